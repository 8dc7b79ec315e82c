//! Loading the tokenizer from a GGUF file's `tokenizer.*` metadata.
//!
//! Two kinds: `tokenizer.ggml.model = "llama"` (Gemma 1–3: SentencePiece
//! BPE, merges by piece score) and `"gemma4"` (Gemma 4: BPE by the rank of
//! `tokenizer.ggml.merges`, cut at newline runs first, as llama.cpp does).

use super::bpe::MergeRule;
use super::merge_text::TextMerges;
use super::pretokenize::Pretokenizer;
use super::vocab::{TokenKind, Vocab};
use super::{Parts, SpecialIds, Tokenizer};
use crate::model::gguf::{GgufFile, Value};
use anyhow::{Result, bail};

const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TYPES: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";

/// The merge list of a `gemma4` file.
fn gemma4_merges(file: &GgufFile, source: &str) -> Result<TextMerges> {
    let merges = file.get_str_array(MERGES)?.ok_or_else(|| {
        anyhow::anyhow!(
            "{source}: metadata key {MERGES:?} is missing; a \"gemma4\" tokenizer needs its \
             merge list (reconvert the model with a current llama.cpp)"
        )
    })?;
    let what = format!("{source}: {MERGES}");
    let pairs = merges.iter().enumerate().map(|(i, m)| {
        // llama.cpp cuts at the first space after the first byte, so a
        // merge whose left side is a literal space still parses.
        let cut = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        cut.map(|at| (&m[..at], &m[at + 1..])).ok_or_else(|| {
            anyhow::anyhow!("{what}[{i}] = {m:?} is not two pieces separated by a space")
        })
    });
    TextMerges::from_pairs(pairs, &what)
}

impl Tokenizer {
    /// Reads a tokenizer from GGUF metadata: SentencePiece-style ("llama"
    /// model, Gemma 1–3) or Gemma 4's BPE ("gemma4").
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let source = file.path().display().to_string();
        let model = file.get_str("tokenizer.ggml.model")?.unwrap_or("llama");
        let gemma4 = match model {
            "llama" => false,
            "gemma4" => true,
            _ => bail!(
                "{source}: tokenizer.ggml.model is {model:?}; supported are \"llama\" \
                 (SentencePiece-style, Gemma 1-3) and \"gemma4\" (Gemma 4's BPE)"
            ),
        };
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

        let vocab = Vocab::new(&pieces, scores, kinds, &source)?;
        let (rule, pretokenizer) = if gemma4 {
            let merges = gemma4_merges(file, &source)?;
            (MergeRule::Ranks(merges), Pretokenizer::NewlineRuns)
        } else {
            (MergeRule::Scores, Pretokenizer::Whole)
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
        // llama.cpp adds BOS for SentencePiece vocabularies that do not say
        // otherwise, and always for Gemma 4 (the model needs it).
        let add_bos = flag("tokenizer.ggml.add_bos_token", true)? || gemma4;
        // SentencePiece's default is a dummy prefix; Gemma's files turn it
        // off, and llama.cpp never adds one to a BPE vocabulary.
        let add_space_prefix = !gemma4 && flag("tokenizer.ggml.add_space_prefix", true)?;
        let chat_template = file.get_str("tokenizer.chat_template")?.map(str::to_owned);

        Tokenizer::assemble(Parts {
            vocab,
            rule,
            pretokenizer,
            ids,
            add_bos,
            add_space_prefix,
            chat_template,
            source,
        })
    }
}
