//! Multi-threaded matvec/matmul built from the dot products.
//!
//! [`candidates`] offers, best first, an AVX-512 kernel, an AVX2 kernel and
//! the scalar reference for every supported (weight type, activation type)
//! pair:
//!
//! * fast mode: Q4_0·Q8_0, Q4_1·Q8_1, Q5_0·Q8_0, Q5_1·Q8_1, Q8_0·Q8_0 and
//!   Q2_K..Q6_K·Q8_K (Q2_K/Q3_K are scalar only), and the ternary
//!   TQ1_0·Q8_K and TQ2_0·Q8_K ([`crate::dot::ternary`]);
//! * fast mode's one 16-bit plane ([`ActType::Q16`], [`fast_act`]): the
//!   32-element formats, AVX2 and scalar;
//! * precise mode (`ActType::F32`): F32, F16, BF16 and all the quantised
//!   types above, dequantised on the fly.
//!
//! A call validates the buffer sizes, quantises the activations once into
//! `scratch` (the SIMD kernels use the packed layouts of
//! [`crate::quantize`]; the Vec is reused, so steady-state calls do not
//! allocate), then splits the weight rows into contiguous ranges, one per
//! pool thread. Each thread walks its rows in tiles of up to 4 rows and,
//! for each tile, all tokens in groups of up to 4, so that every weight
//! block is loaded once per 4 tokens (prefill is matrix-matrix work) and
//! decode (`n_tokens == 1`) streams the weights once. F32/F16/BF16 weights
//! with f32 activations over many tokens go to a packed GEMM instead
//! (`gemm_f32`, AVX2/AVX-512). Calls marked
//! [`MatmulCall::prefill`](crate::kernel::MatmulCall) (a prompt's tokens)
//! of the 32-element formats run on AMX int8 tiles where the OS grants them
//! (`amx_int8`), and so do their other calls there (`amx_rows`: decode
//! rows, batches, gathered rows; under 8 tokens the same integer dots by
//! `vpdpbusd`), every output computed in one order by both. [`gemm_packed`] holds weights packed once
//! (f32, or bf16 for avx512_bf16) for callers that own their matrices, such
//! as the BERT encoder.

#[cfg(target_arch = "x86_64")]
mod amx_int8;
#[cfg(target_arch = "x86_64")]
mod amx_rows;
mod gemm_f32;
/// The GEMM over weights packed once (crate `spinfer-gemm`), at its old path.
pub use spinfer_gemm as gemm_packed;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::ops::Range;

pub use gemm_f32::{BLayout, sgemm, sgemm_scalar};

pub(crate) use spinfer_kernel_base::drive::{Isa, broadcast_work, for_each_tile, pack_tokens};
pub(crate) use spinfer_kernel_base::kernel::scratch_aligned;
pub(crate) use spinfer_kernel_base::pool::SyncPtr;

use crate::cpu::CpuFeatures;
use crate::kernel::{ActType, Form, MatmulCall, MatmulDesc, MatmulKernel, Select, not_offered};
use crate::pool::{ThreadPool, chunk_aligned};
use crate::{GgmlType, KernelError, Result};

/// Whether `(wtype, act)` is a pair this crate implements (in scalar).
pub fn is_supported_pair(wtype: GgmlType, act: ActType) -> bool {
    use GgmlType::*;
    match act {
        ActType::F32 => {
            matches!(
                wtype,
                F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | TQ1_0 | TQ2_0
            )
        }
        ActType::Q8_0 => matches!(wtype, Q4_0 | Q5_0 | Q8_0),
        ActType::Q8_1 => matches!(wtype, Q4_1 | Q5_1),
        ActType::Q8_K => matches!(wtype, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | TQ1_0 | TQ2_0),
        ActType::Q16 => matches!(wtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0),
    }
}

/// The activation format of fast mode for `wtype` weights on a CPU with
/// `features`: one 16-bit plane ([`ActType::Q16`]) for the 32-element
/// formats where the kernels would run on AVX2 without VNNI (there
/// `vpmaddwd` multiplies int16 pairs at the rate the 8-bit kernels'
/// `vpmaddubsw` + `vpmaddwd` multiply int8 quads, so one 16-bit plane
/// takes half the two 8-bit planes' integer instructions and runs
/// 1.4–1.7x faster in batches: docs/benchmarks.md, "One 16-bit activation
/// plane"); elsewhere llama.cpp's format
/// ([`ActType::fast_for`]), which fast mode feeds as two 8-bit planes.
pub fn fast_act(features: &CpuFeatures, wtype: GgmlType) -> ActType {
    let sixteen = cfg!(target_arch = "x86_64") && features.has_avx2_fma() && !features.has_avx512();
    if sixteen && is_supported_pair(wtype, ActType::Q16) { ActType::Q16 } else { ActType::fast_for(wtype) }
}

/// Whether fast mode should run a prompt's products over `wtype` weights
/// with the f32-activation kernel of precise mode, whose prompt path is
/// the f32 GEMM over weights dequantised once per call, instead of the
/// int8 kernels on two activation planes. It should on x86-64 CPUs with
/// AVX2, except for the formats that run on AMX int8 tiles where the OS
/// grants them: without tiles, two int8 planes cost as much integer work
/// per weight as f32 FMAs and use it less well, and the GEMM's result is
/// f32-exact (docs/benchmarks.md, "Prompts as an f32 GEMM over dequantised
/// weights").
pub fn prompt_gemm_pays(features: &CpuFeatures, wtype: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let on_tiles = amx_int8::available()
            && matches!(wtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0);
        features.has_avx2_fma() && gemm_f32::quantised(wtype) && !on_tiles
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (features, wtype);
        false
    }
}

/// Whether a SIMD kernel of `isa` exists for the pair.
fn simd_supported(isa: Isa, wtype: GgmlType, act: ActType) -> bool {
    use GgmlType::*;
    match isa {
        Isa::Scalar => true,
        Isa::Avx2 | Isa::Avx512 => match act {
            ActType::Q8_K => matches!(wtype, Q4_K | Q5_K | Q6_K | TQ1_0 | TQ2_0),
            // CPUs with AVX-512 VNNI multiply two 8-bit planes as fast.
            ActType::Q16 => isa == Isa::Avx2 && is_supported_pair(wtype, act),
            _ => is_supported_pair(wtype, act),
        },
    }
}

/// Every kernel in this crate that serves `desc` on a CPU with `features`,
/// best first (AVX-512, AVX2, scalar). Empty for unsupported pairs, for
/// rows that are not a whole number of blocks, and for the forms this
/// crate does not serve: gathered columns (the engine's sparse down
/// projection runs on its own neuron-major repack) and gathered rows of
/// the ternary kernels.
pub fn candidates(desc: &MatmulDesc, features: &CpuFeatures) -> Vec<Box<dyn MatmulKernel>> {
    let mut v: Vec<Box<dyn MatmulKernel>> = Vec::new();
    let ternary = desc.act == ActType::Q8_K && matches!(desc.wtype, GgmlType::TQ1_0 | GgmlType::TQ2_0);
    let form_served = match desc.form {
        Form::Dense => true,
        Form::GatheredRows => !ternary,
        Form::GatheredColumns => false,
    };
    if !form_served || !is_supported_pair(desc.wtype, desc.act) || desc.wtype.row_bytes(desc.cols).is_err() {
        return v;
    }
    let mut isas = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if features.has_avx512() {
            isas.push(Isa::Avx512);
        }
        if features.has_avx2() {
            isas.push(Isa::Avx2);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = features;
    isas.push(Isa::Scalar);
    for isa in isas {
        if simd_supported(isa, desc.wtype, desc.act) {
            v.push(Box::new(Kernel::new(*desc, isa)));
        }
    }
    v
}

/// A matmul kernel: one (weight type, activation type, shape) served by
/// one instruction set.
#[derive(Debug)]
pub(crate) struct Kernel {
    name: String,
    desc: MatmulDesc,
    isa: Isa,
    row_bytes: usize,
}

impl Kernel {
    fn new(desc: MatmulDesc, isa: Isa) -> Self {
        let name = format!("{}/{}*{}", isa.name(), desc.wtype.name(), desc.act.name());
        let row_bytes = desc.wtype.row_bytes(desc.cols).unwrap_or(0);
        Self { name, desc, isa, row_bytes }
    }

    /// Checks the buffers of `call`; returns the weight rows it holds and
    /// the output rows it computes.
    fn validate(&self, call: &MatmulCall<'_>) -> Result<(usize, usize)> {
        let d = &self.desc;
        let (w, x, n_tokens) = (call.w, call.x, call.n_tokens);
        if self.row_bytes == 0 || w.len() % self.row_bytes != 0 {
            let want = d.rows * self.row_bytes;
            return Err(KernelError::BufferSize { ty: d.wtype, n: d.rows * d.cols, want, got: w.len() });
        }
        let w_rows = w.len() / self.row_bytes;
        let out_rows = match call.select {
            Select::All => w_rows,
            Select::Rows(idx) => {
                crate::kernel::check_indices("gathered-row matmul", idx, w_rows)?;
                idx.len()
            }
            Select::Columns(_) => return Err(not_offered(self, Form::GatheredColumns)),
        };
        if x.len() != n_tokens * d.cols {
            return Err(KernelError::Shape {
                op: "matmul",
                detail: format!("activations hold {} values, expected {n_tokens} tokens x {} columns", x.len(), d.cols),
            });
        }
        if call.out.len() != n_tokens * out_rows {
            return Err(KernelError::Shape {
                op: "matmul",
                detail: format!("output holds {} values, expected {n_tokens} tokens x {out_rows} rows", call.out.len()),
            });
        }
        Ok((w_rows, out_rows))
    }
}

impl MatmulKernel for Kernel {
    fn name(&self) -> &str {
        &self.name
    }

    /// Validates the call and runs it with this kernel's instruction set.
    fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> Result<()> {
        let (w_rows, out_rows) = self.validate(&call)?;
        // `candidates` trusts the features it is given; make sure the CPU we
        // run on really has the instructions before executing them.
        if !self.isa.available() {
            return Err(KernelError::Unsupported { ty: self.desc.wtype, what: "this cpu (missing simd features)" });
        }
        let MatmulCall { w, select, x, n_tokens, out, scratch, prefill } = call;
        if n_tokens == 0 || out_rows == 0 {
            return Ok(());
        }
        let idx = match select {
            Select::Rows(idx) => Some(idx),
            _ => None,
        };
        let desc = MatmulDesc { rows: w_rows, ..self.desc };
        if self.desc.act == ActType::Q8_K && matches!(self.desc.wtype, GgmlType::TQ1_0 | GgmlType::TQ2_0) {
            if idx.is_some() {
                return Err(not_offered(self, Form::GatheredRows));
            }
            let out = SyncPtr::new(out.as_mut_ptr());
            return crate::dot::ternary::run(self.isa, pool, &desc, self.row_bytes, w, x, n_tokens, out, scratch);
        }
        let job =
            Job { desc, row_bytes: self.row_bytes, w, idx, x, n_tokens, out: SyncPtr::new(out.as_mut_ptr()), prefill };
        match self.isa {
            Isa::Scalar => scalar::run(pool, &job, scratch),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => x86::run(self.isa, pool, &job, scratch),
            #[cfg(not(target_arch = "x86_64"))]
            _ => Err(KernelError::Unsupported { ty: self.desc.wtype, what: "simd matmul" }),
        }
    }
}

/// One validated matmul call.
pub(crate) struct Job<'a> {
    pub desc: MatmulDesc,
    pub row_bytes: usize,
    pub w: &'a [u8],
    /// The weight rows to compute, in output order (`None`: all of them).
    pub idx: Option<&'a [u32]>,
    pub x: &'a [f32],
    pub n_tokens: usize,
    pub out: SyncPtr<f32>,
    /// A prompt's tokens ([`MatmulCall::prefill`]).
    pub prefill: bool,
}

impl Job<'_> {
    /// Output rows per token (the stride between tokens in `out`).
    pub fn out_rows(&self) -> usize {
        self.idx.map_or(self.desc.rows, <[u32]>::len)
    }

    /// The weight row of output row `r`.
    pub fn w_row(&self, r: usize) -> usize {
        self.idx.map_or(r, |idx| idx[r] as usize)
    }

    /// Multiply-adds of the whole job.
    pub fn macs(&self) -> usize {
        self.out_rows() * self.desc.cols * self.n_tokens
    }
}

/// Asks the CPU to start loading weight row `row` of `job` into the caches.
#[inline]
fn prefetch_row(job: &Job<'_>, row: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let bytes = &job.w[row * job.row_bytes..(row + 1) * job.row_bytes];
        for line in (0..bytes.len()).step_by(64) {
            // SAFETY: a prefetch is only a hint and `line` is inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(line).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (job, row);
}

/// The tile loop of one thread of `job`: calls `tile(out_row, w_row,
/// n_rows, tok0, n_toks)` for the output rows `out_row..out_row + n_rows`,
/// computed from the consecutive weight rows `w_row..w_row + n_rows`.
/// Without a row list that is [`for_each_tile`] (weight rows = output
/// rows; nothing is added to the dense loop, whose tiles can take only
/// ~60 ns). With one, tiles of `rmax` rows are formed where the list holds
/// `rmax` consecutive weight rows, and, if `scattered` is given, for any
/// 4 rows (`scattered(out_row, w_rows, tok0, n_toks)`, for a tile kernel
/// that takes one pointer per row); single rows elsewhere. Each row's value
/// is thus computed by the same tile code as in the dense product. Rows of
/// the list are prefetched ahead, as scattered rows defeat the hardware
/// prefetcher.
#[allow(clippy::type_complexity, reason = "the tile callback's signature: pointers and counts, named at the call")]
pub(crate) fn for_each_job_tile(
    job: &Job<'_>,
    ti: usize,
    nt: usize,
    rmax: usize,
    tmax: usize,
    mut tile: impl FnMut(usize, usize, usize, usize, usize),
    mut scattered: Option<&mut dyn FnMut(usize, [usize; 4], usize, usize)>,
) {
    let Some(idx) = job.idx else {
        return for_each_tile(job.desc.rows, job.n_tokens, ti, nt, rmax, tmax, |r, nr, t, ntk| tile(r, r, nr, t, ntk));
    };
    debug_assert!(rmax <= 4 && (scattered.is_none() || rmax == 4));
    const AHEAD: usize = 8;
    let Range { start, end } = chunk_aligned(idx.len(), ti, nt, rmax);
    for &i in &idx[start..end.min(start + AHEAD)] {
        prefetch_row(job, i as usize);
    }
    let mut r = start;
    while r < end {
        let w0 = idx[r] as usize;
        let room = end - r >= rmax;
        let consecutive = room && (1..rmax).all(|i| idx[r + i] as usize == w0 + i);
        let nr = if consecutive || (room && scattered.is_some()) { rmax } else { 1 };
        for &i in &idx[(r + AHEAD).min(end)..(r + nr + AHEAD).min(end)] {
            prefetch_row(job, i as usize);
        }
        let mut t = 0;
        while t < job.n_tokens {
            let ntk = (job.n_tokens - t).min(tmax);
            match scattered.as_mut() {
                Some(f) if nr == 4 && !consecutive => {
                    f(r, [0, 1, 2, 3].map(|i| idx[r + i] as usize), t, ntk);
                }
                _ => tile(r, w0, nr, t, ntk),
            }
            t += ntk;
        }
        r += nr;
    }
}
