//! One step of the fast engine's forward pass over its rows: the
//! embedding, each layer's attention block (with LAuReL beside it),
//! feed-forward block (with a mixture of experts beside it) and per-layer
//! input, AltUp's streams around them, the final norm, and the logits of
//! the rows that want them. Reads like the reference pass.

use super::matmul::Product;
use super::{FastEngine, Part};
use crate::engine::kernels::SharedOut;
use crate::engine::ops;
use crate::engine::packed::PackedMatrix;
use crate::engine::pool::split_range;
use crate::engine::q8_input::SPLIT_MIN_ROWS;
use crate::jit::emit::gemm_quant::TOKENS;
use crate::model::config::ModelConfig;
use anyhow::{Result, bail};

/// One step's activations, row-major `[tokens, width]`. Kept by the
/// engine and resized per step, never shrunk: sized once for a prefill
/// chunk, a decode step reuses the same memory. Where layers differ in
/// shape, each buffer is sized for the widest and a layer uses the front.
#[derive(Default)]
pub(super) struct Activations {
    pub(super) x: Vec<f32>,
    pub(super) normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    pub(super) proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    /// Gemma 4: every layer's per-layer input, `[tokens, layers x P]`.
    per_layer_inputs: Vec<f32>,
    /// Gemma 4: a layer's per-layer gate, `[tokens, P]`.
    per_layer_gate: Vec<f32>,
    /// Gemma 4's mixture: the experts' input and their weighted sum.
    expert_in: Vec<f32>,
    routed: Vec<f32>,
    /// Gemma 3n's AltUp: each token's streams, `[tokens, streams x
    /// hidden]`, and the inputs and outputs of the projections of streams
    /// 1.. (`[streams - 1][tokens, hidden]`).
    pub(super) streams: Vec<f32>,
    pub(super) altup_in: Vec<f32>,
    pub(super) altup_out: Vec<f32>,
    /// Gemma 3n's LAuReL: the low-rank product and the branch's output.
    laurel_mid: Vec<f32>,
    laurel: Vec<f32>,
}

impl Activations {
    /// Sets every buffer to `n` tokens' rows (contents are overwritten
    /// before they are read).
    pub(super) fn size_for(&mut self, c: &ModelConfig, n: usize) {
        let (q_dim, kv_dim, ffn) = (c.max_q_width(), c.max_kv_width(), c.max_ffn_width());
        let p = c.features.per_layer_input;
        let moe_rows = if c.features.moe.is_some() {
            c.hidden
        } else {
            0
        };
        let streams = c.features.altup.map_or(0, |a| a.streams);
        let rank = c.features.laurel_rank;
        let laurel_rows = if rank > 0 { c.hidden } else { 0 };
        for (buf, width) in [
            (&mut self.x, c.hidden),
            (&mut self.normed, c.hidden),
            (&mut self.q, q_dim),
            (&mut self.k, kv_dim),
            (&mut self.v, kv_dim),
            (&mut self.attn, q_dim),
            (&mut self.proj, c.hidden),
            (&mut self.gate, ffn),
            (&mut self.up, ffn),
            // Also the per-layer input's gated row.
            (&mut self.act, ffn.max(p)),
            (&mut self.per_layer_inputs, c.n_layers() * p),
            (&mut self.per_layer_gate, p),
            (&mut self.expert_in, moe_rows),
            (&mut self.routed, moe_rows),
            (&mut self.streams, streams * c.hidden),
            (&mut self.altup_in, streams.saturating_sub(1) * c.hidden),
            (&mut self.altup_out, streams.saturating_sub(1) * c.hidden),
            (&mut self.laurel_mid, rank),
            (&mut self.laurel, laurel_rows),
        ] {
            buf.resize(n * width, 0.0);
        }
    }
}

/// What a step's layers share: its parts, where each begins, how many
/// leading rows are exact, and the RoPE angles of every row's position.
struct Step<'a> {
    parts: &'a [Part],
    first_rows: Vec<usize>,
    exact: usize,
    /// One table per distinct RoPE of the model's layers (base, scale, head
    /// size and pairs rotated; a model has one or two): `(cos, sin)` per row.
    rope_tables: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    /// Each layer's index into `rope_tables`.
    rope_table_of: Vec<usize>,
}

impl<'a> Step<'a> {
    fn new(c: &ModelConfig, parts: &'a [Part]) -> Step<'a> {
        let first_rows = parts
            .iter()
            .scan(0, |row, p| {
                *row += p.n;
                Some(*row - p.n)
            })
            .collect();
        let positions: Vec<usize> = parts.iter().flat_map(|p| p.start..p.start + p.n).collect();
        let mut keys: Vec<(f32, f32, usize, usize)> = Vec::new();
        let mut rope_tables = Vec::new();
        let rope_table_of = c
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let s = c.shape(i);
                let key = (l.rope_base, l.rope_scale, s.head_dim, s.rotated_pairs);
                keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                    let angles = positions
                        .iter()
                        .map(|&pos| ops::rope_angles_partial(pos, key.2, key.0, key.1, key.3))
                        .collect();
                    keys.push(key);
                    rope_tables.push(angles);
                    rope_tables.len() - 1
                })
            })
            .collect();
        Step {
            parts,
            first_rows,
            exact: parts.iter().filter(|p| p.exact).map(|p| p.n).sum(),
            rope_tables,
            rope_table_of,
        }
    }

    fn angles_of_layer(&self, li: usize) -> &[(Vec<f32>, Vec<f32>)] {
        &self.rope_tables[self.rope_table_of[li]]
    }
}

impl FastEngine {
    /// Runs one step over the rows of `parts` (their tokens in `tokens`, in
    /// order, exact parts first) and returns the final-norm output of each
    /// row. Every part's tokens follow its sequence's cached ones. Reads
    /// like the reference pass: embed, then per layer an attention block
    /// and a feed-forward block, then the final norm.
    pub(super) fn forward_parts(&mut self, parts: &[Part], tokens: &[u32]) -> Result<Vec<f32>> {
        let n = tokens.len();
        debug_assert_eq!(parts.iter().map(|p| p.n).sum::<usize>(), n);
        debug_assert!(parts.iter().skip_while(|p| p.exact).all(|p| !p.exact));
        let step = Step::new(&self.config, parts);
        // The activations live in the engine between steps (sized once for
        // the largest step); taken out here so the blocks can borrow the
        // engine while writing them.
        let mut acts = std::mem::take(&mut self.activations);
        acts.size_for(&self.config, n);
        let result = self.embed(tokens, &mut acts).map(|()| {
            self.altup_streams(step.exact, &mut acts);
            for li in 0..self.config.n_layers() {
                self.altup_predict(li, &mut acts);
                self.attention_block(li, &step, &mut acts);
                self.feed_forward_block(li, step.exact, &mut acts);
                self.altup_correct(li, &mut acts);
                self.per_layer_input_block(li, step.exact, &mut acts);
            }
            self.altup_merge(step.exact, &mut acts);
            self.kernels.rms_norm_in_place(
                &mut acts.x,
                &self.weights.final_norm,
                self.config.rms_eps,
            );
            acts.x.clone()
        });
        self.activations = acts;
        if result.is_ok() {
            for p in parts {
                self.seqs[p.seq].len = p.start + p.n;
            }
        }
        result
    }

    /// Each token's scaled embedding row into `x`, and with per-layer
    /// inputs each token's input to every layer.
    fn embed(&self, tokens: &[u32], a: &mut Activations) -> Result<()> {
        let c = &self.config;
        let scale = (c.hidden as f32).sqrt();
        for (&token, row) in tokens.iter().zip(a.x.chunks_exact_mut(c.hidden)) {
            if token as usize >= c.vocab_size {
                bail!(
                    "token id {token} is outside the vocabulary (size {})",
                    c.vocab_size
                );
            }
            self.weights.embedding.row_f32(token as usize, row);
            row.iter_mut().for_each(|v| *v *= scale);
        }
        if let Some(table) = &self.weights.per_layer_input {
            let p = c.features.per_layer_input;
            let width = c.n_layers() * p;
            // The projection of the scaled embeddings, then per token
            // combined with its row of the table.
            self.matmul(
                &table.model_projection,
                &a.x,
                &mut a.per_layer_inputs,
                tokens.len(),
            );
            let out = SharedOut::new(&mut a.per_layer_inputs[..tokens.len() * width], width);
            self.over_tokens(tokens.len(), |rows| {
                let mut row = vec![0.0; width];
                for t in rows {
                    table
                        .embedding
                        .row_f32(c.per_layer_row(tokens[t]), &mut row);
                    // SAFETY: token row t is this call's alone.
                    let inputs = unsafe { out.rows_mut(t..t + 1) };
                    ops::combine_per_layer_inputs(
                        inputs,
                        &row,
                        &table.projection_norm,
                        c.hidden,
                        c.rms_eps,
                    );
                }
            });
        }
        Ok(())
    }

    /// Layer `li`'s attention: norm, q/k/v, q/k norms and RoPE, the new
    /// keys and values into each sequence's cache (unless the layer reads
    /// an earlier layer's), attention per part, the output projection and
    /// the residual.
    fn attention_block(&mut self, li: usize, step: &Step, a: &mut Activations) {
        let c = &self.config;
        let shape = c.shape(li);
        let n = a.x.len() / c.hidden;
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let q_dim = c.n_heads * shape.head_dim;
        let w = &self.weights.layers[li];
        self.rms_norm_rows(&a.x, &w.attn_norm, &mut a.normed);
        let (q, k, v) = (
            &mut a.q[..n * q_dim],
            &mut a.k[..n * kv_dim],
            &mut a.v[..n * kv_dim],
        );
        let mut jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])> = vec![(&w.q, &a.normed, q)];
        if let Some(wk) = &w.k {
            jobs.push((wk, &a.normed, k));
        }
        if let Some(wv) = &w.v {
            jobs.push((wv, &a.normed, v));
        }
        let rank = c.features.laurel_rank;
        if let Some(l) = &w.laurel {
            jobs.push((&l.left, &a.normed, &mut a.laurel_mid[..n * rank]));
        }
        self.matmuls(jobs, step.exact);
        let keeps_kv = w.k.is_some();
        if keeps_kv && w.v.is_none() {
            // k = v: the values are the raw keys, before K's norm and RoPE.
            a.v[..n * kv_dim].copy_from_slice(&a.k[..n * kv_dim]);
        }
        self.prepare_queries_keys(
            li,
            step.angles_of_layer(li),
            &mut a.q[..n * q_dim],
            keeps_kv.then_some(&mut a.k[..n * kv_dim]),
            keeps_kv.then_some(&mut a.v[..n * kv_dim]),
        );
        if keeps_kv {
            for (p, &row) in step.parts.iter().zip(&step.first_rows) {
                for t in 0..p.n {
                    let r = (row + t) * kv_dim..(row + t + 1) * kv_dim;
                    self.seqs[p.seq].store(li, p.start + t, &a.k[r.clone()], &a.v[r]);
                }
            }
        }
        // The exact parts come first: their tokens attend alone, all in one
        // parallel section.
        let exact_tokens: Vec<(usize, usize)> = step
            .parts
            .iter()
            .filter(|p| p.exact)
            .flat_map(|p| (0..p.n).map(|t| (p.seq, p.start + t)))
            .collect();
        let exact_rows = exact_tokens.len() * q_dim;
        if !exact_tokens.is_empty() {
            let (q, out) = (&a.q[..exact_rows], &mut a.attn[..exact_rows]);
            self.decode_attention(li, &exact_tokens, q, out);
        }
        for (p, &row) in step.parts.iter().zip(&step.first_rows) {
            if !p.exact {
                let rows = row * q_dim..(row + p.n) * q_dim;
                let (q, out) = (&a.q[rows.clone()], &mut a.attn[rows]);
                self.attention(p.seq, li, p.start, q, out, p.n);
            }
        }
        let w = &self.weights.layers[li];
        let mut jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])> =
            vec![(&w.o, &a.attn[..n * q_dim], &mut a.proj)];
        if let Some(l) = &w.laurel {
            jobs.push((&l.right, &a.laurel_mid[..n * rank], &mut a.laurel));
        }
        self.matmuls(jobs, step.exact);
        match &w.laurel {
            // LAuReL: x = (x + post_norm(attn) + h + norm(right(left(h)))) / √2.
            Some(l) => {
                self.kernels
                    .rms_norm_in_place(&mut a.laurel, &l.post_norm, c.rms_eps);
                for (v, h) in a.laurel.iter_mut().zip(&a.normed) {
                    *v += h;
                }
                if let Some(nw) = &w.attn_post_norm {
                    self.kernels.rms_norm_in_place(&mut a.proj, nw, c.rms_eps);
                }
                ops::laurel_residual(&mut a.x, &a.proj, &a.laurel);
            }
            None => self.residual_add(&mut a.x, &mut a.proj, w.attn_post_norm.as_deref()),
        }
    }

    /// Layer `li`'s feed-forward: norm, gate and up, GeGLU, down, with a
    /// mixture the experts beside it, and the residual. The experts read
    /// the residual rather than the dense MLP's output, so they are routed
    /// first and their products join the dense MLP's two parallel
    /// sections: a decode step of the 26B-A4B had four sections here (now
    /// three, the router's among them), each ending in a wait for its
    /// slowest thread.
    fn feed_forward_block(&self, li: usize, exact: usize, a: &mut Activations) {
        let c = &self.config;
        let w = &self.weights.layers[li];
        let n = a.x.len() / c.hidden;
        let width = c.shape(li).ffn_width;
        self.rms_norm_rows(&a.x, &w.ffn_norm, &mut a.normed);
        let mut mixture = match (&w.moe, c.features.moe) {
            (Some(moe), Some(shape)) => {
                Some(self.route_step(moe, shape, exact, &a.x, &mut a.expert_in))
            }
            _ => None,
        };
        let mut jobs: Vec<Product> = vec![
            (&w.gate, &a.normed, &mut a.gate[..n * width], exact),
            (&w.up, &a.normed, &mut a.up[..n * width], exact),
        ];
        if let Some(m) = &mut mixture {
            jobs.extend(m.gate_up_products(&a.expert_in));
        }
        self.products(jobs);
        if let Some(cut) = c.shape(li).sparsity_cut {
            self.sparsity_cut(&mut a.gate[..n * width], width, cut);
        }
        self.geglu(
            &a.gate[..n * width],
            &a.up[..n * width],
            &mut a.act[..n * width],
            n,
        );
        let mut jobs: Vec<Product> = vec![(&w.down, &a.act[..n * width], &mut a.proj, exact)];
        if let Some(m) = &mut mixture {
            m.geglu(&*self.kernels);
            jobs.extend(m.down_products());
        }
        self.products(jobs);
        if let (Some(moe), Some(m)) = (&w.moe, &mixture) {
            self.kernels
                .rms_norm_in_place(&mut a.proj, &moe.dense_post_norm, c.rms_eps);
            let routed = &mut a.routed[..n * c.hidden];
            m.weighted_sum(routed);
            self.kernels
                .rms_norm_in_place(routed, &moe.experts_post_norm, c.rms_eps);
            for (p, r) in a.proj.iter_mut().zip(routed.iter()) {
                *p += r;
            }
        }
        self.residual_add(&mut a.x, &mut a.proj, w.ffn_post_norm.as_deref());
    }

    /// The per-layer input of layer `li` (Gemma 3n and 4):
    /// `post_norm(projection(gelu(gate(x)) * input))` added to the
    /// residual, then the layer's scale on the whole stream. With AltUp the
    /// gate reads the corrected active stream (times its scale) and the
    /// result goes to every stream but 0.
    fn per_layer_input_block(&self, li: usize, exact: usize, a: &mut Activations) {
        let c = &self.config;
        let w = &self.weights.layers[li];
        if let Some(ple) = &w.per_layer_input {
            let p = c.features.per_layer_input;
            let h = c.hidden;
            let n = a.x.len() / h;
            let width = c.n_layers() * p;
            let gate_input = if c.features.altup.is_some() {
                self.per_layer_gate_input(li, a);
                &a.normed
            } else {
                &a.x
            };
            self.matmul(&ple.gate, gate_input, &mut a.per_layer_gate[..n * p], exact);
            // gelu(gate) * this layer's input, each token's row into `act`.
            let out = SharedOut::new(&mut a.act[..n * p], p);
            let (gates, inputs) = (&a.per_layer_gate, &a.per_layer_inputs);
            let kernels = &*self.kernels;
            self.over_tokens(n, |rows| {
                for t in rows {
                    let input = &inputs[t * width + li * p..t * width + (li + 1) * p];
                    // SAFETY: token row t is this call's alone.
                    let row = unsafe { out.rows_mut(t..t + 1) };
                    kernels.geglu(&gates[t * p..(t + 1) * p], input, row);
                }
            });
            self.matmul(&ple.projection, &a.act[..n * p], &mut a.proj, exact);
            match c.features.altup {
                Some(_) => {
                    self.kernels
                        .rms_norm_in_place(&mut a.proj, &ple.post_norm, c.rms_eps);
                    self.add_to_side_streams(a);
                }
                None => self.residual_add(&mut a.x, &mut a.proj, Some(&ple.post_norm)),
            }
        }
        if w.output_scale != 1.0 {
            let s = w.output_scale;
            a.x.iter_mut().for_each(|v| *v *= s);
        }
    }

    /// GeGLU of `n` token rows, split over the pool when there are several.
    pub(super) fn geglu(&self, gate: &[f32], up: &[f32], act: &mut [f32], n: usize) {
        let kern = &*self.kernels;
        if n == 1 {
            return kern.geglu(gate, up, act);
        }
        let width = act.len() / n;
        let out = SharedOut::new(act, width);
        let threads = self.pool.threads();
        self.pool.run(|tid| {
            let (t0, t1) = split_range(n, threads, tid, 1);
            let rows = t0 * width..t1 * width;
            // SAFETY: token rows t0..t1 belong to this thread alone.
            let part = unsafe { out.rows_mut(t0..t1) };
            kern.geglu(&gate[rows.clone()], &up[rows], part);
        });
    }

    /// x += post_norm(delta), row by row (a prompt's rows split over the
    /// pool, as [`FastEngine::rms_norm_rows`]).
    pub(super) fn residual_add(&self, x: &mut [f32], delta: &mut [f32], post_norm: Option<&[f32]>) {
        let (kern, eps) = (&*self.kernels, self.config.rms_eps);
        let add = |x: &mut [f32], delta: &mut [f32]| {
            if let Some(nw) = post_norm {
                kern.rms_norm_in_place(delta, nw, eps);
            }
            for (a, b) in x.iter_mut().zip(delta.iter()) {
                *a += b;
            }
        };
        // A row is as wide as its post-norm where there is one: an
        // assistant's rows are narrower than the target model's.
        let width = post_norm.map_or(self.config.hidden, <[f32]>::len);
        let rows = x.len() / width;
        if rows < SPLIT_MIN_ROWS {
            return add(x, delta);
        }
        let (mut x_left, mut delta_left) = (x, delta);
        let carve = |rows: usize| {
            let (x, x_rest) = std::mem::take(&mut x_left).split_at_mut(rows * width);
            let (delta, delta_rest) = std::mem::take(&mut delta_left).split_at_mut(rows * width);
            (x_left, delta_left) = (x_rest, delta_rest);
            (x, delta)
        };
        self.split_rows(rows, carve, |(x, delta)| add(x, delta));
    }

    /// `out = rms_norm(x) · w` row by row (`w.len()` wide). A prompt's
    /// rows are split over the pool as `Q8Input::quantize_on` splits them,
    /// so the thread that quantizes a row for the next product finds it
    /// in its own cache: made on the main thread alone, the worker's half
    /// crossed cores, and the main thread waited on that half.
    pub(super) fn rms_norm_rows(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        let (kern, eps) = (&*self.kernels, self.config.rms_eps);
        let width = w.len();
        let (mut x_left, mut out_left) = (x, &mut out[..x.len()]);
        let carve = |rows: usize| {
            let (x, x_rest) = x_left.split_at(rows * width);
            let (out, out_rest) = std::mem::take(&mut out_left).split_at_mut(rows * width);
            (x_left, out_left) = (x_rest, out_rest);
            (x, out)
        };
        self.split_rows(x.len() / width, carve, |(x, out)| {
            kern.rms_norm(x, w, out, eps)
        });
    }

    /// Runs `work` on `rows` token rows, each part's slices cut off the
    /// front by `carve(rows of the part)`: on the calling thread for a
    /// step of few tokens, else split over the pool in runs of whole
    /// 8-token tiles (`gemm_quant::TOKENS`), the runs
    /// `Q8Input::quantize_on` gives each thread at one input level.
    fn split_rows<T: Send>(
        &self,
        rows: usize,
        mut carve: impl FnMut(usize) -> T,
        work: impl Fn(T) + Sync,
    ) {
        if self.pool.threads() == 1 || rows < SPLIT_MIN_ROWS {
            return work(carve(rows));
        }
        self.pool.run_parts(rows, TOKENS, carve, work);
    }

    /// Logits of each row; the first `exact` as decode computes them.
    pub(super) fn logits_of(&self, normed_rows: &[f32], exact: usize) -> Vec<f32> {
        let c = &self.config;
        let n = normed_rows.len() / c.hidden * c.vocab_size;
        // Every value is written by the LM head's product, so a recycled
        // buffer's old values need no zeroing; only growth is zeroed.
        let mut logits =
            std::mem::take(&mut *self.spare_logits.lock().unwrap_or_else(|e| e.into_inner()));
        logits.truncate(n);
        logits.resize(n, 0.0);
        self.matmul(&self.weights.embedding, normed_rows, &mut logits, exact);
        if let Some(cap) = c.final_softcap {
            // Split over the pool: a row of Gemma's is 262,144 tanh.
            let all = SharedOut::new(&mut logits, 1);
            let (len, threads, kernels) = (all.rows(), self.pool.threads(), &*self.kernels);
            self.pool.run(|tid| {
                let (from, to) = split_range(len, threads, tid, 64);
                // SAFETY: values from..to are this thread's alone.
                kernels.softcap(unsafe { all.rows_mut(from..to) }, cap);
            });
        }
        logits
    }
}
