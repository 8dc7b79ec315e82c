//! Structured output: JSON schemas, regular expressions and Lark grammars
//! turned into a mask over the vocabulary before each token is sampled, so
//! that the output is always a prefix of a text the constraint accepts.
//!
//! The work is done by llguidance (the engine llama.cpp uses). This module
//! gives it Pulsar's vocabulary ([`vocab`]), reads what the user asked for
//! ([`spec`]), and follows one generation ([`state`]); [`mask`] applies a
//! mask to logits.
//!
//! Lifetimes, chosen so that a server can serve many requests from one
//! process: a [`GrammarCompiler`] is built once per tokenizer (it indexes
//! the whole vocabulary, the slow part) and is `Send + Sync`; each request
//! compiles its [`ConstraintSpec`] into a [`CompiledConstraint`]; each
//! generation (each chat reply) starts a fresh [`ConstraintState`] from it.
//!
//! Layering: this sits above the tokenizer and beside `generate`; the
//! engine, model and JIT know nothing of it.

pub mod lookahead;
pub mod mask;
pub mod spec;
pub mod state;
pub mod vocab;

pub use spec::ConstraintSpec;
pub use state::{ConstraintState, NextTokens};
pub use vocab::VocabBytes;

use crate::tokenizer::Tokenizer;
use anyhow::Result;
use llguidance::{Matcher, ParserFactory};
use std::time::Instant;
use toktrie::ApproximateTokEnv;

/// Compiles constraints for one tokenizer. Build it once per process.
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// How long indexing the vocabulary took, for the stats line.
    build_secs: f64,
}

impl GrammarCompiler {
    /// Indexes `tok`'s vocabulary. `end_ids` are the tokens that end
    /// generation (EOS first); they are allowed exactly when a constraint
    /// is complete.
    pub fn for_tokenizer(tok: &Tokenizer, end_ids: &[u32]) -> Result<GrammarCompiler> {
        GrammarCompiler::build(VocabBytes::of(tok, end_ids)?)
    }

    /// Indexes a vocabulary gathered by [`VocabBytes::of`]. This is the slow
    /// part (about a second for Gemma's 262,144 tokens on 2 busy cores:
    /// the trie, then llguidance's precomputed slices of the vocabulary
    /// that make JSON-string masks fast), so callers with other work to do
    /// (loading the model) run it on another thread.
    pub fn build(vocab: VocabBytes) -> Result<GrammarCompiler> {
        let start = Instant::now();
        let env = vocab.into_token_env();
        let mut factory = ParserFactory::new_simple(&env)?;
        // llguidance's own warnings would go to stderr unasked; errors come
        // back as values and are reported with the flag that caused them.
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            build_secs: start.elapsed().as_secs_f64(),
        })
    }

    /// A compiler over a vocabulary of the 256 single bytes: built in
    /// moments, it tells whether a constraint compiles (errors do not
    /// depend on the vocabulary) before the real one is ready.
    pub fn byte_level() -> Result<GrammarCompiler> {
        let start = Instant::now();
        let mut factory = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env())?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            build_secs: start.elapsed().as_secs_f64(),
        })
    }

    /// Seconds spent indexing the vocabulary.
    pub fn build_secs(&self) -> f64 {
        self.build_secs
    }

    /// Compiles `spec`. An invalid schema, regex or grammar gives one line
    /// that starts with the flag and carries llguidance's description of
    /// the problem (which names the rule, position or keyword).
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<CompiledConstraint> {
        let start = Instant::now();
        let parser = self
            .factory
            .create_parser(spec.to_grammar())
            .map_err(|e| anyhow::anyhow!("{}: {}", spec.flag(), one_line(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            anyhow::bail!("{}: {}", spec.flag(), one_line(&e));
        }
        Ok(CompiledConstraint {
            fresh: matcher,
            flag: spec.flag(),
            compile_secs: start.elapsed().as_secs_f64(),
        })
    }
}

/// llguidance's messages sometimes span lines (a grammar excerpt); the CLI
/// reports errors on one line.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A compiled constraint, ready to start any number of generations.
pub struct CompiledConstraint {
    /// A matcher that has seen no token; each generation gets a copy.
    fresh: Matcher,
    flag: &'static str,
    compile_secs: f64,
}

impl CompiledConstraint {
    /// A matcher for one new generation.
    pub fn start(&self) -> ConstraintState {
        ConstraintState::new(self.fresh.clone(), self.flag)
    }

    /// The flag it came from, for messages.
    pub fn flag(&self) -> &'static str {
        self.flag
    }

    /// Seconds the compilation took.
    pub fn compile_secs(&self) -> f64 {
        self.compile_secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::TokenKind::*;

    pub(crate) fn letters_tokenizer() -> Tokenizer {
        Tokenizer::for_tests(&[
            ("<eos>", Control),
            ("<bos>", Control),
            ("a", Normal),
            ("b", Normal),
            ("ab", Normal),
            ("{", Normal),
            ("}", Normal),
            ("\"", Normal),
            (":", Normal),
            ("1", Normal),
            ("▁", Normal),
        ])
    }

    fn compile_error(spec: ConstraintSpec) -> String {
        let tok = letters_tokenizer();
        let compiler = GrammarCompiler::for_tokenizer(&tok, &[0]).unwrap();
        match compiler.compile(&spec) {
            Ok(_) => panic!("{spec:?} compiled"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn invalid_regex_names_flag_and_problem() {
        let msg = compile_error(ConstraintSpec::regex("[0-9").unwrap());
        assert!(msg.starts_with("--regex: "), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.to_lowercase().contains("class"), "{msg}");
    }

    #[test]
    fn invalid_lark_names_flag_and_problem() {
        let spec = ConstraintSpec::Lark {
            grammar: "start: missing_rule\n".to_string(),
            path: "g.lark".into(),
        };
        let msg = compile_error(spec);
        assert!(msg.starts_with("--grammar: "), "{msg}");
        assert!(msg.contains("missing_rule"), "{msg}");
    }

    #[test]
    fn invalid_schema_names_flag_and_keyword() {
        let spec = ConstraintSpec::JsonSchema(serde_json::json!({"type": "strnig"}));
        let msg = compile_error(spec);
        assert!(msg.starts_with("--json-schema: "), "{msg}");
        assert!(msg.contains("strnig"), "{msg}");
    }

    #[test]
    fn compiler_is_shareable_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<GrammarCompiler>();
        fn sendable<T: Send>() {}
        sendable::<ConstraintState>();
    }
}
