//! Matrix-product inputs quantized to 8 bits for the integer kernels: each
//! token's activations in blocks of 32, an f32 scale per block (llama.cpp's
//! Q8_0 rule, `d = max|x| / 127`, `q = round(x / d)`, with the scale kept
//! in f32 rather than f16).
//!
//! Quantized once per product, before its rows are split across threads:
//! every thread's chunk of rows reads the same quantized input.
//!
//! Per token the bytes are the K quants, then the K/32 scales (f32, little
//! endian), then the K/32 sums of each block's quants (i32), which a weight
//! format stored with an offset needs (Q5_0: w = v - 16, so w · x = v · x -
//! 16 · sum(x)). The kernel reads a group's 32 quants with one load, its
//! scale and its sum with one each.

use crate::model::quant_blocks::GROUP_COLS;

pub struct Q8Input {
    bytes: Vec<u8>,
    k: usize,
    tokens: usize,
}

impl Q8Input {
    /// Bytes one token takes.
    pub fn token_bytes(k: usize) -> usize {
        k + k / GROUP_COLS * 8
    }

    /// Quantizes `x` (`[tokens, k]`, row-major); `k` must be a multiple of 32.
    pub fn quantize(x: &[f32], k: usize) -> Q8Input {
        assert!(
            k > 0 && k.is_multiple_of(GROUP_COLS) && x.len().is_multiple_of(k),
            "Q8 input of {} values with K {k}",
            x.len()
        );
        let tokens = x.len() / k;
        let stride = Self::token_bytes(k);
        let mut bytes = vec![0u8; tokens * stride];
        for (row, out) in x.chunks_exact(k).zip(bytes.chunks_exact_mut(stride)) {
            let (quants, rest) = out.split_at_mut(k);
            let (scales, sums) = rest.split_at_mut(k / GROUP_COLS * 4);
            for (((block, q), s), sum) in row
                .chunks_exact(GROUP_COLS)
                .zip(quants.chunks_exact_mut(GROUP_COLS))
                .zip(scales.chunks_exact_mut(4))
                .zip(sums.chunks_exact_mut(4))
            {
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                for (q, &v) in q.iter_mut().zip(block) {
                    // |v * inv| <= 127 (up to rounding), so the cast never saturates wrongly.
                    *q = ((v * inv).round() as i8) as u8;
                }
                s.copy_from_slice(&d.to_le_bytes());
                let total: i32 = q.iter().map(|&b| i32::from(b as i8)).sum();
                sum.copy_from_slice(&total.to_le_bytes());
            }
        }
        Q8Input { bytes, k, tokens }
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Token `t`'s quants and scales, as the kernel reads them.
    pub fn token(&self, t: usize) -> &[u8] {
        let stride = Self::token_bytes(self.k);
        &self.bytes[t * stride..(t + 1) * stride]
    }

    /// Token `t`'s group `g`: its scale and 32 quants.
    pub fn group(&self, t: usize, g: usize) -> (f32, &[u8]) {
        let token = self.token(t);
        let at = self.k + g * 4;
        let d = f32::from_le_bytes([token[at], token[at + 1], token[at + 2], token[at + 3]]);
        (d, &token[g * GROUP_COLS..(g + 1) * GROUP_COLS])
    }
}

/// The integer dot product of a group's weight values and its input
/// quants (signed bytes stored as u8).
pub fn dot_i8(weights: &[i8], quants: &[u8]) -> i32 {
    weights
        .iter()
        .zip(quants)
        .map(|(&w, &q)| i32::from(w) * i32::from(q as i8))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_values_are_within_half_a_step() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 29 % 71) as f32 - 35.0) / 7.0)
            .collect();
        let q = Q8Input::quantize(&x, 64);
        assert_eq!(q.tokens(), 2);
        for t in 0..2 {
            for g in 0..2 {
                let (d, quants) = q.group(t, g);
                let block = &x[t * 64 + g * 32..][..32];
                let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert!((d - amax / 127.0).abs() <= f32::EPSILON * amax);
                for (&b, &v) in quants.iter().zip(block) {
                    let back = d * f32::from(b as i8);
                    assert!((back - v).abs() <= d * 0.5 + 1e-6, "{v} -> {back}");
                }
            }
        }
    }

    #[test]
    fn a_zero_block_has_zero_scale_and_quants() {
        let q = Q8Input::quantize(&[0.0; 32], 32);
        let (d, quants) = q.group(0, 0);
        assert_eq!(d, 0.0);
        assert!(quants.iter().all(|&b| b == 0));
    }
}
