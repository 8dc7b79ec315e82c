//! Matrix-product inputs quantized to 8 bits for the integer kernels: each
//! token's activations in blocks of 32, an f32 scale per block (llama.cpp's
//! Q8_0 rule, `d = max|x| / 127`, `q = round(x / d)`, with the scale kept
//! in f32 rather than f16). For the K-quant kernels with VNNI the maximum
//! is taken over a super-block of 256 values and its 8 blocks share the
//! scale (llama.cpp's Q8_K; [`ScaleSpan::SuperBlock`]): the layout stays
//! the same, each block holding its copy of the scale.
//!
//! Quantized once per product, before its rows are split across threads:
//! every thread's chunk of rows reads the same quantized input.
//!
//! Per token the bytes are the K quants, then the K/32 scales (f32, little
//! endian), then the K/32 sums of each block's quants (i32), which a weight
//! format stored with an offset needs (Q5_0: w = v - 16, so w · x = v · x -
//! 16 · sum(x)). The kernel reads a group's 32 quants with one load, its
//! scale and its sum with one each.
//!
//! The tokens are also laid out in tiles of 8 for the integer GEMMs
//! (`jit::emit::gemm_quant`, `gemm_q8_0x16`, which takes single tokens
//! too): per group of 32 columns, the tokens' quants interleaved 4 columns
//! at a time (byte `32c + 4t + j` is token t's column `4c + j`), then the
//! 8 scales, the 8 sums, then the sums as VNNI's group sums start from
//! (`gemm_quant::vnni_group_start`). Tokens past the last are zeros. The values
//! are the same as the per-token layout's, so the GEMV and the GEMMs see
//! the same input.
//!
//! The tiles are built with the quantization, before the rows are split
//! across threads. (Built by the first thread that asked, inside the
//! parallel section, they made the other thread sleep on a futex: 4% of a
//! 4-stream server's samples in waking threads.)
//!
//! A prompt chunk's quantization is split across the threads, whole tiles
//! to each (`Q8Input::quantize_on`): on the main thread alone it was the
//! larger part of a prefill's serial work (a Gemma 3 4B's prefill on two
//! threads gained 2-4%, performance.md). A verify or decode step's few
//! tokens stay on the calling thread, where a parallel section costs more
//! than the work.

use super::pool::ThreadPool;
use crate::jit::emit::gemm_quant::{
    SINGLE_GROUP_BYTES, SINGLE_HALF_STARTS_AT, SINGLE_SCALE_AT, SINGLE_SCALED_SUM_AT, ScaleSpan,
    TILE_GROUP_BYTES, TILE_HALF_STARTS_AT, TILE_SCALED_SUMS_AT, TILE_SCALES_AT, TILE_SUMS_AT,
    TILE_VNNI_STARTS_AT, TOKENS, single_tile_bytes, tile_bytes, vnni_group_start,
};
use crate::model::quant_blocks::GROUP_COLS;

/// Rows from which [`Q8Input::quantize_on`] splits the work across threads:
/// above a verify step's 16 tokens, below a prompt chunk's.
pub const SPLIT_MIN_ROWS: usize = 32;

pub struct Q8Input {
    bytes: Vec<u8>,
    /// The token tiles.
    tiles: Vec<u8>,
    /// The last tile's token in the one-token layout, where that tile
    /// holds one token (`gemm_quant::SINGLE_GROUP_BYTES`); else empty.
    single: Vec<u8>,
    k: usize,
    tokens: usize,
    span: ScaleSpan,
}

/// How finely a product's input is quantized for the integer kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InputPrecision {
    /// One 8-bit level per value (llama.cpp's Q8_0 rule): what the issue
    /// of native weights prescribes, and the fastest.
    #[default]
    Bits8,
    /// Two 8-bit levels per value: the value as [`InputPrecision::Bits8`]
    /// has it, then what that rounding left out, quantized the same way
    /// (its step is at most 1/254 of the first's). The kernels multiply
    /// both as two tokens and the engine adds the pair, so the product
    /// sees the input to about 15 bits for twice the integer work. On the
    /// default model it raises top-1 agreement with `--dtype f16` from
    /// about 97% to over 99%, and no cheaper subset of the matrices
    /// reached 98%.
    TwoLevels,
}

impl InputPrecision {
    /// Quantized tokens per input token.
    pub fn levels(self) -> usize {
        match self {
            InputPrecision::Bits8 => 1,
            InputPrecision::TwoLevels => 2,
        }
    }
}

/// Quantizes each row of `x` into `levels` consecutive tokens' bytes
/// (quants, scales, sums), as [`Q8Input::quantize`] lays them out: the
/// first holds the row, the second (if any) what the first's rounding
/// left out.
#[inline(always)]
fn quantize_rows(
    x: &[f32],
    k: usize,
    (levels, span): (usize, ScaleSpan),
    bytes: &mut [u8],
    tiles: &mut [u8],
) {
    quantize_rows_with(x, k, (levels, span), bytes, tiles, quantize_block);
}

/// [`quantize_rows`] with `block` quantizing each group to the maximum
/// `|x|` of its span: it writes the 32 quants and returns the scale and
/// the quants' sum. Each group goes to
/// the per-token layout (`bytes`) and to its token's tile (`tiles`) as it
/// is made: built in a second pass over the tokens' bytes, the tiles took
/// a third of `Q8Input::quantize`'s time at 512 tokens.
#[inline(always)]
fn quantize_rows_with(
    x: &[f32],
    k: usize,
    (levels, span): (usize, ScaleSpan),
    bytes: &mut [u8],
    tiles: &mut [u8],
    block: impl Fn(&[f32], f32, &mut [u8]) -> (f32, i32),
) {
    let stride = Q8Input::token_bytes(k);
    let groups_per_span = span.values() / GROUP_COLS;
    for (r, (row, out)) in x
        .chunks_exact(k)
        .zip(bytes.chunks_exact_mut(levels * stride))
        .enumerate()
    {
        let (first, second) = out.split_at_mut(stride);
        for (s, values) in row.chunks_exact(span.values()).enumerate() {
            let first_group = s * groups_per_span;
            let quantize_span = |values: &[f32], token: &mut [u8], t: usize, tiles: &mut [u8]| {
                let amax = abs_max(values);
                let mut d = 0.0;
                for (i, group) in values.chunks_exact(GROUP_COLS).enumerate() {
                    let g = first_group + i;
                    d = quantize_group(group, amax, k, g, token, &block, (tiles, t));
                }
                d
            };
            let d = quantize_span(values, first, r * levels, tiles);
            if levels == 2 {
                let quants = &first[first_group * GROUP_COLS..][..values.len()];
                let mut left_out = [0.0f32; 8 * GROUP_COLS];
                let left_out = &mut left_out[..values.len()];
                for ((l, &v), &q) in left_out.iter_mut().zip(values).zip(quants) {
                    *l = v - d * f32::from(q as i8);
                }
                quantize_span(left_out, second, r * levels + 1, tiles);
            }
        }
    }
}

/// Quantizes `values` as group `g` of one token's bytes (`k` values)
/// with `block` to the maximum `amax` of its span: its 32 quants, its
/// scale and the sum of its quants, in `token` and in token `t`'s tile.
/// Returns the scale.
#[inline(always)]
fn quantize_group(
    values: &[f32],
    amax: f32,
    k: usize,
    g: usize,
    token: &mut [u8],
    block: impl Fn(&[f32], f32, &mut [u8]) -> (f32, i32),
    (tiles, t): (&mut [u8], usize),
) -> f32 {
    let groups = k / GROUP_COLS;
    let quants = &mut token[g * GROUP_COLS..(g + 1) * GROUP_COLS];
    let (d, total) = block(values, amax, quants);
    let at = t / TOKENS * tile_bytes(k) + g * TILE_GROUP_BYTES;
    let cell = &mut tiles[at..at + TILE_GROUP_BYTES];
    let lane = 4 * (t % TOKENS);
    for (c, four) in quants.chunks_exact(4).enumerate() {
        cell[c * 4 * TOKENS + lane..][..4].copy_from_slice(four);
    }
    cell[TILE_SCALES_AT + lane..][..4].copy_from_slice(&d.to_le_bytes());
    cell[TILE_SUMS_AT + lane..][..4].copy_from_slice(&total.to_le_bytes());
    let start = vnni_group_start(total);
    cell[TILE_VNNI_STARTS_AT + lane..][..4].copy_from_slice(&start.to_le_bytes());
    let (scaled_sum, half_starts) = k_quant_terms(quants, d, total);
    cell[TILE_SCALED_SUMS_AT + lane..][..4].copy_from_slice(&scaled_sum.to_le_bytes());
    for (half, start) in half_starts.into_iter().enumerate() {
        let at = TILE_HALF_STARTS_AT + half * 4 * TOKENS + lane;
        cell[at..][..4].copy_from_slice(&start.to_le_bytes());
    }
    token[k + g * 4..][..4].copy_from_slice(&d.to_le_bytes());
    token[k + groups * 4 + g * 4..][..4].copy_from_slice(&total.to_le_bytes());
    d
}

/// What the K-quant kernels take of a group of 32 quants besides them
/// (see `gemm_kquant`): its scaled sum `d · sum` (Q4_K's mins multiply
/// it) and the starts of its halves' Q6_K sums, `-32 ·` each half's sum.
fn k_quant_terms(quants: &[u8], d: f32, total: i32) -> (f32, [i32; 2]) {
    let first_half: i32 = quants[..GROUP_COLS / 2]
        .iter()
        .map(|&q| i32::from(q as i8))
        .sum();
    (
        d * total as f32,
        [-32 * first_half, -32 * (total - first_half)],
    )
}

/// Token `token` (its quants, scales and sums as [`Q8Input::token`]
/// lays them out) in the one-token tile's layout.
fn single_tile(token: &[u8], k: usize) -> Vec<u8> {
    let groups = k / GROUP_COLS;
    let word = |at: usize| [token[at], token[at + 1], token[at + 2], token[at + 3]];
    let mut out = vec![0u8; single_tile_bytes(k)];
    for (g, cell) in out.chunks_exact_mut(SINGLE_GROUP_BYTES).enumerate() {
        let quants = &token[g * GROUP_COLS..(g + 1) * GROUP_COLS];
        let d = f32::from_le_bytes(word(k + 4 * g));
        let total = i32::from_le_bytes(word(k + 4 * groups + 4 * g));
        let (scaled_sum, half_starts) = k_quant_terms(quants, d, total);
        cell[..GROUP_COLS].copy_from_slice(quants);
        cell[SINGLE_SCALE_AT..][..4].copy_from_slice(&d.to_le_bytes());
        cell[SINGLE_SCALED_SUM_AT..][..4].copy_from_slice(&scaled_sum.to_le_bytes());
        for (half, start) in half_starts.into_iter().enumerate() {
            cell[SINGLE_HALF_STARTS_AT + 4 * half..][..4].copy_from_slice(&start.to_le_bytes());
        }
    }
    out
}

/// One block of 32 values whose span's maximum `|x|` is `amax`: writes
/// its quants and returns its scale and the quants' sum.
#[inline(always)]
fn quantize_block(block: &[f32], amax: f32, quants: &mut [u8]) -> (f32, i32) {
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    // The quants' sum, in 8 lanes of whole numbers (exact: 32 values of
    // at most 127). Summing the stored bytes instead compiled to 32 scalar
    // sign-extending loads per group: this function's share of a 4-stream
    // server profile went from 1.64% to 1.49% of all samples.
    let mut lane_sums = [0.0f32; 8];
    for (eight_q, eight_v) in quants.chunks_exact_mut(8).zip(block.chunks_exact(8)) {
        for ((q, &v), sum) in eight_q.iter_mut().zip(eight_v).zip(&mut lane_sums) {
            // |v * inv| <= 127 up to rounding. r is a whole number, so
            // adding 1.5 * 2^23 is exact and leaves r in the low bits
            // of the sum's mantissa, two's complement: its low byte is
            // r as i8. (`r as i8` compiled to a scalar saturating
            // conversion per value, 32 per block, in a loop otherwise
            // vector code.)
            let r = (v * inv).round();
            *q = (r + WHOLE_NUMBER_BIAS).to_bits() as u8;
            *sum += r;
        }
    }
    (d, lane_sums.iter().sum::<f32>() as i32)
}

/// [`quantize_block`] in AVX2 intrinsics, the same bytes. What the
/// compiler made of the portable code kept the maximum scalar and packed
/// 8 quants at a time through xmm shuffles, while the other thread of a
/// verify step waited; this form takes about half the time per value.
///
/// # Safety
/// The CPU must have AVX2; `block` holds 32 values and `quants` 32 bytes.
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(block: &[f32], amax: f32, quants: &mut [u8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    assert!(block.len() == GROUP_COLS && quants.len() == GROUP_COLS);
    // SAFETY: 32 values and 32 bytes, asserted above; AVX2 per this
    // function's contract.
    unsafe {
        let at = block.as_ptr();
        let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(at.add(i)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // Half away from zero as `f32::round` compiles: truncate x plus
        // the float just below 0.5 with x's sign (0.5 itself would carry
        // 0.49999997 up to 1).
        let below_half = _mm256_set1_ps(0.499_999_97);
        let sign = _mm256_set1_ps(-0.0);
        let q = v.map(|x| {
            let x = _mm256_mul_ps(x, inv);
            let nudge = _mm256_or_ps(below_half, _mm256_and_ps(x, sign));
            _mm256_cvttps_epi32(_mm256_add_ps(x, nudge))
        });
        // Packing works within 128-bit halves: for j < 4, dword j of the
        // result holds vector j's quants 0-3 and dword j + 4 its quants
        // 4-7; the permutation puts the dwords back in order.
        let words = [
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        ];
        let bytes = _mm256_packs_epi16(words[0], words[1]);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        _mm256_storeu_si256(quants.as_mut_ptr().cast(), bytes);
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_extracti128_si256(s, 1), _mm256_castsi256_si128(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        (d, _mm_cvtsi128_si32(s))
    }
}

/// 1.5 * 2^23: added to a whole number of magnitude below 2^22, the
/// number ends up in the low mantissa bits of the sum.
const WHOLE_NUMBER_BIAS: f32 = 12_582_912.0;

/// max |v| over a block, in 8 lanes so the compiler keeps it in vector
/// registers (a fold in order stays scalar: 32 dependent maxima). Maxima
/// do not round, so the order does not change the result.
#[inline(always)]
fn abs_max(block: &[f32]) -> f32 {
    // A compare and select rather than f32::max, whose NaN rule keeps it
    // from being vmaxps; both ignore a NaN value.
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [0.0f32; 8];
    for eight in block.chunks_exact(8) {
        for (lane, v) in lanes.iter_mut().zip(eight) {
            *lane = larger(*lane, v.abs());
        }
    }
    lanes.iter().fold(0.0f32, |m, &v| larger(m, v))
}

/// [`quantize_rows`] compiled for AVX2, where `f32::round` (half away from
/// zero) is a few vector instructions rather than a call to libm's
/// `roundf` per value: that call and the loop around it were 6% of a
/// 512-token prefill's profile, 3.1% in `roundf` alone.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
unsafe fn quantize_rows_avx2(
    x: &[f32],
    k: usize,
    levels_and_span: (usize, ScaleSpan),
    bytes: &mut [u8],
    tiles: &mut [u8],
) {
    // SAFETY: AVX2 per this function's contract; every block the rows
    // are cut into holds 32 values and 32 quants.
    quantize_rows_with(
        x,
        k,
        levels_and_span,
        bytes,
        tiles,
        |block, amax, quants| unsafe { quantize_block_avx2(block, amax, quants) },
    );
}

impl Q8Input {
    /// Bytes one token takes.
    pub fn token_bytes(k: usize) -> usize {
        k + k / GROUP_COLS * 8
    }

    /// Quantizes `x` (`[tokens, k]`, row-major); `k` must be a multiple of 32.
    pub fn quantize(x: &[f32], k: usize) -> Q8Input {
        Q8Input::quantize_with(x, k, InputPrecision::Bits8, ScaleSpan::Group)
    }

    /// Quantizes `x` at `precision`: with two levels, row `t` of `x`
    /// becomes tokens `2t` (the row) and `2t + 1` (what its rounding left
    /// out), and a product's rows `2t` and `2t + 1` add up to row `t`'s.
    /// One scale covers `span`'s values (K must hold whole spans).
    pub fn quantize_with(
        x: &[f32],
        k: usize,
        precision: InputPrecision,
        span: ScaleSpan,
    ) -> Q8Input {
        Q8Input::quantize_split(x, k, precision, span, None)
    }

    /// [`Q8Input::quantize_with`] with the tokens split across `pool`'s
    /// threads when there are at least [`SPLIT_MIN_ROWS`] rows (a prompt's
    /// chunk), whole tiles to each: the same bytes, made in about half the
    /// time on two threads. Fewer rows (a decode or verify step) are
    /// quantized on the calling thread, where a parallel section would
    /// cost more than the work.
    pub fn quantize_on(
        pool: &ThreadPool,
        x: &[f32],
        k: usize,
        precision: InputPrecision,
        span: ScaleSpan,
    ) -> Q8Input {
        let split = (pool.threads() > 1 && x.len() / k.max(1) >= SPLIT_MIN_ROWS).then_some(pool);
        Q8Input::quantize_split(x, k, precision, span, split)
    }

    fn quantize_split(
        x: &[f32],
        k: usize,
        precision: InputPrecision,
        span: ScaleSpan,
        pool: Option<&ThreadPool>,
    ) -> Q8Input {
        assert!(
            k > 0 && k.is_multiple_of(span.values()) && x.len().is_multiple_of(k),
            "Q8 input of {} values with K {k} in spans of {}",
            x.len(),
            span.values()
        );
        let levels = precision.levels();
        let tokens = x.len() / k * levels;
        let stride = Self::token_bytes(k);
        let mut bytes = vec![0u8; tokens * stride];
        // Zeros stand for the absent tokens of the last tile.
        let mut tiles = vec![0u8; tokens.div_ceil(TOKENS) * tile_bytes(k)];
        let quantize = |x: &[f32], bytes: &mut [u8], tiles: &mut [u8]| {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, checked just above.
                unsafe { quantize_rows_avx2(x, k, (levels, span), bytes, tiles) };
            } else {
                quantize_rows(x, k, (levels, span), bytes, tiles);
            }
        };
        match pool {
            None => quantize(x, &mut bytes, &mut tiles),
            Some(pool) => {
                // Each thread's rows fill whole tiles (but the last
                // thread's), so its tokens' bytes and tiles are slices of
                // their own; the rows' tile indices start at zero in each.
                let (mut x_left, mut bytes_left, mut tiles_left) =
                    (x, &mut bytes[..], &mut tiles[..]);
                let carve = |rows: usize| {
                    let part_tokens = rows * levels;
                    let (x_part, x_rest) = x_left.split_at(rows * k);
                    let (bytes_part, bytes_rest) =
                        std::mem::take(&mut bytes_left).split_at_mut(part_tokens * stride);
                    let (tiles_part, tiles_rest) = std::mem::take(&mut tiles_left)
                        .split_at_mut(part_tokens.div_ceil(TOKENS) * tile_bytes(k));
                    (x_left, bytes_left, tiles_left) = (x_rest, bytes_rest, tiles_rest);
                    (x_part, bytes_part, tiles_part)
                };
                pool.run_parts(x.len() / k, TOKENS / levels, carve, |(x, bytes, tiles)| {
                    quantize(x, bytes, tiles)
                });
            }
        }
        let single = if tokens % TOKENS == 1 {
            single_tile(&bytes[(tokens - 1) * stride..], k)
        } else {
            Vec::new()
        };
        Q8Input {
            bytes,
            tiles,
            single,
            k,
            tokens,
            span,
        }
    }

    /// How many values share a scale.
    pub fn span(&self) -> ScaleSpan {
        self.span
    }

    /// Tiles of 8 tokens (a single token has one too, for the GEMMs that
    /// take single tokens).
    pub fn tile_count(&self) -> usize {
        self.tokens.div_ceil(TOKENS)
    }

    /// Tile `i`'s bytes and how many real tokens it holds.
    pub fn tile(&self, i: usize) -> (&[u8], usize) {
        let bytes = tile_bytes(self.k);
        assert!(i < self.tile_count(), "tile {i} of {}", self.tile_count());
        let ntok = (self.tokens - i * TOKENS).min(TOKENS);
        (&self.tiles[i * bytes..(i + 1) * bytes], ntok)
    }

    /// Tile `i` as a kernel takes it: a tile of one token in the
    /// one-token layout when `single_token_layout` (the kernel's
    /// `GemmQuantParams::single_token_layout`), else as [`Q8Input::tile`].
    pub fn tile_for(&self, i: usize, single_token_layout: bool) -> (&[u8], usize) {
        let (tile, ntok) = self.tile(i);
        if ntok == 1 && single_token_layout {
            (&self.single, 1)
        } else {
            (tile, ntok)
        }
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Token `t`'s quants and scales, as the kernel reads them.
    pub fn token(&self, t: usize) -> &[u8] {
        let stride = Self::token_bytes(self.k);
        &self.bytes[t * stride..(t + 1) * stride]
    }

    /// Token `t`'s block sums as f32, `d_x · sum(q_x)` per 32 inputs: what
    /// a weight offset per block multiplies (`model::k_quant_as_q5_0`).
    pub fn block_sums(&self, t: usize) -> impl Iterator<Item = f32> + '_ {
        let groups = self.k / GROUP_COLS;
        let (scales, sums) = self.token(t)[self.k..].split_at(groups * 4);
        let word = |b: &[u8]| [b[0], b[1], b[2], b[3]];
        scales
            .chunks_exact(4)
            .zip(sums.chunks_exact(4))
            .map(move |(d, sum)| f32::from_le_bytes(word(d)) * i32::from_le_bytes(word(sum)) as f32)
    }

    /// Token `t`'s group `g`: its scale and 32 quants.
    pub fn group(&self, t: usize, g: usize) -> (f32, &[u8]) {
        let token = self.token(t);
        let at = self.k + g * 4;
        let d = f32::from_le_bytes([token[at], token[at + 1], token[at + 2], token[at + 3]]);
        (d, &token[g * GROUP_COLS..(g + 1) * GROUP_COLS])
    }
}

/// The integer dot product of a group's weight values and its input
/// quants (signed bytes stored as u8).
pub fn dot_i8(weights: &[i8], quants: &[u8]) -> i32 {
    weights
        .iter()
        .zip(quants)
        .map(|(&w, &q)| i32::from(w) * i32::from(q as i8))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_values_are_within_half_a_step() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 29 % 71) as f32 - 35.0) / 7.0)
            .collect();
        let q = Q8Input::quantize(&x, 64);
        assert_eq!(q.tokens(), 2);
        for t in 0..2 {
            for g in 0..2 {
                let (d, quants) = q.group(t, g);
                let block = &x[t * 64 + g * 32..][..32];
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!((d - amax / 127.0).abs() <= f32::EPSILON * amax);
                for (&b, &v) in quants.iter().zip(block) {
                    let back = d * f32::from(b as i8);
                    assert!((back - v).abs() <= d * 0.5 + 1e-6, "{v} -> {back}");
                }
            }
        }
    }

    #[test]
    fn the_one_token_tile_holds_what_the_tile_holds_for_its_token() {
        let k = 96;
        for tokens in [1, 9, 2] {
            let x: Vec<f32> = (0..tokens * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
                .collect();
            let q = Q8Input::quantize(&x, k);
            let last = q.tile_count() - 1;
            let (tile, ntok) = q.tile(last);
            let (single, n) = q.tile_for(last, true);
            assert_eq!(n, ntok);
            if ntok > 1 {
                assert_eq!(single, tile, "{tokens} tokens: the 8-token tile");
                continue;
            }
            assert_eq!(single.len(), single_tile_bytes(k));
            for g in 0..k / GROUP_COLS {
                let cell = &tile[g * TILE_GROUP_BYTES..][..TILE_GROUP_BYTES];
                let one = &single[g * SINGLE_GROUP_BYTES..][..SINGLE_GROUP_BYTES];
                for c in 0..GROUP_COLS / 4 {
                    assert_eq!(one[4 * c..][..4], cell[4 * TOKENS * c..][..4]);
                }
                for (at, tile_at) in [
                    (SINGLE_SCALE_AT, TILE_SCALES_AT),
                    (SINGLE_SCALED_SUM_AT, TILE_SCALED_SUMS_AT),
                    (SINGLE_HALF_STARTS_AT, TILE_HALF_STARTS_AT),
                    (SINGLE_HALF_STARTS_AT + 4, TILE_HALF_STARTS_AT + 4 * TOKENS),
                ] {
                    assert_eq!(one[at..][..4], cell[tile_at..][..4], "group {g} at {at}");
                }
            }
        }
    }

    #[test]
    fn halves_round_away_from_zero_on_every_path() {
        // With max|x| = 127 the scale is 1, so x / d is x itself: halves
        // must round away from zero (llama.cpp's rule), and just below a
        // half must not round up.
        let mut block = [0.0f32; 32];
        let cases = [
            (127.0, 127),
            (2.5, 3),
            (-2.5, -3),
            (0.5, 1),
            (-0.5, -1),
            (0.49999997, 0),
            (-1.4999999, -1),
            (126.5, 127),
        ];
        for (slot, &(v, _)) in block.iter_mut().zip(&cases) {
            *slot = v;
        }
        let mut portable = vec![0u8; Q8Input::token_bytes(32)];
        let mut tile = vec![0u8; tile_bytes(32)];
        quantize_rows(&block, 32, (1, ScaleSpan::Group), &mut portable, &mut tile);
        let quants: Vec<i8> = portable[..cases.len()].iter().map(|&b| b as i8).collect();
        let expected: Vec<i8> = cases.iter().map(|&(_, q)| q).collect();
        assert_eq!(quants, expected);
        assert!(
            std::arch::is_x86_feature_detected!("avx2"),
            "the engine needs AVX2"
        );
        // Many scales, every path the same bytes.
        let x: Vec<f32> = (0..32 * 64)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / (1.0 + (i / 32) as f32))
            .collect();
        for (input, k) in [(&block[..], 32), (&x[..], 32), (&x[..], 256)] {
            let span = if k == 256 {
                ScaleSpan::SuperBlock
            } else {
                ScaleSpan::Group
            };
            for levels in 1..=2 {
                let tokens = input.len() / k * levels;
                let mut plain = vec![0u8; tokens * Q8Input::token_bytes(k)];
                let mut avx2 = plain.clone();
                let mut plain_tiles = vec![0u8; tokens.div_ceil(TOKENS) * tile_bytes(k)];
                let mut avx2_tiles = plain_tiles.clone();
                quantize_rows(input, k, (levels, span), &mut plain, &mut plain_tiles);
                // SAFETY: AVX2 is present, asserted above.
                unsafe { quantize_rows_avx2(input, k, (levels, span), &mut avx2, &mut avx2_tiles) };
                assert_eq!(plain, avx2);
                assert_eq!(plain_tiles, avx2_tiles);
            }
        }
    }

    #[test]
    fn tiles_hold_each_tokens_quants_scales_and_sums() {
        let k = 64;
        let tokens = 11;
        let x: Vec<f32> = (0..tokens * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
            .collect();
        let q = Q8Input::quantize(&x, k);
        assert_eq!(q.tile_count(), 2);
        for t in 0..16 {
            let (tile, ntok) = q.tile(t / TOKENS);
            assert_eq!(ntok, if t < 8 { 8 } else { 3 });
            let lane = t % TOKENS;
            for g in 0..k / GROUP_COLS {
                let group = &tile[g * TILE_GROUP_BYTES..][..TILE_GROUP_BYTES];
                let scale =
                    f32::from_le_bytes(group[TILE_SCALES_AT + 4 * lane..][..4].try_into().unwrap());
                let sum =
                    i32::from_le_bytes(group[TILE_SUMS_AT + 4 * lane..][..4].try_into().unwrap());
                let start = i32::from_le_bytes(
                    group[TILE_VNNI_STARTS_AT + 4 * lane..][..4]
                        .try_into()
                        .unwrap(),
                );
                let quants: Vec<u8> = (0..GROUP_COLS)
                    .map(|col| group[col / 4 * 4 * TOKENS + lane * 4 + col % 4])
                    .collect();
                if t < tokens {
                    let (d, want) = q.group(t, g);
                    assert_eq!((scale, quants.as_slice()), (d, want));
                    assert_eq!(sum, want.iter().map(|&b| i32::from(b as i8)).sum::<i32>());
                    assert_eq!(start, 0x4B40_0000 - sum * 128);
                } else {
                    assert_eq!((scale, sum, start), (0.0, 0, 0));
                    assert!(quants.iter().all(|&b| b == 0));
                }
            }
        }
        assert_eq!(Q8Input::quantize(&x[..k], k).tile_count(), 1);
    }

    /// Two levels: the first is the one-level quantization, byte for
    /// byte, and the two together are within half of the second's step
    /// of each value, which is at most 1/254 of the first's.
    #[test]
    fn two_levels_hold_what_the_first_rounding_left_out() {
        let k = 96;
        // Blocks with one large value among small ones: where one level
        // loses the most.
        let x: Vec<f32> = (0..3 * k)
            .map(|i| {
                let v = ((i * 7919 % 2003) as f32 - 1001.0) / 977.0;
                if i % 29 == 0 { v * 300.0 } else { v }
            })
            .collect();
        let one = Q8Input::quantize(&x, k);
        let two = Q8Input::quantize_with(&x, k, InputPrecision::TwoLevels, ScaleSpan::Group);
        assert_eq!((one.tokens(), two.tokens()), (3, 6));
        let mut first_error = 0.0f32;
        let mut both_error = 0.0f32;
        for t in 0..3 {
            assert_eq!(two.token(2 * t), one.token(t), "token {t}'s first level");
            for g in 0..k / GROUP_COLS {
                let (d1, q1) = two.group(2 * t, g);
                let (d2, q2) = two.group(2 * t + 1, g);
                assert!(d2 <= d1 / 254.0 * 1.0001, "second step {d2} against {d1}");
                let block = &x[t * k + g * GROUP_COLS..][..GROUP_COLS];
                for ((&v, &a), &b) in block.iter().zip(q1).zip(q2) {
                    let first = d1 * f32::from(a as i8);
                    let both = first + d2 * f32::from(b as i8);
                    first_error = first_error.max((v - first).abs() / d1);
                    let bound = d2 / 2.0 + v.abs() * f32::EPSILON * 2.0;
                    assert!(
                        (v - both).abs() <= bound,
                        "{v}: {both} off by more than {bound}"
                    );
                    both_error = both_error.max((v - both).abs() / d1);
                }
            }
        }
        // The test's blocks make the first level's rounding show.
        assert!(first_error > 0.4, "{first_error}");
        assert!(both_error < 0.0025, "{both_error}");
    }

    /// A super-block's 8 groups share the scale of its largest value, at
    /// every level, and each value is within half a step of it.
    #[test]
    fn a_super_block_shares_one_scale_per_level() {
        let k = 512;
        let x: Vec<f32> = (0..3 * k)
            .map(|i| {
                let v = ((i * 7919 % 2003) as f32 - 1001.0) / 977.0;
                if i % 293 == 0 { v * 40.0 } else { v }
            })
            .collect();
        let two = Q8Input::quantize_with(&x, k, InputPrecision::TwoLevels, ScaleSpan::SuperBlock);
        assert_eq!(two.span(), ScaleSpan::SuperBlock);
        for t in 0..6 {
            for s in 0..k / 256 {
                let row = &x[t / 2 * k + s * 256..][..256];
                let d = two.group(t, 8 * s).0;
                if t % 2 == 0 {
                    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    assert_eq!(d, amax / 127.0, "token {t}, super-block {s}");
                }
                for g in 8 * s..8 * s + 8 {
                    let (dg, quants) = two.group(t, g);
                    assert_eq!(dg, d, "token {t}, group {g}");
                    if t % 2 == 0 {
                        let values = &x[t / 2 * k + g * GROUP_COLS..][..GROUP_COLS];
                        for (&v, &q) in values.iter().zip(quants) {
                            let err = (v - d * f32::from(q as i8)).abs();
                            assert!(err <= d / 2.0 * 1.0001, "{v} in group {g}: {err}");
                        }
                    }
                }
            }
        }
    }

    /// Split across two threads, every token's bytes, every tile and the
    /// one-token tile are those made on one thread, for row counts that
    /// do and do not fill the threads' tiles, at either precision and
    /// scale span; below `SPLIT_MIN_ROWS` nothing is split.
    #[test]
    fn quantizing_on_two_threads_makes_the_same_input() {
        let pool = ThreadPool::new(2);
        let k = 512;
        for rows in [1, SPLIT_MIN_ROWS, 37, 130] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 6151 % 4099) as f32 - 2049.0) / 613.0)
                .collect();
            for precision in [InputPrecision::Bits8, InputPrecision::TwoLevels] {
                for span in [ScaleSpan::Group, ScaleSpan::SuperBlock] {
                    let one = Q8Input::quantize_with(&x, k, precision, span);
                    let split = Q8Input::quantize_on(&pool, &x, k, precision, span);
                    let case = format!("{rows} rows, {precision:?}, {span:?}");
                    assert_eq!(split.tokens(), one.tokens(), "{case}");
                    assert_eq!(split.bytes, one.bytes, "{case}: token bytes");
                    assert_eq!(split.tiles, one.tiles, "{case}: tiles");
                    assert_eq!(split.single, one.single, "{case}: one-token tile");
                }
            }
        }
    }

    #[test]
    fn a_zero_block_has_zero_scale_and_quants() {
        let q = Q8Input::quantize(&[0.0; 32], 32);
        let (d, quants) = q.group(0, 0);
        assert_eq!(d, 0.0);
        assert!(quants.iter().all(|&b| b == 0));
    }
}
