//! `pulsar chat` (and bare `pulsar`): a multi-turn conversation. Replies
//! stream to stdout; everything else (load line, stats, notices, slash
//! command output) goes to stderr so that stdout holds only the replies.

use super::run::{load_tokenizer, read_text_file};
use super::{
    ConstraintBuild, GenerationArgs, drafting, effective_speculation, open_engine_drafting,
    report_constraint, start_constraint,
};
use crate::chat::conversation::{ContextPolicy, Conversation};
use crate::chat::input::Input;
use crate::chat::interrupt::Interrupt;
use crate::chat::reply::{self, ReplyReport, ReplySettings};
use crate::chat::slash::{self, Line};
use crate::chat::thinking::{Part, ThoughtSplitter};
use crate::chat::turns::TurnEncoder;
use crate::chat_template::TemplateChoice;
use crate::constrain::CompiledConstraint;
use crate::engine::Engine;
use crate::generate::{StdoutStream, StopReason};
use crate::model::source::ModelSource;
use crate::sample::Sampler;
use crate::speculative::{SpecStats, Speculation};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use std::time::{Duration, Instant};

pub struct ChatArgs {
    pub common: GenerationArgs,
    /// What to do when the conversation fills the context.
    pub policy: ContextPolicy,
}

/// Refuses settings that cannot work, before anything slow happens.
fn validate(args: &ChatArgs) -> Result<()> {
    args.common.sampling.validate()?;
    if args.common.context < 2 {
        bail!(
            "-c/--ctx-size must be at least 2 tokens, got {}",
            args.common.context
        );
    }
    if args.common.max_new == 0 {
        bail!("-n must be at least 1 token");
    }
    if args.common.engine.threads == 0 {
        bail!("--threads must be at least 1");
    }
    if let Some(p) = &args.common.prompt
        && p.trim().is_empty()
    {
        bail!("the prompt given with -p is empty; give some text");
    }
    for (what, text) in [
        ("-p", &args.common.prompt),
        ("--system", &args.common.system),
    ] {
        if text.as_deref().is_some_and(|t| t.contains('\0')) {
            bail!("the {what} text contains a NUL byte; remove it");
        }
    }
    Ok(())
}

/// Running totals for `/stats`.
#[derive(Default)]
struct Totals {
    replies: usize,
    prompt_tokens: usize,
    prefill_secs: f64,
    generated: usize,
    decode_secs: f64,
    dropped: usize,
    /// Speculation over the replies that had it.
    spec: Option<SpecStats>,
    last: Option<ReplyReport>,
}

impl Totals {
    fn add(&mut self, r: &ReplyReport) {
        self.replies += 1;
        self.prompt_tokens += r.stats.prompt_tokens;
        self.prefill_secs += r.stats.prefill_secs;
        self.generated += r.stats.generated;
        self.decode_secs += r.stats.decode_secs;
        if let Some(s) = r.stats.spec {
            let total = self.spec.get_or_insert_with(SpecStats::default);
            total.steps += s.steps;
            total.drafted += s.drafted;
            total.accepted += s.accepted;
        }
        self.last = Some(r.clone());
    }
}

/// Everything one chat needs between turns.
struct Session<'a> {
    args: &'a ChatArgs,
    tok: Tokenizer,
    engine: Box<dyn Engine>,
    encoder: TurnEncoder,
    conv: Conversation,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    stop_strings: Vec<String>,
    model_end: Vec<u32>,
    /// What every reply must be (`--json`…); each reply starts it afresh.
    constraint: Option<CompiledConstraint>,
    /// `--spec` as it applies to the replies.
    speculation: Speculation,
    interrupt: Interrupt,
    totals: Totals,
}

pub fn run(args: &ChatArgs) -> Result<()> {
    validate(args)?;
    let document = match &args.common.file {
        Some(path) => {
            let text = read_text_file(path)?;
            if text.contains('\0') {
                bail!("{}: contains a NUL byte; remove it", path.display());
            }
            Some(text)
        }
        None => None,
    };
    let mut session = Session::open(args, document.as_deref())?;
    if let Some(prompt) = &args.common.prompt {
        session.turn(prompt)?;
        return Ok(());
    }
    let mut input = Input::open()?;
    if input.is_terminal() {
        eprintln!("pulsar: type a message; /help lists commands; Ctrl-D or /quit leaves");
    }
    while let Some(line) = input.next_line()? {
        match slash::parse(&line) {
            Line::Blank => {}
            Line::Message(m) => session.turn(&m)?,
            Line::Reset => {
                session.reset();
                eprintln!("pulsar: new conversation");
            }
            Line::Stats => session.print_stats(),
            Line::Help => eprintln!("{}", slash::HELP),
            Line::Quit => break,
            Line::Unknown(word) => {
                eprintln!("pulsar: unknown command {word}; /help lists the commands")
            }
        }
    }
    Ok(())
}

impl<'a> Session<'a> {
    fn open(args: &'a ChatArgs, document: Option<&str>) -> Result<Session<'a>> {
        let start = Instant::now();
        // Opening the file only maps it: the format line comes first.
        let src = ModelSource::open(&args.common.model)?;
        let tok = load_tokenizer(&src)?;
        let choice = TemplateChoice::for_model(&src, &tok, args.common.chat_template.as_deref())?;
        eprintln!(
            "pulsar: {}",
            choice.describe(args.common.engine.flags.verbose)
        );
        let encoder = TurnEncoder::with_thinking(
            choice.template,
            args.common.system.as_deref(),
            document,
            args.common.think,
        )?;
        let stop_ids = encoder.stop_ids(&tok);
        let constraint_build = start_constraint(args.common.constraint.as_ref(), &tok, &stop_ids)?;
        let (assistant, speculation) =
            drafting(&src, args.common.draft.as_deref(), args.common.speculation)?;
        let speculation = effective_speculation(speculation)?;
        let drafts_note = assistant.as_ref().map_or(String::new(), |a| {
            format!(", drafts from {}", a.path.display())
        });
        // Under a constraint the constraint decides where a reply ends; the
        // template's stop strings (the dialogue's "\nUser:") would only cut a
        // valid reply short. The user's own --stop strings still apply.
        let stop_strings = match constraint_build {
            Some(_) => args.common.stop.clone(),
            None => encoder.stop_strings(&args.common.stop),
        };
        let spinner = ProgressBar::new_spinner().with_message(format!(
            "preparing the {} engine (converting weights)",
            args.common.engine.kind.name()
        ));
        spinner.enable_steady_tick(Duration::from_millis(120));
        let opened =
            open_engine_drafting(src, &args.common.engine, args.common.context, assistant)?;
        let mut engine = opened.engine;
        spinner.finish_and_clear();
        let constraint = constraint_build.map(ConstraintBuild::finish).transpose()?;

        let limit = args.common.context.min(engine.capacity());
        if limit < args.common.context {
            eprintln!(
                "pulsar: the model holds at most {limit} tokens; using that instead of -c {}",
                args.common.context
            );
        }
        eprintln!(
            "pulsar: loaded {} in {:.2} s ({} engine, context {limit}, seed {}{}{drafts_note})",
            args.common.model.display(),
            start.elapsed().as_secs_f64(),
            args.common.engine.kind.name(),
            args.common.seed,
            opened.note
        );
        let mut conv = Conversation::new(encoder.prefix(&tok), limit);
        if conv.len() + 1 > limit {
            bail!(
                "the start of the conversation (--system text and -f document) takes {} tokens \
                 but the context holds {limit}; shorten them or raise -c",
                conv.len()
            );
        }
        // Feed the start now: the first reply comes sooner, and /reset keeps it.
        let read_start = Instant::now();
        let mut bar = None;
        reply::feed(&mut conv, engine.as_mut(), &|| false, &mut |fed, total| {
            show_progress(&mut bar, "reading the document", fed, total)
        })?;
        if args.common.file.is_some() || args.common.system.is_some() {
            eprintln!(
                "pulsar: fed the opening of the conversation with the --system text and -f document: {} tokens in {:.2} s",
                conv.len(),
                read_start.elapsed().as_secs_f64()
            );
        }
        Ok(Session {
            speculation,
            stop_ids,
            stop_strings,
            constraint,
            model_end: encoder.model_end(&tok),
            sampler: Sampler::new(args.common.sampling, args.common.seed),
            interrupt: Interrupt::install()?,
            args,
            tok,
            engine,
            encoder,
            conv,
            totals: Totals::default(),
        })
    }

    /// A new conversation that replies exactly as a fresh process would.
    fn reset(&mut self) {
        self.conv.reset();
        self.sampler = Sampler::new(self.args.common.sampling, self.args.common.seed);
        self.totals = Totals::default();
    }

    /// One user message and the model's reply.
    fn turn(&mut self, message: &str) -> Result<()> {
        if message.contains('\0') {
            eprintln!("pulsar: the message contains a NUL byte; it was not sent");
            return Ok(());
        }
        let first = self.conv.exchanges() == 0;
        let user_turn = self.encoder.user_turn(&self.tok, message, first);
        let interrupt = self.interrupt.clone();
        let interrupted = move || interrupt.raised();
        let settings = ReplySettings {
            max_new: self.args.common.max_new,
            stop_ids: &self.stop_ids,
            stop_strings: &self.stop_strings,
            model_end: &self.model_end,
            interrupted: &interrupted,
            constraint: self.constraint.as_ref(),
            speculation: self.speculation,
        };
        let need = reply::room_needed(&self.conv, &user_turn, &settings);
        match self.conv.make_room(need, self.args.policy) {
            Ok(0) => {}
            Ok(n) => {
                self.totals.dropped += n;
                eprintln!(
                    "pulsar: context full ({} tokens); dropped the {n} oldest exchange{} after the first",
                    self.conv.limit(),
                    if n == 1 { "" } else { "s" }
                );
            }
            Err(why) => {
                // What the need is made of, in the user's terms: the
                // message's turn and the room kept for the reply (-n, at
                // most half the context), against what is left.
                let reserve = need.saturating_sub(user_turn.len() + self.model_end.len());
                let left = self.conv.limit().saturating_sub(self.conv.len());
                let why = format!(
                    "{why} (this message's turn is {} tokens and {reserve} are kept for the reply: -n {}, at most half the context; {left} are left)",
                    user_turn.len(),
                    self.args.common.max_new
                );
                // With --context-full stop a full context ends the chat, and
                // -p has no later turn to go on with; otherwise the user can
                // shorten the message or /reset.
                if self.args.policy == ContextPolicy::Stop || self.args.common.prompt.is_some() {
                    bail!("{why}");
                }
                eprintln!("pulsar: {why}");
                return Ok(());
            }
        }

        let mut out = StdoutStream::reply();
        // Gemma 4's thought channel: hidden, or on stderr with
        // --show-thinking, so that stdout holds only the answers.
        let mut thoughts = self
            .encoder
            .has_thought_channel()
            .then(ThoughtSplitter::new);
        let show_thinking = self.args.common.show_thinking;
        let route = move |out: &mut StdoutStream, parts: Vec<Part>| {
            for part in parts {
                match part {
                    Part::Answer(text) => out.write(&text),
                    Part::Thought(text) if show_thinking => eprint!("{text}"),
                    Part::Thought(_) => {}
                }
            }
        };
        let mut bar: Option<ProgressBar> = None;
        self.interrupt.begin_reply();
        let result = reply::reply(
            &mut self.conv,
            self.engine.as_mut(),
            &self.tok,
            &mut self.sampler,
            &user_turn,
            &settings,
            &mut |fed, total| show_progress(&mut bar, "reading the prompt", fed, total),
            &mut |piece| match &mut thoughts {
                Some(splitter) => route(&mut out, splitter.push(piece)),
                None => out.write(piece),
            },
        );
        if let Some(splitter) = &mut thoughts {
            route(&mut out, splitter.finish());
        }
        let stopped = self.interrupt.end_reply();
        if let Some(bar) = bar {
            // A prefill stopped by Ctrl-C never reached the end.
            bar.finish_and_clear();
        }
        let report = result?;
        out.finish(if report.abandoned { "" } else { "\n" })
            .context("cannot write the reply to stdout")?;

        if report.abandoned {
            eprintln!(
                "pulsar: [stopped by Ctrl-C before the reply began; the message was taken back]"
            );
        } else if stopped || report.stats.stop == StopReason::Interrupted {
            eprintln!("pulsar: [reply stopped by Ctrl-C]");
        }
        if report.cut_by_context {
            eprintln!(
                "pulsar: context full: the reply was cut at {} tokens; the next turn makes room",
                report.stats.generated
            );
        }
        report_constraint(
            report.stats.stop,
            report.constraint.as_ref(),
            self.constraint.as_ref(),
        );
        eprintln!("pulsar: {}", report.stats.summary());
        self.totals.add(&report);
        Ok(())
    }

    fn print_stats(&self) {
        let t = &self.totals;
        eprintln!(
            "context: {} of {} tokens used, {} exchange{} held, {} dropped",
            self.conv.len(),
            self.conv.limit(),
            self.conv.exchanges(),
            if self.conv.exchanges() == 1 { "" } else { "s" },
            t.dropped
        );
        eprintln!(
            "this conversation: {} repl{}; prompt {} tok, {:.1} tok/s; generated {} tok, {:.1} tok/s",
            t.replies,
            if t.replies == 1 { "y" } else { "ies" },
            t.prompt_tokens,
            t.prompt_tokens as f64 / t.prefill_secs.max(1e-9),
            t.generated,
            t.generated as f64 / t.decode_secs.max(1e-9)
        );
        if let Some(s) = &t.spec {
            eprintln!("speculation: {}", s.describe(t.generated));
        }
        if let Some(last) = &t.last {
            eprintln!("last reply: {}", last.stats.summary());
        }
    }
}

/// Shows `fed` of `total` prompt tokens on a bar made at the first call;
/// prompts short enough to go in one piece get none.
fn show_progress(bar: &mut Option<ProgressBar>, what: &str, fed: usize, total: usize) {
    if total <= reply::PREFILL_PIECE {
        return;
    }
    let bar = bar.get_or_insert_with(|| {
        let bar = ProgressBar::new(total as u64);
        let template = format!("{what} [{{bar:30}}] {{pos}}/{{len}} tokens, {{eta}} left");
        if let Ok(style) = ProgressStyle::with_template(&template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    });
    bar.set_position(fed as u64);
    if fed == total {
        bar.finish_and_clear();
    }
}
