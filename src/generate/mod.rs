//! Generation: one sequence's reply ([`Generation`], the only place a
//! token is chosen or a draft judged) and the driver `pulsar run` and
//! `pulsar chat` run it with ([`generate`], [`decode`]): prefill the prompt,
//! then feed each chosen token (and with speculation the tokens drafted
//! after it) until the reply ends. The server's scheduler drives many
//! generations at once over the same type.

pub mod logprobs;
mod sequence;
mod stdout;

pub use sequence::{GenParams, Generation, Judged, Outcome, Piece, ReplyCheck};
pub use stdout::StdoutStream;

use crate::constrain::CompiledConstraint;
use crate::constrain::lookahead::{ConstraintReport, overlap_from_env};
use crate::engine::{Engine, LogitsWanted};
use crate::sample::Sampler;
use crate::speculative::{SpecStats, Speculation};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (EOS or end of turn) was sampled; it was not fed.
    StopToken(u32),
    /// A stop string was generated; it was not shown, and the token that
    /// completed it was not fed.
    StopString,
    /// `max_new` tokens were generated.
    Limit,
    /// The context is full.
    ContextFull,
    /// The caller's interrupt flag was raised.
    Interrupted,
    /// The output constraint is complete: nothing more may follow.
    ConstraintComplete,
    /// No token could continue the text under the output constraint; the
    /// reason is in [`Decoded::constraint`].
    ConstraintDeadEnd,
    /// The reply's [`ReplyCheck`] ended it.
    Check,
}

/// How the OpenAI API names the end of a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token, a stop string, a complete output constraint.
    Stop,
    /// The token limit, or the end of the context.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

impl StopReason {
    pub fn finish_reason(self) -> FinishReason {
        match self {
            StopReason::Limit | StopReason::ContextFull => FinishReason::Length,
            _ => FinishReason::Stop,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub generated: usize,
    pub decode_secs: f64,
    pub stop: StopReason,
    /// What speculation did, when it was on.
    pub spec: Option<SpecStats>,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    pub fn decode_tok_s(&self) -> f64 {
        self.generated as f64 / self.decode_secs.max(1e-9)
    }

    /// One line for stderr after a reply.
    pub fn summary(&self) -> String {
        self.summary_with_format(0)
    }

    /// [`GenerationStats::summary`] saying how many of the prompt's tokens
    /// the chat format added (BOS, turn markers, a preamble), so the count
    /// matches what the user typed.
    pub fn summary_with_format(&self, format_tokens: usize) -> String {
        let spec = match &self.spec {
            Some(s) => format!(" | spec: {}", s.describe(self.generated)),
            None => String::new(),
        };
        let format = match format_tokens {
            0 => String::new(),
            n => format!(" ({n} of them the chat format)"),
        };
        format!(
            "[prompt {} tok{format}, {:.1} tok/s | generated {} tok, {:.1} tok/s{spec}]",
            self.prompt_tokens,
            self.prefill_tok_s(),
            self.generated,
            self.decode_tok_s()
        )
    }
}

/// Ids that end generation: EOS, `<end_of_turn>` (Gemma 1-3), `<turn|>`
/// and `<|tool_response>` (Gemma 4), whichever the vocabulary has.
pub fn stop_ids(tok: &Tokenizer) -> Vec<u32> {
    tok.end_of_generation_ids()
}

pub struct Request<'a> {
    /// Tokens to feed before generating (the new part of the conversation).
    pub prompt: &'a [u32],
    pub max_new: usize,
    pub stop_ids: &'a [u32],
    /// Text that ends generation when generated; never shown.
    pub stop_strings: &'a [String],
    /// Checked before every step; `true` ends the reply.
    pub interrupted: &'a dyn Fn() -> bool,
    /// The output must satisfy this (`--json`, `--json-schema`, `--regex`,
    /// `--grammar`); each generation starts it afresh.
    pub constraint: Option<&'a CompiledConstraint>,
    /// Draft tokens and verify them in batched steps. Under a constraint
    /// each row of a step is masked before it is judged, the mask of a row
    /// after a confirmed draft computed in line, and a draft is cut where
    /// the constraint would refuse it.
    pub speculation: Speculation,
}

/// Runs one generation. `history` holds every token in the engine's cache
/// (for the repetition penalty) and is extended with the prompt and every
/// fed token. `emit` receives text as soon as it is complete.
pub fn generate(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    req: &Request<'_>,
    history: &mut Vec<u32>,
    emit: &mut dyn FnMut(&str),
) -> Result<Decoded> {
    let start = Instant::now();
    let logits = engine.forward(req.prompt, LogitsWanted::Last)?;
    history.extend_from_slice(req.prompt);
    let prefill_secs = start.elapsed().as_secs_f64();
    let mut decoded = decode(engine, tok, sampler, logits, req, history, emit)?;
    decoded.stats.prompt_tokens = req.prompt.len();
    decoded.stats.prefill_secs = prefill_secs;
    Ok(decoded)
}

/// Where a stop string cut the generated text, so that a caller keeping
/// the KV cache (chat) can take back what was fed past it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopCut {
    /// How many of the reply's tokens lie wholly before the stop string.
    pub tokens_before: usize,
    /// Text between those tokens' end and the stop string (part of a token
    /// that also began the stop string; usually empty).
    pub text_between: String,
}

/// What [`decode`] did.
#[derive(Clone, Debug)]
pub struct Decoded {
    pub stats: GenerationStats,
    /// Set when a stop string ended the text.
    pub cut: Option<StopCut>,
    /// How the output constraint went, when there was one.
    pub constraint: Option<ConstraintReport>,
    /// Reply tokens chosen but not fed: the last one, when the limit came
    /// right after it (nothing would read its logits). A stop token, the
    /// token that completed a stop string and the one a full context
    /// could not take are in neither list.
    pub unfed: Vec<u32>,
}

/// The decoding half of [`generate`], for a caller that fed the prompt
/// itself (chat feeds it in pieces with progress): starts from `logits`,
/// those of the last token in the engine, which `history` must end with.
/// `req.prompt` is not fed; the stats count no prompt. On return the
/// engine holds exactly `history`, extended with the reply's fed tokens:
/// drafted tokens that were not taken are gone from its cache.
pub fn decode(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    logits: Vec<f32>,
    req: &Request<'_>,
    history: &mut Vec<u32>,
    emit: &mut dyn FnMut(&str),
) -> Result<Decoded> {
    let params = GenParams {
        sampling: *sampler.config(),
        max_tokens: req.max_new,
        stop_strings: Arc::from(req.stop_strings),
        stop_ids: Arc::from(req.stop_ids),
        ..GenParams::read_only()
    };
    // The sampler goes on to the next reply (chat): it is lent to this one.
    let lent = std::mem::replace(sampler, Sampler::new(params.sampling, 0));
    let base = engine.position();
    let mut generation = Generation::new(tok, params, lent, history)
        .with_speculation(req.speculation)
        .with_context_left(engine.capacity().saturating_sub(base));
    if let Some(constraint) = req.constraint {
        generation = generation.with_constraint(constraint.start(), overlap_from_env());
    }
    let start = Instant::now();
    let mut show = |piece: Piece| emit(&piece.text);
    // Reply tokens in the engine's cache: confirmed drafts are, the rest
    // of a step's drafts are taken back before the next step.
    let mut fed = 0;
    let mut rows = logits;
    let width = rows.len();
    let looped: Result<StopReason> = loop {
        let judged = generation.judge(&mut rows, req.interrupted, &mut show);
        fed += judged.confirmed;
        let next = match judged.outcome {
            Outcome::Feed(next) => next,
            Outcome::Finished(reason) => break Ok(reason),
        };
        engine.truncate(base + fed);
        // After the chosen token and its draft the cache must still fit.
        let room = engine.capacity().saturating_sub(base + fed + 1);
        let mut step = vec![next];
        // The draft model (`--spec mtp`) drafts from the cache as it is
        // now: the accepted tokens, `next` not yet fed.
        let mut model = |last: u32, k: usize| engine.draft(last, k, None);
        match generation.draft_with(room, &mut model) {
            Ok(drafts) => step.extend_from_slice(drafts),
            Err(e) => break Err(e),
        }
        let wanted = if step.len() > 1 {
            LogitsWanted::All
        } else {
            LogitsWanted::Last
        };
        let began = Instant::now();
        // The last step's logits are read: this step writes over them.
        engine.reuse_logits(std::mem::take(&mut rows));
        rows = match generation.alongside(|| engine.forward(&step, wanted)) {
            Ok(rows) => rows,
            Err(e) => break Err(e),
        };
        let rows_wanted = if wanted == LogitsWanted::All {
            step.len()
        } else {
            1
        };
        if rows.len() != rows_wanted * width {
            break Err(anyhow::anyhow!(
                "internal error: the engine returned {} logits for {rows_wanted} rows of {width}",
                rows.len()
            ));
        }
        generation.step_done(step.len(), began.elapsed().as_secs_f64());
        fed += 1;
    };
    // Drafted tokens fed past the end of the reply leave the cache.
    engine.truncate(base + fed);
    let stop = match looped {
        Ok(stop) => stop,
        Err(e) => {
            // The sampler goes back also when the step failed.
            *sampler = generation.into_parts().0;
            return Err(e);
        }
    };
    let reply = generation.reply_tokens();
    history.extend_from_slice(&reply[..fed]);
    let unfed = match stop {
        StopReason::Limit => reply[fed..].to_vec(),
        // The token that completed a stop string (or a check) is not part
        // of the reply's tokens to keep, nor one a full context could not
        // take; any other end comes after its last token was fed.
        _ => Vec::new(),
    };
    let generated = generation.generated();
    let cut = generation.stop_cut();
    let spec = generation.spec_stats();
    let (sampler_back, constraint) = generation.into_parts();
    *sampler = sampler_back;
    Ok(Decoded {
        stats: GenerationStats {
            prompt_tokens: 0,
            prefill_secs: 0.0,
            generated,
            decode_secs: start.elapsed().as_secs_f64(),
            stop,
            spec,
        },
        cut,
        constraint,
        unfed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;
    use crate::sample::SamplerConfig;
    use crate::speculative::DraftOptions;
    use crate::tokenizer::TokenKind;
    use std::cell::Cell;

    /// Letters a..j, then <bos> and <eos>.
    const LETTERS: usize = 10;
    const BOS: u32 = 10;
    const EOS: u32 = 11;
    const VOCAB: usize = 12;

    fn tokenizer() -> Tokenizer {
        let letters = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
        let mut pieces: Vec<(&str, TokenKind)> =
            letters.iter().map(|l| (*l, TokenKind::Normal)).collect();
        pieces.push(("<bos>", TokenKind::Control));
        pieces.push(("<eos>", TokenKind::Control));
        Tokenizer::for_tests(&pieces)
    }

    /// A language model whose logits after each position depend on every
    /// token before it (a hash of the whole prefix), so a cache holding a
    /// rejected draft, or missing a token, changes every later row. Beside
    /// that noise it favours the letter after the last one, so the text
    /// repeats enough for drafts to be accepted and rejected.
    struct HashLm {
        seen: Vec<u32>,
        capacity: usize,
        config: ModelConfig,
        /// Tokens fed per forward call, to check the steps' sizes.
        calls: Vec<usize>,
        /// Draft rounds run.
        draft_rounds: usize,
    }

    impl HashLm {
        fn new(capacity: usize) -> HashLm {
            HashLm {
                seen: Vec::new(),
                capacity,
                config: crate::model::presets::shape("gemma3-270m").expect("known shape"),
                calls: Vec::new(),
                draft_rounds: 0,
            }
        }

        fn row(&self) -> Vec<f32> {
            Self::row_after(&self.seen)
        }

        fn hash(prefix: &[u32]) -> u64 {
            prefix.iter().fold(0x1234_5678u64, |h, &t| {
                (h ^ u64::from(t)).wrapping_mul(0x100_0000_01B3)
            })
        }

        /// The logits after `prefix`.
        fn row_after(prefix: &[u32]) -> Vec<f32> {
            let h = Self::hash(prefix);
            let last = *prefix.last().unwrap_or(&0) as usize;
            (0..VOCAB)
                .map(|v| {
                    let noise = ((h.rotate_left(v as u32 * 5) >> 40) % 1000) as f32 / 400.0;
                    let favoured = if v == (last + 1) % LETTERS { 3.0 } else { 0.0 };
                    // The end of text is possible but rare.
                    let eos = if v == EOS as usize { -1.5 } else { 0.0 };
                    if v == BOS as usize {
                        f32::NEG_INFINITY
                    } else {
                        favoured + noise + eos
                    }
                })
                .collect()
        }
    }

    impl Engine for HashLm {
        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn position(&self) -> usize {
            self.seen.len()
        }
        fn capacity(&self) -> usize {
            self.capacity
        }
        fn truncate(&mut self, len: usize) {
            self.seen.truncate(len);
        }
        fn forward(&mut self, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
            if self.seen.len() + tokens.len() > self.capacity {
                anyhow::bail!("over capacity");
            }
            self.calls.push(tokens.len());
            let mut rows = Vec::new();
            for &t in tokens {
                self.seen.push(t);
                let row = self.row();
                if wanted == LogitsWanted::All {
                    rows.extend(row);
                } else {
                    rows = row;
                }
            }
            Ok(rows)
        }

        // This fake's hidden states are its logits (an identity LM head).
        fn final_hidden(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.forward(tokens, LogitsWanted::All)
        }

        fn can_draft(&self) -> bool {
            true
        }

        /// A draft model that reads the cache as it is: the argmax after
        /// the cache, `token` and the drafts so far, but one guess in four
        /// (by a hash of that prefix) the letter after it, so that drafts
        /// are both confirmed and refused.
        fn draft(
            &mut self,
            token: u32,
            k: usize,
            logits: Option<&mut Vec<f32>>,
        ) -> Result<Vec<u32>> {
            assert!(logits.is_none(), "the loop asks for tokens only");
            let mut prefix = self.seen.clone();
            prefix.push(token);
            let mut drafts = Vec::with_capacity(k);
            for _ in 0..k {
                let row = Self::row_after(&prefix);
                let best = crate::engine::ops::argmax(&row) as u32;
                let guess = if Self::hash(&prefix).is_multiple_of(4) {
                    (best + 1) % LETTERS as u32
                } else {
                    best
                };
                prefix.push(guess);
                drafts.push(guess);
            }
            self.draft_rounds += 1;
            Ok(drafts)
        }
    }

    #[derive(Clone)]
    struct Setup {
        sampling: SamplerConfig,
        seed: u64,
        capacity: usize,
        max_new: usize,
        stop_ids: Vec<u32>,
        stop_strings: Vec<String>,
        /// Raise the interrupt once this many pieces were emitted.
        interrupt_after: Option<usize>,
    }

    impl Default for Setup {
        fn default() -> Self {
            Setup {
                sampling: SamplerConfig::greedy(),
                seed: 1,
                capacity: 1000,
                max_new: 200,
                stop_ids: Vec::new(),
                stop_strings: Vec::new(),
                interrupt_after: None,
            }
        }
    }

    struct Outcome {
        text: String,
        decoded: Decoded,
        history: Vec<u32>,
        calls: Vec<usize>,
    }

    /// Always drafting (step cost 0), so every kind of step happens.
    fn eager() -> Speculation {
        Speculation::Ngram(DraftOptions {
            step_cost: Some(0.0),
            ..DraftOptions::default()
        })
    }

    fn run(setup: &Setup, speculation: Speculation) -> Outcome {
        let tok = tokenizer();
        let mut engine = HashLm::new(setup.capacity);
        let mut sampler = Sampler::new(setup.sampling, setup.seed);
        // A prompt with repeats, so the first drafts come from it.
        let prompt = [BOS, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5];
        let emitted = Cell::new(0);
        let interrupted = || setup.interrupt_after.is_some_and(|n| emitted.get() >= n);
        let mut history = Vec::new();
        let mut text = String::new();
        let decoded = generate(
            &mut engine,
            &tok,
            &mut sampler,
            &Request {
                prompt: &prompt,
                max_new: setup.max_new,
                stop_ids: &setup.stop_ids,
                stop_strings: &setup.stop_strings,
                interrupted: &interrupted,
                constraint: None,
                speculation,
            },
            &mut history,
            &mut |piece| {
                emitted.set(emitted.get() + 1);
                text.push_str(piece)
            },
        )
        .expect("generation runs");
        assert_eq!(
            engine.seen, history,
            "the cache holds exactly the history: no rejected draft, nothing missing"
        );
        Outcome {
            text,
            decoded,
            history,
            calls: engine.calls,
        }
    }

    /// Runs with and without speculation and checks they agree in every
    /// respect but the step sizes; returns the speculative run.
    fn same_either_way(setup: &Setup) -> Outcome {
        let off = run(setup, Speculation::Off);
        let on = run(setup, eager());
        assert_eq!(on.text, off.text);
        assert_eq!(on.history, off.history);
        assert_eq!(on.decoded.cut, off.decoded.cut);
        assert_eq!(on.decoded.stats.stop, off.decoded.stats.stop);
        assert_eq!(on.decoded.stats.generated, off.decoded.stats.generated);
        assert_eq!(off.decoded.stats.spec, None);
        assert!(off.calls[1..].iter().all(|&m| m == 1));
        let spec = on.decoded.stats.spec.expect("speculation stats");
        assert_eq!(spec.steps, on.calls.len() - 1, "every decode step counted");
        assert_eq!(
            spec.drafted,
            on.calls[1..].iter().map(|m| m - 1).sum::<usize>(),
            "every fed draft counted"
        );
        on
    }

    #[test]
    fn greedy_and_seeded_sampling_are_unchanged_by_speculation() {
        let configs = [
            SamplerConfig::greedy(),
            SamplerConfig {
                temperature: 0.8,
                ..SamplerConfig::default()
            },
            SamplerConfig {
                temperature: 1.0,
                top_k: 5,
                top_p: 0.9,
                min_p: 0.0,
                repeat_penalty: 1.3,
                repeat_last_n: 6,
            },
        ];
        let (mut drafted, mut accepted) = (0, 0);
        for sampling in configs {
            for seed in 0..8 {
                let on = same_either_way(&Setup {
                    sampling,
                    seed,
                    ..Setup::default()
                });
                let spec = on.decoded.stats.spec.expect("stats");
                drafted += spec.drafted;
                accepted += spec.accepted;
            }
        }
        // The test means something only if drafts were both taken and refused.
        assert!(accepted > 100, "{accepted} of {drafted} accepted");
        assert!(accepted < drafted, "{accepted} of {drafted} accepted");
    }

    #[test]
    fn every_way_of_stopping_is_unchanged_by_speculation() {
        let sampled = SamplerConfig {
            temperature: 0.9,
            ..SamplerConfig::default()
        };
        for seed in 0..6 {
            for sampling in [SamplerConfig::greedy(), sampled] {
                let base = Setup {
                    sampling,
                    seed,
                    ..Setup::default()
                };
                // -n in the middle of a draft.
                for max_new in [1, 2, 7, 13] {
                    let on = same_either_way(&Setup {
                        max_new,
                        ..base.clone()
                    });
                    assert_eq!(on.decoded.stats.stop, StopReason::Limit);
                    assert_eq!(on.decoded.stats.generated, max_new);
                }
                // The context's end.
                for capacity in [12, 15, 40] {
                    let on = same_either_way(&Setup {
                        capacity,
                        ..base.clone()
                    });
                    assert_eq!(on.decoded.stats.stop, StopReason::ContextFull);
                    assert!(on.calls.iter().all(|&m| m > 0));
                }
                // Stop tokens, including one the prompt holds (drafts can
                // propose it).
                same_either_way(&Setup {
                    stop_ids: vec![EOS, 7],
                    ..base.clone()
                });
                // Stop strings spanning tokens.
                for stop in ["cd", "hij", "ja"] {
                    let on = same_either_way(&Setup {
                        stop_strings: vec![stop.to_string()],
                        ..base.clone()
                    });
                    assert_eq!(on.decoded.stats.stop, StopReason::StopString);
                }
                // Ctrl-C after some pieces.
                for after in [1, 5, 9] {
                    let on = same_either_way(&Setup {
                        interrupt_after: Some(after),
                        ..base.clone()
                    });
                    assert_eq!(on.decoded.stats.stop, StopReason::Interrupted);
                    assert_eq!(on.decoded.stats.generated, after);
                }
            }
        }
    }

    /// The draft model's loop (`--spec mtp`): greedy and seeded sampling
    /// give the same text as without it, drafts both confirmed and
    /// refused, one round per drafted step.
    #[test]
    fn a_draft_model_changes_nothing_but_the_steps() {
        let mtp = Speculation::Mtp(DraftOptions {
            step_cost: Some(0.0),
            ..DraftOptions::default()
        });
        let (mut drafted, mut accepted) = (0, 0);
        for sampling in [
            SamplerConfig::greedy(),
            SamplerConfig {
                temperature: 0.8,
                ..SamplerConfig::default()
            },
        ] {
            for seed in 0..6 {
                for max_new in [1, 9, 200] {
                    let setup = Setup {
                        sampling,
                        seed,
                        max_new,
                        stop_ids: vec![EOS],
                        ..Setup::default()
                    };
                    let off = run(&setup, Speculation::Off);
                    let on = run(&setup, mtp);
                    assert_eq!(on.text, off.text);
                    assert_eq!(on.history, off.history);
                    assert_eq!(on.decoded.stats.stop, off.decoded.stats.stop);
                    let spec = on.decoded.stats.spec.expect("stats");
                    assert_eq!(
                        spec.drafted,
                        on.calls[1..].iter().map(|m| m - 1).sum::<usize>(),
                        "every drafted token was fed"
                    );
                    drafted += spec.drafted;
                    accepted += spec.accepted;
                }
            }
        }
        assert!(accepted > 100, "{accepted} of {drafted} accepted");
        assert!(accepted < drafted, "{accepted} of {drafted} accepted");
    }

    #[test]
    fn steps_never_exceed_the_draft_limit_or_the_context() {
        let on = same_either_way(&Setup {
            capacity: 60,
            max_new: 500,
            ..Setup::default()
        });
        assert!(on.calls[1..].iter().all(|&m| m <= 1 + 8), "{:?}", on.calls);
        assert!(on.calls[1..].iter().any(|&m| m > 1), "{:?}", on.calls);
        assert_eq!(on.history.len(), 60);
    }

    #[test]
    fn the_summary_names_the_speculation_figures() {
        let mut stats = GenerationStats {
            prompt_tokens: 10,
            prefill_secs: 1.0,
            generated: 30,
            decode_secs: 1.0,
            stop: StopReason::Limit,
            spec: None,
        };
        assert!(!stats.summary().contains("spec"));
        stats.spec = Some(SpecStats {
            steps: 12,
            drafted: 40,
            accepted: 18,
        });
        let line = stats.summary();
        assert!(
            line.contains("spec: drafted 40, accepted 18 (45%), 2.50 tok/step"),
            "{line}"
        );
    }
}
