//! Q4_K, Q5_K and Q6_K read at the file's own bits (`model::k_quant_x16`,
//! `jit::emit::gemm_kquant`): the JIT's GEMM, AVX2 and VNNI, against the
//! plain-Rust product of the same arithmetic bit for bit, and that product
//! against the exact one within the bound of the input's 8-bit rounding.

mod common;

use common::k_quant_file;
use pulsar::engine::kernels::{SharedOut, gemm_kquant_portable};
use pulsar::engine::packed::{PackedMatrix, WeightFormat};
use pulsar::engine::q8_input::{InputPrecision, Q8Input};
use pulsar::jit::cpu::{CpuCaps, Isa};
use pulsar::jit::emit::gemm_quant::{GemmQuantParams, ScaleSpan};
use pulsar::jit::kernels::{GemmQuant, KernelSet};
use pulsar::jit::plan::KernelKind;
use pulsar::model::dtype::TensorView;
use pulsar::model::quant_blocks::QuantType;

fn inputs(tokens: usize, k: usize) -> Vec<f32> {
    (0..tokens * k)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0 * (1.0 + (i % 5) as f32))
        .collect()
}

fn packed(q: QuantType, rows: usize, cols: usize, file: &[u8]) -> PackedMatrix {
    let shape = [rows, cols];
    let dtype = q.file_dtype();
    PackedMatrix::convert(
        &TensorView {
            dtype,
            shape: &shape,
            bytes: file,
        },
        WeightFormat::of_quant(q),
    )
}

/// The plain-Rust product of every row and token.
fn portable(w: &PackedMatrix, xq: &Q8Input) -> Vec<f32> {
    let mut y = vec![0.0f32; xq.tokens() * w.rows];
    // SAFETY: this thread alone writes y.
    unsafe { gemm_kquant_portable(w, xq, 0..w.rows, SharedOut::new(&mut y, w.rows)) };
    y
}

#[test]
fn the_k_quant_layouts_keep_the_files_bits() {
    for (q, file_bytes, layout_bytes) in [
        (QuantType::Q4Kx16, 144, 148),
        (QuantType::Q5Kx16, 176, 180),
        (QuantType::Q6Kx16, 210, 210),
    ] {
        let (rows, k) = (37, 768);
        let file = k_quant_file(q, rows, k, 5);
        assert_eq!(file.len(), rows * k / 256 * file_bytes);
        let w = packed(q, rows, k, &file);
        // 16-row blocks: the padding rows of the last block, and Q4_K's
        // and Q5_K's 4 bytes per super-block of unpacked scales (2.8%,
        // 2.3%).
        assert_eq!(w.bytes(), 48 * k / 256 * layout_bytes, "{}", q.name());
    }
}

/// Both ways of scaling the input: a scale per group of 32 (AVX2) and per
/// super-block of 256 (VNNI, whose Q4_K and Q5_K sums are scaled in
/// integers).
#[test]
fn the_portable_product_stays_within_the_input_rounding_bound() {
    let forms = [QuantType::Q4Kx16, QuantType::Q5Kx16, QuantType::Q6Kx16]
        .into_iter()
        .flat_map(|q| [(q, ScaleSpan::Group), (q, ScaleSpan::SuperBlock)]);
    for (q, span) in forms {
        let (rows, k, tokens) = (21, 512, 3);
        let file = k_quant_file(q, rows, k, 77);
        let w = packed(q, rows, k, &file);
        let x = inputs(tokens, k);
        let xq = Q8Input::quantize_with(&x, k, InputPrecision::Bits8, span);
        let got = portable(&w, &xq);
        let mut row = vec![0.0f32; k];
        for r in 0..rows {
            w.row_f32(r, &mut row);
            for t in 0..tokens {
                let xt = &x[t * k..(t + 1) * k];
                let exact: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                // Each input value moves by at most half its span's step.
                let bound: f64 = row
                    .chunks(span.values())
                    .zip(xt.chunks(span.values()))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                        amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
                    })
                    .sum();
                let g = got[t * rows + r] as f64;
                let slack = 1e-5 * exact.abs().max(1e-3);
                assert!(
                    (g - exact).abs() <= bound + slack,
                    "{} {span:?} row {r} token {t}: {g} against {exact} (bound {bound})",
                    q.name()
                );
            }
        }
    }
}

#[test]
fn the_jit_k_quant_gemm_equals_the_portable_product_bit_for_bit() {
    let caps = CpuCaps::detect();
    let mut forms = vec![false];
    if caps.avx512_vnni && caps.has_avx512() {
        forms.push(true);
    } else {
        println!("this CPU has no AVX-512 VNNI: only the AVX2 form is checked");
    }
    for q in [QuantType::Q4Kx16, QuantType::Q5Kx16, QuantType::Q6Kx16] {
        for &vnni in &forms {
            for (rows, k) in [(37, 768), (16, 256), (13, 512), (64, 2560), (3, 256)] {
                let file = k_quant_file(q, rows, k, (rows * k) as u32 + 3);
                let w = packed(q, rows, k, &file);
                let kinds = [KernelKind::GemmQuant(GemmQuantParams {
                    q,
                    vnni,
                    prefetch: 8192,
                    l2_prefetch: if vnni { 32768 } else { 0 },
                })];
                let max_isa = if vnni { Isa::Avx512 } else { Isa::Avx2 };
                let set = KernelSet::from_kinds(&kinds, &caps, max_isa).expect("emit + verify");
                let gemm = set.get::<GemmQuant>((q, k)).unwrap();
                let mid = Some((rows / 2).next_multiple_of(16))
                    .filter(|&m| m < rows)
                    .unwrap_or(0);
                // 1 and 9: a tile of one token (the one-token tile with VNNI).
                for tokens in [1, 2, 3, 4, 5, 6, 7, 8, 9, 11] {
                    let x = inputs(tokens, k);
                    // Two levels as well: the integer sums' range is the
                    // same, the second level's scale far smaller.
                    let precision = if tokens % 2 == 0 {
                        InputPrecision::TwoLevels
                    } else {
                        InputPrecision::Bits8
                    };
                    let x = &x[..x.len() / precision.levels()];
                    let xq = Q8Input::quantize_with(x, k, precision, gemm.input_span);
                    let want = portable(&w, &xq);
                    let ldy = rows + 3;
                    let mut got = vec![f32::NAN; tokens * ldy];
                    for i in 0..xq.tile_count() {
                        let (tile, ntok) = xq.tile_for(i, gemm.single_token_layout);
                        let y = &mut got[i * 8 * ldy..];
                        gemm.run(w.raw(), tile, ntok, y, ldy, 0..mid).unwrap();
                        gemm.run(w.raw(), tile, ntok, y, ldy, mid..rows).unwrap();
                    }
                    for t in 0..tokens {
                        let (g, e) = (&got[t * ldy..][..rows], &want[t * rows..][..rows]);
                        assert!(
                            g.iter().zip(e).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{} vnni={vnni} {rows}x{k} token {t} of {tokens}:\n jit {g:?}\n portable {e:?}",
                            q.name()
                        );
                        assert!(
                            got[t * ldy + rows..(t * ldy + ldy).min(got.len())]
                                .iter()
                                .all(|v| v.is_nan()),
                            "{rows}x{k}: wrote past the rows of token {t}"
                        );
                    }
                }
                // Refused: a start inside a 16-row block, too short a W.
                let xq = Q8Input::quantize(&inputs(2, k), k);
                let (tile, _) = xq.tile(0);
                let mut y = vec![0.0f32; 2 * rows];
                if rows > 4 {
                    assert!(gemm.run(w.raw(), tile, 2, &mut y, rows, 4..rows).is_err());
                }
                let short = &w.raw()[..w.raw().len() - 1];
                assert!(gemm.run(short, tile, 2, &mut y, rows, 0..rows).is_err());
                // A call of one token takes the one-token tile with VNNI
                // (the 8-token tile of the same token is refused), the
                // 8-token tile under AVX2.
                let xq = Q8Input::quantize(&inputs(1, k), k);
                let (eight, _) = xq.tile(0);
                let (single, _) = xq.tile_for(0, true);
                let (right, wrong) = if vnni {
                    (single, eight)
                } else {
                    (eight, single)
                };
                assert_eq!(gemm.single_token_layout, vnni);
                assert_eq!(gemm.input_span == ScaleSpan::SuperBlock, vnni);
                assert!(gemm.run(w.raw(), right, 1, &mut y, rows, 0..rows).is_ok());
                assert!(gemm.run(w.raw(), wrong, 1, &mut y, rows, 0..rows).is_err());
            }
        }
    }
}
