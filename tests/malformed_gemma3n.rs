//! Damaged Gemma 3n models, each broken in one way from the tiny fixtures
//! of tests/data/gemma3n (llama.cpp's GGUF conversion and the HF folder),
//! through the real binary: exit code 1, no panic, one line naming the
//! file and the tensor or key.

mod common;

use pulsar::model::gguf::{GgufFile, Value};
use pulsar::model::gguf_write::GgufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gemma3n")
        .join(name)
}

const GGUF: &str = "tiny-gemma3n-llamacpp-f32.gguf";

/// A writer holding every key and tensor of the GGUF fixture, for one
/// test to break.
fn copy_of_gguf() -> GgufWriter {
    let g = GgufFile::open(&fixture(GGUF)).expect("fixture opens");
    let mut w = GgufWriter::new();
    let mut keys: Vec<&String> = g.metadata().keys().collect();
    keys.sort();
    for key in keys {
        w.add_value(key, &g.metadata()[key]);
    }
    for t in g.tensors() {
        let bytes = g.tensor(&t.name).expect("listed").bytes.to_vec();
        w.add_tensor(&t.name, &t.shape, t.dtype, bytes)
            .expect("sizes match");
    }
    w
}

fn logits(model: &Path, out: &Path) -> std::process::Output {
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

/// Expects `pulsar logits` to refuse `model` in one line naming `names`
/// (the file) and each of `needles`.
fn expect_refusal_of(model: &Path, names: &Path, needles: &[&str]) {
    let out = logits(model, &model.with_extension("bin"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(&names.display().to_string()),
        "names {}: {stderr}",
        names.display()
    );
    for needle in needles {
        assert!(stderr.contains(needle), "should say {needle:?}: {stderr}");
    }
}

/// Writes `w` and expects it refused, naming the file and `needles`.
fn expect_refusal(w: &GgufWriter, needles: &[&str]) {
    let dir = tempfile::tempdir().expect("scratch folder");
    let path = dir.path().join("broken.gguf");
    w.write(&path).expect("write GGUF");
    expect_refusal_of(&path, &path, needles);
}

fn set(w: &mut GgufWriter, key: &str, value: Value) {
    w.kvs.retain(|kv| kv.key != key);
    w.add_value(key, &value);
}

/// A copy of the 7-layer HF folder whose config.json `edit` changes;
/// expects it refused naming config.json (or, with `names_weights`, the
/// safetensors file) and `needles`.
fn expect_hf_refusal(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    names_weights: bool,
    needles: &[&str],
) {
    let source = fixture("tiny-gemma3n-f32");
    let dir = tempfile::tempdir().expect("scratch folder");
    let text = std::fs::read_to_string(source.join("config.json")).unwrap();
    let mut config: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).unwrap();
    edit(&mut config);
    let config_path = dir.path().join("config.json");
    std::fs::write(&config_path, serde_json::to_string(&config).unwrap()).unwrap();
    let weights = dir.path().join("model.safetensors");
    std::fs::copy(source.join("model.safetensors"), &weights).unwrap();
    let named = if names_weights { weights } else { config_path };
    let out_dir = tempfile::tempdir().expect("scratch folder");
    let out = logits(dir.path(), &out_dir.path().join("out.bin"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains(&named.display().to_string()),
        "names {}: {stderr}",
        named.display()
    );
    for needle in needles {
        assert!(stderr.contains(needle), "should say {needle:?}: {stderr}");
    }
}

#[test]
fn the_unbroken_copy_runs() {
    let dir = tempfile::tempdir().expect("scratch folder");
    let path = dir.path().join(GGUF);
    copy_of_gguf().write(&path).expect("write GGUF");
    let out = logits(&path, &path.with_extension("bin"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let mut w = copy_of_gguf();
    w.tensors.retain(|t| t.name != "blk.3.laurel_r.weight");
    expect_refusal(&w, &["blk.3.laurel_r.weight", "missing"]);
}

#[test]
fn a_missing_altup_tensor_is_named() {
    let mut w = copy_of_gguf();
    w.tensors.retain(|t| t.name != "altup_unembd_proj.weight");
    expect_refusal(&w, &["altup_unembd_proj.weight", "missing"]);
    let mut w = copy_of_gguf();
    w.tensors.retain(|t| t.name != "blk.0.laurel_l.weight");
    expect_refusal(&w, &["blk.0.laurel_l.weight", "missing"]);
}

#[test]
fn a_per_layer_array_of_the_wrong_length_is_named() {
    let mut w = copy_of_gguf();
    set(
        &mut w,
        "gemma3n.feed_forward_length",
        Value::Array(vec![Value::U32(96); 5]),
    );
    expect_refusal(
        &w,
        &["gemma3n.feed_forward_length", "5 entries for 22 layers"],
    );
    let mut w = copy_of_gguf();
    set(
        &mut w,
        "gemma3n.activation_sparsity_scale",
        Value::Array(vec![Value::F32(1.6); 21]),
    );
    expect_refusal(
        &w,
        &[
            "gemma3n.activation_sparsity_scale",
            "21 entries for 22 layers",
        ],
    );
}

#[test]
fn a_sparsity_scale_that_is_not_a_number_is_named() {
    let mut w = copy_of_gguf();
    let mut scales = vec![Value::F32(f32::NEG_INFINITY); 22];
    scales[3] = Value::F32(f32::NAN);
    set(
        &mut w,
        "gemma3n.activation_sparsity_scale",
        Value::Array(scales),
    );
    expect_refusal(&w, &["gemma3n.activation_sparsity_scale", "layer 3"]);
}

/// Three AltUp streams claimed where the tensors hold four: the first
/// tensor sized by the count says so.
#[test]
fn an_altup_count_that_disagrees_with_the_tensors_is_named() {
    let mut w = copy_of_gguf();
    set(&mut w, "gemma3n.altup.num_inputs", Value::U32(3));
    expect_refusal(&w, &["blk.0.altup_router.weight", "[4, 64]", "[3, 64]"]);
    // The stacked projections with a slice missing.
    let mut w = copy_of_gguf();
    let t = w
        .tensors
        .iter_mut()
        .find(|t| t.name == "altup_proj.weight")
        .expect("stacked projections");
    // GGUF order: {64, 64, 3}, the stack outermost.
    t.dims[2] = 2;
    let slice = t.data.len() / 3;
    t.data.truncate(2 * slice);
    expect_refusal(&w, &["altup_proj.weight", "[2, 64, 64]", "[3, 64, 64]"]);
}

#[test]
fn a_non_zero_active_stream_is_refused() {
    let mut w = copy_of_gguf();
    set(&mut w, "gemma3n.altup.active_idx", Value::U32(1));
    expect_refusal(&w, &["AltUp active stream 1"]);
}

#[test]
fn sharing_more_layers_than_there_are_is_refused() {
    let mut w = copy_of_gguf();
    set(&mut w, "gemma3n.attention.shared_kv_layers", Value::U32(22));
    expect_refusal(&w, &["22 KV-sharing layers of 22"]);
}

#[test]
fn hf_a_per_layer_width_list_of_the_wrong_length_is_named() {
    expect_hf_refusal(
        |c| {
            c.insert("intermediate_size".into(), serde_json::json!(vec![96; 6]));
        },
        false,
        &["intermediate_size", "6 entries for 7 layers"],
    );
    expect_hf_refusal(
        |c| {
            c.insert(
                "activation_sparsity_pattern".into(),
                serde_json::json!([0.95, 0.9]),
            );
        },
        false,
        &["activation_sparsity_pattern", "2 entries for 7 layers"],
    );
}

#[test]
fn hf_a_sparsity_target_that_is_not_a_fraction_is_named() {
    expect_hf_refusal(
        |c| {
            c.insert(
                "activation_sparsity_pattern".into(),
                serde_json::json!([0.95, 1.5, 0, 0, 0, 0, 0]),
            );
        },
        false,
        &["activation_sparsity_pattern", "layer 1", "1.5"],
    );
}

#[test]
fn hf_an_altup_count_that_disagrees_with_the_tensors_is_named() {
    expect_hf_refusal(
        |c| {
            c.insert("altup_num_inputs".into(), serde_json::json!(5));
        },
        true,
        &["altup.modality_router.weight", "[4, 64]", "[5, 64]"],
    );
}

#[test]
fn hf_a_laurel_rank_that_disagrees_with_the_tensors_is_named() {
    expect_hf_refusal(
        |c| {
            c.insert("laurel_rank".into(), serde_json::json!(16));
        },
        true,
        &["laurel.linear_left.weight", "[8, 64]", "[16, 64]"],
    );
}

#[test]
fn hf_a_per_layer_table_larger_than_the_vocabulary_is_refused() {
    expect_hf_refusal(
        |c| {
            c.insert("vocab_size_per_layer_input".into(), serde_json::json!(300));
        },
        false,
        &["per-layer token table of 300 rows", "vocabulary of 256"],
    );
}

#[test]
fn hf_a_non_zero_active_stream_is_refused() {
    expect_hf_refusal(
        |c| {
            c.insert("altup_active_idx".into(), serde_json::json!(2));
        },
        false,
        &["AltUp active stream 2"],
    );
}

/// `convert` writes a Gemma 3n model from its GGUF only: the HF folder is
/// refused in one line that names it and says what to do instead, and
/// nothing is written.
#[test]
fn convert_refuses_the_hf_folder_in_one_line() {
    let model = fixture("tiny-gemma3n-f32");
    let out = common::ScratchFile::new("pulsar-convert-gemma3n-", "out.gguf");
    let run = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .arg("convert")
        .arg(&model)
        .arg("-o")
        .arg(&*out)
        .output()
        .expect("binary runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    for needle in [
        "tiny-gemma3n-f32",
        "from its GGUF file only",
        "convert_hf_to_gguf.py",
        "run the folder directly",
    ] {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    }
    assert!(!out.exists(), "nothing is written");
}
