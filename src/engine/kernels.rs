//! The matrix kernels the fast engine calls. The JIT provides the real
//! implementation; `PortableKernels` is plain Rust with the same contract,
//! used to test the engine's driver logic on its own.

use super::ops::{self, dot};
use super::packed::{OFFSET_BLOCK_ROWS, PackedMatrix};
use super::q8_input::{Q8Input, dot_i8};
use super::wide_input::WideInput;
use crate::jit::blocking::Blocking;
use crate::jit::emit::gemm_quant::ScaleSpan;
use crate::jit::emit::gemm_wide::GemmWideParams;
use crate::jit::kernels::KernelId;
use crate::model::k_quant_x16;
use crate::model::quant_blocks;
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

    /// The rows from `t` on, as an output of their own.
    pub fn from_row(&self, t: usize) -> SharedOut {
        let skip = (t * self.stride).min(self.len);
        SharedOut {
            // The offset stays within (or one past) the output.
            ptr: self.ptr.wrapping_add(skip),
            len: self.len - skip,
            stride: self.stride,
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
/// `first_query + i / rows_per_token` and sees the given keys up to its own
/// position (and, with a window, only the last `window` of them).
#[derive(Clone, Copy)]
pub struct GroupAttention<'a> {
    /// `[nq][head_dim]`, already scaled.
    pub queries: &'a [f32],
    pub head_dim: usize,
    pub rows_per_token: usize,
    pub first_query: usize,
    /// Contiguous rows of `head_dim` for positions from `first_key` on, up
    /// to the last query's position or fewer (a part of the keys, whose
    /// results are merged with [`merge_key_parts`]).
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
        let end = (pos + 1 - self.first_key).min(self.n_keys());
        (lo - self.first_key).min(end)..end
    }

    /// Turns row `i`'s raw scores (one per key) into probabilities: zero
    /// for keys it may not see, softcap and `softmax` over the rest. With
    /// `log_sum`, also stores ln(sum(exp(score))) over the keys seen, which
    /// weighs this part of the keys against the others when merged.
    pub fn probabilities(
        &self,
        i: usize,
        row: &mut [f32],
        softmax: impl Fn(&mut [f32]),
        log_sum: Option<&mut f32>,
    ) {
        let vis = self.visible(i);
        row[..vis.start].fill(0.0);
        row[vis.end..].fill(0.0);
        let seen = &mut row[vis];
        if let Some(cap) = self.softcap {
            seen.iter_mut().for_each(|s| *s = ops::softcap(*s, cap));
        }
        // ln(sum(exp(score))) = max + ln(sum(exp(score - max))), and the
        // softmax leaves 1 / sum(exp(score - max)) at the largest score: so
        // the log-sum comes from the probabilities, without a second exp
        // per key. (Summing exp in plain Rust took a fifth of a verify
        // step's attention: 8,800 calls of expf per unit at 8 tokens and
        // 275 keys.)
        let (top, max) =
            seen.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |(ti, m), (i, &s)| {
                        if s > m { (i, s) } else { (ti, m) }
                    },
                );
        softmax(seen);
        if let Some(out) = log_sum {
            // No key seen: no mass, which the merge weighs as nothing.
            *out = seen.get(top).map_or(f32::NEG_INFINITY, |p| max - p.ln());
        }
    }
}

/// Merges attention computed over separate parts of the keys: `parts[p]`
/// holds part p's normalised output rows (`head_dim` each) and
/// `log_sums[p]` their ln(sum(exp(score))). Each part's rows are weighed
/// by its share of the total exponential mass.
pub fn merge_key_parts(parts: &[&[f32]], log_sums: &[&[f32]], head_dim: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (row, o) in out.chunks_exact_mut(head_dim).enumerate() {
        let max = log_sums
            .iter()
            .fold(f32::NEG_INFINITY, |m, l| m.max(l[row]));
        let total: f32 = log_sums.iter().map(|l| (l[row] - max).exp()).sum();
        for (part, l) in parts.iter().zip(log_sums) {
            let weight = (l[row] - max).exp() / total;
            let src = &part[row * head_dim..(row + 1) * head_dim];
            for (o, &v) in o.iter_mut().zip(src) {
                *o += weight * v;
            }
        }
    }
}

/// The JIT kernels that multiply one matrix, resolved once (see
/// [`MatKernels::resolve`]) and kept with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatrixKernels {
    /// One token at a time: the GEMV (the integer one for quantized
    /// weights).
    pub one_token: Option<KernelId>,
    /// Several tokens at once: the GEMM (for quantized weights the integer
    /// GEMM over 16-row blocks).
    pub tokens: Option<KernelId>,
    /// Q5_0 and Q4_0: what unpacks panels of rows into 16-row blocks for
    /// that GEMM.
    pub unpack: Option<KernelId>,
    /// How many values of a quantized matrix's input share a scale, as its
    /// integer kernels read them.
    pub input_span: ScaleSpan,
}

pub trait MatKernels: Sync {
    /// `y[t][r] = W[r,:] · x[t,:]` for every token `t` of `x` (row-major
    /// `[tokens, w.cols]`) and every row `r` in `rows`.
    ///
    /// # Safety
    /// No other thread may touch columns `rows` of `y` meanwhile.
    unsafe fn gemm(&self, w: &PackedMatrix, x: &[f32], rows: Range<usize>, y: SharedOut);

    /// `y[t][r] = W[r,:] · x[t,:]` for Q8_0 weights and inputs quantized
    /// to 8 bits (integer dot products per 32-value block, each scaled by
    /// the two blocks' scales).
    ///
    /// # Safety
    /// No other thread may touch columns `rows` of `y` meanwhile.
    unsafe fn gemm_q8(&self, w: &PackedMatrix, x: &Q8Input, rows: Range<usize>, y: SharedOut) {
        unsafe { gemm_q8_portable(w, x, rows, y) }
    }

    /// The GEMM of 16-bit `w` that takes its tokens as tiles laid out once
    /// per product ([`WideInput`]), if these kernels have one; the driver
    /// then lays the input out once for all threads and calls
    /// [`MatKernels::gemm_tiles`] instead of [`MatKernels::gemm`].
    fn tiled_gemm(&self, _w: &PackedMatrix) -> Option<GemmWideParams> {
        None
    }

    /// `y[t][r] = W[r,:] · x[t,:]` for the tokens of `x`, laid out for
    /// `self.tiled_gemm(w)`. Only kernels that name a tiled GEMM are
    /// handed tiles.
    ///
    /// # Safety
    /// No other thread may touch columns `rows` of `y` meanwhile.
    unsafe fn gemm_tiles(
        &self,
        w: &PackedMatrix,
        _x: &WideInput,
        _rows: Range<usize>,
        _y: SharedOut,
    ) {
        unreachable!(
            "{}: tiles for kernels without a tiled GEMM ({} x {})",
            self.name(),
            w.rows,
            w.cols
        )
    }

    /// The kernels that multiply `w`, found once per matrix when these
    /// kernels meet the weights and kept with it
    /// ([`PackedMatrix::set_kernels`]); the calls above use them without a
    /// search. A missing kernel is a load error naming the matrix, never a
    /// quiet fallback on every call. Plain-Rust kernels take any matrix and
    /// need nothing.
    fn resolve(&self, _w: &PackedMatrix) -> Result<MatrixKernels, String> {
        Ok(MatrixKernels::default())
    }

    /// [`MatKernels::resolve`] for a matrix only ever multiplied one token
    /// at a time (a Gemma 4 assistant's): it needs no GEMM.
    fn resolve_one_token(&self, w: &PackedMatrix) -> Result<MatrixKernels, String> {
        self.resolve(w)
    }

    /// A short name for reports ("jit avx2", "portable").
    fn name(&self) -> String;

    /// The blocking the driver obeys: the plan's for the JIT.
    fn blocking(&self) -> Blocking {
        Blocking::default()
    }

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

    /// The final logit softcap, `cap · tanh(x / cap)`, in place.
    fn softcap(&self, x: &mut [f32], cap: f32) {
        x.iter_mut().for_each(|v| *v = ops::softcap(*v, cap));
    }

    /// Attention of every query row of `a` into `out` (`[nq][head_dim]`);
    /// `scratch` holds the scores and is reused across calls. With
    /// `log_sums`, each row's ln(sum(exp(score))) goes there too (see
    /// [`GroupAttention::probabilities`]).
    fn attend(
        &self,
        a: &GroupAttention<'_>,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        mut log_sums: Option<&mut [f32]>,
    ) {
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
            let log_sum = log_sums.as_deref_mut().map(|l| &mut l[i]);
            a.probabilities(i, scratch, ops::softmax, log_sum);
            o.fill(0.0);
            for (j, &w) in scratch.iter().enumerate() {
                for (o, &v) in o.iter_mut().zip(&a.values[j * hd..(j + 1) * hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

/// Adds a matrix's offsets per row and 32 columns (a K-quant kept as Q5_0,
/// `PackedMatrix::offsets`, in blocks of 8 rows) to its product over rows
/// `rows`: `y[t][r] += sum_g offset[r][g] · d_x · sum(q_x)` over token t's
/// groups, from the 8-bit input's block sums, as the kernels take Q5_0's
/// own 16 off. Each (token, row) is summed in one fixed order (groups g
/// into accumulator g mod 4, then the four added), so a token's result
/// does not depend on the step or thread that computed it.
///
/// A vector holds 8 rows' offsets of a group, so there are no horizontal
/// sums. Before, each row went over 8 lanes of groups and then summed the
/// lanes, per row and token: 2.4-3.0% of a 4-stream server profile
/// (`--spec off`, three runs) went there, and 2.2% now (1.67% in the sums,
/// 0.53% around them, one run).
///
/// # Safety
/// No other thread may touch columns `rows` of `y` meanwhile.
pub unsafe fn add_block_offsets(offsets: &[f32], x: &Q8Input, rows: Range<usize>, y: SharedOut) {
    let groups = x.k() / quant_blocks::GROUP_COLS;
    let block = OFFSET_BLOCK_ROWS;
    assert!(
        rows.start.is_multiple_of(block)
            && offsets.len() >= rows.end.next_multiple_of(block) * groups,
        "offsets for every row, from a block's first"
    );
    // Token by token: `flat_map` over the tokens' sums compiled to an
    // iterator adapter that took 0.9% of a 4-stream server profile.
    let mut sums = Vec::with_capacity(x.tokens() * groups);
    for t in 0..x.tokens() {
        sums.extend(x.block_sums(t));
    }
    let mut added = [0.0f32; OFFSET_BLOCK_ROWS];
    for first in rows.clone().step_by(block) {
        let run = first..(first + block).min(rows.end);
        let block_offsets = &offsets[first * groups..(first + block) * groups];
        for (t, token_sums) in sums.chunks_exact(groups).enumerate() {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: AVX2 and FMA were just detected.
                unsafe { block_offset_sums_fma(block_offsets, token_sums, &mut added) };
            } else {
                block_offset_sums(block_offsets, token_sums, &mut added);
            }
            #[cfg(not(target_arch = "x86_64"))]
            block_offset_sums(block_offsets, token_sums, &mut added);
            // SAFETY: the caller owns columns `rows` of every token's row.
            let out = unsafe { y.cells(t, run.clone()) };
            for (o, a) in out.iter_mut().zip(added) {
                *o += a;
            }
        }
    }
}

/// One block's 8 rows: `added[l] = sum_g offsets[g][l] · sums[g]`, the
/// groups in four accumulators (g mod 4) so that the FMAs do not wait on
/// each other, then added in a fixed order. FMA rounds exactly, so the
/// wrapper below and a CPU without it (libm's fmaf) give the same bits.
#[inline(always)]
fn block_offset_sums(offsets: &[f32], sums: &[f32], added: &mut [f32; OFFSET_BLOCK_ROWS]) {
    const CHAINS: usize = 4;
    const ROWS: usize = OFFSET_BLOCK_ROWS;
    let mut acc = [[0.0f32; ROWS]; CHAINS];
    let whole = sums.len() / CHAINS * CHAINS;
    for (quad, four) in offsets[..whole * ROWS]
        .chunks_exact(CHAINS * ROWS)
        .zip(sums[..whole].chunks_exact(CHAINS))
    {
        for (c, chain) in acc.iter_mut().enumerate() {
            for (l, a) in chain.iter_mut().enumerate() {
                *a = quad[c * ROWS + l].mul_add(four[c], *a);
            }
        }
    }
    for g in whole..sums.len() {
        let chain = &mut acc[g % CHAINS];
        for (l, a) in chain.iter_mut().enumerate() {
            *a = offsets[g * ROWS + l].mul_add(sums[g], *a);
        }
    }
    for (l, out) in added.iter_mut().enumerate() {
        *out = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
}

/// [`block_offset_sums`] compiled with FMA, where `mul_add` is one
/// instruction rather than a call per value.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_offset_sums_fma(
    offsets: &[f32],
    sums: &[f32],
    added: &mut [f32; OFFSET_BLOCK_ROWS],
) {
    block_offset_sums(offsets, sums, added);
}

/// The integer product of quantized weights (Q8_0, Q5_0, Q4_0) and 8-bit inputs
/// in plain Rust: the arithmetic the JIT's kernels perform, in another
/// order of the f32 sums.
///
/// # Safety
/// No other thread may touch columns `rows` of `y` meanwhile.
pub unsafe fn gemm_q8_portable(w: &PackedMatrix, x: &Q8Input, rows: Range<usize>, y: SharedOut) {
    let data = w.raw();
    let q = w
        .format
        .quant()
        .expect("an integer product needs quantized weights");
    if q.is_k_quant() {
        // SAFETY: the caller's contract, passed on.
        return unsafe { gemm_kquant_portable(w, x, rows, y) };
    }
    let groups = w.cols / quant_blocks::GROUP_COLS;
    for r in rows {
        for t in 0..x.tokens() {
            let mut sum = 0.0f32;
            for g in 0..groups {
                let (dw, values) = quant_blocks::group(q, data, r, g, w.cols);
                let (dx, qx) = x.group(t, g);
                sum += dot_i8(&values, qx) as f32 * (dw * dx);
            }
            // SAFETY: the caller owns columns `rows` of y.
            unsafe { y.cells(t, r..r + 1)[0] = sum };
        }
    }
}

/// The product of Q4_K, Q5_K or Q6_K weights in 16-row blocks
/// (`model::k_quant_x16`) and 8-bit inputs in plain Rust: the very f32
/// operations of the JIT's kernel (`jit::emit::gemm_kquant`), group after
/// group, so the same bits. With a scale per super-block of input
/// ([`ScaleSpan::SuperBlock`], the VNNI kernels') the group sums (Q6_K's
/// half-group sums) are scaled in integers and converted once per
/// super-block; with a scale per group each group's sum is scaled in f32.
///
/// # Safety
/// No other thread may touch columns `rows` of `y` meanwhile.
pub unsafe fn gemm_kquant_portable(
    w: &PackedMatrix,
    x: &Q8Input,
    rows: Range<usize>,
    y: SharedOut,
) {
    let data = w.raw();
    let q = w.format.quant().expect("a K-quant matrix");
    let groups = w.cols / quant_blocks::GROUP_COLS;
    let super_groups = k_quant_x16::SUPER_GROUPS;
    let integer_scales = x.span() == ScaleSpan::SuperBlock;
    // Each row's groups unpacked once for every token; each token's sum
    // goes group after group, as the kernel's does.
    let mut sums = vec![0.0f32; x.tokens()];
    let mut scaled = vec![0i32; x.tokens()];
    for r in rows {
        sums.fill(0.0);
        for g in 0..groups {
            let k = k_quant_x16::group(q, data, r, g, w.cols);
            for (t, f) in sums.iter_mut().enumerate() {
                let (dx, qx) = x.group(t, g);
                let half = |h: usize| -> (i32, i32) {
                    let range = 16 * h..16 * h + 16;
                    let xs = &qx[range.clone()];
                    let dot = k.quants[range]
                        .iter()
                        .zip(xs)
                        .map(|(&w, &x)| i32::from(w) * i32::from(x as i8))
                        .sum();
                    (dot, xs.iter().map(|&x| i32::from(x as i8)).sum())
                };
                let ((dot_a, sum_a), (dot_b, sum_b)) = (half(0), half(1));
                // Q4_K's and Q5_K's mins: `(dmin·m) · (d_x · Σx)`.
                let min = k.min as f32 * k.dmin;
                let scaled_sum = dx * (sum_a + sum_b) as f32;
                if integer_scales {
                    // Exact: |sum| < 2^27 over a super-block (see the kernel).
                    if q.has_k_mins() {
                        scaled[t] += k.scales[0] * (dot_a + dot_b);
                        *f = (-min).mul_add(scaled_sum, *f);
                    } else {
                        scaled[t] += k.scales[0] * (dot_a - 32 * sum_a);
                        scaled[t] += k.scales[1] * (dot_b - 32 * sum_b);
                    }
                    if g % super_groups == super_groups - 1 {
                        *f = (scaled[t] as f32).mul_add(k.d * dx, *f);
                        scaled[t] = 0;
                    }
                } else if q.has_k_mins() {
                    let scale = k.scales[0] as f32 * k.d;
                    *f = ((dot_a + dot_b) as f32).mul_add(scale * dx, *f);
                    *f = (-min).mul_add(scaled_sum, *f);
                } else {
                    let a = (dot_a - 32 * sum_a) as f32;
                    let b = (dot_b - 32 * sum_b) as f32;
                    let v = b.mul_add(k.scales[1] as f32 * k.d, a * (k.scales[0] as f32 * k.d));
                    *f = v.mul_add(dx, *f);
                }
            }
        }
        for (t, &f) in sums.iter().enumerate() {
            // SAFETY: the caller owns columns `rows` of y.
            unsafe { y.cells(t, r..r + 1)[0] = f };
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
    use crate::engine::packed::offset_index;

    #[test]
    fn block_offsets_add_each_rows_offsets_times_the_group_sums() {
        // 13 rows (the second block partial), K = 160: 5 groups, one past
        // the four accumulators' whole rounds.
        let (rows, k, tokens) = (13, 160, 3);
        let groups = k / quant_blocks::GROUP_COLS;
        let offset = |r: usize, g: usize| (r as f32 - 6.0) * 0.25 + g as f32 * 0.125;
        let mut offsets = vec![0.0f32; 16 * groups];
        for r in 0..rows {
            for g in 0..groups {
                offsets[offset_index(r, g, groups)] = offset(r, g);
            }
        }
        let x: Vec<f32> = (0..tokens * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let input = Q8Input::quantize(&x, k);
        let mut y = vec![1.0f32; tokens * rows];
        // SAFETY: this thread alone writes y.
        unsafe { add_block_offsets(&offsets, &input, 0..rows, SharedOut::new(&mut y, rows)) };
        for t in 0..tokens {
            let sums: Vec<f32> = input.block_sums(t).collect();
            for r in 0..rows {
                let want: f64 = 1.0
                    + (0..groups)
                        .map(|g| f64::from(offset(r, g)) * f64::from(sums[g]))
                        .sum::<f64>();
                let got = f64::from(y[t * rows + r]);
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "t {t} r {r}: {got} vs {want}"
                );
            }
        }
    }

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
        a.probabilities(1, &mut row, ops::softmax, None);
        assert_eq!(&row[..2], &[0.0, 0.0]);
        assert_eq!(&row[6..], &[0.0, 0.0]);
        assert!((row[2..6].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(row[2..6].iter().all(|&p| p > 0.0));
    }

    #[test]
    fn a_part_of_the_keys_is_all_a_query_sees() {
        let keys = [0.0f32; 3];
        // Keys at 5..=7 only, while the queries sit at 10 and 11.
        let part = block(&keys, 5, None);
        assert_eq!(part.visible(0), 0..3);
        assert_eq!(part.visible(3), 0..3);
        // A window that starts past the part leaves nothing to see.
        assert!(block(&keys, 5, Some(2)).visible(0).is_empty());
    }

    #[test]
    fn merged_key_parts_equal_attention_over_all_keys() {
        let hd = 4;
        let mut seed = 7u32;
        let mut rand = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        };
        // Two query rows (heads) of one token at position 10; keys 0..=10.
        let queries: Vec<f32> = (0..2 * hd).map(|_| 3.0 * rand()).collect();
        let keys: Vec<f32> = (0..11 * hd).map(|_| rand()).collect();
        let values: Vec<f32> = (0..11 * hd).map(|_| rand()).collect();
        for (window, softcap) in [(None, None), (Some(9), Some(5.0))] {
            let first = window.map_or(0, |w: usize| 11 - w);
            let over = |k0: usize, k1: usize| GroupAttention {
                queries: &queries,
                head_dim: hd,
                rows_per_token: 2,
                first_query: 10,
                keys: &keys[k0 * hd..k1 * hd],
                values: &values[k0 * hd..k1 * hd],
                first_key: k0,
                window,
                softcap,
            };
            let mut scratch = Vec::new();
            let mut whole = vec![0.0; 2 * hd];
            PortableKernels.attend(&over(first, 11), &mut scratch, &mut whole, None);
            let (mut a, mut b) = (vec![0.0; 2 * hd], vec![0.0; 2 * hd]);
            let (mut la, mut lb) = (vec![0.0; 2], vec![0.0; 2]);
            PortableKernels.attend(&over(first, 6), &mut scratch, &mut a, Some(&mut la));
            PortableKernels.attend(&over(6, 11), &mut scratch, &mut b, Some(&mut lb));
            let mut merged = vec![0.0; 2 * hd];
            merge_key_parts(&[&a, &b], &[&la, &lb], hd, &mut merged);
            for (m, w) in merged.iter().zip(&whole) {
                assert!((m - w).abs() < 1e-5, "{merged:?} vs {whole:?}");
            }
        }
    }
}
