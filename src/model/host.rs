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
