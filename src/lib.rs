//! Pulsar: a CPU inference engine for Google's Gemma models whose hot kernels
//! are x86-64 machine code generated at launch.

pub mod cancel;
pub mod chat;
pub mod chat_template;
pub mod commands;
pub mod constrain;
pub mod embedding;
pub mod engine;
pub mod fs_atomic;
#[doc(hidden)]
pub mod fuzz_checks;
pub mod generate;
pub mod jit;
pub mod model;
pub mod perplexity;
pub mod sample;
pub mod serve;
pub mod speculative;
pub mod stop_strings;
pub mod tokenizer;
