//! Opening a fast engine, in the one order every command uses: the weight
//! formats decided once, the kernel plan made complete (with a stored
//! launch tuning in it) before any code is generated, then the kernels
//! emitted, verified and mapped, the weights loaded, the input precision
//! set and launch tuning finished.
//!
//! It takes two steps, as oneDNN's primitive descriptor and primitive do:
//! [`FastEngine::plan`] decides everything and reads no weights, so a
//! caller can print what will happen before the load, or move the plan to
//! the thread the engine will run on; [`EnginePlan::open`] generates the
//! code and loads. What a command's flags decide comes in
//! [`EngineOptions`] and what the launch did goes back in [`OpenReport`]:
//! nothing here reads process-wide settings but the CPU and the
//! documented environment overrides of the kernels (`PULSAR_MAX_ISA`,
//! `PULSAR_K_QUANTS`).

use super::{FastEngine, FastOptions, WeightFormats};
use crate::engine::autotune::{self, LaunchStep};
use crate::engine::jit_kernels::{JitKernels, plan_options};
use crate::engine::kernels::MatKernels;
use crate::engine::packed::{PackedMatrix, WeightArena};
use crate::engine::q8_input::InputPrecision;
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::dims::ModelDims;
use crate::jit::plan::{Plan, plan};
use crate::model::config::ModelConfig;
use crate::model::gemma4_assistant::{refuse_as_model, target_kv_layers};
use crate::model::source::ModelSource;
use crate::model::weights::{ModelWeights, RowTable, model_matrices};
use anyhow::Result;
use std::path::PathBuf;
use std::sync::Arc;

/// How to open a fast engine: everything a command's flags decide.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Threads, context, the formats asked for, and whether to use a
    /// converted file's weights in place.
    pub load: FastOptions,
    /// How the integer kernels' inputs are quantized.
    pub input_precision: InputPrecision,
    /// Whether launch tuning runs, and where tunings are stored.
    pub tuning: LaunchTuning,
    /// Whether the plan's notes include the long ones (how weights are
    /// converted at load); start-up is otherwise a line or two.
    pub verbose: bool,
}

/// Whether a launch tunes the plan's knobs on this CPU.
#[derive(Clone, Debug)]
pub enum LaunchTuning {
    /// Reuse the tuning stored in `dir` for this CPU, model, formats,
    /// threads, input precision and binary; when there is none, measure
    /// one (within `autotune::LAUNCH_BUDGET`) and store it there.
    Stored { dir: PathBuf },
    /// Run the analytic plan and measure nothing; `why` is what the
    /// report says ("--no-tune").
    Off { why: String },
}

/// An engine decided but not made: the formats, the complete kernel plan
/// and what launch tuning will do. Made by [`FastEngine::plan`], made real
/// by [`EnginePlan::open`].
pub struct EnginePlan {
    src: Arc<ModelSource>,
    /// A Gemma 4 assistant to load beside the model, to draft with.
    assistant: Option<DraftSource>,
    load: FastOptions,
    input_precision: InputPrecision,
    formats: WeightFormats,
    kernels: KernelPlan,
    tuning: LaunchStep,
    notes: Vec<String>,
}

/// The Gemma 4 assistant an [`EnginePlan`] loads beside the model.
#[derive(Clone)]
pub enum DraftSource {
    /// An assistant's GGUF file or HF folder.
    File(Arc<ModelSource>),
    /// Random weights of a known assistant shape, called `name`: `bench`
    /// prices drafting with it where no real assistant of that size can
    /// be had. Its head's clusters are runs of ids in order.
    Random {
        config: Box<ModelConfig>,
        name: String,
    },
}

impl DraftSource {
    pub fn config(&self) -> &ModelConfig {
        match self {
            DraftSource::File(src) => &src.config,
            DraftSource::Random { config, .. } => config,
        }
    }

    /// What error messages and reports call it.
    pub fn path(&self) -> PathBuf {
        match self {
            DraftSource::File(src) => src.path.clone(),
            DraftSource::Random { name, .. } => PathBuf::from(name),
        }
    }
}

/// The kernels an [`EnginePlan`] will generate.
enum KernelPlan {
    /// The JIT's plan for this CPU, complete: generating it is all that is
    /// left.
    Jit { plan: Box<Plan>, max_isa: Isa },
    /// This CPU cannot run the JIT's kernels, for `reason`.
    Unsupported { reason: String },
}

/// What [`EnginePlan::open`] made.
pub enum Opened {
    /// The fast engine, ready to feed, and what its launch did.
    Fast {
        engine: Box<FastEngine>,
        report: OpenReport,
    },
    /// This CPU cannot run the JIT's kernels; `reason` says what it lacks.
    /// The caller runs the reference engine (or stops, if it needs this
    /// one).
    NoJit { reason: String },
}

/// What opening an engine did, for the caller's "loaded …" line (no line
/// of its own: scripts and tests count stderr lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenReport {
    /// What launch tuning did: "tuning reused", "tuning measured in 310
    /// ms", "no tuning (--no-tune)".
    pub tuning: String,
    /// How the integer kernels' inputs are quantized.
    pub input_precision: InputPrecision,
    /// The file's types that were converted, in a few words
    /// ([`WeightFormats::conversion_brief`]).
    pub converted: Option<String>,
}

impl OpenReport {
    /// ", inputs in two 8-bit levels" with two input levels, else empty.
    pub fn input_note(&self) -> &'static str {
        match self.input_precision {
            InputPrecision::Bits8 => "",
            InputPrecision::TwoLevels => ", inputs in two 8-bit levels",
        }
    }

    /// The input precision where it is not the default, then the tuning:
    /// ", tuning reused", to end a "loaded …" line with.
    pub fn loaded_note(&self) -> String {
        let converted = self
            .converted
            .as_ref()
            .map_or(String::new(), |c| format!(", {c}"));
        format!("{}{converted}, {}", self.input_note(), self.tuning)
    }
}

impl FastEngine {
    /// Decides the engine `options` ask for on `src`, generating no code
    /// and reading no weights: the formats (once; see
    /// [`FastEngine::weight_formats`]), whether this CPU runs the JIT, the
    /// kernel plan with a stored launch tuning applied, and the notes to
    /// print before the load.
    pub fn plan(src: Arc<ModelSource>, options: &EngineOptions) -> Result<EnginePlan> {
        Self::plan_drafting(src, None, options)
    }

    /// [`FastEngine::plan`] with a Gemma 4 assistant to load beside the
    /// model (checked against it here): its matrices are planned in the
    /// model's 16-bit format.
    pub fn plan_drafting(
        src: Arc<ModelSource>,
        assistant: Option<DraftSource>,
        options: &EngineOptions,
    ) -> Result<EnginePlan> {
        refuse_as_model(&src.config, &src.path)?;
        if let Some(a) = &assistant {
            target_kv_layers(&src.config, &src.path, a.config(), &a.path())?;
        }
        let formats = Self::weight_formats(&src, &options.load)?;
        let mut notes = Vec::new();
        if options.verbose
            && let Some(note) = formats.conversion_note()
        {
            notes.push(note);
        }
        let config = &src.config;
        let threads = options.load.threads;
        let caps = CpuCaps::detect();
        let skip = |reason: String| LaunchStep::Skip { reason };
        let (kernels, tuning) = match caps.baseline_message() {
            Some(reason) => (
                KernelPlan::Unsupported { reason },
                skip("the JIT does not run".into()),
            ),
            None => {
                let tuning = match &options.tuning {
                    LaunchTuning::Off { why } => skip(why.clone()),
                    LaunchTuning::Stored { dir } => {
                        let (step, warning) = autotune::launch_step(
                            config,
                            &formats,
                            threads.max(1),
                            options.input_precision,
                            options.load.context,
                            dir,
                        );
                        notes.extend(warning);
                        step
                    }
                };
                let mut opts = plan_options(config, &formats, threads);
                if let Some(a) = &assistant {
                    let format = super::assistant_format(&formats, a.config());
                    super::plan_assistant(&mut opts, a.config(), format);
                }
                if let LaunchStep::Reuse { entry, .. } = &tuning {
                    autotune::plan_with(&mut opts, &entry.tuned);
                }
                let plan = plan(&ModelDims::from(config), &caps, &opts)?;
                let kernels = KernelPlan::Jit {
                    plan: Box::new(plan),
                    max_isa: opts.max_isa,
                };
                (kernels, tuning)
            }
        };
        Ok(EnginePlan {
            src,
            assistant,
            load: options.load.clone(),
            input_precision: options.input_precision,
            formats,
            kernels,
            tuning,
            notes,
        })
    }

    /// [`FastEngine::plan`] and [`EnginePlan::open`] in one call, for a
    /// caller with nothing to print before the load (the plan's notes are
    /// dropped).
    pub fn open(src: Arc<ModelSource>, options: &EngineOptions) -> Result<Opened> {
        Self::plan(src, options)?.open()
    }

    /// Loads weights in the kernels' layout: converted (or copied) into one
    /// huge-page arena, or, with `in_place`, used zero-copy from the mapping
    /// where the file already stores them in the packed format. The
    /// formats are decided here ([`FastEngine::weight_formats`]); `kernels`
    /// must be planned for them.
    pub fn load(
        src: &Arc<ModelSource>,
        kernels: Box<dyn MatKernels>,
        opts: &FastOptions,
    ) -> Result<Self> {
        refuse_as_model(&src.config, &src.path)?;
        let formats = Self::weight_formats(src, opts)?;
        Self::load_in(src, kernels, &formats, opts)
    }

    /// [`FastEngine::load`] with the formats already decided.
    fn load_in(
        src: &Arc<ModelSource>,
        kernels: Box<dyn MatKernels>,
        formats: &WeightFormats,
        opts: &FastOptions,
    ) -> Result<Self> {
        let owner: Arc<dyn Send + Sync> = src.clone();
        let c = &src.config;
        // One arena for every matrix that needs converting.
        let arena_bytes = model_matrices(c)
            .into_iter()
            .map(|(role, [rows, cols])| WeightArena::footprint(formats.of(role), rows, cols))
            .sum();
        let arena = WeightArena::new(arena_bytes);
        let table_owner = owner.clone();
        let weights = ModelWeights::load_with(
            src,
            |role, t| {
                let format = formats.of(role);
                if opts.in_place && t.dtype == format.row_blocked_dtype() {
                    PackedMatrix::borrowed(owner.clone(), &t)
                } else {
                    Ok(PackedMatrix::convert_into(&t, format, &arena))
                }
            },
            // A token reads one row of the per-layer table: it stays in
            // the mapped file, in the file's type. Its pages, read once
            // for the scale check, are dropped; rows fault back in as
            // tokens need them.
            |t| {
                t.release_pages();
                Ok(RowTable::mapped(table_owner, &t))
            },
        )?;
        Self::new(src.config.clone(), weights, kernels, opts)
    }
}

impl EnginePlan {
    /// The packed format of each matrix, as the engine will hold them.
    pub fn formats(&self) -> &WeightFormats {
        &self.formats
    }

    /// Lines for stderr before the load, each to follow the command's
    /// prefix: with `verbose`, how weights are converted at load; a stored
    /// tuning that cannot be read.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The model this plan opens.
    pub fn source(&self) -> &Arc<ModelSource> {
        &self.src
    }

    /// Generates the planned kernels, loads the weights into the planned
    /// formats, sets the input precision and finishes launch tuning
    /// (applies the stored tuning's blocking, or measures and stores one).
    /// A kernel that fails verification is an error: the program must
    /// stop rather than run unverified code.
    pub fn open(self) -> Result<Opened> {
        let (plan, max_isa) = match self.kernels {
            KernelPlan::Jit { plan, max_isa } => (plan, max_isa),
            KernelPlan::Unsupported { reason } => return Ok(Opened::NoJit { reason }),
        };
        let config = &self.src.config;
        let kernels = JitKernels::from_plan(config, &plan, max_isa)?;
        let mut engine =
            FastEngine::load_in(&self.src, Box::new(kernels), &self.formats, &self.load)?;
        if let Some(a) = &self.assistant {
            let format = super::assistant_format(&self.formats, a.config());
            match a {
                DraftSource::File(src) => engine.load_assistant(src, &self.src.path, format)?,
                DraftSource::Random { config, name } => {
                    engine.attach_random_assistant((**config).clone(), name, format)?
                }
            }
        }
        engine.set_input_precision(self.input_precision);
        let tuning = match self.tuning {
            LaunchStep::Skip { reason } => format!("no tuning ({reason})"),
            LaunchStep::Reuse { entry, .. } => {
                // The kernels were generated with its choices already.
                autotune::apply_blocking(&mut engine, &entry.tuned);
                "tuning reused".to_string()
            }
            LaunchStep::Measure { key, dir, path } => {
                let (entry, stored) = autotune::measure_at_launch(
                    &mut engine,
                    config,
                    &self.formats,
                    key,
                    &dir,
                    &path,
                )?;
                let stored = match stored {
                    Ok(()) => String::new(),
                    Err(e) => format!(" (not stored: {e:#})"),
                };
                format!("tuning measured in {:.0} ms{stored}", entry.spent_ms)
            }
        };
        Ok(Opened::Fast {
            engine: Box::new(engine),
            report: OpenReport {
                tuning,
                input_precision: self.input_precision,
                converted: self.formats.conversion_brief(),
            },
        })
    }
}
