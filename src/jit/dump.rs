//! `pulsar dump` and `pulsar tune`: show what the JIT plans and generates.

use super::cpu::{CpuCaps, Isa};
use super::dims::{ModelDims, load_dims};
use super::kernels::{Compiled, emit_and_verify};
use super::plan::{Plan, PlanOptions, plan};
use super::verify::format_instr;
use crate::fs_atomic::write_atomic;
use crate::model::fetch::default_model_path;
use anyhow::{Context, Result, bail};
use iced_x86::{Decoder, DecoderOptions, Instruction};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Clone, clap::Args)]
pub struct DumpArgs {
    /// Model .gguf or a bare HF config.json (shape only); default: the cached gemma-3-270m
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Write KERNEL.bin and KERNEL.asm for every kernel into this directory
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print a JSON summary instead of listings
    #[arg(long)]
    pub json: bool,
    /// Highest ISA the kernels may use
    #[arg(long = "max-isa", default_value = "avx512")]
    pub max_isa: Isa,
    /// Worker threads to plan for (0 = all cores)
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

#[derive(Debug, Clone, clap::Args)]
pub struct TuneArgs {
    #[command(flatten)]
    pub common: DumpArgs,
    /// Also time the GEMV kernels on synthetic weights (GB/s of weight traffic)
    #[arg(long, hide = true)]
    pub measure: bool,
}

fn dims_for(model: &Option<PathBuf>) -> Result<(ModelDims, PathBuf)> {
    let path = match model {
        Some(p) => p.clone(),
        None => default_model_path()?,
    };
    if !path.exists() {
        bail!(
            "model {} not found; pass -m PATH (a .gguf or a config.json){}",
            path.display(),
            if model.is_none() {
                ", or download the default model into that path"
            } else {
                ""
            }
        );
    }
    Ok((load_dims(&path)?, path))
}

fn options(a: &DumpArgs) -> PlanOptions {
    PlanOptions {
        max_isa: a.max_isa,
        threads: a.threads,
        ..PlanOptions::default()
    }
}

/// Intel-syntax listing: offset, bytes, instruction.
pub fn listing(code: &[u8]) -> String {
    let mut out = String::new();
    let mut dec = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    while dec.can_decode() {
        dec.decode_out(&mut ins);
        let s = ins.ip() as usize;
        let hex: String = code[s..s + ins.len()]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let _ = writeln!(out, "{s:04x}  {hex:<30}  {}", format_instr(&ins));
    }
    out
}

#[derive(serde::Serialize)]
struct JsonKernel<'a> {
    name: &'a str,
    bytes: usize,
    instructions: usize,
    spec: &'a super::plan::KernelSpec,
}

#[derive(serde::Serialize)]
struct JsonDump<'a> {
    kernels: Vec<JsonKernel<'a>>,
    total_bytes: usize,
    budget_bytes: usize,
    isa: &'static str,
    verified: bool,
    emit_verify_ms: f64,
    model: String,
}

/// Writes to stdout; a closed pipe (`pulsar dump | head`) is not an error.
fn write_stdout(text: &str) -> Result<()> {
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("cannot write to stdout"),
    }
}

pub fn run_dump_command(args: &DumpArgs) -> Result<()> {
    let mut out = String::new();
    let caps = CpuCaps::detect();
    if let Some(msg) = caps.baseline_message() {
        bail!("{msg}; there is no JIT code to dump on this CPU");
    }
    let (dims, path) = dims_for(&args.model)?;
    let t0 = Instant::now();
    let plan = plan(&dims, &caps, &options(args))?;
    let emitted = emit_and_verify(&plan, &caps, args.max_isa)?;
    let elapsed = t0.elapsed();
    let kernels = &emitted.kernels;
    let total: usize = kernels.iter().map(|k| k.code.len()).sum();
    if args.json {
        let j = JsonDump {
            kernels: kernels
                .iter()
                .map(|k| JsonKernel {
                    name: &k.spec.name,
                    bytes: k.code.len(),
                    instructions: k.verified.instructions,
                    spec: &k.spec,
                })
                .collect(),
            total_bytes: total,
            budget_bytes: plan.budget_bytes,
            isa: plan.isa.name(),
            verified: true,
            emit_verify_ms: elapsed.as_secs_f64() * 1e3,
            model: path.display().to_string(),
        };
        writeln!(out, "{}", serde_json::to_string_pretty(&j)?)?;
    } else {
        writeln!(out, "model {}  ({dims:?})", path.display())?;
        for k in kernels {
            writeln!(
                out,
                "\n== {}  {} bytes, {} instructions, offset {:#x}\n   spec: {}\n   used for: {}",
                k.spec.name,
                k.code.len(),
                k.verified.instructions,
                k.offset,
                serde_json::to_string(&k.spec.kind)?,
                k.spec.used_for.join("; ")
            )?;
            write!(out, "{}", listing(&k.code))?;
        }
        writeln!(
            out,
            "\ntotal {total} of {} bytes budget, isa {}, all {} kernels verified",
            plan.budget_bytes,
            plan.isa.name(),
            kernels.len()
        )?;
        for n in &plan.notes {
            writeln!(out, "note: {n}")?;
        }
        writeln!(out, "stays in Rust: {}", plan.not_jitted.join(", "))?;
    }
    write_stdout(&out)?;
    if let Some(dir) = &args.out {
        write_out(dir, kernels)?;
    }
    // Timing goes to stderr so --json stays machine-readable.
    eprintln!(
        "plan+emit+verify {:.3} ms (emit {:.3} ms, verify {:.3} ms)",
        elapsed.as_secs_f64() * 1e3,
        emitted.emit_time.as_secs_f64() * 1e3,
        emitted.verify_time.as_secs_f64() * 1e3
    );
    Ok(())
}

fn write_out(dir: &Path, kernels: &[Compiled]) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create --out directory {}", dir.display()))?;
    for k in kernels {
        let bin = dir.join(format!("{}.bin", k.spec.name));
        write_atomic(&bin, &k.code)?;
        let asm = dir.join(format!("{}.asm", k.spec.name));
        write_atomic(&asm, listing(&k.code).as_bytes())?;
        eprintln!(
            "objdump -D -b binary -mi386:x86-64 -M intel {}",
            bin.display()
        );
    }
    Ok(())
}

fn print_plan(out: &mut String, caps: &CpuCaps, dims: &ModelDims, plan: &Plan) -> Result<()> {
    writeln!(out, "cpu: {caps}")?;
    writeln!(out, "model: {dims:?}")?;
    writeln!(
        out,
        "isa: {}  threads: {}  k_chunk: {}",
        plan.isa.name(),
        plan.threads,
        plan.k_chunk
    )?;
    for (k, b) in plan.kernels.iter().zip(&plan.kernel_bytes) {
        writeln!(
            out,
            "  {:<32} {:>5} B  {}",
            k.name,
            b,
            k.used_for.join("; ")
        )?;
    }
    writeln!(
        out,
        "  total {} of {} B",
        plan.total_bytes(),
        plan.budget_bytes
    )?;
    for m in &plan.matrices {
        writeln!(
            out,
            "  {:<16} {:>6} x {:<6} {}  threads {:?}",
            m.tensor, m.rows, m.k, m.gemv, m.thread_rows
        )?;
    }
    for n in &plan.notes {
        writeln!(out, "note: {n}")?;
    }
    writeln!(out, "stays in Rust: {}", plan.not_jitted.join(", "))?;
    Ok(())
}

pub fn run_tune_command(args: &TuneArgs) -> Result<()> {
    let mut out = String::new();
    let caps = CpuCaps::detect();
    if let Some(msg) = caps.baseline_message() {
        writeln!(out, "cpu: {caps}\n{msg}")?;
        return write_stdout(&out);
    }
    let (dims, _) = dims_for(&args.common.model)?;
    let plan = plan(&dims, &caps, &options(&args.common))?;
    print_plan(&mut out, &caps, &dims, &plan)?;
    write_stdout(&out)?;
    if args.measure {
        super::measure::measure_gemv(&plan, &caps, args.common.max_isa)?;
        super::measure::measure_gemm(&plan, &caps, args.common.max_isa)?;
    }
    Ok(())
}
