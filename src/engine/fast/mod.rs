//! The fast forward pass: 16-bit weights in the kernels' layout, matrix
//! products on the matrix kernels split across the thread pool, prefill as
//! batched GEMMs over chunks of tokens, and logits only where wanted.
//!
//! The math is the reference pass's (same ops, same order of the per-token
//! steps); only the matrix products and their summation order differ.
//!
//! By concern: this module holds the engine, its options and the
//! single-sequence [`Engine`] calls; `open` opens an engine (formats
//! decided once, the kernel plan complete before code is generated, the
//! weights loaded, launch tuning); `forward` runs one step's layers;
//! `matmul` schedules the matrix products over the pool; `attention` holds
//! prefill's and decode's attention; `experts` Gemma 4's mixture of
//! experts; `gemma3n` the per-token work of
//! Gemma 3n's AltUp, sparsity and per-layer inputs; `batch` the calls over
//! several sequences at once.

mod attention;
mod batch;
mod draft;
mod experts;
mod forward;
mod gemma3n;
mod matmul;
mod open;

pub use super::formats::{Conversion, WeightFormats};
pub use draft::{assistant_format, plan_assistant};
pub use open::{DraftSource, EngineOptions, EnginePlan, LaunchTuning, OpenReport, Opened};

use super::kernels::MatKernels;
use super::kv_cache::FlatKv;
use super::packed::{PackedMatrix, WeightFormat};
use super::pool::ThreadPool;
use super::q8_input::InputPrecision;
use super::{Engine, LogitsWanted};
use crate::jit::blocking::{Blocking, ROW_GRANULE};
use crate::model::config::ModelConfig;
use crate::model::source::Role;
use crate::model::weights::{ModelWeights, matrix_name};
use anyhow::{Result, bail};
use forward::Activations;
use std::collections::HashMap;
use std::sync::Mutex;

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
    /// A Gemma 4 assistant to draft with, and what it reads of each
    /// sequence (see `draft`).
    assistant: Option<draft::FastAssistant>,
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
#[derive(Clone, Debug)]
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
    /// measured about 10% slower.
    pub in_place: bool,
}

/// Resolves the kernels of every matrix and keeps them with it; on the
/// first matrix `kernels` cannot multiply, says which and why and changes
/// nothing. A Gemma 4 assistant's matrices (`assistant`) are resolved for
/// single tokens.
fn resolve_kernels(
    kernels: &dyn MatKernels,
    w: &mut ModelWeights<PackedMatrix>,
    assistant: Option<&mut ModelWeights<PackedMatrix>>,
) -> Result<(), String> {
    let mut matrices: Vec<(Role, &mut PackedMatrix, bool)> = w
        .matrices_mut()
        .into_iter()
        .map(|(role, m)| (role, m, false))
        .collect();
    if let Some(a) = assistant {
        matrices.extend(
            a.matrices_mut()
                .into_iter()
                .map(|(role, m)| (role, m, true)),
        );
    }
    let mut resolved = Vec::with_capacity(matrices.len());
    for (role, m, drafting) in &matrices {
        let found = if *drafting {
            kernels.resolve_one_token(m)
        } else {
            kernels.resolve(m)
        };
        match found {
            Ok(k) => resolved.push(k),
            Err(why) => {
                let layer = match role {
                    Role::Layer(i, _) | Role::Expert(i, _, _) => format!(" (layer {i})"),
                    _ => String::new(),
                };
                let whose = if *drafting { "the assistant's " } else { "" };
                return Err(format!(
                    "the {} kernels cannot multiply {whose}{}{layer}: {why}",
                    kernels.name(),
                    matrix_name(*role)
                ));
            }
        }
    }
    for ((_, m, _), k) in matrices.iter_mut().zip(resolved) {
        m.set_kernels(k);
    }
    Ok(())
}

impl FastEngine {
    pub fn new(
        config: ModelConfig,
        mut weights: ModelWeights<PackedMatrix>,
        kernels: Box<dyn MatKernels>,
        opts: &FastOptions,
    ) -> Result<Self> {
        if opts.context == 0 {
            bail!("the context size must be at least 1 token");
        }
        if let Err(why) = resolve_kernels(&*kernels, &mut weights, None) {
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
            assistant: None,
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
        let assistant = self.assistant.as_mut().map(|a| a.weights_mut());
        if let Err(why) = resolve_kernels(&*kernels, &mut self.weights, assistant) {
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

    /// The bytes of the matrices [`FastEngine::bytes_per_token`] counts
    /// (a mixture's experts whole), in the model's order, at most `limit`
    /// of them: for timing a plain read of the weights' own pages.
    pub fn streamed_weights(&self, limit: usize) -> Vec<&[u8]> {
        let mut left = limit;
        let mut out = Vec::new();
        for (_, m) in self.weights.matrices() {
            if left == 0 {
                break;
            }
            let raw = m.raw();
            let take = raw.len().min(left);
            out.push(&raw[..take]);
            left -= take;
        }
        out
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
    /// a fresh buffer, zeroed first, every time: reusing the buffer takes
    /// about 6% off a step over 8 tokens and 10% off one over 16.
    fn reuse_logits(&self, logits: Vec<f32>) {
        self.keep_logits_buffer(logits);
    }

    fn can_draft(&self) -> bool {
        self.assistant.is_some()
    }

    fn draft(&mut self, token: u32, k: usize, logits: Option<&mut Vec<f32>>) -> Result<Vec<u32>> {
        self.draft_sequence(0, token, k, logits)
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
