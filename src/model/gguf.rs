//! GGUF reader (versions 2 and 3), memory-mapped.
//!
//! Layout: magic `GGUF`, version, tensor count, metadata count, the metadata
//! key/value pairs, the tensor infos, padding to `general.alignment`, then the
//! tensor data. Every length, count and offset read from the file is checked
//! against the bytes that are really there before anything is allocated, so a
//! truncated or hostile file gives an error instead of a panic or a huge
//! allocation.

use super::dtype::{DType, TensorView};
use anyhow::{Context, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML supports at most four dimensions.
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float (integers convert).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value's debug form cut to a length that fits in a one-line error
    /// (a mistyped key may hold a 262,144-entry vocabulary).
    pub fn brief(&self) -> String {
        const MAX: usize = 80;
        let full = match self {
            Value::Array(items) if items.len() > 8 => {
                format!("[{} items: {:?}, …]", items.len(), &items[..3])
            }
            _ => format!("{self:?}"),
        };
        match full.char_indices().nth(MAX) {
            Some((cut, _)) => format!("{}…", &full[..cut]),
            None => full,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Outermost dimension first (GGUF stores the innermost first; we reverse).
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

/// The bytes a [`GgufFile`] or a safetensors file reads from: a read-only
/// memory map of the file, or bytes already in memory (tests and fuzzing
/// parse without touching the file system).
pub(crate) enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// Maps `path` read-only, with errors that name the file. A directory or a
/// special file is refused before mapping so the message says what is wrong.
pub(crate) fn map_file(path: &Path) -> Result<Bytes> {
    let p = path.display();
    let file = File::open(path).with_context(|| format!("{p}: cannot open"))?;
    let meta = file
        .metadata()
        .with_context(|| format!("{p}: cannot read its metadata"))?;
    if meta.is_dir() {
        anyhow::bail!("{p}: is a directory, not a model file");
    }
    if !meta.is_file() {
        anyhow::bail!("{p}: is not a regular file");
    }
    // Mapping an empty file fails on some systems; an empty buffer parses
    // the same way (and fails as truncated).
    if meta.len() == 0 {
        return Ok(Bytes::Owned(Vec::new()));
    }
    // SAFETY: the map is read-only; a file changed underneath us while
    // mapped can give wrong values but every access is bounds-checked.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("{p}: cannot memory-map"))?;
    Ok(Bytes::Mapped(map))
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Bytes,
    pub version: u32,
    metadata: HashMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl GgufFile {
    /// Maps and parses `path`. Fails with a message naming the file on any
    /// malformation.
    pub fn open(path: &Path) -> Result<GgufFile> {
        Self::parse(path, map_file(path)?)
    }

    /// Parses a GGUF file already in memory; `path` only names it in
    /// messages. The same checks apply as for [`GgufFile::open`].
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(path, Bytes::Owned(bytes))
    }

    fn parse(path: &Path, map: Bytes) -> Result<GgufFile> {
        let fail = |what: String| anyhow::anyhow!("{}: {}", path.display(), what);
        let mut cur = Cursor {
            bytes: &map,
            pos: 0,
        };
        let magic = cur.take(4).map_err(&fail)?;
        if magic != MAGIC {
            return Err(fail(format!(
                "not a GGUF file (magic {:02x?}, expected \"GGUF\")",
                magic
            )));
        }
        let version = cur.u32().map_err(&fail)?;
        if version != 2 && version != 3 {
            return Err(fail(format!(
                "unsupported GGUF version {version} (Pulsar reads versions 2 and 3)"
            )));
        }
        let tensor_count = cur.u64().map_err(&fail)?;
        let kv_count = cur.u64().map_err(&fail)?;

        let mut metadata = HashMap::new();
        for i in 0..kv_count {
            let key = cur
                .string()
                .map_err(|e| fail(format!("metadata entry {i}: key: {e}")))?;
            let ty = cur
                .u32()
                .map_err(|e| fail(format!("metadata {key:?}: {e}")))?;
            let value = cur
                .value(ty, 0)
                .map_err(|e| fail(format!("metadata {key:?}: {e}")))?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(fail(format!("metadata key {key:?} appears twice")));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(fail(format!(
                        "general.alignment must be a power of two up to 1 MiB, found {}",
                        v.brief()
                    )));
                }
            },
        };

        // Each tensor info takes at least 8 (name len) + 4 + 4 + 8 bytes.
        if tensor_count > (cur.remaining() / 24) as u64 {
            return Err(fail(format!(
                "header claims {tensor_count} tensors, more than the file can hold (truncated?)"
            )));
        }
        // Reserve for at most a few thousand infos up front: the count is a
        // claim, the infos that really parse are what the vector grows to.
        let mut raw_infos = Vec::with_capacity((tensor_count as usize).min(RESERVE_CAP));
        for i in 0..tensor_count {
            let name = cur
                .string()
                .map_err(|e| fail(format!("tensor info {i}: name: {e}")))?;
            let tfail = |e: String| fail(format!("tensor {name:?}: {e}"));
            let n_dims = cur.u32().map_err(tfail)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(tfail(format!(
                    "{n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})"
                )));
            }
            let mut shape = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = cur.u64().map_err(tfail)?;
                let d = usize::try_from(d)
                    .ok()
                    .filter(|&d| d > 0 && d <= 1 << 40)
                    .ok_or_else(|| tfail(format!("dimension {d} is zero or absurd")))?;
                shape.push(d);
            }
            shape.reverse();
            let type_id = cur.u32().map_err(tfail)?;
            if type_id == crate::model::dtype::RETIRED_Q5_0_ROW_BLOCKS_ID {
                return Err(tfail(
                    "Q5_0 row blocks in the layout of an earlier pulsar convert, which this version no longer reads; convert the model again with this version".into(),
                ));
            }
            let dtype = DType::from_ggml_id(type_id).ok_or_else(|| {
                tfail(format!(
                    "tensor type {} (id {type_id}) is not supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K",
                    DType::ggml_name(type_id)
                ))
            })?;
            let offset = cur.u64().map_err(tfail)?;
            raw_infos.push((name, shape, dtype, offset));
        }

        let data_start = match align_up(cur.pos as u64, alignment) {
            Some(start) if start <= map.len() as u64 => start,
            // A file without tensors (llama.cpp's vocabulary-only GGUFs) may
            // end right after the metadata, without padding to a data section.
            Some(_) if raw_infos.is_empty() => map.len() as u64,
            _ => {
                return Err(fail(
                    "file ends before the tensor data section (truncated?)".into(),
                ));
            }
        };
        let data_len = map.len() as u64 - data_start;

        let mut tensors = Vec::with_capacity(raw_infos.len());
        let mut by_name = HashMap::new();
        for (name, shape, dtype, offset) in raw_infos {
            let tfail = |e: String| fail(format!("tensor {name:?}: {e}"));
            let elems = shape
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| tfail(format!("element count of shape {shape:?} overflows")))?;
            let row = *shape.last().unwrap_or(&1);
            // A row-blocked tensor is a matrix, or a stack of them (experts,
            // AltUp's projections) each of whole row blocks, so that one
            // matrix's rows are one run of bytes.
            if let Some(block_rows) = dtype.rows_per_block() {
                let stacked_whole = shape.len() == 3 && shape[1] % block_rows == 0;
                if shape.len() != 2 && !stacked_whole {
                    return Err(tfail(format!(
                        "a {dtype} tensor must be a matrix or a stack of matrices of whole {block_rows}-row blocks, not of shape {shape:?}"
                    )));
                }
            }
            let row_bytes = dtype.row_bytes(row).ok_or_else(|| {
                tfail(format!(
                    "row length {row} is not a multiple of the {dtype} block size {}",
                    dtype.block_elems()
                ))
            })?;
            let len = if dtype.is_row_blocked() {
                // Rows and columns padded to whole blocks and groups.
                dtype
                    .row_blocked_len(elems / row.max(1), row)
                    .map(|n| n as u64)
            } else {
                (row_bytes as u64).checked_mul((elems / row.max(1)) as u64)
            }
            .ok_or_else(|| tfail("byte size overflows".into()))?;
            if offset % alignment != 0 {
                return Err(tfail(format!(
                    "data offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if offset.checked_add(len).is_none_or(|end| end > data_len) {
                return Err(tfail(format!(
                    "data [{offset}, +{len}) runs past the end of the file's data section ({data_len} bytes; truncated?)"
                )));
            }
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(tfail("appears twice".into()));
            }
            tensors.push(TensorInfo {
                name,
                shape,
                dtype,
                start: (data_start + offset) as usize,
                len: len as usize,
            });
        }

        let mut order: Vec<&TensorInfo> = tensors.iter().collect();
        order.sort_by_key(|t| t.start);
        for pair in order.windows(2) {
            if pair[0].start + pair[0].len > pair[1].start {
                return Err(fail(format!(
                    "tensors {:?} and {:?} overlap",
                    pair[0].name, pair[1].name
                )));
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version,
            metadata,
            tensors,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn wrong_type(&self, key: &str, want: &str, v: &Value) -> anyhow::Error {
        anyhow::anyhow!(
            "{}: metadata {key:?} should be {want}, found {} {}",
            self.path.display(),
            v.type_name(),
            v.brief()
        )
    }

    /// An unsigned integer key, `None` when absent, an error when mistyped.
    pub fn get_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "an unsigned integer", v)),
        }
    }

    /// A float key, `None` when absent, an error when mistyped.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a number", v)),
        }
    }

    /// A string key, `None` when absent, an error when mistyped.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a string", v)),
        }
    }

    /// A required key, with an error naming file and key when absent.
    pub fn require_usize(&self, key: &str) -> Result<usize> {
        self.get_usize(key)?.ok_or_else(|| {
            anyhow::anyhow!("{}: metadata key {key:?} is missing", self.path.display())
        })
    }

    /// An array of strings (for example the tokenizer vocabulary).
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.wrong_type(key, "an array of strings", v));
        };
        items
            .iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| self.wrong_type(key, "an array of strings", v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An array of numbers, converted to f64.
    pub fn get_num_array(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.wrong_type(key, "an array of numbers", v));
        };
        items
            .iter()
            .map(|x| {
                x.as_f64()
                    .ok_or_else(|| self.wrong_type(key, "an array of numbers", v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A borrowed view of the tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensor_info(name).map(|t| TensorView {
            dtype: t.dtype,
            shape: &t.shape,
            bytes: &self.map[t.start..t.start + t.len],
        })
    }
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_add(alignment - 1)
        .map(|v| v / alignment * alignment)
}

/// Bounds-checked little-endian reads over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// Most entries reserved ahead of parsing them (see the uses).
const RESERVE_CAP: usize = 4096;

/// Arrays nested deeper than this are refused (GGUF files use one level).
const MAX_NESTING: u32 = 4;

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "needs {n} bytes at offset {} but the file ends at {} (truncated?)",
                self.pos,
                self.bytes.len()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.remaining())
            .ok_or_else(|| {
                format!(
                    "string length {len} at offset {} exceeds the {} bytes left (truncated or corrupt)",
                    self.pos - 8,
                    self.remaining()
                )
            })?;
        let s = self.take(len)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| format!("string at offset {} is not valid UTF-8", self.pos - len))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("bool byte {b} is neither 0 nor 1")),
            },
            8 => Value::Str(self.string()?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err("arrays nested too deeply".into());
                }
                let item_ty = self.u32()?;
                let count = self.u64()?;
                let min_size = match item_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => return Err(format!("unknown array item type {item_ty}")),
                };
                let count = usize::try_from(count)
                    .ok()
                    .filter(|&c| c <= self.remaining() / min_size)
                    .ok_or_else(|| {
                        format!(
                            "array of {count} items cannot fit in the {} bytes left (truncated or corrupt)",
                            self.remaining()
                        )
                    })?;
                // A `Value` is 32 bytes even for a one-byte item, so reserving
                // the claimed count would allocate 32 times the bytes present;
                // reserve a bounded amount and grow with the items parsed.
                let mut items = Vec::with_capacity(count.min(RESERVE_CAP));
                for _ in 0..count {
                    items.push(self.value(item_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            _ => return Err(format!("unknown value type {ty}")),
        })
    }
}
