//! Gemma 4's tokenizer (BPE by merge rank, `tokenizer.ggml.model = "gemma4"`):
//! - the real vocabulary (`../shared/oracle/gemma4/ggml-vocab-gemma-4.gguf`)
//!   against llama.cpp's own 46 cases for it, and against extra cases whose
//!   ids come from Hugging Face `tokenizers`
//!   (`tests/data/make_gemma4_tokenizer_cases.py`);
//! - the 512-token stand-in `tokenizer.json` of the same layout;
//! - token kinds, end-of-generation ids, decoding and streaming;
//! - `pulsar tokenize` on the vocabulary-only GGUF;
//! - malformed `gemma4` GGUFs.

use pulsar::model::gguf::GgufFile;
use pulsar::model::gguf_write::GgufWriter;
use pulsar::tokenizer::{TokenKind, Tokenizer};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

fn oracle_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle/gemma4");
    assert!(
        dir.is_dir(),
        "{} is missing: these tests need ../shared/oracle beside the repository",
        dir.display()
    );
    dir
}

fn vocab_gguf() -> PathBuf {
    oracle_dir().join("ggml-vocab-gemma-4.gguf")
}

/// The real Gemma 4 tokenizer, loaded once.
fn gemma4() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let file = GgufFile::open(&vocab_gguf()).expect("open the vocabulary-only GGUF");
        Tokenizer::from_gguf(&file).expect("Gemma 4 tokenizer from GGUF")
    })
}

/// llama.cpp's test texts and their ids (`.inp` / `.out`).
fn llama_cpp_cases() -> Vec<(String, Vec<u32>)> {
    let base = vocab_gguf();
    let read = |ext: &str| {
        let path = base.with_extension(format!("gguf.{ext}"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let (inp, out) = (read("inp"), read("out"));
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(texts.len(), lines.len(), "one line of ids per text");
    texts
        .into_iter()
        .zip(lines)
        .map(|(t, l)| {
            let ids = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (t.to_string(), ids)
        })
        .collect()
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

fn data_cases(name: &str) -> Vec<Case> {
    #[derive(Deserialize)]
    struct File {
        cases: Vec<Case>,
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gemma4_tokenizer")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let f: File = serde_json::from_str(&text).expect("parse the cases file");
    assert!(f.cases.len() >= 10, "{} has too few cases", path.display());
    f.cases
}

/// Encodes (no BOS) and decodes every case; returns the failures.
fn check_cases(tok: &Tokenizer, cases: &[Case]) -> Vec<String> {
    let mut failures = Vec::new();
    for c in cases {
        let got = tok.encode(&c.text, false);
        if got != c.ids {
            failures.push(format!(
                "{} {:?}: ids {got:?}\n  want {:?}",
                c.name, c.text, c.ids
            ));
        }
        let back = tok.decode_with_control(&c.ids);
        if back != c.decoded {
            failures.push(format!(
                "{} {:?}: decoded {back:?} want {:?}",
                c.name, c.text, c.decoded
            ));
        }
    }
    failures
}

#[test]
fn llama_cpp_cases_match_id_for_id_and_round_trip() {
    let tok = gemma4();
    let cases = llama_cpp_cases();
    assert_eq!(
        cases.len(),
        46,
        "llama.cpp ships 46 cases for this vocabulary"
    );
    let mut failures = Vec::new();
    for (i, (text, want)) in cases.iter().enumerate() {
        let got = tok.encode(text, false);
        if &got != want {
            let pieces: Vec<_> = got
                .iter()
                .map(|&id| tok.token_text(id).unwrap_or("?"))
                .collect();
            failures.push(format!(
                "case {i} {text:?}: ids {got:?}\n  want {want:?}\n  pieces {pieces:?}"
            ));
        }
        // Nothing in these texts is lost: decoding gives them back.
        let back = tok.decode_with_control(want);
        if &back != text {
            failures.push(format!("case {i} {text:?}: decodes to {back:?}"));
        }
        let mut stream = tok.stream_decoder();
        let streamed: String =
            want.iter().map(|&id| stream.push(id)).collect::<String>() + &stream.finish();
        if &streamed != text {
            failures.push(format!("case {i} {text:?}: streams to {streamed:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 46 fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn vocab_extra_cases_match_hf_tokenizers() {
    let failures = check_cases(gemma4(), &data_cases("vocab_cases.json"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn bos_examples_from_the_readme() {
    let tok = gemma4();
    assert_eq!(tok.encode("Hello world", true), vec![2, 9259, 1902]);
    assert_eq!(
        tok.encode("The capital of France is", true),
        vec![2, 818, 5279, 529, 7001, 563]
    );
}

#[test]
fn metadata_kinds_and_end_of_generation() {
    let tok = gemma4();
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!((tok.bos_id(), tok.eos_id()), (2, 1));
    let ids = tok.special_ids();
    assert_eq!((ids.unk, ids.pad), (Some(3), Some(0)));
    assert!(tok.add_bos_by_default());
    assert!(
        tok.chat_template().is_some_and(|t| t.contains("<|turn>")),
        "the file carries Gemma 4's chat template"
    );
    let kind = |id| tok.token_kind(id).unwrap();
    for id in [0, 1, 2, 3, 4, 46, 47, 98, 105, 106, 255_999] {
        assert_eq!(kind(id), TokenKind::Control, "{:?}", tok.token_text(id));
    }
    for id in [48, 49, 51, 52, 100, 101] {
        assert_eq!(kind(id), TokenKind::UserDefined, "{:?}", tok.token_text(id));
    }
    // Typed user-defined in the file, a control token (and an end of
    // generation) as in llama.cpp.
    assert_eq!(tok.token_text(50), Some("<|tool_response>"));
    assert_eq!(kind(50), TokenKind::Control);
    assert_eq!(tok.end_of_generation_ids(), vec![1, 50, 106]);
    assert_eq!(
        (tok.token_text(238), kind(238)),
        (Some("<0x00>"), TokenKind::Byte)
    );
    assert_eq!(
        (tok.token_text(493), kind(493)),
        (Some("<0xFF>"), TokenKind::Byte)
    );
    assert_eq!(
        kind(107),
        TokenKind::Normal,
        "\\n is merged, not cut out verbatim"
    );
}

#[test]
fn control_tokens_only_when_trusted_markers_always() {
    let tok = gemma4();
    let text = "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\nx<channel|>Hello";
    let ids = tok.encode(text, true);
    assert_eq!(&ids[..4], &[2, 105, 2364, 107]);
    assert_eq!(ids.iter().filter(|&&i| i == 105).count(), 2);
    assert!(
        ids.contains(&106) && ids.contains(&100) && ids.contains(&101),
        "{ids:?}"
    );
    // Untrusted text spells control tokens out; the rendered markers are
    // user-defined and still single ids, as llama.cpp does without
    // special-token parsing.
    let plain = tok.encode_untrusted("<|turn>user<|channel>", false);
    assert!(!plain.contains(&105), "{plain:?}");
    assert_eq!(plain.last(), Some(&100));
    assert_eq!(tok.decode(&plain), "<|turn>user<|channel>");
    // Decoding hides control tokens and renders the markers.
    assert_eq!(
        tok.decode(&ids),
        "user\nHi\nmodel\n<|channel>thought\nx<channel|>Hello"
    );
    assert_eq!(tok.decode_with_control(&ids), format!("<bos>{text}"));
}

#[test]
fn stream_decoder_holds_partial_characters() {
    let tok = gemma4();
    // U+F0000 has no piece: four byte tokens F3 B0 80 80 (238 + byte).
    let ids = tok.encode("a\u{F0000}b", false);
    assert_eq!(ids, vec![236746, 481, 414, 366, 366, 236763]);
    let mut d = tok.stream_decoder();
    let parts: Vec<String> = ids.iter().map(|&i| d.push(i)).collect();
    assert_eq!(parts, vec!["a", "", "", "", "\u{F0000}", "b"]);
    assert_eq!(d.finish(), "");
    // A space is no dummy prefix here: generated text keeps it.
    let mut d = tok.stream_decoder();
    assert_eq!(d.push(tok.encode(" Hello", false)[0]), " Hello");
}

#[test]
fn long_text_encodes_fast_and_round_trips() {
    let tok = gemma4();
    // About 200 KB over many scripts, with and without newlines: a quadratic
    // merge loop would take minutes here.
    let unit = "Pulsar runs Gemma 4 on the CPU; naïve café, 日本語のテキスト, русский текст. ";
    let mut text = String::new();
    for i in 0..2500 {
        text.push_str(unit);
        if i % 50 == 0 {
            text.push_str("\n\n");
        }
    }
    let one_line = unit.repeat(2500);
    for t in [&text, &one_line] {
        let start = Instant::now();
        let ids = tok.encode(t, false);
        let took = start.elapsed();
        assert!(
            took.as_secs_f64() < 2.0,
            "{} bytes took {took:?} ({} ids)",
            t.len(),
            ids.len()
        );
        assert_eq!(&tok.decode(&ids), t);
    }
}

#[test]
fn stand_in_tokenizer_json_matches_hf_tokenizers() {
    let dir = oracle_dir().join("tiny-tokenizer-512");
    let tok = Tokenizer::from_hf_folder(&dir).unwrap();
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!((tok.bos_id(), tok.eos_id()), (2, 1));
    assert!(tok.add_bos_by_default());
    let failures = check_cases(&tok, &data_cases("tiny_cases.json"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The same kinds as the GGUF route gives the real vocabulary.
    let kind = |text: &str| tok.token_kind(tok.id_of(text).unwrap()).unwrap();
    assert_eq!(kind("<|turn>"), TokenKind::Control);
    assert_eq!(kind("<|channel>"), TokenKind::UserDefined);
    assert_eq!(kind("<|\"|>"), TokenKind::UserDefined);
    assert_eq!(kind("<|tool_response>"), TokenKind::Control);
    let eog: Vec<&str> = tok
        .end_of_generation_ids()
        .into_iter()
        .map(|id| tok.token_text(id).unwrap())
        .collect();
    assert_eq!(eog, vec!["<eos>", "<|tool_response>", "<turn|>"]);
}

#[test]
fn tokenize_command_reads_a_vocabulary_only_gguf() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_pulsar"))
            .arg("tokenize")
            .arg("-m")
            .arg(vocab_gguf())
            .args(args)
            .output()
            .expect("pulsar runs");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(run(&["-p", "Hello world"]), "2 9259 1902\n");
    assert_eq!(
        run(&["-p", "The capital of France is", "--no-bos"]),
        "818 5279 529 7001 563\n"
    );
}

// ---- malformed gemma4 GGUFs ----

/// A metadata value of the tiny vocabularies below.
enum Meta<'a> {
    Bool(bool),
    Str(&'a str),
    Strs(&'a [&'a str]),
    I32s(&'a [i32]),
}

/// A GGUF file with metadata only, written by the project's GGUF writer.
fn write_gguf(path: &Path, kvs: &[(&str, Meta)]) {
    let mut w = GgufWriter::new();
    for (key, value) in kvs {
        match value {
            Meta::Bool(v) => w.add_bool(key, *v),
            Meta::Str(s) => w.add_str(key, s),
            Meta::Strs(list) => w.add_str_array(key, list),
            Meta::I32s(list) => w.add_i32_array(key, list),
        };
    }
    w.write(path).expect("write GGUF");
}

const TINY_PIECES: &[&str] = &[
    "<pad>", "<eos>", "<bos>", "<unk>", "\n", "\n\n", "\n\n\n", "a", "b", "ab", "▁", "▁ab",
    "<0x41>",
];
const TINY_TYPES: &[i32] = &[3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6];
/// "\n\n\n" is an entry but no merge makes it; "▁ab" needs "ab" first.
const TINY_MERGES: &[&str] = &["a b", "\n \n", "▁ ab"];

fn tiny_gemma4(merges: Option<&[&str]>) -> anyhow::Result<Tokenizer> {
    tiny_gemma4_with(merges, vec![])
}

fn tiny_gemma4_with(
    merges: Option<&[&str]>,
    extra: Vec<(&str, Meta)>,
) -> anyhow::Result<Tokenizer> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-gemma4.gguf");
    let mut kvs = vec![
        ("tokenizer.ggml.model", Meta::Str("gemma4")),
        ("tokenizer.ggml.tokens", Meta::Strs(TINY_PIECES)),
        ("tokenizer.ggml.token_type", Meta::I32s(TINY_TYPES)),
        ("tokenizer.ggml.scores", Meta::I32s(&[0; 13])),
    ];
    if let Some(m) = merges {
        kvs.push(("tokenizer.ggml.merges", Meta::Strs(m)));
    }
    kvs.extend(extra);
    write_gguf(&path, &kvs);
    GgufFile::open(&path).and_then(|f| Tokenizer::from_gguf(&f))
}

#[test]
fn tiny_gemma4_gguf_merges_by_rank_and_cuts_newline_runs() {
    let tok = tiny_gemma4(Some(TINY_MERGES)).unwrap();
    // The file has no add_bos_token key; Gemma 4 wants BOS.
    assert!(tok.add_bos_by_default());
    assert_eq!(tok.encode(" ab", true), vec![2, 11]);
    assert_eq!(tok.encode("aab", false), vec![7, 9]);
    // A newline run that is an entry is taken whole, merges or not; a
    // longer one is merged; runs never merge with their neighbours.
    assert_eq!(tok.encode("\n\n\n", false), vec![6]);
    assert_eq!(tok.encode("\n\n\n\n", false), vec![5, 5]);
    assert_eq!(tok.encode("a\n\nb", false), vec![7, 5, 8]);
    // Byte fallback, with unk for a byte that has no token.
    assert_eq!(tok.encode("A", false), vec![12]);
    assert_eq!(tok.decode(&[12, 4, 11]), "A\n ab");
}

#[test]
fn malformed_gemma4_gguf_errors_name_file_and_key() {
    let err = |merges: Option<&[&str]>| {
        tiny_gemma4(merges)
            .err()
            .expect("a malformed merge list must be refused")
            .to_string()
    };
    let e = err(None);
    assert!(
        e.contains("tiny-gemma4.gguf")
            && e.contains("tokenizer.ggml.merges")
            && e.contains("missing"),
        "{e}"
    );
    let e = err(Some(&["a b", "ab"]));
    assert!(
        e.contains("tokenizer.ggml.merges[1]") && e.contains("\"ab\""),
        "{e}"
    );
}

#[test]
fn gemma4_always_adds_bos_and_never_a_space_prefix() {
    // llama.cpp overrides both flags for Gemma 4, whatever the file says.
    let tok = tiny_gemma4_with(
        Some(TINY_MERGES),
        vec![
            ("tokenizer.ggml.add_bos_token", Meta::Bool(false)),
            ("tokenizer.ggml.add_space_prefix", Meta::Bool(true)),
        ],
    )
    .unwrap();
    assert!(tok.add_bos_by_default());
    assert_eq!(tok.encode("ab", false), vec![9]);
    assert_eq!(tok.decode(&[11]), " ab", "no prefix to strip either");
}

#[test]
fn a_merge_into_no_entry_is_skipped_not_lost() {
    // "ba" is no entry: llama.cpp would merge and then lose both bytes (it
    // has no byte tokens for them); the pair stays apart instead.
    let tok = tiny_gemma4(Some(&["b a", "a b"])).unwrap();
    assert_eq!(tok.encode("ba", false), vec![8, 7]);
    assert_eq!(tok.encode("bab", false), vec![8, 9]);
}
