//! Multi-turn chat: the conversation held in the engine's KV cache, how turns
//! become tokens, one reply at a time, Ctrl-C, and where the user's lines
//! come from. `commands::chat` wires these to the terminal.

pub mod conversation;
pub mod input;
pub mod interrupt;
pub mod reply;
pub mod slash;
pub mod thinking;
pub mod turns;
