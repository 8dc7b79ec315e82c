//! Random weights of a given shape, for benchmarking shapes whose real
//! weights are not at hand (`pulsar bench --shape gemma-2b`).

use super::packed::{PackedMatrix, WeightFormat};
use crate::model::config::ModelConfig;
use crate::model::weights::{LayerWeights, ModelWeights};

/// splitmix64: a tiny, fast, well-mixed generator; quality needs are low.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A `[rows, cols]` matrix of values uniform in ±0.05, filled in parallel
/// (a 2B model has 2.5 billion of them).
fn random_matrix(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> PackedMatrix {
    let mut data = vec![0u16; rows * cols];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = data.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, part) in data.chunks_mut(per).enumerate() {
            s.spawn(move || {
                let mut state = seed ^ (i as u64).wrapping_mul(0x1234_5678_9abc_def1);
                for v in part.iter_mut() {
                    let unit = (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
                    *v = format.from_f32((unit - 0.5) * 0.1);
                }
            });
        }
    });
    PackedMatrix::from_values(format, rows, cols, data)
}

/// Random weights for `c`, deterministic in `seed`.
pub fn random_weights(
    c: &ModelConfig,
    format: WeightFormat,
    seed: u64,
) -> ModelWeights<PackedMatrix> {
    let mut n = seed;
    let mut mat = |rows, cols| {
        n = n.wrapping_add(1);
        random_matrix(format, rows, cols, n)
    };
    let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let ones = |len: usize| vec![1.0f32; len];
    let layers = (0..c.n_layers())
        .map(|_| LayerWeights {
            q: mat(q_dim, c.hidden),
            k: mat(kv_dim, c.hidden),
            v: mat(kv_dim, c.hidden),
            o: mat(c.hidden, q_dim),
            gate: mat(c.intermediate, c.hidden),
            up: mat(c.intermediate, c.hidden),
            down: mat(c.hidden, c.intermediate),
            attn_norm: ones(c.hidden),
            ffn_norm: ones(c.hidden),
            attn_post_norm: c.has_post_norms().then(|| ones(c.hidden)),
            ffn_post_norm: c.has_post_norms().then(|| ones(c.hidden)),
            q_norm: c.has_qk_norm().then(|| ones(c.head_dim)),
            k_norm: c.has_qk_norm().then(|| ones(c.head_dim)),
        })
        .collect();
    ModelWeights {
        embedding: mat(c.vocab_size, c.hidden),
        final_norm: ones(c.hidden),
        layers,
    }
}
