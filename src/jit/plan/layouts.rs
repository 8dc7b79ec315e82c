//! How each quantized type is stored for a CPU's kernels: the engine lays
//! its matrices out so, and the plan emits the kernels of those layouts.

use crate::jit::cpu::{CpuCaps, Isa};
use crate::model::quant_blocks::QuantType;

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
    /// Q4_K, Q5_K and Q6_K at the file's bits (`emit::gemm_kquant`, with VNNI,
    /// and `emit::gemm_kquant_avx2`) rather than converted to Q5_0 with
    /// offsets and Q8_0, wherever the JIT runs: under AVX2 too since its
    /// passes of 4 tokens and its L2 prefetches (a 4B Q4_K_M file decodes
    /// about a third faster there, reading 27% fewer bytes, and
    /// prefills as fast; see docs/performance.md).
    /// `PULSAR_K_QUANTS=convert` asks for the conversion.
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
            k_quants_native: isa.is_some(),
        }
    }

    /// The layout of values of `q`'s file type.
    pub fn of(&self, q: QuantType) -> QuantType {
        match q {
            QuantType::Q8_0 | QuantType::Q8_0x16 => self.q8_0,
            QuantType::Q5_0 | QuantType::Q5_0x16 => self.q5_0,
            QuantType::Q4_0 => QuantType::Q4_0,
            // One layout each, whose kernel has AVX2 and VNNI forms.
            k @ (QuantType::Q4Kx16 | QuantType::Q5Kx16 | QuantType::Q6Kx16) => k,
        }
    }
}
