//! Structured output on the real default model through the binary: every
//! constrained output parses and validates (with an independent JSON-schema
//! validator), regex and Lark outputs match, greedy runs repeat, and bad
//! constraints fail with one line naming the flag.
//!
//! Runs are sequential: the machine has 2 cores and each run uses both.

use serde::Deserialize;
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

/// Tokens per run: enough for every schema below, small enough to be quick.
const MAX_NEW: &str = "96";

fn pulsar(args: &[&str]) -> Output {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .arg("run")
        .arg("-m")
        .arg(model)
        .args(["-t", "0", "-n", MAX_NEW])
        // The cases are written as questions to a chat model; `--raw`
        // asks for plain completion instead.
        .args(if args.contains(&"--raw") {
            &[][..]
        } else {
            &["--chat"][..]
        })
        .args(args)
        .output()
        .expect("pulsar runs")
}

/// Runs with `args`, expecting success; returns stdout.
fn generated(args: &[&str]) -> String {
    let out = pulsar(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "pulsar {args:?} failed: {stderr}");
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The 20 prompt × schema cases: required fields, enums, arrays with
/// minItems/maxItems, nested objects, numbers with bounds, string patterns.
/// They live in `tests/data/structured_cases.json` so that
/// `tools/bench_structured.py` runs the same list. Strings have a `maxLength`
/// and integers a `maximum` (France's population too): without one a greedy
/// model can write digits until -n runs out. A number's fraction is just as
/// free: the movie's rating is an integer since a greedy run wrote
/// "1.0000000000000001000…" until -n ran out (after prompts moved to the
/// integer GEMM, whose 8-bit inputs changed its logits slightly). serde_json keeps the file's key
/// order (`preserve_order`, which llguidance turns on), so the schema text
/// given to the binary, and with it the property order, is the file's.
fn cases() -> Vec<(String, Value)> {
    const FILE: &str = "tests/data/structured_cases.json";
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Case {
        prompt: String,
        schema: Value,
    }
    let cases: Vec<Case> = serde_json::from_str(include_str!("data/structured_cases.json"))
        .unwrap_or_else(|e| panic!("{FILE}: {e}"));
    // An empty list would let every test over it pass without a run.
    assert!(!cases.is_empty(), "{FILE}: no cases");
    cases.into_iter().map(|c| (c.prompt, c.schema)).collect()
}

/// Why `text` is not an instance of `schema`, or `None` when it is.
fn invalid_because(schema: &Value, text: &str) -> Option<String> {
    let value: Value = match serde_json::from_str(text.trim()) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON: {e}")),
    };
    let validator = jsonschema::validator_for(schema).expect("test schemas are valid");
    validator.validate(&value).err().map(|e| e.to_string())
}

#[test]
fn twenty_schemas_give_valid_json() {
    let mut failures = Vec::new();
    for (prompt, schema) in cases() {
        let schema_text = schema.to_string();
        let text = generated(&["-p", &prompt, "--json-schema", &schema_text]);
        if let Some(why) = invalid_because(&schema, &text) {
            failures.push(format!("{prompt:?} -> {text:?}: {why}"));
        }
    }
    assert!(
        failures.is_empty(),
        "invalid outputs:\n{}",
        failures.join("\n")
    );
}

/// The same prompts without the constraint, the schema written into the
/// prompt instead: the constraint is what makes every output valid (the
/// base model measured 0 of 20 here). Prints the count (`-- --nocapture`).
#[test]
fn unconstrained_outputs_are_not_all_valid() {
    let cases = cases();
    let mut valid = 0;
    for (prompt, schema) in &cases {
        let with_schema = format!("{prompt} Use this JSON schema: {schema}");
        let text = generated(&["-p", &with_schema]);
        let why = invalid_because(schema, &text);
        println!("{:5} {prompt:?} -> {text:?}", why.is_none());
        valid += usize::from(why.is_none());
    }
    println!("unconstrained: {valid} of {} valid", cases.len());
    assert!(
        valid < cases.len(),
        "every unconstrained output was valid: the comparison shows nothing"
    );
}

#[test]
fn json_schema_from_a_file_and_repeatable() {
    // Removed on drop when the test ends, pass or fail.
    let dir = tempfile::Builder::new()
        .prefix("pulsar-structured-")
        .tempdir()
        .expect("temp folder");
    let path: PathBuf = dir.path().join("person.json");
    let (prompt, schema) = cases().swap_remove(0);
    std::fs::write(&path, schema.to_string()).unwrap();
    let args = [
        "-p",
        prompt.as_str(),
        "--json-schema",
        path.to_str().unwrap(),
    ];
    let first = generated(&args);
    assert_eq!(invalid_because(&schema, &first), None, "{first:?}");
    assert_eq!(generated(&args), first, "greedy runs differ");
}

/// `--json` bounds nothing inside the object, so the prompt must lead the
/// model to close it: an example does (without one, the model wrote a
/// number of ninety digits until -n).
#[test]
fn any_json_object() {
    let text = generated(&[
        "--raw",
        "-p",
        "Example: {\"name\": \"Alice\", \"age\": 30}. Another person as JSON:",
        "--json",
    ]);
    let value: Value =
        serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    assert!(value.is_object(), "{text:?}");
}

#[test]
fn regex_output_matches_in_full_and_repeats() {
    let args = [
        "-p",
        "What is your phone number?",
        "--regex",
        "[0-9]{3}-[0-9]{4}",
    ];
    let text = generated(&args);
    let digits = |s: &str| s.len() == 3 && s.bytes().all(|b| b.is_ascii_digit());
    let line = text.trim_end_matches('\n');
    let (a, b) = line.split_once('-').unwrap_or(("", ""));
    assert!(
        digits(a) && b.len() == 4 && b.bytes().all(|c| c.is_ascii_digit()),
        "{text:?}"
    );
    assert_eq!(generated(&args), text, "greedy runs differ");
}

#[test]
fn lark_grammar_output_is_in_the_language() {
    let dir = tempfile::Builder::new()
        .prefix("pulsar-lark-")
        .tempdir()
        .expect("temp folder");
    let path = dir.path().join("answer.lark");
    std::fs::write(
        &path,
        "start: verdict \" because \" reason \".\"\n\
         verdict: \"yes\" | \"no\"\n\
         reason: /[a-z ]{1,40}/\n",
    )
    .unwrap();
    let args = [
        "-p",
        "Is the sun hot? Say why.",
        "--grammar",
        path.to_str().unwrap(),
    ];
    let text = generated(&args);
    let line = text.trim_end_matches('\n');
    let rest = line
        .strip_prefix("yes because ")
        .or_else(|| line.strip_prefix("no because "))
        .unwrap_or_else(|| panic!("{text:?} does not start with a verdict"));
    let reason = rest
        .strip_suffix('.')
        .unwrap_or_else(|| panic!("{text:?} does not end with a full stop"));
    assert!(
        (1..=40).contains(&reason.len())
            && reason.bytes().all(|b| b.is_ascii_lowercase() || b == b' '),
        "{text:?}"
    );
    assert_eq!(generated(&args), text, "greedy runs differ");
}

/// Runs expecting failure; returns the last stderr line.
fn error_line(args: &[&str]) -> String {
    let out = pulsar(args);
    assert!(!out.status.success(), "pulsar {args:?} succeeded");
    let stderr = String::from_utf8_lossy(&out.stderr);
    stderr.lines().last().unwrap_or_default().to_string()
}

#[test]
fn bad_constraints_fail_with_one_line_naming_the_flag() {
    let line = error_line(&["-p", "x", "--regex", "[0-9"]);
    assert!(line.starts_with("pulsar: --regex: "), "{line}");
    assert!(line.contains("unclosed character class"), "{line}");

    let line = error_line(&["-p", "x", "--json-schema", r#"{"type": "strnig"}"#]);
    assert!(line.starts_with("pulsar: --json-schema: "), "{line}");
    assert!(line.contains("strnig"), "{line}");

    let line = error_line(&["-p", "x", "--json-schema", r#"{"type": "object","#]);
    assert!(line.starts_with("pulsar: --json-schema: "), "{line}");
    assert!(line.contains("column"), "{line}");

    // A schema file that is not there is named as a missing file, not
    // parsed as JSON text.
    let line = error_line(&["-p", "x", "--json-schema", "/no/such/schema.json"]);
    assert!(line.contains("no such file"), "{line}");
    assert!(line.contains("/no/such/schema.json"), "{line}");

    let dir = tempfile::Builder::new()
        .prefix("pulsar-badlark-")
        .tempdir()
        .expect("temp folder");
    let path = dir.path().join("bad.lark");
    std::fs::write(&path, "start: undefined_rule\n").unwrap();
    let line = error_line(&["-p", "x", "--grammar", path.to_str().unwrap()]);
    assert!(line.starts_with("pulsar: --grammar: "), "{line}");
    assert!(line.contains("undefined_rule"), "{line}");

    let out = pulsar(&["-p", "x", "--json", "--regex", "a"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}
