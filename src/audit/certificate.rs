//! The certificate `audit.json` (schema `phaselens.audit` version 2, documented field
//! by field in docs/audit.md), its gates and verdict.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::ModelInfo;

use super::Target;
use super::config::{AuditConfig, GateOn};
use super::measure::{PartResult, ProtocolResult};
use super::plan::{Geometry, Sizing, Skipped};

/// Schema name in `audit.json`.
pub const SCHEMA: &str = "phaselens.audit";
/// Schema version; bumped on any change a reader must know about (docs/audit.md).
pub const SCHEMA_VERSION: u32 = 2;

/// The audit's conclusion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every gate passed.
    Pass,
    /// At least one gate failed (exit code 3).
    Fail,
    /// No gate was set: a measurement, not a certification (exit code 0).
    NoGates,
}

/// One gate checked on one period and protocol.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GateResult {
    /// `max_gap` or `min_worst_phase`.
    pub gate: String,
    /// The part (`period-8`, `shift-8`).
    pub part: String,
    /// The padding protocol (`prefix_padding` or `in_sequence_padding`).
    pub protocol: String,
    /// The statistic compared (`gap_pp`, `gap_ci95_hi`, `worst_accuracy`, ...).
    pub statistic: String,
    /// The statistic's value (pp for a gap, a fraction for an accuracy).
    pub value: f64,
    /// The gate's threshold, in the same unit.
    pub threshold: f64,
    /// Whether the gate passed.
    pub pass: bool,
}

/// The model audited.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelSummary {
    /// The model's name (its folder or recipe name).
    pub name: String,
    /// The model folder.
    pub path: String,
    /// The organism recipe beside the folder, if any.
    pub organism_recipe: Option<String>,
    /// The architecture (`kvc`, `deepseek_v4`).
    pub arch: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Number of layers.
    pub n_layers: usize,
    /// The compression overlay the model ran under (`null`: none).
    pub compression: Option<crate::model::compression::Overlay>,
}

/// `audit.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Certificate {
    /// `phaselens.audit` ([`SCHEMA`]).
    pub schema: &'static str,
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The phaselens version that wrote it.
    pub phaselens_version: &'static str,
    /// UTC time the certificate was written (ISO 8601).
    pub created_utc: String,
    /// The model audited.
    pub model: ModelSummary,
    /// Its compression geometry.
    pub geometry: Geometry,
    /// Strides not audited, with the reason.
    pub skipped_strides: Vec<Skipped>,
    /// The settings the measurements used (budget, knobs, task overrides).
    pub settings: serde_json::Value,
    /// What the budget bought.
    pub sizing: Sizing,
    /// One entry per audited period.
    pub parts: Vec<PartResult>,
    /// Every gate checked, per part and protocol.
    pub gates: Vec<GateResult>,
    /// The conclusion.
    pub verdict: Verdict,
    /// The process exit code the CLI returns for this certificate.
    pub exit_code: i32,
    /// One-line summary of the headline (the first part, prefix padding).
    pub headline: String,
    /// Wall time of the audit (s).
    pub seconds: f64,
    /// Forward passes computed (0 when fully resumed).
    pub forwards: u64,
}

/// What [`Certificate::new`] needs.
pub struct Inputs<'a> {
    pub target: &'a Target,
    pub info: &'a ModelInfo,
    pub geometry: Geometry,
    pub skipped: Vec<Skipped>,
    pub sizing: Sizing,
    pub cfg: &'a AuditConfig,
    pub parts: Vec<PartResult>,
    pub seconds: f64,
}

/// The statistic a gate compares under `on`: (name, value).
fn gap_stat(p: &ProtocolResult, on: GateOn) -> (&'static str, f64) {
    match on {
        GateOn::Estimate => ("gap_pp", p.gap_pp),
        GateOn::Upper => ("gap_ci95_hi", p.gap_ci95[1]),
        GateOn::Lower => ("gap_ci95_lo", p.gap_ci95[0]),
    }
}

fn worst_stat(p: &ProtocolResult, on: GateOn) -> (&'static str, f64) {
    match on {
        GateOn::Estimate => ("worst_accuracy", p.worst_accuracy),
        GateOn::Upper => ("worst_ci95_lo", p.worst_ci95[0]),
        GateOn::Lower => ("worst_ci95_hi", p.worst_ci95[1]),
    }
}

/// Every gate on every part and protocol. A statistic that is not finite fails.
pub fn check_gates(cfg: &AuditConfig, parts: &[PartResult]) -> Vec<GateResult> {
    let g = &cfg.gates;
    let mut out = Vec::new();
    for part in parts {
        for p in &part.protocols {
            let mut push = |gate: &str, (stat, v): (&str, f64), thr: f64, pass: bool| {
                out.push(GateResult {
                    gate: gate.into(),
                    part: part.name.clone(),
                    protocol: p.protocol.clone(),
                    statistic: stat.into(),
                    value: v,
                    threshold: thr,
                    pass: v.is_finite() && pass,
                })
            };
            if let Some(max) = g.max_gap {
                let s = gap_stat(p, g.gate_on);
                push("max_gap", s, max, s.1 <= max + 1e-9);
            }
            if let Some(min) = g.min_worst_phase {
                let s = worst_stat(p, g.gate_on);
                push("min_worst_phase", s, min, s.1 >= min - 1e-12);
            }
        }
    }
    out
}

/// `2026-12-02T05:52:23Z` for a Unix time.
pub fn iso_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Now, as `iso_utc` writes it.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    iso_utc(secs)
}

/// The headline sentence: the first part's first protocol.
fn headline(parts: &[PartResult]) -> String {
    let Some(part) = parts.first() else {
        return "nothing audited".into();
    };
    let Some(p) = part.protocols.first() else {
        return "nothing audited".into();
    };
    let what = if part.phased { "phase" } else { "shift" };
    format!(
        "{} ({}): mean accuracy {:.1}%, worst {what} {} at {:.1}% [{:.1}, {:.1}], gap {:.1} pp [{:.1}, {:.1}] (selection-adjusted 95% CI), flatness p = {:.3}",
        part.name,
        p.protocol,
        100.0 * p.mean_accuracy,
        p.worst_phase,
        100.0 * p.worst_accuracy,
        100.0 * p.worst_ci95[0],
        100.0 * p.worst_ci95[1],
        p.gap_pp,
        p.gap_ci95[0],
        p.gap_ci95[1],
        p.flatness.p_value,
    )
}

impl Certificate {
    /// Assemble the certificate and evaluate the gates.
    pub(crate) fn new(i: Inputs) -> Self {
        let gates = check_gates(i.cfg, &i.parts);
        let verdict = if gates.is_empty() {
            Verdict::NoGates
        } else if gates.iter().all(|g| g.pass) {
            Verdict::Pass
        } else {
            Verdict::Fail
        };
        let forwards = i.parts.iter().map(|p| p.stats.forwards).sum();
        Certificate {
            schema: SCHEMA,
            schema_version: SCHEMA_VERSION,
            phaselens_version: env!("CARGO_PKG_VERSION"),
            created_utc: now_utc(),
            model: ModelSummary {
                name: i.target.name.clone(),
                path: i.target.dir.display().to_string(),
                organism_recipe: i.target.organism.as_ref().map(|p| p.display().to_string()),
                arch: i.info.arch.clone(),
                vocab_size: i.info.vocab_size,
                n_layers: i.info.n_layers(),
                compression: i.cfg.model.compression.clone(),
            },
            geometry: i.geometry,
            skipped_strides: i.skipped,
            settings: serde_json::json!({
                "gates": i.cfg.gates,
                "budget": i.cfg.budget,
                "audit": i.cfg.audit,
                "task": i.cfg.task,
                "model": i.cfg.model,
                "ci_level": crate::analysis::DEFAULT_LEVEL,
            }),
            sizing: i.sizing,
            headline: headline(&i.parts),
            parts: i.parts,
            gates,
            verdict,
            exit_code: match verdict {
                Verdict::Fail => super::EXIT_GATE_FAILED,
                _ => super::EXIT_PASS,
            },
            seconds: i.seconds,
            forwards,
        }
    }

    /// Write `audit.json` atomically (NaN written as null).
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Other(format!("audit certificate: {e}")))?;
        crate::output::write_bytes_atomic(path, format!("{text}\n").as_bytes())
            .map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_dates_match_known_instants() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso_utc(1_796_104_343), "2026-12-01T05:52:23Z");
    }
}
