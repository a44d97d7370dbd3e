//! GGUF files (llama.cpp's model container, versions 2 and 3): the header, the metadata,
//! the tensor directory, and the dequantisation of ggml's block formats to f32.
//!
//! [`GgufFile::open`] maps the file and checks its whole header against the file's size
//! (`header.rs` lists what is refused); the tensors' bytes stay in the map until
//! [`GgufFile::dequantize`] (a whole tensor) or [`GgufFile::dequantize_rows`] (rows of
//! it, e.g. an embedding lookup) turns them into f32 values, bit-identical to ggml's
//! reference `dequantize_row_*` and to the `gguf` Python package (tests/it/gguf.rs checks
//! every tensor of the two pretrained models by SHA-256). docs/models.md, "GGUF".
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`GgufFile`] (open, typed metadata reads, tensor bytes, dequantisation), [`TensorInfo`] |
//! | `header.rs` | the parser: magic, version, key/values, tensor directory, alignment, bounds |
//! | `metadata.rs` | [`MetaValue`]: the 13 value types and their typed reads |
//! | `types.rs` | [`GgmlType`]: ggml's type ids, names, block and type sizes |
//! | `quant.rs` | one decoder per block format (its layout in its doc) and [`dequantize`] |
//!
//! Shapes: GGUF stores dims fastest-first (`ne0` = the row length); [`TensorInfo::shape`]
//! reverses them into the row-major order of PyTorch and burn (`[ne1, ne0]` for a
//! matrix), and dequantised values come out in that order.

mod header;
mod metadata;
mod quant;
mod types;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};

pub use header::DEFAULT_ALIGNMENT;
pub use metadata::MetaValue;
pub use quant::dequantize;
pub use types::{GgmlType, retired_name};

/// Most dims a GGUF tensor has (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// The dims as stored: `ne0` (the fastest, the row length) first.
    pub dims: Vec<u64>,
    /// How its values are stored.
    pub ggml_type: GgmlType,
    /// Where its bytes start, relative to the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The shape in row-major order (PyTorch's, burn's): the dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| to_usize(d)).collect()
    }

    /// Values in the tensor (saturating at `usize::MAX` for a directory entry
    /// [`GgufFile::open`] would refuse).
    pub fn n_elements(&self) -> usize {
        self.checked_elements().unwrap_or(usize::MAX)
    }

    /// Bytes of its stored data (saturating like [`n_elements`](Self::n_elements)).
    pub fn n_bytes(&self) -> usize {
        self.checked_bytes().unwrap_or(usize::MAX)
    }

    /// The row length (`ne0`; 1 for a scalar).
    fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| to_usize(d))
    }

    fn checked_elements(&self) -> std::result::Result<usize, String> {
        self.dims.iter().try_fold(1usize, |n, &d| {
            usize::try_from(d)
                .ok()
                .and_then(|d| n.checked_mul(d))
                .ok_or_else(|| format!("dims {:?} hold more values than usize counts", self.dims))
        })
    }

    fn checked_bytes(&self) -> std::result::Result<usize, String> {
        let n = self.checked_elements()?;
        let (bs, ts) = (self.ggml_type.block_size(), self.ggml_type.type_size());
        if !self.row_len().is_multiple_of(bs) {
            return Err(format!(
                "rows of {} values (dims {:?}) do not split into {}'s blocks of {bs}",
                self.row_len(),
                self.dims,
                self.ggml_type
            ));
        }
        (n / bs).checked_mul(ts).ok_or_else(|| {
            format!(
                "dims {:?} of {} overflow usize bytes",
                self.dims, self.ggml_type
            )
        })
    }

    /// Its bytes' range in the file, given the data section's start; checks the size and
    /// the offset's alignment, not the file's end.
    fn span(
        &self,
        data_offset: usize,
        alignment: usize,
    ) -> std::result::Result<(usize, usize), String> {
        let n = self.checked_bytes()?;
        if !self.offset.is_multiple_of(alignment as u64) {
            return Err(format!(
                "offset {} is not a multiple of the alignment {alignment}",
                self.offset
            ));
        }
        let start = usize::try_from(self.offset)
            .ok()
            .and_then(|o| o.checked_add(data_offset));
        match start.and_then(|s| Some((s, s.checked_add(n)?))) {
            Some(span) => Ok(span),
            None => Err(format!(
                "offset {} + {n} bytes overflows usize",
                self.offset
            )),
        }
    }
}

fn to_usize(d: u64) -> usize {
    usize::try_from(d).unwrap_or(usize::MAX)
}

/// An open GGUF file: its header parsed and checked, its tensor data mapped.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Map `path` and parse its header; every count, length and offset is checked against
    /// the file's size, so a truncated or hostile file is an error naming the key or
    /// tensor and the byte offset, never a panic.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            let message = "empty file, not a GGUF file".into();
            return Err(Error::Config {
                path: path.into(),
                message,
            });
        }
        // SAFETY: the map is read-only and lives in this struct with the file's bytes
        // borrowed from it only through `&self`. As with every mapped reader, another
        // process truncating or rewriting the model file while it is open is outside what
        // the program can guard against; phaselens never writes a file it has mapped.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let h = header::parse(path, &mmap)?;
        let index = h
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: h.version,
            metadata: h.metadata,
            tensors: h.tensors,
            index,
            alignment: h.alignment,
            data_offset: h.data_offset,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data section's alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Every metadata key and value, in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`, else an error naming the file and the tensor.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        match self.index.get(name) {
            Some(&i) => Ok(&self.tensors[i]),
            None => Err(Error::tensor(
                &self.path,
                name,
                format!("not in the file ({} tensors)", self.tensors.len()),
            )),
        }
    }

    /// The stored bytes of `t`, a tensor of this file (empty when `t`'s span does not lie
    /// inside the file).
    pub fn raw(&self, t: &TensorInfo) -> &[u8] {
        t.span(self.data_offset, self.alignment)
            .ok()
            .and_then(|(start, end)| self.mmap.get(start..end))
            .unwrap_or(&[])
    }

    /// The whole tensor `name` as f32, row-major with `ne0` fastest (the order of
    /// [`TensorInfo::shape`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        self.dequantize_bytes(t, self.raw(t), t.n_elements())
    }

    /// Rows `rows` of the tensor `name` seen as a `[ne1 * ne2 * ne3, ne0]` matrix, as f32
    /// (`rows.len() * ne0` values).
    pub fn dequantize_rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        let row_len = t.row_len();
        let n_rows = t.n_elements().checked_div(row_len).unwrap_or(0);
        if rows.start > rows.end || rows.end > n_rows {
            let message = format!(
                "rows {rows:?} of a tensor of {n_rows} rows (shape {:?})",
                t.shape()
            );
            return Err(Error::tensor(&self.path, name, message));
        }
        let row_bytes = row_len / t.ggml_type.block_size() * t.ggml_type.type_size();
        let bytes = &self.raw(t)[rows.start * row_bytes..rows.end * row_bytes];
        self.dequantize_bytes(t, bytes, rows.len() * row_len)
    }

    fn dequantize_bytes(&self, t: &TensorInfo, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
        let fail = |m: String| Error::tensor(&self.path, &t.name, m);
        if !t.ggml_type.dequantizable() {
            return Err(fail(format!(
                "its type {} (ggml type {}) cannot be dequantised; phaselens reads {}",
                t.ggml_type,
                t.ggml_type.id(),
                quant::supported_names()
            )));
        }
        let mut out = vec![0f32; n];
        quant::dequantize_into(t.ggml_type, bytes, &mut out).map_err(fail)?;
        Ok(out)
    }
}
