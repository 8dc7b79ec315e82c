//! Pulsar's block decoders against gguf-py's (the llama.cpp project's Python
//! reference), on random blocks made by tools/make_quant_vectors.py.
//!
//! Equality is exact, bit for bit: both sides decode in f32 with the same
//! operation order (scale products first, e.g. (d·sc)·q − dmin·m for the
//! K-quants), and Rust does not contract a·b + c into a fused multiply-add
//! unless asked to, so there is no rounding difference to allow for.

use pulsar::model::dequant::dequantize_into;
use pulsar::model::dtype::DType;
use std::path::Path;

fn check(dtype: DType) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant_vectors");
    let read = |ext: &str| {
        let path = dir.join(format!("{dtype}.{ext}"));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let blocks = read("bin");
    let expected: Vec<f32> = read("f32")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert!(
        blocks.len().is_multiple_of(dtype.block_bytes()),
        "{dtype}: partial block"
    );
    let n_blocks = blocks.len() / dtype.block_bytes();
    assert!(n_blocks >= 8, "{dtype}: too few test blocks");
    assert_eq!(
        expected.len(),
        n_blocks * dtype.block_elems(),
        "{dtype}: sizes"
    );

    let mut got = vec![f32::NAN; expected.len()];
    dequantize_into(dtype, &blocks, &mut got);
    let mut mismatches = 0;
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        if g.to_bits() != e.to_bits() {
            if mismatches < 5 {
                eprintln!(
                    "{dtype}: block {}, element {}: got {g:e}, gguf-py says {e:e}",
                    i / dtype.block_elems(),
                    i % dtype.block_elems()
                );
            }
            mismatches += 1;
        }
    }
    assert_eq!(
        mismatches, 0,
        "{dtype}: {mismatches} values differ from gguf-py"
    );
}

#[test]
fn q8_0_matches_gguf_py() {
    check(DType::Q8_0);
}

#[test]
fn q4_0_matches_gguf_py() {
    check(DType::Q4_0);
}

#[test]
fn q5_0_matches_gguf_py() {
    check(DType::Q5_0);
}

#[test]
fn q4_k_matches_gguf_py() {
    check(DType::Q4K);
}

#[test]
fn q5_k_matches_gguf_py() {
    check(DType::Q5K);
}

#[test]
fn q6_k_matches_gguf_py() {
    check(DType::Q6K);
}
