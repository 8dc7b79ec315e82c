//! Attention scores on AVX-512: `scores[i][j] = q_i · k_j` for a block of
//! query rows against a run of cached keys.
//!
//! Why not the JIT's scores kernel (an f32 GEMM of 4 keys x 3 queries on
//! ymm registers, `jit::emit::gemm`) on CPUs with AVX-512: a step over 8
//! tokens of one sequence gives each thread 32 query rows over about 275
//! keys of 256 values per layer, and that GEMM took about half of such a
//! unit's time. The zmm tiles here hold 4 queries x 4 keys and compute the
//! same scores in about three quarters of the JIT's GEMM's time.
//!
//! Each score is the same sum wherever it falls in a tile: 16 lanes, lane
//! l summing dimensions l, l + 16, ... in order with one FMA each from
//! zero, then the lanes added in one fixed tree. So a query row gets the
//! same bits alone or beside others, over any run of keys that holds its
//! own, which the exact steps of speculative decoding rely on.

/// Whether [`scores`] runs on this CPU for heads of `head_dim`.
pub fn available(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        head_dim.is_multiple_of(16) && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = head_dim;
        false
    }
}

/// Query rows (and keys) per register tile.
const TILE: usize = 4;

/// `out[i * n_keys + j] = queries[i] · keys[j]` for every query row i and
/// key j (rows of `head_dim`).
///
/// # Panics
/// If [`available`] is false for `head_dim`, or `out` is shorter than
/// queries x keys.
pub fn scores(keys: &[f32], queries: &[f32], head_dim: usize, out: &mut [f32]) {
    assert!(
        available(head_dim),
        "AVX-512 scores for head_dim {head_dim}"
    );
    let (n_keys, nq) = (keys.len() / head_dim, queries.len() / head_dim);
    assert!(out.len() >= nq * n_keys, "scores sized by the caller");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted above); every access is inside
    // the slices (sizes checked above, head_dim a multiple of 16).
    unsafe {
        scores_avx512(keys, queries, head_dim, out)
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores_avx512(keys: &[f32], queries: &[f32], head_dim: usize, out: &mut [f32]) {
    let (n_keys, nq) = (keys.len() / head_dim, queries.len() / head_dim);
    // Keys outermost: each run of 4 keys is read from memory once and
    // stays in L1 while every query tile passes over it (the queries, 32
    // rows of 1 KB for a verify step of 8 tokens, stay in L1 and L2). With
    // the queries outermost the keys of a part (about 275 KB) were read
    // once per query tile, past what L2 held beside the values: the scores
    // of such a unit took 81 us either way, on ymm or zmm.
    for j0 in (0..n_keys).step_by(TILE) {
        let kt = (n_keys - j0).min(TILE);
        for i0 in (0..nq).step_by(TILE) {
            let qt = (nq - i0).min(TILE);
            let q = &queries[i0 * head_dim..(i0 + qt) * head_dim];
            let k = &keys[j0 * head_dim..(j0 + kt) * head_dim];
            if (qt, kt) == (TILE, TILE) {
                // SAFETY: as for the caller; the tile's rows are inside
                // `q` and `k`, and rows i0..i0 + 4, columns j0..j0 + 4 of
                // `out` exist (asserted by the caller's size check).
                unsafe { full_tile_avx512(q, k, head_dim, &mut out[i0 * n_keys + j0..], n_keys) };
                continue;
            }
            let mut tile = [[0.0f32; TILE]; TILE];
            // SAFETY: as for the caller; the tile's rows are inside `q`
            // and `k`.
            unsafe {
                match (qt, kt) {
                    (4, 4) => tile_avx512::<4, 4>(q, k, head_dim, &mut tile),
                    (4, 3) => tile_avx512::<4, 3>(q, k, head_dim, &mut tile),
                    (4, 2) => tile_avx512::<4, 2>(q, k, head_dim, &mut tile),
                    (4, _) => tile_avx512::<4, 1>(q, k, head_dim, &mut tile),
                    (3, 4) => tile_avx512::<3, 4>(q, k, head_dim, &mut tile),
                    (3, 3) => tile_avx512::<3, 3>(q, k, head_dim, &mut tile),
                    (3, 2) => tile_avx512::<3, 2>(q, k, head_dim, &mut tile),
                    (3, _) => tile_avx512::<3, 1>(q, k, head_dim, &mut tile),
                    (2, 4) => tile_avx512::<2, 4>(q, k, head_dim, &mut tile),
                    (2, 3) => tile_avx512::<2, 3>(q, k, head_dim, &mut tile),
                    (2, 2) => tile_avx512::<2, 2>(q, k, head_dim, &mut tile),
                    (2, _) => tile_avx512::<2, 1>(q, k, head_dim, &mut tile),
                    (_, 4) => tile_avx512::<1, 4>(q, k, head_dim, &mut tile),
                    (_, 3) => tile_avx512::<1, 3>(q, k, head_dim, &mut tile),
                    (_, 2) => tile_avx512::<1, 2>(q, k, head_dim, &mut tile),
                    _ => tile_avx512::<1, 1>(q, k, head_dim, &mut tile),
                }
            }
            for (i, row) in tile.iter().enumerate().take(qt) {
                let dst = &mut out[(i0 + i) * n_keys + j0..(i0 + i) * n_keys + j0 + kt];
                dst.copy_from_slice(&row[..kt]);
            }
        }
    }
}

/// The `Q x K` scores of the first `Q` rows of `q` and `K` rows of `k`
/// into `tile[i][j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const Q: usize, const K: usize>(
    q: &[f32],
    k: &[f32],
    head_dim: usize,
    tile: &mut [[f32; TILE]; TILE],
) {
    // SAFETY: AVX-512F per this function's contract.
    let acc = unsafe { lane_sums::<Q, K>(q, k, head_dim) };
    for (row, acc) in tile.iter_mut().zip(&acc) {
        for (s, &a) in row.iter_mut().zip(acc) {
            *s = lanes_sum(a);
        }
    }
}

/// Score (i, j) of the first `Q` rows of `q` and `K` rows of `k` in 16
/// lanes, lane l the sum of dimensions l, l + 16, ... in order, one FMA
/// each from zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn lane_sums<const Q: usize, const K: usize>(
    q: &[f32],
    k: &[f32],
    head_dim: usize,
) -> [[std::arch::x86_64::__m512; K]; Q] {
    use std::arch::x86_64::*;
    assert!(q.len() >= Q * head_dim && k.len() >= K * head_dim);
    let mut acc = [[_mm512_setzero_ps(); K]; Q];
    for d in (0..head_dim).step_by(16) {
        // SAFETY: rows i and j are inside `q` and `k` (asserted above), and
        // d + 16 <= head_dim; unaligned loads.
        let (qv, kv): ([__m512; Q], [__m512; K]) = unsafe {
            (
                std::array::from_fn(|i| _mm512_loadu_ps(q.as_ptr().add(i * head_dim + d))),
                std::array::from_fn(|j| _mm512_loadu_ps(k.as_ptr().add(j * head_dim + d))),
            )
        };
        for (acc, &qv) in acc.iter_mut().zip(&qv) {
            for (a, &kv) in acc.iter_mut().zip(&kv) {
                *a = _mm512_fmadd_ps(kv, qv, *a);
            }
        }
    }
    acc
}

/// A whole tile, 4 queries x 4 keys, into `out[i * n_keys + j]`: the 16
/// sums as [`lane_sums`] makes them, then reduced together. Each level
/// of [`lanes_sum`]'s tree (halves, quarters, pairs, the last two) adds the
/// same lanes of every score, but here two to four scores share each
/// shuffle and add: 45 instructions for the 16 scores where `lanes_sum`
/// takes 8 for each (128), so every score keeps its bits. The result is
/// one vector whose 128-bit block b holds query b's 4 scores in key order,
/// in about three quarters of the time `lanes_sum` per score takes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn full_tile_avx512(q: &[f32], k: &[f32], head_dim: usize, out: &mut [f32], n_keys: usize) {
    use std::arch::x86_64::*;
    assert!(out.len() >= (TILE - 1) * n_keys + TILE);
    // SAFETY: AVX-512F per this function's contract.
    let acc = unsafe { lane_sums::<TILE, TILE>(q, k, head_dim) };
    // Halves: blocks 0 and 1 of a score's vector plus its blocks 2 and 3,
    // two scores (queries 2p and 2p + 1, key j) to a vector.
    let halves = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    };
    // Quarters: block 0 plus block 1 of each half, four scores (queries
    // 0..4, key j) to a vector, query b in block b.
    let quarters = |h: __m512, g: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(h, g),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(h, g),
        )
    };
    // Pairs, within each block: lanes 0 and 1 plus lanes 2 and 3, keys j
    // (lanes 0, 1) and j + 1 (lanes 2, 3).
    let pairs = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
            _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
        )
    };
    // The last two, within each block: lane 0 plus lane 1, and lane 2 plus
    // lane 3, giving keys 0..4 in order.
    let last = |t: __m512, u: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(t, u),
            _mm512_shuffle_ps::<0b11_01_11_01>(t, u),
        )
    };
    let by_key: [__m512; TILE] = std::array::from_fn(|j| {
        quarters(halves(acc[0][j], acc[1][j]), halves(acc[2][j], acc[3][j]))
    });
    let scores = last(pairs(by_key[0], by_key[1]), pairs(by_key[2], by_key[3]));
    // SAFETY: row i's 4 scores at i * n_keys lie inside `out` (asserted
    // above); unaligned stores.
    unsafe {
        let at = out.as_mut_ptr();
        _mm_storeu_ps(at, _mm512_extractf32x4_ps::<0>(scores));
        _mm_storeu_ps(at.add(n_keys), _mm512_extractf32x4_ps::<1>(scores));
        _mm_storeu_ps(at.add(2 * n_keys), _mm512_extractf32x4_ps::<2>(scores));
        _mm_storeu_ps(at.add(3 * n_keys), _mm512_extractf32x4_ps::<3>(scores));
    }
}

/// The 16 lanes added in one fixed tree: halves, quarters, pairs, then the
/// last two.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn lanes_sum(a: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let halves = _mm512_add_ps(a, _mm512_shuffle_f32x4::<0b01_00_11_10>(a, a));
    let quarters = _mm512_add_ps(
        halves,
        _mm512_shuffle_f32x4::<0b10_11_00_01>(halves, halves),
    );
    let x = _mm512_castps512_ps128(quarters);
    let pairs = _mm_add_ps(x, _mm_movehl_ps(x, x));
    let last = _mm_add_ss(pairs, _mm_movehdup_ps(pairs));
    _mm_cvtss_f32(last)
}

/// Whether [`scores_ymm`] runs on this CPU for heads of `head_dim`.
pub fn ymm_available(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        head_dim.is_multiple_of(8)
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = head_dim;
        false
    }
}

/// [`scores`] on ymm registers, for a plan that left attention's kernels
/// out of its code budget under AVX2 (Gemma 4 and 3n): a query row
/// against 4 keys at a time, 8 lanes each, lane l summing dimensions l,
/// l + 8, ... with one FMA each from zero, then one fixed tree. A score
/// has the same bits whatever block it is computed in, as with
/// [`scores`]; the portable loop it replaces did not vectorize.
///
/// # Panics
/// If [`ymm_available`] is false for `head_dim`, or `out` is shorter than
/// queries x keys.
pub fn scores_ymm(keys: &[f32], queries: &[f32], head_dim: usize, out: &mut [f32]) {
    assert!(
        ymm_available(head_dim),
        "AVX2 scores for head_dim {head_dim}"
    );
    let (n_keys, nq) = (keys.len() / head_dim, queries.len() / head_dim);
    assert!(out.len() >= nq * n_keys, "scores sized by the caller");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA are present (asserted above); every access is
    // inside the slices (sizes checked above, head_dim a multiple of 8).
    unsafe {
        scores_avx2(keys, queries, head_dim, out)
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(keys: &[f32], queries: &[f32], head_dim: usize, out: &mut [f32]) {
    let (n_keys, nq) = (keys.len() / head_dim, queries.len() / head_dim);
    // Keys outermost, as on zmm: 4 keys stay in L1 while every query
    // passes over them.
    for j0 in (0..n_keys).step_by(TILE) {
        let k = &keys[j0 * head_dim..];
        for (i, q) in queries.chunks_exact(head_dim).take(nq).enumerate() {
            let dst = &mut out[i * n_keys + j0..];
            // SAFETY: as for the caller; the run's keys lie inside `k`
            // and its scores inside `dst`.
            unsafe {
                match n_keys - j0 {
                    1 => keys_avx2::<1>(q, k, head_dim, dst),
                    2 => keys_avx2::<2>(q, k, head_dim, dst),
                    3 => keys_avx2::<3>(q, k, head_dim, dst),
                    _ => keys_avx2::<TILE>(q, k, head_dim, dst),
                }
            }
        }
    }
}

/// The scores of one query row `q` against the first `K` rows of `k`
/// into `out[..K]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn keys_avx2<const K: usize>(q: &[f32], k: &[f32], head_dim: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(q.len() >= head_dim && k.len() >= K * head_dim && out.len() >= K);
    let mut acc = [_mm256_setzero_ps(); K];
    for d in (0..head_dim).step_by(8) {
        // SAFETY: d + 8 <= head_dim, so every load is inside `q` and the
        // K rows of `k` (asserted above); unaligned loads.
        unsafe {
            let x = _mm256_loadu_ps(q.as_ptr().add(d));
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(x, _mm256_loadu_ps(k.as_ptr().add(j * head_dim + d)), *a);
            }
        }
    }
    for (o, &a) in out.iter_mut().zip(&acc) {
        let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let pairs = _mm_add_ps(x, _mm_movehl_ps(x, x));
        *o = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, hd: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n * hd)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn each_score_has_the_same_bits_alone_and_in_any_block() {
        let hd = 256;
        assert!(ymm_available(hd), "the JIT needs AVX2 and FMA");
        check_blocks(scores_ymm, hd);
        if available(hd) {
            check_blocks(scores, hd);
        } else {
            // The engine takes the JIT's or the ymm scores there.
            eprintln!("no AVX-512 on this CPU: its scores are not used here");
        }
    }

    fn check_blocks(scores: fn(&[f32], &[f32], usize, &mut [f32]), hd: usize) {
        for (nq, n_keys) in [(1usize, 1usize), (4, 4), (32, 275), (5, 7), (3, 2), (9, 13)] {
            let (q, k) = (rows(nq, hd, 1), rows(n_keys + 3, hd, 2));
            let mut all = vec![f32::NAN; nq * n_keys];
            scores(&k[..n_keys * hd], &q, hd, &mut all);
            for i in 0..nq {
                for j in 0..n_keys {
                    // Alone, and as the first key of a shifted run.
                    let qi = &q[i * hd..(i + 1) * hd];
                    let mut one = [f32::NAN];
                    scores(&k[j * hd..(j + 1) * hd], qi, hd, &mut one);
                    let run = &k[j * hd..(j + 3) * hd];
                    let mut three = [f32::NAN; 3];
                    scores(run, qi, hd, &mut three);
                    let got = all[i * n_keys + j];
                    assert_eq!(got.to_bits(), one[0].to_bits(), "{nq}x{n_keys}: ({i}, {j})");
                    assert_eq!(
                        got.to_bits(),
                        three[0].to_bits(),
                        "{nq}x{n_keys}: ({i}, {j})"
                    );
                    let exact: f64 = qi
                        .iter()
                        .zip(&k[j * hd..(j + 1) * hd])
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    assert!((got as f64 - exact).abs() < 1e-4, "{got} against {exact}");
                }
            }
        }
    }
}
