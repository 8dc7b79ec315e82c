//! Generated text on stdout as it is made.

/// Generated text to stdout, flushed piece by piece so it appears as it is
/// made. A write error (a closed pipe) is kept, not raised mid-generation,
/// and reported by [`StdoutStream::finish`].
pub struct StdoutStream {
    out: std::io::StdoutLock<'static>,
    error: Option<std::io::Error>,
    /// A reply: white space at its start and end is not shown.
    trim: bool,
    /// Nothing but white space has come yet.
    at_start: bool,
    /// White space held back until more text follows it.
    held_space: String,
}

impl Default for StdoutStream {
    fn default() -> Self {
        StdoutStream {
            out: std::io::stdout().lock(),
            error: None,
            trim: false,
            at_start: true,
            held_space: String::new(),
        }
    }
}

impl StdoutStream {
    /// A stream for a reply, which leaves out the white space around it:
    /// after the dialogue format's `Assistant:` the model's first token is a
    /// space, and before the `\nUser:` that ends it comes a line break.
    pub fn reply() -> Self {
        StdoutStream {
            trim: true,
            ..StdoutStream::default()
        }
    }

    pub fn write(&mut self, piece: &str) {
        if !self.trim {
            self.write_out(piece);
            return;
        }
        let piece = if self.at_start {
            piece.trim_start()
        } else {
            piece
        };
        let body = piece.trim_end();
        if !body.is_empty() {
            self.at_start = false;
            let space = std::mem::take(&mut self.held_space);
            self.write_out(&space);
            self.write_out(body);
        }
        self.held_space.push_str(&piece[body.len()..]);
    }

    fn write_out(&mut self, piece: &str) {
        use std::io::Write;
        if piece.is_empty() {
            return;
        }
        if self.error.is_none()
            && let Err(e) = self
                .out
                .write_all(piece.as_bytes())
                .and_then(|_| self.out.flush())
        {
            self.error = Some(e);
        }
    }

    /// Ends the text with `end` (e.g. a newline) and reports any write error.
    pub fn finish(mut self, end: &str) -> std::io::Result<()> {
        self.write_out(end);
        self.error.map_or(Ok(()), Err)
    }
}
