//! Reading and writing safetensors files tensor by tensor.
//!
//! Reading parses each file's header once and then reads one tensor at a time with a
//! positioned read, so loading a sharded checkpoint never holds more than the model in
//! the compute dtype plus one source tensor (no whole-file buffers, no mmap pages).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Element types phaselens reads from checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDtype {
    F64,
    F32,
    F16,
    BF16,
    /// float8 e4m3 ("fn" variant: no infinities, NaN = S.1111.111).
    F8E4M3,
    /// float8 e8m0 (power-of-two scales used by some FP8 releases).
    F8E8M0,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl StDtype {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F64" => StDtype::F64,
            "F32" => StDtype::F32,
            "F16" => StDtype::F16,
            "BF16" => StDtype::BF16,
            "F8_E4M3" => StDtype::F8E4M3,
            "F8_E8M0" => StDtype::F8E8M0,
            "I64" => StDtype::I64,
            "I32" => StDtype::I32,
            "I16" => StDtype::I16,
            "I8" => StDtype::I8,
            "U8" => StDtype::U8,
            "BOOL" => StDtype::Bool,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            StDtype::F64 | StDtype::I64 => 8,
            StDtype::F32 | StDtype::I32 => 4,
            StDtype::F16 | StDtype::BF16 | StDtype::I16 => 2,
            StDtype::F8E4M3 | StDtype::F8E8M0 | StDtype::I8 | StDtype::U8 | StDtype::Bool => 1,
        }
    }

    /// Whether values are floating point.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            StDtype::F64
                | StDtype::F32
                | StDtype::F16
                | StDtype::BF16
                | StDtype::F8E4M3
                | StDtype::F8E8M0
        )
    }
}

/// Decode one float8 e4m3fn value.
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * (man / 8.0) * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Decode one float8 e8m0 value (an unsigned power of two, 0xFF = NaN).
pub fn f8_e8m0_to_f32(b: u8) -> f32 {
    if b == 0xff {
        f32::NAN
    } else {
        2f32.powi(b as i32 - 127)
    }
}

/// Little-endian `bytes` of a float tensor of `dtype` as f32 values (F64 / F32 / F16 /
/// BF16 / F8_E4M3 / F8_E8M0); `None` for any other dtype. The one decoder of every
/// float read, so a weight kept as stored dequantises to the values a load to f32 gives.
pub fn decode_floats(dtype: StDtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        StDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        StDtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        StDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::F8E4M3 => bytes.iter().map(|&b| f8_e4m3_to_f32(b)).collect(),
        StDtype::F8E8M0 => bytes.iter().map(|&b| f8_e8m0_to_f32(b)).collect(),
        _ => return None,
    })
}

/// The tensors of one file must tile its data section: sorted by offset, each starts
/// where the previous one ended, from the first byte after the header to the end of
/// the file. Overlapping tensors (two names reading the same bytes), gaps and trailing
/// bytes mean a corrupt or hand-edited header and are named.
fn check_layout(
    path: &Path,
    tensors: &BTreeMap<String, TensorEntry>,
    file: usize,
    data_start: u64,
    file_len: u64,
) -> Result<()> {
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .filter(|(_, e)| e.file == file)
        .map(|(n, e)| (e.start, e.start + e.len, n.as_str()))
        .collect();
    spans.sort();
    let mut end = data_start;
    let mut prev: Option<&str> = None;
    for &(start, stop, name) in &spans {
        if start < end {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "its bytes overlap tensor `{}` (its data_offsets start at {} but `{0}` ends at {})",
                    prev.unwrap_or("?"),
                    start - data_start,
                    end - data_start
                ),
            ));
        }
        if start > end {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "no tensor in the header claims data bytes {}..{} ({} unclaimed bytes before \
                     this tensor): a tensor is missing from the header, or this tensor's \
                     data_offsets (starting at {}) are wrong",
                    end - data_start,
                    start - data_start,
                    start - end,
                    start - data_start
                ),
            ));
        }
        end = stop;
        prev = Some(name);
    }
    if end != file_len {
        return Err(Error::Safetensors {
            path: path.to_path_buf(),
            message: format!(
                "the tensors cover {} bytes of data but the file holds {} after the header (trailing bytes no tensor claims)",
                end - data_start,
                file_len - data_start
            ),
        });
    }
    Ok(())
}

/// An error naming `name` when `values` hold NaN or infinities (weights never do in a
/// trained model; they make every logit NaN, which would read as a finding).
pub fn check_finite(path: &Path, name: &str, values: &[f32]) -> Result<()> {
    let mut c = FiniteCheck::default();
    c.feed(values);
    c.finish(path, name)
}

/// Values per task of [`FiniteCheck::feed`].
const FINITE_BLOCK: usize = 1 << 16;

/// [`check_finite`] over a tensor's values fed in parts (a tensor dequantised row block
/// by row block), with the same error.
#[derive(Debug, Default)]
pub struct FiniteCheck {
    seen: usize,
    bad: usize,
    /// Flat index and value of the first non-finite value.
    first: Option<(usize, f32)>,
}

impl FiniteCheck {
    /// The next `values` of the tensor. Counted in blocks over the rayon pool, each
    /// block in one branch-free pass; the first bad value is looked for only when
    /// there is one (a checkpoint's load checks every value it dequantises).
    pub fn feed(&mut self, values: &[f32]) {
        use rayon::prelude::*;
        let count = |c: &[f32]| c.iter().map(|v| usize::from(!v.is_finite())).sum::<usize>();
        let bad: usize = values.par_chunks(FINITE_BLOCK).map(count).sum();
        if bad > 0 {
            if self.first.is_none()
                && let Some(i) = values.iter().position(|v| !v.is_finite())
            {
                self.first = Some((self.seen + i, values[i]));
            }
            self.bad += bad;
        }
        self.seen += values.len();
    }

    /// An error naming `name` when a fed value was NaN or infinite.
    pub fn finish(&self, path: &Path, name: &str) -> Result<()> {
        match self.first {
            None => Ok(()),
            Some((i, v)) => Err(Error::tensor(
                path,
                name,
                format!(
                    "holds {} non-finite value(s) of {} (first: {v} at flat index {i}); the checkpoint is corrupt or diverged",
                    self.bad, self.seen
                ),
            )),
        }
    }
}

/// Open `path` and read its safetensors header: the open file, the header's JSON
/// object, where the data starts and the file's length.
fn read_header(
    path: &Path,
) -> Result<(File, serde_json::Map<String, serde_json::Value>, u64, u64)> {
    let bad = |m: String| Error::Safetensors {
        path: path.to_path_buf(),
        message: m,
    };
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad(format!("file is {file_len} bytes, too short for a header")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > 100_000_000 || 8 + header_len > file_len {
        return Err(bad(format!(
            "header claims {header_len} bytes but the file has {file_len} (truncated or not safetensors)"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let serde_json::Value::Object(obj) = json else {
        return Err(bad("header is not a JSON object".into()));
    };
    Ok((f, obj, 8 + header_len, file_len))
}

/// Where a file's tensor data lies: the file's index in the reader, the byte where
/// the data starts (after the header) and the file's length.
struct DataSpan {
    file: usize,
    data_start: u64,
    file_len: u64,
}

/// The entry of tensor `name` from its header value `v`: dtype, shape and offsets,
/// checked against each other and against the file's data `span`.
fn parse_entry(
    path: &Path,
    name: &str,
    v: &serde_json::Value,
    span: &DataSpan,
) -> Result<TensorEntry> {
    let DataSpan {
        file,
        data_start,
        file_len,
    } = *span;
    let terr = |m: String| Error::tensor(path, name, m);
    let dtype_name = v["dtype"]
        .as_str()
        .ok_or_else(|| terr("no dtype".into()))?
        .to_string();
    let dtype = StDtype::parse(&dtype_name)
        .ok_or_else(|| terr(format!("unsupported dtype {dtype_name}")))?;
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .ok_or_else(|| terr("no shape".into()))?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect::<Option<_>>()
        .ok_or_else(|| terr("shape is not a list of integers".into()))?;
    let offs = v["data_offsets"]
        .as_array()
        .filter(|a| a.len() == 2)
        .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
        .ok_or_else(|| terr("bad data_offsets".into()))?;
    let expect = shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&b| b <= file_len)
        .ok_or_else(|| {
            terr(format!(
                "shape {shape:?} of {dtype_name} needs more bytes than the file has ({file_len})"
            ))
        })?;
    if offs.1 < offs.0 || offs.1 - offs.0 != expect {
        return Err(terr(format!(
            "data_offsets {:?} span {} bytes but shape {:?} of {dtype_name} needs {expect}",
            offs,
            offs.1.saturating_sub(offs.0),
            shape
        )));
    }
    if offs.1 > file_len - data_start {
        return Err(terr(format!(
            "data ends at byte {} but the file has only {file_len} bytes (truncated file)",
            data_start.saturating_add(offs.1)
        )));
    }
    Ok(TensorEntry {
        file,
        dtype,
        dtype_name,
        shape,
        start: data_start + offs.0,
        len: expect,
    })
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub file: usize,
    pub dtype: StDtype,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the file.
    pub start: u64,
    pub len: u64,
}

/// Bytes per read of [`read_at`]'s parallel reads.
const READ_PIECE: usize = 4 << 20;

/// `buf.len()` bytes of `f` from `offset`: large reads in pieces of [`READ_PIECE`] over
/// the rayon pool (positioned reads, so the pieces do not share a file cursor). The
/// kernel's copy into fresh pages of `buf` took about two thirds of the real-width
/// checkpoint's load on one core.
fn read_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use rayon::prelude::*;
    use std::os::unix::fs::FileExt;
    buf.par_chunks_mut(READ_PIECE)
        .enumerate()
        .try_for_each(|(i, piece)| f.read_exact_at(piece, offset + (i * READ_PIECE) as u64))
}

struct OpenFile {
    path: PathBuf,
    file: Mutex<File>,
    metadata: BTreeMap<String, String>,
}

/// A set of safetensors files (one, or the shards of an index) opened for reading.
pub struct SafetensorsReader {
    files: Vec<OpenFile>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl SafetensorsReader {
    /// Open one file.
    pub fn open(path: &Path) -> Result<Self> {
        let mut r = SafetensorsReader {
            files: Vec::new(),
            tensors: BTreeMap::new(),
        };
        r.add_file(path)?;
        Ok(r)
    }

    /// Open several files (shards); a tensor present in two files is an error.
    pub fn open_many(paths: &[PathBuf]) -> Result<Self> {
        let mut r = SafetensorsReader {
            files: Vec::new(),
            tensors: BTreeMap::new(),
        };
        for p in paths {
            r.add_file(p)?;
        }
        Ok(r)
    }

    /// Read the header of `path` and add its tensors; a tensor already present (from
    /// another file) is an error.
    fn add_file(&mut self, path: &Path) -> Result<()> {
        let (f, obj, data_start, file_len) = read_header(path)?;
        let span = DataSpan {
            file: self.files.len(),
            data_start,
            file_len,
        };
        let mut metadata = BTreeMap::new();
        for (name, v) in &obj {
            if name == "__metadata__" {
                if let Some(m) = v.as_object() {
                    for (k, val) in m {
                        metadata.insert(k.clone(), val.as_str().unwrap_or_default().to_string());
                    }
                }
                continue;
            }
            let entry = parse_entry(path, name, v, &span)?;
            if let Some(prev) = self.tensors.get(name) {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("also present in {}", self.files[prev.file].path.display()),
                ));
            }
            self.tensors.insert(name.clone(), entry);
        }
        check_layout(path, &self.tensors, span.file, data_start, file_len)?;
        self.files.push(OpenFile {
            path: path.to_path_buf(),
            file: Mutex::new(f),
            metadata,
        });
        Ok(())
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// The entry for `name`.
    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The file holding `name` (for error messages).
    pub fn path_of(&self, name: &str) -> PathBuf {
        match self.tensors.get(name) {
            Some(e) => self.files[e.file].path.clone(),
            None => self
                .files
                .first()
                .map(|f| f.path.clone())
                .unwrap_or_default(),
        }
    }

    /// `__metadata__` of the first file.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        self.files
            .first()
            .map(|f| f.metadata.clone())
            .unwrap_or_default()
    }

    /// The entry of `name` and its data bytes as stored (little-endian).
    pub fn raw(&self, name: &str) -> Result<(&TensorEntry, Vec<u8>)> {
        let e = self.tensors.get(name).ok_or_else(|| {
            Error::tensor(self.path_of(name), name, "missing from the checkpoint")
        })?;
        let of = &self.files[e.file];
        let mut buf = vec![0u8; e.len as usize];
        let f = of.file.lock().expect("file lock");
        read_at(&f, &mut buf, e.start)
            .map_err(|x| Error::tensor(&of.path, name, format!("cannot read data: {x}")))?;
        Ok((e, buf))
    }

    /// Read a float tensor converted to f32 (F64/F32/F16/BF16/F8 accepted).
    pub fn read_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (e, buf) = self.raw(name)?;
        let v = decode_floats(e.dtype, &buf).ok_or_else(|| {
            Error::tensor(
                &self.files[e.file].path,
                name,
                format!(
                    "expected a floating-point tensor, found {} ({:?})",
                    e.dtype_name, e.dtype
                ),
            )
        })?;
        Ok((e.shape.clone(), v))
    }

    /// Read an integer tensor converted to i64.
    pub fn read_i64(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>)> {
        let (e, buf) = self.raw(name)?;
        let v: Vec<i64> = match e.dtype {
            StDtype::I64 => buf
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            StDtype::I32 => buf
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
                .collect(),
            StDtype::I16 => buf
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
                .collect(),
            StDtype::I8 => buf.iter().map(|&b| b as i8 as i64).collect(),
            StDtype::U8 | StDtype::Bool => buf.iter().map(|&b| b as i64).collect(),
            _ => {
                return Err(Error::tensor(
                    &self.files[e.file].path,
                    name,
                    format!("expected an integer tensor, found {}", e.dtype_name),
                ));
            }
        };
        Ok((e.shape.clone(), v))
    }
}

/// A tensor to write.
pub struct OwnedTensor {
    pub shape: Vec<usize>,
    pub data: TensorValues,
}

/// Values of a tensor to write.
pub enum TensorValues {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

struct View<'a>(&'a OwnedTensor, Vec<u8>);

impl safetensors::View for View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.0.data {
            TensorValues::F32(_) => safetensors::Dtype::F32,
            TensorValues::I64(_) => safetensors::Dtype::I64,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.1)
    }
    fn data_len(&self) -> usize {
        self.1.len()
    }
}

/// Write tensors to `path` atomically (temp file in the same folder, fsync, rename).
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, OwnedTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let views: Vec<(String, View)> = tensors
        .iter()
        .map(|(n, t)| {
            let bytes = match &t.data {
                TensorValues::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                TensorValues::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            (n.clone(), View(t, bytes))
        })
        .collect();
    let bytes = safetensors::serialize(views, metadata).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    write_atomic(path, &sorted_header(bytes))
}

/// The same file with its JSON header's keys in sorted order: the metadata arrive as a
/// `HashMap`, whose order changes from one map to the next, so two writes of the same
/// tensors could differ in their header bytes. The header keeps its length (padded with
/// spaces, as the format pads it); the data offsets are unchanged.
fn sorted_header(bytes: Vec<u8>) -> Vec<u8> {
    let Some(n) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
    else {
        return bytes;
    };
    let Some(Ok(header)) = bytes
        .get(8..8 + n)
        .map(serde_json::from_slice::<serde_json::Value>)
    else {
        return bytes;
    };
    // serde_json's objects are sorted by key (no `preserve_order`).
    let Ok(mut text) = serde_json::to_string(&header) else {
        return bytes;
    };
    if text.len() > n {
        return bytes;
    }
    text.extend(std::iter::repeat_n(' ', n - text.len()));
    let mut out = Vec::with_capacity(bytes.len());
    out.extend_from_slice(&bytes[..8]);
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// Write bytes to `path` atomically through `crate::output::atomic` (unique temp
/// name beside it, fsync, rename, fsync of the directory): what checkpoints and model
/// directories are written with, so a killed writer leaves the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    crate::output::write_bytes_atomic(path, bytes).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    /// Values fed in parts, over several blocks of the pool: every non-finite value is
    /// counted and the first is named by its flat index in the whole tensor.
    #[test]
    fn finite_check_counts_every_bad_value_and_names_the_first() {
        let mut v = vec![1.5f32; 3 * super::FINITE_BLOCK + 7];
        v[2 * super::FINITE_BLOCK + 3] = f32::NAN;
        v[2 * super::FINITE_BLOCK + 5] = f32::INFINITY;
        v[3 * super::FINITE_BLOCK + 6] = f32::NEG_INFINITY;
        let mut c = super::FiniteCheck::default();
        c.feed(&[0.0; 10]);
        c.feed(&v);
        c.feed(&[f32::NAN]);
        let e = c
            .finish(std::path::Path::new("m.safetensors"), "w")
            .unwrap_err()
            .to_string();
        let first = 10 + 2 * super::FINITE_BLOCK + 3;
        let total = 10 + v.len() + 1;
        assert!(
            e.contains(&format!("holds 4 non-finite value(s) of {total}"))
                && e.contains(&format!("first: NaN at flat index {first}")),
            "{e}"
        );
        let mut ok = super::FiniteCheck::default();
        ok.feed(&v[..super::FINITE_BLOCK]);
        assert!(ok.finish(std::path::Path::new("m"), "w").is_ok());
    }

    /// The same tensors and metadata give the same bytes on every write (the metadata's
    /// `HashMap` order does not reach the file), and the file reads back.
    #[test]
    fn writes_are_byte_identical_whatever_the_metadata_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = BTreeMap::new();
        t.insert(
            "w".to_string(),
            OwnedTensor {
                shape: vec![2, 3],
                data: TensorValues::F32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            },
        );
        let mut first: Option<Vec<u8>> = None;
        for i in 0..16 {
            let mut meta = HashMap::new();
            for k in ["format", "producer", "a", "b", "c"] {
                meta.insert(k.to_string(), format!("{k}-value"));
            }
            let p = dir.path().join(format!("{i}.safetensors"));
            write_safetensors(&p, &t, Some(meta)).unwrap();
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            assert_eq!(st.tensor("w").unwrap().shape(), &[2, 3]);
            match &first {
                None => first = Some(bytes),
                Some(f) => assert_eq!(f, &bytes, "write {i}"),
            }
        }
    }

    use super::*;

    #[test]
    fn fp8_e4m3_decoding() {
        assert_eq!(f8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(f8_e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(f8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(f8_e4m3_to_f32(0x7e), 448.0); // largest finite
        assert!(f8_e4m3_to_f32(0x7f).is_nan());
        assert_eq!(f8_e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(f8_e8m0_to_f32(127), 1.0);
        assert_eq!(f8_e8m0_to_f32(130), 8.0);
    }

    #[test]
    fn write_atomic_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("x.bin");
        write_atomic(&p, b"old").unwrap();
        write_atomic(&p, b"new").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.bin")]);
        // A target that cannot be replaced (a directory) fails naming it, and no temp is left.
        let d = dir.path().join("d");
        std::fs::create_dir_all(d.join("inner")).unwrap();
        let e = write_atomic(&d, b"x").unwrap_err().to_string();
        assert!(e.contains(&*d.to_string_lossy()), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn write_then_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.safetensors");
        let mut m = BTreeMap::new();
        m.insert(
            "a".to_string(),
            OwnedTensor {
                shape: vec![2, 3],
                data: TensorValues::F32(vec![1., 2., 3., 4., 5., 6.]),
            },
        );
        m.insert(
            "b".to_string(),
            OwnedTensor {
                shape: vec![2],
                data: TensorValues::I64(vec![7, -8]),
            },
        );
        // Read in several pieces over the pool (not a multiple of a piece), after the
        // small tensors.
        let long: Vec<f32> = (0..(READ_PIECE / 4) * 2 + 1001).map(|i| i as f32).collect();
        m.insert(
            "c".to_string(),
            OwnedTensor {
                shape: vec![long.len()],
                data: TensorValues::F32(long.clone()),
            },
        );
        write_safetensors(&p, &m, None).unwrap();
        let r = SafetensorsReader::open(&p).unwrap();
        assert_eq!(
            r.read_f32("a").unwrap(),
            (vec![2, 3], vec![1., 2., 3., 4., 5., 6.])
        );
        assert_eq!(r.read_i64("b").unwrap(), (vec![2], vec![7, -8]));
        assert_eq!(r.read_f32("c").unwrap(), (vec![long.len()], long));
        assert!(r.read_f32("b").is_err());
        let e = r.read_f32("zzz").unwrap_err().to_string();
        assert!(e.contains("zzz") && e.contains("missing"), "{e}");
        // truncation is detected at open, naming the tensor
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
        let e = SafetensorsReader::open(&p).err().unwrap().to_string();
        assert!(e.contains("truncated"), "{e}");
    }
}
