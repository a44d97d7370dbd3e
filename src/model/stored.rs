//! Weights resident in the dtype they are stored in (issue 22 §1).
//!
//! A checkpoint's BF16 / F16 matrices, its block-scaled FP8 e4m3 matrices (128 x 128
//! ue8m0 or f32 scales) and its packed FP4 e2m1 routed experts (ue8m0 scales per row and
//! 32 columns) are kept as their file bytes in host memory ([`Block`], shared through
//! `Arc`s), and dequantised to f32 only where they are used: a whole matrix, a set of
//! rows (an embedding lookup) or one routed expert, into a transient tensor on the
//! device that uses it ([`StoredWeight`]). The decoders are the loader's own
//! ([`decode_floats`], [`decode_scales`], [`E2M1`]): a stored weight dequantises to the
//! bits a load to f32 ([`Residency::F32`]) gives. On flex in f32 a product with a stored
//! matrix dequantises it block by block into each thread's own buffer and multiplies it
//! from there ([`crate::model::products::matmul_t_filled`]): no dequantised tensor is made.
//!
//! A leaf of the model code: it knows safetensors dtypes and burn tensors, nothing of the
//! architectures.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::gguf::{GgmlType, dequantize};
use super::precision::ComputeDtype;
use super::safetensors_io::{StDtype, decode_floats, f8_e4m3_to_f32, f8_e8m0_to_f32};

/// Values per dequantisation task ([`Block::rows_f32`]).
const DEQUANT_TASK_VALUES: usize = 1 << 16;

/// Every FP8 e4m3 byte's value, as [`f8_e4m3_to_f32`] decodes it.
static E4M3: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(|| std::array::from_fn(|b| f8_e4m3_to_f32(b as u8)));
use crate::model::flops::Mm;

/// Columns per FP4 scale (transformers' `sf_gran_k = 32`).
pub const FP4_GROUP: usize = 32;

/// The e2m1 value of each 4-bit code (bit 3 is the sign).
/// Bytes per task of [`Block::surely_finite`]'s scan.
const FINITE_SCAN_BYTES: usize = 1 << 18;

pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values (f32 elements) a blocked product dequantises at once: 32 MiB. A stored matrix
/// larger than this (the 129280 x 4096 head of V4-Flash is 2 GiB as f32) is multiplied
/// in blocks of its rows ([`StoredWeight::matmul_t`]).
pub const DEQUANT_BUDGET: usize = 8 << 20;

thread_local! {
    static DQ_BUDGET: std::cell::Cell<usize> = const { std::cell::Cell::new(DEQUANT_BUDGET) };
    static DQ_LARGEST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Run `f` with another dequantisation budget (f32 elements per block) on this thread:
/// tests use a tiny one to force many blocks.
pub fn with_dequant_budget<T>(values: usize, f: impl FnOnce() -> T) -> T {
    let old = DQ_BUDGET.with(|b| b.replace(values.max(1)));
    let out = f();
    DQ_BUDGET.with(|b| b.set(old));
    out
}

/// The dequantisation budget of this thread (f32 elements).
pub fn dequant_budget() -> usize {
    DQ_BUDGET.with(|b| b.get())
}

/// The most values a stored weight dequantised at once on this thread since the last
/// call (a whole matrix or one block of rows; embedding lookups not counted); resets it.
pub fn take_largest_dequant() -> usize {
    DQ_LARGEST.with(|l| l.replace(0))
}

fn note_dequant(values: usize) {
    DQ_LARGEST.with(|l| l.set(l.get().max(values)));
}

/// Rows of `cols` columns per block within the budget: a multiple of 128 (whole FP8
/// scale blocks) when at least 128 fit, at least two (a one-row product would take
/// gemm's matrix-vector path, whose sums are ordered differently).
pub fn block_rows(cols: usize) -> usize {
    let r = (dequant_budget() / cols.max(1)).max(2);
    if r >= 128 { r / 128 * 128 } else { r }
}

/// The blocks of `rows` in blocks of `block` rows ([`super::host::row_blocks`]): a last
/// block shorter than `min(block, 65)` rows joins the one before it, so that no block is
/// a single row or (unless `block` is) a matrix of at most 64 rows, which gemm multiplies
/// with other kernel parameters (a product over more than 512 columns summed in two
/// passes instead of one); every column then sums as with the whole matrix.
fn blocks(rows: std::ops::Range<usize>, block: usize) -> Vec<std::ops::Range<usize>> {
    super::host::row_blocks(rows, block, 65)
}

/// How a checkpoint's BF16 / F16 / FP8 / FP4 weights are held once loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Residency {
    /// As stored (about the checkpoint's bytes), dequantised transiently where used.
    #[default]
    Stored,
    /// Dequantised to f32 on load (4 bytes per weight; what training needs).
    F32,
}

impl std::str::FromStr for Residency {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stored" => Ok(Residency::Stored),
            "f32" => Ok(Residency::F32),
            _ => Err(format!(
                "`{s}`: weights are `stored` (resident as in the checkpoint) or `f32`"
            )),
        }
    }
}

impl fmt::Display for Residency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Residency::Stored => "stored",
            Residency::F32 => "f32",
        })
    }
}

/// Scale values from their file bytes: F8_E8M0, F32, BF16, F16 as floats, U8 as ue8m0
/// exponent bytes (as transformers reads them); `None` for any other dtype.
pub fn decode_scales(dtype: StDtype, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        StDtype::U8 => Some(bytes.iter().map(|&b| f8_e8m0_to_f32(b)).collect()),
        StDtype::F8E8M0 | StDtype::F32 | StDtype::BF16 | StDtype::F16 => {
            decode_floats(dtype, bytes)
        }
        _ => None,
    }
}

/// Scales of a [`Block`]: a grid of multipliers, each for `block` values.
#[derive(Clone)]
pub struct Scales {
    dtype: StDtype,
    /// `[rows, cols]` of the grid.
    grid: [usize; 2],
    /// Values per scale: `[128, 128]` (FP8 blocks), `[1, 32]` (FP4 groups).
    block: [usize; 2],
    bytes: Arc<Vec<u8>>,
}

impl Scales {
    /// `None` when `dtype` is not a scale dtype ([`decode_scales`]) or the bytes do not
    /// hold the grid.
    pub fn new(
        dtype: StDtype,
        grid: [usize; 2],
        block: [usize; 2],
        bytes: Vec<u8>,
    ) -> Option<Self> {
        let ok = decode_scales(dtype, &[]).is_some()
            && bytes.len() == grid[0] * grid[1] * dtype.size()
            && block[0] > 0
            && block[1] > 0;
        ok.then(|| Scales {
            dtype,
            grid,
            block,
            bytes: Arc::new(bytes),
        })
    }

    /// The largest magnitude of a scale when every scale is finite; `None` otherwise.
    fn largest_finite(&self) -> Option<f32> {
        let s = decode_scales(self.dtype, &self.bytes)?;
        s.iter()
            .try_fold(0.0f32, |m, v| v.is_finite().then(|| m.max(v.abs())))
    }

    /// `v` (rows `r0..r1` of `cols` values) times their scales.
    fn apply(&self, v: &mut [f32], r0: usize, r1: usize, cols: usize) {
        if r1 <= r0 {
            return;
        }
        let [b0, b1] = self.block;
        let (s0, s1) = (r0 / b0, (r1 - 1) / b0 + 1);
        let w = self.grid[1] * self.dtype.size();
        let s = decode_scales(self.dtype, &self.bytes[s0 * w..s1 * w]).expect("checked dtype");
        let gc = self.grid[1];
        for r in r0..r1 {
            let g = r / b0 - s0;
            let srow = &s[g * gc..(g + 1) * gc];
            // `b1` values per scale: value c takes scale c / b1, one group at a time.
            for (group, &scale) in v[(r - r0) * cols..(r - r0 + 1) * cols]
                .chunks_mut(b1)
                .zip(srow)
            {
                group.iter_mut().for_each(|x| *x *= scale);
            }
        }
    }
}

/// One checkpoint tensor, a `rows x cols` matrix, as its file bytes: floats of its
/// dtype (BF16, F16, F8_E4M3, ...) or packed e2m1 codes (I8 / U8: two per byte, the even
/// column in the low nibble), optionally times block scales.
#[derive(Clone)]
pub struct Block {
    rows: usize,
    cols: usize,
    dtype: StDtype,
    bytes: Arc<Vec<u8>>,
    scales: Option<Scales>,
    /// GGUF quantised blocks (Q4_1, Q8_0, Q4_K, ...): each row is `cols / block_size`
    /// ggml blocks (`dtype` unused), dequantised by [`crate::model::gguf::dequantize`].
    ggml: Option<GgmlType>,
}

impl Block {
    /// `None` when the bytes do not hold `rows x cols` values of `dtype` (half as many
    /// bytes for packed FP4, whose columns must be even) or `dtype` is not a float or
    /// packed dtype. Shapes and scale grids are the caller's to check (with its names).
    pub fn new(
        [rows, cols]: [usize; 2],
        dtype: StDtype,
        bytes: Vec<u8>,
        scales: Option<Scales>,
    ) -> Option<Self> {
        let packed = matches!(dtype, StDtype::I8 | StDtype::U8);
        let len = if packed {
            cols.is_multiple_of(2).then_some(rows * cols / 2)
        } else {
            decode_floats(dtype, &[]).map(|_| rows * cols * dtype.size())
        };
        (len == Some(bytes.len())).then(|| Block {
            rows,
            cols,
            dtype,
            bytes: Arc::new(bytes),
            scales,
            ggml: None,
        })
    }

    /// A matrix of GGUF blocks of type `t`, row-major: `None` when a row is not a whole
    /// number of blocks or the bytes do not hold `rows` rows.
    pub fn ggml([rows, cols]: [usize; 2], t: GgmlType, bytes: Vec<u8>) -> Option<Self> {
        let (bs, ts) = (t.block_size(), t.type_size());
        let ok = bs > 0 && cols.is_multiple_of(bs) && bytes.len() == rows * cols / bs * ts;
        ok.then(|| Block {
            rows,
            cols,
            dtype: StDtype::U8,
            bytes: Arc::new(bytes),
            scales: None,
            ggml: Some(t),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Whether every value the block dequantises to is finite, decided from its bytes
    /// without dequantising: FP4 codes (all finite), FP8 e4m3 codes other than NaN,
    /// BF16 / F16 codes without an all-ones exponent, times scales that are all finite
    /// and small enough that no product overflows f32. `false` means undecided (GGUF
    /// blocks, other dtypes, a bad code or a scale too large): the caller dequantises and
    /// checks every value, which names the first bad one.
    pub fn surely_finite(&self) -> bool {
        use rayon::prelude::*;
        if self.ggml.is_some() {
            return false;
        }
        let any = |bad: &(dyn Fn(&[u8]) -> bool + Sync), width: usize| {
            self.bytes
                .par_chunks(FINITE_SCAN_BYTES / width * width)
                .any(bad)
        };
        let largest = if self.packed() {
            6.0
        } else {
            match self.dtype {
                StDtype::F8E4M3 => {
                    let lut = &*E4M3;
                    if any(&|c| c.iter().any(|&b| !lut[b as usize].is_finite()), 1) {
                        return false;
                    }
                    448.0
                }
                StDtype::BF16 | StDtype::F16 => {
                    let mask = if self.dtype == StDtype::BF16 {
                        0x7f80
                    } else {
                        0x7c00
                    };
                    let bad = move |c: &[u8]| {
                        c.chunks_exact(2)
                            .any(|h| u16::from_le_bytes([h[0], h[1]]) & mask == mask)
                    };
                    if any(&bad, 2) {
                        return false;
                    }
                    // The largest finite value of the dtype.
                    if self.dtype == StDtype::BF16 {
                        f32::MAX as f64
                    } else {
                        65504.0
                    }
                }
                _ => return false,
            }
        };
        match &self.scales {
            None => true,
            Some(s) => s
                .largest_finite()
                .is_some_and(|m| m as f64 * largest < f32::MAX as f64),
        }
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn packed(&self) -> bool {
        matches!(self.dtype, StDtype::I8 | StDtype::U8)
    }

    /// Rows `r0..r1` dequantised, row-major: `value * scale`, exactly as the loader
    /// computes them. Runs over the rayon pool in blocks of rows (each value is decoded
    /// alone, so the result does not depend on the threads).
    pub fn rows_f32(&self, r0: usize, r1: usize) -> Vec<f32> {
        let mut v = vec![0.0f32; (r1 - r0) * self.cols];
        self.rows_into(r0, &mut v);
        v
    }

    /// [`Block::rows_f32`] written into `out` (whole rows from `r0` on, as many as fit).
    fn rows_into(&self, r0: usize, out: &mut [f32]) {
        use rayon::prelude::*;
        let cols = self.cols.max(1);
        // About 64K values per task: enough work per task, every core busy on a matrix.
        let rows = (DEQUANT_TASK_VALUES / cols).max(1);
        out.par_chunks_mut(rows * cols)
            .enumerate()
            .for_each(|(j, out)| {
                let a = r0 + j * rows;
                self.fill_rows(a, a + out.len() / cols, out);
            });
    }

    /// Rows `r0..r1` dequantised into `out` (`(r1 - r0) x cols` values).
    fn fill_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        if let Some(t) = self.ggml {
            let w = self.cols / t.block_size() * t.type_size();
            dequantize(t, &self.bytes[r0 * w..r1 * w], out).expect("checked block size");
            return;
        }
        if self.packed() {
            let w = self.cols / 2;
            for (o, &b) in out.chunks_exact_mut(2).zip(&self.bytes[r0 * w..r1 * w]) {
                o[0] = E2M1[(b & 0x0f) as usize];
                o[1] = E2M1[(b >> 4) as usize];
            }
        } else if self.dtype == StDtype::F8E4M3 {
            let w = self.cols;
            let lut = &*E4M3;
            for (o, &b) in out.iter_mut().zip(&self.bytes[r0 * w..r1 * w]) {
                *o = lut[b as usize];
            }
        } else if self.dtype == StDtype::BF16 {
            let w = self.cols * 2;
            for (o, c) in out
                .iter_mut()
                .zip(self.bytes[r0 * w..r1 * w].chunks_exact(2))
            {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        } else {
            let w = self.cols * self.dtype.size();
            let v = decode_floats(self.dtype, &self.bytes[r0 * w..r1 * w]).expect("checked dtype");
            out.copy_from_slice(&v);
        }
        if let Some(s) = &self.scales {
            s.apply(out, r0, r1, self.cols);
        }
    }

    /// Every value, dequantised.
    pub fn to_f32(&self) -> Vec<f32> {
        self.rows_f32(0, self.rows)
    }

    /// The label of the values' storage: `bf16`, `f16`, `fp8`, `fp4`, `f32`, ...
    pub fn label(&self) -> &'static str {
        if let Some(t) = self.ggml {
            return t.name();
        }
        match self.dtype {
            StDtype::I8 | StDtype::U8 => "fp4",
            StDtype::F8E4M3 => "fp8",
            StDtype::BF16 => "bf16",
            StDtype::F16 => "f16",
            StDtype::F32 => "f32",
            StDtype::F64 => "f64",
            _ => "other",
        }
    }

    /// Resident bytes by label (scales under `scales`).
    fn add_bytes(&self, out: &mut BTreeMap<String, usize>) {
        *out.entry(self.label().into()).or_default() += self.bytes.len();
        if let Some(s) = &self.scales {
            *out.entry("scales".into()).or_default() += s.bytes.len();
        }
    }
}

/// A matrix made of [`Block`]s stacked by rows (one block, or a routed expert's gate and
/// up projections `[w1; w3]`).
#[derive(Clone)]
pub struct StoredMatrix {
    parts: Vec<Block>,
}

impl StoredMatrix {
    /// `None` without parts or when their column counts differ.
    pub fn new(parts: Vec<Block>) -> Option<Self> {
        let cols = parts.first()?.cols;
        parts
            .iter()
            .all(|p| p.cols == cols)
            .then_some(StoredMatrix { parts })
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    pub fn cols(&self) -> usize {
        self.parts[0].cols
    }

    /// Rows `r0..r1` dequantised into `out` (`(r1 - r0) x cols` values) on the calling
    /// thread.
    #[cfg(feature = "flex")]
    fn fill(&self, r0: usize, r1: usize, out: &mut [f32]) {
        self.by_parts(r0, r1, out, |p, r, o| p.fill_rows(r.start, r.end, o));
    }

    /// Rows `r0..r1`, dequantised, row-major.
    /// Each part writes its rows straight into the one result (no copy of a part's).
    pub fn rows_f32(&self, r0: usize, r1: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; r1.saturating_sub(r0) * self.cols()];
        self.by_parts(r0, r1, &mut out, |p, r, o| p.rows_into(r.start, o));
        out
    }

    /// `write(part, its rows, their place in out)` for each part holding some of rows
    /// `r0..r1` (`out`: those rows, row-major).
    fn by_parts(
        &self,
        r0: usize,
        r1: usize,
        out: &mut [f32],
        write: impl Fn(&Block, std::ops::Range<usize>, &mut [f32]),
    ) {
        let cols = self.cols();
        let mut first = 0;
        for p in &self.parts {
            let (a, b) = (r0.max(first), r1.min(first + p.rows));
            if a < b {
                write(
                    p,
                    a - first..b - first,
                    &mut out[(a - r0) * cols..(b - r0) * cols],
                );
            }
            first += p.rows;
        }
    }
}

/// Weights held as stored: one matrix (a linear map, an embedding) or one per routed
/// expert, with the device their dequantised values go to. A burn [`Module`] without
/// parameters: moving a model moves this device; `num_params` (parameters) does not
/// count its values ([`StoredWeight::values`] does).
#[derive(Clone)]
pub struct StoredWeight {
    matrices: Arc<[StoredMatrix]>,
    device: Device,
}

impl StoredWeight {
    /// `None` without matrices or when their shapes differ.
    pub fn new(matrices: Vec<StoredMatrix>, device: &Device) -> Option<Self> {
        let first = matrices.first()?;
        let dims = [first.rows(), first.cols()];
        matrices
            .iter()
            .all(|m| [m.rows(), m.cols()] == dims)
            .then(|| StoredWeight {
                matrices: matrices.into(),
                device: device.clone(),
            })
    }

    /// Number of matrices (routed experts; 1 for a linear map).
    pub fn len(&self) -> usize {
        self.matrices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.matrices.is_empty()
    }

    /// `[rows, cols]` of each matrix.
    pub fn dims(&self) -> [usize; 2] {
        [self.matrices[0].rows(), self.matrices[0].cols()]
    }

    /// Where the dequantised values go.
    pub fn device(&self) -> Device {
        self.device.clone()
    }

    /// Matrix `i` dequantised into a transient tensor `[rows, cols]` on the device.
    pub fn matrix(&self, i: usize) -> Tensor<2> {
        let m = &self.matrices[i];
        self.rows_tensor(i, 0, m.rows(), ComputeDtype::F32)
    }

    /// Rows `r0..r1` of matrix `i`, dequantised into a transient tensor on the device in
    /// `dtype`: bf16 (2 bytes per value) rounds as a cast of the f32 values does.
    fn rows_tensor(&self, i: usize, r0: usize, r1: usize, dtype: ComputeDtype) -> Tensor<2> {
        let m = &self.matrices[i];
        note_dequant((r1 - r0) * m.cols());
        // Timed as the LM head's when the matrix has the vocabulary's rows.
        super::profile::timed(super::profile::Kind::Dequant, m.rows(), || {
            let v = m.rows_f32(r0, r1);
            let shape = [r1 - r0, m.cols()];
            let data = match dtype {
                ComputeDtype::F32 => TensorData::new(v, shape),
                ComputeDtype::Bf16 => {
                    let h: Vec<half::bf16> = v.into_iter().map(half::bf16::from_f32).collect();
                    TensorData::new(h, shape)
                }
            };
            Tensor::from_data(data, &self.device)
        })
    }

    /// `x: [n, cols] -> x W_i^T: [n, rows]` with `W_i` matrix `i`, dequantised in blocks
    /// of [`block_rows`] rows (one block when it fits the budget), each block's product
    /// written into its columns of the output: each output column is the same product of
    /// `x` with the same row as with the whole matrix. `x` must be on
    /// [`StoredWeight::device`].
    pub fn matmul_t(&self, i: usize, x: Tensor<2>) -> Tensor<2> {
        self.matmul_t_rows(i, 0..self.matrices[i].rows(), x)
    }

    /// As [`StoredWeight::matmul_t`] with rows `rows` of matrix `i` only: `[n, rows.len()]`.
    pub fn matmul_t_rows(&self, i: usize, rows: std::ops::Range<usize>, x: Tensor<2>) -> Tensor<2> {
        let m = &self.matrices[i];
        let _head = super::profile::head_if_vocab(m.rows());
        let block = block_rows(m.cols());
        // Blocks are dequantised in the compute dtype their product takes (bf16: half the
        // transient bytes).
        let dtype = super::precision::compute();
        #[cfg(feature = "flex")]
        if dtype == ComputeDtype::F32
            && let Some(y) = self.filled_product(i, rows.clone(), &x, block)
        {
            return y;
        }
        let product = |r0: usize, r1: usize, x: Tensor<2>| {
            x.mm(self.rows_tensor(i, r0, r1, dtype).transpose())
        };
        if rows.len() <= block {
            return product(rows.start, rows.end, x);
        }
        // Each block's product goes into its columns of the output (in place where the
        // backend can: one output and one block's product alive, not all blocks and
        // their concatenation).
        let n = x.dims()[0];
        let mut out = Tensor::<2>::empty([n, rows.len()], &x.device());
        for r in blocks(rows.clone(), block) {
            let cols = r.start - rows.start..r.end - rows.start;
            out = out.slice_assign([0..n, cols], product(r.start, r.end, x.clone()));
        }
        out
    }

    /// [`StoredWeight::matmul_t_rows`] on flex f32 tensors, each thread dequantising its
    /// own blocks of rows (of the `block` rows the budget allows, a share per thread) and
    /// multiplying them into its columns of the output ([`super::products::matmul_t_filled`]):
    /// no dequantised block is allocated, joined or freed. The same values as the blocked
    /// product; `None` where that function declines.
    #[cfg(feature = "flex")]
    fn filled_product(
        &self,
        i: usize,
        rows: std::ops::Range<usize>,
        x: &Tensor<2>,
        block: usize,
    ) -> Option<Tensor<2>> {
        use super::profile::{Kind, enabled, timed_shared};
        use std::sync::atomic::{AtomicU64, Ordering};
        let m = &self.matrices[i];
        let threads = rayon::current_num_threads();
        let per_thread = (block / threads).max(1);
        let [n, k] = x.dims();
        let filling = AtomicU64::new(0);
        let fill = |r: std::ops::Range<usize>, out: &mut [f32]| {
            let t0 = enabled().then(std::time::Instant::now);
            m.fill(rows.start + r.start, rows.start + r.end, out);
            if let Some(t0) = t0 {
                filling.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        };
        let y = timed_shared(Kind::Products, Kind::Dequant, m.rows(), || {
            let t0 = std::time::Instant::now();
            let y = super::products::matmul_t_filled(x, rows.len(), per_thread, fill);
            let busy = t0.elapsed().as_secs_f64() * threads as f64;
            let share = filling.load(Ordering::Relaxed) as f64 * 1e-9 / busy.max(1e-12);
            (y, share)
        })?;
        note_dequant(per_thread.min(rows.len()) * threads.min(rows.len()) * m.cols());
        super::flops::count(&[n, k], &[k, rows.len()]);
        Some(y)
    }

    /// Rows `rows` of matrix `i` (an embedding lookup), dequantised: `[rows.len(), cols]`.
    pub fn gather_rows(&self, i: usize, rows: &[usize]) -> Tensor<2> {
        let m = &self.matrices[i];
        super::profile::timed(super::profile::Kind::Dequant, 0, || {
            let mut v = Vec::with_capacity(rows.len() * m.cols());
            for &r in rows {
                v.extend(m.rows_f32(r, r + 1));
            }
            Tensor::from_data(TensorData::new(v, [rows.len(), m.cols()]), &self.device)
        })
    }

    /// Matrices `0..keep` and `keep..` (both sharing these bytes); `None` for an empty part.
    pub fn split(&self, keep: usize) -> (Option<Self>, Option<Self>) {
        let part = |r: std::ops::Range<usize>| {
            (!r.is_empty()).then(|| StoredWeight {
                matrices: self.matrices[r].to_vec().into(),
                device: self.device.clone(),
            })
        };
        let keep = keep.min(self.len());
        (part(0..keep), part(keep..self.len()))
    }

    /// Values held (elements of the dequantised matrices).
    pub fn values(&self) -> usize {
        self.matrices.iter().map(|m| m.rows() * m.cols()).sum()
    }

    /// Add the resident bytes by storage label (`bf16`, `fp8`, `fp4`, `scales`, ...).
    pub fn add_bytes(&self, out: &mut BTreeMap<String, usize>) {
        for m in self.matrices.iter() {
            for p in &m.parts {
                p.add_bytes(out);
            }
        }
    }
}

impl fmt::Debug for StoredWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut bytes = BTreeMap::new();
        self.add_bytes(&mut bytes);
        write!(
            f,
            "StoredWeight {{ {} x {:?}, bytes {bytes:?}, device {:?} }}",
            self.len(),
            self.dims(),
            self.device
        )
    }
}

impl Module for StoredWeight {
    fn collect_devices(&self, mut devices: Devices) -> Devices {
        if !devices.contains(&self.device) {
            devices.push(self.device.clone());
        }
        devices
    }

    fn fork(self, device: &Device) -> Self {
        self.to_device(device)
    }

    fn to_device(mut self, device: &Device) -> Self {
        self.device = device.clone();
        self
    }

    fn train(self) -> Self {
        self
    }

    fn valid(&self) -> Self {
        self.clone()
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper>(self, _mapper: &mut M) -> Self {
        self
    }
}

impl ModuleDisplayDefault for StoredWeight {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_single(&format!("{self:?}")).optional()
    }
}

impl ModuleDisplay for StoredWeight {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_last_blocks_join_the_one_before() {
        let block_starts = |rows: std::ops::Range<usize>, block| -> Vec<usize> {
            let b = blocks(rows.clone(), block);
            // The blocks tile `rows` in order.
            assert_eq!(b.first().map(|r| r.start), Some(rows.start));
            assert_eq!(b.last().map(|r| r.end), Some(rows.end));
            assert!(b.windows(2).all(|w| w[0].end == w[1].start));
            b.into_iter().map(|r| r.start).collect()
        };
        assert_eq!(block_starts(0..10, 3), vec![0, 3, 6]); // 3, 3, 4 rows
        assert_eq!(block_starts(0..9, 3), vec![0, 3, 6]);
        assert_eq!(block_starts(5..9, 2), vec![5, 7]);
        // blocks of 128: a 64-row tail joins, a 65-row one stays
        assert_eq!(block_starts(0..320, 128), vec![0, 128]);
        assert_eq!(block_starts(0..321, 128), vec![0, 128, 256]);
        assert_eq!(block_starts(0..100, 128), vec![0]);
    }

    #[test]
    fn fp4_and_fp8_blocks_dequantise_by_rows() {
        // FP4: one row of 64 values, codes 0..16 repeated, scales 2^0 and 2^1
        let bytes: Vec<u8> = (0..32u8)
            .map(|i| (i % 16) | (((i + 1) % 16) << 4))
            .collect();
        let s = Scales::new(StDtype::U8, [1, 2], [1, FP4_GROUP], vec![127, 128]).unwrap();
        let b = Block::new([1, 64], StDtype::U8, bytes, Some(s)).unwrap();
        let v = b.to_f32();
        assert_eq!(v[2], E2M1[1]);
        assert_eq!(v[33], 2.0 * E2M1[1]);
        // FP8: 3 x 2 values with 2 x 1 blocks: rows 0-1 scale 1, row 2 scale 4
        let s = Scales::new(StDtype::F8E8M0, [2, 1], [2, 128], vec![127, 129]).unwrap();
        let b = Block::new([3, 2], StDtype::F8E4M3, vec![0x38; 6], Some(s)).unwrap();
        assert_eq!(b.to_f32(), vec![1.0, 1.0, 1.0, 1.0, 4.0, 4.0]);
        assert_eq!(b.rows_f32(2, 3), vec![4.0, 4.0]);
        let m = StoredMatrix::new(vec![b.clone(), b]).unwrap();
        assert_eq!(m.rows_f32(2, 4), vec![4.0, 4.0, 1.0, 1.0]);
        assert!(Block::new([3, 2], StDtype::I64, vec![0; 48], None).is_none());
        assert!(Scales::new(StDtype::I8, [1, 1], [1, 1], vec![0]).is_none());
    }

    /// Loading decides finiteness from the bytes where it can: never "finite" when a
    /// dequantised value is not (every FP8 code and FP4 pair under every E8M0 scale,
    /// BF16 / F16 codes), and "finite" for the usual weights (small scales, no NaN code).
    #[test]
    fn surely_finite_is_never_wrong_and_decides_the_usual_weights() {
        let finite = |b: &Block| b.to_f32().iter().all(|v| v.is_finite());
        for scale in 0..=255u8 {
            for code in 0..=255u8 {
                let s = Scales::new(StDtype::F8E8M0, [1, 1], [128, 128], vec![scale]).unwrap();
                let b = Block::new([1, 2], StDtype::F8E4M3, vec![code, 0x38], Some(s)).unwrap();
                assert!(
                    !b.surely_finite() || finite(&b),
                    "fp8 {code:#x} scale {scale}"
                );
                let s = Scales::new(StDtype::U8, [1, 1], [1, FP4_GROUP], vec![scale]).unwrap();
                let b = Block::new([1, 2], StDtype::U8, vec![code], Some(s)).unwrap();
                assert!(
                    !b.surely_finite() || finite(&b),
                    "fp4 {code:#x} scale {scale}"
                );
            }
        }
        for hi in 0..=255u8 {
            for dtype in [StDtype::BF16, StDtype::F16] {
                let b = Block::new([1, 2], dtype, vec![0, hi, 0x80, 0x3f], None).unwrap();
                assert_eq!(b.surely_finite(), finite(&b), "{dtype:?} {hi:#x}");
            }
        }
        // The usual weights: scales near 1, codes without NaN.
        let s = Scales::new(StDtype::F8E8M0, [1, 1], [128, 128], vec![120]).unwrap();
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7f != 0x7f).collect();
        let n = codes.len();
        assert!(
            Block::new([1, n], StDtype::F8E4M3, codes, Some(s))
                .unwrap()
                .surely_finite()
        );
        let s = Scales::new(StDtype::U8, [1, 1], [1, FP4_GROUP], vec![130]).unwrap();
        let b = Block::new(
            [1, 32],
            StDtype::U8,
            (0..16).map(|i| i * 17).collect(),
            Some(s),
        );
        assert!(b.unwrap().surely_finite());
        // A NaN code, or a scale whose product overflows: undecided, so checked.
        let s = Scales::new(StDtype::F8E8M0, [1, 1], [128, 128], vec![127]).unwrap();
        assert!(
            !Block::new([1, 2], StDtype::F8E4M3, vec![0x7f, 0], Some(s))
                .unwrap()
                .surely_finite()
        );
        let s = Scales::new(StDtype::F8E8M0, [1, 1], [128, 128], vec![254]).unwrap();
        assert!(
            !Block::new([1, 2], StDtype::F8E4M3, vec![0x7e, 0], Some(s))
                .unwrap()
                .surely_finite()
        );
    }
}
