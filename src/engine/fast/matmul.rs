//! The fast engine's matrix products: every product of a step split over
//! the thread pool in chunks handed out from a shared counter, the exact
//! tokens multiplied as a decode step would, quantized weights fed 8-bit
//! inputs (in one or two levels).

use super::FastEngine;
use crate::engine::kernels::{SharedOut, add_block_offsets};
use crate::engine::packed::PackedMatrix;
use crate::engine::q8_input::Q8Input;
use crate::engine::wide_input::WideInput;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `out[t] = pairs[2t] + pairs[2t + 1]` over columns `rows`, for each of
/// `tokens` tokens: the product of a two-level input is its levels' sum
/// (see `InputPrecision::TwoLevels`).
///
/// # Safety
/// No other thread may touch columns `rows` of either output meanwhile.
unsafe fn add_level_pairs(pairs: SharedOut, out: SharedOut, tokens: usize, rows: Range<usize>) {
    for t in 0..tokens {
        // SAFETY: the caller owns columns `rows` of every row of both.
        let (sum, first, second) = unsafe {
            (
                out.cells(t, rows.clone()),
                pairs.cells(2 * t, rows.clone()),
                pairs.cells(2 * t + 1, rows.clone()),
            )
        };
        for ((y, a), b) in sum.iter_mut().zip(first.iter()).zip(second.iter()) {
            *y = a + b;
        }
    }
}

/// One product of a parallel section: `y = W · x` over whole token rows
/// of `x`, the first `exact` of them as a decode step computes them.
pub(super) type Product<'a> = (&'a PackedMatrix, &'a [f32], &'a mut [f32], usize);

impl FastEngine {
    /// `y[t] = W · x[t]` for every token, rows split across the pool; the
    /// first `exact` tokens as decode computes them (see `matmuls`).
    pub(super) fn matmul(&self, w: &PackedMatrix, x: &[f32], y: &mut [f32], exact: usize) {
        self.matmuls(vec![(w, x, y)], exact);
    }

    /// Several independent products in one parallel section (one wake-up).
    /// 16-bit weights: the first `exact` tokens of each input are
    /// multiplied one at a time by the GEMV a decode step uses (so their
    /// results are bit-identical to a one-token step's), the rest together
    /// by the GEMM. When more than one pass reads a thread's rows, the rows
    /// go in sub-chunks of `Blocking::shared_rows_bytes`, so every pass
    /// after the first finds them in cache: the weights are streamed from
    /// memory once per call. Quantized weights: every token's input is
    /// quantized to 8 bits and all go to the integer kernels in one pass,
    /// whose results are bit-identical to a one-token step's anyway (the
    /// GEMM reads each weight once for 8 tokens, see `emit::gemm_quant`).
    /// With two input levels each token is two of the integer kernels'
    /// tokens, whose rows are added in pairs (`add_level_pairs`).
    pub(super) fn matmuls(&self, jobs: Vec<(&PackedMatrix, &[f32], &mut [f32])>, exact: usize) {
        self.products(jobs.into_iter().map(|(w, x, y)| (w, x, y, exact)).collect());
    }

    /// [`FastEngine::matmuls`] with each product's own count of exact
    /// tokens, the fourth of its tuple: a mixture's experts each take
    /// their own share of a step's tokens.
    pub(super) fn products(&self, jobs: Vec<Product>) {
        struct Job<'a> {
            w: &'a PackedMatrix,
            x: &'a [f32],
            exact: usize,
            /// Index into `quantized` of the exact tokens' 8-bit input.
            q8: Option<usize>,
            /// Index into `tiled` of the other tokens' input laid out for a
            /// tiled GEMM (16-bit weights with AVX-512).
            tiles: Option<usize>,
            out: SharedOut,
            /// With two input levels: where the kernels write, two rows
            /// per token, before each pair is added into `out`.
            level_rows: Option<SharedOut>,
        }
        let levels = self.input_precision.levels();
        let quantized_with_levels = |w: &PackedMatrix| w.format.quant().is_some() && levels > 1;
        // Every job's level rows in one buffer, carved up below.
        let mut level_rows = self.level_rows.lock().unwrap_or_else(|e| e.into_inner());
        let wanted: usize = jobs
            .iter()
            .filter(|(w, ..)| quantized_with_levels(w))
            .map(|(w, x, ..)| levels * x.len() / w.cols * w.rows)
            .sum();
        if level_rows.len() < wanted {
            level_rows.resize(wanted, 0.0);
        }
        let mut level_rows_left = &mut level_rows[..];
        let mut work = Vec::with_capacity(jobs.len());
        // An integer kernel's input is quantized once, here, for every
        // thread's chunk of rows, and once for the jobs that share it (q, k
        // and v; gate and up).
        // Keyed by the input's address: the same slice, not equal values.
        let mut quantized: Vec<(usize, Q8Input)> = Vec::new();
        // Likewise the 16-bit GEMM's tiles (bf16 for its dot products):
        // laid out once for every thread, and once for the jobs sharing an
        // input.
        let mut tiled: Vec<(usize, WideInput)> = Vec::new();
        for (w, x, y, exact) in jobs {
            assert_eq!(x.len() % w.cols, 0, "input is not whole rows");
            assert_eq!(y.len(), x.len() / w.cols * w.rows, "output size");
            let tokens = x.len() / w.cols;
            let exact = if w.format.quant().is_some() {
                tokens
            } else {
                exact.min(tokens)
            };
            let q8 = (w.format.quant().is_some() && exact > 0).then(|| {
                let at = x.as_ptr() as usize;
                let tokens = exact * levels;
                let span = w.kernels().input_span;
                match quantized.iter().position(|(p, q)| {
                    *p == at && q.k() == w.cols && q.tokens() == tokens && q.span() == span
                }) {
                    Some(i) => i,
                    None => {
                        let x = &x[..exact * w.cols];
                        let input =
                            Q8Input::quantize_on(&self.pool, x, w.cols, self.input_precision, span);
                        quantized.push((at, input));
                        quantized.len() - 1
                    }
                }
            });
            let bulk = &x[exact * w.cols..];
            let tiles = match self.kernels.tiled_gemm(w) {
                Some(params) if bulk.len() >= 2 * w.cols => {
                    let at = bulk.as_ptr() as usize;
                    let same = |(p, t): &(usize, WideInput)| {
                        *p == at && t.k() == w.cols && t.tokens() * w.cols == bulk.len()
                    };
                    Some(match tiled.iter().position(same) {
                        Some(i) => i,
                        None => {
                            tiled.push((at, WideInput::new(bulk, w.cols, &params)));
                            tiled.len() - 1
                        }
                    })
                }
                _ => None,
            };
            let level_rows = (q8.is_some() && levels > 1).then(|| {
                let (rows, rest) =
                    std::mem::take(&mut level_rows_left).split_at_mut(levels * exact * w.rows);
                level_rows_left = rest;
                SharedOut::new(rows, w.rows)
            });
            let out = SharedOut::new(y, w.rows);
            work.push(Job {
                w,
                x,
                exact,
                q8,
                tiles,
                out,
                level_rows,
            });
        }
        // One pass of the job's kernels over `rows`.
        let pass = |job: &Job, rows: Range<usize>| {
            let (w, k) = (job.w, job.w.cols);
            if job.exact > 0 {
                // SAFETY (both arms): the caller owns columns `rows` of
                // every row of the output.
                match job.q8 {
                    Some(i) => unsafe {
                        let x = &quantized[i].1;
                        let out = job.level_rows.unwrap_or(job.out);
                        self.kernels.gemm_q8(w, x, rows.clone(), out);
                        if let Some(offsets) = w.offsets() {
                            add_block_offsets(offsets, x, rows.clone(), out);
                        }
                        if let Some(pairs) = job.level_rows {
                            add_level_pairs(pairs, job.out, job.exact, rows.clone());
                        }
                    },
                    None => {
                        for t in 0..job.exact {
                            let x = &job.x[t * k..(t + 1) * k];
                            unsafe { self.kernels.gemm(w, x, rows.clone(), job.out.from_row(t)) };
                        }
                    }
                }
            }
            if job.x.len() > job.exact * k {
                let x = &job.x[job.exact * k..];
                let y = job.out.from_row(job.exact);
                // SAFETY: as above.
                match job.tiles {
                    Some(i) => unsafe { self.kernels.gemm_tiles(w, &tiled[i].1, rows, y) },
                    None => unsafe { self.kernels.gemm(w, x, rows, y) },
                }
            }
        };
        // Rows are handed out from a shared counter rather than split evenly
        // up front, so a thread slowed by anything (another process, a
        // slower memory path) takes less work instead of holding everyone at
        // the section's end. Chunk sizes are guided: each take is a
        // 1/(2*threads) share of the rows left, down to `min_chunk_bytes`. Every
        // chunk starts a new memory stream that the prefetchers must ramp up
        // on; at decode, fixed 256 KiB chunks left the LM head 10% and the
        // layers 8% slower than a few large chunks (same process, alternate
        // tokens), and the shrinking tail keeps the end of a section short.
        let threads = self.pool.threads();
        let b = &self.blocking;
        let next: Vec<AtomicUsize> = work.iter().map(|_| AtomicUsize::new(0)).collect();
        self.pool.run(|_| {
            for (job, next) in work.iter().zip(&next) {
                let w = job.w;
                let row_bytes = w.bytes() / w.rows.next_multiple_of(b.row_granule).max(1);
                let min_rows = b.rows_within(b.min_chunk_bytes, row_bytes);
                let bulk = job.x.len() > job.exact * w.cols;
                let passes = match job.q8 {
                    Some(_) => 1,
                    None => job.exact + usize::from(bulk),
                };
                let sub_rows = if passes > 1 {
                    b.rows_within(b.shared_rows_bytes, row_bytes)
                } else {
                    usize::MAX
                };
                let mut r0 = next.load(Ordering::Relaxed);
                while r0 < w.rows {
                    let left = w.rows - r0;
                    let size = (left / (2 * threads))
                        .next_multiple_of(b.row_granule)
                        .max(min_rows)
                        .min(left);
                    match next.compare_exchange_weak(
                        r0,
                        r0 + size,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => {
                            // Each chunk of rows goes to exactly one thread.
                            let end = r0 + size;
                            let mut s0 = r0;
                            while s0 < end {
                                let s1 = s0.saturating_add(sub_rows).min(end);
                                pass(job, s0..s1);
                                s0 = s1;
                            }
                            r0 = next.load(Ordering::Relaxed);
                        }
                        Err(now) => r0 = now,
                    }
                }
            }
        });
    }
}
