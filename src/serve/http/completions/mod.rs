//! `POST /v1/chat/completions` and `POST /v1/completions`: both prepare
//! their request into prompts and settings, queue each prompt's choices,
//! and write the events back as one JSON reply ([`whole`]) or as an SSE
//! stream ([`stream`]). They differ in the reply's shape only ([`Kind`]):
//! a chat's `message` (with its calls, read back from a function-calling
//! reply, and its thought as `reasoning_content`) or a completion's `text`.

mod stream;

use super::choices::{ChoiceEvents, ended_early, enqueue};
use super::guard::TokenCount;
use super::{AppState, off_the_async_threads, parse_json, unix_now};
use crate::chat::thinking;
use crate::serve::api::{
    ApiError, ChatRequest, CompletionRequest, TokenLogprob, Usage, completion_logprobs,
};
use crate::serve::gemma4_calls;
use crate::serve::request::Prepared;
use crate::serve::slot::Event;
use crate::serve::tools::CallFormat;
use crate::serve::tools::reply::{
    PartialCall, PartialReply, call_value, native_call_value, read_partial,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
}

/// Which endpoint a reply answers: the shapes differ, the machinery not.
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

async fn chat_completions(
    State(app): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(app, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    serve(app, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn serve(
    app: AppState,
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
    let streamed = prepared.stream;
    let events = enqueue(&app, prepared)?;
    if streamed {
        Ok(stream::sse(reply, events))
    } else {
        whole(reply, events).await
    }
}

impl Reply {
    /// The echoed text choice `i` starts with.
    fn echoed(&self, i: usize) -> Option<&str> {
        let prompts = self.echo.as_ref()?;
        prompts.get(i / self.choices_per_prompt).map(String::as_str)
    }

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
