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

#[derive(Subcommand)]
enum Command {
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pulsar: {e:#}");
            ExitCode::FAILURE
        }
    }
}
