//! Q8_0 weights in row blocks: GGUF's Q8_0 bytes regrouped so that the
//! integer GEMV reads 4 rows as one sequential stream, like the 16-bit
//! row blocks of `row_blocks`, with not one byte more than the file.
//!
//! A GGUF Q8_0 row is a run of 34-byte blocks: an f16 scale `d`, then 32
//! signed bytes `q`, value = d * q. Here rows come in blocks of 4, and
//! inside a row block each 32-column group holds the 4 rows' scales side by
//! side (8 bytes), then the 4 rows' 32 quants one after the other (128
//! bytes): 136 bytes, exactly the 4 file blocks it came from. So one group
//! step of the kernel loads its 4 scales at once and then 4 × 32 quants.
//! Rows past the last one (up to a multiple of 4) are zero: scale 0.

use half::f16;

/// Rows per block (as for the 16-bit layout).
pub const BLOCK_ROWS: usize = 4;
/// Columns per Q8_0 block.
pub const GROUP_COLS: usize = 32;
/// Bytes of one file block: f16 scale and 32 quants.
pub const FILE_BLOCK_BYTES: usize = 2 + GROUP_COLS;
/// Bytes of one group of a row block: 4 scales, then 4 × 32 quants.
pub const GROUP_BYTES: usize = BLOCK_ROWS * FILE_BLOCK_BYTES;
/// Offset of the quants inside a group.
pub const QUANTS_AT: usize = BLOCK_ROWS * 2;

/// Whether a row of `cols` can be stored: Q8_0 rows are whole blocks.
pub fn fits(cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(GROUP_COLS)
}

/// Bytes of one row block of `cols` columns.
pub fn block_bytes(cols: usize) -> usize {
    cols / GROUP_COLS * GROUP_BYTES
}

/// Bytes a `rows x cols` matrix takes, padding rows included.
pub fn matrix_bytes(rows: usize, cols: usize) -> usize {
    rows.next_multiple_of(BLOCK_ROWS) * cols / GROUP_COLS * FILE_BLOCK_BYTES
}

/// Where row `r`'s scale and quants of group `g` sit.
fn scale_at(r: usize, g: usize, cols: usize) -> usize {
    r / BLOCK_ROWS * block_bytes(cols) + g * GROUP_BYTES + r % BLOCK_ROWS * 2
}

fn quants_at(r: usize, g: usize, cols: usize) -> usize {
    r / BLOCK_ROWS * block_bytes(cols) + g * GROUP_BYTES + QUANTS_AT + r % BLOCK_ROWS * GROUP_COLS
}

/// Copies one GGUF Q8_0 row (`cols / 32` file blocks) into row `r` of a
/// matrix in the layout. Bit for bit: nothing is requantized.
pub fn scatter_row(data: &mut [u8], r: usize, cols: usize, file_row: &[u8]) {
    for (g, block) in file_row.chunks_exact(FILE_BLOCK_BYTES).enumerate() {
        let s = scale_at(r, g, cols);
        data[s..s + 2].copy_from_slice(&block[..2]);
        let q = quants_at(r, g, cols);
        data[q..q + GROUP_COLS].copy_from_slice(&block[2..]);
    }
}

/// Row `r` of a matrix in the layout, dequantized exactly as the file's
/// blocks dequantize: `f16(d) as f32 * q`.
pub fn dequant_row(data: &[u8], r: usize, cols: usize, out: &mut [f32]) {
    for (g, part) in out[..cols].chunks_exact_mut(GROUP_COLS).enumerate() {
        let s = scale_at(r, g, cols);
        let d = f16::from_bits(u16::from_le_bytes([data[s], data[s + 1]])).to_f32();
        let q = quants_at(r, g, cols);
        for (o, &b) in part.iter_mut().zip(&data[q..q + GROUP_COLS]) {
            *o = d * f32::from(b as i8);
        }
    }
}

/// Row `r`'s scale and quants of group `g`, for integer arithmetic.
pub fn group(data: &[u8], r: usize, g: usize, cols: usize) -> (f32, &[u8]) {
    let s = scale_at(r, g, cols);
    let d = f16::from_bits(u16::from_le_bytes([data[s], data[s + 1]])).to_f32();
    let q = quants_at(r, g, cols);
    (d, &data[q..q + GROUP_COLS])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant;
    use crate::model::dtype::{DType, TensorView};

    /// GGUF Q8_0 bytes for a `rows x cols` matrix of made-up blocks.
    fn file_bytes(rows: usize, cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..rows * cols / GROUP_COLS {
            let d = f16::from_f32(0.01 + i as f32 * 0.003);
            out.extend_from_slice(&d.to_bits().to_le_bytes());
            out.extend((0..GROUP_COLS).map(|j| ((i * 37 + j * 11) % 255) as u8));
        }
        out
    }

    #[test]
    fn repacking_keeps_the_bytes_and_dequantizes_bit_for_bit() {
        for (rows, cols) in [(4, 64), (7, 96), (1, 32), (9, 640)] {
            let file = file_bytes(rows, cols);
            let row_bytes = cols / GROUP_COLS * FILE_BLOCK_BYTES;
            let mut packed = vec![0u8; matrix_bytes(rows, cols)];
            assert!(packed.len() <= file.len() + 3 * row_bytes, "padding only");
            for r in 0..rows {
                scatter_row(
                    &mut packed,
                    r,
                    cols,
                    &file[r * row_bytes..(r + 1) * row_bytes],
                );
            }
            let shape = [rows, cols];
            let t = TensorView {
                dtype: DType::Q8_0,
                shape: &shape,
                bytes: &file,
            };
            let (mut want, mut got) = (vec![0.0f32; cols], vec![0.0f32; cols]);
            for r in 0..rows {
                dequant::row_into(&t, r, &mut want);
                dequant_row(&packed, r, cols, &mut got);
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rows}x{cols} row {r}");
            }
            // Padding rows are zero.
            if rows % BLOCK_ROWS != 0 {
                dequant_row(&packed, rows, cols, &mut got);
                assert!(got.iter().all(|&v| v == 0.0));
            }
        }
    }
}
