//! `path-patching`: sender head -> receiver head through the receiver's query, key or
//! value input, per source phase (TransformerLens / Wang et al. style).
//!
//! For every phase group r (clean prompts and their corrupted partners, as in
//! patch-heads) and every sender head s (a query head's `hook_z`):
//!
//! 1. **Sender forward**: the receiving prompts run from the sender's layer with the
//!    sender's `hook_z` at `positions` taken from the partner prompt and EVERY other
//!    `hook_z` and every `hook_mlp_out` from that layer on frozen to the receiving
//!    prompt's own base values. The receivers' inputs `hook_q` / `hook_k` / `hook_v` of
//!    the later layers then differ from the base run only by the sender's direct path
//!    through the residual stream; they are captured.
//! 2. **Receiver forward**: for every receiver head and path (q: a query head's slice of
//!    `hook_q`; k, v: a KV head's slice of `hook_k` / `hook_v`), the receiving prompts run
//!    from the receiver's layer with only that slice replaced by its capture from step 1;
//!    everything else is computed normally. Metric: the patch-heads NLD.
//!
//! Both steps are batched: one forward per sender layer (rows = senders x prompts) and one
//! `forward_from` per chunk of cells of the same receiver layer.

use std::collections::BTreeMap;

use burn::tensor::{Bool, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::analysis::effects::nld_of_sums;
use crate::analysis::{Est, accuracy_clusters, per_phase};
use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::LanguageModel;
use crate::output::{HeadKind, HeatmapSpec, LongRow, heatmap};

use super::super::exec::GroupResult;
use super::super::experiment::{Experiment, Selection};
use super::super::heads::{Direction, nld_clusters};
use super::super::patching::{Outcome, Positions, Prompts, Target, base_run, readout};
use super::super::progress::Progress;
use super::super::report::{Figures, push, sym_range};
use super::super::rows::baseline_rows;
use super::{Ctx, Kind, KindOutput, base_obs, empty_list};
use crate::tasks::prompts::{PromptMeta, paired_prompts};

/// The receiver's input a path runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathInput {
    /// The receiver query head's `hook_q`.
    Q,
    /// The receiver KV head's `hook_k`.
    K,
    /// The receiver KV head's `hook_v`.
    V,
}

impl PathInput {
    /// `q`, `k`, `v`.
    pub fn name(self) -> &'static str {
        match self {
            PathInput::Q => "q",
            PathInput::K => "k",
            PathInput::V => "v",
        }
    }

    fn site(self) -> Site {
        match self {
            PathInput::Q => Site::AttnQ,
            PathInput::K => Site::AttnK,
            PathInput::V => Site::AttnV,
        }
    }
}

/// `[path]` (path-patching).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PathPatching {
    /// Layers of the sender heads. Default all.
    pub sender_layers: Selection,
    /// Sender query heads. Default all.
    pub sender_heads: Selection,
    /// Layers of the receiver heads (only those after a sender's layer pair up).
    /// Default all.
    pub receiver_layers: Selection,
    /// Receiver query heads (q path). Default all.
    pub receiver_heads: Selection,
    /// Receiver KV heads (k and v paths). Default all.
    pub receiver_kv_heads: Selection,
    /// Default all three.
    pub paths: Vec<PathInput>,
    /// Default denoising only.
    pub directions: Vec<Direction>,
    /// Positions where the sender is patched. Default all (so that the sender's effect
    /// on the keys and values at the needle's positions counts).
    pub positions: Positions,
}

impl Default for PathPatching {
    fn default() -> Self {
        PathPatching {
            sender_layers: Selection::All,
            sender_heads: Selection::All,
            receiver_layers: Selection::All,
            receiver_heads: Selection::All,
            receiver_kv_heads: Selection::All,
            paths: vec![PathInput::Q, PathInput::K, PathInput::V],
            directions: vec![Direction::Denoise],
            positions: Positions::All,
        }
    }
}

/// The metric of the path from any sender to receiver `(layer, head)` through `input`:
/// `path_nld_denoise_q_L3H1`, `path_nld_denoise_v_L3KV0`.
pub fn path_metric(d: Direction, input: PathInput, layer: usize, head: usize) -> String {
    let h = match input {
        PathInput::Q => format!("H{head}"),
        _ => format!("KV{head}"),
    };
    format!("path_{}_{}_L{layer}{h}", d.metric(), input.name())
}

impl Kind for PathPatching {
    fn name(&self) -> &'static str {
        "path-patching"
    }

    fn section(&self) -> &'static str {
        "path"
    }

    fn default_n_logical(&self) -> usize {
        16
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        empty_list(exp, "path", "paths", self.paths.is_empty())?;
        empty_list(exp, "path", "directions", self.directions.is_empty())
    }

    fn accuracy_series(&self) -> Vec<(&'static str, String)> {
        vec![
            ("clean", "accuracy".to_string()),
            (
                "corrupted (answer = the replaced value)",
                "accuracy_corrupted".to_string(),
            ),
        ]
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(f)
    }
}

/// A sender query head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sender {
    pub layer: usize,
    pub head: usize,
}

/// A receiver: a query head (q) or a KV head (k, v) of a later layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Receiver {
    pub layer: usize,
    pub head: usize,
    pub input: PathInput,
}

/// One path cell: sender index, receiver, direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathCell {
    pub sender: usize,
    pub receiver: Receiver,
    pub direction: Direction,
}

fn resolve(exp: &Experiment, key: &str, sel: &Selection, n: usize) -> Result<Vec<usize>> {
    sel.resolve(n, key).map_err(|e| exp.err("path", key, e))
}

/// `base` rows `rows` with `[.., head, ..]` (axis 2) at `positions` per row taken from
/// `fill` (the same rows): a host mask over `[rows, pos, head, 1]`.
fn splice(
    base: Tensor<4>,
    fill: Tensor<4>,
    heads: &[usize],
    positions: &[Option<Vec<usize>>],
) -> Result<Tensor<4>> {
    let dims = base.dims();
    let [r, t, h, _] = dims;
    if positions.len() != r {
        return Err(Error::Other(format!(
            "path patching: {} position lists for {r} rows",
            positions.len()
        )));
    }
    let mut mask = vec![false; r * t * h];
    for (row, pos) in positions.iter().enumerate() {
        let all: Vec<usize>;
        let pos: &[usize] = match pos {
            Some(p) => p,
            None => {
                all = (0..t).collect();
                &all
            }
        };
        for &p in pos {
            for &q in heads {
                if p >= t || q >= h {
                    return Err(Error::Other(format!(
                        "path patching: position {p} / head {q} outside [{t}, {h}]"
                    )));
                }
                mask[(row * t + p) * h + q] = true;
            }
        }
    }
    let mask = Tensor::<4, Bool>::from_data(TensorData::new(mask, [r, t, h, 1]), &base.device())
        .expand(dims);
    Ok(base.mask_where(mask, fill))
}

fn act4(cache: &ActivationCache, p: &HookPoint, rows: &[usize]) -> Result<Tensor<4>> {
    cache
        .get(p)
        .ok_or_else(|| Error::hook(p.to_string(), "not captured by the base run"))?
        .select_batch(rows)?
        .get::<4>()
}

fn act_rows(cache: &ActivationCache, p: &HookPoint, rows: &[usize]) -> Result<Act> {
    cache
        .get(p)
        .ok_or_else(|| Error::hook(p.to_string(), "not captured by the base run"))?
        .select_batch(rows)
}

/// Base captures of a group: every hook_z and hook_mlp_out from the first sender layer on,
/// the residual entering sender and receiver layers, the receivers' inputs.
fn base_captures(first: usize, last: usize) -> Vec<HookPoint> {
    let mut caps = Vec::new();
    for l in first..=last {
        caps.push(HookPoint::block(l, Site::AttnZ));
        caps.push(HookPoint::block(l, Site::MlpOut));
        caps.push(HookPoint::block(l, Site::ResidPre));
        for s in [Site::AttnQ, Site::AttnK, Site::AttnV] {
            caps.push(HookPoint::block(l, s));
        }
    }
    caps
}

/// Captures of the receivers' inputs per (direction, sender): point -> activation.
type SenderCaptures = BTreeMap<(&'static str, usize), BTreeMap<HookPoint, Act>>;

/// One prompt batch's path patching: the cells and the base run they start from.
struct PathRun<'a> {
    model: &'a dyn LanguageModel,
    prompts: &'a Prompts,
    senders: &'a [Sender],
    cells: &'a [PathCell],
    positions: &'a Positions,
    max_rows: usize,
    cache: &'a ActivationCache,
    /// The last receiver layer.
    last: usize,
}

impl PathRun<'_> {
    /// The receiving prompts of a direction: the corrupted ones for denoising, the clean
    /// ones for noising.
    fn receiving(&self, d: Direction) -> Vec<usize> {
        let (n2, n) = (self.prompts.n(), self.prompts.n() / 2);
        match d {
            Direction::Denoise => (n..n2).collect(),
            Direction::Noise => (0..n).collect(),
        }
    }

    /// Step 1: per direction and sender layer, rows = senders x receiving prompts;
    /// captures of the receivers' inputs per (direction, sender).
    fn sender_captures(&self) -> Result<SenderCaptures> {
        let mut dirs: Vec<Direction> = self.cells.iter().map(|c| c.direction).collect();
        dirs.dedup();
        dirs.sort_by_key(|d| d.metric());
        dirs.dedup();
        let mut captured = SenderCaptures::new();
        for &d in &dirs {
            let recv = self.receiving(d);
            let mut by_layer: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for (si, s) in self.senders.iter().enumerate() {
                if self
                    .cells
                    .iter()
                    .any(|c| c.sender == si && c.direction == d)
                {
                    by_layer.entry(s.layer).or_default().push(si);
                }
            }
            for (ls, list) in by_layer {
                let per_chunk = (self.max_rows / recv.len().max(1)).max(1);
                for chunk in list.chunks(per_chunk) {
                    self.sender_forward(d, ls, chunk, &recv, &mut captured)?;
                }
            }
        }
        Ok(captured)
    }

    /// One sender forward from layer `ls` for the senders `chunk` over the receiving
    /// prompts `recv`; its captures of the later layers' q / k / v go to `captured`.
    fn sender_forward(
        &self,
        d: Direction,
        ls: usize,
        chunk: &[usize],
        recv: &[usize],
        captured: &mut SenderCaptures,
    ) -> Result<()> {
        let rows: Vec<usize> = chunk.iter().flat_map(|_| recv.iter().copied()).collect();
        let tokens = self.prompts.tokens_of(&rows, &self.model.device());
        let resid = act_rows(self.cache, &HookPoint::block(ls, Site::ResidPre), &rows)?;
        let spec = self.sender_spec(ls, chunk, recv, &rows)?;
        let out = self.model.forward_from(tokens, ls, &resid, &spec)?;
        let k = recv.len();
        for (ci, &si) in chunk.iter().enumerate() {
            let sel: Vec<usize> = (ci * k..(ci + 1) * k).collect();
            let mut m = BTreeMap::new();
            for l in ls + 1..=self.last {
                for s in [Site::AttnQ, Site::AttnK, Site::AttnV] {
                    let p = HookPoint::block(l, s);
                    let a = out.cache.get(&p).ok_or_else(|| {
                        Error::hook(
                            p.to_string(),
                            "the sender forward did not produce this activation",
                        )
                    })?;
                    m.insert(p, a.select_batch(&sel)?);
                }
            }
            captured.insert((d.metric(), si), m);
        }
        Ok(())
    }

    /// The hooks of a sender forward: at the sender's layer the base z with each row's
    /// sender head from the partner; every other hook_z and every MLP output from that
    /// layer on frozen; the later layers' q / k / v captured.
    fn sender_spec(
        &self,
        ls: usize,
        chunk: &[usize],
        recv: &[usize],
        rows: &[usize],
    ) -> Result<HookSpec> {
        let (cache, n2) = (self.cache, self.prompts.n());
        let partner = |p: usize| (p + n2 / 2) % n2;
        let mut spec = HookSpec::new();
        // The sender's layer: base z with each row's sender head from the partner.
        let zp = HookPoint::block(ls, Site::AttnZ);
        let base_z = act4(cache, &zp, rows)?;
        let partner_rows: Vec<usize> = rows.iter().map(|&p| partner(p)).collect();
        let fill = act4(cache, &zp, &partner_rows)?;
        let mut blocks = Vec::new();
        let k = recv.len();
        for (ci, &si) in chunk.iter().enumerate() {
            let b = base_z.clone().slice_dim(0, ci * k..(ci + 1) * k);
            let f = fill.clone().slice_dim(0, ci * k..(ci + 1) * k);
            let pos: Vec<Option<Vec<usize>>> = recv
                .iter()
                .map(|&p| self.positions.resolve(&self.prompts.targets[p].positions))
                .collect();
            blocks.push(splice(b, f, &[self.senders[si].head], &pos)?);
        }
        spec = spec.intervene_point(
            zp,
            Action::Replace(Act::new(Tensor::cat(blocks, 0))),
            Scope::all(),
        );
        // Freeze every other hook_z and every MLP output from the sender's layer on.
        for l in ls..=self.last {
            if l > ls {
                let p = HookPoint::block(l, Site::AttnZ);
                spec = spec.intervene_point(
                    p,
                    Action::Replace(act_rows(cache, &p, rows)?),
                    Scope::all(),
                );
            }
            let p = HookPoint::block(l, Site::MlpOut);
            spec =
                spec.intervene_point(p, Action::Replace(act_rows(cache, &p, rows)?), Scope::all());
        }
        for l in ls + 1..=self.last {
            for s in [Site::AttnQ, Site::AttnK, Site::AttnV] {
                spec = spec.capture_point(HookPoint::block(l, s));
            }
        }
        Ok(spec)
    }

    /// Step 2: per receiver layer, chunks of cells; rows = cells x receiving prompts.
    /// One outcome per receiving prompt of every cell.
    fn receiver_outcomes(
        &self,
        captured: &SenderCaptures,
        progress: &mut Progress,
    ) -> Result<Vec<Vec<Outcome>>> {
        let k = self.prompts.n() / 2;
        let mut results: Vec<Vec<Outcome>> = vec![Vec::new(); self.cells.len()];
        let mut by_layer: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, c) in self.cells.iter().enumerate() {
            by_layer.entry(c.receiver.layer).or_default().push(i);
        }
        for (lr, list) in by_layer {
            let per_chunk = (self.max_rows / k.max(1)).max(1);
            for chunk in list.chunks(per_chunk) {
                let o = self.receiver_forward(lr, chunk, captured)?;
                for (ci, &c) in chunk.iter().enumerate() {
                    results[c] = o[ci * k..(ci + 1) * k].to_vec();
                }
                progress.inc(chunk.len() as u64);
            }
        }
        Ok(results)
    }

    /// One receiver forward from layer `lr` for the cells `chunk`: each cell's receiver
    /// slice replaced by its capture from the sender forward; the outcomes of its rows.
    fn receiver_forward(
        &self,
        lr: usize,
        chunk: &[usize],
        captured: &SenderCaptures,
    ) -> Result<Vec<Outcome>> {
        let (cells, k) = (self.cells, self.prompts.n() / 2);
        let rows: Vec<usize> = chunk
            .iter()
            .flat_map(|&c| self.receiving(cells[c].direction))
            .collect();
        let tokens = self.prompts.tokens_of(&rows, &self.model.device());
        let resid = act_rows(self.cache, &HookPoint::block(lr, Site::ResidPre), &rows)?;
        let mut spec = HookSpec::new();
        let inputs: Vec<PathInput> = {
            let mut v: Vec<PathInput> = chunk.iter().map(|&c| cells[c].receiver.input).collect();
            v.sort();
            v.dedup();
            v
        };
        for input in inputs {
            let p = HookPoint::block(lr, input.site());
            let mut blocks = Vec::new();
            for (ci, &c) in chunk.iter().enumerate() {
                let cell = &cells[c];
                let b = act4(self.cache, &p, &rows[ci * k..(ci + 1) * k])?;
                if cell.receiver.input != input {
                    blocks.push(b);
                    continue;
                }
                let fill = captured[&(cell.direction.metric(), cell.sender)]
                    .get(&p)
                    .ok_or_else(|| Error::hook(p.to_string(), "no capture of the sender forward"))?
                    .get::<4>()?;
                blocks.push(splice(b, fill, &[cell.receiver.head], &vec![None; k])?);
            }
            spec = spec.intervene_point(
                p,
                Action::Replace(Act::new(Tensor::cat(blocks, 0))),
                Scope::all(),
            );
        }
        let out = self.model.forward_from(tokens, lr, &resid, &spec)?;
        let targets: Vec<&Target> = rows.iter().map(|&p| &self.prompts.targets[p]).collect();
        readout(out.logits, &targets)
    }
}

/// Evaluate path cells on one prompt batch (clean `0..n`, corrupted partners `n..2n`).
/// Returns the base outcomes (every prompt) and, per cell, one outcome per receiving
/// prompt (the corrupted prompts for denoising, the clean ones for noising).
pub fn path_group(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    senders: &[Sender],
    cells: &[PathCell],
    positions: &Positions,
    max_rows: usize,
    progress: &mut Progress,
) -> Result<(Vec<Outcome>, Vec<Vec<Outcome>>)> {
    let first = senders.iter().map(|s| s.layer).min().unwrap_or(0);
    let last = cells.iter().map(|c| c.receiver.layer).max().unwrap_or(0);
    let base = base_run(model, prompts, &base_captures(first, last))?;
    let run = PathRun {
        model,
        prompts,
        senders,
        cells,
        positions,
        max_rows,
        cache: &base.cache,
        last,
    };
    let captured = run.sender_captures()?;
    let results = run.receiver_outcomes(&captured, progress)?;
    Ok((base.outcomes.clone(), results))
}

/// The senders and the path cells of a run: per direction, sender, later receiver layer,
/// receiver input and receiver head.
struct Paths {
    senders: Vec<Sender>,
    cells: Vec<PathCell>,
}

/// The senders and cells the settings select; an error when no receiver layer comes
/// after a sender layer.
fn select_paths(cfg: &PathPatching, ctx: &Ctx) -> Result<Paths> {
    let exp = ctx.exp;
    let nl = ctx.info.n_layers();
    let s_layers = resolve(exp, "sender_layers", &cfg.sender_layers, nl)?;
    let r_layers = resolve(exp, "receiver_layers", &cfg.receiver_layers, nl)?;
    let mut senders = Vec::new();
    for &l in &s_layers {
        for h in resolve(
            exp,
            "sender_heads",
            &cfg.sender_heads,
            ctx.info.layers[l].n_heads,
        )? {
            senders.push(Sender { layer: l, head: h });
        }
    }
    let mut cells = Vec::new();
    for &d in &cfg.directions {
        for (si, s) in senders.iter().enumerate() {
            for &lr in r_layers.iter().filter(|&&l| l > s.layer) {
                let spec = &ctx.info.layers[lr];
                for &input in &cfg.paths {
                    let (key, sel, n) = match input {
                        PathInput::Q => ("receiver_heads", &cfg.receiver_heads, spec.n_heads),
                        _ => ("receiver_kv_heads", &cfg.receiver_kv_heads, spec.n_kv_heads),
                    };
                    for h in resolve(exp, key, sel, n)? {
                        cells.push(PathCell {
                            sender: si,
                            receiver: Receiver {
                                layer: lr,
                                head: h,
                                input,
                            },
                            direction: d,
                        });
                    }
                }
            }
        }
    }
    if cells.is_empty() {
        return Err(exp.err(
            "path",
            "receiver_layers",
            "no receiver layer comes after a sender layer: no path to patch",
        ));
    }
    Ok(Paths { senders, cells })
}

/// Every phase group's prompt metadata and outcomes (from the store, or computed and
/// stored).
fn path_groups(
    cfg: &PathPatching,
    ctx: &mut Ctx,
    paths: &Paths,
) -> Result<(Vec<Vec<PromptMeta>>, Vec<GroupResult>)> {
    let cells = &paths.cells;
    let set = ctx.eval_set()?;
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let phases = ctx.task.phases.clone();
    let mut progress = Progress::new(
        ctx.opts.progress,
        &format!("{} path-patching", ctx.mref.name),
        "cells",
        (cells.len() * phases.len()) as u64,
    );
    let t0 = std::time::Instant::now();
    let mut metas = Vec::new();
    let mut results = Vec::new();
    for &r in &phases {
        let ex = ctx.examples(&set, r);
        let n = ex.len();
        let (prompts, meta) = paired_prompts(
            &ex,
            &ctx.task.space,
            assign,
            ctx.task.prompt.key_len,
            ctx.task.seed,
        )?;
        let key = format!("p{r}-path");
        let mut expected = vec![n; cells.len()];
        expected.push(2 * n);
        let res = match ctx.store.load(&key, &expected)? {
            Some(mut v) => {
                progress.skip(cells.len() as u64);
                ctx.stats.cells_resumed += cells.len() as u64;
                let base = v.pop().expect("the base vector was expected");
                GroupResult { base, cells: v }
            }
            None => {
                let (base, out) = path_group(
                    ctx.model,
                    &prompts,
                    &paths.senders,
                    cells,
                    &cfg.positions,
                    ctx.max_rows,
                    &mut progress,
                )?;
                let mut save = out.clone();
                save.push(base.clone());
                ctx.store.save(&key, &save)?;
                ctx.stats.cells_computed += cells.len() as u64;
                GroupResult { base, cells: out }
            }
        };
        metas.push(meta);
        results.push(res);
    }
    progress.finish();
    ctx.stats.seconds += t0.elapsed().as_secs_f64();
    Ok((metas, results))
}

/// Clean and corrupted accuracy rows, from the base outcomes of every group.
fn baseline(ctx: &Ctx, metas: &[Vec<PromptMeta>], results: &[GroupResult]) -> Vec<LongRow> {
    let mut acc = Vec::new();
    let mut acc_corrupt = Vec::new();
    for (meta, res) in metas.iter().zip(results) {
        acc.extend(base_obs(meta, res));
        let n = meta.len() / 2;
        for (i, m) in meta.iter().take(n).enumerate() {
            acc_corrupt.push((m.logical, m.phase, res.base[n + i].correct));
        }
    }
    let (p, phases) = (ctx.p(), &ctx.task.phases);
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = &ctx.rows;
    let mut rows: Vec<LongRow> =
        baseline_rows(rc, "", &accuracy_clusters(p, acc), phases, reps, seed);
    rows.extend(baseline_rows(
        rc,
        "_corrupted",
        &accuracy_clusters(p, acc_corrupt),
        phases,
        reps,
        seed,
    ));
    rows
}

/// The NLD rows of every path cell (at the sender head, per phase and pooled).
fn cell_rows(
    ctx: &Ctx,
    paths: &Paths,
    metas: &[Vec<PromptMeta>],
    results: &[GroupResult],
) -> Vec<LongRow> {
    let (p, phases) = (ctx.p(), &ctx.task.phases);
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let mut rows = Vec::new();
    for (ci, cell) in paths.cells.iter().enumerate() {
        let c = nld_clusters(metas, results, ci, cell.direction, p);
        let (per, pooled) = per_phase(&c, nld_of_sums, reps, seed);
        let s = paths.senders[cell.sender];
        let metric = path_metric(
            cell.direction,
            cell.receiver.input,
            cell.receiver.layer,
            cell.receiver.head,
        );
        let at = Some((s.layer as u32, Some((s.head as u32, HeadKind::Query))));
        rows.extend(ctx.rows.phase_rows(&metric, at, phases, &per, pooled));
    }
    rows
}

fn run(cfg: &PathPatching, ctx: &mut Ctx) -> Result<KindOutput> {
    let paths = select_paths(cfg, ctx)?;
    let (metas, results) = path_groups(cfg, ctx, &paths)?;
    let mut rows = baseline(ctx, &metas, &results);
    rows.extend(cell_rows(ctx, &paths, &metas, &results));
    rows.push(ctx.rows.row(
        "path_cells",
        Est {
            value: paths.cells.len() as f64,
            ci: None,
            n: ctx.task.phases.len() as u64,
        },
    ));
    Ok(KindOutput {
        tables: vec![("paths".into(), rows)],
    })
}

/// metric -> (sender layer, head) -> phase (None: pooled) -> value.
type PathValues = BTreeMap<String, BTreeMap<(u32, u32), BTreeMap<Option<u32>, f64>>>;

/// Figures: per receiver input with the strongest feed, a sender x phase heatmap; a
/// table of the strongest paths.
fn draw(f: &mut Figures) -> Result<()> {
    let (d, m) = (f.data, f.model.clone());
    let m = m.as_str();
    f.report
        .section("Path patching: sender head -> receiver head (q / k / v)");
    f.report.paragraph(
        "Each row is a sender query head whose hook_z is patched from the partner prompt, with every other \
         head's hook_z and every MLP output frozen to the receiving prompt's own values, so that the receivers' \
         query/key/value inputs change only through the sender's direct path; then only the receiver head's \
         hook_q (query heads) or hook_k / hook_v (KV heads) is replaced by that value in an otherwise normal run. \
         Metric: the patch-heads NLD (denoising: 1 = the path alone restores the clean answer). Metric names: \
         path_nld_<direction>_<q|k|v>_L<layer>H<head> (KV heads: KV<head>); the sender is in the layer/head columns.",
    );
    // metric -> (sender label, phase) -> value
    let mut by_metric: PathValues = BTreeMap::new();
    for r in d
        .rows
        .iter()
        .filter(|r| r.model == m && r.metric.starts_with("path_nld_"))
    {
        if let (Some(l), Some(h)) = (r.layer, r.head) {
            by_metric
                .entry(r.metric.clone())
                .or_default()
                .entry((l, h))
                .or_default()
                .insert(r.phase, r.value);
        }
    }
    strongest_heatmaps(f, &by_metric)?;
    strongest_paths(f, &by_metric);
    Ok(())
}

/// Sender x phase heatmaps of the six receivers with the largest pooled |NLD|.
fn strongest_heatmaps(f: &mut Figures, by_metric: &PathValues) -> Result<()> {
    let (m, phases, dir) = (f.model.clone(), f.phases.clone(), f.dir);
    let mut strength: Vec<(f64, String)> = by_metric
        .iter()
        .map(|(k, v)| {
            let s = v
                .values()
                .filter_map(|p| p.get(&None))
                .filter(|x| x.is_finite())
                .fold(0.0f64, |a, x| a.max(x.abs()));
            (s, k.clone())
        })
        .collect();
    strength.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, metric) in strength.iter().take(6) {
        let senders = &by_metric[metric];
        let mut cols: Vec<Option<u32>> = phases.iter().map(|&p| Some(p)).collect();
        cols.push(None);
        let matrix: Vec<Vec<f64>> = senders
            .values()
            .map(|v| {
                cols.iter()
                    .map(|c| v.get(c).copied().unwrap_or(f64::NAN))
                    .collect()
            })
            .collect();
        let spec = HeatmapSpec {
            range: sym_range(matrix.iter().flatten().copied()),
            matrix,
            row_labels: senders.keys().map(|(l, h)| format!("L{l}H{h}")).collect(),
            col_labels: cols
                .iter()
                .map(|c| c.map_or("all".to_string(), |p| p.to_string()))
                .collect(),
            title: format!("{m}: {metric} per sender x source phase"),
            x_label: "source phase".into(),
            y_label: "sender head".into(),
            colorbar_label: "normalised logit difference".into(),
            diverging: true,
            annotate: true,
            size: None,
        };
        let fig = heatmap(dir.join(metric), &spec)?;
        push(
            &mut f.files,
            &mut f.report,
            &format!("{metric}: per sender head x source phase"),
            fig,
        );
    }
    Ok(())
}

/// The strongest paths (pooled), with their per-phase values.
fn strongest_paths(f: &mut Figures, by_metric: &PathValues) {
    let phases = &f.phases;
    let mut edges: Vec<(f64, Vec<String>)> = Vec::new();
    for (metric, senders) in by_metric {
        let receiver = metric.trim_start_matches("path_");
        for ((l, h), v) in senders {
            let pooled = v.get(&None).copied().unwrap_or(f64::NAN);
            if !pooled.is_finite() {
                continue;
            }
            let per: Vec<String> = phases
                .iter()
                .map(|p| v.get(&Some(*p)).map_or("n/a".into(), |x| format!("{x:.2}")))
                .collect();
            edges.push((
                pooled,
                vec![
                    format!("L{l}H{h}"),
                    receiver.to_string(),
                    format!("{pooled:.3}"),
                    per.join(" "),
                ],
            ));
        }
    }
    edges.sort_by(|a, b| b.0.abs().total_cmp(&a.0.abs()));
    if !edges.is_empty() {
        f.report.table(
            format!("Strongest paths (|NLD| pooled over phases; per phase {phases:?})"),
            vec![
                "sender".into(),
                "receiver (direction_input_layer.head)".into(),
                "NLD all".into(),
                "NLD per phase".into(),
            ],
            edges.into_iter().take(12).map(|e| e.1).collect(),
        );
    }
}
