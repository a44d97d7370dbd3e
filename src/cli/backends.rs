//! `phaselens backends`: the backend equivalence matrix on this machine (device x check:
//! ok / WRONG with the error / error / not built / unavailable), like a doctor command.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use phaselens::backends::{Check, MatrixOptions, default_devices, render, run_matrix};
use phaselens::device::DeviceSpec;

#[derive(Args, Debug)]
#[command(after_help = "\
Checks (each against flex, the pure-Rust CPU backend, or against transformers):
  v4-parity       DeepSeek-V4 fixtures' logits vs transformers (1e-4 relative)
  kvc-contract    kvc-w8s8: capture-all and patch-all leave logits unchanged, suffix
                  forward == plain forward (1e-5), logits vs flex (1e-4)
  patching-table  a small patch-heads run on kvc-w8s8: its table vs flex's (1e-4)
  training        20 steps of a small kvc recipe: loss curve vs flex's (1e-3)
  checkpoint      10 steps, save, resume to 20 == uninterrupted (1e-5); the saved
                  model's logits on the device vs on flex (1e-4)
Exit status 1 when a device this machine has is WRONG or fails a check.
Example: phaselens backends --devices cpu,tch-cpu --checks kvc-contract,training")]
pub struct BackendsArgs {
    /// Devices to check, comma-separated (default: cpu, tch-cpu, wgpu, tch-cuda:0, cuda:0).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<String>>,
    /// Checks to run, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    checks: Option<Vec<String>>,
    /// The phaselens source tree that holds tests/fixtures/deepseek_v4 and
    /// experiments/organisms/kvc-w8s8 (default: the current directory when it has them,
    /// else the tree this binary was built from).
    #[arg(long)]
    root: Option<PathBuf>,
    /// Keep the checks' runs (tables, checkpoints) in this folder (default: a temporary
    /// folder, removed at the end).
    #[arg(long)]
    scratch: Option<PathBuf>,
    /// Print the cells as JSON lines instead of the matrix.
    #[arg(long)]
    json: bool,
}

fn source_root(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let has = |p: &Path| {
        p.join("tests/fixtures/deepseek_v4").is_dir() && p.join("experiments/organisms").is_dir()
    };
    if let Some(r) = given {
        if !has(&r) {
            bail!(
                "--root {}: no tests/fixtures/deepseek_v4 and experiments/organisms there",
                r.display()
            );
        }
        return Ok(r);
    }
    let cwd = std::env::current_dir().context("current directory")?;
    if has(&cwd) {
        return Ok(cwd);
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if has(&built) {
        return Ok(built);
    }
    bail!(
        "run from the phaselens source tree or pass --root (the fixtures and the shipped organism are read from it)"
    )
}

pub fn run(a: BackendsArgs) -> anyhow::Result<()> {
    let devices = match a.devices {
        None => default_devices(),
        Some(v) => v
            .iter()
            .map(|s| s.parse::<DeviceSpec>())
            .collect::<Result<_, _>>()?,
    };
    let checks = match a.checks {
        None => Check::ALL.to_vec(),
        Some(v) => v
            .iter()
            .map(|s| s.parse::<Check>())
            .collect::<Result<_, _>>()?,
    };
    let temporary = a.scratch.is_none();
    let scratch = a.scratch.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("phaselens-backends-{}", std::process::id()))
    });
    let opts = MatrixOptions {
        devices,
        checks,
        root: source_root(a.root)?,
        scratch: scratch.clone(),
        verbose: !a.json,
    };
    let cells = run_matrix(&opts);
    if temporary {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let cells = cells?;
    if a.json {
        for c in &cells {
            println!("{}", serde_json::to_string(c)?);
        }
    } else {
        print!("{}", render(&cells));
    }
    let failed = cells.iter().filter(|c| c.status.is_failure()).count();
    if failed > 0 {
        bail!("{failed} check(s) failed on a device this machine has");
    }
    Ok(())
}
