//! Turning ids back into text, one id at a time.
//!
//! Byte tokens (`<0xNN>`) carry single bytes of a UTF-8 character that had
//! no piece of its own, so the text of one id may be an incomplete
//! character. The decoder keeps such bytes until the character is complete
//! and only then hands the text out; bytes that can never form a character
//! come out as U+FFFD.

use super::Tokenizer;
use super::vocab::{SPACE_MARK, TokenKind, parse_byte_piece};

/// Incremental decoder: [`StreamDecoder::push`] one id, get the text that is
/// complete now; [`StreamDecoder::finish`] at the end for what is left.
pub struct StreamDecoder<'t> {
    tok: &'t Tokenizer,
    /// Bytes not yet handed out because they end in an incomplete character.
    pending: Vec<u8>,
    /// Write the text of control tokens instead of nothing.
    show_control: bool,
    /// Drop the `▁` that a dummy-prefix encoder put before the first piece.
    strip_prefix: bool,
    /// No text token has been seen yet (the one place that prefix can be).
    at_start: bool,
}

impl<'t> StreamDecoder<'t> {
    /// `strip_prefix` is for decoding a whole encoded text; generated
    /// continuations must keep their leading space.
    pub(crate) fn new(
        tok: &'t Tokenizer,
        show_control: bool,
        strip_prefix: bool,
    ) -> StreamDecoder<'t> {
        StreamDecoder {
            tok,
            pending: Vec::new(),
            show_control,
            strip_prefix: strip_prefix && tok.add_space_prefix,
            at_start: true,
        }
    }

    /// Adds one id and returns the text it completes (possibly empty).
    /// Ids outside the vocabulary decode as U+FFFD so that the mistake shows.
    pub fn push(&mut self, id: u32) -> String {
        self.append(id);
        self.take_complete(false)
    }

    /// Returns whatever is held back, with incomplete characters as U+FFFD,
    /// and resets the decoder for a new stream.
    pub fn finish(&mut self) -> String {
        let out = self.take_complete(true);
        self.at_start = true;
        out
    }

    fn append(&mut self, id: u32) {
        let vocab = &self.tok.vocab;
        let (Some(kind), Some(piece)) = (vocab.kind(id), vocab.piece(id)) else {
            self.pending.extend_from_slice("\u{FFFD}".as_bytes());
            return;
        };
        match kind {
            TokenKind::Byte => {
                self.at_start = false;
                // The vocabulary checked at load time that byte pieces parse.
                if let Some(b) = parse_byte_piece(piece) {
                    self.pending.push(b);
                }
            }
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => {
                if self.show_control {
                    self.pending.extend_from_slice(piece.as_bytes());
                }
            }
            TokenKind::Normal | TokenKind::UserDefined => {
                let mut text = piece;
                // The encoder prefixed a space that the writer never typed.
                if self.at_start && self.strip_prefix {
                    text = text.strip_prefix(SPACE_MARK).unwrap_or(text);
                }
                self.at_start = false;
                for ch in text.chars() {
                    let ch = if ch == SPACE_MARK { ' ' } else { ch };
                    let mut buf = [0u8; 4];
                    self.pending
                        .extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    }

    /// Moves complete characters out of `pending`. With `flush`, incomplete
    /// trailing bytes are replaced too instead of being kept.
    fn take_complete(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // from_utf8 just said this prefix is valid, so nothing is lost here.
                    out.push_str(std::str::from_utf8(good).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        None if flush => {
                            out.push('\u{FFFD}');
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let len = self.pending.len();
        self.pending.drain(..len - keep);
        out
    }
}
