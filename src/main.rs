//! The `pulsar` command line: argument parsing only; the work is done in
//! `pulsar::commands`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use pulsar::chat::conversation::ContextPolicy;
use pulsar::commands::{self, EngineKind};
use pulsar::constrain::ConstraintSpec;
use pulsar::engine::packed::WeightFormat;
use pulsar::engine::q8_input::InputPrecision;
use pulsar::jit::cpu::Isa;
use pulsar::sample::SamplerConfig;
use pulsar::speculative::Speculation;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "pulsar",
    version,
    about = "Gemma inference on CPU with JIT-generated, verified x86-64 kernels",
    long_about = "Gemma inference on CPU with JIT-generated, verified x86-64 kernels.\n\n\
                  Without a subcommand, pulsar chats: the options below are `pulsar chat`'s.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Run the analytic plan: no launch-time measurement, no stored tuning
    /// used.
    #[arg(long, global = true)]
    no_tune: bool,
    /// Print the long start-up notes too (how weights were converted at load).
    #[arg(long, global = true)]
    verbose: bool,
    /// Bits of the inputs to the integer kernels of quantized weights: 8 (one 8-bit level per
    /// value, fastest) or 16 (two 8-bit levels, the value and its rounding error: matches
    /// `--dtype f16` more closely, for about twice the integer work; see docs/quantized-weights.md).
    #[arg(long, global = true, value_enum, default_value = "8")]
    input_bits: InputBitsArg,
    /// `pulsar` alone chats; these are the chat's flags.
    #[command(flatten)]
    chat: ChatCli,
}

#[derive(Clone, Copy, ValueEnum)]
enum InputBitsArg {
    /// One 8-bit level per value.
    #[value(name = "8")]
    Eight,
    /// Two 8-bit levels per value.
    #[value(name = "16")]
    Sixteen,
}

impl From<InputBitsArg> for InputPrecision {
    fn from(bits: InputBitsArg) -> InputPrecision {
        match bits {
            InputBitsArg::Eight => InputPrecision::Bits8,
            InputBitsArg::Sixteen => InputPrecision::TwoLevels,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum EngineArg {
    /// JIT kernels on the thread pool (fast).
    Jit,
    /// Plain-Rust f32 forward pass (the correctness oracle).
    Reference,
}

impl From<EngineArg> for EngineKind {
    fn from(e: EngineArg) -> EngineKind {
        match e {
            EngineArg::Jit => EngineKind::Jit,
            EngineArg::Reference => EngineKind::Reference,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ContextFullArg {
    /// Drop the oldest exchanges, keeping the first (with the -f document).
    Drop,
    /// End the chat with a message.
    Stop,
}

impl From<ContextFullArg> for ContextPolicy {
    fn from(c: ContextFullArg) -> ContextPolicy {
        match c {
            ContextFullArg::Drop => ContextPolicy::DropOldest,
            ContextFullArg::Stop => ContextPolicy::Stop,
        }
    }
}

/// `--dtype` of `convert`: a format, or the file's own types.
#[derive(Clone, Copy, ValueEnum)]
enum ConvertDtypeArg {
    /// The file's own types where an integer kernel reads them (Q8_0, Q5_0, Q4_0), in the kernels' layouts; Q6_K requantized to Q8_0, Q4_K and Q5_K written as they are (loading keeps them as Q5_0 with an offset per 32 values): what `run --dtype native` computes with, loadable zero-copy but for those.
    Native,
    F16,
    Bf16,
    /// Q8_0 (8 bits and an f16 scale per 32 values) where rows are whole 32-value blocks, FP16 elsewhere.
    #[value(name = "q8_0")]
    Q8_0,
    /// Q4_0 (4 bits and an f16 scale per 32 values), as q8_0.
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<ConvertDtypeArg> for commands::convert::Target {
    fn from(d: ConvertDtypeArg) -> commands::convert::Target {
        use commands::convert::Target;
        match d {
            ConvertDtypeArg::Native => Target::Native,
            ConvertDtypeArg::F16 => Target::Format(WeightFormat::F16),
            ConvertDtypeArg::Bf16 => Target::Format(WeightFormat::BF16),
            ConvertDtypeArg::Q8_0 => Target::Format(WeightFormat::Q8_0),
            ConvertDtypeArg::Q4_0 => Target::Format(WeightFormat::Q4_0),
        }
    }
}

/// `--dtype` of the commands that run a model.
#[derive(Clone, Copy, ValueEnum)]
enum RunDtypeArg {
    /// The file's own types where an integer kernel reads them (Q8_0, Q5_0, Q4_0, Q4_K, Q5_K and Q6_K); otherwise Q4_K and Q5_K as Q5_0 with an offset per 32 values, Q6_K requantized to Q8_0, Q5_0 beside both K-quants widened to Q8_0 (said on stderr); 16-bit matrices as FP16.
    Native,
    /// Every matrix widened to FP16.
    F16,
    /// Every matrix as BF16.
    Bf16,
    /// Every matrix quantized to Q8_0 at load where its rows are whole 32-value blocks, the rest FP16.
    #[value(name = "q8_0")]
    Q8_0,
    /// As q8_0, in Q4_0 (4 bits and an f16 scale per 32 values).
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<RunDtypeArg> for commands::Dtype {
    fn from(d: RunDtypeArg) -> commands::Dtype {
        match d {
            RunDtypeArg::Native => commands::Dtype::Native,
            RunDtypeArg::F16 => commands::Dtype::F16,
            RunDtypeArg::Bf16 => commands::Dtype::Bf16,
            RunDtypeArg::Q8_0 => commands::Dtype::Q8_0,
            RunDtypeArg::Q4_0 => commands::Dtype::Q4_0,
        }
    }
}

/// `--spec` of `run`, `chat` and `serve`.
#[derive(Clone, Copy, ValueEnum)]
enum SpecArg {
    /// Draft with a Gemma 4 assistant (multi-token prediction; --draft, or found beside the
    /// model) and verify in one batched step.
    Mtp,
    /// Draft the continuation of the longest earlier n-gram of the context
    /// and verify it in one batched step.
    Ngram,
    /// One token per step.
    Off,
}

impl From<SpecArg> for Speculation {
    fn from(s: SpecArg) -> Speculation {
        match s {
            SpecArg::Mtp => Speculation::mtp(),
            SpecArg::Ngram => Speculation::ngram(),
            SpecArg::Off => Speculation::Off,
        }
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `--threads`: at most the cores there are. More threads than cores spin
/// against each other (4 on 2 cores ran at a quarter of the speed, 999
/// seemed to hang), so a larger count is capped, with one line saying so.
fn threads_arg(text: &str) -> Result<usize, String> {
    let asked: usize = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of threads"))?;
    let cores = default_threads();
    if asked > cores {
        eprintln!("pulsar: --threads {asked}: this machine has {cores} cores; using {cores}");
        return Ok(cores);
    }
    Ok(asked)
}

/// `-n`: a count of tokens, or -1 for no limit but the context (as in
/// llama.cpp).
fn max_new_arg(text: &str) -> Result<usize, String> {
    // Any count a usize holds (generation stops where the context ends).
    if let Ok(n) = text.parse::<usize>() {
        return Ok(n);
    }
    match text.parse::<i64>() {
        Ok(-1) => Ok(usize::MAX),
        Ok(n) if n >= 0 => Ok(n as usize),
        _ => Err(format!(
            "{text:?}: give a number of tokens, or -1 for no limit but the context"
        )),
    }
}

/// `-k`: a count of tokens, 0 or -1 for off (as in llama.cpp).
fn top_k_arg(text: &str) -> Result<usize, String> {
    match text.parse::<i64>() {
        Ok(-1) => Ok(0),
        Ok(k) if k >= 0 => Ok(k as usize),
        _ => Err(format!(
            "{text:?}: give a number of tokens to keep, or 0 or -1 for off"
        )),
    }
}

/// How `run`, `chat`, `logits`, `embed` and `perplexity` run the forward
/// pass.
#[derive(Args)]
struct ForwardArgs {
    /// The forward pass.
    #[arg(long, value_enum, default_value = "jit")]
    engine: EngineArg,
    /// Worker threads, the caller included (at most the cores).
    #[arg(long, default_value_t = default_threads(), value_parser = threads_arg)]
    threads: usize,
    /// Formats of the fast engine's matrices.
    #[arg(long, value_enum, default_value = "native")]
    dtype: RunDtypeArg,
}

impl ForwardArgs {
    fn engine_args(&self, in_place: bool, flags: commands::SharedFlags) -> commands::EngineArgs {
        commands::EngineArgs {
            kind: self.engine.into(),
            threads: self.threads,
            dtype: self.dtype.into(),
            in_place,
            flags,
        }
    }
}

/// Sampling flags shared by `run` and `chat`.
#[derive(Args)]
struct SamplingArgs {
    /// Temperature; 0 always picks the most likely token.
    #[arg(short = 't', long = "temp", default_value_t = 0.7)]
    temperature: f32,
    /// Keep only the K most likely tokens (0 or -1 = off).
    #[arg(short = 'k', long, default_value_t = 40, value_parser = top_k_arg,
          allow_negative_numbers = true)]
    top_k: usize,
    /// Keep the most likely tokens up to this total probability (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens below this fraction of the top token's probability (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalize tokens seen in the last --repeat-last-n (1 = off). Off by default: in the dialogue
    /// format a penalty keeps a base model from writing the "\nUser:" that ends its reply, so
    /// replies ran on and repeated more (tools/chat_defaults.py).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// Random seed (default: from the clock; printed so a run can be repeated).
    #[arg(short, long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
        }
    }

    fn seed(&self) -> u64 {
        self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        })
    }
}

/// The flags `run` and `chat` share.
#[derive(Args)]
struct GenerationCli {
    /// Model: a .gguf file or a Hugging Face folder (default: Gemma 3 270M, fetched once).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// The prompt (`run`; with -f, the question about the file), or one chat message after which `chat` exits.
    #[arg(short, long)]
    prompt: Option<String>,
    /// A UTF-8 text file: `run`'s prompt (or context for -p), or the document that opens a chat.
    #[arg(short, long)]
    file: Option<PathBuf>,
    /// Most tokens to generate (per reply in a chat); -1: until the context is full.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256, value_parser = max_new_arg,
          allow_negative_numbers = true)]
    max_new: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    context: usize,
    /// Instructions for the model: Gemma 4's system turn, or the start of the first user turn
    /// (Gemma 1–3 have no system role).
    #[arg(long)]
    system: Option<String>,
    /// Turn format: `gemma` (Gemma 1–3 and 3n instruction-tuned), `gemma4`, `dialogue` (User:/Assistant:
    /// lines, for base models), a JSON file like templates/gemma.json or a Jinja file
    /// (.jinja). Default: the template the model ships, else gemma4 or gemma by its vocabulary
    /// when its name marks it instruction-tuned (-it), else dialogue.
    #[arg(long, value_name = "NAME|FILE")]
    chat_template: Option<String>,
    /// Let the model think before it answers (Gemma 4: `<|think|>` in the system turn).
    #[arg(long)]
    think: bool,
    /// Print the model's thinking (Gemma 4's thought channel) instead of hiding it.
    #[arg(long)]
    show_thinking: bool,
    /// Text that ends generation when generated (not printed; repeatable). The dialogue format
    /// adds "\nUser:".
    #[arg(long = "stop", value_name = "TEXT")]
    stop: Vec<String>,
    #[command(flatten)]
    forward: ForwardArgs,
    /// Use the weights of a `pulsar convert` file in place from the mapped
    /// file instead of copying them into huge-page memory (loads faster;
    /// decodes slower here). Other files are copied as usual.
    #[arg(long)]
    mmap: bool,
    /// Speculative decoding: draft tokens with a Gemma 4 assistant (mtp) or from n-grams of the
    /// prompt and the text so far (ngram) and verify them in one batched step; the default is mtp
    /// when there is an assistant, else ngram. The output is the same as with `off` (greedy:
    /// identical; sampled: the same distribution, and the same text for a seed). Under --json,
    /// --json-schema, --regex and --grammar a draft is cut where the constraint refuses it.
    #[arg(long, value_enum)]
    spec: Option<SpecArg>,
    /// The Gemma 4 assistant (drafter) for --spec mtp: a Gemma4AssistantForCausalLM folder or a
    /// gemma4-assistant GGUF. Default: MODEL-assistant (or MODEL-assistant.gguf) beside the model.
    #[arg(long, value_name = "ASSISTANT")]
    draft: Option<PathBuf>,
    /// Constrain the output to a JSON object (any keys and values). Generation ends when the
    /// object is complete.
    #[arg(long, help_heading = "Structured output")]
    json: bool,
    /// Constrain the output to JSON valid against this JSON schema: a path to a file, else the
    /// schema text itself.
    #[arg(long, value_name = "FILE|TEXT", help_heading = "Structured output",
          conflicts_with_all = ["json", "regex", "grammar"])]
    json_schema: Option<String>,
    /// Constrain the output to text that this regular expression matches in full.
    #[arg(long, value_name = "TEXT", help_heading = "Structured output",
          conflicts_with_all = ["json", "grammar"])]
    regex: Option<String>,
    /// Constrain the output to the language of this Lark grammar file (rule `start`).
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "Structured output",
        conflicts_with = "json"
    )]
    grammar: Option<PathBuf>,
}

impl GenerationCli {
    /// The output constraint asked for, if any; clap has already refused
    /// more than one.
    fn constraint(&self) -> anyhow::Result<Option<ConstraintSpec>> {
        Ok(if self.json {
            Some(ConstraintSpec::AnyJsonObject)
        } else if let Some(schema) = &self.json_schema {
            Some(ConstraintSpec::json_schema(schema)?)
        } else if let Some(pattern) = &self.regex {
            Some(ConstraintSpec::regex(pattern)?)
        } else if let Some(path) = &self.grammar {
            Some(ConstraintSpec::lark_file(path)?)
        } else {
            None
        })
    }

    fn resolve(self, flags: commands::SharedFlags) -> anyhow::Result<commands::GenerationArgs> {
        let constraint = self.constraint()?;
        Ok(commands::GenerationArgs {
            model: commands::resolve_model(self.model.as_deref())?,
            prompt: self.prompt,
            file: self.file,
            max_new: self.max_new,
            sampling: self.sampling.config(),
            seed: self.sampling.seed(),
            context: self.context,
            system: self.system,
            chat_template: self.chat_template,
            think: self.think,
            show_thinking: self.show_thinking,
            stop: self.stop,
            engine: self.forward.engine_args(self.mmap, flags),
            constraint,
            speculation: self.spec.map(Into::into),
            draft: self.draft,
        })
    }
}

/// `pulsar chat`'s flags.
#[derive(Args)]
struct ChatCli {
    #[command(flatten)]
    common: GenerationCli,
    /// When the context is full: drop the oldest exchanges, or stop.
    #[arg(long, value_enum, default_value = "drop")]
    context_full: ContextFullArg,
}

impl ChatCli {
    fn run(self, flags: commands::SharedFlags) -> anyhow::Result<()> {
        commands::chat::run(&commands::chat::ChatArgs {
            common: self.common.resolve(flags)?,
            policy: self.context_full.into(),
        })
    }
}

/// The flags `dump` and `tune` share.
#[derive(Args)]
struct DumpCli {
    /// Model .gguf, HF folder or a bare HF config.json (shape only); default: the cached gemma-3-270m
    #[arg(short = 'm', long = "model")]
    model: Option<PathBuf>,
    /// Plan for a known shape instead of a model (gemma-2b, gemma3-270m, gemma3n-e2b, gemma3n-e4b, gemma4-e2b, gemma4-e4b, gemma4-26b-a4b, gemma4-31b; FP16 unless --dtype says otherwise)
    #[arg(long, conflicts_with = "model")]
    shape: Option<String>,
    /// Write KERNEL.bin and KERNEL.asm for every kernel into this directory
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print a JSON summary instead of listings
    #[arg(long)]
    json: bool,
    /// Highest ISA the kernels may use
    #[arg(long = "max-isa", default_value = "avx512")]
    max_isa: Isa,
    /// Worker threads to plan for (0 = all cores)
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Formats the engine keeps the matrices in (plans their kernels).
    #[arg(long, value_enum, default_value = "native")]
    dtype: RunDtypeArg,
}

impl DumpCli {
    fn args(self, flags: commands::SharedFlags) -> commands::dump::DumpArgs {
        let d = self;
        commands::dump::DumpArgs {
            model: d.model,
            shape: d.shape,
            out: d.out,
            json: d.json,
            max_isa: d.max_isa,
            threads: d.threads,
            dtype: d.dtype.into(),
            flags,
        }
    }
}

/// `pulsar serve`'s flags.
#[derive(Args)]
struct ServeCli {
    /// Model: a .gguf file or a Hugging Face folder (default: Gemma 3 270M, fetched once).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Address to listen on; anything but loopback exposes the server to the network.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests decoded together, each in its own KV cache (slot).
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Requests that may wait for a slot; more get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Context size of each slot, in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    context: usize,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, env = "PULSAR_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Worker threads of the engine, the caller included (at most the cores).
    #[arg(long, default_value_t = default_threads(), value_parser = threads_arg)]
    threads: usize,
    /// Formats of the fast engine's matrices.
    #[arg(long, value_enum, default_value = "native")]
    dtype: RunDtypeArg,
    /// Use the weights of a `pulsar convert` file in place from the mapped file.
    #[arg(long)]
    mmap: bool,
    /// Turn format for /v1/chat/completions: gemma, gemma4, dialogue, a JSON or a Jinja file (default: chosen as
    /// `pulsar chat` chooses it).
    #[arg(long, value_name = "NAME|FILE")]
    chat_template: Option<String>,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = 4 << 20)]
    max_body: usize,
    /// Most prompt tokens fed in one step beside the decoding streams.
    #[arg(long, default_value_t = commands::serve::DEFAULT_SERVE_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Seconds a request may wait on a client that reads nothing before it is ended.
    #[arg(long, default_value_t = 30)]
    stall_timeout: u64,
    /// Seconds running requests may go on after Ctrl-C or SIGTERM.
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// Connections open at once; more wait to be accepted.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds a connection may take to send a request's headers, counted from when it opens or
    /// its previous reply ended (so also how long an idle connection is kept alive).
    #[arg(long, default_value_t = 5)]
    header_timeout: u64,
    /// Seconds a request's body may take to arrive; then 408.
    #[arg(long, default_value_t = 600)]
    read_timeout: u64,
    /// Seconds a write to a client may wait for it to read before the connection is closed.
    #[arg(long, default_value_t = 600)]
    write_timeout: u64,
    /// No log line per request on stderr.
    #[arg(long)]
    quiet: bool,
    /// Speculative decoding: drafts from a Gemma 4 assistant (mtp) or from n-grams of each
    /// request's own text (ngram), verified in the step it shares with the other requests;
    /// replies are the same as with `off`. Default: mtp when there is an assistant, else ngram.
    #[arg(long, value_enum)]
    spec: Option<SpecArg>,
    /// The Gemma 4 assistant (drafter) for --spec mtp. Default: MODEL-assistant (or
    /// MODEL-assistant.gguf) beside the model.
    #[arg(long, value_name = "ASSISTANT")]
    draft: Option<PathBuf>,
    /// Defaults for the sampling settings a request leaves out.
    #[command(flatten)]
    sampling: SamplingArgs,
}

impl ServeCli {
    fn run(self, flags: commands::SharedFlags) -> anyhow::Result<()> {
        commands::serve::run(commands::serve::ServeArgs {
            model: commands::resolve_model(self.model.as_deref())?,
            host: self.host,
            port: self.port,
            parallel: self.parallel,
            queue: self.queue,
            context: self.context,
            api_key: self.api_key,
            threads: self.threads,
            dtype: self.dtype.into(),
            in_place: self.mmap,
            chat_template: self.chat_template,
            max_body: self.max_body,
            prefill_chunk: self.prefill_chunk,
            stall_timeout: std::time::Duration::from_secs(self.stall_timeout),
            grace: std::time::Duration::from_secs(self.grace),
            limits: pulsar::serve::conn::ConnectionLimits {
                max_connections: self.max_connections,
                header_timeout: std::time::Duration::from_secs(self.header_timeout),
                write_timeout: std::time::Duration::from_secs(self.write_timeout),
            },
            read_timeout: std::time::Duration::from_secs(self.read_timeout),
            quiet: self.quiet,
            speculation: self.spec.map(Into::into),
            draft: self.draft,
            defaults: self.sampling.config(),
            flags,
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Chat in turns (the default): replies stream, the KV cache is kept between turns.
    Chat(ChatCli),
    /// Generate text from one prompt; the text goes to stdout as it is made. Plain completion
    /// (BOS and the prompt, as llama-completion does) unless --chat.
    Run {
        #[command(flatten)]
        common: GenerationCli,
        /// Wrap the prompt in the model's chat format as `pulsar chat` does (the model's own
        /// template, Gemma's turns, or User:/Assistant: lines for a base model).
        /// --chat-template and --think imply it.
        #[arg(long, conflicts_with = "raw")]
        chat: bool,
        /// Plain completion with BOS, no chat turn format: the default, kept for scripts that
        /// name it.
        #[arg(long)]
        raw: bool,
    },
    /// Print the token ids of a text, space-separated.
    Tokenize {
        #[arg(short, long)]
        model: Option<PathBuf>,
        #[arg(short, long)]
        prompt: String,
        /// Leave out the leading BOS token.
        #[arg(long)]
        no_bos: bool,
    },
    /// Write raw little-endian f32 logits of a token sequence to a file.
    Logits {
        #[arg(short, long)]
        model: Option<PathBuf>,
        /// Comma-separated token ids, e.g. 2,818,5279.
        #[arg(long, value_delimiter = ',', required_unless_present = "prompt")]
        tokens: Vec<u32>,
        /// Text to tokenize (with BOS) instead of --tokens.
        #[arg(short, long, conflicts_with = "tokens")]
        prompt: Option<String>,
        /// Logits of every position ([positions, vocab]) instead of the last ([vocab]).
        #[arg(long)]
        all: bool,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        /// Write this Gemma 4 assistant's draft logits instead: [n-draft, vocab] f32, no header.
        ///
        /// The model runs ids[0..n-2]; drafting starts from ids[n-1] at position n-1, each later draft fed the previous draft's argmax.
        #[arg(long, value_name = "ASSISTANT", conflicts_with = "all")]
        draft: Option<PathBuf>,
        /// Drafts to write with --draft (1 to 8).
        #[arg(long, value_name = "K", default_value_t = 8, requires = "draft")]
        n_draft: usize,
        #[command(flatten)]
        forward: ForwardArgs,
    },
    /// Print a text's embedding (the mean of its tokens' final hidden states, length 1) as a
    /// JSON list, as `pulsar serve`'s /v1/embeddings computes it.
    Embed {
        #[arg(short, long)]
        model: Option<PathBuf>,
        /// The text (BOS is put first).
        #[arg(short, long, required_unless_present = "file")]
        prompt: Option<String>,
        /// A file whose text is embedded instead of -p.
        #[arg(short, long, conflicts_with = "prompt")]
        file: Option<PathBuf>,
        #[command(flatten)]
        forward: ForwardArgs,
    },
    /// Perplexity of a text the way llama-perplexity measures it; with --kl-base, the KL
    /// divergence from a run saved with --save-logits (e.g. `--dtype native` against `f16`).
    Perplexity {
        #[arg(short, long)]
        model: Option<PathBuf>,
        /// The UTF-8 text to score.
        #[arg(short, long)]
        file: PathBuf,
        /// Tokens per window; the second half of each window is scored.
        #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
        context: usize,
        /// Score at most this many windows (default: all whole windows; with --kl-base, the
        /// base's).
        #[arg(long)]
        chunks: Option<usize>,
        /// Save the top log-probabilities of every scored position for a later --kl-base.
        #[arg(long, value_name = "FILE", conflicts_with = "kl_base")]
        save_logits: Option<PathBuf>,
        /// Compare with a file saved by --save-logits: KL divergence, top-1 agreement.
        #[arg(long, value_name = "FILE")]
        kl_base: Option<PathBuf>,
        #[command(flatten)]
        forward: ForwardArgs,
    },
    /// Plan, emit and verify the JIT kernels for a model and print them.
    Dump(DumpCli),
    /// Show the CPU that was detected and the kernel plan for a model.
    Tune {
        #[command(flatten)]
        common: DumpCli,
        /// Also time every GEMV and GEMM on synthetic weights (one thread and the plan's threads, beside a plain read of the same bytes), search the launch tuning on the real weights, and store it.
        #[arg(long)]
        measure: bool,
    },
    /// Write a model in the fast engine's layout (GGUF; the file's own types by default, or FP16, BF16, Q8_0 or Q4_0), loadable zero-copy with --mmap.
    Convert {
        /// The model to convert: a .gguf file or a Hugging Face folder (Gemma 4 and 3n: a .gguf file, whose keys and tensor list are kept).
        input: PathBuf,
        /// The file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Weight format (default: native, the file's own types; a 16-bit or f32 checkpoint becomes f16, bf16 stays bf16).
        #[arg(long, value_enum)]
        dtype: Option<ConvertDtypeArg>,
    },
    /// Serve the OpenAI API over HTTP, decoding several requests together (continuous batching).
    Serve(ServeCli),
    /// Measure prefill and decode speed against the machine's read bandwidth.
    Bench {
        /// Model (default: Gemma 3 270M).
        #[arg(short, long, conflicts_with = "shape")]
        model: Option<PathBuf>,
        /// Benchmark a known shape on random weights instead (gemma-2b, gemma3-270m, gemma3n-e2b, gemma3n-e4b, gemma4-e2b, gemma4-e4b, gemma4-26b-a4b, gemma4-31b).
        #[arg(long)]
        shape: Option<String>,
        /// Formats of the matrices (random weights: native means f16).
        #[arg(long, value_enum, default_value = "native")]
        dtype: RunDtypeArg,
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
        /// Use the weights of a `pulsar convert` file in place from the
        /// mapped file instead of copying them into huge-page memory.
        #[arg(long)]
        mmap: bool,
        /// Also time one step over m = 1..16 tokens of one sequence (a
        /// speculative verify step), relative to a step over one.
        #[arg(long)]
        m_curve: bool,
        /// Tokens cached before each of the m-curve's steps: its attention
        /// reads them (a document given with -f makes a few hundred).
        #[arg(long, default_value_t = commands::bench::M_CURVE_CONTEXT, value_name = "TOKENS")]
        m_curve_context: usize,
        /// Also time a Gemma 4 assistant's draft tokens beside the model (-m), and the decode
        /// speed they give at acceptance 0.5-0.9 (implies --m-curve).
        #[arg(long, value_name = "ASSISTANT", conflicts_with = "shape")]
        draft: Option<PathBuf>,
        /// As --draft, a known assistant shape on random weights, beside -m or --shape
        /// (gemma4-e2b-assistant, gemma4-e4b-assistant; widths assumed).
        #[arg(long, value_name = "NAME", conflicts_with = "draft")]
        draft_shape: Option<String>,
    },
}

fn run(command: Command, flags: commands::SharedFlags) -> anyhow::Result<()> {
    match command {
        Command::Chat(chat) => chat.run(flags),
        Command::Run { common, chat, .. } => commands::run::run(&commands::run::RunArgs {
            common: common.resolve(flags)?,
            chat,
        }),
        Command::Tokenize {
            model,
            prompt,
            no_bos,
        } => commands::tokenize::run(
            &commands::resolve_model(model.as_deref())?,
            &prompt,
            !no_bos,
        ),
        Command::Logits {
            model,
            tokens,
            prompt,
            all,
            output,
            draft,
            n_draft,
            forward,
        } => commands::logits::run(&commands::logits::LogitsArgs {
            model: &commands::resolve_model(model.as_deref())?,
            tokens: &tokens,
            prompt: prompt.as_deref(),
            all,
            output: &output,
            draft: draft.as_deref(),
            n_draft,
            engine: forward.engine_args(false, flags),
        }),
        Command::Embed {
            model,
            prompt,
            file,
            forward,
        } => commands::embed::run(&commands::embed::EmbedArgs {
            model: &commands::resolve_model(model.as_deref())?,
            prompt: prompt.as_deref(),
            file: file.as_deref(),
            engine: forward.engine_args(false, flags),
        }),
        Command::Perplexity {
            model,
            file,
            context,
            chunks,
            save_logits,
            kl_base,
            forward,
        } => commands::perplexity::run(&commands::perplexity::PerplexityArgs {
            model: commands::resolve_model(model.as_deref())?,
            file,
            context,
            chunks,
            save_logits,
            kl_base,
            engine: forward.engine_args(false, flags),
        }),
        Command::Serve(serve) => serve.run(flags),
        Command::Dump(a) => commands::dump::run_dump_command(&a.args(flags)),
        Command::Tune { common, measure } => {
            commands::dump::run_tune_command(&commands::dump::TuneArgs {
                common: common.args(flags),
                measure,
            })
        }
        Command::Convert {
            input,
            output,
            dtype,
        } => commands::convert::run(&input, &output, dtype.map(Into::into)),
        Command::Bench {
            model,
            shape,
            dtype,
            threads,
            pp,
            tg,
            json,
            mmap,
            m_curve,
            m_curve_context,
            draft,
            draft_shape,
        } => commands::bench::run_command(
            model.as_deref(),
            shape.as_deref(),
            &commands::EngineArgs {
                kind: EngineKind::Jit,
                threads,
                dtype: dtype.into(),
                in_place: mmap,
                flags,
            },
            &commands::bench::BenchArgs {
                prompt_tokens: pp,
                generate_tokens: tg,
                json,
                m_curve,
                m_curve_context,
                draft: match (draft, draft_shape) {
                    (Some(path), _) => Some(commands::bench::DraftBench::File(path)),
                    (None, Some(name)) => Some(commands::bench::DraftBench::Shape(name)),
                    (None, None) => None,
                },
            },
        ),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let flags = commands::SharedFlags {
        verbose: cli.verbose,
        no_tune: cli.no_tune,
        input_precision: cli.input_bits.into(),
    };
    let result = match cli.command {
        Some(command) => run(command, flags),
        None => cli.chat.run(flags),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if pulsar::cancel::is_interrupted(&e) => {
            eprintln!("pulsar: {e:#}");
            ExitCode::from(pulsar::cancel::EXIT_ON_SIGINT)
        }
        Err(e) => {
            eprintln!("pulsar: {e:#}");
            ExitCode::FAILURE
        }
    }
}
