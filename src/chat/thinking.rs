//! Gemma 4's thought channel, told apart from the answer as a reply
//! streams: `<|channel>thought\n… <channel|>answer`. The channel's pieces
//! are vocabulary tokens that decode as text, so the split is on text; a
//! marker cut across two pieces is held back until it is whole or ruled out.

/// What opens the thought channel; the channel's name follows it.
pub const OPEN: &str = "<|channel>";
/// What closes it.
pub const CLOSE: &str = "<channel|>";
/// The channel's name and its newline, not part of the thought.
const LABEL: &str = "thought\n";

/// A stretch of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Thought(String),
    Answer(String),
}

#[derive(Default)]
pub struct ThoughtSplitter {
    /// Text not yet given out: it may be the start of a marker.
    pending: String,
    in_thought: bool,
    /// Right after [`OPEN`]: the channel's name may still come.
    at_label: bool,
}

/// How many bytes at the end of `text` could be the start of `marker`.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

impl ThoughtSplitter {
    pub fn new() -> ThoughtSplitter {
        ThoughtSplitter::default()
    }

    /// The parts that `piece` completes, in order.
    pub fn push(&mut self, piece: &str) -> Vec<Part> {
        self.pending.push_str(piece);
        let mut parts = Vec::new();
        loop {
            if self.at_label {
                if let Some(rest) = self.pending.strip_prefix(LABEL) {
                    self.pending = rest.to_string();
                } else if LABEL.starts_with(self.pending.as_str()) {
                    // Too little text yet to tell.
                    break;
                }
                self.at_label = false;
            }
            let marker = if self.in_thought { CLOSE } else { OPEN };
            if let Some(at) = self.pending.find(marker) {
                let before: String = self.pending[..at].to_string();
                self.pending.drain(..at + marker.len());
                self.give(&mut parts, before);
                self.in_thought = !self.in_thought;
                self.at_label = self.in_thought;
                continue;
            }
            let keep = partial_marker_len(&self.pending, marker);
            let ready: String = self.pending[..self.pending.len() - keep].to_string();
            self.pending.drain(..self.pending.len() - keep);
            self.give(&mut parts, ready);
            break;
        }
        parts
    }

    /// What is left at the end of the reply (a marker that never completed
    /// is text after all).
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.pending);
        let mut parts = Vec::new();
        self.give(&mut parts, rest);
        parts
    }

    fn give(&self, parts: &mut Vec<Part>, text: String) {
        if text.is_empty() {
            return;
        }
        parts.push(match self.in_thought {
            true => Part::Thought(text),
            false => Part::Answer(text),
        });
    }
}

/// A whole reply split at once: the thought (if any) and the answer.
pub fn split_reply(text: &str) -> (Option<String>, String) {
    let mut splitter = ThoughtSplitter::new();
    let mut parts = splitter.push(text);
    parts.extend(splitter.finish());
    let (mut thought, mut answer) = (None::<String>, String::new());
    for part in parts {
        match part {
            Part::Thought(t) => thought.get_or_insert_with(String::new).push_str(&t),
            Part::Answer(a) => answer.push_str(&a),
        }
    }
    (thought, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(parts: Vec<Part>) -> (String, String) {
        let (mut thought, mut answer) = (String::new(), String::new());
        for part in parts {
            match part {
                Part::Thought(t) => thought.push_str(&t),
                Part::Answer(a) => answer.push_str(&a),
            }
        }
        (thought, answer)
    }

    #[test]
    fn a_thought_split_across_pieces_is_told_from_the_answer() {
        let text = "<|channel>thought\nThe user greets me.<channel|>Hello!";
        // Every way of cutting the text in two pieces, and one per byte.
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut s = ThoughtSplitter::new();
            let mut parts = s.push(&text[..cut]);
            parts.extend(s.push(&text[cut..]));
            parts.extend(s.finish());
            assert_eq!(
                joined(parts),
                ("The user greets me.".to_string(), "Hello!".to_string()),
                "cut at {cut}"
            );
        }
        let mut s = ThoughtSplitter::new();
        let mut parts = Vec::new();
        for c in text.chars() {
            parts.extend(s.push(&c.to_string()));
        }
        parts.extend(s.finish());
        assert_eq!(
            joined(parts),
            ("The user greets me.".to_string(), "Hello!".to_string())
        );
    }

    #[test]
    fn text_without_a_channel_is_all_answer_even_with_a_lone_angle() {
        assert_eq!(
            split_reply("a < b and <|chan"),
            (None, "a < b and <|chan".to_string())
        );
        assert_eq!(split_reply("Hi é"), (None, "Hi é".to_string()));
    }

    #[test]
    fn an_unclosed_thought_stays_a_thought() {
        assert_eq!(
            split_reply("<|channel>thought\nstill think"),
            (Some("still think".to_string()), String::new())
        );
        assert_eq!(
            split_reply("<|channel>thought\n<channel|>Answer"),
            (None, "Answer".to_string())
        );
    }
}
