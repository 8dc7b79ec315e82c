//! The Jinja chat template a model ships (GGUF `tokenizer.chat_template`,
//! HF `chat_template.jinja` or `tokenizer_config.json`), rendered with
//! minijinja the way transformers renders it with Python's jinja2:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python's string and
//! dict methods, `tojson` as `json.dumps(…, ensure_ascii=False)` writes it,
//! and the globals transformers adds (`raise_exception`, `strftime_now`).
//! Values print as Python prints them (`None`, `True`), since templates
//! written against jinja2 sometimes print them.

use anyhow::{Result, anyhow};
use minijinja::value::{Kwargs, Value as JinjaValue, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::{Map, Value};
use std::fmt::Write as _;

/// A parsed template and where it came from (named in every error).
pub struct JinjaTemplate {
    env: Environment<'static>,
    /// Where the text came from, e.g. `GGUF tokenizer.chat_template`.
    source: String,
}

/// What a template is rendered with: transformers' variables.
pub struct RenderInput<'a> {
    /// Messages as OpenAI sends them: `role`, `content` (a string or a
    /// list of `{type, text}` parts), `tool_calls`, `tool_call_id`…
    pub messages: &'a [Value],
    /// Tool definitions (`[{type: function, function: {…}}]`); `None` when
    /// the request has none, as transformers passes it.
    pub tools: Option<&'a [Value]>,
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
    /// Further variables (`enable_thinking`…), as `chat_template_kwargs`.
    pub extra: &'a Map<String, Value>,
}

/// The name the template is stored under in its environment.
const NAME: &str = "chat_template";

impl JinjaTemplate {
    /// Parses `text`; `source` says where it came from.
    pub fn new(source: &str, text: &str) -> Result<JinjaTemplate> {
        let mut env = Environment::new();
        // transformers' environment: jinja2's trim_blocks and lstrip_blocks,
        // a single trailing newline dropped (jinja2's default).
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| anyhow!("internal error: Jinja syntax: {e}"))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, text.to_string())
            .map_err(|e| describe(source, &e))?;
        Ok(JinjaTemplate {
            env,
            source: source.to_string(),
        })
    }

    /// Where the template came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template's text mentions `word` (a variable it reads,
    /// such as `enable_thinking`).
    pub fn mentions(&self, word: &str) -> bool {
        self.env
            .get_template(NAME)
            .is_ok_and(|t| t.source().contains(word))
    }

    pub fn render(&self, input: &RenderInput) -> Result<String> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| describe(&self.source, &e))?;
        let mut vars: Map<String, Value> = input.extra.clone();
        vars.insert("messages".into(), Value::Array(input.messages.to_vec()));
        if let Some(tools) = input.tools {
            vars.insert("tools".into(), Value::Array(tools.to_vec()));
        }
        vars.insert(
            "add_generation_prompt".into(),
            Value::Bool(input.add_generation_prompt),
        );
        vars.insert("bos_token".into(), Value::from(input.bos_token));
        vars.insert("eos_token".into(), Value::from(input.eos_token));
        template
            .render(JinjaValue::from(minijinja::value::Serde(&vars)))
            .map_err(|e| describe(&self.source, &e))
    }
}

/// One line naming the template's source, the line and what went wrong.
fn describe(source: &str, e: &Error) -> anyhow::Error {
    let what = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    match e.line() {
        Some(line) => anyhow!("chat template ({source}), line {line}: {what}"),
        None => anyhow!("chat template ({source}): {what}"),
    }
}

/// Prints values as Python's `str()` does where minijinja's differs:
/// `None`, `True`, `False`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut State,
    value: &JinjaValue,
) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::None => "None",
        ValueKind::Bool if value.is_true() => "True",
        ValueKind::Bool => "False",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(text).map_err(Error::from)
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<JinjaValue, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("the template refused the conversation: {message}"),
    ))
}

/// `x | tojson(indent=…, sort_keys=…)` as transformers defines it:
/// `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`,
/// so with Python's separators (`", "` and `": "`).
fn tojson(value: JinjaValue, kwargs: Kwargs) -> Result<JinjaValue, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: cannot write the value as JSON: {e}"),
        )
    })?;
    let mut out = String::new();
    write_python_json(&mut out, &json, indent, sort_keys.unwrap_or(false), 0);
    Ok(JinjaValue::from_safe_string(out))
}

/// JSON as Python's `json.dumps` writes it with `ensure_ascii=False`.
fn write_python_json(out: &mut String, v: &Value, indent: Option<usize>, sort: bool, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    // With an indent, items end their line, so no space after the comma.
    let comma = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => write!(out, "{i}").unwrap_or_default(),
            (None, Some(u), _) => write!(out, "{u}").unwrap_or_default(),
            (None, None, Some(f)) => out.push_str(&python_float(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_python_string(out, s),
        Value::Array(items) if items.is_empty() => out.push_str("[]"),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(comma);
                }
                newline(out, depth + 1);
                write_python_json(out, item, indent, sort, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(comma);
                }
                newline(out, depth + 1);
                write_python_string(out, key);
                out.push_str(": ");
                write_python_json(out, value, indent, sort, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

/// A float as Python's `repr` writes it for the common cases: always with a
/// fraction or an exponent (`1.0`, `0.5`, `1e-05`).
fn python_float(f: f64) -> String {
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Python: mantissa, `e`, a sign and at least two exponent digits.
        let text = format!("{f:e}");
        let (mantissa, exp) = text.split_once('e').unwrap_or((&text, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let text = format!("{f}");
    if text.contains('.') {
        text
    } else {
        format!("{text}.0")
    }
}

fn write_python_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).unwrap_or_default(),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `strftime_now(format)`: the current UTC time in C's `strftime` format
/// (the directives chat templates use: dates, month and day names, times).
fn strftime_now(format: String) -> Result<JinjaValue, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, secs).map(JinjaValue::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `format` for the UTC time `secs` after the Unix epoch.
fn strftime(format: &str, secs: u64) -> Result<String, Error> {
    let days = (secs / 86_400) as i64;
    let (year, month, day) = civil_from_days(days);
    let in_day = secs % 86_400;
    let (hour, minute, second) = (in_day / 3600, in_day / 60 % 60, in_day % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('-') if chars.clone().next() == Some('d') => {
                chars.next();
                write!(out, "{day}")
            }
            Some('B') => write!(out, "{month_name}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('H') => write!(out, "{hour:02}"),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: the directive %{} is not supported",
                        other.map_or(String::new(), String::from)
                    ),
                ));
            }
        }
        .unwrap_or_default();
    }
    Ok(out)
}

/// Year, month (1–12) and day of the month of a day count since 1970-01-01
/// in the proleptic Gregorian calendar (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(text: &str, messages: &[Value]) -> Result<String> {
        let t = JinjaTemplate::new("test", text)?;
        t.render(&RenderInput {
            messages,
            tools: None,
            add_generation_prompt: true,
            bos_token: "<bos>",
            eos_token: "<eos>",
            extra: &Map::new(),
        })
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_does() {
        let text = "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content | trim }}]\n  {% endif %}\n{% endfor %}\n";
        let out = render(text, &[json!({"role": "user", "content": " hi "})]).unwrap();
        assert_eq!(out, "<bos>\n[hi]\n");
    }

    #[test]
    fn python_string_methods_and_printing() {
        let text = "{{ messages[0].content.strip().startswith('a') }} {{ none }} {{ messages[0].get('x') }} {{ 'a,b'.split(',') | length }}";
        let out = render(text, &[json!({"role": "user", "content": " ab "})]).unwrap();
        assert_eq!(out, "True None None 2");
    }

    #[test]
    fn tojson_writes_what_python_writes() {
        let text = "{{ messages[0] | tojson }}|{{ [1.0, 0.5, 1e-05, 'é\"'] | tojson }}|{{ {'b': 1, 'a': [2]} | tojson(indent=2) }}";
        let out = render(text, &[json!({"role": "user", "content": "x\ny"})]).unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"x\\ny\"}|[1.0, 0.5, 1e-05, \"é\\\"\"]|{\n  \"b\": 1,\n  \"a\": [\n    2\n  ]\n}"
        );
    }

    #[test]
    fn errors_name_the_source_and_the_line() {
        let err = JinjaTemplate::new("model.gguf tokenizer.chat_template", "ok\n{% if %}")
            .err()
            .expect("a syntax error");
        let text = err.to_string();
        assert!(
            text.contains("model.gguf tokenizer.chat_template") && text.contains("line 2"),
            "{text}"
        );
        let err = render(
            "a\nb\n{{ raise_exception('only user turns') }}",
            &[json!({"role": "user", "content": "x"})],
        )
        .expect_err("raise_exception refuses");
        let text = err.to_string();
        assert!(
            text.contains("line 3") && text.contains("only user turns"),
            "{text}"
        );
    }

    #[test]
    fn strftime_formats_a_known_day() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let secs = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y, %A %B %-d %H:%M:%S %y/%m", secs).unwrap(),
            "29 Feb 2024, Thursday February 29 13:05:09 24/02"
        );
        assert!(strftime("%Q", secs).is_err());
    }
}
