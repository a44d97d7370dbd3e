//! `attribution-patching`: AtP, the gradient estimate of every head's activation
//! patching effect, checked against exact patching.
//!
//! For every phase group r, the clean prompts and their corrupted versions run ONCE
//! together on an autodiff device view: at every selected layer a zero tensor that
//! requires a gradient is added to `hook_z` (`Action::Add`; the model's weights stay
//! constants), and ONE backward of the summed logit differences gives
//! `dLD / dz` for every prompt, position and head. The estimated change of a prompt's
//! logit difference when head h's `hook_z` at position t is patched from its partner
//! prompt is the first-order term
//!
//! ```text
//! dLD(h, t) ~ (z_partner[t, h] - z[t, h]) . dLD/dz[t, h]
//! ```
//!
//! (denoising: the gradient of the corrupted prompt's LD in the clean orientation;
//! noising: of the clean prompt's). Estimates add over positions and over the query
//! heads of a KV head, so one backward gives every head x position cell. The estimate
//! of the normalised logit difference is the patch-heads NLD with `LD_patched`
//! replaced by `LD_base + sum dLD`, a ratio of sums over the group.
//!
//! With `validate = true` the same cells run through the runner's exact batched
//! patching (what patch-heads computes), and per phase the agreement of estimate and
//! exact effect over the heads is written: Spearman rank correlation and top-k recall.

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::analysis::effects::nld_of_sums;
use crate::analysis::{Clusters, Est, accuracy_clusters, per_phase, spearman, topk_recall};
use crate::error::{Error, Result};
use crate::output::{
    HeadKind, Headline, HeatmapSpec, LongRow, ScatterSpec, heatmap, scatter_predicted_vs_observed,
};

use super::super::exec::{Group, GroupResult};
use super::super::experiment::{Experiment, Selection};
use super::super::heads::{Direction, head_patch_cells, nld_clusters};
use super::super::patching::{Cell, Outcome, Positions, Prompts};
use super::super::report::{
    ColourScale, ExperimentData, Figures, HeadGrid, cell_map, head_axes, layer_head_heatmap,
    paired_series, sym_range,
};
use super::super::rows::{RowCtx, baseline_rows};
use super::super::setup;
use super::{Ctx, HeadCell, Kind, KindOutput, base_obs, empty_list, head_cells};
use crate::tasks::prompts::{PromptMeta, paired_prompts};

mod atp;
pub mod atp_star;

pub use atp::atp_terms;
use atp::group_terms;

/// `[atp]` (attribution-patching).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AttributionPatching {
    /// Layers whose heads are estimated. Default all.
    pub layers: Selection,
    /// Query heads (for `query` cells). Default all.
    pub heads: Selection,
    /// KV heads (for `kv` cells; the sum over the query heads that read the KV head).
    /// Default all.
    pub kv_heads: Selection,
    /// Which cells. Default both.
    pub head_kinds: Vec<HeadKind>,
    /// Default both.
    pub directions: Vec<Direction>,
    /// Positions of the head-level estimate (and of the exact cells it is checked
    /// against). Default `answer`.
    pub positions: Positions,
    /// Per-position estimates for the last `position_band` positions up to the read
    /// position (offset 0 = the read position). Default 8; 0 = none.
    pub position_band: usize,
    /// Run the exact head-level patching too and write the agreement. Default true.
    pub validate: bool,
    /// Also patch every head at every offset of the band exactly (head x position
    /// cells, `position_band` times the head-level cost). Default false.
    pub validate_positions: bool,
    /// k of the top-k recall. Default 3.
    pub top_k: usize,
    /// Also estimate the query and key nodes of every head (hook_q per query head,
    /// key slots per KV head) with AtP and with AtP* (the exact attention-pattern
    /// change; [`atp_star`]), checked against exact patching of hook_q / hook_k.
    /// Default false.
    pub qk_fix: bool,
}

impl Default for AttributionPatching {
    fn default() -> Self {
        AttributionPatching {
            layers: Selection::All,
            heads: Selection::All,
            kv_heads: Selection::All,
            head_kinds: vec![HeadKind::Query, HeadKind::Kv],
            directions: vec![Direction::Denoise, Direction::Noise],
            positions: Positions::Answer,
            position_band: 8,
            validate: true,
            validate_positions: false,
            top_k: 3,
            qk_fix: false,
        }
    }
}

/// Metric of the AtP estimate of a direction's NLD (`atp_nld_denoise`).
pub fn atp_metric(d: Direction) -> String {
    format!("atp_{}", d.metric())
}

/// Suffix of a per-position metric (`_offset3`: three positions before the read one).
pub fn offset_suffix(o: usize) -> String {
    format!("_offset{o}")
}

/// Metric of an agreement statistic (`spearman`, `recall_top3`) over heads of `kind`.
pub fn agreement_metric(stat: &str, d: Direction, kind: HeadKind) -> String {
    format!("{stat}_{}_{}", d.metric(), kind.as_str())
}

impl Kind for AttributionPatching {
    fn name(&self) -> &'static str {
        "attribution-patching"
    }

    fn section(&self) -> &'static str {
        "atp"
    }

    fn default_n_logical(&self) -> usize {
        32
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        empty_list(exp, "atp", "head_kinds", self.head_kinds.is_empty())?;
        empty_list(exp, "atp", "directions", self.directions.is_empty())?;
        if self.top_k == 0 {
            return Err(exp.err("atp", "top_k", "must be at least 1"));
        }
        if self.position_band > crate::tasks::MAX_HAYSTACK_LEN {
            return Err(exp.err(
                "atp",
                "position_band",
                format!(
                    "{} offsets is more than the longest prompt any task makes ({} tokens)",
                    self.position_band,
                    crate::tasks::MAX_HAYSTACK_LEN
                ),
            ));
        }
        if self.validate_positions && self.position_band == 0 {
            return Err(exp.err(
                "atp",
                "validate_positions",
                "needs position_band >= 1 (the offsets it patches)",
            ));
        }
        Ok(())
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
        draw(self, f)
    }
}

/// AtP terms of one prompt batch of clean prompts `0..n` and their corrupted partners
/// `n..2n` ([`paired_prompts`]).
#[derive(Debug, Clone)]
pub struct AtpTerms {
    /// Outcomes of the plain forward of every prompt (the values are those of a
    /// forward without hooks).
    pub base: Vec<Outcome>,
    /// Clean prompts per batch (`n`).
    pub n: usize,
    /// Tokens per prompt.
    pub len: usize,
    /// Per direction (in the order asked), per layer (in the order asked): the
    /// estimated change of the clean-orientation LD, `[n, len, n_heads]` row-major.
    pub terms: Vec<Vec<Vec<f32>>>,
    /// Query heads per layer (the last axis of `terms`).
    pub heads: Vec<usize>,
}

impl AtpTerms {
    /// Estimate for prompt `i` (0..n), layer index `li`, direction index `di`: the sum
    /// of the terms over `heads` and `positions`.
    pub fn sum(&self, di: usize, li: usize, i: usize, heads: &[usize], positions: &[usize]) -> f64 {
        let h = self.heads[li];
        let t = &self.terms[di][li];
        let mut s = 0.0f64;
        for &p in positions {
            for &q in heads {
                s += t[(i * self.len + p) * h + q] as f64;
            }
        }
        s
    }
}

/// The loss weights of the clean-orientation logit differences: denoising reads the
/// corrupted prompts (weight -1), noising the clean ones (+1).
pub(super) fn weights(n: usize, directions: &[Direction]) -> Vec<f32> {
    let mut w = vec![0f32; 2 * n];
    for d in directions {
        match d {
            Direction::Denoise => w[n..].iter_mut().for_each(|w| *w = -1.0),
            Direction::Noise => w[..n].iter_mut().for_each(|w| *w = 1.0),
        }
    }
    w
}

/// The summed weighted logit differences of `logits: [2n, T, V]` at every prompt's first
/// target position.
pub(super) fn weighted_ld(logits: Tensor<3>, prompts: &Prompts, w: Vec<f32>) -> Result<Tensor<1>> {
    let [n2, t, v] = logits.dims();
    let device = logits.device();
    let mut flat = Vec::with_capacity(n2);
    let mut pairs = Vec::with_capacity(2 * n2);
    for (i, tg) in prompts.targets.iter().enumerate() {
        let alt = tg.alt.ok_or_else(|| {
            Error::Other(format!(
                "prompt {i} has no competing answer (alt) for the logit difference"
            ))
        })?;
        if tg.answers[0] as usize >= v || alt as usize >= v {
            return Err(Error::Input(format!(
                "answer token {} / {alt} is outside the model's vocabulary 0..{v}",
                tg.answers[0]
            )));
        }
        flat.push((i * t + tg.positions[0]) as i64);
        pairs.push(tg.answers[0] as i64);
        pairs.push(alt as i64);
    }
    let idx = Tensor::<1, Int>::from_data(TensorData::new(flat, [n2]), &device);
    let pairs = Tensor::<2, Int>::from_data(TensorData::new(pairs, [n2, 2]), &device);
    let g = logits.reshape([n2 * t, v]).select(0, idx).gather(1, pairs);
    let ld = g.clone().slice([0..n2, 0..1]) - g.slice([0..n2, 1..2]);
    let w = Tensor::<2>::from_data(TensorData::new(w, [n2, 1]), &device);
    Ok((ld * w).sum())
}

/// (direction, head cell, offset or None) -> per-phase values and the pooled value.
type CellVals = BTreeMap<(usize, usize, Option<usize>), (Vec<f64>, f64)>;

/// Where a row sits, as [`RowCtx::phase_rows`] takes it: layer and (head, kind).
pub(super) type At = Option<(u32, Option<(u32, HeadKind)>)>;

/// The per-phase and pooled NLD rows of a run's clustered logit differences.
pub(super) struct NldRows {
    pub rc: RowCtx,
    pub phases: Vec<u32>,
    pub reps: usize,
    pub seed: u64,
}

impl NldRows {
    /// The run's row context, phases and bootstrap settings.
    pub(super) fn new(ctx: &Ctx) -> Self {
        NldRows {
            rc: ctx.rows.clone(),
            phases: ctx.task.phases.clone(),
            reps: ctx.reps(),
            seed: ctx.seed(),
        }
    }

    /// Append the rows of `metric` (the NLD of `c` per phase and pooled) and return
    /// their values.
    pub(super) fn push(
        &self,
        c: &Clusters<3>,
        metric: &str,
        at: At,
        rows: &mut Vec<LongRow>,
    ) -> (Vec<f64>, f64) {
        let (per, pooled) = per_phase(c, nld_of_sums, self.reps, self.seed);
        rows.extend(self.rc.phase_rows(metric, at, &self.phases, &per, pooled));
        (per.iter().map(|e| e.value).collect(), pooled.value)
    }
}

/// Spearman, top-k recall and mean absolute error of `est` against `exact` as rows
/// named `metric(stat)`, at phase `ph` (None: pooled).
pub(super) fn agreement_stats(
    rc: &RowCtx,
    top_k: usize,
    metric: impl Fn(&str) -> String,
    ph: Option<u32>,
    est: &[f64],
    exact: &[f64],
) -> Vec<LongRow> {
    let n = est.len() as u64;
    let sp = spearman(est, exact).ok().flatten().unwrap_or(f64::NAN);
    let rec = topk_recall(est, exact, top_k).unwrap_or(f64::NAN);
    let mae = if est.is_empty() {
        f64::NAN
    } else {
        est.iter()
            .zip(exact)
            .map(|(a, b)| (a - b).abs())
            .sum::<f64>()
            / n as f64
    };
    [
        ("spearman".to_string(), sp),
        (format!("recall_top{top_k}"), rec),
        ("mae".to_string(), mae),
    ]
    .into_iter()
    .map(|(stat, v)| {
        let row = rc.row(
            metric(&stat),
            Est {
                value: v,
                ci: None,
                n,
            },
        );
        match ph {
            Some(ph) => row.at_phase(ph),
            None => row,
        }
    })
    .collect()
}

/// The AtP terms of every phase group, with the prompts and metadata they came from.
struct AtpGroups {
    metas: Vec<Vec<PromptMeta>>,
    prompts: Vec<Prompts>,
    terms: Vec<AtpTerms>,
    /// Wall time of the AtP passes.
    seconds: f64,
}

/// AtP: one forward + one backward per phase group (or its stored terms).
fn atp_groups(ctx: &mut Ctx, layers: &[usize], dirs: &[Direction]) -> Result<AtpGroups> {
    let set = ctx.eval_set()?;
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let mut g = AtpGroups {
        metas: Vec::new(),
        prompts: Vec::new(),
        terms: Vec::new(),
        seconds: 0.0,
    };
    let phases_run = ctx.task.phases.clone();
    let label = format!("{} attribution-patching (AtP)", ctx.mref.name);
    let mut progress = super::super::progress::Progress::new(
        ctx.opts.progress,
        &label,
        "groups",
        phases_run.len() as u64,
    );
    let t0 = std::time::Instant::now();
    for &r in &phases_run {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = paired_prompts(
            &ex,
            &ctx.task.space,
            assign,
            ctx.task.prompt.key_len,
            ctx.task.seed,
        )?;
        let terms = group_terms(ctx, r, &prompts, layers, dirs)?;
        progress.inc(1);
        g.metas.push(meta);
        g.prompts.push(prompts);
        g.terms.push(terms);
    }
    progress.finish();
    g.seconds = t0.elapsed().as_secs_f64();
    Ok(g)
}

/// The exact cells of a group of `n` pairs: per position set (the kind's positions,
/// then with `validate_positions` each offset of the band), direction and head.
fn exact_cells(cfg: &AttributionPatching, heads: &[HeadCell], n: usize) -> Vec<Cell> {
    let mut positions = vec![cfg.positions.clone()];
    if cfg.validate_positions {
        positions.extend((0..cfg.position_band).map(Positions::Offset));
    }
    positions
        .iter()
        .flat_map(|pos| head_patch_cells(&cfg.directions, heads, pos, n))
        .collect()
}

/// Exact patching of the estimated cells in every phase group, and its wall time.
fn exact_patching(
    cfg: &AttributionPatching,
    ctx: &mut Ctx,
    heads: &[HeadCell],
    prompts: &[Prompts],
) -> Result<(Vec<GroupResult>, f64)> {
    let groups: Vec<Group> = prompts
        .iter()
        .zip(&ctx.task.phases)
        .map(|(prompts, &r)| Group {
            key: format!("p{r}"),
            prompts: prompts.clone(),
            cells: exact_cells(cfg, heads, prompts.n() / 2),
        })
        .collect();
    let t1 = std::time::Instant::now();
    let res = ctx.execute(&format!("{} exact patching", ctx.mref.name), &groups)?;
    Ok((res, t1.elapsed().as_secs_f64()))
}

/// Clean and corrupted accuracy rows, from the outcomes of the AtP forwards.
fn baseline(ctx: &Ctx, g: &AtpGroups) -> Vec<LongRow> {
    let mut acc = Vec::new();
    let mut acc_corrupt = Vec::new();
    for (meta, terms) in g.metas.iter().zip(&g.terms) {
        let res = GroupResult {
            base: terms.base.clone(),
            cells: Vec::new(),
        };
        acc.extend(base_obs(meta, &res));
        let n = terms.n;
        for (i, m) in meta.iter().take(n).enumerate() {
            acc_corrupt.push((m.logical, m.phase, terms.base[n + i].correct));
        }
    }
    let p = ctx.p();
    let phases = ctx.task.phases.clone();
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let mut rows: Vec<LongRow> =
        baseline_rows(&rc, "", &accuracy_clusters(p, acc), &phases, reps, seed);
    rows.extend(baseline_rows(
        &rc,
        "_corrupted",
        &accuracy_clusters(p, acc_corrupt),
        &phases,
        reps,
        seed,
    ));
    rows
}

/// What the estimate, exact, agreement and speed rows of a run share.
struct CellRows<'a> {
    cfg: &'a AttributionPatching,
    heads: &'a [HeadCell],
    groups: &'a AtpGroups,
    /// Layer -> its index in the terms.
    layer_index: BTreeMap<usize, usize>,
    /// Offsets of the position band.
    offsets: Vec<usize>,
    nld: NldRows,
    p: usize,
}

impl CellRows<'_> {
    /// Position sets patched exactly: the kind's positions, and the band's offsets with
    /// `validate_positions`.
    fn n_pos_sets(&self) -> usize {
        1 + if self.cfg.validate_positions {
            self.offsets.len()
        } else {
            0
        }
    }

    /// Estimate rows (head level and every offset of the band) and, with `exact`, exact
    /// rows per direction x head; the values of both.
    fn cell_rows(
        &self,
        exact: Option<&[GroupResult]>,
        rows: &mut Vec<LongRow>,
    ) -> (CellVals, CellVals) {
        let mut est_vals: CellVals = BTreeMap::new();
        let mut exact_vals: CellVals = BTreeMap::new();
        for (di, d) in self.cfg.directions.iter().enumerate() {
            for (hi, h) in self.heads.iter().enumerate() {
                let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
                let mut sets: Vec<(Option<usize>, String)> = vec![(None, String::new())];
                sets.extend(self.offsets.iter().map(|&o| (Some(o), offset_suffix(o))));
                for (off, suffix) in &sets {
                    let c = self.estimate(di, *d, h, *off);
                    let metric = format!("{}{suffix}", atp_metric(*d));
                    est_vals.insert((di, hi, *off), self.nld.push(&c, &metric, at, rows));
                }
                // Exact values from the executor's outcomes.
                if let Some(res) = exact {
                    for ps in 0..self.n_pos_sets() {
                        let off = if ps == 0 {
                            None
                        } else {
                            Some(self.offsets[ps - 1])
                        };
                        let ci = (ps * self.cfg.directions.len() + di) * self.heads.len() + hi;
                        let c = nld_clusters(&self.groups.metas, res, ci, *d, self.p);
                        let metric = match off {
                            None => d.metric().to_string(),
                            Some(o) => format!("{}{}", d.metric(), offset_suffix(o)),
                        };
                        exact_vals.insert((di, hi, off), self.nld.push(&c, &metric, at, rows));
                    }
                }
            }
        }
        (est_vals, exact_vals)
    }

    /// `[LD estimate, LD clean, LD corrupted]` per pair of head `h` in direction `d`
    /// (index `di`), at the kind's positions (`off = None`) or at one offset.
    fn estimate(&self, di: usize, d: Direction, h: &HeadCell, off: Option<usize>) -> Clusters<3> {
        let li = self.layer_index[&h.layer];
        let g = self.groups;
        let mut c = Clusters::<3>::new(self.p);
        for ((meta, terms), prompts) in g.metas.iter().zip(&g.terms).zip(&g.prompts) {
            let n = terms.n;
            for (i, mi) in meta.iter().enumerate().take(n) {
                let (row, sign) = match d {
                    Direction::Denoise => (n + i, -1.0),
                    Direction::Noise => (i, 1.0),
                };
                let tg = &prompts.targets[row].positions;
                let pos: Vec<usize> = match off {
                    None => self
                        .cfg
                        .positions
                        .resolve(tg)
                        .unwrap_or_else(|| (0..prompts.len).collect()),
                    Some(o) => Positions::Offset(o).resolve(tg).unwrap_or_default(),
                };
                let delta = terms.sum(di, li, i, &h.query_heads, &pos);
                let ld_clean = terms.base[i].ld as f64;
                let ld_corr = -terms.base[n + i].ld as f64;
                let ld_base = sign * terms.base[row].ld as f64;
                c.add(mi.logical, mi.phase, [ld_base + delta, ld_clean, ld_corr]);
            }
        }
        c
    }

    /// Agreement of estimate and exact values per direction and head kind, per phase and
    /// pooled: over the heads, and with `validate_positions` over every head x offset
    /// cell of the band (`_positions`).
    fn agreement_rows(&self, est: &CellVals, exact: &CellVals, rows: &mut Vec<LongRow>) {
        for (di, d) in self.cfg.directions.iter().enumerate() {
            for kind in [HeadKind::Query, HeadKind::Kv] {
                let hs: Vec<usize> = (0..self.heads.len())
                    .filter(|&i| self.heads[i].kind == kind)
                    .collect();
                if hs.is_empty() {
                    continue;
                }
                let mut offs: Vec<(Option<usize>, String)> = vec![(None, String::new())];
                if self.cfg.validate_positions {
                    // Over every head x offset cell of the band.
                    offs.push((Some(usize::MAX), "_positions".to_string()));
                }
                for (off, suffix) in offs {
                    let keys: Vec<(usize, Option<usize>)> = match off {
                        None => hs.iter().map(|&h| (h, None)).collect(),
                        Some(_) => hs
                            .iter()
                            .flat_map(|&h| self.offsets.iter().map(move |&o| (h, Some(o))))
                            .collect(),
                    };
                    let metric =
                        |stat: &str| format!("{}{suffix}", agreement_metric(stat, *d, kind));
                    for ph in self.nld.phases.iter().map(|&p| Some(p)).chain([None]) {
                        let (e, x) = finite_pairs(est, exact, di, &keys, ph.map(|p| p as usize));
                        rows.extend(agreement_stats(
                            &self.nld.rc,
                            self.cfg.top_k,
                            metric,
                            ph,
                            &e,
                            &x,
                        ));
                    }
                }
            }
        }
    }

    /// Speed: head x position cells per second, AtP against exact patching (`exact_secs`).
    fn speed_rows(&self, exact_secs: Option<f64>, rows: &mut Vec<LongRow>) {
        let (rc, g) = (&self.nld.rc, self.groups);
        let n_dirs = self.cfg.directions.len();
        let n_groups = g.prompts.len().max(1) as f64;
        let atp_cells =
            (self.heads.len() * n_dirs * g.prompts.first().map_or(0, |p| p.len)) as f64 * n_groups;
        rows.push(rc.row(
            "atp_seconds",
            Est {
                value: g.seconds,
                ci: None,
                n: n_groups as u64,
            },
        ));
        rows.push(rc.row(
            "atp_cells_per_s",
            Est {
                value: atp_cells / g.seconds.max(1e-9),
                ci: None,
                n: atp_cells as u64,
            },
        ));
        if let Some(secs) = exact_secs {
            let cells = (self.heads.len() * n_dirs * self.n_pos_sets()) as f64 * n_groups;
            rows.push(rc.row(
                "exact_seconds",
                Est {
                    value: secs,
                    ci: None,
                    n: n_groups as u64,
                },
            ));
            rows.push(rc.row(
                "exact_cells_per_s",
                Est {
                    value: cells / secs.max(1e-9),
                    ci: None,
                    n: cells as u64,
                },
            ));
        }
    }
}

/// The finite (estimate, exact) value pairs of the `(head, offset)` cells `keys` in
/// direction `di`, at phase `ph` (None: pooled).
fn finite_pairs(
    est: &CellVals,
    exact: &CellVals,
    di: usize,
    keys: &[(usize, Option<usize>)],
    ph: Option<usize>,
) -> (Vec<f64>, Vec<f64>) {
    keys.iter()
        .map(|&(h, o)| {
            let pick = |m: &CellVals| {
                let (per, pooled) = &m[&(di, h, o)];
                ph.map_or(*pooled, |ph| per[ph])
            };
            (pick(est), pick(exact))
        })
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .unzip()
}

fn run(cfg: &AttributionPatching, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = setup::layers(ctx.exp, "atp", &cfg.layers, &ctx.info, false)?;
    let heads = head_cells(
        ctx,
        "atp",
        &layers,
        &cfg.head_kinds,
        &cfg.heads,
        &cfg.kv_heads,
    )?;
    let groups = atp_groups(ctx, &layers, &cfg.directions)?;
    // The band sizes the per-offset estimates and exact cells: an offset past the first
    // token patches nothing, so a band longer than the prompts is refused before them.
    if let Some(len) = groups.prompts.iter().map(|p| p.len).max()
        && cfg.position_band > len
    {
        return Err(ctx.exp.err(
            "atp",
            "position_band",
            format!(
                "{} offsets, but the prompts hold {len} tokens (offsets past the first token patch nothing)",
                cfg.position_band
            ),
        ));
    }
    // Exact patching of the same cells (and, optionally, of every offset of the band).
    let exact = if cfg.validate {
        Some(exact_patching(cfg, ctx, &heads, &groups.prompts)?)
    } else {
        None
    };
    // Baselines (from the AtP forward's outcomes).
    let mut rows = baseline(ctx, &groups);
    let cells = CellRows {
        cfg,
        heads: &heads,
        groups: &groups,
        layer_index: layers.iter().enumerate().map(|(i, &l)| (l, i)).collect(),
        offsets: (0..cfg.position_band).collect(),
        nld: NldRows::new(ctx),
        p: ctx.p(),
    };
    // Estimates (and exact values) per direction x head (x offset).
    let (est, ex) = cells.cell_rows(exact.as_ref().map(|(res, _)| res.as_slice()), &mut rows);
    // Agreement per phase (and pooled) over the heads of each kind.
    if exact.is_some() {
        cells.agreement_rows(&est, &ex, &mut rows);
    }
    if cfg.qk_fix {
        let phases_run = ctx.task.phases.clone();
        let inp = atp_star::QkInput {
            cfg,
            layers: &layers,
            heads: &heads,
            metas: &groups.metas,
            prompts: &groups.prompts,
            phases_run: &phases_run,
        };
        atp_star::rows(ctx, &inp, &mut rows)?;
    }
    cells.speed_rows(exact.as_ref().map(|(_, secs)| *secs), &mut rows);
    ctx.stats.forwards += groups.prompts.len() as u64;
    Ok(KindOutput {
        tables: vec![("atp".into(), rows)],
    })
}

fn fmt3(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.3}")
    } else {
        "n/a".into()
    }
}

/// The value of `metric` at phase `ph` (None: pooled), NaN when absent.
fn metric_val(d: &ExperimentData, m: &str, metric: &str, ph: Option<u32>) -> f64 {
    d.find(m, metric)
        .find(|r| r.phase == ph)
        .map_or(f64::NAN, |r| r.value)
}

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &AttributionPatching, f: &mut Figures) -> Result<()> {
    let (d, m) = (f.data, f.model.clone());
    let m = m.as_str();
    f.report.section("Attribution patching (AtP) of hook_z");
    f.report.paragraph(
        "AtP estimates each head's activation-patching effect from one forward of the clean and \
         corrupted prompts and one backward: the change of the logit difference when head h's hook_z \
         at position t is patched from the partner prompt is approximated by \
         (z_partner - z) . dLD/dz. The estimate of the normalised logit difference (atp_nld_*) is the \
         patch-heads NLD with LD_patched = LD_base + the summed terms. With validation, the same cells \
         are patched exactly (nld_*, what patch-heads computes) and, per source phase, the Spearman \
         rank correlation and the top-k recall (how many of the k heads with the largest exact |NLD| \
         AtP also puts in its top k) are reported. A KV-head cell sums the terms of the query heads \
         that read it.",
    );
    // Speed headline.
    if let (Some(a), Some(x)) = (
        d.scalar(m, "atp_cells_per_s"),
        d.scalar(m, "exact_cells_per_s"),
    ) {
        f.report.headline(
            Headline::new(
                "AtP head x position cells/s vs exact head cells/s",
                format!("{:.0}x", a.value / x.value),
            )
            .with_detail(format!("{:.0} vs {:.1} cells/s", a.value, x.value)),
        );
    }
    for dirn in &cfg.directions {
        if d.has(m, &atp_metric(*dirn)) {
            direction_section(cfg, f, *dirn)?;
        }
    }
    atp_star::draw(cfg, f)
}

/// One direction's subsection: estimate and exact heatmaps, their scatter, the agreement
/// table with where the estimate fails, and the per-position estimates.
fn direction_section(cfg: &AttributionPatching, f: &mut Figures, dirn: Direction) -> Result<()> {
    let (d, m) = (f.data, f.model.clone());
    let am = atp_metric(dirn);
    let xm = dirn.metric();
    f.report.subsection(format!("{xm}: estimate against exact"));
    let (layers, heads) = head_axes(d, &m, &am, HeadKind::Query);
    if !layers.is_empty() {
        query_heatmaps(f, &am, xm, &layers, &heads)?;
    }
    estimate_scatter(f, &am, xm)?;
    agreement_section(cfg, f, dirn)?;
    if cfg.position_band > 0 {
        positions_heatmap(cfg, f, &am, xm, &layers, &heads)?;
    }
    Ok(())
}

/// Layer x query head heatmaps of the estimate `am` and of the exact `xm`, all phases.
fn query_heatmaps(
    f: &mut Figures,
    am: &str,
    xm: &str,
    layers: &[u32],
    heads: &[u32],
) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let est = cell_map(d, &m, am, HeadKind::Query);
    let ex = cell_map(d, &m, xm, HeadKind::Query);
    let range = sym_range(est.values().chain(ex.values()).copied());
    let fig = layer_head_heatmap(
        &dir.join(format!("{am}_all_phases")),
        &HeadGrid {
            cells: &est,
            layers,
            heads,
            head_label: "H",
        },
        None,
        format!("{m}: AtP estimate of {xm}, all phases"),
        &ColourScale {
            label: "normalised logit difference (AtP)",
            range,
            diverging: true,
        },
    )?;
    f.push(
        &format!("AtP estimate of {xm} per layer x query head, all phases"),
        fig,
    );
    if !ex.is_empty() {
        let fig = layer_head_heatmap(
            &dir.join(format!("{xm}_all_phases")),
            &HeadGrid {
                cells: &ex,
                layers,
                heads,
                head_label: "H",
            },
            None,
            format!("{m}: exact {xm}, all phases"),
            &ColourScale {
                label: "normalised logit difference (exact)",
                range,
                diverging: true,
            },
        )?;
        f.push(
            &format!("Exact {xm} per layer x query head, all phases"),
            fig,
        );
    }
    Ok(())
}

/// Scatter: every head x phase cell, estimate `am` against exact `xm`.
fn estimate_scatter(f: &mut Figures, am: &str, xm: &str) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let mut series = Vec::new();
    for kind in [HeadKind::Query, HeadKind::Kv] {
        let e = cell_map(d, &m, am, kind);
        let x = cell_map(d, &m, xm, kind);
        series.extend(paired_series(format!("{} heads", kind.as_str()), &e, &x));
    }
    if !series.is_empty() {
        let fig = scatter_predicted_vs_observed(
            dir.join(format!("{am}_vs_exact")),
            &ScatterSpec {
                series,
                title: format!("{m}: AtP estimate vs exact {xm}, head x phase"),
                x_label: "AtP estimate of NLD".into(),
                y_label: "exact NLD".into(),
                r2_text: None,
                size: None,
            },
        )?;
        f.push(
            &format!("AtP estimate vs exact {xm}, every head x source phase"),
            fig,
        );
    }
    Ok(())
}

/// Agreement table per phase, followed by where the estimate fails.
fn agreement_section(cfg: &AttributionPatching, f: &mut Figures, dirn: Direction) -> Result<()> {
    let (d, m, phases) = (f.data, f.model.clone(), f.phases.clone());
    let xm = dirn.metric();
    let recall = format!("recall_top{}", cfg.top_k);
    let mut header = vec!["phase".to_string()];
    let mut cols = Vec::new();
    for kind in [HeadKind::Query, HeadKind::Kv] {
        for stat in ["spearman", recall.as_str(), "mae"] {
            let metric = agreement_metric(stat, dirn, kind);
            if d.has(&m, &metric) {
                header.push(format!("{stat} ({})", kind.as_str()));
                cols.push(metric);
            }
        }
    }
    if cols.is_empty() {
        return Ok(());
    }
    let mut body = Vec::new();
    for ph in phases.iter().map(|&p| Some(p)).chain([None]) {
        let mut row = vec![ph.map_or("all".to_string(), |p| p.to_string())];
        row.extend(cols.iter().map(|c| fmt3(metric_val(d, &m, c, ph))));
        body.push(row);
    }
    f.report.table(
        format!(
            "Agreement of AtP with exact patching ({xm}; top-{} recall over |NLD|)",
            cfg.top_k
        ),
        header,
        body,
    );
    f.report.paragraph(failure_text(cfg, f, dirn));
    Ok(())
}

/// Where the estimate fails: phases with weak agreement and the worst heads.
fn failure_text(cfg: &AttributionPatching, f: &Figures, dirn: Direction) -> String {
    let (d, m, phases) = (f.data, f.model.as_str(), &f.phases);
    let recall = format!("recall_top{}", cfg.top_k);
    let val = |metric: &str, ph: Option<u32>| metric_val(d, m, metric, ph);
    let mut weak: Vec<String> = Vec::new();
    for kind in [HeadKind::Query, HeadKind::Kv] {
        let sp = agreement_metric("spearman", dirn, kind);
        let rq = agreement_metric(&recall, dirn, kind);
        if !d.has(m, &sp) {
            continue;
        }
        let bad: Vec<String> = phases
            .iter()
            .filter(|&&p| val(&sp, Some(p)) < 0.5 || val(&rq, Some(p)) < 1.0)
            .map(|p| {
                format!(
                    "{p} (Spearman {}, recall {})",
                    fmt3(val(&sp, Some(*p))),
                    fmt3(val(&rq, Some(*p)))
                )
            })
            .collect();
        if !bad.is_empty() {
            weak.push(format!(
                "{} heads at phase {}",
                kind.as_str(),
                bad.join(", phase ")
            ));
        }
    }
    let worst = worst_cells(d, m, &atp_metric(dirn), dirn.metric());
    let large = worst.iter().filter(|w| w.0 > 0.25).count();
    let mut text = if weak.is_empty() {
        format!(
            "The ranking agrees at every phase for both head kinds (Spearman >= 0.5 and every top-{} head found).",
            cfg.top_k
        )
    } else {
        format!(
            "Where the ranking fails (Spearman < 0.5 or a top-{} head missed): {}.",
            cfg.top_k,
            weak.join("; ")
        )
    };
    text.push_str(&format!(
        " {large} head x phase cells are off by more than 0.25 NLD (AtP is first order: a head whose \
         patch switches the answer all at once, through saturated attention or later layers, is \
         under- or over-estimated)."
    ));
    if !worst.is_empty() {
        let list: Vec<String> = worst.iter().take(5).map(|w| w.1.clone()).collect();
        text.push_str(&format!(" Largest errors: {}.", list.join("; ")));
    }
    text
}

/// Every head x phase cell with both values finite, as (|estimate - exact|, description),
/// largest error first.
fn worst_cells(d: &ExperimentData, m: &str, am: &str, xm: &str) -> Vec<(f64, String)> {
    let mut worst: Vec<(f64, String)> = Vec::new();
    for kind in [HeadKind::Query, HeadKind::Kv] {
        let e = cell_map(d, m, am, kind);
        let x = cell_map(d, m, xm, kind);
        for ((l, h, ph), v) in &e {
            if let (Some(ph), Some(o)) = (ph, x.get(&(*l, *h, *ph)))
                && v.is_finite()
                && o.is_finite()
            {
                let name = match kind {
                    HeadKind::Query => format!("L{l}.H{h}"),
                    HeadKind::Kv => format!("L{l}.KV{h}"),
                };
                worst.push((
                    (v - o).abs(),
                    format!("{name} at phase {ph}: AtP {v:.3}, exact {o:.3}"),
                ));
            }
        }
    }
    worst.sort_by(|a, b| b.0.total_cmp(&a.0));
    worst
}

/// Per-position estimates: rows = query heads, columns = offsets, pooled.
fn positions_heatmap(
    cfg: &AttributionPatching,
    f: &mut Figures,
    am: &str,
    xm: &str,
    layers: &[u32],
    heads: &[u32],
) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let mut row_labels = Vec::new();
    let mut matrix = Vec::new();
    for &l in layers {
        for &h in heads {
            let vals: Vec<f64> = (0..cfg.position_band)
                .map(|o| {
                    d.find(&m, &format!("{am}{}", offset_suffix(o)))
                        .find(|r| {
                            r.layer == Some(l)
                                && r.head == Some(h)
                                && r.head_kind == Some(HeadKind::Query)
                                && r.phase.is_none()
                        })
                        .map_or(f64::NAN, |r| r.value)
                })
                .collect();
            if vals.iter().any(|v| v.is_finite()) {
                row_labels.push(format!("L{l}H{h}"));
                matrix.push(vals);
            }
        }
    }
    if matrix.is_empty() {
        return Ok(());
    }
    let spec = HeatmapSpec {
        range: sym_range(matrix.iter().flatten().copied()),
        matrix,
        row_labels,
        col_labels: (0..cfg.position_band).map(|o| format!("-{o}")).collect(),
        title: format!("{m}: AtP estimate of {xm} per query head x position, all phases"),
        x_label: "position relative to the read position".into(),
        y_label: "query head".into(),
        colorbar_label: "normalised logit difference (AtP)".into(),
        diverging: true,
        annotate: true,
        size: None,
    };
    let fig = heatmap(dir.join(format!("{am}_positions")), &spec)?;
    f.push(
        &format!("AtP estimate of {xm} per query head x position (one position patched at a time)"),
        fig,
    );
    Ok(())
}
