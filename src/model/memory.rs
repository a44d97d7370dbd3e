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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::model::ModelInfo;

/// Sizes beyond 16 TiB are refused even with the override.
pub const HARD_LIMIT_BYTES: f64 = (1u64 << 44) as f64;

/// The environment variable that skips the comparison with available memory.
pub const OVERRIDE_ENV: &str = "PHASELENS_NO_MEMORY_CHECK";

static OVERRIDE: AtomicBool = AtomicBool::new(false);

/// A cap on the bytes the checks allow, set by the library ([`set_budget`]); 0 = none.
static BUDGET: AtomicU64 = AtomicU64::new(0);

/// Cap the memory the checks allow for the rest of the process (`None`: no cap beyond
/// `MemAvailable` and [`BUDGET_ENV`]), e.g. the share of a machine a notebook may take.
pub fn set_budget(bytes: Option<f64>) {
    BUDGET.store(bytes.map_or(0, |b| b.max(1.0) as u64), Ordering::Relaxed);
}

/// Skip the comparison with available memory for the rest of the process (what
/// `--no-memory-check` sets).
pub fn set_override(on: bool) {
    OVERRIDE.store(on, Ordering::Relaxed);
}

fn overridden() -> bool {
    OVERRIDE.load(Ordering::Relaxed)
        || std::env::var(OVERRIDE_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The environment variable that caps the memory the checks allow (a size such as
/// `8GiB`): on a machine shared with other jobs, the share this run may take.
pub const BUDGET_ENV: &str = "PHASELENS_MEMORY_BUDGET";

/// `MemAvailable` in bytes, when the platform says.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// The bytes a check may allow and where that number comes from: the smallest of
/// `MemAvailable`, [`BUDGET_ENV`] and [`set_budget`]'s cap. A malformed budget is an
/// error naming it.
pub fn budget() -> Result<Option<(f64, String)>> {
    let mut limits: Vec<(f64, String)> = Vec::new();
    if let Some(b) = available_bytes() {
        limits.push((b as f64, "available (MemAvailable)".into()));
    }
    if let Ok(v) = std::env::var(BUDGET_ENV)
        && !v.trim().is_empty()
    {
        let b = parse_bytes(&v).map_err(|e| Error::Input(format!("{BUDGET_ENV}: {e}")))?;
        limits.push((b, format!("allowed by {BUDGET_ENV}={}", v.trim())));
    }
    let cap = BUDGET.load(Ordering::Relaxed);
    if cap > 0 {
        limits.push((
            cap as f64,
            "allowed by the library's memory budget (set_budget)".into(),
        ));
    }
    Ok(limits.into_iter().min_by(|a, b| a.0.total_cmp(&b.0)))
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
    if let Some((avail, source)) = budget()?
        && bytes > avail
    {
        return Err(Error::Memory(format!(
            "{what} would need about {} but this machine has {} {source}: \
             lower {keys}, or set {OVERRIDE_ENV}=1 (--no-memory-check) to try anyway",
            human(bytes),
            human(avail)
        )));
    }
    Ok(())
}

/// Parse `141GiB`, `80GB`, `1.5TiB`, `512MiB` or a plain byte count.
pub fn parse_bytes(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}`: expected a size like 141GiB, 80GB or 512MiB"))?;
    let k = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024f64,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        u => {
            return Err(format!(
                "`{s}`: unknown unit `{u}` (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ));
        }
    };
    if !(v * k).is_finite() || v <= 0.0 {
        return Err(format!("`{s}`: a size must be positive"));
    }
    Ok(v * k)
}

/// What a model's forward holds per token, in f32 values, for the estimates here: the
/// activations alive at once at the widest point of a layer, and what each layer keeps
/// per token (its keys and values in a plain forward; everything a suffix forward
/// reads back from a prefix state). A model gives its own
/// ([`crate::model::LanguageModel::memory_widths`]); [`Widths::from_info`] is the
/// generic one.
#[derive(Debug, Clone, PartialEq)]
pub struct Widths {
    /// Values per token alive at once inside the widest layer.
    pub layer: f64,
    /// Values per token each layer keeps (keys and values, or its prefix state), in
    /// layer order.
    pub state: Vec<f64>,
}

impl Widths {
    /// From the model's widths alone: a dozen residual-sized tensors per token inside a
    /// layer, and each layer's keys and values.
    pub fn from_info(info: &ModelInfo) -> Self {
        Widths {
            layer: 12.0 * info.d_model as f64,
            state: info
                .layers
                .iter()
                .map(|l| 2.0 * l.n_kv_heads as f64 * info.d_head as f64)
                .collect(),
        }
    }

    /// Values per token of every layer's state together.
    pub fn state_total(&self) -> f64 {
        self.state.iter().sum()
    }

    /// Values per token of the largest layer's state.
    pub fn state_max(&self) -> f64 {
        self.state.iter().copied().fold(0.0, f64::max)
    }
}

/// Bytes of the activations of one forward over `rows x len` tokens on a model like
/// `info` (blocked attention: linear in the length): a dozen residual-sized tensors per
/// token alive at once inside the layers, or at the end the streams leaving the last
/// layer, the final hidden state and the logits (the layers' activations are freed by
/// then, so the larger of the two counts), plus the per-layer keys and values.
pub fn forward_bytes(info: &ModelInfo, rows: usize, len: usize) -> f64 {
    forward_bytes_logits(info, rows, len, len)
}

/// [`forward_bytes`] when only `logit_len` positions per row go through the LM head
/// (e.g. 1: a prefill that reads the next-token logits).
pub fn forward_bytes_logits(info: &ModelInfo, rows: usize, len: usize, logit_len: usize) -> f64 {
    forward_bytes_with(info, &Widths::from_info(info), rows, len, logit_len)
}

/// [`forward_bytes_logits`] with the model's own [`Widths`]: the widest layer's
/// activations or the head's (the streams, the final hidden state and `logit_len`
/// positions of logits per row), whichever is larger, plus every layer's kept state.
pub fn forward_bytes_with(
    info: &ModelInfo,
    widths: &Widths,
    rows: usize,
    len: usize,
    logit_len: usize,
) -> f64 {
    let tokens = rows as f64 * len as f64;
    let d = info.d_model as f64;
    let layers = tokens * widths.layer;
    let head = tokens * info.streams.max(1) as f64 * d
        + rows as f64 * logit_len.min(len) as f64 * (info.vocab_size as f64 + d);
    4.0 * (layers.max(head) + tokens * widths.state_total())
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
