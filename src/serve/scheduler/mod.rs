//! The engine thread: continuous batching over the engine's sequences.
//!
//! Each slot is one of the engine's KV caches. Every step gathers, from
//! every busy slot, the token it must feed next (the one it just sampled)
//! and, for a slot still reading its prompt, a chunk of the prompt, and
//! runs them as one `forward_batch`: each weight is read once for all of
//! them. A request that arrives joins at the next step; one that ends frees
//! its slot for the next waiting request at once.
//!
//! # Speculative decoding
//! With `--spec ngram` each request's drafter offers a draft from the
//! request's own text, and the step returns every row's logits of the
//! requests that drafted: each request's [`Generation::judge`] walks its
//! rows, confirming drafts by the one rule `pulsar run` uses; the first
//! miss ends the walk and the unconfirmed drafts leave that request's
//! cache.
//! - A request decoding alone drafts as `generate` does: its policy weighs
//!   the jump from a one-token step to a batched one against its own
//!   acceptance and timings.
//! - In a step of several decoding requests the draft lengths are chosen
//!   together (`policy::batch_draft_lens`): the drafted tokens that yield
//!   most, while each yields twice what it costs against what a token
//!   adds to such steps here (`BatchStepTimes`, fitted to this server's
//!   decode steps). Under AVX2 alone, where a token adds about a fifth of
//!   a 4-token step, only drafts close to certain meet that; an engine
//!   whose small batches cost little feeds more.
//! - A step that feeds a prompt chunk carries no drafts.
//!
//! Handlers never wait on this thread: they put jobs in the [`Queue`] (a
//! mutex held for a push or a pop) and read events from a bounded channel.
//!
//! # What a reply depends on
//! A reply is a function of the request alone (its prompt tokens, settings
//! and seed), bit for bit, whatever else shares its steps and whatever its
//! slot's cache held before:
//! - a run of at most `EXACT_STEP_MAX_TOKENS` tokens of one sequence is
//!   computed exactly as one-token steps (the engine's guarantee), and a
//!   longer run in bulk, where each token's result does not depend on how
//!   the run was cut into chunks or what else is in the step
//!   (`tests/batched_steps.rs` checks both);
//! - so a prompt of more than `EXACT_STEP_MAX_TOKENS` tokens is always fed
//!   in bulk runs of more than that many tokens, a shorter one in one exact
//!   run, and generated tokens one at a time (exact);
//! - drafted tokens (below) go in the same exact runs, so a reply with
//!   speculation is the reply without it;
//! - prefix reuse takes only cached positions computed the way a fresh
//!   prompt would compute them: for a long prompt, the slot's bulk-fed
//!   prefix (its last prompt, not its reply, which was fed token by token),
//!   leaving at least one bulk run to feed; for a short prompt, a cache fed
//!   wholly token by token.

mod queue;
mod step;

pub use queue::{Job, Queue, too_many_sequences};

use super::api::ApiError;
use super::metrics::Metrics;
use super::slot::Event;
use crate::embedding::MeanPool;
use crate::engine::Engine;
use crate::engine::fast::{EXACT_STEP_MAX_TOKENS, FastEngine};
use crate::generate::Generation;
use crate::sample::Sampler;
use crate::speculative::Speculation;
use crate::speculative::policy::BatchStepTimes;
use crate::tokenizer::Tokenizer;
use queue::{Mode, Queued};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{self, error::TrySendError};

/// The shortest bulk run: one token more than an exact one.
const MIN_BULK: usize = EXACT_STEP_MAX_TOKENS + 1;

pub struct SchedulerOptions {
    pub slots: usize,
    /// Most prompt tokens one step feeds in bulk.
    pub prefill_chunk: usize,
    /// How long a request may sit with its channel full (its client not
    /// reading) before it is ended.
    pub stall_timeout: Duration,
    /// Drafting for decoding requests (see the module documentation).
    pub speculation: Speculation,
}

/// A request being served in a slot.
struct Active<'t> {
    prompt: Vec<u32>,
    /// Prompt tokens in the cache (the reused prefix first).
    fed: usize,
    /// The prompt goes in one exact run (it is short).
    exact_prompt: bool,
    /// Prompt tokens taken from a cache rather than fed.
    cached_tokens: usize,
    generation: Generation<'t>,
    /// The token sampled last, to feed in the next step.
    next: Option<u32>,
    events: mpsc::Sender<Event>,
    outbox: VecDeque<Event>,
    stalled_since: Option<Instant>,
    /// Admission order: the oldest prompt is fed first.
    order: u64,
    /// Alternatives per token when the prompt's own log-probabilities are
    /// reported (`echo` with `logprobs`).
    scores_prompt: Option<usize>,
    /// An embedding job's pooling so far.
    embedding: Option<MeanPool>,
    /// The request this job is a part of (see [`Queued`]).
    request: u64,
}

struct Slot<'t> {
    seq: usize,
    /// The tokens in this sequence's KV cache.
    cached: Vec<u32>,
    /// How many leading cached tokens were fed in bulk runs.
    bulk_len: usize,
    last_used: u64,
    active: Option<Active<'t>>,
}

/// Events a finished request still owes a slow client, delivered after its
/// slot is freed.
struct Leftover {
    request: u64,
    events: mpsc::Sender<Event>,
    outbox: VecDeque<Event>,
    since: Instant,
}

/// How many prompt tokens to feed in this step's bulk run when `left`
/// remain (`left >= MIN_BULK`): at most `chunk`, and never leaving a tail
/// shorter than a bulk run.
pub fn bulk_run(left: usize, chunk: usize) -> usize {
    let chunk = chunk.max(MIN_BULK);
    if left <= chunk {
        left
    } else if left - chunk >= MIN_BULK {
        chunk
    } else if left - MIN_BULK >= MIN_BULK {
        left - MIN_BULK
    } else {
        left
    }
}

/// How much of a slot's cache a prompt can reuse (see the module notes).
pub fn reusable(cached: &[u32], bulk_len: usize, prompt: &[u32]) -> usize {
    let common = cached
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    if prompt.len() >= MIN_BULK {
        common.min(bulk_len).min(prompt.len() - MIN_BULK)
    } else if bulk_len == 0 {
        common.min(prompt.len().saturating_sub(1))
    } else {
        0
    }
}

pub struct Scheduler<'t> {
    engine: FastEngine,
    tok: &'t Tokenizer,
    queue: Arc<Queue>,
    metrics: Arc<Metrics>,
    opts: SchedulerOptions,
    slots: Vec<Slot<'t>>,
    leftovers: Vec<Leftover>,
    clock: u64,
    /// (when, tokens generated) per recent step, for the decode rate.
    recent: VecDeque<(Instant, usize)>,
    /// Decode steps' times by size, which prices drafts in a step of
    /// several requests.
    batch_times: BatchStepTimes,
}

impl<'t> Scheduler<'t> {
    pub fn new(
        mut engine: FastEngine,
        tok: &'t Tokenizer,
        queue: Arc<Queue>,
        metrics: Arc<Metrics>,
        opts: SchedulerOptions,
    ) -> anyhow::Result<Scheduler<'t>> {
        engine.set_sequences(opts.slots)?;
        let slots = (0..opts.slots)
            .map(|seq| Slot {
                seq,
                cached: Vec::new(),
                bulk_len: 0,
                last_used: 0,
                active: None,
            })
            .collect();
        metrics.slots.store(opts.slots, Ordering::Relaxed);
        metrics.kv_cells_total.store(
            opts.slots * crate::engine::Engine::capacity(&engine),
            Ordering::Relaxed,
        );
        Ok(Scheduler {
            engine,
            tok,
            queue,
            metrics,
            opts,
            slots,
            leftovers: Vec::new(),
            clock: 0,
            recent: VecDeque::new(),
            batch_times: BatchStepTimes::default(),
        })
    }

    /// Serves until the queue is drained (shutdown) or aborted.
    pub fn run(mut self) {
        loop {
            let mode = self.admit();
            if mode == Mode::Abort {
                self.abort_all();
                return;
            }
            self.deliver();
            let busy = self.slots.iter().filter(|s| s.active.is_some()).count();
            if mode == Mode::Draining && busy == 0 && self.leftovers.is_empty() {
                return;
            }
            let stepped = self.step();
            self.publish();
            if !stepped {
                self.idle(busy > 0 || !self.leftovers.is_empty());
            }
        }
    }

    /// Waits for work: briefly when some client must be waited for,
    /// otherwise until a request (or shutdown) arrives.
    fn idle(&self, waiting_on_clients: bool) {
        let state = self.queue.lock();
        if !state.waiting.is_empty() || state.mode == Mode::Abort {
            return;
        }
        if waiting_on_clients || state.mode == Mode::Draining {
            let _ = self
                .queue
                .wake
                .wait_timeout(state, Duration::from_millis(5));
        } else {
            let _ = self.queue.wake.wait_timeout(state, Duration::from_secs(1));
        }
    }

    /// Moves waiting jobs into free slots; during shutdown, refuses them.
    fn admit(&mut self) -> Mode {
        let queue = self.queue.clone();
        let mut state = queue.lock();
        let mode = state.mode;
        if mode != Mode::Running {
            for Queued { job, .. } in state.waiting.drain(..) {
                let _ = job.events.try_send(Event::Failed(ApiError::unavailable(
                    "the server is shutting down",
                    5,
                )));
            }
        }
        let gone = state.drop_disconnected();
        self.metrics
            .disconnects
            .fetch_add(gone as u64, Ordering::Relaxed);
        while state.waiting.front().is_some() && self.slots.iter().any(|s| s.active.is_none()) {
            let Some(Queued { request, job }) = state.waiting.pop_front() else {
                break;
            };
            self.start(job, request);
        }
        self.metrics
            .queue_length
            .store(state.waiting.len(), Ordering::Relaxed);
        mode
    }

    /// Puts a job in the free slot whose cache it can reuse most (the
    /// least recently used among equals).
    fn start(&mut self, job: Job, request: u64) {
        let Some(index) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.active.is_none())
            .max_by_key(|(_, s)| {
                (
                    reusable(&s.cached, s.bulk_len, &job.prompt),
                    std::cmp::Reverse(s.last_used),
                )
            })
            .map(|(i, _)| i)
        else {
            return;
        };
        self.clock += 1;
        let slot = &mut self.slots[index];
        // A prompt to be scored is computed whole: cached positions have
        // no logits left.
        let scores_prompt = job
            .params
            .prompt_logprobs
            .then(|| job.params.logprobs.unwrap_or(0));
        // So is an embedding's: it pools every position's hidden state.
        let reuse = match (scores_prompt, job.embed) {
            (None, false) => reusable(&slot.cached, slot.bulk_len, &job.prompt),
            _ => 0,
        };
        self.engine.truncate_sequence(slot.seq, reuse);
        slot.cached.truncate(reuse);
        slot.bulk_len = slot.bulk_len.min(reuse);
        slot.last_used = self.clock;
        self.metrics
            .prompt_tokens
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        self.metrics
            .cached_prompt_tokens
            .fetch_add(reuse as u64, Ordering::Relaxed);
        let sampler = Sampler::new(job.params.sampling, job.params.seed);
        let mut generation = Generation::new(self.tok, job.params, sampler, &job.prompt)
            .with_speculation(self.opts.speculation);
        if let Some(constraint) = job.constraint.as_deref() {
            // Masks are computed ahead by the step itself (`look_ahead`).
            generation = generation.with_constraint(constraint.start(), false);
        }
        slot.active = Some(Active {
            cached_tokens: reuse,
            exact_prompt: job.prompt.len() < MIN_BULK,
            fed: reuse,
            prompt: job.prompt,
            generation,
            next: None,
            events: job.events,
            outbox: VecDeque::new(),
            stalled_since: None,
            order: self.clock,
            scores_prompt,
            embedding: job
                .embed
                .then(|| MeanPool::new(self.engine.config().hidden)),
            request,
        });
    }

    /// Lets each slot still reading its prompt take what another slot has
    /// computed of it: the n choices of one request, conversations that
    /// open with the same system prompt. The positions are copied under
    /// [`reusable`]'s rule (as a free slot's own cache is reused), so a
    /// reply keeps its bits. The choices of a request thus read their
    /// prompt once: while the first feeds a bulk run, the others wait for
    /// the one bulk run a step has, then copy it.
    fn share_prefixes(&mut self) {
        for i in 0..self.slots.len() {
            let Some(active) = &self.slots[i].active else {
                continue;
            };
            if active.fed >= active.prompt.len()
                || active.scores_prompt.is_some()
                || active.embedding.is_some()
            {
                continue;
            }
            let best = self
                .slots
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(j, other)| (reusable(&other.cached, other.bulk_len, &active.prompt), j))
                .max();
            let Some((len, from)) = best.filter(|&(len, _)| len > active.fed) else {
                continue;
            };
            let (from_seq, from_bulk) = (self.slots[from].seq, self.slots[from].bulk_len);
            if let Err(e) = self.engine.copy_prefix(from_seq, self.slots[i].seq, len) {
                eprintln!("pulsar serve: a prompt's cache was not shared: {e:#}");
                continue;
            }
            let slot = &mut self.slots[i];
            let Some(active) = &mut slot.active else {
                continue;
            };
            let gained = len - active.fed;
            slot.cached = active.prompt[..len].to_vec();
            slot.bulk_len = from_bulk.min(len);
            active.fed = len;
            active.cached_tokens += gained;
            self.metrics
                .cached_prompt_tokens
                .fetch_add(gained as u64, Ordering::Relaxed);
        }
    }

    /// Hands each request's events to its channel as far as it has room;
    /// frees the slots of clients that went away or stopped reading. A
    /// request whose client stopped reading ends whole: every choice of it
    /// running, waiting or finished (else its choices would stall in turn,
    /// each holding a slot for the timeout again).
    fn deliver(&mut self) {
        let timeout = self.opts.stall_timeout;
        let mut stalled: Vec<u64> = Vec::new();
        for slot in &mut self.slots {
            let Some(active) = &mut slot.active else {
                continue;
            };
            match flush(&active.events, &mut active.outbox) {
                Flush::Done => active.stalled_since = None,
                Flush::Full => {
                    let since = *active.stalled_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= timeout && !stalled.contains(&active.request) {
                        stalled.push(active.request);
                    }
                }
                Flush::Closed => {
                    self.metrics.disconnects.fetch_add(1, Ordering::Relaxed);
                    slot.active = None;
                }
            }
        }
        self.leftovers.retain_mut(|left| {
            if stalled.contains(&left.request) {
                return false;
            }
            match flush(&left.events, &mut left.outbox) {
                Flush::Done | Flush::Closed => false,
                Flush::Full => {
                    let stalls = left.since.elapsed() >= timeout;
                    if stalls && !stalled.contains(&left.request) {
                        stalled.push(left.request);
                    }
                    !stalls
                }
            }
        });
        if !stalled.is_empty() {
            self.end_stalled(&stalled, timeout);
        }
    }

    /// Ends the requests whose clients read nothing for `timeout`: their
    /// slots, their jobs still waiting and what they still owe.
    fn end_stalled(&mut self, requests: &[u64], timeout: Duration) {
        eprintln!(
            "pulsar serve: {} read nothing for {} s; ended",
            if requests.len() == 1 {
                "a client".to_string()
            } else {
                format!("{} clients", requests.len())
            },
            timeout.as_secs()
        );
        self.metrics
            .stalled
            .fetch_add(requests.len() as u64, Ordering::Relaxed);
        for slot in &mut self.slots {
            if slot
                .active
                .as_ref()
                .is_some_and(|a| requests.contains(&a.request))
            {
                slot.active = None;
            }
        }
        self.leftovers
            .retain(|left| !requests.contains(&left.request));
        let mut state = self.queue.lock();
        state.waiting.retain(|q| !requests.contains(&q.request));
        self.metrics
            .queue_length
            .store(state.waiting.len(), Ordering::Relaxed);
    }

    fn count_generated(&mut self, tokens: usize) {
        self.metrics
            .generated_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        let now = Instant::now();
        self.recent.push_back((now, tokens));
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(10))
        {
            self.recent.pop_front();
        }
        let total: usize = self.recent.iter().map(|(_, n)| n).sum();
        let span = self
            .recent
            .front()
            .map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64());
        let rate = if span > 0.0 { total as f64 / span } else { 0.0 };
        self.metrics.set_decode_rate(rate);
    }

    /// Frees a slot whose generation ended; what its client has not read
    /// yet is delivered later.
    fn finish(&mut self, index: usize) {
        let Some(mut active) = self.slots[index].active.take() else {
            return;
        };
        // The gauges first: a client that reads /metrics right after its
        // reply must not find its slot still busy (tests/serve.rs did, when
        // the rest of the step ran before the loop's own publish).
        self.publish();
        if let Flush::Full = flush(&active.events, &mut active.outbox) {
            self.leftovers.push(Leftover {
                request: active.request,
                events: active.events,
                outbox: active.outbox,
                since: Instant::now(),
            });
        }
    }

    /// Ends a slot's request with an error; its cache is forgotten, since
    /// the step that failed may have left it part-written.
    fn fail(&mut self, index: usize, error: ApiError) {
        let slot = &mut self.slots[index];
        let freed = slot.active.take();
        slot.cached.clear();
        slot.bulk_len = 0;
        let seq = slot.seq;
        self.engine.truncate_sequence(seq, 0);
        // The gauges before the client hears (see `finish`).
        self.publish();
        if let Some(mut active) = freed {
            active.outbox.push_back(Event::Failed(error));
            if let Flush::Full = flush(&active.events, &mut active.outbox) {
                self.leftovers.push(Leftover {
                    request: active.request,
                    events: active.events,
                    outbox: active.outbox,
                    since: Instant::now(),
                });
            }
        }
    }

    /// The grace period is over: every running request ends with an error.
    fn abort_all(&mut self) {
        for i in 0..self.slots.len() {
            if self.slots[i].active.is_some() {
                self.fail(
                    i,
                    ApiError::unavailable("the server shut down before the reply was complete", 5),
                );
            }
        }
        for left in &mut self.leftovers {
            let _ = flush(&left.events, &mut left.outbox);
        }
    }

    fn publish(&self) {
        let busy = self.slots.iter().filter(|s| s.active.is_some()).count();
        self.metrics.busy_slots.store(busy, Ordering::Relaxed);
        let cells = self.slots.iter().map(|s| s.cached.len()).sum();
        self.metrics.kv_cells_used.store(cells, Ordering::Relaxed);
    }
}

enum Flush {
    /// Everything was handed over.
    Done,
    /// The channel is full: the client is not reading.
    Full,
    /// The client went away.
    Closed,
}

fn flush(events: &mpsc::Sender<Event>, outbox: &mut VecDeque<Event>) -> Flush {
    if events.is_closed() {
        return Flush::Closed;
    }
    while let Some(event) = outbox.pop_front() {
        match events.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(event)) => {
                outbox.push_front(event);
                return Flush::Full;
            }
            Err(TrySendError::Closed(_)) => return Flush::Closed,
        }
    }
    Flush::Done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_runs_never_leave_a_short_tail() {
        for left in MIN_BULK..400 {
            let mut rest = left;
            while rest > 0 {
                let n = bulk_run(rest, 64);
                assert!(n >= MIN_BULK, "left {left}: run of {n}");
                assert!(n <= 64 + MIN_BULK, "left {left}: run of {n}");
                rest -= n;
                assert!(rest == 0 || rest >= MIN_BULK, "left {left}: tail {rest}");
            }
        }
    }

    #[test]
    fn reuse_takes_only_canonically_fed_positions() {
        let prompt: Vec<u32> = (0..40).collect();
        // A long prompt reuses the bulk-fed prefix, leaving a bulk run.
        assert_eq!(reusable(&prompt, 40, &prompt), 40 - MIN_BULK);
        let longer: Vec<u32> = (0..100).collect();
        assert_eq!(reusable(&prompt, 40, &longer), 40);
        // Cached positions fed one at a time (a reply) are not reused by a
        // long prompt.
        assert_eq!(reusable(&longer, 40, &longer), 40);
        assert_eq!(reusable(&prompt, 0, &longer), 0);
        // A short prompt reuses only a cache fed token by token.
        let short: Vec<u32> = (0..10).collect();
        assert_eq!(reusable(&prompt[..12], 0, &short), 9);
        assert_eq!(reusable(&prompt, 40, &short), 0);
        // Different tokens share nothing.
        assert_eq!(reusable(&[9, 9, 9], 0, &[1, 2]), 0);
    }

    #[test]
    fn a_full_channel_keeps_the_events_and_a_closed_one_says_so() {
        let (tx, mut rx) = mpsc::channel(1);
        let mut outbox: VecDeque<Event> = (0..3)
            .map(|i| Event::Delta {
                text: i.to_string(),
                logprobs: Vec::new(),
            })
            .collect();
        assert!(matches!(flush(&tx, &mut outbox), Flush::Full));
        assert_eq!(outbox.len(), 2);
        assert!(rx.try_recv().is_ok());
        assert!(matches!(flush(&tx, &mut outbox), Flush::Full));
        assert_eq!(outbox.len(), 1);
        drop(rx);
        assert!(matches!(flush(&tx, &mut outbox), Flush::Closed));
    }
}
