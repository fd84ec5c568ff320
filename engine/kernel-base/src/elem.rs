//! The element types of the rows attention reads from a KV cache: `f32`,
//! or IEEE `f16` for half the bytes (llama.cpp's default cache type). An
//! f16 value widens to f32 exactly, so a product over f16 rows is the f32
//! product over the widened rows, bit for bit: only storing rounds.

use half::f16;

/// An element of cached key and value rows: `f32` or [`half::f16`]. Sealed;
/// the all-zero bit pattern of both is `0.0`.
pub trait KvElem: Copy + Send + Sync + sealed::Sealed + 'static {
    /// Bytes per element.
    const BYTES: usize;

    /// The value as f32 (exact).
    fn to_f32(self) -> f32;

    /// `x` rounded to the nearest element, ties to even; values beyond
    /// f16's range saturate to its largest finite value (an infinite key
    /// would turn every score of its row into NaN).
    fn from_f32(x: f32) -> Self;

    /// The elements themselves when they are already f32.
    fn as_f32(rows: &[Self]) -> Option<&[f32]>;

    /// Eight elements from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `p` must point at 8
    /// readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

impl KvElem for f32 {
    const BYTES: usize = 4;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }

    fn as_f32(rows: &[Self]) -> Option<&[f32]> {
        Some(rows)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: 8 readable floats at `p` (the contract).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    const BYTES: usize = 2;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x.clamp(f16::MIN.to_f32(), f16::MAX.to_f32()))
    }

    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: 8 readable halves (16 bytes) at `p` (the contract);
        // `f16` is `repr(transparent)` over the IEEE bits `vcvtph2ps` reads.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// Appends `rows` rows of `width` elements, `stride` apart in `m`, to
/// `out` as f32, back to back.
///
/// # Panics
/// If `m` is shorter than the last row's end.
pub fn widen_rows<E: KvElem>(m: &[E], rows: usize, stride: usize, width: usize, out: &mut Vec<f32>) {
    let at = out.len();
    out.resize(at + rows * width, 0.0);
    for (j, o) in out[at..].chunks_exact_mut(width.max(1)).take(rows).enumerate() {
        widen(&m[j * stride..j * stride + width], o);
    }
}

/// `out[i] = src[i]` as f32 (F16C eight at a time where the CPU has it:
/// a prompt's attention widens every key and value it multiplies).
fn widen<E: KvElem>(src: &[E], out: &mut [f32]) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::CpuFeatures::detect().has_avx2() {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn eights<E: KvElem>(src: &[E], out: &mut [f32]) -> usize {
            let n = src.len().min(out.len()) / 8 * 8;
            for i in (0..n).step_by(8) {
                // SAFETY: `i + 8 <= n` elements of both slices; AVX2, FMA
                // and F16C (the caller).
                unsafe { std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr().add(i), E::load8(src.as_ptr().add(i))) };
            }
            n
        }
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        i = unsafe { eights(src, out) };
    }
    for (o, x) in out[i..].iter_mut().zip(&src[i..]) {
        *o = x.to_f32();
    }
}

/// `src` rounded into `dst` ([`KvElem::from_f32`] per element).
pub fn store_row<E: KvElem>(dst: &mut [E], src: &[f32]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = E::from_f32(s);
    }
}

/// `madvise(DONTNEED)` on the whole pages inside `v`: their memory is
/// released and they read as zeros afterwards (`0.0` for every
/// [`KvElem`]); advice only, so a failure leaves the memory held and
/// changes nothing else.
pub fn release_pages<E: KvElem>(v: &mut [E]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        const MADV_DONTNEED: i32 = 4;
        unsafe extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        let start = v.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(v);
        let (from, to) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
        if to > from {
            // SAFETY: [from, to) lies inside `v`'s allocation, which the
            // `&mut` borrow keeps from every other reader during the call.
            // Heap memory is private and anonymous: after DONTNEED its
            // pages stay mapped and read as zeros, a valid element (0.0 as
            // f32 or f16), so the slice stays valid and initialised.
            unsafe { madvise(from as *mut std::ffi::c_void, to - from, MADV_DONTNEED) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounds_to_nearest_and_saturates() {
        assert_eq!(<f16 as KvElem>::from_f32(1.0).to_f32(), 1.0);
        assert_eq!(<f16 as KvElem>::from_f32(1e6).to_f32(), 65504.0);
        assert_eq!(<f16 as KvElem>::from_f32(-1e30).to_f32(), -65504.0);
        assert!(<f16 as KvElem>::from_f32(f32::NAN).to_f32().is_nan());
        // 1 + 2^-11 is halfway between 1 and the next f16: ties to even.
        assert_eq!(<f16 as KvElem>::from_f32(1.0 + 1.0 / 2048.0).to_f32(), 1.0);
        let x = 0.123_456_79f32;
        assert!((<f16 as KvElem>::from_f32(x).to_f32() - x).abs() <= x * 2f32.powi(-11));
    }

    #[test]
    fn widen_rows_appends_every_row_exactly() {
        // Whole vectors and a tail, after what the buffer held.
        let m: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) / 7.0).collect();
        let h: Vec<f16> = m.iter().map(|&x| f16::from_f32(x)).collect();
        let mut buf = vec![7.0];
        widen_rows(&h, 3, 30, 21, &mut buf);
        assert_eq!((buf.len(), buf[0]), (1 + 3 * 21, 7.0));
        for j in 0..3 {
            for i in 0..21 {
                assert_eq!(buf[1 + j * 21 + i].to_bits(), h[j * 30 + i].to_f32().to_bits(), "row {j} col {i}");
            }
        }
        assert!(<f32 as KvElem>::as_f32(&m).is_some() && <f16 as KvElem>::as_f32(&h).is_none());
    }
}
