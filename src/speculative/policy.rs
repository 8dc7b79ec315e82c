//! How many drafted tokens to verify in the next step.
//!
//! A step over `1 + k` tokens (the sampled token and `k` drafted ones)
//! costs `t(1) · (1 + a + b·k)` for `k ≥ 1`: `a` is what any batched step
//! costs beyond a one-token one, `b` the extra cost of each further token
//! (on the default model a step over 8 tokens costs about 1.5x a one-token
//! step with AVX-512 VNNI and about 2x with AVX2 alone, whose byte products
//! cost more). If each drafted token is accepted with probability `α`
//! given that the ones before it were, the step yields `1 + α + … + α^k =
//! (1 − α^(k+1)) / (1 − α)` tokens. The policy picks the `k` that
//! maximizes tokens per unit of time, `(1 − α^(k+1)) / ((1 − α)(1 + a +
//! b·k))`, or 0 (no draft: a plain one-token step) when no `k` beats 1.
//!
//! The fixed part `a` matters: a line through the origin fitted to those
//! steps prices long drafts at about twice their cost and drafts one or two
//! tokens at a time.
//!
//! `α` is estimated per length of the n-gram match that produced the draft
//! (a 1-token match is a much weaker hint than an 8-token one), from recent
//! verifications; `a` and `b` are fitted to the steps' own timings, so the
//! same policy drafts long on an engine whose small batches cost little and
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

/// Prior acceptance of a draft model's tokens: one estimate for all of
/// them. No real pair could be measured here (issue 49); 0.6 lets the
/// first drafts happen where a step over several tokens is cheap, and the
/// estimate follows what is accepted.
const MODEL_PRIOR_RATE: f64 = 0.6;

/// The step cost assumed before any step has been timed, `(a, b)`: about
/// the fast engine's m-curve. It enters the fit as one observation at
/// m = 2 and one at m = 9 ([`PRIOR_COST_WEIGHT`]).
pub const PRIOR_STEP_COST: StepCost = StepCost {
    batched: 0.3,
    per_token: 0.05,
};

/// The weight of each of the prior's two observations: a step size timed
/// a few times outweighs it.
const PRIOR_COST_WEIGHT: f64 = 0.5;

/// What a step over `1 + k` tokens costs relative to a one-token step:
/// `1 + batched + per_token · k` for `k ≥ 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    /// `a`: the extra cost of any step over more than one token.
    pub batched: f64,
    /// `b`: the extra cost of each drafted token.
    pub per_token: f64,
}

impl StepCost {
    /// Every drafted token costs `c`, with no fixed part.
    pub fn per_token(c: f64) -> StepCost {
        StepCost {
            batched: 0.0,
            per_token: c.max(0.0),
        }
    }

    /// The cost of a step verifying `k` drafted tokens.
    pub fn of(&self, k: usize) -> f64 {
        if k == 0 {
            1.0
        } else {
            1.0 + self.batched + self.per_token * k as f64
        }
    }
}

/// A step size timed at least this often is priced by its own mean time
/// rather than by the fitted line. The integer GEMM has one form for 2 to
/// 4 tokens and a costlier one for 5 to 8 (`jit::emit::gemm_q8_0x16`),
/// so the real cost is a staircase that no line follows: a line through
/// it priced the fifth token of a 4-stream server step at a quarter of
/// what it costs, so shared steps drafted past the 4-token form and
/// served fewer tokens a second than without drafts.
const MEASURED_WEIGHT: f64 = 4.0;

/// The slope is measured against the time of a one-token step, which
/// changes as the context grows and as other work comes and goes on the
/// machine: when this many steps in a row carried drafts, the next one is
/// a plain step to time it again (at most one step in 32 without a draft).
const RETIME_AFTER: usize = 32;

/// A weighted least-squares line through `(x, y, weight)` points with at
/// least two distinct x: the weighted means of x and y, and the slope.
fn fit_line(points: &[(f64, f64, f64)]) -> (f64, f64, f64) {
    let total: f64 = points.iter().map(|p| p.2).sum();
    let mean_x = points.iter().map(|p| p.2 * p.0).sum::<f64>() / total;
    let mean_y = points.iter().map(|p| p.2 * p.1).sum::<f64>() / total;
    let sxx: f64 = points.iter().map(|p| p.2 * (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points
        .iter()
        .map(|p| p.2 * (p.0 - mean_x) * (p.1 - mean_y))
        .sum();
    (mean_x, mean_y, sxy / sxx)
}

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
    /// Prior acceptance per class of draft (n-gram match length).
    prior: [f64; BUCKETS],
    acceptance: [Acceptance; BUCKETS],
    /// Seconds a draft model takes per drafted token (none for n-grams):
    /// a token's price adds it, relative to a one-token step.
    draft_token: Timing,
    /// Index m − 1: steps over m = 1 ..= 1 + MAX_DRAFT tokens.
    timings: [Timing; MAX_DRAFT + 1],
    /// A fixed cost instead of the measured one (tests, benchmarks).
    fixed_cost: Option<StepCost>,
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
            prior: PRIOR_RATE,
            acceptance: [Acceptance::default(); BUCKETS],
            draft_token: Timing::default(),
            timings: [Timing::default(); MAX_DRAFT + 1],
            fixed_cost: None,
            since_plain: 0,
        }
    }

    /// The policy of a draft model's drafts: one acceptance estimate
    /// (class 1), its prior [`MODEL_PRIOR_RATE`].
    pub fn for_model(max_draft: usize) -> DraftPolicy {
        DraftPolicy {
            prior: [MODEL_PRIOR_RATE; BUCKETS],
            ..DraftPolicy::new(max_draft)
        }
    }

    /// A draft model drafted `tokens` in `secs`.
    pub fn record_draft(&mut self, tokens: usize, secs: f64) {
        if tokens > 0 {
            self.draft_token.add(secs / tokens as f64);
        }
    }

    /// What drafting one token costs relative to a one-token step: 0 for
    /// n-grams, and with a fixed step cost (the draft lengths then do not
    /// depend on timing).
    fn draft_token_cost(&self) -> f64 {
        let one = self.timings[0];
        if self.fixed_cost.is_some() || self.draft_token.weight == 0.0 || one.mean <= 0.0 {
            return 0.0;
        }
        self.draft_token.mean / one.mean
    }

    /// Prices every drafted token at `c` (no fixed part) instead of
    /// measuring the cost.
    pub fn with_fixed_step_cost(mut self, c: f64) -> DraftPolicy {
        self.fixed_cost = Some(StepCost::per_token(c));
        self
    }

    /// The estimated probability that a token drafted from a match of
    /// `match_len` tokens is accepted.
    pub fn acceptance(&self, match_len: usize) -> f64 {
        let b = bucket(match_len);
        self.acceptance[b].rate(self.prior[b])
    }

    /// The step cost: a weighted least-squares fit of `t(m) / t(1) − 1 =
    /// a + b·(m − 1)` over the step sizes m ≥ 2 timed so far, each weighted
    /// by how often it was seen, with the prior as two light observations;
    /// neither part below 0.
    pub fn step_cost(&self) -> StepCost {
        if let Some(c) = self.fixed_cost {
            return c;
        }
        let one = self.timings[0];
        if one.weight == 0.0 || one.mean <= 0.0 {
            return PRIOR_STEP_COST;
        }
        let prior = PRIOR_STEP_COST;
        let mut points: Vec<(f64, f64, f64)> = vec![
            (1.0, prior.of(1) - 1.0, PRIOR_COST_WEIGHT),
            (
                MAX_DRAFT as f64,
                prior.of(MAX_DRAFT) - 1.0,
                PRIOR_COST_WEIGHT,
            ),
        ];
        for (i, t) in self.timings.iter().enumerate().skip(1) {
            if t.weight > 0.0 {
                points.push((i as f64, t.mean / one.mean - 1.0, t.weight));
            }
        }
        let (mean_x, mean_y, slope) = fit_line(&points);
        let per_token = slope.max(0.0);
        StepCost {
            batched: (mean_y - per_token * mean_x).max(0.0),
            per_token,
        }
    }

    /// A step verifying `k` drafts relative to a one-token step, from
    /// both sizes' own mean times once each was timed often enough (see
    /// [`MEASURED_WEIGHT`]); never with a fixed cost.
    fn measured_cost(&self, k: usize) -> Option<f64> {
        let one = self.timings[0];
        let step = self.timings.get(k)?;
        let timed = |t: &Timing| t.weight >= MEASURED_WEIGHT && t.mean > 0.0;
        (self.fixed_cost.is_none() && timed(&one) && timed(step)).then(|| step.mean / one.mean)
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
        let cost = self.step_cost();
        let drafting = self.draft_token_cost();
        let limit = available.min(self.max_draft);
        let mut best = (0, 1.0);
        // Expected tokens from a step with k drafts: 1 + α + … + α^k.
        let (mut expected, mut power) = (1.0, 1.0);
        for k in 1..=limit {
            power *= alpha;
            expected += power;
            let step = self.measured_cost(k).unwrap_or_else(|| cost.of(k));
            let rate = expected / (step + drafting * k as f64);
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

/// Most tokens a server step may carry with its sequences' drafts: one
/// tile of the integer GEMM (under AVX2 alone a step of the default model
/// over 12 tokens took 80 ms where 4 took 26, a stall every stream in it
/// feels). [`batch_draft_lens`] stops there, and
/// [`BatchStepTimes`] times steps up to this size.
pub const MAX_BATCH_TOKENS: usize = 8;

/// The times of a server's decode steps by their token count, fitted to
/// `t(m) = t0 + t1 · m` over steps of several tokens: what one more token
/// adds to a step that already carries several sequences' tokens. Unlike
/// [`DraftPolicy::step_cost`] this needs no one-token step as its base,
/// which a busy server never takes.
#[derive(Clone, Debug)]
pub struct BatchStepTimes {
    /// Index m − 1: steps over m = 1 ..= [`MAX_BATCH_TOKENS`] tokens.
    timings: [Timing; MAX_BATCH_TOKENS],
}

impl Default for BatchStepTimes {
    fn default() -> Self {
        BatchStepTimes {
            timings: [Timing::default(); MAX_BATCH_TOKENS],
        }
    }
}

impl BatchStepTimes {
    /// Records one decode step over `m` tokens (of one or more sequences).
    pub fn record(&mut self, m: usize, secs: f64) {
        if let Some(t) = m.checked_sub(1).and_then(|i| self.timings.get_mut(i)) {
            t.add(secs);
        }
    }

    /// What one more token costs relative to a step over `m` ≥ 2 tokens:
    /// `(t(m + 1) − t(m)) / t(m)` from the two sizes' own mean times when
    /// both were timed [`MEASURED_WEIGHT`] times, else `t1 / t(m)` from a
    /// weighted least-squares fit over the sizes m ≥ 2 timed so far;
    /// infinite (no drafts) before two sizes have been timed. Steps of 2, 3 and 4 requests without drafts, and a lone
    /// request's drafted steps, time the sizes a server meets anyway.
    ///
    /// (Infinite rather than the prior curve's value, which prices a token
    /// at m = 4 at a sixth or less of what AVX2 alone measures: its drafts
    /// into a server's first steps cost throughput and latency.)
    pub fn marginal(&self, m: usize) -> f64 {
        // Both sizes timed often enough: their own means (the line misses
        // the GEMM's steps, see MEASURED_WEIGHT).
        if let (Some(now), Some(next)) = (
            m.checked_sub(1).and_then(|i| self.timings.get(i)),
            self.timings.get(m),
        ) && now.weight >= MEASURED_WEIGHT
            && next.weight >= MEASURED_WEIGHT
            && now.mean > 0.0
        {
            return (next.mean - now.mean).max(0.0) / now.mean;
        }
        let points: Vec<(f64, f64, f64)> = self
            .timings
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, t)| t.weight > 0.0)
            .map(|(i, t)| ((i + 1) as f64, t.mean, t.weight))
            .collect();
        if points.len() < 2 {
            return f64::INFINITY;
        }
        let (mean_x, mean_y, slope) = fit_line(&points);
        let slope = slope.max(0.0);
        let at_m = mean_y + slope * (m as f64 - mean_x);
        if at_m > 0.0 {
            slope / at_m
        } else {
            f64::INFINITY
        }
    }
}

/// How much more than its priced cost a drafted token in a shared step
/// must yield. The price is the forward step's time alone; the rows'
/// logits and sampling, and the wait a longer step imposes on every other
/// stream in it, come on top. Priced at 1x, drafts in shared steps gave
/// the default model no throughput under AVX2 alone and a longer p95 time
/// between tokens. At 2x, AVX2's cost of about a fifth of a 4-token step
/// per token leaves only drafts close to certain, while an engine whose
/// small batches cost little still drafts what is likely confirmed.
pub const BATCH_DRAFT_MARGIN: f64 = 2.0;

/// How many drafted tokens each sequence of a server step verifies, when
/// several sequences each feed their sampled token: `plain` of them have
/// no draft to offer, and offer i is (its draft's acceptance estimate α_i,
/// the tokens it holds). A sequence's j-th drafted token yields α_i^j
/// expected tokens (all before it accepted); each costs `marginal(m)` of a
/// step over m tokens. Tokens are added best first while one raises the
/// step's expected tokens per unit of time by a margin: while its yield
/// exceeds the step's expected tokens times its relative cost times
/// [`BATCH_DRAFT_MARGIN`]. A sequence's yields fall with j, so taking the
/// best first is optimal for a cost that grows by the same amount per
/// token. (One sequence alone has the jump from a one-token step to a
/// batched one to pay: [`DraftPolicy::draft_len`].)
pub fn batch_draft_lens(
    plain: usize,
    offers: &[(f64, usize)],
    marginal: impl Fn(usize) -> f64,
) -> Vec<usize> {
    let mut lens = vec![0; offers.len()];
    let mut m = plain + offers.len();
    let mut expected = m as f64;
    while m < MAX_BATCH_TOKENS {
        let best = offers
            .iter()
            .zip(&lens)
            .enumerate()
            .filter(|(_, ((_, available), len))| *len < available)
            .map(|(i, ((alpha, _), &len))| (i, alpha.powi(len as i32 + 1)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((i, gain)) = best else {
            break;
        };
        if gain <= BATCH_DRAFT_MARGIN * expected * marginal(m) {
            break;
        }
        lens[i] += 1;
        expected += gain;
        m += 1;
    }
    lens
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
        // t(m) = 10 ms · (1 + 0.3 (m − 1)), many times: the fit approaches
        // a = 0, b = 0.3.
        for _ in 0..50 {
            for m in [1, 3, 5, 9] {
                p.record_step(m, 0.010 * (1.0 + 0.3 * (m - 1) as f64));
            }
        }
        let c = p.step_cost();
        assert!(
            c.batched < 0.03 && (c.per_token - 0.3).abs() < 0.01,
            "{c:?}"
        );
        // A jump then a gentle slope, the fast engine's shape: t(m) = 10 ms
        // · (1.4 + 0.02 (m − 1)) for m ≥ 2.
        let mut q = DraftPolicy::new(8);
        for _ in 0..50 {
            q.record_step(1, 0.010);
            for m in [2, 9] {
                q.record_step(m, 0.010 * (1.0 + 0.4 + 0.02 * (m - 1) as f64));
            }
        }
        let c = q.step_cost();
        assert!(
            (c.batched - 0.4).abs() < 0.02 && (c.per_token - 0.02).abs() < 0.01,
            "{c:?}"
        );
        // There a match with α = 0.69 drafts to the limit (rate(8) = 2.98 /
        // 1.56 = 1.91 against rate(1) = 1.69 / 1.42 = 1.19), which a model
        // through the origin (c = 0.3 for this curve) would cut at 2.
        q.record(4, 4, 3);
        assert!((q.acceptance(4) - 0.69).abs() < 0.01, "{}", q.acceptance(4));
        assert_eq!(q.draft_len(4, 8), 8);
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
        let c = p.step_cost();
        assert!(c.of(1) > 1.8 && c.of(3) > 3.0, "{c:?}");
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

    #[test]
    fn batch_drafts_go_where_they_yield_most_while_they_pay() {
        // Two sequences, α = 0.9 and 0.8, each token 0.05 of a step over m
        // (a flat marginal for the arithmetic), 0.1 with the margin. Best first: 0.9, 0.81,
        // 0.8, 0.729, 0.656, 0.64 each beat the expected tokens before
        // them times 0.1 (2, 2.9, 3.71, 4.51, 5.24, 5.90); the next, 0.59,
        // does not (6.54 · 0.1).
        let lens = batch_draft_lens(0, &[(0.9, 8), (0.8, 8)], |_| 0.05);
        assert_eq!(lens, vec![4, 2]);
        // Best first means a weak draft waits for the strong one's yields
        // to fall below it: at 0.9 and 0.5 the first stops at 0.531 < 0.57
        // before the second's 0.5 is reached.
        assert_eq!(
            batch_draft_lens(0, &[(0.9, 8), (0.5, 8)], |_| 0.05),
            vec![5, 0]
        );
        // A sequence without a draft still counts: three plain ones make
        // every token dearer.
        let lens = batch_draft_lens(3, &[(0.9, 8), (0.5, 8)], |_| 0.05);
        assert_eq!(lens, vec![3, 0]);
        // No more than each draft holds, nor than the step's limit.
        assert_eq!(
            batch_draft_lens(0, &[(0.99, 2), (0.99, 1)], |_| 0.01),
            vec![2, 1]
        );
        let lens = batch_draft_lens(2, &[(0.99, 8), (0.99, 8)], |_| 0.001);
        assert_eq!(lens.iter().sum::<usize>() + 4, MAX_BATCH_TOKENS);
        // Costs that cannot be paid: nothing.
        assert_eq!(
            batch_draft_lens(0, &[(0.9, 8), (0.9, 8)], |_| f64::INFINITY),
            vec![0, 0]
        );
    }

    #[test]
    fn batch_step_times_fit_the_cost_of_one_more_token() {
        let mut t = BatchStepTimes::default();
        assert_eq!(t.marginal(4), f64::INFINITY, "nothing timed");
        // One-token steps are no base here; one size alone gives no slope.
        t.record(1, 0.010);
        t.record(4, 0.020);
        assert_eq!(t.marginal(4), f64::INFINITY);
        // t(m) = 12 ms + 2 ms · m: at m = 4, 2 / 20.
        for _ in 0..20 {
            for m in [2, 3, 4, 6, 9] {
                t.record(m, 0.012 + 0.002 * m as f64);
            }
        }
        assert!((t.marginal(4) - 0.1).abs() < 0.01, "{}", t.marginal(4));
        assert!(t.marginal(9) < t.marginal(4));
        // Sizes past the limit are not kept.
        t.record(MAX_BATCH_TOKENS + 1, 1.0);
        assert!((t.marginal(4) - 0.1).abs() < 0.01);
    }

    #[test]
    fn sizes_timed_often_are_priced_by_their_own_time() {
        // The GEMM's staircase: steps over 2-4 tokens cost 1.2 of a
        // one-token step, over 5-9 tokens 2.4. At α = 0.8 three drafts
        // give 2.95 / 1.2 = 2.46 tokens per unit of time and any longer
        // draft at most 1.80; the fitted line (a = 0.01, b = 0.21) would
        // have chosen four.
        let mut p = DraftPolicy::new(8);
        for _ in 0..5 {
            for m in 2..=9 {
                p.record_step(m, if m <= 4 { 0.012 } else { 0.024 });
            }
            p.record_step(1, 0.010);
        }
        assert!((p.acceptance(8) - 0.8).abs() < 1e-9);
        assert_eq!(p.draft_len(8, 8), 3);
        // Timed fewer than MEASURED_WEIGHT times, a size is priced by the
        // line.
        let mut q = DraftPolicy::new(8);
        for m in 2..=9 {
            q.record_step(m, if m <= 4 { 0.012 } else { 0.024 });
        }
        q.record_step(1, 0.010);
        assert_eq!(q.measured_cost(3), None);

        // A server: the fifth token takes the GEMM's 8-token form.
        let mut t = BatchStepTimes::default();
        for _ in 0..5 {
            for (m, ms) in [(2, 13.0), (3, 13.5), (4, 14.3), (5, 18.5)] {
                t.record(m, ms * 1e-3);
            }
        }
        assert!(
            (t.marginal(4) - 4.2 / 14.3).abs() < 1e-9,
            "{}",
            t.marginal(4)
        );
        assert!(
            (t.marginal(3) - 0.8 / 13.5).abs() < 1e-9,
            "{}",
            t.marginal(3)
        );
        // m = 6 was never timed: the line over 2..5.
        assert!(t.marginal(5) < t.marginal(4), "{}", t.marginal(5));
    }
}
