//! Every input the fuzzers in `fuzz/` found crashing, replayed through the
//! same checks (`pulsar::fuzz_checks`) the fuzz targets run. The inputs live
//! in `tests/data/fuzz_regressions/<target>/`, one file each.

use pulsar::model::gguf::GgufFile;
use pulsar::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/fuzz_regressions")
        .join(target);
    // A target without findings has no folder (git keeps no empty ones).
    if !dir.exists() {
        return Vec::new();
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "README.md"))
        .collect();
    files.sort();
    files
}

/// Runs `check` on each saved input of `target`, naming the file on failure.
fn replay(target: &str, check: impl Fn(&[u8])) {
    let files = inputs(target);
    for path in &files {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&bytes)));
        assert!(outcome.is_ok(), "{}: the check panicked", path.display());
    }
    println!("{target}: replayed {} saved inputs", files.len());
}

#[test]
fn gguf_regressions() {
    // At least the division by zero found in review must be here.
    assert!(
        !inputs("gguf").is_empty(),
        "the saved GGUF inputs are missing"
    );
    replay("gguf", pulsar::fuzz_checks::gguf);
}

#[test]
fn safetensors_regressions() {
    replay("safetensors", pulsar::fuzz_checks::safetensors);
}

#[test]
fn hf_config_regressions() {
    replay("hf_config", pulsar::fuzz_checks::hf_config);
}

#[test]
fn hf_tokenizer_regressions() {
    replay("hf_tokenizer", pulsar::fuzz_checks::hf_tokenizer);
}

#[test]
fn tokenizer_regressions() {
    if inputs("tokenizer").is_empty() {
        return;
    }
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&model).expect("default model opens"))
        .expect("tokenizer loads");
    replay("tokenizer", |data| {
        pulsar::fuzz_checks::tokenizer(&tok, data)
    });
}
