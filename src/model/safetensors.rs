//! safetensors reader, memory-mapped: an 8-byte little-endian header length,
//! a JSON header `{name: {dtype, shape, data_offsets: [begin, end]}}`, then
//! the data. Offsets are relative to the end of the header. Every offset is
//! checked against the real file size and the shape's byte size.

use super::dtype::{DType, TensorView};
use super::gguf::{Bytes, map_file};
use anyhow::{Result, bail};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::collections::HashMap;
use std::fmt;
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
    map: Bytes,
    entries: HashMap<String, Entry>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        Self::parse(path, map_file(path)?)
    }

    /// Parses a safetensors file already in memory; `path` only names it in
    /// messages. The same checks apply as for [`SafetensorsFile::open`].
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<SafetensorsFile> {
        Self::parse(path, Bytes::Owned(bytes))
    }

    fn parse(path: &Path, map: Bytes) -> Result<SafetensorsFile> {
        let p = path.display();
        if map.len() < 8 {
            bail!(
                "{p}: {} bytes is too short for a safetensors header (truncated?)",
                map.len()
            );
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&map[..8]);
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER || header_len > map.len() as u64 - 8 {
            bail!(
                "{p}: header length {header_len} runs past the end of the {}-byte file (truncated or not safetensors)",
                map.len()
            );
        }
        let data_start = 8 + header_len as usize;
        let header_bytes = &map[8..data_start];
        // Check it is JSON at all first, for the plainer message.
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(header_bytes) {
            bail!("{p}: header is not valid JSON: {e}");
        }
        let HeaderEntries(header) = serde_json::from_slice(header_bytes)
            .map_err(|e| anyhow::anyhow!("{p}: header must be a JSON object of tensors: {e}"))?;
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
            if entries.insert(name.clone(), entry).is_some() {
                bail!("{p}: tensor {name:?} appears twice in the header");
            }
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

/// The header's entries in file order with duplicates kept: a plain
/// `serde_json` map would silently keep the last of two equal names.
struct HeaderEntries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for HeaderEntries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeaderEntries, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Value>()? {
                    out.push(entry);
                }
                Ok(HeaderEntries(out))
            }
        }
        d.deserialize_map(EntriesVisitor)
    }
}

fn parse_entry(info: &Value, data_start: usize, data_len: usize) -> Result<Entry, String> {
    let dtype = match info.get("dtype").and_then(|d| d.as_str()) {
        Some("F32") => DType::F32,
        Some("F16") => DType::F16,
        Some("BF16") => DType::BF16,
        // Index tables (a Gemma 4 assistant's token ordering).
        Some("I32") => DType::I32,
        Some("I64") => DType::I64,
        Some(other) => {
            return Err(format!(
                "dtype {other} is not supported (Pulsar reads F32, F16, BF16, and I32, I64 for indices)"
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
