//! `pulsar tokenize`: the ids of a text, space-separated on one line.
//!
//! Only the tokenizer is read: not the model's config, not its tensors. So a
//! vocabulary-only GGUF (llama.cpp's `ggml-vocab-*.gguf`, which
//! `llama-tokenize` takes) works, and so does a model whose architecture
//! this build cannot run yet.

use crate::model::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use std::path::Path;

pub fn run(model: &Path, text: &str, bos: bool) -> Result<()> {
    let tok = open_tokenizer(model)?;
    let ids = tok.encode(text, bos);
    let line: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    println!("{}", line.join(" "));
    Ok(())
}

/// The tokenizer of a GGUF file or of a Hugging Face folder, alone.
fn open_tokenizer(path: &Path) -> Result<Tokenizer> {
    let meta = std::fs::metadata(path).with_context(|| {
        format!(
            "{}: cannot read the model path (pass a .gguf file or a Hugging Face folder with -m)",
            path.display()
        )
    })?;
    if meta.is_dir() {
        Tokenizer::from_hf_folder(path)
    } else {
        Tokenizer::from_gguf(&GgufFile::open(path)?)
    }
}
