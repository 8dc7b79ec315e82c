//! What each CLI subcommand does; `main.rs` only parses arguments.

pub mod logits;

use crate::model::fetch;
use anyhow::Result;
use std::path::{Path, PathBuf};

/// The model named with `-m`, else the default model.
pub fn resolve_model(arg: Option<&Path>) -> Result<PathBuf> {
    match arg {
        Some(p) => Ok(p.to_path_buf()),
        None => fetch::default_model_path(),
    }
}
