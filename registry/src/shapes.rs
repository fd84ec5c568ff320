//! The generic matmul shape grid that `spinfer tune --synthetic-shapes` measures next to a model's
//! own shapes (data only).
//!
//! Kernel selection from history picks, for an operation never measured, the fastest kernel on
//! the nearest recorded shape (log rows, log cols). With the history of one model only, "nearest"
//! can be far away: SmolLM2-135M's shapes are all 576 wide, and a 128x896 matrix then borrows
//! the ranking of 192x576. The grid spreads measured shapes over the space a model's matrices
//! live in, from short and wide (32 x 4096) to tall and narrow (8192 x 256), two octaves
//! apart, so that a crossover between kernels shows up in the history wherever it is. The
//! 32-row shapes are there for one such crossover: a native pack's copy of a built-in kernel
//! pays a fixed cost per call (the ABI crossing and the host's split of the rows), a few percent
//! of a small matrix's time and 10-20% of a 32-row one's.
//!
//! Every column count is a multiple of 256, so the grid suits every block size (32 for the
//! legacy quants, 256 for the K-quants and ternary types); shapes above
//! [`SYNTHETIC_MAX_ELEMENTS`] are left out to keep tuning short (the scalar reference kernels
//! are measured too). The grid is fixed: the same history gives the same selection on every
//! run.

/// Row counts of the grid.
pub const SYNTHETIC_ROWS: [usize; 5] = [32, 128, 512, 2048, 8192];

/// Column counts of the grid (each a multiple of 256).
pub const SYNTHETIC_COLS: [usize; 3] = [256, 1024, 4096];

/// Largest `rows * cols` in the grid.
pub const SYNTHETIC_MAX_ELEMENTS: usize = 4 << 20;

/// The grid's `(rows, cols)` whose column count is a whole number of `block`-element blocks,
/// ordered by rows then columns, without those listed in `skip` (shapes measured anyway, such as
/// the model's own).
pub fn synthetic_shapes(block: usize, skip: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let block = block.max(1);
    SYNTHETIC_ROWS
        .iter()
        .flat_map(|&r| SYNTHETIC_COLS.iter().map(move |&c| (r, c)))
        .filter(|&(r, c)| r * c <= SYNTHETIC_MAX_ELEMENTS && c.is_multiple_of(block) && !skip.contains(&(r, c)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_spans_short_wide_to_tall_narrow_within_the_budget() {
        let g = synthetic_shapes(32, &[]);
        assert_eq!(
            g,
            vec![
                (32, 256),
                (32, 1024),
                (32, 4096),
                (128, 256),
                (128, 1024),
                (128, 4096),
                (512, 256),
                (512, 1024),
                (512, 4096),
                (2048, 256),
                (2048, 1024),
                (8192, 256),
            ]
        );
        assert!(g.iter().all(|&(r, c)| r * c <= SYNTHETIC_MAX_ELEMENTS));
        // Deterministic.
        assert_eq!(synthetic_shapes(32, &[]), g);
        // Every block size the kernels use divides every column count.
        for block in [1, 32, 256] {
            assert_eq!(synthetic_shapes(block, &[]), g, "block {block}");
        }
    }

    #[test]
    fn block_filter_and_skip() {
        // 3 divides none of 256, 1024, 4096.
        assert!(synthetic_shapes(3, &[]).is_empty());
        // 1024-element blocks leave the 1024 and 4096 columns.
        assert!(synthetic_shapes(1024, &[]).iter().all(|&(_, c)| c >= 1024));
        assert_eq!(synthetic_shapes(1024, &[]).len(), 7);
        // 0 is treated as 1 (no block constraint).
        assert_eq!(synthetic_shapes(0, &[]), synthetic_shapes(1, &[]));
        let g = synthetic_shapes(32, &[(512, 1024), (7, 7)]);
        assert_eq!(g.len(), 11);
        assert!(!g.contains(&(512, 1024)));
    }

    /// The selection-quality example (`tests/examples/selection_quality.rs`) evaluates nearest-shape
    /// selection on these shapes, which must stay unmeasured: none of them may be in the grid.
    #[test]
    fn grid_avoids_the_evaluated_unseen_shapes() {
        let mut unseen = Vec::new();
        for (dim, kv, ffn, vocab) in [(960, 320, 2560, 49152), (896, 128, 4864, 151_936), (64, 32, 128, 512)] {
            unseen.extend([(dim, dim), (kv, dim), (ffn, dim), (dim, ffn), (vocab, dim)]);
        }
        // SmolLM2-135M's own shapes too (measured exactly anyway).
        unseen.extend([(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]);
        let g = synthetic_shapes(32, &[]);
        for s in unseen {
            assert!(!g.contains(&s), "{s:?} is in the grid");
        }
    }
}
