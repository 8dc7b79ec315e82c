//! The integer GEMM of `gemm_quant` with AVX-512 VNNI: the same call, the
//! same weights (Q8_0's row blocks, values stored plus 128) and token
//! tiles, the same results bit for bit, with the lanes of a 512-bit vector
//! laid out as (row, token) pairs rather than tokens.
//!
//! Lane `4r + t` of a half holds row r and token t (tokens 0..3 in the
//! first half, 4..7 in the second): 128-bit lane r is row r. Per chunk c
//! of 4 columns:
//! - the weights' operand holds row r's 4 bytes of chunk c in each dword
//!   of 128-bit lane r. Two shuffles of 128-bit lanes (`vshufi64x2`) put
//!   each row's chunks 0..3 (then 4..7) in its lane, and one `vpshufd`
//!   per chunk repeats chunk c across the lane;
//! - the input's operand holds tokens 0..3's (or 4..7's) bytes of chunk c,
//!   which the tile keeps side by side: one 16-byte broadcast;
//! - one `vpdpbusd` then adds the 4 rows x 4 tokens' products of the chunk.
//!
//! Each lane ends a group with a whole group sum, so the scaling is one
//! conversion, one product of scales and one FMA per 16 (row, token)
//! pairs, and no horizontal sum is needed: the ymm form before it
//! broadcast each row's bytes to the token lanes and folded lane pairs per
//! row, 81 instructions per group against 60 here.
//!
//! Measured from L2, one thread, 128 x 640 weights (ns per 4 rows x 32
//! columns, alternating in one process): 8 tokens 5.0 against 6.1; 4
//! tokens 3.1 against 6.0 (a step of at most 4 tokens skips the second
//! half). A layout of 16 rows interleaved by 4 bytes, with the input
//! broadcast from memory as a dword, measured 3.3 ns for 8 tokens, but it
//! would change how every Q8_0 matrix is stored.
//!
//! Registers: zmm0/zmm1 the halves' f32 sums; zmm2/zmm3 the first half's
//! group sums (even and odd chunks: two chains), zmm4/zmm5 the second's;
//! zmm6/zmm7 rows 0..1 and 2..3 of a group; zmm8..11 the weights' operands
//! of 4 chunks; zmm12 the input's operand; zmm13 a row's chunks, then the
//! rows' scales; zmm14 the lane order for the stores; zmm15 the lane index
//! that spreads the 4 row scales over their 128-bit lanes. General
//! registers as in `gemm_quant` (`token_call_frame`).

use super::gemm_quant::{
    GemmQuantParams, TILE_GROUP_BYTES, TILE_SCALES_AT, TILE_SUMS_AT, iced, prefetch_group,
    store_red_zone_tokens, token_call_frame,
};
use super::gemv_quant::block_pointer;
use super::{Asm, new_asm, next_block_and_return, save_callee_saved};
use crate::jback;
use crate::model::quant_blocks::{GROUP_COLS, PAYLOADS_AT, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::code_asm::*;

/// Tokens per half: the 4 dwords of a 128-bit lane.
const HALF_TOKENS: usize = 4;
/// Chunks of 4 columns whose operands are built at once.
const QUAD: usize = 4;

const F32_SUMS: [AsmRegisterZmm; 2] = [zmm0, zmm1];
/// Group sums per half, even chunks then odd chunks.
const GROUP_SUMS: [[AsmRegisterZmm; 2]; 2] = [[zmm2, zmm3], [zmm4, zmm5]];
const ROWS_01: AsmRegisterZmm = zmm6;
const ROWS_23: AsmRegisterZmm = zmm7;
const WEIGHTS: [AsmRegisterZmm; QUAD] = [zmm8, zmm9, zmm10, zmm11];
const INPUT: AsmRegisterZmm = zmm12;
const QUAD_OR_SCALES: AsmRegisterZmm = zmm13;
const STORE_ORDER: AsmRegisterZmm = zmm14;
const SCALE_LANES: AsmRegisterZmm = zmm15;

/// `vshufi64x2` selectors: 128-bit lanes 0 and 2 of rows 0..1, then of
/// rows 2..3 (each row's chunks 0..3), or lanes 1 and 3 (chunks 4..7).
const QUAD_SELECT: [u32; 2] = [0b10_00_10_00, 0b11_01_11_01];

/// The lanes of both constant index vectors: zmm15 takes lane i from
/// lane i / 4 (row i / 4's scale over its 128-bit lane), zmm14 from lane
/// 4 * (i % 4) + i / 4 (token-major order: each token's 4 rows side by
/// side).
fn lane_constants(a: &mut CodeAssembler) -> Result<(), iced_x86::IcedError> {
    let bytes = |f: &dyn Fn(u64) -> u64| -> (u64, u64) {
        let lo = (0..8).fold(0u64, |acc, i| acc | f(i) << (8 * i));
        let hi = (8..16).fold(0u64, |acc, i| acc | f(i) << (8 * (i - 8)));
        (lo, hi)
    };
    for (reg, xmm, (lo, hi)) in [
        (SCALE_LANES, xmm15, bytes(&|i| i / 4)),
        (STORE_ORDER, xmm14, bytes(&|i| 4 * (i % 4) + i / 4)),
    ] {
        a.mov(rax, lo)?;
        a.vmovq(xmm, rax)?;
        a.mov(rax, hi)?;
        a.vpinsrq(xmm, xmm, rax, 1)?;
        a.vpmovzxbd(reg, xmm)?;
    }
    Ok(())
}

/// One quad of chunks (0..3 or 4..7) of the group at r9 against the tile
/// group at r10: the weights' operands, then the first half's products;
/// the second half's unless the call has at most 4 tokens (r13).
fn quad_products(ops: &mut Asm, quad: usize) {
    let chunk_at = |j: usize| (QUAD * quad + j) as i32 * 32;
    iced(ops, |a| {
        a.vshufi64x2(QUAD_OR_SCALES, ROWS_01, ROWS_23, QUAD_SELECT[quad])?;
        for (j, &w) in WEIGHTS.iter().enumerate() {
            a.vpshufd(w, QUAD_OR_SCALES, 0x55 * j as u32)?;
        }
        Ok(())
    });
    let skip = ops.new_dynamic_label();
    for (half, sums) in GROUP_SUMS.iter().enumerate() {
        if half == 1 {
            dynasm!(ops
                ; .arch x64
                ; cmp r13, HALF_TOKENS as i32
                ; jbe =>skip
            );
        }
        iced(ops, |a| {
            for (j, &w) in WEIGHTS.iter().enumerate() {
                let at = chunk_at(j) + (HALF_TOKENS * 4 * half) as i32;
                a.vbroadcasti32x4(INPUT, xmmword_ptr(r10 + at))?;
                a.vpdpbusd(sums[j % 2], w, INPUT)?;
            }
            Ok(())
        });
    }
    dynasm!(ops ; .arch x64 ; =>skip);
}

/// The group's sums of a half, less the offset, scaled and added into its
/// f32 sums: `f += float(sum - (sum_x << 7)) * (d_x * d_w)`, the GEMV's
/// order of operations. zmm13 holds the row scales over their lanes.
fn scale_half(ops: &mut Asm, half: usize) {
    let [even, odd] = GROUP_SUMS[half];
    let tokens_at = (HALF_TOKENS * 4 * half) as i32;
    let shift = QuantType::Q8_0.stored_offset_shift() as u32;
    iced(ops, |a| {
        a.vpaddd(even, even, odd)?;
        a.vbroadcasti32x4(INPUT, xmmword_ptr(r10 + TILE_SUMS_AT as i32 + tokens_at))?;
        a.vpslld(INPUT, INPUT, shift)?;
        a.vpsubd(even, even, INPUT)?;
        a.vcvtdq2ps(even, even)?;
        a.vbroadcastf32x4(INPUT, xmmword_ptr(r10 + TILE_SCALES_AT as i32 + tokens_at))?;
        a.vmulps(INPUT, INPUT, QUAD_OR_SCALES)?;
        a.vfmadd231ps(F32_SUMS[half], even, INPUT)
    });
}

/// Emits the kernel `extern "sysv64" fn(w, x_tile, y, r0, r1, k, ldy,
/// ntok)` (see `gemm_quant`).
pub fn emit(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    iced(&mut ops, lane_constants);
    token_call_frame(&mut ops, TILE_GROUP_BYTES, done);
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block);
    block_pointer(&mut ops);
    dynasm!(ops ; .arch x64 ; mov r10, rsi);
    iced(&mut ops, |a| {
        for f in F32_SUMS {
            a.vpxord(f, f, f)?;
        }
        Ok(())
    });
    let group_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    prefetch_group(&mut ops, p.prefetch);
    let row_bytes = GROUP_COLS as i32;
    iced(&mut ops, |a| {
        a.vmovdqu32(ROWS_01, zmmword_ptr(r9 + PAYLOADS_AT as i32))?;
        a.vmovdqu32(
            ROWS_23,
            zmmword_ptr(r9 + PAYLOADS_AT as i32 + 2 * row_bytes),
        )?;
        for s in GROUP_SUMS.iter().flatten() {
            a.vpxord(*s, *s, *s)?;
        }
        Ok(())
    });
    for quad in 0..2 {
        quad_products(&mut ops, quad);
    }
    // The 4 rows' scales, row r's over 128-bit lane r.
    iced(&mut ops, |a| {
        a.vmovq(xmm13, qword_ptr(r9))?;
        a.vcvtph2ps(ymm13, xmm13)?;
        a.vpermps(QUAD_OR_SCALES, SCALE_LANES, QUAD_OR_SCALES)
    });
    scale_half(&mut ops, 0);
    let one_half = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; cmp r13, HALF_TOKENS as i32
        ; jbe =>one_half
    );
    scale_half(&mut ops, 1);
    dynasm!(ops
        ; .arch x64
        ; =>one_half
        ; add r9, QuantType::Q8_0.group_bytes() as i32
        ; add r10, TILE_GROUP_BYTES as i32
        ; cmp r10, r11
    );
    jback!(ops, jb, group, group_top);
    // Each token's 4 rows side by side into the red zone, tokens in order.
    iced(&mut ops, |a| {
        for (half, f) in F32_SUMS.into_iter().enumerate() {
            a.vpermps(f, STORE_ORDER, f)?;
            a.vmovups(zmmword_ptr(rsp - 128 + 64 * half as i32), f)?;
        }
        Ok(())
    });
    store_red_zone_tokens(&mut ops, -128);
    next_block_and_return(ops, super::gemm_quant::ROWS, (block, block_top), done, name)
}
