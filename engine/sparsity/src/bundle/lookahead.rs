//! Look-ahead reads of the bundle's cold records (Deja Vu's asynchronous
//! prediction, applied to storage): while layer `l` computes, the caller
//! predicts layer `l + 1`'s neurons from the residual stream it already has
//! (which changes little from one layer to the next) and hands them to
//! [`FfnBundle::prefetch`]. A dedicated thread reads the predicted records
//! that are neither hot nor cached, in runs as [`FfnBundle::gather`] does,
//! into a staging area of one layer (not into the cold cache, whose policy
//! would have to evict for guesses, or refuse them), so the gather of
//! layer `l + 1` takes its misses from there instead of waiting for
//! storage, and inserts them into the cache as it would a read record.
//! The staging area is about one layer's predicted cold records (under a
//! megabyte for SmolLM2), outside the FFN budget's accounting.
//!
//! Only the latest request is kept: one the thread has not started when the
//! next arrives is dropped (counted), since its layer has been reached by
//! then. A look-ahead read that fails is dropped too (the gather then reads
//! the record itself and reports the error). Prefetching changes what is
//! cached, never what is computed: a gathered record is the file's bytes
//! whichever read brought it in.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::file::read_at;
use super::{FfnBundle, MAX_GAP, MAX_RUN};
use crate::cache::{ColdCache, NeuronId};

/// Engine-wide counters of the look-ahead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LookAheadCounters {
    /// Requests handed to the thread.
    pub requests: u64,
    /// Requests replaced by a newer one before the thread started them.
    pub dropped: u64,
    /// Records read ahead (not already cached when the thread got to them).
    pub records: u64,
    /// Bytes read ahead.
    pub bytes: u64,
    /// Records a gather took from the look-ahead instead of storage.
    pub used: u64,
}

/// One request: cold records `(position in the layer's record order,
/// neuron)` of `layer`, whose records start at file offset `base`.
struct Job {
    layer: u32,
    base: u64,
    cold: Vec<(u32, u32)>,
}

#[derive(Default)]
struct Queue {
    next: Option<Job>,
    stop: bool,
}

/// The records of the latest finished request: `neurons` (ascending, with
/// each one's record index in `data`) of `layer`.
#[derive(Default)]
struct Staged {
    layer: Option<u32>,
    neurons: Vec<(u32, u32)>,
    data: Vec<u8>,
}

struct Shared {
    file: Arc<File>,
    path: PathBuf,
    record: usize,
    cache: Arc<Mutex<ColdCache>>,
    queue: Mutex<Queue>,
    wake: Condvar,
    staged: Mutex<Staged>,
    requests: AtomicU64,
    used: AtomicU64,
    dropped: AtomicU64,
    records: AtomicU64,
    bytes: AtomicU64,
}

/// The look-ahead thread of a bundle (started by its first request).
pub(super) struct LookAhead {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The end (exclusive) of the run of records read in one call that starts
/// at `i` of `sorted` (ascending record positions by `key`): neighbours at
/// most [`MAX_GAP`] apart, at most [`MAX_RUN`] records from the first.
pub(super) fn run_end<T>(sorted: &[T], i: usize, key: impl Fn(&T) -> u32) -> usize {
    let p0 = key(&sorted[i]);
    let mut e = i + 1;
    while e < sorted.len() && key(&sorted[e]) - key(&sorted[e - 1]) <= MAX_GAP && key(&sorted[e]) - p0 < MAX_RUN {
        e += 1;
    }
    e
}

impl LookAhead {
    fn start(b: &FfnBundle) -> Option<Self> {
        let shared = Arc::new(Shared {
            file: Arc::clone(&b.file),
            path: b.path.clone(),
            record: b.h.record,
            cache: Arc::clone(&b.cache),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            staged: Mutex::new(Staged::default()),
            requests: AtomicU64::new(0),
            used: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        let worker = Arc::clone(&shared);
        match std::thread::Builder::new().name("spinfer-ffn-lookahead".into()).spawn(move || run(&worker)) {
            Ok(t) => Some(Self { shared, thread: Some(t) }),
            Err(e) => {
                tracing::warn!("FFN look-ahead off: cannot start its thread: {e}");
                None
            }
        }
    }
}

impl Drop for LookAhead {
    fn drop(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: takes the latest request, reads its records that are not
/// cached into a fresh staging area, publishes it.
fn run(sh: &Shared) {
    let (mut buf, mut next) = (Vec::new(), Staged::default());
    loop {
        let mut job = {
            let mut q = lock(&sh.queue);
            loop {
                if q.stop {
                    return;
                }
                if let Some(job) = q.next.take() {
                    break job;
                }
                q = sh.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        {
            let cache = lock(&sh.cache);
            job.cold.retain(|&(_, j)| !cache.contains(NeuronId { layer: job.layer, index: j }));
        }
        job.cold.sort_unstable();
        let rec = sh.record;
        next.neurons.clear();
        next.data.clear();
        let mut i = 0;
        while i < job.cold.len() {
            let e = run_end(&job.cold, i, |c| c.0);
            let p0 = job.cold[i].0;
            let n = (job.cold[e - 1].0 - p0 + 1) as usize;
            buf.resize(n * rec, 0);
            if read_at(&sh.file, &sh.path, &mut buf, job.base + p0 as u64 * rec as u64).is_err() {
                return;
            }
            sh.bytes.fetch_add((n * rec) as u64, Ordering::Relaxed);
            for &(p, j) in &job.cold[i..e] {
                next.neurons.push((j, next.neurons.len() as u32));
                next.data.extend_from_slice(&buf[(p - p0) as usize * rec..][..rec]);
            }
            sh.records.fetch_add((e - i) as u64, Ordering::Relaxed);
            i = e;
        }
        next.neurons.sort_unstable();
        next.layer = Some(job.layer);
        std::mem::swap(&mut *lock(&sh.staged), &mut next);
    }
}

impl FfnBundle {
    /// Asks for the records of neurons `idx` of layer `l` (predicted, not
    /// yet needed) to be read into the cold cache in the background. Hot
    /// neurons are skipped; returns at once.
    pub fn prefetch(&self, l: usize, idx: &[u32]) {
        let Some(layer) = self.layers.get(l) else { return };
        if self.report.cache_slots == 0 {
            return;
        }
        let cold: Vec<(u32, u32)> = idx
            .iter()
            .filter_map(|&j| {
                let p = *layer.pos.get(j as usize)?;
                (p as usize >= layer.hot).then_some((p, j))
            })
            .collect();
        if cold.is_empty() {
            return;
        }
        let Some(la) = self.prefetcher.get_or_init(|| LookAhead::start(self)) else { return };
        let base = self.records_at(l);
        let sh = &la.shared;
        sh.requests.fetch_add(1, Ordering::Relaxed);
        let replaced = lock(&sh.queue).next.replace(Job { layer: l as u32, base, cold });
        if replaced.is_some() {
            sh.dropped.fetch_add(1, Ordering::Relaxed);
        }
        sh.wake.notify_one();
    }

    /// Serves the misses in `cold` (`(position, slot in the gather,
    /// neuron)` of layer `l`) that the look-ahead has staged: each goes to
    /// `put(slot, record)` and into `cache`, and leaves `cold`. Returns how
    /// many were served.
    pub(super) fn take_staged(
        &self,
        l: usize,
        cold: &mut Vec<(u32, u32, u32)>,
        cache: &mut ColdCache,
        mut put: impl FnMut(usize, &[u8]),
    ) -> u64 {
        let Some(Some(la)) = self.prefetcher.get() else { return 0 };
        let sh = &la.shared;
        let staged = lock(&sh.staged);
        if staged.layer != Some(l as u32) {
            return 0;
        }
        let rec = sh.record;
        let before = cold.len();
        cold.retain(|&(_, kk, j)| match staged.neurons.binary_search_by_key(&j, |n| n.0) {
            Ok(i) => {
                let at = staged.neurons[i].1 as usize * rec;
                let r = &staged.data[at..at + rec];
                put(kk as usize, r);
                cache.insert(NeuronId { layer: l as u32, index: j }, r);
                false
            }
            Err(_) => true,
        });
        let served = (before - cold.len()) as u64;
        sh.used.fetch_add(served, Ordering::Relaxed);
        served
    }

    /// The look-ahead's counters so far (all sessions).
    pub fn lookahead_counters(&self) -> LookAheadCounters {
        let Some(Some(la)) = self.prefetcher.get() else { return LookAheadCounters::default() };
        let sh = &la.shared;
        LookAheadCounters {
            requests: sh.requests.load(Ordering::Relaxed),
            dropped: sh.dropped.load(Ordering::Relaxed),
            records: sh.records.load(Ordering::Relaxed),
            bytes: sh.bytes.load(Ordering::Relaxed),
            used: sh.used.load(Ordering::Relaxed),
        }
    }
}
