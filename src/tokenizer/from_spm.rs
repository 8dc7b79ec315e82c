//! Loading a SentencePiece `tokenizer.model` (a serialized `ModelProto`).
//!
//! Field numbers used (from sentencepiece_model.proto):
//! - ModelProto: 1 repeated SentencePiece, 2 TrainerSpec, 3 NormalizerSpec.
//! - SentencePiece: 1 piece, 2 score (float), 3 type (1 normal … 6 byte).
//! - TrainerSpec: 3 model_type (1 unigram, 2 BPE), 40 unk_id, 41 bos_id,
//!   42 eos_id, 43 pad_id.
//! - NormalizerSpec: 1 name, 2 precompiled_charsmap, 3 add_dummy_prefix,
//!   4 remove_extra_whitespaces.

use super::bpe::MergeRule;
use super::pretokenize::Pretokenizer;
use super::protobuf::{Field, Reader};
use super::vocab::TokenKind;
use super::vocab::Vocab;
use super::{Parts, SpecialIds, Tokenizer};
use anyhow::{Context, Result, bail};
use std::path::Path;

struct Trainer {
    model_type: i32,
    unk: i32,
    bos: i32,
    eos: i32,
    pad: i32,
}

struct Normalizer {
    name: String,
    has_charsmap: bool,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
}

fn parse_piece(bytes: &[u8], index: usize, source: &str) -> Result<(String, f32, TokenKind)> {
    let mut piece = None;
    let mut score = 0.0;
    let mut kind = TokenKind::Normal;
    let mut r = Reader::new(bytes);
    while let Some((n, f)) = r.next_field()? {
        match (n, f) {
            (1, Field::Bytes(b)) => {
                piece = Some(
                    String::from_utf8(b.to_vec())
                        .with_context(|| format!("{source}: piece {index} is not valid UTF-8"))?,
                )
            }
            (2, f) => score = f.as_f32().unwrap_or(0.0),
            (3, f) => {
                let code = f.as_i32().unwrap_or(1);
                kind = TokenKind::from_code(code.into()).ok_or_else(|| {
                    anyhow::anyhow!("{source}: piece {index} has unknown type {code}")
                })?;
            }
            _ => {}
        }
    }
    let piece = piece.ok_or_else(|| anyhow::anyhow!("{source}: piece {index} has no text"))?;
    Ok((piece, score, kind))
}

fn parse_trainer(bytes: &[u8]) -> Result<Trainer> {
    // Defaults as declared in the .proto.
    let mut t = Trainer {
        model_type: 1,
        unk: 0,
        bos: 1,
        eos: 2,
        pad: -1,
    };
    let mut r = Reader::new(bytes);
    while let Some((n, f)) = r.next_field()? {
        let Some(v) = f.as_i32() else { continue };
        match n {
            3 => t.model_type = v,
            40 => t.unk = v,
            41 => t.bos = v,
            42 => t.eos = v,
            43 => t.pad = v,
            _ => {}
        }
    }
    Ok(t)
}

fn parse_normalizer(bytes: &[u8]) -> Result<Normalizer> {
    let mut s = Normalizer {
        name: String::new(),
        has_charsmap: false,
        add_dummy_prefix: true,
        remove_extra_whitespaces: true,
    };
    let mut r = Reader::new(bytes);
    while let Some((n, f)) = r.next_field()? {
        match (n, f) {
            (1, Field::Bytes(b)) => s.name = String::from_utf8_lossy(b).into_owned(),
            (2, Field::Bytes(b)) => s.has_charsmap = !b.is_empty(),
            (3, f) => s.add_dummy_prefix = f.as_i32().unwrap_or(1) != 0,
            (4, f) => s.remove_extra_whitespaces = f.as_i32().unwrap_or(1) != 0,
            _ => {}
        }
    }
    Ok(s)
}

impl Tokenizer {
    /// Reads a SentencePiece BPE model file (`tokenizer.model`).
    pub fn from_sentencepiece_model(path: &Path) -> Result<Tokenizer> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read SentencePiece model {}", path.display()))?;
        Tokenizer::from_sentencepiece_bytes(&bytes, &path.display().to_string(), None)
    }

    pub(crate) fn from_sentencepiece_bytes(
        bytes: &[u8],
        source: &str,
        chat_template: Option<String>,
    ) -> Result<Tokenizer> {
        let (mut pieces, mut scores, mut kinds) = (Vec::new(), Vec::new(), Vec::new());
        let mut trainer = None;
        let mut normalizer = None;
        let mut r = Reader::new(bytes);
        while let Some((n, f)) = r
            .next_field()
            .with_context(|| format!("{source}: not a SentencePiece model (bad protobuf)"))?
        {
            match (n, f) {
                (1, Field::Bytes(b)) => {
                    let (p, s, k) = parse_piece(b, pieces.len(), source)?;
                    pieces.push(p);
                    scores.push(s);
                    kinds.push(k);
                }
                (2, Field::Bytes(b)) => trainer = Some(parse_trainer(b)?),
                (3, Field::Bytes(b)) => normalizer = Some(parse_normalizer(b)?),
                _ => {}
            }
        }
        let trainer = trainer
            .ok_or_else(|| anyhow::anyhow!("{source}: SentencePiece model has no trainer_spec"))?;
        match trainer.model_type {
            2 => {}
            1 => bail!(
                "{source}: this is a SentencePiece unigram model; only BPE models (Gemma's) are \
                 supported — use the model's tokenizer.json or GGUF instead"
            ),
            t => bail!("{source}: unsupported SentencePiece model_type {t} (only 2 = BPE)"),
        }
        let normalizer = normalizer.unwrap_or(Normalizer {
            name: "identity".into(),
            has_charsmap: false,
            add_dummy_prefix: true,
            remove_extra_whitespaces: false,
        });
        // Gemma's models do no Unicode normalization; silently skipping a
        // normalizer that a model relies on would give wrong ids.
        if normalizer.has_charsmap && normalizer.name != "identity" {
            bail!(
                "{source}: normalizer {:?} (Unicode normalization) is not supported; only \
                 \"identity\" models such as Gemma's are",
                normalizer.name
            );
        }
        if normalizer.remove_extra_whitespaces {
            bail!(
                "{source}: remove_extra_whitespaces is set; whitespace collapsing is not supported"
            );
        }
        let id = |what: &str, v: i32| -> Result<Option<u32>> {
            if v < 0 {
                return Ok(None);
            }
            if v as usize >= pieces.len() {
                bail!(
                    "{source}: {what}_id {v} is outside the {} pieces",
                    pieces.len()
                );
            }
            Ok(Some(v as u32))
        };
        let bos = id("bos", trainer.bos)?.ok_or_else(|| {
            anyhow::anyhow!("{source}: the model defines no BOS token (bos_id = -1)")
        })?;
        let eos = id("eos", trainer.eos)?.ok_or_else(|| {
            anyhow::anyhow!("{source}: the model defines no EOS token (eos_id = -1)")
        })?;
        let ids = SpecialIds {
            bos,
            eos,
            unk: id("unk", trainer.unk)?,
            pad: id("pad", trainer.pad)?,
        };
        Tokenizer::assemble(Parts {
            vocab: Vocab::new(&pieces, scores, kinds, source)?,
            rule: MergeRule::Scores,
            pretokenizer: Pretokenizer::Whole,
            ids,
            add_bos: true,
            add_space_prefix: normalizer.add_dummy_prefix,
            chat_template,
            source: source.to_owned(),
        })
    }
}
