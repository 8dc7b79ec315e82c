//! Element types a tensor can be stored in, and their block geometry.

use super::quant_blocks::{self, QuantType};
use super::row_blocks;
use std::fmt;

/// Storage type of a tensor as found in a GGUF or safetensors file.
///
/// Quantized types store `block_elems` values in `block_bytes` bytes; plain
/// types are blocks of one element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// Integers (an index table such as a Gemma 4 assistant's token
    /// ordering): never a weight matrix.
    I32,
    I64,
    Q8_0,
    Q4_0,
    Q5_0,
    Q4K,
    Q5K,
    Q6K,
    /// FP16 in the kernels' row-block layout (`model::row_blocks`), written
    /// by `pulsar convert`. A Pulsar-private GGML id: other readers refuse
    /// the file instead of misreading it.
    F16RowBlocks,
    /// BF16 in the row-block layout, as [`DType::F16RowBlocks`].
    BF16RowBlocks,
    /// A 32-value block type in the integer kernels' row blocks
    /// (`model::quant_blocks`: 4 rows' blocks per group, values stored as
    /// the kernels read them), written by `pulsar convert --dtype q8_0`
    /// or `q4_0`. Private ids, as for [`DType::F16RowBlocks`].
    QuantRowBlocks(QuantType),
}

/// GGML type ids of the row-block types, far above GGML's own (under 64).
const F16_ROW_BLOCKS_ID: u32 = 0x5055_0001;
const BF16_ROW_BLOCKS_ID: u32 = 0x5055_0030;
/// Quantized row blocks: this plus the GGML id of the block type.
const QUANT_ROW_BLOCKS_BASE: u32 = 0x5055_0100;
const Q8_0_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 8;
/// Q5_0 with its rows in pairs (`quant_blocks::QuantType::Q5_0`). The
/// id of the block type alone marked the earlier layout, one row at a
/// time, which no kernel reads any more ([`RETIRED_Q5_0_ROW_BLOCKS_ID`]).
const Q5_0_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 6 + 0x40;
/// Q5_0 row blocks one row at a time, the layout before the pairs. No
/// `pulsar convert` wrote them (it quantizes to Q8_0 or Q4_0 only), but
/// the id meant them: a file carrying it is refused with a line that says
/// to convert again rather than misread.
pub const RETIRED_Q5_0_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 6;
const Q4_0_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 2;
/// Q8_0 in 16-row blocks: its own id, the block type's plus 0x80.
const Q8_0X16_ROW_BLOCKS_ID: u32 = Q8_0_ROW_BLOCKS_ID + 0x80;
/// Q5_0 in 16-row blocks with its high bits as masks: likewise.
const Q5_0X16_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 6 + 0x80;
/// Q4_K, Q5_K and Q6_K in 16-row blocks (`model::k_quant_x16`): the base plus
/// the block type's id, their only layout.
const Q4_KX16_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 12;
const Q6_KX16_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 14;
const Q5_KX16_ROW_BLOCKS_ID: u32 = QUANT_ROW_BLOCKS_BASE + 13;

impl DType {
    /// The GGML type id used in GGUF tensor infos, or `None` for ids we do not read.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            6 => DType::Q5_0,
            8 => DType::Q8_0,
            12 => DType::Q4K,
            13 => DType::Q5K,
            14 => DType::Q6K,
            26 => DType::I32,
            27 => DType::I64,
            30 => DType::BF16,
            F16_ROW_BLOCKS_ID => DType::F16RowBlocks,
            BF16_ROW_BLOCKS_ID => DType::BF16RowBlocks,
            Q8_0_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q8_0),
            Q5_0_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q5_0),
            Q4_0_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q4_0),
            Q8_0X16_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q8_0x16),
            Q5_0X16_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q5_0x16),
            Q4_KX16_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q4Kx16),
            Q6_KX16_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q6Kx16),
            Q5_KX16_ROW_BLOCKS_ID => DType::QuantRowBlocks(QuantType::Q5Kx16),
            _ => return None,
        })
    }

    /// The GGML type id (inverse of [`DType::from_ggml_id`]).
    pub fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q5_0 => 6,
            DType::Q8_0 => 8,
            DType::Q4K => 12,
            DType::Q5K => 13,
            DType::Q6K => 14,
            DType::BF16 => 30,
            DType::I32 => 26,
            DType::I64 => 27,
            DType::F16RowBlocks => F16_ROW_BLOCKS_ID,
            DType::BF16RowBlocks => BF16_ROW_BLOCKS_ID,
            DType::QuantRowBlocks(QuantType::Q8_0x16) => Q8_0X16_ROW_BLOCKS_ID,
            DType::QuantRowBlocks(QuantType::Q5_0x16) => Q5_0X16_ROW_BLOCKS_ID,
            DType::QuantRowBlocks(QuantType::Q5_0) => Q5_0_ROW_BLOCKS_ID,
            DType::QuantRowBlocks(q) => QUANT_ROW_BLOCKS_BASE + q.file_dtype().ggml_id(),
        }
    }

    /// Whether rows are stored in the row-block layout rather than one after
    /// another.
    pub fn is_row_blocked(self) -> bool {
        matches!(
            self,
            DType::F16RowBlocks | DType::BF16RowBlocks | DType::QuantRowBlocks(_)
        )
    }

    /// Rows per block of a row-block layout; `None` for types stored row
    /// after row.
    pub fn rows_per_block(self) -> Option<usize> {
        match self {
            DType::F16RowBlocks | DType::BF16RowBlocks => Some(row_blocks::BLOCK_ROWS),
            DType::QuantRowBlocks(q) => Some(q.block_rows()),
            _ => None,
        }
    }

    /// Bytes of a `rows x cols` matrix in a row-block layout, padding
    /// included; `None` for types stored row after row or on overflow.
    pub fn row_blocked_len(self, rows: usize, cols: usize) -> Option<usize> {
        match self {
            DType::F16RowBlocks | DType::BF16RowBlocks => {
                row_blocks::padded_len(rows, cols).checked_mul(2)
            }
            DType::QuantRowBlocks(q) => rows
                .div_ceil(q.block_rows())
                .checked_mul(cols / q.unit_cols())?
                .checked_mul(q.block_rows() * q.unit_row_bytes()),
            _ => None,
        }
    }

    /// Name of a GGML type id we do not support, for error messages.
    pub fn ggml_name(id: u32) -> &'static str {
        match id {
            3 => "Q4_1",
            7 => "Q5_1",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            15 => "Q8_K",
            16..=23 => "IQ*",
            24 => "I8",
            25 => "I16",
            28 => "F64",
            29 => "IQ1_M",
            _ => "unknown",
        }
    }

    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::I32 | DType::I64 => 1,
            DType::F16RowBlocks | DType::BF16RowBlocks => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => 32,
            DType::QuantRowBlocks(q) => q.unit_cols(),
            DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::F16RowBlocks | DType::BF16RowBlocks => 2,
            DType::Q8_0 => 2 + 32,
            DType::Q4_0 => 2 + 16,
            DType::Q5_0 => 2 + 4 + 16,
            // Per row and group: the same bytes as the file's block.
            DType::QuantRowBlocks(q) => q.unit_row_bytes(),
            DType::Q4K => 2 + 2 + 12 + 128,
            DType::Q5K => 2 + 2 + 12 + 32 + 128,
            DType::Q6K => 128 + 64 + 16 + 2,
        }
    }

    /// Where each block of a quantized type keeps its f16 scales (the
    /// super-scale and minimum of the K types), in bytes from the block's
    /// start; none for the plain and row-block types.
    pub fn scale_offsets(self) -> &'static [usize] {
        match self {
            DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => &[0],
            DType::Q4K | DType::Q5K => &[0, 2],
            DType::Q6K => &[128 + 64 + 16],
            // Per group of a row block (see `scale_unit_bytes`).
            DType::QuantRowBlocks(QuantType::Q8_0x16 | QuantType::Q5_0x16 | QuantType::Q6Kx16) => {
                &[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
            }
            // A super-block's 16 d, then 16 dmin.
            DType::QuantRowBlocks(QuantType::Q4Kx16 | QuantType::Q5Kx16) => &[
                0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
            ],
            DType::QuantRowBlocks(_) => &[0, 2, 4, 6],
            _ => &[],
        }
    }

    /// The bytes that [`DType::scale_offsets`] index into, one after
    /// another: a block, or a row block's group.
    fn scale_unit_bytes(self) -> usize {
        match self {
            DType::QuantRowBlocks(q) if q.is_k_quant() => q.block_rows() * q.unit_row_bytes(),
            DType::QuantRowBlocks(q) => q.group_bytes(),
            _ => self.block_bytes(),
        }
    }

    /// The first block of `bytes` (whole blocks of this type, rows of
    /// `cols` values) whose scale is NaN or infinite, with that scale: a
    /// damaged file, which would otherwise turn every logit into NaN
    /// without a word. Blocks are counted row after row, as the file's
    /// type stores them, also for quantized row blocks.
    pub fn first_bad_scale(self, bytes: &[u8], cols: usize) -> Option<(usize, f32)> {
        let offsets = self.scale_offsets();
        if offsets.is_empty() {
            return None;
        }
        let unit_bytes = self.scale_unit_bytes();
        let first_in = |from: usize, part: &[u8]| {
            part.chunks_exact(unit_bytes)
                .enumerate()
                .find_map(|(i, unit)| {
                    offsets.iter().enumerate().find_map(|(k, &at)| {
                        let v = half::f16::from_le_bytes([unit[at], unit[at + 1]]);
                        (!v.is_finite()).then_some(((from + i, k), v.to_f32()))
                    })
                })
        };
        // The scan is the first read of a tensor's pages in the mapped
        // file (a 4B model's 2.5 GB): large tensors are split over the
        // cores, and the first bad unit of the first part that has one is
        // the tensor's first.
        let units = bytes.len() / unit_bytes;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ((i, k), scale) = if threads < 2 || bytes.len() < PARALLEL_SCAN_BYTES {
            first_in(0, bytes)
        } else {
            let per = units.div_ceil(threads);
            std::thread::scope(|scope| {
                let parts: Vec<_> = bytes
                    .chunks(per * unit_bytes)
                    .enumerate()
                    .map(|(n, part)| scope.spawn(move || first_in(n * per, part)))
                    .collect();
                // A part's thread cannot panic (slicing within its own
                // chunk), so a join error is treated as nothing found.
                parts
                    .into_iter()
                    .find_map(|part| part.join().ok().flatten())
            })
        }?;
        let block = match self {
            // Group i of the row blocks holds row (i / groups) * 4 + k's
            // block i % groups.
            DType::QuantRowBlocks(q) => {
                let groups = (cols / quant_blocks::GROUP_COLS).max(1);
                (i / groups * q.block_rows() + k) * groups + i % groups
            }
            _ => i,
        };
        Some((block, scale))
    }

    /// Bytes needed for a row of `elems` values, or `None` when `elems` is not
    /// a whole number of blocks.
    pub fn row_bytes(self, elems: usize) -> Option<usize> {
        if !elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (elems / self.block_elems()).checked_mul(self.block_bytes())
    }
}

/// Tensors of at least this many bytes have their scales scanned on
/// several threads ([`DType::first_bad_scale`]).
const PARALLEL_SCAN_BYTES: usize = 8 << 20;

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q5_0 => "Q5_0",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
            DType::F16RowBlocks => "F16_R4X8",
            DType::BF16RowBlocks => "BF16_R4X8",
            DType::QuantRowBlocks(QuantType::Q8_0) => "Q8_0_R4",
            DType::QuantRowBlocks(QuantType::Q5_0) => "Q5_0_R4",
            DType::QuantRowBlocks(QuantType::Q4_0) => "Q4_0_R4",
            DType::QuantRowBlocks(QuantType::Q8_0x16) => "Q8_0_R16",
            DType::QuantRowBlocks(QuantType::Q5_0x16) => "Q5_0_R16K",
            DType::QuantRowBlocks(QuantType::Q4Kx16) => "Q4_K_R16",
            DType::QuantRowBlocks(QuantType::Q6Kx16) => "Q6_K_R16",
            DType::QuantRowBlocks(QuantType::Q5Kx16) => "Q5_K_R16",
        };
        f.write_str(name)
    }
}

/// A borrowed tensor: its dtype, its shape (outermost dimension first, as in
/// PyTorch; a weight matrix is `[out, in]`) and its raw bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// Tells the kernel this tensor's pages will not be read again soon, so
    /// a model converted at load does not keep both copies resident. The
    /// bytes stay valid: they come from a read-only file mapping, and a
    /// later read faults them back in from the file.
    pub fn release_pages(&self) {
        #[cfg(target_os = "linux")]
        {
            let page = 4096usize;
            let start = (self.bytes.as_ptr() as usize).div_ceil(page) * page;
            let end = (self.bytes.as_ptr() as usize + self.bytes.len()) / page * page;
            if end > start {
                // SAFETY: whole pages inside this tensor's bytes. Every
                // TensorView comes from a read-only file mapping (GGUF or
                // safetensors), for which MADV_DONTNEED only drops resident
                // copies; the advice's result does not matter.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
                }
            }
        }
    }

    /// Rows and columns when seen as a matrix: the last dimension is the row
    /// length, all others multiply into the row count.
    pub fn matrix_dims(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = self.shape[..self.shape.len().saturating_sub(1)]
            .iter()
            .product();
        (rows, cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `blocks` blocks of `dtype`, all scales 1.0.
    fn blocks(dtype: DType, blocks: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; blocks * dtype.block_bytes()];
        for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
            for &at in dtype.scale_offsets() {
                block[at..at + 2].copy_from_slice(&half::f16::ONE.to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn a_nan_or_infinite_scale_is_found_in_every_quantized_type() {
        for dtype in [
            DType::Q8_0,
            DType::Q4_0,
            DType::Q5_0,
            DType::Q4K,
            DType::Q5K,
            DType::Q6K,
        ] {
            let good = blocks(dtype, 5);
            assert_eq!(dtype.first_bad_scale(&good, 256), None, "{dtype}");
            for (&at, bad) in dtype
                .scale_offsets()
                .iter()
                .zip([half::f16::NAN, half::f16::INFINITY])
            {
                let mut bytes = good.clone();
                let start = 3 * dtype.block_bytes() + at;
                bytes[start..start + 2].copy_from_slice(&bad.to_le_bytes());
                let (block, value) = dtype.first_bad_scale(&bytes, 256).expect("found");
                assert_eq!(block, 3, "{dtype}");
                assert!(!value.is_finite(), "{dtype}");
            }
        }
        // Types without block scales are not scanned.
        assert_eq!(DType::F16.first_bad_scale(&[0xff; 8], 4), None);
    }

    /// A tensor large enough to be scanned on several threads reports the
    /// first bad block of the whole tensor, whichever part holds it.
    #[test]
    fn a_large_tensor_scanned_in_parts_reports_its_first_bad_block() {
        let dtype = DType::Q8_0;
        let count = PARALLEL_SCAN_BYTES / dtype.block_bytes() + 1000;
        let good = blocks(dtype, count);
        assert_eq!(dtype.first_bad_scale(&good, 256), None);
        let bad = half::f16::NAN.to_le_bytes();
        let mut bytes = good;
        let (early, late) = (count / 3, count - 2);
        bytes[late * dtype.block_bytes()..][..2].copy_from_slice(&bad);
        assert_eq!(dtype.first_bad_scale(&bytes, 256).map(|b| b.0), Some(late));
        bytes[early * dtype.block_bytes()..][..2].copy_from_slice(&bad);
        assert_eq!(dtype.first_bad_scale(&bytes, 256).map(|b| b.0), Some(early));
    }

    /// In quantized row blocks a group holds 4 rows' scales: a bad one is
    /// reported as the block of its own row, counted row after row.
    #[test]
    fn a_bad_scale_in_row_blocks_names_its_row() {
        let dtype = DType::QuantRowBlocks(QuantType::Q4_0);
        let q = QuantType::Q4_0;
        // 8 rows of 64 columns: 2 row blocks of 2 groups.
        let mut bytes = vec![0u8; 2 * 2 * q.group_bytes()];
        assert_eq!(dtype.first_bad_scale(&bytes, 64), None);
        // Row block 1, group 1, third row's scale: row 6, block 1 of it.
        let at = (2 + 1) * q.group_bytes() + 2 * 2;
        bytes[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
        let (block, _) = dtype.first_bad_scale(&bytes, 64).expect("found");
        assert_eq!(block, 6 * 2 + 1);
    }
}
