//! How many drafted tokens to verify in the next step.
//!
//! A step over `1 + k` tokens (the sampled token and `k` drafted ones)
//! costs `t(1) · (1 + c·k)` where `c` is the extra cost of one more token
//! relative to a one-token step (the m-curve's slope). If each drafted
//! token is accepted with probability `α` given that the ones before it
//! were, the step yields `1 + α + … + α^k = (1 − α^(k+1)) / (1 − α)` tokens.
//! The policy picks the `k` that maximizes tokens per unit of time,
//! `(1 − α^(k+1)) / ((1 − α)(1 + c·k))`, which is 0 (no draft: a plain
//! one-token step) whenever `α ≤ c`: drafting cannot then pay for itself.
//!
//! `α` is estimated per length of the n-gram match that produced the draft
//! (a 1-token match is a much weaker hint than an 8-token one), from recent
//! verifications; `c` is measured from the steps' own timings, so the same
//! policy drafts long on an engine whose small batches cost little and
//! stops drafting on one whose cost grows with every token (the reference
//! engine).

/// Most tokens drafted for one step: the verify step feeds `1 + k ≤ 9`
/// tokens, where the engine still streams each weight once.
pub const MAX_DRAFT: usize = 8;

/// Each match length (1 ..= `ngram::MAX_N`) keeps its own acceptance
/// estimate.
const BUCKETS: usize = super::ngram::MAX_N;

/// Weight of older evidence after each new verification of a bucket: about
/// the last ten drafts of that kind count.
const DECAY: f64 = 0.9;

/// Per decode step, every estimate drifts back toward its prior by this
/// much, so a kind of match that stopped being drafted (its `α` fell below
/// `c`) is tried again now and then when the text may have changed.
const IDLE_DECAY: f64 = 0.98;

/// Prior acceptance per match length 1 ..= 8, each worth
/// [`PRIOR_WEIGHT`] observations: about what the default model showed on
/// documents, code and free text (tools/bench_spec.py) once the estimates
/// had settled, so that a long match is drafted from its first occurrence
/// and a one-token match only once it has proved itself.
const PRIOR_RATE: [f64; BUCKETS] = [0.3, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8];
const PRIOR_WEIGHT: f64 = 3.0;

/// The m-curve slope assumed before any step has been timed.
pub const PRIOR_STEP_COST: f64 = 0.1;

/// The slope is measured against the time of a one-token step, which
/// changes as the context grows and as other work comes and goes on the
/// machine: when this many steps in a row carried drafts, the next one is
/// a plain step to time it again (at most one step in 32 without a draft).
const RETIME_AFTER: usize = 32;

#[derive(Clone, Copy, Debug, Default)]
struct Acceptance {
    hits: f64,
    misses: f64,
}

impl Acceptance {
    fn rate(&self, prior: f64) -> f64 {
        (self.hits + prior * PRIOR_WEIGHT) / (self.hits + self.misses + PRIOR_WEIGHT)
    }
}

/// Exponentially weighted mean seconds of the steps over `m` tokens.
#[derive(Clone, Copy, Debug, Default)]
struct Timing {
    weight: f64,
    mean: f64,
}

impl Timing {
    fn add(&mut self, secs: f64) {
        // The first observations count fully; later ones with weight 1/16,
        // so a burst of other work on a shared machine fades out.
        self.weight = (self.weight + 1.0).min(16.0);
        self.mean += (secs - self.mean) / self.weight;
    }
}

/// The draft-length policy of one sequence.
#[derive(Clone, Debug)]
pub struct DraftPolicy {
    max_draft: usize,
    acceptance: [Acceptance; BUCKETS],
    /// Index m − 1: steps over m = 1 ..= 1 + MAX_DRAFT tokens.
    timings: [Timing; MAX_DRAFT + 1],
    /// Fixed slope instead of the measured one (tests, benchmarks).
    fixed_cost: Option<f64>,
    /// Steps since the last one-token step.
    since_plain: usize,
}

impl Default for DraftPolicy {
    fn default() -> Self {
        DraftPolicy::new(MAX_DRAFT)
    }
}

fn bucket(match_len: usize) -> usize {
    match_len.clamp(1, BUCKETS) - 1
}

impl DraftPolicy {
    /// A policy drafting at most `max_draft` tokens (clamped to
    /// 1 ..= [`MAX_DRAFT`]).
    pub fn new(max_draft: usize) -> DraftPolicy {
        DraftPolicy {
            max_draft: max_draft.clamp(1, MAX_DRAFT),
            acceptance: [Acceptance::default(); BUCKETS],
            timings: [Timing::default(); MAX_DRAFT + 1],
            fixed_cost: None,
            since_plain: 0,
        }
    }

    /// Uses `c` as the m-curve slope instead of measuring it.
    pub fn with_fixed_step_cost(mut self, c: f64) -> DraftPolicy {
        self.fixed_cost = Some(c.max(0.0));
        self
    }

    /// The estimated probability that a token drafted from a match of
    /// `match_len` tokens is accepted.
    pub fn acceptance(&self, match_len: usize) -> f64 {
        let b = bucket(match_len);
        self.acceptance[b].rate(PRIOR_RATE[b])
    }

    /// The extra cost of one more token in a step, relative to a one-token
    /// step: a least-squares fit through the origin of
    /// `t(m) / t(1) − 1` against `m − 1` over the step sizes timed so far,
    /// each weighted by how often it was seen.
    pub fn step_cost(&self) -> f64 {
        if let Some(c) = self.fixed_cost {
            return c;
        }
        let one = self.timings[0];
        if one.weight == 0.0 || one.mean <= 0.0 {
            return PRIOR_STEP_COST;
        }
        // The prior enters as one observation at m = 2.
        let (mut num, mut den) = (PRIOR_STEP_COST, 1.0);
        for (i, t) in self.timings.iter().enumerate().skip(1) {
            let extra = i as f64;
            num += t.weight * extra * (t.mean / one.mean - 1.0);
            den += t.weight * extra * extra;
        }
        (num / den).max(0.0)
    }

    /// How many of the `available` drafted tokens from a match of
    /// `match_len` tokens to verify: 0 means a plain one-token step.
    pub fn draft_len(&self, match_len: usize, available: usize) -> usize {
        if self.fixed_cost.is_none()
            && (self.timings[0].weight == 0.0 || self.since_plain >= RETIME_AFTER)
        {
            // Without a recent one-token step the slope has no base.
            return 0;
        }
        let alpha = self.acceptance(match_len);
        let c = self.step_cost();
        let limit = available.min(self.max_draft);
        let mut best = (0, 1.0);
        // Expected tokens from a step with k drafts: 1 + α + … + α^k.
        let (mut expected, mut power) = (1.0, 1.0);
        for k in 1..=limit {
            power *= alpha;
            expected += power;
            let rate = expected / (1.0 + c * k as f64);
            if rate > best.1 {
                best = (k, rate);
            }
        }
        best.0
    }

    /// Records a verification: `drafted` tokens from a match of
    /// `match_len` tokens, of which the first `accepted` were taken.
    /// Tokens after the first rejected one were never judged and count for
    /// nothing.
    pub fn record(&mut self, match_len: usize, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let a = &mut self.acceptance[bucket(match_len)];
        a.hits = a.hits * DECAY + accepted as f64;
        a.misses = a.misses * DECAY + f64::from(u8::from(accepted < drafted));
    }

    /// Records the time of one step over `m` tokens, and lets every
    /// acceptance estimate drift toward its prior.
    pub fn record_step(&mut self, m: usize, secs: f64) {
        if let Some(t) = m.checked_sub(1).and_then(|i| self.timings.get_mut(i)) {
            t.add(secs);
        }
        self.since_plain = if m == 1 { 0 } else { self.since_plain + 1 };
        for a in &mut self.acceptance {
            a.hits *= IDLE_DECAY;
            a.misses *= IDLE_DECAY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_draft_when_acceptance_cannot_pay_for_the_cost() {
        let mut p = DraftPolicy::new(8).with_fixed_step_cost(0.2);
        for _ in 0..30 {
            p.record(1, 1, 0);
        }
        assert!(p.acceptance(1) < 0.1, "{}", p.acceptance(1));
        assert_eq!(p.draft_len(1, 8), 0);
        // Other match lengths keep their own estimate.
        assert!(p.draft_len(4, 8) > 0);
        // Longer matches start out more trusted.
        let fresh = DraftPolicy::new(8);
        assert!((1..8).all(|n| fresh.acceptance(n) < fresh.acceptance(n + 1)));
    }

    #[test]
    fn high_acceptance_and_cheap_steps_draft_to_the_limit() {
        let mut p = DraftPolicy::new(8).with_fixed_step_cost(0.02);
        for _ in 0..30 {
            p.record(5, 8, 8);
        }
        assert!(p.acceptance(5) > 0.95);
        assert_eq!(p.draft_len(5, 20), 8);
        assert_eq!(p.draft_len(5, 3), 3, "no more than the draft holds");
        let mut p = DraftPolicy::new(3).with_fixed_step_cost(0.02);
        p.record(5, 3, 3);
        assert_eq!(p.draft_len(5, 20), 3, "no more than the policy's limit");
    }

    #[test]
    fn the_chosen_length_maximizes_tokens_per_time() {
        // At α = 0.5 (the prior of 3-token matches), c = 0.1: rate(1) =
        // 1.5/1.1 = 1.364, rate(2) = 1.75/1.2 = 1.458, rate(3) = 1.875/1.3
        // = 1.442: k = 2.
        let p = DraftPolicy::new(8).with_fixed_step_cost(0.1);
        assert!((p.acceptance(3) - 0.5).abs() < 1e-12);
        assert_eq!(p.draft_len(3, 8), 2);
        // At α = 0.5, c = 0.5 a draft cannot pay: rate(1) = 1.5/1.5 = 1.
        let p = DraftPolicy::new(8).with_fixed_step_cost(0.5);
        assert_eq!(p.draft_len(3, 8), 0);
        // Past the last bucket, lengths share it.
        assert_eq!(p.acceptance(12), p.acceptance(8));
    }

    #[test]
    fn step_cost_is_fitted_from_timings() {
        let mut p = DraftPolicy::new(8);
        assert_eq!(p.step_cost(), PRIOR_STEP_COST);
        // t(m) = 10 ms · (1 + 0.3 (m − 1)), many times: the fit approaches 0.3.
        for _ in 0..50 {
            for m in [1, 3, 5, 9] {
                p.record_step(m, 0.010 * (1.0 + 0.3 * (m - 1) as f64));
            }
        }
        assert!((p.step_cost() - 0.3).abs() < 0.01, "{}", p.step_cost());
        // Steps with drafts only: after RETIME_AFTER of them a plain step
        // times t(1) again.
        p.record(4, 4, 4);
        assert!(p.draft_len(4, 8) > 0);
        for _ in 0..RETIME_AFTER {
            p.record_step(5, 0.022);
        }
        assert_eq!(p.draft_len(4, 8), 0);
        p.record_step(1, 0.01);
        assert!(p.draft_len(4, 8) > 0);
        // Nothing to compare with before the first one-token step.
        let fresh = DraftPolicy::new(8);
        assert_eq!(fresh.draft_len(4, 8), 0);
        // An engine whose cost is proportional to m (c = 1) stops drafting
        // even at a high acceptance.
        let mut p = DraftPolicy::new(8);
        for _ in 0..50 {
            p.record(4, 4, 3);
            for m in [1, 2, 4] {
                p.record_step(m, 0.01 * m as f64);
            }
        }
        assert!(p.step_cost() > 0.9, "{}", p.step_cost());
        assert!(p.acceptance(4) > 0.6, "{}", p.acceptance(4));
        assert_eq!(p.draft_len(4, 8), 0);
    }

    #[test]
    fn estimates_drift_back_so_a_closed_bucket_is_tried_again() {
        let mut p = DraftPolicy::new(8).with_fixed_step_cost(0.1);
        for _ in 0..30 {
            p.record(1, 2, 0);
        }
        assert_eq!(p.draft_len(1, 8), 0);
        for _ in 0..300 {
            p.record_step(1, 0.01);
        }
        assert!(p.draft_len(1, 8) > 0);
    }
}
