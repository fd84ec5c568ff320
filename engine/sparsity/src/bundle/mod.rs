//! The FFN bundle: a model's FFN weights repacked neuron-major, for running
//! the sparse FFN under a memory budget (`ffn_budget_mb`).
//!
//! Under a budget the mapped GGUF FFN matrices are never read at run time.
//! Instead each neuron `j` of each layer is one *record*: its `W_gate` row
//! and `W_up` row in the file's quantised row format, and its `W_down`
//! column as the exact integer codes of [`spinfer_sparse_kernels::NeuronMajor`]
//! (4-bit types packed two per byte). The hottest records (highest
//! calibrated `active_freq`, across all layers) are held in RAM; the rest
//! are read on demand with positioned reads from the bundle file into a
//! bounded [`ColdCache`] whose [`super::cache::CachePolicy`] decides what
//! stays. Positioned reads (not a mapping) keep the file's pages out of the
//! process's resident set.
//!
//! # File format (`<sidecar>.ffn`, written once beside the sidecar)
//!
//! | bytes | content |
//! |---|---|
//! | 8 | magic `SPFFNB01` |
//! | 8 | header length `h` (u64 LE) |
//! | h | header JSON: `format`, `version`, `fingerprint` (the model's, see the sidecar), `freq_sha256` (SHA-256 of every layer's `active_freq`, f32 LE), `n_layers`, `dim`, `ffn_dim`, `gate_type`, `up_type`, `down_type`, `gate_row`, `up_row`, `down_col`, `record`, `scales`, `layer_bytes`, `data_start` (byte sizes) |
//! | … | zero padding to `data_start` (a multiple of 4096) |
//!
//! then per layer `l`, at `data_start + l · layer_bytes`:
//!
//! | bytes | content |
//! |---|---|
//! | 4 · ffn_dim | `order`: neuron ids (u32 LE) by descending `active_freq` (ties: lower id first) |
//! | scales | `W_down` block scales `d` as f16 laid out `[block][output]` (`ffn_dim/32 × dim`), then for Q4_1 the minimums `m` in the same layout |
//! | ffn_dim · record | records in `order`: gate row (`gate_row` bytes), up row (`up_row`), down codes (`down_col`: Q4_0/Q4_1 raw nibbles, byte `t` = output `t` low, output `t + dim/2` high; Q8_0 one i8 per output) |
//!
//! The hot set of a budget is therefore a prefix of each layer's records
//! (one read per layer at load). A bundle whose header does not match the
//! model and sidecar is rebuilt (write to `*.tmp`, then rename).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use half::f16;
use half::slice::HalfFloatSliceExt;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::pool::SyncPtr;
use spinfer_kernels::pool::{ThreadPool, chunk};
use spinfer_sparse_kernels::{AxpyIsa, NeuronMajor, QuantisedCoefs};

mod file;
mod lookahead;

pub use file::{FfnSource, path_for};
use file::{Header, QK, down_layout, header_for, read_at, read_header, release_layer, write_bundle};
pub use lookahead::LookAheadCounters;
use lookahead::{LookAhead, run_end};

use super::cache::{BoxedPolicy, ColdCache, NeuronId};
use super::shared::{AxpyMode, CacheCounters, sparsity_err};
use crate::{Error, Result};

/// Cold misses this many records apart or closer are read in one call.
const MAX_GAP: u32 = 4;
/// At most this many records per read.
const MAX_RUN: u32 = 256;
/// Outputs per AXPY tile.
const TILE: usize = 64;
/// Below this many multiply-adds the AXPY runs on one thread.
const PAR_MACS: usize = 32 * 1024;

/// Engine-wide totals of the cold path (all sessions).
#[derive(Default)]
struct Totals {
    hot: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    reads: AtomicU64,
}

struct BundleLayer {
    /// Per neuron: its position in the layer's record order.
    pos: Vec<u32>,
    /// Records `0..hot` are in `hot_data`.
    hot: usize,
    hot_data: Vec<u8>,
    /// `W_down` block scales `[block][output]`.
    d: Vec<f16>,
    /// Minimums (Q4_1), same layout; empty otherwise.
    m: Vec<f16>,
}

/// Where the budget went (bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BudgetReport {
    pub budget: usize,
    /// Resident whatever the budget: predictor factors, down scales, maps.
    pub fixed: usize,
    /// Hot records in RAM.
    pub hot: usize,
    pub hot_neurons: usize,
    /// Cold-cache slots.
    pub cache: usize,
    pub cache_slots: usize,
    pub total_neurons: usize,
    pub record: usize,
    pub policy: String,
}

/// A layer's gathered records for one token.
#[derive(Default)]
pub struct Gathered {
    /// Gate rows of the requested neurons (k × gate_row).
    pub gate: Vec<u8>,
    /// Up rows (k × up_row).
    pub up: Vec<u8>,
    /// Down codes (k × down_col).
    pub down: Vec<u8>,
    cold: Vec<(u32, u32, u32)>,
    buf: Vec<u8>,
}

impl Gathered {
    /// Keeps entries `keep` (ascending positions into the last gather) of
    /// the up rows and down codes, in order.
    pub fn compact(&mut self, keep: &[u32], up_row: usize, down_col: usize) {
        for (new, &old) in keep.iter().enumerate() {
            let old = old as usize;
            if old != new {
                self.up.copy_within(old * up_row..(old + 1) * up_row, new * up_row);
                self.down.copy_within(old * down_col..(old + 1) * down_col, new * down_col);
            }
        }
    }
}

/// The repacked FFN of a model under a memory budget.
pub struct FfnBundle {
    pub path: PathBuf,
    file: Arc<File>,
    h: Header,
    q4: bool,
    bias: i8,
    /// Fused multiply-adds in the AXPY, as `NeuronMajor`'s AVX2 / AVX-512
    /// kernels compute (so the results are bit-identical to the
    /// unbudgeted path on this CPU).
    fma: bool,
    layers: Vec<BundleLayer>,
    cache: Arc<Mutex<ColdCache>>,
    report: BudgetReport,
    totals: Totals,
    /// Whether the model predicts each next layer's neurons and asks for
    /// them ahead ([`FfnBundle::prefetch`]; `SparsityOptions::lookahead`).
    pub lookahead: bool,
    /// Started by the first [`FfnBundle::prefetch`] (`None`: it could not
    /// start).
    prefetcher: OnceLock<Option<LookAhead>>,
}

/// `acc += a · b`, fused when `FMA` (only inside `avx2,fma` code).
#[inline(always)]
fn madd<const FMA: bool>(acc: &mut f32, a: f32, b: f32) {
    if FMA {
        *acc = a.mul_add(b, *acc);
    } else {
        *acc += a * b;
    }
}

impl FfnBundle {
    /// Opens the bundle at `path` (writing it from `src` first if it is
    /// missing or stale), then fills the budget: `fixed_other` bytes that
    /// stay resident anyway (the predictor), the down scales and maps, a
    /// quarter of the rest as cold-cache slots, the remainder as hot
    /// records (highest `freqs` first, across layers). Releases the pages
    /// of mapped `src` matrices afterwards.
    #[allow(clippy::too_many_arguments, reason = "the bundle's shapes and weights, each a plain value")]
    pub fn open_or_build(
        path: &Path,
        fingerprint: &str,
        freqs: &[Vec<f32>],
        src: &[FfnSource],
        dim: usize,
        ffn: usize,
        budget: usize,
        fixed_other: usize,
        policy: impl FnOnce(usize) -> Result<BoxedPolicy>,
    ) -> Result<Self> {
        let want = header_for(fingerprint, freqs, src, dim, ffn)?;
        let fresh = File::open(path).ok().and_then(|f| read_header(&f, path)).is_some_and(|h| h == want);
        if !fresh {
            tracing::info!(path = %path.display(), "writing the FFN bundle (hot/cold repack)");
            write_bundle(path, &want, freqs, src)?;
        }
        for s in src.iter().filter(|s| s.mapped) {
            // SAFETY: as in `write_bundle`: mapped slices of the model file.
            unsafe { release_layer(s) };
        }
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let h = want;
        let (q4, bias) = down_layout(src[0].down.0).expect("checked by header_for");
        let n_layers = h.n_layers;
        // Order and scales of every layer.
        let mut layers = Vec::with_capacity(n_layers);
        let half_scales = if src[0].down.0 == GgmlType::Q4_1 { h.scales / 2 } else { h.scales };
        for l in 0..n_layers {
            let base = (h.data_start + l * h.layer_bytes) as u64;
            let mut head = vec![0u8; 4 * ffn + h.scales];
            read_at(&file, path, &mut head, base)?;
            let mut pos = vec![0u32; ffn];
            for (p, b) in head[..4 * ffn].chunks_exact(4).enumerate() {
                let j = u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize;
                if j >= ffn {
                    return Err(sparsity_err(path, format!("layer {l}: neuron id {j} out of range")));
                }
                pos[j] = p as u32;
            }
            let f16s = |b: &[u8]| -> Vec<f16> {
                b.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()
            };
            let sc = &head[4 * ffn..];
            let d = f16s(&sc[..half_scales]);
            let m = f16s(&sc[half_scales..]);
            layers.push(BundleLayer { pos, hot: 0, hot_data: Vec::new(), d, m });
        }
        let total = n_layers * ffn;
        let maps = n_layers * ffn * 4 * 2 + total * 12;
        let fixed = fixed_other + n_layers * h.scales + maps;
        let floor = fixed + h.record;
        if budget < floor {
            return Err(Error::InvalidArgument(format!(
                "FFN memory budget {:.1} MB is below the {:.1} MB that must stay resident (low-rank predictor, \
                 down-projection scales, maps) plus one neuron",
                budget as f64 / 1e6,
                floor as f64 / 1e6
            )));
        }
        let rest = (budget - fixed) / h.record;
        let (hot_n, slots) = if rest >= total { (total, 0) } else { (rest - rest / 4, rest / 4) };
        // The hottest neurons across layers: (freq desc, layer, id).
        let mut all: Vec<(f32, u32, u32)> = Vec::with_capacity(total);
        for (l, f) in freqs.iter().enumerate() {
            all.extend(f.iter().enumerate().map(|(j, &v)| (v, l as u32, j as u32)));
        }
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for &(_, l, _) in &all[..hot_n] {
            layers[l as usize].hot += 1;
        }
        drop(all);
        for (l, layer) in layers.iter_mut().enumerate() {
            let base = (h.data_start + l * h.layer_bytes + 4 * ffn + h.scales) as u64;
            let mut data = vec![0u8; layer.hot * h.record];
            read_at(&file, path, &mut data, base)?;
            layer.hot_data = data;
        }
        let cache = ColdCache::new(slots, h.record, n_layers, ffn, policy(slots)?);
        let report = BudgetReport {
            budget,
            fixed,
            hot: hot_n * h.record,
            hot_neurons: hot_n,
            cache: slots * h.record,
            cache_slots: slots,
            total_neurons: total,
            record: h.record,
            policy: cache.policy_name(),
        };
        tracing::info!(
            hot = hot_n,
            cache_slots = slots,
            total,
            fixed_mb = fixed as f64 / 1e6,
            "FFN under a memory budget"
        );
        let fma = AxpyIsa::select(&CpuFeatures::detect()) != AxpyIsa::Scalar;
        Ok(Self {
            path: path.to_path_buf(),
            file: Arc::new(file),
            h,
            q4,
            bias,
            fma,
            layers,
            cache: Arc::new(Mutex::new(cache)),
            report,
            totals: Totals::default(),
            lookahead: false,
            prefetcher: OnceLock::new(),
        })
    }

    pub fn report(&self) -> &BudgetReport {
        &self.report
    }

    /// Bytes of gate row, up row and down codes in a record.
    pub fn row_sizes(&self) -> (usize, usize, usize) {
        (self.h.gate_row, self.h.up_row, self.h.down_col)
    }

    /// Resident bytes the budget pays for.
    pub fn resident_bytes(&self) -> usize {
        self.report.fixed + self.report.hot + self.report.cache
    }

    /// Engine-wide cold-path totals (all sessions so far).
    pub fn totals(&self) -> CacheCounters {
        let t = &self.totals;
        CacheCounters {
            hot: t.hot.load(Ordering::Relaxed),
            hits: t.hits.load(Ordering::Relaxed),
            misses: t.misses.load(Ordering::Relaxed),
            bytes_read: t.bytes_read.load(Ordering::Relaxed),
            reads: t.reads.load(Ordering::Relaxed),
        }
    }

    /// File offset of layer `l`'s first record.
    fn records_at(&self, l: usize) -> u64 {
        (self.h.data_start + l * self.h.layer_bytes + 4 * self.h.ffn_dim + self.h.scales) as u64
    }

    /// Gathers the records of neurons `idx` of layer `l` into `g` (gate
    /// rows, up rows and down codes, in `idx` order): hot ones from RAM,
    /// cold ones from the cache or the file.
    pub fn gather(&self, l: usize, idx: &[u32], g: &mut Gathered, c: &mut CacheCounters) -> Result<()> {
        let (gr, ur, dc, rec) = (self.h.gate_row, self.h.up_row, self.h.down_col, self.h.record);
        let k = idx.len();
        g.gate.resize(k * gr, 0);
        g.up.resize(k * ur, 0);
        g.down.resize(k * dc, 0);
        let layer = &self.layers[l];
        g.cold.clear();
        let put = |g: &mut Gathered, kk: usize, r: &[u8]| {
            g.gate[kk * gr..(kk + 1) * gr].copy_from_slice(&r[..gr]);
            g.up[kk * ur..(kk + 1) * ur].copy_from_slice(&r[gr..gr + ur]);
            g.down[kk * dc..(kk + 1) * dc].copy_from_slice(&r[gr + ur..rec]);
        };
        let mut hot = 0u64;
        for (kk, &j) in idx.iter().enumerate() {
            let p = layer.pos[j as usize] as usize;
            if p < layer.hot {
                put(g, kk, &layer.hot_data[p * rec..(p + 1) * rec]);
                hot += 1;
            } else {
                g.cold.push((p as u32, kk as u32, j));
            }
        }
        let (mut hits, mut misses, mut bytes, mut reads) = (0u64, 0u64, 0u64, 0u64);
        if !g.cold.is_empty() {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let mut cold = std::mem::take(&mut g.cold);
            // Hits first; misses stay in `cold`.
            cold.retain(|&(_, kk, j)| match cache.lookup(NeuronId { layer: l as u32, index: j }) {
                Some(r) => {
                    put(g, kk as usize, r);
                    hits += 1;
                    false
                }
                None => true,
            });
            // Then what the look-ahead read for this layer.
            hits += self.take_staged(l, &mut cold, &mut cache, |kk, r| put(g, kk, r));
            misses = cold.len() as u64;
            cold.sort_unstable();
            let base = self.records_at(l);
            let mut i = 0;
            while i < cold.len() {
                let p0 = cold[i].0;
                let e = run_end(&cold, i, |c| c.0);
                let n = (cold[e - 1].0 - p0 + 1) as usize;
                g.buf.resize(n * rec, 0);
                read_at(&self.file, &self.path, &mut g.buf[..n * rec], base + p0 as u64 * rec as u64)?;
                bytes += (n * rec) as u64;
                reads += 1;
                let buf = std::mem::take(&mut g.buf);
                for &(p, kk, j) in &cold[i..e] {
                    let r = &buf[(p - p0) as usize * rec..][..rec];
                    put(g, kk as usize, r);
                    cache.insert(NeuronId { layer: l as u32, index: j }, r);
                }
                g.buf = buf;
                i = e;
            }
            cold.clear();
            g.cold = cold;
        }
        c.hot += hot;
        c.hits += hits;
        c.misses += misses;
        c.bytes_read += bytes;
        c.reads += reads;
        let t = &self.totals;
        t.hot.fetch_add(hot, Ordering::Relaxed);
        t.hits.fetch_add(hits, Ordering::Relaxed);
        t.misses.fetch_add(misses, Ordering::Relaxed);
        t.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        t.reads.fetch_add(reads, Ordering::Relaxed);
        Ok(())
    }

    /// `out = Σ_k coef[k] · W_down[:, idx[k]]` for layer `l`, from the down
    /// codes `codes` gathered for `idx` (ascending): the arithmetic of
    /// `NeuronMajor::axpy` on this CPU (per block `S = Σ coef·q`,
    /// `H = Σ coef`, then `acc += d·S + m·H`; fused multiply-adds where its
    /// AVX2 / AVX-512 kernels use them), so the same bits.
    ///
    /// With [`AxpyMode::Int8`] on a CPU where `NeuronMajor::axpy_fast` is
    /// the integer AXPY, the coefficients are quantised as it quantises
    /// them ([`QuantisedCoefs`]) and the result is its bits instead; that
    /// quantisation refuses `idx` not strictly ascending (an error).
    #[allow(clippy::too_many_arguments, reason = "the AXPY's inputs, as NeuronMajor's")]
    pub fn axpy(
        &self,
        pool: &ThreadPool,
        l: usize,
        idx: &[u32],
        codes: &[u8],
        coef: &[f32],
        out: &mut [f32],
        mode: AxpyMode,
    ) -> Result<()> {
        let dim = self.h.dim;
        debug_assert!(out.len() == dim && coef.len() == idx.len() && codes.len() >= idx.len() * self.h.down_col);
        let units = if self.q4 { dim / 2 } else { dim };
        let ptr = SyncPtr::new(out.as_mut_ptr());
        let int8 = if mode == AxpyMode::Int8 && NeuronMajor::axpy_fast_is_int8() {
            Some(QuantisedCoefs::new(idx, coef)?)
        } else {
            None
        };
        let run = |r: std::ops::Range<usize>| {
            #[cfg(target_arch = "x86_64")]
            if let Some(qc) = &int8 {
                // SAFETY: `axpy_fast_is_int8` found AVX-512 (and so FMA).
                unsafe { self.axpy_range_int8(l, r, qc, codes, ptr) };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if self.fma {
                // SAFETY: `fma` is set only when `AxpyIsa::select` found
                // AVX2 and FMA on this CPU.
                unsafe { self.axpy_range_fma(l, r, idx, codes, coef, ptr) };
                return;
            }
            self.axpy_range::<false>(l, r, idx, codes, coef, ptr);
        };
        if pool.n_threads() == 1 || idx.len() * dim < PAR_MACS {
            run(0..units);
        } else {
            pool.broadcast(&|ti, nt| {
                let r = chunk(units, ti, nt);
                if !r.is_empty() {
                    run(r);
                }
            });
        }
        Ok(())
    }

    /// The integer AXPY over outputs `r` (as [`Self::axpy_range`]): per run
    /// of `qc`, exact integer sums of both coefficient planes, then per
    /// output `acc = fma(d, fma(T, 1/128, S) · scale, acc)` and `acc =
    /// fma(m, h, acc)`, one `acc` for the runs before `qc.split` and one for
    /// the rest, added at the end: `NeuronMajor::axpy_fast_scalar`'s
    /// arithmetic.
    ///
    /// # Safety
    /// The CPU has FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_range_int8(
        &self,
        l: usize,
        r: std::ops::Range<usize>,
        qc: &QuantisedCoefs,
        codes: &[u8],
        out: SyncPtr<f32>,
    ) {
        let (dim, dc) = (self.h.dim, self.h.down_col);
        let layer = &self.layers[l];
        let planes = if self.q4 { 2 } else { 1 };
        let mut a = r.start;
        while a < r.end {
            let w = TILE.min(r.end - a);
            // Per half of the runs (`qc.split`), per output plane.
            let mut acc = [[[0f32; TILE]; 2]; 2];
            for (k, run) in qc.runs.iter().enumerate() {
                let h = usize::from(k >= qc.split);
                // Per output plane: Σ c8·q and Σ r8·q.
                let mut s = [[0i32; TILE]; 2];
                let mut t = [[0i32; TILE]; 2];
                for k in run.start..run.start + run.len {
                    let (c, rc) = (i32::from(qc.c8[k]), i32::from(qc.r8[k]));
                    let row = &codes[k * dc + a..][..w];
                    for (j, &v) in row.iter().enumerate() {
                        if self.q4 {
                            let (lo, hi) =
                                (i32::from((v & 0x0F) as i8 - self.bias), i32::from((v >> 4) as i8 - self.bias));
                            s[0][j] += c * lo;
                            t[0][j] += rc * lo;
                            s[1][j] += c * hi;
                            t[1][j] += rc * hi;
                        } else {
                            let q = i32::from(v as i8);
                            s[0][j] += c * q;
                            t[0][j] += rc * q;
                        }
                    }
                }
                for p in 0..planes {
                    let o = run.block * dim + a + p * (dim / 2);
                    for j in 0..w {
                        let f = (t[p][j] as f32).mul_add(1.0 / 128.0, s[p][j] as f32);
                        let mut x = layer.d[o + j].to_f32().mul_add(f * run.scale, acc[h][p][j]);
                        if !layer.m.is_empty() {
                            x = layer.m[o + j].to_f32().mul_add(run.h, x);
                        }
                        acc[h][p][j] = x;
                    }
                }
            }
            let [mut sum, second] = acc;
            for (s, t) in sum.iter_mut().flatten().zip(second.iter().flatten()) {
                *s += t;
            }
            self.store(a, w, planes, &sum, out);
            a += w;
        }
    }

    /// Writes the accumulators of outputs `a .. a + w` (and `+ dim/2` for
    /// 4-bit types) to `out`.
    fn store(&self, a: usize, w: usize, planes: usize, acc: &[[f32; TILE]; 2], out: SyncPtr<f32>) {
        let half = self.h.dim / 2;
        for (p, acc) in acc.iter().enumerate().take(planes) {
            // SAFETY: callers hand disjoint ranges `r` within
            // `0..units` (`dim/2` for 4-bit types, else `dim`); the
            // outputs written, `a + p·dim/2 .. + w`, are inside the
            // `dim` floats behind `out`, which outlive the call, and no
            // other thread writes them.
            let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(a + p * half), w) };
            o.copy_from_slice(&acc[..w]);
        }
    }

    /// [`Self::axpy_range`] with fused multiply-adds.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_range_fma(
        &self,
        l: usize,
        r: std::ops::Range<usize>,
        idx: &[u32],
        codes: &[u8],
        coef: &[f32],
        out: SyncPtr<f32>,
    ) {
        self.axpy_range::<true>(l, r, idx, codes, coef, out);
    }

    #[inline(always)]
    fn axpy_range<const FMA: bool>(
        &self,
        l: usize,
        r: std::ops::Range<usize>,
        idx: &[u32],
        codes: &[u8],
        coef: &[f32],
        out: SyncPtr<f32>,
    ) {
        let (dim, dc) = (self.h.dim, self.h.down_col);
        let layer = &self.layers[l];
        let half = dim / 2;
        let planes = if self.q4 { 2 } else { 1 };
        let mut a = r.start;
        while a < r.end {
            let w = TILE.min(r.end - a);
            let mut acc = [[0f32; TILE]; 2];
            let mut s = [[0f32; TILE]; 2];
            let mut dv = [[0f32; TILE]; 2];
            let mut mv = [[0f32; TILE]; 2];
            let mut k = 0;
            while k < idx.len() {
                let b = idx[k] as usize / QK;
                for p in s.iter_mut().take(planes) {
                    p[..w].fill(0.0);
                }
                let mut hsum = 0.0f32;
                while k < idx.len() && idx[k] as usize / QK == b {
                    let c = coef[k];
                    hsum += c;
                    let row = &codes[k * dc + a..][..w];
                    if self.q4 {
                        let bias = self.bias;
                        let (lo, hi) = s.split_at_mut(1);
                        for ((sl, sh), &v) in lo[0][..w].iter_mut().zip(&mut hi[0][..w]).zip(row) {
                            madd::<FMA>(sl, c, f32::from((v & 0x0F) as i8 - bias));
                            madd::<FMA>(sh, c, f32::from((v >> 4) as i8 - bias));
                        }
                    } else {
                        for (sv, &v) in s[0][..w].iter_mut().zip(row) {
                            madd::<FMA>(sv, c, f32::from(v as i8));
                        }
                    }
                    k += 1;
                }
                for p in 0..planes {
                    let o = b * dim + a + p * half;
                    layer.d[o..o + w].convert_to_f32_slice(&mut dv[p][..w]);
                    if layer.m.is_empty() {
                        for ((acc, &s), &d) in acc[p][..w].iter_mut().zip(&s[p][..w]).zip(&dv[p][..w]) {
                            madd::<FMA>(acc, d, s);
                        }
                    } else {
                        layer.m[o..o + w].convert_to_f32_slice(&mut mv[p][..w]);
                        for (((acc, &s), &d), &m) in
                            acc[p][..w].iter_mut().zip(&s[p][..w]).zip(&dv[p][..w]).zip(&mv[p][..w])
                        {
                            if FMA {
                                *acc = m.mul_add(hsum, d.mul_add(s, *acc));
                            } else {
                                *acc += d * s + m * hsum;
                            }
                        }
                    }
                }
            }
            self.store(a, w, planes, &acc, out);
            a += w;
        }
    }
}

#[cfg(test)]
mod tests {
    use spinfer_sparse_kernels::NeuronMajor;

    use super::*;
    use crate::cache::{CachePolicyKind, policy};

    /// Random blocks of `ty` with finite scales (the kernels' generator).
    fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
        spinfer_kernels::random::weights(&mut rng, ty, rows, cols)
    }

    fn check(ty: GgmlType, budget_records: Option<usize>) {
        let (dim, ffn, layers) = (256, 288, 2);
        let mats: Vec<_> = (0..layers)
            .map(|l| {
                let s = 1 + l as u64 * 3;
                (random_matrix(ty, ffn, dim, s), random_matrix(ty, ffn, dim, s + 1), random_matrix(ty, dim, ffn, s + 2))
            })
            .collect();
        let src: Vec<_> = mats
            .iter()
            .map(|(g, u, d)| FfnSource { gate: (ty, g), up: (ty, u), down: (ty, d), mapped: false })
            .collect();
        let freqs: Vec<Vec<f32>> =
            (0..layers).map(|l| (0..ffn).map(|j| ((j * 7 + l * 5) % 11) as f32 / 10.0).collect()).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.spinfer.ffn");
        let open = |budget| {
            let priors = freqs.clone();
            FfnBundle::open_or_build(&path, "fp", &freqs, &src, dim, ffn, budget, 0, move |slots| {
                Ok(policy(CachePolicyKind::FreqLru, slots, priors))
            })
            .unwrap()
        };
        let probe = open(usize::MAX / 2);
        let rec = probe.report().record;
        let fixed = probe.report().fixed;
        let b = match budget_records {
            Some(n) => open(fixed + n * rec),
            None => probe,
        };
        let pool = ThreadPool::new(2);
        let (gr, ur, _) = b.row_sizes();
        let mut g = Gathered::default();
        let mut c = CacheCounters::default();
        for round in 0..3 {
            for (l, (gate, up, down)) in mats.iter().enumerate() {
                let idx: Vec<u32> = (0..ffn as u32).filter(|j| !(j + round + l as u32).is_multiple_of(3)).collect();
                b.gather(l, &idx, &mut g, &mut c).unwrap();
                for (k, &j) in idx.iter().enumerate() {
                    let j = j as usize;
                    assert_eq!(&g.gate[k * gr..(k + 1) * gr], &gate[j * gr..(j + 1) * gr]);
                    assert_eq!(&g.up[k * ur..(k + 1) * ur], &up[j * ur..(j + 1) * ur]);
                }
                let coef: Vec<f32> = idx.iter().map(|&j| (j as f32 * 0.37).sin()).collect();
                let nm = NeuronMajor::from_weights(ty, down, dim, ffn).unwrap();
                let mut want = vec![0f32; dim];
                if b.fma {
                    nm.axpy(&pool, &idx, &coef, &mut want).unwrap();
                } else {
                    nm.axpy_scalar(&idx, &coef, &mut want).unwrap();
                }
                let mut got = vec![1f32; dim];
                b.axpy(&pool, l, &idx, &g.down, &coef, &mut got, AxpyMode::Exact).unwrap();
                assert_eq!(got, want, "{ty} layer {l}");
                // The integer AXPY: NeuronMajor's bits (its f32 AXPY when the
                // CPU has no integer one).
                let mut want = vec![0f32; dim];
                nm.axpy_fast(&pool, &idx, &coef, &mut want).unwrap();
                let mut got = vec![1f32; dim];
                b.axpy(&pool, l, &idx, &g.down, &coef, &mut got, AxpyMode::Int8).unwrap();
                if NeuronMajor::axpy_fast_is_int8() {
                    assert_eq!(got, want, "{ty} layer {l}, integer AXPY");
                }
            }
        }
        if budget_records.is_some() {
            assert!(c.misses > 0 && c.bytes_read > 0, "{c:?}");
        } else {
            assert_eq!((c.hits, c.misses), (0, 0));
        }
    }

    #[test]
    fn bundled_records_and_axpy_equal_the_model_matrices() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            check(ty, None);
            check(ty, Some(40));
        }
    }

    #[test]
    fn a_budget_below_the_fixed_part_is_refused() {
        let ty = GgmlType::Q4_1;
        let (g, u, d) = (random_matrix(ty, 32, 32, 1), random_matrix(ty, 32, 32, 2), random_matrix(ty, 32, 32, 3));
        let src = [FfnSource { gate: (ty, &g), up: (ty, &u), down: (ty, &d), mapped: false }];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.ffn");
        let e = FfnBundle::open_or_build(&path, "fp", &[vec![0.5; 32]], &src, 32, 32, 100, 0, |_| {
            Ok(policy(CachePolicyKind::Lru, 0, Vec::new()))
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("budget"), "{e}");
    }
}
