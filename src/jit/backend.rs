//! The engine's entry: JIT kernels when the CPU can run them, otherwise the
//! reference engine with the reason (never a crash on an old CPU).

use super::cpu::CpuCaps;
use super::dims::ModelDims;
use super::kernels::KernelSet;
use super::plan::{Plan, PlanOptions, plan};
use anyhow::Result;

pub enum Backend {
    Jit { plan: Box<Plan>, kernels: KernelSet },
    Reference { reason: String },
}

/// Picks the backend. A verification failure is an error (the program must
/// stop and show it); a missing ISA is not.
pub fn select_backend(dims: &ModelDims, caps: &CpuCaps, opts: &PlanOptions) -> Result<Backend> {
    if let Some(reason) = caps.baseline_message() {
        return Ok(Backend::Reference { reason });
    }
    let plan = plan(dims, caps, opts)?;
    let kernels = KernelSet::build(&plan, caps, opts.max_isa)?;
    Ok(Backend::Jit {
        plan: Box::new(plan),
        kernels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_cpu_gets_the_reference_engine_with_a_reason() {
        for caps in [
            CpuCaps {
                avx2: false,
                ..CpuCaps::zen4_like()
            },
            CpuCaps {
                f16c: false,
                ..CpuCaps::zen4_like()
            },
            CpuCaps {
                fma: false,
                ..CpuCaps::zen4_like()
            },
        ] {
            match select_backend(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap() {
                Backend::Reference { reason } => {
                    assert!(
                        reason.contains("AVX2+F16C+FMA") && reason.contains("reference engine"),
                        "{reason}"
                    )
                }
                Backend::Jit { .. } => panic!("JIT chosen without AVX2+F16C+FMA"),
            }
        }
    }

    #[test]
    fn capable_cpu_gets_verified_kernels() {
        let caps = CpuCaps::detect();
        assert!(
            caps.has_jit_baseline(),
            "test machine must have AVX2+F16C+FMA: {caps}"
        );
        match select_backend(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap() {
            Backend::Jit { plan, kernels } => {
                assert_eq!(plan.kernels.len(), kernels.kernels().len());
                assert!(
                    kernels
                        .get::<crate::jit::kernels::Gemv>((
                            crate::jit::emit::gemv::WeightType::F16,
                            640
                        ))
                        .is_some()
                );
            }
            Backend::Reference { reason } => panic!("reference chosen: {reason}"),
        }
    }
}
