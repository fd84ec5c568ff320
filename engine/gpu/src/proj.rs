//! Projections that read the same input (Q/K/V, gate/up): consecutive parts
//! of one weight format stacked into one matrix, so that each group is one
//! launch.

use spinfer_kernels_cuda::{CudaBackend, DeviceBuf, DeviceMatrix, WeightFormat};

use crate::Result;
use crate::fused::Input;
use crate::slices::{UBATCH, at_mut};

/// One part of a projection: its format, output rows and GGUF bytes.
pub(crate) struct Part<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub bytes: &'a [u8],
}

/// A projection's groups on the device. Group g writes `tokens` rows of its
/// own width at `UBATCH x` (the rows of the groups before it) in the output
/// buffer, so part i's output is at `place[i]` = (offset, row stride): one
/// stacked row when every part has one format, one buffer each otherwise.
pub(crate) struct Proj {
    groups: Vec<DeviceMatrix>,  // (rows of its parts, cols) each
    place: Vec<(usize, usize)>, // per part: (offset, row stride) in the output
}

impl Proj {
    /// Uploads `parts` (of `cols` columns), consecutive ones of one format
    /// stacked when `stack`.
    pub(crate) fn upload(be: &CudaBackend, parts: &[Part<'_>], cols: usize, stack: bool) -> Result<Self> {
        let (mut groups, mut place) = (Vec::new(), Vec::new());
        let mut i = 0;
        let mut base = 0; // rows of the groups before this one
        while i < parts.len() {
            let same = |p: &Part<'_>| stack && p.format == parts[i].format;
            let end = i + 1 + parts[i + 1..].iter().take_while(|p| same(p)).count();
            let rows: usize = parts[i..end].iter().map(|p| p.rows).sum();
            let mut off = 0;
            for p in &parts[i..end] {
                place.push((UBATCH * base + off, rows));
                off += p.rows;
            }
            // One part uploads from its own bytes; several are joined first.
            let bytes: std::borrow::Cow<'_, [u8]> = if end - i == 1 {
                parts[i].bytes.into()
            } else {
                parts[i..end].iter().flat_map(|p| p.bytes.iter().copied()).collect::<Vec<u8>>().into()
            };
            groups.push(be.upload_matrix(parts[i].format, rows, cols, &bytes)?);
            base += rows;
            i = end;
        }
        Ok(Self { groups, place })
    }

    /// Part i's output: (offset, row stride) in the buffer [`Proj::project`]
    /// writes.
    pub(crate) fn place(&self, i: usize) -> (usize, usize) {
        self.place[i]
    }

    /// Bytes of the weights.
    pub(crate) fn bytes(&self) -> usize {
        self.groups.iter().map(DeviceMatrix::bytes).sum()
    }

    /// Every group applied to `input` for `n` tokens, into `out` (named
    /// `what` in errors), laid out as [`Proj::place`] says.
    pub(crate) fn project(
        &self,
        be: &CudaBackend,
        input: &mut Input<'_>,
        n: usize,
        out: &mut DeviceBuf<f32>,
        what: &str,
    ) -> Result<()> {
        let mut base = 0;
        for m in &self.groups {
            let rows = m.shape().0;
            input.project(be, m, n, at_mut(out, what, UBATCH * base, n * rows)?)?;
            base += rows;
        }
        Ok(())
    }
}
