//! One design, start to finish: write its recipe, train it (`phaselens train`'s code
//! path, resuming from its checkpoints), then run its phase sweeps (`phase-sweep`
//! experiments through [`crate::runner::run_experiment`]). Every step is skipped when
//! its output is already there and was made from the same recipe and settings, so a
//! killed task simply runs again.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::device::DeviceSpec;
use crate::error::{Error, Result};
use crate::output::write_bytes_atomic;
use crate::runner::{ProgressMode, RunOptions, run_experiment};
use crate::tasks::{KvPromptConfig, Protocol, QuerySampling};
use crate::train::{OrganismFile, TrainOptions, config_hash, train};

use super::spec::{Design, Grid};

/// Where a grid's outputs go and how its tasks run.
#[derive(Debug, Clone)]
pub struct GridOptions {
    /// Sweep tables go to `<data_root>/grids/<grid>/`. Default `notebooks-data`.
    pub data_root: PathBuf,
    /// The merged figures and report go to `<reports_root>/grids/<grid>/`. Default `reports`.
    pub reports_root: PathBuf,
    /// Device of training and sweeps.
    pub device: DeviceSpec,
    /// Progress: bars on a terminal (`Auto`), one line per checkpoint / chunk
    /// (`Plain`, logs and Slurm), or nothing (`Hidden`).
    pub progress: ProgressMode,
    /// Ignore checkpoints and finished sweeps (retrain and re-evaluate).
    pub fresh: bool,
}

impl Default for GridOptions {
    fn default() -> Self {
        GridOptions {
            data_root: PathBuf::from("notebooks-data"),
            reports_root: PathBuf::from("reports"),
            device: DeviceSpec::Cpu,
            progress: ProgressMode::Auto,
            fresh: false,
        }
    }
}

impl GridOptions {
    /// `<data_root>/grids/<grid>`: the sweeps, the merged tables.
    pub fn data_dir(&self, grid: &Grid) -> PathBuf {
        self.data_root.join("grids").join(&grid.name)
    }

    /// `<reports_root>/grids/<grid>`: figures and report.
    pub fn report_dir(&self, grid: &Grid) -> PathBuf {
        self.reports_root.join("grids").join(&grid.name)
    }

    /// A design's sweep folder.
    pub fn design_data_dir(&self, grid: &Grid, d: &Design) -> PathBuf {
        self.data_dir(grid).join(&d.name)
    }
}

/// What an evaluation of a design measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvalKind {
    /// The paper's single final query (the headline), every protocol.
    Final,
    /// The final query at slot k (k - 1 queries before it, asking distinct other
    /// bindings).
    Slot,
    /// A single final query with N bindings.
    Bindings,
}

impl EvalKind {
    /// The name used in the `eval` column.
    pub fn name(self) -> &'static str {
        match self {
            EvalKind::Final => "final",
            EvalKind::Slot => "slot",
            EvalKind::Bindings => "bindings",
        }
    }
}

/// One phase sweep of a design.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSpec {
    /// Experiment name (`final`, `slot-16`, `bindings-32`): its folder.
    pub name: String,
    pub kind: EvalKind,
    pub n_bindings: usize,
    pub n_queries: usize,
    pub protocols: Vec<Protocol>,
    pub n_logical: usize,
}

/// The sweeps of `d`: the final query, then each other slot, then each other count
/// of bindings (slot 1 and the design's own count are the final sweep).
pub fn eval_specs(grid: &Grid, file: &OrganismFile) -> Vec<EvalSpec> {
    let e = &grid.eval;
    let n = file.task.train.prompt.n_bindings;
    let mut out = vec![EvalSpec {
        name: "final".into(),
        kind: EvalKind::Final,
        n_bindings: n,
        n_queries: 1,
        protocols: e.protocols.clone(),
        n_logical: e.n_logical,
    }];
    for k in e.slots_for(n).into_iter().filter(|&k| k != 1) {
        out.push(EvalSpec {
            name: format!("slot-{k}"),
            kind: EvalKind::Slot,
            n_bindings: n,
            n_queries: k,
            protocols: vec![e.detail_protocol],
            n_logical: e.detail_n_logical,
        });
    }
    for &b in e.bindings.iter().filter(|&&b| b != n) {
        out.push(EvalSpec {
            name: format!("bindings-{b}"),
            kind: EvalKind::Bindings,
            n_bindings: b,
            n_queries: 1,
            protocols: vec![e.detail_protocol],
            n_logical: e.detail_n_logical,
        });
    }
    out
}

/// The `phase-sweep` experiment TOML of one sweep (it lives in `<design>/eval/`).
pub fn experiment_text(grid: &Grid, d: &Design, file: &OrganismFile, s: &EvalSpec) -> String {
    let mut prompt = KvPromptConfig {
        n_bindings: s.n_bindings,
        n_queries: s.n_queries,
        ..file.task.train.prompt.clone()
    };
    if s.kind == EvalKind::Slot {
        // The k - 1 queries before the target ask distinct bindings: the strongest
        // cue a model that eliminates already-asked bindings could use.
        prompt.query_sampling = QuerySampling::Distinct;
    }
    let mut exp = toml::Table::new();
    let mut section = toml::Table::new();
    section.insert("name".into(), s.name.clone().into());
    section.insert("kind".into(), "phase-sweep".into());
    section.insert(
        "description".into(),
        format!(
            "grid `{}`, design `{}`: {} (N = {}, query slot {})",
            grid.name,
            d.name,
            s.kind.name(),
            s.n_bindings,
            s.n_queries
        )
        .into(),
    );
    section.insert(
        "bootstrap_reps".into(),
        (grid.eval.bootstrap_reps as i64).into(),
    );
    exp.insert("experiment".into(), section.into());
    let mut model = toml::Table::new();
    model.insert("organism".into(), "../recipe.toml".into());
    model.insert("name".into(), d.name.clone().into());
    exp.insert("model".into(), model.into());
    let mut task = toml::Table::new();
    task.insert("n_logical".into(), (s.n_logical as i64).into());
    if let Some(seed) = grid.eval.seed {
        task.insert("seed".into(), (seed as i64).into());
    }
    task.insert(
        "prompt".into(),
        toml::Value::try_from(&prompt).expect("a prompt config serialises"),
    );
    exp.insert("task".into(), task.into());
    let mut sweep = toml::Table::new();
    sweep.insert(
        "protocols".into(),
        toml::Value::Array(s.protocols.iter().map(|p| p.name().into()).collect()),
    );
    sweep.insert("skip_untrained".into(), false.into());
    exp.insert("sweep".into(), sweep.into());
    format!(
        "# Generated by `phaselens grid` ({}); rerun with `phaselens run` from anywhere.\n\n{}",
        grid.path.display(),
        toml::to_string(&exp).expect("a TOML table serialises")
    )
}

/// Parse every sweep experiment of every design as `phaselens run` would (its
/// experiment-wide numbers and the phase-sweep settings), so an invalid `[eval]`
/// setting stops the grid before any design trains instead of after each one has.
pub fn check_sweeps(grid: &Grid) -> Result<()> {
    for d in &grid.designs {
        let file = d.organism(&grid.dir)?;
        for s in eval_specs(grid, &file) {
            let path = d
                .dir(&grid.dir)
                .join("eval")
                .join(format!("{}.toml", s.name));
            let text = experiment_text(grid, d, &file, &s);
            crate::runner::Experiment::parse(&path, text).map_err(|e| Error::Config {
                path: grid.path.clone(),
                message: format!(
                    "[eval] makes an invalid sweep `{}` for design `{}`: {e}",
                    s.name, d.name
                ),
            })?;
        }
    }
    Ok(())
}

/// `<data>/<design>/design.json`: written when a design is trained and swept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DesignRecord {
    /// The design's name.
    pub design: String,
    /// Its index in the grid (file order).
    pub index: usize,
    /// The recipe's config hash (as in its checkpoints).
    pub config_hash: String,
    /// Training steps done.
    pub steps: u64,
    /// The last logged training loss.
    pub final_loss: Option<f64>,
    /// Mean batch accuracy of the last 50 steps.
    pub final_batch_accuracy: Option<f64>,
    /// The sweeps, by name.
    pub evals: Vec<String>,
    /// The phaselens version that wrote it.
    pub phaselens_version: String,
}

/// `<sweep>/done.json`: which experiment text and which trained model it measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SweepDone {
    experiment_sha: String,
    config_hash: String,
}

fn sha(text: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(text.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Write `text` to `path` unless it already holds exactly that (atomic).
pub fn write_if_changed(path: &Path, text: &str) -> Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    write_bytes_atomic(path, text.as_bytes()).map_err(|e| Error::io(path, e))
}

/// Write every design's recipe (the same text `phaselens train` would read).
pub fn write_recipes(grid: &Grid) -> Result<()> {
    for d in &grid.designs {
        write_if_changed(&d.recipe_path(&grid.dir), &d.recipe_text(&grid.path))?;
    }
    Ok(())
}

/// The design's record, if it finished with its current recipe and sweeps.
pub fn finished(grid: &Grid, d: &Design, opts: &GridOptions) -> Option<DesignRecord> {
    let p = opts.design_data_dir(grid, d).join("design.json");
    let r: DesignRecord = serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()?;
    let file = d.organism(&grid.dir).ok()?;
    let evals: Vec<String> = eval_specs(grid, &file)
        .into_iter()
        .map(|s| s.name)
        .collect();
    (r.config_hash == config_hash(&file) && r.evals == evals).then_some(r)
}

/// Whether the model directory holds the finished training of this recipe.
fn trained(model_dir: &Path, hash: &str, steps: u64) -> bool {
    let Ok(text) = std::fs::read_to_string(model_dir.join("training.json")) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    v["config_hash"].as_str() == Some(hash)
        && v["steps"].as_u64() == Some(steps)
        && model_dir.join("model.safetensors").exists()
}

/// Train and sweep one design (skipping what is already done). Messages go to stderr.
pub fn run_design(grid: &Grid, d: &Design, opts: &GridOptions) -> Result<DesignRecord> {
    let recipe = d.recipe_path(&grid.dir);
    write_if_changed(&recipe, &d.recipe_text(&grid.path))?;
    let file = OrganismFile::load(&recipe)?;
    let hash = config_hash(&file);
    let model_dir = file.model_dir(&recipe);
    train_design(d, &recipe, &file, &hash, opts)?;
    let data = opts.design_data_dir(grid, d);
    let specs = eval_specs(grid, &file);
    for s in &specs {
        sweep_design(grid, d, &file, &hash, s, &data, opts)?;
    }
    let (final_loss, final_batch_accuracy) = loss_tail(&model_dir.join("training/loss.arrow"));
    let record = DesignRecord {
        design: d.name.clone(),
        index: d.index,
        config_hash: hash,
        steps: file.train.steps,
        final_loss,
        final_batch_accuracy,
        evals: specs.into_iter().map(|s| s.name).collect(),
        phaselens_version: env!("CARGO_PKG_VERSION").into(),
    };
    write_json(&data.join("design.json"), &record)?;
    Ok(record)
}

/// Train a design's recipe unless its model directory already holds this training.
fn train_design(
    d: &Design,
    recipe: &Path,
    file: &OrganismFile,
    hash: &str,
    opts: &GridOptions,
) -> Result<()> {
    let model_dir = file.model_dir(recipe);
    let device = opts.device.device()?;
    if !opts.fresh && trained(&model_dir, hash, file.train.steps) {
        eprintln!("{}: trained ({})", d.name, model_dir.display());
        return Ok(());
    }
    let topts = TrainOptions {
        fresh: opts.fresh,
        max_steps: None,
        progress: opts.progress != ProgressMode::Hidden,
    };
    let s = train(recipe, file, &device, &topts)
        .map_err(|e| e.context(format!("design `{}`: training", d.name)))?;
    if let Some(from) = s.resumed_from {
        eprintln!("{}: resumed from step {from}", d.name);
    }
    Ok(())
}

/// Write one eval experiment of a design and run it, unless its `done.json` says this
/// experiment text already ran on this training.
fn sweep_design(
    grid: &Grid,
    d: &Design,
    file: &OrganismFile,
    hash: &str,
    s: &EvalSpec,
    data: &Path,
    opts: &GridOptions,
) -> Result<()> {
    let text = experiment_text(grid, d, file, s);
    let exp_path = d
        .dir(&grid.dir)
        .join("eval")
        .join(format!("{}.toml", s.name));
    write_if_changed(&exp_path, &text)?;
    let done_path = data.join(&s.name).join("done.json");
    let done = SweepDone {
        experiment_sha: sha(&text),
        config_hash: hash.to_string(),
    };
    let current = std::fs::read_to_string(&done_path)
        .ok()
        .and_then(|t| serde_json::from_str::<SweepDone>(&t).ok());
    if !opts.fresh && current.as_ref() == Some(&done) {
        return Ok(());
    }
    let ropts = RunOptions {
        data_root: data.to_path_buf(),
        reports_root: data.join("reports"),
        fresh: opts.fresh,
        device: Some(opts.device.clone()),
        devices: None,
        weights: None,
        dtype: None,
        shard: None,
        progress: opts.progress,
        figures: false,
    };
    run_experiment(&exp_path, &ropts)
        .map_err(|e| e.context(format!("design `{}`: sweep {}", d.name, s.name)))?;
    // The shards only serve to resume an interrupted sweep.
    let _ = std::fs::remove_dir_all(data.join(&s.name).join("shards"));
    write_json(&done_path, &done)
}

/// Pretty JSON, written atomically.
fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    write_bytes_atomic(
        path,
        serde_json::to_string_pretty(value)
            .expect("serialises")
            .as_bytes(),
    )
    .map_err(|e| Error::io(path, e))
}

/// Mean loss and batch accuracy over the last 50 steps of a `loss.arrow`.
fn loss_tail(path: &Path) -> (Option<f64>, Option<f64>) {
    let Ok(t) = crate::output::Table::read_arrow(path) else {
        return (None, None);
    };
    let mean = |c: &str| -> Option<f64> {
        let v: Vec<f64> = t
            .float64(c)
            .ok()?
            .iter()
            .rev()
            .take(50)
            .flatten()
            .copied()
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    (mean("loss"), mean("accuracy"))
}
