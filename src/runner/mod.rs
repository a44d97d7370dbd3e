//! The experiment runner: `phaselens run <experiment.toml>`.
//!
//! ```text
//! experiment TOML --config--> settings --setup--> model + prompts (+ checks)
//!   --kinds/<kind>--> cells --patching (one batched routine) + exec (resume, progress)-->
//!   outcomes --analysis + rows--> long rows --output--> tables
//!   --report + the kind's figures--> figures + report   (`phaselens figures` redraws from tables)
//! ```
//!
//! | file | role |
//! |---|---|
//! | [`experiment`] | the experiment TOML (every key documented in docs/experiments.md) |
//! | [`setup`] | organism / model directory, token space, prompt format, period; checks against the model |
//! | [`patching`] | THE batched intervention routine (and its one-forward-per-cell reference) |
//! | `exec`, `store`, [`progress`] | chunks with resume (atomic shard tables), progress with ETA |
//! | `rows` | statistics (from [`crate::analysis`]) -> long-format rows |
//! | `heads` | head cells, patching directions and head patch cells the patching kinds share |
//! | [`kinds`] | one file per experiment kind ([`Kind`]: settings, cells, rows, figures, report section) |
//! | [`report`] | the report frame and figure helpers, from the tables alone |
//! | [`bench`] | batched vs one-forward-per-cell throughput |
//! | [`grid_shift`] | the grid-shift test of two phase sweeps (`phaselens grid-shift`) |

pub mod bench;
pub(crate) mod concurrent;
pub(crate) mod exec;
pub mod experiment;
pub mod grid_shift;
pub(crate) mod heads;
pub mod kinds;
pub mod patching;
pub mod progress;
pub mod report;
pub(crate) mod rows;
pub mod setup;
pub(crate) mod store;
pub mod text_pairs;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::device::DeviceSpec;
use crate::error::{Result, ResultExt};
use crate::output::{LongRow, long_table, write_parquet_copy};

/// Moved to [`crate::tasks::prompts`]; this alias keeps code written before the move
/// compiling (remove it once nothing imports `runner::prompts`).
#[doc(hidden)]
pub use crate::tasks::prompts;
pub use exec::ExecStats;
pub use experiment::Experiment;
pub use kinds::{Kind, KindConfig};
pub use progress::ProgressMode;

/// Where outputs go and how the run behaves.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Tables go to `<data_root>/<experiment>/`. Default `notebooks-data`.
    pub data_root: PathBuf,
    /// Figures and the report go to `<reports_root>/<experiment>/`. Default `reports`.
    pub reports_root: PathBuf,
    /// Recompute everything (ignore and overwrite the shards of these settings).
    pub fresh: bool,
    /// Overrides `[model] device`.
    pub device: Option<DeviceSpec>,
    /// `--devices` (+ `--device-memory`): every model split over these devices
    /// (overrides `[model.placement]`; see `model::placement`).
    pub devices: Option<crate::model::placement::DevicesRequest>,
    /// `--weights stored|f32`: how BF16 / FP8 / FP4 checkpoint weights are held
    /// (overrides `[model] weights`; default stored).
    pub weights: Option<crate::model::stored::Residency>,
    /// `--dtype f32|bf16`: the compute dtype of the matrix products (overrides
    /// `[model] dtype`; default f32; [`crate::model::precision`]).
    pub dtype: Option<crate::model::ComputeDtype>,
    /// `--shard i/N`: compute only part `i` of `N` of the run's shards and write no
    /// tables; a run without it then loads every part's shards (the merge).
    pub shard: Option<(usize, usize)>,
    pub progress: ProgressMode,
    /// Draw the figures and the report after the run.
    pub figures: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            data_root: PathBuf::from("notebooks-data"),
            reports_root: PathBuf::from("reports"),
            fresh: false,
            device: None,
            devices: None,
            weights: None,
            dtype: None,
            shard: None,
            progress: ProgressMode::Auto,
            figures: true,
        }
    }
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub name: String,
    /// The kind's name.
    pub kind: &'static str,
    pub models: Vec<String>,
    /// `<data_root>/<experiment>`.
    pub data_dir: PathBuf,
    /// `<reports_root>/<experiment>`.
    pub report_dir: PathBuf,
    /// The long tables written (`.arrow`; each has a `.parquet` copy).
    pub tables: Vec<PathBuf>,
    /// Figure files (PNG and SVG).
    pub figures: Vec<PathBuf>,
    pub notes: Vec<String>,
    pub stats: ExecStats,
    pub seconds: f64,
}

/// Table metadata key: the experiment kind.
pub const META_KIND: &str = "phaselens.kind";
/// Table metadata key: notes (warnings of the checks, provenance of defaults), one per line.
pub const META_NOTES: &str = "phaselens.notes";

/// Write a long table `<dir>/<name>.arrow` (+ Parquet copy) with provenance.
pub fn write_long_table(
    dir: &Path,
    name: &str,
    rows: &[LongRow],
    exp: &Experiment,
    notes: &[String],
) -> Result<PathBuf> {
    let path = dir.join(format!("{name}.arrow"));
    let t = long_table(name, rows)
        .with_provenance(&exp.text)
        .with_metadata(META_KIND, exp.kind().name())
        .with_metadata(META_NOTES, notes.join("\n"));
    t.write_arrow(&path)?;
    write_parquet_copy(&path)?;
    Ok(path)
}

/// The settings that determine the computed outcomes (for the run hash).
fn settings_for_hash(exp: &Experiment, dtype: crate::model::ComputeDtype) -> serde_json::Value {
    let mut f = exp.file.clone();
    // The effective compute dtype, whether from the file or `--dtype`: bf16 results
    // never resume f32 shards. f32 leaves the key out (the hashes of runs before
    // `dtype` existed stay valid).
    f.model.dtype = (dtype != crate::model::ComputeDtype::F32).then_some(dtype);
    f.experiment.description.clear();
    f.experiment.bootstrap_reps = 0;
    f.experiment.seed = 0;
    f.experiment.name = None;
    serde_json::to_value(&f).expect("experiment settings serialise")
}

/// `--device`, else `[model] device`, else the CPU.
fn device_of(exp: &Experiment, opts: &RunOptions) -> Result<DeviceSpec> {
    Ok(match (&opts.device, &exp.file.model.device) {
        (Some(d), _) => d.clone(),
        (None, Some(s)) => s
            .parse::<DeviceSpec>()
            .map_err(|e| exp.err("model", "device", e))?,
        (None, None) => DeviceSpec::Cpu,
    })
}

/// `--dtype`, else `[model] dtype`, else f32; an error when a device of the run
/// (`--device` or every device of `--devices`) cannot compute in it.
fn compute_dtype_of(
    exp: &Experiment,
    opts: &RunOptions,
    spec: &DeviceSpec,
    device: &burn::tensor::Device,
) -> Result<crate::model::ComputeDtype> {
    let dtype = opts.dtype.or(exp.file.model.dtype).unwrap_or_default();
    let refuse = |m: String| match opts.dtype {
        Some(_) => crate::error::Error::Other(m),
        None => exp.err("model", "dtype", m),
    };
    match &opts.devices {
        Some(req) => {
            for d in &req.devices {
                dtype
                    .check_device(&d.device()?, &d.to_string())
                    .map_err(refuse)?;
            }
        }
        None => dtype
            .check_device(device, &spec.to_string())
            .map_err(refuse)?,
    }
    if dtype != crate::model::ComputeDtype::F32 {
        eprintln!(
            "note: compute dtype {dtype}: matrix products take {dtype} operands (f32 sums, {dtype} result); norms, softmax and the residual stream stay f32"
        );
    }
    Ok(dtype)
}

/// Add one model's notes (tagged with the model when there are several), counters and
/// rows (appended to the table of the same name) to the run's.
fn merge_model_output(
    notes: &mut Vec<String>,
    stats: &mut ExecStats,
    tables: &mut Vec<(String, Vec<LongRow>)>,
    tag: Option<&str>,
    ctx: &kinds::Ctx,
    out: kinds::KindOutput,
) {
    for n in &ctx.notes {
        let tagged = match tag {
            Some(m) => format!("{m}: {n}"),
            None => n.clone(),
        };
        if !notes.contains(&tagged) {
            notes.push(tagged);
        }
    }
    stats.add(&ctx.stats);
    for (t, rows) in out.tables {
        match tables.iter_mut().find(|(n, _)| *n == t) {
            Some((_, acc)) => acc.extend(rows),
            None => tables.push((t, rows)),
        }
    }
}

/// Take the experiment's run lock (one run of an experiment at a time), then remove
/// what killed writers of earlier runs left (temporary files of this program's atomic
/// writer only).
fn lock_and_clean(
    name: &str,
    data_dir: &Path,
    report_dir: &Path,
) -> Result<crate::output::lock::RunLock> {
    let lock = crate::output::lock::RunLock::acquire(
        &data_dir.join(".lock"),
        &format!("experiment `{name}`"),
    )?;
    for dir in [data_dir, report_dir] {
        crate::output::clean_stale_temps(dir, 2).map_err(|e| crate::error::Error::io(dir, e))?;
    }
    Ok(lock)
}

/// Open the shard store of the run's settings and models, with a note when shards of
/// other settings are kept beside it.
fn open_store(
    exp: &Experiment,
    models: &[setup::ModelRef],
    data_dir: &Path,
    fresh: bool,
    dtype: crate::model::ComputeDtype,
) -> Result<store::Store> {
    let dirs: Vec<&Path> = models.iter().map(|m| m.dir.as_path()).collect();
    let hash = store::run_hash(&settings_for_hash(exp, dtype), &dirs);
    // Shards live per settings hash and are never deleted by a run (store.rs): a run
    // whose settings a later check rejects cannot cost another run its finished work.
    let shard_root = data_dir.join("shards");
    let store = store::Store::open(&shard_root, &hash, fresh)?;
    let others = store::other_settings(&shard_root, &hash);
    if !others.is_empty() {
        let n: usize = others.iter().map(|(_, n)| n).sum();
        let n = format!(
            "kept {n} shard(s) of {} earlier run(s) with other settings or another model in {} (delete them by hand to free the space)",
            others.len(),
            shard_root.display()
        );
        eprintln!("note: {n}");
    }
    Ok(store)
}

/// The model at `dir` on `device`, or placed over `--devices` / `[model.placement]`.
fn load_for_run(
    exp: &Experiment,
    opts: &RunOptions,
    dir: &Path,
    device: &burn::tensor::Device,
) -> Result<Box<dyn crate::model::LanguageModel>> {
    use crate::model::placement::Placement;
    let residency = opts.weights.or(exp.file.model.weights).unwrap_or_default();
    if let Some(o) = &exp.file.model.compression {
        if opts.devices.is_some() || exp.file.model.placement.is_some() {
            return Err(exp.err(
                "model",
                "compression",
                "an overlay runs on one device (no --devices / [model.placement])",
            ));
        }
        return crate::model::load_model_overlaid(dir, device, residency, o)
            .map_err(|e| e.context(format!("{}: [model.compression]", exp.path.display())));
    }
    if let Some(req) = &opts.devices {
        let (m, p) = crate::model::load_model_split(
            dir,
            req.devices.clone(),
            req.memory.as_deref(),
            residency,
        )?;
        eprintln!("note: placement: {p}");
        return Ok(m);
    }
    match &exp.file.model.placement {
        Some(c) => {
            let origin = exp.path.display().to_string();
            let p = Placement::from_config(c, c.layers.len(), &origin)?;
            eprintln!("note: placement: {p}");
            crate::model::load_model_placed(dir, &p, residency)
        }
        None => crate::model::load_model_with(dir, device, residency),
    }
}

/// The lock of a run of experiment `name`: the whole run's (which also clears what an
/// interrupted run left), or, for part `i` of `n` run at once on other nodes, the
/// part's own, which leaves temporary files alone (their writers may live on another
/// machine).
fn run_lock(
    name: &str,
    data_dir: &Path,
    report_dir: &Path,
    shard: Option<(usize, usize)>,
) -> Result<crate::output::lock::RunLock> {
    match shard {
        Some((i, n)) => Ok(crate::output::lock::RunLock::acquire(
            &data_dir.join(format!(".lock-shard-{i}-of-{n}")),
            &format!("experiment `{name}` part {i}/{n}"),
        )?),
        None => lock_and_clean(name, data_dir, report_dir),
    }
}

/// Run the experiment at `path`.
pub fn run_experiment(path: &Path, opts: &RunOptions) -> Result<RunSummary> {
    let t0 = Instant::now();
    let exp = Experiment::load(path)?;
    let name = exp.name();
    let kind = exp.kind();
    let (models, mut notes) = setup::resolve_models(&exp)?;
    for n in &notes {
        eprintln!("note: {n}");
    }
    let device_spec = device_of(&exp, opts)?;
    let device = device_spec.device()?;
    let dtype = compute_dtype_of(&exp, opts, &device_spec, &device)?;
    // Every product of this run (on this thread) in that dtype.
    let _compute = crate::model::precision::scoped(dtype);
    let data_dir = opts.data_root.join(&name);
    let report_dir = opts.reports_root.join(&name);
    // Declared before the lock, so the lock file goes first and a refused run's
    // folders, still empty, go after it.
    let _new = crate::output::leftovers::NewDirs::note(&[data_dir.as_path(), report_dir.as_path()]);
    let _lock = run_lock(&name, &data_dir, &report_dir, opts.shard)?;
    let store = open_store(&exp, &models, &data_dir, opts.fresh, dtype)?.with_part(opts.shard);
    let mut tables: Vec<(String, Vec<LongRow>)> = Vec::new();
    let mut stats = ExecStats::default();
    for mref in &models {
        let model = load_for_run(&exp, opts, &mref.dir, &device)
            .context_with(|| format!("loading model {}", mref.dir.display()))?;
        let info = model.info();
        let task = setup::TaskSetup::resolve(&exp, mref, &info)?;
        let mut ctx = kinds::Ctx {
            exp: &exp,
            data_dir: &data_dir,
            opts,
            store: &store,
            model: model.as_ref(),
            info,
            mref,
            rows: rows::RowCtx {
                experiment: name.clone(),
                model: mref.name.clone(),
                kind: kind.name().to_string(),
            },
            notes: task.provenance.clone(),
            task,
            stats: ExecStats::default(),
            // a placed model's home device (where its inputs go)
            device: model.device(),
            max_rows: exp.max_rows(&device_spec),
        };
        let out = kind.run(&mut ctx)?;
        let tag = (models.len() > 1).then_some(mref.name.as_str());
        merge_model_output(&mut notes, &mut stats, &mut tables, tag, &ctx, out);
    }
    let (written, figures) = if store.partial() {
        // A part's tables would hold other parts' placeholders: none are written.
        (Vec::new(), Vec::new())
    } else {
        let written = tables
            .iter()
            .map(|(t, rows)| write_long_table(&data_dir, t, rows, &exp, &notes))
            .collect::<Result<Vec<_>>>()?;
        let figures = if opts.figures {
            report::draw_experiment(&data_dir, &report_dir)?
        } else {
            Vec::new()
        };
        (written, figures)
    };
    Ok(RunSummary {
        name,
        kind: kind.name(),
        models: models.iter().map(|m| m.name.clone()).collect(),
        data_dir,
        report_dir,
        tables: written,
        figures,
        notes,
        stats,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
