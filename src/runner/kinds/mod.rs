//! One small file per experiment kind: which cells to sweep, and how their outcomes
//! become rows. Everything else (the batched routine, resume, progress, statistics,
//! tables, figures) is shared.

pub mod ablate;
pub mod gate_cycling;
pub mod gate_profiles;
pub mod knockout;
pub mod patch_heads;
pub mod phase_sweep;

use crate::error::Result;
use crate::hooks::{HookPoint, Site};
use crate::model::{LanguageModel, ModelInfo};
use crate::output::{HeadKind, LongRow};
use crate::tasks::{KvEvalSet, KvExample};

use super::RunOptions;
use super::aggregate::RowCtx;
use super::config::{Experiment, HeadKindSel, Method};
use super::exec::{ExecStats, Executor, Group, GroupResult};
use super::patching::Fill;
use super::progress::Progress;
use super::prompts::{PromptMeta, group_examples};
use super::setup::{self, ModelRef, TaskSetup};
use super::store::Store;

/// What a kind hands back: named long tables (rows) and notes for the report.
#[derive(Debug, Default)]
pub struct KindOutput {
    pub tables: Vec<(String, Vec<LongRow>)>,
}

/// Everything a kind needs for one model.
pub struct Ctx<'a> {
    pub exp: &'a Experiment,
    pub opts: &'a RunOptions,
    pub store: &'a Store,
    pub model: &'a dyn LanguageModel,
    pub info: ModelInfo,
    pub mref: &'a ModelRef,
    pub task: TaskSetup,
    pub rows: RowCtx,
    pub notes: Vec<String>,
    pub stats: ExecStats,
    pub device: burn::tensor::Device,
    /// Rows per batched forward.
    pub max_rows: usize,
}

impl<'a> Ctx<'a> {
    /// Bootstrap replicates.
    pub fn reps(&self) -> usize {
        self.exp.file.experiment.bootstrap_reps
    }

    /// Bootstrap seed.
    pub fn seed(&self) -> u64 {
        self.exp.file.experiment.seed
    }

    /// Number of phases P.
    pub fn p(&self) -> usize {
        self.task.period.len()
    }

    /// Check the experiment against the model for prompts of `prompt_len` tokens;
    /// warnings are printed and kept for the report.
    pub fn preflight(&mut self, prompt_len: usize) -> Result<()> {
        let warn = setup::check(self.exp, self.mref, &self.info, &self.task, prompt_len)?;
        for w in warn {
            eprintln!("warning: {w}");
            self.notes.push(w);
        }
        Ok(())
    }

    /// The evaluation set of the experiment's protocol, checked against the model.
    pub fn eval_set(&mut self) -> Result<KvEvalSet> {
        let set = self.task.eval_set(self.task.protocol)?;
        self.preflight(set.prompt_len)?;
        Ok(set)
    }

    /// The examples of phase group `r` used by the experiment.
    pub fn examples<'s>(&self, set: &'s KvEvalSet, r: u32) -> Vec<&'s KvExample> {
        group_examples(set, r, self.task.n_logical)
    }

    /// Evaluate `groups` with resume and a progress bar labelled `label`.
    pub fn execute(&mut self, label: &str, groups: &[Group]) -> Result<Vec<GroupResult>> {
        let total: u64 = groups.iter().map(Group::units).sum();
        let unit = if groups.iter().all(|g| g.cells.is_empty()) {
            "groups"
        } else {
            "cells"
        };
        let mut progress = Progress::new(self.opts.progress, label, unit, total);
        let mut ex = Executor {
            model: self.model,
            store: self.store,
            max_rows: self.max_rows,
            progress: &mut progress,
            stats: ExecStats::default(),
        };
        let mut out = Vec::with_capacity(groups.len());
        for g in groups {
            out.push(ex.run(g)?);
        }
        let s = ex.stats;
        progress.finish();
        self.stats.cells_computed += s.cells_computed;
        self.stats.cells_resumed += s.cells_resumed;
        self.stats.forwards += s.forwards;
        self.stats.seconds += s.seconds;
        Ok(out)
    }
}

/// A head cell: `(layer, head, kind)` and the query heads its edit covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadCell {
    pub layer: usize,
    pub head: usize,
    pub kind: HeadKind,
    /// Query heads of hook_z the edit touches: the head itself, or for a KV head every
    /// query head that reads it (`h / (n_heads / n_kv_heads) == kv`).
    pub query_heads: Vec<usize>,
}

impl HeadCell {
    /// The `blocks.{layer}.attn.hook_z` point.
    pub fn point(&self) -> HookPoint {
        HookPoint::block(self.layer, Site::AttnZ)
    }
}

/// Query and/or KV head cells of `layers`.
pub fn head_cells(
    ctx: &Ctx,
    section: &str,
    layers: &[usize],
    kinds: &[HeadKindSel],
    heads: &super::config::Selection,
    kv_heads: &super::config::Selection,
) -> Result<Vec<HeadCell>> {
    let mut out = Vec::new();
    let q = if kinds.contains(&HeadKindSel::Query) {
        setup::heads(ctx.exp, section, "heads", heads, &ctx.info, layers, false)?
    } else {
        Vec::new()
    };
    let kv = if kinds.contains(&HeadKindSel::Kv) {
        setup::heads(
            ctx.exp, section, "kv_heads", kv_heads, &ctx.info, layers, true,
        )?
    } else {
        Vec::new()
    };
    for &l in layers {
        let spec = &ctx.info.layers[l];
        let group = spec.n_heads / spec.n_kv_heads.max(1);
        for &h in &q {
            out.push(HeadCell {
                layer: l,
                head: h,
                kind: HeadKind::Query,
                query_heads: vec![h],
            });
        }
        for &g in &kv {
            out.push(HeadCell {
                layer: l,
                head: g,
                kind: HeadKind::Kv,
                query_heads: (g * group..(g + 1) * group).collect(),
            });
        }
    }
    Ok(out)
}

/// The fill of an ablation method.
pub fn fill_of(m: Method) -> Fill {
    match m {
        Method::Zero => Fill::Zero,
        Method::Mean => Fill::Mean,
        Method::Resample => Fill::Resample,
    }
}

/// `(logical, phase, correct)` of the base outcomes of clean prompts.
pub fn base_obs<'m>(
    meta: &'m [PromptMeta],
    res: &'m GroupResult,
) -> impl Iterator<Item = (u64, u32, bool)> + 'm {
    meta.iter()
        .zip(&res.base)
        .filter(|(m, _)| !m.corrupted)
        .map(|(m, o)| (m.logical, m.phase, o.correct))
}
