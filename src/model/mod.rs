//! Model files: readers for GGUF and Hugging Face folders, dequantization,
//! and the one model description both produce.

pub mod config;
pub mod dequant;
pub mod dtype;
pub mod fetch;
pub mod gemma3n;
pub mod gemma4;
pub mod gemma4_assistant;
pub mod gguf;
pub mod gguf_write;
pub mod k_quant_as_q5_0;
pub mod k_quant_x16;
pub mod presets;
pub mod quant_blocks;
pub mod row_blocks;
pub mod safetensors;
pub mod source;
pub mod weights;
