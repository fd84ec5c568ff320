//! AMX tile state for the kernels that run on the tiles (the int8 prompt
//! path of the matmuls, the packed bf16 GEMM): a configuration loaded on
//! the calling thread, released when its guard drops.

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
