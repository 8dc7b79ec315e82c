//! Integer GEMV over up to 4 tokens at once, for the small steps of
//! batched serving and speculative decoding: `y[t, r] = sum_g d_w[r,g] *
//! d_x[t,g] * (v_w[r,g] · q_x[t,g])` for r in `r0..r1` and t < `ntok` ≤ 4,
//! weights in Q8_0's row-block layout with Q8_0's offset (a Q8_0 matrix,
//! or a Q5_0/Q4_0 panel unpacked for the GEMM, `unpack_quant`), AVX-512
//! VNNI only.
//!
//! Why a kernel beside the GEMM (`gemm_quant`): the GEMM's lanes are 8
//! tokens, and it costs the same for 2 of them as for 8, about 110
//! instructions per 4 rows x 32 columns, which made a step over 2 tokens
//! cost 1.35-1.5x a one-token step while the weights stream no slower.
//! Here, as in the GEMV (`gemv_quant`), the lanes are columns: a group's 4
//! rows are loaded once and each token costs a load of its 32 quants and 4
//! `vpdpbusd`; two tokens share the fold of the row sums, the offset's
//! correction, the conversion and the scaling, one token in each 128-bit
//! half. About 45 instructions per group for 2 tokens, 80 for 4.
//!
//! Exactness: each token's row group sums are the GEMV's integers, folded
//! the same way and scaled by `d_w * d_x` with one FMA per group, group
//! after group, so every result is bit-identical to a one-token step's.
//!
//! Input (`engine::q8_input`, the "few-token" layout), per 32-column
//! group: the 4 tokens' quants (32 bytes each, zeros past the last), then
//! per pair of tokens (2p, 2p + 1) their block sums as 8 i32 (4 copies
//! each, the order of the rows' lanes) and their scales as 8 f32 likewise.
//!
//! Signature `fn(w, x, y, r0, r1, k, ldy, ntok)`: y points at token 0's
//! row, token t's output at `y + t*ldy`. r0 a multiple of 4; the last
//! block may be partial (padding rows are zeros; only valid rows are
//! stored).
//!
//! Registers: rdi=W, rsi=x, rdx=y, rcx=r, r8=r1, r9=K on entry, then the W
//! group pointer; r10 the x group pointer, r11 its end, rbx=K, rbp=bytes of
//! W per row of a block, r12=ldy in bytes, r13=ntok, r14/r15 the store's
//! pointers, rax a scratch. ymm0..3 the group's 4 rows, ymm4 a token's
//! quants, ymm5..12 two tokens' row products, ymm13 tokens 0 and 1's
//! sums (f32, token 0 in the low half), ymm14 tokens 2 and 3's, ymm15 the
//! rows' scales (twice).

use super::gemm_quant::{store_red_zone_tokens, token_call_frame, vpdpbusd};
use super::gemv_quant::block_pointer;
use super::{Asm, finish, new_asm, restore_callee_saved_and_return, save_callee_saved};
use crate::jback;
use crate::model::quant_blocks::{BLOCK_ROWS, GROUP_COLS, PAYLOADS_AT, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemvQuantFewParams {
    /// Bytes ahead of each group to prefetch (0: none), as the GEMV.
    pub prefetch: usize,
}

pub const ROWS: usize = BLOCK_ROWS;
/// Most tokens per call.
pub const TOKENS: usize = 4;
/// Where a group's pair p (tokens 2p, 2p + 1) keeps its sums; their
/// scales follow at `+ 32`.
pub const PAIRS_AT: usize = TOKENS * GROUP_COLS;
pub const PAIR_BYTES: usize = 64;
pub const GROUP_BYTES: usize = PAIRS_AT + TOKENS / 2 * PAIR_BYTES;

const X: u8 = 4;
const ACC: [u8; 2] = [13, 14];
const W_SCALES: u8 = 15;

/// The product register of token `u` (0 or 1) of a pair, row `row`.
fn product(u: usize, row: usize) -> u8 {
    (5 + 4 * u + row) as u8
}

/// Bytes of the few-token input for rows of `k` values.
pub fn input_bytes(k: usize) -> usize {
    k / GROUP_COLS * GROUP_BYTES
}

/// Tokens 2p and 2p + 1 of the group at r10: their products with the 4
/// rows, folded to one i32 per row and token, corrected, scaled and added
/// into `ACC[p]`.
fn pair(ops: &mut Asm, p: usize) {
    for u in 0..2 {
        let t = 2 * p + u;
        dynasm!(ops ; .arch x64 ; vmovdqu Ry(X), [BYTE r10 + (GROUP_COLS * t) as i8]);
        for row in 0..ROWS {
            let dst = product(u, row);
            dynasm!(ops ; .arch x64 ; vpxor Ry(dst), Ry(dst), Ry(dst));
            vpdpbusd(ops, dst, row as u8, X);
        }
    }
    let sums_at = (PAIRS_AT + PAIR_BYTES * p) as i32;
    let (a, b) = (product(0, 0), product(1, 0));
    dynasm!(ops
        ; .arch x64
        // Per token, as the GEMV folds: [r0 r1 r2 r3 | r0 r1 r2 r3], each
        // half summing 4 of the 8 lanes.
        ; vphaddd Ry(a), Ry(a), Ry(product(0, 1))
        ; vphaddd Ry(product(0, 2)), Ry(product(0, 2)), Ry(product(0, 3))
        ; vphaddd Ry(a), Ry(a), Ry(product(0, 2))
        ; vphaddd Ry(b), Ry(b), Ry(product(1, 1))
        ; vphaddd Ry(product(1, 2)), Ry(product(1, 2)), Ry(product(1, 3))
        ; vphaddd Ry(b), Ry(b), Ry(product(1, 2))
        // The halves added in integers, token 2p low and 2p + 1 high.
        ; vinserti128 Ry(product(0, 1)), Ry(a), Rx(b), 1
        ; vperm2f128 Ry(product(0, 2)), Ry(a), Ry(b), 0x31
        ; vpaddd Ry(a), Ry(product(0, 1)), Ry(product(0, 2))
        // Q8_0's offset of 128 times each token's sum off.
        ; vmovdqu Ry(b), [r10 + sums_at]
        ; vpslld Ry(b), Ry(b), QuantType::Q8_0.stored_offset_shift() as i8
        ; vpsubd Ry(a), Ry(a), Ry(b)
        ; vcvtdq2ps Ry(a), Ry(a)
        ; vmulps Ry(b), Ry(W_SCALES), [r10 + sums_at + 32]
        ; vfmadd231ps Ry(ACC[p]), Ry(a), Ry(b)
    );
}

/// Emits the kernel `extern "sysv64" fn(w, x, y, r0, r1, k, ldy, ntok)`.
pub fn emit(p: &GemvQuantFewParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    let one_pair = ops.new_dynamic_label();
    token_call_frame(&mut ops, GROUP_BYTES, done);
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block);
    block_pointer(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; mov r10, rsi
        ; vxorps Ry(ACC[0]), Ry(ACC[0]), Ry(ACC[0])
        ; vxorps Ry(ACC[1]), Ry(ACC[1]), Ry(ACC[1])
    );
    let group_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    if p.prefetch > 0 {
        dynasm!(ops
            ; .arch x64
            ; prefetcht0 [r9 + p.prefetch as i32]
            ; prefetcht0 [r9 + (p.prefetch + 64) as i32]
        );
    }
    dynasm!(ops
        ; .arch x64
        // The 4 rows' f16 scales, twice: one copy per token of a pair.
        ; vpbroadcastq Rx(W_SCALES), [r9]
        ; vcvtph2ps Ry(W_SCALES), Rx(W_SCALES)
    );
    for row in 0..ROWS {
        let at = (PAYLOADS_AT + row * GROUP_COLS) as i8;
        dynasm!(ops ; .arch x64 ; vmovdqu Ry(row as u8), [BYTE r9 + at]);
    }
    pair(&mut ops, 0);
    // Tokens 2 and 3 only when there are more than 2.
    dynasm!(ops
        ; .arch x64
        ; cmp r13, BYTE 2
        ; jbe =>one_pair
    );
    pair(&mut ops, 1);
    dynasm!(ops
        ; .arch x64
        ; =>one_pair
        ; add r9, QuantType::Q8_0.group_bytes() as i32
        ; add r10, GROUP_BYTES as i32
        ; cmp r10, r11
    );
    jback!(ops, jb, group, group_top);
    // The block's rows, token after token, into the red zone (token t's 4
    // rows at rsp - 64 + 16t), then one masked store per token of the rows
    // that exist.
    dynasm!(ops
        ; .arch x64
        ; vmovups [BYTE rsp - 64], Ry(ACC[0])
        ; vmovups [BYTE rsp - 32], Ry(ACC[1])
    );
    store_red_zone_tokens(&mut ops, -64);
    dynasm!(ops
        ; .arch x64
        ; add rcx, BYTE ROWS as i8
        ; cmp rcx, r8
    );
    jback!(ops, jb, block, block_top);
    dynasm!(ops ; .arch x64 ; =>done);
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}
