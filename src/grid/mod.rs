//! `phaselens grid GRID.toml`: train and phase-sweep a matrix of controlled designs,
//! on this machine or as a Slurm job array, and merge the sweeps into one table,
//! figures and a report.
//!
//! ```text
//! grid TOML --spec--> designs (each: a recipe = base recipe + keys)
//!   --task (per design: `train` + `phase-sweep` experiments, resumable)-->
//!       local: one design after another | slurm: one array task per design
//!   --merge (polars)--> grid.arrow / grid_summary.arrow (+ Parquet)
//!   --figures, report--> reports/grids/<grid>/
//! ```
//!
//! | file | role |
//! |---|---|
//! | `spec` | the grid TOML, design expansion, validation with file:line:key errors |
//! | `keys` | recipe key paths, aliases (`W`, `S`, `kv_heads`, `seed`, ...), design names |
//! | [`task`] | one design: recipe, training, sweeps, its `design.json` record |
//! | [`slurm`] | `sbatch --array` + a dependent merge job, `status` from squeue/sacct, `--resume` |
//! | [`run_array`] | `phaselens run EXP --slurm --shards N`: one experiment's shards as an array job + merge |
//! | `merge` | every design's sweeps into long tables (polars), resumable |
//! | [`frontier`] | designs pooled over seeds: gap vs mean accuracy, CIs, the gap gate's verdict |
//! | [`merged`] | the merged rows and the look-ups the figures and the report share |
//! | `figures` | phase gap per design, accuracy-by-phase small multiples, seed variance, slots, bindings |
//! | `report` | the designs side by side with the paper's numbers, what each learned |

pub mod frontier;
pub mod merged;

mod figures;
mod keys;
mod merge;
mod report;
mod spec;

#[doc(hidden)] // `phaselens run EXP --slurm` (the CLI)
pub mod run_array;
#[doc(hidden)] // `phaselens grid --slurm` and `grid status` (the CLI)
pub mod slurm;
#[doc(hidden)] // one design's recipe, training and sweeps: the CLI and tests/it
pub mod task;

use crate::error::{Error, Result};

pub use merge::MergeSummary;
#[doc(hidden)] // the alias table of `phaselens grid --help`
pub use spec::aliases_help;
pub use spec::{Design, EvalConfig, Grid, SlurmConfig};
pub use task::{DesignRecord, GridOptions, check_sweeps, finished, run_design, write_recipes};

/// Merge the designs' sweeps into the grid tables, then draw the figures, then write
/// the report (in that order: `merge.rs`, `figures.rs`, `report.rs`).
/// Returns what was written.
pub fn merge(grid: &Grid, opts: &GridOptions) -> Result<MergeSummary> {
    let (mut out, m) = merge::merge_tables(grid, opts)?;
    let dir = opts.report_dir(grid);
    out.figures = figures::draw(grid, &m, &dir)?;
    out.report = Some(report::write(grid, &m, &dir, &out.figures)?);
    Ok(out)
}

/// Run designs one after another on this machine (all of them, or those named in
/// `only`), then merge. Finished designs are skipped, interrupted ones resume. With
/// `keep_going` a failing design is reported and the next one runs.
pub fn run_local(
    grid: &Grid,
    opts: &GridOptions,
    only: &[String],
    keep_going: bool,
) -> Result<Vec<DesignRecord>> {
    for n in only {
        grid.design(n)?;
    }
    // Every sweep's settings and the device are checked before any recipe or folder
    // is written.
    task::check_sweeps(grid)?;
    opts.device.device()?;
    write_recipes(grid)?;
    let todo: Vec<&Design> = grid
        .designs
        .iter()
        .filter(|d| only.is_empty() || only.contains(&d.name))
        .collect();
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for (i, d) in todo.iter().enumerate() {
        if !opts.fresh
            && let Some(r) = finished(grid, d, opts)
        {
            eprintln!("[{}/{}] {}: done", i + 1, todo.len(), d.name);
            done.push(r);
            continue;
        }
        eprintln!("[{}/{}] {}", i + 1, todo.len(), d.name);
        match run_design(grid, d, opts) {
            Ok(r) => done.push(r),
            Err(e) if keep_going => {
                eprintln!("error: {e}");
                failed.push(d.name.clone());
            }
            Err(e) => return Err(e),
        }
    }
    merge(grid, opts)?;
    if !failed.is_empty() {
        return Err(Error::Other(format!(
            "{} design(s) failed: {}",
            failed.len(),
            failed.join(", ")
        )));
    }
    Ok(done)
}
