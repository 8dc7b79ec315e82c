//! Q4_K, Q5_K and Q6_K in 16-row blocks at the file's own bits, for the integer
//! GEMM whose vector lanes are rows (`jit::emit::gemm_kquant`).
//!
//! A K-quant row is a run of 256-value super-blocks. Here a block of 16
//! rows holds, per super-block, the 16 rows' super-block scales side by
//! side, then per 32 columns (a "group", the input's quantization unit)
//! the 16 rows' sub-block scales, then their quants interleaved 4 columns
//! at a time, as `QuantType::Q8_0x16` interleaves bytes: a 64-byte run is
//! one chunk of 4 columns of 16 rows, which one `vpdpbusd` multiplies by a
//! token's 4 bytes broadcast.
//!
//! **Q4Kx16**, 2,368 bytes per super-block (16 x 148; the file's 144 and
//! 4 bytes for its 6-bit scales and mins unpacked to one byte each,
//! 2.8% more): the 16 rows' `d` (f16), their `dmin` (f16); then per pair
//! of groups (2p, 2p + 1), 576 bytes: the 16 rows' scales of group 2p,
//! of group 2p + 1, their mins of 2p, of 2p + 1 (a byte each), then 8
//! runs of 64 bytes, run n holding row r's file bytes `32p + 4n ..+4` at
//! `4r`: the low nibbles are group 2p's columns 4n..4n+3, the high
//! nibbles group 2p + 1's (the file pairs its sub-blocks the same way).
//! A value is `d·sc·q − dmin·m`.
//!
//! **Q6Kx16**, 3,360 bytes per super-block (16 x 210, the file's): the 16
//! rows' `d` (f16); then per group g, 416 bytes: the 16 rows' scales of
//! values 0..15 of the group, of values 16..31 (signed bytes), 4 nibble
//! runs (run n: row r's 4 bytes at `4r`, low nibble the low 4 bits of
//! column 4n + j, high nibble those of column 16 + 4n + j) and 2 runs of
//! high bits (run h: byte j of row r holds at bits 2i..2i+1 the top 2 bits
//! of column 16h + 4i + j). A value is `d·sc·(q − 32)`.
//!
//! **Q5Kx16**, 2,880 bytes per super-block (16 x 180; the file's 176 and
//! Q4Kx16's 4 bytes of unpacked scales and mins, 2.3% more): Q4Kx16's
//! header and pairs, each pair (704 bytes) with 2 runs of fifth bits
//! between its mins and its 8 nibble runs. In run h byte j of row r holds
//! at bit i the fifth bit of group 2p's column 16h + 4i + j, at bit 4 + i
//! group 2p + 1's: chunk n = 4h + i's bits after a shift right by i sit at
//! bit 0 (group 2p) and bit 4 (group 2p + 1) of each byte, which the
//! kernels OR onto the nibbles. A value is `d·sc·q − dmin·m`, q in 0..31.
//!
//! Repacking is exact: each value dequantizes to the very f32 the file's
//! super-block gives (`dequant`'s formulas in the same order).

use super::dequant::k_scale_min;
use super::quant_blocks::{CHUNK_BYTES, GROUP_COLS, MAX_BLOCK_ROWS, QuantType};
use half::f16;

/// Columns per super-block.
pub const SUPER_COLS: usize = 256;
/// Groups of 32 columns per super-block.
pub const SUPER_GROUPS: usize = SUPER_COLS / GROUP_COLS;
const ROWS: usize = MAX_BLOCK_ROWS;
/// Bytes of one 4-column chunk of 16 rows.
pub const RUN_BYTES: usize = ROWS * CHUNK_BYTES;

/// Q4Kx16: where the 16 rows' `dmin` start in a super-block.
pub const Q4K_DMIN_AT: usize = ROWS * 2;
/// Q4Kx16: where the first pair of groups starts in a super-block.
pub const Q4K_PAIRS_AT: usize = ROWS * 4;
/// Q4Kx16: bytes of a pair of groups (scales, mins, 8 nibble runs).
pub const Q4K_PAIR_BYTES: usize = 4 * ROWS + 8 * RUN_BYTES;
/// Q4Kx16: where a pair's mins and nibble runs start, from the pair's
/// start.
pub const Q4K_MINS_AT: usize = 2 * ROWS;
pub const Q4K_RUNS_AT: usize = 4 * ROWS;

/// Q5Kx16: the header (`d`, then `dmin` at [`Q4K_DMIN_AT`]) and a
/// pair's scales and mins sit as Q4Kx16's; the pair's fifth-bit runs and
/// nibble runs start here from the pair's start.
pub const Q5K_HIGH_AT: usize = 4 * ROWS;
pub const Q5K_RUNS_AT: usize = Q5K_HIGH_AT + 2 * RUN_BYTES;
/// Q5Kx16: bytes of a pair of groups (scales, mins, 2 fifth-bit runs, 8
/// nibble runs).
pub const Q5K_PAIR_BYTES: usize = Q5K_RUNS_AT + 8 * RUN_BYTES;

/// Q6Kx16: where the first group starts in a super-block.
pub const Q6K_GROUPS_AT: usize = ROWS * 2;
/// Q6Kx16: bytes of a group (scales, 4 nibble runs, 2 high-bit runs).
pub const Q6K_GROUP_BYTES: usize = 2 * ROWS + 6 * RUN_BYTES;
/// Q6Kx16: where a group's nibble runs and high-bit runs start, from the
/// group's start.
pub const Q6K_NIBBLES_AT: usize = 2 * ROWS;
pub const Q6K_HIGH_AT: usize = Q6K_NIBBLES_AT + 4 * RUN_BYTES;

/// Bytes of one file super-block of `q`'s type (per row).
pub fn row_super_bytes(q: QuantType) -> usize {
    match q {
        QuantType::Q4Kx16 => 144,
        QuantType::Q5Kx16 => 176,
        QuantType::Q6Kx16 => 210,
        other => panic!("{other:?} is not a K-quant layout"),
    }
}

/// Bytes per row and super-block in the layout (16 of them per block's
/// super-block).
pub fn layout_row_super_bytes(q: QuantType) -> usize {
    match q {
        QuantType::Q4Kx16 => 148,
        QuantType::Q5Kx16 => 180,
        _ => row_super_bytes(q),
    }
}

/// Bytes of a 16-row block's super-block.
pub fn super_block_bytes(q: QuantType) -> usize {
    ROWS * layout_row_super_bytes(q)
}

/// Where row `r`'s super-block `s` starts, and the row's lane in it.
fn super_at(q: QuantType, r: usize, s: usize, cols: usize) -> (usize, usize) {
    let block = r / ROWS * (cols / SUPER_COLS) * super_block_bytes(q);
    (block + s * super_block_bytes(q), r % ROWS)
}

/// One super-block of a Q6_K file row: its 256 quants (0..63), 16 scales
/// and `d`, as `dequant` reads them.
fn q6_k_parts(block: &[u8]) -> ([u8; SUPER_COLS], [i8; 16], [u8; 2]) {
    let mut q = [0u8; SUPER_COLS];
    for half in 0..2 {
        let ql = &block[half * 64..half * 64 + 64];
        let qh = &block[128 + half * 32..128 + half * 32 + 32];
        let out = &mut q[half * 128..half * 128 + 128];
        for l in 0..32 {
            out[l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
            out[l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
            out[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            out[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    let scales = std::array::from_fn(|j| block[192 + j] as i8);
    (q, scales, [block[208], block[209]])
}

/// The file's Q6_K super-block from its parts (the inverse of
/// [`q6_k_parts`]).
fn q6_k_block(q: &[u8; SUPER_COLS], scales: &[i8; 16], d: [u8; 2]) -> Vec<u8> {
    let mut block = vec![0u8; 210];
    for half in 0..2 {
        let v = &q[half * 128..half * 128 + 128];
        for l in 0..32 {
            block[half * 64 + l] = (v[l] & 0x0f) | (v[l + 64] & 0x0f) << 4;
            block[half * 64 + l + 32] = (v[l + 32] & 0x0f) | (v[l + 96] & 0x0f) << 4;
            block[128 + half * 32 + l] =
                v[l] >> 4 | (v[l + 32] >> 4) << 2 | (v[l + 64] >> 4) << 4 | (v[l + 96] >> 4) << 6;
        }
    }
    for (b, &s) in block[192..208].iter_mut().zip(scales) {
        *b = s as u8;
    }
    block[208..210].copy_from_slice(&d);
    block
}

/// Q4_K's 12 bytes of 6-bit scales and mins from the 8 of each (the
/// inverse of `dequant::k_scale_min`).
fn q4_k_packed_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        s[j + 4] = m[j] | (m[j + 4] >> 4) << 6;
        s[j + 8] = (sc[j + 4] & 0x0f) | (m[j + 4] & 0x0f) << 4;
    }
    s
}

/// Row `lane`'s part of pair `p` of a Q4_K or Q5_K super-block: its two
/// groups' scales and mins (from the file's 12 packed bytes) and its 8
/// nibble runs, the first at `runs_at` in the pair.
fn scatter_pair(
    pair: &mut [u8],
    packed_scales: &[u8],
    p: usize,
    lane: usize,
    nibbles: &[u8],
    runs_at: usize,
) {
    for half in 0..2 {
        let (sc, m) = k_scale_min(packed_scales, 2 * p + half);
        pair[half * ROWS + lane] = sc as u8;
        pair[Q4K_MINS_AT + half * ROWS + lane] = m as u8;
    }
    for (n, four) in nibbles.chunks_exact(CHUNK_BYTES).enumerate() {
        let run = runs_at + n * RUN_BYTES + CHUNK_BYTES * lane;
        pair[run..run + CHUNK_BYTES].copy_from_slice(four);
    }
}

/// Copies one GGUF row of `q`'s file type (whole super-blocks) into row
/// `r` of a matrix in the layout. Nothing is requantized.
pub fn scatter_row(q: QuantType, data: &mut [u8], r: usize, cols: usize, file_row: &[u8]) {
    for (s, block) in file_row.chunks_exact(row_super_bytes(q)).enumerate() {
        let (at, lane) = super_at(q, r, s, cols);
        let sb = &mut data[at..at + super_block_bytes(q)];
        match q {
            QuantType::Q4Kx16 => {
                sb[2 * lane..2 * lane + 2].copy_from_slice(&block[0..2]);
                sb[Q4K_DMIN_AT + 2 * lane..][..2].copy_from_slice(&block[2..4]);
                for p in 0..SUPER_GROUPS / 2 {
                    let pair = &mut sb[Q4K_PAIRS_AT + p * Q4K_PAIR_BYTES..][..Q4K_PAIR_BYTES];
                    let nibbles = &block[16 + 32 * p..16 + 32 * p + 32];
                    scatter_pair(pair, &block[4..16], p, lane, nibbles, Q4K_RUNS_AT);
                }
            }
            QuantType::Q5Kx16 => {
                sb[2 * lane..2 * lane + 2].copy_from_slice(&block[0..2]);
                sb[Q4K_DMIN_AT + 2 * lane..][..2].copy_from_slice(&block[2..4]);
                let qh = &block[16..48];
                for p in 0..SUPER_GROUPS / 2 {
                    let pair = &mut sb[Q4K_PAIRS_AT + p * Q5K_PAIR_BYTES..][..Q5K_PAIR_BYTES];
                    let nibbles = &block[48 + 32 * p..48 + 32 * p + 32];
                    scatter_pair(pair, &block[4..16], p, lane, nibbles, Q5K_RUNS_AT);
                    for h in 0..2 {
                        for j in 0..CHUNK_BYTES {
                            let bits = (0..4).fold(0u8, |b, i| {
                                let col = 16 * h + 4 * i + j;
                                let low = (qh[col] >> (2 * p)) & 1;
                                let high = (qh[col] >> (2 * p + 1)) & 1;
                                b | low << i | high << (4 + i)
                            });
                            pair[Q5K_HIGH_AT + h * RUN_BYTES + CHUNK_BYTES * lane + j] = bits;
                        }
                    }
                }
            }
            QuantType::Q6Kx16 => {
                let (quants, scales, d) = q6_k_parts(block);
                sb[2 * lane..2 * lane + 2].copy_from_slice(&d);
                for g in 0..SUPER_GROUPS {
                    let group = &mut sb[Q6K_GROUPS_AT + g * Q6K_GROUP_BYTES..][..Q6K_GROUP_BYTES];
                    let v = &quants[g * GROUP_COLS..(g + 1) * GROUP_COLS];
                    group[lane] = scales[2 * g] as u8;
                    group[ROWS + lane] = scales[2 * g + 1] as u8;
                    for n in 0..4 {
                        for j in 0..CHUNK_BYTES {
                            let low = v[4 * n + j] & 0x0f;
                            let high = v[16 + 4 * n + j] & 0x0f;
                            group[Q6K_NIBBLES_AT + n * RUN_BYTES + CHUNK_BYTES * lane + j] =
                                low | high << 4;
                        }
                    }
                    for h in 0..2 {
                        for j in 0..CHUNK_BYTES {
                            let bits = (0..4)
                                .fold(0u8, |b, i| b | (v[16 * h + 4 * i + j] >> 4) << (2 * i));
                            group[Q6K_HIGH_AT + h * RUN_BYTES + CHUNK_BYTES * lane + j] = bits;
                        }
                    }
                }
            }
            other => panic!("{other:?} is not a K-quant layout"),
        }
    }
}

/// Row `r`'s group `g` of a matrix in the layout, in the terms the kernels
/// compute with: the 32 quants (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63),
/// `d`, the sub-block scales (Q4_K and Q5_K: one, twice; Q6_K: values
/// 0..15 and 16..31), and Q4_K's and Q5_K's `dmin` and min.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KGroup {
    pub quants: [u8; GROUP_COLS],
    pub d: f32,
    pub scales: [i32; 2],
    pub dmin: f32,
    pub min: i32,
}

pub fn group(q: QuantType, data: &[u8], r: usize, g: usize, cols: usize) -> KGroup {
    let (s, j) = (g / SUPER_GROUPS, g % SUPER_GROUPS);
    let (at, lane) = super_at(q, r, s, cols);
    let sb = &data[at..at + super_block_bytes(q)];
    let f16_at = |i: usize| f16::from_le_bytes([sb[i], sb[i + 1]]).to_f32();
    // Q4_K's and Q5_K's group: one scale for its 32 values, and a min.
    let with_mins = |quants, pair: &[u8], half: usize| {
        let sc = i32::from(pair[half * ROWS + lane]);
        KGroup {
            quants,
            d: f16_at(2 * lane),
            scales: [sc, sc],
            dmin: f16_at(Q4K_DMIN_AT + 2 * lane),
            min: i32::from(pair[Q4K_MINS_AT + half * ROWS + lane]),
        }
    };
    let mut quants = [0u8; GROUP_COLS];
    match q {
        QuantType::Q4Kx16 => {
            let pair = &sb[Q4K_PAIRS_AT + j / 2 * Q4K_PAIR_BYTES..][..Q4K_PAIR_BYTES];
            let half = j % 2;
            for (c, four) in quants.chunks_exact_mut(CHUNK_BYTES).enumerate() {
                let run = Q4K_RUNS_AT + c * RUN_BYTES + CHUNK_BYTES * lane;
                for (v, &b) in four.iter_mut().zip(&pair[run..run + CHUNK_BYTES]) {
                    *v = if half == 0 { b & 0x0f } else { b >> 4 };
                }
            }
            with_mins(quants, pair, half)
        }
        QuantType::Q5Kx16 => {
            let pair = &sb[Q4K_PAIRS_AT + j / 2 * Q5K_PAIR_BYTES..][..Q5K_PAIR_BYTES];
            let half = j % 2;
            for (col, v) in quants.iter_mut().enumerate() {
                let (n, jj) = (col / CHUNK_BYTES, col % CHUNK_BYTES);
                let nib = pair[Q5K_RUNS_AT + n * RUN_BYTES + CHUNK_BYTES * lane + jj];
                let low = if half == 0 { nib & 0x0f } else { nib >> 4 };
                let high = pair[Q5K_HIGH_AT + n / 4 * RUN_BYTES + CHUNK_BYTES * lane + jj];
                *v = low | ((high >> (n % 4 + 4 * half)) & 1) << 4;
            }
            with_mins(quants, pair, half)
        }
        QuantType::Q6Kx16 => {
            let group = &sb[Q6K_GROUPS_AT + j * Q6K_GROUP_BYTES..][..Q6K_GROUP_BYTES];
            for (col, v) in quants.iter_mut().enumerate() {
                let (half, in_half) = (col / 16, col % 16);
                let (n, jj) = (in_half / CHUNK_BYTES, in_half % CHUNK_BYTES);
                let nib = group[Q6K_NIBBLES_AT + n * RUN_BYTES + CHUNK_BYTES * lane + jj];
                let low = if half == 0 { nib & 0x0f } else { nib >> 4 };
                let high = group[Q6K_HIGH_AT + half * RUN_BYTES + CHUNK_BYTES * lane + jj];
                *v = low | ((high >> (2 * n)) & 3) << 4;
            }
            KGroup {
                quants,
                d: f16_at(2 * lane),
                scales: [
                    i32::from(group[lane] as i8),
                    i32::from(group[ROWS + lane] as i8),
                ],
                dmin: 0.0,
                min: 0,
            }
        }
        other => panic!("{other:?} is not a K-quant layout"),
    }
}

/// Row `r` dequantized exactly as the file's super-blocks dequantize.
pub fn dequant_row(q: QuantType, data: &[u8], r: usize, cols: usize, out: &mut [f32]) {
    for (g, part) in out[..cols].chunks_exact_mut(GROUP_COLS).enumerate() {
        let k = group(q, data, r, g, cols);
        for (i, (o, &v)) in part.iter_mut().zip(&k.quants).enumerate() {
            let sc = k.scales[i / 16] as f32;
            *o = match q {
                QuantType::Q4Kx16 | QuantType::Q5Kx16 => {
                    k.d * sc * f32::from(v) - k.dmin * k.min as f32
                }
                _ => k.d * sc * (i32::from(v) - 32) as f32,
            };
        }
    }
}

/// Row `r` of a matrix in the layout as the file stores it.
pub fn file_row(q: QuantType, data: &[u8], r: usize, cols: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(cols / SUPER_COLS * row_super_bytes(q));
    for s in 0..cols / SUPER_COLS {
        let groups: Vec<KGroup> = (0..SUPER_GROUPS)
            .map(|j| group(q, data, r, s * SUPER_GROUPS + j, cols))
            .collect();
        let (at, lane) = super_at(q, r, s, cols);
        let d = [data[at + 2 * lane], data[at + 2 * lane + 1]];
        match q {
            QuantType::Q4Kx16 => {
                out.extend_from_slice(&d);
                out.extend_from_slice(&data[at + Q4K_DMIN_AT + 2 * lane..][..2]);
                let sc = std::array::from_fn(|j| groups[j].scales[0] as u8);
                let m = std::array::from_fn(|j| groups[j].min as u8);
                out.extend_from_slice(&q4_k_packed_scales(&sc, &m));
                for p in 0..SUPER_GROUPS / 2 {
                    let (low, high) = (&groups[2 * p].quants, &groups[2 * p + 1].quants);
                    out.extend(low.iter().zip(high).map(|(&l, &h)| l | h << 4));
                }
            }
            QuantType::Q5Kx16 => {
                out.extend_from_slice(&d);
                out.extend_from_slice(&data[at + Q4K_DMIN_AT + 2 * lane..][..2]);
                let sc = std::array::from_fn(|j| groups[j].scales[0] as u8);
                let m = std::array::from_fn(|j| groups[j].min as u8);
                out.extend_from_slice(&q4_k_packed_scales(&sc, &m));
                out.extend((0..GROUP_COLS).map(|l| {
                    (0..SUPER_GROUPS).fold(0u8, |b, j| b | (groups[j].quants[l] >> 4) << j)
                }));
                for p in 0..SUPER_GROUPS / 2 {
                    let (low, high) = (&groups[2 * p].quants, &groups[2 * p + 1].quants);
                    out.extend(
                        low.iter()
                            .zip(high)
                            .map(|(&l, &h)| l & 0x0f | (h & 0x0f) << 4),
                    );
                }
            }
            _ => {
                let quants = std::array::from_fn(|i| groups[i / GROUP_COLS].quants[i % GROUP_COLS]);
                let scales = std::array::from_fn(|j| groups[j / 2].scales[j % 2] as i8);
                out.extend(q6_k_block(&quants, &scales, d));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant;
    use crate::model::dtype::{DType, TensorView};

    /// Random super-blocks with scales of weights' size: every quant,
    /// scale and min pattern occurs.
    fn random_rows(q: QuantType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let bytes = row_super_bytes(q);
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut out = vec![0u8; rows * cols / SUPER_COLS * bytes];
        for block in out.chunks_exact_mut(bytes) {
            block.iter_mut().for_each(|b| *b = next() as u8);
            let scale = |r: u64| f16::from_f32((r % 1000) as f32 * 1e-5 + 1e-6).to_le_bytes();
            let at = if q.has_k_mins() { 0 } else { 208 };
            block[at..at + 2].copy_from_slice(&scale(next()));
            if q.has_k_mins() {
                block[2..4].copy_from_slice(&scale(next()));
            }
        }
        out
    }

    #[test]
    fn repacking_keeps_the_file_bits_and_dequantizes_bit_for_bit() {
        for (q, dtype) in [
            (QuantType::Q4Kx16, DType::Q4K),
            (QuantType::Q5Kx16, DType::Q5K),
            (QuantType::Q6Kx16, DType::Q6K),
        ] {
            for (rows, cols) in [(16, 256), (5, 512), (33, 768)] {
                let file = random_rows(q, rows, cols, rows as u64 * 31 + cols as u64);
                let row_bytes = cols / SUPER_COLS * row_super_bytes(q);
                let mut packed = vec![0u8; q.matrix_bytes(rows, cols)];
                assert_eq!(
                    packed.len(),
                    rows.next_multiple_of(16) * cols / SUPER_COLS * layout_row_super_bytes(q)
                );
                for r in 0..rows {
                    scatter_row(q, &mut packed, r, cols, &file[r * row_bytes..][..row_bytes]);
                }
                let shape = [rows, cols];
                let t = TensorView {
                    dtype,
                    shape: &shape,
                    bytes: &file,
                };
                let (mut want, mut got) = (vec![0.0f32; cols], vec![0.0f32; cols]);
                for r in 0..rows {
                    dequant::row_into(&t, r, &mut want);
                    dequant_row(q, &packed, r, cols, &mut got);
                    for (c, (a, b)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{q:?} row {r} column {c}");
                    }
                    let src = &file[r * row_bytes..][..row_bytes];
                    assert!(file_row(q, &packed, r, cols) == src, "{q:?} row {r} back");
                }
            }
        }
    }

    /// The bytes as the kernels read them: Q4Kx16's run n of a pair is
    /// chunk n of both groups, Q6Kx16's high-bit run h holds chunk 4h + i
    /// at bits 2i..2i+1, Q5Kx16's fifth-bit run h chunk 4h + i at bit i
    /// (the pair's first group) and 4 + i (its second).
    #[test]
    fn chunks_sit_where_the_kernels_load_them() {
        let cols = 256;
        for q in [QuantType::Q4Kx16, QuantType::Q5Kx16, QuantType::Q6Kx16] {
            let file = random_rows(q, 16, cols, 99);
            let row_bytes = row_super_bytes(q);
            let mut packed = vec![0u8; q.matrix_bytes(16, cols)];
            for r in 0..16 {
                scatter_row(q, &mut packed, r, cols, &file[r * row_bytes..][..row_bytes]);
            }
            for r in 0..16 {
                for g in 0..SUPER_GROUPS {
                    let want = group(q, &packed, r, g, cols).quants;
                    for c in 0..8 {
                        for j in 0..4 {
                            let v = want[4 * c + j];
                            let got = if q == QuantType::Q5Kx16 {
                                let pair = Q4K_PAIRS_AT + g / 2 * Q5K_PAIR_BYTES;
                                let run = pair + Q5K_RUNS_AT + c * RUN_BYTES;
                                let b = packed[run + 4 * r + j];
                                let nib = if g % 2 == 0 { b & 15 } else { b >> 4 };
                                let high = pair + Q5K_HIGH_AT + c / 4 * RUN_BYTES;
                                let bits = packed[high + 4 * r + j] >> (c % 4);
                                nib | (bits >> (4 * (g % 2)) & 1) << 4
                            } else if q == QuantType::Q4Kx16 {
                                let run = Q4K_PAIRS_AT
                                    + g / 2 * Q4K_PAIR_BYTES
                                    + Q4K_RUNS_AT
                                    + c * RUN_BYTES;
                                let b = packed[run + 4 * r + j];
                                if g % 2 == 0 { b & 15 } else { b >> 4 }
                            } else {
                                let grp = Q6K_GROUPS_AT + g * Q6K_GROUP_BYTES;
                                let nib =
                                    packed[grp + Q6K_NIBBLES_AT + c % 4 * RUN_BYTES + 4 * r + j];
                                let low = if c < 4 { nib & 15 } else { nib >> 4 };
                                let high =
                                    packed[grp + Q6K_HIGH_AT + c / 4 * RUN_BYTES + 4 * r + j];
                                low | ((high >> (2 * (c % 4))) & 3) << 4
                            };
                            assert_eq!(got, v, "{q:?} row {r} group {g} chunk {c}");
                        }
                    }
                }
            }
        }
    }
}
