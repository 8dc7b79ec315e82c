//! llama-perplexity's window rule, and feeding one window to an engine.
//!
//! The text's tokens (BOS first) are cut into non-overlapping windows of
//! `n_ctx` tokens; only whole windows count. Each window goes to a fresh
//! KV cache with its first token replaced by BOS. Only the second half is
//! scored, so that every scored token has at least `n_ctx / 2` tokens of
//! context: with `first = n_ctx / 2`, the logits at window positions
//! `first ..= n_ctx - 2` predict the tokens at `first + 1 ..= n_ctx - 1`,
//! `n_ctx - 1 - first` tokens per window (255 at `-c 512`). This is
//! llama.cpp's `tools/perplexity/perplexity.cpp` rule, which also refuses a
//! text of fewer than `2 * n_ctx` tokens.

use crate::engine::{Engine, LogitsWanted};
use anyhow::{Result, bail};

/// The smallest window that scores at least one token after some context.
pub const MIN_WINDOW: usize = 4;

/// Rows of logits asked for per forward call: 64 rows of a 262,144-token
/// vocabulary are 64 MiB, where a whole 512-token window would be 512 MiB.
pub const LOGITS_PIECE: usize = 64;

/// Which windows of a tokenized text are scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowPlan {
    /// Tokens per window (`-c`).
    pub n_ctx: usize,
    /// Whole windows scored.
    pub windows: usize,
}

impl WindowPlan {
    /// The windows of a `n_tokens`-token text, at most `max_windows` of them
    /// (`--chunks`).
    pub fn new(n_tokens: usize, n_ctx: usize, max_windows: Option<usize>) -> Result<WindowPlan> {
        if n_ctx < MIN_WINDOW {
            bail!("-c {n_ctx}: a window must hold at least {MIN_WINDOW} tokens");
        }
        if n_tokens < 2 * n_ctx {
            bail!(
                "the text has {n_tokens} tokens but -c {n_ctx} needs at least {} (two windows, as llama-perplexity requires); give a longer text or a smaller -c",
                2 * n_ctx
            );
        }
        if max_windows == Some(0) {
            bail!("--chunks 0: nothing would be scored; give at least 1");
        }
        let whole = n_tokens / n_ctx;
        let windows = max_windows.map_or(whole, |m| m.min(whole));
        Ok(WindowPlan { n_ctx, windows })
    }

    /// The first window position whose logits are scored.
    pub fn first_scored(&self) -> usize {
        self.n_ctx / 2
    }

    /// Tokens scored per window.
    pub fn scored_per_window(&self) -> usize {
        self.n_ctx - 1 - self.first_scored()
    }

    /// Tokens scored over all windows.
    pub fn scored_total(&self) -> usize {
        self.windows * self.scored_per_window()
    }

    /// The tokens the windows cover, as the text has them.
    pub fn covered<'a>(&self, tokens: &'a [u32]) -> &'a [u32] {
        &tokens[..self.windows * self.n_ctx]
    }

    /// Window `index` as it is fed: its first token replaced by BOS.
    pub fn window(&self, tokens: &[u32], index: usize, bos: u32) -> Vec<u32> {
        let start = index * self.n_ctx;
        let mut window = tokens[start..start + self.n_ctx].to_vec();
        window[0] = bos;
        window
    }
}

/// Feeds `window` to a fresh KV cache and calls `on_row(target, row)` for
/// each scored position, `row` being the logits (length `vocab`) that
/// predict the token `target`. The tokens before `first` are fed asking
/// only for the last logits, which are discarded; the rest in pieces of
/// [`LOGITS_PIECE`] so that memory stays bounded. The window's last token
/// is never fed: nothing after it is predicted.
pub fn score_window(
    engine: &mut dyn Engine,
    window: &[u32],
    first: usize,
    on_row: &mut dyn FnMut(u32, &mut [f32]) -> Result<()>,
) -> Result<()> {
    let vocab = engine.config().vocab_size;
    engine.truncate(0);
    if first > 0 {
        engine.forward(&window[..first], LogitsWanted::Last)?;
    }
    let scored_inputs = &window[first..window.len() - 1];
    let mut target_at = first + 1;
    for piece in scored_inputs.chunks(LOGITS_PIECE) {
        let mut logits = engine.forward(piece, LogitsWanted::All)?;
        if logits.len() != piece.len() * vocab {
            bail!(
                "the engine returned {} logits for {} positions of a {vocab}-token vocabulary",
                logits.len(),
                piece.len()
            );
        }
        for row in logits.chunks_exact_mut(vocab) {
            on_row(window[target_at], row)?;
            target_at += 1;
        }
    }
    Ok(())
}
