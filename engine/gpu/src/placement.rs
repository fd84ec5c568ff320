//! Where each FFN neuron lives in a hybrid CPU/GPU run (PowerInfer's
//! split): the hottest neurons, by calibrated activation frequency, on the
//! GPU within a byte budget, the rest on the CPU. Pure arithmetic on
//! frequencies and block bytes, so it is tested without a device.
//!
//! Neurons move in **groups of one quantisation block** of the down
//! projection (32 neurons for the 32-element formats, 256 for K-quants):
//! a row of `ffn_down` stores its inputs (the neurons) in blocks, so a
//! group's columns are whole blocks and the hot and cold down matrices are
//! copies of the original bytes, never re-quantised. Gate and up rows are
//! one row per neuron and are copied as they are. The split therefore
//! computes the same products as the full matrices; only the order of the
//! final sum (hot part + cold part) differs.

use spinfer_kernels::GgmlType;

use crate::{GpuError, Result};

/// One layer's FFN bytes per neuron group: gate and up rows plus the down
/// projection's column block, for `group` neurons.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupCost {
    pub group: usize,
    pub bytes: usize,
}

impl GroupCost {
    /// The cost of one group for gate/up of `gate_up_ty` (rows of `dim`)
    /// and down of `down_ty` (`dim` rows of `ffn` inputs).
    ///
    /// # Errors
    ///
    /// A row that is not whole blocks.
    pub fn of(gate_ty: GgmlType, up_ty: GgmlType, down_ty: GgmlType, dim: usize) -> Result<Self> {
        let group = down_ty.block_size();
        let row = |ty: GgmlType| ty.row_bytes(dim).map_err(|e| GpuError::InvalidArgument(e.to_string()));
        let bytes = group * (row(gate_ty)? + row(up_ty)?) + dim * down_ty.type_size();
        Ok(Self { group, bytes })
    }
}

/// Bytes of every layer's whole FFN, from its group costs.
pub fn total_bytes(costs: &[GroupCost], ffn: usize) -> usize {
    costs.iter().map(|g| ffn / g.group * g.bytes).sum()
}

/// The hot groups of every layer (ascending group indices), chosen by
/// [`plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FfnPlacement {
    pub hot: Vec<Vec<usize>>,
    /// Bytes the hot groups take on the device.
    pub bytes: usize,
}

impl FfnPlacement {
    /// Hot neurons of all layers over all neurons.
    pub fn hot_fraction(&self, costs: &[GroupCost], ffn: usize) -> f64 {
        let hot: usize = self.hot.iter().zip(costs).map(|(h, c)| h.len() * c.group).sum();
        hot as f64 / (ffn * self.hot.len()).max(1) as f64
    }
}

/// The hottest neuron groups of all layers that fit in `budget` bytes:
/// groups ranked by their neurons' mean activation frequency (`freq[l]`,
/// one value per neuron of layer `l`), highest first, ties to the earlier
/// layer and group; taken in that order while they fit (PowerInfer's
/// placement by frequency, greedy instead of its ILP).
///
/// # Errors
///
/// Frequencies of the wrong count for a layer.
pub fn plan(freq: &[Vec<f32>], costs: &[GroupCost], ffn: usize, budget: usize) -> Result<FfnPlacement> {
    if freq.len() != costs.len() {
        return Err(GpuError::InvalidArgument(format!(
            "activation frequencies for {} layers, the model has {}",
            freq.len(),
            costs.len()
        )));
    }
    let mut groups = Vec::new();
    for (l, (f, c)) in freq.iter().zip(costs).enumerate() {
        if f.len() != ffn || c.group == 0 || !ffn.is_multiple_of(c.group) {
            return Err(GpuError::InvalidArgument(format!(
                "layer {l}: {} activation frequencies for {ffn} neurons in groups of {}",
                f.len(),
                c.group
            )));
        }
        for (g, chunk) in f.chunks_exact(c.group).enumerate() {
            let mean = chunk.iter().map(|&v| f64::from(v)).sum::<f64>() / c.group as f64;
            groups.push((mean, l, g));
        }
    }
    groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut hot = vec![Vec::new(); freq.len()];
    let mut bytes = 0usize;
    for (_, l, g) in groups {
        if bytes + costs[l].bytes <= budget {
            bytes += costs[l].bytes;
            hot[l].push(g);
        }
    }
    hot.iter_mut().for_each(|h| h.sort_unstable());
    Ok(FfnPlacement { hot, bytes })
}

/// The groups of a layer not in `hot` (ascending).
pub fn cold_groups(hot: &[usize], n_groups: usize) -> Vec<usize> {
    (0..n_groups).filter(|g| hot.binary_search(g).is_err()).collect()
}

/// Rows `groups` x `group` .. of a row-major matrix of `row_bytes` rows,
/// in order: the gate or up rows of those neurons.
pub fn gather_rows(bytes: &[u8], row_bytes: usize, groups: &[usize], group: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(groups.len() * group * row_bytes);
    for &g in groups {
        out.extend_from_slice(&bytes[g * group * row_bytes..(g + 1) * group * row_bytes]);
    }
    out
}

/// Block `groups[i]` of every row of a matrix of `rows` rows of
/// `row_bytes`, whose blocks are `block_bytes` each: the down projection's
/// columns of those neuron groups, as a `rows x (groups.len() x group)`
/// matrix in the same format.
pub fn gather_column_blocks(
    bytes: &[u8],
    rows: usize,
    row_bytes: usize,
    block_bytes: usize,
    groups: &[usize],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * groups.len() * block_bytes);
    for r in 0..rows {
        let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
        for &g in groups {
            out.extend_from_slice(&row[g * block_bytes..(g + 1) * block_bytes]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use spinfer_kernels::dequant::dequantize_row;

    #[test]
    fn the_hottest_groups_that_fit_are_chosen() {
        let cost = GroupCost { group: 2, bytes: 10 };
        // Layer 0 groups: means 0.9, 0.1; layer 1: 0.5, 0.95.
        let freq = vec![vec![1.0, 0.8, 0.2, 0.0], vec![0.5, 0.5, 1.0, 0.9]];
        let p = plan(&freq, &[cost, cost], 4, 25).unwrap();
        assert_eq!(p.hot, vec![vec![0], vec![1]]);
        assert_eq!(p.bytes, 20);
        assert!((p.hot_fraction(&[cost, cost], 4) - 0.5).abs() < 1e-12);
        assert_eq!(plan(&freq, &[cost, cost], 4, 1000).unwrap().hot, vec![vec![0, 1], vec![0, 1]]);
        assert_eq!(plan(&freq, &[cost, cost], 4, 9).unwrap().hot, vec![Vec::<usize>::new(), vec![]]);
        assert_eq!(cold_groups(&[1], 2), vec![0]);
    }

    #[test]
    fn wrong_frequency_counts_are_errors() {
        let cost = GroupCost { group: 2, bytes: 10 };
        let e = plan(&[vec![0.5; 3]], &[cost], 4, 100).unwrap_err().to_string();
        assert!(e.contains("layer 0: 3 activation frequencies for 4 neurons"), "{e}");
        let e = plan(&[vec![0.5; 4]], &[cost, cost], 4, 100).unwrap_err().to_string();
        assert!(e.contains("for 1 layers, the model has 2"), "{e}");
    }

    /// The gathered column blocks dequantise to exactly the original
    /// matrix's columns of those groups; gathered rows to its rows.
    #[test]
    fn gathered_blocks_are_the_original_columns() {
        let (ty, rows, cols) = (GgmlType::Q4_1, 5, 32 * 6);
        let row_bytes = ty.row_bytes(cols).unwrap();
        let bytes: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 7919 % 251) as u8).collect();
        let full = |b: &[u8], n: usize| -> Vec<f32> {
            let rb = ty.row_bytes(n).unwrap();
            b.chunks_exact(rb)
                .flat_map(|r| {
                    let mut v = vec![0f32; n];
                    dequantize_row(ty, r, &mut v).unwrap();
                    v
                })
                .collect()
        };
        let groups = [1, 4, 5];
        let got = full(&gather_column_blocks(&bytes, rows, row_bytes, ty.type_size(), &groups), 32 * groups.len());
        let want = full(&bytes, cols);
        for r in 0..rows {
            for (i, &g) in groups.iter().enumerate() {
                for k in 0..32 {
                    assert_eq!(got[r * 96 + i * 32 + k].to_bits(), want[r * cols + g * 32 + k].to_bits());
                }
            }
        }
        let rows_of = gather_rows(&bytes, row_bytes, &[1], 2);
        assert_eq!(rows_of, bytes[2 * row_bytes..4 * row_bytes]);
        let cost = GroupCost::of(ty, ty, GgmlType::Q8_0, 64).unwrap();
        assert_eq!(cost, GroupCost { group: 32, bytes: 32 * 2 * ty.row_bytes(64).unwrap() + 64 * 34 });
    }
}
