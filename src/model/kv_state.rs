//! Suffix forwards, in one place: an explicit per-token KV state, like a KV cache.
//!
//! A base forward over prompts of `T` tokens can record, per layer, the per-token tensors
//! that later positions' attention reads (keys, values, compressor gate logits, indexer
//! projections, ... : each model decides, by name). A later forward of the same prompts
//! that recomputes only some positions of each row (a *suffix*: row `r` computes
//! positions `from[r] .. from[r] + len`) reads every other position from that state.
//! When nothing upstream of the recomputed positions differs from the base run, that is
//! the same computation as a full forward, only cheaper: earlier positions are causally
//! unaffected. The batched patching runner uses it to recompute only the patched and read
//! positions of each prompt.
//!
//! Models see one small interface, [`TokenFlow`], in every kind of forward:
//! - [`TokenFlow::full`]: "here are this layer's new per-token values of `name` at the
//!   positions I compute; give me the tensor over every position" (plain forward: the
//!   input itself; recording: the input, also kept; suffix: the base run's values with
//!   the recomputed positions replaced);
//! - [`TokenFlow::previous`]: the values at each computed position's predecessor (a
//!   one-token shift, zeros before position 0);
//! - [`TokenFlow::queries`]: which positions this forward computes.
//!
//! So a model feature that reads per-token state needs no mode of its own: it passes its
//! tensor through `full` or `previous`, and recording and merging follow.

use std::collections::BTreeMap;

use burn::tensor::{Device, Int, Tensor};

use super::layers::int_tensor;
use super::placement::to;
use crate::error::{Error, Result};
use crate::hooks::Act;
use crate::hooks::cache::stack_maps;

/// Which positions of the prompts a forward computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Queries {
    /// A plain forward: every position `0..len` of each of `rows` prompts.
    All {
        /// Prompts.
        rows: usize,
        /// Tokens per prompt.
        len: usize,
    },
    /// A suffix forward: row `r` computes positions `from[r] .. from[r] + len` of prompts
    /// of `total` tokens.
    Rows {
        /// Each row's first computed position.
        from: Vec<usize>,
        /// Positions computed per row.
        len: usize,
        /// Tokens per prompt.
        total: usize,
    },
}

impl Queries {
    /// Batch rows.
    pub fn rows(&self) -> usize {
        match self {
            Queries::All { rows, .. } => *rows,
            Queries::Rows { from, .. } => from.len(),
        }
    }

    /// Computed positions per row.
    pub fn len(&self) -> usize {
        match self {
            Queries::All { len, .. } | Queries::Rows { len, .. } => *len,
        }
    }

    /// Whether no position is computed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens per prompt: keys live at positions `0..total`.
    pub fn total(&self) -> usize {
        match self {
            Queries::All { len, .. } => *len,
            Queries::Rows { total, .. } => *total,
        }
    }

    /// The first computed position of row `r`.
    pub fn first(&self, r: usize) -> usize {
        match self {
            Queries::All { .. } => 0,
            Queries::Rows { from, .. } => from[r],
        }
    }

    /// Whether every row computes the same positions.
    pub fn shared(&self) -> bool {
        match self {
            Queries::All { .. } => true,
            Queries::Rows { from, .. } => from.windows(2).all(|w| w[0] == w[1]),
        }
    }

    /// The computed positions: `[len]` when [`shared`](Self::shared), else row-major
    /// `[rows * len]` (the two layouts RoPE tables accept).
    pub fn positions(&self) -> Vec<usize> {
        let len = self.len();
        if self.shared() {
            let f = if self.rows() > 0 { self.first(0) } else { 0 };
            (f..f + len).collect()
        } else {
            (0..self.rows())
                .flat_map(|r| {
                    let f = self.first(r);
                    f..f + len
                })
                .collect()
        }
    }
}

/// Which positions a suffix forward recomputes: batch row `r` is prompt `rows[r]` of
/// the [`PrefixState`], at positions `from[r] .. from[r] + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suffix {
    /// Each batch row's prompt in the prefix state.
    pub rows: Vec<usize>,
    /// Each batch row's first recomputed position.
    pub from: Vec<usize>,
    /// Positions recomputed per row.
    pub len: usize,
}

impl Suffix {
    /// The recomputed positions, row-major `[rows * len]`.
    pub fn positions(&self) -> Vec<usize> {
        self.from.iter().flat_map(|&f| f..f + self.len).collect()
    }

    /// Check the suffix against a state of `rows` prompts of `total` tokens.
    pub fn check(&self, rows: usize, total: usize) -> Result<()> {
        if self.rows.len() != self.from.len() || self.rows.is_empty() || self.len == 0 {
            return Err(Error::Input(format!(
                "suffix: {} rows, {} start positions, length {}",
                self.rows.len(),
                self.from.len(),
                self.len
            )));
        }
        for (&r, &f) in self.rows.iter().zip(&self.from) {
            if r >= rows {
                return Err(Error::Input(format!(
                    "suffix row {r} out of range 0..{rows}"
                )));
            }
            if f.checked_add(self.len).is_none_or(|end| end > total) {
                return Err(Error::Input(format!(
                    "suffix positions {f}..{f}+{} run past the prompt length {total}",
                    self.len
                )));
            }
        }
        Ok(())
    }
}

/// What a base forward leaves behind so that later forwards of the same prompts can
/// recompute only some positions ([`super::LanguageModel::forward_suffix`]): per layer,
/// the named per-token tensors `[rows, len, ...]` the model passed through
/// `TokenFlow::full` / `TokenFlow::previous`.
#[derive(Debug, Clone)]
pub struct PrefixState {
    arch: &'static str,
    rows: usize,
    len: usize,
    /// The prompts' token ids, row-major `[rows * len]` (for models whose layers read
    /// them, e.g. hash routing); empty when not kept.
    ids: Vec<i64>,
    layers: Vec<BTreeMap<&'static str, Act>>,
}

impl PrefixState {
    /// An empty state for `rows` prompts of `len` tokens of an `arch` model.
    pub fn new(arch: &'static str, rows: usize, len: usize) -> Self {
        PrefixState {
            arch,
            rows,
            len,
            ids: Vec::new(),
            layers: Vec::new(),
        }
    }

    /// The states of consecutive blocks of rows of one batch, recorded by the same
    /// model over prompts of one length, stacked along the batch (each tensor's first
    /// axis). Each tensor's pieces are dropped once stacked.
    pub fn cat(mut parts: Vec<PrefixState>) -> Result<PrefixState> {
        let Some(first) = parts.first() else {
            return Err(Error::Other("no prefix states to stack".into()));
        };
        let (arch, len) = (first.arch, first.len);
        // Entries per layer: the stacking names any entry a later block lacks.
        let sizes: Vec<usize> = first.layers.iter().map(|m| m.len()).collect();
        let keeps_ids = !first.ids.is_empty();
        for p in &parts {
            let same = p.arch == arch
                && p.len == len
                && keeps_ids != p.ids.is_empty()
                && p.layers.len() == sizes.len()
                && p.layers.iter().zip(&sizes).all(|(m, &n)| m.len() == n);
            if !same {
                return Err(Error::Other(format!(
                    "prefix states of {arch} x {len} tokens ({} layers) and {} x {} tokens ({} layers) cannot be stacked",
                    sizes.len(),
                    p.arch,
                    p.len,
                    p.layers.len()
                )));
            }
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let ids = parts
            .iter_mut()
            .flat_map(|p| std::mem::take(&mut p.ids))
            .collect();
        let layers = (0..sizes.len())
            .map(|l| {
                stack_maps(
                    parts.iter_mut().map(|p| &mut p.layers[l]).collect(),
                    |name| format!("layer {l}'s {name} is missing from a block's state"),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PrefixState {
            arch,
            rows,
            len,
            ids,
            layers,
        })
    }

    /// Keep the prompts' token ids (row-major `[rows * len]`).
    pub fn with_ids(mut self, ids: Vec<i64>) -> Self {
        self.ids = ids;
        self
    }

    /// The prompts' token ids, row-major (empty when not kept).
    pub fn ids(&self) -> &[i64] {
        &self.ids
    }

    /// Number of prompts.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens per prompt.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the state holds no prompt.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The model type that recorded it.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Number of layers recorded.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes (f32) of the largest layer's recorded tensors: what a suffix forward
    /// merges over every position one layer at a time.
    pub fn max_layer_bytes(&self) -> f64 {
        self.layers
            .iter()
            .map(|m| {
                m.values()
                    .map(|a| 4.0 * a.shape().iter().product::<usize>() as f64)
                    .sum::<f64>()
            })
            .fold(0.0, f64::max)
    }

    fn insert(&mut self, layer: usize, name: &'static str, act: Act) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, BTreeMap::new);
        }
        self.layers[layer].insert(name, act);
    }

    fn get(&self, layer: usize, name: &str) -> Result<&Act> {
        self.layers
            .get(layer)
            .and_then(|m| m.get(name))
            .ok_or_else(|| {
                Error::Input(format!(
                    "the prefix state holds no `{name}` for layer {layer} (was it recorded by \
                     a forward_with_state of the same model?)"
                ))
            })
    }
}

/// How a forward reads and writes per-token state (see the module docs).
pub struct TokenFlow<'a> {
    queries: Queries,
    mode: Mode<'a>,
}

enum Mode<'a> {
    Plain,
    Record(&'a mut PrefixState),
    /// Boxed: two index tensors, over a kilobyte beside the other variants' reference.
    Suffix(Box<SuffixIndex<'a>>),
}

/// Where a suffix forward's rows come from.
struct SuffixIndex<'a> {
    state: &'a PrefixState,
    /// Each batch row's prompt in the state.
    rows: Vec<usize>,
    /// `[rows * total]`: each (row, position)'s index in `cat([state rows * total,
    /// recomputed rows * len])`.
    merge: Tensor<1, Int>,
    /// `merge`'s values on the host (the rows a host copy takes).
    merge_rows: Vec<usize>,
    /// `[rows * len]`: each computed position's predecessor in `cat([state rows *
    /// total, recomputed rows * len, one zero row])`.
    prev: Tensor<1, Int>,
}

impl<'a> TokenFlow<'a> {
    /// A plain forward of `rows` prompts of `len` tokens.
    pub fn plain(rows: usize, len: usize) -> Self {
        TokenFlow {
            queries: Queries::All { rows, len },
            mode: Mode::Plain,
        }
    }

    /// A plain forward that records into `state` (made by [`PrefixState::new`] for the
    /// same rows and length).
    pub fn record(state: &'a mut PrefixState) -> Self {
        TokenFlow {
            queries: Queries::All {
                rows: state.rows,
                len: state.len,
            },
            mode: Mode::Record(state),
        }
    }

    /// A suffix forward over `state` (checked: made by an `arch` model, `suffix` fits its
    /// prompts, and it holds the layers from `start` on).
    pub fn suffix(
        state: &'a PrefixState,
        suffix: &Suffix,
        arch: &str,
        start: usize,
        n_layers: usize,
        device: &Device,
    ) -> Result<Self> {
        if state.arch != arch {
            return Err(Error::Input(format!(
                "the prefix state was made by a {} model, not a {arch} model",
                state.arch
            )));
        }
        suffix.check(state.rows, state.len)?;
        if start >= n_layers || state.layers.len() != n_layers {
            return Err(Error::Input(format!(
                "suffix forward from block {start}: the model has {n_layers} blocks, the \
                 state {}",
                state.layers.len()
            )));
        }
        let (total, len, b) = (state.len, suffix.len, suffix.rows.len());
        let base = |r: usize, p: usize| suffix.rows[r] * total + p;
        let new = |r: usize, i: usize| state.rows * total + r * len + i;
        let merge = merge_index(state.rows, total, &suffix.rows, &suffix.from, len, 0);
        let mut prev = Vec::with_capacity(b * len);
        let zero = state.rows * total + b * len;
        for (r, &f) in suffix.from.iter().enumerate() {
            prev.extend((0..len).map(|i| match (i, f) {
                (0, 0) => zero,
                (0, f) => base(r, f - 1),
                (i, _) => new(r, i - 1),
            }));
        }
        Ok(TokenFlow {
            queries: Queries::Rows {
                from: suffix.from.clone(),
                len,
                total,
            },
            mode: Mode::Suffix(Box::new(SuffixIndex {
                state,
                rows: suffix.rows.clone(),
                merge: int_tensor(&merge, device),
                merge_rows: merge,
                prev: int_tensor(&prev, device),
            })),
        })
    }

    /// Whether this is a plain forward over every position that keeps no state.
    pub fn is_plain(&self) -> bool {
        matches!(self.mode, Mode::Plain)
    }

    /// The positions this forward computes.
    pub fn queries(&self) -> &Queries {
        &self.queries
    }

    /// `new: [rows, len, ...]` (this forward's values of `name` in `layer` at its
    /// computed positions) -> `[rows, total, ...]` over every position.
    pub fn full<const D: usize>(
        &mut self,
        layer: usize,
        name: &'static str,
        new: Tensor<D>,
    ) -> Result<Tensor<D>> {
        match &mut self.mode {
            Mode::Plain => Ok(new),
            Mode::Record(state) => {
                state.insert(layer, name, Act::new(new.clone()));
                Ok(new)
            }
            Mode::Suffix(_) => self.merged(layer, name, new, 0),
        }
    }

    /// A suffix forward's `[rows, total - from, ...]`: each row's positions `from..` from
    /// the base run's state, with its recomputed positions from `new: [rows, len, ...]`.
    fn merged<const D: usize>(
        &self,
        layer: usize,
        name: &str,
        new: Tensor<D>,
        from: usize,
    ) -> Result<Tensor<D>> {
        let (
            Mode::Suffix(s),
            Queries::Rows {
                from: firsts,
                len,
                total,
            },
        ) = (&self.mode, &self.queries)
        else {
            unreachable!("only a suffix forward merges")
        };
        let SuffixIndex {
            state,
            rows,
            merge,
            merge_rows,
            ..
        } = &**s;
        let device = new.device();
        let later;
        let idx: &[usize] = if from == 0 {
            merge_rows
        } else {
            later = merge_index(state.rows, *total, rows, firsts, *len, from);
            &later
        };
        let mut dims = new.dims();
        dims[0] = firsts.len();
        dims[1] = total - from;
        let (base, new) = (base_rows(state, layer, name, &new)?, flat_rows(new));
        // On flex: the chosen rows copied from either side, without their concatenation
        // (the base state's every row) being built first.
        if let Some(all) = super::host::rows_of_two(&base, &new, idx) {
            return Ok(all.reshape(dims));
        }
        let idx = if from == 0 {
            to(merge.clone(), &device)
        } else {
            int_tensor(idx, &device)
        };
        Ok(Tensor::cat(vec![base, new], 0).select(0, idx).reshape(dims))
    }

    /// In a suffix forward, the first position any row recomputes (every position
    /// before it holds the base run's values in every row); `None` in a plain or
    /// recording forward.
    pub fn first_recomputed(&self) -> Option<usize> {
        match (&self.mode, &self.queries) {
            (Mode::Suffix(_), Queries::Rows { from, .. }) => from.iter().copied().min(),
            _ => None,
        }
    }

    /// Positions `from..total` of what [`TokenFlow::full`] gives, `[rows, total - from,
    /// ...]`, without building the positions before `from` (a suffix forward merges
    /// only the later ones; a plain or recording forward slices, and records `new`).
    pub fn full_from<const D: usize>(
        &mut self,
        layer: usize,
        name: &'static str,
        new: Tensor<D>,
        from: usize,
    ) -> Result<Tensor<D>> {
        let total = self.queries.total();
        if from > total {
            return Err(Error::Input(format!(
                "positions {from}.. of `{name}` in layer {layer}: the prompts have {total}"
            )));
        }
        if !matches!(self.mode, Mode::Suffix(_)) {
            let full = self.full(layer, name, new)?;
            return Ok(full.slice_dim(1, from..total));
        }
        self.merged(layer, name, new, from)
    }

    /// In a recording forward, keep `value` (any shape, first axis the prompts) as
    /// `name` of `layer` in the state: a value derived from every position that a suffix
    /// forward can reuse where no row recomputed its inputs ([`TokenFlow::kept`]).
    /// Nothing in a plain or suffix forward.
    pub fn keep<const D: usize>(&mut self, layer: usize, name: &'static str, value: &Tensor<D>) {
        if let Mode::Record(state) = &mut self.mode {
            state.insert(layer, name, Act::new(value.clone()));
        }
    }

    /// In a suffix forward, what the recording forward kept as `name` of `layer`
    /// ([`TokenFlow::keep`]), on this forward's `device`, and each batch row's prompt in
    /// it; `None` in a plain or recording forward, or when nothing was kept so.
    pub fn kept<const D: usize>(
        &self,
        layer: usize,
        name: &str,
        device: &Device,
    ) -> Option<Result<(Tensor<D>, Vec<usize>)>> {
        let Mode::Suffix(s) = &self.mode else {
            return None;
        };
        let SuffixIndex { state, rows, .. } = &**s;
        let act = state.layers.get(layer)?.get(name)?;
        Some(act.get::<D>().map(|t| (to(t, device), rows.clone())))
    }

    /// In a suffix forward, the base run's `name` of `layer` over every position of
    /// every prompt of the state, `[state rows, total, ...]` (the per-position shape of
    /// `like`), and each batch row's prompt in it: what values derived only from
    /// positions before [`TokenFlow::first_recomputed`] can be computed from once per
    /// prompt. `None` in a plain or recording forward.
    pub fn base_state<const D: usize>(
        &self,
        layer: usize,
        name: &str,
        like: &Tensor<D>,
    ) -> Option<Result<(Tensor<D>, Vec<usize>)>> {
        let Mode::Suffix(s) = &self.mode else {
            return None;
        };
        let SuffixIndex { state, rows, .. } = &**s;
        let mut dims = like.dims();
        dims[0] = state.rows;
        dims[1] = state.len;
        Some(base_rows(state, layer, name, like).map(|t| (t.reshape(dims), rows.clone())))
    }

    /// `new: [rows, len, ...]` -> the values of `name` in `layer` at each computed
    /// position's predecessor, `[rows, len, ...]` (zeros before position 0).
    pub fn previous<const D: usize>(
        &mut self,
        layer: usize,
        name: &'static str,
        new: Tensor<D>,
    ) -> Result<Tensor<D>> {
        let dims = new.dims();
        let per: usize = dims[2..].iter().product();
        match &mut self.mode {
            Mode::Plain | Mode::Record(_) => {
                if let Mode::Record(state) = &mut self.mode {
                    state.insert(layer, name, Act::new(new.clone()));
                }
                let mut first = dims;
                first[1] = 1;
                let zeros = Tensor::<D>::zeros(first, &new.device());
                if dims[1] <= 1 {
                    return Ok(zeros);
                }
                Ok(Tensor::cat(
                    vec![zeros, new.slice_dim(1, 0..dims[1] - 1)],
                    1,
                ))
            }
            Mode::Suffix(s) => {
                let SuffixIndex { state, prev, .. } = &**s;
                let device = new.device();
                let rows = Tensor::cat(
                    vec![
                        base_rows(state, layer, name, &new)?,
                        flat_rows(new),
                        Tensor::zeros([1, per], &device),
                    ],
                    0,
                );
                Ok(rows.select(0, to(prev.clone(), &device)).reshape(dims))
            }
        }
    }
}

/// For batch row `r` (prompt `rows[r]` of a state of `state_rows` prompts of `total`
/// tokens, recomputing positions `firsts[r] .. firsts[r] + len`), each position
/// `from..total`'s index in `cat([state rows * total, recomputed rows * len])`.
fn merge_index(
    state_rows: usize,
    total: usize,
    rows: &[usize],
    firsts: &[usize],
    len: usize,
    from: usize,
) -> Vec<usize> {
    let mut idx = Vec::with_capacity(rows.len() * (total - from));
    for (r, (&p, &f)) in rows.iter().zip(firsts).enumerate() {
        idx.extend((from..total).map(|q| {
            if q >= f && q < f + len {
                state_rows * total + r * len + q - f
            } else {
                p * total + q
            }
        }));
    }
    idx
}

/// `[rows, len, ...]` -> `[rows * len, per]`.
fn flat_rows<const D: usize>(x: Tensor<D>) -> Tensor<2> {
    let dims = x.dims();
    let per: usize = dims[2..].iter().product();
    x.reshape([dims[0] * dims[1], per])
}

/// The state's `name` of `layer` as `[state rows * total, per]`, checked against the
/// per-position shape of `new`.
fn base_rows<const D: usize>(
    state: &PrefixState,
    layer: usize,
    name: &str,
    new: &Tensor<D>,
) -> Result<Tensor<2>> {
    let base = state.get(layer, name)?;
    let dims = new.dims();
    if base.shape().len() != D || base.shape()[2..] != dims[2..] {
        return Err(Error::Input(format!(
            "the prefix state's `{name}` of layer {layer} has shape {:?}, the suffix's {dims:?}",
            base.shape()
        )));
    }
    let per: usize = dims[2..].iter().product();
    // A placed model's layers may run on another device than the suffix forward's input.
    Ok(to(
        base.reshaped(vec![state.rows * state.len, per])?
            .get::<2>()?,
        &new.device(),
    ))
}
