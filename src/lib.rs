//! Pulsar: a CPU inference engine for Google's Gemma models whose hot kernels
//! are x86-64 machine code generated at launch.

pub mod jit;
pub mod model;
