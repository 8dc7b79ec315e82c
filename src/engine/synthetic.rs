//! Random weights of a given shape, for benchmarking shapes whose real
//! weights are not at hand (`pulsar bench --shape gemma-2b`).

use super::fast::WeightFormats;
use super::packed::{PackedMatrix, WeightFormat};
use crate::model::config::ModelConfig;
use crate::model::dtype::{DType, TensorView};
use crate::model::source::{ExpertRole, LayerRole, Role};
use crate::model::weights::{
    AltUpStreams, AltUpWeights, AssistantWeights, ClusteredHead, F32Matrix, LaurelWeights,
    LayerWeights, Mlp, ModelWeights, MoeWeights, PerLayerInputTable, PerLayerInputWeights,
    RowTable, has_layer_matrix, matrix_shape,
};

/// splitmix64: a tiny, fast, well-mixed generator; quality needs are low.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `len` values uniform in ±0.05, filled in parallel (a 2B model has 2.5
/// billion of them), each turned into a `T` by `store`.
fn random_values<T: Copy + Default + Send>(
    len: usize,
    seed: u64,
    store: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    let mut data = vec![T::default(); len];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = data.len().div_ceil(threads).max(1);
    let store = &store;
    std::thread::scope(|s| {
        for (i, part) in data.chunks_mut(per).enumerate() {
            s.spawn(move || {
                let mut state = seed ^ (i as u64).wrapping_mul(0x1234_5678_9abc_def1);
                for v in part.iter_mut() {
                    let unit = (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
                    *v = store((unit - 0.5) * 0.1);
                }
            });
        }
    });
    data
}

/// A random `[rows, cols]` matrix in `format`: 16-bit values directly; a
/// quantized one is quantized from f32 values as a load would.
fn random_matrix(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> PackedMatrix {
    if format.is_16bit() {
        let data = random_values(rows * cols, seed, |v| format.from_f32(v));
        return PackedMatrix::from_values(format, rows, cols, data);
    }
    let values = random_values(rows * cols, seed, |v| v);
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    drop(values);
    let shape = [rows, cols];
    let view = TensorView {
        dtype: DType::F32,
        shape: &shape,
        bytes: &bytes,
    };
    PackedMatrix::convert(&view, format)
}

/// A random row table in Q8_0 (as the per-layer tables of released files
/// are stored quantized).
fn random_rows([rows, cols]: [usize; 2], seed: u64) -> RowTable {
    let values = random_values(rows * cols, seed, |v| v);
    let bytes = crate::model::gguf_write::q8_0_bytes(&values);
    drop(values);
    let shape = [rows, cols];
    RowTable::owned(&TensorView {
        dtype: DType::Q8_0,
        shape: &shape,
        bytes: &bytes,
    })
}

/// A small f32 matrix of values uniform in ±0.5 (routers, AltUp's
/// coefficients).
fn random_small(rows: usize, cols: usize, seed: u64) -> F32Matrix {
    let mut state = seed;
    F32Matrix {
        rows,
        cols,
        data: (0..rows * cols)
            .map(|_| (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect(),
    }
}

/// Random weights for `c` in `formats`, deterministic in `seed`: every
/// matrix the config calls for (per-layer shapes, per-layer inputs and
/// experts included), norms of ones, scales of one.
pub fn random_weights(
    c: &ModelConfig,
    formats: &WeightFormats,
    seed: u64,
) -> ModelWeights<PackedMatrix> {
    let mut n = seed;
    let mut mat = |role: Role| {
        n = n.wrapping_add(1);
        let [rows, cols] = matrix_shape(role, c);
        random_matrix(formats.of(role), rows, cols, n)
    };
    let ones = |len: usize| vec![1.0f32; len];
    let mut layers = Vec::with_capacity(c.n_layers());
    for i in 0..c.n_layers() {
        let mut m = |role: LayerRole| mat(Role::Layer(i, role));
        let hd = c.shape(i).head_dim;
        let has = |role: LayerRole| has_layer_matrix(role, c, i);
        let (q, k, v, o) = (
            m(LayerRole::Q),
            has(LayerRole::K).then(|| m(LayerRole::K)),
            has(LayerRole::V).then(|| m(LayerRole::V)),
            m(LayerRole::O),
        );
        let (gate, up, down) = (m(LayerRole::Gate), m(LayerRole::Up), m(LayerRole::Down));
        let per_layer_input = (c.features.per_layer_input > 0).then(|| PerLayerInputWeights {
            gate: m(LayerRole::PleGate),
            projection: m(LayerRole::PleProjection),
            post_norm: ones(c.hidden),
        });
        let laurel = (c.features.laurel_rank > 0).then(|| LaurelWeights {
            left: m(LayerRole::LaurelLeft),
            right: m(LayerRole::LaurelRight),
            post_norm: ones(c.hidden),
        });
        let altup = c.features.altup.map(|a| AltUpWeights {
            router: random_small(a.streams, c.hidden, 1),
            router_input_scale: vec![1.0 / c.hidden as f32; c.hidden],
            predict: random_small(a.streams * a.streams, a.streams, 2),
            correct: random_small(a.streams, a.streams, 3),
            correct_output_scale: a.correct_scale.then(|| ones(c.hidden)),
        });
        let moe = c.features.moe.map(|shape| MoeWeights {
            router: random_small(shape.experts, c.hidden, 0),
            router_input_scale: ones(c.hidden),
            expert_scale: ones(shape.experts),
            norm: ones(c.hidden),
            dense_post_norm: ones(c.hidden),
            experts_post_norm: ones(c.hidden),
            experts: (0..shape.experts)
                .map(|e| Mlp {
                    gate: mat(Role::Expert(i, e, ExpertRole::Gate)),
                    up: mat(Role::Expert(i, e, ExpertRole::Up)),
                    down: mat(Role::Expert(i, e, ExpertRole::Down)),
                })
                .collect(),
        });
        layers.push(LayerWeights {
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
            attn_norm: ones(c.hidden),
            ffn_norm: ones(c.hidden),
            attn_post_norm: c.has_post_norms().then(|| ones(c.hidden)),
            ffn_post_norm: c.has_post_norms().then(|| ones(c.hidden)),
            q_norm: c.has_qk_norm().then(|| ones(hd)),
            k_norm: (c.has_qk_norm() && c.keeps_kv(i)).then(|| ones(hd)),
            per_layer_input,
            moe,
            altup,
            laurel,
            output_scale: 1.0,
        });
    }
    let per_layer_input = (c.features.per_layer_input > 0).then(|| PerLayerInputTable {
        embedding: random_rows(matrix_shape(Role::PerLayerEmbedding, c), seed ^ 0x5eed),
        model_projection: mat(Role::PerLayerModelProjection),
        projection_norm: ones(c.features.per_layer_input),
    });
    let altup = c.features.altup.map(|a| AltUpStreams {
        projections: (0..a.streams - 1)
            .map(|k| mat(Role::AltUpProjection(k)))
            .collect(),
        unembed: (0..a.streams - 1)
            .map(|k| mat(Role::AltUpUnembed(k)))
            .collect(),
    });
    // An assistant's head clusters are consecutive runs of ids.
    let assistant = c.features.assistant.map(|a| AssistantWeights {
        pre_projection: mat(Role::AssistantPreProjection),
        post_projection: mat(Role::AssistantPostProjection),
        clusters: a.clusters.map(|_| ClusteredHead {
            centroids: mat(Role::HeadCentroids),
            token_ordering: (0..c.vocab_size as u32).collect(),
        }),
    });
    ModelWeights {
        embedding: mat(Role::Embedding),
        final_norm: ones(c.hidden),
        layers,
        per_layer_input,
        altup,
        assistant,
    }
}
