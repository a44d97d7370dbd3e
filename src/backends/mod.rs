//! The backend equivalence matrix: every [`Check`] on every device, each compared with
//! the reference (the DeepSeek-V4 fixtures' transformers outputs, or the same
//! computation on the `flex` CPU backend). `phaselens backends` prints it;
//! tests/backends.rs asserts it is all `ok` on each device the build has.
//!
//! It sits above the runner and training (it runs both); `crate::device` is the leaf it
//! probes devices with.
//!
//! | file | role |
//! |---|---|
//! | `mod.rs` | [`Check`], [`Status`], [`Cell`] |
//! | [`matrix`] | what to run ([`MatrixOptions`]), [`run_matrix`], [`render`]; the table of checks and tolerances |
//! | `checks.rs` | the checks themselves and the flex references they share |

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::device::Unusable;
use crate::error::{Error, Result};

mod checks;
pub mod matrix;

pub use matrix::{MatrixOptions, default_devices, render, run_matrix};

/// One check of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Check {
    V4Parity,
    KvcContract,
    PatchingTable,
    Training,
    Checkpoint,
}

impl Check {
    /// Every check, in the order of the matrix.
    pub const ALL: [Check; 5] = [
        Check::V4Parity,
        Check::KvcContract,
        Check::PatchingTable,
        Check::Training,
        Check::Checkpoint,
    ];

    /// The name on the command line and in the printed matrix.
    pub fn name(self) -> &'static str {
        match self {
            Check::V4Parity => "v4-parity",
            Check::KvcContract => "kvc-contract",
            Check::PatchingTable => "patching-table",
            Check::Training => "training",
            Check::Checkpoint => "checkpoint",
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Check {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Check::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Check::ALL.iter().map(|c| c.name()).collect();
                Error::Input(format!("unknown check `{s}`; checks: {}", names.join(", ")))
            })
    }
}

/// How a cell of the matrix came out.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Status {
    /// Within tolerance: the worst error and its tolerance.
    Ok { max_err: f64, tol: f64 },
    /// Outside tolerance: the worst error, its tolerance and where it was seen.
    Wrong {
        max_err: f64,
        tol: f64,
        detail: String,
    },
    /// The check could not run (the message says why).
    Error { message: String },
    /// This binary was built without the device's backend feature.
    NotBuilt { feature: String },
    /// Built, but the device does not work on this machine (no GPU, no Vulkan driver).
    Unavailable { message: String },
}

impl Status {
    /// Whether the cell is a failure of a device that this machine has: `WRONG` or
    /// `error` (not `not built` / `unavailable`).
    pub fn is_failure(&self) -> bool {
        matches!(self, Status::Wrong { .. } | Status::Error { .. })
    }

    /// Short text for the printed matrix.
    pub fn short(&self) -> String {
        match self {
            Status::Ok { max_err, .. } => format!("ok {max_err:.1e}"),
            Status::Wrong { max_err, tol, .. } => format!("WRONG {max_err:.1e} > {tol:.0e}"),
            Status::Error { .. } => "error".into(),
            Status::NotBuilt { .. } => "not built".into(),
            Status::Unavailable { .. } => "unavailable".into(),
        }
    }
}

/// One cell: a check on a device.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub device: String,
    pub check: Check,
    #[serde(flatten)]
    pub status: Status,
    pub seconds: f64,
}

impl From<Unusable> for Status {
    fn from(u: Unusable) -> Self {
        match u {
            Unusable::NotBuilt { feature } => Status::NotBuilt { feature },
            Unusable::Unavailable { message } => Status::Unavailable { message },
        }
    }
}
