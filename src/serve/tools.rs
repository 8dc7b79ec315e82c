//! Function calling (`tools`, `tool_choice`, `parallel_tool_calls`) for
//! models with no tool tokens of their own, as Gemma's are.
//!
//! The functions are described to the model in the system text (folded
//! into the first user turn, like any system message), and its reply is
//! held by a JSON schema (the `response_format` machinery) to one object:
//! `{"tool_calls": [{"name": …, "arguments": {…}}, …]}` to call functions,
//! or, where `tool_choice` lets it answer, `{"content": "…"}`. Each call's
//! name is one of the functions and its arguments follow that function's
//! `parameters` schema, so every call a client receives parses and
//! validates, even from a small base model. The reply object is then read
//! back into OpenAI's `tool_calls` (and `finish_reason: "tool_calls"`) or
//! plain content.
//!
//! The conversation's history goes back in the same format: an assistant
//! message's calls as the object the model would have written, and `tool`
//! messages as a user turn that names each call's function.

use super::api::{
    ApiError, FunctionDefinition, LegacyFunctionCall, Message, NamedFunction, Tool, ToolChoice,
};
use super::gemma4_calls;
use crate::generate::ReplyCheck;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// OpenAI's limit on `tools`.
const MAX_TOOLS: usize = 128;
/// OpenAI's rule for function names: `^[a-zA-Z0-9_-]{1,64}$`.
const MAX_NAME: usize = 64;

struct Function {
    name: String,
    description: Option<String>,
    /// The arguments' schema (an empty object when left out).
    parameters: Value,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Choice {
    /// Call functions or answer.
    Auto,
    /// Call at least one function.
    Required,
    /// Call this one (an index into the functions).
    Named(usize),
}

/// How a reply's calls go back to the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallFormat {
    /// `message.tool_calls`, `finish_reason: "tool_calls"`.
    ToolCalls,
    /// The deprecated `functions` API: one call in
    /// `message.function_call`, `finish_reason: "function_call"`.
    FunctionCall,
    /// The model's own call syntax (Gemma 4's, [`super::gemma4_calls`]),
    /// sent as `message.tool_calls`.
    Native,
}

impl CallFormat {
    /// The check that ends a reply in this format at its first repeated
    /// call ([`PartialReply::first_repeat`], [`gemma4_calls::repeat_start`]).
    /// A call ends with `}` (JSON) or `<tool_call|>`: only a piece with
    /// one can complete a repeat, so the reply is read again only then.
    pub fn repeat_check(self) -> ReplyCheck {
        match self {
            CallFormat::Native => {
                |reply, newest| newest.contains('>') && gemma4_calls::repeat_start(reply).is_some()
            }
            CallFormat::ToolCalls | CallFormat::FunctionCall => {
                |reply, newest| newest.contains('}') && read_partial(reply).first_repeat().is_some()
            }
        }
    }
}

/// A request's tools, when it lets the model call them.
pub struct ToolCalling {
    functions: Vec<Function>,
    choice: Choice,
    /// More than one call per reply (`parallel_tool_calls`, default true).
    parallel: bool,
}

impl ToolCalling {
    /// The request's `tools`, `tool_choice` and `parallel_tool_calls`,
    /// checked. `None` when there are no tools or `tool_choice` is
    /// `"none"`: the reply is then plain text.
    pub fn from_request(
        tools: Option<&[Tool]>,
        choice: Option<&ToolChoice>,
        parallel: Option<bool>,
    ) -> Result<Option<ToolCalling>, ApiError> {
        let tools = tools.unwrap_or_default();
        if tools.is_empty() {
            if choice.is_some() {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice needs tools: give `tools` or leave tool_choice out",
                ));
            }
            return Ok(None);
        }
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::invalid(
                "tools",
                format!("{} tools given; at most {MAX_TOOLS}", tools.len()),
            ));
        }
        let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            functions.push(function_of(tool, i)?);
            let name = &functions[i].name;
            if functions[..i].iter().any(|f| &f.name == name) {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name"),
                    format!("two tools are named {name:?}; names must differ"),
                ));
            }
        }
        let choice = match choice {
            None => Choice::Auto,
            Some(ToolChoice::Mode(mode)) => match mode.as_str() {
                "none" => return Ok(None),
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                other => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!(
                            "tool_choice {other:?}: use \"none\", \"auto\", \"required\" or \
                             {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                        ),
                    ));
                }
            },
            Some(ToolChoice::Function { kind, function }) => {
                if kind != "function" {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        format!("tool_choice of type {kind:?}: only \"function\""),
                    ));
                }
                let index = functions
                    .iter()
                    .position(|f| f.name == function.name)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tool_choice.function.name",
                            format!(
                                "tool_choice names {:?}, which is not one of the tools",
                                function.name
                            ),
                        )
                    })?;
                Choice::Named(index)
            }
        };
        Ok(Some(ToolCalling {
            functions,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Whether the model may answer or call as it likes (`tool_choice`
    /// `"auto"`): the only choice a model's own call syntax leaves it, as
    /// nothing holds it to a call.
    pub fn is_auto(&self) -> bool {
        matches!(self.choice, Choice::Auto)
    }

    /// The deprecated `functions` and `function_call`, as tools with one
    /// call per reply; refusals name the deprecated fields.
    pub fn from_legacy(
        functions: Option<&[FunctionDefinition]>,
        function_call: Option<&LegacyFunctionCall>,
    ) -> Result<Option<ToolCalling>, ApiError> {
        let tools: Option<Vec<Tool>> = functions.map(|f| {
            f.iter()
                .map(|f| Tool {
                    kind: "function".into(),
                    function: Some(f.clone()),
                })
                .collect()
        });
        let choice = function_call.map(|c| match c {
            LegacyFunctionCall::Mode(mode) => ToolChoice::Mode(mode.clone()),
            LegacyFunctionCall::Named { name } => ToolChoice::Function {
                kind: "function".into(),
                function: NamedFunction { name: name.clone() },
            },
        });
        ToolCalling::from_request(tools.as_deref(), choice.as_ref(), Some(false)).map_err(
            |mut e| {
                e.param = e.param.map(|p| {
                    p.replacen("tools[", "functions[", 1)
                        .replacen(".function.", ".", 1)
                        .replacen("tool_choice", "function_call", 1)
                        .replacen("function_call.function.", "function_call.", 1)
                });
                e
            },
        )
    }

    /// The functions callable in this reply: one when `tool_choice` names
    /// it, else all.
    fn callable(&self) -> &[Function] {
        match self.choice {
            Choice::Named(i) => &self.functions[i..=i],
            Choice::Auto | Choice::Required => &self.functions,
        }
    }

    /// What the model is told: the functions, then the reply's format.
    pub fn instructions(&self) -> String {
        let mut text = String::from("You can call these functions:\n");
        for f in &self.functions {
            let _ = write!(text, "- {}", f.name);
            if let Some(d) = f.description.as_deref().filter(|d| !d.is_empty()) {
                let _ = write!(text, ": {d}");
            }
            let _ = writeln!(text, "\n  arguments (JSON schema): {}", f.parameters);
        }
        let call = r#"{"tool_calls": [{"name": "<function>", "arguments": {…}}]}"#;
        let how = match (self.choice, self.parallel) {
            (Choice::Named(i), _) => format!(
                "Call {} now: reply with only the JSON object {}.",
                self.functions[i].name,
                call.replace("<function>", &self.functions[i].name)
            ),
            (Choice::Required, true) => {
                format!("Call one or more of them now: reply with only the JSON object {call}.")
            }
            (Choice::Required, false) => {
                format!("Call one of them now: reply with only the JSON object {call}.")
            }
            (Choice::Auto, parallel) => format!(
                "To call {}, reply with only the JSON object {call}. To answer without \
                 calling a function, reply with only the JSON object {{\"content\": \"<your answer>\"}}.",
                if parallel { "functions" } else { "a function" },
            ),
        };
        text.push('\n');
        text.push_str(&how);
        text
    }

    /// The JSON schema every reply follows.
    pub fn schema(&self) -> Value {
        let calls: Vec<Value> = self
            .callable()
            .iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": f.name},
                        "arguments": f.parameters,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut list = json!({"type": "array", "items": {"anyOf": calls}, "minItems": 1});
        if !self.parallel || matches!(self.choice, Choice::Named(_)) {
            list["maxItems"] = json!(1);
        }
        let call_object = json!({
            "type": "object",
            "properties": {"tool_calls": list},
            "required": ["tool_calls"],
            "additionalProperties": false,
        });
        if self.choice != Choice::Auto {
            return call_object;
        }
        json!({"anyOf": [
            call_object,
            {
                "type": "object",
                "properties": {"content": {"type": "string"}},
                "required": ["content"],
                "additionalProperties": false,
            },
        ]})
    }
}

/// `tools[i]`, checked.
fn function_of(tool: &Tool, i: usize) -> Result<Function, ApiError> {
    if tool.kind != "function" {
        return Err(ApiError::invalid(
            format!("tools[{i}].type"),
            format!(
                "tools of type {:?} are not supported; only \"function\"",
                tool.kind
            ),
        ));
    }
    let f = tool.function.as_ref().ok_or_else(|| {
        ApiError::invalid(
            format!("tools[{i}].function"),
            "a tool of type \"function\" needs `function` (its name and parameters)",
        )
    })?;
    let name_ok = (1..=MAX_NAME).contains(&f.name.len())
        && f.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(ApiError::invalid(
            format!("tools[{i}].function.name"),
            format!(
                "function name {:?}: use 1 to {MAX_NAME} letters, digits, '_' or '-'",
                f.name
            ),
        ));
    }
    let parameters = match &f.parameters {
        // No parameters: a function of no arguments, so `{}` (an open
        // object let the default model fill it with junk in the soak).
        None => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        Some(p) if p.is_object() => p.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.parameters"),
                "parameters must be a JSON schema object",
            ));
        }
    };
    Ok(Function {
        name: f.name.clone(),
        description: f.description.clone(),
        parameters,
    })
}

/// One call of a reply, as far as it has been written: its name is
/// whole, its arguments are the JSON text written so far (what OpenAI's
/// `function.arguments` carries, streamed piece by piece).
#[derive(Clone, Debug, PartialEq)]
pub struct PartialCall {
    pub name: String,
    pub arguments: String,
    /// The arguments are a whole JSON value (nothing more is written to
    /// them).
    pub finished: bool,
}

/// What a reply under [`ToolCalling::schema`] says so far. It is read
/// again from the start as each piece arrives (a reply is at most a few
/// thousand bytes), and what grew since is what a stream sends.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PartialReply {
    /// The calls whose name is complete, in order.
    pub calls: Vec<PartialCall>,
    /// `{"content": "…"}`: the answer's text decoded so far.
    pub content: Option<String>,
    /// The reply object is complete.
    pub complete: bool,
}

impl PartialReply {
    /// Neither calls nor content could be read (a reply cut before its
    /// first name, or not in the format): the client gets the text.
    pub fn is_unread(&self) -> bool {
        self.calls.is_empty() && self.content.is_none()
    }

    /// The first finished call that repeats an earlier one (the same name,
    /// the arguments written the same way). A small model that repeats a
    /// call tends to repeat it until the length limit, so the first repeat
    /// ends the reply and is left out of it.
    pub fn first_repeat(&self) -> Option<usize> {
        (1..self.calls.len()).find(|&k| {
            let call = &self.calls[k];
            call.finished && self.calls[..k].contains(call)
        })
    }

    /// The reply is over as calls: whole, or ended by a repeated call.
    pub fn ends_in_calls(&self) -> bool {
        !self.calls.is_empty() && (self.complete || self.first_repeat().is_some())
    }

    /// Call `k` is still being written as a copy of an earlier call (its
    /// arguments so far begin that one's): a stream holds it back until it
    /// differs, so that a repeat never reaches the client.
    fn may_repeat(&self, k: usize) -> bool {
        let call = &self.calls[k];
        !call.finished
            && self.calls[..k]
                .iter()
                .any(|c| c.name == call.name && c.arguments.starts_with(&call.arguments))
    }
}

/// Reads a reply's text so far. The constraint makes it valid JSON of the
/// reply's shape, properties in the schema's order (`name` before
/// `arguments`); anything else ends the reading where it stands.
pub fn read_partial(text: &str) -> PartialReply {
    let mut reply = PartialReply::default();
    let mut c = Cursor { text, at: 0 };
    let _ = c.reply(&mut reply);
    reply
}

/// A position in a reply's text. Each step returns `None` where the text
/// ends (or breaks the format) before the step is done.
struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn reply(&mut self, reply: &mut PartialReply) -> Option<()> {
        self.expect(b'{')?;
        match self.key()?.as_str() {
            "content" => {
                self.skip_white();
                self.expect_here(b'"')?;
                let (text, closed) = self.string_body();
                reply.content = Some(text);
                if closed {
                    self.expect(b'}')?;
                    reply.complete = true;
                }
            }
            "tool_calls" => {
                self.expect(b'[')?;
                loop {
                    self.expect(b'{')?;
                    if self.key()? != "name" {
                        return None;
                    }
                    let name = self.whole_string()?;
                    self.expect(b',')?;
                    if self.key()? != "arguments" {
                        return None;
                    }
                    self.skip_white();
                    let start = self.at;
                    let done = self.skip_value();
                    reply.calls.push(PartialCall {
                        name,
                        arguments: self.text[start..self.at].to_string(),
                        finished: done,
                    });
                    if !done {
                        return None;
                    }
                    self.expect(b'}')?;
                    self.skip_white();
                    match self.next_byte()? {
                        b',' => continue,
                        b']' => break,
                        _ => return None,
                    }
                }
                self.expect(b'}')?;
                reply.complete = true;
            }
            _ => {}
        }
        Some(())
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn next_byte(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn skip_white(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.at += 1;
        }
    }

    /// `b` after any white space.
    fn expect(&mut self, b: u8) -> Option<()> {
        self.skip_white();
        self.expect_here(b)
    }

    fn expect_here(&mut self, b: u8) -> Option<()> {
        (self.next_byte()? == b).then_some(())
    }

    /// A whole object key and its colon.
    fn key(&mut self) -> Option<String> {
        let key = self.whole_string()?;
        self.expect(b':')?;
        Some(key)
    }

    /// A whole string (after any white space), decoded.
    fn whole_string(&mut self) -> Option<String> {
        self.expect(b'"')?;
        let (text, closed) = self.string_body();
        closed.then_some(text)
    }

    /// A string's characters after its opening quote, decoded as far as
    /// they are whole (an escape cut by the end of the text waits), and
    /// whether the closing quote was reached.
    fn string_body(&mut self) -> (String, bool) {
        let mut out = String::new();
        loop {
            let rest = &self.text[self.at..];
            let Some(i) = rest.find(['"', '\\']) else {
                out.push_str(rest);
                self.at = self.text.len();
                return (out, false);
            };
            out.push_str(&rest[..i]);
            self.at += i;
            if rest.as_bytes()[i] == b'"' {
                self.at += 1;
                return (out, true);
            }
            match self.escape() {
                Some(c) => out.push(c),
                None => return (out, false),
            }
        }
    }

    /// One escape at a backslash, decoded; `None` (and the position kept)
    /// when the text ends inside it.
    fn escape(&mut self) -> Option<char> {
        let start = self.at;
        let bytes = &self.text.as_bytes()[start..];
        let simple = match bytes.get(1)? {
            b'"' => Some('"'),
            b'\\' => Some('\\'),
            b'/' => Some('/'),
            b'b' => Some('\u{8}'),
            b'f' => Some('\u{c}'),
            b'n' => Some('\n'),
            b'r' => Some('\r'),
            b't' => Some('\t'),
            _ => None,
        };
        if let Some(c) = simple {
            self.at += 2;
            return Some(c);
        }
        let unit = |at: usize| -> Option<u32> {
            let hex = self.text.get(start + at..start + at + 4)?;
            u32::from_str_radix(hex, 16).ok()
        };
        let high = unit(2)?;
        if (0xD800..0xDC00).contains(&high) {
            // A surrogate pair: the low half must be there too.
            if self.text.get(start + 6..start + 8)? == "\\u" {
                let low = unit(8)?;
                if (0xDC00..0xE000).contains(&low) {
                    self.at += 12;
                    let code = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
                    return Some(char::from_u32(code).unwrap_or('\u{FFFD}'));
                }
            }
            self.at += 6;
            return Some('\u{FFFD}');
        }
        self.at += 6;
        Some(char::from_u32(high).unwrap_or('\u{FFFD}'))
    }

    /// One JSON value, skipped; whether it is complete. A number or word
    /// at the very end of the text may go on, so it is not.
    fn skip_value(&mut self) -> bool {
        let mut depth = 0usize;
        loop {
            self.skip_white();
            let Some(b) = self.peek() else {
                return false;
            };
            match b {
                b'{' | b'[' => {
                    depth += 1;
                    self.at += 1;
                }
                b'}' | b']' => {
                    if depth == 0 {
                        return false;
                    }
                    depth -= 1;
                    self.at += 1;
                }
                b',' | b':' if depth > 0 => self.at += 1,
                b'"' => {
                    self.at += 1;
                    if !self.string_body().1 {
                        return false;
                    }
                }
                _ => {
                    // A number, true, false or null.
                    let rest = &self.text[self.at..];
                    let Some(end) =
                        rest.find(|c: char| c.is_ascii_whitespace() || ",:]}".contains(c))
                    else {
                        self.at = self.text.len();
                        return false;
                    };
                    if end == 0 {
                        return false;
                    }
                    self.at += end;
                }
            }
            if depth == 0 {
                return true;
            }
        }
    }
}

/// What a streamed reply said since the last look, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Growth {
    /// Call `k`'s name became whole (`PartialReply::calls[k]`).
    CallStarted(usize),
    /// More of call `k`'s arguments.
    Arguments(usize, String),
    /// More of the answer's text (or, once the reply ended unread, its
    /// text as it is).
    Content(String),
}

/// A function-calling reply as it streams: its text, and how much of what
/// it says went out, so that each API writes only what grew (calls as
/// they start, arguments and answer text in pieces).
#[derive(Default)]
pub struct ReplyStream {
    text: String,
    calls_started: usize,
    arguments_sent: Vec<usize>,
    content_sent: usize,
}

impl ReplyStream {
    pub fn push(&mut self, piece: &str) {
        self.text.push_str(piece);
    }

    /// The reply as read so far, and what it says beyond the last look.
    /// `ended`: the reply is over, so text that cannot be read as calls or
    /// an answer is content as it is.
    pub fn advance(&mut self, ended: bool) -> (PartialReply, Vec<Growth>) {
        let read = read_partial(&self.text);
        let mut grown = Vec::new();
        // Calls from a repeat on are never sent, nor one that may still
        // turn out to be a repeat.
        let repeat = read.first_repeat().unwrap_or(read.calls.len());
        for (k, call) in read.calls[..repeat].iter().enumerate() {
            if read.may_repeat(k) {
                break;
            }
            if k == self.calls_started {
                self.calls_started += 1;
                self.arguments_sent.push(0);
                grown.push(Growth::CallStarted(k));
            }
            let sent = &mut self.arguments_sent[k];
            if call.arguments.len() > *sent {
                grown.push(Growth::Arguments(k, call.arguments[*sent..].to_string()));
                *sent = call.arguments.len();
            }
        }
        let content = match &read.content {
            Some(content) => Some(content.as_str()),
            None if ended && read.is_unread() => Some(self.text.as_str()),
            None => None,
        };
        if let Some(content) = content
            && content.len() > self.content_sent
        {
            grown.push(Growth::Content(content[self.content_sent..].to_string()));
            self.content_sent = content.len();
        }
        (read, grown)
    }
}

/// The OpenAI `tool_calls` entry of call `k`: its id, type and function.
pub fn call_value(call: &PartialCall, reply_id: &str, choice: usize, k: usize) -> Value {
    json!({
        "id": call_id(reply_id, choice, k),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

/// The OpenAI `tool_calls` entry of a call read from the model's own
/// syntax: `arguments` is JSON text.
pub fn native_call_value(
    name: &str,
    arguments: &Value,
    reply_id: &str,
    choice: usize,
    k: usize,
) -> Value {
    json!({
        "id": call_id(reply_id, choice, k),
        "type": "function",
        "function": {"name": name, "arguments": arguments.to_string()},
    })
}

/// Ids are `call_`, a number drawn when the server started, the reply's
/// number, the choice and the call's place: unique within a conversation
/// even when it goes on after a restart, where reply numbers start again.
fn call_id(reply_id: &str, choice: usize, k: usize) -> String {
    static SALT: OnceLock<u32> = OnceLock::new();
    let salt = SALT.get_or_init(|| {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        (now as u32) ^ std::process::id().rotate_left(16)
    });
    let unique = reply_id.rsplit(['-', '_']).next().unwrap_or(reply_id);
    format!("call_{salt:08x}{unique}_{choice}_{k}")
}

/// An assistant message's calls as the model writes them. Arguments that
/// are not JSON (a client's own mistake) go in as a string.
/// A deprecated `function_call` counts as one call.
pub fn history_calls_text(m: &Message) -> Option<String> {
    let mut functions: Vec<&super::api::CalledFunction> =
        m.tool_calls.iter().flatten().map(|c| &c.function).collect();
    functions.extend(m.function_call.as_ref());
    if functions.is_empty() {
        return None;
    }
    let calls: Vec<Value> = functions
        .iter()
        .map(|f| {
            let arguments = serde_json::from_str::<Value>(&f.arguments)
                .unwrap_or_else(|_| Value::String(f.arguments.clone()));
            json!({"name": f.name, "arguments": arguments})
        })
        .collect();
    Some(json!({"tool_calls": calls}).to_string())
}

/// A `tool` message as the line the model reads: the function's name
/// (from `name`, or the call `tool_call_id` names in an earlier assistant
/// message) and the result.
pub fn tool_result_text(messages: &[Message], i: usize, content: &str) -> Result<String, ApiError> {
    let m = &messages[i];
    let name = match (&m.name, &m.tool_call_id) {
        (Some(name), _) => name.clone(),
        (None, Some(id)) => messages[..i]
            .iter()
            .flat_map(|earlier| earlier.tool_calls.iter().flatten())
            .find(|call| call.id.as_deref() == Some(id.as_str()))
            .map(|call| call.function.name.clone())
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!("tool_call_id {id:?} matches no call in an earlier assistant message"),
                )
            })?,
        (None, None) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_call_id"),
                "a tool message needs tool_call_id (the id of the call it answers)",
            ));
        }
    };
    Ok(format!("Result of {name}: {content}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::api::{FunctionDefinition, NamedFunction};

    fn tool(name: &str) -> Tool {
        Tool {
            kind: "function".into(),
            function: Some(FunctionDefinition {
                name: name.into(),
                description: Some("does a thing".into()),
                parameters: Some(json!({"type": "object",
                    "properties": {"city": {"type": "string"}}, "required": ["city"]})),
                strict: None,
            }),
        }
    }

    #[test]
    fn choices_shape_the_schema() {
        let tools = [tool("weather"), tool("time")];
        let auto = ToolCalling::from_request(Some(&tools), None, None)
            .unwrap()
            .unwrap();
        let schema = auto.schema();
        assert_eq!(
            schema["anyOf"].as_array().map(Vec::len),
            Some(2),
            "{schema}"
        );
        let named = ToolChoice::Function {
            kind: "function".into(),
            function: NamedFunction {
                name: "time".into(),
            },
        };
        let one = ToolCalling::from_request(Some(&tools), Some(&named), None)
            .unwrap()
            .unwrap();
        let schema = one.schema();
        let items = &schema["properties"]["tool_calls"]["items"]["anyOf"];
        assert_eq!(items.as_array().map(Vec::len), Some(1), "{schema}");
        assert_eq!(items[0]["properties"]["name"]["const"], "time");
        assert_eq!(schema["properties"]["tool_calls"]["maxItems"], 1);
        let none = ToolChoice::Mode("none".into());
        assert!(
            ToolCalling::from_request(Some(&tools), Some(&none), None)
                .unwrap()
                .is_none()
        );
        let serial = ToolCalling::from_request(
            Some(&tools),
            Some(&ToolChoice::Mode("required".into())),
            Some(false),
        )
        .unwrap()
        .unwrap();
        let schema = serial.schema();
        assert!(schema.get("anyOf").is_none(), "{schema}");
        assert_eq!(schema["properties"]["tool_calls"]["maxItems"], 1);
    }

    #[test]
    fn bad_tools_name_their_field() {
        let param = |tools: &[Tool], choice: Option<ToolChoice>| {
            ToolCalling::from_request(Some(tools), choice.as_ref(), None)
                .err()
                .and_then(|e| e.param)
        };
        assert_eq!(
            param(&[tool("a b")], None).as_deref(),
            Some("tools[0].function.name")
        );
        assert_eq!(
            param(&[tool("a"), tool("a")], None).as_deref(),
            Some("tools[1].function.name")
        );
        let mut other = tool("a");
        other.kind = "retrieval".into();
        assert_eq!(param(&[other], None).as_deref(), Some("tools[0].type"));
        let unknown = ToolChoice::Function {
            kind: "function".into(),
            function: NamedFunction { name: "b".into() },
        };
        assert_eq!(
            param(&[tool("a")], Some(unknown)).as_deref(),
            Some("tool_choice.function.name")
        );
        assert_eq!(
            param(&[tool("a")], Some(ToolChoice::Mode("always".into()))).as_deref(),
            Some("tool_choice")
        );
        let no_tools =
            ToolCalling::from_request(None, Some(&ToolChoice::Mode("auto".into())), None);
        assert_eq!(
            no_tools.err().and_then(|e| e.param).as_deref(),
            Some("tool_choice")
        );
    }

    #[test]
    fn replies_read_back_into_calls_or_content_as_they_grow() {
        let text = r#"{"tool_calls": [{"name": "weather", "arguments": {"city": "Par\"is", "n": [1, 2.5]}},
            {"name": "time", "arguments": {}}]}"#;
        let whole = read_partial(text);
        assert!(whole.complete);
        assert_eq!(
            whole.calls,
            vec![
                PartialCall {
                    name: "weather".into(),
                    arguments: r#"{"city": "Par\"is", "n": [1, 2.5]}"#.into(),
                    finished: true,
                },
                PartialCall {
                    name: "time".into(),
                    arguments: "{}".into(),
                    finished: true,
                },
            ]
        );
        // Every prefix reads as a prefix of the whole: names appear whole,
        // arguments only grow.
        let mut previous = PartialReply::default();
        for end in (0..=text.len()).filter(|&e| text.is_char_boundary(e)) {
            let now = read_partial(&text[..end]);
            assert!(now.calls.len() >= previous.calls.len(), "at {end}");
            for (k, call) in now.calls.iter().enumerate() {
                assert_eq!(call.name, whole.calls[k].name, "at {end}");
                assert!(
                    whole.calls[k].arguments.starts_with(&call.arguments),
                    "at {end}"
                );
                if let Some(before) = previous.calls.get(k) {
                    assert!(call.arguments.starts_with(&before.arguments), "at {end}");
                }
            }
            assert_eq!(now.complete, end == text.len(), "at {end}");
            previous = now;
        }
        let answer = r#"{"content": "It is \"sunny\" \u00e9\ud83d\ude00."}"#;
        let mut previous = String::new();
        for end in 0..=answer.len() {
            let now = read_partial(&answer[..end]);
            let content = now.content.unwrap_or_default();
            assert!(content.starts_with(&previous), "at {end}: {content:?}");
            previous = content;
        }
        assert_eq!(previous, "It is \"sunny\" é😀.");
        // A number at the end of the text may go on.
        let cut = read_partial(r#"{"tool_calls": [{"name": "f", "arguments": {"n": 12"#);
        assert_eq!(cut.calls[0].arguments, r#"{"n": 12"#);
        assert!(!cut.complete);
        assert!(read_partial(r#"{"tool_calls": [{"name": "wea"#).is_unread());
        assert!(read_partial("I will not").is_unread());
        let value = call_value(&whole.calls[1], "chatcmpl-1f", 2, 1);
        let id = value["id"].as_str().unwrap_or_default();
        assert!(id.starts_with("call_") && id.ends_with("1f_2_1"), "{id}");
        assert_eq!(id.len(), "call_".len() + 8 + "1f_2_1".len(), "{id}");
        assert_eq!(value["function"]["arguments"], "{}");
    }

    #[test]
    fn a_reply_stream_reports_each_call_once_and_arguments_in_pieces() {
        let text = r#"{"tool_calls": [{"name": "a", "arguments": {"x": "y\u00e9"}}, {"name": "b", "arguments": {}}]}"#;
        let mut stream = ReplyStream::default();
        let mut grown = Vec::new();
        for piece in text.as_bytes().chunks(3) {
            stream.push(std::str::from_utf8(piece).unwrap_or_default());
            grown.extend(stream.advance(false).1);
        }
        let (read, last) = stream.advance(true);
        assert!(read.complete && last.is_empty(), "{last:?}");
        let started: Vec<usize> = grown
            .iter()
            .filter_map(|g| match g {
                Growth::CallStarted(k) => Some(*k),
                _ => None,
            })
            .collect();
        assert_eq!(started, [0, 1]);
        for (k, call) in read.calls.iter().enumerate() {
            let pieces: String = grown
                .iter()
                .filter_map(|g| match g {
                    Growth::Arguments(j, piece) if *j == k => Some(piece.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(pieces, call.arguments);
        }
        // Text that is no reply goes out as content once the reply ends.
        let mut stream = ReplyStream::default();
        stream.push("not JSON");
        assert!(stream.advance(false).1.is_empty());
        assert_eq!(stream.advance(true).1, [Growth::Content("not JSON".into())]);
    }

    /// The report's reply: one call, then another repeated until the
    /// length limit. The first repeat ends the reply: the watch says so
    /// when it is written, whole and streamed replies leave it out, and a
    /// stream never starts a call that is still a copy of an earlier one.
    #[test]
    fn a_repeated_call_ends_the_reply_and_is_left_out() {
        let weather =
            r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}"#;
        let time = r#"{"name": "get_time", "arguments": {"city": "Paris"}}"#;
        let time_elsewhere = r#"{"name": "get_time", "arguments": {"city": "Rome"}}"#;
        let text =
            format!(r#"{{"tool_calls": [{weather}, {time}, {time_elsewhere}, {time}, {time}"#);
        let read = read_partial(&text);
        assert_eq!(read.first_repeat(), Some(3));
        assert!(read.ends_in_calls() && !read.complete);
        let check = CallFormat::ToolCalls.repeat_check();
        let mut stream = ReplyStream::default();
        let mut grown = Vec::new();
        let mut ended_at = None;
        for (i, piece) in text.as_bytes().chunks(2).enumerate() {
            let piece = std::str::from_utf8(piece).unwrap_or_default();
            stream.push(piece);
            grown.extend(stream.advance(false).1);
            if check(&text[..i * 2 + piece.len()], piece) {
                ended_at = Some(i * 2 + piece.len());
                break;
            }
        }
        let repeat_end = text.find(time).unwrap_or(0) + time.len();
        // Its arguments' last brace (the call's own comes after).
        let repeat_end = text[repeat_end..]
            .find(time)
            .map(|at| repeat_end + at + time.len() - 1);
        assert_eq!(
            ended_at, repeat_end,
            "the check ends the reply as the repeat's arguments close"
        );
        grown.extend(stream.advance(true).1);
        let started: Vec<&Growth> = grown
            .iter()
            .filter(|g| matches!(g, Growth::CallStarted(_)))
            .collect();
        assert_eq!(
            started,
            [
                &Growth::CallStarted(0),
                &Growth::CallStarted(1),
                &Growth::CallStarted(2)
            ]
        );
        let sent: String = grown
            .iter()
            .filter_map(|g| match g {
                Growth::Arguments(2, piece) => Some(piece.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(sent, r#"{"city": "Rome"}"#);
        assert!(
            !grown.iter().any(|g| matches!(g, Growth::Arguments(3.., _))),
            "{grown:?}"
        );
        // Calls with other arguments, or cut, are no repeat.
        let cut = format!(
            r#"{{"tool_calls": [{time}, {{"name": "get_time", "arguments": {{"city": "Paris""#
        );
        assert_eq!(read_partial(&cut).first_repeat(), None);
        assert!(read_partial(&cut).may_repeat(1));
    }
}
