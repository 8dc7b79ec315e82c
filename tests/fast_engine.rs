//! The fast engine's driver (packed 16-bit weights, thread split, batched
//! prefill in chunks, KV cache) against the HF reference on the tiny
//! fixtures whose weights are already 16-bit, so only summation order
//! differs from the f32 reference.

mod common;

use common::*;
use pulsar::engine::fast::{FastEngine, FastOptions, WeightFormats};
use pulsar::engine::jit_kernels::JitKernels;
use pulsar::engine::kernels::{MatKernels, PortableKernels};
use pulsar::engine::packed::WeightFormat;
use pulsar::engine::{Engine, LogitsWanted};
use pulsar::model::config::ModelConfig;
use pulsar::model::source::ModelSource;

type MakeKernels = fn(&ModelConfig, WeightFormat) -> Box<dyn MatKernels>;

/// The JIT's kernels and the plain-Rust ones; both must give the same
/// answers through the same driver.
fn kernel_sets() -> Vec<(&'static str, MakeKernels)> {
    vec![
        ("jit", |c, f| {
            Box::new(
                JitKernels::build(c, WeightFormats::uniform(f), 2).expect("JIT builds on this CPU"),
            )
        }),
        ("portable", |_, _| Box::new(PortableKernels)),
    ]
}

fn check(fixture: &str, reference: &str, dtype: &str, tolerance: f32) {
    let oracle = oracle_dir();
    let meta = read_json(&oracle.join(reference).join("reference.json"));
    let input = ids(&meta["input_ids"]);
    let expected = read_f32(
        &oracle
            .join(reference)
            .join(format!("logits_{dtype}weights.bin")),
    );
    let src = std::sync::Arc::new(ModelSource::open(&oracle.join(fixture)).expect("fixture opens"));
    let vocab = src.config.vocab_size;
    for (name, make) in kernel_sets() {
        for threads in [1, 2, 3] {
            // A chunk of 5 makes the prefill cross chunk boundaries.
            let opts = FastOptions {
                threads,
                context: 64,
                format: None,
                prefill_chunk: 5,
                // A plain F16/BF16 file is not in the kernels' layout, so
                // in place falls back to converting (tests/convert.rs
                // covers the zero-copy load of a converted file).
                in_place: threads == 2,
                native: false,
            };
            let format = FastEngine::weight_format_for(&src, &opts).unwrap();
            let mut engine =
                FastEngine::load(&src, make(&src.config, format), &opts).expect("loads");
            let logits = engine.forward(&input, LogitsWanted::All).unwrap();
            let (diff, at) = max_abs_diff(&logits, &expected);
            println!("{fixture} {name} x{threads}: max abs diff {diff:e}");
            assert!(
                diff <= tolerance,
                "{fixture} ({name}, {threads} threads): logits differ by {diff} at position {}",
                at / vocab
            );

            // Decoding token by token after a prefill gives the same rows.
            engine.truncate(0);
            let split = input.len() / 2;
            let mut rows = engine.forward(&input[..split], LogitsWanted::All).unwrap();
            for &t in &input[split..] {
                rows.extend(engine.forward(&[t], LogitsWanted::Last).unwrap());
            }
            // GEMV (decode) and GEMM (prefill) sum in different orders, so
            // allow f32 rounding relative to the logits' size.
            let scale = logits.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            let (diff, _) = max_abs_diff(&rows, &logits);
            assert!(
                diff <= 1e-5 * scale,
                "{fixture}: prefill+decode differs from one pass by {diff} (scale {scale})"
            );
        }
    }
}

#[test]
fn tiny_gemma1_f16() {
    check("tiny-gemma1-f16", "tiny-gemma1-ref", "f16", 1e-4);
}

#[test]
fn tiny_gemma1_bf16_stays_bf16() {
    check("tiny-gemma1-bf16", "tiny-gemma1-ref", "bf16", 1e-4);
}

#[test]
fn tiny_gemma2_f16() {
    check("tiny-gemma2-f16", "tiny-gemma2-ref", "f16", 2e-4);
}

#[test]
fn tiny_gemma3_f16() {
    check("tiny-gemma3-f16", "tiny-gemma3-ref", "f16", 1e-4);
}

#[test]
fn context_overflow_is_an_error() {
    let src =
        std::sync::Arc::new(ModelSource::open(&oracle_dir().join("tiny-gemma3-f16")).unwrap());
    let opts = FastOptions {
        threads: 1,
        context: 4,
        format: None,
        prefill_chunk: 64,
        in_place: false,
        native: false,
    };
    let mut engine = FastEngine::load(&src, Box::new(PortableKernels), &opts).unwrap();
    engine.forward(&[2, 5, 6], LogitsWanted::Last).unwrap();
    let err = engine.forward(&[7, 8], LogitsWanted::Last).unwrap_err();
    assert!(err.to_string().contains("context full"), "{err}");
}

#[test]
fn real_model_jit_logits_within_fp16_yardstick() {
    let dir = oracle_dir().join("gemma3-270m");
    let meta = read_json(&dir.join("prompt_a.json"));
    let prompt = ids(&meta["input_ids"]);
    let path = pulsar::model::fetch::default_model_path().expect("default model");
    let src = std::sync::Arc::new(ModelSource::open(&path).unwrap());
    let opts = FastOptions {
        threads: 2,
        context: 64,
        format: None,
        prefill_chunk: 64,
        in_place: false,
        native: false,
    };
    let format = FastEngine::weight_format_for(&src, &opts).unwrap();
    assert_eq!(format, WeightFormat::F16);
    let kernels =
        Box::new(JitKernels::build(&src.config, WeightFormats::uniform(format), 2).unwrap());
    let mut engine = FastEngine::load(&src, kernels, &opts).unwrap();
    assert!(engine.kernels_name().starts_with("jit"));
    let logits = engine.forward(&prompt, LogitsWanted::Last).unwrap();
    let f32_ref = read_f32(&dir.join("final_logits_a_f32.bin"));
    let (diff, _) = max_abs_diff(&logits, &f32_ref);
    println!("270M jit vs f32 oracle: {diff:e}");
    assert!(
        diff <= 0.02,
        "jit logits differ from the f32 oracle by {diff}"
    );
    // Against HF with the same FP16 rounding of the weights, only
    // summation order differs.
    let f16_ref = read_f32(&dir.join("final_logits_a_fp16weights.bin"));
    let (diff16, _) = max_abs_diff(&logits, &f16_ref);
    println!("270M jit vs fp16-weights oracle: {diff16:e}");
    assert!(
        diff16 <= 2e-3,
        "jit logits differ from the fp16-weight oracle by {diff16}"
    );
}

/// Awkward shapes (K and rows not multiples of 8/16/32, 6 heads over 2 KV
/// heads, softcaps, windows): the JIT kernels and the portable ones give
/// the same logits from the same FP16 weights.
#[test]
fn jit_matches_portable_on_awkward_shapes() {
    for name in ["awkward-gemma1", "awkward-gemma2", "awkward-gemma3"] {
        let fx = load_fixture(name);
        let src = std::sync::Arc::new(ModelSource::open(&fx.dir).unwrap());
        let opts = FastOptions {
            threads: 2,
            context: 32,
            format: Some(WeightFormat::F16),
            prefill_chunk: 4,
            in_place: false,
            native: false,
        };
        let jit = Box::new(
            JitKernels::build(&src.config, WeightFormats::uniform(WeightFormat::F16), 2)
                .expect("JIT builds"),
        );
        let mut a = FastEngine::load(&src, jit, &opts).unwrap();
        let mut b = FastEngine::load(&src, Box::new(PortableKernels), &opts).unwrap();
        let la = a.forward(&fx.input, LogitsWanted::All).unwrap();
        let lb = b.forward(&fx.input, LogitsWanted::All).unwrap();
        let (diff, _) = max_abs_diff(&la, &lb);
        println!("{name}: jit vs portable {diff:e}");
        assert!(
            diff <= 1e-4,
            "{name}: jit and portable kernels differ by {diff}"
        );
        // FP16 rounding of the weights keeps it near the float64 oracle.
        let (diff, _) = max_abs_diff(&la, &fx.logits);
        assert!(diff <= 2e-2, "{name}: {diff} from the oracle");
    }
}

/// Each form of the 16-bit GEMM this host can run, forced by the plan's
/// options as `PULSAR_MAX_ISA` forces the ISA: AVX-512 BF16 dot products
/// (BF16 weights), AVX-512 FMA on zmm, AVX2. The fast engine prefills
/// a 41-token input in one chunk (the GEMM) and is held to the reference
/// engine on the same weights: 1e-4 with f32 inputs (summation order
/// only), 1e-2 for the dot products, whose inputs are rounded to bf16
/// (2^-9 relative each; measured 2.8e-3 on this fixture, Zen 4). Decoding after part of the prompt (the GEMV, f32
/// inputs) stays within the same bound.
#[test]
fn sixteen_bit_gemm_forms_match_the_reference_engine() {
    use pulsar::engine::jit_kernels::plan_options;
    use pulsar::engine::reference::ReferenceEngine;
    use pulsar::jit::cpu::{CpuCaps, Isa};
    use pulsar::jit::plan::PlanOptions;
    let caps = CpuCaps::detect();
    let oracle = oracle_dir();
    let meta = read_json(&oracle.join("tiny-gemma1-ref").join("reference.json"));
    let prompt = ids(&meta["input_ids"]);
    // Longer than a run computed as one-token steps (16), so the prefill
    // goes through the GEMM; 41 tokens: 6 whole tiles of 6 and a part.
    let input: Vec<u32> = (0..41).map(|i| prompt[i % prompt.len()]).collect();
    for fixture in ["tiny-gemma1-bf16", "tiny-gemma1-f16"] {
        let src = std::sync::Arc::new(ModelSource::open(&oracle.join(fixture)).expect("opens"));
        let want = ReferenceEngine::load(&src)
            .expect("reference loads")
            .forward(&input, LogitsWanted::All)
            .unwrap();
        let opts = FastOptions {
            threads: 2,
            context: 64,
            format: None,
            prefill_chunk: 64,
            in_place: false,
            native: false,
        };
        let format = FastEngine::weight_format_for(&src, &opts).unwrap();
        let bf16 = format == WeightFormat::BF16;
        // (form, max ISA, dot products allowed, zmm GEMV, tolerance)
        let mut forms = vec![("avx2", Isa::Avx2, true, false, 1e-4f32)];
        if caps.has_avx512() {
            forms.push(("avx512 fma", Isa::Avx512, false, false, 1e-4));
            // The GEMV on zmm (decode and the exact tokens), with the FMA GEMM.
            forms.push(("avx512 fma, zmm gemv", Isa::Avx512, false, true, 1e-4));
            if bf16 && caps.avx512_bf16 {
                forms.push(("avx512 bf16 dot", Isa::Avx512, true, false, 1e-2));
            } else {
                println!(
                    "{fixture}: no BF16 dot products on this CPU or weights; FMA form checked"
                );
            }
        } else {
            println!("{fixture}: this CPU has no AVX-512; the AVX2 form is checked");
        }
        for (form, max_isa, bf16_dot, zmm_gemv, tolerance) in forms {
            let plan = PlanOptions {
                max_isa,
                bf16_dot,
                zmm_gemv,
                ..plan_options(&src.config, &WeightFormats::uniform(format), 2)
            };
            let kernels = JitKernels::with_options(&src.config, plan)
                .expect("JIT builds")
                .expect("this CPU has AVX2");
            let name = kernels.name();
            let wanted_gemm = match (max_isa, bf16_dot && bf16 && caps.avx512_bf16) {
                (Isa::Avx2, _) => "r4t3",
                (_, true) => "_dot",
                _ => "_fma",
            };
            assert!(
                max_isa == Isa::Avx2 && !name.contains("gemm") || name.contains(wanted_gemm),
                "{fixture} {form}: kernels {name}"
            );
            assert_eq!(
                name.contains("16-bit GEMV"),
                zmm_gemv,
                "{fixture} {form}: kernels {name}"
            );
            let mut engine = FastEngine::load(&src, Box::new(kernels), &opts).expect("loads");
            let got = engine.forward(&input, LogitsWanted::All).unwrap();
            let (diff, at) = max_abs_diff(&got, &want);
            println!("{fixture} {form} ({name}): max abs diff {diff:e} from the reference");
            assert!(
                diff <= tolerance,
                "{fixture} {form}: logits differ from the reference engine by {diff} at {at}"
            );
            engine.truncate(0);
            let split = input.len() / 2;
            let mut rows = engine.forward(&input[..split], LogitsWanted::All).unwrap();
            for &t in &input[split..] {
                rows.extend(engine.forward(&[t], LogitsWanted::Last).unwrap());
            }
            let (diff, _) = max_abs_diff(&rows, &want);
            assert!(
                diff <= tolerance,
                "{fixture} {form}: prefill + decode differ from the reference by {diff}"
            );
        }
    }
}
