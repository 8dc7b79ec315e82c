//! A Gemma 3 model of random Q4_K, Q5_K and Q6_K weights through the fast
//! engine at the file's bits, against the reference engine. Its own test
//! binary: it sets `PULSAR_K_QUANTS=native` so that the kernels run
//! whatever the default choice, and no other test shares its process.

mod common;

use common::k_quant_file;
use pulsar::engine::packed::WeightFormat;
use pulsar::model::dtype::DType;
use pulsar::model::quant_blocks::QuantType;

/// A Gemma 3 model of random K-quant weights whose every K is a multiple of
/// 256 (hidden 256, 4 heads of 64, FFN 512, 2 layers, vocab 512): the Q/K/V
/// matrices Q4_K, gate/up Q5_K, attn_output and ffn_down Q6_K, the tied
/// embedding Q6_K, as Q4_K_M and Q5_K_M files mix them.
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
        let dtype = q.file_dtype();
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
            ("ffn_gate", QuantType::Q5Kx16, ffn, hidden),
            ("ffn_up", QuantType::Q5Kx16, ffn, hidden),
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
    // SAFETY: the only test of this binary, set before any thread of it
    // reads the environment.
    unsafe { std::env::set_var("PULSAR_K_QUANTS", "native") };
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
    // The kernels' one-token and 8-token forms give the same bits: runs of
    // tokens against the same tokens one at a time, all three K-quants.
    common::assert_short_steps_equal_one_token_steps(&file, None, (500, 400));
}
