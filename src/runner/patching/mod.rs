//! The one batched intervention routine every experiment kind uses.
//!
//! Like TransformerLens' `patching.py`, the routine is generic: a [`Cell`] is one
//! variant of a forward pass (patch head 3 of layer 2 from the clean run, zero KV
//! head 0 of layer 1, roll the gates of every layer by +2 offsets, ...) applied to a
//! set of prompts, and the experiment kinds only decide which cells to sweep (layer x
//! head x source phase x direction, layer x KV head, gate shifts, ...).
//!
//! How a set of cells is evaluated on a batch of prompts ([`Prompts`]):
//!
//! 1. [`base_run`]: ONE forward over all prompts (e.g. the clean AND the corrupted
//!    prompts of one phase group), capturing `blocks.{l}.hook_resid_pre` at every
//!    layer a cell starts at and every activation a cell replaces.
//! 2. [`plan_chunks`]: cells are grouped by the layer they start at and packed into
//!    chunks of at most `max_rows` batch rows (cells x prompts).
//! 3. [`run_chunk`]: ONE `forward_from(start, resid)` over the rows of a chunk; the
//!    layers before `start` are not run again. Each block of rows carries one cell:
//!    - a [`Edit::Replace`] at a point of layer `start` (hook_z, hook_attn_out,
//!      hook_resid_pre, ...): since nothing upstream of that point differs from the
//!      base run, the receiving activation IS the base run's; the routine builds, for
//!      every replaced point, one tensor = base activation of each row's prompt with
//!      the cell's heads x positions taken from the fill (the partner prompt's
//!      activation, zero, the group mean, another prompt of the group), and installs it
//!      with one `Action::Replace` scoped to the rows of the cells that edit that point.
//!      Positions may differ per row (the answer position moves with prefix padding).
//!    - a [`Edit::Transform`] (e.g. `Action::Roll` on the compressor gates) is applied
//!      inside the forward through the hook mechanism, scoped to its rows.
//!    - a [`Edit::FromStage`] (path patching) replaces a point by its capture in an
//!      earlier stage's forward of the same prompt: a [`Stage`] is one replacement
//!      plus freezes (points held at the prompt's own base values). [`run_stages`]
//!      (called by [`base_run_for`]) runs each distinct stage once per prompt, batched
//!      per start layer like the chunks; the chunk then takes the capture as a fill.
//! 4. The logits are read only at each prompt's target positions ([`Outcome`]).
//!
//! Files: this one (the types, the base run, the chunk plan and [`run_chunk`]),
//! `fill.rs` (fill values), `stage.rs` (two-stage edits), `suffix.rs` (suffix plans),
//! `budget.rs` (the memory check of a group's forwards), `naive.rs` (the oracle).
//!
//! [`run_cell_naive`] evaluates one cell the slow, obvious way (a full forward per
//! cell, two for a stage edit, with the hooks' own `Patch`/`Zero`/`Mean`/`Resample`
//! actions); it is the reference the batched path is tested against and the baseline
//! of `phaselens bench patching`.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hooks::{
    Act, Action, ActivationCache, HookPoint, HookSpec, PosCounts, RowScope, Scope, Site,
};
use crate::model::{LanguageModel, PrefixState, Suffix};

pub mod budget;
mod fill;
mod naive;
mod stage;
mod suffix;

/// The prompt batch the routine runs on (built in [`crate::tasks::prompts`]).
pub use crate::tasks::prompts::{Prompts, Target};
use fill::{
    FillKey, RowEdit, RowFill, act_at, check_edit_positions, edits_scope, fill_value_act,
    group_mean,
};
pub use naive::run_cell_naive;
pub use stage::{Stage, StageCaptures, run_stages};
pub use suffix::{ChunkPath, capture_window, plan_suffix};
use suffix::{slice_positions, take_positions};

/// Which query positions an edit touches, per prompt. `{ final = 0 }` (a band of no
/// positions: every cell would read as "no effect") is rejected where it is parsed, in
/// experiment files and `bench patching --positions` alike ([`Positions::parse`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", try_from = "PositionsRepr")]
pub enum Positions {
    /// Every position (TransformerLens' "all positions" patching).
    #[default]
    All,
    /// The prompt's target positions (where the answer is read).
    Answer,
    /// The last `k` positions up to and including the last target position
    /// (a band of final query positions; clipped at position 0).
    Final(usize),
    /// The one position `k` before the last target position (0 = the last target
    /// position itself; none when the prompt is shorter). One position at a time:
    /// what per-position patching and attribution patching compare.
    Offset(usize),
}

/// The serde form of [`Positions`], checked by `TryFrom`.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum PositionsRepr {
    All,
    Answer,
    Final(usize),
}

impl TryFrom<PositionsRepr> for Positions {
    type Error = String;
    fn try_from(r: PositionsRepr) -> std::result::Result<Self, String> {
        match r {
            PositionsRepr::All => Ok(Positions::All),
            PositionsRepr::Answer => Ok(Positions::Answer),
            PositionsRepr::Final(k) => Positions::final_band(k),
        }
    }
}

impl Positions {
    /// `Final(k)`, rejecting `k = 0` (a band of no positions patches nothing).
    pub fn final_band(k: usize) -> std::result::Result<Self, String> {
        if k == 0 {
            Err("`final = 0` selects no positions (every cell would read as no effect); use final = K with K >= 1".into())
        } else {
            Ok(Positions::Final(k))
        }
    }

    /// The command-line form: `all`, `answer` or `final:K` (K >= 1).
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "all" => Ok(Positions::All),
            "answer" => Ok(Positions::Answer),
            _ => match s.strip_prefix("final:").map(str::parse::<usize>) {
                Some(Ok(k)) => Positions::final_band(k),
                _ => Err(format!("`{s}`: expected all, answer or final:K (K >= 1)")),
            },
        }
    }

    /// The positions for a prompt whose target positions are `targets`; `None` = all.
    pub fn resolve(&self, targets: &[usize]) -> Option<Vec<usize>> {
        match self {
            Positions::All => None,
            Positions::Answer => Some(targets.to_vec()),
            Positions::Final(k) => {
                let end = *targets.last().expect("a prompt has a target position");
                Some((end + 1).saturating_sub(*k)..end + 1).map(|r| r.collect())
            }
            Positions::Offset(k) => {
                let end = *targets.last().expect("a prompt has a target position");
                Some(end.checked_sub(*k).into_iter().collect())
            }
        }
    }
}

/// What a [`Edit::Replace`] puts in place of the activation: the one fill of every
/// kind (`methods = ["zero", "mean", "resample"]` of ablate-heads, `method` and
/// `layer_output_fill` of knockout; patch-heads patches from the source).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fill {
    /// The same activation in the prompt's partner ([`Prompts::source`]): activation
    /// patching (clean into corrupted = denoising, the reverse = noising).
    Source,
    /// Zero.
    Zero,
    /// The mean over the prompts of the same group ([`Prompts::group`]), per position.
    Mean,
    /// The activation of the next prompt of the same group (cyclically): resampling.
    Resample,
}

impl Fill {
    /// The name in experiment files and metric suffixes (`rel_change_pct_zero`).
    pub fn name(self) -> &'static str {
        match self {
            Fill::Source => "source",
            Fill::Zero => "zero",
            Fill::Mean => "mean",
            Fill::Resample => "resample",
        }
    }
}

/// One intervention.
#[derive(Debug, Clone)]
pub enum Edit {
    /// Replace the activation at `point` (a layer point), within `heads` (along the
    /// point's head axis; `None` = all) and `positions`, by `fill`.
    Replace {
        point: HookPoint,
        heads: Option<Vec<usize>>,
        positions: Positions,
        fill: Fill,
    },
    /// Apply `action` at every point of `points` during the forward (e.g. roll the
    /// compressor gates), within `heads`.
    Transform {
        points: Vec<HookPoint>,
        /// Boxed: an action may hold a tensor (several hundred bytes).
        action: Box<Action>,
        heads: Option<Vec<usize>>,
    },
    /// Apply its own action at each point during the forward (e.g. add each layer's
    /// rolled-minus-learned gate bias to its gate logits), within `heads`.
    TransformEach {
        actions: Vec<(HookPoint, Action)>,
        heads: Option<Vec<usize>>,
    },
    /// A two-stage edit (path patching): replace the activation at `point` (a layer
    /// point), within `heads` and at every position, by its value in a forward of the
    /// same prompt under `stage` (an earlier stage's capture). Cells sharing a stage
    /// share its forwards ([`run_stages`]).
    FromStage {
        stage: Arc<Stage>,
        point: HookPoint,
        heads: Option<Vec<usize>>,
    },
}

impl Edit {
    /// The block the batched forward starts at.
    pub fn start_layer(&self) -> Result<usize> {
        match self {
            Edit::Replace { point, .. } | Edit::FromStage { point, .. } => block_layer(point),
            Edit::Transform { points, .. } => Self::first_layer(points.iter(), block_layer),
            Edit::TransformEach { actions, .. } => {
                Self::first_layer(actions.iter().map(|(p, _)| p), block_layer)
            }
        }
    }

    /// The smallest layer of `points`.
    fn first_layer<'p>(
        points: impl Iterator<Item = &'p HookPoint>,
        layer: impl Fn(&HookPoint) -> Result<usize>,
    ) -> Result<usize> {
        let mut m = usize::MAX;
        for p in points {
            m = m.min(layer(p)?);
        }
        if m == usize::MAX {
            return Err(Error::Other("a transform edit without points".into()));
        }
        Ok(m)
    }
}

/// The layer of a block point (`blocks.{l}.*`).
fn block_layer(p: &HookPoint) -> Result<usize> {
    p.layer.ok_or_else(|| {
        Error::hook(
            p.to_string(),
            "interventions of the batched routine target block points (blocks.{l}.*)",
        )
    })
}

/// One variant of the forward pass applied to some of the prompts.
#[derive(Debug, Clone)]
pub struct Cell {
    pub edit: Edit,
    /// The prompts (indices into [`Prompts`]) that receive the edit.
    pub prompts: Vec<usize>,
}

/// What a forward pass says about one prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Top-1 over the full vocabulary equals the answer at every target position.
    pub correct: bool,
    /// `logit(answer[0]) - logit(alt)` at the first target position (`NaN` without alt).
    pub ld: f32,
}

/// The base run of a batch: its captured activations and outcomes, and, for models
/// with a suffix forward, the state that lets a chunk recompute only the positions it
/// edits and reads ([`run_chunk`]).
#[derive(Debug, Clone)]
pub struct Base {
    pub cache: Arc<ActivationCache>,
    pub outcomes: Vec<Outcome>,
    pub state: Option<Arc<PrefixState>>,
    /// The captures of the stages the cells' [`Edit::FromStage`] edits replace from
    /// ([`run_stages`]; empty without such cells).
    pub stages: Arc<StageCaptures>,
    /// The token positions its per-token captures hold (`None`: every position): a
    /// base run whose cells all run as suffix forwards keeps only the positions they
    /// read ([`base_run_for`]).
    pub window: Option<std::ops::Range<usize>>,
}

/// The points a base run must capture so that `cells` can run.
pub fn captures_for(cells: &[Cell]) -> Result<Vec<HookPoint>> {
    let mut pts = std::collections::BTreeSet::new();
    for c in cells {
        pts.insert(HookPoint::block(c.edit.start_layer()?, Site::ResidPre));
        match &c.edit {
            Edit::Replace { point, .. } => {
                pts.insert(*point);
            }
            Edit::FromStage { stage, point, .. } => {
                pts.insert(*point);
                pts.extend(stage.reads()?);
            }
            _ => {}
        }
    }
    Ok(pts.into_iter().collect())
}

/// Read the outcomes of `targets[i]` from row `i` of `logits: [rows, pos, vocab]`.
pub fn readout(logits: Tensor<3>, targets: &[&Target]) -> Result<Vec<Outcome>> {
    let [r, t, v] = logits.dims();
    if r != targets.len() {
        return Err(Error::Other(format!(
            "readout: {r} logit rows for {} targets",
            targets.len()
        )));
    }
    let (flat, pairs) = target_rows(targets, t, v)?;
    let k = flat.len();
    let idx = Tensor::<1, Int>::from_data(TensorData::new(flat, [k]), &logits.device());
    outcomes_of(logits.reshape([r * t, v]).select(0, idx), pairs, targets)
}

/// The flat logit rows (`i * t + p`, row `i` of the batch, position `p`) every target
/// reads, in order, and the (answer, alternative) id pairs read there; an error when an
/// answer lies outside the vocabulary `0..v`.
fn target_rows(targets: &[&Target], t: usize, v: usize) -> Result<(Vec<i64>, Vec<i64>)> {
    let mut flat = Vec::new();
    let mut pairs = Vec::new();
    for (i, tg) in targets.iter().enumerate() {
        for (k, (&p, &a)) in tg.positions.iter().zip(&tg.answers).enumerate() {
            flat.push((i * t + p) as i64);
            let alt = if k == 0 { tg.alt.unwrap_or(a) } else { a };
            if a as usize >= v || alt as usize >= v {
                return Err(Error::Input(format!(
                    "answer token {a} / {alt} is outside the model's vocabulary 0..{v}"
                )));
            }
            pairs.push(a as i64);
            pairs.push(alt as i64);
        }
    }
    Ok((flat, pairs))
}

/// The outcomes from `rows: [k, vocab]`, the logits at the targets' positions in
/// [`target_rows`]' order, and its (answer, alternative) `pairs`.
fn outcomes_of(rows: Tensor<2>, pairs: Vec<i64>, targets: &[&Target]) -> Result<Vec<Outcome>> {
    let k = rows.dims()[0];
    let device = rows.device();
    // NaN or infinite logits would read as "wrong answer, no effect": a finding made
    // of garbage. The executor names the layer that went non-finite (model/diagnose.rs).
    if !crate::model::diagnose::all_finite(&rows)? {
        return Err(Error::NonFinite(format!(
            "the logits read at the target positions of {} row(s) hold NaN or infinite values",
            targets.len()
        )));
    }
    let top = rows.clone().argmax(1).try_into_vec_as::<i64>()?;
    let pairs = Tensor::<2, Int>::from_data(TensorData::new(pairs, [k, 2]), &device);
    let vals = rows.gather(1, pairs).try_into_vec_as::<f32>()?;
    let mut out = Vec::with_capacity(targets.len());
    let mut j = 0;
    for tg in targets {
        let mut correct = true;
        let mut ld = f32::NAN;
        for (k, &a) in tg.answers.iter().enumerate() {
            correct &= top[j] == a as i64;
            if k == 0 && tg.alt.is_some() {
                ld = vals[2 * j] - vals[2 * j + 1];
            }
            j += 1;
        }
        out.push(Outcome { correct, ld });
    }
    Ok(out)
}

/// One forward over every prompt, capturing `captures`, keeping the model's prefix
/// state for suffix forwards.
pub fn base_run(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    captures: &[HookPoint],
) -> Result<Base> {
    base_run_with(model, prompts, captures, true)
}

/// [`base_run`] for `cells`: captures what they read, and keeps the prefix state only
/// when some cell can run as a suffix forward (it holds every layer's per-token keys
/// and values: no need to keep them for "all"-position edits or transforms); then
/// the forwards of the cells' stages ([`run_stages`], `max_rows` rows at a time).
/// When every cell runs as a suffix forward, the per-token captures keep only the
/// positions the suffixes read ([`suffix::capture_window`]; at 8K tokens of
/// DeepSeek-V4-Flash width, every position of `hook_z` and `hook_resid_pre` of three
/// layers is ~9 GiB, the answer positions a few MiB).
pub fn base_run_for(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    cells: &[Cell],
    max_rows: usize,
) -> Result<Base> {
    let keep = suffix::keeps_state(cells);
    let captures = captures_for(cells)?;
    let window = suffix::capture_window(prompts, cells);
    let mut base = base_run_windowed(model, prompts, &captures, keep, window.clone())?;
    if window.is_some() && base.state.is_none() {
        // The model has no suffix forward: its chunks read every position.
        base = base_run_with(model, prompts, &captures, keep)?;
    }
    base.stages = Arc::new(run_stages(
        model,
        prompts,
        &base,
        cells,
        max_rows,
        ChunkPath::Auto,
    )?);
    Ok(base)
}

/// [`base_run`], keeping the prefix state only when `keep_state`.
pub fn base_run_with(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    captures: &[HookPoint],
    keep_state: bool,
) -> Result<Base> {
    base_run_windowed(model, prompts, captures, keep_state, None)
}

/// [`base_run_with`], the per-token captures kept at positions `window` only
/// ([`HookSpec::capture_window`]; `None`: every position).
pub fn base_run_windowed(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    captures: &[HookPoint],
    keep_state: bool,
    window: Option<std::ops::Range<usize>>,
) -> Result<Base> {
    prompts.check()?;
    let mut spec = HookSpec::new();
    for p in captures {
        spec = spec.capture_point(*p);
    }
    if let Some(w) = &window {
        spec = spec.capture_window(w.clone());
    }
    // Blocks of rows fixed by the prompts' shape, several at once: a forward keeps about
    // one core busy (burn-flex's elementwise passes run on the calling thread).
    let blocks = budget::base_blocks(prompts.n(), prompts.len);
    let width = budget::base_width(&budget::Sizes::of(model), prompts, &blocks);
    let mut parts: Vec<Option<BasePart>> = blocks.iter().map(|_| None).collect();
    let items: Vec<usize> = (0..blocks.len()).collect();
    crate::runner::concurrent::run(
        &items,
        width,
        |i| base_part(model, prompts, &spec, blocks[i].clone(), keep_state),
        |i, part| {
            parts[i] = Some(part);
            Ok(())
        },
    )?;
    let parts: Vec<BasePart> = parts.into_iter().flatten().collect();
    let outcomes = parts.iter().flat_map(|p| p.outcomes.clone()).collect();
    let (caches, states): (Vec<_>, Vec<_>) = parts.into_iter().map(|p| (p.cache, p.state)).unzip();
    let cache = if caches.len() == 1 {
        caches.into_iter().next().unwrap_or_default()
    } else {
        ActivationCache::cat_batch(caches)?
    };
    let state = match states.into_iter().collect::<Option<Vec<PrefixState>>>() {
        Some(s) if s.len() == 1 => s.into_iter().next(),
        Some(s) => Some(PrefixState::cat(s)?),
        None => None,
    };
    for p in captures {
        if cache.get(p).is_none() {
            return Err(Error::hook(
                p.to_string(),
                "the model did not produce this activation (is the layer of the right kind?)",
            ));
        }
    }
    Ok(Base {
        cache: Arc::new(cache),
        outcomes,
        state: state.map(Arc::new),
        stages: Default::default(),
        window,
    })
}

/// One block of rows of a base run.
struct BasePart {
    outcomes: Vec<Outcome>,
    cache: ActivationCache,
    state: Option<PrefixState>,
}

/// The base run's forward over the prompts `rows`: captures, state, and the outcomes
/// from the LM head at the positions the targets read (only there).
fn base_part(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    spec: &HookSpec,
    rows: std::ops::Range<usize>,
    keep_state: bool,
) -> Result<BasePart> {
    let rows: Vec<usize> = rows.collect();
    let (outcomes, (cache, state)) = outcomes_at(model, prompts, &rows, |tokens, idx| {
        let (logits, cache, state) = model.forward_rows(tokens, spec, idx, keep_state)?;
        Ok((logits, (cache, state)))
    })?;
    Ok(BasePart {
        outcomes,
        cache,
        state,
    })
}

/// The outcomes of the prompts `rows` from `forward(tokens, flat target positions) ->
/// (logits there, what else it returns)`; a non-finite logit is diagnosed by layer.
fn outcomes_at<T>(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    rows: &[usize],
    forward: impl FnOnce(Tensor<2, Int>, Tensor<1, Int>) -> Result<(Tensor<2>, T)>,
) -> Result<(Vec<Outcome>, T)> {
    let device = model.device();
    let tokens = prompts.tokens_of(rows, &device);
    let targets: Vec<&Target> = rows.iter().map(|&r| &prompts.targets[r]).collect();
    let (flat, pairs) = target_rows(&targets, tokens.dims()[1], model.info().vocab_size)?;
    let k = flat.len();
    let idx = Tensor::<1, Int>::from_data(TensorData::new(flat, [k]), &device);
    let (logit_rows, rest) = forward(tokens, idx)?;
    match outcomes_of(logit_rows, pairs, &targets) {
        Err(Error::NonFinite(what)) => {
            let tokens = prompts.tokens_of(rows, &device);
            Err(crate::model::diagnose::non_finite_error(
                model, tokens, &what,
            ))
        }
        r => Ok((r?, rest)),
    }
}

/// Outcomes of plain forwards over every prompt, `max_rows` prompts at a time.
pub fn evaluate(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    max_rows: usize,
) -> Result<Vec<Outcome>> {
    prompts.check()?;
    let idx: Vec<usize> = (0..prompts.n()).collect();
    let chunks: Vec<&[usize]> = idx.chunks(max_rows.max(1)).collect();
    let rows = chunks.first().map_or(0, |c| c.len());
    let sizes = budget::Sizes::of(model);
    let width = crate::runner::concurrent::width(
        chunks.len(),
        Some(budget::base_block_bytes(&sizes, prompts, rows)),
    );
    let mut parts: Vec<Vec<Outcome>> = vec![Vec::new(); chunks.len()];
    let items: Vec<usize> = (0..chunks.len()).collect();
    // Chunks of `max_rows` prompts (fixed by it, not by the threads), several at once;
    // the LM head only at the positions the targets read (at a 262,144-word vocabulary
    // it is most of a short forward).
    crate::runner::concurrent::run(
        &items,
        width,
        |i| {
            let (o, ()) = outcomes_at(model, prompts, chunks[i], |tokens, idx| {
                Ok((model.forward_logit_rows(tokens, idx)?, ()))
            })?;
            Ok(o)
        },
        |i, o| {
            parts[i] = o;
            Ok(())
        },
    )?;
    Ok(parts.concat())
}

/// Split `cells` into chunks that share a start layer and hold at most `max_rows`
/// rows (a cell with more prompts than that gets a chunk of its own). The plan is a
/// pure function of the cells, so an interrupted run finds the same chunks again.
pub fn plan_chunks(cells: &[Cell], max_rows: usize) -> Result<Vec<Vec<usize>>> {
    let mut by_layer: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, c) in cells.iter().enumerate() {
        by_layer.entry(c.edit.start_layer()?).or_default().push(i);
    }
    let mut chunks = Vec::new();
    for idx in by_layer.into_values() {
        let mut cur: Vec<usize> = Vec::new();
        let mut rows = 0;
        for i in idx {
            let n = cells[i].prompts.len();
            if !cur.is_empty() && rows + n > max_rows {
                chunks.push(std::mem::take(&mut cur));
                rows = 0;
            }
            cur.push(i);
            rows += n;
        }
        if !cur.is_empty() {
            chunks.push(cur);
        }
    }
    Ok(chunks)
}

/// Evaluate the cells `chunk` (indices into `cells`, all with the same start layer)
/// in ONE forward over their rows. Returns, per cell of the chunk, one outcome per
/// prompt of the cell.
///
/// When the model has a suffix forward and every edit of the chunk replaces a
/// per-token activation at given positions (answer positions, a final band), the
/// forward recomputes only each row's positions from its first edited or read one to
/// its last read one, over the base run's keys and values for the rest
/// ([`LanguageModel::forward_suffix`]); otherwise `forward_from` runs every position.
pub fn run_chunk(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    base: &Base,
    cells: &[Cell],
    chunk: &[usize],
) -> Result<Vec<Vec<Outcome>>> {
    run_chunk_with(model, prompts, base, cells, chunk, ChunkPath::Auto)
}

/// The rows of a chunk's forward: the start layer, the prompt of each row, and the
/// rows of each cell (in chunk order).
struct ChunkRows {
    start: usize,
    row_prompt: Vec<usize>,
    cell_rows: Vec<std::ops::Range<usize>>,
}

/// Lay out the rows of `chunk` (its cells' prompts in cell order), checking that the
/// cells share a start layer.
fn chunk_rows(cells: &[Cell], chunk: &[usize]) -> Result<ChunkRows> {
    let first = chunk
        .first()
        .ok_or_else(|| Error::Other("empty chunk".into()))?;
    let start = cells[*first].edit.start_layer()?;
    let mut row_prompt = Vec::new();
    let mut cell_rows: Vec<std::ops::Range<usize>> = Vec::new();
    for &c in chunk {
        let cell = &cells[c];
        if cell.edit.start_layer()? != start {
            return Err(Error::Other("a chunk mixes start layers".into()));
        }
        let from = row_prompt.len();
        row_prompt.extend_from_slice(&cell.prompts);
        cell_rows.push(from..row_prompt.len());
    }
    Ok(ChunkRows {
        start,
        row_prompt,
        cell_rows,
    })
}

/// Install a transform edit's actions (every point of a [`Edit::Transform`], each
/// action of a [`Edit::TransformEach`]) into `spec`, within `scope` narrowed to the
/// edit's heads; a [`Edit::Replace`] installs nothing.
fn intervene_transform(mut spec: HookSpec, edit: &Edit, scope: &Scope) -> HookSpec {
    let (actions, heads): (Vec<(&HookPoint, &Action)>, _) = match edit {
        Edit::Replace { .. } | Edit::FromStage { .. } => return spec,
        Edit::Transform {
            points,
            action,
            heads,
        } => (points.iter().map(|p| (p, &**action)).collect(), heads),
        Edit::TransformEach { actions, heads } => {
            (actions.iter().map(|(p, a)| (p, a)).collect(), heads)
        }
    };
    for (p, action) in actions {
        let scope = Scope {
            heads: heads.clone(),
            ..scope.clone()
        };
        spec = spec.intervene_point(*p, action.clone(), scope);
    }
    spec
}

/// The replace edits of a chunk, merged per point (one [`RowEdit`] per row), and a
/// spec holding its transform edits, each scoped to its cell's rows.
fn chunk_edits<'c>(
    prompts: &Prompts,
    cells: &'c [Cell],
    chunk: &[usize],
    rows: &ChunkRows,
) -> (BTreeMap<HookPoint, Vec<RowEdit<'c>>>, HookSpec) {
    let mut per_point: BTreeMap<HookPoint, Vec<RowEdit>> = BTreeMap::new();
    let mut spec = HookSpec::new();
    for (&c, cell_rows) in chunk.iter().zip(&rows.cell_rows) {
        match &cells[c].edit {
            Edit::Replace {
                point,
                heads,
                positions,
                fill,
            } => {
                let list = per_point.entry(*point).or_default();
                for row in cell_rows.clone() {
                    let prompt = rows.row_prompt[row];
                    list.push(RowEdit {
                        row,
                        prompt,
                        fill: RowFill::Fill(*fill),
                        heads: heads.as_deref(),
                        positions: positions.resolve(&prompts.targets[prompt].positions),
                    });
                }
            }
            Edit::FromStage {
                stage,
                point,
                heads,
            } => {
                let list = per_point.entry(*point).or_default();
                for row in cell_rows.clone() {
                    list.push(RowEdit {
                        row,
                        prompt: rows.row_prompt[row],
                        fill: RowFill::Stage(stage),
                        heads: heads.as_deref(),
                        positions: None,
                    });
                }
            }
            edit => {
                let scope = Scope {
                    batch: Some(cell_rows.clone().collect()),
                    ..Scope::all()
                };
                spec = intervene_transform(spec, edit, &scope);
            }
        }
    }
    (per_point, spec)
}

/// Bytes of full-length rows a suffix chunk builds at once before slicing them to its
/// positions (a fill's value, one block of rows at a time).
const SLICE_BLOCK_BYTES: usize = 256 << 20;

/// `value(rows, edits)` (`[rows, len, ...]` over every position) sliced to each row's
/// suffix positions, computed a block of rows at a time so that no more than
/// [`SLICE_BLOCK_BYTES`] of full-length rows exist at once: at 8K tokens one row of a
/// DeepSeek-V4-Flash `hook_z` is 1 GiB, and a chunk holds dozens.
fn sliced_rows(
    base_act: &Act,
    row_prompt: &[usize],
    edits: &[&RowEdit],
    sfx: &Suffix,
    value: impl Fn(&[usize], &[&RowEdit]) -> Result<Act>,
) -> Result<Act> {
    let per_row = 4 * base_act.shape()[1..].iter().product::<usize>();
    let block = (SLICE_BLOCK_BYTES / per_row.max(1)).max(1);
    sliced_rows_by(block, row_prompt, edits, sfx, value)
}

/// [`sliced_rows`] `block` rows at a time.
fn sliced_rows_by(
    block: usize,
    row_prompt: &[usize],
    edits: &[&RowEdit],
    sfx: &Suffix,
    value: impl Fn(&[usize], &[&RowEdit]) -> Result<Act>,
) -> Result<Act> {
    let mut parts = Vec::new();
    for start in (0..row_prompt.len()).step_by(block) {
        let end = (start + block).min(row_prompt.len());
        let local: Vec<RowEdit> = edits
            .iter()
            .filter(|e| (start..end).contains(&e.row))
            .map(|e| RowEdit {
                row: e.row - start,
                prompt: e.prompt,
                fill: e.fill,
                heads: e.heads,
                positions: e.positions.clone(),
            })
            .collect();
        let refs: Vec<&RowEdit> = local.iter().collect();
        let full = value(&row_prompt[start..end], &refs)?;
        parts.push(slice_positions(&full, &sfx.from[start..end], sfx.len)?);
    }
    if parts.len() == 1 {
        return Ok(parts.pop().expect("one part"));
    }
    Act::cat_batch(&parts)
}

/// Add to `spec` one `Action::Replace` per point and fill of the merged replace
/// edits: the fill's value over every row (sliced to the suffix when the chunk runs
/// as one), scoped to the rows that take it. Per point, the rows' own values
/// (freezes) go first, so that a fill at the same point lands on top of them.
fn install_replacements(
    mut spec: HookSpec,
    per_point: &BTreeMap<HookPoint, Vec<RowEdit>>,
    base: &Base,
    prompts: &Prompts,
    row_prompt: &[usize],
    suffix: Option<&Suffix>,
) -> Result<HookSpec> {
    // Suffix positions as indices into the base run's captures (which may hold a
    // window of positions only, `Base::window`).
    let local = suffix.map(|s| windowed_suffix(base, s)).transpose()?;
    for (point, edits) in per_point {
        let base_act = act_at(&base.cache, point)?;
        check_edit_positions(point, prompts.len, edits)?;
        let mut fills: Vec<FillKey> = edits.iter().map(|e| e.fill.key()).collect();
        fills.sort();
        fills.dedup();
        for fill in fills {
            let of_fill: Vec<&RowEdit> = edits.iter().filter(|e| e.fill.key() == fill).collect();
            let value = |rows: &[usize], edits: &[&RowEdit]| -> Result<Act> {
                match fill {
                    FillKey::Own => base_act.select_batch(rows),
                    FillKey::Fill(f) => fill_value_act(point, f, base_act, prompts, rows, edits),
                    FillKey::Stage => base.stages.value(point, base_act, rows, edits),
                }
            };
            let value = match &local {
                None => value(row_prompt, &of_fill)?,
                Some(sfx) => sliced_rows(base_act, row_prompt, &of_fill, sfx, value)?,
            };
            // Every row at every head and position (a stage's freezes): no mask.
            let whole = of_fill.len() == row_prompt.len()
                && of_fill
                    .iter()
                    .all(|e| e.heads.is_none() && e.positions.is_none());
            let scope = if whole {
                Scope::all()
            } else {
                edits_scope(&of_fill, suffix)
            };
            spec = spec.intervene_point(*point, Action::Replace(value), scope);
        }
    }
    Ok(spec)
}

/// `sfx` with its positions counted from the start of the base run's capture window
/// (`Base::window`; unchanged without one). A window that does not hold the suffix is
/// an error (the window was planned for other cells).
fn windowed_suffix(base: &Base, sfx: &Suffix) -> Result<Suffix> {
    let Some(w) = &base.window else {
        return Ok(sfx.clone());
    };
    let mut from = Vec::with_capacity(sfx.from.len());
    for &f in &sfx.from {
        if f < w.start || f + sfx.len > w.end {
            return Err(Error::Other(format!(
                "suffix positions {f}..{} lie outside the base run's capture window {}..{}",
                f + sfx.len,
                w.start,
                w.end
            )));
        }
        from.push(f - w.start);
    }
    Ok(Suffix {
        rows: sfx.rows.clone(),
        from,
        len: sfx.len,
    })
}

/// The targets of the rows of a suffix forward, their positions relative to each
/// row's first recomputed position.
fn suffix_targets(prompts: &Prompts, row_prompt: &[usize], sfx: &Suffix) -> Vec<Target> {
    row_prompt
        .iter()
        .zip(&sfx.from)
        .map(|(&p, &f)| {
            let t = &prompts.targets[p];
            Target {
                positions: t.positions.iter().map(|&q| q - f).collect(),
                ..t.clone()
            }
        })
        .collect()
}

/// [`run_chunk`] with the path chosen by the caller (benchmarks, tests).
pub fn run_chunk_with(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    base: &Base,
    cells: &[Cell],
    chunk: &[usize],
    path: ChunkPath,
) -> Result<Vec<Vec<Outcome>>> {
    let rows = chunk_rows(cells, chunk)?;
    let (start, row_prompt) = (rows.start, &rows.row_prompt);
    let device = model.device();
    let resid_all = act_at(&base.cache, &HookPoint::block(start, Site::ResidPre))?;
    let tokens = prompts.tokens_of(row_prompt, &device);
    let (per_point, spec) = chunk_edits(prompts, cells, chunk, &rows);
    let suffix = match (path, &base.state) {
        (ChunkPath::Auto, Some(_)) => plan_suffix(prompts, cells, chunk),
        _ => None,
    };
    if let (Some(w), None) = (&base.window, &suffix) {
        return Err(Error::Other(format!(
            "the base run kept positions {}..{} of its captures only, and this chunk does \
             not run as a suffix forward (give its cells a base run of their own: \
             base_run_for)",
            w.start, w.end
        )));
    }
    let spec = install_replacements(spec, &per_point, base, prompts, row_prompt, suffix.as_ref())?;
    let outcomes = match (&suffix, &base.state) {
        (Some(sfx), Some(state)) => {
            // Each row's suffix positions straight from the base run's prompts, never
            // its whole prompt per row.
            let local = windowed_suffix(base, sfx)?;
            let resid = take_positions(resid_all, row_prompt, &local.from, sfx.len)?;
            let out = model.forward_suffix(start, state, sfx, &resid, &spec)?;
            let shifted = suffix_targets(prompts, row_prompt, sfx);
            readout(out.logits, &shifted.iter().collect::<Vec<_>>())?
        }
        _ => {
            let resid = resid_all.select_batch(row_prompt)?;
            let out = model.forward_from(tokens, start, &resid, &spec)?;
            let targets: Vec<&Target> = row_prompt.iter().map(|&p| &prompts.targets[p]).collect();
            readout(out.logits, &targets)?
        }
    };
    Ok(rows
        .cell_rows
        .into_iter()
        .map(|r| outcomes[r].to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slicing a block of rows at a time gives the rows of slicing them all at once,
    /// with each block's edits renumbered to its rows.
    #[test]
    fn sliced_rows_in_blocks_equal_one_block() {
        let device = Default::default();
        let values: Vec<f32> = (0..3 * 6 * 2).map(|v| v as f32).collect();
        let base = Act::from_vec(values, vec![3, 6, 2], &device).unwrap();
        let row_prompt = [0, 1, 2, 1, 0];
        let edited = [
            RowEdit {
                row: 1,
                prompt: 1,
                fill: RowFill::Own,
                heads: None,
                positions: None,
            },
            RowEdit {
                row: 4,
                prompt: 0,
                fill: RowFill::Own,
                heads: None,
                positions: None,
            },
        ];
        let edits: Vec<&RowEdit> = edited.iter().collect();
        // Edited rows take prompt 2's values (a stand-in for a partner fill).
        let value = |rows: &[usize], edits: &[&RowEdit]| -> Result<Act> {
            let mut idx = rows.to_vec();
            for e in edits {
                idx[e.row] = 2;
            }
            base.select_batch(&idx)
        };
        let sfx = Suffix {
            rows: row_prompt.to_vec(),
            from: vec![0, 3, 1, 2, 4],
            len: 2,
        };
        let all = sliced_rows_by(99, &row_prompt, &edits, &sfx, value).unwrap();
        assert_eq!(all.shape(), &[5, 2, 2]);
        for block in [1, 2, 3] {
            let got = sliced_rows_by(block, &row_prompt, &edits, &sfx, value).unwrap();
            assert_eq!(got.to_vec(), all.to_vec(), "block {block}");
        }
        // Row 1 (edited) reads prompt 2 at positions 3..5; row 3 its own prompt 1.
        let v = all.to_vec();
        assert_eq!(&v[4..8], &[(2 * 12 + 6) as f32, 31.0, 32.0, 33.0]);
        assert_eq!(&v[12..16], &[(12 + 4) as f32, 17.0, 18.0, 19.0]);
        assert_eq!(
            take_positions(&base, &row_prompt, &sfx.from, 2)
                .unwrap()
                .to_vec(),
            slice_positions(&base.select_batch(&row_prompt).unwrap(), &sfx.from, 2)
                .unwrap()
                .to_vec()
        );
    }

    #[test]
    fn positions_resolve() {
        assert_eq!(Positions::All.resolve(&[5]), None);
        assert_eq!(Positions::Answer.resolve(&[5, 6]), Some(vec![5, 6]));
        assert_eq!(Positions::Final(3).resolve(&[5]), Some(vec![3, 4, 5]));
        assert_eq!(Positions::Final(9).resolve(&[2]), Some(vec![0, 1, 2]));
        assert_eq!(Positions::Offset(0).resolve(&[5, 6]), Some(vec![6]));
        assert_eq!(Positions::Offset(2).resolve(&[5]), Some(vec![3]));
        assert_eq!(Positions::Offset(9).resolve(&[5]), Some(vec![]));
    }

    fn cell(layer: usize, n: usize) -> Cell {
        Cell {
            edit: Edit::Replace {
                point: HookPoint::block(layer, Site::AttnZ),
                heads: Some(vec![0]),
                positions: Positions::All,
                fill: Fill::Zero,
            },
            prompts: (0..n).collect(),
        }
    }

    #[test]
    fn chunks_share_a_layer_and_respect_max_rows() {
        let cells = vec![cell(1, 4), cell(0, 4), cell(1, 4), cell(1, 4), cell(0, 10)];
        let chunks = plan_chunks(&cells, 8).unwrap();
        assert_eq!(chunks, vec![vec![1], vec![4], vec![0, 2], vec![3]]);
    }

    #[test]
    fn resample_partner_stays_in_group() {
        let p = Prompts {
            len: 1,
            tokens: vec![0; 5],
            targets: vec![
                Target {
                    positions: vec![0],
                    answers: vec![0],
                    alt: None
                };
                5
            ],
            source: vec![None; 5],
            group: vec![0, 1, 0, 1, 0],
        };
        assert_eq!(p.resample_partner(), vec![2, 3, 4, 1, 0]);
    }
}
