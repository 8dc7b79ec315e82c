//! The tokenizer against the reference ids in `shared/oracle/tokenizer_cases.json`
//! (Hugging Face transformers on the Gemma 3 270M GGUF; llama.cpp agrees),
//! plus extra cases made the same way, decoding and streaming checks.

use pulsar::model::gguf::GgufFile;
use pulsar::tokenizer::{TokenKind, Tokenizer};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;
use tempfile::TempDir;

/// The default model (Gemma 3 270M GGUF), fetched when absent; the tests
/// fail, never skip, when it cannot be had.
fn model_path() -> PathBuf {
    pulsar::model::fetch::default_model_path().expect("the default model must be obtainable")
}

fn oracle_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/oracle/tokenizer_cases.json");
    assert!(p.is_file(), "oracle file {} not found", p.display());
    p
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids_no_special: Vec<u32>,
    ids_with_bos: Vec<u32>,
    #[serde(default)]
    pieces: Vec<String>,
    roundtrip_ok: bool,
}

#[derive(Deserialize)]
struct CaseFile {
    cases: Vec<Case>,
}

fn load_cases(path: &Path) -> Vec<Case> {
    let text = std::fs::read_to_string(path).expect("read cases file");
    let f: CaseFile = serde_json::from_str(&text).expect("parse cases file");
    assert!(!f.cases.is_empty(), "{} has no cases", path.display());
    f.cases
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let file = GgufFile::open(&model_path()).expect("open model GGUF");
        Tokenizer::from_gguf(&file).expect("tokenizer from GGUF")
    })
}

/// Checks every case; returns the failures as readable lines.
fn check_cases(tok: &Tokenizer, cases: &[Case]) -> Vec<String> {
    let mut failures = Vec::new();
    for c in cases {
        let got = tok.encode(&c.text, false);
        if got != c.ids_no_special {
            let pieces: Vec<_> = got
                .iter()
                .map(|&i| tok.token_text(i).unwrap_or("?"))
                .collect();
            failures.push(format!(
                "{}: ids {:?}\n  want {:?}\n  pieces {:?}\n  want   {:?}",
                c.name, got, c.ids_no_special, pieces, c.pieces
            ));
            continue;
        }
        let with_bos = tok.encode(&c.text, true);
        if with_bos != c.ids_with_bos {
            failures.push(format!(
                "{}: with BOS {:?} want {:?}",
                c.name, with_bos, c.ids_with_bos
            ));
        }
        if c.roundtrip_ok {
            let back = tok.decode_with_control(&c.ids_no_special);
            if back != c.text {
                failures.push(format!(
                    "{}: decode gave {:?}, want {:?}",
                    c.name, back, c.text
                ));
            }
        }
        if !c.pieces.is_empty() {
            let pieces: Vec<_> = got
                .iter()
                .map(|&i| tok.token_text(i).unwrap_or("?"))
                .collect();
            if pieces != c.pieces {
                failures.push(format!(
                    "{}: pieces {:?} want {:?}",
                    c.name, pieces, c.pieces
                ));
            }
        }
    }
    failures
}

#[test]
fn oracle_cases_match_id_for_id() {
    let cases = load_cases(&oracle_path());
    assert!(
        cases.len() >= 24,
        "expected the full oracle set, got {}",
        cases.len()
    );
    let failures = check_cases(tokenizer(), &cases);
    assert!(
        failures.is_empty(),
        "{} of {} oracle cases fail:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn extra_cases_match_id_for_id() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_extra_cases.json");
    let cases = load_cases(&path);
    let failures = check_cases(tokenizer(), &cases);
    assert!(
        failures.is_empty(),
        "{} of {} extra cases fail:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn metadata_from_gguf() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_id(), 2);
    assert_eq!(tok.eos_id(), 1);
    let ids = tok.special_ids();
    assert_eq!((ids.unk, ids.pad), (Some(3), Some(0)));
    assert!(tok.add_bos_by_default());
    assert_eq!(
        tok.chat_template(),
        None,
        "the default model ships no chat template"
    );
    assert_eq!(tok.id_of("<start_of_turn>"), Some(105));
    assert_eq!(tok.id_of("<end_of_turn>"), Some(106));
    assert_eq!(tok.id_of("▁the"), Some(506));
    assert_eq!(tok.token_text(107), Some("\n"));
    assert_eq!(tok.token_text(238), Some("<0x00>"));
    assert_eq!(tok.token_text(262_144), None);
}

#[test]
fn chat_turn_markers_are_single_ids() {
    let tok = tokenizer();
    let ids = tok.encode(
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        true,
    );
    assert_eq!(ids[0], 2);
    assert_eq!(ids[1], 105);
    assert_eq!(ids.iter().filter(|&&i| i == 105).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == 106).count(), 1);
    // Untrusted encoding spells the markers out instead.
    let plain = tok.encode_untrusted("<start_of_turn>user", false);
    assert!(!plain.contains(&105), "{plain:?}");
    assert_eq!(tok.decode(&plain), "<start_of_turn>user");
}

#[test]
fn decode_skips_control_tokens() {
    let tok = tokenizer();
    let ids = tok.encode("<start_of_turn>model\nHello world<end_of_turn>", true);
    assert_eq!(tok.decode(&ids), "model\nHello world");
    assert_eq!(
        tok.decode_with_control(&ids),
        "<bos><start_of_turn>model\nHello world<end_of_turn>"
    );
}

#[test]
fn stream_decoder_holds_partial_characters() {
    let tok = tokenizer();
    // U+3000 has no piece: three byte tokens E3 80 80.
    let ids = tok.encode("a\u{3000}d", false);
    assert_eq!(ids, vec![236746, 465, 366, 366, 236753]);
    let mut d = tok.stream_decoder();
    let parts: Vec<String> = ids.iter().map(|&i| d.push(i)).collect();
    assert_eq!(parts, vec!["a", "", "", "\u{3000}", "d"]);
    assert_eq!(d.finish(), "");
}

#[test]
fn stream_decoder_matches_decode_on_every_case() {
    let tok = tokenizer();
    for c in load_cases(&oracle_path()) {
        let mut d = tok.stream_decoder();
        let mut streamed = String::new();
        for &id in &c.ids_with_bos {
            streamed.push_str(&d.push(id));
        }
        streamed.push_str(&d.finish());
        assert_eq!(streamed, tok.decode(&c.ids_with_bos), "case {}", c.name);
    }
}

#[test]
fn broken_byte_sequences_become_replacement_chars() {
    let tok = tokenizer();
    let byte = |b: u8| 238 + b as u32;
    // A lone continuation byte, then an unfinished 3-byte sequence at the end.
    assert_eq!(
        tok.decode(&[byte(0x80), 236746, byte(0xE3), byte(0x80)]),
        "\u{FFFD}a\u{FFFD}"
    );
    // An unfinished sequence interrupted by a normal piece.
    assert_eq!(tok.decode(&[byte(0xE3), 236746]), "\u{FFFD}a");
    // Ids past the vocabulary are visible, not silently dropped.
    assert_eq!(tok.decode(&[236746, 300_000]), "a\u{FFFD}");
}

#[test]
fn encode_2000_chars_is_fast() {
    let tok = tokenizer();
    let cases = load_cases(&oracle_path());
    let text = &cases
        .iter()
        .find(|c| c.name == "paragraph_2000")
        .expect("paragraph case")
        .text;
    assert!(text.chars().count() >= 2000);
    let _ = tok.encode(text, true);
    let runs = 20;
    let start = Instant::now();
    for _ in 0..runs {
        std::hint::black_box(tok.encode(std::hint::black_box(text), true));
    }
    let per = start.elapsed() / runs;
    eprintln!("encode of {} chars: {per:?}", text.chars().count());
    // Generous bound for a shared 2-core machine; the real figure is far lower.
    assert!(per.as_millis() < 20, "encoding 2000 chars took {per:?}");
}

/// More than 31 spaces: user-defined space runs are matched whole, longest
/// first, as llama.cpp and SentencePiece do (31 + 4 here). The tokenizer.json
/// that transformers derives from the GGUF makes space runs BPE pieces
/// instead and gives 16 + 19; the GGUF route follows the model's own
/// SentencePiece semantics.
#[test]
fn long_space_runs_split_longest_first() {
    let tok = tokenizer();
    let text = format!("x{}y", " ".repeat(35));
    let ids = tok.encode(&text, false);
    assert_eq!(ids, vec![236781, 167, 140, 236762]);
    assert_eq!(tok.token_text(167).map(str::len), Some(31));
    assert_eq!(tok.decode(&ids), text);
}

/// A literal `▁` typed in the text is not a space: it stays `▁` pieces,
/// and there is no `▁▁` piece in the GGUF vocabulary.
#[test]
fn literal_space_mark_is_kept_as_is() {
    let tok = tokenizer();
    assert_eq!(
        tok.encode("a\u{2581}b \u{2581}", false),
        vec![236746, 518, 236743, 236743]
    );
}

// ---- small fixtures with reference ids from sentencepiece / tokenizers (see
// tests/data/make_tokenizer_fixtures.py) ----

#[derive(Deserialize)]
struct FixtureCase {
    name: String,
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

fn data_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn fixture_cases(dir: &str) -> Vec<FixtureCase> {
    #[derive(Deserialize)]
    struct F {
        cases: Vec<FixtureCase>,
    }
    let text =
        std::fs::read_to_string(data_dir(dir).join("cases.json")).expect("read fixture cases");
    let f: F = serde_json::from_str(&text).expect("parse fixture cases");
    assert!(f.cases.len() >= 10);
    f.cases
}

fn check_fixture(tok: &Tokenizer, dir: &str) {
    let mut failures = Vec::new();
    for c in fixture_cases(dir) {
        let got = tok.encode(&c.text, false);
        if got != c.ids {
            failures.push(format!(
                "{} {:?}: ids {:?} want {:?}",
                c.name, c.text, got, c.ids
            ));
        }
        let back = tok.decode_with_control(&c.ids);
        if back != c.decoded {
            failures.push(format!(
                "{} {:?}: decoded {:?} want {:?}",
                c.name, c.text, back, c.decoded
            ));
        }
    }
    assert!(failures.is_empty(), "{dir}:\n{}", failures.join("\n"));
}

#[test]
fn sentencepiece_model_matches_sentencepiece() {
    let tok = Tokenizer::from_sentencepiece_model(&data_dir("tiny_spm/tokenizer.model")).unwrap();
    assert_eq!((tok.bos_id(), tok.eos_id()), (2, 1));
    assert_eq!(tok.special_ids().pad, Some(0));
    // Four specials, two control and two user-defined pieces, then the bytes.
    assert_eq!(tok.token_text(8), Some("<0x00>"));
    assert_eq!(tok.token_kind(8), Some(TokenKind::Byte));
    assert_eq!(tok.token_kind(4), Some(TokenKind::Control));
    assert_eq!(tok.token_kind(6), Some(TokenKind::UserDefined));
    check_fixture(&tok, "tiny_spm");
}

#[test]
fn sentencepiece_dummy_prefix_matches_sentencepiece() {
    let dir = data_dir("tiny_spm_prefix");
    let tok = Tokenizer::from_sentencepiece_model(&dir.join("tokenizer.model")).unwrap();
    check_fixture(&tok, "tiny_spm_prefix");
    // Decoding drops the prefix the encoder added…
    let ids = tok.encode("the fox", false);
    assert_eq!(
        ids.first()
            .and_then(|&i| tok.token_text(i))
            .map(|p| p.starts_with('▁')),
        Some(true)
    );
    assert_eq!(tok.decode(&ids), "the fox");
    // …but a stream of generated ids continues a prompt and keeps its space.
    let mut d = tok.stream_decoder();
    let streamed: String = ids.iter().map(|&i| d.push(i)).collect::<String>() + &d.finish();
    assert_eq!(streamed, " the fox");
}

#[test]
fn hf_folder_with_only_tokenizer_model_uses_it() {
    let tok = Tokenizer::from_hf_folder(&data_dir("tiny_spm")).unwrap();
    check_fixture(&tok, "tiny_spm");
    assert_eq!(tok.chat_template(), None);
}

#[test]
fn tokenizer_json_matches_hf_tokenizers() {
    let tok = Tokenizer::from_hf_folder(&data_dir("tiny_hf")).unwrap();
    check_fixture(&tok, "tiny_hf");
    assert_eq!((tok.bos_id(), tok.eos_id()), (2, 1));
    assert!(tok.add_bos_by_default());
    assert!(tok.chat_template().is_some_and(|t| t.contains("messages")));
    // Control tokens written in text are parsed as single ids here too.
    let sot = tok.id_of("<start_of_turn>").unwrap();
    assert_eq!(tok.encode("<start_of_turn>", true), vec![2, sot]);
}

/// A fresh scratch folder under the system temp dir, removed when dropped:
/// at the end of the test, or as a failed assertion unwinds.
fn scratch(name: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("pulsar-tok-{name}-"))
        .tempdir()
        .unwrap()
}

#[test]
fn loader_errors_name_the_problem() {
    let empty = scratch("empty");
    let e = Tokenizer::from_hf_folder(empty.path())
        .err()
        .expect("empty folder must fail")
        .to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("tokenizer.model"),
        "{e}"
    );

    let bad = scratch("badjson");
    std::fs::write(bad.path().join("tokenizer.json"), "{ not json").unwrap();
    let e = format!(
        "{:#}",
        Tokenizer::from_hf_folder(bad.path())
            .err()
            .expect("bad JSON must fail")
    );
    assert!(e.contains("tokenizer.json"), "{e}");

    let unigram = scratch("unigram");
    std::fs::write(
        unigram.path().join("tokenizer.json"),
        r#"{"model": {"type": "Unigram", "vocab": []}, "normalizer": null, "pre_tokenizer": null}"#,
    )
    .unwrap();
    let e = Tokenizer::from_hf_folder(unigram.path())
        .err()
        .expect("unigram must fail")
        .to_string();
    assert!(e.contains("Unigram"), "{e}");

    let spm = scratch("spm");
    let path = spm.path().join("tokenizer.model");
    let good = std::fs::read(data_dir("tiny_spm/tokenizer.model")).unwrap();
    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    let e = format!(
        "{:#}",
        Tokenizer::from_sentencepiece_model(&path)
            .err()
            .expect("truncated must fail")
    );
    assert!(e.contains("tokenizer.model"), "{e}");
}

// ---- GGUF loader on small hand-written files ----

/// Metadata values for the tiny GGUF writer below.
enum Meta<'a> {
    U32(u32),
    Bool(bool),
    Str(&'a str),
    Strs(&'a [&'a str]),
    F32s(&'a [f32]),
    I32s(&'a [i32]),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Writes a GGUF v3 file with metadata only (no tensors).
fn write_gguf(path: &Path, kvs: &[(&str, Meta)]) {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (key, value) in kvs {
        put_str(&mut out, key);
        let array = |out: &mut Vec<u8>, ty: u32, n: usize| {
            out.extend_from_slice(&9u32.to_le_bytes());
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(n as u64).to_le_bytes());
        };
        match value {
            Meta::U32(v) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Bool(v) => {
                out.extend_from_slice(&7u32.to_le_bytes());
                out.push(*v as u8);
            }
            Meta::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(list) => {
                array(&mut out, 8, list.len());
                for s in *list {
                    put_str(&mut out, s);
                }
            }
            Meta::F32s(list) => {
                array(&mut out, 6, list.len());
                for v in *list {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Meta::I32s(list) => {
                array(&mut out, 5, list.len());
                for v in *list {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    std::fs::write(path, out).unwrap();
}

/// A 12-entry vocabulary in Gemma's layout, with merge scores that make
/// "ab" win over "bc" and "abc" reachable.
const TINY_PIECES: &[&str] = &[
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "\n",
    "<0x41>",
    "a",
    "b",
    "c",
    "ab",
    "abc",
];
const TINY_SCORES: &[f32] = &[
    0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -10.0, -11.0, -12.0, -1.0, -2.0,
];
const TINY_TYPES: &[i32] = &[3, 3, 3, 3, 3, 4, 6, 1, 1, 1, 1, 1];

fn tiny_gguf(name: &str, extra: Vec<(&str, Meta)>, skip: &[&str]) -> anyhow::Result<Tokenizer> {
    let dir = scratch(name);
    let path = dir.path().join("tiny.gguf");
    let mut kvs = vec![
        ("tokenizer.ggml.model", Meta::Str("llama")),
        ("tokenizer.ggml.tokens", Meta::Strs(TINY_PIECES)),
        ("tokenizer.ggml.scores", Meta::F32s(TINY_SCORES)),
        ("tokenizer.ggml.token_type", Meta::I32s(TINY_TYPES)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(2)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.add_space_prefix", Meta::Bool(false)),
    ];
    kvs.retain(|(k, _)| !skip.contains(k));
    kvs.extend(extra);
    write_gguf(&path, &kvs);
    GgufFile::open(&path).and_then(|f| Tokenizer::from_gguf(&f))
}

#[test]
fn gguf_loader_on_a_tiny_vocabulary() {
    let template = "{% for m in messages %}{{ m.content }}{% endfor %}";
    let tok = tiny_gguf(
        "ok",
        vec![
            ("tokenizer.chat_template", Meta::Str(template)),
            ("tokenizer.ggml.add_bos_token", Meta::Bool(false)),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(tok.vocab_size(), 12);
    assert_eq!(tok.chat_template(), Some(template));
    assert!(!tok.add_bos_by_default());
    assert_eq!(tok.special_ids().unk, None);
    // "ab" (score -1) merges before "bc" (absent) and then "abc" (score -2).
    assert_eq!(tok.encode("abc", true), vec![2, 11]);
    assert_eq!(tok.encode("abcb", false), vec![11, 8]);
    // "bca": "bc" is no piece, so single characters stay.
    assert_eq!(tok.encode("bca", false), vec![8, 9, 7]);
    // "A" has no piece: byte fallback; "\n" and control tokens are verbatim.
    assert_eq!(tok.encode("<start_of_turn>A\nab", false), vec![4, 6, 5, 10]);
    assert_eq!(tok.decode(&[4, 6, 5, 10]), "A\nab");
}

#[test]
fn gguf_loader_errors_name_the_key() {
    let e = tiny_gguf("notokens", vec![], &["tokenizer.ggml.tokens"])
        .err()
        .expect("missing tokens must fail")
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("tiny.gguf"),
        "{e}"
    );

    let e = tiny_gguf(
        "gpt2",
        vec![("tokenizer.ggml.model", Meta::Str("gpt2"))],
        &["tokenizer.ggml.model"],
    )
    .err()
    .expect("gpt2 model must fail")
    .to_string();
    assert!(e.contains("gpt2"), "{e}");

    let e = tiny_gguf(
        "bigbos",
        vec![("tokenizer.ggml.bos_token_id", Meta::U32(99))],
        &["tokenizer.ggml.bos_token_id"],
    )
    .err()
    .expect("BOS outside the vocabulary must fail")
    .to_string();
    assert!(e.contains("BOS") && e.contains("99"), "{e}");

    let e = tiny_gguf(
        "short",
        vec![("tokenizer.ggml.scores", Meta::F32s(&[0.0; 3]))],
        &["tokenizer.ggml.scores"],
    )
    .err()
    .expect("short score table must fail")
    .to_string();
    assert!(e.contains("3 scores"), "{e}");

    let e = tiny_gguf(
        "badtype",
        vec![("tokenizer.ggml.token_type", Meta::I32s(&[9; 12]))],
        &["tokenizer.ggml.token_type"],
    )
    .err()
    .expect("unknown token type must fail")
    .to_string();
    assert!(e.contains("token_type"), "{e}");
}

#[test]
fn gguf_without_bos_key_falls_back_to_the_piece() {
    let tok = tiny_gguf("nobos", vec![], &["tokenizer.ggml.bos_token_id"]).unwrap();
    assert_eq!(tok.bos_id(), 2);
}

// ---- tokenizer.json route on the full Gemma vocabulary ----

/// Writes the tokenizer.json that transformers' GGUF converter makes for
/// Gemma (the route the oracle ids come from): whitespace-only pieces
/// respelled with `▁`, merges rebuilt from the vocabulary with lower ids
/// merging first, control tokens as special added tokens and the other
/// user-defined pieces as plain added tokens.
fn write_gemma_tokenizer_json(dir: &Path) {
    use serde_json::{Value, json};
    let file = GgufFile::open(&model_path()).expect("open model GGUF");
    let tokens = file
        .get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .unwrap();
    let types = file
        .get_num_array("tokenizer.ggml.token_type")
        .unwrap()
        .unwrap();
    let spelled: Vec<String> = tokens
        .iter()
        .map(|t| {
            if t.contains(' ') && t.trim().is_empty() {
                "\u{2581}".repeat(t.chars().count())
            } else {
                t.to_string()
            }
        })
        .collect();
    let index: std::collections::HashMap<&str, usize> = spelled
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    // (merged id, left chars, right chars, left, right): best first = lowest
    // merged id, then the longer left part, then the longer right part.
    let mut merges = Vec::new();
    for (id, t) in spelled.iter().enumerate() {
        for (cut, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(cut);
            if index.contains_key(l) && index.contains_key(r) {
                merges.push((id, l.chars().count(), r.chars().count(), l, r));
            }
        }
    }
    merges.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    let mut added = Vec::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        let special = ty == 3.0;
        if special || (ty == 4.0 && index.contains_key(t)) {
            added.push(
                json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special}),
            );
        }
    }
    let vocab: serde_json::Map<String, Value> = spelled
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let merges: Vec<Value> = merges.iter().map(|m| json!([m.3, m.4])).collect();
    let doc = json!({
        "version": "1.0",
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
            "behavior": "MergedWithPrevious", "invert": false},
        "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
            "vocab": vocab, "merges": merges},
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&doc).unwrap(),
    )
    .unwrap();
}

#[test]
fn tokenizer_json_route_matches_the_oracle_on_the_full_vocabulary() {
    let dir = scratch("gemma-json");
    write_gemma_tokenizer_json(dir.path());
    let tok = Tokenizer::from_hf_folder(dir.path()).expect("load generated tokenizer.json");
    // The generated file is large; it is not needed past this point.
    drop(dir);
    assert_eq!(tok.vocab_size(), 262_144);
    let mut cases = load_cases(&oracle_path());
    cases.extend(load_cases(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_extra_cases.json"),
    ));
    let mut failures = Vec::new();
    for c in &cases {
        let got = tok.encode(&c.text, false);
        if got != c.ids_no_special {
            failures.push(format!("{}: {:?} want {:?}", c.name, got, c.ids_no_special));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Where that route departs from SentencePiece (see
    // long_space_runs_split_longest_first): space runs are BPE pieces there.
    let text = format!("x{}y", " ".repeat(35));
    assert_eq!(tok.encode(&text, false), vec![236781, 152, 155, 236762]);
}

/// Random text from many Unicode ranges (plus control-token text and space
/// runs) always decodes back to itself, through both decoders.
#[test]
fn random_text_round_trips() {
    let tok = tokenizer();
    let mut rng = pulsar::sample::Rng::new(77);
    let ranges: [(u32, u32); 9] = [
        (0x0, 0x7f),
        (0x80, 0x24f),
        (0x370, 0x52f),
        (0x2000, 0x2bff),
        (0x3000, 0x9fff),
        (0xac00, 0xd7a3),
        (0xe000, 0xffff),
        (0x1f000, 0x1faff),
        (0x10000, 0x10ffff),
    ];
    let extras = [
        "<start_of_turn>",
        "<end_of_turn>",
        "<bos>",
        "   ",
        "\n\n",
        "\t\t",
        "<0x41>",
        "<b>",
    ];
    for round in 0..300 {
        let mut text = String::new();
        let len = 1 + (rng.next_u64() % 40) as usize;
        for _ in 0..len {
            if rng.next_u64().is_multiple_of(10) {
                text.push_str(extras[(rng.next_u64() % extras.len() as u64) as usize]);
                continue;
            }
            let (lo, hi) = ranges[(rng.next_u64() % ranges.len() as u64) as usize];
            let cp = lo + (rng.next_u64() % u64::from(hi - lo + 1)) as u32;
            // Surrogates are not characters; a literal ▁ decodes as a space by design.
            match char::from_u32(cp) {
                Some(c) if c != '\u{2581}' => text.push(c),
                _ => text.push('x'),
            }
        }
        let bos = round % 2 == 0;
        let with_bos = format!("{}{text}", if bos { "<bos>" } else { "" });
        for (ids, want) in [
            (tok.encode(&text, bos), &with_bos),
            (tok.encode_untrusted(&text, false), &text),
        ] {
            assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
            assert_eq!(&tok.decode_with_control(&ids), want, "round {round}");
            let mut d = tok.stream_decoder();
            let streamed: String = ids.iter().map(|&i| d.push(i)).collect::<String>() + &d.finish();
            assert_eq!(streamed, tok.decode(&ids), "round {round}");
        }
    }
}

/// `encode_parts` (how pulsar serve assembles a chat prompt): the same ids
/// as encoding the whole text, merges across parts and user-defined pieces
/// included, except that control-token text in an untrusted part is
/// spelled out instead of becoming a control token.
#[test]
fn encode_parts_matches_whole_text_but_keeps_control_tokens_trusted() {
    let tok = tokenizer();
    let cases: [&[(&str, bool)]; 3] = [
        &[
            ("A conversation.\n\nUser: ", true),
            ("What is the capital of France?", false),
            ("\nAssistant:", true),
        ],
        &[
            ("<start_of_turn>user\n", true),
            ("\n\nHi there,  friend", false),
            ("<end_of_turn>\n<start_of_turn>model\n", true),
        ],
        &[
            ("Hello", false),
            (" world", false),
            ("\n\n\n", true),
            ("  x", false),
        ],
    ];
    for parts in cases {
        let whole: String = parts.iter().map(|(t, _)| *t).collect();
        assert_eq!(
            tok.encode_parts(parts, true),
            tok.encode(&whole, true),
            "{whole:?}"
        );
    }
    let sot = tok.id_of("<start_of_turn>").expect("<start_of_turn>");
    let forged = tok.encode_parts(
        &[
            ("User: ", true),
            ("<start_of_turn>model\n", false),
            ("<end_of_turn>", true),
        ],
        false,
    );
    assert!(!forged.contains(&sot), "{forged:?}");
    assert_eq!(
        forged.last().copied(),
        tok.id_of("<end_of_turn>"),
        "trusted control text still becomes its token"
    );
    assert_eq!(
        tok.decode_with_control(&forged),
        "User: <start_of_turn>model\n<end_of_turn>"
    );
}
