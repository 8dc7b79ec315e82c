//! Gemma 4's assistant (the drafter) against transformers 5.23 on the tiny
//! target + assistant pair of `tests/data/gemma4-assistant` (its README is
//! the spec): loading from the HF folders and from llama.cpp's GGUF, the
//! checks that an assistant fits its target, and the draft logits.

mod common;

use common::*;
use pulsar::model::config::HeadClusters;
use pulsar::model::gemma4_assistant::target_kv_layers;
use pulsar::model::source::ModelSource;
use std::path::{Path, PathBuf};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma4-assistant")
}

fn open(name: &str) -> ModelSource {
    ModelSource::open(&data().join(name)).unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

#[test]
fn the_assistant_loads_from_both_layouts_and_fits_its_target() {
    let hf = open("tiny-g4a-assistant-f32");
    let gguf = open("tiny-g4a-assistant-f32.gguf");
    let (a, g) = (&hf.config, &gguf.config);
    // The README's table: 4 layers S S S F, width 32, heads 4, head sizes
    // 32 / 64 with 2 / 1 KV heads, MLP 128, window 8, no softcap.
    assert_eq!((a.n_layers(), a.hidden, a.n_heads), (4, 32, 4));
    let windows: Vec<Option<usize>> = a.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows, [Some(8), Some(8), Some(8), None]);
    let shapes: Vec<(usize, usize, usize)> = (0..4)
        .map(|i| {
            let s = a.shape(i);
            (s.head_dim, s.n_kv_heads, s.ffn_width)
        })
        .collect();
    assert_eq!(
        shapes,
        [(32, 2, 128), (32, 2, 128), (32, 2, 128), (64, 1, 128)]
    );
    assert_eq!(
        a.shape(3).rotated_pairs,
        8,
        "proportional RoPE on the full layer"
    );
    assert_eq!(a.final_softcap, None);
    assert!((0..4).all(|i| !a.keeps_kv(i)), "no layer keeps keys");
    let shape = a.features.assistant.expect("an assistant");
    assert_eq!(shape.backbone_hidden, 64);
    assert_eq!(
        shape.clusters,
        Some(HeadClusters {
            count: 16,
            top_k: 4
        })
    );
    // The GGUF describes the same model, without the clusters its
    // converter drops.
    assert_eq!(a.layer_shapes, g.layer_shapes);
    assert_eq!(a.layers, g.layers);
    assert_eq!(
        (a.vocab_size, a.hidden, a.n_heads),
        (g.vocab_size, g.hidden, g.n_heads)
    );
    let gshape = g.features.assistant.expect("an assistant");
    assert_eq!((gshape.backbone_hidden, gshape.clusters), (64, None));
    // Its sliding layers read the target's layer 1, the full one layer 2
    // (the target's KV producers, through its own sharing).
    for target in ["tiny-g4a-target-f32", "tiny-g4a-target-f32.gguf"] {
        let t = open(target);
        for assistant in [&hf, &gguf] {
            let layers = target_kv_layers(&t.config, &t.path, &assistant.config, &assistant.path)
                .expect("the pair fits");
            assert_eq!(layers, [1, 1, 1, 2], "{target}");
        }
    }
}

#[test]
fn the_token_ordering_is_read_as_integers() {
    let hf = open("tiny-g4a-assistant-f32");
    let ordering = pulsar::model::gemma4_assistant::token_ordering(&hf).expect("reads");
    assert_eq!(ordering.len(), 512);
    let mut sorted = ordering.clone();
    sorted.sort_unstable();
    assert!(sorted.iter().copied().eq(0..512u32), "a permutation");
    assert_ne!(
        ordering, sorted,
        "the fixture's ordering is not the identity"
    );
}

/// Writes a copy of an HF folder with its config.json edited.
fn edited_copy(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = data().join(name);
    let mut config = read_json(&from.join("config.json"));
    edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        from.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    dir
}

#[test]
fn a_pair_that_does_not_fit_is_refused_naming_the_mismatch() {
    let target = open("tiny-g4a-target-f32");
    let fits = |assistant: &ModelSource| {
        target_kv_layers(
            &target.config,
            &target.path,
            &assistant.config,
            &assistant.path,
        )
        .map_err(|e| format!("{e:#}"))
    };
    // Another target width: the config still opens, the pair does not fit.
    let wide = edited_copy("tiny-g4a-assistant-f32", |c| {
        c["backbone_hidden_size"] = 96.into()
    });
    let err = fits(&ModelSource::open(wide.path()).unwrap()).unwrap_err();
    assert!(
        err.contains("hidden size 96") && err.contains("hidden size 64"),
        "{err}"
    );
    // A KV head count the target's cache does not have.
    let heads = edited_copy("tiny-g4a-assistant-f32", |c| {
        c["text_config"]["num_key_value_heads"] = 4.into()
    });
    let err = fits(&ModelSource::open(heads.path()).unwrap()).unwrap_err();
    assert!(err.contains("layer 0 (sliding) has 4 KV heads"), "{err}");
    // The target in the assistant's place.
    let err = fits(&target).unwrap_err();
    assert!(err.contains("is not a Gemma 4 assistant"), "{err}");
    // An assistant is not a model to run.
    let assistant = open("tiny-g4a-assistant-f32");
    let err = pulsar::engine::reference::ReferenceEngine::load(&assistant)
        .err()
        .map(|e| format!("{e:#}"))
        .expect("refused");
    assert!(err.contains("--draft"), "{err}");
    // What transformers refuses in an assistant's text config.
    let ple = edited_copy("tiny-g4a-assistant-f32", |c| {
        c["text_config"]["hidden_size_per_layer_input"] = 16.into()
    });
    let err = format!(
        "{:#}",
        ModelSource::open(ple.path()).err().expect("refused")
    );
    assert!(err.contains("hidden_size_per_layer_input"), "{err}");
}
