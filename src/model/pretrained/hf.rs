//! Hugging Face folders: `config.json` (transformers' keys) + `model.safetensors` or a
//! sharded index (BF16 / F16 / F32), for the Llama family and Gemma 3.

use std::path::Path;

use burn::tensor::Device;
use serde_json::Value;

use super::gemma3;
use crate::error::{Error, Result};
use crate::model::kvc::{
    ArchOptions, AttentionKind, KvcConfig, LayerType, Llama3Rope, MODEL_TYPE, RopeMode,
};
use crate::model::weights::{CheckpointSource, Init, Vb, WeightSource};

/// The `model_type`s of config.json phaselens loads.
pub const HF_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma3",
];

/// Load a Hugging Face folder as a kvc decoder; every tensor of its files must be used.
pub fn load(dir: &Path, device: &Device) -> Result<crate::model::kvc::KvcModel> {
    let (path, _, json) = crate::model::read_config_json(dir)?;
    let config = config_from_json(&json).map_err(|message| Error::Config {
        path: path.clone(),
        message,
    })?;
    config
        .validate()
        .map_err(|e| e.context(path.display().to_string()))?;
    let gemma = config.arch.name.as_deref() == Some("gemma3");
    let prefix = if json["model_type"] == "gemma3" {
        "model.language_model."
    } else {
        "model."
    };
    let prefix = prefix.to_string();
    let src = CheckpointSource::open_dir(dir)?.with_rename(move |n| hf_name(n, &prefix, gemma));
    let src = NormPlusOne {
        inner: src,
        on: gemma,
    };
    let model = crate::model::kvc::KvcModel::new(&config, &Vb::new(&src, device))?;
    src.inner.check_all_used()?;
    Ok(model)
}

/// Gemma's safetensors hold RMSNorm scales `w` of `x * (1 + w)`: the forward's norms
/// multiply by their weight, so 1 is added on load.
struct NormPlusOne {
    inner: CheckpointSource,
    on: bool,
}

impl WeightSource for NormPlusOne {
    fn float(&self, name: &str, shape: &[usize], init: Init) -> Result<Vec<f32>> {
        let mut v = self.inner.float(name, shape, init)?;
        if self.on && name.ends_with("norm.weight") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(v)
    }
    fn int(&self, name: &str, shape: &[usize], init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        self.inner.int(name, shape, init)
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(name)
    }
}

/// kvc parameter name -> transformers' name.
fn hf_name(name: &str, prefix: &str, gemma: bool) -> String {
    match name {
        "embed.weight" => return format!("{prefix}embed_tokens.weight"),
        "final_norm.weight" => return format!("{prefix}norm.weight"),
        "lm_head.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let Some((l, rest)) = name.strip_prefix("blocks.").and_then(|r| r.split_once('.')) else {
        return name.to_string();
    };
    let Some((param, suffix)) = rest.rsplit_once('.') else {
        return name.to_string();
    };
    let hf = match (param, gemma) {
        ("attn_norm", _) => "input_layernorm",
        ("attn.w_q", _) => "self_attn.q_proj",
        ("attn.w_k", _) => "self_attn.k_proj",
        ("attn.w_v", _) => "self_attn.v_proj",
        ("attn.w_o", _) => "self_attn.o_proj",
        ("attn.q_norm", _) => "self_attn.q_norm",
        ("attn.k_norm", _) => "self_attn.k_norm",
        ("mlp_norm", false) => "post_attention_layernorm",
        ("mlp_norm", true) => "pre_feedforward_layernorm",
        ("post_attn_norm", _) => "post_attention_layernorm",
        ("post_mlp_norm", _) => "post_feedforward_layernorm",
        ("mlp.gate", _) => "mlp.gate_proj",
        ("mlp.up", _) => "mlp.up_proj",
        ("mlp.down", _) => "mlp.down_proj",
        _ => return name.to_string(),
    };
    format!("{prefix}layers.{l}.{hf}.{suffix}")
}

fn uint(j: &Value, key: &str) -> std::result::Result<usize, String> {
    j[key].as_u64().map(|v| v as usize).ok_or_else(|| {
        format!(
            "key `{key}`: expected a non-negative integer, found {}",
            j[key]
        )
    })
}

fn opt_uint(j: &Value, key: &str) -> std::result::Result<Option<usize>, String> {
    if j[key].is_null() {
        Ok(None)
    } else {
        uint(j, key).map(Some)
    }
}

fn opt_float(j: &Value, key: &str) -> std::result::Result<Option<f64>, String> {
    match &j[key] {
        Value::Null => Ok(None),
        v => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("key `{key}`: expected a number, found {v}")),
    }
}

/// The RoPE base of `layer_type` (transformers 5's `rope_parameters`, flat or per layer
/// type, or 4.x's `rope_theta`).
fn rope_theta(j: &Value, layer_type: &str) -> std::result::Result<Option<f64>, String> {
    let rp = &j["rope_parameters"];
    let nested = &rp[layer_type]["rope_theta"];
    if let Some(t) = nested.as_f64() {
        return Ok(Some(t));
    }
    if let Some(t) = rp["rope_theta"].as_f64() {
        return Ok(Some(t));
    }
    opt_float(j, "rope_theta")
}

/// Llama 3 RoPE scaling from `rope_parameters` / `rope_scaling`, if any; other scaling
/// types are refused by name.
fn rope_llama3(j: &Value) -> std::result::Result<Option<Llama3Rope>, String> {
    let s = if j["rope_scaling"].is_object() {
        &j["rope_scaling"]
    } else {
        &j["rope_parameters"]
    };
    let kind = s["rope_type"].as_str().or(s["type"].as_str());
    match kind {
        None | Some("default") => Ok(None),
        Some("llama3") => {
            let f = |k: &str| {
                s[k].as_f64()
                    .ok_or_else(|| format!("key `rope_scaling.{k}`: expected a number"))
            };
            Ok(Some(Llama3Rope {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_positions: f("original_max_position_embeddings")?,
            }))
        }
        Some(other) => Err(format!(
            "key `rope_scaling.rope_type`: \"{other}\" is not supported (supported: \"default\", \"llama3\")"
        )),
    }
}

/// The kvc config of a transformers config.json (a supported `model_type`).
pub fn config_from_json(json: &Value) -> std::result::Result<KvcConfig, String> {
    let model_type = json["model_type"].as_str().unwrap_or_default();
    // Gemma3ForConditionalGeneration nests the text model's settings.
    let j = if model_type == "gemma3" {
        &json["text_config"]
    } else {
        json
    };
    let gemma = model_type.starts_with("gemma3");
    let d_model = uint(j, "hidden_size")?;
    let n_heads = uint(j, "num_attention_heads")?;
    let n_layers = uint(j, "num_hidden_layers")?;
    let d_head = opt_uint(j, "head_dim")?.unwrap_or(d_model / n_heads.max(1));
    let mut arch = if gemma {
        let qpas = opt_float(j, "query_pre_attn_scalar")?.unwrap_or(256.0);
        let mut a = gemma3::arch_options(d_model, qpas);
        a.rope_local_theta = rope_theta(j, "sliding_attention")?.or(a.rope_local_theta);
        a.final_softcap = opt_float(j, "final_logit_softcapping")?;
        a
    } else {
        ArchOptions {
            name: Some(model_type.to_string()),
            qkv_bias: j["attention_bias"]
                .as_bool()
                .unwrap_or(model_type == "qwen2"),
            rope_llama3: rope_llama3(j)?,
            ..ArchOptions::default()
        }
    };
    arch.layer_types = layer_types(j, n_layers, gemma)?;
    if arch.layer_types.contains(&LayerType::SlidingAttention) {
        arch.sliding_window = opt_uint(j, "sliding_window")?;
    }
    arch.max_positions = opt_uint(j, "max_position_embeddings")?;
    Ok(KvcConfig {
        model_type: MODEL_TYPE.into(),
        vocab_size: uint(j, "vocab_size")?,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads: opt_uint(j, "num_key_value_heads")?.unwrap_or(n_heads),
        d_head: Some(d_head),
        d_ff: uint(j, "intermediate_size")?,
        norm_eps: opt_float(j, "rms_norm_eps")?.unwrap_or(1e-6),
        rope: RopeMode::All,
        rope_dims: None,
        rope_theta: rope_theta(j, "full_attention")?.unwrap_or(10000.0),
        qk_norm: gemma || model_type == "qwen3",
        tied_kv: false,
        sink: false,
        tie_embeddings: json["tie_word_embeddings"]
            .as_bool()
            .or(j["tie_word_embeddings"].as_bool())
            .unwrap_or(gemma),
        key_shift: false,
        attention: AttentionKind::Full,
        compression: None,
        init_std: 0.02,
        overlay: None,
        arch,
    })
}

/// `layer_types` (transformers' list), else Gemma 3's pattern, else none (all full).
fn layer_types(
    j: &Value,
    n_layers: usize,
    gemma: bool,
) -> std::result::Result<Vec<LayerType>, String> {
    if let Some(list) = j["layer_types"].as_array() {
        return list
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full_attention") => Ok(LayerType::FullAttention),
                Some("sliding_attention") => Ok(LayerType::SlidingAttention),
                _ => Err(format!(
                    "key `layer_types[{i}]`: {t} (expected \"full_attention\" or \"sliding_attention\")"
                )),
            })
            .collect();
    }
    if gemma {
        let pattern = opt_uint(j, "sliding_window_pattern")?.unwrap_or(gemma3::SLIDING_PATTERN);
        return Ok(gemma3::layer_types(n_layers, pattern));
    }
    // Mistral / Qwen2 with `use_sliding_window`: every layer slides.
    let slides = j["use_sliding_window"].as_bool() == Some(true) || j["model_type"] == "mistral";
    if slides && opt_uint(j, "sliding_window")?.is_some() {
        return Ok(vec![LayerType::SlidingAttention; n_layers]);
    }
    Ok(Vec::new())
}
