//! The trained compressor of a `learned` overlay: its folder and the checks that it
//! belongs to the model and the overlay it is applied with.
//!
//! A folder holds two files, written by `phaselens train` on a `[compressor]` recipe
//! (`src/train/compressor/`):
//! - `compressor.safetensors`: per layer `l`, `blocks.{l}.key_gate.weight` and
//!   `blocks.{l}.value_gate.weight` (`[kv_heads * g, d_model]`, g = 1 for scalar
//!   gates, `d_head` for vector gates) and `blocks.{l}.key_gate_bias`,
//!   `blocks.{l}.value_gate_bias` (`[window, kv_heads]`, the per-offset bias);
//! - `compressor.json` ([`CompressorMeta`]), written last (so a folder whose json
//!   exists is complete): the shape of the compressor, the model it was trained on
//!   ([`ModelIdentity`]) and how it was trained.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::kvc::{CompressionConfig, GateMode, KvcConfig};

/// The file of the gate weights in a compressor folder.
pub const WEIGHTS_FILE: &str = "compressor.safetensors";
/// The description of a compressor folder.
pub const META_FILE: &str = "compressor.json";
/// The format tag of [`CompressorMeta`].
pub const FORMAT: &str = "phaselens-compressor/1";

/// What identifies the model a compressor was trained on: its architecture and every
/// dimension the gates depend on, plus the model file's name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// The architecture (`llama`, `gemma3`, `kvc`, ...).
    pub arch: String,
    /// Decoder layers.
    pub n_layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key-value heads.
    pub n_kv_heads: usize,
    /// Width of one head.
    pub d_head: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// The file name of the weights (a `.gguf` file or a folder's name).
    pub file: String,
}

impl ModelIdentity {
    /// The identity of a model of configuration `c` loaded from `path`.
    pub fn of(c: &KvcConfig, path: &Path) -> Self {
        ModelIdentity {
            arch: c.arch.name.clone().unwrap_or_else(|| "kvc".into()),
            n_layers: c.n_layers,
            d_model: c.d_model,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            d_head: c.d_head(),
            vocab_size: c.vocab_size,
            file: path
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        }
    }

    /// The first dimension in which `self` (the checkpoint's) differs from `model`'s,
    /// as `name: checkpoint vs model` (the file name is not compared: a model copied
    /// under another name is the same model).
    fn mismatch(&self, model: &ModelIdentity) -> Option<String> {
        let dims = [
            ("n_layers", self.n_layers, model.n_layers),
            ("d_model", self.d_model, model.d_model),
            ("n_heads", self.n_heads, model.n_heads),
            ("n_kv_heads", self.n_kv_heads, model.n_kv_heads),
            ("d_head", self.d_head, model.d_head),
            ("vocab_size", self.vocab_size, model.vocab_size),
        ];
        if self.arch != model.arch {
            return Some(format!("arch: {} vs {}", self.arch, model.arch));
        }
        dims.iter()
            .find(|(_, a, b)| a != b)
            .map(|(k, a, b)| format!("{k}: {a} vs {b}"))
    }
}

/// `compressor.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressorMeta {
    /// [`FORMAT`].
    pub format: String,
    /// The compressor's name (its recipe's `[compressor] name`).
    pub name: String,
    /// Tokens pooled into one entry.
    pub window: usize,
    /// Tokens between entries (the phase period).
    pub stride: usize,
    /// Raw tokens read beside the entries.
    pub local: usize,
    /// `scalar` or `vector` gates.
    pub gate: GateMode,
    /// The model it was trained on.
    pub model: ModelIdentity,
    /// Optimiser steps it was trained for.
    pub steps: u64,
    /// The steps its recipe asks for (more than `steps`: an export of an unfinished
    /// training with `--max-steps`).
    pub recipe_steps: u64,
    /// Tokens it was trained on.
    pub tokens_seen: u64,
    /// The mean distillation KL (nats per position) over the last logged steps.
    pub final_kl: f64,
    /// The recipe's hash (`phaselens train` refuses to resume another recipe's run).
    pub recipe_hash: String,
    /// The phaselens commit that trained it.
    pub phaselens_commit: String,
}

impl CompressorMeta {
    /// The kvc compression of this compressor.
    pub fn compression(&self) -> CompressionConfig {
        compression(self.window, self.stride, self.local, self.gate)
    }
}

/// The kvc compression of a pooling overlay: `gate` `uniform` is `pool` (the mean, no
/// parameter), `scalar` / `vector` is `learned` (softmax gates with a per-offset bias).
pub fn compression(
    window: usize,
    stride: usize,
    local: usize,
    gate: GateMode,
) -> CompressionConfig {
    CompressionConfig {
        window,
        stride,
        local_tail: local,
        gate,
        gate_bias: gate != GateMode::Uniform,
        window_offsets: Vec::new(),
    }
}

/// The folder of `checkpoint` (a path relative to the working directory, `~/` expanded).
pub fn folder(checkpoint: &str) -> PathBuf {
    crate::model::pretrained::expand_model_path(Path::new(checkpoint))
}

/// Read `compressor.json` of the folder `dir`, naming the key `compression.checkpoint`
/// when it is missing or unreadable.
pub fn read_meta(dir: &Path) -> Result<CompressorMeta> {
    let path = dir.join(META_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::field(
            "compression.checkpoint",
            format!(
                "{}: {e} (train one with `phaselens train` on a [compressor] recipe)",
                path.display()
            ),
        )
    })?;
    let meta: CompressorMeta = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: path.clone(),
        message: format!("not a phaselens compressor description: {e}"),
    })?;
    if meta.format != FORMAT {
        return Err(Error::Config {
            path,
            message: format!("format `{}`, expected `{FORMAT}`", meta.format),
        });
    }
    Ok(meta)
}

/// Check that a compressor described by `meta` fits an overlay of `window`, `stride`
/// and `local` and the model `model`: the error names the key that differs.
pub fn check(
    meta: &CompressorMeta,
    (window, stride, local): (usize, usize, usize),
    model: &ModelIdentity,
) -> Result<()> {
    for (key, overlay, trained) in [
        ("window", window, meta.window),
        ("stride", stride, meta.stride),
        ("local", local, meta.local),
    ] {
        if overlay != trained {
            return Err(Error::field(
                format!("compression.{key}"),
                format!(
                    "{overlay}, but the compressor `{}` was trained with {key} = {trained}",
                    meta.name
                ),
            ));
        }
    }
    if let Some(m) = meta.model.mismatch(model) {
        return Err(Error::field(
            "compression.checkpoint",
            format!(
                "the compressor `{}` was trained on another model ({}, file {}): {m} (checkpoint vs this model)",
                meta.name, meta.model.arch, meta.model.file
            ),
        ));
    }
    Ok(())
}
