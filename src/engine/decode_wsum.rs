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
//! output row in L1), decode attention per layer takes about a quarter
//! less time at a few hundred cached positions. A prefill block's dozens
//! of query rows keep the JIT's tile, which shares each V load among 6
//! queries.
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

/// Query rows per register tile of [`weighted_sum_tiled`].
const TILE_QUERIES: usize = 4;

/// Dimensions per register tile of [`weighted_sum_tiled`]: 4 zmm
/// registers, 256 contiguous bytes of each V row.
const TILE_DIMS: usize = 64;

/// Whether [`weighted_sum_tiled`] has its AVX-512 form on this CPU for
/// rows of `head_dim`.
pub fn tiled_available(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        head_dim.is_multiple_of(TILE_DIMS) && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = head_dim;
        false
    }
}

/// The same sum as [`weighted_sum_by_rows`], for the dozens of query rows
/// of a verify step's tokens over one part of the keys (in L2 after the
/// prefetch): register tiles of 4 queries x 64 dimensions (16 zmm
/// accumulators), the keys innermost, so each key's 256 bytes are loaded
/// once per tile and feed 16 FMAs. Each output element is still summed
/// key after key with one FMA from zero: the bits of the other two forms.
///
/// Why: a step over 8 tokens at 600 cached tokens gives each thread 32
/// query rows over about 275 keys, which this tile sums from L1/L2 in
/// about three quarters of the JIT's tile's time (6 queries x 16 dims, 16
/// passes over the keys each reading 64 bytes of every 1 KB row) and under
/// half of row by row's. In a real step V comes from memory, where the
/// JIT's strided passes fare worse.
pub fn weighted_sum_tiled(p: &[f32], ldp: usize, v: &[f32], head_dim: usize, out: &mut [f32]) {
    let (n_keys, nq) = (v.len() / head_dim, out.len() / head_dim);
    assert!(
        nq == 0 || p.len() >= (nq - 1) * ldp + n_keys,
        "probabilities sized by the caller"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if tiled_available(head_dim) {
            // SAFETY: AVX-512F was just detected; head_dim is a multiple of
            // TILE_DIMS and every access is inside the slices (sizes
            // checked above).
            unsafe { tiled_avx512(p, ldp, v, head_dim, out) };
            return;
        }
    }
    weighted_sum_by_rows(p, ldp, v, head_dim, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tiled_avx512(p: &[f32], ldp: usize, v: &[f32], head_dim: usize, out: &mut [f32]) {
    let nq = out.len() / head_dim;
    let mut q0 = 0;
    while q0 < nq {
        let queries = (nq - q0).min(TILE_QUERIES);
        let (p, out) = (&p[q0 * ldp..], &mut out[q0 * head_dim..]);
        // SAFETY: as for the caller; the tile's rows lie inside `p` and
        // `out`.
        unsafe {
            match queries {
                4 => tile_avx512::<4>(p, ldp, v, head_dim, out),
                3 => tile_avx512::<3>(p, ldp, v, head_dim, out),
                2 => tile_avx512::<2>(p, ldp, v, head_dim, out),
                _ => tile_avx512::<1>(p, ldp, v, head_dim, out),
            }
        }
        q0 += queries;
    }
}

/// `Q` query rows from the start of `p` and `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const Q: usize>(
    p: &[f32],
    ldp: usize,
    v: &[f32],
    head_dim: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n_keys = v.len() / head_dim;
    for d0 in (0..head_dim).step_by(TILE_DIMS) {
        let mut acc = [[_mm512_setzero_ps(); TILE_DIMS / 16]; Q];
        for j in 0..n_keys {
            let row = &v[j * head_dim + d0..j * head_dim + d0 + TILE_DIMS];
            // SAFETY: `row` holds TILE_DIMS floats; unaligned loads.
            let x: [__m512; TILE_DIMS / 16] =
                std::array::from_fn(|c| unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * c)) });
            for (q, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(p[q * ldp + j]);
                for (a, &x) in acc.iter_mut().zip(&x) {
                    *a = _mm512_fmadd_ps(x, w, *a);
                }
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            let dst = &mut out[q * head_dim + d0..q * head_dim + d0 + TILE_DIMS];
            for (c, a) in acc.iter().enumerate() {
                // SAFETY: `dst` holds TILE_DIMS floats; unaligned stores.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(16 * c), *a) };
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
/// operations in the same order, so the same bits) and so took nearly a
/// tenth of a long speculative decode's samples.
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
