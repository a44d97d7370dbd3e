//! Runs one audited period through the runner's pieces: the phase-matched evaluation
//! sets of both padding protocols (the runner's task setup, prompts, batched routine
//! with resumable shards and progress), the filler-probe kind, and the analysis
//! module's statistics.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::analysis::{DEFAULT_LEVEL, Z95, accuracy_clusters, phase_clusters, phase_gap, wilson};
use crate::error::{Error, Result};
use crate::model::{LanguageModel, ModelInfo};
use crate::output::LongRow;
use crate::runner::exec::{ExecStats, Group};
use crate::runner::experiment::Experiment;
use crate::runner::kinds::Ctx;
use crate::runner::rows::{RowCtx, protocol_obs};
use crate::runner::setup::{self, ModelRef, TaskSetup};
use crate::runner::store::Store;
use crate::runner::{ProgressMode, RunOptions};
use crate::tasks::Protocol;
use crate::tasks::prompts::{PromptMeta, clean_prompts};

use super::plan::{Part, experiment_text};
use super::stats::{Flatness, Row, flatness_test, shift_flips};
use super::{AuditConfig, Target};

/// Accuracy of one phase (or shift) group with its 95% Wilson interval.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseStat {
    /// The phase (or shift).
    pub phase: u32,
    /// Prompts.
    pub n: u64,
    /// Prompts answered right (top-1).
    pub correct: u64,
    /// `correct / n`.
    pub accuracy: f64,
    /// 95% Wilson interval of the accuracy.
    pub ci95: [f64; 2],
}

/// One protocol's retrieval by phase.
#[derive(Debug, Clone, Serialize)]
pub struct ProtocolResult {
    /// `prefix_padding` or `in_sequence_padding`.
    pub protocol: String,
    /// Accuracy of every phase.
    pub per_phase: Vec<PhaseStat>,
    /// Mean accuracy over phases.
    pub mean_accuracy: f64,
    /// Its 95% cluster-bootstrap interval.
    pub mean_ci95: [f64; 2],
    /// The phase of highest accuracy.
    pub best_phase: usize,
    /// The phase of lowest accuracy.
    pub worst_phase: usize,
    /// The worst phase's accuracy.
    pub worst_accuracy: f64,
    /// Wilson interval of the worst phase (not adjusted for choosing it).
    pub worst_ci95: [f64; 2],
    /// `100 x (best - worst)`.
    pub gap_pp: f64,
    /// Selection-adjusted cluster-bootstrap interval of the gap (pp).
    pub gap_ci95: [f64; 2],
    /// Permutation test of a flat profile.
    pub flatness: Flatness,
}

/// The shift-invariance test: the same prompts shifted by 0..P-1 prefix pads.
#[derive(Debug, Clone, Serialize)]
pub struct ShiftResult {
    /// Shifts tested (the period).
    pub shifts: usize,
    /// Logical examples.
    pub n_logical: u64,
    /// Logical examples answered right at some shifts and wrong at others.
    pub flipping: u64,
    /// `flipping / n_logical`.
    pub flip_rate: f64,
    /// Its 95% Wilson interval.
    pub ci95: [f64; 2],
}

/// The filler-length flip probe, grouped by `L mod P`.
#[derive(Debug, Clone, Serialize)]
pub struct ResidueStat {
    /// The filler length modulo the period.
    pub residue: u32,
    /// Mean `P(correct) - P(distractor)`.
    pub prob_diff: f64,
    /// Its 95% cluster-bootstrap interval (`None`: undefined).
    pub ci95: Option<[f64; 2]>,
    /// Fraction of prompts where the distractor is more probable.
    pub distractor_preferred: f64,
}

/// The filler probe's summary.
#[derive(Debug, Clone, Serialize)]
pub struct FillerResult {
    /// Filler lengths `[min, max]`.
    pub lengths: [usize; 2],
    /// Probe instances (each rendered at every length).
    pub instances: usize,
    /// One entry per residue.
    pub by_residue: Vec<ResidueStat>,
    /// Max - min of the residues' mean `prob_diff`.
    pub swing: f64,
    /// Residues whose mean `prob_diff` is negative (the wrong answer on top).
    pub wrong_on_top_residues: Vec<u32>,
}

/// Accuracy of one phase with its cluster-bootstrap interval (long-context rows).
#[derive(Debug, Clone, Serialize)]
pub struct EstStat {
    /// The phase.
    pub phase: u32,
    /// Accuracy over the phase's prompts.
    pub accuracy: f64,
    /// Its 95% cluster-bootstrap interval (`None`: undefined).
    pub ci95: Option<[f64; 2]>,
    /// Prompts.
    pub n: u64,
}

/// Retrieval by phase at one long-context length under one protocol (over depths).
#[derive(Debug, Clone, Serialize)]
pub struct LengthResult {
    /// The prompt length (tokens).
    pub length: usize,
    /// The padding protocol.
    pub protocol: String,
    /// Accuracy of every phase.
    pub per_phase: Vec<EstStat>,
    /// Mean accuracy over phases.
    pub mean_accuracy: f64,
    /// Its 95% cluster-bootstrap interval.
    pub mean_ci95: Option<[f64; 2]>,
    /// The phase of lowest accuracy.
    pub worst_phase: Option<u32>,
    /// Best minus worst phase accuracy (pp).
    pub gap_pp: f64,
    /// Selection-adjusted cluster-bootstrap interval (pp).
    pub gap_ci95: Option<[f64; 2]>,
}

/// Everything measured at one period.
#[derive(Debug, Clone, Serialize)]
pub struct PartResult {
    /// `period-P` (or `shift-P` for a model without compression).
    pub name: String,
    /// The audited period `P`.
    pub period: usize,
    /// False for a model without compression: groups are shifts, not phases.
    pub phased: bool,
    /// Why this period (a stride, their least common multiple, `[audit] period`).
    pub why: String,
    /// Logical examples per phase.
    pub n_logical: usize,
    /// The block grid's offset: a phase is `(position - offset) mod period` (0 but
    /// under a compression overlay with an `offset`).
    pub offset: usize,
    /// Retrieval by phase under each padding protocol.
    pub protocols: Vec<ProtocolResult>,
    /// The shift-invariance test.
    pub shift_invariance: ShiftResult,
    /// The filler-length probe (`None` when off).
    pub filler: Option<FillerResult>,
    /// The long-context test (`[audit] lengths`), per length and protocol.
    pub long_context: Vec<LengthResult>,
    /// Notes for the report (e.g. a small sample).
    pub notes: Vec<String>,
    #[serde(skip)]
    pub(crate) stats: ExecStats,
}

/// What every part shares.
pub struct Env<'a> {
    pub target: &'a Target,
    pub model: &'a dyn LanguageModel,
    pub info: &'a ModelInfo,
    pub cfg: &'a AuditConfig,
    pub out: &'a Path,
    pub device: burn::tensor::Device,
    pub device_spec: crate::device::DeviceSpec,
    pub progress: ProgressMode,
    pub fresh: bool,
}

impl Env<'_> {
    /// The experiment file of `part` for `kind` (written to `OUT/plan/` for
    /// reference: `phaselens run` runs it), parsed.
    pub fn experiment(&self, part: &Part, kind: &str, n_logical: usize) -> Result<Experiment> {
        let text = experiment_text(self.target, self.cfg, part, kind, n_logical)?;
        let path = self
            .out
            .join("plan")
            .join(format!("{}-{kind}.toml", part.name));
        crate::output::write_bytes_atomic(&path, text.as_bytes())
            .map_err(|e| Error::io(&path, e))?;
        Experiment::parse(&path, text)
    }

    fn run_options(&self) -> RunOptions {
        RunOptions {
            data_root: self.out.join("data"),
            reports_root: self.out.join("reports"),
            fresh: self.fresh,
            device: Some(self.device_spec.clone()),
            devices: None,
            weights: None,
            dtype: None,
            shard: None,
            progress: self.progress,
            figures: false,
        }
    }
}

/// The model reference and task setup of an experiment, checked for prompts of
/// `prompt_len` tokens (errors before any compute).
pub fn resolve(env: &Env, exp: &Experiment) -> Result<(ModelRef, TaskSetup)> {
    let (mut refs, _) = setup::resolve_models(exp)?;
    let mref = refs.remove(0);
    let task = TaskSetup::resolve(exp, &mref, env.info)?;
    Ok((mref, task))
}

/// A shard store for `part`'s `what` under `OUT/shards/`, keyed by the experiment's
/// settings and the model files.
fn store(env: &Env, exp: &Experiment, mref: &ModelRef, what: &str) -> Result<Store> {
    let settings = serde_json::to_value(&exp.file)
        .map_err(|e| Error::Other(format!("audit settings: {e}")))?;
    let hash = crate::runner::store::run_hash(&settings, &[mref.dir.as_path()]);
    Store::open(&env.out.join("shards").join(what), &hash, env.fresh)
}

/// Run `f` with a runner context for `exp` on the audited model.
fn with_ctx<T>(
    env: &Env,
    exp: &Experiment,
    what: &str,
    f: impl FnOnce(&mut Ctx) -> Result<T>,
) -> Result<(T, ExecStats, Vec<String>)> {
    let (mref, task) = resolve(env, exp)?;
    let store = store(env, exp, &mref, what)?;
    let opts = env.run_options();
    let data_dir: PathBuf = opts.data_root.join(what);
    let mut ctx = Ctx {
        exp,
        data_dir: &data_dir,
        opts: &opts,
        store: &store,
        model: env.model,
        info: env.info.clone(),
        mref: &mref,
        rows: RowCtx {
            experiment: what.to_string(),
            model: mref.name.clone(),
            kind: exp.kind().name().to_string(),
        },
        notes: task.provenance.clone(),
        task,
        stats: ExecStats::default(),
        device: env.device.clone(),
        max_rows: exp.max_rows(&env.device_spec),
    };
    let out = f(&mut ctx)?;
    Ok((out, ctx.stats, ctx.notes))
}

/// The prompt metas of each protocol's groups.
type ProtocolMetas = Vec<(Protocol, Vec<PromptMeta>)>;

/// Per protocol, one group per phase (each protocol's set checked against the model).
fn retrieval_groups(ctx: &mut Ctx, protocols: &[Protocol]) -> Result<(Vec<Group>, ProtocolMetas)> {
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &proto in protocols {
        let set = ctx.task.eval_set(proto)?;
        ctx.preflight(set.prompt_len)?;
        for &r in &ctx.task.phases.clone() {
            let ex = ctx.examples(&set, r);
            let (prompts, meta) = clean_prompts(&ex, |_| 0);
            groups.push(Group {
                key: format!("{}-p{r}", proto.name()),
                prompts,
                cells: Vec::new(),
            });
            metas.push((proto, meta));
        }
    }
    Ok((groups, metas))
}

/// The phase of a position on a block grid of period `p` starting at `offset`.
fn grid_phase(r: u32, p: usize, offset: usize) -> u32 {
    ((r as usize + p - offset % p) % p) as u32
}

/// Observations `(logical, position mod P, correct)` with their phases on the grid
/// that starts at `offset` (a compression overlay's block grid).
fn on_grid(obs: Vec<(u64, u32, bool)>, p: usize, offset: usize) -> Vec<(u64, u32, bool)> {
    obs.into_iter()
        .map(|(l, r, ok)| (l, grid_phase(r, p, offset), ok))
        .collect()
}

/// One row per logical example: its outcome at each phase.
fn rows_by_logical(obs: &[(u64, u32, bool)], p: usize) -> Vec<Row> {
    let mut map: std::collections::BTreeMap<u64, Row> = Default::default();
    for &(l, ph, ok) in obs {
        map.entry(l).or_insert_with(|| vec![None; p])[ph as usize] = Some(ok);
    }
    map.into_values().collect()
}

/// Accuracy by phase, the selection-adjusted gap and the flatness test of one
/// protocol.
fn protocol_result(
    proto: Protocol,
    obs: &[(u64, u32, bool)],
    p: usize,
    cfg: &AuditConfig,
) -> Result<ProtocolResult> {
    let a = &cfg.audit;
    let clusters = phase_clusters(&accuracy_clusters(p, obs.iter().copied()));
    let gap = phase_gap(&clusters, a.bootstrap_reps, a.seed, DEFAULT_LEVEL)
        .map_err(|e| Error::Other(format!("phase gap of {}: {e}", proto.name())))?;
    let per_phase: Vec<PhaseStat> = (0..p)
        .map(|r| {
            let (n, c) = obs
                .iter()
                .filter(|o| o.1 as usize == r)
                .fold((0u64, 0u64), |(n, c), o| (n + 1, c + u64::from(o.2)));
            let (lo, hi) = if n > 0 {
                wilson(c, n, Z95)
            } else {
                (f64::NAN, f64::NAN)
            };
            PhaseStat {
                phase: r as u32,
                n,
                correct: c,
                accuracy: if n > 0 { c as f64 / n as f64 } else { f64::NAN },
                ci95: [lo, hi],
            }
        })
        .collect();
    let worst = &per_phase[gap.worst_phase];
    Ok(ProtocolResult {
        protocol: proto.name().to_string(),
        mean_accuracy: gap.mean_accuracy,
        mean_ci95: [gap.mean_ci.0, gap.mean_ci.1],
        best_phase: gap.best_phase,
        worst_phase: gap.worst_phase,
        worst_accuracy: worst.accuracy,
        worst_ci95: worst.ci95,
        gap_pp: gap.gap_pp,
        gap_ci95: [gap.ci_lo_pp, gap.ci_hi_pp],
        flatness: flatness_test(&rows_by_logical(obs, p), p, a.permutations, a.seed),
        per_phase,
    })
}

/// Retrieval by phase under every protocol of `part`, and the shift-invariance test
/// (the prefix-padding renderings of each logical example are the same prompt
/// shifted by 0..P-1 pads).
pub fn retrieval(
    env: &Env,
    part: &Part,
) -> Result<(Vec<ProtocolResult>, ShiftResult, ExecStats, Vec<String>)> {
    let exp = env.experiment(part, "phase-sweep", part.n_logical)?;
    let label = format!("{} {} retrieval", env.target.name, part.name);
    let ((results, metas), stats, notes) = with_ctx(env, &exp, &part.name, |ctx| {
        let (groups, metas) = retrieval_groups(ctx, &part.protocols)?;
        let results = ctx.execute(&label, &groups)?;
        Ok((results, metas))
    })?;
    let p = part.period;
    let obs_of = |proto| on_grid(protocol_obs(&metas, &results, proto), p, part.offset);
    let mut out = Vec::new();
    for &proto in &part.protocols {
        out.push(protocol_result(proto, &obs_of(proto), p, env.cfg)?);
    }
    let prefix = obs_of(Protocol::PrefixPadding);
    let (flipping, n) = shift_flips(&rows_by_logical(&prefix, p));
    let (lo, hi) = if n > 0 {
        wilson(flipping, n, Z95)
    } else {
        (f64::NAN, f64::NAN)
    };
    let shift = ShiftResult {
        shifts: p,
        n_logical: n,
        flipping,
        flip_rate: if n > 0 {
            flipping as f64 / n as f64
        } else {
            f64::NAN
        },
        ci95: [lo, hi],
    };
    Ok((out, shift, stats, notes))
}

/// The filler-length flip probe at `part`'s period (the runner's filler-probe kind).
pub fn filler(env: &Env, part: &Part) -> Result<(FillerResult, ExecStats)> {
    let exp = env.experiment(part, "filler-probe", env.cfg.audit.filler_instances)?;
    let what = format!("{}-filler", part.name);
    let (out, stats, _) = with_ctx(env, &exp, &what, |ctx| exp.kind().run(ctx))?;
    let rows: Vec<LongRow> = out.tables.into_iter().flat_map(|(_, r)| r).collect();
    let get = |metric: &str, r: u32| {
        rows.iter()
            .find(|x| x.metric == metric && x.phase == Some(r))
    };
    let by_residue: Vec<ResidueStat> = (0..part.period as u32)
        .filter_map(|r| {
            let d = get("prob_diff", r)?;
            Some(ResidueStat {
                residue: r,
                prob_diff: d.value,
                ci95: d.ci_lo.zip(d.ci_hi).map(|(a, b)| [a, b]),
                distractor_preferred: get("distractor_preferred", r).map_or(f64::NAN, |x| x.value),
            })
        })
        .collect();
    let vals: Vec<f64> = by_residue
        .iter()
        .map(|r| r.prob_diff)
        .filter(|v| v.is_finite())
        .collect();
    let swing = if vals.is_empty() {
        f64::NAN
    } else {
        vals.iter().cloned().fold(f64::MIN, f64::max)
            - vals.iter().cloned().fold(f64::MAX, f64::min)
    };
    let (lo, hi) = part.filler_lengths();
    Ok((
        FillerResult {
            lengths: [lo, hi],
            instances: env.cfg.audit.filler_instances,
            wrong_on_top_residues: by_residue
                .iter()
                .filter(|r| r.prob_diff < 0.0)
                .map(|r| r.residue)
                .collect(),
            by_residue,
            swing,
        },
        stats,
    ))
}

/// The long rows of `metric` (per phase and pooled) as per-length results.
fn length_result(rows: &[LongRow], length: usize, proto: Protocol, part: &Part) -> LengthResult {
    let (p, offset) = (part.period, part.offset);
    let sfx = format!("{}_len{length}", proto.metric_suffix());
    let find = |m: &str, ph: Option<u32>| {
        rows.iter()
            .find(|r| r.metric == format!("{m}{sfx}") && r.phase == ph)
    };
    let ci = |r: &LongRow| r.ci_lo.zip(r.ci_hi).map(|(a, b)| [a, b]);
    let mut per_phase: Vec<EstStat> = (0..p as u32)
        .filter_map(|r| {
            find("accuracy", Some(r)).map(|x| EstStat {
                phase: grid_phase(r, p, offset),
                accuracy: x.value,
                ci95: ci(x),
                n: x.n,
            })
        })
        .collect();
    per_phase.sort_by_key(|s| s.phase);
    let mean = find("mean_accuracy", None);
    let gap = find("phase_gap_pp", None);
    LengthResult {
        length,
        protocol: proto.name().to_string(),
        per_phase,
        mean_accuracy: mean.map_or(f64::NAN, |x| x.value),
        mean_ci95: mean.and_then(ci),
        worst_phase: find("worst_phase", None).map(|x| grid_phase(x.value as u32, p, offset)),
        gap_pp: gap.map_or(f64::NAN, |x| x.value),
        gap_ci95: gap.and_then(ci),
    }
}

/// Retrieval by phase in long haystacks (the runner's long-context kind).
pub fn long_context(env: &Env, part: &Part) -> Result<(Vec<LengthResult>, ExecStats)> {
    let a = &env.cfg.audit;
    if a.lengths.is_empty() {
        return Ok((Vec::new(), ExecStats::default()));
    }
    let exp = env.experiment(part, "long-context", a.long_logical)?;
    let what = format!("{}-long", part.name);
    let (out, stats, _) = with_ctx(env, &exp, &what, |ctx| exp.kind().run(ctx))?;
    let rows: Vec<LongRow> = out.tables.into_iter().flat_map(|(_, r)| r).collect();
    let mut res = Vec::new();
    for &l in &a.lengths {
        for &proto in &part.protocols {
            res.push(length_result(&rows, l, proto, part));
        }
    }
    Ok((res, stats))
}

fn add_stats(to: &mut ExecStats, s: &ExecStats) {
    to.forwards += s.forwards;
    to.cells_computed += s.cells_computed;
    to.cells_resumed += s.cells_resumed;
    to.seconds += s.seconds;
}

/// Measure one part.
pub fn measure(env: &Env, part: &Part) -> Result<PartResult> {
    let (protocols, shift, mut stats, mut notes) = retrieval(env, part)?;
    let filler = if part.filler {
        let (f, s) = filler(env, part)?;
        add_stats(&mut stats, &s);
        Some(f)
    } else {
        None
    };
    let (long, s) = long_context(env, part)?;
    add_stats(&mut stats, &s);
    notes.dedup();
    Ok(PartResult {
        name: part.name.clone(),
        period: part.period,
        phased: part.phased,
        why: part.why.clone(),
        n_logical: part.n_logical,
        offset: part.offset,
        protocols,
        shift_invariance: shift,
        filler,
        long_context: long,
        notes,
        stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_count_from_the_grid_offset() {
        // Grid boundaries at 3 + 8 i: position 3 is phase 0, position 2 phase 7.
        assert_eq!(grid_phase(3, 8, 3), 0);
        assert_eq!(grid_phase(2, 8, 3), 7);
        assert_eq!(grid_phase(5, 8, 0), 5);
        assert_eq!(grid_phase(1, 4, 6), 3);
        let obs = on_grid(vec![(0, 0, true), (0, 1, false)], 2, 1);
        assert_eq!(obs, vec![(0, 1, true), (0, 0, false)]);
    }
}
