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
use serde::Deserialize;
use std::path::Path;

pub mod jinja;

/// The built-in templates, by name.
const BUILT_IN: [(&str, &str); 2] = [
    ("gemma", include_str!("../templates/gemma.json")),
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
    /// What closes the model's turn once it stopped.
    pub model_end: String,
    /// Put before the first user message when system text is given;
    /// `{system}` is replaced by it.
    pub system_prefix: String,
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
    /// one message: preamble, the user turn, the opening of the model's
    /// turn. `system` goes before the message.
    pub fn user_then_model(&self, message: &str, system: Option<&str>) -> String {
        let content = match system {
            Some(s) if !s.is_empty() => {
                format!("{}{message}", self.system_prefix.replace("{system}", s))
            }
            _ => message.to_string(),
        };
        format!(
            "{}{}{}",
            self.preamble,
            self.user_turn.replace("{content}", &content),
            self.model_start
        )
    }
}

/// A template and why it was chosen, for the first line on stderr.
pub struct TemplateChoice {
    pub template: ChatTemplate,
    pub why: String,
}

impl TemplateChoice {
    /// `requested` is `--chat-template`; without it, a model that ships a
    /// chat template or whose name marks it instruction-tuned gets Gemma's
    /// turn format and any other model the plain dialogue.
    pub fn for_model(
        src: &ModelSource,
        tok: &Tokenizer,
        requested: Option<&str>,
    ) -> Result<TemplateChoice> {
        if let Some(arg) = requested {
            return Ok(TemplateChoice {
                template: ChatTemplate::named_or_file(arg)?,
                why: format!("--chat-template {arg}"),
            });
        }
        let shipped = tok.chat_template().is_some();
        let names = model_names(src);
        let tuned_name = names.iter().find(|n| marks_instruction_tuned(n));
        let (template, why) = match (shipped, tuned_name) {
            (true, _) => (
                ChatTemplate::gemma(),
                "the model ships a chat template".to_string(),
            ),
            (false, Some(name)) => (
                ChatTemplate::gemma(),
                format!("the model's name {name:?} marks it instruction-tuned"),
            ),
            (false, None) => (
                ChatTemplate::dialogue(),
                format!(
                    "the model ships no chat template and its name {:?} does not mark it instruction-tuned",
                    names.first().map_or("", String::as_str)
                ),
            ),
        };
        Ok(TemplateChoice { template, why })
    }

    /// The first line a chat or a templated run prints.
    pub fn describe(&self) -> String {
        format!(
            "chat format {:?} ({}): {}; --chat-template {}|FILE overrides",
            self.template.name,
            self.template.about,
            self.why,
            ChatTemplate::built_in_names().replace(", ", "|")
        )
    }
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
            t.user_then_model("Hi", None),
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            t.user_then_model("Hi", Some("Be brief.")),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(t.model_end, "<end_of_turn>\n");
    }

    #[test]
    fn dialogue_turns_end_at_the_next_user_line() {
        let t = ChatTemplate::dialogue();
        let text = t.user_then_model("Hi", None);
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
            "Llama-3-8B-Instruct",
        ] {
            assert!(marks_instruction_tuned(name), "{name}");
        }
        for name in [
            "gemma-3-270m-q4_k_m.gguf",
            "Gemma 3 270m",
            "gemma-2b",
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
        assert!(err.to_string().contains("gemma, dialogue"), "{err}");
    }
}
