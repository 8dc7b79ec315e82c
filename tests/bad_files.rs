//! Missing, truncated and corrupt model files give a one-line error naming
//! the file, through the real binary, never a panic.

mod common;

use std::path::Path;
use std::process::Command;
use tempfile::TempDir;

/// A fresh folder for one test, removed when the returned `TempDir` is
/// dropped: at the end of the test, pass or fail (a failed assertion
/// unwinds), after every child run on its files has exited.
fn scratch(name: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("pulsar-bad-files-{name}-"))
        .tempdir()
        .unwrap()
}

/// Runs `pulsar logits -m model` and returns its stderr after checking it
/// failed cleanly with a message naming `names`.
fn expect_clean_failure(model: &Path, names: &str) -> String {
    let out_file = model.with_extension("out.bin");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["logits", "--tokens", "2,3", "-o"])
        .arg(&out_file)
        .arg("-m")
        .arg(model)
        .output()
        .expect("binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(names),
        "message should name {names}: {stderr}"
    );
    stderr
}

#[test]
fn missing_file() {
    let tmp = scratch("missing");
    let dir = tmp.path();
    let path = dir.join("nope.gguf");
    expect_clean_failure(&path, "nope.gguf");
}

#[test]
fn truncated_gguf_at_many_lengths() {
    let tmp = scratch("truncated");
    let dir = tmp.path();
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let bytes = std::fs::read(&model).unwrap();
    for len in [
        0usize,
        3,
        4,
        8,
        23,
        1000,
        100_000,
        6_000_000,
        bytes.len() - 1,
    ] {
        let path = dir.join(format!("cut-{len}.gguf"));
        std::fs::write(&path, &bytes[..len]).unwrap();
        let msg = expect_clean_failure(&path, &format!("cut-{len}.gguf"));
        assert!(
            msg.contains("truncated") || msg.contains("not a GGUF"),
            "cut at {len}: {msg}"
        );
    }
}

#[test]
fn corrupt_gguf_magic_and_version() {
    let tmp = scratch("corrupt");
    let dir = tmp.path();
    let path = dir.join("magic.gguf");
    std::fs::write(&path, b"GGUX\x03\0\0\0").unwrap();
    expect_clean_failure(&path, "not a GGUF file");
    let path = dir.join("version.gguf");
    std::fs::write(&path, b"GGUF\x07\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0").unwrap();
    expect_clean_failure(&path, "unsupported GGUF version 7");
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let tmp = scratch("safetensors");
    let dir = tmp.path();
    let fixture = common::oracle_dir().join("tiny-gemma1-f32");
    let weights = std::fs::read(fixture.join("model.safetensors")).unwrap();
    std::fs::copy(fixture.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    expect_clean_failure(dir, "model.safetensors");

    let mut bad_json = weights.clone();
    bad_json[8] = b'!';
    std::fs::write(dir.join("model.safetensors"), &bad_json).unwrap();
    expect_clean_failure(dir, "not valid JSON");

    std::fs::write(dir.join("config.json"), b"{\"model_type\": \"llama\"}").unwrap();
    expect_clean_failure(dir, "config.json");
}
