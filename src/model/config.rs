//! The one model description both file formats produce.
//!
//! Gemma generations differ in a handful of switches (post-norms, q/k norm,
//! softcaps, sliding windows, per-layer rope bases); this table of switches
//! is all the forward pass looks at, in the spirit of gemma.cpp's per-model
//! config tables.

use anyhow::{Result, bail};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Gemma 1 (gemma-2b, gemma-7b): pre-norms only.
    Gemma1,
    /// Gemma 2: pre- and post-norms, softcaps, alternating local/global.
    Gemma2,
    /// Gemma 3 text: pre- and post-norms, q/k norm, 5 local : 1 global.
    Gemma3,
    /// Gemma 4 text: Gemma 3's block with per-layer shapes, RMSNorm by `w`,
    /// attention scale 1, a weightless V norm and a scalar per layer; some
    /// models add per-layer inputs, KV sharing or a mixture of experts
    /// ([`Features`]).
    Gemma4,
    /// Gemma 3n text (E2B, E4B): Gemma 4's block (RMSNorm by `w`, scale 1,
    /// V norm, per-layer inputs, KV sharing) with AltUp's parallel
    /// streams, the LAuReL residual and activation sparsity
    /// ([`Features::altup`], [`Features::laurel_rank`],
    /// [`LayerShape::sparsity_cut`]).
    Gemma3n,
}

/// The shape of one layer where a family lets layers differ.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerShape {
    pub head_dim: usize,
    pub n_kv_heads: usize,
    /// Width of the feed-forward's hidden layer (gate and up rows).
    pub ffn_width: usize,
    /// RoPE rotates pairs `(i, i + head_dim/2)` for `i < rotated_pairs`,
    /// with frequencies over the whole head (`base^(-2i/head_dim)`); the
    /// rest pass unrotated. `head_dim / 2` is ordinary RoPE; fewer is
    /// Gemma 4's proportional RoPE on global layers.
    pub rotated_pairs: usize,
    /// The layer whose keys and values this one attends over: itself, or
    /// for a layer that shares KV an earlier layer of the same kind (it
    /// then has no K and V projections and keeps no cache).
    pub kv_layer: usize,
    /// V is the K projection's output (before K's norm and RoPE): the
    /// layer has no V projection (`attention_k_eq_v`).
    pub values_from_keys: bool,
    /// Gemma 3n's activation sparsity: `Some(c)` cuts the feed-forward's
    /// gate pre-activations to `relu(g - (mean(g) + c * std(g)))` over the
    /// layer's width (a Gaussian top-k; `c` is the standard normal
    /// quantile of the fraction cut).
    pub sparsity_cut: Option<f32>,
}

/// Gemma 3n's AltUp: the residual is `streams` parallel vectors; each
/// layer computes on the `active` one, predicts the others from it and
/// corrects them with what the layer added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AltUp {
    pub streams: usize,
    pub active: usize,
    /// The per-layer input's gate reads the active stream times a stored
    /// scale (`altup_correct_scale`).
    pub correct_scale: bool,
}

/// A mixture-of-experts feed-forward beside the dense one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Hidden width of one expert.
    pub width: usize,
    /// `[width, hidden]`: an expert's gate or up matrix (borrowed as the
    /// shape of per-expert tensor views).
    pub gate_shape: [usize; 2],
    /// `[hidden, width]`: an expert's down matrix.
    pub down_shape: [usize; 2],
}

impl MoeShape {
    pub fn new(experts: usize, top_k: usize, width: usize, hidden: usize) -> MoeShape {
        MoeShape {
            experts,
            top_k,
            width,
            gate_shape: [width, hidden],
            down_shape: [hidden, width],
        }
    }
}

/// Operations only some models have; all off for Gemma 1-3.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Features {
    /// Per-layer inputs (Gemma 4 "PLE"): each token gets a vector of this
    /// many values per layer, gated into the residual after the block.
    pub per_layer_input: usize,
    pub moe: Option<MoeShape>,
    /// V heads get an RMS normalisation without weights.
    pub value_norm: bool,
    /// Each layer ends by scaling the residual stream by a stored scalar.
    pub layer_scalar: bool,
    /// Rows of the per-layer token table (with per-layer inputs): ids past
    /// it read row 0, as transformers maps them (Gemma 3n's table leaves
    /// out the multimodal tokens at the end of the vocabulary).
    pub per_layer_vocab: usize,
    /// Gemma 3n: the residual as parallel streams ([`AltUp`]).
    pub altup: Option<AltUp>,
    /// Gemma 3n's LAuReL: a low-rank branch of this rank beside attention
    /// (0 = none).
    pub laurel_rank: usize,
    /// A Gemma 4 assistant (drafter): its layers keep no keys and values
    /// but attend over its target's (see `model::gemma4_assistant`).
    pub assistant: Option<AssistantShape>,
}

/// What a Gemma 4 assistant adds to the Gemma 4 block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AssistantShape {
    /// The target's hidden width: the assistant reads the target's scaled
    /// embedding and final hidden state, side by side, and writes the next
    /// draft's hidden state back at this width.
    pub backbone_hidden: usize,
    /// The LM head ranked through clusters of the vocabulary, or `None`:
    /// the whole tied head.
    pub clusters: Option<HeadClusters>,
}

/// The assistant's LM head by clusters (transformers'
/// `Gemma4AssistantMaskedEmbedder`): the `top_k` clusters whose centroids
/// score highest are the only rows computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadClusters {
    pub count: usize,
    pub top_k: usize,
}

/// How one layer attends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// `Some(w)`: a query at q sees keys k with q - w < k <= q.
    pub window: Option<usize>,
    /// RoPE base frequency for this layer.
    pub rope_base: f32,
    /// Linear RoPE scaling: positions are divided by this factor (1 = none).
    pub rope_scale: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    /// Multiplier applied to queries before q·k: 1/sqrt(query_pre_attn_scalar).
    pub query_scale: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    pub layers: Vec<LayerAttention>,
    /// Added to every stored RMSNorm weight at load: HF stores w and means
    /// (1 + w); GGUF already stores (1 + w).
    pub norm_weight_offset: f32,
    pub max_context: usize,
    pub bos_id: u32,
    pub eos_id: u32,
    /// Each layer's shape where layers differ; empty when every layer has
    /// the shape of the fields above (see [`ModelConfig::shape`]).
    pub layer_shapes: Vec<LayerShape>,
    pub features: Features,
}

impl ModelConfig {
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `i`'s shape.
    pub fn shape(&self, i: usize) -> LayerShape {
        match self.layer_shapes.get(i) {
            Some(s) => *s,
            None => LayerShape {
                head_dim: self.head_dim,
                n_kv_heads: self.n_kv_heads,
                ffn_width: self.intermediate,
                rotated_pairs: self.head_dim / 2,
                kv_layer: i,
                values_from_keys: false,
                sparsity_cut: None,
            },
        }
    }

    /// Whether layer `i` computes and caches keys and values of its own
    /// (an assistant's layers read their target's).
    pub fn keeps_kv(&self, i: usize) -> bool {
        self.features.assistant.is_none() && self.shape(i).kv_layer == i
    }

    /// The widest query row (heads x head dim) of any layer.
    pub fn max_q_width(&self) -> usize {
        (0..self.n_layers())
            .map(|i| self.n_heads * self.shape(i).head_dim)
            .max()
            .unwrap_or(0)
    }

    /// The widest key or value row (KV heads x head dim) of any layer.
    pub fn max_kv_width(&self) -> usize {
        (0..self.n_layers())
            .map(|i| self.shape(i).n_kv_heads * self.shape(i).head_dim)
            .max()
            .unwrap_or(0)
    }

    /// The widest feed-forward of any layer (dense or one expert).
    pub fn max_ffn_width(&self) -> usize {
        (0..self.n_layers())
            .map(|i| self.shape(i).ffn_width)
            .chain(self.features.moe.map(|m| m.width))
            .max()
            .unwrap_or(0)
    }

    /// Gemma 2 and 3 wrap attention and feed-forward in post-norms too.
    pub fn has_post_norms(&self) -> bool {
        matches!(
            self.family,
            Family::Gemma2 | Family::Gemma3 | Family::Gemma4 | Family::Gemma3n
        )
    }

    /// Gemma 3, 3n and 4 normalize each query and key head before RoPE.
    pub fn has_qk_norm(&self) -> bool {
        matches!(
            self.family,
            Family::Gemma3 | Family::Gemma4 | Family::Gemma3n
        )
    }

    /// The row of the per-layer token table a token reads: its own, or
    /// row 0 past the table's end (transformers' mapping).
    pub fn per_layer_row(&self, token: u32) -> usize {
        let t = token as usize;
        if t < self.features.per_layer_vocab {
            t
        } else {
            0
        }
    }

    /// Checks the relations the forward pass relies on.
    pub fn validate(&self, origin: &Path) -> Result<()> {
        let o = origin.display();
        for (name, v) in [
            ("vocab size", self.vocab_size),
            ("hidden size", self.hidden),
            ("intermediate size", self.intermediate),
            ("head count", self.n_heads),
            ("KV head count", self.n_kv_heads),
            ("head dim", self.head_dim),
            ("layer count", self.layers.len()),
        ] {
            if v == 0 || v > 1 << 24 {
                bail!("{o}: {name} {v} is zero or absurd");
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "{o}: {} query heads cannot be grouped over {} KV heads",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("{o}: head dim {} must be even for RoPE", self.head_dim);
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            bail!("{o}: RMSNorm epsilon {} is invalid", self.rms_eps);
        }
        if !(self.query_scale.is_finite() && self.query_scale > 0.0) {
            bail!("{o}: query scale {} is invalid", self.query_scale);
        }
        for l in &self.layers {
            if !(l.rope_base.is_finite() && l.rope_base > 1.0) {
                bail!("{o}: RoPE base {} is invalid", l.rope_base);
            }
            if l.window == Some(0) {
                bail!("{o}: a sliding window of 0 tokens sees nothing");
            }
        }
        if !self.layer_shapes.is_empty() && self.layer_shapes.len() != self.layers.len() {
            bail!(
                "{o}: {} layer shapes for {} layers",
                self.layer_shapes.len(),
                self.layers.len()
            );
        }
        for i in 0..self.n_layers() {
            let s = self.shape(i);
            if s.head_dim == 0 || s.head_dim > 1 << 16 || !s.head_dim.is_multiple_of(2) {
                bail!(
                    "{o}: layer {i}'s head dim {} is zero, odd or absurd",
                    s.head_dim
                );
            }
            if s.n_kv_heads == 0 || !self.n_heads.is_multiple_of(s.n_kv_heads) {
                bail!(
                    "{o}: layer {i}: {} query heads cannot be grouped over {} KV heads",
                    self.n_heads,
                    s.n_kv_heads
                );
            }
            if s.ffn_width == 0 || s.ffn_width > 1 << 24 {
                bail!(
                    "{o}: layer {i}'s feed-forward width {} is zero or absurd",
                    s.ffn_width
                );
            }
            if s.rotated_pairs > s.head_dim / 2 {
                bail!(
                    "{o}: layer {i} rotates {} pairs of a {}-dim head",
                    s.rotated_pairs,
                    s.head_dim
                );
            }
            if let Some(cut) = s.sparsity_cut
                && !cut.is_finite()
            {
                bail!("{o}: layer {i}'s activation sparsity multiplier {cut} is not finite");
            }
            if s.kv_layer > i {
                bail!(
                    "{o}: layer {i} cannot share the keys of the later layer {}",
                    s.kv_layer
                );
            }
            let source = self.shape(s.kv_layer);
            if source.kv_layer != s.kv_layer
                || (source.head_dim, source.n_kv_heads) != (s.head_dim, s.n_kv_heads)
                || self.layers[s.kv_layer].window != self.layers[i].window
            {
                bail!(
                    "{o}: layer {i} shares the keys of layer {}, which has another shape or kind",
                    s.kv_layer
                );
            }
        }
        if let Some(m) = self.features.moe
            && (m.experts == 0
                || m.top_k == 0
                || m.top_k > m.experts
                || m.width == 0
                || m.experts > 1 << 16)
        {
            bail!(
                "{o}: {} experts with {} used per token and width {} is not a valid mixture",
                m.experts,
                m.top_k,
                m.width
            );
        }
        let f = &self.features;
        if f.per_layer_input > 0 && (f.per_layer_vocab == 0 || f.per_layer_vocab > self.vocab_size)
        {
            bail!(
                "{o}: a per-layer token table of {} rows for a vocabulary of {}",
                f.per_layer_vocab,
                self.vocab_size
            );
        }
        if let Some(a) = f.altup
            && !(2..=16).contains(&a.streams)
        {
            bail!(
                "{o}: AltUp with {} streams (Pulsar runs 2 to 16)",
                a.streams
            );
        }
        if let Some(a) = f.altup
            && a.active != 0
        {
            // transformers and llama.cpp both hard-code stream 0 where the
            // per-layer input and the final merge read the streams.
            bail!(
                "{o}: AltUp active stream {} has no agreed meaning; only 0 is supported",
                a.active
            );
        }
        if f.laurel_rank > 1 << 16 {
            bail!("{o}: LAuReL rank {} is absurd", f.laurel_rank);
        }
        for cap in [self.attn_softcap, self.final_softcap]
            .into_iter()
            .flatten()
        {
            if !(cap.is_finite() && cap > 0.0) {
                bail!("{o}: softcap {cap} must be positive");
            }
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_config(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("{}: cannot read config: {e}", path.display()))?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{}: not valid JSON: {e}", path.display()))?;
        Self::from_hf_json(&root, path)
    }

    /// Builds the description from parsed `config.json` (both the
    /// transformers 4 and 5 key styles).
    pub fn from_hf_json(root: &Value, path: &Path) -> Result<ModelConfig> {
        let p = path.display();
        if !root.is_object() {
            bail!("{p}: config must be a JSON object");
        }
        let model_type = str_key(root, "model_type", path)?;
        if matches!(model_type.as_str(), "gemma4" | "gemma4_text") {
            return super::gemma4::config_from_hf(root, &model_type, path);
        }
        if model_type == super::gemma4_assistant::HF_MODEL_TYPE {
            return super::gemma4_assistant::config_from_hf(root, path);
        }
        if matches!(model_type.as_str(), "gemma3n" | "gemma3n_text") {
            return super::gemma3n::config_from_hf(root, &model_type, path);
        }
        // Multimodal Gemma 3 checkpoints nest the text model.
        let cfg = if model_type == "gemma3" {
            root.get("text_config")
                .filter(|v| v.is_object())
                .ok_or_else(|| {
                    anyhow::anyhow!("{p}: model_type gemma3 needs a text_config object")
                })?
        } else {
            root
        };
        let family = match model_type.as_str() {
            "gemma" => Family::Gemma1,
            "gemma2" => Family::Gemma2,
            "gemma3" | "gemma3_text" => Family::Gemma3,
            other => bail!(
                "{p}: model_type {other:?} is not supported (Pulsar runs gemma, gemma2, gemma3_text, gemma3n_text, gemma4_text)"
            ),
        };
        let r = Reader { v: cfg, path };
        let hidden = r.usize("hidden_size")?;
        let n_heads = r.usize("num_attention_heads")?;
        let n_layers = r.usize("num_hidden_layers")?;
        if n_layers == 0 || n_layers > 4096 {
            bail!("{p}: num_hidden_layers {n_layers} is zero or absurd");
        }
        let head_dim = match r.opt_usize("head_dim")? {
            Some(h) => h,
            None if n_heads > 0 => hidden / n_heads,
            None => bail!("{p}: num_attention_heads is 0"),
        };
        let activation = r
            .opt_str("hidden_activation")?
            .or(r.opt_str("hidden_act")?)
            .unwrap_or_else(|| "gelu_pytorch_tanh".into());
        // Gemma checkpoints say "gelu" but were trained with the tanh form.
        if !matches!(
            activation.as_str(),
            "gelu" | "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast"
        ) {
            bail!("{p}: activation {activation:?} is not a GELU; Pulsar runs GeGLU models only");
        }

        let (global_base, local_base, global_scale) = rope_bases(cfg, family, path)?;
        let window = r.opt_usize("sliding_window")?;
        let is_global = layer_kinds(cfg, family, n_layers, path)?;
        let layers = is_global
            .iter()
            .map(|&global| {
                Ok(if global || window.is_none() {
                    LayerAttention {
                        window: None,
                        rope_base: global_base,
                        rope_scale: global_scale,
                    }
                } else {
                    LayerAttention {
                        window,
                        rope_base: local_base,
                        rope_scale: 1.0,
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;

        let query_pre_attn_scalar = match family {
            Family::Gemma1 => head_dim as f64,
            _ => r
                .opt_f64("query_pre_attn_scalar")?
                .unwrap_or(head_dim as f64),
        };
        // Gemma 3 configs carry null softcaps, Gemma 1 none at all.
        let softcap = |key: &str| -> Result<Option<f32>> { Ok(r.opt_f64(key)?.map(|v| v as f32)) };
        let config = ModelConfig {
            family,
            vocab_size: r.usize("vocab_size")?,
            hidden,
            intermediate: r.usize("intermediate_size")?,
            n_heads,
            n_kv_heads: r.opt_usize("num_key_value_heads")?.unwrap_or(n_heads),
            head_dim,
            rms_eps: r.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            query_scale: (1.0 / query_pre_attn_scalar.sqrt()) as f32,
            attn_softcap: softcap("attn_logit_softcapping")?,
            final_softcap: softcap("final_logit_softcapping")?,
            layers,
            norm_weight_offset: 1.0,
            max_context: r.opt_usize("max_position_embeddings")?.unwrap_or(8192),
            bos_id: r.opt_usize("bos_token_id")?.unwrap_or(2) as u32,
            eos_id: first_id(cfg.get("eos_token_id")).unwrap_or(1),
            layer_shapes: Vec::new(),
            features: Features::default(),
        };
        config.validate(path)?;
        Ok(config)
    }
}

/// `eos_token_id` may be a number or a list of numbers.
pub(super) fn first_id(v: Option<&Value>) -> Option<u32> {
    match v? {
        Value::Number(n) => n.as_u64().map(|x| x as u32),
        Value::Array(a) => a.first().and_then(|x| x.as_u64()).map(|x| x as u32),
        _ => None,
    }
}

/// (global base, local base, global linear scale) from either key style:
/// `rope_theta` + `rope_local_base_freq` + `rope_scaling` (transformers 4) or
/// `rope_parameters`, flat or per layer type (transformers 5).
fn rope_bases(cfg: &Value, family: Family, path: &Path) -> Result<(f32, f32, f32)> {
    let r = Reader { v: cfg, path };
    let mut global = r.opt_f64("rope_theta")?.unwrap_or(10_000.0);
    let mut local = r
        .opt_f64("rope_local_base_freq")?
        .unwrap_or(if family == Family::Gemma3 {
            10_000.0
        } else {
            global
        });
    let mut scale = linear_factor(cfg.get("rope_scaling"), path)?;
    if let Some(params) = cfg.get("rope_parameters").filter(|v| v.is_object()) {
        let pr = Reader { v: params, path };
        if let Some(theta) = pr.opt_f64("rope_theta")? {
            global = theta;
            local = if family == Family::Gemma3 {
                local
            } else {
                theta
            };
            scale = linear_factor(Some(params), path)?;
        }
        if let Some(full) = params.get("full_attention") {
            if let Some(t) = (Reader { v: full, path }).opt_f64("rope_theta")? {
                global = t;
            }
            scale = linear_factor(Some(full), path)?;
        }
        if let Some(sliding) = params.get("sliding_attention")
            && let Some(t) = (Reader { v: sliding, path }).opt_f64("rope_theta")?
        {
            local = t;
        }
    }
    Ok((global as f32, local as f32, scale))
}

/// The factor of a `{"rope_type": "linear", "factor": f}` block, else 1.
fn linear_factor(v: Option<&Value>, path: &Path) -> Result<f32> {
    let Some(v) = v.filter(|v| v.is_object()) else {
        return Ok(1.0);
    };
    let kind = v
        .get("rope_type")
        .or(v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(1.0),
        "linear" => {
            let f = (Reader { v, path }).opt_f64("factor")?.unwrap_or(1.0);
            if !(f.is_finite() && f > 0.0) {
                bail!("{}: rope scaling factor {f} is invalid", path.display());
            }
            Ok(f as f32)
        }
        other => bail!(
            "{}: rope scaling type {other:?} is not supported (only linear)",
            path.display()
        ),
    }
}

/// Which layers attend globally, from `layer_types` or the older
/// `sliding_window_pattern`, else the family's fixed pattern.
fn layer_kinds(cfg: &Value, family: Family, n_layers: usize, path: &Path) -> Result<Vec<bool>> {
    let p = path.display();
    if let Some(types) = cfg.get("layer_types").filter(|v| !v.is_null()) {
        let arr = types
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("{p}: layer_types must be a list"))?;
        if arr.len() != n_layers {
            bail!(
                "{p}: layer_types lists {} layers but num_hidden_layers is {n_layers}",
                arr.len()
            );
        }
        return arr
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                _ => bail!("{p}: layer_types entry {t} is not full_attention or sliding_attention"),
            })
            .collect();
    }
    Ok(match family {
        Family::Gemma1 => vec![true; n_layers],
        // Gemma 2 alternates, starting with a sliding layer.
        Family::Gemma2 => (0..n_layers).map(|i| i % 2 == 1).collect(),
        Family::Gemma3 | Family::Gemma4 | Family::Gemma3n => {
            let r = Reader { v: cfg, path };
            let pattern = r.opt_usize("sliding_window_pattern")?.unwrap_or(6).max(1);
            (0..n_layers).map(|i| (i + 1) % pattern == 0).collect()
        }
    })
}

pub(super) fn str_key(v: &Value, key: &str, path: &Path) -> Result<String> {
    (Reader { v, path })
        .opt_str(key)?
        .ok_or_else(|| anyhow::anyhow!("{}: key {key:?} is missing", path.display()))
}

/// The text model's config of an HF `config.json`: the root for a text
/// checkpoint, `text_config` for the image/audio-text one (`multimodal`,
/// e.g. "gemma4"), and a reader of it with its layer count checked.
pub(super) fn hf_text_config<'a>(
    root: &'a Value,
    model_type: &str,
    multimodal: &str,
    path: &'a Path,
) -> Result<(Reader<'a>, usize)> {
    let p = path.display();
    let cfg = if model_type == multimodal {
        root.get("text_config")
            .filter(|v| v.is_object())
            .ok_or_else(|| {
                anyhow::anyhow!("{p}: model_type {multimodal} needs a text_config object")
            })?
    } else {
        root
    };
    let r = Reader { v: cfg, path };
    let n_layers = r.usize("num_hidden_layers")?;
    if n_layers == 0 || n_layers > 4096 {
        bail!("{p}: num_hidden_layers {n_layers} is zero or absurd");
    }
    Ok((r, n_layers))
}

/// Typed access to JSON keys with errors naming the file and key.
pub(super) struct Reader<'a> {
    pub v: &'a Value,
    pub path: &'a Path,
}

impl Reader<'_> {
    pub(super) fn opt(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn wrong(&self, key: &str, want: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{}: key {key:?} should be {want}, found {}",
            self.path.display(),
            self.v.get(key).map(|v| v.to_string()).unwrap_or_default()
        )
    }

    pub(super) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.wrong(key, "a non-negative integer")),
        }
    }

    pub(super) fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| anyhow::anyhow!("{}: key {key:?} is missing", self.path.display()))
    }

    pub(super) fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.opt(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong(key, "a number")),
        }
    }

    pub(super) fn opt_str(&self, key: &str) -> Result<Option<String>> {
        match self.opt(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.wrong(key, "a string")),
        }
    }
}
