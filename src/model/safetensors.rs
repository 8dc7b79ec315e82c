//! safetensors reader, memory-mapped: an 8-byte little-endian header length,
//! a JSON header `{name: {dtype, shape, data_offsets: [begin, end]}}`, then
//! the data. Offsets are relative to the end of the header. Every offset is
//! checked against the real file size and the shape's byte size.

use super::dtype::{DType, TensorView};
use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Headers beyond this size are refused (the format caps them at 100 MB).
const MAX_HEADER: u64 = 100_000_000;

struct Entry {
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

/// One open `.safetensors` file.
pub struct SafetensorsFile {
    path: PathBuf,
    map: Mmap,
    entries: HashMap<String, Entry>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        let p = path.display();
        let file = File::open(path).with_context(|| format!("{p}: cannot open"))?;
        // SAFETY: read-only map; all accesses below are bounds-checked.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("{p}: cannot memory-map"))?;
        if map.len() < 8 {
            bail!(
                "{p}: {} bytes is too short for a safetensors header (truncated?)",
                map.len()
            );
        }
        let header_len = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
        if header_len > MAX_HEADER || header_len > map.len() as u64 - 8 {
            bail!(
                "{p}: header length {header_len} runs past the end of the {}-byte file (truncated or not safetensors)",
                map.len()
            );
        }
        let data_start = 8 + header_len as usize;
        let header: Value = serde_json::from_slice(&map[8..data_start])
            .map_err(|e| anyhow::anyhow!("{p}: header is not valid JSON: {e}"))?;
        let Value::Object(header) = header else {
            bail!("{p}: header must be a JSON object");
        };
        let data_len = map.len() - data_start;
        let mut entries = HashMap::new();
        let mut spans = Vec::new();
        for (name, info) in &header {
            if name == "__metadata__" {
                continue;
            }
            let entry = parse_entry(info, data_start, data_len)
                .map_err(|e| anyhow::anyhow!("{p}: tensor {name:?}: {e}"))?;
            spans.push((entry.start, entry.len, name.clone()));
            entries.insert(name.clone(), entry);
        }
        spans.sort();
        for pair in spans.windows(2) {
            if pair[0].0 + pair[0].1 > pair[1].0 {
                bail!("{p}: tensors {:?} and {:?} overlap", pair[0].2, pair[1].2);
            }
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            map,
            entries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.entries.get(name).map(|e| TensorView {
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.map[e.start..e.start + e.len],
        })
    }
}

fn parse_entry(info: &Value, data_start: usize, data_len: usize) -> Result<Entry, String> {
    let dtype = match info.get("dtype").and_then(|d| d.as_str()) {
        Some("F32") => DType::F32,
        Some("F16") => DType::F16,
        Some("BF16") => DType::BF16,
        Some(other) => {
            return Err(format!(
                "dtype {other} is not supported (Pulsar reads F32, F16, BF16)"
            ));
        }
        None => return Err("has no dtype string".into()),
    };
    let shape = info
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or("has no shape list")?
        .iter()
        .map(|d| {
            d.as_u64()
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| format!("shape entry {d} is not a non-negative integer"))
        })
        .collect::<Result<Vec<usize>, String>>()?;
    if shape.len() > 8 {
        return Err(format!(
            "{} dimensions is more than allowed (8)",
            shape.len()
        ));
    }
    let offsets = info
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .ok_or("data_offsets must be a list of two integers")?;
    let (begin, end) = match (offsets[0].as_u64(), offsets[1].as_u64()) {
        (Some(b), Some(e)) if b <= e => (b, e),
        _ => return Err("data_offsets must be two ascending non-negative integers".into()),
    };
    let elems = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("element count of shape {shape:?} overflows"))?;
    let want = elems
        .checked_mul(dtype.block_bytes())
        .ok_or("byte size overflows")?;
    if end - begin != want as u64 {
        return Err(format!(
            "data_offsets span {} bytes but shape {shape:?} of {dtype} needs {want}",
            end - begin
        ));
    }
    if end > data_len as u64 {
        return Err(format!(
            "data [{begin}, {end}) runs past the end of the data ({data_len} bytes; truncated?)"
        ));
    }
    Ok(Entry {
        dtype,
        shape,
        start: data_start + begin as usize,
        len: want,
    })
}
