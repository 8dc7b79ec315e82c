//! Integer GEMV for Q8_0 weights: `y[r] = sum_g d_w[r,g] * d_x[g] *
//! (q_w[r,g] · q_x[g])` for r in `r0..r1`, W in Q8_0 row blocks
//! (`model::q8_blocks`: per 32-column group, the 4 rows' f16 scales, then
//! their 4 × 32 quants) and x quantized to 8 bits per 32 values with an f32
//! scale (`engine::q8_input`: K quants, then K/32 scales).
//!
//! Each group's integer dot products use AVX2's `vpmaddubsw`, which
//! multiplies unsigned by signed bytes; the sign trick makes the weights
//! unsigned: |w| · (x · sign(w)) = w · x. A pair sum is at most 2 · 127 ·
//! 127 = 32258, inside i16, so nothing saturates (Q8_0 quants are within
//! ±127; a -128 would give 2 · 128 · 127 = 32512, still inside).
//! `vpmaddwd` against ones widens the pairs to 8 lane sums in i32, which
//! are converted to f32 and accumulated with the group's two scales
//! multiplied, per lane; the 8 lanes are summed once per row at the end.
//!
//! K and the block size are immediates; K is a multiple of 32. r0 must be
//! a multiple of 4; the last block may be partial, its padding rows are
//! zeros and only valid rows are stored.
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, r9=W group
//! pointer, r10=x scale pointer, r11=end of x quants, rax=x quant index
//! counting up to 0. ymm0..3 accumulators, ymm4 the 4 rows' scales times
//! x's, ymm5 x quants, ymm6..13 per-row temporaries, ymm14 lane indices,
//! ymm15 16-bit ones.

use super::{broadcast_const, count_mask, finish, lane_index, new_asm, reduce4};
use crate::jback;
use crate::model::q8_blocks::{self, BLOCK_ROWS, GROUP_BYTES, GROUP_COLS, QUANTS_AT};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemvQ8Params {
    pub k: usize,
}

pub const ROWS: usize = BLOCK_ROWS;
const IDX: u8 = 14;
const ONES: u8 = 15;

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1)`.
pub fn emit(p: &GemvQ8Params, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        q8_blocks::fits(p.k),
        "{name}: K = {} is not a whole number of 32-value blocks",
        p.k
    );
    let k = p.k as i32;
    // r is a multiple of 4, so r * (block bytes / 4) is its block's offset.
    let per_row = (q8_blocks::block_bytes(p.k) / ROWS) as i32;

    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    lane_index(&mut ops, IDX);
    broadcast_const(&mut ops, ONES, 0x0001_0001);
    dynasm!(ops
        ; .arch x64
        ; lea r11, [rsi + k]
        ; cmp rcx, r8
        ; jae =>done
    );
    let block_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>block
        ; imul r9, rcx, per_row
        ; add r9, rdi
        ; mov r10, r11
        ; mov rax, -k
    );
    for a in 0..ROWS as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    let group_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>group
        // The 4 rows' f16 scales (lanes 0..3; the other 4 lanes read the
        // first quants and are never used), times x's scale.
        ; vcvtph2ps ymm4, [r9]
        ; vmovss xmm5, [r10]
        ; vpbroadcastd ymm5, xmm5
        ; vmulps ymm4, ymm4, ymm5
        // Both 128-bit halves hold the 4 scales, so an in-lane shuffle
        // broadcasts each one to all 8 lanes.
        ; vinsertf128 ymm4, ymm4, xmm4, 1
        ; vmovdqu ymm5, [r11 + rax]
    );
    for row in 0..ROWS {
        let (w, t) = (6 + 2 * row as u8, 7 + 2 * row as u8);
        let quants = (QUANTS_AT + row * GROUP_COLS) as i32;
        let pick = (row * 0x55) as i8;
        dynasm!(ops
            ; .arch x64
            ; vmovdqu Ry(w), [r9 + quants]
            ; vpsignb Ry(t), ymm5, Ry(w)
            ; vpabsb Ry(w), Ry(w)
            ; vpmaddubsw Ry(w), Ry(w), Ry(t)
            ; vpmaddwd Ry(w), Ry(w), Ry(ONES)
            ; vcvtdq2ps Ry(w), Ry(w)
            ; vpermilps Ry(t), ymm4, pick
            ; vfmadd231ps Ry(row as u8), Ry(w), Ry(t)
        );
    }
    dynasm!(ops
        ; .arch x64
        ; add r9, GROUP_BYTES as i32
        ; add r10, BYTE 4
        ; add rax, BYTE GROUP_COLS as i8
    );
    jback!(ops, jnz, group, group_top);
    reduce4(&mut ops, [0, 1, 2, 3], 8);
    // Store only the rows that exist.
    dynasm!(ops
        ; .arch x64
        ; mov r10, r8
        ; sub r10, rcx
    );
    count_mask(&mut ops, 8, IDX, super::reg::R10);
    dynasm!(ops
        ; .arch x64
        ; vmaskmovps [rdx + rcx * 4], xmm8, xmm0
        ; add rcx, BYTE ROWS as i8
        ; cmp rcx, r8
    );
    jback!(ops, jb, block, block_top);
    dynasm!(ops
        ; .arch x64
        ; =>done
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}
