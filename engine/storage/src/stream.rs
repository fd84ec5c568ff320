//! Weights read from storage per token, ahead of need, under a memory
//! budget ([`crate::placement`] decides which).
//!
//! A session that streams owns a [`Streamer`]: a dedicated I/O thread and
//! a ring of buffers. The forward pass uses the streamed pieces ("items":
//! a matrix, or a range of rows of a large one) in the same order every
//! step, so the order is a cycle known at load: the thread reads item
//! after item into the ring as buffers come free, running ahead of the
//! compute by up to the ring's size, across layer and token boundaries.
//! Each read is followed by `posix_fadvise(DONTNEED)` on its range, so
//! streamed bytes do not stay in the page cache (which a memory cap counts)
//! and never push out what is resident.
//!
//! [`Streamer::acquire`] hands the compute thread the next item's bytes,
//! waiting (a *stall*, counted) if the read has not finished. When a step
//! uses items out of the cycle's order (an error mid-step, a step that
//! skips a part), the consumer resynchronises: reads ahead of it are
//! dropped and the thread restarts at the item asked for.

use std::cell::UnsafeCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// One streamed piece of weights: `len` bytes at `offset` of `file`.
#[derive(Clone, Debug)]
pub struct Item {
    pub file: Arc<File>,
    /// For error messages: the file and the tensor.
    pub what: Arc<str>,
    pub offset: u64,
    pub len: usize,
}

/// Per-session counters of the streamed weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bytes read from storage (streamed items and embedding rows).
    pub bytes_read: u64,
    /// Items the compute found already read (read ahead in time).
    pub prefetch_hits: u64,
    /// Items it had to wait for.
    pub stalls: u64,
    /// Time spent waiting for reads.
    pub stall_time: Duration,
    /// Read-ahead dropped by a resynchronisation.
    pub resyncs: u64,
}

/// What a ring slot holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// The I/O thread is reading cycle position `pos` into it.
    Filling(u64),
    /// Position `pos` is read.
    Ready(u64),
}

struct State {
    slots: Vec<Slot>,
    /// The next cycle position the I/O thread reads.
    next_read: u64,
    /// The next cycle position the compute uses.
    next_use: u64,
    /// Bumped by a resynchronisation: a read started before it is dropped.
    generation: u64,
    error: Option<String>,
    stop: bool,
    stats: StreamStats,
}

struct Shared {
    items: Arc<[Item]>,
    /// One buffer per slot, `max item len` bytes each.
    bufs: Vec<UnsafeCell<Box<[u8]>>>,
    state: Mutex<State>,
    changed: Condvar,
}

// SAFETY: a slot's buffer is written only by the I/O thread while the slot
// is `Filling` and read only by the compute thread while it is `Ready` and
// held through an `ItemBytes` (which keeps the slot from being freed until
// it is dropped); the state machine in `state` (behind the mutex) makes the
// two exclusive.
unsafe impl Sync for Shared {}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A session's I/O thread and ring of read-ahead buffers.
pub struct Streamer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// I/O threads per streamer: reads in flight at once (storage serves a
/// queue of several reads faster than one at a time).
pub const READERS: usize = 3;

/// The bytes of one acquired item, valid until [`Streamer::release`].
pub struct ItemBytes {
    ptr: *const u8,
    len: usize,
}

impl ItemBytes {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the slot stays `Ready` and unwritten until `release`,
        // which consumes this value; the buffer outlives the streamer's
        // shared state, which `Streamer` keeps alive.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Streamer {
    /// A streamer over `items` (the cycle) with `slots` buffers; starts the
    /// I/O thread.
    ///
    /// # Errors
    ///
    /// When the buffers cannot be allocated or the thread cannot start.
    pub fn new(items: Arc<[Item]>, slots: usize) -> Result<Self> {
        let slots = slots.clamp(2, 64);
        let max = items.iter().map(|i| i.len).max().unwrap_or(0);
        let mut bufs = Vec::with_capacity(slots);
        for _ in 0..slots {
            let mut v = Vec::new();
            v.try_reserve_exact(max)
                .map_err(|e| Error::InvalidArgument(format!("read-ahead buffer of {max} bytes: {e}")))?;
            v.resize(max, 0);
            bufs.push(UnsafeCell::new(v.into_boxed_slice()));
        }
        let shared = Arc::new(Shared {
            items,
            bufs,
            state: Mutex::new(State {
                slots: vec![Slot::Free; slots],
                next_read: 0,
                next_use: 0,
                generation: 0,
                error: None,
                stop: false,
                stats: StreamStats::default(),
            }),
            changed: Condvar::new(),
        });
        // Kernel read-ahead would read past each item into the page cache
        // (which the items' DONTNEED then drops unused): the items are the
        // read-ahead.
        for f in unique_files(&shared.items) {
            advise(f, 0, 0, POSIX_FADV_RANDOM);
        }
        let mut streamer = Self { shared, threads: Vec::with_capacity(READERS) };
        for i in 0..READERS.min(slots - 1) {
            let worker = Arc::clone(&streamer.shared);
            let t = std::thread::Builder::new()
                .name(format!("spinfer-stream-{i}"))
                .spawn(move || read_loop(&worker))
                .map_err(|e| Error::InvalidArgument(format!("starting the weight-streaming thread: {e}")))?;
            streamer.threads.push(t);
        }
        Ok(streamer)
    }

    /// The bytes of item `item`, the next the forward pass needs: waits for
    /// its read if it is not done yet. Give them back with
    /// [`Streamer::release`] before acquiring the next.
    ///
    /// # Errors
    ///
    /// A read error of this or an earlier item (naming the file, the tensor
    /// and the offset).
    pub fn acquire(&self, item: usize) -> Result<ItemBytes> {
        let sh = &*self.shared;
        let n = sh.items.len() as u64;
        let k = sh.bufs.len() as u64;
        let mut st = sh.lock();
        if let Some(e) = &st.error {
            return Err(Error::InvalidArgument(e.clone()));
        }
        // Out of order: restart the cycle at `item`.
        if st.next_use % n != item as u64 {
            let mut pos = st.next_use;
            while pos % n != item as u64 {
                pos += 1;
            }
            st.next_use = pos;
            st.next_read = pos;
            st.generation += 1;
            st.stats.resyncs += 1;
            for s in st.slots.iter_mut() {
                if let Slot::Ready(_) = s {
                    *s = Slot::Free;
                }
            }
            sh.changed.notify_all();
        }
        let pos = st.next_use;
        let slot = (pos % k) as usize;
        if st.slots[slot] == Slot::Ready(pos) {
            st.stats.prefetch_hits += 1;
        } else {
            let t0 = Instant::now();
            while st.slots[slot] != Slot::Ready(pos) {
                if let Some(e) = &st.error {
                    return Err(Error::InvalidArgument(e.clone()));
                }
                st = sh.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            st.stats.stalls += 1;
            st.stats.stall_time += t0.elapsed();
        }
        let len = sh.items[item].len;
        // SAFETY: the slot is `Ready(pos)`: the I/O thread no longer writes
        // it, and will not until `release` frees it.
        let whole: &[u8] = unsafe { &*sh.bufs[slot].get() };
        let ptr = whole.as_ptr();
        Ok(ItemBytes { ptr, len })
    }

    /// Gives back the item acquired last; its buffer takes a later read.
    pub fn release(&self, _bytes: ItemBytes) {
        let sh = &*self.shared;
        let k = sh.bufs.len() as u64;
        let mut st = sh.lock();
        let slot = (st.next_use % k) as usize;
        st.slots[slot] = Slot::Free;
        st.next_use += 1;
        sh.changed.notify_all();
    }

    /// Counts a synchronous read of `bytes` bytes (an embedding row).
    pub fn count_read(&self, bytes: usize) {
        self.shared.lock().stats.bytes_read += bytes as u64;
    }

    /// The counters so far.
    pub fn stats(&self) -> StreamStats {
        self.shared.lock().stats
    }

    /// Zeroes the counters.
    pub fn reset_stats(&self) {
        self.shared.lock().stats = StreamStats::default();
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The I/O thread: reads the cycle's items into free slots, ahead of the
/// compute, until stopped or a read fails.
fn read_loop(sh: &Shared) {
    let n = sh.items.len() as u64;
    let k = sh.bufs.len() as u64;
    if n == 0 {
        return;
    }
    loop {
        let (pos, slot, generation) = {
            let mut st = sh.lock();
            loop {
                if st.stop || st.error.is_some() {
                    return;
                }
                let pos = st.next_read;
                let slot = (pos % k) as usize;
                if pos < st.next_use + k && st.slots[slot] == Slot::Free {
                    st.slots[slot] = Slot::Filling(pos);
                    st.next_read = pos + 1;
                    break (pos, slot, st.generation);
                }
                st = sh.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let item = &sh.items[(pos % n) as usize];
        // SAFETY: the slot is `Filling(pos)`: the compute thread does not
        // read it until it is `Ready`.
        let whole: &mut Box<[u8]> = unsafe { &mut *sh.bufs[slot].get() };
        let buf = &mut whole[..item.len];
        let r = item.file.read_exact_at(buf, item.offset);
        if r.is_ok() {
            drop_cached(&item.file, item.offset, item.len);
        }
        let mut st = sh.lock();
        match r {
            Err(e) => {
                st.error = Some(format!("{}: reading {} bytes at offset {}: {e}", item.what, item.len, item.offset));
                st.slots[slot] = Slot::Free;
            }
            Ok(()) if st.generation == generation && st.slots[slot] == Slot::Filling(pos) => {
                st.slots[slot] = Slot::Ready(pos);
                st.stats.bytes_read += item.len as u64;
            }
            // Dropped by a resynchronisation meanwhile: the new cycle
            // position is in `next_read` already.
            Ok(()) => {
                if st.slots[slot] == Slot::Filling(pos) {
                    st.slots[slot] = Slot::Free;
                }
                st.stats.bytes_read += item.len as u64;
            }
        }
        sh.changed.notify_all();
    }
}

/// Asks the kernel to drop `file`'s cached pages of `[offset, offset +
/// len)`: the bytes were copied out, and a memory cap counts page cache.
pub fn drop_cached(file: &File, offset: u64, len: usize) {
    advise(file, offset, len as u64, POSIX_FADV_DONTNEED);
}

const POSIX_FADV_RANDOM: i32 = 1;
const POSIX_FADV_DONTNEED: i32 = 4;

/// `posix_fadvise(file, offset, len, advice)`; advice only, so a failure
/// changes nothing but speed or memory and is ignored.
fn advise(file: &File, offset: u64, len: u64, advice: i32) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        unsafe extern "C" {
            fn posix_fadvise(fd: i32, offset: i64, len: i64, advice: i32) -> i32;
        }
        // SAFETY: a plain system call on an open descriptor; it only
        // affects the page cache, never the file's contents.
        unsafe { posix_fadvise(file.as_raw_fd(), offset as i64, len as i64, advice) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len, advice);
}

/// The distinct files of `items`.
fn unique_files(items: &[Item]) -> Vec<&File> {
    let mut out: Vec<&Arc<File>> = Vec::new();
    for i in items {
        if !out.iter().any(|f| Arc::ptr_eq(f, &i.file)) {
            out.push(&i.file);
        }
    }
    out.into_iter().map(|f| &**f).collect()
}
