//! The reference forward pass: plain Rust, f32 compute on weights
//! dequantized to f32, one token at a time through a KV cache. It is the
//! oracle every JIT kernel and the fast engine are tested against; it is
//! not the fast path.

use super::kv_cache::KvCache;
use super::ops::{self, dot, matvec, rms_norm, rms_norm_in_place};
use super::{Engine, LogitsWanted};
use crate::model::config::ModelConfig;
use crate::model::source::ModelSource;
use crate::model::weights::{F32Matrix, LayerWeights, ModelWeights};
use anyhow::{Result, bail};

pub struct ReferenceEngine {
    config: ModelConfig,
    weights: ModelWeights<F32Matrix>,
    kv: KvCache,
}

/// Per-position snapshots of the residual stream, in the oracle's layout:
/// `[layers + 2][hidden]` per token: the scaled embedding, the stream after
/// each layer, and the final norm's output.
pub type HiddenTrace = Vec<Vec<Vec<f32>>>;

impl ReferenceEngine {
    pub fn load(src: &ModelSource) -> Result<ReferenceEngine> {
        let weights = ModelWeights::load(src, |_, t| {
            let m = F32Matrix::from_view(&t);
            t.release_pages();
            Ok(m)
        })?;
        Ok(Self::new(src.config.clone(), weights))
    }

    pub fn new(config: ModelConfig, weights: ModelWeights<F32Matrix>) -> ReferenceEngine {
        let kv = KvCache::new(&config);
        ReferenceEngine {
            config,
            weights,
            kv,
        }
    }

    /// Runs `tokens` after the cached ones, recording the hidden states of
    /// every position into `trace` when given; returns the final-norm output
    /// of each position.
    fn run(
        &mut self,
        tokens: &[u32],
        mut trace: Option<&mut HiddenTrace>,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let mut finals = Vec::with_capacity(tokens.len());
        for &token in tokens {
            if token as usize >= c.vocab_size {
                bail!(
                    "token id {token} is outside the vocabulary (size {})",
                    c.vocab_size
                );
            }
            let pos = self.kv.len();
            let mut snapshots = Vec::new();
            // Embedding scaled by sqrt(hidden), computed in f32.
            let scale = (c.hidden as f32).sqrt();
            let mut x: Vec<f32> = self
                .weights
                .embedding
                .row(token as usize)
                .iter()
                .map(|v| v * scale)
                .collect();
            snapshots.push(x.clone());
            for (i, layer) in self.weights.layers.iter().enumerate() {
                layer_step(c, i, layer, &mut self.kv, pos, &mut x);
                snapshots.push(x.clone());
            }
            self.kv.advance();
            rms_norm_in_place(&mut x, &self.weights.final_norm, c.rms_eps);
            snapshots.push(x.clone());
            if let Some(t) = trace.as_deref_mut() {
                t.push(snapshots);
            }
            finals.push(x);
        }
        Ok(finals)
    }

    fn logits_of(&self, normed: &[f32]) -> Vec<f32> {
        let mut logits = vec![0.0; self.config.vocab_size];
        matvec(&self.weights.embedding.data, normed, &mut logits);
        if let Some(cap) = self.config.final_softcap {
            for l in &mut logits {
                *l = ops::softcap(*l, cap);
            }
        }
        logits
    }

    /// Like [`Engine::forward`] with every position's logits, also returning
    /// the hidden-state trace of each position.
    pub fn forward_traced(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, HiddenTrace)> {
        let mut trace = Vec::new();
        let finals = self.run(tokens, Some(&mut trace))?;
        let logits = finals.iter().flat_map(|h| self.logits_of(h)).collect();
        Ok((logits, trace))
    }
}

impl Engine for ReferenceEngine {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn position(&self) -> usize {
        self.kv.len()
    }

    fn capacity(&self) -> usize {
        self.config.max_context
    }

    fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
    }

    fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        let finals = self.run(tokens, None)?;
        Ok(match wanted {
            LogitsWanted::All => finals.iter().flat_map(|h| self.logits_of(h)).collect(),
            LogitsWanted::Last => finals.last().map(|h| self.logits_of(h)).unwrap_or_default(),
        })
    }

    fn final_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self.run(tokens, None)?.concat())
    }
}

/// One transformer block for the token at `pos`, updating the residual
/// stream `x` in place and appending this position's K and V to the cache.
fn layer_step(
    c: &ModelConfig,
    layer_index: usize,
    w: &LayerWeights<F32Matrix>,
    kv: &mut KvCache,
    pos: usize,
    x: &mut [f32],
) {
    let hd = c.head_dim;
    let mut normed = vec![0.0; c.hidden];
    rms_norm(x, &w.attn_norm, c.rms_eps, &mut normed);

    let mut q = vec![0.0; c.n_heads * hd];
    let mut k = vec![0.0; c.n_kv_heads * hd];
    let mut v = vec![0.0; c.n_kv_heads * hd];
    matvec(&w.q.data, &normed, &mut q);
    matvec(&w.k.data, &normed, &mut k);
    matvec(&w.v.data, &normed, &mut v);

    let attn = c.layers[layer_index];
    let (cos, sin) = ops::rope_angles(pos, hd, attn.rope_base, attn.rope_scale);
    for head in q.chunks_exact_mut(hd) {
        if let Some(n) = &w.q_norm {
            rms_norm_in_place(head, n, c.rms_eps);
        }
        ops::rope(head, &cos, &sin);
        for e in head.iter_mut() {
            *e *= c.query_scale;
        }
    }
    for head in k.chunks_exact_mut(hd) {
        if let Some(n) = &w.k_norm {
            rms_norm_in_place(head, n, c.rms_eps);
        }
        ops::rope(head, &cos, &sin);
    }
    kv.store(layer_index, &k, &v);

    // Keys visible to this query: q - window < key <= q.
    let first = match attn.window {
        Some(win) => (pos + 1).saturating_sub(win),
        None => 0,
    };
    let group = c.n_heads / c.n_kv_heads;
    let mut attn_out = vec![0.0; c.n_heads * hd];
    let mut scores = vec![0.0; pos + 1 - first];
    for h in 0..c.n_heads {
        let kv_head = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        for (s, key_pos) in scores.iter_mut().zip(first..=pos) {
            let score = dot(qh, kv.key(layer_index, key_pos, kv_head));
            *s = match c.attn_softcap {
                Some(cap) => ops::softcap(score, cap),
                None => score,
            };
        }
        ops::softmax(&mut scores);
        let out = &mut attn_out[h * hd..(h + 1) * hd];
        for (&p, key_pos) in scores.iter().zip(first..=pos) {
            for (o, &val) in out.iter_mut().zip(kv.value(layer_index, key_pos, kv_head)) {
                *o += p * val;
            }
        }
    }
    let mut projected = vec![0.0; c.hidden];
    matvec(&w.o.data, &attn_out, &mut projected);
    if let Some(n) = &w.attn_post_norm {
        rms_norm_in_place(&mut projected, n, c.rms_eps);
    }
    for (xi, a) in x.iter_mut().zip(&projected) {
        *xi += a;
    }

    // Feed-forward: down(gelu(gate(h)) * up(h)).
    rms_norm(x, &w.ffn_norm, c.rms_eps, &mut normed);
    let mut gate = vec![0.0; c.intermediate];
    let mut up = vec![0.0; c.intermediate];
    matvec(&w.gate.data, &normed, &mut gate);
    matvec(&w.up.data, &normed, &mut up);
    for (g, u) in gate.iter_mut().zip(&up) {
        *g = ops::gelu_tanh(*g) * u;
    }
    matvec(&w.down.data, &gate, &mut projected);
    if let Some(n) = &w.ffn_post_norm {
        rms_norm_in_place(&mut projected, n, c.rms_eps);
    }
    for (xi, f) in x.iter_mut().zip(&projected) {
        *xi += f;
    }
}
