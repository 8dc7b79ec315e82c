//! The sampling settings, their defaults and their validation.

use anyhow::{Result, bail};

/// Sampling settings. Each filter has a value that turns it off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches
    /// this; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one; 0 = off.
    pub min_p: f32,
    /// Divide positive / multiply negative logits of recent tokens; 1 = off.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalty looks at.
    pub repeat_last_n: usize,
}

impl Default for SamplerConfig {
    /// Common defaults for chat-style generation (llama.cpp's values).
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
        }
    }
}

impl SamplerConfig {
    /// Deterministic argmax decoding with every filter off.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
        }
    }

    /// Refuses settings that have no meaning, naming the setting and its range.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!(
                "temperature must be a number >= 0 (0 = greedy), got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must be in (0, 1] (1 = off), got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min-p must be in [0, 1] (0 = off), got {}", self.min_p);
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            bail!(
                "repeat penalty must be a number > 0 (1 = off), got {}",
                self.repeat_penalty
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::tests::cfg;

    #[test]
    fn validate_names_the_bad_setting() {
        assert!(cfg().validate().is_ok());
        assert!(SamplerConfig::default().validate().is_ok());
        assert!(SamplerConfig::greedy().validate().is_ok());
        let bad = |c: SamplerConfig, word: &str| {
            let e = c.validate().expect_err("should be refused").to_string();
            assert!(e.contains(word), "{e:?} should mention {word}");
        };
        bad(
            SamplerConfig {
                temperature: -0.1,
                ..cfg()
            },
            "temperature",
        );
        bad(
            SamplerConfig {
                temperature: f32::NAN,
                ..cfg()
            },
            "temperature",
        );
        bad(
            SamplerConfig {
                top_p: 0.0,
                ..cfg()
            },
            "top-p",
        );
        bad(
            SamplerConfig {
                top_p: 1.01,
                ..cfg()
            },
            "top-p",
        );
        bad(
            SamplerConfig {
                min_p: -0.01,
                ..cfg()
            },
            "min-p",
        );
        bad(
            SamplerConfig {
                min_p: 1.5,
                ..cfg()
            },
            "min-p",
        );
        bad(
            SamplerConfig {
                repeat_penalty: 0.0,
                ..cfg()
            },
            "repeat penalty",
        );
        bad(
            SamplerConfig {
                repeat_penalty: -1.0,
                ..cfg()
            },
            "repeat penalty",
        );
    }
}
