//! `config.json` of a DeepSeek-V4 checkpoint, in the transformers form (`layer_types`,
//! `compress_rates`, nested `rope_parameters`) or DeepSeek's release form
//! (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`), resolved
//! the way transformers 5.24 `DeepseekV4Config.__post_init__` resolves it.
//!
//! [`RawConfig`] is the file as written (every field optional, unknown keys ignored as
//! transformers ignores them); [`DeepseekV4Config`] is the resolved, validated form the
//! model is built from.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// The `model_type` of DeepSeek-V4 checkpoints.
pub const MODEL_TYPE: &str = "deepseek_v4";

/// Attention kind of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttnType {
    /// Sliding window only.
    #[serde(rename = "sliding_attention")]
    Sliding,
    /// Compressed sparse attention: overlapping compression at rate m, lightning indexer.
    #[serde(rename = "compressed_sparse_attention")]
    Csa,
    /// Heavily compressed attention: non-overlapping compression at rate m'.
    #[serde(rename = "heavily_compressed_attention")]
    Hca,
}

impl AttnType {
    /// The name used in `layer_types`.
    pub fn name(self) -> &'static str {
        match self {
            AttnType::Sliding => "sliding_attention",
            AttnType::Csa => "compressed_sparse_attention",
            AttnType::Hca => "heavily_compressed_attention",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "sliding_attention" => AttnType::Sliding,
            "compressed_sparse_attention" => AttnType::Csa,
            "heavily_compressed_attention" => AttnType::Hca,
            _ => return None,
        })
    }
}

/// MoE routing kind of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpType {
    /// Experts chosen by a fixed token-id table (`tid2eid`).
    HashMoe,
    /// Learned top-k routing with a score-correction bias.
    Moe,
}

/// Router scoring function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoringFunc {
    /// `sqrt(softplus(x))` (V4 default).
    Sqrtsoftplus,
    /// Softmax over the experts. transformers 5.24 cannot build this (`ACT2FN` has no
    /// `softmax`), so there is no parity target; phaselens implements the usual definition.
    Softmax,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
}

/// A resolved rotary table: inverse frequencies (f32, as the reference computes them)
/// and the factor multiplied into cos and sin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    /// `default` or `yarn`.
    pub rope_type: String,
    pub theta: f64,
    /// Number of rotated channels (the LAST `rot_dims` of a head).
    pub rot_dims: usize,
    /// YaRN factor (1 for default).
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Multiplies cos and sin.
    pub attention_scaling: f64,
}

/// The config.json as written: every field optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RawConfig {
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub q_lora_rank: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub scoring_func: Option<String>,
    pub routed_scaling_factor: Option<f64>,
    pub max_position_embeddings: Option<f64>,
    pub rope_theta: Option<f64>,
    pub layer_types: Option<Vec<String>>,
    pub compress_rates: Option<serde_json::Map<String, Value>>,
    pub compress_rope_theta: Option<f64>,
    pub hc_mult: Option<usize>,
    pub hc_sinkhorn_iters: Option<usize>,
    pub hc_eps: Option<f64>,
    pub mlp_layer_types: Option<Vec<String>>,
    pub swiglu_limit: Option<f64>,
    pub sliding_window: Option<usize>,
    pub o_groups: Option<usize>,
    pub o_lora_rank: Option<usize>,
    pub index_n_heads: Option<usize>,
    pub index_head_dim: Option<usize>,
    pub index_topk: Option<usize>,
    pub hidden_act: Option<String>,
    pub rms_norm_eps: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub rope_parameters: Option<Value>,
    pub partial_rotary_factor: Option<f64>,
    pub mlp_bias: Option<bool>,
    pub attention_bias: Option<bool>,
    pub quantization_config: Option<Value>,
    // Legacy (release) keys.
    pub compress_ratios: Option<Vec<i64>>,
    pub compress_rate_csa: Option<usize>,
    pub compress_rate_hca: Option<usize>,
    pub num_hash_layers: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub rope_scaling: Option<Value>,
}

/// The resolved configuration the model is built from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV4Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    /// CSA rate m.
    pub csa_rate: usize,
    /// HCA rate m'.
    pub hca_rate: usize,
    pub layer_types: Vec<AttnType>,
    pub mlp_layer_types: Vec<MlpType>,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// Rotary of sliding layers.
    pub rope_main: RopeSpec,
    /// Rotary of CSA/HCA layers, their compressors and the indexer.
    pub rope_compress: RopeSpec,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub rms_norm_eps: f64,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub scoring_func: ScoringFunc,
    pub routed_scaling_factor: f64,
    pub swiglu_limit: f64,
    /// Biases on the shared expert's linears.
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
    /// FP8 block size from `quantization_config.weight_block_size` (default 128 x 128).
    pub fp8_block: [usize; 2],
}

/// The most layers a config may declare (checked before any per-layer list is built).
pub const MAX_LAYERS: usize = 100_000;

impl DeepseekV4Config {
    /// Parse and resolve config.json text.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| {
            Error::field(
                "config.json",
                format!("cannot parse: {}", crate::model::json_error(text, &e)),
            )
        })?;
        Self::resolve(&raw)
    }

    /// Resolve a raw config (defaults are the V4-Flash values, as in transformers).
    pub fn resolve(r: &RawConfig) -> Result<Self> {
        if let Some(mt) = &r.model_type
            && mt != MODEL_TYPE
        {
            return Err(Error::field(
                "model_type",
                format!("must be \"{MODEL_TYPE}\", got \"{mt}\""),
            ));
        }
        let n = r.num_hidden_layers.unwrap_or(43);
        if n > MAX_LAYERS {
            // Before the per-layer lists are built.
            return Err(Error::field(
                "num_hidden_layers",
                format!("{n} layers is more than {MAX_LAYERS}"),
            ));
        }
        let head_dim = r.head_dim.unwrap_or(512);

        let (csa_rate, hca_rate) = compress_rates(r)?;

        let layer_types = layer_types(r, n)?;
        let mlp_layer_types = mlp_layer_types(r, n)?;

        let partial = match (r.partial_rotary_factor, r.qk_rope_head_dim) {
            (Some(p), _) => p,
            (None, Some(q)) => q as f64 / head_dim as f64,
            (None, None) => 64.0 / 512.0,
        };
        let max_pos = r.max_position_embeddings.unwrap_or(1048576.0);
        let rope_theta = r.rope_theta.unwrap_or(10000.0);
        let compress_theta = r.compress_rope_theta.unwrap_or(160000.0);
        let (rope_main, rope_compress) =
            resolve_rope(r, head_dim, partial, rope_theta, compress_theta, max_pos)?;

        let scoring_func = scoring_func(r)?;
        check_unsupported(r)?;
        let fp8_block = fp8_block(r)?;

        let c = DeepseekV4Config {
            vocab_size: r.vocab_size.unwrap_or(129280),
            hidden_size: r.hidden_size.unwrap_or(4096),
            num_hidden_layers: n,
            num_attention_heads: r.num_attention_heads.unwrap_or(64),
            head_dim,
            q_lora_rank: r.q_lora_rank.unwrap_or(1024),
            o_groups: r.o_groups.unwrap_or(8),
            o_lora_rank: r.o_lora_rank.unwrap_or(1024),
            sliding_window: r.sliding_window.unwrap_or(128),
            csa_rate,
            hca_rate,
            layer_types,
            mlp_layer_types,
            index_n_heads: r.index_n_heads.unwrap_or(64),
            index_head_dim: r.index_head_dim.unwrap_or(128),
            index_topk: r.index_topk.unwrap_or(512),
            rope_main,
            rope_compress,
            hc_mult: r.hc_mult.unwrap_or(4),
            hc_sinkhorn_iters: r.hc_sinkhorn_iters.unwrap_or(20),
            hc_eps: r.hc_eps.unwrap_or(1e-6),
            rms_norm_eps: r.rms_norm_eps.unwrap_or(1e-6),
            n_routed_experts: r.n_routed_experts.unwrap_or(256),
            num_experts_per_tok: r.num_experts_per_tok.unwrap_or(6),
            moe_intermediate_size: r.moe_intermediate_size.unwrap_or(2048),
            scoring_func,
            routed_scaling_factor: r.routed_scaling_factor.unwrap_or(1.5),
            swiglu_limit: r.swiglu_limit.unwrap_or(10.0),
            mlp_bias: r.mlp_bias.unwrap_or(false),
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(false),
            fp8_block,
        };
        c.validate()?;
        Ok(c)
    }

    /// Check the resolved values; the error names the field.
    pub fn validate(&self) -> Result<()> {
        self.validate_sizes()?;
        self.validate_rope()?;
        self.validate_scalars()
    }

    /// The sizes: every count at least 1, the experts per token at most the experts,
    /// the output groups dividing the heads.
    fn validate_sizes(&self) -> Result<()> {
        let pos = at_least_one;
        pos("vocab_size", self.vocab_size)?;
        pos("hidden_size", self.hidden_size)?;
        pos("num_hidden_layers", self.num_hidden_layers)?;
        pos("num_attention_heads", self.num_attention_heads)?;
        pos("head_dim", self.head_dim)?;
        pos("q_lora_rank", self.q_lora_rank)?;
        pos("o_groups", self.o_groups)?;
        pos("o_lora_rank", self.o_lora_rank)?;
        pos("sliding_window", self.sliding_window)?;
        pos("compress_rates.compressed_sparse_attention", self.csa_rate)?;
        pos("compress_rates.heavily_compressed_attention", self.hca_rate)?;
        pos("hc_mult", self.hc_mult)?;
        pos("hc_sinkhorn_iters", self.hc_sinkhorn_iters)?;
        pos("n_routed_experts", self.n_routed_experts)?;
        pos("num_experts_per_tok", self.num_experts_per_tok)?;
        pos("moe_intermediate_size", self.moe_intermediate_size)?;
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(Error::field(
                "num_experts_per_tok",
                format!(
                    "must be at most n_routed_experts ({}), got {}",
                    self.n_routed_experts, self.num_experts_per_tok
                ),
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.o_groups) {
            return Err(Error::field(
                "o_groups",
                format!(
                    "must divide num_attention_heads ({}), got {}",
                    self.num_attention_heads, self.o_groups
                ),
            ));
        }
        Ok(())
    }

    /// The rotary embeddings: rotated dims even and within the heads (and the CSA
    /// indexer's heads, with its sizes), thetas and YaRN parameters finite.
    fn validate_rope(&self) -> Result<()> {
        let pos = at_least_one;
        for (name, r) in [("main", &self.rope_main), ("compress", &self.rope_compress)] {
            if r.rot_dims % 2 != 0 || r.rot_dims > self.head_dim {
                return Err(Error::field(
                    format!("rope_parameters.{name}.partial_rotary_factor"),
                    format!(
                        "gives {} rotated dims; must be even and at most head_dim ({})",
                        r.rot_dims, self.head_dim
                    ),
                ));
            }
        }
        if self.layer_types.contains(&AttnType::Csa) {
            pos("index_n_heads", self.index_n_heads)?;
            pos("index_head_dim", self.index_head_dim)?;
            pos("index_topk", self.index_topk)?;
            if self.rope_compress.rot_dims > self.index_head_dim {
                return Err(Error::field(
                    "index_head_dim",
                    format!(
                        "must be at least the rotated dims ({}), got {}",
                        self.rope_compress.rot_dims, self.index_head_dim
                    ),
                ));
            }
        }
        for (name, r) in [
            ("rope_theta", &self.rope_main),
            ("compress_rope_theta", &self.rope_compress),
        ] {
            if !(r.theta.is_finite() && r.theta > 0.0) {
                return Err(Error::field(
                    name,
                    format!("must be a finite number > 0, got {}", r.theta),
                ));
            }
            for (k, v) in [
                ("factor", r.factor),
                (
                    "original_max_position_embeddings",
                    r.original_max_position_embeddings,
                ),
                ("beta_fast", r.beta_fast),
                ("beta_slow", r.beta_slow),
                ("attention_scaling", r.attention_scaling),
            ] {
                if !v.is_finite() {
                    return Err(Error::field(
                        format!("rope_parameters.{k}"),
                        format!("must be a finite number, got {v}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The float parameters: finite, and the epsilons and SwiGLU limit in range.
    fn validate_scalars(&self) -> Result<()> {
        for (name, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("hc_eps", self.hc_eps),
            ("swiglu_limit", self.swiglu_limit),
            ("routed_scaling_factor", self.routed_scaling_factor),
        ] {
            if !v.is_finite() {
                return Err(Error::field(
                    name,
                    format!("must be a finite number, got {v}"),
                ));
            }
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(Error::field("rms_norm_eps", "must be > 0"));
        }
        if self.hc_eps.is_nan() || self.hc_eps < 0.0 {
            return Err(Error::field("hc_eps", "must be >= 0"));
        }
        if self.swiglu_limit.is_nan() || self.swiglu_limit <= 0.0 {
            return Err(Error::field("swiglu_limit", "must be > 0"));
        }
        Ok(())
    }

    /// The compression rate of a layer type (None for sliding layers).
    pub fn rate(&self, t: AttnType) -> Option<usize> {
        match t {
            AttnType::Sliding => None,
            AttnType::Csa => Some(self.csa_rate),
            AttnType::Hca => Some(self.hca_rate),
        }
    }

    /// Number of parameters (f32 values) the model holds.
    pub fn n_params(&self) -> usize {
        // `as` saturates: a config too large to count is refused by the memory check.
        self.n_params_f64() as usize
    }

    /// Refuse a config whose weights cannot fit in memory (f32), naming its size keys
    /// ([`crate::model::memory::check`]).
    pub fn check_memory(&self) -> Result<()> {
        crate::model::memory::check(
            "the model's weights (f32)",
            &format!(
                "config.json vocab_size = {}, hidden_size = {}, num_hidden_layers = {}, n_routed_experts = {}, moe_intermediate_size = {}",
                self.vocab_size,
                self.hidden_size,
                self.num_hidden_layers,
                self.n_routed_experts,
                self.moe_intermediate_size
            ),
            4.0 * self.n_params_f64(),
        )
    }

    /// What a forward holds per token (f32 values) for the memory estimates
    /// ([`crate::model::memory::Widths`]). Inside a layer, next to the `hc_mult` streams
    /// (and their mixed copy and collapsed input), the widest of: the queries
    /// (`q_lora` and `heads x head_dim` with the rotary's temporaries, 3 copies), a CSA
    /// layer's selector (the queries, K and V, the compressor's projections and the
    /// indexer's `index_n_heads x index_head_dim` queries with their rotary's
    /// temporaries), the attention's queries and output blocks (3 x `heads x head_dim`,
    /// the indexer's queries alive in a CSA layer) and the experts (gate, up and their
    /// product for the routed and the shared expert). Per layer it keeps K and V
    /// (`head_dim` each), a compressed layer its compressor's `kv` / `gate` projections
    /// (`2 x head_dim` each with CSA's overlap, `head_dim` with HCA's) and a CSA layer its
    /// indexer's (`2 x index_head_dim` each): what the prefix state records. Checked
    /// against measured peaks in docs/performance.md ("Memory check").
    pub fn memory_widths(&self) -> crate::model::memory::Widths {
        let f = |x: usize| x as f64;
        let (d, hc, dh) = (f(self.hidden_size), f(self.hc_mult), f(self.head_dim));
        let q = f(self.num_attention_heads) * dh;
        let idx = f(self.index_n_heads) * f(self.index_head_dim);
        let held = 2.0 * hc * d + d;
        let experts = 3.0 * f(self.num_experts_per_tok + 1) * f(self.moe_intermediate_size) + d;
        let dense = (f(self.q_lora_rank) + 3.0 * q)
            .max(3.0 * q + 2.0 * dh)
            .max(experts);
        let csa = (q + 2.0 * dh + 4.0 * dh + 3.0 * idx).max(3.0 * q + 2.0 * dh + idx);
        let layer = self.layer_types.iter().fold(0.0f64, |m, t| {
            m.max(
                held + if *t == AttnType::Csa {
                    dense.max(csa)
                } else {
                    dense
                },
            )
        });
        let state = self
            .layer_types
            .iter()
            .map(|t| match t {
                AttnType::Sliding => 2.0 * dh,
                AttnType::Hca => 4.0 * dh,
                AttnType::Csa => 6.0 * dh + 4.0 * f(self.index_head_dim),
            })
            .collect();
        crate::model::memory::Widths { layer, state }
    }

    /// [`Self::n_params`] in floating point (no overflow for any config).
    pub fn n_params_f64(&self) -> f64 {
        let f = |x: usize| x as f64;
        let (h, d, nh, q) = (
            f(self.hidden_size),
            f(self.head_dim),
            f(self.num_attention_heads),
            f(self.q_lora_rank),
        );
        let (e, i, n) = (
            f(self.n_routed_experts),
            f(self.moe_intermediate_size),
            f(self.hc_mult),
        );
        let (og, olr) = (f(self.o_groups), f(self.o_lora_rank));
        let hc = (2.0 + n) * n * (n * h) + (2.0 + n) * n + 3.0;
        let mut total = 2.0 * f(self.vocab_size) * h + h + n * n * h + n + 1.0;
        if self.tie_word_embeddings {
            total -= f(self.vocab_size) * h;
        }
        let (di, hi) = (f(self.index_head_dim), f(self.index_n_heads));
        let (csa, hca) = (f(self.csa_rate), f(self.hca_rate));
        let per_type = |t: AttnType, moe: bool| {
            let mut p = h * q + q + q * nh * d + h * d + d;
            p += og * olr * (nh * d / og);
            p += h * og * olr + nh;
            p += match t {
                AttnType::Sliding => 0.0,
                AttnType::Hca => 2.0 * h * d + hca * d + d,
                AttnType::Csa => {
                    4.0 * h * d
                        + csa * 2.0 * d
                        + d
                        + 4.0 * h * di
                        + csa * 2.0 * di
                        + di
                        + hi * di * q
                        + hi * h
                }
            };
            p += 2.0 * h + 2.0 * hc;
            p += e * h + e * 3.0 * i * h + 3.0 * i * h;
            if self.mlp_bias {
                p += 2.0 * i + h;
            }
            if moe {
                p += e;
            }
            p
        };
        for (l, t) in self.layer_types.iter().enumerate() {
            total += per_type(*t, self.mlp_layer_types[l] == MlpType::Moe);
        }
        total
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

fn rope_err(field: &str, msg: impl Into<String>) -> Error {
    Error::field(field, msg)
}

/// Resolve the `main` and `compress` rotaries (transformers' `__post_init__` + rope init).
fn resolve_rope(
    r: &RawConfig,
    head_dim: usize,
    partial: f64,
    rope_theta: f64,
    compress_theta: f64,
    max_pos: f64,
) -> Result<(RopeSpec, RopeSpec)> {
    let rp = r.rope_parameters.clone().or_else(|| r.rope_scaling.clone());
    let rp = match rp {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(rope_err(
                "rope_parameters",
                format!("must be an object, got {other}"),
            ));
        }
    };
    let nested = matches!(rp.get("main"), Some(Value::Object(_)))
        && matches!(rp.get("compress"), Some(Value::Object(_)));
    let (main, compress) = if nested {
        let m = rp["main"].as_object().cloned().unwrap_or_default();
        let c = rp["compress"].as_object().cloned().unwrap_or_default();
        (m, c)
    } else {
        let mut flat: serde_json::Map<String, Value> = rp
            .into_iter()
            .filter(|(k, _)| k != "main" && k != "compress")
            .collect();
        if !flat.contains_key("rope_type")
            && let Some(t) = flat.get("type").cloned()
        {
            flat.insert("rope_type".into(), t);
        }
        let mut main = serde_json::Map::new();
        main.insert("rope_type".into(), Value::from("default"));
        main.insert("rope_theta".into(), Value::from(rope_theta));
        main.insert("partial_rotary_factor".into(), Value::from(partial));
        let mut compress = flat;
        compress.insert("rope_theta".into(), Value::from(compress_theta));
        compress.insert("partial_rotary_factor".into(), Value::from(partial));
        if !compress.contains_key("rope_type") {
            compress.insert("rope_type".into(), Value::from("default"));
        }
        if compress["rope_type"] == "yarn" && !compress.contains_key("attention_factor") {
            compress.insert("attention_factor".into(), Value::from(1.0));
        }
        (main, compress)
    };
    Ok((
        rope_spec("rope_parameters.main", &main, head_dim, max_pos)?,
        rope_spec("rope_parameters.compress", &compress, head_dim, max_pos)?,
    ))
}

fn num(m: &serde_json::Map<String, Value>, k: &str) -> Option<f64> {
    m.get(k).and_then(|v| v.as_f64())
}

fn rope_spec(
    field: &str,
    m: &serde_json::Map<String, Value>,
    head_dim: usize,
    max_pos: f64,
) -> Result<RopeSpec> {
    let rope_type = m
        .get("rope_type")
        .or_else(|| m.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default")
        .to_string();
    let theta =
        num(m, "rope_theta").ok_or_else(|| rope_err(&format!("{field}.rope_theta"), "missing"))?;
    if !theta.is_finite() || theta <= 1.0 {
        return Err(rope_err(
            &format!("{field}.rope_theta"),
            format!("must be > 1, got {theta}"),
        ));
    }
    let partial = num(m, "partial_rotary_factor").unwrap_or(1.0);
    if !(partial.is_finite() && partial > 0.0 && partial <= 1.0) {
        return Err(rope_err(
            &format!("{field}.partial_rotary_factor"),
            format!("must be in (0, 1], got {partial}"),
        ));
    }
    let rot_dims = (head_dim as f64 * partial) as usize;
    match rope_type.as_str() {
        "default" => Ok(RopeSpec {
            rope_type,
            theta,
            rot_dims,
            factor: 1.0,
            original_max_position_embeddings: max_pos,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_scaling: 1.0,
        }),
        "yarn" => {
            let orig = num(m, "original_max_position_embeddings").unwrap_or(max_pos);
            let factor = num(m, "factor").unwrap_or(max_pos / orig);
            let get_mscale = |scale: f64, ms: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * ms * scale.ln() + 1.0
                }
            };
            let attention_scaling = match num(m, "attention_factor") {
                Some(a) => a,
                None => match (num(m, "mscale"), num(m, "mscale_all_dim")) {
                    (Some(a), Some(b)) if a != 0.0 && b != 0.0 => {
                        get_mscale(factor, a) / get_mscale(factor, b)
                    }
                    _ => get_mscale(factor, 1.0),
                },
            };
            let nz = |k: &str, d: f64| match num(m, k) {
                Some(v) if v != 0.0 => v,
                _ => d,
            };
            Ok(RopeSpec {
                rope_type,
                theta,
                rot_dims,
                factor,
                original_max_position_embeddings: orig,
                beta_fast: nz("beta_fast", 32.0),
                beta_slow: nz("beta_slow", 1.0),
                attention_scaling,
            })
        }
        other => Err(rope_err(
            &format!("{field}.rope_type"),
            format!("\"{other}\" is not supported (supported: \"default\", \"yarn\")"),
        )),
    }
}

/// `compress_rates` (a dict), then the legacy scalar overrides: (CSA rate, HCA rate).
fn compress_rates(r: &RawConfig) -> Result<(usize, usize)> {
    let mut csa_rate = 4usize;
    let mut hca_rate = 128usize;
    if let Some(m) = &r.compress_rates {
        for (k, v) in m {
            let v = v.as_u64().ok_or_else(|| {
                Error::field(format!("compress_rates.{k}"), "must be a positive integer")
            })? as usize;
            match AttnType::parse(k) {
                Some(AttnType::Csa) => csa_rate = v,
                Some(AttnType::Hca) => hca_rate = v,
                _ => {
                    return Err(Error::field(
                        "compress_rates",
                        format!(
                            "unknown key \"{k}\" (allowed: \"compressed_sparse_attention\", \"heavily_compressed_attention\")"
                        ),
                    ));
                }
            }
        }
    }
    if let Some(v) = r.compress_rate_csa {
        csa_rate = v;
    }
    if let Some(v) = r.compress_rate_hca {
        hca_rate = v;
    }
    Ok((csa_rate, hca_rate))
}

/// Layer types: explicit `layer_types` > legacy `compress_ratios` > the V4-Pro default;
/// truncated to `n` layers.
fn layer_types(r: &RawConfig, n: usize) -> Result<Vec<AttnType>> {
    let mut layer_types: Vec<AttnType> = if let Some(lt) = &r.layer_types {
        lt.iter()
            .enumerate()
            .map(|(i, s)| {
                AttnType::parse(s).ok_or_else(|| {
                    Error::field(
                        format!("layer_types[{i}]"),
                        format!(
                            "\"{s}\" is not one of \"sliding_attention\", \"compressed_sparse_attention\", \"heavily_compressed_attention\""
                        ),
                    )
                })
            })
            .collect::<Result<_>>()?
    } else if let Some(cr) = &r.compress_ratios {
        cr.iter()
            .enumerate()
            .map(|(i, &v)| match v {
                0 => Ok(AttnType::Sliding),
                4 => Ok(AttnType::Csa),
                128 => Ok(AttnType::Hca),
                _ => Err(Error::field(
                    format!("compress_ratios[{i}]"),
                    format!("{v} is not one of 0 (sliding), 4 (CSA), 128 (HCA)"),
                )),
            })
            .collect::<Result<_>>()?
    } else {
        let mut v = vec![AttnType::Hca; n.min(2)];
        v.extend((0..n.saturating_sub(2)).map(|i| {
            if i % 2 == 1 {
                AttnType::Csa
            } else {
                AttnType::Hca
            }
        }));
        v
    };
    layer_types.truncate(n);
    if layer_types.len() != n {
        return Err(Error::field(
            if r.layer_types.is_some() {
                "layer_types"
            } else {
                "compress_ratios"
            },
            format!(
                "has {} entries but num_hidden_layers is {n}",
                layer_types.len()
            ),
        ));
    }
    Ok(layer_types)
}

/// MLP types: explicit `mlp_layer_types`, else `num_hash_layers` hash-routed layers
/// then routed ones; truncated to `n` layers.
fn mlp_layer_types(r: &RawConfig, n: usize) -> Result<Vec<MlpType>> {
    let mut mlp_layer_types: Vec<MlpType> = if let Some(mt) = &r.mlp_layer_types {
        mt.iter()
            .enumerate()
            .map(|(i, s)| match s.as_str() {
                "hash_moe" => Ok(MlpType::HashMoe),
                "moe" => Ok(MlpType::Moe),
                _ => Err(Error::field(
                    format!("mlp_layer_types[{i}]"),
                    format!("\"{s}\" is not one of \"hash_moe\", \"moe\""),
                )),
            })
            .collect::<Result<_>>()?
    } else {
        let h = r.num_hash_layers.unwrap_or(3).min(n);
        let mut v = vec![MlpType::HashMoe; h];
        v.extend(std::iter::repeat_n(MlpType::Moe, n - h));
        v
    };
    mlp_layer_types.truncate(n);
    if mlp_layer_types.len() != n {
        return Err(Error::field(
            "mlp_layer_types",
            format!(
                "has {} entries but num_hidden_layers is {n}",
                mlp_layer_types.len()
            ),
        ));
    }
    Ok(mlp_layer_types)
}

/// The router's `scoring_func`.
fn scoring_func(r: &RawConfig) -> Result<ScoringFunc> {
    Ok(match r.scoring_func.as_deref().unwrap_or("sqrtsoftplus") {
        "sqrtsoftplus" => ScoringFunc::Sqrtsoftplus,
        "softmax" => ScoringFunc::Softmax,
        "sigmoid" => ScoringFunc::Sigmoid,
        other => {
            return Err(Error::field(
                "scoring_func",
                format!("\"{other}\" is not one of \"sqrtsoftplus\", \"softmax\", \"sigmoid\""),
            ));
        }
    })
}

/// Settings transformers accepts that DeepSeek-V4 does not use: rejected with the field.
fn check_unsupported(r: &RawConfig) -> Result<()> {
    if let Some(act) = &r.hidden_act
        && act != "silu"
        && act != "swish"
    {
        return Err(Error::field(
            "hidden_act",
            format!("only \"silu\" is supported, got \"{act}\""),
        ));
    }
    if r.attention_bias == Some(true) {
        return Err(Error::field(
            "attention_bias",
            "DeepSeek-V4 attention has no biases (transformers ignores the flag); set it to false",
        ));
    }
    if let Some(kv) = r.num_key_value_heads
        && kv != 1
    {
        return Err(Error::field(
            "num_key_value_heads",
            format!("DeepSeek-V4 has one shared K=V head, got {kv}"),
        ));
    }
    Ok(())
}

/// `quantization_config.weight_block_size` (default 128 x 128).
fn fp8_block(r: &RawConfig) -> Result<[usize; 2]> {
    Ok(
        match r
            .quantization_config
            .as_ref()
            .and_then(|q| q.get("weight_block_size"))
        {
            None | Some(Value::Null) => [128, 128],
            Some(v) => {
                let a: Option<Vec<usize>> = v.as_array().map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64().map(|x| x as usize))
                        .collect()
                });
                match a.as_deref() {
                    Some([a, b]) if *a > 0 && *b > 0 => [*a, *b],
                    _ => {
                        return Err(Error::field(
                            "quantization_config.weight_block_size",
                            format!("must be two positive integers, got {v}"),
                        ));
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_release_keys_resolve() {
        let c = DeepseekV4Config::from_json(
            r#"{"model_type": "deepseek_v4", "num_hidden_layers": 4, "head_dim": 32,
                "qk_rope_head_dim": 8, "num_hash_layers": 2,
                "compress_ratios": [128, 128, 4, 0, 4],
                "rope_scaling": {"type": "yarn", "factor": 16,
                    "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
                "topk_method": "noaux_tc"}"#,
        )
        .unwrap();
        assert_eq!(
            c.layer_types,
            vec![
                AttnType::Hca,
                AttnType::Hca,
                AttnType::Csa,
                AttnType::Sliding
            ]
        );
        assert_eq!(
            c.mlp_layer_types,
            vec![
                MlpType::HashMoe,
                MlpType::HashMoe,
                MlpType::Moe,
                MlpType::Moe
            ]
        );
        assert_eq!(c.rope_main.rope_type, "default");
        assert_eq!(c.rope_main.rot_dims, 8);
        assert_eq!(c.rope_compress.rope_type, "yarn");
        assert_eq!(c.rope_compress.theta, 160000.0);
        assert_eq!(c.rope_compress.attention_scaling, 1.0);
        assert_eq!(c.hca_rate, 128);
    }

    #[test]
    fn defaults_follow_v4_pro_schedule() {
        let c = DeepseekV4Config::from_json(r#"{"num_hidden_layers": 6}"#).unwrap();
        use AttnType::*;
        assert_eq!(c.layer_types, vec![Hca, Hca, Hca, Csa, Hca, Csa]);
        assert_eq!(c.mlp_layer_types[2], MlpType::HashMoe);
        assert_eq!(c.mlp_layer_types[3], MlpType::Moe);
    }

    #[test]
    fn errors_name_the_field() {
        let e =
            DeepseekV4Config::from_json(r#"{"num_hidden_layers": 2, "compress_ratios": [4, 7]}"#)
                .unwrap_err()
                .to_string();
        assert!(e.contains("compress_ratios[1]"), "{e}");
        let e = DeepseekV4Config::from_json(
            r#"{"num_hidden_layers": 3, "layer_types": ["sliding_attention"]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("layer_types"), "{e}");
        let e = DeepseekV4Config::from_json(r#"{"scoring_func": "relu"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("scoring_func"), "{e}");
        let e = DeepseekV4Config::from_json(
            r#"{"rope_parameters": {"rope_type": "longrope", "factor": 2}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("rope_parameters.compress.rope_type"), "{e}");
    }
}
