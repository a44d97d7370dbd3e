//! `phaselens audit MODEL`: certify a checkpoint's phase sensitivity.
//!
//! ```text
//! MODEL --load + geometry--> periods (strides, their lcm) --task setup + checks-->
//!   plan (budget -> logical examples) --runner (eval sets, batched routine, shards,
//!   progress; the filler-probe kind)--> outcomes --analysis (bootstrap, gap, Wilson)
//!   + permutation test--> certificate (audit.json) + gates --> report + figures
//! ```
//!
//! | file | role (its public items are re-exported here) |
//! |---|---|
//! | `config` | gates, budget and knobs (TOML + flags) |
//! | `plan` | geometry, audited periods, the runner experiments, budget sizing |
//! | `measure` | one period: retrieval by phase (both protocols), shift invariance, filler probe |
//! | `stats` | permutation test of flatness, shift flips, sample size for a CI width |
//! | `certificate` | `audit.json` (schema in docs/audit.md), gates, verdict |
//! | `report` | report.md / report.html and figures |
//!
//! Exit codes (the CLI): [`EXIT_PASS`], [`EXIT_ERROR`], clap's 2 for usage errors,
//! [`EXIT_GATE_FAILED`].

mod certificate;
mod config;
mod measure;
mod plan;
mod report;
mod stats;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::device::DeviceSpec;
use crate::error::{Error, Result};
use crate::model::{load_model_as, residency_summary};
use crate::train::OrganismFile;

pub use crate::runner::ProgressMode;
#[doc(hidden)] // the CLI's default output folder name (`audit-<model>-<time>`)
pub use certificate::now_utc;
pub use certificate::{Certificate, GateResult, ModelSummary, SCHEMA, SCHEMA_VERSION, Verdict};
pub use config::{
    AuditConfig, Budget, GateOn, Gates, ModelSettings, Settings, parse_fraction, parse_pp,
    parse_seconds,
};
pub use measure::{
    EstStat, FillerResult, LengthResult, PartResult, PhaseStat, ProtocolResult, ResidueStat,
    ShiftResult,
};
pub use plan::{Geometry, LayerGeometry, Sizing, Skipped};
pub use stats::Flatness;

/// Every gate passed (or none was set).
pub const EXIT_PASS: i32 = 0;
/// The audit could not run (bad input, a model that does not load, ...).
pub const EXIT_ERROR: i32 = 1;
/// The audit ran and a gate failed.
pub const EXIT_GATE_FAILED: i32 = 3;

/// The audited model: its directory and, for an organism, its recipe.
#[derive(Debug, Clone)]
pub struct Target {
    /// The name the certificate and report use.
    pub name: String,
    /// The model folder.
    pub dir: PathBuf,
    /// The organism recipe (task settings), when there is one.
    pub organism: Option<PathBuf>,
}

/// The organism recipe beside a model directory (`organisms/kvc-w8s8.toml` for
/// `organisms/kvc-w8s8/`) when it names that directory.
fn sibling_recipe(dir: &Path) -> Option<PathBuf> {
    let name = dir.file_name()?;
    let recipe = dir.with_file_name(format!("{}.toml", name.to_string_lossy()));
    let file = OrganismFile::load(&recipe).ok()?;
    let same =
        std::fs::canonicalize(file.model_dir(&recipe)).ok()? == std::fs::canonicalize(dir).ok()?;
    same.then_some(recipe)
}

/// A folder name usable as a table's model name (letters, digits, `-`, `_`, `.`;
/// no leading `.`, no `..`).
fn plain_name(s: &str) -> String {
    let mut n: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    while n.contains("..") {
        n = n.replace("..", ".");
    }
    let n = n
        .trim_start_matches('.')
        .chars()
        .take(100)
        .collect::<String>();
    if n.is_empty() { "model".into() } else { n }
}

/// A pretrained checkpoint (a `.gguf` file, a folder holding one, a Hugging Face
/// folder; `models:NAME/FILE` names one in the model cache) as a target.
fn pretrained_target(model: &Path) -> Option<Target> {
    use crate::model::pretrained;
    let path = pretrained::expand_model_path(model);
    pretrained::detect(&path)?;
    let name = std::fs::canonicalize(&path)
        .ok()
        .and_then(|p| {
            let stem = if p.is_file() {
                p.file_stem()
            } else {
                p.file_name()
            };
            stem.map(|s| s.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "model".into());
    Some(Target {
        name: plain_name(&name),
        dir: path,
        organism: None,
    })
}

/// `MODEL`: a model directory (config.json + safetensors), a pretrained checkpoint
/// (a `.gguf` file or `models:NAME/FILE.gguf`, a Hugging Face folder), an organism
/// recipe, or a folder holding a recipe as `recipe.toml` (a grid design's folder).
pub fn resolve_target(model: &Path) -> Result<Target> {
    if let Some(t) = pretrained_target(model) {
        return Ok(t);
    }
    let is_toml = model.extension().is_some_and(|e| e == "toml");
    if is_toml {
        let file = OrganismFile::load(model)?;
        let dir = file.model_dir(model);
        if !dir.join("config.json").exists() {
            return Err(Error::Input(format!(
                "organism `{}` is not trained yet ({} has no config.json): run `phaselens train {}`",
                file.organism.name,
                dir.display(),
                model.display()
            )));
        }
        return Ok(Target {
            name: file.organism.name.clone(),
            dir,
            organism: Some(model.to_path_buf()),
        });
    }
    if !model.exists() {
        return Err(Error::Input(format!(
            "{}: no such model folder, GGUF file or organism recipe",
            model.display()
        )));
    }
    if !model.join("config.json").exists() {
        // A grid design's folder (`experiments/grids/<grid>/<design>/`) or any folder
        // holding its recipe as `recipe.toml`: audit the model that recipe trains.
        let recipe = model.join("recipe.toml");
        if recipe.is_file() {
            return resolve_target(&recipe);
        }
        return Err(Error::Input(format!(
            "{} is not a model folder: it has no config.json (a model folder holds config.json and model.safetensors; give a model folder, a .gguf file, an organism recipe .toml, or a grid design's folder with its recipe.toml)",
            model.display()
        )));
    }
    let name = std::fs::canonicalize(model)
        .ok()
        .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    Ok(Target {
        name: plain_name(&name),
        organism: sibling_recipe(model),
        dir: model.to_path_buf(),
    })
}

/// The audited model, under the configured overlay when there is one; errors say
/// whether the model or the overlay is at fault.
fn load(
    target: &Target,
    device: &burn::tensor::Device,
    cfg: &AuditConfig,
) -> Result<Box<dyn crate::model::LanguageModel>> {
    let (dir, residency) = (&target.dir, cfg.model.weights);
    let overlay = cfg.model.compression.as_ref();
    load_model_as(dir, device, residency, overlay).map_err(|e| match overlay {
        Some(o) if is_overlay_error(&e) => Error::Input(format!(
            "the compression overlay {o} does not apply to {}: {}",
            dir.display(),
            config::overlay_message(&e)
        )),
        _ => Error::Input(format!(
            "the model folder {} does not load: {e}",
            dir.display()
        )),
    })
}

/// Whether a load error is the overlay's (a `compression.*` key, or a model family
/// that takes no overlay) rather than the checkpoint's.
fn is_overlay_error(e: &Error) -> bool {
    match e {
        Error::ConfigField { field, .. } => field.starts_with("compression"),
        Error::Config { message, .. } => message.contains("compression overlay"),
        _ => false,
    }
}

/// One audit.
#[derive(Debug, Clone)]
pub struct AuditRequest {
    /// A model directory or an organism recipe.
    pub model: PathBuf,
    /// Output folder (created; an earlier audit of the same request there resumes).
    pub out: PathBuf,
    /// Gates, budget and knobs.
    pub config: AuditConfig,
    /// Where the model runs.
    pub device: DeviceSpec,
    /// How progress is shown ([`ProgressMode::Hidden`] for library calls).
    pub progress: ProgressMode,
    /// Recompute (ignore finished shards).
    pub fresh: bool,
}

/// What the audit wrote and concluded.
#[derive(Debug, Clone)]
pub struct AuditOutcome {
    /// The certificate (also written as `audit.json`).
    pub certificate: Certificate,
    /// `OUT/audit.json`.
    pub json: PathBuf,
    /// `OUT/report.md` (and `.html`).
    pub report: PathBuf,
    /// What the CLI exits with ([`EXIT_PASS`] or [`EXIT_GATE_FAILED`]).
    pub exit_code: i32,
}

/// The resumable plan: kept in `OUT/plan.json`, reused when the same request runs
/// again into the same folder (so a time budget's sizing cannot change the settings
/// of an interrupted audit's shards).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct SavedPlan {
    request: serde_json::Value,
    parts: Vec<plan::Part>,
    sizing: plan::Sizing,
}

/// The request fields that determine the measurements (gates do not).
fn request_key(req: &AuditRequest, target: &Target) -> serde_json::Value {
    let dir = std::fs::canonicalize(&target.dir).unwrap_or_else(|_| target.dir.clone());
    serde_json::json!({
        "model": dir,
        "budget": req.config.budget,
        "audit": req.config.audit,
        "task": req.config.task,
        "compression": req.config.model.compression,
        "device": req.device.to_string(),
    })
}

fn load_saved(out: &Path, key: &serde_json::Value, fresh: bool) -> Result<Option<SavedPlan>> {
    let path = out.join("plan.json");
    if fresh || !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let saved: SavedPlan = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: path.clone(),
        message: format!("not an audit plan: {e}"),
    })?;
    if &saved.request != key {
        return Err(Error::Input(format!(
            "{} holds an audit with other settings or of another model; use another --out, or --fresh to replace it",
            out.display()
        )));
    }
    Ok(Some(saved))
}

/// Run the audit described by `req`: plan (every check before compute), measure,
/// write the certificate, report and figures, evaluate the gates.
pub fn run_audit(req: &AuditRequest) -> Result<AuditOutcome> {
    let t0 = Instant::now();
    req.config.validate().map_err(Error::Input)?;
    let target = resolve_target(&req.model)?;
    let device = req.device.device()?;
    let residency = req.config.model.weights;
    let model = load(&target, &device, &req.config)?;
    if req.progress != ProgressMode::Hidden {
        eprintln!(
            "{}: {}",
            target.dir.display(),
            residency_summary(model.as_ref(), residency)
        );
    }
    let info = model.info();
    std::fs::create_dir_all(&req.out).map_err(|e| Error::io(&req.out, e))?;
    let _lock = crate::output::lock::RunLock::acquire(&req.out.join(".lock"), "audit")?;
    crate::output::clean_stale_temps(&req.out, 2).map_err(|e| Error::io(&req.out, e))?;
    let env = measure::Env {
        target: &target,
        model: model.as_ref(),
        info: &info,
        cfg: &req.config,
        out: &req.out,
        device: device.clone(),
        device_spec: req.device.clone(),
        progress: req.progress,
        fresh: req.fresh,
    };
    let geometry = plan::Geometry::of(&info);
    let key = request_key(req, &target);
    let (parts, sizing, skipped) = make_plan(&env, &geometry, &key)?;
    let mut results = Vec::new();
    for part in &parts {
        results.push(measure::measure(&env, part)?);
    }
    let cert = Certificate::new(certificate::Inputs {
        target: &target,
        info: &info,
        geometry,
        skipped,
        sizing,
        cfg: &req.config,
        parts: results,
        seconds: t0.elapsed().as_secs_f64(),
    });
    let json = req.out.join("audit.json");
    cert.write(&json)?;
    let report = report::write(&cert, &req.out)?;
    let exit_code = match cert.verdict {
        Verdict::Fail => EXIT_GATE_FAILED,
        _ => EXIT_PASS,
    };
    Ok(AuditOutcome {
        certificate: cert,
        json,
        report,
        exit_code,
    })
}

/// The parts, their sizes and the strides left out: from `OUT/plan.json` when the
/// same request ran there before, else planned, checked and saved.
fn make_plan(
    env: &measure::Env,
    geometry: &plan::Geometry,
    key: &serde_json::Value,
) -> Result<(Vec<plan::Part>, plan::Sizing, Vec<plan::Skipped>)> {
    // A probe of the task setup: the prompt format and token space, checked.
    let probe = plan::Part {
        name: "probe".into(),
        period: 1,
        phased: false,
        why: "prompt format".into(),
        protocols: vec![crate::tasks::Protocol::PrefixPadding],
        filler: false,
        n_logical: 2,
        offset: 0,
    };
    let exp = env.experiment(&probe, "phase-sweep", 2)?;
    let (_, task) = measure::resolve(env, &exp)?;
    if let Some(t) = &task.text {
        return Err(Error::Input(format!(
            "[task] kind = \"{}\": the audit measures the key-value retrieval prompt (its single final query, both padding protocols); \
             drop [task] kind and [task.text] and give the model's tokenizer in [task] vocab (docs/audit.md, \"Compression overlays\")",
            t.task.name()
        )));
    }
    let prompt_len = task.prompt.unpadded_len(&task.space);
    if let Some(o) = &env.cfg.model.compression {
        plan::check_overlay(o, prompt_len)?;
    }
    let (mut parts, skipped) = plan::parts(geometry, env.cfg, prompt_len);
    if let Some(saved) = load_saved(env.out, key, env.fresh)? {
        return Ok((saved.parts, saved.sizing, skipped));
    }
    // Every part's prompts against the model (vocabulary, positions, memory).
    for part in &parts {
        let exp = env.experiment(part, "phase-sweep", 2)?;
        let (mref, task) = measure::resolve(env, &exp)?;
        let len = prompt_len + 2 * part.period;
        // A phase sweep runs its prompts `max_rows` at a time.
        let size = crate::runner::setup::ForwardSize {
            prompt_len: len,
            rows: exp.max_rows(&crate::device::DeviceSpec::Cpu).max(1),
        };
        crate::runner::setup::check(&exp, &mref, env.info, &task, size)?;
    }
    let spp = plan::calibrate(env.model, task.space.pad(), prompt_len + 8, 32)?;
    let sizing = plan::size(&mut parts, env.cfg, spp, prompt_len)?;
    let saved = SavedPlan {
        request: key.clone(),
        parts: parts.clone(),
        sizing: sizing.clone(),
    };
    let path = env.out.join("plan.json");
    let text = serde_json::to_string_pretty(&saved)
        .map_err(|e| Error::Other(format!("audit plan: {e}")))?;
    crate::output::write_bytes_atomic(&path, text.as_bytes()).map_err(|e| Error::io(&path, e))?;
    Ok((parts, sizing, skipped))
}
