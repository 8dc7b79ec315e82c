//! The kernels a plan would emit at given unroll levels, and which of them
//! multiply each matrix: the 16-bit and element-wise kernels of the
//! model's shape, and the quantized kernels' parameters (prefetch
//! distances, VNNI, the layout a type's GEMM reads). `fit` only turns the
//! knobs these take.

use super::{GEMM_L2_PREFETCH_BYTES, KernelKind, MatrixUse, PlanOptions, QUANT_PREFETCH_BYTES};
use crate::jit::dims::ModelDims;
use crate::jit::emit::LANES;
use crate::jit::emit::gemm::GemmParams;
use crate::jit::emit::gemm_quant::GemmQuantParams;
use crate::jit::emit::gemm_wide::GemmWideParams;
use crate::jit::emit::gemv::{GemvParams, WeightType};
use crate::jit::emit::gemv_quant::{self, GemvQuantParams};
use crate::jit::emit::unpack_quant::UnpackQuantParams;
use crate::model::quant_blocks::QuantType;

/// The 16-row layouts have no GEMV: their GEMM takes single tokens too.
fn has_gemv(q: QuantType) -> bool {
    !q.rows_are_lanes()
}

/// The quantized kernels' parameters for one plan's options and ISA.
pub(super) struct QuantChoices<'a> {
    opts: &'a PlanOptions,
    vnni: bool,
    /// The quantized types of the model, each once, by name.
    pub types: Vec<QuantType>,
}

impl<'a> QuantChoices<'a> {
    pub fn new(opts: &'a PlanOptions, vnni: bool) -> Self {
        let mut types: Vec<QuantType> = opts.quantized.iter().map(|m| m.q).collect();
        types.sort_by_key(|q| q.name());
        types.dedup();
        QuantChoices { opts, vnni, types }
    }

    /// The GEMV of `q`.
    pub fn gemv(&self, q: QuantType, two_blocks: bool) -> GemvQuantParams {
        // Only Q8_0's GEMV gains from VNNI (3 instructions a row instead of
        // 5); Q5_0's and Q4_0's unpacking leaves their products 2 either way.
        GemvQuantParams {
            q,
            prefetch: self.opts.quant_prefetch,
            vnni: self.vnni && q == QuantType::Q8_0,
            two_blocks: two_blocks && gemv_quant::in_pairs(q),
        }
    }

    /// The kernel that unpacks `q`'s panels for its GEMM, if it has one.
    pub fn unpack(&self, q: QuantType) -> Option<UnpackQuantParams> {
        // Q5_0 and Q4_0 panels are unpacked first (see emit::unpack_quant)
        // into Q8_0x16's 16-row blocks: with VNNI with Q8_0's offset, so that
        // one GEMM (Q8_0x16's) serves every type; under AVX2 with their own,
        // small enough for vpmaddubsw without Q8_0's sign trick, each type with
        // its GEMM. (Under AVX2 with Q8_0's offset, a prefill of 512 tokens
        // measured 432-482 tok/s against 500-568 for the 4-row GEMM before.)
        // (Q5_0x16 is unpacked by its GEMM itself, in registers.)
        (!q.is_q8_0() && !q.rows_are_lanes()).then_some(UnpackQuantParams {
            q,
            into: if self.vnni { QuantType::Q8_0x16 } else { q },
            prefetch: QUANT_PREFETCH_BYTES,
        })
    }

    /// The GEMM of `q` (of its unpacked panels where it has them).
    pub fn gemm(&self, q: QuantType) -> GemmQuantParams {
        // The GEMM keeps the analytic distance: the launch tuning times decode
        // steps (the GEMVs) only, and a distance that won there by noise, off
        // say, costs the GEMM most (an 8-token tile from memory: 24.5 ns per
        // group without prefetching, 13-15 with 8 KiB).
        // AVX2's GEMM of unpacked panels reads them from L2, where they were
        // just written: no prefetching (which also leaves the plan room for
        // its GeGLU). Q8_0x16's GEMM also reads Q8_0 from memory.
        let gemm_q = self.unpack(q).map_or(q, |u| u.into);
        GemmQuantParams {
            q: gemm_q,
            vnni: self.vnni,
            prefetch: if gemm_q.rows_are_lanes() {
                QUANT_PREFETCH_BYTES
            } else {
                0
            },
            // The AVX2 K-quant GEMM also serves decode steps (there is no
            // K-quant GEMV): without the L2 prefetches its one-token passes
            // waited on memory (4B Q4_K_M, 1 thread: 4.9 tok/s, 8.6 with).
            l2_prefetch: if gemm_q.rows_are_lanes() && (self.vnni || gemm_q.is_k_quant()) {
                GEMM_L2_PREFETCH_BYTES
            } else {
                0
            },
        }
    }

    /// The kernels that multiply the matrix `tensor` (`rows` x `k`): its
    /// type's if it is kept quantized, the 16-bit ones otherwise.
    pub fn matrix_use(
        &self,
        (tensor, rows, k): (&'static str, usize, usize),
        (gemv_unroll, gemv_zmm): (usize, bool),
        two_block_gemv: bool,
        wide_gemm: Option<GemmWideParams>,
    ) -> MatrixUse {
        let quantized = self
            .opts
            .quantized
            .iter()
            .find(|m| m.tensor == tensor && m.k == k);
        let (gemv, gemm) = match quantized {
            Some(m) if has_gemv(m.q) => (
                KernelKind::GemvQuant(self.gemv(m.q, two_block_gemv)),
                KernelKind::GemmQuant(self.gemm(m.q)),
            ),
            Some(m) => (
                KernelKind::GemmQuant(self.gemm(m.q)),
                KernelKind::GemmQuant(self.gemm(m.q)),
            ),
            None => (
                KernelKind::Gemv(GemvParams {
                    wt: self.opts.weights,
                    k,
                    unroll: gemv_unroll,
                    zmm: gemv_zmm,
                }),
                match wide_gemm {
                    Some(p) => KernelKind::GemmWide(p),
                    None => KernelKind::Gemm(GemmParams {
                        wt: self.opts.weights,
                        k,
                    }),
                },
            ),
        };
        // A matrix multiplied one token at a time has no GEMM.
        let gemm = if self.opts.one_token.contains(&tensor) {
            "none (one token at a time)".to_string()
        } else {
            gemm.name()
        };
        MatrixUse {
            tensor,
            rows,
            k,
            gemv: gemv.name(),
            gemm,
            unpack: quantized
                .and_then(|m| self.unpack(m.q))
                .map(|u| KernelKind::UnpackQuant(u).name()),
        }
    }

    /// Every quantized kernel: the GEMVs, the GEMMs (one per distinct
    /// parameters, listing the types it serves), the unpacking kernels.
    pub fn kinds(&self, two_block_gemv: bool) -> Vec<(KernelKind, Vec<String>)> {
        let mut kinds = Vec::new();
        // The matrices stored in `q`, as a one-token kernel lists them.
        let matrices_in = |q: QuantType| {
            self.opts
                .quantized
                .iter()
                .filter(|m| m.q == q)
                .map(|m| format!("{} (K {})", m.tensor, m.k))
                .collect::<Vec<_>>()
                .join(", ")
        };
        kinds.extend(
            self.types
                .iter()
                .filter(|&&q| has_gemv(q))
                .map(|&q| self.gemv(q, two_block_gemv))
                .map(|p| (KernelKind::GemvQuant(p), vec![matrices_in(p.q)])),
        );
        let mut gemms: Vec<(GemmQuantParams, Vec<String>)> = Vec::new();
        for &q in &self.types {
            let gemm = self.gemm(q);
            let name = q.name().to_uppercase();
            match gemms.iter_mut().find(|(g, _)| *g == gemm) {
                Some((_, types)) => types.push(name),
                None => gemms.push((gemm, vec![name])),
            }
        }
        kinds.extend(gemms.into_iter().map(|(gemm, types)| {
            let used_for = if has_gemv(gemm.q) {
                format!("{} products of 2 or more tokens", types.join(", "))
            } else {
                // Also the one-token kernel: its matrices, as a GEMV's.
                format!("products of 1 or more tokens: {}", matrices_in(gemm.q))
            };
            (KernelKind::GemmQuant(gemm), vec![used_for])
        }));
        kinds.extend(self.types.iter().filter_map(|&q| {
            let unpack = self.unpack(q)?;
            Some((
                KernelKind::UnpackQuant(unpack),
                vec![format!(
                    "{} panels for the GEMM, in 16-row blocks",
                    q.name().to_uppercase()
                )],
            ))
        }));
        kinds
    }
}

/// The 16-bit matrix kernels (a GEMV per K in `wide_ks`, on zmm where
/// `gemv_zmm`; a GEMM per K in `gemm_ks`, or the one wide GEMM for all of
/// them), the RMSNorms, and those of the optional ops still in `optional`.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_kinds(
    dims: &ModelDims,
    wide_ks: &[usize],
    gemm_ks: &[usize],
    wt: WeightType,
    wide_gemm: Option<GemmWideParams>,
    (gemv_unroll, gemv_zmm): (usize, bool),
    norm_unroll: usize,
    optional: &[&str],
) -> Vec<(KernelKind, Vec<String>)> {
    let mut out = Vec::new();
    let uses_of_k = |k: usize| -> Vec<String> {
        let mut u = Vec::new();
        if k == dims.hidden {
            u.push("attn_q/k/v, ffn_gate/up, lm_head".to_string());
        }
        if k == dims.q_width() {
            u.push("attn_output".to_string());
        }
        if k == dims.intermediate {
            u.push("ffn_down".to_string());
        }
        u
    };
    for &k in wide_ks {
        out.push((
            KernelKind::Gemv(GemvParams {
                wt,
                k,
                unroll: gemv_unroll,
                zmm: gemv_zmm,
            }),
            uses_of_k(k),
        ));
    }
    match wide_gemm {
        Some(p) if !gemm_ks.is_empty() => out.push((
            KernelKind::GemmWide(p),
            vec![format!(
                "16-bit products of 2 or more tokens, K in {gemm_ks:?}"
            )],
        )),
        Some(_) => {}
        None => {
            for &k in gemm_ks {
                out.push((KernelKind::Gemm(GemmParams { wt, k }), uses_of_k(k)));
            }
        }
    }
    out.push((
        KernelKind::RmsNorm {
            dim: dims.hidden,
            unroll: norm_unroll,
        },
        vec!["attn/ffn pre- and post-norms, final norm".into()],
    ));
    let head_dims = std::iter::once(dims.head_dim)
        .chain((dims.other_head_dim != 0).then_some(dims.other_head_dim));
    for hd in head_dims.clone() {
        if dims.qk_norm && hd != dims.hidden {
            out.push((
                KernelKind::RmsNorm {
                    dim: hd,
                    unroll: norm_unroll.min(2),
                },
                vec![format!("q_norm, k_norm (per head of {hd})")],
            ));
        }
    }
    let has = |op: &str| optional.contains(&op);
    if has("geglu") {
        out.push((
            KernelKind::Geglu {
                width: dims.intermediate,
            },
            vec!["ffn activation".into()],
        ));
    }
    for hd in head_dims.clone() {
        if has("attn_scores") && hd >= LANES {
            out.push((
                KernelKind::AttnScores(GemmParams {
                    wt: WeightType::F32,
                    k: hd,
                }),
                vec![format!(
                    "q . k of a query block over the KV cache (heads of {hd})"
                )],
            ));
        }
    }
    if has("softmax") {
        out.push((KernelKind::Softmax, vec!["attention probabilities".into()]));
    }
    for hd in head_dims {
        if has("attn_wsum") && hd.is_multiple_of(LANES) {
            out.push((
                KernelKind::AttnWsum { head_dim: hd },
                vec![format!("probability-weighted sum of V (heads of {hd})")],
            ));
        }
    }
    out
}
