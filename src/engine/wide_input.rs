//! The input of the 16-bit GEMM on 512-bit vectors (`jit::emit::gemm_wide`),
//! laid out once per product for every thread: tiles of 6 tokens, per
//! group of 8 columns the 6 tokens' values side by side, K padded with
//! zeros to whole groups and absent tokens zero. For BF16 dot products the
//! values are rounded to bf16 (round to nearest even, as
//! `vcvtne2ps2bf16`), otherwise kept in f32.

use crate::jit::emit::gemm_wide::{GemmWideParams, TILE_TOKENS, WideProducts};
use crate::model::row_blocks::{GROUP_COLS, padded_cols};

/// A cache line of the tiles (the kernel's loads stay inside lines).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Tokens laid out for one wide GEMM.
pub struct WideInput {
    lines: Vec<Line>,
    len: usize,
    tokens: usize,
    k: usize,
}

impl WideInput {
    /// The `x.len() / k` tokens of `x` (row-major, `k` values each) laid
    /// out for the kernel of `params`.
    pub fn new(x: &[f32], k: usize, params: &GemmWideParams) -> WideInput {
        assert!(
            k > 0 && x.len().is_multiple_of(k),
            "input is not whole rows"
        );
        let tokens = x.len() / k;
        let tile_bytes = params.tile_bytes(k);
        let len = tokens.div_ceil(TILE_TOKENS) * tile_bytes;
        let mut lines = vec![Line([0; 64]); len.div_ceil(64)];
        // SAFETY: `lines` holds at least `len` initialized bytes, borrowed
        // mutably for this block only.
        let bytes = unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), len) };
        let group_bytes = params.tile_group_bytes();
        let value_bytes = params.input_bytes();
        for (t, row) in x.chunks_exact(k).enumerate() {
            let tile = &mut bytes[t / TILE_TOKENS * tile_bytes..][..tile_bytes];
            let at = t % TILE_TOKENS * GROUP_COLS * value_bytes;
            let mut group = [0f32; GROUP_COLS];
            for (g, values) in row.chunks(GROUP_COLS).enumerate() {
                group[..values.len()].copy_from_slice(values);
                group[values.len()..].fill(0.0);
                let out = &mut tile[g * group_bytes + at..][..GROUP_COLS * value_bytes];
                match params.products {
                    WideProducts::Fma => {
                        for (o, v) in out.chunks_exact_mut(4).zip(group) {
                            o.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    WideProducts::Bf16Dot => {
                        for (o, v) in out.chunks_exact_mut(2).zip(bf16_group(&group)) {
                            o.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                }
            }
        }
        debug_assert_eq!(padded_cols(k) / GROUP_COLS * group_bytes, tile_bytes);
        WideInput {
            lines,
            len,
            tokens,
            k,
        }
    }

    /// The tiles' bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialized bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn k(&self) -> usize {
        self.k
    }
}

/// 8 values rounded to bf16: `vcvtneps2bf16` where the CPU has AVX-512
/// BF16, else the same rounding in Rust.
fn bf16_group(values: &[f32; GROUP_COLS]) -> [u16; GROUP_COLS] {
    if std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512vl")
    {
        // SAFETY: the CPU has the features the function enables.
        unsafe { bf16_group_avx512(values) }
    } else {
        values.map(bf16_round)
    }
}

#[target_feature(enable = "avx512bf16,avx512vl,avx512f")]
fn bf16_group_avx512(values: &[f32; GROUP_COLS]) -> [u16; GROUP_COLS] {
    use std::arch::x86_64::*;
    // SAFETY: 8 f32 are read from and 8 u16 written to arrays of that size.
    unsafe {
        let v = _mm256_loadu_ps(values.as_ptr());
        let b = _mm256_cvtneps_pbh(v);
        let mut out = [0u16; GROUP_COLS];
        _mm_storeu_si128(
            out.as_mut_ptr().cast(),
            std::mem::transmute::<__m128bh, __m128i>(b),
        );
        out
    }
}

/// f32 to bf16, round to nearest even; NaN stays NaN (quieted).
pub fn bf16_round(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jit::emit::gemv::WeightType;

    #[test]
    fn tokens_sit_side_by_side_per_group_padded_with_zeros() {
        let p = GemmWideParams {
            wt: WeightType::F16,
            products: WideProducts::Fma,
        };
        let (k, tokens) = (10, 7);
        let x: Vec<f32> = (0..k * tokens).map(|i| i as f32 + 1.0).collect();
        let input = WideInput::new(&x, k, &p);
        let b = input.bytes();
        assert_eq!(b.len(), 2 * p.tile_bytes(k));
        let value = |at: usize| f32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        // Tile 0, group 1, token 2, column 9 - 8.
        assert_eq!(value(p.tile_group_bytes() + 2 * 32 + 4), x[2 * k + 9]);
        // Past K: zero; token 6 is tile 1's first.
        assert_eq!(value(p.tile_group_bytes() + 2 * 32 + 8), 0.0);
        assert_eq!(value(p.tile_bytes(k)), x[6 * k]);
        // Tile 1's absent tokens are zero.
        assert_eq!(value(p.tile_bytes(k) + 32), 0.0);
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even_as_the_instruction() {
        assert_eq!(bf16_round(1.0), 0x3F80);
        // Halfway: to even (down from 0x3F80_8000, up from 0x3F81_8000).
        assert_eq!(bf16_round(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(bf16_round(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(bf16_round(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert!(half::bf16::from_bits(bf16_round(f32::NAN)).is_nan());
        // The instruction, where this CPU has it, agrees on normal values.
        let mut state = 0x9E37_79B9u32;
        for _ in 0..1000 {
            let mut g = [0f32; GROUP_COLS];
            for v in &mut g {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                *v = f32::from_bits(state & 0xBFFF_FFFF | 0x0080_0000);
            }
            assert_eq!(bf16_group(&g), g.map(bf16_round), "{g:?}");
        }
    }
}
