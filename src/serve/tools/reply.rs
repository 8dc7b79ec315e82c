//! A function-calling reply read back as it grows: the calls whose names
//! are whole, their arguments as written so far, or the answer's text.
//! The reply is JSON of the shape [`super::ToolCalling::schema`] holds the
//! model to; a JSON parser reads only whole values, so this reader of that
//! one shape reads any prefix of a reply (what a stream has) and reports
//! what grew since the last look. The calls then become OpenAI's
//! `tool_calls` entries.

use serde_json::{Value, json};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::tools::CallFormat;

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
