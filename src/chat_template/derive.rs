//! A model's Jinja template read back into turn pieces.
//!
//! `pulsar chat` keeps the conversation as token spans that mirror the KV
//! cache (src/chat/conversation.rs): a fixed start, then per exchange the
//! user turn, the reply as generated and the turn's close. Re-rendering the
//! whole conversation every turn and keeping the common prefix would throw
//! the cache away whenever a template rewrites history (Gemma 4's drops the
//! thought channel of earlier replies), and would re-tokenize the replies
//! the model generated. So the template is rendered once, at startup, for a
//! few probe conversations whose messages are unique marker words, and the
//! renderings are differenced into the pieces a [`ChatTemplate`] holds: what
//! opens a conversation, what goes around a user message, what opens and
//! closes the model's turn, how system text is written (a turn of its own
//! or the head of the first user turn) and what `enable_thinking` changes.
//! The pieces are then checked: a longer conversation built from them must
//! equal the template's own rendering of it, else the template is one these
//! pieces cannot express and the caller falls back to a built-in format.

use super::ChatTemplate;
use super::jinja::{JinjaTemplate, RenderInput};
use anyhow::{Result, bail};
use serde_json::{Map, Value, json};

/// Marker words for the probe messages: no white space (templates trim
/// messages) and nothing a template would act on.
const USER_1: &str = "PulsarProbeUserOne";
const USER_2: &str = "PulsarProbeUserTwo";
const REPLY_1: &str = "PulsarProbeReplyOne";
const SYSTEM: &str = "PulsarProbeSystem";

struct Prober<'a> {
    template: &'a JinjaTemplate,
    bos_token: &'a str,
    eos_token: &'a str,
}

impl Prober<'_> {
    fn render(&self, messages: &[Value], generation: bool, think: bool) -> Result<String> {
        let mut extra = Map::new();
        if think {
            extra.insert("enable_thinking".into(), Value::Bool(true));
        }
        self.template.render(&RenderInput {
            messages,
            tools: None,
            add_generation_prompt: generation,
            bos_token: self.bos_token,
            eos_token: self.eos_token,
            extra: &extra,
        })
    }
}

fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// `text` split around each of `markers`, which must appear once each and
/// in order: the pieces before, between and after them.
fn split_at_markers(text: &str, markers: &[&str]) -> Option<Vec<String>> {
    let mut pieces = Vec::new();
    let mut rest = text;
    for marker in markers {
        if text.matches(marker).count() != 1 {
            return None;
        }
        let (before, after) = rest.split_once(marker)?;
        pieces.push(before.to_string());
        rest = after;
    }
    pieces.push(rest.to_string());
    Some(pieces)
}

/// The longest common suffix of `a` and `b`, on character boundaries.
fn common_suffix<'a>(a: &'a str, b: &str) -> &'a str {
    let len = a
        .chars()
        .rev()
        .zip(b.chars().rev())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.len_utf8())
        .sum::<usize>();
    &a[a.len() - len..]
}

/// Turn pieces equivalent to `template` for plain conversations (system
/// text, user messages, replies); `name` names the format in messages.
pub fn derive(
    template: &JinjaTemplate,
    name: &str,
    bos_token: &str,
    eos_token: &str,
) -> Result<ChatTemplate> {
    let p = Prober {
        template,
        bos_token,
        eos_token,
    };
    let unreadable = |what: &str| {
        anyhow::anyhow!(
            "chat template ({}): cannot read its turn format: {what}",
            template.source()
        )
    };
    let one = [message("user", USER_1)];
    let asked = p.render(&one, true, false)?;
    let [head, asked_tail] = split_at_markers(&asked, &[USER_1])
        .and_then(|v| <[String; 2]>::try_from(v).ok())
        .ok_or_else(|| unreadable("a user message does not appear once"))?;
    let closed = p.render(&one, false, false)?;
    let after = closed
        .strip_prefix(&format!("{head}{USER_1}"))
        .ok_or_else(|| unreadable("the conversation changes with the generation prompt"))?
        .to_string();
    let model_start = asked_tail
        .strip_prefix(&after)
        .ok_or_else(|| unreadable("the generation prompt does not follow the user turn"))?
        .to_string();

    let three = [
        message("user", USER_1),
        message("assistant", REPLY_1),
        message("user", USER_2),
    ];
    let longer = p.render(&three, true, false)?;
    let pieces = split_at_markers(&longer, &[USER_1, REPLY_1, USER_2])
        .ok_or_else(|| unreadable("the messages of a conversation do not appear once each"))?;
    let (reply_open, between) = (&pieces[1], &pieces[2]);
    // `between` is the close of the model's turn and the opening of the
    // next user turn, which is also the end of `head`.
    let user_open = common_suffix(&head, between).to_string();
    let model_end = between[..between.len() - user_open.len()].to_string();
    let start = &head[..head.len() - user_open.len()];
    let (bos, preamble) = match start.strip_prefix(bos_token) {
        Some(rest) if !bos_token.is_empty() => (true, rest.to_string()),
        _ => (false, start.to_string()),
    };
    // What a past reply opens with may differ from the generation prompt
    // (Gemma 4's prompt closes an empty thought channel); only the check
    // below needs it.
    let history_reply_open = reply_open
        .strip_prefix(&after)
        .ok_or_else(|| unreadable("a reply does not follow the user turn"))?
        .to_string();

    let mut derived = ChatTemplate {
        name: name.to_string(),
        about: format!("the model's own chat template ({})", template.source()),
        bos,
        preamble,
        user_turn: format!("{user_open}{{content}}{after}"),
        model_start,
        model_start_thinking: None,
        model_end,
        system_prefix: String::new(),
        system_turn: None,
        think_marker: None,
        stop_pieces: Vec::new(),
        stop_strings: Vec::new(),
    };
    derive_system(&p, &mut derived, &head, &user_open, &asked_tail)
        .map_err(|e| unreadable(&e.to_string()))?;
    if template.mentions("enable_thinking") {
        derive_thinking(&p, &mut derived, &after);
    }
    check(&p, &derived, &history_reply_open).map_err(|e| unreadable(&e.to_string()))?;
    Ok(derived)
}

/// Where system text goes: a turn of its own before the first user turn,
/// or the head of the first user message.
fn derive_system(
    p: &Prober,
    t: &mut ChatTemplate,
    head: &str,
    user_open: &str,
    asked_tail: &str,
) -> Result<()> {
    let with_system = [message("system", SYSTEM), message("user", USER_1)];
    let text = p.render(&with_system, true, false)?;
    let Some(pieces) = split_at_markers(&text, &[SYSTEM, USER_1]) else {
        bail!("system text does not appear once before the user message");
    };
    let (before, between, tail) = (&pieces[0], &pieces[1], &pieces[2]);
    if tail != asked_tail {
        bail!("system text changes the end of the conversation");
    }
    if before == head {
        // Folded into the first user turn (Gemma 1–3).
        t.system_prefix = format!("{{system}}{between}");
        return Ok(());
    }
    let opening = format!("{}{}", if t.bos { p.bos_token } else { "" }, t.preamble);
    let (Some(turn_open), Some(turn_close)) = (
        before.strip_prefix(&opening),
        between.strip_suffix(user_open),
    ) else {
        bail!("system text is neither a turn of its own nor the head of the first user turn");
    };
    t.system_turn = Some(format!("{turn_open}{{system}}{turn_close}"));
    Ok(())
}

/// What `enable_thinking` changes, when it is only a marker at the head of
/// the system turn and another generation prompt (Gemma 4). Anything else
/// leaves the format without a thinking switch.
fn derive_thinking(p: &Prober, t: &mut ChatTemplate, after: &str) {
    let Some(turn) = t.system_turn.clone() else {
        return;
    };
    let (turn_open, _) = turn.split_once("{system}").unwrap_or((&turn, ""));
    let with_system = [message("system", SYSTEM), message("user", USER_1)];
    let Ok(text) = p.render(&with_system, true, true) else {
        return;
    };
    let opening = format!(
        "{}{}{turn_open}",
        if t.bos { p.bos_token } else { "" },
        t.preamble
    );
    let Some(pieces) = split_at_markers(&text, &[SYSTEM, USER_1]) else {
        return;
    };
    let (Some(marker), Some(model_start)) = (
        pieces[0].strip_prefix(&opening),
        pieces[2].strip_prefix(after),
    ) else {
        return;
    };
    let mut candidate = t.clone();
    candidate.think_marker = Some(marker.to_string());
    candidate.model_start_thinking =
        (model_start != t.model_start).then(|| model_start.to_string());
    // Thinking without system text must come out as the template writes it.
    let one = [message("user", USER_1)];
    match p.render(&one, true, true) {
        Ok(text) if text == built(&candidate, p, None, true, &[], USER_1) => *t = candidate,
        _ => {}
    }
}

/// A conversation as the derived pieces write it: system text, past
/// exchanges (user message, reply), then the last user message and the
/// generation prompt.
fn built(
    t: &ChatTemplate,
    p: &Prober,
    system: Option<&str>,
    think: bool,
    past: &[(&str, &str, &str)],
    last: &str,
) -> String {
    let mut text = String::new();
    if t.bos {
        text.push_str(p.bos_token);
    }
    text.push_str(&t.preamble);
    if let Some(parts) = t.system_turn_parts(system, think) {
        text.extend(parts.map(|(s, _)| s));
    }
    let folded = system
        .filter(|_| t.system_turn.is_none())
        .map(|s| t.system_prefix.replace("{system}", s))
        .unwrap_or_default();
    let (open, close) = t.user_turn.split_once("{content}").unwrap_or(("", ""));
    for (i, (user, reply_open, reply)) in past.iter().enumerate() {
        let head = if i == 0 { folded.as_str() } else { "" };
        text.push_str(&format!(
            "{open}{head}{user}{close}{reply_open}{reply}{}",
            t.model_end
        ));
    }
    let head = if past.is_empty() { folded.as_str() } else { "" };
    text.push_str(&format!(
        "{open}{head}{last}{close}{}",
        t.model_start(think)
    ));
    text
}

/// The derived pieces must write a longer conversation (system text, two
/// exchanges, a third message) exactly as the template does.
fn check(p: &Prober, t: &ChatTemplate, history_reply_open: &str) -> Result<()> {
    let messages = [
        message("system", SYSTEM),
        message("user", USER_1),
        message("assistant", REPLY_1),
        message("user", USER_2),
        message("assistant", "PulsarProbeReplyTwo"),
        message("user", "PulsarProbeUserThree"),
    ];
    let rendered = p.render(&messages, true, false)?;
    let past = [
        (USER_1, history_reply_open, REPLY_1),
        (USER_2, history_reply_open, "PulsarProbeReplyTwo"),
    ];
    let ours = built(t, p, Some(SYSTEM), false, &past, "PulsarProbeUserThree");
    if rendered != ours {
        let at = rendered
            .char_indices()
            .zip(ours.chars())
            .find(|((_, a), b)| a != b)
            .map_or(rendered.len().min(ours.len()), |((i, _), _)| i);
        let near = |text: &str| text[at..].chars().take(40).collect::<String>();
        bail!(
            "a three-turn conversation renders differently from the turn pieces read from it, \
             at byte {at}: {:?} where the pieces write {:?}",
            near(&rendered),
            near(&ours)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template_source(name: &str) -> String {
        let path = format!(
            "{}/tests/data/chat_templates/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn gemma4_templates_give_the_built_in_gemma4_format() {
        // llama.cpp's copy, and the one in Gemma 4's vocab GGUF, whose
        // think marker has no newline after it: read from the template,
        // not assumed.
        for (name, marker) in [
            ("google-gemma-4-31B-it.jinja", "<|think|>\n"),
            ("gemma-4-vocab-gguf.jinja", "<|think|>"),
        ] {
            check_gemma4(&template_source(name), marker);
        }
    }

    fn check_gemma4(source: &str, think_marker: &str) {
        let jinja = JinjaTemplate::new("gemma-4 test", source).unwrap();
        let derived = derive(&jinja, "gemma4", "<bos>", "<eos>").unwrap();
        let built_in = ChatTemplate::built_in("gemma4").unwrap();
        assert!(derived.bos);
        assert_eq!(derived.preamble, built_in.preamble);
        assert_eq!(derived.user_turn, built_in.user_turn);
        assert_eq!(derived.model_start, built_in.model_start);
        assert_eq!(derived.model_start_thinking, built_in.model_start_thinking);
        assert_eq!(derived.model_end, built_in.model_end);
        assert_eq!(derived.system_turn, built_in.system_turn);
        assert_eq!(derived.think_marker.as_deref(), Some(think_marker));
    }

    #[test]
    fn a_folded_system_prompt_is_read_as_a_prefix() {
        // Gemma 1–3's way, written small.
        let source = "{{ bos_token }}{% if messages[0].role == 'system' %}{% set sys = messages[0].content + '\\n\\n' %}{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}\
{% for m in msgs %}{% set role = 'model' if m.role == 'assistant' else m.role %}<start_of_turn>{{ role }}\n{{ (sys if loop.first else '') + m.content | trim }}<end_of_turn>\n{% endfor %}\
{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
        let jinja = JinjaTemplate::new("small", source).unwrap();
        let derived = derive(&jinja, "small", "<bos>", "<eos>").unwrap();
        let gemma = ChatTemplate::gemma();
        assert_eq!(derived.user_turn, gemma.user_turn);
        assert_eq!(derived.model_start, gemma.model_start);
        assert_eq!(derived.model_end, gemma.model_end);
        assert_eq!(derived.system_prefix, gemma.system_prefix);
        assert_eq!(derived.system_turn, None);
        assert!(derived.bos && derived.preamble.is_empty());
        assert!(!derived.can_think());
    }

    #[test]
    fn a_template_that_changes_later_turns_fails_the_check() {
        // Marks the fourth message only, which no probe before the check has.
        let source = "{% for m in messages %}{% if loop.index0 == 4 %}*{% endif %}<{{ m.role }}>{{ m.content }}</>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let jinja = JinjaTemplate::new("later", source).unwrap();
        let err = derive(&jinja, "later", "<bos>", "<eos>").expect_err("refused");
        let text = err.to_string();
        assert!(
            text.contains("renders differently") && text.contains("\"*<assistant>"),
            "{text}"
        );
    }

    #[test]
    fn a_template_the_pieces_cannot_express_is_refused() {
        // Numbers every user turn: no fixed user-turn opening.
        let source = "{% for m in messages %}[{{ loop.index }}:{{ m.role }}]{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[model]{% endif %}";
        let jinja = JinjaTemplate::new("numbered", source).unwrap();
        let err = derive(&jinja, "numbered", "<bos>", "<eos>").expect_err("refused");
        assert!(err.to_string().contains("numbered"), "{err}");
    }
}
