//! Chat templates: how turns are written as text for the model. Kept as
//! small JSON files in templates/ (the Gemma one is built in); a user can
//! supply another with `--chat-template FILE`.

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::path::Path;

/// The built-in Gemma turn format.
const GEMMA: &str = include_str!("../templates/gemma.json");

#[derive(Clone, Debug, Deserialize)]
pub struct ChatTemplate {
    pub name: String,
    /// Whether a conversation starts with BOS.
    pub bos: bool,
    /// A user turn; `{content}` is replaced by the message.
    pub user_turn: String,
    /// What opens the model's turn (the prompt ends with it).
    pub model_start: String,
    /// What closes the model's turn once it stopped.
    pub model_end: String,
    /// Put before the first user message when system text is given;
    /// `{system}` is replaced by it.
    pub system_prefix: String,
    /// Pieces that end the model's turn when generated.
    #[serde(default)]
    pub stop_pieces: Vec<String>,
}

impl ChatTemplate {
    pub fn gemma() -> ChatTemplate {
        serde_json::from_str(GEMMA).expect("the built-in template is valid")
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
        if !t.user_turn.contains("{content}") {
            bail!("{}: user_turn must contain {{content}}", path.display());
        }
        Ok(t)
    }

    /// The text of one user turn followed by the opening of the model's
    /// reply. `system` goes before the message (only on the first turn).
    pub fn user_then_model(&self, message: &str, system: Option<&str>) -> String {
        let content = match system {
            Some(s) if !s.is_empty() => {
                format!("{}{message}", self.system_prefix.replace("{system}", s))
            }
            _ => message.to_string(),
        };
        format!(
            "{}{}",
            self.user_turn.replace("{content}", &content),
            self.model_start
        )
    }
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
}
