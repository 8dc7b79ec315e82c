//! The planner: a pure function from (model dims, CPU caps, options) to the
//! list of kernels to generate, with their blocking, unrolling and thread
//! split. Emission is deterministic, so the planner measures candidate sizes
//! by emitting them and trades unrolling against the byte budget.

use super::blocking::{Blocking, Reason};
use super::cpu::{CpuCaps, Isa};
use super::dims::ModelDims;
use super::emit::gemm::{self, GemmParams};
use super::emit::gemm_quant::{self, GemmQuantParams};
use super::emit::gemv::{self, GemvParams, WeightType};
use super::emit::gemv_quant::{self, GemvQuantParams};
use super::emit::unpack_quant::UnpackQuantParams;
use super::emit::{self, LANES};
use crate::model::quant_blocks::{self, QuantType};
use anyhow::{Result, bail};
use std::ops::Range;

/// Bytes ahead the quantized GEMVs prefetch by default, and the integer
/// GEMM always (measured, see `GemvQuantParams::prefetch`).
pub const QUANT_PREFETCH_BYTES: usize = 8 << 10;

/// Bytes ahead the VNNI GEMM's passes over several tokens also prefetch
/// into L2 (see `emit::gemm_q8_0x16`).
pub const GEMM_L2_PREFETCH_BYTES: usize = 32 << 10;

/// Total machine-code bytes allowed for one model's kernels.
pub const BUDGET_BYTES: usize = 5120;

#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub max_isa: Isa,
    /// Worker threads the rows are split across (0 = all cores).
    pub threads: usize,
    pub weights: WeightType,
    /// The matrices kept quantized, by type and K: each type gets an
    /// integer GEMV (one token) and an integer GEMM (several).
    pub quantized: Vec<QuantizedMatrix>,
    /// The tensors stored in the 16-bit format in at least one layer
    /// (`None`: all of them). A K none of them has gets no 16-bit GEMV.
    pub wide_tensors: Option<Vec<&'static str>>,
    /// The model's matrices as (name, rows, K) where its layers differ in
    /// shape (Gemma 4: two head sizes, wider MLPs, per-layer inputs,
    /// experts); empty: the one layer shape of `ModelDims`.
    pub matrices: Vec<(&'static str, usize, usize)>,
    /// Bytes ahead the quantized GEMVs prefetch (see `GemvQuantParams`).
    pub quant_prefetch: usize,
    pub budget: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            max_isa: Isa::Avx512,
            threads: 0,
            weights: WeightType::F16,
            quantized: Vec::new(),
            wide_tensors: None,
            matrices: Vec::new(),
            quant_prefetch: QUANT_PREFETCH_BYTES,
            budget: BUDGET_BYTES,
        }
    }
}

/// A matrix of the model kept quantized (in some or all layers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizedMatrix {
    /// The plan's name for it: "attn_q", "output(lm_head)", ...
    pub tensor: &'static str,
    pub q: QuantType,
    pub k: usize,
}

/// What one kernel computes; dims and strides here become immediates.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KernelKind {
    Gemv(GemvParams),
    /// Integer GEMV over quantized weights and 8-bit inputs.
    GemvQuant(GemvQuantParams),
    /// Integer GEMM over quantized weights in 16-row blocks and tiles of 8
    /// tokens' 8-bit inputs (Q8_0's single tokens too).
    GemmQuant(GemmQuantParams),
    /// Q5_0 or Q4_0 row blocks unpacked into 16-row blocks, for the GEMM.
    UnpackQuant(UnpackQuantParams),
    /// The 16-bit GEMM over several tokens.
    Gemm(GemmParams),
    RmsNorm {
        dim: usize,
        unroll: usize,
    },
    Geglu {
        width: usize,
    },
    /// `q . k` for a block of queries over a run of cached keys: the GEMM
    /// with f32 "weights" (the keys) and K = head_dim.
    AttnScores(GemmParams),
    Softmax,
    AttnWsum {
        head_dim: usize,
    },
}

/// The name of values of `q` (its offset) in Q8_0x16's 16-row blocks:
/// `q8_0x16`, `q5_0x16`; a 16-row layout's own name (`q5_0x16k`, Q5_0's
/// nibbles with opmasks of high bits).
fn rows16_name(q: QuantType) -> String {
    match q {
        QuantType::Q8_0 | QuantType::Q8_0x16 => QuantType::Q8_0x16.name().to_string(),
        _ if q.rows_are_lanes() => q.name().to_string(),
        _ => format!("{}x16", q.name()),
    }
}

impl KernelKind {
    /// The registry key, e.g. `gemv_f16_r4_u2_k640`.
    pub fn name(&self) -> String {
        match self {
            KernelKind::Gemv(p) => {
                format!(
                    "gemv_{}_r{}_u{}_k{}",
                    p.wt.name(),
                    gemv::ROWS,
                    p.unroll,
                    p.k
                )
            }
            KernelKind::GemvQuant(p) => {
                format!(
                    "gemv_{}_r{}{}_pf{}",
                    p.q.name(),
                    gemv_quant::ROWS * if p.two_blocks { 2 } else { 1 },
                    if p.vnni { "_vnni" } else { "" },
                    p.prefetch
                )
            }
            KernelKind::GemmQuant(p) => {
                let l2 = match p.l2_prefetch {
                    0 => String::new(),
                    bytes => format!("_l2pf{bytes}"),
                };
                format!(
                    "gemm_{}_r{}t{}{}_pf{}{l2}",
                    rows16_name(p.q),
                    gemm_quant::ROWS,
                    gemm_quant::TOKENS,
                    if p.vnni { "_vnni" } else { "" },
                    p.prefetch
                )
            }
            KernelKind::UnpackQuant(p) => {
                format!(
                    "unpack_{}_r{}_to_{}_pf{}",
                    p.q.name(),
                    quant_blocks::BLOCK_ROWS,
                    rows16_name(p.into),
                    p.prefetch
                )
            }
            KernelKind::Gemm(p) => {
                format!(
                    "gemm_{}_r{}t{}_k{}",
                    p.wt.name(),
                    gemm::ROWS,
                    gemm::TOKENS,
                    p.k
                )
            }
            KernelKind::RmsNorm { dim, unroll } => format!("rmsnorm_d{dim}_u{unroll}"),
            KernelKind::Geglu { width } => format!("geglu_w{width}"),
            KernelKind::AttnScores(p) => {
                format!("attn_scores_r{}t{}_hd{}", gemm::ROWS, gemm::TOKENS, p.k)
            }
            KernelKind::Softmax => "softmax".to_string(),
            KernelKind::AttnWsum { head_dim } => {
                format!("attn_wsum_q{}_hd{head_dim}", emit::attention::WSUM_QUERIES)
            }
        }
    }

    /// The widest vectors the kernel uses: 512 bits for the VNNI integer
    /// GEMM, 256 for every other kernel (the verifier holds each to its
    /// width).
    pub fn vector_bits(&self) -> usize {
        match self {
            KernelKind::GemmQuant(GemmQuantParams { vnni: true, .. }) => 512,
            _ => 256,
        }
    }

    /// Emits the machine code (AVX2 + FMA + F16C; AVX-512 VNNI's
    /// `vpdpbusd` where a kernel's params ask for it: on ymm registers in
    /// Q8_0's GEMV, on zmm in the integer GEMM).
    pub fn emit(&self) -> Result<Vec<u8>> {
        let name = self.name();
        match self {
            KernelKind::Gemv(p) => emit::gemv::emit(p, &name),
            KernelKind::GemvQuant(p) => emit::gemv_quant::emit(p, &name),
            KernelKind::GemmQuant(p) => emit::gemm_quant::emit(p, &name),
            KernelKind::UnpackQuant(p) => emit::unpack_quant::emit(p, &name),
            KernelKind::Gemm(p) | KernelKind::AttnScores(p) => emit::gemm::emit(p, &name),
            KernelKind::RmsNorm { dim, unroll } => {
                emit::elementwise::emit_rmsnorm(*dim, *unroll, &name)
            }
            KernelKind::Geglu { width } => emit::elementwise::emit_geglu(*width, &name),
            KernelKind::Softmax => emit::attention::emit_softmax(&name),
            KernelKind::AttnWsum { head_dim } => emit::attention::emit_wsum(*head_dim, &name),
        }
    }
}

/// One kernel of the plan and the model tensors it serves.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KernelSpec {
    pub name: String,
    #[serde(flatten)]
    pub kind: KernelKind,
    pub isa: Isa,
    pub used_for: Vec<String>,
}

/// A matrix-vector product of the model and how its rows split over threads.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MatrixUse {
    pub tensor: &'static str,
    pub rows: usize,
    pub k: usize,
    pub gemv: String,
    pub gemm: String,
    /// Q5_0 and Q4_0: the kernel that unpacks panels of rows into Q8_0's
    /// layout for the GEMM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unpack: Option<String>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Plan {
    /// ISA of the emitted kernels (AVX2 until an AVX-512 family exists).
    pub isa: Isa,
    /// Highest ISA the CPU and --max-isa allow.
    pub allowed_isa: Isa,
    pub threads: usize,
    pub budget_bytes: usize,
    pub kernels: Vec<KernelSpec>,
    pub matrices: Vec<MatrixUse>,
    /// Sizes measured by emission, parallel to `kernels`.
    pub kernel_bytes: Vec<usize>,
    /// Every blocking decision the engine obeys, and why.
    pub blocking: Blocking,
    pub blocking_reasons: Vec<Reason>,
    /// Human-readable record of the choices made.
    pub notes: Vec<String>,
    /// Ops of the hot path that stay in Rust.
    pub not_jitted: Vec<String>,
    /// Attention's scores and its weighted sums of more than a token's
    /// query heads run on AVX-512 in the engine (`engine::attn_scores`,
    /// `engine::decode_wsum`), so the plan emits no kernels for them.
    pub avx512_attention: bool,
}

impl Plan {
    /// The instruction sets that run, as a user should read them: AVX2
    /// kernels, plus VNNI's byte products where the integer kernels use
    /// them, plus the engine's AVX-512 attention where the plan leaves
    /// attention to it.
    pub fn isa_description(&self) -> String {
        let mut text = self.isa.name().to_string();
        if self.kernels.iter().any(|k| k.isa == Isa::Avx512) {
            text += " + avx512-vnni (integer products)";
        }
        if self.avx512_attention {
            text += " + avx512 (attention, in the engine)";
        }
        text
    }

    pub fn total_bytes(&self) -> usize {
        self.kernel_bytes.iter().sum()
    }
}

/// Splits `n` rows into at most `threads` contiguous ranges whose starts are
/// multiples of `block`, so no block is shared by two threads.
pub fn split_rows(n: usize, threads: usize, block: usize) -> Vec<Range<usize>> {
    let blocks = n.div_ceil(block);
    let t = threads.clamp(1, blocks.max(1));
    let mut out = Vec::with_capacity(t);
    let mut start_block = 0;
    for i in 0..t {
        let end_block = blocks * (i + 1) / t;
        let r = (start_block * block).min(n)..(end_block * block).min(n);
        if !r.is_empty() {
            out.push(r);
        }
        start_block = end_block;
    }
    out
}

/// Elements of x per chunk so that a 3-token tile of x uses at most half of L1d.
pub fn k_chunk(caps: &CpuCaps, k: usize) -> usize {
    let l1 = if caps.l1d == 0 { 32 * 1024 } else { caps.l1d };
    let per = (l1 / 2) / (4 * gemm::TOKENS);
    (per / LANES * LANES).clamp(LANES, k.max(LANES)).min(k)
}

/// How each quantized type is stored for the kernels of a CPU. The engine
/// stores matrices so; the plan then emits the kernels of the types it is
/// given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantLayouts {
    /// Q8_0: in 16-row blocks wherever the JIT runs (the integer GEMM's
    /// lanes are rows, with VNNI or AVX2, and it also takes single tokens:
    /// see `emit::gemm_quant`), in 4-row blocks for a CPU it cannot serve.
    pub q8_0: QuantType,
    /// Q5_0: in 16-row blocks with VNNI, where one kernel unpacks and
    /// multiplies them for any token count (`emit::gemm_q8_0x16`); in
    /// 4-row pairs otherwise (AVX2's GEMV, and panels unpacked for its
    /// GEMM).
    pub q5_0: QuantType,
    /// Q4_K and Q6_K at the file's bits (`emit::gemm_kquant`) rather than
    /// converted to Q5_0 with offsets and Q8_0: with VNNI. Under AVX2 the
    /// kernel's passes of one token over 8 rows were slower than the
    /// converted path on a Gemma 3 4B Q4_K_M file (AMD EPYC, 2 threads,
    /// `PULSAR_MAX_ISA=avx2 bench --pp 64 --tg 16`: prefill 22.2 against
    /// 43.8 tok/s, decode 8.38 against 9.47 though it reads 2,524 MB a
    /// token against 3,443), so there they stay converted unless
    /// `PULSAR_K_QUANTS=native` asks.
    pub k_quants_native: bool,
}

impl QuantLayouts {
    /// The layouts for a CPU and the ISA the user allows.
    pub fn for_cpu(caps: &CpuCaps, max_isa: Isa) -> QuantLayouts {
        let isa = caps.effective_isa(max_isa);
        let vnni = isa == Some(Isa::Avx512) && caps.avx512_vnni;
        QuantLayouts {
            q8_0: if isa.is_some() {
                QuantType::Q8_0x16
            } else {
                QuantType::Q8_0
            },
            q5_0: if vnni {
                QuantType::Q5_0x16
            } else {
                QuantType::Q5_0
            },
            k_quants_native: vnni,
        }
    }

    /// The layout of values of `q`'s file type.
    pub fn of(&self, q: QuantType) -> QuantType {
        match q {
            QuantType::Q8_0 | QuantType::Q8_0x16 => self.q8_0,
            QuantType::Q5_0 | QuantType::Q5_0x16 => self.q5_0,
            QuantType::Q4_0 => QuantType::Q4_0,
            // One layout each, whose kernel has AVX2 and VNNI forms.
            k @ (QuantType::Q4Kx16 | QuantType::Q6Kx16) => k,
        }
    }
}

/// Builds the plan for a model. Pure: same inputs, same plan.
pub fn plan(dims: &ModelDims, caps: &CpuCaps, opts: &PlanOptions) -> Result<Plan> {
    dims.validate()?;
    let Some(allowed_isa) = caps.effective_isa(opts.max_isa) else {
        bail!(
            caps.baseline_message()
                .unwrap_or_else(|| "no usable ISA".into())
        );
    };
    for (what, v) in [
        ("hidden", dims.hidden),
        ("intermediate", dims.intermediate),
        ("head_dim", dims.head_dim),
    ] {
        if v < LANES {
            bail!(
                "model shape: {what} = {v} is below the vector width {LANES}; use the reference engine"
            );
        }
    }
    let threads = if opts.threads == 0 {
        caps.cores.max(1)
    } else {
        opts.threads
    };
    let mut notes = Vec::new();
    let isa = Isa::Avx2;
    // VNNI's byte dot product: on zmm registers in the integer GEMM, on
    // ymm in Q8_0's GEMV; no other kernel uses AVX-512, and none uses
    // masks or zmm16..31.
    let vnni = allowed_isa == Isa::Avx512 && caps.avx512_vnni;
    if allowed_isa == Isa::Avx512 {
        notes.push(if vnni && !opts.quantized.is_empty() {
            "AVX-512 allowed: the integer GEMM uses VNNI's vpdpbusd on zmm registers, Q8_0's GEMV on ymm; every other kernel is AVX2".into()
        } else {
            "AVX-512 allowed, but only AVX2 kernels are emitted for these weights; using them".into()
        });
    }

    // Matrix-vector products of one layer plus the LM head.
    let q = dims.q_width();
    let kv = dims.kv_stride();
    let uniform_mats = vec![
        ("attn_q", q, dims.hidden),
        ("attn_k", kv, dims.hidden),
        ("attn_v", kv, dims.hidden),
        ("attn_output", dims.hidden, q),
        ("ffn_gate", dims.intermediate, dims.hidden),
        ("ffn_up", dims.intermediate, dims.hidden),
        ("ffn_down", dims.hidden, dims.intermediate),
        ("output(lm_head)", dims.vocab, dims.hidden),
    ];
    let mats: Vec<(&'static str, usize, usize)> = if opts.matrices.is_empty() {
        uniform_mats
    } else {
        opts.matrices.clone()
    };
    let mut ks: Vec<usize> = mats.iter().map(|m| m.2).collect();
    ks.sort_unstable();
    ks.dedup();
    // 16-bit GEMV and GEMM only where some 16-bit matrix is multiplied.
    let wide_ks: Vec<usize> = ks
        .iter()
        .copied()
        .filter(|&k| {
            mats.iter().any(|&(tensor, _, mk)| {
                mk == k
                    && opts
                        .wide_tensors
                        .as_ref()
                        .is_none_or(|wide| wide.contains(&tensor))
            })
        })
        .collect();
    if wide_ks.len() < ks.len() {
        notes.push(format!(
            "no 16-bit GEMV or GEMM for K in {:?}: every matrix with that K is quantized",
            ks.iter()
                .filter(|k| !wide_ks.contains(k))
                .collect::<Vec<_>>()
        ));
    }
    // Only Q8_0's GEMV gains from VNNI (3 instructions a row instead of
    // 5); Q5_0's and Q4_0's unpacking leaves their products 2 either way.
    let quant_gemv = |q: QuantType, two_blocks: bool| GemvQuantParams {
        q,
        prefetch: opts.quant_prefetch,
        vnni: vnni && q == QuantType::Q8_0,
        two_blocks: two_blocks && gemv_quant::in_pairs(q),
    };
    let mut quant_types: Vec<QuantType> = opts.quantized.iter().map(|m| m.q).collect();
    quant_types.sort_by_key(|q| q.name());
    quant_types.dedup();
    // The 16-row layouts have no GEMV: their GEMM takes single tokens too.
    let has_gemv = |q: QuantType| !q.rows_are_lanes();
    let quant_kinds = |two_blocks: bool| -> Vec<GemvQuantParams> {
        quant_types
            .iter()
            .filter(|&&q| has_gemv(q))
            .map(|&q| quant_gemv(q, two_blocks))
            .collect()
    };
    // Q5_0 and Q4_0 panels are unpacked first (see emit::unpack_quant)
    // into Q8_0x16's 16-row blocks: with VNNI with Q8_0's offset, so that
    // one GEMM (Q8_0x16's) serves every type; under AVX2 with their own,
    // small enough for vpmaddubsw without Q8_0's sign trick, each type with
    // its GEMM. (Under AVX2 with Q8_0's offset, a prefill of 512 tokens
    // measured 432-482 tok/s against 500-568 for the 4-row GEMM before.)
    // (Q5_0x16 is unpacked by its GEMM itself, in registers.)
    let unpack_of = |q: QuantType| {
        (!q.is_q8_0() && !q.rows_are_lanes()).then_some(UnpackQuantParams {
            q,
            into: if vnni { QuantType::Q8_0x16 } else { q },
            prefetch: QUANT_PREFETCH_BYTES,
        })
    };
    // The GEMM keeps the analytic distance: the launch tuning times decode
    // steps (the GEMVs) only, and a distance that won there by noise, off
    // say, costs the GEMM most (an 8-token tile from memory: 24.5 ns per
    // group without prefetching, 13-15 with 8 KiB).
    // AVX2's GEMM of unpacked panels reads them from L2, where they were
    // just written: no prefetching (which also leaves the plan room for
    // its GeGLU). Q8_0x16's GEMM also reads Q8_0 from memory.
    let quant_gemm = |q: QuantType| {
        let gemm_q = unpack_of(q).map_or(q, |u| u.into);
        GemmQuantParams {
            q: gemm_q,
            vnni,
            prefetch: if gemm_q.rows_are_lanes() {
                QUANT_PREFETCH_BYTES
            } else {
                0
            },
            l2_prefetch: if gemm_q.rows_are_lanes() && vnni {
                GEMM_L2_PREFETCH_BYTES
            } else {
                0
            },
        }
    };

    // Candidate unroll levels, most aggressive first.
    let mut gemv_unroll = 4usize;
    // Q5_0's and Q4_0's GEMV over two row blocks per pass: 738 bytes
    // against 493 for Q5_0. Q4_0's decode on the gemma-2b shape gains
    // most from it, and fits; the default model's Q5_0 GEMV gained from
    // L2 only (from DRAM it already reads at the plain read's rate on 2
    // threads), so it is traded first there.
    let mut two_block_gemv = true;
    let mut norm_unroll = 2usize;
    // With AVX-512 the engine computes attention's scores and weighted
    // sums on zmm registers in Rust: for a verify step's 32 query rows per
    // thread over 275 keys, from L1/L2, scores 51 us against 64-68 with
    // the JIT's ymm GEMM and weighted sums 44 against 57-58 (both near the
    // FMA's rate; an AVX-512 form in the JIT would need EVEX code that the
    // 1,031 bytes of the two ymm kernels could not hold). Those bytes go
    // back to the budget.
    let avx512_attention = allowed_isa == Isa::Avx512
        && dims.head_dim.is_multiple_of(64)
        && dims.other_head_dim.is_multiple_of(64);
    let mut optional: Vec<&str> = if avx512_attention {
        vec!["softmax", "geglu"]
    } else {
        vec!["attn_scores", "softmax", "attn_wsum", "geglu"]
    };
    let mut dropped: Vec<String> = Vec::new();
    loop {
        let mut kinds = build_kinds(
            dims,
            &wide_ks,
            opts.weights,
            gemv_unroll,
            norm_unroll,
            &optional,
        );
        // The matrices stored in `q`, as a one-token kernel lists them.
        let matrices_in = |q: QuantType| {
            opts.quantized
                .iter()
                .filter(|m| m.q == q)
                .map(|m| format!("{} (K {})", m.tensor, m.k))
                .collect::<Vec<_>>()
                .join(", ")
        };
        kinds.extend(
            quant_kinds(two_block_gemv)
                .into_iter()
                .map(|p| (KernelKind::GemvQuant(p), vec![matrices_in(p.q)])),
        );
        let mut gemms: Vec<(GemmQuantParams, Vec<String>)> = Vec::new();
        for &q in &quant_types {
            let gemm = quant_gemm(q);
            let name = q.name().to_uppercase();
            match gemms.iter_mut().find(|(g, _)| *g == gemm) {
                Some((_, types)) => types.push(name),
                None => gemms.push((gemm, vec![name])),
            }
        }
        kinds.extend(gemms.into_iter().map(|(gemm, types)| {
            let used_for = if has_gemv(gemm.q) {
                format!("{} products of 2 or more tokens", types.join(", "))
            } else {
                // Also the one-token kernel: its matrices, as a GEMV's.
                format!("products of 1 or more tokens: {}", matrices_in(gemm.q))
            };
            (KernelKind::GemmQuant(gemm), vec![used_for])
        }));
        kinds.extend(quant_types.iter().filter_map(|&q| {
            let unpack = unpack_of(q)?;
            Some((
                KernelKind::UnpackQuant(unpack),
                vec![format!(
                    "{} panels for the GEMM, in 16-row blocks",
                    q.name().to_uppercase()
                )],
            ))
        }));
        let mut sizes = Vec::with_capacity(kinds.len());
        for (k, _) in &kinds {
            sizes.push(k.emit()?.len());
        }
        let total: usize = sizes.iter().sum();
        if total <= opts.budget {
            notes.push(format!(
                "chose gemv unroll {gemv_unroll} (x8 elements, 4 rows/block), rmsnorm unroll {norm_unroll}: {total} of {} bytes",
                opts.budget
            ));
            let kernels: Vec<KernelSpec> = kinds
                .into_iter()
                .map(|(kind, used_for)| KernelSpec {
                    name: kind.name(),
                    isa: match kind {
                        KernelKind::GemmQuant(GemmQuantParams { vnni: true, .. })
                        | KernelKind::GemvQuant(GemvQuantParams { vnni: true, .. }) => Isa::Avx512,
                        _ => isa,
                    },
                    kind,
                    used_for,
                })
                .collect();
            let matrices = mats
                .iter()
                .map(|&(tensor, rows, k)| {
                    let quantized = opts
                        .quantized
                        .iter()
                        .find(|m| m.tensor == tensor && m.k == k);
                    let (gemv, gemm) = match quantized {
                        Some(m) if has_gemv(m.q) => (
                            KernelKind::GemvQuant(quant_gemv(m.q, two_block_gemv)),
                            KernelKind::GemmQuant(quant_gemm(m.q)),
                        ),
                        Some(m) => (
                            KernelKind::GemmQuant(quant_gemm(m.q)),
                            KernelKind::GemmQuant(quant_gemm(m.q)),
                        ),
                        None => (
                            KernelKind::Gemv(GemvParams {
                                wt: opts.weights,
                                k,
                                unroll: gemv_unroll,
                            }),
                            KernelKind::Gemm(GemmParams {
                                wt: opts.weights,
                                k,
                            }),
                        ),
                    };
                    MatrixUse {
                        tensor,
                        rows,
                        k,
                        gemv: gemv.name(),
                        gemm: gemm.name(),
                        unpack: quantized
                            .and_then(|m| unpack_of(m.q))
                            .map(|u| KernelKind::UnpackQuant(u).name()),
                    }
                })
                .collect();
            // The smallest layer matrix in its stored format sizes the
            // threads' smallest chunks.
            let smallest = mats
                .iter()
                .filter(|m| m.0 != "output(lm_head)")
                .map(|&(tensor, rows, k)| {
                    match opts
                        .quantized
                        .iter()
                        .find(|m| m.tensor == tensor && m.k == k)
                    {
                        Some(m) => m.q.matrix_bytes(rows, k),
                        None => rows * k * 2,
                    }
                })
                .min()
                .unwrap_or(0);
            let (blocking, blocking_reasons) = Blocking::analytic(caps, dims, threads, smallest);
            for &k in &ks {
                if k_chunk(caps, k) < k {
                    notes.push(format!(
                        "K={k}: a 3-token x slice ({} KiB) exceeds half of L1d; the L1 chunk would be {}, but chunking is not emitted: GEMM with x from L2 measured no slower per FLOP (tune --measure)",
                        k * 4 * gemm::TOKENS / 1024,
                        k_chunk(caps, k)
                    ));
                }
            }
            let mut not_jitted: Vec<String> = vec![
                "embedding lookup and scaling".into(),
                "residual adds".into(),
                "RoPE".into(),
                "a decode step's weighted sum over V (4 query heads or fewer: row by row, see engine::decode_wsum)".into(),
                "converting q4_k/q5_k to q5_0 and q6_k to q8_0 at load".into(),
                "a q4_k/q5_k matrix's offset per 32 values (added after its q5_0 product)".into(),
                "quantizing quantized matrices' inputs to 8 bits (per token, and in tiles of 8 tokens)".into(),
                "sampling".into(),
            ];
            if avx512_attention {
                not_jitted.push("attention scores, and weighted sums over more query rows: AVX-512 (engine::attn_scores, engine::decode_wsum::weighted_sum_tiled)".into());
            }
            not_jitted.extend(
                dropped
                    .iter()
                    .map(|d| format!("{d} (dropped for the byte budget)")),
            );
            return Ok(Plan {
                isa,
                allowed_isa,
                threads,
                budget_bytes: opts.budget,
                kernel_bytes: sizes,
                kernels,
                matrices,
                blocking,
                blocking_reasons,
                notes,
                not_jitted,
                avx512_attention,
            });
        }
        // Over budget: give up unrolling first, then optional kernels.
        if gemv_unroll > 1 {
            notes.push(format!(
                "{total} B > budget: gemv unroll {gemv_unroll} -> {}",
                gemv_unroll / 2
            ));
            gemv_unroll /= 2;
        } else if two_block_gemv && quant_types.iter().any(|&q| gemv_quant::in_pairs(q)) {
            notes.push(format!(
                "{total} B > budget: Q5_0/Q4_0 GEMV 8 rows per pass -> 4"
            ));
            two_block_gemv = false;
        } else if norm_unroll > 1 {
            notes.push(format!(
                "{total} B > budget: rmsnorm unroll {norm_unroll} -> 1"
            ));
            norm_unroll = 1;
        } else if let Some(op) = optional.pop() {
            notes.push(format!("{total} B > budget: {op} stays in Rust"));
            dropped.push(op.to_string());
        } else {
            let each: Vec<String> = kinds
                .iter()
                .zip(&sizes)
                .map(|((k, _), n)| format!("{} {n}", k.name()))
                .collect();
            bail!(
                "the matrix kernels alone need {total} bytes, over the {} byte budget ({})",
                opts.budget,
                each.join(", ")
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn build_kinds(
    dims: &ModelDims,
    wide_ks: &[usize],
    wt: WeightType,
    gemv_unroll: usize,
    norm_unroll: usize,
    optional: &[&str],
) -> Vec<(KernelKind, Vec<String>)> {
    let mut out = Vec::new();
    let uses_of_k = |k: usize| -> Vec<String> {
        let mut u = Vec::new();
        if k == dims.hidden {
            u.push("attn_q/k/v, ffn_gate/up, lm_head".to_string());
        }
        if k == dims.q_width() {
            u.push("attn_output".to_string());
        }
        if k == dims.intermediate {
            u.push("ffn_down".to_string());
        }
        u
    };
    for &k in wide_ks {
        out.push((
            KernelKind::Gemv(GemvParams {
                wt,
                k,
                unroll: gemv_unroll,
            }),
            uses_of_k(k),
        ));
    }
    for &k in wide_ks {
        out.push((KernelKind::Gemm(GemmParams { wt, k }), uses_of_k(k)));
    }
    out.push((
        KernelKind::RmsNorm {
            dim: dims.hidden,
            unroll: norm_unroll,
        },
        vec!["attn/ffn pre- and post-norms, final norm".into()],
    ));
    let head_dims = std::iter::once(dims.head_dim)
        .chain((dims.other_head_dim != 0).then_some(dims.other_head_dim));
    for hd in head_dims.clone() {
        if dims.qk_norm && hd != dims.hidden {
            out.push((
                KernelKind::RmsNorm {
                    dim: hd,
                    unroll: norm_unroll.min(2),
                },
                vec![format!("q_norm, k_norm (per head of {hd})")],
            ));
        }
    }
    let has = |op: &str| optional.contains(&op);
    if has("geglu") {
        out.push((
            KernelKind::Geglu {
                width: dims.intermediate,
            },
            vec!["ffn activation".into()],
        ));
    }
    for hd in head_dims.clone() {
        if has("attn_scores") && hd >= LANES {
            out.push((
                KernelKind::AttnScores(GemmParams {
                    wt: WeightType::F32,
                    k: hd,
                }),
                vec![format!(
                    "q . k of a query block over the KV cache (heads of {hd})"
                )],
            ));
        }
    }
    if has("softmax") {
        out.push((KernelKind::Softmax, vec!["attention probabilities".into()]));
    }
    for hd in head_dims {
        if has("attn_wsum") && hd.is_multiple_of(LANES) {
            out.push((
                KernelKind::AttnWsum { head_dim: hd },
                vec![format!("probability-weighted sum of V (heads of {hd})")],
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma2b() -> ModelDims {
        ModelDims::from(&crate::model::presets::gemma_2b())
    }

    #[test]
    fn the_270m_constant_matches_its_preset() {
        assert_eq!(
            ModelDims::GEMMA3_270M,
            ModelDims::from(&crate::model::presets::gemma3_270m())
        );
    }

    #[test]
    fn split_rows_covers_everything_on_block_boundaries() {
        for n in [1, 3, 4, 5, 17, 640, 1001] {
            for t in 1..=5 {
                let parts = split_rows(n, t, 4);
                assert!(parts.len() <= t);
                assert_eq!(parts.first().map(|r| r.start), Some(0));
                assert_eq!(parts.last().map(|r| r.end), Some(n));
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                for r in &parts {
                    assert_eq!(r.start % 4, 0, "n={n} t={t} {parts:?}");
                }
            }
        }
        assert_eq!(split_rows(8, 2, 4), vec![0..4, 4..8]);
    }

    #[test]
    fn plan_is_deterministic_and_fits_budget() {
        let caps = CpuCaps::zen4_like();
        for dims in [ModelDims::GEMMA3_270M, gemma2b()] {
            let a = plan(&dims, &caps, &PlanOptions::default()).unwrap();
            let b = plan(&dims, &caps, &PlanOptions::default()).unwrap();
            assert_eq!(a, b);
            assert!(a.total_bytes() <= BUDGET_BYTES, "{}", a.total_bytes());
            assert_eq!(a.kernels.len(), a.kernel_bytes.len());
        }
    }

    #[test]
    fn plan_270m_has_one_gemv_per_distinct_k() {
        let p = plan(
            &ModelDims::GEMMA3_270M,
            &CpuCaps::zen4_like(),
            &PlanOptions::default(),
        )
        .unwrap();
        let gemv: Vec<_> = p
            .kernels
            .iter()
            .filter(|k| matches!(k.kind, KernelKind::Gemv(_)))
            .collect();
        let ks: Vec<usize> = gemv
            .iter()
            .map(|k| match &k.kind {
                KernelKind::Gemv(g) => g.k,
                _ => 0,
            })
            .collect();
        assert_eq!(ks, vec![640, 1024, 2048]);
        assert!(
            p.kernels
                .iter()
                .any(|k| k.name == "rmsnorm_d256_u2" || k.name == "rmsnorm_d256_u1")
        );
        // Every matrix names a kernel that exists in the plan.
        for m in &p.matrices {
            assert!(p.kernels.iter().any(|k| k.name == m.gemv), "{}", m.gemv);
        }
    }

    #[test]
    fn tight_budget_reduces_unroll_then_drops_ops() {
        let caps = CpuCaps::zen4_like();
        let full = plan(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap();
        let opts = PlanOptions {
            budget: full.total_bytes() - 1,
            ..PlanOptions::default()
        };
        let tight = plan(&ModelDims::GEMMA3_270M, &caps, &opts).unwrap();
        assert!(tight.total_bytes() < full.total_bytes());
        assert!(tight.notes.iter().any(|n| n.contains("> budget")));
        let tiny = PlanOptions {
            budget: 100,
            ..PlanOptions::default()
        };
        assert!(plan(&ModelDims::GEMMA3_270M, &caps, &tiny).is_err());
    }

    #[test]
    fn no_avx2_means_no_plan_with_a_clear_message() {
        let caps = CpuCaps {
            avx2: false,
            ..CpuCaps::zen4_like()
        };
        let err = plan(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap_err();
        assert!(err.to_string().contains("reference engine"), "{err}");
    }

    #[test]
    fn k_chunk_keeps_x_in_half_l1() {
        let caps = CpuCaps::zen4_like();
        assert_eq!(k_chunk(&caps, 640), 640);
        let c = k_chunk(&caps, 16384);
        assert!(
            c * 4 * gemm::TOKENS <= caps.l1d / 2 && c.is_multiple_of(LANES),
            "{c}"
        );
    }

    #[test]
    fn every_gemma_shape_fits_the_budget() {
        let caps = CpuCaps::zen4_like();
        // (hidden, intermediate, heads, kv heads, head_dim, vocab, qk_norm)
        let shapes = [
            (640, 2048, 4, 1, 256, 262_144, true),      // gemma-3-270m
            (1152, 6912, 4, 1, 256, 262_144, true),     // gemma-3-1b
            (2560, 10240, 8, 4, 256, 262_208, true),    // gemma-3-4b
            (5376, 21504, 32, 16, 128, 262_208, true),  // gemma-3-27b
            (2048, 16384, 8, 1, 256, 256_000, false),   // gemma-2b
            (3072, 24576, 16, 16, 256, 256_000, false), // gemma-7b
            (2304, 9216, 8, 4, 256, 256_000, false),    // gemma-2-2b
            (1001, 37, 3, 1, 18, 999, true),            // odd sizes
        ];
        for (hidden, intermediate, n_heads, n_kv_heads, head_dim, vocab, qk_norm) in shapes {
            let dims = ModelDims {
                hidden,
                intermediate,
                n_heads,
                n_kv_heads,
                head_dim,
                vocab,
                n_layers: 1,
                qk_norm,
                other_head_dim: 0,
            };
            for max_isa in [Isa::Avx2, Isa::Avx512] {
                let opts = PlanOptions {
                    max_isa,
                    ..PlanOptions::default()
                };
                let p = plan(&dims, &caps, &opts).unwrap_or_else(|e| panic!("{dims:?}: {e}"));
                assert!(
                    p.total_bytes() <= BUDGET_BYTES,
                    "{dims:?}: {}",
                    p.total_bytes()
                );
                let ks = [hidden, intermediate, n_heads * head_dim];
                for k in ks {
                    assert!(
                        p.kernels
                            .iter()
                            .any(|s| matches!(&s.kind, KernelKind::Gemv(g) if g.k == k)),
                        "{dims:?}: no GEMV for K={k}"
                    );
                }
            }
        }
    }

    #[test]
    fn max_isa_avx2_plans_avx2() {
        let opts = PlanOptions {
            max_isa: Isa::Avx2,
            ..PlanOptions::default()
        };
        let p = plan(&ModelDims::GEMMA3_270M, &CpuCaps::zen4_like(), &opts).unwrap();
        assert_eq!(p.isa, Isa::Avx2);
        assert!(p.kernels.iter().all(|k| k.isa == Isa::Avx2));
    }

    /// With AVX-512 the engine computes attention's scores and weighted
    /// sums itself, so the plan carries neither kernel (and says so); with
    /// AVX2 alone it has both.
    #[test]
    fn attention_products_are_planned_only_without_avx512() {
        let caps = CpuCaps::zen4_like();
        let has = |p: &Plan, kind: &str| p.kernels.iter().any(|k| k.name.starts_with(kind));
        let wide = plan(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap();
        assert!(wide.avx512_attention);
        assert!(!has(&wide, "attn_scores") && !has(&wide, "attn_wsum"));
        assert!(has(&wide, "softmax"));
        assert!(
            wide.not_jitted
                .iter()
                .any(|n| n.contains("engine::attn_scores"))
        );
        let opts = PlanOptions {
            max_isa: Isa::Avx2,
            ..PlanOptions::default()
        };
        let narrow = plan(&ModelDims::GEMMA3_270M, &caps, &opts).unwrap();
        assert!(!narrow.avx512_attention);
        assert!(has(&narrow, "attn_scores") && has(&narrow, "attn_wsum"));
    }
}
