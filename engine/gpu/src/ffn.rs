//! A block's FFN weights: all on the device, or split by neuron group
//! between the device (hot) and the CPU (cold, `hybrid.rs`).

use spinfer_formats::loader::check_dims;
use spinfer_formats::{Loader, ModelConfig};
use spinfer_kernels::GgmlType;
use spinfer_kernels_cuda::{CudaBackend, DeviceMatrix};

use crate::hybrid::{ColdFfn, CpuMatrix};
use crate::placement::{cold_groups, gather_column_blocks, gather_rows};
use crate::proj::{Part, Proj};
use crate::slices::format_of;
use crate::{GpuError, Result};

/// A block's FFN: every neuron on the device, or (hybrid) the hot neuron
/// groups on the device and the cold ones on the CPU (`hybrid.rs`).
pub(crate) enum Ffn {
    Gpu {
        gate_up: Proj,        // gate, up (ffn_dim each) x dim
        w_down: DeviceMatrix, // (dim, ffn_dim)
    },
    Split {
        hot: Option<(Proj, DeviceMatrix)>, // as above for the hot neurons (may be none)
        hot_neurons: usize,
        cold: Box<ColdFfn>,
    },
}

/// Layer `l`'s FFN split by its `hot` neuron groups (ascending): their gate
/// and up rows and down columns uploaded, the others kept on the CPU; `None`
/// when every group is hot (the whole FFN then goes on the device as usual).
///
/// # Errors
///
/// A group past the layer's neurons; tensors of the wrong shape or type;
/// device errors.
pub(crate) fn split_ffn(
    be: &CudaBackend,
    loader: &dyn Loader,
    c: &ModelConfig,
    l: usize,
    hot: &[usize],
) -> Result<Option<Ffn>> {
    let (dim, ffn) = (c.dim, c.ffn_dim);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let tensor = |s: &str, rows: usize, cols: usize| {
        let t = loader.tensor(&name(s))?;
        check_dims(loader, &t, &[cols, rows])?;
        Ok::<_, GpuError>(t)
    };
    let (gate, up, down) = (tensor("ffn_gate", ffn, dim)?, tensor("ffn_up", ffn, dim)?, tensor("ffn_down", dim, ffn)?);
    let group = down.ty.block_size();
    let n_groups = ffn / group;
    if let Some(g) = hot.iter().find(|&&g| g >= n_groups) {
        return Err(GpuError::InvalidArgument(format!(
            "layer {l}: hot group {g} of {n_groups} groups of {group} neurons"
        )));
    }
    if hot.len() == n_groups {
        return Ok(None);
    }
    let row_bytes = |ty: GgmlType, n: usize| ty.row_bytes(n).map_err(|e| GpuError::Model(e.into()));
    let (gate_rb, up_rb, down_rb) = (row_bytes(gate.ty, dim)?, row_bytes(up.ty, dim)?, row_bytes(down.ty, ffn)?);
    let gate_rows = |gs: &[usize]| gather_rows(gate.data.bytes(), gate_rb, gs, group);
    let up_rows = |gs: &[usize]| gather_rows(up.data.bytes(), up_rb, gs, group);
    let down_cols = |gs: &[usize]| gather_column_blocks(down.data.bytes(), dim, down_rb, down.ty.type_size(), gs);

    // The hot groups on the device: gate and up stacked when one format.
    let hot_n = hot.len() * group;
    let hot_part = if hot.is_empty() {
        None
    } else {
        let (g, u) = (gate_rows(hot), up_rows(hot));
        let parts = [
            Part { format: format_of(&gate)?, rows: hot_n, bytes: &g },
            Part { format: format_of(&up)?, rows: hot_n, bytes: &u },
        ];
        let gate_up = Proj::upload(be, &parts, dim, true)?;
        Some((gate_up, be.upload_matrix(format_of(&down)?, dim, hot_n, &down_cols(hot))?))
    };
    // The cold groups on the CPU.
    let cold_g = cold_groups(hot, n_groups);
    let cold_n = cold_g.len() * group;
    let cold = ColdFfn {
        gate: CpuMatrix::new(&name("ffn_gate"), gate.ty, cold_n, dim, gate_rows(&cold_g))?,
        up: CpuMatrix::new(&name("ffn_up"), up.ty, cold_n, dim, up_rows(&cold_g))?,
        down: CpuMatrix::new(&name("ffn_down"), down.ty, dim, cold_n, down_cols(&cold_g))?,
        neurons: cold_n,
    };
    Ok(Some(Ffn::Split { hot: hot_part, hot_neurons: hot_n, cold: Box::new(cold) }))
}
