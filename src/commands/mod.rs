//! What each CLI subcommand does; `main.rs` only parses arguments.

pub mod bench;
pub mod chat;
pub mod logits;
pub mod run;
pub mod tokenize;

use crate::engine::Engine;
use crate::engine::fast::{DEFAULT_PREFILL_CHUNK, FastEngine, FastOptions};
use crate::engine::kernels::{MatKernels, PortableKernels};
use crate::engine::packed::WeightFormat;
use crate::engine::reference::ReferenceEngine;
use crate::engine::synthetic;
use crate::model::source::ModelSource;
use crate::model::{fetch, presets};
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

/// The model named with `-m`, else the default model.
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    match arg {
        Some(p) => Ok(p.to_path_buf()),
        None => fetch::default_model_path(),
    }
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

/// Builds the chosen engine for an opened model.
pub fn open_engine(
    src: &ModelSource,
    kind: EngineKind,
    threads: usize,
    context: usize,
) -> Result<Box<dyn Engine>> {
    Ok(match kind {
        EngineKind::Reference => Box::new(ReferenceEngine::load(src)?),
        EngineKind::Jit => {
            let opts = FastOptions {
                threads,
                context,
                format: None,
                prefill_chunk: DEFAULT_PREFILL_CHUNK,
            };
            Box::new(FastEngine::load(src, kernels(), &opts)?)
        }
    })
}

/// The matrix kernels for this CPU.
pub fn kernels() -> Box<dyn MatKernels> {
    Box::new(PortableKernels)
}

/// `pulsar bench`: a real model, or a known shape on random weights.
pub fn bench_command(
    model: Option<&Path>,
    shape: Option<&str>,
    format: Option<WeightFormat>,
    threads: usize,
    args: &bench::BenchArgs,
) -> Result<()> {
    let context = args.prompt_tokens + args.generate_tokens + 2;
    let opts = FastOptions {
        threads,
        context,
        format,
        prefill_chunk: DEFAULT_PREFILL_CHUNK,
    };
    let (mut engine, name) = match shape {
        Some(name) => {
            let Some(config) = presets::shape(name) else {
                bail!(
                    "unknown shape {name:?}; known shapes: {}",
                    presets::SHAPES.join(", ")
                );
            };
            eprintln!("bench: making random {name} weights");
            let weights =
                synthetic::random_weights(&config, format.unwrap_or(WeightFormat::F16), 1);
            (
                FastEngine::new(config, weights, kernels(), &opts)?,
                format!("{name} (random weights)"),
            )
        }
        None => {
            let path = resolve_model(model)?;
            let src = ModelSource::open(&path)?;
            (
                FastEngine::load(&src, kernels(), &opts)?,
                path.display().to_string(),
            )
        }
    };
    let dtype = engine_weights_name(&engine);
    let report = bench::run(&mut engine, &name, &dtype, args)?;
    bench::print(&report, args.json)
}

fn engine_weights_name(engine: &FastEngine) -> String {
    engine.weight_format().name().to_string()
}
