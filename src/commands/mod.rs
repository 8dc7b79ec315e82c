//! What each CLI subcommand does; `main.rs` only parses arguments.

pub mod bench;
pub mod chat;
pub mod convert;
mod convert_same_tensors;
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
use crate::engine::fast::{
    DraftSource, EngineOptions, EnginePlan, FastEngine, FastOptions, LaunchTuning, OpenReport,
    Opened, WeightFormats,
};
use crate::engine::jit_kernels::JitKernels;
use crate::engine::kernels::MatKernels;
use crate::engine::packed::WeightFormat;
use crate::engine::q8_input::InputPrecision;
use crate::engine::reference::ReferenceEngine;
use crate::generate::StopReason;
use crate::model::config::ModelConfig;
use crate::model::fetch;
use crate::model::source::ModelSource;
use crate::sample::SamplerConfig;
use crate::speculative::Speculation;
use crate::tokenizer::Tokenizer;
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    /// The engine, its threads and formats, and the shared flags.
    pub engine: EngineArgs,
    /// `--json`, `--json-schema`, `--regex` or `--grammar`: what every
    /// reply must be.
    pub constraint: Option<ConstraintSpec>,
    /// `--spec`: draft tokens and verify them in batched steps; `None`:
    /// with a Gemma 4 assistant (`mtp`), else from n-grams.
    pub speculation: Option<Speculation>,
    /// `--draft`: the Gemma 4 assistant to draft with (else one found
    /// beside the model by name).
    pub draft: Option<PathBuf>,
}

/// The Gemma 4 assistant a generating command drafts with and the
/// speculation it runs: `--draft`, else an assistant found beside the
/// model by name ([`crate::model::gemma4_assistant::beside`]) unless
/// `--spec` asks for no model; `--spec` as asked, else `mtp` with an
/// assistant and `ngram` without. An assistant found by name that does
/// not fit the model is passed over with one line on stderr (unless
/// `--spec mtp` asked for it: then that is the error); `--spec ngram` or
/// `off` loads none.
pub fn drafting(
    src: &ModelSource,
    draft: Option<&Path>,
    asked: Option<Speculation>,
) -> Result<(Option<ModelSource>, Speculation)> {
    use crate::model::gemma4_assistant::{beside, target_kv_layers};
    let wants_model = matches!(asked, None | Some(Speculation::Mtp(_)));
    if !wants_model {
        return Ok((None, asked.unwrap_or_else(Speculation::ngram)));
    }
    let assistant = match draft {
        Some(path) => Some(ModelSource::open(path)?),
        None => match beside(&src.path) {
            Some(path) => {
                let found = ModelSource::open(&path).and_then(|a| {
                    target_kv_layers(&src.config, &src.path, &a.config, &a.path)?;
                    Ok(a)
                });
                match (found, asked) {
                    (Ok(a), _) => Some(a),
                    (Err(e), Some(_)) => return Err(e),
                    (Err(e), None) => {
                        eprintln!(
                            "pulsar: not drafting with the assistant beside the model: {e:#}"
                        );
                        None
                    }
                }
            }
            None => None,
        },
    };
    let speculation = match (asked, &assistant) {
        (Some(Speculation::Mtp(_)), None) => bail!(
            "--spec mtp needs a Gemma 4 assistant: give one with --draft (none was found beside {})",
            src.path.display()
        ),
        (Some(s), _) => s,
        (None, Some(_)) => Speculation::mtp(),
        (None, None) => Speculation::ngram(),
    };
    Ok((assistant, speculation))
}

/// Environment variable that fixes the draft-length policy's step cost
/// at `1 + c·k` for `k` drafted tokens instead of measuring it (tests and
/// benchmarks: the draft lengths then do not depend on timing).
pub const SPEC_STEP_COST_VAR: &str = "PULSAR_SPEC_STEP_COST";

/// The speculation a command runs with: the one asked for, with
/// [`SPEC_STEP_COST_VAR`] applied.
pub fn effective_speculation(asked: Speculation) -> Result<Speculation> {
    let mut asked = asked;
    if let Some(options) = asked.options_mut()
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

/// The flags every command takes (`--verbose`, `--no-tune`,
/// `--input-bits`), passed down from `main` rather than kept in process
/// globals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedFlags {
    /// `--verbose`: print the long start-up notes too (how the weights
    /// were converted, what the chat format is).
    pub verbose: bool,
    /// `--no-tune`: run the analytic plan, measure nothing.
    pub no_tune: bool,
    /// `--input-bits`: how the integer kernels' inputs are quantized.
    pub input_precision: InputPrecision,
}

impl SharedFlags {
    /// Whether launch tuning runs, and the folder it stores tunings in.
    pub fn tuning(&self) -> Result<LaunchTuning> {
        Ok(if self.no_tune {
            LaunchTuning::Off {
                why: "--no-tune".into(),
            }
        } else {
            LaunchTuning::Stored { dir: tuning_dir()? }
        })
    }
}

/// The flags that choose and shape a command's engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineArgs {
    pub kind: EngineKind,
    pub threads: usize,
    /// The formats the fast engine keeps its matrices in.
    pub dtype: Dtype,
    /// Use 16-bit weights in place from the mapped file (see
    /// [`FastOptions::in_place`]).
    pub in_place: bool,
    pub flags: SharedFlags,
}

impl EngineArgs {
    /// The fast engine's options, with room for `context` tokens per
    /// sequence.
    pub fn options(&self, context: usize) -> Result<EngineOptions> {
        Ok(EngineOptions {
            load: self
                .dtype
                .fast_options(self.threads, context, self.in_place),
            input_precision: self.flags.input_precision,
            tuning: self.flags.tuning()?,
            verbose: self.flags.verbose,
        })
    }
}

/// An engine a command opened, and what opening it did.
pub struct OpenedEngine {
    pub engine: Box<dyn Engine>,
    /// ", tuning reused" and the like, to end the "loaded …" line with;
    /// empty for the reference engine.
    pub note: String,
}

/// Builds the chosen engine for an opened model, with room for `context`
/// tokens. A CPU the JIT cannot serve gets the reason on stderr and the
/// reference engine; a kernel that fails verification stops the program.
pub fn open_engine(src: ModelSource, args: &EngineArgs, context: usize) -> Result<OpenedEngine> {
    open_engine_drafting(src, args, context, None)
}

/// [`open_engine`] with a Gemma 4 assistant to draft with
/// ([`Engine::draft`]), when one is given: checked against the model
/// before either is loaded.
pub fn open_engine_drafting(
    src: ModelSource,
    args: &EngineArgs,
    context: usize,
    assistant: Option<ModelSource>,
) -> Result<OpenedEngine> {
    if let Some(a) = &assistant {
        crate::model::gemma4_assistant::target_kv_layers(
            &src.config,
            &src.path,
            &a.config,
            &a.path,
        )?;
    }
    let assistant = assistant.map(Arc::new);
    let reference = |src: &ModelSource| -> Result<OpenedEngine> {
        let mut engine = ReferenceEngine::load(src)?;
        if let Some(a) = &assistant {
            engine.attach_assistant(a, &src.path)?;
        }
        Ok(OpenedEngine {
            engine: Box::new(engine),
            note: String::new(),
        })
    };
    if args.kind == EngineKind::Reference {
        return reference(&src);
    }
    let plan = FastEngine::plan_drafting(
        Arc::new(src),
        assistant.clone().map(DraftSource::File),
        &args.options(context)?,
    )?;
    print_notes("pulsar", &plan);
    let src = plan.source().clone();
    match plan.open()? {
        Opened::Fast { engine, report } => Ok(OpenedEngine {
            engine,
            note: report.loaded_note(),
        }),
        Opened::NoJit { reason } => {
            eprintln!("pulsar: {reason}");
            reference(&src)
        }
    }
}

/// Opens the planned fast engine, for a command that has no use for the
/// reference engine: a CPU the JIT cannot serve is an error naming
/// `command`, after the reason on stderr.
pub fn open_fast_engine(plan: EnginePlan, command: &str) -> Result<(FastEngine, OpenReport)> {
    match plan.open()? {
        Opened::Fast { engine, report } => Ok((*engine, report)),
        Opened::NoJit { reason } => {
            eprintln!("pulsar: {reason}");
            bail!("{command} needs the JIT engine, which this CPU cannot run (see above)")
        }
    }
}

/// A plan's start-up notes on stderr, each after `prefix`.
pub fn print_notes(prefix: &str, plan: &EnginePlan) {
    for note in plan.notes() {
        eprintln!("{prefix}: {note}");
    }
}

/// Where launch tunings are stored: `tuning/` in the cache folder.
pub fn tuning_dir() -> Result<PathBuf> {
    Ok(fetch::cache_dir()?.join("tuning"))
}

/// The JIT's kernels for this model on this CPU.
pub fn jit_kernels(
    config: &ModelConfig,
    formats: WeightFormats,
    threads: usize,
) -> Result<Box<dyn MatKernels>> {
    Ok(Box::new(JitKernels::build(config, formats, threads)?))
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
