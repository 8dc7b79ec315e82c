//! Gemma 4's model description from either format: the per-layer shapes
//! (two head sizes and KV head counts, proportional RoPE on global layers,
//! KV sharing, the double-wide MLP of the sharing layers) and the
//! features it adds (per-layer inputs, the mixture of experts, the V norm
//! and the layer scalar).
//!
//! transformers 5.23 (`models/gemma4`) is the definition; llama.cpp's
//! converter (`Gemma4Model`) writes the same facts under `gemma4.*` keys.

use super::config::{
    Family, Features, LayerAttention, LayerShape, ModelConfig, MoeShape, Reader, first_id,
    hf_text_config,
};
use super::gguf::{GgufFile, Value as GgufValue};
use anyhow::{Result, bail};
use serde_json::Value;
use std::path::Path;

/// What decides every layer's shape, gathered from either format.
pub(super) struct Layout {
    pub(super) sliding: Vec<bool>,
    head_dim: usize,
    global_head_dim: usize,
    kv_heads: Vec<usize>,
    ffn_widths: Vec<usize>,
    /// Pairs RoPE rotates on global layers.
    global_rotated_pairs: usize,
    pub(super) shared_kv_layers: usize,
    pub(super) values_from_keys: bool,
}

impl Layout {
    /// Each layer's shape (whose keys it reads: [`kv_producers`]).
    fn shapes(&self, path: &Path) -> Result<Vec<LayerShape>> {
        let producers = kv_producers(&self.sliding, self.shared_kv_layers, path)?;
        (0..self.sliding.len())
            .map(|i| {
                let sliding = self.sliding[i];
                let kv_layer = producers[i];
                let head_dim = if sliding {
                    self.head_dim
                } else {
                    self.global_head_dim
                };
                Ok(LayerShape {
                    head_dim,
                    n_kv_heads: self.kv_heads[i],
                    ffn_width: self.ffn_widths[i],
                    rotated_pairs: if sliding {
                        head_dim / 2
                    } else {
                        self.global_rotated_pairs.min(head_dim / 2)
                    },
                    kv_layer,
                    values_from_keys: self.values_from_keys && !sliding,
                    sparsity_cut: None,
                })
            })
            .collect()
    }
}

/// The layer whose keys each layer attends over, given which layers slide
/// and how many at the end share: a layer at or past `L - shared` reuses
/// the keys of the last earlier layer of its kind that keeps its own
/// (transformers' rule for Gemma 3n and 4; llama.cpp hard-codes layers
/// L-s-2 and L-s-1, which agree for the released models).
pub(super) fn kv_producers(sliding: &[bool], shared: usize, path: &Path) -> Result<Vec<usize>> {
    let n = sliding.len();
    let p = path.display();
    if shared >= n && n > 0 {
        bail!("{p}: {shared} KV-sharing layers of {n} leave no layer that computes keys");
    }
    let first_shared = n - shared;
    (0..n)
        .map(|i| {
            if i < first_shared {
                return Ok(i);
            }
            (0..first_shared)
                .rev()
                .find(|&j| sliding[j] == sliding[i])
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{p}: layer {i} shares keys, but no earlier {} layer computes them",
                        if sliding[i] { "sliding" } else { "global" }
                    )
                })
        })
        .collect()
}

/// The parts common to both formats: the config from the layout and the
/// scalars.
pub(super) struct Scalars {
    pub(super) vocab_size: usize,
    pub(super) hidden: usize,
    n_heads: usize,
    rms_eps: f32,
    pub(super) final_softcap: Option<f32>,
    window: Option<usize>,
    global_base: f32,
    local_base: f32,
    max_context: usize,
    bos_id: u32,
    eos_id: u32,
    pub(super) features: Features,
}

pub(super) fn assemble(s: Scalars, layout: &Layout, path: &Path) -> Result<ModelConfig> {
    let shapes = layout.shapes(path)?;
    let layers = layout
        .sliding
        .iter()
        .map(|&sliding| LayerAttention {
            window: if sliding { s.window } else { None },
            rope_base: if sliding { s.local_base } else { s.global_base },
            rope_scale: 1.0,
        })
        .collect();
    let first = shapes.first().copied();
    let config = ModelConfig {
        family: Family::Gemma4,
        vocab_size: s.vocab_size,
        hidden: s.hidden,
        intermediate: first.map_or(0, |f| f.ffn_width),
        n_heads: s.n_heads,
        n_kv_heads: first.map_or(0, |f| f.n_kv_heads),
        head_dim: first.map_or(0, |f| f.head_dim),
        rms_eps: s.rms_eps,
        // Gemma 4 folds the attention temperature into q_norm and k_norm.
        query_scale: 1.0,
        attn_softcap: None,
        final_softcap: s.final_softcap,
        layers,
        // Gemma 4's RMSNorm multiplies by the stored weight itself, in
        // safetensors and GGUF alike.
        norm_weight_offset: 0.0,
        max_context: s.max_context,
        bos_id: s.bos_id,
        eos_id: s.eos_id,
        layer_shapes: shapes,
        features: s.features,
    };
    config.validate(path)?;
    Ok(config)
}

/// Pairs proportional RoPE rotates: `int(p * D // 2)`.
fn proportional_pairs(factor: f64, head_dim: usize) -> usize {
    ((factor * head_dim as f64) / 2.0).floor() as usize
}

/// A Hugging Face `config.json` of `gemma4_text`, or the text part of a
/// `gemma4` (image/audio-text) checkpoint.
pub fn config_from_hf(root: &Value, model_type: &str, path: &Path) -> Result<ModelConfig> {
    let (r, n_layers) = hf_text_config(root, model_type, "gemma4", path)?;
    let (scalars, layout) = read_hf_text(&r, n_layers)?;
    assemble(scalars, &layout, path)
}

/// The scalars and layer layout of a Gemma 4 text config (`r`, of
/// `n_layers` layers): what [`config_from_hf`] assembles, and what a
/// Gemma 4 assistant's `text_config` holds.
pub(super) fn read_hf_text(r: &Reader<'_>, n_layers: usize) -> Result<(Scalars, Layout)> {
    let path = r.path;
    let p = path.display();
    let cfg = r.v;
    let hidden = r.usize("hidden_size")?;
    let n_heads = r.usize("num_attention_heads")?;
    let activation = r
        .opt_str("hidden_activation")?
        .unwrap_or_else(|| "gelu_pytorch_tanh".into());
    if !matches!(activation.as_str(), "gelu_pytorch_tanh" | "gelu") {
        bail!("{p}: hidden_activation {activation:?} is not the tanh GELU Gemma 4 uses");
    }
    let types = cfg
        .get("layer_types")
        .and_then(|t| t.as_array())
        .ok_or_else(|| anyhow::anyhow!("{p}: key \"layer_types\" (a list) is missing"))?;
    if types.len() != n_layers {
        bail!(
            "{p}: layer_types lists {} layers but num_hidden_layers is {n_layers}",
            types.len()
        );
    }
    let sliding = types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => bail!("{p}: layer_types entry {t} is not full_attention or sliding_attention"),
        })
        .collect::<Result<Vec<bool>>>()?;
    let head_dim = r.usize("head_dim")?;
    let kv_heads = r.usize("num_key_value_heads")?;
    let mut global_head_dim = r.opt_usize("global_head_dim")?.unwrap_or(head_dim);
    let global_kv_heads = r
        .opt_usize("num_global_key_value_heads")?
        .unwrap_or(kv_heads);
    let mut kv_per_layer: Vec<usize> = sliding
        .iter()
        .map(|&s| if s { kv_heads } else { global_kv_heads })
        .collect();
    // `per_layer_config` is what transformers itself reads.
    if let Some(per_layer) = cfg.get("per_layer_config").and_then(|v| v.as_object()) {
        for (key, entry) in per_layer {
            let i: usize = key.parse().ok().filter(|&i| i < n_layers).ok_or_else(|| {
                anyhow::anyhow!("{p}: per_layer_config key {key:?} is not a layer")
            })?;
            let er = Reader { v: entry, path };
            if let Some(h) = er.opt_usize("head_dim")? {
                if sliding[i] && h != head_dim {
                    bail!(
                        "{p}: per_layer_config gives sliding layer {i} head_dim {h}, not {head_dim}"
                    );
                }
                if !sliding[i] {
                    global_head_dim = h;
                }
            }
            if let Some(k) = er.opt_usize("num_key_value_heads")? {
                kv_per_layer[i] = k;
            }
        }
    }
    let intermediate = r.usize("intermediate_size")?;
    let shared = r.opt_usize("num_kv_shared_layers")?.unwrap_or(0);
    let double_wide = cfg
        .get("use_double_wide_mlp")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let ffn_widths = (0..n_layers)
        .map(|i| {
            if double_wide && shared > 0 && i >= n_layers.saturating_sub(shared) {
                2 * intermediate
            } else {
                intermediate
            }
        })
        .collect();

    let (mut global_base, mut local_base, mut global_pairs) = (1e6, 1e4, global_head_dim / 2);
    if let Some(params) = cfg.get("rope_parameters").filter(|v| v.is_object()) {
        if let Some(full) = params.get("full_attention") {
            let fr = Reader { v: full, path };
            global_base = fr.opt_f64("rope_theta")?.unwrap_or(global_base);
            match fr.opt_str("rope_type")?.as_deref() {
                None | Some("default") => {}
                Some("proportional") => {
                    let factor = fr.opt_f64("partial_rotary_factor")?.unwrap_or(1.0);
                    if !(factor > 0.0 && factor <= 1.0) {
                        bail!("{p}: partial_rotary_factor {factor} is not in (0, 1]");
                    }
                    global_pairs = proportional_pairs(factor, global_head_dim);
                }
                Some(other) => bail!(
                    "{p}: rope_type {other:?} of full_attention is not supported (default, proportional)"
                ),
            }
        }
        if let Some(sliding) = params.get("sliding_attention") {
            let sr = Reader { v: sliding, path };
            local_base = sr.opt_f64("rope_theta")?.unwrap_or(local_base);
            if let Some(kind) = sr.opt_str("rope_type")?
                && kind != "default"
            {
                bail!("{p}: rope_type {kind:?} of sliding_attention is not supported (default)");
            }
        }
    }

    let per_layer_input = r.opt_usize("hidden_size_per_layer_input")?.unwrap_or(0);
    if per_layer_input > 0 {
        let ple_vocab = r.opt_usize("vocab_size_per_layer_input")?;
        let vocab = r.usize("vocab_size")?;
        if ple_vocab.is_some_and(|v| v != vocab) {
            bail!(
                "{p}: vocab_size_per_layer_input differs from vocab_size; Pulsar needs them equal"
            );
        }
    }
    let moe = if cfg
        .get("enable_moe_block")
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
    {
        Some(MoeShape::new(
            r.usize("num_experts")?,
            r.usize("top_k_experts")?,
            r.usize("moe_intermediate_size")?,
            hidden,
        ))
    } else {
        None
    };
    let layout = Layout {
        sliding,
        head_dim,
        global_head_dim,
        kv_heads: kv_per_layer,
        ffn_widths,
        global_rotated_pairs: global_pairs,
        shared_kv_layers: shared,
        values_from_keys: cfg
            .get("attention_k_eq_v")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
    };
    let softcap = r.opt_f64("final_logit_softcapping")?.map(|v| v as f32);
    let scalars = Scalars {
        vocab_size: r.usize("vocab_size")?,
        hidden,
        n_heads,
        rms_eps: r.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        final_softcap: softcap.filter(|&c| c > 0.0),
        window: r.opt_usize("sliding_window")?,
        global_base: global_base as f32,
        local_base: local_base as f32,
        max_context: r.opt_usize("max_position_embeddings")?.unwrap_or(131_072),
        bos_id: r.opt_usize("bos_token_id")?.unwrap_or(2) as u32,
        eos_id: first_id(cfg.get("eos_token_id")).unwrap_or(1),
        features: Features {
            per_layer_input,
            moe,
            value_norm: true,
            layer_scalar: true,
            per_layer_vocab: r.usize("vocab_size")?,
            ..Features::default()
        },
    };
    Ok((scalars, layout))
}

/// A per-layer GGUF key: an array of one entry per layer, or one value
/// for all.
pub(super) fn per_layer(g: &GgufFile, key: &str, n: usize) -> Result<Option<Vec<f64>>> {
    let p = g.path().display();
    let Some(v) = g.get(key) else {
        return Ok(None);
    };
    let number = |x: &GgufValue| match x {
        GgufValue::Bool(b) => Some(f64::from(u8::from(*b))),
        other => other.as_f64(),
    };
    match v {
        GgufValue::Array(items) => {
            if items.len() != n {
                bail!(
                    "{p}: metadata {key:?} has {} entries for {n} layers",
                    items.len()
                );
            }
            items
                .iter()
                .map(|x| {
                    number(x).ok_or_else(|| {
                        anyhow::anyhow!(
                            "{p}: metadata {key:?} should hold numbers, found {}",
                            x.brief()
                        )
                    })
                })
                .collect::<Result<Vec<f64>>>()
                .map(Some)
        }
        other => match number(other) {
            Some(x) => Ok(Some(vec![x; n])),
            None => bail!(
                "{p}: metadata {key:?} should be a number or an array, found {}",
                other.brief()
            ),
        },
    }
}

pub(super) fn whole(values: Vec<f64>, key: &str, path: &Path) -> Result<Vec<usize>> {
    values
        .into_iter()
        .map(|v| {
            if v >= 0.0 && v.fract() == 0.0 && v < (1u64 << 32) as f64 {
                Ok(v as usize)
            } else {
                bail!(
                    "{}: metadata {key:?} holds {v}, not a count",
                    path.display()
                )
            }
        })
        .collect()
}

/// The layer count, width and query heads of a GGUF's `ARCH.*` metadata,
/// checked (Gemma 4 and Gemma 3n read them alike).
pub(super) fn gguf_dims(g: &GgufFile, arch: &str) -> Result<(usize, usize, usize)> {
    let p = g.path().display();
    let key = |k: &str| format!("{arch}.{k}");
    let n_layers = g.require_usize(&key("block_count"))?;
    if n_layers == 0 || n_layers > 4096 {
        bail!("{p}: block_count {n_layers} is zero or absurd");
    }
    let hidden = g.require_usize(&key("embedding_length"))?;
    let n_heads = g.require_usize(&key("attention.head_count"))?;
    if n_heads == 0 {
        bail!("{p}: metadata key {:?} is 0", key("attention.head_count"));
    }
    Ok((n_layers, hidden, n_heads))
}

/// Gemma 4's description from llama.cpp's `gemma4.*` metadata.
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let (scalars, layout) = read_gguf(g, "gemma4")?;
    assemble(scalars, &layout, g.path())
}

/// The scalars and layer layout of a GGUF's `ARCH.*` metadata as
/// llama.cpp's Gemma 4 converter writes it (`gemma4`, and its
/// `gemma4-assistant` subclass).
pub(super) fn read_gguf(g: &GgufFile, arch: &str) -> Result<(Scalars, Layout)> {
    let path = g.path();
    let p = path.display();
    let key = |k: &str| format!("{arch}.{k}");
    let (n_layers, hidden, n_heads) = gguf_dims(g, arch)?;
    let sliding: Vec<bool> = match per_layer(g, &key("attention.sliding_window_pattern"), n_layers)?
    {
        Some(flags) => flags.into_iter().map(|f| f != 0.0).collect(),
        None => bail!(
            "{p}: metadata key {:?} is missing (which layers slide)",
            key("attention.sliding_window_pattern")
        ),
    };
    let kv_key = key("attention.head_count_kv");
    let kv_heads = match per_layer(g, &kv_key, n_layers)? {
        Some(v) => whole(v, &kv_key, path)?,
        None => vec![n_heads; n_layers],
    };
    let ffn_key = key("feed_forward_length");
    let ffn_widths = match per_layer(g, &ffn_key, n_layers)? {
        Some(v) => whole(v, &ffn_key, path)?,
        None => bail!("{p}: metadata key {ffn_key:?} is missing"),
    };
    let global_head_dim = g
        .get_usize(&key("attention.key_length"))?
        .unwrap_or(hidden / n_heads);
    let head_dim = g
        .get_usize(&key("attention.key_length_swa"))?
        .unwrap_or(global_head_dim);
    for (k, expect) in [
        ("attention.value_length", global_head_dim),
        ("attention.value_length_swa", head_dim),
    ] {
        if let Some(v) = g.get_usize(&key(k))?
            && v != expect
        {
            bail!(
                "{p}: metadata {:?} is {v}, but Pulsar needs it equal to the key length {expect}",
                key(k)
            );
        }
    }
    // Proportional RoPE is written as NeoX RoPE over the whole head with
    // a frequency factor per pair: 1 for the pairs that rotate, 1e30 (no
    // rotation) for the rest.
    let global_pairs = match g.tensor("rope_freqs.weight") {
        Some(t) => {
            let factors = super::dequant::to_f32(&t);
            if factors.len() != global_head_dim / 2 {
                bail!(
                    "{p}: tensor \"rope_freqs.weight\" has {} factors for a {global_head_dim}-dim head",
                    factors.len()
                );
            }
            let rotating = factors.iter().take_while(|&&f| f == 1.0).count();
            if let Some(f) = factors[rotating..].iter().find(|&&f| f < 1e20) {
                bail!(
                    "{p}: tensor \"rope_freqs.weight\" holds the factor {f}; Pulsar reads only 1 (rotate) and 1e30 (keep) as Gemma 4 writes them"
                );
            }
            rotating
        }
        None => {
            let dims = g
                .get_usize(&key("rope.dimension_count"))?
                .unwrap_or(global_head_dim);
            if dims != global_head_dim {
                bail!(
                    "{p}: rope.dimension_count {dims} differs from the global head dim {global_head_dim} and there is no rope_freqs tensor to say which pairs rotate"
                );
            }
            global_head_dim / 2
        }
    };
    let embd = g
        .tensor_info("token_embd.weight")
        .ok_or_else(|| anyhow::anyhow!("{p}: tensor \"token_embd.weight\" is missing"))?;
    let vocab_size = embd.shape[0];
    let experts = g.get_usize(&key("expert_count"))?.unwrap_or(0);
    let moe = if experts > 0 {
        Some(MoeShape::new(
            experts,
            g.require_usize(&key("expert_used_count"))?,
            g.require_usize(&key("expert_feed_forward_length"))?,
            hidden,
        ))
    } else {
        None
    };
    // The converter writes no k = v flag: a global layer with K and no V
    // takes its values from K.
    let values_from_keys = (0..n_layers).any(|i| {
        !sliding[i]
            && g.tensor_info(&format!("blk.{i}.attn_k.weight")).is_some()
            && g.tensor_info(&format!("blk.{i}.attn_v.weight")).is_none()
    });
    let layout = Layout {
        sliding,
        head_dim,
        global_head_dim,
        kv_heads,
        ffn_widths,
        global_rotated_pairs: global_pairs,
        shared_kv_layers: g
            .get_usize(&key("attention.shared_kv_layers"))?
            .unwrap_or(0),
        values_from_keys,
    };
    let scalars = Scalars {
        vocab_size,
        hidden,
        n_heads,
        rms_eps: g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6) as f32,
        final_softcap: g
            .get_f64(&key("final_logit_softcapping"))?
            .filter(|&v| v > 0.0)
            .map(|v| v as f32),
        window: g.get_usize(&key("attention.sliding_window"))?,
        global_base: g.get_f64(&key("rope.freq_base"))?.unwrap_or(1e6) as f32,
        local_base: g.get_f64(&key("rope.freq_base_swa"))?.unwrap_or(1e4) as f32,
        max_context: g.get_usize(&key("context_length"))?.unwrap_or(131_072),
        bos_id: g.get_usize("tokenizer.ggml.bos_token_id")?.unwrap_or(2) as u32,
        eos_id: g.get_usize("tokenizer.ggml.eos_token_id")?.unwrap_or(1) as u32,
        features: Features {
            per_layer_input: g
                .get_usize(&key("embedding_length_per_layer_input"))?
                .unwrap_or(0),
            moe,
            value_norm: true,
            layer_scalar: true,
            per_layer_vocab: vocab_size,
            ..Features::default()
        },
    };
    Ok((scalars, layout))
}

/// A released Gemma 4 model's text shape (`../shared/oracle/gemma4/shapes.md`),
/// for planning and benchmarking without the weights.
pub struct ReleasedShape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads_sliding: usize,
    pub kv_heads_global: usize,
    pub ffn: usize,
    /// The FFN of the KV-sharing layers is twice as wide.
    pub double_wide: bool,
    pub window: usize,
    /// Sliding layers before each global one.
    pub sliding_per_global: usize,
    pub per_layer_input: usize,
    pub shared_kv_layers: usize,
    pub values_from_keys: bool,
    /// (experts, used per token, expert width).
    pub moe: Option<(usize, usize, usize)>,
    pub context: usize,
}

impl ReleasedShape {
    pub fn config(&self) -> ModelConfig {
        let n = self.layers;
        // Every (pattern+1)-th layer global, and the last one always.
        let sliding: Vec<bool> = (0..n)
            .map(|i| (i + 1) % (self.sliding_per_global + 1) != 0 && i + 1 != n)
            .collect();
        let layout = Layout {
            kv_heads: sliding
                .iter()
                .map(|&s| {
                    if s {
                        self.kv_heads_sliding
                    } else {
                        self.kv_heads_global
                    }
                })
                .collect(),
            ffn_widths: (0..n)
                .map(|i| {
                    if self.double_wide && i >= n - self.shared_kv_layers {
                        2 * self.ffn
                    } else {
                        self.ffn
                    }
                })
                .collect(),
            sliding,
            head_dim: 256,
            global_head_dim: 512,
            global_rotated_pairs: proportional_pairs(0.25, 512),
            shared_kv_layers: self.shared_kv_layers,
            values_from_keys: self.values_from_keys,
        };
        let scalars = Scalars {
            vocab_size: 262_144,
            hidden: self.hidden,
            n_heads: self.heads,
            rms_eps: 1e-6,
            final_softcap: Some(30.0),
            window: Some(self.window),
            global_base: 1e6,
            local_base: 1e4,
            max_context: self.context,
            bos_id: 2,
            eos_id: 1,
            features: Features {
                per_layer_input: self.per_layer_input,
                moe: self
                    .moe
                    .map(|(e, k, w)| MoeShape::new(e, k, w, self.hidden)),
                value_norm: true,
                layer_scalar: true,
                per_layer_vocab: 262_144,
                ..Features::default()
            },
        };
        assemble(scalars, &layout, Path::new("(built-in shape)"))
            .expect("the built-in Gemma 4 shapes are valid")
    }
}

/// The shape of a Gemma 4 assistant (drafter) beside a released target,
/// for benchmarking without the weights. Its structure is the released
/// assistants' (4 layers, three sliding then one global, the target's head
/// sizes and KV heads, 2,048 head clusters of which 32 are searched);
/// their widths could not be read here, so `hidden` and `ffn` are
/// assumptions, named as such wherever a figure is reported.
pub struct ReleasedAssistant {
    pub target: &'static ReleasedShape,
    pub hidden: usize,
    pub heads: usize,
    pub ffn: usize,
}

impl ReleasedAssistant {
    pub fn config(&self) -> ModelConfig {
        let t = self.target;
        let sliding = vec![true, true, true, false];
        let layout = Layout {
            kv_heads: sliding
                .iter()
                .map(|&s| {
                    if s {
                        t.kv_heads_sliding
                    } else {
                        t.kv_heads_global
                    }
                })
                .collect(),
            ffn_widths: vec![self.ffn; 4],
            sliding,
            head_dim: 256,
            global_head_dim: 512,
            global_rotated_pairs: proportional_pairs(0.25, 512),
            shared_kv_layers: 0,
            values_from_keys: false,
        };
        let scalars = Scalars {
            vocab_size: 262_144,
            hidden: self.hidden,
            n_heads: self.heads,
            rms_eps: 1e-6,
            final_softcap: None,
            window: Some(t.window),
            global_base: 1e6,
            local_base: 1e4,
            max_context: t.context,
            bos_id: 2,
            eos_id: 1,
            features: Features {
                value_norm: true,
                layer_scalar: true,
                per_layer_vocab: 262_144,
                assistant: Some(super::config::AssistantShape {
                    backbone_hidden: t.hidden,
                    clusters: Some(super::config::HeadClusters {
                        count: 2048,
                        top_k: 32,
                    }),
                }),
                ..Features::default()
            },
        };
        assemble(scalars, &layout, Path::new("(built-in shape)"))
            .expect("the built-in assistant shapes are valid")
    }
}

/// E2B's assistant: width 512 and MLP 2048 assumed (see
/// [`ReleasedAssistant`]).
pub const E2B_ASSISTANT: ReleasedAssistant = ReleasedAssistant {
    target: &E2B,
    hidden: 512,
    heads: 8,
    ffn: 2048,
};

/// E4B's assistant: width 768 and MLP 3072 assumed.
pub const E4B_ASSISTANT: ReleasedAssistant = ReleasedAssistant {
    target: &E4B,
    hidden: 768,
    heads: 8,
    ffn: 3072,
};

pub const E2B: ReleasedShape = ReleasedShape {
    hidden: 1536,
    layers: 35,
    heads: 8,
    kv_heads_sliding: 1,
    kv_heads_global: 1,
    ffn: 6144,
    double_wide: true,
    window: 512,
    sliding_per_global: 4,
    per_layer_input: 256,
    shared_kv_layers: 20,
    values_from_keys: false,
    moe: None,
    context: 131_072,
};

pub const E4B: ReleasedShape = ReleasedShape {
    hidden: 2560,
    layers: 42,
    heads: 8,
    kv_heads_sliding: 2,
    kv_heads_global: 2,
    ffn: 10_240,
    double_wide: false,
    window: 512,
    sliding_per_global: 5,
    per_layer_input: 256,
    shared_kv_layers: 18,
    values_from_keys: false,
    moe: None,
    context: 131_072,
};

pub const MOE_26B_A4B: ReleasedShape = ReleasedShape {
    hidden: 2816,
    layers: 30,
    heads: 16,
    kv_heads_sliding: 8,
    kv_heads_global: 2,
    ffn: 2112,
    double_wide: false,
    window: 1024,
    sliding_per_global: 5,
    per_layer_input: 0,
    shared_kv_layers: 0,
    values_from_keys: true,
    moe: Some((128, 8, 704)),
    context: 262_144,
};

pub const DENSE_31B: ReleasedShape = ReleasedShape {
    hidden: 5376,
    layers: 60,
    heads: 32,
    kv_heads_sliding: 16,
    kv_heads_global: 4,
    ffn: 21_504,
    double_wide: false,
    window: 1024,
    sliding_per_global: 5,
    per_layer_input: 0,
    shared_kv_layers: 0,
    values_from_keys: true,
    moe: None,
    context: 262_144,
};
