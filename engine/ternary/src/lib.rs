//! Ternary weights (BitNet b1.58: every weight is -1, 0 or +1 times a scale)
//! dotted with Q8_K activations: GGUF's TQ1_0 and TQ2_0, and spinfer's I2_S
//! layout (defined below).
//!
//! * Scalar references: [`dot_tq1_0_q8_k`] and [`dot_tq2_0_q8_k`] follow
//!   ggml's `ggml_vec_dot_tq{1,2}_0_q8_K_generic` (an exact i32 sum per
//!   256-element block, one float multiply-add per block); [`dot_i2s_q8_k`]
//!   does the same and applies the row scale once at the end.
//! * x86-64 tile kernels, AVX2 (`vpmaddubsw`) and AVX-512 VNNI (256-bit
//!   `vpdpbusd`): every weight block is unpacked to unsigned codes
//!   `c = w + 1` in {0, 1, 2}, in element order, and multiplied with the
//!   int8 activations; `sum(x)`, read from the Q8_K block sums, is then
//!   subtracted, since `sum((c - 1) x) = sum(c x) - sum(x)` (exact in
//!   integers). Activations come in the [`KLayout`](spinfer_kernel_base::quantize::KLayout) packing.
//! * The matmul drivers: `spinfer_kernels::matmul::candidates` serves TQ1_0/TQ2_0 ×
//!   Q8_K through `run`; I2_S has no GGML type id and is served by
//!   [`I2sKernel`] ([`i2s_candidates`]).
//!
//! # The I2_S layout
//!
//! bitnet.cpp's I2_S packs four 2-bit codes per byte and stores one f32
//! scale per tensor after all the codes. spinfer's I2_S keeps the codes but
//! makes every row self-contained, so that rows can be split across threads
//! or handed through the pack ABI in row ranges:
//!
//! * a row of `cols` weights (`cols` a multiple of 256) is `cols / 4` code
//!   bytes followed by the row's scale as a little-endian f32:
//!   [`i2s_row_bytes`]`(cols) = cols / 4 + 4`; a matrix is `rows` such rows;
//! * codes come in groups of 128 weights in 32 bytes (bitnet.cpp's x86
//!   order): byte `j` of group `g` holds weight `128 g + j` in bits 6..8,
//!   `128 g + 32 + j` in bits 4..6, `128 g + 64 + j` in bits 2..4 and
//!   `128 g + 96 + j` in bits 0..2;
//! * code `c` is the weight `(c - 1) * scale` (0: `-scale`, 1: 0, 2:
//!   `+scale`); code 3 is never written by [`repack_tq2_0_to_i2s`] and reads
//!   as `2 * scale` in every kernel, as TQ2_0's code 3 does;
//! * the scale belongs to a row group: rows that share a scale (every row
//!   of a BitNet tensor, whose scale is per tensor) carry the same value.
//!
//! It is not a GGUF type (upstream ggml has no I2_S, and forks number it
//! differently): a loader produces it by repacking TQ2_0 weights whose
//! block scales are equal along each row ([`repack_tq2_0_to_i2s`], exact),
//! and the plugin ABI names it `WeightType::I2_S` (an extension type id).

use bytemuck::Pod;
use half::f16;

use spinfer_kernel_base::QK_K;
use spinfer_kernel_base::blocks::{BlockQ8K, BlockTQ1_0, BlockTQ2_0};
use spinfer_kernel_base::cpu::CpuFeatures;
use spinfer_kernel_base::drive::{Isa, pack_tokens};
use spinfer_kernel_base::kernel::scratch_aligned;
use spinfer_kernel_base::kernel::{MatmulCall, MatmulDesc, MatmulKernel, Select, not_offered};
use spinfer_kernel_base::pool::{SyncPtr, ThreadPool, chunk};
use spinfer_kernel_base::quantize;
use spinfer_kernel_base::{GgmlType, KernelError, Result};

/// Iterates over the blocks of a weight row (unaligned bytes).
#[inline]
fn blocks<B: Pod>(w: &[u8]) -> impl Iterator<Item = B> + '_ {
    w.chunks_exact(size_of::<B>()).map(bytemuck::pod_read_unaligned::<B>)
}

/// Powers of three that move base-3 digit `n` of a TQ1_0 byte to the top.
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// Digit of a TQ1_0 byte `q` selected by `pow`, as a weight in {-1, 0, 1}.
#[inline]
fn trit(q: u8, pow: u8) -> i32 {
    let q = q.wrapping_mul(pow);
    i32::from((u16::from(q) * 3) >> 8) - 1
}

/// TQ2_0 weights · Q8_K activations (ggml's `ggml_vec_dot_tq2_0_q8_K`).
/// `w` is one row of TQ2_0 blocks, `x` the activation blocks.
pub fn dot_tq2_0_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockTQ2_0>(w).zip(x) {
        let mut sumi = 0i32;
        for (j, qs) in b.qs.chunks_exact(32).enumerate() {
            for l in 0..4 {
                let q8 = &y.qs[128 * j + 32 * l..128 * j + 32 * l + 32];
                for (&q, &v) in qs.iter().zip(q8) {
                    sumi += (i32::from((q >> (2 * l)) & 3) - 1) * i32::from(v);
                }
            }
        }
        sumf += sumi as f32 * (y.d * b.d.to_f32());
    }
    sumf
}

/// TQ1_0 weights · Q8_K activations (ggml's `ggml_vec_dot_tq1_0_q8_K`).
pub fn dot_tq1_0_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockTQ1_0>(w).zip(x) {
        let mut sumi = 0i32;
        let (qs0, qs1) = b.qs.split_at(32);
        for (n, &p) in POW3.iter().enumerate() {
            for (m, &q) in qs0.iter().enumerate() {
                sumi += trit(q, p) * i32::from(y.qs[32 * n + m]);
            }
        }
        for (n, &p) in POW3.iter().enumerate() {
            for (m, &q) in qs1.iter().enumerate() {
                sumi += trit(q, p) * i32::from(y.qs[160 + 16 * n + m]);
            }
        }
        for (n, &p) in POW3[..4].iter().enumerate() {
            for (m, &q) in b.qh.iter().enumerate() {
                sumi += trit(q, p) * i32::from(y.qs[240 + 4 * n + m]);
            }
        }
        sumf += sumi as f32 * (b.d.to_f32() * y.d);
    }
    sumf
}

// === I2_S ===

/// Weights per I2_S code group (32 bytes).
pub const I2S_GROUP: usize = 128;

/// Bytes of one I2_S row of `cols` weights: `cols / 4` code bytes and the
/// f32 scale. `cols` must be a multiple of 256 (the Q8_K block).
pub fn i2s_row_bytes(cols: usize) -> Result<usize> {
    if !cols.is_multiple_of(QK_K) {
        return Err(KernelError::Shape {
            op: "i2_s",
            detail: format!("rows of {cols} weights are not a multiple of {QK_K}"),
        });
    }
    Ok(cols / 4 + 4)
}

/// The code bytes and the scale of one I2_S row (`row.len() >= 4`).
#[inline]
fn split_i2s_row(row: &[u8]) -> (&[u8], f32) {
    let (codes, s) = row.split_at(row.len() - 4);
    (codes, f32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// The scale stored at the end of an I2_S row.
pub fn i2s_row_scale(row: &[u8]) -> Result<f32> {
    if row.len() < 4 {
        return Err(KernelError::Shape { op: "i2_s", detail: format!("a row of {} bytes has no scale", row.len()) });
    }
    Ok(split_i2s_row(row).1)
}

/// I2_S weights · Q8_K activations: `w` is one row (codes and scale), `x`
/// its `cols / 256` activation blocks.
pub fn dot_i2s_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let (codes, scale) = split_i2s_row(w);
    let mut sumf = 0.0f32;
    for (blk, y) in codes.chunks_exact(QK_K / 4).zip(x) {
        let mut sumi = 0i32;
        for (g, grp) in blk.chunks_exact(32).enumerate() {
            for l in 0..4 {
                let shift = 6 - 2 * l;
                let q8 = &y.qs[128 * g + 32 * l..128 * g + 32 * l + 32];
                for (&q, &v) in grp.iter().zip(q8) {
                    sumi += (i32::from((q >> shift) & 3) - 1) * i32::from(v);
                }
            }
        }
        sumf += sumi as f32 * y.d;
    }
    sumf * scale
}

/// Dequantises one I2_S row (`row.len() == i2s_row_bytes(out.len())`).
pub fn dequantize_row_i2s(row: &[u8], out: &mut [f32]) -> Result<()> {
    let want = i2s_row_bytes(out.len())?;
    if row.len() != want {
        return Err(KernelError::Shape {
            op: "dequantize_row_i2s",
            detail: format!("{} weights need {want} bytes, got {}", out.len(), row.len()),
        });
    }
    let (codes, scale) = split_i2s_row(row);
    for (y, grp) in out.chunks_exact_mut(I2S_GROUP).zip(codes.chunks_exact(32)) {
        for (l, y) in y.chunks_exact_mut(32).enumerate() {
            for (o, &q) in y.iter_mut().zip(grp) {
                *o = f32::from(((q >> (6 - 2 * l)) & 3) as i8 - 1) * scale;
            }
        }
    }
    Ok(())
}

/// Repacks a TQ2_0 matrix (`rows` rows of `cols` weights) into I2_S,
/// exactly: every weight dequantises to the same f32. Each row's blocks
/// must share one scale (as in BitNet models, whose scale is per tensor);
/// otherwise the row cannot be I2_S and this is an error naming it.
pub fn repack_tq2_0_to_i2s(src: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let rb = GgmlType::TQ2_0.row_bytes(cols)?;
    let ob = i2s_row_bytes(cols)?;
    if src.len() != rows * rb {
        return Err(KernelError::BufferSize { ty: GgmlType::TQ2_0, n: rows * cols, want: rows * rb, got: src.len() });
    }
    let mut out = vec![0u8; rows * ob];
    for (r, (row, dst)) in src.chunks_exact(rb.max(1)).zip(out.chunks_exact_mut(ob)).enumerate() {
        let mut d: Option<f16> = None;
        for (b, dblk) in blocks::<BlockTQ2_0>(row).zip(dst.chunks_exact_mut(QK_K / 4)) {
            match d {
                None => d = Some(b.d),
                Some(d0) if d0.to_bits() == b.d.to_bits() => {}
                Some(d0) => {
                    return Err(KernelError::Shape {
                        op: "repack_tq2_0_to_i2s",
                        detail: format!("row {r} has block scales {d0} and {}; I2_S needs one scale per row", b.d),
                    });
                }
            }
            // TQ2_0 element 32 l + j of a 128-group sits at bits 2 l of
            // byte j; I2_S wants it at bits 6 - 2 l.
            for (o, &q) in dblk.iter_mut().zip(&b.qs) {
                *o = (0..4).fold(0u8, |acc, l| acc | (((q >> (2 * l)) & 3) << (6 - 2 * l)));
            }
        }
        let scale = d.map_or(0.0, f16::to_f32);
        dst[ob - 4..].copy_from_slice(&scale.to_le_bytes());
    }
    Ok(out)
}

// === Matmul drivers ===

/// Ternary weight formats, as const-generic tags for the tile kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
mod tfmt {
    pub const TQ1: u8 = 0;
    pub const TQ2: u8 = 1;
    pub const I2S: u8 = 2;

    /// Bytes per 256-weight block (I2_S: codes only).
    pub const fn block_bytes(f: u8) -> usize {
        match f {
            TQ1 => 54,
            TQ2 => 66,
            _ => 64,
        }
    }
}

/// One validated ternary matmul.
struct TJob<'a> {
    fmt: u8,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    w: &'a [u8],
    x: &'a [f32],
    n_tokens: usize,
    out: SyncPtr<f32>,
}

/// Runs a TQ1_0/TQ2_0 × Q8_K matmul for `spinfer_kernels::matmul`: `desc`,
/// `row_bytes` and the buffers are validated, `isa` is available, and
/// `n_tokens` and `rows` are non-zero.
#[allow(clippy::too_many_arguments, reason = "the fields of matmul's validated job")]
pub fn run(
    isa: Isa,
    pool: &ThreadPool,
    desc: &MatmulDesc,
    row_bytes: usize,
    w: &[u8],
    x: &[f32],
    n_tokens: usize,
    out: SyncPtr<f32>,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let fmt = match desc.wtype {
        GgmlType::TQ1_0 => tfmt::TQ1,
        GgmlType::TQ2_0 => tfmt::TQ2,
        ty => return Err(KernelError::Unsupported { ty, what: "the ternary kernels" }),
    };
    let job = TJob { fmt, rows: desc.rows, cols: desc.cols, row_bytes, w, x, n_tokens, out };
    run_job(isa, pool, &job, scratch);
    Ok(())
}

fn run_job(isa: Isa, pool: &ThreadPool, job: &TJob<'_>, scratch: &mut Vec<u8>) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => x86::run(isa == Isa::Avx512, pool, job, scratch),
        _ => run_scalar(pool, job, scratch),
    }
}

/// The scalar path: reference Q8_K blocks, one dot per (row, token).
fn run_scalar(pool: &ThreadPool, job: &TJob<'_>, scratch: &mut Vec<u8>) {
    let cols = job.cols;
    let nb = cols / QK_K;
    let stride = nb * size_of::<BlockQ8K>();
    let buf = scratch_aligned(scratch, stride * job.n_tokens);
    pack_tokens(pool, job.x, cols, job.n_tokens, buf, stride, &|x, dst| {
        let _ = quantize::quantize_row_q8_k_ref(x, bytemuck::cast_slice_mut(dst));
    });
    let q: &[BlockQ8K] = bytemuck::cast_slice(buf);
    let f = match job.fmt {
        tfmt::TQ1 => dot_tq1_0_q8_k,
        tfmt::TQ2 => dot_tq2_0_q8_k,
        _ => dot_i2s_q8_k,
    };
    let (rows, out) = (job.rows, job.out);
    pool.broadcast(&|ti, nt| {
        for r in chunk(rows, ti, nt) {
            let row = &job.w[r * job.row_bytes..(r + 1) * job.row_bytes];
            for t in 0..job.n_tokens {
                let v = f(row, &q[t * nb..(t + 1) * nb]);
                // SAFETY: `out` holds `n_tokens * rows` floats (validated);
                // row `r` belongs to this thread only.
                unsafe { *out.get().add(t * rows + r) = v };
            }
        }
    });
}

// === I2_S kernels ===

/// The I2_S × Q8_K kernels for `rows x cols` on a CPU with `features`,
/// best first (AVX-512, AVX2, scalar), named like the others
/// (`"avx2/i2_s*q8_K"`). Empty if `cols` is not a multiple of 256. The
/// weights passed to `run` are `rows` rows of [`i2s_row_bytes`]`(cols)`.
pub fn i2s_candidates(rows: usize, cols: usize, features: &CpuFeatures) -> Vec<Box<dyn MatmulKernel>> {
    let mut v: Vec<Box<dyn MatmulKernel>> = Vec::new();
    let Ok(row_bytes) = i2s_row_bytes(cols) else { return v };
    #[cfg(target_arch = "x86_64")]
    {
        if features.has_avx512() {
            v.push(Box::new(I2sKernel { name: "avx512/i2_s*q8_K", isa: Isa::Avx512, rows, cols, row_bytes }));
        }
        if features.has_avx2() {
            v.push(Box::new(I2sKernel { name: "avx2/i2_s*q8_K", isa: Isa::Avx2, rows, cols, row_bytes }));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = features;
    v.push(Box::new(I2sKernel { name: "scalar/i2_s*q8_K", isa: Isa::Scalar, rows, cols, row_bytes }));
    v
}

/// An I2_S × Q8_K matmul kernel for one shape (see [`i2s_candidates`]).
#[derive(Debug)]
pub struct I2sKernel {
    name: &'static str,
    isa: Isa,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl I2sKernel {
    fn isa_available(&self) -> bool {
        let f = CpuFeatures::detect();
        match self.isa {
            Isa::Scalar => true,
            Isa::Avx2 => f.has_avx2(),
            Isa::Avx512 => f.has_avx512(),
        }
    }
}

impl MatmulKernel for I2sKernel {
    fn name(&self) -> &str {
        self.name
    }

    fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> Result<()> {
        let MatmulCall { w, select, x, n_tokens, out, scratch, prefill: _ } = call;
        if !matches!(select, Select::All) {
            return Err(not_offered(self, select.form()));
        }
        let (rows, cols) = (self.rows, self.cols);
        let shape = |detail: String| Err(KernelError::Shape { op: "i2_s matmul", detail });
        if w.len() != rows * self.row_bytes {
            return shape(format!(
                "{rows} rows of {cols} weights need {} bytes, got {}",
                rows * self.row_bytes,
                w.len()
            ));
        }
        if x.len() != n_tokens * cols {
            return shape(format!("activations hold {} values, expected {n_tokens} tokens x {cols} columns", x.len()));
        }
        if out.len() != n_tokens * rows {
            return shape(format!("output holds {} values, expected {n_tokens} tokens x {rows} rows", out.len()));
        }
        if !self.isa_available() {
            return Err(KernelError::Shape {
                op: "i2_s matmul",
                detail: "this cpu lacks the kernel's simd features".into(),
            });
        }
        if n_tokens == 0 || rows == 0 {
            return Ok(());
        }
        let job = TJob {
            fmt: tfmt::I2S,
            rows,
            cols,
            row_bytes: self.row_bytes,
            w,
            x,
            n_tokens,
            out: SyncPtr::new(out.as_mut_ptr()),
        };
        run_job(self.isa, pool, &job, scratch);
        Ok(())
    }
}

// === SIMD ===

/// Generates a module of ternary tile kernels for one instruction set:
/// `$feat` the target features, `step` one 32-byte multiply-accumulate of
/// unsigned codes with int8 activations, `finish` the accumulator as eight
/// i32 partial sums.
#[cfg(target_arch = "x86_64")]
macro_rules! ternary_simd {
    (
        $(#[$meta:meta])*
        mod $name:ident, $feat:literal,
        step |$acc:ident, $w:ident, $x:ident| $step:block,
        finish |$a:ident| $finish:block
    ) => {
        $(#[$meta])*
        pub(crate) mod $name {
            #![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

            use std::arch::x86_64::*;

            use super::tfmt;
            use spinfer_kernel_base::quantize::KLayout;

            #[inline]
            #[target_feature(enable = $feat)]
            fn step($acc: __m256i, $w: __m256i, $x: __m256i) -> __m256i $step

            #[inline]
            #[target_feature(enable = $feat)]
            fn finish($a: __m256i) -> __m256i $finish

            /// `floor(3 q / 256)` of every unsigned byte `q`: the top base-3
            /// digit, in {0, 1, 2} (`q >= 86` adds one, `q >= 171` another).
            #[inline]
            #[target_feature(enable = $feat)]
            fn trit(v: __m256i) -> __m256i {
                let m1 = _mm256_cmpeq_epi8(_mm256_max_epu8(v, _mm256_set1_epi8(86)), v);
                let m2 = _mm256_cmpeq_epi8(_mm256_max_epu8(v, _mm256_set1_epi8(171u8 as i8)), v);
                _mm256_sub_epi8(_mm256_sub_epi8(_mm256_setzero_si256(), m1), m2)
            }

            /// Every byte times 3, wrapping.
            #[inline]
            #[target_feature(enable = $feat)]
            fn mul3(v: __m256i) -> __m256i {
                _mm256_add_epi8(v, _mm256_add_epi8(v, v))
            }

            /// The codes (`weight + 1`, in {0, 1, 2}; I2_S/TQ2_0 code 3
            /// stays 3) of the 256 weights of one block, 32 per vector in
            /// element order.
            ///
            /// # Safety
            /// `p` must point at a readable block of format `F` (I2_S: 64
            /// code bytes).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn unpack<const F: u8>(p: *const u8) -> [__m256i; 8] {
                let m3 = _mm256_set1_epi8(3);
                let mut o = [_mm256_setzero_si256(); 8];
                if F == tfmt::TQ1 {
                    // SAFETY: a TQ1_0 block is qs (48 bytes), qh (4), d (2).
                    let (a, b, qh) = unsafe {
                        (
                            _mm256_loadu_si256(p.cast()),
                            _mm_loadu_si128(p.add(32).cast()),
                            p.add(48).cast::<i32>().read_unaligned(),
                        )
                    };
                    // Weights 0..160: digit n of qs[0..32] is weight 32 n + m.
                    let mut pa = a;
                    for n in 0..5 {
                        o[n] = trit(pa);
                        pa = mul3(pa);
                    }
                    // Weights 160..240: digit n of qs[32..48] is 160 + 16 n + m;
                    // two digits per vector.
                    let b3 = _mm_add_epi8(b, _mm_add_epi8(b, b));
                    let c = _mm256_set_m128i(b3, b);
                    o[5] = trit(c);
                    let c9 = mul3(mul3(c));
                    o[6] = trit(c9);
                    let c81 = mul3(mul3(c9));
                    // Weights 240..256: digit n of qh[m] is 240 + 4 n + m.
                    let h16 = _mm256_cvtepu8_epi16(_mm_set1_epi32(qh));
                    let pw = _mm256_setr_epi16(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27);
                    let prod = _mm256_and_si256(_mm256_mullo_epi16(h16, pw), _mm256_set1_epi16(0xFF));
                    let hb = _mm_packus_epi16(_mm256_castsi256_si128(prod), _mm256_extracti128_si256::<1>(prod));
                    o[7] = trit(_mm256_set_m128i(hb, _mm256_castsi256_si128(c81)));
                } else {
                    for n in 0..2 {
                        // SAFETY: 64 code bytes at `p`.
                        let v = unsafe { _mm256_loadu_si256(p.add(32 * n).cast()) };
                        let s = [
                            v,
                            _mm256_srli_epi16::<2>(v),
                            _mm256_srli_epi16::<4>(v),
                            _mm256_srli_epi16::<6>(v),
                        ];
                        for l in 0..4 {
                            // TQ2_0: weight 32 l + m at bits 2 l; I2_S at 6 - 2 l.
                            let k = if F == tfmt::TQ2 { l } else { 3 - l };
                            o[4 * n + l] = _mm256_and_si256(s[k], m3);
                        }
                    }
                }
                o
            }

            /// Dots `R` ternary weight rows (format `F`) with `T` packed Q8_K
            /// activation rows, writing `out[t * out_stride + r]`.
            ///
            /// # Safety
            /// The CPU must support the module's features; `w` must hold `R`
            /// rows, `row_bytes` apart, of `l.blocks` blocks of format `F`
            /// (I2_S: followed by the row's f32 scale); `act` must hold `T`
            /// tokens packed with `l` (64-byte aligned, `l.stride` apart);
            /// `out` must be valid for the `R * T` writes.
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn tile<const F: u8, const R: usize, const T: usize>(
                w: *const u8,
                row_bytes: usize,
                l: &KLayout,
                act: *const u8,
                out: *mut f32,
                out_stride: usize,
            ) {
                let bb = tfmt::block_bytes(F);
                let ones = _mm256_set1_epi16(1);
                let mut facc = [[_mm256_setzero_ps(); T]; R];
                for sb in 0..l.blocks {
                    let mut xsum = [_mm256_setzero_si256(); T];
                    let mut dx = [0.0f32; T];
                    for t in 0..T {
                        let xa = act.wrapping_add(t * l.stride);
                        // SAFETY: `d` and the 32-byte aligned `bsums` of
                        // token `t`, block `sb`, inside the packed buffer.
                        unsafe {
                            dx[t] = xa.add(l.off_d + 4 * sb).cast::<f32>().read();
                            xsum[t] = _mm256_madd_epi16(_mm256_load_si256(xa.add(l.off_bsums + 32 * sb).cast()), ones);
                        }
                    }
                    let mut wv = [[_mm256_setzero_si256(); 8]; R];
                    let mut dw = [1.0f32; R];
                    for r in 0..R {
                        let p = w.wrapping_add(r * row_bytes + sb * bb);
                        // SAFETY: block `sb` of row `r` is readable; TQ
                        // blocks end with their f16 scale.
                        unsafe {
                            wv[r] = unpack::<F>(p);
                            if F != tfmt::I2S {
                                dw[r] = spinfer_kernel_base::drive::f16_at(p.add(bb - 2));
                            }
                        }
                    }
                    let mut acc = [[_mm256_setzero_si256(); T]; R];
                    for v in 0..8 {
                        for t in 0..T {
                            // SAFETY: 32 aligned quants of token `t`, block `sb`.
                            let xv = unsafe { _mm256_load_si256(act.add(t * l.stride + sb * 256 + 32 * v).cast()) };
                            for r in 0..R {
                                acc[r][t] = step(acc[r][t], wv[r][v], xv);
                            }
                        }
                    }
                    for r in 0..R {
                        for t in 0..T {
                            let i = _mm256_sub_epi32(finish(acc[r][t]), xsum[t]);
                            let s = _mm256_set1_ps(if F == tfmt::I2S { dx[t] } else { dw[r] * dx[t] });
                            facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), s, facc[r][t]);
                        }
                    }
                }
                for r in 0..R {
                    let scale = if F == tfmt::I2S {
                        // SAFETY: the I2_S scale follows the row's codes.
                        unsafe { w.add(r * row_bytes + l.blocks * 64).cast::<f32>().read_unaligned() }
                    } else {
                        1.0
                    };
                    for t in 0..T {
                        let y = spinfer_kernel_base::drive::hsum8(facc[r][t]);
                        // SAFETY: the caller guarantees `out` covers these positions.
                        unsafe { *out.add(t * out_stride + r) = if F == tfmt::I2S { y * scale } else { y } };
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
ternary_simd! {
    /// AVX2 (+FMA, F16C) ternary tiles: `vpmaddubsw` into i16 lanes (at
    /// most 8 x 2 x 2 x 127 per lane per block, no saturation), widened
    /// once per block with `vpmaddwd`.
    mod avx2, "avx2,fma,f16c",
    step |acc, w, x| { _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)) },
    finish |a| { _mm256_madd_epi16(a, _mm256_set1_epi16(1)) }
}

#[cfg(target_arch = "x86_64")]
ternary_simd! {
    /// AVX-512 VNNI ternary tiles: 256-bit `vpdpbusd` straight into i32.
    mod avx512, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    step |acc, w, x| { _mm256_dpbusd_epi32(acc, w, x) },
    finish |a| { a }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{TJob, tfmt};
    use spinfer_kernel_base::drive::{for_each_tile, pack_tokens};
    use spinfer_kernel_base::kernel::scratch_aligned;
    use spinfer_kernel_base::pool::ThreadPool;
    use spinfer_kernel_base::quantize::{self, KLayout};

    /// Rows per tile.
    const RMAX: usize = 2;
    /// Tokens per tile.
    const TMAX: usize = 4;

    /// Calls the tile kernel of `$m` for format `$f` and the tile shape.
    macro_rules! tile {
        ($m:ident, $f:expr, $nr:expr, $nt:expr, ($($a:expr),*)) => {
            match ($nr, $nt) {
                (RMAX, 4) => super::$m::tile::<{ $f }, RMAX, 4>($($a),*),
                (RMAX, 3) => super::$m::tile::<{ $f }, RMAX, 3>($($a),*),
                (RMAX, 2) => super::$m::tile::<{ $f }, RMAX, 2>($($a),*),
                (RMAX, 1) => super::$m::tile::<{ $f }, RMAX, 1>($($a),*),
                (_, 4) => super::$m::tile::<{ $f }, 1, 4>($($a),*),
                (_, 3) => super::$m::tile::<{ $f }, 1, 3>($($a),*),
                (_, 2) => super::$m::tile::<{ $f }, 1, 2>($($a),*),
                _ => super::$m::tile::<{ $f }, 1, 1>($($a),*),
            }
        };
    }

    /// Runs `job` with the AVX-512 (`avx512`) or AVX2 tiles; the caller
    /// checked that the CPU has them.
    pub(super) fn run(avx512: bool, pool: &ThreadPool, job: &TJob<'_>, scratch: &mut Vec<u8>) {
        let l = KLayout::new(job.cols);
        let buf = scratch_aligned(scratch, l.stride * job.n_tokens);
        pack_tokens(pool, job.x, job.cols, job.n_tokens, buf, l.stride, &|x, dst| quantize::pack_k(&l, x, dst));
        let act = buf.as_ptr() as usize;
        let (w, rb, rows, n, fmt) = (job.w.as_ptr() as usize, job.row_bytes, job.rows, job.n_tokens, job.fmt);
        let out = job.out;
        pool.broadcast(&|ti, nt| {
            let (w, act) = (w as *const u8, act as *const u8);
            for_each_tile(rows, n, ti, nt, RMAX, TMAX, |r, nr, t, ntk| {
                let (wp, ap, op) =
                    (w.wrapping_add(r * rb), act.wrapping_add(t * l.stride), out.get().wrapping_add(t * rows + r));
                // SAFETY: the CPU has the instruction set (checked by the
                // caller); rows `r..r + nr` and tokens `t..t + ntk` lie inside
                // the validated weight, packed-activation and output buffers;
                // this thread owns the output rows.
                unsafe {
                    match (avx512, fmt) {
                        (true, tfmt::TQ1) => tile!(avx512, tfmt::TQ1, nr, ntk, (wp, rb, &l, ap, op, rows)),
                        (true, tfmt::TQ2) => tile!(avx512, tfmt::TQ2, nr, ntk, (wp, rb, &l, ap, op, rows)),
                        (true, _) => tile!(avx512, tfmt::I2S, nr, ntk, (wp, rb, &l, ap, op, rows)),
                        (false, tfmt::TQ1) => tile!(avx2, tfmt::TQ1, nr, ntk, (wp, rb, &l, ap, op, rows)),
                        (false, tfmt::TQ2) => tile!(avx2, tfmt::TQ2, nr, ntk, (wp, rb, &l, ap, op, rows)),
                        (false, _) => tile!(avx2, tfmt::I2S, nr, ntk, (wp, rb, &l, ap, op, rows)),
                    }
                }
            });
        });
    }
}
