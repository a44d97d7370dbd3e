//! The attention core every model shares: for each query, ONE joint softmax over
//! `[compressed entries ; raw tokens ; sink]`, computed over blocks of queries so that
//! memory grows with the keys a query can see, never as `T x T`:
//! - raw tokens are a band per block (sliding window / local tail: `block + window`
//!   keys; full causal attention: the keys up to the block's last query);
//! - compressed entries are the ones closed by the block's last query, or (CSA) a
//!   gather of the `k` entries each query's selector kept;
//! - the sink is one more logit per head.
//!
//! When the `hook_pattern` (or `hook_attn_scores`) of the layer is captured or
//! intervened on, the layer runs as ONE block over every query with the full key layout
//! of that hook point (`[entries (all n) ; raw tokens (all T) ; sink]`, invisible slots
//! 0): the pattern is `[T, n + T]` by definition. Both paths compute the same function (tests compare them).
//!
//! GQA without copies: query head `h` reads KV head `h / (n_heads / n_kv_heads)`, so the
//! queries are viewed as `[b, kv_heads, group * block, d_head]` against
//! `[b, kv_heads, d_head, keys]`.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use super::kv_state::Queries;
use super::layers::int_tensor;
use super::topk::selected_indices;
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::flops::Mm;
use crate::model::host;

/// Raw per-token keys and values over every position of the prompts.
pub struct Raw {
    /// `[b, total, kv_heads, d_head]`, rotated.
    pub k: Tensor<4>,
    /// `[b, total, kv_heads, d_head]`.
    pub v: Tensor<4>,
    /// Query `q` sees raw token `j` iff `q - window < j <= q`; `None`: every `j <= q`.
    pub window: Option<usize>,
    /// The position of index 0 of axis 1 of `k` and `v` (0: every position is there). A
    /// suffix forward with a window may pass only the positions its queries can see:
    /// from its first query's position less `window - 1` on. Only for the blocked path
    /// with a window: a dense block (a hooked pattern) reads every position.
    pub start: usize,
}

/// Compressed entries.
#[derive(Clone)]
pub struct Entries {
    /// `[b, n, kv_heads, d_head]`, rotated.
    pub k: Tensor<4>,
    /// `[b, n, kv_heads, d_head]`.
    pub v: Tensor<4>,
    /// Entry `i` becomes visible to the query at position `i * stride + close`
    /// (`+ offsets[h]` for KV head `h`).
    pub stride: usize,
    pub close: usize,
    /// Staggered windows: per KV head, where its windows start (the smallest 0); empty:
    /// every head at 0. Only without a selector.
    pub offsets: Vec<usize>,
}

impl Entries {
    /// Entries visible to a query at position `q` (for the head whose windows start at
    /// 0, which sees the most).
    fn visible_at(&self, q: usize) -> usize {
        let n = self.k.dims()[1];
        if q < self.close {
            0
        } else {
            ((q - self.close) / self.stride + 1).min(n)
        }
    }
}

/// Which closed entries each query keeps (DeepSeek-V4's lightning indexer).
pub trait EntrySelector {
    /// The most entries a query keeps (the blocked path gathers `k`; a selection
    /// changed through a hook runs as one dense block, where any number may be kept).
    fn k(&self) -> usize;
    /// Score elements the selector builds per (query, candidate entry) (the indexer: one
    /// per index head), for sizing blocks.
    fn cost_per_entry(&self) -> usize;
    /// For the queries at indices `i0..i1` of every row (positions
    /// `queries.first(r) + i`): `[b, i1 - i0, n_vis]`, true for the kept entries
    /// (only closed ones) among entries `0..n_vis`.
    /// `hooks` is the forward's hook run (e.g. for the selector's own hook points).
    fn select(
        &mut self,
        i0: usize,
        i1: usize,
        n_vis: usize,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3, Bool>>;
}

/// What one layer's queries attend to.
pub struct Keys<'s> {
    pub entries: Option<Entries>,
    /// With a selector, each query reads only its selected entries.
    pub selector: Option<&'s mut dyn EntrySelector>,
    pub raw: Option<Raw>,
    /// Per-head sink logits `[n_heads]`.
    pub sink: Option<Tensor<1>>,
}

/// The widest sliding window read as a band of keys gathered per query (shared
/// positions); a wider one (Gemma 3's 512) reads the block's contiguous band of
/// `block + window - 1` keys instead: gathering `window x d_head` values for every query
/// cost more than the extra scores (Gemma 3 270M at 2K tokens: 4.7x transformers' time).
pub const GATHERED_BAND_MAX: usize = 128;

/// Score tensor elements per block (`b * heads * block * keys`): 4 MiB of f32 (smaller
/// blocks measured faster here, and the softmax intermediates scale with it).
pub const BLOCK_BUDGET: usize = 1 << 20;

thread_local! {
    static BUDGET: std::cell::Cell<usize> = const { std::cell::Cell::new(BLOCK_BUDGET) };
    static LARGEST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// This thread's per-block budget (score elements): [`BLOCK_BUDGET`] unless
/// [`with_block_budget`] set another.
pub fn block_budget() -> usize {
    BUDGET.with(|b| b.get())
}

/// Run `f` with another per-block budget (score elements) on this thread: tests use a
/// tiny budget to force many blocks, benches a larger one.
pub fn with_block_budget<T>(budget: usize, f: impl FnOnce() -> T) -> T {
    let old = BUDGET.with(|b| b.replace(budget.max(1)));
    let out = f();
    BUDGET.with(|b| b.set(old));
    out
}

/// Query rows per block of `lq` queries: `lq` halved until `cost(rows)` (score
/// elements of a block of `rows` queries) fits this thread's budget ([`BLOCK_BUDGET`]);
/// at least 1. The blocked attention sizes its blocks so; `phaselens plan` repeats it.
pub fn rows_within_budget(lq: usize, cost: impl Fn(usize) -> usize) -> usize {
    let budget = BUDGET.with(|b| b.get());
    let mut bq = lq.max(1);
    while bq > 1 && cost(bq) > budget {
        bq = bq.div_ceil(2);
    }
    bq
}

/// The largest score tensor (elements) the blocked path built on this thread since the
/// last call; resets it. The dense path (a hooked `hook_pattern`) is not counted.
pub fn take_largest_block() -> usize {
    LARGEST.with(|l| l.replace(0))
}

/// `x: [b, total, a, c]` at the positions `pos` of every row -> `[b, pos.len(), a, c]`,
/// as `x.select(1, pos)`, but as one select of whole rows of a `[b * total, a * c]` view:
/// its backward (a scatter-add) then copies rows instead of locating every element. On
/// flex the rows are copied over every core ([`host::positions`]).
pub fn select_positions(x: Tensor<4>, pos: &[usize]) -> Tensor<4> {
    if let Some(y) = host::positions(&x, pos, pos.len()) {
        return y;
    }
    let [b, total, a, c] = x.dims();
    let idx: Vec<usize> = (0..b)
        .flat_map(|r| pos.iter().map(move |&p| r * total + p))
        .collect();
    let idx = int_tensor(&idx, &x.device());
    x.reshape([b * total, a * c])
        .select(0, idx)
        .reshape([b, pos.len(), a, c])
}

/// Whether [`attend`] builds the dense layout of every query over every key (for
/// `hook_pattern` / `hook_attn_scores` of the layer whose pattern point is `pattern`, or
/// `force_dense`): then its [`Raw`] keys must hold every position (`start` 0).
pub fn reads_every_key(pattern: HookPoint, force_dense: bool, hooks: &HookRun) -> bool {
    force_dense || pattern_hooked(pattern, hooks)
}

/// Whether `hooks` touch the pattern point or its scores point.
fn pattern_hooked(pattern: HookPoint, hooks: &HookRun) -> bool {
    hooks.touches(&pattern) || hooks.touches(&scores_point(pattern))
}

/// `q: [b, lq, n_heads, d_head]` (rotated) at the positions `queries` names -> `z: [b, lq,
/// n_heads, d_head]`. `pattern` is the layer's `hook_pattern` point; the layer runs as
/// one dense block when that point is hooked or `force_dense` (another hook of the layer
/// needs every query over every key, e.g. the indexer's scores).
pub fn attend(
    q: Tensor<4>,
    queries: &Queries,
    mut keys: Keys,
    scale: f64,
    pattern: HookPoint,
    force_dense: bool,
    hooks: &mut HookRun,
) -> Result<Tensor<4>> {
    let _stage = super::profile::region(super::profile::Region::Attention);
    let [b, _, nh, dh] = q.dims();
    let kvh = keys
        .raw
        .as_ref()
        .map(|r| r.k.dims()[2])
        .or(keys.entries.as_ref().map(|e| e.k.dims()[2]))
        .unwrap_or(1);
    let g = Geometry {
        b,
        nh,
        kvh,
        dh,
        scale,
        queries,
        device: q.device(),
    };
    if force_dense {
        return g.dense(q, &mut keys, pattern, hooks);
    }
    if pattern_hooked(pattern, hooks) {
        let intervened = hooks.spec().interventions().iter().any(|i| {
            i.target.matches_point(&pattern) || i.target.matches_point(&scores_point(pattern))
        });
        if force_dense || intervened || keys.selector.is_some() {
            return g.dense(q, &mut keys, pattern, hooks);
        }
        // Captured only: the pattern in the dense layout for the capture, the output
        // through the blocked path below, so that capturing leaves every number as in a
        // forward without hooks.
        g.capture_pattern(&q, &mut keys, pattern, hooks)?;
    }
    Ok(super::layers::cat_dim1(g.blocked(&q, &mut keys, hooks)?))
}

/// The environment variable that caps how many query blocks of one attention call run
/// at once (`1`: one after another).
pub const BLOCKS_AT_ONCE_ENV: &str = "PHASELENS_BLOCKS_AT_ONCE";

/// Bytes of score scratch of one attention block of [`BLOCK_BUDGET`] score elements
/// (scores, exponentials, probabilities: f32).
pub fn block_scratch_bytes() -> f64 {
    scratch_bytes(BLOCK_BUDGET)
}

/// Bytes of score scratch of an attention block of `scores` score elements: the scores,
/// their exponentials and the probabilities, f32.
pub fn scratch_bytes(scores: usize) -> f64 {
    3.0 * 4.0 * scores as f64
}

/// The largest block (bytes: scores three times over and the keys and values it
/// reads) that runs beside others: twice one block's score scratch. A block that reads
/// wide gathered keys (DeepSeek-V4's 512-wide heads, a query's selected entries) runs
/// alone, so that blocks at once add at most this much per thread.
pub fn concurrent_block_bytes() -> f64 {
    2.0 * block_scratch_bytes()
}

/// How many of a layer's `blocks` query blocks of about `block_bytes` each run at once
/// on `device`: [`concurrent_width`] on the flex (CPU) backend, whose elementwise passes
/// (masks, softmax, gathers) run on the calling thread; one on other backends (their
/// kernels already fill the device), under autodiff (the graph records in order) and
/// while stages are profiled (each stage is timed on the calling thread). The blocks
/// are the same at any width (their size depends on the budget alone), so the output
/// does not depend on the threads.
pub fn blocks_at_once(device: &Device, blocks: usize, block_bytes: f64) -> usize {
    if blocks <= 1 || !super::host::is_flex(device) || super::profile::enabled() {
        return 1;
    }
    concurrent_width(blocks, block_bytes)
}

/// Blocks at once on a backend that splits them: the rayon pool's threads (capped by
/// [`BLOCKS_AT_ONCE_ENV`]) and no more than `blocks`, when a block holds at most
/// [`concurrent_block_bytes`]; else 1. The memory plan counts the blocks so.
pub fn concurrent_width(blocks: usize, block_bytes: f64) -> usize {
    if block_bytes > concurrent_block_bytes() {
        return 1;
    }
    let mut w = rayon::current_num_threads();
    if let Some(cap) = std::env::var(BLOCKS_AT_ONCE_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        w = w.min(cap.max(1));
    }
    w.min(blocks).max(1)
}

/// What an entry selector chose for one block of queries ([`Geometry::selection`]).
enum Choice {
    /// No selector: the block reads every closed entry.
    NoSelector,
    /// The block's queries see no entry yet (the selector was not asked).
    NoEntries,
    /// `[b, bq, n]`, true for the kept entries among the `n` the block may see; each
    /// query keeps at most `k`.
    Kept {
        mask: Box<Tensor<3, Bool>>,
        k: usize,
    },
}

/// The parts of [`Keys`] a block reads once the selector has chosen: shared by the
/// blocks that run at once.
struct KeyParts<'k> {
    entries: Option<&'k Entries>,
    raw: Option<&'k Raw>,
    sink: Option<&'k Tensor<1>>,
}

impl<'k> KeyParts<'k> {
    fn of(keys: &'k Keys<'_>) -> Self {
        KeyParts {
            entries: keys.entries.as_ref(),
            raw: keys.raw.as_ref(),
            sink: keys.sink.as_ref(),
        }
    }
}

/// The queries a block's parts are built for: indices `i0..i1` of the computed
/// positions, as one block of the blocked path, or (`dense`) as the one block of every
/// query over the full key layout of the hook points.
#[derive(Debug, Clone, Copy)]
struct QueryBlock {
    i0: usize,
    i1: usize,
    dense: bool,
}

impl QueryBlock {
    /// Queries `i0..i1` of the blocked path.
    fn blocked(i0: usize, i1: usize) -> Self {
        QueryBlock {
            i0,
            i1,
            dense: false,
        }
    }

    /// Every one of `lq` queries, over the full key layout.
    fn dense(lq: usize) -> Self {
        QueryBlock {
            i0: 0,
            i1: lq,
            dense: true,
        }
    }
}

/// The position of key slot 0 of batch row `r` in a raw part (slot `j` is at that
/// position plus `j`).
type KeyBase<'a> = Box<dyn Fn(usize) -> i64 + 'a>;

struct Geometry<'q> {
    b: usize,
    nh: usize,
    kvh: usize,
    dh: usize,
    scale: f64,
    queries: &'q Queries,
    device: Device,
}

/// One group of key slots of a block: scores `[b, nh, bq, n]`, visibility, and how to
/// turn probabilities into output.
struct Part {
    scores: Tensor<4>,
    /// Visibility as an additive constant `[1 or b, 1 or nh, bq, n]`: 0 where visible,
    /// [`HIDDEN`] where not (the same for every head unless windows are staggered).
    bias: Tensor<4>,
    values: PartValues,
    /// Every query of every row and head sees at least one slot of this part (known on
    /// the host): then no row of the joint softmax is empty.
    sees_slot: bool,
}

/// The additive mask value of an invisible slot: `score + HIDDEN == HIDDEN` exactly for
/// any finite attention score, so its probability is exactly 0 (as with a mask fill).
const HIDDEN: f32 = -1.0e30;

/// The slots each query sees, as one range per query row of a `[rows, heads, bq, n]`
/// layout (row-major; `heads` is 1 unless visibility differs per head):
/// `seen(r, h, i)` gives slots `lo..hi` (any integers: clipped to `0..n`).
struct Visible {
    shape: [usize; 4],
    ranges: Vec<(usize, usize)>,
}

impl Visible {
    fn new(shape: [usize; 4], seen: impl Fn(usize, usize, usize) -> (i64, i64)) -> Self {
        let [rows, heads, bq, n] = shape;
        let clip = |x: i64| x.clamp(0, n as i64) as usize;
        let mut ranges = Vec::with_capacity(rows * heads * bq);
        for r in 0..rows {
            for h in 0..heads {
                for i in 0..bq {
                    let (lo, hi) = seen(r, h, i);
                    ranges.push((clip(lo), clip(hi).max(clip(lo))));
                }
            }
        }
        Visible { shape, ranges }
    }

    /// Whether every query sees at least one slot.
    fn every_query_sees_one(&self) -> bool {
        self.ranges.iter().all(|&(lo, hi)| hi > lo)
    }

    /// Every slot, row-major: `seen` where visible, `hidden` where not.
    fn filled<T: Copy>(&self, hidden: T, seen: T) -> Vec<T> {
        let n = self.shape[3];
        let mut v = vec![hidden; self.ranges.len() * n];
        for (row, &(lo, hi)) in v.chunks_exact_mut(n.max(1)).zip(&self.ranges) {
            row[lo..hi].fill(seen);
        }
        v
    }

    /// The additive mask: 0 where visible, [`HIDDEN`] where not.
    fn bias(&self, device: &Device) -> Tensor<4> {
        Tensor::from_data(
            TensorData::new(self.filled(HIDDEN, 0.0), self.shape),
            device,
        )
    }

    /// Visibility as booleans, row-major.
    fn bools(&self) -> Vec<bool> {
        self.filled(false, true)
    }

    /// A part over these slots.
    fn part(&self, scores: Tensor<4>, values: PartValues, device: &Device) -> Part {
        Part {
            scores,
            bias: self.bias(device),
            values,
            sees_slot: self.every_query_sees_one(),
        }
    }
}

/// `[b, bq, n]` visibility computed on the device -> `[b, 1, bq, n]` additive mask.
fn bias_from_mask(m: Tensor<3, Bool>) -> Tensor<4> {
    let [b, bq, n] = m.dims();
    m.bool_not()
        .float()
        .mul_scalar(HIDDEN)
        .reshape([b, 1, bq, n])
}

enum PartValues {
    /// `[b, n, kvh, dh]`, the same keys for every query of the block.
    Shared(Tensor<4>),
    /// `[b, bq, n, kvh, dh]`, per-query keys (gathered entries).
    PerQuery(Tensor<5>),
    /// The sink: no value.
    Sink,
}

impl Geometry<'_> {
    fn group(&self) -> usize {
        self.nh / self.kvh
    }

    /// Query rows per block so that one block's scores stay within [`BLOCK_BUDGET`],
    /// and the bytes such a block holds: its scores three times over (scores,
    /// exponentials, probabilities) and the keys and values it reads (gathered per query
    /// or sliced per block).
    fn block_size(&self, keys: &Keys) -> (usize, f64) {
        let lq = self.queries.len();
        let total = self.queries.total();
        let n = keys.entries.as_ref().map_or(0, |e| e.k.dims()[1]);
        // Attention score columns per query head, and the selector's scores per query.
        let (entries, selecting) = match &keys.selector {
            Some(s) if n > 0 => (s.k(), s.cost_per_entry() * n),
            _ => (n, 0),
        };
        let shared = self.queries.shared();
        // Shared positions, a narrow window: each query's own `w` keys, gathered.
        let per_query_band = match &keys.raw {
            Some(Raw {
                window: Some(w), ..
            }) if shared && *w <= GATHERED_BAND_MAX => Some((*w).min(total)),
            _ => None,
        };
        let raw = |bq: usize| match (&keys.raw, per_query_band) {
            (_, Some(w)) => w,
            (
                Some(Raw {
                    window: Some(w), ..
                }),
                None,
            ) => (bq + w).min(total),
            (Some(_), None) => total,
            (None, _) => 0,
        };
        let scores = |bq: usize| self.b * bq * (self.nh * (entries + raw(bq) + 1) + selecting);
        let bq = rows_within_budget(lq, scores);
        // Keys and values read: per query where gathered per query, else per block.
        let raw_keys = per_query_band.map_or(raw(bq), |w| bq * w);
        let entry_keys = if selecting > 0 { bq * entries } else { entries };
        let read = self.b * 2 * self.kvh * self.dh * (raw_keys + entry_keys);
        (bq, 4.0 * (3 * scores(bq) + read) as f64)
    }

    /// Every query in blocks (`q: [b, lq, nh, dh]`) -> each block's output, in order.
    /// Up to [`blocks_at_once`] blocks run at once: the selector chooses for a group of
    /// blocks, block after block on this thread (it may run hooks), then the group's
    /// blocks are computed, each on its own thread where the group has several.
    fn blocked(
        &self,
        q: &Tensor<4>,
        keys: &mut Keys,
        hooks: &mut HookRun,
    ) -> Result<Vec<Tensor<4>>> {
        let lq = self.queries.len();
        let (block, block_bytes) = self.block_size(keys);
        let blocks: Vec<QueryBlock> = (0..lq)
            .step_by(block)
            .map(|i0| QueryBlock::blocked(i0, (i0 + block).min(lq)))
            .collect();
        let width = blocks_at_once(&self.device, blocks.len(), block_bytes);
        let mut parts = Vec::with_capacity(blocks.len());
        for group in blocks.chunks(width) {
            let kept = group
                .iter()
                .map(|&b| self.selection(keys, b, hooks))
                .collect::<Result<Vec<_>>>()?;
            let view = KeyParts::of(keys);
            let one = |(b, kept): (&QueryBlock, Choice)| {
                self.block(q.clone().slice_dim(1, b.i0..b.i1), *b, &view, kept)
            };
            let done: Vec<(Tensor<4>, usize)> = if group.len() == 1 {
                group.iter().zip(kept).map(one).collect()
            } else {
                use rayon::prelude::*;
                let dtype = super::precision::compute();
                group
                    .par_iter()
                    .zip(kept.into_par_iter())
                    .map(|x| {
                        let _dtype = super::precision::scoped(dtype);
                        one(x)
                    })
                    .collect()
            };
            for (z, elements) in done {
                LARGEST.with(|l| l.set(l.get().max(elements)));
                parts.push(z);
            }
        }
        Ok(parts)
    }

    /// Rows whose query positions differ: 1 when every row computes the same positions.
    fn mask_rows(&self) -> usize {
        if self.queries.shared() { 1 } else { self.b }
    }

    /// Position of query `i` (an index into the computed positions) of row `r`.
    fn qpos(&self, r: usize, i: usize) -> usize {
        self.queries.first(r) + i
    }

    /// `[b, n, kvh, dh]` keys shared by the block's queries -> scores `[b, nh, bq, n]`.
    fn shared_scores(&self, q: &Tensor<4>, k: Tensor<4>) -> Tensor<4> {
        let [b, bq, _, _] = q.dims();
        let n = k.dims()[1];
        let (kvh, g, dh) = (self.kvh, self.group(), self.dh);
        let qh = q.clone().swap_dims(1, 2).reshape([b, kvh, g * bq, dh]);
        let kt = k.swap_dims(1, 2).swap_dims(2, 3); // [b, kvh, dh, n]
        qh.mm(kt).reshape([b, self.nh, bq, n]) * self.scale
    }

    /// `[b, bq, n, kvh, dh]` per-query keys -> scores `[b, nh, bq, n]`.
    fn per_query_scores(&self, q: &Tensor<4>, k: Tensor<5>) -> Tensor<4> {
        let [b, bq, n, kvh, dh] = k.dims();
        let g = self.group();
        let qh = q.clone().reshape([b * bq, kvh, g, dh]);
        let kt = k
            .reshape([b * bq, n, kvh, dh])
            .swap_dims(1, 2)
            .swap_dims(2, 3); // [b*bq, kvh, dh, n]
        // Scaled while contiguous (in place), then viewed per head: the same values as
        // scaling the view, without a strided pass.
        (qh.mm(kt) * self.scale)
            .reshape([b, bq, self.nh, n])
            .swap_dims(1, 2)
    }

    /// Probabilities `p: [b, nh, bq, n]` times the part's values -> `[b, bq, nh, dh]`.
    fn read(&self, p: Tensor<4>, values: PartValues) -> Option<Tensor<4>> {
        let [b, _, bq, n] = p.dims();
        let (kvh, g, dh) = (self.kvh, self.group(), self.dh);
        match values {
            PartValues::Sink => None,
            PartValues::Shared(v) => Some(
                p.reshape([b, kvh, g * bq, n])
                    .mm(v.swap_dims(1, 2)) // [b, kvh, n, dh]
                    .reshape([b, self.nh, bq, dh])
                    .swap_dims(1, 2),
            ),
            PartValues::PerQuery(v) => Some(
                host::contiguous(p.swap_dims(1, 2))
                    .reshape([b * bq, kvh, g, n])
                    .mm(v.reshape([b * bq, n, kvh, dh]).swap_dims(1, 2))
                    .reshape([b, bq, self.nh, dh]),
            ),
        }
    }

    /// The sink column (always visible).
    fn sink(&self, sink: &Tensor<1>, bq: usize) -> Part {
        let (b, nh) = (self.b, self.nh);
        let scores = sink.clone().reshape([1, nh, 1, 1]).expand([b, nh, bq, 1]);
        Part {
            scores,
            bias: Tensor::zeros([1, 1, bq, 1], &self.device),
            values: PartValues::Sink,
            sees_slot: true,
        }
    }

    /// Raw keys for the block's queries `i0..i1`: with shared positions and a window,
    /// each query's own `window` keys (gathered, [`Geometry::raw_band`]); otherwise keys
    /// `lo..hi` (shared positions or dense: a slice) or a band per row (`len` keys from
    /// each row's own start, gathered). Visibility: `q - window < j <= q`, `j >= 0`.
    fn raw(&self, q: &Tensor<4>, raw: &Raw, block: QueryBlock) -> Part {
        let QueryBlock { i0, i1, dense } = block;
        if let (Some(w), false, true) = (raw.window, dense, self.queries.shared())
            && w <= GATHERED_BAND_MAX
        {
            return self.raw_band(q, raw, w, i0, i1);
        }
        let device = q.device();
        let total = self.queries.total();
        let bq = i1 - i0;
        let rows = self.mask_rows();
        // Key position of slot 0 of row `r`.
        let (k, v, n, base): (_, _, usize, KeyBase<'_>) =
            if dense || raw.window.is_none() || self.queries.shared() {
                let last = (0..self.b).map(|r| self.qpos(r, i1 - 1)).max().unwrap_or(0);
                let hi = if dense { total } else { last + 1 };
                // Shared positions and a wide window: the contiguous band of keys the
                // block's queries can see.
                let lo = match raw.window {
                    Some(w) if !dense => self.qpos(0, i0).saturating_sub(w - 1),
                    _ => 0,
                };
                assert!(
                    lo >= raw.start,
                    "raw keys from {} read from {lo}",
                    raw.start
                );
                (
                    raw.k.clone().slice_dim(1, lo - raw.start..hi - raw.start),
                    raw.v.clone().slice_dim(1, lo - raw.start..hi - raw.start),
                    hi - lo,
                    Box::new(move |_| lo as i64),
                )
            } else {
                // Rows at different positions, banded keys: gather each row's own band.
                let Some(w) = raw.window else {
                    unreachable!("the first branch takes every unbanded case")
                };
                let len = bq + w - 1;
                let start = move |r: usize| self.qpos(r, i0) as i64 - (w as i64 - 1);
                // Positions before `raw.start` (or 0) are invisible: any slot serves.
                let [_, held, kvh, dh] = raw.k.dims();
                let first = raw.start as i64;
                let idx: Vec<usize> = (0..self.b)
                    .flat_map(|r| {
                        (0..len as i64).map(move |j| {
                            r * held + (start(r) + j - first).clamp(0, held as i64 - 1) as usize
                        })
                    })
                    .collect();
                let idx = int_tensor(&idx, &device);
                let gather = |x: &Tensor<4>| {
                    x.clone()
                        .reshape([self.b * held, kvh * dh])
                        .select(0, idx.clone())
                        .reshape([self.b, len, kvh, dh])
                };
                (gather(&raw.k), gather(&raw.v), len, Box::new(start))
            };
        // Query `i` of row `r` at position `qp` sees the keys at `max(0, qp - window +
        // 1) ..= qp`.
        let visible = Visible::new([rows, 1, bq, n], |r, _, i| {
            let qp = self.qpos(r, i0 + i) as i64;
            let first = raw.window.map_or(0, |w| qp - w as i64 + 1).max(0);
            (first - base(r), qp + 1 - base(r))
        });
        visible.part(self.shared_scores(q, k), PartValues::Shared(v), &device)
    }

    /// Shared positions, window `w`: query `i` reads the keys at positions `p - w + 1
    /// ..= p` (`p` its position; those before 0 invisible), gathered per query, so that
    /// a block scores `w` raw keys per query instead of a band of `bq + w - 1`.
    fn raw_band(&self, q: &Tensor<4>, raw: &Raw, w: usize, i0: usize, i1: usize) -> Part {
        let device = q.device();
        let bq = i1 - i0;
        let [b, held, kvh, dh] = raw.k.dims();
        let first = raw.start as i64;
        let mut idx = Vec::with_capacity(bq * w);
        for i in i0..i1 {
            let p = self.qpos(0, i) as i64;
            for j in 0..w as i64 {
                let kp = p - (w as i64 - 1) + j;
                idx.push((kp - first).clamp(0, held as i64 - 1) as usize);
            }
        }
        // Slot `j` of query `i` is at `p - w + 1 + j`: visible from position 0 on.
        let visible = Visible::new([1, 1, bq, w], |_, _, i| {
            let p = self.qpos(0, i0 + i) as i64;
            (w as i64 - 1 - p, w as i64)
        });
        let gather = |x: &Tensor<4>| select_positions(x.clone(), &idx).reshape([b, bq, w, kvh, dh]);
        visible.part(
            self.per_query_scores(q, gather(&raw.k)),
            PartValues::PerQuery(gather(&raw.v)),
            &device,
        )
    }

    /// Entries for the block's queries `i0..i1`: those closed by the last query (all `n`
    /// when dense), masked by closedness, and by the selector's choice when there is one
    /// (dense: as a mask; blocked: the `k` kept entries of each query, gathered).
    fn entries(
        &self,
        q: &Tensor<4>,
        e: &Entries,
        selected: Choice,
        block: QueryBlock,
    ) -> Option<Part> {
        let QueryBlock { i0, i1, .. } = block;
        let device = q.device();
        let n = self.entries_seen(e, block);
        if n == 0 {
            return None;
        }
        let bq = i1 - i0;
        let rows = self.mask_rows();
        // Closedness `[rows, heads, bq, n]`: per query head with staggered windows (head
        // `h` reads KV head `h / group`, whose windows start `offsets[h / group]` later),
        // else one for every head.
        let (heads, g) = if e.offsets.is_empty() {
            (1, 1)
        } else {
            (self.nh, self.group())
        };
        // Entry `c` is closed for a query at `qp` when `c * stride + shift <= qp`.
        let closed = Visible::new([rows, heads, bq, n], |r, h, i| {
            let shift = (e.close + e.offsets.get(h / g).copied().unwrap_or(0)) as i64;
            let qp = self.qpos(r, i0 + i) as i64;
            let count = if qp < shift {
                0
            } else {
                (qp - shift) / e.stride as i64 + 1
            };
            (0, count)
        });
        let k = e.k.clone().slice_dim(1, 0..n);
        let v = e.v.clone().slice_dim(1, 0..n);
        let (kept, kk) = match selected {
            Choice::Kept { mask, k } => (*mask, k.min(n)),
            Choice::NoSelector | Choice::NoEntries => {
                return Some(closed.part(self.shared_scores(q, k), PartValues::Shared(v), &device));
            }
        };
        let closed =
            Tensor::<1, Bool>::from_data(TensorData::new(closed.bools(), [rows * bq * n]), &device)
                .reshape([rows, bq, n])
                .expand([self.b, bq, n]);
        let kept = kept.bool_and(closed);
        if block.dense {
            return Some(Part {
                scores: self.shared_scores(q, k),
                bias: bias_from_mask(kept),
                values: PartValues::Shared(v),
                sees_slot: false,
            });
        }
        let (idx, valid) = selected_indices(kept, kk);
        let (kg, vg) = self.gathered_entries(idx, k, v);
        Some(Part {
            scores: self.per_query_scores(q, kg),
            bias: bias_from_mask(valid),
            values: PartValues::PerQuery(vg),
            sees_slot: false,
        })
    }

    /// Each query's kept entries of `k` and `v` (`[b, n, kvh, dh]`; `idx: [b, bq, kk]`,
    /// indices into `n`) -> `[b, bq, kk, kvh, dh]` each: on flex copied over every core
    /// ([`host::positions`]), else gathered with `select` from a `[b * n, kvh * dh]` view.
    fn gathered_entries(
        &self,
        idx: Tensor<3, Int>,
        k: Tensor<4>,
        v: Tensor<4>,
    ) -> (Tensor<5>, Tensor<5>) {
        let [b, bq, kk] = idx.dims();
        let [_, n, kvh, dh] = k.dims();
        let on_host = || {
            if !host::reachable(&k) || !host::reachable(&v) {
                return None;
            }
            let pos: Vec<usize> = idx
                .clone()
                .into_data()
                .convert::<i64>()
                .try_into_vec::<i64>()
                .ok()?
                .into_iter()
                .map(|i| usize::try_from(i).ok())
                .collect::<Option<_>>()?;
            let gather = |x: &Tensor<4>| {
                Some(host::positions(x, &pos, bq * kk)?.reshape([b, bq, kk, kvh, dh]))
            };
            Some((gather(&k)?, gather(&v)?))
        };
        if let Some(kv) = on_host() {
            return kv;
        }
        let rows = Tensor::<1, Int>::arange(0..b as i64, &idx.device())
            .mul_scalar(n as i64)
            .reshape([b, 1, 1])
            .expand([b, bq, kk]);
        let flat = (idx + rows).reshape([b * bq * kk]);
        let gather = |x: Tensor<4>| {
            x.reshape([b * n, kvh * dh])
                .select(0, flat.clone())
                .reshape([b, bq, kk, kvh, dh])
        };
        (gather(k), gather(v))
    }

    /// Entries the block's queries may see: those closed by its last query (all `n`
    /// when dense).
    fn entries_seen(&self, e: &Entries, block: QueryBlock) -> usize {
        if block.dense {
            return e.k.dims()[1];
        }
        let last = (0..self.b)
            .map(|r| self.qpos(r, block.i1 - 1))
            .max()
            .unwrap_or(0);
        e.visible_at(last)
    }

    /// The selector's choice for the block's queries. Runs on the calling thread, in
    /// block order: the selector may run hooks.
    fn selection(&self, keys: &mut Keys, block: QueryBlock, hooks: &mut HookRun) -> Result<Choice> {
        let (Some(e), Some(sel)) = (&keys.entries, keys.selector.as_mut()) else {
            return Ok(Choice::NoSelector);
        };
        let n = self.entries_seen(e, block);
        if n == 0 {
            return Ok(Choice::NoEntries);
        }
        if !e.offsets.is_empty() {
            return Err(Error::Other(
                "staggered compression windows with an entry selector are not supported".into(),
            ));
        }
        Ok(Choice::Kept {
            mask: Box::new(sel.select(block.i0, block.i1, n, hooks)?),
            k: sel.k(),
        })
    }

    /// One block of queries (`q: [b, bq, nh, dh]`) with the selector's choice for it
    /// ([`Geometry::selection`]) -> `[b, bq, nh, dh]` and its score elements.
    fn block(
        &self,
        q: Tensor<4>,
        block: QueryBlock,
        keys: &KeyParts,
        selected: Choice,
    ) -> (Tensor<4>, usize) {
        let parts = self.parts_of(&q, block, keys, selected);
        let elements: usize = parts.iter().map(|p| p.scores.shape().num_elements()).sum();
        let (p, values) = softmax_parts(parts);
        (self.combine(p, values, block.i1 - block.i0), elements)
    }

    /// The block's key parts, in slot order: entries, raw tokens, sink.
    fn parts(
        &self,
        q: &Tensor<4>,
        block: QueryBlock,
        keys: &mut Keys,
        hooks: &mut HookRun,
    ) -> Result<Vec<Part>> {
        let selected = self.selection(keys, block, hooks)?;
        Ok(self.parts_of(q, block, &KeyParts::of(keys), selected))
    }

    /// [`Geometry::parts`] once the selector has chosen.
    fn parts_of(
        &self,
        q: &Tensor<4>,
        block: QueryBlock,
        keys: &KeyParts,
        selected: Choice,
    ) -> Vec<Part> {
        let mut parts = Vec::with_capacity(3);
        if let Some(e) = keys.entries
            && let Some(p) = self.entries(q, e, selected, block)
        {
            parts.push(p);
        }
        if let Some(raw) = keys.raw {
            parts.push(self.raw(q, raw, block));
        }
        if let Some(s) = keys.sink {
            parts.push(self.sink(s, block.i1 - block.i0));
        }
        parts
    }

    /// Per-part probabilities -> `[b, bq, nh, dh]`.
    fn combine(&self, p: Vec<Tensor<4>>, values: Vec<PartValues>, bq: usize) -> Tensor<4> {
        let mut z: Option<Tensor<4>> = None;
        for (pi, vi) in p.into_iter().zip(values) {
            if let Some(r) = self.read(pi, vi) {
                z = Some(match z {
                    Some(acc) => acc + r,
                    None => r,
                });
            }
        }
        z.unwrap_or_else(|| Tensor::zeros([self.b, bq, self.nh, self.dh], &self.device))
    }

    /// The dense pattern `[b, nh, lq, n + T (+ 1)]` of every query, through the pattern
    /// hook (a capture: its result is not used).
    fn capture_pattern(
        &self,
        q: &Tensor<4>,
        keys: &mut Keys,
        pattern: HookPoint,
        hooks: &mut HookRun,
    ) -> Result<()> {
        let lq = self.queries.len();
        let parts = self.parts(q, QueryBlock::dense(lq), keys, hooks)?;
        let scores = scores_point(pattern);
        if hooks.touches(&scores) && !parts.is_empty() {
            // Captured only: the logits every slot shows (invisible ones at -1e30).
            let all = Tensor::cat(
                parts
                    .iter()
                    .map(|p| p.scores.clone() + p.bias.clone())
                    .collect(),
                3,
            );
            hooks.apply(scores, all)?;
        }
        let (p, _) = softmax_parts(parts);
        let p = if p.is_empty() {
            Tensor::<4>::zeros([self.b, self.nh, lq, 0], &self.device)
        } else {
            Tensor::cat(p, 3)
        };
        hooks.apply(pattern, p)?;
        Ok(())
    }

    /// Every query in one block over the full key layout, through the pattern hook.
    fn dense(
        &self,
        q: Tensor<4>,
        keys: &mut Keys,
        pattern: HookPoint,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        let lq = self.queries.len();
        let mut parts = self.parts(&q, QueryBlock::dense(lq), keys, hooks)?;
        let widths: Vec<usize> = parts.iter().map(|p| p.scores.dims()[3]).collect();
        let scores = scores_point(pattern);
        if hooks.touches(&scores) && !parts.is_empty() {
            // The logits of every slot (invisible ones at -1e30, what the softmax sees)
            // through `hook_attn_scores`, split back per part; the mask still applies.
            let all = Tensor::cat(
                parts
                    .iter()
                    .map(|p| p.scores.clone() + p.bias.clone())
                    .collect(),
                3,
            );
            let all = hooks.apply(scores, all)?;
            let mut at = 0;
            for (part, w) in parts.iter_mut().zip(&widths) {
                part.scores = all.clone().slice_dim(3, at..at + w);
                at += w;
            }
        }
        let (p, values) = softmax_parts(parts);
        let p = if p.is_empty() {
            Tensor::<4>::zeros([self.b, self.nh, lq, 0], &self.device)
        } else {
            Tensor::cat(p, 3)
        };
        let p = hooks.apply(pattern, p)?;
        let mut split = Vec::with_capacity(widths.len());
        let mut at = 0;
        for w in widths {
            split.push(p.clone().slice_dim(3, at..at + w));
            at += w;
        }
        Ok(self.combine(split, values, lq))
    }
}

/// The logit `hook_attn_scores` shows at an invisible slot (as `masked_softmax` fills).
pub const MASKED: f32 = -1.0e30;

/// The layer's `hook_attn_scores` point, next to its `hook_pattern` point.
fn scores_point(pattern: HookPoint) -> HookPoint {
    HookPoint {
        site: Site::AttnScores,
        ..pattern
    }
}

/// One masked softmax over the concatenated parts; the probabilities split back per part.
fn softmax_parts(parts: Vec<Part>) -> (Vec<Tensor<4>>, Vec<PartValues>) {
    if parts.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let widths: Vec<usize> = parts.iter().map(|p| p.scores.dims()[3]).collect();
    // A sink is visible to every query, and so may be another part (known on the
    // host): then no row can be empty.
    let never_empty = parts.iter().any(|p| p.sees_slot);
    let rows = parts.iter().map(|p| p.bias.dims()[0]).max().unwrap_or(1);
    let heads = parts.iter().map(|p| p.bias.dims()[1]).max().unwrap_or(1);
    let mut scores = Vec::with_capacity(parts.len());
    let mut biases = Vec::with_capacity(parts.len());
    let mut values = Vec::with_capacity(parts.len());
    for p in parts {
        let [r, h, bq, n] = p.bias.dims();
        scores.push(p.scores);
        biases.push(if r == rows && h == heads {
            p.bias
        } else {
            p.bias.expand([rows, heads, bq, n])
        });
        values.push(p.values);
    }
    let cat = |mut v: Vec<Tensor<4>>| {
        if v.len() == 1 {
            v.pop().expect("one part")
        } else {
            host::cat(&v, 3).unwrap_or_else(|| Tensor::cat(v, 3))
        }
    };
    let p = biased_softmax(cat(scores), cat(biases), !never_empty);
    if widths.len() == 1 {
        return (vec![p], values);
    }
    let mut out = Vec::with_capacity(widths.len());
    let mut at = 0;
    for w in widths {
        out.push(p.clone().slice_dim(3, at..at + w));
        at += w;
    }
    (out, values)
}

/// Softmax over the last axis of `scores: [b, nh, bq, K]` plus the additive mask `bias:
/// [1 or b, 1 or nh, bq, K]` (0 visible, [`HIDDEN`] not). With `check_empty`, rows with nothing
/// visible give all zeros instead of a uniform row (without it the caller knows every
/// row sees a slot). The same numbers as a mask fill with [`HIDDEN`].
fn biased_softmax(scores: Tensor<4>, bias: Tensor<4>, check_empty: bool) -> Tensor<4> {
    if let Some(p) = biased_softmax_host(&scores, &bias, check_empty) {
        return p;
    }
    let masked = scores + bias.clone();
    let max = masked.clone().max_dim(3).detach();
    let mut e = (masked - max).exp();
    if check_empty {
        let seen = bias.max_dim(3).greater_elem(HIDDEN / 2.0).float();
        e = e * seen;
    }
    let denom = e.clone().sum_dim(3).clamp_min(1e-30);
    e / denom
}

/// [`biased_softmax`] on flex: one pass per row over every core into one new buffer (the
/// expression writes five: the sum, the difference, the powers, the mask product and the
/// quotient), with the vectorised [`host::exp`] (flex calls libm's `expf` per value) and
/// the maximum and sum taken in 16 lanes. Within float rounding of the expression (a few
/// ulp). `None` where [`host::reachable`] does not hold or the bias does not broadcast.
fn biased_softmax_host(
    scores: &Tensor<4>,
    bias: &Tensor<4>,
    check_empty: bool,
) -> Option<Tensor<4>> {
    let [b, h, q, k] = scores.dims();
    let [rb, hb, qb, kb] = bias.dims();
    if qb != q || kb != k || (rb != 1 && rb != b) || (hb != 1 && hb != h) {
        return None;
    }
    let values = host::with_values(scores, |s| {
        host::with_values(bias, |m| {
            host::new_rows(s.len() / k.max(1), k, |row, o| {
                let (bi, hi, qi) = (row / (h * q), row / q % h, row % q);
                let mrow =
                    ((if rb == 1 { 0 } else { bi }) * hb + if hb == 1 { 0 } else { hi }) * q + qi;
                let mask = &m[mrow * k..][..k];
                softmax_row(&s[row * k..][..k], mask, check_empty, o);
            })
        })
    })??;
    Some(host::tensor_from(values, [b, h, q, k], scores))
}

host::multiversion! {
/// One row of [`biased_softmax_host`] into `o`.
fn softmax_row(scores: &[f32], mask: &[f32], check_empty: bool, o: &mut [f32]) {
    let larger = |a: f32, e: f32| if e > a { e } else { a };
    let lane_max = |v: &[f32]| {
        let (acc, rest) = host::lanes(v, f32::NEG_INFINITY, larger);
        acc.iter().chain(rest).fold(f32::NEG_INFINITY, |a, &e| larger(a, e))
    };
    for ((o, &a), &c) in o.iter_mut().zip(scores).zip(mask) {
        *o = a + c;
    }
    let max = lane_max(o);
    for v in o.iter_mut() {
        *v = host::exp(*v - max);
    }
    if check_empty {
        let seen = if lane_max(mask) > HIDDEN / 2.0 {
            1.0
        } else {
            0.0
        };
        o.iter_mut().for_each(|v| *v *= seen);
    }
    let (acc, rest) = host::lanes(o, 0.0, |a, e| a + e);
    let sum = acc.iter().sum::<f32>() + rest.iter().sum::<f32>();
    // As `clamp_min`: a NaN sum stays NaN (`f32::max` would drop it).
    let denom = if sum < 1e-30 { 1e-30 } else { sum };
    o.iter_mut().for_each(|v| *v /= denom);
}
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    /// The softmax on flex against the tensor expression (run on the autodiff device, where
    /// the kernel declines): biases broadcast over batch rows and heads or not, a row
    /// with nothing visible (zeros with `check_empty`, uniform without), a NaN score
    /// (its row NaN), a strided score tensor.
    #[test]
    fn biased_softmax_on_flex_gives_the_tensor_expression() {
        let (dev, ad) = (Device::flex(), Device::flex().autodiff());
        let (b, h, q, k) = (2, 3, 5, 37);
        let scores = Tensor::<4>::random([b, h, q, k], Distribution::Normal(0.0, 4.0), &dev)
            .slice_assign(
                [1..2, 2..3, 4..5, 9..10],
                Tensor::full([1, 1, 1, 1], f32::NAN, &dev),
            );
        let strided =
            Tensor::<4>::random([b, q, h, k], Distribution::Normal(0.0, 4.0), &dev).swap_dims(1, 2);
        let bias = |rb, hb| {
            let v: Vec<f32> = (0..rb * hb * q * k)
                .map(|i| {
                    if (i * 7) % 5 == 0 || i / k == 3 {
                        HIDDEN
                    } else {
                        0.0
                    }
                })
                .collect();
            Tensor::<4>::from_data(TensorData::new(v, [rb, hb, q, k]), &dev)
        };
        for s in [&scores, &strided] {
            for m in [bias(1, 1), bias(b, 1), bias(1, h), bias(b, h)] {
                for check_empty in [true, false] {
                    let got = biased_softmax(s.clone(), m.clone(), check_empty);
                    let want = biased_softmax(
                        Tensor::from_data(s.to_data(), &ad),
                        Tensor::from_data(m.to_data(), &ad),
                        check_empty,
                    );
                    let got = got.into_data().try_into_vec::<f32>().unwrap();
                    let want = want.into_data().try_into_vec::<f32>().unwrap();
                    assert_eq!(got.len(), want.len());
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        let close = (g - e).abs() <= 1e-6 * e.abs() + 1e-12;
                        assert!(
                            close || (g.is_nan() && e.is_nan()),
                            "value {i} ({check_empty}): {g} against {e}"
                        );
                    }
                }
            }
        }
    }
}
