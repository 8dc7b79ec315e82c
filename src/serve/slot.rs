//! One request's generation, stepped by the scheduler: given the logits of
//! the last token fed, pick the next token and say what the client gets.
//!
//! This is `generate::decode`'s loop turned inside out (the scheduler owns
//! the engine and feeds many sequences per step), with the same rules: stop
//! tokens are not shown, stop strings are caught however the tokens split
//! them and never shown, an output constraint masks the logits and ends the
//! output when complete. It knows nothing of the engine, so it is tested on
//! made-up logits.

use super::api::{ApiError, TokenLogprob, TopLogprob, Usage};
use super::tools::{CallFormat, RepeatWatch};
use crate::constrain::mask::mask_logits;
use crate::constrain::{ConstraintState, NextTokens};
use crate::sample::{Sampler, SamplerConfig};
use crate::speculative::{DraftOffer, Drafter};
use crate::stop_strings::{Scan, StopStrings};
use crate::tokenizer::{SPACE_MARK, StreamDecoder, TokenKind, Tokenizer, parse_byte_piece};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// What one request asked for, checked and resolved.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub sampling: SamplerConfig,
    pub seed: u64,
    /// Already capped by the context left after the prompt.
    pub max_tokens: usize,
    /// Shared by every prompt and choice of a request (checked once).
    pub stop_strings: Arc<[String]>,
    pub stop_ids: Arc<[u32]>,
    /// OpenAI's penalties, over the tokens generated so far.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to a token's logit; `-inf` bans it.
    pub logit_bias: Arc<[(u32, f32)]>,
    /// Report log-probabilities, with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Leave out the white space around the reply (chat: the dialogue
    /// format's model writes a space after `Assistant:` and a line break
    /// before the `User:` that ends its turn).
    pub trim: bool,
    /// Report the prompt tokens' log-probabilities too (`echo` with
    /// `logprobs`): every prompt position's logits are computed, none is
    /// taken from a cache.
    pub prompt_logprobs: bool,
    /// A function-calling reply in this call format ends at its first
    /// repeated call ([`RepeatWatch`]).
    pub calls: Option<CallFormat>,
}

impl GenParams {
    /// For a request that generates nothing (an embedding): its prompt is
    /// read and no token is ever sampled.
    pub fn read_only() -> GenParams {
        GenParams {
            sampling: SamplerConfig::greedy(),
            seed: 0,
            max_tokens: 0,
            stop_strings: Arc::from([]),
            stop_ids: Arc::from([]),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Arc::from([]),
            logprobs: None,
            trim: false,
            prompt_logprobs: false,
            calls: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token, a stop string, or a complete output constraint.
    Stop,
    /// `max_tokens`, or the end of the context.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the scheduler sends a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Text that is final (nothing held back as a possible stop string) and
    /// the log-probabilities of the tokens that wrote it.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Log-probabilities of prompt tokens, in order, before any `Delta`
    /// (`echo` with `logprobs`). The prompt's first token has no context to
    /// be scored in: its entry's `logprob` is NaN (null in JSON).
    PromptLogprobs(Vec<TokenLogprob>),
    /// The end, with exact counts.
    Done { reason: FinishReason, usage: Usage },
    /// An embedding job's vector (its only event): the mean of its
    /// tokens' final hidden states, scaled to length 1.
    Embedding(Vec<f32>),
    /// The request could not be served (sent instead of `Done`).
    Failed(ApiError),
}

/// After a step: feed this token next, or the generation is over (its
/// `Done` is in the events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Feed(u32),
    Finished(FinishReason),
}

/// Leaves out white space at the start and the end of a reply, holding
/// back white space until more text follows it (as `pulsar chat` prints
/// replies).
#[derive(Debug)]
struct ReplyTrim {
    on: bool,
    at_start: bool,
    held: String,
}

impl ReplyTrim {
    fn push(&mut self, piece: &str) -> String {
        if !self.on {
            return piece.to_string();
        }
        let piece = if self.at_start {
            piece.trim_start()
        } else {
            piece
        };
        let body = piece.trim_end();
        let mut out = String::new();
        if !body.is_empty() {
            self.at_start = false;
            out.push_str(&std::mem::take(&mut self.held));
            out.push_str(body);
        }
        self.held.push_str(&piece[body.len()..]);
        out
    }
}

/// Which pending log-probabilities a release of text takes along.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Release {
    /// Those of tokens whose text began in the text released so far.
    Released,
    /// As `Released`, and the rest are dropped: a stop string ended the
    /// text.
    Stop,
    /// All: the generation ended.
    All,
}

pub struct Generation<'t> {
    tok: &'t Tokenizer,
    params: GenParams,
    sampler: Sampler,
    constraint: Option<ConstraintState>,
    decoder: StreamDecoder<'t>,
    stops: StopStrings,
    trim: ReplyTrim,
    repeat_watch: Option<RepeatWatch>,
    /// Prompt and generated tokens, for the repetition penalty.
    history: Vec<u32>,
    /// How often each generated token came, for OpenAI's penalties.
    counts: HashMap<u32, u32>,
    generated: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// Bytes of decoded text so far, and of it, released past the stop
    /// strings' matcher.
    text_len: usize,
    released: usize,
    /// Log-probabilities of tokens whose text is not yet released, with
    /// where that text starts.
    pending_logprobs: VecDeque<(usize, TokenLogprob)>,
    finished: Option<FinishReason>,
}

impl<'t> Generation<'t> {
    pub fn new(
        tok: &'t Tokenizer,
        params: GenParams,
        constraint: Option<ConstraintState>,
        prompt: &[u32],
        cached_tokens: usize,
    ) -> Generation<'t> {
        Generation {
            tok,
            sampler: Sampler::new(params.sampling, params.seed),
            constraint,
            decoder: tok.stream_decoder(),
            stops: StopStrings::new(&params.stop_strings[..]),
            trim: ReplyTrim {
                on: params.trim,
                at_start: true,
                held: String::new(),
            },
            repeat_watch: params.calls.map(RepeatWatch::new),
            history: prompt.to_vec(),
            counts: HashMap::new(),
            generated: 0,
            prompt_tokens: prompt.len(),
            cached_tokens,
            text_len: 0,
            released: 0,
            pending_logprobs: VecDeque::new(),
            finished: None,
            params,
        }
    }

    /// The constraint, for computing the next mask on a helper thread
    /// while the forward pass runs.
    pub fn constraint_mut(&mut self) -> Option<&mut ConstraintState> {
        self.constraint.as_mut()
    }

    pub fn generated(&self) -> usize {
        self.generated
    }

    /// A draft from `drafter` to feed after the last token: from the
    /// prompt and reply so far, at most `room` tokens and no more than the
    /// request may still generate, cut where the output constraint would
    /// refuse it.
    pub fn draft(&mut self, drafter: &mut Drafter, room: usize) -> Vec<u32> {
        match self.offer_draft(drafter, room) {
            Some(offer) => drafter.take_alone(offer),
            None => Vec::new(),
        }
    }

    /// The draft [`Generation::draft`] would take from, before its length
    /// is chosen (a step of several requests chooses them together).
    pub fn offer_draft(&mut self, drafter: &mut Drafter, room: usize) -> Option<DraftOffer> {
        let room = room.min(self.params.max_tokens.saturating_sub(self.generated));
        let constraint = &mut self.constraint;
        drafter.offer(&self.history, room, |draft| match constraint {
            Some(state) => state.allowed_prefix(draft),
            None => draft.len(),
        })
    }

    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }

    /// Counts `n` more prompt tokens as taken from a cache rather than
    /// fed (another slot's, copied).
    pub fn add_cached(&mut self, n: usize) {
        self.cached_tokens += n;
    }

    pub fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.cached_tokens, self.generated)
    }

    /// Takes the logits of the last token fed and picks the next token.
    /// `allowed` is the constraint's mask computed ahead (computed here
    /// when the constraint has one and it was not). Events for the client
    /// go to `out`.
    pub fn step(
        &mut self,
        logits: &mut [f32],
        allowed: Option<NextTokens>,
        out: &mut Vec<Event>,
    ) -> Outcome {
        if let Some(reason) = self.finished {
            return Outcome::Finished(reason);
        }
        if self.generated >= self.params.max_tokens {
            return self.finish(FinishReason::Length, out);
        }
        // Log-probabilities are those of the model's own distribution: the
        // log-softmax of the raw logits, before the logit bias, penalties,
        // constraint mask and temperature that shape the draw.
        let raw = self.params.logprobs.map(|_| logits.to_vec());
        for &(id, bias) in self.params.logit_bias.iter() {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            for (&id, &count) in &self.counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -=
                        self.params.presence_penalty + self.params.frequency_penalty * count as f32;
                }
            }
        }
        if let Some(state) = &mut self.constraint {
            let next = allowed.unwrap_or_else(|| state.next_tokens());
            match next {
                NextTokens::Allowed(mask) => mask_logits(logits, &mask),
                NextTokens::Complete => return self.finish(FinishReason::Stop, out),
                NextTokens::DeadEnd(why) => {
                    eprintln!("pulsar serve: generation stopped: {why}");
                    return self.finish(FinishReason::Stop, out);
                }
            }
        }
        let window = self.params.sampling.repeat_last_n.min(self.history.len());
        let next = self
            .sampler
            .sample(logits, &self.history[self.history.len() - window..]);
        if self.params.stop_ids.contains(&next) {
            return self.finish(FinishReason::Stop, out);
        }
        if let Some(state) = &mut self.constraint
            && let Err(why) = state.take(next)
        {
            eprintln!("pulsar serve: generation stopped: {why}");
            return self.finish(FinishReason::Stop, out);
        }
        self.generated += 1;
        self.history.push(next);
        *self.counts.entry(next).or_insert(0) += 1;
        if let (Some(raw), Some(top)) = (raw, self.params.logprobs) {
            let entry = token_logprob(self.tok, &raw, next, top);
            self.pending_logprobs.push_back((self.text_len, entry));
        }
        let piece = self.decoder.push(next);
        if self.show(&piece, out) {
            return self.finish_stopped(out);
        }
        if let Some(watch) = &mut self.repeat_watch
            && watch.push(&piece)
        {
            return self.finish(FinishReason::Stop, out);
        }
        if self.generated >= self.params.max_tokens {
            return self.finish(FinishReason::Length, out);
        }
        Outcome::Feed(next)
    }

    /// Runs a piece of decoded text through the stop strings and sends
    /// what is final. Returns whether a stop string completed.
    fn show(&mut self, piece: &str, out: &mut Vec<Event>) -> bool {
        self.text_len += piece.len();
        let (text, stopped) = match self.stops.push(piece) {
            Scan::Go(text) => (text, false),
            Scan::Stop { text, .. } => (text, true),
        };
        self.released += text.len();
        let release = if stopped {
            Release::Stop
        } else {
            Release::Released
        };
        self.send(&text, release, out);
        stopped
    }

    /// Sends released text with the log-probabilities of the tokens whose
    /// text began in it.
    fn send(&mut self, text: &str, release: Release, out: &mut Vec<Event>) {
        let mut logprobs = Vec::new();
        while let Some((start, _)) = self.pending_logprobs.front() {
            // A token whose text is still empty (an unfinished character)
            // starts where the released text ends: it goes with the next
            // release, or at the end.
            if *start >= self.released && release != Release::All {
                break;
            }
            if let Some((_, entry)) = self.pending_logprobs.pop_front() {
                logprobs.push(entry);
            }
        }
        if release == Release::Stop {
            // Tokens that began inside the stop string go with it.
            self.pending_logprobs.clear();
        }
        let text = self.trim.push(text);
        if !text.is_empty() || !logprobs.is_empty() {
            out.push(Event::Delta { text, logprobs });
        }
    }

    fn finish_stopped(&mut self, out: &mut Vec<Event>) -> Outcome {
        self.finished = Some(FinishReason::Stop);
        out.push(Event::Done {
            reason: FinishReason::Stop,
            usage: self.usage(),
        });
        Outcome::Finished(FinishReason::Stop)
    }

    /// Ends the generation for a reason other than a stop string: what the
    /// decoder and the stop strings held back is released (a stop string
    /// can still complete in the decoder's last bytes).
    pub fn finish(&mut self, reason: FinishReason, out: &mut Vec<Event>) -> Outcome {
        if let Some(reason) = self.finished {
            return Outcome::Finished(reason);
        }
        let tail = self.decoder.finish();
        if self.show(&tail, out) {
            return self.finish_stopped(out);
        }
        if reason == FinishReason::Length {
            // The start of a stop string the limit cut stays hidden.
            self.stops.discard();
        }
        let held = self.stops.finish();
        self.released += held.len();
        self.send(&held, Release::All, out);
        self.finished = Some(reason);
        out.push(Event::Done {
            reason,
            usage: self.usage(),
        });
        Outcome::Finished(reason)
    }
}

/// A token as the API shows it: its text (`▁` as a space, a byte token as
/// its byte, a control token as its name) and that text's bytes.
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let (Some(kind), Some(piece)) = (tok.token_kind(id), tok.token_text(id)) else {
        return (String::new(), Vec::new());
    };
    let bytes = match kind {
        TokenKind::Byte => parse_byte_piece(piece).map_or_else(Vec::new, |b| vec![b]),
        TokenKind::Normal | TokenKind::UserDefined => piece.replace(SPACE_MARK, " ").into_bytes(),
        TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => piece.as_bytes().to_vec(),
    };
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The log-probabilities of the prompt tokens a run predicts: the run fed
/// tokens `from..` and `rows` are its logits, `width` wide (row r: after
/// token `from + r`, so for token `from + r + 1`), each entry with its
/// `top` alternatives. A run from 0 also gives token 0's entry, unscored
/// (no context precedes it). In the echoed prompt a control token (BOS)
/// writes no text, so its entry's text is empty and the entries' texts add
/// up to the echoed text.
pub fn prompt_logprobs(
    tok: &Tokenizer,
    prompt: &[u32],
    from: usize,
    rows: &[f32],
    width: usize,
    top: usize,
) -> Vec<TokenLogprob> {
    let shown = |mut entry: TokenLogprob, id: u32| {
        if tok.token_kind(id) == Some(TokenKind::Control) {
            entry.token.clear();
            entry.bytes.clear();
        }
        entry
    };
    let mut out = Vec::new();
    if from == 0
        && let Some(&id) = prompt.first()
    {
        let (token, bytes) = token_text(tok, id);
        let unscored = TokenLogprob {
            token,
            logprob: f32::NAN,
            bytes,
            top_logprobs: Vec::new(),
        };
        out.push(shown(unscored, id));
    }
    for (r, row) in rows.chunks_exact(width.max(1)).enumerate() {
        let Some(&id) = prompt.get(from + r + 1) else {
            break;
        };
        out.push(shown(token_logprob(tok, row, id, top), id));
    }
    out
}

/// The sampled token's log-probability and the `top` most likely tokens',
/// from the log-softmax of the raw logits (NaN counts as impossible).
pub fn token_logprob(tok: &Tokenizer, raw: &[f32], token: u32, top: usize) -> TokenLogprob {
    let clean = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = raw
        .iter()
        .copied()
        .map(clean)
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = raw.iter().map(|&l| f64::from(clean(l) - max).exp()).sum();
    let log_norm = f64::from(max) + sum.ln();
    let logprob = |id: u32| {
        raw.get(id as usize).map_or(f32::NEG_INFINITY, |&l| {
            (f64::from(clean(l)) - log_norm) as f32
        })
    };
    // The `top` best ids, best first, lower id on ties.
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &l) in raw.iter().enumerate() {
            let l = clean(l);
            if best.len() == top && best.last().is_some_and(|&(worst, _)| l <= worst) {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= l);
            best.insert(at, (l, id as u32));
            best.truncate(top);
        }
    }
    let (text, bytes) = token_text(tok, token);
    TokenLogprob {
        token: text,
        logprob: logprob(token),
        bytes,
        top_logprobs: best
            .into_iter()
            .map(|(_, id)| {
                let (token, bytes) = token_text(tok, id);
                TopLogprob {
                    token,
                    logprob: logprob(id),
                    bytes,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::TokenKind::*;

    fn tokenizer() -> Tokenizer {
        Tokenizer::for_tests(&[
            ("<eos>", Control),
            ("<bos>", Control),
            ("He", Normal),
            ("llo", Normal),
            ("\n", Normal),
            ("Us", Normal),
            ("er", Normal),
            (":", Normal),
            ("▁", Normal),
            ("!", Normal),
        ])
    }

    fn params() -> GenParams {
        GenParams {
            seed: 1,
            max_tokens: 100,
            stop_strings: Arc::from(["\nUser:".to_string()]),
            stop_ids: Arc::from([0]),
            ..GenParams::read_only()
        }
    }

    /// Logits that make `id` the greedy choice.
    fn pick(id: u32) -> Vec<f32> {
        let mut l = vec![0.0; 10];
        l[id as usize] = 5.0;
        l
    }

    /// Runs greedy steps choosing `ids` in turn; returns the text sent, the
    /// outcomes and the last event.
    fn run(g: &mut Generation, ids: &[u32]) -> (String, Vec<Outcome>, Vec<Event>) {
        let mut events = Vec::new();
        let mut outcomes = Vec::new();
        for &id in ids {
            let o = g.step(&mut pick(id), None, &mut events);
            outcomes.push(o);
            if let Outcome::Finished(_) = o {
                break;
            }
        }
        let text = events
            .iter()
            .filter_map(|e| match e {
                Event::Delta { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        (text, outcomes, events)
    }

    #[test]
    fn a_stop_string_split_across_tokens_ends_the_reply_unshown() {
        let tok = tokenizer();
        let mut g = Generation::new(&tok, params(), None, &[1], 0);
        let (text, outcomes, events) = run(&mut g, &[2, 3, 4, 5, 6, 7, 9]);
        assert_eq!(text, "Hello");
        assert_eq!(
            outcomes.last(),
            Some(&Outcome::Finished(FinishReason::Stop))
        );
        // Every token that was sampled counts, the stop string's too.
        match events.last() {
            Some(Event::Done { reason, usage }) => {
                assert_eq!(*reason, FinishReason::Stop);
                assert_eq!(usage.completion_tokens, 6);
                assert_eq!(usage.prompt_tokens, 1);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn held_back_text_is_released_when_it_cannot_become_a_stop() {
        let tok = tokenizer();
        let mut g = Generation::new(&tok, params(), None, &[1], 0);
        let (text, outcomes, _) = run(&mut g, &[2, 4, 5, 9, 0]);
        assert_eq!(text, "He\nUs!");
        assert_eq!(
            outcomes.last(),
            Some(&Outcome::Finished(FinishReason::Stop))
        );
        assert_eq!(g.generated(), 4, "the stop token is not counted");
    }

    #[test]
    fn max_tokens_ends_with_length() {
        let tok = tokenizer();
        let mut p = params();
        p.max_tokens = 2;
        let mut g = Generation::new(&tok, p, None, &[1], 0);
        let (text, outcomes, _) = run(&mut g, &[2, 3, 2, 3]);
        assert_eq!(text, "Hello");
        assert_eq!(
            outcomes,
            vec![Outcome::Feed(2), Outcome::Finished(FinishReason::Length)]
        );
    }

    #[test]
    fn a_reply_is_trimmed_when_asked() {
        let tok = tokenizer();
        let mut p = params();
        p.trim = true;
        p.stop_strings = Arc::from([]);
        let mut g = Generation::new(&tok, p, None, &[1], 0);
        let (text, _, _) = run(&mut g, &[8, 2, 8, 3, 4, 8, 0]);
        assert_eq!(text, "He llo");
    }

    #[test]
    fn logit_bias_and_penalties_move_the_choice() {
        let tok = tokenizer();
        let mut p = params();
        p.logit_bias = Arc::from([(2, f32::NEG_INFINITY)]);
        let mut g = Generation::new(&tok, p, None, &[1], 0);
        let mut events = Vec::new();
        let mut logits = pick(2);
        logits[3] = 1.0;
        assert_eq!(g.step(&mut logits, None, &mut events), Outcome::Feed(3));

        let mut p = params();
        p.frequency_penalty = 2.0;
        let mut g = Generation::new(&tok, p, None, &[1], 0);
        let mut l = vec![0.0; 10];
        l[2] = 3.0;
        l[3] = 2.0;
        assert_eq!(g.step(&mut l.clone(), None, &mut events), Outcome::Feed(2));
        // "He" came once: 3 - 2 < 2.
        assert_eq!(g.step(&mut l, None, &mut events), Outcome::Feed(3));
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_and_stop_text_takes_its_tokens() {
        let tok = tokenizer();
        let mut p = params();
        p.logprobs = Some(2);
        let mut g = Generation::new(&tok, p, None, &[1], 0);
        let mut events = Vec::new();
        let mut logits = vec![0.0f32; 10];
        logits[2] = 2.0_f32.ln();
        // p(He) = 2 / 11, p(others) = 1 / 11 each.
        g.step(&mut logits, None, &mut events);
        let Some(Event::Delta { text, logprobs }) = events.first() else {
            panic!("{events:?}")
        };
        assert_eq!(text, "He");
        assert_eq!(logprobs.len(), 1);
        assert!((logprobs[0].logprob - (2.0f32 / 11.0).ln()).abs() < 1e-5);
        assert_eq!(logprobs[0].top_logprobs[0].token, "He");
        // Ties go to the lower id.
        assert_eq!(logprobs[0].top_logprobs[1].token, "<eos>");
        // "\n" and "Us" are held back, then dropped with the stop string.
        let (text, _, events) = run(&mut g, &[4, 5, 6, 7]);
        assert_eq!(text, "");
        let reported: usize = events
            .iter()
            .map(|e| match e {
                Event::Delta { logprobs, .. } => logprobs.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(reported, 0);
    }
}
