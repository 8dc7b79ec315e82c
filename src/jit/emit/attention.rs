//! Attention kernels besides the scores (an f32 GEMM over the KV cache, see
//! gemm.rs): softmax in place, and the probability-weighted sum of V rows for
//! a block of queries. The KV cache keeps each KV head's rows contiguous
//! (`[kv_head][pos][head_dim]`), so a block of queries sharing a KV head
//! reads one dense run of rows.

use super::reg::*;
use super::{
    Asm, ExpRegs, LANES, alias_missing, cmp_imm8, count_mask, exp_ps, finish, hsum, lane_index,
    new_asm, restore_callee_saved_and_return, save_callee_saved,
};
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

/// Queries per register tile of the weighted sum.
pub const WSUM_QUERIES: usize = 6;
const WSUM_P_PTRS: [u8; WSUM_QUERIES] = [RBX, R11, R12, R13, R14, R15];

/// `vbroadcastss ymm(dst), dword [base + index*4]`, hand-encoded (VEX.256.66.0F38.W0 18 /r):
/// dynasm 5.1 encodes the ymm-from-memory form as the xmm one.
fn broadcast_mem_x4(ops: &mut Asm, dst: u8, base: u8, index: u8) {
    let inv = |bit: u8| !bit & 1;
    ops.push(0xC4);
    ops.push((inv(dst >> 3) << 7) | (inv(index >> 3) << 6) | (inv(base >> 3) << 5) | 0b00010);
    ops.push(0x7D); // W0, vvvv unused (1111), L=256, pp=66
    ops.push(0x18);
    // mod=01 with a zero disp8 works for every base, rbp and r13 included.
    ops.push(0b01_000_100 | ((dst & 7) << 3));
    ops.push(0b10_000_000 | ((index & 7) << 3) | (base & 7));
    ops.push(0);
}

/// `extern "sysv64" fn(p, ldp, v, n_keys, out, nq)`: for each of `nq`
/// queries i, `out[i][d] = sum_j P[i*ldp + j] * V[j][d]` over `j < n_keys`,
/// V and out rows `head_dim` floats long and contiguous.
///
/// Every query of a tile shares each V load: 6 queries x 16 dims in 12
/// accumulators, per key two V vectors, six broadcast probabilities and 12
/// FMAs (a single query would need a load per FMA). The grouped-query heads
/// of a token and the tokens of a prefill chunk all read the same V rows.
/// A partial last tile aliases its missing queries to the first one and
/// stores only the real rows.
///
/// Registers: rdi = P of the tile, rsi = ldp in bytes, rdx = V, rcx =
/// n_keys, r8 = out of the tile, r9 = queries left, r10 = V cursor, rbp =
/// byte offset of the dims block, rax = key; rbx, r11..r15 = P rows.
pub fn emit_wsum(head_dim: usize, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        head_dim.is_multiple_of(LANES),
        "{name}: head_dim {head_dim} must be a multiple of 8"
    );
    let row_b = (head_dim * 4) as i32;
    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let tile = ops.new_dynamic_label();
    save_callee_saved(&mut ops);
    dynasm!(ops
        ; .arch x64
        ; shl rsi, 2
        ; test r9, r9
        ; jz =>done
    );
    let tile_top = ops.offset();
    dynasm!(ops ; .arch x64 ; =>tile ; mov rbx, rdi);
    for i in 1..WSUM_QUERIES {
        let (prev, cur) = (WSUM_P_PTRS[i - 1], WSUM_P_PTRS[i]);
        dynasm!(ops ; .arch x64 ; lea Rq(cur), [Rq(prev) + rsi]);
    }
    alias_missing(&mut ops, &WSUM_P_PTRS, R9);
    dynasm!(ops ; .arch x64 ; xor ebp, ebp);
    // One block of `nv` vectors (8 dims each) of every query in the tile.
    let block = |ops: &mut Asm, nv: usize| {
        let acc = |q: usize, v: usize| (q * nv + v) as u8;
        let kloop = ops.new_dynamic_label();
        let stored = ops.new_dynamic_label();
        let sum = ops.new_dynamic_label();
        for a in 0..(WSUM_QUERIES * nv) as u8 {
            dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
        }
        dynasm!(ops
            ; .arch x64
            ; test rcx, rcx
            ; jz =>sum
            ; lea r10, [rdx + rbp]
            ; xor eax, eax
        );
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>kloop);
        for v in 0..nv {
            dynasm!(ops ; .arch x64 ; vmovups Ry(12 + v as u8), [BYTE r10 + (v * 32) as i8]);
        }
        for (q, &pr) in WSUM_P_PTRS.iter().enumerate() {
            broadcast_mem_x4(ops, 14, pr, RAX);
            for v in 0..nv {
                dynasm!(ops ; .arch x64 ; vfmadd231ps Ry(acc(q, v)), Ry(12 + v as u8), ymm14);
            }
        }
        dynasm!(ops
            ; .arch x64
            ; add r10, row_b
            ; inc rax
            ; cmp rax, rcx
        );
        jback!(ops, jb, kloop, top);
        dynasm!(ops ; .arch x64 ; =>sum ; lea rax, [r8 + rbp]);
        for q in 0..WSUM_QUERIES {
            if q > 0 {
                cmp_imm8(ops, R9, (q + 1) as i8);
                dynasm!(ops ; .arch x64 ; jb =>stored ; add rax, row_b);
            }
            for v in 0..nv {
                dynasm!(ops ; .arch x64 ; vmovups [BYTE rax + (v * 32) as i8], Ry(acc(q, v)));
            }
        }
        dynasm!(ops ; .arch x64 ; =>stored);
    };
    let pairs = head_dim / (2 * LANES);
    if pairs > 0 {
        let dloop = ops.new_dynamic_label();
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>dloop);
        block(&mut ops, 2);
        dynasm!(ops
            ; .arch x64
            ; add rbp, BYTE 64
            ; cmp rbp, (pairs * 64) as i32
        );
        jback!(ops, jb, dloop, top);
    }
    if !head_dim.is_multiple_of(2 * LANES) {
        block(&mut ops, 1);
    }
    // Next tile of queries.
    dynasm!(ops
        ; .arch x64
        ; lea rdi, [rdi + rsi * 2]
        ; lea rdi, [rdi + rsi * 4]
        ; add r8, (WSUM_QUERIES as i32) * row_b
        ; sub r9, BYTE WSUM_QUERIES as i8
    );
    jback!(ops, ja, tile, tile_top);
    dynasm!(ops
        ; .arch x64
        ; =>done
    );
    restore_callee_saved_and_return(&mut ops);
    finish(ops, name)
}
