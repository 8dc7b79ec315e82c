//! Splitting input text around pieces that are matched verbatim (control
//! tokens like `<start_of_turn>` and user-defined pieces like `\n` or runs of
//! spaces) before any merging happens.
//!
//! A byte trie finds, at each position, the longest such piece starting
//! there; the scan takes the leftmost match, which is how Hugging Face
//! tokenizers splits added tokens.

/// One piece of the input after splitting.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub(crate) enum Segment<'a> {
    /// Ordinary text, to be merged into pieces.
    Text(&'a str),
    /// A verbatim token.
    Token(u32),
}

#[derive(Default)]
struct Node {
    /// Sorted by byte so lookups can binary-search.
    children: Vec<(u8, u32)>,
    /// Token ending here and whether it is a control token.
    token: Option<(u32, bool)>,
}

pub(crate) struct SpecialMatcher {
    nodes: Vec<Node>,
    /// Bytes that can start a match, so most positions cost one load.
    starts: [bool; 256],
}

impl SpecialMatcher {
    pub(crate) fn new() -> SpecialMatcher {
        SpecialMatcher {
            nodes: vec![Node::default()],
            starts: [false; 256],
        }
    }

    /// Adds a verbatim piece. The first id given for a text is kept.
    pub(crate) fn insert(&mut self, text: &str, id: u32, is_control: bool) {
        let Some(&first) = text.as_bytes().first() else {
            return;
        };
        self.starts[first as usize] = true;
        let mut node = 0usize;
        for &b in text.as_bytes() {
            node = match self.nodes[node].children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => self.nodes[node].children[i].1 as usize,
                Err(i) => {
                    let fresh = self.nodes.len();
                    self.nodes.push(Node::default());
                    self.nodes[node].children.insert(i, (b, fresh as u32));
                    fresh
                }
            };
        }
        self.nodes[node].token.get_or_insert((id, is_control));
    }

    /// Longest verbatim piece at the start of `bytes`, as (length, id).
    /// Control tokens count only when `with_control` is set.
    fn longest_at(&self, bytes: &[u8], with_control: bool) -> Option<(usize, u32)> {
        let mut node = 0usize;
        let mut best = None;
        for (i, &b) in bytes.iter().enumerate() {
            let children = &self.nodes[node].children;
            match children.binary_search_by_key(&b, |c| c.0) {
                Ok(k) => node = children[k].1 as usize,
                Err(_) => break,
            }
            if let Some((id, is_control)) = self.nodes[node].token
                && (with_control || !is_control)
            {
                best = Some((i + 1, id));
            }
        }
        best
    }

    /// Cuts `text` into ordinary text and verbatim tokens, in order.
    pub(crate) fn split<'a>(&self, text: &'a str, with_control: bool) -> Vec<Segment<'a>> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut plain_start = 0;
        let mut i = 0;
        while i < bytes.len() {
            if self.starts[bytes[i] as usize]
                && let Some((len, id)) = self.longest_at(&bytes[i..], with_control)
            {
                if plain_start < i {
                    out.push(Segment::Text(&text[plain_start..i]));
                }
                out.push(Segment::Token(id));
                i += len;
                plain_start = i;
                continue;
            }
            i += 1;
        }
        if plain_start < bytes.len() {
            out.push(Segment::Text(&text[plain_start..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Segment::{Text, Token};
    use super::*;

    fn matcher() -> SpecialMatcher {
        let mut m = SpecialMatcher::new();
        m.insert("<s>", 1, true);
        m.insert("<start>", 2, true);
        m.insert("\n", 3, false);
        m.insert("\n\n", 4, false);
        m.insert("  ", 5, false);
        m.insert("   ", 6, false);
        m
    }

    #[test]
    fn longest_match_wins() {
        let m = matcher();
        assert_eq!(
            m.split("a<start>b<s>", true),
            vec![Text("a"), Token(2), Text("b"), Token(1)]
        );
        assert_eq!(
            m.split("x\n\n\ny", true),
            vec![Text("x"), Token(4), Token(3), Text("y")]
        );
        assert_eq!(
            m.split("a     b", true),
            vec![Text("a"), Token(6), Token(5), Text("b")]
        );
    }

    #[test]
    fn partial_matches_stay_text() {
        let m = matcher();
        assert_eq!(m.split("<sta <st", true), vec![Text("<sta <st")]);
        assert_eq!(m.split("", true), vec![]);
    }

    #[test]
    fn control_tokens_only_on_request() {
        let m = matcher();
        assert_eq!(m.split("<s>\n", false), vec![Text("<s>"), Token(3)]);
    }

    #[test]
    fn multibyte_text_is_preserved() {
        let m = matcher();
        assert_eq!(
            m.split("é\n日本", true),
            vec![Text("é"), Token(3), Text("日本")]
        );
    }
}
