//! From a request body to a job: the prompt's tokens, checked settings and
//! the compiled output constraint. Every refusal is a 400 naming the field.
//!
//! Here: the prompt of each endpoint (chat messages through the template,
//! completion prompts and embedding inputs as text or token ids) and the
//! checks that need it. The settings that do not depend on the prompt
//! (sampling, stops, log-probabilities, `response_format`) are checked in
//! [`settings`].

mod settings;

use super::api::{
    ApiError, ChatRequest, CompletionRequest, Content, EmbeddingRequest, Message, Prompt,
    ResponseFormat, Sampling,
};
use super::native_prompt;
use super::scheduler::too_many_sequences;
use super::slot::GenParams;
use super::tools::{self, CallFormat, ToolCalling};
use crate::chat_template::ChatTemplate;
use crate::chat_template::jinja::JinjaTemplate;
use crate::constrain::{CompiledConstraint, GrammarCompiler};
use crate::sample::SamplerConfig;
use crate::tokenizer::Tokenizer;
use settings::{MAX_TOP_LOGPROBS, Report, choices, include_usage};
use std::sync::Arc;

/// What every request is prepared against.
pub struct ServeContext {
    pub tok: Tokenizer,
    pub template: ChatTemplate,
    /// The model's Jinja template, when the format was read from one.
    pub jinja: Option<Arc<JinjaTemplate>>,
    pub compiler: GrammarCompiler,
    /// Tokens one sequence holds (`-c`).
    pub context: usize,
    pub model_id: String,
    /// Values per embedding: the model's hidden width.
    pub embedding_width: usize,
    /// The defaults for settings a request leaves out (`pulsar run`'s).
    pub defaults: SamplerConfig,
    /// Ids that end a chat reply (EOS, `<end_of_turn>`, the template's stop
    /// pieces) and a completion (EOS, `<end_of_turn>`).
    pub chat_stop_ids: Vec<u32>,
    pub completion_stop_ids: Vec<u32>,
    /// Sequences that may wait for a slot (`--queue`): a request with
    /// more prompts × choices (or inputs) is refused before it is read
    /// further.
    pub max_waiting: usize,
}

/// One prompt of a request and its settings (`max_tokens` is capped by
/// the context that prompt leaves).
pub struct PreparedPrompt {
    pub tokens: Vec<u32>,
    pub params: GenParams,
}

/// A request ready for the queue.
pub struct Prepared {
    /// One for a chat; a completion may send a list (a batch), each
    /// prompt with `choices` choices of its own.
    pub prompts: Vec<PreparedPrompt>,
    pub constraint: Option<CompiledConstraint>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate from the prompt (`n`), each its own sequence.
    pub choices: usize,
    /// `echo` (completions): each choice's text starts with the prompt's.
    pub echo: bool,
    /// The reply is a function-calling object ([`tools`]) to read back
    /// into calls of this format, or content.
    pub tool_calls: Option<CallFormat>,
    /// The chat format has a thought channel (Gemma 4): what the model
    /// writes in it is sent as `reasoning_content`, not as content.
    pub thought_channel: bool,
}

/// An embeddings request ready for the queue.
pub struct PreparedEmbeddings {
    /// Each input's tokens, in order.
    pub inputs: Vec<Vec<u32>>,
    /// `encoding_format: "base64"`.
    pub base64: bool,
}

/// How many prompts (completions) or inputs (embeddings) a request has,
/// counted without reading them.
fn prompt_count(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(_) | Prompt::Tokens(_) => 1,
        Prompt::Texts(texts) => texts.len(),
        Prompt::TokenLists(lists) => lists.len(),
    }
}

impl ServeContext {
    /// Refuses a completion whose prompts × choices could never wait in
    /// the queue together (as `Queue::submit` would, but before any
    /// prompt is tokenized or any job built).
    fn check_sequences(&self, prompts: usize, choices: usize) -> Result<(), ApiError> {
        let sequences = prompts.saturating_mul(choices);
        if sequences <= self.max_waiting {
            return Ok(());
        }
        let (param, what) = if prompts == 1 {
            ("n", format!("n = {choices}"))
        } else {
            (
                "prompt",
                format!("{prompts} prompts with n = {choices} are {sequences} sequences"),
            )
        };
        Err(too_many_sequences(param, &what, self.max_waiting))
    }

    /// `model`: absent, the served model's id (its file name without
    /// `.gguf`, as `/v1/models` lists it) or that file name; any other
    /// name is a 404, as OpenAI answers an unknown model.
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        let Some(name) = model else {
            return Ok(());
        };
        if name == self.model_id || name.strip_suffix(".gguf") == Some(self.model_id.as_str()) {
            return Ok(());
        }
        Err(ApiError {
            param: Some("model".into()),
            ..ApiError::not_found(format!(
                "the model `{name}` does not exist; this server has `{}` (or leave model out)",
                self.model_id
            ))
            .with_code("model_not_found")
        })
    }

    pub fn prepare_chat(&self, req: &ChatRequest) -> Result<Prepared, ApiError> {
        self.check_model(req.model.as_deref())?;
        let legacy = req.functions.is_some() || req.function_call.is_some();
        let tool_calling = if legacy {
            if req.tools.is_some() || req.tool_choice.is_some() {
                return Err(ApiError::invalid(
                    "functions",
                    "functions and function_call (deprecated) cannot be combined with tools and \
                     tool_choice: use tools",
                ));
            }
            ToolCalling::from_legacy(req.functions.as_deref(), req.function_call.as_ref())?
        } else {
            ToolCalling::from_request(
                req.tools.as_deref(),
                req.tool_choice.as_ref(),
                req.parallel_tool_calls,
            )?
        };
        let call_format = if legacy {
            CallFormat::FunctionCall
        } else {
            CallFormat::ToolCalls
        };
        let top = match (req.logprobs, req.top_logprobs) {
            (Some(true), top) => Some(top.unwrap_or(0)),
            (_, Some(n)) if n > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ));
            }
            _ => None,
        };
        let sampling = req.sampling();
        let think = req
            .chat_template_kwargs
            .as_ref()
            .and_then(|k| k.enable_thinking)
            .unwrap_or(false);
        if think && !self.template.can_think() {
            return Err(ApiError::invalid(
                "chat_template_kwargs.enable_thinking",
                format!(
                    "this model's chat format {:?} has no thinking switch (Gemma 4's has one); \
                     leave enable_thinking out",
                    self.template.name
                ),
            ));
        }
        // A template with its own call syntax declares the tools and reads
        // the calls itself, where the model may answer or call as it likes.
        if let (Some(jinja), Some(tools), false) = (self.native_tools(), &tool_calling, legacy)
            && tools.is_auto()
        {
            if let Some(ResponseFormat::JsonObject | ResponseFormat::JsonSchema { .. }) =
                &sampling.response_format
            {
                return Err(ApiError::invalid(
                    "response_format",
                    "response_format cannot be combined with tools: leave one of them out",
                ));
            }
            let prompt = native_prompt::render(
                jinja,
                &self.tok,
                &req.messages,
                req.tools.as_deref().unwrap_or_default(),
                think,
            )?;
            return self.prepared_chat(&sampling, prompt, None, Some(CallFormat::Native), top);
        }
        let constraint = match &tool_calling {
            Some(t) => self.tools_constraint(t, &sampling)?,
            None => self.constraint(&sampling)?,
        };
        let instructions = tool_calling.as_ref().map(ToolCalling::instructions);
        let prompt = self.chat_prompt(&req.messages, instructions.as_deref(), think)?;
        let format = tool_calling.is_some().then_some(call_format);
        self.prepared_chat(&sampling, prompt, constraint, format, top)
    }

    /// The model's Jinja template when it has its own tool-call syntax.
    fn native_tools(&self) -> Option<&JinjaTemplate> {
        self.jinja
            .as_deref()
            .filter(|j| j.mentions(super::gemma4_calls::CALL_OPEN))
    }

    /// A chat request's prompt and reply settings, ready for the queue.
    fn prepared_chat(
        &self,
        sampling: &Sampling,
        prompt: Vec<u32>,
        constraint: Option<CompiledConstraint>,
        tool_calls: Option<CallFormat>,
        top: Option<u32>,
    ) -> Result<Prepared, ApiError> {
        let mut stop_strings = if constraint.is_some() {
            // Under a constraint the constraint decides where the output
            // ends; the template's stop strings would only cut it short.
            Vec::new()
        } else {
            self.template.stop_strings.clone()
        };
        let params = self.params(
            sampling,
            &prompt,
            "messages",
            Report {
                top_logprobs: top,
                echo: false,
            },
            self.chat_stop_ids.clone(),
            &mut stop_strings,
        )?;
        Ok(Prepared {
            prompts: vec![PreparedPrompt {
                tokens: prompt,
                params: GenParams {
                    trim: true,
                    check: tool_calls.map(CallFormat::repeat_check),
                    ..params
                },
            }],
            constraint,
            stream: sampling.stream.unwrap_or(false),
            include_usage: include_usage(sampling),
            choices: choices(sampling)?,
            echo: false,
            tool_calls,
            thought_channel: self.template.can_think(),
        })
    }

    pub fn prepare_completion(&self, req: &CompletionRequest) -> Result<Prepared, ApiError> {
        self.check_model(req.model.as_deref())?;
        let echo = req.echo == Some(true);
        if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                "suffix",
                "suffix (insertion) is not supported by this server",
            ));
        }
        // best_of = n asks for no candidates beyond the n returned; more
        // (generated, then ranked by likelihood) are not supported.
        let n = req.n.unwrap_or(1);
        if let Some(best_of) = req.best_of
            && best_of != n
        {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "best_of = {best_of}: this server returns every completion it generates; \
                     leave best_of out or set it to n ({n})"
                ),
            ));
        }
        let top = req.logprobs.map(|n| n as usize);
        if let Some(n) = req.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs = {n}: at most {MAX_TOP_LOGPROBS} alternatives per token"),
            ));
        }
        let sampling = req.sampling();
        // Before any work per prompt: a list that could never wait in the
        // queue is refused while it costs nothing.
        let choices_per_prompt = choices(&sampling)?;
        self.check_sequences(prompt_count(&req.prompt), choices_per_prompt)?;
        let settings = self.settings(
            &sampling,
            Report {
                top_logprobs: top.map(|n| n as u32),
                echo,
            },
            self.completion_stop_ids.clone(),
            Vec::new(),
        )?;
        let constraint = self.constraint(&sampling)?;
        let mut prompts = Vec::new();
        for (field, tokens) in self.token_lists(&req.prompt, "prompt")? {
            let params = self.prompt_params(&settings, &tokens, &field)?;
            prompts.push(PreparedPrompt { tokens, params });
        }
        Ok(Prepared {
            prompts,
            constraint,
            stream: sampling.stream.unwrap_or(false),
            include_usage: include_usage(&sampling),
            choices: choices_per_prompt,
            echo,
            tool_calls: None,
            thought_channel: false,
        })
    }

    /// The chat's messages in the template's turn format. System (and
    /// developer) messages go in the format's system turn (Gemma 4), else
    /// they are folded into the first user turn, as `pulsar chat` does
    /// (Gemma 1–3 have no system role), and after them the
    /// function-calling `instructions` of a request with tools. Calls in
    /// the history go in as the model writes them, and `tool` messages as
    /// a user turn ([`tools`]). The template's own pieces are trusted;
    /// message text cannot write control tokens.
    pub fn chat_prompt(
        &self,
        messages: &[Message],
        instructions: Option<&str>,
        think: bool,
    ) -> Result<Vec<u32>, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages is empty"));
        }
        let mut system: Vec<String> = Vec::new();
        let mut turns: Vec<(bool, String)> = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let calls = (m.role == "assistant")
                .then(|| tools::history_calls_text(m))
                .flatten();
            let text = match (&calls, &m.content) {
                // An assistant message that only calls functions has no
                // content.
                (Some(_), None) => String::new(),
                _ => message_text(m, i)?,
            };
            match m.role.as_str() {
                "system" | "developer" => system.push(text),
                "user" => turns.push((true, text)),
                "assistant" => {
                    let text = match calls {
                        Some(calls) if text.is_empty() => calls,
                        Some(calls) => format!("{text}\n{calls}"),
                        None => text,
                    };
                    turns.push((false, text));
                }
                "tool" | "function" => {
                    if m.role == "function" && m.name.is_none() {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].name"),
                            "a function message (deprecated) needs `name`: the function it answers for",
                        ));
                    }
                    let line = tools::tool_result_text(messages, i, &text)?;
                    // Results of one round of calls share a user turn.
                    match turns.last_mut() {
                        Some((true, last))
                            if i > 0
                                && matches!(messages[i - 1].role.as_str(), "tool" | "function") =>
                        {
                            last.push('\n');
                            last.push_str(&line);
                        }
                        _ => turns.push((true, line)),
                    }
                }
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!(
                            "role {other:?} is not supported; use system, developer, user, \
                             assistant, tool or function"
                        ),
                    ));
                }
            }
        }
        system.extend(instructions.map(str::to_string));
        if !turns.iter().any(|(user, _)| *user) {
            return Err(ApiError::invalid(
                "messages",
                "messages has no user message",
            ));
        }
        let t = &self.template;
        let (before, after) = t
            .user_turn
            .split_once("{content}")
            .unwrap_or((t.user_turn.as_str(), ""));
        let system = system.join("\n\n");
        let (sys_before, sys_after) = t
            .system_prefix
            .split_once("{system}")
            .unwrap_or((t.system_prefix.as_str(), ""));
        let mut parts: Vec<(&str, bool)> = vec![(&t.preamble, true)];
        let system_turn = t.system_turn_parts(Some(&system), think);
        if let Some(turn) = &system_turn {
            parts.extend(turn.iter().map(|(text, trusted)| (text.as_str(), *trusted)));
        }
        let mut first_user = true;
        for (user, text) in &turns {
            if *user {
                parts.push((before, true));
                if first_user && !system.is_empty() && t.system_turn.is_none() {
                    parts.extend([
                        (sys_before, true),
                        (system.as_str(), false),
                        (sys_after, true),
                    ]);
                }
                first_user = false;
                parts.extend([(text.as_str(), false), (after, true)]);
            } else {
                parts.push((&t.model_start, true));
                // The reply was sent without the space the dialogue
                // format's model writes after `Assistant:`; it goes back.
                if !t.model_start.ends_with(char::is_whitespace)
                    && !text.starts_with(char::is_whitespace)
                {
                    parts.push((" ", true));
                }
                parts.extend([(text.as_str(), false), (&t.model_end, true)]);
            }
        }
        parts.push((t.model_start(think), true));
        Ok(self.tok.encode_parts(&parts, t.bos))
    }

    /// `prompt`: text is plain completion with BOS (as `pulsar run --raw`),
    /// token ids are used as they are.
    /// `POST /v1/embeddings`: each input's tokens (text gets BOS first, as
    /// a prompt does), none empty, none longer than a sequence's context.
    pub fn prepare_embeddings(
        &self,
        req: &EmbeddingRequest,
    ) -> Result<PreparedEmbeddings, ApiError> {
        self.check_model(req.model.as_deref())?;
        let base64 = match req.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::invalid(
                    "encoding_format",
                    format!("encoding_format \"{other}\": use \"float\" or \"base64\""),
                ));
            }
        };
        let width = self.embedding_width;
        if let Some(d) = req.dimensions
            && d as usize != width
        {
            return Err(ApiError::invalid(
                "dimensions",
                format!(
                    "dimensions = {d}: this model's embeddings have {width} values; \
                     leave dimensions out or set it to {width}"
                ),
            ));
        }
        let count = prompt_count(&req.input);
        if count > self.max_waiting {
            return Err(too_many_sequences(
                "input",
                &format!("{count} inputs"),
                self.max_waiting,
            ));
        }
        let inputs = self.token_lists(&req.input, "input")?;
        // An empty text would be BOS alone: refused, as OpenAI refuses it.
        let texts: Vec<&str> = match &req.input {
            Prompt::Text(text) => vec![text],
            Prompt::Texts(texts) => texts.iter().map(String::as_str).collect(),
            Prompt::Tokens(_) | Prompt::TokenLists(_) => Vec::new(),
        };
        if let Some(i) = texts.iter().position(|t| t.is_empty()) {
            let field = match req.input {
                Prompt::Text(_) => "input".to_string(),
                _ => format!("input[{i}]"),
            };
            return Err(ApiError::invalid(
                field.clone(),
                format!("{field} is empty"),
            ));
        }
        for (field, ids) in &inputs {
            if ids.len() > self.context {
                return Err(ApiError::invalid(
                    field.clone(),
                    format!(
                        "{field} has {} tokens but a sequence's context holds {} tokens (-c {}): \
                         shorten it",
                        ids.len(),
                        self.context,
                        self.context
                    ),
                )
                .with_code("context_length_exceeded"));
            }
        }
        Ok(PreparedEmbeddings {
            inputs: inputs.into_iter().map(|(_, ids)| ids).collect(),
            base64,
        })
    }

    /// Token ids from a client: at least one, each in the vocabulary.
    fn check_ids(&self, ids: &[u32], field: &str) -> Result<(), ApiError> {
        if ids.is_empty() {
            return Err(ApiError::invalid(field, format!("{field} has no tokens")));
        }
        if let Some(i) = ids
            .iter()
            .position(|&id| id as usize >= self.tok.vocab_size())
        {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                format!(
                    "token id {} is outside the vocabulary ({} tokens)",
                    ids[i],
                    self.tok.vocab_size()
                ),
            ));
        }
        Ok(())
    }

    /// The texts or token lists of a `prompt` (completions) or `input`
    /// (embeddings), each with the field it came from (`prompt`, or
    /// `prompt[i]` in a list): text gets BOS first, as `pulsar run --raw`
    /// does. Every list has tokens, all in the vocabulary.
    fn token_lists(
        &self,
        prompt: &Prompt,
        field: &str,
    ) -> Result<Vec<(String, Vec<u32>)>, ApiError> {
        let at = |i: usize| format!("{field}[{i}]");
        let lists: Vec<(String, Vec<u32>)> = match prompt {
            Prompt::Text(text) => vec![(field.to_string(), self.tok.encode(text, true))],
            Prompt::Tokens(ids) => vec![(field.to_string(), ids.clone())],
            Prompt::Texts(texts) => texts
                .iter()
                .enumerate()
                .map(|(i, t)| (at(i), self.tok.encode(t, true)))
                .collect(),
            Prompt::TokenLists(lists) => lists
                .iter()
                .enumerate()
                .map(|(i, ids)| (at(i), ids.clone()))
                .collect(),
        };
        if lists.is_empty() {
            return Err(ApiError::invalid(
                field,
                format!("{field} is an empty list"),
            ));
        }
        for (field, ids) in &lists {
            self.check_ids(ids, field)?;
        }
        Ok(lists)
    }
}

/// A message's text: a string, or the text parts of a list.
fn message_text(m: &Message, i: usize) -> Result<String, ApiError> {
    match &m.content {
        None => Err(ApiError::invalid(
            format!("messages[{i}].content"),
            "the message has no content",
        )),
        Some(Content::Text(text)) => Ok(text.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.kind.as_str(), &part.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].text"),
                            "a text part needs `text`",
                        ));
                    }
                    (other, _) => {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}].type"),
                            format!("content parts of type {other:?} are not supported; only text"),
                        ));
                    }
                }
            }
            Ok(text)
        }
    }
}
