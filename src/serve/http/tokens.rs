//! `POST /tokenize` and `POST /detokenize`, in llama-server's shapes, so
//! that a client can count a prompt's tokens or read ids back as text with
//! the server's own tokenizer (no second copy of the vocabulary on its
//! side). Both run on tokio's blocking pool like the completions' parsing:
//! a long text takes milliseconds to tokenize.

use super::{AppState, off_the_async_threads, parse_json};
use crate::serve::api::ApiError;
use crate::serve::request::ServeContext;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::{Deserialize, Serialize};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
}

async fn tokenize(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let work =
        |ctx: &ServeContext, body: &[u8]| Ok(ctx.tokenize(&parse_json::<TokenizeRequest>(body)?));
    match off_the_async_threads(&app, body, work).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let work =
        |ctx: &ServeContext, body: &[u8]| ctx.detokenize(&parse_json::<DetokenizeRequest>(body)?);
    match off_the_async_threads(&app, body, work).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /tokenize`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    /// Start with BOS (llama-server's default: no).
    #[serde(default)]
    pub add_special: bool,
    /// Whether control-token text in `content` (`<start_of_turn>`) becomes
    /// its single id (llama-server's default: yes) or stays plain
    /// characters, as a chat message's text does.
    #[serde(default = "yes")]
    pub parse_special: bool,
    /// Each id with its piece (`{"id", "piece"}`) instead of bare ids.
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum TokenizeReply {
    Ids { tokens: Vec<u32> },
    Pieces { tokens: Vec<Piece> },
}

#[derive(Debug, Serialize)]
pub struct Piece {
    pub id: u32,
    /// The text the token adds (SentencePiece's `▁` as a space, control
    /// tokens written out); a byte token that is not a character on its
    /// own as the list of its byte values, as llama-server gives it.
    pub piece: PieceText,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum PieceText {
    Text(String),
    Bytes(Vec<u8>),
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeReply {
    pub content: String,
}

impl ServeContext {
    pub fn tokenize(&self, r: &TokenizeRequest) -> TokenizeReply {
        let ids = if r.parse_special {
            self.tok.encode(&r.content, r.add_special)
        } else {
            self.tok.encode_untrusted(&r.content, r.add_special)
        };
        if !r.with_pieces {
            return TokenizeReply::Ids { tokens: ids };
        }
        let tokens = ids
            .iter()
            .map(|&id| {
                // The encoder only makes ids of its own vocabulary.
                let bytes = self.tok.piece_bytes(id).unwrap_or_default();
                let piece = match String::from_utf8(bytes) {
                    Ok(text) => PieceText::Text(text),
                    Err(e) => PieceText::Bytes(e.into_bytes()),
                };
                Piece { id, piece }
            })
            .collect();
        TokenizeReply::Pieces { tokens }
    }

    /// The ids' text, control tokens written out (`<start_of_turn>`), so
    /// that detokenizing what `/tokenize` gave returns its content.
    pub fn detokenize(&self, r: &DetokenizeRequest) -> Result<DetokenizeReply, ApiError> {
        let vocab = self.tok.vocab_size();
        if let Some(at) = r.tokens.iter().position(|&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("tokens[{at}]"),
                format!(
                    "token id {} is outside the vocabulary ({vocab} tokens)",
                    r.tokens[at]
                ),
            ));
        }
        Ok(DetokenizeReply {
            content: self.tok.decode_with_control(&r.tokens),
        })
    }
}
