//! The persistent thread pool: coverage, reuse, panics, nesting, sleep.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use spinfer_kernels::pool::{ThreadPool, chunk};

#[test]
fn every_index_runs_once_per_broadcast() {
    for n in 1..=4 {
        let pool = ThreadPool::new(n);
        assert_eq!(pool.n_threads(), n);
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..2000 {
            pool.broadcast(&|i, nt| {
                assert_eq!(nt, n);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), 2000);
        }
    }
}

#[test]
fn broadcast_waits_for_all_threads() {
    let pool = ThreadPool::new(3);
    let data = Mutex::new(vec![0usize; 300]);
    for round in 1..50 {
        pool.broadcast(&|i, n| {
            let r = chunk(300, i, n);
            if i == 1 {
                std::thread::sleep(Duration::from_micros(50));
            }
            let mut d = data.lock().unwrap();
            for v in &mut d[r] {
                *v += 1;
            }
        });
        assert!(data.lock().unwrap().iter().all(|&v| v == round));
    }
}

#[test]
fn worker_panic_is_resumed_on_the_caller_and_pool_survives() {
    let pool = ThreadPool::new(3);
    let res = catch_unwind(AssertUnwindSafe(|| {
        pool.broadcast(&|i, _| {
            if i == 2 {
                panic!("boom in worker");
            }
        })
    }));
    let msg = res.unwrap_err();
    assert_eq!(msg.downcast_ref::<&str>(), Some(&"boom in worker"));
    let res = catch_unwind(AssertUnwindSafe(|| pool.broadcast(&|i, _| assert_ne!(i, 0, "caller"))));
    assert!(res.is_err());
    let count = AtomicUsize::new(0);
    pool.broadcast(&|_, _| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 3);
}

#[test]
fn nested_broadcast_runs_serially_instead_of_deadlocking() {
    let pool = ThreadPool::new(2);
    let inner = AtomicUsize::new(0);
    pool.broadcast(&|i, _| {
        if i == 0 {
            pool.broadcast(&|_, _| {
                inner.fetch_add(1, Ordering::Relaxed);
            });
        }
    });
    assert_eq!(inner.load(Ordering::Relaxed), 2);
}

#[test]
fn sleeping_workers_wake_up() {
    let pool = ThreadPool::new(2);
    let count = AtomicUsize::new(0);
    for _ in 0..3 {
        // Longer than the spin window, so workers go to sleep.
        std::thread::sleep(Duration::from_millis(5));
        pool.broadcast(&|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
    }
    assert_eq!(count.load(Ordering::Relaxed), 6);
}

#[test]
fn pool_is_shareable_and_drops_cleanly() {
    let pool = ThreadPool::new(4);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let c = AtomicUsize::new(0);
                for _ in 0..200 {
                    pool.broadcast(&|_, _| {
                        c.fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert_eq!(c.load(Ordering::Relaxed), 800);
            });
        }
    });
    drop(pool);
}

/// Reports the broadcast round trip; it asserts nothing about time (a
/// spinning pool on a shared, oversubscribed CI machine can wait a whole
/// scheduler quantum per broadcast). `cargo bench -p spinfer-kernels`
/// measures it; correctness of broadcast is checked above.
#[test]
fn dispatch_round_trip() {
    let pool = ThreadPool::new(2);
    for _ in 0..1000 {
        pool.broadcast(&|_, _| {});
    }
    let iters = 20_000;
    let t = Instant::now();
    for _ in 0..iters {
        pool.broadcast(&|_, _| {});
    }
    let per = t.elapsed() / iters;
    eprintln!("broadcast round trip: {per:?}");
}
