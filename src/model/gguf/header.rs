//! The GGUF header: magic, version, metadata and the tensor directory, every read
//! bounds-checked against the file.
//!
//! Layout (little-endian; llama.cpp's `docs/gguf.md`, versions 2 and 3 alike):
//!
//! ```text
//! magic "GGUF" | version: u32 | n_tensors: u64 | n_kv: u64
//! n_kv x      { key: string | value_type: u32 | value }
//! n_tensors x { name: string | n_dims: u32 | dims: [u64; n_dims] | ggml_type: u32 | offset: u64 }
//! padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
//! string = len: u64 | UTF-8 bytes;  array value = elem_type: u32 | count: u64 | elements
//! ```
//!
//! Hostile input gives an error, never a panic or an allocation a claimed count alone
//! decides: every count and length is checked against the bytes that remain before
//! anything is reserved (an element needs at least one byte, a tensor entry 24), every
//! size and offset is computed with checked arithmetic. What it accepts is what ggml's
//! `gguf.cpp` accepts: version 2 or 3, unique keys and tensor names, no arrays of arrays,
//! at most 4 dims, `ne0` a multiple of the type's block, offsets that are multiples of
//! the alignment, tensors inside the file and not overlapping each other.

use std::collections::HashMap;
use std::path::Path;

use super::metadata::{MetaValue, type_name};
use super::types::{GgmlType, retired_name};
use super::{MAX_DIMS, TensorInfo};
use crate::error::{Error, Result};

/// GGUF's default `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;

/// The parsed header.
pub(super) struct Header {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    pub data_offset: usize,
}

/// Parse the header of the GGUF file `buf` (read from `path`, for messages) and check
/// its tensor directory against the file's size.
pub(super) fn parse(path: &Path, buf: &[u8]) -> Result<Header> {
    let mut r = Reader { buf, pos: 0, path };
    let magic = r.array::<4>(&|| "magic".into())?;
    if &magic != b"GGUF" {
        return Err(r.err(
            0,
            format!("not a GGUF file: magic {magic:02x?}, expected \"GGUF\""),
        ));
    }
    let version = r.u32(&|| "version".into())?;
    if matches!(version.swap_bytes(), 2 | 3) {
        let message = "a big-endian GGUF file: phaselens reads little-endian ones".into();
        return Err(r.err(4, message));
    }
    if version != 2 && version != 3 {
        return Err(r.err(
            4,
            format!("GGUF version {version}: phaselens reads versions 2 and 3"),
        ));
    }
    let n_tensors = r.count(24, &|| "tensor count".into())?;
    let n_kv = r.count(13, &|| "metadata count".into())?;
    let metadata = read_metadata(&mut r, n_kv)?;
    let alignment = alignment(&r, &metadata)?;
    let tensors = read_tensor_infos(&mut r, n_tensors)?;
    let data_offset = r
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| r.err(r.pos, format!("padding to alignment {alignment} overflows")))?;
    check_tensors(path, buf.len(), &tensors, alignment, data_offset)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// A cursor over the file's bytes; every read says what it read when the file ends.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

/// What a read is for, formatted only when it fails (`metadata key `x``).
type What<'w> = &'w dyn Fn() -> String;

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn err(&self, at: usize, message: String) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            message: format!("{message} (at byte {at})"),
        }
    }

    fn bytes(&mut self, n: usize, what: What) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(
                self.pos,
                format!(
                    "{}: needs {n} bytes, the file ends {} bytes later",
                    what(),
                    self.remaining()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: What) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: What) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: What) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A u64 count of items that take at least `min_bytes` each in the rest of the file.
    fn count(&mut self, min_bytes: usize, what: What) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let most = self.remaining() / min_bytes;
        match usize::try_from(n) {
            Ok(n) if n <= most => Ok(n),
            _ => Err(self.err(
                at,
                format!(
                    "{} {n}: the {} bytes left hold at most {most} (at least {min_bytes} bytes each)",
                    what(),
                    self.remaining()
                ),
            )),
        }
    }

    fn string(&mut self, what: What) -> Result<&'a str> {
        let at = self.pos;
        let len = self.count(1, &|| format!("{}: string length", what()))?;
        let bytes = self.bytes(len, what)?;
        std::str::from_utf8(bytes).map_err(|e| self.err(at, format!("{}: not UTF-8 ({e})", what())))
    }
}

fn read_metadata(r: &mut Reader, n_kv: usize) -> Result<Vec<(String, MetaValue)>> {
    let mut metadata = Vec::with_capacity(n_kv);
    let mut seen = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let at = r.pos;
        let key = r.string(&|| format!("metadata key {i}"))?.to_string();
        if let Some(j) = seen.insert(key.clone(), i) {
            return Err(r.err(at, format!("metadata `{key}`: key {i} repeats key {j}")));
        }
        let what = || format!("metadata `{key}`");
        let ty = r.u32(&|| format!("{}: value type", what()))?;
        let value = read_value(r, ty, &what)?;
        metadata.push((key, value));
    }
    Ok(metadata)
}

/// Bytes an element of value type `ty` takes at least.
fn min_size(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        9 => 12,
        _ => 8,
    }
}

fn read_value(r: &mut Reader, ty: u32, what: What) -> Result<MetaValue> {
    let at = r.pos;
    Ok(match ty {
        0 => MetaValue::U8(u8::from_le_bytes(r.array(what)?)),
        1 => MetaValue::I8(i8::from_le_bytes(r.array(what)?)),
        2 => MetaValue::U16(u16::from_le_bytes(r.array(what)?)),
        3 => MetaValue::I16(i16::from_le_bytes(r.array(what)?)),
        4 => MetaValue::U32(u32::from_le_bytes(r.array(what)?)),
        5 => MetaValue::I32(i32::from_le_bytes(r.array(what)?)),
        6 => MetaValue::F32(f32::from_le_bytes(r.array(what)?)),
        7 => match r.array::<1>(what)? {
            [0] => MetaValue::Bool(false),
            [1] => MetaValue::Bool(true),
            [b] => return Err(r.err(at, format!("{}: bool {b}, expected 0 or 1", what()))),
        },
        8 => MetaValue::Str(r.string(what)?.to_string()),
        9 => read_array(r, what)?,
        10 => MetaValue::U64(u64::from_le_bytes(r.array(what)?)),
        11 => MetaValue::I64(i64::from_le_bytes(r.array(what)?)),
        12 => MetaValue::F64(f64::from_le_bytes(r.array(what)?)),
        _ => return Err(r.err(at, format!("{}: unknown value type {ty}", what()))),
    })
}

fn read_array(r: &mut Reader, what: What) -> Result<MetaValue> {
    let at = r.pos;
    let ty = r.u32(&|| format!("{}: array element type", what()))?;
    match type_name(ty) {
        Some("array") => {
            return Err(r.err(
                at,
                format!("{}: arrays of arrays are not supported", what()),
            ));
        }
        None => {
            return Err(r.err(at, format!("{}: unknown array element type {ty}", what())));
        }
        Some(_) => {}
    }
    let n = r.count(min_size(ty), &|| format!("{}: array length", what()))?;
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        v.push(read_value(r, ty, &|| format!("{}[{i}]", what()))?);
    }
    Ok(MetaValue::Array(v))
}

/// `general.alignment` (a power of two), or 32 when absent.
fn alignment(r: &Reader, metadata: &[(String, MetaValue)]) -> Result<usize> {
    let Some((_, v)) = metadata.iter().find(|(k, _)| k == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match v.as_u64().and_then(|a| usize::try_from(a).ok()) {
        Some(a) if a.is_power_of_two() => Ok(a),
        _ => Err(Error::Config {
            path: r.path.to_path_buf(),
            message: format!(
                "metadata `general.alignment`: {v} ({}), expected a power of two",
                v.type_desc()
            ),
        }),
    }
}

fn read_tensor_infos(r: &mut Reader, n_tensors: usize) -> Result<Vec<TensorInfo>> {
    let mut tensors = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(&|| format!("tensor {i}'s name"))?.to_string();
        let what = || format!("tensor `{name}`");
        let at = r.pos;
        let n_dims = r.u32(&|| format!("{}: n_dims", what()))?;
        if n_dims as usize > MAX_DIMS {
            let message = format!("{n_dims} dims, at most {MAX_DIMS} (at byte {at})");
            return Err(Error::tensor(r.path, name, message));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(r.u64(&|| format!("{}: dim {d}", what()))?);
        }
        let at = r.pos;
        let id = r.u32(&|| format!("{}: type", what()))?;
        let Some(ggml_type) = GgmlType::from_id(id) else {
            let known = match retired_name(id) {
                Some(n) => format!(" ({n}: removed from ggml or never stored)"),
                None => " (unknown to ggml)".into(),
            };
            let message = format!("ggml type {id}{known} is not supported (at byte {at})");
            return Err(Error::tensor(r.path, name, message));
        };
        let offset = r.u64(&|| format!("{}: offset", what()))?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    Ok(tensors)
}

/// Every tensor's size fits usize and its type's blocks, its data lies aligned inside the
/// file, names are unique and no two tensors share bytes.
fn check_tensors(
    path: &Path,
    file_len: usize,
    tensors: &[TensorInfo],
    alignment: usize,
    data_offset: usize,
) -> Result<()> {
    let mut seen = HashMap::with_capacity(tensors.len());
    let mut spans = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let fail = |m: String| Err(Error::tensor(path, &t.name, m));
        if let Some(j) = seen.insert(t.name.as_str(), i) {
            return fail(format!("tensor {i} repeats the name of tensor {j}"));
        }
        let (start, end) = match t.span(data_offset, alignment) {
            Ok(s) => s,
            Err(m) => return fail(m),
        };
        if end > file_len {
            return fail(format!(
                "its {} bytes of {} at bytes {start}..{end} run past the file's end at {file_len}",
                end - start,
                t.ggml_type
            ));
        }
        if end > start {
            spans.push((start, end, i));
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (w[0], w[1]);
        if b_start < a_end {
            let message = format!(
                "its data at byte {b_start} overlaps tensor `{}` (which ends at {a_end})",
                tensors[a].name
            );
            return Err(Error::tensor(path, &tensors[b].name, message));
        }
    }
    Ok(())
}
