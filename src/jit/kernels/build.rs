//! The emit-and-verify driver: emits every kernel of a plan and verifies
//! each buffer before anything can map it.

use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::plan::{KernelSpec, Plan};
use crate::jit::verify::{self, Policy, Verified};
use anyhow::Result;
use std::time::{Duration, Instant};

/// One emitted, verified kernel.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub spec: KernelSpec,
    pub code: Vec<u8>,
    pub verified: Verified,
    /// Offset of the kernel inside the executable buffer.
    pub offset: usize,
}

/// Emitted kernels before mapping, plus timings.
pub struct Emitted {
    pub kernels: Vec<Compiled>,
    pub emit_time: Duration,
    pub verify_time: Duration,
}

/// Emits and verifies every kernel of `plan`; stops at the first failure.
pub fn emit_and_verify(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<Emitted> {
    emit_and_verify_specs(&plan.kernels, caps, max_isa)
}

/// Emits and verifies the given kernels; stops at the first failure.
pub fn emit_and_verify_specs(
    specs: &[KernelSpec],
    caps: &CpuCaps,
    max_isa: Isa,
) -> Result<Emitted> {
    let policy = Policy::new(caps, max_isa);
    let t0 = Instant::now();
    let mut codes = Vec::with_capacity(specs.len());
    for spec in specs {
        codes.push(spec.kind.emit()?);
    }
    let emit_time = t0.elapsed();
    let t1 = Instant::now();
    let mut kernels = Vec::with_capacity(codes.len());
    let mut offset = 0;
    for (spec, code) in specs.iter().zip(codes) {
        let verified = verify::verify(
            &spec.name,
            &code,
            &policy.with_vector_bits(spec.kind.vector_bits()),
        )?;
        let len = code.len();
        kernels.push(Compiled {
            spec: spec.clone(),
            code,
            verified,
            offset,
        });
        offset += len;
    }
    Ok(Emitted {
        kernels,
        emit_time,
        verify_time: t1.elapsed(),
    })
}
