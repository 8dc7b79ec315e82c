//! A Gemma 4 assistant beside its target engine: what both engines share
//! of a draft round (the spec is `tests/data/gemma4-assistant/README.md`).
//!
//! A round drafts `k` tokens after the token the target just chose, which
//! the target has not fed: with the target's cache holding positions
//! `0..p`, every step of the round is at position `p`, reads the target's
//! scaled embedding of its token beside a hidden state (the target's final
//! hidden state at `p - 1` first, then the assistant's own projected back),
//! and attends over the target's cache: a global layer over every cached
//! position, a sliding one over the last `W + 1` (transformers' mask; the
//! target's own layers see `W`). Each step's token is the argmax of the
//! previous step's logits. The assistant keeps no state of its own between
//! rounds, so after a rejection it reads exactly the target's accepted
//! cache.

use crate::model::config::{HeadClusters, ModelConfig};
use crate::model::dtype::TensorView;
use crate::model::gemma4_assistant::target_kv_layers;
use crate::model::source::{ModelSource, Role};
use crate::model::weights::ModelWeights;
use anyhow::{Result, bail};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Most tokens one round drafts (`pulsar logits --n-draft`; a verify
/// step feeds at most 8 drafts, `speculative::policy::MAX_DRAFT`).
pub const MAX_DRAFT_TOKENS: usize = 8;

/// An assistant's weights in an engine's layout, and where its layers read
/// the target's cache.
pub struct Assistant<M> {
    pub config: ModelConfig,
    pub weights: ModelWeights<M>,
    /// Per assistant layer, the target layer whose cache it attends over.
    pub target_layers: Vec<usize>,
    pub path: PathBuf,
}

impl<M> Assistant<M> {
    /// Loads the assistant `src` for the target described by `target`
    /// (at `target_path`), checking that the pair fits; `matrix` puts
    /// each matrix in the engine's layout. A head without clusters (a
    /// GGUF from llama.cpp's converter, which drops them) is said once on
    /// stderr.
    pub fn load(
        src: &ModelSource,
        target: &ModelConfig,
        target_path: &Path,
        matrix: impl FnMut(Role, TensorView<'_>) -> Result<M>,
    ) -> Result<Assistant<M>> {
        let target_layers = target_kv_layers(target, target_path, &src.config, &src.path)?;
        let weights = ModelWeights::load(src, matrix)?;
        if src.gguf().is_some() && clusters(&src.config).is_none() {
            eprintln!(
                "pulsar: {}: no head clusters in this GGUF (llama.cpp's converter drops them): drafts rank the whole vocabulary",
                src.path.display()
            );
        }
        Ok(Assistant {
            config: src.config.clone(),
            weights,
            target_layers,
            path: src.path.clone(),
        })
    }

    /// The target's hidden width.
    pub fn backbone_hidden(&self) -> usize {
        self.config
            .features
            .assistant
            .map_or(0, |a| a.backbone_hidden)
    }

    /// The keys assistant layer `layer` sees for a draft at position
    /// `pos` (the target's cache holds `0..pos`): all of them on a global
    /// layer, the last `W + 1` on a sliding one.
    pub fn visible_keys(&self, layer: usize, pos: usize) -> Range<usize> {
        match self.config.layers[layer].window {
            Some(w) => pos.saturating_sub(w + 1)..pos,
            None => 0..pos,
        }
    }
}

/// The head's clusters, if it ranks through them.
pub fn clusters(c: &ModelConfig) -> Option<HeadClusters> {
    c.features.assistant.and_then(|a| a.clusters)
}

/// Checks a round's request: `k` drafts after `token` at a target
/// position of `pos` cached tokens.
pub fn check_round(target: &ModelConfig, token: u32, k: usize, pos: usize) -> Result<()> {
    if k == 0 || k > MAX_DRAFT_TOKENS {
        bail!("a draft round drafts 1 to {MAX_DRAFT_TOKENS} tokens, not {k}");
    }
    if token as usize >= target.vocab_size {
        bail!(
            "token id {token} is outside the vocabulary (size {})",
            target.vocab_size
        );
    }
    if pos == 0 {
        bail!("the target has no cached token to draft after (feed at least one first)");
    }
    Ok(())
}

/// `concat(E_t[token] · sqrt(H_t), h)`: a step's input before the
/// pre-projection, from the target's unscaled embedding row.
pub fn step_input(embedding_row: &[f32], hidden: &[f32]) -> Vec<f32> {
    let scale = (embedding_row.len() as f32).sqrt();
    embedding_row
        .iter()
        .map(|v| v * scale)
        .chain(hidden.iter().copied())
        .collect()
}

/// The `top_k` clusters of the highest centroid `scores`, best first
/// (ties to the lower cluster).
pub fn kept_clusters(clusters: HeadClusters, scores: &[f32]) -> Vec<usize> {
    let mut ranked: Vec<usize> = (0..clusters.count).collect();
    ranked.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    ranked.truncate(clusters.top_k);
    ranked
}

/// The whole head's row `all` of one step (an assistant without
/// clusters): copied into `full` when given; returns its argmax.
pub fn full_head(all: &[f32], full: Option<&mut [f32]>) -> u32 {
    if let Some(full) = full {
        full.copy_from_slice(all);
    }
    crate::engine::ops::argmax(all) as u32
}

/// The clustered head of one step: the `top_k` clusters of the highest
/// centroid `scores` (ties to the lower cluster), each cluster's logits
/// from `cluster_logits(c, out)` (its `vocab / count` tokens in the order
/// `ordering` lists them). Writes the full row into `full` when given
/// (tokens of other clusters get the lowest computed logit minus 1, as
/// transformers fills them) and returns the argmax (the lowest id on a
/// tie, as over the full row).
pub fn clustered_head(
    clusters: HeadClusters,
    scores: &[f32],
    ordering: &[u32],
    mut cluster_logits: impl FnMut(usize, &mut [f32]),
    full: Option<&mut [f32]>,
) -> u32 {
    let per = ordering.len() / clusters.count;
    let kept = kept_clusters(clusters, scores);
    let mut logits = vec![0.0; per * kept.len()];
    for (&c, out) in kept.iter().zip(logits.chunks_exact_mut(per)) {
        cluster_logits(c, out);
    }
    let ids = kept.iter().flat_map(|&c| &ordering[c * per..(c + 1) * per]);
    let (mut best, mut best_logit) = (u32::MAX, f32::NEG_INFINITY);
    for (&id, &l) in ids.clone().zip(&logits) {
        if l > best_logit || (l == best_logit && id < best) {
            (best, best_logit) = (id, l);
        }
    }
    if let Some(full) = full {
        let floor = logits.iter().copied().fold(f32::INFINITY, f32::min) - 1.0;
        full.fill(floor);
        for (&id, &l) in ids.zip(&logits) {
            full[id as usize] = l;
        }
    }
    best
}
