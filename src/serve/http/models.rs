//! `GET /v1/models` and `GET /v1/models/{model}`: the one model this
//! server has, in OpenAI's shapes.

use super::{App, AppState};
use crate::serve::api::ApiError;
use axum::Router;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
}

fn model_object(app: &App) -> Value {
    json!({
        "id": app.ctx.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "pulsar",
    })
}

async fn models(State(app): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [model_object(&app)],
    }))
    .into_response()
}

/// OpenAI's "retrieve model": the one model this server has, by its id.
async fn model(State(app): State<AppState>, Path(id): Path<String>) -> Response {
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
