//! The machine's read bandwidth over a buffer of a given size, or over
//! given memory (the weights themselves): the ceiling a decode step
//! (which streams every weight once) is compared with.

use super::pool::{ThreadPool, split_range};
use std::time::Instant;

/// Sums a slice's 8-byte words with wide loads (a tail shorter than a
/// word is skipped); the sum only keeps the reads alive.
fn touch(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was just detected.
            return unsafe { touch_avx2(bytes) };
        }
    }
    words_sum(bytes)
}

fn words_sum(bytes: &[u8]) -> u64 {
    bytes.chunks_exact(8).fold(0u64, |a, w| {
        a.wrapping_add(u64::from_le_bytes([
            w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
        ]))
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn touch_avx2(bytes: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let blocks = bytes.len() / 128;
    for b in 0..blocks {
        for (l, a) in acc.iter_mut().enumerate() {
            // SAFETY: in bounds (128 bytes per block); unaligned loads.
            let v = unsafe { _mm256_loadu_si256(bytes.as_ptr().add(b * 128 + l * 32).cast()) };
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
    let tail = words_sum(&bytes[blocks * 128..]);
    out.iter().fold(tail, |a, &w| a.wrapping_add(w))
}

/// Best-of-`rounds` read bandwidth in GB/s (1e9 bytes/s) over a buffer of
/// `bytes`, read by every thread of `pool` in contiguous parts.
pub fn read_bandwidth(pool: &ThreadPool, bytes: usize, rounds: usize) -> f64 {
    // The same kind of memory the packed weights live in: anonymous,
    // advised for huge pages, filled (so every page is really there).
    let len = bytes.max(128);
    let mut map = memmap2::MmapMut::map_anon(len).expect("memory for the read benchmark");
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(1);
    read_bandwidth_of(pool, &[&map[..]], rounds)
}

/// Best-of-`rounds` read bandwidth in GB/s over `parts` (the model's own
/// weights, say), each part split across `pool`'s threads. On the VMs
/// this was written on, the memory's speed changed within seconds (about
/// 33 or 58-67 GB/s), so a read measures its own moment: `bench` reads
/// the weights just before a decode and just after it.
pub fn read_bandwidth_of(pool: &ThreadPool, parts: &[&[u8]], rounds: usize) -> f64 {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut best = f64::MAX;
    let mut sink = 0u64;
    for _ in 0..rounds.max(1) + 1 {
        let start = Instant::now();
        sink = sink.wrapping_add(read_parts(pool, parts));
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    total as f64 / best / 1e9
}

/// One read of `parts`, each split across `pool`'s threads on 128-byte
/// boundaries: the wrapping sum of every part's whole words.
fn read_parts(pool: &ThreadPool, parts: &[&[u8]]) -> u64 {
    let threads = pool.threads();
    let sink = std::sync::atomic::AtomicU64::new(0);
    pool.run(|tid| {
        let mut sum = 0u64;
        for part in parts {
            let (a, b) = split_range(part.len(), threads, tid, 128);
            sum = sum.wrapping_add(touch(&part[a..b]));
        }
        sink.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
    });
    sink.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wide loop and its tail add up every whole word, whatever the
    /// length, as the plain sum does (a lost or doubled block would change
    /// the sum).
    #[test]
    fn the_wide_read_sums_every_word_once() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 131 % 251) as u8).collect();
        for len in [0, 7, 8, 127, 128, 129, 300, 1000] {
            assert_eq!(
                touch(&bytes[..len]),
                words_sum(&bytes[..len]),
                "{len} bytes"
            );
        }
        assert_ne!(words_sum(&bytes), 0);
    }

    /// Every thread's share of every part is read once: the split read
    /// of parts of odd lengths sums what each part's plain sum does.
    #[test]
    fn the_read_of_parts_covers_each_once() {
        let pool = ThreadPool::new(2);
        let a: Vec<u8> = (0..4096 + 24).map(|i| (i % 253) as u8).collect();
        let b: Vec<u8> = (0..333).map(|i| (i % 7 + 1) as u8).collect();
        let want = words_sum(&a).wrapping_add(words_sum(&b));
        assert_eq!(read_parts(&pool, &[&a, &b]), want);
        assert!(read_bandwidth_of(&pool, &[&a, &b], 1) > 0.0);
    }
}
