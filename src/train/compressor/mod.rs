//! `phaselens train` on a `[compressor]` recipe: a DeepSeek-V4-style compressor (the
//! `learned` overlay: per window, softmax gates per token and KV head from the layer's
//! input plus a per-offset bias, keys and values pooled separately) trained on a FROZEN
//! pretrained model by self-distillation.
//!
//! - **Text**: the model's own continuations of varied built-in prompts ([`data`]),
//!   made once per run by the uncompressed model (the teacher) and kept in the run.
//! - **Loss**: `KL(teacher || student)` of the next-token distributions, averaged over
//!   every position from `local` on (before it, the raw window holds the whole
//!   prefix and the two agree); the student is the same weights with the compressor in
//!   every layer. Only the compressor's gates get gradients.
//! - **Start**: zero gates, i.e. the `pool` overlay (mean pooling), so the first steps'
//!   KL is pool's.
//! - **Checkpoints**: as organisms (`runs/compressors/<name>/checkpoints/step-NNNNNNN/`
//!   with the gates, the optimizer state, then `meta.json`; `[compressor] run_dir`
//!   moves the folder), so a killed run resumes; the
//!   compressor goes to `<name>/` next to the recipe (`compressor.safetensors`, its
//!   loss curve under `training/`, then `compressor.json`), where a `learned` overlay's
//!   `checkpoint` key finds it: after every invocation, so `--max-steps N` (or a rerun
//!   with N at a checkpoint's step) exports the compressor at step N, and
//!   `compressor.json` records `steps` of `recipe_steps`.
//!
//! The recipe:
//! ```toml
//! [compressor]
//! name = "smollm2-w16s8"
//! model = "models:smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
//! window = 16      # W: tokens pooled into one entry
//! stride = 8       # S: a new entry every S tokens (the phase period)
//! local = 32       # raw tokens beside the entries
//! gate = "scalar"  # or "vector" (one gate per channel)
//! [data]           # data::DataConfig
//! sequences = 48
//! [train]          # the organisms' [train] table (steps, batch_size, lr, ...)
//! steps = 300
//! ```

pub mod data;
mod prompts;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use self::data::DataConfig;
use super::{
    LogRow, RunDir, TrainConfig, TrainOptions, TrainSummary, latest_checkpoint, lr_at, optimizer,
    write_loss_curve,
};
use crate::error::{Error, Result, ResultExt};
use crate::model::compression::learned::{self, CompressorMeta, ModelIdentity};
use crate::model::kvc::{CompressorStack, GateMode, KvcModel};
use crate::model::safetensors_io::{SafetensorsReader, write_atomic};
use crate::model::stored::Residency;
use crate::model::weights::{CheckpointSource, save_by_builder_names};
use crate::model::{LanguageModel, load_kvc, pretrained};
use crate::tokenizer::Tokenizer;

/// A `[compressor]` recipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressorFile {
    /// `[compressor]`.
    pub compressor: CompressorSection,
    /// `[data]`.
    #[serde(default)]
    pub data: DataConfig,
    /// `[train]`.
    pub train: TrainConfig,
}

/// `[compressor]`: the compressor and the model it is trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressorSection {
    /// Names the run (`runs/compressors/<name>/`) and the output folder.
    pub name: String,
    /// The frozen model: a `.gguf` file, a Hugging Face folder, a kvc model folder or
    /// `models:NAME/FILE` (the model cache).
    pub model: String,
    /// Tokens pooled into one entry (W >= stride).
    pub window: usize,
    /// Tokens between entries (the phase period).
    pub stride: usize,
    /// Raw tokens read beside the entries.
    #[serde(default)]
    pub local: usize,
    /// `scalar` (one gate per token and KV head) or `vector` (per channel too).
    #[serde(default = "scalar")]
    pub gate: GateMode,
    /// The output folder, relative to the recipe's folder (default: `<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out: Option<PathBuf>,
    /// The run folder (checkpoints, the distillation text), relative to the recipe's
    /// folder (default: `runs/compressors/<name>` in the working directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_dir: Option<PathBuf>,
}

fn scalar() -> GateMode {
    GateMode::Scalar
}

impl CompressorFile {
    /// Read and check a recipe.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let file: CompressorFile = toml::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        file.check().context_with(|| path.display().to_string())?;
        Ok(file)
    }

    /// What the recipe's keys must satisfy on their own; the error names the key.
    fn check(&self) -> Result<()> {
        let t = &self.train;
        if t.init.is_some() || !t.init_tile.is_empty() || t.indexer_distill != 0.0 {
            return Err(Error::field(
                "train",
                "init, init_tile and indexer_distill are organism keys; a compressor starts from zero gates",
            ));
        }
        for (k, v) in [
            ("steps", t.steps),
            ("batch_size", t.batch_size as u64),
            ("checkpoint_every", t.checkpoint_every),
        ] {
            if v == 0 {
                return Err(Error::field(format!("train.{k}"), "must be at least 1"));
            }
        }
        let c = &self.compressor;
        if c.name.is_empty() || c.name.contains(['/', '\\']) || c.name.starts_with('.') {
            return Err(Error::field(
                "compressor.name",
                format!("`{}` must be a plain folder name", c.name),
            ));
        }
        if c.local >= self.data.seq_len() {
            return Err(Error::field(
                "compressor.local",
                format!(
                    "{} leaves no position to distil in sequences of {} tokens ([data] prompt_tokens + new_tokens)",
                    c.local,
                    self.data.seq_len()
                ),
            ));
        }
        self.data.validate()
    }

    /// `[compressor] out` (default `<name>`), relative to the recipe's folder.
    pub fn out_dir(&self, path: &Path) -> PathBuf {
        let base = path.parent().unwrap_or(Path::new("."));
        base.join(
            self.compressor
                .out
                .clone()
                .unwrap_or_else(|| self.compressor.name.clone().into()),
        )
    }

    /// `[compressor] run_dir` (relative to the recipe's folder), by default
    /// `runs/compressors/<name>` (relative to the working directory).
    pub fn run_dir(&self, path: &Path) -> PathBuf {
        match &self.compressor.run_dir {
            Some(r) => path.parent().unwrap_or(Path::new(".")).join(r),
            None => PathBuf::from("runs/compressors").join(&self.compressor.name),
        }
    }

    /// The sha256 prefix of the recipe (a run of another recipe is never resumed).
    pub fn hash(&self) -> String {
        use sha2::Digest;
        let text = serde_json::to_string(self).expect("serialises");
        let d = sha2::Sha256::digest(text.as_bytes());
        d.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }

    fn shape(&self) -> (usize, usize, usize) {
        let c = &self.compressor;
        (c.window, c.stride, c.local)
    }
}

/// Whether the TOML text is a `[compressor]` recipe (rather than an organism's).
pub fn is_compressor_recipe(text: &str) -> bool {
    toml::from_str::<toml::Table>(text).is_ok_and(|t| t.contains_key("compressor"))
}

/// Load the frozen model of a recipe as a kvc-family model on `device` (f32 weights).
fn load_base(path: &Path, device: &Device) -> Result<KvcModel> {
    match pretrained::detect(path) {
        Some(p) => pretrained::load(&p, device, Residency::F32),
        None => load_kvc(path, device),
    }
}

/// Train (or resume) the compressor of the recipe `file` (at `path`).
pub fn train(
    path: &Path,
    file: &CompressorFile,
    device: &Device,
    opts: &TrainOptions,
) -> Result<TrainSummary> {
    if opts.max_steps == Some(0) {
        return Err(Error::Input("--max-steps 0 would train nothing".into()));
    }
    let model_path = pretrained::expand_model_path(Path::new(&file.compressor.model));
    let ctx = || format!("{}: [compressor] model", path.display());
    let teacher = load_base(&model_path, device).context_with(ctx)?;
    let tok = Tokenizer::open(&model_path).context_with(ctx)?;
    let run = file.run_dir(path);
    let _lock = crate::output::lock::RunLock::acquire(
        &run.join(".lock"),
        &format!("training of compressor `{}`", file.compressor.name),
    )?;
    crate::output::clean_stale_temps(&run, 3).map_err(|e| Error::io(&run, e))?;
    let text = data::load_or_make(
        &run.join("data"),
        &file.data,
        &teacher,
        &tok,
        device,
        opts.progress,
    )?;
    super::step::tune_allocator();
    let ad = device.clone().autodiff();
    let hash = file.hash();
    let (student, optim, start, history, resumed_from) =
        start(file, &model_path, &run, &hash, opts.fresh, &ad)?;
    let total = opts
        .max_steps
        .map_or(file.train.steps, |m| m.min(file.train.steps));
    let mut trainer = Trainer {
        file,
        teacher: &teacher,
        text: &text,
        device: device.clone(),
        ad,
        run: run.clone(),
        hash,
        drop_old: opts.fresh,
    };
    let (student, history) = trainer.steps(student, optim, (start, total), history, opts)?;
    let out_dir = file.out_dir(path);
    // The folder holds the compressor at the run's step: the recipe's last, or an earlier
    // one after `--max-steps` (its `compressor.json` says which).
    if total.max(start) > 0 {
        write_final(
            file,
            &model_path,
            &student,
            &history,
            &out_dir,
            &trainer.hash,
        )?;
    }
    Ok(TrainSummary {
        resumed_from,
        final_step: total.max(start),
        history,
        model_dir: out_dir,
    })
}

/// A run's start: the student, its optimizer, the step, the history so far, the step
/// resumed from.
type Start = (KvcModel, ModuleOptimizer, u64, Vec<LogRow>, Option<u64>);

/// The student at the latest checkpoint of `run` (unless `fresh`) or with zero gates.
fn start(
    file: &CompressorFile,
    model_path: &Path,
    run: &Path,
    hash: &str,
    fresh: bool,
    ad: &Device,
) -> Result<Start> {
    let base = load_base(model_path, ad)?;
    let gate = file.compressor.gate;
    let optim = optimizer(&file.train);
    let latest = if fresh { None } else { latest_checkpoint(run)? };
    let Some((dir, meta)) = latest else {
        let student = base.with_trainable_compressor(file.shape(), gate, None)?;
        return Ok((student, optim, 0, Vec::new(), None));
    };
    if meta.config_hash != hash {
        return Err(Error::Config {
            path: run.to_path_buf(),
            message: format!(
                "holds a checkpoint of a different recipe (hash {} vs {hash}); rerun with --fresh to start over",
                meta.config_hash
            ),
        });
    }
    let src =
        CheckpointSource::from_reader(SafetensorsReader::open(&dir.join(learned::WEIGHTS_FILE))?);
    let student = base.with_trainable_compressor(file.shape(), gate, Some(&src))?;
    let bytes =
        std::fs::read(dir.join("optim.bpk")).map_err(|e| Error::io(dir.join("optim.bpk"), e))?;
    let optim = optim
        .from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
        .map_err(|e| Error::Other(format!("{}: optimizer state: {e}", dir.display())))?;
    Ok((student, optim, meta.step, meta.history, Some(meta.step)))
}

/// Write the compressor gates of `model` to `dir/compressor.safetensors`.
pub fn save_gates(model: &KvcModel, dir: &Path) -> Result<()> {
    let (Some(stack), Some(cc)) = (model.compressor_stack(), model.config.compression.clone())
    else {
        return Err(Error::Other("the model has no compressor to save".into()));
    };
    let c = &model.config;
    let (n, dims) = (c.n_layers, (c.d_model, c.n_kv_heads, c.d_head()));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    save_by_builder_names(
        &stack,
        &|vb| CompressorStack::new(vb, &cc, n, dims),
        &model.device(),
        &dir.join(learned::WEIGHTS_FILE),
        Default::default(),
    )
}

/// The trained compressor's folder: gates, loss curve, then `compressor.json`.
fn write_final(
    file: &CompressorFile,
    model_path: &Path,
    student: &KvcModel,
    history: &[LogRow],
    out: &Path,
    hash: &str,
) -> Result<()> {
    save_gates(student, out)?;
    let name = &file.compressor.name;
    write_loss_curve(&out.join("training"), name, history, hash)?;
    let tail = &history[history.len().saturating_sub(20)..];
    let c = &file.compressor;
    let meta = CompressorMeta {
        format: learned::FORMAT.into(),
        name: name.clone(),
        window: c.window,
        stride: c.stride,
        local: c.local,
        gate: c.gate,
        model: ModelIdentity::of(&student.config, model_path),
        steps: history.len() as u64,
        recipe_steps: file.train.steps,
        tokens_seen: history.last().map_or(0, |r| r.tokens_seen),
        final_kl: tail.iter().map(|r| r.loss).sum::<f64>() / tail.len().max(1) as f64,
        recipe_hash: hash.into(),
        phaselens_commit: env!("PHASELENS_GIT_COMMIT").into(),
    };
    write_atomic(
        &out.join(learned::META_FILE),
        format!("{}\n", serde_json::to_string_pretty(&meta).expect("json")).as_bytes(),
    )
}

/// The parts every step reads.
struct Trainer<'a> {
    file: &'a CompressorFile,
    teacher: &'a KvcModel,
    text: &'a [Vec<u32>],
    device: Device,
    ad: Device,
    run: PathBuf,
    hash: String,
    drop_old: bool,
}

impl Trainer<'_> {
    /// The sequences of step `step`: `batch_size` of them, in a seeded order per epoch.
    fn batch(&self, step: u64) -> Vec<i64> {
        let b = self.file.train.batch_size;
        let n = self.text.len();
        let mut out = Vec::with_capacity(b * self.file.data.seq_len());
        for k in 0..b {
            let i = step as usize * b + k;
            let (epoch, at) = (i / n, i % n);
            let mut rng = ChaCha8Rng::seed_from_u64(self.file.train.seed ^ (epoch as u64) << 20);
            let mut order: Vec<usize> = (0..n).collect();
            for j in (1..n).rev() {
                order.swap(j, rand::Rng::random_range(&mut rng, 0..=j));
            }
            out.extend(self.text[order[at]].iter().map(|&t| t as i64));
        }
        out
    }

    /// The flat rows `[batch * seq]` whose next-token distributions are distilled.
    fn rows(&self) -> Vec<i64> {
        let (b, t) = (self.file.train.batch_size, self.file.data.seq_len());
        let from = self.file.compressor.local.min(t - 1);
        (0..b)
            .flat_map(|r| (from..t).map(move |p| (r * t + p) as i64))
            .collect()
    }

    /// One optimiser step: the updated student, the KL and the top-1 agreement.
    fn step(
        &self,
        student: KvcModel,
        optim: &mut ModuleOptimizer,
        step: u64,
    ) -> Result<(KvcModel, f64, f64)> {
        let (b, t) = (self.file.train.batch_size, self.file.data.seq_len());
        let ids = self.batch(step);
        let rows = self.rows();
        let n = rows.len();
        let on = |d: &Device| {
            (
                Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [b, t]), d),
                Tensor::<1, Int>::from_data(TensorData::new(rows.clone(), [n]), d),
            )
        };
        let (tok, r) = on(&self.device);
        let target = self.teacher.forward_logit_rows(tok, r)?;
        let p = softmax(target.clone(), 1);
        let p = Tensor::<2>::from_data(p.into_data(), &self.ad);
        let top = Tensor::<1, Int>::from_data(target.argmax(1).reshape([n]).into_data(), &self.ad);
        let (tok, r) = on(&self.ad);
        let logits = student.forward_logit_rows(tok, r)?;
        let log_q = log_softmax(logits.clone(), 1);
        let log_p = p.clone().clamp_min(1e-30).log();
        let kl = (p * (log_p - log_q)).sum() / n as f64;
        let agree = logits
            .detach()
            .argmax(1)
            .reshape([n])
            .equal(top)
            .float()
            .mean();
        let kl_v = kl.clone().into_scalar::<f32>() as f64;
        if !kl_v.is_finite() {
            return Err(Error::Other(format!(
                "distillation KL became {kl_v} at step {step} (lower [train] lr, now {})",
                self.file.train.lr
            )));
        }
        let grads = GradientsParams::from_grads(kl.backward(), &student);
        let student = optim.step(lr_at(&self.file.train, step), student, grads);
        Ok((student, kl_v, agree.into_scalar::<f32>() as f64))
    }

    /// Steps `start..total` on a progress bar, a checkpoint every `checkpoint_every`.
    fn steps(
        &mut self,
        mut student: KvcModel,
        mut optim: ModuleOptimizer,
        (start, total): (u64, u64),
        mut history: Vec<LogRow>,
        opts: &TrainOptions,
    ) -> Result<(KvcModel, Vec<LogRow>)> {
        let tc = &self.file.train;
        let per_step = (tc.batch_size * self.file.data.seq_len()) as u64;
        let bar = super::steps_bar(opts.progress, total, start, &self.file.compressor.name);
        let t0 = Instant::now();
        for step in start..total {
            let (next, kl, agree) = self.step(student, &mut optim, step)?;
            student = next;
            let row = LogRow {
                step,
                loss: kl,
                lr: lr_at(tc, step),
                tokens_seen: (step + 1) * per_step,
                accuracy: agree,
                indexer_kl: None,
            };
            history.push(row);
            let secs = t0.elapsed().as_secs_f64() / (step + 1 - start) as f64;
            bar.set_message(format!("KL {kl:.4}  agree {agree:.3}  {secs:.1} s/step"));
            bar.inc(1);
            if (step + 1) % tc.checkpoint_every == 0 || step + 1 == total {
                self.checkpoint(&student, &optim, &row, &history)?;
                if opts.progress && !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                    eprintln!(
                        "{}: step {}/{total}  KL {kl:.4}  agreement {agree:.3}  {secs:.1} s/step  checkpoint saved",
                        self.file.compressor.name,
                        step + 1
                    );
                }
            }
        }
        bar.finish();
        Ok((student, history))
    }

    fn checkpoint(
        &mut self,
        student: &KvcModel,
        optim: &ModuleOptimizer,
        row: &LogRow,
        history: &[LogRow],
    ) -> Result<()> {
        let run = RunDir {
            run: &self.run,
            name: &self.file.compressor.name,
            hash: &self.hash,
            keep: self.file.train.keep_checkpoints,
        };
        run.checkpoint(
            student,
            &save_gates,
            optim,
            (row, history),
            &mut self.drop_old,
        )
    }
}
