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
//! F16: ymm0..7 accumulators, ymm8..11 x, ymm12 weights. BF16 (see
//! `bf16_group`): ymm0..7 accumulators, ymm8/9 x's halves, ymm10..12
//! weights, ymm14 zero. Both: ymm13 lane indices, ymm15 tail mask.
//!
//! With AVX-512 `PlanOptions::zmm_gemv` plans the zmm form instead
//! (`emit::gemv_wide`).

use super::gemm_quant::iced;
use super::{
    Asm, LANES, add_rax, lane_index, lane_mask, new_asm, reduce4, return_at,
    store_rows_and_next_block,
};
use crate::jback;
use crate::model::row_blocks;
use dynasmrt::{AssemblyOffset, DynamicLabel, DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

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

/// Loads row `row`'s 8 F16 weights of a group as f32 into ymm12: at
/// `[r9 + rax*2 + disp]` in the loop (rax counts x bytes, 32 per group,
/// against 64 weight bytes), at `[r9 + disp]` after it.
fn load_w(ops: &mut Asm, indexed: bool, disp: i32) {
    let d8 = i8::try_from(disp).ok();
    match (indexed, d8) {
        (true, Some(d)) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [BYTE r9 + rax * 2 + d]),
        (true, None) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [r9 + rax * 2 + disp]),
        (false, Some(d)) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [BYTE r9 + d]),
        (false, None) => dynasm!(ops ; .arch x64 ; vcvtph2ps ymm12, [r9 + disp]),
    }
}

/// F16's group step: the 4 rows of group `group` (counted from the block
/// pointer) times the x vector in ymm`x`, into the accumulators `acc(row)`.
fn group_step(ops: &mut Asm, indexed: bool, group: usize, x: u8, acc: impl Fn(usize) -> u8) {
    for row in 0..ROWS {
        load_w(ops, indexed, (group * GROUP_BYTES + row * LANES * 2) as i32);
        dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(row)), ymm12, Ry(x));
    }
}

/// Accumulators of BF16's group step: pair p (rows 2p, 2p+1), columns
/// 0-3 (h = 0) or 4-7 (h = 1), unroll slot s: `BF16_ACC[p + 2h + 4s]`.
const BF16_ACC: [AsmRegisterYmm; 8] = [ymm0, ymm1, ymm2, ymm3, ymm4, ymm5, ymm6, ymm7];

/// BF16's group step: each pair of rows (32 bytes, row 2p in the low
/// 128-bit lane, 2p+1 in the high) unpacked with zero (ymm14) into
/// columns 0-3 and 4-7 as f32 (bf16 is the high half of an f32, so this
/// is exact), times the input's columns 0-3 (ymm8) and 4-7 (ymm9), each
/// broadcast to both lanes. Per line 4 unpacks and 4 FMAs, where widening
/// each row (`vpmovzxwd`, a shift) took 8 operations and 4 FMAs: about
/// 1.5x the rate from L1 on Zen 4 (docs/performance.md). `masked`: the
/// zero-padded last group, x's lanes past K read under ymm15.
fn bf16_group(
    a: &mut CodeAssembler,
    indexed: bool,
    group: usize,
    slot: usize,
    masked: bool,
) -> Result<(), IcedError> {
    let x_disp = (group * LANES * 4) as i32;
    let x = |d: i32| match indexed {
        true => r11 + rax + x_disp + d,
        false => r11 + x_disp + d,
    };
    if masked {
        a.vmaskmovps(ymm8, ymm15, ymmword_ptr(x(0)))?;
        a.vperm2f128(ymm9, ymm8, ymm8, 0x11)?;
        a.vperm2f128(ymm8, ymm8, ymm8, 0x00)?;
    } else {
        a.vbroadcastf128(ymm8, xmmword_ptr(x(0)))?;
        a.vbroadcastf128(ymm9, xmmword_ptr(x(16)))?;
    }
    for pair in 0..2 {
        let w_disp = (group * GROUP_BYTES + pair * 32) as i32;
        let w = match indexed {
            true => ymmword_ptr(r9 + rax * 2 + w_disp),
            false => ymmword_ptr(r9 + w_disp),
        };
        a.vmovdqu(ymm10, w)?;
        a.vpunpcklwd(ymm11, ymm14, ymm10)?;
        a.vpunpckhwd(ymm12, ymm14, ymm10)?;
        a.vfmadd231ps(BF16_ACC[pair + 4 * slot], ymm11, ymm8)?;
        a.vfmadd231ps(BF16_ACC[pair + 2 + 4 * slot], ymm12, ymm9)?;
    }
    Ok(())
}

/// BF16's accumulators reduced to `[row 0, 1, 2, 3]` in xmm0.
fn bf16_reduce(a: &mut CodeAssembler, slots: usize) -> Result<(), IcedError> {
    if slots == 2 {
        for i in 0..4 {
            a.vaddps(BF16_ACC[i], BF16_ACC[i], BF16_ACC[i + 4])?;
        }
    }
    // ymm0 = [row 0 | row 1], ymm1 = [row 2 | row 3], 4 partial sums each.
    a.vaddps(ymm0, ymm0, ymm2)?;
    a.vaddps(ymm1, ymm1, ymm3)?;
    // [r0 r0 r2 r2 | r1 r1 r3 r3], then [r0 r2 . . | r1 r3 . .].
    a.vhaddps(ymm0, ymm0, ymm1)?;
    a.vhaddps(ymm0, ymm0, ymm0)?;
    a.vextractf128(xmm2, ymm0, 1)?;
    a.vunpcklps(xmm0, xmm0, xmm2)
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
    let block_top = open_block_loop(
        &mut ops,
        (looped * LANES * 4) as i32,
        (looped * GROUP_BYTES) as i32,
        per_row,
        block,
        done,
    );
    for a in 0..(ROWS * accs_per_row) as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    let bf16 = p.wt == WeightType::Bf16;
    if bf16 {
        iced(&mut ops, |a| a.vpxor(xmm14, xmm14, xmm14));
    }
    if looped > 0 {
        dynasm!(ops ; .arch x64 ; mov rax, -((looped * LANES * 4) as i32));
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>kloop);
        if bf16 {
            iced(&mut ops, |a| {
                (0..p.unroll).try_for_each(|j| bf16_group(a, true, j, j % accs_per_row, false))
            });
        } else {
            for j in 0..p.unroll {
                load_x(&mut ops, 8 + j as u8, true, (j * LANES * 4) as i32);
            }
            for j in 0..p.unroll {
                group_step(&mut ops, true, j, 8 + j as u8, |row| acc(row, j));
            }
        }
        add_rax(&mut ops, (p.unroll * LANES * 4) as i32);
        jback!(ops, jnz, kloop, top);
    }
    if bf16 {
        iced(&mut ops, |a| {
            for v in 0..rest + usize::from(tail > 0) {
                bf16_group(a, false, v, v % accs_per_row, v == rest)?;
            }
            bf16_reduce(a, accs_per_row)
        });
        store_rows_and_next_block(&mut ops, IDX, block, block_top);
        return return_at(ops, done, name);
    }
    // Whole groups left after the unrolled loop, then the padded one.
    for v in 0..rest + usize::from(tail > 0) {
        let x_at = (v * LANES * 4) as i32;
        if v == rest {
            dynasm!(ops ; .arch x64 ; vmaskmovps ymm8, Ry(MASK), [r11 + x_at]);
        } else {
            load_x(&mut ops, 8, false, x_at);
        }
        group_step(&mut ops, false, v, 8, |row| acc(row, v));
    }
    if accs_per_row == 2 {
        for row in 0..ROWS as u8 {
            dynasm!(ops ; .arch x64 ; vaddps Ry(row), Ry(row), Ry(row + ROWS as u8));
        }
    }
    reduce4(&mut ops, [0, 1, 2, 3], 8);
    store_rows_and_next_block(&mut ops, IDX, block, block_top);
    return_at(ops, done, name)
}

/// The head of the loop over row blocks both GEMV forms share: r11 = x
/// past the unrolled groups (`x_skip` bytes), nothing to do when r1 <= r,
/// then at the returned offset (`block`) r9 = the block's weights past
/// them (`w_skip` bytes), `per_row` bytes a row of the block.
pub(super) fn open_block_loop(
    ops: &mut Asm,
    x_skip: i32,
    w_skip: i32,
    per_row: i32,
    block: DynamicLabel,
    done: DynamicLabel,
) -> AssemblyOffset {
    dynasm!(ops
        ; .arch x64
        ; lea r11, [rsi + x_skip]
        ; cmp rcx, r8
        ; jae =>done
    );
    let block_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>block
        ; imul r9, rcx, per_row
        ; lea r9, [rdi + r9 + w_skip]
    );
    block_top
}
