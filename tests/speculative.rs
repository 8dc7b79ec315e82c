//! Speculative decoding (`--spec ngram`) changes nothing but the speed:
//!
//! - greedy text through the real binary and the default model is
//!   byte-identical with and without it (documents, code, counting, a text
//!   that crosses the 512-token sliding window, a chat keeping its cache);
//! - sampled text on the tiny oracle model has the same token frequencies
//!   over many seeds (a two-sample chi-square bound, derived below), and
//!   each seed gives the same tokens;
//! - cutting drafted tokens out of the KV cache leaves the same logits as a
//!   run that never fed them, on the reference engine and the fast one,
//!   with sliding-window layers.

mod common;

use common::*;
use pulsar::commands::{self, Dtype, EngineKind};
use pulsar::engine::fast::{FastEngine, FastOptions, WeightFormats};
use pulsar::engine::jit_kernels::JitKernels;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::source::ModelSource;
use pulsar::sample::SamplerConfig;
use pulsar::speculative::{DraftOptions, Speculation};
use pulsar::tokenizer::Tokenizer;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

// ---------------------------------------------------------------------------
// The real model through the binary.

/// Runs the binary on the default model with 2 threads. `spec` runs get a
/// fixed step cost in the draft-length policy, so that drafts are made and
/// verified whatever the machine's timings say.
fn pulsar(args: &[&str], spec: &str, stdin: Option<&str>) -> Output {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pulsar"));
    cmd.args(args)
        .args(["--spec", spec, "--threads", "2", "-m"])
        .arg(model)
        .env("PULSAR_SPEC_STEP_COST", "0.02")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("binary starts");
    let mut input = child.stdin.take().expect("stdin");
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).expect("stdin written");
    }
    drop(input);
    let out = child.wait_with_output().expect("binary runs");
    assert!(
        out.status.success(),
        "pulsar {args:?} --spec {spec}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The number after `word ` in a stats line, e.g. `drafted 12`.
fn figure(line: &str, word: &str) -> Option<usize> {
    let at = line.find(&format!("{word} "))? + word.len() + 1;
    let digits: String = line[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// Sums of (drafted, accepted) over the stats lines of a run's stderr.
fn spec_figures(stderr: &str) -> (usize, usize) {
    stderr
        .lines()
        .filter(|l| l.contains("spec: drafted"))
        .fold((0, 0), |(d, a), l| {
            (
                d + figure(l, "drafted").expect("drafted count"),
                a + figure(l, "accepted").expect("accepted count"),
            )
        })
}

/// A file in a fresh temporary folder, removed when the returned value is
/// dropped: keep it until the children reading it have exited.
fn temp_file(name: &str, text: &str) -> ScratchFile {
    let path = ScratchFile::new("pulsar-spec-", name);
    std::fs::write(&path, text).expect("temp file written");
    path
}

const DOCUMENT: &str = "\
The harbour town of Ardmore keeps three lighthouses. The oldest, called the \
Grey Tower, was built in 1791 from granite carried by boat from the quarries \
at Kell. The second, the Red Light, stands on the breakwater and was lit for \
the first time on the night of 4 March 1864. The newest, the North Beacon, \
is an automatic light installed in 1972; it needs no keeper and is checked \
once a month by the harbour board.

The harbour board meets on the first Tuesday of every month in the old \
customs house. Its members are the harbour master, two elected fishermen \
and the mayor of Ardmore. Visitors may attend the meetings but may not \
speak unless the harbour master invites them to.";

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[test]
fn greedy_text_is_identical_with_and_without_speculation() {
    let document = temp_file("ardmore.txt", DOCUMENT);
    let document = document.to_str().expect("UTF-8 path");
    let code = repo_file("src/stop_strings.rs");
    let code = code.to_str().expect("UTF-8 path");
    // The first ~1,500 characters of the README, cut at a line end: about
    // 350 tokens, so that the prompt and 220 generated tokens cross the
    // default model's 512-token sliding window.
    let readme = std::fs::read_to_string(repo_file("README.md")).expect("README");
    let cut = readme[..1500].rfind('\n').expect("a line end");
    let long = temp_file("long.txt", &readme[..cut]);
    let long = long.to_str().expect("UTF-8 path");
    let cases: [(&str, Vec<&str>, bool); 5] = [
        (
            "quote from a document",
            vec![
                "run",
                "--chat",
                "-f",
                document,
                "-p",
                "When was the Red Light lit for the first time? Quote the sentence.",
                "-n",
                "96",
            ],
            true,
        ),
        (
            "rewrite a code file",
            vec![
                "run",
                "--chat",
                "-f",
                code,
                "-p",
                "Rewrite this code with the struct StopStrings renamed to StopScanner.",
                "-n",
                "160",
            ],
            true,
        ),
        (
            "free text",
            vec!["run", "--raw", "-p", "The capital of France is", "-n", "48"],
            false,
        ),
        (
            "counting",
            vec!["run", "--raw", "-p", "1, 2, 3, 4, 5, 6, 7, 8,", "-n", "64"],
            true,
        ),
        (
            "across the sliding window",
            vec!["run", "--raw", "-f", long, "-n", "220"],
            true,
        ),
    ];
    for (name, mut args, grounded) in cases {
        args.extend(["-t", "0"]);
        let off = pulsar(&args, "off", None);
        let on = pulsar(&args, "ngram", None);
        let on_err = String::from_utf8_lossy(&on.stderr);
        assert_eq!(
            String::from_utf8_lossy(&on.stdout),
            String::from_utf8_lossy(&off.stdout),
            "{name}: the text differs with --spec ngram ({on_err})"
        );
        let (drafted, accepted) = spec_figures(&on_err);
        println!("{name}: drafted {drafted}, accepted {accepted}");
        assert!(
            spec_figures(&String::from_utf8_lossy(&off.stderr)) == (0, 0),
            "{name}: --spec off drafted"
        );
        if grounded {
            // Otherwise the comparison would test nothing.
            assert!(accepted > 0, "{name}: no draft was accepted ({on_err})");
        }
        if name == "across the sliding window" {
            let stats = on_err
                .lines()
                .find(|l| l.contains("generated"))
                .expect("stats line");
            let prompt = figure(stats, "prompt").expect("prompt tokens");
            let generated = figure(stats, "generated").expect("generated tokens");
            assert!(
                prompt < 512 && prompt + generated > 512 + 16,
                "{stats}: the text should cross the 512-token window"
            );
        }
    }
}

#[test]
fn chat_replies_are_identical_with_and_without_speculation() {
    // The chat keeps its KV cache across turns; drafts fed and taken back
    // in one turn must leave it as the next turn expects. The second and
    // third turns repeat names of the first, so drafts come from earlier
    // turns too.
    let document = temp_file("ardmore-chat.txt", DOCUMENT);
    let document = document.to_str().expect("UTF-8 path");
    let turns = "Which lighthouse is the oldest, and when was it built?\n\
                 Who are the members of the harbour board?\n\
                 Repeat what you said about the Grey Tower.\n";
    let args = ["chat", "-t", "0", "-n", "80", "-f", document];
    let off = pulsar(&args, "off", Some(turns));
    let on = pulsar(&args, "ngram", Some(turns));
    let on_err = String::from_utf8_lossy(&on.stderr);
    assert_eq!(
        String::from_utf8_lossy(&on.stdout),
        String::from_utf8_lossy(&off.stdout),
        "chat replies differ with --spec ngram ({on_err})"
    );
    assert_eq!(
        on_err
            .lines()
            .filter(|l| l.contains("spec: drafted"))
            .count(),
        3,
        "one stats line with the speculation figures per reply: {on_err}"
    );
    let (_, accepted) = spec_figures(&on_err);
    assert!(accepted > 0, "no draft was accepted: {on_err}");
}

#[test]
fn seeded_sampling_gives_the_same_text_with_and_without_speculation() {
    // The sampler draws one number per emitted token from the same rows
    // either way (see src/speculative/mod.rs), so a seed fixes the text.
    let document = temp_file("ardmore-sampled.txt", DOCUMENT);
    let document = document.to_str().expect("UTF-8 path");
    for seed in ["1", "2"] {
        let args = [
            "run",
            "-f",
            document,
            "-p",
            "Retell the text above in your own words.",
            "-t",
            "0.7",
            "-s",
            seed,
            "-n",
            "96",
        ];
        let off = pulsar(&args, "off", None);
        let on = pulsar(&args, "ngram", None);
        assert_eq!(
            String::from_utf8_lossy(&on.stdout),
            String::from_utf8_lossy(&off.stdout),
            "seed {seed}: {}",
            String::from_utf8_lossy(&on.stderr)
        );
    }
}

/// Under an output constraint each row of a verify step is masked before
/// it is judged, and a draft is cut where the constraint would refuse it:
/// greedy and seeded output stays the same, and drafts copied from the
/// prompt are still accepted.
#[test]
fn constrained_output_is_identical_with_and_without_speculation() {
    let fruits = r#"{"type": "object", "properties": {"fruits": {"type": "array",
        "items": {"enum": ["apples", "pears", "plums"]}, "maxItems": 9}},
        "required": ["fruits"], "additionalProperties": false}"#;
    let cases: [(&str, Vec<&str>); 3] = [
        (
            "regex over a repeated sentence",
            vec![
                "--raw",
                "-p",
                "the cat sat on the mat. the cat sat on the mat. the cat sat on",
                "--regex",
                "[a-z .]+",
                "-n",
                "40",
                "-t",
                "0",
            ],
        ),
        (
            "JSON schema listing the prompt's words",
            vec![
                "-p",
                "Copy this list as JSON: apples, pears, plums, apples, pears, plums.",
                "--json-schema",
                fruits,
                "-t",
                "0",
            ],
        ),
        (
            "regex, sampled with a seed",
            vec![
                "--raw",
                "-p",
                "one two three, one two three, one two three, one two",
                "--regex",
                "[a-z ,]+",
                "-n",
                "32",
                "-t",
                "0.7",
                "-s",
                "11",
            ],
        ),
    ];
    let mut accepted_in_all = 0;
    for (name, case_args) in cases {
        let mut args = vec!["run"];
        args.extend(case_args);
        let off = pulsar(&args, "off", None);
        let on = pulsar(&args, "ngram", None);
        let on_err = String::from_utf8_lossy(&on.stderr);
        assert_eq!(
            String::from_utf8_lossy(&on.stdout),
            String::from_utf8_lossy(&off.stdout),
            "{name}: the text differs with --spec ngram ({on_err})"
        );
        assert!(!on.stdout.is_empty(), "{name}: nothing generated");
        let (drafted, accepted) = spec_figures(&on_err);
        println!("{name}: drafted {drafted}, accepted {accepted}");
        accepted_in_all += accepted;
    }
    // Otherwise the comparison would test nothing.
    assert!(
        accepted_in_all > 0,
        "no draft was accepted under a constraint"
    );
}

#[test]
fn a_bad_step_cost_variable_is_refused_by_name() {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["run", "-p", "Hi", "-n", "4", "-m"])
        .arg(model)
        .env("PULSAR_SPEC_STEP_COST", "fast")
        .output()
        .expect("binary runs");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("PULSAR_SPEC_STEP_COST=\"fast\""),
        "{stderr}"
    );
}

// ---------------------------------------------------------------------------
// The tiny oracle model through the library.

fn tiny_source(folder: &str) -> ModelSource {
    ModelSource::open(&oracle_dir().join(folder)).expect("tiny model opens")
}

fn tiny_tokenizer() -> Tokenizer {
    Tokenizer::from_hf_folder(&repo_file("tests/data/tiny_hf")).expect("tiny tokenizer")
}

/// Drafting whenever an n-gram matches (a fixed step cost of zero), so the
/// tests do not depend on timings.
fn eager() -> Speculation {
    Speculation::Ngram(DraftOptions {
        step_cost: Some(0.0),
        ..DraftOptions::default()
    })
}

/// A prompt with repeats, so drafts start from the first step.
const TINY_PROMPT: [u32; 13] = [2, 30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31];

/// Generates `n` tokens after [`TINY_PROMPT`] for each seed, reusing the
/// prompt's cache. Returns the tokens and (drafted, accepted).
fn tiny_samples(
    engine: &mut dyn Engine,
    sampling: SamplerConfig,
    seeds: std::ops::Range<u64>,
    n: usize,
    speculation: Speculation,
) -> (Vec<Vec<u32>>, usize, usize) {
    let tok = tiny_tokenizer();
    engine.truncate(0);
    let last = engine
        .forward(&TINY_PROMPT, LogitsWanted::Last)
        .expect("prompt");
    let (mut drafted, mut accepted) = (0, 0);
    let mut out = Vec::new();
    for seed in seeds {
        engine.truncate(TINY_PROMPT.len());
        let c = continuation(
            engine,
            &tok,
            sampling,
            seed,
            &TINY_PROMPT,
            last.clone(),
            n,
            speculation,
        );
        assert_eq!(c.generated, n);
        drafted += c.drafted;
        accepted += c.accepted;
        // The last token, right at the limit, is chosen but not fed.
        out.push(c.tokens);
    }
    (out, drafted, accepted)
}

#[test]
fn sampled_token_frequencies_agree_with_and_without_speculation() {
    // Temperature 0.05 with top-k 4 on the tiny model (logits within ±1)
    // leaves a few likely tokens per step and runs of repeats, so about half
    // of the drafts are accepted: both the acceptance and the rejection
    // branches of the rule are exercised many times.
    let sampling = SamplerConfig {
        temperature: 0.05,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
    };
    let src = tiny_source("tiny-gemma3-f32");
    let mut engine = ReferenceEngine::load(&src).expect("loads");
    const N: u64 = 1000;
    const LEN: usize = 12;
    // Different seeds for the two arms: independent samples, so this is a
    // test of the distributions, not of the seed-for-seed agreement (the
    // next test checks that).
    let (off, _, _) = tiny_samples(&mut engine, sampling, 0..N, LEN, Speculation::Off);
    let (on, drafted, accepted) = tiny_samples(&mut engine, sampling, N..2 * N, LEN, eager());
    println!("drafted {drafted}, accepted {accepted}");
    assert!(
        accepted > 500 && drafted - accepted > 500,
        "drafts must be both accepted and rejected often: {accepted} of {drafted}"
    );

    // Per position, the token's frequencies. Under the null hypothesis
    // (speculation keeps the distribution) each position's statistic is
    // χ²(df); testing all LEN positions at level 1e-4 / LEN each
    // (Bonferroni), a correct implementation fails with probability at
    // most 1e-4 over the choice of seeds. z = 4.26 is the normal quantile
    // of 1 − 1e-4/12 ≈ 1 − 8.3e-6.
    assert_positions_agree(&off, &on, LEN, 4.26, "with speculation");

    // Repeats of the previous token: the event drafts most often propose
    // here, so a rule that accepts drafts too easily shows up as more of
    // them. Each sequence's count is one independent draw; the difference
    // of the two means over its standard error is normal under the null,
    // and |z| < 4.5 fails a correct implementation with probability < 1e-5.
    let repeats = |s: &Vec<u32>| s.windows(2).filter(|w| w[0] == w[1]).count() as f64;
    let stats = |set: &[Vec<u32>]| {
        let xs: Vec<f64> = set.iter().map(repeats).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (xs.len() - 1) as f64;
        (mean, var)
    };
    let ((m_off, v_off), (m_on, v_on)) = (stats(&off), stats(&on));
    let z = (m_on - m_off) / ((v_off + v_on) / N as f64).sqrt();
    println!("repeats per sequence: {m_off:.3} off, {m_on:.3} on, z = {z:.2}");
    assert!(
        z.abs() < 4.5,
        "repeats per sequence: {m_off:.3} without speculation, {m_on:.3} with (z = {z:.2})"
    );
}

#[test]
fn each_seed_gives_the_same_tokens_with_and_without_speculation() {
    // The reference engine computes a verify step's rows exactly as single
    // steps, so the sampler's draws meet the same numbers either way; with
    // a repetition penalty the history must include the accepted drafts.
    let src = tiny_source("tiny-gemma3-f32");
    let mut engine = ReferenceEngine::load(&src).expect("loads");
    for sampling in [
        SamplerConfig {
            temperature: 0.05,
            top_k: 4,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
        },
        SamplerConfig {
            temperature: 0.1,
            top_k: 8,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.05,
            repeat_last_n: 8,
        },
        SamplerConfig::greedy(),
    ] {
        let (off, _, _) = tiny_samples(&mut engine, sampling, 0..100, 16, Speculation::Off);
        let (on, drafted, accepted) = tiny_samples(&mut engine, sampling, 0..100, 16, eager());
        assert!(
            accepted > 0 && accepted < drafted,
            "{accepted} of {drafted}"
        );
        for (seed, (a, b)) in off.iter().zip(&on).enumerate() {
            assert_eq!(a, b, "{sampling:?}, seed {seed}");
        }
    }
}

/// Feeds `prefix`, then `[sampled, draft…]` in one step, keeps the first
/// `keep` drafted tokens, and feeds `next` in one step; returns the rows of
/// that last step. The second engine is fed only what was kept, in the same
/// steps, and must give the same rows bit for bit.
fn rollback_rows(
    engine: &mut dyn Engine,
    prefix: &[u32],
    step: &[u32],
    keep: usize,
    next: &[u32],
) -> Vec<f32> {
    engine.truncate(0);
    engine.forward(prefix, LogitsWanted::Last).expect("prefix");
    engine
        .forward(step, LogitsWanted::All)
        .expect("verify step");
    engine.truncate(prefix.len() + 1 + keep);
    engine.forward(next, LogitsWanted::All).expect("next step")
}

fn never_fed_rows(
    engine: &mut dyn Engine,
    prefix: &[u32],
    step: &[u32],
    keep: usize,
    next: &[u32],
) -> Vec<f32> {
    engine.truncate(0);
    engine.forward(prefix, LogitsWanted::Last).expect("prefix");
    engine
        .forward(&step[..1 + keep], LogitsWanted::All)
        .expect("kept step");
    engine.forward(next, LogitsWanted::All).expect("next step")
}

/// Rollback cases on a model with a sliding window of `window` tokens: the
/// rejected drafts lie inside and across the window of the next step.
fn check_rollback(make: &mut dyn FnMut() -> Box<dyn Engine>, vocab: u32, window: usize) {
    let token = |i: usize| (4 + (i * 37 + 11) % (vocab as usize - 4)) as u32;
    let mut used = make();
    let mut fresh = make();
    for prefix_len in [1, window - 3, window + 5, 3 * window] {
        let prefix: Vec<u32> = std::iter::once(2)
            .chain((1..prefix_len).map(token))
            .collect();
        let step: Vec<u32> = (0..9).map(|i| token(500 + i)).collect();
        let next: Vec<u32> = (0..4).map(|i| token(900 + i)).collect();
        for keep in [0, 3, 8] {
            let got = rollback_rows(used.as_mut(), &prefix, &step, keep, &next);
            let want = never_fed_rows(fresh.as_mut(), &prefix, &step, keep, &next);
            assert_eq!(got.len(), want.len());
            let (diff, at) = max_abs_diff(&got, &want);
            assert!(
                got == want,
                "prefix {prefix_len}, keep {keep}: logits after rollback differ by {diff} at {at}"
            );
        }
        // And against one prefill of the whole final sequence, which sums
        // in another order on the fast engine: equal to rounding.
        let keep = 3;
        let got = rollback_rows(used.as_mut(), &prefix, &step, keep, &next);
        let whole: Vec<u32> = prefix
            .iter()
            .chain(&step[..1 + keep])
            .chain(&next)
            .copied()
            .collect();
        fresh.truncate(0);
        let all = fresh.forward(&whole, LogitsWanted::All).expect("whole");
        let rows = &all[all.len() - got.len()..];
        let scale = rows.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let (diff, _) = max_abs_diff(&got, rows);
        assert!(
            diff <= 2e-3 * scale,
            "prefix {prefix_len}: rollback differs from a whole prefill by {diff} (scale {scale})"
        );
    }
}

#[test]
fn kv_rollback_equals_a_recompute_on_the_reference_engine() {
    // Tiny Gemma 3: five sliding-window layers of 8 tokens, one global.
    let src = tiny_source("tiny-gemma3-f32");
    check_rollback(
        &mut || Box::new(ReferenceEngine::load(&src).expect("loads")),
        512,
        8,
    );
}

#[test]
fn kv_rollback_equals_a_recompute_on_the_fast_engine() {
    let src = std::sync::Arc::new(tiny_source("tiny-gemma3-f16"));
    check_rollback(
        &mut || {
            let opts = FastOptions {
                threads: 2,
                context: 64,
                format: None,
                prefill_chunk: 64,
                in_place: false,
                native: false,
            };
            let format = FastEngine::weight_format_for(&src, &opts).expect("format");
            let kernels = JitKernels::build(&src.config, WeightFormats::uniform(format), 2)
                .expect("JIT builds on this CPU");
            Box::new(FastEngine::load(&src, Box::new(kernels), &opts).expect("loads"))
        },
        512,
        8,
    );
}

#[test]
fn kv_rollback_equals_a_recompute_on_the_real_model() {
    // The default model's local layers see 512 tokens: prefixes around
    // and past that, in the engine `run` and `chat` use.
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let make = || {
        let src = ModelSource::open(&path).expect("opens");
        let args = commands::EngineArgs {
            kind: EngineKind::Jit,
            threads: 2,
            dtype: Dtype::Native,
            in_place: false,
            flags: commands::SharedFlags::default(),
        };
        commands::open_engine(src, &args, 1024)
            .expect("engine loads")
            .engine
    };
    let mut used = make();
    let mut fresh = make();
    let token = |i: usize| (300 + (i * 7919) % 20_000) as u32;
    for prefix_len in [509, 520] {
        let prefix: Vec<u32> = std::iter::once(2)
            .chain((1..prefix_len).map(token))
            .collect();
        let step: Vec<u32> = (0..9).map(|i| token(5000 + i)).collect();
        let next: Vec<u32> = (0..3).map(|i| token(7000 + i)).collect();
        for keep in [0, 5] {
            let got = rollback_rows(used.as_mut(), &prefix, &step, keep, &next);
            let want = never_fed_rows(fresh.as_mut(), &prefix, &step, keep, &next);
            let (diff, at) = max_abs_diff(&got, &want);
            assert!(
                got == want,
                "prefix {prefix_len}, keep {keep}: logits after rollback differ by {diff} at {at}"
            );
        }
    }
}
