//! Chat templates: how turns are written as text for the model. Kept as
//! small JSON files in templates/ (the built-in ones are compiled in); a
//! user can name a built-in one or supply a file with `--chat-template`.
//!
//! Which one a model gets is decided by [`TemplateChoice::for_model`]: an
//! instruction-tuned model learned Gemma's turn format; a base
//! (pretrained) model never saw it and answers it with noise, but it
//! continues a plain `User:`/`Assistant:` dialogue sensibly.

use crate::model::source::ModelSource;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use jinja::JinjaTemplate;
use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;

pub mod derive;
pub mod jinja;

/// The built-in templates, by name.
const BUILT_IN: [(&str, &str); 3] = [
    ("gemma", include_str!("../templates/gemma.json")),
    ("gemma4", include_str!("../templates/gemma4.json")),
    ("dialogue", include_str!("../templates/dialogue.json")),
];

#[derive(Clone, Debug, Deserialize)]
pub struct ChatTemplate {
    pub name: String,
    /// A few words on what the format is and whom it is for.
    #[serde(default)]
    pub about: String,
    /// Whether a conversation starts with BOS.
    pub bos: bool,
    /// Text that opens every conversation, before the first user turn.
    #[serde(default)]
    pub preamble: String,
    /// A user turn; `{content}` is replaced by the message.
    pub user_turn: String,
    /// What opens the model's turn (the prompt ends with it).
    pub model_start: String,
    /// What opens the model's turn when it may think first (`--think`),
    /// where that differs: Gemma 4 closes an empty thought channel in
    /// `model_start` so that the model answers at once.
    #[serde(default)]
    pub model_start_thinking: Option<String>,
    /// What closes the model's turn once it stopped.
    pub model_end: String,
    /// Put before the first user message when system text is given;
    /// `{system}` is replaced by it (formats without a system role).
    #[serde(default)]
    pub system_prefix: String,
    /// A turn of its own for the system text, before the first user turn
    /// (formats with a system role, as Gemma 4's); `{system}` is replaced
    /// by it. When set, `system_prefix` is not used.
    #[serde(default)]
    pub system_turn: Option<String>,
    /// What switches thinking on (`--think`), at the start of the system
    /// turn's text; the system turn is then written even without system text.
    #[serde(default)]
    pub think_marker: Option<String>,
    /// Control pieces that end the model's turn when generated.
    #[serde(default)]
    pub stop_pieces: Vec<String>,
    /// Text that ends the model's turn when generated (never shown).
    #[serde(default)]
    pub stop_strings: Vec<String>,
}

impl ChatTemplate {
    /// A built-in template by name.
    pub fn built_in(name: &str) -> Option<ChatTemplate> {
        let (_, json) = BUILT_IN.iter().find(|(n, _)| *n == name)?;
        Some(serde_json::from_str(json).expect("the built-in templates are valid"))
    }

    pub fn gemma() -> ChatTemplate {
        Self::built_in("gemma").expect("gemma is built in")
    }

    pub fn dialogue() -> ChatTemplate {
        Self::built_in("dialogue").expect("dialogue is built in")
    }

    /// Names of the built-in templates, for messages.
    pub fn built_in_names() -> String {
        BUILT_IN.map(|(n, _)| n).join(", ")
    }

    pub fn from_file(path: &Path) -> Result<ChatTemplate> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read chat template", path.display()))?;
        let t: ChatTemplate = serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: not a chat template (JSON with name, bos, user_turn, model_start, model_end, system_prefix)",
                path.display()
            )
        })?;
        if t.user_turn.matches("{content}").count() != 1 {
            bail!(
                "{}: user_turn must contain {{content}} exactly once",
                path.display()
            );
        }
        Ok(t)
    }

    /// `--chat-template NAME|FILE`: a built-in name, else a file.
    pub fn named_or_file(arg: &str) -> Result<ChatTemplate> {
        if let Some(t) = Self::built_in(arg) {
            return Ok(t);
        }
        let path = Path::new(arg);
        if !path.exists() {
            bail!(
                "--chat-template {arg:?}: neither a built-in template ({}) nor an existing file",
                Self::built_in_names()
            );
        }
        Self::from_file(path)
    }

    /// The text of a whole conversation's start up to the model's reply to
    /// one message: preamble, the system text (in its own turn or before
    /// the message), the user turn, the opening of the model's turn.
    pub fn user_then_model(&self, message: &str, system: Option<&str>, think: bool) -> String {
        let mut text = self.preamble.clone();
        let system = system.filter(|s| !s.is_empty());
        let mut content = message.to_string();
        match self.system_turn_parts(system, think) {
            Some(parts) => text.extend(parts.map(|(t, _)| t)),
            None => {
                if let Some(s) = system.filter(|_| self.system_turn.is_none()) {
                    content = format!("{}{message}", self.system_prefix.replace("{system}", s));
                }
            }
        }
        text.push_str(&self.user_turn.replace("{content}", &content));
        text.push_str(self.model_start(think));
        text
    }

    /// The system turn of a format with a system role, as (text, trusted)
    /// pieces: its opening with the think marker, the system text, its
    /// close. `None` when the format has no system role, or when there is
    /// neither system text nor thinking to put in it.
    pub fn system_turn_parts(
        &self,
        system: Option<&str>,
        think: bool,
    ) -> Option<[(String, bool); 3]> {
        let turn = self.system_turn.as_deref()?;
        let system = system.unwrap_or("");
        let marker = self.think_marker.as_deref().filter(|_| think);
        if system.is_empty() && marker.is_none() {
            return None;
        }
        let (before, after) = turn.split_once("{system}").unwrap_or((turn, ""));
        Some([
            (format!("{before}{}", marker.unwrap_or("")), true),
            (system.to_string(), false),
            (after.to_string(), true),
        ])
    }

    /// What opens the model's turn, with or without thinking.
    pub fn model_start(&self, think: bool) -> &str {
        match &self.model_start_thinking {
            Some(thinking) if think => thinking,
            _ => &self.model_start,
        }
    }

    /// Ids that end the model's turn: EOS, `<end_of_turn>` and the
    /// template's stop pieces that the vocabulary has.
    pub fn stop_ids(&self, tok: &Tokenizer) -> Vec<u32> {
        let mut ids = crate::generate::stop_ids(tok);
        for piece in &self.stop_pieces {
            if let Some(id) = tok.id_of(piece)
                && !ids.contains(&id)
            {
                ids.push(id);
            }
        }
        ids
    }

    /// Whether `--think` does anything with this format.
    pub fn can_think(&self) -> bool {
        self.think_marker.is_some() && self.system_turn.is_some()
    }
}

/// A template and why it was chosen, for the first line on stderr.
pub struct TemplateChoice {
    pub template: ChatTemplate,
    /// The Jinja template the turn pieces were read from, when there is
    /// one: the server renders whole requests (tools, tool calls) with it.
    pub jinja: Option<Arc<JinjaTemplate>>,
    pub why: String,
}

impl TemplateChoice {
    /// `requested` is `--chat-template`. Without it, a model that ships a
    /// chat template gets that template's turn format; one whose name
    /// marks it instruction-tuned gets its family's built-in format (Gemma
    /// 4's or Gemma's turns, told apart by the vocabulary); any other
    /// model the plain dialogue.
    pub fn for_model(
        src: &ModelSource,
        tok: &Tokenizer,
        requested: Option<&str>,
    ) -> Result<TemplateChoice> {
        if let Some(arg) = requested {
            return Self::requested(arg, tok);
        }
        let names = model_names(src);
        if let Some(text) = tok.chat_template() {
            let source = match src.gguf() {
                Some(_) => format!("{} tokenizer.chat_template", src.path.display()),
                None => format!("{} chat_template", src.path.display()),
            };
            return Ok(Self::shipped(&source, text, tok));
        }
        let tuned_name = names.iter().find(|n| marks_instruction_tuned(n));
        let (template, why) = match tuned_name {
            Some(name) => (
                family_template(tok),
                format!("the model's name {name:?} marks it instruction-tuned"),
            ),
            None => (
                ChatTemplate::dialogue(),
                format!(
                    "no chat template shipped, and {:?} is not named as instruction-tuned",
                    names.first().map_or("", String::as_str)
                ),
            ),
        };
        Ok(TemplateChoice {
            template,
            jinja: None,
            why,
        })
    }

    /// The template a model ships, read into turn pieces; where they cannot
    /// express it, the family's built-in format, saying why.
    fn shipped(source: &str, text: &str, tok: &Tokenizer) -> TemplateChoice {
        let read = JinjaTemplate::new(source, text).and_then(|jinja| {
            let template = from_jinja(&jinja, tok)?;
            Ok((template, jinja))
        });
        match read {
            Ok((template, jinja)) => TemplateChoice {
                template,
                jinja: Some(Arc::new(jinja)),
                why: "the model ships a chat template".to_string(),
            },
            Err(e) => TemplateChoice {
                template: family_template(tok),
                jinja: None,
                why: format!(
                    "the model ships a chat template, but it is not used ({e:#}); using the built-in format instead"
                ),
            },
        }
    }

    /// `--chat-template NAME|FILE`: a built-in name, a JSON file of turn
    /// pieces or a Jinja file.
    fn requested(arg: &str, tok: &Tokenizer) -> Result<TemplateChoice> {
        let why = format!("--chat-template {arg}");
        let path = Path::new(arg);
        let is_jinja = ChatTemplate::built_in(arg).is_none()
            && path.exists()
            && path.extension().is_none_or(|e| e != "json");
        if !is_jinja {
            return Ok(TemplateChoice {
                template: ChatTemplate::named_or_file(arg)?,
                jinja: None,
                why,
            });
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read chat template", path.display()))?;
        let jinja = JinjaTemplate::new(&path.display().to_string(), &text)?;
        let template = from_jinja(&jinja, tok)?;
        Ok(TemplateChoice {
            template,
            jinja: Some(Arc::new(jinja)),
            why,
        })
    }

    /// The first line a chat or a templated run prints: the format and
    /// why, short (start-up is a line or two); with `verbose` also what
    /// the format is.
    pub fn describe(&self, verbose: bool) -> String {
        let about = if verbose {
            format!(" ({})", self.template.about)
        } else {
            String::new()
        };
        format!(
            "chat format {:?}{about}: {}; --chat-template NAME|FILE to change",
            self.template.name, self.why,
        )
    }
}

/// The built-in turn format of the model's family: Gemma 4's when the
/// vocabulary has its turn tokens, else Gemma's.
fn family_template(tok: &Tokenizer) -> ChatTemplate {
    match tok.id_of("<|turn>") {
        Some(_) => ChatTemplate::built_in("gemma4").expect("gemma4 is built in"),
        None => ChatTemplate::gemma(),
    }
}

/// Turn pieces read from a Jinja template, named after the model's family,
/// with the family's stop pieces and the token that closes a model turn.
fn from_jinja(jinja: &JinjaTemplate, tok: &Tokenizer) -> Result<ChatTemplate> {
    let family = family_template(tok);
    let bos = tok.token_text(tok.bos_id()).unwrap_or("<bos>");
    let eos = tok.token_text(tok.eos_id()).unwrap_or("<eos>");
    let mut t = derive::derive(jinja, &family.name, bos, eos)?;
    t.stop_pieces = family.stop_pieces;
    let close = t.model_end.trim();
    if tok.id_of(close).is_some() && !t.stop_pieces.iter().any(|p| p == close) {
        t.stop_pieces.push(close.to_string());
    }
    Ok(t)
}

/// The names a model goes by: GGUF `general.name` and `general.finetune`,
/// then the file or folder name.
fn model_names(src: &ModelSource) -> Vec<String> {
    let mut names = Vec::new();
    if let Some(g) = src.gguf() {
        for key in ["general.name", "general.finetune"] {
            if let Ok(Some(v)) = g.get_str(key) {
                names.push(v.to_string());
            }
        }
    }
    if let Some(file) = src.path.file_name() {
        names.push(file.to_string_lossy().into_owned());
    }
    names
}

/// Whether a name says "instruction-tuned" the way Gemma releases and their
/// conversions do: a word `it`, `instruct` or `chat` (`gemma-2b-it`,
/// `gemma-3-270m-it-Q8_0.gguf`, `…-Instruct`).
fn marks_instruction_tuned(name: &str) -> bool {
    name.to_ascii_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .any(|word| matches!(word, "it" | "instruct" | "chat"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_turns() {
        let t = ChatTemplate::gemma();
        assert_eq!(
            t.user_then_model("Hi", None, false),
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            t.user_then_model("Hi", Some("Be brief."), false),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(t.model_end, "<end_of_turn>\n");
    }

    #[test]
    fn dialogue_turns_end_at_the_next_user_line() {
        let t = ChatTemplate::dialogue();
        let text = t.user_then_model("Hi", None, false);
        assert!(text.starts_with("A conversation between"), "{text}");
        assert!(text.ends_with("\n\nUser: Hi\nAssistant:"), "{text}");
        assert_eq!(t.stop_strings, ["\nUser:"]);
        assert!(t.stop_pieces.is_empty());
    }

    #[test]
    fn instruction_tuned_names() {
        for name in [
            "gemma-2b-it",
            "Gemma 3 270m It",
            "gemma-3-270m-it-Q4_K_M.gguf",
            "gemma-3n-E2B-it-Q4_K_M.gguf",
            "Gemma 3n E4B It",
            "Llama-3-8B-Instruct",
        ] {
            assert!(marks_instruction_tuned(name), "{name}");
        }
        for name in [
            "gemma-3-270m-q4_k_m.gguf",
            "Gemma 3 270m",
            "gemma-2b",
            "gemma-3n-E4B",
            "italian-model",
            "split",
        ] {
            assert!(!marks_instruction_tuned(name), "{name}");
        }
    }

    #[test]
    fn a_template_is_named_or_read_from_a_file() {
        assert_eq!(ChatTemplate::named_or_file("gemma").unwrap().name, "gemma");
        assert_eq!(
            ChatTemplate::named_or_file("dialogue").unwrap().name,
            "dialogue"
        );
        let err =
            ChatTemplate::named_or_file("no-such-template").expect_err("unknown names are refused");
        assert!(err.to_string().contains("gemma, gemma4, dialogue"), "{err}");
    }

    #[test]
    fn gemma4_has_a_system_turn_and_thinks_on_request() {
        let t = ChatTemplate::built_in("gemma4").unwrap();
        assert_eq!(
            t.user_then_model("Hi", Some("Be brief."), false),
            "<|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n\
             <|turn>model\n<|channel>thought\n<channel|>"
        );
        assert_eq!(
            t.user_then_model("Hi", None, true),
            "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
        );
        assert_eq!(
            t.user_then_model("Hi", None, false),
            "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
        );
        assert!(t.can_think());
        assert!(!ChatTemplate::gemma().can_think());
        assert_eq!(t.stop_pieces, ["<turn|>", "<|tool_response>"]);
    }
}
