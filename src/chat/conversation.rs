//! A conversation as a token sequence that mirrors the engine's KV cache.
//!
//! The tokens are a fixed prefix (BOS, the opening of the first user turn,
//! the system text and document) followed by exchanges: one user turn plus
//! the model's reply and its closing `<end_of_turn>\n`. The first `cached`
//! tokens are known to be in the engine's cache at the same positions;
//! [`Conversation::sync`] feeds the rest. When the context is full, the
//! oldest exchanges after the first one (which completes the prefix's
//! turn) are cut out; every token after the cut moves to a new position,
//! so the cache is truncated to the cut and the kept exchanges are fed
//! again.

use crate::engine::{Engine, LogitsWanted};
use anyhow::{Result, bail};

/// What to do when a new turn does not fit in the context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextPolicy {
    /// Drop the oldest exchanges (never the first one) until it fits and
    /// at most half the context is used.
    DropOldest,
    /// Refuse the turn (the chat command then ends).
    Stop,
}

/// Why a turn could not be made room for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoRoom {
    /// The policy is [`ContextPolicy::Stop`] and `need` more tokens do not fit.
    Full {
        used: usize,
        need: usize,
        limit: usize,
    },
    /// Even with every droppable exchange gone, `need` tokens do not fit
    /// after the `kept` ones.
    TooLong {
        kept: usize,
        need: usize,
        limit: usize,
    },
}

impl std::fmt::Display for NoRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            NoRoom::Full { used, need, limit } => write!(
                f,
                "the context is full: {used} of {limit} tokens used and this turn needs {need} more; \
                 raise -c, or pass --context-full drop to drop the oldest turns"
            ),
            NoRoom::TooLong { kept, need, limit } => write!(
                f,
                "this turn needs {need} tokens but only {} of the {limit}-token context can be freed \
                 ({kept} are kept: the start of the conversation, with any -f document); \
                 shorten the message or the document, /reset, or raise -c",
                limit.saturating_sub(kept)
            ),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Conversation {
    /// Every token of the conversation, in order.
    tokens: Vec<u32>,
    /// How many leading tokens the engine's cache holds at their positions.
    cached: usize,
    /// Length of the fixed prefix that starts every conversation.
    prefix_len: usize,
    /// Where each exchange starts in `tokens`; the last one runs to the end.
    starts: Vec<usize>,
    /// Most tokens the conversation may hold (the context size).
    limit: usize,
}

impl Conversation {
    /// An empty conversation that starts with `prefix` and may hold `limit`
    /// tokens in all.
    pub fn new(prefix: Vec<u32>, limit: usize) -> Conversation {
        Conversation {
            prefix_len: prefix.len(),
            tokens: prefix,
            cached: 0,
            starts: Vec::new(),
            limit,
        }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Tokens the engine's cache holds for this conversation.
    pub fn cached(&self) -> usize {
        self.cached
    }

    /// Exchanges begun so far (the last may still be open).
    pub fn exchanges(&self) -> usize {
        self.starts.len()
    }

    /// The token span of exchange `i`.
    pub fn exchange(&self, i: usize) -> &[u32] {
        let end = self.starts.get(i + 1).copied().unwrap_or(self.tokens.len());
        &self.tokens[self.starts[i]..end]
    }

    /// Back to just the prefix. The prefix's cache stays valid.
    pub fn reset(&mut self) {
        self.tokens.truncate(self.prefix_len);
        self.starts.clear();
        self.cached = self.cached.min(self.prefix_len);
    }

    /// Makes sure `need` more tokens fit, dropping whole exchanges from the
    /// second-oldest on when the policy allows, until at most half the
    /// context is used. The first exchange is kept because it completes the
    /// first user turn, which the prefix (with the system text and any `-f`
    /// document) opened. Returns how many exchanges were dropped.
    pub fn make_room(&mut self, need: usize, policy: ContextPolicy) -> Result<usize, NoRoom> {
        if self.tokens.len() + need <= self.limit {
            return Ok(0);
        }
        let kept = self.starts.get(1).copied().unwrap_or(self.tokens.len());
        if kept + need > self.limit {
            return Err(NoRoom::TooLong {
                kept,
                need,
                limit: self.limit,
            });
        }
        if policy == ContextPolicy::Stop {
            return Err(NoRoom::Full {
                used: self.tokens.len(),
                need,
                limit: self.limit,
            });
        }
        // Every exchange after the cut is fed again, so dropping just enough
        // would re-feed nearly the whole context on every later turn. Going
        // down to half the context (as llama.cpp does) pays that once per
        // half-context of new turns.
        let mut dropped = 0;
        while self.starts.len() > 1
            && (self.tokens.len() + need > self.limit || self.tokens.len() > self.limit / 2)
        {
            self.drop_exchange(1);
            dropped += 1;
        }
        Ok(dropped)
    }

    /// Cuts exchange `i` out; what follows moves down and must be fed again.
    fn drop_exchange(&mut self, i: usize) {
        let start = self.starts[i];
        let end = self.starts.get(i + 1).copied().unwrap_or(self.tokens.len());
        self.tokens.drain(start..end);
        self.starts.remove(i);
        for s in &mut self.starts[i..] {
            *s -= end - start;
        }
        self.cached = self.cached.min(start);
    }

    /// Opens a new exchange with the user's turn (not fed yet).
    pub fn begin_exchange(&mut self, user_turn: &[u32]) {
        self.starts.push(self.tokens.len());
        self.tokens.extend_from_slice(user_turn);
    }

    /// Appends tokens to the open exchange without feeding them.
    pub fn push(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Appends tokens that the caller fed to the engine itself (the reply,
    /// as the generation loop feeds it), right after every unfed token,
    /// which the caller must have fed first. The engine's position proves it.
    pub fn push_fed(&mut self, engine: &dyn Engine, tokens: &[u32]) -> Result<()> {
        self.tokens.extend_from_slice(tokens);
        self.cached = self.tokens.len();
        self.check_engine(engine)
    }

    /// Brings the engine's cache up to the first `end` tokens: forgets what
    /// no longer matches, then feeds the tokens it lacks. Returns the logits
    /// of the fed tokens as asked (empty when nothing was fed).
    pub fn sync_to(
        &mut self,
        engine: &mut dyn Engine,
        end: usize,
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>> {
        if end > self.tokens.len() || end < self.cached {
            bail!(
                "internal error: cannot sync to {end} tokens ({} cached of {})",
                self.cached,
                self.tokens.len()
            );
        }
        if engine.position() < self.cached {
            bail!(
                "internal error: the engine holds {} tokens but the conversation counted {} as cached",
                engine.position(),
                self.cached
            );
        }
        engine.truncate(self.cached);
        let logits = if end > self.cached {
            engine.forward(&self.tokens[self.cached..end], wanted)?
        } else {
            Vec::new()
        };
        self.cached = end;
        self.check_engine(engine)?;
        Ok(logits)
    }

    /// [`Conversation::sync_to`] the end.
    pub fn sync(&mut self, engine: &mut dyn Engine, wanted: LogitsWanted) -> Result<Vec<f32>> {
        self.sync_to(engine, self.tokens.len(), wanted)
    }

    /// Forgets the tokens from `len` on within the open exchange (the part
    /// of a reply past a stop string); the cache forgets them at the next
    /// sync.
    pub fn take_back(&mut self, len: usize) {
        let open_start = self.starts.last().copied().unwrap_or(self.prefix_len);
        let len = len.max(open_start);
        self.tokens.truncate(len);
        self.cached = self.cached.min(len);
    }

    /// Takes back the open exchange (a turn stopped before its reply
    /// began), leaving the conversation as it was before it.
    pub fn abandon_exchange(&mut self) {
        if let Some(start) = self.starts.pop() {
            self.tokens.truncate(start);
            self.cached = self.cached.min(start);
        }
    }

    /// The engine and the conversation must agree on how much is cached;
    /// if they do not, replies would be garbage, so say so.
    fn check_engine(&self, engine: &dyn Engine) -> Result<()> {
        if engine.position() != self.cached {
            bail!(
                "internal error: the engine holds {} tokens but the conversation expects {}",
                engine.position(),
                self.cached
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;

    /// An engine whose "logits" are a hash of every token before and at
    /// each position, so a stale or misplaced cache shows in the output.
    struct Recorder {
        seen: Vec<u32>,
        config: ModelConfig,
    }

    impl Recorder {
        fn new() -> Recorder {
            Recorder {
                seen: Vec::new(),
                config: crate::model::presets::shape("gemma3-270m").expect("known shape"),
            }
        }
    }

    impl Engine for Recorder {
        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn position(&self) -> usize {
            self.seen.len()
        }
        fn capacity(&self) -> usize {
            1000
        }
        fn truncate(&mut self, len: usize) {
            self.seen.truncate(len);
        }
        fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
            let mut out = Vec::new();
            for &t in tokens {
                self.seen.push(t);
                let h = self.seen.iter().enumerate().fold(0u64, |h, (i, &x)| {
                    h.wrapping_mul(31).wrapping_add(x as u64 * (i as u64 + 7))
                });
                out.push(h as f32);
            }
            Ok(match wanted {
                LogitsWanted::All => out,
                LogitsWanted::Last => vec![*out.last().unwrap_or(&0.0)],
            })
        }

        // This fake's hidden states are its logits (an identity LM head).
        fn final_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.forward(tokens, LogitsWanted::All)
        }
    }

    fn exchange(conv: &mut Conversation, engine: &mut Recorder, user: &[u32], reply: &[u32]) {
        conv.begin_exchange(user);
        conv.sync(engine, LogitsWanted::Last).unwrap();
        for &t in reply {
            engine.forward(&[t], LogitsWanted::Last).unwrap();
        }
        conv.push_fed(engine, reply).unwrap();
        conv.push(&[9, 9]);
        conv.sync(engine, LogitsWanted::Last).unwrap();
    }

    #[test]
    fn second_turn_feeds_only_the_new_tokens() {
        let mut engine = Recorder::new();
        let mut conv = Conversation::new(vec![2], 100);
        exchange(&mut conv, &mut engine, &[10, 11], &[20, 21, 22]);
        assert_eq!(conv.cached(), 8);
        conv.begin_exchange(&[12, 13]);
        let logits = conv.sync(&mut engine, LogitsWanted::All).unwrap();
        assert_eq!(logits.len(), 2, "only the two new tokens were fed");
        assert_eq!(engine.seen, conv.tokens());
        let mut fresh = Recorder::new();
        let all = fresh.forward(conv.tokens(), LogitsWanted::All).unwrap();
        assert_eq!(logits, all[all.len() - 2..]);
    }

    #[test]
    fn dropping_keeps_the_first_exchange_and_refeeds_the_rest() {
        let mut engine = Recorder::new();
        let mut conv = Conversation::new(vec![2], 20);
        exchange(&mut conv, &mut engine, &[10], &[20]); // 1 + 4
        exchange(&mut conv, &mut engine, &[11], &[21]); // 4
        exchange(&mut conv, &mut engine, &[12], &[22]); // 4
        exchange(&mut conv, &mut engine, &[13], &[23]); // 4
        assert_eq!(conv.len(), 17);
        let dropped = conv.make_room(8, ContextPolicy::DropOldest).unwrap();
        assert_eq!(dropped, 2);
        assert_eq!(conv.tokens(), [2, 10, 20, 9, 9, 13, 23, 9, 9]);
        assert_eq!(conv.cached(), 5, "everything after the cut moved");
        conv.begin_exchange(&[14]);
        let logits = conv.sync(&mut engine, LogitsWanted::All).unwrap();
        assert_eq!(engine.seen, conv.tokens());
        let mut fresh = Recorder::new();
        let all = fresh.forward(conv.tokens(), LogitsWanted::All).unwrap();
        assert_eq!(logits, all[5..]);
    }

    #[test]
    fn a_drop_goes_down_to_half_the_context_keeping_the_newest() {
        let mut engine = Recorder::new();
        let mut conv = Conversation::new(vec![2], 40);
        for i in 0..9 {
            exchange(&mut conv, &mut engine, &[10 + i], &[20 + i]);
        }
        assert_eq!(conv.len(), 37);
        assert_eq!(conv.make_room(4, ContextPolicy::DropOldest), Ok(5));
        assert_eq!(conv.len(), 17);
        assert_eq!(conv.exchanges(), 4);
        assert_eq!(conv.exchange(0), [10, 20, 9, 9]);
        assert_eq!(conv.exchange(1), [16, 26, 9, 9]);
        assert_eq!(conv.exchange(3), [18, 28, 9, 9]);
        assert_eq!(conv.make_room(4, ContextPolicy::DropOldest), Ok(0));
    }

    #[test]
    fn stop_policy_and_oversized_turns_are_refused() {
        let mut engine = Recorder::new();
        let mut conv = Conversation::new(vec![2], 12);
        exchange(&mut conv, &mut engine, &[10], &[20]);
        exchange(&mut conv, &mut engine, &[11], &[21]);
        assert_eq!(
            conv.make_room(4, ContextPolicy::Stop),
            Err(NoRoom::Full {
                used: 9,
                need: 4,
                limit: 12
            })
        );
        assert_eq!(
            conv.make_room(8, ContextPolicy::DropOldest),
            Err(NoRoom::TooLong {
                kept: 5,
                need: 8,
                limit: 12
            })
        );
        assert_eq!(conv.len(), 9, "a refused turn changes nothing");
        assert_eq!(conv.make_room(3, ContextPolicy::Stop), Ok(0));
    }

    #[test]
    fn reset_keeps_the_prefix_cached() {
        let mut engine = Recorder::new();
        let mut conv = Conversation::new(vec![2], 100);
        exchange(&mut conv, &mut engine, &[10], &[20]);
        conv.reset();
        assert_eq!(conv.tokens(), [2]);
        assert_eq!(conv.cached(), 1);
        assert_eq!(conv.exchanges(), 0);
        conv.begin_exchange(&[10]);
        conv.sync(&mut engine, LogitsWanted::Last).unwrap();
        assert_eq!(engine.seen, [2, 10]);
    }

    #[test]
    fn feeding_in_pieces_matches_one_piece() {
        let mut conv = Conversation::new(vec![2], 100);
        conv.begin_exchange(&[5, 6, 7, 8, 9, 10, 11]);
        let mut engine = Recorder::new();
        conv.sync_to(&mut engine, 3, LogitsWanted::Last).unwrap();
        assert_eq!(conv.cached(), 3);
        conv.sync_to(&mut engine, 6, LogitsWanted::Last).unwrap();
        let last = conv.sync(&mut engine, LogitsWanted::Last).unwrap();
        let mut fresh = Recorder::new();
        assert_eq!(
            last,
            fresh.forward(conv.tokens(), LogitsWanted::Last).unwrap()
        );
    }

    #[test]
    fn an_abandoned_exchange_leaves_no_trace() {
        let mut engine = Recorder::new();
        let mut conv = Conversation::new(vec![2], 100);
        exchange(&mut conv, &mut engine, &[10], &[20]);
        let before = conv.tokens().to_vec();
        conv.begin_exchange(&[11, 12, 13]);
        conv.sync_to(&mut engine, before.len() + 2, LogitsWanted::Last)
            .unwrap();
        conv.abandon_exchange();
        assert_eq!(conv.tokens(), before);
        assert_eq!(conv.exchanges(), 1);
        assert_eq!(conv.cached(), before.len());
        conv.begin_exchange(&[14]);
        conv.sync(&mut engine, LogitsWanted::Last).unwrap();
        assert_eq!(engine.seen, conv.tokens(), "the half-fed turn is gone");
    }
}
