//! Weight matrices in the kernels' layout: 16-bit floats, FP16 or BF16, in
//! row blocks (`model::row_blocks`), or the file's own Q8_0 blocks regrouped
//! into row blocks (`model::quant_blocks`); either owned (converted at load)
//! or borrowed zero-copy from a memory-mapped file that already stores them
//! that way (written by `pulsar convert`).

#[cfg(doc)]
use super::kernels::MatKernels;
use super::kernels::MatrixKernels;
use crate::model::dequant;
use crate::model::dtype::{DType, TensorView};
use crate::model::gguf_write::{q4_0_bytes, q8_0_bytes};
use crate::model::k_quant_as_q5_0;
use crate::model::quant_blocks::{self, QuantType};
use crate::model::row_blocks;
use anyhow::{Result, bail};
use half::{bf16, f16};
use memmap2::MmapMut;
use std::sync::Arc;

/// The format of packed weights: 16-bit floats, or Q8_0 blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F16,
    BF16,
    /// GGUF's Q8_0 (8-bit quants, an f16 scale per 32), read by the
    /// integer kernels.
    Q8_0,
    /// GGUF's Q5_0 (5-bit quants, an f16 scale per 32), read by the
    /// integer kernels.
    Q5_0,
    /// GGUF's Q4_0 (4-bit quants, an f16 scale per 32), read by the
    /// integer kernels.
    Q4_0,
    /// Q8_0 in 16-row blocks (see [`QuantType::Q8_0x16`]): how Q8_0 is
    /// stored where the JIT runs.
    Q8_0x16,
    /// Q5_0 in 16-row blocks (see [`QuantType::Q5_0x16`]): how Q5_0 is
    /// stored where the integer kernels use AVX-512 VNNI.
    Q5_0x16,
    /// GGUF's Q4_K in 16-row blocks at its own bits (see
    /// [`QuantType::Q4Kx16`]).
    Q4Kx16,
    /// GGUF's Q6_K in 16-row blocks at its own bits (see
    /// [`QuantType::Q6Kx16`]).
    Q6Kx16,
    /// GGUF's Q5_K in 16-row blocks at its own bits (see
    /// [`QuantType::Q5Kx16`]).
    Q5Kx16,
}

impl WeightFormat {
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F16 => "f16",
            WeightFormat::BF16 => "bf16",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q8_0x16 => "q8_0x16",
            WeightFormat::Q5_0x16 => "q5_0x16k",
            WeightFormat::Q4Kx16 => "q4_k",
            WeightFormat::Q6Kx16 => "q6_k",
            WeightFormat::Q5Kx16 => "q5_k",
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            WeightFormat::F16 => DType::F16,
            WeightFormat::BF16 => DType::BF16,
            WeightFormat::Q8_0 | WeightFormat::Q8_0x16 => DType::Q8_0,
            WeightFormat::Q5_0 | WeightFormat::Q5_0x16 => DType::Q5_0,
            WeightFormat::Q4_0 => DType::Q4_0,
            WeightFormat::Q4Kx16 => DType::Q4K,
            WeightFormat::Q6Kx16 => DType::Q6K,
            WeightFormat::Q5Kx16 => DType::Q5K,
        }
    }

    /// The quantized block type of this format, if it is one.
    pub fn quant(self) -> Option<QuantType> {
        match self {
            WeightFormat::Q8_0 => Some(QuantType::Q8_0),
            WeightFormat::Q5_0 => Some(QuantType::Q5_0),
            WeightFormat::Q4_0 => Some(QuantType::Q4_0),
            WeightFormat::Q8_0x16 => Some(QuantType::Q8_0x16),
            WeightFormat::Q5_0x16 => Some(QuantType::Q5_0x16),
            WeightFormat::Q4Kx16 => Some(QuantType::Q4Kx16),
            WeightFormat::Q6Kx16 => Some(QuantType::Q6Kx16),
            WeightFormat::Q5Kx16 => Some(QuantType::Q5Kx16),
            _ => None,
        }
    }

    /// The format that keeps a tensor of `dtype` as it is, where a kernel
    /// family reads it.
    pub fn native(dtype: DType) -> Option<WeightFormat> {
        match dtype {
            DType::Q8_0 | DType::QuantRowBlocks(QuantType::Q8_0) => Some(WeightFormat::Q8_0),
            DType::QuantRowBlocks(QuantType::Q8_0x16) => Some(WeightFormat::Q8_0x16),
            DType::QuantRowBlocks(QuantType::Q5_0x16) => Some(WeightFormat::Q5_0x16),
            DType::Q5_0 | DType::QuantRowBlocks(QuantType::Q5_0) => Some(WeightFormat::Q5_0),
            DType::Q4_0 | DType::QuantRowBlocks(QuantType::Q4_0) => Some(WeightFormat::Q4_0),
            DType::Q4K | DType::QuantRowBlocks(QuantType::Q4Kx16) => Some(WeightFormat::Q4Kx16),
            DType::Q6K | DType::QuantRowBlocks(QuantType::Q6Kx16) => Some(WeightFormat::Q6Kx16),
            DType::Q5K | DType::QuantRowBlocks(QuantType::Q5Kx16) => Some(WeightFormat::Q5Kx16),
            _ => None,
        }
    }

    /// The format of a quantized block type.
    pub fn of_quant(q: QuantType) -> WeightFormat {
        match q {
            QuantType::Q8_0 => WeightFormat::Q8_0,
            QuantType::Q5_0 => WeightFormat::Q5_0,
            QuantType::Q4_0 => WeightFormat::Q4_0,
            QuantType::Q8_0x16 => WeightFormat::Q8_0x16,
            QuantType::Q5_0x16 => WeightFormat::Q5_0x16,
            QuantType::Q4Kx16 => WeightFormat::Q4Kx16,
            QuantType::Q6Kx16 => WeightFormat::Q6Kx16,
            QuantType::Q5Kx16 => WeightFormat::Q5Kx16,
        }
    }

    /// Whether a matrix of file type `source` stored in this format takes
    /// an offset per row and 32 columns: a Q4_K or Q5_K one kept as Q5_0
    /// (`model::k_quant_as_q5_0`).
    pub fn takes_offsets(self, source: DType) -> bool {
        matches!(self, WeightFormat::Q5_0 | WeightFormat::Q5_0x16)
            && k_quant_as_q5_0::converts(source)
    }

    /// Offsets of a `rows x cols` matrix that takes them: one per row and
    /// 32 columns.
    pub fn offsets_len(rows: usize, cols: usize) -> usize {
        rows * (cols / quant_blocks::GROUP_COLS)
    }

    /// Whether values are stored one 16-bit float each.
    pub fn is_16bit(self) -> bool {
        matches!(self, WeightFormat::F16 | WeightFormat::BF16)
    }

    /// The file type of matrices already in this format and layout, which
    /// can be used in place.
    pub fn row_blocked_dtype(self) -> DType {
        match self {
            WeightFormat::F16 => DType::F16RowBlocks,
            WeightFormat::BF16 => DType::BF16RowBlocks,
            WeightFormat::Q8_0
            | WeightFormat::Q5_0
            | WeightFormat::Q4_0
            | WeightFormat::Q8_0x16
            | WeightFormat::Q5_0x16
            | WeightFormat::Q4Kx16
            | WeightFormat::Q6Kx16
            | WeightFormat::Q5Kx16 => {
                DType::QuantRowBlocks(self.quant().expect("a quantized format"))
            }
        }
    }

    /// Bytes a `rows x cols` matrix takes in this format's layout.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        match self.quant() {
            Some(q) => q.matrix_bytes(rows, cols),
            None => row_blocks::padded_len(rows, cols) * 2,
        }
    }

    /// The format a tensor of `dtype` is packed to by default: BF16 stays
    /// BF16 (lossless); everything else becomes FP16.
    pub fn default_for(dtype: DType) -> WeightFormat {
        match dtype {
            DType::BF16 | DType::BF16RowBlocks => WeightFormat::BF16,
            _ => WeightFormat::F16,
        }
    }

    /// One 16-bit value (BF16 bits for BF16, FP16 bits otherwise).
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            WeightFormat::BF16 => bf16::from_bits(bits).to_f32(),
            _ => f16::from_bits(bits).to_f32(),
        }
    }

    /// The 16-bit bits of `v` (BF16 for BF16, FP16 otherwise).
    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            WeightFormat::BF16 => bf16::from_f32(v).to_bits(),
            _ => f16::from_f32(v).to_bits(),
        }
    }
}

/// Where a matrix's values live.
enum Storage {
    /// Converted at load into anonymous memory advised for huge pages
    /// (a decode step streams every page once; fewer TLB misses help);
    /// the values start `start` bytes in, on a 2 MiB boundary.
    Owned { map: MmapMut, start: usize },
    /// Converted at load into a shared [`WeightArena`].
    Arena {
        /// Held only to keep the arena alive.
        _arena: Arc<WeightArena>,
        ptr: *const u8,
    },
    /// Zero-copy: values inside a mapped model file that already stores
    /// them in this layout.
    Mapped {
        /// Held only to keep the mapping alive.
        _owner: Arc<dyn Send + Sync>,
        ptr: *const u8,
    },
}

// SAFETY: the pointers target memory kept alive by the Arc beside them
// (itself Send + Sync) and never written after load.
unsafe impl Send for Storage {}
unsafe impl Sync for Storage {}

pub struct PackedMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
    /// Per row and 32 columns, a value added to each of them: a Q4_K or
    /// Q5_K matrix kept as Q5_0 (`model::k_quant_as_q5_0`). A product adds
    /// `offset · d_x · sum(q_x)` after the kernel. Laid out in blocks of
    /// [`OFFSET_BLOCK_ROWS`] rows, group-major within a block
    /// ([`offset_index`]), so one vector holds a group's offsets for 8
    /// rows.
    offsets: Option<Box<[f32]>>,
    /// The kernels that multiply it, resolved when an engine's kernels
    /// meet its weights.
    kernels: MatrixKernels,
}

/// Anonymous memory of `bytes`, advised for transparent huge pages where
/// the kernel offers them, starting on a 2 MiB boundary (only whole,
/// aligned 2 MiB ranges can become huge pages).
///
/// The advice costs some load time (huge pages come from free 2 MiB
/// blocks, which a VM may have handed back to its host, so each is backed
/// afresh) and pays it back in decode, about 8% faster on the default
/// model. Faulting the arena in ahead from a thread of its own loads no
/// faster: the faults contend rather than overlap.
fn huge_page_map(bytes: usize) -> (MmapMut, usize) {
    const HUGE: usize = 2 << 20;
    let map = MmapMut::map_anon(bytes.max(1) + HUGE).expect("anonymous memory for weights");
    #[cfg(target_os = "linux")]
    {
        // Advice only: a kernel without THP simply ignores it.
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    let start = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
    (map, start)
}

/// One huge-page-advised mapping that all converted matrices of a model
/// are carved from, back to back. Matrices smaller than a huge page (most
/// of a small model's) would otherwise each sit on 4 KiB pages, which
/// measured half the GEMV speed of huge-page-backed ones here.
pub struct WeightArena {
    map: MmapMut,
    start: usize,
    capacity: usize,
    next: std::sync::Mutex<usize>,
}

impl WeightArena {
    /// Room for matrices totalling `bytes` (each rounded up to 64 bytes).
    pub fn new(bytes: usize) -> Arc<WeightArena> {
        let (map, start) = huge_page_map(bytes);
        Arc::new(WeightArena {
            map,
            start,
            capacity: bytes,
            next: std::sync::Mutex::new(0),
        })
    }

    /// Bytes a `rows x cols` matrix of `format` takes in the arena.
    pub fn footprint(format: WeightFormat, rows: usize, cols: usize) -> usize {
        format.matrix_bytes(rows, cols).next_multiple_of(64)
    }

    /// A fresh, zeroed region for a `rows x cols` matrix, 64-byte aligned.
    fn alloc(&self, format: WeightFormat, rows: usize, cols: usize) -> *mut u8 {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let at = *next;
        let size = Self::footprint(format, rows, cols);
        assert!(at + size <= self.capacity, "weight arena sized too small");
        *next += size;
        // SAFETY: inside the map; each region is handed out once, and the
        // map's memory is not otherwise borrowed.
        unsafe { self.map.as_ptr().add(self.start + at) as *mut u8 }
    }
}

impl PackedMatrix {
    /// A matrix from row-major values.
    pub fn from_values(format: WeightFormat, rows: usize, cols: usize, data: Vec<u16>) -> Self {
        let mut m = Self::zeroed(format, rows, cols);
        m.values_mut()
            .copy_from_slice(&row_blocks::from_row_major(&data, rows, cols));
        m
    }

    /// A matrix of zeros in its own huge-page-advised memory, to be filled
    /// with [`PackedMatrix::values_mut`] (16-bit) or
    /// [`PackedMatrix::bytes_mut`].
    pub fn zeroed(format: WeightFormat, rows: usize, cols: usize) -> Self {
        let bytes = format.matrix_bytes(rows, cols);
        let (mut map, start) = huge_page_map(bytes);
        map[start..start + bytes].fill(0);
        PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Owned { map, start },
            offsets: None,
            kernels: MatrixKernels::default(),
        }
    }

    /// The values of an owned 16-bit matrix in the row-block layout, for
    /// filling it.
    pub fn values_mut(&mut self) -> &mut [u16] {
        assert!(
            self.format.is_16bit(),
            "values of a {} matrix",
            self.format.name()
        );
        let len = self.byte_len() / 2;
        // SAFETY: the bytes start 2 MiB-aligned, so they are u16-aligned.
        unsafe { std::slice::from_raw_parts_mut(self.bytes_mut().as_mut_ptr().cast(), len) }
    }

    /// The bytes of an owned matrix in its layout, for filling it.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.byte_len();
        match &mut self.storage {
            // SAFETY: the map holds `len` bytes from `start`.
            Storage::Owned { map, start } => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(*start), len)
            },
            _ => panic!("only an owned matrix can be filled"),
        }
    }

    /// Converts any stored tensor to `format` into memory of its own.
    pub fn convert(t: &TensorView<'_>, format: WeightFormat) -> PackedMatrix {
        let (rows, cols) = t.matrix_dims();
        let mut m = Self::zeroed(format, rows, cols);
        let mut offsets = offsets_for(t, format);
        fill_converted(t, format, m.bytes_mut(), offsets.as_deref_mut());
        m.offsets = offsets.map(|o| offsets_in_blocks(&o, rows, cols));
        m
    }

    /// Converts any stored tensor to `format` into the next region of
    /// `arena`.
    pub fn convert_into(
        t: &TensorView<'_>,
        format: WeightFormat,
        arena: &Arc<WeightArena>,
    ) -> Self {
        let (rows, cols) = t.matrix_dims();
        let ptr = arena.alloc(format, rows, cols);
        // SAFETY: a fresh region of the matrix's bytes that nothing else
        // refers to yet.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr, format.matrix_bytes(rows, cols)) };
        let mut offsets = offsets_for(t, format);
        fill_converted(t, format, out, offsets.as_deref_mut());
        let offsets = offsets.map(|o| offsets_in_blocks(&o, rows, cols));
        PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Arena {
                _arena: arena.clone(),
                ptr,
            },
            offsets,
            kernels: MatrixKernels::default(),
        }
    }

    /// Uses a tensor stored in the row-block layout inside a mapped file in
    /// place. `owner` must own the memory `t` points into.
    pub fn borrowed(owner: Arc<dyn Send + Sync>, t: &TensorView<'_>) -> Result<PackedMatrix> {
        let format = match t.dtype {
            DType::F16RowBlocks => WeightFormat::F16,
            DType::BF16RowBlocks => WeightFormat::BF16,
            DType::QuantRowBlocks(q) => WeightFormat::of_quant(q),
            other => bail!(
                "a {other} tensor cannot be used in place (only files written by `pulsar convert` can)"
            ),
        };
        if !(t.bytes.as_ptr() as usize).is_multiple_of(2) {
            bail!("tensor data is not 2-byte aligned");
        }
        let (rows, cols) = t.matrix_dims();
        Ok(PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Mapped {
                _owner: owner,
                ptr: t.bytes.as_ptr().cast(),
            },
            offsets: None,
            kernels: MatrixKernels::default(),
        })
    }

    /// The kernels resolved for it (none before an engine's kernels have
    /// met it, and none for plain-Rust kernels).
    pub fn kernels(&self) -> MatrixKernels {
        self.kernels
    }

    /// Keeps the kernels that multiply it (see [`MatKernels::resolve`]).
    pub fn set_kernels(&mut self, kernels: MatrixKernels) {
        self.kernels = kernels;
    }

    /// Whether the values are used in place from a mapped file.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// Bytes in the layout, padding included.
    fn byte_len(&self) -> usize {
        self.format.matrix_bytes(self.rows, self.cols)
    }

    /// The matrix's bytes in its layout, padding included.
    pub fn raw(&self) -> &[u8] {
        let ptr: *const u8 = match &self.storage {
            // SAFETY: `start` is inside the map.
            Storage::Owned { map, start } => unsafe { map.as_ptr().add(*start) },
            Storage::Arena { ptr, .. } | Storage::Mapped { ptr, .. } => *ptr,
        };
        // SAFETY: every storage holds the layout's bytes, which live as long
        // as `self` (the Arcs keep arenas and mappings alive).
        unsafe { std::slice::from_raw_parts(ptr, self.byte_len()) }
    }

    /// All values of a 16-bit matrix in the row-block layout, padding
    /// included.
    pub fn data(&self) -> &[u16] {
        assert!(
            self.format.is_16bit(),
            "values of a {} matrix",
            self.format.name()
        );
        let raw = self.raw();
        // SAFETY: 16-bit matrices start 2-byte aligned (arena regions are
        // 64-byte aligned, mapped ones are checked at load).
        unsafe { std::slice::from_raw_parts(raw.as_ptr().cast(), raw.len() / 2) }
    }

    /// The values added per row and 32 columns (see the field).
    pub fn offsets(&self) -> Option<&[f32]> {
        self.offsets.as_deref()
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        if let Some(q) = self.format.quant() {
            quant_blocks::dequant_row(q, self.raw(), r, self.cols, out);
            if let Some(offsets) = self.offsets() {
                let groups = self.cols / quant_blocks::GROUP_COLS;
                for (g, block) in out.chunks_mut(quant_blocks::GROUP_COLS).enumerate() {
                    let offset = offsets[offset_index(r, g, groups)];
                    block.iter_mut().for_each(|v| *v += offset);
                }
            }
            return;
        }
        let data = self.data();
        for (g, part) in out[..self.cols]
            .chunks_mut(row_blocks::GROUP_COLS)
            .enumerate()
        {
            let at = row_blocks::index(r, g * row_blocks::GROUP_COLS, self.cols);
            for (o, &b) in part.iter_mut().zip(&data[at..]) {
                *o = self.format.to_f32(b);
            }
        }
    }

    /// Bytes a product streams: the values with their padding, and the
    /// offsets.
    pub fn bytes(&self) -> usize {
        self.byte_len() + self.offsets().map_or(0, |o| o.len() * 4)
    }
}

/// Rows per block of a matrix's offsets.
pub const OFFSET_BLOCK_ROWS: usize = 8;

/// Where row `r`'s offset for group `g` of `groups` is kept: blocks of
/// [`OFFSET_BLOCK_ROWS`] rows, each group's offsets for the block's rows
/// side by side.
pub fn offset_index(r: usize, g: usize, groups: usize) -> usize {
    (r / OFFSET_BLOCK_ROWS * groups + g) * OFFSET_BLOCK_ROWS + r % OFFSET_BLOCK_ROWS
}

/// Row-major offsets (`rows` x groups, as the conversion writes them) in
/// the blocked layout, the last block's missing rows zero.
fn offsets_in_blocks(row_major: &[f32], rows: usize, cols: usize) -> Box<[f32]> {
    let groups = cols / quant_blocks::GROUP_COLS;
    let mut blocked = vec![0.0f32; rows.next_multiple_of(OFFSET_BLOCK_ROWS) * groups];
    for (r, row) in row_major.chunks_exact(groups).enumerate() {
        for (g, &offset) in row.iter().enumerate() {
            blocked[offset_index(r, g, groups)] = offset;
        }
    }
    blocked.into_boxed_slice()
}

/// Room for the offsets of `t` stored as `format`, if it takes any: a
/// Q4_K or Q5_K matrix kept as Q5_0.
fn offsets_for(t: &TensorView<'_>, format: WeightFormat) -> Option<Box<[f32]>> {
    let (rows, cols) = t.matrix_dims();
    format
        .takes_offsets(t.dtype)
        .then(|| vec![0.0f32; WeightFormat::offsets_len(rows, cols)].into_boxed_slice())
}

/// Writes `t` converted to `format` into `out` (a tensor already in that
/// format is copied bit for bit), and a K-quant's offsets into `offsets`,
/// on every core for large tensors.
fn fill_converted(
    t: &TensorView<'_>,
    format: WeightFormat,
    out: &mut [u8],
    offsets: Option<&mut [f32]>,
) {
    let (rows, cols) = t.matrix_dims();
    let groups = cols / quant_blocks::GROUP_COLS;
    let fill = |first_row: usize, part: &mut [u8], offsets: Option<&mut [f32]>| {
        if let Some(q) = format.quant() {
            fill_quant_rows(t, q, first_row, part, offsets);
        } else {
            // SAFETY: arena regions and owned maps start 64-byte aligned and
            // every part is whole row blocks of u16 values.
            let values = unsafe {
                std::slice::from_raw_parts_mut(part.as_mut_ptr().cast::<u16>(), part.len() / 2)
            };
            fill_rows(t, format, first_row, values);
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Below a million values a thread costs more than it saves.
    if threads < 2 || rows * cols < 1 << 20 {
        return fill(0, out, offsets);
    }
    // Parts of whole row blocks, which are contiguous in every layout.
    let per = rows.div_ceil(threads).next_multiple_of(
        format
            .quant()
            .map_or(row_blocks::BLOCK_ROWS, |q| q.block_rows()),
    );
    let part_len = format.matrix_bytes(per, cols);
    let mut offset_parts: Vec<Option<&mut [f32]>> = match offsets {
        Some(o) => o.chunks_mut(per * groups).map(Some).collect(),
        None => Vec::new(),
    };
    offset_parts.resize_with(out.len().div_ceil(part_len), || None);
    std::thread::scope(|s| {
        for (i, (part, offsets)) in out.chunks_mut(part_len).zip(offset_parts).enumerate() {
            s.spawn(move || fill(i * per, part, offsets));
        }
    });
}

/// Regroups rows `first_row..` of a quantized tensor into row blocks of
/// the same type (nothing requantized), releasing the source pages as it
/// goes. A Q4_K or Q5_K tensor becomes Q5_0 with `offsets` (rows
/// `first_row..`, see `model::k_quant_as_q5_0`).
fn fill_quant_rows(
    t: &TensorView<'_>,
    q: QuantType,
    first_row: usize,
    out: &mut [u8],
    mut offsets: Option<&mut [f32]>,
) {
    let (rows, cols) = t.matrix_dims();
    if t.dtype == DType::QuantRowBlocks(q) {
        // Already in this layout (a converted file loaded without --mmap):
        // the same bytes, padding rows included.
        let at = first_row / q.block_rows() * q.block_bytes(cols);
        let source = TensorView {
            bytes: &t.bytes[at..at + out.len()],
            ..*t
        };
        out.copy_from_slice(source.bytes);
        source.release_pages();
        return;
    }
    // The same type in another layout (a converted file's 4-row blocks,
    // for a 16-row kernel): the same blocks, regrouped.
    let other_layout = match t.dtype {
        DType::QuantRowBlocks(from) if from != q && from.file_dtype() == q.file_dtype() => {
            Some(from)
        }
        _ => None,
    };
    // The file's own blocks are copied; another type (one no kernel reads,
    // or `--dtype q8_0|q4_0`) is quantized from its exact f32 values.
    let same_type = t.dtype == q.file_dtype() || other_layout.is_some();
    let k_quant = WeightFormat::of_quant(q).takes_offsets(t.dtype);
    // Q5_0 kept as Q8_0 (its family left out of a full plan) moves no value.
    let widen_q5_0 = t.dtype == DType::Q5_0 && q.is_q8_0();
    let quantize = match q {
        _ if same_type || k_quant || widen_q5_0 => None,
        QuantType::Q8_0 | QuantType::Q8_0x16 => Some(q8_0_bytes as fn(&[f32]) -> Vec<u8>),
        QuantType::Q4_0 => Some(q4_0_bytes as fn(&[f32]) -> Vec<u8>),
        QuantType::Q5_0 | QuantType::Q5_0x16 => panic!("a {} tensor cannot become q5_0", t.dtype),
        QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16 => {
            panic!("a {} tensor cannot become {}", t.dtype, q.name())
        }
    };
    let groups = cols / quant_blocks::GROUP_COLS;
    let mut q5_0_row = vec![
        0u8;
        if k_quant {
            groups * k_quant_as_q5_0::Q5_0_BLOCK_BYTES
        } else {
            0
        }
    ];
    let mut values = vec![0.0f32; if same_type { 0 } else { cols }];
    let row_bytes = t.bytes.len() / rows.max(1);
    let block_bytes = q.block_bytes(cols);
    let block_rows = q.block_rows();
    // About 4 MB of source per release, whole row blocks.
    let group = ((4 << 20) / row_bytes.max(1))
        .max(1)
        .next_multiple_of(block_rows);
    for (g, dst) in out.chunks_mut(group / block_rows * block_bytes).enumerate() {
        let first = first_row + g * group;
        let last = (first + dst.len() / block_bytes * block_rows).min(rows);
        for r in first..last {
            match quantize {
                None if k_quant => {
                    let row_offsets = match offsets.as_deref_mut() {
                        Some(o) => &mut o[(r - first_row) * groups..(r - first_row + 1) * groups],
                        None => panic!("a {} matrix kept as q5_0 needs its offsets", t.dtype),
                    };
                    let src = &t.bytes[r * row_bytes..(r + 1) * row_bytes];
                    k_quant_as_q5_0::row_as_q5_0(t.dtype, src, &mut q5_0_row, row_offsets);
                    quant_blocks::scatter_row(q, dst, r - first, cols, &q5_0_row);
                }
                None if widen_q5_0 => {
                    let src = &t.bytes[r * row_bytes..(r + 1) * row_bytes];
                    let blocks = quant_blocks::q5_0_row_as_q8_0(src);
                    quant_blocks::scatter_row(q, dst, r - first, cols, &blocks);
                }
                None => {
                    let regrouped;
                    let src = match other_layout {
                        Some(from) => {
                            regrouped = quant_blocks::file_row(from, t.bytes, r, cols);
                            &regrouped[..]
                        }
                        None => &t.bytes[r * row_bytes..(r + 1) * row_bytes],
                    };
                    quant_blocks::scatter_row(q, dst, r - first, cols, src);
                }
                Some(quantize) => {
                    dequant::row_into(t, r, &mut values);
                    let blocks = quantize(&values);
                    quant_blocks::scatter_row(q, dst, r - first, cols, &blocks);
                }
            }
        }
        TensorView {
            bytes: &t.bytes[first * row_bytes..last * row_bytes],
            ..*t
        }
        .release_pages();
    }
}

/// Converts rows `first_row..` of `t` into `out`, whole row blocks of the
/// layout from `first_row` (a multiple of 4) on, releasing the source pages
/// as it goes so that peak memory stays near the size of the result.
fn fill_rows(t: &TensorView<'_>, format: WeightFormat, first_row: usize, out: &mut [u16]) {
    let (rows, cols) = t.matrix_dims();
    let row_bytes = t.bytes.len() / rows.max(1);
    let block_len = row_blocks::BLOCK_ROWS * row_blocks::padded_cols(cols);
    // Rows per release: about 4 MB of source at a time, whole blocks.
    let group = ((4 << 20) / row_bytes.max(1))
        .max(1)
        .next_multiple_of(row_blocks::BLOCK_ROWS);
    let mut row = vec![0.0f32; cols];
    let mut bits = vec![0u16; cols];
    let group_len = group / row_blocks::BLOCK_ROWS * block_len.max(1);
    for (g, dst) in out.chunks_mut(group_len).enumerate() {
        let first = first_row + g * group;
        let last = (first + dst.len() / block_len.max(1) * row_blocks::BLOCK_ROWS).min(rows);
        let source = if t.dtype == format.row_blocked_dtype() {
            // Already in this layout: whole blocks, padding included.
            let block_bytes = block_len * 2;
            let blocks = first / row_blocks::BLOCK_ROWS * block_bytes
                ..last.div_ceil(row_blocks::BLOCK_ROWS) * block_bytes;
            for (d, c) in dst.iter_mut().zip(t.bytes[blocks.clone()].chunks_exact(2)) {
                *d = u16::from_le_bytes([c[0], c[1]]);
            }
            blocks
        } else {
            for r in first..last {
                if t.dtype == format.dtype() {
                    let src = &t.bytes[r * row_bytes..(r + 1) * row_bytes];
                    for (d, c) in bits.iter_mut().zip(src.chunks_exact(2)) {
                        *d = u16::from_le_bytes([c[0], c[1]]);
                    }
                } else {
                    dequant::row_into(t, r, &mut row);
                    for (d, &v) in bits.iter_mut().zip(&row) {
                        *d = format.from_f32(v);
                    }
                }
                row_blocks::scatter_row(dst, r - first, cols, &bits);
            }
            first * row_bytes..last * row_bytes
        };
        TensorView {
            bytes: &t.bytes[source],
            ..*t
        }
        .release_pages();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Converts an f32 matrix and reads every row back.
    fn round_trip(rows: usize, cols: usize) {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 8.0)
            .collect();
        // The conversion releases source pages as it goes: keep the
        // expectation apart from the bytes it reads.
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let shape = [rows, cols];
        let t = TensorView {
            dtype: DType::F32,
            shape: &shape,
            bytes: &bytes,
        };
        let m = PackedMatrix::convert(&t, WeightFormat::F16);
        assert_eq!(m.bytes(), row_blocks::padded_len(rows, cols) * 2);
        let mut row = vec![0.0f32; cols];
        for r in 0..rows {
            m.row_f32(r, &mut row);
            for (c, (&got, &want)) in row.iter().zip(&values[r * cols..]).enumerate() {
                // These values are multiples of 1/8 below 8: exact in f16.
                assert_eq!(got, want, "{rows}x{cols}: row {r} column {c}");
            }
        }
    }

    #[test]
    fn small_odd_matrices_convert_into_row_blocks() {
        round_trip(6, 13);
        round_trip(1, 1);
    }

    /// A matrix already in the quantized row blocks (a converted file read
    /// without --mmap) is copied byte for byte, also when its rows are
    /// split between threads.
    #[test]
    fn quantized_row_blocks_are_copied_as_they_are() {
        // Over a million values and a row count that is not a multiple of
        // 4 (a padding row in the last block).
        let (rows, cols) = (1031, 1024);
        let values: Vec<u8> = (0..rows * cols)
            .flat_map(|i| (((i * 37 % 101) as f32 - 50.0) / 8.0).to_le_bytes())
            .collect();
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let shape = [rows, cols];
            let f32_view = TensorView {
                dtype: DType::F32,
                shape: &shape,
                bytes: &values,
            };
            let first = PackedMatrix::convert(&f32_view, format);
            let stored = first.raw().to_vec();
            let blocked = TensorView {
                dtype: format.row_blocked_dtype(),
                shape: &shape,
                bytes: &stored,
            };
            let again = PackedMatrix::convert(&blocked, format);
            assert!(
                again.raw() == first.raw(),
                "{}: bytes differ",
                format.name()
            );
        }
    }

    #[test]
    fn large_matrices_convert_on_several_threads() {
        // Over a million values (the threaded path), a row count that is
        // not a multiple of 4, and columns that are not a multiple of 8.
        round_trip(1030, 1021);
    }
}
