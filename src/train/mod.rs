//! Training model organisms: `phaselens train experiments/organisms/<name>.toml`.
//!
//! nanoGPT-shaped and linear: sample a batch (a pure function of seed and step), forward,
//! cross-entropy on the answer positions only, backward, clip, AdamW step with warm-up +
//! cosine. Every `checkpoint_every` steps the weights, the optimizer state and the loss
//! history are written to `<run_dir>/checkpoints/step-NNNNNNN/`, `meta.json` last (atomic
//! rename), so a run killed at any moment (even `kill -9`) resumes from the latest
//! complete checkpoint and loses at most one interval.

#[doc(hidden)] // `phaselens bench train` (the CLI) and its test in tests/it
pub mod bench;
pub mod compressor;
pub mod distill;
#[doc(hidden)] // training's memory estimate: the CLI checks it, tests/it compare it to measurements
pub mod memory;
mod organism;
mod schedule;
mod step;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, ResultExt};
use crate::model::deepseek_v4::DeepseekV4Model;
use crate::model::deepseek_v4::V4Checkpoint;
use crate::model::safetensors_io::write_atomic;
use crate::model::weights::{CheckpointSource, RandomInit, Tiled, Vb, WeightSource};
use crate::model::{KvcModel, LanguageModel, save_kvc};
use crate::tasks::{IGNORE_INDEX, KvTrainSampler};

pub use organism::{ModelConfig, OrganismFile, OrganismSection, TaskSection, TrainConfig};
pub use schedule::lr_at;
#[doc(hidden)] // one training step, shared with `phaselens bench train` (bench.rs)
pub use step::{PhaseTimes, StepOutcome, Stepper, optimizer};

/// One logged training step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LogRow {
    /// The step (0-based).
    pub step: u64,
    /// Cross-entropy on the answer positions.
    pub loss: f64,
    /// The learning rate.
    pub lr: f64,
    /// Tokens trained on so far.
    pub tokens_seen: u64,
    /// Top-1 accuracy on the batch's answer positions.
    pub accuracy: f64,
    /// The indexer distillation loss (`[train] indexer_distill`; absent without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer_kl: Option<f64>,
}

/// What a checkpoint's `meta.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Steps done.
    pub step: u64,
    /// The last logged loss.
    pub loss: f64,
    /// Tokens trained on so far.
    pub tokens_seen: u64,
    /// [`config_hash`] of the recipe (a resume must match it).
    pub config_hash: String,
    /// The phaselens version that wrote it.
    pub phaselens_version: String,
    /// The source commit of the binary that wrote it (`unknown` outside a git checkout;
    /// absent in checkpoints written before it was recorded).
    #[serde(default)]
    pub phaselens_commit: Option<String>,
    /// Every logged step.
    pub history: Vec<LogRow>,
}

/// The flat indices (into row-major `[batch, pos]`) of the positions whose label is not
/// [`IGNORE_INDEX`], and those labels.
pub(crate) fn answer_positions(labels: &[i64]) -> (Vec<i64>, Vec<i64>) {
    labels
        .iter()
        .enumerate()
        .filter(|(_, l)| **l != IGNORE_INDEX)
        .map(|(i, l)| (i as i64, *l))
        .unzip()
}

/// Mean cross-entropy and top-1 accuracy of `rows: [n, vocab]` logits against `targets`
/// (`n` token ids).
pub(crate) fn rows_loss(rows: Tensor<2>, targets: Vec<i64>) -> (Tensor<1>, Tensor<1>) {
    let n = targets.len();
    let device = rows.device();
    let tgt_t = Tensor::<2, Int>::from_data(TensorData::new(targets, [n, 1]), &device);
    let logp = log_softmax(rows.clone(), 1);
    let nll = logp.gather(1, tgt_t.clone()).neg().mean();
    let hit = rows.detach().argmax(1).equal(tgt_t).float().mean();
    (nll, hit)
}

/// The sha256 of the organism file's `[model]`, `[task]` and `[train]` tables, so a
/// checkpoint from another recipe is never resumed by mistake.
pub fn config_hash(file: &OrganismFile) -> String {
    use sha2::Digest;
    let text = serde_json::to_string(&(&file.model, &file.task, &file.train)).expect("serialises");
    let d = sha2::Sha256::digest(text.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

fn step_dir(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step-{step:07}"))
}

/// The latest complete checkpoint (one whose `meta.json` exists) under `run`.
pub fn latest_checkpoint(run: &Path) -> Result<Option<(PathBuf, CheckpointMeta)>> {
    let dir = run.join("checkpoints");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(None);
    };
    let mut best: Option<(PathBuf, CheckpointMeta)> = None;
    for e in entries.flatten() {
        let meta_path = e.path().join("meta.json");
        let Ok(text) = std::fs::read_to_string(&meta_path) else {
            continue; // incomplete: killed before meta.json was renamed into place
        };
        let meta: CheckpointMeta = serde_json::from_str(&text).map_err(|x| Error::Config {
            path: meta_path.clone(),
            message: format!("corrupt checkpoint metadata: {x}"),
        })?;
        if best.as_ref().is_none_or(|(_, m)| meta.step > m.step) {
            best = Some((e.path(), meta));
        }
    }
    Ok(best)
}

/// Options of one training invocation.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Ignore existing checkpoints and start from step 0.
    pub fresh: bool,
    /// Stop after this many steps in total (for tests and quick looks).
    pub max_steps: Option<u64>,
    /// Show a progress bar.
    pub progress: bool,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The checkpoint step the run resumed from (`None`: a fresh start).
    pub resumed_from: Option<u64>,
    /// Steps done at the end.
    pub final_step: u64,
    /// Every logged step.
    pub history: Vec<LogRow>,
    /// The trained model folder (for a compressor: its folder, written after every
    /// invocation).
    pub model_dir: PathBuf,
}

/// Train (or resume) the organism described by `file` (located at `path`).
pub fn train(
    path: &Path,
    file: &OrganismFile,
    device: &Device,
    opts: &TrainOptions,
) -> Result<TrainSummary> {
    match &file.model {
        ModelConfig::Kvc(cfg) => train_model(
            path,
            file,
            device,
            opts,
            &|vb: &Vb| KvcModel::new(cfg, vb),
            &|dir: &Path| Ok(Box::new(CheckpointSource::open_dir(dir)?)),
            &|m: &KvcModel, dir: &Path| save_kvc(m, dir),
        ),
        ModelConfig::DeepseekV4 { json, resolved } => train_model(
            path,
            file,
            device,
            opts,
            &|vb: &Vb| DeepseekV4Model::new(resolved, vb),
            &|dir: &Path| Ok(Box::new(V4Checkpoint::open_dir(dir, resolved.fp8_block)?)),
            &|m: &DeepseekV4Model, dir: &Path| crate::model::deepseek_v4::save(m, json, dir),
        ),
    }
}

pub(crate) type Build<'a, M> = &'a dyn Fn(&Vb) -> Result<M>;
pub(crate) type Save<'a, M> = &'a dyn Fn(&M, &Path) -> Result<()>;
type Open<'a> = &'a dyn Fn(&Path) -> Result<Box<dyn WeightSource>>;

/// The recipe's training sampler, checked against `[model] vocab_size` and the
/// machine's memory (the training estimate at the sampler's prompt length).
pub(crate) fn training_sampler(path: &Path, file: &OrganismFile) -> Result<KvTrainSampler> {
    let space = file
        .task
        .vocab
        .build()
        .context_with(|| format!("{}: [task.vocab]", path.display()))?;
    let sampler = KvTrainSampler::new(&space, file.task.train.clone())
        .context_with(|| format!("{}: [task.train]", path.display()))?;
    if space.vocab_size() > file.model.vocab_size() {
        return Err(Error::Config {
            path: path.to_path_buf(),
            message: format!(
                "[model] vocab_size = {} is smaller than the task's vocabulary ({})",
                file.model.vocab_size(),
                space.vocab_size()
            ),
        });
    }
    memory::check_training(file, sampler.seq_len()).context_with(|| path.display().to_string())?;
    Ok(sampler)
}

/// [`train`] for one model type: `build` makes it from weights, `open` reads a
/// checkpoint's weights, `save` writes them.
fn train_model<M: Module + LanguageModel>(
    path: &Path,
    file: &OrganismFile,
    device: &Device,
    opts: &TrainOptions,
    build: Build<M>,
    open: Open,
    save: Save<M>,
) -> Result<TrainSummary> {
    let tc = &file.train;
    if opts.max_steps == Some(0) {
        return Err(Error::Input(
            "--max-steps 0 would train nothing: give at least 1 (or leave it out for [train] steps)"
                .into(),
        ));
    }
    let sampler = training_sampler(path, file)?;
    step::tune_allocator();
    let run_dir = file.run_dir(path);
    let _new = crate::output::leftovers::NewDirs::note(&[run_dir.as_path()]);
    let t = Training {
        path,
        file,
        run: run_dir.clone(),
        hash: config_hash(file),
        build,
        open,
        save,
    };
    let _lock = t.lock()?;
    let ad = device.clone().autodiff();
    let begin = t.start(opts.fresh, &ad)?;
    let (start, resumed_from) = (begin.step, begin.resumed_from);
    let total = opts.max_steps.map_or(tc.steps, |m| m.min(tc.steps));
    let seq = sampler.seq_len();
    let tokens_per_step = (tc.batch_size * seq) as u64;
    let stepper = Stepper {
        sampler: &sampler,
        tc,
        device: ad.clone(),
        distill: file.distill_layers(),
    };
    let (model, history) = t.train_steps(begin, &stepper, total, tokens_per_step, opts)?;
    let final_step = total.max(start);
    let out = file.model_dir(path);
    if final_step == tc.steps {
        t.save_final(&model.valid(), &out, final_step * tokens_per_step, &history)?;
    }
    Ok(TrainSummary {
        resumed_from,
        final_step,
        history,
        model_dir: out,
    })
}

/// One training run: the recipe (at `path`), its run folder and config hash, and how
/// to build, open and save its model.
struct Training<'a, M> {
    path: &'a Path,
    file: &'a OrganismFile,
    run: PathBuf,
    hash: String,
    build: Build<'a, M>,
    open: Open<'a>,
    save: Save<'a, M>,
}

/// Where a run starts: the model and its optimizer, its step, the loss history so
/// far, and the step it resumed from (`None` for a fresh start).
struct Start<M> {
    model: M,
    optim: ModuleOptimizer,
    step: u64,
    history: Vec<LogRow>,
    resumed_from: Option<u64>,
}

impl<M: Module + LanguageModel> Training<'_, M> {
    /// Resume from the latest checkpoint (unless `fresh`) with its optimizer state;
    /// else a randomly initialised model at step 0. A checkpoint of a different recipe
    /// is an error.
    fn start(&self, fresh: bool, ad: &Device) -> Result<Start<M>> {
        let optim = optimizer(&self.file.train);
        let latest = if fresh {
            None
        } else {
            latest_checkpoint(&self.run)?
        };
        let Some((dir, meta)) = latest else {
            let model = match self.file.init_dir(self.path) {
                // `[train] init`: a trained model's weights, fresh optimizer, step 0.
                Some(init) => {
                    let src = (self.open)(&init).context_with(|| {
                        format!("{}: [train] init = {}", self.path.display(), init.display())
                    })?;
                    let tile = &self.file.train.init_tile;
                    let tiled = Tiled::new(src.as_ref(), tile);
                    let model = (self.build)(&Vb::new(&tiled, ad)).context_with(|| {
                        format!(
                            "{}: [train] init = {}: its weights do not fit [model]",
                            self.path.display(),
                            init.display()
                        )
                    })?;
                    if let Some(p) = tiled.unmatched().first() {
                        return Err(Error::Config {
                            path: self.path.to_path_buf(),
                            message: format!(
                                "[train] init_tile: `{p}` names no parameter of the model"
                            ),
                        });
                    }
                    for (name, from, to) in tiled.tiled() {
                        eprintln!("init: tiled `{name}` {from:?} -> {to:?}");
                    }
                    model
                }
                None => (self.build)(&Vb::new(
                    &RandomInit {
                        seed: self.file.train.seed,
                    },
                    ad,
                ))?,
            };
            return Ok(Start {
                model,
                optim,
                step: 0,
                history: Vec::new(),
                resumed_from: None,
            });
        };
        if meta.config_hash != self.hash {
            return Err(Error::Config {
                path: self.path.to_path_buf(),
                message: format!(
                    "{} holds a checkpoint of a different recipe (hash {} vs {}); \
                     rerun with --fresh to start over",
                    self.run.display(),
                    meta.config_hash,
                    self.hash
                ),
            });
        }
        let src = (self.open)(&dir)?;
        let model = (self.build)(&Vb::new(src.as_ref(), ad))?;
        let bytes = std::fs::read(dir.join("optim.bpk"))
            .map_err(|e| Error::io(dir.join("optim.bpk"), e))?;
        let optim = optim
            .from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
            .map_err(|e| Error::Other(format!("{}: optimizer state: {e}", dir.display())))?;
        Ok(Start {
            model,
            optim,
            step: meta.step,
            history: meta.history,
            resumed_from: Some(meta.step),
        })
    }

    /// Take the run's lock (one training of an organism at a time), then remove what
    /// killed writers left in the run and model folders.
    fn lock(&self) -> Result<crate::output::lock::RunLock> {
        let lock = crate::output::lock::RunLock::acquire(
            &self.run.join(".lock"),
            &format!("training of `{}`", self.file.organism.name),
        )?;
        let model_dir = self.file.model_dir(self.path);
        for (dir, depth) in [(&self.run, 3), (&model_dir, 2)] {
            crate::output::clean_stale_temps(dir, depth).map_err(|e| Error::io(dir, e))?;
        }
        Ok(lock)
    }

    /// Train from `begin` up to step `total` (on a progress bar), saving a checkpoint
    /// every `checkpoint_every` steps and after the last; returns the model and the
    /// whole loss history.
    fn train_steps(
        &self,
        begin: Start<M>,
        stepper: &Stepper,
        total: u64,
        tokens_per_step: u64,
        opts: &TrainOptions,
    ) -> Result<(M, Vec<LogRow>)> {
        let Start {
            mut model,
            mut optim,
            step: start,
            mut history,
            ..
        } = begin;
        let bar = self.progress_bar(opts.progress, total, start);
        let mut tokens_seen = start * tokens_per_step;
        let mut meter = Meter {
            bar: &bar,
            t0: Instant::now(),
            ema: history.last().map(|r| r.loss),
            start,
            tokens_per_step,
        };
        // `--fresh`: the old checkpoints go only when the first new one is saved, after
        // every check passed and the model was built.
        let mut drop_old = opts.fresh;
        for step in start..total {
            let (next, out) = stepper.step(model, &mut optim, step)?;
            model = next;
            tokens_seen += tokens_per_step;
            let row = LogRow {
                step,
                loss: out.loss,
                lr: out.lr,
                tokens_seen,
                accuracy: out.accuracy,
                indexer_kl: out.indexer_kl,
            };
            history.push(row);
            let (e, tps) = meter.tick(&row);
            if (step + 1) % self.file.train.checkpoint_every == 0 || step + 1 == total {
                self.checkpoint(&model, &optim, &row, &history, &mut drop_old)?;
                if opts.progress && !std::io::stderr().is_terminal() {
                    // Logs and CI get one line per checkpoint instead of a bar.
                    eprintln!(
                        "{}: step {}/{total}  loss {e:.4}  batch acc {:.3}  {tps:.0} tok/s  checkpoint saved",
                        self.file.organism.name,
                        step + 1,
                        row.accuracy
                    );
                }
            }
        }
        bar.finish();
        Ok((model, history))
    }

    /// The training progress bar (hidden without `progress`), at `start` of `total`.
    fn progress_bar(&self, progress: bool, total: u64, start: u64) -> ProgressBar {
        steps_bar(progress, total, start, &self.file.organism.name)
    }

    /// Save a checkpoint after step `row` (removing the old checkpoints first when
    /// `drop_old` is still set) and the loss curve so far.
    fn checkpoint(
        &self,
        model: &M,
        optim: &ModuleOptimizer,
        row: &LogRow,
        history: &[LogRow],
        drop_old: &mut bool,
    ) -> Result<()> {
        let run = RunDir {
            run: &self.run,
            name: &self.file.organism.name,
            hash: &self.hash,
            keep: self.file.train.keep_checkpoints,
        };
        run.checkpoint(model, self.save, optim, (row, history), drop_old)
    }

    /// Save the finished model into `out`, with `training.json` and the loss curve.
    fn save_final(
        &self,
        inference: &M,
        out: &Path,
        tokens_seen: u64,
        history: &[LogRow],
    ) -> Result<()> {
        (self.save)(inference, out)?;
        let steps = self.file.train.steps;
        let meta = serde_json::json!({
            "organism": self.file.organism.name,
            "steps": steps,
            "tokens_seen": tokens_seen,
            "final_loss": history.last().map(|r| r.loss),
            "config_hash": self.hash,
            "phaselens_version": env!("CARGO_PKG_VERSION"),
            // The source commit of the binary that finished the training (build.rs):
            // trainings of one recipe by different commits can differ (numeric changes
            // grow over thousands of steps).
            "phaselens_commit": env!("PHASELENS_GIT_COMMIT"),
        });
        write_atomic(
            &out.join("training.json"),
            format!("{:#}\n", meta).as_bytes(),
        )?;
        write_loss_curve(
            &out.join("training"),
            &self.file.organism.name,
            history,
            &self.hash,
        )
    }
}

/// A bar of training steps named `name` (hidden without `progress`), at `start` of
/// `total`.
pub(crate) fn steps_bar(progress: bool, total: u64, start: u64, name: &str) -> ProgressBar {
    let bar = if progress {
        ProgressBar::new(total)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps  {msg}  eta {eta}")
            .expect("template")
            .progress_chars("=> "),
    );
    bar.set_prefix(name.to_string());
    bar.set_position(start);
    bar
}

/// The progress of a run on its bar: smoothed loss, batch accuracy, throughput.
struct Meter<'a> {
    bar: &'a ProgressBar,
    t0: Instant,
    /// Exponential moving average of the loss.
    ema: Option<f64>,
    start: u64,
    tokens_per_step: u64,
}

impl Meter<'_> {
    /// Count step `row` on the bar; returns the smoothed loss and tokens per second.
    fn tick(&mut self, row: &LogRow) -> (f64, f64) {
        let e = self.ema.map_or(row.loss, |e| 0.95 * e + 0.05 * row.loss);
        self.ema = Some(e);
        let done = row.step + 1 - self.start;
        let tps = (done * self.tokens_per_step) as f64 / self.t0.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_message(format!(
            "loss {e:.3}  acc {:.2}  {tps:.0} tok/s",
            row.accuracy
        ));
        self.bar.inc(1);
        (e, tps)
    }
}

/// The loss curve as `loss.arrow` (columns `step, loss, lr, tokens_seen, accuracy`) and
/// `loss.png` / `loss.svg` in `dir`.
pub(crate) fn write_loss_curve(
    dir: &Path,
    name: &str,
    history: &[LogRow],
    hash: &str,
) -> Result<()> {
    use crate::output::{Table, loss_curve};
    let table = Table::new(format!("{name}-loss"))
        .with_metadata("phaselens.version", env!("CARGO_PKG_VERSION"))
        .with_metadata("phaselens.organism", name)
        .with_metadata("phaselens.config_hash", hash)
        .with_column("step", history.iter().map(|r| r.step).collect::<Vec<u64>>())
        .and_then(|t| t.with_column("loss", history.iter().map(|r| r.loss).collect::<Vec<f64>>()))
        .and_then(|t| t.with_column("lr", history.iter().map(|r| r.lr).collect::<Vec<f64>>()))
        .and_then(|t| {
            t.with_column(
                "tokens_seen",
                history.iter().map(|r| r.tokens_seen).collect::<Vec<u64>>(),
            )
        })
        .and_then(|t| {
            t.with_column(
                "accuracy",
                history.iter().map(|r| r.accuracy).collect::<Vec<f64>>(),
            )
        })
        .and_then(|t| {
            // Only for trainings with indexer distillation (NaN on rows before it).
            if history.iter().all(|r| r.indexer_kl.is_none()) {
                return Ok(t);
            }
            t.with_column(
                "indexer_kl",
                history
                    .iter()
                    .map(|r| r.indexer_kl.unwrap_or(f64::NAN))
                    .collect::<Vec<f64>>(),
            )
        })
        .map_err(|e| Error::Other(format!("loss table: {e}")))?;
    table
        .write_arrow(dir.join("loss.arrow"))
        .map_err(|e| Error::Other(format!("{}: {e}", dir.join("loss.arrow").display())))?;
    let steps: Vec<u64> = history.iter().map(|r| r.step).collect();
    let losses: Vec<f64> = history.iter().map(|r| r.loss).collect();
    loss_curve(
        dir.join("loss"),
        &steps,
        &losses,
        &format!("{name}: training loss (answer tokens)"),
    )
    .map_err(|e| Error::Other(format!("{}: {e}", dir.join("loss.png").display())))?;
    Ok(())
}

/// A training run's folder: its checkpoints and loss curve, the run's name and recipe
/// hash, and how many checkpoints it keeps (organisms and learned compressors alike).
pub(crate) struct RunDir<'a> {
    pub run: &'a Path,
    pub name: &'a str,
    pub hash: &'a str,
    pub keep: usize,
}

impl RunDir<'_> {
    /// Save the checkpoint after step `row` (the old checkpoints go first while
    /// `drop_old` is still set: a `--fresh` run's first save) and the loss curve of
    /// `history` so far.
    pub(crate) fn checkpoint<M: Module>(
        &self,
        model: &M,
        save: Save<M>,
        optim: &ModuleOptimizer,
        (row, history): (&LogRow, &[LogRow]),
        drop_old: &mut bool,
    ) -> Result<()> {
        if std::mem::take(drop_old) {
            let old = self.run.join("checkpoints");
            if old.exists() {
                std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
            }
        }
        let meta = CheckpointMeta {
            step: row.step + 1,
            loss: row.loss,
            tokens_seen: row.tokens_seen,
            config_hash: self.hash.to_string(),
            phaselens_version: env!("CARGO_PKG_VERSION").into(),
            phaselens_commit: Some(env!("PHASELENS_GIT_COMMIT").into()),
            history: history.to_vec(),
        };
        save_checkpoint(self.run, model, save, optim, &meta, self.keep)?;
        write_loss_curve(self.run, self.name, history, self.hash)
    }
}

/// Write checkpoint `meta.step` (model, optimizer state, then `meta.json`, whose presence
/// marks it complete) and drop the oldest checkpoints beyond `keep`.
fn save_checkpoint<M: Module>(
    run: &Path,
    model: &M,
    save: Save<M>,
    optim: &burn::optim::ModuleOptimizer,
    meta: &CheckpointMeta,
    keep: usize,
) -> Result<()> {
    let dir = step_dir(run, meta.step);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    save(model, &dir)?;
    let bytes = optim
        .into_bytes()
        .map_err(|e| Error::Other(format!("serialising optimizer state: {e}")))?;
    write_atomic(&dir.join("optim.bpk"), &bytes)?;
    // meta.json last: its presence marks the checkpoint complete.
    write_atomic(
        &dir.join("meta.json"),
        serde_json::to_string(meta).expect("meta").as_bytes(),
    )?;
    // Drop older checkpoints beyond `keep`.
    if let Ok(entries) = std::fs::read_dir(run.join("checkpoints")) {
        let mut steps: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        steps.sort();
        let n = steps.len();
        for old in steps.into_iter().take(n.saturating_sub(keep.max(1))) {
            let _ = std::fs::remove_dir_all(old);
        }
    }
    Ok(())
}
