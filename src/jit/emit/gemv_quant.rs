//! Integer GEMV for quantized weights (Q8_0, Q5_0, Q4_0): `y[r] = sum_g d_w[r,g]
//! * d_x[g] * (v_w[r,g] · q_x[g])` for r in `r0..r1`, W in quantized row
//! blocks (`model::quant_blocks`: per 32-column group, the 4 rows' f16
//! scales, then their 4 payloads) and x quantized to 8 bits per 32 values
//! (`engine::q8_input`: K quants, K/32 f32 scales, K/32 i32 sums).
//!
//! One emitter for every type: the frame (pointers, scales, the fold of
//! the 4 rows' sums, the store) is shared, and each type adds how one
//! row's payload becomes 8 lane sums of products ([`row_products`]).
//!
//! Products use AVX2's `vpmaddubsw`, which multiplies unsigned by signed
//! bytes:
//! - Q8_0 quants are stored plus 128 (`model::quant_blocks`). With AVX-512
//!   VNNI, `vpdpbusd` multiplies them as they are, 4 byte pairs into each
//!   i32 lane with no 16-bit step, and 128 · sum(x) comes off per group.
//!   Without it, the top bit is flipped back and the sign trick makes the
//!   quants unsigned: |w| · (x · sign(w)) = w · x. A pair sum is at most
//!   2 · 127 · 127 = 32258 (2 · 128 · 127 = 32512 for a -128), inside i16.
//! - Q5_0 values are stored as v = w + 16 in 0..31, already unsigned: the
//!   products of v are taken as they are (pairs at most 2 · 31 · 128 =
//!   7936) and 16 · sum(x) is subtracted per group, from the sums the input
//!   carries ("block sums where a weight format needs them").
//!
//! `vpmaddwd` against ones widens the pairs to 8 lane sums in i32. Two
//! rounds of `vphaddd` fold the 4 rows' lane sums into one register, each
//! 128-bit half holding the 4 rows' partial sums; the halves are added in
//! integers, so each row's group sum is whole (and exact) before it is
//! converted to f32 and accumulated, times the rows' scales and x's, in
//! one FMA per group (against one convert, shuffle and FMA per row).
//! The integer GEMM for several tokens (`gemm_quant`) performs the same
//! f32 operations in the same order, so a token's result is bit-identical
//! whichever of the two computed it.
//!
//! K comes as an argument, a multiple of 32: it only sizes pointers, so an
//! immediate would buy nothing but a copy of the kernel per K (308 bytes
//! each for Q8_0, which the default model needs at 3 K's). r0 must be a
//! multiple of 4; the last block may be partial, its padding rows are
//! zeros and only valid rows are stored.
//!
//! Q5_0 and Q4_0 take their rows in pairs ([`unpack_pair`]): one vector
//! holds the first 16 values of both rows, another their last 16, each
//! multiplied by x's matching half broadcast to both halves, so a pair's
//! 8 lane sums are 4 of each row, folded by `vphaddd` like 4 rows' 8.
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, r9=K on entry,
//! then the W group pointer, r10=x scale pointer, r11=end of x quants,
//! rax=x quant index counting up to 0, rbx=K, rbp=bytes of W per row of a
//! block, r12=bytes from x's scales to its sums. ymm0 accumulator, xmm4
//! the 4 rows' scales times x's, ymm14 lane indices, ymm15 16-bit ones.
//! Q8_0: ymm5 x quants, ymm6..9 the rows' products, ymm10 and ymm11
//! temporaries, ymm12 bytes of 0x80. Pairs: ymm1 and ymm2 x's halves,
//! ymm3 and ymm5 the high bits' qword shifts (Q5_0), ymm6 and ymm7 the
//! pairs' products, ymm8..10 temporaries, ymm11 bytes of 0xF0, ymm12
//! bytes of 0x10 (Q5_0), ymm13 bytes of 0x0F.

use super::{
    Asm, broadcast_const, count_mask, finish, lane_index, new_asm, reg,
    restore_callee_saved_and_return, save_callee_saved, store_rows_and_next_block, vshufps,
};
use crate::jback;
use crate::model::quant_blocks::{BLOCK_ROWS, GROUP_COLS, PAYLOADS_AT, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemvQuantParams {
    pub q: QuantType,
    /// Bytes ahead of each group to prefetch (0: none). Unlike the 16-bit
    /// GEMV, which streams at the read bandwidth on the hardware
    /// prefetcher alone, these kernels spend more time per byte and the
    /// prefetcher falls behind; prefetching 8 KiB ahead let them read
    /// faster than the 16-bit GEMV on a Xeon.
    pub prefetch: usize,
    /// Q8_0's products with AVX-512 VNNI's `vpdpbusd` (its EVEX form on
    /// ymm registers): 3 instructions a row instead of 5.
    pub vnni: bool,
    /// Q5_0 and Q4_0: two row blocks (8 rows) per pass ([`emit_pairs`]),
    /// which the planner gives up first when the budget is short.
    pub two_blocks: bool,
}

pub const ROWS: usize = BLOCK_ROWS;
const TEMP: u8 = 10;
const CORRECTION: u8 = 11;
/// Bytes of 0x80 (Q8_0 without VNNI).
const SIGN_BITS: u8 = 12;
const IDX: u8 = 14;
const ONES: u8 = 15;

/// The registers of the pair kernels (Q5_0, Q4_0).
const X_FIRST: u8 = 1;
const X_LAST: u8 = 2;
/// The pair products of a block (ymm6, ymm7) and, two blocks at a time,
/// the second block's (ymm4, ymm14).
const PAIR_PRODUCTS: [u8; 4] = [6, 7, 4, 14];
const PAIR_REGS: PairRegs = PairRegs {
    last: 8,
    temp: 9,
    temp2: 10,
    low_nibbles: 13,
    high_nibbles: 11,
    bit4: 12,
    right_shifts: 3,
    left_shifts: 5,
};
/// The offset's correction in the pair kernels (a temporary by then).
const PAIR_CORRECTION: u8 = 8;

/// Whether a type's kernels take its rows in pairs ([`unpack_pair`]).
pub fn in_pairs(q: QuantType) -> bool {
    matches!(q, QuantType::Q5_0 | QuantType::Q4_0)
}

/// Offset of pair `pair`'s bytes (rows 2 * pair and 2 * pair + 1) inside
/// a group: Q5_0's high-bit word and nibbles, Q4_0's nibbles.
pub(super) fn pair_at(q: QuantType, pair: usize) -> i8 {
    (PAYLOADS_AT + pair * 2 * q.payload_bytes()) as i8
}

/// The registers [`unpack_pair`] uses besides its two destinations.
#[derive(Clone, Copy)]
pub(super) struct PairRegs {
    /// The vector of the pair's last 16 values of each row.
    pub last: u8,
    pub temp: u8,
    pub temp2: u8,
    /// Bytes of 0x0F.
    pub low_nibbles: u8,
    /// Bytes of 0xF0.
    pub high_nibbles: u8,
    /// Bytes of 0x10 (Q5_0 only).
    pub bit4: u8,
    /// Qword shifts [0, 1, 2, 3] and [4, 3, 2, 1] (Q5_0 only).
    pub right_shifts: u8,
    pub left_shifts: u8,
}

/// Sets the constants [`unpack_pair`] reads: the nibble masks, and for
/// Q5_0 bytes of 0x10 and the qword shifts, each widened from 4 bytes.
/// (Deriving [0, 1, 2, 3] from the lane indices with `vpsrlq ymm, ymm,
/// 33` went wrong: dynasm-rs 5.1 encodes that as the xmm form, zeroing
/// lanes 2 and 3, as it does `vbroadcastss ymm, [mem]`.) Clobbers rax.
pub(super) fn pair_constants(ops: &mut Asm, q: QuantType, r: PairRegs) {
    broadcast_const(ops, r.low_nibbles, 0x0F0F_0F0F);
    broadcast_const(ops, r.high_nibbles, 0xF0F0_F0F0);
    if q == QuantType::Q5_0 {
        broadcast_const(ops, r.bit4, 0x1010_1010);
        for (reg, counts) in [(r.right_shifts, 0x0302_0100), (r.left_shifts, 0x0102_0304)] {
            dynasm!(ops
                ; .arch x64
                ; mov eax, counts
                ; vmovd Rx(reg), eax
                ; vpmovzxbq Ry(reg), Rx(reg)
            );
        }
    }
}

/// A pair of Q5_0 or Q4_0 rows at `[r9 + at]` as unsigned bytes (Q5_0's
/// values plus 16, 0..31; Q4_0's plus 8, 0..15): ymm`first` = the first
/// 16 values of the first row, then of the second; ymm`r.last` = their
/// last 16 likewise. The unpacking for the integer GEMM (`unpack_quant`)
/// uses the same code.
///
/// Why pairs: one row at a time, the Q5_0 GEMV was bound by its
/// instructions (the same rate from L2 as from DRAM), at 8 instructions a
/// row to unpack. A pair takes 10 for both rows and its products 4
/// instead of 2 x 2, and the GEMV reads at the plain read's rate on one
/// thread (about 1.45x the one-row form's from DRAM).
pub(super) fn unpack_pair(
    ops: &mut Asm,
    q: QuantType,
    first: u8,
    (base, at): (u8, i8),
    r: PairRegs,
) {
    let nibbles_at = if q == QuantType::Q5_0 { at + 8 } else { at };
    dynasm!(ops
        ; .arch x64
        // Both rows' 16 nibble bytes in one load: the low nibbles are the
        // first 16 values of each, the high ones the last 16.
        ; vpand Ry(first), Ry(r.low_nibbles), [BYTE Rq(base) + nibbles_at]
        ; vpand Ry(r.last), Ry(r.high_nibbles), [BYTE Rq(base) + nibbles_at]
        ; vpsrlw Ry(r.last), Ry(r.last), 4
    );
    if q == QuantType::Q5_0 {
        dynasm!(ops
            ; .arch x64
            // The pair's 64 high bits in every qword lane, lane k shifted
            // so that each byte's bit lands on bit 4 (QuantType::Q5_0).
            ; vpbroadcastq Ry(r.temp), [BYTE Rq(base) + at]
            ; vpsllvq Ry(r.temp2), Ry(r.temp), Ry(r.left_shifts)
            ; vpsrlvq Ry(r.temp), Ry(r.temp), Ry(r.right_shifts)
            ; vpand Ry(r.temp), Ry(r.temp), Ry(r.bit4)
            ; vpand Ry(r.temp2), Ry(r.temp2), Ry(r.bit4)
            ; vpor Ry(first), Ry(first), Ry(r.temp)
            ; vpor Ry(r.last), Ry(r.last), Ry(r.temp2)
        );
    }
}

/// Pair `pair`'s products with x (its halves in ymm1 and ymm2) as 8 i32
/// lane sums in ymm`dst`: lanes 0..3 the first row's, 4..7 the second's.
/// Two bytes' products (at most 31 x 127 each) and two such pairs, from
/// the first and the last 16 values, add up within 16 bits.
fn pair_products(ops: &mut Asm, q: QuantType, dst: u8, (base, pair): (u8, usize)) {
    let r = PAIR_REGS;
    unpack_pair(ops, q, dst, (base, pair_at(q, pair)), r);
    dynasm!(ops
        ; .arch x64
        ; vpmaddubsw Ry(dst), Ry(dst), Ry(X_FIRST)
        ; vpmaddubsw Ry(r.last), Ry(r.last), Ry(X_LAST)
        ; vpaddw Ry(dst), Ry(dst), Ry(r.last)
        ; vpmaddwd Ry(dst), Ry(dst), Ry(ONES)
    );
}

/// Row `row`'s 32 products with x (in ymm5) as 8 i32 lane sums in
/// ymm`dst`, its payload at `[r9 + at]` (Q8_0).
fn row_products(ops: &mut Asm, p: &GemvQuantParams, dst: u8, at: i8) {
    match p.q {
        // The stored bytes are q + 128, unsigned: VNNI multiplies them as
        // they are (128 · sum(x) comes off per group); AVX2 flips them back
        // to q for the sign trick.
        QuantType::Q8_0 if p.vnni => {
            dynasm!(ops
                ; .arch x64
                ; vmovdqu Ry(TEMP), [BYTE r9 + at]
                ; vpxor Ry(dst), Ry(dst), Ry(dst)
            );
            vpdpbusd(ops, dst, TEMP, 5);
            return;
        }
        QuantType::Q8_0x16
        | QuantType::Q5_0x16
        | QuantType::Q4Kx16
        | QuantType::Q5Kx16
        | QuantType::Q6Kx16 => {
            unreachable!("emit refuses 16-row layouts")
        }
        QuantType::Q8_0 => dynasm!(ops
            ; .arch x64
            ; vpxor Ry(dst), Ry(SIGN_BITS), [BYTE r9 + at]
            ; vpsignb Ry(TEMP), ymm5, Ry(dst)
            ; vpabsb Ry(dst), Ry(dst)
            ; vpmaddubsw Ry(dst), Ry(dst), Ry(TEMP)
        ),
        QuantType::Q5_0 | QuantType::Q4_0 => unreachable!("in pairs: pair_products"),
    }
    dynasm!(ops ; .arch x64 ; vpmaddwd Ry(dst), Ry(dst), Ry(ONES));
}

/// rbx = K (from r9) and rbp = the bytes of W per row of a row block: r
/// is a multiple of 4, so r * (K / 32 * one file block) is its row block's
/// offset. Shared with the integer GEMM, which takes W, r0, r1 and K in
/// the same registers.
pub(super) fn block_stride(ops: &mut Asm, q: QuantType) {
    dynasm!(ops
        ; .arch x64
        ; mov rbx, r9
        ; mov rbp, r9
        ; shr rbp, 5
        ; imul rbp, rbp, q.file_block_bytes() as i32
    );
}

/// r12 = the bytes from a group's x scale to its x sum (past the K/32
/// scales), r11 = the end of x's quants (K in r9 and rbx, x in rsi).
fn x_pointers(ops: &mut Asm) {
    dynasm!(ops
        ; .arch x64
        ; mov r12, r9
        ; shr r12, 3
        ; lea r11, [rsi + rbx]
    );
}

/// r9 = the row block of row rcx (W in rdi, stride in rbp).
pub(super) fn block_pointer(ops: &mut Asm) {
    dynasm!(ops
        ; .arch x64
        ; mov r9, rcx
        ; imul r9, rbp
        ; add r9, rdi
    );
}

/// `vpdpbusd ymm dst, ymm unsigned, ymm signed`, EVEX.256.66.0F38.W0 50 /r
/// with registers 0..15 (R', V' and X set, no mask, no broadcast).
pub(super) fn vpdpbusd(ops: &mut Asm, dst: u8, unsigned: u8, signed: u8) {
    let not_r = u8::from(dst < 8);
    let not_b = u8::from(signed < 8);
    ops.push(0x62);
    ops.push(not_r << 7 | 1 << 6 | not_b << 5 | 1 << 4 | 0b10);
    ops.push((!unsigned & 0xF) << 3 | 1 << 2 | 0b01);
    ops.push(0b01 << 5 | 1 << 3);
    ops.push(0x50);
    ops.push(0xC0 | (dst & 7) << 3 | (signed & 7));
}

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1, k)`.
pub fn emit(p: &GemvQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let q = p.q;
    anyhow::ensure!(
        !q.rows_are_lanes(),
        "kernel {name}: {} has no GEMV (its GEMM, emit::gemm_q8_0x16, takes single tokens)",
        q.name()
    );
    if p.two_blocks {
        anyhow::ensure!(
            in_pairs(q),
            "kernel {name}: only Q5_0 and Q4_0 take two row blocks per pass"
        );
        return emit_pairs(p, name);
    }
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    lane_index(&mut ops, IDX);
    broadcast_const(&mut ops, ONES, 0x0001_0001);
    if in_pairs(q) {
        pair_constants(&mut ops, q, PAIR_REGS);
    } else if !p.vnni {
        broadcast_const(&mut ops, SIGN_BITS, 0x8080_8080);
    }
    block_stride(&mut ops, q);
    x_pointers(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; cmp rcx, r8
        ; jae =>done
    );
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block);
    block_pointer(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; mov r10, r11
        ; xor eax, eax
        ; sub rax, rbx
        ; vxorps ymm0, ymm0, ymm0
    );
    // x's scale goes where x's quants go next (Q8_0), or in a temporary
    // (pairs: ymm5 holds a constant).
    let x_scale = if in_pairs(q) { PAIR_REGS.temp } else { 5 };
    let group_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>group
        // The 4 rows' f16 scales times x's scale (lanes 0..3; the upper
        // lanes read the first payload and are never used).
        ; vcvtph2ps ymm4, [r9]
        ; vpbroadcastd Ry(x_scale), [r10]
        ; vmulps xmm4, xmm4, Rx(x_scale)
    );
    if in_pairs(q) {
        dynasm!(ops
            ; .arch x64
            ; vbroadcasti128 Ry(X_FIRST), [r11 + rax]
            ; vbroadcasti128 Ry(X_LAST), [r11 + rax + 16]
        );
    } else {
        dynasm!(ops ; .arch x64 ; vmovdqu ymm5, [r11 + rax]);
    }
    if p.prefetch > 0 {
        dynasm!(ops ; .arch x64 ; prefetcht0 [r9 + p.prefetch as i32]);
        // Groups over a line (Q8_0's 136 bytes, Q5_0's 88) get a second
        // line: one thread over a 262,144 x 640 Q8_0 matrix, 10.5-11.0
        // against 9.7-10.0 GB/s; an 8-token decode step 14.4-14.9 against
        // 14.9-16.7 ms (bench --m-curve, alternating).
        if q.group_bytes() > 64 {
            dynasm!(ops ; .arch x64 ; prefetcht0 [r9 + (p.prefetch + 64) as i32]);
        }
    }
    if in_pairs(q) {
        for (pair, &dst) in PAIR_PRODUCTS[..2].iter().enumerate() {
            pair_products(&mut ops, q, dst, (reg::R9, pair));
        }
        dynasm!(ops
            ; .arch x64
            // [r0 r0 r2 r2 | r1 r1 r3 r3], then [r0 r2 r0 r2 | r1 r3 r1
            // r3]: each row's 4 lane sums added in integers, so its group
            // sum is whole before it is scaled, as in the integer GEMM,
            // and a token's result does not depend on which kernel
            // computed it. Then [r0 r1 r2 r3].
            ; vphaddd ymm6, ymm6, ymm7
            ; vphaddd ymm6, ymm6, ymm6
            ; vextracti128 Rx(TEMP), ymm6, 1
            ; vpunpckldq xmm6, xmm6, Rx(TEMP)
        );
    } else {
        for row in 0..ROWS {
            let at = (PAYLOADS_AT + row * q.payload_bytes()) as i8;
            row_products(&mut ops, p, 6 + row as u8, at);
        }
        dynasm!(ops
            ; .arch x64
            // [r0 r0 r1 r1 | r0 r0 r1 r1], [r2 r2 r3 r3 | ...], then
            // [r0 r1 r2 r3 | r0 r1 r2 r3]: each half sums 4 of the 8 lanes.
            ; vphaddd ymm6, ymm6, ymm7
            ; vphaddd ymm8, ymm8, ymm9
            ; vphaddd ymm6, ymm6, ymm8
            // The halves added in integers: each row's group sum is whole
            // before it is scaled, as in the integer GEMM, so a token's
            // result does not depend on which kernel computed it.
            ; vextracti128 Rx(TEMP), ymm6, 1
            ; vpaddd xmm6, xmm6, Rx(TEMP)
        );
    }
    // The values' offset (128 for Q8_0 with VNNI, 16 for Q5_0, 8 for Q4_0)
    // times sum(x) off each
    // row.
    // AVX2's Q8_0 products are of q itself (the sign trick).
    let stored_bytes_multiplied = p.vnni || q != QuantType::Q8_0;
    if stored_bytes_multiplied {
        let shift = q.stored_offset_shift() as i8;
        let correction = if in_pairs(q) {
            PAIR_CORRECTION
        } else {
            CORRECTION
        };
        dynasm!(ops
            ; .arch x64
            ; vpbroadcastd Ry(correction), [r10 + r12]
            ; vpslld Rx(correction), Rx(correction), shift
            ; vpsubd xmm6, xmm6, Rx(correction)
        );
    }
    dynasm!(ops
        ; .arch x64
        ; vcvtdq2ps xmm6, xmm6
        ; vfmadd231ps xmm0, xmm6, xmm4
        ; add r9, q.group_bytes() as i32
        ; add r10, BYTE 4
        ; add rax, BYTE GROUP_COLS as i8
    );
    jback!(ops, jnz, group, group_top);
    // Only valid rows are stored.
    store_rows_and_next_block(&mut ops, IDX, block, block_top);
    dynasm!(ops ; .arch x64 ; =>done);
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}

/// The GEMV of the pair types (Q5_0, Q4_0): two row blocks at a time.
///
/// Why 8 rows: a group's products are 7 instructions a pair (10 more for
/// Q5_0's high bits), but one block's group also paid for x's loads, the
/// 4 rows' fold (2 `vphaddd`, an extract and an unpack), the offset's
/// correction, the scales, the loop and its own convert and FMA, about as
/// many again (the fold alone cost about a tenth of the Q4_0 GEMV's speed
/// from L2). Two blocks share x's loads, the correction and the loop, and
/// 3 `vphaddd` fold their 8 rows into one vector, which the scales, the
/// convert and the FMA then take whole.
///
/// The fold leaves the rows in the order [0 2 4 6 | 1 3 5 7] (pairs'
/// first rows low, second rows high), so the scales are shuffled into it
/// and the sums back out of it once per 8 rows, before the store. When
/// one block is left, the second block is the first read again and its
/// lanes are masked off at the store.
///
/// Registers: rdi=W, rsi=x, rdx=y, rcx=r, r8=r1, r9=K on entry, then the
/// first block's group pointer, r14 the second block's, r13 the bytes of 4
/// rows (from one block to the next), r10=x scale pointer, r11=end of x
/// quants, rax=x quant index counting up to 0, rbx=K, rbp=bytes of W per
/// row of a block, r12=bytes from x's scales to its sums. ymm0 the 8 rows'
/// accumulator, ymm1 and ymm2 x's halves, ymm3 and ymm5 Q5_0's qword
/// shifts, ymm6/ymm7 the first block's pair products, ymm4/ymm14 the
/// second's, ymm8..10 temporaries, ymm11..13 the nibble and bit masks,
/// ymm15 16-bit ones.
fn emit_pairs(p: &GemvQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let q = p.q;
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    broadcast_const(&mut ops, ONES, 0x0001_0001);
    pair_constants(&mut ops, q, PAIR_REGS);
    block_stride(&mut ops, q);
    x_pointers(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; lea r13, [rbp * 4]
        ; cmp rcx, r8
        ; jae =>done
    );
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block);
    block_pointer(&mut ops);
    dynasm!(ops
        ; .arch x64
        // The second block, or the first again when it is the last.
        ; lea r14, [r9 + r13]
        ; mov r15, r9
        ; lea r10, [rcx + ROWS as i32]
        ; cmp r10, r8
        ; cmovae r14, r9
        ; mov r10, r11
        ; xor eax, eax
        ; sub rax, rbx
        ; vxorps ymm0, ymm0, ymm0
    );
    let group_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>group
        ; vbroadcasti128 Ry(X_FIRST), [r11 + rax]
        ; vbroadcasti128 Ry(X_LAST), [r11 + rax + 16]
    );
    if p.prefetch > 0 {
        // One stream of prefetches through both blocks' bytes, which are
        // contiguous, at the rate the two pointers consume them.
        for line in 0..(2 * q.group_bytes()).div_ceil(64) {
            dynasm!(ops ; .arch x64 ; prefetcht0 [r15 + (p.prefetch + 64 * line) as i32]);
        }
        dynasm!(ops ; .arch x64 ; add r15, 2 * q.group_bytes() as i32);
    }
    for (dst, at) in [
        (PAIR_PRODUCTS[0], (reg::R9, 0)),
        (PAIR_PRODUCTS[1], (reg::R9, 1)),
        (PAIR_PRODUCTS[2], (reg::R14, 0)),
        (PAIR_PRODUCTS[3], (reg::R14, 1)),
    ] {
        pair_products(&mut ops, q, dst, at);
    }
    let [a0, a1, b0, b1] = PAIR_PRODUCTS;
    // `vshufps` selectors: lanes 0 and 2 of each source, then 1 and 3.
    const EVEN_LANES: u8 = 0x88;
    const ODD_LANES: u8 = 0xDD;
    let r = PAIR_REGS;
    dynasm!(ops
        ; .arch x64
        // [r0 r0 r2 r2 | r1 r1 r3 r3] and [r4 r4 r6 r6 | r5 r5 r7 r7],
        // then [r0 r2 r4 r6 | r1 r3 r5 r7]: each row's 4 lane sums added
        // in integers, so its group sum is whole before it is scaled, as
        // in the integer GEMM, and a token's result does not depend on
        // which kernel computed it.
        ; vphaddd Ry(a0), Ry(a0), Ry(a1)
        ; vphaddd Ry(b0), Ry(b0), Ry(b1)
        ; vphaddd Ry(a0), Ry(a0), Ry(b0)
        // The values' offset (16 for Q5_0, 8 for Q4_0) times sum(x) off
        // each row.
        ; vpbroadcastd Ry(r.temp), [r10 + r12]
        ; vpslld Ry(r.temp), Ry(r.temp), q.stored_offset_shift() as i8
        ; vpsubd Ry(a0), Ry(a0), Ry(r.temp)
        // The 8 rows' f16 scales in the same order, times x's scale.
        // Each block's 4 are lanes 0..3 of a convert (the upper lanes read
        // its first payload and are shuffled into upper halves that
        // `vinsertf128` replaces).
        ; vcvtph2ps Ry(b0), [r9]
        ; vcvtph2ps Ry(b1), [r14]
    );
    vshufps(&mut ops, a1, b0, b1, EVEN_LANES);
    vshufps(&mut ops, b0, b0, b1, ODD_LANES);
    dynasm!(ops
        ; .arch x64
        ; vinsertf128 Ry(a1), Ry(a1), Rx(b0), 1
        ; vpbroadcastd Ry(r.temp), [r10]
        ; vmulps Ry(a1), Ry(a1), Ry(r.temp)
        ; vcvtdq2ps Ry(a0), Ry(a0)
        ; vfmadd231ps ymm0, Ry(a0), Ry(a1)
        ; add r9, q.group_bytes() as i32
        ; add r14, q.group_bytes() as i32
        ; add r10, BYTE 4
        ; add rax, BYTE GROUP_COLS as i8
    );
    jback!(ops, jnz, group, group_top);
    dynasm!(ops
        ; .arch x64
        // [r0 r2 r4 r6 | r1 r3 r5 r7] back to [r0 .. r7].
        ; vextractf128 Rx(r.temp), ymm0, 1
        ; vunpckhps Rx(r.temp2), xmm0, Rx(r.temp)
        ; vunpcklps xmm0, xmm0, Rx(r.temp)
        ; vinsertf128 ymm0, ymm0, Rx(r.temp2), 1
        // Only the rows that exist are stored (r8 - rcx of them, 8 at
        // most).
        ; mov r10, r8
        ; sub r10, rcx
    );
    lane_index(&mut ops, r.temp);
    count_mask(&mut ops, 8, r.temp, reg::R10);
    dynasm!(ops
        ; .arch x64
        ; vmaskmovps [rdx + rcx * 4], ymm8, ymm0
        ; add rcx, BYTE 2 * ROWS as i8
        ; cmp rcx, r8
    );
    jback!(ops, jb, block, block_top);
    dynasm!(ops ; .arch x64 ; =>done);
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, Register};

    #[test]
    fn the_evex_dot_product_decodes_as_written() {
        for (dst, u, s) in [(4u8, 9u8, 8u8), (0, 15, 3), (12, 1, 14)] {
            let mut ops = new_asm();
            vpdpbusd(&mut ops, dst, u, s);
            let bytes = ops.finalize().expect("no labels");
            let mut d = Decoder::with_ip(64, &bytes, 0, DecoderOptions::NONE);
            let ins = d.decode();
            assert_eq!(ins.len(), bytes.len());
            assert_eq!(ins.mnemonic(), Mnemonic::Vpdpbusd);
            let ymm = |n: u8| Register::YMM0 as u32 + u32::from(n);
            assert_eq!(ins.op0_register() as u32, ymm(dst));
            assert_eq!(ins.op1_register() as u32, ymm(u));
            assert_eq!(ins.op2_register() as u32, ymm(s));
        }
    }
}
