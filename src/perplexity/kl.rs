//! KL divergence of a run's next-token distribution from a saved base.
//!
//! The base file keeps, per scored position, only the base's top-K
//! log-probabilities and the log of the mass left outside them (see
//! [`super::base_file`]). The divergence is therefore taken between the two
//! distributions coarsened to K + 1 buckets — the base's top-K tokens one
//! by one, and "everything else" as one bucket:
//!
//! `KL_K = Σ_{i in top-K} p_i ln(p_i / q_i) + p_rest ln(p_rest / q_rest)`.
//!
//! By the chain rule of KL divergence the exact value is
//! `KL = KL_K + p_rest · KL(P | rest ‖ Q | rest)`, the last factor being the
//! divergence between the two distributions restricted to the tail and
//! renormalized. So `KL_K` never exceeds the exact KL, equals it when the
//! tail holds no mass, and misses at most `p_rest` times the tail's own
//! divergence; the mean `p_rest` is printed with the result so that the
//! size of the coarsened part is visible.

use super::base_file::BasePosition;
use super::logprobs::{argmax, log_mass_outside};

/// Below this a log-probability is treated as this: `exp` in f32 is zero
/// under about -103.9, so smaller values carry no information.
const LOG_PROB_FLOOR: f64 = -104.0;

/// `KL_K(base ‖ run)` at one position; `run` is the run's log-softmax row.
pub fn bucket_kl(base: &BasePosition, run: &[f32]) -> f64 {
    let mut kl = 0.0;
    for &(id, base_lp) in &base.top {
        let base_lp = f64::from(base_lp);
        let run_lp = f64::from(run[id as usize]).max(LOG_PROB_FLOOR);
        kl += base_lp.exp() * (base_lp - run_lp);
    }
    let base_rest = f64::from(base.log_rest);
    if base_rest > LOG_PROB_FLOOR {
        let ids: Vec<u32> = base.top.iter().map(|&(id, _)| id).collect();
        let run_rest = f64::from(log_mass_outside(run, &ids)).max(LOG_PROB_FLOOR);
        kl += base_rest.exp() * (base_rest - run_rest);
    }
    kl
}

/// KL, top-1 agreement and tail mass over all scored positions.
#[derive(Clone, Debug, Default)]
pub struct KlStats {
    per_position: Vec<f64>,
    top1_agreements: usize,
    base_tail_mass: f64,
}

impl KlStats {
    /// Compares one position of the run (its log-softmax row) with the base.
    pub fn add(&mut self, base: &BasePosition, run: &[f32]) {
        self.per_position.push(bucket_kl(base, run));
        if base.top.first().map(|&(id, _)| id) == Some(argmax(run)) {
            self.top1_agreements += 1;
        }
        self.base_tail_mass += f64::from(base.log_rest).exp();
    }

    pub fn count(&self) -> usize {
        self.per_position.len()
    }

    pub fn mean(&self) -> f64 {
        mean(&self.per_position)
    }

    /// The 99th percentile by nearest rank: the smallest value with at
    /// least 99% of positions at or below it.
    pub fn percentile_99(&self) -> f64 {
        if self.per_position.is_empty() {
            return 0.0;
        }
        let mut sorted = self.per_position.clone();
        sorted.sort_by(f64::total_cmp);
        let rank = (0.99 * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1]
    }

    pub fn top1_agreements(&self) -> usize {
        self.top1_agreements
    }

    /// Percent of positions where the run's most likely token is the base's.
    pub fn top1_percent(&self) -> f64 {
        if self.per_position.is_empty() {
            return 0.0;
        }
        100.0 * self.top1_agreements as f64 / self.per_position.len() as f64
    }

    /// The mean probability the base left outside its top-K: the part of
    /// the distribution the KL sees only as one bucket.
    pub fn mean_base_tail_mass(&self) -> f64 {
        if self.per_position.is_empty() {
            return 0.0;
        }
        self.base_tail_mass / self.per_position.len() as f64
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}
