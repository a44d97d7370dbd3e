//! Matrix-product FLOPs executed by the model code, counted while enabled
//! (`phaselens bench forward` reports them per forward, as GFLOP/s and as a fraction of
//! the device's dense-GEMM rate). Every product of the model code goes through
//! [`Mm::mm`]; a product of `[.., m, k] x [.., k, n]` over `batch` broadcast matrices
//! counts `2 * batch * m * k * n`. Elementwise work (norms, softmax, RoPE, gathers) is not
//! counted. Off by default: one relaxed atomic load per product. The product is computed
//! in the thread's compute dtype ([`super::precision`]).
//!
//! A leaf: the model files call it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use burn::tensor::{DType, Tensor};

use super::precision::{ComputeDtype, compute};

static COUNTING: AtomicBool = AtomicBool::new(false);
static FLOPS: AtomicU64 = AtomicU64::new(0);

/// A counted matrix product.
pub trait Mm {
    /// `self.matmul(rhs)`, counted while [`start`] is in effect, in the compute dtype
    /// ([`super::precision::compute`]): with bf16 both operands are rounded to bf16 and
    /// the product (f32 sums, rounded to bf16) comes back as f32.
    fn mm(self, rhs: Self) -> Self;
}

impl<const D: usize> Mm for Tensor<D> {
    fn mm(self, rhs: Self) -> Self {
        count(&self.dims(), &rhs.dims());
        let n = rhs.dims()[D - 1];
        super::profile::timed(super::profile::Kind::Products, n, || match compute() {
            ComputeDtype::F32 => {
                #[cfg(feature = "flex")]
                if let Some(p) = super::products::matmul(&self, &rhs) {
                    return p;
                }
                self.matmul(rhs)
            }
            ComputeDtype::Bf16 => self
                .cast(DType::BF16)
                .matmul(rhs.cast(DType::BF16))
                .cast(DType::F32),
        })
    }
}

/// Count a product of `[.., m, k] x [.., k, n]` (while [`start`] is in effect) that the
/// model code computes without [`Mm::mm`].
pub fn count(a: &[usize], b: &[usize]) {
    if COUNTING.load(Ordering::Relaxed) {
        FLOPS.fetch_add(product_flops(a, b), Ordering::Relaxed);
    }
}

/// FLOPs of `[.., m, k] x [.., k, n]` with broadcast batch dimensions.
pub fn product_flops(a: &[usize], b: &[usize]) -> u64 {
    let d = a.len();
    if d < 2 || b.len() != d {
        return 0;
    }
    let batch: u64 = (0..d - 2).map(|i| a[i].max(b[i]) as u64).product();
    2 * batch * a[d - 2] as u64 * a[d - 1] as u64 * b[d - 1] as u64
}

/// Reset the counter and count from now on.
pub fn start() {
    FLOPS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
}

/// Stop counting; the FLOPs counted since [`start`].
pub fn stop() -> u64 {
    COUNTING.store(false, Ordering::Relaxed);
    FLOPS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_count_two_flops_per_multiply_add_with_broadcast() {
        assert_eq!(product_flops(&[3, 4], &[4, 5]), 2 * 3 * 4 * 5);
        assert_eq!(
            product_flops(&[2, 1, 3, 4], &[1, 6, 4, 5]),
            2 * 12 * 3 * 4 * 5
        );
    }
}
