//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `../shared/oracle` beside the repository: the HF reference data.
pub fn oracle_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle");
    assert!(
        dir.is_dir(),
        "the oracle folder {} is missing: tests need ../shared/oracle beside the repository",
        dir.display()
    );
    dir
}

/// A raw little-endian f32 file.
pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}: not whole f32s", path.display());
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// Largest |a - b| and where it occurs.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> (f32, usize) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut worst = (0.0f32, 0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = (x - y).abs();
        if d > worst.0 || d.is_nan() {
            worst = (if d.is_nan() { f32::INFINITY } else { d }, i);
        }
    }
    worst
}
