//! GEMV for decode: `y[r] = scale * sum_k W[r,k] * x[k]` for r in `r0..r1`.
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
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1. r9/r10/r11/rbx = row pointers, r12 = rows left, r13 = biased x,
//! rax = K index counting up to 0. ymm0..7 accumulators, ymm8..11 x,
//! ymm12 weights, ymm13 lane indices, ymm15 tail mask.

use super::{
    Asm, LANES, add_rax, alias_missing, count_mask, finish, lane_index, lane_mask, new_asm,
    reduce4, reg::*,
};
use crate::jback;
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
    /// Elements between row starts (K for a dense matrix).
    pub row_stride: usize,
    /// 8-element vectors per loop iteration: 1, 2 or 4.
    pub unroll: usize,
    /// Software prefetch distance in bytes along the block stream; 0 = none.
    /// The 4 rows of a block are contiguous, so a block is one sequential
    /// region of 4*K*eb bytes consumed at 4 bytes of region per byte of row;
    /// the kernel prefetches `prefetch` bytes ahead of its position in that
    /// region, one line per 64 bytes consumed. Short rows give the hardware
    /// prefetcher four short interleaved streams, which it handles poorly.
    pub prefetch: usize,
}

pub const ROWS: usize = 4;
const ROW_PTRS: [u8; ROWS] = [R9, R10, R11, RBX];
const WT: u8 = 12;
const IDX: u8 = 13;
const MASK: u8 = 15;

/// Loads one weight vector (8 elements) at `[p + rax + disp]` (or `[p + disp]`
/// without the index) as f32 into `dst`. Small displacements use disp8.
fn load_w(ops: &mut Asm, wt: WeightType, dst: u8, p: u8, with_idx: bool, disp: i32) {
    let d8 = i8::try_from(disp).ok();
    match (wt, with_idx, d8) {
        (WeightType::F16, true, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(dst), [BYTE Rq(p) + rax + d])
        }
        (WeightType::F16, true, None) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(dst), [Rq(p) + rax + disp])
        }
        (WeightType::F16, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(dst), [BYTE Rq(p) + d])
        }
        (WeightType::F16, false, None) => {
            dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(dst), [Rq(p) + disp])
        }
        (WeightType::Bf16, true, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(dst), [BYTE Rq(p) + rax + d])
        }
        (WeightType::Bf16, true, None) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(dst), [Rq(p) + rax + disp])
        }
        (WeightType::Bf16, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(dst), [BYTE Rq(p) + d])
        }
        (WeightType::Bf16, false, None) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd Ry(dst), [Rq(p) + disp])
        }
        (WeightType::F32, true, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE Rq(p) + rax + d])
        }
        (WeightType::F32, true, None) => {
            dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(p) + rax + disp])
        }
        (WeightType::F32, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE Rq(p) + d])
        }
        (WeightType::F32, false, None) => {
            dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [Rq(p) + disp])
        }
    }
    if wt == WeightType::Bf16 {
        // bf16 is the high half of an f32.
        dynasm!(ops ; .arch x64 ; vpslld Ry(dst), Ry(dst), 16);
    }
}

/// Loads the x vector at `[XB + rax*s + disp]`, s relating the weight byte
/// index in rax to f32 offsets (2 for 16-bit weights, 1 for f32).
fn load_x(ops: &mut Asm, wt: WeightType, dst: u8, with_idx: bool, disp: i32) {
    let d8 = i8::try_from(disp).ok();
    match (wt.bytes(), with_idx, d8) {
        (2, true, Some(d)) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE r13 + rax*2 + d]),
        (2, true, None) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [r13 + rax*2 + disp]),
        (_, true, Some(d)) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE r13 + rax + d]),
        (_, true, None) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [r13 + rax + disp]),
        (_, false, Some(d)) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE r13 + d]),
        (_, false, None) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [r13 + disp]),
    }
}

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1)`.
pub fn emit(p: &GemvParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        p.k >= LANES,
        "{name}: K = {} is below the vector width {LANES}",
        p.k
    );
    anyhow::ensure!(
        matches!(p.unroll, 1 | 2 | 4),
        "{name}: unroll must be 1, 2 or 4"
    );
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
    if tail > 0 {
        lane_mask(&mut ops, MASK, LANES - tail, tail);
    }
    lane_index(&mut ops, IDX);
    dynasm!(ops
        ; .arch x64
        ; lea r13, [rsi + (kmain * 4) as i32]
        ; cmp rcx, r8
        ; jae =>done
    );
    let block_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>block
        ; mov r12, r8
        ; sub r12, rcx
        ; imul r9, rcx, stride_b
        ; lea r9, [rdi + r9 + (kmain * eb) as i32]
    );
    // Rows past the end alias row 0 of the block: reads stay in bounds.
    for (i, &pr) in ROW_PTRS.iter().enumerate().skip(1) {
        dynasm!(ops ; .arch x64 ; lea Rq(pr), [r9 + stride_b * i as i32]);
    }
    alias_missing(&mut ops, &ROW_PTRS, R12);
    for a in 0..(ROWS * accs_per_row) as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    if kmain > 0 {
        dynasm!(ops ; .arch x64 ; mov rax, -((kmain * eb) as i32));
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>kloop);
        for j in 0..p.unroll {
            load_x(&mut ops, p.wt, 8 + j as u8, true, (j * 32) as i32);
        }
        if p.prefetch > 0 {
            // Position in the block region: row0 start + 4 * (k * eb)
            // = r9 + 4*rax + 3*kmain*eb (r9 and rax are biased by kmain*eb).
            let base = (3 * kmain * eb + p.prefetch) as i32;
            for line in 0..(ROWS * step * eb).div_ceil(64) {
                dynasm!(ops ; .arch x64 ; prefetcht0 [r9 + rax * 4 + base + 64 * line as i32]);
            }
        }
        for j in 0..p.unroll {
            for (row, &pr) in ROW_PTRS.iter().enumerate() {
                load_w(&mut ops, p.wt, WT, pr, true, (j * LANES * eb) as i32);
                dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, j)), Ry(WT), Ry(8 + j as u8));
            }
        }
        add_rax(&mut ops, (step * eb) as i32);
        jback!(ops, jnz, kloop, top);
    }
    // Whole vectors left after the unrolled loop, at fixed offsets.
    for v in 0..rest_vecs {
        load_x(&mut ops, p.wt, 8, false, (v * 32) as i32);
        for (row, &pr) in ROW_PTRS.iter().enumerate() {
            load_w(&mut ops, p.wt, WT, pr, false, (v * LANES * eb) as i32);
            dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, v)), Ry(WT), Ry(8));
        }
    }
    if tail > 0 {
        // The vector ending at K; offsets are relative to the biased pointers.
        let e = (p.k - LANES) as i32 - kmain as i32;
        dynasm!(ops ; .arch x64 ; vandps ymm8, Ry(MASK), [r13 + e * 4]);
        for (row, &pr) in ROW_PTRS.iter().enumerate() {
            load_w(&mut ops, p.wt, WT, pr, false, e * eb as i32);
            dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row, 0)), Ry(WT), ymm8);
        }
    }
    if accs_per_row == 2 {
        for row in 0..ROWS as u8 {
            dynasm!(ops ; .arch x64 ; vaddps Ry(row), Ry(row), Ry(row + ROWS as u8));
        }
    }
    reduce4(&mut ops, [0, 1, 2, 3], 8);
    // Store only the rows that exist (a masked store; once per 4 rows x K).
    count_mask(&mut ops, 8, IDX, R12);
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
        ; pop r13
        ; pop r12
        ; pop rbx
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}
