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

/// One query head's attention over cached positions: `keys` and `values`
/// start at the first visible position's row for this KV head, rows
/// `stride` apart; `q` is already scaled.
#[derive(Clone, Copy)]
pub struct HeadAttention<'a> {
    pub q: &'a [f32],
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub stride: usize,
    pub positions: usize,
    pub softcap: Option<f32>,
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

    /// One query head attending over its visible cached positions;
    /// `scores` is scratch of at least `a.positions`.
    fn attend(&self, a: &HeadAttention<'_>, scores: &mut [f32], out: &mut [f32]) {
        let HeadAttention {
            q,
            keys,
            values,
            stride,
            positions: n,
            softcap,
        } = *a;
        let hd = q.len();
        let scores = &mut scores[..n];
        for (p, s) in scores.iter_mut().enumerate() {
            *s = dot(q, &keys[p * stride..p * stride + hd]);
        }
        if let Some(cap) = softcap {
            scores.iter_mut().for_each(|s| *s = ops::softcap(*s, cap));
        }
        ops::softmax(scores);
        out.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            for (o, &v) in out.iter_mut().zip(&values[p * stride..p * stride + hd]) {
                *o += w * v;
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
