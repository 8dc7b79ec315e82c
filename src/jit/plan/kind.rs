//! What one kernel computes ([`KernelKind`]): its parameters, the registry
//! name they give it, and the emitter that turns them into machine code.

use crate::jit::emit;
use crate::jit::emit::gemm::{self, GemmParams};
use crate::jit::emit::gemm_quant::{self, GemmQuantParams};
use crate::jit::emit::gemm_wide::{self, GemmWideParams, WideProducts};
use crate::jit::emit::gemv::{self, GemvParams};
use crate::jit::emit::gemv_quant::{self, GemvQuantParams};
use crate::jit::emit::unpack_quant::UnpackQuantParams;
use crate::model::quant_blocks::{self, QuantType};
use anyhow::Result;

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
    /// The 16-bit GEMM on 512-bit vectors, any K (AVX-512: BF16 dot
    /// products or widened weights and FMA).
    GemmWide(GemmWideParams),
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
                    "gemv_{}_r{}_u{}_k{}{}",
                    p.wt.name(),
                    gemv::ROWS,
                    p.unroll,
                    p.k,
                    if p.zmm { "_zmm" } else { "" }
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
            KernelKind::GemmWide(p) => {
                format!(
                    "gemm_{}_r{}t{}_{}",
                    p.wt.name(),
                    p.rows(),
                    gemm_wide::TILE_TOKENS,
                    match p.products {
                        WideProducts::Bf16Dot => "dot",
                        WideProducts::Fma => "fma",
                    }
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
    /// GEMM and the 16-bit GEMM and GEMV on zmm, 256 for every other
    /// kernel (the verifier holds each to its width).
    pub fn vector_bits(&self) -> usize {
        match self {
            KernelKind::GemmQuant(GemmQuantParams { vnni: true, .. })
            | KernelKind::GemmWide(_)
            | KernelKind::Gemv(GemvParams { zmm: true, .. }) => 512,
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
            KernelKind::GemmWide(p) => emit::gemm_wide::emit(p, &name),
            KernelKind::RmsNorm { dim, unroll } => {
                emit::elementwise::emit_rmsnorm(*dim, *unroll, &name)
            }
            KernelKind::Geglu { width } => emit::elementwise::emit_geglu(*width, &name),
            KernelKind::Softmax => emit::attention::emit_softmax(&name),
            KernelKind::AttnWsum { head_dim } => emit::attention::emit_wsum(*head_dim, &name),
        }
    }
}
