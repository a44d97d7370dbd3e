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

use crate::analysis::{Clusters, Est, accuracy_clusters, normalized_logit_diff, per_phase, spearman, topk_recall};
use crate::error::{Error, Result};
use crate::hooks::{Act, Action, HookPoint, HookSpec, Scope, Site};
use crate::model::LanguageModel;
use crate::output::{
    HeadKind, HeatmapSpec, Headline, LongRow, ScatterSeries, ScatterSpec, heatmap,
    scatter_predicted_vs_observed,
};

use super::super::exec::Group;
use super::super::experiment::{Experiment, Selection};
use super::super::patching::{Cell, Edit, Fill, Outcome, Positions, Prompts, Target, readout};
use super::super::prompts::{PromptMeta, paired_prompts};
use super::super::report::{Figures, cell_map, head_axes, layer_head_heatmap, push, sym_range};
use super::super::rows::baseline_rows;
use super::super::setup;
use super::patch_heads::Direction;
use super::{Ctx, Kind, KindOutput, base_obs, empty_list, head_cells};

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
    /// change; [`super::atp_star`]), checked against exact patching of hook_q / hook_k.
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

/// One forward over the clean and corrupted prompts with a gradient leaf at
/// `hook_z` of every layer of `layers`, one backward of the summed logit differences
/// (clean orientation), and the first-order patching terms of every head and position.
/// Prompts `0..n` must be clean and `n..2n` their partners, each with an `alt` answer.
pub fn atp_terms(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    layers: &[usize],
    directions: &[Direction],
) -> Result<AtpTerms> {
    let n2 = prompts.n();
    if n2 == 0 || !n2.is_multiple_of(2) {
        return Err(Error::Other(format!(
            "attribution patching needs clean/corrupted pairs, got {n2} prompts"
        )));
    }
    let n = n2 / 2;
    let len = prompts.len;
    let info = model.info();
    let device = model.device();
    let ad = device.clone().autodiff();
    let mut spec = HookSpec::new();
    let mut leaves = Vec::with_capacity(layers.len());
    let mut heads = Vec::with_capacity(layers.len());
    for &l in layers {
        let h = info.layers[l].n_heads;
        let leaf = Tensor::<4>::zeros([n2, len, h, info.d_head], &ad).require_grad();
        let p = HookPoint::block(l, Site::AttnZ);
        spec = spec
            .intervene_point(p, Action::Add(Act::new(leaf.clone())), Scope::all())
            .capture_point(p);
        leaves.push(leaf);
        heads.push(h);
    }
    let all: Vec<usize> = (0..n2).collect();
    let out = model.forward(prompts.tokens_of(&all, &device), &spec)?;
    let targets: Vec<&Target> = prompts.targets.iter().collect();
    let base = readout(out.logits.clone().inner(), &targets)?;

    // The LD of every prompt at its first target position, weighted by direction.
    let [_, t, v] = out.logits.dims();
    let mut flat = Vec::with_capacity(n2);
    let mut pairs = Vec::with_capacity(2 * n2);
    let mut weight = vec![0f32; n2];
    for (i, tg) in prompts.targets.iter().enumerate() {
        let alt = tg.alt.ok_or_else(|| {
            Error::Other(format!("prompt {i} has no competing answer (alt) for the logit difference"))
        })?;
        flat.push((i * t + tg.positions[0]) as i64);
        pairs.push(tg.answers[0] as i64);
        pairs.push(alt as i64);
        if tg.answers[0] as usize >= v || alt as usize >= v {
            return Err(Error::Input(format!(
                "answer token {} / {alt} is outside the model's vocabulary 0..{v}",
                tg.answers[0]
            )));
        }
    }
    for d in directions {
        match d {
            // The corrupted prompt's LD in the clean orientation is -LD.
            Direction::Denoise => weight[n..].iter_mut().for_each(|w| *w = -1.0),
            Direction::Noise => weight[..n].iter_mut().for_each(|w| *w = 1.0),
        }
    }
    let idx = Tensor::<1, Int>::from_data(TensorData::new(flat, [n2]), &ad);
    let pairs = Tensor::<2, Int>::from_data(TensorData::new(pairs, [n2, 2]), &ad);
    let g = out.logits.reshape([n2 * t, v]).select(0, idx).gather(1, pairs);
    let ld = g.clone().slice([0..n2, 0..1]) - g.slice([0..n2, 1..2]);
    let w = Tensor::<2>::from_data(TensorData::new(weight, [n2, 1]), &ad);
    let grads = (ld * w).sum().backward();

    let mut terms = vec![Vec::with_capacity(layers.len()); directions.len()];
    for ((&l, leaf), &h) in layers.iter().zip(&leaves).zip(&heads) {
        let p = HookPoint::block(l, Site::AttnZ);
        let grad = leaf.grad(&grads).ok_or_else(|| {
            Error::hook(p.to_string(), "no gradient reached this point (does the model run it?)")
        })?;
        let z = out
            .cache
            .get(&p)
            .ok_or_else(|| Error::hook(p.to_string(), "not captured"))?
            .get::<4>()?
            .inner();
        let dh = info.d_head;
        let (zc, zx) = (
            z.clone().slice([0..n, 0..len, 0..h, 0..dh]),
            z.slice([n..n2, 0..len, 0..h, 0..dh]),
        );
        for (di, d) in directions.iter().enumerate() {
            let (delta, gr) = match d {
                Direction::Denoise => (zc.clone() - zx.clone(), grad.clone().slice([n..n2, 0..len, 0..h, 0..dh])),
                Direction::Noise => (zx.clone() - zc.clone(), grad.clone().slice([0..n, 0..len, 0..h, 0..dh])),
            };
            let term = (delta * gr).sum_dim(3).reshape([n * len * h]);
            terms[di].push(term.try_into_vec_as::<f32>()?);
        }
    }
    Ok(AtpTerms {
        base,
        n,
        len,
        terms,
        heads,
    })
}

/// The store key of a group's AtP terms.
fn terms_key(r: u32) -> String {
    format!("p{r}-atp")
}

/// AtP terms of a group, from the store or computed (and stored): one outcome vector
/// per (direction, layer, query head, position) with the per-prompt term in `ld`,
/// then the base outcomes.
fn group_terms(
    ctx: &Ctx,
    r: u32,
    prompts: &Prompts,
    layers: &[usize],
    dirs: &[Direction],
) -> Result<AtpTerms> {
    let n = prompts.n() / 2;
    let len = prompts.len;
    let heads: Vec<usize> = layers.iter().map(|&l| ctx.info.layers[l].n_heads).collect();
    let per_dir: usize = heads.iter().map(|h| h * len).sum();
    let mut expected = vec![n; dirs.len() * per_dir];
    expected.push(2 * n);
    if let Some(mut stored) = ctx.store.load(&terms_key(r), &expected)? {
        let base = stored.pop().expect("the base vector was expected");
        let mut it = stored.into_iter();
        let mut terms = Vec::new();
        for _ in dirs {
            let mut per_layer = Vec::new();
            for &h in &heads {
                let mut t = vec![0f32; n * len * h];
                for q in 0..h {
                    for p in 0..len {
                        let v = it.next().expect("sizes checked by the store");
                        for (i, o) in v.iter().enumerate() {
                            t[(i * len + p) * h + q] = o.ld;
                        }
                    }
                }
                per_layer.push(t);
            }
            terms.push(per_layer);
        }
        return Ok(AtpTerms {
            base,
            n,
            len,
            terms,
            heads,
        });
    }
    let got = atp_terms(ctx.model, prompts, layers, dirs)?;
    let mut save = Vec::with_capacity(expected.len());
    for per_layer in &got.terms {
        for (t, &h) in per_layer.iter().zip(&heads) {
            for q in 0..h {
                for p in 0..len {
                    save.push(
                        (0..n)
                            .map(|i| Outcome {
                                correct: false,
                                ld: t[(i * len + p) * h + q],
                            })
                            .collect(),
                    );
                }
            }
        }
    }
    save.push(got.base.clone());
    ctx.store.save(&terms_key(r), &save)?;
    Ok(got)
}

/// (direction, head cell, offset or None) -> per-phase values and the pooled value.
type CellVals = BTreeMap<(usize, usize, Option<usize>), (Vec<f64>, f64)>;

pub(super) fn nld(s: &[f64; 3], n: u64) -> f64 {
    let k = n as f64;
    normalized_logit_diff(s[0] / k, s[1] / k, s[2] / k).unwrap_or(f64::NAN)
}

fn run(cfg: &AttributionPatching, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = setup::layers(ctx.exp, "atp", &cfg.layers, &ctx.info, false)?;
    let heads = head_cells(ctx, "atp", &layers, &cfg.head_kinds, &cfg.heads, &cfg.kv_heads)?;
    let set = ctx.eval_set()?;
    let p = ctx.p();
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let offsets: Vec<usize> = (0..cfg.position_band).collect();
    let dirs = cfg.directions.clone();

    // AtP: one forward + one backward per phase group.
    let mut metas: Vec<Vec<PromptMeta>> = Vec::new();
    let mut all_prompts = Vec::new();
    let mut all_terms = Vec::new();
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
        let terms = group_terms(ctx, r, &prompts, &layers, &dirs)?;
        progress.inc(1);
        metas.push(meta);
        all_prompts.push(prompts);
        all_terms.push(terms);
    }
    progress.finish();
    let atp_seconds = t0.elapsed().as_secs_f64();

    // Exact patching of the same cells (and, optionally, of every offset of the band).
    let mut exact = None;
    if cfg.validate {
        let mut groups = Vec::new();
        for (prompts, &r) in all_prompts.iter().zip(&phases_run) {
            let n = prompts.n() / 2;
            let mut cells = Vec::new();
            let mut positions = vec![cfg.positions.clone()];
            if cfg.validate_positions {
                positions.extend(offsets.iter().map(|&o| Positions::Offset(o)));
            }
            for pos in &positions {
                for d in &dirs {
                    let receivers: Vec<usize> = match d {
                        Direction::Denoise => (n..2 * n).collect(),
                        Direction::Noise => (0..n).collect(),
                    };
                    for h in &heads {
                        cells.push(Cell {
                            edit: Edit::Replace {
                                point: h.point(),
                                heads: Some(h.query_heads.clone()),
                                positions: pos.clone(),
                                fill: Fill::Source,
                            },
                            prompts: receivers.clone(),
                        });
                    }
                }
            }
            groups.push(Group {
                key: format!("p{r}"),
                prompts: prompts.clone(),
                cells,
            });
        }
        let t1 = std::time::Instant::now();
        let res = ctx.execute(&format!("{} exact patching", ctx.mref.name), &groups)?;
        exact = Some((res, t1.elapsed().as_secs_f64()));
    }

    // Baselines (from the AtP forward's outcomes).
    let mut acc = Vec::new();
    let mut acc_corrupt = Vec::new();
    for (meta, terms) in metas.iter().zip(&all_terms) {
        let res = super::super::exec::GroupResult {
            base: terms.base.clone(),
            cells: Vec::new(),
        };
        acc.extend(base_obs(meta, &res));
        let n = terms.n;
        for (i, m) in meta.iter().take(n).enumerate() {
            acc_corrupt.push((m.logical, m.phase, terms.base[n + i].correct));
        }
    }
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

    // Estimates (and exact values) per direction x head (x offset).
    let layer_index: BTreeMap<usize, usize> =
        layers.iter().enumerate().map(|(i, &l)| (l, i)).collect();
    // (direction, head cell, offset or None) -> per phase value, pooled value.
    let mut est_vals: CellVals = BTreeMap::new();
    let mut exact_vals: CellVals = BTreeMap::new();
    let n_pos_sets = 1 + if cfg.validate_positions { offsets.len() } else { 0 };
    for (di, d) in dirs.iter().enumerate() {
        for (hi, h) in heads.iter().enumerate() {
            let li = layer_index[&h.layer];
            let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
            let mut sets: Vec<(Option<usize>, String)> = vec![(None, String::new())];
            sets.extend(offsets.iter().map(|&o| (Some(o), offset_suffix(o))));
            for (off, suffix) in &sets {
                let mut c = Clusters::<3>::new(p);
                for ((meta, terms), prompts) in metas.iter().zip(&all_terms).zip(&all_prompts) {
                    let n = terms.n;
                    for (i, mi) in meta.iter().enumerate().take(n) {
                        let (row, sign) = match d {
                            Direction::Denoise => (n + i, -1.0),
                            Direction::Noise => (i, 1.0),
                        };
                        let tg = &prompts.targets[row].positions;
                        let pos: Vec<usize> = match off {
                            None => cfg.positions.resolve(tg).unwrap_or_else(|| (0..prompts.len).collect()),
                            Some(o) => Positions::Offset(*o).resolve(tg).unwrap_or_default(),
                        };
                        let delta = terms.sum(di, li, i, &h.query_heads, &pos);
                        let ld_clean = terms.base[i].ld as f64;
                        let ld_corr = -terms.base[n + i].ld as f64;
                        let ld_base = sign * terms.base[row].ld as f64;
                        c.add(mi.logical, mi.phase, [ld_base + delta, ld_clean, ld_corr]);
                    }
                }
                let (per, pooled) = per_phase(&c, nld, reps, seed);
                let metric = format!("{}{suffix}", atp_metric(*d));
                rows.extend(rc.phase_rows(&metric, at, &phases, &per, pooled));
                est_vals.insert(
                    (di, hi, *off),
                    (per.iter().map(|e| e.value).collect(), pooled.value),
                );
            }
            // Exact values from the executor's outcomes.
            if let Some((res, _)) = &exact {
                for ps in 0..n_pos_sets {
                    let off = if ps == 0 { None } else { Some(offsets[ps - 1]) };
                    let ci = (ps * dirs.len() + di) * heads.len() + hi;
                    let mut c = Clusters::<3>::new(p);
                    for (meta, g) in metas.iter().zip(res) {
                        let n = meta.len() / 2;
                        for (i, o) in g.cells[ci].iter().enumerate() {
                            let sign = match d {
                                Direction::Denoise => -1.0,
                                Direction::Noise => 1.0,
                            };
                            c.add(
                                meta[i].logical,
                                meta[i].phase,
                                [
                                    sign * o.ld as f64,
                                    g.base[i].ld as f64,
                                    -g.base[n + i].ld as f64,
                                ],
                            );
                        }
                    }
                    let (per, pooled) = per_phase(&c, nld, reps, seed);
                    let metric = match off {
                        None => d.metric().to_string(),
                        Some(o) => format!("{}{}", d.metric(), offset_suffix(o)),
                    };
                    rows.extend(rc.phase_rows(&metric, at, &phases, &per, pooled));
                    exact_vals.insert(
                        (di, hi, off),
                        (per.iter().map(|e| e.value).collect(), pooled.value),
                    );
                }
            }
        }
    }

    // Agreement per phase (and pooled) over the heads of each kind.
    if exact.is_some() {
        for (di, d) in dirs.iter().enumerate() {
            for kind in [HeadKind::Query, HeadKind::Kv] {
                let hs: Vec<usize> = (0..heads.len()).filter(|&i| heads[i].kind == kind).collect();
                if hs.is_empty() {
                    continue;
                }
                let mut offs: Vec<(Option<usize>, String)> = vec![(None, String::new())];
                if cfg.validate_positions {
                    // Over every head x offset cell of the band.
                    offs.push((Some(usize::MAX), "_positions".to_string()));
                }
                for (off, suffix) in offs {
                    let keys: Vec<(usize, Option<usize>)> = match off {
                        None => hs.iter().map(|&h| (h, None)).collect(),
                        Some(_) => hs
                            .iter()
                            .flat_map(|&h| offsets.iter().map(move |&o| (h, Some(o))))
                            .collect(),
                    };
                    let at_phase = |ph: Option<usize>| -> (Vec<f64>, Vec<f64>) {
                        keys.iter()
                            .map(|&(h, o)| {
                                let pick = |m: &CellVals| {
                                    let (per, pooled) = &m[&(di, h, o)];
                                    ph.map_or(*pooled, |ph| per[ph])
                                };
                                (pick(&est_vals), pick(&exact_vals))
                            })
                            .filter(|(a, b)| a.is_finite() && b.is_finite())
                            .unzip()
                    };
                    let mut emit = |ph: Option<u32>, est: &[f64], ex: &[f64]| {
                        let n = est.len() as u64;
                        let sp = spearman(est, ex).ok().flatten().unwrap_or(f64::NAN);
                        let rec = topk_recall(est, ex, cfg.top_k).unwrap_or(f64::NAN);
                        let mae = if est.is_empty() {
                            f64::NAN
                        } else {
                            est.iter().zip(ex).map(|(a, b)| (a - b).abs()).sum::<f64>() / n as f64
                        };
                        for (stat, v) in [
                            ("spearman".to_string(), sp),
                            (format!("recall_top{}", cfg.top_k), rec),
                            ("mae".to_string(), mae),
                        ] {
                            let mut row = rc.row(
                                format!("{}{suffix}", agreement_metric(&stat, *d, kind)),
                                Est { value: v, ci: None, n },
                            );
                            if let Some(ph) = ph {
                                row = row.at_phase(ph);
                            }
                            rows.push(row);
                        }
                    };
                    for &ph in &phases {
                        let (e, x) = at_phase(Some(ph as usize));
                        emit(Some(ph), &e, &x);
                    }
                    let (e, x) = at_phase(None);
                    emit(None, &e, &x);
                }
            }
        }
    }

    if cfg.qk_fix {
        let inp = super::atp_star::QkInput {
            cfg,
            layers: &layers,
            heads: &heads,
            metas: &metas,
            prompts: &all_prompts,
            phases_run: &phases_run,
        };
        super::atp_star::rows(ctx, &inp, &mut rows)?;
    }

    // Speed: head x position cells per second, AtP against exact patching.
    let n_groups = phases_run.len().max(1) as f64;
    let atp_cells = (heads.len() * dirs.len() * all_prompts.first().map_or(0, |p| p.len)) as f64 * n_groups;
    rows.push(rc.row("atp_seconds", Est { value: atp_seconds, ci: None, n: n_groups as u64 }));
    rows.push(rc.row(
        "atp_cells_per_s",
        Est { value: atp_cells / atp_seconds.max(1e-9), ci: None, n: atp_cells as u64 },
    ));
    if let Some((_, secs)) = &exact {
        let cells = (heads.len() * dirs.len() * n_pos_sets) as f64 * n_groups;
        rows.push(rc.row("exact_seconds", Est { value: *secs, ci: None, n: n_groups as u64 }));
        rows.push(rc.row(
            "exact_cells_per_s",
            Est { value: cells / secs.max(1e-9), ci: None, n: cells as u64 },
        ));
    }
    ctx.stats.forwards += phases_run.len() as u64;
    Ok(KindOutput {
        tables: vec![("atp".into(), rows)],
    })
}

fn fmt3(v: f64) -> String {
    if v.is_finite() { format!("{v:.3}") } else { "n/a".into() }
}

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &AttributionPatching, f: &mut Figures) -> Result<()> {
    let (d, m, phases, dir) = (f.data, f.model.clone(), f.phases.clone(), f.dir);
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
    if let (Some(a), Some(x)) = (d.scalar(m, "atp_cells_per_s"), d.scalar(m, "exact_cells_per_s")) {
        f.report.headline(
            Headline::new("AtP head x position cells/s vs exact head cells/s", format!("{:.0}x", a.value / x.value))
                .with_detail(format!("{:.0} vs {:.1} cells/s", a.value, x.value)),
        );
    }
    for dirn in &cfg.directions {
        let am = atp_metric(*dirn);
        let xm = dirn.metric();
        if !d.has(m, &am) {
            continue;
        }
        f.report.subsection(format!("{xm}: estimate against exact"));
        let (layers, heads) = head_axes(d, m, &am, HeadKind::Query);
        let est = cell_map(d, m, &am, HeadKind::Query);
        let ex = cell_map(d, m, xm, HeadKind::Query);
        let range = sym_range(est.values().chain(ex.values()).copied());
        if !layers.is_empty() {
            let fig = layer_head_heatmap(
                &dir.join(format!("{am}_all_phases")),
                &est,
                &layers,
                &heads,
                None,
                format!("{m}: AtP estimate of {xm}, all phases"),
                "normalised logit difference (AtP)",
                range,
                "H",
                true,
            )?;
            push(&mut f.files, &mut f.report, &format!("AtP estimate of {xm} per layer x query head, all phases"), fig);
            if !ex.is_empty() {
                let fig = layer_head_heatmap(
                    &dir.join(format!("{xm}_all_phases")),
                    &ex,
                    &layers,
                    &heads,
                    None,
                    format!("{m}: exact {xm}, all phases"),
                    "normalised logit difference (exact)",
                    range,
                    "H",
                    true,
                )?;
                push(&mut f.files, &mut f.report, &format!("Exact {xm} per layer x query head, all phases"), fig);
            }
        }
        // Scatter: every head x phase cell, estimate against exact.
        let mut series = Vec::new();
        for kind in [HeadKind::Query, HeadKind::Kv] {
            let e = cell_map(d, m, &am, kind);
            let x = cell_map(d, m, xm, kind);
            let (pe, po): (Vec<f64>, Vec<f64>) = e
                .iter()
                .filter(|((_, _, ph), _)| ph.is_some())
                .filter_map(|(k, v)| x.get(k).map(|o| (*v, *o)))
                .unzip();
            if !pe.is_empty() {
                series.push(ScatterSeries {
                    name: format!("{} heads", kind.as_str()),
                    predicted: pe,
                    observed: po,
                });
            }
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
            push(&mut f.files, &mut f.report, &format!("AtP estimate vs exact {xm}, every head x source phase"), fig);
        }
        // Agreement table per phase.
        let recall = format!("recall_top{}", cfg.top_k);
        let mut header = vec!["phase".to_string()];
        let mut cols = Vec::new();
        for kind in [HeadKind::Query, HeadKind::Kv] {
            for stat in ["spearman", recall.as_str(), "mae"] {
                let metric = agreement_metric(stat, *dirn, kind);
                if d.has(m, &metric) {
                    header.push(format!("{stat} ({})", kind.as_str()));
                    cols.push(metric);
                }
            }
        }
        if !cols.is_empty() {
            let val = |metric: &str, ph: Option<u32>| {
                d.find(m, metric)
                    .find(|r| r.phase == ph)
                    .map_or(f64::NAN, |r| r.value)
            };
            let mut body = Vec::new();
            for ph in phases.iter().map(|&p| Some(p)).chain([None]) {
                let mut row = vec![ph.map_or("all".to_string(), |p| p.to_string())];
                row.extend(cols.iter().map(|c| fmt3(val(c, ph))));
                body.push(row);
            }
            f.report.table(
                format!("Agreement of AtP with exact patching ({xm}; top-{} recall over |NLD|)", cfg.top_k),
                header,
                body,
            );
            // Where the estimate fails: phases with weak agreement and the worst heads.
            let mut weak: Vec<String> = Vec::new();
            for kind in [HeadKind::Query, HeadKind::Kv] {
                let sp = agreement_metric("spearman", *dirn, kind);
                let rq = agreement_metric(&recall, *dirn, kind);
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
                    weak.push(format!("{} heads at phase {}", kind.as_str(), bad.join(", phase ")));
                }
            }
            let mut worst: Vec<(f64, String)> = Vec::new();
            for kind in [HeadKind::Query, HeadKind::Kv] {
                let e = cell_map(d, m, &am, kind);
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
                        worst.push(((v - o).abs(), format!("{name} at phase {ph}: AtP {v:.3}, exact {o:.3}")));
                    }
                }
            }
            worst.sort_by(|a, b| b.0.total_cmp(&a.0));
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
            f.report.paragraph(text);
        }
        // Per-position estimates: rows = query heads, columns = offsets, pooled.
        if cfg.position_band > 0 {
            let mut row_labels = Vec::new();
            let mut matrix = Vec::new();
            for &l in &layers {
                for &h in &heads {
                    let vals: Vec<f64> = (0..cfg.position_band)
                        .map(|o| {
                            d.find(m, &format!("{am}{}", offset_suffix(o)))
                                .find(|r| r.layer == Some(l) && r.head == Some(h) && r.head_kind == Some(HeadKind::Query) && r.phase.is_none())
                                .map_or(f64::NAN, |r| r.value)
                        })
                        .collect();
                    if vals.iter().any(|v| v.is_finite()) {
                        row_labels.push(format!("L{l}H{h}"));
                        matrix.push(vals);
                    }
                }
            }
            if !matrix.is_empty() {
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
                push(&mut f.files, &mut f.report, &format!("AtP estimate of {xm} per query head x position (one position patched at a time)"), fig);
            }
        }
    }
    super::atp_star::draw(cfg, f)
}
