//! The final logit softcap, `cap · tanh(x / cap)`, 8 logits at a time in
//! AVX2: `tanh(|y|) = 1 - 2 / (1 + e^(2|y|))` with the JIT's exp (the AVX2
//! GeGLU's `exp_ps`). libm's `tanhf` per logit, on one thread, was 1.2%
//! of a Gemma 3n E2B decode step's `perf` samples (262,400 logits).

use super::geglu_avx2::exp_ps;
use std::arch::x86_64::*;

/// `x = cap · tanh(x / cap)` in place; the tail past a multiple of 8
/// values in scalar code. A NaN stays NaN.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softcap(x: &mut [f32], cap: f32) {
    let whole = x.len() / 8 * 8;
    // SAFETY: every load and store covers 8 values below `whole`, inside
    // `x`; AVX2 and FMA per the function's contract.
    unsafe {
        let (two_over_cap, two_cap) = (_mm256_set1_ps(2.0 / cap), _mm256_set1_ps(2.0 * cap));
        let (vcap, one) = (_mm256_set1_ps(cap), _mm256_set1_ps(1.0));
        let sign_bit = _mm256_set1_ps(-0.0);
        for i in (0..whole).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            // On |x|, whose quotient is at most cap, so the difference
            // keeps its precision; the sign goes back on after.
            let sign = _mm256_and_ps(v, sign_bit);
            let e = exp_ps(_mm256_mul_ps(_mm256_xor_ps(v, sign), two_over_cap));
            let y = _mm256_sub_ps(vcap, _mm256_div_ps(two_cap, _mm256_add_ps(one, e)));
            let y = _mm256_or_ps(y, sign);
            // exp's clamp would turn a NaN into ±cap.
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            _mm256_storeu_ps(x.as_mut_ptr().add(i), _mm256_blendv_ps(y, v, nan));
        }
    }
    for v in &mut x[whole..] {
        *v = super::ops::softcap(*v, cap);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn it_follows_libm_within_a_millionth_of_the_cap() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            panic!("the JIT's hosts have AVX2 and FMA; this one does not");
        }
        let cap = 30.0;
        let mut x: Vec<f32> = (0..4003).map(|i| (i as f32 - 2001.0) * 0.05).collect();
        x.extend([f32::NAN, 1e30, -1e30, 0.0, 3000.0, -3000.0, 1e-6]);
        let want: Vec<f32> = x
            .iter()
            .map(|&v| crate::engine::ops::softcap(v, cap))
            .collect();
        // SAFETY: AVX2 and FMA detected above.
        unsafe { super::softcap(&mut x, cap) };
        let mut worst = 0.0f32;
        for (&got, &want) in x.iter().zip(&want) {
            if want.is_nan() {
                assert!(got.is_nan());
            } else {
                assert!((got - want).abs() <= 1e-6 * cap, "{got} against {want}");
                worst = worst.max((got - want).abs());
            }
        }
        eprintln!("largest difference {worst:e} at cap {cap}");
    }
}
