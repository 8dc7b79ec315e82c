//! `pulsar bench`: prefill and decode speed, with the machine's read
//! bandwidth over the same number of bytes measured in the same run, so a
//! decode rate is always stated against the ceiling it is chasing.

use super::{EngineArgs, open_fast_engine, print_notes, resolve_model};
use crate::engine::fast::{DraftSource, FastEngine, OpenReport, assistant_format, plan_assistant};
use crate::engine::jit_kernels::{JitKernels, plan_options};
use crate::engine::membench::{read_bandwidth, read_bandwidth_of};
use crate::engine::synthetic;
use crate::engine::{Engine, LogitsWanted};
use crate::model::presets;
use crate::model::source::ModelSource;
use anyhow::{Result, bail};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

pub struct BenchArgs {
    pub prompt_tokens: usize,
    pub generate_tokens: usize,
    pub json: bool,
    /// Also time one step over m = 1..=16 tokens (`--m-curve`).
    pub m_curve: bool,
    /// Tokens cached before each of those steps (`--m-curve-context`).
    pub m_curve_context: usize,
    /// A Gemma 4 assistant to time beside the model (`--draft FILE` or
    /// `--draft-shape NAME`): its draft token against a step, and the
    /// decode speed that gives (implies the m-curve).
    pub draft: Option<DraftBench>,
}

/// The assistant `bench` times.
pub enum DraftBench {
    File(std::path::PathBuf),
    Shape(String),
}

/// What drafting with an assistant costs, and the decode speed the
/// measured costs give when each drafted token is accepted with
/// probability α (given the ones before it were).
#[derive(Serialize)]
pub struct DraftCost {
    pub assistant: String,
    /// Weight bytes one draft token streams.
    pub bytes_per_draft_token: usize,
    /// A draft token's time: a round of 8 after the m-curve's context,
    /// median over rounds, per token.
    pub draft_token_ms: f64,
    /// Against a step over one token.
    pub relative: f64,
    pub at_acceptance: Vec<SpeedAt>,
}

/// The decode speed at one acceptance rate: with `k` drafts per step a
/// step yields (1 − α^(k+1)) / (1 − α) tokens and takes t(1 + k) (the
/// m-curve) plus k draft tokens; the best k.
#[derive(Serialize)]
pub struct SpeedAt {
    pub acceptance: f64,
    pub drafts: usize,
    pub tokens_per_step: f64,
    pub tok_s: f64,
    /// Against plain decoding at 1 / t(1).
    pub speedup: f64,
}

/// The cost of one step over `m` tokens of one sequence (every position's
/// logits, as a speculative verify step wants them).
#[derive(Serialize)]
pub struct StepCost {
    pub m: usize,
    pub step_ms: f64,
    /// Against the step over one token.
    pub relative: f64,
}

#[derive(Serialize)]
pub struct BenchReport {
    pub model: String,
    pub weights_dtype: String,
    pub kernels: String,
    pub threads: usize,
    pub bytes_per_token: usize,
    pub read_bw_gbs: f64,
    /// A plain read of the weights' own pages (a dense model's all, a
    /// mixture's first bytes per token) just before the decode and just
    /// after it.
    pub weights_read_before_gbs: f64,
    pub weights_read_after_gbs: f64,
    pub weights_read_bytes: usize,
    pub prefill_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tokens: usize,
    pub decode_tok_s: f64,
    pub decode_gbs: f64,
    pub decode_bw_fraction: f64,
    pub wake_latency_ns: f64,
    /// What the launch tuning did (empty on random weights).
    pub tuning: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub m_curve: Vec<StepCost>,
    /// Tokens cached before each of the m-curve's steps.
    pub m_curve_context: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafting: Option<DraftCost>,
}

/// Token ids spread over the vocabulary, avoiding the control ids below 4.
fn bench_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (4 + (i * 7919 + 13) % (vocab - 4)) as u32)
        .collect()
}

/// Measures `engine` (`model`, in `weights_dtype`); `tuning` says what its
/// launch tuning did.
pub fn run(
    engine: &mut FastEngine,
    model: &str,
    weights_dtype: &str,
    tuning: &str,
    args: &BenchArgs,
) -> Result<BenchReport> {
    let vocab = engine.config().vocab_size;
    let bytes = engine.bytes_per_token();

    let prompt = bench_tokens(args.prompt_tokens.max(1), vocab);
    engine.truncate(0);
    // One short warm-up pass faults the weights in.
    engine.forward(&prompt[..1], LogitsWanted::Last)?;
    engine.truncate(0);
    let start = Instant::now();
    engine.forward(&prompt, LogitsWanted::Last)?;
    let prefill_s = start.elapsed().as_secs_f64();

    engine.truncate(1);
    // The weights' own read just before the decode and again just after
    // (the slices are taken again there: the decode borrows the engine
    // mutably). This host's memory changed speed (about 33 against 58
    // GB/s) within seconds, so a decode is compared with a read only
    // when the two agree. All of a dense model's matrices; a mixture's
    // first bytes per token of them.
    let weights = engine.streamed_weights(bytes);
    let weights_read_bytes = weights.iter().map(|w| w.len()).sum();
    let weights_read_before_gbs = read_bandwidth_of(engine.pool(), &weights, 3);
    let decode = bench_tokens(args.generate_tokens.max(1), vocab);
    let start = Instant::now();
    for &t in &decode {
        engine.forward(&[t], LogitsWanted::Last)?;
    }
    let decode_s = start.elapsed().as_secs_f64();
    let decode_tok_s = decode.len() as f64 / decode_s;
    // The read benchmark comes last: freeing its buffer (as large as the
    // weights) sets off work outside this process (on this VM the kernel
    // reports the freed pages to the host) that slowed a prefill timed
    // right after it: pp512 on 2 threads, two ABBA x3 rounds, median 594.4
    // and 624.7 tok/s with the read first, 644.1 and 641.5 with it last.
    let m_curve = if args.m_curve || args.draft.is_some() {
        step_costs(engine, vocab, args.m_curve_context)?
    } else {
        Vec::new()
    };
    let drafting = match &args.draft {
        Some(draft) => Some(draft_cost(
            engine,
            draft,
            vocab,
            args.m_curve_context,
            &m_curve,
        )?),
        None => None,
    };
    // At most 1 GiB, far past any L3 here: a 26B-A4B reads 2 GB a token,
    // and a buffer that large beside its 18 GB of weights would not fit.
    let read_bw = read_bandwidth(engine.pool(), bytes.min(1 << 30), 5);
    let weights = engine.streamed_weights(bytes);
    let weights_read_after_gbs = read_bandwidth_of(engine.pool(), &weights, 3);
    let wake = engine.pool().wake_latency(2000);
    let decode_gbs = decode_tok_s * bytes as f64 / 1e9;
    Ok(BenchReport {
        model: model.to_string(),
        weights_dtype: weights_dtype.to_string(),
        kernels: engine.kernels_name(),
        threads: engine.threads(),
        bytes_per_token: bytes,
        read_bw_gbs: read_bw,
        weights_read_before_gbs,
        weights_read_after_gbs,
        weights_read_bytes,
        prefill_tokens: prompt.len(),
        prefill_tok_s: prompt.len() as f64 / prefill_s,
        decode_tokens: decode.len(),
        decode_tok_s,
        decode_gbs,
        decode_bw_fraction: decode_gbs / read_bw,
        wake_latency_ns: wake.as_secs_f64() * 1e9,
        tuning: tuning.to_string(),
        m_curve,
        m_curve_context: args.m_curve_context,
        drafting,
    })
}

/// Rounds of drafting timed; the median round is reported.
const DRAFT_ROUNDS: usize = 15;

/// Times rounds of 8 drafts after `cached` tokens and prices speculative
/// decoding with them against `m_curve`.
fn draft_cost(
    engine: &mut FastEngine,
    draft: &DraftBench,
    vocab: usize,
    cached: usize,
    m_curve: &[StepCost],
) -> Result<DraftCost> {
    const K: usize = crate::engine::assistant::MAX_DRAFT_TOKENS;
    let context = bench_tokens(cached.max(1), vocab);
    engine.truncate(0);
    engine.forward(&context, LogitsWanted::Last)?;
    let mut rounds = Vec::with_capacity(DRAFT_ROUNDS);
    for i in 0..DRAFT_ROUNDS {
        let token = bench_tokens(cached + 1 + i, vocab)[cached + i];
        let start = Instant::now();
        engine.draft(token, K, None)?;
        rounds.push(start.elapsed().as_secs_f64());
    }
    rounds.sort_by(f64::total_cmp);
    let draft_token_ms = rounds[rounds.len() / 2] * 1e3 / K as f64;
    let one = m_curve.first().map_or(f64::NAN, |c| c.step_ms);
    let at_acceptance = [0.5, 0.6, 0.7, 0.8, 0.9]
        .into_iter()
        .map(|alpha| speed_at(alpha, m_curve, draft_token_ms))
        .collect();
    Ok(DraftCost {
        assistant: match draft {
            DraftBench::File(p) => p.display().to_string(),
            DraftBench::Shape(name) => format!("{name} (random weights, assumed widths)"),
        },
        bytes_per_draft_token: engine.draft_bytes_per_token(),
        draft_token_ms,
        relative: draft_token_ms / one,
        at_acceptance,
    })
}

/// The best number of drafts per step at acceptance `alpha`, priced by the
/// m-curve's step times and the draft token's time.
fn speed_at(alpha: f64, m_curve: &[StepCost], draft_token_ms: f64) -> SpeedAt {
    let one = m_curve[0].step_ms;
    let plain = SpeedAt {
        acceptance: alpha,
        drafts: 0,
        tokens_per_step: 1.0,
        tok_s: 1e3 / one,
        speedup: 1.0,
    };
    (1..=crate::engine::assistant::MAX_DRAFT_TOKENS)
        .filter_map(|k| {
            let step = m_curve.get(k)?.step_ms + k as f64 * draft_token_ms;
            let tokens = (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha);
            Some(SpeedAt {
                acceptance: alpha,
                drafts: k,
                tokens_per_step: tokens,
                tok_s: tokens * 1e3 / step,
                speedup: tokens * one / step,
            })
        })
        .fold(plain, |best, s| if s.tok_s > best.tok_s { s } else { best })
}

/// `pulsar bench`: a real model, or a known shape on random weights.
pub fn run_command(
    model: Option<&Path>,
    shape: Option<&str>,
    engine_args: &EngineArgs,
    args: &BenchArgs,
) -> Result<()> {
    let mut context = args.prompt_tokens + args.generate_tokens + 2;
    if args.m_curve || args.draft.is_some() {
        // The m-curve's cached context and its largest step.
        context = context.max(args.m_curve_context + M_CURVE_MAX);
    }
    let (mut engine, name, report) = match shape {
        Some(name) => {
            let Some(config) = presets::shape(name) else {
                bail!(
                    "unknown shape {name:?}; known shapes: {}",
                    presets::SHAPES.join(", ")
                );
            };
            eprintln!("bench: making random {name} weights");
            let (dtype, threads) = (engine_args.dtype, engine_args.threads);
            let opts = dtype.fast_options(threads, context, engine_args.in_place);
            let formats = dtype.shape_formats(&config);
            let weights = synthetic::random_weights(&config, &formats, 1);
            let mut plan = plan_options(&config, &formats, threads);
            let assistant = match args.draft.as_ref().map(draft_source).transpose()? {
                Some(DraftSource::Random { config: a, name }) => {
                    let format = assistant_format(&formats, &a);
                    plan_assistant(&mut plan, &a, format);
                    Some((a, name, format))
                }
                Some(DraftSource::File(_)) => {
                    bail!("--draft FILE needs -m MODEL; with --shape give --draft-shape")
                }
                None => None,
            };
            let Some(kernels) = JitKernels::with_options(&config, plan)? else {
                bail!("this CPU cannot run the JIT kernels (AVX2, F16C and FMA are needed)");
            };
            let mut engine = FastEngine::new(config, weights, Box::new(kernels), &opts)?;
            if let Some((a, name, format)) = assistant {
                engine.attach_random_assistant(*a, &name, format)?;
            }
            let input_precision = engine_args.flags.input_precision;
            engine.set_input_precision(input_precision);
            // Random weights are not tuned.
            let report = OpenReport {
                tuning: String::new(),
                input_precision,
                converted: None,
            };
            (engine, format!("{name} (random weights)"), report)
        }
        None => {
            let path = resolve_model(model)?;
            let mut options = engine_args.options(context)?;
            // The conversion note is part of what bench reports.
            options.verbose = true;
            let assistant = args.draft.as_ref().map(draft_source).transpose()?;
            let plan = FastEngine::plan_drafting(
                Arc::new(ModelSource::open(&path)?),
                assistant,
                &options,
            )?;
            print_notes("bench", &plan);
            let (engine, report) = open_fast_engine(plan, "pulsar bench")?;
            (engine, path.display().to_string(), report)
        }
    };
    let dtype = format!("{}{}", engine.formats().describe(), report.input_note());
    let report = run(&mut engine, &name, &dtype, &report.tuning, args)?;
    print(&report, args.json)
}

/// Largest step of the m-curve.
pub const M_CURVE_MAX: usize = 16;
/// Rounds over every m; each m's median is reported.
const M_CURVE_ROUNDS: usize = 9;
/// Tokens cached before each timed step, unless `--m-curve-context` says.
pub const M_CURVE_CONTEXT: usize = 64;

/// Times a step over m = 1..=16 tokens after the same cached context. The
/// rounds go over every m in turn, so a slow spell of the machine lands on
/// all of them rather than on one.
fn step_costs(engine: &mut FastEngine, vocab: usize, cached: usize) -> Result<Vec<StepCost>> {
    let context = bench_tokens(cached, vocab);
    let steps = bench_tokens(cached + M_CURVE_MAX, vocab)[cached..].to_vec();
    engine.truncate(0);
    engine.forward(&context, LogitsWanted::Last)?;
    let mut times: Vec<Vec<f64>> = (0..M_CURVE_MAX)
        .map(|_| Vec::with_capacity(M_CURVE_ROUNDS))
        .collect();
    for _ in 0..M_CURVE_ROUNDS {
        for m in 1..=M_CURVE_MAX {
            engine.truncate(cached);
            let start = Instant::now();
            // As a verify step of speculative decoding runs (`generate`):
            // the logits go back to the engine once read.
            let logits = engine.forward(&steps[..m], LogitsWanted::All)?;
            engine.reuse_logits(logits);
            times[m - 1].push(start.elapsed().as_secs_f64());
        }
    }
    let medians: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect();
    Ok(medians
        .iter()
        .enumerate()
        .map(|(i, &secs)| StepCost {
            m: i + 1,
            step_ms: secs * 1e3,
            relative: secs / medians[0],
        })
        .collect())
}

pub fn print(report: &BenchReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    let r = report;
    println!("model            {}", r.model);
    println!(
        "weights          {} ({} kernels, {} threads)",
        r.weights_dtype, r.kernels, r.threads
    );
    if !r.tuning.is_empty() {
        println!("launch           {}", r.tuning);
    }
    println!("bytes per token  {:.1} MB", r.bytes_per_token as f64 / 1e6);
    println!(
        "read bandwidth   {:.1} GB/s over {:.1} MB (same run)",
        r.read_bw_gbs,
        r.bytes_per_token as f64 / 1e6
    );
    println!(
        "weights read     {:.1} GB/s before the decode, {:.1} after, over {:.1} MB of the weights themselves",
        r.weights_read_before_gbs,
        r.weights_read_after_gbs,
        r.weights_read_bytes as f64 / 1e6
    );
    println!(
        "prefill          {:.1} tok/s ({} tokens)",
        r.prefill_tok_s, r.prefill_tokens
    );
    println!(
        "decode           {:.2} tok/s ({} tokens)",
        r.decode_tok_s, r.decode_tokens
    );
    println!(
        "decode traffic   {:.1} GB/s = {:.0}% of the read bandwidth, {:.0}% and {:.0}% of the weights' reads",
        r.decode_gbs,
        r.decode_bw_fraction * 100.0,
        100.0 * r.decode_gbs / r.weights_read_before_gbs,
        100.0 * r.decode_gbs / r.weights_read_after_gbs
    );
    println!(
        "pool wake-up     {:.0} ns per parallel section",
        r.wake_latency_ns
    );
    if let Some(d) = &r.drafting {
        println!("assistant        {}", d.assistant);
        println!(
            "draft token      {:.3} ms = {:.3} of a one-token step ({:.1} MB)",
            d.draft_token_ms,
            d.relative,
            d.bytes_per_draft_token as f64 / 1e6
        );
        println!(
            "decode with drafts, by acceptance (best drafts per step, priced by the m-curve):"
        );
        println!("   α   drafts   tok/step    tok/s   x plain");
        for s in &d.at_acceptance {
            println!(
                "{:>5.2} {:>7} {:>10.2} {:>8.2} {:>9.2}",
                s.acceptance, s.drafts, s.tokens_per_step, s.tok_s, s.speedup
            );
        }
    }
    if !r.m_curve.is_empty() {
        println!(
            "step over m tokens after {} cached (all logits), median of {M_CURVE_ROUNDS}:",
            r.m_curve_context
        );
        println!("   m   ms/step   x m=1   ms/token");
        for p in &r.m_curve {
            println!(
                "{:>4} {:>9.2} {:>7.2} {:>10.2}",
                p.m,
                p.step_ms,
                p.relative,
                p.step_ms / p.m as f64
            );
        }
    }
    Ok(())
}

/// The assistant `--draft` or `--draft-shape` names.
fn draft_source(draft: &DraftBench) -> Result<DraftSource> {
    Ok(match draft {
        DraftBench::File(path) => DraftSource::File(Arc::new(ModelSource::open(path)?)),
        DraftBench::Shape(name) => {
            let Some(config) = presets::assistant_shape(name) else {
                let known: Vec<&str> = presets::ASSISTANT_SHAPES.iter().map(|s| s.0).collect();
                bail!(
                    "unknown assistant shape {name:?}; known: {}",
                    known.join(", ")
                );
            };
            eprintln!("bench: making random {name} weights (widths assumed)");
            DraftSource::Random {
                config: Box::new(config),
                name: name.clone(),
            }
        }
    })
}
