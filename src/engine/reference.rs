//! The reference forward pass: plain Rust, f32 compute on weights
//! dequantized to f32, one token at a time through a KV cache. It is the
//! oracle every JIT kernel and the fast engine are tested against; it is
//! not the fast path.

use super::assistant::{self, Assistant};
use super::kv_cache::KvCache;
use super::ops::{self, dot, matvec, rms_norm, rms_norm_in_place};
use super::{Engine, LogitsWanted};
use crate::model::config::ModelConfig;
use crate::model::source::ModelSource;
use crate::model::weights::{
    AltUpStreams, F32Matrix, LayerWeights, ModelWeights, MoeWeights, PerLayerInputTable,
};
use anyhow::{Result, bail};
use std::path::Path;

pub struct ReferenceEngine {
    config: ModelConfig,
    weights: ModelWeights<F32Matrix>,
    kv: KvCache,
    /// A Gemma 4 assistant to draft with ([`Engine::draft`]).
    assistant: Option<Assistant<F32Matrix>>,
    /// With an assistant: the final hidden states of the last run's
    /// positions, from `last_start` on (a draft round reads the one of
    /// the last cached position, whatever was cut back since).
    last_finals: Vec<Vec<f32>>,
    last_start: usize,
}

/// Per-position snapshots of the residual stream, in the oracle's layout:
/// `[layers + 2][hidden]` per token: the scaled embedding, the stream after
/// each layer, and the final norm's output. With AltUp (Gemma 3n), the
/// stream after each layer is stream 0.
pub type HiddenTrace = Vec<Vec<Vec<f32>>>;

impl ReferenceEngine {
    pub fn load(src: &ModelSource) -> Result<ReferenceEngine> {
        crate::model::gemma4_assistant::refuse_as_model(&src.config, &src.path)?;
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
            assistant: None,
            last_finals: Vec::new(),
            last_start: 0,
        }
    }

    /// Loads the Gemma 4 assistant `src` for this engine's model (at
    /// `target_path`) to draft with, checking that they fit.
    pub fn attach_assistant(&mut self, src: &ModelSource, target_path: &Path) -> Result<()> {
        let assistant = Assistant::load(src, &self.config, target_path, |_, t| {
            Ok(F32Matrix::from_view(&t))
        })?;
        self.assistant = Some(assistant);
        Ok(())
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
        let start = self.kv.len();
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
            let inputs = self
                .weights
                .per_layer_input
                .as_ref()
                .map(|table| per_layer_inputs(c, table, token, &x));
            let mut streams = self.weights.altup.as_ref().map(|a| altup_streams(a, &x));
            let p = c.features.per_layer_input;
            for (i, layer) in self.weights.layers.iter().enumerate() {
                let input = inputs.as_ref().map(|all| &all[i * p..(i + 1) * p]);
                let keys = KeySource::Own(&mut self.kv);
                layer_step(
                    c,
                    i,
                    layer,
                    keys,
                    pos,
                    &mut x,
                    streams.as_deref_mut(),
                    input,
                );
                snapshots.push(match &streams {
                    Some(s) => s[..c.hidden].to_vec(),
                    None => x.clone(),
                });
            }
            if let (Some(a), Some(s)) = (&self.weights.altup, &streams) {
                x = altup_merge(a, s);
            }
            self.kv.advance();
            rms_norm_in_place(&mut x, &self.weights.final_norm, c.rms_eps);
            snapshots.push(x.clone());
            if let Some(t) = trace.as_deref_mut() {
                t.push(snapshots);
            }
            finals.push(x);
        }
        if self.assistant.is_some() {
            self.last_finals = finals.clone();
            self.last_start = start;
        }
        Ok(finals)
    }

    /// One draft round of the attached assistant (see [`Engine::draft`]).
    fn draft_round(
        &self,
        token: u32,
        k: usize,
        mut logits: Option<&mut Vec<f32>>,
    ) -> Result<Vec<u32>> {
        let Some(a) = &self.assistant else {
            bail!("no assistant is attached to draft with (give one with --draft)");
        };
        let pos = self.kv.len();
        assistant::check_round(&self.config, token, k, pos)?;
        let mut h = pos
            .checked_sub(self.last_start + 1)
            .and_then(|i| self.last_finals.get(i))
            .cloned()
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "internal error: the target's hidden state at position {} was not kept",
                    pos - 1
                )
            })?;
        let (ac, aw) = (&a.config, &a.weights);
        let extra = aw.assistant.as_ref().ok_or_else(|| {
            anyhow::anyhow!("internal error: the assistant's projections are missing")
        })?;
        let vocab = ac.vocab_size;
        let mut tokens = Vec::with_capacity(k);
        let mut next = token;
        for _ in 0..k {
            let input = assistant::step_input(self.weights.embedding.row(next as usize), &h);
            let mut x = vec![0.0; ac.hidden];
            matvec(&extra.pre_projection.data, &input, &mut x);
            for (l, layer) in aw.layers.iter().enumerate() {
                let keys = KeySource::Target {
                    cache: &self.kv,
                    layer: a.target_layers[l],
                    keys: a.visible_keys(l, pos),
                };
                layer_step(ac, l, layer, keys, pos, &mut x, None, None);
            }
            rms_norm_in_place(&mut x, &aw.final_norm, ac.rms_eps);
            matvec(&extra.post_projection.data, &x, &mut h);
            let mut row = logits.as_ref().map(|_| vec![0.0; vocab]);
            next = match (&extra.clusters, assistant::clusters(ac)) {
                (Some(head), Some(shape)) => {
                    let mut scores = vec![0.0; shape.count];
                    matvec(&head.centroids.data, &x, &mut scores);
                    let per = vocab / shape.count;
                    let ordering = &head.token_ordering;
                    let cluster = |c: usize, out: &mut [f32]| {
                        for (o, &id) in out.iter_mut().zip(&ordering[c * per..(c + 1) * per]) {
                            *o = dot(aw.embedding.row(id as usize), &x);
                        }
                    };
                    assistant::clustered_head(shape, &scores, ordering, cluster, row.as_deref_mut())
                }
                _ => {
                    let mut all = vec![0.0; vocab];
                    matvec(&aw.embedding.data, &x, &mut all);
                    assistant::full_head(&all, row.as_deref_mut())
                }
            };
            if let (Some(out), Some(row)) = (logits.as_deref_mut(), row) {
                out.extend_from_slice(&row);
            }
            tokens.push(next);
        }
        Ok(tokens)
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

    fn can_draft(&self) -> bool {
        self.assistant.is_some()
    }

    fn draft(&mut self, token: u32, k: usize, logits: Option<&mut Vec<f32>>) -> Result<Vec<u32>> {
        self.draft_round(token, k, logits)
    }
}

/// Where a layer's attention reads keys and values.
enum KeySource<'a> {
    /// The model's own cache: the layer stores this position's keys first
    /// (unless it reads an earlier layer's), then attends over its window
    /// up to and including `pos`.
    Own(&'a mut KvCache),
    /// A Gemma 4 assistant's layer: the target's cache of layer `layer`,
    /// positions `keys` (the query has no keys of its own).
    Target {
        cache: &'a KvCache,
        layer: usize,
        keys: std::ops::Range<usize>,
    },
}

/// One transformer block for the token at `pos`, updating the residual
/// stream `x` in place and, reading its own cache, appending this
/// position's K and V to it (unless the layer reads an earlier layer's).
/// `per_layer_input` is this layer's part of the token's per-layer input
/// (Gemma 3n and 4), if any.
///
/// With AltUp (Gemma 3n) the residual is `streams` (`[streams][hidden]`):
/// the block runs on the active stream's prediction in `x`, then corrects
/// every stream with what it added; `x` is scratch between layers.
#[allow(clippy::too_many_arguments)]
fn layer_step(
    c: &ModelConfig,
    layer_index: usize,
    w: &LayerWeights<F32Matrix>,
    mut keys: KeySource<'_>,
    pos: usize,
    x: &mut [f32],
    mut streams: Option<&mut [f32]>,
    per_layer_input: Option<&[f32]>,
) {
    let shape = c.shape(layer_index);
    let hd = shape.head_dim;
    let h = c.hidden;
    let active = c.features.altup.map_or(0, |a| a.active);
    if let (Some(a), Some(s)) = (&w.altup, streams.as_deref_mut()) {
        let m = ops::altup_route(
            &a.router.data,
            &a.router_input_scale,
            &s[active * h..(active + 1) * h],
            c.rms_eps,
        );
        ops::altup_predict(s, h, &a.predict.data, &m);
        x.copy_from_slice(&s[active * h..(active + 1) * h]);
    }
    let mut normed = vec![0.0; c.hidden];
    rms_norm(x, &w.attn_norm, c.rms_eps, &mut normed);
    // LAuReL: h + norm(right(left(h))) beside attention.
    let laurel = w.laurel.as_ref().map(|l| {
        let mut mid = vec![0.0; l.left.rows];
        matvec(&l.left.data, &normed, &mut mid);
        let mut out = vec![0.0; c.hidden];
        matvec(&l.right.data, &mid, &mut out);
        rms_norm_in_place(&mut out, &l.post_norm, c.rms_eps);
        for (o, n) in out.iter_mut().zip(&normed) {
            *o += n;
        }
        out
    });

    let mut q = vec![0.0; c.n_heads * hd];
    matvec(&w.q.data, &normed, &mut q);
    let attn = c.layers[layer_index];
    let (cos, sin) = ops::rope_angles_partial(
        pos,
        hd,
        attn.rope_base,
        attn.rope_scale,
        shape.rotated_pairs,
    );
    for head in q.chunks_exact_mut(hd) {
        if let Some(n) = &w.q_norm {
            rms_norm_in_place(head, n, c.rms_eps);
        }
        ops::rope(head, &cos, &sin);
        for e in head.iter_mut() {
            *e *= c.query_scale;
        }
    }
    if let (Some(k_matrix), KeySource::Own(kv)) = (&w.k, &mut keys) {
        let kv_width = shape.n_kv_heads * hd;
        let mut k = vec![0.0; kv_width];
        matvec(&k_matrix.data, &normed, &mut k);
        // With k = v the values are the raw keys, before K's norm and RoPE.
        let mut v = match &w.v {
            Some(v_matrix) => {
                let mut v = vec![0.0; kv_width];
                matvec(&v_matrix.data, &normed, &mut v);
                v
            }
            None => k.clone(),
        };
        for head in k.chunks_exact_mut(hd) {
            if let Some(n) = &w.k_norm {
                rms_norm_in_place(head, n, c.rms_eps);
            }
            ops::rope(head, &cos, &sin);
        }
        if c.features.value_norm {
            v.chunks_exact_mut(hd)
                .for_each(|head| ops::rms_normalize(head, c.rms_eps));
        }
        kv.store(layer_index, &k, &v);
    }

    let (kv, cache_layer, visible) = match keys {
        // Keys visible to this query: q - window < key <= q.
        KeySource::Own(kv) => {
            let first = match attn.window {
                Some(win) => (pos + 1).saturating_sub(win),
                None => 0,
            };
            (&*kv, shape.kv_layer, first..pos + 1)
        }
        KeySource::Target { cache, layer, keys } => (cache, layer, keys),
    };
    let group = c.n_heads / shape.n_kv_heads;
    let mut attn_out = vec![0.0; c.n_heads * hd];
    let mut scores = vec![0.0; visible.len()];
    for h in 0..c.n_heads {
        let kv_head = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        for (s, key_pos) in scores.iter_mut().zip(visible.clone()) {
            let score = dot(qh, kv.key(cache_layer, key_pos, kv_head));
            *s = match c.attn_softcap {
                Some(cap) => ops::softcap(score, cap),
                None => score,
            };
        }
        ops::softmax(&mut scores);
        let out = &mut attn_out[h * hd..(h + 1) * hd];
        for (&p, key_pos) in scores.iter().zip(visible.clone()) {
            for (o, &val) in out.iter_mut().zip(kv.value(cache_layer, key_pos, kv_head)) {
                *o += p * val;
            }
        }
    }
    let mut projected = vec![0.0; c.hidden];
    matvec(&w.o.data, &attn_out, &mut projected);
    if let Some(n) = &w.attn_post_norm {
        rms_norm_in_place(&mut projected, n, c.rms_eps);
    }
    match &laurel {
        Some(l) => ops::laurel_residual(x, &projected, l),
        None => {
            for (xi, a) in x.iter_mut().zip(&projected) {
                *xi += a;
            }
        }
    }

    // Feed-forward: down(gelu(gate(h)) * up(h)), and with a mixture the
    // experts' weighted sum beside it.
    rms_norm(x, &w.ffn_norm, c.rms_eps, &mut normed);
    mlp(
        &w.gate,
        &w.up,
        &w.down,
        &normed,
        shape.sparsity_cut,
        &mut projected,
    );
    if let Some(moe) = &w.moe {
        rms_norm_in_place(&mut projected, &moe.dense_post_norm, c.rms_eps);
        let mut routed = vec![0.0; c.hidden];
        experts_step(c, moe, x, &mut routed);
        rms_norm_in_place(&mut routed, &moe.experts_post_norm, c.rms_eps);
        for (p, r) in projected.iter_mut().zip(&routed) {
            *p += r;
        }
    }
    if let Some(n) = &w.ffn_post_norm {
        rms_norm_in_place(&mut projected, n, c.rms_eps);
    }
    for (xi, f) in x.iter_mut().zip(&projected) {
        *xi += f;
    }

    if let (Some(a), Some(s)) = (&w.altup, streams.as_deref_mut()) {
        let m = ops::altup_route(&a.router.data, &a.router_input_scale, x, c.rms_eps);
        ops::altup_correct(s, h, &a.correct.data, &m, x, active);
    }

    if let (Some(ple), Some(input)) = (&w.per_layer_input, per_layer_input) {
        // The gate reads the residual; with AltUp the corrected active
        // stream, times its scale.
        let gate_input: Vec<f32> = match (&streams, &w.altup) {
            (Some(s), Some(a)) => {
                let stream = &s[active * h..(active + 1) * h];
                match &a.correct_output_scale {
                    Some(scale) => stream.iter().zip(scale).map(|(v, s)| v * s).collect(),
                    None => stream.to_vec(),
                }
            }
            _ => x.to_vec(),
        };
        let mut gate = vec![0.0; input.len()];
        matvec(&ple.gate.data, &gate_input, &mut gate);
        for (g, &p) in gate.iter_mut().zip(input) {
            *g = ops::gelu_tanh(*g) * p;
        }
        matvec(&ple.projection.data, &gate, &mut projected);
        rms_norm_in_place(&mut projected, &ple.post_norm, c.rms_eps);
        match streams {
            // Every stream but 0 (transformers and llama.cpp name stream 0,
            // not the active one).
            Some(s) => {
                for stream in s.chunks_exact_mut(h).skip(1) {
                    for (v, p) in stream.iter_mut().zip(&projected) {
                        *v += p;
                    }
                }
            }
            None => {
                for (xi, p) in x.iter_mut().zip(&projected) {
                    *xi += p;
                }
            }
        }
    }
    if w.output_scale != 1.0 {
        x.iter_mut().for_each(|v| *v *= w.output_scale);
    }
}

/// AltUp's streams of a token from its scaled embedding `x0`
/// (`[streams][hidden]`): stream 0 is `x0`, stream k its k-th projection
/// rescaled to the RMS of `x0`.
fn altup_streams(a: &AltUpStreams<F32Matrix>, x0: &[f32]) -> Vec<f32> {
    let h = x0.len();
    let target = ops::rms(x0);
    let mut streams = vec![0.0; (a.projections.len() + 1) * h];
    streams[..h].copy_from_slice(x0);
    for (p, s) in a.projections.iter().zip(streams[h..].chunks_exact_mut(h)) {
        matvec(&p.data, x0, s);
        ops::match_rms(s, target);
    }
    streams
}

/// The residual AltUp's streams leave for the final norm: the mean of
/// stream 0 and each other stream's unembedding, rescaled to the RMS of
/// stream 0.
fn altup_merge(a: &AltUpStreams<F32Matrix>, streams: &[f32]) -> Vec<f32> {
    let n = a.unembed.len() + 1;
    let h = streams.len() / n;
    let first = &streams[..h];
    let target = ops::rms(first);
    let mut sum = first.to_vec();
    let mut t = vec![0.0; h];
    for (u, s) in a.unembed.iter().zip(streams[h..].chunks_exact(h)) {
        matvec(&u.data, s, &mut t);
        ops::match_rms(&mut t, target);
        for (acc, v) in sum.iter_mut().zip(&t) {
            *acc += v;
        }
    }
    sum.iter_mut().for_each(|v| *v /= n as f32);
    sum
}

/// `out = down(gelu(gate(h)) * up(h))`, with Gemma 3n's activation
/// sparsity cutting `gate(h)` first where the layer has it.
fn mlp(
    gate: &F32Matrix,
    up: &F32Matrix,
    down: &F32Matrix,
    h: &[f32],
    sparsity_cut: Option<f32>,
    out: &mut [f32],
) {
    let mut g = vec![0.0; gate.rows];
    let mut u = vec![0.0; up.rows];
    matvec(&gate.data, h, &mut g);
    if let Some(cut) = sparsity_cut {
        ops::gaussian_top_k(&mut g, cut);
    }
    matvec(&up.data, h, &mut u);
    for (g, u) in g.iter_mut().zip(&u) {
        *g = ops::gelu_tanh(*g) * u;
    }
    matvec(&down.data, &g, out);
}

/// The mixture's output for the residual `x` (before the feed-forward's
/// norm, which the router reads): the routed experts' weighted sum.
fn experts_step(c: &ModelConfig, moe: &MoeWeights<F32Matrix>, x: &[f32], out: &mut [f32]) {
    let top_k = c.features.moe.map_or(0, |m| m.top_k);
    let routes = ops::route_token(
        &moe.router.data,
        &moe.router_input_scale,
        &moe.expert_scale,
        x,
        top_k,
        c.rms_eps,
    );
    let mut expert_in = vec![0.0; c.hidden];
    rms_norm(x, &moe.norm, c.rms_eps, &mut expert_in);
    let mut expert_out = vec![0.0; c.hidden];
    out.fill(0.0);
    for (e, weight) in routes {
        let expert = &moe.experts[e];
        mlp(
            &expert.gate,
            &expert.up,
            &expert.down,
            &expert_in,
            None,
            &mut expert_out,
        );
        for (o, v) in out.iter_mut().zip(&expert_out) {
            *o += weight * v;
        }
    }
}

/// Each layer's per-layer input for a token (Gemma 4), `[layers][P]`: the
/// token's row of the table times sqrt(P), plus the normalised projection
/// of the scaled embedding `x0`, times 2^-1/2.
pub fn per_layer_inputs(
    c: &ModelConfig,
    table: &PerLayerInputTable<F32Matrix>,
    token: u32,
    x0: &[f32],
) -> Vec<f32> {
    let p = c.features.per_layer_input;
    let mut projected = vec![0.0; c.n_layers() * p];
    matvec(&table.model_projection.data, x0, &mut projected);
    let mut row = vec![0.0; c.n_layers() * p];
    table.embedding.row_f32(c.per_layer_row(token), &mut row);
    ops::combine_per_layer_inputs(
        &mut projected,
        &row,
        &table.projection_norm,
        c.hidden,
        c.rms_eps,
    );
    projected
}
