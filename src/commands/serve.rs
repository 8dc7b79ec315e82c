//! `pulsar serve`: loads the model, the tokenizer, the chat format and the
//! constraint compiler, then hands them to the server (`crate::serve`).

use super::run::load_tokenizer;
use super::{Dtype, EngineArgs, EngineKind, SharedFlags, drafting, effective_speculation};
use crate::chat::turns::TurnEncoder;
use crate::chat_template::TemplateChoice;
use crate::constrain::{GrammarCompiler, VocabBytes};
use crate::engine::fast::{DraftSource, FastEngine};
use crate::generate;
use crate::model::source::ModelSource;
use crate::sample::SamplerConfig;
use crate::serve::request::ServeContext;
use crate::serve::{self, ServeOptions};
use crate::speculative::Speculation;
use anyhow::{Result, bail};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct ServeArgs {
    pub model: PathBuf,
    pub host: String,
    pub port: u16,
    pub parallel: usize,
    pub queue: usize,
    /// Tokens per sequence.
    pub context: usize,
    pub api_key: Option<String>,
    pub threads: usize,
    pub dtype: Dtype,
    pub in_place: bool,
    pub chat_template: Option<String>,
    pub max_body: usize,
    pub prefill_chunk: usize,
    pub stall_timeout: Duration,
    pub grace: Duration,
    pub limits: crate::serve::conn::ConnectionLimits,
    pub read_timeout: Duration,
    pub quiet: bool,
    /// `--spec`; `None`: with a Gemma 4 assistant (`mtp`), else `ngram`.
    pub speculation: Option<Speculation>,
    /// `--draft`: the Gemma 4 assistant each sequence drafts with (else one
    /// found beside the model by name).
    pub draft: Option<PathBuf>,
    /// Defaults for the settings a request leaves out.
    pub defaults: SamplerConfig,
    /// `--verbose`, `--no-tune`, `--input-bits`.
    pub flags: SharedFlags,
}

/// The name `/v1/models` lists: the file (or folder) name without `.gguf`.
fn model_id(path: &std::path::Path) -> String {
    let name = path
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    name.strip_suffix(".gguf").unwrap_or(&name).to_string()
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.parallel == 0 {
        bail!("--parallel 0: the server needs at least one slot");
    }
    if args.context < 2 {
        bail!(
            "-c {}: a sequence must hold a prompt token and a new one",
            args.context
        );
    }
    if args.limits.max_connections == 0 {
        bail!("--max-connections 0: the server needs at least one connection");
    }
    args.defaults.validate()?;
    let started = Instant::now();
    let src = ModelSource::open(&args.model)?;
    let tok = load_tokenizer(&src)?;
    let choice = TemplateChoice::for_model(&src, &tok, args.chat_template.as_deref())?;
    eprintln!("pulsar serve: {}", choice.describe(args.flags.verbose));
    let end_ids = generate::stop_ids(&tok);
    // The chat's stop ids add the template's stop pieces.
    let chat_stop_ids = TurnEncoder::new(choice.template.clone(), None, None)?.stop_ids(&tok);
    // Indexing the vocabulary for response_format takes about a second:
    // beside the model load.
    let vocab = VocabBytes::of(&tok, &end_ids)?;
    let indexing = std::thread::spawn(move || GrammarCompiler::build(vocab));

    // The model cannot attend further than it was built for.
    let context = args.context.min(src.config.max_context);
    if context < args.context {
        eprintln!(
            "pulsar serve: -c {}: the model was trained for {context} tokens; using {context}",
            args.context
        );
    }
    let engine_args = EngineArgs {
        kind: EngineKind::Jit,
        threads: args.threads,
        dtype: args.dtype,
        in_place: args.in_place,
        flags: args.flags,
    };
    let embedding_width = src.config.hidden;
    let (assistant, speculation) = drafting(&src, args.draft.as_deref(), args.speculation)?;
    let drafts_note = assistant.as_ref().map_or(String::new(), |a| {
        format!(", drafts from {}", a.path.display())
    });
    let plan = FastEngine::plan_drafting(
        Arc::new(src),
        assistant.map(|a| DraftSource::File(Arc::new(a))),
        &engine_args.options(context)?,
    )?;
    super::print_notes("pulsar serve", &plan);
    // The engine is built on the engine thread, where it then runs.
    let engine = move || -> Result<FastEngine> {
        let (engine, report) = super::open_fast_engine(plan, "pulsar serve")?;
        eprintln!(
            "pulsar serve: loaded the model in {:.2} s ({}, {} threads{}{drafts_note})",
            started.elapsed().as_secs_f64(),
            engine.formats().describe(),
            engine.threads(),
            report.loaded_note(),
        );
        Ok(engine)
    };
    let compiler = indexing
        .join()
        .map_err(|_| anyhow::anyhow!("indexing the vocabulary for response_format failed"))??;
    let ctx = ServeContext {
        tok,
        template: choice.template,
        jinja: choice.jinja,
        compiler,
        context,
        model_id: model_id(&args.model),
        embedding_width,
        defaults: args.defaults,
        chat_stop_ids,
        completion_stop_ids: end_ids,
        max_waiting: args.queue,
    };
    eprintln!(
        "pulsar serve: {}, {} slots of {context} tokens",
        args.model.display(),
        args.parallel
    );
    serve::run(
        engine,
        ctx,
        ServeOptions {
            host: args.host,
            port: args.port,
            slots: args.parallel,
            queue: args.queue,
            api_key: args.api_key.filter(|k| !k.is_empty()),
            max_body: args.max_body,
            prefill_chunk: args.prefill_chunk.max(1),
            stall_timeout: args.stall_timeout,
            grace: args.grace,
            limits: args.limits,
            read_timeout: args.read_timeout,
            quiet: args.quiet,
            speculation: effective_speculation(speculation)?,
        },
    )
}

/// The default bulk prompt chunk per step: smaller than the CLI's prefill
/// chunk (126), so that a step carrying one stays short for the streams
/// decoding beside it, yet long enough that prefill keeps most of its
/// GEMM speed.
pub const DEFAULT_SERVE_PREFILL_CHUNK: usize = 64;
