//! The JIT: cpu -> plan -> emit -> verify -> dump, and the kernel registry
//! that maps verified code and hands out typed entry points.

pub mod cpu;
pub mod dims;
pub mod dump;
pub mod emit;
pub mod kernels;
pub mod measure;
pub mod plan;
pub mod verify;
