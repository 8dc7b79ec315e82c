//! One step's final distribution: what a draw would return and with what
//! probability, for speculative decoding's acceptance test.

use super::Sampler;

/// One step's final distribution, as [`Sampler::distribution`] computed
/// it. Holds the sampler so that [`Distribution::draw`] uses its random
/// stream.
pub struct Distribution<'s> {
    pub(super) sampler: &'s mut Sampler,
    /// The token when no draw is needed: greedy decoding, or a row where
    /// the softmax is undefined.
    pub(super) certain: Option<u32>,
}

impl Distribution<'_> {
    /// Sum of the survivors' weights: the filters leave them unnormalized,
    /// and the draw scales its random number by this sum.
    fn total(&self) -> f64 {
        self.sampler.cands.iter().map(|c| f64::from(c.p)).sum()
    }

    /// The token this step takes whatever the random draw, if any.
    pub fn certain(&self) -> Option<u32> {
        self.certain
    }

    /// The probability that [`Distribution::draw`] returns `id`.
    pub fn probability(&self, id: u32) -> f64 {
        match self.certain {
            Some(c) => f64::from(u8::from(c == id)),
            None => self
                .sampler
                .cands
                .iter()
                .find(|c| c.id == id)
                .map_or(0.0, |c| f64::from(c.p) / self.total()),
        }
    }

    /// Every token with a nonzero probability and that probability.
    pub fn support(&self) -> Vec<(u32, f64)> {
        match self.certain {
            Some(c) => vec![(c, 1.0)],
            None => {
                let total = self.total();
                self.sampler
                    .cands
                    .iter()
                    .filter(|c| c.p > 0.0)
                    .map(|c| (c.id, f64::from(c.p) / total))
                    .collect()
            }
        }
    }

    /// Draws a token, consuming one random number unless it is certain.
    pub fn draw(self) -> u32 {
        match self.certain {
            Some(id) => id,
            None => self.sampler.draw(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::sample::tests::{cfg, logits_for};
    use crate::sample::{Sampler, SamplerConfig};

    #[test]
    fn drawing_from_the_distribution_is_sampling() {
        // The same seed through `sample` and through `distribution().draw()`
        // gives the same tokens: the split changes no random number.
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let recent = [5u32, 17, 17, 250];
        let c = SamplerConfig {
            top_k: 50,
            top_p: 0.9,
            min_p: 0.02,
            repeat_penalty: 1.3,
            ..cfg()
        };
        let mut a = Sampler::new(c, 77);
        let mut b = Sampler::new(c, 77);
        for _ in 0..200 {
            assert_eq!(
                a.sample(&logits, &recent),
                b.distribution(&logits, &recent).draw()
            );
        }
    }

    #[test]
    fn distribution_probabilities_are_the_filtered_softmax() {
        // top-k 3 over p ∝ [0.4, 0.3, 0.1, 0.1, 0.1] keeps ids 0, 1, 2 with
        // 0.5, 0.375, 0.125 (as in filters_compose_in_order).
        let logits = logits_for(&[0.4, 0.3, 0.1, 0.1, 0.1]);
        let mut s = Sampler::new(SamplerConfig { top_k: 3, ..cfg() }, 0);
        let d = s.distribution(&logits, &[]);
        assert_eq!(d.certain(), None);
        for (id, want) in [(0, 0.5), (1, 0.375), (2, 0.125), (3, 0.0), (4, 0.0)] {
            assert!(
                (d.probability(id) - want).abs() < 1e-6,
                "p({id}) = {}",
                d.probability(id)
            );
        }
        let support = d.support();
        assert_eq!(support.len(), 3);
        assert!((support.iter().map(|s| s.1).sum::<f64>() - 1.0).abs() < 1e-9);
        // Greedy: the argmax with probability 1, and no random number used.
        let mut g = Sampler::new(SamplerConfig::greedy(), 0);
        let d = g.distribution(&logits, &[]);
        assert_eq!(d.certain(), Some(0));
        assert_eq!((d.probability(0), d.probability(1)), (1.0, 0.0));
        assert_eq!(d.support(), vec![(0, 1.0)]);
    }
}
