//! `pulsar logits --draft`: a Gemma 4 assistant's draft logits through the
//! binary, against transformers' on the tiny pair of
//! `tests/data/gemma4-assistant` (issue 52's definition: K x V little-endian
//! f32, the target having run all ids but the last), and the input it
//! refuses in one line.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma4-assistant")
}

fn case_ids(case: &str) -> Vec<u32> {
    ids(&read_json(&data().join("tiny-g4a-ref/reference.json"))["cases"][case]["ids"])
}

/// Runs `pulsar logits --draft` and returns its output and the file's
/// values (empty when it failed).
fn draft_logits(
    target: &Path,
    assistant: &Path,
    tokens: &[u32],
    k: &str,
    engine: &str,
) -> (Output, Vec<f32>) {
    draft_logits_with(target, assistant, tokens, k, &["--engine", engine])
}

/// [`draft_logits`] with the engine flags given.
fn draft_logits_with(
    target: &Path,
    assistant: &Path,
    tokens: &[u32],
    k: &str,
    engine_flags: &[&str],
) -> (Output, Vec<f32>) {
    let out_file = ScratchFile::new("pulsar-draft-logits-", "drafts.bin");
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["logits", "--no-tune", "--n-draft", k])
        .args(engine_flags)
        .arg("-m")
        .arg(target)
        .arg("--draft")
        .arg(assistant)
        .arg("--tokens")
        .arg(list.join(","))
        .arg("-o")
        .arg(&*out_file)
        .output()
        .expect("the pulsar binary runs");
    let values = if out.status.success() {
        read_f32(&out_file)
    } else {
        Vec::new()
    };
    (out, values)
}

fn check(target: &str, assistant: &str, case: &str, chain: &str, engine: &str, tolerance: f32) {
    check_with(
        target,
        assistant,
        case,
        chain,
        &["--engine", engine],
        tolerance,
    );
}

fn check_with(
    target: &str,
    assistant: &str,
    case: &str,
    chain: &str,
    engine_flags: &[&str],
    tolerance: f32,
) {
    let engine = engine_flags.join(" ");
    let want = read_f32(
        &data()
            .join("tiny-g4a-ref")
            .join(format!("{case}_{chain}_logits.bin")),
    );
    for k in [1usize, 3, 8] {
        let (out, got) = draft_logits_with(
            &data().join(target),
            &data().join(assistant),
            &case_ids(case),
            &k.to_string(),
            engine_flags,
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{target} + {assistant}: {stderr}");
        assert_eq!(got.len(), k * 512, "K x V values, no header");
        let (diff, at) = max_abs_diff(&got, &want[..k * 512]);
        println!("{engine} {assistant} {case} k={k}: max abs diff {diff:e}");
        assert!(
            diff <= tolerance,
            "{engine} {assistant} {case} k={k}: differs by {diff} at draft {}, token {}",
            at / 512,
            at % 512
        );
    }
}

#[test]
fn the_reference_engine_writes_transformers_draft_logits() {
    for case in ["a", "b"] {
        check(
            "tiny-g4a-target-f32",
            "tiny-g4a-assistant-f32",
            case,
            "centroid_f32",
            "reference",
            1e-4,
        );
        check(
            "tiny-g4a-target-f32",
            "tiny-g4a-assistant-bf16",
            case,
            "centroid_bf16",
            "reference",
            1e-4,
        );
        // llama.cpp's GGUFs: no clusters, the full head (said once).
        check(
            "tiny-g4a-target-f32.gguf",
            "tiny-g4a-assistant-f32.gguf",
            case,
            "full_f32",
            "reference",
            1e-4,
        );
    }
    let (out, _) = draft_logits(
        &data().join("tiny-g4a-target-f32.gguf"),
        &data().join("tiny-g4a-assistant-f32.gguf"),
        &case_ids("a"),
        "2",
        "reference",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let notes: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("whole vocabulary"))
        .collect();
    assert_eq!(notes.len(), 1, "{stderr}");
}

/// The fast engine keeps both models' matrices in 16 bits (the target's
/// format): FP16 from the f32 folders, within FP16's rounding of the f32
/// chain; the bf16 assistant folder against its own chain; BF16 for both
/// models within BF16's.
#[test]
fn the_jit_engine_writes_draft_logits_within_16_bit_tolerances() {
    for case in ["a", "b"] {
        let jit = ["--engine", "jit"];
        check_with(
            "tiny-g4a-target-f32",
            "tiny-g4a-assistant-f32",
            case,
            "centroid_f32",
            &jit,
            TOLERANCE_F16,
        );
        check_with(
            "tiny-g4a-target-f32",
            "tiny-g4a-assistant-bf16",
            case,
            "centroid_bf16",
            &jit,
            TOLERANCE_F16,
        );
        check_with(
            "tiny-g4a-target-f32.gguf",
            "tiny-g4a-assistant-f32.gguf",
            case,
            "full_f32",
            &jit,
            TOLERANCE_F16,
        );
    }
    // Both models in BF16, case a only: case b's drafts are 0.02 apart at
    // their closest, and BF16 moves its third draft's logits by 0.09, so
    // its chain may leave the f32 one (it does, at the eighth draft).
    check_with(
        "tiny-g4a-target-f32",
        "tiny-g4a-assistant-f32",
        "a",
        "centroid_f32",
        &["--engine", "jit", "--dtype", "bf16"],
        TOLERANCE_BF16,
    );
}

/// FP16 moves the first draft's logits by 3e-3 here and the eighth's by
/// 0.022: each draft reads the previous one's hidden state, so the
/// rounding compounds down the round.
const TOLERANCE_F16: f32 = 0.05;
/// BF16 (both models): 0.042 measured on case a.
const TOLERANCE_BF16: f32 = 0.1;

/// Exit code 1, no panic, one line on stderr containing every needle.
fn expect_refusal(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} not in: {stderr}");
    }
}

#[test]
fn bad_draft_requests_are_refused_in_one_line() {
    let target = data().join("tiny-g4a-target-f32");
    let assistant = data().join("tiny-g4a-assistant-f32");
    let ids = case_ids("a");
    for engine in ["reference", "jit"] {
        // A model that is not an assistant.
        let (out, _) = draft_logits(&target, &target, &ids, "4", engine);
        expect_refusal(&out, &["tiny-g4a-target-f32", "is not a Gemma 4 assistant"]);
        // No drafts, or more than a round drafts.
        for k in ["0", "9"] {
            let (out, _) = draft_logits(&target, &assistant, &ids, k, engine);
            expect_refusal(&out, &[&format!("--n-draft {k}"), "1 to 8"]);
        }
        // Nothing for the target to run.
        let (out, _) = draft_logits(&target, &assistant, &ids[..1], "4", engine);
        expect_refusal(&out, &["at least 2 token ids"]);
    }
    // An assistant made for a wider target.
    let dir = tempfile::tempdir().unwrap();
    let mut config = read_json(&assistant.join("config.json"));
    config["backbone_hidden_size"] = 128.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        assistant.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    for engine in ["reference", "jit"] {
        let (out, _) = draft_logits(&target, dir.path(), &ids, "4", engine);
        expect_refusal(&out, &["hidden size 128", "hidden size 64"]);
    }
    // The assistant given as the model.
    let (out, _) = draft_logits(&assistant, &assistant, &ids, "4", "reference");
    expect_refusal(&out, &["is a Gemma 4 assistant", "--draft"]);
}
