//! A chat or completion reply as server-sent events: the role first
//! (chat), each choice's text as it comes (a function-calling reply as
//! calls and argument pieces, a thought channel as `reasoning_content`),
//! each choice's finish reason, the usage when asked for, then `[DONE]`.

use super::{Kind, Reply, tool_reason};
use crate::chat::thinking::{self, Part, ThoughtSplitter};
use crate::serve::api::{TokenLogprob, Usage};
use crate::serve::http::choices::{ChoiceEvents, ended_early};
use crate::serve::http::guard::TokenCount;
use crate::serve::http::{SseSource, data, sse_response};
use crate::serve::slot::Event;
use crate::serve::tools::CallFormat;
use crate::serve::tools::reply::{Growth, PartialReply, ReplyStream, call_value};
use axum::response::Response;
use axum::response::sse::Event as SseEvent;
use serde_json::{Value, json};
use std::collections::VecDeque;

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

pub(super) fn sse(reply: Reply, events: ChoiceEvents) -> Response {
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

impl SseSource for Streaming {
    fn next_event(&mut self) -> impl Future<Output = Option<SseEvent>> + Send {
        self.next()
    }
}
