//! `phaselens bench train RECIPE`: the optimiser steps `phaselens train` runs (same
//! model, random init, sampler and optimiser, through the same [`Stepper`]), timed, with
//! no checkpoint writes; and `--export DIR`, what a reference implementation needs to
//! replay exactly those steps (docs/performance.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::Serialize;

use super::step::{BETA1, EPSILON, PhaseTimes, Stepper, optimizer};
use super::{Build, ModelConfig, OrganismFile, Save, lr_at, training_sampler};
use crate::error::{Error, Result};
use crate::hooks::HookSpec;
use crate::model::bench::{reset_peak_rss, rss};
use crate::model::deepseek_v4::DeepseekV4Model;
use crate::model::safetensors_io::{OwnedTensor, TensorValues, write_atomic, write_safetensors};
use crate::model::weights::{RandomInit, Vb};
use crate::model::{KvcModel, LanguageModel, save_kvc};
use crate::tasks::IGNORE_INDEX;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Timed steps.
    pub steps: u64,
    /// Untimed steps before them (steps `0..warmup`; the timed ones follow).
    pub warmup: u64,
    /// Write the initial weights, the batches and the optimiser settings here.
    pub export: Option<PathBuf>,
}

/// The measurement (`--json`; schema in docs/performance.md).
#[derive(Debug, Clone, Serialize)]
pub struct TrainBench {
    pub organism: String,
    pub device: String,
    /// Logical CPUs the process may use (`std::thread::available_parallelism`).
    pub cpus: usize,
    pub batch_size: usize,
    pub seq_len: usize,
    pub tokens_per_step: usize,
    pub n_params: Option<usize>,
    pub warmup: u64,
    pub steps: u64,
    /// Wall time of the timed steps.
    pub seconds: f64,
    pub steps_per_second: f64,
    pub tokens_per_second: f64,
    /// Mean seconds per timed step in each phase.
    pub phases: PhaseTimes,
    /// Peak resident set over the timed steps (bytes; reset before them), if reported.
    pub peak_rss_bytes: Option<u64>,
    /// Resident set before the timed steps.
    pub base_rss_bytes: Option<u64>,
    /// Loss of every step, warm-up included (step 0 first).
    pub losses: Vec<f64>,
}

/// Run the benchmark of the recipe at `path`.
pub fn bench_train(
    path: &Path,
    file: &OrganismFile,
    device: &Device,
    opts: &BenchOptions,
) -> Result<TrainBench> {
    match &file.model {
        ModelConfig::Kvc(cfg) => run(
            path,
            file,
            device,
            opts,
            &|vb: &Vb| KvcModel::new(cfg, vb),
            &|m: &KvcModel, dir: &Path| save_kvc(m, dir),
        ),
        ModelConfig::DeepseekV4 { json, resolved } => run(
            path,
            file,
            device,
            opts,
            &|vb: &Vb| DeepseekV4Model::new(resolved, vb),
            &|m: &DeepseekV4Model, dir: &Path| crate::model::deepseek_v4::save(m, json, dir),
        ),
    }
}

fn run<M: Module + LanguageModel>(
    path: &Path,
    file: &OrganismFile,
    device: &Device,
    opts: &BenchOptions,
    build: Build<M>,
    save: Save<M>,
) -> Result<TrainBench> {
    if opts.steps == 0 {
        return Err(Error::Input("--steps must be at least 1".into()));
    }
    let tc = &file.train;
    let sampler = training_sampler(path, file)?;
    super::step::tune_allocator();
    let ad = device.clone().autodiff();
    let stepper = Stepper {
        sampler: &sampler,
        tc,
        device: ad.clone(),
        distill: file.distill_layers(),
    };
    let mut model = build(&Vb::new(&RandomInit { seed: tc.seed }, &ad))?;
    let mut optim = optimizer(tc);
    let total = opts.warmup + opts.steps;
    if let Some(dir) = &opts.export {
        export_inputs(dir, &model, &stepper, total, device, save)?;
    }
    let mut losses = Vec::with_capacity(total as usize);
    for step in 0..opts.warmup {
        let (next, out) = stepper.step(model, &mut optim, step)?;
        model = next;
        losses.push(out.loss);
    }
    let base = rss().map(|r| r.0);
    let reset = reset_peak_rss();
    let mut phases = PhaseTimes::default();
    let t0 = Instant::now();
    for step in opts.warmup..total {
        let (next, out) = stepper.step(model, &mut optim, step)?;
        model = next;
        losses.push(out.loss);
        phases.add(&out.times);
    }
    let seconds = t0.elapsed().as_secs_f64();
    let n = opts.steps as f64;
    let tokens_per_step = tc.batch_size * sampler.seq_len();
    let bench = TrainBench {
        organism: file.organism.name.clone(),
        device: format!("{device:?}"),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        batch_size: tc.batch_size,
        seq_len: sampler.seq_len(),
        tokens_per_step,
        n_params: model.n_params(),
        warmup: opts.warmup,
        steps: opts.steps,
        seconds,
        steps_per_second: n / seconds,
        tokens_per_second: n * tokens_per_step as f64 / seconds,
        phases: PhaseTimes {
            sample: phases.sample / n,
            forward: phases.forward / n,
            backward: phases.backward / n,
            optimizer: phases.optimizer / n,
        },
        peak_rss_bytes: reset.then(|| rss().map(|r| r.1)).flatten(),
        base_rss_bytes: base,
        losses,
    };
    if let Some(dir) = &opts.export {
        export_settings(dir, file, &bench)?;
    }
    Ok(bench)
}

/// `DIR/model/` (config.json + model.safetensors: the initial weights),
/// `DIR/batches.safetensors` (`input_ids`, `labels` with -100 off the answers,
/// `loss_mask` 0/1; each `[steps, batch, seq]` i64) and `DIR/logits0.safetensors` (the
/// initial model's `logits` `[batch, seq, vocab]` on the batch of step 0).
fn export_inputs<M: Module + LanguageModel>(
    dir: &Path,
    model: &M,
    stepper: &Stepper,
    total: u64,
    device: &Device,
    save: Save<M>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let inference = model.valid();
    save(&inference, &dir.join("model"))?;
    let (b, t) = (stepper.tc.batch_size, stepper.sampler.seq_len());
    let mut ids = Vec::with_capacity(total as usize * b * t);
    let mut labels = Vec::with_capacity(ids.capacity());
    for step in 0..total {
        let batch = stepper.sampler.batch(step, b);
        ids.extend(batch.input_ids().into_iter().map(|x| x as i64));
        labels.extend(batch.labels());
    }
    let mask: Vec<i64> = labels.iter().map(|&l| (l != IGNORE_INDEX) as i64).collect();
    let shape = vec![total as usize, b, t];
    let mut tensors = BTreeMap::new();
    for (name, values) in [
        ("input_ids", ids.clone()),
        ("labels", labels),
        ("loss_mask", mask),
    ] {
        let data = TensorValues::I64(values);
        tensors.insert(
            name.to_string(),
            OwnedTensor {
                shape: shape.clone(),
                data,
            },
        );
    }
    write_safetensors(&dir.join("batches.safetensors"), &tensors, None)?;
    let first = TensorData::new(ids[..b * t].to_vec(), [b, t]);
    let tokens = Tensor::<2, Int>::from_data(first, device);
    let logits = inference.forward(tokens, &HookSpec::new())?.logits;
    let dims = logits.dims().to_vec();
    let values: Vec<f32> = logits
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| Error::Other(format!("reading logits back: {e:?}")))?;
    let mut out = BTreeMap::new();
    let data = TensorValues::F32(values);
    out.insert("logits".to_string(), OwnedTensor { shape: dims, data });
    write_safetensors(&dir.join("logits0.safetensors"), &out, None)
}

/// `DIR/train.json`: the optimiser, the learning rate of every exported step, the
/// threads, and the measured losses (`bench`).
fn export_settings(dir: &Path, file: &OrganismFile, bench: &TrainBench) -> Result<()> {
    let tc = &file.train;
    let total = bench.warmup + bench.steps;
    let json = serde_json::json!({
        "schema": "phaselens.bench_train_export/v1",
        "organism": file.organism.name,
        "optimizer": {
            "kind": "adamw",
            "beta1": BETA1,
            "beta2": tc.beta2,
            "epsilon": EPSILON,
            "weight_decay": tc.weight_decay,
            "weight_decay_on": "every parameter",
            "grad_clip": tc.grad_clip,
            "grad_clip_mode": "per-parameter L2 norm: g *= min(1, clip / (|g| + f32::MIN_POSITIVE))",
        },
        "loss": "mean cross-entropy over the positions where labels != -100",
        "lr": (0..total).map(|s| lr_at(tc, s)).collect::<Vec<f64>>(),
        "warmup": bench.warmup,
        "steps": bench.steps,
        "batch_size": bench.batch_size,
        "seq_len": bench.seq_len,
        "bench": bench,
    });
    write_atomic(&dir.join("train.json"), format!("{json:#}\n").as_bytes())
}
