//! From statistics to long-format rows: the identity of a row ([`RowCtx`]) and the
//! rows every kind shares (baseline accuracy, specialization). The statistics come
//! from [`crate::analysis`] ([`crate::analysis::clusters`] for per-phase estimates with
//! cluster-bootstrap intervals).

use crate::analysis::{self, Clusters, DEFAULT_LEVEL, Est, per_phase, phase_clusters};
use crate::output::{HeadKind, LongRow};

use super::exec::GroupResult;
use crate::tasks::prompts::PromptMeta;

/// Clusters of `(correct_edited, correct_clean)` for cell `ci` over all groups (the
/// ablation and knockout kinds' relative change).
pub fn change_clusters(
    p: usize,
    metas: &[Vec<PromptMeta>],
    results: &[GroupResult],
    ci: usize,
) -> Clusters<2> {
    let mut c = Clusters::<2>::new(p);
    for (meta, res) in metas.iter().zip(results) {
        for (i, o) in res.cells[ci].iter().enumerate() {
            let m = &meta[i];
            c.add(
                m.logical,
                m.phase,
                [
                    f64::from(u8::from(o.correct)),
                    f64::from(u8::from(res.base[i].correct)),
                ],
            );
        }
    }
    c
}

/// Identity of the rows of one experiment on one model.
#[derive(Debug, Clone)]
pub struct RowCtx {
    pub experiment: String,
    pub model: String,
    pub kind: String,
}

impl RowCtx {
    /// A whole-model row.
    pub fn row(&self, metric: impl Into<String>, e: Est) -> LongRow {
        let mut r =
            LongRow::new(&self.experiment, &self.model, &self.kind, metric, e.value).with_n(e.n);
        if let Some((lo, hi)) = e.ci {
            r = r.with_ci(lo, hi);
        }
        r
    }

    /// Rows per phase (for the phases with observations) plus the pooled row, for
    /// a head (`head = Some`), a layer (`layer = Some`) or the whole model.
    pub fn phase_rows(
        &self,
        metric: &str,
        at: Option<(u32, Option<(u32, HeadKind)>)>,
        phases: &[u32],
        per: &[Est],
        pooled: Est,
    ) -> Vec<LongRow> {
        let place = |r: LongRow| match at {
            Some((l, Some((h, k)))) => r.at_head(l, h, k),
            Some((l, None)) => r.at_layer(l),
            None => r,
        };
        let mut out: Vec<LongRow> = phases
            .iter()
            .map(|&ph| place(self.row(metric, per[ph as usize])).at_phase(ph))
            .collect();
        out.push(place(self.row(metric, pooled)));
        out
    }
}

/// Baseline rows: `accuracy{suffix}` per phase (and pooled, i.e. the mean over
/// prompts), `mean_accuracy{suffix}` (mean over phases, with CI), `phase_gap_pp{suffix}`
/// (selection-adjusted CI), `best_phase{suffix}`, `worst_phase{suffix}`.
pub fn baseline_rows(
    ctx: &RowCtx,
    suffix: &str,
    acc: &Clusters<1>,
    phases: &[u32],
    reps: usize,
    seed: u64,
) -> Vec<LongRow> {
    let (per, pooled) = per_phase(acc, |s, n| s[0] / n as f64, reps, seed);
    let mut rows = ctx.phase_rows(&format!("accuracy{suffix}"), None, phases, &per, pooled);
    if let Ok(gap) = analysis::phase_gap(&phase_clusters(acc), reps, seed, DEFAULT_LEVEL) {
        let n = gap.n_clusters as u64;
        rows.push(ctx.row(
            format!("mean_accuracy{suffix}"),
            Est {
                value: gap.mean_accuracy,
                ci: Some(gap.mean_ci),
                n,
            },
        ));
        rows.push(ctx.row(
            format!("phase_gap_pp{suffix}"),
            Est {
                value: gap.gap_pp,
                ci: Some((gap.ci_lo_pp, gap.ci_hi_pp)),
                n,
            },
        ));
        for (m, v) in [
            ("best_phase", gap.best_phase),
            ("worst_phase", gap.worst_phase),
        ] {
            rows.push(ctx.row(
                format!("{m}{suffix}"),
                Est {
                    value: v as f64,
                    ci: None,
                    n,
                },
            ));
        }
    }
    rows
}

/// `specialization` and `effective_phases` rows of a head from its effect profile
/// over the evaluated phases (see [`analysis::specialization`]); `peak_phase` too.
pub fn specialization_rows(
    ctx: &RowCtx,
    layer: u32,
    head: u32,
    kind: HeadKind,
    phases: &[u32],
    effect: &[f64],
) -> Vec<LongRow> {
    let finite: Vec<f64> = effect
        .iter()
        .map(|v| if v.is_finite() { *v } else { 0.0 })
        .collect();
    let Ok(s) = analysis::specialization(&finite) else {
        return Vec::new();
    };
    let n = phases.len() as u64;
    let est = |v: Option<f64>| Est {
        value: v.unwrap_or(f64::NAN),
        ci: None,
        n,
    };
    vec![
        ctx.row("specialization", est(s.score))
            .at_head(layer, head, kind),
        ctx.row("effective_phases", est(s.effective_phases))
            .at_head(layer, head, kind),
        ctx.row("peak_phase", est(s.peak_phase.map(|i| phases[i] as f64)))
            .at_head(layer, head, kind),
    ]
}

/// `(logical, phase, correct)` of every clean prompt evaluated under `proto`: `metas[i]`
/// is the protocol and prompt metas of group `i`, `results[i]` its base run (the phase
/// sweep and the audit's retrieval both score their groups this way).
pub fn protocol_obs(
    metas: &[(crate::tasks::Protocol, Vec<PromptMeta>)],
    results: &[GroupResult],
    proto: crate::tasks::Protocol,
) -> Vec<(u64, u32, bool)> {
    metas
        .iter()
        .zip(results)
        .filter(|((pr, _), _)| *pr == proto)
        .flat_map(|((_, meta), res)| {
            meta.iter()
                .zip(&res.base)
                .map(|(m, o)| (m.logical, m.phase, o.correct))
                .collect::<Vec<_>>()
        })
        .collect()
}
