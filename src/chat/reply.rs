//! One exchange: make room for the user's turn, feed it, generate the
//! reply while streaming it, then feed the template's end of turn so the
//! cache holds a well-formed conversation even after an interrupt.

use super::conversation::Conversation;
use crate::constrain::CompiledConstraint;
use crate::constrain::lookahead::ConstraintReport;
use crate::engine::{Engine, LogitsWanted};
use crate::generate::{self, GenerationStats, Request, StopReason};
use crate::sample::Sampler;
use crate::speculative::Speculation;
use crate::tokenizer::Tokenizer;
use anyhow::{Result, bail};
use std::time::Instant;

/// Prompts are fed in pieces of this many tokens so that a long one (a
/// `-f` document, or turns fed again after a drop) can show progress.
pub const PREFILL_PIECE: usize = 128;

pub struct ReplySettings<'a> {
    pub max_new: usize,
    pub stop_ids: &'a [u32],
    /// Text that ends a reply (the dialogue template's `\nUser:`, `--stop`).
    pub stop_strings: &'a [String],
    /// Closes the model's turn (`<end_of_turn>\n`).
    pub model_end: &'a [u32],
    pub interrupted: &'a dyn Fn() -> bool,
    /// What every reply must be; each reply starts it afresh.
    pub constraint: Option<&'a CompiledConstraint>,
    /// Drafting and batched verification of the reply's tokens.
    pub speculation: Speculation,
}

#[derive(Clone, Debug)]
pub struct ReplyReport {
    /// Prompt tokens fed (the new turn, plus kept turns fed again after a
    /// drop, plus the previous end of turn) and generation speeds.
    pub stats: GenerationStats,
    /// The reply was cut because the context ran out (not by -n).
    pub cut_by_context: bool,
    /// Ctrl-C came before the reply began: the turn was taken back.
    pub abandoned: bool,
    /// How the output constraint went, when there was one.
    pub constraint: Option<ConstraintReport>,
}

/// Tokens a user turn needs free before it starts: the turn, room for a
/// reply (a whole -n reply where the context allows, else half the
/// context) and the end of turn. Make room with
/// [`Conversation::make_room`] before calling [`reply`].
pub fn room_needed(conv: &Conversation, user_turn: &[u32], settings: &ReplySettings<'_>) -> usize {
    user_turn.len() + settings.max_new.min(conv.limit() / 2) + settings.model_end.len()
}

/// Feeds the conversation's unfed tokens by pieces, so that a long prompt
/// shows progress and Ctrl-C can stop it. Returns the last token's logits,
/// or `None` if `interrupted` said stop first. `progress` hears
/// `(fed, total)`.
pub fn feed(
    conv: &mut Conversation,
    engine: &mut dyn Engine,
    interrupted: &dyn Fn() -> bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Option<Vec<f32>>> {
    let base = conv.cached();
    let total = conv.len() - base;
    let mut logits = Vec::new();
    while conv.cached() < conv.len() {
        if interrupted() {
            return Ok(None);
        }
        let end = (conv.cached() + PREFILL_PIECE).min(conv.len());
        logits = conv.sync_to(engine, end, LogitsWanted::Last)?;
        progress(end - base, total);
    }
    Ok(Some(logits))
}

/// Runs one exchange: feeds the user's turn (after any turns that moved),
/// generates the reply, then feeds the end of turn, also when Ctrl-C
/// stopped the reply. `progress` hears `(fed, total)` prompt tokens;
/// `emit` gets the reply's text as it comes.
#[allow(clippy::too_many_arguments)]
pub fn reply(
    conv: &mut Conversation,
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    user_turn: &[u32],
    settings: &ReplySettings<'_>,
    progress: &mut dyn FnMut(usize, usize),
    emit: &mut dyn FnMut(&str),
) -> Result<ReplyReport> {
    if user_turn.is_empty() {
        // Sampling needs the logits of at least one fed token.
        bail!("internal error: an empty user turn");
    }
    let limit = conv.limit();
    conv.begin_exchange(user_turn);

    // A turn stopped before its reply began is taken back.
    let base = conv.cached();
    let pending = conv.len() - base;
    let start = Instant::now();
    let Some(logits) = feed(conv, engine, settings.interrupted, progress)? else {
        let fed = conv.cached() - base;
        conv.abandon_exchange();
        return Ok(ReplyReport {
            stats: GenerationStats {
                prompt_tokens: fed,
                prefill_secs: start.elapsed().as_secs_f64(),
                generated: 0,
                decode_secs: 0.0,
                stop: StopReason::Interrupted,
                spec: None,
            },
            cut_by_context: false,
            abandoned: true,
            constraint: None,
        });
    };
    let prefill_secs = start.elapsed().as_secs_f64();

    let mut history = conv.tokens().to_vec();
    let before = history.len();
    // Leave room for the end of turn after the longest allowed reply.
    let room = limit.saturating_sub(conv.len() + settings.model_end.len());
    let max_new = settings.max_new.min(room);
    let decoded = generate::decode(
        engine,
        tok,
        sampler,
        logits,
        &Request {
            prompt: &[],
            max_new,
            stop_ids: settings.stop_ids,
            stop_strings: settings.stop_strings,
            interrupted: settings.interrupted,
            constraint: settings.constraint,
            speculation: settings.speculation,
        },
        &mut history,
        emit,
    )?;
    // `history` now also holds every reply token the loop fed; a stop
    // token it sampled was not fed and is not there.
    conv.push_fed(engine, &history[before..])?;
    if let Some(cut) = &decoded.cut {
        // The tokens that began the stop string were fed; the reply ends
        // where the stop string began, so they are taken back and any
        // text of the reply they also held is fed in their place.
        conv.take_back(before + cut.tokens_before);
        conv.push(&tok.encode_untrusted(&cut.text_between, false));
    }
    // The reply's last token when the limit came right after it: fed with
    // the end of turn.
    conv.push(&decoded.unfed);
    conv.push(settings.model_end);
    conv.sync(engine, LogitsWanted::Last)?;

    let mut stats = decoded.stats;
    stats.prompt_tokens = pending;
    stats.prefill_secs = prefill_secs;
    let cut_by_context = stats.stop == StopReason::ContextFull
        || (stats.stop == StopReason::Limit && max_new < settings.max_new);
    Ok(ReplyReport {
        stats,
        cut_by_context,
        abandoned: false,
        constraint: decoded.constraint,
    })
}
