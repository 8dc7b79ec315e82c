//! `pulsar convert` writes a GGUF in the fast engine's layout that
//! describes the same model and loads zero-copy.

mod common;

use common::*;
use pulsar::engine::fast::{FastEngine, FastOptions};
use pulsar::engine::kernels::PortableKernels;
use pulsar::engine::packed::WeightFormat;
use pulsar::engine::reference::ReferenceEngine;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::source::ModelSource;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn convert(input: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out =
        std::env::temp_dir().join(format!("pulsar-convert-{}-{name}.gguf", std::process::id()));
    let status = Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .arg("convert")
        .arg(input)
        .arg("-o")
        .arg(&out)
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
        std::fs::remove_file(out).ok();
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
    assert!(
        engine.all_weights_borrowed(),
        "converted weights should be used in place"
    );
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
    std::fs::remove_file(out).ok();
}
