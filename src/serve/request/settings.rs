//! A request's settings that do not depend on its prompt, checked once
//! per request: the sampler's values, penalties, logit bias, stop strings,
//! `max_tokens`, `n`, log-probabilities, and `response_format` (or the
//! function-calling reply schema) compiled to a constraint. A list of
//! prompts shares them; [`ServeContext::prompt_params`] then caps
//! `max_tokens` by the room each prompt leaves.

use super::ServeContext;
use crate::constrain::{CompiledConstraint, ConstraintSpec, NextTokens};
use crate::sample::SamplerConfig;
use crate::serve::api::{ApiError, ResponseFormat, Sampling};
use crate::serve::slot::GenParams;
use crate::serve::tools::ToolCalling;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most stop strings a request may give.
const MAX_STOP_STRINGS: usize = 16;
/// Most alternatives per token in `top_logprobs` (OpenAI's limit).
pub(super) const MAX_TOP_LOGPROBS: u32 = 20;
/// Most choices (`n`) one request may ask for. Each choice is a sequence
/// of its own, in a slot of its own, so `n` costs what `n` requests cost;
/// the bound keeps one request from filling the queue.
const MAX_CHOICES: u32 = 16;

/// A request's settings for every prompt of it: the parameters (their
/// `max_tokens` still to be set per prompt) and the `max_tokens` asked for.
pub(super) struct RequestSettings {
    params: GenParams,
    max_tokens: Option<u32>,
}

/// What a reply reports besides its text.
pub(super) struct Report {
    /// Log-probabilities with this many alternatives per token.
    pub(super) top_logprobs: Option<u32>,
    /// `echo` (completions): the prompt's text first, and its tokens'
    /// log-probabilities when those are asked for.
    pub(super) echo: bool,
}

/// `n`, checked: 1 when left out.
pub(super) fn choices(s: &Sampling) -> Result<usize, ApiError> {
    match s.n {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("n = {n}: a request may ask for 1 to {MAX_CHOICES} choices"),
        )),
    }
}

/// Seeds for requests that give none: the clock, stirred per request so
/// that two requests in the same nanosecond differ.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    now ^ COUNTER
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl ServeContext {
    /// The settings shared by both endpoints, checked, for one prompt.
    pub(super) fn params(
        &self,
        s: &Sampling,
        prompt: &[u32],
        prompt_field: &str,
        report: Report,
        stop_ids: Vec<u32>,
        stop_strings: &mut Vec<String>,
    ) -> Result<GenParams, ApiError> {
        let settings = self.settings(s, report, stop_ids, std::mem::take(stop_strings))?;
        self.prompt_params(&settings, prompt, prompt_field)
    }

    /// The settings that do not depend on the prompt, checked once per
    /// request: a list of prompts shares them (the logit bias and the stop
    /// strings are not copied per prompt or per choice).
    pub(super) fn settings(
        &self,
        s: &Sampling,
        report: Report,
        stop_ids: Vec<u32>,
        mut stop_strings: Vec<String>,
    ) -> Result<RequestSettings, ApiError> {
        let Report { top_logprobs, echo } = report;
        if let Some(n) = top_logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs = {n}: at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        let d = self.defaults;
        let sampling = SamplerConfig {
            temperature: s.temperature.unwrap_or(d.temperature),
            top_k: s.top_k.map_or(d.top_k, |k| k as usize),
            top_p: s.top_p.unwrap_or(d.top_p),
            min_p: s.min_p.unwrap_or(d.min_p),
            repeat_penalty: s.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: s.repeat_last_n.map_or(d.repeat_last_n, |n| n as usize),
        };
        check_range(
            "temperature",
            sampling.temperature,
            0.0,
            f32::MAX,
            "0 = greedy",
        )?;
        if !(sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1] (1 = off), got {}", sampling.top_p),
            ));
        }
        check_range("min_p", sampling.min_p, 0.0, 1.0, "0 = off")?;
        if !(sampling.repeat_penalty.is_finite() && sampling.repeat_penalty > 0.0) {
            return Err(ApiError::invalid(
                "repeat_penalty",
                format!(
                    "repeat_penalty must be a number > 0 (1 = off), got {}",
                    sampling.repeat_penalty
                ),
            ));
        }
        let presence = s.presence_penalty.unwrap_or(0.0);
        let frequency = s.frequency_penalty.unwrap_or(0.0);
        check_range("presence_penalty", presence, -2.0, 2.0, "0 = off")?;
        check_range("frequency_penalty", frequency, -2.0, 2.0, "0 = off")?;
        let logit_bias = self.logit_bias(s)?;
        let stops = s.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
        if stops.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "{} stop strings given; at most {MAX_STOP_STRINGS}",
                    stops.len()
                ),
            ));
        }
        stop_strings.extend(stops.into_iter().filter(|s| !s.is_empty()));
        let (max_tokens_field, asked) = match (s.max_completion_tokens, s.max_tokens) {
            (Some(n), _) => ("max_completion_tokens", Some(n)),
            (None, n) => ("max_tokens", n),
        };
        // With `echo`, no new token is a request to score the prompt alone.
        if asked == Some(0) && !echo {
            return Err(ApiError::invalid(
                max_tokens_field,
                format!("{max_tokens_field} must be at least 1 (0 only with echo)"),
            ));
        }
        Ok(RequestSettings {
            params: GenParams {
                sampling,
                seed: s.seed.map_or_else(fresh_seed, |s| s as u64),
                max_tokens: 0,
                stop_strings: stop_strings.into(),
                stop_ids: stop_ids.into(),
                presence_penalty: presence,
                frequency_penalty: frequency,
                logit_bias,
                logprobs: top_logprobs.map(|n| n as usize),
                trim: false,
                // The prompt's own log-probabilities come with `echo`.
                prompt_logprobs: echo && top_logprobs.is_some(),
                check: None,
            },
            max_tokens: asked,
        })
    }

    /// `logit_bias`, checked: each key a token id of the vocabulary, each
    /// bias in [-100, 100] (-100 bans the token, as OpenAI documents it).
    fn logit_bias(&self, s: &Sampling) -> Result<Arc<[(u32, f32)]>, ApiError> {
        let vocab = self.tok.vocab_size();
        let mut logit_bias = Vec::with_capacity(s.logit_bias.as_ref().map_or(0, |b| b.len()));
        for (key, &bias) in s.logit_bias.iter().flatten() {
            let param = || format!("logit_bias.{key}");
            let id: u32 = key.parse().map_err(|_| {
                ApiError::invalid(param(), format!("logit_bias key {key:?} is not a token id"))
            })?;
            if id as usize >= vocab {
                return Err(ApiError::invalid(
                    param(),
                    format!("token id {id} is outside the vocabulary ({vocab} tokens)"),
                ));
            }
            if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
                check_range(&param(), bias, -100.0, 100.0, "as OpenAI")?;
            }
            let bias = if bias <= -100.0 {
                f32::NEG_INFINITY
            } else {
                bias
            };
            logit_bias.push((id, bias));
        }
        Ok(logit_bias.into())
    }

    /// One prompt's settings: the request's, with `max_tokens` capped by
    /// the room the prompt leaves in a sequence.
    pub(super) fn prompt_params(
        &self,
        settings: &RequestSettings,
        prompt: &[u32],
        prompt_field: &str,
    ) -> Result<GenParams, ApiError> {
        if prompt.len() >= self.context {
            return Err(ApiError::invalid(
                prompt_field,
                format!(
                    "the prompt has {} tokens but a sequence's context holds {} tokens (-c {}); \
                     at least one token must be left to generate: shorten the prompt",
                    prompt.len(),
                    self.context,
                    self.context
                ),
            )
            .with_code("context_length_exceeded"));
        }
        let room = self.context - prompt.len();
        Ok(GenParams {
            max_tokens: settings.max_tokens.map_or(room, |n| (n as usize).min(room)),
            ..settings.params.clone()
        })
    }

    /// `response_format`, compiled; `None` for plain text.
    pub(super) fn constraint(&self, s: &Sampling) -> Result<Option<CompiledConstraint>, ApiError> {
        let (spec, param) = match &s.response_format {
            None | Some(ResponseFormat::Text) => return Ok(None),
            Some(ResponseFormat::JsonObject) => (ConstraintSpec::AnyJsonObject, "response_format"),
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let param = "response_format.json_schema.schema";
                let schema = json_schema.schema.clone().ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        "response_format json_schema needs a `schema` (a JSON schema object)",
                    )
                })?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(ApiError::invalid(
                        param,
                        "the schema must be a JSON object (a JSON schema)",
                    ));
                }
                (ConstraintSpec::JsonSchema(schema), param)
            }
        };
        let compiled = self.compile(&spec, param)?;
        // A schema that no value satisfies (`{"$ref": "#"}`) compiles, and
        // its reply would be empty with finish_reason "stop": refused
        // instead, before it takes a slot.
        match compiled.start().next_tokens() {
            NextTokens::Allowed(_) => Ok(Some(compiled)),
            NextTokens::Complete => Err(ApiError::invalid(
                param,
                "the schema admits no value (not even an empty reply is JSON): check its \
                 references and constraints",
            )),
            NextTokens::DeadEnd(why) => Err(ApiError::invalid(
                param,
                format!("the schema admits no value: {why}"),
            )),
        }
    }

    /// The reply schema of function calling, compiled. A `response_format`
    /// beside it is refused: the reply has the schema of the calls.
    pub(super) fn tools_constraint(
        &self,
        tools: &ToolCalling,
        s: &Sampling,
    ) -> Result<Option<CompiledConstraint>, ApiError> {
        if let Some(ResponseFormat::JsonObject | ResponseFormat::JsonSchema { .. }) =
            &s.response_format
        {
            return Err(ApiError::invalid(
                "response_format",
                "response_format cannot be combined with tools: a reply that may call tools \
                 has the calls' format; leave one of them out (or set tool_choice to \"none\")",
            ));
        }
        let spec = ConstraintSpec::JsonSchema(tools.schema());
        self.compile(&spec, "tools").map(Some)
    }

    fn compile(&self, spec: &ConstraintSpec, param: &str) -> Result<CompiledConstraint, ApiError> {
        self.compiler.compile(spec).map_err(|e| {
            // The compiler's messages start with the CLI flag; the request
            // field is named instead.
            let message = format!("{e:#}");
            let prefix = format!("{}: ", spec.flag());
            let problem = message.strip_prefix(&prefix).unwrap_or(&message);
            ApiError::invalid(param, format!("the schema cannot be used: {problem}"))
        })
    }
}

pub(super) fn include_usage(s: &Sampling) -> bool {
    s.stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false)
}

fn check_range(field: &str, value: f32, lo: f32, hi: f32, note: &str) -> Result<(), ApiError> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        return Ok(());
    }
    let range = if hi == f32::MAX {
        format!(">= {lo}")
    } else {
        format!("in [{lo}, {hi}]")
    };
    Err(ApiError::invalid(
        field,
        format!("{field} must be a number {range} ({note}), got {value}"),
    ))
}
