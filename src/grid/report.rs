//! Grid report (in progress).
use super::merge::Merged;
use super::spec::Grid;
use crate::error::Result;
use std::path::{Path, PathBuf};
/// Write the report into `dir`.
pub fn write(_grid: &Grid, _m: &Merged, dir: &Path, _figures: &[PathBuf]) -> Result<PathBuf> {
    Ok(dir.join("report.md"))
}
