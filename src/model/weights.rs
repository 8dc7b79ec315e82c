//! The model's weights, gathered by role and shape-checked against the
//! config. Generic over the matrix storage so each engine keeps weights in
//! its own layout (f32 for the reference pass, FP16/BF16 for the kernels).

use super::config::{AssistantShape, ModelConfig};
use super::dequant;
use super::dtype::TensorView;
use super::source::{ExpertRole, LayerRole, ModelSource, Role};
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

/// `[rows, cols]` of layer `layer`'s matrix of a role of [`LAYER_MATRICES`].
pub fn layer_matrix_shape(role: LayerRole, c: &ModelConfig, layer: usize) -> [usize; 2] {
    let s = c.shape(layer);
    let q_rows = c.n_heads * s.head_dim;
    let kv_rows = s.n_kv_heads * s.head_dim;
    match role {
        LayerRole::Q => [q_rows, c.hidden],
        LayerRole::K | LayerRole::V => [kv_rows, c.hidden],
        LayerRole::O => [c.hidden, q_rows],
        LayerRole::Gate | LayerRole::Up => [s.ffn_width, c.hidden],
        LayerRole::Down => [c.hidden, s.ffn_width],
        LayerRole::PleGate => [c.features.per_layer_input, c.hidden],
        LayerRole::PleProjection => [c.hidden, c.features.per_layer_input],
        LayerRole::LaurelLeft => [c.features.laurel_rank, c.hidden],
        LayerRole::LaurelRight => [c.hidden, c.features.laurel_rank],
        other => panic!("{other:?} is not a layer matrix"),
    }
}

/// Whether layer `layer` has a matrix of `role` (of [`LAYER_MATRICES`]):
/// a layer that shares another's keys has no K or V, and a layer whose
/// values are its keys has no V.
pub fn has_layer_matrix(role: LayerRole, c: &ModelConfig, layer: usize) -> bool {
    let s = c.shape(layer);
    match role {
        LayerRole::K => c.keeps_kv(layer),
        LayerRole::V => c.keeps_kv(layer) && !s.values_from_keys,
        _ => true,
    }
}

/// `[rows, cols]` of any matrix an engine multiplies by.
pub fn matrix_shape(role: Role, c: &ModelConfig) -> [usize; 2] {
    let layers_p = c.n_layers() * c.features.per_layer_input;
    match role {
        Role::Embedding => [c.vocab_size, c.hidden],
        Role::PerLayerEmbedding => [c.features.per_layer_vocab, layers_p],
        Role::PerLayerModelProjection => [layers_p, c.hidden],
        Role::AltUpProjection(_) | Role::AltUpUnembed(_) => [c.hidden, c.hidden],
        Role::AssistantPreProjection => [c.hidden, 2 * assistant_of(c).backbone_hidden],
        Role::AssistantPostProjection => [assistant_of(c).backbone_hidden, c.hidden],
        Role::HeadCentroids => [assistant_of(c).clusters.map_or(0, |k| k.count), c.hidden],
        Role::Layer(i, r) => layer_matrix_shape(r, c, i),
        Role::Expert(_, _, r) => {
            let m = c.features.moe.expect("experts in a model with a mixture");
            match r {
                ExpertRole::Gate | ExpertRole::Up => m.gate_shape,
                ExpertRole::Down => m.down_shape,
            }
        }
        other => panic!("{other:?} is not a matrix"),
    }
}

fn assistant_of(c: &ModelConfig) -> AssistantShape {
    c.features
        .assistant
        .expect("an assistant's matrix in a model that is an assistant")
}

/// Every matrix a model of this config has, with its shape, in the order
/// [`ModelWeights::matrices`] gives them.
pub fn model_matrices(c: &ModelConfig) -> Vec<(Role, [usize; 2])> {
    let mut roles = vec![Role::Embedding];
    if let Some(a) = c.features.assistant {
        roles.extend([Role::AssistantPreProjection, Role::AssistantPostProjection]);
        if a.clusters.is_some() {
            roles.push(Role::HeadCentroids);
        }
    }
    if c.features.per_layer_input > 0 {
        // The per-layer token table is a row table (`RowTable`), not here.
        roles.push(Role::PerLayerModelProjection);
    }
    if let Some(altup) = c.features.altup {
        roles.extend((0..altup.streams - 1).map(Role::AltUpProjection));
        roles.extend((0..altup.streams - 1).map(Role::AltUpUnembed));
    }
    for i in 0..c.n_layers() {
        roles.extend(
            LAYER_MATRICES
                .iter()
                .filter(|&&(r, _)| has_layer_matrix(r, c, i))
                .map(|&(r, _)| Role::Layer(i, r)),
        );
        if c.features.laurel_rank > 0 {
            roles.extend([
                Role::Layer(i, LayerRole::LaurelLeft),
                Role::Layer(i, LayerRole::LaurelRight),
            ]);
        }
        if c.features.per_layer_input > 0 {
            roles.extend([
                Role::Layer(i, LayerRole::PleGate),
                Role::Layer(i, LayerRole::PleProjection),
            ]);
        }
        if let Some(moe) = c.features.moe {
            for e in 0..moe.experts {
                roles.extend(
                    [ExpertRole::Gate, ExpertRole::Up, ExpertRole::Down]
                        .map(|r| Role::Expert(i, e, r)),
                );
            }
        }
    }
    roles.into_iter().map(|r| (r, matrix_shape(r, c))).collect()
}

/// The name the plan and reports give a matrix (llama.cpp's tensor name
/// without the layer).
pub fn matrix_name(role: Role) -> &'static str {
    match role {
        Role::Embedding => "output(lm_head)",
        Role::PerLayerEmbedding => "per_layer_token_embd",
        Role::PerLayerModelProjection => "per_layer_model_proj",
        Role::Layer(_, LayerRole::PleGate) => "inp_gate",
        Role::Layer(_, LayerRole::PleProjection) => "proj",
        Role::Layer(_, LayerRole::LaurelLeft) => "laurel_l",
        Role::Layer(_, LayerRole::LaurelRight) => "laurel_r",
        Role::AltUpProjection(_) => "altup_proj",
        Role::AltUpUnembed(_) => "altup_unembd_proj",
        Role::Layer(_, r) => LAYER_MATRICES
            .iter()
            .find(|&&(m, _)| m == r)
            .map_or("?", |&(_, name)| name),
        Role::Expert(_, _, ExpertRole::Gate) => "ffn_gate_exps",
        Role::Expert(_, _, ExpertRole::Up) => "ffn_up_exps",
        Role::Expert(_, _, ExpertRole::Down) => "ffn_down_exps",
        Role::AssistantPreProjection => "nextn_pre_projection",
        Role::AssistantPostProjection => "nextn_post_projection",
        Role::HeadCentroids => "masked_embd_centroids",
        Role::FinalNorm | Role::PerLayerProjectionNorm | Role::HeadTokenOrdering => "?",
    }
}

/// RMSNorm weights are kept as the final multiplier (the `1 + w` of HF
/// checkpoints already added).
pub type NormWeights = Vec<f32>;

/// A gated feed-forward: `down(gelu(gate(x)) * up(x))`. A layer's dense
/// MLP and each expert of a mixture.
pub struct Mlp<M> {
    pub gate: M,
    pub up: M,
    pub down: M,
}

/// Gemma 4's per-layer input path of one layer: `post_norm(projection(
/// gelu(gate(x)) * per_layer_input))` added to the residual.
pub struct PerLayerInputWeights<M> {
    pub gate: M,
    pub projection: M,
    pub post_norm: NormWeights,
}

/// Gemma 3n's AltUp in one layer: the router that reads a stream and the
/// coefficients that predict every stream from all of them before the
/// layer and correct them after it. All small: f32, multiplied in Rust.
pub struct AltUpWeights {
    /// `[streams, hidden]`.
    pub router: F32Matrix,
    /// The router's input norm with the `1 / hidden` input scale folded in.
    pub router_input_scale: Vec<f32>,
    /// `[streams², streams]`: the router's output to the prediction matrix.
    pub predict: F32Matrix,
    /// `[streams, streams]`: the router's output to the correction.
    pub correct: F32Matrix,
    /// What the active stream is multiplied by where the per-layer input's
    /// gate reads it (`altup_correct_scale`).
    pub correct_output_scale: Option<Vec<f32>>,
}

/// Gemma 3n's LAuReL branch: `post_norm(right(left(h)))` beside attention.
pub struct LaurelWeights<M> {
    pub left: M,
    pub right: M,
    pub post_norm: NormWeights,
}

/// Gemma 3n's projections between the embedding and the AltUp streams
/// 1.. (`[hidden, hidden]` each), and back before the final norm.
pub struct AltUpStreams<M> {
    pub projections: Vec<M>,
    pub unembed: Vec<M>,
}

/// A layer's mixture of experts (Gemma 4 26B-A4B), beside its dense MLP.
pub struct MoeWeights<M> {
    /// `[experts, hidden]`, small: kept in f32 and multiplied in Rust.
    pub router: F32Matrix,
    /// Multiplies the router's normalised input, with `hidden^-1/2` folded in.
    pub router_input_scale: Vec<f32>,
    /// Multiplies each chosen expert's weight.
    pub expert_scale: Vec<f32>,
    /// The experts' input norm.
    pub norm: NormWeights,
    /// The post-norms of the dense MLP's and the experts' outputs.
    pub dense_post_norm: NormWeights,
    pub experts_post_norm: NormWeights,
    pub experts: Vec<Mlp<M>>,
}

pub struct LayerWeights<M> {
    pub attn_norm: NormWeights,
    pub attn_post_norm: Option<NormWeights>,
    pub ffn_norm: NormWeights,
    pub ffn_post_norm: Option<NormWeights>,
    pub q_norm: Option<NormWeights>,
    pub k_norm: Option<NormWeights>,
    pub q: M,
    /// `None` in a layer that shares an earlier layer's keys and values.
    pub k: Option<M>,
    /// `None` where K is absent or the values are the keys.
    pub v: Option<M>,
    pub o: M,
    pub gate: M,
    pub up: M,
    pub down: M,
    pub per_layer_input: Option<PerLayerInputWeights<M>>,
    pub moe: Option<MoeWeights<M>>,
    pub altup: Option<AltUpWeights>,
    pub laurel: Option<LaurelWeights<M>>,
    /// The residual stream's scale at the end of the layer (1 where the
    /// family has none).
    pub output_scale: f32,
}

impl<M> LayerWeights<M> {
    /// The matrix of a role of [`LAYER_MATRICES`], if the layer has it.
    pub fn matrix(&self, role: LayerRole) -> Option<&M> {
        match role {
            LayerRole::Q => Some(&self.q),
            LayerRole::K => self.k.as_ref(),
            LayerRole::V => self.v.as_ref(),
            LayerRole::O => Some(&self.o),
            LayerRole::Gate => Some(&self.gate),
            LayerRole::Up => Some(&self.up),
            LayerRole::Down => Some(&self.down),
            other => panic!("{other:?} is not a layer matrix"),
        }
    }

    /// Every matrix of layer `i` with its role: those of
    /// [`LAYER_MATRICES`] it has, then LAuReL's, the per-layer input's,
    /// then each expert's.
    pub fn matrices(&self, i: usize) -> Vec<(Role, &M)> {
        let mut out: Vec<(Role, &M)> = LAYER_MATRICES
            .iter()
            .filter_map(|&(r, _)| self.matrix(r).map(|m| (Role::Layer(i, r), m)))
            .collect();
        if let Some(l) = &self.laurel {
            out.push((Role::Layer(i, LayerRole::LaurelLeft), &l.left));
            out.push((Role::Layer(i, LayerRole::LaurelRight), &l.right));
        }
        if let Some(p) = &self.per_layer_input {
            out.push((Role::Layer(i, LayerRole::PleGate), &p.gate));
            out.push((Role::Layer(i, LayerRole::PleProjection), &p.projection));
        }
        if let Some(moe) = &self.moe {
            for (e, x) in moe.experts.iter().enumerate() {
                out.push((Role::Expert(i, e, ExpertRole::Gate), &x.gate));
                out.push((Role::Expert(i, e, ExpertRole::Up), &x.up));
                out.push((Role::Expert(i, e, ExpertRole::Down), &x.down));
            }
        }
        out
    }

    /// [`LayerWeights::matrices`], mutable, in the same order.
    pub fn matrices_mut(&mut self, i: usize) -> Vec<(Role, &mut M)> {
        let mut out: Vec<(Role, &mut M)> = vec![(Role::Layer(i, LayerRole::Q), &mut self.q)];
        if let Some(k) = &mut self.k {
            out.push((Role::Layer(i, LayerRole::K), k));
        }
        if let Some(v) = &mut self.v {
            out.push((Role::Layer(i, LayerRole::V), v));
        }
        out.push((Role::Layer(i, LayerRole::O), &mut self.o));
        out.push((Role::Layer(i, LayerRole::Gate), &mut self.gate));
        out.push((Role::Layer(i, LayerRole::Up), &mut self.up));
        out.push((Role::Layer(i, LayerRole::Down), &mut self.down));
        if let Some(l) = &mut self.laurel {
            out.push((Role::Layer(i, LayerRole::LaurelLeft), &mut l.left));
            out.push((Role::Layer(i, LayerRole::LaurelRight), &mut l.right));
        }
        if let Some(p) = &mut self.per_layer_input {
            out.push((Role::Layer(i, LayerRole::PleGate), &mut p.gate));
            out.push((Role::Layer(i, LayerRole::PleProjection), &mut p.projection));
        }
        if let Some(moe) = &mut self.moe {
            for (e, x) in moe.experts.iter_mut().enumerate() {
                out.push((Role::Expert(i, e, ExpertRole::Gate), &mut x.gate));
                out.push((Role::Expert(i, e, ExpertRole::Up), &mut x.up));
                out.push((Role::Expert(i, e, ExpertRole::Down), &mut x.down));
            }
        }
        out
    }
}

/// A table read one row at a time (Gemma 4's per-layer token table: 2.3
/// billion values in E2B, of which a token reads 8,960), kept in the
/// file's own type: owned bytes, or in place inside the mapped file.
pub struct RowTable {
    dtype: super::dtype::DType,
    shape: [usize; 2],
    storage: RowStorage,
}

enum RowStorage {
    Owned(Vec<u8>),
    /// Bytes inside a mapped model file.
    Mapped {
        /// Held only to keep the mapping alive.
        _owner: std::sync::Arc<dyn Send + Sync>,
        ptr: *const u8,
        len: usize,
    },
}

// SAFETY: `Mapped` points into memory kept alive by the Arc beside it
// (itself Send + Sync), a read-only file mapping never written.
unsafe impl Send for RowStorage {}
unsafe impl Sync for RowStorage {}

impl RowTable {
    /// A copy of the tensor's bytes.
    pub fn owned(t: &TensorView<'_>) -> RowTable {
        let (rows, cols) = t.matrix_dims();
        RowTable {
            dtype: t.dtype,
            shape: [rows, cols],
            storage: RowStorage::Owned(t.bytes.to_vec()),
        }
    }

    /// The tensor in place. `owner` must own the memory `t` points into.
    pub fn mapped(owner: std::sync::Arc<dyn Send + Sync>, t: &TensorView<'_>) -> RowTable {
        let (rows, cols) = t.matrix_dims();
        RowTable {
            dtype: t.dtype,
            shape: [rows, cols],
            storage: RowStorage::Mapped {
                _owner: owner,
                ptr: t.bytes.as_ptr(),
                len: t.bytes.len(),
            },
        }
    }

    fn bytes(&self) -> &[u8] {
        match &self.storage {
            RowStorage::Owned(bytes) => bytes,
            // SAFETY: `ptr..ptr+len` is the tensor's bytes inside the
            // mapping `_owner` keeps alive for as long as `self`.
            RowStorage::Mapped { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(*ptr, *len)
            },
        }
    }

    /// Row `r` as f32, into `out` (one row long).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let view = TensorView {
            dtype: self.dtype,
            shape: &self.shape,
            bytes: self.bytes(),
        };
        dequant::row_into(&view, r, out);
    }
}

/// Gemma 4's per-layer inputs: the token table and the embedding's
/// projection, shared by all layers.
pub struct PerLayerInputTable<M> {
    /// `[vocab, layers x P]`: one row per token, read a row at a time.
    pub embedding: RowTable,
    /// `[layers x P, hidden]`.
    pub model_projection: M,
    /// `[P]`, applied to each layer's part of the projection.
    pub projection_norm: NormWeights,
}

/// What a Gemma 4 assistant adds around its layers.
pub struct AssistantWeights<M> {
    /// `[hidden, 2 x target hidden]`: the target's scaled embedding and
    /// hidden state, side by side, into the assistant's width.
    pub pre_projection: M,
    /// `[target hidden, hidden]`: the final hidden state back to the
    /// target's width, the next draft's input.
    pub post_projection: M,
    /// The LM head by clusters, when the model has it.
    pub clusters: Option<ClusteredHead<M>>,
}

/// An assistant's LM head by clusters: the centroids `[clusters, hidden]`
/// and the token ids of cluster 0, then cluster 1, … (a permutation of the
/// vocabulary, `vocab / clusters` per cluster).
pub struct ClusteredHead<M> {
    pub centroids: M,
    pub token_ordering: Vec<u32>,
}

pub struct ModelWeights<M> {
    /// `[vocab, hidden]`; also the LM head (Gemma ties them).
    pub embedding: M,
    pub final_norm: NormWeights,
    pub layers: Vec<LayerWeights<M>>,
    pub per_layer_input: Option<PerLayerInputTable<M>>,
    pub altup: Option<AltUpStreams<M>>,
    pub assistant: Option<AssistantWeights<M>>,
}

impl<M> ModelWeights<M> {
    /// Every matrix with its role: the embedding, the per-layer input
    /// projection, AltUp's projections, then each layer's
    /// ([`LayerWeights::matrices`]).
    pub fn matrices(&self) -> Vec<(Role, &M)> {
        let mut out = vec![(Role::Embedding, &self.embedding)];
        if let Some(a) = &self.assistant {
            out.push((Role::AssistantPreProjection, &a.pre_projection));
            out.push((Role::AssistantPostProjection, &a.post_projection));
            if let Some(h) = &a.clusters {
                out.push((Role::HeadCentroids, &h.centroids));
            }
        }
        if let Some(p) = &self.per_layer_input {
            out.push((Role::PerLayerModelProjection, &p.model_projection));
        }
        if let Some(a) = &self.altup {
            out.extend(
                a.projections
                    .iter()
                    .enumerate()
                    .map(|(k, m)| (Role::AltUpProjection(k), m)),
            );
            out.extend(
                a.unembed
                    .iter()
                    .enumerate()
                    .map(|(k, m)| (Role::AltUpUnembed(k), m)),
            );
        }
        for (i, l) in self.layers.iter().enumerate() {
            out.extend(l.matrices(i));
        }
        out
    }

    /// [`ModelWeights::matrices`], mutable, in the same order.
    pub fn matrices_mut(&mut self) -> Vec<(Role, &mut M)> {
        let mut out = vec![(Role::Embedding, &mut self.embedding)];
        if let Some(a) = &mut self.assistant {
            out.push((Role::AssistantPreProjection, &mut a.pre_projection));
            out.push((Role::AssistantPostProjection, &mut a.post_projection));
            if let Some(h) = &mut a.clusters {
                out.push((Role::HeadCentroids, &mut h.centroids));
            }
        }
        if let Some(p) = &mut self.per_layer_input {
            out.push((Role::PerLayerModelProjection, &mut p.model_projection));
        }
        if let Some(a) = &mut self.altup {
            out.extend(
                a.projections
                    .iter_mut()
                    .enumerate()
                    .map(|(k, m)| (Role::AltUpProjection(k), m)),
            );
            out.extend(
                a.unembed
                    .iter_mut()
                    .enumerate()
                    .map(|(k, m)| (Role::AltUpUnembed(k), m)),
            );
        }
        for (i, l) in self.layers.iter_mut().enumerate() {
            out.extend(l.matrices_mut(i));
        }
        out
    }

    /// Collects every tensor the config calls for; `matrix` converts each
    /// weight matrix (given its role and view) into the engine's layout.
    /// A table read by rows is copied in the file's type.
    pub fn load(
        src: &ModelSource,
        matrix: impl FnMut(Role, TensorView<'_>) -> Result<M>,
    ) -> Result<Self> {
        Self::load_with(src, matrix, |t| Ok(RowTable::owned(&t)))
    }

    /// [`ModelWeights::load`] with the row table made by `table`.
    pub fn load_with(
        src: &ModelSource,
        mut matrix: impl FnMut(Role, TensorView<'_>) -> Result<M>,
        table: impl FnOnce(TensorView<'_>) -> Result<RowTable>,
    ) -> Result<Self> {
        let c = &src.config;
        let vector = |role: Role, len: usize| -> Result<Vec<f32>> {
            Ok(dequant::to_f32(&src.tensor(role, &[len])?))
        };
        let norm = |role: Role, len: usize| -> Result<NormWeights> {
            Ok(vector(role, len)?
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
            let hd = c.shape(i).head_dim;
            let mut mat = |r: LayerRole| -> Result<M> {
                matrix(l(r), src.tensor(l(r), &layer_matrix_shape(r, c, i))?)
            };
            let q = mat(LayerRole::Q)?;
            let k = if has_layer_matrix(LayerRole::K, c, i) {
                Some(mat(LayerRole::K)?)
            } else {
                None
            };
            let v = if has_layer_matrix(LayerRole::V, c, i) {
                Some(mat(LayerRole::V)?)
            } else {
                None
            };
            let (o, gate, up, down) = (
                mat(LayerRole::O)?,
                mat(LayerRole::Gate)?,
                mat(LayerRole::Up)?,
                mat(LayerRole::Down)?,
            );
            let per_layer_input = if c.features.per_layer_input > 0 {
                Some(PerLayerInputWeights {
                    gate: mat(LayerRole::PleGate)?,
                    projection: mat(LayerRole::PleProjection)?,
                    post_norm: norm(l(LayerRole::PlePostNorm), c.hidden)?,
                })
            } else {
                None
            };
            let laurel = if c.features.laurel_rank > 0 {
                Some(LaurelWeights {
                    left: mat(LayerRole::LaurelLeft)?,
                    right: mat(LayerRole::LaurelRight)?,
                    post_norm: norm(l(LayerRole::LaurelPostNorm), c.hidden)?,
                })
            } else {
                None
            };
            let moe = match c.features.moe {
                Some(shape) => {
                    let mut experts = Vec::with_capacity(shape.experts);
                    for e in 0..shape.experts {
                        let mut expert = |r: ExpertRole| -> Result<M> {
                            matrix(Role::Expert(i, e, r), src.expert_tensor(i, e, r)?)
                        };
                        experts.push(Mlp {
                            gate: expert(ExpertRole::Gate)?,
                            up: expert(ExpertRole::Up)?,
                            down: expert(ExpertRole::Down)?,
                        });
                    }
                    let router_view =
                        src.tensor(l(LayerRole::RouterProj), &[shape.experts, c.hidden])?;
                    // The router reads rms(x) * scale * hidden^-1/2.
                    let inv_sqrt_hidden = (c.hidden as f32).powf(-0.5);
                    Some(MoeWeights {
                        router: F32Matrix::from_view(&router_view),
                        router_input_scale: vector(l(LayerRole::RouterScale), c.hidden)?
                            .into_iter()
                            .map(|s| s * inv_sqrt_hidden)
                            .collect(),
                        expert_scale: vector(l(LayerRole::ExpertScale), shape.experts)?,
                        norm: norm(l(LayerRole::MoeNorm), c.hidden)?,
                        dense_post_norm: norm(l(LayerRole::DensePostNorm), c.hidden)?,
                        experts_post_norm: norm(l(LayerRole::MoePostNorm), c.hidden)?,
                        experts,
                    })
                }
                None => None,
            };
            let altup = match c.features.altup {
                Some(shape) => {
                    let n = shape.streams;
                    let small = |r: LayerRole, dims: [usize; 2]| -> Result<F32Matrix> {
                        Ok(F32Matrix::from_view(&src.tensor(l(r), &dims)?))
                    };
                    // The router reads rms(x) * norm * (1 / hidden).
                    let inv_hidden = 1.0 / c.hidden as f32;
                    Some(AltUpWeights {
                        router: small(LayerRole::AltUpRouter, [n, c.hidden])?,
                        router_input_scale: norm(l(LayerRole::AltUpRouterNorm), c.hidden)?
                            .into_iter()
                            .map(|w| w * inv_hidden)
                            .collect(),
                        predict: small(LayerRole::AltUpPredict, [n * n, n])?,
                        correct: small(LayerRole::AltUpCorrect, [n, n])?,
                        correct_output_scale: if shape.correct_scale {
                            Some(vector(l(LayerRole::AltUpCorrectScale), c.hidden)?)
                        } else {
                            None
                        },
                    })
                }
                None => None,
            };
            let output_scale = if c.features.layer_scalar {
                let s = vector(l(LayerRole::OutputScale), 1)?[0];
                if !s.is_finite() {
                    anyhow::bail!(
                        "{}: tensor {:?} holds {s}; the file is damaged",
                        src.path.display(),
                        src.tensor_name(l(LayerRole::OutputScale))
                    );
                }
                s
            } else {
                1.0
            };
            layers.push(LayerWeights {
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
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
                q_norm: optional_norm(l(LayerRole::QNorm), hd, c.has_qk_norm())?,
                k_norm: optional_norm(l(LayerRole::KNorm), hd, c.has_qk_norm() && c.keeps_kv(i))?,
                per_layer_input,
                moe,
                altup,
                laurel,
                output_scale,
            });
        }
        let per_layer_input = if c.features.per_layer_input > 0 {
            let rows = Role::PerLayerEmbedding;
            let projection = Role::PerLayerModelProjection;
            Some(PerLayerInputTable {
                embedding: table(src.row_table(rows, &matrix_shape(rows, c))?)?,
                model_projection: matrix(
                    projection,
                    src.tensor(projection, &matrix_shape(projection, c))?,
                )?,
                projection_norm: norm(Role::PerLayerProjectionNorm, c.features.per_layer_input)?,
            })
        } else {
            None
        };
        let altup = match c.features.altup {
            Some(shape) => {
                let mut stack = |role: fn(usize) -> Role| -> Result<Vec<M>> {
                    (0..shape.streams - 1)
                        .map(|k| matrix(role(k), src.tensor(role(k), &matrix_shape(role(k), c))?))
                        .collect()
                };
                let projections = stack(Role::AltUpProjection)?;
                let unembed = stack(Role::AltUpUnembed)?;
                Some(AltUpStreams {
                    projections,
                    unembed,
                })
            }
            None => None,
        };
        let assistant = match c.features.assistant {
            Some(shape) => {
                let mut of_role = |role: Role| -> Result<M> {
                    matrix(role, src.tensor(role, &matrix_shape(role, c))?)
                };
                let pre_projection = of_role(Role::AssistantPreProjection)?;
                let post_projection = of_role(Role::AssistantPostProjection)?;
                let clusters = match shape.clusters {
                    Some(_) => Some(ClusteredHead {
                        centroids: of_role(Role::HeadCentroids)?,
                        token_ordering: super::gemma4_assistant::token_ordering(src)?,
                    }),
                    None => None,
                };
                Some(AssistantWeights {
                    pre_projection,
                    post_projection,
                    clusters,
                })
            }
            None => None,
        };
        Ok(ModelWeights {
            embedding: matrix(
                Role::Embedding,
                src.tensor(Role::Embedding, &[c.vocab_size, c.hidden])?,
            )?,
            final_norm: norm(Role::FinalNorm, c.hidden)?,
            layers,
            per_layer_input,
            altup,
            assistant,
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
