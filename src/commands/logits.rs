//! `pulsar logits`: raw logits of a token sequence, for comparing engines.

use super::run::load_tokenizer;
use super::{EngineArgs, open_engine};
use crate::engine::LogitsWanted;
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
    /// The engine, its threads and formats, and the shared flags.
    pub engine: EngineArgs,
}

pub fn run(args: &LogitsArgs<'_>) -> Result<()> {
    let src = ModelSource::open(args.model)?;
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
    let mut engine = open_engine(src, &args.engine, tokens.len())?.engine;
    let wanted = if args.all {
        LogitsWanted::All
    } else {
        LogitsWanted::Last
    };
    let logits = engine.forward(&tokens, wanted)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_atomic(args.output, &bytes)?;
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
