//! Perplexity and its standard error from per-token negative
//! log-likelihoods.

/// Running sums of the per-token NLL, enough for the mean and variance.
#[derive(Clone, Copy, Debug, Default)]
pub struct NllStats {
    sum: f64,
    sum_of_squares: f64,
    count: usize,
}

impl NllStats {
    pub fn add(&mut self, nll: f64) {
        self.sum += nll;
        self.sum_of_squares += nll * nll;
        self.count += 1;
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// Mean NLL in nats per token (0 before any token).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }

    /// `exp(mean NLL)`.
    pub fn perplexity(&self) -> f64 {
        self.mean().exp()
    }

    /// The standard error of the PPL, computed as llama-perplexity does:
    /// the NLL's variance is `E[x²] - E[x]²` over the N scored tokens, the
    /// standard error of its mean `sqrt(var / (N - 1))`, and that error is
    /// carried through `PPL = exp(mean)` to first order, whose derivative
    /// is `exp(mean)` itself: `PPL * sqrt(var / (N - 1))`. `None` with fewer
    /// than two tokens or when rounding makes the variance non-positive
    /// (llama.cpp prints a warning there instead of a figure).
    pub fn perplexity_error(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let variance = self.sum_of_squares / n - mean * mean;
        if variance <= 0.0 {
            return None;
        }
        Some(self.perplexity() * (variance / (n - 1.0)).sqrt())
    }

    /// The result line, `PPL = 12.3456 +/- 0.1234`.
    pub fn result_line(&self) -> String {
        match self.perplexity_error() {
            Some(error) => format!("PPL = {:.4} +/- {error:.4}", self.perplexity()),
            None => format!("PPL = {:.4} +/- nan", self.perplexity()),
        }
    }
}
