//! The library's one error type. Every variant names what the user has to fix: the file,
//! the tensor, the config field or the hook point. The errors of the sub-modules
//! (tables, figures, reports, statistics, task generators) convert into it with `?`
//! and keep their source chain; [`ResultExt::context_with`] (and [`Error::context`])
//! adds what was being done.

use std::path::PathBuf;

use crate::analysis::AnalysisError;
use crate::output::{FigureError, ReportError, TableError};
use crate::tasks::TaskError;

/// Errors raised by phaselens' library code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: std::io::Error,
    },
    /// A config file (JSON or TOML) is malformed or has an invalid value.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key.
        message: String,
    },
    /// An invalid model configuration value.
    #[error("invalid model config: field `{field}`: {message}")]
    ConfigField {
        /// The field.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A checkpoint tensor is missing, mis-shaped, wrongly typed or unreadable.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        /// The checkpoint file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        message: String,
    },
    /// A checkpoint file is not a valid safetensors file.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A hook point name or pattern is invalid, or an intervention does not fit its point.
    #[error("hook `{point}`: {message}")]
    Hook {
        /// The point or pattern as given.
        point: String,
        /// What is wrong.
        message: String,
    },
    /// Input data (token ids, prompts) is invalid.
    #[error("invalid input: {0}")]
    Input(String),
    /// A device was requested that this build cannot provide.
    #[error("device `{device}`: {message}")]
    Device {
        /// The device as given.
        device: String,
        /// Why it cannot be used.
        message: String,
    },
    /// A tensor could not be read back from the device.
    #[error("reading a tensor back from the device: {0}")]
    Readback(#[from] burn::tensor::TensorReadError),
    /// A table could not be built, written or read.
    #[error(transparent)]
    Table(#[from] TableError),
    /// A figure could not be drawn.
    #[error(transparent)]
    Figure(#[from] FigureError),
    /// A report could not be written.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// A statistic got invalid input.
    #[error(transparent)]
    Analysis(#[from] AnalysisError),
    /// A task (prompt) generator got an impossible config.
    #[error(transparent)]
    Task(#[from] TaskError),
    /// Another process holds the run's lock file.
    #[error(transparent)]
    Lock(#[from] crate::output::lock::LockError),
    /// A forward pass produced NaN or infinite values; the message names the first
    /// hook point (layer and sublayer) that went non-finite when a diagnostic forward
    /// could find it.
    #[error("non-finite values: {0}")]
    NonFinite(String),
    /// The memory a run would need exceeds what the machine has available.
    #[error("{0}")]
    Memory(String),
    /// An error with what was being done when it happened.
    #[error("{context}: {source}")]
    Context {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: Box<Error>,
    },
    /// A violated invariant or a condition without an underlying error, in words.
    #[error("{0}")]
    Other(String),
}

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// A problem with tensor `tensor` of the file `path`.
    pub fn tensor(
        path: impl Into<PathBuf>,
        tensor: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            tensor: tensor.into(),
            message: message.into(),
        }
    }

    /// A bad config value: `field` is its key.
    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::ConfigField {
            field: field.into(),
            message: message.into(),
        }
    }

    /// A problem at hook point `point`.
    pub fn hook(point: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Hook {
            point: point.into(),
            message: message.into(),
        }
    }

    /// Wrap `self` with what was being done (`"loading model organisms/x"`).
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

/// `.context(...)` on any result whose error converts into [`Error`]; the original
/// error stays the source.
pub trait ResultExt<T> {
    /// Wrap the error with `context()`, computed only on failure.
    fn context_with<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Into<Error>> ResultExt<T> for std::result::Result<T, E> {
    fn context_with<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| e.into().context(context()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn sub_errors_convert_and_keep_their_source() {
        let task = TaskError::config("n_bindings", "must be at least 1");
        let msg = task.to_string();
        let e: Error = Err::<(), _>(task).context_with(|| "[task]").unwrap_err();
        assert_eq!(e.to_string(), format!("[task]: {msg}"));
        let src = e.source().expect("the context keeps its source");
        assert_eq!(src.to_string(), msg);
        assert!(
            matches!(&e, Error::Context { source, .. } if matches!(**source, Error::Task(_))),
            "{e:?}"
        );
    }
}
