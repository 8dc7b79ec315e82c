//! The model's weights, gathered by role and shape-checked against the
//! config. Generic over the matrix storage so each engine keeps weights in
//! its own layout (f32 for the reference pass, FP16/BF16 for the kernels).

use super::dequant;
use super::dtype::TensorView;
use super::source::{LayerRole, ModelSource, Role};
use anyhow::Result;

/// RMSNorm weights are kept as the final multiplier (the `1 + w` of HF
/// checkpoints already added).
pub type NormWeights = Vec<f32>;

pub struct LayerWeights<M> {
    pub attn_norm: NormWeights,
    pub attn_post_norm: Option<NormWeights>,
    pub ffn_norm: NormWeights,
    pub ffn_post_norm: Option<NormWeights>,
    pub q_norm: Option<NormWeights>,
    pub k_norm: Option<NormWeights>,
    pub q: M,
    pub k: M,
    pub v: M,
    pub o: M,
    pub gate: M,
    pub up: M,
    pub down: M,
}

pub struct ModelWeights<M> {
    /// `[vocab, hidden]`; also the LM head (Gemma ties them).
    pub embedding: M,
    pub final_norm: NormWeights,
    pub layers: Vec<LayerWeights<M>>,
}

impl<M> ModelWeights<M> {
    /// Collects every tensor the config calls for; `matrix` converts each
    /// weight matrix (given its role and view) into the engine's layout.
    pub fn load(
        src: &ModelSource,
        mut matrix: impl FnMut(Role, TensorView<'_>) -> Result<M>,
    ) -> Result<Self> {
        let c = &src.config;
        let norm = |role: Role, len: usize| -> Result<NormWeights> {
            let t = src.tensor(role, &[len])?;
            Ok(dequant::to_f32(&t)
                .into_iter()
                .map(|w| w + c.norm_weight_offset)
                .collect())
        };
        let optional_norm = |role: Role, len: usize, wanted: bool| -> Result<Option<NormWeights>> {
            if wanted {
                norm(role, len).map(Some)
            } else {
                Ok(None)
            }
        };
        let q_rows = c.n_heads * c.head_dim;
        let kv_rows = c.n_kv_heads * c.head_dim;
        let mut layers = Vec::with_capacity(c.n_layers());
        for i in 0..c.n_layers() {
            let l = |r: LayerRole| Role::Layer(i, r);
            let mut mat = |r: LayerRole, rows: usize, cols: usize| -> Result<M> {
                matrix(l(r), src.tensor(l(r), &[rows, cols])?)
            };
            layers.push(LayerWeights {
                q: mat(LayerRole::Q, q_rows, c.hidden)?,
                k: mat(LayerRole::K, kv_rows, c.hidden)?,
                v: mat(LayerRole::V, kv_rows, c.hidden)?,
                o: mat(LayerRole::O, c.hidden, q_rows)?,
                gate: mat(LayerRole::Gate, c.intermediate, c.hidden)?,
                up: mat(LayerRole::Up, c.intermediate, c.hidden)?,
                down: mat(LayerRole::Down, c.hidden, c.intermediate)?,
                attn_norm: norm(l(LayerRole::AttnNorm), c.hidden)?,
                ffn_norm: norm(l(LayerRole::FfnNorm), c.hidden)?,
                attn_post_norm: optional_norm(
                    l(LayerRole::AttnPostNorm),
                    c.hidden,
                    c.has_post_norms(),
                )?,
                ffn_post_norm: optional_norm(
                    l(LayerRole::FfnPostNorm),
                    c.hidden,
                    c.has_post_norms(),
                )?,
                q_norm: optional_norm(l(LayerRole::QNorm), c.head_dim, c.has_qk_norm())?,
                k_norm: optional_norm(l(LayerRole::KNorm), c.head_dim, c.has_qk_norm())?,
            });
        }
        Ok(ModelWeights {
            embedding: matrix(
                Role::Embedding,
                src.tensor(Role::Embedding, &[c.vocab_size, c.hidden])?,
            )?,
            final_norm: norm(Role::FinalNorm, c.hidden)?,
            layers,
        })
    }
}

/// A row-major f32 matrix `[rows, cols]`.
pub struct F32Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl F32Matrix {
    pub fn from_view(t: &TensorView<'_>) -> F32Matrix {
        let (rows, cols) = t.matrix_dims();
        F32Matrix {
            rows,
            cols,
            data: dequant::to_f32(t),
        }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}
