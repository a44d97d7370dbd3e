//! Grid figures (in progress).
use super::merge::Merged;
use super::spec::Grid;
use crate::error::Result;
use std::path::{Path, PathBuf};
/// Draw the grid figures into `dir`.
pub fn draw(_grid: &Grid, _m: &Merged, _dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(Vec::new())
}
