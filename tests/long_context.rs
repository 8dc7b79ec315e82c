//! Numerics over a long sequence: a 4,096-token prefill followed by decode
//! steps on the default model keeps every logit finite, on the fast engine
//! (f32 accumulation everywhere, 16-bit weights).

use pulsar::commands::jit_kernels;
use pulsar::engine::fast::{FastEngine, FastOptions, WeightFormats};
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::fetch::default_model_path;
use pulsar::model::source::ModelSource;
use std::sync::Arc;

#[test]
fn logits_stay_finite_over_4096_tokens() {
    let path = default_model_path().expect("default model");
    let src = Arc::new(ModelSource::open(&path).unwrap());
    let opts = FastOptions {
        threads: 2,
        context: 4096 + 16,
        format: None,
        prefill_chunk: 64,
        in_place: false,
        native: false,
    };
    let format = FastEngine::weight_format_for(&src, &opts).unwrap();
    let kernels = jit_kernels(&src.config, WeightFormats::uniform(format), 2).unwrap();
    let mut engine = FastEngine::load(&src, kernels, &opts).unwrap();
    let vocab = src.config.vocab_size;
    // A repetitive but varied text: ids spread over the vocabulary.
    let tokens: Vec<u32> = std::iter::once(2)
        .chain((1..4096).map(|i| (4 + (i * 7919 + 13) % (vocab - 4)) as u32))
        .collect();
    // Feed in pieces, checking the last position's logits of each piece
    // (all positions' logits would cost a 262k-row LM head per token).
    for (i, piece) in tokens.chunks(256).enumerate() {
        let logits = engine.forward(piece, LogitsWanted::Last).unwrap();
        assert_eq!(logits.len(), vocab);
        if let Some(bad) = logits.iter().position(|v| !v.is_finite()) {
            panic!(
                "non-finite logit {} for token {bad} after piece {i}",
                logits[bad]
            );
        }
    }
    assert_eq!(engine.position(), 4096);
    let mut next = 2u32;
    for step in 0..16 {
        let logits = engine.forward(&[next], LogitsWanted::Last).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()), "decode step {step}");
        next = pulsar::engine::ops::argmax(&logits) as u32;
    }
    // The cache is full to its capacity now; one more token is refused.
    assert!(engine.forward(&[next], LogitsWanted::Last).is_err());
}
