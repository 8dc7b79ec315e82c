//! Runs the commands the README shows. Every command in a ```sh block is
//! either run through the real binary (and must exit with 0) or listed in
//! `SKIPPED` with the reason; a command that is neither fails the test, so
//! a new README example has to be classified here.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Commands not run, matched by prefix, each with why.
const SKIPPED: &[(&str, &str)] = &[
    (
        "cargo test --release",
        "the whole test suite; this test is part of it",
    ),
    (
        "cargo install --path .",
        "installs into ~/.cargo/bin: a change outside the repository",
    ),
    (
        "pulsar chat",
        "interactive: reads turns from the terminal (tests/cli_chat.rs drives it)",
    ),
    (
        "pulsar serve",
        "a server that runs until stopped (tests/serve.rs drives it)",
    ),
    (
        "curl ",
        "talks to the `pulsar serve` above, which is not started here",
    ),
    (
        "pulsar bench --pp 512 --tg 128",
        "a full benchmark on the real model: seconds of both cores, which would disturb other measurements; the --shape example below runs the same command",
    ),
    (
        "llama-bench ",
        "llama.cpp's benchmark, not part of this repository",
    ),
];

/// How the README spells the binary: `cargo run --release --` (the set-up
/// command) or `pulsar` (once installed).
const PREFIXES: &[&str] = &["cargo run --release -- ", "pulsar "];

/// The default model's path as the README writes it; replaced by where
/// `default_model_path` keeps it (the cache may be moved by
/// `PULSAR_CACHE_DIR`, or the model named by `PULSAR_MODEL`).
const README_MODEL_PATH: &str = "~/.cache/pulsar/gemma-3-270m-q4_k_m.gguf";

/// The commands of every ```sh block, continuation lines joined and
/// whole-line comments dropped.
fn sh_commands(readme: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in readme.lines() {
        let trimmed = line.trim();
        if !in_sh {
            in_sh = trimmed == "```sh";
            continue;
        }
        if trimmed.starts_with("```") {
            assert!(
                pending.is_empty(),
                "a ```sh block ends in a continuation line"
            );
            in_sh = false;
            continue;
        }
        if pending.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            pending.push_str(head.trim_end());
            pending.push(' ');
            continue;
        }
        pending.push_str(trimmed);
        commands.push(std::mem::take(&mut pending));
    }
    assert!(!in_sh, "a ```sh block is not closed");
    commands
}

/// Splits a command into words as sh does for the quoting the README
/// uses: single quotes, double quotes and backslash escapes.
fn shell_words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = command.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    word.push(c);
                }
            }
            '"' => {
                in_word = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        c => word.push(c),
                    }
                }
            }
            '\\' => {
                in_word = true;
                word.extend(chars.next());
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                assert!(
                    !"$`|&;<>*?".contains(c),
                    "`{command}` uses shell syntax ({c}) this test does not interpret"
                );
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

fn run(command: &str, args: &str, model: &Path, dir: &Path) {
    let args: Vec<String> = shell_words(args)
        .into_iter()
        .map(|w| {
            if w == README_MODEL_PATH {
                model.display().to_string()
            } else {
                assert!(
                    !w.starts_with('~'),
                    "`{command}`: a path under ~ this test does not map"
                );
                w
            }
        })
        .collect();
    eprintln!("running: {command}");
    let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(&args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("start pulsar");
    assert!(
        out.status.success(),
        "`{command}` exited with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn readme_commands_run_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("read README.md");
    let commands = sh_commands(&readme);

    // The two set-up commands, exactly.
    for setup in [
        r#"cargo run --release -- run -p "The capital of France is" -n 32 -t 0 --raw"#,
        "cargo test --release",
    ] {
        assert!(
            commands.iter().any(|c| c == setup),
            "the README's set-up no longer shows `{setup}`"
        );
    }

    let model: PathBuf = pulsar::model::fetch::default_model_path().expect("default model");
    // Commands run in one scratch folder, in README order, so a file one
    // writes (`convert -o`) is there for the next.
    let dir = tempfile::Builder::new()
        .prefix("pulsar-readme-")
        .tempdir()
        .expect("create a temp folder");

    let mut ran = 0;
    let mut used_skips = vec![false; SKIPPED.len()];
    for command in &commands {
        if let Some(i) = SKIPPED.iter().position(|(p, _)| command.starts_with(p)) {
            eprintln!("skipped: {command}\n  because: {}", SKIPPED[i].1);
            used_skips[i] = true;
            continue;
        }
        let Some(args) = PREFIXES.iter().find_map(|p| command.strip_prefix(p)) else {
            panic!(
                "the README shows `{command}`, which is neither a pulsar command nor in SKIPPED: \
                 add it to SKIPPED with the reason, or make it a pulsar command"
            );
        };
        run(command, args, &model, dir.path());
        ran += 1;
    }
    for ((prefix, _), used) in SKIPPED.iter().zip(used_skips) {
        assert!(
            used,
            "SKIPPED lists `{prefix}`, which the README no longer shows"
        );
    }
    assert!(ran >= 5, "only {ran} README commands ran");
    eprintln!(
        "{ran} README commands ran, {} skipped",
        commands.len() - ran
    );
}

#[test]
fn shell_words_follow_sh_quoting() {
    assert_eq!(
        shell_words(r#"run -p "a \"b\" c" --x '{"k": 1}' d\ e"#),
        ["run", "-p", r#"a "b" c"#, "--x", r#"{"k": 1}"#, "d e"]
    );
    assert_eq!(
        sh_commands("```sh\n# c\na \\\n  b\n\nc\n```\n```\nnot sh\n```\n"),
        ["a b", "c"]
    );
}
