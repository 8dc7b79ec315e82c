//! Bad prompts and flags for `pulsar run`, one test per kind, through the
//! real binary on the default model with the reference engine: a clear
//! one-line error (naming the prompt file where there is one) and exit code
//! 1, or clap's usage error and exit code 2 for numbers that do not parse;
//! never a panic.
//!
//! argv cannot carry NUL bytes or invalid UTF-8, so those prompts travel
//! in files given with `-f`.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A fresh folder for one test's prompt files, removed when the test ends,
/// pass or fail: a failed assertion unwinds and drops the `TempDir`.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix(&format!("pulsar-bad-prompts-{tag}-"))
            .tempdir()
            .expect("create scratch folder");
        Scratch(dir)
    }

    /// Writes `bytes` to a file called `name` and returns its path.
    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.path().join(name);
        std::fs::write(&path, bytes).expect("write prompt file");
        path
    }
}

/// `pulsar run --engine reference -m <default model> ARGS`.
fn run(args: &[&str]) -> Output {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["run", "--engine", "reference", "-m"])
        .arg(model)
        .args(args)
        .output()
        .expect("the pulsar binary runs")
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Checks a refusal with exit code 1: no panic, one line, containing each
/// of `needles` (a prompt file's path among them where there is one).
fn expect_refusal(args: &[&str], needles: &[&str]) -> String {
    let out = run(args);
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?}: no text after a refusal");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: want {needle:?} in {stderr}"
        );
    }
    stderr
}

/// Checks clap's refusal of a value that does not parse: exit code 2 and a
/// message naming the flag, no panic.
fn expect_usage_error(args: &[&str], flag: &str) {
    let out = run(args);
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(
        stderr.contains("error: invalid value") && stderr.contains(flag),
        "{args:?}: {stderr}"
    );
}

#[test]
fn prompt_longer_than_the_context() {
    let scratch = Scratch::new("long");
    let long = scratch.file("long.txt", "word ".repeat(40).as_bytes());
    let long = long.to_str().unwrap();
    expect_refusal(
        &["-f", long, "-c", "16"],
        &["the prompt has", "the context holds 16", "raise -c"],
    );
    // -c above the model's own maximum is capped to it, so a prompt longer
    // than the model can attend to is refused however large -c is.
    let huge = scratch.file("huge.txt", "word ".repeat(33_000).as_bytes());
    expect_refusal(
        &["-f", huge.to_str().unwrap(), "--raw", "-c", "1000000"],
        &["the context holds 32768", "model maximum 32768"],
    );
    // -c 0 cannot hold anything.
    expect_refusal(&["-p", "hi", "-c", "0"], &["-c 0"]);
}

#[test]
fn prompt_file_not_utf8() {
    let scratch = Scratch::new("utf8");
    let latin1 = scratch.file("latin1.txt", b"caf\xe9 au lait");
    let path = latin1.to_str().unwrap();
    expect_refusal(&["-f", path], &[path, "not valid UTF-8", "offset 3"]);
    // Also when -p asks a question about the file.
    expect_refusal(
        &["-f", path, "-p", "Summarize."],
        &[path, "not valid UTF-8"],
    );
}

#[test]
fn empty_prompt() {
    let scratch = Scratch::new("empty");
    for text in ["", "   ", "\n\t \n"] {
        expect_refusal(&["-p", text], &["the prompt is empty"]);
    }
    let empty = scratch.file("empty.txt", b"");
    let blank = scratch.file("blank.txt", b" \n\n ");
    for file in [empty, blank] {
        let path = file.to_str().unwrap();
        expect_refusal(&["-f", path], &[path, "empty"]);
    }
    expect_refusal(&[], &["give a prompt with -p"]);
}

#[test]
fn prompt_with_nul_bytes() {
    let scratch = Scratch::new("nul");
    let nul = scratch.file("nul.txt", b"The capital\0 of France");
    let path = nul.to_str().unwrap();
    expect_refusal(&["-f", path], &[path, "NUL byte at offset 11"]);
    let binary = scratch.file("binary.bin", &[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0]);
    let path = binary.to_str().unwrap();
    expect_refusal(&["-f", path, "-p", "What is this?"], &[path, "NUL byte"]);
}

#[test]
fn missing_or_unreadable_prompt_file() {
    let scratch = Scratch::new("unreadable");
    let missing = scratch.0.path().join("missing.txt");
    let path = missing.to_str().unwrap();
    expect_refusal(&["-f", path], &[path, "cannot read"]);
    // A folder given as the prompt file.
    let path = scratch.0.path().to_str().unwrap();
    expect_refusal(&["-f", path], &[path, "cannot read"]);
}

#[test]
fn huge_n_predict() {
    // usize::MAX new tokens: generation stops where the context ends, so
    // the run is short and nothing is sized by -n.
    let out = run(&[
        "-p",
        "The capital of France is",
        "--raw",
        "-t",
        "0",
        "-c",
        "12",
        "-n",
        &usize::MAX.to_string(),
    ]);
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // 6 prompt tokens (BOS included) leave 6 positions in a context of 12.
    assert!(stderr.contains("[prompt 6 tok"), "{stderr}");
    let generated: usize = stderr
        .split("generated ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no generated count in {stderr}"));
    assert!((1..=6).contains(&generated), "{stderr}");
    // Beyond usize: clap refuses it.
    expect_usage_error(&["-p", "hi", "-n", "99999999999999999999999"], "-n");
}

#[test]
fn invalid_numbers() {
    for (flag, value) in [
        ("-n", "ten"),
        // -1 means no limit (as in llama.cpp); other negatives mean nothing.
        ("-n", "-2"),
        ("-n", "1.5"),
        ("-c", "4k"),
        ("-t", "warm"),
        ("--top-k", "0.5"),
        ("--top-p", ""),
        ("-s", "-7"),
        ("--threads", "many"),
    ] {
        expect_usage_error(&["-p", "hi", &format!("{flag}={value}")], flag);
    }
    // Numbers that parse but mean nothing are refused by pulsar itself.
    for (flag, value, needle) in [
        ("-t", "NaN", "temperature"),
        ("-t", "-1", "temperature"),
        ("--top-p", "0", "top-p"),
        ("--min-p", "1.5", "min-p"),
        ("--repeat-penalty", "inf", "repeat penalty"),
    ] {
        expect_refusal(&["-p", "hi", &format!("{flag}={value}")], &[needle]);
    }
}
