//! What a line typed at the chat prompt means: a message, or one of the
//! slash commands.

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Line {
    /// Nothing but spaces: ask again.
    Blank,
    /// A message for the model.
    Message(String),
    /// Start a new conversation.
    Reset,
    /// Show context use and speeds.
    Stats,
    Help,
    Quit,
    /// A slash word that is not a command.
    Unknown(String),
}

/// The commands and what they do, for `/help`.
pub const HELP: &str = "\
/reset  start a new conversation (the -f document and --system text stay)
/stats  context use and speeds so far
/help   this list
/quit   leave (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C during a reply stops the reply. Start a message with // to send one that begins with /.";

pub fn parse(line: &str) -> Line {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return Line::Blank;
    }
    // `//text` sends `/text` as a message.
    if let Some(rest) = trimmed.strip_prefix("//") {
        return Line::Message(format!("/{rest}"));
    }
    let Some(word) = trimmed.strip_prefix('/') else {
        return Line::Message(trimmed.to_string());
    };
    match word.to_ascii_lowercase().as_str() {
        "reset" | "clear" => Line::Reset,
        "stats" => Line::Stats,
        "help" | "?" => Line::Help,
        "quit" | "exit" | "bye" => Line::Quit,
        _ => Line::Unknown(trimmed.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        assert_eq!(parse("  "), Line::Blank);
        assert_eq!(parse(" hello \n"), Line::Message("hello".into()));
        assert_eq!(parse("/reset"), Line::Reset);
        assert_eq!(parse(" /QUIT "), Line::Quit);
        assert_eq!(parse("/stats"), Line::Stats);
        assert_eq!(parse("/help"), Line::Help);
        assert_eq!(parse("/nope"), Line::Unknown("/nope".into()));
        assert_eq!(parse("/reset now"), Line::Unknown("/reset now".into()));
        assert_eq!(parse("//etc/passwd"), Line::Message("/etc/passwd".into()));
        assert_eq!(parse("a /reset"), Line::Message("a /reset".into()));
    }
}
