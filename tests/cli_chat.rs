//! `pulsar chat` through the real binary on the default model: piped turns,
//! /reset, -f with -p, a conversation longer than the context, bad flags,
//! and Ctrl-C under a pseudo-terminal.

use pulsar::chat::turns::TurnEncoder;
use pulsar::chat_template::ChatTemplate;
use pulsar::commands::run::load_tokenizer;
use pulsar::model::source::ModelSource;
use std::io::Write;
use std::process::{Command, Output, Stdio};

/// The engine the tests chat with; flip to "jit" once its kernels are fast.
const ENGINE: &str = "jit";

fn model() -> std::path::PathBuf {
    pulsar::model::fetch::default_model_path().expect("default model")
}

fn chat_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pulsar"));
    cmd.arg("chat")
        .args(args)
        .arg("-m")
        .arg(model())
        .args(["--engine", ENGINE]);
    cmd
}

/// Runs a chat with `input` piped to stdin.
fn chat_piped(args: &[&str], input: &str) -> Output {
    let mut child = chat_command(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary runs");
    let mut stdin = child.stdin.take().expect("stdin is piped");
    stdin.write_all(input.as_bytes()).expect("write stdin");
    drop(stdin);
    child.wait_with_output().expect("binary finishes")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The per-reply stats lines on stderr, as (prompt tokens, generated tokens).
fn stats_lines(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("pulsar: [prompt "))
        .map(|rest| {
            let prompt = rest.split(' ').next().expect("prompt count");
            let generated = rest
                .split("generated ")
                .nth(1)
                .and_then(|g| g.split(' ').next())
                .expect("generated count");
            (
                prompt.parse().expect("a number"),
                generated.parse().expect("a number"),
            )
        })
        .collect()
}

fn assert_ok(out: &Output) -> String {
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn two_piped_turns_give_two_replies_and_two_stats_lines() {
    let out = chat_piped(
        &["-t", "0", "-n", "16"],
        "Hello, who are you?\nTell me about the sea.\n",
    );
    let stderr = assert_ok(&out);
    let stats = stats_lines(&stderr);
    assert_eq!(stats.len(), 2, "{stderr}");
    let stdout = text(&out.stdout);
    assert!(stdout.trim().len() > 4, "replies expected, got {stdout:?}");
    // BOS and the opening of the first turn were fed at startup, so the
    // first prompt is the rest of the first turn; the second reuses the
    // cache, so only its own turn is fed (the end of the first reply was
    // fed right after it).
    let path = model();
    let tok = load_tokenizer(&ModelSource::open(&path).unwrap()).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::dialogue(), None, None).unwrap();
    let turn = |m: &str, first: bool| enc.user_turn(&tok, m, first).len();
    assert_eq!(stats[0].0, turn("Hello, who are you?", true), "{stderr}");
    assert_eq!(
        stats[1].0,
        turn("Tell me about the sea.", false),
        "{stderr}"
    );
}

#[test]
fn reset_replies_like_a_fresh_process() {
    let question = "Tell me a story about a cat.\n";
    for sampling in [&["-t", "0"][..], &["-t", "0.9", "-s", "11"][..]] {
        let args = [sampling, &["-n", "20"][..]].concat();
        let fresh = chat_piped(&args, question);
        assert_ok(&fresh);
        let fresh = text(&fresh.stdout);
        assert!(!fresh.trim().is_empty());
        let after_reset = chat_piped(&args, &format!("What is two plus two?\n/reset\n{question}"));
        let stderr = assert_ok(&after_reset);
        assert_eq!(stats_lines(&stderr).len(), 2, "{stderr}");
        assert!(stderr.contains("new conversation"), "{stderr}");
        let both = text(&after_reset.stdout);
        assert!(
            both.len() > fresh.len() && both.ends_with(&fresh),
            "{sampling:?}: after /reset the reply should be the fresh one\nfresh: {fresh:?}\nboth: {both:?}"
        );
    }
}

#[test]
fn file_and_prompt_answer_in_one_turn() {
    // Removed on drop at the end, after both children have exited, even
    // when an assertion fails and unwinds.
    let dir = tempfile::Builder::new()
        .prefix("pulsar-chat-file-")
        .tempdir()
        .expect("temp folder");
    let doc = dir.path().join("ship.txt");
    std::fs::write(
        &doc,
        "The ship was called the Northern Lantern. It sailed from Bergen in 1893 \
         with a crew of eleven and a cargo of dried cod, and it reached Lisbon \
         after forty-one days at sea.\n",
    )
    .unwrap();
    let question = "What was the ship called?";
    let doc = doc.to_str().unwrap();
    // -p must not wait for stdin.
    let out = chat_command(&["-t", "0", "-n", "12", "-f", doc, "-p", question])
        .stdin(Stdio::null())
        .output()
        .expect("binary runs");
    let stderr = assert_ok(&out);
    assert_eq!(stats_lines(&stderr).len(), 1, "{stderr}");
    let reply = text(&out.stdout);
    assert!(!reply.trim().is_empty());
    // The document (about 45 tokens) was fed at startup.
    let start_tokens: usize = stderr
        .split("document: ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no document line: {stderr}"));
    assert!(start_tokens >= 45, "{start_tokens} tokens: {stderr}");

    // The document stays across /reset: the same question gets the same
    // reply before and after, as it does with -p.
    let out = chat_piped(
        &["-t", "0", "-n", "12", "-f", doc],
        &format!("{question}\n/reset\n{question}\n"),
    );
    assert_ok(&out);
    assert_eq!(text(&out.stdout), format!("{reply}{reply}"));
}

#[test]
fn a_conversation_longer_than_the_context_keeps_going() {
    let input: String = (1..=8)
        .map(|i| format!("Tell me fact number {i} about the moon.\n"))
        .collect();
    // In Gemma's turn format the base model never ends a reply, so every
    // reply runs to -n and the exchanges have the sizes counted below.
    let out = chat_piped(
        &[
            "-t",
            "0",
            "-n",
            "40",
            "-c",
            "300",
            "--chat-template",
            "gemma",
        ],
        &format!("{input}/stats\n"),
    );
    let stderr = assert_ok(&out);
    let stats = stats_lines(&stderr);
    assert_eq!(stats.len(), 8, "{stderr}");
    assert!(
        stats.iter().all(|&(_, generated)| generated > 0),
        "every turn got a reply: {stderr}"
    );
    assert!(stderr.contains("context full"), "{stderr}");
    assert!(stderr.contains("dropped the"), "{stderr}");
    // Each exchange is about 60 tokens: with four held, the fifth turn
    // drops the second and third (down to half the context) and the fourth
    // moves, so it is fed again with the new turn.
    assert!(
        stats[1..].iter().any(|&(prompt, _)| prompt > 40),
        "no turn was fed again after a drop: {stderr}"
    );
    let used: usize = stderr
        .lines()
        .find_map(|l| l.strip_prefix("context: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("a /stats context line");
    assert!(
        used <= 300,
        "the conversation holds {used} tokens: {stderr}"
    );

    let out = chat_piped(
        &[
            "-t",
            "0",
            "-n",
            "40",
            "-c",
            "160",
            "--context-full",
            "stop",
            "--chat-template",
            "gemma",
        ],
        &input,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("context is full"), "{stderr}");
    // It says what the need is made of: the room kept for the reply (-n 40,
    // less than half of 160) and how much is left.
    assert!(
        stderr.contains("40 are kept for the reply: -n 40") && stderr.contains("are left"),
        "{stderr}"
    );
    let replies = stats_lines(&stderr).len();
    assert!((1..8).contains(&replies), "{replies} replies: {stderr}");
}

#[test]
fn bad_values_are_refused_clearly() {
    for (args, needle) in [
        (&["--temp=-1"][..], "temperature"),
        (&["--top-p", "1.5"][..], "top-p"),
        (&["-c", "1"][..], "ctx-size"),
        (&["-p", " "][..], "empty"),
    ] {
        let out = chat_command(args)
            .stdin(Stdio::null())
            .output()
            .expect("binary runs");
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn help_shows_the_chat_flags_and_defaults() {
    for args in [&["--help"][..], &["chat", "--help"][..]] {
        let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
            .args(args)
            .output()
            .expect("binary runs");
        let help = text(&out.stdout);
        assert!(out.status.success(), "{args:?}");
        for needle in [
            "--temp <TEMPERATURE>",
            "[default: 0.7]",
            "[default: 40]",
            "--ctx-size",
            "--repeat-penalty",
            "--system",
        ] {
            assert!(help.contains(needle), "{args:?} lacks {needle}:\n{help}");
        }
    }
}

#[test]
fn ctrl_c_mid_reply_returns_to_the_prompt_and_quit_exits_zero() {
    let message = "Once upon a time there was a dragon.";
    // Gemma's turn format, in which the base model never ends its reply:
    // Ctrl-C must come mid-reply.
    let gemma = ["--chat-template", "gemma"];
    // The greedy reply's first words, to know when the reply is under way.
    let head = chat_piped(
        &[&gemma[..], &["-t", "0", "-n", "8"]].concat(),
        &format!("{message}\n"),
    );
    assert_ok(&head);
    let head = text(&head.stdout);
    let first_line = head.trim_start().lines().next().unwrap_or("").to_string();
    let marker: String = first_line.chars().take(12).collect();
    assert!(marker.trim().len() >= 3, "reply starts with {head:?}");
    assert!(
        !message.contains(&marker),
        "{marker:?} would match the echo"
    );

    let max_new = 4000;
    let max_new_text = max_new.to_string();
    let mut cmd =
        chat_command(&[&gemma[..], &["-t", "0", "-n", &max_new_text, "-c", "8192"]].concat());
    cmd.env("TERM", "xterm");
    // Generous: a guard against hanging forever, not a speed requirement.
    let mut p = rexpect::session::spawn_command(cmd, Some(600_000)).expect("spawn under a pty");
    p.exp_string("> ").expect("first prompt");
    p.send_line(message).expect("send message");
    p.exp_string(&marker).expect("reply starts");
    p.send_control('c').expect("send Ctrl-C");
    p.exp_string("stopped by Ctrl-C").expect("the reply stops");
    let (_, generated) = p
        .exp_regex(r"generated \d+ tok")
        .expect("stats line after the stopped reply");
    let generated: usize = generated
        .trim_start_matches("generated ")
        .trim_end_matches(" tok")
        .parse()
        .expect("a count");
    assert!(
        (1..max_new).contains(&generated),
        "stopped mid-reply: {generated} tokens"
    );
    p.exp_string("> ").expect("back at the prompt");
    p.send_line("/quit").expect("send /quit");
    p.exp_eof().expect("program ends");
    match p.process().wait().expect("exit status") {
        rexpect::process::WaitStatus::Exited(_, code) => assert_eq!(code, 0),
        other => panic!("did not exit normally: {other:?}"),
    }
}

/// Ctrl-D at the prompt leaves; Ctrl-C asks once, then leaves (a single
/// Ctrl-C also stops a reply, so one press at the prompt could be a slip).
#[test]
fn ctrl_c_twice_or_ctrl_d_at_the_prompt_exits_zero() {
    for key in ['c', 'd'] {
        let mut cmd = chat_command(&["-t", "0"]);
        cmd.env("TERM", "xterm");
        let mut p = rexpect::session::spawn_command(cmd, Some(600_000)).expect("spawn under a pty");
        p.exp_string("> ").expect("prompt");
        p.send_control(key).expect("send the key");
        if key == 'c' {
            p.exp_string("press Ctrl-C again").expect("asks once");
            p.exp_string("> ").expect("still at the prompt");
            p.send_control('c').expect("send Ctrl-C again");
        }
        p.exp_eof().expect("program ends");
        match p.process().wait().expect("exit status") {
            rexpect::process::WaitStatus::Exited(_, code) => assert_eq!(code, 0, "Ctrl-{key}"),
            other => panic!("Ctrl-{key}: did not exit normally: {other:?}"),
        }
    }
}

/// The first line on stderr, which must say which chat format is used.
fn format_line(stderr: &str) -> &str {
    stderr.lines().next().unwrap_or("")
}

#[test]
fn the_base_model_answers_in_the_dialogue_format_and_stops_at_the_next_user_line() {
    let max_new = 64;
    let out = chat_piped(
        &["-t", "0", "-n", &max_new.to_string()],
        "What is the capital of France?\nAnd what is the capital of Italy?\n",
    );
    let stderr = assert_ok(&out);
    let first = format_line(&stderr);
    assert!(
        first.contains("chat format \"dialogue\"") && first.contains("no chat template"),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    let replies: Vec<&str> = stdout.lines().collect();
    assert_eq!(replies.len(), 2, "one line per reply: {stdout:?}");
    assert!(replies[0].contains("Paris"), "{stdout:?}");
    assert!(!stdout.contains("User:"), "{stdout:?}");
    let stats = stats_lines(&stderr);
    assert_eq!(stats.len(), 2, "{stderr}");
    // Each reply ended at the stop string, long before -n.
    assert!(
        stats
            .iter()
            .all(|&(_, generated)| (1..max_new / 2).contains(&generated)),
        "{stderr}"
    );
    // The second turn was fed alone, on the kept cache.
    let tok = load_tokenizer(&ModelSource::open(&model()).unwrap()).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::dialogue(), None, None).unwrap();
    assert_eq!(
        stats[1].0,
        enc.user_turn(&tok, "And what is the capital of Italy?", false)
            .len(),
        "{stderr}"
    );
}

#[test]
fn chat_template_gemma_restores_the_turn_format() {
    let out = chat_piped(
        &["-t", "0", "-n", "8", "--chat-template", "gemma"],
        "Hello! Who are you?\n",
    );
    let stderr = assert_ok(&out);
    assert!(
        format_line(&stderr).contains("chat format \"gemma\"")
            && format_line(&stderr).contains("--chat-template gemma"),
        "{stderr}"
    );
    let tok = load_tokenizer(&ModelSource::open(&model()).unwrap()).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::gemma(), None, None).unwrap();
    let stats = stats_lines(&stderr);
    assert_eq!(
        stats,
        [(enc.user_turn(&tok, "Hello! Who are you?", true).len(), 8)],
        "the Gemma turn, and (in this format) a reply that runs to -n: {stderr}"
    );

    let out = chat_command(&["--chat-template", "no-such-format", "-p", "Hi"])
        .stdin(Stdio::null())
        .output()
        .expect("binary runs");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("gemma, gemma4, dialogue"), "{stderr}");
}

#[test]
fn the_first_screen_names_the_model_and_the_format() {
    let mut cmd = chat_command(&["-t", "0"]);
    cmd.env("TERM", "xterm");
    let mut p = rexpect::session::spawn_command(cmd, Some(600_000)).expect("spawn under a pty");
    let before = p.exp_string("> ").expect("first prompt");
    assert!(before.contains("chat format \"dialogue\""), "{before}");
    assert!(before.contains("Gemma 3 270m"), "{before}");
    assert!(before.contains("gemma-3-270m-q4_k_m.gguf"), "{before}");
    p.send_line("/quit").expect("send /quit");
    p.exp_eof().expect("program ends");
}

/// A line ending in `\` continues on the next: the two lines are one
/// message (one reply, one stats line), not two.
#[test]
fn a_line_ending_in_a_backslash_continues_the_message() {
    let out = chat_piped(&["-t", "0", "-n", "4"], "Hello, who\\\nare you?\n");
    let stderr = assert_ok(&out);
    let stats = stats_lines(&stderr);
    assert_eq!(stats.len(), 1, "{stderr}");
    let path = model();
    let tok = load_tokenizer(&ModelSource::open(&path).unwrap()).unwrap();
    let enc = TurnEncoder::new(ChatTemplate::dialogue(), None, None).unwrap();
    let joined = enc.user_turn(&tok, "Hello, who\nare you?", true).len();
    assert_eq!(stats[0].0, joined, "{stderr}");
}

#[test]
fn think_needs_a_format_with_a_thinking_switch() {
    let out = chat_command(&["--think", "-p", "Hi"])
        .stdin(Stdio::null())
        .output()
        .expect("binary runs");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--think") && stderr.contains("\"dialogue\"") && stderr.contains("Gemma 4"),
        "{stderr}"
    );
    // Gemma 4's format takes it: the system turn opens with <|think|>.
    let out = chat_command(&[
        "--chat-template",
        "gemma4",
        "--think",
        "-t",
        "0",
        "-n",
        "2",
        "-p",
        "Hi",
    ])
    .stdin(Stdio::null())
    .output()
    .expect("binary runs");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("chat format \"gemma4\""), "{stderr}");
}
