//! The planner: a pure function from (model dims, CPU caps, options) to the
//! list of kernels to generate, with their blocking, unrolling and thread
//! split. The plan is complete before any code is mapped. Emission is
//! deterministic, so the planner measures candidate sizes by emitting them
//! and trades unrolling against the byte budget.
//!
//! - this module: the plan's types and its options;
//! - `kind`: what one kernel computes, its name and its emitter;
//! - `layouts`: how each quantized type is stored for a CPU;
//! - `choices`: the kernels of given unroll levels and their parameters;
//! - `fit`: [`plan`], which trades those levels against the budget;
//! - `split`: rows across threads, K into L1-sized chunks.

mod choices;
mod fit;
mod kind;
mod layouts;
mod split;

pub use fit::plan;
pub use kind::KernelKind;
pub use layouts::QuantLayouts;
pub use split::{k_chunk, split_rows};

use super::blocking::{Blocking, Reason};
use super::cpu::Isa;
use super::emit::gemm_wide::{GemmWideParams, WideProducts};
use super::emit::gemv::{GemvParams, WeightType};
use crate::model::quant_blocks::QuantType;

/// Bytes ahead the quantized GEMVs prefetch by default, and the integer
/// GEMM always (measured, see `GemvQuantParams::prefetch`).
pub const QUANT_PREFETCH_BYTES: usize = 8 << 10;

/// Bytes ahead the VNNI GEMM's passes over several tokens, and the
/// K-quant GEMM's every pass, also prefetch into L2 (see
/// `emit::gemm_q8_0x16`, `emit::gemm_kquant`).
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
    /// Matrices only ever multiplied one token at a time (a Gemma 4
    /// assistant's, drafting): a K that only they have gets a GEMV and no
    /// GEMM.
    pub one_token: Vec<&'static str>,
    /// Bytes ahead the quantized GEMVs prefetch (see `GemvQuantParams`).
    pub quant_prefetch: usize,
    /// BF16 weights' GEMM with AVX-512 BF16's `vdpbf16ps` (inputs rounded
    /// to bf16) where the CPU has it; false keeps f32 inputs (the FMA form).
    pub bf16_dot: bool,
    /// The 16-bit GEMV on zmm registers (`emit::gemv_wide`) where the CPU
    /// has AVX-512; false (the default) keeps the ymm form, which streams
    /// from memory at least as fast on Zen 4.
    pub zmm_gemv: bool,
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
            one_token: Vec::new(),
            quant_prefetch: QUANT_PREFETCH_BYTES,
            bf16_dot: true,
            zmm_gemv: false,
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
        let wide = |k: &KernelSpec| matches!(k.kind, KernelKind::GemmWide(_));
        let zmm_gemv =
            |k: &KernelSpec| matches!(k.kind, KernelKind::Gemv(GemvParams { zmm: true, .. }));
        if self
            .kernels
            .iter()
            .any(|k| k.isa == Isa::Avx512 && !wide(k) && !zmm_gemv(k))
        {
            text += " + avx512-vnni (integer products)";
        }
        if self.kernels.iter().any(zmm_gemv) {
            text += " + avx512 (16-bit GEMV)";
        }
        if let Some(k) = self.kernels.iter().find(|k| wide(k)) {
            text += match k.kind {
                KernelKind::GemmWide(GemmWideParams {
                    products: WideProducts::Bf16Dot,
                    ..
                }) => " + avx512-bf16 (16-bit GEMM)",
                _ => " + avx512 (16-bit GEMM)",
            };
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
