//! The GEMV handles: one token's matrix-vector products, over 16-bit
//! weights and over quantized weights with 8-bit inputs.

use super::{Compiled, Kernel, KernelError, blocks_fit, shape};
use crate::jit::emit::gemv::WeightType;
use crate::jit::plan::KernelKind;
use crate::model::quant_blocks::{self, QuantType};
use std::ops::Range;

/// `(w, x, y, r0, r1)`: `y[r] = sum_k W[r,k] x[k]`, r in `r0..r1`.
pub type GemvFn = unsafe extern "sysv64" fn(*const u16, *const f32, *mut f32, usize, usize);

type GemvQuantFn = unsafe extern "sysv64" fn(*const u8, *const u8, *mut f32, usize, usize, usize);

#[derive(Clone, Copy)]
pub struct Gemv<'a> {
    f: GemvFn,
    pub name: &'a str,
    pub k: usize,
    pub wt: WeightType,
}

impl Gemv<'_> {
    /// `y[r] = sum_k W[r,k] x[k]` for r in `rows`; `w` is the whole matrix
    /// in the row-block layout (u16 bits of f16 or bf16, as planned) and
    /// `rows` starts on a block; `y` is indexed by row.
    pub fn run(
        &self,
        w: &[u16],
        x: &[f32],
        y: &mut [f32],
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if x.len() != self.k {
            return Err(shape(
                self.name,
                format!("x has {} elements, K is {}", x.len(), self.k),
            ));
        }
        if rows.start > rows.end || y.len() < rows.end {
            return Err(shape(
                self.name,
                format!("rows {rows:?} do not fit y of {}", y.len()),
            ));
        }
        if !blocks_fit(w.len(), &rows, self.k) {
            return Err(shape(
                self.name,
                format!(
                    "W of {} values has fewer than {} rows of {} in 4-row blocks, or rows {rows:?} start inside a block",
                    w.len(),
                    rows.end,
                    self.k
                ),
            ));
        }
        // SAFETY: every row read is inside `w`, x has K elements, and only
        // y[rows] is written (checked above).
        unsafe { (self.f)(w.as_ptr(), x.as_ptr(), y.as_mut_ptr(), rows.start, rows.end) };
        Ok(())
    }

    /// Like `run`, but `y_part[i]` receives row `rows.start + i`, so threads
    /// can each own a disjoint piece of y (`split_at_mut` along `split_rows`).
    pub fn run_part(
        &self,
        w: &[u16],
        x: &[f32],
        y_part: &mut [f32],
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if rows.start > rows.end || y_part.len() != rows.len() {
            return Err(shape(
                self.name,
                format!("y part of {} does not match rows {rows:?}", y_part.len()),
            ));
        }
        if x.len() != self.k || !blocks_fit(w.len(), &rows, self.k) {
            return Err(shape(
                self.name,
                format!(
                    "x {} or W {} too small for K {} and rows {rows:?}",
                    x.len(),
                    w.len(),
                    self.k
                ),
            ));
        }
        // The kernel writes y[r] for r in rows; shifting the base by -start
        // makes that y_part[r - start]. Only in-bounds addresses are written.
        let base = y_part.as_mut_ptr().wrapping_sub(rows.start);
        // SAFETY: as in `run`; writes land in y_part exactly.
        unsafe { (self.f)(w.as_ptr(), x.as_ptr(), base, rows.start, rows.end) };
        Ok(())
    }
}

impl<'a> Kernel<'a> for Gemv<'a> {
    /// The weights' type and K.
    type Key = (WeightType, usize);
    fn serves(kind: &KernelKind, (wt, k): Self::Key) -> bool {
        matches!(kind, KernelKind::Gemv(g) if g.wt == wt && g.k == k)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (wt, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified GEMV code (see emit::gemv).
        let f = unsafe { std::mem::transmute::<*const u8, GemvFn>(entry) };
        Gemv {
            f,
            name: &c.spec.name,
            k,
            wt,
        }
    }
}

#[derive(Clone, Copy)]
pub struct GemvQuant<'a> {
    f: GemvQuantFn,
    pub name: &'a str,
    pub q: QuantType,
    pub k: usize,
}

impl GemvQuant<'_> {
    /// `y_part[i] = W[rows.start + i, :] · x` for quantized row blocks `w`
    /// (the whole matrix) and one token's 8-bit input `x` (K quants, K/32
    /// f32 scales, K/32 i32 sums); `rows` starts on a block.
    pub fn run_part(
        &self,
        w: &[u8],
        x: &[u8],
        y_part: &mut [f32],
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        let block_bytes = self.q.block_bytes(self.k);
        let x_bytes = self.k + self.k / quant_blocks::GROUP_COLS * 8;
        if rows.start > rows.end || y_part.len() != rows.len() {
            return Err(shape(
                self.name,
                format!("y part of {} does not match rows {rows:?}", y_part.len()),
            ));
        }
        let blocks_in_w = w.len() / block_bytes.max(1);
        if x.len() != x_bytes
            || !rows.start.is_multiple_of(quant_blocks::BLOCK_ROWS)
            || rows.end.div_ceil(quant_blocks::BLOCK_ROWS) > blocks_in_w
        {
            return Err(shape(
                self.name,
                format!(
                    "x of {} bytes (want {x_bytes}) or W of {} bytes too small for K {} and rows {rows:?}, or rows start inside a block",
                    x.len(),
                    w.len(),
                    self.k
                ),
            ));
        }
        // The kernel writes y[r] for r in rows; shifting the base by -start
        // makes that y_part[r - start]. Only in-bounds addresses are written.
        let base = y_part.as_mut_ptr().wrapping_sub(rows.start);
        // SAFETY: every block read is inside `w`, x holds the K quants and
        // scales, and only y_part is written (checked above).
        unsafe { (self.f)(w.as_ptr(), x.as_ptr(), base, rows.start, rows.end, self.k) };
        Ok(())
    }
}

impl<'a> Kernel<'a> for GemvQuant<'a> {
    /// The weights' block type and K (the kernel takes K as an argument,
    /// the handle fixes it).
    type Key = (QuantType, usize);
    fn serves(kind: &KernelKind, (q, k): Self::Key) -> bool {
        quant_blocks::fits(k) && matches!(kind, KernelKind::GemvQuant(g) if g.q == q)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (q, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified integer GEMV code (see
        // emit::gemv_quant).
        let f = unsafe { std::mem::transmute::<*const u8, GemvQuantFn>(entry) };
        GemvQuant {
            f,
            name: &c.spec.name,
            q,
            k,
        }
    }
}
