//! Merging the characters of one text segment into vocabulary pieces.
//!
//! Both SentencePiece's BPE (merge the adjacent pair whose joined text has the
//! best score) and Hugging Face's BPE (merge the adjacent pair with the lowest
//! rank in the merge list) are "repeatedly take the best adjacent pair", so
//! one engine serves both; only the way a pair is judged differs. Symbols form
//! a doubly linked list and candidate pairs sit in a max-heap, so a segment
//! of n characters costs O(n log n), not O(n²) rescans. Stale heap entries
//! (a side already merged into something else) are detected and skipped.
//!
//! Characters without a piece of their own are spelled as `<0xNN>` byte
//! tokens at the end (byte fallback).

use super::merge_text::TextMerges;
use super::vocab::Vocab;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// How adjacent pairs are judged.
pub(crate) enum MergeRule {
    /// SentencePiece: a pair may merge when its joined text is a mergeable
    /// piece; higher piece score merges first.
    Scores,
    /// Hugging Face BPE and Gemma 4's GGUF: a merge list, looked up by the
    /// pair's text; the pair with the lower rank merges first. A merge
    /// whose joined text is no mergeable piece is skipped, so no text can
    /// be lost to it.
    Ranks(TextMerges),
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
    /// Vocabulary id of this span, when it has one.
    id: Option<u32>,
}

struct Candidate {
    /// Higher merges first.
    priority: f32,
    left: usize,
    right: usize,
    /// Joined length when pushed; a mismatch later means the entry is stale.
    len: usize,
    /// The merged piece's id, when the rule knows it already.
    merged: Option<u32>,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Equal priority: the leftmost pair goes first, as in both references.
        self.priority
            .total_cmp(&other.priority)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl MergeRule {
    /// The verdict on merging `l` and `r` in `text`: (priority, merged id
    /// if known yet).
    fn judge(
        &self,
        vocab: &Vocab,
        text: &str,
        l: &Symbol,
        r: &Symbol,
    ) -> Option<(f32, Option<u32>)> {
        // Loaders refuse lists of 2^24 merges or more, so ranks are exact in f32.
        match self {
            MergeRule::Scores => {
                let id = vocab.mergeable_id(&text[l.start..r.start + r.len])?;
                Some((vocab.score(id), Some(id)))
            }
            MergeRule::Ranks(table) => {
                let rank = table.rank(&text[l.start..r.start + r.len], l.len)?;
                Some((-(rank as f32), None))
            }
        }
    }
}

/// Encodes one segment of already-normalized text (spaces written as `▁`),
/// appending ids to `out`. `unk` is used for a byte with no byte token.
pub(crate) fn encode_segment(
    vocab: &Vocab,
    rule: &MergeRule,
    unk: Option<u32>,
    text: &str,
    out: &mut Vec<u32>,
) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, ch) in text.char_indices() {
        let len = ch.len_utf8();
        let n = symbols.len();
        symbols.push(Symbol {
            start,
            len,
            prev: n.checked_sub(1),
            next: None,
            id: vocab.mergeable_id(&text[start..start + len]),
        });
        if n > 0 {
            symbols[n - 1].next = Some(n);
        }
    }

    let mut heap = BinaryHeap::with_capacity(symbols.len());
    let push = |heap: &mut BinaryHeap<Candidate>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else {
            return;
        };
        let (l, r) = (&symbols[left], &symbols[right]);
        if let Some((priority, merged)) = rule.judge(vocab, text, l, r) {
            heap.push(Candidate {
                priority,
                left,
                right,
                len: l.len + r.len,
                merged,
            });
        }
    };
    for left in 0..symbols.len() {
        push(&mut heap, &symbols, left);
    }

    while let Some(c) = heap.pop() {
        let (l, r) = (&symbols[c.left], &symbols[c.right]);
        // Merged-away symbols have len 0; a changed neighbour shows in the length.
        if l.len == 0 || r.len == 0 || l.next != Some(c.right) || l.len + r.len != c.len {
            continue;
        }
        let Some(merged) = c
            .merged
            .or_else(|| vocab.mergeable_id(&text[l.start..l.start + c.len]))
        else {
            continue;
        };
        let right_next = r.next;
        let left = &mut symbols[c.left];
        left.len = c.len;
        left.id = Some(merged);
        left.next = right_next;
        symbols[c.right].len = 0;
        if let Some(n) = right_next {
            symbols[n].prev = Some(c.left);
        }
        if let Some(p) = symbols[c.left].prev {
            push(&mut heap, &symbols, p);
        }
        push(&mut heap, &symbols, c.left);
    }

    let mut cur = if symbols.is_empty() { None } else { Some(0) };
    while let Some(i) = cur {
        let s = symbols[i];
        match s.id {
            Some(id) => out.push(id),
            None => {
                for &b in &text.as_bytes()[s.start..s.start + s.len] {
                    if let Some(id) = vocab.byte_id(b).or(unk) {
                        out.push(id);
                    }
                }
            }
        }
        cur = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::vocab::TokenKind;

    fn vocab(pieces: &[(&str, f32, TokenKind)]) -> Vocab {
        Vocab::new(
            &pieces.iter().map(|p| p.0).collect::<Vec<_>>(),
            pieces.iter().map(|p| p.1).collect(),
            pieces.iter().map(|p| p.2).collect(),
            "test",
        )
        .unwrap()
    }

    fn run(v: &Vocab, rule: &MergeRule, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        encode_segment(v, rule, Some(0), text, &mut out);
        out
    }

    use TokenKind::{Byte, Control, Normal};

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let v = vocab(&[
            ("<unk>", 0.0, Control),
            ("a", -5.0, Normal),
            ("aa", -1.0, Normal),
        ]);
        assert_eq!(run(&v, &MergeRule::Scores, "aaa"), vec![2, 1]);
        assert_eq!(run(&v, &MergeRule::Scores, "aaaa"), vec![2, 2]);
    }

    #[test]
    fn higher_score_wins_over_position() {
        // "bc" outranks "ab", so "abc" → a + bc even though "ab" is leftmost.
        let v = vocab(&[
            ("<unk>", 0.0, Control),
            ("a", -9.0, Normal),
            ("b", -9.0, Normal),
            ("c", -9.0, Normal),
            ("ab", -3.0, Normal),
            ("bc", -2.0, Normal),
        ]);
        assert_eq!(run(&v, &MergeRule::Scores, "abc"), vec![1, 5]);
    }

    #[test]
    fn only_text_pieces_are_merge_targets() {
        // "ab" exists but is a control token: no merge.
        let v = vocab(&[
            ("<unk>", 0.0, Control),
            ("a", -1.0, Normal),
            ("b", -1.0, Normal),
            ("ab", 0.0, Control),
        ]);
        assert_eq!(run(&v, &MergeRule::Scores, "ab"), vec![1, 2]);
    }

    #[test]
    fn ranks_follow_the_merge_list_not_scores() {
        let v = vocab(&[
            ("<unk>", 0.0, Control),
            ("a", 0.0, Normal),
            ("b", 0.0, Normal),
            ("c", 0.0, Normal),
            ("ab", 0.0, Normal),
            ("bc", 0.0, Normal),
        ]);
        let ranks = |merges: [(&'static str, &'static str); 2]| {
            let list = TextMerges::from_pairs(merges.into_iter().map(Ok), "test").unwrap();
            MergeRule::Ranks(list)
        };
        assert_eq!(run(&v, &ranks([("a", "b"), ("b", "c")]), "abc"), vec![4, 3]);
        assert_eq!(run(&v, &ranks([("b", "c"), ("a", "b")]), "abc"), vec![1, 5]);
        // "ca" is listed but no piece: skipped, the characters stay.
        assert_eq!(run(&v, &ranks([("c", "a"), ("a", "b")]), "cab"), vec![3, 4]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes_or_unk() {
        let v = vocab(&[
            ("<unk>", 0.0, Control),
            ("a", 0.0, Normal),
            ("<0xC3>", 0.0, Byte),
            ("<0xA9>", 0.0, Byte),
        ]);
        assert_eq!(run(&v, &MergeRule::Scores, "aéa"), vec![1, 2, 3, 1]);
        // No byte token for 0xB6 (ö is C3 B6): that byte becomes unk.
        assert_eq!(run(&v, &MergeRule::Scores, "ö"), vec![2, 0]);
        assert_eq!(run(&v, &MergeRule::Scores, ""), Vec::<u32>::new());
    }
}
