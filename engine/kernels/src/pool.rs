//! Thread pool for kernels. OWNED BY THE KERNELS HELPER: this simple
//! scoped-thread version is to be replaced by a persistent spinning pool.

use std::ops::Range;

/// A fixed set of worker threads that run one closure on every thread.
pub struct ThreadPool {
    n_threads: usize,
}

impl ThreadPool {
    pub fn new(n_threads: usize) -> Self {
        Self { n_threads: n_threads.max(1) }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(thread_index, n_threads)` once on each of the pool's threads
    /// (the caller's thread is index 0) and returns when all have finished.
    pub fn broadcast(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.n_threads;
        std::thread::scope(|s| {
            for i in 1..n {
                s.spawn(move || f(i, n));
            }
            f(0, n);
        });
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
