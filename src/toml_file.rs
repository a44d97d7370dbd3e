//! TOML configs: unknown keys and bad values are rejected with the file, line and key.

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// 1-based line of a byte offset.
pub fn line_of(text: &str, offset: usize) -> usize {
    line_col(text, offset).0
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.bytes().filter(|&b| b == b'\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[start..].chars().count() + 1)
}

/// Parse `text` (the contents of `path`) as `T`; errors read
/// `path:LINE: message` and name the offending key.
pub fn parse_toml<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    // Syntax first, so a malformed file is reported as a syntax error at its line and
    // column rather than as whatever key the typed pass happens to miss.
    if let Err(e) = text.parse::<toml::Table>() {
        let msg = e.message().trim().to_string();
        return Err(Error::Config {
            path: path.to_path_buf(),
            message: match e.span() {
                Some(s) => {
                    let (l, c) = line_col(text, s.start);
                    format!("line {l}, column {c}: TOML syntax error: {msg}")
                }
                None => format!("TOML syntax error: {msg}"),
            },
        });
    }
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

/// The three TOML files phaselens reads, told apart by their top-level section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// `[experiment]`: `phaselens run`.
    Experiment,
    /// `[organism]`: an organism recipe, `phaselens train`.
    Recipe,
    /// `[grid]`: `phaselens grid`.
    Grid,
}

impl FileKind {
    fn section(self) -> &'static str {
        match self {
            FileKind::Experiment => "experiment",
            FileKind::Recipe => "organism",
            FileKind::Grid => "grid",
        }
    }

    fn words(self) -> &'static str {
        match self {
            FileKind::Experiment => "an experiment file",
            FileKind::Recipe => "an organism recipe",
            FileKind::Grid => "a grid file",
        }
    }

    fn command(self) -> &'static str {
        match self {
            FileKind::Experiment => "phaselens run",
            FileKind::Recipe => "phaselens train",
            FileKind::Grid => "phaselens grid",
        }
    }
}

/// When `text` lacks `expected`'s section but has another kind's, the error saying
/// what the file is and what was expected ("this is an experiment file, expected an
/// organism recipe"), instead of a message about a missing field. `Ok` otherwise
/// (syntax errors and the rest are left to the typed parse).
pub fn expect_kind(path: &Path, text: &str, expected: FileKind) -> Result<()> {
    let Ok(table) = text.parse::<toml::Table>() else {
        return Ok(());
    };
    if table.contains_key(expected.section()) {
        return Ok(());
    }
    let found = [FileKind::Experiment, FileKind::Recipe, FileKind::Grid]
        .into_iter()
        .find(|k| table.contains_key(k.section()));
    match found {
        Some(found) => Err(Error::Config {
            path: path.to_path_buf(),
            message: format!(
                "this is {} (it has [{}]), expected {}; give it to `{} {}`",
                found.words(),
                found.section(),
                expected.words(),
                found.command(),
                path.display()
            ),
        }),
        None => Ok(()),
    }
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
    struct Inner {
        steps: usize,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        name: String,
        train: Inner,
    }

    #[test]
    fn a_valid_file_parses_into_its_fields() {
        let text = "name = \"x\"\n\n[train]\nsteps = 3\n";
        let d = parse_toml::<Doc>(Path::new("exp/a.toml"), text).unwrap();
        assert_eq!((d.name.as_str(), d.train.steps), ("x", 3));
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
    fn syntax_error_names_line_and_column() {
        let text = "name = \"x\"\n[train]\nsteps = = 3\n";
        let e = parse_toml::<Doc>(Path::new("a.toml"), text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a.toml") && e.contains("line 3, column") && e.contains("syntax"),
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
