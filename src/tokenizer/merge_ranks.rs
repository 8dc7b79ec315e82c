//! A BPE merge list as a lookup table: (left id, right id) → (rank, merged id).
//!
//! Gemma 4 ships 514,906 merges and every encode looks pairs up in this
//! table, so both building and probing must be cheap: the two ids are packed
//! into one `u64` key and hashed with a single multiply-and-fold instead of
//! SipHash (the keys are ids of one local vocabulary, so there is no
//! adversary to defend against by a keyed hash).

use anyhow::{Result, bail};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes one `u64` key by a multiply with an odd constant and a fold of the
/// high half into the low half, where the hash map takes its bucket bits
/// (a product's low bits see only the key's low bits, its high bits all).
#[derive(Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by the table's keys; this keeps the hasher
        // correct for any other key type all the same.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Ranks are compared as `f32` in the merge loop, exact below 2^24.
pub(crate) const MAX_MERGES: usize = 1 << 24;

#[derive(Default)]
pub(crate) struct MergeRanks {
    table: HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>,
}

fn key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

impl MergeRanks {
    pub(crate) fn with_capacity(n: usize) -> MergeRanks {
        MergeRanks {
            table: HashMap::with_capacity_and_hasher(n, BuildHasherDefault::default()),
        }
    }

    /// Records that `left right` merges into `merged` at `rank`. When a pair
    /// is listed twice the first (best) rank is kept, as in Hugging Face
    /// tokenizers and llama.cpp.
    pub(crate) fn insert(&mut self, left: u32, right: u32, rank: u32, merged: u32) {
        self.table.entry(key(left, right)).or_insert((rank, merged));
    }

    /// (rank, merged id) of the pair, if it merges.
    pub(crate) fn get(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        self.table.get(&key(left, right)).copied()
    }

    /// Builds the table from merges given as piece texts, in rank order.
    /// `id_of` finds a piece's id; every side of a merge and the joined
    /// piece must be in the vocabulary. `what` names the list in errors
    /// (file and key).
    pub(crate) fn from_text_pairs<'a>(
        merges: impl ExactSizeIterator<Item = Result<(&'a str, &'a str)>>,
        id_of: impl Fn(&str) -> Option<u32>,
        what: &str,
    ) -> Result<MergeRanks> {
        if merges.len() >= MAX_MERGES {
            bail!(
                "{what}: {} merges is more than the {MAX_MERGES} this tokenizer supports",
                merges.len()
            );
        }
        let mut ranks = MergeRanks::with_capacity(merges.len());
        // One buffer for every joined piece instead of a String per merge.
        let mut joined = String::new();
        for (rank, pair) in merges.enumerate() {
            let (a, b) = pair?;
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let lookup = |piece: &str| {
                id_of(piece).ok_or_else(|| {
                    anyhow::anyhow!(
                        "{what}: merge {rank} ({a:?} {b:?}) uses {piece:?}, which is not in the \
                         vocabulary; the merges do not belong to this vocabulary"
                    )
                })
            };
            let merged = lookup(&joined)?;
            ranks.insert(lookup(a)?, lookup(b)?, rank as u32, merged);
        }
        Ok(ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_rank_of_a_pair_wins() {
        let mut r = MergeRanks::default();
        r.insert(1, 2, 5, 9);
        r.insert(1, 2, 7, 8);
        assert_eq!(r.get(1, 2), Some((5, 9)));
        assert_eq!(r.get(2, 1), None);
    }

    #[test]
    fn ids_are_not_confused_across_halves() {
        let mut r = MergeRanks::default();
        r.insert(0, 1, 0, 10);
        r.insert(1, 0, 1, 11);
        r.insert(u32::MAX, 0, 2, 12);
        r.insert(0, u32::MAX, 3, 13);
        assert_eq!(r.get(0, 1), Some((0, 10)));
        assert_eq!(r.get(1, 0), Some((1, 11)));
        assert_eq!(r.get(u32::MAX, 0), Some((2, 12)));
        assert_eq!(r.get(0, u32::MAX), Some((3, 13)));
    }

    #[test]
    fn text_pairs_resolve_to_ids_and_name_missing_pieces() {
        let pieces = ["a", "b", "ab", "c"];
        let id_of = |p: &str| pieces.iter().position(|x| *x == p).map(|i| i as u32);
        let ok = [Ok(("a", "b"))];
        let r = MergeRanks::from_text_pairs(ok.into_iter(), id_of, "x.gguf").unwrap();
        assert_eq!(r.get(0, 1), Some((0, 2)));
        let bad = [Ok(("a", "b")), Ok(("ab", "c"))];
        let err = MergeRanks::from_text_pairs(bad.into_iter(), id_of, "x.gguf: key k")
            .err()
            .expect("abc is not a piece");
        let msg = err.to_string();
        assert!(
            msg.contains("x.gguf: key k") && msg.contains("merge 1"),
            "{msg}"
        );
        assert!(msg.contains("\"abc\""), "{msg}");
    }
}
