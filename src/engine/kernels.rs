//! The matrix kernels the fast engine calls. The JIT provides the real
//! implementation; `PortableKernels` is plain Rust with the same contract,
//! used to test the engine's driver logic on its own.

use super::ops::dot;
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

pub trait MatKernels: Sync {
    /// `y[t][r] = W[r,:] · x[t,:]` for every token `t` of `x` (row-major
    /// `[tokens, w.cols]`) and every row `r` in `rows`.
    ///
    /// # Safety
    /// No other thread may touch columns `rows` of `y` meanwhile.
    unsafe fn gemm(&self, w: &PackedMatrix, x: &[f32], rows: Range<usize>, y: SharedOut);

    /// A short name for reports ("jit avx2", "portable").
    fn name(&self) -> String;
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
