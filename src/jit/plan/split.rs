//! How work divides: a matrix's rows across threads on block boundaries,
//! and K into chunks whose slice of x stays in L1.

use crate::jit::cpu::CpuCaps;
use crate::jit::emit::{LANES, gemm};
use std::ops::Range;

/// Splits `n` rows into at most `threads` contiguous ranges whose starts are
/// multiples of `block`, so no block is shared by two threads.
pub fn split_rows(n: usize, threads: usize, block: usize) -> Vec<Range<usize>> {
    let blocks = n.div_ceil(block);
    let t = threads.clamp(1, blocks.max(1));
    let mut out = Vec::with_capacity(t);
    let mut start_block = 0;
    for i in 0..t {
        let end_block = blocks * (i + 1) / t;
        let r = (start_block * block).min(n)..(end_block * block).min(n);
        if !r.is_empty() {
            out.push(r);
        }
        start_block = end_block;
    }
    out
}

/// Elements of x per chunk so that a 3-token tile of x uses at most half of L1d.
pub fn k_chunk(caps: &CpuCaps, k: usize) -> usize {
    let l1 = if caps.l1d == 0 { 32 * 1024 } else { caps.l1d };
    let per = (l1 / 2) / (4 * gemm::TOKENS);
    (per / LANES * LANES).clamp(LANES, k.max(LANES)).min(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rows_covers_everything_on_block_boundaries() {
        for n in [1, 3, 4, 5, 17, 640, 1001] {
            for t in 1..=5 {
                let parts = split_rows(n, t, 4);
                assert!(parts.len() <= t);
                assert_eq!(parts.first().map(|r| r.start), Some(0));
                assert_eq!(parts.last().map(|r| r.end), Some(n));
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                for r in &parts {
                    assert_eq!(r.start % 4, 0, "n={n} t={t} {parts:?}");
                }
            }
        }
        assert_eq!(split_rows(8, 2, 4), vec![0..4, 4..8]);
    }

    #[test]
    fn k_chunk_keeps_x_in_half_l1() {
        let caps = CpuCaps::zen4_like();
        assert_eq!(k_chunk(&caps, 640), 640);
        let c = k_chunk(&caps, 16384);
        assert!(
            c * 4 * gemm::TOKENS <= caps.l1d / 2 && c.is_multiple_of(LANES),
            "{c}"
        );
    }
}
