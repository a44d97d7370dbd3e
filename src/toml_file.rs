//! TOML configs: unknown keys and bad values are rejected with the file, line and key.

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// 1-based line of a byte offset.
pub fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())]
        .bytes()
        .filter(|&b| b == b'\n')
        .count()
        + 1
}

/// Parse `text` (the contents of `path`) as `T`; errors read
/// `path:LINE: message` and name the offending key.
pub fn parse_toml<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    toml::from_str::<T>(text).map_err(|e| {
        let line = e.span().map(|s| line_of(text, s.start));
        let msg = e.message().trim().to_string();
        Error::Config {
            path: path.to_path_buf(),
            message: match line {
                Some(l) => format!("line {l}: {msg}"),
                None => msg,
            },
        }
    })
}

/// Read and parse a TOML file.
pub fn load_toml<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_toml(path, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        steps: usize,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Doc {
        name: String,
        train: Inner,
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let text = "name = \"x\"\n\n[train]\nsteps = 3\nstesp = 4\n";
        let e = parse_toml::<Doc>(Path::new("exp/a.toml"), text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("exp/a.toml") && e.contains("line 5") && e.contains("stesp"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_line() {
        let text = "name = \"x\"\n[train]\nsteps = \"many\"\n";
        let e = parse_toml::<Doc>(Path::new("a.toml"), text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3"), "{e}");
    }
}
