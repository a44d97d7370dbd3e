//! The backend equivalence matrix (src/backends/) on every device this build has:
//! flex always; tch-cpu when built with `tch`; wgpu when built with `wgpu` (on CI through
//! Mesa's software Vulkan; set PHASELENS_SKIP_WGPU=1 on a machine with no Vulkan driver
//! at all). Every check must be `ok`; a built device that does not work fails the test.
//! Also `phaselens backends` itself, and that a wrong result is reported as WRONG.

use std::path::PathBuf;
use std::process::Command;

use phaselens::backends::{Check, MatrixOptions, Status, render, run_matrix};
use phaselens::device::DeviceSpec;

fn matrix_on(spec: DeviceSpec, required: bool) {
    if !spec.is_built() {
        eprintln!(
            "{spec}: not built in this test binary (feature `{}`); nothing to check",
            spec.feature()
        );
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let cells = run_matrix(&MatrixOptions {
        devices: vec![spec.clone()],
        checks: Check::ALL.to_vec(),
        root: PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        scratch: scratch.path().to_path_buf(),
        verbose: true,
    })
    .unwrap();
    let text = render(&cells);
    eprintln!("{text}");
    assert_eq!(cells.len(), Check::ALL.len());
    for c in &cells {
        match &c.status {
            Status::Ok { .. } => {}
            Status::Unavailable { message } if !required => {
                eprintln!("{spec} unavailable here ({message}); skipped as allowed");
                return;
            }
            other => panic!("{spec} {}: {other:?}\n{text}", c.check),
        }
    }
}

#[test]
fn matrix_flex() {
    matrix_on(DeviceSpec::Cpu, true);
}

#[test]
fn matrix_tch_cpu() {
    matrix_on(DeviceSpec::TchCpu, true);
}

#[test]
fn matrix_wgpu() {
    let skip = std::env::var_os("PHASELENS_SKIP_WGPU").is_some_and(|v| v != "0");
    matrix_on(DeviceSpec::Wgpu(None), !skip);
}

#[test]
fn cli_prints_the_matrix_and_names_missing_backends() {
    let out = Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args([
            "backends",
            "--devices",
            "cpu,cuda:0",
            "--checks",
            "kvc-contract",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("kvc-contract"))
        .unwrap_or_else(|| panic!("no kvc-contract row:\n{stdout}"));
    let cols: Vec<&str> = row
        .split("  ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    assert!(cols[1].starts_with("ok "), "{stdout}");
    let cuda = if cfg!(feature = "cuda") {
        ""
    } else {
        "not built"
    };
    assert!(cols[2].contains(cuda), "{stdout}");
    if !cfg!(feature = "cuda") {
        assert!(
            stdout.contains("cuda:0: not built: built without the `cuda` feature"),
            "{stdout}"
        );
    }
}

#[test]
fn cli_rejects_unknown_checks_and_devices() {
    for (flag, value, says) in [
        ("--checks", "kvc-contract,nope", "unknown check `nope`"),
        ("--devices", "cpu,tpu", "unknown device"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_phaselens"))
            .args(["backends", flag, value])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
    }
}
