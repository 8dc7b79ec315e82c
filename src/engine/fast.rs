//! The fast forward pass: 16-bit weights in the kernels' layout, matrix
//! products on the matrix kernels split across the thread pool, prefill as
//! batched GEMMs over chunks of tokens, and logits only where wanted.
//!
//! The math is the reference pass's (same ops, same order of the per-token
//! steps); only the matrix products and their summation order differ.

pub use super::formats::{Conversion, WeightFormats};
use super::formats::{converted_bytes, nearest_with_kernel};
use super::kernels::{GroupAttention, MatKernels, SharedOut, add_block_offsets, merge_key_parts};
use super::key_split::{KeySplit, attention_units};
use super::kv_cache::FlatKv;
use super::ops;
use super::packed::{PackedMatrix, WeightArena, WeightFormat};
use super::pool::{ThreadPool, split_range};
use super::q8_input::{InputPrecision, Q8Input};
use super::step_logits::StepLogits;
use super::{Engine, LogitsWanted};
use crate::jit::blocking::{Blocking, ROW_GRANULE};
use crate::model::config::ModelConfig;
use crate::model::dtype::DType;
use crate::model::quant_blocks;
use crate::model::source::{LayerRole, ModelSource, Role};
use crate::model::weights::{ModelWeights, RowTable, matrix_name, matrix_shape, model_matrices};
use anyhow::{Result, bail};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct FastEngine {
    config: ModelConfig,
    weights: ModelWeights<PackedMatrix>,
    kernels: Box<dyn MatKernels>,
    pool: ThreadPool,
    /// One KV cache per sequence; sequence 0 is the one the [`Engine`]
    /// trait feeds.
    seqs: Vec<FlatKv>,
    /// The plan's blocking (see `jit::blocking`), which every split below
    /// obeys.
    blocking: Blocking,
    activations: Activations,
    /// The last `forward_batch`'s rows after the final norm, `[tokens,
    /// hidden]`, and each batch entry's rows in it (see
    /// [`FastEngine::last_hidden`]).
    last_hidden: Vec<f32>,
    last_hidden_rows: Vec<std::ops::Range<usize>>,
    /// How the integer kernels' inputs are quantized.
    input_precision: InputPrecision,
    /// With two input levels, the kernels' rows before each pair is
    /// added: kept between calls, so a decode step does not fault in a
    /// fresh 2 MB (the head's two rows) every time.
    level_rows: Mutex<Vec<f32>>,
    /// A step's logits buffer handed back ([`FastEngine::recycle_logits`])
    /// for the next step to write over, instead of a fresh zeroed one (1%
    /// of a 4-stream server profile went to zeroing it).
    spare_logits: Mutex<Vec<f32>>,
}

/// A step over at most this many tokens of one sequence computes every
/// token exactly as a one-token decode step would: the same kernels on the
/// same inputs, so the logits are bit-identical (speculative decoding's
/// greedy output then equals plain decoding's, and a server's reply does
/// not depend on which other requests shared its steps). Each weight is
/// still read from memory once per step (see `EXACT_SUBCHUNK_BYTES`).
/// Longer runs of tokens (prompts) go through the GEMMs, whose summation
/// order differs.
pub const EXACT_STEP_MAX_TOKENS: usize = 16;

/// One sequence's tokens in a batched step ([`FastEngine::forward_batch`]).
#[derive(Clone, Copy, Debug)]
pub struct SeqTokens<'a> {
    /// Which KV cache (0..[`FastEngine::sequences`]).
    pub seq: usize,
    /// Fed after the sequence's cached tokens.
    pub tokens: &'a [u32],
    /// Which of its rows need logits; `None` for a prompt chunk followed
    /// by more.
    pub wanted: Option<LogitsWanted>,
}

/// A run of a step's rows: `n` tokens of sequence `seq` from position
/// `start`, computed exactly (per token, as decode) or in bulk (GEMMs).
#[derive(Clone, Copy, Debug)]
struct Part {
    seq: usize,
    start: usize,
    n: usize,
    exact: bool,
}

/// Options for building the fast engine.
pub struct FastOptions {
    pub threads: usize,
    pub context: usize,
    /// Packed weight format; `None` keeps BF16 checkpoints in BF16 and
    /// stores everything else as FP16.
    pub format: Option<WeightFormat>,
    /// Tokens per prefill step; 0 takes the plan's (`Blocking`).
    pub prefill_chunk: usize,
    /// Keep matrices in the file's own quantized type where a kernel
    /// family reads it (Q8_0, Q5_0, Q4_0) instead of widening them to `format`:
    /// the bytes a decode step streams shrink to the file's, and the
    /// values stay the same.
    pub native: bool,
    /// Use matrices a mapped file already stores in the kernels' format
    /// and layout (a `pulsar convert` file) in place (zero-copy) instead of
    /// copying them into the huge-page arena. In place loads faster and
    /// shares the page cache, but decode from 4 KiB page-cache pages
    /// measured slower (270M at F16, 1 thread: 46.6-51.0 against 51.3-56.2
    /// tok/s; with row-major weights it was 33.9 against 45).
    pub in_place: bool,
}

/// `out[t] = pairs[2t] + pairs[2t + 1]` over columns `rows`, for each of
/// `tokens` tokens: the product of a two-level input is its levels' sum
/// (see `InputPrecision::TwoLevels`).
///
/// # Safety
/// No other thread may touch columns `rows` of either output meanwhile.
unsafe fn add_level_pairs(pairs: SharedOut, out: SharedOut, tokens: usize, rows: Range<usize>) {
    for t in 0..tokens {
        // SAFETY: the caller owns columns `rows` of every row of both.
        let (sum, first, second) = unsafe {
            (
                out.cells(t, rows.clone()),
                pairs.cells(2 * t, rows.clone()),
                pairs.cells(2 * t + 1, rows.clone()),
            )
        };
        for ((y, a), b) in sum.iter_mut().zip(first.iter()).zip(second.iter()) {
            *y = a + b;
        }
    }
}

/// Resolves the kernels of every matrix and keeps them with it; on the
/// first matrix `kernels` cannot multiply, says which and why and changes
/// nothing.
fn resolve_kernels(
    kernels: &dyn MatKernels,
    w: &mut ModelWeights<PackedMatrix>,
) -> Result<(), String> {
    let mut matrices = w.matrices_mut();
    let mut resolved = Vec::with_capacity(matrices.len());
    for (role, m) in &matrices {
        match kernels.resolve(m) {
            Ok(k) => resolved.push(k),
            Err(why) => {
                let layer = match role {
                    Role::Layer(i, _) | Role::Expert(i, _, _) => format!(" (layer {i})"),
                    _ => String::new(),
                };
                return Err(format!(
                    "the {} kernels cannot multiply {}{layer}: {why}",
                    kernels.name(),
                    matrix_name(*role)
                ));
            }
        }
    }
    for ((_, m), k) in matrices.iter_mut().zip(resolved) {
        m.set_kernels(k);
    }
    Ok(())
}

/// One step's activations, row-major `[tokens, width]`. Kept by the
/// engine and resized per step, never shrunk: sized once for a prefill
/// chunk, a decode step reuses the same memory. Where layers differ in
/// shape, each buffer is sized for the widest and a layer uses the front.
#[derive(Default)]
struct Activations {
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    /// Gemma 4: every layer's per-layer input, `[tokens, layers x P]`.
    per_layer_inputs: Vec<f32>,
    /// Gemma 4: a layer's per-layer gate, `[tokens, P]`.
    per_layer_gate: Vec<f32>,
    /// Gemma 4's mixture: the experts' input and their weighted sum.
    expert_in: Vec<f32>,
    routed: Vec<f32>,
}

impl Activations {
    /// Sets every buffer to `n` tokens' rows (contents are overwritten
    /// before they are read).
    fn size_for(&mut self, c: &ModelConfig, n: usize) {
        let (q_dim, kv_dim, ffn) = (c.max_q_width(), c.max_kv_width(), c.max_ffn_width());
        let p = c.features.per_layer_input;
        let moe_rows = if c.features.moe.is_some() {
            c.hidden
        } else {
            0
        };
        for (buf, width) in [
            (&mut self.x, c.hidden),
            (&mut self.normed, c.hidden),
            (&mut self.q, q_dim),
            (&mut self.k, kv_dim),
            (&mut self.v, kv_dim),
            (&mut self.attn, q_dim),
            (&mut self.proj, c.hidden),
            (&mut self.gate, ffn),
            (&mut self.up, ffn),
            (&mut self.act, ffn),
            (&mut self.per_layer_inputs, c.n_layers() * p),
            (&mut self.per_layer_gate, p),
            (&mut self.expert_in, moe_rows),
            (&mut self.routed, moe_rows),
        ] {
            buf.resize(n * width, 0.0);
        }
    }
}

/// What a step's layers share: its parts, where each begins, how many
/// leading rows are exact, and the RoPE angles of every row's position.
struct Step<'a> {
    parts: &'a [Part],
    first_rows: Vec<usize>,
    exact: usize,
    /// One table per distinct RoPE of the model's layers (base, scale, head
    /// size and pairs rotated; a model has one or two): `(cos, sin)` per row.
    rope_tables: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    /// Each layer's index into `rope_tables`.
    rope_table_of: Vec<usize>,
}

impl<'a> Step<'a> {
    fn new(c: &ModelConfig, parts: &'a [Part]) -> Step<'a> {
        let first_rows = parts
            .iter()
            .scan(0, |row, p| {
                *row += p.n;
                Some(*row - p.n)
            })
            .collect();
        let positions: Vec<usize> = parts.iter().flat_map(|p| p.start..p.start + p.n).collect();
        let mut keys: Vec<(f32, f32, usize, usize)> = Vec::new();
        let mut rope_tables = Vec::new();
        let rope_table_of = c
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let s = c.shape(i);
                let key = (l.rope_base, l.rope_scale, s.head_dim, s.rotated_pairs);
                keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                    let angles = positions
                        .iter()
                        .map(|&pos| ops::rope_angles_partial(pos, key.2, key.0, key.1, key.3))
                        .collect();
                    keys.push(key);
                    rope_tables.push(angles);
                    rope_tables.len() - 1
                })
            })
            .collect();
        Step {
            parts,
            first_rows,
            exact: parts.iter().filter(|p| p.exact).map(|p| p.n).sum(),
            rope_tables,
            rope_table_of,
        }
    }

    fn angles_of_layer(&self, li: usize) -> &[(Vec<f32>, Vec<f32>)] {
        &self.rope_tables[self.rope_table_of[li]]
    }
}

impl FastEngine {
    /// Loads weights in the kernels' layout: converted (or copied) into one
    /// huge-page arena, or, with `in_place`, used zero-copy from the mapping
    /// where the file already stores them in the packed format.
    pub fn load(
        src: &Arc<ModelSource>,
        kernels: Box<dyn MatKernels>,
        opts: &FastOptions,
    ) -> Result<Self> {
        let owner: Arc<dyn Send + Sync> = src.clone();
        let formats = Self::weight_formats(src, opts)?;
        let c = &src.config;
        // One arena for every matrix that needs converting.
        let arena_bytes = model_matrices(c)
            .into_iter()
            .map(|(role, [rows, cols])| WeightArena::footprint(formats.of(role), rows, cols))
            .sum();
        let arena = WeightArena::new(arena_bytes);
        let table_owner = owner.clone();
        let weights = ModelWeights::load_with(
            src,
            |role, t| {
                let format = formats.of(role);
                if opts.in_place && t.dtype == format.row_blocked_dtype() {
                    PackedMatrix::borrowed(owner.clone(), &t)
                } else {
                    Ok(PackedMatrix::convert_into(&t, format, &arena))
                }
            },
            // A token reads one row of the per-layer table: it stays in
            // the mapped file, in the file's type. Its pages, read once
            // for the scale check, are dropped; rows fault back in as
            // tokens need them.
            |t| {
                t.release_pages();
                Ok(RowTable::mapped(table_owner, &t))
            },
        )?;
        Self::new(src.config.clone(), weights, kernels, opts)
    }

    /// The packed format of each matrix, decided once: with `native`, a
    /// matrix the file stores in a type a kernel family reads stays in it;
    /// every other one gets the 16-bit format of
    /// [`FastEngine::weight_format_for`].
    pub fn weight_formats(src: &ModelSource, opts: &FastOptions) -> Result<WeightFormats> {
        // Each quantized type in the layout this CPU's kernels read.
        let layouts = super::jit_kernels::quant_layouts();
        let native = Self::weight_formats_in_file_layouts(src, opts, layouts.k_quants_native)?
            .with_layouts(&layouts);
        if !native.has_k_quants() || super::jit_kernels::kernels_fit(&src.config, &native) {
            return Ok(native);
        }
        // Q4_K and Q6_K beside three other kernel families (the default
        // model has Q8_0, Q5_0, Q4_K and Q6_K matrices) are more code than
        // the plan's budget: they become Q5_0 with offsets and Q8_0, as
        // before they had kernels of their own.
        Ok(Self::weight_formats_in_file_layouts(src, opts, false)?.with_layouts(&layouts))
    }

    /// The formats as the file's types have them; with `k_quants_native`
    /// false, Q4_K and Q6_K converted to the types of the other kernels.
    fn weight_formats_in_file_layouts(
        src: &ModelSource,
        opts: &FastOptions,
        k_quants_native: bool,
    ) -> Result<WeightFormats> {
        // `--dtype q8_0`: that type wherever the rows are whole blocks,
        // quantized at load; FP16 elsewhere and for prefill's panels.
        if let Some(format) = opts.format.filter(|f| !f.is_16bit()) {
            return Ok(WeightFormats::for_shape(&src.config, format));
        }
        let wide = Self::weight_format_for(src, opts)?;
        let c = &src.config;
        let mut converted: Vec<Conversion> = Vec::new();
        let mut keep =
            |role: Role, name: &'static str, shape: [usize; 2]| -> Result<WeightFormat> {
                if !opts.native || !quant_blocks::fits(shape[1]) {
                    return Ok(wide);
                }
                let t = src.matrix_unscanned(role, &shape)?;
                // A file already in the K-quant layouts (`pulsar convert`)
                // keeps them whatever the choice: nothing converts back.
                if let Some(format) = WeightFormat::native(t.dtype)
                    .filter(|_| k_quants_native || !matches!(t.dtype, DType::Q4K | DType::Q6K))
                {
                    return Ok(format);
                }
                let Some(to) = nearest_with_kernel(t.dtype) else {
                    return Ok(wide);
                };
                let bytes = converted_bytes(t.dtype, to, shape[0], shape[1]);
                match converted
                    .iter_mut()
                    .find(|c| c.tensor == name && c.from == t.dtype)
                {
                    Some(c) => {
                        c.count += 1;
                        c.file_bytes += t.bytes.len();
                        c.bytes += bytes;
                    }
                    None => converted.push(Conversion {
                        tensor: name,
                        from: t.dtype,
                        to,
                        count: 1,
                        file_bytes: t.bytes.len(),
                        bytes,
                    }),
                }
                Ok(to)
            };
        let head = keep(Role::Embedding, "output(lm_head)", [c.vocab_size, c.hidden])?;
        let mut matrices = HashMap::new();
        for (role, shape) in model_matrices(c) {
            if role != Role::Embedding {
                matrices.insert(role, keep(role, matrix_name(role), shape)?);
            }
        }
        Ok(WeightFormats {
            wide,
            head,
            matrices,
            converted,
        })
    }

    /// The one packed format all matrices get (the kernels are planned for
    /// one): the requested one, else BF16 for a BF16 checkpoint (lossless)
    /// and FP16 for everything else, judged by the first layer's Q.
    pub fn weight_format_for(src: &ModelSource, opts: &FastOptions) -> Result<WeightFormat> {
        if let Some(f) = opts.format.filter(|f| f.is_16bit()) {
            return Ok(f);
        }
        let c = &src.config;
        let q = src.tensor_unscanned(
            Role::Layer(0, LayerRole::Q),
            &matrix_shape(Role::Layer(0, LayerRole::Q), c),
        )?;
        Ok(WeightFormat::default_for(q.dtype))
    }

    pub fn new(
        config: ModelConfig,
        mut weights: ModelWeights<PackedMatrix>,
        kernels: Box<dyn MatKernels>,
        opts: &FastOptions,
    ) -> Result<Self> {
        if opts.context == 0 {
            bail!("the context size must be at least 1 token");
        }
        if let Err(why) = resolve_kernels(&*kernels, &mut weights) {
            bail!("internal error: {why}; the plan was made for other weight formats");
        }
        let kv = FlatKv::new(&config, opts.context)?;
        let blocking = kernels.blocking();
        let prefill_chunk = match opts.prefill_chunk {
            0 => blocking.prefill_chunk,
            n => n,
        };
        // Room for a prefill chunk up front: later steps only reuse it.
        let mut activations = Activations::default();
        activations.size_for(&config, prefill_chunk.min(opts.context));
        Ok(FastEngine {
            config,
            weights,
            kernels,
            pool: ThreadPool::new(opts.threads),
            seqs: vec![kv],
            blocking: Blocking {
                prefill_chunk,
                ..blocking
            },
            activations,
            last_hidden: Vec::new(),
            last_hidden_rows: Vec::new(),
            input_precision: InputPrecision::default(),
            level_rows: Mutex::new(Vec::new()),
            spare_logits: Mutex::new(Vec::new()),
        })
    }

    /// How many matrices are used in place from a mapped file, of how
    /// many.
    pub fn matrices_in_place(&self) -> (usize, usize) {
        let all = self.weights.matrices();
        let in_place = all.iter().filter(|(_, m)| m.is_borrowed()).count();
        (in_place, all.len())
    }

    /// The packed formats of the matrices.
    pub fn formats(&self) -> WeightFormats {
        let matrices: HashMap<Role, WeightFormat> = self
            .weights
            .matrices()
            .into_iter()
            .filter(|&(role, _)| role != Role::Embedding)
            .map(|(role, m)| (role, m.format))
            .collect();
        let wide = matrices
            .values()
            .copied()
            .chain([self.weights.embedding.format])
            .find(|f| f.is_16bit())
            .unwrap_or(WeightFormat::F16);
        WeightFormats {
            wide,
            head: self.weights.embedding.format,
            matrices,
            converted: Vec::new(),
        }
    }

    pub fn kernels_name(&self) -> String {
        self.kernels.name()
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Swaps in other kernels (launch tuning measures candidates on real
    /// calls) and returns the previous ones; kernels that cannot multiply
    /// every matrix are refused and handed back.
    pub fn replace_kernels(
        &mut self,
        kernels: Box<dyn MatKernels>,
    ) -> Result<Box<dyn MatKernels>, (Box<dyn MatKernels>, String)> {
        if let Err(why) = resolve_kernels(&*kernels, &mut self.weights) {
            return Err((kernels, why));
        }
        Ok(std::mem::replace(&mut self.kernels, kernels))
    }

    /// The blocking every split obeys.
    pub fn blocking(&self) -> &Blocking {
        &self.blocking
    }

    /// Replaces the blocking (tests vary it; tuning applies what it
    /// measured). Results do not depend on it beyond summation order, and
    /// exact steps not at all.
    pub fn set_blocking(&mut self, blocking: Blocking) {
        assert!(
            blocking.row_granule.is_multiple_of(ROW_GRANULE) && blocking.prefill_chunk > 0,
            "blocking {blocking:?}: rows in whole kernel blocks, at least one token per step"
        );
        self.blocking = blocking;
    }

    /// How the integer kernels' inputs are quantized (default: one 8-bit
    /// level). Exact steps stay exact at either precision.
    pub fn set_input_precision(&mut self, precision: InputPrecision) {
        self.input_precision = precision;
    }

    pub fn input_precision(&self) -> InputPrecision {
        self.input_precision
    }

    /// Weight bytes one decode step streams: every layer matrix and the LM
    /// head (the embedding lookup touches one row).
    pub fn bytes_per_token(&self) -> usize {
        // A token reads one row of the per-layer input table, and of a
        // mixture only the experts it is routed to: their share of all.
        let (top_k, experts) = self
            .config
            .features
            .moe
            .map_or((1, 1), |m| (m.top_k, m.experts));
        self.weights
            .matrices()
            .into_iter()
            .map(|(role, m)| match role {
                Role::Expert(..) => m.bytes() * top_k / experts,
                _ => m.bytes(),
            })
            .sum()
    }

    /// `y[t] = W · x[t]` for every token, rows split across the pool; the
    /// first `exact` tokens as decode computes them (see `matmuls`).
    fn matmul(&self, w: &PackedMatrix, x: &[f32], y: &mut [f32], exact: usize) {
        self.matmuls(vec![(w, x, y)], exact);
    }

    /// Several independent products in one parallel section (one wake-up).
    /// 16-bit weights: the first `exact` tokens of each input are
    /// multiplied one at a time by the GEMV a decode step uses (so their
    /// results are bit-identical to a one-token step's), the rest together
    /// by the GEMM. When more than one pass reads a thread's rows, the rows
    /// go in sub-chunks of `Blocking::shared_rows_bytes`, so every pass
    /// after the first finds them in cache: the weights are streamed from
    /// memory once per call. Quantized weights: every token's input is
    /// quantized to 8 bits and all go to the integer kernels in one pass,
    /// whose results are bit-identical to a one-token step's anyway (the
    /// GEMM reads each weight once for 8 tokens, see `emit::gemm_quant`).
    /// With two input levels each token is two of the integer kernels'
    /// tokens, whose rows are added in pairs (`add_level_pairs`).
    fn matmuls(&self, jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])>, exact: usize) {
        struct Job<'a> {
            w: &'a PackedMatrix,
            x: &'a [f32],
            exact: usize,
            /// Index into `quantized` of the exact tokens' 8-bit input.
            q8: Option<usize>,
            out: SharedOut,
            /// With two input levels: where the kernels write, two rows
            /// per token, before each pair is added into `out`.
            level_rows: Option<SharedOut>,
        }
        let levels = self.input_precision.levels();
        let quantized_with_levels = |w: &PackedMatrix| w.format.quant().is_some() && levels > 1;
        // Every job's level rows in one buffer, carved up below.
        let mut level_rows = self.level_rows.lock().unwrap_or_else(|e| e.into_inner());
        let wanted: usize = jobs
            .iter()
            .filter(|(w, _, _)| quantized_with_levels(w))
            .map(|(w, x, _)| levels * x.len() / w.cols * w.rows)
            .sum();
        if level_rows.len() < wanted {
            level_rows.resize(wanted, 0.0);
        }
        let mut level_rows_left = &mut level_rows[..];
        let mut work = Vec::with_capacity(jobs.len());
        // An integer kernel's input is quantized once, here, for every
        // thread's chunk of rows, and once for the jobs that share it (q, k
        // and v; gate and up).
        // Keyed by the input's address: the same slice, not equal values.
        let mut quantized: Vec<(usize, Q8Input)> = Vec::new();
        for (w, x, y) in jobs {
            assert_eq!(x.len() % w.cols, 0, "input is not whole rows");
            assert_eq!(y.len(), x.len() / w.cols * w.rows, "output size");
            let tokens = x.len() / w.cols;
            let exact = if w.format.quant().is_some() {
                tokens
            } else {
                exact.min(tokens)
            };
            let q8 = (w.format.quant().is_some() && exact > 0).then(|| {
                let at = x.as_ptr() as usize;
                let tokens = exact * levels;
                match quantized
                    .iter()
                    .position(|(p, q)| *p == at && q.k() == w.cols && q.tokens() == tokens)
                {
                    Some(i) => i,
                    None => {
                        let x = &x[..exact * w.cols];
                        let input = Q8Input::quantize_with(x, w.cols, self.input_precision);
                        quantized.push((at, input));
                        quantized.len() - 1
                    }
                }
            });
            let level_rows = (q8.is_some() && levels > 1).then(|| {
                let (rows, rest) =
                    std::mem::take(&mut level_rows_left).split_at_mut(levels * exact * w.rows);
                level_rows_left = rest;
                SharedOut::new(rows, w.rows)
            });
            let out = SharedOut::new(y, w.rows);
            work.push(Job {
                w,
                x,
                exact,
                q8,
                out,
                level_rows,
            });
        }
        // One pass of the job's kernels over `rows`.
        let pass = |job: &Job, rows: Range<usize>| {
            let (w, k) = (job.w, job.w.cols);
            if job.exact > 0 {
                // SAFETY (both arms): the caller owns columns `rows` of
                // every row of the output.
                match job.q8 {
                    Some(i) => unsafe {
                        let x = &quantized[i].1;
                        let out = job.level_rows.unwrap_or(job.out);
                        self.kernels.gemm_q8(w, x, rows.clone(), out);
                        if let Some(offsets) = w.offsets() {
                            add_block_offsets(offsets, x, rows.clone(), out);
                        }
                        if let Some(pairs) = job.level_rows {
                            add_level_pairs(pairs, job.out, job.exact, rows.clone());
                        }
                    },
                    None => {
                        for t in 0..job.exact {
                            let x = &job.x[t * k..(t + 1) * k];
                            unsafe { self.kernels.gemm(w, x, rows.clone(), job.out.from_row(t)) };
                        }
                    }
                }
            }
            if job.x.len() > job.exact * k {
                let x = &job.x[job.exact * k..];
                // SAFETY: as above.
                unsafe { self.kernels.gemm(w, x, rows, job.out.from_row(job.exact)) };
            }
        };
        // Rows are handed out from a shared counter rather than split evenly
        // up front, so a thread slowed by anything (another process, a
        // slower memory path) takes less work instead of holding everyone at
        // the section's end. Chunk sizes are guided: each take is a
        // 1/(2*threads) share of the rows left, down to `min_chunk_bytes`. Every
        // chunk starts a new memory stream that the prefetchers must ramp up
        // on; at decode, fixed 256 KiB chunks left the LM head 10% and the
        // layers 8% slower than a few large chunks (same process, alternate
        // tokens), and the shrinking tail keeps the end of a section short.
        let threads = self.pool.threads();
        let b = &self.blocking;
        let next: Vec<AtomicUsize> = work.iter().map(|_| AtomicUsize::new(0)).collect();
        self.pool.run(|_| {
            for (job, next) in work.iter().zip(&next) {
                let w = job.w;
                let row_bytes = w.bytes() / w.rows.next_multiple_of(b.row_granule).max(1);
                let min_rows = b.rows_within(b.min_chunk_bytes, row_bytes);
                let bulk = job.x.len() > job.exact * w.cols;
                let passes = match job.q8 {
                    Some(_) => 1,
                    None => job.exact + usize::from(bulk),
                };
                let sub_rows = if passes > 1 {
                    b.rows_within(b.shared_rows_bytes, row_bytes)
                } else {
                    usize::MAX
                };
                let mut r0 = next.load(Ordering::Relaxed);
                while r0 < w.rows {
                    let left = w.rows - r0;
                    let size = (left / (2 * threads))
                        .next_multiple_of(b.row_granule)
                        .max(min_rows)
                        .min(left);
                    match next.compare_exchange_weak(
                        r0,
                        r0 + size,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => {
                            // Each chunk of rows goes to exactly one thread.
                            let end = r0 + size;
                            let mut s0 = r0;
                            while s0 < end {
                                let s1 = s0.saturating_add(sub_rows).min(end);
                                pass(job, s0..s1);
                                s0 = s1;
                            }
                            r0 = next.load(Ordering::Relaxed);
                        }
                        Err(now) => r0 = now,
                    }
                }
            }
        });
    }

    /// Runs one step over the rows of `parts` (their tokens in `tokens`, in
    /// order, exact parts first) and returns the final-norm output of each
    /// row. Every part's tokens follow its sequence's cached ones. Reads
    /// like the reference pass: embed, then per layer an attention block
    /// and a feed-forward block, then the final norm.
    fn forward_parts(&mut self, parts: &[Part], tokens: &[u32]) -> Result<Vec<f32>> {
        let n = tokens.len();
        debug_assert_eq!(parts.iter().map(|p| p.n).sum::<usize>(), n);
        debug_assert!(parts.iter().skip_while(|p| p.exact).all(|p| !p.exact));
        let step = Step::new(&self.config, parts);
        // The activations live in the engine between steps (sized once for
        // the largest step); taken out here so the blocks can borrow the
        // engine while writing them.
        let mut acts = std::mem::take(&mut self.activations);
        acts.size_for(&self.config, n);
        let result = self.embed(tokens, &mut acts).map(|()| {
            for li in 0..self.config.n_layers() {
                self.attention_block(li, &step, &mut acts);
                self.feed_forward_block(li, step.exact, &mut acts);
                self.per_layer_input_block(li, step.exact, &mut acts);
            }
            self.kernels.rms_norm_in_place(
                &mut acts.x,
                &self.weights.final_norm,
                self.config.rms_eps,
            );
            acts.x.clone()
        });
        self.activations = acts;
        if result.is_ok() {
            for p in parts {
                self.seqs[p.seq].len = p.start + p.n;
            }
        }
        result
    }

    /// Each token's scaled embedding row into `x`, and with per-layer
    /// inputs each token's input to every layer.
    fn embed(&self, tokens: &[u32], a: &mut Activations) -> Result<()> {
        let c = &self.config;
        let scale = (c.hidden as f32).sqrt();
        for (&token, row) in tokens.iter().zip(a.x.chunks_exact_mut(c.hidden)) {
            if token as usize >= c.vocab_size {
                bail!(
                    "token id {token} is outside the vocabulary (size {})",
                    c.vocab_size
                );
            }
            self.weights.embedding.row_f32(token as usize, row);
            row.iter_mut().for_each(|v| *v *= scale);
        }
        if let Some(table) = &self.weights.per_layer_input {
            let p = c.features.per_layer_input;
            let width = c.n_layers() * p;
            // The projection of the scaled embeddings, then per token
            // combined with its row of the table.
            self.matmul(
                &table.model_projection,
                &a.x,
                &mut a.per_layer_inputs,
                tokens.len(),
            );
            let mut row = vec![0.0; width];
            for (&token, inputs) in tokens
                .iter()
                .zip(a.per_layer_inputs.chunks_exact_mut(width))
            {
                table.embedding.row_f32(token as usize, &mut row);
                ops::combine_per_layer_inputs(
                    inputs,
                    &row,
                    &table.projection_norm,
                    c.hidden,
                    c.rms_eps,
                );
            }
        }
        Ok(())
    }

    /// Layer `li`'s attention: norm, q/k/v, q/k norms and RoPE, the new
    /// keys and values into each sequence's cache (unless the layer reads
    /// an earlier layer's), attention per part, the output projection and
    /// the residual.
    fn attention_block(&mut self, li: usize, step: &Step, a: &mut Activations) {
        let c = &self.config;
        let shape = c.shape(li);
        let n = a.x.len() / c.hidden;
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let q_dim = c.n_heads * shape.head_dim;
        let w = &self.weights.layers[li];
        self.kernels
            .rms_norm(&a.x, &w.attn_norm, &mut a.normed, c.rms_eps);
        let (q, k, v) = (
            &mut a.q[..n * q_dim],
            &mut a.k[..n * kv_dim],
            &mut a.v[..n * kv_dim],
        );
        let mut jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])> = vec![(&w.q, &a.normed, q)];
        if let Some(wk) = &w.k {
            jobs.push((wk, &a.normed, k));
        }
        if let Some(wv) = &w.v {
            jobs.push((wv, &a.normed, v));
        }
        self.matmuls(jobs, step.exact);
        let keeps_kv = w.k.is_some();
        if keeps_kv && w.v.is_none() {
            // k = v: the values are the raw keys, before K's norm and RoPE.
            a.v[..n * kv_dim].copy_from_slice(&a.k[..n * kv_dim]);
        }
        self.prepare_queries_keys(
            li,
            step.angles_of_layer(li),
            &mut a.q[..n * q_dim],
            keeps_kv.then_some(&mut a.k[..n * kv_dim]),
            keeps_kv.then_some(&mut a.v[..n * kv_dim]),
        );
        if keeps_kv {
            for (p, &row) in step.parts.iter().zip(&step.first_rows) {
                for t in 0..p.n {
                    let r = (row + t) * kv_dim..(row + t + 1) * kv_dim;
                    self.seqs[p.seq].store(li, p.start + t, &a.k[r.clone()], &a.v[r]);
                }
            }
        }
        // The exact parts come first: their tokens attend alone, all in one
        // parallel section.
        let exact_tokens: Vec<(usize, usize)> = step
            .parts
            .iter()
            .filter(|p| p.exact)
            .flat_map(|p| (0..p.n).map(|t| (p.seq, p.start + t)))
            .collect();
        let exact_rows = exact_tokens.len() * q_dim;
        if !exact_tokens.is_empty() {
            let (q, out) = (&a.q[..exact_rows], &mut a.attn[..exact_rows]);
            self.decode_attention(li, &exact_tokens, q, out);
        }
        for (p, &row) in step.parts.iter().zip(&step.first_rows) {
            if !p.exact {
                let rows = row * q_dim..(row + p.n) * q_dim;
                let (q, out) = (&a.q[rows.clone()], &mut a.attn[rows]);
                self.attention(p.seq, li, p.start, q, out, p.n);
            }
        }
        let w = &self.weights.layers[li];
        self.matmul(&w.o, &a.attn[..n * q_dim], &mut a.proj, step.exact);
        self.residual_add(&mut a.x, &mut a.proj, w.attn_post_norm.as_deref());
    }

    /// Layer `li`'s feed-forward: norm, gate and up, GeGLU, down, with a
    /// mixture the experts beside it, and the residual.
    fn feed_forward_block(&self, li: usize, exact: usize, a: &mut Activations) {
        let c = &self.config;
        let w = &self.weights.layers[li];
        let n = a.x.len() / c.hidden;
        let width = c.shape(li).ffn_width;
        self.kernels
            .rms_norm(&a.x, &w.ffn_norm, &mut a.normed, c.rms_eps);
        self.matmuls(
            vec![
                (&w.gate, &a.normed, &mut a.gate[..n * width]),
                (&w.up, &a.normed, &mut a.up[..n * width]),
            ],
            exact,
        );
        self.geglu(
            &a.gate[..n * width],
            &a.up[..n * width],
            &mut a.act[..n * width],
            n,
        );
        self.matmul(&w.down, &a.act[..n * width], &mut a.proj, exact);
        if let Some(moe) = &w.moe {
            self.kernels
                .rms_norm_in_place(&mut a.proj, &moe.dense_post_norm, c.rms_eps);
            self.experts_block(li, exact, a);
            self.kernels
                .rms_norm_in_place(&mut a.routed, &moe.experts_post_norm, c.rms_eps);
            for (p, r) in a.proj.iter_mut().zip(&a.routed) {
                *p += r;
            }
        }
        self.residual_add(&mut a.x, &mut a.proj, w.ffn_post_norm.as_deref());
    }

    /// The mixture of layer `li` for every row of `a.x` into `a.routed`:
    /// each token's experts chosen by the router (in Rust: a few dozen
    /// dot products), then the tokens grouped by expert so each chosen
    /// expert's rows are read once for the step, all experts' products in
    /// one parallel section per stage.
    fn experts_block(&self, li: usize, exact: usize, a: &mut Activations) {
        let c = &self.config;
        let (Some(moe), Some(shape)) = (&self.weights.layers[li].moe, c.features.moe) else {
            return;
        };
        let (h, width) = (c.hidden, shape.width);
        let n = a.x.len() / h;
        self.kernels
            .rms_norm(&a.x, &moe.norm, &mut a.expert_in, c.rms_eps);
        // Per expert: its tokens (rows of the step, in order) and weights.
        let mut routed_to: Vec<Vec<(usize, f32)>> = vec![Vec::new(); shape.experts];
        for (t, x) in a.x.chunks_exact(h).enumerate() {
            let routes = ops::route_token(
                &moe.router.data,
                &moe.router_input_scale,
                &moe.expert_scale,
                x,
                shape.top_k,
                c.rms_eps,
            );
            for (e, weight) in routes {
                routed_to[e].push((t, weight));
            }
        }
        let used: Vec<usize> = (0..shape.experts)
            .filter(|&e| !routed_to[e].is_empty())
            .collect();
        // Each used expert's inputs gathered, and room for its products.
        let gathered: Vec<Vec<f32>> = used
            .iter()
            .map(|&e| {
                routed_to[e]
                    .iter()
                    .flat_map(|&(t, _)| a.expert_in[t * h..(t + 1) * h].iter().copied())
                    .collect()
            })
            .collect();
        let exact_of = |e: usize| routed_to[e].iter().filter(|&&(t, _)| t < exact).count();
        let rows_of = |e: usize| routed_to[e].len();
        let mut gates: Vec<Vec<f32>> = used
            .iter()
            .map(|&e| vec![0.0; rows_of(e) * width])
            .collect();
        let mut ups: Vec<Vec<f32>> = gates.clone();
        // One section for every expert's gate and up. Each job's exact
        // tokens lead its input, as `matmuls` wants; all jobs share the
        // smallest count (tokens past it go through the GEMM, which only
        // 16-bit weights distinguish).
        let jobs_exact = used.iter().map(|&e| exact_of(e)).min().unwrap_or(0);
        let mut jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])> = Vec::new();
        for (((&e, x), g), u) in used.iter().zip(&gathered).zip(&mut gates).zip(&mut ups) {
            let expert = &moe.experts[e];
            jobs.push((&expert.gate, x, g));
            jobs.push((&expert.up, x, u));
        }
        self.matmuls(jobs, jobs_exact);
        let mut acts: Vec<Vec<f32>> = gates
            .iter()
            .zip(&ups)
            .map(|(g, u)| {
                let mut out = vec![0.0; g.len()];
                self.kernels.geglu(g, u, &mut out);
                out
            })
            .collect();
        let mut outs: Vec<Vec<f32>> = used.iter().map(|&e| vec![0.0; rows_of(e) * h]).collect();
        let jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])> = used
            .iter()
            .zip(&mut acts)
            .zip(&mut outs)
            .map(|((&e, x), y)| (&moe.experts[e].down, &x[..], &mut y[..]))
            .collect();
        self.matmuls(jobs, jobs_exact);
        // Each token's sum in expert order, whatever else shares the step.
        a.routed[..n * h].fill(0.0);
        for (&e, out) in used.iter().zip(&outs) {
            for (&(t, weight), y) in routed_to[e].iter().zip(out.chunks_exact(h)) {
                for (r, v) in a.routed[t * h..(t + 1) * h].iter_mut().zip(y) {
                    *r += weight * v;
                }
            }
        }
    }

    /// Gemma 4's per-layer input of layer `li`, added to the residual:
    /// `post_norm(projection(gelu(gate(x)) * input))`, then the layer's
    /// scale on the whole stream.
    fn per_layer_input_block(&self, li: usize, exact: usize, a: &mut Activations) {
        let c = &self.config;
        let w = &self.weights.layers[li];
        if let Some(ple) = &w.per_layer_input {
            let p = c.features.per_layer_input;
            let n = a.x.len() / c.hidden;
            let width = c.n_layers() * p;
            self.matmul(&ple.gate, &a.x, &mut a.per_layer_gate[..n * p], exact);
            for (t, gate) in a.per_layer_gate[..n * p].chunks_exact_mut(p).enumerate() {
                let input = &a.per_layer_inputs[t * width + li * p..t * width + (li + 1) * p];
                for (g, &i) in gate.iter_mut().zip(input) {
                    *g = ops::gelu_tanh(*g) * i;
                }
            }
            self.matmul(
                &ple.projection,
                &a.per_layer_gate[..n * p],
                &mut a.proj,
                exact,
            );
            self.residual_add(&mut a.x, &mut a.proj, Some(&ple.post_norm));
        }
        if w.output_scale != 1.0 {
            let s = w.output_scale;
            a.x.iter_mut().for_each(|v| *v *= s);
        }
    }

    /// Per token, in parallel: q/k norms, RoPE with the given angles (one
    /// pair of tables per token) and the query scale; with a V norm, V's
    /// heads normalised. `k` and `v` are `None` in a layer that reads an
    /// earlier layer's cache.
    fn prepare_queries_keys(
        &self,
        li: usize,
        angles: &[(Vec<f32>, Vec<f32>)],
        q: &mut [f32],
        k: Option<&mut [f32]>,
        v: Option<&mut [f32]>,
    ) {
        let c = &self.config;
        let w = &self.weights.layers[li];
        let shape = c.shape(li);
        let (hd, n) = (shape.head_dim, angles.len());
        let kv_dim = shape.n_kv_heads * hd;
        let qs = SharedOut::new(q, c.n_heads * hd);
        let ks = k.map(|k| SharedOut::new(k, kv_dim));
        let vs = v
            .filter(|_| c.features.value_norm)
            .map(|v| SharedOut::new(v, kv_dim));
        let kern = &*self.kernels;
        let prepare = |t: usize| {
            let (cos, sin) = &angles[t];
            // SAFETY: token t's rows belong to one caller of `prepare`.
            let q_row = unsafe { qs.cells(t, 0..qs.stride) };
            if let Some(nw) = &w.q_norm {
                kern.rms_norm_in_place(q_row, nw, c.rms_eps);
            }
            for head in q_row.chunks_exact_mut(hd) {
                ops::rope(head, cos, sin);
                if c.query_scale != 1.0 {
                    head.iter_mut().for_each(|e| *e *= c.query_scale);
                }
            }
            if let Some(ks) = &ks {
                // SAFETY: as above.
                let k_row = unsafe { ks.cells(t, 0..ks.stride) };
                if let Some(nw) = &w.k_norm {
                    kern.rms_norm_in_place(k_row, nw, c.rms_eps);
                }
                for head in k_row.chunks_exact_mut(hd) {
                    ops::rope(head, cos, sin);
                }
            }
            if let Some(vs) = &vs {
                // SAFETY: as above.
                let v_row = unsafe { vs.cells(t, 0..vs.stride) };
                for head in v_row.chunks_exact_mut(hd) {
                    ops::rms_normalize(head, c.rms_eps);
                }
            }
        };
        // A single decode token is not worth waking the pool for.
        if n == 1 {
            return prepare(0);
        }
        let threads = self.pool.threads();
        self.pool
            .run(|tid| (tid..n).step_by(threads).for_each(prepare));
    }

    /// Causal (and windowed) attention of `n` new queries at positions
    /// `start..start+n` over the cache. A unit of work is one KV head, a
    /// block of tokens and the query heads sharing that KV head (split when
    /// a short chunk leaves too few units for the threads), so each K and V
    /// row is read once per block rather than once per query head. A single
    /// token (decode) splits its keys instead: see `decode_attention`.
    fn attention(&self, seq: usize, li: usize, start: usize, q: &[f32], out: &mut [f32], n: usize) {
        let c = &self.config;
        let kv = &self.seqs[seq];
        let shape = c.shape(li);
        let (hd, n_kv_heads, cache) = (shape.head_dim, shape.n_kv_heads, shape.kv_layer);
        let q_dim = c.n_heads * hd;
        let group = c.n_heads / n_kv_heads;
        let window = c.layers[li].window;
        let (keys, values) = (&kv.keys[cache], &kv.values[cache]);
        let threads = self.pool.threads();
        if n == 1 {
            return self.decode_attention(li, &[(seq, start)], q, out);
        }
        let token_block = self.blocking.attention_token_block;
        let blocks = n.div_ceil(token_block);
        let head_parts = if blocks * n_kv_heads >= threads {
            1
        } else {
            group.min(threads.div_ceil(blocks * n_kv_heads))
        };
        let heads_per_part = group.div_ceil(head_parts);
        let units = n_kv_heads * blocks * head_parts;
        let next = AtomicUsize::new(0);
        let shared = SharedOut::new(out, q_dim);
        let kern = &*self.kernels;
        self.pool.run(|_| {
            // Sized for the largest unit up front: growing them would copy.
            let rows = token_block * heads_per_part;
            let max_keys = window.map_or(start + n, |w| (w + token_block).min(start + n));
            let mut queries = Vec::with_capacity(rows * hd);
            let mut result = Vec::with_capacity(rows * hd);
            let mut scratch = Vec::with_capacity(rows * max_keys);
            loop {
                let taken = next.fetch_add(1, Ordering::Relaxed);
                if taken >= units {
                    break;
                }
                // Later token blocks see more keys: hand them out first.
                let unit = units - 1 - taken;
                let (kv_head, rest) = (unit % n_kv_heads, unit / n_kv_heads);
                let (block, part) = (rest / head_parts, rest % head_parts);
                let (t0, t1) = (block * token_block, ((block + 1) * token_block).min(n));
                let (h0, h1) = (
                    part * heads_per_part,
                    ((part + 1) * heads_per_part).min(group),
                );
                if h0 >= h1 {
                    continue;
                }
                let head_col = |t: usize, h: usize| t * q_dim + (kv_head * group + h) * hd;
                queries.clear();
                for t in t0..t1 {
                    for h in h0..h1 {
                        queries.extend_from_slice(&q[head_col(t, h)..head_col(t, h) + hd]);
                    }
                }
                let first_query = start + t0;
                let first_key = window.map_or(0, |w| (first_query + 1).saturating_sub(w));
                let (lo, hi) = (
                    kv.at(cache, kv_head, first_key),
                    kv.at(cache, kv_head, start + t1),
                );
                let block_attention = GroupAttention {
                    queries: &queries,
                    head_dim: hd,
                    rows_per_token: h1 - h0,
                    first_query,
                    keys: &keys[lo..hi],
                    values: &values[lo..hi],
                    first_key,
                    window,
                    softcap: c.attn_softcap,
                };
                result.resize(queries.len(), 0.0);
                kern.attend(&block_attention, &mut scratch, &mut result, None);
                for (i, row) in result.chunks_exact(hd).enumerate() {
                    let (t, h) = (t0 + i / (h1 - h0), h0 + i % (h1 - h0));
                    let col = (kv_head * group + h) * hd;
                    // SAFETY: each (token, head) belongs to exactly one unit.
                    unsafe { shared.cells(t, col..col + hd) }.copy_from_slice(row);
                }
            }
        });
    }

    /// Attention of single tokens, each with its keys split into parts:
    /// token `i` is sequence `tokens[i].0`'s position `tokens[i].1`, its
    /// queries row `i` of `q` and its result row `i` of `out`. A unit of
    /// work is one part of a KV head's keys for a run of the step's tokens
    /// (`key_split`): all the query heads sharing that KV head, and every
    /// token of a verify step whose split has the same inner boundaries,
    /// so each K and V row of the part is read once for all of them.
    /// Splitting the query heads instead would have every thread read all
    /// of the head's keys and values. The parts' results are merged by
    /// their softmax mass. A token's split depends only on its position
    /// and the threads, and its query rows see only their own keys, so it
    /// gets the same result whichever step computes it, alone or beside
    /// others: the tokens of a step share one parallel section, whose units
    /// the threads take in any order.
    ///
    /// (One section per token made every token pay a wake-up, and with
    /// Gemma 3 270M's one KV head and a short context a token is a single
    /// unit, so one thread attended while the other waited. At a 64-token
    /// context, steps over 8 tokens spent 5.8% of their samples in
    /// attention and 5.8% in the workers' wait with a section per token,
    /// 5.3% and 5.3% with one per step: a small gain, within the m-curve's
    /// noise. Until the units took runs of tokens, each token of a verify
    /// step read the whole cache again.)
    fn decode_attention(&self, li: usize, tokens: &[(usize, usize)], q: &[f32], out: &mut [f32]) {
        let c = &self.config;
        let shape = c.shape(li);
        let (hd, n_kv_heads, cache) = (shape.head_dim, shape.n_kv_heads, shape.kv_layer);
        let group = c.n_heads / n_kv_heads;
        let q_dim = c.n_heads * hd;
        debug_assert_eq!(q.len(), tokens.len() * q_dim);
        let window = c.layers[li].window;
        let threads = self.pool.threads();
        let splits: Vec<KeySplit> = tokens
            .iter()
            .map(|&(seq, pos)| {
                KeySplit::new(seq, pos, window, threads, self.blocking.min_keys_per_part)
            })
            .collect();
        // Token i's part p of KV head h is row `first_row[i] + h * parts + p`
        // of both outputs, so a KV head's parts are adjacent.
        let mut first_row = Vec::with_capacity(splits.len() + 1);
        first_row.push(0);
        for s in &splits {
            first_row.push(first_row[first_row.len() - 1] + n_kv_heads * s.parts());
        }
        let rows = first_row[splits.len()];
        let mut partial = vec![0.0f32; rows * group * hd];
        let mut log_sums = vec![0.0f32; rows * group];
        let (partial_out, log_sums_out) = (
            SharedOut::new(&mut partial, group * hd),
            SharedOut::new(&mut log_sums, group),
        );
        let units = attention_units(&splits, n_kv_heads, threads);
        let most_scores = units
            .iter()
            .map(|u| u.tokens.len() * group * u.keys(&splits).len())
            .max();
        let most_rows = units.iter().map(|u| u.tokens.len() * group).max();
        let next = AtomicUsize::new(0);
        let kern = &*self.kernels;
        self.pool.run(|_| {
            let mut scratch = Vec::with_capacity(most_scores.unwrap_or(0));
            let (mut queries, mut result, mut unit_log_sums) = (
                Vec::with_capacity(most_rows.unwrap_or(0) * hd),
                Vec::new(),
                Vec::new(),
            );
            loop {
                let taken = next.fetch_add(1, Ordering::Relaxed);
                let Some(unit) = units.get(taken) else {
                    break;
                };
                let first = &splits[unit.tokens.start];
                let kv = &self.seqs[first.seq];
                let keys = unit.keys(&splits);
                let (lo, hi) = (
                    kv.at(cache, unit.kv_head, keys.start),
                    kv.at(cache, unit.kv_head, keys.end),
                );
                let head_rows = |i: usize| {
                    let col = i * q_dim + unit.kv_head * group * hd;
                    col..col + group * hd
                };
                let unit_queries = if unit.tokens.len() == 1 || n_kv_heads == 1 {
                    &q[head_rows(unit.tokens.start).start..head_rows(unit.tokens.end - 1).end]
                } else {
                    queries.clear();
                    for i in unit.tokens.clone() {
                        queries.extend_from_slice(&q[head_rows(i)]);
                    }
                    &queries[..]
                };
                let a = GroupAttention {
                    queries: unit_queries,
                    head_dim: hd,
                    rows_per_token: group,
                    first_query: first.pos,
                    keys: &kv.keys[cache][lo..hi],
                    values: &kv.values[cache][lo..hi],
                    first_key: keys.start,
                    window,
                    softcap: c.attn_softcap,
                };
                let row_of = |i: usize| first_row[i] + unit.kv_head * splits[i].parts() + unit.part;
                if unit.tokens.len() == 1 {
                    let row = row_of(unit.tokens.start);
                    // SAFETY: this token's row for the unit's head and part
                    // belongs to this unit alone.
                    let (o, l) = unsafe {
                        (
                            partial_out.rows_mut(row..row + 1),
                            log_sums_out.rows_mut(row..row + 1),
                        )
                    };
                    kern.attend(&a, &mut scratch, o, Some(l));
                    continue;
                }
                result.resize(unit_queries.len(), 0.0);
                unit_log_sums.resize(unit.tokens.len() * group, 0.0);
                kern.attend(&a, &mut scratch, &mut result, Some(&mut unit_log_sums));
                let per_token = result
                    .chunks_exact(group * hd)
                    .zip(unit_log_sums.chunks_exact(group));
                for (i, (o, l)) in unit.tokens.clone().zip(per_token) {
                    let row = row_of(i);
                    // SAFETY: as above, for each of the unit's tokens.
                    unsafe {
                        partial_out.rows_mut(row..row + 1).copy_from_slice(o);
                        log_sums_out.rows_mut(row..row + 1).copy_from_slice(l);
                    }
                }
            }
        });
        for (i, (s, token_out)) in splits.iter().zip(out.chunks_exact_mut(q_dim)).enumerate() {
            let (r0, r1) = (first_row[i], first_row[i + 1]);
            let heads = partial[r0 * group * hd..r1 * group * hd]
                .chunks_exact(s.parts() * group * hd)
                .zip(log_sums[r0 * group..r1 * group].chunks_exact(s.parts() * group))
                .zip(token_out.chunks_exact_mut(group * hd));
            for ((head_parts, head_sums), head_out) in heads {
                let part_out: Vec<&[f32]> = head_parts.chunks_exact(group * hd).collect();
                let part_sums: Vec<&[f32]> = head_sums.chunks_exact(group).collect();
                merge_key_parts(&part_out, &part_sums, hd, head_out);
            }
        }
    }

    /// GeGLU of `n` token rows, split over the pool when there are several.
    fn geglu(&self, gate: &[f32], up: &[f32], act: &mut [f32], n: usize) {
        let kern = &*self.kernels;
        if n == 1 {
            return kern.geglu(gate, up, act);
        }
        let width = act.len() / n;
        let out = SharedOut::new(act, width);
        let threads = self.pool.threads();
        self.pool.run(|tid| {
            let (t0, t1) = split_range(n, threads, tid, 1);
            let rows = t0 * width..t1 * width;
            // SAFETY: token rows t0..t1 belong to this thread alone.
            let part = unsafe { out.rows_mut(t0..t1) };
            kern.geglu(&gate[rows.clone()], &up[rows], part);
        });
    }

    /// x += post_norm(delta), row by row.
    fn residual_add(&self, x: &mut [f32], delta: &mut [f32], post_norm: Option<&[f32]>) {
        if let Some(nw) = post_norm {
            self.kernels
                .rms_norm_in_place(delta, nw, self.config.rms_eps);
        }
        for (a, b) in x.iter_mut().zip(delta.iter()) {
            *a += b;
        }
    }

    /// Logits of each row; the first `exact` as decode computes them.
    fn logits_of(&self, normed_rows: &[f32], exact: usize) -> Vec<f32> {
        let c = &self.config;
        let n = normed_rows.len() / c.hidden * c.vocab_size;
        // Every value is written by the LM head's product, so a recycled
        // buffer's old values need no zeroing; only growth is zeroed.
        let mut logits =
            std::mem::take(&mut *self.spare_logits.lock().unwrap_or_else(|e| e.into_inner()));
        logits.truncate(n);
        logits.resize(n, 0.0);
        self.matmul(&self.weights.embedding, normed_rows, &mut logits, exact);
        if let Some(cap) = c.final_softcap {
            for l in &mut logits {
                *l = ops::softcap(*l, cap);
            }
        }
        logits
    }
}

impl FastEngine {
    /// Independent sequences (KV caches) the engine holds.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Holds `count` sequences (at least 1), each with room for the
    /// engine's context; sequences added start empty, sequences beyond
    /// `count` are dropped.
    pub fn set_sequences(&mut self, count: usize) -> Result<()> {
        let capacity = self.seqs[0].capacity;
        self.seqs.truncate(count.max(1));
        while self.seqs.len() < count {
            self.seqs.push(FlatKv::new(&self.config, capacity)?);
        }
        Ok(())
    }

    /// Tokens sequence `seq` has cached.
    pub fn sequence_len(&self, seq: usize) -> usize {
        self.seqs[seq].len
    }

    /// Forgets sequence `seq`'s cached tokens from `len` on (exact: the
    /// cache keeps every position).
    pub fn truncate_sequence(&mut self, seq: usize, len: usize) {
        let kv = &mut self.seqs[seq];
        kv.len = kv.len.min(len);
    }

    /// Makes sequence `to` hold sequence `from`'s first `len` cached
    /// positions, copied, and nothing after: for a sequence about to read
    /// a prompt another one has read already. Positions computed the same
    /// way hold the same bits, so this is what feeding them would give
    /// wherever `forward_batch` would compute them alike (see its notes).
    pub fn copy_prefix(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
        let count = self.seqs.len();
        if from >= count || to >= count || from == to {
            bail!("cannot copy sequence {from} into {to} (the engine holds {count})");
        }
        if len > self.seqs[from].len {
            bail!(
                "sequence {from} holds {} positions, not {len}",
                self.seqs[from].len
            );
        }
        let (source, target) = if from < to {
            let (head, tail) = self.seqs.split_at_mut(to);
            (&head[from], &mut tail[0])
        } else {
            let (head, tail) = self.seqs.split_at_mut(from);
            (&tail[0], &mut head[to])
        };
        target.copy_prefix_from(source, len);
        Ok(())
    }

    /// The final hidden states (after the final norm, the LM head's input)
    /// of entry `entry` of the last [`FastEngine::forward_batch`]: one row
    /// of `hidden` values per token it fed, whether or not logits were
    /// wanted; empty for an entry that step did not have.
    pub fn last_hidden(&self, entry: usize) -> &[f32] {
        let hidden = self.config.hidden;
        self.last_hidden_rows.get(entry).map_or(&[][..], |rows| {
            &self.last_hidden[rows.start * hidden..rows.end * hidden]
        })
    }

    /// One forward step over several sequences' tokens: each weight is read
    /// once for all of them. A sequence's run of at most
    /// [`EXACT_STEP_MAX_TOKENS`] is computed exactly as one-token steps
    /// would; longer runs in bulk, by the GEMMs (callers bound them, e.g. to
    /// a prefill chunk). Returns each entry's logits (empty where none were
    /// wanted), in the order of `batch`.
    pub fn forward_batch(&mut self, batch: &[SeqTokens]) -> Result<Vec<Vec<f32>>> {
        Ok(self.forward_batch_logits(batch)?.into_entries())
    }

    /// Takes back a step's logits once they are read: the next step writes
    /// its logits over the same memory.
    /// A buffer of more rows than a decode step's
    /// ([`EXACT_STEP_MAX_TOKENS`], e.g. a scored prompt's) is dropped
    /// rather than kept for the life of the process.
    pub fn recycle_logits(&self, logits: StepLogits) {
        self.keep_logits_buffer(logits.into_buffer());
    }

    /// Keeps `buffer` for the next step's logits, unless it is larger
    /// than a decode step's (see [`FastEngine::recycle_logits`]).
    fn keep_logits_buffer(&self, buffer: Vec<f32>) {
        if buffer.capacity() <= EXACT_STEP_MAX_TOKENS * self.config.vocab_size {
            *self.spare_logits.lock().unwrap_or_else(|e| e.into_inner()) = buffer;
        }
    }

    /// [`FastEngine::forward_batch`], with the entries' logits left in one
    /// buffer ([`StepLogits`]).
    pub fn forward_batch_logits(&mut self, batch: &[SeqTokens]) -> Result<StepLogits> {
        for (i, entry) in batch.iter().enumerate() {
            if entry.seq >= self.seqs.len() {
                bail!(
                    "sequence {} does not exist (the engine holds {})",
                    entry.seq,
                    self.seqs.len()
                );
            }
            if batch[..i].iter().any(|e| e.seq == entry.seq) {
                bail!("sequence {} appears twice in one step", entry.seq);
            }
            let kv = &self.seqs[entry.seq];
            if kv.len + entry.tokens.len() > kv.capacity {
                bail!(
                    "context full: {} cached + {} new tokens exceed the context size {} (raise -c)",
                    kv.len,
                    entry.tokens.len(),
                    kv.capacity
                );
            }
        }
        self.last_hidden_rows.clear();
        let is_exact = |e: &SeqTokens| e.tokens.len() <= EXACT_STEP_MAX_TOKENS;
        // Exact runs first: the products take them as the leading rows.
        let order: Vec<usize> = (0..batch.len())
            .filter(|&i| is_exact(&batch[i]))
            .chain((0..batch.len()).filter(|&i| !is_exact(&batch[i])))
            .filter(|&i| !batch[i].tokens.is_empty())
            .collect();
        let mut tokens = Vec::new();
        let mut parts = Vec::with_capacity(order.len());
        for &i in &order {
            let e = &batch[i];
            tokens.extend_from_slice(e.tokens);
            parts.push(Part {
                seq: e.seq,
                start: self.seqs[e.seq].len,
                n: e.tokens.len(),
                exact: is_exact(e),
            });
        }
        if tokens.is_empty() {
            let none = vec![Vec::new(); batch.len()];
            return Ok(StepLogits::new(Vec::new(), 0, &none));
        }
        let normed = self.forward_parts(&parts, &tokens)?;

        // The rows whose logits are wanted: every exact one and the last
        // row of a bulk run first (computed exactly), then the bulk runs'
        // other rows. `wanted_rows[i]` lists entry i's rows in `picked`.
        let hidden = self.config.hidden;
        let mut first_row = vec![0; batch.len()];
        let mut row = 0;
        for &i in &order {
            first_row[i] = row;
            row += batch[i].tokens.len();
        }
        let mut picked: Vec<usize> = Vec::new();
        let mut wanted_rows: Vec<Vec<usize>> = vec![Vec::new(); batch.len()];
        for bulk_rows in [false, true] {
            for &i in &order {
                let (e, r0) = (&batch[i], first_row[i]);
                let n = e.tokens.len();
                let rows = match (e.wanted, bulk_rows, is_exact(e)) {
                    (None, ..) => 0..0,
                    (Some(LogitsWanted::Last), false, _) => n - 1..n,
                    (Some(LogitsWanted::All), false, true) => 0..n,
                    (Some(LogitsWanted::All), false, false) => n - 1..n,
                    (Some(LogitsWanted::All), true, false) => 0..n - 1,
                    (_, true, _) => 0..0,
                };
                for r in rows {
                    wanted_rows[i].push(picked.len());
                    picked.push(r0 + r);
                }
            }
        }
        let exact_rows = picked.len()
            - batch
                .iter()
                .filter(|e| e.wanted == Some(LogitsWanted::All) && !is_exact(e))
                .map(|e| e.tokens.len() - 1)
                .sum::<usize>();
        let mut rows = Vec::with_capacity(picked.len() * hidden);
        for &r in &picked {
            rows.extend_from_slice(&normed[r * hidden..(r + 1) * hidden]);
        }
        let vocab = self.config.vocab_size;
        let logits = self.logits_of(&rows, exact_rows);
        self.last_hidden_rows = (0..batch.len())
            .map(|i| first_row[i]..first_row[i] + batch[i].tokens.len())
            .collect();
        self.last_hidden = normed;
        // Each entry's rows in its own order (a bulk run's last row was
        // computed before its other rows).
        for rows in &mut wanted_rows {
            rows.sort_by_key(|&p| picked[p]);
        }
        Ok(StepLogits::new(logits, vocab, &wanted_rows))
    }
}

impl Engine for FastEngine {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn position(&self) -> usize {
        self.seqs[0].len
    }

    fn capacity(&self) -> usize {
        self.seqs[0].capacity
    }

    fn truncate(&mut self, len: usize) {
        self.truncate_sequence(0, len);
    }

    fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        let kv = &self.seqs[0];
        if kv.len + tokens.len() > kv.capacity {
            bail!(
                "context full: {} cached + {} new tokens exceed the context size {} (raise -c)",
                kv.len,
                tokens.len(),
                kv.capacity
            );
        }
        // A short run is one exact step; a prompt goes in prefill chunks.
        let chunk = if tokens.len() <= EXACT_STEP_MAX_TOKENS {
            tokens.len().max(1)
        } else {
            self.blocking.prefill_chunk
        };
        let chunks: Vec<&[u32]> = tokens.chunks(chunk).collect();
        let mut logits = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let wanted = match wanted {
                LogitsWanted::All => Some(LogitsWanted::All),
                LogitsWanted::Last => last.then_some(LogitsWanted::Last),
            };
            let step = [SeqTokens {
                seq: 0,
                tokens: chunk,
                wanted,
            }];
            let out = self.forward_batch(&step)?.pop().unwrap_or_default();
            // A single step's logits as they are; a prompt's chunks appended.
            if logits.is_empty() {
                logits = out;
            } else {
                logits.extend_from_slice(&out);
            }
        }
        Ok(logits)
    }

    /// Without it a verify step of 8 tokens wrote its 8 MiB of logits into
    /// a fresh buffer, zeroed first, every time. `bench --m-curve` (Intel
    /// Xeon, 3 alternating runs), a step over 8 tokens against a one-token
    /// step: 1.57-1.69x with a fresh buffer, 1.49-1.57x with the buffer
    /// reused; over 16 tokens 2.76-2.99x against 2.49-2.66x.
    fn reuse_logits(&self, logits: Vec<f32>) {
        self.keep_logits_buffer(logits);
    }

    fn final_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        // The runs `forward` would make, without logits.
        let chunk = if tokens.len() <= EXACT_STEP_MAX_TOKENS {
            tokens.len().max(1)
        } else {
            self.blocking.prefill_chunk
        };
        let mut rows = Vec::with_capacity(tokens.len() * self.config.hidden);
        for chunk in tokens.chunks(chunk) {
            self.forward_batch(&[SeqTokens {
                seq: 0,
                tokens: chunk,
                wanted: None,
            }])?;
            rows.extend_from_slice(self.last_hidden(0));
        }
        Ok(rows)
    }
}
