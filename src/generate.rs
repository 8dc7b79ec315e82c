//! The generation loop shared by `pulsar run` and `pulsar chat`: prefill the
//! prompt, then sample, stream and feed one token at a time until a stop
//! token, the token limit, the context's end or an interrupt.

use crate::engine::{Engine, LogitsWanted};
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (EOS or end of turn) was sampled; it was not fed.
    StopToken(u32),
    /// `max_new` tokens were generated.
    Limit,
    /// The context is full.
    ContextFull,
    /// The caller's interrupt flag was raised.
    Interrupted,
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
    /// Checked before every step; `true` ends the reply.
    pub interrupted: &'a dyn Fn() -> bool,
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
) -> Result<GenerationStats> {
    let start = Instant::now();
    let logits = engine.forward(req.prompt, LogitsWanted::Last)?;
    history.extend_from_slice(req.prompt);
    let prefill_secs = start.elapsed().as_secs_f64();
    let mut stats = decode(engine, tok, sampler, logits, req, history, emit)?;
    stats.prompt_tokens = req.prompt.len();
    stats.prefill_secs = prefill_secs;
    Ok(stats)
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
) -> Result<GenerationStats> {
    let mut decoder = tok.stream_decoder();
    let start = Instant::now();
    let mut generated = 0;
    let stop = loop {
        if generated >= req.max_new {
            break StopReason::Limit;
        }
        if (req.interrupted)() {
            break StopReason::Interrupted;
        }
        let window = sampler.config().repeat_last_n.min(history.len());
        let next = sampler.sample(&logits, &history[history.len() - window..]);
        if req.stop_ids.contains(&next) {
            break StopReason::StopToken(next);
        }
        emit(&decoder.push(next));
        generated += 1;
        if engine.position() >= engine.capacity() {
            break StopReason::ContextFull;
        }
        logits = engine.forward(&[next], LogitsWanted::Last)?;
        history.push(next);
    };
    emit(&decoder.finish());
    Ok(GenerationStats {
        prompt_tokens: 0,
        prefill_secs: 0.0,
        generated,
        decode_secs: start.elapsed().as_secs_f64(),
        stop,
    })
}

/// Generated text to stdout, flushed piece by piece so it appears as it is
/// made. A write error (a closed pipe) is kept, not raised mid-generation,
/// and reported by [`StdoutStream::finish`].
pub struct StdoutStream {
    out: std::io::StdoutLock<'static>,
    error: Option<std::io::Error>,
}

impl Default for StdoutStream {
    fn default() -> Self {
        StdoutStream {
            out: std::io::stdout().lock(),
            error: None,
        }
    }
}

impl StdoutStream {
    pub fn write(&mut self, piece: &str) {
        use std::io::Write;
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
        self.write(end);
        self.error.map_or(Ok(()), Err)
    }
}
