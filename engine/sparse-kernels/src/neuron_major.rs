//! [`NeuronMajor`]: an exact neuron-major form of a legacy-quantised
//! `W_down` (Q4_0, Q4_1, Q8_0) for the sparse down projection.
//!
//! Every weight of such a matrix is `W[i, j] = d[i, B] * q[i, j] + m[i, B]`
//! with `B = j / 32` the block of 32 columns (neurons) holding `j`. Keeping
//! the integer codes `q` neuron-major and the block scales `d` / minimums
//! `m` laid out `[B][i]`, an AXPY over the active neurons needs no
//! requantisation at all:
//!
//! ```text
//! out[i] = Σ_B ( d[i, B] · S_B[i] + m[i, B] · H_B )
//! S_B[i] = Σ_{j ∈ B active} coef_j · q[i, j]      H_B = Σ_{j ∈ B active} coef_j
//! ```
//!
//! which is `Σ_k coef[k] · W[i, idx[k]]` up to f32 rounding, with `W` exactly
//! as `dequantize_row` produces it.
//!
//! The copy holds exactly as many bytes as the GGUF matrix: 4-bit codes stay
//! 4-bit (two per byte), 8-bit codes one per byte, and the scales and
//! minimums stay f16. A sparse down projection therefore reads
//! `(1 - sparsity)` of the codes plus the scales of every block with an
//! active neuron, never more than the dense matvec.
//!
//! [`NeuronMajor::axpy_fast`] (in `neuron_major_fast.rs`) is the int8
//! variant: the coefficients quantised to 8 bits per run of active neurons
//! in one block, integer block sums with AVX-512 VNNI (`vpdpbusd`).

use half::f16;

use super::{AXPY_PAR_MACS, AxpyIsa, SyncPtr, shape_err};
use spinfer_kernels::blocks::QK;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::pool::{ThreadPool, chunk_aligned};
use spinfer_kernels::{GgmlType, KernelError, Result};

/// The int8 AXPY ([`NeuronMajor::axpy_fast`]).
#[path = "neuron_major_fast/mod.rs"]
mod fast;
pub use fast::{QuantisedCoefs, QuantisedRun};

/// Outputs per code group: 16 bytes of nibbles (low nibbles are outputs
/// `0..16`, high nibbles `16..32`) or 32 int8. Rows of codes and scales are
/// padded to a multiple of it, and the threads' output slices start on one.
const GROUP: usize = 32;

/// Outputs per tile of the scalar implementation.
const SCALAR_TILE: usize = 64;

/// An exact neuron-major copy of a Q4_0 / Q4_1 / Q8_0 matrix `W` (`outputs`
/// rows × `neurons` columns, e.g. `W_down`, `dim × ffn`), for
/// [`NeuronMajor::axpy`] over selected columns (neurons).
///
/// Layout, with `opad` = `outputs` rounded up to 32 (zero padded): `codes`
/// holds, for neuron `j`, the codes `q[0..opad, j]` (`stride` bytes per
/// neuron): for Q4_0 / Q4_1 the raw nibbles, output `32 g + e` in the low
/// nibble and `32 g + 16 + e` in the high nibble of byte `16 g + e`
/// (`stride = opad / 2`); for Q8_0 one `i8` per output (`stride = opad`).
/// `d` (and `m` for Q4_1) hold, for neuron block `B` and output `i`, the
/// block's f16 scale (minimum) at `B * opad + i`.
#[derive(Clone, Debug)]
pub struct NeuronMajor {
    wtype: GgmlType,
    outputs: usize,
    neurons: usize,
    /// `outputs` rounded up to [`GROUP`].
    opad: usize,
    /// Code bytes per neuron.
    stride: usize,
    has_min: bool,
    codes: Vec<u8>,
    d: Vec<f16>,
    /// Empty unless `has_min`.
    m: Vec<f16>,
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
        let opad = rows.checked_next_multiple_of(GROUP).ok_or_else(overflow)?;
        let nibbles = wtype != GgmlType::Q8_0;
        let stride = if nibbles { opad / 2 } else { opad };
        let n_codes = cols.checked_mul(stride).ok_or_else(overflow)?;
        let nb = cols / QK;
        let mut codes = vec![0u8; n_codes];
        let mut d = vec![f16::ZERO; nb * opad];
        let mut m = if has_min { vec![f16::ZERO; nb * opad] } else { Vec::new() };
        let bs = wtype.type_size();
        let f16_at = |b: &[u8], o: usize| f16::from_le_bytes([b[o], b[o + 1]]);
        let mut q = [0u8; QK];
        for i in 0..rows {
            // Where output `i`'s code lives in a neuron's row, and how.
            let (byte, shift) = if nibbles { ((i / GROUP) * 16 + i % 16, 4 * ((i % GROUP) / 16)) } else { (i, 0) };
            for (b, blk) in w[i * rb..(i + 1) * rb].chunks_exact(bs).enumerate() {
                d[b * opad + i] = f16_at(blk, 0);
                match wtype {
                    GgmlType::Q4_0 => unpack_nibbles(&blk[2..18], &mut q),
                    GgmlType::Q4_1 => {
                        m[b * opad + i] = f16_at(blk, 2);
                        unpack_nibbles(&blk[4..20], &mut q);
                    }
                    _ => q.copy_from_slice(&blk[2..34]),
                }
                for (e, &v) in q.iter().enumerate() {
                    codes[(b * QK + e) * stride + byte] |= v << shift;
                }
            }
        }
        Ok(Self { wtype, outputs: rows, neurons: cols, opad, stride, has_min, codes, d, m })
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
        self.codes.len() + 2 * (self.d.len() + self.m.len()) + std::mem::size_of::<Self>()
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
        let row = &self.codes[neuron * self.stride..][..self.stride];
        match self.wtype {
            GgmlType::Q8_0 => row[output] as i8,
            ty => {
                let byte = row[(output / GROUP) * 16 + output % 16];
                let nibble = (byte >> (4 * ((output % GROUP) / 16))) & 0x0F;
                nibble as i8 - if ty == GgmlType::Q4_0 { 8 } else { 0 }
            }
        }
    }

    /// `(d, m)` of output `output` in neuron block `block` (neurons
    /// `32 block .. 32 block + 32`). For types without a minimum `m` is
    /// `-0.0`, so `d * q + m` is `d * q` bit for bit (also for `-0.0`).
    ///
    /// # Panics
    /// When `output` or `block` is out of range.
    pub fn block_scale(&self, output: usize, block: usize) -> (f32, f32) {
        assert!(output < self.outputs && block < self.neurons / QK, "({output}, {block}) out of range");
        let at = block * self.opad + output;
        (self.d[at].to_f32(), if self.has_min { self.m[at].to_f32() } else { -0.0 })
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
    /// 32 (single-threaded when the work is small); the implementation is the
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
        self.split_outputs(pool, idx.len(), out, &|o0, o| self.run(isa, o0, idx, coef, o));
        Ok(())
    }

    /// Calls `f(o0, out[o0..])` over slices of the outputs (multiples of
    /// 32 long) split over the pool's threads, or once for all of them when
    /// the work (`active` neurons times the outputs) is small.
    fn split_outputs(&self, pool: &ThreadPool, active: usize, out: &mut [f32], f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
        let n = self.outputs;
        if pool.n_threads() == 1 || active * n < AXPY_PAR_MACS || n <= GROUP {
            f(0, out);
            return;
        }
        let base = SyncPtr::new(out.as_mut_ptr());
        pool.broadcast(&|ti, nt| {
            let r = chunk_aligned(n, ti, nt, GROUP);
            if r.is_empty() {
                return;
            }
            // SAFETY: `r` lies inside `0..outputs` = `0..out.len()` and
            // `chunk_aligned` hands every thread a disjoint range.
            let o = unsafe { std::slice::from_raw_parts_mut(base.get().add(r.start), r.len()) };
            f(r.start, o);
        });
    }

    /// Calls `f(h, o0, out_h[o0..])` for both halves `h` of the active
    /// neurons (`out_0` is `out`, `out_1` a second buffer), then adds the
    /// second buffer to `out`. With two threads or more, the threads work
    /// in pairs, one per half, each pair on its own slice of the outputs
    /// (multiples of 32): every thread reads whole rows of the neurons of
    /// its half, an order the hardware prefetcher follows, where splitting
    /// the outputs alone has each thread read a part of every row (1.2-1.3x
    /// slower from DRAM). Small work (`active` neurons times the outputs)
    /// runs both halves on the calling thread; the sum is the same.
    fn split_halves(
        &self,
        pool: &ThreadPool,
        active: usize,
        out: &mut [f32],
        f: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
    ) {
        thread_local! {
            /// The second half's sums, reused from call to call.
            static SECOND: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        SECOND.with(|b| match b.try_borrow_mut() {
            Ok(mut second) => self.split_halves_into(pool, active, out, &mut second, f),
            // Not reached (`f` never calls back in); a fresh buffer is as correct.
            Err(_) => self.split_halves_into(pool, active, out, &mut Vec::new(), f),
        });
    }

    /// [`Self::split_halves`] with the second half's buffer.
    fn split_halves_into(
        &self,
        pool: &ThreadPool,
        active: usize,
        out: &mut [f32],
        second: &mut Vec<f32>,
        f: &(dyn Fn(usize, usize, &mut [f32]) + Sync),
    ) {
        let n = self.outputs;
        second.clear();
        second.resize(n, 0.0);
        if pool.n_threads() == 1 || active * n < AXPY_PAR_MACS {
            f(0, 0, out);
            f(1, 0, second);
        } else {
            let bases = [SyncPtr::new(out.as_mut_ptr()), SyncPtr::new(second.as_mut_ptr())];
            pool.broadcast(&|ti, nt| {
                let pairs = nt / 2;
                if ti >= 2 * pairs {
                    return;
                }
                let r = chunk_aligned(n, ti / 2, pairs, GROUP);
                if r.is_empty() {
                    return;
                }
                // SAFETY: `r` lies inside `0..outputs`, the length of both
                // buffers; `chunk_aligned` gives every pair a disjoint range
                // and the two threads of a pair write different buffers.
                let o = unsafe { std::slice::from_raw_parts_mut(bases[ti % 2].get().add(r.start), r.len()) };
                f(ti % 2, r.start, o);
            });
        }
        for (o, s) in out.iter_mut().zip(second.iter()) {
            *o += s;
        }
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

    /// Outputs `o0 .. o0 + out.len()` (`o0` a multiple of 32) into `out`;
    /// arguments validated by the caller.
    fn run(&self, isa: AxpyIsa, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        debug_assert!(o0.is_multiple_of(GROUP) && o0 + out.len() <= self.outputs);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `AxpyIsa::Avx512` only comes from `select` on a CPU
            // with AVX-512F, AVX2, FMA and F16C; the caller validated `idx`
            // (every index < neurons), `coef` and the output slice.
            AxpyIsa::Avx512 => unsafe { x86::axpy_avx512(self, o0, idx, coef, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2, FMA and F16C detected.
            AxpyIsa::Avx2 => unsafe { x86::axpy_avx2(self, o0, idx, coef, out) },
            _ => self.run_scalar(o0, idx, coef, out),
        }
    }

    fn run_scalar(&self, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
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
                    for (o, s) in s[..w].iter_mut().enumerate() {
                        *s += c * f32::from(self.code(off + o, idx[k] as usize));
                    }
                    k += 1;
                }
                let d = &self.d[b * self.opad + off..][..w];
                if self.has_min {
                    let m = &self.m[b * self.opad + off..][..w];
                    for (((a, &s), &d), &m) in acc.iter_mut().zip(&s).zip(d).zip(m) {
                        *a += d.to_f32() * s + m.to_f32() * h;
                    }
                } else {
                    for ((a, &s), &d) in acc.iter_mut().zip(&s).zip(d) {
                        *a += d.to_f32() * s;
                    }
                }
            }
            out.copy_from_slice(&acc[..w]);
        }
    }
}

/// Low nibbles of `qs` are elements 0..16, high nibbles 16..32 (ggml order).
fn unpack_nibbles(qs: &[u8], q: &mut [u8; QK]) {
    let (lo, hi) = q.split_at_mut(QK / 2);
    for ((&v, l), h) in qs.iter().zip(lo).zip(hi) {
        *l = v & 0x0F;
        *h = v >> 4;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::x86::{PREFETCH, prefetch_tile};
    use super::{GROUP, NeuronMajor, QK};
    use spinfer_kernels::GgmlType;
    use spinfer_kernels::pool::chunk;

    /// How a tile turns code bytes into integers.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Codes {
        /// Q4_1: nibbles as they are.
        Nibbles,
        /// Q4_0: nibbles minus 8.
        NibblesMinus8,
        /// Q8_0: int8.
        Int8,
    }

    /// Raw view of a [`NeuronMajor`] for one tile of output groups.
    struct Tile<'a> {
        codes: *const u8,
        d: *const u16,
        /// Null without a minimum.
        m: *const u16,
        kind: Codes,
        stride: usize,
        opad: usize,
        /// First output of the tile (a multiple of 32).
        off: usize,
        idx: &'a [u32],
        coef: &'a [f32],
    }

    impl<'a> Tile<'a> {
        fn new(nm: &NeuronMajor, off: usize, idx: &'a [u32], coef: &'a [f32]) -> Self {
            let m = if nm.has_min { nm.m.as_ptr().cast() } else { std::ptr::null() };
            let kind = match nm.wtype {
                GgmlType::Q4_1 => Codes::Nibbles,
                GgmlType::Q4_0 => Codes::NibblesMinus8,
                _ => Codes::Int8,
            };
            Tile {
                codes: nm.codes.as_ptr(),
                d: nm.d.as_ptr().cast(),
                m,
                kind,
                stride: nm.stride,
                opad: nm.opad,
                off,
                idx,
                coef,
            }
        }

        /// Byte offset of the tile's codes inside a neuron's row.
        fn code_off(&self) -> usize {
            if self.kind == Codes::Int8 { self.off } else { self.off / 2 }
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

    /// Accumulates `G` groups of 32 outputs (`2 G` zmm vectors from
    /// `t.off`) over all neurons and writes the first `valid` to `out`.
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA, F16C; every `idx[k] < neurons`, `idx.len() ==
    /// coef.len()`, `t.off + 32 G <= opad`, and `out` valid for `valid <=
    /// 32 G` floats.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn tile512<const G: usize, const V: usize>(t: &Tile<'_>, out: *mut f32, valid: usize) {
        debug_assert_eq!(V, 2 * G);
        let mut acc = [_mm512_setzero_ps(); V];
        let (coff, clen) = (t.code_off(), if t.kind == Codes::Int8 { 32 * G } else { 16 * G });
        // Nibble code → its value as f32 (Q4_0: code − 8), by table lookup.
        let bias = if t.kind == Codes::NibblesMinus8 { 8.0 } else { 0.0 };
        let values = _mm512_sub_ps(
            _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.),
            _mm512_set1_ps(bias),
        );
        let mut k = 0;
        while k < t.idx.len() {
            let (end, b) = t.block_run(k);
            let mut s = [_mm512_setzero_ps(); V];
            let mut h = 0.0f32;
            while k < end {
                prefetch_tile(t.codes, t.stride, coff, clen, t.idx, k + PREFETCH);
                let c = t.coef[k];
                h += c;
                let cv = _mm512_set1_ps(c);
                // SAFETY: `idx[k] < neurons`, so the `clen` code bytes at
                // `idx[k] * stride + coff` (`coff + clen <= stride`) are
                // inside `codes` (`neurons * stride` bytes).
                let row = unsafe { t.codes.add(t.idx[k] as usize * t.stride + coff) };
                if t.kind == Codes::Int8 {
                    for (v, s) in s.iter_mut().enumerate() {
                        // SAFETY: bytes `16 v .. 16 v + 16` of the tile's row.
                        let q = unsafe { _mm_loadu_si128(row.add(16 * v).cast()) };
                        *s = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), *s);
                    }
                } else {
                    for g in 0..G {
                        // SAFETY: bytes `16 g .. 16 g + 16` of the tile's row:
                        // outputs `32 g + e` (low) and `32 g + 16 + e` (high).
                        let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(row.add(16 * g).cast()) });
                        // The table lookup reads only the low 4 bits of each
                        // lane: the low nibble as it is, the high one shifted.
                        let lo = _mm512_permutexvar_ps(q, values);
                        let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), values);
                        s[2 * g] = _mm512_fmadd_ps(cv, lo, s[2 * g]);
                        s[2 * g + 1] = _mm512_fmadd_ps(cv, hi, s[2 * g + 1]);
                    }
                }
                k += 1;
            }
            // SAFETY: block `b < neurons / 32`, so the `32 G` f16 at
            // `b * opad + off` (`off + 32 G <= opad`) lie inside `d` (and
            // `m`, when not null).
            unsafe {
                let dp = t.d.add(b * t.opad + t.off);
                for (v, (a, s)) in acc.iter_mut().zip(&s).enumerate() {
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(dp.add(16 * v).cast()));
                    *a = _mm512_fmadd_ps(d, *s, *a);
                }
                if !t.m.is_null() {
                    let mp = t.m.add(b * t.opad + t.off);
                    let hv = _mm512_set1_ps(h);
                    for (v, a) in acc.iter_mut().enumerate() {
                        let m = _mm512_cvtph_ps(_mm256_loadu_si256(mp.add(16 * v).cast()));
                        *a = _mm512_fmadd_ps(m, hv, *a);
                    }
                }
            }
        }
        if valid == 32 * G {
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `out` holds `valid = 32 G` floats.
                unsafe { _mm512_storeu_ps(out.add(16 * v), *a) };
            }
        } else {
            let mut buf = [0f32; 32 * 6];
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `G <= 6`, so `16 v + 16 <= 192`.
                unsafe { _mm512_storeu_ps(buf.as_mut_ptr().add(16 * v), *a) };
            }
            // SAFETY: `out` holds `valid <= 32 G <= 192` floats.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), out, valid) };
        }
    }

    /// AVX-512 implementation for outputs `o0 .. o0 + out.len()`, in tiles
    /// of up to 6 groups of 32 outputs (12 accumulators + 12 block sums).
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA, F16C; `o0` a multiple of 32, `o0 + out.len() <=
    /// outputs`, every `idx[k] < neurons`, `coef.len() == idx.len()`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn axpy_avx512(nm: &NeuronMajor, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        let ng = out.len().div_ceil(GROUP);
        let tiles = ng.div_ceil(6);
        for ti in 0..tiles {
            let r = chunk(ng, ti, tiles);
            let first = GROUP * r.start;
            let valid = (out.len() - first).min(GROUP * r.len());
            // `o0 + first + 32 r.len() <= opad`: both are multiples of 32 and
            // the slice ends inside the padded row.
            let t = Tile::new(nm, o0 + first, idx, coef);
            // SAFETY: `first + valid <= out.len()`; the tile's codes and
            // scales are in range as argued above and by the caller.
            unsafe {
                let o = out.as_mut_ptr().add(first);
                match r.len() {
                    6 => tile512::<6, 12>(&t, o, valid),
                    5 => tile512::<5, 10>(&t, o, valid),
                    4 => tile512::<4, 8>(&t, o, valid),
                    3 => tile512::<3, 6>(&t, o, valid),
                    2 => tile512::<2, 4>(&t, o, valid),
                    _ => tile512::<1, 2>(&t, o, valid),
                }
            }
        }
    }

    /// AVX2 implementation, one group of 32 outputs (4 ymm accumulators + 4
    /// block sums) at a time.
    ///
    /// # Safety
    /// AVX2, FMA, F16C; as [`axpy_avx512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_avx2(nm: &NeuronMajor, o0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        let low = _mm256_set1_epi32(0x0F);
        let eight = _mm256_set1_epi32(8);
        for g in 0..out.len().div_ceil(GROUP) {
            let first = GROUP * g;
            let valid = (out.len() - first).min(GROUP);
            let t = Tile::new(nm, o0 + first, idx, coef);
            let coff = t.code_off();
            let clen = if t.kind == Codes::Int8 { 32 } else { 16 };
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut k = 0;
            while k < idx.len() {
                let (end, b) = t.block_run(k);
                let mut s = [_mm256_setzero_ps(); 4];
                let mut h = 0.0f32;
                while k < end {
                    prefetch_tile(t.codes, t.stride, coff, clen, idx, k + PREFETCH);
                    let c = coef[k];
                    h += c;
                    let cv = _mm256_set1_ps(c);
                    // SAFETY: `idx[k] < neurons` and `coff + clen <= stride`,
                    // so the group's codes of neuron `idx[k]` are in `codes`.
                    let row = unsafe { t.codes.add(idx[k] as usize * t.stride + coff) };
                    let q: [__m256i; 4] = if t.kind == Codes::Int8 {
                        // SAFETY: bytes `8 v .. 8 v + 8` of the group's 32.
                        std::array::from_fn(|v| _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(row.add(8 * v).cast()) }))
                    } else {
                        // SAFETY: the group's 16 bytes of nibbles.
                        let bytes = unsafe { _mm_loadu_si128(row.cast()) };
                        let (a, b) = (_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(bytes)));
                        let q = [
                            _mm256_and_si256(a, low),
                            _mm256_and_si256(b, low),
                            _mm256_srli_epi32::<4>(a),
                            _mm256_srli_epi32::<4>(b),
                        ];
                        if t.kind == Codes::NibblesMinus8 { q.map(|q| _mm256_sub_epi32(q, eight)) } else { q }
                    };
                    for (s, q) in s.iter_mut().zip(q) {
                        *s = _mm256_fmadd_ps(cv, _mm256_cvtepi32_ps(q), *s);
                    }
                    k += 1;
                }
                // SAFETY: block `b < neurons / 32`, so the group's 32 f16 at
                // `b * opad + off` lie inside `d` (and `m`, when not null).
                unsafe {
                    let dp = t.d.add(b * t.opad + t.off);
                    for (v, (a, s)) in acc.iter_mut().zip(&s).enumerate() {
                        let d = _mm256_cvtph_ps(_mm_loadu_si128(dp.add(8 * v).cast()));
                        *a = _mm256_fmadd_ps(d, *s, *a);
                    }
                    if !t.m.is_null() {
                        let mp = t.m.add(b * t.opad + t.off);
                        let hv = _mm256_set1_ps(h);
                        for (v, a) in acc.iter_mut().enumerate() {
                            let m = _mm256_cvtph_ps(_mm_loadu_si128(mp.add(8 * v).cast()));
                            *a = _mm256_fmadd_ps(m, hv, *a);
                        }
                    }
                }
            }
            let mut buf = [0f32; GROUP];
            for (v, a) in acc.iter().enumerate() {
                // SAFETY: `8 v + 8 <= 32`.
                unsafe { _mm256_storeu_ps(buf.as_mut_ptr().add(8 * v), *a) };
            }
            out[first..first + valid].copy_from_slice(&buf[..valid]);
        }
    }
}
