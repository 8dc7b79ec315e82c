//! Launch-time tuning through the real binary: the first run on a CPU,
//! model and thread count measures and stores, later runs reuse, a run with
//! other threads measures its own, a corrupt entry is ignored with one line
//! and replaced, and `--no-tune` measures nothing. Each test has a cache
//! folder of its own (the model is named with -m).

use std::path::{Path, PathBuf};
use std::process::Command;
use tempfile::TempDir;

/// A fresh cache folder, removed when the test ends, pass or fail (a
/// failed assertion unwinds and drops it).
fn cache(name: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("pulsar-tuning-{name}-"))
        .tempdir()
        .expect("temp folder")
}

/// `pulsar ARGS -m MODEL` with `dir` as the cache folder; its stderr.
fn pulsar(dir: &Path, args: &[&str]) -> String {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(args)
        .arg("-m")
        .arg(model)
        .env("PULSAR_CACHE_DIR", dir)
        .output()
        .expect("binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {stderr}");
    stderr
}

fn run(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["run", "-p", "Hello", "-n", "2", "-t", "0", "--raw"];
    args.extend_from_slice(extra);
    pulsar(dir, &args)
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(dir.join("tuning")) {
        Ok(d) => d.map(|e| e.unwrap().path()).collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn the_first_run_measures_later_runs_reuse_and_other_threads_measure_again() {
    let tmp = cache("reuse");
    let dir = tmp.path();
    let first = run(dir, &["--threads", "2"]);
    assert!(first.contains("tuning measured in"), "{first}");
    let stored = entries(dir);
    assert_eq!(stored.len(), 1, "{stored:?}");
    let entry: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stored[0]).unwrap()).unwrap();
    assert!(entry["key"].as_str().unwrap().contains("threads: 2"));
    // Every knob's candidates were timed.
    let knobs: Vec<&str> = entry["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["knob"].as_str().unwrap())
        .collect();
    assert!(knobs.contains(&"quant_prefetch") && knobs.contains(&"shared_rows_bytes"));

    let second = run(dir, &["--threads", "2"]);
    assert!(second.contains("tuning reused"), "{second}");
    assert!(!second.contains("measured in"), "{second}");
    let tune = String::from_utf8_lossy(
        &Command::new(env!("CARGO_BIN_EXE_pulsar"))
            .args(["tune", "--threads", "2", "-m"])
            .arg(pulsar::model::fetch::default_model_path().unwrap())
            .env("PULSAR_CACHE_DIR", dir)
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(tune.contains("later runs reuse"), "{tune}");

    let other = run(dir, &["--threads", "1"]);
    assert!(other.contains("measured in"), "{other}");
    assert_eq!(entries(dir).len(), 2);
}

/// The full search (`tune --measure`) also times the prefill knobs (too
/// slow for a launch) and stores them with the rest; a later run with the
/// same key reuses the whole entry.
#[test]
fn the_full_search_stores_the_prefill_knobs_for_later_runs() {
    let tmp = cache("full");
    let dir = tmp.path();
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["tune", "--measure", "--threads", "2", "-m"])
        .arg(pulsar::model::fetch::default_model_path().unwrap())
        .env("PULSAR_CACHE_DIR", dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for knob in [
        "quant_prefetch",
        "shared_rows_bytes",
        "prefill_chunk",
        "widened_panel_bytes",
    ] {
        let chosen = stdout
            .lines()
            .filter(|l| l.trim_start().starts_with(knob) && l.contains("<- chosen"))
            .count();
        assert_eq!(chosen, 1, "{knob}: one chosen candidate\n{stdout}");
    }
    let stored = entries(dir);
    assert_eq!(stored.len(), 1, "{stored:?}");
    let entry: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stored[0]).unwrap()).unwrap();
    let chunk = entry["tuned"]["prefill_chunk"]
        .as_u64()
        .expect("prefill chunk stored");
    assert!([63, 126, 252].contains(&chunk), "{entry}");
    let again = run(dir, &["--threads", "2"]);
    assert!(again.contains("tuning reused"), "{again}");
}

#[test]
fn a_corrupt_entry_is_ignored_and_replaced() {
    let tmp = cache("corrupt");
    let dir = tmp.path();
    run(dir, &[]);
    let stored = entries(dir);
    assert_eq!(stored.len(), 1);
    std::fs::write(&stored[0], "{\"key\": 3").unwrap();
    let again = run(dir, &[]);
    assert!(again.contains("ignoring a tuning entry"), "{again}");
    assert!(again.contains("measured in"), "{again}");
    let reused = run(dir, &[]);
    assert!(reused.contains("reused"), "{reused}");
}

#[test]
fn no_tune_measures_and_stores_nothing() {
    let tmp = cache("off");
    let dir = tmp.path();
    let out = run(dir, &["--no-tune"]);
    assert!(out.contains("no tuning (--no-tune)"), "{out}");
    assert!(entries(dir).is_empty());
}
