//! `pulsar run` and `pulsar tokenize` through the real binary on the
//! default model.

mod common;

use common::*;
use std::process::Command;

fn pulsar(args: &[&str]) -> std::process::Output {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(args)
        .arg("-m")
        .arg(model)
        .output()
        .expect("binary runs")
}

#[test]
fn greedy_run_reproduces_the_reference_chain() {
    let meta = read_json(&oracle_dir().join("gemma3-270m/prompt_a.json"));
    let want = meta["greedy_text"].as_str().unwrap();
    let out = pulsar(&[
        "run",
        "-p",
        "The capital of France is",
        "-n",
        "32",
        "-t",
        "0",
        "--raw",
        "--engine",
        "reference",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{want}\n"));
    assert!(stderr.contains("generated 32 tok"), "{stderr}");
    assert!(stderr.contains("tok/s"), "{stderr}");
}

#[test]
fn seeded_sampling_is_reproducible_and_seeds_differ() {
    let run = |seed: &str| {
        let out = pulsar(&[
            "run",
            "-p",
            "Once upon a time",
            "-n",
            "24",
            "-t",
            "1.0",
            "-s",
            seed,
            "--raw",
            "--engine",
            "reference",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let a = run("7");
    assert_eq!(a, run("7"), "same seed, same text");
    assert_ne!(a, run("8"), "different seeds should differ");
}

#[test]
fn tokenize_prints_ids() {
    let out = pulsar(&["tokenize", "-p", "The capital of France is"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "2 818 5279 529 7001 563\n"
    );
    let out = pulsar(&["tokenize", "-p", "The capital", "--no-bos"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "818 5279\n");
}

#[test]
fn logits_from_text_equal_logits_from_ids() {
    // Removed on drop when the test ends, pass or fail, after the children.
    let dir = tempfile::Builder::new()
        .prefix("pulsar-cli-logits-")
        .tempdir()
        .unwrap();
    let a = dir.path().join("a.bin");
    let b = dir.path().join("b.bin");
    let out = pulsar(&[
        "logits",
        "--engine",
        "reference",
        "-p",
        "The capital of France is",
        "-o",
        a.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = pulsar(&[
        "logits",
        "--engine",
        "reference",
        "--tokens",
        "2,818,5279,529,7001,563",
        "-o",
        b.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("[262144]"));
    let expected = read_f32(&oracle_dir().join("gemma3-270m/final_logits_a_f32.bin"));
    let (diff, _) = max_abs_diff(&read_f32(&a), &expected);
    assert!(diff <= 2e-3, "{diff}");
    assert_eq!(read_f32(&a), read_f32(&b));
}

#[test]
fn bad_prompts_are_refused_clearly() {
    let dir = tempfile::Builder::new()
        .prefix("pulsar-cli-bad-")
        .tempdir()
        .unwrap();
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    // argv cannot carry NUL bytes; a file can.
    let nul = dir.path().join("nul.txt");
    std::fs::write(&nul, b"a\0b").unwrap();
    for (args, needle) in [
        (vec!["run", "-p", "", "--engine", "reference"], "empty"),
        (
            vec![
                "run",
                "-f",
                latin1.to_str().unwrap(),
                "--engine",
                "reference",
            ],
            "UTF-8",
        ),
        (
            vec!["run", "-f", nul.to_str().unwrap(), "--engine", "reference"],
            "NUL",
        ),
        (
            vec!["run", "-p", "hi", "--temp=-1", "--engine", "reference"],
            "temperature",
        ),
        (
            vec!["run", "-p", "hi", "-c", "2", "--engine", "reference"],
            "context",
        ),
    ] {
        let out = pulsar(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            stderr.to_lowercase().contains(&needle.to_lowercase()),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_stop_string_split_across_tokens_ends_the_text_unprinted() {
    let meta = read_json(&oracle_dir().join("gemma3-270m/prompt_a.json"));
    let want = meta["greedy_text"].as_str().unwrap();
    // " the capital of the country of France": "ntry of" starts inside
    // the token "▁country" and ends in "▁of".
    let stop = "ntry of";
    let before = &want[..want.find(stop).unwrap()];
    assert!(before.ends_with(" cou"), "{before:?}");
    let out = pulsar(&[
        "run",
        "-p",
        "The capital of France is",
        "-n",
        "32",
        "-t",
        "0",
        "--raw",
        "--engine",
        "reference",
        "--stop",
        "nothing like this",
        "--stop",
        stop,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{before}\n"));
    // "▁the ▁capital ▁of ▁the ▁country" and "▁of", which completed it.
    assert!(stderr.contains("generated 6 tok"), "{stderr}");
}

/// `run` is plain completion unless `--chat`, as llama-completion is: the
/// prompt is continued, and no chat format is named.
#[test]
fn run_is_plain_completion_by_default() {
    let out = pulsar(&[
        "run",
        "-p",
        "The capital of France is",
        "-n",
        "3",
        "-t",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("chat format"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout, " the capital of\n", "{stderr}");
    let both = pulsar(&["run", "-p", "hi", "--chat", "--raw"]);
    assert!(!both.status.success());
    assert!(
        String::from_utf8_lossy(&both.stderr).contains("cannot be used with"),
        "{}",
        String::from_utf8_lossy(&both.stderr)
    );
}

#[test]
fn run_with_chat_uses_the_models_chat_format() {
    let out = pulsar(&[
        "run",
        "-p",
        "What is the capital of France?",
        "-n",
        "48",
        "-t",
        "0",
        "--chat",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr
            .lines()
            .next()
            .unwrap_or("")
            .contains("chat format \"dialogue\""),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Paris"), "{stdout:?}");
    assert!(
        !stdout.contains("User:") && !stdout.starts_with(' '),
        "{stdout:?}"
    );
}

/// `bench --m-curve` times a step over every m from 1 to 16 after the
/// cached context `--m-curve-context` asks for, each against the step over
/// one token (no timing is checked, only what the report holds).
#[test]
fn the_m_curve_reports_every_step_size_after_the_context_asked_for() {
    let out = pulsar(&[
        "bench",
        "--pp",
        "8",
        "--tg",
        "2",
        "--m-curve",
        "--m-curve-context",
        "40",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(report["m_curve_context"], 40);
    let steps = report["m_curve"].as_array().expect("the m-curve");
    let sizes: Vec<u64> = steps.iter().map(|s| s["m"].as_u64().unwrap()).collect();
    assert_eq!(sizes, (1..=16).collect::<Vec<u64>>());
    assert_eq!(steps[0]["relative"], 1.0);
    for s in steps {
        assert!(s["step_ms"].as_f64().unwrap() > 0.0, "{s}");
    }
}

/// The machine's cores, as `--threads` counts them.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn threads_above_the_cores_are_capped_with_one_line() {
    let out = pulsar(&["run", "-p", "Hi", "-n", "2", "--raw", "--threads", "999"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let cores = cores();
    let line = format!("--threads 999: this machine has {cores} cores; using {cores}");
    assert_eq!(stderr.matches(&line).count(), 1, "{stderr}");
}

#[test]
fn a_context_above_the_trained_one_is_capped_and_minus_one_means_no_limit() {
    let out = pulsar(&["run", "-p", "Hi", "-n", "2", "--raw", "-c", "999999"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("-c 999999: the model was trained for 32768 tokens; using 32768"),
        "{stderr}"
    );
    // -n -1: until the context is full; -k -1: top-k off (llama.cpp's).
    let out = pulsar(&[
        "run",
        "-p",
        "Once upon a time",
        "--raw",
        "-c",
        "24",
        "-n",
        "-1",
        "-k",
        "-1",
        "-t",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("generated"), "{stderr}");
    let out = pulsar(&["run", "-p", "Hi", "--raw", "-n", "-2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("or -1 for no limit"), "{stderr}");
}

/// Types still converted at load say so in a few words on the "loaded"
/// line (issue 46); the tensors and sizes need `--verbose`.
#[test]
fn start_up_is_short_and_the_conversion_note_needs_verbose() {
    let out = pulsar(&["run", "-p", "Hi", "-n", "2", "--raw"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Before the statistics line: the start-up.
    let start_up: Vec<&str> = stderr
        .lines()
        .take_while(|l| !l.starts_with("pulsar: ["))
        .collect();
    assert!(start_up.len() <= 2, "{stderr}");
    assert!(!stderr.contains("were converted"), "{stderr}");
    let loaded = start_up
        .iter()
        .find(|l| l.starts_with("pulsar: loaded"))
        .unwrap_or_else(|| panic!("no loaded line: {stderr}"));
    assert!(
        loaded.contains("Q6_K converted, +") && loaded.len() < 200,
        "{loaded}"
    );
    let out = pulsar(&["run", "-p", "Hi", "-n", "2", "--raw", "--verbose"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("were converted"),
        "the default model's Q6_K (and with VNNI Q4_K) matrices are converted at load; with \
         --verbose the note says so: {stderr}"
    );
}

/// A length limit that cuts the reply inside a stop string does not show
/// the stop string's start: with the base model's dialogue format ("\nUser:"
/// ends the model's turn), seed 4 and `-n 4` once printed "Hi!\nUser".
#[test]
fn a_limit_inside_a_stop_string_hides_its_start() {
    let out = pulsar(&["run", "-p", "hi", "-n", "4", "-s", "4", "--chat"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let text = String::from_utf8_lossy(&out.stdout);
    let shown = text.strip_suffix('\n').unwrap_or(&text);
    // No proper start of "\nUser:" ends the text (on this model and seed
    // the reply is "Hi!" then the cut stop string).
    for end in 1.."\nUser:".len() {
        assert!(!shown.ends_with(&"\nUser:"[..end]), "{text:?}");
    }
}

/// The prompt's count says how much of it the chat format added, so "hi"
/// is not reported as a 30-token prompt without a word why; plain
/// completion has nothing to add.
#[test]
fn the_prompt_count_separates_the_chat_format() {
    let out = pulsar(&["run", "-p", "hi", "-n", "2", "-t", "0", "--chat"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stats = stderr
        .lines()
        .find(|l| l.contains("[prompt "))
        .expect("stats");
    let total: usize = stats["pulsar: [prompt ".len()..]
        .split(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("prompt count");
    let format: usize = stats
        .split(" (")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no chat-format count in {stats}"));
    assert!(stats.contains("of them the chat format"), "{stats}");
    // "hi" is one token of the user's; the rest is the format's.
    assert_eq!(total - format, 1, "{stats}");
    for plain in [&["--raw"][..], &[]] {
        let mut args = vec!["run", "-p", "hi", "-n", "2", "-t", "0"];
        args.extend(plain);
        let raw = pulsar(&args);
        assert!(!String::from_utf8_lossy(&raw.stderr).contains("chat format)"));
    }
}
