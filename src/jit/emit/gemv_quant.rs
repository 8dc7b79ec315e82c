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
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r (from r0), r8=r1, r9=K on entry,
//! then the W group pointer, r10=x scale pointer, r11=end of x quants,
//! rax=x quant index counting up to 0, rbx=K, rbp=bytes of W per row of a
//! block, r12=bytes from x's scales to its sums. ymm0 accumulator, ymm1 the
//! nibbles' dword shifts (Q5_0, Q4_0), xmm4 the 4 rows' scales times x's,
//! ymm5 x quants, ymm6..9 the rows' products, ymm10 and
//! ymm11 temporaries, ymm12 bytes of 1 and ymm13 bytes of 15 (Q5_0), ymm14
//! lane indices, ymm15 16-bit ones.

use super::{
    Asm, broadcast_const, finish, lane_index, new_asm, restore_callee_saved_and_return,
    save_callee_saved, store_rows_and_next_block,
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
    /// prefetcher falls behind: 256 MiB on 2 threads of a Xeon read at
    /// 13.0-13.2 GB/s (Q8_0) and 8.1-10.0 (Q5_0) without, 18.4-20.0 and
    /// 17.4-17.9 with 8 KiB, against 15.5-16.7 for the 16-bit GEMV
    /// (`pulsar tune --measure`); 4 KiB gained less, 16 KiB no more.
    pub prefetch: usize,
    /// Q8_0's products with AVX-512 VNNI's `vpdpbusd` (its EVEX form on
    /// ymm registers): 3 instructions a row instead of 5.
    pub vnni: bool,
}

pub const ROWS: usize = BLOCK_ROWS;
/// Dword shifts for the nibbles (Q5_0, Q4_0).
const NIBBLE_SHIFTS: u8 = 1;
const TEMP: u8 = 10;
const CORRECTION: u8 = 11;
const BYTE_ONES: u8 = 12;
/// Bytes of 0x80 (Q8_0 without VNNI), in the register Q5_0's ones use.
const SIGN_BITS: u8 = 12;
const LOW_NIBBLES: u8 = 13;
const IDX: u8 = 14;
const ONES: u8 = 15;

/// The registers [`unpack_values`] uses besides its destination.
#[derive(Clone, Copy)]
pub(super) struct UnpackRegs {
    pub temp: u8,
    /// Bytes of 0x0F.
    pub low_nibbles: u8,
    /// Bytes of 1 (Q5_0 only).
    pub byte_ones: u8,
    /// Lane indices 0..7 (Q5_0 only).
    pub idx: u8,
    /// Dword shifts 0 (lanes 0..3) and 4 (lanes 4..7): see
    /// [`nibble_shifts`].
    pub nibble_shifts: u8,
}

/// Sets ymm`dst` to the dword shifts `[0, 0, 0, 0, 4, 4, 4, 4]` from the
/// lane indices in ymm`idx`: shifting a payload's 16 nibble bytes,
/// broadcast to both halves, by them puts the low nibbles' values in the
/// low half and the high nibbles' in the high one in a single instruction.
pub(super) fn nibble_shifts(ops: &mut Asm, dst: u8, idx: u8) {
    dynasm!(ops
        ; .arch x64
        ; vpsrld Ry(dst), Ry(idx), 2
        ; vpslld Ry(dst), Ry(dst), 2
    );
}

/// A Q5_0 or Q4_0 payload at `[r9 + at]` as 32 unsigned bytes in
/// ymm`dst`: Q5_0's values plus 16 (0..31), Q4_0's plus 8 (0..15). The
/// unpacking for the integer GEMM (`unpack_quant`) uses the same code.
///
/// The Q5_0 GEMV is bound by its instructions, not by memory: it reads
/// at the same rate from L2 as from DRAM. Broadcasting the nibbles and
/// the high bits straight from memory (8 instructions a row instead of 10)
/// took it from 9.9-10.2 to 11.5-11.6 GB/s from L2 (`PULSAR_MEASURE_KIB=256
/// pulsar tune --measure`, AMD EPYC with AVX2, alternating), and a
/// one-thread decode of the default model from 45.62 to 47.80 tok/s
/// (medians of 3, `bench --threads 1`).
pub(super) fn unpack_values(ops: &mut Asm, q: QuantType, dst: u8, at: i8, r: UnpackRegs) {
    let nibbles_at = if q == QuantType::Q5_0 { at + 4 } else { at };
    dynasm!(ops
        ; .arch x64
        // Low nibbles: bytes 0..15 of the vector from the low halves of
        // the 16 bytes, bytes 16..31 from their high halves: the 16 bytes
        // in both halves, the high half shifted by 4 (3 instructions where
        // a load, a shift and an insert across halves took 4).
        ; vbroadcasti128 Ry(dst), [BYTE r9 + nibbles_at]
        ; vpsrlvd Ry(dst), Ry(dst), Ry(r.nibble_shifts)
        ; vpand Ry(dst), Ry(dst), Ry(r.low_nibbles)
    );
    if q == QuantType::Q5_0 {
        dynasm!(ops
            ; .arch x64
            // High bits: lane i shifted right by i puts value j's bit at
            // bit 0 of byte j (see QuantType::Q5_0), then to bit 4.
            ; vpbroadcastd Ry(r.temp), [BYTE r9 + at]
            ; vpsrlvd Ry(r.temp), Ry(r.temp), Ry(r.idx)
            ; vpand Ry(r.temp), Ry(r.temp), Ry(r.byte_ones)
            ; vpsllw Ry(r.temp), Ry(r.temp), 4
            ; vpor Ry(dst), Ry(dst), Ry(r.temp)
        );
    }
}

/// Row `row`'s 32 products with x (in ymm5) as 8 i32 lane sums in
/// ymm`dst`, its payload at `[r9 + at]`.
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
        QuantType::Q8_0x16 => unreachable!("emit refuses Q8_0x16"),
        QuantType::Q8_0 => dynasm!(ops
            ; .arch x64
            ; vpxor Ry(dst), Ry(SIGN_BITS), [BYTE r9 + at]
            ; vpsignb Ry(TEMP), ymm5, Ry(dst)
            ; vpabsb Ry(dst), Ry(dst)
            ; vpmaddubsw Ry(dst), Ry(dst), Ry(TEMP)
        ),
        // Q5_0's values are stored plus 16 and Q4_0's plus 8, already
        // unsigned: the offset is taken off per group with x's sum.
        QuantType::Q5_0 | QuantType::Q4_0 => {
            let regs = UnpackRegs {
                temp: TEMP,
                low_nibbles: LOW_NIBBLES,
                byte_ones: BYTE_ONES,
                idx: IDX,
                nibble_shifts: NIBBLE_SHIFTS,
            };
            unpack_values(ops, p.q, dst, at, regs);
            dynasm!(ops ; .arch x64 ; vpmaddubsw Ry(dst), Ry(dst), ymm5);
        }
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
        q != QuantType::Q8_0x16,
        "kernel {name}: Q8_0x16 has no GEMV (its GEMM, emit::gemm_q8_0x16, takes single tokens)"
    );
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    lane_index(&mut ops, IDX);
    broadcast_const(&mut ops, ONES, 0x0001_0001);
    match q {
        QuantType::Q5_0 => broadcast_const(&mut ops, BYTE_ONES, 0x0101_0101),
        QuantType::Q8_0 if !p.vnni => broadcast_const(&mut ops, SIGN_BITS, 0x8080_8080),
        _ => {}
    }
    if q != QuantType::Q8_0 {
        broadcast_const(&mut ops, LOW_NIBBLES, 0x0F0F_0F0F);
        nibble_shifts(&mut ops, NIBBLE_SHIFTS, IDX);
    }
    block_stride(&mut ops, q);
    dynasm!(ops
        ; .arch x64
        // r12: from a group's x scale to its x sum, past the K/32 scales.
        ; mov r12, r9
        ; shr r12, 3
        ; lea r11, [rsi + rbx]
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
    let group_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>group
        // The 4 rows' f16 scales times x's scale (lanes 0..3; the upper
        // lanes read the first payload and are never used).
        ; vcvtph2ps ymm4, [r9]
        ; vpbroadcastd ymm5, [r10]
        ; vmulps xmm4, xmm4, xmm5
        ; vmovdqu ymm5, [r11 + rax]
    );
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
    // The values' offset (128 for Q8_0 with VNNI, 16 for Q5_0, 8 for Q4_0)
    // times sum(x) off each
    // row.
    // AVX2's Q8_0 products are of q itself (the sign trick).
    let stored_bytes_multiplied = p.vnni || q != QuantType::Q8_0;
    if stored_bytes_multiplied {
        let shift = q.stored_offset_shift() as i8;
        dynasm!(ops
            ; .arch x64
            ; vpbroadcastd Ry(CORRECTION), [r10 + r12]
            ; vpslld Rx(CORRECTION), Rx(CORRECTION), shift
            ; vpsubd xmm6, xmm6, Rx(CORRECTION)
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
