//! `POST /v1/responses`: OpenAI's Responses API over the chat path.
//!
//! A request is turned into the chat completion it amounts to
//! ([`chat_request`]: `instructions` as a system message, `input` items as
//! messages, function calls and their outputs as the chat's tool calls and
//! `tool` messages, `text.format` as `response_format`), prepared and
//! queued as one; its events are then written as a response object, or as
//! the Responses API's typed stream events (`response.created`, each
//! output item's `added` / deltas / `done`, then `response.completed` or
//! `response.incomplete`). Nothing is stored: `previous_response_id` is
//! refused, and a client sends the whole conversation in `input`.

use super::choices::{ChoiceEvents, ended_early, enqueue};
use super::{AppState, SseSource, off_the_async_threads, parse_json, sse_response, unix_now};
use crate::serve::api::{
    ApiError, CalledFunction, ChatRequest, Content, ContentPart, FunctionDefinition,
    JsonSchemaFormat, Message, MessageToolCall, NamedFunction, ResponseFormat, ResponsesInput,
    ResponsesRequest, ResponsesToolChoice, TokenLogprob, Tool, ToolChoice, Usage,
};
use crate::serve::slot::Event;
use crate::serve::tools::reply::{
    Growth, PartialCall, PartialReply, ReplyStream, call_value, read_partial,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/v1/responses", post(create))
}

/// The handler of `POST /v1/responses`.
async fn create(State(app): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn respond(app: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (request, prepared) = off_the_async_threads(&app, body, |ctx, body| {
        let request: ResponsesRequest = parse_json(body)?;
        let chat = chat_request(&request)?;
        let prepared = ctx.prepare_chat(&chat).map_err(responses_param)?;
        Ok((request, prepared))
    })
    .await?;
    let shape = Shape {
        id: format!("resp_{:x}", app.next_id.fetch_add(1, Ordering::Relaxed)),
        created_at: unix_now(),
        model: app.ctx.model_id.clone(),
        tool_calls: prepared.tool_calls.is_some(),
        logprobs: wants_logprobs(&request) && prepared.tool_calls.is_none(),
        echo: echoed_settings(&request),
    };
    let stream = prepared.stream;
    let events = enqueue(&app, prepared)?;
    if stream {
        Ok(sse(shape, events))
    } else {
        whole(shape, events).await
    }
}

/// The chat completion request a Responses request amounts to.
pub fn chat_request(req: &ResponsesRequest) -> Result<ChatRequest, ApiError> {
    if req.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "previous_response_id",
            "previous_response_id is not supported: this server stores no responses; send the \
             whole conversation in `input`",
        ));
    }
    let mut messages: Vec<Message> = Vec::new();
    if let Some(instructions) = &req.instructions {
        messages.push(message("system", Some(Content::Text(instructions.clone()))));
    }
    match &req.input {
        ResponsesInput::Text(text) => {
            messages.push(message("user", Some(Content::Text(text.clone()))))
        }
        ResponsesInput::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                let field = |name: &str| format!("input[{i}].{name}");
                let needed = |value: &Option<String>, name: &str, what: &str| {
                    value.clone().ok_or_else(|| {
                        ApiError::invalid(field(name), format!("{what} needs `{name}`"))
                    })
                };
                match item.kind.as_deref() {
                    None | Some("message") => {
                        let role = needed(&item.role, "role", "a message")?;
                        let content = item
                            .content
                            .as_ref()
                            .map(|c| chat_content(c, &field("content")))
                            .transpose()?;
                        messages.push(message(&role, content));
                    }
                    Some("function_call") => {
                        let call = MessageToolCall {
                            id: Some(needed(&item.call_id, "call_id", "a function_call")?),
                            function: CalledFunction {
                                name: needed(&item.name, "name", "a function_call")?,
                                arguments: item.arguments.clone().unwrap_or_else(|| "{}".into()),
                            },
                        };
                        // Calls in a row are one assistant turn.
                        match messages.last_mut() {
                            Some(last) if last.role == "assistant" && last.content.is_none() => {
                                last.tool_calls.get_or_insert_with(Vec::new).push(call);
                            }
                            _ => messages.push(Message {
                                tool_calls: Some(vec![call]),
                                ..message("assistant", None)
                            }),
                        }
                    }
                    Some("function_call_output") => messages.push(Message {
                        tool_call_id: Some(needed(
                            &item.call_id,
                            "call_id",
                            "a function_call_output",
                        )?),
                        ..message(
                            "tool",
                            Some(Content::Text(needed(
                                &item.output,
                                "output",
                                "a function_call_output",
                            )?)),
                        )
                    }),
                    Some(other) => {
                        return Err(ApiError::invalid(
                            field("type"),
                            format!(
                                "input items of type {other:?} are not supported; use message, \
                                 function_call or function_call_output"
                            ),
                        ));
                    }
                }
            }
        }
    }
    let tools = req
        .tools
        .as_ref()
        .map(|tools| {
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    if t.kind != "function" {
                        return Err(ApiError::invalid(
                            format!("tools[{i}].type"),
                            format!(
                                "tools of type {:?} are not supported; only \"function\" \
                                 (built-in tools such as web search are not served here)",
                                t.kind
                            ),
                        ));
                    }
                    let name = t.name.clone().ok_or_else(|| {
                        ApiError::invalid(
                            format!("tools[{i}].name"),
                            "a function tool needs `name`",
                        )
                    })?;
                    Ok(Tool {
                        kind: t.kind.clone(),
                        function: Some(FunctionDefinition {
                            name,
                            description: t.description.clone(),
                            parameters: t.parameters.clone(),
                            strict: t.strict,
                        }),
                    })
                })
                .collect::<Result<Vec<_>, ApiError>>()
        })
        .transpose()?;
    let tool_choice = req.tool_choice.as_ref().map(|c| match c {
        ResponsesToolChoice::Mode(mode) => ToolChoice::Mode(mode.clone()),
        ResponsesToolChoice::Function { kind, name } => ToolChoice::Function {
            kind: kind.clone(),
            function: NamedFunction { name: name.clone() },
        },
    });
    let response_format = match req.text.as_ref().and_then(|t| t.format.as_ref()) {
        None => None,
        Some(f) => Some(match f.kind.as_str() {
            "text" => ResponseFormat::Text,
            "json_object" => ResponseFormat::JsonObject,
            "json_schema" => ResponseFormat::JsonSchema {
                json_schema: JsonSchemaFormat {
                    name: f.name.clone(),
                    schema: f.schema.clone(),
                    strict: f.strict,
                },
            },
            other => {
                return Err(ApiError::invalid(
                    "text.format.type",
                    format!("text.format of type {other:?}: use text, json_object or json_schema"),
                ));
            }
        }),
    };
    let logprobs = wants_logprobs(req);
    Ok(ChatRequest {
        model: req.model.clone(),
        messages,
        logprobs: logprobs.then_some(true),
        top_logprobs: logprobs.then(|| req.top_logprobs.unwrap_or(0)),
        tools,
        tool_choice,
        parallel_tool_calls: req.parallel_tool_calls,
        functions: None,
        function_call: None,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        max_tokens: None,
        max_completion_tokens: req.max_output_tokens,
        stop: None,
        presence_penalty: None,
        frequency_penalty: None,
        repeat_penalty: None,
        repeat_last_n: None,
        logit_bias: None,
        n: None,
        stream: req.stream,
        stream_options: None,
        response_format,
        chat_template_kwargs: None,
    })
}

/// Output tokens' log-probabilities are asked for: by `include` or by
/// `top_logprobs` above 0.
fn wants_logprobs(req: &ResponsesRequest) -> bool {
    req.include
        .iter()
        .flatten()
        .any(|i| i == "message.output_text.logprobs")
        || req.top_logprobs.is_some_and(|n| n > 0)
}

fn message(role: &str, content: Option<Content>) -> Message {
    Message {
        role: role.to_string(),
        content,
        tool_calls: None,
        tool_call_id: None,
        function_call: None,
        name: None,
    }
}

/// Content parts of the Responses API (`input_text`, `output_text`) as
/// the chat's text parts.
fn chat_content(content: &Content, field: &str) -> Result<Content, ApiError> {
    let Content::Parts(parts) = content else {
        return Ok(content.clone());
    };
    parts
        .iter()
        .enumerate()
        .map(|(j, part)| match part.kind.as_str() {
            "input_text" | "output_text" | "text" => Ok(ContentPart {
                kind: "text".into(),
                text: part.text.clone(),
            }),
            other => Err(ApiError::invalid(
                format!("{field}[{j}].type"),
                format!("content parts of type {other:?} are not supported; only input_text and output_text"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Content::Parts)
}

/// A refusal about a chat field, named as the Responses API names it.
/// (A message's index is its place among the chat's messages: after
/// `instructions`, with calls in a row as one.)
fn responses_param(mut e: ApiError) -> ApiError {
    if let Some(param) = e.param.take() {
        let renamed = [
            ("max_completion_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"),
            ("messages", "input"),
        ]
        .iter()
        .find_map(|(chat, responses)| {
            param
                .strip_prefix(chat)
                .map(|rest| format!("{responses}{rest}"))
        });
        let renamed = renamed
            .unwrap_or(param)
            .replace(".function.", ".")
            .replace(".tool_call_id", ".call_id");
        e.param = Some(renamed);
    }
    e
}

/// The request settings a response object repeats.
fn echoed_settings(req: &ResponsesRequest) -> Value {
    let tools: Vec<Value> = req
        .tools
        .iter()
        .flatten()
        .map(|t| {
            json!({"type": t.kind, "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict.unwrap_or(false)})
        })
        .collect();
    let tool_choice = match &req.tool_choice {
        None => json!("auto"),
        Some(ResponsesToolChoice::Mode(mode)) => json!(mode),
        Some(ResponsesToolChoice::Function { kind, name }) => json!({"type": kind, "name": name}),
    };
    let format = match req.text.as_ref().and_then(|t| t.format.as_ref()) {
        None => json!({"type": "text"}),
        Some(f) => json!({"type": f.kind, "name": f.name, "schema": f.schema, "strict": f.strict}),
    };
    json!({
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "text": {"format": format},
        "store": req.store.unwrap_or(false),
        "metadata": req.metadata.clone().unwrap_or_else(|| json!({})),
    })
}

/// What every part of one response carries.
struct Shape {
    id: String,
    created_at: u64,
    model: String,
    /// Function calling: the reply is read back into calls or a message.
    tool_calls: bool,
    /// A text reply carries its tokens' log-probabilities (not a function
    /// calling reply, whose tokens are the calls' JSON).
    logprobs: bool,
    /// The request's settings, repeated in the response object.
    echo: Value,
}

/// The finish of a response: `completed`, or `incomplete` when
/// `max_output_tokens` (or the context) ended it.
fn status(reason: Option<&str>) -> (&'static str, Value) {
    match reason {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
        None => ("in_progress", Value::Null),
    }
}

impl Shape {
    /// The response object with these output items.
    fn object(&self, reason: Option<&str>, output: &[Value], usage: Option<Usage>) -> Value {
        let (status, incomplete) = status(reason);
        let mut object = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage.map(|u| json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens,
            })),
        });
        if let (Some(object), Some(echo)) = (object.as_object_mut(), self.echo.as_object()) {
            object.extend(echo.clone());
        }
        object
    }

    fn message_id(&self, index: usize) -> String {
        format!("msg_{}_{index}", self.id.trim_start_matches("resp_"))
    }

    fn message_item(
        &self,
        index: usize,
        text: &str,
        logprobs: &[TokenLogprob],
        status: &str,
    ) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([text_part(text, logprobs)])
        };
        json!({
            "type": "message",
            "id": self.message_id(index),
            "status": status,
            "role": "assistant",
            "content": content,
        })
    }

    fn call_item_id(&self, index: usize) -> String {
        format!("fc_{}_{index}", self.id.trim_start_matches("resp_"))
    }

    fn call_item(&self, index: usize, call: &PartialCall, k: usize, status: &str) -> Value {
        let chat_call = call_value(call, &self.id, 0, k);
        json!({
            "type": "function_call",
            "id": self.call_item_id(index),
            "call_id": chat_call["id"],
            "name": call.name,
            "arguments": if status == "in_progress" { "" } else { call.arguments.as_str() },
            "status": status,
        })
    }

    /// The output items of a whole reply's text.
    fn output(&self, text: &str, logprobs: &[TokenLogprob]) -> Vec<Value> {
        if !self.tool_calls {
            return vec![self.message_item(0, text, logprobs, "completed")];
        }
        let read = read_partial(text);
        if read.is_unread() {
            return vec![self.message_item(0, text, &[], "completed")];
        }
        if let Some(content) = &read.content {
            return vec![self.message_item(0, content, &[], "completed")];
        }
        // An identical repeated call ended the reply: it is left out.
        let made = read.first_repeat().unwrap_or(read.calls.len());
        read.calls[..made]
            .iter()
            .enumerate()
            .map(|(k, call)| self.call_item(k, call, k, "completed"))
            .collect()
    }
}

fn text_part(text: &str, logprobs: &[TokenLogprob]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

/// Collects the reply into one response object.
async fn whole(shape: Shape, mut events: ChoiceEvents) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some((i, event)) = events.next().await {
        match event {
            Some(Event::Delta {
                text: piece,
                logprobs: lp,
            }) => {
                text.push_str(&piece);
                if shape.logprobs {
                    logprobs.extend(lp);
                }
            }
            Some(Event::PromptLogprobs(_)) => {}
            Some(Event::Done { reason, usage }) => {
                events.close(i);
                let output = shape.output(&text, &logprobs);
                let object = shape.object(Some(reason.as_str()), &output, Some(usage));
                return Ok(axum::Json(object).into_response());
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Embedding(_)) | None => return Err(ended_early()),
        }
    }
    Err(ended_early())
}

/// The output item being written in a stream.
enum Open {
    None,
    /// A message at this output index, its text and its tokens'
    /// log-probabilities so far.
    Message {
        index: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Call `k` of the reply at this output index.
    Call {
        index: usize,
        k: usize,
    },
}

/// A streamed response: typed events, each with its `sequence_number`.
struct Streaming {
    shape: Shape,
    events: ChoiceEvents,
    sequence: u64,
    started: bool,
    finished: bool,
    /// Function calling: the reply so far and what of it went out.
    reply: ReplyStream,
    /// Output items done, and the one being written.
    output: Vec<Value>,
    open: Open,
    /// Log-probabilities of tokens whose text has not gone out yet.
    pending_logprobs: Vec<TokenLogprob>,
    queued: VecDeque<SseEvent>,
}

impl Streaming {
    fn emit(&mut self, kind: &str, mut body: Value) {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.queued
            .push_back(SseEvent::default().event(kind).data(body.to_string()));
    }

    /// Closes the item being written, if any: its `done` events.
    fn close_item(&mut self, read: &PartialReply) {
        match std::mem::replace(&mut self.open, Open::None) {
            Open::None => {}
            Open::Message {
                index,
                text,
                logprobs,
            } => {
                let item_id = self.shape.message_id(index);
                let at = json!({"item_id": item_id, "output_index": index, "content_index": 0});
                let mut done = at.clone();
                done["text"] = json!(text);
                done["logprobs"] = json!(logprobs);
                self.emit("response.output_text.done", done);
                let mut part = at;
                part["part"] = text_part(&text, &logprobs);
                self.emit("response.content_part.done", part);
                let item = self
                    .shape
                    .message_item(index, &text, &logprobs, "completed");
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
                self.output.push(item);
            }
            Open::Call { index, k } => {
                let call = &read.calls[k];
                let item = self.shape.call_item(index, call, k, "completed");
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": item["id"], "output_index": index, "name": call.name,
                           "arguments": call.arguments}),
                );
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
                self.output.push(item);
            }
        }
    }

    /// Text for the message being written (opened here if need be). No
    /// text opens no message, but the log-probabilities of tokens that
    /// wrote none (white space trimmed at the end) still go out, in a
    /// delta of no text, as the chat's stream sends them.
    fn message_text(&mut self, piece: &str) {
        let open = matches!(self.open, Open::Message { .. });
        if piece.is_empty() && (!open || self.pending_logprobs.is_empty()) {
            return;
        }
        if !matches!(self.open, Open::Message { .. }) {
            let index = self.output.len();
            let item = self.shape.message_item(index, "", &[], "in_progress");
            self.emit(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.emit(
                "response.content_part.added",
                json!({"item_id": self.shape.message_id(index), "output_index": index,
                       "content_index": 0, "part": text_part("", &[])}),
            );
            self.open = Open::Message {
                index,
                text: String::new(),
                logprobs: Vec::new(),
            };
        }
        let pending = std::mem::take(&mut self.pending_logprobs);
        if let Open::Message {
            index,
            text,
            logprobs,
        } = &mut self.open
        {
            text.push_str(piece);
            logprobs.extend(pending.iter().cloned());
            let index = *index;
            self.emit(
                "response.output_text.delta",
                json!({"item_id": self.shape.message_id(index), "output_index": index,
                       "content_index": 0, "delta": piece, "logprobs": pending}),
            );
        }
    }

    /// Sends what `piece` adds to the reply. `ended`: the reply is over,
    /// so text that cannot be read as calls or an answer goes out as a
    /// message. Returns the reply as read (function calling).
    fn advance(&mut self, piece: &str, ended: bool) -> PartialReply {
        if !self.shape.tool_calls {
            self.message_text(piece);
            return PartialReply::default();
        }
        self.reply.push(piece);
        let (read, grown) = self.reply.advance(ended);
        for growth in grown {
            match growth {
                Growth::CallStarted(k) => {
                    self.close_item(&read);
                    let index = self.output.len();
                    let item = self
                        .shape
                        .call_item(index, &read.calls[k], k, "in_progress");
                    self.emit(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    );
                    self.open = Open::Call { index, k };
                }
                Growth::Arguments(_, piece) => {
                    // The call's item is the open one, at the next index.
                    let index = self.output.len();
                    self.emit(
                        "response.function_call_arguments.delta",
                        json!({"item_id": self.shape.call_item_id(index), "output_index": index,
                               "delta": piece}),
                    );
                }
                Growth::Content(piece) => self.message_text(&piece),
            }
        }
        read
    }

    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Some(event);
            }
            if self.finished {
                return None;
            }
            if !self.started {
                self.started = true;
                let response = self.shape.object(None, &[], None);
                self.emit("response.created", json!({"response": response}));
                self.emit("response.in_progress", json!({"response": response}));
                continue;
            }
            match self.events.next().await {
                Some((_, Some(Event::Delta { text, logprobs }))) => {
                    if self.shape.logprobs {
                        self.pending_logprobs.extend(logprobs);
                    }
                    self.advance(&text, false);
                }
                Some((_, Some(Event::PromptLogprobs(_)))) => {}
                Some((i, Some(Event::Done { reason, usage }))) => {
                    self.events.close(i);
                    let read = self.advance("", true);
                    self.close_item(&read);
                    let object =
                        self.shape
                            .object(Some(reason.as_str()), &self.output, Some(usage));
                    let kind = if object["status"] == "incomplete" {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    self.emit(kind, json!({"response": object}));
                    self.finished = true;
                }
                Some((_, Some(Event::Failed(e)))) => {
                    self.finished = true;
                    return Some(SseEvent::default().data(e.body().to_string()));
                }
                Some((_, None | Some(Event::Embedding(_)))) | None => {
                    self.finished = true;
                    return Some(SseEvent::default().data(ended_early().body().to_string()));
                }
            }
        }
    }
}

fn sse(shape: Shape, events: ChoiceEvents) -> Response {
    let state = Streaming {
        shape,
        events,
        sequence: 0,
        started: false,
        finished: false,
        reply: ReplyStream::default(),
        output: Vec::new(),
        open: Open::None,
        pending_logprobs: Vec::new(),
        queued: VecDeque::new(),
    };
    sse_response(state)
}

impl SseSource for Streaming {
    fn next_event(&mut self) -> impl Future<Output = Option<SseEvent>> + Send {
        self.next()
    }
}
