//! Q4_K and Q5_K rows as Q5_0 blocks plus an offset per 32 values, so that
//! the Q5_0 kernels read them: no kernel family of their own (and no bytes
//! of the JIT's budget), 6.5 bits a weight where requantizing to Q8_0
//! took 8.5.
//!
//! A K-quant value is `d·sc·q − dmin·m` per 32-value sub-block, with q in
//! 0..15 (Q4_K) or 0..31 (Q5_K) and 6-bit sc and m. Q5_0's is `s·(v − 16)`
//! with v in 0..31. With v = q + 8 (Q4_K) or v = q (Q5_K) and s = d·sc the
//! two differ by `offset = (16 − shift)·s − dmin·m` per sub-block (shift
//! the 8 or 0 added to q), which the engine adds after the kernel as
//! `offset · d_x · sum(q_x)` from the 8-bit input's block sums, as Q5_0's
//! own 16 comes off. Q5_0 keeps s in FP16; d is FP16 and sc has 6 bits, so
//! d·sc needs up to 17 bits and rounding it to 11 moves a value by at most
//! `q · 2^-11 · |s|` (requantizing to Q8_0 moved it by up to half a step
//! of `max / 127`, about 8 times more for Q4_K's 16 levels).

use super::dequant::k_scale_min;
use super::dtype::DType;
use half::f16;

/// Bytes of one GGUF Q5_0 block (an FP16 scale, 32 high bits, 16 bytes of
/// nibbles).
pub const Q5_0_BLOCK_BYTES: usize = 22;
const SUB_BLOCK: usize = 32;
const SUB_BLOCKS: usize = 8;

/// Whether rows of `dtype` are stored this way when no kernel reads them.
pub fn converts(dtype: DType) -> bool {
    matches!(dtype, DType::Q4K | DType::Q5K)
}

/// Writes one row of `dtype` (whole 256-value super-blocks) as GGUF Q5_0
/// blocks into `blocks` and its offsets, one per 32 values, into
/// `offsets`.
///
/// Panics for another type or lengths that disagree: callers size them
/// from a validated shape.
pub fn row_as_q5_0(dtype: DType, row: &[u8], blocks: &mut [u8], offsets: &mut [f32]) {
    let (super_block_bytes, shift) = match dtype {
        DType::Q4K => (144, 8u8),
        DType::Q5K => (176, 0u8),
        other => panic!("{other} rows are not stored as Q5_0"),
    };
    let groups = row.len() / super_block_bytes * SUB_BLOCKS;
    assert_eq!(
        blocks.len(),
        groups * Q5_0_BLOCK_BYTES,
        "Q5_0 bytes for the row"
    );
    assert_eq!(offsets.len(), groups, "offsets for the row");
    let mut q = [0u8; SUB_BLOCK];
    for (b, block) in row.chunks_exact(super_block_bytes).enumerate() {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let dmin = f16::from_le_bytes([block[2], block[3]]).to_f32();
        for j in 0..SUB_BLOCKS {
            let (sc, m) = k_scale_min(&block[4..16], j);
            sub_block_quants(dtype, block, j, &mut q);
            let s = f16::from_f32(d * sc);
            let g = b * SUB_BLOCKS + j;
            offsets[g] = f32::from(16 - shift) * s.to_f32() - dmin * m;
            let out = &mut blocks[g * Q5_0_BLOCK_BYTES..(g + 1) * Q5_0_BLOCK_BYTES];
            out[..2].copy_from_slice(&s.to_le_bytes());
            let v = q.map(|q| q + shift);
            let high_bits = v
                .iter()
                .enumerate()
                .fold(0u32, |bits, (l, &v)| bits | (u32::from(v >> 4) << l));
            out[2..6].copy_from_slice(&high_bits.to_le_bytes());
            for l in 0..SUB_BLOCK / 2 {
                out[6 + l] = (v[l] & 0x0f) | ((v[l + 16] & 0x0f) << 4);
            }
        }
    }
}

/// The 32 quants of sub-block `j` of a super-block, as `dequant` reads
/// them: Q4_K's 32-byte runs hold two sub-blocks (low nibbles, then high);
/// Q5_K adds bit `j` of each of its 32 high-bit bytes as 16.
fn sub_block_quants(dtype: DType, block: &[u8], j: usize, q: &mut [u8; SUB_BLOCK]) {
    let (nibbles, high) = match dtype {
        DType::Q4K => (&block[16..144], None),
        _ => (&block[48..176], Some(&block[16..48])),
    };
    let run = &nibbles[j / 2 * 32..j / 2 * 32 + 32];
    for (l, q) in q.iter_mut().enumerate() {
        let nibble = if j.is_multiple_of(2) {
            run[l] & 0x0f
        } else {
            run[l] >> 4
        };
        let fifth = high.map_or(0, |h| ((h[l] >> j) & 1) << 4);
        *q = nibble | fifth;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant::dequantize_into;

    /// Super-blocks of random bytes with plausible scales (FP16 d and dmin
    /// of weights' size): every quant, scale and min pattern occurs.
    fn random_super_blocks(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
        let bytes = if dtype == DType::Q4K { 144 } else { 176 };
        let mut state = seed;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out = vec![0u8; n * bytes];
        for block in out.chunks_exact_mut(bytes) {
            block.iter_mut().for_each(|b| *b = next() as u8);
            let scale = |r: u64| f16::from_f32((r % 1000) as f32 * 1e-5 + 1e-6).to_le_bytes();
            block[..2].copy_from_slice(&scale(next()));
            block[2..4].copy_from_slice(&scale(next()));
        }
        out
    }

    #[test]
    fn stored_as_q5_0_the_values_move_by_at_most_the_scales_rounding() {
        for (dtype, q_max) in [(DType::Q4K, 15.0f32), (DType::Q5K, 31.0)] {
            let row = random_super_blocks(dtype, 4, 7 + q_max as u64);
            let groups = 4 * SUB_BLOCKS;
            let mut exact = vec![0.0f32; groups * SUB_BLOCK];
            dequantize_into(dtype, &row, &mut exact);
            let mut blocks = vec![0u8; groups * Q5_0_BLOCK_BYTES];
            let mut offsets = vec![0.0f32; groups];
            row_as_q5_0(dtype, &row, &mut blocks, &mut offsets);
            let mut stored = vec![0.0f32; groups * SUB_BLOCK];
            dequantize_into(DType::Q5_0, &blocks, &mut stored);
            for (g, (e, s)) in exact
                .chunks(SUB_BLOCK)
                .zip(stored.chunks(SUB_BLOCK))
                .enumerate()
            {
                let scale = f16::from_le_bytes([blocks[g * 22], blocks[g * 22 + 1]]).to_f32();
                // |d·sc − s|: FP16's half ulp, 2^-11 of it (2^-25 where s
                // is subnormal), over up to q_max steps; plus the f32
                // rounding of either side, a few ulps of the largest term.
                let rounding = (scale.abs() / 2048.0 * 1.001).max(2f32.powi(-25));
                let terms = e
                    .iter()
                    .fold(offsets[g].abs() + 16.0 * scale.abs(), |m, v| m.max(v.abs()));
                let bound = q_max * rounding + 4.0 * f32::EPSILON * terms;
                for (l, (&x, &y)) in e.iter().zip(s).enumerate() {
                    let got = y + offsets[g];
                    assert!(
                        (x - got).abs() <= bound,
                        "{dtype} sub-block {g} value {l}: {x} stored as {got}"
                    );
                }
            }
        }
    }

    #[test]
    fn other_types_are_refused() {
        assert!(converts(DType::Q4K) && converts(DType::Q5K));
        assert!(!converts(DType::Q6K) && !converts(DType::Q8_0));
        let caught = std::panic::catch_unwind(|| {
            row_as_q5_0(DType::Q6K, &[0; 210], &mut [0; 176], &mut [0.0; 8])
        });
        assert!(caught.is_err());
    }
}
