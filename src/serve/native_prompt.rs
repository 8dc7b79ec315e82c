//! A chat request rendered with the model's own Jinja template, for a
//! template with its own tool-call syntax (Gemma 4's): the tools are
//! declared and the history's calls and results written as the model
//! learned them, and its reply is read back by [`super::gemma4_calls`].
//!
//! Message text must stay text: the rendering is one string, so each
//! message's content is wrapped in two noncharacters before rendering and
//! the spans between them are tokenized without control tokens. The marks go
//! inside the content's outer white space, so a template's `| trim` still
//! trims it.

use super::api::{ApiError, Content, Message, Tool};
use crate::chat_template::jinja::{JinjaTemplate, RenderInput};
use crate::tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

/// Opens and closes a message's text in the rendering (Unicode
/// noncharacters: never in text a client sends for a reason, and refused
/// when one does).
const TEXT_OPEN: char = '\u{FDD0}';
const TEXT_CLOSE: char = '\u{FDD1}';

/// `text` with its inner part between the marks.
fn marked(text: &str) -> String {
    let core = text.trim();
    if core.is_empty() {
        return text.to_string();
    }
    let start = text.len() - text.trim_start().len();
    let end = start + core.len();
    format!(
        "{}{TEXT_OPEN}{core}{TEXT_CLOSE}{}",
        &text[..start],
        &text[end..]
    )
}

fn has_marks(text: &str) -> bool {
    text.contains([TEXT_OPEN, TEXT_CLOSE])
}

/// A message as transformers takes it, its text marked. Call arguments
/// (JSON text in OpenAI's API) become objects, which the template writes
/// in the model's syntax.
fn message_value(m: &Message, i: usize) -> Result<Value, ApiError> {
    let field = format!("messages[{i}].content");
    let refuse_marks = |text: &str| {
        if has_marks(text) {
            Err(ApiError::invalid(
                &field,
                "the text contains a Unicode noncharacter (U+FDD0 or U+FDD1); remove it",
            ))
        } else {
            Ok(())
        }
    };
    let mut v = Map::new();
    v.insert("role".into(), json!(m.role));
    let content = match &m.content {
        None => Value::Null,
        Some(Content::Text(text)) => {
            refuse_marks(text)?;
            json!(marked(text))
        }
        Some(Content::Parts(parts)) => {
            let mut list = Vec::new();
            for part in parts {
                let text = part.text.as_deref().unwrap_or("");
                refuse_marks(text)?;
                list.push(json!({"type": part.kind, "text": marked(text)}));
            }
            Value::Array(list)
        }
    };
    v.insert("content".into(), content);
    if let Some(calls) = &m.tool_calls {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let arguments = serde_json::from_str::<Value>(&c.function.arguments)
                    .unwrap_or_else(|_| json!(c.function.arguments));
                json!({"id": c.id, "type": "function",
                       "function": {"name": c.function.name, "arguments": arguments}})
            })
            .collect();
        v.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        v.insert("tool_call_id".into(), json!(id));
    }
    if let Some(name) = &m.name {
        v.insert("name".into(), json!(name));
    }
    Ok(Value::Object(v))
}

fn tool_value(t: &Tool) -> Value {
    let f = t.function.as_ref();
    let mut function = json!({
        "name": f.map(|f| f.name.as_str()).unwrap_or(""),
        "description": f.and_then(|f| f.description.as_deref()).unwrap_or(""),
    });
    if let Some(parameters) = f.and_then(|f| f.parameters.clone()) {
        function["parameters"] = parameters;
    }
    json!({"type": t.kind, "function": function})
}

/// The prompt's tokens: the template's own text with control tokens, the
/// messages' text without.
pub fn render(
    template: &JinjaTemplate,
    tok: &Tokenizer,
    messages: &[Message],
    tools: &[Tool],
    think: bool,
) -> Result<Vec<u32>, ApiError> {
    let values = messages
        .iter()
        .enumerate()
        .map(|(i, m)| message_value(m, i))
        .collect::<Result<Vec<Value>, ApiError>>()?;
    let tools: Vec<Value> = tools.iter().map(tool_value).collect();
    let mut extra = Map::new();
    if think {
        extra.insert("enable_thinking".into(), Value::Bool(true));
    }
    let text = template
        .render(&RenderInput {
            messages: &values,
            tools: (!tools.is_empty()).then_some(tools.as_slice()),
            add_generation_prompt: true,
            bos_token: tok.token_text(tok.bos_id()).unwrap_or(""),
            eos_token: tok.token_text(tok.eos_id()).unwrap_or(""),
            extra: &extra,
        })
        .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
    let parts = split_marked(&text).ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "the model's chat template cut a message's text apart; send the text without \
             the model's own markers",
        )
    })?;
    let parts: Vec<(&str, bool)> = parts.iter().map(|(t, trusted)| (*t, *trusted)).collect();
    Ok(tok.encode_parts(&parts, false))
}

/// The rendering as (text, trusted) pieces: the marked spans are message
/// text. `None` when the marks do not pair up.
fn split_marked(text: &str) -> Option<Vec<(&str, bool)>> {
    let mut parts = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find([TEXT_OPEN, TEXT_CLOSE]) {
        if !rest[open..].starts_with(TEXT_OPEN) {
            return None;
        }
        parts.push((&rest[..open], true));
        let inner = &rest[open + TEXT_OPEN.len_utf8()..];
        let close = inner.find([TEXT_OPEN, TEXT_CLOSE])?;
        if !inner[close..].starts_with(TEXT_CLOSE) {
            return None;
        }
        parts.push((&inner[..close], false));
        rest = &inner[close + TEXT_CLOSE.len_utf8()..];
    }
    parts.push((rest, true));
    Some(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_go_inside_the_outer_white_space() {
        assert_eq!(marked("  hi there \n"), "  \u{FDD0}hi there\u{FDD1} \n");
        assert_eq!(marked("   "), "   ");
    }

    #[test]
    fn marked_spans_are_untrusted_and_unpaired_marks_refused() {
        let text = "<a>\u{FDD0}<b>\u{FDD1}<c>";
        assert_eq!(
            split_marked(text).unwrap(),
            [("<a>", true), ("<b>", false), ("<c>", true)]
        );
        assert!(split_marked("x\u{FDD1}y").is_none());
        assert!(split_marked("\u{FDD0}x").is_none());
        assert!(split_marked("\u{FDD0}x\u{FDD0}y\u{FDD1}").is_none());
    }
}
