//! Models. Every architecture speaks the same interface: `forward(tokens, &HookSpec)
//! -> (logits, cache)`, plus `forward_from(layer, resid)` for batched interventions.

pub mod deepseek_v4;
pub mod kvc;
pub mod layers;
pub mod safetensors_io;
pub mod topk;
pub mod weights;

use std::path::Path;

use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hooks::{Act, ActivationCache, HookSpec};

pub use kvc::{KvcConfig, KvcModel};

/// What a forward pass returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[batch, pos, vocab]`
    pub logits: Tensor<3>,
    /// The captured activations.
    pub cache: ActivationCache,
}

/// The attention geometry of one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LayerKind {
    /// Causal attention over every raw token.
    Full,
    /// Sliding-window attention over the last `window` raw tokens.
    Sliding { window: usize },
    /// Chunk-compressed attention: windows of `window` tokens every `stride` tokens,
    /// plus `local_tail` raw tokens. Phase = position mod `stride`.
    Compressed {
        window: usize,
        stride: usize,
        local_tail: usize,
    },
}

impl LayerKind {
    /// The compression stride, if the layer compresses.
    pub fn stride(&self) -> Option<usize> {
        match self {
            LayerKind::Compressed { stride, .. } => Some(*stride),
            _ => None,
        }
    }
}

/// One layer's description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub n_heads: usize,
    pub n_kv_heads: usize,
}

/// Static facts about a model that runners check experiments against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub arch: String,
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_head: usize,
    pub layers: Vec<LayerSpec>,
}

impl ModelInfo {
    /// Number of blocks.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// The distinct compression strides, sorted.
    pub fn strides(&self) -> Vec<usize> {
        let mut s: Vec<usize> = self.layers.iter().filter_map(|l| l.kind.stride()).collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    /// Whether any layer compresses.
    pub fn compressed(&self) -> bool {
        !self.strides().is_empty()
    }
}

/// What a base forward leaves behind so that later forwards of the same prompts can
/// recompute only their last positions ([`LanguageModel::forward_suffix`]): the
/// per-layer, per-token state the attention of later positions reads (for kvc: keys,
/// values and compressor gate logits). Its content is the model's own.
pub struct PrefixState {
    rows: usize,
    len: usize,
    inner: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for PrefixState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PrefixState {{ rows: {}, len: {} }}",
            self.rows, self.len
        )
    }
}

impl PrefixState {
    /// Wrap a model's state of `rows` prompts of `len` tokens.
    pub fn new<T: std::any::Any + Send + Sync>(rows: usize, len: usize, inner: T) -> Self {
        PrefixState {
            rows,
            len,
            inner: Box::new(inner),
        }
    }

    /// Number of prompts.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens per prompt.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the state holds no prompt.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The model's own content.
    pub fn inner<T: std::any::Any>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }

    /// The content for a suffix forward: an error unless it is a `T` (made by an
    /// `arch` model) and `suffix` fits the state's prompts ([`Suffix::check`]).
    pub fn for_suffix<T: std::any::Any>(&self, suffix: &Suffix, arch: &str) -> Result<&T> {
        let inner = self.inner::<T>().ok_or_else(|| {
            Error::Input(format!("the prefix state was not made by a {arch} model"))
        })?;
        suffix.check(self.rows, self.len)?;
        Ok(inner)
    }
}

/// Which positions a [`LanguageModel::forward_suffix`] recomputes: batch row `r` is
/// prompt `rows[r]` of the [`PrefixState`], at positions `from[r] .. from[r] + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suffix {
    pub rows: Vec<usize>,
    pub from: Vec<usize>,
    pub len: usize,
}

impl Suffix {
    /// The recomputed positions, row-major `[rows * len]`.
    pub fn positions(&self) -> Vec<usize> {
        self.from.iter().flat_map(|&f| f..f + self.len).collect()
    }

    /// `[rows * total]`: for every (row, position) of the full sequence, its index in
    /// `cat([state rows * total, recomputed rows * len])`: the recomputed value where the
    /// row recomputes that position, the state's elsewhere ([`merge_positions`]).
    pub fn merge_index(&self, total: usize) -> Vec<usize> {
        let (b, l) = (self.rows.len(), self.len);
        let mut merge = Vec::with_capacity(b * total);
        for (r, &f) in self.from.iter().enumerate() {
            merge.extend((0..total).map(|p| {
                if p >= f && p < f + l {
                    b * total + r * l + (p - f)
                } else {
                    r * total + p
                }
            }));
        }
        merge
    }

    /// Check the suffix against a state of `rows` prompts of `total` tokens.
    pub fn check(&self, rows: usize, total: usize) -> Result<()> {
        if self.rows.len() != self.from.len() || self.rows.is_empty() || self.len == 0 {
            return Err(Error::Input(format!(
                "suffix: {} rows, {} start positions, length {}",
                self.rows.len(),
                self.from.len(),
                self.len
            )));
        }
        for (&r, &f) in self.rows.iter().zip(&self.from) {
            if r >= rows {
                return Err(Error::Input(format!(
                    "suffix row {r} out of range 0..{rows}"
                )));
            }
            if f + self.len > total {
                return Err(Error::Input(format!(
                    "suffix positions {f}..{} run past the prompt length {total}",
                    f + self.len
                )));
            }
        }
        Ok(())
    }
}

/// `base: [b, total, ...]` with each row's recomputed positions taken from `new: [b,
/// len, ...]`, through a [`Suffix::merge_index`] tensor.
pub fn merge_positions<const D: usize>(
    base: Tensor<D>,
    new: Tensor<D>,
    index: &Tensor<1, Int>,
) -> Tensor<D> {
    let dims = base.dims();
    let (b, t, l) = (dims[0], dims[1], new.dims()[1]);
    let per: usize = dims[2..].iter().product();
    Tensor::cat(
        vec![base.reshape([b * t, per]), new.reshape([b * l, per])],
        0,
    )
    .select(0, index.clone())
    .reshape(dims)
}

/// The interface every model implements.
pub trait LanguageModel: Send + Sync {
    /// Static description.
    fn info(&self) -> ModelInfo;
    /// The device the weights live on.
    fn device(&self) -> Device;
    /// `[batch, pos]` token ids -> logits and captured activations.
    fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput>;
    /// Run from block `start` given the residual stream entering it (the activation
    /// captured at `blocks.{start}.hook_resid_pre`). `tokens` are needed by models whose
    /// layers read token ids (hash routing).
    fn forward_from(
        &self,
        tokens: Tensor<2, Int>,
        start: usize,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput>;
    /// Number of parameters (values held in the compute dtype), when known.
    fn n_params(&self) -> Option<usize> {
        None
    }
    /// [`forward`](Self::forward), also returning the state that
    /// [`forward_suffix`](Self::forward_suffix) needs (`None`: the model has no
    /// suffix path).
    fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, Option<PrefixState>)> {
        Ok((self.forward(tokens, spec)?, None))
    }
    /// Run blocks `start..` over only the positions `suffix` names, given the residual
    /// entering block `start` at those positions (`[rows, len, ...]`) and the state of a
    /// base forward for every other position. When nothing upstream of block `start`
    /// differs from the base forward and the hooks edit only those positions, the
    /// logits (`[rows, len, vocab]`) are those of a full `forward_from` at the same
    /// positions, up to float rounding: earlier positions are causally unaffected, so
    /// their keys and values are the base run's. Hooks see suffix-shaped activations
    /// at per-token points (positions `0..len` = `from[r]..from[r]+len`).
    fn forward_suffix(
        &self,
        start: usize,
        state: &PrefixState,
        suffix: &Suffix,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        let _ = (start, state, suffix, resid, spec);
        Err(Error::Other(format!(
            "{} models have no suffix forward",
            self.info().arch
        )))
    }
}

/// Read a model directory's `config.json` as JSON, with file-named errors.
pub fn read_config_json(dir: &Path) -> Result<(std::path::PathBuf, String, serde_json::Value)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: path.clone(),
        message: format!("not valid JSON: {e}"),
    })?;
    Ok((path, text, json))
}

/// Load a kvc model directory (`config.json` + `model.safetensors`).
pub fn load_kvc(dir: &Path, device: &Device) -> Result<KvcModel> {
    let (path, text, _) = read_config_json(dir)?;
    let config = KvcConfig::from_json(&text).map_err(|m| Error::Config {
        path: path.clone(),
        message: m,
    })?;
    let src = weights::CheckpointSource::open_dir(dir)?;
    let model = KvcModel::new(&config, &weights::Vb::new(&src, device))?;
    src.check_all_used()?;
    Ok(model)
}

/// Save a kvc model as `dir/config.json` + `dir/model.safetensors` (atomic writes).
pub fn save_kvc(model: &KvcModel, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let json = serde_json::to_string_pretty(&model.config).expect("config serialises");
    let config = model.config.clone();
    weights::save_by_builder_names(
        model,
        &|vb| KvcModel::new(&config, vb),
        &model.device(),
        &dir.join("model.safetensors"),
        Default::default(),
    )?;
    safetensors_io::write_atomic(&dir.join("config.json"), format!("{json}\n").as_bytes())
}

/// Load any supported model directory, dispatching on `config.json`'s `model_type`.
pub fn load_model(dir: &Path, device: &Device) -> Result<Box<dyn LanguageModel>> {
    let (path, _, json) = read_config_json(dir)?;
    match json["model_type"].as_str() {
        Some(kvc::MODEL_TYPE) => Ok(Box::new(load_kvc(dir, device)?)),
        Some(deepseek_v4::MODEL_TYPE) => Ok(Box::new(deepseek_v4::load(dir, device)?)),
        Some(other) => Err(Error::Config {
            path,
            message: format!(
                "unsupported model_type \"{other}\" (supported: \"{}\", \"{}\")",
                kvc::MODEL_TYPE,
                deepseek_v4::MODEL_TYPE
            ),
        }),
        None => Err(Error::Config {
            path,
            message: "no `model_type` field".into(),
        }),
    }
}
