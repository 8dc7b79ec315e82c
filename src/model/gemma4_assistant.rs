//! A Gemma 4 assistant: the small drafter each Gemma 4 model ships for
//! multi-token prediction (transformers 5.23 `Gemma4AssistantForCausalLM`,
//! llama.cpp's `gemma4-assistant`).
//!
//! It is Gemma 4's block with three changes, so its description is a
//! Gemma 4 [`ModelConfig`] read by Gemma 4's readers plus
//! [`AssistantShape`]:
//! - its layers compute no keys or values: each attends over the cache of
//!   its target's last layer of the same kind ([`target_kv_layers`]);
//! - its input is the target's scaled embedding of a token beside the
//!   target's final hidden state, projected into its width, and its final
//!   hidden state is projected back to the target's width for the next
//!   draft (`pre_projection`, `post_projection`);
//! - its LM head (its own embedding, tied) may be ranked through clusters
//!   of the vocabulary (`masked_embedding`: centroids and a token
//!   ordering), and has no softcap.
//!
//! llama.cpp's converter writes the GGUF under `gemma4-assistant.*` keys
//! with `embedding_length_out` for the target's width, and drops the
//! centroids and the token ordering (a GGUF assistant from it ranks
//! through the whole head).

use super::config::{AssistantShape, HeadClusters, ModelConfig, Reader, hf_text_config};
use super::dtype::DType;
use super::gemma4::{Layout, Scalars, assemble, read_gguf, read_hf_text};
use super::gguf::GgufFile;
use super::source::{ModelSource, Role};
use anyhow::{Result, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// `model_type` of an assistant's `config.json`.
pub const HF_MODEL_TYPE: &str = "gemma4_assistant";
/// `general.architecture` of an assistant's GGUF.
pub const GGUF_ARCH: &str = "gemma4-assistant";

/// An assistant's description from its `config.json` (the Gemma 4 text
/// model under `text_config`, the target's width and the head's clusters
/// at the top).
pub fn config_from_hf(root: &Value, path: &Path) -> Result<ModelConfig> {
    let p = path.display();
    let (r, n_layers) = hf_text_config(root, HF_MODEL_TYPE, HF_MODEL_TYPE, path)?;
    // What transformers' `Gemma4AssistantConfig.validate_architecture`
    // refuses, refused here with the key named.
    for key in ["hidden_size_per_layer_input", "vocab_size_per_layer_input"] {
        if r.opt_usize(key)?.is_some_and(|v| v != 0) {
            bail!("{p}: text_config key {key:?} must be 0 in an assistant");
        }
    }
    for key in ["enable_moe_block", "use_double_wide_mlp"] {
        if r.opt(key).and_then(|v| v.as_bool()) == Some(true) {
            bail!("{p}: text_config key {key:?} must be false in an assistant");
        }
    }
    // transformers makes every layer share (num_kv_shared_layers =
    // num_hidden_layers) when the config leaves it out.
    if let Some(shared) = r.opt_usize("num_kv_shared_layers")?
        && shared != 0
        && shared != n_layers
    {
        bail!(
            "{p}: text_config num_kv_shared_layers is {shared}; every one of an assistant's {n_layers} layers reads its target's keys"
        );
    }
    let (scalars, mut layout) = read_hf_text(&r, n_layers)?;
    // Its layers keep no cache and have no K or V of their own
    // (`attention_k_eq_v` only sets the global KV head count).
    layout.shared_kv_layers = 0;
    layout.values_from_keys = false;
    let top = Reader { v: root, path };
    let clusters = if top.opt("use_ordered_embeddings").and_then(|v| v.as_bool()) == Some(true) {
        Some(HeadClusters {
            count: top.opt_usize("num_centroids")?.unwrap_or(2048),
            top_k: top.opt_usize("centroid_intermediate_top_k")?.unwrap_or(32),
        })
    } else {
        None
    };
    let backbone_hidden = top.usize("backbone_hidden_size")?;
    finish(scalars, &layout, backbone_hidden, clusters, path)
}

/// An assistant's description from llama.cpp's `gemma4-assistant.*`
/// metadata: Gemma 4's keys, with `embedding_length_out` the target's
/// width.
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let path = g.path();
    let p = path.display();
    let key = |k: &str| format!("{GGUF_ARCH}.{k}");
    let (scalars, mut layout) = read_gguf(g, GGUF_ARCH)?;
    let n_layers = layout.sliding.len();
    if let Some(drafting) = g.get_usize(&key("nextn_predict_layers"))?
        && drafting != n_layers
    {
        bail!(
            "{p}: metadata {:?} is {drafting}, but Pulsar reads assistants whose {n_layers} layers all draft",
            key("nextn_predict_layers")
        );
    }
    layout.shared_kv_layers = 0;
    layout.values_from_keys = false;
    if scalars.features.per_layer_input > 0 || scalars.features.moe.is_some() {
        bail!("{p}: an assistant has no per-layer inputs and no experts");
    }
    let backbone_hidden = g.require_usize(&key("embedding_length_out"))?;
    // A file that kept the clusters (llama.cpp's converter drops them)
    // says how many are searched; without that key, the whole head.
    let clusters = match (
        g.tensor_info(&super::source::gguf_name(Role::HeadCentroids)),
        g.get_usize(&key("centroid_top_k"))?,
    ) {
        (Some(t), Some(top_k)) if t.shape.len() == 2 => Some(HeadClusters {
            count: t.shape[0],
            top_k,
        }),
        _ => None,
    };
    finish(scalars, &layout, backbone_hidden, clusters, path)
}

/// The description of either layout from Gemma 4's reading of it: the
/// assistant's own shape added, its relations checked.
fn finish(
    mut scalars: Scalars,
    layout: &Layout,
    backbone_hidden: usize,
    clusters: Option<HeadClusters>,
    path: &Path,
) -> Result<ModelConfig> {
    // The assistant's logits are its head's products as they are.
    scalars.final_softcap = None;
    scalars.features.assistant = Some(AssistantShape {
        backbone_hidden,
        clusters,
    });
    let config = assemble(scalars, layout, path)?;
    check_shape(&config, path)?;
    Ok(config)
}

/// The relations an assistant's own description must keep.
fn check_shape(c: &ModelConfig, path: &Path) -> Result<()> {
    let p = path.display();
    let Some(a) = c.features.assistant else {
        return Ok(());
    };
    if a.backbone_hidden == 0 || a.backbone_hidden > 1 << 20 {
        bail!(
            "{p}: the target width {} is zero or absurd",
            a.backbone_hidden
        );
    }
    if let Some(k) = a.clusters {
        if k.count == 0 || !c.vocab_size.is_multiple_of(k.count) {
            bail!(
                "{p}: {} head clusters do not divide the vocabulary of {}",
                k.count,
                c.vocab_size
            );
        }
        if k.top_k == 0 || k.top_k > k.count {
            bail!(
                "{p}: {} of {} head clusters searched per draft is not a valid choice",
                k.top_k,
                k.count
            );
        }
    }
    Ok(())
}

/// The clustered head's token ordering: the ids of cluster 0's tokens,
/// then cluster 1's, …, checked to hold every id of the vocabulary once.
pub fn token_ordering(src: &ModelSource) -> Result<Vec<u32>> {
    let vocab = src.config.vocab_size;
    let role = Role::HeadTokenOrdering;
    let t = src.tensor(role, &[vocab])?;
    let name = src.tensor_name(role);
    let p = src.path.display();
    let ids: Vec<i64> = match t.dtype {
        DType::I64 => t
            .bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect(),
        DType::I32 => t
            .bytes
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .collect(),
        other => bail!("{p}: tensor {name:?} is {other}; token ids must be I32 or I64"),
    };
    let mut seen = vec![false; vocab];
    for (i, &id) in ids.iter().enumerate() {
        let slot = usize::try_from(id)
            .ok()
            .filter(|&v| v < vocab)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "{p}: tensor {name:?} entry {i} is {id}, not a token id (vocabulary {vocab})"
                )
            })?;
        if std::mem::replace(&mut seen[slot], true) {
            bail!("{p}: tensor {name:?} holds token {id} twice; it must order the vocabulary");
        }
    }
    Ok(ids.into_iter().map(|id| id as u32).collect())
}

/// Refuses an assistant where a model to run is wanted (`-m`).
pub fn refuse_as_model(c: &ModelConfig, path: &Path) -> Result<()> {
    if c.features.assistant.is_some() {
        bail!(
            "{}: is a Gemma 4 assistant (a drafter), not a model to run: give it with --draft beside the model it drafts for",
            path.display()
        );
    }
    Ok(())
}

/// Checks that `assistant` drafts for `target` and returns, for each of
/// the assistant's layers, the target layer whose keys and values it
/// attends over: the cache the target's last layer of the same kind
/// (sliding or global) reads. (transformers hands over the KV of the last
/// layer of each kind that keeps its own; llama.cpp the caches of the
/// target's layers L-2 and L-1. Both are that cache in the released
/// models.)
pub fn target_kv_layers(
    target: &ModelConfig,
    target_path: &Path,
    assistant: &ModelConfig,
    assistant_path: &Path,
) -> Result<Vec<usize>> {
    let (t, a) = (target_path.display(), assistant_path.display());
    let Some(shape) = assistant.features.assistant else {
        bail!(
            "{a}: is not a Gemma 4 assistant; --draft takes a Gemma4AssistantForCausalLM folder or a {GGUF_ARCH} GGUF"
        );
    };
    refuse_as_model(target, target_path)?;
    if target.family != super::config::Family::Gemma4 {
        bail!(
            "{t}: is not a Gemma 4 model; {a} drafts only for the Gemma 4 model it was trained with"
        );
    }
    if shape.backbone_hidden != target.hidden {
        bail!(
            "{a}: drafts for a model of hidden size {}, but {t} has hidden size {}",
            shape.backbone_hidden,
            target.hidden
        );
    }
    if assistant.vocab_size != target.vocab_size {
        bail!(
            "{a}: has a vocabulary of {} tokens, but {t} has {}",
            assistant.vocab_size,
            target.vocab_size
        );
    }
    let kind = |sliding: bool| if sliding { "sliding" } else { "global" };
    (0..assistant.n_layers())
        .map(|i| {
            let sliding = assistant.layers[i].window.is_some();
            let last = (0..target.n_layers())
                .rev()
                .find(|&j| target.layers[j].window.is_some() == sliding)
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{a}: layer {i} is {}, but {t} has no {} layer whose keys it could read",
                        kind(sliding),
                        kind(sliding)
                    )
                })?;
            let source = target.shape(last).kv_layer;
            let (mine, theirs) = (assistant.shape(i), target.shape(source));
            if (mine.head_dim, mine.n_kv_heads) != (theirs.head_dim, theirs.n_kv_heads) {
                bail!(
                    "{a}: layer {i} ({}) has {} KV heads of size {}, but the {} cache of {t} (layer {source}) has {} of size {}",
                    kind(sliding),
                    mine.n_kv_heads,
                    mine.head_dim,
                    kind(sliding),
                    theirs.n_kv_heads,
                    theirs.head_dim
                );
            }
            Ok(source)
        })
        .collect()
}

/// Where an assistant for the model at `model` would be, by the names
/// its releases use: a folder `NAME` beside `NAME-assistant`, a file
/// `NAME.gguf` beside `NAME-assistant.gguf`, or with a trailing type tag
/// (`NAME-Q4_K_M.gguf`) beside `NAME-assistant-Q4_K_M.gguf`. The first
/// that exists, if any.
pub fn beside(model: &Path) -> Option<PathBuf> {
    let name = model.file_name()?.to_str()?;
    let mut names = Vec::new();
    match name.strip_suffix(".gguf") {
        Some(stem) => {
            names.push(format!("{stem}-assistant.gguf"));
            if let Some((base, tag)) = stem.rsplit_once('-') {
                names.push(format!("{base}-assistant-{tag}.gguf"));
            }
        }
        None => names.push(format!("{name}-assistant")),
    }
    names
        .into_iter()
        .map(|n| model.with_file_name(n))
        .find(|candidate| candidate.exists())
}
