//! `phaselens figures`: redraw figures and reports from the tables, without a model.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use phaselens::runner::report::draw_all;

/// Redraw every figure and report from the tables under notebooks-data/ (no model runs).
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens figures                        # every experiment under notebooks-data/
  phaselens figures --experiment v4pro     # one experiment")]
pub struct FiguresArgs {
    /// Only this experiment (its folder name under the data root).
    #[arg(long)]
    pub experiment: Option<String>,
    /// Root of the tables.
    #[arg(long, default_value = "notebooks-data")]
    pub data_dir: PathBuf,
    /// Root of the figures and reports.
    #[arg(long, default_value = "reports")]
    pub reports_dir: PathBuf,
}

pub fn run(a: FiguresArgs) -> Result<()> {
    let done = draw_all(&a.data_dir, &a.reports_dir, a.experiment.as_deref())?;
    if done.is_empty() {
        eprintln!(
            "no experiment tables under {} (run `phaselens run <experiment.toml>` first)",
            a.data_dir.display()
        );
    }
    // The static explorers that exist (`phaselens view` creates them) follow the tables.
    for site in phaselens::view::redraw_sites(&a.data_dir, &a.reports_dir, a.experiment.as_deref())?
    {
        eprintln!("view: {}", site.dir.join("index.html").display());
    }
    for (name, files) in done {
        eprintln!(
            "{name}: {} files, report {}",
            files.len(),
            a.reports_dir.join(&name).join("report.md").display()
        );
    }
    Ok(())
}
