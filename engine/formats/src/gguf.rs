//! GGUF v2/v3 reader: memory-mapped, tensors borrowed zero-copy.
//!
//! Layout (little-endian): magic `GGUF`, version u32, tensor count u64,
//! metadata count u64, metadata key/value pairs, tensor infos (name, dims,
//! type, offset), padding to `general.alignment` (default 32), tensor data.
//! Every count and offset read from the file is checked against the file's
//! size before anything is allocated or sliced, so a truncated or hostile
//! file yields an [`Error`] naming the file and what was wrong, never a panic
//! or an allocation bomb.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use spinfer_kernels::GgmlType;

use crate::tensor::{TensorData, TensorView};
use crate::{Error, Result};

mod array;
pub use array::{Array, StrList};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Nested arrays deeper than this are rejected (no real file nests more
/// than one level; the bound keeps a hostile file from blowing the stack).
const MAX_ARRAY_DEPTH: usize = 8;
const MAX_DIMS: u32 = 4;
/// Longest metadata array accepted. The largest real ones (token lists and
/// merges of 256k-token vocabularies) hold a few hundred thousand entries;
/// the bound keeps a hostile count from amplifying a large file into a much
/// larger allocation.
const MAX_ARRAY_LEN: u64 = 1 << 24;

/// A metadata value. Arrays may nest.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

impl Value {
    /// The value as an unsigned integer, if it is any integer type holding a
    /// non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Short description of the type, for error messages and `inspect`.
    pub fn type_name(&self) -> String {
        match self {
            Value::U8(_) => "u8".into(),
            Value::I8(_) => "i8".into(),
            Value::U16(_) => "u16".into(),
            Value::I16(_) => "i16".into(),
            Value::U32(_) => "u32".into(),
            Value::I32(_) => "i32".into(),
            Value::U64(_) => "u64".into(),
            Value::I64(_) => "i64".into(),
            Value::F32(_) => "f32".into(),
            Value::F64(_) => "f64".into(),
            Value::Bool(_) => "bool".into(),
            Value::String(_) => "string".into(),
            Value::Array(a) if a.is_empty() => "[]".into(),
            Value::Array(a) => format!("[{}; {}]", a.elem_type_name(), a.len()),
        }
    }
}

/// One entry of the tensor-info table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

/// An opened GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    /// The open file `mmap` maps (tensors read from it under a memory
    /// budget).
    file: Arc<File>,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    index: BTreeMap<String, usize>,
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens and validates `path`: header, metadata, tensor table, and that
    /// every tensor lies inside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is mapped read-only. The engine's invariant is that
        // model files are not modified while loaded (as with llama.cpp and
        // candle); a concurrent truncation would be the user's error.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        Self::parse(path, Arc::new(mmap), Arc::new(file))
    }

    fn parse(path: PathBuf, mmap: Arc<Mmap>, file: Arc<File>) -> Result<Self> {
        let mut r = Reader { buf: &mmap[..], pos: 0, path: &path };
        let magic = r.bytes(4, "magic")?;
        if magic != MAGIC {
            return Err(Error::format(&path, format!("not a GGUF file (magic {:02x?}, expected \"GGUF\")", magic)));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::format(&path, format!("unsupported GGUF version {version} (supported: 2, 3)")));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("type of metadata '{key}'"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(Error::Metadata {
                        path: path.clone(),
                        key: "general.alignment".into(),
                        detail: format!("must be a power of two, got {v:?}"),
                    });
                }
            },
        };

        // Each tensor info takes at least 8 (name len) + 4 + 4 + 8 bytes.
        r.check_count(n_tensors, 24, "tensor count")?;
        let mut tensors = Vec::new();
        tensors
            .try_reserve_exact(n_tensors as usize)
            .map_err(|e| Error::format(&path, format!("tensor count {n_tensors} does not fit in memory: {e}")))?;
        let mut index = BTreeMap::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor #{i}"))?;
            let n_dims = r.u32(&format!("dimension count of tensor '{name}'"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::format(
                    &path,
                    format!("tensor '{name}' has {n_dims} dimensions (1..={MAX_DIMS} supported)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = r.u64(&format!("dimensions of tensor '{name}'"))?;
                dims.push(
                    usize::try_from(d)
                        .map_err(|_| Error::format(&path, format!("tensor '{name}' dimension {d} too large")))?,
                );
            }
            let raw_ty = r.u32(&format!("type of tensor '{name}'"))?;
            let ty = GgmlType::from_u32(raw_ty).ok_or_else(|| Error::TensorType {
                path: path.clone(),
                tensor: name.clone(),
                ty: format!("#{raw_ty}"),
                what: "is not a supported GGML tensor type".into(),
            })?;
            let offset = r.u64(&format!("offset of tensor '{name}'"))?;
            if offset % alignment != 0 {
                return Err(Error::format(
                    &path,
                    format!("tensor '{name}' offset {offset} is not aligned to {alignment}"),
                ));
            }
            let n_elems = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
            let size = n_elems
                .filter(|n| n.is_multiple_of(ty.block_size()) && dims[0].is_multiple_of(ty.block_size()))
                .and_then(|n| (n / ty.block_size()).checked_mul(ty.type_size()))
                .ok_or_else(|| {
                    Error::format(&path, format!("tensor '{name}' shape {dims:?} is invalid for type {ty}"))
                })?;
            if index.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::format(&path, format!("tensor '{name}' appears twice")));
            }
            tensors.push(TensorInfo { name, dims, ty, offset: offset as usize, size });
        }

        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        for t in &tensors {
            let end = data_offset.checked_add(t.offset as u64).and_then(|s| s.checked_add(t.size as u64));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(Error::format(
                        &path,
                        format!(
                            "tensor '{}' ({} bytes at data offset {}) lies past the end of the file ({} bytes): truncated or corrupt",
                            t.name, t.size, t.offset, file_len
                        ),
                    ));
                }
            }
        }
        Ok(Self { path, mmap, file, version, metadata, tensors, index, data_offset: data_offset as usize })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the mapped file in bytes.
    pub fn file_size(&self) -> usize {
        self.mmap.len()
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required metadata value, or an error naming the key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| self.meta_err(key, "is missing"))
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| self.meta_err(key, &format!("must be an unsigned integer, got {}", v.type_name())))
    }

    pub fn require_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.meta_err(key, &format!("must be a number, got {}", v.type_name())))
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.meta_err(key, &format!("must be a string, got {}", v.type_name())))
    }

    /// An optional string array (e.g. `tokenizer.ggml.tokens`).
    pub fn str_array(&self, key: &str) -> Result<Option<&StrList>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let arr = v.as_array().and_then(Array::as_strs);
        arr.map(Some).ok_or_else(|| self.meta_err(key, &format!("must be an array of strings, got {}", v.type_name())))
    }

    pub fn meta_err(&self, key: &str, detail: &str) -> Error {
        Error::Metadata { path: self.path.clone(), key: key.into(), detail: detail.into() }
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// A zero-copy view of a tensor's bytes, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<TensorView> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), tensor: name.into() })?;
        let start = self.data_offset + info.offset;
        Ok(TensorView {
            name: info.name.clone(),
            ty: info.ty,
            dims: info.dims.clone(),
            data: TensorData::mapped_file(self.mmap.clone(), self.file.clone(), start, info.size),
        })
    }
}

/// Bounds-checked little-endian cursor over the mapped file.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn truncated(&self, what: &str) -> Error {
        Error::format(self.path, format!("truncated file: unexpected end while reading {what} at byte {}", self.pos))
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| self.truncated(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let b = self.bytes(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects a count whose items (each at least `min_item` bytes) could
    /// not fit in what remains of the file.
    fn check_count(&self, count: u64, min_item: u64, what: &str) -> Result<()> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if count.saturating_mul(min_item) > remaining {
            return Err(Error::format(
                self.path,
                format!("{what} {count} cannot fit in the remaining {remaining} bytes: truncated or corrupt"),
            ));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        self.check_count(len, 1, &format!("length of {what}"))?;
        let b = self.bytes(len as usize, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| Error::format(self.path, format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = format!("value of '{key}'");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(Error::format(self.path, format!("metadata '{key}': invalid bool byte {b}"))),
            },
            8 => Value::String(self.string(&what)?),
            9 => Value::Array(self.array_value(key, depth)?),
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            t => return Err(Error::format(self.path, format!("metadata '{key}' has unknown value type {t}"))),
        })
    }

    /// An array value (after its type tag): element type, count, then the
    /// elements, read into one vector of that type.
    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array> {
        let what = format!("value of '{key}'");
        if depth >= MAX_ARRAY_DEPTH {
            return Err(Error::format(
                self.path,
                format!("metadata '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH}"),
            ));
        }
        let elem_ty = self.u32(&what)?;
        let n = self.u64(&what)?;
        self.check_count(n, min_value_size(elem_ty), &format!("element count of '{key}'"))?;
        if n > MAX_ARRAY_LEN {
            return Err(Error::format(
                self.path,
                format!("metadata '{key}' is an array of {n} elements (at most {MAX_ARRAY_LEN} supported)"),
            ));
        }
        let n = n as usize;
        let path = self.path;
        let oom = |e| Error::format(path, format!("metadata '{key}': {n} elements do not fit in memory: {e}"));
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let mut v: Vec<$t> = Vec::new();
                v.try_reserve_exact(n).map_err(oom)?;
                for _ in 0..n {
                    v.push(<$t>::from_le_bytes(self.array(&what)?));
                }
                Array::$variant(v)
            }};
        }
        Ok(match elem_ty {
            0 => fixed!(U8, u8),
            1 => fixed!(I8, i8),
            2 => fixed!(U16, u16),
            3 => fixed!(I16, i16),
            4 => fixed!(U32, u32),
            5 => fixed!(I32, i32),
            6 => fixed!(F32, f32),
            7 => {
                let mut v = Vec::new();
                v.try_reserve_exact(n).map_err(oom)?;
                for _ in 0..n {
                    v.push(match self.array::<1>(&what)?[0] {
                        0 => false,
                        1 => true,
                        b => return Err(Error::format(self.path, format!("metadata '{key}': invalid bool byte {b}"))),
                    });
                }
                Array::Bool(v)
            }
            8 => {
                // Two passes: the first checks every length and sums them,
                // so the text is one allocation of the exact size.
                let start = self.pos;
                let mut total = 0usize;
                for _ in 0..n {
                    let len = self.u64(&what)?;
                    if len > (self.buf.len() - self.pos) as u64 {
                        self.check_count(len, 1, &format!("length of {what}"))?;
                    }
                    self.bytes(len as usize, &what)?;
                    total += len as usize;
                }
                self.pos = start;
                let mut l = StrList::default();
                l.try_reserve(n, total).map_err(oom)?;
                for _ in 0..n {
                    let len = self.u64(&what)? as usize;
                    let b = self.bytes(len, &what)?;
                    let s = std::str::from_utf8(b)
                        .map_err(|_| Error::format(self.path, format!("{what} is not valid UTF-8")))?;
                    l.push(s);
                }
                Array::String(l)
            }
            9 => {
                let mut v = Vec::new();
                v.try_reserve_exact(n).map_err(oom)?;
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                Array::Array(v)
            }
            10 => fixed!(U64, u64),
            11 => fixed!(I64, i64),
            12 => fixed!(F64, f64),
            t => {
                return Err(Error::format(self.path, format!("metadata '{key}' has arrays of unknown value type {t}")));
            }
        })
    }
}

/// Smallest encoded size of a value of GGUF type `ty` (for count checks).
fn min_value_size(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Minimal GGUF writer for tests.
    pub(crate) fn build(kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)], data: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        for (k, ty, v) in kv {
            s(&mut b, k);
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(v);
        }
        for (name, dims, ty, off) in tensors {
            s(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
        }
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend_from_slice(data);
        b
    }

    fn open_bytes(bytes: &[u8]) -> Result<GgufFile> {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        GgufFile::open(f.path())
    }

    fn str_val(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    #[test]
    fn reads_metadata_nested_arrays_and_tensors() {
        // [[1u8, 2u8], [3u8]]
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend_from_slice(&2u64.to_le_bytes());
        nested.extend_from_slice(&0u32.to_le_bytes());
        nested.extend_from_slice(&2u64.to_le_bytes());
        nested.extend_from_slice(&[1, 2]);
        nested.extend_from_slice(&0u32.to_le_bytes());
        nested.extend_from_slice(&1u64.to_le_bytes());
        nested.extend_from_slice(&[3]);
        let data: Vec<u8> = (0..8u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let bytes = build(
            &[
                ("general.architecture", 8, str_val("llama")),
                ("x.f64", 12, 2.5f64.to_le_bytes().to_vec()),
                ("x.bool", 7, vec![1]),
                ("x.nested", 9, nested),
            ],
            &[("w", &[4, 2], 0, 0)],
            &data,
        );
        let g = open_bytes(&bytes).unwrap();
        assert_eq!(g.require_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.require_f64("x.f64").unwrap(), 2.5);
        assert_eq!(g.get("x.bool"), Some(&Value::Bool(true)));
        assert_eq!(
            g.get("x.nested"),
            Some(&Value::Array(Array::Array(vec![Array::U8(vec![1, 2]), Array::U8(vec![3])])))
        );
        let t = g.tensor("w").unwrap();
        assert_eq!(t.dims, vec![4, 2]);
        assert_eq!(t.data.bytes(), &data[..]);
    }

    #[test]
    fn bad_files_give_clear_errors() {
        let ok = build(&[], &[("w", &[4], 0, 0)], &[0u8; 16]);
        let msg = |b: &[u8]| open_bytes(b).unwrap_err().to_string();

        assert!(msg(b"GGML\x03\0\0\0").contains("not a GGUF file"), "{}", msg(b"GGML"));
        assert!(msg(&ok[..20]).contains("truncated"));
        // Data cut short: the tensor lies past the end.
        let m = msg(&ok[..ok.len() - 4]);
        assert!(m.contains("tensor 'w'") && m.contains("past the end"), "{m}");
        // Unknown tensor type id 99.
        let bad_ty = build(&[], &[("w", &[4], 99, 0)], &[0u8; 16]);
        let m = msg(&bad_ty);
        assert!(m.contains("tensor 'w'") && m.contains("#99"), "{m}");
        // Huge metadata count must not allocate.
        let mut huge = ok.clone();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(msg(&huge).contains("truncated"));
        // An array longer than any real one is refused, naming the key,
        // before its elements are decoded (32 bytes each).
        let n = MAX_ARRAY_LEN + 1;
        let mut arr = 0u32.to_le_bytes().to_vec();
        arr.extend_from_slice(&n.to_le_bytes());
        arr.resize(arr.len() + n as usize, 0);
        let m = msg(&build(&[("x.big", 9, arr)], &[("w", &[4], 0, 0)], &[0u8; 16]));
        assert!(m.contains("'x.big'") && m.contains("16777217 elements"), "{m}");
        // String arrays: an element running past the end, and one that is
        // not UTF-8, each named by its key.
        let strings = |elems: &[&[u8]], lens: &[u64]| {
            let mut a = 8u32.to_le_bytes().to_vec();
            a.extend_from_slice(&(elems.len() as u64).to_le_bytes());
            for (e, l) in elems.iter().zip(lens) {
                a.extend_from_slice(&l.to_le_bytes());
                a.extend_from_slice(e);
            }
            msg(&build(&[("x.strs", 9, a)], &[("w", &[4], 0, 0)], &[0u8; 16]))
        };
        let m = strings(&[b"ok", b"long"], &[2, 1 << 40]);
        assert!(m.contains("'x.strs'") && m.contains("cannot fit"), "{m}");
        let m = strings(&[b"ok", b"\xff\xfe"], &[2, 2]);
        assert!(m.contains("'x.strs'") && m.contains("not valid UTF-8"), "{m}");
        // Offset past the end.
        let past = build(&[], &[("w", &[4], 0, 1 << 20)], &[0u8; 16]);
        assert!(msg(&past).contains("past the end"));
        // Missing tensor.
        let g = open_bytes(&ok).unwrap();
        assert!(g.tensor("nope").unwrap_err().to_string().contains("tensor 'nope' not found"));
    }
}
