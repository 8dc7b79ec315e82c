//! `pulsar dump` end to end, driving the built binary.

mod common;

use common::ScratchFile;
use pulsar::jit::cpu::CpuCaps;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const GEMMA_2B: &str = r#"{
  "architectures": ["GemmaForCausalLM"],
  "model_type": "gemma",
  "hidden_size": 2048,
  "intermediate_size": 16384,
  "num_attention_heads": 8,
  "num_key_value_heads": 1,
  "head_dim": 256,
  "vocab_size": 256000,
  "num_hidden_layers": 18
}"#;

fn pulsar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pulsar"))
        .args(args)
        .output()
        .expect("run pulsar")
}

fn dump_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["dump", "--json"];
    all.extend_from_slice(args);
    let out = pulsar(&all);
    assert!(
        out.status.success(),
        "pulsar {all:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

/// The checks the issue asks for, on one dump.
fn check_dump(j: &serde_json::Value, expect_isa: Option<&str>) {
    assert_eq!(j["verified"], true);
    assert_eq!(j["budget_bytes"], 5120);
    let total = j["total_bytes"].as_u64().unwrap();
    assert!(total <= 5120, "total {total} over budget");
    let kernels = j["kernels"].as_array().unwrap();
    assert!(kernels.len() >= 5, "{kernels:?}");
    let mut sum = 0;
    for k in kernels {
        let name = k["name"].as_str().unwrap();
        let bytes = k["bytes"].as_u64().unwrap();
        assert!(
            bytes > 0 && k["instructions"].as_u64().unwrap() > 0,
            "{name}"
        );
        assert_eq!(k["spec"]["name"], name);
        assert!(k["spec"]["kind"].is_string(), "{name}");
        sum += bytes;
    }
    assert_eq!(sum, total);
    if let Some(isa) = expect_isa {
        assert_eq!(j["isa"], isa);
    }
}

fn names(j: &serde_json::Value) -> Vec<String> {
    j["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["name"].as_str().unwrap().to_string())
        .collect()
}

/// The 2B config in a temp folder that goes when the returned path is
/// dropped; keep it until the children reading it have exited.
fn write_2b_config() -> ScratchFile {
    let cfg = ScratchFile::new("pulsar-jit-dump-2b-", "config.json");
    std::fs::write(&cfg, GEMMA_2B).unwrap();
    cfg
}

#[test]
fn gemma_2b_config_dumps_within_budget() {
    let cfg = write_2b_config();
    let path = cfg.to_str().unwrap();
    for isa in [None, Some("avx2")] {
        let mut args = vec!["-m", path];
        if let Some(i) = isa {
            args.extend(["--max-isa", i]);
        }
        let j = dump_json(&args);
        check_dump(&j, isa);
        let n = names(&j);
        assert!(
            n.iter()
                .any(|s| s.starts_with("gemv_f16_r4_") && s.contains("_k2048")),
            "{n:?}"
        );
        assert!(
            n.iter()
                .any(|s| s.starts_with("gemv_f16_r4_") && s.contains("_k16384")),
            "{n:?}"
        );
        assert!(
            n.iter()
                .any(|s| s == "rmsnorm_d2048_u2" || s == "rmsnorm_d2048_u1"),
            "{n:?}"
        );
    }
}

fn default_model() -> PathBuf {
    let home = std::env::var_os("HOME").expect("HOME must be set to find the default model");
    let p = Path::new(&home).join(".cache/pulsar/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "default model missing at {}: download gemma-3-270m-q4_k_m.gguf there (this test does not skip)",
        p.display()
    );
    p
}

#[test]
fn default_model_dumps_within_budget() {
    default_model();
    for isa in [None, Some("avx2")] {
        let args: Vec<&str> = isa.map(|i| vec!["--max-isa", i]).unwrap_or_default();
        let j = dump_json(&args);
        check_dump(&j, isa);
        let n = names(&j);
        // The default model's matrices are read in the file's own types:
        // Q8_0 in 16-row blocks, whose GEMM also takes single tokens (no
        // Q8_0 GEMV). With VNNI (where the CPU and --max-isa allow it)
        // Q5_0 is in 16-row blocks too, unpacked in registers by a GEMM of
        // its own that also takes single tokens: no GEMV, no unpacking.
        // Under AVX2 Q5_0 has its own one-token kernel (K is an argument)
        // and its panels are unpacked into Q8_0x16's blocks with its own
        // offset, for a GEMM of their own; and no 16-bit kernel for its
        // matrices.
        let caps = CpuCaps::detect();
        // The plan's rule: VNNI where AVX-512 is allowed and present.
        let vnni = isa.is_none() && caps.has_avx512() && caps.avx512_vnni;
        let gemm_suffix = if vnni { "_vnni_pf" } else { "t8_pf" };
        let q5_0_gemv = n
            .iter()
            .any(|s| s.starts_with("gemv_q5_0_r4_pf") || s.starts_with("gemv_q5_0_r8_pf"));
        let unpacks = n.iter().filter(|s| s.starts_with("unpack_")).count();
        assert!(
            !n.iter().any(|s| s.starts_with("gemv_q8_0")),
            "no Q8_0 GEMV: {n:?}"
        );
        let gemms: &[&str] = if vnni {
            assert!(!q5_0_gemv && unpacks == 0, "{n:?}");
            &["gemm_q8_0x16_r16t8", "gemm_q5_0x16k_r16t8"]
        } else {
            // One row block or two per pass: the planner trades the pair
            // first when the plan is over budget.
            assert!(q5_0_gemv, "{n:?}");
            let unpack = "unpack_q5_0_r4_to_q5_0x16";
            assert!(n.iter().any(|s| s.starts_with(unpack)), "{unpack} in {n:?}");
            &["gemm_q8_0x16_r16t8", "gemm_q5_0x16_r16t8"]
        };
        for kernel in gemms {
            assert!(
                n.iter()
                    .any(|s| s.starts_with(kernel) && s.contains(gemm_suffix)),
                "{kernel}..{gemm_suffix} in {n:?}"
            );
        }
        let all_gemms = n.iter().filter(|s| s.starts_with("gemm_q")).count();
        assert_eq!(all_gemms, gemms.len(), "{n:?}");
        assert!(
            !n.iter()
                .any(|s| s.starts_with("gemm_f16") || s.starts_with("gemv_f16")),
            "{n:?}"
        );
        let f16 = dump_json(&[&args[..], &["--dtype", "f16"]].concat());
        let n = names(&f16);
        for k in ["_k640", "_k1024", "_k2048"] {
            assert!(
                n.iter().any(|s| s.starts_with("gemv_f16") && s.contains(k)),
                "--dtype f16: {k} in {n:?}"
            );
        }
        assert!(!n.iter().any(|s| s.starts_with("gemv_q")), "{n:?}");
        assert!(
            n.iter().any(|s| s.starts_with("rmsnorm_d256")),
            "q/k norm kernel in {n:?}"
        );
    }
}

#[test]
fn out_writes_bin_and_asm_per_kernel() {
    let cfg = write_2b_config();
    // Removed on drop when the test ends, pass or fail.
    let tmp = tempfile::Builder::new()
        .prefix("pulsar-jit-dump-out-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let out = pulsar(&[
        "dump",
        "-m",
        cfg.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("bytes budget") && stdout.contains("verified"),
        "{stdout}"
    );
    assert!(
        stderr.contains("objdump -D -b binary -mi386:x86-64"),
        "{stderr}"
    );
    assert!(stderr.contains("plan+emit+verify"), "{stderr}");
    let j = dump_json(&["-m", cfg.to_str().unwrap()]);
    for k in j["kernels"].as_array().unwrap() {
        let name = k["name"].as_str().unwrap();
        let bin = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
        assert_eq!(bin.len() as u64, k["bytes"].as_u64().unwrap(), "{name}");
        let asm = std::fs::read_to_string(dir.join(format!("{name}.asm"))).unwrap();
        assert_eq!(
            asm.lines().count() as u64,
            k["instructions"].as_u64().unwrap(),
            "{name}"
        );
        assert!(asm.lines().last().unwrap().ends_with("ret"), "{name}");
    }
}

#[test]
fn bad_model_paths_and_configs_give_clear_errors() {
    let out = pulsar(&["dump", "-m", "/nonexistent/model.gguf"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/model.gguf") && err.contains("not found"),
        "{err}"
    );

    let cfg = ScratchFile::new("pulsar-jit-dump-bad-", "config.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "gemma", "hidden_size": 2048, "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 100}"#,
    )
    .unwrap();
    let out = pulsar(&["dump", "-m", cfg.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("intermediate_size") && err.contains("config.json"),
        "{err}"
    );
}

/// Introspection says what runs: on a CPU with AVX-512 VNNI the default
/// model's quantized plan names VNNI (its integer kernels use it), held to
/// AVX2 it does not; and `tune --help` lists `--measure`.
#[test]
fn the_isa_shown_is_the_isa_that_runs() {
    let caps = pulsar::jit::cpu::CpuCaps::detect();
    let model = pulsar::model::fetch::default_model_path().expect("default model");
    let model = model.to_str().unwrap();
    let shown = dump_json(&["-m", model])["isa"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(shown.contains("avx512-vnni"), caps.avx512_vnni, "{shown}");
    let held = dump_json(&["-m", model, "--max-isa", "avx2"]);
    assert_eq!(held["isa"], "avx2");
    let help = pulsar(&["tune", "--help"]);
    assert!(String::from_utf8_lossy(&help.stdout).contains("--measure"));
}
