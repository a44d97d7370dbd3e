//! The organism TOML: what to build, what to train it on, and how.
//!
//! ```toml
//! [organism]
//! name = "kvc-w8s8"
//! description = "W = S = 8, one KV head"
//! # model_dir = "kvc-w8s8"          # default: <name>, next to this file
//! # run_dir = "../../runs/kvc-w8s8"  # default: runs/<name> at the repo root (checkpoints)
//!
//! [model]        # a kvc config.json, as TOML (see docs/models.md)
//! [task.vocab]   # the token space (see docs/prompt_format.md)
//! [task.train]   # the training prompt sampler
//! [train]        # optimisation (fields below)
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::KvcConfig;
use crate::model::deepseek_v4::DeepseekV4Config;
use crate::tasks::{KvTrainConfig, TokenSpaceConfig};
use crate::toml_file::parse_toml;

/// `[organism]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrganismSection {
    /// The organism's name.
    pub name: String,
    /// What it is for (free text).
    #[serde(default)]
    pub description: String,
    /// Where the trained model directory goes (relative to the TOML's folder).
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
    /// Where checkpoints go (relative to the TOML's folder).
    #[serde(default)]
    pub run_dir: Option<PathBuf>,
}

/// `[task]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    /// The token space.
    #[serde(default)]
    pub vocab: TokenSpaceConfig,
    /// The training task (prompt format, period, sampling).
    #[serde(default)]
    pub train: KvTrainConfig,
}

/// `[train]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimiser steps.
    pub steps: u64,
    /// Prompts per step.
    pub batch_size: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Final learning rate as a fraction of `lr` (cosine decay).
    pub min_lr_ratio: f64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f32,
    /// AdamW beta2.
    pub beta2: f32,
    /// Gradient clipping by global norm.
    pub grad_clip: f32,
    /// Init seed.
    pub seed: u64,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
    /// Checkpoints kept on disk.
    pub keep_checkpoints: usize,
    /// A trained model directory (`config.json` + `model.safetensors`, relative to the
    /// recipe's folder) whose weights start the run instead of a random init, with a
    /// fresh optimizer at step 0: fine-tuning and length curricula. Its architecture
    /// must be the recipe's `[model]` (a missing or misshapen tensor is an error).
    /// Default: none (random init). Not serialised when unset, so recipes without it
    /// keep their config hash.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
    /// Parameters of `init` that may be tiled along their first axis when the recipe's
    /// `[model]` asks for a multiple of the stored rows: each entry names a parameter or
    /// a name suffix after a `.` (`"position_bias"` matches every compressor's and
    /// indexer's `position_bias`). Row `i` of the new tensor is row `i mod r` of the
    /// stored one, so a compressor trained at rate `r` starts a rate `k r` model with
    /// its per-offset biases repeated `k` times (a warm start; the pooled windows still
    /// differ). Needs `init`. Default: none (every tensor must fit exactly). Not
    /// serialised when empty, so recipes without it keep their config hash.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub init_tile: Vec<String>,
    /// Weight of the lightning-indexer distillation loss (DeepSeek-V4 CSA layers;
    /// `super::distill`): each CSA layer's indexer is trained towards the main
    /// attention's distribution over the entries it selected, with its inputs detached,
    /// so this loss trains the indexers alone. 0 (the default): no distillation, and
    /// then the indexer gets no gradient at all (its top-k passes none). Not serialised
    /// when 0, so recipes without it keep their config hash.
    #[serde(skip_serializing_if = "is_zero")]
    pub indexer_distill: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 3000,
            batch_size: 32,
            lr: 3e-3,
            warmup_steps: 100,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            beta2: 0.99,
            grad_clip: 1.0,
            seed: 0,
            checkpoint_every: 250,
            keep_checkpoints: 2,
            init: None,
            init_tile: Vec::new(),
            indexer_distill: 0.0,
        }
    }
}

impl TrainConfig {
    /// Reject impossible settings; the message starts with the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (key, v) in [
            ("steps", self.steps),
            ("batch_size", self.batch_size as u64),
            ("checkpoint_every", self.checkpoint_every),
            ("keep_checkpoints", self.keep_checkpoints as u64),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        let finite = |key: &str, v: f64| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{key} must be a finite number, got {v}"))
            }
        };
        finite("lr", self.lr)?;
        finite("min_lr_ratio", self.min_lr_ratio)?;
        finite("weight_decay", self.weight_decay as f64)?;
        finite("beta2", self.beta2 as f64)?;
        finite("grad_clip", self.grad_clip as f64)?;
        finite("indexer_distill", self.indexer_distill)?;
        if !self.init_tile.is_empty() && self.init.is_none() {
            return Err(format!(
                "init_tile = {:?} needs `init` (a trained model whose tensors are tiled)",
                self.init_tile
            ));
        }
        if let Some(bad) = self.init_tile.iter().find(|p| p.is_empty()) {
            return Err(format!(
                "init_tile: an empty name ({bad:?}) matches nothing"
            ));
        }
        if self.indexer_distill < 0.0 {
            return Err(format!(
                "indexer_distill must be >= 0 (a loss weight), got {}",
                self.indexer_distill
            ));
        }
        if self.lr <= 0.0 {
            return Err(format!("lr must be > 0, got {}", self.lr));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(format!(
                "min_lr_ratio must be in 0..=1 (a fraction of lr), got {}",
                self.min_lr_ratio
            ));
        }
        if self.weight_decay < 0.0 {
            return Err(format!(
                "weight_decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if !(self.beta2 > 0.0 && self.beta2 < 1.0) {
            return Err(format!("beta2 must be in (0, 1), got {}", self.beta2));
        }
        if self.grad_clip <= 0.0 {
            return Err(format!("grad_clip must be > 0, got {}", self.grad_clip));
        }
        if self.batch_size > MAX_BATCH_SIZE {
            return Err(format!(
                "batch_size {} is more than {MAX_BATCH_SIZE} prompts per step",
                self.batch_size
            ));
        }
        if self.keep_checkpoints > 10_000 {
            return Err(format!(
                "keep_checkpoints {} is more than 10000",
                self.keep_checkpoints
            ));
        }
        Ok(())
    }
}

/// The most prompts per training step (the batch's activations are held for the
/// backward pass; the memory check refuses smaller batches that do not fit too).
pub const MAX_BATCH_SIZE: usize = 1 << 20;

/// `[model]`: a kvc config (`model_type = "phaselens-kvc"`) or a DeepSeek-V4 config in
/// transformers' config.json form (`model_type = "deepseek_v4"`).
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
// A kvc config carries the pretrained architectures' options inline; one value per
// recipe, so its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum ModelConfig {
    /// The kvc family (`model_type = "phaselens-kvc"`).
    Kvc(KvcConfig),
    /// The config.json fields as written (saved verbatim with the trained model) and
    /// their resolved form.
    DeepseekV4 {
        /// The fields as written.
        json: serde_json::Value,
        /// Resolved (defaults filled in, validated).
        #[serde(skip)]
        resolved: Box<DeepseekV4Config>,
    },
}

impl ModelConfig {
    /// The vocabulary size.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Kvc(c) => c.vocab_size,
            ModelConfig::DeepseekV4 { resolved, .. } => resolved.vocab_size,
        }
    }
}

/// A whole organism file.
#[derive(Debug, Clone, Serialize)]
pub struct OrganismFile {
    /// `[organism]`: name and folders.
    pub organism: OrganismSection,
    /// `[model]`: the architecture and its configuration.
    pub model: ModelConfig,
    /// `[task]`: vocabulary and training task.
    pub task: TaskSection,
    /// `[train]`: steps, batch, optimiser, schedule.
    pub train: TrainConfig,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Doc<M> {
    organism: OrganismSection,
    model: M,
    #[serde(default = "default_task")]
    task: TaskSection,
    #[serde(default)]
    train: TrainConfig,
}

#[derive(Deserialize)]
struct ModelType {
    model: ModelTypeInner,
}

#[derive(Deserialize)]
struct ModelTypeInner {
    model_type: Option<String>,
}

fn default_task() -> TaskSection {
    TaskSection {
        vocab: TokenSpaceConfig::default(),
        train: KvTrainConfig::default(),
    }
}

impl OrganismFile {
    /// Read and validate an organism TOML.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, &text)
    }

    /// Parse and validate organism TOML `text`; errors name `path` (the file the text
    /// is, or will be, at).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        // A malformed file is a syntax error at its line and column, not a missing key.
        parse_toml::<toml::Table>(path, text)?;
        crate::toml_file::expect_kind(path, text, crate::toml_file::FileKind::Recipe)?;
        let bad = |m: String| Error::Config {
            path: path.to_path_buf(),
            message: m,
        };
        // First pass: which architecture; second pass: the whole file with line numbers.
        let kind = toml::from_str::<ModelType>(text)
            .ok()
            .and_then(|m| m.model.model_type)
            .ok_or_else(|| {
                bad("[model] needs model_type = \"phaselens-kvc\" or \"deepseek_v4\"".into())
            })?;
        let f = match kind.as_str() {
            crate::model::kvc::MODEL_TYPE => {
                let d: Doc<KvcConfig> = parse_toml(path, text)?;
                d.model
                    .validate()
                    .map_err(|e| bad(format!("[model]: {e}")))?;
                OrganismFile {
                    organism: d.organism,
                    model: ModelConfig::Kvc(d.model),
                    task: d.task,
                    train: d.train,
                }
            }
            crate::model::deepseek_v4::MODEL_TYPE => {
                let d: Doc<serde_json::Value> = parse_toml(path, text)?;
                let raw = serde_json::from_value(d.model.clone())
                    .map_err(|e| bad(format!("[model]: {e}")))?;
                let resolved =
                    DeepseekV4Config::resolve(&raw).map_err(|e| bad(format!("[model]: {e}")))?;
                resolved
                    .validate()
                    .map_err(|e| bad(format!("[model]: {e}")))?;
                OrganismFile {
                    organism: d.organism,
                    model: ModelConfig::DeepseekV4 {
                        json: d.model,
                        resolved: Box::new(resolved),
                    },
                    task: d.task,
                    train: d.train,
                }
            }
            other => {
                return Err(bad(format!(
                    "[model] model_type \"{other}\" cannot be trained (allowed: \"phaselens-kvc\", \"deepseek_v4\")"
                )));
            }
        };
        if let Err(m) = crate::output::check_output_name(&f.organism.name) {
            return Err(bad(format!("[organism] name: {m}")));
        }
        f.train
            .validate()
            .map_err(|m| bad(format!("[train] {m}")))?;
        if f.train.indexer_distill > 0.0 && f.distill_layers().is_empty() {
            return Err(bad(format!(
                "[train] indexer_distill = {}: the model has no lightning indexer to distil (a DeepSeek-V4 \"compressed_sparse_attention\" layer)",
                f.train.indexer_distill
            )));
        }
        Ok(f)
    }

    /// The layers whose indexers `[train] indexer_distill` trains: the CSA layers of a
    /// DeepSeek-V4 model when the weight is above 0, else none.
    pub fn distill_layers(&self) -> Vec<usize> {
        match &self.model {
            ModelConfig::DeepseekV4 { resolved, .. } if self.train.indexer_distill > 0.0 => {
                resolved
                    .layer_types
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| **t == crate::model::deepseek_v4::config::AttnType::Csa)
                    .map(|(i, _)| i)
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    fn base(path: &Path) -> PathBuf {
        path.parent().unwrap_or(Path::new(".")).to_path_buf()
    }

    /// The trained model directory.
    pub fn model_dir(&self, path: &Path) -> PathBuf {
        Self::base(path).join(
            self.organism
                .model_dir
                .clone()
                .unwrap_or_else(|| self.organism.name.clone().into()),
        )
    }

    /// The model directory `[train] init` names (relative to the recipe's folder).
    pub fn init_dir(&self, path: &Path) -> Option<PathBuf> {
        self.train.init.as_ref().map(|p| Self::base(path).join(p))
    }

    /// The checkpoint directory.
    pub fn run_dir(&self, path: &Path) -> PathBuf {
        match &self.organism.run_dir {
            Some(r) => Self::base(path).join(r),
            None => PathBuf::from("runs").join(&self.organism.name),
        }
    }
}
