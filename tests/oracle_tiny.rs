//! The reference forward pass against HF transformers on the tiny fixtures
//! in ../shared/oracle: every position's logits and, for f32 weights, the
//! hidden state after every layer (so a failure names the layer).

mod common;

use common::*;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::model::source::ModelSource;

fn check(fixture: &str, reference: &str, dtype: &str, tolerance: f32) {
    let oracle = oracle_dir();
    let refdir = oracle.join(reference);
    let meta = read_json(&refdir.join("reference.json"));
    let input = ids(&meta["input_ids"]);
    let src = ModelSource::open(&oracle.join(fixture)).expect("fixture opens");
    let vocab = src.config.vocab_size;
    let hidden = src.config.hidden;
    let mut engine = ReferenceEngine::load(&src).expect("weights load");
    let (logits, trace) = engine.forward_traced(&input).expect("forward");

    if dtype == "f32" {
        let expected = read_f32(&refdir.join("hidden_states_f32weights.bin"));
        let n_states = trace[0].len();
        assert_eq!(expected.len(), n_states * input.len() * hidden);
        for state in 0..n_states {
            let mut worst = 0.0f32;
            for (pos, snapshots) in trace.iter().enumerate() {
                let at = (state * input.len() + pos) * hidden;
                let (d, _) = max_abs_diff(&snapshots[state], &expected[at..at + hidden]);
                worst = worst.max(d);
            }
            let what = match state {
                0 => "the scaled embedding".to_string(),
                s if s == n_states - 1 => "the final norm".to_string(),
                s => format!("layer {}", s - 1),
            };
            // Hidden states grow with depth; compare relative to their size.
            let scale = expected.iter().map(|v| v.abs()).fold(1.0f32, f32::max);
            assert!(
                worst <= tolerance * scale,
                "{fixture}: {what} differs by {worst} (scale {scale})"
            );
        }
    }

    let expected = read_f32(&refdir.join(format!("logits_{dtype}weights.bin")));
    assert_eq!(logits.len(), input.len() * vocab);
    let (diff, at) = max_abs_diff(&logits, &expected);
    println!("{fixture}: max abs logit diff {diff:e}");
    assert!(
        diff <= tolerance,
        "{fixture}: logits differ by {diff} at position {}, token {} (tolerance {tolerance})",
        at / vocab,
        at % vocab
    );
}

#[test]
fn tiny_gemma1_f32() {
    check("tiny-gemma1-f32", "tiny-gemma1-ref", "f32", 1e-4);
}

#[test]
fn tiny_gemma1_f16() {
    check("tiny-gemma1-f16", "tiny-gemma1-ref", "f16", 1e-4);
}

#[test]
fn tiny_gemma1_bf16() {
    check("tiny-gemma1-bf16", "tiny-gemma1-ref", "bf16", 1e-4);
}

#[test]
fn tiny_gemma2_f32() {
    check("tiny-gemma2-f32", "tiny-gemma2-ref", "f32", 2e-4);
}

#[test]
fn tiny_gemma2_f16() {
    check("tiny-gemma2-f16", "tiny-gemma2-ref", "f16", 2e-4);
}

#[test]
fn tiny_gemma3_f32() {
    check("tiny-gemma3-f32", "tiny-gemma3-ref", "f32", 1e-4);
}

#[test]
fn tiny_gemma3_f16() {
    check("tiny-gemma3-f16", "tiny-gemma3-ref", "f16", 1e-4);
}
