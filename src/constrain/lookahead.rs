//! Keeping the mask off the critical path: the mask for the next token
//! depends only on the tokens taken so far, not on the logits, so it can
//! be computed on a helper thread while the forward pass of the token just
//! taken runs on the engine's threads.
//!
//! A mask takes about 0.2 ms to compute, under 1% of a decode step even
//! in line; the overlap saves about that much per token, and on 2 cores
//! the helper thread cost the forward pass nothing measurable.

use super::{ConstraintState, NextTokens};
use std::time::Instant;

/// Whether masks are computed beside the forward pass unless
/// `PULSAR_MASK_OVERLAP=0` (or `=1`) says otherwise.
///
/// On 2 cores the helper thread competes with the engine's two workers for
/// the ~0.2 ms it runs; measured, that cost nothing visible and the overlap
/// gained about that much per token.
pub const OVERLAP_BY_DEFAULT: bool = true;

/// Reads `PULSAR_MASK_OVERLAP` (0 or 1), for measuring both ways.
pub fn overlap_from_env() -> bool {
    match std::env::var("PULSAR_MASK_OVERLAP").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => OVERLAP_BY_DEFAULT,
    }
}

/// The output constraint's part in one generation.
#[derive(Clone, Debug, Default)]
pub struct ConstraintReport {
    /// Masks computed.
    pub masks: usize,
    /// Seconds spent computing them (partly hidden behind the forward pass
    /// when overlapped).
    pub mask_secs: f64,
    /// Seconds the generation loop spent waiting for masks and applying
    /// them: what the constraint cost the decode speed.
    pub wait_secs: f64,
    /// Why generation stopped at a dead end, when it did.
    pub dead_end: Option<String>,
}

impl ConstraintReport {
    /// One line for stderr.
    pub fn summary(&self, flag: &str) -> String {
        let per_mask = |secs: f64| 1e3 * secs / self.masks.max(1) as f64;
        format!(
            "[{flag}: {} masks, {:.2} ms each to compute, {:.2} ms each on the decode path]",
            self.masks,
            per_mask(self.mask_secs),
            per_mask(self.wait_secs)
        )
    }
}

/// A [`ConstraintState`] with at most one mask computed ahead.
pub struct MaskLookahead {
    state: ConstraintState,
    ahead: Option<NextTokens>,
    overlap: bool,
    report: ConstraintReport,
}

impl MaskLookahead {
    pub fn new(state: ConstraintState, overlap: bool) -> MaskLookahead {
        MaskLookahead {
            state,
            ahead: None,
            overlap,
            report: ConstraintReport::default(),
        }
    }

    /// What may come next: the mask computed ahead, or one computed now.
    pub fn next_tokens(&mut self) -> NextTokens {
        if let Some(next) = self.ahead.take() {
            return next;
        }
        let start = Instant::now();
        let next = self.state.next_tokens();
        let secs = start.elapsed().as_secs_f64();
        self.report.masks += 1;
        self.report.mask_secs += secs;
        self.report.wait_secs += secs;
        next
    }

    /// Takes the sampled token; the error is the reason for the user.
    pub fn take(&mut self, token: u32) -> Result<(), String> {
        self.ahead = None;
        self.state.take(token)
    }

    /// Runs `work` (the forward pass) on this thread while the next mask
    /// is computed on a helper thread, when overlapping is on; otherwise
    /// just runs `work` and leaves the mask to [`MaskLookahead::next_tokens`].
    pub fn alongside<T>(&mut self, work: impl FnOnce() -> T) -> T {
        if !self.overlap {
            return work();
        }
        self.ahead = None;
        let this = &mut *self;
        let (result, waited) = std::thread::scope(|scope| {
            let helper = scope.spawn(|| this.compute_ahead());
            let result = work();
            let wait = Instant::now();
            let joined = helper.join();
            (result, joined.map(|()| wait.elapsed().as_secs_f64()))
        });
        match waited {
            Ok(waited) => self.report.wait_secs += waited,
            Err(_) => {
                let why = "the constraint engine failed while computing a mask".to_string();
                self.ahead = Some(NextTokens::DeadEnd(why));
            }
        }
        result
    }

    /// Computes the next mask now and keeps it for
    /// [`MaskLookahead::next_tokens`] (the server computes those of a
    /// step's sequences on a helper thread while the step runs).
    pub fn compute_ahead(&mut self) {
        if self.ahead.is_some() {
            return;
        }
        let start = Instant::now();
        let next = self.state.next_tokens();
        self.report.masks += 1;
        self.report.mask_secs += start.elapsed().as_secs_f64();
        self.ahead = Some(next);
    }

    /// Why the constraint reached a dead end, once it did.
    pub fn dead_end(&self) -> Option<&str> {
        self.report.dead_end.as_deref()
    }

    /// How many leading tokens of a draft the constraint accepts from
    /// here (see [`ConstraintState::allowed_prefix`]); counted as time on
    /// the decode path.
    pub fn allowed_prefix(&mut self, draft: &[u32]) -> usize {
        let start = Instant::now();
        let n = self.state.allowed_prefix(draft);
        self.report.wait_secs += start.elapsed().as_secs_f64();
        n
    }

    /// Counts time spent applying a mask to the logits.
    pub fn add_wait(&mut self, secs: f64) {
        self.report.wait_secs += secs;
    }

    pub fn record_dead_end(&mut self, why: String) {
        self.report.dead_end = Some(why);
    }

    pub fn into_report(self) -> ConstraintReport {
        self.report
    }
}
