//! Unpacks Q5_0 or Q4_0 row blocks into Q8_0x16's 16-row blocks, the
//! layout the integer GEMM (`gemm_quant`) reads.
//!
//! Why: the GEMM multiplies each chunk of 4 columns of its rows by every
//! token of a tile. Q8_0's stored bytes are ready for it; Q5_0's and
//! Q4_0's had to be unpacked into bytes first, in every tile's pass, which
//! made their GEMM 1.6x Q8_0's per group (with the earlier 4-row layout).
//! Unpacked once per panel of rows, the unpacking is shared by every tile
//! of a prefill chunk (16 tiles for 126 tokens).
//!
//! `into` says which offset the bytes carry: Q8_0's (s + 128, Q8_0x16's
//! stored form, so that with VNNI one GEMM serves every type), or the
//! type's own (v = s + 16 or s + 8, small enough for AVX2's `vpmaddubsw`
//! without the sign trick Q8_0 needs). Either way a GEMM group sum is the
//! same exact integer as the GEMV's, so results stay bit-identical to
//! one-token steps.
//!
//! Signature `fn(w, out, k, r0, r1)`: rows r0..r1 of W (r0 a multiple of
//! 16; whole 4-row blocks, padding rows included) into `out`, which
//! receives the 16-row blocks one after another from r0's.
//!
//! Registers: rdi=W, rsi=out, rcx=row, r8=r1, r9 the W pointer (K on
//! entry, as `block_stride` wants), rbx=K, rbp=bytes of W per row of a
//! block, r10 the groups left in a block, rax the scales; ymm0..3 the rows'
//! bytes, ymm4..7 a pair's unpacking, then the rows' transposition, ymm8
//! and ymm9 the high bits' qword shifts (Q5_0), ymm11 bytes of 0xF0, ymm12
//! bytes of 0x10 (Q5_0), ymm13 bytes of 0x0F, ymm15 the bytes to add.

use super::gemv_quant::{
    PairRegs, block_pointer, block_stride, pair_at, pair_constants, unpack_pair,
};
use super::{Asm, broadcast_const, new_asm, next_block_and_return, reg, save_callee_saved};
use crate::jback;
use crate::model::quant_blocks::{BLOCK_ROWS, GROUP_COLS, QuantType};
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct UnpackQuantParams {
    /// The packed type (Q5_0 or Q4_0).
    pub q: QuantType,
    /// Whose offset the unpacked bytes carry: Q8_0's or `q`'s own.
    pub into: QuantType,
    /// Bytes ahead of each group to prefetch (0: none). The unpacking is
    /// where a small step's Q5_0 weights come from memory (the GEMM then
    /// reads the panel from L2), and like the GEMVs it outruns the
    /// hardware prefetcher.
    pub prefetch: usize,
}

/// A pair's first 16 values of each row (its last 16 in `REGS.last`).
const PAIR_FIRST: u8 = 4;
const OFFSET_CHANGE: u8 = 15;

/// What turns an unpacked byte (s plus `q`'s offset) into s plus
/// `into`'s offset.
fn offset_change(q: QuantType, into: QuantType) -> u8 {
    (1u8 << into.stored_offset_shift()) - (1u8 << q.stored_offset_shift())
}

/// Emits the kernel `extern "sysv64" fn(w, out, k, r0, r1)`.
pub fn emit(p: &UnpackQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        !p.q.is_q8_0() && (p.into == p.q || p.into == QuantType::Q8_0x16),
        "{name}: unpacks Q5_0 or Q4_0 into 16-row blocks, with their own offset or Q8_0's"
    );
    emit_into_16_rows(p, name)
}

/// The registers `unpack_pair` works with.
const REGS: PairRegs = PairRegs {
    last: 5,
    temp: 6,
    temp2: 7,
    low_nibbles: 13,
    high_nibbles: 11,
    bit4: 12,
    right_shifts: 8,
    left_shifts: 9,
};

/// Prefetches the source group `prefetch` bytes ahead of r9 (none for
/// 0): one line, two for a group over 64 bytes (Q5_0's 88).
fn prefetch_source(ops: &mut Asm, q: QuantType, prefetch: usize) {
    if prefetch > 0 {
        dynasm!(ops ; .arch x64 ; prefetcht0 [r9 + prefetch as i32]);
        if q.group_bytes() > 64 {
            dynasm!(ops ; .arch x64 ; prefetcht0 [r9 + (prefetch + 64) as i32]);
        }
    }
}

/// The constants: the offset's change (when there is one) and what
/// `unpack_pair` reads.
fn unpack_constants(ops: &mut Asm, q: QuantType, add: u8) {
    if add != 0 {
        broadcast_const(ops, OFFSET_CHANGE, u32::from_ne_bytes([add; 4]));
    }
    pair_constants(ops, q, REGS);
}

/// The unpacking into Q8_0x16's 16-row blocks: rows r0..r1, r0 a multiple of 16, into
/// `out` from r0's 16-row block on. Each 4-row block's group is unpacked
/// pair by pair, each pair's two vectors (both rows' first 16 values,
/// then their last 16) recombined into its rows (ymm0..3, `vperm2i128`),
/// transposed so that each 4 columns of the 4 rows
/// are 16 bytes side by side (`vpunpck*dq`, `vpunpck*qdq`: chunks c and
/// c + 4 in the halves of ymm c), and stored where its rows sit in the
/// 16-row block (16 bytes at `32 + 64c + 16 * (block % 4)`, its scales at
/// `8 * (block % 4)`). A last 16-row block's missing 4-row blocks are not
/// written: the caller zeroes them.
///
/// Registers: r13 = r0, r15 = the bytes of a 16-row block of the output
/// (K / 32 * 544), r11 the group's scales and r12 its chunks in the
/// output, r10 the groups left; the rest as above.
fn emit_into_16_rows(p: &UnpackQuantParams, name: &str) -> anyhow::Result<Vec<u8>> {
    let q = p.q;
    // The output's geometry; `p.into` only says which offset its bytes carry.
    let into = QuantType::Q8_0x16;
    let add = offset_change(q, p.into);
    let mut ops = new_asm();
    save_callee_saved(&mut ops);
    let done = ops.new_dynamic_label();
    let block = ops.new_dynamic_label();
    let group = ops.new_dynamic_label();
    unpack_constants(&mut ops, q, add);
    dynasm!(ops
        ; .arch x64
        ; mov r9, rdx
    );
    block_stride(&mut ops, q);
    dynasm!(ops
        ; .arch x64
        ; mov r13, rcx
        ; imul r15, rbx, (into.group_bytes() / GROUP_COLS) as i32
        ; cmp rcx, r8
        ; jae =>done
    );
    block_pointer(&mut ops);
    let block_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>block
        // The 16-row block's first group in the output, and where in it
        // this 4-row block's rows go.
        ; mov rax, rcx
        ; sub rax, r13
        ; shr rax, 4
        ; imul rax, r15
        ; add rax, rsi
        ; mov r10, rcx
        ; shr r10, 2
        ; and r10, 3
        ; lea r11, [rax + r10 * 8]
        ; lea r12, [r11 + r10 * 8]
        ; mov r10, rbx
        ; shr r10, 5
    );
    let group_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>group);
    prefetch_source(&mut ops, q, p.prefetch);
    dynasm!(ops
        ; .arch x64
        ; mov rax, [r9]
        ; mov [r11], rax
    );
    for pair in 0..BLOCK_ROWS / 2 {
        unpack_pair(&mut ops, q, PAIR_FIRST, (reg::R9, pair_at(q, pair)), REGS);
        let (first_row, second_row) = (2 * pair as u8, 2 * pair as u8 + 1);
        dynasm!(ops
            ; .arch x64
            ; vperm2i128 Ry(first_row), Ry(PAIR_FIRST), Ry(REGS.last), 0x20
            ; vperm2i128 Ry(second_row), Ry(PAIR_FIRST), Ry(REGS.last), 0x31
        );
        if add != 0 {
            for row in [first_row, second_row] {
                dynasm!(ops ; .arch x64 ; vpaddb Ry(row), Ry(row), Ry(OFFSET_CHANGE));
            }
        }
    }
    // ymm c: chunk c of rows 0..3 in its low half, chunk c + 4 in its high.
    dynasm!(ops
        ; .arch x64
        ; vpunpckldq ymm4, ymm0, ymm1
        ; vpunpckhdq ymm5, ymm0, ymm1
        ; vpunpckldq ymm6, ymm2, ymm3
        ; vpunpckhdq ymm7, ymm2, ymm3
        ; vpunpcklqdq ymm0, ymm4, ymm6
        ; vpunpckhqdq ymm1, ymm4, ymm6
        ; vpunpcklqdq ymm2, ymm5, ymm7
        ; vpunpckhqdq ymm3, ymm5, ymm7
    );
    let chunk_at = |c: usize| (into.block_rows() * 2 + 64 * c) as i32;
    for c in 0..4u8 {
        let (low, high) = (chunk_at(usize::from(c)), chunk_at(usize::from(c) + 4));
        dynasm!(ops
            ; .arch x64
            ; vmovdqu [r12 + low], Rx(c)
            ; vextracti128 [r12 + high], Ry(c), 1
        );
    }
    dynasm!(ops
        ; .arch x64
        ; add r9, q.group_bytes() as i32
        ; add r11, into.group_bytes() as i32
        ; add r12, into.group_bytes() as i32
        ; dec r10
    );
    jback!(ops, jnz, group, group_top);
    next_block_and_return(ops, BLOCK_ROWS, (block, block_top), done, name)
}
