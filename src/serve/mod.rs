//! `pulsar serve`: an OpenAI-compatible HTTP server with continuous
//! batching.
//!
//! - [`api`]: request and response bodies, the error shape;
//! - [`request`]: a body turned into a job (prompt tokens, checked
//!   settings, compiled `response_format`);
//! - [`http`]: the axum app (state, middleware, JSON and SSE plumbing) and
//!   one module per endpoint family: chat and legacy completions, the
//!   Responses API, embeddings, models, tokens, health and metrics;
//! - [`tools`]: function calling, as a schema on the reply, and the reply
//!   read back into calls;
//! - [`scheduler`]: the engine thread, batching every busy slot into one
//!   forward step;
//! - [`slot`]: one request's generation, stepped by the scheduler;
//! - [`metrics`]: counters and their Prometheus form.
//!
//! Threads: the engine runs on its own OS thread (with its own worker
//! pool); HTTP runs on a single-threaded tokio runtime, plus tokio's
//! blocking pool for parsing and tokenizing. On a 2-core machine more
//! async workers would only compete with the engine's.
//!
//! Layering: this module uses the engine, tokenizer, chat templates,
//! sampler, stop strings and constraints; nothing below imports it.

pub mod api;
pub mod conn;
pub mod gemma4_calls;
pub mod http;
pub mod metrics;
pub mod native_prompt;
pub mod request;
pub mod scheduler;
pub mod slot;
pub mod tools;

use anyhow::{Context, Result};
use metrics::Metrics;
use request::ServeContext;
use scheduler::{Queue, Scheduler, SchedulerOptions};
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::engine::fast::FastEngine;
use crate::speculative::Speculation;

pub struct ServeOptions {
    pub host: String,
    /// 0 asks the system for a free port; the address is printed.
    pub port: u16,
    /// Sequences decoded together (`--parallel`).
    pub slots: usize,
    /// Requests that may wait for a slot (`--queue`).
    pub queue: usize,
    pub api_key: Option<String>,
    /// Largest request body in bytes.
    pub max_body: usize,
    pub prefill_chunk: usize,
    pub stall_timeout: Duration,
    /// Connections open at once and their header and write timeouts.
    pub limits: conn::ConnectionLimits,
    /// How long a request's body may take to arrive (`--read-timeout`).
    pub read_timeout: Duration,
    /// No log line per request (`--quiet`).
    pub quiet: bool,
    /// How long running requests may go on after Ctrl-C or SIGTERM.
    pub grace: Duration,
    /// Drafting while one request decodes (see `scheduler`).
    pub speculation: Speculation,
}

/// Serves until Ctrl-C or SIGTERM, then lets running requests finish
/// within the grace period and returns. The engine is built by `engine`
/// on the engine thread (its kernels stay on the thread that made them).
pub fn run(
    engine: impl FnOnce() -> Result<FastEngine> + Send + 'static,
    ctx: ServeContext,
    opts: ServeOptions,
) -> Result<()> {
    let ctx = Arc::new(ctx);
    let metrics = Arc::new(Metrics::default());
    let queue = Arc::new(Queue::new(opts.queue, metrics.clone()));

    // The engine thread answers with the engine's fingerprint once it runs.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<String>>();
    let engine_thread = {
        let (ctx, queue, metrics) = (ctx.clone(), queue.clone(), metrics.clone());
        let sched = SchedulerOptions {
            slots: opts.slots,
            prefill_chunk: opts.prefill_chunk,
            stall_timeout: opts.stall_timeout,
            speculation: opts.speculation,
        };
        std::thread::Builder::new()
            .name("pulsar-engine".into())
            .spawn(move || {
                let scheduler = engine().and_then(|engine| {
                    let fingerprint = system_fingerprint(&engine, sched.prefill_chunk);
                    Scheduler::new(engine, &ctx.tok, queue.clone(), metrics, sched)
                        .map(|s| (s, fingerprint))
                });
                let scheduler = match scheduler {
                    Ok((s, fingerprint)) => {
                        let _ = ready_tx.send(Ok(fingerprint));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // A bug in the engine must not leave requests waiting
                // forever: they fail, and /health says so.
                if catch_unwind(AssertUnwindSafe(|| scheduler.run())).is_err() {
                    eprintln!("pulsar serve: the engine thread failed; requests now get 500");
                    queue.mark_failed();
                }
            })
            .context("cannot start the engine thread")?
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    // The port is taken before the model loads: clients meanwhile get 503
    // "loading" (as from llama-server), not a refused connection.
    let bound = runtime
        .block_on(tokio::net::TcpListener::bind((
            opts.host.as_str(),
            opts.port,
        )))
        .with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port));
    let listener = match bound {
        Ok(l) => l,
        Err(e) => {
            // The engine thread ends once its model is loaded.
            queue.drain();
            let _ = engine_thread.join();
            return Err(e);
        }
    };
    let addr = listener.local_addr()?;
    // The one line on stdout: scripts and tests read the address from it
    // (with --port 0 the system chose the port).
    println!(
        "pulsar serve: listening on http://{addr} (model {}, {} slots of {} tokens)",
        ctx.model_id, opts.slots, ctx.context
    );
    let _ = std::io::stdout().flush();
    if opts.api_key.is_none() && !addr.ip().is_loopback() {
        eprintln!(
            "pulsar serve: warning: listening on {} without an API key (--api-key)",
            addr.ip()
        );
    }

    let grace = opts.grace;
    let (routes_tx, routes_rx) = tokio::sync::watch::channel(http::loading_router());
    let mut load_failure: Option<anyhow::Error> = None;
    let served = runtime.block_on(async {
        let (started_tx, mut started_rx) = tokio::sync::watch::channel(false);
        let (failed_tx, mut failed_rx) = tokio::sync::watch::channel(false);
        let drain_queue = queue.clone();
        let signal = async move {
            tokio::select! {
                () = wait_for_signal() => eprintln!(
                    "pulsar serve: shutting down: no new requests; running ones get up to {} s",
                    grace.as_secs()
                ),
                _ = failed_rx.wait_for(|failed| *failed) => {}
            }
            drain_queue.drain();
            let _ = started_tx.send(true);
        };
        let server = conn::serve(listener, routes_rx, opts.limits, signal);
        let loaded = async {
            let ready = tokio::task::spawn_blocking(move || ready_rx.recv()).await;
            match ready {
                Ok(Ok(Ok(fingerprint))) => {
                    let app = Arc::new(http::App {
                        ctx: ctx.clone(),
                        queue: queue.clone(),
                        metrics,
                        api_key: opts.api_key.clone(),
                        max_body: opts.max_body,
                        read_timeout: opts.read_timeout,
                        quiet: opts.quiet,
                        next_id: AtomicU64::new(1),
                        fingerprint,
                    });
                    let _ = routes_tx.send(http::router(app));
                }
                Ok(Ok(Err(e))) => {
                    load_failure = Some(e);
                    let _ = failed_tx.send(true);
                }
                _ => {
                    load_failure = Some(anyhow::anyhow!(
                        "the engine thread failed while loading the model"
                    ));
                    let _ = failed_tx.send(true);
                }
            }
            // Keeps the router alive while the server runs.
            std::future::pending::<()>().await
        };
        let abort_queue = queue.clone();
        let watchdog = async move {
            let _ = started_rx.wait_for(|started| *started).await;
            tokio::time::sleep(grace).await;
            eprintln!("pulsar serve: the grace period is over; ending running requests");
            abort_queue.abort();
            // Ended streams close their connections; a client that keeps
            // its connection open anyway is not waited for long.
            tokio::time::sleep(Duration::from_secs(5)).await;
        };
        tokio::select! {
            () = server => Ok(()),
            () = loaded => Ok(()),
            () = watchdog => {
                eprintln!("pulsar serve: some connections stayed open; exiting anyway");
                Ok::<(), anyhow::Error>(())
            }
        }
    });
    queue.drain();
    runtime.shutdown_timeout(Duration::from_secs(1));
    if engine_thread.join().is_err() {
        eprintln!("pulsar serve: the engine thread failed");
    }
    if let Some(e) = load_failure {
        return Err(e);
    }
    served?;
    eprintln!("pulsar serve: stopped");
    Ok(())
}

/// OpenAI's `system_fingerprint`: what, besides the model, the seed and the
/// request, decides the bits of a reply. Here that is this build, the
/// kernels (their ISA), the weights' packed formats, the inputs'
/// precision, the threads, the blocking (summation order) and the
/// server's prompt chunk (which
/// positions a bulk run computes together): two replies with the same
/// fingerprint, model and seed are the same text.
fn system_fingerprint(engine: &FastEngine, prefill_chunk: usize) -> String {
    use sha2::{Digest, Sha256};
    let backend = format!(
        "pulsar {}\n{}\n{}\ninputs {:?}\nthreads {}\n{:?}\nprompt chunk {prefill_chunk}",
        env!("CARGO_PKG_VERSION"),
        engine.kernels_name(),
        engine.formats().describe(),
        engine.input_precision(),
        engine.threads(),
        engine.blocking(),
    );
    let digest = Sha256::digest(backend.as_bytes());
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("fp_{hex}")
}

/// Ctrl-C or SIGTERM.
async fn wait_for_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
