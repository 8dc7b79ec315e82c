//! GeGLU in AVX2 intrinsics, for a plan whose byte budget left the JIT's
//! GeGLU out (`jit::plan` drops it after unrolling): the JIT kernel's
//! arithmetic (`jit::emit::elementwise::emit_geglu`: `x / (1 + exp(-2u))`
//! with the same polynomial exp), 8 values at a time. The scalar fallback
//! calls libm's `tanhf` per value, with which a Gemma 4 E2B prefill ran at
//! about two thirds of the speed it reaches with the JIT's kernel.

use crate::jit::emit::expc;
use std::arch::x86_64::*;

/// `out = gelu_tanh(gate) · up`, elementwise; the tail past a multiple of
/// 8 values in scalar code.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    let a = (-2.0 * (2.0f64 / std::f64::consts::PI).sqrt()) as f32;
    let b = a * 0.044_715;
    let whole = gate.len() / 8 * 8;
    // SAFETY: every load and store covers 8 values below `whole`, inside
    // the three slices (asserted equal in length); AVX2 and FMA per the
    // function's contract.
    unsafe {
        let (va, vb) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let one = _mm256_set1_ps(1.0);
        for i in (0..whole).step_by(8) {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            // -2u = x (a + b x²)
            let arg = _mm256_mul_ps(_mm256_fmadd_ps(_mm256_mul_ps(x, x), vb, va), x);
            let e = exp_ps(arg);
            let g = _mm256_div_ps(x, _mm256_add_ps(e, one));
            let y = _mm256_mul_ps(g, _mm256_loadu_ps(up.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
        }
    }
    for i in whole..gate.len() {
        out[i] = super::ops::gelu_tanh(gate[i]) * up[i];
    }
}

/// exp of 8 values as the JIT's `exp_ps`: clamped, 2^n times a degree-6
/// polynomial of the remainder.
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp_ps(y: __m256) -> __m256 {
    let y = _mm256_min_ps(
        _mm256_max_ps(y, _mm256_set1_ps(expc::LO)),
        _mm256_set1_ps(expc::HI),
    );
    let n =
        _mm256_round_ps::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(y, _mm256_set1_ps(expc::LOG2E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(expc::LN2), y);
    let c = expc::C.map(|c| _mm256_set1_ps(c));
    let mut p = _mm256_fmadd_ps(c[4], r, c[3]);
    p = _mm256_fmadd_ps(p, r, c[2]);
    p = _mm256_fmadd_ps(p, r, c[1]);
    p = _mm256_fmadd_ps(p, r, c[0]);
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0));
    let scale = _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(n));
    _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), scale))
}

#[cfg(test)]
mod tests {
    #[test]
    fn it_follows_the_tanh_form_within_float_rounding() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            panic!("the JIT's hosts have AVX2 and FMA; this one does not");
        }
        let gate: Vec<f32> = (0..203).map(|i| (i as f32 - 100.0) * 0.07).collect();
        let up: Vec<f32> = (0..203).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut out = vec![0.0f32; 203];
        // SAFETY: AVX2 and FMA detected above.
        unsafe { super::geglu(&gate, &up, &mut out) };
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            let want = crate::engine::ops::gelu_tanh(g) * u;
            assert!(
                (o - want).abs() <= 1e-5 * want.abs().max(1.0),
                "gate {g}: {o} against {want}"
            );
        }
    }
}
