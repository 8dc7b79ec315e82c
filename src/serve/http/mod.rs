//! The HTTP app: the state every handler shares ([`App`]), the router
//! that merges each endpoint family's routes under one middleware
//! ([`guard`]), a request body read as JSON (a wrong field is a 400 that
//! names it), and the SSE plumbing streamed replies go out through.
//! Handlers do their CPU work (parsing, tokenizing, compiling a schema) on
//! tokio's blocking pool and never wait on the engine thread except through
//! the request's own event channel.
//!
//! One module per endpoint family, each with its `routes()`:
//! - [`completions`]: chat (`/v1/chat/completions`) and legacy
//!   (`/v1/completions`) completions, which share the reply and stream
//!   machinery;
//! - [`responses`]: OpenAI's Responses API (`/v1/responses`), served as the
//!   chat request it amounts to;
//! - [`embeddings`]: one vector per input (`/v1/embeddings`);
//! - [`models`]: the model list (`/v1/models`, `/v1/models/{model}`);
//! - [`tokens`]: text to token ids and back (`/tokenize`, `/detokenize`,
//!   llama-server's shapes);
//! - [`status`]: the server's state (`/health`, `/metrics`).
//!
//! [`choices`] puts a prepared request's sequences in the queue and reads
//! their events back, for the endpoints that generate.

mod choices;
mod completions;
mod embeddings;
mod guard;
mod models;
mod responses;
mod status;
mod tokens;

use super::api::ApiError;
use super::metrics::Metrics;
use super::request::ServeContext;
use super::scheduler::Queue;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The server as every handler and the middleware see it.
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

/// What the handlers share; axum hands each one a clone of the `Arc`.
pub type AppState = Arc<App>;

pub fn router(app: AppState) -> Router {
    Router::new()
        .merge(completions::routes())
        .merge(responses::routes())
        .merge(embeddings::routes())
        .merge(models::routes())
        .merge(tokens::routes())
        .merge(status::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(app.max_body))
        .layer(middleware::from_fn_with_state(app.clone(), guard::guard))
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

/// Runs `work` on the request's body on tokio's blocking pool: parsing,
/// tokenizing and compiling a schema take milliseconds (more for a long
/// text), and off the async threads `/health` stays quick meanwhile.
async fn off_the_async_threads<T: Send + 'static>(
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
fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
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

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A reply's stream of server-sent events, one at a time until `None`.
trait SseSource: Send + 'static {
    fn next_event(&mut self) -> impl Future<Output = Option<SseEvent>> + Send;
}

/// The SSE response of a source of events.
fn sse_response(source: impl SseSource) -> Response {
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

/// An SSE event whose data is `value` as JSON.
fn data(value: &Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::api::ChatRequest;
    use axum::http::header;

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
}
