//! Model files: readers for GGUF and Hugging Face folders, dequantization,
//! and the one model description both produce.

pub mod dtype;
pub mod gguf;
