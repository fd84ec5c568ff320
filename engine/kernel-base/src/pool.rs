//! A persistent thread pool with low dispatch latency for the kernels.
//!
//! The pool owns `n - 1` worker threads; the thread calling
//! [`ThreadPool::broadcast`] acts as thread 0. A broadcast publishes the job
//! by bumping an atomic generation counter; workers that finished their last
//! job less than [`SPIN_TIME`] ago are spinning on that counter and start
//! within a fraction of a microsecond, workers idle for longer sleep on a
//! condition variable (so an idle process does not burn CPU) and are woken
//! explicitly. Decode issues a few hundred broadcasts per token, so the
//! round trip has to cost a microsecond or two, not the tens of microseconds
//! of a futex wake-up.
//!
//! Each index of a broadcast is *claimed* (a compare-and-swap on a per-worker
//! slot) by either its worker or the caller: when the caller has finished
//! its own index and a worker has not started yet (it is asleep, or the
//! machine is oversubscribed and the OS has not scheduled it), the caller
//! runs that index itself instead of waiting. Every index still runs exactly
//! once, but not necessarily on "its" thread; the kernels only use the index
//! to pick their share of the work.
//!
//! A panic inside the job on any thread is caught, the broadcast still waits
//! for every started index to finish, and the first panic is then resumed on
//! the caller, so a panicking kernel never deadlocks the pool.

use std::any::Any;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins on the generation counter before it goes
/// to sleep on the condition variable.
pub const SPIN_TIME: Duration = Duration::from_millis(1);

/// How long waits spin without yielding the CPU (workers waiting for a job,
/// the caller waiting for the workers).
pub const PURE_SPIN_TIME: Duration = Duration::from_micros(50);

/// The job type: called once per thread with `(thread_index, n_threads)`.
type Job<'a> = dyn Fn(usize, usize) + Sync + 'a;

/// State shared between the caller and the workers.
struct Shared {
    n_threads: usize,
    /// Bumped once per broadcast (and once at shutdown).
    generation: AtomicU64,
    /// Points at a `&Job` on the broadcasting thread's stack while a
    /// broadcast is in flight, null otherwise.
    job: AtomicPtr<()>,
    /// Workers between announcing a claim attempt and finishing the job;
    /// the caller waits for this to drop to zero.
    pending: AtomicUsize,
    /// Per worker index (entry 0 unused): the last generation whose index
    /// was claimed, by the worker or by the caller.
    claims: Box<[AtomicU64]>,
    /// Workers sleeping (or about to sleep) on `cv`.
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
    /// The first panic payload raised by a worker during the current job.
    panic: Mutex<Option<Box<dyn Any + Send + 'static>>>,
}

fn lock_ignoring_poison<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Waits until the generation differs from `seen` and returns it:
    /// spins for [`PURE_SPIN_TIME`], then spins with `yield_now` (so an
    /// oversubscribed machine can run other threads) until [`SPIN_TIME`],
    /// then sleeps on the condition variable.
    fn wait_for_job(&self, seen: u64) -> u64 {
        let start = Instant::now();
        let mut spins = 0u32;
        let mut yielding = false;
        loop {
            let g = self.generation.load(Ordering::Acquire);
            if g != seen {
                return g;
            }
            if yielding {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                let el = start.elapsed();
                if el > SPIN_TIME {
                    break;
                }
                yielding = el > PURE_SPIN_TIME;
            }
        }
        let mut guard = lock_ignoring_poison(&self.lock);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let g = loop {
            let g = self.generation.load(Ordering::SeqCst);
            if g != seen {
                break g;
            }
            guard = self.cv.wait(guard).unwrap_or_else(|e| e.into_inner());
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// Wakes every sleeping worker after the generation was bumped.
    fn wake_sleepers(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = lock_ignoring_poison(&self.lock);
            self.cv.notify_all();
        }
    }

    /// Claims index `i` for generation `g`; exactly one of the worker and
    /// the caller succeeds.
    fn claim(&self, i: usize, g: u64) -> bool {
        let cur = self.claims[i].load(Ordering::SeqCst);
        cur < g && self.claims[i].compare_exchange(cur, g, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Runs the job for index `i`, recording a panic instead of unwinding.
    fn run_index(&self, f: &Job<'_>, i: usize) {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(i, self.n_threads))) {
            let mut slot = lock_ignoring_poison(&self.panic);
            if slot.is_none() {
                *slot = Some(payload);
            }
        }
    }

    fn worker_loop(&self, index: usize) {
        let mut seen = 0u64;
        loop {
            seen = self.wait_for_job(seen);
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            // Announce before claiming: once the claim succeeds, the caller
            // (whose own claim then fails) waits for `pending` to drop.
            self.pending.fetch_add(1, Ordering::SeqCst);
            if self.claim(index, seen) {
                let job = self.job.load(Ordering::SeqCst) as *const &Job<'static>;
                // SAFETY: `broadcast` stores a pointer to a live `&Job`
                // before bumping the generation to `seen` and keeps it alive
                // and unchanged until `pending` is zero; we won the claim for
                // `seen`, so that broadcast is still waiting for us.
                let f: &Job<'_> = unsafe { *job };
                self.run_index(f, index);
            }
            self.pending.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A fixed set of worker threads that run one closure on every thread.
pub struct ThreadPool {
    n_threads: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Set while a broadcast is in flight; a nested or concurrent broadcast
    /// runs its job serially on the calling thread instead of deadlocking.
    busy: AtomicBool,
}

impl ThreadPool {
    /// Creates a pool of `n_threads` threads (at least 1): the caller plus
    /// `n_threads - 1` persistent workers.
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            pending: AtomicUsize::new(0),
            claims: (0..n_threads).map(|_| AtomicU64::new(0)).collect(),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            panic: Mutex::new(None),
        });
        let workers = (1..n_threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("spinfer-worker-{i}"))
                    .spawn(move || shared.worker_loop(i))
                    .expect("failed to spawn a kernel worker thread")
            })
            .collect();
        Self { n_threads, shared, workers, busy: AtomicBool::new(false) }
    }

    /// Number of threads a broadcast runs on (including the caller).
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(index, n_threads)` once for each `index` in `0..n_threads`,
    /// spread over the pool's threads, and returns when all have finished.
    /// Index 0 runs on the calling thread; another index runs on its worker,
    /// or on the caller if that worker has not started when the caller is
    /// done (see the module docs). If any invocation panics, the first panic
    /// is resumed on the caller after all invocations have finished.
    pub fn broadcast(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.n_threads;
        if n == 1 {
            f(0, 1);
            return;
        }
        if self.busy.swap(true, Ordering::Acquire) {
            // Called from inside a job, or from two threads at once: run
            // every index here so the semantics (each index exactly once)
            // hold without waiting on ourselves.
            for i in 0..n {
                f(i, n);
            }
            return;
        }
        let sh = &*self.shared;
        let job: &Job<'_> = f;
        sh.job.store(&job as *const &Job<'_> as *mut (), Ordering::SeqCst);
        let g = sh.generation.fetch_add(1, Ordering::SeqCst) + 1;
        sh.wake_sleepers();

        let own = catch_unwind(AssertUnwindSafe(|| f(0, n)));
        // Run the indices of workers that have not started yet ourselves.
        for i in 1..n {
            if sh.claim(i, g) {
                sh.run_index(job, i);
            }
        }

        let mut spins = 0u32;
        let mut wait_start: Option<Instant> = None;
        let mut yielding = false;
        while sh.pending.load(Ordering::SeqCst) != 0 {
            if yielding {
                std::thread::yield_now();
                continue;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                let start = *wait_start.get_or_insert_with(Instant::now);
                yielding = start.elapsed() > PURE_SPIN_TIME;
            }
        }
        sh.job.store(std::ptr::null_mut(), Ordering::Release);
        let worker_panic = lock_ignoring_poison(&sh.panic).take();
        self.busy.store(false, Ordering::Release);
        if let Err(payload) = own {
            resume_unwind(payload);
        }
        if let Some(payload) = worker_panic {
            resume_unwind(payload);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _guard = lock_ignoring_poison(&self.shared.lock);
            self.shared.cv.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("n_threads", &self.n_threads).finish()
    }
}

/// The `i`-th of `parts` near-equal contiguous pieces of `0..n`.
pub fn chunk(n: usize, i: usize, parts: usize) -> Range<usize> {
    let base = n / parts;
    let rem = n % parts;
    let start = i * base + i.min(rem);
    let len = base + usize::from(i < rem);
    start..start + len
}

/// Like [`chunk`], but every piece except the last starts and ends on a
/// multiple of `align` (useful to keep SIMD row tiles whole).
pub fn chunk_aligned(n: usize, i: usize, parts: usize, align: usize) -> Range<usize> {
    let align = align.max(1);
    let units = n.div_ceil(align);
    let r = chunk(units, i, parts);
    (r.start * align).min(n)..(r.end * align).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_range() {
        for n in [0, 1, 7, 64, 1000] {
            for parts in 1..5 {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk_aligned(n, i, parts, 4);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}

/// A raw pointer handed to the pool's threads, which write disjoint parts of
/// the buffer behind it. Every use states why its writes are disjoint and
/// why the buffer outlives the broadcast.
#[derive(Clone, Copy, Debug)]
pub struct SyncPtr<T>(*mut T);

// SAFETY: the pointer is only dereferenced under the disjointness argument
// stated at each use; the wrapper itself shares nothing else.
unsafe impl<T> Sync for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Send for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    pub fn new(p: *mut T) -> Self {
        Self(p)
    }

    pub fn get(self) -> *mut T {
        self.0
    }
}
