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
    /// Text that opens the first user turn: system text and the document.
    opening: String,
}

impl TurnEncoder {
    /// `system` and `document` go at the start of the first user turn of
    /// every conversation (Gemma has no system role).
    pub fn new(
        template: ChatTemplate,
        system: Option<&str>,
        document: Option<&str>,
    ) -> Result<TurnEncoder> {
        if template.user_turn.matches("{content}").count() != 1 {
            bail!(
                "chat template {:?}: user_turn must contain {{content}} exactly once",
                template.name
            );
        }
        let mut opening = String::new();
        if let Some(s) = system.filter(|s| !s.is_empty()) {
            opening.push_str(&template.system_prefix.replace("{system}", s));
        }
        if let Some(d) = document {
            opening.push_str(d.trim_end());
            opening.push_str("\n\n");
        }
        Ok(TurnEncoder { template, opening })
    }

    /// What every conversation starts with: BOS, the template's preamble,
    /// the opening of the first user turn and the system text and document. Being the same for every conversation,
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
        ids.extend(tok.encode(&self.template.model_start, false));
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
        let mut ids = crate::generate::stop_ids(tok);
        for piece in &self.template.stop_pieces {
            if let Some(id) = tok.id_of(piece)
                && !ids.contains(&id)
            {
                ids.push(id);
            }
        }
        ids
    }
}
