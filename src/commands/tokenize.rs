//! `pulsar tokenize`: the ids of a text, space-separated on one line.

use super::run::load_tokenizer;
use crate::model::source::ModelSource;
use anyhow::Result;
use std::path::Path;

pub fn run(model: &Path, text: &str, bos: bool) -> Result<()> {
    let src = ModelSource::open(model)?;
    let tok = load_tokenizer(&src)?;
    let ids = tok.encode(text, bos);
    let line: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    println!("{}", line.join(" "));
    Ok(())
}
