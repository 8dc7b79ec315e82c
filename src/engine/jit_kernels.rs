//! The fast engine's matrix kernels from the JIT: plan for the model's
//! shapes on this CPU, emit, verify, map, then dispatch each product to the
//! GEMV (one token) or GEMM (a prefill chunk) generated for its K.

use super::fast::WeightFormats;
use super::kernels::{GroupAttention, MatKernels, MatrixKernels, PortableKernels, SharedOut};
use super::packed::{PackedMatrix, WeightFormat};
use super::q8_input::Q8Input;
use super::wide_input::WideInput;
use super::{attn_scores, decode_wsum, ops};
use crate::jit::backend::{Backend, select_backend};
use crate::jit::blocking::Blocking;
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::dims::ModelDims;
use crate::jit::emit::gemm_quant::{ScaleSpan, TOKENS as TILE_TOKENS};
use crate::jit::emit::gemm_wide::GemmWideParams;
use crate::jit::emit::gemv::WeightType;
use crate::jit::kernels::{
    AttnScores, AttnWsum, Geglu, Gemm, GemmQuant, GemmWide, Gemv, GemvQuant, KernelId, KernelSet,
    RmsNorm, Softmax, UnpackQuant,
};
use crate::jit::plan::{Plan, PlanOptions};
use crate::model::config::ModelConfig;
use crate::model::quant_blocks::{self, QuantType};
use anyhow::{Result, bail};
use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
use std::ops::Range;

/// A cache line of a thread's panel buffer (the kernels read it aligned).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line {
    _bytes: [u8; 64],
}

/// Each thread's buffer for a panel of Q5_0 or Q4_0 rows unpacked into
/// 16-row blocks: grown to the largest panel once, then reused by every
/// product (pool threads live as long as the engine).
#[derive(Default)]
struct PanelBuffer(Vec<Line>);

impl PanelBuffer {
    /// The first `len` bytes, grown if needed (contents undefined).
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        let lines = len.div_ceil(64);
        if self.0.len() < lines {
            self.0.resize(lines, Line { _bytes: [0; 64] });
        }
        // SAFETY: `lines` initialized 64-byte lines hold at least `len`
        // bytes, borrowed mutably through `self` for as long as the slice.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) }
    }
}

thread_local! {
    static PANEL: std::cell::RefCell<PanelBuffer> = std::cell::RefCell::new(PanelBuffer::default());
}

/// The 16-bit kernels' weight type; Q8_0 matrices have kernels of their own.
fn weight_type(f: WeightFormat) -> WeightType {
    match f {
        WeightFormat::BF16 => WeightType::Bf16,
        _ => WeightType::F16,
    }
}

/// The plan options for a model whose matrices have `formats`: the one
/// place the engine and `pulsar dump`/`tune` get them from, so the plan
/// shown is the plan run.
pub fn plan_options(config: &ModelConfig, formats: &WeightFormats, threads: usize) -> PlanOptions {
    PlanOptions {
        threads,
        weights: weight_type(formats.wide),
        quantized: formats.quantized(config),
        wide_tensors: Some(formats.wide_tensors(config)),
        matrices: if config.layer_shapes.is_empty() && config.features == Default::default() {
            Vec::new()
        } else {
            let mut mats: Vec<(&'static str, usize, usize)> = Vec::new();
            for (role, [rows, k]) in crate::model::weights::model_matrices(config) {
                let m = (crate::model::weights::matrix_name(role), rows, k);
                if !mats.contains(&m) {
                    mats.push(m);
                }
            }
            mats
        },
        max_isa: max_isa_from_env(),
        ..PlanOptions::default()
    }
}

/// Whether the plan for `config` with `formats` fits the JIT's code
/// budget on this CPU (true where the JIT does not run: nothing to fit).
pub fn kernels_fit(config: &ModelConfig, formats: &WeightFormats) -> bool {
    let caps = CpuCaps::detect();
    let opts = plan_options(config, formats, 1);
    if caps.effective_isa(opts.max_isa).is_none() {
        return true;
    }
    crate::jit::plan::plan(&ModelDims::from(config), &caps, &opts).is_ok()
}

/// `PULSAR_MAX_ISA=avx2` keeps every command's kernels to AVX2 (the
/// integer GEMMs without VNNI, say), as `tune`/`dump --max-isa` do for a
/// listing: to compare the two on one machine, or to step around a
/// kernel. Unset: whatever the CPU has.
fn max_isa_from_env() -> Isa {
    const VAR: &str = "PULSAR_MAX_ISA";
    let default = PlanOptions::default().max_isa;
    match std::env::var(VAR) {
        Err(std::env::VarError::NotPresent) => default,
        Ok(value) => value.parse().unwrap_or_else(|e| {
            eprintln!("pulsar: {VAR}: {e}; using {}", default.name());
            default
        }),
        Err(e) => {
            eprintln!("pulsar: {VAR}: {e}; using {}", default.name());
            default
        }
    }
}

/// The layouts quantized matrices take for this CPU's kernels (and
/// `PULSAR_MAX_ISA`), see `jit::plan::QuantLayouts`. Whether K-quants keep
/// kernels of their own is the CPU's choice here; the format decision
/// (`engine::formats`) applies `PULSAR_K_QUANTS` on top.
pub fn quant_layouts() -> crate::jit::plan::QuantLayouts {
    crate::jit::plan::QuantLayouts::for_cpu(&CpuCaps::detect(), max_isa_from_env())
}

pub struct JitKernels {
    set: KernelSet,
    /// What the kernels use, for reports (`name`).
    description: String,
    ops: OpKernels,
    blocking: Blocking,
}

/// The kernels of the operations other than matrix products, resolved
/// once for the model's dimensions. `None` where the plan left an
/// operation to plain Rust (optional kernels it dropped to stay within its
/// code budget, which its notes say).
struct OpKernels {
    /// RMSNorm over the hidden width and, with q/k norms, over a head.
    norms: Vec<(usize, KernelId)>,
    /// GeGLU over the feed-forward width.
    geglu: Option<(usize, KernelId)>,
    /// Attention's kernels for each head dimension the plan has all it
    /// needs for (a head size without them runs the portable code).
    attention: Vec<AttentionKernels>,
}

/// The softmax and what computes the scores and the weighted sums of more
/// than a token's query heads. The softmax is the JIT's unless the plan
/// dropped it for its code budget (Gemma 4 E2B's plan is its three GEMM
/// families and norms): then the Rust one, so the products stay on
/// AVX-512 rather than the whole head falling back to the portable loop
/// (which took 14% of E2B's 512-token prefill).
#[derive(Clone, Copy)]
struct AttentionKernels {
    head_dim: usize,
    softmax: Option<KernelId>,
    products: AttentionProducts,
}

#[derive(Clone, Copy)]
enum AttentionProducts {
    /// The JIT's ymm kernels.
    Jit { scores: KernelId, wsum: KernelId },
    /// `attn_scores::scores_ymm` and `decode_wsum::weighted_sum_by_rows`,
    /// where an AVX2 plan left the JIT's out of its code budget.
    Ymm,
    /// `attn_scores` and `decode_wsum::weighted_sum_tiled` on zmm, as the
    /// plan decided (`Plan::avx512_attention`).
    Avx512,
}

impl OpKernels {
    fn resolve(set: &KernelSet, config: &ModelConfig, avx512_attention: bool) -> Result<OpKernels> {
        let mut dims = vec![config.hidden];
        if config.has_qk_norm() && config.head_dim != config.hidden {
            dims.push(config.head_dim);
        }
        let mut norms = Vec::new();
        for dim in dims {
            match set.resolve::<RmsNorm>(dim) {
                Some(id) => norms.push((dim, id)),
                None => bail!("the kernel plan has no RMSNorm for {dim} values"),
            }
        }
        // Another head size of a model whose layers differ (Gemma 4's
        // global layers): its norm if the plan has one, else the portable.
        for i in 0..config.n_layers() {
            let hd = config.shape(i).head_dim;
            if config.has_qk_norm()
                && !norms.iter().any(|&(d, _)| d == hd)
                && let Some(id) = set.resolve::<RmsNorm>(hd)
            {
                norms.push((hd, id));
            }
        }
        let width = config.intermediate;
        let geglu = set.resolve::<Geglu>(width).map(|id| (width, id));
        let mut head_dims: Vec<usize> = (0..config.n_layers())
            .map(|i| config.shape(i).head_dim)
            .collect();
        head_dims.sort_unstable();
        head_dims.dedup();
        // The plan's softmax, if its budget kept one (any head size).
        let softmax = set.resolve::<Softmax>(());
        let mut attention = Vec::new();
        for hd in head_dims {
            let products = if avx512_attention {
                if !(attn_scores::available(hd) && decode_wsum::tiled_available(hd)) {
                    if hd == config.head_dim {
                        bail!(
                            "the kernel plan leaves attention to AVX-512 code, which this CPU or head size ({hd}) does not run"
                        );
                    }
                    continue;
                }
                Some(AttentionProducts::Avx512)
            } else {
                match (
                    set.resolve::<AttnScores>(hd),
                    set.resolve::<AttnWsum>(hd),
                    softmax,
                ) {
                    (Some(scores), Some(wsum), Some(_)) => {
                        Some(AttentionProducts::Jit { scores, wsum })
                    }
                    _ if attn_scores::ymm_available(hd) => Some(AttentionProducts::Ymm),
                    _ => None,
                }
            };
            if let Some(products) = products {
                attention.push(AttentionKernels {
                    head_dim: hd,
                    softmax,
                    products,
                });
            }
        }
        Ok(OpKernels {
            norms,
            geglu,
            attention,
        })
    }

    /// The RMSNorm kernel for `dim` values, if the plan has one.
    fn norm<'a>(&self, set: &'a KernelSet, dim: usize) -> Option<RmsNorm<'a>> {
        let &(_, id) = self.norms.iter().find(|(d, _)| *d == dim)?;
        Some(set.bind(id, dim))
    }
}

impl JitKernels {
    /// Plans, emits and verifies the kernels for `config` with `format`
    /// weights on this CPU. `Ok(None)` with the reason printed when the CPU
    /// lacks AVX2, F16C or FMA (the caller then runs the reference engine);
    /// an error when planning or verification fails, which must stop the
    /// program rather than run unverified code.
    pub fn for_this_cpu(
        config: &ModelConfig,
        formats: WeightFormats,
        threads: usize,
    ) -> Result<Option<JitKernels>> {
        Self::with_options(config, plan_options(config, &formats, threads))
    }

    /// The kernels for explicit plan options (launch tuning tries several
    /// prefetch distances).
    pub fn with_options(config: &ModelConfig, opts: PlanOptions) -> Result<Option<JitKernels>> {
        match select_backend(&ModelDims::from(config), &CpuCaps::detect(), &opts)? {
            Backend::Jit { plan, kernels } => Ok(Some(Self::assemble(config, &plan, kernels)?)),
            Backend::Reference { reason } => {
                eprintln!("pulsar: {reason}");
                Ok(None)
            }
        }
    }

    /// Emits, verifies and maps the kernels of `plan`, made for `config`
    /// on this CPU with kernels up to `max_isa`: the plan is complete
    /// before any code is generated (see `engine::fast::open`).
    pub fn from_plan(config: &ModelConfig, plan: &Plan, max_isa: Isa) -> Result<JitKernels> {
        let kernels = KernelSet::build(plan, &CpuCaps::detect(), max_isa)?;
        Self::assemble(config, plan, kernels)
    }

    /// The engine's view of a plan's verified kernels.
    fn assemble(config: &ModelConfig, plan: &Plan, kernels: KernelSet) -> Result<JitKernels> {
        Ok(JitKernels {
            ops: OpKernels::resolve(&kernels, config, plan.avx512_attention)?,
            set: kernels,
            // What the kernels use, as a report names it: AVX2, plus the
            // AVX-512 forms of the integer and 16-bit GEMMs and of the
            // 16-bit GEMV where planned.
            description: {
                use crate::jit::emit::gemv::GemvParams;
                use crate::jit::plan::KernelKind;
                let zmm_gemv = |k: &crate::jit::plan::KernelSpec| {
                    matches!(k.kind, KernelKind::Gemv(GemvParams { zmm: true, .. }))
                };
                let wide = |k: &crate::jit::plan::KernelSpec| {
                    matches!(k.kind, KernelKind::GemmWide(_)) || zmm_gemv(k)
                };
                let mut text = "jit avx2".to_string();
                if plan
                    .kernels
                    .iter()
                    .any(|k| k.isa == Isa::Avx512 && !wide(k))
                {
                    text += " + avx512-vnni";
                }
                if let Some(k) = plan
                    .kernels
                    .iter()
                    .find(|k| matches!(k.kind, KernelKind::GemmWide(_)))
                {
                    text += &format!(" + avx512 {}", k.name);
                }
                if plan.kernels.iter().any(zmm_gemv) {
                    text += " + avx512 16-bit GEMV";
                }
                text
            },
            blocking: plan.blocking.clone(),
        })
    }

    /// Like [`JitKernels::for_this_cpu`], but a CPU without the JIT's
    /// baseline is an error too (benchmarks and tests need the JIT).
    pub fn build(
        config: &ModelConfig,
        formats: WeightFormats,
        threads: usize,
    ) -> Result<JitKernels> {
        match Self::for_this_cpu(config, formats, threads)? {
            Some(k) => Ok(k),
            None => bail!("this CPU cannot run the JIT kernels (AVX2, F16C and FMA are needed)"),
        }
    }
}

/// The GEMM resolved for `w` at load.
fn tokens_kernel(w: &PackedMatrix) -> KernelId {
    w.kernels()
        .tokens
        .expect("the engine resolves every matrix's kernels at load")
}

/// The GEMV resolved for `w` at load.
fn one_token_kernel(w: &PackedMatrix) -> KernelId {
    w.kernels()
        .one_token
        .expect("the engine resolves every matrix's kernels at load")
}

impl MatKernels for JitKernels {
    unsafe fn gemm(&self, w: &PackedMatrix, x: &[f32], rows: Range<usize>, y: SharedOut) {
        assert!(
            w.format.is_16bit(),
            "quantized weights are multiplied by gemm_q8 (the engine quantizes their input)"
        );
        let key = (weight_type(w.format), w.cols);
        let tokens = x.len() / w.cols;
        if tokens == 1 {
            let k: Gemv = self.set.bind(one_token_kernel(w), key);
            // SAFETY: the caller owns columns `rows` of y.
            let part = unsafe { y.cells(0, rows.clone()) };
            k.run_part(w.data(), x, part, rows)
                .expect("GEMV arguments sized by the engine");
        } else if let Some(params) = self.tiled_gemm(w) {
            // Callers other than the driver's (which lays tiles out once for
            // every thread) get their tiles here.
            let tiles = WideInput::new(x, w.cols, &params);
            // SAFETY: as the caller guarantees for this call.
            unsafe { self.gemm_tiles(w, &tiles, rows, y) };
        } else {
            let k: Gemm = self.set.bind(tokens_kernel(w), key);
            assert!(rows.end <= w.rows && rows.end <= y.stride && y.rows() >= tokens);
            // SAFETY: W has rows < rows.end of K values, x holds tokens·K,
            // y holds tokens rows of `stride` (asserted), and the caller
            // owns columns `rows` of y.
            unsafe {
                k.run_unchecked(
                    w.data().as_ptr(),
                    x.as_ptr(),
                    tokens,
                    y.as_mut_ptr(),
                    y.stride,
                    rows,
                )
            };
        }
    }

    fn tiled_gemm(&self, w: &PackedMatrix) -> Option<GemmWideParams> {
        let id = w.kernels().tokens?;
        match self.set.kind(id) {
            crate::jit::plan::KernelKind::GemmWide(p) if w.format.is_16bit() => Some(*p),
            _ => None,
        }
    }

    unsafe fn gemm_tiles(&self, w: &PackedMatrix, x: &WideInput, rows: Range<usize>, y: SharedOut) {
        let key = (weight_type(w.format), w.cols);
        let k: GemmWide = self.set.bind(tokens_kernel(w), key);
        let tokens = x.tokens();
        assert!(
            x.k() == w.cols
                && x.bytes().len() >= k.input_bytes(tokens)
                && rows.end <= w.rows
                && rows.end <= y.stride
                && y.rows() >= tokens
                && rows.start.is_multiple_of(k.params.rows())
        );
        // Every token tile passes over a panel of rows while it stays in
        // L2 (the plan's `widened_panel_bytes`, as the integer GEMM's).
        let row_bytes = crate::model::row_blocks::padded_cols(w.cols) * 2;
        let panel_rows = self.blocking.widened_panel_bytes / row_bytes;
        // SAFETY: W has the row blocks of rows < rows.end, the tiles hold
        // `tokens` tokens of K, y holds tokens rows of `stride` (asserted),
        // and the caller owns columns `rows` of y.
        unsafe {
            k.run_unchecked(
                w.data().as_ptr(),
                x.bytes().as_ptr(),
                tokens,
                y.as_mut_ptr(),
                y.stride,
                rows,
                panel_rows,
            )
        };
    }

    unsafe fn gemm_q8(&self, w: &PackedMatrix, x: &Q8Input, rows: Range<usize>, y: SharedOut) {
        let q = w
            .format
            .quant()
            .expect("an integer product needs quantized weights");
        // One token: the GEMV, where the type has one (Q8_0x16's GEMM takes
        // single tokens itself).
        if x.tokens() == 1 && !q.rows_are_lanes() {
            let k: GemvQuant = self.set.bind(one_token_kernel(w), (q, w.cols));
            // SAFETY: the caller owns columns `rows` of y.
            let part = unsafe { y.cells(0, rows.clone()) };
            k.run_part(w.raw(), x.token(0), part, rows)
                .expect("quantized GEMV arguments sized by the engine");
            return;
        }
        let unpack: Option<UnpackQuant> =
            w.kernels().unpack.map(|id| self.set.bind(id, (q, w.cols)));
        assert_eq!(
            unpack.is_some(),
            !q.is_q8_0() && !q.rows_are_lanes(),
            "unpacking resolved at load"
        );
        let gemm_q = unpack.map_or(q, |u| u.into);
        let k: GemmQuant = self.set.bind(tokens_kernel(w), (gemm_q, w.cols));
        // A kernel that sums a super-block's groups in integers reads one
        // input scale per super-block: any other input would be misread.
        assert_eq!(
            x.span(),
            k.input_span,
            "{}: input quantized for another kernel",
            k.name
        );
        assert!(rows.end <= w.rows && rows.end <= y.stride && y.rows() >= x.tokens());
        assert!(
            rows.start
                .is_multiple_of(crate::jit::emit::gemm_quant::ROWS)
        );
        // Every tile passes over a panel of rows while it stays in L2 (the
        // plan's `widened_panel_bytes`, at Q8_0's bytes per row), so the rows are
        // read from memory once, and unpacked once. A single tile read
        // straight from the matrix takes all the rows in one call: one
        // stream the prefetchers follow.
        let q8_row_bytes = QuantType::Q8_0.file_block_bytes() * (w.cols / quant_blocks::GROUP_COLS);
        let panel_rows = if x.tile_count() == 1 && unpack.is_none() {
            rows.len().max(1)
        } else {
            self.blocking
                .rows_within(self.blocking.widened_panel_bytes, q8_row_bytes)
        };
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = rows.end.min(r0 + panel_rows);
            let run_tiles = |panel: &[u8], first_row: usize| {
                for i in 0..x.tile_count() {
                    let (tile, ntok) = x.tile_for(i, k.single_token_layout);
                    // SAFETY: `panel` holds the 16-row blocks of rows
                    // first_row..r1 - r0 + first_row (the whole matrix's, or
                    // the unpacked panel's), the tile is whole, y holds every
                    // token's row of `stride` (asserted), and the caller
                    // owns columns r0..r1 of them: the kernel writes rows
                    // first_row.. from y + r0 - first_row.
                    unsafe {
                        k.run_unchecked(
                            panel.as_ptr(),
                            tile.as_ptr(),
                            ntok,
                            y.as_mut_ptr()
                                .add(i * TILE_TOKENS * y.stride + r0 - first_row),
                            y.stride,
                            first_row..first_row + (r1 - r0),
                        )
                    };
                }
            };
            match unpack {
                None => run_tiles(w.raw(), r0),
                Some(unpack) => PANEL.with_borrow_mut(|panel| {
                    let bytes = unpack.out_bytes(r0..r1);
                    let out = panel.bytes(bytes);
                    unpack
                        .run(w.raw(), r0..r1, out)
                        .expect("a panel of the matrix's rows");
                    run_tiles(out, 0);
                }),
            }
            r0 = r1;
        }
    }

    fn resolve(&self, w: &PackedMatrix) -> Result<MatrixKernels, String> {
        // Quantized weights: the integer GEMV for one token, Q8_0's integer
        // GEMM for several (Q5_0 and Q4_0 unpacked to Q8_0 first).
        let unpack = match w.format.quant() {
            Some(q) if !q.is_q8_0() && !q.rows_are_lanes() => {
                let Some(id) = self.set.resolve::<UnpackQuant>((q, w.cols)) else {
                    return Err(format!("no unpacking of {} at K {}", q.name(), w.cols));
                };
                Some(id)
            }
            _ => None,
        };
        let (one_token, tokens, input_span) = match w.format.quant() {
            Some(q) => {
                // The GEMM for the bytes the unpacking makes, and the
                // input it reads.
                let gemm_q =
                    unpack.map_or(q, |id| self.set.bind::<UnpackQuant>(id, (q, w.cols)).into);
                let gemm = self.set.resolve::<GemmQuant>((gemm_q, w.cols));
                let span = gemm.map_or(ScaleSpan::Group, |id| {
                    self.set.bind::<GemmQuant>(id, (gemm_q, w.cols)).input_span
                });
                if q.rows_are_lanes() {
                    // Its GEMM takes single tokens too.
                    (gemm, gemm, span)
                } else {
                    (self.set.resolve::<GemvQuant>((q, w.cols)), gemm, span)
                }
            }
            None => {
                let key = (weight_type(w.format), w.cols);
                let gemm = self
                    .set
                    .resolve::<GemmWide>(key)
                    .or_else(|| self.set.resolve::<Gemm>(key));
                (self.set.resolve::<Gemv>(key), gemm, ScaleSpan::Group)
            }
        };
        match (one_token, tokens) {
            (Some(_), Some(_)) => Ok(MatrixKernels {
                one_token,
                tokens,
                unpack,
                input_span,
            }),
            (None, _) => Err(format!("no GEMV for {} at K {}", w.format.name(), w.cols)),
            (_, None) => Err(format!("no GEMM for {} at K {}", w.format.name(), w.cols)),
        }
    }

    fn resolve_one_token(&self, w: &PackedMatrix) -> Result<MatrixKernels, String> {
        if !w.format.is_16bit() {
            return self.resolve(w);
        }
        match self.set.resolve::<Gemv>((weight_type(w.format), w.cols)) {
            Some(one_token) => Ok(MatrixKernels {
                one_token: Some(one_token),
                tokens: None,
                unpack: None,
                input_span: ScaleSpan::Group,
            }),
            None => Err(format!("no GEMV for {} at K {}", w.format.name(), w.cols)),
        }
    }

    fn name(&self) -> String {
        self.description.clone()
    }

    fn blocking(&self) -> Blocking {
        self.blocking.clone()
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], out: &mut [f32], eps: f32) {
        match self.ops.norm(&self.set, w.len()) {
            Some(norm) => norm
                .run(x, w, out, eps)
                .expect("RMSNorm sized by the engine"),
            None => PortableKernels.rms_norm(x, w, out, eps),
        }
    }

    fn rms_norm_in_place(&self, x: &mut [f32], w: &[f32], eps: f32) {
        match self.ops.norm(&self.set, w.len()) {
            Some(norm) => norm
                .run_inplace(x, w, eps)
                .expect("RMSNorm sized by the engine"),
            None => PortableKernels.rms_norm_in_place(x, w, eps),
        }
    }

    fn geglu(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        match self.ops.geglu {
            // Rows of the planned width (a token's or several tokens').
            Some((width, id)) if gate.len().is_multiple_of(width) => self
                .set
                .bind::<Geglu>(id, width)
                .run(gate, up, out)
                .expect("GeGLU sized by the engine"),
            // SAFETY: the JIT's kernels run only where AVX2 and FMA are.
            _ => unsafe { super::geglu_avx2::geglu(gate, up, out) },
        }
    }

    fn softcap(&self, x: &mut [f32], cap: f32) {
        // SAFETY: the JIT's kernels run only where AVX2 and FMA are.
        unsafe { super::softcap_avx2::softcap(x, cap) }
    }

    fn attend(
        &self,
        a: &GroupAttention<'_>,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
        mut log_sums: Option<&mut [f32]>,
    ) {
        let Some(&kernels) = self.ops.attention.iter().find(|k| k.head_dim == a.head_dim) else {
            return PortableKernels.attend(a, scratch, out, log_sums);
        };
        let hd = kernels.head_dim;
        let softmax: Option<Softmax> = kernels.softmax.map(|id| self.set.bind(id, ()));
        // One GEMM for the whole block's scores, then each row masked and
        // normalised, then one pass over V shared by every row.
        let n_keys = a.n_keys();
        // At decode the block's V rows were evicted by the weights streamed
        // since the last token; asking for them now lets them arrive while
        // the scores are computed, instead of one cache-line miss at a time
        // in the weighted sum (measured: attention 25% faster per token).
        for line in a.values.chunks(16) {
            // SAFETY: a prefetch has no architectural effect; the address is
            // inside `values`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
        }
        scratch.resize(a.n_queries() * n_keys, 0.0);
        match kernels.products {
            AttentionProducts::Avx512 => attn_scores::scores(a.keys, a.queries, hd, scratch),
            AttentionProducts::Ymm => attn_scores::scores_ymm(a.keys, a.queries, hd, scratch),
            AttentionProducts::Jit { scores, .. } => self
                .set
                .bind::<AttnScores>(scores, hd)
                .run(a.keys, a.queries, scratch)
                .expect("attention scores sized by the engine"),
        }
        for (i, row) in scratch.chunks_exact_mut(n_keys).enumerate() {
            let log_sum = log_sums.as_deref_mut().map(|l| &mut l[i]);
            match &softmax {
                Some(jit) => a.probabilities(i, row, |p| jit.run(p), log_sum),
                None => a.probabilities(i, row, ops::softmax, log_sum),
            }
        }
        let rows = a.n_queries();
        let out = &mut out[..rows * hd];
        match kernels.products {
            // A decode step's query heads: V read row by row (see
            // `decode_wsum` for why and what it measured).
            _ if rows <= decode_wsum::MAX_QUERIES => {
                decode_wsum::weighted_sum_by_rows(scratch, n_keys, a.values, hd, out)
            }
            AttentionProducts::Ymm => {
                decode_wsum::weighted_sum_by_rows(scratch, n_keys, a.values, hd, out)
            }
            AttentionProducts::Avx512 => {
                decode_wsum::weighted_sum_tiled(scratch, n_keys, a.values, hd, out)
            }
            AttentionProducts::Jit { wsum, .. } => self
                .set
                .bind::<AttnWsum>(wsum, hd)
                .run(scratch, n_keys, a.values, out)
                .expect("attention sum sized by the engine"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jit::plan::KernelKind;

    /// A plan that leaves the softmax to Rust (as Gemma 4 E2B's does, for
    /// its budget) keeps attention's products on AVX-512 where the plan
    /// chose them, and under AVX2 takes the ymm ones in Rust rather than
    /// the portable loop; both compute what the portable code does.
    #[test]
    fn a_plan_without_the_jit_softmax_keeps_vector_attention() {
        let caps = CpuCaps::detect();
        let isas = [Isa::Avx2, Isa::Avx512];
        for isa in isas
            .into_iter()
            .filter(|&i| caps.effective_isa(i) == Some(i))
        {
            attention_without_the_jit_softmax(isa);
        }
    }

    fn attention_without_the_jit_softmax(isa: Isa) {
        let config = crate::model::presets::shape("gemma4-e2b").expect("a known shape");
        let layouts = crate::jit::plan::QuantLayouts::for_cpu(&CpuCaps::detect(), isa);
        let formats = WeightFormats::for_shape(&config, WeightFormat::Q8_0).with_layouts(&layouts);
        let opts = PlanOptions {
            max_isa: isa,
            ..plan_options(&config, &formats, 2)
        };
        let Backend::Jit { mut plan, .. } =
            select_backend(&ModelDims::from(&config), &CpuCaps::detect(), &opts).unwrap()
        else {
            panic!("this CPU plans JIT kernels");
        };
        let keep: Vec<bool> = plan
            .kernels
            .iter()
            .map(|k| !matches!(k.kind, KernelKind::Softmax))
            .collect();
        let mut kept = keep.iter();
        plan.kernels
            .retain(|_| *kept.next().expect("a flag a kernel"));
        let mut kept = keep.iter();
        plan.kernel_bytes
            .retain(|_| *kept.next().expect("a flag a kernel"));
        let kernels = JitKernels::from_plan(&config, &plan, isa).unwrap();
        let hd = config.head_dim;
        let products = kernels
            .ops
            .attention
            .iter()
            .find(|k| k.head_dim == hd)
            .map(|k| k.products);
        let expected = if plan.avx512_attention {
            "AVX-512"
        } else {
            "ymm"
        };
        assert!(
            matches!(
                (products, plan.avx512_attention),
                (Some(AttentionProducts::Avx512), true) | (Some(AttentionProducts::Ymm), false)
            ),
            "{isa:?}, heads of {hd}: the {expected} products are kept without the JIT softmax"
        );

        let mut seed = 7u32;
        let mut rand = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        };
        // 6 tokens of 8 query heads each, at positions 20..26, over keys 0..26.
        let (tokens, heads, keys_n) = (6, 8, 26);
        let queries: Vec<f32> = (0..tokens * heads * hd).map(|_| rand()).collect();
        let keys: Vec<f32> = (0..keys_n * hd).map(|_| rand()).collect();
        let values: Vec<f32> = (0..keys_n * hd).map(|_| rand()).collect();
        let a = GroupAttention {
            queries: &queries,
            head_dim: hd,
            rows_per_token: heads,
            first_query: keys_n - tokens,
            keys: &keys,
            values: &values,
            first_key: 0,
            window: Some(16),
            softcap: None,
        };
        let mut scratch = Vec::new();
        let mut want = vec![0.0; queries.len()];
        PortableKernels.attend(&a, &mut scratch, &mut want, None);
        let mut got = vec![0.0; queries.len()];
        kernels.attend(&a, &mut scratch, &mut got, None);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-5,
            "attention differs from the portable code by {worst}"
        );
    }
}
