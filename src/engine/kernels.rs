//! The matrix kernels the fast engine calls. The JIT provides the real
//! implementation; `PortableKernels` is plain Rust with the same contract,
//! used to test the engine's driver logic on its own.

use super::ops::{self, dot};
use super::packed::PackedMatrix;
use std::ops::Range;

/// A row-major `[tokens, stride]` f32 output that several threads write
/// into at once, each owning a disjoint range of columns.
#[derive(Clone, Copy)]
pub struct SharedOut {
    ptr: *mut f32,
    len: usize,
    pub stride: usize,
}

// SAFETY: writers own disjoint column ranges (the engine's split), so no
// element is written by two threads; readers wait for the section's end.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(out: &mut [f32], stride: usize) -> SharedOut {
        SharedOut {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            stride,
        }
    }

    /// Rows (tokens) the output holds.
    pub fn rows(&self) -> usize {
        self.len / self.stride.max(1)
    }

    /// The start of the output, for kernels that take raw pointers.
    pub fn as_mut_ptr(&self) -> *mut f32 {
        self.ptr
    }

    /// Whole rows `rows` as one mutable slice.
    ///
    /// # Safety
    /// No other thread may access the same rows during the borrow.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn rows_mut(&self, rows: Range<usize>) -> &mut [f32] {
        let (start, end) = (rows.start * self.stride, rows.end * self.stride);
        assert!(start <= end && end <= self.len);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), end - start) }
    }

    /// Row `t`, columns `cols`, as a mutable slice.
    ///
    /// # Safety
    /// No other thread may access the same elements during the borrow.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn cells(&self, t: usize, cols: Range<usize>) -> &mut [f32] {
        let start = t * self.stride + cols.start;
        assert!(
            cols.start <= cols.end && cols.end <= self.stride && start + cols.len() <= self.len
        );
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), cols.len()) }
    }
}

/// A block of query rows that share one KV head, over a run of that head's
/// cached positions. Query row i belongs to the token at position
/// `first_query + i / rows_per_token` and sees the keys up to its own
/// position (and, with a window, only the last `window` of them).
#[derive(Clone, Copy)]
pub struct GroupAttention<'a> {
    /// `[nq][head_dim]`, already scaled.
    pub queries: &'a [f32],
    pub head_dim: usize,
    pub rows_per_token: usize,
    pub first_query: usize,
    /// Contiguous rows of `head_dim` for positions `first_key..=` the last
    /// query's position.
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub first_key: usize,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl GroupAttention<'_> {
    pub fn n_keys(&self) -> usize {
        self.keys.len() / self.head_dim
    }

    pub fn n_queries(&self) -> usize {
        self.queries.len() / self.head_dim
    }

    /// The keys query row `i` may see, as indices into `keys`.
    pub fn visible(&self, i: usize) -> Range<usize> {
        let pos = self.first_query + i / self.rows_per_token;
        let lo = self
            .window
            .map_or(0, |w| (pos + 1).saturating_sub(w))
            .max(self.first_key);
        (lo - self.first_key)..(pos + 1 - self.first_key)
    }

    /// Turns row `i`'s raw scores (one per key) into probabilities: zero
    /// for keys it may not see, softcap and `softmax` over the rest.
    pub fn probabilities(&self, i: usize, row: &mut [f32], softmax: impl Fn(&mut [f32])) {
        let vis = self.visible(i);
        row[..vis.start].fill(0.0);
        row[vis.end..].fill(0.0);
        let seen = &mut row[vis];
        if let Some(cap) = self.softcap {
            seen.iter_mut().for_each(|s| *s = ops::softcap(*s, cap));
        }
        softmax(seen);
    }
}

pub trait MatKernels: Sync {
    /// `y[t][r] = W[r,:] · x[t,:]` for every token `t` of `x` (row-major
    /// `[tokens, w.cols]`) and every row `r` in `rows`.
    ///
    /// # Safety
    /// No other thread may touch columns `rows` of `y` meanwhile.
    unsafe fn gemm(&self, w: &PackedMatrix, x: &[f32], rows: Range<usize>, y: SharedOut);

    /// A short name for reports ("jit avx2", "portable").
    fn name(&self) -> String;

    /// RMSNorm of every `w.len()`-long row of `x` into `out`.
    fn rms_norm(&self, x: &[f32], w: &[f32], out: &mut [f32], eps: f32) {
        for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
            ops::rms_norm(xr, w, eps, or);
        }
    }

    /// In-place RMSNorm of every `w.len()`-long row of `x`.
    fn rms_norm_in_place(&self, x: &mut [f32], w: &[f32], eps: f32) {
        for row in x.chunks_exact_mut(w.len()) {
            ops::rms_norm_in_place(row, w, eps);
        }
    }

    /// out = gelu_tanh(gate) · up, elementwise.
    fn geglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = ops::gelu_tanh(g) * u;
        }
    }

    /// Attention of every query row of `a` into `out` (`[nq][head_dim]`);
    /// `scratch` holds the scores and is reused across calls.
    fn attend(&self, a: &GroupAttention<'_>, scratch: &mut Vec<f32>, out: &mut [f32]) {
        let (hd, n_keys) = (a.head_dim, a.n_keys());
        scratch.resize(n_keys, 0.0);
        for (i, (q, o)) in a
            .queries
            .chunks_exact(hd)
            .zip(out.chunks_exact_mut(hd))
            .enumerate()
        {
            for (j, s) in scratch.iter_mut().enumerate() {
                *s = dot(q, &a.keys[j * hd..(j + 1) * hd]);
            }
            a.probabilities(i, scratch, ops::softmax);
            o.fill(0.0);
            for (j, &w) in scratch.iter().enumerate() {
                for (o, &v) in o.iter_mut().zip(&a.values[j * hd..(j + 1) * hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

/// Plain-Rust kernels: widen a row once, dot it with every token.
pub struct PortableKernels;

impl MatKernels for PortableKernels {
    unsafe fn gemm(&self, w: &PackedMatrix, x: &[f32], rows: Range<usize>, y: SharedOut) {
        let tokens = x.len() / w.cols;
        let mut row = vec![0.0f32; w.cols];
        for r in rows {
            w.row_f32(r, &mut row);
            for t in 0..tokens {
                let v = dot(&row, &x[t * w.cols..(t + 1) * w.cols]);
                unsafe { y.cells(t, r..r + 1)[0] = v };
            }
        }
    }

    fn name(&self) -> String {
        "portable".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block<'a>(keys: &'a [f32], first_key: usize, window: Option<usize>) -> GroupAttention<'a> {
        GroupAttention {
            queries: &[],
            head_dim: 1,
            rows_per_token: 2,
            first_query: 10,
            keys,
            values: keys,
            first_key,
            window,
            softcap: None,
        }
    }

    #[test]
    fn visible_keys_are_causal_and_windowed() {
        let keys = [0.0f32; 8];
        // Keys at positions 5..=12; queries at 10, 10, 11, 11, 12, 12.
        let causal = block(&keys, 5, None);
        assert_eq!(causal.visible(0), 0..6);
        assert_eq!(causal.visible(1), 0..6);
        assert_eq!(causal.visible(2), 0..7);
        assert_eq!(causal.visible(5), 0..8);
        // A window of 4: position 12 sees 9..=12.
        let windowed = block(&keys, 5, Some(4));
        assert_eq!(windowed.visible(0), 2..6);
        assert_eq!(windowed.visible(4), 4..8);
    }

    #[test]
    fn probabilities_are_zero_outside_and_sum_to_one_inside() {
        let keys = [0.0f32; 8];
        let a = block(&keys, 5, Some(4));
        let mut row = [3.0f32, 1.0, 2.0, 0.5, 1.5, 2.5, 9.0, 9.0];
        a.probabilities(1, &mut row, ops::softmax);
        assert_eq!(&row[..2], &[0.0, 0.0]);
        assert_eq!(&row[6..], &[0.0, 0.0]);
        assert!((row[2..6].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(row[2..6].iter().all(|&p| p > 0.0));
    }
}
