//! The fast engine's attention: a prefill chunk's causal (and windowed)
//! attention in units of a KV head and a block of tokens, and the exact
//! tokens' (decode's) with each token's keys split into parts merged by
//! their softmax mass; before either, the queries' and keys' norms and
//! RoPE.

use super::FastEngine;
use crate::engine::kernels::{GroupAttention, SharedOut, merge_key_parts};
use crate::engine::key_split::{KeySplit, attention_units};
use crate::engine::ops;
use std::sync::atomic::{AtomicUsize, Ordering};

/// What single-token attention reads of one cached layer.
#[derive(Clone, Copy, Debug)]
pub(super) struct CachedLayer {
    /// The layer whose keys and values are read.
    pub cache: usize,
    pub head_dim: usize,
    pub n_kv_heads: usize,
    /// Query heads, grouped evenly over the KV heads.
    pub n_heads: usize,
    /// `Some(w)`: a query at q sees keys k with q - w < k <= q.
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl FastEngine {
    /// Per token, in parallel: q/k norms, RoPE with the given angles (one
    /// pair of tables per token) and the query scale; with a V norm, V's
    /// heads normalised. `k` and `v` are `None` in a layer that reads an
    /// earlier layer's cache.
    pub(super) fn prepare_queries_keys(
        &self,
        li: usize,
        angles: &[(Vec<f32>, Vec<f32>)],
        q: &mut [f32],
        k: Option<&mut [f32]>,
        v: Option<&mut [f32]>,
    ) {
        let c = &self.config;
        let w = &self.weights.layers[li];
        let shape = c.shape(li);
        let (hd, n) = (shape.head_dim, angles.len());
        let kv_dim = shape.n_kv_heads * hd;
        let qs = SharedOut::new(q, c.n_heads * hd);
        let ks = k.map(|k| SharedOut::new(k, kv_dim));
        let vs = v
            .filter(|_| c.features.value_norm)
            .map(|v| SharedOut::new(v, kv_dim));
        let kern = &*self.kernels;
        let prepare = |t: usize| {
            let (cos, sin) = &angles[t];
            // SAFETY: token t's rows belong to one caller of `prepare`.
            let q_row = unsafe { qs.cells(t, 0..qs.stride) };
            if let Some(nw) = &w.q_norm {
                kern.rms_norm_in_place(q_row, nw, c.rms_eps);
            }
            for head in q_row.chunks_exact_mut(hd) {
                ops::rope(head, cos, sin);
                if c.query_scale != 1.0 {
                    head.iter_mut().for_each(|e| *e *= c.query_scale);
                }
            }
            if let Some(ks) = &ks {
                // SAFETY: as above.
                let k_row = unsafe { ks.cells(t, 0..ks.stride) };
                if let Some(nw) = &w.k_norm {
                    kern.rms_norm_in_place(k_row, nw, c.rms_eps);
                }
                for head in k_row.chunks_exact_mut(hd) {
                    ops::rope(head, cos, sin);
                }
            }
            if let Some(vs) = &vs {
                // SAFETY: as above.
                let v_row = unsafe { vs.cells(t, 0..vs.stride) };
                for head in v_row.chunks_exact_mut(hd) {
                    ops::rms_normalize(head, c.rms_eps);
                }
            }
        };
        // A single decode token is not worth waking the pool for.
        if n == 1 {
            return prepare(0);
        }
        let threads = self.pool.threads();
        self.pool
            .run(|tid| (tid..n).step_by(threads).for_each(prepare));
    }

    /// Causal (and windowed) attention of `n` new queries at positions
    /// `start..start+n` over the cache. A unit of work is one KV head, a
    /// block of tokens and the query heads sharing that KV head (split when
    /// a short chunk leaves too few units for the threads), so each K and V
    /// row is read once per block rather than once per query head. A single
    /// token (decode) splits its keys instead: see `decode_attention`.
    pub(super) fn attention(
        &self,
        seq: usize,
        li: usize,
        start: usize,
        q: &[f32],
        out: &mut [f32],
        n: usize,
    ) {
        let c = &self.config;
        let kv = &self.seqs[seq];
        let shape = c.shape(li);
        let (hd, n_kv_heads, cache) = (shape.head_dim, shape.n_kv_heads, shape.kv_layer);
        let q_dim = c.n_heads * hd;
        let group = c.n_heads / n_kv_heads;
        let window = c.layers[li].window;
        let (keys, values) = (&kv.keys[cache], &kv.values[cache]);
        let threads = self.pool.threads();
        if n == 1 {
            return self.decode_attention(li, &[(seq, start)], q, out);
        }
        let token_block = self.blocking.attention_token_block;
        let blocks = n.div_ceil(token_block);
        let head_parts = if blocks * n_kv_heads >= threads {
            1
        } else {
            group.min(threads.div_ceil(blocks * n_kv_heads))
        };
        let heads_per_part = group.div_ceil(head_parts);
        let units = n_kv_heads * blocks * head_parts;
        let next = AtomicUsize::new(0);
        let shared = SharedOut::new(out, q_dim);
        let kern = &*self.kernels;
        self.pool.run(|_| {
            // Sized for the largest unit up front: growing them would copy.
            let rows = token_block * heads_per_part;
            let max_keys = window.map_or(start + n, |w| (w + token_block).min(start + n));
            let mut queries = Vec::with_capacity(rows * hd);
            let mut result = Vec::with_capacity(rows * hd);
            let mut scratch = Vec::with_capacity(rows * max_keys);
            loop {
                let taken = next.fetch_add(1, Ordering::Relaxed);
                if taken >= units {
                    break;
                }
                // Later token blocks see more keys: hand them out first.
                let unit = units - 1 - taken;
                let (kv_head, rest) = (unit % n_kv_heads, unit / n_kv_heads);
                let (block, part) = (rest / head_parts, rest % head_parts);
                let (t0, t1) = (block * token_block, ((block + 1) * token_block).min(n));
                let (h0, h1) = (
                    part * heads_per_part,
                    ((part + 1) * heads_per_part).min(group),
                );
                if h0 >= h1 {
                    continue;
                }
                let head_col = |t: usize, h: usize| t * q_dim + (kv_head * group + h) * hd;
                queries.clear();
                for t in t0..t1 {
                    for h in h0..h1 {
                        queries.extend_from_slice(&q[head_col(t, h)..head_col(t, h) + hd]);
                    }
                }
                let first_query = start + t0;
                let first_key = window.map_or(0, |w| (first_query + 1).saturating_sub(w));
                let (lo, hi) = (
                    kv.at(cache, kv_head, first_key),
                    kv.at(cache, kv_head, start + t1),
                );
                let block_attention = GroupAttention {
                    queries: &queries,
                    head_dim: hd,
                    rows_per_token: h1 - h0,
                    first_query,
                    keys: &keys[lo..hi],
                    values: &values[lo..hi],
                    first_key,
                    window,
                    softcap: c.attn_softcap,
                };
                result.resize(queries.len(), 0.0);
                kern.attend(&block_attention, &mut scratch, &mut result, None);
                for (i, row) in result.chunks_exact(hd).enumerate() {
                    let (t, h) = (t0 + i / (h1 - h0), h0 + i % (h1 - h0));
                    let col = (kv_head * group + h) * hd;
                    // SAFETY: each (token, head) belongs to exactly one unit.
                    unsafe { shared.cells(t, col..col + hd) }.copy_from_slice(row);
                }
            }
        });
    }

    /// Attention of single tokens, each with its keys split into parts:
    /// token `i` is sequence `tokens[i].0`'s position `tokens[i].1`, its
    /// queries row `i` of `q` and its result row `i` of `out`. A unit of
    /// work is one part of a KV head's keys for a run of the step's tokens
    /// (`key_split`): all the query heads sharing that KV head, and every
    /// token of a verify step whose split has the same inner boundaries,
    /// so each K and V row of the part is read once for all of them.
    /// Splitting the query heads instead would have every thread read all
    /// of the head's keys and values. The parts' results are merged by
    /// their softmax mass. A token's split depends only on its position
    /// and the threads, and its query rows see only their own keys, so it
    /// gets the same result whichever step computes it, alone or beside
    /// others: the tokens of a step share one parallel section, whose units
    /// the threads take in any order.
    ///
    /// (One section per token made every token pay a wake-up, and with
    /// Gemma 3 270M's one KV head and a short context a token is a single
    /// unit, so one thread attended while the other waited. At a 64-token
    /// context, steps over 8 tokens spent 5.8% of their samples in
    /// attention and 5.8% in the workers' wait with a section per token,
    /// 5.3% and 5.3% with one per step: a small gain, within the m-curve's
    /// noise. Until the units took runs of tokens, each token of a verify
    /// step read the whole cache again.)
    pub(super) fn decode_attention(
        &self,
        li: usize,
        tokens: &[(usize, usize)],
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.config;
        let shape = c.shape(li);
        let layer = CachedLayer {
            cache: shape.kv_layer,
            head_dim: shape.head_dim,
            n_kv_heads: shape.n_kv_heads,
            n_heads: c.n_heads,
            window: c.layers[li].window,
            softcap: c.attn_softcap,
        };
        self.decode_attention_over(layer, tokens, q, out);
    }

    /// [`FastEngine::decode_attention`] over the cache of `layer.cache`
    /// with the queries' shape and window given: a Gemma 4 assistant's
    /// layers attend over its target's cache with their own query heads.
    pub(super) fn decode_attention_over(
        &self,
        layer: CachedLayer,
        tokens: &[(usize, usize)],
        q: &[f32],
        out: &mut [f32],
    ) {
        let CachedLayer {
            cache,
            head_dim: hd,
            n_kv_heads,
            n_heads,
            window,
            softcap,
        } = layer;
        let group = n_heads / n_kv_heads;
        let q_dim = n_heads * hd;
        debug_assert_eq!(q.len(), tokens.len() * q_dim);
        let threads = self.pool.threads();
        let splits: Vec<KeySplit> = tokens
            .iter()
            .map(|&(seq, pos)| {
                KeySplit::new(seq, pos, window, threads, self.blocking.min_keys_per_part)
            })
            .collect();
        // Token i's part p of KV head h is row `first_row[i] + h * parts + p`
        // of both outputs, so a KV head's parts are adjacent.
        let mut first_row = Vec::with_capacity(splits.len() + 1);
        first_row.push(0);
        for s in &splits {
            first_row.push(first_row[first_row.len() - 1] + n_kv_heads * s.parts());
        }
        let rows = first_row[splits.len()];
        let mut partial = vec![0.0f32; rows * group * hd];
        let mut log_sums = vec![0.0f32; rows * group];
        let (partial_out, log_sums_out) = (
            SharedOut::new(&mut partial, group * hd),
            SharedOut::new(&mut log_sums, group),
        );
        let units = attention_units(&splits, n_kv_heads, threads);
        let most_scores = units
            .iter()
            .map(|u| u.tokens.len() * group * u.keys(&splits).len())
            .max();
        let most_rows = units.iter().map(|u| u.tokens.len() * group).max();
        let next = AtomicUsize::new(0);
        let kern = &*self.kernels;
        self.pool.run(|_| {
            let mut scratch = Vec::with_capacity(most_scores.unwrap_or(0));
            let (mut queries, mut result, mut unit_log_sums) = (
                Vec::with_capacity(most_rows.unwrap_or(0) * hd),
                Vec::new(),
                Vec::new(),
            );
            loop {
                let taken = next.fetch_add(1, Ordering::Relaxed);
                let Some(unit) = units.get(taken) else {
                    break;
                };
                let first = &splits[unit.tokens.start];
                let kv = &self.seqs[first.seq];
                let keys = unit.keys(&splits);
                let (lo, hi) = (
                    kv.at(cache, unit.kv_head, keys.start),
                    kv.at(cache, unit.kv_head, keys.end),
                );
                let head_rows = |i: usize| {
                    let col = i * q_dim + unit.kv_head * group * hd;
                    col..col + group * hd
                };
                let unit_queries = if unit.tokens.len() == 1 || n_kv_heads == 1 {
                    &q[head_rows(unit.tokens.start).start..head_rows(unit.tokens.end - 1).end]
                } else {
                    queries.clear();
                    for i in unit.tokens.clone() {
                        queries.extend_from_slice(&q[head_rows(i)]);
                    }
                    &queries[..]
                };
                let a = GroupAttention {
                    queries: unit_queries,
                    head_dim: hd,
                    rows_per_token: group,
                    first_query: first.pos,
                    keys: &kv.keys[cache][lo..hi],
                    values: &kv.values[cache][lo..hi],
                    first_key: keys.start,
                    window,
                    softcap,
                };
                let row_of = |i: usize| first_row[i] + unit.kv_head * splits[i].parts() + unit.part;
                if unit.tokens.len() == 1 {
                    let row = row_of(unit.tokens.start);
                    // SAFETY: this token's row for the unit's head and part
                    // belongs to this unit alone.
                    let (o, l) = unsafe {
                        (
                            partial_out.rows_mut(row..row + 1),
                            log_sums_out.rows_mut(row..row + 1),
                        )
                    };
                    kern.attend(&a, &mut scratch, o, Some(l));
                    continue;
                }
                result.resize(unit_queries.len(), 0.0);
                unit_log_sums.resize(unit.tokens.len() * group, 0.0);
                kern.attend(&a, &mut scratch, &mut result, Some(&mut unit_log_sums));
                let per_token = result
                    .chunks_exact(group * hd)
                    .zip(unit_log_sums.chunks_exact(group));
                for (i, (o, l)) in unit.tokens.clone().zip(per_token) {
                    let row = row_of(i);
                    // SAFETY: as above, for each of the unit's tokens.
                    unsafe {
                        partial_out.rows_mut(row..row + 1).copy_from_slice(o);
                        log_sums_out.rows_mut(row..row + 1).copy_from_slice(l);
                    }
                }
            }
        });
        for (i, (s, token_out)) in splits.iter().zip(out.chunks_exact_mut(q_dim)).enumerate() {
            let (r0, r1) = (first_row[i], first_row[i + 1]);
            let heads = partial[r0 * group * hd..r1 * group * hd]
                .chunks_exact(s.parts() * group * hd)
                .zip(log_sums[r0 * group..r1 * group].chunks_exact(s.parts() * group))
                .zip(token_out.chunks_exact_mut(group * hd));
            for ((head_parts, head_sums), head_out) in heads {
                let part_out: Vec<&[f32]> = head_parts.chunks_exact(group * hd).collect();
                let part_sums: Vec<&[f32]> = head_sums.chunks_exact(group).collect();
                merge_key_parts(&part_out, &part_sums, hd, head_out);
            }
        }
    }
}
