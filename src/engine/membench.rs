//! The machine's read bandwidth over a buffer of a given size: the ceiling
//! a decode step (which streams every weight once) is compared with.

use super::pool::{ThreadPool, split_range};
use std::time::Instant;

/// Sums a slice with wide loads; the sum only keeps the reads alive.
fn touch(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was just detected.
            return unsafe { touch_avx2(words) };
        }
    }
    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn touch_avx2(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let blocks = words.len() / 16;
    for b in 0..blocks {
        for (l, a) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds (16 words per block); unaligned loads.
            let v = unsafe { _mm256_loadu_si256(words.as_ptr().add(b * 16 + l * 4).cast()) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let mut out = [0u64; 4];
    let sum = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    // SAFETY: out holds 32 bytes.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), sum) };
    let tail: u64 = words[blocks * 16..]
        .iter()
        .fold(0, |a, &w| a.wrapping_add(w));
    out.iter().fold(tail, |a, &w| a.wrapping_add(w))
}

/// Best-of-`rounds` read bandwidth in GB/s (1e9 bytes/s) over a buffer of
/// `bytes`, read by every thread of `pool` in contiguous parts.
pub fn read_bandwidth(pool: &ThreadPool, bytes: usize, rounds: usize) -> f64 {
    // The same kind of memory the packed weights live in: anonymous,
    // advised for huge pages, filled (so every page is really there).
    let len = bytes.div_ceil(8).max(16);
    let mut map = memmap2::MmapMut::map_anon(len * 8).expect("memory for the read benchmark");
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(1);
    // SAFETY: the map holds len u64s, page-aligned.
    let words: &[u64] = unsafe { std::slice::from_raw_parts(map.as_ptr().cast(), len) };
    let threads = pool.threads();
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut best = f64::MAX;
    for _ in 0..rounds.max(1) + 1 {
        let start = Instant::now();
        pool.run(|tid| {
            let (a, b) = split_range(words.len(), threads, tid, 16);
            sink.fetch_add(touch(&words[a..b]), std::sync::atomic::Ordering::Relaxed);
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink.into_inner());
    words.len() as f64 * 8.0 / best / 1e9
}
