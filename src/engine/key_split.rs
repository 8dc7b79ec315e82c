//! How the single-token attentions of a step are cut into units of work.
//!
//! A token attending alone splits its keys into parts, one per thread, and
//! merges the parts by their softmax mass (`kernels::merge_key_parts`). The
//! split must depend on the token's position alone: a verify step of
//! speculative decoding computes its tokens "exactly", with the bits each
//! would get in a one-token step.
//!
//! The tokens of a verify step sit at consecutive positions of one sequence.
//! Where they also share the inner boundaries of their splits, one unit of
//! work can take a part of the keys for all of them: every K and V row of
//! the part is read once for the whole run instead of once per token. Each
//! query row still sees exactly its own keys (the rows' causal and window
//! limits mask the rest to probability 0, whose products add nothing), so
//! every token's result keeps its bits. The inner boundaries are therefore
//! rounded down to a multiple of a power of two (an eighth of a part or
//! less), which neighbouring positions share most of the time.

use std::ops::Range;

/// One token's keys and how they are split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySplit {
    pub seq: usize,
    pub pos: usize,
    /// Part p holds keys `bounds[p]..bounds[p + 1]`: the first is the
    /// token's first visible key, the last its position + 1.
    bounds: Vec<usize>,
}

impl KeySplit {
    /// The split of the keys that the token at `pos` sees (the last
    /// `window` positions, or all up to its own), into at most `threads`
    /// parts of at least `min_keys_per_part` keys.
    pub fn new(
        seq: usize,
        pos: usize,
        window: Option<usize>,
        threads: usize,
        min_keys_per_part: usize,
    ) -> KeySplit {
        let first_key = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let n_keys = pos + 1 - first_key;
        let parts = threads.min(n_keys / min_keys_per_part.max(1)).max(1);
        let align = alignment(n_keys / parts);
        let inner = (1..parts).map(|p| {
            let even = first_key + n_keys * p / parts;
            even - even % align
        });
        let bounds = std::iter::once(first_key)
            .chain(inner)
            .chain(std::iter::once(pos + 1))
            .collect();
        KeySplit { seq, pos, bounds }
    }

    pub fn parts(&self) -> usize {
        self.bounds.len() - 1
    }

    pub fn first_key(&self) -> usize {
        self.bounds[0]
    }

    pub fn n_keys(&self) -> usize {
        self.pos + 1 - self.first_key()
    }

    /// The keys of part `p`.
    pub fn part(&self, p: usize) -> Range<usize> {
        self.bounds[p]..self.bounds[p + 1]
    }

    /// The boundaries between parts.
    fn inner_bounds(&self) -> &[usize] {
        &self.bounds[1..self.bounds.len() - 1]
    }

    /// Whether `next` can share units with this token: the same sequence,
    /// the next position, and the same inner boundaries.
    fn continued_by(&self, next: &KeySplit) -> bool {
        next.seq == self.seq
            && next.pos == self.pos + 1
            && next.inner_bounds() == self.inner_bounds()
    }
}

/// The power of two the inner boundaries are rounded down to for parts of
/// about `part_keys` keys: at most an eighth of a part, so the threads'
/// shares differ by at most that much.
fn alignment(part_keys: usize) -> usize {
    let eighth = (part_keys / 8).max(1);
    1 << eighth.ilog2()
}

/// A unit of work: part `part` of KV head `kv_head`'s keys, for the tokens
/// `tokens` (indices into the step's splits: consecutive positions of one
/// sequence sharing their inner boundaries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionUnit {
    pub tokens: Range<usize>,
    pub kv_head: usize,
    pub part: usize,
}

impl AttentionUnit {
    /// The keys the unit reads: from its first token's start of the part to
    /// its last token's end of it.
    pub fn keys(&self, splits: &[KeySplit]) -> Range<usize> {
        let (first, last) = (&splits[self.tokens.start], &splits[self.tokens.end - 1]);
        first.part(self.part).start..last.part(self.part).end
    }
}

/// The units for tokens with the given splits, `n_kv_heads` KV heads and
/// `threads` threads. Runs of tokens that can share are cut only where
/// they would otherwise leave a thread without a unit.
pub fn attention_units(
    splits: &[KeySplit],
    n_kv_heads: usize,
    threads: usize,
) -> Vec<AttentionUnit> {
    let mut units = Vec::new();
    let mut start = 0;
    while start < splits.len() {
        let mut end = start + 1;
        while end < splits.len() && splits[end - 1].continued_by(&splits[end]) {
            end += 1;
        }
        let per_run = splits[start].parts() * n_kv_heads;
        let pieces = threads.div_ceil(per_run.max(1)).min(end - start).max(1);
        let per_piece = (end - start).div_ceil(pieces);
        for t0 in (start..end).step_by(per_piece) {
            let tokens = t0..(t0 + per_piece).min(end);
            for kv_head in 0..n_kv_heads {
                for part in 0..splits[start].parts() {
                    units.push(AttentionUnit {
                        tokens: tokens.clone(),
                        kv_head,
                        part,
                    });
                }
            }
        }
        start = end;
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_visible_keys_in_order_and_none_is_empty() {
        for window in [None, Some(512), Some(37)] {
            for threads in 1..=4 {
                for pos in 0..1500 {
                    let s = KeySplit::new(0, pos, window, threads, 4);
                    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    assert_eq!(s.first_key(), first);
                    assert_eq!(s.part(s.parts() - 1).end, pos + 1);
                    for p in 0..s.parts() {
                        assert!(!s.part(p).is_empty(), "pos {pos} part {p}: {s:?}");
                        if p > 0 {
                            assert_eq!(s.part(p - 1).end, s.part(p).start);
                        }
                    }
                    assert_eq!(s.parts(), threads.min(s.n_keys() / 4).max(1));
                }
            }
        }
    }

    #[test]
    fn shares_stay_within_an_eighth_of_a_part_of_even() {
        for pos in 100..2000 {
            let s = KeySplit::new(0, pos, Some(512), 2, 4);
            let (a, b) = (s.part(0).len(), s.part(1).len());
            assert!(
                b >= a && b - a <= s.n_keys() / 8 + 1,
                "pos {pos}: {a} and {b}"
            );
        }
    }

    #[test]
    fn a_run_of_eight_mostly_forms_one_group() {
        // Positions 600..1600 with the default model's window and 2 threads:
        // a run of 8 is cut in two only where a boundary moves inside it.
        for window in [None, Some(512)] {
            let mut single = 0;
            for start in 600..1600 {
                let splits: Vec<KeySplit> = (start..start + 8)
                    .map(|pos| KeySplit::new(0, pos, window, 2, 4))
                    .collect();
                let units = attention_units(&splits, 1, 2);
                let runs = units.iter().filter(|u| u.part == 0).count();
                assert!(runs <= 2, "at {start}: {units:?}");
                single += usize::from(runs == 1);
            }
            assert!(
                single >= 700,
                "{window:?}: {single} of 1000 runs in one group"
            );
        }
    }

    #[test]
    fn units_cover_every_token_part_and_head_once() {
        let mut splits: Vec<KeySplit> = (40..56)
            .map(|pos| KeySplit::new(0, pos, None, 2, 4))
            .collect();
        // A second sequence and a short one whose keys take one part.
        splits.extend((300..303).map(|pos| KeySplit::new(1, pos, Some(512), 2, 4)));
        splits.push(KeySplit::new(2, 5, None, 2, 4));
        for (threads, heads) in [(1, 1), (2, 1), (2, 2), (3, 1), (8, 1)] {
            let units = attention_units(&splits, heads, threads);
            let mut seen = vec![0; splits.len() * heads * 2];
            for u in &units {
                let first = &splits[u.tokens.start];
                for t in u.tokens.clone() {
                    assert_eq!(splits[t].seq, first.seq);
                    assert_eq!(splits[t].pos, first.pos + (t - u.tokens.start));
                    let own = splits[t].part(u.part);
                    let keys = u.keys(&splits);
                    assert!(keys.start <= own.start && own.end <= keys.end);
                    seen[(t * heads + u.kv_head) * 2 + u.part] += 1;
                }
            }
            for (t, s) in splits.iter().enumerate() {
                for h in 0..heads {
                    for p in 0..2 {
                        let want = usize::from(p < s.parts());
                        assert_eq!(
                            seen[(t * heads + h) * 2 + p],
                            want,
                            "token {t} head {h} part {p}"
                        );
                    }
                }
            }
            // The short sequence's lone part still leaves no thread idle
            // where tokens could be cut.
            assert!(units.len() >= threads.min(splits.len()));
        }
    }
}
