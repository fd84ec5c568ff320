//! The cold side of a hybrid CPU/GPU FFN (PowerInfer's split): the neuron
//! groups that [`crate::placement::plan`] left on the CPU, as copies of
//! their gate and up rows and of the down projection's column blocks, run
//! by the CPU engine's matmul kernels on f32 activations (its precise
//! mode). The hot side is in `model.rs`, on the GPU's kernels.

use spinfer_formats::{FfnAct, Loader, ModelConfig};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::vec;

use crate::placement::GroupCost;
use crate::{GpuError, Result};

/// A matrix in host memory and the CPU kernel that multiplies it.
pub(crate) struct CpuMatrix {
    bytes: Vec<u8>,
    kernel: Box<dyn MatmulKernel>,
}

impl CpuMatrix {
    /// `rows x cols` weights of `ty` (`bytes` exactly that matrix).
    pub(crate) fn new(name: &str, ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Self> {
        let desc = MatmulDesc::dense(ty, ActType::F32, rows, cols);
        let kernel = candidates(&desc, &CpuFeatures::detect()).into_iter().next().ok_or_else(|| {
            GpuError::InvalidArgument(format!("{name}: no CPU kernel multiplies {ty} weights by f32 activations"))
        })?;
        Ok(Self { bytes, kernel })
    }

    fn matmul(&self, pool: &ThreadPool, x: &[f32], n: usize, out: &mut [f32], scratch: &mut Vec<u8>) -> Result<()> {
        let call = MatmulCall::dense(&self.bytes, x, n, out, scratch);
        self.kernel.run(pool, call).map_err(|e| GpuError::Model(e.into()))
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// One layer's cold neurons on the CPU.
pub(crate) struct ColdFfn {
    pub gate: CpuMatrix, // (cold, dim)
    pub up: CpuMatrix,   // (cold, dim)
    pub down: CpuMatrix, // (dim, cold)
    pub neurons: usize,
}

/// Host buffers of the cold side, reused from step to step.
#[derive(Default)]
pub(crate) struct HostBufs {
    pub xn: Vec<f32>, // the FFN's normalised input (tokens, dim), from the device
    gate: Vec<f32>,   // (tokens, cold)
    up: Vec<f32>,     // (tokens, cold)
    pub y: Vec<f32>,  // the cold neurons' share of the FFN output (tokens, dim)
    scratch: Vec<u8>, // the kernels' quantised activations
}

impl ColdFfn {
    /// `h.y = down_cold · act(gate_cold · h.xn) * (up_cold · h.xn)` for `n`
    /// tokens of `dim`.
    pub(crate) fn run(&self, pool: &ThreadPool, act: FfnAct, dim: usize, n: usize, h: &mut HostBufs) -> Result<()> {
        let c = self.neurons;
        h.gate.resize(n * c, 0.0);
        h.up.resize(n * c, 0.0);
        h.y.resize(n * dim, 0.0);
        self.gate.matmul(pool, &h.xn[..n * dim], n, &mut h.gate, &mut h.scratch)?;
        self.up.matmul(pool, &h.xn[..n * dim], n, &mut h.up, &mut h.scratch)?;
        // The CPU engine's activations, in place in h.gate.
        match act {
            FfnAct::Silu => vec::swiglu(&mut h.gate, &h.up),
            FfnAct::GeluTanh => vec::geglu(&mut h.gate, &h.up),
        }
        self.down.matmul(pool, &h.gate, n, &mut h.y, &mut h.scratch)
    }
}

/// Every layer's FFN cost per neuron group (see [`GroupCost`]).
///
/// # Errors
///
/// A missing FFN tensor or one whose rows are not whole blocks.
pub fn ffn_costs(loader: &dyn Loader, c: &ModelConfig) -> Result<Vec<GroupCost>> {
    (0..c.n_layers)
        .map(|l| {
            let ty = |s: &str| loader.tensor(&format!("blk.{l}.{s}.weight")).map(|t| t.ty);
            GroupCost::of(ty("ffn_gate")?, ty("ffn_up")?, ty("ffn_down")?, c.dim)
        })
        .collect()
}

/// Bytes of every layer's FFN weights (gate, up, down), the base of a
/// budget given as a fraction of the FFN.
///
/// # Errors
///
/// As [`ffn_costs`].
pub fn ffn_bytes(loader: &dyn Loader, c: &ModelConfig) -> Result<usize> {
    Ok(crate::placement::total_bytes(&ffn_costs(loader, c)?, c.ffn_dim))
}
