//! Perplexity measured the way llama.cpp's `llama-perplexity` measures it,
//! and the KL divergence of one run's next-token distributions from a
//! saved base run.
//!
//! This layer sits above `engine` and `tokenizer`: it drives any
//! [`crate::engine::Engine`], and nothing in `engine`, `model` or `jit`
//! imports it. Each module has one job: [`windows`] cuts the text and
//! feeds a window, [`measure`] runs all windows, [`logprobs`] turns a
//! logits row into log-probabilities, [`stats`] accumulates the PPL and its
//! error, [`kl`] compares a row with a saved base position, [`base_file`]
//! is the `--save-logits` / `--kl-base` file.

pub mod base_file;
pub mod kl;
pub mod logprobs;
pub mod measure;
pub mod stats;
pub mod windows;
