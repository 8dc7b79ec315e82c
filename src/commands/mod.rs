//! What each CLI subcommand does; `main.rs` only parses arguments.

pub mod bench;
pub mod chat;
pub mod convert;
pub mod dump;
pub mod embed;
pub mod logits;
pub mod perplexity;
pub mod run;
pub mod serve;
pub mod tokenize;
pub mod tune_measure;

use crate::constrain::lookahead::ConstraintReport;
use crate::constrain::{CompiledConstraint, ConstraintSpec, GrammarCompiler, VocabBytes};
use crate::engine::Engine;
use crate::engine::autotune;
use crate::engine::fast::{FastEngine, FastOptions, WeightFormats};
use crate::engine::jit_kernels::JitKernels;
use crate::engine::kernels::MatKernels;
use crate::engine::packed::WeightFormat;
use crate::engine::q8_input::InputPrecision;
use crate::engine::reference::ReferenceEngine;
use crate::engine::synthetic;
use crate::generate::StopReason;
use crate::model::config::ModelConfig;
use crate::model::source::ModelSource;
use crate::model::{fetch, presets};
use crate::sample::SamplerConfig;
use crate::speculative::Speculation;
use crate::tokenizer::Tokenizer;
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The model named with `-m`, else the default model.
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    match arg {
        Some(p) => Ok(p.to_path_buf()),
        None => fetch::default_model_path(),
    }
}

/// What `run` and `chat` share: the model, the input, sampling and the
/// engine.
pub struct GenerationArgs {
    pub model: PathBuf,
    /// The prompt (`run`), or one message after which `chat` exits.
    pub prompt: Option<String>,
    /// A UTF-8 document: `run`'s prompt or context, `chat`'s opening.
    pub file: Option<PathBuf>,
    pub max_new: usize,
    pub sampling: SamplerConfig,
    pub seed: u64,
    pub context: usize,
    pub system: Option<String>,
    /// `--chat-template NAME|FILE`; without it the model decides.
    pub chat_template: Option<String>,
    /// `--think`: the model may think before it answers (Gemma 4).
    pub think: bool,
    /// `--show-thinking`: print the thought channel instead of hiding it.
    pub show_thinking: bool,
    /// `--stop TEXT`: text that ends generation, never printed.
    pub stop: Vec<String>,
    pub engine: EngineKind,
    pub threads: usize,
    /// Use 16-bit weights in place from the mapped file (see
    /// [`FastOptions::in_place`]).
    pub in_place: bool,
    /// The formats the fast engine keeps its matrices in.
    pub dtype: Dtype,
    /// `--json`, `--json-schema`, `--regex` or `--grammar`: what every
    /// reply must be.
    pub constraint: Option<ConstraintSpec>,
    /// `--spec`: draft tokens and verify them in batched steps.
    pub speculation: Speculation,
}

/// Environment variable that fixes the draft-length policy's step cost
/// at `1 + c·k` for `k` drafted tokens instead of measuring it (tests and
/// benchmarks: the draft lengths then do not depend on timing).
pub const SPEC_STEP_COST_VAR: &str = "PULSAR_SPEC_STEP_COST";

/// The speculation a command runs with: the one asked for, with
/// [`SPEC_STEP_COST_VAR`] applied.
pub fn effective_speculation(asked: Speculation) -> Result<Speculation> {
    let mut asked = asked;
    if let Speculation::Ngram(options) = &mut asked
        && let Some(value) = std::env::var_os(SPEC_STEP_COST_VAR)
    {
        let value = value.to_string_lossy();
        match value.trim().parse::<f64>() {
            Ok(c) if c.is_finite() && c >= 0.0 => options.step_cost = Some(c),
            _ => bail!("{SPEC_STEP_COST_VAR}={value:?}: expected a number >= 0, e.g. 0.05"),
        }
    }
    Ok(asked)
}

/// Which forward pass to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// JIT kernels on the thread pool (the fast path).
    Jit,
    /// The plain-Rust f32 oracle.
    Reference,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Jit => "jit",
            EngineKind::Reference => "reference",
        }
    }
}

/// `--dtype`: the formats the fast engine keeps its matrices in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dtype {
    /// The file's own types where an integer kernel reads them (Q8_0, Q5_0,
    /// Q4_0), Q4_K and Q5_K as Q5_0 with an offset per 32 values, Q6_K
    /// requantized to Q8_0; 16-bit matrices as FP16 (BF16 checkpoints as
    /// BF16).
    #[default]
    Native,
    /// Every matrix as FP16.
    F16,
    /// Every matrix as BF16.
    Bf16,
    /// Every matrix whose rows are whole 32-value blocks quantized to Q8_0
    /// at load (an FP16 or BF16 checkpoint then streams half the bytes);
    /// the rest FP16.
    Q8_0,
    /// As `Q8_0`, in Q4_0 (4 bits and an f16 scale per 32 values).
    Q4_0,
}

impl Dtype {
    /// The packed format asked for, if one is.
    pub fn format(self) -> Option<WeightFormat> {
        match self {
            Dtype::Native => None,
            Dtype::F16 => Some(WeightFormat::F16),
            Dtype::Bf16 => Some(WeightFormat::BF16),
            Dtype::Q8_0 => Some(WeightFormat::Q8_0),
            Dtype::Q4_0 => Some(WeightFormat::Q4_0),
        }
    }

    /// The formats of a shape without a file (`--shape`, a bare
    /// config.json): FP16 unless asked otherwise, Q8_0 in the layout this
    /// CPU's kernels read.
    pub fn shape_formats(self, config: &ModelConfig) -> WeightFormats {
        WeightFormats::for_shape(config, self.format().unwrap_or(WeightFormat::F16))
            .with_layouts(&crate::engine::jit_kernels::quant_layouts())
    }

    pub fn fast_options(self, threads: usize, context: usize, in_place: bool) -> FastOptions {
        FastOptions {
            threads,
            context,
            format: self.format(),
            prefill_chunk: 0,
            in_place,
            native: self == Dtype::Native,
        }
    }
}

/// Builds the chosen engine for an opened model. A CPU the JIT cannot
/// serve gets the reason on stderr and the reference engine; a kernel that
/// fails verification stops the program.
pub fn open_engine(
    src: ModelSource,
    kind: EngineKind,
    threads: usize,
    context: usize,
    in_place: bool,
    dtype: Dtype,
) -> Result<Box<dyn Engine>> {
    if kind == EngineKind::Reference {
        return Ok(Box::new(ReferenceEngine::load(&src)?));
    }
    let opts = dtype.fast_options(threads, context, in_place);
    let formats = FastEngine::weight_formats(&src, &opts)?;
    print_conversion_note("pulsar", &formats);
    let config = src.config.clone();
    match JitKernels::for_this_cpu(&src.config, formats.clone(), threads)? {
        Some(kernels) => {
            let mut engine = FastEngine::load(&Arc::new(src), Box::new(kernels), &opts)?;
            prepare_loaded_engine(&mut engine, &config, &formats)?;
            Ok(Box::new(engine))
        }
        None => Ok(Box::new(ReferenceEngine::load(&src)?)),
    }
}

/// Set by `--verbose`: start-up notes beyond the model and its speed (how
/// the weights were converted) are printed.
static VERBOSE: AtomicBool = AtomicBool::new(false);

/// `--verbose`: print the long start-up notes.
pub fn set_verbose() {
    VERBOSE.store(true, Ordering::Relaxed);
}

/// Whether `--verbose` asked for the long start-up notes.
pub fn verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// The note on weights converted at load, on stderr with `prefix`, under
/// `--verbose` only: it runs to some 300 characters, and start-up should
/// be a line or two.
pub fn print_conversion_note(prefix: &str, formats: &crate::engine::fast::WeightFormats) {
    if verbose()
        && let Some(note) = formats.conversion_note()
    {
        eprintln!("{prefix}: {note}");
    }
}

/// Set by `--no-tune`: engines run the analytic plan, nothing is measured.
static NO_TUNE: AtomicBool = AtomicBool::new(false);

/// `--no-tune`: skip launch tuning in this process.
pub fn disable_launch_tuning() {
    NO_TUNE.store(true, Ordering::Relaxed);
}

/// Where launch tunings are stored: `tuning/` in the cache folder.
pub fn tuning_dir() -> Result<PathBuf> {
    Ok(fetch::cache_dir()?.join("tuning"))
}

/// What this process's launch tuning did, for the "loaded" line (no line
/// of its own: scripts and tests count stderr lines).
static TUNING_NOTE: Mutex<String> = Mutex::new(String::new());

/// ", tuning reused" or ", tuning measured in 310 ms" (empty before any
/// fast engine was tuned), to end a "loaded …" line with.
pub fn tuning_note() -> String {
    TUNING_NOTE.lock().map(|n| n.clone()).unwrap_or_default()
}

/// What was set up for this process's fast engine, for the "loaded …"
/// lines: the input precision where it is not the default, then
/// `tuning_note` (empty before any fast engine was readied).
pub fn engine_note() -> String {
    let tuning = tuning_note();
    if tuning.is_empty() {
        return tuning;
    }
    format!("{}{tuning}", input_note())
}

/// Set by `--input-bits 16`: engines quantize the integer kernels'
/// inputs in two 8-bit levels.
static TWO_INPUT_LEVELS: AtomicBool = AtomicBool::new(false);

/// `--input-bits`: how every fast engine of this process quantizes the
/// integer kernels' inputs.
pub fn set_input_precision(precision: InputPrecision) {
    TWO_INPUT_LEVELS.store(precision == InputPrecision::TwoLevels, Ordering::Relaxed);
}

/// ", inputs in two 8-bit levels" under `--input-bits 16`, else empty: for
/// the "loaded …" lines.
pub fn input_note() -> &'static str {
    match input_precision() {
        InputPrecision::Bits8 => "",
        InputPrecision::TwoLevels => ", inputs in two 8-bit levels",
    }
}

/// This process's input precision (`--input-bits`).
pub fn input_precision() -> InputPrecision {
    if TWO_INPUT_LEVELS.load(Ordering::Relaxed) {
        InputPrecision::TwoLevels
    } else {
        InputPrecision::Bits8
    }
}

/// Readies a freshly loaded engine with this process's flags: the input
/// precision (`--input-bits`), then launch tuning, which reuses a stored
/// tuning when there is one for this CPU, model, formats, threads and
/// binary. `tuning_note` says what it did. Call before feeding it.
pub fn prepare_loaded_engine(
    engine: &mut FastEngine,
    config: &ModelConfig,
    formats: &WeightFormats,
) -> Result<()> {
    engine.set_input_precision(input_precision());
    let note = if NO_TUNE.load(Ordering::Relaxed) {
        ", no tuning (--no-tune)".to_string()
    } else {
        match autotune::tune_at_launch(engine, config, formats, &tuning_dir()?)? {
            autotune::Outcome::Reused { .. } => ", tuning reused".to_string(),
            autotune::Outcome::Measured { entry, stored, .. } => {
                let stored = match stored {
                    Ok(()) => String::new(),
                    Err(e) => format!(" (not stored: {e:#})"),
                };
                format!(", tuning measured in {:.0} ms{stored}", entry.spent_ms)
            }
            autotune::Outcome::Skipped { reason } => format!(", no tuning ({reason})"),
        }
    };
    if let Ok(mut n) = TUNING_NOTE.lock() {
        *n = note;
    }
    Ok(())
}

/// The JIT's kernels for this model on this CPU.
pub fn jit_kernels(
    config: &ModelConfig,
    formats: WeightFormats,
    threads: usize,
) -> Result<Box<dyn MatKernels>> {
    Ok(Box::new(JitKernels::build(config, formats, threads)?))
}

/// `pulsar bench`: a real model, or a known shape on random weights.
pub fn bench_command(
    model: Option<&Path>,
    shape: Option<&str>,
    dtype: Dtype,
    threads: usize,
    in_place: bool,
    args: &bench::BenchArgs,
) -> Result<()> {
    let mut context = args.prompt_tokens + args.generate_tokens + 2;
    if args.m_curve {
        // The m-curve's cached context and its largest step.
        context = context.max(args.m_curve_context + bench::M_CURVE_MAX);
    }
    let opts = dtype.fast_options(threads, context, in_place);
    let (mut engine, name) = match shape {
        Some(name) => {
            let Some(config) = presets::shape(name) else {
                bail!(
                    "unknown shape {name:?}; known shapes: {}",
                    presets::SHAPES.join(", ")
                );
            };
            eprintln!("bench: making random {name} weights");
            let formats = dtype.shape_formats(&config);
            let weights = synthetic::random_weights(&config, &formats, 1);
            let kernels = jit_kernels(&config, formats, threads)?;
            let mut engine = FastEngine::new(config, weights, kernels, &opts)?;
            engine.set_input_precision(input_precision());
            (engine, format!("{name} (random weights)"))
        }
        None => {
            let path = resolve_model(model)?;
            let src = Arc::new(ModelSource::open(&path)?);
            let formats = FastEngine::weight_formats(&src, &opts)?;
            if let Some(note) = formats.conversion_note() {
                eprintln!("bench: {note}");
            }
            let kernels = jit_kernels(&src.config, formats.clone(), threads)?;
            let mut engine = FastEngine::load(&src, kernels, &opts)?;
            prepare_loaded_engine(&mut engine, &src.config, &formats)?;
            (engine, path.display().to_string())
        }
    };
    let dtype = format!("{}{}", engine.formats().describe(), input_note());
    let report = bench::run(&mut engine, &name, &dtype, args)?;
    bench::print(&report, args.json)
}
/// The output constraint's compiler, indexing the vocabulary on a helper
/// thread (about a second for Gemma's vocabulary) while the model loads.
pub struct ConstraintBuild {
    spec: ConstraintSpec,
    vocab_size: usize,
    indexing: std::thread::JoinHandle<Result<GrammarCompiler>>,
}

/// Starts building the output constraint, when one was asked for. The
/// constraint is first compiled over a byte-level vocabulary, so that an
/// invalid schema, regex or grammar fails at once, before the model loads.
/// `end_ids` are the tokens that end a reply.
pub fn start_constraint(
    spec: Option<&ConstraintSpec>,
    tok: &Tokenizer,
    end_ids: &[u32],
) -> Result<Option<ConstraintBuild>> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    GrammarCompiler::byte_level()?.compile(spec)?;
    let vocab = VocabBytes::of(tok, end_ids)?;
    Ok(Some(ConstraintBuild {
        spec: spec.clone(),
        vocab_size: tok.vocab_size(),
        indexing: std::thread::spawn(move || GrammarCompiler::build(vocab)),
    }))
}

impl ConstraintBuild {
    /// Waits for the index, compiles the constraint and says on stderr how
    /// long each took (one line).
    pub fn finish(self) -> Result<CompiledConstraint> {
        let compiler = self.indexing.join().map_err(|_| {
            anyhow::anyhow!(
                "{}: the constraint engine failed while indexing the vocabulary",
                self.spec.flag()
            )
        })??;
        let compiled = compiler.compile(&self.spec)?;
        eprintln!(
            "pulsar: {} constraint: vocabulary of {} tokens indexed in {:.0} ms (beside the model load), compiled in {:.1} ms",
            self.spec.flag(),
            self.vocab_size,
            compiler.build_secs() * 1e3,
            compiled.compile_secs() * 1e3
        );
        Ok(compiled)
    }
}

/// Says on stderr how an output constraint ended a reply when that needs
/// saying: a dead end, or a token limit that cut the output short.
pub fn report_constraint(
    stop: StopReason,
    report: Option<&ConstraintReport>,
    constraint: Option<&CompiledConstraint>,
) {
    let (Some(report), Some(flag)) = (report, constraint.map(CompiledConstraint::flag)) else {
        return;
    };
    match stop {
        StopReason::ConstraintDeadEnd => eprintln!(
            "pulsar: generation stopped: no token can continue the output under {}",
            report.dead_end.as_deref().unwrap_or(flag)
        ),
        StopReason::Limit | StopReason::ContextFull => eprintln!(
            "pulsar: the output is incomplete under {flag}: the token limit came first; raise -n"
        ),
        _ => {}
    }
    eprintln!("pulsar: {}", report.summary(flag));
}
