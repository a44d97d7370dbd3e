//! The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): pre-norm RMSNorm
//! blocks, grouped-query attention with RoPE (half-split pairs), SwiGLU MLP; Qwen2 adds
//! query/key/value biases, Qwen3 per-head query/key RMSNorms.

use super::gguf_name_with;
use crate::error::{Error, Result};
use crate::model::gguf::GgufFile;
use crate::model::kvc::{ArchOptions, AttentionKind, KvcConfig, MODEL_TYPE, RopeMode};

/// kvc parameter (under `blocks.{l}.`) -> llama.cpp tensor (under `blk.{l}.`).
const BLOCK_NAMES: &[(&str, &str)] = &[
    ("attn_norm", "attn_norm"),
    ("attn.w_q", "attn_q"),
    ("attn.w_k", "attn_k"),
    ("attn.w_v", "attn_v"),
    ("attn.w_o", "attn_output"),
    ("attn.q_norm", "attn_q_norm"),
    ("attn.k_norm", "attn_k_norm"),
    ("mlp_norm", "ffn_norm"),
    ("mlp.gate", "ffn_gate"),
    ("mlp.up", "ffn_up"),
    ("mlp.down", "ffn_down"),
];

/// The GGUF tensor of a kvc parameter name.
pub fn gguf_name(name: &str) -> Option<String> {
    gguf_name_with(name, BLOCK_NAMES)
}

/// Whether the file holds a tensor.
fn has(file: &GgufFile, name: &str) -> bool {
    file.tensors().iter().any(|t| t.name == name)
}

/// The vocabulary size: `{arch}.vocab_size`, else the token list's length, else the
/// embedding's rows.
fn vocab_size(file: &GgufFile, arch: &str) -> Result<usize> {
    if let Some(v) = file.opt_uint(&format!("{arch}.vocab_size"))? {
        return Ok(v as usize);
    }
    if let Ok(t) = file.strings("tokenizer.ggml.tokens") {
        return Ok(t.len());
    }
    Ok(file.tensor("token_embd.weight")?.shape()[0])
}

/// A usize metadata value `{arch}.{key}`.
pub(super) fn meta(file: &GgufFile, arch: &str, key: &str) -> Result<usize> {
    Ok(file.uint(&format!("{arch}.{key}"))? as usize)
}

/// The kvc config of a Llama-family GGUF (`arch`: `llama`, `qwen2`, `qwen3`).
pub fn config_from_gguf(file: &GgufFile, arch: &str) -> Result<KvcConfig> {
    if has(file, "rope_freqs.weight") {
        return Err(Error::Tensor {
            path: file.path().to_path_buf(),
            tensor: "rope_freqs.weight".into(),
            message:
                "per-frequency RoPE factors (Llama 3.1+ long-context scaling) are not supported yet"
                    .into(),
        });
    }
    base_config(file, arch, 10000.0)
}

/// The config every GGUF architecture shares, from `{arch}.*` metadata and the tensors
/// present: sizes, RoPE (base `default_theta` when the file has none; partial when
/// `rope.dimension_count` is below the head width), Q/K norms and q/k/v biases when
/// their tensors exist, tied embeddings without `output.weight`, the context length.
pub(super) fn base_config(file: &GgufFile, arch: &str, default_theta: f64) -> Result<KvcConfig> {
    let d_model = meta(file, arch, "embedding_length")?;
    let n_heads = meta(file, arch, "attention.head_count")?;
    let n_kv_heads = file
        .opt_uint(&format!("{arch}.attention.head_count_kv"))?
        .map_or(n_heads, |v| v as usize);
    let d_head = file
        .opt_uint(&format!("{arch}.attention.key_length"))?
        .map_or(d_model / n_heads.max(1), |v| v as usize);
    let rot = file
        .opt_uint(&format!("{arch}.rope.dimension_count"))?
        .map_or(d_head, |v| v as usize);
    let (rope, rope_dims) = if rot == d_head {
        (RopeMode::All, None)
    } else {
        (RopeMode::Partial, Some(rot))
    };
    Ok(KvcConfig {
        model_type: MODEL_TYPE.into(),
        vocab_size: vocab_size(file, arch)?,
        d_model,
        n_layers: meta(file, arch, "block_count")?,
        n_heads,
        n_kv_heads,
        d_head: Some(d_head),
        d_ff: meta(file, arch, "feed_forward_length")?,
        norm_eps: file.float(&format!("{arch}.attention.layer_norm_rms_epsilon"))?,
        rope,
        rope_dims,
        rope_theta: file
            .opt_float(&format!("{arch}.rope.freq_base"))?
            .unwrap_or(default_theta),
        qk_norm: has(file, "blk.0.attn_q_norm.weight"),
        tied_kv: false,
        sink: false,
        tie_embeddings: !has(file, "output.weight"),
        key_shift: false,
        attention: AttentionKind::Full,
        compression: None,
        init_std: 0.02,
        overlay: None,
        arch: ArchOptions {
            name: Some(arch.to_string()),
            qkv_bias: has(file, "blk.0.attn_q.bias"),
            max_positions: file
                .opt_uint(&format!("{arch}.context_length"))?
                .map(|v| v as usize),
            ..ArchOptions::default()
        },
    })
}
