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
    let p = x.clone().try_into_primitive::<burn_flex::Flex>().ok()?;
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
    let mut p = x
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
            let mut out = Vec::with_capacity(idx.len() * w);
            for &i in idx {
                out.extend_from_slice(if i < na {
                    &av[i * w..][..w]
                } else {
                    &bv[(i - na) * w..][..w]
                });
            }
            out
        })
    })??;
    Some(tensor_from(values, [idx.len(), w], a))
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
