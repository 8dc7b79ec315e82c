//! A small GGUF (version 3) writer, for tests and tools.
//!
//! It builds a whole file in memory: the header, metadata key/values, tensor
//! infos, zero padding up to the alignment, then the tensor data, each
//! tensor starting at a multiple of the alignment. The typed methods
//! ([`GgufWriter::add_u32`], [`GgufWriter::add_tensor`], …) produce valid
//! files; every field is public and [`GgufWriter::add_raw_kv`] /
//! [`GgufWriter::add_raw_tensor`] accept anything, so robustness tests can
//! build malformed files (wrong counts, unknown types, bogus offsets,
//! misaligned data) with the same code.
//!
//! ```
//! use pulsar::model::dtype::DType;
//! use pulsar::model::gguf_write::{GgufWriter, f32_bytes};
//!
//! let mut w = GgufWriter::new();
//! w.add_str("general.architecture", "gemma");
//! w.add_u32("gemma.block_count", 1);
//! w.add_tensor("output_norm.weight", &[4], DType::F32, f32_bytes(&[1.0; 4]))
//!     .unwrap();
//! let bytes = w.to_bytes();
//! assert_eq!(&bytes[..4], b"GGUF");
//! ```

use super::dtype::DType;
use super::gguf::Value;
use anyhow::{Result, bail};
use half::{bf16, f16};
use std::path::Path;

/// GGUF metadata value type ids.
pub mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata entry as it will be written: the key, the value type id and
/// the encoded value (without the type id).
#[derive(Clone, Debug)]
pub struct RawKv {
    pub key: String,
    pub type_id: u32,
    pub payload: Vec<u8>,
}

/// One tensor as it will be written.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub name: String,
    /// Dimensions in GGUF order: innermost (row length) first.
    pub dims: Vec<u64>,
    /// GGML type id (see [`DType::ggml_id`]); may be one Pulsar cannot read.
    pub type_id: u32,
    /// Offset within the data section; `None` places the tensor at the next
    /// multiple of the alignment after the previous tensor's data.
    pub offset: Option<u64>,
    /// The bytes stored at the offset. They need not match the dims and
    /// type; bytes that would start more than [`MAX_GAP`] past the end of
    /// the data written so far are dropped (the info still claims them).
    pub data: Vec<u8>,
}

/// Largest zero-filled gap the writer creates for a tensor placed at an
/// explicit offset; beyond it the tensor's data is not written.
pub const MAX_GAP: u64 = 1 << 26;

/// Builds a GGUF file. See the module documentation.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    /// The four bytes at the start, `GGUF` unless a test wants otherwise.
    pub magic: [u8; 4],
    /// Format version written in the header (3).
    pub version: u32,
    /// Alignment used to lay out the data. [`GgufWriter::set_alignment`]
    /// also records it under `general.alignment`; assigning the field alone
    /// does not.
    pub alignment: u64,
    /// Tensor count written in the header; `None` writes the real count.
    pub tensor_count_override: Option<u64>,
    /// Metadata count written in the header; `None` writes the real count.
    pub kv_count_override: Option<u64>,
    pub kvs: Vec<RawKv>,
    pub tensors: Vec<RawTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment.
    pub fn new() -> GgufWriter {
        GgufWriter {
            magic: *b"GGUF",
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            tensor_count_override: None,
            kv_count_override: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Adds a metadata entry whose value is already encoded.
    pub fn add_raw_kv(&mut self, key: &str, type_id: u32, payload: Vec<u8>) -> &mut Self {
        self.kvs.push(RawKv {
            key: key.to_string(),
            type_id,
            payload,
        });
        self
    }

    /// Adds any metadata value. An array takes its item type from its first
    /// item (an empty array is written as an array of u8) and panics if its
    /// items differ in type: use [`GgufWriter::add_raw_kv`] for such files.
    pub fn add_value(&mut self, key: &str, value: &Value) -> &mut Self {
        let mut payload = Vec::new();
        let type_id = encode_value(value, &mut payload);
        self.add_raw_kv(key, type_id, payload)
    }

    pub fn add_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.add_value(key, &Value::U32(v))
    }

    pub fn add_i32(&mut self, key: &str, v: i32) -> &mut Self {
        self.add_value(key, &Value::I32(v))
    }

    pub fn add_u64(&mut self, key: &str, v: u64) -> &mut Self {
        self.add_value(key, &Value::U64(v))
    }

    pub fn add_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.add_value(key, &Value::F32(v))
    }

    pub fn add_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.add_value(key, &Value::Bool(v))
    }

    pub fn add_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.add_value(key, &Value::Str(v.to_string()))
    }

    pub fn add_str_array<S: AsRef<str>>(&mut self, key: &str, items: &[S]) -> &mut Self {
        let items = items.iter().map(|s| Value::Str(s.as_ref().into()));
        self.add_typed_array(key, value_type::STRING, items)
    }

    pub fn add_f32_array(&mut self, key: &str, items: &[f32]) -> &mut Self {
        let items = items.iter().map(|&v| Value::F32(v));
        self.add_typed_array(key, value_type::F32, items)
    }

    pub fn add_i32_array(&mut self, key: &str, items: &[i32]) -> &mut Self {
        let items = items.iter().map(|&v| Value::I32(v));
        self.add_typed_array(key, value_type::I32, items)
    }

    fn add_typed_array(
        &mut self,
        key: &str,
        item_type: u32,
        items: impl ExactSizeIterator<Item = Value>,
    ) -> &mut Self {
        let mut payload = Vec::new();
        payload.extend_from_slice(&item_type.to_le_bytes());
        payload.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for item in items {
            encode_value(&item, &mut payload);
        }
        self.add_raw_kv(key, value_type::ARRAY, payload)
    }

    /// Sets the data alignment and records it as `general.alignment` (u32).
    pub fn set_alignment(&mut self, alignment: u32) -> &mut Self {
        self.alignment = alignment as u64;
        self.add_u32("general.alignment", alignment)
    }

    /// Adds a tensor of `shape` (outermost dimension first, as everywhere
    /// in Pulsar; a weight matrix is `[out, in]`) stored as `dtype`.
    ///
    /// Fails when `bytes` is not exactly the size the shape needs.
    pub fn add_tensor(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        bytes: Vec<u8>,
    ) -> Result<&mut Self> {
        let row = *shape.last().unwrap_or(&1);
        let rows: usize = shape[..shape.len().saturating_sub(1)].iter().product();
        let Some(row_bytes) = dtype.row_bytes(row) else {
            bail!(
                "{name}: row length {row} is not a multiple of the {dtype} block size {}",
                dtype.block_elems()
            );
        };
        if rows * row_bytes != bytes.len() {
            bail!(
                "{name}: shape {shape:?} of {dtype} needs {} bytes, got {}",
                rows * row_bytes,
                bytes.len()
            );
        }
        Ok(self.add_raw_tensor(RawTensor {
            name: name.to_string(),
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            type_id: dtype.ggml_id(),
            offset: None,
            data: bytes,
        }))
    }

    /// Adds a tensor exactly as given, without any check.
    pub fn add_raw_tensor(&mut self, tensor: RawTensor) -> &mut Self {
        self.tensors.push(tensor);
        self
    }

    /// The whole file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment.max(1);
        // Lay out the data section first: the infos need the offsets.
        let mut data: Vec<u8> = Vec::new();
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let offset = t
                .offset
                .unwrap_or_else(|| (data.len() as u64).div_ceil(align) * align);
            offsets.push(offset);
            let end = offset.saturating_add(t.data.len() as u64);
            if offset > data.len() as u64 + MAX_GAP {
                continue;
            }
            if end > data.len() as u64 {
                data.resize(end as usize, 0);
            }
            data[offset as usize..end as usize].copy_from_slice(&t.data);
        }
        if self.tensors.iter().all(|t| t.offset.is_none()) {
            data.resize(
                (data.len() as u64).div_ceil(align) as usize * align as usize,
                0,
            );
        }

        let mut out = self.header_bytes(&offsets);
        out.extend_from_slice(&data);
        out
    }

    /// The header alone (magic through the tensor infos, padded to the
    /// alignment), with the tensors at `offsets` within the data section.
    /// Lets a large file be written as header, then each tensor's data
    /// streamed after it at those offsets.
    pub fn header_bytes(&self, offsets: &[u64]) -> Vec<u8> {
        let align = self.alignment.max(1);
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        let tensor_count = self
            .tensor_count_override
            .unwrap_or(self.tensors.len() as u64);
        out.extend_from_slice(&tensor_count.to_le_bytes());
        let kv_count = self.kv_count_override.unwrap_or(self.kvs.len() as u64);
        out.extend_from_slice(&kv_count.to_le_bytes());
        for kv in &self.kvs {
            put_str(&mut out, &kv.key);
            out.extend_from_slice(&kv.type_id.to_le_bytes());
            out.extend_from_slice(&kv.payload);
        }
        for (t, offset) in self.tensors.iter().zip(offsets) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
        }
        let padded = (out.len() as u64).div_ceil(align) * align;
        out.resize(padded as usize, 0);
        out
    }

    /// Writes the file to `path`, whole or not at all.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        crate::fs_atomic::write_atomic(path, &self.to_bytes())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends the encoding of `v` to `out` and returns its type id.
fn encode_value(v: &Value, out: &mut Vec<u8>) -> u32 {
    use value_type as t;
    match v {
        Value::U8(x) => {
            out.push(*x);
            t::U8
        }
        Value::I8(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::I8
        }
        Value::U16(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::U16
        }
        Value::I16(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::I16
        }
        Value::U32(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::U32
        }
        Value::I32(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::I32
        }
        Value::U64(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::U64
        }
        Value::I64(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::I64
        }
        Value::F32(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::F32
        }
        Value::F64(x) => {
            out.extend_from_slice(&x.to_le_bytes());
            t::F64
        }
        Value::Bool(x) => {
            out.push(*x as u8);
            t::BOOL
        }
        Value::Str(s) => {
            put_str(out, s);
            t::STRING
        }
        Value::Array(items) => {
            let mut body = Vec::new();
            let mut item_type = None;
            for item in items {
                let ty = encode_value(item, &mut body);
                assert!(
                    item_type.is_none_or(|first| first == ty),
                    "GGUF arrays hold one item type; use add_raw_kv for mixed arrays"
                );
                item_type = Some(ty);
            }
            out.extend_from_slice(&item_type.unwrap_or(t::U8).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            out.extend_from_slice(&body);
            t::ARRAY
        }
    }
}

/// Little-endian f32 bytes.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Values rounded to IEEE half precision (nearest, ties to even), as bytes.
pub fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect()
}

/// Values rounded to bfloat16 (nearest, ties to even), as bytes.
pub fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect()
}

/// Q8_0 blocks of `values` (a multiple of 32 long): per block of 32, the
/// scale d = max|x| / 127 stored as f16, then q = round(x / d) as i8, as
/// llama.cpp's reference quantizer does (it divides by the unrounded d).
pub fn q8_0_bytes(values: &[f32]) -> Vec<u8> {
    assert!(
        values.len().is_multiple_of(32),
        "Q8_0 needs whole blocks of 32"
    );
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&x| (x * inv).round() as i8 as u8));
    }
    out
}

/// Q4_0 blocks of `values` (a multiple of 32 long), as llama.cpp's
/// reference quantizer makes them: per block, the value of largest
/// magnitude `m` (with its sign) gives d = m / -8, stored as f16; each
/// value becomes min(15, trunc(x / d + 8.5)), value j < 16 in the low
/// nibble of byte j, value j + 16 in its high nibble.
pub fn q4_0_bytes(values: &[f32]) -> Vec<u8> {
    assert!(
        values.len().is_multiple_of(32),
        "Q4_0 needs whole blocks of 32"
    );
    let mut out = Vec::with_capacity(values.len() / 32 * 18);
    for block in values.chunks_exact(32) {
        let max = block
            .iter()
            .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        let q = |x: f32| ((x * inv + 8.5) as i32).min(15) as u8;
        out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dequant;
    use crate::model::gguf::GgufFile;

    /// A new file's path in a fresh folder that the returned `TempDir`
    /// removes on drop, even when the test panics. A folder rather than a
    /// `NamedTempFile`: the writer makes the file itself, with its
    /// temporary beside it.
    fn temp_path(tag: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix(&format!("pulsar-gguf-write-{tag}-"))
            .tempdir()
            .unwrap();
        let path = dir.path().join(format!("{tag}.gguf"));
        (dir, path)
    }

    fn reopen(w: &GgufWriter, tag: &str) -> GgufFile {
        let (_dir, path) = temp_path(tag);
        w.write(&path).unwrap();
        GgufFile::open(&path).unwrap()
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let mut w = GgufWriter::new();
        w.add_str("general.architecture", "gemma2")
            .add_u32("gemma2.block_count", 3)
            .add_f32("gemma2.rope.freq_base", 10_000.0)
            .add_bool("flag", true)
            .add_i32("neg", -7)
            .add_u64("big", 1 << 40)
            .add_str_array("tokens", &["<pad>", "a", "ünï"])
            .add_f32_array("scores", &[0.5, -1.25])
            .add_i32_array("types", &[1, 2, 3])
            .add_value("empty", &Value::Array(vec![]));
        let a: Vec<f32> = (0..15).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        w.add_tensor("a", &[3, 5], DType::F32, f32_bytes(&a))
            .unwrap()
            .add_tensor("b", &[2, 32], DType::Q8_0, q8_0_bytes(&b))
            .unwrap()
            .add_tensor("c", &[7], DType::F16, f16_bytes(&a[..7]))
            .unwrap();
        let g = reopen(&w, "roundtrip");
        assert_eq!(g.version, 3);
        assert_eq!(g.get_str("general.architecture").unwrap(), Some("gemma2"));
        assert_eq!(g.get_usize("gemma2.block_count").unwrap(), Some(3));
        assert_eq!(g.get("gemma2.rope.freq_base"), Some(&Value::F32(10_000.0)));
        assert_eq!(g.get("flag"), Some(&Value::Bool(true)));
        assert_eq!(g.get("neg"), Some(&Value::I32(-7)));
        assert_eq!(g.get("big"), Some(&Value::U64(1 << 40)));
        assert_eq!(
            g.get_str_array("tokens").unwrap().unwrap(),
            ["<pad>", "a", "ünï"]
        );
        assert_eq!(g.get_num_array("scores").unwrap().unwrap(), [0.5, -1.25]);
        assert_eq!(g.get_num_array("types").unwrap().unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(g.get("empty"), Some(&Value::Array(vec![])));

        let ta = g.tensor("a").unwrap();
        assert_eq!((ta.shape, ta.dtype), (&[3usize, 5][..], DType::F32));
        assert_eq!(dequant::to_f32(&ta), a);
        let tb = g.tensor("b").unwrap();
        assert_eq!((tb.shape, tb.dtype), (&[2usize, 32][..], DType::Q8_0));
        // Q8_0 error is at most half a step, plus |q| ≤ 127 times the f16
        // rounding of d (relative 2^-11): 0.5 + 127/2048 < 0.57 steps.
        for (block, want) in dequant::to_f32(&tb).chunks(32).zip(b.chunks(32)) {
            let step = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for (x, y) in block.iter().zip(want) {
                assert!((x - y).abs() <= 0.57 * step, "{x} vs {y}");
            }
        }
        let tc = g.tensor("c").unwrap();
        assert_eq!(dequant::to_f32(&tc), &a[..7]);
        for t in g.tensors() {
            assert!(t.start.is_multiple_of(32), "{} is not aligned", t.name);
        }
    }

    #[test]
    fn honours_a_custom_alignment() {
        let mut w = GgufWriter::new();
        w.set_alignment(64);
        for i in 0..3 {
            w.add_tensor(
                &format!("t{i}"),
                &[3],
                DType::F32,
                f32_bytes(&[i as f32; 3]),
            )
            .unwrap();
        }
        let bytes = w.to_bytes();
        assert!(bytes.len().is_multiple_of(64));
        let g = reopen(&w, "align");
        for (i, t) in g.tensors().iter().enumerate() {
            assert!(t.start.is_multiple_of(64));
            assert_eq!(dequant::to_f32(&g.tensor(&t.name).unwrap()), [i as f32; 3]);
        }
    }

    #[test]
    fn rejects_wrong_sizes_but_raw_entries_pass_through() {
        let mut w = GgufWriter::new();
        assert!(w.add_tensor("x", &[2, 3], DType::F32, vec![0; 20]).is_err());
        assert!(
            w.add_tensor("q", &[2, 30], DType::Q8_0, vec![0; 68])
                .is_err()
        );
        w.add_raw_tensor(RawTensor {
            name: "bogus".into(),
            dims: vec![4],
            type_id: 0,
            offset: Some(1 << 40),
            data: vec![1; 16],
        });
        w.tensor_count_override = Some(5);
        let bytes = w.to_bytes();
        assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), 5);
        // The far-away data was not written: the file is only the header.
        assert!(bytes.len() < 128);
        let (_dir, path) = temp_path("bogus");
        w.write(&path).unwrap();
        let err = GgufFile::open(&path)
            .err()
            .expect("malformed file rejected");
        assert!(format!("{err:#}").contains("tensors"), "{err:#}");
    }
    #[test]
    fn q4_0_blocks_dequantize_within_half_a_step() {
        let values: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let bytes = q4_0_bytes(&values);
        assert_eq!(bytes.len(), 3 * 18);
        let shape = [1, 96];
        let t = crate::model::dtype::TensorView {
            dtype: DType::Q4_0,
            shape: &shape,
            bytes: &bytes,
        };
        let mut back = vec![0.0f32; 96];
        dequant::row_into(&t, 0, &mut back);
        for (block, got) in values.chunks(32).zip(back.chunks(32)) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 8.0;
            for (&x, &y) in block.iter().zip(got) {
                // Half a step of rounding, plus the f16 rounding of d; the
                // codes run from -8 to 7 steps, so a value on the side
                // opposite the largest one may be clipped by up to a step.
                let clipped = x.abs() > 7.0 * step;
                let allowed = if clipped { step } else { step * 0.5 };
                assert!((x - y).abs() <= allowed + amax * 2e-3, "{x} -> {y}");
            }
        }
    }
}
