//! Turning chat messages into tokens with a chat template.
//!
//! The template's own pieces (`<start_of_turn>user\n`…) are encoded with
//! control tokens; what the user typed, the system text and the `-f`
//! document are encoded as plain text, so typing `<end_of_turn>` cannot
//! close a turn early or forge a model turn.

use crate::chat_template::ChatTemplate;
use crate::tokenizer::Tokenizer;
use anyhow::{Result, bail};

pub struct TurnEncoder {
    template: ChatTemplate,
    /// The system turn of a format with a system role (with the think
    /// marker under `--think`), as (text, trusted) pieces.
    system_turn: Option<[(String, bool); 3]>,
    /// Text that opens the first user turn: the system text of a format
    /// without a system role, and the document.
    opening: String,
    /// `--think`: the model may think before it answers.
    think: bool,
}

impl TurnEncoder {
    /// `system` goes in the format's system turn, or at the start of the
    /// first user turn of every conversation where it has none (Gemma 1–3);
    /// `document` opens the first user turn.
    pub fn new(
        template: ChatTemplate,
        system: Option<&str>,
        document: Option<&str>,
    ) -> Result<TurnEncoder> {
        Self::with_thinking(template, system, document, false)
    }

    /// [`TurnEncoder::new`], where `think` switches thinking on (Gemma 4's
    /// `<|think|>`); a format without a thinking switch refuses it.
    pub fn with_thinking(
        template: ChatTemplate,
        system: Option<&str>,
        document: Option<&str>,
        think: bool,
    ) -> Result<TurnEncoder> {
        if template.user_turn.matches("{content}").count() != 1 {
            bail!(
                "chat template {:?}: user_turn must contain {{content}} exactly once",
                template.name
            );
        }
        if think && !template.can_think() {
            bail!(
                "--think: the chat format {:?} has no thinking switch (Gemma 4's has one)",
                template.name
            );
        }
        let system = system.filter(|s| !s.is_empty());
        let system_turn = template.system_turn_parts(system, think);
        let mut opening = String::new();
        if let Some(s) = system.filter(|_| template.system_turn.is_none()) {
            opening.push_str(&template.system_prefix.replace("{system}", s));
        }
        if let Some(d) = document {
            opening.push_str(d.trim_end());
            opening.push_str("\n\n");
        }
        Ok(TurnEncoder {
            template,
            system_turn,
            opening,
            think,
        })
    }

    /// What every conversation starts with: BOS, the template's preamble,
    /// the system turn, the opening of the first user turn and the system
    /// text and document. Being the same for every conversation,
    /// it can be fed once at startup and survives /reset in the cache.
    pub fn prefix(&self, tok: &Tokenizer) -> Vec<u32> {
        let mut ids = if self.template.bos {
            vec![tok.bos_id()]
        } else {
            Vec::new()
        };
        if !self.template.preamble.is_empty() {
            ids.extend(tok.encode(&self.template.preamble, false));
        }
        for (text, trusted) in self.system_turn.iter().flatten() {
            ids.extend(match trusted {
                true => tok.encode(text, false),
                false => tok.encode_untrusted(text, false),
            });
        }
        ids.extend(tok.encode(self.turn_parts().0, false));
        if !self.opening.is_empty() {
            ids.extend(tok.encode_untrusted(&self.opening, false));
        }
        ids
    }

    /// A user turn followed by the opening of the model's reply. The first
    /// turn of a conversation continues the [`TurnEncoder::prefix`], which
    /// already opened it.
    pub fn user_turn(&self, tok: &Tokenizer, message: &str, first: bool) -> Vec<u32> {
        let (before, after) = self.turn_parts();
        let mut ids = if first {
            Vec::new()
        } else {
            tok.encode(before, false)
        };
        ids.extend(tok.encode_untrusted(message, false));
        ids.extend(tok.encode(after, false));
        ids.extend(tok.encode(self.template.model_start(self.think), false));
        ids
    }

    /// The user turn's text before and after `{content}`.
    fn turn_parts(&self) -> (&str, &str) {
        // The constructor checked that `{content}` is there.
        self.template
            .user_turn
            .split_once("{content}")
            .unwrap_or((&self.template.user_turn, ""))
    }

    /// Whether replies may hold a thought channel to tell from the answer
    /// (Gemma 4's format).
    pub fn has_thought_channel(&self) -> bool {
        self.template.can_think()
    }

    /// What closes the model's turn, fed after every reply.
    pub fn model_end(&self, tok: &Tokenizer) -> Vec<u32> {
        tok.encode(&self.template.model_end, false)
    }

    /// Text that ends a reply: the template's own stop strings and the
    /// user's `--stop` ones.
    pub fn stop_strings(&self, extra: &[String]) -> Vec<String> {
        let mut all = self.template.stop_strings.clone();
        all.extend(extra.iter().cloned());
        all
    }

    /// Ids that end a reply: EOS, `<end_of_turn>` and the template's stop pieces.
    pub fn stop_ids(&self, tok: &Tokenizer) -> Vec<u32> {
        self.template.stop_ids(tok)
    }
}
