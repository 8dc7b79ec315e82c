//! The reference engine on models with awkward shapes (odd sizes, head dims
//! that are no multiple of 8, grouped and full multi-head attention, tiny
//! sliding windows, binding softcaps, bf16 weights), against logits from the
//! independent float64 oracle in tools/make_fixtures.py; and the KV cache
//! against recomputing the whole sequence, on those and the HF tiny models.

mod common;

use common::*;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::config::{Family, ModelConfig};
use pulsar::model::dtype::DType;
use pulsar::model::source::{ModelSource, Role};
use pulsar::model::weights::{F32Matrix, ModelWeights};
use std::path::Path;

/// Allowed |logit - oracle| for f32 compute against the float64 oracle.
const TOLERANCE: f32 = 1e-4;
/// Allowed difference between a KV-cached step and a fresh recomputation.
/// Both run the same f32 arithmetic, so this is far looser than needed.
const KV_TOLERANCE: f32 = 1e-5;

fn open(dir: &Path) -> ModelSource {
    ModelSource::open(dir).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()))
}

/// An engine over the model in `dir` with its config changed by `edit`.
fn engine_with(dir: &Path, edit: impl FnOnce(&mut ModelConfig)) -> ReferenceEngine {
    let src = open(dir);
    let weights =
        ModelWeights::load(&src, |_, t| Ok(F32Matrix::from_view(&t))).expect("weights load");
    let mut config = src.config.clone();
    edit(&mut config);
    ReferenceEngine::new(config, weights)
}

fn all_logits(engine: &mut ReferenceEngine, input: &[u32]) -> Vec<f32> {
    engine.forward(input, LogitsWanted::All).expect("forward")
}

/// Compares every position's logits with the oracle's; returns the largest
/// difference.
fn check_fixture(name: &str) -> f32 {
    let fx = load_fixture(name);
    let src = open(&fx.dir);
    assert_eq!(src.config.vocab_size, fx.vocab, "{name}: vocab size");
    let mut engine = ReferenceEngine::load(&src).expect("weights load");
    let logits = all_logits(&mut engine, &fx.input);
    assert_eq!(logits.len(), fx.logits.len(), "{name}: logits length");
    let mut worst = 0.0f32;
    for (pos, (got, want)) in logits
        .chunks_exact(fx.vocab)
        .zip(fx.logits.chunks_exact(fx.vocab))
        .enumerate()
    {
        let (diff, token) = max_abs_diff(got, want);
        assert!(
            diff <= TOLERANCE,
            "{name}: position {pos}, token {token}: logit {} but the oracle says {} (diff {diff:e}, tolerance {TOLERANCE:e})",
            got[token],
            want[token]
        );
        worst = worst.max(diff);
    }
    println!(
        "{name}: max abs logit diff {worst:e} over {} positions",
        fx.input.len()
    );
    worst
}

#[test]
fn awkward_gemma3_matches_oracle() {
    check_fixture("awkward-gemma3");
}

#[test]
fn awkward_gemma2_matches_oracle() {
    check_fixture("awkward-gemma2");
}

#[test]
fn awkward_gemma1_bf16_matches_oracle() {
    check_fixture("awkward-gemma1");
}

/// The fixtures really have the awkward features the oracle was built with,
/// as read from their config.json (transformers 4 keys for Gemma 1 and 3,
/// transformers 5 keys for Gemma 2).
#[test]
fn fixture_configs_parse_as_intended() {
    let g3 = open(&fixtures_dir().join("awkward-gemma3"));
    let c = &g3.config;
    assert_eq!(c.family, Family::Gemma3);
    assert_eq!(
        (c.vocab_size, c.hidden, c.intermediate),
        (97, 46, 58),
        "gemma3 sizes"
    );
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (6, 2, 18));
    assert!((c.query_scale - 1.0 / 17f32.sqrt()).abs() < 1e-7);
    let windows: Vec<_> = c.layers.iter().map(|l| l.window).collect();
    assert_eq!(
        windows,
        [Some(3), None, Some(3)],
        "sliding_window_pattern 2"
    );
    let bases: Vec<_> = c.layers.iter().map(|l| l.rope_base).collect();
    assert_eq!(bases, [1e4, 1e6, 1e4], "local and global rope bases");
    assert_eq!((c.attn_softcap, c.final_softcap), (None, None));

    let g2 = open(&fixtures_dir().join("awkward-gemma2"));
    let c = &g2.config;
    assert_eq!(c.family, Family::Gemma2);
    assert_eq!((c.vocab_size, c.hidden, c.intermediate), (89, 39, 77));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 1, 14));
    let windows: Vec<_> = c.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows, [Some(4), None, Some(4), None], "layer_types");
    assert_eq!((c.attn_softcap, c.final_softcap), (Some(5.0), Some(3.0)));

    let g1 = open(&fixtures_dir().join("awkward-gemma1"));
    let c = &g1.config;
    assert_eq!(c.family, Family::Gemma1);
    assert_eq!((c.vocab_size, c.hidden, c.intermediate), (101, 40, 90));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (5, 5, 10));
    assert!(c.layers.iter().all(|l| l.window.is_none()));
    let embd = g1.tensor(Role::Embedding, &[101, 40]).expect("embedding");
    assert_eq!(embd.dtype, DType::BF16, "gemma1 fixture stores bf16");
}

/// Each awkward feature moves the logits by far more than the tolerance, so
/// an engine that mishandled it would fail the oracle comparison above.
#[test]
fn fixtures_detect_missing_features() {
    type Edit = fn(&mut ModelConfig);
    let cases: [(&str, &str, Edit); 5] = [
        ("awkward-gemma2", "no final softcap", |c| {
            c.final_softcap = None
        }),
        ("awkward-gemma2", "no attention softcap", |c| {
            c.attn_softcap = None
        }),
        ("awkward-gemma2", "no sliding window", |c| {
            c.layers.iter_mut().for_each(|l| l.window = None)
        }),
        ("awkward-gemma3", "query scale 1/sqrt(head_dim)", |c| {
            c.query_scale = 1.0 / (c.head_dim as f32).sqrt()
        }),
        ("awkward-gemma3", "one rope base for all layers", |c| {
            c.layers.iter_mut().for_each(|l| l.rope_base = 1e6)
        }),
    ];
    for (name, what, edit) in cases {
        let fx = load_fixture(name);
        let mut engine = engine_with(&fx.dir, edit);
        let logits = all_logits(&mut engine, &fx.input);
        let (diff, _) = max_abs_diff(&logits, &fx.logits);
        println!("{name} with {what}: max abs logit diff {diff:e}");
        assert!(
            diff > 10.0 * TOLERANCE,
            "{name}: {what} changes logits by only {diff:e}; the fixture cannot catch that bug"
        );
    }
}

/// Input ids of every model the KV-cache checks run on: the awkward fixtures
/// and every HF tiny model folder (f32, f16, bf16).
fn kv_cases() -> Vec<(std::path::PathBuf, Vec<u32>)> {
    let mut cases = Vec::new();
    for name in ["awkward-gemma3", "awkward-gemma2", "awkward-gemma1"] {
        let fx = load_fixture(name);
        cases.push((fx.dir, fx.input));
    }
    let oracle = oracle_dir();
    for (fam, dtypes) in [
        ("gemma1", &["f32", "f16", "bf16"][..]),
        ("gemma2", &["f32", "f16"][..]),
        ("gemma3", &["f32", "f16"][..]),
    ] {
        let meta = read_json(&oracle.join(format!("tiny-{fam}-ref/reference.json")));
        for dtype in dtypes {
            cases.push((
                oracle.join(format!("tiny-{fam}-{dtype}")),
                ids(&meta["input_ids"]),
            ));
        }
    }
    assert_eq!(cases.len(), 10);
    cases
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let (diff, at) = max_abs_diff(a, b);
    assert!(
        diff <= KV_TOLERANCE,
        "{what}: differs by {diff:e} at token {at} (tolerance {KV_TOLERANCE:e})"
    );
}

/// Feeding n - 1 tokens and then the last one gives the last row of an
/// all-at-once forward; so does every single-token step, and re-feeding after
/// a truncation.
#[test]
fn kv_cached_steps_match_full_recompute() {
    for (dir, input) in kv_cases() {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let n = input.len();
        assert!(n >= 4, "{name}: sequence too short to test the cache");
        let src = open(&dir);
        let vocab = src.config.vocab_size;
        let full = all_logits(&mut ReferenceEngine::load(&src).unwrap(), &input);
        let row = |i: usize| &full[i * vocab..(i + 1) * vocab];

        // n - 1 tokens, then one.
        let mut engine = ReferenceEngine::load(&src).unwrap();
        let prefix = engine.forward(&input[..n - 1], LogitsWanted::Last).unwrap();
        assert_eq!(engine.position(), n - 1);
        assert_close(&prefix, row(n - 2), &format!("{name}: prefix's last row"));
        let last = engine.forward(&input[n - 1..], LogitsWanted::Last).unwrap();
        assert_eq!(last.len(), vocab);
        assert_close(&last, row(n - 1), &format!("{name}: cached last step"));

        // One token at a time.
        let mut engine = ReferenceEngine::load(&src).unwrap();
        for (i, &t) in input.iter().enumerate() {
            let step = engine.forward(&[t], LogitsWanted::Last).unwrap();
            assert_close(&step, row(i), &format!("{name}: single step at {i}"));
        }

        // Truncate into the sequence and feed the rest again in one call.
        let keep = n / 2;
        engine.truncate(keep);
        assert_eq!(engine.position(), keep);
        let rest = engine.forward(&input[keep..], LogitsWanted::All).unwrap();
        assert_close(
            &rest,
            &full[keep * vocab..],
            &format!("{name}: after truncating to {keep}"),
        );
        println!("{name}: KV-cached steps agree with the full recompute");
    }
}
