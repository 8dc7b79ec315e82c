//! The kernel registry: emits and verifies every kernel of a plan, maps them
//! into one executable buffer (written while not executable, then flipped to
//! read+execute: never writable and executable at once), and hands out typed
//! entry points behind safe wrappers that check slice lengths.
//!
//! - `build`: emit and verify, before anything is mapped;
//! - `set`: [`KernelSet`], the mapped code, and the [`Kernel`] accessor;
//! - `perf_map`: the names `perf report` gives the code;
//! - `gemv`, `gemm`, `elementwise`, `attention`: the typed handles, each
//!   with the key that finds its kernel and the checks of its calls.

mod attention;
mod build;
mod elementwise;
mod gemm;
mod gemv;
mod perf_map;
mod set;

pub use attention::{AttnScores, AttnWsum, Softmax, SoftmaxFn, WsumFn};
pub use build::{Compiled, Emitted, emit_and_verify, emit_and_verify_specs};
pub use elementwise::{Geglu, GegluFn, RmsNorm, RmsNormFn};
pub use gemm::{Gemm, GemmFn, GemmQuant, GemmWide, UnpackQuant};
pub use gemv::{Gemv, GemvFn, GemvQuant};
pub use set::{Kernel, KernelId, KernelSet};

use crate::jit::emit;
use crate::model::row_blocks;
use std::ops::Range;

/// Errors from a kernel call with arguments that do not fit the kernel.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    #[error("kernel {kernel}: {what}")]
    Shape { kernel: String, what: String },
}

fn shape(kernel: &str, what: String) -> KernelError {
    KernelError::Shape {
        kernel: kernel.to_string(),
        what,
    }
}

/// Rows `r0..r1` of a row-block matrix of `k` columns must fit in `len`
/// values (padding rows included), with `r0` on a block boundary.
fn blocks_fit(len: usize, rows: &Range<usize>, k: usize) -> bool {
    rows.start.is_multiple_of(row_blocks::BLOCK_ROWS)
        && rows
            .end
            .next_multiple_of(row_blocks::BLOCK_ROWS)
            .checked_mul(row_blocks::padded_cols(k))
            .is_some_and(|need| need <= len)
}

/// Rows `r < r1` of a `stride`-element row matrix must fit in `len` elements
/// (the last row only needs `k`).
fn rows_fit(len: usize, r1: usize, stride: usize, k: usize) -> bool {
    r1 == 0
        || (r1 - 1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(k))
            .is_some_and(|need| need <= len)
}

/// Keeps the gemm tile constants visible to callers that split rows.
pub const GEMM_TILE: (usize, usize) = (emit::gemm::ROWS, emit::gemm::TOKENS);

// The engine shares one KernelSet across its thread pool.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<KernelSet>();
    send_sync::<Gemv<'static>>();
    send_sync::<Gemm<'static>>();
    send_sync::<GemmWide<'static>>();
};
