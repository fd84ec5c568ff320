//! GEMM over weights packed once, at load: `out[t, r] = bias[r] + Σ_c
//! W[r, c] · x[t, c]` for matmuls over many tokens (the sentence-embedding
//! encoder), in one of three precisions ([`PackedType`]):
//!
//! * **BF16**: weights and activations rounded to bf16 (to nearest even),
//!   products exact, sums in f32. AVX-512 BF16's `vdpbf16ps` multiplies a
//!   broadcast activation pair with 16 weight pairs and adds both products
//!   to 16 f32 lanes: twice the arithmetic of an f32 FMA per instruction,
//!   half the bytes per weight. The activations are rounded on every call,
//!   row-major, into the caller's scratch.
//! * **I16**: weights scaled per row and activations per block of 64
//!   columns to 13- and 14-bit integers, products summed exactly in i32
//!   per block, blocks in f32 (`int16.rs`). AVX2's `vpmaddwd` multiplies a
//!   broadcast activation pair with 8 weight pairs and adds each lane's
//!   two products: twice the arithmetic of an f32 FMA per instruction, for
//!   CPUs without AVX-512 BF16. The activations are quantised on every
//!   call into the caller's scratch.
//! * **F32**: the weights as they are (any type, dequantised to f32), one
//!   FMA per product; the activations are read in place.
//!
//! Both keep the weights in panels of [`NR`] rows stored k-major (one `u32`
//! per row and step: a bf16 pair `W[r, 2q]` (low half), `W[r, 2q + 1]`
//! (high half), or one f32), so the packing of the f32 GEMM
//! (`gemm_f32.rs`) is not redone on every call. Several matrices of the
//! same width can share one packed matrix, their rows one after the other
//! (Q, K and V become one product).
//!
//! Every kernel keeps a register tile of tokens × rows **starting from the
//! bias** and adds the products in column order over the whole K (no K
//! blocks, no reassociation), then stores with a lane mask for a ragged
//! last vector. So an output's value does not depend on the other tokens
//! of the call or on the thread count, and in f32 it is bit for bit `bias +
//! x[0]·w[0] + x[1]·w[1] + ...` with fused multiply-adds
//! ([`gemm_packed_scalar`] computes exactly that; so does the neuron-major
//! accumulation of the sparse FFN). Each pool thread owns a range of rows
//! (a multiple of 16). The kernels ([`packed_simd_available`]):
//!
//! * AVX-512 F/BW (`avx512.rs`), plus BF16 for [`PackedType::Bf16`]: 8
//!   tokens × 48 rows in 24 zmm registers; a thread's packed weights (a few
//!   hundred KiB at BERT-small widths) stay in its L2 while the token tiles
//!   stream by.
//! * AVX2 with FMA (`avx2.rs`, `avx2_i16.rs`), [`PackedType::F32`] and
//!   [`PackedType::I16`]: 6 tokens × 16 rows in 12 ymm registers, over
//!   blocks of rows sized to the L2.
//! * AMX tiles (`amx.rs`) for bf16 where the OS grants them.
//!
//! Without them [`gemm_packed`] runs the scalar reference's arithmetic
//! split over the pool: correct, not fast, so callers that care keep their
//! other kernels on such CPUs.

use spinfer_kernel_base::dequant::dequantize_row;
use spinfer_kernel_base::pool::{SyncPtr, ThreadPool, chunk_aligned};
use spinfer_kernel_base::{GgmlType, KernelError, Result};

/// Rows per packed panel (three vectors of 16 lanes).
pub const NR: usize = 48;
/// Rows a thread's range is a multiple of (one AVX-512 vector, two AVX2
/// ones).
const LANES: usize = 16;

/// Precision of a [`PackedMatrix`] and of its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedType {
    /// bf16 weights and activations, f32 sums.
    Bf16,
    /// f32 weights and activations.
    F32,
    /// i16 weights (one scale per row) and activations (one scale per 64
    /// columns of a token), exact i32 sums per 64 columns, f32 across.
    I16,
}

/// `x` rounded to bf16 (round to nearest, ties to even; NaN stays NaN,
/// quiet): the bit pattern `half::bf16::from_f32` gives.
#[inline]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() { ((b >> 16) | 0x0040) as u16 } else { (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16 }
}

/// The f32 value of a bf16 bit pattern.
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Whether the CPU runs a SIMD kernel of `ty` (else [`gemm_packed`]
/// falls back to scalar code): AVX-512 F/BW (and BF16 for bf16), or AVX2
/// with FMA for f32 and i16.
pub fn packed_simd_available(ty: PackedType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available(ty) || (ty != PackedType::Bf16 && avx2::available())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// The reduced precision that multiplies faster than f32 on this CPU,
/// if any: bf16 with AVX-512 BF16 (or AMX), else i16 where AVX2 is the
/// widest (with AVX-512 F but no BF16, the 512-bit f32 kernel does as many
/// products per instruction as the 256-bit `vpmaddwd` one).
pub fn reduced_type() -> Option<PackedType> {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available(PackedType::Bf16) {
            return Some(PackedType::Bf16);
        }
        if avx2::available() && !avx512::available(PackedType::F32) {
            return Some(PackedType::I16);
        }
    }
    None
}

/// The kernel [`gemm_packed`] runs for `ty` on this CPU, for reports
/// (`isa/weights*activations`; bf16 shapes that fit AMX tiles run there
/// where the OS grants them).
pub fn kernel_name(ty: PackedType) -> &'static str {
    #[cfg(target_arch = "x86_64")]
    match ty {
        PackedType::Bf16 if avx512::available(ty) => return "avx512bf16/bf16*bf16 (prepacked)",
        PackedType::F32 if avx512::available(ty) => return "avx512/f32*f32 (prepacked)",
        PackedType::F32 if avx2::available() => return "avx2/f32*f32 (prepacked)",
        PackedType::I16 if avx2::available() => return "avx2/i16*i16 (prepacked)",
        _ => {}
    }
    match ty {
        PackedType::Bf16 => "scalar/bf16*bf16 (prepacked)",
        PackedType::F32 => "scalar/f32*f32 (prepacked)",
        PackedType::I16 => "scalar/i16*i16 (prepacked)",
    }
}

/// Whether the bf16 product runs on AMX tiles (the OS granted them and
/// `SPINFER_CPU` does not cap them off); shapes whose K is not a whole
/// number of tiles stay on `vdpbf16ps`.
pub fn amx_available() -> bool {
    spinfer_kernel_base::cpu::CpuFeatures::detect().amx_bf16
}

#[cfg(target_arch = "x86_64")]
mod amx;

/// A weight matrix (`rows × cols`) packed for [`gemm_packed`]: panel `p`,
/// step `q`, row `j` of the panel at `u32` index `p · steps · NR + q · NR +
/// j`, where a step is a column pair (bf16, i16: the even column in the
/// low half) or a column (f32); rows past `rows` and the column past an
/// odd `cols` (bf16, i16) are zero. I16 rows have a scale each.
pub struct PackedMatrix {
    ty: PackedType,
    rows: usize,
    cols: usize,
    /// K steps: `ceil(cols / 2)` (bf16, i16) or `cols` (f32).
    steps: usize,
    buf: Vec<u32>,
    /// I16: each row's scale, zero past `rows` to a whole panel; else
    /// empty.
    scales: Vec<f32>,
    /// First element of the panels in `buf` (64-byte aligned).
    off: usize,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl PackedMatrix {
    /// Converts and packs the matrices `parts` (each `(type, bytes, rows)`,
    /// row-major with `cols` elements per row, of any type
    /// [`spinfer_kernel_base::dequant::dequantize_row`] reads) into one matrix of `ty`,
    /// their rows one after the other.
    ///
    /// # Errors
    /// If a part's bytes do not hold `rows × cols` elements of its type, or
    /// the type has no dequantisation.
    pub fn pack(ty: PackedType, parts: &[(GgmlType, &[u8], usize)], cols: usize) -> Result<Self> {
        let rows: usize = parts.iter().map(|p| p.2).sum();
        let steps = match ty {
            PackedType::Bf16 | PackedType::I16 => cols.div_ceil(2),
            PackedType::F32 => cols,
        };
        let mut scales = if ty == PackedType::I16 { vec![0.0f32; rows.div_ceil(NR) * NR] } else { Vec::new() };
        let mut qrow = vec![0i16; if ty == PackedType::I16 { 2 * steps } else { 0 }];
        let len = rows.div_ceil(NR) * steps * NR;
        let mut buf = vec![0u32; len + 16];
        let off = buf.as_ptr().align_offset(64).min(16);
        let panels = &mut buf[off..off + len];
        let mut row = vec![0.0f32; cols];
        let mut r = 0;
        for &(wt, bytes, n) in parts {
            let rb = wt.row_bytes(cols)?;
            if bytes.len() != n * rb {
                return Err(KernelError::BufferSize { ty: wt, n: n * cols, want: n * rb, got: bytes.len() });
            }
            for i in 0..n {
                dequantize_row(wt, &bytes[i * rb..(i + 1) * rb], &mut row)?;
                if ty == PackedType::I16 {
                    scales[r] = int16::quantize(&row, int16::W_MAX, &mut qrow[..cols]);
                }
                let base = r / NR * steps * NR + r % NR;
                for q in 0..steps {
                    panels[base + q * NR] = match ty {
                        PackedType::F32 => row[q].to_bits(),
                        PackedType::Bf16 => {
                            let hi = row.get(2 * q + 1).map_or(0, |&v| to_bf16(v));
                            u32::from(to_bf16(row[2 * q])) | (u32::from(hi) << 16)
                        }
                        PackedType::I16 => u32::from(qrow[2 * q] as u16) | (u32::from(qrow[2 * q + 1] as u16) << 16),
                    };
                }
                r += 1;
            }
        }
        Ok(Self { ty, rows, cols, steps, buf, scales, off })
    }

    /// Packs an f32 matrix given as a slice (`rows × cols`, row-major).
    ///
    /// # Errors
    /// If `w` does not hold `rows × cols` floats.
    pub fn from_f32(ty: PackedType, w: &[f32], rows: usize, cols: usize) -> Result<Self> {
        Self::pack(ty, &[(GgmlType::F32, bytemuck::cast_slice(w), rows)], cols)
    }

    pub fn ty(&self) -> PackedType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.buf.len() + self.scales.len()) * 4
    }

    fn panels(&self) -> &[u32] {
        &self.buf[self.off..self.off + self.rows.div_ceil(NR) * self.steps * NR]
    }

    /// The packed element of row `r`, step `q`.
    fn at(&self, r: usize, q: usize) -> u32 {
        self.panels()[r / NR * self.steps * NR + q * NR + r % NR]
    }

    /// Weight `(r, c)` as stored, as f32.
    ///
    /// # Panics
    /// If `r` or `c` is out of range.
    pub fn weight(&self, r: usize, c: usize) -> f32 {
        assert!(r < self.rows && c < self.cols, "weight ({r}, {c}) of a {} x {} matrix", self.rows, self.cols);
        match self.ty {
            PackedType::F32 => f32::from_bits(self.at(r, c)),
            PackedType::Bf16 => {
                let p = self.at(r, c / 2);
                bf16_to_f32(if c.is_multiple_of(2) { p as u16 } else { (p >> 16) as u16 })
            }
            PackedType::I16 => f32::from(self.qweight(r, c)) * self.scales[r],
        }
    }

    /// The quantised weight `(r, c)` of an I16 matrix.
    fn qweight(&self, r: usize, c: usize) -> i16 {
        let p = self.at(r, c / 2);
        (if c.is_multiple_of(2) { p } else { p >> 16 }) as u16 as i16
    }
}

/// Fewest activation values for which converting them (bf16 rounding,
/// i16 quantisation) is split over the pool (below, one more broadcast
/// costs more than it saves).
const PAR_CONVERT: usize = 32 * 1024;

/// Runs `convert` over the tokens `0..n` (`values` activations in all):
/// in ranges over the pool when there are enough of them, else on this
/// thread alone.
#[cfg(target_arch = "x86_64")]
fn convert_tokens(pool: &ThreadPool, n: usize, values: usize, convert: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    if values >= PAR_CONVERT && pool.n_threads() > 1 {
        pool.broadcast(&|ti, nt| convert(spinfer_kernel_base::pool::chunk(n, ti, nt)));
    } else {
        convert(0..n);
    }
}

/// A function applied once to every output, after the sum, on slices of
/// one token's row (e.g. an activation function), while they are still in
/// cache.
pub type Epilogue<'a> = &'a (dyn Fn(&mut [f32]) + Sync);

/// Checks the operands of an `n`-token product with `w`.
fn check(w: &PackedMatrix, x: &[f32], n: usize, bias: Option<&[f32]>, out: &[f32]) -> Result<()> {
    let shape = |detail: String| KernelError::Shape { op: "gemm_packed", detail };
    if x.len() != n * w.cols {
        return Err(shape(format!("activations hold {} values, expected {n} tokens x {} columns", x.len(), w.cols)));
    }
    if out.len() != n * w.rows {
        return Err(shape(format!("output holds {} values, expected {n} tokens x {} rows", out.len(), w.rows)));
    }
    if let Some(b) = bias.filter(|b| b.len() != w.rows) {
        return Err(shape(format!("bias holds {} values, expected {}", b.len(), w.rows)));
    }
    Ok(())
}

/// `out[t, r] = bias[r] + Σ_c W[r, c] · x[t, c]` in `w`'s precision for the
/// `n` rows of `x` (`n × cols`, row-major; `out` is `n × rows`), then
/// `epilogue` on the results. Rows are split over the pool's threads; an
/// output's value depends neither on the thread count nor on the other
/// tokens of the call. `scratch` holds the rounded activations of the bf16
/// product (grown as needed, never shrunk).
///
/// # Errors
/// If a slice does not match the shapes.
#[allow(clippy::too_many_arguments, reason = "the GEMM operands")]
pub fn gemm_packed(
    pool: &ThreadPool,
    w: &PackedMatrix,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    scratch: &mut Vec<u8>,
    epilogue: Option<Epilogue<'_>>,
) -> Result<()> {
    check(w, x, n, bias, out)?;
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if w.ty == PackedType::Bf16 && amx_available() && amx::fits(w) {
        amx::run(pool, w, x, n, bias, out, scratch, epilogue);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if avx512::available(w.ty) {
        avx512::run(pool, w, x, n, bias, out, scratch, epilogue);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if w.ty == PackedType::F32 && avx2::available() {
        avx2::run(pool, w, x, n, bias, out, epilogue);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if w.ty == PackedType::I16 && avx2::available() {
        avx2_i16::run(pool, w, x, n, bias, out, scratch, epilogue);
        return Ok(());
    }
    let _ = scratch;
    // Scalar fallback, rows split over the pool as in the SIMD kernel.
    let rows = w.rows;
    let quantized = (w.ty == PackedType::I16).then(|| int16::Quantized::new(x, n, w.cols));
    let out_ptr = SyncPtr::new(out.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, LANES);
        if rr.is_empty() {
            return;
        }
        for t in 0..n {
            // SAFETY: this thread alone writes rows `rr` of token `t`; `out`
            // holds `n * rows` floats (checked) and outlives the broadcast.
            let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(t * rows + rr.start), rr.len()) };
            for (r, ov) in rr.clone().zip(o.iter_mut()) {
                *ov = dot_scalar(w, r, token(w, x, quantized.as_ref(), t), bias.map_or(0.0, |b| b[r]));
            }
            if let Some(e) = epilogue {
                e(o);
            }
        }
    });
    Ok(())
}

/// Token `t`'s activations as the scalar reference reads them: the
/// quantised ones for i16, else `x`'s row.
enum Token<'a> {
    Float(&'a [f32]),
    Int16(&'a [i16], &'a [f32]),
}

fn token<'a>(w: &PackedMatrix, x: &'a [f32], q: Option<&'a int16::Quantized>, t: usize) -> Token<'a> {
    match q {
        Some(q) => {
            let (qx, sa) = q.token(t);
            Token::Int16(qx, sa)
        }
        None => Token::Float(&x[t * w.cols..(t + 1) * w.cols]),
    }
}

/// `b + Σ_c W[r, c] · x[c]` in the kernels' order: from `b`, one fused
/// multiply-add per column (f32); per column pair the odd column's product,
/// then the even one's, each added with one rounding (bf16: the products
/// are exact), as `vdpbf16ps` specifies; [`int16::dot`] on quantised
/// activations.
fn dot_scalar(w: &PackedMatrix, r: usize, x: Token<'_>, b: f32) -> f32 {
    let x = match x {
        Token::Int16(qx, sa) => return int16::dot(qx, sa, |c| w.qweight(r, c), w.scales[r], b),
        Token::Float(x) => x,
    };
    let mut s = b;
    match w.ty {
        PackedType::F32 => {
            for (c, &xv) in x.iter().enumerate() {
                s = xv.mul_add(f32::from_bits(w.at(r, c)), s);
            }
        }
        PackedType::Bf16 | PackedType::I16 => {
            let round = |v: f32| bf16_to_f32(to_bf16(v));
            for q in 0..w.steps {
                let p = w.at(r, q);
                let x1 = x.get(2 * q + 1).map_or(0.0, |&v| round(v));
                s += x1 * bf16_to_f32((p >> 16) as u16);
                s += round(x[2 * q]) * bf16_to_f32(p as u16);
            }
        }
    }
    s
}

/// The scalar reference of [`gemm_packed`] (single-threaded, no epilogue).
///
/// # Errors
/// If a slice does not match the shapes.
pub fn gemm_packed_scalar(w: &PackedMatrix, x: &[f32], n: usize, bias: Option<&[f32]>, out: &mut [f32]) -> Result<()> {
    check(w, x, n, bias, out)?;
    let quantized = (w.ty == PackedType::I16).then(|| int16::Quantized::new(x, n, w.cols));
    for t in 0..n {
        for r in 0..w.rows {
            out[t * w.rows + r] = dot_scalar(w, r, token(w, x, quantized.as_ref(), t), bias.map_or(0.0, |b| b[r]));
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_i16;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod int16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_half() {
        let mut s = 0x1234_5678u32;
        let mut xs = vec![0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY, f32::NAN];
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            xs.push(f32::from_bits(s));
        }
        for x in xs {
            if x.is_nan() {
                assert!(bf16_to_f32(to_bf16(x)).is_nan());
            } else {
                assert_eq!(to_bf16(x), half::bf16::from_f32(x).to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn packing_keeps_every_weight() {
        let (rows, cols) = (50, 7);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        for ty in [PackedType::Bf16, PackedType::F32] {
            let p = PackedMatrix::from_f32(ty, &w, rows, cols).unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    let v = w[r * cols + c];
                    let want = if ty == PackedType::F32 { v } else { bf16_to_f32(to_bf16(v)) };
                    assert_eq!(p.weight(r, c), want);
                }
            }
            assert!(PackedMatrix::from_f32(ty, &w[1..], rows, cols).is_err());
        }
    }

    /// The bf16 rounding of a row of activations (SIMD body and scalar
    /// tail) against `to_bf16`, on random bit patterns (NaN, infinities,
    /// subnormals and ties included).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_rounding_matches_the_scalar_one() {
        if !avx512::available(PackedType::F32) {
            return;
        }
        let mut s = 0x9e37_79b9u32;
        let mut x: Vec<f32> = (0..1001)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                f32::from_bits(s)
            })
            .collect();
        x[..6].copy_from_slice(&[f32::NAN, -f32::INFINITY, 1e-40, f32::from_bits(0x3f80_8000), -0.0, f32::MAX]);
        let mut got = vec![0u32; x.len().div_ceil(2)];
        // SAFETY: AVX-512 F/BW detected above; `got` holds ceil(len / 2) u32.
        unsafe { avx512::convert_row(&x, got.as_mut_ptr()) };
        for (q, &g) in got.iter().enumerate() {
            let lo = to_bf16(x[2 * q]);
            let hi = x.get(2 * q + 1).map_or(0, |&v| to_bf16(v));
            assert_eq!(g, u32::from(lo) | (u32::from(hi) << 16), "pair {q}: {:e}, {:?}", x[2 * q], x.get(2 * q + 1));
        }
    }
}
