//! Host kernels on flex's f32 buffers, over every core.
//!
//! burn-flex runs its elementwise passes (broadcast products, sums over an axis, adds) on
//! the calling thread, and each pass writes a fresh tensor. For the few wide position-wise
//! steps that are such chains (DeepSeek-V4's hyper-connections over `4 x d_model` values
//! per position) a loop over a position's values does the chain in one pass, and rows of
//! positions split over the rayon pool. The helpers here lend a flex tensor's values to
//! such a loop without a copy; on every other backend, in autodiff and in other dtypes
//! they decline (`None`, [`reachable`] false), and the caller keeps its tensor expression.
//!
//! Each output row is computed from its own inputs in a fixed order, so results do not
//! depend on the number of threads.

use burn::tensor::{DType, Device, Tensor, TensorData};

/// Whether `device` is the flex (CPU) backend without autodiff: its tensors are host
/// buffers, its elementwise passes run on the calling thread.
#[cfg(feature = "flex")]
pub fn is_flex(device: &Device) -> bool {
    !device.is_autodiff() && *device == Device::flex()
}
/// Whether `device` is the flex (CPU) backend without autodiff (not built in).
#[cfg(not(feature = "flex"))]
pub fn is_flex(_: &Device) -> bool {
    false
}

/// Positions per rayon task in the row kernels: rows of a few KiB each, enough per task
/// to amortise the scheduling, few enough to split a short prompt over the cores.
pub const ROWS_PER_TASK: usize = 16;

/// `f(r, row)` for every row `r` of `values` (rows of `width` values), [`ROWS_PER_TASK`]
/// rows per rayon task. Nothing runs when `width` is 0.
pub fn par_rows(values: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    par_rows_with(values, width, || (), |_, r, row| f(r, row));
}

/// `rows` new rows of `width` values, zeros until `f(r, row)` writes row `r`, over every
/// core as [`par_rows`]. Each task zeroes its own rows just before `f` writes them:
/// `vec![0.0; n]` below glibc's mmap threshold is a `memset` on the calling thread while
/// the pool waits.
pub fn new_rows(rows: usize, width: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    use rayon::prelude::*;
    let total = rows * width;
    let mut out: Vec<f32> = Vec::with_capacity(total);
    if width > 0 {
        out.spare_capacity_mut()[..total]
            .par_chunks_mut(width * ROWS_PER_TASK)
            .enumerate()
            .for_each(|(task, part)| {
                part.iter_mut().for_each(|v| {
                    v.write(0.0);
                });
                // SAFETY: every value of `part` was just written.
                let part =
                    unsafe { &mut *(part as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
                for (i, row) in part.chunks_mut(width).enumerate() {
                    f(task * ROWS_PER_TASK + i, row);
                }
            });
    }
    // SAFETY: the tasks' parts cover all `total` values, each written above (a panic in a
    // task propagates before this line).
    unsafe { out.set_len(total) };
    out
}

/// [`par_rows`] with a scratch value made by `init` once per task and lent to each of its
/// rows.
pub fn par_rows_with<S>(
    values: &mut [f32],
    width: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    if width == 0 {
        return;
    }
    values
        .par_chunks_mut(width * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, part)| {
            let mut scratch = init();
            for (i, row) in part.chunks_mut(width).enumerate() {
                f(&mut scratch, task * ROWS_PER_TASK + i, row);
            }
        });
}

/// Lanes of [`lanes`].
pub const LANES: usize = 16;

/// The vectorised half of a reduction over `v`: lane `i` folds values `i, i + 16, ...` of
/// the whole chunks of [`LANES`] with `step` from `init`; returned with the values after the
/// last whole chunk. The caller combines the lanes and the rest in its own order.
#[inline(always)]
pub fn lanes(v: &[f32], init: f32, step: impl Fn(f32, f32) -> f32) -> ([f32; LANES], &[f32]) {
    let mut acc = [init; LANES];
    let chunks = v.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &e) in acc.iter_mut().zip(c) {
            *a = step(*a, e);
        }
    }
    (acc, rest)
}

/// `(mean(v^2) + eps)^(-1/2)`, the squares summed in [`lanes`], then the lanes and the
/// rest in order.
pub fn inv_rms(v: &[f32], eps: f64) -> f32 {
    let (acc, rest) = lanes(v, 0.0, |a, e| a + e * e);
    let sum: f32 = acc.iter().sum::<f32>() + rest.iter().map(|e| e * e).sum::<f32>();
    ((sum as f64 / v.len() as f64 + eps).sqrt().recip()) as f32
}

/// `e^x`, in a form the compiler vectorises (no call, no branch): `2^n e^r` with
/// `n = round(x log2 e)` and `r = x - n ln 2` (ln 2 in two parts), `e^r` by its Taylor
/// series to the 8th power. Within 2 ulp of libm's `expf` (tested), subnormal results
/// included; `+inf` above `ln f32::MAX`, 0 below `ln 2^-150`, NaN for NaN.
/// flex's `exp` and `sigmoid` call libm's `expf` one value at a time: 14% of SmolLM2's
/// forward at 512 tokens.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 with 16 bits of mantissa: n ln2_hi is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const HI: f32 = 88.722_83;
    const LO: f32 = -103.972_08; // ln 2^-150: below, e^x rounds to 0
    let c = x.clamp(LO, HI);
    let t = c * LOG2E + ROUND;
    let nf = t - ROUND;
    let r = (c - nf * LN2_HI) - nf * LN2_LO;
    let mut p = 1.0 / 40320.0;
    for k in [5040.0f32, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0] {
        p = p * r + 1.0 / k;
    }
    // n in the low mantissa bits of t; 2^n as 2^a 2^(n - a) with a = n / 2, both normal
    // for n in -150..=128 (p 2^a is exact; the second product rounds once, into the
    // subnormals where the result is one).
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let a = n >> 1;
    let pow2 = |e: i32| f32::from_bits((e.wrapping_add(127) << 23) as u32);
    let v = p * pow2(a) * pow2(n.wrapping_sub(a));
    let v = if x > HI { f32::INFINITY } else { v };
    let v = if x < LO { 0.0 } else { v };
    if x.is_nan() { x } else { v }
}

/// `1 / (1 + e^-x)`, in flex's two branches (`e^x / (1 + e^x)` below 0), with [`exp`].
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    }
}

/// `x sigmoid(x)` (flex's `silu`), with [`sigmoid`].
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `$vis fn $name(args) body`, compiled three times: with AVX-512F, with AVX2 and as built
/// (SSE2 on x86-64), the first the CPU has chosen at each call. The body inlines into
/// each copy (and what it calls `#[inline(always)]`, like [`exp`]), so its loops take
/// the CPU's widest vectors; the values are the same in all three (no fused multiply-add
/// is introduced: Rust does not contract `a * b + c`).
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn imp($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512($($arg: $ty),*) {
                imp($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            unsafe fn avx2($($arg: $ty),*) {
                imp($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Whether `x` is a flex (non-autodiff) f32 tensor, whose values the helpers can reach.
pub fn reachable<const D: usize>(x: &Tensor<D>) -> bool {
    x.dtype() == DType::F32 && is_flex(&x.device())
}

/// `f` over `x`'s values (row-major, as many as `x` has elements), borrowed without a
/// copy when `x` is contiguous. `None` when `x` is not [`reachable`].
#[cfg(feature = "flex")]
pub fn with_values<const D: usize, R>(x: &Tensor<D>, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    if !reachable(x) {
        return None;
    }
    // A strided view is copied over every core first ([`contiguous`]).
    let p = contiguous(x.clone())
        .try_into_primitive::<burn_flex::Flex>()
        .ok()?;
    match p.as_slice::<f32>() {
        Some(v) => Some(f(v)),
        None => p.to_contiguous().as_slice::<f32>().map(f),
    }
}
/// Flex is not built in: nothing is reachable.
#[cfg(not(feature = "flex"))]
pub fn with_values<const D: usize, R>(_: &Tensor<D>, _: impl FnOnce(&[f32]) -> R) -> Option<R> {
    None
}

/// `f` over `x`'s values in place (row-major), then `x`. The values are copied first only
/// when `x` shares its buffer or is strided.
///
/// # Panics
/// When `x` is not [`reachable`]: callers check first.
#[cfg(feature = "flex")]
pub fn update<const D: usize>(x: Tensor<D>, f: impl FnOnce(&mut [f32])) -> Tensor<D> {
    assert!(reachable(&x), "host::update: not a flex f32 tensor");
    let mut p = contiguous(x)
        .try_into_primitive::<burn_flex::Flex>()
        .expect("a reachable tensor is a flex float tensor");
    if p.layout().contiguous_offsets().is_none() {
        p = p.to_contiguous();
    }
    let (start, end) = p
        .layout()
        .contiguous_offsets()
        .expect("a contiguous layout has contiguous offsets");
    f(&mut p.storage_mut::<f32>()[start..end]);
    Tensor::from_primitive::<burn_flex::Flex>(p)
}
/// Flex is not built in: nothing is [`reachable`].
#[cfg(not(feature = "flex"))]
pub fn update<const D: usize>(_: Tensor<D>, _: impl FnOnce(&mut [f32])) -> Tensor<D> {
    unreachable!("host::update: flex is not built in, so no tensor is reachable")
}

/// `rows` in blocks of `block` rows, a last block shorter than `min(block, last)` rows
/// joining the one before it: the callers' products then never take one of `gemm`'s
/// special paths for a short tail (a single row, at most 64 rows, at most 256 outputs),
/// so every column sums as with the whole matrix.
pub fn row_blocks(
    rows: std::ops::Range<usize>,
    block: usize,
    last: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut starts: Vec<usize> = rows.clone().step_by(block.max(1)).collect();
    if let Some(&tail) = starts.last()
        && starts.len() > 1
        && rows.end - tail < block.min(last)
    {
        starts.pop();
    }
    (0..starts.len())
        .map(|i| starts[i]..starts.get(i + 1).copied().unwrap_or(rows.end))
        .collect()
}

/// Rows `idx` of `cat([a, b])` along the first axis (`a: [na, w]`, `b: [nb, w]`), copied
/// into one new tensor without the concatenation being built. `None` unless both are
/// [`reachable`] with the same width and every index is below `na + nb` (the caller's
/// tensor expression then reports what is wrong).
pub fn rows_of_two(a: &Tensor<2>, b: &Tensor<2>, idx: &[usize]) -> Option<Tensor<2>> {
    let ([na, w], [nb, wb]) = (a.dims(), b.dims());
    if w != wb || !reachable(a) || !reachable(b) || idx.iter().any(|&i| i >= na + nb) {
        return None;
    }
    let values = with_values(a, |av| {
        with_values(b, |bv| {
            gathered(idx.len(), w, |o| {
                let i = idx[o];
                if i < na {
                    &av[i * w..][..w]
                } else {
                    &bv[(i - na) * w..][..w]
                }
            })
        })
    })??;
    Some(tensor_from(values, [idx.len(), w], a))
}

/// `x: [b, total, a, c]` at positions `pos` along its second axis -> `[b, m, a, c]`, as
/// `x.select(1, ..)`, copied a position's `a * c` values at a time over every core (burn-flex
/// gathers on the calling thread, after copying a strided `x` whole). `pos` holds `m`
/// positions for every row, or `b * m` (row `r`'s at `r * m..`). `None` when `x` is not
/// [`reachable`], a position's values are not contiguous in `x`, `pos` has another length
/// or a position is out of range: the caller's `select` then runs (and reports it).
#[cfg(feature = "flex")]
pub fn positions(x: &Tensor<4>, pos: &[usize], m: usize) -> Option<Tensor<4>> {
    let [b, total, a, c] = x.dims();
    if !reachable(x) || (pos.len() != m && pos.len() != b * m) || pos.iter().any(|&p| p >= total) {
        return None;
    }
    let p = x.clone().try_into_primitive::<burn_flex::Flex>().ok()?;
    let l = p.layout();
    let st = l.strides();
    // The `a x c` values of a position, contiguous (axes of one element have any stride).
    if (c > 1 && st[3] != 1) || (a > 1 && st[2] != c as isize) {
        return None;
    }
    let (start, values) = (l.start_offset() as isize, p.storage::<f32>());
    let shared = pos.len() == m;
    let out = gathered(b * m, a * c, |o| {
        let (r, j) = (o / m, o % m);
        let at = start + r as isize * st[0] + pos[if shared { j } else { o }] as isize * st[1];
        let at = usize::try_from(at).expect("a layout's rows start inside its buffer");
        &values[at..at + a * c]
    });
    Some(tensor_from(out, [b, m, a, c], x))
}
/// Flex is not built in: nothing is [`reachable`].
#[cfg(not(feature = "flex"))]
pub fn positions(_: &Tensor<4>, _: &[usize], _: usize) -> Option<Tensor<4>> {
    None
}

/// `rows` rows of `width` values, row `o` copied from `row(o)`, over every core
/// ([`written_rows`]).
fn gathered<'a>(rows: usize, width: usize, row: impl Fn(usize) -> &'a [f32] + Sync) -> Vec<f32> {
    written_rows(rows, width, |o, put| put(row(o)))
}

/// `rows` rows of `width` values written over every core (about 16 K values per task):
/// `row(o, put)` hands row `o`'s values to `put` in order, in pieces that together are
/// exactly `width` values (checked). The buffer is not zeroed first: below glibc's mmap
/// threshold `vec![0.0; n]` is a `memset` on the calling thread, which for the gathered
/// keys of an attention block took longer than the copies over the pool; here each page
/// is first written by the thread that fills it.
fn written_rows(
    rows: usize,
    width: usize,
    row: impl Fn(usize, &mut dyn FnMut(&[f32])) + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    let total = rows * width;
    let mut out: Vec<f32> = Vec::with_capacity(total);
    if let Some(per_task) = (1usize << 14).checked_div(width) {
        let per_task = per_task + 1;
        out.spare_capacity_mut()[..total]
            .par_chunks_mut(width * per_task)
            .enumerate()
            .for_each(|(task, chunk)| {
                for (i, dst) in chunk.chunks_mut(width).enumerate() {
                    let mut at = 0;
                    row(task * per_task + i, &mut |piece: &[f32]| {
                        assert!(
                            at + piece.len() <= width,
                            "a row longer than {width} values"
                        );
                        // SAFETY: `piece` fits in `dst[at..]` (checked above), and the two
                        // do not overlap (`dst` is this buffer's spare capacity).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                piece.as_ptr(),
                                dst.as_mut_ptr().add(at).cast::<f32>(),
                                piece.len(),
                            );
                        }
                        at += piece.len();
                    });
                    assert_eq!(at, width, "a row of {at} values, not {width}");
                }
            });
    }
    // SAFETY: every one of the `total` values was written above (each row exactly
    // `width` values, checked; a panic in a task propagates before this line).
    unsafe { out.set_len(total) };
    out
}

/// `parts` joined along `dim`, as `Tensor::cat(parts, dim)`, copied into one new tensor a
/// row (the last axis) at a time over every core: burn-flex makes each strided part
/// contiguous first and then copies on the calling thread. A part may be a strided view
/// (a transpose, a slice) as long as its last axis is contiguous. `None` when a part is
/// not [`reachable`], the shapes do not join along `dim`, a part's last axis is strided or
/// the result is empty: the caller's `Tensor::cat` then runs (and reports a mismatch).
#[cfg(feature = "flex")]
pub fn cat<const D: usize>(parts: &[Tensor<D>], dim: usize) -> Option<Tensor<D>> {
    if D == 0 || dim >= D || parts.is_empty() || parts.iter().any(|p| !reachable(p)) {
        return None;
    }
    let prims = parts
        .iter()
        .map(|p| p.clone().try_into_primitive::<burn_flex::Flex>().ok())
        .collect::<Option<Vec<_>>>()?;
    let mut out = parts[0].dims();
    out[dim] = 0;
    let mut offsets = Vec::with_capacity(parts.len());
    for (p, prim) in parts.iter().zip(&prims) {
        let d = p.dims();
        let l = prim.layout();
        if (0..D).any(|a| a != dim && d[a] != out[a]) || (d[D - 1] > 1 && l.strides()[D - 1] != 1) {
            return None;
        }
        offsets.push(out[dim]);
        out[dim] += d[dim];
    }
    let width = out[D - 1];
    let total: usize = out.iter().product();
    if total == 0 {
        return None;
    }
    let lead = &out[..D - 1];
    let values = written_rows(total / width, width, |r, put| {
        let mut idx = [0usize; D];
        let mut rest = r;
        for a in (0..D - 1).rev() {
            idx[a] = rest % lead[a];
            rest /= lead[a];
        }
        if dim == D - 1 {
            for prim in &prims {
                put(row_of(prim, &idx[..D - 1], prim.layout().shape()[D - 1]));
            }
        } else {
            // The part holding this row (the last of those starting at or before it:
            // parts empty along `dim` start where the next one does).
            let k = offsets.partition_point(|&o| o <= idx[dim]) - 1;
            idx[dim] -= offsets[k];
            put(row_of(&prims[k], &idx[..D - 1], width));
        }
    });
    Some(tensor_from(values, out, &parts[0]))
}
/// Flex is not built in: nothing is [`reachable`].
#[cfg(not(feature = "flex"))]
pub fn cat<const D: usize>(_: &[Tensor<D>], _: usize) -> Option<Tensor<D>> {
    None
}

/// The `len` values of `p`'s row at the leading indices `idx` (its last axis
/// contiguous).
#[cfg(feature = "flex")]
fn row_of<'a>(p: &'a burn_flex::FlexTensor, idx: &[usize], len: usize) -> &'a [f32] {
    let l = p.layout();
    let at = idx
        .iter()
        .zip(l.strides())
        .fold(l.start_offset() as isize, |at, (&i, &s)| {
            at + i as isize * s
        });
    let at = usize::try_from(at).expect("a layout's rows start inside its buffer");
    &p.storage::<f32>()[at..at + len]
}

/// `x` with its values in row-major order in a buffer of its own, copied over every core
/// ([`cat`] of one part) when `x` is a strided flex view whose last axis is contiguous;
/// otherwise `x` as it is (contiguous already, or left to the backend's own copy).
pub fn contiguous<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if is_contiguous(&x) {
        return x;
    }
    cat(std::slice::from_ref(&x), 0).unwrap_or(x)
}

/// Whether `x` is a flex tensor whose values are row-major in its buffer (or not
/// reachable at all: then nothing here copies it).
#[cfg(feature = "flex")]
fn is_contiguous<const D: usize>(x: &Tensor<D>) -> bool {
    !reachable(x)
        || x.clone()
            .try_into_primitive::<burn_flex::Flex>()
            .map_or(true, |p| p.layout().contiguous_offsets().is_some())
}
/// Flex is not built in: nothing is [`reachable`].
#[cfg(not(feature = "flex"))]
fn is_contiguous<const D: usize>(_: &Tensor<D>) -> bool {
    true
}

/// A tensor of shape `shape` on `like`'s device holding `values` (row-major; moved, not
/// copied, on flex).
pub fn tensor_from<const D: usize, const E: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    like: &Tensor<E>,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), &like.device())
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;

    /// [`rows_of_two`] gives `cat([a, b]).select(idx)`, strided sides included; declines
    /// out-of-range indices, widths that differ and other devices.
    #[test]
    fn rows_of_two_is_the_selection_of_the_concatenation() {
        let dev = Device::flex();
        let t = |v: Vec<f32>, s: [usize; 2]| Tensor::<2>::from_data(TensorData::new(v, s), &dev);
        let a = t((0..12).map(|i| i as f32).collect(), [4, 3]);
        let b = t((0..9).map(|i| 100.0 + i as f32).collect(), [3, 3]).transpose();
        let idx = [5usize, 0, 3, 4, 4, 1, 6];
        let want = Tensor::cat(vec![a.clone(), b.clone()], 0).select(
            0,
            Tensor::from_data(TensorData::new(idx.map(|i| i as i64).to_vec(), [7]), &dev),
        );
        let got = rows_of_two(&a, &b, &idx).unwrap();
        assert_eq!(got.dims(), [7, 3]);
        assert_eq!(
            got.to_data().try_to_vec::<f32>().unwrap(),
            want.to_data().try_to_vec::<f32>().unwrap()
        );
        assert_eq!(rows_of_two(&a, &b, &[]).unwrap().dims(), [0, 3]);
        assert!(rows_of_two(&a, &b, &[7]).is_none());
        assert!(rows_of_two(&a, &t(vec![0.0; 4], [2, 2]), &[0]).is_none());
        let ad = Tensor::<2>::from_data(TensorData::new(vec![0f32; 6], [2, 3]), &dev.autodiff());
        assert!(rows_of_two(&ad, &a, &[0]).is_none());
    }

    /// [`cat`] gives `Tensor::cat` along every axis for contiguous, transposed, sliced and
    /// broadcast parts, parts empty along the axis included; [`contiguous`] keeps the
    /// values of a view; both decline what they cannot copy by rows.
    #[test]
    fn cat_is_burns_concatenation() {
        let dev = Device::flex();
        let values = |x: &Tensor<4>| x.to_data().try_to_vec::<f32>().unwrap();
        let t = |s: [usize; 4], from: f32| {
            let n: usize = s.iter().product();
            Tensor::<4>::from_data(
                TensorData::new((0..n).map(|i| from + i as f32).collect::<Vec<_>>(), s),
                &dev,
            )
        };
        for dim in 0..4 {
            let mut shape = [2, 3, 4, 5];
            let mut parts = Vec::new();
            for (k, len) in [2usize, 0, 3, 1].into_iter().enumerate() {
                shape[dim] = len;
                let base = 1000.0 * k as f32;
                parts.push(match k {
                    // A view with the first two axes swapped.
                    0 => {
                        let mut s = shape;
                        s.swap(0, 1);
                        t(s, base).swap_dims(0, 1)
                    }
                    // A slice of a larger tensor.
                    2 => {
                        let mut s = shape;
                        s[dim] += 2;
                        t(s, base).slice_dim(dim, 1..1 + len)
                    }
                    // Broadcast over every axis but the last.
                    3 => {
                        let s = [1, 1, 1, shape[3]];
                        t(s, base).expand(shape)
                    }
                    _ => t(shape, base),
                });
            }
            let want = Tensor::cat(parts.clone(), dim);
            let got = cat(&parts, dim).unwrap();
            assert_eq!(got.dims(), want.dims(), "dim {dim}");
            assert_eq!(values(&got), values(&want), "dim {dim}");
        }
        let x = t([2, 3, 4, 5], 0.0);
        let view = x.clone().swap_dims(1, 2);
        assert_eq!(values(&contiguous(view.clone())), values(&view));
        // The last axis strided, shapes that do not join, an empty result and autodiff
        // are declined.
        assert!(cat(&[x.clone().swap_dims(2, 3)], 0).is_none());
        assert!(cat(&[x.clone(), t([2, 3, 4, 6], 0.0)], 0).is_none());
        assert!(cat(&[x.clone().slice_dim(1, 0..0)], 1).is_none());
        let ad = Tensor::<4>::ones([2, 3, 4, 5], &dev.autodiff());
        assert!(cat(&[x.clone(), ad], 0).is_none());
        assert_eq!(
            values(&contiguous(x.clone().swap_dims(2, 3))),
            values(&x.swap_dims(2, 3))
        );
    }

    /// [`positions`] gives `select` along the second axis, with the same positions for
    /// every row or each row's own, from a contiguous tensor and from a slice of a wider
    /// one; it declines positions out of range, a wrong count, values of a position that
    /// are not contiguous and autodiff.
    #[test]
    fn positions_are_burns_selection() {
        let dev = Device::flex();
        let values = |x: &Tensor<4>| x.to_data().try_to_vec::<f32>().unwrap();
        let x = Tensor::<4>::from_data(
            TensorData::new(
                (0..2 * 7 * 3 * 4).map(|i| i as f32).collect::<Vec<_>>(),
                [2, 7, 3, 4],
            ),
            &dev,
        );
        let ints = |v: &[usize]| {
            Tensor::<1, burn::tensor::Int>::from_data(
                TensorData::new(v.iter().map(|&i| i as i64).collect::<Vec<_>>(), [v.len()]),
                &dev,
            )
        };
        for x in [x.clone(), x.clone().slice_dim(1, 1..6)] {
            let shared = [4usize, 0, 0, 2];
            let want = x.clone().select(1, ints(&shared));
            assert_eq!(values(&positions(&x, &shared, 4).unwrap()), values(&want));
            let own = [1usize, 3, 2, 0, 4, 4];
            let rows: Vec<Tensor<4>> = (0..2)
                .map(|r| {
                    x.clone()
                        .slice_dim(0, r..r + 1)
                        .select(1, ints(&own[r * 3..r * 3 + 3]))
                })
                .collect();
            let want = Tensor::cat(rows, 0);
            assert_eq!(values(&positions(&x, &own, 3).unwrap()), values(&want));
        }
        assert!(positions(&x, &[7], 1).is_none());
        assert!(positions(&x, &[0, 1, 2], 2).is_none());
        assert!(positions(&x.clone().swap_dims(2, 3), &[0], 1).is_none());
        let ad = Tensor::<4>::ones([2, 7, 3, 4], &dev.autodiff());
        assert!(positions(&ad, &[0], 1).is_none());
        assert_eq!(positions(&x, &[], 0).unwrap().dims(), [2, 0, 3, 4]);
    }

    /// [`exp`] within 2 ulp of libm's over its whole range, exact at the ends (0, inf, NaN),
    /// and [`sigmoid`] within 2 ulp of flex's form; the same values with the CPU's vector
    /// instructions as without.
    #[test]
    fn exp_and_sigmoid_follow_libm() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        // -106 to 90: the subnormal results and both overflows included.
        let mut xs: Vec<f32> = (-2_400_000..=2_050_000)
            .map(|i| i as f32 * 4.4e-5)
            .collect();
        xs.extend([
            0.0, -0.0, 1e-30, -1e-30, 88.7, 88.72, -87.3, -87.33, -103.97, -103.28,
        ]);
        for &x in &xs {
            let (got, want) = (exp(x), x.exp());
            assert!(ulps(got, want) <= 2, "exp({x}) = {got}, libm {want}");
            let s = if x >= 0.0 {
                1.0 / (1.0 + (-x).exp())
            } else {
                x.exp() / (1.0 + x.exp())
            };
            assert!(
                ulps(sigmoid(x), s) <= 2,
                "sigmoid({x}) = {}, want {s}",
                sigmoid(x)
            );
        }
        for (x, want) in [
            (89.0, f32::INFINITY),
            (1e30, f32::INFINITY),
            (f32::INFINITY, f32::INFINITY),
            (-104.0, 0.0),
            (-1e30, 0.0),
            (f32::NEG_INFINITY, 0.0),
        ] {
            assert_eq!(exp(x), want, "exp({x})");
        }
        assert!(exp(f32::NAN).is_nan() && sigmoid(f32::NAN).is_nan());
        assert_eq!((sigmoid(-1e30), sigmoid(1e30)), (0.0, 1.0));
        multiversion! {
            fn exps(xs: &[f32], out: &mut [f32]) {
                for (o, &x) in out.iter_mut().zip(xs) {
                    *o = exp(x);
                }
            }
        }
        let mut vector = vec![0f32; xs.len()];
        exps(&xs, &mut vector);
        let plain: Vec<u32> = xs.iter().map(|&x| exp(x).to_bits()).collect();
        assert!(plain == vector.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }

    #[test]
    fn values_are_lent_and_updated_in_place_or_copied_when_shared() {
        let dev = Device::flex();
        let x = Tensor::<2>::from_data(
            TensorData::new((0..6).map(|v| v as f32).collect::<Vec<_>>(), [2, 3]),
            &dev,
        );
        assert_eq!(
            with_values(&x, |v| v.to_vec()),
            Some(vec![0., 1., 2., 3., 4., 5.])
        );
        // A strided view is read in its own order.
        let t = x.clone().transpose();
        assert_eq!(
            with_values(&t, |v| v.to_vec()),
            Some(vec![0., 3., 1., 4., 2., 5.])
        );
        // Shared: the update copies, the other holder keeps its values.
        let y = update(x.clone(), |v| v.iter_mut().for_each(|e| *e *= 2.0));
        assert_eq!(
            y.to_data().try_into_vec::<f32>().unwrap(),
            vec![0., 2., 4., 6., 8., 10.]
        );
        assert_eq!(
            x.to_data().try_into_vec::<f32>().unwrap(),
            vec![0., 1., 2., 3., 4., 5.]
        );
        // A slice of rows updates only its rows.
        let s = update(x.clone().slice_dim(0, 1..2), |v| {
            v.iter_mut().for_each(|e| *e += 1.0)
        });
        assert_eq!(s.to_data().try_into_vec::<f32>().unwrap(), vec![4., 5., 6.]);
        // Autodiff tensors are not reachable: the tensor comes back.
        let a = Tensor::<2>::ones([2, 2], &dev.autodiff());
        assert!(with_values(&a, |_| ()).is_none());
        assert!(!reachable(&a));
    }
}
