//! The integer GEMM under AVX2 over 16-row blocks ([`QuantType::Q8_0x16`]'s
//! layout), in two forms: Q8_0x16 itself, which also takes single tokens
//! (Q8_0's GEMV under AVX2 then), and Q5_0 or Q4_0 panels unpacked into
//! those blocks with their own offset (`unpack_quant`). The call, the token
//! tiles and the results are `gemm_q8_0x16`'s (its VNNI form), bit for bit.
//!
//! Why rows as lanes under AVX2 too: the 4-row GEMM this replaced put 8
//! tokens in a vector's lanes and paid for all 8 whatever the step's
//! count, so a step over 2 tokens cost about twice a one-token step (now
//! about 1.15x). Here a vector's 8 dword lanes are 8 rows: a chunk (4
//! columns) of 8 rows is one 32-byte load, shared by every token, and each
//! token costs its own products only: a broadcast of its 4 bytes,
//! `vpmaddubsw` + `vpmaddwd` and an add per 8 rows x 4 columns. So the
//! work grows with the tokens present, not with the tile's 8 slots. An
//! 8-token step stays bound by these products: AVX2 has no cheaper byte
//! dot product.
//!
//! Q8_0x16's stored bytes are q + 128 (VNNI's unsigned operand);
//! `vpmaddubsw` on them would saturate (255 x 127 pairs), so each chunk is
//! flipped back to q once (`vpxor` 0x80) and multiplied through the sign
//! trick, `|q| * (x * sign q)`. An unpacked panel's values (s + 16, s + 8)
//! multiply as they are (at most 2 x 31 x 128 a pair, so two chunks'
//! pair sums add up in 16 bits before one `vpmaddwd`) and lose their
//! offset from the group sum, `sum - (sum_x << shift)`: 3 multiplications
//! per token per 2 chunks instead of 4 (and 6 with the sign trick). A
//! prompt's steps, whose products are mostly Q5_0 in the default model,
//! need that: through the sign trick a prefill was slower than with the
//! 4-row GEMM before, with the panel's own offset about as fast (figures
//! in `docs/performance.md`). Either way the group sum is the exact
//! integer of VNNI's form, scaled as there: `f += float(sum) * (d_w *
//! d_x)`.
//!
//! A pass takes 2 tokens over both halves of the block (rows 0..7 and
//! 8..15 of each 64-byte chunk). Q8_0x16's odd last token, or a call of
//! one token (a decode step), takes a pass of 1; a panel's (its one-token
//! steps go through Q5_0's GEMV) rides a pass of 2 with the tile's zeros.
//! Each pass reads the block's 16 rows x K (10 KiB for K = 640) and the
//! next one reads them again from L1 or L2.
//!
//! Rows: r0 a multiple of 16; the last block may be partial (its padding
//! rows are zeros). Stores are masked to the rows that exist.
//!
//! Registers: ymm0..3 the group sums in i32 of (token, half) = (t, h) at
//! 2t + h, ymm4..7 their f32 sums at 4 + 2t + h, ymm8/9 the chunk's q of
//! each half (a panel's two chunks of a half), ymm10/11 its |q| (the two
//! chunks' products), ymm12 a token's broadcast bytes, ymm13 a temporary,
//! ymm14 16-bit ones, ymm15 bytes of 0x80 (a panel: the second chunk's
//! token bytes). General registers as
//! `gemm_q8_0x16`: `gemm_quant`'s frame (`token_call_frame`), r15 the
//! block's first group, r14 the block's outputs, rax the pass's first
//! token, rbx the chunk's offset in the tile (4 x 8 tokens per chunk; the
//! weights' is twice that).

use super::gemm_quant::{
    GemmQuantParams, TILE_GROUP_BYTES, TILE_SCALES_AT, TILE_SUMS_AT, block_and_pass_top,
    next_group, token_call_frame,
};
use super::{
    Asm, broadcast_const, cmp_imm8, count_mask, lane_index, new_asm, next_block_and_return, reg,
    save_callee_saved,
};
use crate::jback;
use crate::model::quant_blocks::{CHUNK_BYTES, GROUP_COLS, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

const Q: QuantType = QuantType::Q8_0x16;
/// Rows per block, two vectors' worth.
pub const ROWS: usize = 16;
const HALF_ROWS: usize = 8;
/// Tokens of a full pass.
const PASS_TOKENS: usize = 2;
/// Bytes of a chunk of one token in the tile (4 columns of 8 tokens).
const TILE_CHUNK_BYTES: i32 = (CHUNK_BYTES * super::gemm_quant::TOKENS) as i32;
/// Where the first chunk of a group starts (after the 16 f16 scales).
const CHUNKS_AT: i32 = (ROWS * 2) as i32;

const SIGNED: [u8; 2] = [8, 9];
const MAGNITUDE: [u8; 2] = [10, 11];
const X: u8 = 12;
const TEMP: u8 = 13;
const ONES: u8 = 14;
const SIGN_BITS: u8 = 15;

fn group_sum(t: usize, h: usize) -> u8 {
    (2 * t + h) as u8
}

fn f32_sum(t: usize, h: usize) -> u8 {
    (4 + 2 * t + h) as u8
}

/// Whether the weights go through the sign trick: Q8_0x16's q + 128 do;
/// an unpacked Q5_0 or Q4_0 panel's small unsigned values (s + 16, s + 8)
/// multiply as they are, their offset taken off each group sum as VNNI
/// takes Q8_0's (`sum - (sum_x << shift)`).
fn sign_trick(q: QuantType) -> bool {
    q == Q
}

/// One chunk (rbx) of Q8_0x16 for `tokens`: each half flipped back to q
/// and its |q| once, then per token the sign trick. Advances rbx.
fn sign_trick_chunk(ops: &mut Asm, tokens: usize) {
    for h in 0..2 {
        let at = (CHUNKS_AT as usize + h * HALF_ROWS * CHUNK_BYTES) as i8;
        dynasm!(ops
            ; .arch x64
            ; vpxor Ry(SIGNED[h]), Ry(SIGN_BITS), [BYTE r9 + rbx * 2 + at]
            ; vpabsb Ry(MAGNITUDE[h]), Ry(SIGNED[h])
        );
    }
    for t in 0..tokens {
        dynasm!(ops ; .arch x64 ; vpbroadcastd Ry(X), [BYTE r10 + rbx + 4 * t as i8]);
        for h in 0..2 {
            let s = group_sum(t, h);
            dynasm!(ops
                ; .arch x64
                ; vpsignb Ry(TEMP), Ry(X), Ry(SIGNED[h])
                ; vpmaddubsw Ry(TEMP), Ry(MAGNITUDE[h]), Ry(TEMP)
                ; vpmaddwd Ry(TEMP), Ry(TEMP), Ry(ONES)
                ; vpaddd Ry(s), Ry(s), Ry(TEMP)
            );
        }
    }
    dynasm!(ops
        ; .arch x64
        ; add ebx, BYTE TILE_CHUNK_BYTES as i8
        ; cmp ebx, (GROUP_COLS / CHUNK_BYTES) as i32 * TILE_CHUNK_BYTES
    );
}

/// Two chunks (rbx) of an unpacked panel for `tokens`, a half at a time:
/// the two chunks' 16-bit pair sums are added before one `vpmaddwd`, which
/// the small values allow (2 x 2 x 31 x 128 < 2^15), so a token costs 3
/// multiplications per 2 chunks instead of 4. Advances rbx.
fn small_values_chunks(ops: &mut Asm, tokens: usize) {
    let (first, second) = (MAGNITUDE[0], MAGNITUDE[1]);
    let other = SIGN_BITS;
    for h in 0..2 {
        // The next chunk is 64 bytes on: a 1-byte displacement but for the
        // second half's (128).
        let at = CHUNKS_AT + (h * HALF_ROWS * CHUNK_BYTES) as i32;
        let next = at + 2 * TILE_CHUNK_BYTES;
        dynasm!(ops ; .arch x64 ; vmovdqu Ry(SIGNED[0]), [BYTE r9 + rbx * 2 + at as i8]);
        if let Ok(next) = i8::try_from(next) {
            dynasm!(ops ; .arch x64 ; vmovdqu Ry(SIGNED[1]), [BYTE r9 + rbx * 2 + next]);
        } else {
            dynasm!(ops ; .arch x64 ; vmovdqu Ry(SIGNED[1]), [r9 + rbx * 2 + next]);
        }
        for t in 0..tokens {
            let s = group_sum(t, h);
            let x = 4 * t as i8;
            dynasm!(ops
                ; .arch x64
                ; vpbroadcastd Ry(X), [BYTE r10 + rbx + x]
                ; vpmaddubsw Ry(first), Ry(SIGNED[0]), Ry(X)
                ; vpbroadcastd Ry(other), [BYTE r10 + rbx + x + TILE_CHUNK_BYTES as i8]
                ; vpmaddubsw Ry(second), Ry(SIGNED[1]), Ry(other)
                ; vpaddw Ry(first), Ry(first), Ry(second)
                ; vpmaddwd Ry(first), Ry(first), Ry(ONES)
                ; vpaddd Ry(s), Ry(s), Ry(first)
            );
        }
    }
    dynasm!(ops
        ; .arch x64
        ; add ebx, BYTE 2 * TILE_CHUNK_BYTES as i8
        ; cmp ebx, (GROUP_COLS / CHUNK_BYTES) as i32 * TILE_CHUNK_BYTES
    );
}

/// One group of the pass: 16 rows x 32 columns (r9) against `tokens` (2
/// or 1) tokens of the tile group (r10), scaled into the f32 sums. The
/// chunks loop (rbx), one per round: straight-line, a 2-token step would
/// be about 900 bytes.
fn group_step(ops: &mut Asm, q: QuantType, prefetch: usize, tokens: usize) {
    let chunk = ops.new_dynamic_label();
    for t in 0..tokens {
        for h in 0..2 {
            let s = group_sum(t, h);
            dynasm!(ops ; .arch x64 ; vpxor Ry(s), Ry(s), Ry(s));
        }
    }
    if prefetch > 0 {
        // The group's 544 bytes ahead: 9 lines, from rbx (the chunks'
        // counter, free until the loop) 128 bytes into them, so that 4 of
        // the 9 take a 1-byte displacement (15 bytes fewer, which the
        // plan's budget needed).
        let base = prefetch as i32 + 128;
        dynasm!(ops ; .arch x64 ; lea rbx, [r9 + base]);
        for line in 0..Q.group_bytes().div_ceil(64) as i32 {
            let at = 64 * line - 128;
            match i8::try_from(at) {
                Ok(0) => dynasm!(ops ; .arch x64 ; prefetcht0 [rbx]),
                Ok(at) => dynasm!(ops ; .arch x64 ; prefetcht0 [BYTE rbx + at]),
                Err(_) => dynasm!(ops ; .arch x64 ; prefetcht0 [rbx + at]),
            }
        }
    }
    dynasm!(ops ; .arch x64 ; xor ebx, ebx);
    let chunk_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>chunk);
    if sign_trick(q) {
        sign_trick_chunk(ops, tokens);
    } else {
        small_values_chunks(ops, tokens);
    }
    jback!(ops, jb, chunk, chunk_top);
    // Scaling: the offset off (unpacked panels), the halves' 8 row scales,
    // each token's d_x, as VNNI's.
    let row_scales = SIGNED;
    let x_scale = MAGNITUDE[0];
    let product = MAGNITUDE[1];
    for (h, &scales) in row_scales.iter().enumerate() {
        dynasm!(ops ; .arch x64 ; vcvtph2ps Ry(scales), [BYTE r9 + (2 * HALF_ROWS * h) as i8]);
    }
    for t in 0..tokens {
        if !sign_trick(q) {
            let at = (TILE_SUMS_AT + 4 * t) as i32;
            dynasm!(ops
                ; .arch x64
                ; vpbroadcastd Ry(X), [r10 + at]
                ; vpslld Ry(X), Ry(X), q.stored_offset_shift() as i8
            );
            for h in 0..2 {
                let s = group_sum(t, h);
                dynasm!(ops ; .arch x64 ; vpsubd Ry(s), Ry(s), Ry(X));
            }
        }
        let at = (TILE_SCALES_AT + 4 * t) as i32;
        dynasm!(ops ; .arch x64 ; vpbroadcastd Ry(x_scale), [r10 + at]);
        for (h, &scales) in row_scales.iter().enumerate() {
            let (s, f) = (group_sum(t, h), f32_sum(t, h));
            dynasm!(ops
                ; .arch x64
                ; vcvtdq2ps Ry(s), Ry(s)
                ; vmulps Ry(product), Ry(scales), Ry(x_scale)
                ; vfmadd231ps Ry(f), Ry(s), Ry(product)
            );
        }
    }
}

/// Stores the pass's 2 tokens (from rax) at `y + t*ldy + r`, each half
/// masked to the rows that exist (`r8 - rcx`, less 8 for the second); a
/// second half without rows is not stored at all (`vmaskmovps` would not
/// write it, but its address may lie past y's end), nor a second token
/// past ntok (r13). Clobbers rbx, r9, r10 and ymm8..12.
fn store_pass(ops: &mut Asm) {
    let skip = ops.new_dynamic_label();
    // lane_index takes rax, the pass's first token: kept in rbx meanwhile.
    dynasm!(ops ; .arch x64 ; mov rbx, rax);
    lane_index(ops, 12);
    dynasm!(ops
        ; .arch x64
        ; mov rax, rbx
        ; mov r9, r8
        ; sub r9, rcx
    );
    count_mask(ops, 8, 12, reg::R9);
    dynasm!(ops ; .arch x64 ; sub r9, BYTE HALF_ROWS as i8);
    count_mask(ops, 9, 12, reg::R9);
    dynasm!(ops ; .arch x64 ; lea rbx, [rax + 1]);
    for h in 0..2 {
        let half_done = ops.new_dynamic_label();
        if h == 1 {
            dynasm!(ops
                ; .arch x64
                ; test r9, r9
                ; jle =>skip
            );
        }
        dynasm!(ops
            ; .arch x64
            ; mov r10, rax
            ; imul r10, r12
            ; add r10, r14
        );
        for t in 0..PASS_TOKENS {
            if t > 0 {
                dynasm!(ops
                    ; .arch x64
                    ; cmp rbx, r13
                    ; jae =>half_done
                    ; add r10, r12
                );
            }
            let mask = 8 + h as u8;
            let at = (4 * HALF_ROWS * h) as i8;
            dynasm!(ops ; .arch x64 ; vmaskmovps [BYTE r10 + at], Ry(mask), Ry(f32_sum(t, h)));
        }
        dynasm!(ops ; .arch x64 ; =>half_done);
    }
    dynasm!(ops ; .arch x64 ; =>skip);
}

/// Emits the kernel `extern "sysv64" fn(w, x_tile, y, r0, r1, k, ldy,
/// ntok)` (see `gemm_quant`) for Q8_0x16, or for Q5_0 or Q4_0 panels
/// unpacked into its 16-row blocks with their own offset.
pub fn emit(p: &GemmQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        !p.vnni && (p.q == Q || !p.q.is_q8_0()),
        "kernel {name}: the AVX2 16-row GEMM reads Q8_0x16, or Q5_0 or Q4_0 values in its blocks"
    );
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let pass = ops.new_dynamic_label();
    broadcast_const(&mut ops, ONES, 0x0001_0001);
    if sign_trick(p.q) {
        broadcast_const(&mut ops, SIGN_BITS, 0x8080_8080);
    }
    token_call_frame(&mut ops, QuantType::Q8_0x16, TILE_GROUP_BYTES, done);
    let (block_top, pass_top) = block_and_pass_top(&mut ops, block, pass);
    let single = ops.new_dynamic_label();
    // Q8_0x16 serves decode steps: a last odd token (and a call of one)
    // takes a pass of its own. An unpacked panel only serves steps of
    // several tokens (one token reads Q5_0 through its GEMV), so a lone
    // token rides a pass of 2 with the tile's zeros, stored alone: the
    // code of a 1-token pass would not fit the plan's budget beside.
    let pass_sizes: &[usize] = if sign_trick(p.q) {
        dynasm!(ops
            ; .arch x64
            ; mov rbx, r13
            ; sub rbx, rax
        );
        cmp_imm8(&mut ops, reg::RBX, PASS_TOKENS as i8);
        dynasm!(ops ; .arch x64 ; jb =>single);
        &[PASS_TOKENS, 1]
    } else {
        &[PASS_TOKENS]
    };
    let store = ops.new_dynamic_label();
    for &tokens in pass_sizes {
        if tokens == 1 {
            dynasm!(ops ; .arch x64 ; =>single);
        }
        let group = ops.new_dynamic_label();
        for t in 0..tokens {
            for h in 0..2 {
                let f = f32_sum(t, h);
                dynasm!(ops ; .arch x64 ; vxorps Ry(f), Ry(f), Ry(f));
            }
        }
        let group_top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>group);
        group_step(&mut ops, p.q, p.prefetch, tokens);
        next_group(&mut ops, QuantType::Q8_0x16, (group, group_top));
        if tokens == PASS_TOKENS && pass_sizes.len() > 1 {
            dynasm!(ops ; .arch x64 ; jmp =>store);
        }
    }
    // One store for both passes: a pass of 1 is the last, whose second
    // token (past ntok) is not stored, and the step of 2 then ends the
    // passes as well.
    dynasm!(ops ; .arch x64 ; =>store);
    store_pass(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; add rax, BYTE PASS_TOKENS as i8
        ; cmp rax, r13
    );
    jback!(ops, jb, pass, pass_top);
    next_block_and_return(ops, ROWS, (block, block_top), done, name)
}
