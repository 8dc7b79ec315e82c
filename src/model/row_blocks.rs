//! The row-block layout the matrix kernels read: rows in blocks of 4, and
//! inside a block, columns in groups of 8 with the 4 rows' 8 values side
//! by side. For 16-bit values one group is one 64-byte cache line.
//!
//! A kernel computing 4 rows at once then reads one sequential stream
//! instead of 4 interleaved ones. With plain rows of 1-4 KiB the hardware
//! prefetcher follows 4 short streams poorly: row-major decode needed a
//! software prefetch to get near the read bandwidth, and the row-block
//! stream needs none.
//!
//! Element (r, c) of a `rows x cols` matrix sits at
//! `(r / 4 * padded_cols + c / 8 * 8) * 4 + r % 4 * 8 + c % 8`, where
//! `padded_cols` is `cols` rounded up to 8. Rows past the last one (up to a
//! multiple of 4) and columns past the last one (up to a multiple of 8) are
//! zero padding, so a kernel never needs a partial block.

/// Rows per block.
pub const BLOCK_ROWS: usize = 4;
/// Columns per group: one 8-lane vector per row.
pub const GROUP_COLS: usize = 8;

/// Columns rounded up to whole groups.
pub fn padded_cols(cols: usize) -> usize {
    cols.next_multiple_of(GROUP_COLS)
}

/// Values a `rows x cols` matrix takes in the layout, padding included.
pub fn padded_len(rows: usize, cols: usize) -> usize {
    rows.next_multiple_of(BLOCK_ROWS) * padded_cols(cols)
}

/// Index of element (r, c) in the layout.
pub fn index(r: usize, c: usize, cols: usize) -> usize {
    (r / BLOCK_ROWS * padded_cols(cols) + c / GROUP_COLS * GROUP_COLS) * BLOCK_ROWS
        + r % BLOCK_ROWS * GROUP_COLS
        + c % GROUP_COLS
}

/// Writes row `r` (`cols` values) into a matrix in the layout.
pub fn scatter_row<T: Copy>(data: &mut [T], r: usize, cols: usize, row: &[T]) {
    for (g, part) in row.chunks(GROUP_COLS).enumerate() {
        let at = index(r, g * GROUP_COLS, cols);
        data[at..at + part.len()].copy_from_slice(part);
    }
}

/// Reads row `r` (`cols` values) of a matrix in the layout into `row`.
pub fn gather_row<T: Copy>(data: &[T], r: usize, cols: usize, row: &mut [T]) {
    for (g, part) in row.chunks_mut(GROUP_COLS).enumerate() {
        let at = index(r, g * GROUP_COLS, cols);
        part.copy_from_slice(&data[at..at + part.len()]);
    }
}

/// A row-major matrix in the layout (padding zeroed).
pub fn from_row_major<T: Copy + Default>(values: &[T], rows: usize, cols: usize) -> Vec<T> {
    assert_eq!(values.len(), rows * cols, "row-major matrix size");
    let mut out = vec![T::default(); padded_len(rows, cols)];
    for (r, row) in values.chunks_exact(cols.max(1)).enumerate().take(rows) {
        scatter_row(&mut out, r, cols, row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_group_is_four_rows_of_eight() {
        // Row 1, columns 0..8 follow row 0's first 8 values.
        assert_eq!(index(0, 7, 16), 7);
        assert_eq!(index(1, 0, 16), 8);
        assert_eq!(index(3, 7, 16), 31);
        // The second group of the block, then the next block.
        assert_eq!(index(0, 8, 16), 32);
        assert_eq!(index(4, 0, 16), 64);
    }

    #[test]
    fn rows_round_trip_with_padding() {
        for (rows, cols) in [(1, 1), (3, 5), (4, 8), (5, 17), (9, 24)] {
            let values: Vec<u32> = (1..=(rows * cols) as u32).collect();
            let blocked = from_row_major(&values, rows, cols);
            assert_eq!(blocked.len(), padded_len(rows, cols));
            // Every value appears once; the rest is zero padding.
            let nonzero = blocked.iter().filter(|&&v| v != 0).count();
            assert_eq!(nonzero, rows * cols);
            let mut row = vec![0; cols];
            for r in 0..rows {
                gather_row(&blocked, r, cols, &mut row);
                assert_eq!(
                    row,
                    values[r * cols..(r + 1) * cols],
                    "{rows}x{cols} row {r}"
                );
            }
        }
    }

    #[test]
    fn padding_rounds_rows_to_4_and_columns_to_8() {
        assert_eq!(padded_len(8, 640), 8 * 640);
        assert_eq!(padded_len(6, 644), 8 * 648);
    }
}
