//! Known model shapes, for planning, dumping and benchmarking without the
//! weights (a per-model table in the spirit of gemma.cpp's configs).

use super::config::{Family, LayerAttention, ModelConfig};

/// Shape names `--shape` accepts.
pub const SHAPES: [&str; 8] = [
    "gemma-2b",
    "gemma3-270m",
    "gemma3n-e2b",
    "gemma3n-e4b",
    "gemma4-e2b",
    "gemma4-e4b",
    "gemma4-26b-a4b",
    "gemma4-31b",
];

/// The shape called `name`, if known.
pub fn shape(name: &str) -> Option<ModelConfig> {
    match name {
        "gemma-2b" => Some(gemma_2b()),
        "gemma3-270m" => Some(gemma3_270m()),
        "gemma3n-e2b" => Some(super::gemma3n::E2B.config()),
        "gemma3n-e4b" => Some(super::gemma3n::E4B.config()),
        "gemma4-e2b" => Some(super::gemma4::E2B.config()),
        "gemma4-e4b" => Some(super::gemma4::E4B.config()),
        "gemma4-26b-a4b" => Some(super::gemma4::MOE_26B_A4B.config()),
        "gemma4-31b" => Some(super::gemma4::DENSE_31B.config()),
        _ => None,
    }
}

/// Assistant (drafter) shapes `bench --draft-shape` accepts, each with the
/// target shape it drafts for.
pub const ASSISTANT_SHAPES: [(&str, &str); 2] = [
    ("gemma4-e2b-assistant", "gemma4-e2b"),
    ("gemma4-e4b-assistant", "gemma4-e4b"),
];

/// The assistant shape called `name`, if known.
pub fn assistant_shape(name: &str) -> Option<ModelConfig> {
    match name {
        "gemma4-e2b-assistant" => Some(super::gemma4::E2B_ASSISTANT.config()),
        "gemma4-e4b-assistant" => Some(super::gemma4::E4B_ASSISTANT.config()),
        _ => None,
    }
}

/// Gemma 1 2B: 18 layers, multi-query attention, 256k vocabulary.
pub fn gemma_2b() -> ModelConfig {
    ModelConfig {
        family: Family::Gemma1,
        vocab_size: 256_000,
        hidden: 2048,
        intermediate: 16_384,
        n_heads: 8,
        n_kv_heads: 1,
        head_dim: 256,
        rms_eps: 1e-6,
        query_scale: 1.0 / 16.0,
        attn_softcap: None,
        final_softcap: None,
        layers: vec![
            LayerAttention {
                window: None,
                rope_base: 10_000.0,
                rope_scale: 1.0
            };
            18
        ],
        norm_weight_offset: 1.0,
        max_context: 8192,
        bos_id: 2,
        eos_id: 1,
        layer_shapes: Vec::new(),
        features: Default::default(),
    }
}

/// Gemma 3 270M: 18 layers, every 6th global, 512-token windows elsewhere.
pub fn gemma3_270m() -> ModelConfig {
    ModelConfig {
        family: Family::Gemma3,
        vocab_size: 262_144,
        hidden: 640,
        intermediate: 2048,
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
        rms_eps: 1e-6,
        query_scale: 1.0 / 16.0,
        attn_softcap: None,
        final_softcap: None,
        layers: (0..18)
            .map(|i| {
                if (i + 1) % 6 == 0 {
                    LayerAttention {
                        window: None,
                        rope_base: 1_000_000.0,
                        rope_scale: 1.0,
                    }
                } else {
                    LayerAttention {
                        window: Some(512),
                        rope_base: 10_000.0,
                        rope_scale: 1.0,
                    }
                }
            })
            .collect(),
        norm_weight_offset: 0.0,
        max_context: 32_768,
        bos_id: 2,
        eos_id: 1,
        layer_shapes: Vec::new(),
        features: Default::default(),
    }
}
