//! The head index file (`.spinfer-head`), written by `spinfer
//! calibrate-head` and read at load:
//!
//! ```text
//! magic "SPHEAD02" | u32 header length (≤ 64 KiB) | header (JSON, HeadHeader)
//! | offsets: (clusters + 1) × u32 | members: vocab × u32 | means: clusters × dim × f32
//! | spread: clusters × f32
//! ```
//!
//! All little-endian. `members[..offsets[0]]` are the hot rows and cluster
//! `c` holds the vocabulary rows `members[offsets[c]..offsets[c + 1]]`
//! (each ascending); `means` holds each cluster's mean row and `spread`
//! the expected variance of its logits around the mean's. Every size is
//! checked against the header, and the header against the model, before
//! anything is allocated from it.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::HeadIndex;
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"SPHEAD02";
/// The format before hot rows were left out of the clusters.
const MAGIC_V1: &[u8; 8] = b"SPHEAD01";
const MAX_HEADER: usize = 64 * 1024;

/// The model a head index was built for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadModel {
    pub arch: String,
    pub vocab_size: usize,
    pub dim: usize,
    /// The head tensor (`output.weight` or the tied `token_embd.weight`).
    pub tensor: String,
    /// Its GGML type.
    pub tensor_type: String,
    /// sha256 of the head tensor's bytes, hex.
    pub sha256: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeadHeader {
    model: HeadModel,
    clusters: usize,
    /// Rows computed for every token (the first members).
    hot: usize,
    /// Calibration positions the clustering metric was measured on
    /// (informational).
    metric_positions: usize,
    /// Clusters probed per token unless the operator says otherwise.
    probes: usize,
    /// sha256 of the cluster-ordered copy of the head beside the index
    /// (`<index>.rows`), if one was written.
    #[serde(default)]
    rows_sha256: Option<String>,
    /// Clustering rounds and seed (informational).
    iters: usize,
    seed: u64,
}

impl HeadIndex {
    /// Writes the index to `path` (through a temporary file renamed into
    /// place, so a reader never sees half a file).
    pub fn save(&self, path: &Path) -> Result<()> {
        if self.means.len() != self.clusters() * self.model.dim {
            return Err(Error::InvalidArgument(format!(
                "{}: this head index has given its means to a SparseHead; save the index HeadIndex::build returned",
                path.display()
            )));
        }
        let header = HeadHeader {
            model: self.model.clone(),
            clusters: self.clusters(),
            hot: self.hot().len(),
            metric_positions: self.metric_positions,
            probes: self.default_probes,
            rows_sha256: self.rows_sha256.clone(),
            iters: self.iters,
            seed: self.seed,
        };
        let json = serde_json::to_vec(&header).map_err(|e| Error::format(path, e.to_string()))?;
        let mut out = Vec::with_capacity(
            12 + json.len() + 4 * (self.offsets.len() + self.members.len() + self.means.len() + self.spread.len()),
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        self.offsets.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.members.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.means.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        self.spread.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, &out).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    /// Reads the index at `path` and checks it belongs to `model` (naming
    /// both when it does not) and is well formed.
    pub fn load(path: &Path, model: &HeadModel) -> Result<Self> {
        let bad = |d: String| Error::format(path, format!("head index: {d}"));
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut fixed = [0u8; 12];
        f.read_exact(&mut fixed).map_err(|_| bad("shorter than its 12-byte preamble".into()))?;
        if &fixed[..8] == MAGIC_V1 {
            return Err(bad("written by an earlier spinfer (format SPHEAD01): rebuild it with calibrate-head".into()));
        }
        if &fixed[..8] != MAGIC {
            return Err(bad("not a spinfer head index (bad magic)".into()));
        }
        let hlen = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes")) as usize;
        if hlen > MAX_HEADER || 12 + hlen as u64 > len {
            return Err(bad(format!("header of {hlen} bytes does not fit (file {len} bytes, limit {MAX_HEADER})")));
        }
        let mut json = vec![0u8; hlen];
        f.read_exact(&mut json).map_err(|e| Error::io(path, e))?;
        let h: HeadHeader = serde_json::from_slice(&json).map_err(|e| bad(format!("header: {e}")))?;
        if h.model != *model {
            return Err(bad(format!(
                "built for {} (vocabulary {}, hidden size {}, {} {} sha256 {}), but the model is {} (vocabulary \
                 {}, hidden size {}, {} {} sha256 {})",
                h.model.arch,
                h.model.vocab_size,
                h.model.dim,
                h.model.tensor,
                h.model.tensor_type,
                h.model.sha256,
                model.arch,
                model.vocab_size,
                model.dim,
                model.tensor,
                model.tensor_type,
                model.sha256
            )));
        }
        let (k, v, d) = (h.clusters, model.vocab_size, model.dim);
        if k == 0 || k > v {
            return Err(bad(format!("{k} clusters for a vocabulary of {v}")));
        }
        if h.probes == 0 || h.probes > k {
            return Err(bad(format!("{} default probes for {k} clusters", h.probes)));
        }
        if h.hot > v {
            return Err(bad(format!("{} hot rows for a vocabulary of {v}", h.hot)));
        }
        // The model's sizes were checked at its load; k, hot ≤ vocab.
        let want = 12 + hlen as u64 + 4 * ((k as u64 + 1) + v as u64 + k as u64 * d as u64 + k as u64);
        if len != want {
            return Err(bad(format!("{len} bytes, expected {want} for {k} clusters")));
        }
        let mut body = vec![0u8; (want - 12 - hlen as u64) as usize];
        f.read_exact(&mut body).map_err(|e| Error::io(path, e))?;
        let words = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let (o, rest) = body.split_at(4 * (k + 1));
        let (m, rest) = rest.split_at(4 * v);
        let (means, spread) = rest.split_at(4 * k * d);
        let offsets = words(o);
        let members = words(m);
        let means: Vec<f32> = words(means).into_iter().map(f32::from_bits).collect();
        let spread: Vec<f32> = words(spread).into_iter().map(f32::from_bits).collect();
        if offsets[0] as usize != h.hot || offsets[k] as usize != v || offsets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad(format!(
                "cluster offsets are not strictly increasing from the {} hot rows to the vocabulary size",
                h.hot
            )));
        }
        let mut seen = vec![false; v];
        for &r in &members {
            match seen.get_mut(r as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(bad(format!("member row {r} is out of range or listed twice"))),
            }
        }
        if let Some(i) = means.iter().position(|x| !x.is_finite()) {
            return Err(bad(format!("cluster mean {} holds a non-finite value", i / d)));
        }
        if let Some(c) = spread.iter().position(|x| !(x.is_finite() && *x >= 0.0)) {
            return Err(bad(format!("cluster {c}'s spread {} is not a finite non-negative number", spread[c])));
        }
        let row_bytes = spinfer_kernels::GgmlType::ALL
            .into_iter()
            .find(|t| t.name() == model.tensor_type)
            .ok_or_else(|| bad(format!("unknown head type {}", model.tensor_type)))?
            .row_bytes(d)
            .map_err(|e| bad(e.to_string()))?;
        let rows = match &h.rows_sha256 {
            Some(sha) => Some(super::rows::open(&super::rows_path(path), v, row_bytes, sha)?),
            None => None,
        };
        Ok(Self {
            model: h.model,
            offsets,
            members,
            means,
            spread,
            metric_positions: h.metric_positions,
            default_probes: h.probes,
            rows,
            rows_sha256: h.rows_sha256,
            iters: h.iters,
            seed: h.seed,
        })
    }
}
