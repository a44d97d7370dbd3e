//! The experiment kinds. A kind is one file here: its settings type (the TOML section
//! it reads), which cells to sweep, how their outcomes become rows (and so its metric
//! names), its checks, its figures and its report section, all through [`Kind`].
//! Everything else (the batched routine, resume, progress, statistics, tables, the
//! report frame) is shared.
//!
//! Adding a kind: write `kinds/<name>.rs` with a settings type that implements
//! `Default`, `Serialize`, `Deserialize` and [`Kind`], declare it (`pub mod <name>;`)
//! and register it (one `<name>::<Settings>,` line in the `kinds!` list) at the bottom
//! of this file. What several kinds need lives below them, never in another kind:
//! [`HeadCell`] / `Direction` / `head_patch_cells` (runner/heads.rs), `PromptShards`
//! (runner/exec.rs), `change_clusters` (runner/rows.rs), the NLD / relative-change
//! estimators (analysis/effects.rs), protocol labels (`Protocol::label`).

use std::fmt;

use serde::de::MapAccess;
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::error::Result;
use crate::model::{LanguageModel, ModelInfo};
use crate::output::{HeadKind, LongRow};
use crate::tasks::{KvEvalSet, KvExample};

use super::RunOptions;
use super::exec::{ExecStats, Executor, Group, GroupResult, PromptShards};
use super::experiment::{Experiment, Selection};
pub use super::heads::HeadCell;
use super::patching::Fill;
use super::progress::Progress;
use super::report::Figures;
use super::rows::RowCtx;
use super::setup::{self, ModelRef, TaskSetup};
use super::store::Store;
use crate::tasks::prompts::{PromptMeta, group_examples};

/// An experiment kind, implemented by its settings type (the kind's TOML section).
pub trait Kind: fmt::Debug + Send + Sync {
    /// The name in `[experiment] kind` and in the tables' `kind` column.
    fn name(&self) -> &'static str;
    /// The TOML section holding the settings (`[patch]` for patch-heads).
    fn section(&self) -> &'static str;
    /// Default logical examples per phase group (sized for 2 CPU cores, see
    /// docs/experiments.md).
    fn default_n_logical(&self) -> usize;
    /// Whether `[model] organism` may be a glob that selects several models.
    fn accepts_model_glob(&self) -> bool {
        false
    }
    /// Whether organisms of a glob without a trained model are skipped (with a note).
    fn skips_untrained(&self) -> bool {
        false
    }
    /// Whether the kind evaluates the task's matched phase groups (whose `n_logical`
    /// should be a multiple of 2P^2); kinds with their own designs say no.
    fn matched_groups(&self) -> bool {
        true
    }
    /// Check the settings (and their interplay with the shared sections); errors name
    /// the line and key through [`Experiment::err`].
    fn check(&self, _exp: &Experiment) -> Result<()> {
        Ok(())
    }
    /// Sweep the cells on one model and turn their outcomes into named long tables.
    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput>;
    /// The series of the `accuracy_by_phase` figure: (legend, metric).
    fn accuracy_series(&self) -> Vec<(&'static str, String)> {
        vec![("clean", "accuracy".to_string())]
    }
    /// This kind's figures and report section, from its tables alone.
    fn figures(&self, f: &mut Figures) -> Result<()>;
    /// The report body between the summary paragraph and "Reading the tables":
    /// by default the headline numbers, `accuracy_by_phase` and [`Kind::figures`].
    fn report(&self, f: &mut Figures) -> Result<()> {
        f.headlines_and_accuracy(&self.accuracy_series())?;
        self.figures(f)
    }
}

/// Registers the kinds: one `module::SettingsType,` line each (the modules are declared
/// with plain `pub mod` lines, so that `cargo fmt` reaches them). Generates
/// [`KindConfig`], the settings of whichever kind a file names.
macro_rules! kinds {
    ($($module:ident :: $settings:ident),* $(,)?) => {

        /// The settings of one experiment kind (from its section, or its defaults).
        #[derive(Debug, Clone, PartialEq)]
        pub enum KindConfig {
            $($settings($module::$settings),)*
        }

        impl KindConfig {
            /// Every kind with its default settings, in registration order.
            pub fn all() -> Vec<KindConfig> {
                vec![$(KindConfig::$settings(Default::default()),)*]
            }

            /// The kind's behaviour.
            pub fn kind(&self) -> &dyn Kind {
                match self {
                    $(KindConfig::$settings(c) => c,)*
                }
            }

            /// Read the value of section `section` with the settings type of the kind
            /// that owns it (the caller has checked that one does).
            pub(crate) fn read_section<'de, A: MapAccess<'de>>(
                section: &str,
                map: &mut A,
            ) -> std::result::Result<KindConfig, A::Error> {
                $(
                    if section == $module::$settings::default().section() {
                        return map.next_value().map(KindConfig::$settings);
                    }
                )*
                Err(serde::de::Error::custom(format!("no kind reads [{section}]")))
            }
        }

        impl Serialize for KindConfig {
            /// As the kind's section: `{ "patch": { ... } }`.
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(Some(1))?;
                match self {
                    $(KindConfig::$settings(c) => m.serialize_entry(c.section(), c)?,)*
                }
                m.end()
            }
        }
    };
}

impl KindConfig {
    /// The default settings of the kind named `name`.
    pub fn named(name: &str) -> Option<KindConfig> {
        KindConfig::all()
            .into_iter()
            .find(|k| k.kind().name() == name)
    }

    /// Every kind's name.
    pub fn names() -> &'static [&'static str] {
        static NAMES: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
            KindConfig::all().iter().map(|k| k.kind().name()).collect()
        });
        &NAMES
    }

    /// Every kind's section.
    pub fn sections() -> &'static [&'static str] {
        static SECTIONS: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
            KindConfig::all()
                .iter()
                .map(|k| k.kind().section())
                .collect()
        });
        &SECTIONS
    }

    /// Every top-level section an experiment file may hold.
    pub fn all_sections() -> &'static [&'static str] {
        static ALL: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
            let mut v = vec!["experiment", "model", "task"];
            v.extend(KindConfig::sections());
            v
        });
        &ALL
    }
}

/// What a kind hands back: named long tables (rows) and notes for the report.
#[derive(Debug, Default)]
pub struct KindOutput {
    pub tables: Vec<(String, Vec<LongRow>)>,
}

/// Everything a kind needs for one model.
pub struct Ctx<'a> {
    pub exp: &'a Experiment,
    /// `<data_root>/<experiment>` (kinds that write more than long tables write there).
    pub data_dir: &'a std::path::Path,
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
    /// The memory check assumes a patching group's base run over every prompt (clean
    /// and corrupted); the executor checks each group's base run with its captures and
    /// its chunks (suffix forwards of a few positions, or full forwards of `max_rows`
    /// rows) again before computing them ([`crate::runner::patching::budget`]).
    pub fn preflight(&mut self, prompt_len: usize) -> Result<()> {
        self.preflight_rows(prompt_len, 2 * self.task.n_logical)
    }

    /// [`Ctx::preflight`] for kinds that only evaluate prompts (no cells): the executor
    /// runs them `max_rows` at a time, so one forward holds at most that many rows.
    pub fn preflight_plain(&mut self, prompt_len: usize) -> Result<()> {
        self.preflight_rows(prompt_len, self.max_rows.max(1))
    }

    fn preflight_rows(&mut self, prompt_len: usize, rows: usize) -> Result<()> {
        let size = setup::ForwardSize { prompt_len, rows };
        let warn = setup::check(self.exp, self.mref, &self.info, &self.task, size)?;
        for w in warn {
            // Hidden progress (library calls, the backend matrix): the warning goes to
            // the report's notes only.
            if self.opts.progress != super::progress::ProgressMode::Hidden {
                eprintln!("warning: {w}");
            }
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
            memory_keys: (
                format!(
                    "[task] n_logical ({}) or the prompt length in {}",
                    self.task.n_logical,
                    self.exp.path.display()
                ),
                format!(
                    "[experiment] max_rows ({}) in {}",
                    self.max_rows,
                    self.exp.path.display()
                ),
            ),
            progress: &mut progress,
            stats: ExecStats::default(),
        };
        let mut out = Vec::with_capacity(groups.len());
        for g in groups {
            out.push(ex.run(g)?);
        }
        let s = ex.stats;
        progress.finish();
        self.stats.add(&s);
        Ok(out)
    }

    /// Shards of per-prompt quantities for a kind that runs its own forwards: resume
    /// from the run's store, a progress bar over `total` prompts labelled `label`.
    pub fn prompt_shards(&self, label: &str, total: u64) -> PromptShards<'a> {
        PromptShards::new(self.store, self.opts.progress, label, total)
    }

    /// Finish `shards`' progress bar and add its counters to the run's.
    pub fn finish_shards(&mut self, shards: PromptShards) {
        self.stats.add(&shards.finish());
    }
}

/// Query and/or KV head cells of `layers`.
pub(crate) fn head_cells(
    ctx: &Ctx,
    section: &str,
    layers: &[usize],
    kinds: &[HeadKind],
    heads: &Selection,
    kv_heads: &Selection,
) -> Result<Vec<HeadCell>> {
    let mut out = Vec::new();
    let q = if kinds.contains(&HeadKind::Query) {
        setup::heads(ctx.exp, section, "heads", heads, &ctx.info, layers, false)?
    } else {
        Vec::new()
    };
    let kv = if kinds.contains(&HeadKind::Kv) {
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

/// An error naming `[section] key` when a fill needs a partner prompt (`source`), which
/// only patch-heads' paired prompts have.
pub(crate) fn no_source(exp: &Experiment, section: &str, key: &str, fills: &[Fill]) -> Result<()> {
    if fills.contains(&Fill::Source) {
        Err(exp.err(
            section,
            key,
            "\"source\" needs paired prompts (patch-heads); use \"zero\", \"mean\" or \"resample\"",
        ))
    } else {
        Ok(())
    }
}

/// An error naming `[section] key` when a list that must not be empty is.
pub(crate) fn empty_list(exp: &Experiment, section: &str, key: &str, empty: bool) -> Result<()> {
    if empty {
        Err(exp.err(section, key, "the list is empty"))
    } else {
        Ok(())
    }
}

/// `(logical, phase, correct)` of the base outcomes of clean prompts.
pub(crate) fn base_obs<'m>(
    meta: &'m [PromptMeta],
    res: &'m GroupResult,
) -> impl Iterator<Item = (u64, u32, bool)> + 'm {
    meta.iter()
        .zip(&res.base)
        .filter(|(m, _)| !m.corrupted)
        .map(|(m, o)| (m.logical, m.phase, o.correct))
}

pub mod ablate;
pub mod attribution_patching;
pub mod edge_attribution;
pub mod filler_probe;
pub mod gate_cycling;
pub mod gate_profiles;
pub mod indexer_diagnostics;
pub mod knockout;
pub mod long_context;
pub mod patch_heads;
pub mod path_patching;
pub mod phase_sweep;
pub mod retrieval_heads;

/// AtP* of the query and key nodes (`[atp] qk_fix`), part of attribution-patching
/// (its old path).
pub use attribution_patching::atp_star;

kinds! {
    phase_sweep::PhaseSweep,
    patch_heads::PatchHeads,
    ablate::AblateHeads,
    knockout::Knockout,
    gate_profiles::GateProfiles,
    gate_cycling::GateCycling,
    long_context::LongContext,
    attribution_patching::AttributionPatching,
    path_patching::PathPatching,
    retrieval_heads::RetrievalHeads,
    filler_probe::FillerProbe,
    indexer_diagnostics::IndexerDiagnostics,
    edge_attribution::EdgeAttribution,
}
