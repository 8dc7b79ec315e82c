//! `pulsar bench`: prefill and decode speed, with the machine's read
//! bandwidth over the same number of bytes measured in the same run, so a
//! decode rate is always stated against the ceiling it is chasing.

use super::{EngineArgs, jit_kernels, open_fast_engine, print_notes, resolve_model};
use crate::engine::fast::{FastEngine, OpenReport};
use crate::engine::membench::read_bandwidth;
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
    let m_curve = if args.m_curve {
        step_costs(engine, vocab, args.m_curve_context)?
    } else {
        Vec::new()
    };
    // At most 1 GiB, far past any L3 here: a 26B-A4B reads 2 GB a token,
    // and a buffer that large beside its 18 GB of weights would not fit.
    let read_bw = read_bandwidth(engine.pool(), bytes.min(1 << 30), 5);
    let wake = engine.pool().wake_latency(2000);
    let decode_gbs = decode_tok_s * bytes as f64 / 1e9;
    Ok(BenchReport {
        model: model.to_string(),
        weights_dtype: weights_dtype.to_string(),
        kernels: engine.kernels_name(),
        threads: engine.threads(),
        bytes_per_token: bytes,
        read_bw_gbs: read_bw,
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
    })
}

/// `pulsar bench`: a real model, or a known shape on random weights.
pub fn run_command(
    model: Option<&Path>,
    shape: Option<&str>,
    engine_args: &EngineArgs,
    args: &BenchArgs,
) -> Result<()> {
    let mut context = args.prompt_tokens + args.generate_tokens + 2;
    if args.m_curve {
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
            let kernels = jit_kernels(&config, formats, threads)?;
            let mut engine = FastEngine::new(config, weights, kernels, &opts)?;
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
            let plan = FastEngine::plan(Arc::new(ModelSource::open(&path)?), &options)?;
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
        "prefill          {:.1} tok/s ({} tokens)",
        r.prefill_tok_s, r.prefill_tokens
    );
    println!(
        "decode           {:.2} tok/s ({} tokens)",
        r.decode_tok_s, r.decode_tokens
    );
    println!(
        "decode traffic   {:.1} GB/s = {:.0}% of the read bandwidth",
        r.decode_gbs,
        r.decode_bw_fraction * 100.0
    );
    println!(
        "pool wake-up     {:.0} ns per parallel section",
        r.wake_latency_ns
    );
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
