//! `indexer-diagnostics` (DeepSeek-V4 CSA): did the lightning indexer select the
//! entry holding the needle, and does forcing that choice change the answer?
//!
//! For every scored query (the first target position of each clean prompt) and every
//! selected CSA layer: the needle is the value token being copied; its entries are the
//! closed compressed entries whose window holds it (CSA entries overlap: two hold each
//! token, [`crate::analysis::SlotLayout`]). From `attn.indexer.hook_scores` the rank
//! of the best of them among the closed entries (top-k rule: higher score first,
//! lower index among ties; [`crate::analysis::best_rank`]), from `hook_topk` whether
//! one was kept. A wrong answer is a *selection miss* at a layer when the needle's
//! entry was closed but not kept there, a *read miss* when it was kept (the heads did
//! not read it); prompts whose needle entry is not closed yet count as neither. How
//! often the top-k decides anything at that query, and how often its boundary lies
//! within float rounding (`crate::model::topk::near_boundary`).
//!
//! Causal check: `attn.indexer.hook_selected` (1.0 = kept) gets `Action::Add` of +1
//! (force in) or -1 (force out) at the needle's entries, at every target position, in
//! every selected layer at once; accuracy per phase and its change against the clean
//! run, with cluster-bootstrap intervals.

use serde::{Deserialize, Serialize};

use crate::analysis::{Clusters, EntryAlign, SlotLayout, accuracy_clusters, best_rank, per_phase};
use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::LayerKind;
use crate::model::topk::near_boundary;
use crate::output::{BandSeries, Headline, LinePlotSpec, LongRow, line_with_bands};
use crate::tasks::{KvEvalSet, KvExample};

use super::super::experiment::{Experiment, Selection};
use super::super::patching::{Outcome, Prompts, Target, readout};
use super::super::report::{Figures, ci_text, push};
use super::super::rows::{RowCtx, baseline_rows};
use super::{Ctx, Kind, KindOutput, empty_list};
use crate::tasks::prompts::{PromptMeta, clean_prompts};

/// Direction of the forced selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Force {
    /// The needle's entries are read (added to the kept set).
    In,
    /// The needle's entries are not read.
    Out,
}

impl Force {
    /// Metric suffix (`_force_in`).
    pub fn suffix(self) -> &'static str {
        match self {
            Force::In => "_force_in",
            Force::Out => "_force_out",
        }
    }

    fn delta(self) -> f32 {
        match self {
            Force::In => 1.0,
            Force::Out => -1.0,
        }
    }
}

/// `[indexer]` (indexer-diagnostics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexerDiagnostics {
    /// CSA layers (with a lightning indexer). Default all of them.
    pub layers: Selection,
    /// Causal checks. Default both.
    pub force: Vec<Force>,
}

impl Default for IndexerDiagnostics {
    fn default() -> Self {
        IndexerDiagnostics {
            layers: Selection::All,
            force: vec![Force::In, Force::Out],
        }
    }
}

impl Kind for IndexerDiagnostics {
    fn name(&self) -> &'static str {
        "indexer-diagnostics"
    }

    fn section(&self) -> &'static str {
        "indexer"
    }

    fn default_n_logical(&self) -> usize {
        64
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        let mut f = self.force.clone();
        f.dedup();
        if f.len() != self.force.len() {
            return Err(exp.err("indexer", "force", "duplicate entries"));
        }
        Ok(())
    }

    fn accuracy_series(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![("clean", "accuracy".to_string())];
        for f in &self.force {
            let label = match f {
                Force::In => "needle entry forced in",
                Force::Out => "needle entry forced out",
            };
            v.push((label, format!("accuracy{}", f.suffix())));
        }
        v
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

/// The CSA layers (overlapping compression of a DeepSeek-V4 model) of the selection.
fn csa_layers(cfg: &IndexerDiagnostics, ctx: &Ctx) -> Result<Vec<(usize, usize, usize)>> {
    let is_csa = |l: usize| match ctx.info.layers[l].kind {
        LayerKind::Compressed { window, stride, .. } if window > stride => Some((window, stride)),
        _ => None,
    };
    if ctx.info.entry_align() != EntryAlign::End {
        return Err(ctx.exp.err(
            "model",
            "",
            format!(
                "indexer-diagnostics needs a DeepSeek-V4 model with CSA layers (a lightning indexer); {} is {}",
                ctx.mref.name, ctx.info.arch
            ),
        ));
    }
    let all = cfg
        .layers
        .resolve(ctx.info.n_layers(), "layers")
        .map_err(|e| ctx.exp.err("indexer", "layers", e))?;
    let mut out = Vec::new();
    for l in all {
        match (is_csa(l), &cfg.layers) {
            (Some((w, s)), _) => out.push((l, w, s)),
            (None, Selection::Only(_)) => {
                return Err(ctx.exp.err(
                    "indexer",
                    "layers",
                    format!(
                        "layer {l} is not a CSA layer ({}): it has no indexer",
                        ctx.info.layers[l].kind
                    ),
                ));
            }
            (None, Selection::All) => {}
        }
    }
    empty_list(ctx.exp, "indexer", "layers", out.is_empty())?;
    Ok(out)
}

/// Per prompt and target position j, the token being copied.
fn needles(ex: &[&KvExample], key_len: usize, assign: usize) -> Vec<Vec<usize>> {
    ex.iter()
        .map(|e| {
            let b = &e.bindings[e.scored_query().binding];
            let v0 = b.key_pos + key_len + assign;
            (0..e.target_positions.len()).map(|j| v0 + j).collect()
        })
        .collect()
}

/// The closed entries of `layout` holding `needle` for the query at `q`.
fn needle_entries(layout: &SlotLayout, needle: usize, q: usize) -> Vec<usize> {
    let closed = (q + 1) / layout.stride;
    layout
        .entries_holding(needle)
        .into_iter()
        .filter(|&e| e < closed)
        .collect()
}

fn read_f32(act: &Act, what: &str) -> Result<Vec<f32>> {
    let v = act.to_vec();
    if v.is_empty() && act.shape().iter().product::<usize>() != 0 {
        return Err(Error::hook(what, "empty activation"));
    }
    Ok(v)
}

/// A chunk's rows: their prompts' targets and needles, and the prompt length.
struct ChunkRows<'a> {
    rows: &'a [usize],
    targets: Vec<&'a Target>,
    needles: &'a [Vec<usize>],
    /// Tokens per prompt.
    t: usize,
}

/// A layer's entry layout and the shape of its `hook_selected`, for the forced runs.
type ForcedShape = (usize, SlotLayout, Vec<usize>);

/// Capture the indexer's scores, top-k and selection at every layer of `layers`.
fn capture_spec(layers: &[(usize, usize, usize)]) -> HookSpec {
    HookSpec::new().capture_sites(
        layers.iter().map(|&(l, _, _)| l),
        &[
            Site::IndexerScores,
            Site::IndexerTopk,
            Site::IndexerSelected,
        ],
    )
}

/// What one layer of the clean run says about each row: (kept?, rank of the needle's
/// best entry), (closed?, closed entries) and (top-k boundary within rounding?, 1.0 when
/// the top-k decides anything else 0.0).
type LayerOutcomes = (Vec<Outcome>, Vec<Outcome>, Vec<Outcome>);

/// Layer `l` (window `w`, stride `s`) of the clean run: its [`LayerOutcomes`] and the
/// layer's forced shape.
fn layer_outcomes(
    c: &ChunkRows,
    cache: &ActivationCache,
    (l, w, s): (usize, usize, usize),
) -> Result<(LayerOutcomes, ForcedShape)> {
    let t = c.t;
    let get = |site: Site| {
        let p = HookPoint::block(l, site);
        cache
            .get(&p)
            .ok_or_else(|| Error::hook(p.to_string(), "not produced (is this a CSA layer?)"))
    };
    let (scores, topk, sel) = (
        get(Site::IndexerScores)?,
        get(Site::IndexerTopk)?,
        get(Site::IndexerSelected)?,
    );
    let (ss, ks) = (scores.shape().to_vec(), topk.shape().to_vec());
    if ss.len() != 3 || ks.len() != 3 || ss[1] != t || ks[1] != t {
        return Err(Error::hook(
            format!("blocks.{l}.attn.indexer"),
            format!("hook_scores {ss:?} / hook_topk {ks:?} do not cover {t} query positions"),
        ));
    }
    let (n, k) = (ss[2], ks[2]);
    let layout = SlotLayout {
        entries: n,
        window: w,
        stride: s,
        align: EntryAlign::End,
        raw: 0,
        sink: false,
    };
    let (sv, kv) = (
        read_f32(scores, "hook_scores")?,
        read_f32(topk, "hook_topk")?,
    );
    let mut kept = Vec::with_capacity(c.rows.len());
    let mut closed = Vec::with_capacity(c.rows.len());
    let mut near = Vec::with_capacity(c.rows.len());
    for (i, &r) in c.rows.iter().enumerate() {
        let q = c.targets[i].positions[0];
        let ne = needle_entries(&layout, c.needles[r][0], q);
        let row_s = &sv[(i * t + q) * n..][..n];
        let row_k = &kv[(i * t + q) * k..][..k];
        let rank = best_rank(row_s, (q + 1) / s, &ne);
        let is_kept = ne
            .iter()
            .any(|&e| row_k.iter().any(|&x| x >= 0.0 && x as usize == e));
        kept.push(Outcome {
            correct: is_kept,
            ld: rank.map_or(f32::NAN, |x| x as f32),
        });
        closed.push(Outcome {
            correct: !ne.is_empty(),
            ld: ((q + 1) / s).min(n) as f32,
        });
        let boundary = near_boundary(&row_s[..((q + 1) / s).min(n)], k);
        near.push(Outcome {
            correct: boundary == Some(true),
            ld: if boundary.is_some() { 1.0 } else { 0.0 },
        });
    }
    Ok(((kept, closed, near), (l, layout, sel.shape().to_vec())))
}

/// The spec of one forced run: `hook_selected` of every layer gets `f`'s delta at the
/// needle's entries, at every target position of every row.
fn forced_spec(
    c: &ChunkRows,
    f: Force,
    shapes: &[ForcedShape],
    device: &burn::tensor::Device,
) -> Result<HookSpec> {
    let t = c.t;
    let mut spec = HookSpec::new();
    for (l, layout, shape) in shapes {
        let n = shape[2];
        let mut delta = vec![0.0f32; shape.iter().product()];
        for (i, &r) in c.rows.iter().enumerate() {
            for (j, &q) in c.targets[i].positions.iter().enumerate() {
                for e in needle_entries(layout, c.needles[r][j], q) {
                    delta[(i * t + q) * n + e] = f.delta();
                }
            }
        }
        let act = Act::from_vec(delta, shape.clone(), device)?;
        spec = spec.intervene_point(
            HookPoint::block(*l, Site::IndexerSelected),
            Action::Add(act),
            Scope::all(),
        );
    }
    Ok(spec)
}

/// One chunk: the clean outcome; per layer (kept?, rank) and (closed?, closed entries);
/// per force direction the forced outcome.
fn chunk_outcomes(
    ctx: &Ctx,
    cfg: &IndexerDiagnostics,
    prompts: &Prompts,
    rows: &[usize],
    layers: &[(usize, usize, usize)],
    needles: &[Vec<usize>],
) -> Result<Vec<Vec<Outcome>>> {
    let spec = capture_spec(layers);
    let tokens = prompts.tokens_of(rows, &ctx.device);
    let out = ctx.model.forward(tokens.clone(), &spec)?;
    let c = ChunkRows {
        rows,
        targets: rows.iter().map(|&r| &prompts.targets[r]).collect(),
        needles,
        t: prompts.len,
    };
    let mut res = vec![readout(out.logits, &c.targets)?];
    let mut forced_shapes = Vec::new();
    for &layer in layers {
        let ((kept, closed, near), shape) = layer_outcomes(&c, &out.cache, layer)?;
        res.push(kept);
        res.push(closed);
        res.push(near);
        forced_shapes.push(shape);
    }
    for &f in &cfg.force {
        let spec = forced_spec(&c, f, &forced_shapes, &ctx.device)?;
        let o = ctx.model.forward(tokens.clone(), &spec)?;
        res.push(readout(o.logits, &c.targets)?);
    }
    Ok(res)
}

/// One phase group's prompt metas and, per quantity, the outcome of every prompt.
type GroupOutcomes = (Vec<PromptMeta>, Vec<Vec<Outcome>>);

/// Per phase group, the prompt metas and the per-quantity outcomes of every prompt
/// (one shard per group and chunk).
fn evaluate(
    cfg: &IndexerDiagnostics,
    ctx: &mut Ctx,
    set: &KvEvalSet,
    layers: &[(usize, usize, usize)],
) -> Result<Vec<GroupOutcomes>> {
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let key_len = ctx.task.prompt.key_len;
    let phases = ctx.task.phases.clone();
    let total: u64 = phases
        .iter()
        .map(|&r| ctx.examples(set, r).len() as u64)
        .sum();
    let mut shards = ctx.prompt_shards(&format!("{} indexer-diagnostics", ctx.mref.name), total);
    let nq = 1 + PER_LAYER * layers.len() + cfg.force.len();
    let mut groups = Vec::new();
    for &r in &phases {
        let ex = ctx.examples(set, r);
        let (mut prompts, meta) = clean_prompts(&ex, |_| 0);
        // A competing value token per prompt, so that every run also reports the
        // logit difference answer - other (a continuous measure of the forced change).
        let atoms = ctx.task.space.value_atoms();
        for t in &mut prompts.targets {
            t.alt = atoms.iter().copied().find(|&a| a != t.answers[0]);
        }
        let need = needles(&ex, key_len, assign);
        let res = shards.run(
            &format!("p{r}-indexer"),
            prompts.n(),
            nq,
            ctx.max_rows.min(32),
            |rows| chunk_outcomes(ctx, cfg, &prompts, rows, layers, &need),
        )?;
        groups.push((meta, res));
    }
    ctx.finish_shards(shards);
    Ok(groups)
}

/// Quantities per diagnosed layer in a prompt's outcomes ([`LayerOutcomes`]).
const PER_LAYER: usize = 3;

/// `(logical, phase, per-quantity outcomes)` of one prompt.
type PromptObs = (u64, u32, Vec<Outcome>);

/// 1.0 for true, 0.0 for false.
fn b(x: bool) -> f64 {
    f64::from(u8::from(x))
}

/// The mean of a summed quantity.
fn frac(s: &[f64; 1], n: u64) -> f64 {
    s[0] / n as f64
}

/// The outcomes of a run and what their rows need.
struct Summary<'a> {
    rc: &'a RowCtx,
    obs: &'a [PromptObs],
    phases: &'a [u32],
    p: usize,
    reps: usize,
    seed: u64,
}

impl Summary<'_> {
    /// Per-phase rows of `metric` (at `layer`): the mean of `f` over the prompts where
    /// it is defined.
    fn mean_rows(
        &self,
        metric: &str,
        layer: Option<u32>,
        f: &dyn Fn(&[Outcome]) -> Option<f64>,
    ) -> Vec<LongRow> {
        let mut c = Clusters::<1>::new(self.p);
        for (l, r, o) in self.obs {
            if let Some(v) = f(o) {
                c.add(*l, *r, [v]);
            }
        }
        let (per, pooled) = per_phase(&c, frac, self.reps, self.seed);
        self.rc
            .phase_rows(metric, layer.map(|l| (l, None)), self.phases, &per, pooled)
    }

    /// The needle rows of the `li`-th layer `l`: selected, rank, open, the two misses,
    /// and how often the top-k choice is decided at all and within rounding.
    fn layer_rows(&self, li: usize, l: usize) -> Vec<LongRow> {
        let (kq, cq, nq) = (1 + PER_LAYER * li, 2 + PER_LAYER * li, 3 + PER_LAYER * li);
        let l = Some(l as u32);
        let mut rows = self.mean_rows("needle_selected", l, &|o| {
            o[cq].correct.then(|| b(o[kq].correct))
        });
        rows.extend(self.mean_rows("needle_rank", l, &|o| {
            o[cq].correct.then(|| f64::from(o[kq].ld))
        }));
        rows.extend(self.mean_rows("needle_open", l, &|o| Some(b(!o[cq].correct))));
        rows.extend(self.mean_rows("selection_miss", l, &|o| {
            Some(b(!o[0].correct && o[cq].correct && !o[kq].correct))
        }));
        rows.extend(self.mean_rows("read_miss", l, &|o| {
            Some(b(!o[0].correct && o[cq].correct && o[kq].correct))
        }));
        rows.extend(self.mean_rows("topk_deciding", l, &|o| Some(f64::from(o[nq].ld))));
        rows.extend(self.mean_rows("topk_near_boundary", l, &|o| {
            (o[nq].ld > 0.0).then(|| b(o[nq].correct))
        }));
        rows
    }

    /// The rows of forced run `f` (quantity `q`): its accuracy, the accuracy change (pp)
    /// and the logit-difference change against the clean run.
    fn force_rows(&self, f: Force, q: usize) -> Vec<LongRow> {
        let (p, reps, seed) = (self.p, self.reps, self.seed);
        let mut rows = self.mean_rows(&format!("accuracy{}", f.suffix()), None, &|o| {
            Some(b(o[q].correct))
        });
        let mut c = Clusters::<2>::new(p);
        for (l, r, o) in self.obs {
            c.add(*l, *r, [b(o[0].correct), b(o[q].correct)]);
        }
        let (per, pooled) = per_phase(&c, |s, n| 100.0 * (s[1] - s[0]) / n as f64, reps, seed);
        rows.extend(self.rc.phase_rows(
            &format!("acc_change_pp{}", f.suffix()),
            None,
            self.phases,
            &per,
            pooled,
        ));
        let mut c = Clusters::<1>::new(p);
        for (l, r, o) in self.obs {
            let d = f64::from(o[q].ld) - f64::from(o[0].ld);
            if d.is_finite() {
                c.add(*l, *r, [d]);
            }
        }
        let (per, pooled) = per_phase(&c, frac, reps, seed);
        rows.extend(self.rc.phase_rows(
            &format!("logit_diff_change{}", f.suffix()),
            None,
            self.phases,
            &per,
            pooled,
        ));
        rows
    }
}

fn run(cfg: &IndexerDiagnostics, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = csa_layers(cfg, ctx)?;
    let set = ctx.eval_set()?;
    let p = ctx.p();
    let phases = ctx.task.phases.clone();
    let groups = evaluate(cfg, ctx, &set, &layers)?;
    let rc = ctx.rows.clone();
    // (logical, phase, per-quantity outcomes) per prompt.
    let obs: Vec<PromptObs> = groups
        .iter()
        .flat_map(|(meta, res)| {
            meta.iter()
                .enumerate()
                .map(|(i, m)| (m.logical, m.phase, res.iter().map(|q| q[i]).collect()))
                .collect::<Vec<_>>()
        })
        .collect();
    let sum = Summary {
        rc: &rc,
        obs: &obs,
        phases: &phases,
        p,
        reps: ctx.reps(),
        seed: ctx.seed(),
    };
    let acc = accuracy_clusters(p, obs.iter().map(|(l, r, o)| (*l, *r, o[0].correct)));
    let mut rows: Vec<LongRow> = baseline_rows(&rc, "", &acc, &phases, sum.reps, sum.seed);
    for (li, &(l, _, _)) in layers.iter().enumerate() {
        rows.extend(sum.layer_rows(li, l));
    }
    for (fi, &f) in cfg.force.iter().enumerate() {
        rows.extend(sum.force_rows(f, 1 + PER_LAYER * layers.len() + fi));
    }
    Ok(KindOutput {
        tables: vec![("indexer".into(), rows)],
    })
}

/// Per-phase rows of `metric` at `layer` as a band series.
fn layer_series(f: &Figures, metric: &str, layer: u32, name: String) -> Option<BandSeries> {
    let mut pts: Vec<(u32, f64, f64, f64)> = f
        .data
        .find(&f.model, metric)
        .filter(|r| r.layer == Some(layer) && r.head.is_none())
        .filter_map(|r| {
            Some((
                r.phase?,
                r.value,
                r.ci_lo.unwrap_or(r.value),
                r.ci_hi.unwrap_or(r.value),
            ))
        })
        .collect();
    if pts.is_empty() {
        return None;
    }
    pts.sort_by_key(|p| p.0);
    Some(BandSeries {
        name,
        x: pts.iter().map(|p| f64::from(p.0)).collect(),
        y: pts.iter().map(|p| p.1).collect(),
        lo: pts.iter().map(|p| p.2).collect(),
        hi: pts.iter().map(|p| p.3).collect(),
    })
}

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &IndexerDiagnostics, f: &mut Figures) -> Result<()> {
    let m = f.model.clone();
    let mut layers: Vec<u32> = f
        .data
        .find(&m, "needle_selected")
        .filter_map(|r| r.layer)
        .collect();
    layers.sort_unstable();
    layers.dedup();
    f.report.section("Indexer diagnostics");
    f.report.paragraph(
        "Per CSA layer, for the query that reads the answer: whether the lightning indexer kept a \
         closed entry holding the token being copied (needle_selected, over prompts whose needle \
         entry is closed), the rank of the best such entry among the closed entries (0 = top), and \
         the errors split into selection misses (closed but not kept) and read misses (kept, still \
         wrong), as fractions of all prompts. Causal check: hook_selected forced to keep (in) or \
         drop (out) the needle's entries in every selected layer at once; accuracy change in pp.",
    );
    for fo in &cfg.force {
        if let Some(r) = f.data.scalar(&m, &format!("acc_change_pp{}", fo.suffix())) {
            let label = match fo {
                Force::In => "Accuracy change, needle entry forced in",
                Force::Out => "Accuracy change, needle entry forced out",
            };
            let detail = ci_text(r, |v| format!("{v:.1}"));
            f.report
                .headline(Headline::new(label, format!("{:+.1} pp", r.value)).with_detail(detail));
        }
    }
    for &l in &layers {
        layer_figures(f, &m, l)?;
    }
    Ok(())
}

/// Layer `l`'s figures: needle kept, selection and read misses by phase, and the rank
/// of the needle's entry by phase.
fn layer_figures(f: &mut Figures, m: &str, l: u32) -> Result<()> {
    let series: Vec<BandSeries> = [
        ("needle_selected", "needle entry kept"),
        ("selection_miss", "selection miss"),
        ("read_miss", "read miss"),
    ]
    .iter()
    .filter_map(|(metric, name)| layer_series(f, metric, l, name.to_string()))
    .collect();
    if !series.is_empty() {
        let spec = LinePlotSpec {
            series,
            title: format!("{m}: indexer, layer {l}"),
            x_label: "phase of the target key (t_K mod P)".into(),
            y_label: "fraction of prompts (95% CI)".into(),
            y_range: Some((0.0, 1.0)),
            size: None,
        };
        let fig = line_with_bands(f.dir.join(format!("indexer_misses_L{l}")), &spec)?;
        push(
            &mut f.files,
            &mut f.report,
            &format!("Layer {l}: needle kept, selection and read misses by phase"),
            fig,
        );
    }
    if let Some(s) = layer_series(f, "needle_rank", l, format!("layer {l}")) {
        let spec = LinePlotSpec {
            series: vec![s],
            title: format!("{m}: rank of the needle's entry, layer {l}"),
            x_label: "phase of the target key (t_K mod P)".into(),
            y_label: "mean rank among closed entries (0 = top)".into(),
            y_range: None,
            size: None,
        };
        let fig = line_with_bands(f.dir.join(format!("needle_rank_L{l}")), &spec)?;
        push(
            &mut f.files,
            &mut f.report,
            &format!("Layer {l}: rank of the needle's entry by phase"),
            fig,
        );
    }
    Ok(())
}
