//! GEMM for prefill: `Y[t, r] = sum_k W[r,k] * X[t,k]` for r in `r0..r1` and
//! t in [0, T). A 4-row x 3-token register tile: 12 accumulators, 3 activation
//! vectors and one converted weight vector fill the 16 ymm registers.
//!
//! Rows outermost: a block of 4 weight rows stays in L1 while every token
//! block streams past it. Partial tiles alias missing rows/tokens to the first
//! of the tile and store only valid lanes (same scheme as GEMV). The K tail is
//! the masked overlapping vector of GEMV, so K >= 8.
//!
//! Registers: rdi=W, rsi=X, rdx=Y, rcx=r, r8=t, r9=T, rbp=ldY in bytes,
//! `[rsp]`=r1; rbx/r10/r11/r12 row pointers, r13/r14/r15 token pointers.

use super::gemv::WeightType;
use super::{
    Asm, LANES, cmp_imm8, count_mask, finish, lane_index, lane_mask, new_asm, reduce4, reg::*,
};
use crate::jback;
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemmParams {
    pub wt: WeightType,
    pub k: usize,
}

pub const ROWS: usize = 4;
pub const TOKENS: usize = 3;
const ROW_PTRS: [u8; ROWS] = [RBX, R10, R11, R12];
const TOK_PTRS: [u8; TOKENS] = [R13, R14, R15];
const W: u8 = 15;

fn acc(row: usize, tok: usize) -> u8 {
    (row * TOKENS + tok) as u8
}

fn load_w(ops: &mut Asm, wt: WeightType, p: u8, with_idx: bool, disp: i32) {
    let d8 = i8::try_from(disp).ok();
    match (wt, with_idx, d8) {
        (WeightType::F16, true, _) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(W), [BYTE Rq(p) + rax + 0])
        }
        (WeightType::F16, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(W), [BYTE Rq(p) + d])
        }
        (WeightType::F16, false, None) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(W), [Rq(p) + disp])
        }
        (WeightType::Bf16, true, _) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(W), [BYTE Rq(p) + rax + 0])
        }
        (WeightType::Bf16, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(W), [BYTE Rq(p) + d])
        }
        (WeightType::Bf16, false, None) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(W), [Rq(p) + disp])
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
    for (row, &pr) in ROW_PTRS.iter().enumerate() {
        load_w(ops, wt, pr, with_idx, wdisp);
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
    let kmain = p.k / LANES * LANES;
    let tail = p.k % LANES;
    let wstride = (p.k * eb) as i32;
    let xstride = (p.k * 4) as i32;

    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let row_block = ops.new_dynamic_label();
    let tok_block = ops.new_dynamic_label();
    let kloop = ops.new_dynamic_label();
    let stored = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; push rbx
        ; push rbp
        ; push r12
        ; push r13
        ; push r14
        ; push r15
        // 7th argument (ldY) sits above the 6 pushes and the return address.
        ; mov rbp, [rsp + 56]
        ; shl rbp, 2
        ; push r8
        ; cmp rcx, r8
        ; jae =>done
        ; test r9, r9
        ; jz =>done
    );
    let row_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>row_block
        ; xor r8d, r8d
    );
    let tok_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>tok_block
        ; mov rax, [rsp]
        ; sub rax, rcx
        ; imul rbx, rcx, wstride
        ; lea rbx, [rdi + rbx + (kmain * eb) as i32]
    );
    // Missing rows and tokens alias the first of the tile: reads stay in bounds.
    for (i, &pr) in ROW_PTRS.iter().enumerate().skip(1) {
        dynasm!(ops ; .arch x64 ; lea Rq(pr), [rbx + wstride * i as i32]);
        cmp_imm8(&mut ops, RAX, (i + 1) as i8);
        dynasm!(ops ; .arch x64 ; cmovb Rq(pr), rbx);
    }
    dynasm!(ops
        ; .arch x64
        ; mov rax, r9
        ; sub rax, r8
        ; imul r13, r8, xstride
        ; lea r13, [rsi + r13 + (kmain * 4) as i32]
    );
    for (j, &tp) in TOK_PTRS.iter().enumerate().skip(1) {
        dynasm!(ops ; .arch x64 ; lea Rq(tp), [r13 + xstride * j as i32]);
        cmp_imm8(&mut ops, RAX, (j + 1) as i8);
        dynasm!(ops ; .arch x64 ; cmovb Rq(tp), r13);
    }
    for a in 0..(ROWS * TOKENS) as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    dynasm!(ops ; .arch x64 ; mov rax, -((kmain * eb) as i32));
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>kloop);
    for (j, &tp) in TOK_PTRS.iter().enumerate() {
        if eb == 2 {
            dynasm!(ops ; .arch x64 ; vmovups Ry(12 + j as u8), [BYTE Rq(tp) + rax * 2 + 0]);
        } else {
            dynasm!(ops ; .arch x64 ; vmovups Ry(12 + j as u8), [BYTE Rq(tp) + rax + 0]);
        }
    }
    tile_step(&mut ops, p.wt, true, 0);
    dynasm!(ops ; .arch x64 ; add rax, BYTE (LANES * eb) as i8);
    jback!(ops, jnz, kloop, top);
    if tail > 0 {
        // Overlapping vector ending at K, already-summed lanes of x masked off.
        let e = (p.k - LANES) as i32 - kmain as i32;
        lane_mask(&mut ops, W, LANES - tail, tail);
        for (j, &tp) in TOK_PTRS.iter().enumerate() {
            dynasm!(ops ; .arch x64 ; vandps Ry(12 + j as u8), Ry(W), [BYTE Rq(tp) + (e * 4) as i8]);
        }
        tile_step(&mut ops, p.wt, false, e * eb as i32);
    }
    // Masked stores of the valid rows; r12 = tokens left, r11 = &Y[t, r].
    lane_index(&mut ops, 14);
    dynasm!(ops
        ; .arch x64
        ; mov r10, [rsp]
        ; sub r10, rcx
        ; mov r12, r9
        ; sub r12, r8
        ; mov r11, r8
        ; imul r11, rbp
        ; add r11, rdx
        ; lea r11, [r11 + rcx * 4]
    );
    count_mask(&mut ops, W, 14, R10);
    for tok in 0..TOKENS {
        if tok > 0 {
            cmp_imm8(&mut ops, R12, tok as i8 + 1);
            dynasm!(ops ; .arch x64 ; jb BYTE =>stored ; add r11, rbp);
        }
        let a = [acc(0, tok), acc(1, tok), acc(2, tok), acc(3, tok)];
        reduce4(&mut ops, a, 13);
        dynasm!(ops ; .arch x64 ; vmaskmovps [r11], Rx(W), Rx(a[0]));
    }
    dynasm!(ops
        ; .arch x64
        ; =>stored
        ; add r8, BYTE TOKENS as i8
        ; cmp r8, r9
    );
    jback!(ops, jb, tok_block, tok_top);
    dynasm!(ops
        ; .arch x64
        ; add rcx, BYTE ROWS as i8
        ; cmp rcx, [rsp]
    );
    jback!(ops, jb, row_block, row_top);
    dynasm!(ops
        ; .arch x64
        ; =>done
        ; pop r8
        ; pop r15
        ; pop r14
        ; pop r13
        ; pop r12
        ; pop rbp
        ; pop rbx
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}
