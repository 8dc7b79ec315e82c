//! `pulsar embed`: a text's embedding (as `/v1/embeddings` computes it),
//! printed as a JSON list of floats.

use super::run::load_tokenizer;
use super::{EngineArgs, open_engine};
use crate::embedding::embed;
use crate::model::source::ModelSource;
use anyhow::{Context, Result, bail};
use std::io::Write;
use std::path::Path;

pub struct EmbedArgs<'a> {
    pub model: &'a Path,
    pub prompt: Option<&'a str>,
    /// A file whose text is embedded instead of `prompt`.
    pub file: Option<&'a Path>,
    /// The engine, its threads and formats, and the shared flags.
    pub engine: EngineArgs,
}

pub fn run(args: &EmbedArgs<'_>) -> Result<()> {
    let text = match (args.prompt, args.file) {
        (Some(text), None) => text.to_string(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?,
        _ => bail!("give the text with -p TEXT or -f FILE"),
    };
    if text.is_empty() {
        bail!("the text is empty: nothing to embed");
    }
    let src = ModelSource::open(args.model)?;
    let tokens = load_tokenizer(&src)?.encode(&text, true);
    let context = src.config.max_context;
    if tokens.len() > context {
        bail!(
            "the text has {} tokens but the model's context holds {context}: shorten it",
            tokens.len()
        );
    }
    let mut engine = open_engine(src, &args.engine, tokens.len())?.engine;
    let vector = embed(engine.as_mut(), &tokens)?;
    eprintln!(
        "embed: {} tokens, {} values (mean of the final hidden states, length 1)",
        tokens.len(),
        vector.len()
    );
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, &vector)?;
    writeln!(out)?;
    Ok(())
}
