//! `gate-cycling`: shift the learned compressor gates by delta offsets, in the selected
//! layers all at once, and compare the observed accuracy profile with the prediction
//! "the baseline profile shifted by delta". Two ways to shift (`roll`):
//!
//! - `bias` (default): only the per-offset gate bias rolls (kvc `key_gate_bias` /
//!   `value_gate_bias`, DeepSeek-V4 `position_bias`, read from the model's weights):
//!   `Action::Add` of `roll(bias, delta) - bias` at `hook_key_gate_logits` /
//!   `hook_value_gate_logits`; every token keeps its own content gate;
//! - `logits`: each token's whole gate (content + bias) rolls across offsets
//!   (`Action::Roll` on axis 2, the offset axis, of `hook_key_gate` / `hook_value_gate`).
//!
//! The prediction:
//! `predicted(r) = acc(r - delta)`. R^2 and MAE per delta and pooled over deltas,
//! with cluster-bootstrap intervals ([`crate::analysis::profile_fit`]).

use std::collections::BTreeMap;

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::analysis::{
    BootstrapCi, DEFAULT_LEVEL, PhaseCluster, ProfileCluster, bootstrap_ci, concatenated_mae,
    concatenated_r2, pooled_mae, profile_fit,
};
use crate::analysis::{Est, accuracy_clusters, per_phase, phase_clusters};
use crate::analysis::{ShiftCluster, separable_ci};
use crate::error::Result;
use crate::hooks::{Act, Action, HookPoint, Site};
use crate::model::LayerKind;
use crate::output::{
    HeadKind, Headline, LinePlotSpec, LongRow, ScatterSeries, ScatterSpec, line_with_bands,
    scatter_predicted_vs_observed,
};

use super::super::exec::Group;
use super::super::experiment::{Experiment, GateKind, Selection};
use super::super::patching::{Cell, Edit};
use super::super::report::{ExperimentData, Figures, accuracy_figure, band_series, ci_text, push};
use super::super::rows::{RowCtx, baseline_rows};
use super::super::setup;
use super::{Ctx, Kind, KindOutput, base_obs};
use crate::tasks::prompts::{PromptMeta, clean_prompts};

/// Metric suffix of a shift: `_d+1`, `_d-2`.
pub fn delta_suffix(d: i64) -> String {
    format!("_d{d:+}")
}

/// What a shift rolls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Roll {
    /// Only the per-offset gate bias (the phase handle). Default.
    #[default]
    Bias,
    /// Each token's whole gate (content gate + bias).
    Logits,
}

/// What one set of shifts rolls at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Per {
    /// The gates of every selected layer together (default; whole-model rows).
    #[default]
    All,
    /// Each selected layer alone (rows at that layer).
    Layer,
    /// Each KV head of each selected layer alone (kvc gates; rows at that KV head).
    Head,
}

/// `[cycling]` (gate-cycling).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateCycling {
    /// Compressed layers whose gates are rolled (all together). Default all.
    pub layers: Selection,
    /// Shifts in offsets. Default -3, -2, -1, 1, 2, 3.
    pub deltas: Vec<i64>,
    /// Which gates are rolled. Default both.
    pub gates: Vec<GateKind>,
    /// Roll the per-offset bias only (default) or each token's whole gate.
    pub roll: Roll,
    /// Roll all selected layers at once (default), each layer alone, or each KV head
    /// of each layer alone.
    pub per: Per,
}

impl Default for GateCycling {
    fn default() -> Self {
        GateCycling {
            layers: Selection::All,
            deltas: vec![-3, -2, -1, 1, 2, 3],
            gates: vec![GateKind::Key, GateKind::Value],
            roll: Roll::Bias,
            per: Per::All,
        }
    }
}

impl Kind for GateCycling {
    fn name(&self) -> &'static str {
        "gate-cycling"
    }

    fn section(&self) -> &'static str {
        "cycling"
    }

    fn default_n_logical(&self) -> usize {
        128
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        if self.deltas.is_empty() {
            return Err(exp.err("cycling", "deltas", "give at least one shift"));
        }
        if self.deltas.contains(&0) {
            return Err(exp.err(
                "cycling",
                "deltas",
                "0 is the baseline; list non-zero shifts",
            ));
        }
        if let Some(d) = self.deltas.iter().find(|d| d.unsigned_abs() > 1 << 20) {
            return Err(exp.err(
                "cycling",
                "deltas",
                format!("{d} is not a shift of a gate window (|delta| <= 1048576)"),
            ));
        }
        if self.gates.is_empty() {
            return Err(exp.err("cycling", "gates", "give \"key\", \"value\" or both"));
        }
        Ok(())
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

/// Warn (and note) for every layer whose rolled offsets are not P: a shift by delta
/// offsets then moves phases by delta only approximately.
fn check_offsets(cfg: &GateCycling, ctx: &mut Ctx, layers: &[usize]) {
    let p = ctx.p();
    for &l in layers {
        if let LayerKind::Compressed { window, stride, .. } = ctx.info.layers[l].kind {
            // The offsets a shift moves: the window's (whole gates, kvc bias) or, for a
            // DeepSeek-V4 bias, the rate's (position_bias has one row per offset in the stride).
            let ds = ctx.info.arch == crate::model::deepseek_v4::MODEL_TYPE;
            let offsets = if cfg.roll == Roll::Bias && ds {
                stride
            } else {
                window
            };
            if offsets != p {
                let w = format!(
                    "layer {l} rolls over {offsets} offsets but P = {p}: rolling by delta offsets shifts phases by delta only when they are equal"
                );
                eprintln!("warning: {w}");
                ctx.notes.push(w);
            }
        }
    }
}

/// Where a unit's rows go: whole model, a layer, or a KV head of a layer.
type At = Option<(u32, Option<(u32, HeadKind)>)>;

/// What one set of shifts rolls at once ([`Per`]).
struct Unit {
    at: At,
    layers: Vec<usize>,
    heads: Option<Vec<usize>>,
}

/// The units of `per` over the selected `layers`.
fn units(cfg: &GateCycling, ctx: &Ctx, layers: &[usize]) -> Vec<Unit> {
    match cfg.per {
        Per::All => vec![Unit {
            at: None,
            layers: layers.to_vec(),
            heads: None,
        }],
        Per::Layer => layers
            .iter()
            .map(|&l| Unit {
                at: Some((l as u32, None)),
                layers: vec![l],
                heads: None,
            })
            .collect(),
        Per::Head => layers
            .iter()
            .flat_map(|&l| {
                (0..ctx.info.n_kv_heads).map(move |h| Unit {
                    at: Some((l as u32, Some((h as u32, HeadKind::Kv)))),
                    layers: vec![l],
                    heads: Some(vec![h]),
                })
            })
            .collect(),
    }
}

/// A row placed at a unit's layer / head.
fn place(r: LongRow, at: At) -> LongRow {
    match at {
        Some((l, Some((h, k)))) => r.at_head(l, h, k),
        Some((l, None)) => r.at_layer(l),
        None => r,
    }
}

/// One edit per shift of `unit`: roll each token's whole gate, or add the
/// rolled-minus-own bias (`biases`: those of every selected layer, read once).
fn shift_edits(cfg: &GateCycling, unit: &Unit, biases: &[GateBias]) -> Vec<Edit> {
    let biases: Vec<&GateBias> = biases
        .iter()
        .filter(|b| b.point.layer.is_some_and(|l| unit.layers.contains(&l)))
        .collect();
    let mut points = Vec::new();
    for &l in &unit.layers {
        for g in &cfg.gates {
            points.push(HookPoint::block(
                l,
                match g {
                    GateKind::Key => Site::KeyGate,
                    GateKind::Value => Site::ValueGate,
                },
            ));
        }
    }
    cfg.deltas
        .iter()
        .map(|&d| match cfg.roll {
            Roll::Logits => Edit::Transform {
                points: points.clone(),
                action: Box::new(Action::Roll { axis: 2, shift: d }),
                heads: unit.heads.clone(),
            },
            Roll::Bias => Edit::TransformEach {
                actions: biases
                    .iter()
                    .map(|b| (b.point, Action::Add(b.delta(d))))
                    .collect(),
                heads: unit.heads.clone(),
            },
        })
        .collect()
}

/// One group per phase: its clean prompts, every shift applied to all of them.
fn shift_groups(ctx: &mut Ctx, edits: &[Edit]) -> Result<(Vec<Group>, Vec<Vec<PromptMeta>>)> {
    let set = ctx.eval_set()?;
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let all: Vec<usize> = (0..prompts.n()).collect();
        let cells = edits
            .iter()
            .map(|e| Cell {
                edit: e.clone(),
                prompts: all.clone(),
            })
            .collect();
        groups.push(Group {
            key: format!("p{r}"),
            prompts,
            cells,
        });
        metas.push(meta);
    }
    Ok((groups, metas))
}

/// A row of a bootstrap interval's estimate.
fn ci_row(rc: &RowCtx, metric: impl Into<String>, ci: &BootstrapCi, n: u64) -> LongRow {
    rc.row(
        metric,
        Est {
            value: ci.estimate,
            ci: Some((ci.lo, ci.hi)),
            n,
        },
    )
}

/// The rows of shift `d` (observed and predicted accuracy per phase, R^2 and MAE of the
/// prediction); returns its profile cluster per logical example.
fn shift_rows(
    ctx: &mut Ctx,
    at: At,
    d: i64,
    obs: Vec<(u64, u32, bool)>,
    base_obs: &[(u64, u32, bool)],
    base_pc: &[PhaseCluster],
    rows: &mut Vec<LongRow>,
) -> Vec<ProfileCluster> {
    let (p, phases) = (ctx.p(), ctx.task.phases.clone());
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let observed = accuracy_clusters(p, obs);
    let predicted = accuracy_clusters(
        p,
        base_obs
            .iter()
            .map(|&(l, ph, ok)| (l, ((ph as i64 + d).rem_euclid(p as i64)) as u32, ok)),
    );
    let sfx = delta_suffix(d);
    let (po, oo) = per_phase(&observed, |s, n| s[0] / n as f64, reps, seed);
    rows.extend(rc.phase_rows(&format!("cycling_observed{sfx}"), at, &phases, &po, oo));
    let (pp, op) = per_phase(&predicted, |s, n| s[0] / n as f64, reps, seed);
    rows.extend(rc.phase_rows(&format!("cycling_predicted{sfx}"), at, &phases, &pp, op));
    let obs_pc = phase_clusters(&observed);
    let clusters: Vec<ProfileCluster> = base_pc
        .iter()
        .zip(obs_pc)
        .map(|(b, o)| ProfileCluster {
            predicted: b.shifted(d),
            observed: o,
        })
        .collect();
    let n = clusters.len() as u64;
    match profile_fit(&clusters, reps, seed, DEFAULT_LEVEL) {
        Ok(fit) => {
            for (m, ci) in [("cycling_r2", fit.r2), ("cycling_mae", fit.mae)] {
                rows.push(place(ci_row(&rc, format!("{m}{sfx}"), &ci, n), at));
            }
        }
        Err(e) => {
            // Typically a constant observed profile: R^2 is undefined, MAE is not.
            let w = format!(
                "{}delta {d:+}: R^2 undefined ({e}); MAE only",
                unit_label(at)
            );
            eprintln!("warning: {w}");
            ctx.notes.push(w);
            if let Ok(ci) = bootstrap_ci(&clusters, pooled_mae, reps, seed, DEFAULT_LEVEL) {
                rows.push(place(ci_row(&rc, format!("cycling_mae{sfx}"), &ci, n), at));
            }
        }
    }
    clusters
}

/// `layer 2, ` / `layer 2 KV head 1, ` / nothing for the whole model.
fn unit_label(at: At) -> String {
    match at {
        Some((l, Some((h, _)))) => format!("layer {l} KV head {h}, "),
        Some((l, None)) => format!("layer {l}, "),
        None => String::new(),
    }
}

/// What must hold before anything runs or is written: every phase selected (a shift
/// predicts phase r + delta from phase r), and no per-KV-head cycling on DeepSeek-V4.
fn check_config(cfg: &GateCycling, ctx: &Ctx) -> Result<()> {
    let p = ctx.p();
    if ctx.task.phases.len() < p {
        return Err(ctx.exp.err(
            "task",
            "phases",
            format!(
                "gate-cycling compares the accuracy profile over all P = {p} phases (a shift by delta predicts phase r + delta from phase r); {} selected: leave `phases` at \"all\"",
                ctx.task.phases.len()
            ),
        ));
    }
    if cfg.per == Per::Head && ctx.info.arch == crate::model::deepseek_v4::MODEL_TYPE {
        return Err(ctx.exp.err(
            "cycling",
            "per",
            "DeepSeek-V4's compressor gates have no KV-head axis (one position_bias per layer); use per = \"layer\" or \"all\"",
        ));
    }
    Ok(())
}

fn run(cfg: &GateCycling, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = setup::layers(ctx.exp, "cycling", &cfg.layers, &ctx.info, true)?;
    let p = ctx.p();
    check_config(cfg, ctx)?;
    check_offsets(cfg, ctx, &layers);
    let biases = match cfg.roll {
        Roll::Bias => gate_biases(ctx, &layers, &cfg.gates)?,
        Roll::Logits => Vec::new(),
    };
    let units = units(cfg, ctx, &layers);
    let edits: Vec<Edit> = units
        .iter()
        .flat_map(|u| shift_edits(cfg, u, &biases))
        .collect();
    let (groups, metas) = shift_groups(ctx, &edits)?;
    let results = ctx.execute(&format!("{} gate-cycling", ctx.mref.name), &groups)?;
    let phases = ctx.task.phases.clone();
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let base_obs_all: Vec<(u64, u32, bool)> = metas
        .iter()
        .zip(&results)
        .flat_map(|(m, r)| base_obs(m, r).collect::<Vec<_>>())
        .collect();
    let base = accuracy_clusters(p, base_obs_all.clone());
    let mut rows: Vec<LongRow> = baseline_rows(&rc, "", &base, &phases, reps, seed);
    let base_pc = phase_clusters(&base);
    let nd = cfg.deltas.len();
    for (ui, unit) in units.iter().enumerate() {
        // Per logical example (in logical order), one profile cluster per delta.
        let mut per_example: Vec<Vec<ProfileCluster>> = vec![Vec::new(); base_pc.len()];
        for (di, &d) in cfg.deltas.iter().enumerate() {
            let obs: Vec<(u64, u32, bool)> = metas
                .iter()
                .zip(&results)
                .flat_map(|(meta, res)| {
                    meta.iter()
                        .zip(&res.cells[ui * nd + di])
                        .map(|(m, o)| (m.logical, m.phase, o.correct))
                        .collect::<Vec<_>>()
                })
                .collect();
            let clusters = shift_rows(ctx, unit.at, d, obs, &base_obs_all, &base_pc, &mut rows);
            for (e, c) in per_example.iter_mut().zip(&clusters) {
                e.push(c.clone());
            }
        }
        // Pooled over deltas: the concatenated predicted and observed profiles.
        let n = per_example.len() as u64;
        type Stat = fn(&[&Vec<ProfileCluster>]) -> f64;
        for (m, f) in [
            ("cycling_r2", concatenated_r2 as Stat),
            ("cycling_mae", concatenated_mae as Stat),
        ] {
            if let Ok(ci) = bootstrap_ci(&per_example, f, reps, seed, DEFAULT_LEVEL) {
                rows.push(place(ci_row(&rc, m, &ci, n), unit.at));
            }
        }
        let shift_clusters: Vec<ShiftCluster> = base_pc
            .iter()
            .zip(&per_example)
            .map(|(b, e)| ShiftCluster {
                base: b.clone(),
                shifted: e.iter().map(|c| c.observed.clone()).collect(),
            })
            .collect();
        rows.extend(
            two_factor_rows(&rc, &cfg.deltas, &shift_clusters, &phases, reps, seed)
                .into_iter()
                .map(|r| place(r, unit.at)),
        );
    }
    Ok(KindOutput {
        tables: vec![("cycling".into(), rows)],
    })
}

/// The two-factor fit of all profiles ([`crate::analysis::separable`]): R^2 of the
/// fixed-only, moving-only and product models (`cycling_r2_fixed`, `cycling_r2_moving`,
/// `cycling_r2_both`), and the product's factors per phase (`cycling_fixed_factor`:
/// what the roll does not move; `cycling_moving_factor`: what moves with it, at the
/// unshifted offset), each with a cluster-bootstrap interval. Nothing when the fit is
/// undefined (e.g. every profile constant).
fn two_factor_rows(
    rc: &RowCtx,
    deltas: &[i64],
    clusters: &[ShiftCluster],
    phases: &[u32],
    reps: usize,
    seed: u64,
) -> Vec<LongRow> {
    let Ok(ci) = separable_ci(deltas, clusters, reps, seed, DEFAULT_LEVEL) else {
        return Vec::new();
    };
    let n = clusters.len() as u64;
    let p = (ci.len() - 3) / 2;
    let mut rows = Vec::new();
    for (i, m) in ["cycling_r2_fixed", "cycling_r2_moving", "cycling_r2_both"]
        .iter()
        .enumerate()
    {
        if ci[i].estimate.is_finite() {
            rows.push(ci_row(rc, *m, &ci[i], n));
        }
    }
    for (k, m) in ["cycling_fixed_factor", "cycling_moving_factor"]
        .iter()
        .enumerate()
    {
        for &r in phases {
            let c = &ci[3 + k * p + r as usize];
            rows.push(ci_row(rc, *m, c, n).at_phase(r));
        }
    }
    rows
}

/// One layer's learned per-offset gate bias and where it lands in the gate logits.
struct GateBias {
    /// `hook_key_gate_logits` / `hook_value_gate_logits` of the layer.
    point: HookPoint,
    /// `[offsets, columns]`: kvc `[W, kv_heads]`; DeepSeek-V4 `[rate, halves * dim]`.
    bias: Tensor<2>,
    /// kvc vector gates (a channel axis after the KV-head axis).
    vector: bool,
    /// DeepSeek-V4: `Some((halves, dim))` (CSA: 2 halves, slots 0..m read the A half).
    deepseek: Option<(usize, usize)>,
}

impl GateBias {
    /// `roll(bias, delta) - bias` along the offset axis, shaped to broadcast over the
    /// gate logits `[batch, entry, slot, kv_head (, channel)]`.
    fn delta(&self, d: i64) -> Act {
        let diff = self.bias.clone().roll_dim(d, 0) - self.bias.clone();
        let [m, c] = diff.dims();
        match self.deepseek {
            Some((2, dim)) => {
                let slots = Tensor::cat(
                    vec![
                        diff.clone().slice_dim(1, 0..dim),
                        diff.slice_dim(1, dim..2 * dim),
                    ],
                    0,
                );
                Act::new(slots.reshape([1, 1, 2 * m, 1, dim]))
            }
            Some(_) => Act::new(diff.reshape([1, 1, m, 1, c])),
            None if self.vector => Act::new(diff.reshape([1, 1, m, c, 1])),
            None => Act::new(diff.reshape([1, 1, m, c])),
        }
    }
}

/// The learned gate biases of `layers` x `gates`, read from the model's weights (the
/// model directory is loaded a second time, as its concrete type).
fn gate_biases(ctx: &Ctx, layers: &[usize], gates: &[GateKind]) -> Result<Vec<GateBias>> {
    let dir = &ctx.mref.dir;
    let point = |l: usize, g: &GateKind| {
        HookPoint::block(
            l,
            match g {
                GateKind::Key => Site::KeyGateLogits,
                GateKind::Value => Site::ValueGateLogits,
            },
        )
    };
    let mut out = Vec::new();
    if ctx.info.arch == crate::model::deepseek_v4::MODEL_TYPE {
        let m = crate::model::deepseek_v4::load(dir, &ctx.device)?;
        for &l in layers {
            let Some(c) = m.model.layers[l].self_attn.compressor.as_ref() else {
                return Err(ctx.exp.err(
                    "cycling",
                    "layers",
                    format!("layer {l} has no compressor"),
                ));
            };
            let p = &c.pooler;
            for g in gates {
                out.push(GateBias {
                    point: point(l, g),
                    bias: p.position_bias.val(),
                    vector: true,
                    deepseek: Some((if p.overlap { 2 } else { 1 }, p.dim)),
                });
            }
        }
        return Ok(out);
    }
    let m = crate::model::load_kvc(dir, &ctx.device)?;
    let vector = matches!(
        m.config.compression.as_ref().map(|c| c.gate),
        Some(crate::model::kvc::GateMode::Vector)
    );
    for &l in layers {
        for g in gates {
            let c = m.blocks[l].attn.compressor.as_ref();
            let bias = c.and_then(|c| match g {
                GateKind::Key => c.key_gate_bias.as_ref(),
                GateKind::Value => c.value_gate_bias.as_ref(),
            });
            let Some(bias) = bias else {
                return Err(ctx.exp.err(
                    "cycling",
                    "roll",
                    format!(
                        "layer {l} has no learned {} gate bias (uniform gates or gate_bias = false): nothing to roll; roll = \"logits\" rolls the whole gates",
                        g.name()
                    ),
                ));
            };
            out.push(GateBias {
                point: point(l, g),
                bias: bias.val(),
                vector,
                deepseek: None,
            });
        }
    }
    Ok(out)
}

/// An interval as `95% CI [lo, hi]` with three decimals (empty without one).
fn fmt_ci(r: &LongRow) -> String {
    ci_text(r, |v| format!("{v:.3}"))
}

/// This kind's figures and report section, from its tables alone.
fn draw(cfg: &GateCycling, f: &mut Figures) -> Result<()> {
    let (d, m, phases, dir) = (f.data, f.model.clone(), f.phases.clone(), f.dir);
    let m = m.as_str();
    intro(cfg, f);
    let mut rows_tbl = Vec::new();
    let mut series = Vec::new();
    let mut lines = vec![("baseline".to_string(), "accuracy".to_string())];
    for &dl in &cfg.deltas {
        let Some((s, row)) = shift_summary(d, m, &phases, dl) else {
            continue;
        };
        series.push(s);
        lines.push((
            format!("observed, delta {dl:+}"),
            format!("cycling_observed{}", delta_suffix(dl)),
        ));
        rows_tbl.push(row);
    }
    if !rows_tbl.is_empty() {
        f.report.table(
            "Agreement per shift",
            ["delta", "R^2", "R^2 CI", "MAE", "MAE CI"]
                .map(String::from)
                .to_vec(),
            rows_tbl,
        );
    }
    if !series.is_empty() {
        cycling_scatter(f, series)?;
    }
    two_factor_section(f)?;
    unit_table(f);
    let series: Vec<(&str, String)> = lines.iter().map(|(a, b)| (a.as_str(), b.clone())).collect();
    if let Some(fig) = accuracy_figure(
        &dir.join("cycling_profiles"),
        d,
        m,
        &series,
        &format!("{m}: accuracy by phase with rolled gates"),
    )? {
        push(
            &mut f.files,
            &mut f.report,
            "Accuracy profiles with rolled gates",
            fig,
        );
    }
    Ok(())
}

/// The section's heading, what was rolled and how to read the numbers, and the pooled
/// R^2 and MAE headlines.
fn intro(cfg: &GateCycling, f: &mut Figures) {
    let (d, m, report) = (f.data, f.model.as_str(), &mut f.report);
    report.section("Gate cycling");
    report.paragraph(
        match cfg.roll {
            Roll::Bias => "Only the per-offset gate bias of the selected layers is rolled by delta offsets (each token keeps its own content gate; roll = \"bias\"). ",
            Roll::Logits => "Each token's whole gate (content + bias) in the selected layers is rolled by delta offsets (roll = \"logits\"). ",
        }
        .to_string()
            + "Prediction: the baseline \
         accuracy profile shifted by delta, predicted(r) = acc(r - delta). R^2 (of the prediction itself, \
         no fitted slope) and MAE with 95% cluster-bootstrap intervals. R^2 divides by the spread of \
         the observed profile: when shifted gates flatten the profile (e.g. the model fails at every \
         phase) it is undefined or hugely negative, and MAE is the number to read.",
    );
    for (metric, label) in [
        ("cycling_r2", "R^2 (all shifts)"),
        ("cycling_mae", "MAE (all shifts)"),
    ] {
        if let Some(r) = d.scalar(m, metric) {
            report.headline(Headline::new(label, format!("{:.3}", r.value)).with_detail(fmt_ci(r)));
        }
    }
}

/// Per layer / KV head (`per = "layer"` / `"head"`): each unit's pure-shift R^2 and
/// MAE and its two-factor fits, one row per unit.
fn unit_table(f: &mut Figures) {
    let (d, m) = (f.data, f.model.clone());
    let m = m.as_str();
    let key = |r: &LongRow| (r.layer, r.head);
    let mut units: Vec<(Option<u32>, Option<u32>)> = d
        .find(m, "cycling_mae")
        .filter(|r| r.layer.is_some() && r.phase.is_none())
        .map(key)
        .collect();
    units.sort();
    units.dedup();
    if units.is_empty() {
        return;
    }
    let cell = |metric: &str, u: (Option<u32>, Option<u32>)| {
        d.find(m, metric)
            .find(|r| key(r) == u && r.phase.is_none())
            .map_or("n/a".to_string(), |r| {
                format!("{:.3} {}", r.value, fmt_ci(r))
                    .trim_end()
                    .to_string()
            })
    };
    let rows = units
        .iter()
        .map(|&u| {
            let unit = match u {
                (Some(l), Some(h)) => format!("layer {l}, KV head {h}"),
                (Some(l), None) => format!("layer {l}"),
                _ => "model".into(),
            };
            vec![
                unit,
                cell("cycling_r2", u),
                cell("cycling_mae", u),
                cell("cycling_r2_fixed", u),
                cell("cycling_r2_moving", u),
                cell("cycling_r2_both", u),
            ]
        })
        .collect();
    f.report.table(
        "Each unit rolled alone: pure-shift R^2 and MAE, and the two-factor fits (R^2), with 95% cluster-bootstrap intervals",
        [
            "rolled",
            "R^2 (shift)",
            "MAE (shift)",
            "R^2 fixed",
            "R^2 moving",
            "R^2 both",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    );
}

/// What moves with the gates: the fixed / moving / product fits and the product's two
/// factors per phase (rows of [`two_factor_rows`]); nothing without them.
fn two_factor_section(f: &mut Figures) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let m = m.as_str();
    let models = [
        ("cycling_r2_fixed", "fixed: A_d(r) = f(r)", "P"),
        ("cycling_r2_moving", "moving: A_d(r) = g(r - d)", "P"),
        ("cycling_r2_both", "both: A_d(r) = f(r) g(r - d)", "2P - 1"),
    ];
    let rows: Vec<Vec<String>> = models
        .iter()
        .filter_map(|(metric, label, params)| {
            let r = d.scalar(m, metric)?;
            Some(vec![
                label.to_string(),
                params.to_string(),
                format!("{:.3}", r.value),
                fmt_ci(r),
            ])
        })
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    f.report.section("What moves with the gates");
    f.report.paragraph(
        "Every profile (the clean one, delta = 0, and each shift) fitted at once by least squares \
         with three models: a profile the roll does not move (fixed), one that moves with it as a \
         whole (moving, with the moving profile fitted rather than taken from the clean run), and \
         the product of a fixed and a moving factor (both must pass: e.g. a binding split by a window \
         boundary fails at its phase whatever the gates weigh, while an offset the gates under-weight \
         moves with them). R^2 over all (shift, phase) cells, 95% cluster-bootstrap intervals over \
         logical examples. The product's factors are drawn below (moving factor at the unshifted \
         offset, max 1).",
    );
    f.report.table(
        "Two-factor fit of the cycling profiles",
        ["model", "free parameters", "R^2", "R^2 CI"]
            .map(String::from)
            .to_vec(),
        rows,
    );
    let series: Vec<_> = [
        ("cycling_fixed_factor", "fixed factor f(r)"),
        ("cycling_moving_factor", "moving factor g(r)"),
    ]
    .iter()
    .filter_map(|(metric, name)| band_series(d, m, metric, name))
    .collect();
    if series.is_empty() {
        return Ok(());
    }
    let spec = LinePlotSpec {
        series,
        title: format!("{m}: fixed and moving factors of the accuracy profile"),
        x_label: "phase r (moving factor: offset before the shift)".into(),
        y_label: "factor, accuracy = f(r) g(r - delta) (95% CI)".into(),
        y_range: None,
        size: None,
    };
    let fig = line_with_bands(dir.join("cycling_factors"), &spec)?;
    push(
        &mut f.files,
        &mut f.report,
        "The product model's factors: f does not move with the gates, g does",
        fig,
    );
    Ok(())
}

/// Shift `dl`'s predicted vs observed accuracy per phase and its row of the agreement
/// table (R^2, MAE and their intervals); None without observed rows.
fn shift_summary(
    d: &ExperimentData,
    m: &str,
    phases: &[u32],
    dl: i64,
) -> Option<(ScatterSeries, Vec<String>)> {
    let sfx = delta_suffix(dl);
    let pred: BTreeMap<u32, f64> = d
        .find(m, &format!("cycling_predicted{sfx}"))
        .filter_map(|r| Some((r.phase?, r.value)))
        .collect();
    let obs: BTreeMap<u32, f64> = d
        .find(m, &format!("cycling_observed{sfx}"))
        .filter_map(|r| Some((r.phase?, r.value)))
        .collect();
    if obs.is_empty() {
        return None;
    }
    let series = ScatterSeries {
        name: format!("delta {dl:+}"),
        predicted: phases
            .iter()
            .map(|p| pred.get(p).copied().unwrap_or(f64::NAN))
            .collect(),
        observed: phases
            .iter()
            .map(|p| obs.get(p).copied().unwrap_or(f64::NAN))
            .collect(),
    };
    let r2 = d.scalar(m, &format!("cycling_r2{sfx}"));
    let mae = d.scalar(m, &format!("cycling_mae{sfx}"));
    let row = vec![
        format!("{dl:+}"),
        r2.map_or("n/a".into(), |r| format!("{:.3}", r.value)),
        r2.map_or(String::new(), fmt_ci),
        mae.map_or("n/a".into(), |r| format!("{:.3}", r.value)),
        mae.map_or(String::new(), fmt_ci),
    ];
    Some((series, row))
}

/// Predicted vs observed per-phase accuracy, one point per phase and shift.
fn cycling_scatter(f: &mut Figures, series: Vec<ScatterSeries>) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.as_str(), f.dir);
    let r2_text = match (d.scalar(m, "cycling_r2"), d.scalar(m, "cycling_mae")) {
        (Some(a), Some(b)) => {
            let ci = |r: &LongRow| match (r.ci_lo, r.ci_hi) {
                (Some(lo), Some(hi)) => format!(" [{lo:.3}, {hi:.3}]"),
                _ => String::new(),
            };
            Some(format!(
                "R² = {:.3}{}, MAE = {:.3}{}",
                a.value,
                ci(a),
                b.value,
                ci(b)
            ))
        }
        _ => None,
    };
    let spec = ScatterSpec {
        series,
        title: format!("{m}: gate cycling"),
        x_label: "predicted accuracy (baseline shifted by delta)".into(),
        y_label: "observed accuracy with rolled gates".into(),
        r2_text,
        size: None,
    };
    let fig = scatter_predicted_vs_observed(dir.join("cycling_scatter"), &spec)?;
    push(
        &mut f.files,
        &mut f.report,
        "Predicted vs observed per-phase accuracy, one point per phase and shift",
        fig,
    );
    Ok(())
}
