//! The middleware every route goes through: the API key (every route but
//! `/health`, which load balancers probe), the body read within
//! `--read-timeout`, the response counted by route and status, and one log
//! line per request, written when its body has gone out.

use super::{App, AppState};
use crate::serve::api::ApiError;
use axum::body::Bytes;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Instant;

/// Checks the API key (every route but `/health`, which load balancers
/// probe), reads the body within `--read-timeout`, counts responses by
/// route and status, and logs one line per request.
pub(super) async fn guard(State(app): State<AppState>, req: Request, next: Next) -> Response {
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
    pub(super) fn set(&self, tokens: usize) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
