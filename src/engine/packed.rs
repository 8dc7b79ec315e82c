//! Weight matrices in the kernels' layout: row-major 16-bit floats, FP16 or
//! BF16, either owned (converted at load) or borrowed zero-copy from a
//! memory-mapped file that already stores them that way.

use crate::model::dequant;
use crate::model::dtype::{DType, TensorView};
use anyhow::{Result, bail};
use half::{bf16, f16};
use memmap2::MmapMut;
use std::sync::Arc;

/// The 16-bit format of packed weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F16,
    BF16,
}

impl WeightFormat {
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F16 => "f16",
            WeightFormat::BF16 => "bf16",
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            WeightFormat::F16 => DType::F16,
            WeightFormat::BF16 => DType::BF16,
        }
    }

    /// The format a tensor of `dtype` is packed to by default: BF16 stays
    /// BF16 (lossless); everything else becomes FP16.
    pub fn default_for(dtype: DType) -> WeightFormat {
        match dtype {
            DType::BF16 => WeightFormat::BF16,
            _ => WeightFormat::F16,
        }
    }

    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            WeightFormat::F16 => f16::from_bits(bits).to_f32(),
            WeightFormat::BF16 => bf16::from_bits(bits).to_f32(),
        }
    }

    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            WeightFormat::F16 => f16::from_f32(v).to_bits(),
            WeightFormat::BF16 => bf16::from_f32(v).to_bits(),
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
        ptr: *const u16,
    },
    /// Zero-copy: values inside a mapped model file that already stores
    /// them in this layout.
    Mapped {
        /// Held only to keep the mapping alive.
        _owner: Arc<dyn Send + Sync>,
        ptr: *const u16,
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
}

/// Anonymous memory of `bytes`, advised for transparent huge pages where
/// the kernel offers them, starting on a 2 MiB boundary (only whole,
/// aligned 2 MiB ranges can become huge pages).
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

    /// Bytes a matrix of `len` 16-bit values takes in the arena.
    pub fn footprint(len: usize) -> usize {
        (len * 2).next_multiple_of(64)
    }

    /// A fresh, zeroed region for `len` values, 64-byte aligned.
    fn alloc(&self, len: usize) -> *mut u16 {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let at = *next;
        let size = Self::footprint(len);
        assert!(at + size <= self.capacity, "weight arena sized too small");
        *next += size;
        // SAFETY: inside the map; each region is handed out once, and the
        // map's memory is not otherwise borrowed.
        unsafe { self.map.as_ptr().add(self.start + at) as *mut u16 }
    }
}

impl PackedMatrix {
    pub fn from_values(format: WeightFormat, rows: usize, cols: usize, data: Vec<u16>) -> Self {
        assert_eq!(data.len(), rows * cols);
        let mut m = Self::zeroed(format, rows, cols);
        m.values_mut().copy_from_slice(&data);
        m
    }

    /// A matrix of zeros in its own huge-page-advised memory, to be filled
    /// with [`PackedMatrix::values_mut`].
    pub fn zeroed(format: WeightFormat, rows: usize, cols: usize) -> Self {
        let (mut map, start) = huge_page_map(rows * cols * 2);
        map[start..start + rows * cols * 2].fill(0);
        PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Owned { map, start },
        }
    }

    /// The values of an owned matrix, for filling it.
    pub fn values_mut(&mut self) -> &mut [u16] {
        let len = self.rows * self.cols;
        match &mut self.storage {
            // SAFETY: the map holds 2·len bytes from `start`, aligned.
            Storage::Owned { map, start } => unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(*start).cast(), len)
            },
            _ => panic!("only an owned matrix can be filled"),
        }
    }

    /// Converts any stored tensor to `format` into memory of its own.
    pub fn convert(t: &TensorView<'_>, format: WeightFormat) -> PackedMatrix {
        let (rows, cols) = t.matrix_dims();
        let mut m = Self::zeroed(format, rows, cols);
        fill_converted(t, format, m.values_mut());
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
        let ptr = arena.alloc(rows * cols);
        // SAFETY: a fresh region of rows·cols values that nothing else
        // refers to yet.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr, rows * cols) };
        fill_converted(t, format, out);
        PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Arena {
                _arena: arena.clone(),
                ptr,
            },
        }
    }

    /// Uses a tensor stored as FP16/BF16 inside a mapped file in place.
    /// `owner` must own the memory `t` points into.
    pub fn borrowed(owner: Arc<dyn Send + Sync>, t: &TensorView<'_>) -> Result<PackedMatrix> {
        let format = match t.dtype {
            DType::F16 => WeightFormat::F16,
            DType::BF16 => WeightFormat::BF16,
            other => bail!("a {other} tensor cannot be used in place"),
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
        })
    }

    /// Whether the values are used in place from a mapped file.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// All `rows * cols` values, row-major.
    pub fn data(&self) -> &[u16] {
        let len = self.rows * self.cols;
        let ptr: *const u16 = match &self.storage {
            // SAFETY: `start` is inside the map.
            Storage::Owned { map, start } => unsafe { map.as_ptr().add(*start).cast() },
            Storage::Arena { ptr, .. } | Storage::Mapped { ptr, .. } => *ptr,
        };
        // SAFETY: every storage holds `len` aligned u16 values that live as
        // long as `self` (the Arcs keep arenas and mappings alive).
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    pub fn row(&self, r: usize) -> &[u16] {
        &self.data()[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(self.row(r)) {
            *o = self.format.to_f32(b);
        }
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.cols * 2
    }
}

/// Writes `t` converted to `format` into `out` (a tensor already in that
/// format is copied bit for bit), on every core for large tensors.
fn fill_converted(t: &TensorView<'_>, format: WeightFormat, out: &mut [u16]) {
    let (rows, cols) = t.matrix_dims();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Below a million values a thread costs more than it saves.
    if threads < 2 || rows * cols < 1 << 20 {
        return fill_rows(t, format, 0, out);
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(per * cols).enumerate() {
            s.spawn(move || fill_rows(t, format, i * per, part));
        }
    });
}

/// Converts rows `first..` of `t` into `out` (whole rows), releasing the
/// source pages as it goes so that peak memory stays near the size of the
/// result.
fn fill_rows(t: &TensorView<'_>, format: WeightFormat, first_row: usize, out: &mut [u16]) {
    let (rows, cols) = t.matrix_dims();
    let row_bytes = t.bytes.len() / rows.max(1);
    // Rows per release: about 4 MB of source at a time.
    let group = ((4 << 20) / row_bytes.max(1)).max(1);
    let mut row = vec![0.0f32; cols];
    for (g, dst_rows) in out.chunks_mut(group * cols.max(1)).enumerate() {
        let first = first_row + g * group;
        for (i, dst) in dst_rows.chunks_exact_mut(cols.max(1)).enumerate() {
            let r = first + i;
            if t.dtype == format.dtype() {
                let src = &t.bytes[r * row_bytes..(r + 1) * row_bytes];
                for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = u16::from_le_bytes([c[0], c[1]]);
                }
            } else {
                dequant::row_into(t, r, &mut row);
                for (d, &v) in dst.iter_mut().zip(&row) {
                    *d = format.from_f32(v);
                }
            }
        }
        let done = first * row_bytes..(first + dst_rows.len() / cols.max(1)) * row_bytes;
        TensorView {
            bytes: &t.bytes[done],
            ..*t
        }
        .release_pages();
    }
}
