//! `pulsar logits`: raw logits of a token sequence, for comparing engines;
//! with `--draft`, the logits of a Gemma 4 assistant's drafts.

use super::run::load_tokenizer;
use super::{EngineArgs, open_engine_drafting};
use crate::engine::LogitsWanted;
use crate::engine::assistant::MAX_DRAFT_TOKENS;
use crate::fs_atomic::write_atomic;
use crate::model::source::ModelSource;
use anyhow::{Result, bail};
use std::path::Path;

pub struct LogitsArgs<'a> {
    pub model: &'a Path,
    pub tokens: &'a [u32],
    /// Text to tokenize with BOS instead of `tokens`.
    pub prompt: Option<&'a str>,
    pub all: bool,
    pub output: &'a Path,
    /// `--draft`: write the drafts' logits of this assistant instead.
    pub draft: Option<&'a Path>,
    /// `--n-draft`: how many drafts.
    pub n_draft: usize,
    /// The engine, its threads and formats, and the shared flags.
    pub engine: EngineArgs,
}

pub fn run(args: &LogitsArgs<'_>) -> Result<()> {
    // The cheap checks first, before anything loads.
    if args.draft.is_some() && !(1..=MAX_DRAFT_TOKENS).contains(&args.n_draft) {
        bail!(
            "--n-draft {}: an assistant drafts 1 to {MAX_DRAFT_TOKENS} tokens per round",
            args.n_draft
        );
    }
    let src = ModelSource::open(args.model)?;
    let assistant = args.draft.map(ModelSource::open).transpose()?;
    let tokens = match args.prompt {
        Some(text) => load_tokenizer(&src)?.encode(text, true),
        None => args.tokens.to_vec(),
    };
    if tokens.is_empty() {
        bail!("no tokens: give --tokens ID,ID,… or -p TEXT");
    }
    let vocab = src.config.vocab_size;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary (size {vocab})");
    }
    if assistant.is_some() && tokens.len() < 2 {
        bail!(
            "--draft needs at least 2 token ids: the model runs all but the last, drafting starts from the last"
        );
    }
    let drafting = assistant.is_some();
    let mut engine = open_engine_drafting(src, &args.engine, tokens.len(), assistant)?.engine;
    if drafting {
        let (context, last) = tokens.split_at(tokens.len() - 1);
        engine.forward(context, LogitsWanted::Last)?;
        let mut logits = Vec::with_capacity(args.n_draft * vocab);
        let drafted = engine.draft(last[0], args.n_draft, Some(&mut logits))?;
        write_atomic(args.output, &le_bytes(&logits))?;
        let listed: Vec<String> = drafted.iter().map(u32::to_string).collect();
        eprintln!(
            "draft logits: f32 [{}, {vocab}] -> {} (drafted {})",
            args.n_draft,
            args.output.display(),
            listed.join(",")
        );
        return Ok(());
    }
    let wanted = if args.all {
        LogitsWanted::All
    } else {
        LogitsWanted::Last
    };
    let logits = engine.forward(&tokens, wanted)?;
    write_atomic(args.output, &le_bytes(&logits))?;
    if args.all {
        eprintln!(
            "logits: f32 [{}, {vocab}] -> {}",
            tokens.len(),
            args.output.display()
        );
    } else {
        eprintln!("logits: f32 [{vocab}] -> {}", args.output.display());
    }
    Ok(())
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
