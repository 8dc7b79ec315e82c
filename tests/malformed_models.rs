//! Malformed model files, one test per kind of damage, through the real
//! binary: each must fail with exit code 1, no panic, and one line naming
//! the file (and the tensor or key) and what is wrong.
//!
//! Every bad input is built here: GGUF files with `GgufWriter` from the
//! weights of the awkward Gemma 2 fixture, then broken in exactly one way;
//! safetensors files byte by byte from the fixture's header and data.
//! `base_gguf_and_folder_are_valid` checks that the unbroken inputs load and
//! run, so each failure below is caused by the one thing broken.

mod common;

use pulsar::model::dequant;
use pulsar::model::dtype::DType;
use pulsar::model::gguf::GgufFile;
use pulsar::model::gguf_write::{GgufWriter, RawTensor, f32_bytes, value_type};
use pulsar::model::safetensors::SafetensorsFile;
use pulsar::model::source::ModelSource;
use serde_json::{Map, Value as Json};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The HF fixture every input is made from (F32, 4 layers, odd sizes).
const FIXTURE: &str = "awkward-gemma2";
const ARCH: &str = "gemma2";

/// A fresh folder for one test's inputs, removed when the test ends, pass
/// or fail: a failed assertion unwinds and drops the `TempDir`.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = tempfile::Builder::new()
            .prefix(&format!("pulsar-malformed-{tag}-"))
            .tempdir()
            .expect("create scratch folder");
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

fn fixture_dir() -> PathBuf {
    common::fixtures_dir().join(FIXTURE)
}

fn pulsar_logits(model: &Path, out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args([
            "logits",
            "--engine",
            "reference",
            "--tokens",
            "2,5,17",
            "-o",
        ])
        .arg(out)
        .arg("-m")
        .arg(model)
        .output()
        .expect("the pulsar binary runs")
}

/// Runs `pulsar logits -m model` and checks it is refused cleanly: exit
/// code 1, no panic, a single line that names `named` (a file path) and
/// contains every one of `needles`. Returns the message.
fn expect_refusal(model: &Path, named: &Path, needles: &[&str]) -> String {
    let out_file = model.with_extension("logits.bin");
    let out = pulsar_logits(model, &out_file);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}: exit code; stderr: {stderr}",
        model.display()
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(&named.display().to_string()),
        "the message should name {}: {stderr}",
        named.display()
    );
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "the message should say {needle:?}: {stderr}"
        );
    }
    assert!(!out_file.exists(), "no output after a refusal");
    stderr
}

/// The GGUF name of a tensor of the Gemma 2 fixture.
fn gguf_name(hf: &str) -> String {
    if hf == "model.embed_tokens.weight" {
        return "token_embd.weight".into();
    }
    if hf == "model.norm.weight" {
        return "output_norm.weight".into();
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, part) = rest.split_once('.').expect("layer number");
    let part = match part.strip_suffix(".weight").expect(".weight") {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "post_attention_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("unexpected tensor {other}"),
    };
    format!("blk.{layer}.{part}.weight")
}

/// A valid GGUF of the fixture (all tensors F32, in name order), as a
/// writer whose fields the tests then break.
fn base_gguf() -> GgufWriter {
    let cfg = common::read_json(&fixture_dir().join("config.json"));
    let n = |key: &str| cfg[key].as_u64().expect(key) as u32;
    let k = |s: &str| format!("{ARCH}.{s}");
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", ARCH)
        .add_u32(&k("context_length"), n("max_position_embeddings"))
        .add_u32(&k("embedding_length"), n("hidden_size"))
        .add_u32(&k("feed_forward_length"), n("intermediate_size"))
        .add_u32(&k("block_count"), n("num_hidden_layers"))
        .add_u32(&k("attention.head_count"), n("num_attention_heads"))
        .add_u32(&k("attention.head_count_kv"), n("num_key_value_heads"))
        .add_u32(&k("attention.key_length"), n("head_dim"))
        .add_u32(&k("attention.sliding_window"), n("sliding_window"));
    let st = SafetensorsFile::open(&fixture_dir().join("model.safetensors")).expect("fixture");
    let mut hf_names: Vec<&str> = st.names().collect();
    hf_names.sort_by_key(|s| gguf_name(s));
    for hf in hf_names {
        let t = st.tensor(hf).expect("listed tensor");
        let values = dequant::to_f32(&t);
        w.add_tensor(&gguf_name(hf), t.shape, DType::F32, f32_bytes(&values))
            .expect("sizes match");
    }
    w
}

fn tensor_index(w: &GgufWriter, name: &str) -> usize {
    w.tensors
        .iter()
        .position(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

fn kv_index(w: &GgufWriter, key: &str) -> usize {
    w.kvs
        .iter()
        .position(|kv| kv.key == key)
        .unwrap_or_else(|| panic!("no key {key}"))
}

/// Writes `w` as `name` in a new scratch folder and expects a refusal that
/// names the file and says each of `needles`.
fn expect_gguf_refusal(tag: &str, w: &GgufWriter, needles: &[&str]) -> String {
    let scratch = Scratch::new(tag);
    let path = scratch.path(&format!("{tag}.gguf"));
    w.write(&path).expect("write GGUF");
    expect_refusal(&path, &path, needles)
}

/// The fixture's safetensors file as (header object, data bytes).
fn safetensors_parts() -> (Map<String, Json>, Vec<u8>) {
    let bytes = std::fs::read(fixture_dir().join("model.safetensors")).expect("fixture");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Json = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header JSON");
    let Json::Object(header) = header else {
        panic!("header is not an object")
    };
    (header, bytes[8 + header_len..].to_vec())
}

/// A safetensors file from its header text and data, written out by hand.
fn safetensors_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A copy of the fixture folder in `scratch`, with `model.safetensors`
/// and `config.json` replaced where given.
fn hf_folder(scratch: &Scratch, weights: Option<&[u8]>, config: Option<&str>) -> PathBuf {
    let dir = scratch.path("model");
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture_dir();
    match weights {
        Some(b) => std::fs::write(dir.join("model.safetensors"), b).unwrap(),
        None => {
            std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        }
    }
    match config {
        Some(c) => std::fs::write(dir.join("config.json"), c).unwrap(),
        None => {
            std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        }
    }
    dir
}

/// The fixture's config.json with `edit` applied.
fn edited_config(edit: impl FnOnce(&mut Map<String, Json>)) -> String {
    let mut cfg = common::read_json(&fixture_dir().join("config.json"));
    edit(cfg.as_object_mut().expect("config object"));
    serde_json::to_string_pretty(&cfg).unwrap()
}

/// A safetensors file whose header is the fixture's with `edit` applied.
fn edited_safetensors(edit: impl FnOnce(&mut Map<String, Json>)) -> Vec<u8> {
    let (mut header, data) = safetensors_parts();
    edit(&mut header);
    safetensors_bytes(&Json::Object(header).to_string(), &data)
}

#[test]
fn base_gguf_and_folder_are_valid() {
    let scratch = Scratch::new("valid");
    let gguf = scratch.path("valid.gguf");
    base_gguf().write(&gguf).unwrap();
    let folder = hf_folder(&scratch, None, None);
    let rebuilt = scratch.path("rebuilt");
    std::fs::create_dir_all(&rebuilt).unwrap();
    std::fs::copy(folder.join("config.json"), rebuilt.join("config.json")).unwrap();
    let (header, data) = safetensors_parts();
    std::fs::write(
        rebuilt.join("model.safetensors"),
        safetensors_bytes(&Json::Object(header).to_string(), &data),
    )
    .unwrap();
    for model in [&gguf, &folder, &rebuilt] {
        let out_file = scratch.path("ok.bin");
        let out = pulsar_logits(model, &out_file);
        assert!(
            out.status.success(),
            "{}: {}",
            model.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(std::fs::read(&out_file).unwrap().len(), 89 * 4);
    }
}

// ---------------------------------------------------------------- GGUF

#[test]
fn gguf_truncated_anywhere() {
    let bytes = base_gguf().to_bytes();
    let full = GgufFile::from_bytes(Path::new("full.gguf"), bytes.clone()).expect("valid");
    let data_end = full
        .tensors()
        .iter()
        .map(|t| t.start + t.len)
        .max()
        .unwrap();
    let first_data = full.tensors().iter().map(|t| t.start).min().unwrap();
    // In memory: every cut in the header and a stride through the data
    // must be refused as truncated.
    let cuts: Vec<usize> = (0..first_data + 64)
        .chain((first_data..data_end).step_by(509))
        .chain([data_end - 1])
        .collect();
    for &cut in &cuts {
        let name = format!("cut-{cut}.gguf");
        let err = GgufFile::from_bytes(Path::new(&name), bytes[..cut].to_vec())
            .and_then(ModelSource::from_gguf)
            .err()
            .unwrap_or_else(|| panic!("a file cut at {cut} of {data_end} bytes was accepted"));
        let msg = format!("{err:#}");
        assert!(msg.starts_with(&name), "{msg}");
        assert!(
            msg.contains("truncated") || (cut < 4 && msg.contains("not a GGUF")),
            "cut at {cut}: {msg}"
        );
    }
    // Through the binary: the empty file, inside the fixed header, inside
    // a key, inside the tensor infos, inside the data, one byte short.
    let scratch = Scratch::new("truncated");
    for cut in [
        0,
        3,
        10,
        30,
        first_data - 40,
        first_data + 1000,
        data_end - 1,
    ] {
        let path = scratch.path(&format!("cut-{cut}.gguf"));
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let msg = expect_refusal(&path, &path, &[]);
        assert!(
            msg.contains("truncated") || msg.contains("not a GGUF"),
            "{msg}"
        );
    }
}

#[test]
fn gguf_wrong_magic() {
    let mut w = base_gguf();
    w.magic = *b"GGML";
    expect_gguf_refusal("magic", &w, &["not a GGUF file"]);
}

#[test]
fn gguf_unsupported_version() {
    for version in [1, 4, u32::MAX] {
        let mut w = base_gguf();
        w.version = version;
        expect_gguf_refusal(
            "version",
            &w,
            &[&format!("unsupported GGUF version {version}")],
        );
    }
}

#[test]
fn gguf_tensor_data_past_the_end() {
    let mut w = base_gguf();
    let last = w.tensors.len() - 1;
    // Far beyond the data: the writer stores the info but not the bytes.
    w.tensors[last].offset = Some(1 << 30);
    let name = w.tensors[last].name.clone();
    expect_gguf_refusal("past-end", &w, &[&format!("{name:?}"), "runs past the end"]);
}

#[test]
fn gguf_misaligned_offset() {
    let mut w = base_gguf();
    let i = tensor_index(&w, "output_norm.weight");
    // Every tensor placed explicitly, this one 4 bytes off the alignment.
    let mut at = 0u64;
    for (j, t) in w.tensors.iter_mut().enumerate() {
        let here = if j == i { at + 4 } else { at };
        t.offset = Some(here);
        at = (here + t.data.len() as u64).div_ceil(32) * 32 + 32;
    }
    expect_gguf_refusal(
        "misaligned",
        &w,
        &[
            "\"output_norm.weight\"",
            "not a multiple of the alignment 32",
        ],
    );
}

#[test]
fn gguf_overlapping_offsets() {
    let mut w = base_gguf();
    // The last tensor claims the first tensor's bytes.
    let last = w.tensors.len() - 1;
    w.tensors[last].offset = Some(0);
    let first = w.tensors[0].name.clone();
    let last_name = w.tensors[last].name.clone();
    expect_gguf_refusal(
        "overlap",
        &w,
        &[&format!("{first:?}"), &format!("{last_name:?}"), "overlap"],
    );
}

#[test]
fn gguf_absurd_dimension() {
    for dim in [1u64 << 50, 0] {
        let mut w = base_gguf();
        let i = tensor_index(&w, "blk.1.attn_q.weight");
        w.tensors[i].dims[1] = dim;
        expect_gguf_refusal(
            "absurd-dim",
            &w,
            &[
                "\"blk.1.attn_q.weight\"",
                &format!("dimension {dim} is zero or absurd"),
            ],
        );
    }
}

#[test]
fn gguf_zero_head_count() {
    // With 46 layers a Gemma 2 file takes its query scale from
    // hidden / heads, which divided by zero before the count was checked.
    let mut w = base_gguf();
    let k = kv_index(&w, "gemma2.block_count");
    w.kvs[k].payload = 46u32.to_le_bytes().to_vec();
    let k = kv_index(&w, "gemma2.attention.head_count");
    w.kvs[k].payload = 0u32.to_le_bytes().to_vec();
    expect_gguf_refusal("zero-heads", &w, &["\"gemma2.attention.head_count\" is 0"]);
}

#[test]
fn gguf_element_count_overflow() {
    let mut w = base_gguf();
    let i = tensor_index(&w, "blk.0.ffn_up.weight");
    // Each dimension is plausible alone; their product is not a usize.
    w.tensors[i].dims = vec![1 << 40, 1 << 40, 1 << 40];
    expect_gguf_refusal(
        "overflow",
        &w,
        &["\"blk.0.ffn_up.weight\"", "element count", "overflows"],
    );
}

#[test]
fn gguf_absurd_string_length() {
    // A metadata string claiming u64::MAX bytes.
    let mut w = base_gguf();
    let mut payload = u64::MAX.to_le_bytes().to_vec();
    payload.extend_from_slice(b"Gemma");
    w.add_raw_kv("general.name", value_type::STRING, payload);
    expect_gguf_refusal(
        "string-len",
        &w,
        &["\"general.name\"", "string length 18446744073709551615"],
    );
    // A tensor name claiming more bytes than the file has.
    let mut bytes = base_gguf().to_bytes();
    let info = find(&bytes, b"token_embd.weight").expect("name in the infos") - 8;
    bytes[info..info + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let scratch = Scratch::new("name-len");
    let path = scratch.path("name-len.gguf");
    std::fs::write(&path, &bytes).unwrap();
    expect_refusal(
        &path,
        &path,
        &["tensor info", "string length 4611686018427387904"],
    );
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[test]
fn gguf_absurd_array_length() {
    let mut w = base_gguf();
    let mut payload = value_type::STRING.to_le_bytes().to_vec();
    payload.extend_from_slice(&(u64::MAX / 3).to_le_bytes());
    w.add_raw_kv("tokenizer.ggml.tokens", value_type::ARRAY, payload);
    expect_gguf_refusal(
        "array-len",
        &w,
        &[
            "\"tokenizer.ggml.tokens\"",
            "array of 6148914691236517205 items cannot fit",
        ],
    );
}

#[test]
fn gguf_absurd_counts() {
    let mut w = base_gguf();
    w.tensor_count_override = Some(u64::MAX);
    expect_gguf_refusal("tensor-count", &w, &["claims", "tensors", "truncated"]);
    let mut w = base_gguf();
    w.kv_count_override = Some(1 << 60);
    // The reader takes the tensor infos for more metadata and fails there.
    expect_gguf_refusal("kv-count", &w, &["metadata"]);
}

#[test]
fn gguf_more_dims_than_allowed() {
    let mut w = base_gguf();
    let i = tensor_index(&w, "output_norm.weight");
    w.tensors[i].dims.extend([1, 1, 1, 1]);
    expect_gguf_refusal(
        "dims",
        &w,
        &[
            "\"output_norm.weight\"",
            "5 dimensions (GGUF allows 1 to 4)",
        ],
    );
}

#[test]
fn gguf_unknown_dtype() {
    for (id, name) in [(99, "unknown"), (3, "Q4_1")] {
        let mut w = base_gguf();
        let i = tensor_index(&w, "blk.2.attn_k.weight");
        w.tensors[i].type_id = id;
        expect_gguf_refusal(
            "dtype",
            &w,
            &[
                "\"blk.2.attn_k.weight\"",
                &format!("tensor type {name} (id {id}) is not supported"),
            ],
        );
    }
}

/// A quantized tensor whose rows are not whole blocks (the fixture's
/// hidden width is 39) is refused, naming the tensor, its type and the
/// block size, before any of its bytes are read.
#[test]
fn gguf_quantized_rows_must_be_whole_blocks() {
    for (id, name, block) in [
        (8, "Q8_0", 32),
        (6, "Q5_0", 32),
        (12, "Q4_K", 256),
        (14, "Q6_K", 256),
        // `pulsar convert --dtype q8_0`'s private row-block type.
        (0x5055_0108, "Q8_0_R4", 32),
    ] {
        let mut w = base_gguf();
        let i = tensor_index(&w, "blk.1.attn_q.weight");
        w.tensors[i].type_id = id;
        expect_gguf_refusal(
            "quant-rows",
            &w,
            &[
                "\"blk.1.attn_q.weight\"",
                &format!("row length 39 is not a multiple of the {name} block size {block}"),
            ],
        );
    }
}

/// A converted file from before Q5_0's rows went in pairs: its blocks
/// would multiply into nonsense under today's kernels, so the file is
/// refused, naming the tensor and saying to convert again.
#[test]
fn gguf_q5_0_row_blocks_of_the_retired_layout() {
    let mut w = base_gguf();
    let i = tensor_index(&w, "blk.1.attn_q.weight");
    w.tensors[i].type_id = pulsar::model::dtype::RETIRED_Q5_0_ROW_BLOCKS_ID;
    expect_gguf_refusal(
        "retired-q5_0",
        &w,
        &[
            "\"blk.1.attn_q.weight\"",
            "earlier pulsar convert",
            "convert the model again",
        ],
    );
}

/// A quantized block whose f16 scale is NaN or infinite (a damaged
/// download) would turn every logit into NaN without a word: the default
/// model with one scale broken is refused, naming the tensor, its type and
/// the block.
#[test]
fn gguf_quantized_block_with_a_broken_scale() {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let file = GgufFile::open(&model).expect("the default model opens");
    let scratch = Scratch::new("bad-scale");
    // The first scale of a Q5_0 block; the last (a K type's minimum, or
    // Q6_K's one scale) of an ffn_down block.
    for (tensor, block, bad) in [
        ("blk.0.attn_q.weight", 7, half::f16::NAN),
        ("blk.0.ffn_down.weight", 3, half::f16::INFINITY),
    ] {
        let info = file.tensor_info(tensor).expect("the tensor is in the file");
        let offsets = info.dtype.scale_offsets();
        let scale_at = if tensor.contains("ffn_down") {
            offsets.last()
        } else {
            offsets.first()
        };
        let scale_at = *scale_at.expect("a quantized tensor");
        let at = info.start + block * info.dtype.block_bytes() + scale_at;
        let mut bytes = std::fs::read(&model).expect("model read");
        bytes[at..at + 2].copy_from_slice(&bad.to_le_bytes());
        let path = scratch.path("damaged.gguf");
        std::fs::write(&path, &bytes).expect("copy written");
        expect_refusal(
            &path,
            &path,
            &[
                &format!("{tensor:?} is damaged"),
                &format!("{} block {block} (row 0)", info.dtype),
            ],
        );
    }
}

#[test]
fn gguf_missing_tensor() {
    let mut w = base_gguf();
    let i = tensor_index(&w, "blk.3.attn_v.weight");
    w.tensors.remove(i);
    expect_gguf_refusal("missing", &w, &["\"blk.3.attn_v.weight\" is missing"]);
}

#[test]
fn gguf_duplicate_tensor_or_key() {
    let mut w = base_gguf();
    let i = tensor_index(&w, "blk.0.attn_norm.weight");
    let copy = w.tensors[i].clone();
    w.add_raw_tensor(RawTensor {
        offset: None,
        ..copy
    });
    expect_gguf_refusal(
        "dup-tensor",
        &w,
        &["\"blk.0.attn_norm.weight\"", "appears twice"],
    );

    let mut w = base_gguf();
    w.add_u32(&format!("{ARCH}.block_count"), 4);
    expect_gguf_refusal("dup-key", &w, &["\"gemma2.block_count\"", "appears twice"]);
}

#[test]
fn gguf_shape_disagrees_with_config() {
    // A matrix stored transposed.
    let mut w = base_gguf();
    let i = tensor_index(&w, "blk.1.ffn_down.weight");
    w.tensors[i].dims.reverse();
    expect_gguf_refusal(
        "transposed",
        &w,
        &[
            "\"blk.1.ffn_down.weight\" has shape [77, 39]",
            "the config implies [39, 77]",
        ],
    );
    // A config that claims a wider model than the tensors hold.
    let mut w = base_gguf();
    let k = kv_index(&w, "gemma2.feed_forward_length");
    w.kvs[k].payload = 78u32.to_le_bytes().to_vec();
    expect_gguf_refusal("ffn", &w, &["has shape", "the config implies"]);
}

#[test]
fn gguf_unknown_architecture() {
    let mut w = base_gguf();
    let k = kv_index(&w, "general.architecture");
    w.kvs.remove(k);
    w.add_str("general.architecture", "llama");
    expect_gguf_refusal("arch", &w, &["architecture \"llama\" is not supported"]);
}

#[test]
fn gguf_missing_metadata_key() {
    let mut w = base_gguf();
    let k = kv_index(&w, "gemma2.embedding_length");
    w.kvs.remove(k);
    expect_gguf_refusal("no-key", &w, &["\"gemma2.embedding_length\" is missing"]);
}

#[test]
fn gguf_wrong_metadata_type() {
    let mut w = base_gguf();
    let k = kv_index(&w, "gemma2.block_count");
    w.kvs.remove(k);
    w.add_str("gemma2.block_count", "four");
    expect_gguf_refusal(
        "key-type",
        &w,
        &[
            "\"gemma2.block_count\" should be an unsigned integer",
            "string",
        ],
    );
    // A mistyped key holding a vocabulary-sized array: the message shows
    // the start of it, not all of it.
    let mut w = base_gguf();
    let k = kv_index(&w, "gemma2.block_count");
    w.kvs.remove(k);
    let words: Vec<String> = (0..100_000).map(|i| format!("piece{i}")).collect();
    w.add_str_array("gemma2.block_count", &words);
    let msg = expect_gguf_refusal(
        "key-array",
        &w,
        &[
            "\"gemma2.block_count\" should be an unsigned integer",
            "[100000 items",
        ],
    );
    assert!(msg.len() < 400, "{} bytes: {msg}", msg.len());
}

#[test]
fn gguf_more_layers_than_tensors() {
    let mut w = base_gguf();
    let k = kv_index(&w, "gemma2.block_count");
    w.kvs[k].payload = 5u32.to_le_bytes().to_vec();
    expect_gguf_refusal("layers", &w, &["tensor \"blk.4.", "is missing"]);
}

// ---------------------------------------------------------- safetensors

#[test]
fn safetensors_header_length_past_the_file() {
    let scratch = Scratch::new("st-header-len");
    let (header, data) = safetensors_parts();
    let mut bytes = safetensors_bytes(&Json::Object(header).to_string(), &data);
    let claimed = bytes.len() as u64;
    bytes[..8].copy_from_slice(&claimed.to_le_bytes());
    let dir = hf_folder(&scratch, Some(&bytes), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &[&format!("header length {claimed} runs past the end")],
    );
}

#[test]
fn safetensors_header_not_json() {
    let scratch = Scratch::new("st-not-json");
    let (_, data) = safetensors_parts();
    let dir = hf_folder(
        &scratch,
        Some(&safetensors_bytes("{\"a\": [1, 2", &data)),
        None,
    );
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["header is not valid JSON"],
    );

    // JSON, but not an object of tensors.
    let scratch = Scratch::new("st-not-object");
    let dir = hf_folder(&scratch, Some(&safetensors_bytes("[1, 2, 3]", &data)), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["header must be a JSON object"],
    );
}

#[test]
fn safetensors_unknown_dtype() {
    let scratch = Scratch::new("st-dtype");
    let bytes = edited_safetensors(|h| {
        h["model.norm.weight"]["dtype"] = Json::from("F8_E4M3");
    });
    let dir = hf_folder(&scratch, Some(&bytes), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["\"model.norm.weight\"", "dtype F8_E4M3 is not supported"],
    );
}

#[test]
fn safetensors_truncated() {
    let scratch = Scratch::new("st-truncated");
    let full = std::fs::read(fixture_dir().join("model.safetensors")).unwrap();
    for cut in [0, 7, 100, full.len() - 1] {
        let dir = hf_folder(&scratch, Some(&full[..cut]), None);
        let msg = expect_refusal(&dir, &dir.join("model.safetensors"), &[]);
        assert!(msg.contains("truncated"), "cut at {cut}: {msg}");
    }
}

#[test]
fn safetensors_offsets_disagree_with_shape() {
    let scratch = Scratch::new("st-offsets");
    let bytes = edited_safetensors(|h| {
        h["model.layers.0.mlp.up_proj.weight"]["shape"] = serde_json::json!([77, 40]);
    });
    let dir = hf_folder(&scratch, Some(&bytes), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["\"model.layers.0.mlp.up_proj.weight\"", "data_offsets span"],
    );
}

#[test]
fn safetensors_overlapping_offsets() {
    let scratch = Scratch::new("st-overlap");
    let (header, _) = safetensors_parts();
    let norm = header["model.norm.weight"]["data_offsets"].clone();
    let bytes = edited_safetensors(|h| {
        // Same size as model.norm.weight, so only the position is wrong.
        h["model.layers.0.input_layernorm.weight"]["data_offsets"] = norm;
    });
    let dir = hf_folder(&scratch, Some(&bytes), None);
    expect_refusal(&dir, &dir.join("model.safetensors"), &["overlap"]);
}

#[test]
fn safetensors_duplicate_tensor() {
    let scratch = Scratch::new("st-dup");
    let (header, data) = safetensors_parts();
    let text = Json::Object(header.clone()).to_string();
    let entry = header["model.norm.weight"].to_string();
    // JSON objects can repeat a key; serde_json would keep the last.
    let text = format!(
        "{{\"model.norm.weight\": {entry}, {}",
        text.strip_prefix('{').unwrap()
    );
    let dir = hf_folder(&scratch, Some(&safetensors_bytes(&text, &data)), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["\"model.norm.weight\" appears twice"],
    );
}

#[test]
fn safetensors_missing_tensor() {
    let scratch = Scratch::new("st-missing");
    let bytes = edited_safetensors(|h| {
        h.remove("model.layers.2.mlp.gate_proj.weight");
    });
    let dir = hf_folder(&scratch, Some(&bytes), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["\"model.layers.2.mlp.gate_proj.weight\" is missing"],
    );
}

#[test]
fn safetensors_shape_disagrees_with_config() {
    let scratch = Scratch::new("st-shape");
    let bytes = edited_safetensors(|h| {
        // Transposed: same bytes, other shape.
        h["model.layers.3.self_attn.o_proj.weight"]["shape"] = serde_json::json!([56, 39]);
    });
    let dir = hf_folder(&scratch, Some(&bytes), None);
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &[
            "\"model.layers.3.self_attn.o_proj.weight\" has shape [56, 39]",
            "[39, 56]",
        ],
    );
}

// ---------------------------------------------------------- config.json

#[test]
fn config_json_invalid() {
    let scratch = Scratch::new("cfg-invalid");
    let dir = hf_folder(&scratch, None, Some("{\"model_type\": \"gemma2\",,}"));
    expect_refusal(&dir, &dir.join("config.json"), &["not valid JSON"]);
    let scratch = Scratch::new("cfg-utf8");
    let dir = hf_folder(&scratch, None, None);
    std::fs::write(dir.join("config.json"), b"{\"model_type\": \"gemma\xff\"}").unwrap();
    expect_refusal(&dir, &dir.join("config.json"), &["cannot read config"]);
    let scratch = Scratch::new("cfg-array");
    let dir = hf_folder(&scratch, None, Some("[]"));
    expect_refusal(&dir, &dir.join("config.json"), &["must be a JSON object"]);
}

#[test]
fn config_json_missing_key() {
    let scratch = Scratch::new("cfg-missing");
    let config = edited_config(|c| {
        c.remove("hidden_size");
    });
    let dir = hf_folder(&scratch, None, Some(&config));
    expect_refusal(
        &dir,
        &dir.join("config.json"),
        &["\"hidden_size\" is missing"],
    );
}

#[test]
fn config_json_wrong_types() {
    for (key, value, want) in [
        (
            "hidden_size",
            serde_json::json!("39"),
            "a non-negative integer",
        ),
        (
            "num_hidden_layers",
            serde_json::json!(-4),
            "a non-negative integer",
        ),
        ("rms_norm_eps", serde_json::json!([1e-6]), "a number"),
        ("model_type", serde_json::json!(2), "a string"),
    ] {
        let scratch = Scratch::new("cfg-type");
        let config = edited_config(|c| {
            c.insert(key.into(), value.clone());
        });
        let dir = hf_folder(&scratch, None, Some(&config));
        expect_refusal(
            &dir,
            &dir.join("config.json"),
            &[&format!("\"{key}\" should be {want}")],
        );
    }
}

#[test]
fn config_json_unknown_architecture() {
    let scratch = Scratch::new("cfg-arch");
    let config = edited_config(|c| {
        c.insert("model_type".into(), Json::from("llama"));
    });
    let dir = hf_folder(&scratch, None, Some(&config));
    expect_refusal(
        &dir,
        &dir.join("config.json"),
        &["model_type \"llama\" is not supported"],
    );
}

#[test]
fn config_json_more_layers_than_tensors() {
    let scratch = Scratch::new("cfg-layers");
    let config = edited_config(|c| {
        c.insert("num_hidden_layers".into(), Json::from(5));
        c.remove("layer_types");
    });
    let dir = hf_folder(&scratch, None, Some(&config));
    expect_refusal(
        &dir,
        &dir.join("model.safetensors"),
        &["tensor \"model.layers.4.", "is missing"],
    );
}

// ------------------------------------------------------- paths and folders

#[test]
fn folder_with_no_model() {
    let scratch = Scratch::new("empty");
    let empty = scratch.path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    expect_refusal(&empty, &empty, &["no config.json"]);
    // A config but no weights.
    let dir = scratch.path("config-only");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
    expect_refusal(&dir, &dir, &["no model.safetensors"]);
}

#[test]
fn file_from_a_folder_given_as_the_model() {
    let scratch = Scratch::new("hf-part");
    let dir = hf_folder(&scratch, None, None);
    for name in ["model.safetensors", "config.json"] {
        let file = dir.join(name);
        expect_refusal(&file, &file, &["pass the folder that holds it"]);
    }
}

#[test]
fn missing_model_path() {
    let scratch = Scratch::new("missing");
    let path = scratch.path("nowhere.gguf");
    expect_refusal(&path, &path, &["cannot read the model path"]);
}

#[cfg(unix)]
#[test]
fn unreadable_paths() {
    use std::os::unix::fs::symlink;
    let scratch = Scratch::new("unreadable");
    // A symbolic link to itself cannot be followed, whoever runs the test
    // (root reads files whatever their permissions).
    let looping = scratch.path("loop.gguf");
    symlink(&looping, &looping).unwrap();
    expect_refusal(&looping, &looping, &["cannot read the model path"]);
    // A path that runs through a file.
    let file = scratch.path("plain.gguf");
    base_gguf().write(&file).unwrap();
    let through = file.join("inner.gguf");
    expect_refusal(&through, &through, &["cannot read the model path"]);
    // Weights behind a dangling link, and a config behind a looping one.
    let dir = hf_folder(&scratch, None, None);
    let weights = dir.join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    symlink(scratch.path("gone.safetensors"), &weights).unwrap();
    expect_refusal(&dir, &weights, &["cannot open"]);
    let config = dir.join("config.json");
    std::fs::remove_file(&config).unwrap();
    symlink(&config, &config).unwrap();
    expect_refusal(&dir, &config, &["cannot read config"]);
}

#[test]
fn directory_where_a_file_should_be() {
    let scratch = Scratch::new("dirs");
    let dir = hf_folder(&scratch, None, None);
    let weights = dir.join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    std::fs::create_dir(&weights).unwrap();
    expect_refusal(&dir, &weights, &["is a directory"]);
    let config = dir.join("config.json");
    std::fs::remove_file(&config).unwrap();
    std::fs::create_dir(&config).unwrap();
    expect_refusal(&dir, &config, &["is a directory"]);
    // A shard named in an index that is a folder.
    let sharded = scratch.path("sharded");
    std::fs::create_dir_all(sharded.join("shard-1.safetensors")).unwrap();
    std::fs::copy(
        fixture_dir().join("config.json"),
        sharded.join("config.json"),
    )
    .unwrap();
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "shard-1.safetensors"}}"#,
    )
    .unwrap();
    expect_refusal(
        &sharded,
        &sharded.join("shard-1.safetensors"),
        &["is a directory"],
    );
}

// ------------------------------------------------------------ tokenizer

/// A tokenizer.json with one entry whose id is near the loader's limit of
/// 16 million used to size the id table by that id: 512 MB for a 200-byte
/// file. Under a 300 MB address-space limit that aborted; now the id is
/// refused against the number of entries the file really lists.
#[cfg(unix)]
#[test]
fn tokenizer_json_claims_a_huge_id() {
    let scratch = Scratch::new("tok-id");
    let dir = hf_folder(&scratch, None, None);
    let json = dir.join("tokenizer.json");
    std::fs::write(
        &json,
        r#"{"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            "model": {"type": "BPE",
                      "vocab": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "a": 15999999}},
            "added_tokens": []}"#,
    )
    .unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 300000 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_pulsar"))
        .args(["tokenize", "-p", "a", "-m"])
        .arg(&dir)
        .output()
        .expect("sh runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&json.display().to_string()), "{stderr}");
    assert!(stderr.contains("has id 15999999"), "{stderr}");
}

// ---------------------------------------------------------- sharded index

/// A folder whose weights are split over shards named by
/// model.safetensors.index.json, with `index` as that file's text.
fn sharded_folder(scratch: &Scratch, index: &str) -> PathBuf {
    let dir = scratch.path("sharded");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
    std::fs::copy(
        fixture_dir().join("model.safetensors"),
        dir.join("shard-1.safetensors"),
    )
    .unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
    dir
}

#[test]
fn sharded_index_problems() {
    // The unbroken index loads and runs.
    let scratch = Scratch::new("shards-ok");
    let (header, _) = safetensors_parts();
    let map: Map<String, Json> = header
        .keys()
        .map(|k| (k.clone(), Json::from("shard-1.safetensors")))
        .collect();
    let good = serde_json::json!({ "weight_map": map }).to_string();
    let dir = sharded_folder(&scratch, &good);
    let out = pulsar_logits(&dir, &scratch.path("ok.bin"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Not JSON.
    let scratch = Scratch::new("shards-json");
    let dir = sharded_folder(&scratch, "{\"weight_map\": ");
    expect_refusal(&dir, &index_of(&dir), &["not valid JSON"]);
    // No weight_map.
    let scratch = Scratch::new("shards-map");
    let dir = sharded_folder(&scratch, "{\"metadata\": {}}");
    expect_refusal(&dir, &index_of(&dir), &["has no weight_map object"]);
    // A shard that is not there.
    let scratch = Scratch::new("shards-gone");
    let dir = sharded_folder(
        &scratch,
        &good.replacen("shard-1.safetensors", "shard-2.safetensors", 1),
    );
    expect_refusal(&dir, &dir.join("shard-2.safetensors"), &["cannot open"]);
    // A shard name that leaves the folder.
    let scratch = Scratch::new("shards-escape");
    let dir = sharded_folder(
        &scratch,
        &good.replacen("shard-1.safetensors", "../model/shard-1.safetensors", 1),
    );
    expect_refusal(&dir, &index_of(&dir), &["must be a plain file name"]);
    // A tensor the index does not list.
    let scratch = Scratch::new("shards-missing");
    let mut fewer = map.clone();
    fewer.remove("model.layers.1.mlp.up_proj.weight");
    let dir = sharded_folder(
        &scratch,
        &serde_json::json!({ "weight_map": fewer }).to_string(),
    );
    expect_refusal(
        &dir,
        &index_of(&dir),
        &["\"model.layers.1.mlp.up_proj.weight\" is missing"],
    );
}

fn index_of(dir: &Path) -> PathBuf {
    dir.join("model.safetensors.index.json")
}
