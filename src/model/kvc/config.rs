//! The `config.json` of kvc models: geometry, operator and options, validated.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The `model_type` of kvc checkpoints' config.json.
pub const MODEL_TYPE: &str = "phaselens-kvc";

/// The most layers a config may declare.
pub const MAX_LAYERS: usize = 100_000;

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
    /// Staggered window boundaries: per KV head, where its windows start (each in
    /// `0..stride`, the smallest 0). KV head `h` pools the windows that start at
    /// `o_h + i S`, so a token sits at a different window offset for each head and some
    /// head sees every phase mid-window. A head whose last window has not closed holds
    /// a zero entry in that slot, which no query sees. Empty (the default, not
    /// written): every head starts at 0.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub window_offsets: Vec<usize>,
}

impl CompressionConfig {
    /// Window start of KV head `h` (0 unless [`CompressionConfig::window_offsets`]).
    pub fn offset(&self, h: usize) -> usize {
        self.window_offsets.get(h).copied().unwrap_or(0)
    }

    /// Whether KV heads start their windows at different offsets.
    pub fn staggered(&self) -> bool {
        self.window_offsets.iter().any(|&o| o > 0)
    }
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
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual stream width.
    pub d_model: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Query heads per layer.
    pub n_heads: usize,
    /// Key/value heads per layer (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Head width; default `d_model / n_heads`.
    #[serde(default)]
    pub d_head: Option<usize>,
    /// SwiGLU hidden width.
    pub d_ff: usize,
    /// RMSNorm epsilon (default 1e-6).
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    /// Which dimensions RoPE rotates.
    #[serde(default = "default_rope")]
    pub rope: RopeMode,
    /// Rotated dims when `rope = "partial"`.
    #[serde(default)]
    pub rope_dims: Option<usize>,
    /// RoPE base (default 10000).
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
    /// Full, sliding or compressed attention.
    pub attention: AttentionKind,
    /// Required when `attention = "compressed"`.
    #[serde(default)]
    pub compression: Option<CompressionConfig>,
    /// Std of the random init.
    #[serde(default = "default_std")]
    pub init_std: f64,
    /// What pretrained architectures (Llama, Qwen, Gemma 3) add to the kvc decoder;
    /// the default (not written) is the kvc model as trained here.
    #[serde(default, skip_serializing_if = "ArchOptions::is_plain")]
    pub arch: ArchOptions,
    /// A training-free compression overlay applied inside every layer's attention
    /// (`select`; `pool` is set as `attention = "compressed"` with uniform gates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<crate::model::compression::Overlay>,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpAct {
    /// SwiGLU: `down(silu(gate x) * up x)` (Llama, Qwen, kvc).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma: `gelu_pytorch_tanh`).
    GeluTanh,
}

/// Attention of one layer of a model with per-layer types (Gemma 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Causal attention over every raw token (RoPE base `rope_theta`).
    FullAttention,
    /// Sliding-window attention over `sliding_window` raw tokens (RoPE base
    /// `rope_local_theta` when set).
    SlidingAttention,
}

/// Architecture options of pretrained decoders, each off by default. With all of them
/// off the decoder is the kvc model; each switch is one fact of a published
/// architecture, applied where that architecture applies it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchOptions {
    /// The architecture's name in [`crate::model::ModelInfo::arch`] (`llama`, `qwen3`,
    /// `gemma3`, ...); `None`: `phaselens-kvc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Biases on the query, key and value projections (Qwen2).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// The MLP's activation.
    #[serde(default, skip_serializing_if = "is_silu")]
    pub mlp_act: MlpAct,
    /// RMSNorms on the attention and MLP outputs before they join the residual stream
    /// (Gemma 2/3's `post_attention_layernorm`, `post_feedforward_layernorm`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub post_norms: bool,
    /// The token embeddings are multiplied by this (Gemma: `sqrt(d_model)`, rounded
    /// to the compute dtype as transformers does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embed_scale: Option<f64>,
    /// The attention logits' scale (default `1 / sqrt(d_head)`; Gemma:
    /// `query_pre_attn_scalar^-0.5`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_scale: Option<f64>,
    /// Per-layer attention types (empty: every layer `attention`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_types: Vec<LayerType>,
    /// Raw tokens a sliding layer's query sees, itself included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// The RoPE base of sliding layers (Gemma 3: 10000); `None`: `rope_theta`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_theta: Option<f64>,
    /// Llama 3's RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_llama3: Option<Llama3Rope>,
    /// Final logits soft-capped as `cap * tanh(logits / cap)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_softcap: Option<f64>,
    /// Positions the model was trained for; longer prompts are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
}

/// Llama 3's RoPE scaling: long wavelengths divided by `factor`, short ones kept, the
/// band between interpolated (transformers' `_compute_llama3_parameters`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3Rope {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_positions: f64,
}

impl Llama3Rope {
    /// The scaled inverse frequencies.
    pub fn apply(&self, inv_freq: &[f64]) -> Vec<f64> {
        let low_wavelen = self.original_max_positions / self.low_freq_factor;
        let high_wavelen = self.original_max_positions / self.high_freq_factor;
        inv_freq
            .iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen > low_wavelen {
                    f / self.factor
                } else if wavelen < high_wavelen {
                    f
                } else {
                    let smooth = (self.original_max_positions / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 - smooth) * f / self.factor + smooth * f
                }
            })
            .collect()
    }
}

fn is_silu(a: &MlpAct) -> bool {
    *a == MlpAct::Silu
}

impl ArchOptions {
    /// Every option off (the kvc decoder).
    pub fn is_plain(&self) -> bool {
        *self == ArchOptions::default()
    }

    /// Whether layer `l` attends through a sliding window.
    pub fn sliding(&self, l: usize) -> bool {
        self.layer_types.get(l) == Some(&LayerType::SlidingAttention)
    }

    /// The raw-token window of layer `l` (`None`: every earlier token).
    pub fn window(&self, l: usize) -> Option<usize> {
        if self.sliding(l) {
            self.sliding_window
        } else {
            None
        }
    }
}

impl KvcConfig {
    /// Check every field; the error names the field and the allowed values.
    pub fn validate(&self) -> Result<()> {
        self.validate_shape()?;
        self.validate_rope()?;
        self.validate_scalars()?;
        self.validate_compression()?;
        self.validate_arch()
    }

    /// `arch`: one layer type per layer, a window for sliding layers, finite scales.
    fn validate_arch(&self) -> Result<()> {
        let a = &self.arch;
        if !a.layer_types.is_empty() && a.layer_types.len() != self.n_layers {
            return Err(Error::field(
                "arch.layer_types",
                format!(
                    "needs one type per layer (n_layers = {}), got {}",
                    self.n_layers,
                    a.layer_types.len()
                ),
            ));
        }
        let sliding = a.layer_types.contains(&LayerType::SlidingAttention);
        match a.sliding_window {
            None if sliding => {
                return Err(Error::field(
                    "arch.sliding_window",
                    "required when a layer is \"sliding_attention\"",
                ));
            }
            Some(0) => return Err(Error::field("arch.sliding_window", "must be at least 1")),
            _ => {}
        }
        for (field, v) in [
            ("arch.embed_scale", a.embed_scale),
            ("arch.attn_scale", a.attn_scale),
            ("arch.rope_local_theta", a.rope_local_theta),
            ("arch.final_softcap", a.final_softcap),
        ] {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return Err(Error::field(
                    field,
                    format!("must be a finite number > 0, got {v}"),
                ));
            }
        }
        if a.max_positions == Some(0) {
            return Err(Error::field("arch.max_positions", "must be at least 1"));
        }
        Ok(())
    }

    /// The model type and the sizes: every count at least 1, KV heads dividing the
    /// query heads, a head width that `d_model` gives or `d_head` sets.
    fn validate_shape(&self) -> Result<()> {
        let pos = at_least_one;
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
        pos("d_head", self.d_head())
    }

    /// The rotary mode against the head width (`rope_dims` only with partial RoPE).
    fn validate_rope(&self) -> Result<()> {
        let dh = self.d_head();
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
        Ok(())
    }

    /// The float parameters (finite and in range) and the number of layers.
    fn validate_scalars(&self) -> Result<()> {
        // Written so that NaN is rejected too.
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(Error::field(
                "norm_eps",
                format!("must be a finite number > 0, got {}", self.norm_eps),
            ));
        }
        // Checked even without RoPE: a config that says theta = 0 is a mistake either way.
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::field(
                "rope_theta",
                format!("must be a finite number > 0, got {}", self.rope_theta),
            ));
        }
        if !(self.init_std.is_finite() && self.init_std >= 0.0) {
            return Err(Error::field(
                "init_std",
                format!("must be a finite number >= 0, got {}", self.init_std),
            ));
        }
        if self.n_layers > MAX_LAYERS {
            return Err(Error::field(
                "n_layers",
                format!("{} layers is more than {MAX_LAYERS}", self.n_layers),
            ));
        }
        Ok(())
    }

    /// `[compression]`: present exactly with compressed attention, window >= stride.
    fn validate_compression(&self) -> Result<()> {
        let pos = at_least_one;
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
                self.validate_window_offsets(c)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// `compression.window_offsets`: empty, or one offset per KV head in `0..stride`
    /// with the smallest 0 (so the first window starts at the first token, and the
    /// number of entry slots is the unstaggered one).
    fn validate_window_offsets(&self, c: &CompressionConfig) -> Result<()> {
        let o = &c.window_offsets;
        if o.is_empty() {
            return Ok(());
        }
        let field = "compression.window_offsets";
        if o.len() != self.n_kv_heads {
            return Err(Error::field(
                field,
                format!(
                    "needs one offset per KV head (n_kv_heads = {}), got {}",
                    self.n_kv_heads,
                    o.len()
                ),
            ));
        }
        if let Some(&bad) = o.iter().find(|&&x| x >= c.stride) {
            return Err(Error::field(
                field,
                format!(
                    "each offset must be in 0..{} (the stride), got {bad}",
                    c.stride
                ),
            ));
        }
        if !o.contains(&0) {
            return Err(Error::field(
                field,
                format!("the smallest offset must be 0, got {o:?}"),
            ));
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
                window_offsets: Vec::new(),
            }),
            init_std: 0.3,
            arch: ArchOptions::default(),
            overlay: None,
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
            window_offsets: Vec::new(),
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

    /// Parameters (an upper estimate: every optional matrix counted).
    pub fn n_params_f64(&self) -> f64 {
        let (v, d, f) = (
            self.vocab_size as f64,
            self.d_model as f64,
            self.d_ff as f64,
        );
        let (h, kv, dh) = (
            self.n_heads as f64,
            self.n_kv_heads as f64,
            self.d_head() as f64,
        );
        let emb = v * d * if self.tie_embeddings { 1.0 } else { 2.0 };
        let window = self.compression.as_ref().map_or(0.0, |x| x.window as f64);
        let per_layer = 2.0 * d * h * dh
            + 2.0 * d * kv * dh
            + 3.0 * d * f
            + 4.0 * d
            + 2.0 * kv * dh * (window + 2.0)
            + h;
        emb + self.n_layers as f64 * per_layer + d
    }

    /// Refuse a config whose weights cannot fit in memory, naming its size keys
    /// ([`crate::model::memory::check`]).
    pub fn check_memory(&self) -> Result<()> {
        crate::model::memory::check(
            "the model's weights",
            &format!(
                "config vocab_size = {}, d_model = {}, n_layers = {}, d_ff = {}, n_heads = {}",
                self.vocab_size, self.d_model, self.n_layers, self.d_ff, self.n_heads
            ),
            4.0 * self.n_params_f64(),
        )
    }

    /// Parse and validate config.json text.
    pub fn from_json(text: &str) -> std::result::Result<Self, String> {
        let c: KvcConfig =
            serde_json::from_str(text).map_err(|e| crate::model::json_error(text, &e))?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

/// `v` as the value of field `name`: an error unless at least 1.
fn at_least_one(name: &str, v: usize) -> Result<()> {
    if v == 0 {
        Err(Error::field(name, "must be at least 1"))
    } else {
        Ok(())
    }
}
