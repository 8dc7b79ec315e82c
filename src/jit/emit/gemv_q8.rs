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
//! `vpmaddwd` against ones widens the pairs to 8 lane sums in i32. Two
//! rounds of `vphaddd` fold the 4 rows' lane sums into one register, each
//! 128-bit half holding the 4 rows' partial sums, which are converted to
//! f32 and accumulated, times the rows' scales and x's, in one FMA per
//! group (against one convert, shuffle and FMA per row; 60 bytes less,
//! which keeps the 16-bit GEMVs' unrolling inside the byte budget). The
//! two halves are added once per row block.
//!
//! K and the block size are immediates; K is a multiple of 32. r0 must be
//! a multiple of 4; the last block may be partial, its padding rows are
//! zeros and only valid rows are stored.
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, r9=W group
//! pointer, r10=x scale pointer, r11=end of x quants, rax=x quant index
//! counting up to 0. ymm0 accumulator, ymm4 the 4 rows' scales times x's
//! (in both halves), ymm5 x quants, ymm6..9 the rows' weights and then
//! sums, ymm10..13 x with the rows' signs, ymm14 lane indices, ymm15
//! 16-bit ones.

use super::{broadcast_const, count_mask, finish, lane_index, new_asm};
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
    dynasm!(ops ; .arch x64 ; vxorps ymm0, ymm0, ymm0);
    let group_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>group
        // The 4 rows' f16 scales (lanes 0..3; the other 4 lanes read the
        // first quants and are never used), times x's scale, then copied
        // to the upper half, which holds the other 4 lanes of each sum.
        ; vcvtph2ps ymm4, [r9]
        ; vmovss xmm5, [r10]
        ; vpbroadcastd ymm5, xmm5
        ; vmulps ymm4, ymm4, ymm5
        ; vinsertf128 ymm4, ymm4, xmm4, 1
        ; vmovdqu ymm5, [r11 + rax]
    );
    for row in 0..ROWS as u8 {
        let (w, t) = (6 + row, 10 + row);
        let quants = (QUANTS_AT + row as usize * GROUP_COLS) as i8;
        dynasm!(ops
            ; .arch x64
            ; vmovdqu Ry(w), [BYTE r9 + quants]
            ; vpsignb Ry(t), ymm5, Ry(w)
            ; vpabsb Ry(w), Ry(w)
            ; vpmaddubsw Ry(w), Ry(w), Ry(t)
            ; vpmaddwd Ry(w), Ry(w), Ry(ONES)
        );
    }
    dynasm!(ops
        ; .arch x64
        // [r0 r0 r1 r1 | r0 r0 r1 r1], [r2 r2 r3 r3 | ...], then
        // [r0 r1 r2 r3 | r0 r1 r2 r3]: each half sums 4 of the 8 lanes.
        ; vphaddd ymm6, ymm6, ymm7
        ; vphaddd ymm8, ymm8, ymm9
        ; vphaddd ymm6, ymm6, ymm8
        ; vcvtdq2ps ymm6, ymm6
        ; vfmadd231ps ymm0, ymm6, ymm4
        ; add r9, GROUP_BYTES as i32
        ; add r10, BYTE 4
        ; add rax, BYTE GROUP_COLS as i8
    );
    jback!(ops, jnz, group, group_top);
    // Both halves' partial sums of the 4 rows, then only valid rows stored.
    dynasm!(ops
        ; .arch x64
        ; vextractf128 xmm1, ymm0, 1
        ; vaddps xmm0, xmm0, xmm1
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
