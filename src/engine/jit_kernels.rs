//! The fast engine's matrix kernels from the JIT: plan for the model's
//! shapes on this CPU, emit, verify, map, then dispatch each product to the
//! GEMV (one token) or GEMM (a prefill chunk) generated for its K.

use super::kernels::{MatKernels, PortableKernels, SharedOut};
use super::packed::{PackedMatrix, WeightFormat};
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::dims::ModelDims;
use crate::jit::emit::gemv::WeightType;
use crate::jit::kernels::KernelSet;
use crate::jit::plan::{self, PlanOptions};
use crate::model::config::ModelConfig;
use anyhow::{Result, bail};
use std::ops::Range;

impl From<&ModelConfig> for ModelDims {
    fn from(c: &ModelConfig) -> ModelDims {
        ModelDims {
            hidden: c.hidden,
            intermediate: c.intermediate,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            n_layers: c.n_layers(),
            qk_norm: c.has_qk_norm(),
        }
    }
}

fn weight_type(f: WeightFormat) -> WeightType {
    match f {
        WeightFormat::F16 => WeightType::F16,
        WeightFormat::BF16 => WeightType::Bf16,
    }
}

pub struct JitKernels {
    set: KernelSet,
    isa: Isa,
}

impl JitKernels {
    /// Plans, emits and verifies the kernels for `config` with `format`
    /// weights. Fails (with the reason) on a CPU without AVX2, F16C and FMA
    /// or for shapes the JIT does not cover.
    pub fn build(config: &ModelConfig, format: WeightFormat, threads: usize) -> Result<JitKernels> {
        let caps = CpuCaps::detect();
        if let Some(msg) = caps.baseline_message() {
            bail!("{msg}");
        }
        let opts = PlanOptions {
            threads,
            weights: weight_type(format),
            ..PlanOptions::default()
        };
        let plan = plan::plan(&ModelDims::from(config), &caps, &opts)?;
        let isa = plan.kernels.first().map_or(Isa::Avx2, |k| k.isa);
        let set = KernelSet::build(&plan, &caps, opts.max_isa)?;
        Ok(JitKernels { set, isa })
    }
}

impl MatKernels for JitKernels {
    unsafe fn gemm(&self, w: &PackedMatrix, x: &[f32], rows: Range<usize>, y: SharedOut) {
        let wt = weight_type(w.format);
        let tokens = x.len() / w.cols;
        if tokens == 1
            && let Some(k) = self.set.gemv(wt, w.cols)
        {
            // SAFETY: the caller owns columns `rows` of y.
            let part = unsafe { y.cells(0, rows.clone()) };
            k.run_part(w.data(), x, part, rows)
                .expect("GEMV arguments sized by the engine");
        } else if let Some(k) = self.set.gemm(wt, w.cols) {
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
        } else {
            // A K the plan did not cover: keep going, correctly, in Rust.
            unsafe { PortableKernels.gemm(w, x, rows, y) };
        }
    }

    fn name(&self) -> String {
        format!("jit {}", self.isa.name())
    }
}
