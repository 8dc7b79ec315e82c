//! One sequence's generation: the only place a token is chosen, a drafted
//! token confirmed or rejected, and a reply ended.
//!
//! A [`Generation`] is given the logits of the tokens its driver fed and
//! says what to feed next or why the reply is over. It knows nothing of
//! the engine: `pulsar run` and `pulsar chat` drive one over a single
//! sequence ([`super::decode`]); the server's scheduler drives many, one
//! per request, and runs the engine once per step for all of them. The
//! rules are the same for both:
//! - stop tokens end the reply unshown and unfed; stop strings are caught
//!   however the tokens split them and never shown;
//! - an output constraint masks the logits and ends the reply when
//!   complete (its next mask may be computed ahead, beside the forward
//!   pass: [`Generation::alongside`], [`Generation::look_ahead`]);
//! - with speculation, the drafted tokens fed after the sampled one are
//!   judged row by row with [`speculative::verify`] (one draw per row,
//!   accepted iff it is the draft), so a reply is the same with or without
//!   it;
//! - the limit ends the reply right after its last token, which is not
//!   fed (nothing would read its logits).

use super::logprobs::{TokenLogprob, token_logprob};
use super::{StopCut, StopReason};
use crate::constrain::lookahead::{ConstraintReport, MaskLookahead};
use crate::constrain::mask::mask_logits;
use crate::constrain::{ConstraintState, NextTokens};
use crate::sample::{Sampler, SamplerConfig};
use crate::speculative::{self, DraftModel, DraftOffer, Drafter, SpecStats, Speculation, Verdict};
use crate::stop_strings::{Scan, StopStrings};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// A check on the reply so far that can end it (the server's: a function
/// call repeated word for word). Given the whole text and its newest
/// piece; true ends the reply with [`StopReason::Check`].
pub type ReplyCheck = fn(reply: &str, newest: &str) -> bool;

/// What one reply is asked for.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub sampling: SamplerConfig,
    pub seed: u64,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Shared by every prompt and choice of a server request (checked
    /// once).
    pub stop_strings: Arc<[String]>,
    pub stop_ids: Arc<[u32]>,
    /// OpenAI's penalties, over the tokens generated so far.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to a token's logit; `-inf` bans it.
    pub logit_bias: Arc<[(u32, f32)]>,
    /// Report log-probabilities, with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Leave out the white space around the reply (the dialogue format's
    /// model writes a space after `Assistant:` and a line break before
    /// the `User:` that ends its turn).
    pub trim: bool,
    /// Report the prompt tokens' log-probabilities too (`echo` with
    /// `logprobs`): every prompt position's logits are computed, none is
    /// taken from a cache.
    pub prompt_logprobs: bool,
    pub check: Option<ReplyCheck>,
}

impl GenParams {
    /// Greedy, no limit but `max_tokens`, nothing else asked: for a
    /// request that generates nothing (an embedding), and the base the
    /// others fill in.
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
            check: None,
        }
    }
}

/// Text that is final (nothing held back as a possible stop string), with
/// the log-probabilities of the tokens that wrote it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Piece {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
}

/// After a token is chosen: feed it next, or the reply is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Feed(u32),
    Finished(StopReason),
}

/// What judging a step's rows gave ([`Generation::judge`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judged {
    pub outcome: Outcome,
    /// Drafted tokens confirmed: each is in the driver's cache already.
    pub confirmed: usize,
    /// Drafted tokens that were fed in the step.
    pub drafted: usize,
}

/// Leaves out white space at the start and the end of a reply, holding
/// back white space until more text follows it.
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
    constraint: Option<MaskLookahead>,
    drafter: Option<Drafter>,
    /// Tokens drafted after the last chosen one, fed with it.
    drafts: Vec<u32>,
    decoder: StreamDecoder<'t>,
    stops: StopStrings,
    trim: ReplyTrim,
    /// The context and every token chosen, for the repetition penalty and
    /// the drafter.
    history: Vec<u32>,
    /// How often each generated token came, for OpenAI's penalties.
    counts: HashMap<u32, u32>,
    generated: usize,
    /// Tokens that may be generated before the driver's cache is full.
    context_left: Option<usize>,
    /// The decoded text, and where each generated token's text ends in it.
    text: String,
    token_ends: Vec<usize>,
    /// Bytes of the text released past the stop strings' matcher.
    released: usize,
    /// Where a stop string began in `text`, once one did.
    cut_at: Option<usize>,
    /// Log-probabilities of tokens whose text is not yet released, with
    /// where that text starts.
    pending_logprobs: VecDeque<(usize, TokenLogprob)>,
    finished: Option<StopReason>,
}

impl<'t> Generation<'t> {
    /// A reply after `context`, the tokens already in the sequence.
    pub fn new(
        tok: &'t Tokenizer,
        params: GenParams,
        sampler: Sampler,
        context: &[u32],
    ) -> Generation<'t> {
        Generation {
            tok,
            sampler,
            constraint: None,
            drafter: None,
            drafts: Vec::new(),
            decoder: tok.stream_decoder(),
            stops: StopStrings::new(&params.stop_strings[..]),
            trim: ReplyTrim {
                on: params.trim,
                at_start: true,
                held: String::new(),
            },
            history: context.to_vec(),
            counts: HashMap::new(),
            generated: 0,
            context_left: None,
            text: String::new(),
            token_ends: Vec::new(),
            released: 0,
            cut_at: None,
            pending_logprobs: VecDeque::new(),
            finished: None,
            params,
        }
    }

    /// The reply must satisfy this output constraint; `overlap` lets
    /// [`Generation::alongside`] compute its next mask beside the forward
    /// pass.
    pub fn with_constraint(mut self, state: ConstraintState, overlap: bool) -> Self {
        self.constraint = Some(MaskLookahead::new(state, overlap));
        self
    }

    /// Drafts tokens to feed after each chosen one.
    pub fn with_speculation(mut self, speculation: Speculation) -> Self {
        self.drafter = match speculation {
            Speculation::Ngram(options) => Some(Drafter::new(&self.history, options)),
            Speculation::Mtp(options) => Some(Drafter::for_model(options)),
            Speculation::Off => None,
        };
        self
    }

    /// The driver's cache holds `n` more tokens: the `n + 1`-th generated
    /// token is shown but cannot be fed, and ends the reply.
    pub fn with_context_left(mut self, n: usize) -> Self {
        self.context_left = Some(n + 1);
        self
    }

    pub fn generated(&self) -> usize {
        self.generated
    }

    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }

    /// The tokens drafted to feed after the last chosen one.
    pub fn drafts(&self) -> &[u32] {
        &self.drafts
    }

    /// Drafts at most `room` tokens (and no more than the reply may still
    /// generate) to feed after the last chosen token, their number chosen
    /// by this sequence's own policy; cut where the output constraint
    /// would refuse them. Empty without speculation. With a draft model
    /// (`--spec mtp`), `model(last, k)` drafts `k` tokens after the last
    /// chosen one (the driver runs its engine's assistant); an n-gram
    /// drafter never calls it. An error of the model's is the step's.
    pub fn draft_with(&mut self, room: usize, model: DraftModel<'_>) -> anyhow::Result<&[u32]> {
        self.drafts = match self.offer_draft_with(room, model)? {
            Some(offer) => self
                .drafter
                .as_mut()
                .map_or_else(Vec::new, |d| d.take_alone(offer)),
            None => Vec::new(),
        };
        Ok(&self.drafts)
    }

    /// The draft [`Generation::draft_with`] would take from, before its length
    /// is chosen (a step of several sequences chooses them together, then
    /// calls [`Generation::take_draft`]). A drafter that uses a draft
    /// model offers nothing here: see [`Generation::offer_draft_with`].
    pub fn offer_draft(&mut self, room: usize) -> Option<DraftOffer> {
        let drafter = self.drafter.as_mut()?;
        let room = room.min(self.params.max_tokens.saturating_sub(self.generated));
        let constraint = &mut self.constraint;
        drafter.offer(&self.history, room, |draft| match constraint {
            Some(lookahead) => lookahead.allowed_prefix(draft),
            None => draft.len(),
        })
    }

    /// [`Generation::offer_draft`] with a draft model to run when the
    /// drafter uses one: its round after the last chosen token, as long as
    /// this sequence's own policy would verify (a shared step may take
    /// fewer), cut where the output constraint would refuse it.
    pub fn offer_draft_with(
        &mut self,
        room: usize,
        model: DraftModel<'_>,
    ) -> anyhow::Result<Option<DraftOffer>> {
        let Some(drafter) = self.drafter.as_mut() else {
            return Ok(None);
        };
        if !drafter.uses_model() {
            return Ok(self.offer_draft(room));
        }
        let room = room.min(self.params.max_tokens.saturating_sub(self.generated));
        let (Some(&last), true) = (self.history.last(), room > 0) else {
            return Ok(None);
        };
        let constraint = &mut self.constraint;
        drafter.offer_from_model(last, room, model, |draft| match constraint {
            Some(lookahead) => lookahead.allowed_prefix(draft),
            None => draft.len(),
        })
    }

    /// The first `k` tokens of `offer` as the draft to feed.
    pub fn take_draft(&mut self, offer: DraftOffer, k: usize) -> &[u32] {
        self.drafts = self
            .drafter
            .as_mut()
            .map_or_else(Vec::new, |d| d.take(offer, k));
        &self.drafts
    }

    /// A forward step of `m` tokens this sequence had to itself took
    /// `secs` (the draft policy fits its cost model to these).
    pub fn step_done(&mut self, m: usize, secs: f64) {
        if let Some(d) = &mut self.drafter {
            d.step_done(m, secs);
        }
    }

    /// Runs `forward` while the output constraint's next mask is computed
    /// on a helper thread (when it has one and overlapping is on).
    pub fn alongside<T>(&mut self, forward: impl FnOnce() -> T) -> T {
        match &mut self.constraint {
            Some(lookahead) => lookahead.alongside(forward),
            None => forward(),
        }
    }

    /// Computes the output constraint's next mask now, so that the next
    /// judgement does not wait for it: the server runs this on a helper
    /// thread for every sequence of a step while the step runs.
    pub fn look_ahead(&mut self) {
        if let Some(lookahead) = &mut self.constraint {
            lookahead.compute_ahead();
        }
    }

    /// Whether the next judgement needs a mask computed.
    pub fn has_constraint(&self) -> bool {
        self.constraint.is_some()
    }

    /// Judges a step's logits: `rows` holds one row per token fed, the
    /// last chosen token's and then one per draft. Row `j` chooses the
    /// token after the `j`-th draft; while the choice confirms the next
    /// draft, the walk goes on. `interrupted` is asked before each row
    /// (Ctrl-C ends a reply between two tokens, also within a step). Text
    /// for the client goes to `out` as it is final.
    pub fn judge(
        &mut self,
        rows: &mut [f32],
        interrupted: &dyn Fn() -> bool,
        out: &mut dyn FnMut(Piece),
    ) -> Judged {
        let drafts = std::mem::take(&mut self.drafts);
        let width = rows.len() / (1 + drafts.len());
        let mut confirmed = 0;
        let outcome = loop {
            if self.finished.is_none() && self.generated < self.params.max_tokens && interrupted() {
                break self.finish(StopReason::Interrupted, out);
            }
            let row = &mut rows[confirmed * width..(confirmed + 1) * width];
            let draft = drafts.get(confirmed).copied();
            match self.step(row, draft, out) {
                Outcome::Feed(token) if draft == Some(token) => confirmed += 1,
                outcome => break outcome,
            }
        };
        if let Some(d) = &mut self.drafter
            && !drafts.is_empty()
        {
            match outcome {
                Outcome::Feed(_) => d.verified(confirmed),
                // The rest of the draft was never judged.
                Outcome::Finished(_) => d.abandon(confirmed),
            }
        }
        Judged {
            outcome,
            confirmed,
            drafted: drafts.len(),
        }
    }

    /// Chooses the token after one row of logits: a draw, or with a
    /// `draft` the verdict on it ([`speculative::verify`]).
    fn step(
        &mut self,
        logits: &mut [f32],
        draft: Option<u32>,
        out: &mut dyn FnMut(Piece),
    ) -> Outcome {
        if let Some(reason) = self.finished {
            return Outcome::Finished(reason);
        }
        if self.generated >= self.params.max_tokens {
            return self.finish(StopReason::Limit, out);
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
        if let Some(lookahead) = &mut self.constraint {
            match lookahead.next_tokens() {
                NextTokens::Allowed(mask) => {
                    let masking = Instant::now();
                    mask_logits(logits, &mask);
                    lookahead.add_wait(masking.elapsed().as_secs_f64());
                }
                NextTokens::Complete => return self.finish(StopReason::ConstraintComplete, out),
                NextTokens::DeadEnd(why) => {
                    lookahead.record_dead_end(why);
                    return self.finish(StopReason::ConstraintDeadEnd, out);
                }
            }
        }
        let window = self.sampler.config().repeat_last_n.min(self.history.len());
        let recent = &self.history[self.history.len() - window..];
        let dist = self.sampler.distribution(logits, recent);
        let next = match draft {
            Some(draft) => match speculative::verify(dist, draft) {
                Verdict::Accepted => draft,
                Verdict::Rejected(other) => other,
            },
            None => dist.draw(),
        };
        if self.params.stop_ids.contains(&next) {
            return self.finish(StopReason::StopToken(next), out);
        }
        if let Some(lookahead) = &mut self.constraint
            && let Err(why) = lookahead.take(next)
        {
            lookahead.record_dead_end(why);
            return self.finish(StopReason::ConstraintDeadEnd, out);
        }
        self.generated += 1;
        self.history.push(next);
        *self.counts.entry(next).or_insert(0) += 1;
        if let (Some(raw), Some(top)) = (raw, self.params.logprobs) {
            let entry = token_logprob(self.tok, &raw, next, top);
            self.pending_logprobs.push_back((self.text.len(), entry));
        }
        let piece = self.decoder.push(next);
        let stopped = self.show(&piece, out);
        self.token_ends.push(self.text.len());
        if stopped {
            return self.finish_stopped(StopReason::StopString);
        }
        if let Some(check) = self.params.check
            && check(&self.text, &piece)
        {
            return self.finish(StopReason::Check, out);
        }
        if self.context_left.is_some_and(|n| self.generated >= n) {
            return self.finish(StopReason::ContextFull, out);
        }
        if self.generated >= self.params.max_tokens {
            return self.finish(StopReason::Limit, out);
        }
        Outcome::Feed(next)
    }

    /// Runs a piece of decoded text through the stop strings and sends
    /// what is final. Returns whether a stop string completed.
    fn show(&mut self, piece: &str, out: &mut dyn FnMut(Piece)) -> bool {
        self.text.push_str(piece);
        let (text, stopped) = match self.stops.push(piece) {
            Scan::Go(text) => (text, false),
            Scan::Stop { text, at } => {
                self.cut_at = Some(at);
                (text, true)
            }
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
    fn send(&mut self, text: &str, release: Release, out: &mut dyn FnMut(Piece)) {
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
            out(Piece { text, logprobs });
        }
    }

    fn finish_stopped(&mut self, reason: StopReason) -> Outcome {
        self.finished = Some(reason);
        Outcome::Finished(reason)
    }

    /// Ends the reply for a reason other than a stop string (also from
    /// outside: an interrupt): what the decoder and the stop strings held
    /// back is released; a stop string can still complete in the
    /// decoder's last bytes.
    pub fn finish(&mut self, reason: StopReason, out: &mut dyn FnMut(Piece)) -> Outcome {
        if let Some(reason) = self.finished {
            return Outcome::Finished(reason);
        }
        let tail = self.decoder.finish();
        if self.show(&tail, out) {
            return self.finish_stopped(StopReason::StopString);
        }
        if reason == StopReason::Limit {
            // The start of a stop string the limit cut stays hidden.
            self.stops.discard();
        }
        let held = self.stops.finish();
        self.released += held.len();
        self.send(&held, Release::All, out);
        self.finished = Some(reason);
        Outcome::Finished(reason)
    }

    /// Where a stop string cut the reply, so that a driver keeping its
    /// cache (chat) can take back what was fed past it.
    pub fn stop_cut(&self) -> Option<StopCut> {
        let at = self.cut_at?;
        let tokens_before = self.token_ends.iter().take_while(|&&end| end <= at).count();
        let from = tokens_before
            .checked_sub(1)
            .map_or(0, |i| self.token_ends[i]);
        Some(StopCut {
            tokens_before,
            text_between: self.text[from..at].to_string(),
        })
    }

    /// The tokens chosen, in order (a stop token is never among them).
    pub fn reply_tokens(&self) -> &[u32] {
        &self.history[self.history.len() - self.generated..]
    }

    pub fn spec_stats(&self) -> Option<SpecStats> {
        self.drafter.as_ref().map(Drafter::stats)
    }

    /// Why the output constraint ended the reply at a dead end, if it did.
    pub fn dead_end(&self) -> Option<&str> {
        self.constraint.as_ref()?.dead_end()
    }

    /// The sampler back (chat keeps one across replies) and how the output
    /// constraint went.
    pub fn into_parts(self) -> (Sampler, Option<ConstraintReport>) {
        (
            self.sampler,
            self.constraint.map(MaskLookahead::into_report),
        )
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

    fn generation(tok: &Tokenizer, p: GenParams) -> Generation<'_> {
        let sampler = Sampler::new(p.sampling, p.seed);
        Generation::new(tok, p, sampler, &[1])
    }

    /// Logits that make `id` the greedy choice.
    fn pick(id: u32) -> Vec<f32> {
        let mut l = vec![0.0; 10];
        l[id as usize] = 5.0;
        l
    }

    /// Runs greedy steps choosing `ids` in turn; returns the text sent, the
    /// outcomes and the pieces.
    fn run(g: &mut Generation, ids: &[u32]) -> (String, Vec<Outcome>, Vec<Piece>) {
        let mut pieces = Vec::new();
        let mut outcomes = Vec::new();
        for &id in ids {
            let o = judge(g, &mut pick(id), &mut pieces).outcome;
            outcomes.push(o);
            if let Outcome::Finished(_) = o {
                break;
            }
        }
        let text = pieces.iter().map(|p| p.text.as_str()).collect();
        (text, outcomes, pieces)
    }

    /// Judges rows uninterrupted, keeping the pieces.
    fn judge(g: &mut Generation, rows: &mut [f32], pieces: &mut Vec<Piece>) -> Judged {
        g.judge(rows, &|| false, &mut |p| pieces.push(p))
    }

    #[test]
    fn a_stop_string_split_across_tokens_ends_the_reply_unshown() {
        let tok = tokenizer();
        let mut g = generation(&tok, params());
        let (text, outcomes, _) = run(&mut g, &[2, 3, 4, 5, 6, 7, 9]);
        assert_eq!(text, "Hello");
        assert_eq!(
            outcomes.last(),
            Some(&Outcome::Finished(StopReason::StopString))
        );
        // Every token that was sampled counts, the stop string's too.
        assert_eq!(g.generated(), 6);
        let cut = g.stop_cut().expect("a cut");
        assert_eq!(cut.tokens_before, 2);
        assert_eq!(cut.text_between, "");
    }

    #[test]
    fn held_back_text_is_released_when_it_cannot_become_a_stop() {
        let tok = tokenizer();
        let mut g = generation(&tok, params());
        let (text, outcomes, _) = run(&mut g, &[2, 4, 5, 9, 0]);
        assert_eq!(text, "He\nUs!");
        assert_eq!(
            outcomes.last(),
            Some(&Outcome::Finished(StopReason::StopToken(0)))
        );
        assert_eq!(g.generated(), 4, "the stop token is not counted");
        assert_eq!(g.reply_tokens(), [2, 4, 5, 9]);
    }

    #[test]
    fn max_tokens_ends_right_after_the_last_token() {
        let tok = tokenizer();
        let mut p = params();
        p.max_tokens = 2;
        let mut g = generation(&tok, p);
        let (text, outcomes, _) = run(&mut g, &[2, 3, 2, 3]);
        assert_eq!(text, "Hello");
        assert_eq!(
            outcomes,
            vec![Outcome::Feed(2), Outcome::Finished(StopReason::Limit)]
        );
    }

    #[test]
    fn a_full_context_ends_the_reply_after_the_token_that_cannot_be_fed() {
        let tok = tokenizer();
        let mut g = generation(&tok, params()).with_context_left(1);
        let (text, outcomes, _) = run(&mut g, &[2, 3, 2]);
        assert_eq!(text, "Hello");
        assert_eq!(
            outcomes,
            vec![Outcome::Feed(2), Outcome::Finished(StopReason::ContextFull)]
        );
    }

    #[test]
    fn a_reply_is_trimmed_when_asked() {
        let tok = tokenizer();
        let mut p = params();
        p.trim = true;
        p.stop_strings = Arc::from([]);
        let mut g = generation(&tok, p);
        let (text, _, _) = run(&mut g, &[8, 2, 8, 3, 4, 8, 0]);
        assert_eq!(text, "He llo");
    }

    #[test]
    fn a_reply_check_ends_the_reply() {
        let tok = tokenizer();
        let mut p = params();
        p.check = Some(|reply, newest| newest == "!" && reply.ends_with("llo!"));
        let mut g = generation(&tok, p);
        let (text, outcomes, _) = run(&mut g, &[2, 9, 3, 9, 2]);
        assert_eq!(text, "He!llo!");
        assert_eq!(outcomes.last(), Some(&Outcome::Finished(StopReason::Check)));
    }

    #[test]
    fn logit_bias_and_penalties_move_the_choice() {
        let tok = tokenizer();
        let mut p = params();
        p.logit_bias = Arc::from([(2, f32::NEG_INFINITY)]);
        let mut g = generation(&tok, p);
        let mut pieces = Vec::new();
        let mut logits = pick(2);
        logits[3] = 1.0;
        assert_eq!(
            judge(&mut g, &mut logits, &mut pieces).outcome,
            Outcome::Feed(3)
        );

        let mut p = params();
        p.frequency_penalty = 2.0;
        let mut g = generation(&tok, p);
        let mut l = vec![0.0; 10];
        l[2] = 3.0;
        l[3] = 2.0;
        assert_eq!(
            judge(&mut g, &mut l.clone(), &mut pieces).outcome,
            Outcome::Feed(2)
        );
        // "He" came once: 3 - 2 < 2.
        assert_eq!(judge(&mut g, &mut l, &mut pieces).outcome, Outcome::Feed(3));
    }

    /// Rows after confirmed drafts are judged in the same call; the first
    /// miss ends the walk with the token drawn instead.
    #[test]
    fn drafts_are_confirmed_row_by_row_until_the_first_miss() {
        let tok = tokenizer();
        let options = speculative::DraftOptions {
            step_cost: Some(0.0),
            ..speculative::DraftOptions::default()
        };
        let mut p = params();
        p.stop_strings = Arc::from([]);
        let sampler = Sampler::new(p.sampling, p.seed);
        // "He llo He llo": the drafter offers "llo" after "He".
        let mut g = Generation::new(&tok, p, sampler, &[1, 2, 3, 2, 3])
            .with_speculation(Speculation::Ngram(options));
        let mut pieces = Vec::new();
        assert_eq!(
            judge(&mut g, &mut pick(2), &mut pieces).outcome,
            Outcome::Feed(2)
        );
        let mut no_model = |_: u32, _: usize| -> anyhow::Result<Vec<u32>> {
            unreachable!("an n-gram drafter runs no model")
        };
        let drafts = g.draft_with(8, &mut no_model).expect("draft").to_vec();
        assert!(drafts.len() >= 2 && drafts[..2] == [3, 2], "{drafts:?}");
        // Rows: after "He" → "llo" (confirms), after "llo" → "!" (misses
        // the drafted "He").
        let mut rows: Vec<f32> = [pick(3), pick(9)].concat();
        rows.resize(10 * (1 + drafts.len()), 0.0);
        let judged = judge(&mut g, &mut rows, &mut pieces);
        assert_eq!(judged.outcome, Outcome::Feed(9));
        assert_eq!((judged.confirmed, judged.drafted), (1, drafts.len()));
        assert_eq!(g.reply_tokens(), [2, 3, 9]);
        let spec = g.spec_stats().expect("stats");
        assert_eq!((spec.drafted, spec.accepted), (drafts.len(), 1));
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_and_stop_text_takes_its_tokens() {
        let tok = tokenizer();
        let mut p = params();
        p.logprobs = Some(2);
        let mut g = generation(&tok, p);
        let mut pieces = Vec::new();
        let mut logits = vec![0.0f32; 10];
        logits[2] = 2.0_f32.ln();
        // p(He) = 2 / 11, p(others) = 1 / 11 each.
        judge(&mut g, &mut logits, &mut pieces);
        let Some(Piece { text, logprobs }) = pieces.first() else {
            panic!("{pieces:?}")
        };
        assert_eq!(text, "He");
        assert_eq!(logprobs.len(), 1);
        assert!((logprobs[0].logprob - (2.0f32 / 11.0).ln()).abs() < 1e-5);
        assert_eq!(logprobs[0].top_logprobs[0].token, "He");
        // Ties go to the lower id.
        assert_eq!(logprobs[0].top_logprobs[1].token, "<eos>");
        // "\n" and "Us" are held back, then dropped with the stop string.
        let before = pieces.len();
        for id in [4, 5, 6, 7] {
            judge(&mut g, &mut pick(id), &mut pieces);
        }
        assert!(g.is_finished());
        let after: usize = pieces[before..].iter().map(|p| p.logprobs.len()).sum();
        assert_eq!(after, 0, "{pieces:?}");
    }
}
