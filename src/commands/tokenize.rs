//! `pulsar tokenize`: the ids of a text, space-separated on one line.
//!
//! Only the tokenizer is read: not the model's config, not its tensors. So a
//! vocabulary-only GGUF (llama.cpp's `ggml-vocab-*.gguf`, which
//! `llama-tokenize` takes) works, and so does a model whose architecture
//! this build cannot run yet.

use crate::model::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use anyhow::Result;
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
    if crate::model::source::is_model_folder(path)? {
        Tokenizer::from_hf_folder(path)
    } else {
        Tokenizer::from_gguf(&GgufFile::open(path)?)
    }
}
