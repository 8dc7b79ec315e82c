//! Cutting normalized text into the words that BPE merges one at a time.
//!
//! Gemma 1–3 and Hugging Face `tokenizer.json` files merge each stretch of
//! text whole. llama.cpp's `gemma4` pre-tokenizer first cuts the text into
//! runs of newlines and runs of anything else (the regex `[^\n]+|[\n]+`),
//! and a run of newlines that is itself a vocabulary entry becomes that one
//! token without merging. Gemma 4's merges never join a newline to anything
//! else, so the cut changes no result of its vocabulary; it is kept so that
//! a GGUF declaring `gemma4` is encoded exactly as llama.cpp encodes it.

/// How a stretch of normalized text is cut before merging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pretokenizer {
    /// Merge the whole stretch.
    Whole,
    /// llama.cpp's `gemma4`: newline runs and other runs, merged apart.
    NewlineRuns,
}

/// One word of a stretch: its text and whether it is all newlines.
pub(crate) struct Word<'a> {
    pub text: &'a str,
    pub newlines: bool,
}

/// Cuts `text` into maximal runs of `\n` and runs of everything else, in order.
pub(crate) fn newline_runs(text: &str) -> impl Iterator<Item = Word<'_>> {
    let bytes = text.as_bytes();
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= bytes.len() {
            return None;
        }
        let newlines = bytes[at] == b'\n';
        let len = bytes[at..]
            .iter()
            .position(|&b| (b == b'\n') != newlines)
            .unwrap_or(bytes.len() - at);
        // `\n` is ASCII, so both ends of a run are character boundaries.
        let word = Word {
            text: &text[at..at + len],
            newlines,
        };
        at += len;
        Some(word)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(text: &str) -> Vec<(&str, bool)> {
        newline_runs(text).map(|w| (w.text, w.newlines)).collect()
    }

    #[test]
    fn alternates_newline_runs_and_other_runs() {
        assert_eq!(
            cut("a▁b\n\nc\n"),
            vec![("a▁b", false), ("\n\n", true), ("c", false), ("\n", true)]
        );
        assert_eq!(cut("\n\n\n"), vec![("\n\n\n", true)]);
        assert_eq!(cut("é日本"), vec![("é日本", false)]);
        assert_eq!(cut(""), Vec::<(&str, bool)>::new());
        // Carriage returns and tabs are not newlines here.
        assert_eq!(
            cut("\r\n\t"),
            vec![("\r", false), ("\n", true), ("\t", false)]
        );
    }
}
