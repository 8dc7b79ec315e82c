//! The 16-bit GEMM on 512-bit vectors (prefill with AVX-512):
//! `Y[t, r] = sum_k W[r,k] * X[t,k]` for r in `r0..r1` and t < `tokens`,
//! W in the row-block layout (`model::row_blocks`: 4 rows x 8 columns per
//! 64-byte line), K an argument, so one kernel serves every K of a model.
//!
//! Two forms:
//! - **BF16 dot products** (`vdpbf16ps`, AVX-512 BF16): a 64-byte line is
//!   loaded as it is, its dword lanes (row, column pair) of 4 rows x 4
//!   pairs; a token's 8 columns, rounded to bf16 once by the engine
//!   (`vcvtne2ps2bf16`), are broadcast to the 4 128-bit lanes, and one
//!   `vdpbf16ps` adds 32 products. The products of two bf16 values are
//!   exact in f32; what changes against the f32 path is the input's
//!   rounding to bf16 (relative 2^-9 per value) and the pair summed before
//!   it reaches the accumulator. 16 rows (4 blocks) x 6 tokens: 24
//!   accumulators, 4 weight registers.
//! - **Widened weights and FMA** (`vfmadd231ps` on zmm, AVX-512F): half a
//!   line (2 rows x 8 columns) widened to 16 f32 (`vcvtph2ps` for F16,
//!   `vpmovzxwd` and a shift for BF16), the token's 8 f32 columns
//!   broadcast to both halves. 8 rows (2 blocks) x 6 tokens.
//!
//! The input comes as tiles of 6 tokens the engine lays out once per
//! product (`engine::wide_input`): per group of 8 columns the 6 tokens'
//! values side by side (16 bytes each in bf16, 32 in f32), K padded with
//! zeros to whole groups and absent tokens zero, so the kernel has no
//! tail and one pointer walks the tile. The weights' padding columns are
//! zeros too.
//!
//! Loops: token tiles outside, row tiles inside (the tile stays in L1 or
//! L2 while the caller's panel of rows streams past it from L2); in the
//! K loop every load feeds 4 (weights) or 6 (inputs) products. A row
//! tile's accumulators hold each row's partial sums in 4 (dot) or 8
//! (FMA) lanes; at the end each token's are summed by a tree of
//! `vshufps`/`vaddps` and put in row order with one `vpermps`, then
//! stored masked (k1) to the rows that exist.
//!
//! Registers: zmm0..23 accumulators (unit u, token j at 6u + j), zmm24..27
//! the units' weights, zmm28 the broadcast input, zmm29 the row order
//! indices, zmm30/31 temporaries. rdi = W, rsi = the token tile, rdx = its
//! first token's Y row, rcx = r, r8 = r1, r9 = tokens left, r12 = ldy in
//! bytes, r13 = K's groups, rbp = bytes of a 4-row block, rbx/r10/r14/r15
//! the blocks of the row tile (biased to the block's end), r11 the tile's
//! group, rax the byte index into the blocks (from -rbp up to 0).

use super::gemm_quant::iced;
use super::gemv::WeightType;
use super::{cmp_imm8, new_asm, reg, restore_callee_saved_and_return, save_callee_saved};
use crate::jback;
use crate::model::row_blocks;
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};
use iced_x86::IcedError;
use iced_x86::code_asm::*;

/// How the products are formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WideProducts {
    /// Weights widened to f32, `vfmadd231ps` with f32 inputs.
    Fma,
    /// `vdpbf16ps` of BF16 weights and inputs rounded to bf16.
    Bf16Dot,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct GemmWideParams {
    pub wt: WeightType,
    pub products: WideProducts,
}

/// Tokens of an input tile (and of the register tile).
pub const TILE_TOKENS: usize = 6;
/// Weight registers of the K loop: 4 blocks (dot) or 4 half blocks (FMA).
const UNITS: usize = 4;
const WEIGHTS: [AsmRegisterZmm; UNITS] = [zmm24, zmm25, zmm26, zmm27];
const INPUT: AsmRegisterZmm = zmm28;
const ROW_ORDER: AsmRegisterZmm = zmm29;
const TEMP: [AsmRegisterZmm; 2] = [zmm30, zmm31];
const ZMM: [AsmRegisterZmm; 24] = [
    zmm0, zmm1, zmm2, zmm3, zmm4, zmm5, zmm6, zmm7, zmm8, zmm9, zmm10, zmm11, zmm12, zmm13, zmm14,
    zmm15, zmm16, zmm17, zmm18, zmm19, zmm20, zmm21, zmm22, zmm23,
];
const XMM_LOW: [AsmRegisterXmm; 16] = [
    xmm0, xmm1, xmm2, xmm3, xmm4, xmm5, xmm6, xmm7, xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14,
    xmm15,
];
/// Stack offsets of the 7th (ldy) and 8th (K) arguments after the 6
/// callee-saved pushes, the pushed r0 and the return address.
const LDY_AT: i32 = 64;
const K_AT: i32 = 72;
/// Bytes of one block line: 4 rows x 8 columns x 2 bytes.
const LINE: i32 = (row_blocks::BLOCK_ROWS * row_blocks::GROUP_COLS * 2) as i32;

impl GemmWideParams {
    /// Rows of the register tile: 4 blocks (dot) or 2 (FMA).
    pub fn rows(&self) -> usize {
        match self.products {
            WideProducts::Bf16Dot => 16,
            WideProducts::Fma => 8,
        }
    }

    /// Bytes of one input value in the tile: bf16 or f32.
    pub fn input_bytes(&self) -> usize {
        match self.products {
            WideProducts::Bf16Dot => 2,
            WideProducts::Fma => 4,
        }
    }

    /// Bytes of one group (8 columns) of a tile: its 6 tokens' values.
    pub fn tile_group_bytes(&self) -> usize {
        TILE_TOKENS * row_blocks::GROUP_COLS * self.input_bytes()
    }

    /// Bytes of one tile for rows of `k` values.
    pub fn tile_bytes(&self, k: usize) -> usize {
        row_blocks::padded_cols(k) / row_blocks::GROUP_COLS * self.tile_group_bytes()
    }
}

fn acc(unit: usize, token: usize) -> AsmRegisterZmm {
    ZMM[unit * TILE_TOKENS + token]
}

/// The row-order indices: after the reduction tree, row r of the tile
/// sits at `pos(r)`; `vpermps` with these indices puts it at r.
fn row_order(p: &GemmWideParams) -> [u8; 16] {
    let mut idx = [0u8; 16];
    for (r, i) in idx.iter_mut().enumerate().take(p.rows()) {
        *i = match p.products {
            // Unit u's 128-bit lane L is row 4u + L, summed to 4L + u.
            WideProducts::Bf16Dot => 4 * (r % 4) + r / 4,
            // Unit u's low half is row 2u (lanes 0, 1 summed to 0 + u),
            // its high half row 2u + 1 (lanes 2, 3 to 8 + u).
            WideProducts::Fma => 8 * (r % 2) + r / 2,
        } as u8;
    }
    idx
}

/// `dst = [x0+x1, x2+x3, y0+y1, y2+y3]` in every 128-bit lane.
pub(super) fn pair_sums(
    a: &mut CodeAssembler,
    dst: AsmRegisterZmm,
    x: AsmRegisterZmm,
    y: AsmRegisterZmm,
    tmp: AsmRegisterZmm,
) -> Result<(), IcedError> {
    a.vshufps(tmp, x, y, 0x88)?;
    a.vshufps(dst, x, y, 0xDD)?;
    a.vaddps(dst, dst, tmp)
}

/// Token j's 4 accumulators summed into `WEIGHTS[0]`, rows in order.
fn reduce_token(a: &mut CodeAssembler, p: &GemmWideParams, j: usize) -> Result<(), IcedError> {
    let [w0, w1, ..] = WEIGHTS;
    pair_sums(a, w0, acc(0, j), acc(1, j), TEMP[0])?;
    pair_sums(a, w1, acc(2, j), acc(3, j), TEMP[1])?;
    pair_sums(a, w0, w0, w1, TEMP[0])?;
    if p.products == WideProducts::Fma {
        // A row's two 128-bit halves: lanes [1, 0, 3, 2] added.
        a.vshuff32x4(TEMP[0], w0, w0, 0xB1)?;
        a.vaddps(w0, w0, TEMP[0])?;
    }
    a.vpermps(w0, ROW_ORDER, w0)
}

/// One group of the K loop: the units' weights, then per token the
/// broadcast input and its products.
fn group_step(a: &mut CodeAssembler, p: &GemmWideParams) -> Result<(), IcedError> {
    let blocks = [rbx, r10, r14, r15];
    for (u, &w) in WEIGHTS.iter().enumerate() {
        match (p.products, p.wt) {
            (WideProducts::Bf16Dot, _) => a.vmovdqu32(w, zmmword_ptr(blocks[u] + rax))?,
            (WideProducts::Fma, wt) => {
                let at = ymmword_ptr(blocks[u / 2] + rax + 32 * (u % 2) as i32);
                if wt == WeightType::Bf16 {
                    // bf16 is the high half of an f32.
                    a.vpmovzxwd(w, at)?;
                    a.vpslld(w, w, 16)?;
                } else {
                    a.vcvtph2ps(w, at)?;
                }
            }
        }
    }
    let step = (row_blocks::GROUP_COLS * p.input_bytes()) as i32;
    for j in 0..TILE_TOKENS {
        match p.products {
            WideProducts::Bf16Dot => {
                a.vbroadcasti32x4(INPUT, xmmword_ptr(r11 + step * j as i32))?;
                for (u, &w) in WEIGHTS.iter().enumerate() {
                    a.vdpbf16ps(acc(u, j), w, INPUT)?;
                }
            }
            WideProducts::Fma => {
                a.vbroadcastf64x4(INPUT, ymmword_ptr(r11 + step * j as i32))?;
                for (u, &w) in WEIGHTS.iter().enumerate() {
                    a.vfmadd231ps(acc(u, j), w, INPUT)?;
                }
            }
        }
    }
    a.add(r11, p.tile_group_bytes() as i32)?;
    a.add(rax, LINE)
}

/// Emits `extern "sysv64" fn(w, x_tiles, y, r0, r1, tokens, ldy, k)`.
pub fn emit(p: &GemmWideParams, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        p.wt.bytes() == 2,
        "kernel {name}: the wide GEMM reads 16-bit row blocks, not {}",
        p.wt.name()
    );
    anyhow::ensure!(
        p.products == WideProducts::Fma || p.wt == WeightType::Bf16,
        "kernel {name}: BF16 dot products need BF16 weights"
    );
    let rows = p.rows();
    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let tok_tile = ops.new_dynamic_label();
    let row_tile = ops.new_dynamic_label();
    let kloop = ops.new_dynamic_label();
    let stored = ops.new_dynamic_label();
    save_callee_saved(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; push rcx
        ; mov r12, [rsp + LDY_AT]
        ; shl r12, 2
        ; mov r13, [rsp + K_AT]
        ; add r13, 7
        ; shr r13, 3
        ; mov rbp, r13
        ; shl rbp, 6
    );
    let order = row_order(p);
    let lo = i64::from_le_bytes(order[..8].try_into().expect("8 bytes"));
    let hi = i64::from_le_bytes(order[8..].try_into().expect("8 bytes"));
    iced(&mut ops, |a| {
        a.mov(rax, lo)?;
        a.vmovq(xmm0, rax)?;
        a.mov(rax, hi)?;
        a.vpinsrq(xmm0, xmm0, rax, 1)?;
        a.vpmovzxbd(ROW_ORDER, xmm0)
    });
    dynasm!(ops
        ; .arch x64
        ; cmp rcx, r8
        ; jae =>done
        ; test r9, r9
        ; jz =>done
    );
    let tok_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>tok_tile
        ; mov rcx, [rsp]
    );
    let row_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>row_tile
        // Block r/4 starts at r/4 * rbp = r * groups * 16; biased to its end.
        ; mov rbx, rcx
        ; imul rbx, r13
        ; shl rbx, 4
        ; add rbx, rdi
        ; add rbx, rbp
        ; lea r10, [rbx + rbp]
        ; lea r14, [rbx + rbp * 2]
        ; lea r15, [r10 + rbp * 2]
        // Blocks past r1 read the tile's first instead: in bounds, never stored.
        ; mov rax, r8
        ; sub rax, rcx
    );
    let blocks = match p.products {
        WideProducts::Bf16Dot => 4,
        WideProducts::Fma => 2,
    };
    for (b, ptr) in [reg::R10, reg::R14, reg::R15]
        .into_iter()
        .enumerate()
        .take(blocks - 1)
    {
        cmp_imm8(&mut ops, reg::RAX, (4 * (b + 1) + 1) as i8);
        dynasm!(ops ; .arch x64 ; cmovb Rq(ptr), rbx);
    }
    iced(&mut ops, |a| {
        // VEX xmm forms clear the whole register, in 4 bytes.
        for (i, &z) in ZMM.iter().enumerate() {
            match XMM_LOW.get(i) {
                Some(&x) => a.vxorps(x, x, x)?,
                None => a.vpxord(z, z, z)?,
            }
        }
        a.mov(r11, rsi)?;
        a.xor(eax, eax)?;
        a.sub(rax, rbp)
    });
    let top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>kloop);
    iced(&mut ops, |a| group_step(a, p));
    jback!(ops, jnz, kloop, top);
    // The mask of the tile's rows that exist (at most `rows`), then token
    // j's row at r10 = y + r (+ j ldy).
    dynasm!(ops
        ; .arch x64
        ; mov rax, r8
        ; sub rax, rcx
        ; mov r10d, rows as i32
        ; cmp r10, rax
        ; cmovb rax, r10
        ; xor r10d, r10d
        ; bts r10d, eax
        ; dec r10d
    );
    iced(&mut ops, |a| a.kmovw(k1, r10d));
    dynasm!(ops ; .arch x64 ; lea r10, [rdx + rcx * 4]);
    for j in 0..TILE_TOKENS {
        if j > 0 {
            cmp_imm8(&mut ops, reg::R9, (j + 1) as i8);
            dynasm!(ops
                ; .arch x64
                ; jb =>stored
                ; add r10, r12
            );
        }
        iced(&mut ops, |a| {
            reduce_token(a, p, j)?;
            a.vmovups(zmmword_ptr(r10).k1(), WEIGHTS[0])
        });
    }
    dynasm!(ops
        ; .arch x64
        ; =>stored
        ; add rcx, BYTE rows as i8
        ; cmp rcx, r8
    );
    jback!(ops, jb, row_tile, row_top);
    // The next token tile: its inputs and its first Y row.
    dynasm!(ops
        ; .arch x64
        ; imul rax, r13, p.tile_group_bytes() as i32
        ; add rsi, rax
        ; lea rax, [r12 + r12 * 2]
        ; lea rdx, [rdx + rax * 2]
        ; sub r9, BYTE TILE_TOKENS as i8
    );
    jback!(ops, jg, tok_tile, tok_top);
    dynasm!(ops
        ; .arch x64
        ; =>done
        ; pop rcx
    );
    restore_callee_saved_and_return(&mut ops);
    super::finish(ops, name)
}
