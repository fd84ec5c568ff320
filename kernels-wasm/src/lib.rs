//! spinfer's reference WebAssembly kernel pack.
//!
//! Precise-mode matmuls (f32 activations, weights dequantised on the fly)
//! for F32, Q4_1 and Q8_0 weights, written with `core::arch::wasm32`
//! simd128. The module is loaded by the engine's `WasmPack` and runs inside
//! wasmtime's sandbox; everything it touches is its own linear memory.
//!
//! # ABI (version [`ABI_VERSION`])
//!
//! All pointers are offsets into the module's linear memory, all integers
//! `u32` (wasm `i32`).
//!
//! * `spinfer_abi_version() -> u32`: the ABI this module implements; the
//!   host refuses a module whose version differs from its own.
//! * `alloc(bytes) -> ptr`: a 16-byte aligned region of `bytes` bytes, or 0
//!   when memory cannot grow. A bump allocator over `memory.grow`; nothing
//!   is ever freed (the host allocates its weight and I/O buffers once and
//!   reuses them).
//! * `spinfer_kernel_count() -> u32` and `spinfer_kernel_wtype(i) -> u32`:
//!   the kernel table, as GGML type ids of the weights served (activations
//!   are always f32). Kernel `i` is exported as `matmul_<name>_f32`.
//! * `matmul_<w>_f32(w_ptr, rows, cols, x_ptr, n_tokens, out_ptr) -> i32`:
//!   `out[t * rows + r] = dot(W[r, :], x[t * cols .. (t + 1) * cols])`, `W`
//!   row-major in GGML's block layout. Returns 0, or a negative status when
//!   `cols` is not a whole number of blocks ([`STATUS_BAD_SHAPE`]).
//!
//! Summation follows the engine's scalar precise kernel: eight lanes per
//! row (element `i` in lane `i % 8`), reduced as
//! `((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7))`. wasm simd128 has no
//! fused multiply-add, so products are rounded before the add; results agree
//! with the engine to about 1e-6 relative.
#![no_std]

use core::arch::wasm32::{
    f32x4, f32x4_add, f32x4_convert_i32x4, f32x4_convert_u32x4, f32x4_extract_lane, f32x4_mul, f32x4_splat,
    i16x8_extend_high_i8x16, i16x8_extend_low_i8x16, i32x4_extend_high_i16x8, i32x4_extend_low_i16x8, u8x16_shr,
    u8x16_splat, u16x8_extend_high_u8x16, u16x8_extend_low_u8x16, u32x4_extend_high_u16x8, u32x4_extend_low_u16x8,
    v128, v128_and, v128_load,
};
use core::sync::atomic::{AtomicUsize, Ordering};

/// The kernel ABI this module implements (`abi_version` in `pack.toml`).
pub const ABI_VERSION: u32 = 1;

/// Status returned when `cols` is not a multiple of the weight's block size.
pub const STATUS_BAD_SHAPE: i32 = -1;

/// GGML type ids of the weights served, in table order.
const KERNELS: [u32; 3] = [GGML_F32, GGML_Q4_1, GGML_Q8_0];
const GGML_F32: u32 = 0;
const GGML_Q4_1: u32 = 3;
const GGML_Q8_0: u32 = 8;

/// Elements per block of the legacy formats.
const QK: usize = 32;
/// Bytes per Q4_1 block: f16 d, f16 m, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;
/// Bytes per Q8_0 block: f16 d, 32 signed bytes.
const Q8_0_BYTES: usize = 34;
/// Tokens computed per pass over a weight row (each block is dequantised
/// once per group).
const TOKEN_GROUP: usize = 4;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

#[unsafe(no_mangle)]
pub extern "C" fn spinfer_abi_version() -> u32 {
    ABI_VERSION
}

#[unsafe(no_mangle)]
pub extern "C" fn spinfer_kernel_count() -> u32 {
    KERNELS.len() as u32
}

/// GGML type id of kernel `i`'s weights, or `u32::MAX` past the end.
#[unsafe(no_mangle)]
pub extern "C" fn spinfer_kernel_wtype(i: u32) -> u32 {
    KERNELS.get(i as usize).copied().unwrap_or(u32::MAX)
}

const PAGE: usize = 65536;
/// Next free byte; 0 until the first allocation.
static NEXT: AtomicUsize = AtomicUsize::new(0);
/// End of the memory owned by the allocator.
static END: AtomicUsize = AtomicUsize::new(0);

/// A 16-byte aligned region of `bytes` bytes, or 0 if memory cannot grow.
/// The allocator owns only pages it grew itself, so the data segment and
/// the stack are never handed out.
#[unsafe(no_mangle)]
pub extern "C" fn alloc(bytes: u32) -> u32 {
    let mut next = NEXT.load(Ordering::Relaxed);
    let mut end = END.load(Ordering::Relaxed);
    if next == 0 {
        next = core::arch::wasm32::memory_size(0) * PAGE;
        end = next;
    }
    let start = (next + 15) & !15;
    let Some(stop) = start.checked_add(bytes as usize) else { return 0 };
    if stop > end {
        let pages = (stop - end).div_ceil(PAGE);
        if core::arch::wasm32::memory_grow(0, pages) == usize::MAX {
            return 0;
        }
        end += pages * PAGE;
    }
    NEXT.store(stop, Ordering::Relaxed);
    END.store(end, Ordering::Relaxed);
    start as u32
}

/// Converts IEEE half-precision bits to f32 (exact, subnormals included).
#[inline]
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: value = man * 2^-24, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// Reads a little-endian f16 at `p` as f32.
///
/// # Safety
/// `p .. p + 2` must be readable.
#[inline]
unsafe fn read_f16(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes.
    let b = unsafe { [*p, *p.add(1)] };
    f16_to_f32(u16::from_le_bytes(b))
}

/// Loads 4 f32 at `p` (no alignment needed).
///
/// # Safety
/// `p .. p + 4` must be readable.
#[inline]
unsafe fn load4(p: *const f32) -> v128 {
    // SAFETY: the caller guarantees 16 readable bytes; wasm loads need no
    // alignment.
    unsafe { v128_load(p.cast()) }
}

#[inline]
fn mul_add(a: v128, b: v128, acc: v128) -> v128 {
    f32x4_add(acc, f32x4_mul(a, b))
}

/// `((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7))` of lanes 0..4 in `a`
/// and 4..8 in `b`, the engine's reduction order.
#[inline]
fn reduce(a: v128, b: v128) -> f32 {
    let s = f32x4_add(a, b);
    (f32x4_extract_lane::<0>(s) + f32x4_extract_lane::<1>(s))
        + (f32x4_extract_lane::<2>(s) + f32x4_extract_lane::<3>(s))
}

/// Shared driver for the block formats: for each row and group of up to
/// [`TOKEN_GROUP`] tokens, dequantises each block once (`deq` writes 32
/// weights as 8 vectors) and accumulates it against every token of the
/// group.
///
/// # Safety
/// `w` must hold `rows * (cols / QK) * block_bytes` readable bytes, `x`
/// `n_tokens * cols` readable f32 and `out` `n_tokens * rows` writable f32;
/// `cols` must be a multiple of [`QK`].
#[allow(clippy::too_many_arguments, reason = "the six ABI operands plus the block format")]
#[inline(always)]
unsafe fn blocks_matmul(
    w: *const u8,
    rows: usize,
    cols: usize,
    x: *const f32,
    n_tokens: usize,
    out: *mut f32,
    block_bytes: usize,
    deq: impl Fn(*const u8) -> [v128; 8],
) {
    let nb = cols / QK;
    for r in 0..rows {
        // SAFETY: row `r` lies inside `w` (caller contract).
        let row = unsafe { w.add(r * nb * block_bytes) };
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(TOKEN_GROUP);
            let zero = f32x4_splat(0.0);
            let mut acc = [[zero; 2]; TOKEN_GROUP];
            for b in 0..nb {
                // SAFETY: block `b` of the row lies inside `w`.
                let wv = deq(unsafe { row.add(b * block_bytes) });
                for (k, acc) in acc.iter_mut().enumerate().take(nt) {
                    // SAFETY: token `t0 + k < n_tokens`, element
                    // `b * QK + 31 < cols`: inside `x`.
                    let xb = unsafe { x.add((t0 + k) * cols + b * QK) };
                    for (i, wi) in wv.iter().enumerate() {
                        // SAFETY: `i * 4 + 3 < QK`: inside the block's span of `x`.
                        let xv = unsafe { load4(xb.add(i * 4)) };
                        acc[i % 2] = mul_add(*wi, xv, acc[i % 2]);
                    }
                }
            }
            for (k, acc) in acc.iter().enumerate().take(nt) {
                // SAFETY: `(t0 + k) * rows + r < n_tokens * rows`: inside `out`.
                unsafe { *out.add((t0 + k) * rows + r) = reduce(acc[0], acc[1]) };
            }
            t0 += nt;
        }
    }
}

/// Dequantises one Q4_1 block (`x = q * d + m`; low nibbles are elements
/// 0..16, high nibbles 16..32).
///
/// # Safety
/// `p .. p + 20` must be readable.
#[inline(always)]
unsafe fn deq_q4_1(p: *const u8) -> [v128; 8] {
    // SAFETY: 20 readable bytes: d at 0, m at 2, qs at 4..20.
    let (d, m, qs) = unsafe { (read_f16(p), read_f16(p.add(2)), v128_load(p.add(4).cast())) };
    let d = f32x4_splat(d);
    let m = f32x4_splat(m);
    let lo = v128_and(qs, u8x16_splat(0x0f));
    let hi = u8x16_shr(qs, 4);
    let cvt = |q: v128| -> [v128; 4] {
        let l = u16x8_extend_low_u8x16(q);
        let h = u16x8_extend_high_u8x16(q);
        [
            f32x4_convert_u32x4(u32x4_extend_low_u16x8(l)),
            f32x4_convert_u32x4(u32x4_extend_high_u16x8(l)),
            f32x4_convert_u32x4(u32x4_extend_low_u16x8(h)),
            f32x4_convert_u32x4(u32x4_extend_high_u16x8(h)),
        ]
    };
    let [a, b, c, e] = cvt(lo);
    let [f, g, h, i] = cvt(hi);
    [a, b, c, e, f, g, h, i].map(|q| f32x4_add(f32x4_mul(q, d), m))
}

/// Dequantises one Q8_0 block (`x = q * d`).
///
/// # Safety
/// `p .. p + 34` must be readable.
#[inline(always)]
unsafe fn deq_q8_0(p: *const u8) -> [v128; 8] {
    // SAFETY: 34 readable bytes: d at 0, qs at 2..34.
    let (d, q0, q1) = unsafe { (read_f16(p), v128_load(p.add(2).cast()), v128_load(p.add(18).cast())) };
    let d = f32x4_splat(d);
    let cvt = |q: v128| -> [v128; 4] {
        let l = i16x8_extend_low_i8x16(q);
        let h = i16x8_extend_high_i8x16(q);
        [
            f32x4_convert_i32x4(i32x4_extend_low_i16x8(l)),
            f32x4_convert_i32x4(i32x4_extend_high_i16x8(l)),
            f32x4_convert_i32x4(i32x4_extend_low_i16x8(h)),
            f32x4_convert_i32x4(i32x4_extend_high_i16x8(h)),
        ]
    };
    let [a, b, c, e] = cvt(q0);
    let [f, g, h, i] = cvt(q1);
    [a, b, c, e, f, g, h, i].map(|q| f32x4_mul(q, d))
}

/// Q4_1 weights, f32 activations.
///
/// # Safety
/// The buffers must hold the sizes implied by `rows`, `cols` and
/// `n_tokens` (see the crate docs). Inside wasm an out-of-range access traps
/// rather than corrupting the host.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn matmul_q4_1_f32(
    w: *const u8,
    rows: u32,
    cols: u32,
    x: *const f32,
    n_tokens: u32,
    out: *mut f32,
) -> i32 {
    if !(cols as usize).is_multiple_of(QK) {
        return STATUS_BAD_SHAPE;
    }
    // SAFETY: the caller's contract; `cols` is a whole number of blocks.
    unsafe {
        blocks_matmul(w, rows as usize, cols as usize, x, n_tokens as usize, out, Q4_1_BYTES, |p| deq_q4_1(p));
    }
    0
}

/// Q8_0 weights, f32 activations.
///
/// # Safety
/// As [`matmul_q4_1_f32`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn matmul_q8_0_f32(
    w: *const u8,
    rows: u32,
    cols: u32,
    x: *const f32,
    n_tokens: u32,
    out: *mut f32,
) -> i32 {
    if !(cols as usize).is_multiple_of(QK) {
        return STATUS_BAD_SHAPE;
    }
    // SAFETY: the caller's contract; `cols` is a whole number of blocks.
    unsafe {
        blocks_matmul(w, rows as usize, cols as usize, x, n_tokens as usize, out, Q8_0_BYTES, |p| deq_q8_0(p));
    }
    0
}

/// F32 weights, f32 activations (any `cols`).
///
/// # Safety
/// As [`matmul_q4_1_f32`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn matmul_f32_f32(
    w: *const u8,
    rows: u32,
    cols: u32,
    x: *const f32,
    n_tokens: u32,
    out: *mut f32,
) -> i32 {
    let (rows, cols, n_tokens) = (rows as usize, cols as usize, n_tokens as usize);
    let w = w.cast::<f32>();
    let body = cols - cols % 8;
    for r in 0..rows {
        // SAFETY: row `r` lies inside `w` (caller contract).
        let wr = unsafe { w.add(r * cols) };
        for t in 0..n_tokens {
            // SAFETY: token `t` lies inside `x`.
            let xt = unsafe { x.add(t * cols) };
            let mut acc = [f32x4(0.0, 0.0, 0.0, 0.0); 2];
            let mut c = 0;
            while c < body {
                // SAFETY: `c + 7 < cols`: inside the row and the token.
                unsafe {
                    acc[0] = mul_add(load4(wr.add(c)), load4(xt.add(c)), acc[0]);
                    acc[1] = mul_add(load4(wr.add(c + 4)), load4(xt.add(c + 4)), acc[1]);
                }
                c += 8;
            }
            // The tail goes to lanes 0.., as in the engine's kernel.
            let mut tail = [0.0f32; 8];
            for (i, lane) in tail.iter_mut().enumerate().take(cols - body) {
                // SAFETY: `body + i < cols`.
                *lane = unsafe { *wr.add(body + i) * *xt.add(body + i) };
            }
            // SAFETY: `tail` holds 8 f32.
            let (t0, t1) = unsafe { (load4(tail.as_ptr()), load4(tail.as_ptr().add(4))) };
            acc[0] = f32x4_add(acc[0], t0);
            acc[1] = f32x4_add(acc[1], t1);
            // SAFETY: `t * rows + r < n_tokens * rows`: inside `out`.
            unsafe { *out.add(t * rows + r) = reduce(acc[0], acc[1]) };
        }
    }
    0
}
