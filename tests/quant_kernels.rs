//! Quantized weights read natively (Q8_0, Q5_0): the JIT's integer GEMV
//! against exact arithmetic, and the fast engine with the default model's
//! own types against the reference.
//!
//! The tolerance comes from the one approximation the integer path makes,
//! quantizing the input to 8 bits per 32 values: each input value moves by
//! at most half a step, `d_x / 2` with `d_x = max|x_block| / 127`, so an
//! output row moves by at most `sum_blocks d_x / 2 * sum |w|` over the
//! block. The tests check every row against that bound computed for it,
//! plus f32 rounding.

mod common;

use common::*;
use half::f16;
use pulsar::engine::fast::{EXACT_STEP_MAX_TOKENS, FastEngine, FastOptions};
use pulsar::engine::jit_kernels::JitKernels;
use pulsar::engine::kernels::{MatKernels, SharedOut, gemm_q8_portable};
use pulsar::engine::ops;
use pulsar::engine::packed::{PackedMatrix, WeightFormat};
use pulsar::engine::q8_input::{InputPrecision, Q8Input};
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::jit::cpu::{CpuCaps, Isa};
use pulsar::jit::emit::gemm_quant::GemmQuantParams;
use pulsar::jit::emit::gemv_quant::GemvQuantParams;
use pulsar::jit::emit::unpack_quant::UnpackQuantParams;
use pulsar::jit::kernels::{GemmQuant, GemvQuant, KernelSet, UnpackQuant};
use pulsar::jit::plan::KernelKind;
use pulsar::model::dtype::{DType, TensorView};
use pulsar::model::quant_blocks::{self, QuantType};
use pulsar::model::source::ModelSource;

/// A made-up tensor of `q` (GGUF bytes) with quants over the whole range
/// (Q8_0's -128 included) and scales of several sizes.
fn quant_file(q: QuantType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        s >> 8
    };
    let mut out = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32((next() % 1000) as f32 / 1000.0 * 0.05 + 1e-4);
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend((0..q.payload_bytes()).map(|_| (next() % 256) as u8));
    }
    out
}

fn inputs(tokens: usize, k: usize) -> Vec<f32> {
    (0..tokens * k)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0 * (1.0 + (i % 5) as f32))
        .collect()
}

/// Row `r` of `w` times token `t` of `x` in f64, and the bound on how far
/// the 8-bit input may move it.
fn exact_and_bound(w: &PackedMatrix, x: &[f32], r: usize) -> (f64, f64) {
    let mut row = vec![0.0f32; w.cols];
    w.row_f32(r, &mut row);
    let exact = row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let bound = row
        .chunks(32)
        .zip(x.chunks(32))
        .map(|(wb, xb)| {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
            amax / 127.0 / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum();
    (exact, bound)
}

fn packed(q: QuantType, rows: usize, cols: usize, file: &[u8]) -> PackedMatrix {
    let shape = [rows, cols];
    let (dtype, format) = match q {
        QuantType::Q8_0 => (DType::Q8_0, WeightFormat::Q8_0),
        QuantType::Q5_0 => (DType::Q5_0, WeightFormat::Q5_0),
        QuantType::Q4_0 => (DType::Q4_0, WeightFormat::Q4_0),
        QuantType::Q8_0x16 => (DType::Q8_0, WeightFormat::Q8_0x16),
        QuantType::Q5_0x16 => (DType::Q5_0, WeightFormat::Q5_0x16),
        QuantType::Q4Kx16 => (DType::Q4K, WeightFormat::Q4Kx16),
        QuantType::Q6Kx16 => (DType::Q6K, WeightFormat::Q6Kx16),
        QuantType::Q5Kx16 => (DType::Q5K, WeightFormat::Q5Kx16),
    };
    PackedMatrix::convert(
        &TensorView {
            dtype,
            shape: &shape,
            bytes: file,
        },
        format,
    )
}

#[test]
fn the_integer_gemv_stays_within_the_input_rounding_bound() {
    let caps = CpuCaps::detect();
    // Q5_0 and Q4_0 in both forms: one row block per pass and two.
    let forms = [
        (QuantType::Q8_0, false),
        (QuantType::Q5_0, false),
        (QuantType::Q5_0, true),
        (QuantType::Q4_0, false),
        (QuantType::Q4_0, true),
    ];
    for (q, two_blocks, rows, k) in forms.into_iter().flat_map(|(q, two)| {
        [(37, 640), (8, 32), (13, 96), (64, 2048)].map(|(r, k)| (q, two, r, k))
    }) {
        let file = quant_file(q, rows, k, (rows * k) as u32);
        let w = packed(q, rows, k, &file);
        assert_eq!(
            w.bytes(),
            rows.next_multiple_of(4) * k / 32 * q.file_block_bytes()
        );
        let x = inputs(1, k);
        let xq = Q8Input::quantize(&x, k);
        let set = KernelSet::from_kinds(
            &[KernelKind::GemvQuant(GemvQuantParams {
                q,
                prefetch: 8192,
                vnni: false,
                two_blocks,
            })],
            &caps,
            Isa::Avx2,
        )
        .expect("emit + verify");
        let kernel = set
            .get::<GemvQuant>((q, k))
            .expect("the kernel is in the set");
        let name = format!("{q:?} two_blocks={two_blocks} {rows}x{k}");
        // All rows at once, and in pieces starting on blocks (an odd
        // number of blocks each for 37 and 8 rows: a lone last block).
        let mut y = vec![0.0f32; rows];
        kernel
            .run_part(w.raw(), xq.token(0), &mut y, 0..rows)
            .unwrap();
        let mut pieces = vec![0.0f32; rows];
        let mid = (rows / 2).next_multiple_of(4).min(rows);
        let (a, b) = pieces.split_at_mut(mid);
        kernel.run_part(w.raw(), xq.token(0), a, 0..mid).unwrap();
        kernel.run_part(w.raw(), xq.token(0), b, mid..rows).unwrap();
        assert_eq!(y, pieces, "{name}: split calls");
        // Rows from the second block on, between canaries: nothing is
        // written outside them.
        if rows > 4 {
            let end = 8 + rows - 4;
            let mut fenced = vec![f32::NAN; end + 8];
            let part = &mut fenced[8..end];
            kernel
                .run_part(w.raw(), xq.token(0), part, 4..rows)
                .unwrap();
            assert_eq!(&fenced[8..end], &y[4..], "{name}: rows 4..");
            assert!(
                fenced[..8].iter().chain(&fenced[end..]).all(|v| v.is_nan()),
                "{name}: wrote outside its rows"
            );
        }

        let mut portable = vec![0.0f32; rows];
        // SAFETY: one thread owns all of `portable`.
        unsafe { gemm_q8_portable(&w, &xq, 0..rows, SharedOut::new(&mut portable, rows)) };
        for r in 0..rows {
            let (exact, bound) = exact_and_bound(&w, &x, r);
            let slack = 1e-5 * (exact.abs() + bound) + 1e-6;
            assert!(
                (y[r] as f64 - exact).abs() <= bound + slack,
                "{name} row {r}: jit {} exact {exact} bound {bound}",
                y[r]
            );
            // Same integers and scales; only the order of the f32 sums differs.
            assert!(
                (y[r] - portable[r]).abs() <= 1e-5 * (portable[r].abs() + 1.0),
                "{name} row {r}: jit {} portable {}",
                y[r],
                portable[r]
            );
        }
    }
}

/// The integer GEMM over unpacked Q5_0 and Q4_0 panels (16-row blocks),
/// with AVX2 (their own offset) and with VNNI where this CPU has it (Q8_0's
/// offset), against the GEMV one token at a time: bit-identical (the same
/// integer group sums, scaled and added in the same order), for partial
/// tiles, partial row blocks and row ranges starting inside the matrix.
/// (Q8_0's own GEMM: the_16_row_gemm_equals_the_gemv_bit_for_bit.)
#[test]
fn the_integer_gemm_equals_the_gemv_bit_for_bit() {
    let caps = CpuCaps::detect();
    let mut forms = vec![false];
    if caps.avx512_vnni && caps.has_avx512() {
        forms.push(true);
    } else {
        println!("this CPU has no AVX-512 VNNI: only the AVX2 GEMM is checked");
    }
    for vnni in forms {
        let max_isa = if vnni { Isa::Avx512 } else { Isa::Avx2 };
        // The GEMV in both forms (one row block per pass and two).
        for (q, two_blocks, rows, k) in [QuantType::Q5_0, QuantType::Q4_0]
            .iter()
            .flat_map(|&q| [(q, false), (q, true)])
            .flat_map(|(q, two)| {
                [(37, 640), (8, 32), (13, 96), (64, 2048)].map(|(r, k)| (q, two, r, k))
            })
        {
            let file = quant_file(q, rows, k, (rows * k + 7) as u32);
            let w = packed(q, rows, k, &file);
            let into = if vnni { QuantType::Q8_0x16 } else { q };
            let kinds = [
                KernelKind::GemvQuant(GemvQuantParams {
                    q,
                    prefetch: 8192,
                    vnni: false,
                    two_blocks,
                }),
                KernelKind::GemmQuant(GemmQuantParams {
                    q: into,
                    vnni,
                    prefetch: 8192,
                    l2_prefetch: if vnni { 32768 } else { 0 },
                }),
                KernelKind::UnpackQuant(UnpackQuantParams {
                    q,
                    into,
                    prefetch: 8192,
                }),
            ];
            let set = KernelSet::from_kinds(&kinds, &caps, max_isa).expect("emit + verify");
            let gemv = set.get::<GemvQuant>((q, k)).unwrap();
            let gemm = set.get::<GemmQuant>((into, k)).unwrap();
            // The rows in two parts, the second starting on a block inside
            // the matrix (when there is one), as the engine's panels and
            // threads split them.
            let mid = Some((rows / 2).next_multiple_of(16))
                .filter(|&m| m < rows)
                .unwrap_or(0);
            let unpack = set.get::<UnpackQuant>((q, k)).unwrap();
            let mut layout = vec![0xAAu8; unpack.out_bytes(0..rows)];
            let (first, second) = layout.split_at_mut(unpack.out_bytes(0..mid));
            unpack.run(w.raw(), 0..mid, first).unwrap();
            unpack.run(w.raw(), mid..rows, second).unwrap();
            if into.is_q8_0() {
                // Exactly Q8_0x16 row blocks of the same values.
                let (mut a, mut b) = (vec![0.0f32; k], vec![0.0f32; k]);
                for r in 0..rows {
                    quant_blocks::dequant_row(q, w.raw(), r, k, &mut a);
                    quant_blocks::dequant_row(into, &layout, r, k, &mut b);
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{q:?} {rows}x{k}: row {r} unpacks to other values"
                    );
                }
            }
            // Refused: a start inside a block, too small an output.
            assert!(unpack.run(w.raw(), 2..rows, &mut layout).is_err());
            assert!(unpack.run(w.raw(), 0..rows, &mut layout[1..]).is_err());
            // A lone token too: with AVX2 it rides a pass of 2 with the
            // tile's zeros and is stored alone.
            for tokens in [1, 2, 5, 8, 9, 11] {
                let x = inputs(tokens, k);
                let xq = Q8Input::quantize(&x, k);
                let mut want = vec![0.0f32; tokens * rows];
                for (t, y) in want.chunks_exact_mut(rows).enumerate() {
                    gemv.run_part(w.raw(), xq.token(t), y, 0..rows).unwrap();
                }
                // The rows in two calls, the second starting on a block
                // inside the matrix, and y wider than the rows (ldy).
                let ldy = rows + 3;
                let mut got = vec![f32::NAN; tokens * ldy];
                for i in 0..xq.tile_count() {
                    let (tile, ntok) = xq.tile(i);
                    let y = &mut got[i * 8 * ldy..];
                    gemm.run(&layout, tile, ntok, y, ldy, 0..mid).unwrap();
                    gemm.run(&layout, tile, ntok, y, ldy, mid..rows).unwrap();
                }
                for t in 0..tokens {
                    let (g, e) = (&got[t * ldy..][..rows], &want[t * rows..][..rows]);
                    assert!(
                        g.iter().zip(e).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{q:?} vnni={vnni} two_blocks={two_blocks} {rows}x{k} token {t} of {tokens}:\n gemm {g:?}\n gemv {e:?}"
                    );
                    assert!(
                        got[t * ldy + rows..(t * ldy + ldy).min(got.len())]
                            .iter()
                            .all(|v| v.is_nan()),
                        "{q:?} vnni={vnni}: wrote past the rows of token {t}"
                    );
                }
                assert!(
                    got[tokens * ldy..].iter().all(|v| v.is_nan()),
                    "wrote past the last token"
                );
            }
            // Arguments that do not fit are refused.
            let xq = Q8Input::quantize(&inputs(3, k), k);
            let (tile, _) = xq.tile(0);
            let mut y = vec![0.0f32; 3 * rows];
            assert!(gemm.run(&layout, tile, 4, &mut y, rows, 0..rows).is_err());
            assert!(
                gemm.run(&layout, &tile[1..], 3, &mut y, rows, 0..rows)
                    .is_err()
            );
            assert!(gemm.run(&layout, tile, 3, &mut y, rows, 2..rows).is_err());
            assert!(gemm.run(&layout, tile, 0, &mut y, rows, 0..rows).is_err());
            let short = &layout[..layout.len() - 1];
            assert!(gemm.run(short, tile, 3, &mut y, rows, 0..rows).is_err());
        }
    }
}

/// The GEMM over Q8_0's 16-row blocks (AVX2, and VNNI where this CPU has
/// it), which also takes single tokens, against the GEMV of Q8_0's 4-row
/// blocks one token at a time: bit-identical for 1 to 11 tokens (full and
/// partial passes, a second tile), partial blocks (one of fewer than 8
/// rows among them) and a row range starting inside the matrix; arguments
/// that do not fit are refused.
#[test]
fn the_16_row_gemm_equals_the_gemv_bit_for_bit() {
    let caps = CpuCaps::detect();
    // (the GEMV's 4-row type, the GEMM's 16-row layout, with VNNI)
    let mut forms = vec![(QuantType::Q8_0, QuantType::Q8_0x16, false)];
    if caps.avx512_vnni && caps.has_avx512() {
        forms.push((QuantType::Q8_0, QuantType::Q8_0x16, true));
        forms.push((QuantType::Q5_0, QuantType::Q5_0x16, true));
    } else {
        println!("this CPU has no AVX-512 VNNI: only the AVX2 form is checked (Q5_0x16 has none)");
    }
    for ((q4, q16, vnni), (rows, k)) in forms.into_iter().flat_map(|form| {
        [
            (37, 640),
            (16, 32),
            (13, 96),
            (64, 2048),
            (48, 640),
            (21, 64),
        ]
        .map(|s| (form, s))
    }) {
        let file = quant_file(q4, rows, k, (rows * k + 11) as u32);
        // Each conversion from its own copy: a conversion releases the
        // source's pages as it goes.
        let w4 = packed(q4, rows, k, &file.clone());
        let w16 = packed(q16, rows, k, &file);
        assert_eq!(
            w16.bytes(),
            rows.next_multiple_of(16) * k / 32 * q4.file_block_bytes()
        );
        let kinds = [
            KernelKind::GemvQuant(GemvQuantParams {
                q: q4,
                prefetch: 8192,
                vnni: vnni && q4 == QuantType::Q8_0,
                two_blocks: false,
            }),
            KernelKind::GemmQuant(GemmQuantParams {
                q: q16,
                vnni,
                prefetch: 8192,
                l2_prefetch: if vnni { 32768 } else { 0 },
            }),
        ];
        let max_isa = if vnni { Isa::Avx512 } else { Isa::Avx2 };
        let set = KernelSet::from_kinds(&kinds, &caps, max_isa).expect("emit + verify");
        let gemv = set.get::<GemvQuant>((q4, k)).unwrap();
        let gemm = set.get::<GemmQuant>((q16, k)).unwrap();
        // The second part starts on a 16-row block inside the matrix, when
        // there is one.
        let mid = Some((rows / 2).next_multiple_of(16))
            .filter(|&m| m < rows)
            .unwrap_or(0);
        for tokens in [1, 2, 3, 4, 5, 8, 11] {
            let x = inputs(tokens, k);
            let xq = Q8Input::quantize(&x, k);
            let mut want = vec![0.0f32; tokens * rows];
            for (t, y) in want.chunks_exact_mut(rows).enumerate() {
                gemv.run_part(w4.raw(), xq.token(t), y, 0..rows).unwrap();
            }
            let ldy = rows + 3;
            let mut got = vec![f32::NAN; tokens * ldy];
            for i in 0..xq.tile_count() {
                let (tile, ntok) = xq.tile(i);
                let y = &mut got[i * 8 * ldy..];
                gemm.run(w16.raw(), tile, ntok, y, ldy, 0..mid).unwrap();
                gemm.run(w16.raw(), tile, ntok, y, ldy, mid..rows).unwrap();
            }
            for t in 0..tokens {
                let (g, e) = (&got[t * ldy..][..rows], &want[t * rows..][..rows]);
                assert!(
                    g.iter().zip(e).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} vnni={vnni} {rows}x{k} token {t} of {tokens}:\n gemm {g:?}\n gemv {e:?}",
                    q16.name()
                );
                assert!(
                    got[t * ldy + rows..(t * ldy + ldy).min(got.len())]
                        .iter()
                        .all(|v| v.is_nan()),
                    "{rows}x{k}: wrote past the rows of token {t}"
                );
            }
        }
        // Refused: a start inside a 16-row block, too short a W, a token
        // count over the tile's.
        let xq = Q8Input::quantize(&inputs(3, k), k);
        let (tile, _) = xq.tile(0);
        let mut y = vec![0.0f32; 3 * rows];
        if rows > 4 {
            assert!(gemm.run(w16.raw(), tile, 3, &mut y, rows, 4..rows).is_err());
        }
        let short = &w16.raw()[..w16.raw().len() - 1];
        assert!(gemm.run(short, tile, 3, &mut y, rows, 0..rows).is_err());
        assert!(gemm.run(w16.raw(), tile, 9, &mut y, rows, 0..rows).is_err());
    }
}

#[test]
fn the_gemv_refuses_arguments_that_do_not_fit() {
    let (q, rows, k) = (QuantType::Q5_0, 8, 64);
    let w = packed(q, rows, k, &quant_file(q, rows, k, 3));
    let xq = Q8Input::quantize(&inputs(1, k), k);
    let set = KernelSet::from_kinds(
        &[KernelKind::GemvQuant(GemvQuantParams {
            q,
            prefetch: 8192,
            vnni: false,
            two_blocks: false,
        })],
        &CpuCaps::detect(),
        Isa::Avx2,
    )
    .unwrap();
    let kernel = set.get::<GemvQuant>((q, k)).unwrap();
    let mut y = vec![0.0f32; rows];
    assert!(
        kernel
            .run_part(w.raw(), xq.token(0), &mut y[..4], 2..6)
            .is_err()
    );
    assert!(
        kernel
            .run_part(w.raw(), &xq.token(0)[1..], &mut y, 0..rows)
            .is_err()
    );
    let mut long = vec![0.0f32; 12];
    assert!(
        kernel
            .run_part(w.raw(), xq.token(0), &mut long, 0..12)
            .is_err()
    );
    // A K that is not whole blocks of 32 gets no kernel handle.
    assert!(set.get::<GemvQuant>((q, 40)).is_none());
}

/// The default model, the oracle's prompt a and the reference logits of
/// its last position.
fn default_model_and_prompt_a() -> (std::sync::Arc<ModelSource>, Vec<u32>, Vec<f32>) {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = std::sync::Arc::new(ModelSource::open(&path).unwrap());
    let meta = read_json(&oracle_dir().join("gemma3-270m/prompt_a.json"));
    let input = ids(&meta["input_ids"]);
    let expected = read_f32(&oracle_dir().join("gemma3-270m/final_logits_a_f32.bin"));
    (src, input, expected)
}

#[test]
fn the_default_model_in_its_own_types_tracks_the_reference() {
    let (src, input, expected) = default_model_and_prompt_a();
    let mut all_rows = Vec::new();
    let mut logits_of = |native: bool| {
        let opts = options(native);
        let formats = FastEngine::weight_formats(&src, &opts).unwrap();
        assert_eq!(
            formats.head.quant().is_some_and(QuantType::is_q8_0),
            native,
            "the default model's embedding is Q8_0 (in either layout)"
        );
        if native {
            assert!(
                formats.describe().contains("q5_0"),
                "{}",
                formats.describe()
            );
        }
        let mut engine = jit_engine(&src, &opts);
        let bytes = engine.bytes_per_token();
        let last = engine.forward(&input, LogitsWanted::Last).unwrap();
        engine.truncate(0);
        // Long enough for the bulk path (GEMMs) on every position but the
        // last, whose logits are computed as a decode step's.
        let long: Vec<u32> = input
            .iter()
            .cycle()
            .take(3 * input.len())
            .copied()
            .collect();
        assert!(long.len() > EXACT_STEP_MAX_TOKENS);
        let all = engine.forward(&long, LogitsWanted::All).unwrap();
        all_rows.push(all[..all.len() - src.config.vocab_size].to_vec());
        (last, bytes)
    };
    let (native, native_bytes) = logits_of(true);
    let (widened, widened_bytes) = logits_of(false);
    // The head alone is 335.5 MB as FP16 and 178.3 MB as Q8_0; the Q5_0
    // and Q8_0 layer matrices shrink to about a third.
    println!("bytes per token: native {native_bytes}, widened {widened_bytes}");
    assert!(
        widened_bytes - native_bytes > 262_144 * 640 * 2 - 262_144 * 640 / 32 * 34,
        "{native_bytes} against {widened_bytes}"
    );
    assert!(
        native_bytes * 10 < widened_bytes * 6,
        "{native_bytes} against {widened_bytes}"
    );
    // Bulk positions: the native run's go through the integer GEMM (every
    // layer's inputs rounded to 8 bits, as a decode step's are), the FP16
    // run's through the FP16 GEMM. At the last position the 8-bit path's
    // distance to the reference is 0.59-0.77 (checked below against its
    // derived bound); over every position of this prompt the two runs
    // must stay within twice that, and pick the same top token wherever
    // the FP16 run's lead over its runner-up is clear of it.
    let (d, _) = max_abs_diff(&all_rows[0], &all_rows[1]);
    assert!(d < 1.6, "native against FP16 rows of every position: {d}");
    let vocab = src.config.vocab_size;
    let mut clear = 0;
    for (n, w) in all_rows[0]
        .chunks_exact(vocab)
        .zip(all_rows[1].chunks_exact(vocab))
    {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 2.0 * d {
            clear += 1;
            assert_eq!(
                ops::argmax(n),
                ops::argmax(w),
                "top token of a position with a clear lead"
            );
        }
    }
    assert!(clear > 0, "no position had a clear lead");

    // The head's integer GEMV on the reference's final hidden state (8-bit
    // input, the file's weights) against exact arithmetic: each row within
    // its 8-bit bound. The integer GEMM of the same input, as the second of
    // two tokens, gives the same row bit for bit.
    let mut reference = ReferenceEngine::load(&src).unwrap();
    let (_, trace) = reference.forward_traced(&input).unwrap();
    let hidden = trace.last().and_then(|t| t.last()).expect("final hidden");
    let formats = FastEngine::weight_formats(&src, &options(true)).unwrap();
    let mut head = packed_head(&src, formats.head.quant().expect("a quantized head"));
    let kernels = JitKernels::build(&src.config, formats, 1).unwrap();
    head.set_kernels(kernels.resolve(&head).expect("the plan covers the head"));
    let (mut gemv, mut gemm) = (vec![0.0f32; vocab], vec![0.0f32; 2 * vocab]);
    let two: Vec<f32> = hidden.iter().rev().chain(hidden).copied().collect();
    // SAFETY: one thread owns every row of both outputs.
    unsafe {
        let xq = Q8Input::quantize(hidden, head.cols);
        kernels.gemm_q8(&head, &xq, 0..vocab, SharedOut::new(&mut gemv, vocab));
        let xq = Q8Input::quantize(&two, head.cols);
        kernels.gemm_q8(&head, &xq, 0..vocab, SharedOut::new(&mut gemm, vocab));
    }
    assert!(
        gemv.iter()
            .zip(&gemm[vocab..])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the head's GEMM differs from its GEMV"
    );
    let mut row = vec![0.0f32; head.cols];
    let mut worst = 0.0f64;
    for (r, &got) in gemv.iter().enumerate() {
        head.row_f32(r, &mut row);
        let rounding_8bit: f64 = row
            .chunks(32)
            .zip(hidden.chunks(32))
            .map(|(wb, hb)| {
                let amax = hb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                amax / 127.0 / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
            })
            .sum();
        let exact: f64 = row
            .iter()
            .zip(hidden)
            .map(|(&w, &h)| w as f64 * h as f64)
            .sum();
        let bound = rounding_8bit;
        let diff = (got as f64 - exact).abs();
        let slack = 1e-5 * got.abs() as f64 + 1e-4;
        assert!(
            diff <= bound + slack,
            "row {r}: GEMV {got} exact {exact} bound {bound}"
        );
        worst = worst.max(diff / bound.max(1e-9));
    }
    let (d_native, _) = max_abs_diff(&native, &expected);
    let (d_widened, _) = max_abs_diff(&widened, &expected);
    println!(
        "max |logit - reference|: q8_0 head {d_native}, f16 head {d_widened}; \
         largest share of its bound a row used: {worst:.3}"
    );
    let top = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    assert_eq!(top(&native), top(&expected));
}

/// `--input-bits 16` on the default model: the engine's logits for prompt
/// a against the reference's (f32 inputs, the file's weights dequantized),
/// next to one 8-bit level's. The second level shrinks each input's
/// rounding at least 254-fold (`q8_input`'s tests), so what stays is the
/// rest of the integer path's distance: Q4_K kept as Q5_0 with offsets
/// and Q6_K as Q8_0 (`types_without_a_kernel_become_the_nearest_that_has_one`)
/// and f32 summation order.
#[test]
fn two_input_levels_bring_the_integer_path_to_the_reference() {
    let (src, input, expected) = default_model_and_prompt_a();
    let mut engine = jit_engine(&src, &options(true));
    assert_eq!(engine.input_precision(), InputPrecision::Bits8);
    let one = engine.forward(&input, LogitsWanted::Last).unwrap();
    engine.truncate(0);
    engine.set_input_precision(InputPrecision::TwoLevels);
    let two = engine.forward(&input, LogitsWanted::Last).unwrap();
    let (d_one, _) = max_abs_diff(&one, &expected);
    let (d_two, _) = max_abs_diff(&two, &expected);
    println!("max |logit - reference|: one level {d_one}, two levels {d_two}");
    // Measured: 0.646 with one level, 0.134 with two. Input rounding is
    // most of one level's distance; a second level that went missing, or
    // was added with the wrong sign or scale, leaves it there or grows it.
    assert!(
        d_two < d_one / 3.0,
        "two levels {d_two} against one level's {d_one}"
    );
    assert_eq!(ops::argmax(&two), ops::argmax(&expected));
}

/// The default model's tied embedding (Q8_0 in the file) in `q`, one of
/// Q8_0's layouts.
fn packed_head(src: &ModelSource, q: QuantType) -> PackedMatrix {
    let c = &src.config;
    let t = src
        .tensor(
            pulsar::model::source::Role::Embedding,
            &[c.vocab_size, c.hidden],
        )
        .unwrap();
    packed(q, c.vocab_size, c.hidden, t.bytes)
}

/// Teacher-forced decode of the reference's greedy chain for prompt a in
/// the file's own types and widened to FP16. The native run's logits move
/// by the 8-bit inputs of every integer GEMV (18 layers and the head), by
/// the Q6_K matrices requantized to Q8_0 and by the FP16 scales of the
/// Q4_K ones kept as Q5_0: measured here up to 0.65 for some of the
/// 262,144 logits of a step with Q4_K requantized to Q8_0 too, 0.82 in a
/// run after (0.41 before any requantization), but the top two move
/// together, so the chain is kept
/// wherever the reference's margin is clear: at least `CLEAR_MARGIN` (25
/// of the 32 steps; all 32 were kept in the last runs, misses seen earlier
/// were at margins of 0.014 and 0.093).
#[test]
fn decoding_in_the_files_types_follows_the_reference_chain() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = std::sync::Arc::new(ModelSource::open(&path).unwrap());
    let meta = read_json(&oracle_dir().join("gemma3-270m/prompt_a.json"));
    let input = ids(&meta["input_ids"]);
    let chain = ids(&meta["greedy_ids"]);
    let steps = meta["greedy_steps"].as_array().expect("greedy_steps");
    let run = |native: bool| -> Vec<Vec<f32>> {
        let opts = options(native);
        let mut engine = jit_engine(&src, &opts);
        let mut rows = vec![engine.forward(&input, LogitsWanted::Last).unwrap()];
        for &t in &chain[..chain.len() - 1] {
            rows.push(engine.forward(&[t], LogitsWanted::Last).unwrap());
        }
        rows
    };
    let native = run(true);
    let widened = run(false);
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap()
    };
    let mut worst = 0.0f32;
    for (i, ((n, w), step)) in native.iter().zip(&widened).zip(steps).enumerate() {
        let (d, _) = max_abs_diff(n, w);
        worst = worst.max(d);
        let margin = step["margin_to_2nd"].as_f64().unwrap();
        println!(
            "step {i}: max |native - f16| {d:.4}, reference margin {margin:.3}, native {} want {}",
            argmax(n),
            chain[i]
        );
        if margin >= CLEAR_MARGIN {
            assert_eq!(argmax(n), chain[i], "step {i}, reference margin {margin}");
        }
    }
    println!("largest logit difference {worst}");
    assert!(worst < 1.0, "native logits moved by {worst}");
}

/// A reference margin this large is kept by the native run (see above).
const CLEAR_MARGIN: f64 = 0.25;

/// Types no kernel reads yet become the nearest that has one, said on
/// stderr with the size change: Q6_K Q8_0, each value within half a Q8_0
/// step of its block; Q4_K Q5_0 with an offset per 32 values, within that
/// too and much closer (`model::k_quant_as_q5_0` bounds it by the FP16
/// rounding of each scale): its squared error over the rows checked is
/// under a sixteenth of requantizing the same rows to Q8_0.
#[test]
fn types_without_a_kernel_become_the_nearest_that_has_one() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = ModelSource::open(&path).unwrap();
    let opts = options(true);
    let formats = FastEngine::weight_formats(&src, &opts).unwrap();
    let note = formats
        .conversion_note()
        .expect("the default model has Q4_K and Q6_K");
    // Q6_K is converted on every CPU (its family does not fit the plan
    // beside the model's others); Q4_K where the plan has room for only
    // one K-quant family with Q5_0's (VNNI's larger kernels), not under
    // AVX2 (`PULSAR_MAX_ISA=avx2`), whose Q4_K kernel fits.
    let q4_k_converted = formats.converted.iter().any(|c| c.from == DType::Q4K);
    let layouts = pulsar::engine::jit_kernels::quant_layouts();
    assert_eq!(q4_k_converted, layouts.q5_0 == QuantType::Q5_0x16, "{note}");
    // In a few words for the "loaded" line: the types and the growth.
    let grown: usize = formats
        .converted
        .iter()
        .map(|c| c.bytes - c.file_bytes)
        .sum();
    let types = if q4_k_converted {
        "Q4_K and Q6_K"
    } else {
        "Q6_K"
    };
    assert_eq!(
        formats.conversion_brief(),
        Some(format!("{types} converted, +{:.1} MB", grown as f64 / 1e6))
    );
    let mut needles = vec!["ffn_down x9 Q6_K to q8_0"];
    if q4_k_converted {
        needles.extend([
            "attn_output x18 Q4_K to q5_0 with an offset per 32",
            "ffn_down x9 Q4_K to q5_0 with an offset per 32",
        ]);
    }
    for needle in needles {
        assert!(note.contains(needle), "{note}");
    }
    let c = &src.config;
    let mut seen = Vec::new();
    for layer in 0..c.n_layers() {
        let role =
            pulsar::model::source::Role::Layer(layer, pulsar::model::source::LayerRole::Down);
        let t = src.tensor(role, &[c.hidden, c.intermediate]).unwrap();
        if seen.contains(&t.dtype) {
            continue;
        }
        seen.push(t.dtype);
        // The conversion is checked whether or not this CPU's choice makes
        // it (Q4_K kept under AVX2 is still Q4_K's conversion elsewhere).
        let (format, kept) = match t.dtype {
            DType::Q4K => (WeightFormat::of_quant(layouts.q5_0), !q4_k_converted),
            DType::Q6K => (WeightFormat::of_quant(layouts.q8_0), false),
            other => panic!("ffn_down of layer {layer} is {other}"),
        };
        let chosen = if kept { WeightFormat::Q4Kx16 } else { format };
        assert_eq!(formats.of(role), chosen, "layer {layer} {}", t.dtype);
        let w = PackedMatrix::convert(&t, format);
        assert_eq!(w.offsets().is_some(), t.dtype == DType::Q4K);
        let as_q8_0 = PackedMatrix::convert(&t, WeightFormat::Q8_0);
        let mut exact = vec![0.0f32; c.intermediate];
        let (mut got, mut q8) = (exact.clone(), exact.clone());
        let (mut err, mut q8_err) = (0.0f64, 0.0f64);
        for r in (0..c.hidden).step_by(37) {
            pulsar::model::dequant::row_into(&t, r, &mut exact);
            w.row_f32(r, &mut got);
            as_q8_0.row_f32(r, &mut q8);
            for (b, (e, g)) in exact.chunks(32).zip(got.chunks(32)).enumerate() {
                let amax = e.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // Half a step of d = amax / 127, plus d's own f16 rounding
                // (2^-11 relative) over up to 127 steps.
                let bound = amax / 254.0 + amax / 2048.0 + 1e-7;
                for (x, y) in e.iter().zip(g) {
                    assert!(
                        (x - y).abs() <= bound,
                        "layer {layer} {} row {r} block {b}: {x} -> {y}",
                        t.dtype
                    );
                }
            }
            let squared = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum()
            };
            err += squared(&exact, &got);
            q8_err += squared(&exact, &q8);
        }
        println!("{}: squared error {err:e}, as Q8_0 {q8_err:e}", t.dtype);
        if t.dtype == DType::Q4K {
            assert!(err * 16.0 < q8_err, "{err} against Q8_0's {q8_err}");
        }
    }
    assert_eq!(seen.len(), 2, "both types checked: {seen:?}");
}

/// `--dtype q8_0`: every matrix whose rows are whole blocks is quantized
/// to Q8_0 at load (the default model's Q5_0 ones requantized from their
/// exact values), read by the integer kernels, and the logits stay as
/// close to the reference as the file's own types give.
#[test]
fn every_matrix_quantized_to_q8_0_at_load_tracks_the_reference() {
    let (src, input, expected) = default_model_and_prompt_a();
    let q8 = FastOptions {
        format: Some(WeightFormat::Q8_0),
        native: false,
        ..options(false)
    };
    let formats = FastEngine::weight_formats(&src, &q8).unwrap();
    // Q8_0 in the layout this CPU's kernels read.
    assert!(formats.head.quant().is_some_and(QuantType::is_q8_0));
    let layers = format!("{} (126 of 126 layer matrices)", formats.head.name());
    assert!(
        formats.describe().ends_with(&layers),
        "{}",
        formats.describe()
    );
    let q8_logits = jit_engine(&src, &q8)
        .forward(&input, LogitsWanted::Last)
        .unwrap();
    let native_logits = jit_engine(&src, &options(true))
        .forward(&input, LogitsWanted::Last)
        .unwrap();
    let (d_q8, _) = max_abs_diff(&q8_logits, &expected);
    let (d_native, _) = max_abs_diff(&native_logits, &expected);
    println!("max |logit - reference|: q8_0 everywhere {d_q8}, the file's types {d_native}");
    assert!(d_q8 <= 2.0 * d_native + 0.1, "{d_q8} against {d_native}");
    let top = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    assert_eq!(top(&q8_logits), top(&expected));
}

/// `--dtype q8_0|q4_0` on a shape without a file: the plan reads every
/// matrix with that type's integer GEMV (gemma-2b's ffn_down at K 16384
/// included) within the byte budget, and `bench` runs a shape on random
/// weights quantized to it.
#[test]
fn a_shape_runs_quantized_to_q8_0_or_q4_0() {
    let pulsar = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pulsar"))
            .args(args)
            .output()
            .expect("binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    for dtype in ["q8_0", "q4_0"] {
        let plan = pulsar(&[
            "tune",
            "--shape",
            "gemma-2b",
            "--dtype",
            dtype,
            "--threads",
            "2",
        ]);
        // The one-token kernel: Q8_0's in 16-row blocks with VNNI is a GEMM
        // (it takes single tokens), every other type's a GEMV.
        let format = match dtype {
            "q8_0" => WeightFormat::of_quant(pulsar::engine::jit_kernels::quant_layouts().q8_0),
            _ => WeightFormat::Q4_0,
        };
        let kernel = match format {
            WeightFormat::Q8_0x16 => "gemm_q8_0x16".to_string(),
            _ => format!("gemv_{dtype}"),
        };
        let gemv = plan
            .lines()
            .find(|l| l.trim_start().starts_with(&kernel))
            .unwrap_or_else(|| panic!("no {kernel} planned:\n{plan}"));
        assert!(
            gemv.contains("ffn_down (K 16384)") && gemv.contains("output(lm_head) (K 2048)"),
            "{gemv}"
        );
        assert!(plan.contains("of 5120 B"), "{plan}");
        let bench = pulsar(&[
            "bench",
            "--shape",
            "gemma3-270m",
            "--dtype",
            dtype,
            "--pp",
            "8",
            "--tg",
            "4",
        ]);
        let name = format.name();
        let described = format!("{name} LM head + {name} (126 of 126 layer matrices)");
        assert!(bench.contains(&described), "{bench}");
    }
}

/// The fast engine's options for the default model in these tests: 2
/// threads, the file's own types or every matrix widened.
fn options(native: bool) -> FastOptions {
    FastOptions {
        threads: 2,
        context: 64,
        format: None,
        prefill_chunk: 126,
        in_place: false,
        native,
    }
}

/// The fast engine on the JIT's kernels for `opts`.
fn jit_engine(src: &std::sync::Arc<ModelSource>, opts: &FastOptions) -> FastEngine {
    let formats = FastEngine::weight_formats(src, opts).unwrap();
    let kernels = Box::new(JitKernels::build(&src.config, formats, 2).unwrap());
    FastEngine::load(src, kernels, opts).unwrap()
}

/// Kernels planned for other formats than the weights' are refused at
/// load, naming the matrix, instead of falling back on every call.
#[test]
fn kernels_planned_for_other_formats_are_a_load_error() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = std::sync::Arc::new(ModelSource::open(&path).unwrap());
    // Planned for FP16 everywhere, loaded in the file's own types.
    let kernels = Box::new(
        JitKernels::build(
            &src.config,
            pulsar::engine::fast::WeightFormats::uniform(WeightFormat::F16),
            2,
        )
        .unwrap(),
    );
    let err = FastEngine::load(&src, kernels, &options(true))
        .err()
        .expect("a plan without the quantized GEMVs is refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("output(lm_head)") && msg.contains("no GEMV for q8_0"),
        "{msg}"
    );
}
