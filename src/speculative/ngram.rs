//! An index of every n-gram (n = 1 ..= `max_n`) of a token sequence, for
//! prompt-lookup drafting: the longest suffix of the sequence that occurred
//! before, and the tokens that followed its most recent earlier occurrence.
//!
//! Tokens are only appended: a generation's context grows one token at a
//! time, and a caller whose sequence shrinks or changes builds a new index
//! (cheap: a 4,096-token context is indexed in well under a millisecond).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Most n-gram lengths the index keeps. Beyond 8 tokens of agreement a
/// longer match rarely points at a different place in the text.
pub const MAX_N: usize = 8;

/// A match of the sequence's suffix earlier in the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Match {
    /// How many tokens of the suffix matched.
    pub n: usize,
    /// Where the tokens that followed the earlier occurrence begin.
    pub continuation: usize,
}

/// The keys are already well-mixed 64-bit hashes; hashing them again would
/// only cost time.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; fold anything else in so
        // the hasher stays correct if that ever changes.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8)) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// The n-gram index of one token sequence.
pub struct NgramIndex {
    tokens: Vec<u32>,
    max_n: usize,
    /// Hash of (n, the n tokens) → index of the token that followed their
    /// most recent occurrence. A hash collision can only lose a match (the
    /// tokens are compared before a match is reported), never invent one.
    latest: HashMap<u64, u32, BuildHasherDefault<PassThrough>>,
}

/// A 64-bit hash of `gram`, different for each length. splitmix64's
/// finalizer per token: cheap, and good enough that collisions between the
/// few thousand n-grams of a context are practically absent.
fn key(gram: &[u32]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64 ^ gram.len() as u64;
    for &t in gram {
        h ^= u64::from(t);
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 29;
        h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 32;
    }
    h
}

impl NgramIndex {
    /// An index of `tokens` keeping n-grams of 1 ..= `max_n` tokens
    /// (`max_n` is clamped to 1 ..= [`MAX_N`]).
    pub fn new(tokens: &[u32], max_n: usize) -> NgramIndex {
        let mut index = NgramIndex {
            tokens: Vec::with_capacity(tokens.len() + 256),
            max_n: max_n.clamp(1, MAX_N),
            latest: HashMap::default(),
        };
        index.extend(tokens);
        index
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends tokens to the sequence.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Appends one token. The n-grams that end just before it now have a
    /// continuation, so they enter the index pointing at it: every indexed
    /// occurrence is followed by at least one token.
    pub fn push(&mut self, token: u32) {
        let at = self.tokens.len();
        for n in 1..=self.max_n.min(at) {
            self.latest.insert(key(&self.tokens[at - n..at]), at as u32);
        }
        self.tokens.push(token);
    }

    /// The longest suffix of the sequence (at most `max_n` tokens) that
    /// occurred earlier, at its most recent earlier occurrence.
    pub fn longest_match(&self) -> Option<Match> {
        let len = self.tokens.len();
        // A suffix as long as the whole sequence has nothing before it.
        let longest = self.max_n.min(len.saturating_sub(1));
        (1..=longest).rev().find_map(|n| {
            let suffix = &self.tokens[len - n..];
            let at = *self.latest.get(&key(suffix))? as usize;
            (at >= n && &self.tokens[at - n..at] == suffix).then_some(Match {
                n,
                continuation: at,
            })
        })
    }

    /// Up to `max_len` tokens that followed the longest earlier match of
    /// the suffix, with the match; empty when nothing matches.
    pub fn draft(&self, max_len: usize) -> (Option<Match>, &[u32]) {
        match self.longest_match() {
            Some(m) if max_len > 0 => {
                let end = (m.continuation + max_len).min(self.tokens.len());
                (Some(m), &self.tokens[m.continuation..end])
            }
            found => (found, &[]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The longest match by brute force: for n from long to short, the
    /// latest earlier position where the suffix occurs.
    fn brute_force(tokens: &[u32], max_n: usize) -> Option<Match> {
        let len = tokens.len();
        for n in (1..=max_n.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // Occurrences ending before the last token, latest first.
            for end in (n..len).rev() {
                if &tokens[end - n..end] == suffix {
                    return Some(Match {
                        n,
                        continuation: end,
                    });
                }
            }
        }
        None
    }

    #[test]
    fn longest_match_first_then_most_recent_occurrence() {
        // "a b c d | x b c d | y c d" then suffix "c d": the 3-gram "b c d"
        // does not end the text, so the longest match is "c d"'s latest.
        let t = [1, 2, 3, 4, 9, 2, 3, 4, 8, 3, 4];
        let index = NgramIndex::new(&t, 4);
        assert_eq!(
            index.longest_match(),
            Some(Match {
                n: 2,
                continuation: 8
            })
        );
        assert_eq!(index.draft(3), (index.longest_match(), &[8u32, 3, 4][..]));
        // After "... 2 3 4" the 3-gram matches at its latest place (5..8).
        let mut index = NgramIndex::new(&t[..8], 4);
        assert_eq!(
            index.longest_match(),
            Some(Match {
                n: 3,
                continuation: 4
            })
        );
        // A new token changes the suffix: nothing ends with 7 before.
        index.push(7);
        assert_eq!(index.longest_match(), None);
        assert_eq!(index.draft(5), (None, &[][..]));
    }

    #[test]
    fn draft_is_cut_at_the_end_of_the_sequence_and_the_limit() {
        // A run of one token: the suffix "5 5" last occurred one token ago,
        // so only one token follows it.
        let index = NgramIndex::new(&[5, 5, 5, 5], 8);
        assert_eq!(
            index.longest_match(),
            Some(Match {
                n: 3,
                continuation: 3
            })
        );
        assert_eq!(index.draft(8).1, &[5]);
        let index = NgramIndex::new(&[1, 2, 3, 4, 5, 6, 1, 2], 4);
        assert_eq!(index.draft(2).1, &[3, 4]);
        assert_eq!(index.draft(10).1, &[3, 4, 5, 6, 1, 2]);
        assert_eq!(index.draft(0), (index.longest_match(), &[][..]));
    }

    #[test]
    fn agrees_with_brute_force_on_random_text_as_it_grows() {
        // A small alphabet makes many repeats of every length.
        let mut state = 12345u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((state >> 33) % 5) as u32
        };
        for max_n in [1, 3, 8] {
            let mut index = NgramIndex::new(&[], max_n);
            let mut tokens = Vec::new();
            for _ in 0..400 {
                let t = next();
                tokens.push(t);
                index.push(t);
                assert_eq!(index.tokens(), tokens);
                assert_eq!(
                    index.longest_match(),
                    brute_force(&tokens, max_n),
                    "after {} tokens, max_n {max_n}",
                    tokens.len()
                );
            }
        }
    }

    #[test]
    fn short_sequences_have_no_match() {
        assert_eq!(NgramIndex::new(&[], 4).longest_match(), None);
        assert_eq!(NgramIndex::new(&[3], 4).longest_match(), None);
        assert_eq!(
            NgramIndex::new(&[3, 3], 4).longest_match(),
            Some(Match {
                n: 1,
                continuation: 1
            })
        );
        assert!(NgramIndex::new(&[], 4).is_empty());
    }
}
