//! Where the user's lines come from: a line editor with history when stdin
//! is a terminal, plain lines otherwise (piped input: each line is a turn,
//! end of input ends the chat). A line ending in `\` continues on the next
//! one, as in llama.cpp's interactive mode.

use anyhow::{Context, Result};
use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;
use std::io::{BufRead, IsTerminal};

/// The prompt shown at a terminal. Fixed, so that scripts and tests can
/// wait for it.
pub const PROMPT: &str = "> ";

pub enum Input {
    Terminal {
        editor: Box<DefaultEditor>,
        /// Ctrl-C was pressed at the prompt once: a second press leaves.
        leaving: bool,
    },
    Piped(std::io::StdinLock<'static>),
}

/// What a Ctrl-C at an empty prompt says: one press could be a slip (it
/// also stops a reply), so leaving takes two.
pub const CTRL_C_AGAIN: &str = "pulsar: press Ctrl-C again (or Ctrl-D, or /quit) to leave";

impl Input {
    /// A line editor if stdin is a terminal, else plain lines.
    pub fn open() -> Result<Input> {
        let stdin = std::io::stdin();
        if stdin.is_terminal() {
            let editor =
                DefaultEditor::new().context("cannot set up line editing on this terminal")?;
            Ok(Input::Terminal {
                editor: Box::new(editor),
                leaving: false,
            })
        } else {
            Ok(Input::Piped(stdin.lock()))
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(self, Input::Terminal { .. })
    }

    /// The next message, or `None` when the user is done (end of input,
    /// Ctrl-D, or Ctrl-C twice at the prompt). Lines ending in `\` are
    /// joined with the next one by a newline.
    pub fn next_line(&mut self) -> Result<Option<String>> {
        let mut message = String::new();
        loop {
            let Some(line) = self.raw_line(!message.is_empty())? else {
                // End of input inside a continued message sends what there is.
                return Ok((!message.is_empty()).then_some(message));
            };
            let line = line.strip_suffix('\n').unwrap_or(&line);
            let line = line.strip_suffix('\r').unwrap_or(line);
            match line.strip_suffix('\\') {
                Some(head) => {
                    message.push_str(head);
                    message.push('\n');
                }
                None => {
                    message.push_str(line);
                    return Ok(Some(message));
                }
            }
        }
    }

    /// One line as typed, or `None` when the user is done.
    fn raw_line(&mut self, continued: bool) -> Result<Option<String>> {
        match self {
            Input::Terminal { editor, leaving } => loop {
                let prompt = if continued { "… " } else { PROMPT };
                match editor.readline(prompt) {
                    Ok(line) => {
                        *leaving = false;
                        if !line.trim().is_empty() {
                            // A failure to remember a line only costs history.
                            let _ = editor.add_history_entry(line.as_str());
                        }
                        return Ok(Some(line));
                    }
                    Err(ReadlineError::Eof) => return Ok(None),
                    Err(ReadlineError::Interrupted) if *leaving => return Ok(None),
                    Err(ReadlineError::Interrupted) => {
                        *leaving = true;
                        eprintln!("{CTRL_C_AGAIN}");
                    }
                    Err(e) => return Err(e).context("cannot read from the terminal"),
                }
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
