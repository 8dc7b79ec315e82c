//! A prepared request in the queue and its events back: each prompt's
//! choices are sequences of their own, and their event channels are read
//! together, so that one stalled choice cannot hold the others.

use super::App;
use crate::serve::api::ApiError;
use crate::serve::request::Prepared;
use crate::serve::scheduler::Job;
use crate::serve::slot::{Event, GenParams};
use std::sync::Arc;
use std::task::Poll;
use tokio::sync::mpsc;

/// Events buffered per request between the engine thread and the client's
/// connection. A client that stops reading fills it; its request then
/// stalls and is ended after `--stall-timeout` (see the scheduler).
pub(super) const EVENT_BUFFER: usize = 256;

/// Puts a prepared request's sequences (each prompt's choices) in the
/// queue; their events, read together.
pub(super) fn enqueue(app: &App, prepared: Prepared) -> Result<ChoiceEvents, ApiError> {
    let sequences = prepared.prompts.len() * prepared.choices;
    let (param, what) = match prepared.prompts.len() {
        1 => ("n", format!("n = {}", prepared.choices)),
        p => (
            "prompt",
            format!(
                "{p} prompts with n = {} are {sequences} sequences",
                prepared.choices
            ),
        ),
    };
    // Each choice is a sequence of its own. Choice i of a prompt draws
    // with the seed plus i, so that with a seed the choices differ from
    // each other, the set is the same on every run, and each prompt of a
    // list gets what a request with it alone gets.
    let constraint = prepared.constraint.map(Arc::new);
    let mut jobs = Vec::with_capacity(sequences);
    let mut receivers = Vec::with_capacity(sequences);
    for prompt in &prepared.prompts {
        for i in 0..prepared.choices {
            let (tx, rx) = mpsc::channel(EVENT_BUFFER);
            jobs.push(Job {
                prompt: prompt.tokens.clone(),
                params: GenParams {
                    seed: prompt.params.seed.wrapping_add(i as u64),
                    ..prompt.params.clone()
                },
                constraint: constraint.clone(),
                events: tx,
                embed: false,
            });
            receivers.push(rx);
        }
    }
    app.queue.submit(jobs, param, &what)?;
    Ok(ChoiceEvents::new(receivers))
}

/// The event channels of a request's choices, read together: a choice
/// whose events are not read fills its buffer and stalls, and a stalled
/// request is ended (`--stall-timeout`). Dropping this (the client went
/// away) closes them all, which ends every choice's generation.
pub(super) struct ChoiceEvents {
    receivers: Vec<mpsc::Receiver<Event>>,
    open: Vec<bool>,
    /// Where the next poll starts, so that a busy choice cannot starve
    /// the others.
    next_first: usize,
}

impl ChoiceEvents {
    fn new(receivers: Vec<mpsc::Receiver<Event>>) -> ChoiceEvents {
        let open = vec![true; receivers.len()];
        ChoiceEvents {
            receivers,
            open,
            next_first: 0,
        }
    }

    pub(super) fn count(&self) -> usize {
        self.receivers.len()
    }

    fn all_closed(&self) -> bool {
        !self.open.contains(&true)
    }

    /// Stops reading choice `i` (its reply is complete).
    pub(super) fn close(&mut self, i: usize) {
        self.open[i] = false;
    }

    /// The next event of any open choice, as `(choice, event)`; the event
    /// is `None` when that choice's channel ended without a last event.
    /// `None` when every choice is closed.
    pub(super) async fn next(&mut self) -> Option<(usize, Option<Event>)> {
        if self.all_closed() {
            return None;
        }
        let n = self.count();
        std::future::poll_fn(|cx| {
            for k in 0..n {
                let i = (self.next_first + k) % n;
                if !self.open[i] {
                    continue;
                }
                if let Poll::Ready(event) = self.receivers[i].poll_recv(cx) {
                    self.next_first = (i + 1) % n;
                    return Poll::Ready(Some((i, event)));
                }
            }
            Poll::Pending
        })
        .await
    }
}

pub(super) fn ended_early() -> ApiError {
    ApiError::internal("the request was ended before its reply was complete")
}
