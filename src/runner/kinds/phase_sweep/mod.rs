//! `phase-sweep`: top-1 accuracy by phase group for each model and protocol.
//!
//! Writes, per model, `notebooks-data/<experiment>/<model>/phase_accuracy.arrow`
//! (schema `phase_accuracy/v1`, Wilson intervals) and `summary.json` (mean accuracy,
//! best and worst phase, phase gap with its selection-adjusted cluster-bootstrap
//! CI), and long rows `accuracy_<protocol>`, `phase_gap_pp_<protocol>`, ... for the
//! experiment's `phase_sweep` table.
//!
//! Key-value tasks run through the batched executor; the text tasks (`[task] kind =
//! "passkey" | "needle"`, module `text`) score their own forwards and add
//! `logit_diff_<protocol>` rows (the value against the best wrong value).
//!
//! Every model also gets `examples.arrow` (`examples/v1`, module `examples`): one row
//! per protocol x phase x logical example, assembled from the prompts computed or
//! resumed from the shards, for statistics over examples from committed tables.

use serde::{Deserialize, Serialize};

use crate::analysis::{Clusters, accuracy_clusters, per_phase, phase_clusters};
use crate::analysis::{DEFAULT_LEVEL, PhaseGap, phase_gap};
use crate::error::{Error, Result};
use crate::output::{PhaseAccuracyRow, phase_accuracy_table, write_parquet_copy};
use crate::tasks::Protocol;

use super::super::exec::Group;
use super::super::experiment::Experiment;
use super::super::report::{Figures, accuracy_figure, baseline_headlines};
use super::super::rows::{baseline_rows, protocol_obs};
use super::{Ctx, Kind, KindOutput};
use crate::tasks::prompts::{PromptMeta, clean_prompts};

pub mod examples;
mod text;

use examples::{ExampleRow, write_examples};

/// `[sweep]` (phase-sweep).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PhaseSweep {
    /// Protocols to evaluate. Default both.
    pub protocols: Vec<Protocol>,
    /// Skip organisms whose model directory does not exist yet (with a note).
    pub skip_untrained: bool,
}

impl Default for PhaseSweep {
    fn default() -> Self {
        PhaseSweep {
            protocols: Protocol::ALL.to_vec(),
            skip_untrained: true,
        }
    }
}

impl Kind for PhaseSweep {
    fn name(&self) -> &'static str {
        "phase-sweep"
    }

    fn section(&self) -> &'static str {
        "sweep"
    }

    fn default_n_logical(&self) -> usize {
        256
    }

    fn accepts_model_glob(&self) -> bool {
        true
    }

    fn skips_untrained(&self) -> bool {
        self.skip_untrained
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        if exp.file.task.protocol.is_some() {
            return Err(exp.err(
                "task",
                "protocol",
                "phase-sweep evaluates [sweep] protocols (default both); remove this key",
            ));
        }
        if self.protocols.is_empty() {
            return Err(exp.err("sweep", "protocols", "give at least one protocol"));
        }
        Ok(())
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }

    /// One section per model: its headlines and its accuracy figure (both protocols).
    fn report(&self, f: &mut Figures) -> Result<()> {
        self.figures(f)
    }
}

/// The prompt metas of one phase group, with the protocol it was rendered under.
type GroupMeta = (Protocol, Vec<PromptMeta>);

/// One group of clean prompts per protocol and phase (each protocol's evaluation set
/// checked against the model first), with their metas.
fn sweep_groups(cfg: &PhaseSweep, ctx: &mut Ctx) -> Result<(Vec<Group>, Vec<GroupMeta>)> {
    let mut groups = Vec::new();
    let mut metas = Vec::new();
    for &proto in &cfg.protocols {
        let set = ctx.task.eval_set(proto)?;
        ctx.preflight_plain(set.prompt_len)?;
        for &r in &ctx.task.phases {
            let ex = ctx.examples(&set, r);
            let (prompts, meta) = clean_prompts(&ex, |_| 0);
            groups.push(Group {
                key: format!("{}-{}-p{r}", ctx.mref.name, proto.label()),
                prompts,
                cells: Vec::new(),
            });
            metas.push((proto, meta));
        }
    }
    Ok((groups, metas))
}

/// The `phase_accuracy` rows of one model and protocol: trials and successes per phase.
fn phase_accuracy_rows(
    model: &str,
    proto: Protocol,
    phases: &[u32],
    obs: &[(u64, u32, bool)],
) -> Vec<PhaseAccuracyRow> {
    phases
        .iter()
        .map(|&r| {
            let (n, correct) = obs
                .iter()
                .filter(|(_, ph, _)| *ph == r)
                .fold((0u64, 0u64), |(n, c), (_, _, ok)| {
                    (n + 1, c + u64::from(*ok))
                });
            PhaseAccuracyRow::new(model, proto.label(), r, n, correct)
        })
        .collect()
}

/// The `summary.json` entry of one protocol (nulls where the phase gap is undefined).
fn protocol_summary(
    proto: Protocol,
    gap: Option<&PhaseGap>,
    n_logical: usize,
    reps: usize,
) -> serde_json::Value {
    serde_json::json!({
        "protocol": proto.name(),
        "mean_accuracy": gap.map(|g| g.mean_accuracy),
        "mean_accuracy_ci95": gap.map(|g| [g.mean_ci.0, g.mean_ci.1]),
        "best_phase": gap.map(|g| g.best_phase),
        "worst_phase": gap.map(|g| g.worst_phase),
        "phase_gap_pp": gap.map(|g| g.gap_pp),
        "phase_gap_ci95": gap.map(|g| [g.ci_lo_pp, g.ci_hi_pp]),
        "n_logical": n_logical,
        "bootstrap_reps": reps,
    })
}

/// The `examples` rows of one protocol's observations (the logit difference where the
/// task computes one).
fn example_rows(model: &str, o: &text::TextObs) -> Vec<ExampleRow> {
    o.correct
        .iter()
        .enumerate()
        .map(|(i, &(logical, phase, correct))| ExampleRow {
            model: model.to_string(),
            protocol: o.proto.label().to_string(),
            phase,
            logical,
            correct,
            ld: o.ld.get(i).map(|x| x.2),
        })
        .collect()
}

/// Write the model's `phase_accuracy` and `examples` tables (+ Parquet copies) and
/// `summary.json` (the first protocol's numbers at the top, every protocol's under
/// `protocols`).
fn write_model_files(
    ctx: &Ctx,
    table_rows: &[PhaseAccuracyRow],
    example_rows: &[ExampleRow],
    first: serde_json::Value,
    per_protocol: serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let dir = ctx.data_dir.join(&ctx.mref.name);
    let t = phase_accuracy_table("phase_accuracy", table_rows).with_provenance(&ctx.exp.text);
    let path = dir.join("phase_accuracy.arrow");
    t.write_arrow(&path)?;
    write_parquet_copy(&path)?;
    write_examples(&dir, example_rows, ctx.p(), &ctx.exp.text)?;
    let summary = serde_json::json!({
        "model": ctx.mref.name,
        "compressed": ctx.info.compressed(),
        "stride": ctx.info.strides().first(),
        "strides": ctx.info.strides(),
        "period": ctx.p(),
        "protocol": first["protocol"],
        "mean_accuracy": first["mean_accuracy"],
        "best_phase": first["best_phase"],
        "worst_phase": first["worst_phase"],
        "phase_gap_pp": first["phase_gap_pp"],
        "phase_gap_ci95": first["phase_gap_ci95"],
        "protocols": per_protocol,
        "phaselens_version": env!("CARGO_PKG_VERSION"),
    });
    crate::output::write_bytes_atomic(
        &dir.join("summary.json"),
        format!("{summary:#}\n").as_bytes(),
    )
    .map_err(|e| Error::io(dir.join("summary.json"), e))
}

/// The key-value tasks' observations: `(protocol, (logical, phase, correct) per
/// prompt)` through the batched executor.
fn observe_kv(cfg: &PhaseSweep, ctx: &mut Ctx) -> Result<Vec<text::TextObs>> {
    let (groups, metas) = sweep_groups(cfg, ctx)?;
    let results = ctx.execute(&format!("{} phase-sweep", ctx.mref.name), &groups)?;
    Ok(cfg
        .protocols
        .iter()
        .map(|&proto| text::TextObs {
            proto,
            correct: protocol_obs(&metas, &results, proto),
            ld: Vec::new(),
        })
        .collect())
}

/// `logit_diff<suffix>` rows (per phase and pooled, cluster-bootstrap CIs) and the
/// per-phase means for `summary.json` (text tasks; empty without observations).
fn logit_diff_rows(
    ctx: &Ctx,
    proto: Protocol,
    ld: &[(u64, u32, f64)],
) -> (Vec<crate::output::LongRow>, Vec<f64>) {
    if ld.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut c = Clusters::<1>::new(ctx.p());
    for &(l, ph, v) in ld.iter().filter(|o| o.2.is_finite()) {
        c.add(l, ph, [v]);
    }
    let (per, pooled) = per_phase(&c, |s, n| s[0] / n as f64, ctx.reps(), ctx.seed());
    let phases = &ctx.task.phases;
    let rows = ctx.rows.phase_rows(
        &format!("logit_diff{}", proto.metric_suffix()),
        None,
        phases,
        &per,
        pooled,
    );
    (
        rows,
        phases.iter().map(|&r| per[r as usize].value).collect(),
    )
}

fn run(cfg: &PhaseSweep, ctx: &mut Ctx) -> Result<KindOutput> {
    let p = ctx.p();
    let observed = if ctx.task.text.is_some() {
        text::observe(cfg, ctx)?
    } else {
        observe_kv(cfg, ctx)?
    };
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let phases = ctx.task.phases.clone();
    let mut rows = Vec::new();
    let mut table_rows = Vec::new();
    let mut examples = Vec::new();
    let mut per_protocol = serde_json::Map::new();
    let mut first: Option<serde_json::Value> = None;
    for o in observed {
        let proto = o.proto;
        let acc = accuracy_clusters(p, o.correct.clone());
        rows.extend(baseline_rows(
            &rc,
            proto.metric_suffix(),
            &acc,
            &phases,
            reps,
            seed,
        ));
        table_rows.extend(phase_accuracy_rows(&rc.model, proto, &phases, &o.correct));
        examples.extend(example_rows(&rc.model, &o));
        let gap = phase_gap(&phase_clusters(&acc), reps, seed, DEFAULT_LEVEL).ok();
        let mut s = protocol_summary(proto, gap.as_ref(), ctx.task.n_logical, reps);
        let (ld_rows, ld_means) = logit_diff_rows(ctx, proto, &o.ld);
        if !ld_rows.is_empty() {
            rows.extend(ld_rows);
            s["logit_diff_by_phase"] = serde_json::json!(ld_means);
        }
        if first.is_none() {
            first = Some(s.clone());
        }
        per_protocol.insert(proto.name().to_string(), s);
    }
    let first = first.unwrap_or_default();
    write_model_files(ctx, &table_rows, &examples, first, per_protocol)?;
    Ok(KindOutput {
        tables: vec![("phase_sweep".into(), rows)],
    })
}

/// Per model: headline numbers and `accuracy_<model>` for each protocol present.
fn draw(_cfg: &PhaseSweep, f: &mut Figures) -> Result<()> {
    let d = f.data;
    for m in f.models.clone() {
        f.report.section(format!("Model `{m}`"));
        let mut series = Vec::new();
        for (sfx, label) in [
            ("_prefix", "prefix padding"),
            ("_in_sequence", "in-sequence padding"),
        ] {
            if d.has(&m, &format!("accuracy{sfx}")) {
                f.report
                    .headlines(baseline_headlines(d, &m, sfx, &format!("{label}: ")));
                series.push((label, format!("accuracy{sfx}")));
            }
        }
        if let Some(fig) = accuracy_figure(
            &f.dir.join(format!("accuracy_{m}")),
            d,
            &m,
            &series,
            &format!("{m}: top-1 accuracy by phase group"),
        )? {
            f.push(
                &format!("{m}: accuracy by phase group, 95% cluster-bootstrap bands"),
                fig,
            );
        }
    }
    Ok(())
}
