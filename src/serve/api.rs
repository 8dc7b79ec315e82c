//! The OpenAI API's request and response bodies, as far as Pulsar serves
//! them, and its error shape.
//!
//! Requests are read with serde: a field Pulsar does not know is ignored
//! (as OpenAI does), a known field of the wrong type is a 400 that names it.
//! Fields Pulsar knows but cannot honour (`suffix`, `best_of` above `n`…) are
//! refused by [`super::request`] rather than ignored.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param",
/// "code"}}`.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`…
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A 400 about one request field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
            retry_after: None,
        }
    }

    /// A 400 about the request as a whole (its body is not JSON).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            param: None,
            ..ApiError::invalid("", message)
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or wrong API key: send the header `Authorization: Bearer <key>` \
                      with the key the server was started with"
                .into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the request body is larger than the server's limit of {limit} bytes (--max-body)"
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }

    /// 503: every slot is busy and the queue is full, or the server is
    /// shutting down.
    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("server_busy"),
            retry_after: Some(retry_after),
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
            retry_after: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The JSON body, also sent as the last event of a stream that fails.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after
            && let Ok(value) = HeaderValue::from_str(&secs.to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        response
    }
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// `response_format`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Clone, Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub schema: Option<Value>,
    /// Pulsar always enforces the schema, strict or not.
    pub strict: Option<bool>,
}

/// The sampling and stopping fields both endpoints share.
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<u32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<ResponseFormat>,
}

/// `POST /v1/chat/completions`. The shared fields are repeated rather than
/// flattened: serde's `flatten` buffers the body and then reports a wrong
/// type without the field's name.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    /// The deprecated form of `tools`: one call per reply, in
    /// `message.function_call`.
    pub functions: Option<Vec<FunctionDefinition>>,
    /// The deprecated form of `tool_choice`.
    pub function_call: Option<LegacyFunctionCall>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<u32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<ResponseFormat>,
    /// Settings for the chat template, as llama-server takes them:
    /// `{"enable_thinking": true}` lets Gemma 4 think before it answers.
    pub chat_template_kwargs: Option<ChatTemplateKwargs>,
}

/// `chat_template_kwargs` of a chat request.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChatTemplateKwargs {
    pub enable_thinking: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    /// The number of top alternatives per token (0 = the sampled token's
    /// own log-probability only).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<u32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<ResponseFormat>,
}

macro_rules! sampling_of {
    ($r:expr) => {
        Sampling {
            temperature: $r.temperature,
            top_p: $r.top_p,
            top_k: $r.top_k,
            min_p: $r.min_p,
            seed: $r.seed,
            max_tokens: $r.max_tokens,
            max_completion_tokens: $r.max_completion_tokens,
            stop: $r.stop.clone(),
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            repeat_penalty: $r.repeat_penalty,
            repeat_last_n: $r.repeat_last_n,
            logit_bias: $r.logit_bias.clone(),
            n: $r.n,
            stream: $r.stream,
            stream_options: $r.stream_options.clone(),
            response_format: $r.response_format.clone(),
        }
    };
}

impl ChatRequest {
    pub fn sampling(&self) -> Sampling {
        sampling_of!(self)
    }
}

impl CompletionRequest {
    pub fn sampling(&self) -> Sampling {
        sampling_of!(self)
    }
}

/// A chat message. `content` may be a string or a list of parts.
#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant message's calls (the history of a conversation with
    /// tools).
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// An assistant message's call in the deprecated `functions` form.
    pub function_call: Option<CalledFunction>,
    /// A `tool` message: the function that answered (optional; found from
    /// `tool_call_id` when left out).
    pub name: Option<String>,
}

/// One entry of `tools`.
#[derive(Clone, Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Option<FunctionDefinition>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct FunctionDefinition {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments object.
    pub parameters: Option<Value>,
    /// Pulsar always holds the arguments to the schema, strict or not.
    pub strict: Option<bool>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or one function.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Function {
        #[serde(rename = "type")]
        kind: String,
        function: NamedFunction,
    },
}

#[derive(Clone, Debug, Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

/// `function_call` (deprecated): `"none"`, `"auto"` or `{"name": …}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum LegacyFunctionCall {
    Mode(String),
    Named { name: String },
}

/// A call in an assistant message of the history.
#[derive(Clone, Debug, Deserialize)]
pub struct MessageToolCall {
    pub id: Option<String>,
    pub function: CalledFunction,
}

#[derive(Clone, Debug, Deserialize)]
pub struct CalledFunction {
    pub name: String,
    /// The arguments as JSON text, as OpenAI sends them.
    pub arguments: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `prompt`: text, token ids, or a list of one of those (a batch, of which
/// Pulsar serves one).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/embeddings`.
#[derive(Clone, Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    /// One input or a batch: text, token ids, or a list of either.
    pub input: Prompt,
    /// `float` (the default) or `base64` (little-endian f32 values, what
    /// OpenAI's Python client asks for).
    pub encoding_format: Option<String>,
    /// Only the model's own width is served.
    pub dimensions: Option<u32>,
}

/// `usage`.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// How many prompt tokens came from a slot's KV cache (prefix reuse).
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, cached: usize, completion: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }

    /// The usage of a request from its choices' own, in order, `n` per
    /// prompt (`None` for a choice that has not ended). Each prompt is
    /// counted once (as OpenAI counts it) with, as cached, the tokens none
    /// of its choices had to prefill; the choices' tokens are added up.
    /// `None` until every choice has ended.
    pub fn of_request(choices: &[Option<Usage>], n: usize) -> Option<Usage> {
        let mut total = Usage::new(0, 0, 0);
        for prompt in choices.chunks(n.max(1)) {
            let mut prompt_tokens = 0;
            let mut cached = usize::MAX;
            for usage in prompt {
                let usage = (*usage)?;
                prompt_tokens = usage.prompt_tokens;
                cached = cached.min(usage.prompt_tokens_details.cached_tokens);
                total.completion_tokens += usage.completion_tokens;
            }
            total.prompt_tokens += prompt_tokens;
            total.prompt_tokens_details.cached_tokens += cached;
        }
        total.total_tokens = total.prompt_tokens + total.completion_tokens;
        Some(total)
    }
}

pub use crate::generate::logprobs::{TokenLogprob, TopLogprob};

/// The legacy completions `logprobs` object for some tokens.
pub fn completion_logprobs(tokens: &[TokenLogprob], text_offset_start: usize) -> Value {
    let mut offset = text_offset_start;
    let mut offsets = Vec::with_capacity(tokens.len());
    for t in tokens {
        offsets.push(offset);
        offset += t.token.len();
    }
    // An echoed prompt's first token is unscored (NaN): null in both
    // lists, as OpenAI reports it.
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            if t.logprob.is_nan() {
                return Value::Null;
            }
            let mut map = serde_json::Map::new();
            for alt in &t.top_logprobs {
                map.insert(alt.token.clone(), serde_json::json!(alt.logprob));
            }
            Value::Object(map)
        })
        .collect();
    let scores: Vec<Value> = tokens
        .iter()
        .map(|t| {
            if t.logprob.is_nan() {
                Value::Null
            } else {
                serde_json::json!(t.logprob)
            }
        })
        .collect();
    serde_json::json!({
        "tokens": tokens.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": scores,
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// `POST /v1/responses` (OpenAI's Responses API), as far as Pulsar serves
/// it: a conversation in `input`, sampling settings, function tools and a
/// text format. It is served as the chat completion it amounts to.
#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: ResponsesInput,
    /// System text, before the conversation.
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stream: Option<bool>,
    /// Extra output: `message.output_text.logprobs` adds each output
    /// token's log-probability; other values name output Pulsar does not
    /// make and are ignored.
    pub include: Option<Vec<String>>,
    /// Alternatives per output token (with or without `include`).
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<ResponsesTool>>,
    pub tool_choice: Option<ResponsesToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    pub text: Option<ResponsesText>,
    /// Refused: this server keeps no responses to continue from.
    pub previous_response_id: Option<String>,
    /// Echoed back; the server stores nothing either way.
    pub store: Option<bool>,
    pub metadata: Option<Value>,
}

/// `input`: one user message as text, or a list of items.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ResponsesInput {
    Text(String),
    Items(Vec<InputItem>),
}

/// One `input` item: a message (`type` `message` or left out), a
/// `function_call` the model made, or a `function_call_output`.
#[derive(Clone, Debug, Deserialize)]
pub struct InputItem {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub role: Option<String>,
    pub content: Option<Content>,
    pub call_id: Option<String>,
    pub name: Option<String>,
    pub arguments: Option<String>,
    /// A function call's result, as text.
    pub output: Option<String>,
}

/// A Responses API tool: the function's fields are at the top level.
#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// `tool_choice`: a mode, or `{"type": "function", "name": …}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ResponsesToolChoice {
    Mode(String),
    Function {
        #[serde(rename = "type")]
        kind: String,
        name: String,
    },
}

/// `text`: the output's format.
#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesText {
    pub format: Option<ResponsesTextFormat>,
}

/// `text.format`: `text`, `json_object`, or `json_schema` with the schema's
/// fields beside the type.
#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesTextFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}
