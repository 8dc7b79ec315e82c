//! `GET /health` and `GET /metrics`: the server's state for load
//! balancers and for Prometheus. Both read atomics only, so they answer at
//! once whatever the engine is doing.

use super::AppState;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use std::sync::atomic::Ordering;

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
}

async fn health(State(app): State<AppState>) -> Response {
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

async fn metrics(State(app): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}
