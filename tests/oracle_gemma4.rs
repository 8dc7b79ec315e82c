//! Gemma 4 against transformers 5.23 on the tiny fixtures of
//! ../shared/oracle/gemma4: the dense model (per-layer inputs, KV sharing,
//! k = v, the double-wide MLP, two head sizes) and the mixture of experts,
//! from the HF folders and from llama.cpp's own GGUF conversion of them.
//! The reference engine must be within 1e-4 of the f32 logits at every
//! position (and of each layer's hidden state, so a failure names the
//! layer); the fast engine within what 16-bit weights allow.

mod common;

use common::*;
use pulsar::engine::fast::{FastEngine, FastOptions, WeightFormats};
use pulsar::engine::jit_kernels::{JitKernels, plan_options};
use pulsar::engine::kernels::{MatKernels, PortableKernels};
use pulsar::engine::packed::WeightFormat;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::jit::cpu::Isa;
use pulsar::jit::plan::PlanOptions;
use pulsar::model::config::Family;
use pulsar::model::source::ModelSource;
use std::path::PathBuf;
use std::sync::Arc;

fn gemma4_dir() -> PathBuf {
    oracle_dir().join("gemma4")
}

/// The fixture's input ids and expected logits.
fn expected(reference: &str, weights: &str) -> (Vec<u32>, Vec<f32>) {
    let dir = gemma4_dir().join(reference);
    let meta = read_json(&dir.join("reference.json"));
    let input = ids(&meta["input_ids"]);
    let logits = read_f32(&dir.join(format!("logits_{weights}weights.bin")));
    (input, logits)
}

fn check_reference(model: &str, reference: &str, weights: &str) {
    let (input, want) = expected(reference, weights);
    let src = ModelSource::open(&gemma4_dir().join(model)).expect("fixture opens");
    assert_eq!(src.config.family, Family::Gemma4);
    let (vocab, hidden) = (src.config.vocab_size, src.config.hidden);
    let mut engine = ReferenceEngine::load(&src).expect("weights load");
    let (logits, trace) = engine.forward_traced(&input).expect("forward");
    if weights == "f32" {
        let states = read_f32(
            &gemma4_dir()
                .join(reference)
                .join("hidden_states_f32weights.bin"),
        );
        let n_states = trace[0].len();
        assert_eq!(states.len(), n_states * input.len() * hidden);
        for state in 0..n_states {
            let (mut worst, mut scale) = (0.0f32, 1.0f32);
            for (pos, snapshots) in trace.iter().enumerate() {
                let at = (state * input.len() + pos) * hidden;
                let expect = &states[at..at + hidden];
                worst = worst.max(max_abs_diff(&snapshots[state], expect).0);
                scale = expect.iter().map(|v| v.abs()).fold(scale, f32::max);
            }
            assert!(
                worst <= 1e-4 * scale,
                "{model}: hidden state {state} (0 = embedding, last = final norm) differs by {worst} (scale {scale})"
            );
        }
    }
    assert_eq!(logits.len(), input.len() * vocab);
    let (diff, at) = max_abs_diff(&logits, &want);
    println!("{model}: reference engine, max abs logit diff {diff:e}");
    assert!(
        diff <= 1e-4,
        "{model}: logits differ by {diff} at position {}, token {}",
        at / vocab,
        at % vocab
    );
}

#[test]
fn reference_dense_hf_f32() {
    check_reference("tiny-gemma4-dense-f32", "tiny-gemma4-dense-ref", "f32");
}

#[test]
fn reference_dense_hf_bf16() {
    check_reference("tiny-gemma4-dense-bf16", "tiny-gemma4-dense-ref", "bf16");
}

#[test]
fn reference_dense_gguf() {
    check_reference("tiny-gemma4-dense-f32.gguf", "tiny-gemma4-dense-ref", "f32");
}

#[test]
fn reference_moe_hf_f32() {
    check_reference("tiny-gemma4-moe-f32", "tiny-gemma4-moe-ref", "f32");
}

#[test]
fn reference_moe_gguf() {
    check_reference("tiny-gemma4-moe-f32.gguf", "tiny-gemma4-moe-ref", "f32");
}

#[test]
fn both_layouts_describe_the_same_model() {
    for (hf, gguf) in [
        ("tiny-gemma4-dense-f32", "tiny-gemma4-dense-f32.gguf"),
        ("tiny-gemma4-moe-f32", "tiny-gemma4-moe-f32.gguf"),
    ] {
        let a = ModelSource::open(&gemma4_dir().join(hf)).unwrap().config;
        let b = ModelSource::open(&gemma4_dir().join(gguf)).unwrap().config;
        assert_eq!(a.layer_shapes, b.layer_shapes, "{hf}: per-layer shapes");
        assert_eq!(a.features, b.features, "{hf}: features");
        assert_eq!(a.layers, b.layers, "{hf}: windows and RoPE bases");
    }
    let dense = ModelSource::open(&gemma4_dir().join("tiny-gemma4-dense-f32"))
        .unwrap()
        .config;
    // Layers 3 and 4 (sliding) read layer 1's cache, layer 5 (global)
    // layer 2's; global layers rotate 8 of 32 pairs and take V from K.
    let kv: Vec<usize> = (0..6).map(|i| dense.shape(i).kv_layer).collect();
    assert_eq!(kv, [0, 1, 2, 1, 1, 2]);
    assert_eq!(dense.shape(2).rotated_pairs, 8);
    assert!(dense.shape(2).values_from_keys && !dense.shape(1).values_from_keys);
    assert_eq!(dense.shape(5).ffn_width, 320);
}

type MakeKernels = fn(&pulsar::model::config::ModelConfig, WeightFormats) -> Box<dyn MatKernels>;

/// The JIT's kernels with what this CPU has, held to AVX2 (the baseline
/// every kernel must have: there the plan emits attention for both head
/// sizes), and the portable ones.
fn kernel_sets() -> Vec<(&'static str, MakeKernels)> {
    vec![
        ("jit", |c, f| {
            Box::new(JitKernels::build(c, f, 2).expect("JIT builds on this CPU"))
        }),
        ("jit-avx2", |c, f| {
            let opts = PlanOptions {
                max_isa: Isa::Avx2,
                ..plan_options(c, &f, 2)
            };
            Box::new(
                JitKernels::with_options(c, opts)
                    .expect("JIT builds")
                    .expect("this CPU has AVX2"),
            )
        }),
        ("portable", |_, _| Box::new(PortableKernels)),
    ]
}

/// The fast engine with `format` weights (None: the file's 16-bit
/// default), prefill in chunks of 5 and then one token at a time, against
/// the f32 logits.
fn check_fast(model: &str, reference: &str, format: Option<WeightFormat>, tolerance: f32) {
    let (input, want) = expected(reference, "f32");
    let src = Arc::new(ModelSource::open(&gemma4_dir().join(model)).expect("fixture opens"));
    let vocab = src.config.vocab_size;
    for (name, make) in kernel_sets() {
        for threads in [1, 2] {
            let opts = FastOptions {
                threads,
                context: 64,
                format,
                prefill_chunk: 5,
                in_place: false,
                native: false,
            };
            let formats = FastEngine::weight_formats(&src, &opts).expect("formats");
            let mut engine =
                FastEngine::load(&src, make(&src.config, formats), &opts).expect("loads");
            // The first 9 tokens as a prompt, the rest one by one.
            let mut logits = engine.forward(&input[..9], LogitsWanted::All).unwrap();
            for &t in &input[9..] {
                logits.extend(engine.forward(&[t], LogitsWanted::All).unwrap());
            }
            let (diff, at) = max_abs_diff(&logits, &want);
            println!("{model} {name} {threads} thread(s) {format:?}: max abs diff {diff:e}");
            assert!(
                diff <= tolerance,
                "{model} ({name}, {threads} threads, {format:?}): logits differ by {diff} at position {}, token {}",
                at / vocab,
                at % vocab
            );
        }
    }
}

#[test]
fn fast_dense_f16() {
    check_fast("tiny-gemma4-dense-f32", "tiny-gemma4-dense-ref", None, 0.02);
    check_fast(
        "tiny-gemma4-dense-f32.gguf",
        "tiny-gemma4-dense-ref",
        None,
        0.02,
    );
}

#[test]
fn fast_moe_f16() {
    check_fast("tiny-gemma4-moe-f32", "tiny-gemma4-moe-ref", None, 0.02);
    check_fast(
        "tiny-gemma4-moe-f32.gguf",
        "tiny-gemma4-moe-ref",
        None,
        0.02,
    );
}

#[test]
fn fast_bf16() {
    let bf16 = Some(WeightFormat::BF16);
    check_fast("tiny-gemma4-dense-f32", "tiny-gemma4-dense-ref", bf16, 0.1);
    check_fast("tiny-gemma4-moe-f32.gguf", "tiny-gemma4-moe-ref", bf16, 0.1);
}

/// Weights quantized to Q8_0 at load run on the integer kernels (8-bit
/// inputs too), by the JIT's kernels and the portable ones: within what
/// that rounding moves on these models (measured 0.19 dense, 0.55 for the
/// mixture, whose expert weights follow the rounded router input; the two
/// kernel sets agree to 1e-6).
#[test]
fn fast_integer_kernels() {
    let q8 = Some(WeightFormat::Q8_0);
    check_fast(
        "tiny-gemma4-dense-f32.gguf",
        "tiny-gemma4-dense-ref",
        q8,
        0.25,
    );
    check_fast("tiny-gemma4-moe-f32", "tiny-gemma4-moe-ref", q8, 0.6);
}

/// The text part of an image-text checkpoint (`Gemma4ForConditionalGeneration`):
/// the config nests `text_config`, tensors sit under
/// `model.language_model.`, and the towers are skipped with one line.
#[test]
fn the_text_part_of_an_image_text_checkpoint_runs() {
    let fixture = gemma4_dir().join("tiny-gemma4-dense-f32");
    let text_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    let config = serde_json::json!({
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config,
        "vision_config": {"model_type": "gemma4_vision"},
    });
    // The safetensors file with every name moved under the language model,
    // and one vision tensor beside them.
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let mut data = bytes[8 + header_len..].to_vec();
    let mut renamed = serde_json::Map::new();
    for (name, entry) in header {
        let name = match name.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => name,
        };
        renamed.insert(name, entry);
    }
    let at = data.len();
    data.extend_from_slice(&[0u8; 8]);
    renamed.insert(
        "model.vision_tower.patch_embedder.weight".into(),
        serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": [at, at + 8]}),
    );
    let mut header = serde_json::to_vec(&renamed).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), file).unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();

    let src = ModelSource::open(dir.path()).expect("the text model opens");
    let (input, want) = expected("tiny-gemma4-dense-ref", "f32");
    let mut engine = ReferenceEngine::load(&src).expect("weights load");
    let logits = engine.forward(&input, LogitsWanted::All).unwrap();
    let (diff, _) = max_abs_diff(&logits, &want);
    assert!(diff <= 1e-4, "logits differ by {diff}");

    // Through the binary: one line says what was skipped.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["logits", "--tokens", "2,5,17", "-o"])
        .arg(dir.path().join("out.bin"))
        .arg("-m")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let skipped: Vec<&str> = stderr.lines().filter(|l| l.contains("skipped")).collect();
    assert_eq!(skipped.len(), 1, "{stderr}");
    assert!(skipped[0].contains("vision tower"), "{stderr}");
}

/// A GGUF whose experts' gate and up are two tensors (`ffn_gate_exps`,
/// `ffn_up_exps`) rather than one fused tensor computes the same.
#[test]
fn split_expert_tensors_equal_fused_ones() {
    use pulsar::model::gguf::GgufFile;
    use pulsar::model::gguf_write::GgufWriter;
    let g = GgufFile::open(&gemma4_dir().join("tiny-gemma4-moe-f32.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in g.metadata() {
        w.add_value(key, value);
    }
    for t in g.tensors() {
        let bytes = g.tensor(&t.name).unwrap().bytes;
        match t.name.strip_suffix("ffn_gate_up_exps.weight") {
            Some(prefix) => {
                // [experts, 2 x width, hidden]: the gate is each expert's
                // first half of rows.
                let (experts, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
                let half = rows / 2 * cols * 4;
                let (mut gate, mut up) = (Vec::new(), Vec::new());
                for e in bytes.chunks_exact(rows * cols * 4).take(experts) {
                    gate.extend_from_slice(&e[..half]);
                    up.extend_from_slice(&e[half..]);
                }
                let shape = [experts, rows / 2, cols];
                w.add_tensor(
                    &format!("{prefix}ffn_gate_exps.weight"),
                    &shape,
                    t.dtype,
                    gate,
                )
                .unwrap();
                w.add_tensor(&format!("{prefix}ffn_up_exps.weight"), &shape, t.dtype, up)
                    .unwrap();
            }
            None => {
                w.add_tensor(&t.name, &t.shape, t.dtype, bytes.to_vec())
                    .unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("split.gguf");
    w.write(&path).unwrap();
    let src = ModelSource::open(&path).expect("split file opens");
    let (input, want) = expected("tiny-gemma4-moe-ref", "f32");
    let mut engine = ReferenceEngine::load(&src).expect("weights load");
    let logits = engine.forward(&input, LogitsWanted::All).unwrap();
    let (diff, _) = max_abs_diff(&logits, &want);
    assert!(diff <= 1e-4, "logits differ by {diff}");
}

/// Speculative decoding's verify steps rely on a short run of tokens being
/// computed exactly as one-token steps compute them: on both Gemma 4
/// models (KV sharing, per-layer inputs, experts grouped per step), in
/// FP16 and Q8_0, every position's logits have the same bits.
#[test]
fn short_steps_equal_one_token_steps_bit_for_bit() {
    for (model, format) in [
        ("tiny-gemma4-dense-f32.gguf", None),
        ("tiny-gemma4-moe-f32.gguf", None),
        ("tiny-gemma4-moe-f32", Some(WeightFormat::Q8_0)),
        ("tiny-gemma4-dense-f32", Some(WeightFormat::Q8_0)),
    ] {
        assert_short_steps_equal_one_token_steps(&gemma4_dir().join(model), format, (500, 500));
    }
}

/// The mixture in a step shared by several sequences (a decode token, a
/// short exact run, a prompt chunk in bulk): each sequence gets the bits
/// it gets alone, with 16-bit weights (whose exact tokens take the GEMV,
/// each expert counting its own) and on the integer kernels. An expert
/// whose tokens are a run of the step reads them in place; one whose
/// tokens are scattered reads a gathered copy: both are exercised here.
#[test]
fn mixture_sequences_sharing_a_step_get_what_they_get_alone() {
    use pulsar::engine::fast::SeqTokens;
    let walk = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 3 + (i * 37 + seed * 101) % 500)
            .collect()
    };
    for format in [None, Some(WeightFormat::Q8_0)] {
        let mut e =
            fast_engine_with_sequences(&gemma4_dir().join("tiny-gemma4-moe-f32"), format, 32, 6);
        let step = step_alone;
        for (seq, prompt) in [walk(9, 1), walk(6, 2), walk(3, 3)].iter().enumerate() {
            step(&mut e, seq, prompt);
            step(&mut e, seq + 3, prompt);
        }
        // A decode token, a short exact run and a prompt chunk in bulk.
        let runs = [walk(1, 4), walk(5, 5), walk(30, 6)];
        let batch: Vec<SeqTokens> = runs
            .iter()
            .enumerate()
            .map(|(seq, tokens)| SeqTokens {
                seq,
                tokens,
                wanted: Some(LogitsWanted::All),
            })
            .collect();
        let together = e.forward_batch(&batch).unwrap();
        for (seq, (run, t)) in runs.iter().zip(&together).enumerate() {
            let a = step(&mut e, seq + 3, run);
            let differs = t
                .iter()
                .zip(&a)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert!(
                differs.is_none(),
                "{format:?}, sequence {seq}: logit {differs:?} differs between the shared step and alone"
            );
        }
    }
}
