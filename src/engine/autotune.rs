//! Launch-time tuning: the choices the CPU's caches cannot decide are
//! measured on the engine's real calls the first time a model runs on a
//! CPU with a thread count, within a time budget, and remembered in the
//! cache folder for every later launch.
//!
//! What it measures:
//! - the quantized GEMVs' software prefetch distance (off, 4, 8 or 16 KiB
//!   ahead), on a whole decode step: each candidate is its own verified
//!   kernel set;
//! - the rows several exact tokens share in cache (`shared_rows_bytes`),
//!   on a two-token step;
//! - in the full search only (`pulsar tune --measure`, no time budget):
//!   the tokens per prefill step and the panel of widened quantized rows,
//!   on a prefill of [`PREFILL_TOKENS`] tokens (about half a second each,
//!   too long for a launch; a launch reuses what the full search stored).
//!
//! A stored entry names everything it depends on (CPU, features, model
//! shape, weight formats, threads, this binary); a launch whose key
//! differs measures again, and an unreadable entry is ignored with one
//! line.

use super::fast::{FastEngine, WeightFormats};
use super::jit_kernels::JitKernels;
use super::kernels::MatKernels;
use super::q8_input::InputPrecision;
use super::{Engine, LogitsWanted};
use crate::fs_atomic::write_atomic;
use crate::jit::blocking::Blocking;
use crate::jit::cpu::CpuCaps;
use crate::jit::plan::{PlanOptions, QUANT_PREFETCH_BYTES};
use crate::model::config::ModelConfig;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The whole of a first launch's tuning: building the candidates' kernels
/// and timing them.
pub const LAUNCH_BUDGET: Duration = Duration::from_millis(300);

/// Rounds over every candidate that `pulsar tune --measure` runs.
pub const FULL_ROUNDS: usize = 7;

/// Positions a measurement uses: one cached token and a two-token step.
const MEASURE_POSITIONS: usize = 3;

/// A candidate replaces the analytic value only when it is faster by more
/// than this share: single runs here swing by 10-20%, a median of a few
/// rounds by less.
const NOISE: f64 = 0.05;

/// Prefetch distances tried for the quantized GEMVs.
const PREFETCH_CANDIDATES: [usize; 4] = [0, 4 << 10, QUANT_PREFETCH_BYTES, 16 << 10];
/// Rows shared by several exact tokens' passes, in bytes.
const SHARED_ROWS_CANDIDATES: [usize; 3] = [16 << 10, 32 << 10, 64 << 10];
/// The prompt the full search prefills to time the prefill knobs.
pub const PREFILL_TOKENS: usize = 252;
/// Tokens per prefill step tried by the full search: multiples of the
/// GEMM's 3-token tile that cut [`PREFILL_TOKENS`] evenly.
const PREFILL_CHUNK_CANDIDATES: [usize; 3] = [63, 126, 252];
/// Rounds of the full search that time the prefill knobs (each round
/// prefills 6 times).
const PREFILL_ROUNDS: usize = 3;

/// What the tuning chose.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuned {
    pub quant_prefetch: usize,
    pub shared_rows_bytes: usize,
    /// Measured by the full search only; `None`: the plan's.
    #[serde(default)]
    pub prefill_chunk: Option<usize>,
    #[serde(default)]
    pub widened_panel_bytes: Option<usize>,
}

impl Tuned {
    /// The value chosen for the knob a [`Candidate`] names.
    pub fn value_of(&self, knob: &str) -> Option<usize> {
        match knob {
            "quant_prefetch" => Some(self.quant_prefetch),
            "shared_rows_bytes" => Some(self.shared_rows_bytes),
            "prefill_chunk" => self.prefill_chunk,
            "widened_panel_bytes" => self.widened_panel_bytes,
            _ => None,
        }
    }
}

/// One candidate's measured time per call (median over the rounds).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub knob: String,
    pub value: usize,
    pub median_ms: f64,
    pub rounds: usize,
}

/// A stored tuning.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    /// Everything the choice depends on (see [`tuning_key`]).
    pub key: String,
    pub tuned: Tuned,
    pub candidates: Vec<Candidate>,
    /// Time spent building the candidates' kernels (plan, emit, verify).
    pub build_ms: f64,
    /// Time the measurement took, kernel builds included.
    pub spent_ms: f64,
}

/// What a launch does about tuning, decided before its kernels are
/// generated (`engine::fast::open`).
pub enum LaunchStep {
    /// Nothing measured or applied: the analytic plan runs, for `reason`.
    Skip { reason: String },
    /// The entry stored for this launch's key: its kernel choices go into
    /// the plan ([`plan_with`]), its blocking onto the loaded engine
    /// ([`apply_blocking`]).
    Reuse { path: PathBuf, entry: Entry },
    /// Nothing usable is stored: measured on the loaded engine
    /// ([`measure_at_launch`]) and stored at `path` in `dir`.
    Measure {
        key: String,
        dir: PathBuf,
        path: PathBuf,
    },
}

/// Everything a tuning depends on, as text: the CPU (brand and features),
/// the model's shape and weight formats, the threads, and this binary (its
/// version, size and modification time), so a changed CPU or a rebuilt
/// binary never reuses an entry.
pub fn tuning_key(
    config: &ModelConfig,
    formats: &WeightFormats,
    threads: usize,
    inputs: InputPrecision,
) -> String {
    let exe = std::env::current_exe()
        .ok()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| {
            let modified = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            format!("{} bytes, modified {modified}", m.len())
        })
        .unwrap_or_else(|| "unknown".into());
    format!(
        "cpu: {}\nmodel: hidden {} ffn {} heads {}/{} head_dim {} vocab {} layers {}\n\
         weights: {}\ninputs: {inputs:?}\nthreads: {threads}\npulsar {} ({exe})",
        CpuCaps::detect(),
        config.hidden,
        config.intermediate,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        config.vocab_size,
        config.n_layers(),
        formats.describe(),
        env!("CARGO_PKG_VERSION"),
    )
}

/// The file an entry for `key` lives in, inside `dir`.
pub fn entry_path(dir: &Path, key: &str) -> PathBuf {
    let digest = Sha256::digest(key.as_bytes());
    let name: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{name}.json"))
}

/// The stored entry for `key`: `Ok(None)` when there is none (or it was
/// written for another key), an error naming the file when it cannot be
/// read or parsed.
pub fn load_entry(path: &Path, key: &str) -> Result<Option<Entry>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let entry: Entry = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a tuning entry", path.display()))?;
    Ok((entry.key == key).then_some(entry))
}

/// The plan options with a tuning's kernel choices (the quantized GEMVs'
/// prefetch distance), so the kernels are generated tuned.
pub fn plan_with(opts: &mut PlanOptions, tuned: &Tuned) {
    opts.quant_prefetch = tuned.quant_prefetch;
}

/// Applies a tuning to an engine: the kernels with its prefetch distance,
/// then its blocking ([`apply_blocking`]).
pub fn apply(
    engine: &mut FastEngine,
    config: &ModelConfig,
    formats: &WeightFormats,
    tuned: &Tuned,
) -> Result<()> {
    let kernels = kernels_with_prefetch(engine, config, formats, tuned.quant_prefetch)?;
    if let Err((_, why)) = engine.replace_kernels(kernels) {
        anyhow::bail!("internal error: tuned kernels refused: {why}");
    }
    apply_blocking(engine, tuned);
    Ok(())
}

/// A tuning's blocking on an engine: its shared rows and, when the full
/// search measured them, its prefill step and widened panel.
pub fn apply_blocking(engine: &mut FastEngine, tuned: &Tuned) {
    let current = engine.blocking().clone();
    let blocking = Blocking {
        shared_rows_bytes: tuned.shared_rows_bytes,
        prefill_chunk: tuned.prefill_chunk.unwrap_or(current.prefill_chunk),
        widened_panel_bytes: tuned
            .widened_panel_bytes
            .unwrap_or(current.widened_panel_bytes),
        ..current
    };
    engine.set_blocking(blocking);
}

fn kernels_with_prefetch(
    engine: &FastEngine,
    config: &ModelConfig,
    formats: &WeightFormats,
    prefetch: usize,
) -> Result<Box<dyn MatKernels>> {
    let mut opts = engine.plan_options(formats);
    opts.quant_prefetch = prefetch;
    match JitKernels::with_options(config, opts)? {
        Some(k) => Ok(Box::new(k)),
        None => anyhow::bail!("this CPU cannot run the JIT kernels"),
    }
}

/// The launch step of an engine of `config` with `formats`, `threads` and
/// `inputs` whose sequences hold `context` tokens, with tunings stored in
/// `dir`: reuse the entry stored for its key, else measure. Beside it a
/// line for stderr when a stored entry cannot be read (it is measured
/// again and replaced).
pub fn launch_step(
    config: &ModelConfig,
    formats: &WeightFormats,
    threads: usize,
    inputs: InputPrecision,
    context: usize,
    dir: &Path,
) -> (LaunchStep, Option<String>) {
    // The measurement runs a cached token and a two-token step after it.
    if context < MEASURE_POSITIONS {
        let reason = format!("a context under {MEASURE_POSITIONS} tokens");
        return (LaunchStep::Skip { reason }, None);
    }
    let key = tuning_key(config, formats, threads, inputs);
    let path = entry_path(dir, &key);
    let (entry, warning) = match load_entry(&path, &key) {
        Ok(entry) => (entry, None),
        Err(e) => (
            None,
            Some(format!("ignoring a tuning entry: {e:#}; measuring again")),
        ),
    };
    let step = match entry {
        Some(entry) => LaunchStep::Reuse { path, entry },
        None => LaunchStep::Measure {
            key,
            dir: dir.to_path_buf(),
            path,
        },
    };
    (step, warning)
}

/// A launch's measurement ([`LaunchStep::Measure`]): the candidates timed
/// on the loaded engine within [`LAUNCH_BUDGET`], the winner applied, and
/// the entry stored atomically at `path` inside `dir`. Returns the entry
/// and whether storing it worked (a read-only cache folder costs the next
/// launch a measurement, nothing more).
pub fn measure_at_launch(
    engine: &mut FastEngine,
    config: &ModelConfig,
    formats: &WeightFormats,
    key: String,
    dir: &Path,
    path: &Path,
) -> Result<(Entry, Result<()>)> {
    let entry = measure(engine, config, formats, key, Some(LAUNCH_BUDGET), 1)?;
    let stored = std::fs::create_dir_all(dir)
        .with_context(|| format!("creating {}", dir.display()))
        .and_then(|()| {
            let text = serde_json::to_string_pretty(&entry)?;
            write_atomic(path, text.as_bytes())
        });
    apply(engine, config, formats, &entry.tuned)?;
    Ok((entry, stored))
}

/// Measures every candidate on the engine's real calls, round after round
/// (each round times every candidate once, so a slow spell of the machine
/// lands on all of them), for at least `min_rounds` and then as long as
/// another round fits the budget. The engine's cache is left empty: tune
/// before feeding it.
pub fn measure(
    engine: &mut FastEngine,
    config: &ModelConfig,
    formats: &WeightFormats,
    key: String,
    budget: Option<Duration>,
    min_rounds: usize,
) -> Result<Entry> {
    let start = Instant::now();
    let quantized = !formats.quantized(config).is_empty();
    // Candidate kernel sets (only one without quantized matrices).
    let prefetches: Vec<usize> = if quantized {
        PREFETCH_CANDIDATES.to_vec()
    } else {
        vec![QUANT_PREFETCH_BYTES]
    };
    // The engine runs the default distance already; the others get kernel
    // sets of their own (`None`: the engine's current kernels).
    let mut kernel_sets: Vec<Option<Box<dyn MatKernels>>> = Vec::new();
    for &p in &prefetches {
        kernel_sets.push(match p {
            QUANT_PREFETCH_BYTES => None,
            _ => Some(kernels_with_prefetch(engine, config, formats, p)?),
        });
    }
    let build_ms = start.elapsed().as_secs_f64() * 1e3;
    let base_blocking = engine.blocking().clone();
    // One cached token before each timed step, so the steps run attention
    // as a decode does; it also brings the weights in.
    let vocab = config.vocab_size as u32;
    let token = |i: usize| 4 + (i as u32 * 7919) % (vocab - 4);
    let context = [token(0)];
    engine.truncate(0);
    engine.forward(&context, LogitsWanted::Last)?;
    // Right after a load the first steps run slow (measured 25-56 ms for a
    // 16 ms step, whichever kernels ran first): two untimed steps first.
    for i in 0..2 {
        engine.forward(&[token(50 + i)], LogitsWanted::All)?;
        engine.truncate(context.len());
    }

    let mut prefetch_times: Vec<Vec<f64>> = vec![Vec::new(); prefetches.len()];
    let mut shared_times: Vec<Vec<f64>> = vec![Vec::new(); SHARED_ROWS_CANDIDATES.len()];
    let step = |engine: &mut FastEngine, tokens: &[u32]| -> Result<f64> {
        let t0 = Instant::now();
        engine.forward(tokens, LogitsWanted::All)?;
        let secs = t0.elapsed().as_secs_f64();
        engine.truncate(context.len());
        Ok(secs)
    };
    // The prefill knobs: only in the full search, and only with room for
    // the prompt.
    let mut prefill = (budget.is_none() && engine.capacity() > PREFILL_TOKENS)
        .then(|| PrefillKnobs::new(config, quantized, &base_blocking));
    let mut rounds = 0;
    let mut longest_round = Duration::ZERO;
    loop {
        let round_start = Instant::now();
        // Odd rounds go backwards, so no candidate always runs first.
        let order: Vec<usize> = if rounds % 2 == 0 {
            (0..kernel_sets.len()).collect()
        } else {
            (0..kernel_sets.len()).rev().collect()
        };
        for i in order {
            let set = &mut kernel_sets[i];
            let Some(kernels) = set.take() else {
                prefetch_times[i].push(step(engine, &[token(100 + rounds)])?);
                continue;
            };
            let previous = match engine.replace_kernels(kernels) {
                Ok(p) => p,
                Err((_, why)) => anyhow::bail!("internal error: candidate kernels refused: {why}"),
            };
            let secs = step(engine, &[token(100 + rounds)]);
            // Put the candidate back beside the others either way.
            let candidate = engine
                .replace_kernels(previous)
                .map_err(|(_, why)| anyhow::anyhow!("internal error: {why}"))?;
            *set = Some(candidate);
            prefetch_times[i].push(secs?);
        }
        for (i, &bytes) in SHARED_ROWS_CANDIDATES.iter().enumerate() {
            engine.set_blocking(Blocking {
                shared_rows_bytes: bytes,
                ..base_blocking.clone()
            });
            shared_times[i].push(step(engine, &[token(200 + rounds), token(300 + rounds)])?);
        }
        engine.set_blocking(base_blocking.clone());
        if let Some(prefill) = &mut prefill
            && rounds < PREFILL_ROUNDS
        {
            prefill.round(engine, &base_blocking)?;
        }
        rounds += 1;
        longest_round = longest_round.max(round_start.elapsed());
        if rounds < min_rounds {
            continue;
        }
        match budget {
            Some(b) if start.elapsed() + longest_round <= b => {}
            _ => break,
        }
    }
    engine.truncate(0);

    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2] * 1e3
    };
    let mut candidates = Vec::new();
    for (t, &p) in prefetch_times.iter_mut().zip(&prefetches) {
        candidates.push(Candidate {
            knob: "quant_prefetch".into(),
            value: p,
            median_ms: median(t),
            rounds,
        });
    }
    for (t, &b) in shared_times.iter_mut().zip(&SHARED_ROWS_CANDIDATES) {
        candidates.push(Candidate {
            knob: "shared_rows_bytes".into(),
            value: b,
            median_ms: median(t),
            rounds,
        });
    }
    if let Some(prefill) = &mut prefill {
        for (knob, value, times) in prefill.timings() {
            candidates.push(Candidate {
                knob: knob.into(),
                value,
                median_ms: median(times),
                rounds: times.len(),
            });
        }
    }
    // The fastest candidate, but the analytic value unless the fastest
    // beats it by more than the noise of a few rounds.
    let best = |knob: &str, analytic: usize| {
        let of_knob = || candidates.iter().filter(|c| c.knob == knob);
        let fastest = of_knob().min_by(|a, b| a.median_ms.total_cmp(&b.median_ms));
        let analytic_ms = of_knob().find(|c| c.value == analytic).map(|c| c.median_ms);
        match (fastest, analytic_ms) {
            (Some(f), Some(a)) if f.median_ms < a * (1.0 - NOISE) => f.value,
            (Some(f), None) => f.value,
            _ => analytic,
        }
    };
    let measured = |knob: &str| candidates.iter().any(|c| c.knob == knob);
    let tuned = Tuned {
        quant_prefetch: best("quant_prefetch", QUANT_PREFETCH_BYTES),
        shared_rows_bytes: best("shared_rows_bytes", base_blocking.shared_rows_bytes),
        prefill_chunk: measured("prefill_chunk")
            .then(|| best("prefill_chunk", base_blocking.prefill_chunk)),
        widened_panel_bytes: measured("widened_panel_bytes")
            .then(|| best("widened_panel_bytes", base_blocking.widened_panel_bytes)),
    };
    Ok(Entry {
        key,
        tuned,
        candidates,
        build_ms,
        spent_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// The full search's prefill knobs: tokens per prefill step and, with
/// quantized matrices (whose prefill widens row panels), the panel size,
/// each timed on a prefill of [`PREFILL_TOKENS`] tokens from an empty
/// cache.
struct PrefillKnobs {
    prompt: Vec<u32>,
    /// (knob, value, times in seconds).
    knobs: Vec<(&'static str, usize, Vec<f64>)>,
}

impl PrefillKnobs {
    fn new(config: &ModelConfig, quantized: bool, base: &Blocking) -> PrefillKnobs {
        let vocab = config.vocab_size as u32;
        let prompt = (0..PREFILL_TOKENS as u32)
            .map(|i| 4 + (i * 7919 + 13) % (vocab - 4))
            .collect();
        let mut knobs: Vec<(&'static str, usize, Vec<f64>)> = PREFILL_CHUNK_CANDIDATES
            .iter()
            .map(|&c| ("prefill_chunk", c, Vec::new()))
            .collect();
        if quantized {
            let panel = base.widened_panel_bytes;
            for bytes in [panel / 2, panel, panel * 2] {
                knobs.push(("widened_panel_bytes", bytes, Vec::new()));
            }
        }
        PrefillKnobs { prompt, knobs }
    }

    /// Times every candidate once, the others at the plan's values; leaves
    /// the engine with `base` and an empty cache.
    fn round(&mut self, engine: &mut FastEngine, base: &Blocking) -> Result<()> {
        for (knob, value, times) in &mut self.knobs {
            let mut blocking = base.clone();
            match *knob {
                "prefill_chunk" => blocking.prefill_chunk = *value,
                _ => blocking.widened_panel_bytes = *value,
            }
            engine.set_blocking(blocking);
            engine.truncate(0);
            let t0 = Instant::now();
            let result = engine.forward(&self.prompt, LogitsWanted::Last);
            times.push(t0.elapsed().as_secs_f64());
            result?;
        }
        engine.set_blocking(base.clone());
        engine.truncate(0);
        Ok(())
    }

    fn timings(&mut self) -> impl Iterator<Item = (&'static str, usize, &mut Vec<f64>)> {
        self.knobs.iter_mut().map(|(k, v, t)| (*k, *v, t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str) -> Entry {
        Entry {
            key: key.into(),
            tuned: Tuned {
                quant_prefetch: 4096,
                shared_rows_bytes: 16384,
                prefill_chunk: Some(63),
                widened_panel_bytes: None,
            },
            candidates: Vec::new(),
            build_ms: 3.0,
            spent_ms: 12.0,
        }
    }

    #[test]
    fn entries_are_found_by_their_whole_key() {
        // Removed on drop when the test ends, pass or fail.
        let tmp = tempfile::Builder::new()
            .prefix("pulsar-tuning-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let path = entry_path(dir, "key a");
        assert_ne!(path, entry_path(dir, "key b"));
        write_atomic(
            &path,
            serde_json::to_string(&entry("key a")).unwrap().as_bytes(),
        )
        .unwrap();
        let found = load_entry(&path, "key a").unwrap().expect("stored entry");
        assert_eq!(found.tuned, entry("key a").tuned);
        // Same file, another key (a hash collision or a hand-copied file):
        // not reused.
        assert!(load_entry(&path, "key b").unwrap().is_none());
        std::fs::write(&path, "{ not json").unwrap();
        let err = load_entry(&path, "key a").unwrap_err();
        assert!(format!("{err:#}").contains(&path.display().to_string()));
        assert!(
            load_entry(&dir.join("missing.json"), "key a")
                .unwrap()
                .is_none()
        );
    }
}
