//! Model shape as the JIT sees it: the few numbers that decide which
//! kernels are generated, taken from the full `ModelConfig`.

use crate::model::config::ModelConfig;
use anyhow::{Result, bail};

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
    /// The head size of layers whose heads differ from `head_dim` (Gemma
    /// 4's global layers: 512 beside 256), or 0: its attention and q/k
    /// norm get kernels of their own.
    pub other_head_dim: usize,
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
        other_head_dim: 0,
    };

    /// Width of the attention output (input width of the o projection).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of the K and V projections (all KV heads of one position).
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

/// Reads dims from anything `-m` accepts: a `.gguf` file, a Hugging Face
/// folder, or a bare `config.json` (shape only: no weights needed), through
/// the same model description the engines use.
impl From<&ModelConfig> for ModelDims {
    fn from(c: &ModelConfig) -> ModelDims {
        ModelDims {
            hidden: c.hidden,
            intermediate: c.intermediate,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            n_layers: c.n_layers(),
            qk_norm: c.has_qk_norm(),
            other_head_dim: (0..c.n_layers())
                .map(|i| c.shape(i).head_dim)
                .find(|&h| h != c.head_dim)
                .unwrap_or(0),
        }
    }
}
