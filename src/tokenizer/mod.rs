//! Gemma's tokenizer: BPE on text with spaces written as `▁`, with byte
//! fallback. Gemma 1–3 merge by SentencePiece piece scores, Gemma 4 (and
//! every Hugging Face `tokenizer.json`) by the rank of a merge list.
//!
//! Encoding first cuts verbatim pieces out of the text (control tokens such
//! as `<start_of_turn>`, and user-defined pieces such as `\n`, runs of spaces
//! or `<b>`), then writes spaces as `▁`, cuts each remaining stretch into
//! words when the tokenizer asks for it (Gemma 4's GGUF: at newline runs)
//! and merges each word into vocabulary pieces, falling back to `<0xNN>` byte
//! tokens for characters without a piece. No Unicode normalization is applied.
//!
//! Loaders: [`Tokenizer::from_gguf`] (GGUF metadata), [`Tokenizer::from_hf_folder`]
//! (`tokenizer.json`, or a SentencePiece `tokenizer.model`).

mod bpe;
mod decode;
mod from_gguf;
mod from_hf;
mod from_spm;
mod markers;
mod merge_text;
mod piece_table;
mod pretokenize;
mod protobuf;
mod specials;
mod vocab;

pub use decode::StreamDecoder;
pub use vocab::{SPACE_MARK, TokenKind, parse_byte_piece};

use bpe::MergeRule;
use pretokenize::Pretokenizer;
use specials::{Segment, SpecialMatcher};
use vocab::Vocab;

/// Ids of the special tokens a tokenizer file names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: u32,
    pub eos: u32,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

/// A loaded tokenizer. Cheap to share by reference; encoding and decoding
/// take `&self`.
pub struct Tokenizer {
    vocab: Vocab,
    rule: MergeRule,
    pretokenizer: Pretokenizer,
    specials: SpecialMatcher,
    ids: SpecialIds,
    add_bos: bool,
    add_space_prefix: bool,
    chat_template: Option<String>,
}

/// Everything a loader gathers; [`Tokenizer::assemble`] checks and indexes it.
pub(crate) struct Parts {
    /// Built by the loader, which may need its index (Gemma 4's merges do).
    pub vocab: Vocab,
    pub rule: MergeRule,
    pub pretokenizer: Pretokenizer,
    pub ids: SpecialIds,
    pub add_bos: bool,
    pub add_space_prefix: bool,
    pub chat_template: Option<String>,
    /// Names the file in error messages.
    pub source: String,
}

impl Tokenizer {
    pub(crate) fn assemble(parts: Parts) -> anyhow::Result<Tokenizer> {
        let mut vocab = parts.vocab;
        for text in markers::END_OF_GENERATION {
            if let Some(id) = vocab.id_of(text) {
                vocab.set_kind(id, TokenKind::Control);
            }
        }
        let n = vocab.len();
        let check = |what: &str, id: u32| {
            if (id as usize) < n {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{}: {what} token id {id} is outside the vocabulary of {n} entries",
                    parts.source
                ))
            }
        };
        check("BOS", parts.ids.bos)?;
        check("EOS", parts.ids.eos)?;
        if let Some(id) = parts.ids.unk {
            check("unknown", id)?;
        }
        if let Some(id) = parts.ids.pad {
            check("padding", id)?;
        }
        let mut specials = SpecialMatcher::new();
        for (id, text, is_control) in vocab.verbatim_entries() {
            specials.insert(text, id, is_control);
            // Matching happens on raw text, where a user-defined piece stored
            // with `▁` (SentencePiece files) appears with real spaces.
            if text.contains(SPACE_MARK) {
                specials.insert(&text.replace(SPACE_MARK, " "), id, is_control);
            }
        }
        Ok(Tokenizer {
            vocab,
            rule: parts.rule,
            pretokenizer: parts.pretokenizer,
            specials,
            ids: parts.ids,
            add_bos: parts.add_bos,
            add_space_prefix: parts.add_space_prefix,
            chat_template: parts.chat_template,
        })
    }

    /// Encodes `text`, optionally starting with BOS. Control tokens written
    /// in the text (`<start_of_turn>`, `<bos>`…) become their single ids; use
    /// [`Tokenizer::encode_untrusted`] for text that must not be able to
    /// inject them.
    pub fn encode(&self, text: &str, add_bos: bool) -> Vec<u32> {
        self.encode_inner(text, add_bos, true)
    }

    /// Like [`Tokenizer::encode`], but control-token text is spelled out as
    /// ordinary characters (user-defined pieces such as `\n` still apply).
    pub fn encode_untrusted(&self, text: &str, add_bos: bool) -> Vec<u32> {
        self.encode_inner(text, add_bos, false)
    }

    /// Encodes text assembled from parts, as [`Tokenizer::encode`] encodes
    /// their concatenation, except that control-token text is honoured only
    /// inside parts marked trusted (`true`): a chat template's own pieces
    /// are trusted, a client's message is not. Merging runs across the
    /// parts, so a prompt assembled this way gets the same ids as the whole
    /// text given to [`Tokenizer::encode`] when the untrusted parts hold no
    /// control-token text.
    pub fn encode_parts(&self, parts: &[(&str, bool)], add_bos: bool) -> Vec<u32> {
        let text: String = parts.iter().map(|(t, _)| *t).collect();
        // Each trusted part's byte range in `text`.
        let mut trusted = Vec::new();
        let mut at = 0;
        for (part, is_trusted) in parts {
            if *is_trusted {
                trusted.push(at..at + part.len());
            }
            at += part.len();
        }
        let until = |i: usize| trusted.iter().find(|r| r.contains(&i)).map_or(i, |r| r.end);
        let segments = self.specials.split_trusted(&text, until);
        self.encode_segments(segments, !text.is_empty(), add_bos, text.len())
    }

    fn encode_inner(&self, text: &str, add_bos: bool, with_control: bool) -> Vec<u32> {
        let segments = self.specials.split(text, with_control);
        self.encode_segments(segments, !text.is_empty(), add_bos, text.len())
    }

    fn encode_segments(
        &self,
        segments: Vec<Segment>,
        non_empty: bool,
        add_bos: bool,
        text_len: usize,
    ) -> Vec<u32> {
        let mut out = Vec::with_capacity(text_len / 3 + 2);
        if add_bos {
            out.push(self.ids.bos);
        }
        let mut normalized = String::new();
        // SentencePiece's dummy prefix: one `▁` before the whole text, which
        // stands alone when the text opens with a verbatim piece.
        let mut prefix = self.add_space_prefix && non_empty;
        for seg in segments {
            if prefix {
                normalized.push(SPACE_MARK);
                prefix = false;
                if let Segment::Token(_) = seg {
                    self.merge_into(&mut normalized, &mut out);
                }
            }
            match seg {
                Segment::Token(id) => out.push(id),
                Segment::Text(t) => {
                    for ch in t.chars() {
                        normalized.push(if ch == ' ' { SPACE_MARK } else { ch });
                    }
                    self.merge_into(&mut normalized, &mut out);
                }
            }
        }
        out
    }

    /// Merges normalized text into ids and empties the buffer.
    fn merge_into(&self, normalized: &mut String, out: &mut Vec<u32>) {
        match self.pretokenizer {
            Pretokenizer::Whole => self.merge_word(normalized, out),
            Pretokenizer::NewlineRuns => {
                for word in pretokenize::newline_runs(normalized) {
                    // llama.cpp takes a newline run that is an entry as is,
                    // whatever the merges would make of it.
                    match self.vocab.id_of(word.text).filter(|_| word.newlines) {
                        Some(id) => out.push(id),
                        None => self.merge_word(word.text, out),
                    }
                }
            }
        }
        normalized.clear();
    }

    fn merge_word(&self, word: &str, out: &mut Vec<u32>) {
        bpe::encode_segment(&self.vocab, &self.rule, self.ids.unk, word, out);
    }

    /// Decodes ids to text. Control tokens (BOS, `<end_of_turn>`…) produce no
    /// text; see [`Tokenizer::decode_with_control`].
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_all(ids, false)
    }

    /// Decodes ids to text, writing control tokens as their text
    /// (`<start_of_turn>`), so that decoding what [`Tokenizer::encode`] made
    /// gives the text back (unless it contained a literal `▁`, which decodes
    /// as a space).
    pub fn decode_with_control(&self, ids: &[u32]) -> String {
        self.decode_all(ids, true)
    }

    fn decode_all(&self, ids: &[u32], show_control: bool) -> String {
        let mut d = StreamDecoder::new(self, show_control, true);
        let mut out = String::new();
        for &id in ids {
            out.push_str(&d.push(id));
        }
        out.push_str(&d.finish());
        out
    }

    /// A decoder for generated ids, one at a time; control tokens produce no
    /// text and a leading space is kept (the ids continue a prompt).
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self, false, false)
    }

    /// The bytes an id adds to a text in mid-stream: its piece with `▁` as a
    /// space, a byte token's one byte (possibly part of a character), a
    /// control token's own text (`<start_of_turn>`). None outside the
    /// vocabulary.
    pub fn piece_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let (kind, piece) = (self.vocab.kind(id)?, self.vocab.piece(id)?);
        Some(match kind {
            TokenKind::Byte => parse_byte_piece(piece).into_iter().collect(),
            TokenKind::Normal | TokenKind::UserDefined => {
                piece.replace(SPACE_MARK, " ").into_bytes()
            }
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => {
                piece.as_bytes().to_vec()
            }
        })
    }

    /// The raw piece of an id as stored in the vocabulary (`▁the`, `<0x0A>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.piece(id)
    }

    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.vocab.kind(id)
    }

    /// The id whose piece is exactly `piece` (written with `▁` for spaces).
    pub fn id_of(&self, piece: &str) -> Option<u32> {
        self.vocab.id_of(piece)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos_id(&self) -> u32 {
        self.ids.bos
    }

    pub fn eos_id(&self) -> u32 {
        self.ids.eos
    }

    pub fn special_ids(&self) -> SpecialIds {
        self.ids
    }

    /// Ids that end generation: EOS, and `<end_of_turn>` (Gemma 1–3),
    /// `<turn|>` and `<|tool_response>` (Gemma 4) where the vocabulary has
    /// them, as in llama.cpp. Sorted, without repeats.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = markers::END_OF_GENERATION
            .iter()
            .filter_map(|text| self.vocab.id_of(text))
            .chain([self.ids.eos])
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Whether the model file asks for BOS at the start of a prompt.
    pub fn add_bos_by_default(&self) -> bool {
        self.add_bos
    }

    /// The Jinja chat template shipped with the model, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }
}

#[cfg(test)]
impl Tokenizer {
    /// A tokenizer over the given pieces, for unit tests elsewhere in the
    /// crate: SentencePiece merge rule, `<bos>` and `<eos>` looked up by text
    /// (each must be among the pieces).
    pub(crate) fn for_tests(pieces: &[(&str, TokenKind)]) -> Tokenizer {
        let id = |text: &str| {
            let at = pieces.iter().position(|(p, _)| *p == text);
            at.expect("test vocabulary needs <bos> and <eos>") as u32
        };
        let vocab = Vocab::new(
            &pieces.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            vec![0.0; pieces.len()],
            pieces.iter().map(|(_, k)| *k).collect(),
            "test vocabulary",
        )
        .expect("test vocabulary is well formed");
        Tokenizer::assemble(Parts {
            vocab,
            rule: MergeRule::Scores,
            pretokenizer: Pretokenizer::Whole,
            ids: SpecialIds {
                bos: id("<bos>"),
                eos: id("<eos>"),
                unk: None,
                pad: None,
            },
            add_bos: true,
            add_space_prefix: false,
            chat_template: None,
            source: "test vocabulary".to_string(),
        })
        .expect("test vocabulary is well formed")
    }
}
