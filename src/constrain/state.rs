//! One generation under a constraint: which tokens may come next, and
//! taking the token that was sampled.

use llguidance::Matcher;
use toktrie::SimpleVob;

/// What may come next.
pub enum NextTokens {
    /// These tokens (a bit per id; end tokens set when the text so far is
    /// already complete).
    Allowed(SimpleVob),
    /// The constraint is complete and nothing more may follow.
    Complete,
    /// No token can continue the text: the reason, for the user.
    DeadEnd(String),
}

/// Follows one generation. Cheap to start from a
/// [`super::CompiledConstraint`]; `Send`, so the next mask can be computed
/// on another thread while the forward pass runs.
pub struct ConstraintState {
    matcher: Matcher,
    flag: &'static str,
    /// The ids that end generation, as a mask, to tell "only the end is
    /// left" from "the end or more".
    end_tokens: SimpleVob,
}

impl ConstraintState {
    pub(super) fn new(matcher: Matcher, flag: &'static str) -> ConstraintState {
        let end_tokens = matcher
            .tok_env()
            .map(|env| env.tok_trie().eos_token_set())
            .unwrap_or_default();
        ConstraintState {
            matcher,
            flag,
            end_tokens,
        }
    }

    /// The tokens allowed after those taken so far.
    pub fn next_tokens(&mut self) -> NextTokens {
        if self.matcher.is_stopped() {
            return match self.matcher.get_error() {
                Some(e) => self.dead_end(&e),
                None => NextTokens::Complete,
            };
        }
        match self.matcher.compute_mask() {
            Err(e) => self.dead_end(&e.to_string()),
            Ok(mask) if mask.is_zero() => {
                self.dead_end("no token of the vocabulary can continue the text")
            }
            // Only an end token is allowed: the text is complete.
            Ok(mask) if mask.num_set() == mask_overlap(&mask, &self.end_tokens) => {
                NextTokens::Complete
            }
            Ok(mask) => NextTokens::Allowed(mask),
        }
    }

    /// Takes the sampled token. An error means it was not allowed, which
    /// cannot happen for a token sampled under the mask.
    pub fn take(&mut self, token: u32) -> Result<(), String> {
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("{}: {}", self.flag, super::one_line(&e.to_string())))
    }

    /// How many leading tokens of `tokens` the constraint would take one
    /// after another from here, without taking them (a draft is cut to
    /// this). A matcher error counts as none allowed.
    pub fn allowed_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    fn dead_end(&self, why: &str) -> NextTokens {
        NextTokens::DeadEnd(format!("{}: {}", self.flag, super::one_line(why)))
    }
}

/// How many ids are set in both masks.
fn mask_overlap(a: &SimpleVob, b: &SimpleVob) -> usize {
    a.as_slice()
        .iter()
        .zip(b.as_slice())
        .map(|(x, y)| (x & y).count_ones() as usize)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constrain::tests::letters_tokenizer;
    use crate::constrain::{ConstraintSpec, GrammarCompiler};

    fn start(pattern: &str) -> ConstraintState {
        let tok = letters_tokenizer();
        let compiler = GrammarCompiler::for_tokenizer(&tok, &[0]).unwrap();
        compiler
            .compile(&ConstraintSpec::regex(pattern).unwrap())
            .unwrap()
            .start()
    }

    fn allowed(state: &mut ConstraintState) -> Vec<u32> {
        match state.next_tokens() {
            NextTokens::Allowed(mask) => mask.to_list(),
            NextTokens::Complete => panic!("complete"),
            NextTokens::DeadEnd(why) => panic!("dead end: {why}"),
        }
    }

    #[test]
    fn mask_follows_the_regex_and_allows_the_end_once_complete() {
        // Ids: 2 "a", 3 "b", 4 "ab"; 0 is the end token.
        let mut state = start("ab+");
        assert_eq!(allowed(&mut state), vec![2, 4]);
        state.take(2).unwrap();
        assert_eq!(allowed(&mut state), vec![3]);
        state.take(3).unwrap();
        assert_eq!(allowed(&mut state), vec![0, 3]);
    }

    #[test]
    fn allowed_prefix_checks_without_taking() {
        // Ids: 2 "a", 3 "b", 4 "ab".
        let mut state = start("ab+");
        assert_eq!(state.allowed_prefix(&[2, 3, 3, 2]), 3);
        assert_eq!(state.allowed_prefix(&[3]), 0);
        assert_eq!(state.allowed_prefix(&[4, 3]), 2);
        // Nothing was taken: "a" and "ab" are still the only starts.
        assert_eq!(allowed(&mut state), vec![2, 4]);
    }

    #[test]
    fn complete_when_nothing_may_follow() {
        let mut state = start("ab");
        state.take(4).unwrap();
        assert!(matches!(state.next_tokens(), NextTokens::Complete));
    }

    #[test]
    fn a_token_outside_the_mask_is_refused_with_the_flag() {
        let mut state = start("ab");
        let err = state.take(3).unwrap_err();
        assert!(err.starts_with("--regex: "), "{err}");
    }

    #[test]
    fn text_no_token_can_continue_is_a_dead_end() {
        // After "a" the regex wants "c", which no token writes.
        let mut state = start("ac");
        state.take(2).unwrap();
        match state.next_tokens() {
            NextTokens::DeadEnd(why) => assert!(why.starts_with("--regex: "), "{why}"),
            _ => panic!("expected a dead end"),
        }
    }
}
