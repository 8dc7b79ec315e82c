//! The blocking the fast engine obeys: how many tokens a prefill step
//! takes, how rows are handed to threads, how much of a matrix several
//! passes share in cache, how attention is cut into units. Computed once
//! per plan from the CPU's caches and cores and the model's dimensions, the
//! same way for the kernels and for the driver that calls them, with the
//! reason for every value (`pulsar tune` prints them).

use super::cpu::CpuCaps;
use super::dims::ModelDims;
use super::emit::gemm;
use serde::{Deserialize, Serialize};

/// Rows per kernel block, the largest of any layout (the 16-bit and most
/// quantized row blocks interleave 4 rows, Q8_0x16 16), so a thread's rows
/// start on a block of every layout.
pub const ROW_GRANULE: usize = crate::model::quant_blocks::MAX_BLOCK_ROWS;

/// Tokens per prefill step unless measured otherwise: large enough to
/// reuse each weight row across many tokens, small enough that the step's
/// activations stay in cache, and a multiple of the GEMM's 3-token tile
/// (no tail tile). 126 measured at least as fast as 64 on a 512-token
/// prefill.
pub const PREFILL_CHUNK: usize = 126;

/// Largest FP16 panel of widened rows (measured, see `analytic`).
const WIDENED_PANEL_MAX: usize = 80 << 10;

/// L1d and L2 assumed when the CPU does not report them.
const FALLBACK_L1D: usize = 32 << 10;
const FALLBACK_L2: usize = 512 << 10;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blocking {
    /// Tokens per prefill step (GEMM over that many tokens).
    pub prefill_chunk: usize,
    /// The smallest unit of rows handed to a thread.
    pub row_granule: usize,
    /// The smallest chunk of weight bytes a thread takes at a time.
    pub min_chunk_bytes: usize,
    /// Weight bytes per sub-chunk when several passes (exact tokens, or
    /// exact tokens and a GEMM) read the same rows.
    pub shared_rows_bytes: usize,
    /// Bytes of quantized rows every tile of 8 tokens passes over while
    /// they stay in L2 (the integer GEMM's panel; named for the FP16
    /// widening it sized before that GEMM existed, and kept so stored
    /// tunings still apply).
    pub widened_panel_bytes: usize,
    /// Tokens per unit of prefill attention work.
    pub attention_token_block: usize,
    /// Fewest keys per part when one token's keys are split between
    /// threads.
    pub min_keys_per_part: usize,
}

/// One blocking value and why it has it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reason {
    pub name: &'static str,
    pub value: usize,
    pub why: String,
}

impl Blocking {
    /// The blocking for a CPU, a model shape and a thread count, with the
    /// reason for each value. `smallest_matrix_bytes` is the smallest layer
    /// matrix in its stored format.
    pub fn analytic(
        caps: &CpuCaps,
        dims: &ModelDims,
        threads: usize,
        smallest_matrix_bytes: usize,
    ) -> (Blocking, Vec<Reason>) {
        let threads = threads.max(1);
        let (l1d, l1d_known) = known_or(caps.l1d, FALLBACK_L1D);
        let (l2, l2_known) = known_or(caps.l2, FALLBACK_L2);
        let kib = |b: usize| format!("{} KiB", b >> 10);
        let mut reasons = Vec::new();

        let prefill_chunk = PREFILL_CHUNK;
        reasons.push(Reason {
            name: "prefill_chunk",
            value: prefill_chunk,
            why: format!(
                "tokens per prefill step: measured best of 64/126 on 2 threads; a multiple of the \
                 GEMM's {}-token tile",
                gemm::TOKENS
            ),
        });
        reasons.push(Reason {
            name: "row_granule",
            value: ROW_GRANULE,
            why: "the kernels' largest row block (Q8_0x16's 16 rows): no block is shared by two threads".into(),
        });

        // Every thread should get a chunk of the smallest matrix, but a
        // chunk under 16 KiB is mostly prefetcher ramp-up. 64 KiB measured
        // best at 2 threads: fixed 256 KiB chunks left decode 8-10% slower,
        // and half the smallest matrix per thread (28 KiB) measured prefill
        // pp256 362-430 tok/s against 64 KiB's 414-468 (Intel Xeon).
        let min_chunk_bytes = (smallest_matrix_bytes / threads).clamp(16 << 10, 64 << 10);
        reasons.push(Reason {
            name: "min_chunk_bytes",
            value: min_chunk_bytes,
            why: format!(
                "a chunk of the smallest matrix ({}) for each of {threads} thread(s), \
                 within 16-64 KiB",
                kib(smallest_matrix_bytes)
            ),
        });

        // Rows read by several passes stay in L1 between them; the first
        // pass's loads and the others' hits share it with the inputs.
        let shared_rows_bytes = (l1d * 2 / 3).max(8 << 10);
        reasons.push(Reason {
            name: "shared_rows_bytes",
            value: shared_rows_bytes,
            why: format!(
                "two thirds of L1d ({}{}): rows several exact tokens read stay in L1 between \
                 passes",
                kib(l1d),
                assumed(l1d_known)
            ),
        });

        // The panel is read once per token tile of a step (8 tokens in the
        // integer GEMM; the FP16 widening it sized before read it per
        // 3-token tile): a quarter of L2 leaves room for the step's
        // inputs. Capped (measured with the widening):
        // on a 2 MiB L2 (Intel Xeon, 2 threads, pp256, alternating x3)
        // 512 KiB panels measured 287-405 tok/s against 80 KiB's 399-429.
        let widened_panel_bytes = (l2 / 4).clamp(16 << 10, WIDENED_PANEL_MAX);
        // Q8_0 rows: 34 bytes per 32 values.
        let rows_at = |k: usize| {
            (widened_panel_bytes / (k / 32 * 34)).max(ROW_GRANULE) / ROW_GRANULE * ROW_GRANULE
        };
        reasons.push(Reason {
            name: "widened_panel_bytes",
            value: widened_panel_bytes,
            why: format!(
                "a quarter of L2 ({}{}), at most 80 KiB, of quantized rows each 8-token tile passes over: {} Q8_0 rows at K {}, {} at K {}",
                kib(l2),
                assumed(l2_known),
                rows_at(dims.hidden),
                dims.hidden,
                rows_at(dims.intermediate),
                dims.intermediate
            ),
        });

        // A block's queries (times the heads sharing a KV head) share
        // every K and V row they read; the causal triangle computed and
        // then masked inside a block stays small.
        let group = (dims.n_heads / dims.n_kv_heads.max(1)).max(1);
        let attention_token_block = 16;
        reasons.push(Reason {
            name: "attention_token_block",
            value: attention_token_block,
            why: format!(
                "{} query rows of {} values share each key row read ({} heads per KV head)",
                attention_token_block * group,
                dims.head_dim,
                group
            ),
        });
        let min_keys_per_part = 4;
        reasons.push(Reason {
            name: "min_keys_per_part",
            value: min_keys_per_part,
            why: "fewer keys than this per thread are not worth a merge".into(),
        });

        let blocking = Blocking {
            prefill_chunk,
            row_granule: ROW_GRANULE,
            min_chunk_bytes,
            shared_rows_bytes,
            widened_panel_bytes,
            attention_token_block,
            min_keys_per_part,
        };
        (blocking, reasons)
    }

    /// Rows of `row_bytes` each that fit `bytes`, in whole row blocks.
    pub fn rows_within(&self, bytes: usize, row_bytes: usize) -> usize {
        (bytes / row_bytes.max(1))
            .max(1)
            .next_multiple_of(self.row_granule)
    }
}

impl Default for Blocking {
    /// The analytic blocking for an unknown CPU (fallback cache sizes),
    /// the default model and 2 threads: what the plain-Rust kernels use.
    fn default() -> Self {
        let caps = CpuCaps {
            l1d: 0,
            l2: 0,
            ..CpuCaps::detect()
        };
        Blocking::analytic(&caps, &ModelDims::GEMMA3_270M, 2, 64 << 10).0
    }
}

fn known_or(bytes: usize, fallback: usize) -> (usize, bool) {
    if bytes == 0 {
        (fallback, false)
    } else {
        (bytes, true)
    }
}

fn assumed(known: bool) -> &'static str {
    if known { "" } else { ", assumed" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(l1d: usize, l2: usize) -> CpuCaps {
        CpuCaps {
            l1d,
            l2,
            ..CpuCaps::detect()
        }
    }

    #[test]
    fn caches_and_threads_change_the_blocking() {
        let dims = ModelDims::GEMMA3_270M;
        let (small, _) = Blocking::analytic(&caps(32 << 10, 512 << 10), &dims, 2, 174 << 10);
        let (large, _) = Blocking::analytic(&caps(48 << 10, 2 << 20), &dims, 2, 174 << 10);
        assert!(large.shared_rows_bytes > small.shared_rows_bytes);
        let (tiny_l2, _) = Blocking::analytic(&caps(32 << 10, 256 << 10), &dims, 2, 174 << 10);
        assert_eq!(tiny_l2.widened_panel_bytes, 64 << 10);
        assert_eq!(large.widened_panel_bytes, 80 << 10);
        // A 96 KiB smallest matrix: one chunk per thread.
        let chunk = |threads| {
            Blocking::analytic(&caps(32 << 10, 512 << 10), &dims, threads, 96 << 10)
                .0
                .min_chunk_bytes
        };
        assert_eq!(chunk(1), 64 << 10);
        assert_eq!(chunk(2), 48 << 10);
        assert_eq!(chunk(8), 16 << 10);
    }

    #[test]
    fn every_value_has_a_reason_and_unknown_caches_say_so() {
        let (b, reasons) = Blocking::analytic(&caps(0, 0), &ModelDims::GEMMA3_270M, 2, 64 << 10);
        assert_eq!(reasons.len(), 7);
        let value = |n: &str| reasons.iter().find(|r| r.name == n).unwrap().value;
        assert_eq!(value("prefill_chunk"), b.prefill_chunk);
        assert_eq!(value("shared_rows_bytes"), b.shared_rows_bytes);
        assert!(reasons.iter().any(|r| r.why.contains("assumed")));
        assert_eq!(b.rows_within(1000, 680), ROW_GRANULE);
        assert_eq!(b.rows_within(32 << 10, 680), 48);
    }
}
