//! `phaselens forward`: run a model on token ids, write logits and captured activations.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::hooks::{HookSpec, PointPattern};
use phaselens::model::load_model_as;
use phaselens::model::safetensors_io::{OwnedTensor, TensorValues, write_safetensors};

/// Run a model on token ids and save logits plus captured activations.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens forward --model experiments/organisms/kvc-w8s8 --input ids.json --out out.safetensors
  phaselens forward --model DIR --input ids.json --out out.safetensors \\
      --capture 'blocks.*.attn.hook_z' --capture hook_embed

IDS.json is a JSON array of equal-length arrays of token ids, e.g. [[1, 5, 9], [1, 7, 3]].
OUT holds `logits` (f32, [batch, pos, vocab]) and each captured activation under its hook
name (f32). `phaselens hooks` lists the hook points and their shapes. Every --capture pattern
must match at least one hook point of the model (a typo is an error naming it). Logits with
NaN or infinities are an error naming the first hook point that went non-finite. The
weights and the input's activations are checked against the available memory first
(--no-memory-check skips that).")]
pub struct ForwardArgs {
    /// Model directory (config.json + model.safetensors, or shards + index).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// JSON file with a batch of token-id sequences.
    #[arg(long, value_name = "IDS.json")]
    pub input: PathBuf,
    /// Output safetensors file.
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,
    /// Hook point name or glob to capture (repeatable).
    #[arg(long, value_name = "PATTERN")]
    pub capture: Vec<String>,
    /// Device: cpu, wgpu[:N], tch-cpu, tch-cuda:N, cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// BF16 / FP8 / FP4 checkpoint weights: `stored` (resident as in the checkpoint,
    /// dequantised where used) or `f32` (dequantised on load, 4 bytes per weight).
    #[arg(long, value_name = "stored|f32", default_value = "stored")]
    pub weights: phaselens::model::stored::Residency,
    /// Compute dtype of the matrix products: `f32` (parity with transformers' f32
    /// forward) or `bf16` (bf16 operands, f32 sums, bf16 result; the rest f32).
    #[arg(long, value_name = "f32|bf16", default_value = "f32")]
    pub dtype: phaselens::model::ComputeDtype,
    /// Skip the comparison of the memory estimate (weights, the forward's activations)
    /// with the machine's available memory (also PHASELENS_NO_MEMORY_CHECK=1).
    #[arg(long)]
    pub no_memory_check: bool,
    /// A training-free compression overlay inside attention, e.g.
    /// `kind=select,block=8,top_k=4,window=32` or `kind=pool,window=8,stride=8,local=32`
    /// (the keys of `[model.compression]`, docs/experiments.md).
    #[arg(long, value_name = "kind=...,key=value")]
    pub compression: Option<phaselens::model::compression::Overlay>,
}

/// Parse IDS.json: equal-length rows of ids below `vocab`.
pub fn read_ids(path: &Path, vocab: usize) -> Result<(Vec<i64>, [usize; 2])> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let rows: Vec<Vec<i64>> = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected a JSON array of arrays of token ids, e.g. [[1, 2, 3]]",
            path.display()
        )
    })?;
    if rows.is_empty() || rows[0].is_empty() {
        bail!("{}: the batch is empty", path.display());
    }
    let len = rows[0].len();
    let mut flat = Vec::with_capacity(rows.len() * len);
    for (r, row) in rows.iter().enumerate() {
        if row.len() != len {
            bail!(
                "{}: ragged input: row {r} has {} ids but row 0 has {len} (rows must have equal length)",
                path.display(),
                row.len()
            );
        }
        for (c, &id) in row.iter().enumerate() {
            if id < 0 || id as usize >= vocab {
                bail!(
                    "{}: row {r}, position {c}: token id {id} is out of the vocabulary 0..{vocab}",
                    path.display()
                );
            }
        }
        flat.extend_from_slice(row);
    }
    Ok((flat, [rows.len(), len]))
}

/// The logits and every captured activation, by name, as f32 tensors to write.
fn output_tensors(out: phaselens::model::ForwardOutput) -> BTreeMap<String, OwnedTensor> {
    let mut tensors = BTreeMap::new();
    let logits = out.logits;
    tensors.insert(
        "logits".to_string(),
        OwnedTensor {
            shape: logits.dims().to_vec(),
            data: TensorValues::F32(
                logits
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .expect("f32"),
            ),
        },
    );
    for (p, a) in out.cache.iter() {
        tensors.insert(
            p.to_string(),
            OwnedTensor {
                shape: a.shape().to_vec(),
                data: TensorValues::F32(a.to_vec()),
            },
        );
    }
    tensors
}

pub fn run(args: ForwardArgs) -> Result<()> {
    if args.no_memory_check {
        phaselens::model::memory::set_override(true);
    }
    let device = args.device.device()?;
    args.dtype
        .check_device(&device, &args.device.to_string())
        .map_err(anyhow::Error::msg)?;
    let _compute = phaselens::model::precision::scoped(args.dtype);
    let model = load_model_as(
        &args.model,
        &device,
        args.weights,
        args.compression.as_ref(),
    )
    .with_context(|| format!("loading model {}", args.model.display()))?;
    let info = model.info();
    let (ids, shape) = read_ids(&args.input, info.vocab_size)?;
    let mut spec = HookSpec::new();
    let mut patterns = Vec::new();
    for c in &args.capture {
        spec = spec.capture(c)?;
        patterns.push(PointPattern::new(c)?);
    }
    phaselens::model::memory::check_forward(
        &info,
        shape[0],
        shape[1],
        &format!(
            "--input {} ({} x {} ids)",
            args.input.display(),
            shape[0],
            shape[1]
        ),
    )?;
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, shape), &device);
    let out = model.forward(tokens.clone(), &spec)?;
    // Every pattern must match something, even when another one does: a typo must
    // not go unnoticed behind a pattern that worked.
    for (c, pat) in args.capture.iter().zip(&patterns) {
        if !out.cache.iter().any(|(p, _)| pat.matches_point(p)) {
            bail!(
                "--capture `{c}` matched no hook point of this model (run `phaselens hooks` for the names; per-layer points need `blocks.<l>.` or `blocks.*.`)"
            );
        }
    }
    if !phaselens::model::diagnose::all_finite(&out.logits)? {
        return Err(phaselens::model::diagnose::non_finite_error(
            model.as_ref(),
            tokens,
            "the logits hold NaN or infinite values",
        )
        .into());
    }
    let tensors = output_tensors(out);
    let captured = tensors.len() - 1;
    write_safetensors(&args.out, &tensors, None)?;
    eprintln!(
        "wrote {} (logits {:?}, {captured} captured activation(s))",
        args.out.display(),
        tensors["logits"].shape
    );
    Ok(())
}
