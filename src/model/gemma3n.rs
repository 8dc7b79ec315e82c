//! Gemma 3n's model description from either format: Gemma 4's block with
//! one head size, per-layer MLP widths, per-layer inputs and KV sharing,
//! plus what 3n adds: AltUp's parallel residual streams, the LAuReL
//! low-rank branch and the activation sparsity of the early layers.
//!
//! transformers 5.23 (`models/gemma3n`, `Gemma3nTextConfig`) is the
//! definition; llama.cpp's converter (`Gemma3NModel`) writes the same facts
//! under `gemma3n.*` keys. `tests/data/gemma3n/README.md` lists both.

use super::config::{
    AltUp, Family, Features, LayerAttention, LayerShape, ModelConfig, Reader, hf_text_config,
};
use super::gemma4::{gguf_dims, kv_producers, per_layer, whole};
use super::gguf::GgufFile;
use anyhow::{Result, bail};
use serde_json::Value;
use std::path::Path;

/// Everything either format says, before it becomes a [`ModelConfig`].
struct Description {
    vocab_size: usize,
    hidden: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Per layer: whether it slides, its MLP width and its sparsity
    /// multiplier.
    sliding: Vec<bool>,
    ffn_widths: Vec<usize>,
    sparsity_cuts: Vec<Option<f32>>,
    shared_kv_layers: usize,
    window: usize,
    global_base: f32,
    local_base: f32,
    rms_eps: f32,
    final_softcap: Option<f32>,
    max_context: usize,
    bos_id: u32,
    eos_id: u32,
    per_layer_input: usize,
    per_layer_vocab: usize,
    altup: AltUp,
    laurel_rank: usize,
}

fn assemble(d: Description, path: &Path) -> Result<ModelConfig> {
    let p = path.display();
    if d.per_layer_input == 0 {
        bail!("{p}: the per-layer input width is 0; every Gemma 3n model has per-layer inputs");
    }
    if d.laurel_rank == 0 {
        bail!("{p}: the LAuReL rank is 0; every Gemma 3n model has a LAuReL branch");
    }
    let producers = kv_producers(&d.sliding, d.shared_kv_layers, path)?;
    let layer_shapes = (0..d.sliding.len())
        .map(|i| LayerShape {
            head_dim: d.head_dim,
            n_kv_heads: d.n_kv_heads,
            ffn_width: d.ffn_widths[i],
            rotated_pairs: d.head_dim / 2,
            kv_layer: producers[i],
            values_from_keys: false,
            sparsity_cut: d.sparsity_cuts[i],
        })
        .collect();
    let layers = d
        .sliding
        .iter()
        .map(|&sliding| LayerAttention {
            window: sliding.then_some(d.window),
            rope_base: if sliding { d.local_base } else { d.global_base },
            rope_scale: 1.0,
        })
        .collect();
    let config = ModelConfig {
        family: Family::Gemma3n,
        vocab_size: d.vocab_size,
        hidden: d.hidden,
        intermediate: d.ffn_widths.first().copied().unwrap_or(0),
        n_heads: d.n_heads,
        n_kv_heads: d.n_kv_heads,
        head_dim: d.head_dim,
        rms_eps: d.rms_eps,
        // As in Gemma 4, the attention temperature is in q_norm and k_norm.
        query_scale: 1.0,
        attn_softcap: None,
        final_softcap: d.final_softcap,
        layers,
        // Gemma3nRMSNorm multiplies by the stored weight, in both formats.
        norm_weight_offset: 0.0,
        max_context: d.max_context,
        bos_id: d.bos_id,
        eos_id: d.eos_id,
        layer_shapes,
        features: Features {
            per_layer_input: d.per_layer_input,
            moe: None,
            value_norm: true,
            layer_scalar: false,
            per_layer_vocab: d.per_layer_vocab,
            altup: Some(d.altup),
            laurel_rank: d.laurel_rank,
            assistant: None,
        },
    };
    config.validate(path)?;
    Ok(config)
}

/// The multiplier of the Gaussian top-k for a sparsity target (the
/// fraction of gate values cut): `Φ⁻¹(target)` rounded to f32, as
/// transformers computes it; `None` for 0 (no cut).
fn sparsity_cut(target: f64, layer: usize, path: &Path) -> Result<Option<f32>> {
    if target == 0.0 {
        return Ok(None);
    }
    if !(target > 0.0 && target < 1.0) {
        bail!(
            "{}: activation_sparsity_pattern gives layer {layer} {target}, not a fraction in [0, 1)",
            path.display()
        );
    }
    Ok(Some(normal_quantile(target) as f32))
}

/// The standard normal quantile `Φ⁻¹(p)` for `0 < p < 1`, by bisection on
/// [`normal_cdf`]: to the last bit of an f64, which rounds to the right
/// f32 (transformers' `Normal.icdf` in f32 gives 1.6448535919 for 0.95).
fn normal_quantile(p: f64) -> f64 {
    let (mut lo, mut hi) = (-40.0f64, 40.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// `Φ(z) = (1 + erf(z / √2)) / 2`, through erfc in the tails so that the
/// small probabilities keep their precision.
fn normal_cdf(z: f64) -> f64 {
    let x = z / std::f64::consts::SQRT_2;
    if x < -2.5 {
        0.5 * erfc_tail(-x)
    } else if x > 2.5 {
        1.0 - 0.5 * erfc_tail(x)
    } else {
        0.5 * (1.0 + erf_series(x))
    }
}

/// erf by its Maclaurin series, `2/√π Σ (-1)^n x^(2n+1) / (n! (2n+1))`;
/// for |x| <= 2.5 its terms stay below e^6.25, so f64 keeps about 13
/// digits.
fn erf_series(x: f64) -> f64 {
    let x2 = x * x;
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x2 / n as f64;
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// erfc for x >= 2.5 by its continued fraction, `e^(-x²)/√π · 1/(x +
/// (1/2)/(x + 1/(x + (3/2)/(x + ...))))`, evaluated from the back.
fn erfc_tail(x: f64) -> f64 {
    let mut f = x;
    for k in (1..=200).rev() {
        f = x + (k as f64 / 2.0) / f;
    }
    (-x * x).exp() / (std::f64::consts::PI.sqrt() * f)
}

/// transformers' default sparsity: 0.95 on the first 10 layers of a model
/// with more than 10, none elsewhere.
fn default_sparsity(n_layers: usize) -> Vec<f64> {
    let sparse = if n_layers > 10 { 10 } else { 0 };
    (0..n_layers)
        .map(|i| if i < sparse { 0.95 } else { 0.0 })
        .collect()
}

/// A JSON key that holds one number for every layer or a list of one per
/// layer.
fn per_layer_json(r: &Reader<'_>, key: &str, n: usize) -> Result<Option<Vec<f64>>> {
    let p = r.path.display();
    let Some(v) = r.opt(key) else {
        return Ok(None);
    };
    if let Some(x) = v.as_f64() {
        return Ok(Some(vec![x; n]));
    }
    let items = v
        .as_array()
        .ok_or_else(|| r.wrong(key, "a number or a list of one per layer"))?;
    if items.len() != n {
        bail!("{p}: {key} has {} entries for {n} layers", items.len());
    }
    items
        .iter()
        .map(|x| {
            x.as_f64()
                .ok_or_else(|| anyhow::anyhow!("{p}: {key} should hold numbers, found {x}"))
        })
        .collect::<Result<Vec<f64>>>()
        .map(Some)
}

/// A Hugging Face `config.json` of `gemma3n_text`, or the text part of a
/// `gemma3n` (image/audio-text) checkpoint.
pub fn config_from_hf(root: &Value, model_type: &str, path: &Path) -> Result<ModelConfig> {
    let p = path.display();
    let (r, n_layers) = hf_text_config(root, model_type, "gemma3n", path)?;
    let cfg = r.v;
    let activation = r
        .opt_str("hidden_activation")?
        .unwrap_or_else(|| "gelu_pytorch_tanh".into());
    if !matches!(activation.as_str(), "gelu_pytorch_tanh" | "gelu") {
        bail!("{p}: hidden_activation {activation:?} is not the tanh GELU Gemma 3n uses");
    }
    let sliding = match cfg.get("layer_types").filter(|v| !v.is_null()) {
        Some(types) => {
            let types = types
                .as_array()
                .ok_or_else(|| r.wrong("layer_types", "a list"))?;
            if types.len() != n_layers {
                bail!(
                    "{p}: layer_types lists {} layers but num_hidden_layers is {n_layers}",
                    types.len()
                );
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => bail!(
                        "{p}: layer_types entry {t} is not full_attention or sliding_attention"
                    ),
                })
                .collect::<Result<Vec<bool>>>()?
        }
        // transformers' default: every fifth layer global.
        None => (0..n_layers).map(|i| (i + 1) % 5 != 0).collect(),
    };
    let ffn_widths = match per_layer_json(&r, "intermediate_size", n_layers)? {
        Some(widths) => whole(widths, "intermediate_size", path)?,
        None => bail!("{p}: key \"intermediate_size\" is missing"),
    };
    let sparsity = per_layer_json(&r, "activation_sparsity_pattern", n_layers)?
        .unwrap_or_else(|| default_sparsity(n_layers));
    let sparsity_cuts = sparsity
        .iter()
        .enumerate()
        .map(|(i, &t)| sparsity_cut(t, i, path))
        .collect::<Result<Vec<_>>>()?;

    let (mut global_base, mut local_base) = (
        r.opt_f64("rope_theta")?.unwrap_or(1e6),
        r.opt_f64("rope_local_base_freq")?.unwrap_or(1e4),
    );
    if let Some(params) = cfg.get("rope_parameters").filter(|v| v.is_object()) {
        for (kind, base) in [
            ("full_attention", &mut global_base),
            ("sliding_attention", &mut local_base),
        ] {
            let Some(entry) = params.get(kind) else {
                continue;
            };
            let er = Reader { v: entry, path };
            if let Some(t) = er.opt_f64("rope_theta")? {
                *base = t;
            }
            if let Some(t) = er.opt_str("rope_type")?
                && t != "default"
            {
                bail!("{p}: rope_type {t:?} of {kind} is not supported (default)");
            }
        }
    }
    let vocab_size = r.usize("vocab_size")?;
    let desc = Description {
        vocab_size,
        hidden: r.usize("hidden_size")?,
        n_heads: r.usize("num_attention_heads")?,
        n_kv_heads: r.usize("num_key_value_heads")?,
        head_dim: r.usize("head_dim")?,
        sliding,
        ffn_widths,
        sparsity_cuts,
        shared_kv_layers: r.opt_usize("num_kv_shared_layers")?.unwrap_or(15),
        window: r.opt_usize("sliding_window")?.unwrap_or(512),
        global_base: global_base as f32,
        local_base: local_base as f32,
        rms_eps: r.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        final_softcap: r
            .opt_f64("final_logit_softcapping")?
            .filter(|&c| c > 0.0)
            .map(|c| c as f32),
        max_context: r.opt_usize("max_position_embeddings")?.unwrap_or(32_768),
        bos_id: r.opt_usize("bos_token_id")?.unwrap_or(2) as u32,
        eos_id: super::config::first_id(cfg.get("eos_token_id")).unwrap_or(1),
        per_layer_input: r.opt_usize("hidden_size_per_layer_input")?.unwrap_or(256),
        per_layer_vocab: r
            .opt_usize("vocab_size_per_layer_input")?
            .unwrap_or(vocab_size.min(262_144)),
        altup: AltUp {
            streams: r.opt_usize("altup_num_inputs")?.unwrap_or(4),
            active: r.opt_usize("altup_active_idx")?.unwrap_or(0),
            correct_scale: match r.opt("altup_correct_scale") {
                None => true,
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| r.wrong("altup_correct_scale", "true or false"))?,
            },
        },
        laurel_rank: r.opt_usize("laurel_rank")?.unwrap_or(64),
    };
    assemble(desc, path)
}

/// Gemma 3n's description from llama.cpp's `gemma3n.*` metadata. LAuReL's
/// rank and the per-layer table's rows are not in the metadata; they come
/// from the tensors' shapes.
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let path = g.path();
    let p = path.display();
    let key = |k: &str| format!("gemma3n.{k}");
    let (n_layers, hidden, n_heads) = gguf_dims(g, "gemma3n")?;
    let kv_key = key("attention.head_count_kv");
    let n_kv_heads = match per_layer(g, &kv_key, n_layers)? {
        Some(v) => {
            let v = whole(v, &kv_key, path)?;
            if v.iter().any(|&k| k != v[0]) {
                bail!(
                    "{p}: metadata {kv_key:?} differs between layers; Gemma 3n has one KV head count"
                );
            }
            v[0]
        }
        None => n_heads,
    };
    let head_dim = g
        .get_usize(&key("attention.key_length"))?
        .unwrap_or(hidden / n_heads);
    if let Some(v) = g.get_usize(&key("attention.value_length"))?
        && v != head_dim
    {
        bail!(
            "{p}: metadata {:?} is {v}, but Pulsar needs it equal to the key length {head_dim}",
            key("attention.value_length")
        );
    }
    let sliding = match per_layer(g, &key("attention.sliding_window_pattern"), n_layers)? {
        Some(flags) => flags.into_iter().map(|f| f != 0.0).collect(),
        None => (0..n_layers).map(|i| (i + 1) % 5 != 0).collect(),
    };
    let ffn_key = key("feed_forward_length");
    let ffn_widths = match per_layer(g, &ffn_key, n_layers)? {
        Some(v) => whole(v, &ffn_key, path)?,
        None => bail!("{p}: metadata key {ffn_key:?} is missing"),
    };
    // The multiplier itself, -inf where a layer has no cut.
    let sparsity_key = key("activation_sparsity_scale");
    let sparsity_cuts = match per_layer(g, &sparsity_key, n_layers)? {
        Some(v) => v
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                if c == f64::NEG_INFINITY {
                    Ok(None)
                } else if c.is_finite() {
                    Ok(Some(c as f32))
                } else {
                    bail!("{p}: metadata {sparsity_key:?} gives layer {i} {c}, not a multiplier or -inf")
                }
            })
            .collect::<Result<Vec<_>>>()?,
        None => vec![None; n_layers],
    };
    let rows = |name: &str| -> Result<usize> {
        g.tensor_info(name)
            .map(|t| t.shape[0])
            .ok_or_else(|| anyhow::anyhow!("{p}: tensor {name:?} is missing"))
    };
    let active = g.get_usize(&key("altup.active_idx"))?.unwrap_or(0);
    let streams = g.get_usize(&key("altup.num_inputs"))?.unwrap_or(4);
    let desc = Description {
        vocab_size: rows("token_embd.weight")?,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        sliding,
        ffn_widths,
        sparsity_cuts,
        shared_kv_layers: g
            .get_usize(&key("attention.shared_kv_layers"))?
            .unwrap_or(0),
        window: g
            .get_usize(&key("attention.sliding_window"))?
            .unwrap_or(512),
        global_base: g.get_f64(&key("rope.freq_base"))?.unwrap_or(1e6) as f32,
        local_base: g.get_f64(&key("rope.freq_base_swa"))?.unwrap_or(1e4) as f32,
        rms_eps: g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6) as f32,
        final_softcap: g
            .get_f64(&key("final_logit_softcapping"))?
            .filter(|&v| v > 0.0)
            .map(|v| v as f32),
        max_context: g.get_usize(&key("context_length"))?.unwrap_or(32_768),
        bos_id: g.get_usize("tokenizer.ggml.bos_token_id")?.unwrap_or(2) as u32,
        eos_id: g.get_usize("tokenizer.ggml.eos_token_id")?.unwrap_or(1) as u32,
        per_layer_input: g
            .get_usize(&key("embedding_length_per_layer_input"))?
            .unwrap_or(256),
        // The converter pads the table with zero rows to the vocabulary,
        // so every id reads its own row (zeros past the original table,
        // where transformers reads row 0: only the multimodal soft tokens).
        per_layer_vocab: rows("per_layer_token_embd.weight")?,
        altup: AltUp {
            streams,
            active,
            // llama.cpp always scales the per-layer input's gate input.
            correct_scale: true,
        },
        laurel_rank: rows("blk.0.laurel_l.weight")?,
    };
    assemble(desc, path)
}

/// A released Gemma 3n model's text shape (transformers'
/// `Gemma3nTextConfig`; E4B is its default), for planning and
/// benchmarking without the weights.
pub struct ReleasedShape {
    pub layers: usize,
    pub ffn: usize,
    pub shared_kv_layers: usize,
}

impl ReleasedShape {
    pub fn config(&self) -> ModelConfig {
        let n = self.layers;
        let desc = Description {
            vocab_size: 262_400,
            hidden: 2048,
            n_heads: 8,
            n_kv_heads: 2,
            head_dim: 256,
            sliding: (0..n).map(|i| (i + 1) % 5 != 0).collect(),
            ffn_widths: vec![self.ffn; n],
            sparsity_cuts: default_sparsity(n)
                .into_iter()
                .map(|t| (t > 0.0).then(|| normal_quantile(t) as f32))
                .collect(),
            shared_kv_layers: self.shared_kv_layers,
            window: 512,
            global_base: 1e6,
            local_base: 1e4,
            rms_eps: 1e-6,
            final_softcap: Some(30.0),
            max_context: 32_768,
            bos_id: 2,
            eos_id: 1,
            per_layer_input: 256,
            per_layer_vocab: 262_144,
            altup: AltUp {
                streams: 4,
                active: 0,
                correct_scale: true,
            },
            laurel_rank: 64,
        };
        assemble(desc, Path::new("(built-in shape)"))
            .expect("the built-in Gemma 3n shapes are valid")
    }
}

pub const E2B: ReleasedShape = ReleasedShape {
    layers: 30,
    ffn: 8192,
    shared_kv_layers: 10,
};

pub const E4B: ReleasedShape = ReleasedShape {
    layers: 35,
    ffn: 16_384,
    shared_kv_layers: 15,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_rounds_as_transformers_computes_it() {
        // transformers' Normal(0, 1).icdf in f32 and llama.cpp's file
        // hold 1.6448535919 (bits 0x3fd28a90) for 0.95.
        assert_eq!((normal_quantile(0.95) as f32).to_bits(), 0x3fd2_8a90);
        assert_eq!((normal_quantile(0.9) as f32).to_bits(), 0x3fa4_09e2);
        assert!((normal_quantile(0.9) - 1.281_551_565_544_600_5).abs() < 1e-13);
        assert!((normal_quantile(0.5)).abs() < 1e-15);
        assert!((normal_quantile(0.001) + 3.090_232_306_167_813_6).abs() < 1e-11);
        assert!((normal_quantile(1e-9) + 5.997_807_015_007_686).abs() < 1e-9);
    }

    #[test]
    fn the_released_shapes_are_valid() {
        for shape in [E2B, E4B] {
            let c = shape.config();
            assert_eq!(c.family, Family::Gemma3n);
            let shared: Vec<usize> = (0..c.n_layers()).filter(|&i| !c.keeps_kv(i)).collect();
            assert_eq!(shared.len(), shape.shared_kv_layers);
            assert!(c.shape(9).sparsity_cut.is_some() && c.shape(10).sparsity_cut.is_none());
        }
    }
}
