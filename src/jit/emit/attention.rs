//! Attention over one query head: scores (a scaled f32 GEMV over the KV
//! cache, see gemv.rs), softmax in place, and the probability-weighted sum of
//! V rows. The KV cache layout is `[pos][kv_head][head_dim]`; the stride
//! between positions is baked in.

use super::{Asm, ExpRegs, LANES, count_mask, exp_ps, finish, hsum, lane_index, new_asm};
use crate::jback;
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

/// `extern "sysv64" fn(x, n)`: x[..n] <- softmax(x[..n]) in place, n >= 1.
pub fn emit_softmax(name: &str) -> anyhow::Result<Vec<u8>> {
    // ymm0 running max / sum, ymm1..4 exp temps, ymm5 mask, ymm6 index temp,
    // ymm7..15 exp constants (the softmax argument is <= 0: no upper clamp).
    let k = ExpRegs {
        lo: 7,
        hi: None,
        log2e: 8,
        ln2: 9,
        c: [10, 11, 12, 13, 14],
        one: 15,
    };
    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let max_loop = ops.new_dynamic_label();
    let max_tail = ops.new_dynamic_label();
    let exp_loop = ops.new_dynamic_label();
    let exp_tail = ops.new_dynamic_label();
    let norm_loop = ops.new_dynamic_label();
    let norm_tail = ops.new_dynamic_label();
    let finish_lbl = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; test rsi, rsi
        ; jz =>done
        // r8 = bytes in whole vectors, r9 = tail lanes
        ; mov r8, rsi
        ; and r8, -8
        ; shl r8, 2
        ; mov r9, rsi
        ; and r9, 7
    );
    lane_index(&mut ops, 6);
    count_mask(&mut ops, 5, 6, super::reg::R9);
    // Pass 1: max. Masked-off tail lanes become -inf.
    dynasm!(ops
        ; .arch x64
        ; mov eax, f32::NEG_INFINITY.to_bits() as i32
        ; vmovd xmm0, eax
        ; vbroadcastss ymm0, xmm0
        ; vmovaps ymm6, ymm0
        ; xor rax, rax
        ; =>max_loop
        ; cmp rax, r8
        ; jae BYTE =>max_tail
        ; vmaxps ymm0, ymm0, [rdi + rax]
        ; add rax, 32
        ; jmp BYTE =>max_loop
        ; =>max_tail
        ; vmaskmovps ymm1, ymm5, [rdi + rax]
        ; vblendvps ymm1, ymm6, ymm1, ymm5
        ; vmaxps ymm0, ymm0, ymm1
        ; vextractf128 xmm1, ymm0, 1
        ; vmaxps xmm0, xmm0, xmm1
        ; vmovhlps xmm1, xmm1, xmm0
        ; vmaxps xmm0, xmm0, xmm1
        ; vmovshdup xmm1, xmm0
        ; vmaxss xmm0, xmm0, xmm1
        ; vbroadcastss ymm6, xmm0
        ; vxorps ymm0, ymm0, ymm0
    );
    k.load(&mut ops);
    // Pass 2: x <- exp(x - max), sum in ymm0.
    let exp_step = |ops: &mut Asm| {
        dynasm!(ops ; .arch x64 ; vsubps ymm1, ymm1, ymm6);
        exp_ps(ops, &k, 1, 2, 3, 4);
    };
    dynasm!(ops
        ; .arch x64
        ; xor rax, rax
        ; =>exp_loop
        ; cmp rax, r8
        ; jae BYTE =>exp_tail
        ; vmovups ymm1, [rdi + rax]
    );
    exp_step(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; vaddps ymm0, ymm0, ymm1
        ; vmovups [rdi + rax], ymm1
        ; add rax, 32
        ; jmp BYTE =>exp_loop
        ; =>exp_tail
        ; test r9, r9
        ; jz BYTE =>finish_lbl
        ; vmaskmovps ymm1, ymm5, [rdi + rax]
    );
    exp_step(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; vandps ymm1, ymm1, ymm5
        ; vaddps ymm0, ymm0, ymm1
        ; vmaskmovps [rdi + rax], ymm5, ymm1
        ; =>finish_lbl
    );
    hsum(&mut ops, 0, 1);
    dynasm!(ops
        ; .arch x64
        ; vdivss xmm0, xmm15, xmm0
        ; vbroadcastss ymm0, xmm0
        // Pass 3: scale by 1/sum.
        ; xor rax, rax
        ; =>norm_loop
        ; cmp rax, r8
        ; jae BYTE =>norm_tail
        ; vmulps ymm1, ymm0, [rdi + rax]
        ; vmovups [rdi + rax], ymm1
        ; add rax, 32
        ; jmp BYTE =>norm_loop
        ; =>norm_tail
        ; test r9, r9
        ; jz BYTE =>done
        ; vmaskmovps ymm1, ymm5, [rdi + rax]
        ; vmulps ymm1, ymm1, ymm0
        ; vmaskmovps [rdi + rax], ymm5, ymm1
        ; =>done
        ; vzeroupper
        ; ret
    );
    finish(ops, name)
}

/// `extern "sysv64" fn(p, v, out, n_pos)`: `out[d] = sum_t p[t] * V[t][d]` for
/// d < head_dim, V rows `stride` floats apart. Accumulates chunks of up to 64
/// floats in eight registers; n_pos = 0 gives zeros.
pub fn emit_wsum(head_dim: usize, stride: usize, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        head_dim.is_multiple_of(LANES),
        "{name}: head_dim {head_dim} must be a multiple of 8"
    );
    const CHUNK: usize = 8 * LANES;
    let full = head_dim / CHUNK;
    let rest = (head_dim % CHUNK) / LANES;
    let stride_b = (stride * 4) as i32;
    let mut ops = new_asm();
    // One chunk of `nv` vectors starting at byte offset r8 of V and out.
    let chunk = |ops: &mut Asm, nv: usize| {
        let tloop = ops.new_dynamic_label();
        let store = ops.new_dynamic_label();
        for a in 0..nv as u8 {
            dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
        }
        dynasm!(ops
            ; .arch x64
            ; test rcx, rcx
            ; jz BYTE =>store
            ; xor eax, eax
            ; lea r9, [rsi + r8]
        );
        let top = ops.offset();
        dynasm!(ops
            ; .arch x64
            ; =>tloop
            ; vmovss xmm8, [rdi + rax * 4]
            ; vbroadcastss ymm8, xmm8
        );
        for a in 0..nv {
            let r = a as u8;
            match i8::try_from(a * 32) {
                Ok(d) => dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(r), ymm8, [BYTE r9 + d]),
                Err(_) => {
                    dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(r), ymm8, [r9 + (a * 32) as i32])
                }
            }
        }
        dynasm!(ops
            ; .arch x64
            ; add r9, stride_b
            ; inc rax
            ; cmp rax, rcx
        );
        jback!(ops, jb, tloop, top);
        dynasm!(ops ; .arch x64 ; =>store);
        for a in 0..nv {
            let r = a as u8;
            match i8::try_from(a * 32) {
                Ok(d) => dynasm!(ops ; .arch x64 ; vmovups [BYTE rdx + r8 + d], Ry(r)),
                Err(_) => dynasm!(ops ; .arch x64 ; vmovups [rdx + r8 + (a * 32) as i32], Ry(r)),
            }
        }
    };
    dynasm!(ops ; .arch x64 ; xor r8d, r8d);
    if full > 0 {
        let cl = ops.new_dynamic_label();
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>cl);
        chunk(&mut ops, 8);
        dynasm!(ops
            ; .arch x64
            ; add r8, (CHUNK * 4) as i32
            ; cmp r8, (full * CHUNK * 4) as i32
        );
        jback!(ops, jb, cl, top);
    }
    if rest > 0 {
        chunk(&mut ops, rest);
    }
    dynasm!(ops ; .arch x64 ; vzeroupper ; ret);
    finish(ops, name)
}
