//! The reference forward pass on the real default model (Gemma 3 270M,
//! Q4_K_M GGUF) against HF transformers' float32 logits.

mod common;

use common::*;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted, ops::argmax};
use pulsar::model::fetch::default_model_path;
use pulsar::model::source::ModelSource;

fn engine() -> ReferenceEngine {
    let path = default_model_path().expect("the default model must be obtainable");
    let src = ModelSource::open(&path).expect("default model opens");
    ReferenceEngine::load(&src).expect("default model loads")
}

#[test]
fn final_logits_and_greedy_chain_match_hf() {
    let dir = oracle_dir().join("gemma3-270m");
    let meta = read_json(&dir.join("prompt_a.json"));
    let prompt = ids(&meta["input_ids"]);
    let greedy = ids(&meta["greedy_ids"]);
    let steps = meta["greedy_steps"].as_array().expect("greedy_steps");
    let mut engine = engine();

    let logits = engine.forward(&prompt, LogitsWanted::Last).unwrap();
    let expected = read_f32(&dir.join("final_logits_a_f32.bin"));
    let (diff, at) = max_abs_diff(&logits, &expected);
    println!("270M prompt a: max abs logit diff {diff:e} (token {at})");
    assert!(diff <= 2e-3, "final logits differ by {diff} at token {at}");

    // Teacher forcing: feed the reference's own chain, and wherever its
    // margin to the runner-up exceeds our tolerance, our argmax must agree.
    let mut logits = logits;
    let mut compared = 0;
    for (step, (&want, info)) in greedy.iter().zip(steps).enumerate() {
        let margin = info["margin_to_2nd"].as_f64().expect("margin") as f32;
        if margin > 0.02 {
            assert_eq!(
                argmax(&logits) as u32,
                want,
                "greedy step {step} (margin {margin})"
            );
            compared += 1;
        }
        logits = engine.forward(&[want], LogitsWanted::Last).unwrap();
    }
    assert!(
        compared >= 25,
        "only {compared} greedy steps had a usable margin"
    );
}

#[test]
fn kv_cached_steps_equal_full_recompute() {
    let tokens = [2u32, 818, 5279, 529, 7001, 563, 506, 5279];
    let mut whole = engine();
    let all = whole.forward(&tokens, LogitsWanted::All).unwrap();
    let vocab = whole.config().vocab_size;

    whole.truncate(0);
    assert_eq!(whole.position(), 0);
    let mut cached = Vec::new();
    whole.forward(&tokens[..3], LogitsWanted::Last).unwrap();
    for &t in &tokens[3..] {
        cached = whole.forward(&[t], LogitsWanted::Last).unwrap();
    }
    let (diff, _) = max_abs_diff(&cached, &all[(tokens.len() - 1) * vocab..]);
    assert!(diff <= 1e-5, "cached step differs from recompute by {diff}");

    // Truncating back and re-feeding a different continuation reuses the prefix.
    whole.truncate(6);
    let branch = whole.forward(&[2891, 529], LogitsWanted::Last).unwrap();
    let mut fresh = engine();
    let expect = fresh
        .forward(
            &[2, 818, 5279, 529, 7001, 563, 2891, 529],
            LogitsWanted::Last,
        )
        .unwrap();
    let (diff, _) = max_abs_diff(&branch, &expect);
    assert!(diff <= 1e-5, "truncate + refeed differs by {diff}");
}
