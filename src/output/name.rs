//! Output folder names: what may name a folder under `notebooks-data/` and `reports/`.

use std::path::Path;

/// An output folder name (`[experiment] name`, the file stem, `[model] name`,
/// `phaselens figures --experiment`): one plain path component, so outputs stay under
/// `notebooks-data/` and `reports/`. Returns what is wrong.
pub fn check_output_name(name: &str) -> std::result::Result<(), String> {
    let bad = |why: &str| Err(format!("`{name}` cannot name an output folder: {why}"));
    if name.trim().is_empty() {
        return bad("it is empty");
    }
    if name.contains('/') || name.contains('\\') {
        return bad(
            "it holds a path separator (give a plain name; outputs go to notebooks-data/<name>/ and reports/<name>/)",
        );
    }
    if name.contains("..") || name.starts_with('.') {
        return bad("it starts with `.` or holds `..` (it would leave or hide in the output root)");
    }
    if Path::new(name).is_absolute() {
        return bad("it is an absolute path");
    }
    if name.chars().any(char::is_control) {
        return bad("it holds control characters");
    }
    if name.len() > 200 {
        return bad("it is longer than 200 bytes");
    }
    Ok(())
}
