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

    /// Longest verbatim piece at `bytes[at..]`, where control tokens may
    /// only match within `bytes[at..trusted_end]`.
    fn longest_trusted(&self, bytes: &[u8], at: usize, trusted_end: usize) -> Option<(usize, u32)> {
        let any = self.longest_at(&bytes[at..], false);
        if trusted_end <= at {
            return any;
        }
        let control = self.longest_at(&bytes[at..trusted_end.min(bytes.len())], true);
        match (control, any) {
            (Some(c), Some(a)) if a.0 > c.0 => Some(a),
            (Some(c), _) => Some(c),
            (None, a) => a,
        }
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
        let end = if with_control { text.len() } else { 0 };
        self.split_trusted(text, |_| end)
    }

    /// Like [`SpecialMatcher::split`], but control tokens are matched only
    /// where they lie wholly inside a trusted stretch: `trusted_until(i)` is
    /// the end of the trusted stretch containing byte `i` (at most `i` when
    /// `i` is untrusted). Other verbatim pieces match anywhere, across
    /// stretches too, so the result equals `split(text, true)` whenever the
    /// untrusted stretches hold no control-token text.
    pub(crate) fn split_trusted<'a>(
        &self,
        text: &'a str,
        trusted_until: impl Fn(usize) -> usize,
    ) -> Vec<Segment<'a>> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut plain_start = 0;
        let mut i = 0;
        while i < bytes.len() {
            if self.starts[bytes[i] as usize]
                && let Some((len, id)) = self.longest_trusted(bytes, i, trusted_until(i))
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

    #[test]
    fn control_tokens_match_only_inside_trusted_stretches() {
        let m = matcher();
        // "<s>" at 0..3 is trusted, the "<start>" at 4..11 is not.
        let text = "<s>\n<start>\n";
        let until = |i: usize| if i < 4 { 4 } else { i };
        assert_eq!(
            m.split_trusted(text, until),
            vec![Token(1), Token(3), Text("<start>"), Token(3)]
        );
        // A control token that would run past the trusted stretch's end is
        // not matched: "<s" is trusted, ">" is not.
        assert_eq!(
            m.split_trusted("<s>", |i| if i < 2 { 2 } else { i }),
            vec![Text("<s>")]
        );
        // Other verbatim pieces cross stretches: "\n" + "\n" is one "\n\n".
        assert_eq!(
            m.split_trusted("a\n\nb", |i| if i < 2 { 2 } else { i }),
            m.split("a\n\nb", true)
        );
    }
}
