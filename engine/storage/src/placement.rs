//! Where each weight lives under one memory budget (`--mem-budget-mb`,
//! `[memory] budget_mb`), decided once at load.
//!
//! The budget covers the weights, the session's KV cache and work buffers
//! and the read-ahead ring; the process's code is outside it. Dense decode
//! reads every byte of every matrix once per token, so the bytes read from
//! storage per token are the bytes not resident, whichever those are. Each
//! matrix is cut into chunks of whole rows (multiples of 64 rows, so every
//! row is computed by the same tile code as in the whole-matrix product;
//! at most [`CHUNK_BYTES`], which bounds the ring); the plan keeps as many
//! chunks resident as fit and spreads the streamed ones evenly through the
//! forward order (so the I/O threads read while the compute works on
//! resident ones).
//! The token embedding is never streamed whole: a token reads its one row.

use std::ops::Range;

use crate::{Error, Result};

/// Bytes in a MB (10^6, as `--mem-budget-mb` and `--ffn-budget-mb` count), for messages.
const MB: f64 = 1e6;

/// Largest chunk of a streamed matrix: one read. Half a MiB rather than
/// one: the ring of read-ahead buffers is part of the budget, so smaller
/// chunks leave more of it resident for the same reads in flight
/// (docs/benchmarks.md, "Decode under a memory cap").
pub const CHUNK_BYTES: usize = 1 << 19;

/// Read-ahead buffers of the ring, at most.
pub const MAX_SLOTS: usize = 6;

/// One matrix the forward pass multiplies by, in forward order.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub name: String,
    pub rows: usize,
    pub row_bytes: usize,
}

impl Matrix {
    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// What the budget has to hold besides the matrices.
#[derive(Clone, Copy, Debug)]
pub struct Fixed {
    /// KV cache, attention scores, RoPE tables (`session_bytes` of the Llama model).
    pub session: u64,
    /// Activation buffers of the largest step and the logits.
    pub work: u64,
}

/// A chunk of a matrix's rows and whether it is resident.
pub type RowChunk = (Range<usize>, bool);

/// The plan: per matrix (forward order) resident, or in row chunks each
/// resident or streamed.
#[derive(Clone, Debug)]
pub struct Placement {
    /// Per matrix: `None` wholly resident, or its row chunks, each resident
    /// (`true`) or streamed (at least one streamed).
    pub streamed: Vec<Option<Vec<RowChunk>>>,
    /// Ring buffers of the read-ahead (0 when nothing streams).
    pub slots: usize,
    /// Bytes of the resident matrices.
    pub resident_bytes: u64,
    /// Bytes read from storage per step (the streamed matrices).
    pub streamed_bytes: u64,
    /// Bytes of the ring.
    pub ring_bytes: u64,
    pub fixed: Fixed,
    pub budget: u64,
}

impl Placement {
    /// Whether anything is streamed.
    pub fn streams(&self) -> bool {
        self.streamed.iter().any(Option::is_some)
    }
}

/// Row chunks of `m`: whole multiples of 64 rows of at most
/// [`CHUNK_BYTES`] (one chunk when the matrix is smaller).
pub fn chunks(m: &Matrix) -> Vec<Range<usize>> {
    let per = (CHUNK_BYTES / m.row_bytes.max(1)) / 64 * 64;
    let per = per.max(64).min(m.rows.max(1));
    (0..m.rows).step_by(per).map(|r| r..(r + per).min(m.rows)).collect()
}

/// Plans `matrices` (forward order) under `budget` bytes with `fixed`
/// besides them.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming the budget and the least it can be
/// when it does not cover the fixed part and two read-ahead buffers.
pub fn plan(budget: u64, fixed: Fixed, matrices: &[Matrix]) -> Result<Placement> {
    let total: u64 = matrices.iter().map(|m| m.bytes() as u64).sum();
    let base = fixed.session + fixed.work;
    let all = |streamed| Placement {
        streamed,
        slots: 0,
        resident_bytes: total,
        streamed_bytes: 0,
        ring_bytes: 0,
        fixed,
        budget,
    };
    if base + total <= budget {
        return Ok(all(vec![None; matrices.len()]));
    }
    let chunked: Vec<Vec<Range<usize>>> = matrices.iter().map(chunks).collect();
    let max_chunk = matrices
        .iter()
        .zip(&chunked)
        .flat_map(|(m, cs)| cs.iter().map(move |c| c.len() * m.row_bytes))
        .max()
        .unwrap_or(0) as u64;
    let least = base + 2 * max_chunk;
    if budget < least {
        return Err(Error::InvalidArgument(format!(
            "memory budget {:.1} MB (--mem-budget-mb / [memory] budget_mb) is below the {:.1} MB this model and \
             context need at least ({:.1} MB KV cache and tables, {:.1} MB work buffers, {:.1} MB for two \
             read-ahead buffers); raise it or lower --ctx",
            budget as f64 / MB,
            least as f64 / MB,
            fixed.session as f64 / MB,
            fixed.work as f64 / MB,
            2.0 * max_chunk as f64 / MB,
        )));
    }
    // The ring: as many buffers as fit next to the fixed part, up to
    // MAX_SLOTS, leaving the rest to resident matrices once two are paid.
    let spare = budget - least;
    let slots = (2 + (spare / 4 / max_chunk.max(1)) as usize).min(MAX_SLOTS);
    let ring = slots as u64 * max_chunk;
    let room = budget.saturating_sub(base + ring);
    // Spread over the chunks in forward order: resident while the running
    // credit of `room / total` of each chunk's bytes covers it (Bresenham),
    // then fill what is left (a large chunk can leave credit unused).
    let share = room as f64 / total.max(1) as f64;
    let mut credit = 0.0f64;
    let mut resident_bytes = 0u64;
    let mut units: Vec<Vec<(Range<usize>, bool)>> =
        chunked.into_iter().map(|cs| cs.into_iter().map(|c| (c, false)).collect()).collect();
    for (m, cs) in matrices.iter().zip(units.iter_mut()) {
        for (r, keep) in cs.iter_mut() {
            let b = (r.len() * m.row_bytes) as u64;
            credit += share * b as f64;
            if credit >= b as f64 && resident_bytes + b <= room {
                credit -= b as f64;
                resident_bytes += b;
                *keep = true;
            }
        }
    }
    for (m, cs) in matrices.iter().zip(units.iter_mut()) {
        for (r, keep) in cs.iter_mut() {
            let b = (r.len() * m.row_bytes) as u64;
            if !*keep && resident_bytes + b <= room {
                resident_bytes += b;
                *keep = true;
            }
        }
    }
    let streamed: Vec<_> =
        units.into_iter().map(|cs| if cs.iter().all(|&(_, keep)| keep) { None } else { Some(cs) }).collect();
    Ok(Placement {
        streamed,
        slots,
        resident_bytes,
        streamed_bytes: total - resident_bytes,
        ring_bytes: ring,
        fixed,
        budget,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rows: usize, row_bytes: usize) -> Matrix {
        Matrix { name: format!("{rows}x{row_bytes}"), rows, row_bytes }
    }

    const FIXED: Fixed = Fixed { session: 1000, work: 1000 };

    #[test]
    fn everything_resident_when_it_fits() {
        let p = plan(10_000, FIXED, &[m(10, 100), m(20, 100)]).unwrap();
        assert!(!p.streams());
        assert_eq!((p.resident_bytes, p.streamed_bytes, p.slots), (3000, 0, 0));
    }

    #[test]
    fn a_budget_below_the_least_names_both_figures() {
        let e = plan(2_100, FIXED, &[m(64, 100), m(64, 100)]).unwrap_err().to_string();
        assert!(e.contains("--mem-budget-mb") && e.contains("below"), "{e}");
    }

    #[test]
    fn streamed_matrices_are_spread_and_the_plan_fits() {
        let ms: Vec<Matrix> = (0..12).map(|_| m(64, 1000)).collect(); // 64,000 bytes each
        let budget = 2_000 + 4 * 64_000 + 6 * 64_000;
        let p = plan(budget, FIXED, &ms).unwrap();
        assert!(p.streams());
        let used = p.fixed.session + p.fixed.work + p.ring_bytes + p.resident_bytes;
        assert!(used <= budget, "{used} > {budget}");
        assert_eq!(p.resident_bytes + p.streamed_bytes, 12 * 64_000);
        // No three resident matrices in a row while others stream: spread.
        let resident: Vec<bool> = p.streamed.iter().map(Option::is_none).collect();
        assert!(resident.iter().any(|&r| r) && resident.iter().any(|&r| !r), "{resident:?}");
        assert!(resident.windows(3).all(|w| !(w[0] && w[1] && w[2])), "{resident:?}");
    }

    #[test]
    fn a_large_matrix_is_part_resident_chunk_by_chunk() {
        // One 4 MiB matrix (eight chunks), a ring of two chunks and room
        // for one and a half more.
        let big = m(4 * 1024, 1024);
        let chunk = CHUNK_BYTES as u64;
        let budget = 2_000 + 2 * chunk + 3 * chunk / 2;
        let p = plan(budget, FIXED, &[big]).unwrap();
        let cs = p.streamed[0].as_ref().expect("partly streamed");
        let kept = cs.iter().filter(|&&(_, keep)| keep).count();
        assert!((1..cs.len()).contains(&kept), "{cs:?}");
        assert_eq!(p.resident_bytes, kept as u64 * chunk);
    }

    #[test]
    fn chunks_are_whole_multiples_of_64_rows_within_the_chunk_size() {
        let big = m(49_152, 612); // a Q8_0 head of 576 columns
        let cs = chunks(&big);
        assert_eq!(cs.first().unwrap().start, 0);
        assert_eq!(cs.last().unwrap().end, 49_152);
        assert!(cs.windows(2).all(|w| w[0].end == w[1].start));
        assert!(cs.iter().all(|c| c.start % 64 == 0 && c.len() * 612 <= CHUNK_BYTES));
        assert_eq!(chunks(&m(10, 5)), vec![0..10]);
    }
}
