//! The two pretrained models the suite checks against (SmolLM2-135M-Instruct Q4_1 and
//! Gemma 3 270M Q4_K_M, GGUF), from the cache `scripts/fetch-models.sh` fills (outside
//! the repository; `phaselens::model::pretrained::models_dir`). CI runs the fetch in
//! set-up, so there a missing file fails the test; elsewhere the test says so and passes
//! without checking.

use std::path::PathBuf;

/// SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture).
pub const SMOLLM2: &str = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Gemma 3 270M base, GGUF Q4_K_M.
pub const GEMMA3: &str = "gemma3-270m/gemma-3-270m-q4_k_m.gguf";

/// The models' cache folder (the library's rule: `PHASELENS_MODELS`, XDG, home).
pub fn models_dir() -> PathBuf {
    phaselens::model::pretrained::models_dir()
}

/// The file `rel` (e.g. [`SMOLLM2`]) of the cache, or `None` (after saying so on stderr)
/// when it is not there outside CI. Under CI (`CI` set) a missing file panics: set-up
/// fetched it, so its absence is a failure, not a skip.
pub fn model_file(rel: &str) -> Option<PathBuf> {
    let p = models_dir().join(rel);
    if p.is_file() {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "{} is missing: scripts/fetch-models.sh (run by scripts/setup.sh) puts it there",
            p.display()
        );
    }
    eprintln!(
        "skipped: {} is not in the cache (bash scripts/fetch-models.sh fetches it)",
        p.display()
    );
    None
}
