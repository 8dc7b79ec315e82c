//! Requests waiting for a slot: the handlers put a request's jobs in, the
//! engine thread takes them out as slots free. A mutex held for a push or
//! a pop; the handlers never wait on the engine thread.

use super::super::api::ApiError;
use super::super::metrics::Metrics;
use super::super::slot::{Event, GenParams};
use crate::constrain::CompiledConstraint;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use tokio::sync::mpsc;

/// One request, ready to run.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// Shared by the choices of one request (`n`): each starts its own
    /// matcher from it.
    pub constraint: Option<Arc<CompiledConstraint>>,
    pub events: mpsc::Sender<Event>,
    /// An embedding: the prompt is read for its final hidden states (no
    /// logits, no token generated) and answered with one
    /// [`Event::Embedding`].
    pub embed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Running,
    /// Shutting down: no new work; running requests finish.
    Draining,
    /// The grace period is over: running requests are cut off.
    Abort,
}

/// A job in the queue, with the request it belongs to: the choices,
/// prompts or inputs of one request share the number.
pub(super) struct Queued {
    pub(super) request: u64,
    pub(super) job: Job,
}

pub(super) struct QueueState {
    pub(super) waiting: VecDeque<Queued>,
    pub(super) mode: Mode,
    /// The number the next request's jobs get.
    next_request: u64,
}

impl QueueState {
    /// Forgets the jobs whose clients went away: they must not hold places
    /// that a new request could take. Returns how many there were.
    pub(super) fn drop_disconnected(&mut self) -> usize {
        let before = self.waiting.len();
        self.waiting.retain(|q| !q.job.events.is_closed());
        before - self.waiting.len()
    }
}

/// Requests waiting for a slot, shared by the handlers and the engine
/// thread.
pub struct Queue {
    state: Mutex<QueueState>,
    pub(super) wake: Condvar,
    capacity: usize,
    metrics: Arc<Metrics>,
    /// The engine thread died (a bug): requests get a 500, /health a 503.
    failed: AtomicBool,
}

impl Queue {
    pub fn new(capacity: usize, metrics: Arc<Metrics>) -> Queue {
        Queue {
            state: Mutex::new(QueueState {
                waiting: VecDeque::new(),
                mode: Mode::Running,
                next_request: 0,
            }),
            wake: Condvar::new(),
            capacity,
            metrics,
            failed: AtomicBool::new(false),
        }
    }

    pub fn engine_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Called when the engine thread died: waiting requests fail at once.
    pub fn mark_failed(&self) {
        self.failed.store(true, Ordering::Relaxed);
        let mut state = self.lock();
        for Queued { job, .. } in state.waiting.drain(..) {
            let _ = job.events.try_send(Event::Failed(ApiError::internal(
                "the server's engine thread failed",
            )));
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        // Nothing panics while holding this lock (pushes and pops); if
        // something did, the queue itself is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a request's jobs, or refuses them with a 503 when the queue
    /// is full or the server is shutting down. More jobs than the queue
    /// can ever hold is the request's fault: a 400 about field `param`,
    /// whose jobs `what` describes ("n = 20", "100 inputs").
    pub fn submit(&self, jobs: Vec<Job>, param: &str, what: &str) -> Result<(), ApiError> {
        if self.engine_failed() {
            return Err(ApiError::internal("the server's engine thread failed"));
        }
        // A request's jobs (its choices, prompts or inputs) wait together
        // or not at all: a reply with some of them missing would be no
        // reply.
        if jobs.len() > self.capacity {
            return Err(too_many_sequences(param, what, self.capacity));
        }
        let mut state = self.lock();
        if state.mode != Mode::Running {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
        let gone = state.drop_disconnected();
        self.metrics
            .disconnects
            .fetch_add(gone as u64, Ordering::Relaxed);
        if state.waiting.len() + jobs.len() > self.capacity {
            self.metrics.rejected_busy.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::unavailable(
                format!(
                    "every slot is busy and {} requests are already waiting (--queue); retry later",
                    state.waiting.len()
                ),
                1,
            ));
        }
        let request = state.next_request;
        state.next_request += 1;
        state
            .waiting
            .extend(jobs.into_iter().map(|job| Queued { request, job }));
        self.metrics
            .queue_length
            .store(state.waiting.len(), Ordering::Relaxed);
        drop(state);
        self.wake.notify_one();
        Ok(())
    }

    /// Stops taking requests; running ones finish.
    pub fn drain(&self) {
        let mut state = self.lock();
        if state.mode == Mode::Running {
            state.mode = Mode::Draining;
        }
        drop(state);
        self.wake.notify_one();
    }

    /// Ends running requests now.
    pub fn abort(&self) {
        self.lock().mode = Mode::Abort;
        self.wake.notify_one();
    }
}

/// The 400 for a request with more jobs (`what`: "n = 20", "100 inputs")
/// than the queue can ever hold; `param` is the field at fault.
pub fn too_many_sequences(param: &str, what: &str, capacity: usize) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "{what}: more than this server lets wait at once (--queue {capacity}); \
             send fewer per request"
        ),
    )
}
