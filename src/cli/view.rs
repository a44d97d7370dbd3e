//! `phaselens view`: write the static explorer of an experiment (or a grid).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::view::{CaptureOptions, ViewOptions, view_experiment, view_grid};

/// Write a self-contained static site (open index.html from disk; nothing is fetched):
/// head x phase maps, accuracy by phase, the prompt view, the phase shift, interventions.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens view v4pro                         # reports/v4pro/view/index.html
  phaselens view experiments/w8s8-knockout.toml --open
  phaselens view w8s8-ablate --out /tmp/ablate-view
  phaselens view --grid paper                  # reports/grids/paper/view/index.html

The experiment must have run (its tables under notebooks-data/<experiment>/). When its
exemplar table (notebooks-data/<experiment>/exemplars.arrow, docs/tables.md) is missing,
view loads the experiment's model once and captures it through the hook points
(hook_pattern, hook_key_gate, indexer hook_scores / hook_selected); --no-capture skips
that. `phaselens figures` redraws the sites that exist. The page: docs/view.md.")]
pub struct ViewArgs {
    /// Experiment name (folder under the data root) or its TOML.
    #[arg(required_unless_present = "grid", conflicts_with = "grid")]
    pub experiment: Option<String>,
    /// A merged grid (name under <data root>/grids/, or its TOML) instead of an experiment.
    #[arg(long)]
    pub grid: Option<String>,
    /// Site folder (default: <reports dir>/<experiment>/view).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Open index.html in the default browser (xdg-open / open).
    #[arg(long)]
    pub open: bool,
    /// Never load the model (no exemplars are captured when the table is missing).
    #[arg(long)]
    pub no_capture: bool,
    /// Logical examples in a captured exemplar table (each at every phase).
    #[arg(long, default_value_t = 2, value_parser = super::run::at_least_one)]
    pub exemplars: usize,
    /// Device for the capture forwards.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// BF16 / FP8 / FP4 checkpoint weights for the capture forwards: `stored` (resident
    /// as in the checkpoint, dequantised where used) or `f32` (dequantised on load).
    /// Overrides the experiment's `[model] weights`; default stored.
    #[arg(long, value_name = "stored|f32")]
    pub weights: Option<phaselens::model::stored::Residency>,
    /// Root of the tables.
    #[arg(long, default_value = "notebooks-data")]
    pub data_dir: PathBuf,
    /// Root of the figures and reports.
    #[arg(long, default_value = "reports")]
    pub reports_dir: PathBuf,
    /// Where `<name>.toml` is found when the experiment is given by name.
    #[arg(long, default_value = "experiments")]
    pub experiments_dir: PathBuf,
}

pub fn run(a: ViewArgs) -> Result<()> {
    let o = ViewOptions {
        data_root: a.data_dir,
        reports_root: a.reports_dir,
        out: a.out,
        experiments_dir: a.experiments_dir,
        capture: (!a.no_capture).then(|| CaptureOptions {
            logical: a.exemplars,
            device: a.device,
            weights: a.weights,
            ..CaptureOptions::default()
        }),
    };
    let site = match (&a.grid, &a.experiment) {
        (Some(g), _) => view_grid(g, &o).with_context(|| format!("viewing grid {g}"))?,
        (None, Some(e)) => view_experiment(e, &o).with_context(|| format!("viewing {e}"))?,
        (None, None) => anyhow::bail!("give an experiment or --grid GRID"),
    };
    if let Some(p) = &site.captured {
        eprintln!("exemplars: {} (captured from the model)", p.display());
    }
    for w in &site.warnings {
        eprintln!("warning: {w}");
    }
    let index = site.dir.join("index.html");
    eprintln!(
        "site: {} ({} files, {:.1} KB)",
        index.display(),
        site.files.len(),
        site.bytes as f64 / 1024.0
    );
    if a.open {
        let opener = if cfg!(target_os = "macos") {
            "open"
        } else {
            "xdg-open"
        };
        std::process::Command::new(opener)
            .arg(&index)
            .spawn()
            .with_context(|| format!("{opener} {}", index.display()))?;
    }
    Ok(())
}
