//! The `pulsar` command line: argument parsing only; the work is done in
//! `pulsar::commands`.

use clap::{Parser, Subcommand, ValueEnum};
use pulsar::commands;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "pulsar",
    version,
    about = "Gemma inference on CPU with JIT-generated x86-64 kernels"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum EngineKind {
    /// Plain-Rust f32 forward pass (the correctness oracle).
    Reference,
}

#[derive(Clone, Copy, ValueEnum)]
enum WeightDtype {
    F16,
    Bf16,
}

#[derive(Subcommand)]
enum Command {
    /// Measure prefill and decode speed against the machine's read bandwidth.
    Bench {
        /// Model: a .gguf file or a Hugging Face folder (default: Gemma 3 270M).
        #[arg(short, long, conflicts_with = "shape")]
        model: Option<PathBuf>,
        /// Benchmark a known shape on random weights instead (gemma-2b, gemma3-270m).
        #[arg(long)]
        shape: Option<String>,
        /// Packed weight format (default: bf16 checkpoints stay bf16, the rest f16).
        #[arg(long, value_enum)]
        dtype: Option<WeightDtype>,
        /// Worker threads, the caller included.
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
        /// Prompt tokens for the prefill measurement.
        #[arg(long, default_value_t = 512)]
        pp: usize,
        /// Generated tokens for the decode measurement.
        #[arg(long, default_value_t = 128)]
        tg: usize,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write raw little-endian f32 logits of a token sequence to a file.
    Logits {
        /// Model: a .gguf file or a Hugging Face folder (default: Gemma 3 270M, fetched once).
        #[arg(short, long)]
        model: Option<PathBuf>,
        /// Comma-separated token ids, e.g. 2,818,5279.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// Logits of every position ([positions, vocab]) instead of the last ([vocab]).
        #[arg(long)]
        all: bool,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, value_enum, default_value = "reference")]
        engine: EngineKind,
    },
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Logits {
            model,
            tokens,
            all,
            output,
            engine: EngineKind::Reference,
        } => commands::resolve_model(model.as_deref()).and_then(|model| {
            commands::logits::run(&commands::logits::LogitsArgs {
                model: &model,
                tokens: &tokens,
                all,
                output: &output,
            })
        }),
        Command::Bench {
            model,
            shape,
            dtype,
            threads,
            pp,
            tg,
            json,
        } => commands::bench_command(
            model.as_deref(),
            shape.as_deref(),
            dtype.map(|d| match d {
                WeightDtype::F16 => pulsar::engine::packed::WeightFormat::F16,
                WeightDtype::Bf16 => pulsar::engine::packed::WeightFormat::BF16,
            }),
            threads,
            &commands::bench::BenchArgs {
                prompt_tokens: pp,
                generate_tokens: tg,
                json,
            },
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pulsar: {e:#}");
            ExitCode::FAILURE
        }
    }
}
