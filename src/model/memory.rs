//! Upfront memory estimates: a model config, an evaluation set, a training step or a
//! forward input whose size would exhaust the machine is refused before anything is
//! allocated, with an error naming the key to change, instead of aborting on a failed
//! allocation halfway through.
//!
//! A leaf: the configs call it with their sizes (`KvcConfig::check_memory`,
//! `DeepseekV4Config::check_memory`), training with its own estimate
//! (train/memory.rs).
//!
//! The budget is `MemAvailable` of `/proc/meminfo` (unknown elsewhere: only the hard
//! ceiling applies). `PHASELENS_NO_MEMORY_CHECK=1` (or `--no-memory-check` on the
//! commands that take it) skips the comparison with the machine; sizes beyond
//! [`HARD_LIMIT_BYTES`] are refused always (no machine has them, and the size
//! arithmetic of the model code stays far from overflow).

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::model::ModelInfo;

/// Sizes beyond 16 TiB are refused even with the override.
pub const HARD_LIMIT_BYTES: f64 = (1u64 << 44) as f64;

/// The environment variable that skips the comparison with available memory.
pub const OVERRIDE_ENV: &str = "PHASELENS_NO_MEMORY_CHECK";

static OVERRIDE: AtomicBool = AtomicBool::new(false);

/// Skip the comparison with available memory for the rest of the process (what
/// `--no-memory-check` sets).
pub fn set_override(on: bool) {
    OVERRIDE.store(on, Ordering::Relaxed);
}

fn overridden() -> bool {
    OVERRIDE.load(Ordering::Relaxed)
        || std::env::var(OVERRIDE_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// `MemAvailable` in bytes, when the platform says.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Bytes in words: `37.3 GiB`.
pub fn human(bytes: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if !v.is_finite() {
        return "an unbounded amount".into();
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Refuse `bytes` (an estimate of what `what` needs) when it exceeds the machine's
/// available memory (unless overridden) or the hard ceiling. `keys` names the setting(s)
/// that make it large, e.g. "config.json num_hidden_layers = 1000000000".
pub fn check(what: &str, keys: &str, bytes: f64) -> Result<()> {
    if !bytes.is_finite() || bytes > HARD_LIMIT_BYTES {
        return Err(Error::Memory(format!(
            "{what} would need about {}, more than any machine has ({} ceiling): lower {keys}",
            human(bytes),
            human(HARD_LIMIT_BYTES)
        )));
    }
    if overridden() {
        return Ok(());
    }
    if let Some(avail) = available_bytes()
        && bytes > avail as f64
    {
        return Err(Error::Memory(format!(
            "{what} would need about {} but this machine has {} available (MemAvailable): \
             lower {keys}, or set {OVERRIDE_ENV}=1 (--no-memory-check) to try anyway",
            human(bytes),
            human(avail as f64)
        )));
    }
    Ok(())
}

/// Bytes of the activations of one forward over `rows x len` tokens on a model like
/// `info` (blocked attention: linear in the length): the logits, a dozen residual-sized
/// tensors per token alive at once, and the per-layer keys and values.
pub fn forward_bytes(info: &ModelInfo, rows: usize, len: usize) -> f64 {
    let tokens = rows as f64 * len as f64;
    let kv: f64 = info
        .layers
        .iter()
        .map(|l| 2.0 * l.n_kv_heads as f64 * info.d_head as f64)
        .sum();
    tokens * 4.0 * (info.vocab_size as f64 + 12.0 * info.d_model as f64 + kv)
}

/// Refuse a forward over `rows x len` tokens that cannot fit; `keys` names its source.
pub fn check_forward(info: &ModelInfo, rows: usize, len: usize, keys: &str) -> Result<()> {
    check(
        &format!("a forward over {rows} x {len} tokens"),
        keys,
        forward_bytes(info, rows, len),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_sizes_are_refused_even_with_the_override_and_name_the_keys() {
        let e = check("the model's weights", "config n_layers = 1000000000", 1e18)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("n_layers = 1000000000") && e.contains("ceiling"),
            "{e}"
        );
        assert_eq!(human(1536.0), "1.5 KiB");
    }
}
