//! Gemma 3 (text): pre- and post-norms around attention and MLP, per-head query/key
//! RMSNorms, local (sliding-window) and global layers with their own RoPE bases,
//! embeddings scaled by `sqrt(d_model)`, GeGLU (tanh GELU), attention scaled by
//! `query_pre_attn_scalar^-0.5`.

use super::gguf_name_with;
use super::llama::{base_config, meta};
use crate::error::Result;
use crate::model::gguf::GgufFile;
use crate::model::kvc::{ArchOptions, KvcConfig, LayerType, MlpAct};

/// kvc parameter (under `blocks.{l}.`) -> llama.cpp tensor (under `blk.{l}.`).
const BLOCK_NAMES: &[(&str, &str)] = &[
    ("attn_norm", "attn_norm"),
    ("attn.w_q", "attn_q"),
    ("attn.w_k", "attn_k"),
    ("attn.w_v", "attn_v"),
    ("attn.w_o", "attn_output"),
    ("attn.q_norm", "attn_q_norm"),
    ("attn.k_norm", "attn_k_norm"),
    ("post_attn_norm", "post_attention_norm"),
    ("mlp_norm", "ffn_norm"),
    ("mlp.gate", "ffn_gate"),
    ("mlp.up", "ffn_up"),
    ("mlp.down", "ffn_down"),
    ("post_mlp_norm", "post_ffw_norm"),
];

/// The GGUF tensor of a kvc parameter name.
pub fn gguf_name(name: &str) -> Option<String> {
    gguf_name_with(name, BLOCK_NAMES)
}

/// Every `pattern`-th layer is global, the others slide (transformers' default
/// `sliding_window_pattern = 6` for Gemma 3, which llama.cpp's metadata does not carry).
pub const SLIDING_PATTERN: usize = 6;
/// The RoPE base of local layers (transformers' `rope_local_base_freq` default).
pub const LOCAL_ROPE_THETA: f64 = 10_000.0;

/// The layer types of `n` layers: global every [`SLIDING_PATTERN`]-th.
pub fn layer_types(n: usize, pattern: usize) -> Vec<LayerType> {
    (0..n)
        .map(|l| {
            if (l + 1) % pattern.max(1) == 0 {
                LayerType::FullAttention
            } else {
                LayerType::SlidingAttention
            }
        })
        .collect()
}

/// The options Gemma 3 sets on a kvc decoder of width `d_model`.
pub fn arch_options(d_model: usize, query_pre_attn_scalar: f64) -> ArchOptions {
    ArchOptions {
        name: Some("gemma3".into()),
        mlp_act: MlpAct::GeluTanh,
        post_norms: true,
        // transformers multiplies by the f32 (model dtype) value of sqrt(hidden).
        embed_scale: Some((d_model as f64).sqrt() as f32 as f64),
        attn_scale: Some(query_pre_attn_scalar.powf(-0.5)),
        rope_local_theta: Some(LOCAL_ROPE_THETA),
        ..ArchOptions::default()
    }
}

/// The kvc config of a Gemma 3 GGUF.
pub fn config_from_gguf(file: &GgufFile) -> Result<KvcConfig> {
    let a = "gemma3";
    let mut c = base_config(file, a, 1_000_000.0)?;
    let mut arch = arch_options(c.d_model, c.d_head() as f64);
    arch.layer_types = layer_types(c.n_layers, SLIDING_PATTERN);
    arch.sliding_window = Some(meta(file, a, "attention.sliding_window")?);
    arch.max_positions = c.arch.max_positions;
    arch.final_softcap = file.opt_float(&format!("{a}.final_logit_softcapping"))?;
    c.arch = arch;
    // Gemma 3 always normalises queries and keys: a file without the norms is refused
    // (a missing tensor, named) rather than loaded without them.
    c.qk_norm = true;
    Ok(c)
}
