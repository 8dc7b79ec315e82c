//! Gemma 4's own tool-call syntax read back into OpenAI calls.
//!
//! Gemma 4 writes a call as `<|tool_call>call:NAME{ARGS}<tool_call|>`, its
//! arguments as its chat template writes them: keys bare, strings between
//! `<|"|>` delimiters, numbers, `true`/`false`, lists `[…]` and objects
//! `{…}` with bare keys, e.g. `call:get_weather{city:<|"|>Paris<|"|>,days:2}`.
//! A reply is read whole: its calls (arguments as a JSON object) and the
//! text around them as content. A reply whose calls do not all read (cut by
//! `max_tokens`, or malformed) is returned as content, as it is, so that a
//! client never receives arguments that are not valid JSON.

use serde_json::{Map, Number, Value};

pub const CALL_OPEN: &str = "<|tool_call>";
pub const CALL_CLOSE: &str = "<tool_call|>";
/// Delimits a string value.
const QUOTE: &str = "<|\"|>";

/// One call as the model wrote it.
#[derive(Clone, Debug, PartialEq)]
pub struct NativeCall {
    pub name: String,
    /// A JSON object.
    pub arguments: Value,
}

/// A reply read for calls.
#[derive(Clone, Debug, PartialEq)]
pub struct NativeReply {
    /// The text outside the calls, trimmed (all of it when no call reads).
    pub content: String,
    pub calls: Vec<NativeCall>,
}

/// Reads `text`, a whole reply.
pub fn read_reply(text: &str) -> NativeReply {
    read_calls(text).unwrap_or_else(|| NativeReply {
        content: text.to_string(),
        calls: Vec::new(),
    })
}

fn read_calls(text: &str) -> Option<NativeReply> {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(CALL_OPEN) {
        content.push_str(&rest[..at]);
        let body_start = &rest[at + CALL_OPEN.len()..];
        let end = body_start.find(CALL_CLOSE)?;
        calls.push(read_call(&body_start[..end])?);
        rest = &body_start[end + CALL_CLOSE.len()..];
    }
    content.push_str(rest);
    Some(NativeReply {
        content: content.trim().to_string(),
        calls,
    })
}

/// Where the first call that repeats an earlier one begins (the same name
/// and arguments), in a reply read so far; calls not yet closed are not
/// compared. The reply ends there ([`super::tools::CallFormat::repeat_check`]).
pub fn repeat_start(text: &str) -> Option<usize> {
    let mut seen: Vec<NativeCall> = Vec::new();
    let mut at = 0;
    while let Some(open) = text[at..].find(CALL_OPEN) {
        let start = at + open;
        let body_at = start + CALL_OPEN.len();
        let end = text[body_at..].find(CALL_CLOSE)?;
        if let Some(call) = read_call(&text[body_at..body_at + end]) {
            if seen.contains(&call) {
                return Some(start);
            }
            seen.push(call);
        }
        at = body_at + end + CALL_CLOSE.len();
    }
    None
}

/// `call:NAME{ARGS}`.
fn read_call(body: &str) -> Option<NativeCall> {
    let body = body.trim().strip_prefix("call:")?;
    let brace = body.find('{')?;
    let name = body[..brace].trim();
    let valid_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !valid_name {
        return None;
    }
    let mut reader = Reader {
        text: &body[brace..],
    };
    let arguments = reader.object()?;
    reader.text.trim().is_empty().then(|| NativeCall {
        name: name.to_string(),
        arguments,
    })
}

/// A cursor over argument text.
struct Reader<'a> {
    text: &'a str,
}

impl Reader<'_> {
    fn eat(&mut self, token: &str) -> bool {
        match self.text.strip_prefix(token) {
            Some(rest) => {
                self.text = rest;
                true
            }
            None => false,
        }
    }

    fn value(&mut self) -> Option<Value> {
        if self.text.starts_with(QUOTE) {
            return self.string().map(Value::String);
        }
        match self.text.chars().next()? {
            '{' => self.object(),
            '[' => self.array(),
            _ => self.bare(),
        }
    }

    /// `<|"|>…<|"|>`: everything up to the closing delimiter, verbatim.
    fn string(&mut self) -> Option<String> {
        self.eat(QUOTE).then_some(())?;
        let end = self.text.find(QUOTE)?;
        let s = self.text[..end].to_string();
        self.text = &self.text[end + QUOTE.len()..];
        Some(s)
    }

    /// `{key:value,…}`, keys bare or delimited.
    fn object(&mut self) -> Option<Value> {
        self.eat("{").then_some(())?;
        let mut map = Map::new();
        if self.eat("}") {
            return Some(Value::Object(map));
        }
        loop {
            let key = if self.text.starts_with(QUOTE) {
                self.string()?
            } else {
                let end = self.text.find(':')?;
                let key = self.text[..end].trim();
                if key.is_empty() || key.contains([',', '{', '}', '[', ']']) {
                    return None;
                }
                self.text = &self.text[end..];
                key.to_string()
            };
            self.eat(":").then_some(())?;
            let value = self.value()?;
            map.insert(key, value);
            if self.eat("}") {
                return Some(Value::Object(map));
            }
            self.eat(",").then_some(())?;
        }
    }

    fn array(&mut self) -> Option<Value> {
        self.eat("[").then_some(())?;
        let mut items = Vec::new();
        if self.eat("]") {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value()?);
            if self.eat("]") {
                return Some(Value::Array(items));
            }
            self.eat(",").then_some(())?;
        }
    }

    /// A number, `true`, `false` or a null (`null`, or Python's `None`
    /// as the template prints it).
    fn bare(&mut self) -> Option<Value> {
        let end = self.text.find([',', '}', ']']).unwrap_or(self.text.len());
        let word = self.text[..end].trim();
        self.text = &self.text[end..];
        match word {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            "null" | "None" => Some(Value::Null),
            _ => {
                let number: Number = serde_json::from_str(word).ok()?;
                Some(Value::Number(number))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_call_with_every_kind_of_argument() {
        let text = "<|tool_call>call:get_weather{city:<|\"|>Paris, \"France\"<|\"|>,days:2,\
                    scale:-1.5e3,metric:true,tags:[<|\"|>a<|\"|>,3],where:{lat:48.8,name:<|\"|>x{y}<|\"|>},\
                    note:None}<tool_call|>";
        let reply = read_reply(text);
        assert_eq!(reply.content, "");
        assert_eq!(
            reply.calls,
            [NativeCall {
                name: "get_weather".into(),
                arguments: json!({
                    "city": "Paris, \"France\"",
                    "days": 2,
                    "scale": -1500.0,
                    "metric": true,
                    "tags": ["a", 3],
                    "where": {"lat": 48.8, "name": "x{y}"},
                    "note": null
                }),
            }]
        );
    }

    #[test]
    fn the_template_s_own_writing_reads_back() {
        // As the Gemma 4 template writes the call of tests/data/chat_templates.
        let text = "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2,unit:<|\"|>celsius<|\"|>}<tool_call|>";
        let reply = read_reply(text);
        assert_eq!(
            reply.calls[0].arguments,
            json!({"city": "Paris", "days": 2, "unit": "celsius"})
        );
    }

    #[test]
    fn several_calls_and_text_around_them() {
        let text =
            "Let me check.\n<|tool_call>call:a{}<tool_call|><|tool_call>call:b{x:1}<tool_call|>";
        let reply = read_reply(text);
        assert_eq!(reply.content, "Let me check.");
        let names: Vec<&str> = reply.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(reply.calls[0].arguments, json!({}));
    }

    #[test]
    fn a_truncated_or_malformed_call_is_returned_as_content() {
        for text in [
            "<|tool_call>call:get_weather{city:<|\"|>Par",
            "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:",
            "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}",
            "<|tool_call>call:get_weather{days:two}<tool_call|>",
            "<|tool_call>call:{days:2}<tool_call|>",
            "<|tool_call>get_weather{days:2}<tool_call|>",
            "<|tool_call>call:f{a:1} extra<tool_call|>",
            "<|tool_call>call:ok{}<tool_call|><|tool_call>call:cut{a:",
        ] {
            let reply = read_reply(text);
            assert!(reply.calls.is_empty(), "{text}: {reply:?}");
            assert_eq!(reply.content, text);
        }
    }

    #[test]
    fn a_repeated_call_is_found_where_it_begins() {
        let a = "<|tool_call>call:a{x:1}<tool_call|>";
        let b = "<|tool_call>call:b{x:1}<tool_call|>";
        let a_again = "<|tool_call>call:a{ x:1 }<tool_call|>";
        assert_eq!(repeat_start(&format!("{a}{b}")), None);
        let text = format!("{a}{b}{a_again}{b}");
        assert_eq!(repeat_start(&text), Some(a.len() + b.len()));
        // An open call is not compared yet; other arguments are no repeat.
        assert_eq!(repeat_start(&format!("{a}<|tool_call>call:a{{x:1}}")), None);
        assert_eq!(
            repeat_start(&format!("{a}<|tool_call>call:a{{x:2}}<tool_call|>")),
            None
        );
    }

    #[test]
    fn a_reply_without_calls_is_its_text() {
        let reply = read_reply("  Paris is the capital.  ");
        assert_eq!(reply.content, "Paris is the capital.");
        assert!(reply.calls.is_empty());
    }
}
