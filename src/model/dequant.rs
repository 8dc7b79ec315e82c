//! Decoding stored tensors to f32.
//!
//! The block layouts follow the published GGML formats: a block holds one or
//! two f16 scales followed by packed integer quants. Each function decodes
//! exactly one block into `out` (whose length is the block's element count).

use super::dtype::{DType, TensorView};
use super::quant_blocks;
use super::row_blocks;
use half::{bf16, f16};

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Q8_0: scale d, then 32 signed bytes; x = d * q.
fn q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    for (o, &q) in out.iter_mut().zip(&block[2..34]) {
        *o = d * (q as i8) as f32;
    }
}

/// Q4_0: scale d, then 16 bytes; low nibbles are elements 0..16, high
/// nibbles 16..32, each offset by 8.
fn q4_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let qs = &block[2..18];
    for j in 0..16 {
        out[j] = d * ((qs[j] & 0x0f) as i32 - 8) as f32;
        out[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// Q5_0: scale d, 32 high bits (one per element), then 16 bytes of low
/// nibbles laid out as in Q4_0; values offset by 16.
fn q5_0(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
    let qs = &block[6..22];
    for j in 0..16 {
        let hi0 = ((qh >> j) & 1) << 4;
        let hi1 = ((qh >> (j + 16)) & 1) << 4;
        out[j] = d * (((qs[j] & 0x0f) as u32 | hi0) as i32 - 16) as f32;
        out[j + 16] = d * (((qs[j] >> 4) as u32 | hi1) as i32 - 16) as f32;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 scale
/// bytes of a Q4_K / Q5_K super-block.
pub(crate) fn k_scale_min(scales: &[u8], j: usize) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

/// Q4_K: super-block of 256 in 8 sub-blocks of 32, each with a 6-bit scale
/// and min; x = d * sc * q - dmin * m. Each 32-byte run of quants holds two
/// sub-blocks: low nibbles first, then high nibbles.
fn q4_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let qs = &block[16..144];
    for pair in 0..4 {
        let q = &qs[pair * 32..pair * 32 + 32];
        let (sc_lo, m_lo) = k_scale_min(scales, 2 * pair);
        let (sc_hi, m_hi) = k_scale_min(scales, 2 * pair + 1);
        let base = pair * 64;
        for l in 0..32 {
            out[base + l] = d * sc_lo * (q[l] & 0x0f) as f32 - dmin * m_lo;
            out[base + 32 + l] = d * sc_hi * (q[l] >> 4) as f32 - dmin * m_hi;
        }
    }
}

/// Q5_K: as Q4_K with a fifth bit per element from 32 bytes of high bits;
/// sub-block `s` takes bit `s` of each high-bit byte.
fn q5_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 0);
    let dmin = f16_at(block, 2);
    let scales = &block[4..16];
    let qh = &block[16..48];
    let qs = &block[48..176];
    for pair in 0..4 {
        let q = &qs[pair * 32..pair * 32 + 32];
        let (sc_lo, m_lo) = k_scale_min(scales, 2 * pair);
        let (sc_hi, m_hi) = k_scale_min(scales, 2 * pair + 1);
        let bit_lo = 1u8 << (2 * pair);
        let bit_hi = 1u8 << (2 * pair + 1);
        let base = pair * 64;
        for l in 0..32 {
            let lo = (q[l] & 0x0f) + if qh[l] & bit_lo != 0 { 16 } else { 0 };
            let hi = (q[l] >> 4) + if qh[l] & bit_hi != 0 { 16 } else { 0 };
            out[base + l] = d * sc_lo * lo as f32 - dmin * m_lo;
            out[base + 32 + l] = d * sc_hi * hi as f32 - dmin * m_hi;
        }
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed 8-bit
/// scales (one per 16 elements), then d. Values are 6-bit, offset by 32.
/// Processed in two halves of 128 elements.
fn q6_k(block: &[u8], out: &mut [f32]) {
    let d = f16_at(block, 208);
    for half in 0..2 {
        let ql = &block[half * 64..half * 64 + 64];
        let qh = &block[128 + half * 32..128 + half * 32 + 32];
        let sc = &block[192 + half * 8..192 + half * 8 + 8];
        let y = &mut out[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Decodes `bytes` (a whole number of `dtype` blocks) into `out`. Values
/// of a row-block type come out in storage order; [`to_f32`] and
/// [`row_into`] put them back in rows.
///
/// Panics if the lengths disagree: callers size both from a validated shape.
pub fn dequantize_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let be = dtype.block_elems();
    let bb = dtype.block_bytes();
    assert_eq!(
        bytes.len() / bb * be,
        out.len(),
        "dequantize: length mismatch"
    );
    assert_eq!(bytes.len() % bb, 0, "dequantize: partial block");
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 | DType::F16RowBlocks => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 | DType::BF16RowBlocks => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        // Index tables as numbers (exact below 2^24).
        DType::I32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        DType::I64 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                *o = i64::from_le_bytes(b) as f32;
            }
        }
        _ => {
            let decode: fn(&[u8], &mut [f32]) = match dtype {
                DType::Q8_0 => q8_0,
                DType::Q4_0 => q4_0,
                DType::Q5_0 => q5_0,
                DType::Q4K => q4_k,
                DType::Q5K => q5_k,
                DType::Q6K => q6_k,
                DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::I64 => {
                    unreachable!()
                }
                DType::F16RowBlocks | DType::BF16RowBlocks => unreachable!(),
                // Rows are spread over row blocks: `row_into` reads them.
                DType::QuantRowBlocks(q) => {
                    panic!("{q:?} row blocks dequantize by row (dequant::row_into)")
                }
            };
            for (block, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                decode(block, o);
            }
        }
    }
}

/// The whole tensor as f32.
pub fn to_f32(t: &TensorView<'_>) -> Vec<f32> {
    let mut out = vec![0.0f32; t.elems()];
    if t.dtype.is_row_blocked() {
        let (_, cols) = t.matrix_dims();
        for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
            row_into(t, r, row);
        }
    } else {
        dequantize_into(t.dtype, t.bytes, &mut out);
    }
    out
}

/// Row `row` of a matrix-shaped tensor as f32, into `out` (one row long).
pub fn row_into(t: &TensorView<'_>, row: usize, out: &mut [f32]) {
    let (_, cols) = t.matrix_dims();
    if let DType::QuantRowBlocks(q) = t.dtype {
        return quant_blocks::dequant_row(q, t.bytes, row, cols, out);
    }
    if t.dtype.is_row_blocked() {
        // One row's values are spread over its block: decode them one
        // 8-value group at a time.
        for (g, part) in out.chunks_mut(row_blocks::GROUP_COLS).enumerate() {
            let at = row_blocks::index(row, g * row_blocks::GROUP_COLS, cols) * 2;
            dequantize_into(t.dtype, &t.bytes[at..at + part.len() * 2], part);
        }
        return;
    }
    let rb = t.dtype.row_bytes(cols).expect("validated row length");
    dequantize_into(t.dtype, &t.bytes[row * rb..(row + 1) * rb], out);
}
