//! The logits of one batched step, every entry's rows in one buffer.
//!
//! The LM head writes all wanted rows of a step into one buffer (a
//! megabyte per row for Gemma 3's vocabulary). Where each entry's rows lie
//! together in their own order, which is every decode step, the entries are
//! handed out as disjoint slices of that buffer instead of copies: in a
//! 4-stream server profile, copying them out took 1.7% of all samples on
//! the engine thread, time its workers spent waiting.

use std::ops::Range;

pub struct StepLogits {
    data: Vec<f32>,
    /// Each entry's values in `data`, in entry order (empty for an entry
    /// that wanted none).
    spans: Vec<Range<usize>>,
}

impl StepLogits {
    /// `logits` holds rows of `width` values; entry i wants rows
    /// `rows[i]`, in that order. The rows are kept in place where every
    /// entry's rows are consecutive in the buffer; otherwise they are
    /// gathered into a new buffer in entry order.
    pub fn new(logits: Vec<f32>, width: usize, rows: &[Vec<usize>]) -> StepLogits {
        let consecutive = |r: &Vec<usize>| r.windows(2).all(|w| w[1] == w[0] + 1);
        if rows.iter().all(consecutive) {
            let spans = rows
                .iter()
                .map(|r| match (r.first(), r.last()) {
                    (Some(&first), Some(&last)) => first * width..(last + 1) * width,
                    _ => 0..0,
                })
                .collect();
            return StepLogits {
                data: logits,
                spans,
            };
        }
        let mut data = Vec::with_capacity(rows.iter().map(Vec::len).sum::<usize>() * width);
        let mut spans = Vec::with_capacity(rows.len());
        for r in rows {
            let start = data.len();
            for &row in r {
                data.extend_from_slice(&logits[row * width..(row + 1) * width]);
            }
            spans.push(start..data.len());
        }
        StepLogits { data, spans }
    }

    /// Entries in the step.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Every entry's logits, mutable (samplers mask and scale them in
    /// place), in entry order.
    pub fn entries_mut(&mut self) -> Vec<&mut [f32]> {
        let mut by_start: Vec<usize> = (0..self.spans.len())
            .filter(|&i| !self.spans[i].is_empty())
            .collect();
        by_start.sort_by_key(|&i| self.spans[i].start);
        let mut out: Vec<&mut [f32]> = (0..self.spans.len()).map(|_| Default::default()).collect();
        let mut rest: &mut [f32] = &mut self.data;
        let mut at = 0;
        for i in by_start {
            let span = &self.spans[i];
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(span.start - at);
            let (mine, tail) = tail.split_at_mut(span.len());
            out[i] = mine;
            rest = tail;
            at = span.end;
        }
        out
    }

    /// The buffer, for the engine to write the next step's logits over.
    pub fn into_buffer(self) -> Vec<f32> {
        self.data
    }

    /// Every entry's logits as a vector of its own; one entry that is the
    /// whole buffer is not copied.
    pub fn into_entries(self) -> Vec<Vec<f32>> {
        if let [only] = &self.spans[..]
            && *only == (0..self.data.len())
        {
            return vec![self.data];
        }
        self.spans
            .iter()
            .map(|span| self.data[span.clone()].to_vec())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row r of width 2 holds r and r + 0.5.
    fn rows(n: usize) -> Vec<f32> {
        (0..n).flat_map(|r| [r as f32, r as f32 + 0.5]).collect()
    }

    #[test]
    fn entries_are_their_rows_in_place_or_gathered() {
        let wanted = vec![vec![2], vec![], vec![0, 1], vec![3]];
        let mut step = StepLogits::new(rows(4), 2, &wanted);
        let firsts: Vec<Vec<f32>> = step.entries_mut().iter().map(|e| e.to_vec()).collect();
        assert_eq!(
            firsts,
            vec![
                vec![2.0, 2.5],
                vec![],
                vec![0.0, 0.5, 1.0, 1.5],
                vec![3.0, 3.5]
            ]
        );
        // Kept in place: a write shows in the buffer.
        step.entries_mut()[3][0] = 9.0;
        assert_eq!(step.data[6], 9.0);
        // A bulk run's last row before its others: gathered in order.
        let wanted = vec![vec![1, 2, 0]];
        let step = StepLogits::new(rows(3), 2, &wanted);
        assert_eq!(
            step.into_entries(),
            vec![vec![1.0, 1.5, 2.0, 2.5, 0.0, 0.5]]
        );
        let whole = StepLogits::new(rows(2), 2, &[vec![0, 1]]);
        assert_eq!(whole.into_entries(), vec![rows(2)]);
    }
}
