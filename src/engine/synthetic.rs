//! Random weights of a given shape, for benchmarking shapes whose real
//! weights are not at hand (`pulsar bench --shape gemma-2b`).

use super::fast::WeightFormats;
use super::packed::{PackedMatrix, WeightFormat};
use crate::model::config::ModelConfig;
use crate::model::dtype::{DType, TensorView};
use crate::model::source::{LayerRole, Role};
use crate::model::weights::{LayerWeights, ModelWeights, layer_matrix_shape};

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

/// Random weights for `c` in `formats`, deterministic in `seed`.
pub fn random_weights(
    c: &ModelConfig,
    formats: &WeightFormats,
    seed: u64,
) -> ModelWeights<PackedMatrix> {
    let mut n = seed;
    let mut mat = |role: Role, rows, cols| {
        n = n.wrapping_add(1);
        random_matrix(formats.of(role), rows, cols, n)
    };
    let ones = |len: usize| vec![1.0f32; len];
    let layers = (0..c.n_layers())
        .map(|i| {
            let mut m = |role: LayerRole| {
                let [rows, cols] = layer_matrix_shape(role, c, 0);
                mat(Role::Layer(i, role), rows, cols)
            };
            LayerWeights {
                q: m(LayerRole::Q),
                k: Some(m(LayerRole::K)),
                v: Some(m(LayerRole::V)),
                o: m(LayerRole::O),
                gate: m(LayerRole::Gate),
                up: m(LayerRole::Up),
                down: m(LayerRole::Down),
                attn_norm: ones(c.hidden),
                ffn_norm: ones(c.hidden),
                attn_post_norm: c.has_post_norms().then(|| ones(c.hidden)),
                ffn_post_norm: c.has_post_norms().then(|| ones(c.hidden)),
                q_norm: c.has_qk_norm().then(|| ones(c.head_dim)),
                k_norm: c.has_qk_norm().then(|| ones(c.head_dim)),
                per_layer_input: None,
                moe: None,
                output_scale: 1.0,
            }
        })
        .collect();
    ModelWeights {
        embedding: mat(Role::Embedding, c.vocab_size, c.hidden),
        final_norm: ones(c.hidden),
        layers,
        per_layer_input: None,
    }
}
