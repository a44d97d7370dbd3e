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

use std::path::{Path, PathBuf};

use crate::analysis::gate_stats;
use crate::error::{Error, Result, ResultExt};
use crate::hooks::{HookPoint, Site};
use crate::model::{LanguageModel, load_model};
use crate::output::{HeadKind, LongRow};
use crate::tasks::KvEvalSet;

use super::super::aggregate::{Est, RowCtx, accuracy_clusters, baseline_rows};
use super::super::config::{GateKind, GatesConfig};
use super::super::patching::base_run_with;
use super::super::progress::Progress;
use super::super::prompts::clean_prompts;
use super::super::setup;
use super::{Ctx, KindOutput};

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

/// Gate rows of one model, and its `(logical, phase, correct)` outcomes.
#[allow(clippy::type_complexity)]
fn profile(
    model: &dyn LanguageModel,
    rc: &RowCtx,
    ctx: &Ctx,
    set: &KvEvalSet,
    layers: &[usize],
    progress: &mut Progress,
) -> Result<(Vec<LongRow>, Vec<(u64, u32, bool)>)> {
    // weights[(layer, gate, kv head)] = rows of W offsets.
    let mut weights: std::collections::BTreeMap<(usize, usize, usize), (usize, Vec<f64>)> =
        Default::default();
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
        for &l in layers {
            for (gi, (_, site)) in GATES.iter().enumerate() {
                let act = base
                    .cache
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
        progress.inc(1);
    }
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
    Ok((rows, obs))
}

pub fn run(ctx: &mut Ctx) -> Result<KindOutput> {
    let cfg: GatesConfig = ctx.exp.file.gates.clone().unwrap_or_default();
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
