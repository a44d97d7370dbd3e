//! Metadata values and the typed reads of [`GgufFile`](super::GgufFile).
//!
//! GGUF stores thirteen value types (ids 0..=12, [`MetaValue::type_id`]); a typed read
//! ([`GgufFile::uint`](super::GgufFile::uint), ...) accepts every stored type that holds
//! the asked-for value exactly (any integer type for an unsigned count that is >= 0) and
//! otherwise names the type it found.

use std::fmt;

use crate::error::{Error, Result};

/// One metadata value, as stored.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `uint8` (type 0).
    U8(u8),
    /// `int8` (type 1).
    I8(i8),
    /// `uint16` (type 2).
    U16(u16),
    /// `int16` (type 3).
    I16(i16),
    /// `uint32` (type 4).
    U32(u32),
    /// `int32` (type 5).
    I32(i32),
    /// `float32` (type 6).
    F32(f32),
    /// `bool` (type 7): one byte, 0 or 1.
    Bool(bool),
    /// `string` (type 8): a u64 length and UTF-8 bytes.
    Str(String),
    /// `array` (type 9): an element type, a u64 count and the elements (all of that type;
    /// arrays of arrays are refused, as by ggml).
    Array(Vec<MetaValue>),
    /// `uint64` (type 10).
    U64(u64),
    /// `int64` (type 11).
    I64(i64),
    /// `float64` (type 12).
    F64(f64),
}

/// The GGUF name of value type `id` (`uint32`, `string`, ...), if it is one.
pub(super) fn type_name(id: u32) -> Option<&'static str> {
    const NAMES: [&str; 13] = [
        "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string",
        "array", "uint64", "int64", "float64",
    ];
    NAMES.get(id as usize).copied()
}

impl MetaValue {
    /// GGUF's id of the value's type (0 `uint8` ... 12 `float64`).
    pub fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }

    /// The type in words: `uint32`, `string`, `array of 49152 string`.
    pub fn type_desc(&self) -> String {
        match self {
            MetaValue::Array(v) => match v.first() {
                Some(e) => format!("array of {} {}", v.len(), e.type_desc()),
                None => "empty array".into(),
            },
            v => type_name(v.type_id()).unwrap_or("?").into(),
        }
    }

    /// The value as a signed integer, if it is an integer of any width.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as an unsigned integer: any integer type holding a value >= 0.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// The value as a float: `float32`, `float64` or an integer (converted with rounding
    /// when beyond 2^53).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Scalars as written; strings quoted; arrays of more than 8 elements abridged.
impl fmt::Display for MetaValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            MetaValue::Str(s) => write!(f, "{s:?}"),
            MetaValue::Array(v) => {
                f.write_str("[")?;
                for (i, e) in v.iter().take(8).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{e}")?;
                }
                if v.len() > 8 {
                    write!(f, ", ... ({} in all)", v.len())?;
                }
                f.write_str("]")
            }
            v => write!(f, "{}", v.as_i128().unwrap_or_default()),
        }
    }
}

/// Typed reads of the metadata: errors name the file, the key and the type found.
impl super::GgufFile {
    fn meta_err(&self, key: &str, message: String) -> Error {
        Error::Config {
            path: self.path().to_path_buf(),
            message: format!("metadata `{key}`: {message}"),
        }
    }

    /// `key`'s value through `read`; `None` when absent, an error naming the type found
    /// when `read` refuses it (`expected`: what it accepts, in words).
    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        read: impl Fn(&'s MetaValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match read(v) {
                Some(t) => Ok(Some(t)),
                None => Err(self.meta_err(key, format!("expected {expected}, found {}", found(v)))),
            },
        }
    }

    fn required<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        read: impl Fn(&'s MetaValue) -> Option<T>,
    ) -> Result<T> {
        self.typed(key, expected, read)?
            .ok_or_else(|| self.meta_err(key, format!("missing (expected {expected})")))
    }

    /// The string `key`.
    pub fn str(&self, key: &str) -> Result<&str> {
        self.required(key, "a string", MetaValue::as_str)
    }

    /// The unsigned integer `key`: any integer type holding a value >= 0.
    pub fn uint(&self, key: &str) -> Result<u64> {
        self.required(key, UINT, MetaValue::as_u64)
    }

    /// The number `key`: `float32`, `float64` or an integer.
    pub fn float(&self, key: &str) -> Result<f64> {
        self.required(key, FLOAT, MetaValue::as_f64)
    }

    /// [`uint`](Self::uint), `None` when `key` is absent.
    pub fn opt_uint(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, UINT, MetaValue::as_u64)
    }

    /// [`float`](Self::float), `None` when `key` is absent.
    pub fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, FLOAT, MetaValue::as_f64)
    }

    /// The array of strings `key` (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    pub fn strings(&self, key: &str) -> Result<Vec<&str>> {
        self.required(key, "an array of strings", |v| {
            v.as_array()?.iter().map(MetaValue::as_str).collect()
        })
    }

    /// The array of floats `key` (`tokenizer.ggml.scores`): `float32` elements (or
    /// `float64`, rounded).
    pub fn floats(&self, key: &str) -> Result<Vec<f32>> {
        self.required(key, "an array of floats", |v| {
            v.as_array()?
                .iter()
                .map(|e| match *e {
                    MetaValue::F32(x) => Some(x),
                    MetaValue::F64(x) => Some(x as f32),
                    _ => None,
                })
                .collect()
        })
    }

    /// The array of integers `key` (`tokenizer.ggml.token_type`): elements of any
    /// integer type within i64's range.
    pub fn ints(&self, key: &str) -> Result<Vec<i64>> {
        self.required(key, "an array of integers", |v| {
            v.as_array()?
                .iter()
                .map(|e| e.as_i128().and_then(|x| i64::try_from(x).ok()))
                .collect()
        })
    }

    /// The model's architecture (`general.architecture`: `llama`, `gemma3`).
    pub fn architecture(&self) -> Result<&str> {
        self.str("general.architecture")
    }
}

const UINT: &str = "an unsigned integer";
const FLOAT: &str = "a number";

/// A found value for messages: its type, and the value itself when short.
fn found(v: &MetaValue) -> String {
    let shown = v.to_string();
    if matches!(v, MetaValue::Array(_)) || shown.chars().count() > 40 {
        v.type_desc()
    } else {
        format!("{} {shown}", v.type_desc())
    }
}
