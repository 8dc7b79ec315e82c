//! The generation loop shared by `pulsar run` and `pulsar chat`: prefill the
//! prompt, then sample, stream and feed one token at a time until a stop
//! token, the token limit, the context's end, an interrupt or, under an
//! output constraint, the constraint's end.

use crate::constrain::lookahead::{ConstraintReport, MaskLookahead, overlap_from_env};
use crate::constrain::mask::mask_logits;
use crate::constrain::{CompiledConstraint, NextTokens};
use crate::engine::{Engine, LogitsWanted};
use crate::sample::Sampler;
use crate::stop_strings::{Scan, StopStrings};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (EOS or end of turn) was sampled; it was not fed.
    StopToken(u32),
    /// A stop string was generated; it was not shown, and the token that
    /// completed it was not fed.
    StopString,
    /// `max_new` tokens were generated.
    Limit,
    /// The context is full.
    ContextFull,
    /// The caller's interrupt flag was raised.
    Interrupted,
    /// The output constraint is complete: nothing more may follow.
    ConstraintComplete,
    /// No token could continue the text under the output constraint; the
    /// reason is in [`Decoded::constraint`].
    ConstraintDeadEnd,
}

#[derive(Clone, Copy, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub generated: usize,
    pub decode_secs: f64,
    pub stop: StopReason,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tok_s(&self) -> f64 {
        self.generated as f64 / self.decode_secs.max(1e-9)
    }

    /// One line for stderr after a reply.
    pub fn summary(&self) -> String {
        format!(
            "[prompt {} tok, {:.1} tok/s | generated {} tok, {:.1} tok/s]",
            self.prompt_tokens,
            self.prefill_tok_s(),
            self.generated,
            self.decode_tok_s()
        )
    }
}

/// Ids that end generation: EOS and, where the vocabulary has it,
/// `<end_of_turn>`.
pub fn stop_ids(tok: &Tokenizer) -> Vec<u32> {
    let mut ids = vec![tok.eos_id()];
    if let Some(id) = tok.id_of("<end_of_turn>") {
        ids.push(id);
    }
    ids
}

pub struct Request<'a> {
    /// Tokens to feed before generating (the new part of the conversation).
    pub prompt: &'a [u32],
    pub max_new: usize,
    pub stop_ids: &'a [u32],
    /// Text that ends generation when generated; never shown.
    pub stop_strings: &'a [String],
    /// Checked before every step; `true` ends the reply.
    pub interrupted: &'a dyn Fn() -> bool,
    /// The output must satisfy this (`--json`, `--json-schema`, `--regex`,
    /// `--grammar`); each generation starts it afresh.
    pub constraint: Option<&'a CompiledConstraint>,
}

/// Runs one generation. `history` holds every token in the engine's cache
/// (for the repetition penalty) and is extended with the prompt and every
/// fed token. `emit` receives text as soon as it is complete.
pub fn generate(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    req: &Request<'_>,
    history: &mut Vec<u32>,
    emit: &mut dyn FnMut(&str),
) -> Result<Decoded> {
    let start = Instant::now();
    let logits = engine.forward(req.prompt, LogitsWanted::Last)?;
    history.extend_from_slice(req.prompt);
    let prefill_secs = start.elapsed().as_secs_f64();
    let mut decoded = decode(engine, tok, sampler, logits, req, history, emit)?;
    decoded.stats.prompt_tokens = req.prompt.len();
    decoded.stats.prefill_secs = prefill_secs;
    Ok(decoded)
}

/// Where a stop string cut the generated text, so that a caller keeping
/// the KV cache (chat) can take back what was fed past it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopCut {
    /// How many of the fed tokens lie wholly before the stop string.
    pub tokens_before: usize,
    /// Text between those tokens' end and the stop string (part of a token
    /// that also began the stop string; usually empty).
    pub text_between: String,
}

/// What [`decode`] did.
#[derive(Clone, Debug)]
pub struct Decoded {
    pub stats: GenerationStats,
    /// Set when a stop string ended the text.
    pub cut: Option<StopCut>,
    /// How the output constraint went, when there was one.
    pub constraint: Option<ConstraintReport>,
}

/// The decoding half of [`generate`], for a caller that fed the prompt
/// itself (chat feeds it in pieces with progress): starts from `logits`,
/// those of the last token in the engine, which `history` must end with.
/// `req.prompt` is not fed; the stats count no prompt.
pub fn decode(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    mut logits: Vec<f32>,
    req: &Request<'_>,
    history: &mut Vec<u32>,
    emit: &mut dyn FnMut(&str),
) -> Result<Decoded> {
    let mut decoder = tok.stream_decoder();
    let mut stops = StopStrings::new(req.stop_strings);
    // The decoded text and where each generated token's text ends in it,
    // to map a stop string's offset back to tokens.
    let mut text = String::new();
    let mut token_ends = Vec::new();
    let mut cut_at = None;
    let start = Instant::now();
    let mut generated = 0;
    let mut show = |piece: String, text: &mut String, emit: &mut dyn FnMut(&str)| {
        text.push_str(&piece);
        match stops.push(&piece) {
            Scan::Go(shown) => {
                emit(&shown);
                None
            }
            Scan::Stop { text: shown, at } => {
                emit(&shown);
                Some(at)
            }
        }
    };
    let mut lookahead = req
        .constraint
        .map(|c| MaskLookahead::new(c.start(), overlap_from_env()));
    let stop = loop {
        if generated >= req.max_new {
            break StopReason::Limit;
        }
        if (req.interrupted)() {
            break StopReason::Interrupted;
        }
        if let Some(lookahead) = &mut lookahead {
            match lookahead.next_tokens() {
                NextTokens::Complete => break StopReason::ConstraintComplete,
                NextTokens::DeadEnd(why) => {
                    lookahead.record_dead_end(why);
                    break StopReason::ConstraintDeadEnd;
                }
                NextTokens::Allowed(mask) => {
                    let masking = Instant::now();
                    mask_logits(&mut logits, &mask);
                    lookahead.add_wait(masking.elapsed().as_secs_f64());
                }
            }
        }
        let window = sampler.config().repeat_last_n.min(history.len());
        let next = sampler.sample(&logits, &history[history.len() - window..]);
        if req.stop_ids.contains(&next) {
            break StopReason::StopToken(next);
        }
        if let Some(lookahead) = &mut lookahead
            && let Err(why) = lookahead.take(next)
        {
            lookahead.record_dead_end(why);
            break StopReason::ConstraintDeadEnd;
        }
        generated += 1;
        cut_at = show(decoder.push(next), &mut text, emit);
        token_ends.push(text.len());
        if cut_at.is_some() {
            break StopReason::StopString;
        }
        if engine.position() >= engine.capacity() {
            break StopReason::ContextFull;
        }
        let mut forward = || engine.forward(&[next], LogitsWanted::Last);
        logits = match &mut lookahead {
            Some(lookahead) => lookahead.alongside(forward)?,
            None => forward()?,
        };
        history.push(next);
    };
    let mut stop = stop;
    if cut_at.is_none() {
        // Bytes of an unfinished character, then whatever was held back
        // as a possible start of a stop string.
        cut_at = show(decoder.finish(), &mut text, emit);
        if cut_at.is_some() {
            stop = StopReason::StopString;
        } else {
            emit(&stops.finish());
        }
    }
    let cut = cut_at.map(|at| {
        let tokens_before = token_ends.iter().take_while(|&&end| end <= at).count();
        let from = tokens_before.checked_sub(1).map_or(0, |i| token_ends[i]);
        StopCut {
            tokens_before,
            text_between: text[from..at].to_string(),
        }
    });
    Ok(Decoded {
        stats: GenerationStats {
            prompt_tokens: 0,
            prefill_secs: 0.0,
            generated,
            decode_secs: start.elapsed().as_secs_f64(),
            stop,
        },
        cut,
        constraint: lookahead.map(MaskLookahead::into_report),
    })
}

/// Generated text to stdout, flushed piece by piece so it appears as it is
/// made. A write error (a closed pipe) is kept, not raised mid-generation,
/// and reported by [`StdoutStream::finish`].
pub struct StdoutStream {
    out: std::io::StdoutLock<'static>,
    error: Option<std::io::Error>,
    /// A reply: white space at its start and end is not shown.
    trim: bool,
    /// Nothing but white space has come yet.
    at_start: bool,
    /// White space held back until more text follows it.
    held_space: String,
}

impl Default for StdoutStream {
    fn default() -> Self {
        StdoutStream {
            out: std::io::stdout().lock(),
            error: None,
            trim: false,
            at_start: true,
            held_space: String::new(),
        }
    }
}

impl StdoutStream {
    /// A stream for a reply, which leaves out the white space around it:
    /// after the dialogue format's `Assistant:` the model's first token is a
    /// space, and before the `\nUser:` that ends it comes a line break.
    pub fn reply() -> Self {
        StdoutStream {
            trim: true,
            ..StdoutStream::default()
        }
    }

    pub fn write(&mut self, piece: &str) {
        if !self.trim {
            self.write_out(piece);
            return;
        }
        let piece = if self.at_start {
            piece.trim_start()
        } else {
            piece
        };
        let body = piece.trim_end();
        if !body.is_empty() {
            self.at_start = false;
            let space = std::mem::take(&mut self.held_space);
            self.write_out(&space);
            self.write_out(body);
        }
        self.held_space.push_str(&piece[body.len()..]);
    }

    fn write_out(&mut self, piece: &str) {
        use std::io::Write;
        if piece.is_empty() {
            return;
        }
        if self.error.is_none()
            && let Err(e) = self
                .out
                .write_all(piece.as_bytes())
                .and_then(|_| self.out.flush())
        {
            self.error = Some(e);
        }
    }

    /// Ends the text with `end` (e.g. a newline) and reports any write error.
    pub fn finish(mut self, end: &str) -> std::io::Result<()> {
        self.write_out(end);
        self.error.map_or(Ok(()), Err)
    }
}
