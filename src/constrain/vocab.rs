//! Pulsar's vocabulary as llguidance sees it: the bytes each token adds to
//! the output, with tokens that write no text of their own marked special.

use crate::tokenizer::{SPACE_MARK, TokenKind, Tokenizer, parse_byte_piece};
use anyhow::{Result, bail};
use std::sync::Arc;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// The bytes token `id` writes, as llguidance expects them:
/// - text pieces with SentencePiece's `▁` written as a space;
/// - byte-fallback tokens (`<0xNN>`) as their one byte;
/// - control, unknown and unused entries as `0xFF` followed by their text,
///   llguidance's mark for special tokens, which a grammar can never emit
///   as text (EOS is allowed by the matcher itself, when the grammar is
///   complete).
///
/// The byte token `<0xFF>` gets no bytes: 0xFF never occurs in UTF-8, so no
/// grammar can want it, and as a lone 0xFF it would sit where llguidance
/// keeps the special tokens in its trie.
pub fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let (Some(kind), Some(piece)) = (tok.token_kind(id), tok.token_text(id)) else {
        return Vec::new();
    };
    match kind {
        TokenKind::Normal | TokenKind::UserDefined => {
            if piece.contains(SPACE_MARK) {
                piece.replace(SPACE_MARK, " ").into_bytes()
            } else {
                piece.as_bytes().to_vec()
            }
        }
        TokenKind::Byte => match parse_byte_piece(piece) {
            Some(TokTrie::SPECIAL_TOKEN_MARKER) | None => Vec::new(),
            Some(byte) => vec![byte],
        },
        TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => {
            let mut bytes = Vec::with_capacity(piece.len() + 1);
            bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
            bytes.extend_from_slice(piece.as_bytes());
            bytes
        }
    }
}

/// The vocabulary as bytes, gathered from a [`Tokenizer`] (quick) so that
/// the slow part, [`VocabBytes::into_token_env`], can run on another thread
/// without borrowing the tokenizer.
pub struct VocabBytes {
    words: Vec<Vec<u8>>,
    info: TokRxInfo,
    end_ids: Vec<u32>,
}

impl VocabBytes {
    /// `end_ids` are the tokens that end generation (EOS first, then
    /// `<end_of_turn>` and the like): the matcher allows them exactly when
    /// the constraint is complete.
    pub fn of(tok: &Tokenizer, end_ids: &[u32]) -> Result<VocabBytes> {
        let vocab_size = tok.vocab_size();
        let Ok(size) = u32::try_from(vocab_size) else {
            bail!("a vocabulary of {vocab_size} tokens is too large for the constraint engine");
        };
        let Some(&eos) = end_ids.first() else {
            bail!("internal error: a constraint needs at least one end-of-generation token");
        };
        Ok(VocabBytes {
            words: (0..size).map(|id| token_bytes(tok, id)).collect(),
            info: TokRxInfo {
                vocab_size: size,
                tok_eos: eos,
                tok_bos: Some(tok.bos_id()),
                tok_pad: tok.special_ids().pad,
                tok_unk: tok.special_ids().unk,
                tok_end_of_turn: tok.id_of("<end_of_turn>"),
            },
            end_ids: end_ids.to_vec(),
        })
    }

    /// Builds llguidance's token trie over the whole vocabulary.
    pub fn into_token_env(self) -> TokEnv {
        let trie = TokTrie::from(&self.info, &self.words).with_eos_tokens(&self.end_ids);
        // Greedy re-tokenization is enough: llguidance only tokenizes text
        // to force tokens, which the generation loop does not use (it
        // samples every token under the mask).
        Arc::new(ApproximateTokEnv::new(trie))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::TokenKind::*;

    fn vocab() -> Tokenizer {
        Tokenizer::for_tests(&[
            ("<pad>", Control),
            ("<eos>", Control),
            ("<bos>", Control),
            ("<0x41>", Byte),
            ("<0xE2>", Byte),
            ("<0xFF>", Byte),
            ("▁the", Normal),
            ("▁▁", UserDefined),
            ("\n", UserDefined),
            ("é", Normal),
            ("<unused0>", Unused),
        ])
    }

    #[test]
    fn byte_fallback_tokens_are_their_single_byte() {
        let tok = vocab();
        assert_eq!(token_bytes(&tok, 3), vec![0x41]);
        assert_eq!(token_bytes(&tok, 4), vec![0xE2]);
    }

    #[test]
    fn space_mark_becomes_a_space() {
        let tok = vocab();
        assert_eq!(token_bytes(&tok, 6), b" the".to_vec());
        assert_eq!(token_bytes(&tok, 7), b"  ".to_vec());
        assert_eq!(token_bytes(&tok, 8), b"\n".to_vec());
        assert_eq!(token_bytes(&tok, 9), "é".as_bytes().to_vec());
    }

    #[test]
    fn control_and_unused_tokens_are_marked_special() {
        let tok = vocab();
        assert_eq!(token_bytes(&tok, 1), b"\xFF<eos>".to_vec());
        assert_eq!(token_bytes(&tok, 10), b"\xFF<unused0>".to_vec());
    }

    #[test]
    fn the_byte_0xff_is_never_text() {
        assert!(token_bytes(&vocab(), 5).is_empty());
    }

    #[test]
    fn trie_knows_special_and_end_tokens() {
        let tok = vocab();
        let env = VocabBytes::of(&tok, &[1]).unwrap().into_token_env();
        let trie = env.tok_trie();
        assert_eq!(trie.vocab_size(), 11);
        assert!(trie.is_special_token(1));
        assert!(trie.is_special_token(10));
        assert!(!trie.is_special_token(6));
        assert_eq!(trie.eos_tokens(), &[1]);
        assert_eq!(trie.token(6), b" the");
    }
}
