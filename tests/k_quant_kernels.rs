//! Q4_K and Q6_K read at the file's own bits (`model::k_quant_x16`,
//! `jit::emit::gemm_kquant`): the JIT's GEMM, AVX2 and VNNI, against the
//! plain-Rust product of the same arithmetic bit for bit, and that product
//! against the exact one within the bound of the input's 8-bit rounding.

mod common;

use half::f16;
use pulsar::engine::kernels::{SharedOut, gemm_kquant_portable};
use pulsar::engine::packed::{PackedMatrix, WeightFormat};
use pulsar::engine::q8_input::Q8Input;
use pulsar::jit::cpu::{CpuCaps, Isa};
use pulsar::jit::emit::gemm_quant::GemmQuantParams;
use pulsar::jit::kernels::{GemmQuant, KernelSet};
use pulsar::jit::plan::KernelKind;
use pulsar::model::dtype::{DType, TensorView};
use pulsar::model::quant_blocks::QuantType;

/// A made-up K-quant tensor (GGUF bytes): random quants, scales and mins,
/// super-block scales of weights' size.
fn k_quant_file(q: QuantType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        s >> 8
    };
    let bytes = if q == QuantType::Q4Kx16 { 144 } else { 210 };
    let mut out = vec![0u8; rows * cols / 256 * bytes];
    for block in out.chunks_exact_mut(bytes) {
        block.iter_mut().for_each(|b| *b = next() as u8);
        let mut scale = || f16::from_f32((next() % 1000) as f32 * 2e-6 + 1e-5).to_le_bytes();
        if q == QuantType::Q4Kx16 {
            block[0..2].copy_from_slice(&scale());
            block[2..4].copy_from_slice(&scale());
        } else {
            block[208..210].copy_from_slice(&scale());
        }
    }
    out
}

fn inputs(tokens: usize, k: usize) -> Vec<f32> {
    (0..tokens * k)
        .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0 * (1.0 + (i % 5) as f32))
        .collect()
}

fn packed(q: QuantType, rows: usize, cols: usize, file: &[u8]) -> PackedMatrix {
    let shape = [rows, cols];
    let dtype = if q == QuantType::Q4Kx16 {
        DType::Q4K
    } else {
        DType::Q6K
    };
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
    for (q, file_bytes, layout_bytes) in
        [(QuantType::Q4Kx16, 144, 148), (QuantType::Q6Kx16, 210, 210)]
    {
        let (rows, k) = (37, 768);
        let file = k_quant_file(q, rows, k, 5);
        assert_eq!(file.len(), rows * k / 256 * file_bytes);
        let w = packed(q, rows, k, &file);
        // 16-row blocks: the padding rows of the last block, and Q4_K's 4
        // bytes per super-block of unpacked scales (2.8%).
        assert_eq!(w.bytes(), 48 * k / 256 * layout_bytes, "{}", q.name());
    }
}

#[test]
fn the_portable_product_stays_within_the_input_rounding_bound() {
    for q in [QuantType::Q4Kx16, QuantType::Q6Kx16] {
        let (rows, k, tokens) = (21, 512, 3);
        let file = k_quant_file(q, rows, k, 77);
        let w = packed(q, rows, k, &file);
        let x = inputs(tokens, k);
        let got = portable(&w, &Q8Input::quantize(&x, k));
        let mut row = vec![0.0f32; k];
        for r in 0..rows {
            w.row_f32(r, &mut row);
            for t in 0..tokens {
                let xt = &x[t * k..(t + 1) * k];
                let exact: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                // Each input value moves by at most half its block's step.
                let bound: f64 = row
                    .chunks(32)
                    .zip(xt.chunks(32))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                        amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
                    })
                    .sum();
                let g = got[t * rows + r] as f64;
                let slack = 1e-5 * exact.abs().max(1e-3);
                assert!(
                    (g - exact).abs() <= bound + slack,
                    "{} row {r} token {t}: {g} against {exact} (bound {bound})",
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
    for q in [QuantType::Q4Kx16, QuantType::Q6Kx16] {
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
                for tokens in [1, 2, 3, 5, 8, 11] {
                    let x = inputs(tokens, k);
                    let xq = Q8Input::quantize(&x, k);
                    let want = portable(&w, &xq);
                    let ldy = rows + 3;
                    let mut got = vec![f32::NAN; tokens * ldy];
                    for i in 0..xq.tile_count() {
                        let (tile, ntok) = xq.tile(i);
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
            }
        }
    }
}

/// A Gemma 3 model of random K-quant weights whose every K is a multiple of
/// 256 (hidden 256, 4 heads of 64, FFN 512, 2 layers, vocab 512): the Q/K/V
/// and gate/up matrices Q4_K, attn_output and ffn_down Q6_K, the tied
/// embedding Q6_K, as a Q4_K_M file mixes them.
fn k_quant_model() -> common::ScratchFile {
    use pulsar::model::gguf_write::{GgufWriter, f32_bytes};
    let (hidden, heads, head_dim, ffn, layers, vocab) = (256, 4, 64, 512, 2, 512);
    let mut w = GgufWriter::new();
    let k = |s: &str| format!("gemma3.{s}");
    w.add_str("general.architecture", "gemma3")
        .add_str("general.name", "pulsar k-quant test model")
        .add_u32(&k("context_length"), 256)
        .add_u32(&k("embedding_length"), hidden as u32)
        .add_u32(&k("feed_forward_length"), ffn as u32)
        .add_u32(&k("block_count"), layers as u32)
        .add_u32(&k("attention.head_count"), heads as u32)
        .add_u32(&k("attention.head_count_kv"), 1)
        .add_u32(&k("attention.key_length"), head_dim as u32)
        .add_u32(&k("attention.value_length"), head_dim as u32)
        .add_f32(&k("attention.layer_norm_rms_epsilon"), 1e-6)
        .add_f32(&k("rope.freq_base"), 10_000.0)
        .add_u32(&k("attention.sliding_window"), 64)
        .add_u32("tokenizer.ggml.bos_token_id", 2)
        .add_u32("tokenizer.ggml.eos_token_id", 1);
    let mut seed = 1u32;
    let mut matrix = |w: &mut GgufWriter, name: &str, q: QuantType, rows: usize, cols: usize| {
        seed += 1;
        let dtype = if q == QuantType::Q4Kx16 {
            DType::Q4K
        } else {
            DType::Q6K
        };
        w.add_tensor(
            name,
            &[rows, cols],
            dtype,
            k_quant_file(q, rows, cols, seed),
        )
        .unwrap();
    };
    let norm = |w: &mut GgufWriter, name: &str, len: usize| {
        w.add_tensor(name, &[len], DType::F32, f32_bytes(&vec![1.0; len]))
            .unwrap();
    };
    matrix(
        &mut w,
        "token_embd.weight",
        QuantType::Q6Kx16,
        vocab,
        hidden,
    );
    norm(&mut w, "output_norm.weight", hidden);
    for l in 0..layers {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        for (name, q, rows, cols) in [
            ("attn_q", QuantType::Q4Kx16, heads * head_dim, hidden),
            ("attn_k", QuantType::Q4Kx16, head_dim, hidden),
            ("attn_v", QuantType::Q4Kx16, head_dim, hidden),
            ("attn_output", QuantType::Q6Kx16, hidden, heads * head_dim),
            ("ffn_gate", QuantType::Q4Kx16, ffn, hidden),
            ("ffn_up", QuantType::Q4Kx16, ffn, hidden),
            ("ffn_down", QuantType::Q6Kx16, hidden, ffn),
        ] {
            matrix(&mut w, &b(name), q, rows, cols);
        }
        for name in [
            "attn_norm",
            "post_attention_norm",
            "ffn_norm",
            "post_ffw_norm",
        ] {
            norm(&mut w, &b(name), hidden);
        }
        for name in ["attn_q_norm", "attn_k_norm"] {
            norm(&mut w, &b(name), head_dim);
        }
    }
    let file = common::ScratchFile::new("pulsar-k-quant-model-", "k-quant.gguf");
    w.write(&file).expect("write GGUF");
    file
}

/// The fast engine keeps that model's matrices at the file's bits (no
/// conversion) and its logits follow the reference engine's, which
/// dequantizes the file's super-blocks to f32: through a prefill and
/// decode steps, within what the 8-bit input moves them.
#[test]
fn a_k_quant_model_runs_at_its_own_bits_and_follows_the_reference() {
    use pulsar::engine::fast::{FastEngine, FastOptions};
    use pulsar::engine::jit_kernels::JitKernels;
    use pulsar::engine::reference::ReferenceEngine;
    use pulsar::engine::{Engine, LogitsWanted};
    use pulsar::model::source::ModelSource;
    let file = k_quant_model();
    let src = std::sync::Arc::new(ModelSource::open(&file).unwrap());
    let opts = FastOptions {
        threads: 2,
        context: 64,
        format: None,
        prefill_chunk: 126,
        in_place: false,
        native: true,
    };
    let formats = FastEngine::weight_formats(&src, &opts).unwrap();
    assert!(
        formats.converted.is_empty(),
        "{:?}",
        formats.conversion_note()
    );
    assert_eq!(formats.head, WeightFormat::Q6Kx16);
    assert!(formats.has_k_quants());
    let kernels = Box::new(JitKernels::build(&src.config, formats, 2).unwrap());
    let mut fast = FastEngine::load(&src, kernels, &opts).unwrap();
    let mut reference = ReferenceEngine::load(&src).unwrap();
    let prompt = [2u32, 17, 301, 45, 9, 88];
    let mut steps = vec![(
        fast.forward(&prompt, LogitsWanted::Last).unwrap(),
        reference.forward(&prompt, LogitsWanted::Last).unwrap(),
    )];
    for t in [7u32, 400, 12] {
        steps.push((
            fast.forward(&[t], LogitsWanted::Last).unwrap(),
            reference.forward(&[t], LogitsWanted::Last).unwrap(),
        ));
    }
    for (i, (f, r)) in steps.iter().enumerate() {
        let scale = r.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = f
            .iter()
            .zip(r)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        let dot: f64 = f.iter().zip(r).map(|(&a, &b)| a as f64 * b as f64).sum();
        let norms: f64 = [f, r]
            .iter()
            .map(|v| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt())
            .product();
        println!(
            "step {i}: max |fast - reference| {diff} of {scale}, cosine {}",
            dot / norms
        );
        assert!(scale > 0.1, "step {i}: the logits carry a signal ({scale})");
        assert!(dot / norms > 0.9995, "step {i}: cosine {}", dot / norms);
        assert!(diff < 0.01 * scale, "step {i}: {diff} against {scale}");
    }
}
