//! Chat keeps the KV cache across turns: a turn's logits after reusing the
//! cache must equal the logits of prefilling the whole conversation at once.

mod common;

use common::*;
use pulsar::chat::conversation::{ContextPolicy, Conversation};
use pulsar::chat::reply::{self, ReplySettings};
use pulsar::chat::turns::TurnEncoder;
use pulsar::chat_template::ChatTemplate;
use pulsar::commands::run::load_tokenizer;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::generate::StopReason;
use pulsar::model::source::ModelSource;
use pulsar::sample::{Sampler, SamplerConfig};
use pulsar::speculative::{DraftOptions, Speculation};
use std::cell::Cell;

const TOLERANCE: f32 = 1e-5;

/// Feeds a made-up reply the way the generation loop does (one token at a
/// time, outside the conversation), then the end of turn.
fn answer(conv: &mut Conversation, engine: &mut dyn Engine, reply: &[u32], end: &[u32]) {
    for &t in reply {
        engine.forward(&[t], LogitsWanted::Last).unwrap();
    }
    conv.push_fed(engine, reply).unwrap();
    conv.push(end);
    conv.sync(engine, LogitsWanted::Last).unwrap();
}

/// The last `rows` rows of logits from prefilling `tokens` in a new engine.
fn fresh_rows(src: &ModelSource, tokens: &[u32], rows: usize) -> Vec<f32> {
    let mut engine = ReferenceEngine::load(src).unwrap();
    let all = engine.forward(tokens, LogitsWanted::All).unwrap();
    let vocab = engine.config().vocab_size;
    all[all.len() - rows * vocab..].to_vec()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let (diff, at) = max_abs_diff(got, want);
    assert!(diff <= TOLERANCE, "{what}: max difference {diff} at {at}");
}

#[test]
fn second_turn_on_the_default_model_matches_a_whole_prefill() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = ModelSource::open(&path).unwrap();
    let tok = load_tokenizer(&src).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::gemma(), Some("Answer briefly."), None).unwrap();
    let mut engine = ReferenceEngine::load(&src).unwrap();
    let mut conv = Conversation::new(enc.prefix(&tok), 4096);

    conv.begin_exchange(&enc.user_turn(&tok, "What is the capital of France?", true));
    conv.sync(&mut engine, LogitsWanted::Last).unwrap();
    let reply = tok.encode_untrusted("The capital of France is Paris.", false);
    answer(&mut conv, &mut engine, &reply, &enc.model_end(&tok));
    let cached = conv.cached();

    let second = enc.user_turn(&tok, "And of Italy?", false);
    conv.begin_exchange(&second);
    let reused = conv.sync(&mut engine, LogitsWanted::All).unwrap();
    assert_eq!(
        reused.len(),
        second.len() * engine.config().vocab_size,
        "only the second turn was fed"
    );
    assert_eq!(engine.position(), cached + second.len());
    assert_close(
        &reused,
        &fresh_rows(&src, conv.tokens(), second.len()),
        "second turn",
    );
}

#[test]
fn turns_fed_again_after_a_drop_match_a_whole_prefill() {
    // Vocabulary of 512 and no tokenizer: turns are written as ids.
    let src = ModelSource::open(&oracle_dir().join("tiny-gemma3-f32")).unwrap();
    let mut engine = ReferenceEngine::load(&src).unwrap();
    let end = [106, 107];
    let mut conv = Conversation::new(vec![2], 64);
    let turns: [(&[u32], &[u32]); 4] = [
        (&[105, 30, 31, 32, 106, 107, 105, 40], &[50, 51, 52, 53]),
        (&[105, 33, 34, 106, 107, 105, 40], &[54, 55, 56, 57, 58, 59]),
        (&[105, 35, 36, 37, 106, 107, 105, 40], &[60, 61, 62]),
        (
            &[105, 38, 39, 106, 107, 105, 40],
            &[63, 64, 65, 66, 67, 68, 69],
        ),
    ];
    for (user, reply) in turns {
        conv.make_room(
            user.len() + reply.len() + end.len(),
            ContextPolicy::DropOldest,
        )
        .unwrap();
        conv.begin_exchange(user);
        conv.sync(&mut engine, LogitsWanted::Last).unwrap();
        answer(&mut conv, &mut engine, reply, &end);
    }
    let before = conv.len();
    let next = [105, 41, 42, 43, 44, 45, 46, 106, 107, 105, 40];
    let dropped = conv
        .make_room(next.len() + 20, ContextPolicy::DropOldest)
        .unwrap();
    assert!(dropped >= 1, "the context of 64 should have forced a drop");
    assert!(conv.len() < before);
    assert_eq!(
        &conv.tokens()[..9],
        [2, 105, 30, 31, 32, 106, 107, 105, 40],
        "first exchange kept"
    );
    conv.begin_exchange(&next);
    let refed = conv.len() - conv.cached();
    let logits = conv.sync(&mut engine, LogitsWanted::All).unwrap();
    assert!(
        refed > next.len(),
        "kept turns after the cut were fed again"
    );
    assert_close(
        &logits,
        &fresh_rows(&src, conv.tokens(), refed),
        "after a drop",
    );
}

#[test]
fn an_interrupted_reply_still_closes_its_turn() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = ModelSource::open(&path).unwrap();
    let tok = load_tokenizer(&src).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::gemma(), None, None).unwrap();
    let mut engine = ReferenceEngine::load(&src).unwrap();
    let mut conv = Conversation::new(enc.prefix(&tok), 4096);
    let prefix = conv.len();
    let mut sampler = Sampler::new(SamplerConfig::greedy(), 0);
    let (stops, end) = (enc.stop_ids(&tok), enc.model_end(&tok));
    // "Ctrl-C" once five tokens were streamed.
    let streamed = Cell::new(0);
    let interrupted = || streamed.get() >= 5;
    let settings = ReplySettings {
        max_new: 200,
        stop_ids: &stops,
        stop_strings: &[],
        model_end: &end,
        interrupted: &interrupted,
        constraint: None,
        // Drafts are fed and rolled back in the chat's kept cache (a fixed
        // step cost keeps the reference engine drafting).
        speculation: Speculation::Ngram(DraftOptions {
            step_cost: Some(0.05),
            ..DraftOptions::default()
        }),
    };
    let user = enc.user_turn(&tok, "Once upon a time there was a dragon.", true);
    let mut text = String::new();
    let report = reply::reply(
        &mut conv,
        &mut engine,
        &tok,
        &mut sampler,
        &user,
        &settings,
        &mut |_, _| {},
        &mut |piece| {
            streamed.set(streamed.get() + 1);
            text.push_str(piece)
        },
    )
    .unwrap();
    assert_eq!(report.stats.stop, StopReason::Interrupted);
    assert_eq!(report.stats.generated, 5);
    assert_eq!(report.stats.prompt_tokens, prefix + user.len());
    assert!(!text.is_empty());
    // The prefix, the turn, five reply tokens, then the end of turn, all cached.
    assert_eq!(conv.len(), prefix + user.len() + 5 + end.len());
    assert!(conv.tokens().ends_with(&end));
    assert_eq!(engine.position(), conv.len());
    assert_eq!(conv.cached(), conv.len());

    // Ctrl-C before the next reply begins takes the turn back.
    let held = conv.tokens().to_vec();
    let settings = ReplySettings {
        interrupted: &|| true,
        constraint: None,
        ..settings
    };
    let user = enc.user_turn(&tok, "Go on.", false);
    let report = reply::reply(
        &mut conv,
        &mut engine,
        &tok,
        &mut sampler,
        &user,
        &settings,
        &mut |_, _| {},
        &mut |piece| panic!("no reply expected, got {piece:?}"),
    )
    .unwrap();
    assert!(report.abandoned);
    assert_eq!(report.stats.generated, 0);
    assert_eq!(conv.tokens(), held);
    assert_eq!(conv.exchanges(), 1);
}

#[test]
fn a_reply_ended_by_a_stop_string_is_cut_there_in_the_cache() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = ModelSource::open(&path).unwrap();
    let tok = load_tokenizer(&src).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::dialogue(), None, None).unwrap();
    let mut engine = ReferenceEngine::load(&src).unwrap();
    let mut conv = Conversation::new(enc.prefix(&tok), 4096);
    let mut sampler = Sampler::new(SamplerConfig::greedy(), 0);
    let (stops, end) = (enc.stop_ids(&tok), enc.model_end(&tok));
    let stop_strings = enc.stop_strings(&[]);
    let settings = ReplySettings {
        max_new: 64,
        stop_ids: &stops,
        stop_strings: &stop_strings,
        model_end: &end,
        interrupted: &|| false,
        constraint: None,
        // Drafts are fed and rolled back in the chat's kept cache (a fixed
        // step cost keeps the reference engine drafting).
        speculation: Speculation::Ngram(DraftOptions {
            step_cost: Some(0.05),
            ..DraftOptions::default()
        }),
    };
    let user = enc.user_turn(&tok, "What is the capital of France?", true);
    let mut text = String::new();
    let report = reply::reply(
        &mut conv,
        &mut engine,
        &tok,
        &mut sampler,
        &user,
        &settings,
        &mut |_, _| {},
        &mut |piece| text.push_str(piece),
    )
    .unwrap();
    assert_eq!(report.stats.stop, StopReason::StopString, "{text:?}");
    assert!(text.contains("Paris"), "{text:?}");
    assert!(
        !text.contains("User"),
        "the stop string was shown: {text:?}"
    );
    // The cache holds the reply up to the stop string and the end of turn:
    // the tokens that began "\nUser:" were taken back.
    let held = tok.decode(conv.tokens());
    assert!(
        held.ends_with(&format!("Assistant:{text}\n")),
        "{held:?} should end with the shown reply and the end of turn"
    );
    assert_eq!(engine.position(), conv.len());

    // The next turn's logits, on the cut cache, equal a whole prefill.
    let second = enc.user_turn(&tok, "And of Italy?", false);
    conv.begin_exchange(&second);
    let reused = conv.sync(&mut engine, LogitsWanted::All).unwrap();
    assert_close(
        &reused,
        &fresh_rows(&src, conv.tokens(), second.len()),
        "turn after a stop string",
    );
}
