//! GEMV for decode: y[r] = scale * sum_k W[r,k] * x[k] for r in [r0, r1).
//!
//! Four rows form a block and share every activation load (measured +65% over
//! one row at a time). K, the row stride and the tail are immediates. The last
//! block of a range may be partial: its missing rows alias the first row of the
//! block (reads stay in bounds) and only the valid lanes are stored.
//!
//! The K tail (K % 8 elements) is computed with one overlapping vector ending
//! exactly at K; the already-summed lanes of x are zeroed by a mask, so every
//! load stays inside the row. This needs K >= 8, which the planner enforces.
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, xmm0=scale (scores
//! variant). r9/r10/r11/rbx = row pointers, r12 = rows left, r13 = biased x,
//! rax = K index counting up to 0. ymm0..7 accumulators, ymm8..11 x,
//! ymm12/13 weights, ymm14 scale, ymm15 tail mask.

use super::{Asm, LANES, finish, lane_mask, new_asm, reduce4, reg::*, store_lanes};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

/// Storage type of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightType {
    F16,
    Bf16,
    F32,
}

impl WeightType {
    pub fn bytes(self) -> usize {
        match self {
            WeightType::F16 | WeightType::Bf16 => 2,
            WeightType::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WeightType::F16 => "f16",
            WeightType::Bf16 => "bf16",
            WeightType::F32 => "f32",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemvParams {
    pub wt: WeightType,
    pub k: usize,
    /// Elements between row starts (K for a dense matrix; the KV stride for scores).
    pub row_stride: usize,
    /// 8-element vectors per loop iteration: 1, 2 or 4.
    pub unroll: usize,
    /// Bytes ahead to prefetch each row; 0 = none (plain streams were faster here).
    pub prefetch: usize,
    /// Multiply results by the f32 argument in xmm0 (attention scores).
    pub scaled: bool,
}

pub const ROWS: usize = 4;
const ROW_PTRS: [u8; ROWS] = [R9, R10, R11, RBX];
const XB: u8 = R13;
const MASK: u8 = 15;
const SCALE: u8 = 14;

/// Loads one weight vector (8 elements) at `[p + rax*idx + disp]` as f32 into `dst`.
fn load_w(ops: &mut Asm, wt: WeightType, dst: u8, p: u8, with_idx: bool, disp: i32) {
    match (wt, with_idx) {
        (WeightType::F16, true) => dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(dst), [Rq(p) + rax + disp]),
        (WeightType::F16, false) => dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(dst), [Rq(p) + disp]),
        (WeightType::Bf16, true) => dynasm!(ops ; .arch x64
            ; vpmovzxwd Ry(dst), [Rq(p) + rax + disp]
            ; vpslld Ry(dst), Ry(dst), 16),
        (WeightType::Bf16, false) => dynasm!(ops ; .arch x64
            ; vpmovzxwd Ry(dst), [Rq(p) + disp]
            ; vpslld Ry(dst), Ry(dst), 16),
        (WeightType::F32, true) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(p) + rax + disp]),
        (WeightType::F32, false) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(p) + disp]),
    }
}

/// Loads x vector at `[XB + rax*scale + disp]`; the scale relates the weight
/// byte index in rax to f32 offsets (2 for 16-bit weights, 1 for f32).
fn load_x(ops: &mut Asm, wt: WeightType, dst: u8, with_idx: bool, disp: i32) {
    match (wt.bytes(), with_idx) {
        (2, true) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(XB) + rax*2 + disp]),
        (_, true) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(XB) + rax + disp]),
        (_, false) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(XB) + disp]),
    }
}

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1[, scale])`.
pub fn emit(p: &GemvParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(p.k >= LANES, "{name}: K = {} is below the vector width {LANES}", p.k);
    anyhow::ensure!(matches!(p.unroll, 1 | 2 | 4), "{name}: unroll must be 1, 2 or 4");
    let eb = p.wt.bytes();
    let stride_b = (p.row_stride * eb) as i32;
    let step = LANES * p.unroll;
    let kmain = p.k / step * step;
    let rest_vecs = (p.k - kmain) / LANES;
    let tail = p.k % LANES;
    // One accumulator per row and unroll slot, at most two per row.
    let accs_per_row = p.unroll.min(2);
    let acc = |row: usize, j: usize| (row + ROWS * (j % accs_per_row)) as u8;

    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let kloop = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; push rbx
        ; push r12
        ; push r13
    );
    if p.scaled {
        dynasm!(ops ; .arch x64 ; vbroadcastss Ry(SCALE), xmm0);
    }
    if tail > 0 {
        lane_mask(&mut ops, MASK, LANES - tail, tail);
    }
    dynasm!(ops
        ; .arch x64
        ; lea Rq(XB), [rsi + (kmain * 4) as i32]
        ; cmp rcx, r8
        ; jae =>done
        ; =>block
        ; mov r12, r8
        ; sub r12, rcx
        ; imul r9, rcx, stride_b
        ; lea r9, [rdi + r9 + (kmain * eb) as i32]
    );
    for (i, &pr) in ROW_PTRS.iter().enumerate().skip(1) {
        dynasm!(ops
            ; .arch x64
            ; lea Rq(pr), [r9 + stride_b * i as i32]
            ; cmp r12, (i + 1) as i32
            ; cmovb Rq(pr), r9
        );
    }
    for a in 0..(ROWS * accs_per_row) as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    if kmain > 0 {
        dynasm!(ops
            ; .arch x64
            ; mov rax, -((kmain * eb) as i32)
            ; =>kloop
        );
        for j in 0..p.unroll {
            load_x(&mut ops, p.wt, 8 + j as u8, true, (j * 32) as i32);
        }
        if p.prefetch > 0 {
            for &pr in &ROW_PTRS {
                dynasm!(ops ; .arch x64 ; prefetcht0 [Rq(pr) + rax + p.prefetch as i32]);
            }
        }
        for j in 0..p.unroll {
            for (row, &pr) in ROW_PTRS.iter().enumerate() {
                let w = 12 + (row % 2) as u8;
                load_w(&mut ops, p.wt, w, pr, true, (j * LANES * eb) as i32);
                dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, j)), Ry(w), Ry(8 + j as u8));
            }
        }
        dynasm!(ops
            ; .arch x64
            ; add rax, (step * eb) as i32
            ; jnz =>kloop
        );
    }
    // Whole vectors left after the unrolled loop, at fixed offsets.
    for v in 0..rest_vecs {
        load_x(&mut ops, p.wt, 8, false, (v * 32) as i32);
        for (row, &pr) in ROW_PTRS.iter().enumerate() {
            let w = 12 + (row % 2) as u8;
            load_w(&mut ops, p.wt, w, pr, false, (v * LANES * eb) as i32);
            dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, v)), Ry(w), Ry(8));
        }
    }
    if tail > 0 {
        // The vector ending at K; offsets are relative to the biased pointers.
        let e = (p.k - LANES) as i32 - kmain as i32;
        dynasm!(ops ; .arch x64 ; vandps Ry(8), Ry(MASK), [Rq(XB) + e * 4]);
        for (row, &pr) in ROW_PTRS.iter().enumerate() {
            let w = 12 + (row % 2) as u8;
            load_w(&mut ops, p.wt, w, pr, false, e * eb as i32);
            dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, 0)), Ry(w), Ry(8));
        }
    }
    if accs_per_row == 2 {
        for row in 0..ROWS as u8 {
            dynasm!(ops ; .arch x64 ; vaddps Ry(row), Ry(row), Ry(row + ROWS as u8));
        }
    }
    reduce4(&mut ops, [0, 1, 2, 3], 8);
    if p.scaled {
        dynasm!(ops ; .arch x64 ; vmulps xmm0, xmm0, Rx(SCALE));
    }
    dynasm!(ops ; .arch x64 ; lea rax, [rdx + rcx * 4]);
    store_lanes(&mut ops, 0, RAX, R12);
    dynasm!(ops
        ; .arch x64
        ; add rcx, ROWS as i32
        ; cmp rcx, r8
        ; jb =>block
        ; =>done
        ; pop r13
        ; pop r12
        ; pop rbx
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}
