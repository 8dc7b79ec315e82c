//! `pulsar tune --measure`: GEMV throughput in isolation, single thread, on
//! synthetic weights larger than L3 so the numbers reflect DRAM streaming.

use super::cpu::{CpuCaps, Isa};
use super::kernels::KernelSet;
use super::plan::{KernelKind, Plan};
use anyhow::{Context, Result};
use std::time::Instant;

pub fn measure_gemv(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<()> {
    let set = KernelSet::build(plan, caps, max_isa)?;
    for spec in &plan.kernels {
        let KernelKind::Gemv(g) = &spec.kind else { continue };
        let gemv = set.gemv(g.wt, g.k).context("planned GEMV missing from the kernel set")?;
        // ~256 MiB of weights: far beyond L3, so every call streams from DRAM.
        let rows = ((256usize << 20) / (g.k * 2)).max(4);
        let w: Vec<u16> = (0..rows * g.k).map(|i| half::f16::from_f32((i % 7) as f32 * 0.01).to_bits()).collect();
        let x = vec![0.5f32; g.k];
        let mut y = vec![0f32; rows];
        gemv.run(&w, &x, &mut y, 0..rows)?;
        let reps = 5;
        let t = Instant::now();
        for _ in 0..reps {
            gemv.run(&w, &x, &mut y, 0..rows)?;
        }
        let secs = t.elapsed().as_secs_f64() / reps as f64;
        let gbs = (rows * g.k * 2) as f64 / secs / 1e9;
        println!("measure {:<28} rows {rows:>7} K {:>6}: {:.2} ms/call, {gbs:.1} GB/s weights (1 thread)", spec.name, g.k, secs * 1e3);
    }
    Ok(())
}
