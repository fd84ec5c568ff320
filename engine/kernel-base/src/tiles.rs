//! AMX tile state for the kernels that run on the tiles (the int8 paths
//! of the matmuls, the packed bf16 GEMM): a configuration loaded on the
//! calling thread, released when its guard drops; and the int8 tile
//! products the matmuls share.

use std::arch::asm;
use std::marker::PhantomData;

/// A tile configuration (palette 1) loaded on this thread; dropping it
/// releases the tile state. Not `Send`: the state belongs to the thread
/// that configured it.
pub struct Tiles {
    _thread: PhantomData<*const ()>,
}

/// The 64-byte `ldtilecfg` operand.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Tiles {
    /// Configures tile registers `tmm0..` as `tiles`, each `(bytes per
    /// row, rows)`; the others are off.
    ///
    /// # Safety
    /// The OS must have granted this process the tile data
    /// ([`crate::cpu::CpuFeatures::amx_bf16`] or
    /// [`amx_int8`](crate::cpu::CpuFeatures::amx_int8)); at most 8 tiles
    /// of at most 64 bytes × 16 rows.
    pub unsafe fn configure(tiles: &[(u16, u8)]) -> Self {
        debug_assert!(tiles.len() <= 8 && tiles.iter().all(|&(b, r)| b <= 64 && r <= 16));
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for (t, &(colsb, rows)) in tiles.iter().enumerate() {
            c.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c.0[48 + t] = rows;
        }
        // SAFETY: a valid palette-1 configuration (the caller's bounds);
        // the OS granted the tile data (the caller's contract).
        unsafe { asm!("ldtilecfg [{0}]", in(reg) c.0.as_ptr(), options(nostack)) };
        Self { _thread: PhantomData }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: this thread configured the tiles (`configure`; the guard
        // cannot leave the thread).
        unsafe { asm!("tilerelease", options(nostack)) };
    }
}

/// Two int8 tile products, `C0 = A0 · B0` and `C1 = A1 · B1`
/// (`tdpbssd`: signed bytes, exact int32 sums), each stored to `c[i]`
/// (`ldc` bytes per row). The loaded configuration's tmm0/1 hold the
/// sums, tmm2/3 the `A` operands (`lda` bytes apart per row), tmm4/5 the
/// `B` operands (`ldb`).
///
/// # Safety
/// This thread must have loaded a configuration of those six tiles
/// ([`Tiles::configure`]); each operand must be readable and each `c[i]`
/// writable for the configured rows with its stride.
#[inline]
pub unsafe fn dpbssd_pair(a: [*const u8; 2], lda: usize, b: [*const u8; 2], ldb: usize, c: [*mut u8; 2], ldc: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tileloadd tmm2, [{a0} + {lda}*1]",
            "tileloadd tmm4, [{b0} + {ldb}*1]",
            "tileloadd tmm3, [{a1} + {lda}*1]",
            "tileloadd tmm5, [{b1} + {ldb}*1]",
            "tdpbssd tmm0, tmm2, tmm4",
            "tdpbssd tmm1, tmm3, tmm5",
            "tilestored [{c0} + {ldc}*1], tmm0",
            "tilestored [{c1} + {ldc}*1], tmm1",
            a0 = in(reg) a[0], a1 = in(reg) a[1], lda = in(reg) lda,
            b0 = in(reg) b[0], b1 = in(reg) b[1], ldb = in(reg) ldb,
            c0 = in(reg) c[0], c1 = in(reg) c[1], ldc = in(reg) ldc,
            options(nostack),
        );
    }
}

/// One int8 tile product, `C0 = A0 · B0`, as [`dpbssd_pair`] (tmm0, tmm2,
/// tmm4).
///
/// # Safety
/// As for [`dpbssd_pair`], for the one product.
#[inline]
pub unsafe fn dpbssd(a: *const u8, lda: usize, b: *const u8, ldb: usize, c: *mut u8, ldc: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tileloadd tmm2, [{a0} + {lda}*1]",
            "tileloadd tmm4, [{b0} + {ldb}*1]",
            "tdpbssd tmm0, tmm2, tmm4",
            "tilestored [{c0} + {ldc}*1], tmm0",
            a0 = in(reg) a, lda = in(reg) lda,
            b0 = in(reg) b, ldb = in(reg) ldb,
            c0 = in(reg) c, ldc = in(reg) ldc,
            options(nostack),
        );
    }
}
