//! Loading the tokenizer from a GGUF file's `tokenizer.*` metadata.

use super::bpe::MergeRule;
use super::vocab::TokenKind;
use super::{Parts, SpecialIds, Tokenizer};
use crate::model::gguf::{GgufFile, Value};
use anyhow::{Result, bail};

const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TYPES: &str = "tokenizer.ggml.token_type";

impl Tokenizer {
    /// Reads a SentencePiece-style ("llama" model) tokenizer from GGUF metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let source = file.path().display().to_string();
        let model = file.get_str("tokenizer.ggml.model")?.unwrap_or("llama");
        if model != "llama" {
            bail!(
                "{source}: tokenizer.ggml.model is {model:?}; only SentencePiece-style \"llama\" \
                 tokenizers (Gemma's) are supported"
            );
        }
        let missing = |key: &str| {
            anyhow::anyhow!(
                "{source}: metadata key {key:?} is missing; the file has no usable tokenizer"
            )
        };
        let pieces: Vec<&str> = file.get_str_array(TOKENS)?.ok_or_else(|| missing(TOKENS))?;
        let scores: Vec<f32> = file
            .get_num_array(SCORES)?
            .ok_or_else(|| missing(SCORES))?
            .into_iter()
            .map(|s| s as f32)
            .collect();
        let kinds = file
            .get_num_array(TYPES)?
            .ok_or_else(|| missing(TYPES))?
            .into_iter()
            .enumerate()
            .map(|(id, code)| {
                TokenKind::from_code(code as i64).ok_or_else(|| {
                    anyhow::anyhow!(
                        "{source}: {TYPES}[{id}] = {code} is not a known token type (1..=6)"
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;

        let id_key = |key: &str| -> Result<Option<u32>> {
            match file.get_usize(key)? {
                None => Ok(None),
                Some(v) => u32::try_from(v)
                    .map(Some)
                    .map_err(|_| anyhow::anyhow!("{source}: {key} = {v} is not a token id")),
            }
        };
        let find = |names: &[&str]| {
            names
                .iter()
                .find_map(|n| pieces.iter().position(|p| p == n))
        };
        let bos = match id_key("tokenizer.ggml.bos_token_id")? {
            Some(id) => id,
            None => find(&["<bos>", "<s>"]).ok_or_else(|| missing("tokenizer.ggml.bos_token_id"))?
                as u32,
        };
        let eos = match id_key("tokenizer.ggml.eos_token_id")? {
            Some(id) => id,
            None => find(&["<eos>", "</s>"])
                .ok_or_else(|| missing("tokenizer.ggml.eos_token_id"))? as u32,
        };
        let ids = SpecialIds {
            bos,
            eos,
            unk: id_key("tokenizer.ggml.unknown_token_id")?,
            pad: id_key("tokenizer.ggml.padding_token_id")?,
        };

        let flag = |key: &str, default: bool| -> Result<bool> {
            match file.get(key) {
                None => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => match v.as_u64() {
                    Some(n) => Ok(n != 0),
                    None => bail!("{source}: {key} should be a boolean, found {}", v.brief()),
                },
            }
        };
        // llama.cpp adds BOS for SentencePiece vocabularies that do not say otherwise.
        let add_bos = flag("tokenizer.ggml.add_bos_token", true)?;
        // SentencePiece's default is a dummy prefix; Gemma's files turn it off.
        let add_space_prefix = flag("tokenizer.ggml.add_space_prefix", true)?;
        let chat_template = file.get_str("tokenizer.chat_template")?.map(str::to_owned);

        Tokenizer::assemble(Parts {
            pieces,
            scores,
            kinds,
            rule: MergeRule::Scores,
            ids,
            add_bos,
            add_space_prefix,
            chat_template,
            source,
        })
    }
}
