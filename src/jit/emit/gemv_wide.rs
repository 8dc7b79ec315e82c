//! The 16-bit GEMV on 512-bit vectors: the same product, arguments and
//! row blocks as `emit::gemv` (4 rows per block, each 8-column group of
//! the 4 rows one 64-byte line), with fewer instructions per line.
//!
//! - **BF16**: a line loaded as it is holds row r in 128-bit lane r.
//!   `vpunpcklwd` with a zero register makes each lane's first 4 values
//!   the high halves of 4 dwords, i.e. exactly those values as f32 (bf16
//!   is the high half of an f32), `vpunpckhwd` its last 4; the input's
//!   columns 0-3 and 4-7 are broadcast to the 4 lanes. Per line: a load,
//!   2 unpacks, 2 FMAs and 2 broadcasts, where the ymm form spends 4
//!   widening loads, 4 shifts and 4 FMAs.
//! - **F16**: half a line (rows 0-1 or 2-3) widened by `vcvtph2ps` to 16
//!   f32, the input's 8 columns broadcast to both halves. Per line: 2
//!   conversions and 2 FMAs.
//!
//! The widening is exact and every product is summed in f32 by FMA, as in
//! the ymm form; only the order of the sums differs.
//!
//! Not planned by default (`PlanOptions::zmm_gemv`): on Zen 4 neither form
//! streams from memory faster than the ymm one, and F16's zmm conversion
//! runs at half the ymm one's rate (docs/performance.md, "The 16-bit GEMV
//! on zmm registers").
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, r9=block
//! pointer (biased to the end of the unrolled groups), r10 the store's
//! mask, r11=biased x, rax=x byte index counting up to 0.
//! zmm0/1 and zmm4/5 the accumulators (unroll slot s: zmm s and zmm 4+s),
//! zmm8 and zmm10 the reduction, zmm14 the row order, zmm15 zero,
//! zmm16..19 the inputs, zmm24..27 the widened weights, zmm31 the tail's
//! input, k1 the tail's lanes, k2 the rows stored.

use super::gemm_quant::iced;
use super::gemm_wide::pair_sums;
use super::gemv::{GemvParams, ROWS, WeightType, open_block_loop};
use super::{LANES, new_asm, return_at};
use crate::jback;
use crate::model::row_blocks;
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

/// Bytes of one 8-column group of a block: 4 rows x 8 values x 2 bytes.
const GROUP_BYTES: i32 = (ROWS * LANES * 2) as i32;
/// Bytes of x per group: 8 f32.
const X_BYTES: i32 = (LANES * 4) as i32;
const ZERO: AsmRegisterZmm = zmm15;
const ORDER: AsmRegisterZmm = zmm14;
/// Slot s's accumulators: `LO[s]` (BF16: columns 0-3; F16: rows 0-1) and
/// `HI[s]` (columns 4-7; rows 2-3).
const LO: [AsmRegisterZmm; 2] = [zmm0, zmm1];
const HI: [AsmRegisterZmm; 2] = [zmm4, zmm5];
const LO_XMM: [AsmRegisterXmm; 2] = [xmm0, xmm1];
const HI_XMM: [AsmRegisterXmm; 2] = [xmm4, xmm5];
/// The inputs of slot s: `X[2s]` and `X[2s + 1]` (F16: `X[2s]` only).
const X: [AsmRegisterZmm; 4] = [zmm16, zmm17, zmm18, zmm19];
/// The tail's masked input load lands here before it is spread.
const X_TAIL: AsmRegisterZmm = zmm31;
/// Slot s's widened weights: `W[2s]` and `W[2s + 1]`.
const W: [AsmRegisterZmm; 4] = [zmm24, zmm25, zmm26, zmm27];

/// Where a group's weights and inputs are: in the loop, indexed by rax
/// (32 bytes of x per 64 of weights); after it, at fixed offsets.
#[derive(Clone, Copy)]
enum At {
    Indexed,
    Fixed,
}

fn w_at(at: At, disp: i32) -> AsmMemoryOperand {
    match at {
        At::Indexed => ptr(r9 + rax * 2 + disp),
        At::Fixed => ptr(r9 + disp),
    }
}

fn x_at(at: At, disp: i32) -> AsmMemoryOperand {
    match at {
        At::Indexed => ptr(r11 + rax + disp),
        At::Fixed => ptr(r11 + disp),
    }
}

/// Group `g`'s inputs into slot `s`'s x registers: BF16 columns 0-3 and
/// 4-7 each broadcast to 4 lanes; F16 all 8 broadcast to both halves.
/// `masked`: the zero-padded last group, whose lanes past K are read
/// under k1 (never outside x) and then spread by shuffles.
fn load_x(
    a: &mut CodeAssembler,
    wt: WeightType,
    at: At,
    g: usize,
    s: usize,
    masked: bool,
) -> Result<(), IcedError> {
    let disp = g as i32 * X_BYTES;
    let (lo, hi) = (X[2 * s], X[2 * s + 1]);
    if masked {
        // A zmm load: iced picks VEX for the ymm form, which has no mask.
        let tail = match at {
            At::Indexed => zmmword_ptr(r11 + rax + disp),
            At::Fixed => zmmword_ptr(r11 + disp),
        };
        a.vmovups(X_TAIL.k1().z(), tail)?;
        // vshuff32x4 picks a 128-bit lane for each of the 4: 0000, 1111, 0101.
        return match wt {
            WeightType::Bf16 => {
                a.vshuff32x4(lo, X_TAIL, X_TAIL, 0x00)?;
                a.vshuff32x4(hi, X_TAIL, X_TAIL, 0x55)
            }
            _ => a.vshuff32x4(lo, X_TAIL, X_TAIL, 0x44),
        };
    }
    match wt {
        WeightType::Bf16 => {
            a.vbroadcastf32x4(lo, x_at(at, disp))?;
            a.vbroadcastf32x4(hi, x_at(at, disp + 16))
        }
        _ => a.vbroadcastf64x4(lo, x_at(at, disp)),
    }
}

/// Group `g`'s 4 rows times slot `s`'s inputs, into slot `s`'s accumulators.
fn products(
    a: &mut CodeAssembler,
    wt: WeightType,
    at: At,
    g: usize,
    s: usize,
) -> Result<(), IcedError> {
    let disp = g as i32 * GROUP_BYTES;
    let (w0, w1) = (W[2 * s], W[2 * s + 1]);
    let (x0, x1) = match wt {
        WeightType::Bf16 => (X[2 * s], X[2 * s + 1]),
        _ => (X[2 * s], X[2 * s]),
    };
    match wt {
        WeightType::Bf16 => {
            // One load, then both unpacks from the register: a second
            // 512-bit load per line (Zen 4 takes one a cycle) cost more.
            a.vmovdqu32(w1, w_at(at, disp))?;
            a.vpunpcklwd(w0, ZERO, w1)?;
            a.vpunpckhwd(w1, ZERO, w1)?;
        }
        _ => {
            a.vcvtph2ps(w0, w_at(at, disp))?;
            a.vcvtph2ps(w1, w_at(at, disp + 32))?;
        }
    }
    a.vfmadd231ps(LO[s], w0, x0)?;
    a.vfmadd231ps(HI[s], w1, x1)
}

/// The slots' accumulators reduced to the 4 rows' sums in zmm8's first
/// 4 elements, in order.
fn reduce(a: &mut CodeAssembler, wt: WeightType, slots: usize) -> Result<(), IcedError> {
    for s in 1..slots {
        a.vaddps(LO[0], LO[0], LO[s])?;
        a.vaddps(HI[0], HI[0], HI[s])?;
    }
    if wt != WeightType::Bf16 {
        // Rows 0|1 and 2|3, 8 lanes each, to row r's 4 lanes in lane r:
        // lanes [0, 2] of each, then lanes [1, 3].
        a.vshuff32x4(zmm8, LO[0], HI[0], 0x88)?;
        a.vshuff32x4(HI[0], LO[0], HI[0], 0xDD)?;
        a.vmovaps(LO[0], zmm8)?;
    }
    // Lane r: row r's 4 partial sums; then their pairs, then row r's sum
    // in every element of lane r.
    a.vaddps(LO[0], LO[0], HI[0])?;
    pair_sums(a, zmm8, LO[0], LO[0], zmm10)?;
    pair_sums(a, zmm8, zmm8, zmm8, zmm10)?;
    // Row r from element 4r to r.
    a.vpermps(zmm8, ORDER, zmm8)
}

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1)`.
pub fn emit(p: &GemvParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let groups = p.k / LANES;
    let tail = p.k % LANES;
    let looped = groups / p.unroll * p.unroll;
    let rest = groups - looped;
    let slots = p.unroll.min(2);
    // Bytes from one block to the next, per row of the block (r0 and r are
    // multiples of 4, so r * this is the block's offset).
    let per_row = (row_blocks::padded_cols(p.k) * 2) as i32;

    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let kloop = ops.new_dynamic_label();
    iced(&mut ops, |a| {
        if tail > 0 {
            a.mov(eax, (1u32 << tail) - 1)?;
            a.kmovw(k1, eax)?;
        }
        // The row order: element r takes 4r (bytes 0, 4, 8, 12).
        a.mov(eax, 0x0C08_0400u32)?;
        a.vmovd(xmm8, eax)?;
        a.vpmovzxbd(ORDER, xmm8)?;
        a.vpxord(ZERO, ZERO, ZERO)
    });
    let block_top = open_block_loop(
        &mut ops,
        looped as i32 * X_BYTES,
        looped as i32 * GROUP_BYTES,
        per_row,
        block,
        done,
    );
    iced(&mut ops, |a| {
        // VEX xmm forms clear the whole register, in 4 bytes.
        for s in 0..slots {
            a.vxorps(LO_XMM[s], LO_XMM[s], LO_XMM[s])?;
            a.vxorps(HI_XMM[s], HI_XMM[s], HI_XMM[s])?;
        }
        Ok(())
    });
    if looped > 0 {
        dynasm!(ops ; .arch x64 ; mov rax, -(looped as i32 * X_BYTES));
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>kloop);
        iced(&mut ops, |a| {
            for g in 0..p.unroll {
                load_x(a, p.wt, At::Indexed, g, g % slots, false)?;
                products(a, p.wt, At::Indexed, g, g % slots)?;
            }
            a.add(rax, p.unroll as i32 * X_BYTES)
        });
        jback!(ops, jnz, kloop, top);
    }
    // Whole groups left after the unrolled loop, then the padded one; then
    // the rows that exist (r1 - r, at most 4) stored under k2.
    iced(&mut ops, |a| {
        for g in 0..rest + usize::from(tail > 0) {
            load_x(a, p.wt, At::Fixed, g, g % slots, g == rest)?;
            products(a, p.wt, At::Fixed, g, g % slots)?;
        }
        reduce(a, p.wt, slots)?;
        a.mov(rax, r8)?;
        a.sub(rax, rcx)?;
        a.mov(r10d, ROWS as u32)?;
        a.cmp(r10, rax)?;
        a.cmovb(rax, r10)?;
        a.xor(r10d, r10d)?;
        a.bts(r10d, eax)?;
        a.dec(r10d)?;
        a.kmovw(k2, r10d)?;
        a.vmovups(zmmword_ptr(rdx + rcx * 4).k2(), zmm8)?;
        a.add(rcx, ROWS as i32)?;
        a.cmp(rcx, r8)
    });
    jback!(ops, jb, block, block_top);
    return_at(ops, done, name)
}
