//! The whole measurement: every window fed, every scored row turned into
//! log-probabilities and its true token's NLL accumulated.

use super::logprobs::log_softmax_in_place;
use super::stats::NllStats;
use super::windows::{WindowPlan, score_window};
use crate::engine::Engine;
use anyhow::{Context, Result};

/// One scored position, handed to the caller for KL or saving.
pub struct ScoredRow<'a> {
    /// Scored positions before this one, over all windows.
    pub index: usize,
    /// The token that was to be predicted.
    pub target: u32,
    /// The log-softmax of the logits that predict it.
    pub log_probs: &'a [f32],
}

/// Scores the windows of `plan` over `tokens`; `on_row` sees each scored
/// position, `on_window` the running figures after each window.
pub fn measure(
    engine: &mut dyn Engine,
    tokens: &[u32],
    plan: &WindowPlan,
    bos: u32,
    on_row: &mut dyn FnMut(ScoredRow<'_>) -> Result<()>,
    on_window: &mut dyn FnMut(usize, &NllStats),
) -> Result<NllStats> {
    let mut nll = NllStats::default();
    let mut index = 0;
    for window_index in 0..plan.windows {
        let window = plan.window(tokens, window_index, bos);
        score_window(engine, &window, plan.first_scored(), &mut |target, row| {
            log_softmax_in_place(row)
                .with_context(|| format!("window {}, scored position {index}", window_index + 1))?;
            nll.add(-f64::from(row[target as usize]));
            on_row(ScoredRow {
                index,
                target,
                log_probs: row,
            })?;
            index += 1;
            Ok(())
        })?;
        on_window(window_index + 1, &nll);
    }
    Ok(nll)
}
