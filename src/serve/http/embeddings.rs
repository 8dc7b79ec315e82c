//! `POST /v1/embeddings`: one vector per input, each input read in a slot
//! of its own between the decode steps of running streams.

use super::choices::{EVENT_BUFFER, ended_early};
use super::{AppState, off_the_async_threads, parse_json};
use crate::serve::api::{ApiError, EmbeddingRequest};
use crate::serve::scheduler::Job;
use crate::serve::slot::{Event, GenParams};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::mpsc;

pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/v1/embeddings", post(embeddings))
}

/// `POST /v1/embeddings`: each input is read in a slot of its own, as a
/// prompt is (in chunks between the decode steps of running streams), and
/// its vector is the mean of its tokens' final hidden states, scaled to
/// length 1.
async fn embeddings(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    embed(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn embed(app: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
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
