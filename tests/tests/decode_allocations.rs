//! Architecture invariant: decode allocates nothing per token. After a
//! session's first tokens (its buffers grow to their working sizes and then
//! never shrink), one decode step — a one-token forward pass and the next
//! token's logits — makes no heap allocation, in every precision, with the
//! dense output head. Counted by a global allocator, on every thread (the
//! session's worker threads included) while the steps run.
//!
//! Its own test binary: the counting allocator is process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use spinfer_engine::Engine;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_tests::smollm2;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: defers every call to `System`; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Counts an allocation while a measurement runs.
fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made (on any thread) while `f` runs.
fn allocations_in(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst) - before
}

#[test]
fn decode_steps_allocate_nothing() {
    let Some(path) = smollm2() else { return };
    for precision in [Precision::Fast, Precision::Int8, Precision::Precise] {
        let e =
            Engine::load(&path, ModelOptions { precision, ctx: 128, threads: 2, ..ModelOptions::default() }).unwrap();
        let mut s = e.new_session();
        let prompt = e.tokenize("The capital of France is").unwrap();
        e.model.forward(&mut s, &prompt).unwrap();
        let mut token = argmax(e.model.next_token_logits(&mut s).unwrap());
        // Warm-up: the first decode steps size the one-token buffers.
        for _ in 0..2 {
            e.model.forward(&mut s, &[token]).unwrap();
            token = argmax(e.model.next_token_logits(&mut s).unwrap());
        }
        let mut tokens = Vec::with_capacity(16);
        let n = allocations_in(|| {
            for _ in 0..16 {
                e.model.forward(&mut s, &[token]).unwrap();
                token = argmax(e.model.next_token_logits(&mut s).unwrap());
                tokens.push(token);
            }
        });
        assert_eq!(n, 0, "{precision:?}: {n} allocations in 16 decode steps");
        assert_eq!(tokens.len(), 16);
    }
}

fn argmax(logits: &[f32]) -> u32 {
    logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32)
}
