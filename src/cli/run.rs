//! `phaselens run`: run an experiment TOML; `phaselens bench patching`: batched vs
//! one-forward-per-cell throughput of the runner's patching routine.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::runner::patching::Positions;
use phaselens::runner::{ProgressMode, RunOptions, bench, run_experiment};

/// Run an experiment (phase-sweep, patch-heads, ablate-heads, knockout, gate-profiles,
/// gate-cycling); resumes an interrupted run.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens run experiments/v4pro.toml            # patch-heads (what `just patch-heads exp/v4pro.toml` runs)
  phaselens run experiments/w8s8-knockout.toml --fresh
  phaselens run experiments/phase-sweep.toml --plain

Tables go to notebooks-data/<experiment>/ (Arrow IPC + Parquet; docs/tables.md), figures and
report.md/report.html to reports/<experiment>/. Finished chunks of cells are kept in
notebooks-data/<experiment>/shards/<settings hash>/: an interrupted run (Ctrl-C, kill) resumes
from them; a run with changed settings computes into its own folder and never deletes another
run's shards. One run per experiment at a time (notebooks-data/<experiment>/.lock). The
experiment keys are in docs/experiments.md.")]
pub struct RunArgs {
    /// Experiment TOML.
    pub experiment: PathBuf,
    /// Recompute everything (ignore and overwrite this settings' shards).
    #[arg(long)]
    pub fresh: bool,
    /// Device: cpu, wgpu[:N], tch-cpu, tch-cuda:N, cuda:N (default: [model] device, else cpu).
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// Root of the tables.
    #[arg(long, default_value = "notebooks-data")]
    pub data_dir: PathBuf,
    /// Root of the figures and reports.
    #[arg(long, default_value = "reports")]
    pub reports_dir: PathBuf,
    /// Skip figures and report (draw them later with `phaselens figures`).
    #[arg(long)]
    pub no_figures: bool,
    /// Plain progress lines instead of a bar (the default when stderr is not a terminal).
    #[arg(long)]
    pub plain: bool,
    /// Skip the comparison of the run's memory estimate with the machine's available
    /// memory (also PHASELENS_NO_MEMORY_CHECK=1).
    #[arg(long)]
    pub no_memory_check: bool,
}

pub fn run(a: RunArgs) -> Result<()> {
    if a.no_memory_check {
        phaselens::model::memory::set_override(true);
    }
    let opts = RunOptions {
        data_root: a.data_dir,
        reports_root: a.reports_dir,
        fresh: a.fresh,
        device: a.device,
        progress: if a.plain {
            ProgressMode::Plain
        } else {
            ProgressMode::Auto
        },
        figures: !a.no_figures,
    };
    let s = run_experiment(&a.experiment, &opts)
        .with_context(|| format!("running {}", a.experiment.display()))?;
    let st = &s.stats;
    eprintln!(
        "{} `{}` on {}: {} cells computed, {} resumed, {} forward passes, {:.1} s",
        s.kind,
        s.name,
        s.models.join(", "),
        st.cells_computed,
        st.cells_resumed,
        st.forwards,
        s.seconds
    );
    for t in &s.tables {
        eprintln!("table:  {} (+ .parquet)", t.display());
    }
    if !s.figures.is_empty() {
        eprintln!(
            "report: {} ({} figure files)",
            s.report_dir.join("report.md").display(),
            s.figures.len().saturating_sub(2)
        );
    }
    Ok(())
}

/// `phaselens bench patching`.
#[derive(Args, Debug)]
#[command(after_help = "\
Example:
  phaselens bench patching experiments/v4pro.toml --phase 7 --n-logical 32

Patches hook_z of every query and KV head of every layer (denoising and noising) on one
phase group of the experiment's model and prompts, once with the batched routine (one base
run, then one forward_from per layer over cells x prompts rows) and once with one full
forward per cell; prints cells/s of both, their ratio and the largest difference of the
logit differences.")]
pub struct PatchingBench {
    /// Experiment TOML whose model and prompts to use.
    #[arg(default_value = "experiments/v4pro.toml")]
    pub experiment: PathBuf,
    /// Phase group.
    #[arg(long, default_value_t = 0)]
    pub phase: u32,
    /// Logical examples (prompts per cell); default: the experiment's.
    #[arg(long, value_parser = at_least_one)]
    pub n_logical: Option<usize>,
    /// Patched positions: all, answer or final:K; default: the experiment's
    /// `[patch] positions`.
    #[arg(long, value_parser = parse_positions)]
    pub positions: Option<Positions>,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

fn parse_positions(s: &str) -> std::result::Result<Positions, String> {
    Positions::parse(s)
}

pub(crate) fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{s}`: {e}")),
    }
}

pub fn bench_patching(b: PatchingBench) -> Result<()> {
    let r = bench::bench_experiment(&b.experiment, b.phase, b.n_logical, b.positions, &b.device)
        .with_context(|| format!("benchmarking {}", b.experiment.display()))?;
    println!("{r}");
    Ok(())
}
