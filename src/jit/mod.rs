//! The JIT: cpu -> plan -> emit -> verify, and the kernel registry that
//! maps verified code and hands out typed entry points. It reads no model
//! file and parses no command line: `commands::dump` and `commands::tune`
//! show what it plans.
//!
//! Flow: [`cpu::CpuCaps::detect`] -> [`plan::plan`] (pure; trades unrolling
//! and optional ops against the 5,120-byte budget) ->
//! [`kernels::KernelSet::build`] (emits with dynasm-rs, verifies every buffer
//! with iced-x86, maps it read+execute) -> typed handles:
//!
//! | handle | safe call | machine-code signature (`extern "sysv64"`) |
//! | --- | --- | --- |
//! | `gemv(wt, k)` | `run(w, x, y, rows)`, `run_part(w, x, y_part, rows)` | `(w: *const u16, x: *const f32, y: *mut f32, r0, r1)` |
//! | `gemv_quant(q, k)` | `run_part(w, x, y_part, rows)` | `(w: *const u8, x: *const u8, y: *mut f32, r0, r1, k)` |
//! | `gemm(wt, k)` | `run(w, x, tokens, y, ldy, rows)`, `unsafe run_unchecked` | `(w, x, y, r0, r1, tokens, ldy)` |
//! | `gemm_quant(q, k)` | `run(w, tile, ntok, y, ldy, rows)`, `unsafe run_unchecked` | `(w, tile, y, r0, r1, k, ldy, ntok)`; Q8_0x16's also takes single tokens |
//! | `unpack_quant(q, k)` | `run(w, rows, out)` (zeroes a last block's missing rows), `unsafe run_unchecked` | `(w, out, k, r0, r1)` |
//! | `rmsnorm(dim)` | `run(x, w, out, eps)`, `run_inplace(x, w, eps)` | `(x, w, out, rows, eps: f32)` |
//! | `geglu(width)` | `run(gate, up, out)` (n >= 8) | `(gate, up, out, rows)` |
//! | `attn_scores(head_dim)` | `run(keys, queries, scores)` | the GEMM's, keys as f32 weights |
//! | `softmax()` | `run(x)` (in place) | `(x: *mut f32, n)` |
//! | `attn_wsum(head_dim)` | `run(p, ldp, values, out)` | `(p, ldp, v, n_keys, out, nq)` |
//!
//! Row-range arguments let a thread pool split rows ([`plan::split_rows`]).

pub mod backend;
pub mod blocking;
pub mod cpu;
pub mod dims;
pub mod emit;
pub mod kernels;
pub mod plan;
pub mod verify;
