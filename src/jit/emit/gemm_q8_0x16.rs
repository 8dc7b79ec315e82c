//! The integer GEMM (and GEMV) for Q8_0 and Q5_0 stored in 16-row blocks
//! ([`QuantType::Q8_0x16`], [`QuantType::Q5_0x16`]), AVX-512 VNNI:
//! `y[t, r] = sum_g d_w[r,g] * d_x[t,g] * (q_w[r,g] · q_x[t,g])` for r in
//! `r0..r1` and t < `ntok` (1..=8), the call and the token tiles of
//! `gemm_quant`, the results of the type's 4-row GEMV bit for bit.
//!
//! The lanes of a 512-bit vector are 16 rows. A group's chunk c (4 columns
//! of 16 rows) is one 64-byte vector, and one `vpdpbusd` multiplies it by
//! a token's 4 bytes of chunk c broadcast from the tile (`{1to16}`): no
//! shuffle, no horizontal sum, 8 multiply-adds per token per 16 rows x 32
//! columns. The group's scaling is then one conversion, one product of
//! scales and one FMA per token for 16 rows, with the GEMV's order of
//! operations: `f += float(sum - (sum_x << 7)) * (d_w * d_x)`.
//!
//! Q8_0x16's chunk is one load. Q5_0x16's chunks n and n + 4 are the low
//! and high nibbles of one 64-byte run, each with a 64-bit mask of its
//! high bits: 5 instructions make both chunks' bytes (`load_chunk_pair`),
//! so Q5_0 needs no unpacking pass into a panel before its products and
//! no GEMV of its own (a step over 4 tokens costs about 1.27x a one-token
//! step, where the Q5_0 GEMV and unpacked panels it replaced cost 1.4x).
//!
//! The chunks 0..3 sums start from the tile's `vnni_group_start`
//! (`1.5 * 2^23` as bits, less `sum_x << 7`), so the correction and the
//! conversion are one `vsubps` of 1.5 * 2^23, exact: per group of 4 tokens
//! 40 vector instructions became 32 plus the scaling.
//!
//! What bounds the arithmetic is issue, not latency: `vpdpbusd` issues on
//! two ports (0 and 5, which the FMAs, `vpaddd` and the unpacking share),
//! and a group of 8 tokens (64 `vpdpbusd`, 24 scaling instructions and,
//! for Q5_0x16, 20 of unpacking) runs from L2 close to what those ports
//! allow, about the rate at which a core streams weights from memory.
//! More chains per token would only add a `vpaddd` a token.
//!
//! A call reads each 16-row block once, in one of three forms that its
//! token count picks per group: one token (a decode step: a loop of two
//! rounds of chunk pairs, 2 chains), 2 to 4 (straight-line, two chains per
//! token; fewer than 4 compute the absent ones from the tile's zeros and
//! store nothing for them) and 5 to 8 (a loop of two rounds, one chain
//! per token). One pass over 5 to 8 tokens, rather than two passes of 4,
//! unpacks Q5_0x16's chunks once for all of them and keeps memory
//! streaming while the products run; see `group_step` for the
//! straight-line form. The figures behind these choices are in
//! `docs/performance.md`.
//!
//! Rows: r0 a multiple of 16; the last block may be partial (its padding
//! rows are zeros). Stores are masked (k1) to the rows that exist.
//!
//! Registers: zmm0..3 a pass of 4 tokens' group sums over chunks 0..3,
//! zmm4..7 over chunks 4..7 (two chains each; the 8-token form has one
//! chain per token in zmm0..7), zmm8..15 their f32 sums, zmm16/17 chunks n and
//! n + 4 of the weights, zmm18 the 16 row scales, zmm19 a temporary, zmm20
//! 1.5 * 2^23 in every lane; Q5_0x16: zmm21..23 the bytes 0x0F, 0x70 and
//! 0x80, zmm24 a nibble run, k2/k3 two chunks' high bits.
//! General registers as `gemm_quant`'s frame (`token_call_frame`), plus
//! r15 the block's first group, rax 0 (the first token) and rbx the
//! round of the chunk loop (K, in rbx on entry, is not needed past the
//! frame).

use super::gemm_quant::{
    FLOAT_MAGIC_BITS, GemmQuantParams, TILE_GROUP_BYTES, TILE_SCALES_AT, TILE_VNNI_STARTS_AT,
    block_and_pass_top, iced, next_group, token_call_frame,
};
use super::{Asm, cmp_imm8, new_asm, next_block_and_return, reg, save_callee_saved};
use crate::jback;
use crate::model::quant_blocks::{CHUNK_BYTES, GROUP_COLS, Q5_0X16_MASKS_AT, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

/// Rows per block: the 16 dword lanes of a zmm register.
pub const ROWS: usize = 16;
/// Tokens of the pass over a block for calls of 2 to 4 tokens.
const PASS_TOKENS: usize = 4;
/// Tokens of the pass for calls of 5 to 8: the whole tile, one chain each.
const TILE_TOKENS: usize = super::gemm_quant::TOKENS;
const CHUNKS: usize = GROUP_COLS / CHUNK_BYTES;
/// A group's chunks go in pairs (n, n + 4): Q5_0x16's nibble run n holds
/// both, and Q8_0x16 loads them as two vectors.
const PAIRS: usize = CHUNKS / 2;
/// Where the first chunk (or nibble run) of a group starts, after the 16
/// f16 scales.
const CHUNKS_AT: i32 = (ROWS * 2) as i32;

/// The group sums, which start from the tile's VNNI values. A pass of up
/// to 4 tokens keeps two chains per token, chunks 0..3 in token t's
/// register and chunks 4..7 in register 4 + t; the pass of 8 one chain
/// per token (8 chains are enough to keep `vpdpbusd` busy).
const SUMS: [AsmRegisterZmm; TILE_TOKENS] = [zmm0, zmm1, zmm2, zmm3, zmm4, zmm5, zmm6, zmm7];
const F32_SUMS: [AsmRegisterZmm; TILE_TOKENS] =
    [zmm8, zmm9, zmm10, zmm11, zmm12, zmm13, zmm14, zmm15];
/// Chunks n and n + 4 of 16 rows, as bytes s + 128.
/// `F32_SUMS`' low 128 bits, to clear them with short VEX forms.
const F32_SUMS_LOW: [AsmRegisterXmm; TILE_TOKENS] =
    [xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14, xmm15];
const WEIGHTS: [AsmRegisterZmm; 2] = [zmm16, zmm17];
const ROW_SCALES: AsmRegisterZmm = zmm18;
const TEMP: AsmRegisterZmm = zmm19;
/// 1.5 * 2^23 in every lane (`FLOAT_MAGIC_BITS`), set once per call.
const FLOAT_MAGIC: AsmRegisterZmm = zmm20;
/// Q5_0x16: bytes 0x0F, 0x70 and 0x80, and a nibble run.
const LOW_NIBBLES: AsmRegisterZmm = zmm21;
const HIGH_BIT_CLEAR: AsmRegisterZmm = zmm22;
const HIGH_BIT_SET: AsmRegisterZmm = zmm23;
const NIBBLES: AsmRegisterZmm = zmm24;

/// The chain that takes token t's chunk c in a pass of `tokens`.
fn chain(tokens: usize, t: usize, c: usize) -> AsmRegisterZmm {
    if tokens < TILE_TOKENS && c >= PAIRS {
        SUMS[PASS_TOKENS + t]
    } else {
        SUMS[t]
    }
}
/// `vpternlogd` truth table of `dest | (src2 & src3)`.
const OR_AND: i32 = 0xF8;

/// Chunks n and n + 4 of the group into `WEIGHTS` as bytes s + 128 (the
/// round's weights at r9 + 8 rbx, Q5_0x16's masks at r9 + rbx). Q5_0x16:
/// the nibble run's low nibbles are chunk n, its high nibbles chunk n + 4,
/// and each chunk's opmask of high bits picks 0x80 or 0x70 to OR in: v +
/// 112 = s + 128, v + 112 + 16 where bit 4 is set (5 instructions for two
/// chunks, one of them, the shift, on port 0).
fn load_chunk_pair(a: &mut CodeAssembler, q: QuantType, n: usize) -> Result<(), IcedError> {
    let [low, high] = WEIGHTS;
    if q == QuantType::Q8_0x16 {
        for (w, c) in [(low, n), (high, n + PAIRS)] {
            let at = CHUNKS_AT + (c * ROWS * CHUNK_BYTES) as i32;
            a.vmovdqu32(w, zmmword_ptr(r9 + rbx * 8 + at))?;
        }
        return Ok(());
    }
    let run_at = CHUNKS_AT + (n * ROWS * CHUNK_BYTES) as i32;
    let mask_at = |c: usize| (Q5_0X16_MASKS_AT + 8 * c) as i32;
    a.vmovdqu32(NIBBLES, zmmword_ptr(r9 + rbx * 8 + run_at))?;
    a.kmovq(k2, qword_ptr(r9 + rbx + mask_at(n)))?;
    a.kmovq(k3, qword_ptr(r9 + rbx + mask_at(n + PAIRS)))?;
    a.vpblendmb(low.k2(), HIGH_BIT_CLEAR, HIGH_BIT_SET)?;
    a.vpternlogd(low, NIBBLES, LOW_NIBBLES, OR_AND)?;
    a.vpsrlw(NIBBLES, NIBBLES, 4)?;
    a.vpblendmb(high.k3(), HIGH_BIT_CLEAR, HIGH_BIT_SET)?;
    a.vpternlogd(high, NIBBLES, LOW_NIBBLES, OR_AND)
}

/// One group of the pass: 16 rows x 32 columns (r9) against the first
/// `tokens` (4; 8 for Q5_0x16's calls of 5 to 8; 1 for a call of one
/// token) of the tile group (r10), scaled into the f32 sums. The 4-token
/// step is straight-line code (3.3 ns per 4 rows x 32 columns x 8 tokens
/// from L2, against 3.8 for a loop of two rounds of 4 chunks); the 8-token
/// step (for the budget) and the 1-token step (bound by memory) loop over
/// two rounds of chunk pairs to save code: rbx counts 8 per pair
/// done, so a round's inputs are 4 rbx on, its weights 8 rbx and
/// Q5_0x16's masks rbx.
fn group_step(ops: &mut Asm, p: &GemmQuantParams, tokens: usize) {
    let q = p.q;
    let rounds = if tokens == PASS_TOKENS { 1 } else { 2 };
    let round_pairs = PAIRS / rounds;
    let round = ops.new_dynamic_label();
    iced(ops, |a| {
        for (t, s) in SUMS[..tokens].iter().enumerate() {
            let at = (TILE_VNNI_STARTS_AT + t * 4) as i32;
            a.vpbroadcastd(*s, dword_ptr(r10 + at))?;
        }
        if tokens < TILE_TOKENS {
            for t in 0..tokens {
                let s = chain(tokens, t, PAIRS);
                a.vpxord(s, s, s)?;
            }
        }
        a.xor(ebx, ebx)
    });
    let round_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>round);
    iced(ops, |a| {
        for n in 0..round_pairs {
            load_chunk_pair(a, q, n)?;
            for (w, c) in [(WEIGHTS[0], n), (WEIGHTS[1], n + PAIRS)] {
                for t in 0..tokens {
                    let x = (c * CHUNK_BYTES * TILE_TOKENS + t * 4) as i32;
                    a.vpdpbusd(chain(tokens, t, c), w, dword_bcst(r10 + rbx * 4 + x))?;
                }
            }
        }
        Ok(())
    });
    if rounds > 1 {
        // Through iced, whose encoder takes the 3-byte imm8 forms that
        // dynasm's `add`/`cmp` with a Rust expression do not.
        iced(ops, |a| {
            a.add(ebx, 8 * round_pairs as i32)?;
            a.cmp(ebx, 8 * PAIRS as i32)
        });
        jback!(ops, jb, round, round_top);
    }
    iced(ops, |a| {
        a.vcvtph2ps(ROW_SCALES, ymmword_ptr(r9))?;
        for t in 0..tokens {
            let (low, high, f) = (SUMS[t], chain(tokens, t, PAIRS), F32_SUMS[t]);
            let at = (t * 4) as i32;
            // The sums started from the tile's `vnni_group_start`, so
            // their bits are 1.5 * 2^23 + the group's exact product as a
            // float: one subtraction converts it (see FLOAT_MAGIC_BITS).
            // Whole numbers, so one chain or two give the same sum.
            if high != low {
                a.vpaddd(low, low, high)?;
            }
            a.vsubps(low, low, FLOAT_MAGIC)?;
            a.vmulps(
                TEMP,
                ROW_SCALES,
                dword_bcst(r10 + TILE_SCALES_AT as i32 + at),
            )?;
            a.vfmadd231ps(f, low, TEMP)?;
        }
        Ok(())
    });
}

/// The group's prefetches, before the form of its token count is chosen,
/// so that the three forms share one copy: the lines `p.prefetch` bytes
/// ahead into L1 and `p.l2_prefetch` bytes ahead into L2 as well.
fn prefetch_group(ops: &mut Asm, p: &GemmQuantParams) {
    let q = p.q;
    iced(ops, |a| {
        if p.prefetch > 0 {
            // The whole group's lines, before its rounds: a round covers
            // a share of the chunks, not of the bytes, so prefetches spread
            // over the rounds missed some of each group.
            for line in 0..q.group_bytes().div_ceil(64) as i32 {
                a.prefetcht0(byte_ptr(r9 + p.prefetch as i32 + 64 * line))?;
            }
        }
        if p.l2_prefetch > 0 {
            // A pass over several tokens fills the reorder buffer with
            // products, so the L1 prefetch alone issues too late for
            // memory's latency under load; the same lines further ahead
            // into L2 let reads and products overlap. Both forms share
            // these prefetches (one copy in the code budget).
            for line in 0..q.group_bytes().div_ceil(64) as i32 {
                a.prefetcht1(byte_ptr(r9 + p.l2_prefetch as i32 + 64 * line))?;
            }
        }
        Ok(())
    });
}

/// Stores the call's tokens (ntok, r13) at `y + t*ldy + r` (r14 = y + r),
/// one store each masked (k1) to the rows that exist (`r8 - rcx`, at most
/// 16). (Through the red zone and two `vmaskmovps` of 8 rows each, the
/// stores took 96 more bytes of code, which the plan's budget lacked.)
/// Clobbers r9, r10 and k1.
pub(super) fn store_pass(ops: &mut Asm) {
    let done = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; mov r9, r8
        ; sub r9, rcx
        ; mov r10d, ROWS as i32
        ; cmp r10, r9
        ; cmovb r9, r10
        ; xor r10d, r10d
        ; bts r10d, r9d
        ; dec r10d
    );
    iced(ops, |a| a.kmovw(k1, r10d));
    dynasm!(ops ; .arch x64 ; mov r10, r14);
    for (t, f) in F32_SUMS.into_iter().enumerate() {
        if t > 0 {
            dynasm!(ops ; .arch x64 ; add r10, r12);
            cmp_imm8(ops, reg::R13, t as i8);
            // The 7 stores after the first span 90 bytes: a short jump.
            dynasm!(ops ; .arch x64 ; jbe BYTE =>done);
        }
        iced(ops, |a| a.vmovups(zmmword_ptr(r10).k1(), f));
    }
    dynasm!(ops ; .arch x64 ; =>done);
}

/// Emits the kernel `extern "sysv64" fn(w, x_tile, y, r0, r1, k, ldy,
/// ntok)` (see `gemm_quant`).
pub fn emit(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let q = p.q;
    anyhow::ensure!(
        q.rows_are_lanes() && p.vnni,
        "kernel {name}: the 16-row GEMM reads Q8_0x16 or Q5_0x16 with VNNI only"
    );
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let pass = ops.new_dynamic_label();
    token_call_frame(&mut ops, q, TILE_GROUP_BYTES, done);
    iced(&mut ops, |a| {
        let mut constant = |reg: AsmRegisterZmm, bits: i32| -> Result<(), IcedError> {
            a.mov(r10d, bits)?;
            a.vpbroadcastd(reg, r10d)
        };
        constant(FLOAT_MAGIC, FLOAT_MAGIC_BITS)?;
        if q == QuantType::Q5_0x16 {
            constant(LOW_NIBBLES, 0x0F0F_0F0F)?;
            constant(HIGH_BIT_CLEAR, 0x7070_7070)?;
            constant(HIGH_BIT_SET, 0x8080_8080_u32 as i32)?;
        }
        Ok(())
    });
    let (block_top, _) = block_and_pass_top(&mut ops, block, pass);
    iced(&mut ops, |a| {
        // VEX xmm forms (4 bytes, against 6 for EVEX zmm): a VEX write
        // clears the register's bits above 128 too.
        for f in F32_SUMS_LOW {
            a.vpxor(f, xmm0, xmm0)?;
        }
        Ok(())
    });
    // A call of one token (a decode step) takes a loop of its own (the
    // 4-token loop's idle tokens slowed decode); a call of 2 to 8 tokens
    // one pass of 8, which unpacks Q5_0x16's chunks once for all tokens
    // and keeps memory busy while its products run. The group's token
    // count picks the form after the group's prefetches, so one copy of
    // the prefetches and of the step to the next group serves all forms
    // (a form each did not fit the plan's budget).
    let group = ops.new_dynamic_label();
    let one_token = ops.new_dynamic_label();
    let eight_tokens = ops.new_dynamic_label();
    let group_done = ops.new_dynamic_label();
    let group_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    prefetch_group(&mut ops, p);
    cmp_imm8(&mut ops, reg::R13, 1);
    dynasm!(ops ; .arch x64 ; je =>one_token);
    cmp_imm8(&mut ops, reg::R13, PASS_TOKENS as i8);
    dynasm!(ops ; .arch x64 ; ja =>eight_tokens);
    for tokens in [PASS_TOKENS, TILE_TOKENS, 1] {
        match tokens {
            1 => dynasm!(ops ; .arch x64 ; =>one_token),
            TILE_TOKENS => dynasm!(ops ; .arch x64 ; =>eight_tokens),
            _ => {}
        }
        group_step(&mut ops, p, tokens);
        if tokens != 1 {
            dynasm!(ops ; .arch x64 ; jmp =>group_done);
        }
    }
    dynasm!(ops ; .arch x64 ; =>group_done);
    next_group(&mut ops, q, (group, group_top));
    // A call has at most a tile's 8 tokens (`GemmQuant::run` checks), so
    // the block takes no second pass.
    store_pass(&mut ops);
    next_block_and_return(ops, ROWS, (block, block_top), done, name)
}
