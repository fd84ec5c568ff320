//! Device memory: buffers, slices of them, weight matrices, activations and
//! row indices.

use crate::{ActType, WeightFormat, imp};

/// Element types of device buffers.
pub trait Elem: imp::ElemBound + Copy + Default + 'static {}
impl Elem for u8 {}
impl Elem for i32 {}
impl Elem for f32 {}

/// A buffer on the device.
pub struct DeviceBuf<T: Elem> {
    pub(crate) inner: imp::Buf<T>,
    pub(crate) len: usize,
}

impl<T: Elem> DeviceBuf<T> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `offset .. offset + len`, or `None` past the end.
    pub fn at(&self, offset: usize, len: usize) -> Option<Slice<'_, T>> {
        (offset.checked_add(len)? <= self.len).then_some(Slice { buf: self, offset, len })
    }

    /// Elements `offset .. offset + len`, writable, or `None` past the end.
    pub fn at_mut(&mut self, offset: usize, len: usize) -> Option<SliceMut<'_, T>> {
        (offset.checked_add(len)? <= self.len).then_some(SliceMut { buf: self, offset, len })
    }

    /// The whole buffer.
    pub fn all(&self) -> Slice<'_, T> {
        Slice { buf: self, offset: 0, len: self.len }
    }

    /// The whole buffer, writable.
    pub fn all_mut(&mut self) -> SliceMut<'_, T> {
        let len = self.len;
        SliceMut { buf: self, offset: 0, len }
    }
}

/// Page-locked host memory that device data is copied into
/// ([`crate::CudaBackend::download_to_host`]): a per-token copy of logits
/// runs at full bus speed and allocates nothing.
pub struct HostBuf<T: Elem> {
    pub(crate) inner: imp::Pinned<T>,
    pub(crate) len: usize,
}

impl<T: Elem> HostBuf<T> {
    /// Elements it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A range of a device buffer (read).
#[derive(Clone, Copy)]
pub struct Slice<'a, T: Elem> {
    pub(crate) buf: &'a DeviceBuf<T>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// A range of a device buffer (written).
pub struct SliceMut<'a, T: Elem> {
    pub(crate) buf: &'a mut DeviceBuf<T>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl<T: Elem> Slice<'_, T> {
    /// Elements in the range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: Elem> SliceMut<'_, T> {
    /// Elements in the range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The same range, read-only (for a kernel that reads and writes it).
    pub fn reborrow(&mut self) -> SliceMut<'_, T> {
        SliceMut { buf: self.buf, offset: self.offset, len: self.len }
    }
}

/// A weight matrix uploaded once: `rows` rows of `cols` weights.
pub struct DeviceMatrix {
    pub(crate) buf: DeviceBuf<u8>,
    pub(crate) format: WeightFormat,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
}

impl DeviceMatrix {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The block format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.buf.len
    }
}

/// Activations on the device in f32, f16 or bf16: `tokens` vectors of
/// `len` elements.
pub struct DeviceActs {
    pub(crate) buf: DeviceBuf<u8>,
    pub(crate) act: ActType,
    pub(crate) tokens: usize,
    pub(crate) len: usize,
}

/// Row indices on the device, each checked below `bound` at upload (so a
/// kernel never reads outside a matrix of at least `bound` rows): the first
/// `len` of a buffer that holds up to its capacity.
pub struct DeviceRows {
    pub(crate) buf: DeviceBuf<i32>,
    pub(crate) bound: usize,
    pub(crate) len: usize,
}

impl DeviceRows {
    /// Number of indices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most indices it can hold ([`crate::CudaBackend::write_rows`]).
    pub fn capacity(&self) -> usize {
        self.buf.len
    }
}
