//! Damaged Gemma 4 GGUF files, each broken in one way from llama.cpp's own
//! conversion of the tiny fixtures, through the real binary: exit code 1,
//! no panic, one line naming the file and the tensor or key.

mod common;

use pulsar::model::gguf::{GgufFile, Value};
use pulsar::model::gguf_write::GgufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    common::oracle_dir().join("gemma4").join(name)
}

/// A writer holding every key and tensor of `file`, for one test to break.
fn copy_of(file: &str) -> GgufWriter {
    let g = GgufFile::open(&fixture(file)).expect("fixture opens");
    let mut w = GgufWriter::new();
    let mut keys: Vec<&String> = g.metadata().keys().collect();
    keys.sort();
    for key in keys {
        w.add_value(key, &g.metadata()[key]);
    }
    for t in g.tensors() {
        let bytes = g.tensor(&t.name).expect("listed").bytes.to_vec();
        w.add_tensor(&t.name, &t.shape, t.dtype, bytes)
            .expect("sizes match");
    }
    w
}

fn logits(model: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args([
            "logits",
            "--engine",
            "reference",
            "--tokens",
            "2,5,17",
            "-o",
        ])
        .arg(model.with_extension("bin"))
        .arg("-m")
        .arg(model)
        .output()
        .expect("the pulsar binary runs")
}

/// Writes `w` and expects `pulsar logits` to refuse it in one line naming
/// the file and each of `needles`.
fn expect_refusal(w: &GgufWriter, needles: &[&str]) {
    let dir = tempfile::tempdir().expect("scratch folder");
    let path = dir.path().join("broken.gguf");
    w.write(&path).expect("write GGUF");
    let out = logits(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(&path.display().to_string()),
        "names the file: {stderr}"
    );
    for needle in needles {
        assert!(stderr.contains(needle), "should say {needle:?}: {stderr}");
    }
}

fn set(w: &mut GgufWriter, key: &str, value: Value) {
    w.kvs.retain(|kv| kv.key != key);
    w.add_value(key, &value);
}

#[test]
fn the_unbroken_copies_run() {
    for file in ["tiny-gemma4-dense-f32.gguf", "tiny-gemma4-moe-f32.gguf"] {
        let dir = tempfile::tempdir().expect("scratch folder");
        let path = dir.path().join(file);
        copy_of(file).write(&path).expect("write GGUF");
        let out = logits(&path);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let mut w = copy_of("tiny-gemma4-dense-f32.gguf");
    w.tensors.retain(|t| t.name != "blk.1.attn_k.weight");
    expect_refusal(&w, &["blk.1.attn_k.weight", "missing"]);
}

#[test]
fn a_missing_per_layer_input_table_is_named() {
    let mut w = copy_of("tiny-gemma4-dense-f32.gguf");
    w.tensors
        .retain(|t| t.name != "per_layer_token_embd.weight");
    expect_refusal(&w, &["per_layer_token_embd.weight", "missing"]);
}

#[test]
fn a_per_layer_array_of_the_wrong_length_is_named() {
    let mut w = copy_of("tiny-gemma4-dense-f32.gguf");
    let five = Value::Array(vec![Value::U32(2); 5]);
    set(&mut w, "gemma4.attention.head_count_kv", five);
    expect_refusal(
        &w,
        &["gemma4.attention.head_count_kv", "5 entries for 6 layers"],
    );
}

#[test]
fn an_expert_count_that_disagrees_with_the_tensors_is_named() {
    let mut w = copy_of("tiny-gemma4-moe-f32.gguf");
    set(&mut w, "gemma4.expert_count", Value::U32(6));
    expect_refusal(&w, &["ffn_gate_up_exps", "[6, 64, 128]"]);
}

#[test]
fn more_experts_used_than_there_are_is_refused() {
    let mut w = copy_of("tiny-gemma4-moe-f32.gguf");
    set(&mut w, "gemma4.expert_used_count", Value::U32(9));
    expect_refusal(&w, &["8 experts with 9 used per token"]);
}

#[test]
fn sharing_more_layers_than_there_are_is_refused() {
    let mut w = copy_of("tiny-gemma4-dense-f32.gguf");
    set(&mut w, "gemma4.attention.shared_kv_layers", Value::U32(6));
    expect_refusal(&w, &["6 KV-sharing layers of 6"]);
}
