//! `gate-cycling`: roll the learned compressor gates by delta offsets
//! (`Action::Roll` on axis 2, the offset axis, of `hook_key_gate` / `hook_value_gate`
//! of the selected layers, all at once) and compare the observed accuracy profile
//! with the prediction "the baseline profile shifted by delta":
//! `predicted(r) = acc(r - delta)`. R^2 and MAE per delta and pooled over deltas,
//! with cluster-bootstrap intervals ([`crate::analysis::profile_fit`]).

use crate::analysis::{
    DEFAULT_LEVEL, ProfileCluster, bootstrap_ci, mae, phase_accuracy, profile_fit, r_squared,
};
use crate::error::Result;
use crate::hooks::{Action, HookPoint, Site};
use crate::model::LayerKind;
use crate::output::LongRow;

use super::super::aggregate::{Est, accuracy_clusters, baseline_rows, per_phase, phase_clusters};
use super::super::config::{CyclingConfig, GateKind};
use super::super::exec::Group;
use super::super::patching::{Cell, Edit};
use super::super::prompts::clean_prompts;
use super::super::setup;
use super::{Ctx, KindOutput, base_obs};

/// Metric suffix of a shift: `_d+1`, `_d-2`.
pub fn delta_suffix(d: i64) -> String {
    format!("_d{d:+}")
}

pub fn run(ctx: &mut Ctx) -> Result<KindOutput> {
    let cfg: CyclingConfig = ctx.exp.file.cycling.clone().unwrap_or_default();
    let layers = setup::layers(ctx.exp, "cycling", &cfg.layers, &ctx.info, true)?;
    let p = ctx.p();
    for &l in &layers {
        if let LayerKind::Compressed { window, .. } = ctx.info.layers[l].kind
            && window != p
        {
            let w = format!(
                "layer {l} pools windows of {window} offsets but P = {p}: rolling the gates by delta offsets shifts phases by delta only when the window equals the period"
            );
            eprintln!("warning: {w}");
            ctx.notes.push(w);
        }
    }
    let mut points = Vec::new();
    for &l in &layers {
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
    let set = ctx.eval_set()?;
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &r in &ctx.task.phases {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let all: Vec<usize> = (0..prompts.n()).collect();
        let cells = cfg
            .deltas
            .iter()
            .map(|&d| Cell {
                edit: Edit::Transform {
                    points: points.clone(),
                    action: Action::Roll { axis: 2, shift: d },
                    heads: None,
                },
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
    // Per logical example (in logical order), one profile cluster per delta.
    let mut per_example: Vec<Vec<ProfileCluster>> = vec![Vec::new(); base_pc.len()];
    for (di, &d) in cfg.deltas.iter().enumerate() {
        let obs: Vec<(u64, u32, bool)> = metas
            .iter()
            .zip(&results)
            .flat_map(|(meta, res)| {
                meta.iter()
                    .zip(&res.cells[di])
                    .map(|(m, o)| (m.logical, m.phase, o.correct))
                    .collect::<Vec<_>>()
            })
            .collect();
        let observed = accuracy_clusters(p, obs);
        let predicted = accuracy_clusters(
            p,
            base_obs_all
                .iter()
                .map(|&(l, ph, ok)| (l, ((ph as i64 + d).rem_euclid(p as i64)) as u32, ok)),
        );
        let sfx = delta_suffix(d);
        let (po, oo) = per_phase(&observed, |s, n| s[0] / n as f64, reps, seed);
        rows.extend(rc.phase_rows(&format!("cycling_observed{sfx}"), None, &phases, &po, oo));
        let (pp, op) = per_phase(&predicted, |s, n| s[0] / n as f64, reps, seed);
        rows.extend(rc.phase_rows(&format!("cycling_predicted{sfx}"), None, &phases, &pp, op));
        let obs_pc = phase_clusters(&observed);
        let clusters: Vec<ProfileCluster> = base_pc
            .iter()
            .zip(obs_pc)
            .map(|(b, o)| ProfileCluster {
                predicted: b.shifted(d),
                observed: o,
            })
            .collect();
        for (e, c) in per_example.iter_mut().zip(&clusters) {
            e.push(c.clone());
        }
        let n = clusters.len() as u64;
        match profile_fit(&clusters, reps, seed, DEFAULT_LEVEL) {
            Ok(fit) => {
                for (m, ci) in [("cycling_r2", fit.r2), ("cycling_mae", fit.mae)] {
                    rows.push(rc.row(
                        format!("{m}{sfx}"),
                        Est {
                            value: ci.estimate,
                            ci: Some((ci.lo, ci.hi)),
                            n,
                        },
                    ));
                }
            }
            Err(e) => {
                // Typically a constant observed profile: R^2 is undefined, MAE is not.
                let w = format!("delta {d:+}: R^2 undefined ({e}); MAE only");
                eprintln!("warning: {w}");
                ctx.notes.push(w);
                let f = |s: &[&ProfileCluster]| {
                    let pr = phase_accuracy(s.iter().map(|c| &c.predicted));
                    let ob = phase_accuracy(s.iter().map(|c| &c.observed));
                    let (a, b): (Vec<f64>, Vec<f64>) = pr
                        .into_iter()
                        .zip(ob)
                        .filter(|(a, b)| a.is_finite() && b.is_finite())
                        .unzip();
                    mae(&a, &b).unwrap_or(f64::NAN)
                };
                if let Ok(ci) = bootstrap_ci(&clusters, f, reps, seed, DEFAULT_LEVEL) {
                    rows.push(rc.row(
                        format!("cycling_mae{sfx}"),
                        Est {
                            value: ci.estimate,
                            ci: Some((ci.lo, ci.hi)),
                            n,
                        },
                    ));
                }
            }
        }
    }
    // Pooled over deltas: the concatenated predicted and observed profiles.
    let pooled = |s: &[&Vec<ProfileCluster>]| -> (Vec<f64>, Vec<f64>) {
        let mut pred = Vec::new();
        let mut obs = Vec::new();
        for di in 0..cfg.deltas.len() {
            let pr = phase_accuracy(s.iter().map(|e| &e[di].predicted));
            let ob = phase_accuracy(s.iter().map(|e| &e[di].observed));
            for (a, b) in pr.into_iter().zip(ob) {
                if a.is_finite() && b.is_finite() {
                    pred.push(a);
                    obs.push(b);
                }
            }
        }
        (pred, obs)
    };
    let n = per_example.len() as u64;
    let r2 = |s: &[&Vec<ProfileCluster>]| {
        let (a, b) = pooled(s);
        r_squared(&a, &b).unwrap_or(f64::NAN)
    };
    let ma = |s: &[&Vec<ProfileCluster>]| {
        let (a, b) = pooled(s);
        mae(&a, &b).unwrap_or(f64::NAN)
    };
    for (m, f) in [
        ("cycling_r2", &r2 as &dyn Fn(&[&Vec<ProfileCluster>]) -> f64),
        ("cycling_mae", &ma),
    ] {
        if let Ok(ci) = bootstrap_ci(&per_example, f, reps, seed, DEFAULT_LEVEL) {
            rows.push(rc.row(
                m,
                Est {
                    value: ci.estimate,
                    ci: Some((ci.lo, ci.hi)),
                    n,
                },
            ));
        }
    }
    Ok(KindOutput {
        tables: vec![("cycling".into(), rows)],
    })
}
