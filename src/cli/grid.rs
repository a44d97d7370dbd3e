//! `phaselens grid`: train and phase-sweep a matrix of designs, locally or on Slurm.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

use phaselens::device::DeviceSpec;
use phaselens::grid::slurm::{self, Resources};
use phaselens::grid::{self, Grid, GridOptions};
use phaselens::runner::ProgressMode;

const EXAMPLES: &str = "\
Examples:
  phaselens grid list experiments/grids/paper.toml        # the designs and how far each got
  phaselens grid experiments/grids/paper.toml --local     # one design after another, resumable
  phaselens grid experiments/grids/paper.toml --local --designs w8s8-seed0,w8s8-kv2
  phaselens grid experiments/grids/paper.toml --slurm --time 04:00:00 --mem 4G
  phaselens grid status experiments/grids/paper.toml      # squeue, sacct (scontrol) per design
  phaselens grid experiments/grids/paper.toml --slurm --resume   # resubmit what failed
  phaselens grid merge experiments/grids/paper.toml       # tables, figures, report again

Each design gets <grid dir>/<grid>/<design>/recipe.toml (+ model/, run/ checkpoints, eval/
experiments), sweeps under notebooks-data/grids/<grid>/<design>/, and the merge writes
notebooks-data/grids/<grid>/grid.arrow + grid_summary.arrow (+ Parquet) and
reports/grids/<grid>/ (figures, report.md, report.html). Keys and files: docs/grid.md.

Key aliases (any other key is a dotted recipe path such as train.lr):
";

/// The examples, then every key alias with its recipe keys (from the grid's own table).
fn after_help() -> String {
    format!("{EXAMPLES}{}", grid::aliases_help())
}

/// Train and phase-sweep a grid of controlled designs (locally or as a Slurm job
/// array), then merge every sweep into one table, figures and a report.
#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    after_help = after_help()
)]
pub struct GridArgs {
    #[command(subcommand)]
    pub command: Option<GridCommand>,
    /// Grid TOML.
    pub grid: Option<PathBuf>,
    /// Run the designs here, one after another (the default).
    #[arg(long, conflicts_with = "slurm")]
    pub local: bool,
    /// Submit one `sbatch --array` job (a task per design) and a dependent merge job.
    #[arg(long)]
    pub slurm: bool,
    /// With --slurm: submit only the designs that are not finished and not queued or
    /// running (their training resumes from its checkpoints).
    #[arg(long, requires = "slurm")]
    pub resume: bool,
    /// Only these designs (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    pub designs: Vec<String>,
    /// Locally: when a design fails, report it and go on with the next.
    #[arg(long)]
    pub keep_going: bool,
    /// Retrain and re-sweep from scratch (ignore checkpoints and finished sweeps).
    #[arg(long)]
    pub fresh: bool,
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub resources: SlurmArgs,
}

/// Output roots and device, shared by every grid command.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Device of training and sweeps: cpu, wgpu[:N], tch-cpu, tch-cuda:N, cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Root of the tables (sweeps and merged tables go to <root>/grids/<grid>/).
    #[arg(long, default_value = "notebooks-data")]
    pub data_dir: PathBuf,
    /// Root of the figures and reports (<root>/grids/<grid>/).
    #[arg(long, default_value = "reports")]
    pub reports_dir: PathBuf,
    /// Plain progress lines instead of bars (the default when stderr is not a terminal).
    #[arg(long)]
    pub plain: bool,
}

impl CommonArgs {
    fn options(&self, fresh: bool) -> GridOptions {
        GridOptions {
            data_root: self.data_dir.clone(),
            reports_root: self.reports_dir.clone(),
            device: self.device.clone(),
            progress: if self.plain {
                ProgressMode::Plain
            } else {
                ProgressMode::Auto
            },
            fresh,
        }
    }
}

/// Slurm resources (override the grid file's [slurm]).
#[derive(Args, Debug, Clone, Default)]
pub struct SlurmArgs {
    /// sbatch --partition.
    #[arg(long)]
    pub partition: Option<String>,
    /// sbatch --cpus-per-task.
    #[arg(long)]
    pub cpus_per_task: Option<u32>,
    /// sbatch --mem (e.g. 4G).
    #[arg(long)]
    pub mem: Option<String>,
    /// sbatch --time (e.g. 04:00:00).
    #[arg(long)]
    pub time: Option<String>,
    /// At most this many array tasks at once (--array=...%N).
    #[arg(long)]
    pub max_parallel: Option<usize>,
    /// One more sbatch argument, verbatim (repeatable), e.g. --sbatch-arg=--account=lab.
    #[arg(long, allow_hyphen_values = true)]
    pub sbatch_arg: Vec<String>,
    /// Write the job scripts and print the sbatch commands without submitting.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Subcommand, Debug)]
pub enum GridCommand {
    /// List the designs, their keys and how far each got.
    List {
        grid: PathBuf,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// The Slurm state of each design (squeue for pending/running, sacct for finished,
    /// scontrol where there is no accounting) and how far its files got.
    Status {
        grid: PathBuf,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Merge every finished design's sweeps into tables, figures and the report.
    Merge {
        grid: PathBuf,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Train and sweep one design (what each Slurm array task runs).
    Task {
        grid: PathBuf,
        /// Design index (default: $SLURM_ARRAY_TASK_ID).
        #[arg(long, conflicts_with = "design")]
        index: Option<usize>,
        /// Design name.
        #[arg(long)]
        design: Option<String>,
        #[command(flatten)]
        common: CommonArgs,
    },
}

/// Load a grid and check every design's sweep settings (before anything runs).
fn load(path: &Path) -> Result<Grid> {
    let g = Grid::load(path).with_context(|| format!("loading grid {}", path.display()))?;
    grid::check_sweeps(&g).with_context(|| format!("loading grid {}", path.display()))?;
    Ok(g)
}

pub fn run(a: GridArgs) -> Result<()> {
    match a.command {
        Some(GridCommand::List { grid, common }) => list(&load(&grid)?, &common.options(false)),
        Some(GridCommand::Status { grid, common }) => {
            let g = load(&grid)?;
            let report = slurm::status(&g, &common.options(false))?;
            print!("{report}");
            Ok(())
        }
        Some(GridCommand::Merge { grid, common }) => {
            let g = load(&grid)?;
            let s = grid::merge(&g, &common.options(false))?;
            eprintln!("{s}");
            Ok(())
        }
        Some(GridCommand::Task {
            grid,
            index,
            design,
            common,
        }) => {
            let g = load(&grid)?;
            let d = match (index, design) {
                (_, Some(name)) => g.design(&name)?,
                (Some(i), None) => g.designs.get(i).with_context(|| {
                    format!("design index {i} out of range (0..{})", g.designs.len())
                })?,
                (None, None) => {
                    let i: usize = std::env::var("SLURM_ARRAY_TASK_ID")
                        .context("give --index or --design (SLURM_ARRAY_TASK_ID is not set)")?
                        .parse()
                        .context("SLURM_ARRAY_TASK_ID is not a number")?;
                    g.designs.get(i).with_context(|| {
                        format!(
                            "SLURM_ARRAY_TASK_ID {i} out of range (0..{})",
                            g.designs.len()
                        )
                    })?
                }
            };
            let r = grid::run_design(&g, d, &common.options(false))?;
            eprintln!(
                "{}: done (batch accuracy {:.3}, sweeps: {})",
                r.design,
                r.final_batch_accuracy.unwrap_or(f64::NAN),
                r.evals.join(", ")
            );
            Ok(())
        }
        None => {
            let Some(path) = a.grid else {
                bail!("give a grid TOML (see `phaselens grid --help`)");
            };
            let g = load(&path)?;
            let opts = a.common.options(a.fresh);
            if a.slurm {
                let r = &a.resources;
                let res = Resources {
                    partition: r.partition.clone(),
                    cpus_per_task: r.cpus_per_task,
                    mem: r.mem.clone(),
                    time: r.time.clone(),
                    max_parallel: r.max_parallel,
                    sbatch_args: r.sbatch_arg.clone(),
                }
                .over(&g.slurm);
                let sub = slurm::submit(&g, &opts, &res, &a.designs, a.resume, r.dry_run)?;
                print!("{sub}");
                return Ok(());
            }
            let done = grid::run_local(&g, &opts, &a.designs, a.keep_going)?;
            eprintln!("{} design(s) done", done.len());
            Ok(())
        }
    }
}

fn list(g: &Grid, opts: &GridOptions) -> Result<()> {
    println!(
        "grid `{}` ({} designs; base {}; designs in {})",
        g.name,
        g.designs.len(),
        g.base.display(),
        g.dir.display()
    );
    for d in &g.designs {
        let keys: Vec<String> = d.keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let state = slurm::design_progress(g, d, opts);
        println!(
            "{:>3}  {:<24} {:<40} {}",
            d.index,
            d.name,
            keys.join(" "),
            state
        );
    }
    Ok(())
}
