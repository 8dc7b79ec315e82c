//! Choosing the next token from logits.
//!
//! The pipeline, in order: repetition penalty → top-k → softmax at the
//! temperature → top-p → min-p → a seeded random draw. Temperature 0 means
//! greedy (argmax, ties to the lowest id).
//!
//! Reproducibility: the random generator is implemented here (xoshiro256**
//! seeded through splitmix64), and every filter is defined by a total order
//! (logit descending, then id ascending), so a seed gives the same tokens
//! whatever the Rust or crate versions — no result depends on how an
//! unstable sort or selection happens to arrange equal elements.
//!
//! - this module: [`Sampler`], its buffers, the pipeline in that order, and
//!   the draw;
//! - `config`: [`SamplerConfig`] and its validation;
//! - `scan`: the candidates' order, and the argmax and top-k over the
//!   vocabulary;
//! - `filters`: the penalty, the softmax, top-p, and back to id order;
//! - `distribution`: [`Distribution`], what one step would draw;
//! - `rng`: [`Rng`], the seeded generator.

mod config;
mod distribution;
mod filters;
mod rng;
mod scan;

pub use config::SamplerConfig;
pub use distribution::Distribution;
pub use rng::Rng;

use scan::{Candidate, Ranked, collect_top_k, finite_or_low, first_max};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Draws token ids from logits. Keeps its buffers between calls, so a
/// generation loop does not allocate per token.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Penalized logits, one per id (only when a penalty applies).
    work: Vec<f32>,
    /// Survivors of the filters.
    cands: Vec<Candidate>,
    /// Top-k selection: the worst kept candidate on top.
    heap: BinaryHeap<Reverse<Ranked>>,
    /// Distinct recent ids, for the penalty.
    recent: Vec<u32>,
    /// Per id, its candidate's index (or `NO_CANDIDATE`) while restoring
    /// id order.
    slots: Vec<u32>,
    /// The candidates in id order, being built.
    sorted: Vec<Candidate>,
}

impl Sampler {
    /// A sampler with its own random stream. Call [`SamplerConfig::validate`]
    /// first on settings that come from a user.
    pub fn new(cfg: SamplerConfig, seed: u64) -> Sampler {
        Sampler {
            cfg,
            rng: Rng::new(seed),
            work: Vec::new(),
            cands: Vec::new(),
            heap: BinaryHeap::new(),
            recent: Vec::new(),
            slots: Vec::new(),
            sorted: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token. `recent_tokens` is the context so far (only its
    /// last `repeat_last_n` entries matter). NaN logits are treated as
    /// impossible. Panics on empty `logits`, which is a caller bug.
    pub fn sample(&mut self, logits: &[f32], recent_tokens: &[u32]) -> u32 {
        self.distribution(logits, recent_tokens).draw()
    }

    /// The distribution [`Sampler::sample`] would draw from for these
    /// logits and this context, after the penalty and every filter; drawing
    /// from it is exactly `sample` (the same random numbers are used).
    /// Panics on empty `logits`, which is a caller bug.
    pub fn distribution(&mut self, logits: &[f32], recent_tokens: &[u32]) -> Distribution<'_> {
        assert!(
            !logits.is_empty(),
            "Sampler::distribution called with no logits"
        );
        let certain = self.filter(logits, recent_tokens);
        Distribution {
            sampler: self,
            certain,
        }
    }

    /// Runs every filter, leaving the survivors (with probabilities) in
    /// `self.cands`. Returns the answer directly when no draw is needed.
    fn filter(&mut self, logits: &[f32], recent: &[u32]) -> Option<u32> {
        // Greedy with no penalty to apply reads the logits where they are:
        // the copy below is a megabyte for Gemma's vocabulary, per row of
        // every verify step (`distribution` took 3.5% of a greedy
        // summary's samples with speculation with the copy, 2.9% without:
        // what is left is the scan).
        let no_penalty = self.cfg.repeat_penalty == 1.0 || self.cfg.repeat_last_n == 0;
        if self.cfg.temperature == 0.0 && no_penalty {
            return Some(first_max(logits).0 as u32);
        }
        // With a penalty, a penalized copy of the logits; without one,
        // the logits where they are (the copy was a megabyte written and
        // read again per sampled token; with the scans below it was 7.6% of
        // a 4-stream server's samples at temperature 0.8).
        let penalized = !no_penalty;
        if penalized {
            self.work.clear();
            self.work.extend(logits.iter().map(|&l| finite_or_low(l)));
            self.penalize(recent);
        }
        let source: &[f32] = if penalized { &self.work } else { logits };

        let (best, max) = first_max(source);
        // Greedy, or a degenerate row (all -inf, or some +inf) where the
        // softmax is undefined: the best logit wins.
        if self.cfg.temperature == 0.0 || !max.is_finite() {
            return Some(best as u32);
        }

        self.cands.clear();
        let k = self.cfg.top_k;
        if k > 0 && k < source.len() {
            collect_top_k(source, k, &mut self.heap, &mut self.cands);
        } else {
            let all = source.iter().enumerate();
            self.cands.extend(all.map(|(i, &logit)| Candidate {
                id: i as u32,
                logit: finite_or_low(logit),
                p: 0.0,
            }));
        }

        self.softmax(max);
        if self.cfg.top_p < 1.0 {
            self.top_p();
        }
        if self.cfg.min_p > 0.0 {
            let p_max = self.cands.iter().map(|c| c.p).fold(0.0, f32::max);
            let threshold = self.cfg.min_p * p_max;
            self.cands.retain(|c| c.p >= threshold);
        }
        None
    }

    fn draw(&mut self) -> u32 {
        let total: f64 = self.cands.iter().map(|c| f64::from(c.p)).sum();
        let mut u = self.rng.next_f64() * total;
        let mut last = self.cands[0].id;
        for c in &self.cands {
            if c.p <= 0.0 {
                continue;
            }
            let p = f64::from(c.p);
            if u < p {
                return c.id;
            }
            u -= p;
            last = c.id;
        }
        // Only reached through rounding at the very top of the range.
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn cfg() -> SamplerConfig {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
        }
    }

    /// Logits whose softmax at temperature 1 is exactly `probs`.
    pub(super) fn logits_for(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    /// Ids that survive the filters, sorted.
    pub(super) fn survivors(c: SamplerConfig, logits: &[f32], recent: &[u32]) -> Vec<u32> {
        let mut s = Sampler::new(c, 0);
        assert_eq!(
            s.filter(logits, recent),
            None,
            "expected a draw, not a direct answer"
        );
        let mut ids: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn temperature_zero_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplerConfig::greedy(), 1);
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9], &[]), 1);
        assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -1.0], &[]), 1);
        // Greedy ignores the other filters.
        let c = SamplerConfig {
            temperature: 0.0,
            top_k: 1,
            top_p: 0.1,
            ..cfg()
        };
        assert_eq!(Sampler::new(c, 9).sample(&[0.0, 0.5, 0.2], &[]), 1);
    }

    #[test]
    fn degenerate_rows_do_not_break() {
        let mut s = Sampler::new(cfg(), 3);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 4], &[]), 0);
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0], &[]), 1);
        for _ in 0..100 {
            assert_eq!(s.sample(&[f32::NEG_INFINITY, 0.0, f32::NAN], &[]), 1);
        }
    }

    #[test]
    fn penalty_changes_the_greedy_choice() {
        let c = SamplerConfig {
            repeat_penalty: 1.5,
            ..SamplerConfig::greedy()
        };
        let c = SamplerConfig {
            repeat_last_n: 8,
            ..c
        };
        let mut s = Sampler::new(c, 0);
        assert_eq!(s.sample(&[3.0, 2.5], &[]), 0);
        assert_eq!(s.sample(&[3.0, 2.5], &[0]), 1);
    }

    #[test]
    fn greedy_picks_the_first_maximum_and_never_a_nan() {
        // With and without a penalty that touches nothing (id 9 is past
        // these rows), the same answers: the copy-free path and the
        // penalized copy agree.
        let plain = SamplerConfig::greedy();
        let penalized = SamplerConfig {
            repeat_penalty: 1.5,
            repeat_last_n: 8,
            ..plain
        };
        for c in [plain, penalized] {
            let mut s = Sampler::new(c, 0);
            assert_eq!(s.sample(&[f32::NAN, 1.0, 3.0, 3.0], &[9]), 2);
            assert_eq!(s.sample(&[f32::NAN, f32::NAN], &[9]), 0);
            assert_eq!(s.sample(&[-1.0, f32::NAN, -0.5], &[9]), 2);
            assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY], &[9]), 0);
        }
    }

    fn draws(c: SamplerConfig, seed: u64, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(c, seed);
        (0..n).map(|_| s.sample(logits, &[])).collect()
    }

    #[test]
    fn same_seed_same_draws_different_seed_different_draws() {
        let logits = vec![0.0f32; 100];
        let a = draws(cfg(), 1234, &logits, 50);
        assert_eq!(a, draws(cfg(), 1234, &logits, 50));
        assert_ne!(a, draws(cfg(), 1235, &logits, 50));
        // Every draw is a valid id and the uniform row spreads them out.
        assert!(a.iter().all(|&i| i < 100));
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 30, "{distinct:?}");
    }

    fn frequency_of_zero(c: SamplerConfig, logits: &[f32], n: usize) -> f64 {
        let d = draws(c, 99, logits, n);
        d.iter().filter(|&&i| i == 0).count() as f64 / n as f64
    }

    #[test]
    fn empirical_frequencies_follow_the_distribution() {
        // sd of the estimate at n = 20000 is about 0.0032; allow ~5 sd.
        let logits = logits_for(&[0.7, 0.3]);
        let f = frequency_of_zero(cfg(), &logits, 20_000);
        assert!((f - 0.7).abs() < 0.016, "frequency {f}");
        // Temperature 0.5 squares the odds: 0.49 / (0.49 + 0.09).
        let f = frequency_of_zero(
            SamplerConfig {
                temperature: 0.5,
                ..cfg()
            },
            &logits,
            20_000,
        );
        assert!((f - 0.49 / 0.58).abs() < 0.016, "frequency {f}");
        // Temperature 2 flattens: sqrt(0.7) / (sqrt(0.7) + sqrt(0.3)).
        let want = 0.7f64.sqrt() / (0.7f64.sqrt() + 0.3f64.sqrt());
        let f = frequency_of_zero(
            SamplerConfig {
                temperature: 2.0,
                ..cfg()
            },
            &logits,
            20_000,
        );
        assert!((f - want).abs() < 0.016, "frequency {f}");
    }

    #[test]
    fn does_not_reallocate_between_calls() {
        let logits = vec![0.0f32; 1000];
        let mut s = Sampler::new(SamplerConfig { top_k: 10, ..cfg() }, 0);
        s.sample(&logits, &[1, 2, 3]);
        let before = (s.cands.as_ptr(), s.work.as_ptr(), s.heap.capacity());
        for _ in 0..10 {
            s.sample(&logits, &[1, 2, 3]);
        }
        assert_eq!(
            (s.cands.as_ptr(), s.work.as_ptr(), s.heap.capacity()),
            before
        );
    }
}
