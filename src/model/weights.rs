//! The model's weights, gathered by role and shape-checked against the
//! config. Generic over the matrix storage so each engine keeps weights in
//! its own layout (f32 for the reference pass, FP16/BF16 for the kernels).

use super::config::ModelConfig;
use super::dequant;
use super::dtype::TensorView;
use super::source::{LayerRole, ModelSource, Role};
use anyhow::Result;

/// The seven matrices of a layer, in the order the forward pass uses them,
/// with the name the plan and reports give them: the one list every place
/// that walks a layer's matrices iterates.
pub const LAYER_MATRICES: [(LayerRole, &str); 7] = [
    (LayerRole::Q, "attn_q"),
    (LayerRole::K, "attn_k"),
    (LayerRole::V, "attn_v"),
    (LayerRole::O, "attn_output"),
    (LayerRole::Gate, "ffn_gate"),
    (LayerRole::Up, "ffn_up"),
    (LayerRole::Down, "ffn_down"),
];

/// `[rows, cols]` of a layer matrix.
pub fn layer_matrix_shape(role: LayerRole, c: &ModelConfig) -> [usize; 2] {
    let q_rows = c.n_heads * c.head_dim;
    let kv_rows = c.n_kv_heads * c.head_dim;
    match role {
        LayerRole::Q => [q_rows, c.hidden],
        LayerRole::K | LayerRole::V => [kv_rows, c.hidden],
        LayerRole::O => [c.hidden, q_rows],
        LayerRole::Gate | LayerRole::Up => [c.intermediate, c.hidden],
        LayerRole::Down => [c.hidden, c.intermediate],
        other => panic!("{other:?} is not a layer matrix"),
    }
}

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

impl<M> LayerWeights<M> {
    /// The matrix of a role of [`LAYER_MATRICES`].
    pub fn matrix(&self, role: LayerRole) -> &M {
        match role {
            LayerRole::Q => &self.q,
            LayerRole::K => &self.k,
            LayerRole::V => &self.v,
            LayerRole::O => &self.o,
            LayerRole::Gate => &self.gate,
            LayerRole::Up => &self.up,
            LayerRole::Down => &self.down,
            other => panic!("{other:?} is not a layer matrix"),
        }
    }

    /// The seven matrices in the order of [`LAYER_MATRICES`].
    pub fn matrices(&self) -> impl Iterator<Item = &M> {
        LAYER_MATRICES.iter().map(|&(role, _)| self.matrix(role))
    }

    /// The seven matrices, mutable, in the order of [`LAYER_MATRICES`].
    pub fn matrices_mut(&mut self) -> [&mut M; 7] {
        // The order of LAYER_MATRICES, checked by a test below.
        [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ]
    }
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
        let mut layers = Vec::with_capacity(c.n_layers());
        for i in 0..c.n_layers() {
            let l = |r: LayerRole| Role::Layer(i, r);
            let mut mat = |r: LayerRole| -> Result<M> {
                matrix(l(r), src.tensor(l(r), &layer_matrix_shape(r, c))?)
            };
            layers.push(LayerWeights {
                q: mat(LayerRole::Q)?,
                k: mat(LayerRole::K)?,
                v: mat(LayerRole::V)?,
                o: mat(LayerRole::O)?,
                gate: mat(LayerRole::Gate)?,
                up: mat(LayerRole::Up)?,
                down: mat(LayerRole::Down)?,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutable_matrices_come_in_the_table_order() {
        let mut layer = LayerWeights {
            attn_norm: Vec::new(),
            attn_post_norm: None,
            ffn_norm: Vec::new(),
            ffn_post_norm: None,
            q_norm: None,
            k_norm: None,
            q: 0,
            k: 1,
            v: 2,
            o: 3,
            gate: 4,
            up: 5,
            down: 6,
        };
        let shared: Vec<i32> = layer.matrices().copied().collect();
        let mutable: Vec<i32> = layer.matrices_mut().into_iter().map(|m| *m).collect();
        assert_eq!(shared, mutable);
        assert_eq!(shared, (0..7).collect::<Vec<_>>());
    }
}
