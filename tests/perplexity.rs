//! `pulsar perplexity`: the window rule, the error formula, the base file
//! and KL on made-up numbers, then the command on the default model.

use anyhow::Result;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::config::ModelConfig;
use pulsar::perplexity::base_file::{BaseHeader, BaseLogits, BasePosition, BaseWriter, mismatch};
use pulsar::perplexity::kl::{KlStats, bucket_kl};
use pulsar::perplexity::logprobs::{log_mass_outside, log_softmax_in_place, top_k};
use pulsar::perplexity::measure::measure;
use pulsar::perplexity::stats::NllStats;
use pulsar::perplexity::windows::{LOGITS_PIECE, WindowPlan};
use std::path::Path;
use std::process::Command;
use tempfile::TempDir;

const VOCAB: usize = 5;
const BOS: u32 = 2;

/// An engine whose logits after token `t` are 0 everywhere but ln 3 at
/// `(t + 1) % 5`: the next token is `t + 1` with probability 3/7, any
/// other with 1/7. It records what each fresh cache was fed.
struct Successor {
    config: ModelConfig,
    cached: Vec<u32>,
    /// Every cache's tokens, one entry per `truncate(0)`.
    fed: Vec<Vec<u32>>,
    /// The most tokens one `LogitsWanted::All` call asked for.
    largest_all: usize,
}

impl Successor {
    fn new() -> Successor {
        let mut config = pulsar::model::presets::shape("gemma3-270m").expect("known shape");
        config.vocab_size = VOCAB;
        Successor {
            config,
            cached: Vec::new(),
            fed: Vec::new(),
            largest_all: 0,
        }
    }

    fn row(token: u32) -> Vec<f32> {
        let mut row = vec![0.0; VOCAB];
        row[(token as usize + 1) % VOCAB] = 3f32.ln();
        row
    }
}

impl Engine for Successor {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn position(&self) -> usize {
        self.cached.len()
    }
    fn capacity(&self) -> usize {
        10_000
    }
    fn truncate(&mut self, len: usize) {
        self.cached.truncate(len);
        if len == 0 {
            self.fed.push(Vec::new());
        }
    }
    fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        self.cached.extend_from_slice(tokens);
        if let Some(fed) = self.fed.last_mut() {
            fed.extend_from_slice(tokens);
        }
        Ok(match wanted {
            LogitsWanted::All => {
                self.largest_all = self.largest_all.max(tokens.len());
                tokens.iter().flat_map(|&t| Successor::row(t)).collect()
            }
            LogitsWanted::Last => tokens
                .last()
                .map(|&t| Successor::row(t))
                .unwrap_or_default(),
        })
    }

    // This fake's hidden states are its logits (an identity LM head).
    fn final_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward(tokens, LogitsWanted::All)
    }
}

fn measure_all(engine: &mut Successor, tokens: &[u32], plan: &WindowPlan) -> (NllStats, Vec<u32>) {
    let mut targets = Vec::new();
    let stats = measure(
        engine,
        tokens,
        plan,
        BOS,
        &mut |row| {
            assert_eq!(row.index, targets.len());
            targets.push(row.target);
            Ok(())
        },
        &mut |_, _| {},
    )
    .unwrap();
    (stats, targets)
}

#[test]
fn windows_score_their_second_half_from_the_previous_positions_logits() {
    // 13 tokens at -c 6: two whole windows (the 13th token is left out),
    // first = 3, so logits at positions 3 and 4 predict positions 4 and 5.
    let tokens = [2, 0, 1, 2, 3, 4, 0, 1, 1, 1, 1, 1, 4];
    let plan = WindowPlan::new(tokens.len(), 6, None).unwrap();
    assert_eq!(plan.windows, 2);
    assert_eq!(plan.scored_per_window(), 2);
    let mut engine = Successor::new();
    let (stats, targets) = measure_all(&mut engine, &tokens, &plan);
    // Each window to a fresh cache, its first token made BOS, its last
    // token never fed.
    assert_eq!(engine.fed, vec![vec![2, 0, 1, 2, 3], vec![2, 1, 1, 1, 1]]);
    assert_eq!(targets, vec![3, 4, 1, 1]);
    // Window 1: 2→3 and 3→4 are the favoured successors (p = 3/7); window 2:
    // 1→1 twice, an unfavoured one (p = 1/7).
    let expected_mean = (2.0 * (7.0f64 / 3.0).ln() + 2.0 * 7.0f64.ln()) / 4.0;
    assert_eq!(stats.count(), 4);
    assert!((stats.mean() - expected_mean).abs() < 1e-6);
    assert!((stats.perplexity() - 7.0 / 3f64.sqrt()).abs() < 1e-5);
}

#[test]
fn long_windows_ask_for_logits_in_bounded_pieces_with_the_same_result() {
    let n_ctx = 3 * LOGITS_PIECE;
    let tokens: Vec<u32> = (0..2 * n_ctx as u32)
        .map(|i| (i * i + 1) % VOCAB as u32)
        .collect();
    let plan = WindowPlan::new(tokens.len(), n_ctx, None).unwrap();
    let mut engine = Successor::new();
    let (stats, _) = measure_all(&mut engine, &tokens, &plan);
    assert!(
        engine.largest_all <= LOGITS_PIECE,
        "asked for {} rows at once",
        engine.largest_all
    );
    // The same numbers by hand: the successor rule over each window's second half.
    let mut by_hand = NllStats::default();
    for w in 0..2 {
        let window = &tokens[w * n_ctx..(w + 1) * n_ctx];
        for i in n_ctx / 2 + 1..n_ctx {
            let favoured = (window[i - 1] + 1) % VOCAB as u32 == window[i];
            by_hand.add(if favoured {
                (7.0f64 / 3.0).ln()
            } else {
                7.0f64.ln()
            });
        }
    }
    assert_eq!(stats.count(), by_hand.count());
    assert!((stats.mean() - by_hand.mean()).abs() < 1e-6);
}

#[test]
fn too_short_texts_and_no_windows_are_refused_by_name() {
    let err = WindowPlan::new(11, 6, None).unwrap_err().to_string();
    assert!(
        err.contains("11 tokens") && err.contains("-c 6") && err.contains("12"),
        "{err}"
    );
    assert!(WindowPlan::new(12, 6, None).is_ok());
    assert_eq!(WindowPlan::new(40, 6, Some(2)).unwrap().windows, 2);
    assert_eq!(WindowPlan::new(40, 6, Some(99)).unwrap().windows, 6);
    assert!(WindowPlan::new(40, 6, Some(0)).is_err());
    assert!(WindowPlan::new(40, 3, None).is_err());
}

#[test]
fn error_is_llama_perplexitys_standard_error_carried_through_exp() {
    let mut stats = NllStats::default();
    for x in [1.0, 2.0, 3.0, 4.0] {
        stats.add(x);
    }
    // mean 2.5, E[x²] 7.5, variance 1.25, error of the mean sqrt(1.25 / 3).
    let ppl = 2.5f64.exp();
    let error = ppl * (1.25f64 / 3.0).sqrt();
    assert!((stats.perplexity() - ppl).abs() < 1e-9);
    assert!((stats.perplexity_error().unwrap() - error).abs() < 1e-9);
    assert_eq!(
        stats.result_line(),
        format!("PPL = {ppl:.4} +/- {error:.4}")
    );
    let mut one = NllStats::default();
    one.add(1.0);
    assert_eq!(one.perplexity_error(), None);
}

#[test]
fn log_softmax_top_k_and_tail_mass() {
    let mut row = vec![0.0, 3f32.ln(), 0.0, 2f32.ln(), f32::NAN];
    assert!(
        log_softmax_in_place(&mut row).is_err(),
        "a NaN logit must be an error"
    );
    let mut row = vec![0.0, 3f32.ln(), 0.0, 2f32.ln()]; // 1, 3, 1, 2 out of 7
    log_softmax_in_place(&mut row).unwrap();
    let p: Vec<f32> = row.iter().map(|x| x.exp()).collect();
    for (got, want) in p.iter().zip([1.0, 3.0, 1.0, 2.0]) {
        assert!((got - want / 7.0).abs() < 1e-6);
    }
    let mut scratch = Vec::new();
    let top = top_k(&row, 3, &mut scratch);
    assert_eq!(
        top.iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![1, 3, 0],
        "ties in id order"
    );
    assert!((log_mass_outside(&row, &[1, 3, 0]) - (1.0f32 / 7.0).ln()).abs() < 1e-6);
    assert!((log_mass_outside(&row, &[1]) - (4.0f32 / 7.0).ln()).abs() < 1e-6);
    assert_eq!(log_mass_outside(&row, &[0, 1, 2, 3]), f32::NEG_INFINITY);
}

fn log_probs(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

#[test]
fn kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_with_less() {
    let p = [0.5, 0.2, 0.15, 0.1, 0.05];
    let q = [0.3, 0.3, 0.2, 0.1, 0.1];
    let (base_row, run_row) = (log_probs(&p), log_probs(&q));
    let exact: f64 = p.iter().zip(&q).map(|(p, q)| p * (p / q).ln()).sum();
    let mut scratch = Vec::new();
    let whole = BasePosition::of_row(&base_row, 0, VOCAB, &mut scratch);
    assert!((bucket_kl(&whole, &run_row) - exact).abs() < 1e-6);
    // Top 2 of the base: tokens 0 and 1 kept, the rest one bucket.
    let top2 = BasePosition::of_row(&base_row, 0, 2, &mut scratch);
    let buckets = 0.5 * (0.5f64 / 0.3).ln() + 0.2 * (0.2f64 / 0.3).ln() + 0.3 * (0.3f64 / 0.4).ln();
    let kl2 = bucket_kl(&top2, &run_row);
    assert!((kl2 - buckets).abs() < 1e-6, "{kl2} vs {buckets}");
    assert!(kl2 <= exact + 1e-9);
}

#[test]
fn kl_against_itself_is_zero_and_against_a_perturbed_copy_positive() {
    let rows = [
        log_probs(&[0.5, 0.2, 0.15, 0.1, 0.05]),
        log_probs(&[0.1, 0.6, 0.1, 0.1, 0.1]),
    ];
    let mut scratch = Vec::new();
    let base: Vec<BasePosition> = rows
        .iter()
        .map(|r| BasePosition::of_row(r, 1, 3, &mut scratch))
        .collect();
    let mut same = KlStats::default();
    for (b, r) in base.iter().zip(&rows) {
        same.add(b, r);
    }
    assert_eq!(same.mean(), 0.0);
    assert_eq!(same.top1_percent(), 100.0);
    // The second row's favourite moves from token 1 to token 2.
    let perturbed = [
        log_probs(&[0.45, 0.25, 0.15, 0.1, 0.05]),
        log_probs(&[0.1, 0.3, 0.4, 0.1, 0.1]),
    ];
    let mut other = KlStats::default();
    for (b, r) in base.iter().zip(&perturbed) {
        other.add(b, r);
    }
    assert!(other.mean() > 0.01, "{}", other.mean());
    assert_eq!(other.top1_agreements(), 1);
    assert_eq!(other.top1_percent(), 50.0);
    assert!(other.percentile_99() >= other.mean());
}

/// A fresh folder for one test's files, removed when the test ends, pass
/// or fail (a failed assertion unwinds and drops it).
fn scratch() -> TempDir {
    tempfile::Builder::new()
        .prefix("pulsar-ppl-test-")
        .tempdir()
        .expect("temp folder")
}

fn sample_header() -> BaseHeader {
    BaseHeader {
        n_ctx: 6,
        vocab: VOCAB,
        top_k: 2,
        tokens: vec![2, 0, 1, 2, 3, 4, 0, 1, 1, 1, 1, 1],
        n_positions: 4,
    }
}

fn sample_positions() -> Vec<BasePosition> {
    (0..4)
        .map(|i| BasePosition {
            nll: 0.5 + i as f32,
            log_rest: -1.0 - i as f32,
            top: vec![(i, -0.25), (4 - i, -2.0 - i as f32)],
        })
        .collect()
}

fn save(path: &Path, header: &BaseHeader, positions: &[BasePosition]) -> anyhow::Result<()> {
    let mut writer = BaseWriter::create(path, header)?;
    for p in positions {
        writer.push(p)?;
    }
    writer.finish()
}

#[test]
fn base_file_round_trips_and_refuses_damage() {
    let dir = scratch();
    let path = dir.path().join("round-trip.pplk");
    save(&path, &sample_header(), &sample_positions()).unwrap();
    let loaded = BaseLogits::load(&path).unwrap();
    assert_eq!(loaded.header, sample_header());
    assert_eq!(loaded.positions, sample_positions());
    let mean_nll = (0.5 + 1.5 + 2.5 + 3.5) / 4.0;
    assert!((loaded.perplexity() - f64::exp(mean_nll)).abs() < 1e-9);

    let bytes = std::fs::read(&path).unwrap();
    let damaged = dir.path().join("damaged.pplk");
    std::fs::write(&damaged, &bytes[..bytes.len() - 1]).unwrap();
    let err = format!("{:#}", BaseLogits::load(&damaged).unwrap_err());
    assert!(
        err.contains("truncated") && err.contains("damaged.pplk"),
        "{err}"
    );
    let mut wrong_magic = bytes.clone();
    wrong_magic[0] = b'X';
    std::fs::write(&damaged, &wrong_magic).unwrap();
    assert!(format!("{:#}", BaseLogits::load(&damaged).unwrap_err()).contains("PPLK"));
    let mut wrong_version = bytes.clone();
    wrong_version[4] = 9;
    std::fs::write(&damaged, &wrong_version).unwrap();
    assert!(format!("{:#}", BaseLogits::load(&damaged).unwrap_err()).contains("version 9"));

    // A run cut short leaves no file behind.
    let short = dir.path().join("short.pplk");
    assert!(save(&short, &sample_header(), &sample_positions()[..3]).is_err());
    assert!(!short.exists());
}

#[test]
fn mismatched_base_files_are_refused_naming_the_difference() {
    let path = Path::new("base.pplk");
    let base = sample_header();
    assert_eq!(mismatch(path, &base, &base), None);
    let mut other = base.clone();
    other.n_ctx = 4;
    assert!(mismatch(path, &base, &other).unwrap().contains("-c 6"));
    let mut other = base.clone();
    other.vocab = 7;
    assert!(
        mismatch(path, &base, &other)
            .unwrap()
            .contains("vocabulary")
    );
    let mut other = base.clone();
    other.tokens[7] = 3;
    assert!(
        mismatch(path, &base, &other)
            .unwrap()
            .contains("token 7 differs")
    );
    let mut other = base.clone();
    other.tokens.truncate(6);
    assert!(mismatch(path, &base, &other).unwrap().contains("--chunks"));
}

// ---- The command on the default model -------------------------------------

const TEXT: &str = "/usr/share/common-licenses/GPL-3";

/// The repository's yardstick for the JIT's FP16 weights against the f32
/// reference: logits within 0.02 (tests/fast_engine.rs). A log-softmax
/// moves by at most twice the largest logit change (the token's own logit
/// and the log-sum-exp each by at most that), so every per-token NLL, their
/// mean ln PPL, and a KL divergence (an average of log-probability
/// differences) stay within 2 × 0.02.
const ENGINE_TOLERANCE: f64 = 2.0 * 0.02;

struct Output {
    stdout: String,
    stderr: String,
    ok: bool,
}

fn pulsar_perplexity(args: &[&str]) -> Output {
    let model = pulsar::model::fetch::default_model_path().expect("the default model");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .arg("perplexity")
        .arg("-m")
        .arg(&model)
        .args(args)
        .output()
        .expect("pulsar runs");
    Output {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        ok: out.status.success(),
    }
}

/// PPL and its error from the last stdout line, checking its format.
fn ppl_line(out: &Output) -> (f64, f64) {
    assert!(out.ok, "pulsar failed: {}", out.stderr);
    let last = out.stdout.lines().last().expect("some stdout");
    let rest = last
        .strip_prefix("PPL = ")
        .unwrap_or_else(|| panic!("last line {last:?}"));
    let (ppl, error) = rest
        .split_once(" +/- ")
        .unwrap_or_else(|| panic!("last line {last:?}"));
    for number in [ppl, error] {
        let decimals = number.split_once('.').map(|(_, d)| d.len());
        assert_eq!(decimals, Some(4), "four decimals in {last:?}");
    }
    (ppl.parse().unwrap(), error.parse().unwrap())
}

/// A number printed after `label` in the KL line.
fn field(out: &Output, label: &str) -> f64 {
    let at = out
        .stdout
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in {}", out.stdout));
    let tail = &out.stdout[at + label.len()..];
    let end = tail.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'));
    tail[..end.unwrap_or(tail.len())].parse().unwrap()
}

#[test]
fn jit_perplexity_of_english_is_sane_and_its_own_base_gives_zero_kl() {
    let dir = scratch();
    let base = dir.path().join("jit.pplk");
    let base_arg = base.to_str().unwrap();
    let saved = pulsar_perplexity(&[
        "-f",
        TEXT,
        "-c",
        "128",
        "--chunks",
        "2",
        "--save-logits",
        base_arg,
    ]);
    let (ppl, error) = ppl_line(&saved);
    assert!(ppl.is_finite() && (5.0..100.0).contains(&ppl), "PPL {ppl}");
    assert!(error > 0.0 && error < ppl, "error {error}");
    assert!(
        saved.stderr.contains("2 windows of 128, 63 scored each"),
        "{}",
        saved.stderr
    );

    let again = pulsar_perplexity(&["-f", TEXT, "-c", "128", "--kl-base", base_arg]);
    assert_eq!(ppl_line(&again).0, ppl);
    assert!(field(&again, "mean ").abs() < 1e-6, "{}", again.stdout);
    assert!(
        again.stdout.contains("top-1 agreement 100.00% (126/126)"),
        "{}",
        again.stdout
    );
    assert_eq!(field(&again, "ln(PPL / PPL_base) = "), 0.0);

    let other_c = pulsar_perplexity(&["-f", TEXT, "-c", "64", "--kl-base", base_arg]);
    assert!(
        !other_c.ok && other_c.stderr.contains("saved with -c 128"),
        "{}",
        other_c.stderr
    );
    let other_text = pulsar_perplexity(&[
        "-f",
        "/usr/share/common-licenses/GPL-2",
        "-c",
        "128",
        "--kl-base",
        base_arg,
    ]);
    assert!(
        !other_text.ok && other_text.stderr.contains("differs"),
        "{}",
        other_text.stderr
    );
}

#[test]
fn reference_and_jit_agree_within_the_fp16_yardstick() {
    let dir = scratch();
    let base = dir.path().join("reference.pplk");
    let base_arg = base.to_str().unwrap();
    let reference = pulsar_perplexity(&[
        "-f",
        TEXT,
        "-c",
        "128",
        "--chunks",
        "2",
        "--engine",
        "reference",
        "--save-logits",
        base_arg,
    ]);
    let (reference_ppl, _) = ppl_line(&reference);
    let jit = pulsar_perplexity(&["-f", TEXT, "-c", "128", "--kl-base", base_arg]);
    let (jit_ppl, _) = ppl_line(&jit);
    let log_ratio = (jit_ppl / reference_ppl).ln();
    assert!(
        log_ratio.abs() <= ENGINE_TOLERANCE,
        "jit {jit_ppl}, reference {reference_ppl}"
    );
    assert!((field(&jit, "ln(PPL / PPL_base) = ") - log_ratio).abs() < 1e-3);
    let kl = field(&jit, "mean ");
    assert!(
        (0.0..=ENGINE_TOLERANCE).contains(&kl),
        "KL {kl}: {}",
        jit.stdout
    );
    // `--input-bits 16`: most of the JIT's distance to the reference is its
    // 8-bit inputs (the rest: Q4_K and Q6_K kept in other types, and
    // summation order), and two levels take most of that away.
    let fine = pulsar_perplexity(&[
        "--input-bits",
        "16",
        "-f",
        TEXT,
        "-c",
        "128",
        "--kl-base",
        base_arg,
    ]);
    ppl_line(&fine);
    assert!(
        fine.stderr.contains("inputs in two 8-bit levels"),
        "{}",
        fine.stderr
    );
    let fine_kl = field(&fine, "mean ");
    println!("mean KL against the reference: 8-bit inputs {kl}, two levels {fine_kl}");
    assert!(fine_kl < kl / 3.0, "two levels {fine_kl}, one {kl}");
}

#[test]
fn a_text_shorter_than_two_windows_is_refused_with_its_token_count() {
    let dir = scratch();
    let text = dir.path().join("short.txt");
    std::fs::write(&text, "Only a few words here.").unwrap();
    let out = pulsar_perplexity(&["-f", text.to_str().unwrap(), "-c", "512"]);
    assert!(!out.ok);
    assert!(
        out.stderr.contains("tokens but -c 512 needs at least 1024"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("short.txt"), "{}", out.stderr);
}
