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
//! back ([`reply`]) into OpenAI's `tool_calls` (and `finish_reason:
//! "tool_calls"`) or plain content.
//!
//! The conversation's history goes back in the same format: an assistant
//! message's calls as the object the model would have written, and `tool`
//! messages as a user turn that names each call's function.

pub mod reply;

use super::api::{
    ApiError, FunctionDefinition, LegacyFunctionCall, Message, NamedFunction, Tool, ToolChoice,
};
use super::gemma4_calls;
use crate::generate::ReplyCheck;
use reply::read_partial;
use serde_json::{Value, json};
use std::fmt::Write as _;

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

impl CallFormat {
    /// The check that ends a reply in this format at its first repeated
    /// call ([`reply::PartialReply::first_repeat`],
    /// [`gemma4_calls::repeat_start`]). A call ends with `}` (JSON) or
    /// `<tool_call|>`: only a piece with one can complete a repeat, so the
    /// reply is read again only then.
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
}
