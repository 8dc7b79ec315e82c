//! The `pulsar` command line. Handlers live in library modules; this file
//! only parses arguments and dispatches.

use clap::{Parser, Subcommand};
use pulsar::jit::dump::{DumpArgs, TuneArgs, run_dump_command, run_tune_command};

#[derive(Parser)]
#[command(
    name = "pulsar",
    version,
    about = "CPU inference engine for Gemma models"
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Plan, emit and verify the JIT kernels for a model and print them
    Dump(DumpArgs),
    /// Show the CPU that was detected and the kernel plan for a model
    Tune(TuneArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Commands::Dump(a) => run_dump_command(&a),
        Commands::Tune(a) => run_tune_command(&a),
    }
}
