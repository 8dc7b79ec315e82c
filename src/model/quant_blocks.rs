//! Quantized weights in row blocks: GGUF's 32-value blocks (Q8_0, Q5_0, Q4_0)
//! regrouped so that an integer GEMV reads 4 rows as one sequential stream,
//! like the 16-bit row blocks of `row_blocks`, with not one byte more than
//! the file.
//!
//! A GGUF row of these types is a run of blocks: an f16 scale `d`, then
//! the block's payload of packed quants. Here rows come in blocks of 4, and
//! inside a row block each 32-column group holds the 4 rows' scales side by
//! side (8 bytes), then the 4 rows' payloads one after the other: exactly
//! the 4 file blocks it came from. One group step of a kernel loads its 4
//! scales at once, then each row's payload. Rows past the last one (up to a
//! multiple of 4) are zero: scale 0.
//!
//! Payloads are the file's bytes, except where a kernel reads another form
//! with fewer instructions: Q8_0's bytes plus 128 (see [`QuantType::Q8_0`])
//! and Q5_0's rows in pairs, their high bits merged into one word (see
//! [`QuantType::Q5_0`]).
//!
//! Two layouts have other blocks: [`QuantType::Q8_0x16`], Q8_0's bytes in
//! blocks of 16 rows interleaved by 4 bytes, and [`QuantType::Q5_0x16`],
//! Q5_0's nibbles likewise with the high bits as 64-bit masks, for the
//! VNNI kernel whose lanes are rows (`jit::emit::gemm_q8_0x16`).
//! Repacking is exact: a repacked block dequantizes to the very f32 values
//! the file's block does.

use super::k_quant_x16;
use half::f16;

/// Rows per block (as for the 16-bit layout), for every type but
/// [`QuantType::Q8_0x16`] (see [`QuantType::block_rows`]).
pub const BLOCK_ROWS: usize = 4;
/// The most rows any type's block holds: a row range split on multiples of
/// it starts on a block of every type.
pub const MAX_BLOCK_ROWS: usize = 16;
/// Columns per quantized block.
pub const GROUP_COLS: usize = 32;
/// Offset of the first row's payload inside a group (after the 4 scales),
/// in the 4-row layouts.
pub const PAYLOADS_AT: usize = BLOCK_ROWS * 2;
/// Bytes of a chunk of a row: what one lane of `vpdpbusd` multiplies.
pub const CHUNK_BYTES: usize = 4;

/// The block types kept quantized, with what differs between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantType {
    /// 32 signed bytes q, value = d * q, stored as the unsigned bytes q +
    /// 128 (each byte's top bit flipped): the unsigned side of a byte dot
    /// product (`vpdpbusd`, `vpmaddubsw`) without a conversion per use,
    /// like Q5_0's and Q4_0's values, stored plus 16 and 8. Kernels take
    /// 128 times the sum of x off per group, or flip the bit back.
    Q8_0,
    /// 32 five-bit values offset by 16: 32 high bits and 16 bytes of low
    /// nibbles (value j in the low nibble of byte j for j < 16, in the high
    /// nibble of byte j - 16 otherwise). Rows go in pairs (0 and 1, 2 and
    /// 3 of a block): a pair's 40 bytes in a group are one 64-bit word of
    /// both rows' high bits, then the first row's 16 nibble bytes, then the
    /// second's. One 32-byte load then holds both rows' nibbles, and
    /// masking and shifting it gives the first 16 values of both rows in
    /// one vector and the last 16 in another; the word, broadcast to 4
    /// qword lanes and shifted right by the lane index (or left by 4 minus
    /// it), has each value's high bit at bit 4 of its byte in those
    /// vectors ([`q5_0_high_bit_at`]). Per pair of rows that is 14
    /// instructions where one row at a time took 20.
    Q5_0,
    /// 32 four-bit values offset by 8, as the file stores them: value j in
    /// the low nibble of byte j for j < 16, in the high nibble of byte
    /// j - 16 otherwise (Q5_0's nibble order).
    Q4_0,
    /// Q8_0's values (q + 128, the same bytes) in blocks of 16 rows: each
    /// group holds the 16 rows' scales (32 bytes), then per chunk c of 4
    /// columns the 16 rows' 4 bytes side by side (64 bytes: row r's at
    /// `64c + 4r`). A 64-byte load is one chunk of 16 rows, the lanes of a
    /// 512-bit `vpdpbusd` against one token's 4 bytes broadcast from
    /// memory, so the kernel needs no shuffle and no horizontal sum.
    Q8_0x16,
    /// Q5_0's values (s + 16) in blocks of 16 rows, for the VNNI kernel
    /// that unpacks them in registers (`jit::emit::gemm_q8_0x16`): each
    /// group holds the 16 rows' scales (32 bytes); then, for n in 0..4,
    /// the 16 rows' nibble bytes 4n..4n+3 side by side (64 bytes: row r's
    /// at `64n + 4r`), whose low nibbles are chunk n (values 4n..4n+3)
    /// and high nibbles chunk n + 4, as in the file's bytes; then per
    /// chunk c a 64-bit mask of the chunk's high bits (bit `4r + j` for
    /// row r's value 4c + j), which AVX-512 takes as an opmask (`kmovq`).
    /// 352 bytes per group: the file's 16 x 22.
    Q5_0x16,
    /// Q4_K's super-blocks in blocks of 16 rows, at the file's bits plus
    /// its 6-bit scales and mins as bytes (`model::k_quant_x16`).
    Q4Kx16,
    /// Q6_K's super-blocks in blocks of 16 rows, the file's bytes
    /// regrouped (`model::k_quant_x16`).
    Q6Kx16,
    /// Q5_K's super-blocks in blocks of 16 rows: Q4Kx16's layout plus
    /// runs of the fifth bits (`model::k_quant_x16`).
    Q5Kx16,
}

impl QuantType {
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "q8_0",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q8_0x16 => "q8_0x16",
            QuantType::Q5_0x16 => "q5_0x16k",
            QuantType::Q4Kx16 => "q4_kx16",
            QuantType::Q6Kx16 => "q6_kx16",
            QuantType::Q5Kx16 => "q5_kx16",
        }
    }

    /// Whether this is a K-quant layout (256-value super-blocks, see
    /// `model::k_quant_x16`), whose GEMM is `jit::emit::gemm_kquant`.
    pub fn is_k_quant(self) -> bool {
        matches!(
            self,
            QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16
        )
    }

    /// Whether this K-quant's values carry a min (`d·sc·q − dmin·m`, Q4_K
    /// and Q5_K) rather than an offset of 32 (Q6_K).
    pub fn has_k_mins(self) -> bool {
        matches!(self, QuantType::Q4Kx16 | QuantType::Q5Kx16)
    }

    /// Columns of one unit of a row's bytes: a 32-value block, or a
    /// K-quant's 256-value super-block.
    pub fn unit_cols(self) -> usize {
        if self.is_k_quant() {
            k_quant_x16::SUPER_COLS
        } else {
            GROUP_COLS
        }
    }

    /// Bytes of one unit ([`QuantType::unit_cols`]) of one row in this
    /// layout.
    pub fn unit_row_bytes(self) -> usize {
        if self.is_k_quant() {
            k_quant_x16::layout_row_super_bytes(self)
        } else {
            self.file_block_bytes()
        }
    }

    /// Rows per block of this layout.
    #[inline]
    pub fn block_rows(self) -> usize {
        match self {
            QuantType::Q8_0x16
            | QuantType::Q5_0x16
            | QuantType::Q4Kx16
            | QuantType::Q5Kx16
            | QuantType::Q6Kx16 => MAX_BLOCK_ROWS,
            _ => BLOCK_ROWS,
        }
    }

    /// Whether this is a 16-row layout, whose kernel (VNNI's
    /// `gemm_q8_0x16`, rows as lanes) takes single tokens too: no GEMV.
    pub fn rows_are_lanes(self) -> bool {
        self.block_rows() == MAX_BLOCK_ROWS
    }

    /// The 4-row layout of the same file type, whose file blocks have the
    /// same size (`block_stride` reads it).
    pub fn file_type(self) -> QuantType {
        match self {
            QuantType::Q8_0 | QuantType::Q8_0x16 => QuantType::Q8_0,
            QuantType::Q5_0 | QuantType::Q5_0x16 => QuantType::Q5_0,
            QuantType::Q4_0 => QuantType::Q4_0,
            k => k,
        }
    }

    /// Whether the bytes are Q8_0's (plus 128), in either layout.
    pub fn is_q8_0(self) -> bool {
        matches!(self, QuantType::Q8_0 | QuantType::Q8_0x16)
    }

    /// What the stored unsigned values carry on top of the signed ones
    /// (Q8_0 128, Q5_0 16, Q4_0 8), as a power of two: a kernel that
    /// multiplies the stored bytes as they are takes `sum(x) << shift` off
    /// each group sum.
    #[inline]
    pub fn stored_offset_shift(self) -> u8 {
        match self {
            QuantType::Q8_0 | QuantType::Q8_0x16 => 7,
            QuantType::Q5_0 | QuantType::Q5_0x16 => 4,
            QuantType::Q4_0 => 3,
            QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16 => {
                panic!("{self:?} stores no offset of its own")
            }
        }
    }

    /// Bytes of one row's packed quants in a group.
    #[inline]
    pub fn payload_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 | QuantType::Q8_0x16 => 32,
            QuantType::Q5_0 | QuantType::Q5_0x16 => 20,
            QuantType::Q4_0 => 16,
            QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16 => {
                panic!("{self:?} has super-blocks, not 32-value blocks")
            }
        }
    }

    /// The GGUF type whose blocks this layout regroups.
    pub fn file_dtype(self) -> crate::model::dtype::DType {
        use crate::model::dtype::DType;
        match self {
            QuantType::Q8_0 | QuantType::Q8_0x16 => DType::Q8_0,
            QuantType::Q5_0 | QuantType::Q5_0x16 => DType::Q5_0,
            QuantType::Q4_0 => DType::Q4_0,
            QuantType::Q4Kx16 => DType::Q4K,
            QuantType::Q6Kx16 => DType::Q6K,
            QuantType::Q5Kx16 => DType::Q5K,
        }
    }

    /// Bytes of one file block: f16 scale and payload.
    #[inline]
    pub fn file_block_bytes(self) -> usize {
        2 + self.payload_bytes()
    }

    /// Bytes of one group of a row block: its rows' scales, then their
    /// payloads. (A K-quant's groups differ within a super-block; this is
    /// their average, a whole number.)
    #[inline]
    pub fn group_bytes(self) -> usize {
        self.block_rows() * self.unit_row_bytes() * GROUP_COLS / self.unit_cols()
    }

    /// Bytes of one row block of `cols` columns.
    #[inline]
    pub fn block_bytes(self, cols: usize) -> usize {
        cols / self.unit_cols() * self.block_rows() * self.unit_row_bytes()
    }

    /// Bytes a `rows x cols` matrix takes, padding rows included.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        rows.div_ceil(self.block_rows()) * self.block_bytes(cols)
    }

    /// The file payload of one block in this layout's order.
    fn repack_payload(self, file: &[u8], out: &mut [u8]) {
        match self {
            QuantType::Q8_0 | QuantType::Q8_0x16 => {
                for (o, &b) in out.iter_mut().zip(file) {
                    *o = b ^ 0x80;
                }
            }
            // Q5_0's high bits go into its row pair's word
            // (`scatter_row`); the row's own payload keeps the file's
            // order.
            QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q5_0x16 => out.copy_from_slice(file),
            QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16 => {
                unreachable!("k_quant_x16 scatters them")
            }
        }
    }

    /// The 32 integer values of one row's payload in its own order (the
    /// file's, but Q8_0's bytes plus 128), offset back: Q5_0's by -16,
    /// Q4_0's by -8.
    pub fn values(self, payload: &[u8]) -> [i8; GROUP_COLS] {
        let mut v = [0i8; GROUP_COLS];
        match self {
            QuantType::Q8_0 | QuantType::Q8_0x16 => {
                for (v, &b) in v.iter_mut().zip(payload) {
                    *v = (b ^ 0x80) as i8;
                }
            }
            QuantType::Q5_0 | QuantType::Q5_0x16 => {
                let qh = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
                let qs = &payload[4..20];
                for (j, v) in v.iter_mut().enumerate() {
                    let low = if j < 16 {
                        qs[j] & 0x0f
                    } else {
                        qs[j - 16] >> 4
                    };
                    let high = ((qh >> j) & 1) as u8;
                    *v = (low | high << 4) as i8 - 16;
                }
            }
            QuantType::Q4_0 => {
                for (j, v) in v.iter_mut().enumerate() {
                    let nibble = if j < 16 {
                        payload[j] & 0x0f
                    } else {
                        payload[j - 16] >> 4
                    };
                    *v = nibble as i8 - 8;
                }
            }
            QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16 => {
                panic!("{self:?} has super-blocks, not 32-value blocks")
            }
        }
        v
    }
}

/// Bytes of a Q5_0 row pair's high bits, ahead of its two rows' nibbles.
const Q5_0_PAIR_HIGH_BYTES: usize = 8;

/// The bit of its pair's 64-bit word that holds the high bit of value j
/// of the pair's first (`second` false) or second row.
///
/// The kernels make two vectors of a pair's values: bytes 0..15 of the
/// first row's and 16..31 of the second's first 16 values (from the low
/// nibbles), then the same of their last 16 (from the high nibbles).
/// Byte b of a vector is byte b % 8 of qword lane b / 8. The word is
/// broadcast to the 4 lanes and lane k shifted right by k for the first
/// vector, left by 4 - k for the second, and bit 4 of each byte kept: so
/// a first-vector byte's bit comes from 8 * (b % 8) + 4 + k and a
/// second-vector byte's from 8 * (b % 8) + k. Each of the 64 bits is used
/// once (the first vector's are the upper half of each of the word's
/// bytes, the second's the lower).
pub const fn q5_0_high_bit_at(second: bool, j: usize) -> usize {
    let byte = if second { 16 } else { 0 } + j % 16;
    let (lane, in_lane) = (byte / 8, byte % 8);
    if j < 16 {
        8 * in_lane + 4 + lane
    } else {
        8 * in_lane + lane
    }
}

/// For the first and the second row of a Q5_0 pair, byte i (0..3) of its
/// file high bits and that byte's value: the bits they set in the pair's
/// word. Loading a model places every row's 32 bits with 4 lookups
/// instead of 32 single-bit moves (which took the default model's load
/// from 0.39-0.68 to 0.77-0.82 s).
static Q5_0_HIGH_BITS_SPREAD: [[[u64; 256]; 4]; 2] = q5_0_high_bits_spread();

const fn q5_0_high_bits_spread() -> [[[u64; 256]; 4]; 2] {
    let mut table = [[[0u64; 256]; 4]; 2];
    let mut row = 0;
    while row < 2 {
        let mut byte = 0;
        while byte < 4 {
            let mut value = 0;
            while value < 256 {
                let mut bits = 0u64;
                let mut b = 0;
                while b < 8 {
                    if (value >> b) & 1 == 1 {
                        bits |= 1 << q5_0_high_bit_at(row == 1, 8 * byte + b);
                    }
                    b += 1;
                }
                table[row][byte][value] = bits;
                value += 1;
            }
            byte += 1;
        }
        row += 1;
    }
    table
}

/// Where row `r`'s pair word of group `g` sits (Q5_0).
#[inline]
fn q5_0_pair_word_at(r: usize, g: usize, cols: usize) -> usize {
    let q = QuantType::Q5_0;
    r / BLOCK_ROWS * q.block_bytes(cols)
        + g * q.group_bytes()
        + PAYLOADS_AT
        + r % BLOCK_ROWS / 2 * 2 * q.payload_bytes()
}

/// Whether a row of `cols` can be stored in `q`: rows are whole units.
pub fn fits_type(q: QuantType, cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(q.unit_cols())
}

/// Whether a row of `cols` can be stored: rows are whole blocks.
pub fn fits(cols: usize) -> bool {
    cols > 0 && cols.is_multiple_of(GROUP_COLS)
}

/// Where row `r`'s scale of group `g` sits.
#[inline]
fn scale_at(q: QuantType, r: usize, g: usize, cols: usize) -> usize {
    let rows = q.block_rows();
    r / rows * q.block_bytes(cols) + g * q.group_bytes() + r % rows * 2
}

/// Where row `r`'s payload bytes `CHUNK_BYTES * c ..` of group `g` sit, for
/// each chunk c: one run in the 4-row layouts, 4 bytes per chunk in
/// Q8_0x16's. Q5_0's high bits (chunk 0) are not bytes of their own:
/// `scatter_row` and `group_payload` place them in the pair's word.
#[inline]
fn chunk_at(q: QuantType, r: usize, g: usize, cols: usize, c: usize) -> usize {
    let rows = q.block_rows();
    let group = r / rows * q.block_bytes(cols) + g * q.group_bytes() + rows * 2;
    match q {
        QuantType::Q8_0x16 => group + c * rows * CHUNK_BYTES + r % rows * CHUNK_BYTES,
        QuantType::Q5_0x16 => {
            debug_assert!(c > 0, "Q5_0's high bits have no chunk");
            group + (c - 1) * rows * CHUNK_BYTES + r % rows * CHUNK_BYTES
        }
        QuantType::Q5_0 => {
            debug_assert!(c > 0, "Q5_0's high bits have no chunk");
            let nibbles = q5_0_pair_word_at(r, g, cols) + Q5_0_PAIR_HIGH_BYTES;
            nibbles + r % 2 * (q.payload_bytes() - 4) + (c - 1) * CHUNK_BYTES
        }
        _ => group + r % rows * q.payload_bytes() + c * CHUNK_BYTES,
    }
}

/// The chunks of a payload that are bytes in the layout: all but Q5_0's
/// high bits.
#[inline]
fn first_byte_chunk(q: QuantType) -> usize {
    usize::from(matches!(q, QuantType::Q5_0 | QuantType::Q5_0x16))
}

/// Where the high-bit mask of chunk `c` of group `g` of row `r`'s 16-row
/// block sits (Q5_0x16): after the scales and the 4 nibble runs.
#[inline]
fn q5_0x16_mask_at(r: usize, g: usize, cols: usize, c: usize) -> usize {
    let q = QuantType::Q5_0x16;
    let rows = q.block_rows();
    r / rows * q.block_bytes(cols) + g * q.group_bytes() + rows * 2 + 4 * rows * CHUNK_BYTES + 8 * c
}

/// Bytes of a Q5_0x16 group before its masks, from its start: what a
/// kernel adds to the group's address to reach mask 0.
pub const Q5_0X16_MASKS_AT: usize = MAX_BLOCK_ROWS * 2 + 4 * MAX_BLOCK_ROWS * CHUNK_BYTES;

/// Copies one GGUF row (`cols / 32` file blocks) into row `r` of a matrix
/// in the layout. Nothing is requantized.
pub fn scatter_row(q: QuantType, data: &mut [u8], r: usize, cols: usize, file_row: &[u8]) {
    if q.is_k_quant() {
        return k_quant_x16::scatter_row(q, data, r, cols, file_row);
    }
    let mut payload = [0u8; GROUP_COLS];
    for (g, block) in file_row.chunks_exact(q.file_block_bytes()).enumerate() {
        let s = scale_at(q, r, g, cols);
        data[s..s + 2].copy_from_slice(&block[..2]);
        let payload = &mut payload[..q.payload_bytes()];
        q.repack_payload(&block[2..], payload);
        let chunks = payload.chunks(CHUNK_BYTES).enumerate();
        for (c, chunk) in chunks.skip(first_byte_chunk(q)) {
            let at = chunk_at(q, r, g, cols, c);
            data[at..at + chunk.len()].copy_from_slice(chunk);
        }
        if q == QuantType::Q5_0 {
            let at = q5_0_pair_word_at(r, g, cols);
            let word = &mut data[at..at + Q5_0_PAIR_HIGH_BYTES];
            let spread = &Q5_0_HIGH_BITS_SPREAD[r % 2];
            let (row_bits, row_mask) = payload[..4]
                .iter()
                .zip(spread)
                .fold((0u64, 0u64), |(bits, mask), (&v, byte)| {
                    (bits | byte[usize::from(v)], mask | byte[255])
                });
            let bits = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            word.copy_from_slice(&((bits & !row_mask) | row_bits).to_le_bytes());
        }
        if q == QuantType::Q5_0x16 {
            // Bits 4c..4c+3 of the row's 32 go to bits 4 (r % 16) .. of
            // chunk c's mask.
            let high = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
            let shift = CHUNK_BYTES * (r % MAX_BLOCK_ROWS);
            for c in 0..GROUP_COLS / CHUNK_BYTES {
                let at = q5_0x16_mask_at(r, g, cols, c);
                let word = &mut data[at..at + 8];
                let mask = u64::from_le_bytes((&*word).try_into().expect("8 bytes"));
                let four = u64::from((high >> (CHUNK_BYTES * c)) & 0xf);
                let mask = (mask & !(0xf << shift)) | four << shift;
                word.copy_from_slice(&mask.to_le_bytes());
            }
        }
    }
}

/// Row `r`'s scale and payload of group `g` (the payload in this layout's
/// order, as one run).
#[inline]
fn group_payload(
    q: QuantType,
    data: &[u8],
    r: usize,
    g: usize,
    cols: usize,
) -> (u16, [u8; GROUP_COLS]) {
    let s = scale_at(q, r, g, cols);
    let mut payload = [0u8; GROUP_COLS];
    for (c, chunk) in payload[..q.payload_bytes()]
        .chunks_mut(CHUNK_BYTES)
        .enumerate()
        .skip(first_byte_chunk(q))
    {
        let at = chunk_at(q, r, g, cols, c);
        chunk.copy_from_slice(&data[at..at + chunk.len()]);
    }
    if q == QuantType::Q5_0 {
        let at = q5_0_pair_word_at(r, g, cols);
        let word = &data[at..at + Q5_0_PAIR_HIGH_BYTES];
        let bits = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let high = (0..GROUP_COLS).fold(0u32, |h, j| {
            h | (((bits >> q5_0_high_bit_at(r % 2 == 1, j)) & 1) as u32) << j
        });
        payload[..4].copy_from_slice(&high.to_le_bytes());
    }
    if q == QuantType::Q5_0x16 {
        let shift = CHUNK_BYTES * (r % MAX_BLOCK_ROWS);
        let high = (0..GROUP_COLS / CHUNK_BYTES).fold(0u32, |h, c| {
            let at = q5_0x16_mask_at(r, g, cols, c);
            let mask = u64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
            h | (((mask >> shift) & 0xf) as u32) << (CHUNK_BYTES * c)
        });
        payload[..4].copy_from_slice(&high.to_le_bytes());
    }
    (u16::from_le_bytes([data[s], data[s + 1]]), payload)
}

/// Row `r`'s scale and 32 integer values of group `g`.
#[inline]
pub fn group(
    q: QuantType,
    data: &[u8],
    r: usize,
    g: usize,
    cols: usize,
) -> (f32, [i8; GROUP_COLS]) {
    let (d, payload) = group_payload(q, data, r, g, cols);
    (f16::from_bits(d).to_f32(), q.values(&payload))
}

/// Row `r` of a matrix in any layout as the file stores it: per group the
/// f16 scale, then the file's payload (Q8_0's signed bytes).
pub fn file_row(q: QuantType, data: &[u8], r: usize, cols: usize) -> Vec<u8> {
    if q.is_k_quant() {
        return k_quant_x16::file_row(q, data, r, cols);
    }
    let flip = if q.is_q8_0() { 0x80 } else { 0 };
    let mut out = Vec::with_capacity(cols / GROUP_COLS * q.file_block_bytes());
    for g in 0..cols / GROUP_COLS {
        let (d, payload) = group_payload(q, data, r, g, cols);
        out.extend_from_slice(&d.to_le_bytes());
        out.extend(payload[..q.payload_bytes()].iter().map(|b| b ^ flip));
    }
    out
}

/// A row of GGUF Q5_0 blocks as Q8_0 blocks of the same values exactly:
/// the same f16 scale, and each 5-bit value less its offset of 16
/// (-16..=15) as a signed byte. Where a model's kernels cannot include
/// Q5_0's family beside the others, its Q5_0 matrices widen to Q8_0
/// without moving a value.
pub fn q5_0_row_as_q8_0(row: &[u8]) -> Vec<u8> {
    let q5_0 = QuantType::Q5_0.file_block_bytes();
    let mut out = Vec::with_capacity(row.len() / q5_0 * QuantType::Q8_0.file_block_bytes());
    for block in row.chunks_exact(q5_0) {
        out.extend_from_slice(&block[..2]);
        let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let low = &block[6..22];
        let value = |j: usize| {
            let nibble = if j < 16 {
                low[j] & 0x0f
            } else {
                low[j - 16] >> 4
            };
            let v = (nibble | (((high >> j) & 1) as u8) << 4) as i8 - 16;
            v as u8
        };
        out.extend((0..GROUP_COLS).map(value));
    }
    out
}

/// Row `r` of a matrix in the layout, dequantized exactly as the file's
/// blocks dequantize: `f16(d) as f32 * value`.
pub fn dequant_row(q: QuantType, data: &[u8], r: usize, cols: usize, out: &mut [f32]) {
    if q.is_k_quant() {
        return k_quant_x16::dequant_row(q, data, r, cols, out);
    }
    for (g, part) in out[..cols].chunks_exact_mut(GROUP_COLS).enumerate() {
        let (d, values) = group(q, data, r, g, cols);
        for (o, v) in part.iter_mut().zip(values) {
            *o = d * f32::from(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant;
    use crate::model::dtype::{DType, TensorView};

    #[test]
    fn q5_0_widens_to_q8_0_without_moving_a_value() {
        let (rows, cols) = (3, 96);
        let bytes = file_bytes(QuantType::Q5_0, rows, cols);
        let q5_0 = TensorView {
            dtype: DType::Q5_0,
            shape: &[rows, cols],
            bytes: &bytes,
        };
        let row_bytes = bytes.len() / rows;
        for r in 0..rows {
            let widened = q5_0_row_as_q8_0(&bytes[r * row_bytes..(r + 1) * row_bytes]);
            let q8_0 = TensorView {
                dtype: DType::Q8_0,
                shape: &[1, cols],
                bytes: &widened,
            };
            let (mut want, mut got) = (vec![0.0f32; cols], vec![0.0f32; cols]);
            dequant::row_into(&q5_0, r, &mut want);
            dequant::row_into(&q8_0, 0, &mut got);
            assert_eq!(
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "row {r}"
            );
            assert!(got.iter().any(|&v| v != 0.0));
        }
    }

    /// GGUF bytes for a `rows x cols` matrix of made-up blocks.
    fn file_bytes(q: QuantType, rows: usize, cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..rows * cols / GROUP_COLS {
            let d = f16::from_f32(0.01 + i as f32 * 0.003);
            out.extend_from_slice(&d.to_bits().to_le_bytes());
            out.extend((0..q.payload_bytes()).map(|j| ((i * 37 + j * 11) % 256) as u8));
        }
        out
    }

    #[test]
    fn repacking_keeps_the_size_and_dequantizes_bit_for_bit() {
        for (q, dtype) in [
            (QuantType::Q8_0, DType::Q8_0),
            (QuantType::Q5_0, DType::Q5_0),
            (QuantType::Q4_0, DType::Q4_0),
            (QuantType::Q8_0x16, DType::Q8_0),
            (QuantType::Q5_0x16, DType::Q5_0),
        ] {
            for (rows, cols) in [(4, 64), (7, 96), (1, 32), (9, 640), (16, 64), (37, 96)] {
                let file = file_bytes(q, rows, cols);
                let row_bytes = cols / GROUP_COLS * q.file_block_bytes();
                let mut packed = vec![0u8; q.matrix_bytes(rows, cols)];
                assert_eq!(
                    packed.len(),
                    rows.next_multiple_of(q.block_rows()) * row_bytes
                );
                for r in 0..rows {
                    let src = &file[r * row_bytes..(r + 1) * row_bytes];
                    scatter_row(q, &mut packed, r, cols, src);
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
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{q:?} {rows}x{cols} row {r}");
                    let src = &file[r * row_bytes..(r + 1) * row_bytes];
                    assert_eq!(file_row(q, &packed, r, cols), src, "{q:?} row {r}");
                }
                if rows % q.block_rows() != 0 {
                    dequant_row(q, &packed, rows, cols, &mut got);
                    assert!(got.iter().all(|&v| v == 0.0), "padding rows are zero");
                }
            }
        }
    }

    /// A Q5_0 pair's word holds each of its two rows' 32 high bits once,
    /// and the kernels' shifts find value j's bit at bit 4 of its byte and
    /// nowhere else: simulated here as the kernels compute it.
    #[test]
    fn q5_0_high_bits_fill_the_pair_word_as_the_kernels_shift_it() {
        let mut seen = 0u64;
        for second in [false, true] {
            for j in 0..GROUP_COLS {
                let at = q5_0_high_bit_at(second, j);
                assert!(at < 64 && seen & 1 << at == 0, "bit {at} used twice");
                seen |= 1 << at;
                // Only this value's high bit set, then the kernel's view.
                let word = 1u64 << at;
                let (vector_high_half, byte) = (j >= 16, 16 * usize::from(second) + j % 16);
                let lane = byte / 8;
                let shifted = if vector_high_half {
                    word << (4 - lane)
                } else {
                    word >> lane
                };
                let kernel_byte = (shifted >> (8 * (byte % 8))) as u8;
                assert_eq!(kernel_byte & 0x10, 0x10, "row {second} value {j}");
                // And no other byte of the vector sees it.
                for other in (0..32).filter(|&b| b != byte) {
                    let l = other / 8;
                    let s = if vector_high_half {
                        word << (4 - l)
                    } else {
                        word >> l
                    };
                    assert_eq!(
                        (s >> (8 * (other % 8))) as u8 & 0x10,
                        0,
                        "leaks to byte {other}"
                    );
                }
            }
        }
        assert_eq!(seen, u64::MAX);
    }

    /// Made-up file rows of `q`'s file type for one 16-row block of `cols`,
    /// and that block in `q`'s layout.
    fn one_block_of_16_rows(q: QuantType, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let rows = MAX_BLOCK_ROWS;
        let file = file_bytes(q.file_type(), rows, cols);
        let row_bytes = cols / GROUP_COLS * q.file_block_bytes();
        let mut packed = vec![0u8; q.matrix_bytes(rows, cols)];
        for r in 0..rows {
            scatter_row(q, &mut packed, r, cols, &file[r * row_bytes..][..row_bytes]);
        }
        (file, packed)
    }

    /// Q8_0x16 keeps each chunk of 4 columns of 16 rows in one 64-byte run,
    /// which its kernel loads as one vector.
    #[test]
    fn q8_0x16_interleaves_16_rows_by_chunks_of_4_bytes() {
        let q = QuantType::Q8_0x16;
        let (rows, cols) = (16, 64);
        let (file, packed) = one_block_of_16_rows(q, cols);
        let row_bytes = cols / GROUP_COLS * q.file_block_bytes();
        for r in 0..rows {
            for g in 0..cols / GROUP_COLS {
                let block = &file[r * row_bytes + g * 34..][..34];
                let group = &packed[g * q.group_bytes()..][..q.group_bytes()];
                assert_eq!(group[2 * r..2 * r + 2], block[..2], "scale of row {r}");
                for c in 0..GROUP_COLS / CHUNK_BYTES {
                    let at = 32 + 64 * c + 4 * r;
                    let want: Vec<u8> = block[2 + 4 * c..][..4].iter().map(|b| b ^ 0x80).collect();
                    assert_eq!(group[at..at + 4], want[..], "row {r} group {g} chunk {c}");
                }
            }
        }
    }

    /// Q5_0x16 as its kernel reads it: chunk c's 16 rows x 4 values are the
    /// low (c < 4) or high nibbles of one 64-byte run, with bit 4 from
    /// chunk c's mask.
    #[test]
    fn q5_0x16_holds_nibble_runs_and_high_bit_masks() {
        let q = QuantType::Q5_0x16;
        let (rows, cols) = (16, 64);
        assert_eq!(q.group_bytes(), 352);
        let (file, packed) = one_block_of_16_rows(q, cols);
        let row_bytes = cols / GROUP_COLS * q.file_block_bytes();
        for r in 0..rows {
            for g in 0..cols / GROUP_COLS {
                let block = &file[r * row_bytes + g * 22..][..22];
                let want = QuantType::Q5_0.values(&block[2..]);
                let group = &packed[g * q.group_bytes()..][..q.group_bytes()];
                assert_eq!(group[2 * r..2 * r + 2], block[..2], "scale of row {r}");
                for c in 0..GROUP_COLS / CHUNK_BYTES {
                    let mask_at = Q5_0X16_MASKS_AT + 8 * c;
                    let mask = u64::from_le_bytes(group[mask_at..mask_at + 8].try_into().unwrap());
                    for j in 0..CHUNK_BYTES {
                        let byte = group[32 + 64 * (c % 4) + 4 * r + j];
                        let nibble = if c < 4 { byte & 0xf } else { byte >> 4 };
                        let high = ((mask >> (4 * r + j)) & 1) as u8;
                        let v = (nibble | high << 4) as i8 - 16;
                        assert_eq!(v, want[4 * c + j], "row {r} group {g} chunk {c} value {j}");
                    }
                }
            }
        }
    }
}
