//! Weights read from storage per token, ahead of need, under a memory
//! budget ([`crate::placement`] decides which).
//!
//! A session that streams owns a [`Streamer`]: a dedicated I/O thread and
//! a ring of buffers. The forward pass uses the streamed pieces ("items":
//! a matrix, or a range of rows of a large one) in the same order every
//! step, so the order is a cycle known at load: the thread reads item
//! after item into the ring as buffers come free, running ahead of the
//! compute by up to the ring's size, across layer and token boundaries.
//! Reads bypass the page cache (`O_DIRECT`, on a second open file
//! description of the loader's own file, through `/proc/self/fd`): streamed
//! bytes never occupy page cache, which a memory cap counts, so they never
//! push out what is resident, and the storage's DMA writes straight into
//! the ring, with no copy for the CPUs that compute. Where the file system
//! refuses `O_DIRECT` (tmpfs, some network file systems), or with
//! `SPINFER_STREAM_IO=buffered`, reads go through the page cache and each
//! is followed by `posix_fadvise(DONTNEED)` on its range instead.
//!
//! [`Streamer::acquire`] hands the compute thread the next item's bytes,
//! waiting (a *stall*, counted) if the read has not finished. When a step
//! uses items out of the cycle's order (an error mid-step, a step that
//! skips a part), the consumer resynchronises: reads ahead of it are
//! dropped and the thread restarts at the item asked for.

use std::cell::UnsafeCell;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
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
    /// Per item, its file opened for direct reads (`None`: buffered).
    direct: Vec<Option<Arc<File>>>,
    /// One buffer per slot, room for the largest item's aligned span.
    bufs: Vec<UnsafeCell<Buf>>,
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

/// Environment variable choosing how streamed weights are read: `direct`
/// (default: `O_DIRECT` where the file system allows it) or `buffered`
/// (through the page cache, dropped after each read).
pub const STREAM_IO_ENV: &str = "SPINFER_STREAM_IO";

/// Alignment of a direct read's offset, length and buffer: a multiple of
/// every logical block size Linux storage reports (512 or 4096 bytes).
const ALIGN: usize = 4096;

/// A slot's buffer: room for an item's span widened to [`ALIGN`]ed ends,
/// starting at an aligned address.
struct Buf {
    raw: Box<[u8]>,
    /// Index of `raw`'s first aligned byte.
    start: usize,
}

impl Buf {
    /// A buffer for items of up to `max` bytes (at most `3 * ALIGN` more
    /// than `max`: the widened ends and the alignment of the start).
    fn new(max: usize) -> Result<Self> {
        let len = max.div_ceil(ALIGN) * ALIGN + 3 * ALIGN;
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|e| Error::InvalidArgument(format!("read-ahead buffer of {len} bytes: {e}")))?;
        v.resize(len, 0);
        let raw = v.into_boxed_slice();
        let start = raw.as_ptr().align_offset(ALIGN);
        Ok(Self { raw, start })
    }
}

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
        let buffered = std::env::var(STREAM_IO_ENV).is_ok_and(|v| v == "buffered");
        Self::start(items, slots, buffered)
    }

    /// [`Streamer::new`], reading through the page cache if `buffered`.
    fn start(items: Arc<[Item]>, slots: usize, buffered: bool) -> Result<Self> {
        let slots = slots.clamp(2, 64);
        let max = items.iter().map(|i| i.len).max().unwrap_or(0);
        let mut bufs = Vec::with_capacity(slots);
        for _ in 0..slots {
            bufs.push(UnsafeCell::new(Buf::new(max)?));
        }
        let direct = direct_handles(&items, buffered);
        let shared = Arc::new(Shared {
            items,
            direct,
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

    /// The bytes of item `item`, the next the forward pass needs, which the
    /// caller expects at file offset `offset`: waits for its read if it is
    /// not done yet. Give them back with [`Streamer::release`] before
    /// acquiring the next.
    ///
    /// # Errors
    ///
    /// A read error of this or an earlier item (naming the file, the tensor
    /// and the offset); an item that is not at `offset` (a streamer started
    /// before the model's plan changed).
    pub fn acquire(&self, item: usize, offset: u64) -> Result<ItemBytes> {
        let sh = &*self.shared;
        let n = sh.items.len() as u64;
        let k = sh.bufs.len() as u64;
        if sh.items.get(item).is_none_or(|i| i.offset != offset) {
            return Err(Error::InvalidArgument(format!(
                "streamed item {item} at offset {offset} is not in this session's read-ahead cycle: the model's \
                 memory plan changed after the session was opened (open a new session)"
            )));
        }
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
        let it = &sh.items[item];
        // SAFETY: the slot is `Ready(pos)`: the I/O thread no longer writes
        // it, and will not until `release` frees it.
        let buf: &Buf = unsafe { &*sh.bufs[slot].get() };
        let skip = if sh.direct[item].is_some() { it.offset as usize % ALIGN } else { 0 };
        let bytes = &buf.raw[buf.start + skip..buf.start + skip + it.len];
        Ok(ItemBytes { ptr: bytes.as_ptr(), len: it.len })
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
        let index = (pos % n) as usize;
        let item = &sh.items[index];
        // SAFETY: the slot is `Filling(pos)`: the compute thread does not
        // read it until it is `Ready`.
        let buf: &mut Buf = unsafe { &mut *sh.bufs[slot].get() };
        let r = match &sh.direct[index] {
            Some(f) => read_direct(f, item, buf),
            None => read_buffered(item, buf),
        };
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

/// Reads `item` into `buf` through the page cache, then drops its pages.
fn read_buffered(item: &Item, buf: &mut Buf) -> std::io::Result<()> {
    let r = item.file.read_exact_at(&mut buf.raw[buf.start..buf.start + item.len], item.offset);
    if r.is_ok() {
        drop_cached(&item.file, item.offset, item.len);
    }
    r
}

/// Reads `item`'s span widened to [`ALIGN`]ed ends into `buf` (its bytes
/// start `offset % ALIGN` into the buffer) from `direct`, the file opened
/// with `O_DIRECT`. The widened end may lie past the end of the file: the
/// read then comes back short, which is fine once the item's own bytes
/// are in.
fn read_direct(direct: &File, item: &Item, buf: &mut Buf) -> std::io::Result<()> {
    let from = item.offset - item.offset % ALIGN as u64;
    let need = (item.offset - from) as usize + item.len;
    let span = &mut buf.raw[buf.start..buf.start + need.div_ceil(ALIGN) * ALIGN];
    let mut done = 0;
    while done < need {
        match direct.read_at(&mut span[done..], from + done as u64) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            // A short read ends at the end of the file (a multiple of
            // ALIGN away from `from` or not): read on only from an
            // aligned point.
            Ok(k) if done + k < need && k % ALIGN != 0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => done += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Per item, its file reopened for direct reads, or `None` where that is
/// turned off (`buffered`, from [`STREAM_IO_ENV`]) or refused. The reopening goes through
/// `/proc/self/fd`, so it is the file the loader opened and checked, not
/// whatever its path names now. A file system that accepts the flag but
/// not a read (checked with one aligned read) falls back too.
fn direct_handles(items: &[Item], buffered: bool) -> Vec<Option<Arc<File>>> {
    let mut opened: Vec<(&Arc<File>, Option<Arc<File>>)> = Vec::new();
    items
        .iter()
        .map(|item| {
            if buffered {
                return None;
            }
            if let Some((_, d)) = opened.iter().find(|(f, _)| Arc::ptr_eq(f, &item.file)) {
                return d.clone();
            }
            let d = open_direct(&item.file).map(Arc::new);
            opened.push((&item.file, d.clone()));
            d
        })
        .collect()
}

/// `file` opened again with `O_DIRECT`, if the file system takes direct
/// reads of [`ALIGN`]ed spans.
fn open_direct(file: &File) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let f = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path) {
            Ok(f) => f,
            Err(e) => {
                tracing::info!("streamed weights are read through the page cache: O_DIRECT refused ({e})");
                return None;
            }
        };
        let mut probe = Buf::new(ALIGN).ok()?;
        match f.read_at(&mut probe.raw[probe.start..probe.start + ALIGN], 0) {
            Ok(_) => Some(f),
            Err(e) => {
                tracing::info!("streamed weights are read through the page cache: a direct read failed ({e})");
                None
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        None
    }
}

/// Locks the pages of `bytes` in memory (`mlock`), so neither swap nor
/// reclaim takes a resident weight. Returns whether the kernel allowed it
/// (`RLIMIT_MEMLOCK`, or `CAP_IPC_LOCK`); where it does not, the bytes stay
/// ordinary anonymous memory, which only swap can evict.
pub fn pin(bytes: &[u8]) -> bool {
    if bytes.is_empty() {
        return true;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `bytes` is a live allocation of this process; `mlock`
        // only changes whether its pages may be evicted, never their
        // contents.
        unsafe { libc::mlock(bytes.as_ptr().cast(), bytes.len()) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    false
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `s` reads direct.
    fn is_direct(s: &Streamer) -> bool {
        s.shared.direct.iter().all(Option::is_some)
    }

    /// Items at unaligned offsets, of unaligned lengths, one ending at the
    /// file's unaligned end, come back byte for byte by both kinds of read,
    /// in cycle order over several rounds and after a resynchronisation.
    #[test]
    fn direct_and_buffered_reads_give_the_file_bytes() {
        let path = std::env::temp_dir().join(format!("spinfer-stream-test-{}", std::process::id()));
        let data: Vec<u8> =
            (0..3 * ALIGN as u32 * 5 + 777).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = Arc::new(File::open(&path).unwrap());
        let spans =
            [(0, 100), (ALIGN as u64 - 3, 2 * ALIGN + 9), (5_000, 1), (8_192, ALIGN), (data.len() as u64 - 999, 999)];
        let items: Arc<[Item]> = spans
            .iter()
            .map(|&(offset, len)| Item { file: Arc::clone(&file), what: Arc::from("t"), offset, len })
            .collect();
        for buffered in [false, true] {
            let s = Streamer::start(Arc::clone(&items), 3, buffered).unwrap();
            if !buffered && !is_direct(&s) {
                eprintln!("skipped: the temporary directory's file system refuses O_DIRECT");
            }
            for i in (0..3 * spans.len()).map(|i| i % spans.len()).chain([3, 4, 0]) {
                let b = s.acquire(i, spans[i].0).unwrap();
                let (o, l) = spans[i];
                assert_eq!(b.bytes(), &data[o as usize..o as usize + l], "item {i}, buffered {buffered}");
                s.release(b);
            }
            assert_eq!(s.stats().resyncs, 1);
            // An item asked for at another offset is refused, not served.
            assert!(s.acquire(1, 0).is_err());
        }
        std::fs::remove_file(&path).unwrap();
    }

    /// A file cut short under the streamer is an error naming the tensor,
    /// not a panic or stale bytes.
    #[test]
    fn a_truncated_file_is_an_error() {
        let path = std::env::temp_dir().join(format!("spinfer-stream-trunc-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 4 * ALIGN]).unwrap();
        let file = Arc::new(File::open(&path).unwrap());
        let item =
            Item { file: Arc::clone(&file), what: Arc::from("blk.0.ffn_up.weight"), offset: 100, len: 2 * ALIGN };
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(ALIGN as u64).unwrap();
        for buffered in [false, true] {
            let s = Streamer::start(Arc::from(vec![item.clone()]), 2, buffered).unwrap();
            let e = s.acquire(0, 100).err().expect("a read past the end").to_string();
            assert!(e.contains("blk.0.ffn_up.weight") && e.contains("offset 100"), "{e}");
        }
        std::fs::remove_file(&path).unwrap();
    }
}
