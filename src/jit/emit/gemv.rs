//! GEMV for decode: `y[r] = sum_k W[r,k] * x[k]` for r in `r0..r1`, W in
//! the row-block layout (`model::row_blocks`): 16-bit weights, 4 rows per
//! block, each 8-column group of the 4 rows one 64-byte line.
//!
//! The 4 rows of a block share every activation load (about 1.65x the
//! speed of one row at a time) and are read as one sequential stream,
//! which the hardware prefetcher follows without help: plain rows of 1-4
//! KiB, 4 short interleaved streams per block, needed a tuned software
//! prefetch to stream well, while a row-block stream reads as fast as a
//! plain memory read.
//!
//! K, the block size and the tail are immediates. r0 must be a multiple of
//! 4; the last block may be partial, its padding rows are zeros in memory
//! and only the valid rows are stored. A K that is not a multiple of 8 ends
//! in a zero-padded group whose x lanes past K are masked off at load, so
//! no read leaves x.
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, r9=block
//! pointer, r10=rows left (at the store), r11=biased x, rax=x byte index
//! counting up to 0.
//! ymm0..7 accumulators, ymm8..11 x, ymm12 weights, ymm13 lane indices,
//! ymm15 tail mask.

use super::{
    Asm, LANES, add_rax, finish, lane_index, lane_mask, new_asm, reduce4, store_rows_and_next_block,
};
use crate::jback;
use crate::model::row_blocks;
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
    /// F16 or BF16 (the row-block layout holds 16-bit values).
    pub wt: WeightType,
    pub k: usize,
    /// 8-column groups per loop iteration: 1, 2 or 4.
    pub unroll: usize,
    /// The AVX-512 form on zmm registers (`emit::gemv_wide`) instead of
    /// the AVX2 one.
    pub zmm: bool,
}

pub const ROWS: usize = row_blocks::BLOCK_ROWS;
/// Bytes of one 8-column group of a block: 4 rows x 8 values x 2 bytes.
const GROUP_BYTES: usize = ROWS * LANES * 2;
const IDX: u8 = 13;
const MASK: u8 = 15;

/// Loads row `row`'s 8 weights of a group as f32 into ymm12: at
/// `[r9 + rax*2 + disp]` in the loop (rax counts x bytes, 32 per group,
/// against 64 weight bytes), at `[r9 + disp]` after it.
fn load_w(ops: &mut Asm, wt: WeightType, indexed: bool, disp: i32) {
    let d8 = i8::try_from(disp).ok();
    match (wt, indexed, d8) {
        (WeightType::Bf16, true, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd ymm12, [BYTE r9 + rax * 2 + d])
        }
        (WeightType::Bf16, true, None) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd ymm12, [r9 + rax * 2 + disp])
        }
        (WeightType::Bf16, false, Some(d)) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd ymm12, [BYTE r9 + d])
        }
        (WeightType::Bf16, false, None) => {
            dynasm!(ops ; .arch x64 ; vpmovzxwd ymm12, [r9 + disp])
        }
        (_, true, Some(d)) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [BYTE r9 + rax * 2 + d]),
        (_, true, None) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [r9 + rax * 2 + disp]),
        (_, false, Some(d)) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [BYTE r9 + d]),
        (_, false, None) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [r9 + disp]),
    }
    if wt == WeightType::Bf16 {
        // bf16 is the high half of an f32.
        dynasm!(ops ; .arch x64 ; vpslld ymm12, ymm12, 16);
    }
}

/// The 4 rows of group `group` (counted from the block pointer) times the
/// x vector in ymm`x`, into the accumulators `acc(row)`.
fn group_step(
    ops: &mut Asm,
    wt: WeightType,
    indexed: bool,
    group: usize,
    x: u8,
    acc: impl Fn(usize) -> u8,
) {
    for row in 0..ROWS {
        load_w(
            ops,
            wt,
            indexed,
            (group * GROUP_BYTES + row * LANES * 2) as i32,
        );
        dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row)), ymm12, Ry(x));
    }
}

/// Loads x's 8 values at `[r11 + rax + disp]` (or `[r11 + disp]`).
fn load_x(ops: &mut Asm, dst: u8, indexed: bool, disp: i32) {
    let d8 = i8::try_from(disp).ok();
    match (indexed, d8) {
        (true, Some(d)) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE r11 + rax + d]),
        (true, None) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [r11 + rax + disp]),
        (false, Some(d)) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [BYTE r11 + d]),
        (false, None) => dynasm!(ops ; .arch x64 ; vmovups Ry(dst), [r11 + disp]),
    }
}

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1)`.
pub fn emit(p: &GemvParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        p.wt.bytes() == 2,
        "{name}: GEMV weights are 16-bit row blocks, not {}",
        p.wt.name()
    );
    anyhow::ensure!(p.k > 0, "{name}: K must be positive");
    anyhow::ensure!(
        matches!(p.unroll, 1 | 2 | 4),
        "{name}: unroll must be 1, 2 or 4"
    );
    if p.zmm {
        return super::gemv_wide::emit(p, name);
    }
    let groups = p.k / LANES;
    let tail = p.k % LANES;
    let looped = groups / p.unroll * p.unroll;
    let rest = groups - looped;
    // Bytes from one block to the next, per row of the block (r0 and r are
    // multiples of 4, so r * this is the block's offset).
    let per_row = (row_blocks::padded_cols(p.k) * 2) as i32;
    // One accumulator per row and unroll slot, at most two per row.
    let accs_per_row = p.unroll.min(2);
    let acc = |row: usize, j: usize| (row + ROWS * (j % accs_per_row)) as u8;

    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let kloop = ops.new_dynamic_label();
    if tail > 0 {
        lane_mask(&mut ops, MASK, 0, tail);
    }
    lane_index(&mut ops, IDX);
    dynasm!(ops
        ; .arch x64
        ; lea r11, [rsi + (looped * LANES * 4) as i32]
        ; cmp rcx, r8
        ; jae =>done
    );
    let block_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>block
        ; imul r9, rcx, per_row
        ; lea r9, [rdi + r9 + (looped * GROUP_BYTES) as i32]
    );
    for a in 0..(ROWS * accs_per_row) as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    if looped > 0 {
        dynasm!(ops ; .arch x64 ; mov rax, -((looped * LANES * 4) as i32));
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>kloop);
        for j in 0..p.unroll {
            load_x(&mut ops, 8 + j as u8, true, (j * LANES * 4) as i32);
        }
        for j in 0..p.unroll {
            group_step(&mut ops, p.wt, true, j, 8 + j as u8, |row| acc(row, j));
        }
        add_rax(&mut ops, (p.unroll * LANES * 4) as i32);
        jback!(ops, jnz, kloop, top);
    }
    // Whole groups left after the unrolled loop, then the padded one.
    for v in 0..rest + usize::from(tail > 0) {
        let x_at = (v * LANES * 4) as i32;
        if v == rest {
            dynasm!(ops ; .arch x64 ; vmaskmovps ymm8, Ry(MASK), [r11 + x_at]);
        } else {
            load_x(&mut ops, 8, false, x_at);
        }
        group_step(&mut ops, p.wt, false, v, 8, |row| acc(row, v));
    }
    if accs_per_row == 2 {
        for row in 0..ROWS as u8 {
            dynasm!(ops ; .arch x64 ; vaddps Ry(row), Ry(row), Ry(row + ROWS as u8));
        }
    }
    reduce4(&mut ops, [0, 1, 2, 3], 8);
    store_rows_and_next_block(&mut ops, IDX, block, block_top);
    dynasm!(ops
        ; .arch x64
        ; =>done
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}
