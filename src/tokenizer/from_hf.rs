//! Loading a Hugging Face tokenizer folder: `tokenizer.json` (BPE with
//! merges and byte fallback, as Gemma ships it), or failing that a
//! SentencePiece `tokenizer.model`; plus `tokenizer_config.json` for the
//! special tokens, the BOS flag and the chat template.

use super::bpe::MergeRule;
use super::markers::RENDERED_MARKERS;
use super::merge_text::TextMerges;
use super::pretokenize::Pretokenizer;
use super::vocab::{TokenKind, Vocab, parse_byte_piece};
use super::{Parts, SpecialIds, Tokenizer};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::Path;

/// What `tokenizer_config.json` (and `chat_template.jinja`) contribute.
#[derive(Default)]
struct Config {
    bos: Option<String>,
    eos: Option<String>,
    add_bos: Option<bool>,
    chat_template: Option<String>,
}

/// A special-token entry is either `"<bos>"` or `{"content": "<bos>", …}`.
fn token_name(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn read_config(dir: &Path) -> Result<Config> {
    let mut cfg = Config::default();
    let path = dir.join("tokenizer_config.json");
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        cfg.bos = v.get("bos_token").and_then(token_name);
        cfg.eos = v.get("eos_token").and_then(token_name);
        cfg.add_bos = v.get("add_bos_token").and_then(Value::as_bool);
        cfg.chat_template = match v.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // Older configs list named templates; "default" is the one to use.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        };
    }
    // Newer transformers versions save the template in its own file.
    let jinja = dir.join("chat_template.jinja");
    if cfg.chat_template.is_none() && jinja.exists() {
        cfg.chat_template = Some(
            std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read {}", jinja.display()))?,
        );
    }
    Ok(cfg)
}

/// Checks that the normalizer and pre-tokenizer write spaces as `▁` (the
/// only behaviour the encoder implements) and tells whether they also
/// prepend a `▁`. Anything else is refused rather than silently mis-encoded.
fn prepends_space(root: &Value, source: &str) -> Result<bool> {
    let mut replaces = false;
    let mut prepends = false;
    let mut stack: Vec<&Value> = vec![&root["normalizer"]];
    while let Some(n) = stack.pop() {
        match n.get("type").and_then(Value::as_str) {
            None if n.is_null() => {}
            Some("Sequence") => {
                if let Some(list) = n["normalizers"].as_array() {
                    stack.extend(list.iter());
                }
            }
            Some("Replace")
                if n["pattern"]["String"].as_str() == Some(" ")
                    && n["content"].as_str() == Some("\u{2581}") =>
            {
                replaces = true
            }
            Some("Prepend") if n["prepend"].as_str() == Some("\u{2581}") => prepends = true,
            other => bail!(
                "{source}: normalizer {} is not supported (only replacing spaces with \u{2581} \
                 and prepending \u{2581}, as Gemma does)",
                other.unwrap_or("(malformed)")
            ),
        }
    }
    let pre = &root["pre_tokenizer"];
    match pre.get("type").and_then(Value::as_str) {
        None if pre.is_null() => {}
        // Splitting on " " after spaces became ▁ finds nothing to split.
        Some("Split") if replaces && pre["pattern"]["String"].as_str() == Some(" ") => {}
        Some("Metaspace") if pre["split"].as_bool() != Some(true) => {
            replaces = true;
            let scheme = pre["prepend_scheme"].as_str().unwrap_or("always");
            prepends |= scheme != "never" && pre["add_prefix_space"].as_bool() != Some(false);
        }
        other => bail!(
            "{source}: pre_tokenizer {} is not supported (Gemma's tokenizer.json has none or a \
             no-op Split)",
            other.unwrap_or("(malformed)")
        ),
    }
    if !replaces {
        bail!(
            "{source}: the tokenizer does not write spaces as \u{2581}; not a Gemma-style tokenizer"
        );
    }
    Ok(prepends)
}

/// Merges are `"a b"` strings in older files and `["a", "b"]` pairs in newer ones.
fn merge_pair<'a>(m: &'a Value, i: usize, source: &str) -> Result<(&'a str, &'a str)> {
    let pair = match m {
        Value::String(s) => s.split_once(' '),
        Value::Array(a) if a.len() == 2 => a[0].as_str().zip(a[1].as_str()),
        _ => None,
    };
    pair.ok_or_else(|| anyhow::anyhow!("{source}: merge {i} is neither \"a b\" nor [\"a\", \"b\"]"))
}

fn from_tokenizer_json(path: &Path, cfg: Config) -> Result<Tokenizer> {
    let source = path.display().to_string();
    let text = std::fs::read(path).with_context(|| format!("cannot read {source}"))?;
    from_tokenizer_json_bytes(&text, &source, cfg)
}

impl Tokenizer {
    /// A `tokenizer.json` already in memory, with no `tokenizer_config.json`
    /// (for fuzzing; `source` names it in messages).
    pub(crate) fn from_tokenizer_json_bytes(bytes: &[u8], source: &str) -> Result<Tokenizer> {
        from_tokenizer_json_bytes(bytes, source, Config::default())
    }
}

fn from_tokenizer_json_bytes(bytes: &[u8], source: &str, cfg: Config) -> Result<Tokenizer> {
    let source = source.to_string();
    let root: Value =
        serde_json::from_slice(bytes).with_context(|| format!("{source} is not valid JSON"))?;
    let model = &root["model"];
    match model["type"].as_str() {
        Some("BPE") => {}
        other => bail!(
            "{source}: model type {} is not supported; Gemma's tokenizer.json uses BPE",
            other.unwrap_or("(missing)")
        ),
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model[key].as_str().is_some_and(|s| !s.is_empty()) {
            bail!("{source}: BPE option model.{key} is not supported");
        }
    }
    let byte_fallback = model["byte_fallback"].as_bool().unwrap_or(false);
    let add_space_prefix = prepends_space(&root, &source)?;

    // Collect (id, piece) from the vocabulary and the added tokens; ids must
    // cover 0..n without gaps.
    let vocab_map = model["vocab"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("{source}: model.vocab is missing or not an object"))?;
    let mut slots: Vec<Option<(String, TokenKind)>> = Vec::new();
    // Dense ids can only run up to the number of entries listed, so a
    // larger id is refused before the table is grown to it: otherwise one
    // entry with id 15,999,999 would allocate half a gigabyte.
    let listed = vocab_map.len() + root["added_tokens"].as_array().map_or(0, Vec::len);
    let mut place = |id: u64, piece: &str, kind: TokenKind| -> Result<()> {
        let id = usize::try_from(id)?;
        if id > 16_000_000 {
            bail!("{source}: token id {id} is implausibly large");
        }
        if id >= listed {
            bail!(
                "{source}: token {piece:?} has id {id}, but the file lists only {listed} tokens \
                 (ids must run from 0 without gaps)"
            );
        }
        if slots.len() <= id {
            slots.resize(id + 1, None);
        }
        slots[id] = Some((piece.to_owned(), kind));
        Ok(())
    };
    for (piece, id) in vocab_map {
        let id = id
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("{source}: vocab entry {piece:?} has no integer id"))?;
        let kind = if byte_fallback && parse_byte_piece(piece).is_some() {
            TokenKind::Byte
        } else {
            TokenKind::Normal
        };
        place(id, piece, kind)?;
    }
    for t in root["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
            bail!("{source}: an added_tokens entry lacks id or content: {t}");
        };
        let kind = if RENDERED_MARKERS.contains(&content) {
            TokenKind::UserDefined
        } else if t["special"].as_bool().unwrap_or(false) {
            TokenKind::Control
        } else {
            TokenKind::UserDefined
        };
        place(id, content, kind)?;
    }
    let mut pieces = Vec::with_capacity(slots.len());
    let mut kinds = Vec::with_capacity(slots.len());
    for (id, slot) in slots.into_iter().enumerate() {
        let (p, k) = slot.ok_or_else(|| anyhow::anyhow!("{source}: no token has id {id}"))?;
        pieces.push(p);
        kinds.push(k);
    }

    let scores = vec![0.0; pieces.len()];
    let vocab = Vocab::new(&pieces, scores, kinds, &source)?;
    drop(pieces);
    // Kept as text like Gemma 4's GGUF merges (see `merge_text`): resolving
    // half a million merges to ids at load is most of the load time.
    let merges = model["merges"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let merges = TextMerges::from_pairs(
        merges
            .iter()
            .enumerate()
            .map(|(i, m)| merge_pair(m, i, &source)),
        &format!("{source}: model.merges"),
    )?;

    let find = |name: &Option<String>, fallbacks: &[&str], what: &str| -> Result<u32> {
        let names = name
            .iter()
            .map(String::as_str)
            .chain(fallbacks.iter().copied());
        for n in names {
            if let Some(id) = vocab.id_of(n) {
                return Ok(id);
            }
        }
        bail!("{source}: cannot tell the {what} token: set {what}_token in tokenizer_config.json")
    };
    let ids = SpecialIds {
        bos: find(&cfg.bos, &["<bos>", "<s>"], "bos")?,
        eos: find(&cfg.eos, &["<eos>", "</s>"], "eos")?,
        unk: model["unk_token"].as_str().and_then(|u| vocab.id_of(u)),
        pad: vocab.id_of("<pad>"),
    };
    Tokenizer::assemble(Parts {
        vocab,
        rule: MergeRule::Ranks(merges),
        // Hugging Face merges each stretch whole (no pre-tokenizer, or a
        // split on " " that finds none once spaces are `▁`).
        pretokenizer: Pretokenizer::Whole,
        ids,
        add_bos: cfg.add_bos.unwrap_or(true),
        add_space_prefix,
        chat_template: cfg.chat_template,
        source,
    })
}

impl Tokenizer {
    /// Loads a Hugging Face model folder's tokenizer: `tokenizer.json` when
    /// present, else the SentencePiece `tokenizer.model`.
    pub fn from_hf_folder(dir: &Path) -> Result<Tokenizer> {
        let cfg = read_config(dir)?;
        let json = dir.join("tokenizer.json");
        if json.exists() {
            return from_tokenizer_json(&json, cfg);
        }
        let spm = dir.join("tokenizer.model");
        if spm.exists() {
            let bytes =
                std::fs::read(&spm).with_context(|| format!("cannot read {}", spm.display()))?;
            let mut tok = Tokenizer::from_sentencepiece_bytes(
                &bytes,
                &spm.display().to_string(),
                cfg.chat_template,
            )?;
            if let Some(b) = cfg.add_bos {
                tok.add_bos = b;
            }
            return Ok(tok);
        }
        bail!(
            "{}: no tokenizer.json or tokenizer.model found; copy the tokenizer files of the model \
             into this folder",
            dir.display()
        )
    }
}
