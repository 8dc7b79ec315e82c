//! The integer GEMM (and GEMV) for Q4_K, Q5_K and Q6_K in 16-row blocks at
//! the file's bits ([`QuantType::Q4Kx16`], [`QuantType::Q5Kx16`],
//! [`QuantType::Q6Kx16`], laid out by
//! `model::k_quant_x16`): `y[t, r] = W[r, :] · x[t, :]` for r in `r0..r1`
//! and t < `ntok` (1..=8), with `gemm_quant`'s call and token tiles.
//!
//! The lanes of a vector are rows, as in `gemm_q8_0x16`: a 64-byte run of
//! the layout is one chunk of 4 columns of 16 rows, and a token's 4 bytes
//! broadcast from the tile multiply it (`vpdpbusd` with AVX-512 VNNI on 16
//! rows; `vpmaddubsw` + `vpmaddwd` under AVX2 on 8). The quants are
//! unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) and the input's bytes
//! signed, so no
//! sign trick is needed. Per row, token and group of 32 columns the group
//! sum is an exact integer; its scaling is:
//! - with VNNI, whose input has one scale `d_x` per super-block of 256
//!   (`gemm_quant::ScaleSpan::SuperBlock`, llama.cpp's Q8_K): `s += sc ·
//!   Σ q·x` in integers (`vpmulld`; exact, |s| < 2^27), Q4_K's and Q5_K's
//!   `f −= (dmin·m) · (d_x · Σx)` (the tile's scaled sum) per group, and
//!   once per super-block `f += float(s) · (d · d_x)`. Q6_K's scales
//!   change every 16 columns: its half-groups' sums start from the tile's
//!   `−32 · Σx` of the half, which takes the stored offset of 32 off, and
//!   are scaled alike. A Q4_K group costs one integer and one f32 product
//!   beside its 8 `vpdpbusd`s a token, where a scale per group of input
//!   took three f32 products (the pass of 8 went from 60-65% of the VNNI
//!   peak to 69-71%; Q6_K's, bound by its unpacking, stayed at 53-57%;
//!   performance.md);
//! - under AVX2 (a scale per group of input): Q4_K and Q5_K `f +=
//!   float(Σ q·x) · ((d·sc) · d_x)`, then `f −= (dmin·m) · (d_x · Σx)`;
//!   Q6_K `v = float(a) · (d·sc_a)`, `v += float(b) · (d·sc_b)`, `f += v ·
//!   d_x` over the halves' sums `a` and `b`.
//!
//! `d·sc` and `dmin·m` are exact in f32 (an f16 times a 6- or 8-bit
//! integer), so `engine::kernels::gemm_kquant_portable`, doing the same
//! f32 operations in the same order, gives the same bits.
//!
//! Unpacking: Q4_K's run holds chunk n of a pair of groups, low and high
//! nibbles; with VNNI the pair's groups go one after the other over the
//! same runs, each shifted right by its group's count (0, then 4) and
//! masked, as do Q6_K's halves. Q6_K's nibble run n
//! holds chunk n (low) and n + 4 (high) of a group; their top 2 bits come
//! from two runs of 2-bit fields, chunk n's at bits 2n..2n+1 of each
//! byte: rotated left by 4 − 2n they sit at bits 4..5 (VNNI rotates the
//! whole run by 2 per chunk: `vprord` in the one-token form, two shifts
//! and an OR in a pass of 8, which its products bound: on Zen 4 a rotate
//! takes one of the two ports the `vpdpbusd`s issue on, shifts and ORs
//! go to the other two; AVX2 shifts 16-bit words, which the mask 0x30
//! makes exact), masked and OR-ed onto the nibble. Q5_K's
//! runs are Q4_K's; its fifth bits come from two runs per pair, those of
//! chunk 4h + i at bits i and 4 + i of run h: shifted right by i (one
//! shift a chunk, the second run loaded at chunk 4), masked by 0x10 at
//! bit 4 for the second group and after a shift left by 4 for the first
//! (with VNNI: rotated left by 4, then right by the group's count).
//!
//! With VNNI a call takes one of two forms by its token count: one token
//! (a decode step) or a pass of 8 (2 to 8 tokens; the absent ones compute
//! on the tile's zeros and are not stored). The one-token form reads the
//! one-token tile (`gemm_quant::SINGLE_GROUP_BYTES`, a line a group: the
//! 8-token tile did not fit L1 beside the stream) and does no software
//! prefetching: the hardware's
//! prefetchers follow a single stream read in address order, which is
//! what bounds a decode step. The AVX2 form is `gemm_kquant_avx2`
//! (passes of 4 tokens over 8 rows, or of one token over 16).
//!
//! Registers (VNNI): zmm0..7 the tokens' sums of a group (Q4_K, Q5_K) or
//! half-group (Q6_K), zmm16..23 the super-block's scaled integer sums,
//! zmm8..15 the f32 results (stored by `gemm_q8_0x16::store_pass`),
//! zmm24..31 the unpacking and scaling (among them the super-block's `d`,
//! and Q4_K's `dmin`, as f32). General registers as `gemm_quant`'s frame,
//! plus r15 the units (pairs or groups) left in the super-block, rbx the
//! chunk's offset, eax (free once a pass has started) which group of a
//! pair or half of a group, and for Q6_K rbp (pushed for the block) the
//! half's offset into the tile group.

use super::gemm_quant::{
    GemmQuantParams, SINGLE_GROUP_BYTES, SINGLE_HALF_STARTS_AT, SINGLE_SCALE_AT,
    SINGLE_SCALED_SUM_AT, TILE_GROUP_BYTES, TILE_HALF_STARTS_AT, TILE_SCALED_SUMS_AT,
    TILE_SCALES_AT, TOKENS, block_and_pass_top, iced, token_call_frame,
};
use super::{Asm, cmp_imm8, new_asm, next_block_and_return, reg, save_callee_saved};
use crate::jback;
use crate::model::k_quant_x16::{
    Q4K_DMIN_AT, Q4K_MINS_AT, Q4K_PAIR_BYTES, Q4K_PAIRS_AT, Q4K_RUNS_AT, Q5K_HIGH_AT,
    Q5K_PAIR_BYTES, Q5K_RUNS_AT, Q6K_GROUP_BYTES, Q6K_GROUPS_AT, Q6K_HIGH_AT, Q6K_NIBBLES_AT,
    RUN_BYTES, SUPER_GROUPS,
};
use crate::model::quant_blocks::{CHUNK_BYTES, QuantType};
use dynasmrt::{AssemblyOffset, DynamicLabel, DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

/// Rows per block: the 16 dword lanes of a zmm register.
pub const ROWS: usize = 16;
/// A token's 4 bytes of one chunk are 32 bytes apart in the tile.
const TILE_CHUNK: i32 = (CHUNK_BYTES * TOKENS) as i32;
const TGB: i32 = TILE_GROUP_BYTES as i32;
/// `vpternlogd` truth table of `dest | (src2 & src3)`.
const OR_AND: i32 = 0xF8;

const FIRST: [AsmRegisterZmm; TOKENS] = [zmm0, zmm1, zmm2, zmm3, zmm4, zmm5, zmm6, zmm7];
const F32_SUMS: [AsmRegisterZmm; TOKENS] = [zmm8, zmm9, zmm10, zmm11, zmm12, zmm13, zmm14, zmm15];
const F32_SUMS_LOW: [AsmRegisterXmm; TOKENS] =
    [xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14, xmm15];
const SECOND: [AsmRegisterZmm; TOKENS] = [zmm16, zmm17, zmm18, zmm19, zmm20, zmm21, zmm22, zmm23];
const NIBBLES: AsmRegisterZmm = zmm24;
const CHUNK_A: AsmRegisterZmm = zmm25;
const CHUNK_B: AsmRegisterZmm = zmm26;
const LOW_NIBBLES: AsmRegisterZmm = zmm27;
const TOP_BITS: AsmRegisterZmm = zmm28;
const HIGH_A: AsmRegisterZmm = zmm29;
const HIGH_B: AsmRegisterZmm = zmm30;
const SPARE: AsmRegisterZmm = zmm31;
/// Q4_K: the super-block's 16 rows' `d` and `dmin` as f32 (Q6_K's
/// registers of high bits, which Q4_K does not use); Q6_K's `d`.
const D: AsmRegisterZmm = HIGH_A;
const DMIN: AsmRegisterZmm = HIGH_B;
const Q6K_D: AsmRegisterZmm = SPARE;
/// Q5_K: the fifth bits of the pair's current run, shifted right by one a
/// chunk (Q5_K's `d` and `dmin` are Q4_K's registers).
const Q5K_HIGH: AsmRegisterZmm = SPARE;
/// Q4_K and Q5_K: how far the current group's nibbles sit up each byte
/// of a run, in every dword (0 for a pair's first group, 4 for its
/// second).
const HALF_SHIFT: AsmRegisterZmm = CHUNK_B;

/// Where the parts of a group of the input are for a call of `tokens`
/// (1 or 8) (see `gemm_quant`'s tiles): the bytes of a group, of a chunk,
/// the offsets of the token's scale, scaled sum and Q6_K half starts, and
/// the bytes between the two half starts.
struct TileGeometry {
    group: i32,
    chunk: i32,
    scale: i32,
    scaled_sum: i32,
    half_starts: i32,
    half_step: i32,
}

fn tile_geometry(tokens: usize) -> TileGeometry {
    if tokens == 1 {
        TileGeometry {
            group: SINGLE_GROUP_BYTES as i32,
            chunk: CHUNK_BYTES as i32,
            scale: SINGLE_SCALE_AT as i32,
            scaled_sum: SINGLE_SCALED_SUM_AT as i32,
            half_starts: SINGLE_HALF_STARTS_AT as i32,
            half_step: 4,
        }
    } else {
        TileGeometry {
            group: TGB,
            chunk: TILE_CHUNK,
            scale: TILE_SCALES_AT as i32,
            scaled_sum: TILE_SCALED_SUMS_AT as i32,
            half_starts: TILE_HALF_STARTS_AT as i32,
            half_step: (4 * TOKENS) as i32,
        }
    }
}

/// The run loop's index and steps: the 8-token form indexes both the
/// weights' runs (rbx · 8) and the tile's chunks (rbx · 4) by rbx, 8 a
/// run; the one-token tile's chunks are 4 bytes apart, which no index
/// scale reaches, so that form steps r10 itself, `chains` chunks an
/// iteration, and returns how far it went (taken back at the unit's end).
fn step_chunks(a: &mut CodeAssembler, tokens: usize, chains: usize) -> Result<(), IcedError> {
    if tokens == 1 {
        a.add(r10, (chains * CHUNK_BYTES) as i32)?;
    }
    Ok(())
}

/// The tile's chunk `c` (of the iteration) for the run loop's operands.
fn chunk_at(g: &TileGeometry, tokens: usize, c: usize) -> AsmMemoryOperand {
    if tokens == 1 {
        r10 + g.chunk * c as i32
    } else {
        r10 + rbx * 4 + g.chunk * c as i32
    }
}

/// Where the one-token form's r10 must end a unit of `groups` groups,
/// having gone `went` bytes through its chunks: `next_unit` steps r10 by
/// the 8-token tile's groups, the one-token tile's are 64 bytes.
fn unit_r10_fixup(tokens: usize, groups: i32, went: i32) -> i32 {
    if tokens == 1 {
        went + groups * (TGB - SINGLE_GROUP_BYTES as i32)
    } else {
        0
    }
}

/// Bytes of a super-block's header (the rows' f16 scales) and of one
/// unit of the loop over it (a pair of groups or a group), and the units.
pub(super) fn geometry(q: QuantType) -> (i32, i32, i32, usize) {
    match q {
        QuantType::Q4Kx16 => (
            Q4K_PAIRS_AT as i32,
            Q4K_PAIR_BYTES as i32,
            (SUPER_GROUPS / 2) as i32,
            2,
        ),
        QuantType::Q5Kx16 => (
            Q4K_PAIRS_AT as i32,
            Q5K_PAIR_BYTES as i32,
            (SUPER_GROUPS / 2) as i32,
            2,
        ),
        _ => (
            Q6K_GROUPS_AT as i32,
            Q6K_GROUP_BYTES as i32,
            SUPER_GROUPS as i32,
            1,
        ),
    }
}

/// Emits the kernel `extern "sysv64" fn(w, x_tile, y, r0, r1, k, ldy,
/// ntok)` (see `gemm_quant`).
pub fn emit(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        p.q.is_k_quant(),
        "kernel {name}: the K-quant GEMM reads Q4Kx16, Q5Kx16 or Q6Kx16"
    );
    if p.vnni {
        emit_vnni(p, name)
    } else {
        super::gemm_kquant_avx2::emit(p, name)
    }
}

/// The prefetches of one unit, `p.prefetch` (into L1) and `p.l2_prefetch`
/// (into L2) bytes ahead of r9. With a `scratch` register (the VNNI pass
/// of 8, whose rbx is free there) each set is addressed from it, set 128
/// bytes into the set's lines, so that four of them take an 8-bit
/// displacement: 12 to 15 bytes of code fewer a set, which the plans of
/// the smallest models need (their budget is 5,120 bytes).
pub(super) fn prefetch_unit(
    a: &mut CodeAssembler,
    p: &GemmQuantParams,
    scratch: Option<AsmRegister64>,
) -> Result<(), IcedError> {
    let (header, unit_bytes, units, _) = geometry(p.q);
    // The units' lines and the super-block header's share: a header
    // line no unit's prefetches cover is a miss to memory once per
    // super-block (Q4_K's units are whole lines, so its 64-byte header
    // was exactly that).
    let lines = (unit_bytes + (header + units - 1) / units + 63) / 64;
    for (ahead, into_l1) in [(p.prefetch, true), (p.l2_prefetch, false)] {
        if ahead == 0 {
            continue;
        }
        let (base, first) = match scratch {
            Some(reg) => {
                a.lea(reg, ptr(r9 + ahead as i32 + 128))?;
                (reg, -128)
            }
            None => (r9, ahead as i32),
        };
        for line in 0..lines {
            let at = byte_ptr(base + first + 64 * line);
            if into_l1 {
                a.prefetcht0(at)?;
            } else {
                a.prefetcht1(at)?;
            }
        }
    }
    Ok(())
}

/// Chains of products per group sum: a call of one token (a decode step,
/// bound by memory) takes two, the even and the odd chunks, so that its
/// `vpdpbusd`s do not wait on each other run after run (a group's 8 in one
/// chain are 8 latencies); a pass of 8 has 8 tokens' chains already.
fn chains(tokens: usize) -> usize {
    if tokens == 1 { 2 } else { 1 }
}

/// Adds the one-token form's odd chunks' chain (the second token's
/// register) to the even one's.
fn join_chains(a: &mut CodeAssembler, chains: usize) -> Result<(), IcedError> {
    if chains == 2 {
        a.vpaddd(FIRST[0], FIRST[0], FIRST[1])?;
    }
    Ok(())
}

/// Q4_K's or Q5_K's pair of groups (r9) for `tokens` (1 or 8) of the tile
/// (r10), one group after the other (eax 0, then 2): a loop over the 8
/// nibble runs (rbx 8 per run), each run's low nibbles for the first
/// group and its high ones for the second (shifted right by
/// `HALF_SHIFT`, 0 then 4), Q5_K's fifth bits ORed on at bit 4; then the
/// group's scaling: its integer sums times its 6-bit scale into the
/// super-block's (`SECOND`), `f −= (dmin·m) · (d_x · Σx)` in f32.
fn k_pair_vnni(ops: &mut Asm, q: QuantType, tokens: usize) {
    let group = ops.new_dynamic_label();
    let run = ops.new_dynamic_label();
    let same_run = ops.new_dynamic_label();
    let chains = chains(tokens);
    let g = tile_geometry(tokens);
    let fifth_bits = q == QuantType::Q5Kx16;
    let runs_at = if fifth_bits { Q5K_RUNS_AT } else { Q4K_RUNS_AT } as i32;
    dynasm!(ops ; .arch x64 ; xor eax, eax);
    let group_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    iced(ops, |a| {
        for sums in &FIRST[..tokens.max(chains)] {
            a.vpxord(*sums, *sums, *sums)?;
        }
        if fifth_bits {
            load_fifth_bits(a, 0)?;
        }
        a.xor(ebx, ebx)
    });
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>run);
    if fifth_bits {
        // Chunk 4 (rbx 32 in either form) starts the second run of fifth
        // bits.
        cmp_imm8(ops, reg::RBX, 4 * 8);
        dynasm!(ops ; .arch x64 ; jne BYTE =>same_run);
        iced(ops, |a| load_fifth_bits(a, RUN_BYTES as i32));
        dynasm!(ops ; .arch x64 ; =>same_run);
    }
    iced(ops, |a| {
        for c in 0..chains {
            let w = (c * RUN_BYTES) as i32;
            a.vmovdqu32(NIBBLES, zmmword_ptr(r9 + rbx * 8 + runs_at + w))?;
            a.vpsrlvd(NIBBLES, NIBBLES, HALF_SHIFT)?;
            let quants = if fifth_bits {
                a.vpandd(CHUNK_A, Q5K_HIGH, TOP_BITS)?;
                a.vpternlogd(CHUNK_A, NIBBLES, LOW_NIBBLES, OR_AND)?;
                a.vpsrld(Q5K_HIGH, Q5K_HIGH, 1)?;
                CHUNK_A
            } else {
                a.vpandd(NIBBLES, NIBBLES, LOW_NIBBLES)?;
                NIBBLES
            };
            for t in 0..tokens {
                let x = chunk_at(&g, tokens, c) + 4 * t as i32;
                a.vpdpbusd(FIRST[t + c], quants, dword_bcst(x))?;
            }
        }
        step_chunks(a, tokens, chains)?;
        a.add(ebx, 8 * chains as i32)?;
        a.cmp(ebx, 8 * 8)
    });
    jback!(ops, jb, run, top);
    // The one-token form's r10 went through the group's 8 chunks.
    let went = if tokens == 1 { g.chunk * 8 } else { 0 };
    iced(ops, |a| {
        join_chains(a, chains)?;
        // The group's 16 scales and mins, 16 bytes after the first
        // group's (rax = 2 for the second group).
        let (scales, mins) = (CHUNK_A, NIBBLES);
        a.vpmovzxbd(scales, xmmword_ptr(r9 + rax * 8))?;
        a.vpmovzxbd(mins, xmmword_ptr(r9 + rax * 8 + Q4K_MINS_AT as i32))?;
        a.vcvtdq2ps(mins, mins)?;
        a.vmulps(mins, mins, DMIN)?;
        for t in 0..tokens {
            let x = r10 - went + g.scaled_sum + 4 * t as i32;
            a.vpmulld(FIRST[t], FIRST[t], scales)?;
            a.vpaddd(SECOND[t], SECOND[t], FIRST[t])?;
            a.vfnmadd231ps(F32_SUMS[t], mins, dword_bcst(x))?;
        }
        // On to the second group: its tile group, the runs' high nibbles
        // (the shift toggles between 0 and 4, so it is 0 again after the
        // pair).
        a.add(r10, g.group - went)?;
        a.vpsrld(scales, TOP_BITS, 26)?;
        a.vpxord(HALF_SHIFT, HALF_SHIFT, scales)?;
        a.add(eax, 2)?;
        a.cmp(eax, 4)
    });
    jback!(ops, jb, group, group_top);
    // Back to the pair's start for `next_unit` (the one-token form's
    // groups are SINGLE_GROUP_BYTES apart, which `unit_r10_fixup` takes
    // into account the same way).
    iced(ops, |a| a.sub(r10, 2 * TGB));
}

/// Q5_K's fifth bits for the pair's chunks from `extra` bytes into its
/// runs of them: rotated so that the current group's bit of the first
/// chunk sits at bit 4 of each byte (the first group's bit i goes 4 up,
/// the second's is there already: rotated left by 4, then right by
/// `HALF_SHIFT`).
fn load_fifth_bits(a: &mut CodeAssembler, extra: i32) -> Result<(), IcedError> {
    a.vprold(Q5K_HIGH, zmmword_ptr(r9 + Q5K_HIGH_AT as i32 + extra), 4)?;
    a.vprorvd(Q5K_HIGH, Q5K_HIGH, HALF_SHIFT)
}

/// The end of a super-block: each token's integer sum `Σ sc·Σqx`
/// converted once, `f += float(s) · (d · d_x)` with the super-block's `d`
/// (in register `d`) and input scale (every group's slot holds it; r10 is
/// past the last group), the sums cleared for the next.
fn finish_super_block(ops: &mut Asm, tokens: usize, d: AsmRegisterZmm) {
    let g = tile_geometry(tokens);
    iced(ops, |a| {
        for t in 0..tokens {
            let x = r10 - g.group + g.scale + 4 * t as i32;
            a.vcvtdq2ps(SECOND[t], SECOND[t])?;
            a.vmulps(CHUNK_A, d, dword_bcst(x))?;
            a.vfmadd231ps(F32_SUMS[t], SECOND[t], CHUNK_A)?;
            a.vpxord(SECOND[t], SECOND[t], SECOND[t])?;
        }
        Ok(())
    });
}

/// Q6_K, one group (r9) for `tokens` (1 or 8) of the tile (r10), one half
/// after the other (eax 0, then 16): the half's sums start from the
/// tile's `−32 · Σx` of the half (rbp steps to the second's), a loop over
/// the 4 nibble runs (rbx 8 per run), their low nibbles for the first
/// half and their high ones for the second (shifted right by
/// `HALF_SHIFT`), the half's run of high bits rotated right by 2 after
/// each chunk; then the half's integer sums times its 8-bit scale into
/// the super-block's (`SECOND`).
fn q6_k_group_vnni(ops: &mut Asm, tokens: usize) {
    let half = ops.new_dynamic_label();
    let run = ops.new_dynamic_label();
    let chains = chains(tokens);
    let g = tile_geometry(tokens);
    // The pass of 8 steps r10 over the first half's chunks itself; the
    // one-token form has by the end of each half.
    let half_chunks = 4 * g.chunk;
    dynasm!(ops ; .arch x64 ; xor eax, eax ; xor ebp, ebp);
    iced(ops, |a| a.vpxord(HALF_SHIFT, HALF_SHIFT, HALF_SHIFT));
    let half_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>half);
    iced(ops, |a| {
        for (t, sums) in FIRST[..tokens].iter().enumerate() {
            let x = r10 + rbp + g.half_starts + 4 * t as i32;
            a.vpbroadcastd(*sums, dword_ptr(x))?;
        }
        for sums in &FIRST[tokens.min(chains)..chains] {
            a.vpxord(*sums, *sums, *sums)?;
        }
        if tokens == 1 {
            // The high-bit runs come after the nibble runs: loaded first,
            // they took the stream out of address order, which the
            // hardware's prefetchers followed poorly (24.7 GB/s a thread;
            // 29-33 with the first two nibble lines touched first, as the
            // plain read). The pass of 8 prefetches its units itself.
            for n in 0..2 {
                a.prefetcht0(byte_ptr(r9 + (Q6K_NIBBLES_AT + n * RUN_BYTES) as i32))?;
            }
        }
        // Chunk n's field at bits 2n..2n+1 of each byte goes to bits 4..5:
        // rotated left by 4 first, then right by 2 per chunk.
        a.vprold(HIGH_A, zmmword_ptr(r9 + rax * 4 + Q6K_HIGH_AT as i32), 4)?;
        a.xor(ebx, ebx)
    });
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>run);
    iced(ops, |a| {
        for c in 0..chains {
            let w = (c * RUN_BYTES) as i32;
            a.vmovdqu32(
                NIBBLES,
                zmmword_ptr(r9 + rbx * 8 + Q6K_NIBBLES_AT as i32 + w),
            )?;
            a.vpsrlvd(NIBBLES, NIBBLES, HALF_SHIFT)?;
            a.vpandd(CHUNK_A, HIGH_A, TOP_BITS)?;
            a.vpternlogd(CHUNK_A, NIBBLES, LOW_NIBBLES, OR_AND)?;
            for t in 0..tokens {
                let x = chunk_at(&g, tokens, c) + 4 * t as i32;
                a.vpdpbusd(FIRST[t + c], CHUNK_A, dword_bcst(x))?;
            }
            if tokens == 1 {
                a.vprord(HIGH_A, HIGH_A, 2)?;
            } else {
                // The same rotation in shifts: a rotate shares the
                // `vpdpbusd`s' two ports on Zen 4 (a pass of 8 is bound
                // by them), shifts and ORs go to the other two. The
                // chunk is free again once its products are issued.
                a.vpslld(CHUNK_A, HIGH_A, 30)?;
                a.vpsrld(HIGH_A, HIGH_A, 2)?;
                a.vpord(HIGH_A, HIGH_A, CHUNK_A)?;
            }
        }
        step_chunks(a, tokens, chains)?;
        a.add(ebx, 8 * chains as i32)?;
        a.cmp(ebx, 4 * 8)
    });
    jback!(ops, jb, run, top);
    iced(ops, |a| {
        join_chains(a, chains)?;
        // The half's 16 signed scales, 16 bytes after the first half's.
        a.vpmovsxbd(CHUNK_A, xmmword_ptr(r9 + rax))?;
        for t in 0..tokens {
            a.vpmulld(FIRST[t], FIRST[t], CHUNK_A)?;
            a.vpaddd(SECOND[t], SECOND[t], FIRST[t])?;
        }
        if tokens != 1 {
            a.add(r10, half_chunks)?;
        }
        // The second half's starts are `half_step` further into the tile
        // group, which r10 has gone 4 chunks into.
        a.add(rbp, g.half_step - half_chunks)?;
        a.add(eax, 16)?;
        // Its nibbles are the runs' high ones: a shift of 4 (eax / 4).
        a.mov(ebx, eax)?;
        a.shr(ebx, 2)?;
        a.vpbroadcastd(HALF_SHIFT, ebx)?;
        a.cmp(eax, 32)
    });
    jback!(ops, jb, half, half_top);
    // Back to the group's start for `next_unit` (the one-token form's
    // groups are SINGLE_GROUP_BYTES apart: `unit_r10_fixup`).
    let fixup = 2 * half_chunks + unit_r10_fixup(tokens, 1, 0);
    iced(ops, |a| a.sub(r10, fixup));
}

/// The VNNI kernel's loop over the row block, super-block by super-block
/// (its scales converted once), unit by unit (r15 counting), each unit in
/// the form of the call's token count: one (a decode step) or a pass of
/// 8, which alone prefetches. The forms share the loop.
fn passes_vnni(ops: &mut Asm, p: &GemmQuantParams) {
    let (header, _, units, _) = geometry(p.q);
    let super_block = ops.new_dynamic_label();
    let unit = ops.new_dynamic_label();
    let one_token = ops.new_dynamic_label();
    let unit_done = ops.new_dynamic_label();
    let super_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>super_block);
    // Once a super-block, for every group's scales (and Q4_K's mins).
    iced(ops, |a| match p.q {
        QuantType::Q4Kx16 | QuantType::Q5Kx16 => {
            a.vcvtph2ps(D, ymmword_ptr(r9))?;
            a.vcvtph2ps(DMIN, ymmword_ptr(r9 + Q4K_DMIN_AT as i32))
        }
        _ => a.vcvtph2ps(Q6K_D, ymmword_ptr(r9)),
    });
    dynasm!(ops
        ; .arch x64
        ; add r9, header
        ; mov r15d, units
    );
    let unit_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>unit);
    cmp_imm8(ops, reg::R13, 1);
    dynasm!(ops ; .arch x64 ; je =>one_token);
    // The pass of 8 alone prefetches: one token's stream, read once,
    // reached 22-23 GB/s a thread with them and 25-34 without (the
    // hardware's prefetchers follow it alone; prefetching 0.5-4 KiB ahead
    // into L1 gained nothing either).
    iced(ops, |a| prefetch_unit(a, p, Some(rbx)));
    for tokens in [TOKENS, 1] {
        if tokens == 1 {
            dynasm!(ops ; .arch x64 ; =>one_token);
        }
        match p.q {
            QuantType::Q4Kx16 | QuantType::Q5Kx16 => k_pair_vnni(ops, p.q, tokens),
            _ => q6_k_group_vnni(ops, tokens),
        }
        if tokens != 1 {
            dynasm!(ops ; .arch x64 ; jmp =>unit_done);
        }
    }
    dynasm!(ops ; .arch x64 ; =>unit_done);
    next_unit_in_super_block(ops, p.q, reg::R15, (unit, unit_top));
    let d = if p.q.has_k_mins() { D } else { Q6K_D };
    let one_token_end = ops.new_dynamic_label();
    let ended = ops.new_dynamic_label();
    cmp_imm8(ops, reg::R13, 1);
    dynasm!(ops ; .arch x64 ; je =>one_token_end);
    finish_super_block(ops, TOKENS, d);
    dynasm!(ops ; .arch x64 ; jmp =>ended ; =>one_token_end);
    finish_super_block(ops, 1, d);
    dynasm!(ops ; .arch x64 ; =>ended ; cmp r10, r11);
    jback!(ops, jb, super_block, super_top);
}

/// The end of a unit: r9 and r10 to the next unit of the block and of the
/// tile, back to `unit` while `count` (a 32-bit register) has units left
/// in the super-block, then to `super_block` while the tile has one.
pub(super) fn next_unit(
    ops: &mut Asm,
    q: QuantType,
    count: u8,
    unit: (DynamicLabel, AssemblyOffset),
    (super_block, super_top): (DynamicLabel, AssemblyOffset),
) {
    next_unit_in_super_block(ops, q, count, unit);
    dynasm!(ops ; .arch x64 ; cmp r10, r11);
    jback!(ops, jb, super_block, super_top);
}

/// [`next_unit`] without the jump to the next super-block.
fn next_unit_in_super_block(
    ops: &mut Asm,
    q: QuantType,
    count: u8,
    (unit, unit_top): (DynamicLabel, AssemblyOffset),
) {
    let (_, unit_bytes, _, unit_groups) = geometry(q);
    dynasm!(ops
        ; .arch x64
        ; add r9, unit_bytes
        ; add r10, TGB * unit_groups as i32
        ; dec Rd(count)
    );
    jback!(ops, jne, unit, unit_top);
}

fn emit_vnni(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let pass = ops.new_dynamic_label();
    token_call_frame(&mut ops, p.q, TILE_GROUP_BYTES, done);
    // One token: the input is the one-token tile, whose groups end at
    // x + K / 32 · 64 (r9 holds K still).
    let eight = ops.new_dynamic_label();
    cmp_imm8(&mut ops, reg::R13, 1);
    dynasm!(ops
        ; .arch x64
        ; jne BYTE =>eight
        ; lea r11, [rsi + r9 * 2]
        ; =>eight
    );
    iced(&mut ops, |a| {
        a.mov(r10d, 0x0F0F_0F0F)?;
        a.vpbroadcastd(LOW_NIBBLES, r10d)?;
        // Q6_K's top bits' mask; Q5_K's fifth bits' (Q4_K's too: the
        // groups' shift of 4 is made from it).
        let mask = match p.q {
            QuantType::Q4Kx16 | QuantType::Q5Kx16 => 0x1010_1010,
            _ => 0x3030_3030,
        };
        a.mov(r10d, mask)?;
        a.vpbroadcastd(TOP_BITS, r10d)?;
        // The super-blocks' integer sums start at zero and
        // `finish_super_block` leaves them so; Q4_K's and Q5_K's pairs
        // leave their shift at zero likewise (Q6_K's groups clear it).
        for sums in SECOND {
            a.vpxord(sums, sums, sums)?;
        }
        a.vpxord(HALF_SHIFT, HALF_SHIFT, HALF_SHIFT)
    });
    let (block_top, _) = block_and_pass_top(&mut ops, block, pass);
    // Q6_K's halves use rbp (the super-block's bytes per row, which only
    // the next block's start needs) for their offset into the tile.
    let q6_k = p.q == QuantType::Q6Kx16;
    if q6_k {
        dynasm!(ops ; .arch x64 ; push rbp);
    }
    iced(&mut ops, |a| {
        // VEX xmm forms clear the whole register, in 4 bytes.
        for f in F32_SUMS_LOW {
            a.vpxor(f, xmm0, xmm0)?;
        }
        Ok(())
    });
    passes_vnni(&mut ops, p);
    super::gemm_q8_0x16::store_pass(&mut ops);
    if q6_k {
        dynasm!(ops ; .arch x64 ; pop rbp);
    }
    next_block_and_return(ops, ROWS, (block, block_top), done, name)
}
