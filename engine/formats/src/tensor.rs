//! Weight tensors as the loaders hand them to the model: a type, a shape and
//! bytes that are borrowed from a memory map (zero-copy) or owned.

use std::fs::File;
use std::sync::Arc;

use memmap2::Mmap;
use spinfer_kernels::GgmlType;

/// Bytes of one tensor. Cloning is cheap (reference counted).
#[derive(Clone)]
pub struct TensorData(Repr);

#[derive(Clone)]
enum Repr {
    /// A window of a mapping of a whole file (offset `start` in the file
    /// too); `file` is the open file it maps, for positioned reads.
    Mapped {
        map: Arc<Mmap>,
        file: Option<Arc<File>>,
        start: usize,
        len: usize,
    },
    Owned(Arc<[u8]>),
}

impl TensorData {
    /// A window of a memory map; the caller has checked `start + len` lies
    /// inside it.
    pub fn mapped(map: Arc<Mmap>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= map.len());
        TensorData(Repr::Mapped { map, file: None, start, len })
    }

    /// A window of `map`, a mapping of all of `file` from offset 0: the
    /// bytes can also be read from `file` at `start` (streaming under a
    /// memory budget reads the same open file, never a path opened again).
    pub fn mapped_file(map: Arc<Mmap>, file: Arc<File>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= map.len());
        TensorData(Repr::Mapped { map, file: Some(file), start, len })
    }

    /// The open file and offset these bytes can be read from, when they are
    /// a window of a file mapping that knows its file.
    pub fn file_range(&self) -> Option<(&Arc<File>, u64)> {
        match &self.0 {
            Repr::Mapped { file: Some(f), start, .. } => Some((f, *start as u64)),
            _ => None,
        }
    }

    pub fn owned(bytes: Vec<u8>) -> Self {
        TensorData(Repr::Owned(bytes.into()))
    }

    /// Bytes already shared in memory.
    pub fn shared(bytes: Arc<[u8]>) -> Self {
        TensorData(Repr::Owned(bytes))
    }

    /// A copy of `self.bytes()[range]` in memory (one allocation). From a
    /// file mapping, the copy goes in pieces and each piece's pages are
    /// released once copied, so the copy never holds the mapped pages and
    /// the copied ones at the same time (what a memory budget counts).
    ///
    /// # Panics
    ///
    /// If `range` is not inside the bytes.
    pub fn copy_released(&self, range: std::ops::Range<usize>) -> Arc<[u8]> {
        let src = &self.bytes()[range];
        let mut dst = Arc::<[u8]>::new_uninit_slice(src.len());
        // A fresh Arc is unique; were it not, the plain copy below serves.
        let Some(slots) = Arc::get_mut(&mut dst) else { return Arc::from(src) };
        for (d, s) in slots.chunks_mut(1 << 20).zip(src.chunks(1 << 20)) {
            for (a, &b) in d.iter_mut().zip(s) {
                a.write(b);
            }
            if self.is_mapped() {
                // SAFETY: `s` lies inside a read-only file mapping.
                unsafe { release_pages(s) };
            }
        }
        // SAFETY: every byte was written above (the chunks cover `src`).
        unsafe { dst.assume_init() }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Mapped { map, start, len, .. } => &map[*start..*start + *len],
            Repr::Owned(b) => b,
        }
    }

    /// True if the bytes live in a file mapping rather than on the heap.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped { .. })
    }
}

impl std::fmt::Debug for TensorData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorData({} bytes, {})", self.bytes().len(), if self.is_mapped() { "mapped" } else { "owned" })
    }
}

/// A named tensor: GGML type, GGML-order dims (`dims[0]` contiguous), bytes.
#[derive(Clone, Debug)]
pub struct TensorView {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<usize>,
    pub data: TensorData,
}

impl TensorView {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// For a 2-D weight: (rows, cols) = (`dims[1]`, `dims[0]`).
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.dims.as_slice() {
            [c] => (1, *c),
            [c, r, ..] => (*r, *c),
            [] => (0, 0),
        }
    }

    /// `out_row` outputs per row of `dims[0]` elements, `f(state, row
    /// bytes, its outputs)` filling them, the rows split between the cores
    /// (each thread with its own `init()` state). Errors: the bytes do not
    /// hold whole rows of the type, or `f`'s first error.
    pub fn map_rows<T, S, E>(
        &self,
        out_row: usize,
        init: impl Fn() -> S + Sync,
        f: impl Fn(&mut S, &[u8], &mut [T]) -> std::result::Result<(), E> + Sync,
    ) -> std::result::Result<Vec<T>, String>
    where
        T: Copy + Default + Send,
        E: std::fmt::Display + Send,
    {
        let cols = self.dims.first().copied().unwrap_or(1);
        if self.n_elements() == 0 || out_row == 0 {
            return Ok(Vec::new());
        }
        let rows = self.n_elements() / cols;
        let row_bytes = self.ty.row_bytes(cols).map_err(|e| e.to_string())?;
        let bytes = self.data.bytes();
        if bytes.len() != rows * row_bytes {
            return Err(format!("{} bytes for {rows} rows of {row_bytes}", bytes.len()));
        }
        let mut out = vec![T::default(); rows * out_row];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows.div_ceil(64)).max(1);
        let per = rows.div_ceil(threads);
        let (init, f) = (&init, &f);
        std::thread::scope(|s| {
            let jobs: Vec<_> = out
                .chunks_mut(per * out_row)
                .zip(bytes.chunks(per * row_bytes))
                .map(|(dst, src)| {
                    s.spawn(move || {
                        let mut state = init();
                        dst.chunks_mut(out_row).zip(src.chunks(row_bytes)).try_for_each(|(d, r)| f(&mut state, r, d))
                    })
                })
                .collect();
            jobs.into_iter().try_for_each(|j| j.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })
        .map_err(|e| e.to_string())?;
        Ok(out)
    }
}

/// Drops this process's pages of `bytes`: they leave the resident set and
/// are re-read from the file if touched again.
///
/// # Safety
/// `bytes` must lie inside a read-only file mapping (a [`TensorData`]
/// borrowed from a memory map, or such a map itself). On anonymous memory
/// `MADV_DONTNEED` would zero the pages under a live shared borrow.
pub unsafe fn release_pages(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        unsafe extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
            fn sysconf(name: i32) -> std::ffi::c_long;
        }
        const MADV_DONTNEED: i32 = 4;
        const SC_PAGESIZE: i32 = 30;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { sysconf(SC_PAGESIZE) }.max(4096) as usize;
        let start = (bytes.as_ptr() as usize).next_multiple_of(page);
        let end = (bytes.as_ptr() as usize + bytes.len()) / page * page;
        if end > start {
            // SAFETY: [start, end) lies inside `bytes`, a read-only file
            // mapping that nothing writes: MADV_DONTNEED only drops the
            // process's page table entries; the contents stay those of the
            // file, re-read on the next access.
            unsafe { madvise(start as *mut std::ffi::c_void, end - start, MADV_DONTNEED) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}
