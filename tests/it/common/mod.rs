//! Shared by the integration tests: the CPU device, reading tensors back, comparing
//! logits ([`mod@self`]), and tiny organisms and experiment files for the runner tests
//! ([`runner`]). Tiny model configs come from `KvcConfig::tiny()`.
#![allow(dead_code)]

pub mod pretrained;
pub mod runner;

use burn::tensor::{Device, Tensor};

/// The device every test runs on.
pub fn dev() -> Device {
    Device::flex()
}

/// All values of a tensor, row-major, as `f32`.
pub fn vals<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// Rows `from[r]..from[r] + len` of `[b, t, v]` logits (row `r` of the batch),
/// flattened.
pub fn rows_at(t: Tensor<3>, from: &[usize], len: usize) -> Vec<f32> {
    let [_, tt, v] = t.dims();
    let all = vals(t);
    let mut out = Vec::new();
    for (r, &f) in from.iter().enumerate() {
        out.extend_from_slice(&all[(r * tt + f) * v..(r * tt + f + len) * v]);
    }
    out
}

/// Largest absolute difference of two equally long slices.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// [`max_diff`] relative to the largest magnitude of `b`.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    max_diff(a, b) / m
}

/// A DeepSeek-V4 parity fixture folder (tests/fixtures/deepseek_v4/NAME).
pub fn v4_fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name)
}

/// Run the built `phaselens` binary with `args` and wait for it.
pub fn phaselens(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(args)
        .output()
        .unwrap()
}
