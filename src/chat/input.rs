//! Where the user's lines come from: a line editor with history when stdin
//! is a terminal, plain lines otherwise (piped input: each line is a turn,
//! end of input ends the chat).

use anyhow::{Context, Result};
use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;
use std::io::{BufRead, IsTerminal};

/// The prompt shown at a terminal. Fixed, so that scripts and tests can
/// wait for it.
pub const PROMPT: &str = "> ";

pub enum Input {
    Terminal(Box<DefaultEditor>),
    Piped(std::io::StdinLock<'static>),
}

impl Input {
    /// A line editor if stdin is a terminal, else plain lines.
    pub fn open() -> Result<Input> {
        let stdin = std::io::stdin();
        if stdin.is_terminal() {
            let editor =
                DefaultEditor::new().context("cannot set up line editing on this terminal")?;
            Ok(Input::Terminal(Box::new(editor)))
        } else {
            Ok(Input::Piped(stdin.lock()))
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, Input::Terminal(_))
    }

    /// The next line, or `None` when the user is done (end of input,
    /// Ctrl-D, or Ctrl-C at the prompt).
    pub fn next_line(&mut self) -> Result<Option<String>> {
        match self {
            Input::Terminal(editor) => match editor.readline(PROMPT) {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        // A failure to remember a line only costs history.
                        let _ = editor.add_history_entry(line.as_str());
                    }
                    Ok(Some(line))
                }
                Err(ReadlineError::Eof | ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(e).context("cannot read from the terminal"),
            },
            Input::Piped(lines) => {
                let mut line = String::new();
                let n = lines
                    .read_line(&mut line)
                    .context("cannot read a line from stdin (is it UTF-8 text?)")?;
                Ok((n > 0).then_some(line))
            }
        }
    }
}
