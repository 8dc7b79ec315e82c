//! What the fuzz targets in `fuzz/` run on each input, kept in the library
//! so that `tests/fuzz_regressions.rs` replays saved crashing inputs through
//! exactly the same code. Each function must return normally for any input;
//! a panic (including a failed assertion below) is a finding.

use crate::model::config::ModelConfig;
use crate::model::dequant;
use crate::model::gguf::GgufFile;
use crate::model::safetensors::SafetensorsFile;
use crate::model::source::ModelSource;
use crate::model::weights::{F32Matrix, ModelWeights};
use crate::tokenizer::{SPACE_MARK, Tokenizer};
use std::path::Path;

/// Bytes as a GGUF file: parse, then (when it parses) dequantize every
/// tensor, read the tokenizer and encode and decode with it, then the model
/// description and every weight the description calls for.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(Path::new("fuzz.gguf"), data.to_vec()) else {
        return;
    };
    for info in file.tensors() {
        let view = file.tensor(&info.name).expect("a listed tensor has a view");
        assert_eq!(view.bytes.len(), info.len, "{}: byte length", info.name);
        assert_eq!(dequant::to_f32(&view).len(), view.elems());
    }
    if let Ok(tok) = Tokenizer::from_gguf(&file) {
        exercise(&tok);
    }
    let Ok(src) = ModelSource::from_gguf(file) else {
        return;
    };
    let _ = ModelWeights::load(&src, |_, t| Ok(F32Matrix::from_view(&t)));
}

/// Encodes and decodes with a tokenizer built from hostile input (no byte
/// tokens, NaN scores, odd control pieces): no panic, ids in range.
fn exercise(tok: &Tokenizer) {
    let ids = tok.encode("<bos>Hi <start_of_turn>wörld  \n\t日本 ▁x", true);
    assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    let _ = tok.decode_with_control(&ids);
    let every: Vec<u32> = (0..tok.vocab_size().min(512) as u32).collect();
    let _ = tok.decode(&every);
}

/// Bytes as a Hugging Face tokenizer file: with an even first byte the
/// rest is a `tokenizer.json`, with an odd one a SentencePiece
/// `tokenizer.model`. A tokenizer that loads is then used.
pub fn hf_tokenizer(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let loaded = if kind % 2 == 0 {
        Tokenizer::from_tokenizer_json_bytes(rest, "fuzz/tokenizer.json")
    } else {
        Tokenizer::from_sentencepiece_bytes(rest, "fuzz/tokenizer.model", None)
    };
    if let Ok(tok) = loaded {
        exercise(&tok);
    }
}

/// Bytes as a safetensors file: parse, then dequantize every tensor.
pub fn safetensors(data: &[u8]) {
    let Ok(file) = SafetensorsFile::from_bytes(Path::new("fuzz.safetensors"), data.to_vec()) else {
        return;
    };
    let names: Vec<String> = file.names().map(str::to_owned).collect();
    for name in names {
        let view = file.tensor(&name).expect("a listed name has a tensor");
        assert_eq!(view.bytes.len(), view.elems() * view.dtype.block_bytes());
        assert_eq!(dequant::to_f32(&view).len(), view.elems());
    }
}

/// Bytes as a Hugging Face `config.json`; an accepted config must pass its
/// own validation.
pub fn hf_config(data: &[u8]) {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let path = Path::new("fuzz/config.json");
    if let Ok(config) = ModelConfig::from_hf_json(&json, path) {
        config.validate(path).expect("an accepted config is valid");
        assert!(config.n_layers() > 0);
    }
}

/// Bytes as tokenizer input. The first byte picks the mode:
/// - even: the rest, as UTF-8 text (invalid sequences replaced), is encoded
///   with and without control tokens (with BOS when bit 1 is set); every id
///   must be in the vocabulary and decoding with control text must give the
///   input back, except for text holding `▁`, which the decoder turns into a
///   space by design;
/// - odd: the rest, as little-endian u32 ids (a few past the vocabulary on
///   purpose), is decoded at once and one id at a time; both must agree.
pub fn tokenizer(tok: &Tokenizer, data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let vocab = tok.vocab_size() as u32;
    if mode % 2 == 0 {
        let text = String::from_utf8_lossy(rest);
        let bos = mode & 2 != 0;
        for with_control in [true, false] {
            let ids = if with_control {
                tok.encode(&text, bos)
            } else {
                tok.encode_untrusted(&text, bos)
            };
            assert!(ids.iter().all(|&id| id < vocab), "id out of range");
            if !text.contains(SPACE_MARK) {
                let bos_text = if bos {
                    tok.token_text(tok.bos_id()).unwrap_or_default()
                } else {
                    ""
                };
                assert_eq!(
                    tok.decode_with_control(&ids),
                    format!("{bos_text}{text}"),
                    "round trip (control tokens parsed: {with_control})"
                );
            }
        }
    } else {
        let ids: Vec<u32> = rest
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % (vocab + 16))
            .collect();
        let whole = tok.decode(&ids);
        let mut stream = tok.stream_decoder();
        let mut pieces = String::new();
        for &id in &ids {
            pieces.push_str(&stream.push(id));
        }
        pieces.push_str(&stream.finish());
        assert_eq!(whole, pieces, "stream and whole decoding differ");
        let _ = tok.decode_with_control(&ids);
    }
}
