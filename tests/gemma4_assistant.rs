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

/// A case's ids (`a` or `b`) and its reference folder.
fn case_ids(case: &str) -> Vec<u32> {
    let meta = read_json(&data().join("tiny-g4a-ref/reference.json"));
    ids(&meta["cases"][case]["ids"])
}

fn reference_file(name: &str) -> Vec<f32> {
    read_f32(&data().join("tiny-g4a-ref").join(name))
}

/// The reference engine's draft round for `case`: the target runs
/// `ids[..n-1]`, the assistant drafts `k` tokens after `ids[n-1]`.
fn reference_drafts(target: &Path, assistant: &Path, case: &str, k: usize) -> (Vec<u32>, Vec<f32>) {
    use pulsar::engine::reference::ReferenceEngine;
    use pulsar::engine::{Engine, LogitsWanted};
    let ids = case_ids(case);
    let t = ModelSource::open(target).expect("target opens");
    let mut engine = ReferenceEngine::load(&t).expect("target loads");
    let a = ModelSource::open(assistant).expect("assistant opens");
    engine.attach_assistant(&a, &t.path).expect("the pair fits");
    engine
        .forward(&ids[..ids.len() - 1], LogitsWanted::Last)
        .expect("target runs");
    let mut logits = Vec::new();
    let tokens = engine
        .draft(ids[ids.len() - 1], k, Some(&mut logits))
        .expect("drafts");
    (tokens, logits)
}

/// The drafted tokens `reference.json` lists for a chain.
fn chain_tokens(case: &str, chain: &str) -> Vec<u32> {
    let meta = read_json(&data().join("tiny-g4a-ref/reference.json"));
    ids(&meta["cases"][case][format!("tokens_{chain}")])
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    let (diff, at) = max_abs_diff(got, want);
    println!("{what}: max abs diff {diff:e}");
    assert!(
        diff <= tolerance,
        "{what}: differs by {diff} at draft {}, token {}",
        at / 512,
        at % 512
    );
}

#[test]
fn reference_drafts_match_transformers_for_every_round_length() {
    let target = data().join("tiny-g4a-target-f32");
    for case in ["a", "b"] {
        for (assistant, chain) in [
            ("tiny-g4a-assistant-f32", "centroid_f32"),
            ("tiny-g4a-assistant-bf16", "centroid_bf16"),
        ] {
            let want = reference_file(&format!("{case}_{chain}_logits.bin"));
            let tokens = chain_tokens(case, chain);
            for k in 1..=8 {
                let (got, logits) = reference_drafts(&target, &data().join(assistant), case, k);
                assert_eq!(got, tokens[..k], "{case} {chain} k={k}: drafted tokens");
                assert_close(
                    &format!("{case} {chain} k={k}"),
                    &logits,
                    &want[..k * 512],
                    1e-4,
                );
            }
        }
    }
}

/// llama.cpp's GGUF assistant has no clusters: its drafts rank the whole
/// tied head, the `full` chain; the GGUF target gives the same.
#[test]
fn reference_drafts_of_the_gguf_assistant_use_the_full_head() {
    for target in ["tiny-g4a-target-f32", "tiny-g4a-target-f32.gguf"] {
        for case in ["a", "b"] {
            let (tokens, logits) = reference_drafts(
                &data().join(target),
                &data().join("tiny-g4a-assistant-f32.gguf"),
                case,
                8,
            );
            assert_eq!(tokens, chain_tokens(case, "full_f32"), "{target} {case}");
            let want = reference_file(&format!("{case}_full_f32_logits.bin"));
            assert_close(&format!("{target} {case} full head"), &logits, &want, 1e-4);
        }
    }
    // The HF assistant told not to use its clusters drafts the same chain.
    let unordered = edited_copy("tiny-g4a-assistant-f32", |c| {
        c["use_ordered_embeddings"] = false.into()
    });
    let (tokens, logits) = reference_drafts(
        &data().join("tiny-g4a-target-f32"),
        unordered.path(),
        "b",
        8,
    );
    assert_eq!(tokens, chain_tokens("b", "full_f32"));
    assert_close(
        "HF without clusters",
        &logits,
        &reference_file("b_full_f32_logits.bin"),
        1e-4,
    );
}

/// Case `case`'s context but its last token run on the fast engine, then a
/// round of 8 drafts from that token: the drafted ids and their logits.
fn draft_round(engine: &mut pulsar::engine::fast::FastEngine, case: &str) -> (Vec<u32>, Vec<f32>) {
    use pulsar::engine::{Engine, LogitsWanted};
    let ids = case_ids(case);
    engine.truncate(0);
    engine
        .forward(&ids[..ids.len() - 1], LogitsWanted::Last)
        .unwrap();
    let mut logits = Vec::new();
    let tokens = engine
        .draft(ids[ids.len() - 1], 8, Some(&mut logits))
        .unwrap();
    (tokens, logits)
}

/// The fast engine's rounds (the JIT's kernels with what the CPU has and
/// held to AVX2, the portable ones; one and two threads, so the attention
/// over the target's cache is split) against the f32 chain, within what
/// FP16 weights allow (see tests/draft_logits.rs).
#[test]
fn fast_drafts_match_the_reference_on_every_kernel_set() {
    use pulsar::engine::fast::{FastEngine, FastOptions, assistant_format, plan_assistant};
    use pulsar::engine::jit_kernels::{JitKernels, plan_options};
    use pulsar::engine::kernels::{MatKernels, PortableKernels};
    use pulsar::jit::cpu::Isa;
    use std::sync::Arc;
    let target = Arc::new(open("tiny-g4a-target-f32"));
    let assistant = open("tiny-g4a-assistant-f32");
    for threads in [1, 2] {
        let opts = FastOptions {
            threads,
            context: 64,
            format: None,
            prefill_chunk: 5,
            in_place: false,
            native: false,
        };
        let formats = FastEngine::weight_formats(&target, &opts).expect("formats");
        let mut plan = plan_options(&target.config, &formats, threads);
        let format = assistant_format(&formats, &assistant.config);
        plan_assistant(&mut plan, &assistant.config, format);
        let sets: Vec<(&str, Box<dyn MatKernels>)> = vec![
            (
                "jit",
                Box::new(
                    JitKernels::with_options(&target.config, plan.clone())
                        .unwrap()
                        .unwrap(),
                ),
            ),
            (
                "jit-avx2",
                Box::new(
                    JitKernels::with_options(
                        &target.config,
                        pulsar::jit::plan::PlanOptions {
                            max_isa: Isa::Avx2,
                            ..plan.clone()
                        },
                    )
                    .unwrap()
                    .unwrap(),
                ),
            ),
            ("portable", Box::new(PortableKernels)),
        ];
        for (name, kernels) in sets {
            let mut engine = FastEngine::load(&target, kernels, &opts).expect("loads");
            engine
                .load_assistant(&assistant, &target.path, format)
                .expect("the assistant loads");
            for case in ["a", "b"] {
                let (tokens, logits) = draft_round(&mut engine, case);
                assert_eq!(
                    tokens,
                    chain_tokens(case, "centroid_f32"),
                    "{name} {threads}"
                );
                assert_close(
                    &format!("{name} {threads} thread(s) {case}"),
                    &logits,
                    &reference_file(&format!("{case}_centroid_f32_logits.bin")),
                    0.05,
                );
            }
        }
    }
}

/// Beside a target kept in Q8_0, the assistant's matrices are kept in the
/// target's 16-row Q8_0 too: the plan's kernels are the target's alone
/// (a Gemma 4 E2B Q4_K_M plan has no room for 16-bit ones), and the drafts
/// stay near the f32 chain, as the target's own Q8_0 logits do.
#[test]
fn beside_a_q8_0_target_the_assistant_drafts_on_the_targets_kernels() {
    use pulsar::engine::fast::{FastEngine, FastOptions, assistant_format, plan_assistant};
    use pulsar::engine::jit_kernels::{JitKernels, plan_options};
    use pulsar::engine::packed::WeightFormat;
    use pulsar::jit::cpu::CpuCaps;
    use pulsar::jit::dims::ModelDims;
    use pulsar::jit::plan::plan;
    use std::sync::Arc;
    let target = Arc::new(open("tiny-g4a-target-f32"));
    let assistant = open("tiny-g4a-assistant-f32");
    let opts = FastOptions {
        threads: 2,
        context: 64,
        format: Some(WeightFormat::Q8_0),
        prefill_chunk: 5,
        in_place: false,
        native: false,
    };
    let formats = FastEngine::weight_formats(&target, &opts).expect("formats");
    let format = assistant_format(&formats, &assistant.config);
    assert_eq!(format, WeightFormat::Q8_0x16);
    let alone = plan_options(&target.config, &formats, 2);
    let mut with = alone.clone();
    plan_assistant(&mut with, &assistant.config, format);
    let caps = CpuCaps::detect();
    let dims = ModelDims::from(&target.config);
    let names = |opts| -> Vec<String> {
        let p = plan(&dims, &caps, &opts).expect("plans");
        p.kernels.into_iter().map(|k| k.name).collect()
    };
    assert_eq!(names(with.clone()), names(alone));
    let kernels = JitKernels::with_options(&target.config, with)
        .unwrap()
        .unwrap();
    let mut engine = FastEngine::load(&target, Box::new(kernels), &opts).expect("loads");
    engine
        .load_assistant(&assistant, &target.path, format)
        .expect("the assistant loads");
    for case in ["a", "b"] {
        let (tokens, logits) = draft_round(&mut engine, case);
        // Rounding to 8 bits moves near ties: of the cluster scores (a
        // different cluster kept changes its rows' logits wholesale) and
        // of the tokens (the rounds after a different draft continue a
        // different text). So the first round's logits are held to the
        // tolerance, and the drafted tokens to the chain's first four.
        let chain = chain_tokens(case, "centroid_f32");
        assert_eq!(tokens[..4], chain[..4], "{case}");
        let want = reference_file(&format!("{case}_centroid_f32_logits.bin"));
        let vocab = want.len() / tokens.len();
        assert_close(
            &format!("Q8_0 {case}"),
            &logits[..vocab],
            &want[..vocab],
            0.25,
        );
    }
}
