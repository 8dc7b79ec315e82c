//! `pulsar logits`: raw logits of a token sequence, for comparing engines.

use crate::engine::reference::ReferenceEngine;
use crate::engine::{Engine, LogitsWanted};
use crate::model::source::ModelSource;
use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

pub struct LogitsArgs<'a> {
    pub model: &'a Path,
    pub tokens: &'a [u32],
    pub all: bool,
    pub output: &'a Path,
}

pub fn run(args: &LogitsArgs<'_>) -> Result<()> {
    if args.tokens.is_empty() {
        anyhow::bail!("--tokens is empty: give at least one token id");
    }
    let src = ModelSource::open(args.model)?;
    let mut engine = ReferenceEngine::load(&src)?;
    let wanted = if args.all {
        LogitsWanted::All
    } else {
        LogitsWanted::Last
    };
    let logits = engine.forward(args.tokens, wanted)?;
    let vocab = src.config.vocab_size;
    let mut bytes = Vec::with_capacity(logits.len() * 4);
    for v in &logits {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let mut file = std::fs::File::create(args.output)
        .with_context(|| format!("{}: cannot create", args.output.display()))?;
    file.write_all(&bytes)
        .with_context(|| format!("{}: cannot write", args.output.display()))?;
    if args.all {
        eprintln!(
            "logits: f32 [{}, {vocab}] -> {}",
            args.tokens.len(),
            args.output.display()
        );
    } else {
        eprintln!("logits: f32 [{vocab}] -> {}", args.output.display());
    }
    Ok(())
}
