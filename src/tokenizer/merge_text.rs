//! A BPE merge list (Gemma 4's GGUF, any `tokenizer.json`) kept as text and
//! looked up by the text of a pair.
//!
//! Resolving Gemma 4's 514,906 merges to ids at load takes three vocabulary
//! lookups each (left, right, joined), nearly all cache misses: most of the
//! load time. Kept as text, loading copies the merges into one buffer and
//! makes one table insert each; the merged piece's id is looked up while
//! encoding, only for merges that happen. This is also how llama.cpp applies
//! a GGUF merge list: to two adjacent strings, whatever their ids. (So a
//! merge naming pieces the vocabulary lacks is not refused at load, as
//! Hugging Face would; it can never apply, or its result is skipped.)

use super::piece_table::hash;
use anyhow::{Result, bail};

pub(crate) struct TextMerges {
    /// Each merge's two sides joined ("ab" for "a b"), back to back in rank order.
    text: String,
    /// `ends[rank]`: where that merge's text ends in `text`; it starts where
    /// the previous one ends.
    ends: Vec<u32>,
    /// `left_lens[rank]`: the byte length of that merge's left side.
    left_lens: Vec<u32>,
    /// 0 = empty, otherwise the high half of the joined text's hash above
    /// rank + 1. Length is a power of two, at most half full.
    slots: Vec<u64>,
}

const TAG: u64 = !0xffff_ffff;

/// Ranks are compared as `f32` in the merge loop, exact below 2^24.
pub(crate) const MAX_MERGES: usize = 1 << 24;

impl TextMerges {
    /// Builds the table from merges in rank order; when a merge is listed
    /// twice the first (best) rank is kept. `what` names the list in errors.
    pub(crate) fn from_pairs<'a>(
        merges: impl ExactSizeIterator<Item = Result<(&'a str, &'a str)>>,
        what: &str,
    ) -> Result<TextMerges> {
        let n = merges.len();
        if n >= MAX_MERGES {
            bail!("{what}: {n} merges is more than the {MAX_MERGES} this tokenizer supports");
        }
        let mut table = TextMerges {
            text: String::new(),
            ends: Vec::with_capacity(n),
            left_lens: Vec::with_capacity(n),
            slots: vec![0; (n * 2).next_power_of_two().max(16)],
        };
        for (rank, pair) in merges.enumerate() {
            let (a, b) = pair?;
            let start = table.text.len();
            table.text.push_str(a);
            table.text.push_str(b);
            let end = u32::try_from(table.text.len())
                .map_err(|_| anyhow::anyhow!("{what}: the merges hold more than 4 GiB of text"))?;
            table.ends.push(end);
            // `a` is shorter than the 4 GiB just checked.
            table.left_lens.push(a.len() as u32);
            let joined = &table.text[start..];
            let h = hash(joined.as_bytes());
            let slot = table.find_slot(joined, a.len(), h);
            if table.slots[slot] == 0 {
                table.slots[slot] = (h & TAG) | (rank as u64 + 1);
            }
        }
        Ok(table)
    }

    /// The joined text and left length of merge `rank`.
    fn merge(&self, rank: usize) -> (&str, usize) {
        let start = if rank == 0 {
            0
        } else {
            self.ends[rank - 1] as usize
        };
        (
            &self.text[start..self.ends[rank] as usize],
            self.left_lens[rank] as usize,
        )
    }

    /// The slot holding the merge of `joined` split after `left_len` bytes
    /// (`h` is the hash of `joined`), or the empty slot where it would go.
    fn find_slot(&self, joined: &str, left_len: usize, h: u64) -> usize {
        let mask = self.slots.len() - 1;
        let mut slot = h as usize & mask;
        loop {
            match self.slots[slot] {
                0 => return slot,
                entry
                    if entry & TAG == h & TAG
                        && self.merge(entry as u32 as usize - 1) == (joined, left_len) =>
                {
                    return slot;
                }
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    /// The rank of merging the first `left_len` bytes of `joined` with the
    /// rest, if the list has that merge.
    pub(crate) fn rank(&self, joined: &str, left_len: usize) -> Option<u32> {
        match self.slots[self.find_slot(joined, left_len, hash(joined.as_bytes()))] {
            0 => None,
            entry => Some(entry as u32 - 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(merges: &[(&'static str, &'static str)]) -> TextMerges {
        TextMerges::from_pairs(merges.iter().map(|&m| Ok(m)), "test").unwrap()
    }

    #[test]
    fn ranks_are_found_by_joined_text_and_split() {
        let t = table(&[
            ("a", "b"),
            ("ab", "c"),
            ("a", "bc"),
            ("▁", "ab"),
            ("a", "b"),
        ]);
        assert_eq!(t.rank("ab", 1), Some(0), "the first listing wins");
        assert_eq!(t.rank("abc", 2), Some(1));
        assert_eq!(t.rank("abc", 1), Some(2));
        assert_eq!(t.rank("▁ab", 3), Some(3));
        assert_eq!(t.rank("abc", 0), None);
        assert_eq!(t.rank("ba", 1), None);
        assert_eq!(t.rank("", 0), None);
    }

    #[test]
    fn many_merges_all_found() {
        let texts: Vec<(String, String)> = (0..20_000)
            .map(|i| (format!("p{i}"), format!("q{}", i % 97)))
            .collect();
        let t = TextMerges::from_pairs(
            texts.iter().map(|(a, b)| Ok((a.as_str(), b.as_str()))),
            "test",
        )
        .unwrap();
        for (rank, (a, b)) in texts.iter().enumerate() {
            assert_eq!(t.rank(&format!("{a}{b}"), a.len()), Some(rank as u32));
        }
        assert_eq!(t.rank("p1q2", 2), None);
    }

    #[test]
    fn a_bad_entry_is_reported() {
        let merges = [
            Ok(("a", "b")),
            Err(anyhow::anyhow!("x.gguf: merge 1 is bad")),
        ];
        let err = TextMerges::from_pairs(merges.into_iter(), "x.gguf").err();
        assert!(err.is_some_and(|e| e.to_string().contains("merge 1")));
    }
}
