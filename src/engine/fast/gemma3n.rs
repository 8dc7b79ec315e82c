//! The fast engine's Gemma 3n work between the matrix products: AltUp's
//! streams (set up, predicted, corrected, merged), the Gaussian top-k of
//! the sparse layers and the per-layer input's elementwise part. Each is a
//! few passes over a token's row, so a step with several tokens splits its
//! rows over the pool (in a prefill they were a tenth of the time, on one
//! thread while the other waited); one token runs on the calling thread.
//!
//! Per token the arithmetic is the reference pass's, in its order, so a
//! row's result does not depend on the step it is in; the only change is
//! where it runs and that no row allocates.

use super::FastEngine;
use super::forward::Activations;
use crate::engine::kernels::SharedOut;
use crate::engine::ops;
use crate::engine::pool::split_range;
use crate::model::weights::AltUpWeights;
use std::ops::Range;

/// Columns a stream update handles at a time: every stream's part of
/// them is copied out first, so the update can write the streams in place.
const CHUNK: usize = 16;

/// AltUp has at most this many streams (`ModelConfig::validate`).
const MAX_STREAMS: usize = 16;

impl FastEngine {
    /// Runs `f` over the token rows `0..n`: on this thread for one token,
    /// split over the pool for several.
    pub(super) fn over_tokens(&self, n: usize, f: impl Fn(Range<usize>) + Sync) {
        let threads = self.pool.threads();
        if n <= 1 || threads == 1 {
            return f(0..n);
        }
        self.pool.run(|tid| {
            let (t0, t1) = split_range(n, threads, tid, 1);
            if t0 < t1 {
                f(t0..t1);
            }
        });
    }

    /// Each token's AltUp streams from its scaled embedding in `x`: stream
    /// 0 is the embedding, stream k its k-th projection rescaled to the
    /// embedding's RMS (the projections in one parallel section).
    pub(super) fn altup_streams(&self, exact: usize, a: &mut Activations) {
        let (Some(w), Some(shape)) = (&self.weights.altup, self.config.features.altup) else {
            return;
        };
        let h = self.config.hidden;
        let n = a.x.len() / h;
        let outs = a.altup_out[..(shape.streams - 1) * n * h].chunks_exact_mut(n * h);
        let jobs = w
            .projections
            .iter()
            .zip(outs)
            .map(|(m, out)| (m, &a.x[..], out))
            .collect();
        self.matmuls(jobs, exact);
        let width = shape.streams * h;
        let streams = SharedOut::new(&mut a.streams[..n * width], width);
        let (x, projected) = (&a.x, &a.altup_out);
        self.over_tokens(n, |rows| {
            // SAFETY: token rows `rows` are this call's alone.
            let mine = unsafe { streams.rows_mut(rows.clone()) };
            for (t, streams) in rows.zip(mine.chunks_exact_mut(width)) {
                let x0 = &x[t * h..(t + 1) * h];
                let target = ops::rms(x0);
                streams[..h].copy_from_slice(x0);
                for (k, stream) in streams.chunks_exact_mut(h).enumerate().skip(1) {
                    let at = ((k - 1) * n + t) * h;
                    stream.copy_from_slice(&projected[at..at + h]);
                    ops::match_rms(stream, target);
                }
            }
        });
    }

    /// Before layer `li`: AltUp's prediction of every stream from the
    /// router's reading of the active one, whose prediction the layer then
    /// computes on in `x`.
    pub(super) fn altup_predict(&self, li: usize, a: &mut Activations) {
        let (Some(w), Some(shape)) = (&self.weights.layers[li].altup, self.config.features.altup)
        else {
            return;
        };
        let (h, eps) = (self.config.hidden, self.config.rms_eps);
        let width = shape.streams * h;
        let n = a.x.len() / h;
        let active = shape.active * h..(shape.active + 1) * h;
        let streams = SharedOut::new(&mut a.streams[..n * width], width);
        let x = SharedOut::new(&mut a.x[..n * h], h);
        self.over_tokens(n, |rows| {
            // SAFETY: token rows `rows` of both are this call's alone.
            let (streams, x) = unsafe { (streams.rows_mut(rows.clone()), x.rows_mut(rows)) };
            let mut normed = vec![0.0; h];
            for (s, x) in streams.chunks_exact_mut(width).zip(x.chunks_exact_mut(h)) {
                let m = route(w, &s[active.clone()], eps, &mut normed);
                predict(s, h, &w.predict.data, &m[..shape.streams]);
                x.copy_from_slice(&s[active.clone()]);
            }
        });
    }

    /// After layer `li`'s feed-forward: every stream corrected by what the
    /// layer added to the active one's prediction.
    pub(super) fn altup_correct(&self, li: usize, a: &mut Activations) {
        let (Some(w), Some(shape)) = (&self.weights.layers[li].altup, self.config.features.altup)
        else {
            return;
        };
        let (h, eps) = (self.config.hidden, self.config.rms_eps);
        let width = shape.streams * h;
        let n = a.x.len() / h;
        let streams = SharedOut::new(&mut a.streams[..n * width], width);
        let x = &a.x;
        self.over_tokens(n, |rows| {
            // SAFETY: token rows `rows` are this call's alone.
            let mine = unsafe { streams.rows_mut(rows.clone()) };
            let mut normed = vec![0.0; h];
            for (t, s) in rows.zip(mine.chunks_exact_mut(width)) {
                let x = &x[t * h..(t + 1) * h];
                let m = route(w, x, eps, &mut normed);
                correct(s, h, &w.correct.data, &m[..shape.streams], x, shape.active);
            }
        });
    }

    /// After the last layer, the residual for the final norm into `x`: the
    /// mean of stream 0 and the other streams' unembeddings, each rescaled
    /// to stream 0's RMS (the unembeddings in one parallel section).
    pub(super) fn altup_merge(&self, exact: usize, a: &mut Activations) {
        let (Some(w), Some(shape)) = (&self.weights.altup, self.config.features.altup) else {
            return;
        };
        let h = self.config.hidden;
        let n = a.x.len() / h;
        let width = shape.streams * h;
        // Stream k of every token, as the rows of one input.
        for (t, streams) in a.streams.chunks_exact(width).enumerate() {
            for (k, stream) in streams.chunks_exact(h).enumerate().skip(1) {
                let at = ((k - 1) * n + t) * h;
                a.altup_in[at..at + h].copy_from_slice(stream);
            }
        }
        let used = (shape.streams - 1) * n * h;
        let ins = a.altup_in[..used].chunks_exact(n * h);
        let outs = a.altup_out[..used].chunks_exact_mut(n * h);
        let jobs = w
            .unembed
            .iter()
            .zip(ins.zip(outs))
            .map(|(m, (x, y))| (m, x, y))
            .collect();
        self.matmuls(jobs, exact);
        let x = SharedOut::new(&mut a.x[..n * h], h);
        // Each token's unembeddings are rescaled in place: its rows of
        // every stream's block.
        let unembedded = SharedOut::new(&mut a.altup_out[..used], h);
        let streams = &a.streams;
        self.over_tokens(n, |rows| {
            // SAFETY: token rows `rows` of `x` are this call's alone.
            let mine = unsafe { x.rows_mut(rows.clone()) };
            for (t, x) in rows.zip(mine.chunks_exact_mut(h)) {
                let first = &streams[t * width..t * width + h];
                let target = ops::rms(first);
                x.copy_from_slice(first);
                for k in 1..shape.streams {
                    // SAFETY: row (k-1)·n + t, token t's, is this call's alone.
                    let u = unsafe { unembedded.rows_mut((k - 1) * n + t..(k - 1) * n + t + 1) };
                    ops::match_rms(u, target);
                    x.iter_mut().zip(&*u).for_each(|(v, u)| *v += u);
                }
                x.iter_mut().for_each(|v| *v /= shape.streams as f32);
            }
        });
    }

    /// A sparse layer's Gaussian top-k on each token's gate row (`width`
    /// values a row).
    pub(super) fn sparsity_cut(&self, gate: &mut [f32], width: usize, cut: f32) {
        let n = gate.len() / width;
        let rows = SharedOut::new(gate, width);
        self.over_tokens(n, |range| {
            // SAFETY: token rows `range` are this call's alone.
            let mine = unsafe { rows.rows_mut(range) };
            mine.chunks_exact_mut(width)
                .for_each(|g| ops::gaussian_top_k(g, cut));
        });
    }

    /// The per-layer input gate's input with AltUp: each token's corrected
    /// active stream, times `altup_correct_scale` where the model has it,
    /// into `normed`.
    pub(super) fn per_layer_gate_input(&self, li: usize, a: &mut Activations) {
        let (Some(w), Some(shape)) = (&self.weights.layers[li].altup, self.config.features.altup)
        else {
            return;
        };
        let h = self.config.hidden;
        let n = a.x.len() / h;
        let width = shape.streams * h;
        let from = shape.active * h;
        let out = SharedOut::new(&mut a.normed[..n * h], h);
        let streams = &a.streams;
        self.over_tokens(n, |rows| {
            // SAFETY: token rows `rows` are this call's alone.
            let mine = unsafe { out.rows_mut(rows.clone()) };
            for (t, row) in rows.zip(mine.chunks_exact_mut(h)) {
                row.copy_from_slice(&streams[t * width + from..t * width + from + h]);
                if let Some(scale) = &w.correct_output_scale {
                    row.iter_mut().zip(scale).for_each(|(v, s)| *v *= s);
                }
            }
        });
    }

    /// The per-layer input's projection `y` (one row per token, already
    /// normed) added to every stream but 0, as transformers and llama.cpp
    /// have it.
    pub(super) fn add_to_side_streams(&self, a: &mut Activations) {
        let Some(shape) = self.config.features.altup else {
            return;
        };
        let h = self.config.hidden;
        let n = a.x.len() / h;
        let width = shape.streams * h;
        let streams = SharedOut::new(&mut a.streams[..n * width], width);
        let y = &a.proj;
        self.over_tokens(n, |rows| {
            // SAFETY: token rows `rows` are this call's alone.
            let mine = unsafe { streams.rows_mut(rows.clone()) };
            for (t, s) in rows.zip(mine.chunks_exact_mut(width)) {
                let y = &y[t * h..(t + 1) * h];
                for stream in s.chunks_exact_mut(h).skip(1) {
                    stream.iter_mut().zip(y).for_each(|(v, d)| *v += d);
                }
            }
        });
    }
}

/// The router's weights for one stream `v` (`ops::altup_route`'s
/// arithmetic, with `normed` as its scratch row).
fn route(w: &AltUpWeights, v: &[f32], eps: f32, normed: &mut [f32]) -> [f32; MAX_STREAMS] {
    ops::rms_norm(v, &w.router_input_scale, eps, normed);
    let mut m = [0.0; MAX_STREAMS];
    for (o, row) in m.iter_mut().zip(w.router.data.chunks_exact(v.len())) {
        *o = ops::dot(row, normed).tanh();
    }
    m
}

/// `ops::altup_predict` on one token's streams, a chunk of columns at a
/// time instead of a copy of every stream.
fn predict(streams: &mut [f32], h: usize, coefs_of: &[f32], m: &[f32]) {
    let n = m.len();
    let mut coefs = [0.0; MAX_STREAMS * MAX_STREAMS];
    ops::matvec(coefs_of, m, &mut coefs[..n * n]);
    let mut old = [[0.0f32; CHUNK]; MAX_STREAMS];
    for c0 in (0..h).step_by(CHUNK) {
        let cols = CHUNK.min(h - c0);
        for (k, part) in old[..n].iter_mut().enumerate() {
            part[..cols].copy_from_slice(&streams[k * h + c0..k * h + c0 + cols]);
        }
        for j in 0..n {
            let out = &mut streams[j * h + c0..j * h + c0 + cols];
            for (k, part) in old[..n].iter().enumerate() {
                let c = coefs[j * n + k];
                for (o, &v) in out.iter_mut().zip(&part[..cols]) {
                    *o += c * v;
                }
            }
        }
    }
}

/// `ops::altup_correct` on one token's streams, a chunk of columns at a
/// time instead of a copy of the innovation.
fn correct(streams: &mut [f32], h: usize, coefs_of: &[f32], m: &[f32], x: &[f32], active: usize) {
    let n = m.len();
    let mut coefs = [0.0; MAX_STREAMS];
    ops::matvec(coefs_of, m, &mut coefs[..n]);
    let mut innovation = [0.0f32; CHUNK];
    for c0 in (0..h).step_by(CHUNK) {
        let cols = CHUNK.min(h - c0);
        let predicted = &streams[active * h + c0..active * h + c0 + cols];
        for ((d, &x), &p) in innovation.iter_mut().zip(&x[c0..c0 + cols]).zip(predicted) {
            *d = x - p;
        }
        for (j, &c) in coefs[..n].iter().enumerate() {
            let c = c + 1.0;
            let out = &mut streams[j * h + c0..j * h + c0 + cols];
            for (v, &d) in out.iter_mut().zip(&innovation[..cols]) {
                *v += c * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn the_chunked_prediction_and_correction_equal_the_reference_bit_for_bit() {
        // 3 streams of 37 columns: chunks of 16 with a tail of 5.
        let (h, n) = (37, 3);
        let predict_coefs = values(n * n * n, 7);
        let correct_coefs = values(n * n, 9);
        let m = values(n, 11);
        let x = values(h, 13);
        let mut want = values(n * h, 5);
        let mut got = want.clone();
        ops::altup_predict(&mut want, h, &predict_coefs, &m);
        predict(&mut got, h, &predict_coefs, &m);
        assert_eq!(got, want);
        ops::altup_correct(&mut want, h, &correct_coefs, &m, &x, 1);
        correct(&mut got, h, &correct_coefs, &m, &x, 1);
        assert_eq!(got, want);
    }
}
