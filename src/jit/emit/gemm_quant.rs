//! The integer GEMM's call and token tiles, shared by its forms, and the
//! choice of form: `y[t, r] = sum_g d_w[r,g] * d_x[t,g] * (v_w[r,g] ·
//! q_x[t,g])` for r in `r0..r1` and t < `ntok` (1..=8). It serves every
//! product of several tokens with quantized weights (a verify step of
//! speculative decoding, a server's batch of sequences, a prefill chunk: 8
//! tokens per call, the caller looping over tiles while the rows stay in
//! cache) and, for Q8_0, single tokens too.
//!
//! Weights come in 16-row blocks ([`QuantType::Q8_0x16`]'s layout): Q8_0
//! matrices as they are stored, Q5_0 and Q4_0 panels unpacked into it
//! first (`unpack_quant`), once per panel for all of a prefill's tiles;
//! with VNNI, Q5_0 is stored in 16-row blocks of its own
//! ([`QuantType::Q5_0x16`]) that the GEMM unpacks in registers. The lanes
//! of a vector are rows, so each token costs its own products only:
//! - with AVX-512 VNNI, `gemm_q8_0x16`: 16 rows per zmm, one `vpdpbusd`
//!   per token per 4 columns; unpacked panels and Q5_0x16's chunks hold
//!   s + 128 like Q8_0x16, so the products and their scaling are the same
//!   code for every type;
//! - under AVX2, `gemm_q8_0x16_avx2`: 8 rows per ymm, `vpmaddubsw` +
//!   `vpmaddwd`; Q8_0 through the sign trick, unpacked panels with their
//!   own small offset (s + 16, s + 8) multiplied as they are, a kernel
//!   each.
//!
//! (A 4-row layout with the tokens as lanes came before: it paid for a
//! tile's 8 token slots whatever the count.)
//!
//! The input comes as a token tile (`engine::q8_input`): per group of 32
//! columns, the 8 tokens' quants interleaved 4 at a time (32 bytes hold
//! columns 4c..4c+3 of all 8 tokens), then their 8 f32 scales, 8 i32
//! sums and 8 VNNI starting values ([`vnni_group_start`] of the sums);
//! absent tokens are zeros.
//!
//! Exactness: each row's group sum is an exact integer, converted,
//! multiplied by `d_w * d_x` and added with one FMA, group after group,
//! exactly as the GEMV does, so every token's result is bit-identical to a
//! one-token step's (greedy speculation and batched serving then reproduce
//! plain decoding).
//!
//! Signature `fn(w, x_tile, y, r0, r1, k, ldy, ntok)`: y points at token
//! 0's row, token t's output at `y + t*ldy`; r0 on a 16-row block, the
//! last block may be partial (padding rows are zeros; only valid rows are
//! stored).

use super::Asm;
use super::gemv_quant::{block_pointer, block_stride};
use crate::model::quant_blocks::{GROUP_COLS, QuantType};
use dynasmrt::{AssemblyOffset, DynamicLabel, DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemmQuantParams {
    /// The weights: Q8_0x16, or (AVX2) Q5_0 or Q4_0 values unpacked into
    /// its 16-row blocks with their own offset.
    pub q: QuantType,
    /// Products with AVX-512 VNNI's `vpdpbusd` on zmm registers
    /// (`gemm_q8_0x16`) rather than AVX2's `vpmaddubsw` + `vpmaddwd`.
    pub vnni: bool,
    /// Bytes ahead of each group to prefetch (0: none), as the GEMV.
    pub prefetch: usize,
    /// Bytes ahead of each group to prefetch into L2 as well, in passes
    /// over several tokens (0: none; VNNI's 16-row GEMM only, see
    /// `gemm_q8_0x16`).
    pub l2_prefetch: usize,
}

impl GemmQuantParams {
    /// Whether the kernel's one-token form reads a one-token tile
    /// ([`SINGLE_GROUP_BYTES`] per group) rather than the 8-token tile:
    /// the K-quant kernels with VNNI.
    pub fn single_token_layout(&self) -> bool {
        self.vnni && self.q.is_k_quant()
    }

    /// How many of its input's values share a scale: a super-block's 256
    /// for the K-quant kernels with VNNI, which sum a super-block's
    /// groups in integers (`gemm_kquant`), else a group's 32.
    pub fn input_span(&self) -> ScaleSpan {
        if self.vnni && self.q.is_k_quant() {
            ScaleSpan::SuperBlock
        } else {
            ScaleSpan::Group
        }
    }
}

/// How many consecutive input values share one 8-bit scale (the tiles'
/// layout is the same either way: each group keeps its own scale slot,
/// equal across a super-block in [`ScaleSpan::SuperBlock`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScaleSpan {
    /// A group's 32 values (llama.cpp's Q8_0 rule).
    #[default]
    Group,
    /// A K-quant super-block's 256 values (llama.cpp's Q8_K): a kernel can
    /// then scale a group's integer sum by the weights' 6-bit group scale
    /// in integers and convert once per super-block.
    SuperBlock,
}

impl ScaleSpan {
    /// Values per scale.
    pub fn values(self) -> usize {
        match self {
            ScaleSpan::Group => GROUP_COLS,
            ScaleSpan::SuperBlock => 8 * GROUP_COLS,
        }
    }
}

/// Rows per block of every form: Q8_0x16's.
pub const ROWS: usize = 16;
/// Tokens per call: a tile's slots.
pub const TOKENS: usize = 8;
/// Where a tile group's scales and sums start, and its size.
pub const TILE_SCALES_AT: usize = TOKENS * GROUP_COLS;
pub const TILE_SUMS_AT: usize = TILE_SCALES_AT + TOKENS * 4;
/// Where a tile group's 8 VNNI starting values begin (see
/// [`vnni_group_start`]).
pub const TILE_VNNI_STARTS_AT: usize = TILE_SUMS_AT + TOKENS * 4;
/// Where a tile group's 8 scaled sums begin (f32 `d_x · sum`, what Q4_K's
/// mins multiply, see `gemm_kquant`).
pub const TILE_SCALED_SUMS_AT: usize = TILE_VNNI_STARTS_AT + TOKENS * 4;
/// Where a tile group's Q6_K starting values begin: per token `-32 ·` the
/// sum of the group's first 16 quants, then 8 of its last 16 (Q6_K's
/// values are stored plus 32 and its scales change every 16 columns).
pub const TILE_HALF_STARTS_AT: usize = TILE_SCALED_SUMS_AT + TOKENS * 4;
pub const TILE_GROUP_BYTES: usize = TILE_HALF_STARTS_AT + 2 * TOKENS * 4;

/// A tile of one token in the one-token layout, which a kernel whose
/// one-token form asks for it ([`GemmQuantParams::single_token_layout`])
/// takes instead of the 8-token tile when `ntok` is 1: per group of 32
/// columns one 64-byte line, the token's 32 quants (chunk c at 4c), then
/// its scale, its scaled sum and its two Q6_K half starts, the values the
/// 8-token tile holds. (The 8-token tile of K 2,560 is 35 KiB, more than
/// L1d, and one token reads 4 bytes in 32 of 6 of its 7 lines per group:
/// a decode step read the whole tile from L2 again for every 16 rows.)
pub const SINGLE_GROUP_BYTES: usize = 64;
pub const SINGLE_SCALE_AT: usize = GROUP_COLS;
pub const SINGLE_SCALED_SUM_AT: usize = SINGLE_SCALE_AT + 4;
pub const SINGLE_HALF_STARTS_AT: usize = SINGLE_SCALED_SUM_AT + 4;

/// Bytes of a one-token tile for rows of `k` values.
pub fn single_tile_bytes(k: usize) -> usize {
    k / GROUP_COLS * SINGLE_GROUP_BYTES
}

/// 1.5 * 2^23 as f32 bits. Every integer i with |i| < 2^22 added to these
/// bits gives the float 1.5 * 2^23 + i exactly, so subtracting 1.5 * 2^23
/// (exact too) turns an integer into a float with one `vsubps`, on either
/// vector port, where `vcvtdq2ps` needs port 0, which the `vpdpbusd`s
/// share with port 5.
pub const FLOAT_MAGIC_BITS: i32 = 0x4B40_0000;

/// The value VNNI's group sums start from for a token whose group of
/// quants sums to `sum`: `vpdpbusd` multiplies the weights' stored bytes
/// (value + 128), so a group's products total `value · x + (sum << 7)`;
/// starting from `FLOAT_MAGIC_BITS - (sum << 7)` leaves
/// `FLOAT_MAGIC_BITS + value · x`, whose float is the exact sum plus 1.5 *
/// 2^23 (|value · x| <= 32 · 128 · 127 < 2^22). Kept in the tile, so the
/// kernel's correction costs a broadcast load instead of a shift and a
/// subtraction per token and group.
pub fn vnni_group_start(sum: i32) -> i32 {
    FLOAT_MAGIC_BITS - (sum << QuantType::Q8_0x16.stored_offset_shift())
}

/// Stack offsets of the 7th and 8th arguments after the 6 callee-saved
/// pushes and the return address.
pub(super) const LDY_AT: i32 = 56;
pub(super) const NTOK_AT: i32 = 64;

/// Bytes of one token tile for rows of `k` values.
pub fn tile_bytes(k: usize) -> usize {
    k / GROUP_COLS * TILE_GROUP_BYTES
}

/// The start of a kernel `fn(w, x, y, r0, r1, k, ldy, ntok)` over weights
/// in 16-row blocks of `layout` and an input of `group_bytes` per 32
/// columns: r12 =
/// ldy in bytes, r13 = ntok, rbx = K, rbp = the bytes of W per row of a
/// block, r11 = the end of the input's groups; jumps to `done` when there
/// are no rows.
pub(super) fn token_call_frame(
    ops: &mut Asm,
    layout: QuantType,
    group_bytes: usize,
    done: dynasmrt::DynamicLabel,
) {
    dynasm!(ops
        ; .arch x64
        ; mov r12, [rsp + LDY_AT]
        ; shl r12, 2
        ; mov r13, [rsp + NTOK_AT]
    );
    if layout.is_k_quant() {
        // A super-block's bytes per row of the layout, per 256 columns.
        dynasm!(ops
            ; .arch x64
            ; mov rbx, r9
            ; mov rbp, r9
            ; shr rbp, 8
            ; imul rbp, rbp, layout.unit_row_bytes() as i32
        );
    } else {
        // The file type's bytes per row (Q8_0's whatever the values'
        // offset): a 16-row block holds 16 rows' file blocks.
        block_stride(ops, layout.file_type());
    }
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

/// The top of a 16-row block (label `block`) and of a pass over it
/// (label `pass`), as both forms of the GEMM loop: r9 = the block's first
/// group, kept in r15, r14 = the block's outputs (`y + r`), rax = 0 the
/// pass's first token; each pass then restarts r9 and points r10 at its
/// first token in the tile. Returns the two labels' offsets for the
/// backward jumps.
pub(super) fn block_and_pass_top(
    ops: &mut Asm,
    block: DynamicLabel,
    pass: DynamicLabel,
) -> (AssemblyOffset, AssemblyOffset) {
    let block_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>block);
    block_pointer(ops);
    dynasm!(ops
        ; .arch x64
        ; mov r15, r9
        ; lea r14, [rdx + rcx * 4]
        ; xor eax, eax
    );
    let pass_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>pass
        ; mov r9, r15
        ; lea r10, [rsi + rax * 4]
    );
    (block_top, pass_top)
}

/// The end of a group of `layout`: r9 and r10 to the next group of the block and of
/// the tile, back to `group` while the tile has one. A pass starts 4 bytes
/// per token into the tile's first group, so r10 passes the end (r11)
/// after its last group whatever the pass.
pub(super) fn next_group(
    ops: &mut Asm,
    layout: QuantType,
    (group, group_top): (DynamicLabel, AssemblyOffset),
) {
    dynasm!(ops
        ; .arch x64
        ; add r9, layout.group_bytes() as i32
        ; add r10, TILE_GROUP_BYTES as i32
        ; cmp r10, r11
    );
    crate::jback!(ops, jb, group, group_top);
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
    if p.q.is_k_quant() {
        super::gemm_kquant::emit(p, name)
    } else if p.vnni {
        super::gemm_q8_0x16::emit(p, name)
    } else {
        super::gemm_q8_0x16_avx2::emit(p, name)
    }
}
