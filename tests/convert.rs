//! `pulsar convert` writes a GGUF in the fast engine's layout that
//! describes the same model and loads zero-copy.

mod common;

use common::*;
use pulsar::engine::fast::{FastEngine, FastOptions};
use pulsar::engine::jit_kernels::JitKernels;
use pulsar::engine::kernels::PortableKernels;
use pulsar::engine::packed::{PackedMatrix, WeightFormat};
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::dequant;
use pulsar::model::dtype::DType;
use pulsar::model::gguf::GgufFile;
use pulsar::model::quant_blocks::QuantType;
use pulsar::model::source::{LayerRole, ModelSource, Role};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// Converts `input` to `{name}.gguf` in a temp folder that goes when the
/// returned path is dropped, after the child has exited.
fn convert(input: &Path, name: &str, extra: &[&str]) -> ScratchFile {
    let out = ScratchFile::new(&format!("pulsar-convert-{name}-"), &format!("{name}.gguf"));
    let status = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .arg("convert")
        .arg(input)
        .arg("-o")
        .arg(&*out)
        .args(extra)
        .output()
        .expect("binary runs");
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    out
}

fn reference_logits(path: &Path, tokens: &[u32]) -> Vec<f32> {
    let src = ModelSource::open(path).unwrap();
    ReferenceEngine::load(&src)
        .unwrap()
        .forward(tokens, LogitsWanted::All)
        .unwrap()
}

#[test]
fn f16_checkpoints_convert_bit_exactly() {
    for fixture in ["tiny-gemma1-f16", "tiny-gemma2-f16", "tiny-gemma3-f16"] {
        let input = oracle_dir().join(fixture);
        let out = convert(&input, fixture, &[]);
        let original = ModelSource::open(&input).unwrap();
        let converted = ModelSource::open(&out).unwrap();
        let mut want = original.config.clone();
        // The converted file stores norms as final multipliers.
        want.norm_weight_offset = 0.0;
        assert_eq!(
            converted.config, want,
            "{fixture}: config survives conversion"
        );
        let tokens = [2u32, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100];
        let (a, b) = (
            reference_logits(&input, &tokens),
            reference_logits(&out, &tokens),
        );
        assert_eq!(a, b, "{fixture}: logits change after conversion");
    }
}

#[test]
fn awkward_config_survives_and_loads_zero_copy() {
    // query_pre_attn_scalar 17 and a 1-in-2 global pattern are not
    // expressible in llama.cpp's keys; the pulsar.* keys carry them.
    let fx = load_fixture("awkward-gemma3");
    let out = convert(&fx.dir, "awkward3", &["--dtype", "f16"]);
    let original = ModelSource::open(&fx.dir).unwrap();
    let converted = Arc::new(ModelSource::open(&out).unwrap());
    let mut want = original.config.clone();
    want.norm_weight_offset = 0.0;
    assert_eq!(converted.config, want);

    let opts = FastOptions {
        threads: 2,
        context: 32,
        format: None,
        prefill_chunk: 64,
        in_place: true,
        native: false,
    };
    let mut engine = FastEngine::load(&converted, Box::new(PortableKernels), &opts).unwrap();
    let (in_place, total) = engine.matrices_in_place();
    assert_eq!(in_place, total, "converted weights should be used in place");
    let logits = engine.forward(&fx.input, LogitsWanted::All).unwrap();
    // The same FP16 rounding done at load from the original folder must
    // give exactly the same numbers.
    let f16_opts = FastOptions {
        format: Some(WeightFormat::F16),
        in_place: false,
        native: false,
        ..opts
    };
    let mut direct =
        FastEngine::load(&Arc::new(original), Box::new(PortableKernels), &f16_opts).unwrap();
    let same = direct.forward(&fx.input, LogitsWanted::All).unwrap();
    assert_eq!(
        max_abs_diff(&logits, &same).0,
        0.0,
        "conversion changed the numbers"
    );
    // And FP16 rounding keeps it near the float64 oracle.
    let (diff, _) = max_abs_diff(&logits, &fx.logits);
    assert!(
        diff < 2e-2,
        "converted awkward-gemma3 differs from the oracle by {diff}"
    );
}

/// The fast engine on the JIT's kernels, planned for the formats `opts`
/// gives this model.
fn jit_engine(src: &Arc<ModelSource>, opts: &FastOptions) -> FastEngine {
    let formats = FastEngine::weight_formats(src, opts).unwrap();
    let kernels = Box::new(JitKernels::build(&src.config, formats, 2).unwrap());
    FastEngine::load(src, kernels, opts).unwrap()
}

/// A small engine's options with the weights copied, in `format` (`None`:
/// the file's own types, `--dtype native`).
fn loaded_as(format: Option<WeightFormat>) -> FastOptions {
    FastOptions {
        threads: 2,
        context: 32,
        format,
        prefill_chunk: 64,
        in_place: false,
        native: format.is_none(),
    }
}

/// The type a file stores layer 0's attn_q in.
fn attn_q_dtype(src: &ModelSource) -> DType {
    let c = &src.config;
    src.tensor(
        Role::Layer(0, LayerRole::Q),
        &[c.n_heads * c.head_dim, c.hidden],
    )
    .unwrap()
    .dtype
}

/// The converted file, its weights used in place (`--mmap`) and copied,
/// computes `want` bit for bit with the native options `opts`.
/// `stays_in_file_type` matrices are converted at load even with
/// `--mmap`: the file keeps them in their own type.
fn assert_computes_in_place_and_copied(
    converted: &Arc<ModelSource>,
    opts: FastOptions,
    tokens: &[u32],
    want: &[f32],
    name: &str,
    stays_in_file_type: usize,
) {
    for in_place in [true, false] {
        let mut engine = jit_engine(converted, &FastOptions { in_place, ..opts });
        let (used_in_place, total) = engine.matrices_in_place();
        let expected = if in_place {
            total - stays_in_file_type
        } else {
            0
        };
        assert_eq!(
            used_in_place, expected,
            "{name}: of {total} weights used in place (only with --mmap)"
        );
        let got = engine.forward(tokens, LogitsWanted::All).unwrap();
        assert!(
            got.iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name} (in place: {in_place}): the converted file computes other logits, by up to {}",
            max_abs_diff(&got, want).0
        );
    }
}

/// `convert --dtype q8_0|q4_0` writes the quantized row blocks that the
/// same `--dtype` makes at load, under their private types: the file then
/// computes the very same logits, used in place (`--mmap`) or copied, and
/// the reference engine reads it too.
#[test]
fn quantized_conversion_computes_what_quantizing_at_load_does() {
    let input = oracle_dir().join("tiny-gemma3-f16");
    let original = Arc::new(ModelSource::open(&input).unwrap());
    let tokens = [2u32, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100];
    // Q8_0 is written in the layout this CPU's kernels read (16-row blocks
    // with VNNI).
    let q8_0 = pulsar::engine::jit_kernels::quant_layouts().q8_0;
    for (name, format, q) in [
        ("q8_0", WeightFormat::Q8_0, q8_0),
        ("q4_0", WeightFormat::Q4_0, QuantType::Q4_0),
    ] {
        let out = convert(&input, &format!("tiny3-{name}"), &["--dtype", name]);
        let converted = Arc::new(ModelSource::open(&out).unwrap());
        // Every matrix of this model has whole 32-value rows.
        let c = &converted.config;
        let q_proj = converted
            .tensor(
                Role::Layer(0, LayerRole::Q),
                &[c.n_heads * c.head_dim, c.hidden],
            )
            .unwrap();
        assert_eq!(q_proj.dtype, DType::QuantRowBlocks(q), "{name}: attn_q");
        let head = converted
            .tensor(Role::Embedding, &[c.vocab_size, c.hidden])
            .unwrap();
        assert_eq!(head.dtype, DType::QuantRowBlocks(q), "{name}: token_embd");

        let at_load = loaded_as(Some(format));
        let want = jit_engine(&original, &at_load)
            .forward(&tokens, LogitsWanted::All)
            .unwrap();
        let native = FastOptions {
            format: None,
            native: true,
            ..at_load
        };
        assert_computes_in_place_and_copied(&converted, native, &tokens, &want, name, 0);
        // What the reference engine reads: the very values quantizing at
        // load gives (dequantized exactly), and logits near the JIT's,
        // whose inputs are rounded to 8 bits (measured 0.037 for q4_0).
        let shape = [c.n_heads * c.head_dim, c.hidden];
        let source = original
            .tensor(Role::Layer(0, LayerRole::Q), &shape)
            .unwrap();
        let packed = PackedMatrix::convert(&source, format);
        let read = dequant::to_f32(&q_proj);
        let mut row = vec![0.0f32; shape[1]];
        for (r, want_row) in read.chunks_exact(shape[1]).enumerate() {
            packed.row_f32(r, &mut row);
            assert!(
                row.iter()
                    .zip(want_row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: row {r} of attn_q reads back other values"
            );
        }
        let (to_jit, _) = max_abs_diff(&reference_logits(&out, &tokens), &want);
        assert!(
            to_jit < 0.1,
            "{name}: the reference on the converted file is {to_jit} from the JIT"
        );

        // A broken scale in the row blocks is refused, naming the row it
        // belongs to: row block 1, group 1, the third row's scale is row
        // `block_rows + 2`'s block 1 (8 blocks a row).
        let info = GgufFile::open(&out)
            .unwrap()
            .tensor_info("blk.0.attn_q.weight")
            .expect("attn_q in the file")
            .clone();
        let at = info.start + (8 + 1) * q.group_bytes() + 2 * 2;
        let mut bytes = std::fs::read(&out).unwrap();
        bytes[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
        let damaged = out.with_extension("damaged.gguf");
        std::fs::write(&damaged, &bytes).unwrap();
        let err = ModelSource::open(&damaged)
            .and_then(|src| src.tensor(Role::Layer(0, LayerRole::Q), &shape).map(|_| ()))
            .expect_err("a NaN scale is refused")
            .to_string();
        let rb_name = DType::QuantRowBlocks(q).to_string();
        let row = q.block_rows() + 2;
        assert!(
            err.contains("\"blk.0.attn_q.weight\" is damaged")
                && err.contains(&format!("{rb_name} block {} (row {row})", row * 8 + 1)),
            "{err}"
        );
    }
}

/// `convert --dtype native` keeps the default model's own types (Q5_0
/// and Q8_0 in this CPU's layouts, the K-quants requantized as at load):
/// the file computes, in place or copied, the very logits the GGUF does
/// with `--dtype native`.
#[test]
fn native_conversion_of_the_default_model_computes_what_loading_it_does() {
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let original = Arc::new(ModelSource::open(&path).unwrap());
    let out = convert(&path, "default-native", &["--dtype", "native"]);
    let converted = Arc::new(ModelSource::open(&out).unwrap());
    assert_eq!(
        attn_q_dtype(&converted),
        DType::QuantRowBlocks(pulsar::engine::jit_kernels::quant_layouts().q5_0)
    );
    let tokens = [2u32, 818, 5279, 529, 7001, 563];
    let opts = loaded_as(None);
    let want = jit_engine(&original, &opts)
        .forward(&tokens, LogitsWanted::All)
        .unwrap();
    let formats = FastEngine::weight_formats(&converted, &opts).unwrap();
    assert_eq!(
        formats.describe(),
        FastEngine::weight_formats(&original, &opts)
            .unwrap()
            .describe(),
        "the converted file keeps the formats loading gives"
    );
    // Q4_K stays Q4_K in the file: its offsets have no place in a Q5_0
    // row-block tensor, so loading converts it as it converts the GGUF's.
    let kept: usize = formats
        .converted
        .iter()
        .filter(|c| c.from == DType::Q4K)
        .map(|c| c.count)
        .sum();
    assert_eq!(kept, 27, "18 attn_output and 9 ffn_down");
    assert_computes_in_place_and_copied(&converted, opts, &tokens, &want, "native", kept);
}

/// Without `--dtype` a quantized file keeps its own types: the default
/// Q4_K_M model is not widened to FP16 (543 MB), and the one line that says
/// other readers refuse the result is there unless the name says so.
#[test]
fn convert_keeps_the_files_own_types_by_default() {
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let input_bytes = std::fs::metadata(&model).unwrap().len();
    for name in ["plain", "model.pulsar"] {
        let out = ScratchFile::new("pulsar-convert-native-", &format!("{name}.gguf"));
        let run = Command::new(env!("CARGO_BIN_EXE_pulsar"))
            .arg("convert")
            .arg(&model)
            .arg("-o")
            .arg(&*out)
            .output()
            .expect("binary runs");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{stderr}");
        let written = std::fs::metadata(&*out).unwrap().len();
        // Q6_K becomes Q8_0 (said on stderr); nothing becomes FP16.
        assert!(
            (written as f64) < input_bytes as f64 * 1.3,
            "{written} bytes from {input_bytes}: {stderr}"
        );
        let warned = stderr.contains("other GGUF readers refuse");
        assert_eq!(warned, name == "plain", "{stderr}");
    }
}

/// Gemma 4 (dense and MoE) and Gemma 3n keep their GGUF's keys and tensor
/// list, every matrix in the kernels' row blocks, expert and AltUp stacks
/// included: the converted file computes, in place or copied, the very
/// logits loading the GGUF in the same formats does.
#[test]
fn gemma4_and_gemma3n_convert_to_files_used_in_place() {
    let gemma4 = oracle_dir().join("gemma4");
    let gemma3n = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma3n");
    let tokens = [2u32, 10, 20, 30, 40, 50, 60, 70];
    for (input, stack) in [
        (
            gemma4.join("tiny-gemma4-moe-f32.gguf"),
            Some("blk.0.ffn_down_exps.weight"),
        ),
        (gemma4.join("tiny-gemma4-dense-f32.gguf"), None),
        (
            gemma3n.join("tiny-gemma3n-llamacpp-f32.gguf"),
            Some("altup_proj.weight"),
        ),
    ] {
        let original = Arc::new(ModelSource::open(&input).unwrap());
        for (dtype, format) in [("q8_0", Some(WeightFormat::Q8_0)), ("native", None)] {
            let name = format!("{}-{dtype}", input.file_stem().unwrap().to_string_lossy());
            let out = convert(&input, &name, &["--dtype", dtype]);
            let converted = Arc::new(ModelSource::open(&out).unwrap());
            let file = GgufFile::open(&out).unwrap();
            assert_eq!(
                file.tensors().len(),
                original.gguf().unwrap().tensors().len(),
                "{name}: every tensor of the source"
            );
            if let Some(stack) = stack {
                let t = file.tensor_info(stack).expect("the stack is kept");
                assert!(t.dtype.is_row_blocked(), "{name}: {stack} is {}", t.dtype);
                assert_eq!(t.shape.len(), 3, "{name}: {stack} stays one tensor");
            }
            let at_load = loaded_as(format);
            let want = jit_engine(&original, &at_load)
                .forward(&tokens, LogitsWanted::All)
                .unwrap();
            let native = FastOptions {
                format: None,
                native: true,
                ..at_load
            };
            assert_computes_in_place_and_copied(&converted, native, &tokens, &want, &name, 0);
        }
    }
}
