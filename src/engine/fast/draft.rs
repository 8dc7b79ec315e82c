//! The fast engine's draft rounds with a Gemma 4 assistant (the maths:
//! `engine::assistant`, the reference engine's `draft_round`): the
//! assistant's matrices in the target's 16-bit format on the target's
//! kernels (the plan has them: [`plan_assistant`]), its attention the
//! decode attention over a sequence's cache, and the clustered head as
//! GEMVs over runs of rows: the head is stored in `token_ordering`'s
//! order, so each cluster is a contiguous run.

use super::attention::CachedLayer;
use super::{FastEngine, WeightFormats};
use crate::engine::assistant::{self, Assistant};
use crate::engine::kernels::SharedOut;
use crate::engine::ops;
use crate::engine::packed::{PackedMatrix, WeightArena, WeightFormat};
use crate::engine::q8_input::{InputPrecision, Q8Input};
use crate::engine::synthetic;
use crate::jit::blocking::ROW_GRANULE;
use crate::jit::plan::{PlanOptions, QuantizedMatrix};
use crate::model::config::ModelConfig;
use crate::model::dequant;
use crate::model::dtype::{DType, TensorView};
use crate::model::quant_blocks::GROUP_COLS;
use crate::model::source::{LayerRole, ModelSource, Role};
use crate::model::weights::model_matrices;
use anyhow::{Result, bail};
use std::path::Path;

/// The assistant beside a fast engine, and what it reads of each sequence.
pub(super) struct FastAssistant {
    a: Assistant<PackedMatrix>,
    /// With clusters, the head's rows are in `token_ordering`'s order.
    ordered_head: bool,
    /// Per sequence: its last step's final hidden states and the position
    /// of the first (a round reads the last cached position's).
    kept: Vec<(usize, Vec<f32>)>,
}

/// The plan's name for an assistant's matrix: its own, so that the plan
/// gives 16-bit kernels to its K values only.
fn plan_name(role: Role) -> &'static str {
    match role {
        Role::Embedding => "draft.head",
        Role::AssistantPreProjection => "draft.pre_projection",
        Role::AssistantPostProjection => "draft.post_projection",
        Role::HeadCentroids => "draft.centroids",
        Role::Layer(_, LayerRole::Q) => "draft.attn_q",
        Role::Layer(_, LayerRole::O) => "draft.attn_output",
        Role::Layer(_, LayerRole::Gate) => "draft.ffn_gate",
        Role::Layer(_, LayerRole::Up) => "draft.ffn_up",
        Role::Layer(_, LayerRole::Down) => "draft.ffn_down",
        _ => "draft.?",
    }
}

/// The format an assistant's matrices are kept in beside a model kept in
/// `formats`: the model's 16-row Q8_0 where the model has that format, so
/// the drafts run on the Q8_0 kernel the plan holds already (its K is a
/// runtime argument) and the plan gains no code; else the model's 16-bit
/// format. A Gemma 4 E2B Q4_K_M plan is within a few bytes of its budget
/// without the assistant: the 16-bit GEMVs and GEMM the assistant would
/// add do not fit beside it. Drafts are proposals the model verifies, so
/// their 8-bit rounding changes which tokens are proposed, never the
/// output.
pub fn assistant_format(formats: &WeightFormats, assistant: &ModelConfig) -> WeightFormat {
    let has_q8 = std::iter::once(&formats.head)
        .chain(formats.matrices.values())
        .any(|&f| f == WeightFormat::Q8_0x16);
    let whole_groups = model_matrices(assistant)
        .iter()
        .all(|(_, [rows, k])| k.is_multiple_of(GROUP_COLS) && rows.is_multiple_of(ROW_GRANULE));
    if has_q8 && whole_groups {
        WeightFormat::Q8_0x16
    } else {
        formats.wide
    }
}

/// Adds an assistant's matrices, kept in `format` (see
/// [`assistant_format`]), to the target's plan options under names of
/// their own: in the 16-bit format only their K values gain kernels, and
/// only GEMVs, as a draft step is one token.
pub fn plan_assistant(opts: &mut PlanOptions, assistant: &ModelConfig, format: WeightFormat) {
    for (role, [rows, k]) in model_matrices(assistant) {
        let m = (plan_name(role), rows, k);
        if !opts.matrices.contains(&m) {
            opts.matrices.push(m);
        }
        if !opts.one_token.contains(&m.0) {
            opts.one_token.push(m.0);
        }
        match format.quant() {
            Some(q) => {
                let quantized = QuantizedMatrix { tensor: m.0, q, k };
                if !opts.quantized.contains(&quantized) {
                    opts.quantized.push(quantized);
                }
            }
            None => {
                if let Some(wide) = &mut opts.wide_tensors
                    && !wide.contains(&m.0)
                {
                    wide.push(m.0);
                }
            }
        }
    }
}

/// `t`'s rows in the order `ordering` gives, in the file's type where its
/// rows lie one after another, else as f32.
fn rows_in_order(t: &TensorView<'_>, ordering: &[u32]) -> (DType, Vec<u8>) {
    let (_, cols) = t.matrix_dims();
    match t
        .dtype
        .row_bytes(cols)
        .filter(|_| !t.dtype.is_row_blocked())
    {
        Some(rb) => {
            let mut bytes = Vec::with_capacity(ordering.len() * rb);
            for &id in ordering {
                let at = id as usize * rb;
                bytes.extend_from_slice(&t.bytes[at..at + rb]);
            }
            (t.dtype, bytes)
        }
        None => {
            let mut row = vec![0.0f32; cols];
            let mut bytes = Vec::with_capacity(ordering.len() * cols * 4);
            for &id in ordering {
                dequant::row_into(t, id as usize, &mut row);
                bytes.extend(row.iter().flat_map(|v| v.to_le_bytes()));
            }
            (DType::F32, bytes)
        }
    }
}

impl FastAssistant {
    pub(super) fn weights_mut(&mut self) -> &mut crate::model::weights::ModelWeights<PackedMatrix> {
        &mut self.a.weights
    }
}

impl FastEngine {
    /// The plan options of this engine's kernels for `formats`: the
    /// model's, and its assistant's matrices when it has one (launch
    /// tuning plans its candidates with them).
    pub fn plan_options(&self, formats: &crate::engine::fast::WeightFormats) -> PlanOptions {
        let mut opts =
            crate::engine::jit_kernels::plan_options(&self.config, formats, self.threads());
        if let Some(fa) = &self.assistant {
            plan_assistant(&mut opts, &fa.a.config, fa.a.weights.embedding.format);
        }
        opts
    }

    /// Loads the Gemma 4 assistant `src` for this engine's model (at
    /// `target_path`) in `format` ([`assistant_format`]), checking
    /// that they fit and that the kernels can multiply its matrices
    /// (plan them with [`plan_assistant`]).
    pub fn load_assistant(
        &mut self,
        src: &ModelSource,
        target_path: &Path,
        format: WeightFormat,
    ) -> Result<()> {
        let arena_bytes = model_matrices(&src.config)
            .into_iter()
            .map(|(_, [rows, cols])| WeightArena::footprint(format, rows, cols))
            .sum();
        let arena = WeightArena::new(arena_bytes);
        let ordering = match assistant::clusters(&src.config) {
            Some(_) => Some(crate::model::gemma4_assistant::token_ordering(src)?),
            None => None,
        };
        let a = Assistant::load(src, &self.config, target_path, |role, t| {
            Ok(match (&ordering, role) {
                (Some(order), Role::Embedding) => {
                    let (dtype, bytes) = rows_in_order(&t, order);
                    let view = TensorView {
                        dtype,
                        shape: t.shape,
                        bytes: &bytes,
                    };
                    PackedMatrix::convert_into(&view, format, &arena)
                }
                _ => PackedMatrix::convert_into(&t, format, &arena),
            })
        })?;
        self.attach_assistant(a, ordering.is_some())
    }

    /// Attaches an assistant of shape `config` on random weights in
    /// `format`, called `name` (`bench` prices drafting with it). Its
    /// head's clusters are runs of ids in order, as a real assistant's are
    /// once its rows are in `token_ordering`'s order.
    pub fn attach_random_assistant(
        &mut self,
        config: ModelConfig,
        name: &str,
        format: WeightFormat,
    ) -> Result<()> {
        let path = Path::new(name);
        let target_layers = crate::model::gemma4_assistant::target_kv_layers(
            &self.config,
            Path::new("(the model)"),
            &config,
            path,
        )?;
        let weights = synthetic::random_weights(&config, &WeightFormats::uniform(format), 2);
        let a = Assistant {
            config,
            weights,
            target_layers,
            path: path.to_path_buf(),
        };
        self.attach_assistant(a, true)
    }

    /// Attaches an assistant whose matrices are in the kernels' formats
    /// already: with `ordered_head`, its head's rows are in its token
    /// ordering's order.
    fn attach_assistant(
        &mut self,
        mut a: Assistant<PackedMatrix>,
        ordered_head: bool,
    ) -> Result<()> {
        for (role, m) in a.weights.matrices_mut() {
            let kernels = self.kernels.resolve_one_token(m).map_err(|why| {
                anyhow::anyhow!(
                    "internal error: the {} kernels cannot multiply the assistant's {}: {why}",
                    self.kernels.name(),
                    plan_name(role)
                )
            })?;
            m.set_kernels(kernels);
        }
        self.assistant = Some(FastAssistant {
            a,
            ordered_head,
            kept: vec![(0, Vec::new()); self.seqs.len()],
        });
        Ok(())
    }

    /// Weight bytes one draft token streams: the assistant's matrices,
    /// of a clustered head only the searched clusters' rows; 0 without
    /// an assistant.
    pub fn draft_bytes_per_token(&self) -> usize {
        let Some(fa) = &self.assistant else {
            return 0;
        };
        let share = match (assistant::clusters(&fa.a.config), fa.ordered_head) {
            (Some(k), true) => (k.top_k, k.count),
            _ => (1, 1),
        };
        fa.a.weights
            .matrices()
            .into_iter()
            .map(|(role, m)| match role {
                Role::Embedding => m.bytes() * share.0 / share.1,
                _ => m.bytes(),
            })
            .sum()
    }

    /// Keeps entry `entry`'s final hidden states of the last step, fed to
    /// sequence `seq` from position `start`, for its next draft round.
    pub(super) fn keep_for_drafts(&mut self, seq: usize, start: usize, entry: usize) {
        let Some(fa) = &mut self.assistant else {
            return;
        };
        let hidden = self.config.hidden;
        let rows = self.last_hidden_rows.get(entry).cloned().unwrap_or(0..0);
        if fa.kept.len() <= seq {
            fa.kept.resize(seq + 1, (0, Vec::new()));
        }
        let (kept_start, kept) = &mut fa.kept[seq];
        *kept_start = start;
        kept.clear();
        kept.extend_from_slice(&self.last_hidden[rows.start * hidden..rows.end * hidden]);
    }

    /// One draft round of the assistant for sequence `seq` (see
    /// [`crate::engine::Engine::draft`]).
    pub fn draft_sequence(
        &mut self,
        seq: usize,
        token: u32,
        k: usize,
        mut logits: Option<&mut Vec<f32>>,
    ) -> Result<Vec<u32>> {
        let Some(fa) = &self.assistant else {
            bail!("no assistant is attached to draft with (give one with --draft)");
        };
        if seq >= self.seqs.len() {
            bail!(
                "sequence {seq} does not exist (the engine holds {})",
                self.seqs.len()
            );
        }
        let pos = self.seqs[seq].len;
        assistant::check_round(&self.config, token, k, pos)?;
        let hidden = self.config.hidden;
        let mut h = fa
            .kept
            .get(seq)
            .and_then(|(start, rows)| {
                let i = pos.checked_sub(start + 1)?;
                rows.get(i * hidden..(i + 1) * hidden)
            })
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "internal error: the hidden state of sequence {seq} at position {} was not kept",
                    pos - 1
                )
            })?
            .to_vec();
        let (a, ordered_head) = (&fa.a, fa.ordered_head);
        let (ac, aw) = (&a.config, &a.weights);
        let Some(extra) = &aw.assistant else {
            bail!("internal error: the assistant's projections are missing");
        };
        let vocab = ac.vocab_size;
        let mut embedding_row = vec![0.0; hidden];
        let mut x = vec![0.0; ac.hidden];
        let mut normed = vec![0.0; ac.hidden];
        let mut proj = vec![0.0; ac.hidden];
        let mut tokens = Vec::with_capacity(k);
        let mut next = token;
        for _ in 0..k {
            self.weights
                .embedding
                .row_f32(next as usize, &mut embedding_row);
            let input = assistant::step_input(&embedding_row, &h);
            self.matmul(&extra.pre_projection, &input, &mut x, 1);
            for (l, w) in aw.layers.iter().enumerate() {
                let shape = ac.shape(l);
                let hd = shape.head_dim;
                let mut q = vec![0.0; ac.n_heads * hd];
                self.kernels
                    .rms_norm(&x, &w.attn_norm, &mut normed, ac.rms_eps);
                self.matmul(&w.q, &normed, &mut q, 1);
                let rope = ac.layers[l];
                let (cos, sin) = ops::rope_angles_partial(
                    pos,
                    hd,
                    rope.rope_base,
                    rope.rope_scale,
                    shape.rotated_pairs,
                );
                for head in q.chunks_exact_mut(hd) {
                    if let Some(n) = &w.q_norm {
                        self.kernels.rms_norm_in_place(head, n, ac.rms_eps);
                    }
                    ops::rope(head, &cos, &sin);
                }
                // The visible keys `first..pos` are what a query at pos - 1
                // sees with a window one longer than the layer's: the
                // target's decode attention over them.
                let layer = CachedLayer {
                    cache: a.target_layers[l],
                    head_dim: hd,
                    n_kv_heads: shape.n_kv_heads,
                    n_heads: ac.n_heads,
                    window: rope.window.map(|w| w + 1),
                    softcap: None,
                };
                let mut attn = vec![0.0; q.len()];
                self.decode_attention_over(layer, &[(seq, pos - 1)], &q, &mut attn);
                self.matmul(&w.o, &attn, &mut proj, 1);
                self.residual_add(&mut x, &mut proj, w.attn_post_norm.as_deref());
                self.kernels
                    .rms_norm(&x, &w.ffn_norm, &mut normed, ac.rms_eps);
                let width = shape.ffn_width;
                let (mut gate, mut up, mut act) =
                    (vec![0.0; width], vec![0.0; width], vec![0.0; width]);
                self.matmuls(
                    vec![
                        (&w.gate, &normed[..], &mut gate),
                        (&w.up, &normed[..], &mut up),
                    ],
                    1,
                );
                self.geglu(&gate, &up, &mut act, 1);
                self.matmul(&w.down, &act, &mut proj, 1);
                self.residual_add(&mut x, &mut proj, w.ffn_post_norm.as_deref());
                if w.output_scale != 1.0 {
                    x.iter_mut().for_each(|v| *v *= w.output_scale);
                }
            }
            self.kernels
                .rms_norm_in_place(&mut x, &aw.final_norm, ac.rms_eps);
            self.matmul(&extra.post_projection, &x, &mut h, 1);
            let mut row = logits.as_ref().map(|_| vec![0.0; vocab]);
            next = match (&extra.clusters, assistant::clusters(ac)) {
                (Some(head), Some(shape)) if ordered_head => {
                    let mut scores = vec![0.0; shape.count];
                    self.matmul(&head.centroids, &x, &mut scores, 1);
                    let per = vocab / shape.count;
                    let ordered = self.head_rows(&aw.embedding, &x, &scores, shape, per);
                    let cluster = |c: usize, out: &mut [f32]| {
                        out.copy_from_slice(&ordered[c * per..(c + 1) * per]);
                    };
                    assistant::clustered_head(
                        shape,
                        &scores,
                        &head.token_ordering,
                        cluster,
                        row.as_deref_mut(),
                    )
                }
                _ => {
                    let mut all = vec![0.0; vocab];
                    self.matmul(&aw.embedding, &x, &mut all, 1);
                    assistant::full_head(&all, row.as_deref_mut())
                }
            };
            if let (Some(out), Some(row)) = (logits.as_deref_mut(), row) {
                out.extend_from_slice(&row);
            }
            tokens.push(next);
        }
        Ok(tokens)
    }

    /// The ordered head's products with `f` for the rows of the clusters
    /// with the `top_k` highest scores (the rest of the returned row is
    /// unset): one run of `per` rows per cluster, the clusters spread over
    /// the pool. Clusters whose runs are not whole kernel blocks take the
    /// whole head.
    fn head_rows(
        &self,
        head: &PackedMatrix,
        f: &[f32],
        scores: &[f32],
        shape: crate::model::config::HeadClusters,
        per: usize,
    ) -> Vec<f32> {
        let mut out = vec![0.0; head.rows];
        if !per.is_multiple_of(ROW_GRANULE) {
            self.matmul(head, f, &mut out, 1);
            return out;
        }
        let kept = assistant::kept_clusters(shape, scores);
        let shared = SharedOut::new(&mut out, head.rows);
        let kern = &*self.kernels;
        let threads = self.pool.threads();
        // A quantized head takes 8-bit inputs, quantized once for every
        // cluster (at one level: the head only ranks proposals).
        let quantized = head.format.quant().map(|_| {
            let span = head.kernels().input_span;
            Q8Input::quantize_with(f, head.cols, InputPrecision::Bits8, span)
        });
        self.pool.run(|tid| {
            for &c in kept.iter().skip(tid).step_by(threads) {
                let rows = c * per..(c + 1) * per;
                // SAFETY: each cluster's run of rows (columns of the one
                // output row) belongs to one thread.
                match &quantized {
                    Some(x) => unsafe { kern.gemm_q8(head, x, rows, shared) },
                    None => unsafe { kern.gemm(head, f, rows, shared) },
                }
            }
        });
        out
    }
}
