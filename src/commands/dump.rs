//! `pulsar dump` and `pulsar tune`: show what the JIT plans and generates
//! for a model, with the plan options the engine itself would use.

use super::tune_measure;
use crate::engine::autotune;
use crate::engine::fast::{EngineOptions, FastEngine, LaunchTuning, WeightFormats};
use crate::engine::jit_kernels::plan_options;
use crate::fs_atomic::write_atomic;
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::dims::ModelDims;
use crate::jit::kernels::{Compiled, KernelSet, emit_and_verify};
use crate::jit::plan::{Plan, PlanOptions, plan};
use crate::jit::verify::format_instr;
use crate::model::config::ModelConfig;
use crate::model::fetch::default_model_path;
use crate::model::presets;
use crate::model::source::ModelSource;
use anyhow::{Context, Result, bail};
use iced_x86::{Decoder, DecoderOptions, Instruction};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What `dump` and `tune` share.
#[derive(Debug, Clone)]
pub struct DumpArgs {
    /// A .gguf file, a Hugging Face folder, or a bare config.json (shape
    /// only); `None`: the default model.
    pub model: Option<PathBuf>,
    /// A known shape (`presets::SHAPES`) instead of a model: its plan,
    /// without weights.
    pub shape: Option<String>,
    /// Write KERNEL.bin and KERNEL.asm for every kernel into this folder.
    pub out: Option<PathBuf>,
    /// A JSON summary instead of listings.
    pub json: bool,
    /// Highest ISA the kernels may use.
    pub max_isa: Isa,
    /// Worker threads to plan for (0 = all cores).
    pub threads: usize,
    /// The formats the engine would keep the matrices in.
    pub dtype: super::Dtype,
    /// `--input-bits` (part of a stored tuning's key) and the other
    /// shared flags.
    pub flags: super::SharedFlags,
}

#[derive(Debug, Clone)]
pub struct TuneArgs {
    pub common: DumpArgs,
    /// Also time the GEMV and GEMM kernels on synthetic weights.
    pub measure: bool,
}

/// The model's shape and the plan options the engine would use for it: a
/// model file gets its weight formats from `FastEngine::weight_formats`; a
/// bare config.json has no weights, so FP16 is assumed.
fn plan_inputs(args: &DumpArgs) -> Result<(ModelDims, PlanOptions, PathBuf)> {
    let (dims, opts, path, _) = plan_inputs_with_model(args)?;
    Ok((dims, opts, path))
}

/// A model file's opened source and weight formats, beside what the plan
/// needs (`None` for a bare config.json).
type ModelFormats = Option<(ModelSource, WeightFormats)>;

fn plan_inputs_with_model(
    args: &DumpArgs,
) -> Result<(ModelDims, PlanOptions, PathBuf, ModelFormats)> {
    let threads = if args.threads == 0 {
        CpuCaps::detect().cores.max(1)
    } else {
        args.threads
    };
    // Q8_0 in the layout of the kernels listed (--max-isa may differ from
    // what the engine would run).
    let layouts = crate::jit::plan::QuantLayouts::for_cpu(&CpuCaps::detect(), args.max_isa);
    // A shape or a bare config.json has no weights: FP16 is assumed
    // unless --dtype names a format.
    if let Some(name) = &args.shape {
        let Some(config) = presets::shape(name) else {
            bail!(
                "unknown --shape {name:?}; known shapes: {}",
                presets::SHAPES.join(", ")
            );
        };
        let dims = ModelDims::from(&config);
        let opts = PlanOptions {
            max_isa: args.max_isa,
            ..plan_options(
                &config,
                &args.dtype.shape_formats(&config).with_layouts(&layouts),
                threads,
            )
        };
        return Ok((dims, opts, PathBuf::from(format!("shape {name}")), None));
    }
    let path = model_path(&args.model)?;
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let (config, formats, model) = if is_json {
        let config = ModelConfig::from_hf_config(&path)?;
        let formats = args.dtype.shape_formats(&config).with_layouts(&layouts);
        (config, formats, None)
    } else {
        let src = ModelSource::open(&path)?;
        let opts = args.dtype.fast_options(threads, 1, false);
        let formats = FastEngine::weight_formats(&src, &opts)?.with_layouts(&layouts);
        (src.config.clone(), formats.clone(), Some((src, formats)))
    };
    let dims = ModelDims::from(&config);
    dims.validate()
        .with_context(|| format!("in {}", path.display()))?;
    let opts = PlanOptions {
        max_isa: args.max_isa,
        ..plan_options(&config, &formats, threads)
    };
    Ok((dims, opts, path, model))
}

fn model_path(model: &Option<PathBuf>) -> Result<PathBuf> {
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
    Ok(path)
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
    spec: &'a crate::jit::plan::KernelSpec,
}

#[derive(serde::Serialize)]
struct JsonDump<'a> {
    kernels: Vec<JsonKernel<'a>>,
    total_bytes: usize,
    budget_bytes: usize,
    isa: String,
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
    let (dims, opts, path) = plan_inputs(args)?;
    let t0 = Instant::now();
    let plan = plan(&dims, &caps, &opts)?;
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
            isa: plan.isa_description(),
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
            plan.isa_description(),
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

/// What the launch tuning has stored for this model, CPU and thread
/// count; with `measure`, a full search on the real weights (more rounds
/// than a launch affords), printed as a table and stored for later runs.
fn launch_tuning_report(
    src: ModelSource,
    formats: &WeightFormats,
    args: &DumpArgs,
    threads: usize,
    measure: bool,
) -> Result<()> {
    let config = src.config.clone();
    let inputs = args.flags.input_precision;
    let key = autotune::tuning_key(&config, formats, threads, inputs);
    let dir = super::tuning_dir()?;
    let path = autotune::entry_path(&dir, &key);
    let mut out = String::new();
    match autotune::load_entry(&path, &key) {
        Ok(Some(entry)) => {
            let t = &entry.tuned;
            let prefill = match (t.prefill_chunk, t.widened_panel_bytes) {
                (None, None) => String::new(),
                (chunk, panel) => format!(
                    ", prefill step {} tokens, widened panel {} B",
                    chunk.map_or("(plan's)".into(), |c| c.to_string()),
                    panel.map_or("(plan's)".into(), |p| p.to_string())
                ),
            };
            writeln!(
                out,
                "tuning: later runs reuse {} (measured in {:.0} ms): quantized GEMV prefetch {} B, \
                 rows shared by exact tokens {} B{prefill}",
                path.display(),
                entry.spent_ms,
                t.quant_prefetch,
                t.shared_rows_bytes
            )?
        }
        Ok(None) => writeln!(
            out,
            "tuning: nothing stored for this CPU, model, formats, threads and binary; the first \
             run measures it (at most {} ms) and stores it in {}",
            autotune::LAUNCH_BUDGET.as_millis(),
            path.display()
        )?,
        Err(e) => writeln!(out, "tuning: {e:#}; the next run measures again")?,
    }
    write_stdout(&out)?;
    if !measure {
        return Ok(());
    }
    // The engine a run opens, with room for the full search's prefill and
    // no launch tuning of its own.
    let options = EngineOptions {
        load: args
            .dtype
            .fast_options(threads, autotune::PREFILL_TOKENS + 8, false),
        input_precision: inputs,
        tuning: LaunchTuning::Off {
            why: "the full search measures".into(),
        },
        verbose: false,
    };
    let plan = FastEngine::plan(std::sync::Arc::new(src), &options)?;
    let formats = plan.formats().clone();
    let key = autotune::tuning_key(&config, &formats, threads, inputs);
    let path = autotune::entry_path(&dir, &key);
    let (mut engine, _) = super::open_fast_engine(plan, "pulsar tune --measure")?;
    let entry = autotune::measure(
        &mut engine,
        &config,
        &formats,
        key,
        None,
        autotune::FULL_ROUNDS,
    )?;
    let mut out = String::new();
    writeln!(
        out,
        "launch tuning, full search ({} rounds, {:.0} ms):",
        autotune::FULL_ROUNDS,
        entry.spent_ms
    )?;
    writeln!(out, "  {:<20} {:>8} {:>12}", "knob", "value", "median ms")?;
    for c in &entry.candidates {
        let chosen = entry.tuned.value_of(&c.knob) == Some(c.value);
        writeln!(
            out,
            "  {:<20} {:>8} {:>12.2}{}",
            c.knob,
            c.value,
            c.median_ms,
            if chosen { "  <- chosen" } else { "" }
        )?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    write_atomic(&path, serde_json::to_string_pretty(&entry)?.as_bytes())?;
    writeln!(out, "stored in {}", path.display())?;
    write_stdout(&out)
}

fn print_plan(out: &mut String, caps: &CpuCaps, dims: &ModelDims, plan: &Plan) -> Result<()> {
    writeln!(out, "cpu: {caps}")?;
    writeln!(out, "model: {dims:?}")?;
    writeln!(
        out,
        "isa: {}  threads: {}",
        plan.isa_description(),
        plan.threads
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
            "  {:<16} {:>6} x {:<6} {}",
            m.tensor, m.rows, m.k, m.gemv
        )?;
    }
    writeln!(out, "blocking (the engine obeys these):")?;
    for r in &plan.blocking_reasons {
        writeln!(out, "  {:<22} {:>7}  {}", r.name, r.value, r.why)?;
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
    let (dims, opts, _, model) = plan_inputs_with_model(&args.common)?;
    let planning = Instant::now();
    let plan = plan(&dims, &caps, &opts)?;
    let plan_ms = planning.elapsed().as_secs_f64() * 1e3;
    let building = Instant::now();
    KernelSet::build(&plan, &caps, args.common.max_isa)?;
    let build_ms = building.elapsed().as_secs_f64() * 1e3;
    print_plan(&mut out, &caps, &dims, &plan)?;
    writeln!(
        out,
        "launch: plan {plan_ms:.1} ms, emit + verify + map {build_ms:.1} ms (every run); \
         launch tuning at most {} ms (first run only, see below)",
        autotune::LAUNCH_BUDGET.as_millis()
    )?;
    write_stdout(&out)?;
    if let Some((src, formats)) = model {
        launch_tuning_report(src, &formats, &args.common, plan.threads, args.measure)?;
    }
    if args.measure {
        tune_measure::measure_gemv(&plan, &caps, args.common.max_isa)?;
        tune_measure::measure_gemv_quant(&plan, &caps, args.common.max_isa)?;
        tune_measure::measure_gemm_quant(&plan, &caps, args.common.max_isa)?;
        tune_measure::measure_gemm(&plan, &caps, args.common.max_isa)?;
    }
    Ok(())
}
