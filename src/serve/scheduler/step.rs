//! One step of the engine thread, in three parts as vLLM's engine core
//! splits it: **schedule** (what each busy slot feeds: a prompt chunk, or
//! the token it chose and the tokens drafted after it), **execute** (one
//! `forward_batch` for all of them, with the output constraints' next
//! masks computed beside it), **update** (each slot's generation judges
//! its rows; drafts not confirmed leave the cache; events go to clients).

use super::{Scheduler, bulk_run};
use crate::engine::LogitsWanted;
use crate::engine::fast::SeqTokens;
use crate::engine::step_logits::StepLogits;
use crate::generate::logprobs::prompt_logprobs;
use crate::generate::{Generation, Judged, Outcome, Piece};
use crate::serve::api::{ApiError, Usage};
use crate::serve::slot::Event;
use crate::speculative::policy::batch_draft_lens;
use crate::speculative::{DraftOffer, Speculation};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The longest bulk run of a prompt whose log-probabilities are reported:
/// every row's logits are kept (1 MiB each for a 262,144-token vocabulary).
const SCORED_CHUNK: usize = 64;

/// What one slot feeds in a step.
struct Run {
    slot: usize,
    tokens: Vec<u32>,
    /// `None`: no logits (a prompt chunk before the last, an embedding).
    wanted: Option<LogitsWanted>,
    /// How many of `tokens` are prompt tokens (0 for a decode run).
    prompt_fed: usize,
}

/// A step's runs, oldest request first.
struct Plan {
    runs: Vec<Run>,
    /// Every run feeds one chosen token (and maybe drafts): its time
    /// prices drafts in later steps.
    decode_only: bool,
}

/// What judging a generation's rows of a step gave.
struct Sampled {
    judged: Judged,
    /// Text for the client.
    pieces: Vec<Piece>,
    /// Tokens generated.
    tokens: usize,
}

impl Scheduler<'_> {
    /// Runs one forward step over every busy slot that has work. Returns
    /// whether there was any.
    pub(super) fn step(&mut self) -> bool {
        self.share_prefixes();
        let Some(plan) = self.schedule() else {
            return false;
        };
        let started = Instant::now();
        let result = self.execute(&plan);
        let secs = started.elapsed().as_secs_f64();
        let tokens: usize = plan.runs.iter().map(|r| r.tokens.len()).sum();
        self.metrics
            .count_step(plan.runs.len(), tokens, (secs * 1e6) as u64);
        if plan.decode_only {
            self.batch_times.record(tokens, secs);
        }
        match result {
            Ok(logits) => self.update(plan, logits, secs),
            Err(e) => {
                eprintln!("pulsar serve: a forward step failed: {e:#}");
                for run in &plan.runs {
                    self.fail(
                        run.slot,
                        ApiError::internal(format!("the forward pass failed: {e:#}")),
                    );
                }
            }
        }
        true
    }

    /// What each busy slot feeds this step: a short prompt whole (one
    /// exact run), one bulk chunk of a long prompt per step (so the step
    /// stays short for the streams decoding beside it), or the token a
    /// generation chose, with drafts after it.
    fn schedule(&mut self) -> Option<Plan> {
        let mut runs: Vec<Run> = Vec::new();
        let mut order: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].active.is_some())
            .collect();
        order.sort_by_key(|&i| self.slots[i].active.as_ref().map_or(0, |a| a.order));
        let mut bulk_taken = false;
        for slot in order {
            let Some(active) = &self.slots[slot].active else {
                continue;
            };
            if active.stalled_since.is_some() {
                continue;
            }
            let left = active.prompt.len() - active.fed;
            // A scored prompt wants every row's logits, an embedding none.
            let scored = active.scores_prompt.is_some();
            let embeds = active.embedding.is_some();
            if left > 0 {
                if active.exact_prompt {
                    let wanted = if embeds {
                        None
                    } else if scored {
                        Some(LogitsWanted::All)
                    } else {
                        Some(LogitsWanted::Last)
                    };
                    runs.push(Run {
                        slot,
                        tokens: active.prompt[active.fed..].to_vec(),
                        wanted,
                        prompt_fed: left,
                    });
                } else if !bulk_taken {
                    bulk_taken = true;
                    let chunk = if scored {
                        self.opts.prefill_chunk.min(SCORED_CHUNK)
                    } else {
                        self.opts.prefill_chunk
                    };
                    let n = bulk_run(left, chunk);
                    let wanted = if scored {
                        Some(LogitsWanted::All)
                    } else {
                        (n == left && !embeds).then_some(LogitsWanted::Last)
                    };
                    runs.push(Run {
                        slot,
                        tokens: active.prompt[active.fed..active.fed + n].to_vec(),
                        wanted,
                        prompt_fed: n,
                    });
                }
            } else if let Some(next) = active.next {
                runs.push(Run {
                    slot,
                    tokens: vec![next],
                    wanted: Some(LogitsWanted::Last),
                    prompt_fed: 0,
                });
            }
        }
        if runs.is_empty() {
            return None;
        }
        let decode_only = runs
            .iter()
            .all(|r| r.prompt_fed == 0 && r.tokens.len() == 1);
        if let [run] = runs.as_mut_slice()
            && run.prompt_fed == 0
        {
            self.draft_alone(run);
        } else if decode_only {
            self.draft_together(&mut runs);
        }
        Some(Plan { runs, decode_only })
    }

    /// One forward pass over every run. The next masks of the generations
    /// that get logits depend only on the tokens taken so far, so they are
    /// computed on a helper thread while it runs.
    fn execute(&mut self, plan: &Plan) -> anyhow::Result<StepLogits> {
        let batch: Vec<SeqTokens> = plan
            .runs
            .iter()
            .map(|r| SeqTokens {
                seq: self.slots[r.slot].seq,
                tokens: &r.tokens,
                wanted: r.wanted,
            })
            .collect();
        let judged_next: Vec<usize> = plan
            .runs
            .iter()
            .filter(|r| r.wanted.is_some())
            .map(|r| r.slot)
            .collect();
        let engine = &mut self.engine;
        let slots = &mut self.slots;
        std::thread::scope(|scope| {
            let constrained: Vec<&mut Generation> = slots
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| judged_next.contains(i))
                .filter_map(|(_, s)| Some(&mut s.active.as_mut()?.generation))
                .filter(|g| g.has_constraint())
                .collect();
            let helper = (!constrained.is_empty()).then(|| {
                scope.spawn(move || constrained.into_iter().for_each(Generation::look_ahead))
            });
            let result = engine.forward_batch_logits(&batch);
            // A helper that panicked leaves the masks to be computed in
            // line, where the panic is caught per request.
            if let Some(helper) = helper {
                let _ = helper.join();
            }
            result
        })
    }

    /// Applies a step's results: bookkeeping first, then every slot that
    /// got logits has its generation judge them (in parallel), then each
    /// slot takes its outcome.
    fn update(&mut self, plan: Plan, mut logits: StepLogits, secs: f64) {
        let mut work: Vec<(usize, &mut [f32])> = Vec::new();
        let alone = match plan.runs.as_slice() {
            [run] => Some(run.tokens.len()),
            _ => None,
        };
        let mut embedded = Vec::new();
        for (entry, (run, logits)) in plan.runs.into_iter().zip(logits.entries_mut()).enumerate() {
            let slot = &mut self.slots[run.slot];
            slot.cached.extend_from_slice(&run.tokens);
            let Some(active) = &mut slot.active else {
                continue;
            };
            let from = active.fed;
            active.fed += run.prompt_fed;
            if run.prompt_fed > 0 && !active.exact_prompt {
                slot.bulk_len = slot.cached.len();
            }
            if let Some(pool) = &mut active.embedding {
                pool.add(self.engine.last_hidden(entry));
                if active.fed == active.prompt.len() {
                    active.outbox.push_back(Event::Embedding(pool.unit_mean()));
                    embedded.push(run.slot);
                }
                continue;
            }
            let mut logits: &mut [f32] = logits;
            if let (Some(top), true) = (active.scores_prompt, run.prompt_fed > 0) {
                let width = logits.len() / run.tokens.len().max(1);
                let scored = prompt_logprobs(self.tok, &active.prompt, from, logits, width, top);
                active.outbox.push_back(Event::PromptLogprobs(scored));
                if active.fed < active.prompt.len() {
                    continue;
                }
                // The prompt's last row picks the first new token.
                let len = logits.len();
                logits = &mut std::mem::take(&mut logits)[len - width..];
            }
            if run.wanted.is_some() {
                work.push((run.slot, logits));
            }
        }
        for i in embedded {
            self.finish(i);
        }
        let results = self.judge_all(work);
        self.engine.recycle_logits(logits);
        let mut generated = 0;
        for (i, result) in results {
            match result {
                Some(sampled) => {
                    generated += sampled.tokens;
                    self.take_outcome(i, sampled, alone, secs);
                }
                None => {
                    eprintln!("pulsar serve: a request's generation panicked; it was ended");
                    self.fail(i, ApiError::internal("internal error while generating"));
                }
            }
        }
        self.count_generated(generated);
    }

    /// Slot `i`'s judgement: unconfirmed drafts leave its cache, its text
    /// goes to the client, and it feeds its token next or ends. `alone`:
    /// the step's size when this slot had it to itself (the draft policy
    /// fits its cost model to such steps).
    fn take_outcome(&mut self, i: usize, sampled: Sampled, alone: Option<usize>, secs: f64) {
        let slot = &mut self.slots[i];
        let Some(active) = &mut slot.active else {
            return;
        };
        let Judged {
            outcome,
            confirmed,
            drafted,
        } = sampled.judged;
        if drafted > 0 {
            let keep = slot.cached.len() - (drafted - confirmed);
            self.engine.truncate_sequence(slot.seq, keep);
            slot.cached.truncate(keep);
            self.metrics
                .drafted_tokens
                .fetch_add(drafted as u64, Ordering::Relaxed);
            self.metrics
                .accepted_tokens
                .fetch_add(confirmed as u64, Ordering::Relaxed);
        }
        if let Some(m) = alone {
            active.generation.step_done(m, secs);
        }
        let deltas = sampled.pieces.into_iter().map(|p| Event::Delta {
            text: p.text,
            logprobs: p.logprobs,
        });
        active.outbox.extend(deltas);
        match outcome {
            Outcome::Feed(next) => active.next = Some(next),
            Outcome::Finished(reason) => {
                if let Some(why) = active.generation.dead_end() {
                    eprintln!("pulsar serve: generation stopped: {why}");
                }
                let usage = Usage::new(
                    active.prompt.len(),
                    active.cached_tokens,
                    active.generation.generated(),
                );
                active.outbox.push_back(Event::Done {
                    reason: reason.finish_reason(),
                    usage,
                });
                self.finish(i);
            }
        }
    }

    /// Has each listed slot's generation judge its rows, spread over the
    /// engine's threads (a judgement scans the vocabulary, about a
    /// millisecond). Returns per slot what it gave, or `None` where
    /// judging panicked.
    fn judge_all(&mut self, work: Vec<(usize, &mut [f32])>) -> Vec<(usize, Option<Sampled>)> {
        struct Item<'a, 't, 'l> {
            generation: &'a mut Generation<'t>,
            /// One row per token fed: the chosen one, then each draft.
            logits: &'l mut [f32],
            result: Option<Sampled>,
        }
        let mut inputs: Vec<Option<&mut [f32]>> = (0..self.slots.len()).map(|_| None).collect();
        for (i, logits) in work {
            inputs[i] = Some(logits);
        }
        let (indices, items): (Vec<usize>, Vec<Mutex<Item>>) = self
            .slots
            .iter_mut()
            .zip(inputs)
            .enumerate()
            .filter_map(|(i, (slot, logits))| {
                let item = Item {
                    generation: &mut slot.active.as_mut()?.generation,
                    logits: logits?,
                    result: None,
                };
                Some((i, Mutex::new(item)))
            })
            .unzip();
        let run = |item: &Mutex<Item>| {
            let mut guard = item.lock().unwrap_or_else(|e| e.into_inner());
            let item = &mut *guard;
            // Client data (settings, schemas) drives this part: a panic in
            // it ends that request, not the server.
            item.result = catch_unwind(AssertUnwindSafe(|| {
                let before = item.generation.generated();
                let mut pieces = Vec::new();
                let judged = item
                    .generation
                    .judge(item.logits, &|| false, &mut |p| pieces.push(p));
                Sampled {
                    judged,
                    pieces,
                    tokens: item.generation.generated() - before,
                }
            }))
            .ok();
        };
        let pool = self.engine.pool();
        if items.len() > 1 {
            let threads = pool.threads();
            pool.run(|tid| items.iter().skip(tid).step_by(threads).for_each(run));
        } else {
            items.iter().for_each(run);
        }
        indices
            .into_iter()
            .zip(items)
            .map(|(i, item)| {
                let item = item.into_inner().unwrap_or_else(|e| e.into_inner());
                (i, item.result)
            })
            .collect()
    }

    /// Room in slot `i`'s cache for a draft after its next token.
    fn draft_room(&self, i: usize) -> usize {
        let capacity = crate::engine::Engine::capacity(&self.engine);
        capacity.saturating_sub(self.slots[i].cached.len() + 1)
    }

    /// The draft of a request decoding alone, its length chosen by its own
    /// policy, fed after its token.
    fn draft_alone(&mut self, run: &mut Run) {
        let room = self.draft_room(run.slot);
        let seq = self.slots[run.slot].seq;
        let Some(active) = &mut self.slots[run.slot].active else {
            return;
        };
        let engine = &mut self.engine;
        let mut model = |last: u32, k: usize| engine.draft_sequence(seq, last, k, None);
        let drafts = match active.generation.draft_with(room, &mut model) {
            Ok(drafts) => drafts,
            Err(e) => return drafting_failed(run.slot, &e),
        };
        if !drafts.is_empty() {
            run.tokens.extend_from_slice(drafts);
            run.wanted = Some(LogitsWanted::All);
        }
    }

    /// Drafts for every request of a decode step of several, their
    /// lengths chosen together (`policy::batch_draft_lens`) against what
    /// a token adds to such steps here (`batch_times`).
    fn draft_together(&mut self, runs: &mut [Run]) {
        let mut offers: Vec<(usize, DraftOffer)> = Vec::new();
        for (at, run) in runs.iter().enumerate() {
            let room = self.draft_room(run.slot);
            let seq = self.slots[run.slot].seq;
            let Some(active) = &mut self.slots[run.slot].active else {
                continue;
            };
            // A draft model's round is as long as this sequence alone
            // would verify; the shared step may take fewer of it.
            let engine = &mut self.engine;
            let mut model = |last: u32, k: usize| engine.draft_sequence(seq, last, k, None);
            match active.generation.offer_draft_with(room, &mut model) {
                Ok(Some(offer)) => offers.push((at, offer)),
                Ok(None) => {}
                Err(e) => drafting_failed(run.slot, &e),
            }
        }
        if offers.is_empty() {
            return;
        }
        let terms: Vec<(f64, usize)> = offers
            .iter()
            .map(|(_, o)| (o.acceptance, o.tokens.len()))
            .collect();
        let fixed_cost = match self.opts.speculation {
            Speculation::Ngram(options) | Speculation::Mtp(options) => options.step_cost,
            Speculation::Off => None,
        };
        let times = &self.batch_times;
        let marginal = |m: usize| match fixed_cost {
            // Each token costs c of a one-token step, as the solo policy's
            // fixed cost says.
            Some(c) => c / (1.0 + c * (m - 1) as f64),
            None => times.marginal(m),
        };
        let lens = batch_draft_lens(runs.len() - offers.len(), &terms, marginal);
        for ((at, offer), k) in offers.into_iter().zip(lens) {
            let run = &mut runs[at];
            let Some(active) = &mut self.slots[run.slot].active else {
                continue;
            };
            let drafts = active.generation.take_draft(offer, k);
            if !drafts.is_empty() {
                run.tokens.extend_from_slice(drafts);
                run.wanted = Some(LogitsWanted::All);
                self.metrics
                    .batch_drafted_tokens
                    .fetch_add(drafts.len() as u64, Ordering::Relaxed);
            }
        }
    }
}

/// A draft round that failed costs its slot this step's drafts, said on
/// stderr: the step goes on without them (an internal error, never the
/// client's).
fn drafting_failed(slot: usize, e: &anyhow::Error) {
    eprintln!("pulsar serve: internal error: slot {slot} drafts nothing this step: {e:#}");
}
