//! The probability-weighted sum of V rows for a decode step's few query
//! heads, read one V row at a time.
//!
//! Why not the JIT's weighted sum (`jit::emit::attention::emit_wsum`) here:
//! it keeps 6 queries x 16 dims in registers and passes over the keys once
//! per 16 dims, so each of its 16 passes (head_dim 256) reads 64 bytes of
//! every V row, 1 KB apart. At decode the weights streamed since the last
//! token have evicted V, so every one of those loads misses, and the
//! stride crosses a 4 KiB page every 4 keys, where the prefetchers stop.
//! Read row by row instead (each V row one sequential run, every query's
//! output row in L1), decode attention per layer took 81.6 against 104.3
//! us at positions 256-383 and 105.2 against 141.0 at 384-511 on 2
//! threads, 119.8 against 167.0 and 167.5 against 231.4 on 1 thread (AMD
//! EPYC with AVX2, `bench --pp 16 --tg 512`, medians of 3, alternating,
//! temporary timers); decode over those 512 tokens read 19.7 against 18.4
//! GB/s on 2 threads. A prefill block's dozens of query rows keep the
//! JIT's tile, which shares each V load among 6 queries.
//!
//! Each output element is summed key after key with one FMA per key from
//! zero, as the JIT's kernel sums it, so the results are bit-identical:
//! a token's attention does not depend on which kernel computed it.

/// The most query rows (a token's query heads per KV head) summed here;
/// more go to the JIT's kernel. Gemma 3 270M has 4 per KV head; this path
/// was measured only there.
pub const MAX_QUERIES: usize = 4;

/// `out[i][d] = sum_j p[i * ldp + j] * v[j][d]` over the `v.len() /
/// head_dim` keys j, for the `out.len() / head_dim` query rows i.
pub fn weighted_sum_by_rows(p: &[f32], ldp: usize, v: &[f32], head_dim: usize, out: &mut [f32]) {
    let (n_keys, nq) = (v.len() / head_dim, out.len() / head_dim);
    assert!(
        nq == 0 || p.len() >= (nq - 1) * ldp + n_keys,
        "probabilities sized by the caller"
    );
    out.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    {
        if head_dim.is_multiple_of(8)
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA were just detected; every access is
            // inside the slices (sizes checked above, head_dim a multiple
            // of 8).
            unsafe { by_rows_avx2(p, ldp, v, head_dim, out) };
            return;
        }
    }
    for j in 0..n_keys {
        let row = &v[j * head_dim..(j + 1) * head_dim];
        for (i, o) in out.chunks_exact_mut(head_dim).enumerate() {
            let pij = p[i * ldp + j];
            for (o, &x) in o.iter_mut().zip(row) {
                *o = x.mul_add(pij, *o);
            }
        }
    }
}

/// Keys whose products one pass adds to an output chunk held in a
/// register.
const KEYS_PER_PASS: usize = 4;

/// Keys `KEYS_PER_PASS` at a time: each query's output chunk of 8 is
/// loaded once, takes the keys' FMAs in key order, and is stored once,
/// where one key at a time loaded and stored it for every FMA (the same
/// operations in the same order, so the same bits). On the Intel Xeon a
/// greedy summary with speculation (`perf record`, about 1,000 cached
/// positions) spent 9.8% of its samples here one key at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn by_rows_avx2(p: &[f32], ldp: usize, v: &[f32], head_dim: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n_keys = v.len() / head_dim;
    let mut j = 0;
    while j < n_keys {
        let block = (n_keys - j).min(KEYS_PER_PASS);
        let rows = &v[j * head_dim..(j + block) * head_dim];
        for (i, o) in out.chunks_exact_mut(head_dim).enumerate() {
            let weights = &p[i * ldp + j..i * ldp + j + block];
            let mut pij = [_mm256_setzero_ps(); KEYS_PER_PASS];
            for (b, &w) in pij.iter_mut().zip(weights) {
                *b = _mm256_set1_ps(w);
            }
            for (c, o) in o.chunks_exact_mut(8).enumerate() {
                // SAFETY: `o` holds 8 floats and each key's row chunk
                // `b * head_dim + 8c ..` lies inside `rows` (block rows of
                // head_dim, a multiple of 8); unaligned loads and stores.
                unsafe {
                    let mut acc = _mm256_loadu_ps(o.as_ptr());
                    for (b, &w) in pij[..block].iter().enumerate() {
                        let x = _mm256_loadu_ps(rows.as_ptr().add(b * head_dim + 8 * c));
                        acc = _mm256_fmadd_ps(x, w, acc);
                    }
                    _mm256_storeu_ps(o.as_mut_ptr(), acc);
                }
            }
        }
        j += block;
    }
}
