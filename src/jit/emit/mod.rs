//! Machine-code emitters, one file per kernel family. Emitters only write
//! bytes; they never run them (verification and mapping happen elsewhere).
//!
//! All kernels use the System V calling convention, touch only caller-saved
//! registers or push/pop the callee-saved ones they use, call nothing, and end
//! with `vzeroupper` so SSE code in the caller pays no transition penalty.

// dynasm! expands dynamic registers as `reg.into()`, which clippy flags when
// the expression is already the register type; the lint has nothing to fix here.
#![allow(clippy::useless_conversion)]

pub mod attention;
pub mod elementwise;
pub mod gemm;
pub mod gemm_kquant;
pub mod gemm_kquant_avx2;
pub mod gemm_q8_0x16;
pub mod gemm_q8_0x16_avx2;
pub mod gemm_quant;
pub mod gemm_wide;
pub mod gemv;
pub mod gemv_quant;
pub mod gemv_wide;
pub mod unpack_quant;

use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

/// Emission target: a plain byte vector with label support. Relocations are
/// all relative, so the bytes can be copied to any executable page.
pub type Asm = dynasmrt::VecAssembler<dynasmrt::x64::X64Relocation>;

pub fn new_asm() -> Asm {
    Asm::new(0)
}

/// Finishes an assembler, turning a label error into a message rather than a panic.
pub fn finish(ops: Asm, name: &str) -> anyhow::Result<Vec<u8>> {
    ops.finalize().map_err(|e| {
        anyhow::anyhow!(
            "kernel {name}: label unresolved or short jump out of range while emitting: {e:?}"
        )
    })
}

/// Places `done` and returns from the kernel there (the vector registers'
/// upper halves cleared first, as every kernel leaves them), then
/// finishes it.
pub fn return_at(
    mut ops: Asm,
    done: dynasmrt::DynamicLabel,
    name: &str,
) -> anyhow::Result<Vec<u8>> {
    dynasm!(ops
        ; .arch x64
        ; =>done
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}

/// f32 elements in one AVX2 vector.
pub const LANES: usize = 8;

/// `cmp reg64, imm8`, hand-encoded: dynasm 5.1 always picks the imm32 form
/// for `cmp`, 3 bytes longer. (REX.W+B, 83 /7 ib.)
pub fn cmp_imm8(ops: &mut Asm, reg: u8, imm: i8) {
    ops.push(0x48 | (reg >> 3));
    ops.push(0x83);
    ops.push(0xF8 | (reg & 7));
    ops.push(imm as u8);
}

/// `add rax, imm` with the imm8 form when it fits (dynasm needs `BYTE` for it).
pub fn add_rax(ops: &mut Asm, imm: i32) {
    match i8::try_from(imm) {
        Ok(b) => dynasm!(ops ; .arch x64 ; add rax, BYTE b),
        Err(_) => dynasm!(ops ; .arch x64 ; add rax, imm),
    }
}

/// Makes a partial tile read in bounds: every pointer of `ptrs[1..]` at or
/// past `count` (a register holding how many rows of the tile are real) is
/// pointed back at `ptrs[0]`; what it then loads is never stored.
pub fn alias_missing(ops: &mut Asm, ptrs: &[u8], count: u8) {
    for (i, &p) in ptrs.iter().enumerate().skip(1) {
        cmp_imm8(ops, count, (i + 1) as i8);
        dynasm!(ops ; .arch x64 ; cmovb Rq(p), Rq(ptrs[0]));
    }
}

/// Saves the six callee-saved registers a kernel with many pointers uses
/// (rbx, rbp, r12..r15); pair with [`restore_callee_saved_and_return`].
pub fn save_callee_saved(ops: &mut Asm) {
    dynasm!(ops
        ; .arch x64
        ; push rbx
        ; push rbp
        ; push r12
        ; push r13
        ; push r14
        ; push r15
    );
}

/// Restores what [`save_callee_saved`] pushed, clears the upper ymm
/// halves for SSE callers and returns.
pub fn restore_callee_saved_and_return(ops: &mut Asm) {
    dynasm!(ops
        ; .arch x64
        ; pop r15
        ; pop r14
        ; pop r13
        ; pop r12
        ; pop rbp
        ; pop rbx
        ; vzeroupper
        ; ret
    );
}

/// The end of a kernel that walks row blocks of `rows` rows: the next
/// block while rcx < r1 (r8), then `done`, the callee-saved registers
/// restored, return; finishes the buffer.
pub fn next_block_and_return(
    mut ops: Asm,
    rows: usize,
    (block, block_top): (dynasmrt::DynamicLabel, dynasmrt::AssemblyOffset),
    done: dynasmrt::DynamicLabel,
    name: &str,
) -> anyhow::Result<Vec<u8>> {
    dynasm!(ops
        ; .arch x64
        ; add rcx, BYTE rows as i8
        ; cmp rcx, r8
    );
    crate::jback!(ops, jb, block, block_top);
    dynasm!(ops ; .arch x64 ; =>done);
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}

/// Backward conditional jump to `label` defined at `top`: the 2-byte short
/// form when it reaches, else the 6-byte near form.
#[macro_export]
macro_rules! jback {
    ($ops:ident, $cc:ident, $label:expr, $top:expr) => {{
        if $ops.offset().0 + 2 - $top.0 <= 128 {
            dynasm!($ops ; .arch x64 ; $cc BYTE =>$label);
        } else {
            dynasm!($ops ; .arch x64 ; $cc =>$label);
        }
    }};
}

/// Broadcasts an f32 bit pattern into all lanes of `ymm`. Clobbers eax.
/// (A register-source broadcast sidesteps dynasm's `vbroadcastss ymm, [mem]` bug.)
pub fn broadcast_const(ops: &mut Asm, ymm: u8, bits: u32) {
    dynasm!(ops
        ; .arch x64
        ; mov eax, bits as i32
        ; vmovd Rx(ymm), eax
        ; vpbroadcastd Ry(ymm), Rx(ymm)
    );
}

/// Sets `ymm` to a lane mask with lanes `[first, first + count)` all-ones.
/// Clobbers rax.
pub fn lane_mask(ops: &mut Asm, ymm: u8, first: usize, count: usize) {
    let mut bytes = 0u64;
    for lane in first..(first + count).min(LANES) {
        bytes |= 0xFF << (8 * lane);
    }
    dynasm!(ops
        ; .arch x64
        ; mov rax, QWORD bytes as i64
        ; vmovq Rx(ymm), rax
        ; vpmovsxbd Ry(ymm), Rx(ymm)
    );
}

/// Horizontal sum of `ymm` into lane 0 of the same register (as xmm).
pub fn hsum(ops: &mut Asm, ymm: u8, tmp: u8) {
    dynasm!(ops
        ; .arch x64
        ; vextractf128 Rx(tmp), Ry(ymm), 1
        ; vaddps Rx(ymm), Rx(ymm), Rx(tmp)
        ; vmovhlps Rx(tmp), Rx(tmp), Rx(ymm)
        ; vaddps Rx(ymm), Rx(ymm), Rx(tmp)
        ; vmovshdup Rx(tmp), Rx(ymm)
        ; vaddss Rx(ymm), Rx(ymm), Rx(tmp)
    );
}

/// Reduces four 8-lane accumulators to `[sum a0, sum a1, sum a2, sum a3]` in
/// xmm `a[0]`. Clobbers the four and `tmp`.
pub fn reduce4(ops: &mut Asm, a: [u8; 4], tmp: u8) {
    dynasm!(ops
        ; .arch x64
        ; vhaddps Ry(a[0]), Ry(a[0]), Ry(a[1])
        ; vhaddps Ry(a[2]), Ry(a[2]), Ry(a[3])
        ; vhaddps Ry(a[0]), Ry(a[0]), Ry(a[2])
        ; vextractf128 Rx(tmp), Ry(a[0]), 1
        ; vaddps Rx(a[0]), Rx(a[0]), Rx(tmp)
    );
}

/// `vshufps ymm dst, ymm first, ymm second, selector`: per 128-bit half,
/// lanes 0 and 1 from `first`, 2 and 3 from `second`. dynasm-rs 5.1
/// encodes its two sources swapped (`vshufps ymm7, ymm4, ymm14, 88h` comes
/// out as `vshufps ymm7, ymm14, ymm4, 88h`), so they are written swapped
/// here; the test below decodes the bytes and fails if that ever changes.
pub fn vshufps(ops: &mut Asm, dst: u8, first: u8, second: u8, selector: u8) {
    dynasm!(ops
        ; .arch x64
        ; vshufps Ry(dst), Ry(second), Ry(first), selector as i8
    );
}

/// Sets `ymm` to the lane indices 0..7 (as i32). Clobbers rax.
pub fn lane_index(ops: &mut Asm, ymm: u8) {
    dynasm!(ops
        ; .arch x64
        ; mov rax, QWORD 0x0706_0504_0302_0100
        ; vmovq Rx(ymm), rax
        ; vpmovzxbd Ry(ymm), Rx(ymm)
    );
}

/// Sets `ymm` to the mask of lanes i < count (count a 64-bit register whose
/// value fits i32), given the lane indices in `idx`.
pub fn count_mask(ops: &mut Asm, ymm: u8, idx: u8, count: u8) {
    dynasm!(ops
        ; .arch x64
        ; vmovd Rx(ymm), Rd(count)
        ; vpbroadcastd Ry(ymm), Rx(ymm)
        ; vpcmpgtd Ry(ymm), Ry(ymm), Ry(idx)
    );
}

/// The end of a GEMV's row-block loop, shared by the 16-bit and the
/// quantized GEMVs: stores xmm0's 4 row sums to `y[rcx..]` for the rows that
/// exist (`r8 - rcx`, at most 4; a masked store, once per 4 rows x K), then
/// steps rcx to the next block and loops to `block` while rcx < r8.
/// Registers: rdx=y, rcx=r, r8=r1; clobbers r10 and ymm8 (a fixed register:
/// dynasm encodes a dynamic one in the store's longer form); `idx` holds the
/// lane indices.
pub fn store_rows_and_next_block(
    ops: &mut Asm,
    idx: u8,
    block: dynasmrt::DynamicLabel,
    block_top: dynasmrt::AssemblyOffset,
) {
    dynasm!(ops
        ; .arch x64
        ; mov r10, r8
        ; sub r10, rcx
    );
    count_mask(ops, 8, idx, reg::R10);
    dynasm!(ops
        ; .arch x64
        ; vmaskmovps [rdx + rcx * 4], xmm8, xmm0
        ; add rcx, BYTE 4
        ; cmp rcx, r8
    );
    crate::jback!(ops, jb, block, block_top);
}

/// Register numbers (dynasm encoding order).
pub mod reg {
    pub const RAX: u8 = 0;
    pub const RCX: u8 = 1;
    pub const RDX: u8 = 2;
    pub const RBX: u8 = 3;
    pub const RBP: u8 = 5;
    pub const RSI: u8 = 6;
    pub const RDI: u8 = 7;
    pub const R8: u8 = 8;
    pub const R9: u8 = 9;
    pub const R10: u8 = 10;
    pub const R11: u8 = 11;
    pub const R12: u8 = 12;
    pub const R13: u8 = 13;
    pub const R14: u8 = 14;
    pub const R15: u8 = 15;
}

/// Constants of the exp approximation used by GeGLU and softmax:
/// exp(y) = 2^n * p(r), n = round(y*log2 e), r = y - n*ln2, |r| <= ln2/2 and
/// p(r) = 1 + r + r^2 (c2 + c3 r + c4 r^2 + c5 r^3 + c6 r^4) (Taylor; the
/// truncation error at |r| = ln2/2 is below 2e-7 relative).
pub mod expc {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const LN2: f32 = std::f32::consts::LN_2;
    /// Below this, 2^n would leave the normal range; exp is ~1e-38 anyway.
    pub const LO: f32 = -87.0;
    /// Above this, 2^n would overflow the exponent field.
    pub const HI: f32 = 88.0;
    pub const C: [f32; 5] = [1.0 / 2.0, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0];
}

/// Registers holding the exp constants, loaded once per call.
#[derive(Clone, Copy)]
pub struct ExpRegs {
    pub lo: u8,
    pub hi: Option<u8>,
    pub log2e: u8,
    pub ln2: u8,
    pub c: [u8; 5],
    pub one: u8,
}

impl ExpRegs {
    pub fn load(&self, ops: &mut Asm) {
        broadcast_const(ops, self.lo, expc::LO.to_bits());
        if let Some(hi) = self.hi {
            broadcast_const(ops, hi, expc::HI.to_bits());
        }
        broadcast_const(ops, self.log2e, expc::LOG2E.to_bits());
        broadcast_const(ops, self.ln2, expc::LN2.to_bits());
        for (r, c) in self.c.iter().zip(expc::C) {
            broadcast_const(ops, *r, c.to_bits());
        }
        broadcast_const(ops, self.one, 1.0f32.to_bits());
    }
}

/// y <- exp(y), elementwise, using temps `n`, `p`, `r2`.
pub fn exp_ps(ops: &mut Asm, k: &ExpRegs, y: u8, n: u8, p: u8, r2: u8) {
    dynasm!(ops
        ; .arch x64
        ; vmaxps Ry(y), Ry(y), Ry(k.lo)
    );
    if let Some(hi) = k.hi {
        dynasm!(ops ; .arch x64 ; vminps Ry(y), Ry(y), Ry(hi));
    }
    dynasm!(ops
        ; .arch x64
        ; vmulps Ry(n), Ry(y), Ry(k.log2e)
        ; vroundps Ry(n), Ry(n), 0
        // r = y - n*ln2 in one rounding
        ; vfnmadd231ps Ry(y), Ry(n), Ry(k.ln2)
        ; vmovaps Ry(p), Ry(k.c[4])
        ; vfmadd213ps Ry(p), Ry(y), Ry(k.c[3])
        ; vfmadd213ps Ry(p), Ry(y), Ry(k.c[2])
        ; vfmadd213ps Ry(p), Ry(y), Ry(k.c[1])
        ; vfmadd213ps Ry(p), Ry(y), Ry(k.c[0])
        ; vmulps Ry(r2), Ry(y), Ry(y)
        ; vfmadd213ps Ry(p), Ry(r2), Ry(y)
        ; vaddps Ry(p), Ry(p), Ry(k.one)
        // scale by 2^n: add n to the exponent field
        ; vcvtps2dq Ry(n), Ry(n)
        ; vpslld Ry(n), Ry(n), 23
        ; vpaddd Ry(y), Ry(p), Ry(n)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, Register};

    #[test]
    fn vshufps_takes_its_sources_in_intel_order() {
        for (dst, first, second) in [(7u8, 4u8, 14u8), (0, 1, 2), (12, 15, 3)] {
            let mut ops = new_asm();
            vshufps(&mut ops, dst, first, second, 0x88);
            let bytes = ops.finalize().expect("no labels");
            let mut d = Decoder::with_ip(64, &bytes, 0, DecoderOptions::NONE);
            let ins = d.decode();
            assert_eq!(ins.len(), bytes.len());
            assert_eq!(ins.mnemonic(), Mnemonic::Vshufps);
            let ymm = |n: u8| Register::YMM0 as u32 + u32::from(n);
            assert_eq!(ins.op0_register() as u32, ymm(dst));
            assert_eq!(ins.op1_register() as u32, ymm(first));
            assert_eq!(ins.op2_register() as u32, ymm(second));
            assert_eq!(ins.immediate8(), 0x88);
        }
    }
}
