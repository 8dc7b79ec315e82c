//! Forward passes: the plain-Rust reference (the oracle) and the JIT engine.

pub mod assistant;
pub mod attn_scores;
pub mod autotune;
pub mod decode_wsum;
pub mod fast;
pub mod formats;
pub mod geglu_avx2;
pub mod jit_kernels;
pub mod kernels;
pub mod key_split;
pub mod kv_cache;
pub mod membench;
pub mod ops;
pub mod packed;
pub mod pool;
pub mod q8_input;
pub mod reference;
pub mod softcap_avx2;
pub mod step_logits;
pub mod synthetic;
pub mod wide_input;

use crate::model::config::ModelConfig;
use anyhow::Result;

/// Which positions of a forward call need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last position (generation).
    Last,
    /// Every position, row-major `[tokens, vocab]`.
    All,
}

/// A transformer with a KV cache.
pub trait Engine {
    fn config(&self) -> &ModelConfig;

    /// Tokens cached so far: the position the next token gets.
    fn position(&self) -> usize;

    /// The most tokens the cache can hold.
    fn capacity(&self) -> usize;

    /// Forgets cached tokens from `len` on.
    fn truncate(&mut self, len: usize);

    /// Feeds `tokens` after the cached ones and returns their logits.
    fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>>;

    /// Takes back logits that [`Engine::forward`] returned, once read, so
    /// that a later call writes over the same memory instead of a fresh
    /// buffer. An engine may drop them.
    fn reuse_logits(&self, logits: Vec<f32>) {
        drop(logits);
    }

    /// Feeds `tokens` after the cached ones and returns their final hidden
    /// states (after the final norm: the LM head's input), row-major
    /// `[tokens, hidden]`, computing no logits.
    fn final_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;

    /// Whether [`Engine::draft`] runs: a Gemma 4 assistant is attached.
    fn can_draft(&self) -> bool {
        false
    }

    /// Drafts `k` tokens (1 ..= [`assistant::MAX_DRAFT_TOKENS`]) to follow
    /// `token`, the token chosen after the cached ones (not fed): one
    /// round of the attached assistant over the cache as it is (see
    /// [`assistant`]). Each draft's logits, `[k, vocab]`, are appended to
    /// `logits` when given.
    fn draft(&mut self, token: u32, k: usize, logits: Option<&mut Vec<f32>>) -> Result<Vec<u32>> {
        let _ = (token, k, logits);
        anyhow::bail!("this engine has no assistant to draft with")
    }
}
