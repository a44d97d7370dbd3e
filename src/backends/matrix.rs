//! The backend equivalence matrix: every check of [`Check`] on every device, each
//! compared with the reference (the DeepSeek-V4 fixtures' transformers outputs, or the
//! same computation on the `flex` CPU backend). `phaselens backends` prints it;
//! tests/it/backends.rs asserts it is all `ok` on each device the build has.
//!
//! | check | what must hold | tolerance |
//! |---|---|---|
//! | `v4-parity` | DeepSeek-V4 logits of every fixture under tests/fixtures/deepseek_v4 vs transformers | 1e-4 relative (max abs diff / max abs reference) |
//! | `kvc-contract` | kvc-w8s8: capturing every hook point leaves the logits unchanged; patching every point from the clean cache reproduces the clean logits; a suffix forward equals the plain forward at its positions; the logits equal flex's | 1e-5 relative on the device, 1e-4 against flex |
//! | `patching-table` | a small patch-heads experiment on kvc-w8s8: every column of the long table equal to flex's run | 1e-4 on floats (absolute up to 1, relative above), exact elsewhere |
//! | `training` | 20 optimiser steps of a small kvc recipe from the same initial weights and batches: the loss curve equal to flex's | 1e-3 absolute per step |
//! | `checkpoint` | 10 steps, save, resume to 20: the curve equals the uninterrupted run's, and the saved model gives the same logits on the device and on flex | 1e-5 on the curve, 1e-4 relative on the logits |

use std::path::PathBuf;
use std::time::Instant;

use super::checks::{self, References};
use super::{Cell, Check, Status};
use crate::device::{DeviceSpec, probe};
use crate::error::{Error, Result};

/// What to run.
#[derive(Debug, Clone)]
pub struct MatrixOptions {
    /// Devices (columns).
    pub devices: Vec<DeviceSpec>,
    /// Checks (rows).
    pub checks: Vec<Check>,
    /// The phaselens source tree: tests/fixtures/deepseek_v4 and
    /// experiments/organisms/kvc-w8s8 are read from it.
    pub root: PathBuf,
    /// Scratch folder for the runs (tables, checkpoints); created if missing.
    pub scratch: PathBuf,
    /// Print a line per cell on stderr as it finishes.
    pub verbose: bool,
}

/// The devices `phaselens backends` checks by default: flex, LibTorch on the CPU and
/// the first CUDA GPU, wgpu's default adapter, burn's CUDA backend.
pub fn default_devices() -> Vec<DeviceSpec> {
    vec![
        DeviceSpec::Cpu,
        DeviceSpec::TchCpu,
        DeviceSpec::Wgpu(None),
        DeviceSpec::TchCuda(0),
        DeviceSpec::Cuda(0),
    ]
}

/// Run the matrix. Cells come back device by device, checks in the order asked.
pub fn run_matrix(opts: &MatrixOptions) -> Result<Vec<Cell>> {
    std::fs::create_dir_all(&opts.scratch).map_err(|e| Error::io(&opts.scratch, e))?;
    let mut refs = References::new(&opts.root, &opts.scratch);
    let mut cells = Vec::new();
    for spec in &opts.devices {
        let gate = probe(spec).map_err(Status::from);
        for &check in &opts.checks {
            let t0 = Instant::now();
            let status = match &gate {
                Err(s) => s.clone(),
                Ok(device) => checks::run(check, spec, device, &mut refs),
            };
            let cell = Cell {
                device: spec.to_string(),
                check,
                status,
                seconds: t0.elapsed().as_secs_f64(),
            };
            if opts.verbose {
                eprintln!(
                    "backends: {:<10} {:<15} {:<22} {:>6.1} s",
                    cell.device,
                    cell.check.name(),
                    cell.status.short(),
                    cell.seconds
                );
            }
            cells.push(cell);
        }
    }
    Ok(cells)
}

/// The matrix as text: a row per check, a column per device, then the details of every
/// cell that is not `ok`.
pub fn render(cells: &[Cell]) -> String {
    let mut devices: Vec<&str> = Vec::new();
    let mut checks: Vec<Check> = Vec::new();
    for c in cells {
        if !devices.contains(&c.device.as_str()) {
            devices.push(&c.device);
        }
        if !checks.contains(&c.check) {
            checks.push(c.check);
        }
    }
    let width = cells
        .iter()
        .map(|c| c.status.short().len())
        .chain(devices.iter().map(|d| d.len()))
        .max()
        .unwrap_or(8)
        + 2;
    let mut out = format!("{:<16}", "check");
    for d in &devices {
        out += &format!("{d:<width$}");
    }
    out.push('\n');
    for check in &checks {
        out += &format!("{:<16}", check.name());
        for d in &devices {
            let s = cells
                .iter()
                .find(|c| c.check == *check && c.device == *d)
                .map_or_else(|| "-".to_string(), |c| c.status.short());
            out += &format!("{s:<width$}");
        }
        out.push('\n');
    }
    let notes = details(cells);
    if !notes.is_empty() {
        out.push('\n');
        out += &notes;
    }
    out.trim_end().to_string() + "\n"
}

fn details(cells: &[Cell]) -> String {
    let mut out = String::new();
    let mut said: Vec<(String, String)> = Vec::new();
    for c in cells {
        let why = match &c.status {
            Status::Ok { .. } => continue,
            Status::Wrong { detail, .. } => detail.clone(),
            Status::Error { message } | Status::Unavailable { message } => message.clone(),
            Status::NotBuilt { feature } => {
                format!("built without the `{feature}` feature (see README, \"Backends\")")
            }
        };
        // A device that is not built or not available says so once, not per check.
        let key = match &c.status {
            Status::NotBuilt { .. } | Status::Unavailable { .. } => {
                (c.device.clone(), String::new())
            }
            _ => (c.device.clone(), c.check.name().to_string()),
        };
        if said.contains(&key) {
            continue;
        }
        said.push(key.clone());
        let what = if key.1.is_empty() {
            String::new()
        } else {
            format!(" {}", key.1)
        };
        out += &format!("{}{what}: {}: {why}\n", c.device, c.status.short());
    }
    out
}
