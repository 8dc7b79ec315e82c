//! `pulsar perplexity`: llama-perplexity's measurement of a text, and the
//! KL divergence from a base run saved with `--save-logits`.

use super::run::{load_tokenizer, read_text_file};
use super::{EngineArgs, open_engine};
use crate::model::source::ModelSource;
use crate::perplexity::base_file::{
    BaseHeader, BaseLogits, BasePosition, BaseWriter, DEFAULT_TOP_K, mismatch,
};
use crate::perplexity::kl::KlStats;
use crate::perplexity::measure::measure;
use crate::perplexity::windows::WindowPlan;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

pub struct PerplexityArgs {
    pub model: PathBuf,
    /// The text to score (`-f`).
    pub file: PathBuf,
    /// Tokens per window (`-c`).
    pub context: usize,
    /// At most this many windows (`--chunks`); with `--kl-base`, the base's.
    pub chunks: Option<usize>,
    pub save_logits: Option<PathBuf>,
    pub kl_base: Option<PathBuf>,
    /// The engine, its threads and formats, and the shared flags.
    pub engine: EngineArgs,
}

pub fn run(args: &PerplexityArgs) -> Result<()> {
    let text = read_text_file(&args.file)?;
    if text.trim().is_empty() {
        bail!(
            "{}: the file is empty or only white space; there is nothing to score",
            args.file.display()
        );
    }
    let load_start = Instant::now();
    let src = ModelSource::open(&args.model)?;
    let tokenizer = load_tokenizer(&src)?;
    let tokens = tokenizer.encode(&text, true);
    let max_context = src.config.max_context;
    if args.context > max_context {
        bail!(
            "-c {}: the model attends to at most {max_context} tokens; lower -c",
            args.context
        );
    }
    let base = match &args.kl_base {
        Some(path) => Some(BaseLogits::load(path)?),
        None => None,
    };
    // Without --chunks a comparison covers exactly the windows the base
    // scored, so that a base made with --chunks needs no repeating of it.
    let chunks = args.chunks.or(base
        .as_ref()
        .map(|b| b.header.tokens.len() / b.header.n_ctx.max(1)));
    let plan = WindowPlan::new(tokens.len(), args.context, chunks)
        .with_context(|| format!("{}", args.file.display()))?;
    let vocab = src.config.vocab_size;
    let header = BaseHeader {
        n_ctx: plan.n_ctx,
        vocab,
        top_k: DEFAULT_TOP_K.min(vocab),
        tokens: plan.covered(&tokens).to_vec(),
        n_positions: plan.scored_total(),
    };
    if let (Some(base), Some(path)) = (&base, &args.kl_base)
        && let Some(why) = mismatch(path, &base.header, &header)
    {
        bail!(why);
    }
    let mut writer = match &args.save_logits {
        Some(path) => Some(BaseWriter::create(path, &header)?),
        None => None,
    };
    let bos = tokenizer.bos_id();
    let opened = open_engine(src, &args.engine, plan.n_ctx)?;
    let mut engine = opened.engine;
    eprintln!(
        "pulsar: loaded {} in {:.2} s ({} engine{}); {} tokens, {} windows of {}, {} scored each",
        args.model.display(),
        load_start.elapsed().as_secs_f64(),
        args.engine.kind.name(),
        opened.note,
        tokens.len(),
        plan.windows,
        plan.n_ctx,
        plan.scored_per_window()
    );

    let run_start = Instant::now();
    let bar = progress_bar(plan.windows);
    let mut kl = KlStats::default();
    let mut scratch = Vec::new();
    let nll = measure(
        engine.as_mut(),
        &tokens,
        &plan,
        bos,
        &mut |scored| {
            if let Some(base) = &base {
                kl.add(&base.positions[scored.index], scored.log_probs);
            }
            if let Some(writer) = writer.as_mut() {
                writer.push(&BasePosition::of_row(
                    scored.log_probs,
                    scored.target,
                    header.top_k,
                    &mut scratch,
                ))?;
            }
            Ok(())
        },
        &mut |windows_done, nll| {
            bar.set_message(format!("PPL {:.4}", nll.perplexity()));
            bar.set_position(windows_done as u64);
        },
    )?;
    bar.finish_and_clear();
    let seconds = run_start.elapsed().as_secs_f64();
    eprintln!(
        "pulsar: scored {} tokens in {seconds:.1} s ({:.1} tokens/s fed)",
        nll.count(),
        (plan.windows * (plan.n_ctx - 1)) as f64 / seconds
    );
    if let (Some(writer), Some(path)) = (writer, &args.save_logits) {
        writer.finish()?;
        eprintln!(
            "pulsar: saved the top {} log-probabilities of {} positions to {}",
            header.top_k,
            header.n_positions,
            path.display()
        );
    }

    let mut out = std::io::stdout().lock();
    if let (Some(base), Some(path)) = (&base, &args.kl_base) {
        writeln!(
            out,
            "KL divergence vs {}: mean {:.6}, 99th percentile {:.6}; top-1 agreement {:.2}% ({}/{}); the base's top {} leave {:.2}% of the probability as one bucket on average",
            path.display(),
            kl.mean(),
            kl.percentile_99(),
            kl.top1_percent(),
            kl.top1_agreements(),
            kl.count(),
            base.header.top_k,
            100.0 * kl.mean_base_tail_mass()
        )?;
        writeln!(
            out,
            "ln(PPL / PPL_base) = {:+.6} (base PPL {:.4})",
            nll.perplexity().ln() - base.perplexity().ln(),
            base.perplexity()
        )?;
    }
    writeln!(out, "{}", nll.result_line()).context("cannot write to stdout")?;
    Ok(())
}

/// Windows done and the running PPL on stderr, in the chat's bar style.
fn progress_bar(windows: usize) -> ProgressBar {
    let bar = ProgressBar::new(windows as u64);
    let template = "perplexity [{bar:30}] {pos}/{len} windows, {msg}, {eta} left";
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
