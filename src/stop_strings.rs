//! Text-level stop strings (`--stop TEXT`, the dialogue template's
//! `\nUser:`), caught in the decoded text however the tokens split them.
//!
//! Streaming and stop strings pull against each other: text must reach the
//! user as soon as it is made, yet a stop string must never be shown, and
//! its first bytes may come tokens before its last. The matcher therefore
//! holds back exactly the tail of the text that could still grow into a
//! stop string and releases everything before it.

/// Watches generated text for stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Text not yet released: the longest tail that is still the start of
    /// some stop string.
    held: String,
    /// Bytes released so far.
    released: usize,
}

/// What one piece of text did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scan {
    /// No stop string is complete; this text is safe to show.
    Go(String),
    /// A stop string is complete. `text` is what remains to show before
    /// it; `at` is the byte offset in the whole text where it begins.
    Stop { text: String, at: usize },
}

impl StopStrings {
    /// Empty strings are ignored: they would stop before the first token.
    pub fn new<S: AsRef<str>>(stops: &[S]) -> StopStrings {
        let mut kept: Vec<String> = Vec::new();
        for s in stops.iter().map(AsRef::as_ref).filter(|s| !s.is_empty()) {
            if !kept.iter().any(|k| k == s) {
                kept.push(s.to_string());
            }
        }
        StopStrings {
            stops: kept,
            ..StopStrings::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Adds the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> Scan {
        self.held.push_str(piece);
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(i) = earliest {
            let text = self.held[..i].to_string();
            let at = self.released + i;
            self.released += i;
            self.held.clear();
            return Scan::Stop { text, at };
        }
        let keep = self.unfinished_tail();
        let cut = self.held.len() - keep;
        let text: String = self.held.drain(..cut).collect();
        self.released += text.len();
        Scan::Go(text)
    }

    /// Releases what is held back: generation ended for another reason, so
    /// no stop string can complete any more.
    pub fn finish(&mut self) -> String {
        self.released += self.held.len();
        std::mem::take(&mut self.held)
    }

    /// Drops what is held back: a length limit cut the reply while a stop
    /// string may have been under way, and the start of hidden text is
    /// not shown (`-n 4` must not end a reply on "\nUser" when "\nUser:"
    /// is a stop string).
    pub fn discard(&mut self) {
        self.held.clear();
    }

    /// Length of the longest tail of `held` that is a proper start of a
    /// stop string (a whole one was looked for already).
    fn unfinished_tail(&self) -> usize {
        let held = self.held.as_str();
        // Tails from longest to shortest, starting on character boundaries.
        held.char_indices()
            .map(|(i, _)| &held[i..])
            .find(|tail| self.stops.iter().any(|s| s.starts_with(tail)))
            .map_or(0, str::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopStrings::new(stops);
        let mut shown = String::new();
        for p in pieces {
            match m.push(p) {
                Scan::Go(t) => shown.push_str(&t),
                Scan::Stop { text, at } => {
                    shown.push_str(&text);
                    return (shown, Some(at));
                }
            }
        }
        shown.push_str(&m.finish());
        (shown, None)
    }

    #[test]
    fn a_stop_split_across_pieces_is_caught_and_not_shown() {
        let (shown, at) = run(&["\nUser:"], &[" Paris", ".\n", "Us", "er", ":", " more"]);
        assert_eq!(shown, " Paris.");
        assert_eq!(at, Some(7));
    }

    #[test]
    fn only_a_possible_start_is_held_back() {
        let mut m = StopStrings::new(&["\nUser:"]);
        assert_eq!(m.push("Hi\nUs"), Scan::Go("Hi".into()));
        // "\nUsa" can no longer become "\nUser:", so it all comes out.
        assert_eq!(m.push("a"), Scan::Go("\nUsa".into()));
        assert_eq!(m.push("\n"), Scan::Go(String::new()));
        assert_eq!(m.finish(), "\n");
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        let (shown, at) = run(&["END", "ND!"], &["aEND!"]);
        assert_eq!((shown.as_str(), at), ("a", Some(1)));
        let (shown, at) = run(&["xyz", "b"], &["ab", "xyz"]);
        assert_eq!((shown.as_str(), at), ("a", Some(1)));
    }

    #[test]
    fn multibyte_text_is_held_on_character_boundaries() {
        let (shown, at) = run(&["éé"], &["aé", "bé", "é"]);
        assert_eq!(shown, "aéb");
        assert_eq!(at, Some("aéb".len()));
        let (shown, at) = run(&["日本"], &["日", "x日"]);
        assert_eq!((shown.as_str(), at), ("日x日", None));
    }

    #[test]
    fn a_discarded_start_is_never_shown() {
        let mut stops = StopStrings::new(&["\nUser:"]);
        assert_eq!(stops.push("Hello.\nUs"), Scan::Go("Hello.".into()));
        stops.discard();
        assert_eq!(stops.finish(), "");
    }

    #[test]
    fn without_stops_everything_passes_at_once() {
        let mut m = StopStrings::new::<&str>(&[""]);
        assert!(m.is_empty());
        assert_eq!(m.push("abc"), Scan::Go("abc".into()));
    }
}
