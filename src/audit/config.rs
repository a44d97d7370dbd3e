//! The audit's settings: gates, budget and knobs, from an optional TOML file
//! (`--config AUDIT.toml`, every key documented in docs/audit.md) with command-line
//! flags on top.
//!
//! ```toml
//! [gates]
//! max_gap = "5pp"          # fail when the phase gap exceeds 5 percentage points
//! min_worst_phase = 0.5    # fail when the worst phase's accuracy is below 50 %
//! gate_on = "estimate"     # or "upper" (certify: CI upper bound) / "lower" (evidence)
//! [budget]
//! prompts = 6000
//! time = "5m"
//! [audit]
//! ci_width = "30pp"
//! [task]                   # passed to the runner's [task] (vocab, prompt format)
//! vocab = { kind = "synthetic" }
//! ```

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Error, Result};

/// Which statistic of the phase gap (and worst-phase accuracy) a gate compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateOn {
    /// The point estimates (default).
    #[default]
    Estimate,
    /// The pessimistic CI bound: the gap's upper and the worst phase's lower bound
    /// (passes only what the data certify).
    Upper,
    /// The optimistic CI bound: the gap's lower and the worst phase's upper bound
    /// (fails only on evidence).
    Lower,
}

impl GateOn {
    /// The snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            GateOn::Estimate => "estimate",
            GateOn::Upper => "upper",
            GateOn::Lower => "lower",
        }
    }
}

/// Parse a percentage-point amount: `5pp`, `5 pp`, `5` (all 5 pp) or `0.05` is NOT
/// accepted as 5 pp (ambiguous): plain numbers are percentage points.
pub fn parse_pp(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let num = t.strip_suffix("pp").unwrap_or(t).trim();
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not an amount in percentage points (e.g. 5pp)"))?;
    if !(0.0..=100.0).contains(&v) {
        return Err(format!("`{s}`: percentage points must be in 0..=100"));
    }
    Ok(v)
}

/// Parse an accuracy: `0.5`, `50%` (both one half).
pub fn parse_fraction(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let (num, scale) = match t.strip_suffix('%') {
        Some(n) => (n.trim(), 100.0),
        None => (t, 1.0),
    };
    let v: f64 = num
        .parse::<f64>()
        .map_err(|_| format!("`{s}` is not an accuracy (e.g. 0.5 or 50%)"))?
        / scale;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!("`{s}`: an accuracy is in 0..=1 (or 0%..=100%)"));
    }
    Ok(v)
}

/// Parse a duration: `300`, `300s`, `5m`, `1h`.
pub fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (e.g. 300, 300s, 5m, 1h)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("`{s}`: a duration must be positive"));
    }
    Ok(v * scale)
}

/// A number or a string parsed by `f`.
fn num_or_text<'de, D: Deserializer<'de>>(
    d: D,
    f: fn(&str) -> std::result::Result<f64, String>,
) -> std::result::Result<Option<f64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum V {
        N(f64),
        I(i64),
        S(String),
    }
    match Option::<V>::deserialize(d)? {
        None => Ok(None),
        Some(V::N(x)) => f(&x.to_string())
            .map(Some)
            .map_err(serde::de::Error::custom),
        Some(V::I(x)) => f(&x.to_string())
            .map(Some)
            .map_err(serde::de::Error::custom),
        Some(V::S(s)) => f(&s).map(Some).map_err(serde::de::Error::custom),
    }
}

fn de_pp<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    num_or_text(d, parse_pp)
}
fn de_fraction<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    num_or_text(d, parse_fraction)
}
fn de_seconds<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<f64>, D::Error> {
    num_or_text(d, parse_seconds)
}

/// `[gates]`: what makes the audit fail (exit code 3). No gate: the audit reports
/// and exits 0.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Gates {
    /// Largest allowed phase gap (pp), per audited period and protocol.
    #[serde(deserialize_with = "de_pp")]
    pub max_gap: Option<f64>,
    /// Smallest allowed accuracy of the worst phase (fraction).
    #[serde(deserialize_with = "de_fraction")]
    pub min_worst_phase: Option<f64>,
    /// Which statistic the gates compare (default `estimate`).
    pub gate_on: GateOn,
}

/// `[budget]`: how much the audit may compute. The number of logical examples per
/// audited period is the largest that fits both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Budget {
    /// Most prompts (forward rows) in all. Default 6000.
    pub prompts: usize,
    /// Most seconds of compute, estimated from a timed forward before the audit.
    /// Default 240 (4 minutes).
    #[serde(deserialize_with = "de_seconds")]
    pub time: Option<f64>,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            prompts: 6000,
            time: Some(240.0),
        }
    }
}

/// `[audit]`: what is measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Most logical examples per audited period (each rendered at every phase).
    /// Default 256.
    pub max_logical: usize,
    /// Required full width of a phase-difference CI (pp, worst case p = 0.5): the
    /// budget must buy enough logical examples for it. Default 30 pp.
    #[serde(deserialize_with = "de_pp")]
    pub ci_width: Option<f64>,
    /// Cluster-bootstrap replicates. Default 1000.
    pub bootstrap_reps: usize,
    /// Permutation replicates of the flatness test. Default 2000.
    pub permutations: usize,
    /// Seed of prompts, bootstrap and permutations. Default 0.
    pub seed: u64,
    /// Period of the shift-invariance test of a model without compression, and an
    /// override of the audited periods of a compressed one. Default: the strides.
    pub period: Option<u32>,
    /// Largest period audited (a matched design needs 2 P^2 logical examples; larger
    /// strides are skipped with a note). Default 32.
    pub max_period: usize,
    /// Run the filler-length flip probe. Default true.
    pub filler: bool,
    /// Instances of the filler probe (each rendered at 2P lengths). Default 32.
    pub filler_instances: usize,
    /// Long-context prompt lengths (the runner's long-context haystacks: the needle at
    /// depths 0.1, 0.5, 0.9, every phase, every protocol). Default none.
    pub lengths: Vec<usize>,
    /// Logical examples per (length, depth) cell of the long-context test. Default 4.
    pub long_logical: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_logical: 256,
            ci_width: Some(30.0),
            bootstrap_reps: 1000,
            permutations: 2000,
            seed: 0,
            period: None,
            max_period: 32,
            filler: true,
            filler_instances: 32,
            lengths: Vec::new(),
            long_logical: 4,
        }
    }
}

/// `[model]`: how the audited checkpoint is loaded.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSettings {
    /// A checkpoint's BF16 / FP8 / FP4 weights: `"stored"` (resident as in the
    /// checkpoint, dequantised where used; the default) or `"f32"` (dequantised on
    /// load). `--weights` overrides it.
    pub weights: crate::model::stored::Residency,
    /// A training-free compression overlay applied when the model is loaded
    /// (`compression = { kind = "select", block = 8, top_k = 4, window = 32 }`, the
    /// keys of an experiment's `[model.compression]`); `--compression` overrides it.
    /// The audited phases follow its block grid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compression: Option<crate::model::compression::Overlay>,
}

/// An overlay's error as `[model] compression.KEY: what is wrong` (the flag
/// `--compression` sets the same keys).
pub fn overlay_message(e: &Error) -> String {
    match e {
        Error::ConfigField { field, message } if field.starts_with("compression") => {
            format!("[model] {field} (or --compression): {message}")
        }
        other => format!("[model] compression (or --compression): {other}"),
    }
}

/// The whole audit configuration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    /// `[gates]`: what makes the audit fail.
    pub gates: Gates,
    /// `[budget]`: how much it may compute.
    pub budget: Budget,
    /// `[audit]`: what is measured.
    pub audit: Settings,
    /// `[model]`: how the model is loaded.
    pub model: ModelSettings,
    /// The runner's `[task]` keys (vocab, prompt, seed, ...; docs/experiments.md),
    /// passed through; `period` and `n_logical` are set by the audit.
    pub task: Option<toml::Table>,
}

impl AuditConfig {
    /// Read an audit TOML; errors name the file, line and key.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let c: AuditConfig = crate::toml_file::parse_toml(path, &text)?;
        c.validate().map_err(|m| Error::Config {
            path: path.to_path_buf(),
            message: m,
        })?;
        Ok(c)
    }

    /// Values that parse but cannot work.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let a = &self.audit;
        if a.max_logical == 0 {
            return Err("[audit] max_logical must be at least 1".into());
        }
        if a.bootstrap_reps < 100 {
            return Err("[audit] bootstrap_reps must be at least 100".into());
        }
        if a.permutations < 100 {
            return Err("[audit] permutations must be at least 100".into());
        }
        if a.period == Some(0) {
            return Err("[audit] period must be at least 1".into());
        }
        if a.max_period < 2 {
            return Err("[audit] max_period must be at least 2".into());
        }
        if a.filler && a.filler_instances == 0 {
            return Err("[audit] filler_instances must be at least 1 (or filler = false)".into());
        }
        if !a.lengths.is_empty() && a.long_logical == 0 {
            return Err("[audit] long_logical must be at least 1".into());
        }
        if let Some(&l) = a
            .lengths
            .iter()
            .find(|l| !(16..=crate::tasks::MAX_HAYSTACK_LEN).contains(*l))
        {
            return Err(format!(
                "[audit] lengths: {l} is outside 16..={}",
                crate::tasks::MAX_HAYSTACK_LEN
            ));
        }
        if let Some(o) = &self.model.compression {
            o.validate(None).map_err(|e| overlay_message(&e))?;
        }
        if self.budget.prompts == 0 {
            return Err("[budget] prompts must be at least 1".into());
        }
        if let Some(t) = &self.task {
            for key in ["period", "n_logical", "protocol", "phases"] {
                if t.contains_key(key) {
                    return Err(format!(
                        "[task] {key} is set by the audit (use [audit] period / the budget)"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_parse_with_and_without_units() {
        assert_eq!(parse_pp("5pp").unwrap(), 5.0);
        assert_eq!(parse_pp(" 2.5 pp").unwrap(), 2.5);
        assert_eq!(parse_pp("7").unwrap(), 7.0);
        assert!(parse_pp("-1pp").is_err());
        assert!(parse_pp("five").is_err());
        assert_eq!(parse_fraction("50%").unwrap(), 0.5);
        assert_eq!(parse_fraction("0.25").unwrap(), 0.25);
        assert!(parse_fraction("1.5").is_err());
        assert_eq!(parse_seconds("5m").unwrap(), 300.0);
        assert_eq!(parse_seconds("90s").unwrap(), 90.0);
        assert_eq!(parse_seconds("2").unwrap(), 2.0);
        assert!(parse_seconds("0").is_err());
    }

    #[test]
    fn toml_gates_and_budget_read_units_and_name_bad_keys() {
        let p = Path::new("audit.toml");
        let c: AuditConfig = crate::toml_file::parse_toml(
            p,
            "[gates]\nmax_gap = \"5pp\"\nmin_worst_phase = \"40%\"\n[budget]\ntime = \"2m\"\nprompts = 100\n",
        )
        .unwrap();
        assert_eq!(c.gates.max_gap, Some(5.0));
        assert_eq!(c.gates.min_worst_phase, Some(0.4));
        assert_eq!(c.budget.time, Some(120.0));
        assert_eq!(c.budget.prompts, 100);
        let e = crate::toml_file::parse_toml::<AuditConfig>(p, "[gates]\nmax_gapp = 5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_gapp") && e.contains("line 2"), "{e}");
        let c: AuditConfig = crate::toml_file::parse_toml(p, "[task]\nperiod = 4\n").unwrap();
        assert!(c.validate().unwrap_err().contains("[task] period"));
    }
}
