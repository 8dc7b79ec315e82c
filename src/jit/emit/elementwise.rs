//! Per-token vector ops of the hot path: RMSNorm, split-half RoPE, GeGLU.
//! Vector widths are baked in; tails use AVX2 masked loads/stores (f32 lanes)
//! or, where the output cannot alias the input, an overlapping last vector.

use super::{ExpRegs, LANES, add_rax, exp_ps, hsum, lane_mask, new_asm, return_at};
use crate::jback;
use dynasmrt::{DynasmApi, DynasmLabelApi, dynasm};

const MASK: u8 = 15;

/// `extern "sysv64" fn(x, w, out, rows, eps: f32)`: for each of `rows`
/// vectors of `dim` floats, out = x / sqrt(mean(x^2) + eps) * w. `out` may
/// equal `x` (masked tail stores never touch other elements).
pub fn emit_rmsnorm(dim: usize, unroll: usize, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        matches!(unroll, 1 | 2 | 4),
        "{name}: unroll must be 1, 2 or 4"
    );
    let step = LANES * unroll;
    let main = dim / step * step;
    let rest = (dim - main) / LANES;
    let tail = dim % LANES;
    let tail_off = ((dim - tail) as i32 - main as i32) * 4;
    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let row = ops.new_dynamic_label();
    let l1 = ops.new_dynamic_label();
    let l2 = ops.new_dynamic_label();
    let vmain = (dim / LANES * LANES) as i32;
    dynasm!(ops
        ; .arch x64
        ; vmovaps xmm14, xmm0
        ; test rcx, rcx
        ; jz =>done
    );
    if tail > 0 {
        lane_mask(&mut ops, MASK, 0, tail);
    }
    let row_top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>row
        ; lea r8, [rdi + (main * 4) as i32]
    );
    for a in 0..unroll as u8 {
        dynasm!(ops ; .arch x64 ; vxorps Ry(a), Ry(a), Ry(a));
    }
    if main > 0 {
        dynasm!(ops ; .arch x64 ; mov rax, -((main * 4) as i32));
        let top = ops.offset();
        dynasm!(ops ; .arch x64 ; =>l1);
        for j in 0..unroll {
            dynasm!(ops ; .arch x64
                ; vmovups ymm8, [r8 + rax + (j * 32) as i32]
                ; vfmadd231ps Ry(j as u8), ymm8, ymm8);
        }
        add_rax(&mut ops, (step * 4) as i32);
        jback!(ops, jnz, l1, top);
    }
    for v in 0..rest {
        dynasm!(ops ; .arch x64
            ; vmovups ymm8, [r8 + (v * 32) as i32]
            ; vfmadd231ps Ry((v % unroll) as u8), ymm8, ymm8);
    }
    if tail > 0 {
        dynasm!(ops ; .arch x64
            ; vmaskmovps ymm8, Ry(MASK), [r8 + tail_off]
            ; vfmadd231ps ymm0, ymm8, ymm8);
    }
    for a in 1..unroll as u8 {
        dynasm!(ops ; .arch x64 ; vaddps ymm0, ymm0, Ry(a));
    }
    hsum(&mut ops, 0, 1);
    dynasm!(ops
        ; .arch x64
        ; mov eax, (1.0f32 / dim as f32).to_bits() as i32
        ; vmovd xmm1, eax
        ; vmulss xmm0, xmm0, xmm1
        ; vaddss xmm0, xmm0, xmm14
        ; vsqrtss xmm0, xmm0, xmm0
        ; mov eax, 1.0f32.to_bits() as i32
        ; vmovd xmm1, eax
        ; vdivss xmm0, xmm1, xmm0
        ; vbroadcastss ymm0, xmm0
    );
    // Second pass: one vector per step; index over all whole vectors.
    if vmain > 0 {
        dynasm!(ops
            ; .arch x64
            ; mov rax, -(vmain * 4)
            ; lea r8, [rdi + vmain * 4]
            ; lea r9, [rsi + vmain * 4]
            ; lea r10, [rdx + vmain * 4]
            ; =>l2
            ; vmulps ymm8, ymm0, [r8 + rax]
            ; vmulps ymm8, ymm8, [r9 + rax]
            ; vmovups [r10 + rax], ymm8
            ; add rax, BYTE 32
            ; jnz BYTE =>l2
        );
    }
    if tail > 0 {
        dynasm!(ops
            ; .arch x64
            ; vmaskmovps ymm8, Ry(MASK), [rdi + vmain * 4]
            ; vmaskmovps ymm9, Ry(MASK), [rsi + vmain * 4]
            ; vmulps ymm8, ymm8, ymm0
            ; vmulps ymm8, ymm8, ymm9
            ; vmaskmovps [rdx + vmain * 4], Ry(MASK), ymm8
        );
    }
    dynasm!(ops
        ; .arch x64
        ; add rdi, (dim * 4) as i32
        ; add rdx, (dim * 4) as i32
        ; dec rcx
    );
    jback!(ops, jnz, row, row_top);
    return_at(ops, done, name)
}

/// `extern "sysv64" fn(gate, up, out, rows)`: out = gelu_tanh(gate) * up over
/// `rows * width` contiguous floats (`rows * width >= 8`). gelu_tanh(x) =
/// x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), computed as
/// x / (1 + exp(-2u)). `out` must not alias the inputs: the last vector
/// overlaps the previous one.
pub fn emit_geglu(width: usize, name: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(width >= 1, "{name}: width must be positive");
    let k = ExpRegs {
        lo: 5,
        hi: Some(6),
        log2e: 7,
        ln2: 8,
        c: [9, 10, 11, 12, 13],
        one: 14,
    };
    // arg = x * (a + b x^2) = -2u
    let a = -2.0 * (2.0f64 / std::f64::consts::PI).sqrt();
    let b = a * 0.044715;
    const CA: u8 = 15;
    const R2: u8 = 4;
    let mut ops = new_asm();
    let done = ops.new_dynamic_label();
    let body = ops.new_dynamic_label();
    dynasm!(ops
        ; .arch x64
        ; imul rcx, rcx, (width * 4) as i32
        ; test rcx, rcx
        ; jz =>done
        ; lea r8, [rcx - 32]
        ; xor r9, r9
    );
    k.load(&mut ops);
    super::broadcast_const(&mut ops, CA, (a as f32).to_bits());
    dynasm!(ops
        ; .arch x64
        // b lives in memory below rsp (red zone) because all 16 registers are taken.
        ; mov DWORD [rsp - 4], (b as f32).to_bits() as i32
    );
    let top = ops.offset();
    dynasm!(ops
        ; .arch x64
        ; =>body
        ; vmovups ymm0, [rdi + r9]
        ; vmulps ymm1, ymm0, ymm0
        ; vmovss xmm2, [rsp - 4]
        ; vbroadcastss ymm2, xmm2
        ; vfmadd213ps ymm1, ymm2, Ry(CA)
        ; vmulps ymm1, ymm1, ymm0
    );
    exp_ps(&mut ops, &k, 1, 2, 3, R2);
    dynasm!(ops
        ; .arch x64
        ; vaddps ymm1, ymm1, Ry(k.one)
        ; vdivps ymm0, ymm0, ymm1
        ; vmulps ymm0, ymm0, [rsi + r9]
        ; vmovups [rdx + r9], ymm0
        ; add r9, BYTE 32
        ; cmp r9, r8
    );
    // Whole vectors while they fit; then one vector ending exactly at n.
    jback!(ops, jle, body, top);
    dynasm!(ops
        ; .arch x64
        ; cmp r9, rcx
        ; jae BYTE =>done
        ; mov r9, r8
    );
    jback!(ops, jmp, body, top);
    return_at(ops, done, name)
}
