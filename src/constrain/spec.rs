//! What the user asked the output to be, as given on the command line (or,
//! later, in a server request), turned into an llguidance grammar.

use anyhow::{Context, Result, bail};
use llguidance::api::TopLevelGrammar;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One output constraint. Build it with the constructors, which read files
/// and check the text; [`super::GrammarCompiler::compile`] compiles it.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// `--json`: any JSON object.
    AnyJsonObject,
    /// `--json-schema`: JSON valid against this schema.
    JsonSchema(Value),
    /// `--regex`: text matching this regular expression in full.
    Regex(String),
    /// `--grammar`: text in the language of this Lark grammar.
    Lark { grammar: String, path: PathBuf },
}

/// llguidance's JSON options for schemas that set none: no free white
/// space, only its fixed separators (`", "` and `": "`). Its default allows
/// any run of white space, and a small greedy model given that freedom can
/// fill the rest of its token budget with blank lines instead of closing
/// the value. A bounded pattern (a space, or a line break and up to 24
/// spaces or tabs) was not enough: with the Q8_0/Q5_0 kernels the default
/// model padded "List two people with their ages as JSON." with alternating
/// spaces and tabs until -n 96 ran out.
fn json_options() -> Value {
    serde_json::json!({ "whitespace_flexible": false })
}

impl ConstraintSpec {
    /// `--json-schema FILE|TEXT`: a path to an existing file, else the text
    /// itself.
    pub fn json_schema(arg: &str) -> Result<ConstraintSpec> {
        let path = Path::new(arg);
        let (text, origin) = if path.is_file() {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!(
                    "--json-schema: cannot read {} as UTF-8 text",
                    path.display()
                )
            })?;
            (text, path.display().to_string())
        } else {
            (arg.to_string(), "the given text".to_string())
        };
        let schema: Value = serde_json::from_str(&text).map_err(|e| {
            // Text that cannot begin a schema was meant as a file name.
            let looks_like_json = arg.trim_start().starts_with(['{', '[', '"'])
                || matches!(arg.trim(), "true" | "false");
            if !path.is_file() && !looks_like_json {
                anyhow::anyhow!(
                    "--json-schema: no such file {arg:?} (nor is it schema text); give a schema file or the schema text"
                )
            } else {
                anyhow::anyhow!(
                    "--json-schema: {origin} is not valid JSON ({e}); give a schema file or the schema text"
                )
            }
        })?;
        if !(schema.is_object() || schema.is_boolean()) {
            bail!("--json-schema: {origin} is JSON but not a schema (a schema is an object)");
        }
        Ok(ConstraintSpec::JsonSchema(schema))
    }

    /// `--regex TEXT`.
    pub fn regex(pattern: &str) -> Result<ConstraintSpec> {
        if pattern.is_empty() {
            bail!("--regex: the pattern is empty; give a pattern such as '[0-9]{{3}}'");
        }
        Ok(ConstraintSpec::Regex(pattern.to_string()))
    }

    /// `--grammar FILE`: a Lark grammar.
    pub fn lark_file(path: &Path) -> Result<ConstraintSpec> {
        let grammar = std::fs::read_to_string(path).with_context(|| {
            format!(
                "--grammar: cannot read {} as a UTF-8 Lark grammar",
                path.display()
            )
        })?;
        if grammar.trim().is_empty() {
            bail!(
                "--grammar: {} is empty; a Lark grammar needs at least a `start:` rule",
                path.display()
            );
        }
        Ok(ConstraintSpec::Lark {
            grammar,
            path: path.to_path_buf(),
        })
    }

    /// The flag this constraint came from, for messages.
    pub fn flag(&self) -> &'static str {
        match self {
            ConstraintSpec::AnyJsonObject => "--json",
            ConstraintSpec::JsonSchema(_) => "--json-schema",
            ConstraintSpec::Regex(_) => "--regex",
            ConstraintSpec::Lark { .. } => "--grammar",
        }
    }

    /// The grammar llguidance compiles. JSON schemas get Pulsar's
    /// white-space rule unless they set their own llguidance options.
    pub(super) fn to_grammar(&self) -> TopLevelGrammar {
        match self {
            ConstraintSpec::AnyJsonObject => {
                TopLevelGrammar::from_json_schema(with_json_options(serde_json::json!({
                    "type": "object"
                })))
            }
            ConstraintSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_json_options(schema.clone()))
            }
            ConstraintSpec::Regex(pattern) => TopLevelGrammar::from_regex(pattern),
            ConstraintSpec::Lark { grammar, .. } => TopLevelGrammar::from_lark(grammar.clone()),
        }
    }
}

/// Adds llguidance's per-schema options (`x-guidance`) unless present.
fn with_json_options(schema: Value) -> Value {
    match schema {
        Value::Object(mut fields) => {
            fields.entry("x-guidance").or_insert_with(json_options);
            Value::Object(fields)
        }
        // `true` allows any JSON value, `false` none; both are kept as they are.
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_text_that_is_not_json_names_the_flag_and_position() {
        let err = ConstraintSpec::json_schema(r#"{"type": "object",}"#).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.starts_with("--json-schema:"), "{msg}");
        assert!(msg.contains("line 1 column"), "{msg}");
    }

    #[test]
    fn schema_that_is_not_an_object_is_refused() {
        let err = ConstraintSpec::json_schema("[1, 2]").unwrap_err();
        assert!(format!("{err:#}").contains("not a schema"), "{err:#}");
    }

    #[test]
    fn schema_from_a_file() {
        // Removed on drop when the test ends, pass or fail.
        let dir = tempfile::Builder::new()
            .prefix("pulsar-spec-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("s.json");
        std::fs::write(&path, r#"{"type": "integer"}"#).unwrap();
        let spec = ConstraintSpec::json_schema(path.to_str().unwrap()).unwrap();
        assert_eq!(
            spec,
            ConstraintSpec::JsonSchema(serde_json::json!({"type": "integer"}))
        );
    }

    #[test]
    fn missing_grammar_file_names_the_flag() {
        let err = ConstraintSpec::lark_file(Path::new("/nonexistent/g.lark")).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.starts_with("--grammar:"), "{msg}");
        assert!(msg.contains("/nonexistent/g.lark"), "{msg}");
    }

    #[test]
    fn user_options_win_over_the_whitespace_rule() {
        let mine = serde_json::json!({"type": "object", "x-guidance": {"whitespace_pattern": " "}});
        assert_eq!(with_json_options(mine.clone()), mine);
        let plain = with_json_options(serde_json::json!({"type": "object"}));
        assert_eq!(plain["x-guidance"]["whitespace_flexible"], false);
    }
}
