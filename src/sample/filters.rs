//! The steps between the logits and the draw: the repetition penalty, the
//! softmax at the temperature, top-p's cut, and the candidates put back in
//! id order (top-k is the scan in `scan`, min-p a threshold in `filter`).

use super::Sampler;
use super::scan::{Candidate, better};

/// A `slots` entry for an id with no candidate.
const NO_CANDIDATE: u32 = u32::MAX;

impl Sampler {
    /// llama.cpp's repetition penalty, once per distinct recent id: a
    /// positive logit is divided by the penalty and a negative one
    /// multiplied, so a penalty above 1 always makes the token less likely.
    pub(super) fn penalize(&mut self, recent: &[u32]) {
        // (`filter` skips the copy this works on when it would do nothing.)
        let penalty = self.cfg.repeat_penalty;
        if penalty == 1.0 || self.cfg.repeat_last_n == 0 {
            return;
        }
        let window = &recent[recent.len().saturating_sub(self.cfg.repeat_last_n)..];
        self.recent.clear();
        self.recent.extend_from_slice(window);
        self.recent.sort_unstable();
        self.recent.dedup();
        for &id in &self.recent {
            // Ids past the vocabulary (a caller's mistake) are ignored.
            if let Some(l) = self.work.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }

    pub(super) fn softmax(&mut self, max: f32) {
        let inv_t = 1.0 / self.cfg.temperature;
        let mut total = 0.0f64;
        for c in &mut self.cands {
            c.p = ((c.logit - max) * inv_t).exp();
            total += f64::from(c.p);
        }
        let inv_total = (1.0 / total) as f32;
        for c in &mut self.cands {
            c.p *= inv_total;
        }
    }

    /// Keeps the shortest most-likely prefix (in the [`better`] order) whose
    /// probability reaches top-p, in expected O(n) without sorting: a
    /// quickselect that halves the range around its median and keeps the
    /// side where the cut must lie, judged by the mass on the better side.
    ///
    /// Probabilities are summed as integers (units of 2^-32), so every sum is
    /// exact and the cut cannot depend on the order in which selection
    /// happened to leave the elements.
    pub(super) fn top_p(&mut self) {
        // Adding 0.5 and truncating rounds like .round() for these
        // non-negative values, without a libm call per element.
        let weight = |c: &Candidate| (f64::from(c.p) * 4_294_967_296.0 + 0.5) as u64;
        let total: u64 = self.cands.iter().map(weight).sum();
        let target = (f64::from(self.cfg.top_p) * total as f64).ceil() as u64;
        // Invariant: the cut lies in lo..=hi and cands[..lo] (all better than
        // cands[lo..]) hold `target - need` of the mass.
        let (mut lo, mut hi, mut need) = (0, self.cands.len(), target);
        let cut = loop {
            if hi - lo <= 32 {
                self.cands[lo..hi].sort_unstable_by(better);
                let mut acc = 0;
                let mut end = hi;
                for (i, c) in self.cands[lo..hi].iter().enumerate() {
                    acc += weight(c);
                    if acc >= need {
                        end = lo + i + 1;
                        break;
                    }
                }
                break end;
            }
            let mid = lo + (hi - lo) / 2;
            self.cands[lo..hi].select_nth_unstable_by(mid - lo, better);
            let left: u64 = self.cands[lo..mid].iter().map(weight).sum();
            let pivot = weight(&self.cands[mid]);
            if left >= need {
                hi = mid;
            } else if left + pivot >= need {
                break mid + 1;
            } else {
                need -= left + pivot;
                lo = mid + 1;
            }
        };
        self.cands.truncate(cut);
        self.canonical_order();
    }

    /// Puts the candidates in id order, which does not depend on how
    /// selection left them: a sort for small sets, and for large ones a pass
    /// over the vocabulary (O(n) instead of O(n log n)).
    pub(super) fn canonical_order(&mut self) {
        if self.cands.len() <= 4096 {
            self.cands.sort_unstable_by_key(|c| c.id);
            return;
        }
        let ids = self.cands.iter().map(|c| c.id as usize + 1).max();
        self.slots.clear();
        self.slots.resize(ids.unwrap_or(0), NO_CANDIDATE);
        for (i, c) in self.cands.iter().enumerate() {
            self.slots[c.id as usize] = i as u32;
        }
        self.sorted.clear();
        let in_id_order = self.slots.iter().filter(|&&i| i != NO_CANDIDATE);
        self.sorted
            .extend(in_id_order.map(|&i| self.cands[i as usize]));
        std::mem::swap(&mut self.cands, &mut self.sorted);
    }
}

#[cfg(test)]
mod tests {
    use crate::sample::tests::{cfg, logits_for, survivors};
    use crate::sample::{Rng, Sampler, SamplerConfig};

    #[test]
    fn top_p_cuts_at_the_first_prefix_reaching_p() {
        let logits = logits_for(&[0.05, 0.5, 0.15, 0.3]);
        let keep = |p: f32| survivors(SamplerConfig { top_p: p, ..cfg() }, &logits, &[]);
        assert_eq!(keep(0.4), vec![1]);
        assert_eq!(keep(0.75), vec![1, 3]);
        assert_eq!(keep(0.9), vec![1, 2, 3]);
        assert_eq!(keep(0.99), vec![0, 1, 2, 3]);
        assert_eq!(keep(1.0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn top_p_on_a_large_vocabulary_matches_a_full_sort() {
        // Logits from a fixed generator; 20000 flat ones make the kept set
        // large enough for the O(vocab) reordering path.
        for (n, spread) in [(5000usize, 8.0f64), (20_000, 1.0)] {
            let mut r = Rng::new(5);
            let logits: Vec<f32> = (0..n).map(|_| (r.next_f64() * spread) as f32).collect();
            for top_p in [0.1f32, 0.5, 0.9, 0.999] {
                let mut s = Sampler::new(SamplerConfig { top_p, ..cfg() }, 0);
                assert_eq!(s.filter(&logits, &[]), None);
                let got: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
                assert!(got.windows(2).all(|w| w[0] < w[1]), "survivors in id order");
                // Reference: sort everything, accumulate in f64.
                let max = logits.iter().cloned().fold(f32::MIN, f32::max);
                let w: Vec<f64> = logits.iter().map(|&l| f64::from((l - max).exp())).collect();
                let z: f64 = w.iter().sum();
                let mut order: Vec<usize> = (0..logits.len()).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                let mut sum = 0.0;
                let mut want = Vec::new();
                for &i in &order {
                    want.push(i as u32);
                    sum += w[i] / z;
                    if sum >= f64::from(top_p) {
                        break;
                    }
                }
                want.sort_unstable();
                // Random logits put no cumulative sum within rounding of the target.
                assert_eq!(got, want, "n {n}, top_p {top_p}");
            }
        }
    }

    #[test]
    fn min_p_threshold_is_relative_to_the_best() {
        let logits = logits_for(&[0.5, 0.3, 0.15, 0.05]);
        let keep = |m: f32| survivors(SamplerConfig { min_p: m, ..cfg() }, &logits, &[]);
        assert_eq!(keep(0.2), vec![0, 1, 2]); // threshold 0.1
        assert_eq!(keep(0.5), vec![0, 1]); // threshold 0.25
        assert_eq!(keep(0.61), vec![0]); // threshold 0.305
        assert_eq!(keep(1.0), vec![0]);
    }

    #[test]
    fn penalty_pushes_positive_and_negative_logits_down() {
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            ..cfg()
        };
        let mut s = Sampler::new(c, 0);
        s.filter(&[2.0, -2.0, 1.0, 0.5], &[0, 1, 0, 0]);
        let logit = |s: &Sampler, id: u32| s.cands.iter().find(|c| c.id == id).map(|c| c.logit);
        assert_eq!(
            logit(&s, 0),
            Some(1.0),
            "positive logit divided once, not per repeat"
        );
        assert_eq!(logit(&s, 1), Some(-4.0), "negative logit multiplied");
        assert_eq!(logit(&s, 2), Some(1.0), "unseen token untouched");
        // Only the last n tokens count.
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            repeat_last_n: 1,
            ..cfg()
        };
        let mut s = Sampler::new(c, 0);
        s.filter(&[2.0, -2.0, 1.0, 0.5], &[0, 1, 3]);
        assert_eq!(logit(&s, 0), Some(2.0));
        assert_eq!(logit(&s, 3), Some(0.25));
        // Ids past the vocabulary are ignored rather than panicking.
        s.filter(&[2.0, -2.0], &[99]);
    }

    #[test]
    fn filters_compose_in_order() {
        // top-k 3 (ties to the lower id) renormalizes over {0,1,2}: 0.5,
        // 0.375, 0.125. min-p 0.3 then cuts at 0.15 → {0, 1}; top-p 0.6 needs
        // {0, 1}; top-p 0.45 only {0}. Without top-k the numbers differ.
        let logits = logits_for(&[0.4, 0.3, 0.1, 0.1, 0.1]);
        let c = SamplerConfig {
            top_k: 3,
            min_p: 0.3,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0, 1]);
        let c = SamplerConfig {
            top_k: 3,
            top_p: 0.6,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0, 1]);
        let c = SamplerConfig {
            top_k: 3,
            top_p: 0.45,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0]);
        // Without top-k, p(0) = 0.4 < 0.45, so top-p needs two tokens.
        let c = SamplerConfig {
            top_p: 0.45,
            ..cfg()
        };
        assert_eq!(survivors(c, &logits, &[]), vec![0, 1]);
    }
}
