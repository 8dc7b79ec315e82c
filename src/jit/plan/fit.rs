//! The fit: builds the plan, emitting every candidate kernel to measure
//! it and giving up unrolling, then optional kernels, until the code fits
//! the byte budget. Everything is chosen before any code is mapped.

use super::choices::{QuantChoices, build_kinds};
use super::split::k_chunk;
use super::{KernelKind, KernelSpec, Plan, PlanOptions};
use crate::jit::blocking::Blocking;
use crate::jit::cpu::{CpuCaps, Isa};
use crate::jit::dims::ModelDims;
use crate::jit::emit::LANES;
use crate::jit::emit::gemm;
use crate::jit::emit::gemm_quant::GemmQuantParams;
use crate::jit::emit::gemm_wide::{GemmWideParams, WideProducts};
use crate::jit::emit::gemv::{GemvParams, WeightType};
use crate::jit::emit::gemv_quant::{self, GemvQuantParams};
use anyhow::{Result, bail};

/// Builds the plan for a model. Pure: same inputs, same plan.
pub fn plan(dims: &ModelDims, caps: &CpuCaps, opts: &PlanOptions) -> Result<Plan> {
    dims.validate()?;
    let Some(allowed_isa) = caps.effective_isa(opts.max_isa) else {
        bail!(
            caps.baseline_message()
                .unwrap_or_else(|| "no usable ISA".into())
        );
    };
    for (what, v) in [
        ("hidden", dims.hidden),
        ("intermediate", dims.intermediate),
        ("head_dim", dims.head_dim),
    ] {
        if v < LANES {
            bail!(
                "model shape: {what} = {v} is below the vector width {LANES}; use the reference engine"
            );
        }
    }
    let threads = if opts.threads == 0 {
        caps.cores.max(1)
    } else {
        opts.threads
    };
    let mut notes = Vec::new();
    let isa = Isa::Avx2;
    // VNNI's byte dot product: on zmm registers in the integer GEMM, on
    // ymm in Q8_0's GEMV; the 16-bit GEMM has a zmm form of its own (see
    // below); every other kernel is AVX2.
    let vnni = allowed_isa == Isa::Avx512 && caps.avx512_vnni;
    if vnni && !opts.quantized.is_empty() {
        notes.push("AVX-512 allowed: the integer GEMM uses VNNI's vpdpbusd on zmm registers, Q8_0's GEMV on ymm".into());
    }

    // Matrix-vector products of one layer plus the LM head.
    let q = dims.q_width();
    let kv = dims.kv_stride();
    let uniform_mats = vec![
        ("attn_q", q, dims.hidden),
        ("attn_k", kv, dims.hidden),
        ("attn_v", kv, dims.hidden),
        ("attn_output", dims.hidden, q),
        ("ffn_gate", dims.intermediate, dims.hidden),
        ("ffn_up", dims.intermediate, dims.hidden),
        ("ffn_down", dims.hidden, dims.intermediate),
        ("output(lm_head)", dims.vocab, dims.hidden),
    ];
    let mats: Vec<(&'static str, usize, usize)> = if opts.matrices.is_empty() {
        uniform_mats
    } else {
        opts.matrices.clone()
    };
    let mut ks: Vec<usize> = mats.iter().map(|m| m.2).collect();
    ks.sort_unstable();
    ks.dedup();
    // 16-bit GEMV and GEMM only where some 16-bit matrix is multiplied.
    let wide_ks: Vec<usize> = ks
        .iter()
        .copied()
        .filter(|&k| {
            mats.iter().any(|&(tensor, _, mk)| {
                mk == k
                    && opts
                        .wide_tensors
                        .as_ref()
                        .is_none_or(|wide| wide.contains(&tensor))
            })
        })
        .collect();
    // A GEMM only where some matrix of that K takes several tokens.
    let gemm_ks: Vec<usize> = wide_ks
        .iter()
        .copied()
        .filter(|&k| {
            mats.iter()
                .any(|&(tensor, _, mk)| mk == k && !opts.one_token.contains(&tensor))
        })
        .collect();
    if wide_ks.len() < ks.len() {
        notes.push(format!(
            "no 16-bit GEMV or GEMM for K in {:?}: every matrix with that K is quantized",
            ks.iter()
                .filter(|k| !wide_ks.contains(k))
                .collect::<Vec<_>>()
        ));
    }
    let quant = QuantChoices::new(opts, vnni);
    // With AVX-512 the 16-bit GEMM is one kernel on zmm registers for every
    // K: BF16 dot products where the CPU has them (and the options allow),
    // widened weights and FMA otherwise.
    let wide_gemm = (allowed_isa == Isa::Avx512).then(|| GemmWideParams {
        wt: opts.weights,
        products: if opts.weights == WeightType::Bf16 && caps.avx512_bf16 && opts.bf16_dot {
            WideProducts::Bf16Dot
        } else {
            WideProducts::Fma
        },
    });
    if let (Some(p), false) = (wide_gemm, wide_ks.is_empty()) {
        notes.push(format!(
            "AVX-512: the 16-bit GEMM is {} on zmm registers, one kernel for every K",
            match p.products {
                WideProducts::Bf16Dot => "vdpbf16ps (inputs rounded to bf16)",
                WideProducts::Fma => "widened weights and vfmadd231ps",
            }
        ));
    }

    // The 16-bit GEMV on zmm registers only where the options ask for it:
    // on Zen 4 it streams from memory no faster than the ymm form (see
    // `emit::gemv_wide`).
    let gemv_zmm = allowed_isa == Isa::Avx512 && opts.zmm_gemv;
    if gemv_zmm && !wide_ks.is_empty() {
        notes.push("AVX-512: the 16-bit GEMV is on zmm registers".into());
    }
    // Candidate unroll levels, most aggressive first.
    let mut gemv_unroll = 4usize;
    // Q5_0's and Q4_0's GEMV over two row blocks per pass: 738 bytes
    // against 493 for Q5_0. Q4_0's decode on the gemma-2b shape gains
    // most from it, and fits; the default model's Q5_0 GEMV gained from
    // L2 only (from DRAM it already reads at the plain read's rate on 2
    // threads), so it is traded first there.
    let mut two_block_gemv = true;
    let mut norm_unroll = 2usize;
    // With AVX-512 the engine computes attention's scores and weighted
    // sums on zmm registers in Rust: for a verify step's 32 query rows per
    // thread over 275 keys, from L1/L2, scores 51 us against 64-68 with
    // the JIT's ymm GEMM and weighted sums 44 against 57-58 (both near the
    // FMA's rate; an AVX-512 form in the JIT would need EVEX code that the
    // 1,031 bytes of the two ymm kernels could not hold). Those bytes go
    // back to the budget.
    let avx512_attention = allowed_isa == Isa::Avx512
        && dims.head_dim.is_multiple_of(64)
        && dims.other_head_dim.is_multiple_of(64);
    let mut optional: Vec<&str> = if avx512_attention {
        vec!["softmax", "geglu"]
    } else {
        vec!["attn_scores", "softmax", "attn_wsum", "geglu"]
    };
    let mut dropped: Vec<String> = Vec::new();
    loop {
        let mut kinds = build_kinds(
            dims,
            &wide_ks,
            &gemm_ks,
            opts.weights,
            wide_gemm,
            (gemv_unroll, gemv_zmm),
            norm_unroll,
            &optional,
        );
        kinds.extend(quant.kinds(two_block_gemv));
        let mut sizes = Vec::with_capacity(kinds.len());
        for (k, _) in &kinds {
            sizes.push(k.emit()?.len());
        }
        let total: usize = sizes.iter().sum();
        if total <= opts.budget {
            notes.push(format!(
                "chose gemv unroll {gemv_unroll} (x8 elements, 4 rows/block), rmsnorm unroll {norm_unroll}: {total} of {} bytes",
                opts.budget
            ));
            let kernels: Vec<KernelSpec> = kinds
                .into_iter()
                .map(|(kind, used_for)| KernelSpec {
                    name: kind.name(),
                    isa: match kind {
                        KernelKind::GemmQuant(GemmQuantParams { vnni: true, .. })
                        | KernelKind::GemvQuant(GemvQuantParams { vnni: true, .. })
                        | KernelKind::GemmWide(_)
                        | KernelKind::Gemv(GemvParams { zmm: true, .. }) => Isa::Avx512,
                        _ => isa,
                    },
                    kind,
                    used_for,
                })
                .collect();
            let matrices = mats
                .iter()
                .map(|&m| quant.matrix_use(m, (gemv_unroll, gemv_zmm), two_block_gemv, wide_gemm))
                .collect();
            let smallest = smallest_layer_matrix(&mats, opts);
            let (blocking, blocking_reasons) = Blocking::analytic(caps, dims, threads, smallest);
            for &k in &ks {
                if k_chunk(caps, k) < k {
                    notes.push(format!(
                        "K={k}: a 3-token x slice ({} KiB) exceeds half of L1d; the L1 chunk would be {}, but chunking is not emitted: GEMM with x from L2 measured no slower per FLOP (tune --measure)",
                        k * 4 * gemm::TOKENS / 1024,
                        k_chunk(caps, k)
                    ));
                }
            }
            let not_jitted = not_jitted(avx512_attention, &dropped);
            return Ok(Plan {
                isa,
                allowed_isa,
                threads,
                budget_bytes: opts.budget,
                kernel_bytes: sizes,
                kernels,
                matrices,
                blocking,
                blocking_reasons,
                notes,
                not_jitted,
                avx512_attention,
            });
        }
        // Over budget: give up unrolling first, then optional kernels.
        if gemv_unroll > 1 {
            notes.push(format!(
                "{total} B > budget: gemv unroll {gemv_unroll} -> {}",
                gemv_unroll / 2
            ));
            gemv_unroll /= 2;
        } else if two_block_gemv && quant.types.iter().any(|&q| gemv_quant::in_pairs(q)) {
            notes.push(format!(
                "{total} B > budget: Q5_0/Q4_0 GEMV 8 rows per pass -> 4"
            ));
            two_block_gemv = false;
        } else if norm_unroll > 1 {
            notes.push(format!(
                "{total} B > budget: rmsnorm unroll {norm_unroll} -> 1"
            ));
            norm_unroll = 1;
        } else if let Some(op) = optional.pop() {
            notes.push(format!("{total} B > budget: {op} stays in Rust"));
            dropped.push(op.to_string());
        } else {
            let each: Vec<String> = kinds
                .iter()
                .zip(&sizes)
                .map(|((k, _), n)| format!("{} {n}", k.name()))
                .collect();
            bail!(
                "the matrix kernels alone need {total} bytes, over the {} byte budget ({})",
                opts.budget,
                each.join(", ")
            );
        }
    }
}

/// The bytes of the smallest layer matrix in its stored format: it sizes
/// the threads' smallest chunks.
fn smallest_layer_matrix(mats: &[(&'static str, usize, usize)], opts: &PlanOptions) -> usize {
    mats.iter()
        .filter(|m| m.0 != "output(lm_head)")
        .map(|&(tensor, rows, k)| {
            match opts
                .quantized
                .iter()
                .find(|m| m.tensor == tensor && m.k == k)
            {
                Some(m) => m.q.matrix_bytes(rows, k),
                None => rows * k * 2,
            }
        })
        .min()
        .unwrap_or(0)
}

/// The hot path's ops that stay in Rust.
fn not_jitted(avx512_attention: bool, dropped: &[String]) -> Vec<String> {
    let mut not_jitted: Vec<String> = vec![
        "embedding lookup and scaling".into(),
        "residual adds".into(),
        "RoPE".into(),
        "a decode step's weighted sum over V (4 query heads or fewer: row by row, see engine::decode_wsum)".into(),
        "converting q4_k/q5_k to q5_0 and q6_k to q8_0 at load".into(),
        "a q4_k/q5_k matrix's offset per 32 values (added after its q5_0 product)".into(),
        "quantizing quantized matrices' inputs to 8 bits (per token, and in tiles of 8 tokens)".into(),
        "sampling".into(),
    ];
    if avx512_attention {
        not_jitted.push("attention scores, and weighted sums over more query rows: AVX-512 (engine::attn_scores, engine::decode_wsum::weighted_sum_tiled)".into());
    }
    not_jitted.extend(
        dropped
            .iter()
            .map(|d| format!("{d} (dropped for the byte budget)")),
    );
    not_jitted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jit::plan::BUDGET_BYTES;

    fn gemma2b() -> ModelDims {
        ModelDims::from(&crate::model::presets::gemma_2b())
    }

    #[test]
    fn the_270m_constant_matches_its_preset() {
        assert_eq!(
            ModelDims::GEMMA3_270M,
            ModelDims::from(&crate::model::presets::gemma3_270m())
        );
    }

    #[test]
    fn plan_is_deterministic_and_fits_budget() {
        let caps = CpuCaps::zen4_like();
        for dims in [ModelDims::GEMMA3_270M, gemma2b()] {
            let a = plan(&dims, &caps, &PlanOptions::default()).unwrap();
            let b = plan(&dims, &caps, &PlanOptions::default()).unwrap();
            assert_eq!(a, b);
            assert!(a.total_bytes() <= BUDGET_BYTES, "{}", a.total_bytes());
            assert_eq!(a.kernels.len(), a.kernel_bytes.len());
        }
    }

    #[test]
    fn plan_270m_has_one_gemv_per_distinct_k() {
        let p = plan(
            &ModelDims::GEMMA3_270M,
            &CpuCaps::zen4_like(),
            &PlanOptions::default(),
        )
        .unwrap();
        let gemv: Vec<_> = p
            .kernels
            .iter()
            .filter(|k| matches!(k.kind, KernelKind::Gemv(_)))
            .collect();
        let ks: Vec<usize> = gemv
            .iter()
            .map(|k| match &k.kind {
                KernelKind::Gemv(g) => g.k,
                _ => 0,
            })
            .collect();
        assert_eq!(ks, vec![640, 1024, 2048]);
        assert!(
            p.kernels
                .iter()
                .any(|k| k.name == "rmsnorm_d256_u2" || k.name == "rmsnorm_d256_u1")
        );
        // Every matrix names a kernel that exists in the plan.
        for m in &p.matrices {
            assert!(p.kernels.iter().any(|k| k.name == m.gemv), "{}", m.gemv);
        }
    }

    #[test]
    fn tight_budget_reduces_unroll_then_drops_ops() {
        let caps = CpuCaps::zen4_like();
        let full = plan(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap();
        let opts = PlanOptions {
            budget: full.total_bytes() - 1,
            ..PlanOptions::default()
        };
        let tight = plan(&ModelDims::GEMMA3_270M, &caps, &opts).unwrap();
        assert!(tight.total_bytes() < full.total_bytes());
        assert!(tight.notes.iter().any(|n| n.contains("> budget")));
        let tiny = PlanOptions {
            budget: 100,
            ..PlanOptions::default()
        };
        assert!(plan(&ModelDims::GEMMA3_270M, &caps, &tiny).is_err());
    }

    #[test]
    fn no_avx2_means_no_plan_with_a_clear_message() {
        let caps = CpuCaps {
            avx2: false,
            ..CpuCaps::zen4_like()
        };
        let err = plan(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap_err();
        assert!(err.to_string().contains("reference engine"), "{err}");
    }

    #[test]
    fn every_gemma_shape_fits_the_budget() {
        let caps = CpuCaps::zen4_like();
        // (hidden, intermediate, heads, kv heads, head_dim, vocab, qk_norm)
        let shapes = [
            (640, 2048, 4, 1, 256, 262_144, true),      // gemma-3-270m
            (1152, 6912, 4, 1, 256, 262_144, true),     // gemma-3-1b
            (2560, 10240, 8, 4, 256, 262_208, true),    // gemma-3-4b
            (5376, 21504, 32, 16, 128, 262_208, true),  // gemma-3-27b
            (2048, 16384, 8, 1, 256, 256_000, false),   // gemma-2b
            (3072, 24576, 16, 16, 256, 256_000, false), // gemma-7b
            (2304, 9216, 8, 4, 256, 256_000, false),    // gemma-2-2b
            (1001, 37, 3, 1, 18, 999, true),            // odd sizes
        ];
        for (hidden, intermediate, n_heads, n_kv_heads, head_dim, vocab, qk_norm) in shapes {
            let dims = ModelDims {
                hidden,
                intermediate,
                n_heads,
                n_kv_heads,
                head_dim,
                vocab,
                n_layers: 1,
                qk_norm,
                other_head_dim: 0,
            };
            for max_isa in [Isa::Avx2, Isa::Avx512] {
                let opts = PlanOptions {
                    max_isa,
                    ..PlanOptions::default()
                };
                let p = plan(&dims, &caps, &opts).unwrap_or_else(|e| panic!("{dims:?}: {e}"));
                assert!(
                    p.total_bytes() <= BUDGET_BYTES,
                    "{dims:?}: {}",
                    p.total_bytes()
                );
                let ks = [hidden, intermediate, n_heads * head_dim];
                for k in ks {
                    assert!(
                        p.kernels
                            .iter()
                            .any(|s| matches!(&s.kind, KernelKind::Gemv(g) if g.k == k)),
                        "{dims:?}: no GEMV for K={k}"
                    );
                }
            }
        }
    }

    #[test]
    fn max_isa_avx2_plans_avx2() {
        let opts = PlanOptions {
            max_isa: Isa::Avx2,
            ..PlanOptions::default()
        };
        let p = plan(&ModelDims::GEMMA3_270M, &CpuCaps::zen4_like(), &opts).unwrap();
        assert_eq!(p.isa, Isa::Avx2);
        assert!(p.kernels.iter().all(|k| k.isa == Isa::Avx2));
    }

    /// The 16-bit GEMM: with AVX-512 one zmm kernel for every K, BF16's
    /// dot products where the CPU has AVX-512 BF16 (and the options allow
    /// them), widened weights and FMA otherwise; with AVX2 one per K.
    #[test]
    fn sixteen_bit_gemm_form_follows_the_cpu_and_options() {
        use crate::jit::emit::gemm_wide::{GemmWideParams, WideProducts};
        let gemms = |caps: &CpuCaps, opts: &PlanOptions| -> Vec<KernelKind> {
            let p = plan(&ModelDims::GEMMA3_270M, caps, opts).unwrap();
            assert!(p.total_bytes() <= BUDGET_BYTES);
            for m in &p.matrices {
                assert!(p.kernels.iter().any(|k| k.name == m.gemm), "{}", m.gemm);
            }
            p.kernels
                .into_iter()
                .map(|k| k.kind)
                .filter(|k| matches!(k, KernelKind::Gemm(_) | KernelKind::GemmWide(_)))
                .collect()
        };
        let wide = |wt, products| vec![KernelKind::GemmWide(GemmWideParams { wt, products })];
        let zen4 = CpuCaps::zen4_like();
        let bf16 = PlanOptions {
            weights: WeightType::Bf16,
            ..PlanOptions::default()
        };
        assert_eq!(
            gemms(&zen4, &bf16),
            wide(WeightType::Bf16, WideProducts::Bf16Dot)
        );
        let no_dot = PlanOptions {
            bf16_dot: false,
            ..bf16.clone()
        };
        assert_eq!(
            gemms(&zen4, &no_dot),
            wide(WeightType::Bf16, WideProducts::Fma)
        );
        let skylake = CpuCaps {
            avx512_bf16: false,
            ..CpuCaps::zen4_like()
        };
        assert_eq!(
            gemms(&skylake, &bf16),
            wide(WeightType::Bf16, WideProducts::Fma)
        );
        assert_eq!(
            gemms(&zen4, &PlanOptions::default()),
            wide(WeightType::F16, WideProducts::Fma)
        );
        let avx2 = PlanOptions {
            max_isa: Isa::Avx2,
            ..bf16
        };
        assert_eq!(gemms(&zen4, &avx2).len(), 3, "one AVX2 GEMM per K");
    }

    /// The 16-bit GEMV on zmm only where the options ask for it and the
    /// ISA allows AVX-512; then every 16-bit GEMV is the zmm form, marked
    /// AVX-512, and every Gemma shape still fits the budget.
    #[test]
    fn zmm_gemv_follows_the_options_and_the_isa() {
        let caps = CpuCaps::zen4_like();
        let zmm = |p: &Plan| -> Vec<bool> {
            p.kernels
                .iter()
                .filter_map(|k| match k.kind {
                    KernelKind::Gemv(g) => Some(g.zmm && k.isa == Isa::Avx512),
                    _ => None,
                })
                .collect()
        };
        for weights in [WeightType::F16, WeightType::Bf16] {
            for dims in [ModelDims::GEMMA3_270M, gemma2b()] {
                let base = PlanOptions {
                    weights,
                    ..PlanOptions::default()
                };
                let default = plan(&dims, &caps, &base).unwrap();
                assert!(zmm(&default).iter().all(|&z| !z));
                let opts = PlanOptions {
                    zmm_gemv: true,
                    ..base.clone()
                };
                let p = plan(&dims, &caps, &opts).unwrap();
                assert!(p.total_bytes() <= BUDGET_BYTES, "{}", p.total_bytes());
                assert!(!zmm(&p).is_empty() && zmm(&p).iter().all(|&z| z));
                assert!(p.matrices.iter().all(|m| m.gemv.ends_with("_zmm")));
                assert!(p.isa_description().contains("16-bit GEMV"));
                let avx2 = PlanOptions {
                    max_isa: Isa::Avx2,
                    ..opts
                };
                assert!(zmm(&plan(&dims, &caps, &avx2).unwrap()).iter().all(|&z| !z));
            }
        }
    }

    /// With AVX-512 the engine computes attention's scores and weighted
    /// sums itself, so the plan carries neither kernel (and says so); with
    /// AVX2 alone it has both.
    #[test]
    fn attention_products_are_planned_only_without_avx512() {
        let caps = CpuCaps::zen4_like();
        let has = |p: &Plan, kind: &str| p.kernels.iter().any(|k| k.name.starts_with(kind));
        let wide = plan(&ModelDims::GEMMA3_270M, &caps, &PlanOptions::default()).unwrap();
        assert!(wide.avx512_attention);
        assert!(!has(&wide, "attn_scores") && !has(&wide, "attn_wsum"));
        assert!(has(&wide, "softmax"));
        assert!(
            wide.not_jitted
                .iter()
                .any(|n| n.contains("engine::attn_scores"))
        );
        let opts = PlanOptions {
            max_isa: Isa::Avx2,
            ..PlanOptions::default()
        };
        let narrow = plan(&ModelDims::GEMMA3_270M, &caps, &opts).unwrap();
        assert!(!narrow.avx512_attention);
        assert!(has(&narrow, "attn_scores") && has(&narrow, "attn_wsum"));
    }
}
