//! Opening a model from either format: the config it describes and its
//! tensors under format-neutral roles.

use super::config::{Family, LayerAttention, ModelConfig};
use super::dtype::{DType, TensorView};
use super::gguf::GgufFile;
use super::safetensors::SafetensorsFile;
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What a tensor is for, independent of how a format names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Embedding,
    FinalNorm,
    Layer(usize, LayerRole),
    /// Gemma 4's per-layer inputs: the token table `[vocab, layers x P]`,
    /// the projection of the embedding `[layers x P, hidden]` and its norm.
    PerLayerEmbedding,
    PerLayerModelProjection,
    PerLayerProjectionNorm,
    /// One expert's matrix of a layer's mixture: a view into the layer's
    /// expert tensor (fused gate-up or split).
    Expert(usize, usize, ExpertRole),
    /// Gemma 3n's AltUp: the `[hidden, hidden]` projection that makes
    /// stream `k + 1` from the embedding, and the one that brings it back
    /// before the final norm. llama.cpp stacks each kind in one tensor.
    AltUpProjection(usize),
    AltUpUnembed(usize),
    /// A Gemma 4 assistant's projections: `[hidden, 2 x target hidden]`
    /// from the target's scaled embedding and hidden state into its width,
    /// `[target hidden, hidden]` back out; its LM head's cluster centroids
    /// `[clusters, hidden]` and the token ids of each cluster in turn
    /// (`[vocab]` integers).
    AssistantPreProjection,
    AssistantPostProjection,
    HeadCentroids,
    HeadTokenOrdering,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertRole {
    Gate,
    Up,
    Down,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerRole {
    AttnNorm,
    AttnPostNorm,
    FfnNorm,
    FfnPostNorm,
    QNorm,
    KNorm,
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    /// Gemma 4: the per-layer input's gate `[P, hidden]`, projection
    /// `[hidden, P]` and post-norm.
    PleGate,
    PleProjection,
    PlePostNorm,
    /// Gemma 4: the scalar the residual stream is multiplied by at the end.
    OutputScale,
    /// Gemma 4's mixture: router `[experts, hidden]`, its input scale
    /// `[hidden]` and per-expert scale `[experts]`; the experts' input norm
    /// and the post-norms of the dense and the experts' outputs.
    RouterProj,
    RouterScale,
    ExpertScale,
    MoeNorm,
    DensePostNorm,
    MoePostNorm,
    /// The layer's expert tensors: `[experts, 2 x width, hidden]` fused
    /// (gate rows first), or gate and up `[experts, width, hidden]` apart;
    /// down `[experts, hidden, width]`.
    ExpertsGateUp,
    ExpertsGate,
    ExpertsUp,
    ExpertsDown,
    /// Gemma 3n's AltUp: the router `[streams, hidden]` and its input norm,
    /// the prediction `[streams², streams]` and correction `[streams,
    /// streams]` coefficients, and the scale of the per-layer input's gate
    /// input `[hidden]`.
    AltUpRouter,
    AltUpRouterNorm,
    AltUpPredict,
    AltUpCorrect,
    AltUpCorrectScale,
    /// Gemma 3n's LAuReL: `[rank, hidden]`, `[hidden, rank]` and the norm
    /// of their product.
    LaurelLeft,
    LaurelRight,
    LaurelPostNorm,
}

enum Files {
    Gguf(GgufFile),
    /// Shards of an HF folder and which shard holds each tensor.
    Hf {
        shards: Vec<SafetensorsFile>,
        index: HashMap<String, usize>,
        /// The file that lists the tensors (model.safetensors or the shard
        /// index), named when a tensor is missing.
        listing: PathBuf,
        /// What tensor names start with: `model.`, or for the text part of
        /// an image-text checkpoint `model.language_model.`.
        prefix: &'static str,
    },
}

/// An opened model: its description and access to its tensors.
pub struct ModelSource {
    pub path: PathBuf,
    pub config: ModelConfig,
    files: Files,
    /// `[hidden, hidden]`: the shape of one slice of a stacked GGUF
    /// tensor (AltUp's projections), borrowed by the slice's view.
    square: [usize; 2],
}

impl ModelSource {
    /// Opens a `.gguf` file or a Hugging Face folder (config.json plus
    /// model.safetensors or a sharded index).
    pub fn open(path: &Path) -> Result<ModelSource> {
        if is_model_folder(path)? {
            return Self::open_hf(path);
        }
        // A file from inside a Hugging Face folder would otherwise be
        // reported as "not a GGUF file", which does not say what to do.
        let is_hf_part = path.extension().is_some_and(|e| e == "safetensors")
            || path
                .file_name()
                .is_some_and(|n| n == "config.json" || n == "model.safetensors.index.json");
        if is_hf_part {
            bail!(
                "{}: is part of a Hugging Face model; pass the folder that holds it with -m",
                path.display()
            );
        }
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// A model from a parsed GGUF file (opened, or parsed from memory by
    /// tests and fuzzing): its metadata becomes the config.
    pub fn from_gguf(gguf: GgufFile) -> Result<ModelSource> {
        let config = config_from_gguf(&gguf)?;
        Ok(ModelSource {
            path: gguf.path().to_path_buf(),
            square: [config.hidden; 2],
            config,
            files: Files::Gguf(gguf),
        })
    }

    fn open_hf(dir: &Path) -> Result<ModelSource> {
        let config_path = dir.join("config.json");
        if !entry_exists(&config_path) {
            bail!(
                "{}: no config.json in this folder (expected a Hugging Face model folder or a .gguf file)",
                dir.display()
            );
        }
        if config_path.is_dir() {
            bail!("{}: is a directory, not a file", config_path.display());
        }
        let config = ModelConfig::from_hf_config(&config_path)?;
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        // Entries that exist but cannot be read (a directory, a broken or
        // looping link) are opened anyway so that the error says what is
        // wrong with them rather than that they are absent.
        let listing = if entry_exists(&single) {
            single.clone()
        } else {
            index_path.clone()
        };
        if entry_exists(&single) {
            let file = SafetensorsFile::open(&single)?;
            for name in file.names() {
                index.insert(name.to_string(), 0);
            }
            shards.push(file);
        } else if entry_exists(&index_path) {
            if index_path.is_dir() {
                bail!("{}: is a directory, not a file", index_path.display());
            }
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("{}: cannot read", index_path.display()))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    anyhow::anyhow!("{}: has no weight_map object", index_path.display())
                })?;
            let mut shard_of_file: HashMap<String, usize> = HashMap::new();
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}: weight_map entry {tensor:?} is not a file name",
                        index_path.display()
                    )
                })?;
                if file.contains('/') || file.contains("..") {
                    bail!(
                        "{}: shard name {file:?} must be a plain file name",
                        index_path.display()
                    );
                }
                let shard = match shard_of_file.get(file) {
                    Some(&i) => i,
                    None => {
                        shards.push(SafetensorsFile::open(&dir.join(file))?);
                        shard_of_file.insert(file.to_string(), shards.len() - 1);
                        shards.len() - 1
                    }
                };
                index.insert(tensor.clone(), shard);
            }
        } else {
            bail!(
                "{}: no model.safetensors or model.safetensors.index.json in this folder",
                dir.display()
            );
        }
        let prefix = if index.contains_key("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        let towers: Vec<&str> = ["vision_tower", "audio_tower"]
            .into_iter()
            .filter(|t| index.keys().any(|k| k.starts_with(&format!("model.{t}."))))
            .collect();
        if !towers.is_empty() {
            eprintln!(
                "{}: running the text model; skipped the {}",
                dir.display(),
                towers.join(" and ").replace('_', " ")
            );
        }
        Ok(ModelSource {
            path: dir.to_path_buf(),
            square: [config.hidden; 2],
            config,
            files: Files::Hf {
                shards,
                index,
                listing,
                prefix,
            },
        })
    }

    /// The GGUF file, when the model is one (the tokenizer reads its vocab).
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.files {
            Files::Gguf(g) => Some(g),
            Files::Hf { .. } => None,
        }
    }

    /// The file-format name of a role.
    pub fn tensor_name(&self, role: Role) -> String {
        match &self.files {
            Files::Gguf(_) => gguf_name(role),
            Files::Hf { prefix, .. } => hf_name(role, self.config.family, prefix),
        }
    }

    /// Expert `e`'s matrix of layer `layer`: a view into the layer's fused
    /// gate-up tensor (gate rows first) or its split gate, up or down
    /// tensor, whichever the file has. Rows of every stored type are whole
    /// blocks, so an expert's rows are one contiguous run of bytes.
    pub fn expert_tensor(
        &self,
        layer: usize,
        e: usize,
        which: ExpertRole,
    ) -> Result<TensorView<'_>> {
        self.expert_view(layer, e, which, true)
    }

    /// Any matrix's view by its role, shape checked, blocks not scanned
    /// (see [`ModelSource::tensor_unscanned`]).
    pub fn matrix_unscanned(&self, role: Role, shape: &[usize]) -> Result<TensorView<'_>> {
        match role {
            Role::Expert(layer, e, which) => self.expert_view(layer, e, which, false),
            _ => self.tensor_unscanned(role, shape),
        }
    }

    fn expert_view(
        &self,
        layer: usize,
        e: usize,
        which: ExpertRole,
        scan: bool,
    ) -> Result<TensorView<'_>> {
        let Some(moe) = &self.config.features.moe else {
            bail!("{}: the model has no experts", self.path.display());
        };
        let n = moe.experts;
        let (role, rows_per_expert, first_row, shape) = match which {
            ExpertRole::Down => (
                LayerRole::ExpertsDown,
                moe.down_shape[0],
                0,
                &moe.down_shape,
            ),
            ExpertRole::Gate | ExpertRole::Up
                if self.has(Role::Layer(layer, LayerRole::ExpertsGateUp)) =>
            {
                let up = usize::from(which == ExpertRole::Up);
                (
                    LayerRole::ExpertsGateUp,
                    2 * moe.width,
                    up * moe.width,
                    &moe.gate_shape,
                )
            }
            ExpertRole::Gate => (LayerRole::ExpertsGate, moe.width, 0, &moe.gate_shape),
            ExpertRole::Up => (LayerRole::ExpertsUp, moe.width, 0, &moe.gate_shape),
        };
        let whole_shape = [n, rows_per_expert, shape[1]];
        let (t, file) = self.locate(Role::Layer(layer, role), &whole_shape)?;
        let row_bytes = t.bytes.len() / (n * rows_per_expert);
        let start = (e * rows_per_expert + first_row) * row_bytes;
        let view = TensorView {
            dtype: t.dtype,
            shape: &shape[..],
            bytes: &t.bytes[start..start + shape[0] * row_bytes],
        };
        // Only this expert's blocks: the whole tensor is read once, expert
        // by expert.
        if !scan {
            return Ok(view);
        }
        if let Some((block, scale)) = view.dtype.first_bad_scale(view.bytes, shape[1]) {
            bail!(
                "{}: tensor {:?} is damaged: expert {e}'s {} block {block} has the scale {scale}; \
                 fetch or convert the file again",
                file.display(),
                self.tensor_name(Role::Layer(layer, role)),
                view.dtype
            );
        }
        Ok(view)
    }

    /// The tensor playing `role`, with its shape checked against `expect`
    /// and, for a quantized type, every block's scale: a damaged file is
    /// refused here, before its values are read.
    pub fn tensor(&self, role: Role, expect: &[usize]) -> Result<TensorView<'_>> {
        let (view, file) = self.locate(role, expect)?;
        let cols = view.shape.last().copied().unwrap_or(1);
        if let Some((block, scale)) = view.dtype.first_bad_scale(view.bytes, cols) {
            return Err(self.damaged(file, role, view.dtype, cols, block, scale));
        }
        Ok(view)
    }

    /// [`ModelSource::tensor`] for a table a token reads one row of (the
    /// per-layer token table, about 2 GB in Gemma 4 E2B): scanned a few
    /// MiB of rows at a time, each run's pages dropped once scanned, so
    /// the check does not make the whole table resident at once.
    pub fn row_table(&self, role: Role, expect: &[usize]) -> Result<TensorView<'_>> {
        let (view, file) = self.locate(role, expect)?;
        let cols = view.shape.last().copied().unwrap_or(1);
        let rows = view.elems() / cols.max(1);
        if view.dtype.is_row_blocked() || rows == 0 {
            return self.tensor(role, expect);
        }
        let row_bytes = view.bytes.len() / rows;
        let blocks_per_row = cols / view.dtype.block_elems().max(1);
        let run_rows = ((32usize << 20) / row_bytes.max(1)).max(1);
        for first in (0..rows).step_by(run_rows) {
            let end = (first + run_rows).min(rows);
            let run = TensorView {
                bytes: &view.bytes[first * row_bytes..end * row_bytes],
                ..view
            };
            if let Some((block, scale)) = run.dtype.first_bad_scale(run.bytes, cols) {
                let block = first * blocks_per_row + block;
                return Err(self.damaged(file, role, view.dtype, cols, block, scale));
            }
            run.release_pages();
        }
        Ok(view)
    }

    fn damaged(
        &self,
        file: &Path,
        role: Role,
        dtype: DType,
        cols: usize,
        block: usize,
        scale: f32,
    ) -> anyhow::Error {
        let per_row = cols / dtype.block_elems();
        anyhow::anyhow!(
            "{}: tensor {:?} is damaged: {} block {block} (row {}) has the scale {scale}; \
             fetch or convert the file again",
            file.display(),
            self.tensor_name(role),
            dtype,
            block / per_row.max(1)
        )
    }

    /// Like [`ModelSource::tensor`] without reading the blocks' scales:
    /// for deciding formats from a tensor's type and size, which need not
    /// touch every page of the file a second time. Values are read through
    /// [`ModelSource::tensor`].
    pub fn tensor_unscanned(&self, role: Role, expect: &[usize]) -> Result<TensorView<'_>> {
        Ok(self.locate(role, expect)?.0)
    }

    /// The tensor playing `role`, its shape checked, and the file it is in.
    fn locate(&self, role: Role, expect: &[usize]) -> Result<(TensorView<'_>, &Path)> {
        if let (Files::Gguf(_), Some(k)) = (&self.files, stacked_slice(role)) {
            return self.stacked_view(role, k, expect);
        }
        let name = self.tensor_name(role);
        let (view, file) = match &self.files {
            Files::Gguf(g) => (g.tensor(&name), g.path()),
            Files::Hf {
                shards,
                index,
                listing,
                ..
            } => match index.get(&name) {
                Some(&i) => (shards[i].tensor(&name), shards[i].path()),
                None => (None, listing.as_path()),
            },
        };
        let view = view.ok_or_else(|| {
            // A config that claims more layers than the file holds shows up
            // here first: say how many the config wants.
            let hint = match role {
                Role::Layer(..) => {
                    format!(" (the config describes {} layers)", self.config.n_layers())
                }
                _ => String::new(),
            };
            anyhow::anyhow!("{}: tensor {name:?} is missing{hint}", file.display())
        })?;
        if view.shape != expect {
            bail!(
                "{}: tensor {name:?} has shape {:?}, but the config implies {expect:?}",
                file.display(),
                view.shape
            );
        }
        Ok((view, file))
    }

    /// Slice `k` of a GGUF tensor that stacks a role's matrices
    /// (`[count, rows, cols]`, count from the config), its shape checked.
    fn stacked_view(
        &self,
        role: Role,
        k: usize,
        expect: &[usize],
    ) -> Result<(TensorView<'_>, &Path)> {
        let Files::Gguf(g) = &self.files else {
            unreachable!("only GGUF files stack matrices");
        };
        let name = self.tensor_name(role);
        let file = g.path();
        let t = g
            .tensor(&name)
            .ok_or_else(|| anyhow::anyhow!("{}: tensor {name:?} is missing", file.display()))?;
        let count = self.config.features.altup.map_or(0, |a| a.streams - 1);
        let whole: Vec<usize> = std::iter::once(count)
            .chain(expect.iter().copied())
            .collect();
        if t.shape != whole || expect != self.square {
            bail!(
                "{}: tensor {name:?} has shape {:?}, but the config implies {whole:?}",
                file.display(),
                t.shape
            );
        }
        let slice = t.bytes.len() / count;
        let view = TensorView {
            dtype: t.dtype,
            shape: &self.square[..],
            bytes: &t.bytes[k * slice..(k + 1) * slice],
        };
        Ok((view, file))
    }

    /// Whether a tensor for `role` exists (for optional tensors).
    pub fn has(&self, role: Role) -> bool {
        let name = self.tensor_name(role);
        match &self.files {
            Files::Gguf(g) => g.tensor_info(&name).is_some(),
            Files::Hf { index, .. } => index.contains_key(&name),
        }
    }
}

/// The slice a role is of the GGUF tensor that stacks its kind.
fn stacked_slice(role: Role) -> Option<usize> {
    match role {
        Role::AltUpProjection(k) | Role::AltUpUnembed(k) => Some(k),
        _ => None,
    }
}

/// Whether `-m PATH` names a folder (a Hugging Face model) rather than a
/// file, with an error that says what `-m` takes when nothing readable is
/// there.
pub fn is_model_folder(path: &Path) -> Result<bool> {
    let meta = std::fs::metadata(path).with_context(|| {
        format!(
            "{}: cannot read the model path (pass a .gguf file or a Hugging Face folder with -m)",
            path.display()
        )
    })?;
    Ok(meta.is_dir())
}

/// Whether anything, even a broken symbolic link, is at `path`.
fn entry_exists(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}

/// The GGUF (llama.cpp) name of a role.
pub fn gguf_name(role: Role) -> String {
    match role {
        Role::Embedding => "token_embd.weight".into(),
        Role::FinalNorm => "output_norm.weight".into(),
        Role::PerLayerEmbedding => "per_layer_token_embd.weight".into(),
        Role::PerLayerModelProjection => "per_layer_model_proj.weight".into(),
        Role::PerLayerProjectionNorm => "per_layer_proj_norm.weight".into(),
        Role::AltUpProjection(_) => "altup_proj.weight".into(),
        Role::AltUpUnembed(_) => "altup_unembd_proj.weight".into(),
        Role::AssistantPreProjection => "nextn.pre_projection.weight".into(),
        Role::AssistantPostProjection => "nextn.post_projection.weight".into(),
        Role::HeadCentroids => "masked_embd_centroids.weight".into(),
        Role::HeadTokenOrdering => "masked_embd_ordering".into(),
        Role::Expert(i, _, r) => gguf_name(Role::Layer(i, expert_tensor_role(r))),
        Role::Layer(i, LayerRole::RouterScale) => format!("blk.{i}.ffn_gate_inp.scale"),
        Role::Layer(i, LayerRole::ExpertScale) => format!("blk.{i}.ffn_down_exps.scale"),
        Role::Layer(i, r) => {
            let suffix = match r {
                LayerRole::AttnNorm => "attn_norm",
                LayerRole::AttnPostNorm => "post_attention_norm",
                LayerRole::FfnNorm => "ffn_norm",
                LayerRole::FfnPostNorm => "post_ffw_norm",
                LayerRole::QNorm => "attn_q_norm",
                LayerRole::KNorm => "attn_k_norm",
                LayerRole::Q => "attn_q",
                LayerRole::K => "attn_k",
                LayerRole::V => "attn_v",
                LayerRole::O => "attn_output",
                LayerRole::Gate => "ffn_gate",
                LayerRole::Up => "ffn_up",
                LayerRole::Down => "ffn_down",
                LayerRole::PleGate => "inp_gate",
                LayerRole::PleProjection => "proj",
                LayerRole::PlePostNorm => "post_norm",
                LayerRole::OutputScale => "layer_output_scale",
                LayerRole::RouterProj => "ffn_gate_inp",
                LayerRole::MoeNorm => "pre_ffw_norm_2",
                LayerRole::DensePostNorm => "post_ffw_norm_1",
                LayerRole::MoePostNorm => "post_ffw_norm_2",
                LayerRole::ExpertsGateUp => "ffn_gate_up_exps",
                LayerRole::ExpertsGate => "ffn_gate_exps",
                LayerRole::ExpertsUp => "ffn_up_exps",
                LayerRole::ExpertsDown => "ffn_down_exps",
                LayerRole::AltUpRouter => "altup_router",
                LayerRole::AltUpRouterNorm => "altup_router_norm",
                LayerRole::AltUpPredict => "altup_predict_coef",
                LayerRole::AltUpCorrect => "altup_correct_coef",
                LayerRole::AltUpCorrectScale => "altup_correct_scale",
                LayerRole::LaurelLeft => "laurel_l",
                LayerRole::LaurelRight => "laurel_r",
                LayerRole::LaurelPostNorm => "laurel_post_norm",
                LayerRole::RouterScale | LayerRole::ExpertScale => unreachable!("named above"),
            };
            format!("blk.{i}.{suffix}.weight")
        }
    }
}

/// The tensor file role an expert's matrix is a view into.
fn expert_tensor_role(r: ExpertRole) -> LayerRole {
    match r {
        ExpertRole::Gate => LayerRole::ExpertsGate,
        ExpertRole::Up => LayerRole::ExpertsUp,
        ExpertRole::Down => LayerRole::ExpertsDown,
    }
}

fn hf_name(role: Role, family: Family, prefix: &str) -> String {
    match role {
        Role::Embedding => format!("{prefix}embed_tokens.weight"),
        Role::FinalNorm => format!("{prefix}norm.weight"),
        Role::PerLayerEmbedding => format!("{prefix}embed_tokens_per_layer.weight"),
        Role::PerLayerModelProjection => format!("{prefix}per_layer_model_projection.weight"),
        Role::PerLayerProjectionNorm => format!("{prefix}per_layer_projection_norm.weight"),
        Role::AltUpProjection(k) => format!("{prefix}altup_projections.{k}.weight"),
        Role::AltUpUnembed(k) => format!("{prefix}altup_unembed_projections.{k}.weight"),
        // Beside the assistant's text model, not under its prefix.
        Role::AssistantPreProjection => "pre_projection.weight".into(),
        Role::AssistantPostProjection => "post_projection.weight".into(),
        Role::HeadCentroids => "masked_embedding.centroids.weight".into(),
        Role::HeadTokenOrdering => "masked_embedding.token_ordering".into(),
        Role::Expert(i, _, r) => hf_name(Role::Layer(i, expert_tensor_role(r)), family, prefix),
        Role::Layer(i, r) => {
            // Parameters stored without a ".weight" suffix.
            let bare = match r {
                LayerRole::OutputScale => Some("layer_scalar"),
                LayerRole::RouterScale => Some("router.scale"),
                LayerRole::ExpertScale => Some("router.per_expert_scale"),
                LayerRole::ExpertsGateUp => Some("experts.gate_up_proj"),
                LayerRole::ExpertsGate => Some("experts.gate_proj"),
                LayerRole::ExpertsUp => Some("experts.up_proj"),
                LayerRole::ExpertsDown => Some("experts.down_proj"),
                LayerRole::AltUpCorrectScale => Some("altup.correct_output_scale"),
                _ => None,
            };
            if let Some(name) = bare {
                return format!("{prefix}layers.{i}.{name}");
            }
            let suffix = match (r, family) {
                (LayerRole::AttnNorm, _) => "input_layernorm",
                // Gemma 1 calls its pre-FFN norm "post_attention_layernorm".
                (LayerRole::FfnNorm, Family::Gemma1) => "post_attention_layernorm",
                (LayerRole::FfnNorm, _) => "pre_feedforward_layernorm",
                (LayerRole::AttnPostNorm, _) => "post_attention_layernorm",
                (LayerRole::FfnPostNorm, _) => "post_feedforward_layernorm",
                (LayerRole::QNorm, _) => "self_attn.q_norm",
                (LayerRole::KNorm, _) => "self_attn.k_norm",
                (LayerRole::Q, _) => "self_attn.q_proj",
                (LayerRole::K, _) => "self_attn.k_proj",
                (LayerRole::V, _) => "self_attn.v_proj",
                (LayerRole::O, _) => "self_attn.o_proj",
                (LayerRole::Gate, _) => "mlp.gate_proj",
                (LayerRole::Up, _) => "mlp.up_proj",
                (LayerRole::Down, _) => "mlp.down_proj",
                (LayerRole::PleGate, _) => "per_layer_input_gate",
                (LayerRole::PleProjection, _) => "per_layer_projection",
                (LayerRole::PlePostNorm, _) => "post_per_layer_input_norm",
                (LayerRole::RouterProj, _) => "router.proj",
                (LayerRole::MoeNorm, _) => "pre_feedforward_layernorm_2",
                (LayerRole::DensePostNorm, _) => "post_feedforward_layernorm_1",
                (LayerRole::MoePostNorm, _) => "post_feedforward_layernorm_2",
                (LayerRole::AltUpRouter, _) => "altup.modality_router",
                (LayerRole::AltUpRouterNorm, _) => "altup.router_norm",
                (LayerRole::AltUpPredict, _) => "altup.prediction_coefs",
                (LayerRole::AltUpCorrect, _) => "altup.correction_coefs",
                (LayerRole::LaurelLeft, _) => "laurel.linear_left",
                (LayerRole::LaurelRight, _) => "laurel.linear_right",
                (LayerRole::LaurelPostNorm, _) => "laurel.post_laurel_norm",
                (_, _) => unreachable!("bare parameters are named above"),
            };
            format!("{prefix}layers.{i}.{suffix}.weight")
        }
    }
}

/// The model description from GGUF metadata, with the defaults GGUF files
/// do not carry (local RoPE base 1e4; query_pre_attn_scalar = head_dim).
fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let p = g.path().display();
    let arch = g
        .get_str("general.architecture")?
        .ok_or_else(|| anyhow::anyhow!("{p}: metadata key \"general.architecture\" is missing"))?
        .to_string();
    let family = match arch.as_str() {
        "gemma" => Family::Gemma1,
        "gemma2" => Family::Gemma2,
        "gemma3" => Family::Gemma3,
        "gemma4" => return super::gemma4::config_from_gguf(g),
        super::gemma4_assistant::GGUF_ARCH => return super::gemma4_assistant::config_from_gguf(g),
        "gemma3n" => return super::gemma3n::config_from_gguf(g),
        other => bail!(
            "{p}: architecture {other:?} is not supported (Pulsar runs gemma, gemma2, gemma3, gemma3n, gemma4, and gemma4-assistant as a drafter)"
        ),
    };
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = g.require_usize(&key("embedding_length"))?;
    let n_heads = g.require_usize(&key("attention.head_count"))?;
    let n_layers = g.require_usize(&key("block_count"))?;
    if n_layers == 0 || n_layers > 4096 {
        bail!("{p}: block_count {n_layers} is zero or absurd");
    }
    // Refused before anything divides by it (hidden / heads below, and in
    // query_pre_attn_scalar for the 27B shapes).
    if n_heads == 0 {
        bail!("{p}: metadata key {:?} is 0", key("attention.head_count"));
    }
    let head_dim = match g.get_usize(&key("attention.key_length"))? {
        Some(h) => h,
        None => hidden / n_heads,
    };
    let embd = g
        .tensor_info("token_embd.weight")
        .ok_or_else(|| anyhow::anyhow!("{p}: tensor \"token_embd.weight\" is missing"))?;
    let vocab_size = embd.shape[0];
    let global_base = g.get_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
    let global_scale = match g.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => 1.0,
        Some("linear") => g.get_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0) as f32,
        Some(other) => bail!("{p}: rope scaling type {other:?} is not supported (only linear)"),
    };
    let window = g.get_usize(&key("attention.sliding_window"))?;
    // Files written by `pulsar convert` say which layers are global and the
    // local RoPE base; llama.cpp's files rely on the family's fixed pattern.
    let global_layers = match g.get_num_array("pulsar.attention.global_layers")? {
        Some(flags) if flags.len() == n_layers => Some(flags),
        Some(flags) => bail!(
            "{p}: pulsar.attention.global_layers has {} entries for {n_layers} layers",
            flags.len()
        ),
        None => None,
    };
    let local_base = match g.get_f64("pulsar.rope.local_freq_base")? {
        Some(b) => b as f32,
        None if family == Family::Gemma3 => 10_000.0,
        None => global_base,
    };
    let layers = (0..n_layers)
        .map(|i| {
            let global = match (&global_layers, family) {
                (Some(flags), _) => flags[i] != 0.0,
                (None, Family::Gemma1) => true,
                (None, Family::Gemma2) => i % 2 == 1,
                (None, Family::Gemma3 | Family::Gemma4 | Family::Gemma3n) => (i + 1) % 6 == 0,
            };
            match window {
                Some(w) if !global => LayerAttention {
                    window: Some(w),
                    rope_base: local_base,
                    rope_scale: 1.0,
                },
                _ => LayerAttention {
                    window: None,
                    rope_base: global_base,
                    rope_scale: global_scale,
                },
            }
        })
        .collect();
    let softcap = |k: &str| -> Result<Option<f32>> {
        Ok(g.get_f64(&key(k))?.filter(|&v| v > 0.0).map(|v| v as f32))
    };
    let config = ModelConfig {
        family,
        vocab_size,
        hidden,
        intermediate: g.require_usize(&key("feed_forward_length"))?,
        n_heads,
        n_kv_heads: g
            .get_usize(&key("attention.head_count_kv"))?
            .unwrap_or(n_heads),
        head_dim,
        rms_eps: g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6) as f32,
        query_scale: match g.get_f64("pulsar.attention.query_scale")? {
            Some(s) => s as f32,
            None => 1.0 / query_pre_attn_scalar(family, n_layers, hidden, n_heads, head_dim).sqrt(),
        },
        attn_softcap: softcap("attn_logit_softcapping")?,
        final_softcap: softcap("final_logit_softcapping")?,
        layers,
        norm_weight_offset: 0.0,
        max_context: g.get_usize(&key("context_length"))?.unwrap_or(8192),
        bos_id: g.get_usize("tokenizer.ggml.bos_token_id")?.unwrap_or(2) as u32,
        eos_id: g.get_usize("tokenizer.ggml.eos_token_id")?.unwrap_or(1) as u32,
        layer_shapes: Vec::new(),
        features: super::config::Features::default(),
    };
    config.validate(g.path())?;
    Ok(config)
}

/// GGUF files do not store query_pre_attn_scalar. Every Gemma uses head_dim
/// except the 27B models of Gemma 2 (46 layers) and Gemma 3 (62 layers),
/// which use hidden / heads; llama.cpp decides the same way.
fn query_pre_attn_scalar(
    family: Family,
    n_layers: usize,
    hidden: usize,
    n_heads: usize,
    head_dim: usize,
) -> f32 {
    match (family, n_layers) {
        (Family::Gemma2, 46) | (Family::Gemma3, 62) => (hidden / n_heads) as f32,
        _ => head_dim as f32,
    }
}
