//! `gate-profiles`: statistics of the compressor's pooling weights per layer x KV
//! head, for key and value gates, captured over the evaluation prompts of every
//! phase group ([`crate::analysis::gate_stats`]):
//!
//! - `g(r) = W * E[a][r]` per offset r (1 = the uniform share),
//! - `exp(H(E[a]))`: offsets the mean gate uses,
//! - `E[exp(H(a))]`: offsets a single window uses.
//!
//! With `[gates] checkpoints = "<run>/checkpoints"` the same statistics are computed
//! at every `step-*` checkpoint (rows with `model = "<name>@<step>"`), giving their
//! trajectories over training. Gate weights are captured, never intervened on, so
//! this kind runs no cells and is cheap; it does not keep shards.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::analysis::gate_stats;
use crate::analysis::{Est, accuracy_clusters};
use crate::error::{Error, Result, ResultExt};
use crate::hooks::{ActivationCache, HookPoint, Site};
use crate::model::{LanguageModel, load_model};
use crate::output::{
    BandSeries, BarProfileSpec, HeadKind, Headline, HeatmapSpec, LinePlotSpec, LongRow, Report,
    bar_profile, heatmap, line_with_bands,
};
use crate::tasks::KvEvalSet;

use super::super::experiment::{GateKind, Selection};
use super::super::patching::base_run_with;
use super::super::progress::Progress;
use super::super::report::{ExperimentData, Figures, push};
use super::super::rows::{RowCtx, baseline_rows};
use super::super::setup;
use super::{Ctx, Kind, KindOutput};
use crate::tasks::prompts::clean_prompts;

const GATES: [(GateKind, Site); 2] = [
    (GateKind::Key, Site::KeyGate),
    (GateKind::Value, Site::ValueGate),
];

/// Checkpoint folders `step-*` of a run, sorted by step.
pub fn checkpoint_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut out: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path()
                .join("config.json")
                .exists()
                .then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Gate weights per (layer, gate index, KV head): (W, the captured weights as rows of W
/// offsets).
type GateWeights = BTreeMap<(usize, usize, usize), (usize, Vec<f64>)>;

/// One prompt's outcome: (logical example, phase, correct).
type Obs = (u64, u32, bool);

/// Gate rows of one model, and its `(logical, phase, correct)` outcomes.
fn profile(
    model: &dyn LanguageModel,
    rc: &RowCtx,
    ctx: &Ctx,
    set: &KvEvalSet,
    layers: &[usize],
    progress: &mut Progress,
) -> Result<(Vec<LongRow>, Vec<Obs>)> {
    // weights[(layer, gate, kv head)] = rows of W offsets.
    let mut weights: GateWeights = Default::default();
    let mut obs = Vec::new();
    let points: Vec<HookPoint> = layers
        .iter()
        .flat_map(|&l| GATES.iter().map(move |(_, s)| HookPoint::block(l, *s)))
        .collect();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let base = base_run_with(model, &prompts, &points, false)?;
        obs.extend(
            meta.iter()
                .zip(&base.outcomes)
                .map(|(m, o)| (m.logical, m.phase, o.correct)),
        );
        add_weights(&base.cache, layers, &mut weights)?;
        progress.inc(1);
    }
    Ok((gate_rows(rc, weights)?, obs))
}

/// Append the captured gate weights of `layers` to `weights`, per KV head in
/// (batch, entry, channel) order.
fn add_weights(cache: &ActivationCache, layers: &[usize], weights: &mut GateWeights) -> Result<()> {
    for &l in layers {
        for (gi, (_, site)) in GATES.iter().enumerate() {
            let act = cache
                .get(&HookPoint::block(l, *site))
                .expect("captured by the base run");
            let s = act.shape().to_vec();
            if s.len() < 4 {
                return Err(Error::hook(
                    HookPoint::block(l, *site).to_string(),
                    format!("expected [batch, entry, offset, kv_head(, d)], got {s:?}"),
                ));
            }
            let (b, e, w, h) = (s[0], s[1], s[2], s[3]);
            let d: usize = s[4..].iter().product();
            let v = act.to_vec();
            for kv in 0..h {
                let slot = weights.entry((l, gi, kv)).or_insert((w, Vec::new()));
                for bi in 0..b {
                    for ei in 0..e {
                        for di in 0..d {
                            for o in 0..w {
                                let idx = (((bi * e + ei) * w + o) * h + kv) * d + di;
                                slot.1.push(v[idx] as f64);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// The gate statistics of every (layer, gate, KV head) as rows: g per offset and the two
/// effective numbers of offsets.
fn gate_rows(rc: &RowCtx, weights: GateWeights) -> Result<Vec<LongRow>> {
    let mut rows = Vec::new();
    for ((l, gi, kv), (w, a)) in weights {
        let name = GATES[gi].0.name();
        if a.is_empty() {
            continue;
        }
        let st =
            gate_stats(&a, w).context_with(|| format!("layer {l} {name} gate, KV head {kv}"))?;
        let n = st.num_windows as u64;
        let at = |r: LongRow| r.at_head(l as u32, kv as u32, HeadKind::Kv);
        for (o, g) in st.g.iter().enumerate() {
            rows.push(
                at(rc.row(
                    format!("{name}_gate_g"),
                    Est {
                        value: *g,
                        ci: None,
                        n,
                    },
                ))
                .at_phase(o as u32),
            );
        }
        for (m, v) in [
            ("exp_entropy_of_mean", st.exp_entropy_of_mean),
            ("mean_exp_entropy", st.mean_exp_entropy),
        ] {
            rows.push(at(rc.row(
                format!("{name}_gate_{m}"),
                Est {
                    value: v,
                    ci: None,
                    n,
                },
            )));
        }
    }
    Ok(rows)
}

/// `[gates]` (gate-profiles).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateProfiles {
    /// Compressed layers. Default all compressed layers.
    pub layers: Selection,
    /// A training run's checkpoint folder (`step-*` subfolders), relative to this
    /// file: the statistics are also computed at every checkpoint.
    pub checkpoints: Option<PathBuf>,
}

impl Kind for GateProfiles {
    fn name(&self) -> &'static str {
        "gate-profiles"
    }

    fn section(&self) -> &'static str {
        "gates"
    }

    fn default_n_logical(&self) -> usize {
        32
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

fn run(cfg: &GateProfiles, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = setup::layers(ctx.exp, "gates", &cfg.layers, &ctx.info, true)?;
    let set = ctx.eval_set()?;
    let checkpoints = match &cfg.checkpoints {
        Some(c) => {
            let dir = ctx.exp.base_dir().join(c);
            if !dir.is_dir() {
                return Err(ctx.exp.err(
                    "gates",
                    "checkpoints",
                    format!("{} is not a folder", dir.display()),
                ));
            }
            let list = checkpoint_dirs(&dir)?;
            if list.is_empty() {
                return Err(ctx.exp.err(
                    "gates",
                    "checkpoints",
                    format!(
                        "no step-* checkpoint with a config.json in {}",
                        dir.display()
                    ),
                ));
            }
            list
        }
        None => Vec::new(),
    };
    let groups = ctx.task.phases.len() as u64;
    let mut progress = Progress::new(
        ctx.opts.progress,
        &format!("{} gate-profiles", ctx.mref.name),
        "groups",
        groups * (1 + checkpoints.len() as u64),
    );
    let rc = ctx.rows.clone();
    let (mut rows, obs) = profile(ctx.model, &rc, ctx, &set, &layers, &mut progress)?;
    let (p, reps, seed) = (ctx.p(), ctx.reps(), ctx.seed());
    rows.extend(baseline_rows(
        &rc,
        "",
        &accuracy_clusters(p, obs),
        &ctx.task.phases,
        reps,
        seed,
    ));
    for (step, dir) in &checkpoints {
        let m = load_model(dir, &ctx.device)?;
        let rc_step = RowCtx {
            model: format!("{}@{step}", rc.model),
            ..rc.clone()
        };
        let (r, _) = profile(m.as_ref(), &rc_step, ctx, &set, &layers, &mut progress)?;
        rows.extend(r);
    }
    progress.finish();
    Ok(KindOutput {
        tables: vec![("gates".into(), rows)],
    })
}

/// Gate profiles: (layer, KV head, gate) -> g per offset.
type Profiles = BTreeMap<(u32, u32, &'static str), BTreeMap<u32, f64>>;

/// The pooled value of a per-head metric of `model`, NaN when absent.
fn head_val(d: &ExperimentData, metric: &str, model: &str, l: u32, h: u32) -> f64 {
    d.find(model, metric)
        .find(|r| r.layer == Some(l) && r.head == Some(h) && r.phase.is_none())
        .map_or(f64::NAN, |r| r.value)
}

/// This kind's figures and report section, from its tables alone.
fn draw(_cfg: &GateProfiles, f: &mut Figures) -> Result<()> {
    let (d, m) = (f.data, f.model.as_str());
    f.report.section("Gate profiles");
    f.report.paragraph(
        "g(r) = W x E[a][r], the mean gate weight at offset r relative to the uniform share (1 = uniform); \
         exp(H(E[a])) = offsets the mean gate uses; E[exp(H(a))] = offsets a single window uses.",
    );
    // Gate rows: (layer, kv, gate) -> g per offset.
    let mut profiles: Profiles = BTreeMap::new();
    for g in ["key", "value"] {
        for r in d.find(m, &format!("{g}_gate_g")) {
            if let (Some(l), Some(h), Some(o)) = (r.layer, r.head, r.phase) {
                profiles.entry((l, h, g)).or_default().insert(o, r.value);
            }
        }
    }
    if profiles.is_empty() {
        return Ok(());
    }
    let w = profiles.values().map(|p| p.len()).max().unwrap_or(0) as u32;
    peak_headline(&mut f.report, &profiles);
    profile_figures(f, &profiles, w)?;
    // Effective numbers of offsets.
    let keys: BTreeSet<(u32, u32)> = profiles.keys().map(|(l, h, _)| (*l, *h)).collect();
    entropy_heatmap(f, &keys, w)?;
    trajectory(f, &keys, w)
}

/// Headline: the gate with the largest g at any offset.
fn peak_headline(report: &mut Report, profiles: &Profiles) {
    if let Some(((l, h, g), prof)) = profiles.iter().max_by(|a, b| {
        let ma = a.1.values().copied().fold(0.0, f64::max);
        let mb = b.1.values().copied().fold(0.0, f64::max);
        ma.total_cmp(&mb)
    }) {
        let (o, v) = prof
            .iter()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(o, v)| (*o, *v))
            .unwrap_or((0, f64::NAN));
        report.headline(
            Headline::new(
                "Most peaked gate",
                format!("layer {l}, KV head {h}, {g} gate"),
            )
            .with_detail(format!("g({o}) = {v:.2} (1 = uniform)")),
        );
    }
}

/// The heatmap of every gate profile g(r) (offsets `0..w`) and bar charts of the first
/// eight.
fn profile_figures(f: &mut Figures, profiles: &Profiles, w: u32) -> Result<()> {
    let (m, dir) = (f.model.clone(), f.dir);
    let spec = HeatmapSpec {
        matrix: profiles
            .values()
            .map(|p| {
                (0..w)
                    .map(|o| p.get(&o).copied().unwrap_or(f64::NAN))
                    .collect()
            })
            .collect(),
        row_labels: profiles
            .keys()
            .map(|(l, h, g)| format!("L{l} KV{h} {g}"))
            .collect(),
        col_labels: (0..w).map(|o| o.to_string()).collect(),
        title: format!("{m}: gate profile g(r) per layer, KV head and gate"),
        x_label: "offset r in the window".into(),
        y_label: "layer, KV head, gate".into(),
        colorbar_label: "g(r) (1 = uniform share)".into(),
        diverging: false,
        range: None,
        annotate: true,
        size: None,
    };
    let fig = heatmap(dir.join("gate_g"), &spec)?;
    push(&mut f.files, &mut f.report, "Gate profiles g(r)", fig);
    for ((l, h, g), prof) in profiles.iter().take(8) {
        let spec = BarProfileSpec {
            labels: (0..w).map(|o| o.to_string()).collect(),
            values: (0..w)
                .map(|o| prof.get(&o).copied().unwrap_or(f64::NAN))
                .collect(),
            title: format!("{m}: layer {l}, KV head {h}, {g} gate"),
            x_label: "offset r in the window".into(),
            y_label: "g(r)".into(),
            reference: Some(1.0),
            reference_label: Some("uniform share".into()),
            size: None,
        };
        let fig = bar_profile(dir.join(format!("gate_profile_L{l}_KV{h}_{g}")), &spec)?;
        push(
            &mut f.files,
            &mut f.report,
            &format!("g(r), layer {l}, KV head {h}, {g} gate"),
            fig,
        );
    }
    Ok(())
}

/// Effective numbers of offsets (both statistics, both gates) per layer x KV head.
fn entropy_heatmap(f: &mut Figures, keys: &BTreeSet<(u32, u32)>, w: u32) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let metrics = [
        ("key_gate_exp_entropy_of_mean", "key exp(H(E[a]))"),
        ("key_gate_mean_exp_entropy", "key E[exp(H(a))]"),
        ("value_gate_exp_entropy_of_mean", "value exp(H(E[a]))"),
        ("value_gate_mean_exp_entropy", "value E[exp(H(a))]"),
    ];
    let spec = HeatmapSpec {
        matrix: keys
            .iter()
            .map(|&(l, h)| {
                metrics
                    .iter()
                    .map(|(mt, _)| head_val(d, mt, &m, l, h))
                    .collect()
            })
            .collect(),
        row_labels: keys.iter().map(|(l, h)| format!("L{l} KV{h}")).collect(),
        col_labels: metrics.iter().map(|(_, n)| n.to_string()).collect(),
        title: format!("{m}: effective number of offsets"),
        x_label: "statistic".into(),
        y_label: "layer, KV head".into(),
        colorbar_label: format!("effective offsets (1..{w})"),
        diverging: false,
        range: Some((1.0, f64::from(w.max(2)))),
        annotate: true,
        size: None,
    };
    let fig = heatmap(dir.join("gate_entropy"), &spec)?;
    push(
        &mut f.files,
        &mut f.report,
        "Effective number of offsets per gate",
        fig,
    );
    Ok(())
}

/// Trajectories of exp(H(E[a])) over the `<model>@<step>` checkpoints, when there are any.
fn trajectory(f: &mut Figures, keys: &BTreeSet<(u32, u32)>, w: u32) -> Result<()> {
    let (d, m, dir) = (f.data, f.model.clone(), f.dir);
    let mut steps: Vec<(u64, String)> = d
        .rows
        .iter()
        .filter_map(|r| {
            let (base, step) = r.model.split_once('@')?;
            (base == m).then(|| step.parse::<u64>().ok().map(|s| (s, r.model.clone())))?
        })
        .collect();
    steps.sort();
    steps.dedup();
    if steps.is_empty() {
        return Ok(());
    }
    let mut series = Vec::new();
    for &(l, h) in keys.iter().take(8) {
        for g in ["key", "value"] {
            let metric = format!("{g}_gate_exp_entropy_of_mean");
            let x: Vec<f64> = steps.iter().map(|(s, _)| *s as f64).collect();
            let y: Vec<f64> = steps
                .iter()
                .map(|(_, model)| head_val(d, &metric, model, l, h))
                .collect();
            series.push(BandSeries {
                name: format!("L{l} KV{h} {g}"),
                lo: y.clone(),
                hi: y.clone(),
                x,
                y,
            });
        }
    }
    let spec = LinePlotSpec {
        series,
        title: format!("{m}: exp(H(E[a])) over training"),
        x_label: "training step".into(),
        y_label: "effective offsets of the mean gate".into(),
        y_range: Some((1.0, f64::from(w.max(2)))),
        size: None,
    };
    let fig = line_with_bands(dir.join("gate_trajectory"), &spec)?;
    push(
        &mut f.files,
        &mut f.report,
        "Gate sharpness over training checkpoints",
        fig,
    );
    Ok(())
}
