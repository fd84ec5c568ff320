//! GGUF metadata arrays, stored by element type: a 262,144-token
//! vocabulary's token list is one buffer of text and one of ends, its
//! scores one `Vec<f32>`, not 262,144 boxed values each (32 bytes a value
//! plus a heap allocation a string: about 25 MB for Gemma 3's tokenizer
//! metadata, against about 4 MB stored by type).

/// A metadata array. Arrays of arrays nest (no real file nests more than
/// one level).
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(StrList),
    Array(Vec<Array>),
}

/// Matches every variant: `$body` with `$v` bound to the element vector
/// of any numeric or bool one, `$strs` with `$s` bound to the strings,
/// `$nested` with `$n` bound to the nested arrays.
macro_rules! by_type {
    ($a:expr, $v:ident => $body:expr, $s:ident => $strs:expr, $n:ident => $nested:expr) => {
        match $a {
            Array::U8($v) => $body,
            Array::I8($v) => $body,
            Array::U16($v) => $body,
            Array::I16($v) => $body,
            Array::U32($v) => $body,
            Array::I32($v) => $body,
            Array::U64($v) => $body,
            Array::I64($v) => $body,
            Array::F32($v) => $body,
            Array::F64($v) => $body,
            Array::Bool($v) => $body,
            Array::String($s) => $strs,
            Array::Array($n) => $nested,
        }
    };
}

impl Array {
    pub fn len(&self) -> usize {
        by_type!(self, v => v.len(), s => s.len(), a => a.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// GGUF's name of the element type (`u8`, `string`, `array`, …).
    pub fn elem_type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "u8",
            Array::I8(_) => "i8",
            Array::U16(_) => "u16",
            Array::I16(_) => "i16",
            Array::U32(_) => "u32",
            Array::I32(_) => "i32",
            Array::U64(_) => "u64",
            Array::I64(_) => "i64",
            Array::F32(_) => "f32",
            Array::F64(_) => "f64",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
        }
    }

    /// Element `i` as an unsigned integer, if it is an integer holding a
    /// non-negative value.
    pub fn u64_at(&self, i: usize) -> Option<u64> {
        match self {
            Array::U8(v) => v.get(i).map(|&x| x.into()),
            Array::U16(v) => v.get(i).map(|&x| x.into()),
            Array::U32(v) => v.get(i).map(|&x| x.into()),
            Array::U64(v) => v.get(i).copied(),
            Array::I8(v) => v.get(i).and_then(|&x| u64::try_from(x).ok()),
            Array::I16(v) => v.get(i).and_then(|&x| u64::try_from(x).ok()),
            Array::I32(v) => v.get(i).and_then(|&x| u64::try_from(x).ok()),
            Array::I64(v) => v.get(i).and_then(|&x| u64::try_from(x).ok()),
            _ => None,
        }
    }

    /// Element `i` as a number (any integer or float type).
    pub fn f64_at(&self, i: usize) -> Option<f64> {
        match self {
            Array::F32(v) => v.get(i).map(|&x| x.into()),
            Array::F64(v) => v.get(i).copied(),
            Array::I8(v) => v.get(i).map(|&x| x.into()),
            Array::I16(v) => v.get(i).map(|&x| x.into()),
            Array::I32(v) => v.get(i).map(|&x| x.into()),
            Array::I64(v) => v.get(i).map(|&x| x as f64),
            _ => self.u64_at(i).map(|x| x as f64),
        }
    }

    /// Every element as an unsigned integer, or `None` if any is not one.
    pub fn to_u64s(&self) -> Option<Vec<u64>> {
        (0..self.len()).map(|i| self.u64_at(i)).collect()
    }

    /// The strings, if this is an array of strings.
    pub fn as_strs(&self) -> Option<&StrList> {
        match self {
            Array::String(s) => Some(s),
            _ => None,
        }
    }

    /// Element `i` rendered for `inspect` and error messages.
    pub fn render_at(&self, i: usize) -> Option<String> {
        by_type!(
            self,
            v => v.get(i).map(|x| format!("{x:?}")),
            s => s.get(i).map(|x| format!("{x:?}")),
            a => a.get(i).map(|x| format!("[{}; {}]", x.elem_type_name(), x.len()))
        )
    }
}

/// Strings stored end to end in one buffer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StrList {
    text: String,
    /// `ends[i]` is where string `i` ends in `text`; it starts where
    /// string `i - 1` ends.
    ends: Vec<usize>,
}

impl StrList {
    /// Room for `strings` more strings of `bytes` bytes in all.
    ///
    /// # Errors
    ///
    /// The allocator's, when they do not fit in memory.
    pub fn try_reserve(&mut self, strings: usize, bytes: usize) -> Result<(), std::collections::TryReserveError> {
        self.text.try_reserve_exact(bytes)?;
        self.ends.try_reserve_exact(strings)
    }

    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.text[start..end])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i).unwrap_or_default())
    }
}

impl<'a> FromIterator<&'a str> for StrList {
    fn from_iter<I: IntoIterator<Item = &'a str>>(it: I) -> Self {
        let mut l = StrList::default();
        for s in it {
            l.push(s);
        }
        l
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn str_list_round_trips_and_accessors_convert_by_type() {
        let l: StrList = ["a", "", "▁the", "<0x0A>"].into_iter().collect();
        assert_eq!(l.len(), 4);
        assert_eq!(l.iter().collect::<Vec<_>>(), ["a", "", "▁the", "<0x0A>"]);
        assert_eq!(l.get(4), None);

        let a = Array::I32(vec![1, -1, 6]);
        assert_eq!(a.u64_at(0), Some(1));
        assert_eq!(a.u64_at(1), None, "negative");
        assert_eq!(a.to_u64s(), None);
        assert_eq!((0..3).map(|i| a.f64_at(i)).collect::<Vec<_>>(), [Some(1.0), Some(-1.0), Some(6.0)]);
        assert_eq!(Array::F32(vec![0.5]).u64_at(0), None, "a float is not an integer");
        assert_eq!(Array::String(l).f64_at(0), None);
        assert_eq!(Array::Bool(vec![true]).render_at(0).as_deref(), Some("true"));
    }
}
