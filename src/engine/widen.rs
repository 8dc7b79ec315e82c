//! Quantized rows widened to FP16 row blocks, for products of several
//! tokens: the GEMM then reads the widened panel once per token tile.
//!
//! Widening happens once per weight per prefill chunk (126 tokens, 252
//! FLOPs per weight in the GEMM), so it must cost a fraction of a
//! nanosecond per weight: scalar Rust (the block's values one by one, then
//! a software f16 conversion) took as long as the GEMM itself. The AVX2 +
//! F16C path unpacks 32 values at a time and converts 8 per instruction;
//! the scalar path is its oracle and serves CPUs the JIT does not run on.

use super::packed::PackedMatrix;
use crate::model::quant_blocks::{self, GROUP_COLS, QuantType};
use crate::model::row_blocks;
use half::f16;
use std::ops::Range;

/// Writes rows `rows` of quantized `w` as rows `0..rows.len()` of a 16-bit
/// (FP16) row-block matrix `out` of `w.cols` columns. `out` must hold
/// `row_blocks::padded_len(rows.len(), w.cols)` values; padding is not
/// touched.
pub fn widen_rows(w: &PackedMatrix, rows: Range<usize>, out: &mut [u16]) {
    let q = w
        .format
        .quant()
        .expect("only quantized matrices are widened");
    assert!(out.len() >= row_blocks::padded_len(rows.len(), w.cols));
    assert!(rows.end <= w.rows.next_multiple_of(quant_blocks::BLOCK_ROWS));
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2 and F16C (checked just above), and the
        // slices are sized as asserted.
        unsafe { avx2::widen_rows(q, w, rows, out) }
    } else {
        widen_rows_scalar(q, w, rows, out);
    }
}

/// The plain-Rust widening: exact values, then round to FP16.
pub fn widen_rows_scalar(q: QuantType, w: &PackedMatrix, rows: Range<usize>, out: &mut [u16]) {
    let data = w.raw();
    let mut bits = [0u16; GROUP_COLS];
    for (i, r) in rows.enumerate() {
        for g in 0..w.cols / GROUP_COLS {
            let (d, payload) = quant_blocks::group(q, data, r, g, w.cols);
            for (b, v) in bits.iter_mut().zip(q.values(payload)) {
                *b = f16::from_f32(d * f32::from(v)).to_bits();
            }
            scatter_group(out, i, g, w.cols, &bits);
        }
    }
}

/// Puts one row's 32 values of group `g` into the 16-bit row-block layout
/// (four 8-column groups).
fn scatter_group(out: &mut [u16], row: usize, g: usize, cols: usize, bits: &[u16; GROUP_COLS]) {
    for (part, chunk) in bits.chunks_exact(row_blocks::GROUP_COLS).enumerate() {
        let at = row_blocks::index(row, g * GROUP_COLS + part * row_blocks::GROUP_COLS, cols);
        out[at..at + row_blocks::GROUP_COLS].copy_from_slice(chunk);
    }
}

mod avx2 {
    use super::{GROUP_COLS, PackedMatrix, QuantType, Range, quant_blocks, row_blocks};
    use std::arch::x86_64::*;

    /// See [`super::widen_rows`].
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; `out` must hold the widened rows.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen_rows(q: QuantType, w: &PackedMatrix, rows: Range<usize>, out: &mut [u16]) {
        let data = w.raw();
        let groups = w.cols / GROUP_COLS;
        for (i, r) in rows.enumerate() {
            for g in 0..groups {
                let (d, payload) = quant_blocks::group(q, data, r, g, w.cols);
                // SAFETY: the payload holds the type's bytes (sliced by
                // `group`), and the CPU has AVX2 (this function's feature).
                let values = unsafe { load_values(q, payload) };
                let scale = _mm256_set1_ps(d);
                for part in 0..GROUP_COLS / row_blocks::GROUP_COLS {
                    // 8 bytes -> 8 i32 -> 8 f32, scaled, rounded to f16.
                    let bytes = match part {
                        0 => _mm256_castsi256_si128(values),
                        1 => _mm_srli_si128::<8>(_mm256_castsi256_si128(values)),
                        2 => _mm256_extracti128_si256::<1>(values),
                        _ => _mm_srli_si128::<8>(_mm256_extracti128_si256::<1>(values)),
                    };
                    let f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
                    let half = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
                    let col = g * GROUP_COLS + part * row_blocks::GROUP_COLS;
                    let at = row_blocks::index(i, col, w.cols);
                    assert!(at + row_blocks::GROUP_COLS <= out.len());
                    // SAFETY: 8 values from `at` are inside `out` (asserted).
                    unsafe { _mm_storeu_si128(out.as_mut_ptr().add(at).cast(), half) };
                }
            }
        }
    }

    /// A payload's 32 values as signed bytes.
    ///
    /// # Safety
    /// `payload` must hold the type's payload bytes; AVX2 is required.
    #[target_feature(enable = "avx2")]
    unsafe fn load_values(q: QuantType, payload: &[u8]) -> __m256i {
        match q {
            QuantType::Q8_0 => {
                assert!(payload.len() >= 32);
                // SAFETY: 32 bytes are there (asserted).
                unsafe { _mm256_loadu_si256(payload.as_ptr().cast()) }
            }
            QuantType::Q5_0 => {
                assert!(payload.len() >= 20);
                // SAFETY: 4 bytes of high bits, then 16 of nibbles (asserted).
                let (high, nibbles) = unsafe {
                    (
                        payload.as_ptr().cast::<i32>().read_unaligned(),
                        _mm_loadu_si128(payload.as_ptr().add(4).cast()),
                    )
                };
                let low = _mm256_set_m128i(_mm_srli_epi16::<4>(nibbles), nibbles);
                let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
                // Lane i shifted right by i puts value j's bit at bit 0 of
                // byte j (the layout of `QuantType::Q5_0`), then to bit 4.
                let shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let bits = _mm256_srlv_epi32(_mm256_set1_epi32(high), shifts);
                let bits = _mm256_and_si256(bits, _mm256_set1_epi8(1));
                let high = _mm256_slli_epi16::<4>(bits);
                _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(16))
            }
            QuantType::Q4_0 => {
                assert!(payload.len() >= 16);
                // SAFETY: 16 bytes of nibbles are there (asserted).
                let nibbles = unsafe { _mm_loadu_si128(payload.as_ptr().cast()) };
                let low = _mm256_set_m128i(_mm_srli_epi16::<4>(nibbles), nibbles);
                let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
                _mm256_sub_epi8(low, _mm256_set1_epi8(8))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::packed::WeightFormat;
    use crate::model::dtype::{DType, TensorView};

    #[test]
    fn the_vector_path_equals_the_scalar_one() {
        for (q, dtype, format) in [
            (QuantType::Q8_0, DType::Q8_0, WeightFormat::Q8_0),
            (QuantType::Q5_0, DType::Q5_0, WeightFormat::Q5_0),
            (QuantType::Q4_0, DType::Q4_0, WeightFormat::Q4_0),
        ] {
            let (rows, cols) = (9, 96);
            let mut file = Vec::new();
            for i in 0..rows * cols / GROUP_COLS {
                let d = f16::from_f32(0.02 + i as f32 * 0.01);
                file.extend_from_slice(&d.to_bits().to_le_bytes());
                file.extend((0..q.payload_bytes()).map(|j| ((i * 53 + j * 29) % 256) as u8));
            }
            let shape = [rows, cols];
            let w = PackedMatrix::convert(
                &TensorView {
                    dtype,
                    shape: &shape,
                    bytes: &file,
                },
                format,
            );
            let len = row_blocks::padded_len(8, cols);
            let (mut fast, mut slow) = (vec![0u16; len], vec![0u16; len]);
            widen_rows(&w, 1..9, &mut fast);
            widen_rows_scalar(q, &w, 1..9, &mut slow);
            assert_eq!(fast, slow, "{q:?}");
            assert!(fast.iter().any(|&b| b != 0));
        }
    }
}
