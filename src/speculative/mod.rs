//! Speculative decoding: tokens are drafted from n-grams of the context
//! itself (prompt lookup) or by the engine's draft model (a Gemma 4
//! assistant, multi-token prediction), and verified in one forward step
//! over `[sampled, d1 … dk]`, whose rows give the distribution after each
//! of them. Both drafters are deterministic given the sequence, so both
//! keep the rule below.
//!
//! # The acceptance rule
//!
//! The draft is deterministic: it proposes `d` with probability 1. The
//! standard rule for such a draft (Leviathan et al. 2023, Chen et al. 2023,
//! with q = δ_d) accepts `d` with probability `min(1, p(d)/q(d)) = p(d)`,
//! where `p` is the sampler's final distribution at that position, and on
//! rejection draws from `max(0, p − q)` normalized, which is `p` with `d`
//! removed and renormalized. [`verify`] carries it out by drawing `x ~ p`
//! with the sampler exactly as a step without speculation would, and
//! accepting iff `x = d`:
//!
//! - P(accept) = P(x = d) = p(d);
//! - given a rejection, x is distributed as p(x) / (1 − p(d)) over x ≠ d.
//!
//! So the output's distribution is unchanged, and more: the sampler draws
//! one random number per emitted token from the same logits and the same
//! history as without speculation, so a seed gives the same text with
//! `--spec ngram` and `--spec off` whenever the engine's verify rows equal
//! its one-token steps bit for bit. Greedy decoding is the case p = δ_argmax:
//! a drafted token is accepted while it is the argmax.
//!
//! # The loop
//!
//! [`crate::generate::decode`] samples from the current row; a sampled
//! token equal to the next drafted one is already in the KV cache and the
//! next row holds its logits, so decoding moves on without a forward pass.
//! At the first disagreement (or past the last draft) the cache is cut back
//! to the accepted tokens ([`crate::engine::Engine::truncate`]: the cache is
//! flat by position, so this is an exact rollback also with sliding-window
//! layers) and the sampled token is fed with a new draft.

pub mod ngram;
pub mod policy;

use crate::sample::Distribution;
use ngram::NgramIndex;
use policy::DraftPolicy;

/// `--spec`: how tokens are drafted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Speculation {
    /// Every step feeds one token.
    Off,
    /// Prompt lookup: the continuation of the longest earlier n-gram that
    /// ends the context.
    Ngram(DraftOptions),
    /// Multi-token prediction: the engine's draft model (a Gemma 4
    /// assistant, `Engine::draft`) drafts after each chosen token.
    Mtp(DraftOptions),
}

impl Speculation {
    /// N-gram drafting with the default options.
    pub fn ngram() -> Speculation {
        Speculation::Ngram(DraftOptions::default())
    }

    /// Drafting with the engine's draft model, with the default options.
    pub fn mtp() -> Speculation {
        Speculation::Mtp(DraftOptions::default())
    }

    pub fn name(self) -> &'static str {
        match self {
            Speculation::Off => "off",
            Speculation::Ngram(_) => "ngram",
            Speculation::Mtp(_) => "mtp",
        }
    }

    /// The drafting options, when tokens are drafted.
    pub fn options_mut(&mut self) -> Option<&mut DraftOptions> {
        match self {
            Speculation::Off => None,
            Speculation::Ngram(o) | Speculation::Mtp(o) => Some(o),
        }
    }
}

/// Drafts with a model: given the last chosen token (not yet fed) and how
/// many tokens, the tokens drafted to follow it.
pub type DraftModel<'a> = &'a mut dyn FnMut(u32, usize) -> anyhow::Result<Vec<u32>>;

/// Settings of drafting (n-gram or model).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftOptions {
    /// Most tokens drafted per step (1 ..= [`policy::MAX_DRAFT`]).
    pub max_draft: usize,
    /// The extra cost of each drafted token relative to a one-token step,
    /// with no fixed part (`policy::StepCost::per_token`); `None` fits the
    /// cost to the steps' timings. Fixing it makes the draft lengths
    /// independent of timing (tests, benchmarks).
    pub step_cost: Option<f64>,
}

impl Default for DraftOptions {
    fn default() -> Self {
        DraftOptions {
            max_draft: policy::MAX_DRAFT,
            step_cost: None,
        }
    }
}

/// What speculation did during one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Forward steps of the decode (each feeds one sampled token and its
    /// draft, if any).
    pub steps: usize,
    /// Drafted tokens fed for verification.
    pub drafted: usize,
    /// Drafted tokens that the sampler's own choice confirmed.
    pub accepted: usize,
}

impl SpecStats {
    /// Share of drafted tokens accepted.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// `drafted D, accepted A (P%), T tok/step` for a stats line, where
    /// `generated` tokens came out of these steps.
    pub fn describe(&self, generated: usize) -> String {
        format!(
            "drafted {}, accepted {} ({:.0}%), {:.2} tok/step",
            self.drafted,
            self.accepted,
            100.0 * self.acceptance(),
            generated as f64 / self.steps.max(1) as f64
        )
    }
}

/// The verdict on one drafted token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    /// The token to emit instead.
    Rejected(u32),
}

/// Judges drafted token `draft` against the step's final distribution by
/// the rule in the module documentation: one draw from `dist`, accepted iff
/// it is the draft.
pub fn verify(dist: Distribution<'_>, draft: u32) -> Verdict {
    let x = dist.draw();
    if x == draft {
        Verdict::Accepted
    } else {
        Verdict::Rejected(x)
    }
}

/// A draft before its length is chosen ([`Drafter::offer`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DraftOffer {
    /// The length of the n-gram match it continues.
    pub match_len: usize,
    /// The estimated probability that each of its tokens is accepted
    /// given the ones before it were.
    pub acceptance: f64,
    pub tokens: Vec<u32>,
}

/// Longest n-gram the drafter matches.
const MATCH_N: usize = ngram::MAX_N;

/// Where a drafter's tokens come from.
enum Source {
    /// The n-gram index of the sequence.
    Ngram(NgramIndex),
    /// A draft model the caller runs ([`Drafter::offer_from_model`]): it
    /// keeps no state here, it reads the engine's cache as it is.
    Model,
}

/// The class a model's drafts are recorded under in the policy (its
/// acceptance has one estimate, where n-gram drafts have one per match
/// length).
const MODEL_CLASS: usize = 1;

/// The drafting state of one sequence: its n-gram index (or a draft
/// model's round), draft-length policy and statistics. Build one per
/// sequence (a request, a chat reply); it only ever sees the sequence
/// grow.
pub struct Drafter {
    source: Source,
    policy: DraftPolicy,
    stats: SpecStats,
    /// The match length and size of the draft being verified.
    pending: Option<(usize, usize)>,
}

impl Drafter {
    /// A drafter over `context`, the tokens already in the sequence.
    pub fn new(context: &[u32], options: DraftOptions) -> Drafter {
        Drafter::with_policy(
            context,
            Self::policy(options, DraftPolicy::new(options.max_draft)),
        )
    }

    /// A drafter whose tokens a draft model gives
    /// ([`Drafter::offer_from_model`]).
    pub fn for_model(options: DraftOptions) -> Drafter {
        Drafter {
            source: Source::Model,
            policy: Self::policy(options, DraftPolicy::for_model(options.max_draft)),
            stats: SpecStats::default(),
            pending: None,
        }
    }

    fn policy(options: DraftOptions, policy: DraftPolicy) -> DraftPolicy {
        match options.step_cost {
            Some(c) => policy.with_fixed_step_cost(c),
            None => policy,
        }
    }

    pub fn with_policy(context: &[u32], policy: DraftPolicy) -> Drafter {
        Drafter {
            source: Source::Ngram(NgramIndex::new(context, MATCH_N)),
            policy,
            stats: SpecStats::default(),
            pending: None,
        }
    }

    /// Whether the drafts come from a draft model.
    pub fn uses_model(&self) -> bool {
        matches!(self.source, Source::Model)
    }

    /// A draft model's offer to follow `last`, the last chosen token: as
    /// many tokens as the policy would verify in a step of this sequence's
    /// own (at most `room`), drafted by `model` (timed: the time prices
    /// later drafts), cut where `allowed` says. None when the policy
    /// drafts nothing.
    pub fn offer_from_model(
        &mut self,
        last: u32,
        room: usize,
        model: DraftModel<'_>,
        allowed: impl FnOnce(&[u32]) -> usize,
    ) -> anyhow::Result<Option<DraftOffer>> {
        let k = self
            .policy
            .draft_len(MODEL_CLASS, room.min(policy::MAX_DRAFT));
        if k == 0 {
            return Ok(None);
        }
        let began = std::time::Instant::now();
        let tokens = model(last, k)?;
        self.policy
            .record_draft(tokens.len(), began.elapsed().as_secs_f64());
        let usable = allowed(&tokens).min(tokens.len());
        Ok((usable > 0).then(|| DraftOffer {
            match_len: MODEL_CLASS,
            acceptance: self.policy.acceptance(MODEL_CLASS),
            tokens: tokens[..usable].to_vec(),
        }))
    }

    /// Drafts at most `room` tokens to follow `context`, which must extend
    /// the context this drafter has seen. The caller feeds them after the
    /// context's last token and reports with [`Drafter::verified`].
    pub fn draft(&mut self, context: &[u32], room: usize) -> Vec<u32> {
        self.draft_within(context, room, |draft| draft.len())
    }

    /// [`Drafter::draft`] under an output constraint: `allowed(draft)`
    /// says how many leading tokens of a draft the constraint accepts, and
    /// the draft is cut there. A token the constraint forbids could never
    /// be confirmed, so feeding it would only cost a row of the step.
    pub fn draft_within(
        &mut self,
        context: &[u32],
        room: usize,
        allowed: impl FnOnce(&[u32]) -> usize,
    ) -> Vec<u32> {
        match self.offer(context, room, allowed) {
            Some(offer) => self.take_alone(offer),
            None => Vec::new(),
        }
    }

    /// [`Drafter::take`] with the length this sequence's policy chooses for
    /// a step it has to itself.
    pub fn take_alone(&mut self, offer: DraftOffer) -> Vec<u32> {
        let k = self.policy.draft_len(offer.match_len, offer.tokens.len());
        self.take(offer, k)
    }

    /// The draft the context offers, before its length is chosen: the
    /// continuation of the longest match (at most `room` tokens, cut where
    /// `allowed` says) and how likely each of its tokens is to be
    /// accepted. Pass it to [`Drafter::take`] with the length chosen.
    pub fn offer(
        &mut self,
        context: &[u32],
        room: usize,
        allowed: impl FnOnce(&[u32]) -> usize,
    ) -> Option<DraftOffer> {
        self.catch_up(context);
        let Source::Ngram(index) = &self.source else {
            return None;
        };
        let (found, continuation) = index.draft(room.min(policy::MAX_DRAFT));
        let m = found?;
        let usable = allowed(continuation).min(continuation.len());
        (usable > 0).then(|| DraftOffer {
            match_len: m.n,
            acceptance: self.policy.acceptance(m.n),
            tokens: continuation[..usable].to_vec(),
        })
    }

    /// The first `k` tokens of `offer` as the draft to verify (none when
    /// `k` is 0); report the verdict with [`Drafter::verified`].
    pub fn take(&mut self, mut offer: DraftOffer, k: usize) -> Vec<u32> {
        let k = k.min(offer.tokens.len());
        if k == 0 {
            return Vec::new();
        }
        self.pending = Some((offer.match_len, k));
        self.stats.drafted += k;
        offer.tokens.truncate(k);
        offer.tokens
    }

    /// The last draft was judged: its first `accepted` tokens were taken,
    /// and if that is fewer than all, the next one was rejected.
    pub fn verified(&mut self, accepted: usize) {
        if let Some((n, k)) = self.pending.take() {
            self.policy.record(n, k, accepted);
            self.stats.accepted += accepted.min(k);
        }
    }

    /// Generation ended while a draft was being judged: `accepted` of its
    /// tokens were taken and the rest were never judged.
    pub fn abandon(&mut self, accepted: usize) {
        if let Some((_, k)) = self.pending.take() {
            self.stats.accepted += accepted.min(k);
        }
    }

    /// A forward step over `m` tokens took `secs`.
    pub fn step_done(&mut self, m: usize, secs: f64) {
        self.stats.steps += 1;
        self.policy.record_step(m, secs);
    }

    pub fn stats(&self) -> SpecStats {
        self.stats
    }

    /// Indexes the tokens of `context` past those seen, or starts over
    /// if `context` is not an extension of them.
    fn catch_up(&mut self, context: &[u32]) {
        let Source::Ngram(index) = &mut self.source else {
            return;
        };
        let seen = index.len();
        if context.len() >= seen && context[..seen] == *index.tokens() {
            index.extend(&context[seen..]);
        } else {
            *index = NgramIndex::new(context, MATCH_N);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{Sampler, SamplerConfig};

    #[test]
    fn the_verdict_follows_the_rule_for_a_deterministic_draft() {
        // p = softmax(ln [0.5, 0.3, 0.15, 0.05]) at temperature 1.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
        };
        let mut sampler = Sampler::new(cfg, 17);
        let p: Vec<f64> = (0..4)
            .map(|id| sampler.distribution(&logits, &[]).probability(id))
            .collect();
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-6);
        let n = 40_000;
        for draft in [0u32, 1, 3] {
            let mut accepted = 0;
            let mut instead = [0usize; 4];
            for _ in 0..n {
                match verify(sampler.distribution(&logits, &[]), draft) {
                    Verdict::Accepted => accepted += 1,
                    Verdict::Rejected(x) => {
                        assert_ne!(x, draft, "a rejection never emits the draft");
                        instead[x as usize] += 1;
                    }
                }
            }
            // Acceptance frequency ≈ p(d): its sd is sqrt(p(1-p)/n) ≤ 0.0025;
            // 0.0125 is 5 sd.
            let rate = accepted as f64 / n as f64;
            let pd = p[draft as usize];
            assert!((rate - pd).abs() < 0.0125, "draft {draft}: {rate} vs {pd}");
            // After a rejection: p with d removed, renormalized. Each share
            // has sd ≤ sqrt(0.25 / rejections) ≤ 0.0035 here; allow 5 sd.
            let rejected = (n - accepted) as f64;
            for x in 0..4u32 {
                if x == draft {
                    continue;
                }
                let want = p[x as usize] / (1.0 - pd);
                let got = instead[x as usize] as f64 / rejected;
                assert!(
                    (got - want).abs() < 0.018,
                    "draft {draft}, residual of {x}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn greedy_accepts_exactly_the_argmax() {
        let mut s = Sampler::new(SamplerConfig::greedy(), 0);
        let logits = [0.1f32, 2.0, 1.9];
        assert_eq!(verify(s.distribution(&logits, &[]), 1), Verdict::Accepted);
        assert_eq!(
            verify(s.distribution(&logits, &[]), 2),
            Verdict::Rejected(1)
        );
        assert_eq!(s.distribution(&logits, &[]).certain(), Some(1));
    }

    #[test]
    fn drafts_come_from_the_context_and_are_accounted() {
        let context = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3];
        let policy = DraftPolicy::new(8).with_fixed_step_cost(0.01);
        let mut d = Drafter::with_policy(&context[..4], policy);
        // The drafter catches up with the longer context.
        let draft = d.draft(&context, 16);
        assert!(!draft.is_empty());
        assert_eq!(draft, &[4, 5, 6, 7, 1, 2, 3][..draft.len()]);
        d.verified(2);
        assert_eq!(
            d.stats(),
            SpecStats {
                steps: 0,
                drafted: draft.len(),
                accepted: 2
            }
        );
        // Room limits the draft; no match, no draft.
        assert!(d.draft(&context, 1).len() <= 1);
        d.abandon(0);
        assert!(d.draft(&[9, 8], 8).is_empty(), "a new context starts over");
        d.step_done(1, 0.01);
        assert_eq!(d.stats().steps, 1);
    }
}
