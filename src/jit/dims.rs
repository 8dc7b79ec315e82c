//! Model shape as the JIT sees it, and the two ways to read it from disk.
//!
//! `ModelDims` is deliberately a plain struct: the full `ModelConfig` lives
//! elsewhere and a `From` conversion will be added when the branches meet.

use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};

/// The shape numbers that decide which kernels are generated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelDims {
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub n_layers: usize,
    /// Gemma 3 normalises q and k per head (a second RMSNorm size).
    pub qk_norm: bool,
}

impl ModelDims {
    /// gemma-3-270m, the default model.
    pub const GEMMA3_270M: ModelDims = ModelDims {
        hidden: 640,
        intermediate: 2048,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
        vocab: 262_144,
        n_layers: 18,
        qk_norm: true,
    };

    /// Width of the attention output (input width of the o projection).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Floats between consecutive positions of one KV-cache layer, in the
    /// layout `[pos][kv_head][head_dim]`.
    pub fn kv_stride(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Rejects shapes no kernel can be generated for, naming the field.
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab", self.vocab),
        ];
        for (name, v) in fields {
            if v == 0 {
                bail!("model shape: {name} is 0; the config or GGUF metadata is incomplete");
            }
            if v > 1 << 24 {
                bail!("model shape: {name} = {v} is larger than the JIT supports (2^24)");
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "model shape: head_dim = {} must be even for split-half RoPE",
                self.head_dim
            );
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "model shape: n_heads = {} is not a multiple of n_kv_heads = {}",
                self.n_heads,
                self.n_kv_heads
            );
        }
        Ok(())
    }
}

/// Where the default model is cached.
pub fn default_model_path() -> Result<PathBuf> {
    let home = std::env::var_os("HOME")
        .ok_or_else(|| anyhow!("HOME is not set; pass the model with -m PATH"))?;
    Ok(PathBuf::from(home).join(".cache/pulsar/gemma-3-270m-q4_k_m.gguf"))
}

/// Reads dims from a `.gguf` model or a bare Hugging Face `config.json`.
pub fn load_dims(path: &Path) -> Result<ModelDims> {
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let dims = if is_json {
        dims_from_config_json(path)?
    } else {
        dims_from_gguf(path)?
    };
    dims.validate()
        .with_context(|| format!("in {}", path.display()))?;
    Ok(dims)
}

/// Minimal reader of the HF config keys the JIT needs; meant to be swapped for
/// the project's full config parser.
pub fn dims_from_config_json(path: &Path) -> Result<ModelDims> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read {}; check the path given to -m", path.display()))?;
    let root: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    // Multimodal Gemma 3 configs nest the language model under text_config.
    let cfg = root.get("text_config").unwrap_or(&root);
    let key = |k: &str| -> Result<Option<usize>> {
        match cfg.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                anyhow!(
                    "{}: key \"{k}\" must be a non-negative integer, found {v}",
                    path.display()
                )
            }),
        }
    };
    let need = |k: &str| -> Result<usize> {
        key(k)?.ok_or_else(|| {
            anyhow!(
                "{}: missing key \"{k}\"; add it to the config",
                path.display()
            )
        })
    };
    let hidden = need("hidden_size")?;
    let n_heads = need("num_attention_heads")?;
    let model_type = cfg.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
    Ok(ModelDims {
        hidden,
        intermediate: need("intermediate_size")?,
        n_heads,
        n_kv_heads: key("num_key_value_heads")?.unwrap_or(n_heads),
        head_dim: key("head_dim")?.unwrap_or(hidden / n_heads.max(1)),
        vocab: need("vocab_size")?,
        n_layers: key("num_hidden_layers")?.unwrap_or(0),
        qk_norm: model_type.starts_with("gemma3"),
    })
}

/// Reads dims from GGUF metadata keyed by `general.architecture`.
pub fn dims_from_gguf(path: &Path) -> Result<ModelDims> {
    let file = crate::model::gguf::GgufFile::open(path)
        .with_context(|| format!("cannot open model {}", path.display()))?;
    let arch = file
        .get_str("general.architecture")?
        .ok_or_else(|| anyhow!("{}: missing key general.architecture", path.display()))?
        .to_string();
    let need = |k: &str| -> Result<usize> {
        let full = format!("{arch}.{k}");
        file.get_usize(&full)?
            .ok_or_else(|| anyhow!("{}: missing metadata key {full}", path.display()))
    };
    let hidden = need("embedding_length")?;
    let n_heads = need("attention.head_count")?;
    let vocab = file
        .tensor_info("token_embd.weight")
        .and_then(|t| t.shape.first().copied())
        .ok_or_else(|| anyhow!("{}: tensor token_embd.weight not found", path.display()))?;
    Ok(ModelDims {
        hidden,
        intermediate: need("feed_forward_length")?,
        n_heads,
        n_kv_heads: file
            .get_usize(&format!("{arch}.attention.head_count_kv"))?
            .unwrap_or(n_heads),
        head_dim: file
            .get_usize(&format!("{arch}.attention.key_length"))?
            .unwrap_or(hidden / n_heads.max(1)),
        vocab,
        n_layers: file.get_usize(&format!("{arch}.block_count"))?.unwrap_or(0),
        qk_norm: arch.starts_with("gemma3"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pulsar-dims-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.json");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn reads_gemma3_text_config_and_defaults() {
        let p = write(
            "g3",
            r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text","hidden_size":640,
               "intermediate_size":2048,"num_attention_heads":4,"num_key_value_heads":1,
               "head_dim":256,"vocab_size":262144,"num_hidden_layers":18}}"#,
        );
        assert_eq!(load_dims(&p).unwrap(), ModelDims::GEMMA3_270M);
        // head_dim and kv heads default like HF does.
        let p = write(
            "defaults",
            r#"{"model_type":"gemma","hidden_size":64,"intermediate_size":128,
               "num_attention_heads":4,"vocab_size":100}"#,
        );
        let d = load_dims(&p).unwrap();
        assert_eq!((d.head_dim, d.n_kv_heads, d.qk_norm), (16, 4, false));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let p = write(
            "missing",
            r#"{"hidden_size":64,"num_attention_heads":4,"vocab_size":9}"#,
        );
        let e = format!("{:#}", load_dims(&p).unwrap_err());
        assert!(
            e.contains("intermediate_size") && e.contains("config.json"),
            "{e}"
        );
        let p = write("badtype", r#"{"hidden_size":"big"}"#);
        let e = format!("{:#}", load_dims(&p).unwrap_err());
        assert!(e.contains("hidden_size") && e.contains("integer"), "{e}");
        let p = write(
            "zero",
            r#"{"hidden_size":0,"intermediate_size":8,"num_attention_heads":1,"vocab_size":9}"#,
        );
        let e = format!("{:#}", load_dims(&p).unwrap_err());
        assert!(e.contains("hidden is 0"), "{e}");
        let e = format!(
            "{:#}",
            load_dims(Path::new("/nonexistent/config.json")).unwrap_err()
        );
        assert!(e.contains("/nonexistent/config.json"), "{e}");
    }
}
