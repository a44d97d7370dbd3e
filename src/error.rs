//! The library's error type. Every variant names what the user has to fix: the file,
//! the tensor, the config field or the hook point.

use std::path::PathBuf;

/// Errors raised by phaselens' library code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A config file (JSON or TOML) is malformed or has an invalid value.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    /// An invalid model configuration value.
    #[error("invalid model config: field `{field}`: {message}")]
    ConfigField { field: String, message: String },
    /// A checkpoint tensor is missing, mis-shaped, wrongly typed or unreadable.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    /// A checkpoint file is not a valid safetensors file.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    /// A hook point name or pattern is invalid, or an intervention does not fit its point.
    #[error("hook `{point}`: {message}")]
    Hook { point: String, message: String },
    /// Input data (token ids, prompts) is invalid.
    #[error("invalid input: {0}")]
    Input(String),
    /// A device was requested that this build cannot provide.
    #[error("device `{device}`: {message}")]
    Device { device: String, message: String },
    /// Anything else, with context.
    #[error("{0}")]
    Other(String),
}

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

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

    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::ConfigField {
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn hook(point: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Hook {
            point: point.into(),
            message: message.into(),
        }
    }
}
