//! Models. Every architecture speaks the same interface: `forward(tokens, &HookSpec)
//! -> (logits, cache)`, plus `forward_from(layer, resid)` for batched interventions.

// The face: the items below, [`kvc`] (the controlled family) and [`placement`].
pub mod kvc;
pub mod placement;

pub(crate) mod grad;
pub(crate) mod kv_state;
pub(crate) mod topk;

#[doc(hidden)] // the layers of the models' public weight fields (`Linear`, `RmsNorm`, ...)
pub mod layers;

// Public for the CLI and tests/it, not part of the face:
#[doc(hidden)] // the blocked attention core: tests/it set and read its block budget
pub mod attention;
#[doc(hidden)] // `phaselens bench forward`
pub mod bench;
/// Training-free chunked-compression overlays (`select`, `pool`) for kvc-family models.
pub mod compression;
#[doc(hidden)] // DeepSeek-V4 (load it with `load_model`); tests/it check its parts
pub mod deepseek_v4;
#[doc(hidden)] // the CLI's non-finite checks
pub mod diagnose;
/// Matrix-product FLOPs counted while benchmarking.
pub mod flops;
/// Greedy decoding from a prompt (`phaselens generate`).
pub mod generate;
/// GGUF files: metadata, the tensor directory, ggml's block formats dequantised to f32.
pub mod gguf;
/// Host kernels on flex's f32 buffers, over every core.
pub mod host;
#[doc(hidden)] // upfront memory checks: the CLI sets and prints them, tests/it compare them
pub mod memory;
#[doc(hidden)] // `phaselens plan`
pub mod plan;
/// The compute dtype of the matrix products (`--dtype f32|bf16`).
pub mod precision;
/// Pretrained checkpoints (GGUF, Hugging Face folders) of the Llama family and Gemma 3.
pub mod pretrained;
/// Matrix products on flex's f32 buffers, split over every core.
#[cfg(feature = "flex")]
pub mod products;
/// Time per stage of a forward (`bench forward --stages`).
pub mod profile;
#[doc(hidden)] // streaming safetensors reads and writes (the CLI, tests/it's fixtures)
pub mod safetensors_io;
#[doc(hidden)] // stored (BF16/FP8/FP4) weights; tests/it read its dequantisation budget
pub mod stored;
#[doc(hidden)] // building a model from a checkpoint or random init (tests/it's tiny models)
pub mod weights;

use std::path::Path;

use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hooks::{Act, ActivationCache, HookSpec};

pub use kv_state::{PrefixState, Queries, Suffix};
pub use kvc::{KvcConfig, KvcModel};
pub use precision::ComputeDtype;
pub use stored::Residency;

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
    Sliding {
        /// Raw tokens a query sees (itself included).
        window: usize,
    },
    /// Chunk-compressed attention: windows of `window` tokens every `stride` tokens,
    /// plus `local_tail` raw tokens. Phase = position mod `stride`.
    Compressed {
        /// Tokens pooled into one entry.
        window: usize,
        /// Tokens between the starts of consecutive entries.
        stride: usize,
        /// Raw tokens beside the entries.
        local_tail: usize,
    },
    /// Block selection (the `select` overlay): each query reads the raw tokens of its
    /// `top_k` best blocks of `block` tokens plus the last `window` tokens. Phase =
    /// (position - offset) mod `block`.
    Selected {
        /// Tokens per block.
        block: usize,
        /// Blocks kept per query.
        top_k: usize,
        /// Raw tokens always read.
        window: usize,
    },
}

/// Words for messages: `full attention`, `sliding window 128`,
/// `compressed (window 8, stride 8, local tail 4)`.
impl std::fmt::Display for LayerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerKind::Full => write!(f, "full attention"),
            LayerKind::Sliding { window } => write!(f, "sliding window {window}"),
            LayerKind::Compressed {
                window,
                stride,
                local_tail,
            } => write!(
                f,
                "compressed (window {window}, stride {stride}, local tail {local_tail})"
            ),
            LayerKind::Selected {
                block,
                top_k,
                window,
            } => write!(
                f,
                "block selection (block {block}, top {top_k}, window {window})"
            ),
        }
    }
}

impl LayerKind {
    /// The compression stride, if the layer compresses.
    pub fn stride(&self) -> Option<usize> {
        match self {
            LayerKind::Compressed { stride, .. } => Some(*stride),
            LayerKind::Selected { block, .. } => Some(*block),
            _ => None,
        }
    }
}

/// One layer's description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    /// Its attention geometry.
    pub kind: LayerKind,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
}

/// Static facts about a model that runners check experiments against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The architecture (`model_type`: `phaselens-kvc`, `deepseek_v4`).
    pub arch: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// Query heads per layer.
    pub n_heads: usize,
    /// Key/value heads per layer.
    pub n_kv_heads: usize,
    /// Head width.
    pub d_head: usize,
    /// Parallel residual streams (DeepSeek-V4's `hc_mult`; 1 for a plain residual):
    /// `hook_resid_*` holds `streams x d_model` values per token.
    #[serde(default = "one_stream")]
    pub streams: usize,
    /// Every layer, in order.
    pub layers: Vec<LayerSpec>,
}

fn one_stream() -> usize {
    1
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

    /// How the model's compressed entries sit on the token axis: at the end of their
    /// window (DeepSeek-V4) or at its start (kvc).
    pub fn entry_align(&self) -> crate::analysis::EntryAlign {
        if self.arch == deepseek_v4::MODEL_TYPE {
            crate::analysis::EntryAlign::End
        } else {
            crate::analysis::EntryAlign::Start
        }
    }
}

/// Where a node reads the residual stream (edge attribution's local pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StreamPoint {
    /// The stream entering block `l` (`blocks.{l}.hook_resid_pre`): read by the
    /// layer's attention inputs (q, k, v, compressed entries).
    Attn(usize),
    /// The stream after block `l`'s attention (`blocks.{l}.hook_resid_mid`): read by
    /// its MLP / MoE.
    Mlp(usize),
    /// The stream after the last block (its `hook_resid_post`): read by the head.
    Final,
}

impl StreamPoint {
    /// Index into [`StreamModel::stream_from_outputs`]' list: `Attn(l)` 2l, `Mlp(l)`
    /// 2l + 1, `Final` 2 n_layers.
    pub fn index(self, n_layers: usize) -> usize {
        match self {
            StreamPoint::Attn(l) => 2 * l,
            StreamPoint::Mlp(l) => 2 * l + 1,
            StreamPoint::Final => 2 * n_layers,
        }
    }
}

/// What [`StreamModel::read_stream`] returns.
pub struct StreamRead {
    /// `Final`: the logits `[batch, pos, vocab]`; `None` elsewhere.
    pub logits: Option<Tensor<3>>,
    /// The activations the spec captured.
    pub cache: ActivationCache,
}

/// The per-layer outputs a [`StreamModel`] method was given: one attention and one MLP
/// (`mlp`: "MLP" or "MoE") output per layer (`unit`: "blocks" or "layers"), else an
/// input error naming both counts.
pub(crate) fn check_stream_outputs(
    n_layers: usize,
    (mlp, unit): (&str, &str),
    attn_out: &[Tensor<3>],
    mlp_out: &[Tensor<3>],
) -> Result<()> {
    if attn_out.len() != n_layers || mlp_out.len() != n_layers {
        return Err(Error::Input(format!(
            "{} attention and {} {mlp} outputs for {n_layers} {unit}",
            attn_out.len(),
            mlp_out.len()
        )));
    }
    Ok(())
}

/// The residual stream as edge attribution sees it: what reads it at each point, and
/// how it is made from the block outputs. With these, the direct-path derivative of
/// every edge comes from local vector-Jacobian products (one per stream point, the
/// receivers of the point as batch rows) and one transport backward instead of a
/// full-model replica per receiver (see `runner/kinds/edge_attribution/eap.rs`).
pub trait StreamModel {
    /// Run ONLY the computation between the stream at `at` (shaped as the model's
    /// `hook_resid_pre`: `[b, T, d]` kvc, `[b, T, hc_mult, d]` DeepSeek-V4) and the
    /// nodes that read it, with the hooks of `spec` as in [`LanguageModel::forward`]:
    /// `Attn(l)`: layer l's attention inputs up to `hook_q`, `hook_k`, `hook_v` and the
    /// compressed entries (`hook_compressed_k` / `_v`; the attention itself does not
    /// run); `Mlp(l)`: the MLP / MoE up to `hook_mlp_out`; `Final`: the logits. Every
    /// value equals the full forward's at that point when `stream` does. `tokens`
    /// (`[b, T]`): for models whose layers read ids (hash routing).
    fn read_stream(
        &self,
        tokens: Tensor<2, Int>,
        at: StreamPoint,
        stream: &Act,
        spec: &HookSpec,
    ) -> Result<StreamRead>;
    /// Whether the stream is the plain sum of the embeddings and every block output
    /// (`hook_attn_out`, `hook_mlp_out`): then the stream-only computation below is the
    /// identity for derivatives and the caller may skip it.
    fn additive_stream(&self) -> bool;
    /// The stream at every point (in [`StreamPoint::index`] order), computed from the
    /// token embeddings (`hook_embed`, `[b, T, d]`) and the block outputs only
    /// (`attn_out[l]` as at `hook_attn_out`, `mlp_out[l]` as at `hook_mlp_out`), every
    /// block's own computation held out: kvc, running sums; DeepSeek-V4, the
    /// hyper-connections (their pre / post / comb weights computed from the stream, as
    /// in the forward) around the given outputs.
    fn stream_from_outputs(
        &self,
        embed: Tensor<3>,
        attn_out: &[Tensor<3>],
        mlp_out: &[Tensor<3>],
    ) -> Result<Vec<Act>>;
    /// [`stream_from_outputs`](Self::stream_from_outputs) linearised at these inputs
    /// (one batch of `b` prompts): everything its derivative needs that does not depend
    /// on the adjoint (DeepSeek-V4: the streams, the post / comb weights and their
    /// per-token Jacobian with respect to the mixing logits) computed once, so that
    /// [`StreamLinear`] applies the transposed map to any number of adjoint row blocks
    /// without recomputing a weight.
    fn linearize_stream(
        &self,
        embed: Tensor<3>,
        attn_out: &[Tensor<3>],
        mlp_out: &[Tensor<3>],
    ) -> Result<Box<dyn StreamLinear + '_>>;
}

/// The vector-Jacobian products of [`StreamModel::stream_from_outputs`] at the point
/// [`StreamModel::linearize_stream`] fixed, step by step: step `k` (1 ..= 2 n_layers)
/// makes the stream at index `k` ([`StreamPoint::index`]) from the one at `k - 1` and
/// the block output written between them (`attn_out[l]` for k = 2l + 1, `mlp_out[l]`
/// for k = 2l + 2). Adjoints are `[c b, T, width]` (width: the stream's per-position
/// size, `hc_mult x d_model` on DeepSeek-V4): `c` blocks of the linearised batch's rows,
/// each block an independent adjoint (e.g. one receiver's). Exact: the same derivative
/// autodiff takes through `stream_from_outputs` (the weights stay functions of the
/// stream), up to float rounding.
pub trait StreamLinear {
    /// `dL/d stream_k` -> (`dL/d stream_(k-1)`, `dL/d` the block output of step `k`,
    /// `[c b, T, d_model]`).
    fn step_back(&self, k: usize, adj: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>)>;
    /// `dL/d stream_0` -> `dL/d hook_embed` (`[c b, T, d_model]`).
    fn embed_back(&self, adj: Tensor<3>) -> Result<Tensor<3>>;
}

/// The [`StreamLinear`] of an additive stream (the running sum of the embeddings and
/// every block output): each step's derivative is the identity.
pub struct AdditiveLinear {
    /// Steps (2 n_layers).
    pub steps: usize,
}

impl StreamLinear for AdditiveLinear {
    fn step_back(&self, k: usize, adj: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>)> {
        if k == 0 || k > self.steps {
            return Err(Error::Input(format!(
                "stream step {k}: the steps are 1..={}",
                self.steps
            )));
        }
        Ok((adj.clone(), adj))
    }
    fn embed_back(&self, adj: Tensor<3>) -> Result<Tensor<3>> {
        Ok(adj)
    }
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
    /// The stream-level API edge attribution's O(1)-pass method needs (`None`: the
    /// kind falls back to one replica forward per receiver).
    fn stream_model(&self) -> Option<&dyn StreamModel> {
        None
    }
    /// Number of parameters (values held in the compute dtype), when known.
    fn n_params(&self) -> Option<usize> {
        None
    }
    /// The weights' resident bytes by storage (`f32`, `bf16`, `fp8`, `fp4`, `scales`,
    /// `i64`), when known.
    fn resident_bytes(&self) -> Option<std::collections::BTreeMap<String, usize>> {
        None
    }
    /// What a forward holds per token, for the memory estimates (the patching budget):
    /// the generic [`memory::Widths::from_info`] unless the model knows better.
    fn memory_widths(&self) -> memory::Widths {
        memory::Widths::from_info(&self.info())
    }
    /// When a hook-free [`forward_logit_rows`](Self::forward_logit_rows) runs a long
    /// prompt span by span (DeepSeek-V4: `deepseek_v4::token_blocks`): the positions it
    /// holds activations for at once, and the f32 values per position it keeps for the
    /// whole forward (its cache for the later spans, per-position tables). `None`: every
    /// position at once.
    fn prefill_span(&self) -> Option<(usize, f64)> {
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
    /// [`forward`](Self::forward) (with `state`: [`forward_with_state`](Self::forward_with_state))
    /// with the logits at the flat positions `rows` only (indices into `[batch * pos]`,
    /// row-major): `([rows, vocab], captures, state)`. Every hook and capture sees every
    /// position, as in `forward`; models may run the LM head at `rows` alone (a patching
    /// base run reads the answer positions, and at a 129,280-word vocabulary the LM head
    /// over every position of two 8K-token prompts is most of the forward). The default
    /// runs the full forward and selects the rows.
    fn forward_rows(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        rows: Tensor<1, Int>,
        state: bool,
    ) -> Result<(Tensor<2>, ActivationCache, Option<PrefixState>)> {
        let (out, st) = if state {
            self.forward_with_state(tokens, spec)?
        } else {
            (self.forward(tokens, spec)?, None)
        };
        let [b, t, v] = out.logits.dims();
        let rows = rows.to_device(&out.logits.device());
        Ok((
            out.logits.reshape([b * t, v]).select(0, rows),
            out.cache,
            st,
        ))
    }
    /// Logits at the flat positions `rows` only (indices into `[batch * pos]`,
    /// row-major): `[rows, vocab]`, the rows of [`forward`](Self::forward)'s logits
    /// (training reads the answer positions; models may skip the LM head elsewhere). The
    /// default runs `forward` and selects the rows.
    fn forward_logit_rows(
        &self,
        tokens: Tensor<2, Int>,
        rows: Tensor<1, Int>,
    ) -> Result<Tensor<2>> {
        let logits = self.forward(tokens, &HookSpec::new())?.logits;
        let [b, t, v] = logits.dims();
        Ok(logits.reshape([b * t, v]).select(0, rows))
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

/// Check that every id of `tokens` lies in `0..vocab` (reads the ids back to the host).
pub fn check_token_ids(tokens: &Tensor<2, Int>, vocab: usize) -> Result<Vec<i64>> {
    let [_, t] = tokens.dims();
    let ids: Vec<i64> = tokens
        .to_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|e| Error::Input(format!("token ids: {e:?}")))?;
    if let Some((i, bad)) = ids
        .iter()
        .enumerate()
        .find(|(_, x)| **x < 0 || **x as usize >= vocab)
    {
        return Err(Error::Input(format!(
            "row {}, position {}: token id {bad} is out of the vocabulary 0..{vocab}",
            i / t,
            i % t
        )));
    }
    Ok(ids)
}

/// A serde_json error of `text` with the key it happened at: serde_json says only
/// "invalid type: string, expected usize at line 1 column 80"; the nearest `"key":`
/// before that spot names the field to fix.
pub fn json_error(text: &str, e: &serde_json::Error) -> String {
    let (line, col) = (e.line(), e.column());
    if line == 0 {
        return e.to_string();
    }
    let start: usize = text
        .split_inclusive('\n')
        .take(line - 1)
        .map(str::len)
        .sum();
    let mut at = (start + col).min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let before = &text[..at];
    // The last `"name"` followed by `:` before the error.
    let key = before.rmatch_indices(':').find_map(|(i, _)| {
        let head = before[..i].trim_end();
        let head = head.strip_suffix('"')?;
        let open = head.rfind('"')?;
        let k = &head[open + 1..];
        (!k.is_empty() && !k.contains(['{', '}', ','])).then(|| k.to_string())
    });
    match key {
        Some(k) if !e.to_string().contains(&format!("`{k}`")) => format!("key `{k}`: {e}"),
        _ => e.to_string(),
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
    if !json.is_object() {
        let found = match &json {
            serde_json::Value::Array(_) => "an array",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::Bool(_) => "a boolean",
            _ => "null",
        };
        return Err(Error::Config {
            path,
            message: format!(
                "a model's config.json must be a JSON object of settings (`{{\"model_type\": ...}}`), this one is {found}"
            ),
        });
    }
    Ok((path, text, json))
}

/// Load a kvc model directory (`config.json` + `model.safetensors`).
pub fn load_kvc(dir: &Path, device: &Device) -> Result<KvcModel> {
    let (path, text, _) = read_config_json(dir)?;
    let config = KvcConfig::from_json(&text).map_err(|m| Error::Config {
        path: path.clone(),
        message: m,
    })?;
    config
        .check_memory()
        .map_err(|e| e.context(path.display().to_string()))?;
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

/// One line on how a loaded model holds its weights, for commands to print:
/// `weights stored: 3.3 MiB resident (bf16 1.2 MiB, fp4 ...)` (by storage, counted from
/// the model), or the f32 bytes of its parameters when it does not report them.
pub fn residency_summary(model: &dyn LanguageModel, residency: stored::Residency) -> String {
    let human = memory::human;
    match model.resident_bytes() {
        Some(by) => {
            let total: usize = by.values().sum();
            let parts: Vec<String> = by
                .iter()
                .map(|(k, v)| format!("{k} {}", human(*v as f64)))
                .collect();
            format!(
                "weights {residency}: {} resident ({})",
                human(total as f64),
                parts.join(", ")
            )
        }
        None => format!(
            "weights {residency}: {} resident (f32 parameters)",
            human(4.0 * model.n_params().unwrap_or(0) as f64)
        ),
    }
}

/// Load any supported model directory, dispatching on `config.json`'s `model_type`
/// (BF16 / FP8 / FP4 weights kept as stored: [`stored::Residency::Stored`]).
pub fn load_model(dir: &Path, device: &Device) -> Result<Box<dyn LanguageModel>> {
    load_any(dir, device, None, stored::Residency::default())
}

/// [`load_model`] with the weights kept as stored or dequantised to f32 on load
/// (`--weights stored|f32`; kvc checkpoints are f32 either way).
pub fn load_model_with(
    dir: &Path,
    device: &Device,
    residency: stored::Residency,
) -> Result<Box<dyn LanguageModel>> {
    load_any(dir, device, None, residency)
}

/// [`load_model_with`], under `overlay` when one is given ([`load_model_overlaid`]).
pub fn load_model_as(
    dir: &Path,
    device: &Device,
    residency: stored::Residency,
    overlay: Option<&compression::Overlay>,
) -> Result<Box<dyn LanguageModel>> {
    match overlay {
        Some(o) => load_model_overlaid(dir, device, residency, o),
        None => load_model_with(dir, device, residency),
    }
}

/// [`load_model_with`] under a training-free compression overlay (kvc organisms,
/// Llama-family and Gemma 3 checkpoints; see [`compression`]).
pub fn load_model_overlaid(
    dir: &Path,
    device: &Device,
    residency: stored::Residency,
    overlay: &compression::Overlay,
) -> Result<Box<dyn LanguageModel>> {
    if let Some(p) = pretrained::detect(dir) {
        return Ok(Box::new(
            pretrained::load(&p, device, residency)?.with_overlay(overlay)?,
        ));
    }
    let (path, _, json) = read_config_json(dir)?;
    match json["model_type"].as_str() {
        Some(kvc::MODEL_TYPE) => Ok(Box::new(load_kvc(dir, device)?.with_overlay(overlay)?)),
        other => Err(Error::Config {
            path,
            message: format!(
                "a compression overlay applies to kvc organisms, Llama-family and Gemma 3 checkpoints, not to model_type {}",
                other.map_or("(none)".to_string(), |t| format!("\"{t}\""))
            ),
        }),
    }
}

/// Load a model directory over the devices of `placement` (see [`placement`]): it
/// loads on the first (home) device, then every layer moves to its own.
pub fn load_model_placed(
    dir: &Path,
    placement: &placement::Placement,
    residency: stored::Residency,
) -> Result<Box<dyn LanguageModel>> {
    let p = placement.open()?;
    load_any(dir, &p.home.clone(), Some(&p), residency)
}

/// Load a model directory over `devices` with layers split automatically (see
/// [`placement::Placement::split`]): by equal shares of the resident bytes (stored bytes
/// for weights kept as stored), or filling the devices in order when `capacity` (bytes
/// per device) is given. Returns the placement used.
pub fn load_model_split(
    dir: &Path,
    devices: Vec<crate::device::DeviceSpec>,
    capacity: Option<&[f64]>,
    residency: stored::Residency,
) -> Result<(Box<dyn LanguageModel>, placement::Placement)> {
    let home = devices
        .first()
        .ok_or_else(|| Error::field("--devices", "no device named"))?
        .device()?;
    let (path, _, json) = read_config_json(dir)?;
    let split = |(layer_bytes, home_bytes): (Vec<f64>, f64)| {
        let pl = placement::Placement::split(devices.clone(), &layer_bytes, home_bytes, capacity)?;
        let opened = pl.open()?;
        Ok::<_, Error>((pl, opened))
    };
    match json["model_type"].as_str() {
        Some(deepseek_v4::MODEL_TYPE) => {
            let m = deepseek_v4::load_with(dir, &home, residency)?;
            let (pl, p) = split(m.placement_bytes())?;
            Ok((Box::new(m.place(&p)?), pl))
        }
        Some(kvc::MODEL_TYPE) => {
            let m = load_kvc(dir, &home)?;
            let (pl, p) = split(m.placement_bytes())?;
            Ok((Box::new(m.place(&p)?), pl))
        }
        _ => Err(Error::Config {
            path,
            message: "no supported `model_type` to place".into(),
        }),
    }
}

fn load_any(
    dir: &Path,
    device: &Device,
    placed: Option<&placement::Placed>,
    residency: stored::Residency,
) -> Result<Box<dyn LanguageModel>> {
    if let Some(p) = pretrained::detect(dir) {
        let m = pretrained::load(&p, device, residency)?;
        return Ok(Box::new(match placed {
            Some(p) => m.place(p)?,
            None => m,
        }));
    }
    let (path, _, json) = read_config_json(dir)?;
    match json["model_type"].as_str() {
        Some(kvc::MODEL_TYPE) => {
            let m = load_kvc(dir, device)?;
            Ok(Box::new(match placed {
                Some(p) => m.place(p)?,
                None => m,
            }))
        }
        Some(deepseek_v4::MODEL_TYPE) => {
            let m = deepseek_v4::load_with(dir, device, residency)?;
            Ok(Box::new(match placed {
                Some(p) => m.place(p)?,
                None => m,
            }))
        }
        Some(other) => Err(Error::Config {
            path,
            message: format!(
                "unsupported model_type \"{other}\" (supported: \"{}\", \"{}\", and Hugging Face's {}; or a .gguf file of {})",
                kvc::MODEL_TYPE,
                deepseek_v4::MODEL_TYPE,
                pretrained::HF_MODEL_TYPES.join(", "),
                pretrained::GGUF_ARCHS.join(", ")
            ),
        }),
        None => Err(Error::Config {
            path,
            message: "no `model_type` field".into(),
        }),
    }
}
