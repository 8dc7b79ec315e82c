//! The candidates' total order (more likely first, lower id on ties) and
//! the passes over a whole vocabulary: its first maximum and its k best,
//! skipping chunks with nothing above the bar at one vector compare each.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate {
    pub(super) id: u32,
    pub(super) logit: f32,
    /// Probability after the temperature softmax (normalized over the
    /// candidates that survived top-k).
    pub(super) p: f32,
}

/// The total order every filter uses: more likely first, lower id on ties.
pub(super) fn better(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// A candidate ordered so that "greater" means "more likely" (per [`better`]).
#[derive(Clone, Copy)]
pub(super) struct Ranked(Candidate);

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Ranked {}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        better(&other.0, &self.0)
    }
}

/// Puts the k best of `logits` into `cands`, best first, NaN counting as
/// minus infinity. One pass with a bounded min-heap: after the first few
/// thousand logits nearly every one loses a single comparison against the
/// current k-th best, so this is much cheaper than building and selecting
/// 262k candidates; and whole chunks with nothing above the k-th best are
/// passed over with one vector comparison per 8 values.
pub(super) fn collect_top_k(
    logits: &[f32],
    k: usize,
    heap: &mut BinaryHeap<Reverse<Ranked>>,
    cands: &mut Vec<Candidate>,
) {
    heap.clear();
    // The k-th best logit so far. Ids arrive in increasing order, so a
    // newcomer that only ties it ranks below it and can be skipped with
    // one float comparison.
    let mut floor = f32::NEG_INFINITY;
    for (c, chunk) in logits.chunks(SCAN_CHUNK).enumerate() {
        if heap.len() == k && !any_above(chunk, floor) {
            continue;
        }
        for (j, &logit) in chunk.iter().enumerate() {
            let logit = finite_or_low(logit);
            if heap.len() == k && logit <= floor {
                continue;
            }
            let c = Ranked(Candidate {
                id: (c * SCAN_CHUNK + j) as u32,
                logit,
                p: 0.0,
            });
            if heap.len() < k {
                heap.push(Reverse(c));
            } else if let Some(mut worst) = heap.peek_mut() {
                *worst = Reverse(c);
            }
            if heap.len() == k {
                floor = heap.peek().map_or(floor, |w| w.0.0.logit);
            }
        }
    }
    cands.extend(heap.drain().map(|r| r.0.0));
    // A canonical order, so sums and the draw do not depend on the heap's layout.
    cands.sort_unstable_by(better);
}

/// Values the scans over the vocabulary test at a time.
const SCAN_CHUNK: usize = 64;

/// Whether any value is above `floor` (NaN never is). A fold without an
/// early exit, so it compiles to vector compares.
#[inline(always)]
fn any_above(values: &[f32], floor: f32) -> bool {
    values.iter().fold(false, |any, &v| any | (v > floor))
}

/// NaN counts as impossible: minus infinity.
pub(super) fn finite_or_low(l: f32) -> f32 {
    if l.is_nan() { f32::NEG_INFINITY } else { l }
}

/// The first maximum (the lowest id among ties) and its value, NaN
/// counting as impossible (minus infinity); id 0 when every value is.
/// Chunks with nothing above the maximum so far are passed over.
pub(super) fn first_max(logits: &[f32]) -> (usize, f32) {
    let (mut best, mut max) = (0, finite_or_low(logits[0]));
    for (c, chunk) in logits.chunks(SCAN_CHUNK).enumerate() {
        if !any_above(chunk, max) {
            continue;
        }
        for (j, &l) in chunk.iter().enumerate() {
            if l > max {
                (best, max) = (c * SCAN_CHUNK + j, l);
            }
        }
    }
    (best, max)
}

#[cfg(test)]
mod tests {
    use crate::sample::tests::{cfg, survivors};
    use crate::sample::{Rng, Sampler, SamplerConfig};

    use super::*;

    #[test]
    fn top_k_keeps_exactly_k() {
        let logits = [0.5, 2.0, -1.0, 3.0, 1.0, 2.5, 0.0];
        let c = SamplerConfig { top_k: 3, ..cfg() };
        assert_eq!(survivors(c, &logits, &[]), vec![1, 3, 5]);
        // Ties at the boundary go to the lower id.
        let c = SamplerConfig { top_k: 2, ..cfg() };
        assert_eq!(survivors(c, &[1.0, 2.0, 1.0, 1.0], &[]), vec![0, 1]);
        // k at or above the vocabulary keeps everything.
        let c = SamplerConfig { top_k: 10, ..cfg() };
        assert_eq!(survivors(c, &logits, &[]).len(), 7);
    }

    #[test]
    fn top_k_on_a_large_vocabulary_matches_a_full_sort() {
        // Coarsely quantized logits so that many ties straddle the cut.
        let mut r = Rng::new(11);
        let logits: Vec<f32> = (0..5000)
            .map(|_| (r.next_f64() * 50.0).floor() as f32)
            .collect();
        for k in [1usize, 7, 100, 4999] {
            let got = survivors(SamplerConfig { top_k: k, ..cfg() }, &logits, &[]);
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            let mut want = order[..k].to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "k = {k}");
        }
    }

    /// Top-k and the maximum over a vocabulary in many scan chunks: the k
    /// best by (logit, lower id) as a full sort has them, with NaN never
    /// chosen, ties at the cut and the best value in a late chunk; a
    /// penalty that changes nothing (ids past the vocabulary) takes the
    /// penalized copy's path and must agree.
    #[test]
    fn top_k_over_many_chunks_matches_a_full_sort() {
        let mut r = Rng::new(9);
        let n = 50 * SCAN_CHUNK + 17;
        let mut logits: Vec<f32> = (0..n)
            .map(|_| (r.next_f64() * 4.0).floor() as f32)
            .collect();
        for i in (3..n).step_by(97) {
            logits[i] = f32::NAN;
        }
        logits[n - 5] = 9.0;
        logits[40 * SCAN_CHUNK + 3] = f32::NAN;
        for k in [1usize, 7, 40, 200] {
            let mut order: Vec<usize> = (0..n).filter(|&i| !logits[i].is_nan()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let want: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
            for penalty in [1.0, 1.5] {
                let c = SamplerConfig {
                    top_k: k,
                    repeat_penalty: penalty,
                    ..cfg()
                };
                let mut s = Sampler::new(c, 0);
                assert_eq!(s.filter(&logits, &[n as u32 + 1]), None);
                let got: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
                assert_eq!(got, want, "k {k}, penalty {penalty}");
            }
        }
        assert_eq!(first_max(&logits), (n - 5, 9.0));
        logits[n - 5] = 3.0;
        let first_three = logits.iter().position(|&l| l == 3.0).unwrap();
        assert_eq!(first_max(&logits), (first_three, 3.0));
    }
}
