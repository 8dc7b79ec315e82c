//! GEMM for prefill: `Y[t, r] = sum_k W[r,k] * X[t,k]` for r in `r0..r1` and
//! t in [0, T). A 4-row x 3-token register tile: 12 accumulators, 3 activation
//! vectors and one converted weight vector fill the 16 ymm registers.
//!
//! Token tiles are the outer loop and row tiles the inner one: a token tile's
//! x (3 x K f32) stays in L1 while the weight rows stream past it from L2,
//! 64 B of f16 per 12 FMAs. Rows outermost keeps 4 weight rows in L1 instead
//! and streams all of x past them, 96 B per 12 FMAs, and measured a few
//! percent slower on Zen 4. The streamed weights should stay in L2, so
//! `kernels::Gemm` passes at most `panel_rows` rows per call (more are
//! still computed correctly, only slower).
//!
//! Of the register tiles measured on Zen 4, this one was the fastest with
//! the engine's row chunks (the figures are in `docs/performance.md`).
//!
//! 16-bit weights are read in the row-block layout (`model::row_blocks`):
//! a row tile is one block, one sequential stream, with zero padding past
//! the last row and column. f32 "weights" (the cached keys of attention)
//! are plain rows: four row pointers, missing rows aliased to the first
//! and a K tail computed with an overlapping vector whose already-summed
//! lanes are masked, so K >= 8. Missing tokens alias the first of the tile
//! too, and only valid lanes are stored.
//!
//! Registers: rdi=W, rsi=X, rdx=Y, rcx=r, r8=t, r9=T, rbp=r1, `[rsp]`=r0,
//! ldY (in elements) stays on the stack; rbx the block pointer (row
//! blocks) or rbx/r10/r11/r12 the row pointers (plain rows), r13/r14/r15
//! token pointers; rax counts x bytes up to 0.

use super::gemv::WeightType;
use super::{
    Asm, LANES, alias_missing, count_mask, finish, lane_mask, new_asm, reduce4, reg::*,
    restore_callee_saved_and_return, save_callee_saved,
};
use crate::jback;
use crate::model::row_blocks;
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemmParams {
    pub wt: WeightType,
    pub k: usize,
}

pub const ROWS: usize = row_blocks::BLOCK_ROWS;
pub const TOKENS: usize = 3;
const ROW_PTRS: [u8; ROWS] = [RBX, R10, R11, R12];
const TOK_PTRS: [u8; TOKENS] = [R13, R14, R15];
const W: u8 = 15;

/// Weight bytes per call: well inside any L2 next to the x tile, and large
/// enough that re-reading x once per panel costs nothing (32 KiB to 128 KiB
/// measured the same on Zen 4; larger panels were slower).
pub const PANEL_BYTES: usize = 64 << 10;

/// Stack offset of the 7th argument (ldY, in elements) after the 6
/// callee-saved pushes, the pushed r0 and the return address.
const LDY: i8 = 64;

/// Most rows per call for rows of `row_bytes`: a whole number of row tiles.
pub fn panel_rows(row_bytes: usize) -> usize {
    (PANEL_BYTES / row_bytes.max(1) / ROWS).max(1) * ROWS
}

fn acc(row: usize, tok: usize) -> u8 {
    (row * TOKENS + tok) as u8
}

/// Loads 8 weights of tile row `row` as f32 into ymm15. Row blocks: at
/// `[rbx + rax*2 + 16*row]` in the loop (64 weight bytes per 32 x bytes),
/// `[rbx + 16*row]` for the padded last group. Plain f32 rows: at
/// `[p + rax]`, or `[p + disp]` for the tail.
fn load_w(ops: &mut Asm, wt: WeightType, row: usize, with_idx: bool, disp: i32) {
    let blocked = (16 * row) as i8;
    let p = ROW_PTRS[row];
    let d8 = i8::try_from(disp).ok();
    match (wt, with_idx, d8) {
        (WeightType::F16, true, _) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(W), [BYTE rbx + rax * 2 + blocked])
        }
        (WeightType::F16, false, _) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(W), [BYTE rbx + blocked])
        }
        (WeightType::Bf16, true, _) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(W), [BYTE rbx + rax * 2 + blocked])
        }
        (WeightType::Bf16, false, _) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(W), [BYTE rbx + blocked])
        }
        (WeightType::F32, true, _) => {
            dynasm!(ops ; .arch x64 ; vmovups Ry(W), [BYTE Rq(p) + rax + 0])
        }
        (WeightType::F32, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vmovups Ry(W), [BYTE Rq(p) + d])
        }
        (WeightType::F32, false, None) => dynasm!(ops ; .arch x64 ; vmovups Ry(W), [Rq(p) + disp]),
    }
    if wt == WeightType::Bf16 {
        dynasm!(ops ; .arch x64 ; vpslld Ry(W), Ry(W), 16);
    }
}

/// One 8-element step of the tile: x vectors must already be in ymm12..14.
fn tile_step(ops: &mut Asm, wt: WeightType, with_idx: bool, wdisp: i32) {
    for row in 0..ROWS {
        load_w(ops, wt, row, with_idx, wdisp);
        for tok in 0..TOKENS {
            dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, tok)), Ry(W), Ry(12 + tok as u8));
        }
    }
}

/// Emits `extern "sysv64" fn(w, x, y, r0, r1, t, ldy)`.
pub fn emit(p: &GemmParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        p.k >= LANES,
        "{name}: K = {} is below the vector width {LANES}",
        p.k
    );
    let eb = p.wt.bytes();
    let blocked = eb == 2;
    let kmain = p.k / LANES * LANES;
    let tail = p.k % LANES;
    // Plain rows: bytes per row. Row blocks: bytes per block / 4, so that
    // r * this is the block offset (r is a multiple of 4).
    let wstride = if blocked {
        (row_blocks::padded_cols(p.k) * 2) as i32
    } else {
        (p.k * eb) as i32
    };
    // Weight bytes the block pointer is biased by: the whole groups.
    let wbias = if blocked {
        (kmain * ROWS * 2) as i32
    } else {
        (kmain * eb) as i32
    };
    let xstride = (p.k * 4) as i32;

    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let tok_block = ops.new_dynamic_label();
    let row_block = ops.new_dynamic_label();
    let kloop = ops.new_dynamic_label();
    let stored = ops.new_dynamic_label();
    save_callee_saved(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; push rcx
        ; mov rbp, r8
        ; cmp rcx, rbp
        ; jae =>done
        ; test r9, r9
        ; jz =>done
        ; xor r8d, r8d
    );
    let tok_top = ops.offset();
    // Missing tokens and rows alias the first of the tile: reads stay in bounds.
    dynasm!(ops
        ; .arch x64
        ; =>tok_block
        ; mov rax, r9
        ; sub rax, r8
        ; imul r13, r8, xstride
        ; lea r13, [rsi + r13 + (kmain * 4) as i32]
    );
    for (j, &tp) in TOK_PTRS.iter().enumerate().skip(1) {
        dynasm!(ops ; .arch x64 ; lea Rq(tp), [r13 + xstride * j as i32]);
    }
    alias_missing(&mut ops, &TOK_PTRS, RAX);
    dynasm!(ops ; .arch x64 ; mov rcx, [rsp]);
    let row_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>row_block
        ; mov rax, rbp
        ; sub rax, rcx
        ; imul rbx, rcx, wstride
        ; lea rbx, [rdi + rbx + wbias]
    );
    if !blocked {
        for (i, &pr) in ROW_PTRS.iter().enumerate().skip(1) {
            dynasm!(ops ; .arch x64 ; lea Rq(pr), [rbx + wstride * i as i32]);
        }
        alias_missing(&mut ops, &ROW_PTRS, RAX);
    }
    zero_accumulators(&mut ops);
    dynasm!(ops ; .arch x64 ; mov rax, -((kmain * 4) as i32));
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>kloop);
    for (j, &tp) in TOK_PTRS.iter().enumerate() {
        dynasm!(ops ; .arch x64 ; vmovups Ry(12 + j as u8), [BYTE Rq(tp) + rax + 0]);
    }
    tile_step(&mut ops, p.wt, true, 0);
    dynasm!(ops ; .arch x64 ; add rax, BYTE (LANES * 4) as i8);
    jback!(ops, jnz, kloop, top);
    if tail > 0 && blocked {
        // The zero-padded last group; x lanes past K masked off at load.
        lane_mask(&mut ops, W, 0, tail);
        for (j, &tp) in TOK_PTRS.iter().enumerate() {
            dynasm!(ops ; .arch x64 ; vmaskmovps Ry(12 + j as u8), Ry(W), [Rq(tp)]);
        }
        tile_step(&mut ops, p.wt, false, 0);
    } else if tail > 0 {
        // Overlapping vector ending at K, already-summed lanes of x masked off.
        let e = (p.k - LANES) as i32 - kmain as i32;
        lane_mask(&mut ops, W, LANES - tail, tail);
        for (j, &tp) in TOK_PTRS.iter().enumerate() {
            dynasm!(ops ; .arch x64 ; vandps Ry(12 + j as u8), Ry(W), [BYTE Rq(tp) + (e * 4) as i8]);
        }
        tile_step(&mut ops, p.wt, false, e * eb as i32);
    }
    // Masked stores of the valid rows: r10 = rows left, r11 = element index
    // of Y[t, r]. The token pointers stay live for the next row tile, so only
    // the row pointers serve as scratch.
    dynasm!(ops
        ; .arch x64
        // Lane indices 0..3; the stores are 4 lanes wide, lanes 4..7 unused.
        ; mov eax, 0x0302_0100
        ; vmovd xmm14, eax
        ; vpmovzxbd ymm14, xmm14
        ; mov r10, rbp
        ; sub r10, rcx
        ; mov r11, r8
        ; imul r11, [BYTE rsp + LDY]
        ; add r11, rcx
    );
    count_mask(&mut ops, W, 14, R10);
    for (tok, &tp) in TOK_PTRS.iter().enumerate() {
        if tok > 0 {
            // A token past T had its pointer aliased to the tile's first
            // (a valid one never equals it: xstride > 0), and so has every
            // later one.
            dynasm!(ops
                ; .arch x64
                ; cmp Rq(tp), r13
                ; je BYTE =>stored
                ; add r11, [BYTE rsp + LDY]
            );
        }
        let a = [acc(0, tok), acc(1, tok), acc(2, tok), acc(3, tok)];
        reduce4(&mut ops, a, 13);
        dynasm!(ops ; .arch x64 ; vmaskmovps [rdx + r11 * 4], Rx(W), Rx(a[0]));
    }
    dynasm!(ops
        ; .arch x64
        ; =>stored
        ; add rcx, BYTE ROWS as i8
        ; cmp rcx, rbp
    );
    jback!(ops, jb, row_block, row_top);
    dynasm!(ops
        ; .arch x64
        ; add r8, BYTE TOKENS as i8
        ; cmp r8, r9
    );
    jback!(ops, jb, tok_block, tok_top);
    dynasm!(ops
        ; .arch x64
        ; =>done
        ; pop rcx
    );
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}

/// Zeroes the 12 accumulators ymm0..11 (a VEX.128 xor clears the upper half
/// too). Written out with fixed registers so that dynasm can pick the 4-byte
/// VEX2 form, which it only does for registers it knows at compile time;
/// ymm8..11 take xmm0 as source since VEX2 cannot name a high source register.
fn zero_accumulators(ops: &mut Asm) {
    const _: () = assert!(ROWS * TOKENS == 12);
    dynasm!(ops
        ; .arch x64
        ; vxorps xmm0, xmm0, xmm0
        ; vxorps xmm1, xmm1, xmm1
        ; vxorps xmm2, xmm2, xmm2
        ; vxorps xmm3, xmm3, xmm3
        ; vxorps xmm4, xmm4, xmm4
        ; vxorps xmm5, xmm5, xmm5
        ; vxorps xmm6, xmm6, xmm6
        ; vxorps xmm7, xmm7, xmm7
        ; vxorps xmm8, xmm0, xmm0
        ; vxorps xmm9, xmm0, xmm0
        ; vxorps xmm10, xmm0, xmm0
        ; vxorps xmm11, xmm0, xmm0
    );
}
