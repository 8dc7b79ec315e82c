//! The K-quant GEMM under AVX2 (`gemm_kquant`'s call, layouts and
//! arithmetic, bit for bit): 8 rows per ymm register, `vpmaddubsw` +
//! `vpmaddwd` for the products.
//!
//! A pass runs over the whole row block and fills up to 4 "lanes", each a
//! (token, half block) pair whose f32 sums one register holds:
//! - several tokens (2 to 8 in the call): passes of 4 tokens over one half
//!   (rows 0..7, then 8..15), so each 32-byte load of weights is unpacked
//!   once for 4 tokens (a pass of one token re-unpacked it per token);
//! - one token (a decode step, or the odd last one): a pass of that token
//!   over both halves, each line of the block read once, the token's
//!   bytes broadcast once per chunk for both halves.
//!
//! The two forms share the super-block and unit loop, the prefetches and
//! the stores; each unit (Q4_K: a pair of groups, Q6_K: a group) picks
//! its form's body by the pass's token count.
//!
//! Integer sums: Q4_K's quants (0..15) and the input's bytes (-127..127)
//! make 16-bit pair sums that add up over a group's 8 chunks (8 x 2 x 15 x
//! 127 < 2^15), widened once per group. Q6_K's (0..63) allow two chunks
//! in 16 bits (2 x 2 x 63 x 127 < 2^15): each run pair is widened into
//! 32-bit sums that start from the tile's `-32 · Σx`. Q5_K's (0..31) are
//! widened every chunk, its fifth bits shifted into place with 16-bit
//! shifts (`q5_k_pair`).
//!
//! Q6_K's top bits: chunk 2j's and 2j + 1's 2-bit fields sit at bits
//! 4j..4j + 3 of the high-bit run; shifted left by 4 - 4j they are at bits
//! 4..7, so chunk 2j's is there masked by 0x30 and chunk 2j + 1's after a
//! shift right by 2 (16-bit shifts; the masks keep what stays in its
//! byte). The shift count comes from a table in the red zone, indexed by
//! the loop over run pairs.
//!
//! Registers: ymm0..3 the lanes' integer sums of a unit's first group (or
//! first 16 columns), ymm4..7 of the second, ymm8..11 the lanes' f32 sums,
//! ymm12..15 the unpacking and scaling; a one-token pass (2 lanes) keeps
//! its broadcast bytes in ymm2/3 and ymm6/7. Constants (0x0F, 16-bit
//! ones, Q6_K's 0x30 and shift counts) live in the red zone below rsp (the
//! kernel calls nothing), read as memory operands. General registers:
//! `gemm_quant`'s frame (ntok and ldy then read from the stack); rax the
//! pass's first token, rbx 4 x the pass's half (0 in a one-token pass),
//! r15 the block's weights, r14 its outputs, r9 the unit, r10 the tile
//! group, r12 the super-block's scales, rdx the units left in it, rdi the
//! chunk loop, rbp the half's runs, r13 scratch.

use super::gemm_kquant::{geometry, next_unit, prefetch_unit};
use super::gemm_quant::{
    GemmQuantParams, LDY_AT, NTOK_AT, TILE_GROUP_BYTES, TILE_HALF_STARTS_AT, TILE_SCALED_SUMS_AT,
    TILE_SCALES_AT, TOKENS, iced, token_call_frame,
};
use super::{Asm, count_mask, finish, new_asm, reg, restore_callee_saved_and_return};
use super::{cmp_imm8, save_callee_saved};
use crate::jback;
use crate::model::k_quant_x16::{
    Q4K_DMIN_AT, Q4K_MINS_AT, Q4K_RUNS_AT, Q5K_HIGH_AT, Q5K_RUNS_AT, Q6K_HIGH_AT, Q6K_NIBBLES_AT,
    RUN_BYTES,
};
use crate::model::quant_blocks::{CHUNK_BYTES, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

/// Rows per block, two halves of 8.
const ROWS: usize = 16;
const HALF_ROWS: i32 = 8;
const TGB: i32 = TILE_GROUP_BYTES as i32;
/// A token's 4 bytes of one chunk are 32 bytes apart in the tile.
const TILE_CHUNK: i32 = (CHUNK_BYTES * TOKENS) as i32;
/// A half's share of a 64-byte run.
const HALF_RUN: i32 = (RUN_BYTES / 2) as i32;

/// Red-zone slots (below rsp) of the constants.
const LOW_NIBBLES_AT: i32 = -32;
const TOP_BITS_AT: i32 = -64;
const ONES_AT: i32 = -96;
/// Q6_K: the shift counts of run pairs 0 and 1 (4 and 0), 16 bytes each.
const COUNTS_AT: i32 = -128;

/// A lane: (token from the pass's first, half from the pass's half).
type Lanes = &'static [(usize, usize)];
/// The pass of several tokens: 4 tokens over one half.
const FOUR_TOKENS: Lanes = &[(0, 0), (1, 0), (2, 0), (3, 0)];
/// The pass of one token: Q4_K's and Q5_K's over both halves, each line of the block
/// read once and the token's bytes broadcast once per chunk for both;
/// Q6_K's over one half as the other form (its code over both halves did
/// not run faster and is larger).
fn one_token_lanes(q: QuantType) -> Lanes {
    if q.has_k_mins() {
        &[(0, 0), (0, 1)]
    } else {
        &[(0, 0)]
    }
}

const YMM: [AsmRegisterYmm; 16] = [
    ymm0, ymm1, ymm2, ymm3, ymm4, ymm5, ymm6, ymm7, ymm8, ymm9, ymm10, ymm11, ymm12, ymm13, ymm14,
    ymm15,
];
const C0: AsmRegisterYmm = ymm12;
const C1: AsmRegisterYmm = ymm13;
const X: AsmRegisterYmm = ymm14;
const W: AsmRegisterYmm = ymm15;

/// Lane `s`'s integer sums of the unit's group (or 16 columns) `g`.
fn acc(g: usize, s: usize) -> AsmRegisterYmm {
    YMM[4 * g + s]
}

/// Lane `s`'s f32 sums.
fn f32_sum(s: usize) -> AsmRegisterYmm {
    YMM[8 + s]
}

/// A one-token pass's broadcast bytes of a chunk of group `g`: registers
/// its 2 lanes leave free.
fn hoisted(g: usize) -> AsmRegisterYmm {
    YMM[2 + g]
}

/// Whether a pass has one token over both halves, whose broadcasts are
/// made once for both.
fn hoists(lanes: Lanes) -> bool {
    lanes.len() > 1 && lanes.iter().all(|&(t, _)| t == 0)
}

/// The halves the lanes cover, each once, and the lanes of each.
fn halves(lanes: Lanes) -> Vec<(usize, Vec<(usize, usize)>)> {
    let mut out: Vec<(usize, Vec<(usize, usize)>)> = Vec::new();
    for (s, &(t, h)) in lanes.iter().enumerate() {
        match out.iter_mut().find(|(half, _)| *half == h) {
            Some((_, of)) => of.push((s, t)),
            None => out.push((h, vec![(s, t)])),
        }
    }
    out
}

/// A pair's tile group `g`: r10, or r13 for the second.
fn tile_group(g: usize) -> AsmRegister64 {
    if g == 0 { r10 } else { r13 }
}

fn red_zone(at: i32) -> AsmMemoryOperand {
    ymmword_ptr(rsp + at)
}

/// Q4_K, one pair of groups (r9) for `lanes`: a loop over the 8 nibble
/// runs (rdi 32 per run, the tile's chunk offset), the 16-bit sums, then
/// the scaling.
fn q4_k_pair(ops: &mut Asm, lanes: Lanes) {
    let chunk = ops.new_dynamic_label();
    let hoist = hoists(lanes);
    iced(ops, |a| {
        for s in 0..lanes.len() {
            for g in 0..2 {
                a.vpxor(acc(g, s), acc(g, s), acc(g, s))?;
            }
        }
        a.lea(rbp, ptr(r9 + rbx * 8 + Q4K_RUNS_AT as i32))?;
        // The second group's tile bytes from r13: 1-byte displacements.
        a.lea(r13, ptr(r10 + TGB))?;
        a.xor(edi, edi)
    });
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>chunk);
    iced(ops, |a| {
        broadcast_hoisted(a, hoist)?;
        for (h, of) in halves(lanes) {
            // The chunk of both groups: low nibbles the pair's first.
            a.vmovdqu(C1, ymmword_ptr(rbp + rdi * 2 + HALF_RUN * h as i32))?;
            a.vpand(C0, C1, red_zone(LOW_NIBBLES_AT))?;
            a.vpsrlw(C1, C1, 4)?;
            a.vpand(C1, C1, red_zone(LOW_NIBBLES_AT))?;
            pair_products(a, hoist, &of, false)?;
        }
        a.add(edi, TILE_CHUNK)?;
        a.cmp(edi, 8 * TILE_CHUNK)
    });
    jback!(ops, jb, chunk, top);
    scale_pair(ops, lanes, true);
}

/// A chunk's inputs broadcast once for every lane, where the pass's lanes
/// share one token (`hoists`).
fn broadcast_hoisted(a: &mut CodeAssembler, hoist: bool) -> Result<(), IcedError> {
    if hoist {
        for g in 0..2 {
            a.vpbroadcastd(hoisted(g), dword_ptr(tile_group(g) + rdi))?;
        }
    }
    Ok(())
}

/// The chunk's quants of both groups (C0, C1) times each lane's token
/// bytes, into the lanes' sums: 16-bit pair sums (Q4_K's), or with
/// `widen` widened to 32 bits every chunk (Q5_K's, whose 8 chunks would
/// overflow 16 bits).
fn pair_products(
    a: &mut CodeAssembler,
    hoist: bool,
    lanes_of_half: &[(usize, usize)],
    widen: bool,
) -> Result<(), IcedError> {
    for &(s, t) in lanes_of_half {
        for (g, quants) in [(0, C0), (1, C1)] {
            if hoist {
                a.vpmaddubsw(X, quants, hoisted(g))?;
            } else {
                let x = 4 * t as i32;
                a.vpbroadcastd(X, dword_ptr(tile_group(g) + rdi + x))?;
                a.vpmaddubsw(X, quants, X)?;
            }
            if widen {
                a.vpmaddwd(X, X, red_zone(ONES_AT))?;
                a.vpaddd(acc(g, s), acc(g, s), X)?;
            } else {
                a.vpaddw(acc(g, s), acc(g, s), X)?;
            }
        }
    }
    Ok(())
}

/// Q5_K: the fifth bits of a half's current run (`model::k_quant_x16`),
/// shifted right by one a chunk: registers no lane of the pass uses (W,
/// and the third lane's f32 sums, in a one-token pass of 2 lanes).
fn q5_k_high(h: usize) -> AsmRegisterYmm {
    if h == 0 { W } else { f32_sum(2) }
}

/// Q5_K, one pair of groups (r9) for `lanes`: a loop over the 8 nibble
/// runs (rdi 32 per run, the tile's chunk offset), each chunk's fifth bits
/// ORed on at bit 4 (after i 16-bit shifts right chunk 4h + i's sit at
/// bit 0 of each byte for the first group, at bit 4 for the second), the
/// second run loaded at chunk 4; the 16-bit pair sums (2 x 31 x 127 at
/// most) widened every chunk, 8 of them overflowing 16 bits; then the
/// scaling, as Q4_K's.
fn q5_k_pair(ops: &mut Asm, lanes: Lanes) {
    let chunk = ops.new_dynamic_label();
    let same_run = ops.new_dynamic_label();
    let hoist = hoists(lanes);
    iced(ops, |a| {
        for s in 0..lanes.len() {
            for g in 0..2 {
                a.vpxor(acc(g, s), acc(g, s), acc(g, s))?;
            }
        }
        for (h, _) in halves(lanes) {
            let at = Q5K_HIGH_AT as i32 + HALF_RUN * h as i32;
            a.vmovdqu(q5_k_high(h), ymmword_ptr(r9 + rbx * 8 + at))?;
        }
        a.lea(rbp, ptr(r9 + rbx * 8 + Q5K_RUNS_AT as i32))?;
        a.lea(r13, ptr(r10 + TGB))?;
        a.xor(edi, edi)
    });
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>chunk);
    iced(ops, |a| a.cmp(edi, 4 * TILE_CHUNK));
    dynasm!(ops ; .arch x64 ; jne BYTE =>same_run);
    iced(ops, |a| {
        for (h, _) in halves(lanes) {
            let at = (Q5K_HIGH_AT + RUN_BYTES) as i32 + HALF_RUN * h as i32;
            a.vmovdqu(q5_k_high(h), ymmword_ptr(r9 + rbx * 8 + at))?;
        }
        Ok(())
    });
    dynasm!(ops ; .arch x64 ; =>same_run);
    iced(ops, |a| {
        broadcast_hoisted(a, hoist)?;
        for (h, of) in halves(lanes) {
            let high = q5_k_high(h);
            a.vmovdqu(C1, ymmword_ptr(rbp + rdi * 2 + HALF_RUN * h as i32))?;
            a.vpand(C0, C1, red_zone(LOW_NIBBLES_AT))?;
            a.vpsrlw(C1, C1, 4)?;
            a.vpand(C1, C1, red_zone(LOW_NIBBLES_AT))?;
            a.vpsllw(X, high, 4)?;
            a.vpand(X, X, red_zone(TOP_BITS_AT))?;
            a.vpor(C0, C0, X)?;
            a.vpand(X, high, red_zone(TOP_BITS_AT))?;
            a.vpor(C1, C1, X)?;
            a.vpsrlw(high, high, 1)?;
            pair_products(a, hoist, &of, true)?;
        }
        a.add(edi, TILE_CHUNK)?;
        a.cmp(edi, 8 * TILE_CHUNK)
    });
    jback!(ops, jb, chunk, top);
    scale_pair(ops, lanes, false);
}

/// The scaling of a pair's two groups, one copy of the code run twice: the
/// second group's sums moved into the first's registers, r9 and r10
/// stepped to its scales and its tile group (back after the pair). Per
/// lane `f += float(Σqx) · ((d·sc) · d_x)`, then `f -= (dmin·m) · (d_x ·
/// Σx)`. `widen`: the sums are 16-bit pair sums (Q4_K's), not 32-bit.
fn scale_pair(ops: &mut Asm, lanes: Lanes, widen: bool) {
    let group = ops.new_dynamic_label();
    iced(ops, |a| a.mov(edi, 2));
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    iced(ops, |a| {
        let (scales, mins, x) = (C0, C1, X);
        // The tile group's scales and sums from r13: 1-byte displacements.
        a.lea(r13, ptr(r10 + TILE_SCALES_AT as i32))?;
        let sums_at = (TILE_SCALED_SUMS_AT - TILE_SCALES_AT) as i32;
        for (h, of) in halves(lanes) {
            let (h8, h16) = (HALF_ROWS * h as i32, 2 * HALF_ROWS * h as i32);
            a.vpmovzxbd(scales, qword_ptr(r9 + rbx * 2 + h8))?;
            a.vcvtdq2ps(scales, scales)?;
            a.vcvtph2ps(x, xmmword_ptr(r12 + rbx * 4 + h16))?;
            a.vmulps(scales, scales, x)?;
            a.vpmovzxbd(mins, qword_ptr(r9 + rbx * 2 + Q4K_MINS_AT as i32 + h8))?;
            a.vcvtdq2ps(mins, mins)?;
            a.vcvtph2ps(x, xmmword_ptr(r12 + rbx * 4 + Q4K_DMIN_AT as i32 + h16))?;
            a.vmulps(mins, mins, x)?;
            for &(s, t) in &of {
                let (sums, t4) = (acc(0, s), 4 * t as i32);
                if widen {
                    a.vpmaddwd(sums, sums, red_zone(ONES_AT))?;
                }
                a.vcvtdq2ps(sums, sums)?;
                a.vbroadcastss(x, dword_ptr(r13 + t4))?;
                a.vmulps(x, x, scales)?;
                a.vfmadd231ps(f32_sum(s), sums, x)?;
                a.vbroadcastss(x, dword_ptr(r13 + sums_at + t4))?;
                a.vfnmadd231ps(f32_sum(s), mins, x)?;
                a.vmovaps(sums, acc(1, s))?;
            }
        }
        a.add(r9, ROWS as i32)?;
        a.add(r10, TGB)?;
        a.dec(edi)
    });
    jback!(ops, jne, group, top);
    iced(ops, |a| {
        a.sub(r9, 2 * ROWS as i32)?;
        a.sub(r10, 2 * TGB)
    });
}

/// Q6_K's second 16 columns' tile bytes and the tile scales from r13, at
/// r10 + this: 1-byte displacements for both.
const Q6K_TILE_BASE: i32 = 160;

/// Where Q6_K's tile bytes of chunk 4g + 2j (rdi 16 x j) are: a base
/// register and a displacement to add to 4 x rdi.
fn q6_k_tile_chunks(g: usize) -> (AsmRegister64, i32) {
    if g == 0 {
        (r10, 0)
    } else {
        (r13, 4 * TILE_CHUNK - Q6K_TILE_BASE)
    }
}

/// The 16-bit pair sums of two chunks (in C0 and C1) for the lanes `of`
/// (lane, token), widened and added to the lanes' sums of `g`.
fn two_chunk_products(
    a: &mut CodeAssembler,
    g: usize,
    of: &[(usize, usize)],
) -> Result<(), IcedError> {
    let (base, at) = q6_k_tile_chunks(g);
    for &(s, t) in of {
        let x = at + 4 * t as i32;
        a.vpbroadcastd(X, dword_ptr(base + rdi * 4 + x))?;
        a.vpmaddubsw(X, C0, X)?;
        a.vpbroadcastd(W, dword_ptr(base + rdi * 4 + x + TILE_CHUNK))?;
        a.vpmaddubsw(W, C1, W)?;
        a.vpaddw(X, X, W)?;
        a.vpmaddwd(X, X, red_zone(ONES_AT))?;
        a.vpaddd(acc(g, s), acc(g, s), X)?;
    }
    Ok(())
}

/// Q6_K, one group (r9) for `lanes`: a loop over the 2 pairs of nibble
/// runs (rdi 16 per pair), each making chunks 2j, 2j + 1 of the group's
/// first 16 columns, then 4 + 2j, 5 + 2j of its last 16; then the
/// scaling, `v = float(a)·(d·sc_a)`, `v += float(b)·(d·sc_b)`, `f += v ·
/// d_x`.
fn q6_k_group(ops: &mut Asm, lanes: Lanes) {
    let pair = ops.new_dynamic_label();
    iced(ops, |a| {
        for (s, &(t, _)) in lanes.iter().enumerate() {
            for g in 0..2 {
                let at = TILE_HALF_STARTS_AT as i32 + (4 * TOKENS * g) as i32 + 4 * t as i32;
                a.vpbroadcastd(acc(g, s), dword_ptr(r10 + at))?;
            }
        }
        a.lea(rbp, ptr(r9 + rbx * 8))?;
        a.lea(r13, ptr(r10 + Q6K_TILE_BASE))?;
        a.xor(edi, edi)
    });
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>pair);
    iced(ops, |a| {
        for g in 0..2 {
            for (h, of) in halves(lanes) {
                let half = HALF_RUN * h as i32;
                let high = Q6K_HIGH_AT as i32 + (RUN_BYTES * g) as i32 + half;
                a.vmovdqu(X, ymmword_ptr(rbp + high))?;
                a.vpsllw(X, X, xmmword_ptr(rsp + rdi + COUNTS_AT))?;
                a.vpand(C0, X, red_zone(TOP_BITS_AT))?;
                a.vpsrlw(X, X, 2)?;
                a.vpand(C1, X, red_zone(TOP_BITS_AT))?;
                for (c, chunk) in [(0, C0), (1, C1)] {
                    let run = Q6K_NIBBLES_AT as i32 + (RUN_BYTES * c) as i32 + half;
                    a.vmovdqu(X, ymmword_ptr(rbp + rdi * 8 + run))?;
                    if g == 1 {
                        a.vpsrlw(X, X, 4)?;
                    }
                    a.vpand(X, X, red_zone(LOW_NIBBLES_AT))?;
                    a.vpor(chunk, chunk, X)?;
                }
                two_chunk_products(a, g, &of)?;
            }
        }
        a.add(edi, 16)?;
        a.cmp(edi, 32)
    });
    jback!(ops, jb, pair, top);
    iced(ops, |a| {
        let (d, first, second, x) = (X, C0, C1, W);
        let scales_at = TILE_SCALES_AT as i32 - Q6K_TILE_BASE;
        for (h, of) in halves(lanes) {
            let h8 = HALF_ROWS * h as i32;
            a.vcvtph2ps(d, xmmword_ptr(r12 + rbx * 4 + 2 * h8))?;
            a.vpmovsxbd(first, qword_ptr(r9 + rbx * 2 + h8))?;
            a.vcvtdq2ps(first, first)?;
            a.vmulps(first, first, d)?;
            a.vpmovsxbd(second, qword_ptr(r9 + rbx * 2 + ROWS as i32 + h8))?;
            a.vcvtdq2ps(second, second)?;
            a.vmulps(second, second, d)?;
            for &(s, t) in &of {
                let (sa, sb) = (acc(0, s), acc(1, s));
                a.vcvtdq2ps(sa, sa)?;
                a.vcvtdq2ps(sb, sb)?;
                a.vmulps(sa, sa, first)?;
                a.vfmadd231ps(sa, sb, second)?;
                a.vbroadcastss(x, dword_ptr(r13 + scales_at + 4 * t as i32))?;
                a.vfmadd231ps(f32_sum(s), sa, x)?;
            }
        }
        Ok(())
    });
}

fn unit_body(ops: &mut Asm, q: QuantType, lanes: Lanes) {
    match q {
        QuantType::Q4Kx16 => q4_k_pair(ops, lanes),
        QuantType::Q5Kx16 => q5_k_pair(ops, lanes),
        _ => q6_k_group(ops, lanes),
    }
}

/// Jumps to `to` when the pass (rax) is the call's last token alone.
fn if_one_token(ops: &mut Asm, to: dynasmrt::DynamicLabel) {
    dynasm!(ops
        ; .arch x64
        ; lea r13, [rax + 1]
        ; cmp r13, [rsp + NTOK_AT]
        ; je =>to
    );
}

/// Stores the lanes' f32 sums at `y + token·ldy + r` (r14 the block's
/// outputs), each half masked to the rows that exist; a half without rows
/// is not stored, nor a token past ntok. `dynamic_half`: the lanes' half
/// is the pass's (rbx). Clobbers rdi, rbp, r10, r13, ymm12, ymm13.
fn store_lanes(ops: &mut Asm, lanes: Lanes, dynamic_half: bool) {
    let end = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; mov rdi, QWORD 0x0706_0504_0302_0100
        ; vmovq xmm12, rdi
        ; vpmovzxbd ymm12, xmm12
        ; mov rbp, [rsp + LDY_AT]
        ; shl rbp, 2
        ; mov rdi, rax
        ; imul rdi, rbp
        ; add rdi, r14
        ; mov r13, r8
        ; sub r13, rcx
    );
    if dynamic_half {
        dynasm!(ops
            ; .arch x64
            ; lea rdi, [rdi + rbx * 8]
            ; lea r10, [rbx + rbx]
            ; sub r13, r10
        );
    }
    let mut at = (0, usize::MAX);
    for (s, &(t, h)) in lanes.iter().enumerate() {
        if h != at.1 {
            if s > 0 {
                dynasm!(ops ; .arch x64 ; sub r13, BYTE HALF_ROWS as i8);
            }
            dynasm!(ops
                ; .arch x64
                ; test r13, r13
                ; jle BYTE =>end
            );
            count_mask(ops, 13, 12, reg::R13);
        }
        if t != at.0 {
            dynasm!(ops
                ; .arch x64
                ; lea r10, [rax + t as i32]
                ; cmp r10, [rsp + NTOK_AT]
                ; jae BYTE =>end
                ; add rdi, rbp
            );
        }
        at = (t, h);
        let f = 8 + s as u8;
        let half = 4 * HALF_ROWS * h as i32;
        dynasm!(ops ; .arch x64 ; vmaskmovps [rdi + half], Ry(13), Ry(f));
    }
    dynasm!(ops ; .arch x64 ; =>end);
}

/// Emits the kernel `extern "sysv64" fn(w, x_tile, y, r0, r1, k, ldy,
/// ntok)` (see `gemm_quant`) for Q4Kx16, Q5Kx16 or Q6Kx16.
pub fn emit(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let q = p.q;
    let (header, _, units, _) = geometry(q);
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    token_call_frame(&mut ops, q, TILE_GROUP_BYTES, done);
    iced(&mut ops, |a| {
        let mut constants = vec![(LOW_NIBBLES_AT, 0x0F0F_0F0F), (ONES_AT, 0x0001_0001)];
        match q {
            QuantType::Q6Kx16 => constants.push((TOP_BITS_AT, 0x3030_3030)),
            QuantType::Q5Kx16 => constants.push((TOP_BITS_AT, 0x1010_1010)),
            _ => {}
        }
        for (at, bits) in constants {
            a.mov(eax, bits)?;
            a.vmovd(xmm15, eax)?;
            a.vpbroadcastd(ymm15, xmm15)?;
            a.vmovdqu(red_zone(at), ymm15)?;
        }
        if q == QuantType::Q6Kx16 {
            // Counts 4 (run pair 0) and 0 (run pair 1), 16 bytes apart.
            a.mov(eax, 4)?;
            a.vmovd(xmm15, eax)?;
            a.vmovdqu(red_zone(COUNTS_AT), ymm15)?;
        }
        Ok(())
    });
    dynasm!(ops
        ; .arch x64
        ; mov r15, rcx
        ; imul r15, rbp
        ; add r15, rdi
        ; lea r14, [rdx + rcx * 4]
    );
    let block = ops.new_dynamic_label();
    let pass = ops.new_dynamic_label();
    let half = ops.new_dynamic_label();
    let super_block = ops.new_dynamic_label();
    let unit = ops.new_dynamic_label();
    let one_unit = ops.new_dynamic_label();
    let unit_done = ops.new_dynamic_label();
    let one_store = ops.new_dynamic_label();
    let pass_done = ops.new_dynamic_label();
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block ; xor eax, eax);
    let pass_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>pass ; xor ebx, ebx);
    let half_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>half
        ; mov r9, r15
        ; lea r10, [rsi + rax * 4]
    );
    iced(&mut ops, |a| {
        for s in 0..4 {
            a.vxorps(f32_sum(s), f32_sum(s), f32_sum(s))?;
        }
        Ok(())
    });
    let super_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>super_block
        ; mov r12, r9
        ; add r9, header
        ; mov edx, units
    );
    let unit_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>unit);
    iced(&mut ops, |a| prefetch_unit(a, p, None));
    if_one_token(&mut ops, one_unit);
    unit_body(&mut ops, q, FOUR_TOKENS);
    dynasm!(ops ; .arch x64 ; jmp =>unit_done ; =>one_unit);
    unit_body(&mut ops, q, one_token_lanes(q));
    dynasm!(ops ; .arch x64 ; =>unit_done);
    next_unit(
        &mut ops,
        q,
        reg::RDX,
        (unit, unit_top),
        (super_block, super_top),
    );
    // The pass's stores, then the other half (a pass of one token over
    // both halves has none).
    let one = one_token_lanes(q);
    if one.len() > 1 {
        if_one_token(&mut ops, one_store);
    }
    store_lanes(&mut ops, FOUR_TOKENS, true);
    dynasm!(ops ; .arch x64 ; add ebx, BYTE 4);
    cmp_imm8(&mut ops, reg::RBX, 8);
    jback!(ops, jb, half, half_top);
    if one.len() > 1 {
        dynasm!(ops ; .arch x64 ; jmp BYTE =>pass_done ; =>one_store);
        store_lanes(&mut ops, one, false);
    }
    dynasm!(ops
        ; .arch x64
        ; =>pass_done
        ; add rax, BYTE FOUR_TOKENS.len() as i8
        ; cmp rax, [rsp + NTOK_AT]
    );
    jback!(ops, jb, pass, pass_top);
    // The last pass walked the whole block: r9 is the next block's start.
    dynasm!(ops
        ; .arch x64
        ; mov r15, r9
        ; add r14, BYTE (ROWS * 4) as i8
        ; add rcx, BYTE ROWS as i8
        ; cmp rcx, r8
    );
    jback!(ops, jb, block, block_top);
    dynasm!(ops ; .arch x64 ; =>done);
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}
