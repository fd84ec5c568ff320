//! The bundle file (`<sidecar>.ffn`): its header, and writing it from the
//! model's FFN matrices; the format is in the parent module's docs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use spinfer_formats::tensor::release_pages;
use spinfer_kernels::GgmlType;

use crate::shared::sparsity_err;
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"SPFFNB01";
const FORMAT: &str = "spinfer-ffn-bundle";
const VERSION: u32 = 1;
/// Neurons per `W_down` block (Q4_0 / Q4_1 / Q8_0).
pub(super) const QK: usize = 32;

/// One layer's FFN matrices as the model file holds them.
pub struct FfnSource<'a> {
    pub gate: (GgmlType, &'a [u8]),
    pub up: (GgmlType, &'a [u8]),
    pub down: (GgmlType, &'a [u8]),
    /// The bytes lie in a read-only file mapping, so their pages may be
    /// released (`MADV_DONTNEED`) once copied. Never set for heap bytes:
    /// releasing those would zero them.
    pub mapped: bool,
}

/// Releases a mapped layer's pages (see [`release_pages`]).
///
/// # Safety
/// `s`'s slices lie in a read-only file mapping (`s.mapped` is true).
pub(super) unsafe fn release_layer(s: &FfnSource) {
    for bytes in [s.gate.1, s.up.1, s.down.1] {
        // SAFETY: the caller's guarantee.
        unsafe { release_pages(bytes) };
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Header {
    pub(super) format: String,
    pub(super) version: u32,
    pub(super) fingerprint: String,
    pub(super) freq_sha256: String,
    pub(super) n_layers: usize,
    pub(super) dim: usize,
    pub(super) ffn_dim: usize,
    pub(super) gate_type: String,
    pub(super) up_type: String,
    pub(super) down_type: String,
    pub(super) gate_row: usize,
    pub(super) up_row: usize,
    pub(super) down_col: usize,
    pub(super) record: usize,
    pub(super) scales: usize,
    pub(super) layer_bytes: usize,
    pub(super) data_start: usize,
}

/// The bundle's path for a sidecar: `<sidecar>.ffn`.
pub fn path_for(sidecar: &Path) -> PathBuf {
    let mut s = sidecar.as_os_str().to_owned();
    s.push(".ffn");
    PathBuf::from(s)
}

pub(super) fn down_layout(ty: GgmlType) -> Option<(bool, i8)> {
    // (4-bit, code bias)
    match ty {
        GgmlType::Q4_0 => Some((true, 8)),
        GgmlType::Q4_1 => Some((true, 0)),
        GgmlType::Q8_0 => Some((false, 0)),
        _ => None,
    }
}

pub(super) fn header_for(
    fingerprint: &str,
    freqs: &[Vec<f32>],
    src: &[FfnSource],
    dim: usize,
    ffn: usize,
) -> Result<Header> {
    let first = src.first().ok_or_else(|| Error::InvalidArgument("FFN bundle: model has no layers".into()))?;
    let (gt, ut, dt) = (first.gate.0, first.up.0, first.down.0);
    if src.iter().any(|s| s.gate.0 != gt || s.up.0 != ut || s.down.0 != dt) {
        return Err(Error::InvalidArgument("FFN bundle: FFN weight types differ between layers".into()));
    }
    let Some((q4, _)) = down_layout(dt) else {
        return Err(Error::InvalidArgument(format!(
            "an FFN memory budget needs ffn_down in Q4_0, Q4_1 or Q8_0, this model's is {dt}"
        )));
    };
    let kerr = |e: spinfer_kernels::KernelError| Error::InvalidArgument(format!("FFN bundle: {e}"));
    let (gate_row, up_row) = (gt.row_bytes(dim).map_err(kerr)?, ut.row_bytes(dim).map_err(kerr)?);
    let down_col = if q4 { dim / 2 } else { dim };
    if !dim.is_multiple_of(2) || !ffn.is_multiple_of(QK) {
        return Err(Error::InvalidArgument(format!("FFN bundle: dim {dim} / ffn {ffn} not block aligned")));
    }
    let scales = (ffn / QK) * dim * 2 * if dt == GgmlType::Q4_1 { 2 } else { 1 };
    let record = gate_row + up_row + down_col;
    let mut h = Sha256::new();
    for f in freqs {
        for v in f {
            h.update(v.to_le_bytes());
        }
    }
    let freq_sha256 = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Header {
        format: FORMAT.into(),
        version: VERSION,
        fingerprint: fingerprint.into(),
        freq_sha256,
        n_layers: src.len(),
        dim,
        ffn_dim: ffn,
        gate_type: gt.to_string(),
        up_type: ut.to_string(),
        down_type: dt.to_string(),
        gate_row,
        up_row,
        down_col,
        record,
        scales,
        layer_bytes: 4 * ffn + scales + ffn * record,
        data_start: 4096,
    })
}

/// Neuron ids by descending frequency (ties: lower id first).
pub(super) fn order_of(freq: &[f32]) -> Vec<u32> {
    let mut o: Vec<u32> = (0..freq.len() as u32).collect();
    o.sort_by(|&a, &b| freq[b as usize].total_cmp(&freq[a as usize]).then(a.cmp(&b)));
    o
}

pub(super) fn write_bundle(path: &Path, h: &Header, freqs: &[Vec<f32>], src: &[FfnSource]) -> Result<()> {
    let tmp = {
        let mut s = path.as_os_str().to_owned();
        s.push(".tmp");
        PathBuf::from(s)
    };
    let io = |e| Error::io(&tmp, e);
    let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(io)?);
    let json = serde_json::to_vec(h).map_err(|e| sparsity_err(path, e.to_string()))?;
    if 16 + json.len() > h.data_start {
        return Err(sparsity_err(path, "FFN bundle header too long"));
    }
    w.write_all(MAGIC).map_err(io)?;
    w.write_all(&(json.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&json).map_err(io)?;
    w.write_all(&vec![0u8; h.data_start - 16 - json.len()]).map_err(io)?;
    let (dim, ffn) = (h.dim, h.ffn_dim);
    let dt = src[0].down.0;
    let (q4, _) = down_layout(dt).expect("checked by header_for");
    let has_min = dt == GgmlType::Q4_1;
    let nb = ffn / QK;
    let mut codes = vec![0u8; ffn * dim]; // neuron-major raw codes
    let mut d = vec![0u8; nb * dim * 2];
    let mut m = vec![0u8; if has_min { nb * dim * 2 } else { 0 }];
    let mut col = vec![0u8; h.down_col];
    for (l, (s, freq)) in src.iter().zip(freqs).enumerate() {
        let order = order_of(freq);
        let down = s.down.1;
        let rb = dt.row_bytes(ffn).map_err(|e| sparsity_err(path, e.to_string()))?;
        let bs = dt.type_size();
        if down.len() != dim * rb || s.gate.1.len() != ffn * h.gate_row || s.up.1.len() != ffn * h.up_row {
            return Err(sparsity_err(path, format!("layer {l}: FFN matrix sizes do not match the model shape")));
        }
        for i in 0..dim {
            for (b, blk) in down[i * rb..(i + 1) * rb].chunks_exact(bs).enumerate() {
                d[(b * dim + i) * 2..][..2].copy_from_slice(&blk[..2]);
                let qs = match dt {
                    GgmlType::Q4_0 => &blk[2..18],
                    GgmlType::Q4_1 => {
                        m[(b * dim + i) * 2..][..2].copy_from_slice(&blk[2..4]);
                        &blk[4..20]
                    }
                    _ => &blk[2..34],
                };
                if q4 {
                    for (e, &v) in qs.iter().enumerate() {
                        codes[(b * QK + e) * dim + i] = v & 0x0F;
                        codes[(b * QK + e + QK / 2) * dim + i] = v >> 4;
                    }
                } else {
                    for (e, &v) in qs.iter().enumerate() {
                        codes[(b * QK + e) * dim + i] = v;
                    }
                }
            }
        }
        for &j in &order {
            w.write_all(&j.to_le_bytes()).map_err(io)?;
        }
        w.write_all(&d).map_err(io)?;
        w.write_all(&m).map_err(io)?;
        let half = dim / 2;
        for &j in &order {
            let j = j as usize;
            w.write_all(&s.gate.1[j * h.gate_row..(j + 1) * h.gate_row]).map_err(io)?;
            w.write_all(&s.up.1[j * h.up_row..(j + 1) * h.up_row]).map_err(io)?;
            let c = &codes[j * dim..(j + 1) * dim];
            if q4 {
                for (t, o) in col.iter_mut().enumerate() {
                    *o = c[t] | (c[t + half] << 4);
                }
                w.write_all(&col).map_err(io)?;
            } else {
                w.write_all(c).map_err(io)?;
            }
        }
        if s.mapped {
            // Streaming: one layer's matrices resident at a time.
            // SAFETY: `mapped` says these slices borrow the model's
            // read-only file mapping.
            unsafe { release_layer(s) };
        }
    }
    let f = w.into_inner().map_err(|e| io(e.into_error()))?;
    f.sync_all().map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

pub(super) fn read_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(buf, offset).map_err(|e| Error::io(path, e))
    }
    #[cfg(windows)]
    {
        use std::os::windows::fs::FileExt;
        let mut done = 0;
        while done < buf.len() {
            match file.seek_read(&mut buf[done..], offset + done as u64) {
                Ok(0) => return Err(sparsity_err(path, "unexpected end of file")),
                Ok(n) => done += n,
                Err(e) => return Err(Error::io(path, e)),
            }
        }
        Ok(())
    }
}

pub(super) fn read_header(file: &File, path: &Path) -> Option<Header> {
    let mut head = [0u8; 16];
    read_at(file, path, &mut head, 0).ok()?;
    if &head[..8] != MAGIC {
        return None;
    }
    let n = u64::from_le_bytes(head[8..16].try_into().ok()?) as usize;
    if n > 1 << 20 {
        return None;
    }
    let mut json = vec![0u8; n];
    read_at(file, path, &mut json, 16).ok()?;
    serde_json::from_slice(&json).ok()
}
