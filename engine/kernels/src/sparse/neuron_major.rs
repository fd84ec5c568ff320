//! [`NeuronMajor`]: an exact neuron-major form of a legacy-quantised
//! `W_down` (Q4_0, Q4_1, Q8_0) for the sparse down projection.
//!
//! Every weight of such a matrix is `W[i, j] = d[i, B] * q[i, j] + m[i, B]`
//! with `B = j / 32` the block of 32 columns (neurons) holding `j`. Keeping
//! the integer codes `q` neuron-major (one `i8` per weight) and the block
//! scales `d` / minimums `m` as f32 laid out `[B][i]`, an AXPY over the
//! active neurons needs no requantisation at all:
//!
//! ```text
//! out[i] = Σ_B ( d[i, B] · S_B[i] + m[i, B] · H_B )
//! S_B[i] = Σ_{j ∈ B active} coef_j · q[i, j]      H_B = Σ_{j ∈ B active} coef_j
//! ```
//!
//! which is `Σ_k coef[k] · W[i, idx[k]]` up to f32 rounding, with `W` exactly
//! as `dequantize_row` produces it.

use half::f16;

use super::{AXPY_PAR_MACS, AxpyIsa, SharedMut, shape_err};
use crate::blocks::QK;
use crate::cpu::CpuFeatures;
use crate::pool::{ThreadPool, chunk_aligned};
use crate::{GgmlType, KernelError, Result};

/// Outputs per zmm register; the code rows are padded to a multiple of it
/// and the threads' output slices start on a multiple of it.
const LANES: usize = 16;

/// Outputs per tile of the scalar implementation.
const SCALAR_TILE: usize = 64;

/// An exact neuron-major copy of a Q4_0 / Q4_1 / Q8_0 matrix `W` (`outputs`
/// rows × `neurons` columns, e.g. `W_down`, `dim × ffn`), for
/// [`NeuronMajor::axpy`] over selected columns (neurons).
///
/// Layout: `codes` holds, for neuron `j`, the `outputs` integer codes
/// `q[0..outputs, j]` as `i8` (`stride` bytes per neuron, `stride` =
/// `outputs` rounded up to 16, zero padded); `d` (and `m` for Q4_1) hold,
/// for neuron block `B` and output `i`, the block's f16 scale (minimum)
/// converted to f32 at `B * stride + i`.
#[derive(Clone, Debug)]
pub struct NeuronMajor {
    wtype: GgmlType,
    outputs: usize,
    neurons: usize,
    stride: usize,
    has_min: bool,
    codes: Vec<i8>,
    d: Vec<f32>,
    /// Empty unless `has_min`.
    m: Vec<f32>,
}

impl NeuronMajor {
    /// From `W` (`rows × cols`, row-major GGUF bytes) of type Q4_0, Q4_1 or
    /// Q8_0: `rows` outputs, `cols` neurons.
    ///
    /// Errors: [`KernelError::Unsupported`] for other types,
    /// [`KernelError::RowNotBlockAligned`] when `cols % 32 != 0`,
    /// [`KernelError::BufferSize`] when `w` is not `rows` rows of `cols`
    /// elements, [`KernelError::Shape`] when the sizes overflow.
    pub fn from_weights(wtype: GgmlType, w: &[u8], rows: usize, cols: usize) -> Result<Self> {
        const OP: &str = "NeuronMajor::from_weights";
        let has_min = match wtype {
            GgmlType::Q4_0 | GgmlType::Q8_0 => false,
            GgmlType::Q4_1 => true,
            _ => return Err(KernelError::Unsupported { ty: wtype, what: "NeuronMajor (Q4_0, Q4_1, Q8_0 only)" }),
        };
        let rb = wtype.row_bytes(cols)?;
        let overflow = || shape_err(OP, format!("{rows} x {cols} overflows"));
        let want = rows.checked_mul(rb).ok_or_else(overflow)?;
        if w.len() != want {
            return Err(KernelError::BufferSize { ty: wtype, n: rows.saturating_mul(cols), want, got: w.len() });
        }
        let stride = rows.checked_next_multiple_of(LANES).ok_or_else(overflow)?;
        let n_codes = cols.checked_mul(stride).ok_or_else(overflow)?;
        let nb = cols / QK;
        let mut codes = vec![0i8; n_codes];
        let mut d = vec![0f32; nb * stride];
        let mut m = if has_min { vec![0f32; nb * stride] } else { Vec::new() };
        let bs = wtype.type_size();
        let f16_at = |b: &[u8], o: usize| f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
        let mut q = [0i8; QK];
        for i in 0..rows {
            for (b, blk) in w[i * rb..(i + 1) * rb].chunks_exact(bs).enumerate() {
                d[b * stride + i] = f16_at(blk, 0);
                match wtype {
                    GgmlType::Q4_0 => unpack_nibbles(&blk[2..18], -8, &mut q),
                    GgmlType::Q4_1 => {
                        m[b * stride + i] = f16_at(blk, 2);
                        unpack_nibbles(&blk[4..20], 0, &mut q);
                    }
                    _ => {
                        for (q, &v) in q.iter_mut().zip(&blk[2..34]) {
                            *q = v as i8;
                        }
                    }
                }
                for (e, &v) in q.iter().enumerate() {
                    codes[(b * QK + e) * stride + i] = v;
                }
            }
        }
        Ok(Self { wtype, outputs: rows, neurons: cols, stride, has_min, codes, d, m })
    }

    /// Number of neurons: the columns of `W`.
    pub fn neurons(&self) -> usize {
        self.neurons
    }

    /// Number of outputs: the rows of `W`.
    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// Resident bytes (codes, scales and minimums).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * (self.d.len() + self.m.len()) + std::mem::size_of::<Self>()
    }

    /// The type of the source matrix.
    pub fn wtype(&self) -> GgmlType {
        self.wtype
    }

    /// Whether the type has a per-block minimum (Q4_1).
    pub fn has_min(&self) -> bool {
        self.has_min
    }

    /// The integer code `q[output, neuron]` (Q4_0: nibble − 8, Q4_1: nibble,
    /// Q8_0: the int8).
    ///
    /// # Panics
    /// When `output` or `neuron` is out of range.
    pub fn code(&self, output: usize, neuron: usize) -> i8 {
        assert!(output < self.outputs && neuron < self.neurons, "({output}, {neuron}) out of range");
        self.codes[neuron * self.stride + output]
    }

    /// `(d, m)` of output `output` in neuron block `block` (neurons
    /// `32 block .. 32 block + 32`). For types without a minimum `m` is
    /// `-0.0`, so `d * q + m` is `d * q` bit for bit (also for `-0.0`).
    ///
    /// # Panics
    /// When `output` or `block` is out of range.
    pub fn block_scale(&self, output: usize, block: usize) -> (f32, f32) {
        assert!(output < self.outputs && block < self.neurons / QK, "({output}, {block}) out of range");
        let at = block * self.stride + output;
        (self.d[at], if self.has_min { self.m[at] } else { -0.0 })
    }

    /// `W[output, neuron]` as `d * q + m` in f32: bit for bit the value
    /// `dequantize_row` gives.
    ///
    /// # Panics
    /// When `output` or `neuron` is out of range.
    pub fn weight(&self, output: usize, neuron: usize) -> f32 {
        let q = f32::from(self.code(output, neuron));
        let (d, m) = self.block_scale(output, neuron / QK);
        d * q + m
    }

    /// `out[i] = Σ_k coef[k] · W[i, idx[k]]` for `i in 0..outputs`,
    /// overwriting `out`. `idx` must be strictly ascending (sorted,
    /// distinct). The outputs are split over the pool's threads in slices of
    /// 16 (single-threaded when the work is small); the implementation is the
    /// best of [`AxpyIsa`] for the running CPU.
    ///
    /// Errors ([`KernelError::Shape`]): `coef.len() != idx.len()`,
    /// `out.len() != outputs`, `idx` not strictly ascending, an index
    /// `>= neurons`. `out` is untouched on error.
    pub fn axpy(&self, pool: &ThreadPool, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        self.axpy_with(pool, AxpyIsa::select(&CpuFeatures::detect()), idx, coef, out)
    }

    /// [`NeuronMajor::axpy`] with an explicit implementation; `isa` is
    /// lowered to what the running CPU supports, so any value is safe.
    pub fn axpy_with(&self, pool: &ThreadPool, isa: AxpyIsa, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        self.check(idx, coef, out)?;
        let cpu = CpuFeatures::detect();
        let isa = match isa {
            AxpyIsa::Avx512 => AxpyIsa::select(&cpu),
            AxpyIsa::Avx2 if cpu.has_avx2() => AxpyIsa::Avx2,
            _ => AxpyIsa::Scalar,
        };
        let n = self.outputs;
        let nt = pool.n_threads();
        if nt == 1 || idx.len() * n < AXPY_PAR_MACS || n <= LANES {
            self.run(isa, 0, idx, coef, out);
            return Ok(());
        }
        let base = SharedMut(out.as_mut_ptr());
        pool.broadcast(&|ti, nt| {
            let r = chunk_aligned(n, ti, nt, LANES);
            if r.is_empty() {
                return;
            }
            // SAFETY: `r` lies inside `0..outputs` = `0..out.len()` and
            // `chunk_aligned` hands every thread a disjoint range.
            let o = unsafe { std::slice::from_raw_parts_mut(base.ptr().add(r.start), r.len()) };
            self.run(isa, r.start, idx, coef, o);
        });
        Ok(())
    }

    /// Scalar reference of [`NeuronMajor::axpy`] (single-threaded): per
    /// output, per neuron block in order, `S = Σ coef·q`, `H = Σ coef` (k in
    /// order, unfused f32), then `acc += d·S + m·H` (`acc += d·S` without a
    /// minimum). Same errors as [`NeuronMajor::axpy`].
    pub fn axpy_scalar(&self, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        self.check(idx, coef, out)?;
        self.run(AxpyIsa::Scalar, 0, idx, coef, out);
        Ok(())
    }

    fn check(&self, idx: &[u32], coef: &[f32], out: &[f32]) -> Result<()> {
        const OP: &str = "NeuronMajor::axpy";
        if coef.len() != idx.len() {
            return Err(shape_err(OP, format!("{} coefficients for {} indices", coef.len(), idx.len())));
        }
        if out.len() != self.outputs {
            return Err(shape_err(OP, format!("output of {} floats for {} outputs", out.len(), self.outputs)));
        }
        if let Some(k) = idx.windows(2).position(|w| w[0] >= w[1]) {
            let (a, b) = (idx[k], idx[k + 1]);
            return Err(shape_err(OP, format!("indices not strictly ascending: {a} then {b} at position {}", k + 1)));
        }
        if let Some(&last) = idx.last()
            && last as usize >= self.neurons
        {
            return Err(shape_err(OP, format!("index {last} is out of range for {} neurons", self.neurons)));
        }
        Ok(())
    }

    /// Outputs `o0 .. o0 + out.len()` (`o0` a multiple of 16) into `out`;
    /// arguments validated by the caller.
    fn run(&self, isa: AxpyIsa, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        debug_assert!(o0.is_multiple_of(LANES) && o0 + out.len() <= self.outputs);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `AxpyIsa::Avx512` only comes from `select` on a CPU
            // with AVX-512F, AVX2 and FMA; the caller validated `idx`
            // (every index < neurons), `coef` and the output slice.
            AxpyIsa::Avx512 => unsafe { x86::axpy_avx512(self, o0, idx, coef, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2 and FMA detected.
            AxpyIsa::Avx2 => unsafe { x86::axpy_avx2(self, o0, idx, coef, out) },
            _ => self.run_scalar(o0, idx, coef, out),
        }
    }

    fn run_scalar(&self, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        let stride = self.stride;
        for (t, out) in out.chunks_mut(SCALAR_TILE).enumerate() {
            let off = o0 + t * SCALAR_TILE;
            let w = out.len();
            let mut acc = [0f32; SCALAR_TILE];
            let mut s = [0f32; SCALAR_TILE];
            let mut k = 0;
            while k < idx.len() {
                let b = idx[k] as usize / QK;
                s.fill(0.0);
                let mut h = 0.0f32;
                while k < idx.len() && idx[k] as usize / QK == b {
                    let c = coef[k];
                    h += c;
                    let row = &self.codes[idx[k] as usize * stride + off..][..w];
                    for (s, &q) in s.iter_mut().zip(row) {
                        *s += c * f32::from(q);
                    }
                    k += 1;
                }
                let d = &self.d[b * stride + off..][..w];
                if self.has_min {
                    let m = &self.m[b * stride + off..][..w];
                    for (((a, &s), &d), &m) in acc.iter_mut().zip(&s).zip(d).zip(m) {
                        *a += d * s + m * h;
                    }
                } else {
                    for ((a, &s), &d) in acc.iter_mut().zip(&s).zip(d) {
                        *a += d * s;
                    }
                }
            }
            out.copy_from_slice(&acc[..w]);
        }
    }
}

/// Low nibbles of `qs` are elements 0..16, high nibbles 16..32 (ggml order),
/// each plus `bias`.
fn unpack_nibbles(qs: &[u8], bias: i8, q: &mut [i8; QK]) {
    let (lo, hi) = q.split_at_mut(QK / 2);
    for ((&v, l), h) in qs.iter().zip(lo).zip(hi) {
        *l = (v & 0x0F) as i8 + bias;
        *h = (v >> 4) as i8 + bias;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::x86::{PREFETCH, prefetch_tile};
    use super::{NeuronMajor, QK};
    use crate::pool::chunk;

    /// Raw view of a [`NeuronMajor`] for one tile.
    struct Tile<'a> {
        codes: *const i8,
        d: *const f32,
        /// Null without a minimum.
        m: *const f32,
        stride: usize,
        /// First output of the tile.
        off: usize,
        idx: &'a [u32],
        coef: &'a [f32],
    }

    impl<'a> Tile<'a> {
        fn new(nm: &NeuronMajor, off: usize, idx: &'a [u32], coef: &'a [f32]) -> Self {
            let m = if nm.has_min { nm.m.as_ptr() } else { std::ptr::null() };
            Tile { codes: nm.codes.as_ptr(), d: nm.d.as_ptr(), m, stride: nm.stride, off, idx, coef }
        }

        /// End (exclusive) of the run of indices from `k` in the neuron
        /// block of `idx[k]`, and that block.
        #[inline(always)]
        fn block_run(&self, k: usize) -> (usize, usize) {
            let b = self.idx[k] as usize / QK;
            let mut e = k + 1;
            while e < self.idx.len() && self.idx[e] as usize / QK == b {
                e += 1;
            }
            (e, b)
        }
    }

    /// Accumulates `T` zmm vectors of outputs (`16 T` from `t.off`) over all
    /// neurons and writes the first `valid` of them to `out`.
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA; every `idx[k] < neurons`, `idx.len() ==
    /// coef.len()`, `t.off + 16 T <= stride`, the block of every index
    /// within `d` / `m`, and `out` valid for `valid <= 16 T` floats.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn tile512<const T: usize>(t: &Tile<'_>, out: *mut f32, valid: usize) {
        let mut acc = [_mm512_setzero_ps(); T];
        let base = t.codes.cast::<u8>();
        let mut k = 0;
        while k < t.idx.len() {
            let (end, b) = t.block_run(k);
            let mut s = [_mm512_setzero_ps(); T];
            let mut h = 0.0f32;
            while k < end {
                prefetch_tile(base, t.stride, t.off, 16 * T, t.idx, k + PREFETCH);
                let c = t.coef[k];
                h += c;
                let cv = _mm512_set1_ps(c);
                // SAFETY: `idx[k] < neurons`, so the `16 T` codes at
                // `idx[k] * stride + off` (`off + 16 T <= stride`) are inside
                // `codes` (`neurons * stride` bytes).
                let row = unsafe { t.codes.add(t.idx[k] as usize * t.stride + t.off) };
                for (v, s) in s.iter_mut().enumerate() {
                    // SAFETY: bytes `16 v .. 16 v + 16` of the tile's row (above).
                    let q = unsafe { _mm_loadu_si128(row.add(16 * v).cast()) };
                    *s = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), *s);
                }
                k += 1;
            }
            // SAFETY: block `b < neurons / 32`, so `16 T` floats at
            // `b * stride + off` lie inside `d` (and `m`, when not null).
            unsafe {
                let dp = t.d.add(b * t.stride + t.off);
                for (v, (a, s)) in acc.iter_mut().zip(&s).enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(dp.add(16 * v)), *s, *a);
                }
                if !t.m.is_null() {
                    let mp = t.m.add(b * t.stride + t.off);
                    let hv = _mm512_set1_ps(h);
                    for (v, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(_mm512_loadu_ps(mp.add(16 * v)), hv, *a);
                    }
                }
            }
        }
        if valid == 16 * T {
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `out` holds `valid = 16 T` floats.
                unsafe { _mm512_storeu_ps(out.add(16 * v), *a) };
            }
        } else {
            let mut buf = [0f32; 16 * 12];
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `T <= 12`, so `16 v + 16 <= 192`.
                unsafe { _mm512_storeu_ps(buf.as_mut_ptr().add(16 * v), *a) };
            }
            // SAFETY: `out` holds `valid <= 16 T <= 192` floats.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), out, valid) };
        }
    }

    /// AVX-512 implementation for outputs `o0 .. o0 + out.len()`, in tiles
    /// of up to 12 zmm vectors (12 accumulators + 12 block sums).
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA; `o0` a multiple of 16, `o0 + out.len() <=
    /// outputs`, every `idx[k] < neurons`, `coef.len() == idx.len()`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn axpy_avx512(nm: &NeuronMajor, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        let nv = out.len().div_ceil(16);
        let tiles = nv.div_ceil(12);
        for ti in 0..tiles {
            let r = chunk(nv, ti, tiles);
            let first = 16 * r.start;
            let valid = (out.len() - first).min(16 * r.len());
            // `o0 + first + 16 r.len() <= stride`: `o0` and `first` are
            // multiples of 16 and the slice ends inside the padded row.
            let t = Tile::new(nm, o0 + first, idx, coef);
            // SAFETY: `first + valid <= out.len()`; the tile's codes and
            // scales are in range as argued above and by the caller.
            unsafe {
                let o = out.as_mut_ptr().add(first);
                match r.len() {
                    12 => tile512::<12>(&t, o, valid),
                    11 => tile512::<11>(&t, o, valid),
                    10 => tile512::<10>(&t, o, valid),
                    9 => tile512::<9>(&t, o, valid),
                    8 => tile512::<8>(&t, o, valid),
                    7 => tile512::<7>(&t, o, valid),
                    6 => tile512::<6>(&t, o, valid),
                    5 => tile512::<5>(&t, o, valid),
                    4 => tile512::<4>(&t, o, valid),
                    3 => tile512::<3>(&t, o, valid),
                    2 => tile512::<2>(&t, o, valid),
                    _ => tile512::<1>(&t, o, valid),
                }
            }
        }
    }

    /// As [`tile512`] with `T` ymm vectors (`8 T` outputs).
    ///
    /// # Safety
    /// AVX2, FMA; as [`tile512`] with `t.off + 8 T <= stride`, `valid <= 8 T`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile256<const T: usize>(t: &Tile<'_>, out: *mut f32, valid: usize) {
        let mut acc = [_mm256_setzero_ps(); T];
        let base = t.codes.cast::<u8>();
        let mut k = 0;
        while k < t.idx.len() {
            let (end, b) = t.block_run(k);
            let mut s = [_mm256_setzero_ps(); T];
            let mut h = 0.0f32;
            while k < end {
                prefetch_tile(base, t.stride, t.off, 8 * T, t.idx, k + PREFETCH);
                let c = t.coef[k];
                h += c;
                let cv = _mm256_set1_ps(c);
                // SAFETY: `idx[k] < neurons` and `off + 8 T <= stride`, so
                // the tile's codes of neuron `idx[k]` are inside `codes`.
                let row = unsafe { t.codes.add(t.idx[k] as usize * t.stride + t.off) };
                for (v, s) in s.iter_mut().enumerate() {
                    // SAFETY: bytes `8 v .. 8 v + 8` of the tile's row (above).
                    let q = unsafe { _mm_loadl_epi64(row.add(8 * v).cast()) };
                    *s = _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), *s);
                }
                k += 1;
            }
            // SAFETY: block `b < neurons / 32`, so `8 T` floats at
            // `b * stride + off` lie inside `d` (and `m`, when not null).
            unsafe {
                let dp = t.d.add(b * t.stride + t.off);
                for (v, (a, s)) in acc.iter_mut().zip(&s).enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(dp.add(8 * v)), *s, *a);
                }
                if !t.m.is_null() {
                    let mp = t.m.add(b * t.stride + t.off);
                    let hv = _mm256_set1_ps(h);
                    for (v, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(mp.add(8 * v)), hv, *a);
                    }
                }
            }
        }
        if valid == 8 * T {
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `out` holds `valid = 8 T` floats.
                unsafe { _mm256_storeu_ps(out.add(8 * v), *a) };
            }
        } else {
            let mut buf = [0f32; 8 * 6];
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `T <= 6`, so `8 v + 8 <= 48`.
                unsafe { _mm256_storeu_ps(buf.as_mut_ptr().add(8 * v), *a) };
            }
            // SAFETY: `out` holds `valid <= 8 T <= 48` floats.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), out, valid) };
        }
    }

    /// AVX2 implementation, in tiles of up to 6 ymm vectors (6 accumulators
    /// + 6 block sums).
    ///
    /// # Safety
    /// AVX2, FMA; as [`axpy_avx512`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(nm: &NeuronMajor, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        let nv = out.len().div_ceil(8);
        let tiles = nv.div_ceil(6);
        for ti in 0..tiles {
            let r = chunk(nv, ti, tiles);
            let first = 8 * r.start;
            let valid = (out.len() - first).min(8 * r.len());
            // `o0 + first + 8 r.len() <= stride`: `o0` is a multiple of 16,
            // `first` of 8, and the slice ends inside the padded row
            // (`stride` is a multiple of 16).
            let t = Tile::new(nm, o0 + first, idx, coef);
            // SAFETY: `first + valid <= out.len()`; the tile's codes and
            // scales are in range as argued above and by the caller.
            unsafe {
                let o = out.as_mut_ptr().add(first);
                match r.len() {
                    6 => tile256::<6>(&t, o, valid),
                    5 => tile256::<5>(&t, o, valid),
                    4 => tile256::<4>(&t, o, valid),
                    3 => tile256::<3>(&t, o, valid),
                    2 => tile256::<2>(&t, o, valid),
                    _ => tile256::<1>(&t, o, valid),
                }
            }
        }
    }
}
