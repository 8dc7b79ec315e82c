//! The HTTP side: axum routes, the API-key and metrics middleware, OpenAI
//! error responses, and turning a request's events into a JSON reply or an
//! SSE stream. Handlers do their CPU work (parsing, tokenizing, compiling a
//! schema) on tokio's blocking pool and never wait on the engine thread
//! except through the request's own event channel.

use super::api::{
    ApiError, ChatRequest, CompletionRequest, EmbeddingRequest, TokenLogprob, Usage,
    completion_logprobs,
};
use super::gemma4_calls;
use super::metrics::Metrics;
use super::request::{Prepared, ServeContext};
use super::scheduler::{Job, Queue};
use super::slot::{Event, GenParams};
use super::tokens::{DetokenizeRequest, TokenizeRequest};
use super::tools::CallFormat;
use super::tools::reply::{
    Growth, PartialCall, PartialReply, ReplyStream, call_value, native_call_value, read_partial,
};
use crate::chat::thinking::{self, Part, ThoughtSplitter};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Events buffered per request between the engine thread and the client's
/// connection. A client that stops reading fills it; its request then
/// stalls and is ended after `--stall-timeout` (see the scheduler).
pub const EVENT_BUFFER: usize = 256;

pub struct App {
    pub ctx: Arc<ServeContext>,
    pub queue: Arc<Queue>,
    pub metrics: Arc<Metrics>,
    pub api_key: Option<String>,
    pub max_body: usize,
    /// How long a request's body may take to arrive (`--read-timeout`).
    pub read_timeout: Duration,
    /// No log line per request (`--quiet`).
    pub quiet: bool,
    pub next_id: AtomicU64,
    /// `system_fingerprint` of every completion (see `serve::run`).
    pub fingerprint: String,
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(super::responses::create))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(app.max_body))
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// What the server answers while the model loads: 503 "loading" on every
/// route, `/health` included (load balancers wait for its 200).
pub fn loading_router() -> Router {
    Router::new().fallback(|| async {
        ApiError {
            code: Some("loading"),
            ..ApiError::unavailable("the model is loading; retry in a few seconds", 1)
        }
    })
}

/// Checks the API key (every route but `/health`, which load balancers
/// probe), reads the body within `--read-timeout`, counts responses by
/// route and status, and logs one line per request.
async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_string();
    let line = (!app.quiet).then(|| LogLine {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        status: 0,
        tokens: None,
        started,
    });
    let response = match &app.api_key {
        Some(key) if route != "/health" && !has_key(&req, key) => {
            ApiError::unauthorized().into_response()
        }
        _ => match read_body(&app, req).await {
            Ok(req) => next.run(req).await,
            Err(e) => e.into_response(),
        },
    };
    app.metrics
        .count_request(&route, response.status().as_u16());
    match line {
        Some(mut line) => {
            line.status = response.status().as_u16();
            line.tokens = response.extensions().get::<TokenCount>().cloned();
            // Written when the body has gone out (or the client left).
            response.map(|body| axum::body::Body::new(LoggedBody { body, _line: line }))
        }
        None => response,
    }
}

/// The request with its body read whole within `--read-timeout` (and
/// within `--max-body`): a client that sends less than its
/// `Content-Length`, or sends it slowly, cannot hold a connection.
async fn read_body(app: &App, req: Request) -> Result<Request, ApiError> {
    use http_body_util::BodyExt as _;
    let (parts, body) = req.into_parts();
    let read = http_body_util::Limited::new(body, app.max_body).collect();
    match tokio::time::timeout(app.read_timeout, read).await {
        Ok(Ok(collected)) => Ok(Request::from_parts(
            parts,
            axum::body::Body::from(collected.to_bytes()),
        )),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::too_large(app.max_body))
        }
        Ok(Err(e)) => Err(ApiError::bad_request(format!(
            "the request body could not be read: {e}"
        ))),
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            code: Some("request_timeout"),
            ..ApiError::bad_request(format!(
                "the request body did not arrive within {} s (--read-timeout)",
                app.read_timeout.as_secs()
            ))
        }),
    }
}

/// Tokens a reply counted (prompt and completion), for the request's log
/// line; a stream sets it when its usage is known, at its end.
#[derive(Clone, Default)]
pub(super) struct TokenCount(Arc<AtomicUsize>);

impl TokenCount {
    fn set(&self, tokens: usize) {
        self.0.store(tokens, Ordering::Relaxed);
    }
}

/// One request's line on stderr, written when it is dropped.
struct LogLine {
    method: String,
    path: String,
    status: u16,
    tokens: Option<TokenCount>,
    started: Instant,
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let tokens = match &self.tokens {
            Some(count) => format!("{} tokens", count.0.load(Ordering::Relaxed)),
            None => "- tokens".to_string(),
        };
        eprintln!(
            "pulsar serve: {} {} {} {tokens} {} ms",
            self.method,
            self.path,
            self.status,
            self.started.elapsed().as_millis()
        );
    }
}

/// A response body that writes its request's log line once it is over.
struct LoggedBody {
    body: axum::body::Body,
    /// Held for its `Drop`.
    _line: LogLine,
}

impl http_body::Body for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Whether the request carries the key. Both sides are hashed first and
/// the digests compared in constant time, so the time taken says nothing
/// of where, or whether in length, the key and the guess differ.
fn has_key(req: &Request, key: &str) -> bool {
    use sha2::{Digest, Sha256};
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let Some(given) = given else {
        return false;
    };
    let (a, b) = (
        Sha256::digest(given.as_bytes()),
        Sha256::digest(key.as_bytes()),
    );
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no such endpoint: {} {}; this server has POST /v1/chat/completions, \
         POST /v1/completions, POST /v1/responses, POST /v1/embeddings, GET /v1/models, GET /v1/models/ID, POST /tokenize, \
         POST /detokenize, GET /health and GET /metrics",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: Some("method_not_allowed"),
        ..ApiError::bad_request(format!(
            "{} is not allowed on {}",
            req.method(),
            req.uri().path()
        ))
    }
}

async fn health(State(app): State<Arc<App>>) -> Response {
    // Atomics only: this answers at once whatever the engine is doing.
    let m = &app.metrics;
    let failed = app.queue.engine_failed();
    let body = json!({
        "status": if failed { "error" } else { "ok" },
        "slots_busy": m.busy_slots.load(Ordering::Relaxed),
        "slots": m.slots.load(Ordering::Relaxed),
        "queue": m.queue_length.load(Ordering::Relaxed),
    });
    let status = if failed {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

fn model_object(app: &App) -> Value {
    json!({
        "id": app.ctx.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "pulsar",
    })
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [model_object(&app)],
    }))
    .into_response()
}

/// OpenAI's "retrieve model": the one model this server has, by its id.
async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id != app.ctx.model_id {
        return ApiError::not_found(format!(
            "the model `{id}` does not exist; this server has `{}`",
            app.ctx.model_id
        ))
        .with_code("model_not_found")
        .into_response();
    }
    axum::Json(model_object(&app)).into_response()
}

async fn tokenize(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let work =
        |ctx: &ServeContext, body: &[u8]| Ok(ctx.tokenize(&parse_json::<TokenizeRequest>(body)?));
    match off_the_async_threads(&app, body, work).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let work =
        |ctx: &ServeContext, body: &[u8]| ctx.detokenize(&parse_json::<DetokenizeRequest>(body)?);
    match off_the_async_threads(&app, body, work).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Runs `work` on the request's body on tokio's blocking pool: parsing,
/// tokenizing and compiling a schema take milliseconds (more for a long
/// text), and off the async threads `/health` stays quick meanwhile.
pub(super) async fn off_the_async_threads<T: Send + 'static>(
    app: &App,
    body: Result<Bytes, BytesRejection>,
    work: impl FnOnce(&ServeContext, &[u8]) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let body = body.map_err(|r| body_error(r, app.max_body))?;
    let ctx = app.ctx.clone();
    tokio::task::spawn_blocking(move || work(&ctx, &body))
        .await
        .map_err(|_| ApiError::internal("internal error while reading the request"))?
}

/// The body of a request as JSON of type `T`; a wrong type is a 400 that
/// names the field (by its path, e.g. `messages[0].content`).
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::bad_request(format!("the body is not valid JSON: {inner}"));
        }
        let message = inner.to_string();
        // serde's message for a value that fits no variant of an untagged
        // enum does not say what was expected.
        let message = if message.contains("untagged enum") {
            format!("{path}: expected {}", expected_shape(&path))
        } else if path == "." {
            message
        } else {
            format!("{path}: {message}")
        };
        // A missing field is reported at its parent; name the field.
        let param = if path == "." {
            message
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .map(str::to_string)
        } else {
            Some(path)
        };
        ApiError {
            param,
            ..ApiError::bad_request(message)
        }
    })?;
    de.end()
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    Ok(value)
}

fn expected_shape(path: &str) -> &'static str {
    if path == "stop" {
        "a string or a list of strings"
    } else if path == "prompt" || path == "input" {
        "a string, a list of token ids, or a list of one of those"
    } else if path.ends_with(".content") {
        "a string or a list of content parts"
    } else if path == "tool_choice" {
        "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}"
    } else {
        "another shape"
    }
}

fn body_error(rejection: BytesRejection, limit: usize) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::too_large(limit)
    } else {
        ApiError {
            status: rejection.status(),
            ..ApiError::bad_request(rejection.body_text())
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// What every piece of one reply carries.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    include_usage: bool,
    logprobs: bool,
    /// Choices per prompt (`n`): choice `i` is of prompt `i / n`.
    choices_per_prompt: usize,
    /// `echo`: each prompt's text, which its choices' texts start with.
    echo: Option<Vec<String>>,
    /// Function calling: each choice's text is a reply object, read back
    /// ([`read_partial`]) into calls or content.
    tool_calls: Option<CallFormat>,
    /// Gemma 4's thought channel goes out as `reasoning_content`, as
    /// llama-server sends it.
    thought_channel: bool,
}

impl Reply {
    /// The echoed text choice `i` starts with.
    fn echoed(&self, i: usize) -> Option<&str> {
        let prompts = self.echo.as_ref()?;
        prompts.get(i / self.choices_per_prompt).map(String::as_str)
    }
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    serve(app, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn serve(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    let prepared: Prepared = off_the_async_threads(&app, body, move |ctx, body| match kind {
        Kind::Chat => ctx.prepare_chat(&parse_json::<ChatRequest>(body)?),
        Kind::Completion => ctx.prepare_completion(&parse_json::<CompletionRequest>(body)?),
    })
    .await?;
    let reply = Reply {
        kind,
        id: format!(
            "{}-{:x}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            app.next_id.fetch_add(1, Ordering::Relaxed)
        ),
        created: unix_now(),
        model: app.ctx.model_id.clone(),
        fingerprint: app.fingerprint.clone(),
        include_usage: prepared.include_usage,
        logprobs: prepared.prompts.iter().any(|p| p.params.logprobs.is_some()),
        choices_per_prompt: prepared.choices,
        echo: prepared.echo.then(|| {
            prepared
                .prompts
                .iter()
                .map(|p| app.ctx.tok.decode(&p.tokens))
                .collect()
        }),
        tool_calls: prepared.tool_calls,
        thought_channel: prepared.thought_channel,
    };
    let stream = prepared.stream;
    let events = enqueue(&app, prepared)?;
    if stream {
        Ok(sse(reply, events))
    } else {
        whole(reply, events).await
    }
}

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

/// `POST /v1/embeddings`: each input is read in a slot of its own, as a
/// prompt is (in chunks between the decode steps of running streams), and
/// its vector is the mean of its tokens' final hidden states, scaled to
/// length 1.
async fn embeddings(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    embed(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn embed(app: Arc<App>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let prepared = off_the_async_threads(&app, body, |ctx, body| {
        ctx.prepare_embeddings(&parse_json::<EmbeddingRequest>(body)?)
    })
    .await?;
    let count = prepared.inputs.len();
    let prompt_tokens: usize = prepared.inputs.iter().map(Vec::len).sum();
    let mut jobs = Vec::with_capacity(count);
    let mut receivers = Vec::with_capacity(count);
    for input in prepared.inputs {
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        jobs.push(Job {
            prompt: input,
            params: GenParams::read_only(),
            constraint: None,
            events: tx,
            embed: true,
        });
        receivers.push(rx);
    }
    app.queue
        .submit(jobs, "input", &format!("{count} inputs"))?;
    // Dropped on a client's disconnect, which closes every input's channel
    // and so ends the jobs still running.
    let mut data = Vec::with_capacity(count);
    for (index, rx) in receivers.iter_mut().enumerate() {
        let vector = match rx.recv().await {
            Some(Event::Embedding(vector)) => vector,
            Some(Event::Failed(e)) => return Err(e),
            _ => return Err(ended_early()),
        };
        let embedding = if prepared.base64 {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(vector)
        };
        data.push(json!({
            "object": "embedding",
            "index": index,
            "embedding": embedding,
        }));
    }
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": app.ctx.model_id,
        "usage": { "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens },
    }))
    .into_response())
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

pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Reply {
    fn logprobs_value(&self, tokens: &[TokenLogprob], text_offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => json!({ "content": tokens, "refusal": null }),
            Kind::Completion => completion_logprobs(tokens, text_offset),
        }
    }

    fn usage_value(&self, usage: Usage) -> Value {
        serde_json::to_value(usage).unwrap_or(Value::Null)
    }

    /// A streamed chunk with one choice.
    fn chunk(&self, choice: Value) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut chunk = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// A chat choice's `message` and finish reason from its text: with
    /// function calling, calls become `tool_calls` (the reason
    /// `tool_calls` once the reply is whole) and an answer its content; a
    /// reply that cannot be read is sent as the text it is.
    fn message(
        &self,
        choice: usize,
        text: String,
        reason: Option<&str>,
    ) -> (Value, Option<String>) {
        let plain =
            |content: String| json!({ "role": "assistant", "content": content, "refusal": null });
        let Some(format) = self.tool_calls else {
            return (plain(text), reason.map(str::to_string));
        };
        if format == CallFormat::Native {
            return self.native_message(choice, &text, reason);
        }
        let read = read_partial(&text);
        let reason = tool_reason(&read, reason, format);
        if read.is_unread() {
            return (plain(text), reason);
        }
        if let Some(content) = read.content {
            return (plain(content), reason);
        }
        // A reply cut by the length limit returns only the calls it
        // finished: never arguments that are not JSON (OpenAI's rule; a
        // client would fail to parse them). With none finished, the
        // choice has no content and finish reason "length".
        // An identical repeated call ended the reply: it and what follows
        // are left out.
        let made = read.first_repeat().unwrap_or(read.calls.len());
        let finished: Vec<&PartialCall> = read.calls[..made]
            .iter()
            .filter(|c| read.complete || serde_json::from_str::<Value>(&c.arguments).is_ok())
            .collect();
        if finished.is_empty() {
            let message = json!({ "role": "assistant", "content": null, "refusal": null });
            return (message, reason);
        }
        if format == CallFormat::FunctionCall {
            // One call at most (the schema allows no more).
            let call = finished[0];
            let message = json!({
                "role": "assistant",
                "content": null,
                "function_call": {"name": call.name, "arguments": call.arguments},
                "refusal": null,
            });
            return (message, reason);
        }
        let calls: Vec<Value> = finished
            .iter()
            .enumerate()
            .map(|(k, call)| call_value(call, &self.id, choice, k))
            .collect();
        let message = json!({
            "role": "assistant",
            "content": null,
            "tool_calls": calls,
            "refusal": null,
        });
        (message, reason)
    }

    /// A reply in the model's own call syntax ([`gemma4_calls`]): its
    /// calls as `tool_calls`, the text around them as content; a reply
    /// whose calls do not read is content as it is.
    fn native_message(
        &self,
        choice: usize,
        text: &str,
        reason: Option<&str>,
    ) -> (Value, Option<String>) {
        // An identical repeated call ended the reply: it is left out.
        let text = &text[..gemma4_calls::repeat_start(text).unwrap_or(text.len())];
        let read = gemma4_calls::read_reply(text);
        if read.calls.is_empty() {
            let message = json!({ "role": "assistant", "content": read.content, "refusal": null });
            return (message, reason.map(str::to_string));
        }
        let calls: Vec<Value> = read
            .calls
            .iter()
            .enumerate()
            .map(|(k, c)| native_call_value(&c.name, &c.arguments, &self.id, choice, k))
            .collect();
        let content = (!read.content.is_empty()).then_some(read.content);
        let message = json!({
            "role": "assistant",
            "content": content,
            "tool_calls": calls,
            "refusal": null,
        });
        (message, Some("tool_calls".to_string()))
    }

    fn delta(&self, index: usize, text: &str, logprobs: Value, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Chat => {
                let delta = if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({ "content": text })
                };
                json!({ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
            }
            Kind::Completion => {
                json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish })
            }
        }
    }
}

/// What one choice of a whole (not streamed) reply collected.
#[derive(Default)]
struct Collected {
    text: String,
    /// The echoed prompt's tokens' (`echo` with `logprobs`), then the
    /// reply's.
    logprobs: Vec<TokenLogprob>,
    reason: Option<&'static str>,
}

/// Collects a request's events, every choice's, into one JSON reply.
async fn whole(reply: Reply, mut events: ChoiceEvents) -> Result<Response, ApiError> {
    let mut collected: Vec<Collected> = (0..events.count()).map(|_| Collected::default()).collect();
    let mut usages: Vec<Option<Usage>> = vec![None; events.count()];
    while let Some((i, event)) = events.next().await {
        match event {
            Some(Event::Delta {
                text: piece,
                logprobs: lp,
            }) => {
                collected[i].text.push_str(&piece);
                collected[i].logprobs.extend(lp);
            }
            Some(Event::PromptLogprobs(lp)) => collected[i].logprobs.extend(lp),
            Some(Event::Done {
                reason,
                usage: choice_usage,
            }) => {
                collected[i].reason = Some(reason.as_str());
                usages[i] = Some(choice_usage);
                events.close(i);
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Embedding(_)) | None => return Err(ended_early()),
        }
    }
    let choices: Vec<Value> = collected
        .into_iter()
        .enumerate()
        .map(|(index, mut c)| {
            if let Some(prompt) = reply.echoed(index) {
                c.text.insert_str(0, prompt);
            }
            let logprobs = reply.logprobs_value(&c.logprobs, 0);
            match reply.kind {
                Kind::Chat => {
                    let (thought, text) = match reply.thought_channel {
                        true => thinking::split_reply(&c.text),
                        false => (None, c.text),
                    };
                    let (mut message, reason) = reply.message(index, text, c.reason);
                    if let Some(thought) = thought {
                        message["reasoning_content"] = json!(thought);
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    })
                }
                Kind::Completion => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.reason,
                }),
            }
        })
        .collect();
    let object = match reply.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let usage = Usage::of_request(&usages, reply.choices_per_prompt).ok_or_else(ended_early)?;
    let tokens = TokenCount::default();
    tokens.set(usage.total_tokens);
    let mut response = axum::Json(json!({
        "id": reply.id,
        "object": object,
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": reply.fingerprint,
        "choices": choices,
        "usage": reply.usage_value(usage),
    }))
    .into_response();
    response.extensions_mut().insert(tokens);
    Ok(response)
}

pub(super) fn ended_early() -> ApiError {
    ApiError::internal("the request was ended before its reply was complete")
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Body,
    Usage,
    Done,
    End,
}

/// An SSE reply in the making: the role first (chat; one chunk per
/// choice), each choice's text as it comes, a chunk with each choice's
/// finish reason, the usage when asked for, then `[DONE]`.
struct Streaming {
    reply: Reply,
    events: ChoiceEvents,
    phase: Phase,
    /// Choices whose role chunk went out (chat).
    started: usize,
    /// Each choice's usage, once it ended.
    usages: Vec<Option<Usage>>,
    /// Bytes of text sent per choice, for the completions' `text_offset`.
    sent: Vec<usize>,
    /// `echo`: each choice's prompt chunk, sent before its first text,
    /// and the prompt's log-probabilities gathered until then.
    echoed: Vec<bool>,
    prompt_logprobs: Vec<Vec<TokenLogprob>>,
    /// Function calling: each choice's reply so far and what of it went
    /// out.
    tool_streams: Vec<ToolStream>,
    /// Each choice's thought channel and answer told apart, and the
    /// log-probabilities of text held back while a marker may be forming.
    thoughts: Vec<ThoughtSplitter>,
    held_logprobs: Vec<Vec<TokenLogprob>>,
    /// Replies in the model's own call syntax, gathered until they end.
    native_text: Vec<String>,
    /// Chunks ready to go before anything else.
    queued: VecDeque<SseEvent>,
    /// The request's tokens, for its log line.
    tokens: TokenCount,
}

/// One choice's function-calling reply in a stream.
#[derive(Default)]
struct ToolStream {
    reply: ReplyStream,
    /// Log-probabilities of tokens whose text has not gone out yet.
    logprobs: Vec<TokenLogprob>,
}

/// A function-calling reply's finish reason: `tool_calls` (or the
/// deprecated `function_call`) when it is whole and calls, else the
/// generation's own (`length` for one cut short).
fn tool_reason(read: &PartialReply, reason: Option<&str>, format: CallFormat) -> Option<String> {
    if read.ends_in_calls() {
        Some(match format {
            CallFormat::ToolCalls | CallFormat::Native => "tool_calls".to_string(),
            CallFormat::FunctionCall => "function_call".to_string(),
        })
    } else {
        reason.map(str::to_string)
    }
}

fn data(value: &Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

impl Streaming {
    /// Choice `i`'s echoed prompt, once, before its first text or end.
    fn echo(&mut self, i: usize) {
        let Some(prompt) = self.reply.echoed(i).map(str::to_string) else {
            return;
        };
        if std::mem::replace(&mut self.echoed[i], true) {
            return;
        }
        let logprobs = std::mem::take(&mut self.prompt_logprobs[i]);
        let lp = self.reply.logprobs_value(&logprobs, 0);
        self.sent[i] = prompt.len();
        let choice = self.reply.delta(i, &prompt, lp, None);
        self.queued.push_back(data(&self.reply.chunk(choice)));
    }

    /// Function calling: what choice `i`'s reply says beyond what was
    /// sent, as chunks: a call's id and name when its name is whole, then
    /// its arguments as they are written, or the answer's text. `ended`:
    /// the reply is over, so text that cannot be read goes out as it is.
    /// Log-probabilities wait for the next chunk that carries anything.
    /// Returns the reply as read.
    fn send_tool_deltas(&mut self, i: usize, ended: bool, format: CallFormat) -> PartialReply {
        let (read, grown) = self.tool_streams[i].reply.advance(ended);
        let deltas: Vec<Value> = grown
            .into_iter()
            .map(|growth| match (growth, format) {
                // A reply in the model's own syntax is read whole, not here.
                (Growth::CallStarted(k), CallFormat::ToolCalls | CallFormat::Native) => {
                    let mut start = call_value(&read.calls[k], &self.reply.id, i, k);
                    start["function"]["arguments"] = json!("");
                    start["index"] = json!(k);
                    json!({ "tool_calls": [start] })
                }
                (Growth::CallStarted(k), CallFormat::FunctionCall) => {
                    json!({ "function_call": {"name": read.calls[k].name, "arguments": ""} })
                }
                (Growth::Arguments(k, piece), CallFormat::ToolCalls | CallFormat::Native) => {
                    json!({ "tool_calls": [{"index": k, "function": {"arguments": piece}}] })
                }
                (Growth::Arguments(_, piece), CallFormat::FunctionCall) => {
                    json!({ "function_call": {"arguments": piece} })
                }
                (Growth::Content(piece), _) => json!({ "content": piece }),
            })
            .collect();
        for delta in deltas {
            let logprobs = std::mem::take(&mut self.tool_streams[i].logprobs);
            let lp = self.reply.logprobs_value(&logprobs, 0);
            let choice =
                json!({ "index": i, "delta": delta, "logprobs": lp, "finish_reason": null });
            self.queued.push_back(data(&self.reply.chunk(choice)));
        }
        read
    }

    /// A chat with a thought channel: the thought's text as
    /// `reasoning_content` deltas, the answer's as `content` deltas. The
    /// log-probabilities held so far go with the first of them.
    fn send_thought_parts(&mut self, i: usize, parts: Vec<Part>) {
        for part in parts {
            let delta = match part {
                Part::Thought(text) => json!({ "reasoning_content": text }),
                Part::Answer(text) => json!({ "content": text }),
            };
            let logprobs = std::mem::take(&mut self.held_logprobs[i]);
            let lp = self.reply.logprobs_value(&logprobs, 0);
            let choice =
                json!({ "index": i, "delta": delta, "logprobs": lp, "finish_reason": null });
            self.queued.push_back(data(&self.reply.chunk(choice)));
        }
    }

    /// A whole reply in the model's own call syntax, as chunks: the
    /// thought, the content, then each call whole. Returns the finish
    /// reason (`tool_calls` when it calls).
    fn send_native_reply(&mut self, i: usize, reason: Option<String>) -> Option<String> {
        let text = std::mem::take(&mut self.native_text[i]);
        let (thought, answer) = match self.reply.thought_channel {
            true => thinking::split_reply(&text),
            false => (None, text),
        };
        let (message, reason) = self.reply.native_message(i, &answer, reason.as_deref());
        let mut deltas = Vec::new();
        if let Some(thought) = thought {
            deltas.push(json!({ "reasoning_content": thought }));
        }
        if let Some(content) = message["content"].as_str().filter(|c| !c.is_empty()) {
            deltas.push(json!({ "content": content }));
        }
        for (k, call) in message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let mut call = call.clone();
            call["index"] = json!(k);
            deltas.push(json!({ "tool_calls": [call] }));
        }
        for delta in deltas {
            let logprobs = std::mem::take(&mut self.held_logprobs[i]);
            let lp = self.reply.logprobs_value(&logprobs, 0);
            let choice =
                json!({ "index": i, "delta": delta, "logprobs": lp, "finish_reason": null });
            self.queued.push_back(data(&self.reply.chunk(choice)));
        }
        reason
    }

    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            match self.phase {
                Phase::Start => {
                    if self.reply.kind != Kind::Chat || self.started == self.events.count() {
                        self.phase = Phase::Body;
                        continue;
                    }
                    let role = json!({
                        "index": self.started,
                        "delta": { "role": "assistant", "content": "" },
                        "logprobs": null,
                        "finish_reason": null,
                    });
                    self.started += 1;
                    return Some(data(&self.reply.chunk(role)));
                }
                Phase::Body => match self.events.next().await {
                    Some((i, Some(Event::PromptLogprobs(lp)))) => {
                        self.prompt_logprobs[i].extend(lp);
                    }
                    Some((i, Some(Event::Delta { text, logprobs })))
                        if let Some(format) =
                            self.reply.tool_calls.filter(|&f| f != CallFormat::Native) =>
                    {
                        self.tool_streams[i].reply.push(&text);
                        self.tool_streams[i].logprobs.extend(logprobs);
                        self.send_tool_deltas(i, false, format);
                    }
                    Some((i, Some(Event::Delta { text, logprobs })))
                        if self.reply.tool_calls == Some(CallFormat::Native) =>
                    {
                        // Calls are read from the whole reply; it goes out
                        // when it ends.
                        self.native_text[i].push_str(&text);
                        self.held_logprobs[i].extend(logprobs);
                    }
                    Some((i, Some(Event::Delta { text, logprobs })))
                        if self.reply.thought_channel =>
                    {
                        self.held_logprobs[i].extend(logprobs);
                        let parts = self.thoughts[i].push(&text);
                        self.send_thought_parts(i, parts);
                    }
                    Some((i, Some(Event::Delta { text, logprobs }))) => {
                        self.echo(i);
                        let lp = self.reply.logprobs_value(&logprobs, self.sent[i]);
                        self.sent[i] += text.len();
                        let choice = self.reply.delta(i, &text, lp, None);
                        self.queued.push_back(data(&self.reply.chunk(choice)));
                    }
                    Some((i, Some(Event::Done { reason, usage }))) => {
                        self.echo(i);
                        self.usages[i] = Some(usage);
                        self.events.close(i);
                        let mut reason = Some(reason.as_str().to_string());
                        if self.reply.tool_calls == Some(CallFormat::Native) {
                            reason = self.send_native_reply(i, reason);
                        } else if self.reply.thought_channel {
                            let parts = self.thoughts[i].finish();
                            self.send_thought_parts(i, parts);
                        }
                        let mut logprobs = Value::Null;
                        if let Some(format) =
                            self.reply.tool_calls.filter(|&f| f != CallFormat::Native)
                        {
                            let read = self.send_tool_deltas(i, true, format);
                            reason = tool_reason(&read, reason.as_deref(), format);
                            let left = std::mem::take(&mut self.tool_streams[i].logprobs);
                            if !left.is_empty() {
                                logprobs = self.reply.logprobs_value(&left, 0);
                            }
                        }
                        let choice = self.reply.delta(i, "", logprobs, reason.as_deref());
                        self.queued.push_back(data(&self.reply.chunk(choice)));
                    }
                    Some((_, Some(Event::Failed(e)))) => {
                        self.phase = Phase::Done;
                        return Some(data(&e.body()));
                    }
                    Some((_, None | Some(Event::Embedding(_)))) => {
                        self.phase = Phase::Done;
                        return Some(data(&ended_early().body()));
                    }
                    None => self.phase = Phase::Usage,
                },
                Phase::Usage => {
                    self.phase = Phase::Done;
                    let usage = Usage::of_request(&self.usages, self.reply.choices_per_prompt);
                    if let Some(usage) = usage {
                        self.tokens.set(usage.total_tokens);
                    }
                    if let (true, Some(usage)) = (self.reply.include_usage, usage) {
                        let mut chunk = self.reply.chunk(Value::Null);
                        chunk["choices"] = json!([]);
                        chunk["usage"] = self.reply.usage_value(usage);
                        return Some(data(&chunk));
                    }
                }
                Phase::Done => {
                    self.phase = Phase::End;
                    return Some(SseEvent::default().data("[DONE]"));
                }
                Phase::End => return None,
            }
        }
    }
}

fn sse(reply: Reply, events: ChoiceEvents) -> Response {
    let count = events.count();
    let state = Streaming {
        reply,
        events,
        phase: Phase::Start,
        started: 0,
        usages: vec![None; count],
        sent: vec![0; count],
        echoed: vec![false; count],
        prompt_logprobs: vec![Vec::new(); count],
        tool_streams: (0..count).map(|_| ToolStream::default()).collect(),
        thoughts: (0..count).map(|_| ThoughtSplitter::new()).collect(),
        held_logprobs: vec![Vec::new(); count],
        native_text: vec![String::new(); count],
        queued: VecDeque::new(),
        tokens: TokenCount::default(),
    };
    let tokens = state.tokens.clone();
    let mut response = sse_response(state);
    response.extensions_mut().insert(tokens);
    response
}

/// A reply's stream of server-sent events, one at a time until `None`.
pub(super) trait SseSource: Send + 'static {
    fn next_event(&mut self) -> impl Future<Output = Option<SseEvent>> + Send;
}

impl SseSource for Streaming {
    fn next_event(&mut self) -> impl Future<Output = Option<SseEvent>> + Send {
        self.next()
    }
}

/// The SSE response of a source of events.
pub(super) fn sse_response(source: impl SseSource) -> Response {
    let events = futures_util::stream::unfold(source, |mut source| async move {
        let event = source.next_event().await?;
        Some((Ok::<_, Infallible>(event), source))
    });
    // Comments every 15 s keep proxies from closing a stream that waits
    // in the queue or behind a long prefill; clients ignore them.
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_the_field() {
        let e = parse_json::<ChatRequest>(br#"{"messages": [], "temperature": "hot"}"#)
            .err()
            .map(|e| (e.param, e.message));
        let (param, message) = e.unwrap_or_default();
        assert_eq!(param.as_deref(), Some("temperature"));
        assert!(
            message.starts_with("temperature: invalid type"),
            "{message}"
        );

        let e = parse_json::<ChatRequest>(br#"{"messages": [{"role": "user", "content": 5}]}"#);
        let e = e.err().map(|e| (e.param, e.message)).unwrap_or_default();
        assert_eq!(e.0.as_deref(), Some("messages[0].content"));
        assert!(
            e.1.contains("a string or a list of content parts"),
            "{}",
            e.1
        );
    }

    #[test]
    fn malformed_json_is_a_bad_request_and_unknown_fields_are_ignored() {
        let e = parse_json::<ChatRequest>(b"{\"messages\": [").err();
        assert!(e.is_some_and(|e| e.param.is_none() && e.message.contains("not valid JSON")));
        let ok = parse_json::<ChatRequest>(br#"{"messages": [], "frobnicate": {"x": 1}}"#);
        assert!(ok.is_ok());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn while_loading_every_route_answers_503_loading() {
        use tower::ServiceExt as _;
        for (method, path) in [("GET", "/health"), ("POST", "/v1/completions")] {
            let req = Request::builder()
                .method(method)
                .uri(path)
                .body(axum::body::Body::empty())
                .unwrap_or_default();
            let response = loading_router().oneshot(req).await;
            let Ok(response) = response;
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
            assert!(response.headers().contains_key(header::RETRY_AFTER));
            let body = axum::body::to_bytes(response.into_body(), 1 << 16).await;
            let body: Value = serde_json::from_slice(&body.unwrap_or_default()).unwrap_or_default();
            assert_eq!(body["error"]["code"], "loading", "{body}");
        }
    }

    #[test]
    fn the_key_is_checked_exactly() {
        let req = |auth: &str| {
            Request::builder()
                .header(header::AUTHORIZATION, auth)
                .body(axum::body::Body::empty())
                .unwrap_or_default()
        };
        assert!(has_key(&req("Bearer sekrit"), "sekrit"));
        assert!(!has_key(&req("Bearer sekri"), "sekrit"));
        assert!(!has_key(&req("Bearer sekrit2"), "sekrit"));
        assert!(!has_key(&req("sekrit"), "sekrit"));
    }
}
