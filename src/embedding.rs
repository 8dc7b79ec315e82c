//! Embeddings: a text's vector is the mean of its tokens' final hidden
//! states (after the final norm: the LM head's input), BOS included,
//! scaled to length 1 as OpenAI's embeddings are. `pulsar embed` and the
//! server's `/v1/embeddings` both pool with [`MeanPool`].

use crate::engine::Engine;
use anyhow::{Result, bail};

/// The running sum of a text's final hidden states, for its embedding.
pub struct MeanPool {
    sum: Vec<f64>,
    rows: usize,
}

impl MeanPool {
    pub fn new(width: usize) -> MeanPool {
        MeanPool {
            sum: vec![0.0; width],
            rows: 0,
        }
    }

    /// Adds rows of `sum.len()` values each.
    pub fn add(&mut self, rows: &[f32]) {
        for row in rows.chunks_exact(self.sum.len()) {
            for (s, &v) in self.sum.iter_mut().zip(row) {
                *s += f64::from(v);
            }
            self.rows += 1;
        }
    }

    /// The mean row scaled to length 1 (as OpenAI's embeddings are, so a
    /// dot product is the cosine similarity).
    pub fn unit_mean(&self) -> Vec<f32> {
        let norm = self.sum.iter().map(|v| v * v).sum::<f64>().sqrt();
        // The mean's direction is the sum's; a zero sum stays zero.
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        self.sum.iter().map(|v| (v * scale) as f32).collect()
    }
}

/// The embedding of `tokens` fed to an empty `engine` (its cache is left
/// holding them).
pub fn embed(engine: &mut dyn Engine, tokens: &[u32]) -> Result<Vec<f32>> {
    if tokens.is_empty() {
        bail!("nothing to embed: the text has no tokens");
    }
    let width = engine.config().hidden;
    let mut pool = MeanPool::new(width);
    pool.add(&engine.final_hidden(tokens)?);
    Ok(pool.unit_mean())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_is_scaled_to_length_one() {
        let mut pool = MeanPool::new(2);
        pool.add(&[3.0, 0.0, 1.0, 4.0]);
        let v = pool.unit_mean();
        // The mean (2, 2) has the direction of (1, 1).
        let half_root_two = std::f32::consts::FRAC_1_SQRT_2;
        assert!((v[0] - half_root_two).abs() < 1e-7 && (v[1] - half_root_two).abs() < 1e-7);
        assert_eq!(pool.rows, 2);
        assert_eq!(MeanPool::new(3).unit_mean(), vec![0.0; 3]);
    }
}
