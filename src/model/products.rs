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
//! against burn's product). One-row products whose right side is read by columns (a
//! vector times a transposed weight, the LM head of a prefill) are one dot product per
//! column ([`dot_rows`]) and split by columns too. Other products run whole, as
//! burn-flex would run them.
//!
//! # Weights filled on demand
//! [`matmul_t_filled`] multiplies by a matrix that exists only as rows a closure writes
//! (stored BF16 / FP8 / FP4 / GGUF weights dequantised): each thread fills a block of the
//! matrix's rows into a buffer of its own, kept between calls, and multiplies it into its
//! columns of the output, so no dequantised copy of the matrix is made, joined or freed
//! and the threads do not wait for each other between the blocks.

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
    let out = plan.run(rayon::current_num_threads());
    let mut shape = [0; D];
    shape[..D - 2].copy_from_slice(&batch.dims);
    shape[D - 2] = plan.m;
    shape[D - 1] = plan.n;
    Some(host::tensor_from(out, shape, a))
}
thread_local! {
    /// Each thread's buffer of filled rows ([`matmul_t_filled`]), kept between calls.
    static FILLED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Values per block of a one-row [`matmul_t_filled`]: about 1 MiB of filled values, which
/// stay in the core's cache for the dot products that read them (at least
/// [`MIN_DOT_BLOCK`] rows).
const DOT_BLOCK_VALUES: usize = 1 << 18;

/// `x W^T: [n, rows]` for `x: [n, k]` and the `rows x k` matrix `W` whose rows
/// `fill(r0..r1, out)` writes row-major into `out` (`(r1 - r0) x k` values), with no
/// copy of `W` made: each thread fills blocks of at most `block` rows (fewer for a
/// one-row `x`) into its own buffer and multiplies them into its columns of the output.
/// Each column's values are those of `x.matmul(W.transpose())` with the whole matrix,
/// whatever the threads: `None` (the caller multiplies otherwise) when a block would take
/// one of `gemm`'s special paths, when `x` is not a [`host::reachable`] flex f32 tensor,
/// and for empty products.
pub fn matmul_t_filled(
    x: &Tensor<2>,
    rows: usize,
    block: usize,
    fill: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) -> Option<Tensor<2>> {
    use rayon::prelude::*;
    if !host::reachable(x) {
        return None;
    }
    let px = x.clone().try_into_primitive::<burn_flex::Flex>().ok()?;
    let lhs = Operand::of(&px);
    let (n, k) = (lhs.dims[0], lhs.dims[1]);
    let lhs_cs = lhs.stride_from_end(0);
    let (block, last) = if n == 1 {
        let cached = (DOT_BLOCK_VALUES / k.max(1)).max(MIN_DOT_BLOCK);
        (block.min(cached), MIN_DOT_BLOCK)
    } else {
        // The narrowest block on the general path with `n` rows.
        (block, 65.max(256 / n.max(1) + 1))
    };
    let parts = filled_blocks(rows, rayon::current_num_threads(), block, last);
    let on_path = |b: &std::ops::Range<usize>| {
        if n == 1 {
            dot_rows(n, b.len(), k, lhs_cs, 1)
        } else {
            general(n, b.len(), k)
        }
    };
    if n == 0 || rows == 0 || !parts.iter().flatten().all(on_path) {
        return None;
    }
    let covered: usize = parts.iter().flatten().map(|b| b.len()).sum();
    assert_eq!(covered, rows, "the blocks cover the rows");
    // Not zeroed here: each block zeroes its columns before its product writes them
    // (as `Plan::run`).
    let mut out: Vec<f32> = Vec::with_capacity(n * rows);
    let base = out.as_mut_ptr() as usize;
    parts.par_iter().for_each(|blocks| {
        FILLED.with(|buf| {
            let mut buf = buf.borrow_mut();
            for b in blocks {
                let len = b.len() * k;
                if buf.len() < len {
                    buf.resize(len, 0.0);
                }
                fill(b.clone(), &mut buf[..len]);
                // SAFETY: each block writes its own columns `b` of `out` (`n x rows`, row
                // stride `rows`, within its capacity), the threads' blocks are disjoint;
                // the right side is the filled rows read transposed (`k x b.len()`,
                // column stride `k`), the left side `x` in its own layout.
                unsafe {
                    zeroed_gemm(
                        [n, b.len(), k],
                        ((base as *mut f32).add(b.start), rows),
                        lhs.side(0, 0, 0),
                        Side {
                            at: buf.as_ptr(),
                            cs: k as isize,
                            rs: 1,
                        },
                        gemm::Parallelism::None,
                    );
                }
            }
        })
    });
    // SAFETY: the blocks tile `0..rows` (`filled_blocks`: each thread's part of `split`
    // in consecutive blocks), so every column of every row was zeroed and written.
    unsafe { out.set_len(n * rows) };
    Some(host::tensor_from(out, [n, rows], x))
}

/// One side of [`zeroed_gemm`]: where its block starts, its column and row strides.
struct Side {
    at: *const f32,
    cs: isize,
    rs: isize,
}

/// `dst := lhs rhs` for an `m x k` and a `k x n` block: the `m x n` block at `dst` (row
/// stride `dst_rs`, columns contiguous) is zeroed row by row, then `gemm` writes it
/// (`dst` is not read: the zeroes only make every value initialised whatever `gemm`
/// does with an empty sum).
///
/// # Safety
/// `dst` must point at `m` rows of `n` values `dst_rs` apart that nothing else touches
/// meanwhile; `lhs` and `rhs` must address their whole blocks.
unsafe fn zeroed_gemm(
    [m, n, k]: [usize; 3],
    (dst, dst_rs): (*mut f32, usize),
    lhs: Side,
    rhs: Side,
    threads: gemm::Parallelism,
) {
    // SAFETY: the caller's contract.
    unsafe {
        for r in 0..m {
            std::ptr::write_bytes(dst.add(r * dst_rs), 0, n);
        }
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            lhs.at,
            lhs.cs,
            lhs.rs,
            rhs.at,
            rhs.cs,
            rhs.rs,
            0.0,
            1.0,
            false,
            false,
            false,
            threads,
        );
    }
}

/// `rows` in one list of blocks per thread: [`split`] over `threads`, each part in
/// [`host::row_blocks`] of `block` rows (a last block shorter than `min(block, last)`
/// rows joining the one before it).
fn filled_blocks(
    rows: usize,
    threads: usize,
    block: usize,
    last: usize,
) -> Vec<Vec<std::ops::Range<usize>>> {
    split(rows, threads)
        .into_iter()
        .map(|part| host::row_blocks(part, block, last))
        .collect()
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

    /// The block of this operand whose first element is [`Operand::at`]`(offset, row,
    /// col)`, for [`zeroed_gemm`].
    fn side(&self, offset: isize, row: usize, col: usize) -> Side {
        Side {
            at: self.at(offset, row, col),
            cs: self.stride_from_end(0),
            rs: self.stride_from_end(1),
        }
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

/// Whether `gemm` computes a one-row product of `n` columns and depth `k` as one dot
/// product per column on its row-major matrix-vector path (the left row and each right
/// column contiguous, more than 256 columns), each over `k` in an order that depends on
/// `k` alone: any split of the columns into blocks for which this holds too gives the
/// same values. (At most 256 columns take its small-product path, which sums in slabs.)
/// `lhs_cs`: the left side's column stride; `rhs_rs`: the right side's row stride.
fn dot_rows(m: usize, n: usize, k: usize, lhs_cs: isize, rhs_rs: isize) -> bool {
    m == 1 && n > 256 && k > 2 && lhs_cs == 1 && rhs_rs == 1
}

/// The fewest columns of a block that [`dot_rows`] allows, rounded up to [`ALIGN`].
const MIN_DOT_BLOCK: usize = 272;

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
        let dots = |n| {
            dot_rows(
                m,
                n,
                k,
                self.lhs.stride_from_end(0),
                self.rhs.stride_from_end(1),
            )
        };
        if !general(m, n, k) && !dots(n) {
            return (each(gemm::Parallelism::Rayon(0)), false);
        }
        let (cols, rows) = (split(n, threads), split(m, threads));
        let narrowest = |r: &[std::ops::Range<usize>]| r.iter().map(|r| r.len()).min().unwrap_or(0);
        let by_cols = cols.len() > 1 && {
            let w = narrowest(&cols);
            dots(w) || general(m, w, k)
        };
        let by_rows = m > 1 && rows.len() > 1 && general(narrowest(&rows), n, k);
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

    /// The product of the batch's matrices (`batch x m x n`, row-major).
    /// The buffer is not zeroed on the calling thread first: each task zeroes its own
    /// block just before its product writes it (below glibc's mmap threshold
    /// `vec![0.0; n]` is a `memset` on the calling thread, while the pool waits).
    fn run(&self, threads: usize) -> Vec<f32> {
        use rayon::prelude::*;
        let (m, n) = (self.m, self.n);
        let total = self.batch.len() * m * n;
        let (tasks, parallel) = self.tasks(threads);
        let covered: usize = tasks.iter().map(|t| t.rows.len() * t.cols.len()).sum();
        assert_eq!(covered, total, "the product's tasks cover its output");
        let mut out: Vec<f32> = Vec::with_capacity(total);
        let base = out.as_mut_ptr() as usize;
        let run = |t: &Task| {
            let dst = base as *mut f32;
            // SAFETY: the tasks cover disjoint blocks of `out` (distinct matrices, or
            // distinct rows or columns of one), each inside `batch x m x n` values of its
            // capacity; the operands' pointers and strides are their own layouts'.
            unsafe {
                zeroed_gemm(
                    [t.rows.len(), t.cols.len(), self.k],
                    (dst.add(t.b * m * n + t.rows.start * n + t.cols.start), n),
                    self.lhs.side(self.batch.lhs[t.b], t.rows.start, 0),
                    self.rhs.side(self.batch.rhs[t.b], 0, t.cols.start),
                    t.threads,
                );
            }
        };
        if parallel {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
        // SAFETY: the disjoint tasks cover all `total` values (counted above), and each
        // zeroed its block before its product wrote it.
        unsafe { out.set_len(total) };
        out
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

    /// A one-row product with a transposed right side is split by columns and keeps
    /// burn's values.
    #[test]
    fn one_row_products_split_by_columns() {
        let x = values([1, 3000], 23);
        let w = values([4096, 3000], 24).transpose();
        assert_eq!(plan_of(&x, &w, 2), (2, true));
        check(x, w, "one row, transposed weight");
        // Strided row: left whole.
        let x = values([3000, 2], 25).transpose().slice([0..1, 0..3000]);
        let w = values([4096, 3000], 26).transpose();
        assert_eq!(plan_of(&x, &w, 2), (1, false));
        check(x, w, "one strided row");
    }

    /// `x W^T` with `W` filled block by block equals burn's product with the whole `W`,
    /// bit for bit, on 1-4 threads, for blocks of many sizes; declined where a block
    /// would leave gemm's general path.
    #[test]
    fn filled_products_give_the_whole_products_bits() {
        let (rows, k) = (2000, 300);
        let w = values([rows, k], 31);
        let wv: Vec<f32> = bits(w.clone()).into_iter().map(f32::from_bits).collect();
        let fill = |r: std::ops::Range<usize>, out: &mut [f32]| {
            out.copy_from_slice(&wv[r.start * k..r.end * k]);
        };
        for (n, what) in [
            (1, "one row"),
            (2, "two rows"),
            (300, "rows"),
            (70, "70 rows"),
        ] {
            let x = values([n, k], 32 + n as u64);
            let expected = bits(x.clone().matmul(w.clone().transpose()));
            for threads in [1, 2, 3, 4] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for block in [2000, 700, 300, 140] {
                    let y = pool.install(|| matmul_t_filled(&x, rows, block, fill));
                    if n == 1 && block < MIN_DOT_BLOCK {
                        // Blocks this narrow would take the small-product path.
                        assert!(y.is_none(), "{what}: blocks of {block} taken");
                        continue;
                    }
                    let y = y.unwrap_or_else(|| panic!("{what}: declined, block {block}"));
                    assert_eq!(y.dims(), [n, rows]);
                    assert!(
                        bits(y) == expected,
                        "{what}, {threads} threads, blocks of {block}: values differ"
                    );
                }
            }
        }
        // Blocks of gemm's small-matrix paths are declined: 2 x 64 (128 outputs), a row
        // times 200 columns.
        let x = values([2, k], 40);
        assert!(matmul_t_filled(&x, 64, 64, fill).is_none());
        assert!(matmul_t_filled(&values([1, k], 45), 200, 200, fill).is_none());
        // Strided one-row left side; empty products.
        let x = values([k, 2], 41).transpose().slice([0..1, 0..k]);
        assert!(matmul_t_filled(&x, rows, 100, fill).is_none());
        assert!(matmul_t_filled(&values([0, k], 42), rows, 100, fill).is_none());
        assert!(matmul_t_filled(&values([3, k], 43), 0, 100, fill).is_none());
        // A strided (sliced) left side with many rows keeps the values.
        let x = values([200, 2 * k], 44).slice([0..200, 7..7 + k]);
        let expected = bits(x.clone().matmul(w.clone().transpose()));
        let y = matmul_t_filled(&x, rows, 256, fill).unwrap();
        assert!(bits(y) == expected, "strided rows: values differ");
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
