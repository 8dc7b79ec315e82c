//! `pulsar run`: one prompt in, generated text streamed to stdout; load
//! time and speeds on stderr.

use super::{
    ConstraintBuild, GenerationArgs, drafting, effective_speculation, open_engine_drafting,
    report_constraint, start_constraint,
};
use crate::chat::thinking::{Part, ThoughtSplitter};
use crate::chat_template::{ChatTemplate, TemplateChoice};
use crate::generate::{self, Request};
use crate::model::source::ModelSource;
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::time::Instant;

pub struct RunArgs {
    pub common: GenerationArgs,
    /// The prompt in the model's chat format (`--chat`); otherwise plain
    /// completion with BOS. `--chat-template` and `--think` imply it.
    pub chat: bool,
}

/// Loads the tokenizer that belongs to a model source.
pub fn load_tokenizer(src: &ModelSource) -> Result<Tokenizer> {
    match src.gguf() {
        Some(g) => Tokenizer::from_gguf(g),
        None => Tokenizer::from_hf_folder(&src.path),
    }
}

/// A text file given with `-f`, which must be UTF-8 without NUL bytes.
pub fn read_text_file(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    // A NUL is valid UTF-8 but never text a model was trained on; it
    // usually means a binary file was given by mistake.
    if let Some(at) = bytes.iter().position(|&b| b == 0) {
        bail!(
            "{}: contains a NUL byte at offset {at}; is it a text file?",
            path.display()
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not valid UTF-8 (first bad byte at offset {}); convert it to UTF-8 first",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// The user's text: a file as context followed by the prompt, or either.
pub fn user_text(prompt: Option<&str>, file: Option<&Path>) -> Result<String> {
    let text = match (file, prompt) {
        (Some(f), p) => {
            let body = read_text_file(f)?;
            if body.trim().is_empty() && p.is_none_or(|p| p.trim().is_empty()) {
                bail!(
                    "{}: the file is empty or only white space; there is nothing to prompt with",
                    f.display()
                );
            }
            match p {
                Some(p) => format!("{body}\n\n{p}"),
                None => body,
            }
        }
        (None, Some(p)) => p.to_string(),
        (None, None) => bail!("give a prompt with -p TEXT or a file with -f FILE"),
    };
    if text.contains('\0') {
        bail!("the prompt contains a NUL byte; remove it");
    }
    Ok(text)
}

pub fn run(args: &RunArgs) -> Result<()> {
    args.common.sampling.validate()?;
    let text = user_text(args.common.prompt.as_deref(), args.common.file.as_deref())?;
    if text.trim().is_empty() {
        bail!("the prompt is empty: give some text with -p or -f");
    }
    let load_start = Instant::now();
    let src = ModelSource::open(&args.common.model)?;
    let tok = load_tokenizer(&src)?;
    let chat = args.chat || args.common.chat_template.is_some() || args.common.think;
    let choice = if !chat {
        None
    } else {
        Some(TemplateChoice::for_model(
            &src,
            &tok,
            args.common.chat_template.as_deref(),
        )?)
    };
    let template = choice.as_ref().map(|c| &c.template);
    if args.common.think && !template.is_some_and(|t| t.can_think()) {
        bail!(
            "--think: the chat format {} has no thinking switch (Gemma 4's has one)",
            template.map_or("of plain completion".to_string(), |t| format!(
                "{:?}",
                t.name
            ))
        );
    }
    let stops = match template {
        Some(t) => t.stop_ids(&tok),
        None => generate::stop_ids(&tok),
    };
    let constraint_build = start_constraint(args.common.constraint.as_ref(), &tok, &stops)?;
    let (assistant, speculation) =
        drafting(&src, args.common.draft.as_deref(), args.common.speculation)?;
    let speculation = effective_speculation(speculation)?;
    let drafts_note = assistant.as_ref().map_or(String::new(), |a| {
        format!(", drafts from {}", a.path.display())
    });
    // Under a constraint the constraint decides where the output ends; the
    // template's stop strings (the dialogue's "\nUser:") would only cut a
    // valid output short. The user's own --stop strings still apply.
    let mut stop_strings = match (template, &constraint_build) {
        (Some(t), None) => t.stop_strings.clone(),
        _ => Vec::new(),
    };
    stop_strings.extend(args.common.stop.iter().cloned());
    // The user's own tokens (prompt and system text), so the stats can say
    // what the chat format added.
    let own_tokens = tok.encode(&text, false).len()
        + args
            .common
            .system
            .as_ref()
            .map_or(0, |s| tok.encode(s, false).len());
    let prompt = match template {
        Some(t) => tok.encode(
            &t.user_then_model(&text, args.common.system.as_deref(), args.common.think),
            t.bos,
        ),
        None => {
            let text = match &args.common.system {
                Some(s) => format!("{s}\n\n{text}"),
                None => text,
            };
            tok.encode(&text, true)
        }
    };
    let format_tokens = match template {
        Some(_) => prompt.len().saturating_sub(own_tokens),
        None => 0,
    };
    if args.common.context == 0 {
        bail!("-c 0: the context must hold at least the prompt and one new token");
    }
    // The model cannot attend further than it was built for, and a -c above
    // that would only size buffers for positions it never reaches.
    let context = args.common.context.min(src.config.max_context);
    if prompt.len() >= context {
        bail!(
            "the prompt has {} tokens but the context holds {context} (-c {}, model maximum {}); shorten the prompt or raise -c",
            prompt.len(),
            args.common.context,
            src.config.max_context
        );
    }
    // Nothing is sized by -n: generation simply stops where the context
    // ends, whichever engine runs (the reference engine's own capacity is
    // the model maximum, not -c).
    let max_new = args.common.max_new.min(context - prompt.len());
    // Said once the prompt is known to fit, so that a refusal stays one line.
    if context < args.common.context {
        eprintln!(
            "pulsar: -c {}: the model was trained for {context} tokens; using {context}",
            args.common.context
        );
    }
    if let Some(choice) = &choice {
        let verbose = args.common.engine.flags.verbose;
        eprintln!("pulsar: {}", choice.describe(verbose));
    }
    let opened = open_engine_drafting(src, &args.common.engine, context, assistant)?;
    let mut engine = opened.engine;
    let constraint = constraint_build.map(ConstraintBuild::finish).transpose()?;
    eprintln!(
        "pulsar: loaded {} in {:.2} s ({} engine, seed {}{}{drafts_note})",
        args.common.model.display(),
        load_start.elapsed().as_secs_f64(),
        args.common.engine.kind.name(),
        args.common.seed,
        opened.note
    );

    let mut sampler = Sampler::new(args.common.sampling, args.common.seed);
    let mut out = if template.is_some() {
        generate::StdoutStream::reply()
    } else {
        generate::StdoutStream::default()
    };
    let mut history = Vec::new();
    // Gemma 4's thought channel: hidden, or on stderr with --show-thinking.
    let mut thoughts = template
        .is_some_and(ChatTemplate::can_think)
        .then(ThoughtSplitter::new);
    let show_thinking = args.common.show_thinking;
    let route = move |out: &mut generate::StdoutStream, parts: Vec<Part>| {
        for part in parts {
            match part {
                Part::Answer(text) => out.write(&text),
                Part::Thought(text) if show_thinking => eprint!("{text}"),
                Part::Thought(_) => {}
            }
        }
    };
    let decoded = generate::generate(
        engine.as_mut(),
        &tok,
        &mut sampler,
        &Request {
            prompt: &prompt,
            max_new,
            stop_ids: &stops,
            stop_strings: &stop_strings,
            interrupted: &|| false,
            constraint: constraint.as_ref(),
            speculation,
        },
        &mut history,
        &mut |piece| match &mut thoughts {
            Some(splitter) => route(&mut out, splitter.push(piece)),
            None => out.write(piece),
        },
    )?;
    if let Some(splitter) = &mut thoughts {
        route(&mut out, splitter.finish());
    }
    out.finish("\n").context("cannot write to stdout")?;
    report_constraint(
        decoded.stats.stop,
        decoded.constraint.as_ref(),
        constraint.as_ref(),
    );
    eprintln!(
        "pulsar: {}",
        decoded.stats.summary_with_format(format_tokens)
    );
    Ok(())
}
