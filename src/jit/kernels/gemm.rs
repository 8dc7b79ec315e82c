//! The GEMM handles: products over several tokens, over 16-bit weights,
//! over quantized weights in 16-row blocks with tiles of 8-bit inputs, and
//! the unpacking of Q5_0 and Q4_0 panels for them.

use super::{Compiled, Kernel, KernelError, blocks_fit, rows_fit, shape};
use crate::jit::emit::gemm_quant::ScaleSpan;
use crate::jit::emit::gemm_wide::GemmWideParams;
use crate::jit::emit::gemv::WeightType;
use crate::jit::emit::{gemm, gemm_quant};
use crate::jit::plan::KernelKind;
use crate::model::quant_blocks::{self, QuantType};
use std::ops::Range;

/// `(w, x, y, r0, r1, tokens, ldy)`: `Y[t*ldy + r] = sum_k W[r,k] X[t*K + k]`.
pub type GemmFn =
    unsafe extern "sysv64" fn(*const u16, *const f32, *mut f32, usize, usize, usize, usize);

type GemmQuantFn =
    unsafe extern "sysv64" fn(*const u8, *const u8, *mut f32, usize, usize, usize, usize, usize);

/// `(w, x_tiles, y, r0, r1, tokens, ldy, k)`, see `emit::gemm_wide`.
type GemmWideFn =
    unsafe extern "sysv64" fn(*const u16, *const u8, *mut f32, usize, usize, usize, usize, usize);

type UnpackQuantFn = unsafe extern "sysv64" fn(*const u8, *mut u8, usize, usize, usize);

#[derive(Clone, Copy)]
pub struct Gemm<'a> {
    /// Also bound by [`AttnScores`](super::AttnScores) to the keys' GEMM.
    pub(super) f: GemmFn,
    pub name: &'a str,
    pub k: usize,
    pub wt: WeightType,
}

impl Gemm<'_> {
    /// `Y[t*ldy + r] = sum_k W[r,k] X[t*K + k]` for r in `rows`, t < tokens.
    /// 16-bit W is in the row-block layout (`rows` starting on a block);
    /// f32 W is plain rows.
    pub fn run(
        &self,
        w: &[u16],
        x: &[f32],
        tokens: usize,
        y: &mut [f32],
        ldy: usize,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if tokens.checked_mul(self.k) != Some(x.len()) {
            return Err(shape(
                self.name,
                format!("X has {} elements, expected {tokens} x {}", x.len(), self.k),
            ));
        }
        if rows.start > rows.end || rows.end > ldy && tokens > 0 {
            return Err(shape(self.name, format!("rows {rows:?} exceed ldy {ldy}")));
        }
        if tokens > 0 && !rows_fit(y.len(), tokens, ldy, rows.end) {
            return Err(shape(
                self.name,
                format!(
                    "Y of {} elements is too small for {tokens} x {ldy}",
                    y.len()
                ),
            ));
        }
        let w_fits = match self.wt.bytes() {
            2 => blocks_fit(w.len(), &rows, self.k),
            _ => rows_fit(w.len(), rows.end, self.k, self.k),
        };
        if !w_fits {
            return Err(shape(
                self.name,
                format!(
                    "W of {} elements has fewer than {} rows, or rows {rows:?} start inside a 4-row block",
                    w.len(),
                    rows.end
                ),
            ));
        }
        // SAFETY: reads stay in W rows < rows.end and X; writes in Y[t*ldy + rows].
        unsafe { self.run_unchecked(w.as_ptr(), x.as_ptr(), tokens, y.as_mut_ptr(), ldy, rows) };
        Ok(())
    }

    /// Raw call for a thread pool whose threads write disjoint row ranges of
    /// one Y (not expressible as disjoint slices).
    ///
    /// # Safety
    /// `w` must hold rows `< rows.end` of K elements (16-bit: whole row
    /// blocks, `rows.start` on a block), `x` `tokens * K` floats, and `Y[t*ldy + r]` must be writable for t < tokens, r in
    /// `rows`, with no other thread touching those elements.
    pub unsafe fn run_unchecked(
        &self,
        w: *const u16,
        x: *const f32,
        tokens: usize,
        y: *mut f32,
        ldy: usize,
        rows: Range<usize>,
    ) {
        // Panels of rows keep the weights the kernel streams per token tile
        // in L2 (see emit::gemm); they start on tile boundaries of `rows`.
        let panel = gemm::panel_rows(self.k * self.wt.bytes());
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = rows.end.min(r0.saturating_add(panel));
            // SAFETY: guaranteed by the caller for all of `rows`.
            unsafe { (self.f)(w, x, y, r0, r1, tokens, ldy) };
            r0 = r1;
        }
    }
}

impl<'a> Kernel<'a> for Gemm<'a> {
    /// The weights' type and K.
    type Key = (WeightType, usize);
    fn serves(kind: &KernelKind, (wt, k): Self::Key) -> bool {
        matches!(kind, KernelKind::Gemm(g) if g.wt == wt && g.k == k)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (wt, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified GEMM code (see emit::gemm).
        let f = unsafe { std::mem::transmute::<*const u8, GemmFn>(entry) };
        Gemm {
            f,
            name: &c.spec.name,
            k,
            wt,
        }
    }
}

/// The 16-bit GEMM on 512-bit vectors (`emit::gemm_wide`): one kernel
/// for every K, its input in tiles of 6 tokens (`engine::wide_input`).
#[derive(Clone, Copy)]
pub struct GemmWide<'a> {
    f: GemmWideFn,
    pub name: &'a str,
    pub params: GemmWideParams,
    pub k: usize,
}

impl GemmWide<'_> {
    /// Bytes of the tiles that hold `tokens` tokens.
    pub fn input_bytes(&self, tokens: usize) -> usize {
        tokens.div_ceil(crate::jit::emit::gemm_wide::TILE_TOKENS) * self.params.tile_bytes(self.k)
    }

    /// `Y[t*ldy + r] = W[r, :] · x_t` for r in `rows` and t < `tokens`,
    /// W the whole matrix in the row-block layout (`rows` starting on a
    /// register tile's rows), `tiles` the tokens laid out for this kernel.
    pub fn run(
        &self,
        w: &[u16],
        tiles: &[u8],
        tokens: usize,
        y: &mut [f32],
        ldy: usize,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        if tiles.len() < self.input_bytes(tokens) {
            return Err(shape(
                self.name,
                format!(
                    "tiles of {} bytes for {tokens} tokens of K {} (want {})",
                    tiles.len(),
                    self.k,
                    self.input_bytes(tokens)
                ),
            ));
        }
        if rows.start > rows.end
            || !rows.start.is_multiple_of(self.params.rows())
            || !blocks_fit(w.len(), &rows, self.k)
            || rows.end > ldy && tokens > 0
            || tokens > 0 && !rows_fit(y.len(), tokens, ldy, rows.end)
        {
            return Err(shape(
                self.name,
                format!(
                    "rows {rows:?} of W ({} values, K {}) into Y of {tokens} x {ldy} ({} elements), or rows start inside a tile of {}",
                    w.len(),
                    self.k,
                    y.len(),
                    self.params.rows()
                ),
            ));
        }
        // SAFETY: checked above: the blocks read are inside `w` (a tile's
        // blocks past the matrix are never read: the kernel reads its
        // first instead), the tiles are whole, and every element written
        // is inside `y`.
        unsafe {
            self.run_unchecked(
                w.as_ptr(),
                tiles.as_ptr(),
                tokens,
                y.as_mut_ptr(),
                ldy,
                rows,
                usize::MAX,
            )
        };
        Ok(())
    }

    /// Raw call, in panels of at most `panel_rows` rows (whole register
    /// tiles), so the rows every token tile passes over stay in L2.
    ///
    /// # Safety
    /// `w` must hold the row blocks up to `rows.end` (`rows.start` on a
    /// register tile), `tiles` the tiles of `tokens` tokens for K, and
    /// `Y[t*ldy + r]` must be writable for t < tokens, r in `rows`, with no
    /// other thread touching those elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_unchecked(
        &self,
        w: *const u16,
        tiles: *const u8,
        tokens: usize,
        y: *mut f32,
        ldy: usize,
        rows: Range<usize>,
        panel_rows: usize,
    ) {
        let panel = (panel_rows / self.params.rows()).max(1) * self.params.rows();
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = rows.end.min(r0.saturating_add(panel));
            // SAFETY: guaranteed by the caller for all of `rows`.
            unsafe { (self.f)(w, tiles, y, r0, r1, tokens, ldy, self.k) };
            r0 = r1;
        }
    }
}

impl<'a> Kernel<'a> for GemmWide<'a> {
    /// The weights' type and K (an argument of the kernel, fixed by the
    /// handle).
    type Key = (WeightType, usize);
    fn serves(kind: &KernelKind, (wt, k): Self::Key) -> bool {
        k > 0 && matches!(kind, KernelKind::GemmWide(g) if g.wt == wt)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (_, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified wide GEMM code (see
        // emit::gemm_wide).
        let f = unsafe { std::mem::transmute::<*const u8, GemmWideFn>(entry) };
        let KernelKind::GemmWide(params) = c.spec.kind else {
            unreachable!("serves() checked the kind")
        };
        GemmWide {
            f,
            name: &c.spec.name,
            params,
            k,
        }
    }
}

#[derive(Clone, Copy)]
pub struct GemmQuant<'a> {
    f: GemmQuantFn,
    pub name: &'a str,
    pub q: QuantType,
    pub k: usize,
    /// A call of one token takes the one-token tile (see
    /// `GemmQuantParams::single_token_layout`).
    pub single_token_layout: bool,
    /// How many input values share a scale (`GemmQuantParams::input_span`).
    pub input_span: ScaleSpan,
}

impl GemmQuant<'_> {
    /// Bytes of one token tile for this K (see `emit::gemm_quant`).
    pub fn tile_bytes(&self) -> usize {
        gemm_quant::tile_bytes(self.k)
    }

    /// Bytes of the tile a call of `ntok` tokens takes.
    fn tile_bytes_for(&self, ntok: usize) -> usize {
        if ntok == 1 && self.single_token_layout {
            gemm_quant::single_tile_bytes(self.k)
        } else {
            self.tile_bytes()
        }
    }

    /// `y[t*ldy + r] = W[r, :] · x_t` for r in `rows` and the `ntok` (1..=8)
    /// tokens of one tile, W in Q8_0x16's 16-row blocks (a Q8_0 matrix, or
    /// a panel unpacked into them with the offset `q` names), `rows`
    /// starting on a block. One token's tile is the one-token tile where
    /// `single_token_layout` (`Q8Input::tile_for` gives the right one).
    pub fn run(
        &self,
        w: &[u8],
        tile: &[u8],
        ntok: usize,
        y: &mut [f32],
        ldy: usize,
        rows: Range<usize>,
    ) -> Result<(), KernelError> {
        let input = TokensInput {
            what: "a tile",
            bytes: tile.len(),
            want: self.tile_bytes_for(ntok),
            ntok,
            max_tokens: gemm_quant::TOKENS,
        };
        let layout = if self.q.rows_are_lanes() {
            self.q
        } else {
            QuantType::Q8_0x16
        };
        check_tokens_call((self.name, self.k, layout), w, &input, y, ldy, &rows)?;
        // SAFETY: checked above: the blocks read are inside `w`, the tile
        // is whole, and every element written is inside `y`.
        unsafe { self.run_unchecked(w.as_ptr(), tile.as_ptr(), ntok, y.as_mut_ptr(), ldy, rows) };
        Ok(())
    }

    /// Raw call for a thread pool whose threads write disjoint row ranges
    /// of one Y.
    ///
    /// # Safety
    /// `w` must hold the row blocks up to `rows.end` (`rows.start` on a
    /// block), `tile` a whole tile for K and `ntok` (as `run`'s), `ntok`
    /// in 1..=8, and `Y[t*ldy +
    /// r]` must be writable for t < ntok, r in `rows`, with no other thread
    /// touching those elements.
    pub unsafe fn run_unchecked(
        &self,
        w: *const u8,
        tile: *const u8,
        ntok: usize,
        y: *mut f32,
        ldy: usize,
        rows: Range<usize>,
    ) {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.f)(w, tile, y, rows.start, rows.end, self.k, ldy, ntok) };
    }
}

impl<'a> Kernel<'a> for GemmQuant<'a> {
    /// The weights' block type and K (an argument of the kernel, fixed by
    /// the handle).
    type Key = (QuantType, usize);
    fn serves(kind: &KernelKind, (q, k): Self::Key) -> bool {
        quant_blocks::fits(k) && matches!(kind, KernelKind::GemmQuant(g) if g.q == q)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (q, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified integer GEMM code (see
        // emit::gemm_quant).
        let f = unsafe { std::mem::transmute::<*const u8, GemmQuantFn>(entry) };
        let KernelKind::GemmQuant(params) = c.spec.kind else {
            unreachable!("serves() checked the kind")
        };
        GemmQuant {
            f,
            name: &c.spec.name,
            q,
            k,
            single_token_layout: params.single_token_layout(),
            input_span: params.input_span(),
        }
    }
}

/// Unpacks Q5_0 or Q4_0 row blocks into Q8_0's (see `emit::unpack_quant`).
#[derive(Clone, Copy)]
pub struct UnpackQuant<'a> {
    f: UnpackQuantFn,
    pub name: &'a str,
    pub q: QuantType,
    /// Whose offset the unpacked bytes carry: the GEMM to run on them.
    pub into: QuantType,
    pub k: usize,
}

impl UnpackQuant<'_> {
    /// The layout of the output: Q8_0x16's 16-row blocks, whichever
    /// offset the bytes carry.
    fn out_layout(&self) -> QuantType {
        QuantType::Q8_0x16
    }

    /// Bytes the rows `rows` take once unpacked (whole row blocks).
    pub fn out_bytes(&self, rows: Range<usize>) -> usize {
        self.out_layout().matrix_bytes(rows.len(), self.k)
    }

    /// Rows `rows` (starting on a block of the output's layout) of W, the
    /// whole matrix in `q`'s row blocks, into `out` in the output's layout,
    /// the first block at `out[0]`. Rows of the output's last block past
    /// W's are zeros.
    pub fn run(&self, w: &[u8], rows: Range<usize>, out: &mut [u8]) -> Result<(), KernelError> {
        let block_bytes = self.q.block_bytes(self.k);
        let layout = self.out_layout();
        if rows.start > rows.end
            || !rows.start.is_multiple_of(layout.block_rows())
            || rows.end.div_ceil(quant_blocks::BLOCK_ROWS) > w.len() / block_bytes.max(1)
            || out.len() < self.out_bytes(rows.clone())
        {
            return Err(shape(
                self.name,
                format!(
                    "rows {rows:?} of W ({} bytes, K {}) into {} bytes, or rows start inside a block",
                    w.len(),
                    self.k,
                    out.len()
                ),
            ));
        }
        // The kernel writes W's 4-row blocks only: a 16-row block it ends
        // inside gets zeros (scale 0) for the rest.
        let whole_blocks = rows.len() / layout.block_rows() * layout.block_bytes(self.k);
        out[whole_blocks..self.out_bytes(rows.clone())].fill(0);
        // SAFETY: checked above: the blocks read are inside `w` and the
        // blocks written inside `out`.
        unsafe { self.run_unchecked(w.as_ptr(), rows, out.as_mut_ptr()) };
        Ok(())
    }

    /// Raw call.
    ///
    /// # Safety
    /// `w` must hold the row blocks up to `rows.end` (`rows.start` on a
    /// block) and `out` [`UnpackQuant::out_bytes`] writable bytes.
    pub unsafe fn run_unchecked(&self, w: *const u8, rows: Range<usize>, out: *mut u8) {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.f)(w, out, self.k, rows.start, rows.end) };
    }
}

impl<'a> Kernel<'a> for UnpackQuant<'a> {
    /// The packed block type and K (an argument of the kernel).
    type Key = (QuantType, usize);
    fn serves(kind: &KernelKind, (q, k): Self::Key) -> bool {
        quant_blocks::fits(k) && matches!(kind, KernelKind::UnpackQuant(u) if u.q == q)
    }
    unsafe fn bind(c: &'a Compiled, entry: *const u8, (q, k): Self::Key) -> Self {
        // SAFETY: the caller passes verified unpacking code (see
        // emit::unpack_quant).
        let f = unsafe { std::mem::transmute::<*const u8, UnpackQuantFn>(entry) };
        let KernelKind::UnpackQuant(params) = c.spec.kind else {
            unreachable!("serves() checked the kind")
        };
        UnpackQuant {
            f,
            name: &c.spec.name,
            q,
            into: params.into,
            k,
        }
    }
}

/// The 8-bit input of a call over several tokens, for
/// [`check_tokens_call`].
struct TokensInput {
    /// What the input is called in an error.
    what: &'static str,
    bytes: usize,
    want: usize,
    ntok: usize,
    max_tokens: usize,
}

/// The checks of a call `fn(w, x, y, r0, r1, k, ldy, ntok)` over weights in
/// 16-row blocks of `layout` (Q8_0x16's whichever offset the bytes carry,
/// or Q5_0x16's): a whole
/// input of 1 to `max_tokens` tokens, rows starting on a block and inside
/// W, and every element written inside Y.
fn check_tokens_call(
    (name, k, layout): (&str, usize, QuantType),
    w: &[u8],
    x: &TokensInput,
    y: &[f32],
    ldy: usize,
    rows: &Range<usize>,
) -> Result<(), KernelError> {
    let ntok = x.ntok;
    if x.bytes != x.want || !(1..=x.max_tokens).contains(&ntok) {
        return Err(shape(
            name,
            format!(
                "{} of {} bytes (want {}) with {ntok} tokens (1 to {})",
                x.what, x.bytes, x.want, x.max_tokens
            ),
        ));
    }
    let block_bytes = layout.block_bytes(k);
    if rows.start > rows.end
        || !rows.start.is_multiple_of(layout.block_rows())
        || rows.end.div_ceil(layout.block_rows()) > w.len() / block_bytes.max(1)
        || rows.end > ldy
        || !rows_fit(y.len(), ntok, ldy, rows.end)
    {
        return Err(shape(
            name,
            format!(
                "rows {rows:?} of W ({} bytes, K {k}) into Y of {ntok} x {ldy} ({} elements), or rows start inside a block",
                w.len(),
                y.len()
            ),
        ));
    }
    Ok(())
}
