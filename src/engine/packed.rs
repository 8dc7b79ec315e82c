//! Weight matrices in the kernels' layout: row-major 16-bit floats, FP16 or
//! BF16, either owned (converted at load) or borrowed zero-copy from a
//! memory-mapped file that already stores them that way.

use crate::model::dequant;
use crate::model::dtype::{DType, TensorView};
use anyhow::{Result, bail};
use half::{bf16, f16};
use memmap2::Mmap;
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

enum Storage {
    Owned(Vec<u16>),
    /// `len` u16 values at byte `offset` of a mapped file (2-byte aligned).
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
    },
}

pub struct PackedMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
}

impl PackedMatrix {
    pub fn from_values(format: WeightFormat, rows: usize, cols: usize, data: Vec<u16>) -> Self {
        assert_eq!(data.len(), rows * cols);
        PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Owned(data),
        }
    }

    /// Converts any stored tensor to `format`. A tensor already in that
    /// format is copied bit for bit.
    pub fn convert(t: &TensorView<'_>, format: WeightFormat) -> PackedMatrix {
        let (rows, cols) = t.matrix_dims();
        let data = if t.dtype == format.dtype() {
            t.bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        } else {
            let mut row = vec![0.0f32; cols];
            let mut out = Vec::with_capacity(rows * cols);
            for r in 0..rows {
                dequant::row_into(t, r, &mut row);
                out.extend(row.iter().map(|&v| format.from_f32(v)));
            }
            out
        };
        Self::from_values(format, rows, cols, data)
    }

    /// Borrows a tensor stored as FP16/BF16 inside `map` without copying.
    pub fn mapped(map: Arc<Mmap>, t: &TensorView<'_>) -> Result<PackedMatrix> {
        let format = match t.dtype {
            DType::F16 => WeightFormat::F16,
            DType::BF16 => WeightFormat::BF16,
            other => bail!("a {other} tensor cannot be used zero-copy"),
        };
        let offset = t.bytes.as_ptr() as usize - map.as_ptr() as usize;
        if !offset.is_multiple_of(2) || offset + t.bytes.len() > map.len() {
            bail!("tensor data is misaligned or outside its file");
        }
        let (rows, cols) = t.matrix_dims();
        Ok(PackedMatrix {
            format,
            rows,
            cols,
            storage: Storage::Mapped { map, offset },
        })
    }

    /// All `rows * cols` values, row-major.
    pub fn data(&self) -> &[u16] {
        match &self.storage {
            Storage::Owned(v) => v,
            Storage::Mapped { map, offset } => {
                let bytes = &map[*offset..*offset + self.rows * self.cols * 2];
                // SAFETY: 2-byte alignment and bounds checked in `mapped`;
                // any bit pattern is a valid u16.
                unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), self.rows * self.cols) }
            }
        }
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
