//! The vocabulary: piece text, score and kind per id, plus the reverse index
//! from text to id and the table of byte-fallback tokens.

use super::piece_table::PieceTable;
use anyhow::{Result, bail};

/// What a vocabulary entry is for. The numbering of [`TokenKind::from_code`]
/// is the one shared by SentencePiece's `ModelProto` and GGUF's
/// `tokenizer.ggml.token_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// Ordinary text piece, built by merges.
    Normal,
    /// The unknown-token placeholder.
    Unknown,
    /// Control tokens such as `<bos>` or `<end_of_turn>`: no text of their own.
    Control,
    /// Pieces matched verbatim in the input before merging (`\n`, runs of spaces, `<b>`…).
    UserDefined,
    /// Reserved entries that never come out of encoding.
    Unused,
    /// `<0xNN>`: one raw byte, used when a character has no piece of its own.
    Byte,
}

impl TokenKind {
    /// Maps the shared numeric code (1 normal … 6 byte) to a kind.
    pub fn from_code(code: i64) -> Option<TokenKind> {
        Some(match code {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => return None,
        })
    }

    /// Whether BPE merges may produce a piece of this kind. SentencePiece
    /// only merges into pieces that are real text; control, byte and unused
    /// entries can be produced by other routes only.
    pub(crate) fn mergeable(self) -> bool {
        matches!(self, TokenKind::Normal | TokenKind::UserDefined)
    }
}

/// The SentencePiece word-boundary mark that stands for a space inside pieces.
pub const SPACE_MARK: char = '\u{2581}';

pub(crate) struct Vocab {
    pieces: PieceTable,
    scores: Vec<f32>,
    kinds: Vec<TokenKind>,
    byte_ids: [Option<u32>; 256],
}

/// Parses the text of a byte piece, `<0xNN>` with two hex digits.
pub fn parse_byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Vocab {
    /// Builds the vocabulary. `source` names the file for error messages.
    /// The three vectors must have one entry per id.
    pub(crate) fn new<S: AsRef<str>>(
        pieces: &[S],
        scores: Vec<f32>,
        kinds: Vec<TokenKind>,
        source: &str,
    ) -> Result<Vocab> {
        if pieces.is_empty() {
            bail!("{source}: the tokenizer vocabulary is empty");
        }
        if pieces.len() != scores.len() || pieces.len() != kinds.len() {
            bail!(
                "{source}: tokenizer tables disagree in length ({} pieces, {} scores, {} types); \
                 the file is damaged or was written by an incompatible converter",
                pieces.len(),
                scores.len(),
                kinds.len()
            );
        }
        let text_len: usize = pieces.iter().map(|p| p.as_ref().len()).sum();
        if pieces.len() >= 1 << 31 || u32::try_from(text_len).is_err() {
            bail!(
                "{source}: vocabulary of {} entries is too large",
                pieces.len()
            );
        }
        let mut byte_ids = [None; 256];
        for (id, piece) in pieces.iter().enumerate() {
            let (id, piece) = (id as u32, piece.as_ref());
            if kinds[id as usize] == TokenKind::Byte {
                match parse_byte_piece(piece) {
                    Some(b) => {
                        byte_ids[b as usize].get_or_insert(id);
                    }
                    None => bail!(
                        "{source}: token {id} ({piece:?}) is typed as a byte token but is not \
                         written <0xNN>"
                    ),
                }
            }
        }
        Ok(Vocab {
            // On duplicate text the lowest id wins, as in SentencePiece.
            pieces: PieceTable::new(pieces),
            scores,
            kinds,
            byte_ids,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.pieces.len()
    }

    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.piece(id)
    }

    pub(crate) fn score(&self, id: u32) -> f32 {
        self.scores[id as usize]
    }

    pub(crate) fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Any entry with exactly this text.
    pub(crate) fn id_of(&self, piece: &str) -> Option<u32> {
        self.pieces.get(piece)
    }

    /// An entry with this text that merges may produce.
    pub(crate) fn mergeable_id(&self, piece: &str) -> Option<u32> {
        self.id_of(piece)
            .filter(|&id| self.kinds[id as usize].mergeable())
    }

    /// Retypes an entry. Byte entries keep their kind: their byte table was
    /// built from it.
    pub(crate) fn set_kind(&mut self, id: u32, kind: TokenKind) {
        if let Some(k) = self.kinds.get_mut(id as usize)
            && *k != TokenKind::Byte
        {
            *k = kind;
        }
    }

    pub(crate) fn byte_id(&self, byte: u8) -> Option<u32> {
        self.byte_ids[byte as usize]
    }

    /// Ids of every entry that is matched verbatim in the input before
    /// merging, with a flag telling whether it is a control token (those are
    /// matched only when the caller asks for special-token parsing).
    pub(crate) fn verbatim_entries(&self) -> impl Iterator<Item = (u32, &str, bool)> {
        self.pieces.iter().filter_map(|(id, p)| {
            let kind = self.kinds[id as usize];
            let wanted = matches!(
                kind,
                TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
            );
            (wanted && !p.is_empty()).then_some((id, p, kind != TokenKind::UserDefined))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_piece_parsing() {
        assert_eq!(parse_byte_piece("<0x0A>"), Some(10));
        assert_eq!(parse_byte_piece("<0xff>"), Some(255));
        assert_eq!(parse_byte_piece("<0x0A"), None);
        assert_eq!(parse_byte_piece("<0x100>"), None);
        assert_eq!(parse_byte_piece("<0xZZ>"), None);
    }

    #[test]
    fn rejects_mismatched_tables() {
        let err = Vocab::new(&["a"], vec![], vec![TokenKind::Normal], "x.gguf")
            .err()
            .expect("length mismatch must fail");
        assert!(err.to_string().contains("x.gguf"), "{err}");
    }

    #[test]
    fn rejects_malformed_byte_piece() {
        let r = Vocab::new(&["<0xG1>"], vec![0.0], vec![TokenKind::Byte], "x");
        assert!(r.is_err());
    }

    #[test]
    fn duplicate_text_keeps_lowest_id() {
        let v = Vocab::new(
            &["a", "b", "a"],
            vec![0.0; 3],
            vec![TokenKind::Normal; 3],
            "x",
        )
        .unwrap();
        assert_eq!(v.id_of("a"), Some(0));
        assert_eq!(v.id_of("b"), Some(1));
    }
}
