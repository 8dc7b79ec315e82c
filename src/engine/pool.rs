//! A persistent thread pool for the decode hot path.
//!
//! A decode step runs dozens of short parallel sections (one per weight
//! matrix), so waking workers must cost well under a microsecond. Workers
//! wait on a cache-line-sized generation counter, spinning with `pause` for
//! a bounded time and then parking, so an idle chat burns no CPU. The
//! calling thread takes part as worker 0.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(200);

/// Keeps a hot atomic on its own cache line (Zen and most x86: 64 bytes;
/// 128 avoids the adjacent-line prefetcher pairing two lines).
#[repr(align(128))]
struct Padded<T>(T);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped once per published job; workers wait for it to change.
    generation: Padded<AtomicU64>,
    /// Workers still running the current job.
    pending: Padded<AtomicUsize>,
    /// The current job. Written only by the caller of `run` while every
    /// worker is idle, read by workers after they see the new generation.
    job: UnsafeCell<Option<*const Job>>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Per worker: parked (or about to park) and needing an unpark.
    sleeping: Vec<Padded<AtomicBool>>,
}

// SAFETY: `job` is only written while no worker reads it (between jobs, with
// `pending` at 0), and the generation counter's release/acquire orders the
// write before every read.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
}

impl ThreadPool {
    /// A pool running jobs on `threads` threads (the caller included).
    pub fn new(threads: usize) -> ThreadPool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: Padded(AtomicU64::new(0)),
            pending: Padded(AtomicUsize::new(0)),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: (0..threads)
                .map(|_| Padded(AtomicBool::new(false)))
                .collect(),
        });
        let workers = (1..threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                let handle = thread::Builder::new()
                    .name(format!("pulsar-worker-{index}"))
                    .spawn(move || worker_loop(&shared, index))
                    .expect("spawning a worker thread");
                let thread = handle.thread().clone();
                (handle, thread)
            })
            .collect();
        ThreadPool { shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `job(thread_index)` on every thread and returns when all are done.
    pub fn run<F: Fn(usize) + Sync>(&self, job: F) {
        if self.workers.is_empty() {
            job(0);
            return;
        }
        let s = &*self.shared;
        let borrowed: &(dyn Fn(usize) + Sync + '_) = &job;
        // SAFETY: the lifetime is erased only for the duration of this call:
        // we wait below until every worker is done with the pointer.
        let erased: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(borrowed) };
        unsafe { *s.job.get() = Some(erased) };
        s.pending.0.store(self.workers.len(), Ordering::Relaxed);
        s.generation.0.fetch_add(1, Ordering::SeqCst);
        for (i, (_, thread)) in self.workers.iter().enumerate() {
            if s.sleeping[i + 1].0.swap(false, Ordering::SeqCst) {
                thread.unpark();
            }
        }
        let mine = catch_unwind(AssertUnwindSafe(|| job(0)));
        let mut spins = 0u32;
        while s.pending.0.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        unsafe { *s.job.get() = None };
        if let Err(payload) = mine {
            std::panic::resume_unwind(payload);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a pulsar worker thread panicked while running a job");
        }
    }

    /// Runs `work` once per thread on that thread's part of `total` items
    /// ([`split_range`] in runs of `granule`). `carve(items)` cuts each
    /// part's data off the front, in thread order, before the section
    /// starts, so every thread owns its slices outright (each sits behind
    /// a lock only its own thread takes).
    pub fn run_parts<T: Send>(
        &self,
        total: usize,
        granule: usize,
        mut carve: impl FnMut(usize) -> T,
        work: impl Fn(T) + Sync,
    ) {
        let threads = self.threads();
        let parts: Vec<Mutex<Option<T>>> = (0..threads)
            .map(|index| {
                let (first, end) = split_range(total, threads, index, granule);
                Mutex::new(Some(carve(end - first)))
            })
            .collect();
        self.run(|tid| {
            let part = parts[tid].lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(part) = part {
                work(part);
            }
        });
    }

    /// Mean time of an empty `run` round trip over `iterations`: the cost
    /// of waking every worker and waiting for all of them.
    pub fn wake_latency(&self, iterations: u32) -> Duration {
        self.run(|_| {});
        let start = Instant::now();
        for _ in 0..iterations {
            self.run(|_| {});
        }
        start.elapsed() / iterations.max(1)
    }
}

fn worker_loop(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new generation: spin, then park.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let now = s.generation.0.load(Ordering::Acquire);
            if now != seen {
                seen = now;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && started.elapsed() > SPIN_BEFORE_PARK {
                s.sleeping[index].0.store(true, Ordering::SeqCst);
                // Re-check after announcing sleep: a job published in between
                // would otherwise find no sleeper to unpark.
                if s.generation.0.load(Ordering::SeqCst) == seen
                    && !s.shutdown.load(Ordering::SeqCst)
                {
                    thread::park();
                }
                s.sleeping[index].0.store(false, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: published before the generation bump we just observed.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index) }));
            if result.is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.0.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for (_, thread) in &self.workers {
            thread.unpark();
        }
        for (handle, _) in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

/// The half-open range of `total` items that thread `index` of `threads`
/// takes, in contiguous chunks rounded to multiples of `granule`.
pub fn split_range(total: usize, threads: usize, index: usize, granule: usize) -> (usize, usize) {
    let granule = granule.max(1);
    let blocks = total.div_ceil(granule);
    let per = blocks / threads;
    let extra = blocks % threads;
    let start_block = index * per + index.min(extra);
    let end_block = start_block + per + usize::from(index < extra);
    (
        (start_block * granule).min(total),
        (end_block * granule).min(total),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Every item of every carved part is worked on exactly once, with
    /// the parts cut at the granule.
    #[test]
    fn run_parts_hands_each_item_to_one_thread() {
        let pool = ThreadPool::new(3);
        let mut items = vec![0u32; 101];
        let mut left = &mut items[..];
        let mut sizes = Vec::new();
        let carve = |n: usize| {
            sizes.push(n);
            let (part, rest) = std::mem::take(&mut left).split_at_mut(n);
            left = rest;
            part
        };
        pool.run_parts(101, 8, carve, |part: &mut [u32]| {
            part.iter_mut().for_each(|v| *v += 1);
        });
        assert_eq!(sizes, [40, 32, 29]);
        assert!(items.iter().all(|&v| v == 1), "{items:?}");
    }

    #[test]
    fn every_thread_runs_every_job() {
        let pool = ThreadPool::new(3);
        let hits = AtomicUsize::new(0);
        for _ in 0..1000 {
            pool.run(|_| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 3000);
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = ThreadPool::new(2);
        let seen = [AtomicUsize::new(0), AtomicUsize::new(0)];
        pool.run(|i| {
            seen[i].fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(SPIN_BEFORE_PARK * 20);
        pool.run(|i| {
            seen[i].fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(seen[1].load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i| {
                if i == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let hits = AtomicUsize::new(0);
        pool.run(|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn split_covers_everything_once() {
        for total in [0, 1, 7, 64, 1000, 1023] {
            for threads in 1..5 {
                for granule in [1, 4, 16] {
                    let mut next = 0;
                    for t in 0..threads {
                        let (a, b) = split_range(total, threads, t, granule);
                        assert_eq!(a, next);
                        assert!(b >= a);
                        if b < total {
                            assert_eq!(b % granule, 0);
                        }
                        next = b;
                    }
                    assert_eq!(next, total);
                }
            }
        }
    }
}
