//! NumPy `.npy` files (format versions 1.0 to 3.0): the header that says
//! the element type and shape, checked against the file before any tensor
//! data is read.
//!
//! Layout: magic `\x93NUMPY`, major and minor version bytes, the header
//! length (u16 little-endian for version 1, u32 for 2 and 3), the header (a
//! Python dict literal such as `{'descr': '<f4', 'fortran_order': False,
//! 'shape': (576, 49152), }`), then the elements in C order.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Largest header accepted (numpy writes a few hundred bytes).
const MAX_HEADER: usize = 64 << 10;

/// Element types read: what a float checkpoint holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 => 2,
        }
    }
}

/// A checked `.npy` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub dtype: Dtype,
    /// Outermost first, as numpy lists it; `[]` for a scalar.
    pub shape: Vec<u64>,
    /// Where the elements start.
    pub data_offset: u64,
    /// Bytes of elements: the product of `shape` times the element size,
    /// equal to the file's length after `data_offset`.
    pub data_len: u64,
}

/// Reads and checks the header of the `.npy` file at `path`.
pub fn read_header(path: &Path) -> Result<Header, String> {
    let mut f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file_len = f.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
    let bad = |what: String| format!("{}: not a valid .npy file: {what}", path.display());
    let mut prefix = [0u8; 12];
    let n = read_up_to(&mut f, &mut prefix).map_err(|e| format!("{}: {e}", path.display()))?;
    if n < 10 || &prefix[..6] != b"\x93NUMPY" {
        return Err(bad("no \\x93NUMPY magic".into()));
    }
    let (header_len, header_start) = match prefix[6] {
        1 => (usize::from(u16::from_le_bytes([prefix[8], prefix[9]])), 10usize),
        2 | 3 if n == 12 => (u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize, 12),
        v => return Err(bad(format!("format version {v} is not 1, 2 or 3"))),
    };
    if header_len > MAX_HEADER {
        return Err(bad(format!("a header of {header_len} bytes (at most {MAX_HEADER})")));
    }
    let data_offset = (header_start + header_len) as u64;
    if data_offset > file_len {
        return Err(bad(format!("the header ends at byte {data_offset}, past the file's {file_len}")));
    }
    let mut text = vec![0u8; header_len];
    f.seek(SeekFrom::Start(header_start as u64))
        .and_then(|_| f.read_exact(&mut text))
        .map_err(|e| bad(e.to_string()))?;
    let text = std::str::from_utf8(&text).map_err(|_| bad("the header is not text".into()))?;
    let (dtype, shape) = parse_dict(text).map_err(bad)?;
    let elements =
        shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).ok_or_else(|| bad("the shape overflows".into()))?;
    let data_len = elements.checked_mul(dtype.size() as u64).ok_or_else(|| bad("the shape overflows".into()))?;
    if file_len - data_offset != data_len {
        return Err(bad(format!(
            "shape {shape:?} needs {data_len} bytes of data but the file has {}",
            file_len - data_offset
        )));
    }
    Ok(Header { dtype, shape, data_offset, data_len })
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// `descr`, `fortran_order` and `shape` of a header dict.
fn parse_dict(text: &str) -> Result<(Dtype, Vec<u64>), String> {
    let value = |key: &str| -> Result<&str, String> {
        let k = format!("'{key}':");
        let at = text.find(&k).ok_or_else(|| format!("the header has no '{key}'"))?;
        Ok(text[at + k.len()..].trim_start())
    };
    let descr = value("descr")?;
    let dtype = if descr.starts_with("'<f4'") {
        Dtype::F32
    } else if descr.starts_with("'<f2'") {
        Dtype::F16
    } else {
        let shown: String = descr.chars().take(12).collect();
        return Err(format!("element type {shown} is not supported (supported: '<f4', '<f2')"));
    };
    if !value("fortran_order")?.starts_with("False") {
        return Err("Fortran-ordered arrays are not supported".into());
    }
    let shape = value("shape")?;
    let inner = shape.strip_prefix('(').and_then(|s| s.split_once(')')).map(|(s, _)| s);
    let inner = inner.ok_or_else(|| "the shape is not a tuple".to_string())?;
    let dims = inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<u64>().map_err(|_| format!("shape entry {d:?} is not a non-negative integer")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((dtype, dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        let mut h = header.as_bytes().to_vec();
        let total = (10 + h.len() + 1).next_multiple_of(64);
        h.resize(total - 10 - 1, b' ');
        h.push(b'\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend((h.len() as u16).to_le_bytes());
        b.extend(h);
        b.extend(data);
        b
    }

    fn header_of(bytes: &[u8]) -> Result<Header, String> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.npy");
        std::fs::write(&p, bytes).unwrap();
        read_header(&p)
    }

    #[test]
    fn reads_f32_and_f16_headers() {
        let h = header_of(&npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", &[0; 24])).unwrap();
        assert_eq!((h.dtype, h.shape.clone(), h.data_len), (Dtype::F32, vec![2, 3], 24));
        assert_eq!(h.data_offset, 128, "the header padded to a multiple of 64 bytes");
        let h = header_of(&npy("{'descr': '<f2', 'fortran_order': False, 'shape': (5,), }", &[0; 10])).unwrap();
        assert_eq!((h.dtype, h.shape), (Dtype::F16, vec![5]));
    }

    #[test]
    fn bad_files_are_errors_naming_what_is_wrong() {
        let cases: [(&[u8], &str); 6] = [
            (b"PK\x03\x04", "magic"),
            (&npy("{'descr': '<i8', 'fortran_order': False, 'shape': (1,), }", &[0; 8]), "'<i8'"),
            (&npy("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", &[0; 4]), "Fortran"),
            (&npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", &[0; 4]), "needs 12 bytes"),
            (&npy("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", &[]), "non-negative"),
            (
                &npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4), }", &[]),
                "overflows",
            ),
        ];
        for (bytes, want) in cases {
            let e = header_of(bytes).unwrap_err();
            assert!(e.contains(want), "{e} (wanted {want:?})");
        }
    }
}
