//! phaselens: mechanistic interpretability of phase sensitivity in chunk-compressed
//! KV-cache language models.
//!
//! Data flows one way: config -> model + task -> runner (hooks, interventions) ->
//! tables -> figures/report.

pub mod analysis;
pub mod audit;
pub mod device;
pub mod error;
pub mod grid;
pub mod hooks;
pub mod model;
pub mod output;
pub mod runner;
pub mod tasks;
pub mod toml_file;
pub mod train;

pub use error::{Error, Result};
