//! `phaselens grid-shift A B [--offset D]`: the grid-shift test of a phase effect from
//! two phase sweeps' per-example tables (`examples.arrow`), with paired cluster-bootstrap
//! intervals (`phaselens::runner::grid_shift`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use phaselens::runner::grid_shift::{GridShiftRequest, run_grid_shift};
use phaselens::tasks::Protocol;

/// The grid-shift test: does run B's profile equal run A's rolled by B's grid offset?
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens grid-shift gemma3-passkey-select gemma3-passkey-select-shift4
  phaselens grid-shift exp/gemma3-select.toml exp/gemma3-select-shift4.toml --offset 4 --reps 5000

Reads notebooks-data/<A>/<model>/examples.arrow and the same of B (phase-sweep writes them;
rerun `phaselens run exp/<name>.toml` on an older run: it resumes from its shards). Both
runs must have the same model, [task] settings (period, task, seed, examples) and logical
examples. r(k) is the Pearson correlation of B's per-phase profile with A's rolled by k
(roll(a, k)[r] = a[(r - k) mod P]); a paired bootstrap over logical examples gives 95%
intervals for r(D), r(D) - r(0) and the fraction of resamples whose best k is D.
Writes notebooks-data/grid-shift/<A>--<B>.arrow (+ .parquet; docs/tables.md, grid_shift/v1)
and reports/grid-shift/<A>--<B>.md.")]
pub struct GridShiftArgs {
    /// Run A (the reference grid): an experiment name under the data root, or its TOML.
    pub a: String,
    /// Run B (the grid offset by D): an experiment name, or its TOML.
    pub b: String,
    /// B's grid offset against A's, in tokens (default: from the runs' `[model]
    /// compression` offsets, B's minus A's, modulo the period).
    #[arg(long)]
    pub offset: Option<usize>,
    /// Bootstrap replicates.
    #[arg(long, default_value_t = 2000)]
    pub reps: usize,
    /// Bootstrap seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The model (when a run swept several).
    #[arg(long)]
    pub model: Option<String>,
    /// The protocol, `prefix` or `in-sequence` (when the runs share both).
    #[arg(long)]
    pub protocol: Option<Protocol>,
    /// Root of the tables.
    #[arg(long, default_value = "notebooks-data")]
    pub data_dir: PathBuf,
    /// Root of the reports.
    #[arg(long, default_value = "reports")]
    pub reports_dir: PathBuf,
}

pub fn run(args: GridShiftArgs) -> Result<()> {
    let out = run_grid_shift(&GridShiftRequest {
        a: args.a,
        b: args.b,
        offset: args.offset,
        reps: args.reps,
        seed: args.seed,
        model: args.model,
        protocol: args.protocol,
        data_dir: args.data_dir,
        reports_dir: args.reports_dir,
    })?;
    print!("{}", out.summary);
    eprintln!(
        "table: {}\nreport: {}",
        out.table.display(),
        out.report.display()
    );
    Ok(())
}
