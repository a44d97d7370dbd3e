//! Matrix products on flex's f32 buffers, split over the rayon pool by us.
//!
//! burn-flex hands each product to `gemm` whole (its own threading splits every `k` slab
//! of the product over the threads and joins them after each) and writes the result into
//! a zeroed buffer that it then copies into an aligned one. For the products of a
//! forward, most of them thin (`2048 x 4096 x 512`, `2048 x 16384 x 24`) or short
//! (`512 x 576 x 576`), that left a third of the cores' GEMM rate unused. Here the
//! output is one buffer that the product writes into, and a product is split into as
//! many column blocks (else row blocks) as the pool has threads, each block one
//! single-threaded `gemm` call with no join until the end. Many small matrices of one
//! batched product (attention scores per head) are spread over the pool instead.
//!
//! # Same values as the whole product
//! `gemm` accumulates every output element over `k` in slabs whose depth depends only on
//! `k` and the CPU's caches, and in the same order whichever tile the element falls in,
//! except on its special paths (products with `k <= 2`, a single row or column, at most
//! 256 outputs, or both sides at most 64). A product is split only when both it and
//! every block stay off those paths ([`general`]), so each element gets the same sums as
//! from one call over the whole product, whatever the thread count (tested bit for bit
//! against burn's product). Other products run whole, as burn-flex would run them.

use burn::tensor::Tensor;

use super::host;

/// Below this many multiply-adds (`m * n * k`, all matrices of a batch together) a product
/// runs on the calling thread: burn-flex's threshold for its own threading.
const PARALLEL_WORK: usize = 192 * 192 * 192;

/// The narrowest block a split makes (columns or rows).
const MIN_BLOCK: usize = 128;

/// Block widths are rounded to this many columns / rows (a multiple of the f32 kernels'
/// tile sides).
const ALIGN: usize = 16;

/// `a x b` over the last two axes, batch axes broadcast as in `Tensor::matmul`, when both
/// are [`host::reachable`] flex f32 tensors; `None` otherwise (and for mismatched shapes,
/// which the caller's `matmul` then reports).
pub fn matmul<const D: usize>(a: &Tensor<D>, b: &Tensor<D>) -> Option<Tensor<D>> {
    if D < 2 || !host::reachable(a) || !host::reachable(b) {
        return None;
    }
    let pa = a.clone().try_into_primitive::<burn_flex::Flex>().ok()?;
    let pb = b.clone().try_into_primitive::<burn_flex::Flex>().ok()?;
    let (lhs, rhs) = (Operand::of(&pa), Operand::of(&pb));
    let batch = Batch::broadcast(&lhs, &rhs)?;
    let plan = Plan::new(&lhs, &rhs, &batch)?;
    let mut out = vec![0f32; batch.len() * plan.m * plan.n];
    plan.run(&mut out, rayon::current_num_threads());
    let mut shape = [0; D];
    shape[..D - 2].copy_from_slice(&batch.dims);
    shape[D - 2] = plan.m;
    shape[D - 1] = plan.n;
    Some(host::tensor_from(out, shape, a))
}
/// One side of a product: its values, where it starts and its strides (in values).
struct Operand<'a> {
    values: &'a [f32],
    start: usize,
    dims: Vec<usize>,
    strides: Vec<isize>,
}

impl<'a> Operand<'a> {
    fn of(p: &'a burn_flex::FlexTensor) -> Self {
        let layout = p.layout();
        Operand {
            values: p.storage::<f32>(),
            start: layout.start_offset(),
            dims: layout.shape().iter().copied().collect(),
            strides: layout.strides().to_vec(),
        }
    }
}

impl Operand<'_> {
    /// Stride of axis `i` from the end (0: columns, 1: rows).
    fn stride_from_end(&self, i: usize) -> isize {
        self.strides[self.strides.len() - 1 - i]
    }

    /// Pointer to the element at `offset + row * rs + col * cs` from the start (the
    /// first element of a block; not read when the block is empty).
    fn at(&self, offset: isize, row: usize, col: usize) -> *const f32 {
        let i = self.start as isize
            + offset
            + row as isize * self.stride_from_end(1)
            + col as isize * self.stride_from_end(0);
        self.values.as_ptr().wrapping_offset(i)
    }
}

/// The broadcast batch axes of a product and each side's offset per batch matrix.
struct Batch {
    dims: Vec<usize>,
    lhs: Vec<isize>,
    rhs: Vec<isize>,
}

impl Batch {
    /// `None` when the batch axes do not broadcast.
    fn broadcast(lhs: &Operand, rhs: &Operand) -> Option<Batch> {
        let axes = lhs.dims.len() - 2;
        let mut dims = Vec::with_capacity(axes);
        for i in 0..axes {
            let (a, b) = (lhs.dims[i], rhs.dims[i]);
            if a != b && a != 1 && b != 1 {
                return None;
            }
            dims.push(if a == 1 { b } else { a });
        }
        let offsets = |side: &Operand| {
            let len: usize = dims.iter().product();
            (0..len)
                .map(|mut flat| {
                    let mut off = 0isize;
                    for i in (0..axes).rev() {
                        let idx = flat % dims[i];
                        flat /= dims[i];
                        if side.dims[i] != 1 {
                            off += idx as isize * side.strides[i];
                        }
                    }
                    off
                })
                .collect::<Vec<_>>()
        };
        let (l, r) = (offsets(lhs), offsets(rhs));
        Some(Batch {
            dims,
            lhs: l,
            rhs: r,
        })
    }

    fn len(&self) -> usize {
        self.lhs.len()
    }
}

/// Whether `gemm` computes an `m x n` product of depth `k` on its general path (module
/// docs), where an element's sums do not depend on the rest of the product.
fn general(m: usize, n: usize, k: usize) -> bool {
    k > 2 && m >= 2 && n >= 2 && m * n > 256 && (m > 64 || n > 64)
}

/// `len` split into at most `parts` ranges of at least [`MIN_BLOCK`] (all but the last a
/// multiple of [`ALIGN`]); one range when `len` is too short to split.
fn split(len: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.min(len / MIN_BLOCK).max(1);
    let width = len.div_ceil(parts).next_multiple_of(ALIGN);
    (0..len)
        .step_by(width.max(1))
        .map(|s| s..(s + width).min(len))
        .collect()
}

/// One `gemm` call: rows `rows` and columns `cols` of batch matrix `b`.
struct Task {
    b: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    threads: gemm::Parallelism,
}

struct Plan<'a> {
    m: usize,
    n: usize,
    k: usize,
    batch: &'a Batch,
    lhs: &'a Operand<'a>,
    rhs: &'a Operand<'a>,
}

impl<'a> Plan<'a> {
    /// The product of `lhs` and `rhs` over `batch`; `None` when their inner sizes differ.
    fn new(lhs: &'a Operand<'a>, rhs: &'a Operand<'a>, batch: &'a Batch) -> Option<Self> {
        let d = lhs.dims.len();
        let k = lhs.dims[d - 1];
        (rhs.dims[d - 2] == k).then(|| Plan {
            m: lhs.dims[d - 2],
            n: rhs.dims[d - 1],
            k,
            batch,
            lhs,
            rhs,
        })
    }

    /// The calls that make the product with `threads` threads, and whether they run over
    /// the pool (else one after the other on the calling thread).
    fn tasks(&self, threads: usize) -> (Vec<Task>, bool) {
        let (m, n, k) = (self.m, self.n, self.k);
        let count = self.batch.len();
        let whole = |b, threads| Task {
            b,
            rows: 0..m,
            cols: 0..n,
            threads,
        };
        let one = m.saturating_mul(n).saturating_mul(k);
        let each = |threads| (0..count).map(|b| whole(b, threads)).collect();
        if threads <= 1 || one.saturating_mul(count) < PARALLEL_WORK {
            return (each(gemm::Parallelism::None), false);
        }
        // Many matrices, or small ones: one call per matrix, spread over the pool.
        if count >= 2 * threads || one < PARALLEL_WORK {
            return (each(gemm::Parallelism::None), true);
        }
        if !general(m, n, k) {
            return (each(gemm::Parallelism::Rayon(0)), false);
        }
        let (cols, rows) = (split(n, threads), split(m, threads));
        let narrowest = |r: &[std::ops::Range<usize>]| r.iter().map(|r| r.len()).min().unwrap_or(0);
        let by_cols = cols.len() > 1 && general(m, narrowest(&cols), k);
        let by_rows = rows.len() > 1 && general(narrowest(&rows), n, k);
        if !(by_cols || by_rows) {
            return (each(gemm::Parallelism::Rayon(0)), false);
        }
        let blocks: Vec<_> = if by_cols {
            cols.into_iter().map(|c| (0..m, c)).collect()
        } else {
            rows.into_iter().map(|r| (r, 0..n)).collect()
        };
        let tasks = (0..count)
            .flat_map(|b| {
                blocks.iter().map(move |(rows, cols)| Task {
                    b,
                    rows: rows.clone(),
                    cols: cols.clone(),
                    threads: gemm::Parallelism::None,
                })
            })
            .collect();
        (tasks, true)
    }

    /// Write the product into `out` (`batch x m x n`, row-major).
    fn run(&self, out: &mut [f32], threads: usize) {
        use rayon::prelude::*;
        let (tasks, parallel) = self.tasks(threads);
        let base = out.as_mut_ptr() as usize;
        let run = |t: &Task| {
            let (m, n) = (self.m, self.n);
            let dst = base as *mut f32;
            // SAFETY: the tasks cover disjoint blocks of `out` (distinct matrices, or
            // distinct rows or columns of one), each inside `batch x m x n` values; the
            // operands' pointers and strides are their own layouts'.
            unsafe {
                let dst = dst.add(t.b * m * n + t.rows.start * n + t.cols.start);
                gemm::gemm(
                    t.rows.len(),
                    t.cols.len(),
                    self.k,
                    dst,
                    1,
                    n as isize,
                    false,
                    self.lhs.at(self.batch.lhs[t.b], t.rows.start, 0),
                    self.lhs.stride_from_end(0),
                    self.lhs.stride_from_end(1),
                    self.rhs.at(self.batch.rhs[t.b], 0, t.cols.start),
                    self.rhs.stride_from_end(0),
                    self.rhs.stride_from_end(1),
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    t.threads,
                );
            }
        };
        if parallel {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// Values of varied sign and magnitude (a fixed LCG), so that a change in the order of
    /// any element's sums shows in its bits.
    fn values<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<D> {
        let len: usize = shape.iter().product();
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v: Vec<f32> = (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * (1.0 + ((s >> 20) % 7) as f32)
            })
            .collect();
        Tensor::from_data(TensorData::new(v, shape), &Device::flex())
    }

    fn bits<const D: usize>(t: Tensor<D>) -> Vec<u32> {
        let v = t
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    /// Ours with `threads` threads, next to burn's product, bit for bit.
    fn check<const D: usize>(a: Tensor<D>, b: Tensor<D>, what: &str) {
        let expected = a.clone().matmul(b.clone());
        let dims = expected.dims();
        let expected = bits(expected);
        for threads in [1, 2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let ours = pool
                .install(|| matmul(&a, &b))
                .expect("flex f32 is taken over");
            assert_eq!(ours.dims(), dims, "{what}: shape");
            assert!(
                bits(ours) == expected,
                "{what}, {threads} threads: values differ"
            );
        }
    }

    /// How many calls, and over the pool or not, for `a x b` with `threads` threads.
    fn plan_of<const D: usize>(a: &Tensor<D>, b: &Tensor<D>, threads: usize) -> (usize, bool) {
        let pa = a.clone().try_into_primitive::<burn_flex::Flex>().unwrap();
        let pb = b.clone().try_into_primitive::<burn_flex::Flex>().unwrap();
        let (lhs, rhs) = (Operand::of(&pa), Operand::of(&pb));
        let batch = Batch::broadcast(&lhs, &rhs).unwrap();
        let plan = Plan::new(&lhs, &rhs, &batch).unwrap();
        let (tasks, parallel) = plan.tasks(threads);
        (tasks.len(), parallel)
    }

    #[test]
    fn split_products_give_burns_product_bit_for_bit() {
        // Split by columns; the weight read transposed, as `Linear` does.
        let x = values([300, 96], 1);
        let w = values([700, 96], 2).transpose();
        assert_eq!(plan_of(&x, &w, 2), (2, true));
        assert_eq!(plan_of(&x, &w, 3), (3, true));
        assert_eq!(plan_of(&x, &w, 1), (1, false));
        check(x, w, "columns");
        // Thin: split by rows; the left side a strided slice of a wider tensor.
        let x = values([2000, 200], 3).slice([0..2000, 20..180]);
        let w = values([160, 24], 4);
        assert_eq!(plan_of(&x, &w, 2), (2, true));
        check(x, w, "rows, strided");
        // Two matrices, each split; and many small ones over the pool.
        let (a, b) = (values([2, 300, 96], 5), values([2, 96, 300], 6));
        assert_eq!(plan_of(&a, &b, 2), (4, true));
        check(a, b, "batch of two");
        let (a, b) = (values([2, 1, 200, 64], 7), values([1, 3, 64, 300], 8));
        assert_eq!(plan_of(&a, &b, 2), (6, true));
        check(a, b, "broadcast batch");
        // Products gemm takes on its special paths run whole.
        check(values([1, 600], 9), values([600, 4096], 10), "one row");
        check(
            values([4000, 3000], 11),
            values([3000, 1], 12),
            "one column",
        );
        check(values([20000, 2], 13), values([2, 700], 14), "depth 2");
        check(
            values([40, 3000], 15),
            values([3000, 60], 16),
            "both sides at most 64",
        );
        check(
            values([2, 16000], 17),
            values([256, 16000], 18).transpose(),
            "two rows, deep",
        );
        check(
            values([1, 2000], 21),
            values([2000, 4096], 22),
            "one row, wide",
        );
        // Reversed strides (a flipped axis).
        check(
            values([300, 96], 19).flip([0]),
            values([96, 700], 20).flip([1]),
            "flipped",
        );
    }

    #[test]
    fn empty_and_mismatched_products() {
        let z = matmul(&values([5, 0], 1), &values([0, 7], 2)).unwrap();
        assert_eq!(z.dims(), [5, 7]);
        assert!(bits(z).iter().all(|&b| b == 0));
        assert_eq!(
            matmul(&values([0, 4], 1), &values([4, 3], 2))
                .unwrap()
                .dims(),
            [0, 3]
        );
        // Left to burn, which reports them.
        assert!(matmul(&values([5, 4], 1), &values([3, 7], 2)).is_none());
        assert!(matmul(&values([2, 5, 4], 1), &values([3, 4, 7], 2)).is_none());
        // Other devices and dtypes are declined.
        let ad = Tensor::<2>::from_data(
            TensorData::new(vec![1f32; 4], [2, 2]),
            &Device::flex().autodiff(),
        );
        assert!(matmul(&ad, &ad).is_none());
    }
}
