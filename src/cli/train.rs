//! `phaselens train`: train (or resume) a model organism.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::train::{OrganismFile, TrainOptions, compressor, train};

/// Train a model organism, or a learned compressor on a frozen pretrained model, from
/// its TOML recipe; resumes from the latest checkpoint.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens train experiments/organisms/kvc-w8s8.toml
  phaselens train experiments/organisms/kvc-w8s8.toml --fresh        # ignore checkpoints
  phaselens train experiments/organisms/full-attn.toml --max-steps 50 # a quick look
  phaselens train experiments/compressors/smollm2-w16s8.toml         # a learned compressor

Checkpoints go to runs/<name>/checkpoints/step-NNNNNNN/ (every [train] checkpoint_every
steps; [organism] run_dir moves runs/<name>); an interrupted run (Ctrl-C, kill -9) resumes from
the latest one. The loss curve so far is runs/<name>/loss.arrow and loss.{png,svg}. The trained
model is written to the organism's model directory ([organism] model_dir, default <name>/ next
to the recipe), with training.json and its loss curve in <model dir>/training/loss.{arrow,png,svg}.
One training per organism at a time (runs/<name>/.lock). --fresh replaces the old checkpoints
when the first new one is saved.

A recipe with a [compressor] table trains the `learned` overlay's compressor on a frozen model
by self-distillation (docs/models.md, \"Training a learned compressor\"): the model's own
sampled text in runs/compressors/<name>/data/, checkpoints in runs/compressors/<name>/, the
trained compressor in <name>/ next to the recipe (compressor.safetensors, compressor.json).")]
pub struct TrainArgs {
    /// Organism recipe (TOML).
    pub recipe: PathBuf,
    /// Start from step 0 even if checkpoints exist.
    #[arg(long)]
    pub fresh: bool,
    /// Stop after this many steps in total (at least 1).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_steps: Option<u64>,
    /// Device: cpu, wgpu[:N], tch-cpu, tch-cuda:N, cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Skip the comparison of the training memory estimate (weights, optimizer state,
    /// one batch's activations) with the machine's available memory (also
    /// PHASELENS_NO_MEMORY_CHECK=1).
    #[arg(long)]
    pub no_memory_check: bool,
}

pub fn run(args: TrainArgs) -> Result<()> {
    if args.no_memory_check {
        phaselens::model::memory::set_override(true);
    }
    let text = std::fs::read_to_string(&args.recipe)
        .with_context(|| format!("reading {}", args.recipe.display()))?;
    if compressor::is_compressor_recipe(&text) {
        return run_compressor(&args);
    }
    let file = OrganismFile::load(&args.recipe)?;
    let device = args.device.device()?;
    let opts = TrainOptions {
        fresh: args.fresh,
        max_steps: args.max_steps,
        progress: true,
    };
    let s = train(&args.recipe, &file, &device, &opts)
        .with_context(|| format!("training {}", args.recipe.display()))?;
    if let Some(from) = s.resumed_from {
        eprintln!("resumed from step {from}");
    }
    let Some(last) = s.history.last() else {
        eprintln!(
            "no step to run: the training is at step {} already (--max-steps or [train] steps)",
            s.final_step
        );
        return Ok(());
    };
    let last = Some(last);
    eprintln!(
        "step {}: loss {:.4}, batch accuracy {:.3}{}",
        s.final_step,
        last.map_or(f64::NAN, |r| r.loss),
        last.map_or(f64::NAN, |r| r.accuracy),
        if s.final_step == file.train.steps {
            format!("; model written to {}", s.model_dir.display())
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `phaselens train` on a `[compressor]` recipe (a learned compressor distilled on a
/// frozen pretrained model).
fn run_compressor(args: &TrainArgs) -> Result<()> {
    let file = compressor::CompressorFile::load(&args.recipe)?;
    let device = args.device.device()?;
    let opts = TrainOptions {
        fresh: args.fresh,
        max_steps: args.max_steps,
        progress: true,
    };
    let s = compressor::train(&args.recipe, &file, &device, &opts)
        .with_context(|| format!("training {}", args.recipe.display()))?;
    if let Some(from) = s.resumed_from {
        eprintln!("resumed from step {from}");
    }
    match s.history.last() {
        None => eprintln!(
            "no step to run: the training is at step {} already",
            s.final_step
        ),
        Some(last) => eprintln!(
            "step {}: KL {:.4} nats/position, top-1 agreement with the uncompressed model {:.3}; compressor at step {} of {} written to {}",
            s.final_step,
            last.loss,
            last.accuracy,
            s.final_step,
            file.train.steps,
            s.model_dir.display()
        ),
    }
    Ok(())
}
