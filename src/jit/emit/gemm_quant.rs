//! Integer GEMM for quantized weights (Q8_0, Q5_0, Q4_0) and up to 8
//! tokens at once: `y[t, r] = sum_g d_w[r,g] * d_x[t,g] * (v_w[r,g] ·
//! q_x[t,g])` for r in `r0..r1` and t < `ntok`. It serves every product of
//! several tokens with quantized weights: a verify step of speculative
//! decoding, a server's batch of sequences, a prefill chunk (8 tokens per
//! call, the caller loops over tiles while the rows stay in cache).
//!
//! The lanes of a vector are the tokens, not the columns. The input comes
//! as a token tile (`engine::q8_input`): per group of 32 columns, the 8
//! tokens' quants interleaved 4 at a time (32 bytes hold columns 4c..4c+3
//! of all 8 tokens), then their 8 f32 scales and 8 i32 sums. So a row's 4
//! weight bytes broadcast to all lanes and one multiply-add of 4 byte
//! pairs per lane gives 8 tokens' partial dot products, with no
//! horizontal sum anywhere: per 32 columns of a row, 8 broadcasts and 8
//! multiply-adds, whatever the token count up to 8. Per 4 rows and 32
//! columns that is about 130 instructions for 8 tokens against the GEMV's
//! (`gemv_quant`) 35 for one, and both read each weight from memory once:
//! a step over 8 tokens of the default model measured 2.3-2.6x a one-token
//! step with all logits, 1.5x with the last token's (`bench --m-curve`).
//!
//! Weights come in Q8_0's row-block layout (`model::quant_blocks`): Q8_0
//! matrices as they are stored, Q5_0 and Q4_0 panels unpacked into it
//! first (`unpack_quant`), once per panel for all of a prefill's tiles.
//! The bytes are unsigned values with an offset, which `q` names: Q8_0's
//! q + 128; an unpacked Q5_0 or Q4_0 panel holds its s + 128 too where
//! VNNI is used (one GEMM then serves every type), or its own v = s + 16
//! or s + 8 under AVX2.
//!
//! This file emits the AVX2 form: `vpmaddubsw` + `vpmaddwd` on Q5_0's and
//! Q4_0's small unsigned values (pairs at most 2 x 31 x 128), Q8_0
//! flipped back to q and through the sign trick as in the GEMV (255 x 127
//! pairs would saturate). With AVX-512 VNNI the same call is served by
//! `gemm_quant_vnni`, whose lanes are (row, token) pairs on zmm registers.
//!
//! Exactness: each row's group sum is an exact integer, converted,
//! multiplied by `d_w * d_x` and added with one FMA, group after group,
//! exactly as the GEMV does, so every token's result is bit-identical to a
//! one-token step's (greedy speculation and batched serving then reproduce
//! plain decoding).
//!
//! Weight bytes are broadcast straight from the row block, except Q8_0
//! under AVX2, flipped back to q (4 rows x 32) into the red zone below rsp
//! (128 bytes, which a leaf function may use without moving rsp) for the
//! sign trick. Rows: r0 a multiple of 4, the last block may be partial
//! (padding rows are zeros; only valid rows are stored).
//!
//! Signature `fn(w, x_tile, y, r0, r1, k, ldy, ntok)`: y points at token
//! 0's row, token t's output at `y + t*ldy`.
//!
//! Registers: rdi=W, rsi=x tile, rdx=y, rcx=r, r8=r1, r9=K on entry, then
//! the W group pointer; r10 the tile group pointer, r11 its end, rbx=K,
//! rbp=bytes of W per row of a block, r12=ldy in bytes, r13=ntok, r14 the
//! output pointer, rax the chunk offset. ymm0..3 the rows' f32 sums, ymm4..7
//! the rows' group sums in i32, ymm8 x, ymm9 a broadcast weight, ymm10..11
//! temporaries, ymm12 16-bit ones, ymm14 bytes of 0x80 (Q8_0).

use super::gemv_quant::{block_pointer, block_stride};
use super::{
    Asm, broadcast_const, count_mask, lane_index, new_asm, next_block_and_return, reg,
    save_callee_saved,
};
use crate::jback;
use crate::model::quant_blocks::{BLOCK_ROWS, GROUP_COLS, PAYLOADS_AT, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemmQuantParams {
    /// Whose offset the weights' bytes (Q8_0's layout) carry: Q8_0's 128,
    /// Q5_0's 16 or Q4_0's 8 (see the module's doc).
    pub q: QuantType,
    /// Products with AVX-512 VNNI's `vpdpbusd` on zmm registers
    /// (`gemm_quant_vnni`) rather than AVX2's `vpmaddubsw` + `vpmaddwd`.
    pub vnni: bool,
    /// Bytes ahead of each group to prefetch (0: none), as the GEMV.
    pub prefetch: usize,
}

pub const ROWS: usize = BLOCK_ROWS;
/// Tokens per call: the 8 i32 lanes of a ymm register.
pub const TOKENS: usize = 8;
/// Where a tile group's scales and sums start, and its size.
pub const TILE_SCALES_AT: usize = TOKENS * GROUP_COLS;
pub const TILE_SUMS_AT: usize = TILE_SCALES_AT + TOKENS * 4;
pub const TILE_GROUP_BYTES: usize = TILE_SUMS_AT + TOKENS * 4;

const X: u8 = 8;
const B: u8 = 9;
const T: u8 = 10;
const TEMP2: u8 = 11;
const ONES: u8 = 12;
const SIGN_BITS: u8 = 14;

fn acc_f32(row: usize) -> u8 {
    row as u8
}

fn acc_i32(row: usize) -> u8 {
    (4 + row) as u8
}

/// Q8_0 under AVX2: q itself in the red zone, for the sign trick.
fn sign_trick(p: &GemmQuantParams) -> bool {
    p.q == QuantType::Q8_0
}

/// Stack offsets of the 7th and 8th arguments after the 6 callee-saved
/// pushes and the return address.
const LDY_AT: i32 = 56;
const NTOK_AT: i32 = 64;

/// The red zone: 128 bytes below rsp, 32 per row of unpacked weights.
const SCRATCH: i8 = -128;

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

/// The offset the weights' unsigned values carry, as a shift of x's sum
/// (16 = 1 << 4 for Q5_0, ...); none for Q8_0 through the sign trick.
fn offset_shift(p: &GemmQuantParams) -> Option<i8> {
    // AVX2's Q8_0 products are of q itself (the sign trick).
    (p.q != QuantType::Q8_0).then_some(p.q.stored_offset_shift() as i8)
}

/// Bytes of one token tile for rows of `k` values.
pub fn tile_bytes(k: usize) -> usize {
    k / GROUP_COLS * TILE_GROUP_BYTES
}

/// Row `row`'s 4 weight bytes at chunk offset rax (+ `u` chunks) times x
/// (ymm8), added into its i32 group sums.
fn chunk_products(ops: &mut Asm, p: &GemmQuantParams, row: usize, u: i8) {
    let acc = acc_i32(row);
    if sign_trick(p) {
        let at = SCRATCH + 32 * row as i8 + 4 * u;
        dynasm!(ops
            ; .arch x64
            ; vpbroadcastd Ry(B), [BYTE rsp + rax + at]
            ; vpabsb Ry(TEMP2), Ry(B)
            ; vpsignb Ry(T), Ry(X), Ry(B)
            ; vpmaddubsw Ry(T), Ry(TEMP2), Ry(T)
            ; vpmaddwd Ry(T), Ry(T), Ry(ONES)
            ; vpaddd Ry(acc), Ry(acc), Ry(T)
        );
        return;
    }
    // Broadcast straight from the row block. (Q8_0 through the red zone
    // took 36.9 ms for an 8-token step, 33.9 ms broadcasting from the
    // block and flipping each dword's top bits, before Q8_0 was stored
    // plus 128; stores followed by loads of parts of them cost.)
    let at = (PAYLOADS_AT + row * GROUP_COLS) as i8 + 4 * u;
    dynasm!(ops
        ; .arch x64
        ; vpbroadcastd Ry(B), [BYTE r9 + rax + at]
        ; vpmaddubsw Ry(T), Ry(B), Ry(X)
        ; vpmaddwd Ry(T), Ry(T), Ry(ONES)
        ; vpaddd Ry(acc), Ry(acc), Ry(T)
    );
}

/// The start of a kernel `fn(w, x, y, r0, r1, k, ldy, ntok)` over weights
/// in Q8_0's row-block layout and an input of `group_bytes` per 32
/// columns (this GEMM, and `gemv_quant_few`): r12 = ldy in bytes, r13 =
/// ntok, rbx = K, rbp = the bytes of W per row of a block, r11 = the end
/// of the input's groups; jumps to `done` when there are no rows.
pub(super) fn token_call_frame(ops: &mut Asm, group_bytes: usize, done: dynasmrt::DynamicLabel) {
    dynasm!(ops
        ; .arch x64
        ; mov r12, [rsp + LDY_AT]
        ; shl r12, 2
        ; mov r13, [rsp + NTOK_AT]
    );
    // Q8_0's layout whatever the values' offset.
    block_stride(ops, QuantType::Q8_0);
    dynasm!(ops
        ; .arch x64
        ; mov r11, r9
        ; shr r11, 5
        ; imul r11, r11, group_bytes as i32
        ; add r11, rsi
        ; cmp rcx, r8
        ; jae =>done
    );
}

/// Prefetches the group `prefetch` bytes ahead of r9 (none for 0): a group
/// of 4 rows of Q8_0's layout is 136 bytes, two lines. With one line, an
/// 8-token tile over a 262,144 x 640 Q8_0 matrix from memory took
/// 16.9-19.2 ns per group on one thread, with two 13.0-15.1 (Xeon, three
/// alternating runs).
pub(super) fn prefetch_group(ops: &mut Asm, prefetch: usize) {
    if prefetch > 0 {
        dynasm!(ops
            ; .arch x64
            ; prefetcht0 [r9 + prefetch as i32]
            ; prefetcht0 [r9 + (prefetch + 64) as i32]
        );
    }
}

/// Assembles the instructions `build` adds with iced-x86's assembler
/// (dynasm 5.1 has no EVEX) and appends their bytes. Only position-free
/// instructions (no branches, no rip-relative operands) go this way.
pub(super) fn iced(ops: &mut Asm, build: impl FnOnce(&mut CodeAssembler) -> Result<(), IcedError>) {
    let mut a = CodeAssembler::new(64).expect("64-bit assembler");
    build(&mut a).expect("an instruction iced-x86 encodes");
    let bytes = a.assemble(0).expect("position-free instructions");
    ops.extend(bytes);
}

/// Emits the kernel `extern "sysv64" fn(w, x_tile, y, r0, r1, k, ldy, ntok)`.
pub fn emit(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    if p.q == QuantType::Q8_0x16 {
        return super::gemm_q8_0x16::emit(p, name);
    }
    if p.vnni {
        return super::gemm_quant_vnni::emit(p, name);
    }
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    let chunk = ops.new_dynamic_label();
    broadcast_const(&mut ops, ONES, 0x0001_0001);
    if sign_trick(p) {
        broadcast_const(&mut ops, SIGN_BITS, 0x8080_8080);
    }
    token_call_frame(&mut ops, TILE_GROUP_BYTES, done);
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block);
    block_pointer(&mut ops);
    dynasm!(ops ; .arch x64 ; mov r10, rsi);
    for row in 0..ROWS {
        let f = acc_f32(row);
        dynasm!(ops ; .arch x64 ; vxorps Ry(f), Ry(f), Ry(f));
    }
    let group_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    prefetch_group(&mut ops, p.prefetch);
    if sign_trick(p) {
        // The 4 rows' q, for the sign trick, into the red zone.
        for row in 0..ROWS {
            let at = (PAYLOADS_AT + row * GROUP_COLS) as i8;
            let to = SCRATCH + 32 * row as i8;
            dynasm!(ops
                ; .arch x64
                ; vpxor Ry(B), Ry(SIGN_BITS), [BYTE r9 + at]
                ; vmovdqu [BYTE rsp + to], Ry(B)
            );
        }
    }
    for row in 0..ROWS {
        let a = acc_i32(row);
        dynasm!(ops ; .arch x64 ; vpxor Ry(a), Ry(a), Ry(a));
    }
    dynasm!(ops ; .arch x64 ; xor eax, eax);
    // Two chunks of 4 columns per pass, 4 passes per group.
    let chunk_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>chunk);
    for u in 0..2 {
        dynasm!(ops ; .arch x64 ; vmovdqu Ry(X), [BYTE r10 + rax * 8 + 32 * u]);
        for row in 0..ROWS {
            chunk_products(&mut ops, p, row, u);
        }
    }
    dynasm!(ops
        ; .arch x64
        ; add eax, BYTE 8
        ; cmp eax, GROUP_COLS as i32
    );
    jback!(ops, jb, chunk, chunk_top);
    // Whole group sums: the offset off, converted, times d_w * d_x.
    if let Some(shift) = offset_shift(p) {
        dynasm!(ops
            ; .arch x64
            ; vmovdqu Ry(X), [r10 + TILE_SUMS_AT as i32]
            ; vpslld Ry(X), Ry(X), shift
        );
    }
    dynasm!(ops ; .arch x64 ; vmovups Ry(B), [r10 + TILE_SCALES_AT as i32]);
    for row in 0..ROWS {
        let (a, f) = (acc_i32(row), acc_f32(row));
        if offset_shift(p).is_some() {
            dynasm!(ops ; .arch x64 ; vpsubd Ry(a), Ry(a), Ry(X));
        }
        dynasm!(ops
            ; .arch x64
            ; vcvtdq2ps Ry(a), Ry(a)
            ; vpbroadcastw Rx(T), [BYTE r9 + 2 * row as i8]
            ; vcvtph2ps Ry(T), Rx(T)
            ; vmulps Ry(T), Ry(T), Ry(B)
            ; vfmadd231ps Ry(f), Ry(a), Ry(T)
        );
    }
    dynasm!(ops
        ; .arch x64
        ; add r9, QuantType::Q8_0.group_bytes() as i32
        ; add r10, TILE_GROUP_BYTES as i32
        ; cmp r10, r11
    );
    jback!(ops, jb, group, group_top);
    store_tokens(&mut ops);
    next_block_and_return(ops, ROWS, (block, block_top), done, name)
}

/// Stores the block's 4 rows x 8 tokens (ymm0..3, lanes = tokens) as
/// each token's 4 row values at `y + t*ldy + r`: a 4 x 4 transpose in each
/// 128-bit half, the tokens in order into the red zone (the unpacked
/// weights are dead by now), then one masked store per token that exists,
/// of the rows that exist. Clobbers r9, r15, rax and ymm4..11.
fn store_tokens(ops: &mut Asm) {
    dynasm!(ops
        ; .arch x64
        ; vunpcklps ymm8, ymm0, ymm1
        ; vunpckhps ymm9, ymm0, ymm1
        ; vunpcklps ymm10, ymm2, ymm3
        ; vunpckhps ymm11, ymm2, ymm3
        // Token t in the low half of ymm(t), token t + 4 in its high half.
        ; vunpcklpd ymm0, ymm8, ymm10
        ; vunpckhpd ymm1, ymm8, ymm10
        ; vunpcklpd ymm2, ymm9, ymm11
        ; vunpckhpd ymm3, ymm9, ymm11
        ; vperm2f128 ymm4, ymm0, ymm1, 0x20
        ; vperm2f128 ymm5, ymm2, ymm3, 0x20
        ; vperm2f128 ymm6, ymm0, ymm1, 0x31
        ; vperm2f128 ymm7, ymm2, ymm3, 0x31
        ; vmovups [BYTE rsp - 128], ymm4
        ; vmovups [BYTE rsp - 96], ymm5
        ; vmovups [BYTE rsp - 64], ymm6
        ; vmovups [BYTE rsp - 32], ymm7
    );
    store_red_zone_tokens(ops, -128);
}

/// Stores the block's rows of each of the ntok (r13) tokens, 4 f32 per
/// token one after another from `rsp + first` (the red zone), to `y +
/// t*ldy + r` (rdx = y, rcx = r, r12 = ldy in bytes): one masked store per
/// token of the rows that exist (`r8 - rcx`). Clobbers r9, r14, r15, rax,
/// ymm8..10.
pub(super) fn store_red_zone_tokens(ops: &mut Asm, first: i8) {
    let tokens = ops.new_dynamic_label();
    lane_index(ops, 9);
    dynasm!(ops
        ; .arch x64
        ; mov rax, r8
        ; sub rax, rcx
    );
    count_mask(ops, 8, 9, reg::RAX);
    dynasm!(ops
        ; .arch x64
        ; lea r14, [rdx + rcx * 4]
        ; lea r15, [BYTE rsp + first]
        ; mov r9, r13
    );
    let top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>tokens
        ; vmovups xmm10, [r15]
        ; vmaskmovps [r14], xmm8, xmm10
        ; add r15, BYTE 16
        ; add r14, r12
        ; dec r9
    );
    jback!(ops, jnz, tokens, top);
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
