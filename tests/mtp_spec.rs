//! Speculative decoding with Gemma 4's assistant (`--spec mtp`) changes
//! nothing but the speed, on the tiny target + assistant pair of
//! `tests/data/gemma4-assistant`:
//!
//! - greedy text through the binary is byte-identical to `--spec off`, on
//!   the JIT and the reference engine, with the assistant given by
//!   `--draft` or found beside the model by name;
//! - through the library, each seed gives the same tokens with and without
//!   it (greedy and sampled, on both engines), and sampled tokens have the
//!   same frequencies over many seeds (the two-sample chi-square bound of
//!   tests/speculative.rs);
//! - after every verify step, rejected or not, the drafter reads exactly
//!   the accepted cache: its next round equals a round of an engine that
//!   was fed only the accepted tokens.

mod common;

use common::{FAVOURED_TOKEN, assert_positions_agree, continuation, favouring_pair};
use pulsar::engine::fast::{
    DraftSource, EngineOptions, FastEngine, FastOptions, LaunchTuning, Opened,
};
use pulsar::engine::q8_input::InputPrecision;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::source::ModelSource;
use pulsar::sample::SamplerConfig;
use pulsar::speculative::{DraftOptions, Speculation};
use pulsar::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma4-assistant")
}

// ---------------------------------------------------------------------------
// Through the binary.

/// `pulsar run` greedy on the GGUF target (it carries the stand-in
/// tokenizer) with a fixed step cost, so that drafts are made whatever the
/// machine's timings say.
fn run(model: &Path, extra: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["run", "--no-tune", "-t", "0", "-n", "48", "--threads", "2"])
        .args(["-p", "the cat sat on the mat and the dog"])
        .arg("-m")
        .arg(model)
        .args(extra)
        .env("PULSAR_SPEC_STEP_COST", "0.02")
        .output()
        .expect("the pulsar binary runs");
    assert!(
        out.status.success(),
        "pulsar run {extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// (drafted, accepted) from a run's stats line.
fn spec_figures(stderr: &str) -> Option<(usize, usize)> {
    let line = stderr.lines().find(|l| l.contains("spec: drafted"))?;
    let number = |word: &str| -> usize {
        let at = line.find(&format!("{word} ")).expect("figure") + word.len() + 1;
        line[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .expect("a count")
    };
    Some((number("drafted"), number("accepted")))
}

#[test]
fn greedy_text_is_identical_with_and_without_the_assistant() {
    let target = data().join("tiny-g4a-target-f32.gguf");
    for assistant in ["tiny-g4a-assistant-f32", "tiny-g4a-assistant-f32.gguf"] {
        let draft = data().join(assistant);
        let draft = draft.to_str().expect("a UTF-8 path");
        for engine in ["jit", "reference"] {
            let off = run(&target, &["--engine", engine, "--spec", "off"]);
            let on = run(
                &target,
                &["--engine", engine, "--spec", "mtp", "--draft", draft],
            );
            assert_eq!(
                String::from_utf8_lossy(&on.stdout),
                String::from_utf8_lossy(&off.stdout),
                "{assistant} on {engine}"
            );
            let stderr = String::from_utf8_lossy(&on.stderr);
            let (drafted, _) = spec_figures(&stderr).expect("spec stats");
            assert!(drafted > 0, "{assistant} on {engine}: {stderr}");
            assert!(stderr.contains("drafts from"), "{stderr}");
        }
    }
}

#[test]
fn an_assistant_beside_the_model_is_found_by_name_and_drafts_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-it-f32.gguf");
    std::fs::copy(data().join("tiny-g4a-target-f32.gguf"), &model).unwrap();
    std::fs::copy(
        data().join("tiny-g4a-assistant-f32.gguf"),
        dir.path().join("tiny-it-f32-assistant.gguf"),
    )
    .unwrap();
    let found = run(&model, &[]);
    let stderr = String::from_utf8_lossy(&found.stderr);
    assert!(stderr.contains("tiny-it-f32-assistant.gguf"), "{stderr}");
    assert!(
        spec_figures(&stderr).is_some_and(|(d, _)| d > 0),
        "{stderr}"
    );
    // --spec ngram leaves it unused.
    let ngram = run(&model, &["--spec", "ngram"]);
    assert!(!String::from_utf8_lossy(&ngram.stderr).contains("drafts from"));
    assert_eq!(found.stdout, ngram.stdout);
    // --spec mtp without an assistant is refused in one line.
    let alone = dir.path().join("other.gguf");
    std::fs::copy(data().join("tiny-g4a-target-f32.gguf"), &alone).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args([
            "run",
            "--no-tune",
            "-n",
            "4",
            "-p",
            "hi",
            "--spec",
            "mtp",
            "-m",
        ])
        .arg(&alone)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("--spec mtp needs a Gemma 4 assistant"),
        "{stderr}"
    );
}

// ---------------------------------------------------------------------------
// Through the library.

fn tokenizer() -> Tokenizer {
    let src = ModelSource::open(&data().join("tiny-g4a-target-f32.gguf")).unwrap();
    pulsar::commands::run::load_tokenizer(&src).expect("the stand-in tokenizer")
}

/// The reference engine with the f32 assistant attached.
fn reference_engine() -> Box<dyn Engine> {
    let target = ModelSource::open(&data().join("tiny-g4a-target-f32")).unwrap();
    let assistant = ModelSource::open(&data().join("tiny-g4a-assistant-f32")).unwrap();
    let mut engine = ReferenceEngine::load(&target).unwrap();
    engine.attach_assistant(&assistant, &target.path).unwrap();
    Box::new(engine)
}

/// The fast engine (JIT, FP16) with the f32 assistant attached.
fn fast_engine() -> Box<dyn Engine> {
    let target = Arc::new(ModelSource::open(&data().join("tiny-g4a-target-f32")).unwrap());
    let assistant = Arc::new(ModelSource::open(&data().join("tiny-g4a-assistant-f32")).unwrap());
    let options = EngineOptions {
        load: FastOptions {
            threads: 2,
            context: 256,
            format: None,
            prefill_chunk: 0,
            in_place: false,
            native: false,
        },
        input_precision: InputPrecision::default(),
        tuning: LaunchTuning::Off {
            why: "tests".into(),
        },
        verbose: false,
    };
    let plan =
        FastEngine::plan_drafting(target, Some(DraftSource::File(assistant)), &options).unwrap();
    match plan.open().unwrap() {
        Opened::Fast { engine, .. } => engine,
        Opened::NoJit { reason } => panic!("the JIT does not run here: {reason}"),
    }
}

/// Drafting at every step (a fixed step cost of zero).
fn eager() -> Speculation {
    Speculation::Mtp(DraftOptions {
        step_cost: Some(0.0),
        ..DraftOptions::default()
    })
}

const PROMPT: [u32; 9] = [2, 40, 41, 97, 200, 17, 301, 55, 9];

/// `n` tokens after [`PROMPT`] for each seed, the prompt's cache reused.
/// Returns the tokens and (drafted, accepted).
fn samples(
    engine: &mut dyn Engine,
    sampling: SamplerConfig,
    seeds: std::ops::Range<u64>,
    n: usize,
    speculation: Speculation,
) -> (Vec<Vec<u32>>, usize, usize) {
    let tok = tokenizer();
    engine.truncate(0);
    let last = engine.forward(&PROMPT, LogitsWanted::Last).unwrap();
    let (mut drafted, mut accepted) = (0, 0);
    let mut out = Vec::new();
    for seed in seeds {
        engine.truncate(PROMPT.len() - 1);
        // The prompt's last token again, so that its hidden state is the
        // one the engine keeps (a new run per seed).
        engine
            .forward(&PROMPT[PROMPT.len() - 1..], LogitsWanted::Last)
            .unwrap();
        let c = continuation(
            engine,
            &tok,
            sampling,
            seed,
            &PROMPT,
            last.clone(),
            n,
            speculation,
        );
        drafted += c.drafted;
        accepted += c.accepted;
        out.push(c.tokens);
    }
    (out, drafted, accepted)
}

const SAMPLED: SamplerConfig = SamplerConfig {
    temperature: 1.0,
    top_k: 0,
    top_p: 1.0,
    min_p: 0.0,
    repeat_penalty: 1.0,
    repeat_last_n: 64,
};

#[test]
fn each_seed_gives_the_same_tokens_with_and_without_the_assistant() {
    // Both engines compute a verify step's rows exactly as single steps,
    // so the sampler's draws meet the same numbers either way.
    for (name, make) in [
        ("reference", reference_engine as fn() -> Box<dyn Engine>),
        ("jit", fast_engine),
    ] {
        let mut engine = make();
        for sampling in [
            SamplerConfig::greedy(),
            SAMPLED,
            SamplerConfig {
                temperature: 0.3,
                top_k: 8,
                top_p: 0.95,
                min_p: 0.05,
                repeat_penalty: 1.1,
                repeat_last_n: 8,
            },
        ] {
            let (off, _, _) = samples(engine.as_mut(), sampling, 0..12, 16, Speculation::Off);
            let (on, drafted, accepted) = samples(engine.as_mut(), sampling, 0..12, 16, eager());
            println!("{name} {sampling:?}: accepted {accepted} of {drafted}");
            assert!(drafted > 0, "{name}: drafts were made");
            for (seed, (a, b)) in off.iter().zip(&on).enumerate() {
                assert_eq!(a, b, "{name} {sampling:?}, seed {seed}");
            }
        }
    }
}

/// After a verify step that kept `keep` of its drafts, a round reads
/// exactly what an engine fed only the kept tokens reads: the same draft
/// tokens and logits, bit for bit (the cut-back cache and the kept final
/// hidden state of the last accepted position).
#[test]
fn after_a_rejection_the_assistant_reads_exactly_the_accepted_cache() {
    for (name, make) in [
        ("reference", reference_engine as fn() -> Box<dyn Engine>),
        ("jit", fast_engine),
    ] {
        let drafts = [301u32, 7, 7, 480, 12, 99];
        for keep in [0, 1, 3, 6] {
            let mut verified = make();
            verified.forward(&PROMPT, LogitsWanted::Last).unwrap();
            let mut step = vec![123u32];
            step.extend_from_slice(&drafts);
            verified.forward(&step, LogitsWanted::All).unwrap();
            let accepted = PROMPT.len() + 1 + keep;
            verified.truncate(accepted);

            let mut fresh = make();
            fresh.forward(&PROMPT, LogitsWanted::Last).unwrap();
            fresh.forward(&step[..1 + keep], LogitsWanted::All).unwrap();

            let next = 64;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let ta = verified.draft(next, 8, Some(&mut a)).unwrap();
            let tb = fresh.draft(next, 8, Some(&mut b)).unwrap();
            assert_eq!(ta, tb, "{name}, {keep} kept");
            assert!(a == b, "{name}, {keep} kept: the draft logits differ");
            // And the round itself left the target untouched.
            assert_eq!(verified.position(), accepted);
        }
    }
}

// ---------------------------------------------------------------------------
// A pair edited so that drafts are often right.

/// The reference engine on the edited pair.
fn favouring_engine(dir: &Path) -> Box<dyn Engine> {
    let (target, assistant) = favouring_pair(dir);
    let t = ModelSource::open(&target).unwrap();
    let mut engine = ReferenceEngine::load(&t).unwrap();
    engine
        .attach_assistant(&ModelSource::open(&assistant).unwrap(), &t.path)
        .unwrap();
    Box::new(engine)
}

#[test]
fn sampled_token_frequencies_agree_with_and_without_the_assistant() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = favouring_engine(dir.path());
    const N: u64 = 400;
    const LEN: usize = 8;
    let sampling = SamplerConfig {
        temperature: 1.0,
        ..SAMPLED
    };
    // Different seeds for the two arms: a test of the distributions.
    let (off, _, _) = samples(engine.as_mut(), sampling, 0..N, LEN, Speculation::Off);
    let (on, drafted, accepted) = samples(engine.as_mut(), sampling, N..2 * N, LEN, eager());
    println!("drafted {drafted}, accepted {accepted}");
    assert!(
        accepted > 300 && drafted - accepted > 300,
        "drafts must be both accepted and rejected often: {accepted} of {drafted}"
    );
    // Each position's token frequencies, every position at level 1e-4 /
    // LEN (z = 4.2): a correct implementation fails with probability at
    // most 1e-4.
    assert_positions_agree(&off, &on, LEN, 4.2, "with the assistant");
    // The favoured token is what the drafts propose: a rule that accepts
    // them too easily shows as more of it. Per sequence, its count; the
    // difference of the means over its standard error, |z| < 4.5.
    let favoured =
        |s: &Vec<u32>| s.iter().filter(|&&x| x as usize == FAVOURED_TOKEN).count() as f64;
    let stats = |set: &[Vec<u32>]| {
        let xs: Vec<f64> = set.iter().map(favoured).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (xs.len() - 1) as f64;
        (mean, var)
    };
    let ((m_off, v_off), (m_on, v_on)) = (stats(&off), stats(&on));
    let z = (m_on - m_off) / ((v_off + v_on) / N as f64).sqrt();
    println!("favoured tokens per sequence: {m_off:.3} off, {m_on:.3} on, z = {z:.2}");
    assert!(
        z.abs() < 4.5,
        "{m_off:.3} without the assistant, {m_on:.3} with (z = {z:.2})"
    );
    // And seed for seed, the same tokens.
    let (same, _, _) = samples(engine.as_mut(), sampling, N..N + 50, LEN, Speculation::Off);
    assert_eq!(same[..], on[..50]);
}

/// `bench --draft` times the assistant's draft tokens beside the model and
/// prices decoding with them at each acceptance rate from the m-curve (no
/// timing is checked, only what the report holds: a draft round reads the
/// searched clusters of the head, not all of it, and the best number of
/// drafts never gives fewer tokens a step than plain decoding).
#[test]
fn bench_prices_drafting_at_each_acceptance_rate() {
    let target = data().join("tiny-g4a-target-f32");
    let assistant = data().join("tiny-g4a-assistant-f32");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["bench", "--no-tune", "--pp", "4", "--tg", "2", "--json"])
        .arg("-m")
        .arg(&target)
        .arg("--draft")
        .arg(&assistant)
        .output()
        .expect("pulsar runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
    assert_eq!(report["m_curve"].as_array().map(Vec::len), Some(16));
    let d = &report["drafting"];
    assert!(d["draft_token_ms"].as_f64().unwrap() > 0.0, "{d}");
    let bytes = d["bytes_per_draft_token"].as_u64().unwrap();
    assert!(bytes > 0, "{d}");
    let rates: Vec<f64> = d["at_acceptance"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["acceptance"].as_f64().unwrap())
        .collect();
    assert_eq!(rates, [0.5, 0.6, 0.7, 0.8, 0.9]);
    for s in d["at_acceptance"].as_array().unwrap() {
        let drafts = s["drafts"].as_u64().unwrap();
        assert!(drafts <= 8, "{s}");
        assert!(s["tokens_per_step"].as_f64().unwrap() >= 1.0, "{s}");
        assert!(s["speedup"].as_f64().unwrap() >= 1.0, "{s}");
    }
    // A draft token with every cluster searched reads more.
    let whole = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["bench", "--no-tune", "--pp", "4", "--tg", "2", "--json"])
        .arg("-m")
        .arg(&target)
        .arg("--draft")
        .arg(data().join("tiny-g4a-assistant-f32.gguf"))
        .output()
        .expect("pulsar runs");
    assert!(
        whole.status.success(),
        "{}",
        String::from_utf8_lossy(&whole.stderr)
    );
    let whole: serde_json::Value = serde_json::from_slice(&whole.stdout).expect("a JSON report");
    let whole_bytes = whole["drafting"]["bytes_per_draft_token"].as_u64().unwrap();
    assert!(whole_bytes > bytes, "{whole_bytes} against {bytes}");
}

/// An assistant shape `bench` does not know is refused in one line that
/// names the ones it does.
#[test]
fn bench_refuses_an_unknown_assistant_shape() {
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(["bench", "--no-tune", "--pp", "4", "--tg", "2"])
        .arg("-m")
        .arg(data().join("tiny-g4a-target-f32"))
        .args(["--draft-shape", "gemma4-e9b-assistant"])
        .output()
        .expect("pulsar runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("gemma4-e9b-assistant") && stderr.contains("gemma4-e2b-assistant"),
        "{stderr}"
    );
}
