//! The paper's controlled family of chunk-compressed transformers ("kvc"), with full
//! attention as the baseline in the same code path.
//!
//! Decoder-only, pre-norm (RMSNorm), SwiGLU MLP, `n_heads` query heads grouped over
//! `n_kv_heads`. A query at position t attends, in ONE joint softmax, over
//! (a) the compressed entries of every window that has closed by t,
//! (b) an optional uncompressed local tail of the last `local_tail` raw tokens, and
//! (c) an optional learned attention sink.
//!
//! Compression: window `W`, stride `S` (W >= S; W > S overlaps). Entry i pools tokens
//! `i*S .. i*S+W` and becomes visible to query t once its window has closed,
//! `i*S + W - 1 <= t`. Pooling is softmax-gated per KV head with separate key and value
//! gates (`scalar`: one weight per token and KV head; `vector`: per channel; `uniform`:
//! the mean), plus an optional learned per-offset gate bias. Compressed keys are rotated
//! at their window's first position `i*S`.

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use super::layers::{
    Embedding, Linear, RmsNorm, RopeLayout, RopeTables, SwiGlu, apply_rope, int_tensor,
    mask_from_fn, masked_softmax, query_mask, rope_inv_freq,
};
use super::weights::{Init, Vb};
use super::{ForwardOutput, LayerKind, LayerSpec, ModelInfo};
use crate::error::{Error, Result};
use crate::hooks::{Act, HookPoint, HookRun, HookSpec, Site};

/// The `model_type` of kvc checkpoints' config.json.
pub const MODEL_TYPE: &str = "phaselens-kvc";

/// Attention variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Chunk-compressed attention (see the module docs).
    Compressed,
    /// Plain causal attention over raw tokens (the baseline).
    Full,
}

/// How the compressor weights the tokens of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateMode {
    /// One learned weight per token and KV head.
    Scalar,
    /// One learned weight per token, KV head and channel.
    Vector,
    /// Plain mean over the window (no learned gates).
    Uniform,
}

/// Which dims RoPE rotates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeMode {
    /// Every dim of the head.
    All,
    /// The first `rope_dims` dims.
    Partial,
    /// No positional rotation.
    None,
}

/// Compression geometry and operator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressionConfig {
    /// Window length W (tokens pooled into one entry).
    pub window: usize,
    /// Stride S (a new entry every S tokens); phase = position mod S.
    pub stride: usize,
    /// Raw tokens kept uncompressed at the end (0 = none).
    #[serde(default)]
    pub local_tail: usize,
    /// Gate mode.
    #[serde(default = "default_gate")]
    pub gate: GateMode,
    /// Learned per-offset gate bias (separate for key and value gates).
    #[serde(default = "yes")]
    pub gate_bias: bool,
}

fn default_gate() -> GateMode {
    GateMode::Scalar
}
fn yes() -> bool {
    true
}
fn is_false(b: &bool) -> bool {
    !*b
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_rope() -> RopeMode {
    RopeMode::All
}
fn default_std() -> f64 {
    0.02
}

/// The `config.json` of a kvc model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvcConfig {
    /// Must be `"phaselens-kvc"`.
    pub model_type: String,
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Head width; default `d_model / n_heads`.
    #[serde(default)]
    pub d_head: Option<usize>,
    pub d_ff: usize,
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    #[serde(default = "default_rope")]
    pub rope: RopeMode,
    /// Rotated dims when `rope = "partial"`.
    #[serde(default)]
    pub rope_dims: Option<usize>,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// RMS-normalise queries and keys per head (learned scale).
    #[serde(default = "yes")]
    pub qk_norm: bool,
    /// Keys and values share one projection.
    #[serde(default)]
    pub tied_kv: bool,
    /// Learned per-head attention sink.
    #[serde(default)]
    pub sink: bool,
    /// LM head shares the embedding matrix.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Keys read a learned per-channel mix of the attention input at `t` and `t - 1`
    /// (`mu * h_t + (1 - mu) * h_{t-1}`, `mu` initialised to 0.5): a one-token shift
    /// that lets a single layer match a key against the token before it. Shift
    /// invariant, so it adds no phase structure. Default false (and not written then).
    #[serde(default, skip_serializing_if = "is_false")]
    pub key_shift: bool,
    pub attention: AttentionKind,
    /// Required when `attention = "compressed"`.
    #[serde(default)]
    pub compression: Option<CompressionConfig>,
    /// Std of the random init.
    #[serde(default = "default_std")]
    pub init_std: f64,
}

impl KvcConfig {
    /// Check every field; the error names the field and the allowed values.
    pub fn validate(&self) -> Result<()> {
        let pos = |name: &str, v: usize| {
            if v == 0 {
                Err(Error::field(name, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        if self.model_type != MODEL_TYPE {
            return Err(Error::field(
                "model_type",
                format!("must be \"{MODEL_TYPE}\""),
            ));
        }
        pos("vocab_size", self.vocab_size)?;
        pos("d_model", self.d_model)?;
        pos("n_layers", self.n_layers)?;
        pos("n_heads", self.n_heads)?;
        pos("n_kv_heads", self.n_kv_heads)?;
        pos("d_ff", self.d_ff)?;
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(Error::field(
                "n_kv_heads",
                format!(
                    "must divide n_heads ({}), got {}",
                    self.n_heads, self.n_kv_heads
                ),
            ));
        }
        if self.d_head.is_none() && !self.d_model.is_multiple_of(self.n_heads) {
            return Err(Error::field(
                "d_head",
                "d_model is not divisible by n_heads; set d_head",
            ));
        }
        let dh = self.d_head();
        pos("d_head", dh)?;
        match self.rope {
            RopeMode::All if !dh.is_multiple_of(2) => {
                return Err(Error::field(
                    "rope",
                    format!("\"all\" needs an even d_head, got {dh}"),
                ));
            }
            RopeMode::Partial => {
                let r = self
                    .rope_dims
                    .ok_or_else(|| Error::field("rope_dims", "required when rope = \"partial\""))?;
                if r == 0 || r % 2 != 0 || r > dh {
                    return Err(Error::field(
                        "rope_dims",
                        format!("must be even and in 2..={dh} (d_head), got {r}"),
                    ));
                }
            }
            _ => {}
        }
        if self.rope != RopeMode::Partial && self.rope_dims.is_some() {
            return Err(Error::field(
                "rope_dims",
                "only allowed with rope = \"partial\"",
            ));
        }
        // Written so that NaN is rejected too.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(self.norm_eps > 0.0) {
            return Err(Error::field("norm_eps", "must be > 0"));
        }
        match (self.attention, &self.compression) {
            (AttentionKind::Compressed, None) => {
                return Err(Error::field(
                    "compression",
                    "required when attention = \"compressed\" (window, stride, ...)",
                ));
            }
            (AttentionKind::Full, Some(_)) => {
                return Err(Error::field(
                    "compression",
                    "only allowed with attention = \"compressed\" (allowed attention values: \"compressed\", \"full\")",
                ));
            }
            (AttentionKind::Compressed, Some(c)) => {
                pos("compression.window", c.window)?;
                pos("compression.stride", c.stride)?;
                if c.window < c.stride {
                    return Err(Error::field(
                        "compression.window",
                        format!("must be >= stride ({}), got {}", c.stride, c.window),
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A tiny compressed model for tests, benches and examples: vocab 37, d_model 32,
    /// 2 layers, 4 query heads over 2 KV heads of width 8, d_ff 48, W = S = 4 with no
    /// tail, scalar gates with per-offset bias, Q/K norm, a sink, init std 0.3 (large
    /// enough that attention is far from uniform). Change fields, or use
    /// [`KvcConfig::with_compression`] / [`KvcConfig::full_attention`].
    pub fn tiny() -> Self {
        KvcConfig {
            model_type: MODEL_TYPE.into(),
            vocab_size: 37,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            d_head: Some(8),
            d_ff: 48,
            norm_eps: 1e-6,
            rope: RopeMode::All,
            rope_dims: None,
            rope_theta: 10000.0,
            qk_norm: true,
            tied_kv: false,
            sink: true,
            tie_embeddings: false,
            key_shift: false,
            attention: AttentionKind::Compressed,
            compression: Some(CompressionConfig {
                window: 4,
                stride: 4,
                local_tail: 0,
                gate: GateMode::Scalar,
                gate_bias: true,
            }),
            init_std: 0.3,
        }
    }

    /// The same model with compressed attention of window `window`, stride `stride` and
    /// a raw tail of `local_tail` tokens (gate settings kept, scalar + bias by default).
    pub fn with_compression(mut self, window: usize, stride: usize, local_tail: usize) -> Self {
        let (gate, gate_bias) = self
            .compression
            .as_ref()
            .map_or((GateMode::Scalar, true), |c| (c.gate, c.gate_bias));
        self.attention = AttentionKind::Compressed;
        self.compression = Some(CompressionConfig {
            window,
            stride,
            local_tail,
            gate,
            gate_bias,
        });
        self
    }

    /// The same model with full causal attention (no compression).
    pub fn full_attention(mut self) -> Self {
        self.attention = AttentionKind::Full;
        self.compression = None;
        self
    }

    /// Head width.
    pub fn d_head(&self) -> usize {
        self.d_head.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Number of rotated dims.
    pub fn rot_dims(&self) -> usize {
        match self.rope {
            RopeMode::All => self.d_head(),
            RopeMode::Partial => self.rope_dims.unwrap_or(0),
            RopeMode::None => 0,
        }
    }

    /// Parse and validate config.json text.
    pub fn from_json(text: &str) -> std::result::Result<Self, String> {
        let c: KvcConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

/// The compressor of one attention layer.
#[derive(Module, Debug)]
pub struct Compressor {
    /// Key gate logits, `[kv_heads * g, d_model]` (g = 1 scalar, d_head vector).
    pub key_gate: Option<Linear>,
    pub value_gate: Option<Linear>,
    /// Per-offset key gate bias `[window, kv_heads]`.
    pub key_gate_bias: Option<Param<Tensor<2>>>,
    pub value_gate_bias: Option<Param<Tensor<2>>>,
}

/// One attention layer.
#[derive(Module, Debug)]
pub struct Attention {
    pub w_q: Linear,
    pub w_k: Linear,
    /// Absent with `tied_kv`.
    pub w_v: Option<Linear>,
    pub w_o: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    /// Per-head sink logits `[n_heads]`.
    pub sink: Option<Param<Tensor<1>>>,
    /// Key-shift mix `mu` `[d_model]` (`key_shift = true`).
    pub key_shift: Option<Param<Tensor<1>>>,
    pub compressor: Option<Compressor>,
}

/// One pre-norm block.
#[derive(Module, Debug)]
pub struct Block {
    pub attn_norm: RmsNorm,
    pub attn: Attention,
    pub mlp_norm: RmsNorm,
    pub mlp: SwiGlu,
}

/// A kvc model.
#[derive(Module, Debug)]
pub struct KvcModel {
    pub embed: Embedding,
    pub blocks: Vec<Block>,
    pub final_norm: RmsNorm,
    /// Absent with `tie_embeddings`.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    pub config: KvcConfig,
}

impl KvcModel {
    /// Build from a weight source (checkpoint or random init).
    pub fn new(config: &KvcConfig, vb: &Vb) -> Result<Self> {
        config.validate()?;
        let c = config;
        let (d, h, kvh, dh) = (c.d_model, c.n_heads, c.n_kv_heads, c.d_head());
        let std = c.init_std;
        let out_std = std / (2.0 * c.n_layers as f64).sqrt();
        let mut blocks = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let vb = vb.pp(format!("blocks.{l}"));
            let va = vb.pp("attn");
            let compressor = match (&c.compression, c.attention) {
                (Some(cc), AttentionKind::Compressed) => {
                    let vc = va.pp("compressor");
                    let g = if cc.gate == GateMode::Vector { dh } else { 1 };
                    let learned = cc.gate != GateMode::Uniform;
                    Some(Compressor {
                        key_gate: learned
                            .then(|| Linear::new(&vc.pp("key_gate"), d, kvh * g, std))
                            .transpose()?,
                        value_gate: learned
                            .then(|| Linear::new(&vc.pp("value_gate"), d, kvh * g, std))
                            .transpose()?,
                        key_gate_bias: (learned && cc.gate_bias)
                            .then(|| vc.param("key_gate_bias", [cc.window, kvh], Init::Zeros))
                            .transpose()?,
                        value_gate_bias: (learned && cc.gate_bias)
                            .then(|| vc.param("value_gate_bias", [cc.window, kvh], Init::Zeros))
                            .transpose()?,
                    })
                }
                _ => None,
            };
            let attn = Attention {
                w_q: Linear::new(&va.pp("w_q"), d, h * dh, std)?,
                w_k: Linear::new(&va.pp("w_k"), d, kvh * dh, std)?,
                w_v: (!c.tied_kv)
                    .then(|| Linear::new(&va.pp("w_v"), d, kvh * dh, std))
                    .transpose()?,
                w_o: Linear::new(&va.pp("w_o"), h * dh, d, out_std)?,
                q_norm: c
                    .qk_norm
                    .then(|| RmsNorm::new(&va.pp("q_norm"), dh, c.norm_eps))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| RmsNorm::new(&va.pp("k_norm"), dh, c.norm_eps))
                    .transpose()?,
                sink: c
                    .sink
                    .then(|| va.param("sink", [h], Init::Zeros))
                    .transpose()?,
                key_shift: c
                    .key_shift
                    .then(|| va.param("key_shift", [d], Init::Const(0.5)))
                    .transpose()?,
                compressor,
            };
            blocks.push(Block {
                attn_norm: RmsNorm::new(&vb.pp("attn_norm"), d, c.norm_eps)?,
                attn,
                mlp_norm: RmsNorm::new(&vb.pp("mlp_norm"), d, c.norm_eps)?,
                mlp: SwiGlu::new(&vb.pp("mlp"), d, c.d_ff, std, out_std)?,
            });
        }
        Ok(KvcModel {
            embed: Embedding::new(&vb.pp("embed"), c.vocab_size, d, std)?,
            blocks,
            final_norm: RmsNorm::new(&vb.pp("final_norm"), d, c.norm_eps)?,
            lm_head: (!c.tie_embeddings)
                .then(|| Linear::new(&vb.pp("lm_head"), d, c.vocab_size, std))
                .transpose()?,
            config: config.clone(),
        })
    }

    /// Static description for runners and checks.
    pub fn info(&self) -> ModelInfo {
        let c = &self.config;
        let kind = match (&c.compression, c.attention) {
            (Some(cc), AttentionKind::Compressed) => LayerKind::Compressed {
                window: cc.window,
                stride: cc.stride,
                local_tail: cc.local_tail,
            },
            _ => LayerKind::Full,
        };
        ModelInfo {
            arch: MODEL_TYPE.into(),
            vocab_size: c.vocab_size,
            d_model: c.d_model,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            d_head: c.d_head(),
            layers: (0..c.n_layers)
                .map(|_| LayerSpec {
                    kind: kind.clone(),
                    n_heads: c.n_heads,
                    n_kv_heads: c.n_kv_heads,
                })
                .collect(),
        }
    }

    /// Full forward pass: `[batch, pos]` token ids -> logits `[batch, pos, vocab]` and
    /// the activations the spec captures.
    pub fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput> {
        self.forward_mode(tokens, spec, &mut Mode::Plain)
    }

    fn forward_mode(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
        mode: &mut Mode,
    ) -> Result<ForwardOutput> {
        self.check_tokens(&tokens)?;
        let mut hooks = spec.run();
        let x = self.embed.forward(tokens);
        let x = hooks.apply(HookPoint::global(Site::Embed), x)?;
        self.run_blocks(x, 0, mode, &mut hooks)
    }

    /// [`KvcModel::forward`], also keeping every block's per-token keys, values and
    /// gate logits for [`KvcModel::forward_suffix`].
    pub fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, super::PrefixState)> {
        let [rows, len] = tokens.dims();
        let mut layers = Vec::with_capacity(self.blocks.len());
        let out = self.forward_mode(tokens, spec, &mut Mode::Record(&mut layers))?;
        Ok((out, super::PrefixState::new(rows, len, KvState { layers })))
    }

    /// Run blocks `start..` over only the positions `suffix` names (see
    /// [`super::LanguageModel::forward_suffix`]); `resid: [rows, len, d_model]`.
    pub fn forward_suffix(
        &self,
        start: usize,
        state: &super::PrefixState,
        suffix: &super::Suffix,
        resid: Tensor<3>,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        let kv = state.for_suffix::<KvState>(suffix, "kvc")?;
        if start >= self.blocks.len() || kv.layers.len() != self.blocks.len() {
            return Err(Error::Input(format!(
                "suffix forward from block {start}: the model has {} blocks, the state {}",
                self.blocks.len(),
                kv.layers.len()
            )));
        }
        let total = state.len();
        let [b, l, d] = resid.dims();
        if b != suffix.rows.len() || l != suffix.len || d != self.config.d_model {
            return Err(Error::Input(format!(
                "suffix residual of shape [{b}, {l}, {d}], expected [{}, {}, {}]",
                suffix.rows.len(),
                suffix.len,
                self.config.d_model
            )));
        }
        let device = resid.device();
        let geo = AttnGeometry::new(&self.config, total, &device);
        let merge = suffix.merge_index(total);
        let qpos = suffix.positions();
        let n_keys = geo.mask.dims()[1];
        let rot = self.config.rot_dims();
        let idx = int_tensor(&suffix.rows, &device);
        let frame = SuffixFrame {
            merge: int_tensor(&merge, &device),
            rope_q: (rot > 0).then(|| {
                RopeTables::new(
                    &qpos,
                    &rope_inv_freq(rot, self.config.rope_theta),
                    1.0,
                    &device,
                )
            }),
            mask: query_mask(&qpos, b, n_keys, &device, |q, k| {
                geo.visible(&self.config, q, k)
            }),
            layers: kv
                .layers
                .iter()
                .enumerate()
                .map(|(i, layer)| (i >= start).then(|| layer.select_rows(&idx)))
                .collect(),
            prev_inputs: {
                // Each row's input at `from - 1` (a zero row where `from` is 0).
                let at: Vec<usize> = suffix
                    .rows
                    .iter()
                    .zip(&suffix.from)
                    .map(|(&r, &f)| r * total + f.saturating_sub(1))
                    .collect();
                let at = int_tensor(&at, &device);
                let live: Vec<f32> = suffix
                    .from
                    .iter()
                    .map(|&f| if f == 0 { 0.0 } else { 1.0 })
                    .collect();
                let live =
                    Tensor::<3>::from_data(burn::tensor::TensorData::new(live, [b, 1, 1]), &device);
                kv.layers
                    .iter()
                    .enumerate()
                    .map(|(i, layer)| {
                        layer.input.as_ref().filter(|_| i >= start).map(|input| {
                            let [rows, total, d] = input.dims();
                            input
                                .clone()
                                .reshape([rows * total, d])
                                .select(0, at.clone())
                                .reshape([b, 1, d])
                                * live.clone()
                        })
                    })
                    .collect()
            },
        };
        let mut hooks = spec.run();
        self.run_blocks_over(resid, start, &geo, &mut Mode::Suffix(&frame), &mut hooks)
    }

    /// Forward from block `start`, given the residual stream entering it
    /// (`blocks.{start}.hook_resid_pre`, `[batch, pos, d_model]`). Blocks before
    /// `start` are not run: batched patching computes the shared prefix once.
    pub fn forward_from(
        &self,
        start: usize,
        resid: Tensor<3>,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        if start > self.blocks.len() {
            return Err(Error::Input(format!(
                "start layer {start} out of range 0..={}",
                self.blocks.len()
            )));
        }
        let mut hooks = spec.run();
        self.run_blocks(resid, start, &mut Mode::Plain, &mut hooks)
    }

    fn check_tokens(&self, tokens: &Tensor<2, Int>) -> Result<()> {
        let [b, t] = tokens.dims();
        if b == 0 || t == 0 {
            return Err(Error::Input(format!("empty token batch [{b}, {t}]")));
        }
        Ok(())
    }

    fn run_blocks(
        &self,
        x: Tensor<3>,
        start: usize,
        mode: &mut Mode,
        hooks: &mut HookRun,
    ) -> Result<ForwardOutput> {
        let [_, t, _] = x.dims();
        let geo = AttnGeometry::new(&self.config, t, &x.device());
        self.run_blocks_over(x, start, &geo, mode, hooks)
    }

    fn run_blocks_over(
        &self,
        mut x: Tensor<3>,
        start: usize,
        geo: &AttnGeometry,
        mode: &mut Mode,
        hooks: &mut HookRun,
    ) -> Result<ForwardOutput> {
        for (l, block) in self.blocks.iter().enumerate().skip(start) {
            x = hooks.apply(HookPoint::block(l, Site::ResidPre), x)?;
            let a = block.attn.forward(
                l,
                block.attn_norm.forward(x.clone()),
                geo,
                &self.config,
                mode,
                hooks,
            )?;
            let a = hooks.apply(HookPoint::block(l, Site::AttnOut), a)?;
            x = x + a;
            x = hooks.apply(HookPoint::block(l, Site::ResidMid), x)?;
            let m = block.mlp.forward(block.mlp_norm.forward(x.clone()));
            let m = hooks.apply(HookPoint::block(l, Site::MlpOut), m)?;
            x = x + m;
            x = hooks.apply(HookPoint::block(l, Site::ResidPost), x)?;
        }
        let x = self.final_norm.forward(x);
        let x = hooks.apply(HookPoint::global(Site::FinalNorm), x)?;
        let logits = match &self.lm_head {
            Some(h) => h.forward(x),
            None => {
                let [b, t, d] = x.dims();
                let w = self.embed.weight.val();
                let v = w.dims()[0];
                x.reshape([b * t, d])
                    .matmul(w.transpose())
                    .reshape([b, t, v])
            }
        };
        Ok(ForwardOutput {
            logits,
            cache: hooks.finish(),
        })
    }
}

/// Everything about the key layout that depends only on the sequence length, computed
/// once per forward and shared by all layers.
struct AttnGeometry {
    /// Number of compressed entries.
    n_entries: usize,
    /// Whether raw tokens are attended (full attention, or a local tail).
    raw: bool,
    /// `[n_entries * W]` token index of every (entry, offset).
    window_idx: Option<Tensor<1, Int>>,
    /// RoPE tables at token positions `0..t`.
    rope_tokens: Option<RopeTables>,
    /// RoPE tables at entry start positions `i * S`.
    rope_entries: Option<RopeTables>,
    /// `[t, n_keys]` visibility (true = visible).
    mask: Tensor<2, burn::tensor::Bool>,
}

/// Whether key `k` (compressed entries first, then raw tokens) is visible to the query
/// at position `q` in compressed attention with `n_entries` entries.
fn key_visible(w: usize, s: usize, tail: usize, n_entries: usize, q: usize, k: usize) -> bool {
    if k < n_entries {
        k * s + w - 1 <= q
    } else {
        let u = k - n_entries;
        u <= q && u + tail > q
    }
}

impl AttnGeometry {
    /// Whether key `k` is visible to the query at position `q` (the entry of
    /// [`AttnGeometry::mask`], for any query position).
    fn visible(&self, c: &KvcConfig, q: usize, k: usize) -> bool {
        match (&c.compression, c.attention) {
            (Some(cc), AttentionKind::Compressed) => {
                key_visible(cc.window, cc.stride, cc.local_tail, self.n_entries, q, k)
            }
            _ => k <= q,
        }
    }

    fn new(c: &KvcConfig, t: usize, device: &Device) -> Self {
        let rot = c.rot_dims();
        let inv = rope_inv_freq(rot, c.rope_theta);
        let tokens: Vec<usize> = (0..t).collect();
        let rope_tokens = (rot > 0).then(|| RopeTables::new(&tokens, &inv, 1.0, device));
        match (&c.compression, c.attention) {
            (Some(cc), AttentionKind::Compressed) => {
                let (w, s, tail) = (cc.window, cc.stride, cc.local_tail);
                let n_entries = if t >= w { (t - w) / s + 1 } else { 0 };
                let raw = tail > 0;
                let idx: Vec<usize> = (0..n_entries)
                    .flat_map(|i| (0..w).map(move |o| i * s + o))
                    .collect();
                let starts: Vec<usize> = (0..n_entries).map(|i| i * s).collect();
                let n_keys = n_entries + if raw { t } else { 0 };
                let mask = mask_from_fn(t, n_keys, device, |q, k| {
                    key_visible(w, s, tail, n_entries, q, k)
                });
                AttnGeometry {
                    n_entries,
                    raw,
                    window_idx: (n_entries > 0).then(|| int_tensor(&idx, device)),
                    rope_tokens,
                    rope_entries: (rot > 0 && n_entries > 0)
                        .then(|| RopeTables::new(&starts, &inv, 1.0, device)),
                    mask,
                }
            }
            _ => AttnGeometry {
                n_entries: 0,
                raw: true,
                window_idx: None,
                rope_tokens,
                rope_entries: None,
                mask: mask_from_fn(t, t, device, |q, k| k <= q),
            },
        }
    }
}

impl Compressor {
    /// Per-token gate logits `[b, t, kvh, g]` of the key (or value) gate from
    /// `h: [b, t, d]`; `None` for uniform pooling.
    fn gate_logits(&self, value: bool, h: &Tensor<3>, kvh: usize) -> Option<Tensor<4>> {
        let gate = if value {
            &self.value_gate
        } else {
            &self.key_gate
        };
        gate.as_ref().map(|g| {
            let [b, t, _] = h.dims();
            g.forward(h.clone()).reshape([b, t, kvh, g.d_out() / kvh])
        })
    }

    /// Pool per-token `x: [b, t, kvh, dh]` into `[b, n_entries, kvh, dh]`, with the gate
    /// weights `[b, n_entries, W, kvh, g]` from the per-token gate logits
    /// ([`Compressor::gate_logits`]).
    #[allow(clippy::too_many_arguments)]
    fn pool(
        &self,
        layer: usize,
        value: bool,
        logits: Option<Tensor<4>>,
        x: Tensor<4>,
        geo: &AttnGeometry,
        cc: &CompressionConfig,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        let [b, _, kvh, dh] = x.dims();
        let (w, n) = (cc.window, geo.n_entries);
        let idx = geo.window_idx.clone().expect("entries exist");
        let xw = x.select(1, idx.clone()).reshape([b, n, w, kvh, dh]);
        let bias = if value {
            &self.value_gate_bias
        } else {
            &self.key_gate_bias
        };
        let site = if value {
            Site::ValueGate
        } else {
            Site::KeyGate
        };
        let point = HookPoint::block(layer, site);
        let weights: Tensor<5> = match logits {
            None => Tensor::full([b, n, w, kvh, 1], 1.0 / w as f32, &x_device(&xw)),
            Some(s) => {
                let gdim = s.dims()[3];
                let mut s = s.select(1, idx).reshape([b, n, w, kvh, gdim]);
                if let Some(bias) = bias {
                    s = s + bias.val().reshape([1, 1, w, kvh, 1]);
                }
                softmax(s, 2)
            }
        };
        let g = weights.dims()[4];
        let weights = if g == 1 {
            let w4 = hooks.apply(point, weights.reshape([b, n, w, kvh]))?;
            w4.reshape([b, n, w, kvh, 1])
        } else {
            hooks.apply(point, weights)?
        };
        Ok((weights * xw).sum_dim(2).reshape([b, n, kvh, dh]))
    }
}

/// `[first, h[:, ..lq-1]]` along positions: each position's predecessor input, `first`
/// (`[b, 1, d]`) for the first one.
fn shift_in(first: Tensor<3>, h: &Tensor<3>) -> Tensor<3> {
    let lq = h.dims()[1];
    if lq == 1 {
        first
    } else {
        Tensor::cat(vec![first, h.clone().slice_dim(1, 0..lq - 1)], 1)
    }
}

fn x_device(t: &Tensor<5>) -> Device {
    t.device()
}

/// Per-layer, per-token state of a base forward that later positions' attention reads:
/// keys and values after the K norm and hooks, before RoPE, and the compressor's gate
/// logits. All `[prompts, t, kv_heads, *]`.
#[derive(Debug, Clone)]
struct KvLayer {
    k: Tensor<4>,
    v: Tensor<4>,
    key_gate: Option<Tensor<4>>,
    value_gate: Option<Tensor<4>>,
    /// The attention input `[prompts, t, d_model]` (with `key_shift`: a recomputed
    /// position's key reads its predecessor's input).
    input: Option<Tensor<3>>,
}

impl KvLayer {
    fn select_rows(&self, idx: &Tensor<1, Int>) -> KvLayer {
        let sel = |t: &Tensor<4>| t.clone().select(0, idx.clone());
        KvLayer {
            k: sel(&self.k),
            v: sel(&self.v),
            key_gate: self.key_gate.as_ref().map(sel),
            value_gate: self.value_gate.as_ref().map(sel),
            // Only each row's predecessor input is read ([`SuffixFrame::prev_inputs`]).
            input: None,
        }
    }
}

/// The [`super::PrefixState`] of kvc models: one [`KvLayer`] per block.
#[derive(Debug)]
struct KvState {
    layers: Vec<KvLayer>,
}

/// Queries at per-row positions `from[r] .. from[r] + len` of prompts of `total`
/// tokens, over the base run's state (rows already selected) for all other positions.
struct SuffixFrame {
    /// `[b * total]`: index into `cat([state rows * total, new rows * len])` that puts
    /// each row's recomputed positions in place of the base run's.
    merge: Tensor<1, Int>,
    /// RoPE tables of the query positions, flattened row-major `[b * len]`.
    rope_q: Option<RopeTables>,
    /// `[b, len, n_keys]` visibility of each query.
    mask: Tensor<3, burn::tensor::Bool>,
    /// Per block (rows selected); empty for blocks before the start.
    layers: Vec<Option<KvLayer>>,
    /// Per block with `key_shift` (from the start on): each row's attention input at
    /// the position before its first recomputed one, `[b, 1, d_model]` (zeros where
    /// that position is 0).
    prev_inputs: Vec<Option<Tensor<3>>>,
}

impl SuffixFrame {
    fn merge(&self, base: Tensor<4>, new: Tensor<4>) -> Tensor<4> {
        super::merge_positions(base, new, &self.merge)
    }
}

/// How a forward treats the per-token keys and values.
enum Mode<'a> {
    /// A plain forward.
    Plain,
    /// A full forward that keeps every block's [`KvLayer`].
    Record(&'a mut Vec<KvLayer>),
    /// Only some positions are recomputed ([`KvcModel::forward_suffix`]).
    Suffix(&'a SuffixFrame),
}

impl Attention {
    /// `h: [b, lq, d]`: every position (`lq = t`) or, in [`Mode::Suffix`], the
    /// recomputed positions of each row.
    fn forward(
        &self,
        layer: usize,
        h: Tensor<3>,
        geo: &AttnGeometry,
        c: &KvcConfig,
        mode: &mut Mode,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let [b, lq, _] = h.dims();
        let (nh, kvh, dh) = (c.n_heads, c.n_kv_heads, c.d_head());
        let mut q = self.w_q.forward(h.clone()).reshape([b, lq, nh, dh]);
        let key_input = match &self.key_shift {
            Some(mix) => {
                let prev = match mode {
                    Mode::Suffix(frame) => {
                        let first = frame.prev_inputs[layer]
                            .clone()
                            .expect("a key_shift model records its attention inputs");
                        shift_in(first, &h)
                    }
                    _ => shift_in(Tensor::zeros([b, 1, h.dims()[2]], &h.device()), &h),
                };
                let mu = mix.val().unsqueeze::<3>();
                h.clone() * mu.clone() + prev * (mu.neg() + 1.0)
            }
            None => h.clone(),
        };
        let mut k = self.w_k.forward(key_input).reshape([b, lq, kvh, dh]);
        let v = match &self.w_v {
            Some(w_v) => w_v.forward(h.clone()).reshape([b, lq, kvh, dh]),
            None => k.clone(),
        };
        if let Some(n) = &self.q_norm {
            q = n.forward(q);
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(k);
        }
        let q = hooks.apply(HookPoint::block(layer, Site::AttnQ), q)?;
        let k = hooks.apply(HookPoint::block(layer, Site::AttnK), k)?;
        let v = hooks.apply(HookPoint::block(layer, Site::AttnV), v)?;
        let (key_gate, value_gate) = match &self.compressor {
            Some(comp) if geo.n_entries > 0 => (
                comp.gate_logits(false, &h, kvh),
                comp.gate_logits(true, &h, kvh),
            ),
            _ => (None, None),
        };
        // Per-token state of every position (the base run's where not recomputed).
        let (k, v, key_gate, value_gate) = match mode {
            Mode::Plain => (k, v, key_gate, value_gate),
            Mode::Record(out) => {
                out.push(KvLayer {
                    k: k.clone(),
                    v: v.clone(),
                    key_gate: key_gate.clone(),
                    value_gate: value_gate.clone(),
                    input: self.key_shift.as_ref().map(|_| h.clone()),
                });
                (k, v, key_gate, value_gate)
            }
            Mode::Suffix(frame) => {
                let base = frame.layers[layer]
                    .as_ref()
                    .expect("the suffix frame holds every block from the start");
                let merge = |base: &Option<Tensor<4>>, new: Option<Tensor<4>>| match (base, new) {
                    (Some(b), Some(n)) => Some(frame.merge(b.clone(), n)),
                    _ => None,
                };
                (
                    frame.merge(base.k.clone(), k),
                    frame.merge(base.v.clone(), v),
                    merge(&base.key_gate, key_gate),
                    merge(&base.value_gate, value_gate),
                )
            }
        };
        let rope = |x: Tensor<4>, t: &Option<RopeTables>| match t {
            Some(t) => apply_rope(x, t, RopeLayout::HalfSplit, false),
            None => x,
        };
        let q = match mode {
            Mode::Suffix(frame) => rope(q, &frame.rope_q),
            _ => rope(q, &geo.rope_tokens),
        };

        let mut keys = Vec::new();
        let mut values = Vec::new();
        if geo.n_entries > 0 {
            let comp = self
                .compressor
                .as_ref()
                .expect("compressed layer has a compressor");
            let cc = c.compression.as_ref().expect("compression config");
            let ck = comp.pool(layer, false, key_gate, k.clone(), geo, cc, hooks)?;
            let ck = hooks.apply(HookPoint::block(layer, Site::CompressedK), ck)?;
            let cv = comp.pool(layer, true, value_gate, v.clone(), geo, cc, hooks)?;
            let cv = hooks.apply(HookPoint::block(layer, Site::CompressedV), cv)?;
            keys.push(rope(ck, &geo.rope_entries));
            values.push(cv);
        }
        if geo.raw {
            keys.push(rope(k, &geo.rope_tokens));
            values.push(v);
        }
        let group = nh / kvh;
        let expand = |x: Tensor<4>| -> Tensor<4> {
            // [b, n, kvh, dh] -> [b, nh, n, dh], query head j reads KV head j / group.
            let [b, n, kvh, dh] = x.dims();
            x.swap_dims(1, 2)
                .reshape([b, kvh, 1, n, dh])
                .expand([b, kvh, group, n, dh])
                .reshape([b, kvh * group, n, dh])
        };
        let n_keys = geo.mask.dims()[1];
        let z = if n_keys == 0 {
            // Nothing to attend to anywhere (sequence shorter than one window, no tail).
            let p = match &self.sink {
                Some(_) => Tensor::<4>::ones([b, nh, lq, 1], &h.device()),
                None => Tensor::<4>::zeros([b, nh, lq, 0], &h.device()),
            };
            let p = hooks.apply(HookPoint::block(layer, Site::AttnPattern), p)?;
            drop(p);
            Tensor::<4>::zeros([b, nh, lq, dh], &h.device())
        } else {
            let kk = expand(Tensor::cat(keys, 1));
            let vv = expand(Tensor::cat(values, 1));
            let qh = q.swap_dims(1, 2); // [b, nh, lq, dh]
            let scores = qh.matmul(kk.swap_dims(2, 3)) * (1.0 / (dh as f64).sqrt());
            let mask = match mode {
                Mode::Suffix(frame) => frame
                    .mask
                    .clone()
                    .reshape([b, 1, lq, n_keys])
                    .expand([b, nh, lq, n_keys]),
                _ => geo
                    .mask
                    .clone()
                    .reshape([1, 1, lq, n_keys])
                    .expand([b, nh, lq, n_keys]),
            };
            let p = match &self.sink {
                Some(sink) => {
                    let sink_col = sink.val().reshape([1, nh, 1, 1]).expand([b, nh, lq, 1]);
                    let all = Tensor::cat(vec![scores, sink_col], 3);
                    let ones = Tensor::<4, burn::tensor::Bool>::from_data(
                        burn::tensor::TensorData::new(vec![true], [1, 1, 1, 1]),
                        &h.device(),
                    )
                    .expand([b, nh, lq, 1]);
                    let m = Tensor::cat(vec![mask, ones], 3);
                    masked_softmax(all, m)
                }
                None => masked_softmax(scores, mask),
            };
            let p = hooks.apply(HookPoint::block(layer, Site::AttnPattern), p)?;
            let p = p.slice_dim(3, 0..n_keys);
            p.matmul(vv)
        };
        let z = z.swap_dims(1, 2); // [b, lq, nh, dh]
        let z = hooks.apply(HookPoint::block(layer, Site::AttnZ), z)?;
        let result_point = HookPoint::block(layer, Site::AttnResult);
        if hooks.touches(&result_point) {
            // Per-head contributions [b, lq, nh, d_model]: W_O split by head.
            let d = self.w_o.d_out();
            let wo = self.w_o.weight.val().reshape([d, nh, dh]).swap_dims(0, 1); // [nh, d, dh]
            let zh = z.clone().swap_dims(0, 2).reshape([nh, lq * b, dh]); // [nh, lq*b, dh]
            let r = zh.matmul(wo.swap_dims(1, 2)); // [nh, lq*b, d]
            let r = r.reshape([nh, lq, b, d]).swap_dims(0, 2); // [b, lq, nh, d]
            let intervened = hooks
                .spec()
                .interventions()
                .iter()
                .any(|i| i.target.matches_point(&result_point));
            let r = hooks.apply(result_point, r)?;
            if intervened {
                let mut out = r.sum_dim(2).reshape([b, lq, d]);
                if let Some(bias) = &self.w_o.bias {
                    out = out + bias.val().unsqueeze::<3>();
                }
                return Ok(out);
            }
        }
        Ok(self.w_o.forward(z.reshape([b, lq, nh * dh])))
    }
}

impl super::LanguageModel for KvcModel {
    fn info(&self) -> ModelInfo {
        KvcModel::info(self)
    }
    fn n_params(&self) -> Option<usize> {
        Some(self.num_params())
    }
    fn device(&self) -> Device {
        self.embed.weight.val().device()
    }
    fn forward(&self, tokens: Tensor<2, Int>, spec: &HookSpec) -> Result<ForwardOutput> {
        KvcModel::forward(self, tokens, spec)
    }
    fn forward_from(
        &self,
        _tokens: Tensor<2, Int>,
        start: usize,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        KvcModel::forward_from(self, start, resid.get::<3>()?, spec)
    }
    fn forward_with_state(
        &self,
        tokens: Tensor<2, Int>,
        spec: &HookSpec,
    ) -> Result<(ForwardOutput, Option<super::PrefixState>)> {
        let (out, state) = KvcModel::forward_with_state(self, tokens, spec)?;
        Ok((out, Some(state)))
    }
    fn forward_suffix(
        &self,
        start: usize,
        state: &super::PrefixState,
        suffix: &super::Suffix,
        resid: &Act,
        spec: &HookSpec,
    ) -> Result<ForwardOutput> {
        KvcModel::forward_suffix(self, start, state, suffix, resid.get::<3>()?, spec)
    }
}
