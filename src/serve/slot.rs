//! What a request's handler hears from the scheduler, and the reply
//! settings it sends along with a job. The generation itself is
//! [`crate::generate::Generation`], the same one `pulsar run` drives.

use super::api::{ApiError, TokenLogprob, Usage};
pub use crate::generate::{FinishReason, GenParams};

/// What the scheduler sends a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Text that is final (nothing held back as a possible stop string) and
    /// the log-probabilities of the tokens that wrote it.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Log-probabilities of prompt tokens, in order, before any `Delta`
    /// (`echo` with `logprobs`). The prompt's first token has no context to
    /// be scored in: its entry's `logprob` is NaN (null in JSON).
    PromptLogprobs(Vec<TokenLogprob>),
    /// The end, with exact counts.
    Done { reason: FinishReason, usage: Usage },
    /// An embedding job's vector (its only event): the mean of its
    /// tokens' final hidden states, scaled to length 1.
    Embedding(Vec<f32>),
    /// The request could not be served (sent instead of `Done`).
    Failed(ApiError),
}
