//! `pulsar tune --measure`: GEMV throughput in isolation, on one thread and
//! on the plan's threads, on synthetic weights larger than L3 so the
//! numbers reflect DRAM streaming. Best of several calls (the machine may
//! be shared), next to a plain Rust read of the same bytes, on as many
//! threads, as the bandwidth reference.

use crate::engine::q8_input::{InputPrecision, Q8Input};
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::emit::gemm_quant::TOKENS;
use crate::jit::emit::gemv;
use crate::jit::kernels::{Gemm, GemmQuant, Gemv, GemvQuant, KernelSet};
use crate::jit::plan::{KernelKind, Plan};
use crate::model::quant_blocks::{self, QuantType};
use crate::model::row_blocks;
use anyhow::{Context, Result};
use std::ops::Range;
use std::time::Instant;

/// Bytes of synthetic weights: larger than L3, so DRAM streaming is timed.
/// `PULSAR_MEASURE_KIB` sets another size, e.g. 512 (L2-resident) to time
/// the kernels' arithmetic alone.
fn weight_bytes() -> usize {
    std::env::var("PULSAR_MEASURE_KIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(256 << 20, |kib| kib.max(64) << 10)
}
const REPS: usize = 7;

fn best_of(mut f: impl FnMut()) -> f64 {
    f();
    (0..REPS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Wrapping sum of all words in 32 independent u16 lanes: the compiler turns
/// this into packed adds, so the loop is bound by loads alone.
fn read_all(w: &[u16]) -> u64 {
    let mut acc = [0u16; 32];
    for c in w.chunks_exact(32) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(v);
        }
    }
    acc.iter().map(|&v| v as u64).sum()
}

pub fn measure_gemv(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<()> {
    let set = KernelSet::build(plan, caps, max_isa)?;
    let w: Vec<u16> = (0..weight_bytes() / 2)
        .map(|i| half::f16::from_f32((i % 7) as f32 * 0.01).to_bits())
        .collect();
    let mut sink = 0u64;
    let secs = best_of(|| sink = sink.wrapping_add(read_all(std::hint::black_box(&w))));
    println!(
        "measure {:<28} {:>6.1} GB/s  (plain Rust read of {} MiB, 1 thread; checksum {})",
        "baseline_read",
        weight_bytes() as f64 / secs / 1e9,
        weight_bytes() >> 20,
        sink % 10
    );
    if plan.threads > 1 {
        // The same read split over the plan's threads: the ceiling of the
        // multi-thread figures below.
        let part = w.len().div_ceil(plan.threads).next_multiple_of(32);
        let secs = best_of(|| {
            std::thread::scope(|sc| {
                let parts: Vec<_> = w
                    .chunks(part)
                    .map(|c| sc.spawn(move || read_all(std::hint::black_box(c))))
                    .collect();
                for p in parts {
                    sink = sink.wrapping_add(p.join().unwrap_or(0));
                }
            })
        });
        println!(
            "measure {:<28} {:>6.1} GB/s  ({} threads; checksum {})",
            "baseline_read",
            weight_bytes() as f64 / secs / 1e9,
            plan.threads,
            sink % 10
        );
    }
    for spec in &plan.kernels {
        let KernelKind::Gemv(g) = &spec.kind else {
            continue;
        };
        let gemv = set
            .get::<Gemv>((g.wt, g.k))
            .context("planned GEMV missing from the kernel set")?;
        let rows = weight_bytes() / (row_blocks::padded_cols(g.k) * 2) / gemv::ROWS * gemv::ROWS;
        let len = row_blocks::padded_len(rows, g.k);
        let x = vec![0.5f32; g.k];
        let mut y = vec![0f32; rows];
        let run = |part: &mut [f32], r: Range<usize>| gemv.run_part(&w[..len], &x, part, r);
        let secs = time_split(&mut y, 1, gemv::ROWS, run)?;
        println!(
            "measure {:<28} {:>6.1} GB/s  ({rows} rows x K {}, {:.2} ms/call, 1 thread)",
            spec.name,
            (rows * g.k * 2) as f64 / secs / 1e9,
            g.k,
            secs * 1e3
        );
        if plan.threads > 1 {
            // Rows split as the engine would split them, one thread each.
            let secs = time_split(&mut y, plan.threads, gemv::ROWS, run)?;
            println!(
                "measure {:<28} {:>6.1} GB/s  ({} threads)",
                spec.name,
                (rows * g.k * 2) as f64 / secs / 1e9,
                plan.threads
            );
        }
    }
    Ok(())
}

/// Best time of `run` over `y`'s rows split into `threads` parts that
/// start on `block`s, one scoped thread each, or in this thread alone for
/// one part (a spawn would weigh on small sizes). The first error a part
/// returns is returned.
fn time_split<E: Send>(
    y: &mut [f32],
    threads: usize,
    block: usize,
    run: impl Fn(&mut [f32], Range<usize>) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<f64, E> {
    let parts = crate::jit::plan::split_rows(y.len(), threads, block);
    let mut err = None;
    let secs = best_of(|| {
        if parts.len() == 1 {
            if let Err(e) = run(y, parts[0].clone()) {
                err = Some(e);
            }
            return;
        }
        std::thread::scope(|sc| {
            let mut rest: &mut [f32] = y;
            let mut handles = Vec::new();
            for r in parts.iter().cloned() {
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
                rest = tail;
                let run = &run;
                handles.push(sc.spawn(move || run(part, r)));
            }
            for h in handles {
                if let Ok(Err(e)) = h.join() {
                    err = Some(e);
                }
            }
        });
    });
    err.map_or(Ok(secs), Err)
}

/// Best time of `run` over `parts`, one scoped thread each, every thread
/// writing its own output of `out_len` values (a kernel given a row range
/// and the whole y, as the engine's threads share one). The first error a
/// part returns is returned.
fn time_own_outputs<E: Send>(
    parts: &[Range<usize>],
    out_len: usize,
    run: impl Fn(&mut [f32], Range<usize>) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<f64, E> {
    let mut outs: Vec<Vec<f32>> = parts.iter().map(|_| vec![0f32; out_len]).collect();
    let mut err = None;
    let secs = best_of(|| {
        std::thread::scope(|sc| {
            let handles: Vec<_> = parts
                .iter()
                .zip(outs.iter_mut())
                .map(|(r, y)| {
                    let (run, r) = (&run, r.clone());
                    sc.spawn(move || run(y, r))
                })
                .collect();
            for h in handles {
                if let Ok(Err(e)) = h.join() {
                    err = Some(e);
                }
            }
        })
    });
    err.map_or(Ok(secs), Err)
}

/// Integer GEMV throughput for each planned quantized type and K, on
/// synthetic blocks (random quants, small scales) as large as the 16-bit
/// measurement's weights: GB/s of quantized weight bytes, on 1 thread and
/// on the plan's threads.
pub fn measure_gemv_quant(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<()> {
    let set = KernelSet::build(plan, caps, max_isa)?;
    for spec in &plan.kernels {
        let KernelKind::GemvQuant(g) = &spec.kind else {
            continue;
        };
        // Each K a matrix of the plan multiplies with this kernel.
        let mut ks: Vec<usize> = plan
            .matrices
            .iter()
            .filter(|m| m.gemv == spec.name)
            .map(|m| m.k)
            .collect();
        ks.sort_unstable();
        ks.dedup();
        for k in ks {
            measure_one_quant(&set, spec, g.q, k, plan.threads)?;
        }
    }
    Ok(())
}

fn measure_one_quant(
    set: &KernelSet,
    spec: &crate::jit::plan::KernelSpec,
    q: QuantType,
    k: usize,
    threads: usize,
) -> Result<()> {
    let gemv = set
        .get::<GemvQuant>((q, k))
        .context("planned GEMV missing from the kernel set")?;
    let block = q.block_bytes(k);
    let rows = weight_bytes() / block * quant_blocks::BLOCK_ROWS;
    let w = synthetic_blocks(rows / quant_blocks::BLOCK_ROWS * block)?;
    let x: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let xq = Q8Input::quantize(&x, k);
    let mut y = vec![0f32; rows];
    let run = |part: &mut [f32], r: Range<usize>| gemv.run_part(&w, xq.token(0), part, r);
    for threads in [1, threads] {
        let secs = time_split(&mut y, threads, quant_blocks::BLOCK_ROWS, run)?;
        println!(
            "measure {:<28} {:>6.1} GB/s  ({rows} rows x K {k}, {:.2} ms/call, {threads} thread{})",
            spec.name,
            w.len() as f64 / secs / 1e9,
            secs * 1e3,
            if threads == 1 { "" } else { "s" }
        );
    }
    Ok(())
}

/// The integer GEMMs over 16-row blocks that take single tokens (Q8_0x16's,
/// the LM head's; with VNNI Q5_0x16's, the layers'; Q4_K's and Q6_K's) at
/// 1, 2, 4 and 8
/// tokens of one tile, 1 thread: GB/s of weight bytes and each step's cost
/// against one token's, the m-curve of `bench --m-curve` for each kernel
/// alone. With `PULSAR_MEASURE_KIB` small enough for L2, it times the
/// arithmetic.
pub fn measure_gemm_quant(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<()> {
    let set = KernelSet::build(plan, caps, max_isa)?;
    let peak = vnni_peak(caps);
    if let Some(gmacs) = peak {
        println!(
            "measure {:<28} {gmacs:>6.1} G MAC/s  ({VNNI_CHAINS} independent chains of vpdpbusd zmm, 64 MACs each, 1 thread)",
            "vnni_peak"
        );
    }
    for q in [
        QuantType::Q8_0x16,
        QuantType::Q5_0x16,
        QuantType::Q4Kx16,
        QuantType::Q5Kx16,
        QuantType::Q6Kx16,
    ] {
        measure_rows_as_lanes_gemm(plan, &set, q, peak)?;
    }
    Ok(())
}

/// Independent `vpdpbusd` chains of the peak's loop: more than its
/// latency times the instructions issued a cycle, so none waits.
const VNNI_CHAINS: usize = 16;

/// One thread's peak of 8-bit multiply-adds with AVX-512 VNNI (G MAC/s):
/// a loop of [`VNNI_CHAINS`] independent `vpdpbusd zmm`s, what the integer
/// GEMMs' share of the peak is measured against. None without VNNI.
fn vnni_peak(caps: &CpuCaps) -> Option<f64> {
    if !caps.avx512_vnni || !std::arch::is_x86_feature_detected!("avx512vnni") {
        return None;
    }
    const ROUNDS: u64 = 4_000_000;
    // SAFETY: the CPU has AVX-512 F and VNNI (checked above).
    let secs = best_of(|| unsafe { vpdpbusd_chains(ROUNDS) });
    Some((ROUNDS * VNNI_CHAINS as u64 * 64) as f64 / secs / 1e9)
}

/// `rounds` rounds of 16 `vpdpbusd zmm`, each into its own accumulator.
///
/// # Safety
/// The CPU must have AVX-512 F and VNNI.
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vpdpbusd_chains(rounds: u64) {
    // SAFETY: registers only (all clobbers declared), no memory, no stack.
    unsafe {
        std::arch::asm!(
            "vpxord zmm0, zmm0, zmm0",
            "2:",
            "vpdpbusd zmm0, zmm30, zmm31",
            "vpdpbusd zmm1, zmm30, zmm31",
            "vpdpbusd zmm2, zmm30, zmm31",
            "vpdpbusd zmm3, zmm30, zmm31",
            "vpdpbusd zmm4, zmm30, zmm31",
            "vpdpbusd zmm5, zmm30, zmm31",
            "vpdpbusd zmm6, zmm30, zmm31",
            "vpdpbusd zmm7, zmm30, zmm31",
            "vpdpbusd zmm8, zmm30, zmm31",
            "vpdpbusd zmm9, zmm30, zmm31",
            "vpdpbusd zmm10, zmm30, zmm31",
            "vpdpbusd zmm11, zmm30, zmm31",
            "vpdpbusd zmm12, zmm30, zmm31",
            "vpdpbusd zmm13, zmm30, zmm31",
            "vpdpbusd zmm14, zmm30, zmm31",
            "vpdpbusd zmm15, zmm30, zmm31",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) rounds => _,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
            out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
            out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
            out("zmm30") _, out("zmm31") _,
            options(nostack, nomem),
        );
    }
}

/// A GEMM's rate in multiply-adds (the tokens' own, not the absent slots
/// a pass computes on zeros) per thread, and its share of the VNNI peak.
fn mac_rate(
    rows: usize,
    k: usize,
    ntok: usize,
    secs: f64,
    threads: usize,
    peak: Option<f64>,
) -> String {
    let gmacs = (rows * k * ntok) as f64 / secs / 1e9 / threads as f64;
    match peak {
        Some(p) => format!(
            "{gmacs:.1} G MAC/s a thread = {:.0}% of the VNNI peak",
            100.0 * gmacs / p
        ),
        None => format!("{gmacs:.1} G MAC/s a thread"),
    }
}

fn measure_rows_as_lanes_gemm(
    plan: &Plan,
    set: &KernelSet,
    q: QuantType,
    peak: Option<f64>,
) -> Result<()> {
    let Some(spec) = plan
        .kernels
        .iter()
        .find(|s| matches!(&s.kind, KernelKind::GemmQuant(g) if g.q == q))
    else {
        return Ok(());
    };
    // The smallest K a matrix multiplies with it: the LM head's.
    let Some(k) = plan
        .matrices
        .iter()
        .filter(|m| m.gemm == spec.name)
        .map(|m| m.k)
        .min()
    else {
        return Ok(());
    };
    let gemm = set
        .get::<GemmQuant>((q, k))
        .context("planned quantized GEMM missing from the kernel set")?;
    let rows = weight_bytes() / q.block_bytes(k) * q.block_rows();
    let w = synthetic_blocks(rows / q.block_rows() * q.block_bytes(k))?;
    let x: Vec<f32> = (0..TOKENS * k)
        .map(|i| (i % 13) as f32 * 0.1 - 0.6)
        .collect();
    let span = gemm.input_span;
    let xq = Q8Input::quantize_with(&x, k, InputPrecision::Bits8, span);
    // A call of one token takes its own tile where the kernel asks for it
    // (`GemmQuant::single_token_layout`).
    let xq1 = Q8Input::quantize_with(&x[..k], k, InputPrecision::Bits8, span);
    let tile_of = |ntok: usize| match ntok {
        1 => xq1.tile_for(0, gemm.single_token_layout).0,
        _ => xq.tile(0).0,
    };
    let mut y = vec![0f32; TOKENS * rows];
    let mut one_token = None;
    for ntok in [1usize, 2, 4, 8] {
        let tile = tile_of(ntok);
        let mut err = None;
        let secs = best_of(|| {
            if let Err(e) = gemm.run(&w, tile, ntok, &mut y, rows, 0..rows) {
                err = Some(e);
            }
        });
        if let Some(e) = err {
            return Err(e.into());
        }
        let base = *one_token.get_or_insert(secs);
        println!(
            "measure {:<28} {:>6.1} GB/s  ({rows} rows x K {k}, {ntok} token(s), {:.2} ms/call = {:.2}x one token, 1 thread; {})",
            spec.name,
            w.len() as f64 / secs / 1e9,
            secs * 1e3,
            secs / base,
            mac_rate(rows, k, ntok, secs, 1, peak)
        );
    }
    if plan.threads > 1 {
        // One token (decode's LM head) and a tile's 8 (a verify step's)
        // with the rows split over the plan's threads, each writing its own
        // copy of y.
        let parts = crate::jit::plan::split_rows(rows, plan.threads, q.block_rows());
        let mut one_token = None;
        for ntok in [1, TOKENS] {
            let tile = tile_of(ntok);
            let secs = time_own_outputs(&parts, TOKENS * rows, |y, r| {
                gemm.run(&w, tile, ntok, y, rows, r)
            })?;
            let base = *one_token.get_or_insert(secs);
            println!(
                "measure {:<28} {:>6.1} GB/s  ({ntok} token(s), {:.2}x one token, {} threads; {})",
                spec.name,
                w.len() as f64 / secs / 1e9,
                secs / base,
                plan.threads,
                mac_rate(rows, k, ntok, secs, plan.threads, peak)
            );
        }
    }
    Ok(())
}

/// Random quantized bytes for timing (every f16 scale, any 2 bytes, a
/// normal number, so no subnormal slows the arithmetic), in the kind of
/// memory the engine's packed weights live in: anonymous and advised for
/// huge pages. On a Vec's 4 KiB pages the one-token K-quant kernels
/// streamed about a sixth slower (docs/performance.md), so the figures
/// below blamed the kernels for the pages.
fn synthetic_blocks(len: usize) -> Result<memmap2::MmapMut> {
    let mut map =
        memmap2::MmapMut::map_anon(len.max(1)).context("anonymous memory for the weights")?;
    #[cfg(target_os = "linux")]
    {
        // Advice only: a kernel without THP simply ignores it.
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    let mut seed = 0x9E37_79B9u32;
    for b in map.iter_mut() {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        // Bytes in 8..56 make every f16 scale's exponent 2..13.
        *b = 8 + (seed >> 24) as u8 % 48;
    }
    Ok(map)
}

/// Prefill GEMM throughput (GFLOP/s) for each planned K, at the engine's
/// prefill chunk and at a small token count, on 1 and 2 threads (each
/// thread takes half the rows): shows how far the kernel is from the FMA
/// peak and whether a second core slows it (shared L3, memory).
pub fn measure_gemm(plan: &Plan, caps: &CpuCaps, max_isa: Isa) -> Result<()> {
    let set = KernelSet::build(plan, caps, max_isa)?;
    for spec in &plan.kernels {
        let KernelKind::Gemm(g) = &spec.kind else {
            continue;
        };
        let gemm = set
            .get::<Gemm>((g.wt, g.k))
            .context("planned GEMM missing from the kernel set")?;
        let rows = ((8usize << 20) / (g.k * 2)).max(8) / 8 * 8;
        let w: Vec<u16> = (0..row_blocks::padded_len(rows, g.k))
            .map(|i| half::f16::from_f32((i % 5) as f32 * 0.01).to_bits())
            .collect();
        for tokens in [48usize, crate::jit::blocking::PREFILL_CHUNK] {
            let x = vec![0.25f32; tokens * g.k];
            for threads in [1usize, 2] {
                let parts: Vec<Range<usize>> = (0..threads)
                    .map(|i| rows / threads * i..rows / threads * (i + 1))
                    .collect();
                let secs = time_own_outputs(&parts, tokens * rows, |y, part| {
                    gemm.run(&w, &x, tokens, y, rows, part)
                })?;
                println!(
                    "measure {:<28} {:>6.1} GFLOP/s  ({rows} rows x K {} x {tokens} tokens, {threads} thread(s))",
                    spec.name,
                    2.0 * (rows * g.k * tokens) as f64 / secs / 1e9,
                    g.k
                );
            }
        }
    }
    Ok(())
}
