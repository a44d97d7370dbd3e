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
  phaselens run experiments/v4pro.toml --devices tch-cuda:0,tch-cuda:1   # layers over two GPUs
  phaselens run experiments/v4pro.toml --shard 2/8  # part 2 of 8 (any scheduler); then run without --shard
  phaselens run experiments/v4pro.toml --slurm --shards 8 --time 04:00:00   # array of 8 + merge job

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
    /// Place each model over several devices, layers split by their bytes
    /// (`cpu,tch-cpu`, `tch-cuda:0,tch-cuda:1`); the first holds the embedding, the
    /// inputs and the captures. Overrides `[model.placement]`.
    #[arg(long, value_name = "D1,D2,...")]
    pub devices: Option<String>,
    /// With --devices: memory per device (`6GiB` for each, or one size per device);
    /// layers fill the devices in order, an error names the device that overflows.
    #[arg(long, value_name = "SIZE[,SIZE...]", requires = "devices")]
    pub device_memory: Option<String>,
    /// BF16 / FP8 / FP4 checkpoint weights: `stored` (resident as in the checkpoint,
    /// dequantised where used) or `f32` (dequantised on load, 4 bytes per weight).
    /// Overrides `[model] weights`; default stored.
    #[arg(long, value_name = "stored|f32")]
    pub weights: Option<phaselens::model::stored::Residency>,
    /// Compute dtype of the matrix products: `f32`, or `bf16` (bf16 operands, f32 sums,
    /// bf16 result; the rest f32: torch.autocast's semantics). Overrides `[model] dtype`;
    /// default f32, which gives parity with transformers' f32 forward.
    #[arg(long, value_name = "f32|bf16")]
    pub dtype: Option<phaselens::model::ComputeDtype>,
    /// Compute only part I of N of the run's shards (`--shard 0/4` .. `3/4`, e.g. one
    /// per array task of any scheduler) and write no tables; parts run at once, each
    /// loading the model once. A run without --shard then loads every part's shards and
    /// writes the tables (computing what a failed part left).
    #[arg(long, value_name = "I/N", value_parser = parse_shard)]
    pub shard: Option<(usize, usize)>,
    /// Submit the run to Slurm as an array job of --shards parts
    /// (`phaselens run EXP --shard $SLURM_ARRAY_TASK_ID/N` each) and a merge job after it.
    #[arg(long, requires = "shards", conflicts_with = "shard")]
    pub slurm: bool,
    /// With --slurm: the number of parts (array tasks).
    #[arg(long, requires = "slurm")]
    pub shards: Option<usize>,
    /// With --slurm: the jobs' resources.
    #[command(flatten)]
    pub resources: super::grid::SlurmArgs,
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

/// `i/N` with `i < N`.
fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not I/N (e.g. 0/4)"))?;
    let num = |t: &str| {
        t.trim()
            .parse::<usize>()
            .map_err(|_| format!("`{t}` in `{s}` is not a whole number"))
    };
    let (i, n) = (num(i)?, num(n)?);
    if n == 0 || i >= n {
        return Err(format!("part {i} of {n}: give 0 <= I < N"));
    }
    Ok((i, n))
}

/// `--slurm --shards N`: write the job scripts and submit them.
fn submit_slurm(a: &RunArgs, parts: usize) -> Result<()> {
    use phaselens::grid::run_array::{ShardedRun, submit};
    let exp = phaselens::runner::Experiment::load(&a.experiment)
        .with_context(|| format!("reading {}", a.experiment.display()))?;
    let mut device_args = Vec::new();
    if let Some(d) = &a.device {
        device_args.extend(["--device".to_string(), d.to_string()]);
    }
    if let Some(d) = &a.devices {
        device_args.extend(["--devices".to_string(), d.clone()]);
    }
    if let Some(m) = &a.device_memory {
        device_args.extend(["--device-memory".to_string(), m.clone()]);
    }
    if let Some(w) = &a.weights {
        device_args.extend(["--weights".to_string(), w.to_string()]);
    }
    if let Some(d) = &a.dtype {
        device_args.extend(["--dtype".to_string(), d.to_string()]);
    }
    if a.no_memory_check {
        device_args.push("--no-memory-check".to_string());
    }
    let r = &a.resources;
    let res = phaselens::grid::slurm::Resources {
        partition: r.partition.clone(),
        cpus_per_task: r.cpus_per_task,
        mem: r.mem.clone(),
        time: r.time.clone(),
        max_parallel: r.max_parallel,
        sbatch_args: r.sbatch_arg.clone(),
    };
    let run = ShardedRun {
        experiment: a.experiment.clone(),
        name: exp.name(),
        parts,
        data_root: a.data_dir.clone(),
        reports_root: a.reports_dir.clone(),
        device_args,
        fresh: a.fresh,
    };
    print!("{}", submit(&run, &res, r.dry_run)?);
    Ok(())
}

/// The run's counters: cells, forwards and seconds, where the time went, the memory
/// estimate.
fn print_counters(s: &phaselens::runner::RunSummary) {
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
    if st.cells_computed > 0 && st.cell_seconds > 0.0 {
        eprintln!(
            "time: base runs {:.1} s, cells {:.1} s ({:.3} s per cell)",
            st.base_seconds,
            st.cell_seconds,
            st.cell_seconds / st.cells_computed as f64
        );
    }
    if st.memory_estimate_bytes > 0.0 {
        eprintln!(
            "memory check: a group's forwards estimated at {} at their largest (beyond the weights)",
            phaselens::model::memory::human(st.memory_estimate_bytes)
        );
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    if let (true, Some(parts)) = (a.slurm, a.shards) {
        return submit_slurm(&a, parts);
    }
    if a.no_memory_check {
        phaselens::model::memory::set_override(true);
    }
    let opts = RunOptions {
        data_root: a.data_dir,
        reports_root: a.reports_dir,
        fresh: a.fresh,
        device: a.device,
        devices: a
            .devices
            .as_deref()
            .map(|d| {
                let sizes = a
                    .device_memory
                    .as_deref()
                    .map(|m| {
                        m.split(',')
                            .map(|s| {
                                phaselens::model::plan::parse_bytes(s).map_err(anyhow::Error::msg)
                            })
                            .collect::<Result<Vec<f64>>>()
                    })
                    .transpose()
                    .context("--device-memory")?;
                Ok::<_, anyhow::Error>(phaselens::model::placement::DevicesRequest::new(d, sizes)?)
            })
            .transpose()?,
        weights: a.weights,
        dtype: a.dtype,
        shard: a.shard,
        progress: if a.plain {
            ProgressMode::Plain
        } else {
            ProgressMode::Auto
        },
        figures: !a.no_figures,
    };
    let s = run_experiment(&a.experiment, &opts)
        .with_context(|| format!("running {}", a.experiment.display()))?;
    print_counters(&s);
    if let Some((i, n)) = a.shard {
        eprintln!(
            "part {i}/{n} done: its shards are in {}; run without --shard to merge",
            s.data_dir.join("shards").display()
        );
    }
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
