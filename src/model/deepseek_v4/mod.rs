//! DeepSeek-V4 (Flash / Pro), matching transformers 5.24 `models/deepseek_v4`
//! (`DeepseekV4ForCausalLM`) in f32 on a stateless prefill. One concept per file:
//!
//! | file | what |
//! |---|---|
//! | `config.rs` | config.json (transformers or release form), resolved and validated |
//! | `rope.rs` | default / YaRN inverse frequencies, interleaved partial RoPE |
//! | `attention.rs` | low-rank queries, shared K = V head, window + compressed keys, sinks, grouped output |
//! | `pooler.rs` | the pooling compressor shared by the compressors and the indexer |
//! | `compressor.rs` | HCA (non-overlapping) and CSA (overlapping two-halves) pooling |
//! | `indexer.rs` | lightning indexer and its top-k selection |
//! | `mhc.rs` | hyper-connections (pre / post / comb with Sinkhorn), hyper-head |
//! | `moe.rs` | router (sqrtsoftplus / sigmoid / softmax, bias, hash routing), experts, shared expert |
//! | `model.rs` | the decoder, `LanguageModel` implementation |
//! | `checkpoint.rs` | the three checkpoint spellings, FP8 block dequantisation, shards |
//!
//! docs/deepseek_v4_reference.md is the behaviour spec; docs/models.md documents the
//! hooks, the name table and FP8 loading.

pub mod attention;
pub mod checkpoint;
pub mod compressor;
pub mod config;
pub mod indexer;
pub mod mhc;
pub mod model;
pub mod moe;
pub mod pooler;
pub mod rope;
pub mod save;
pub mod span_cache;
pub mod token_blocks;

use std::path::Path;

use burn::tensor::Device;

pub use checkpoint::V4Checkpoint;
pub use config::{DeepseekV4Config, MODEL_TYPE};
pub use model::DeepseekV4Model;
pub use save::save;

use crate::error::{Error, Result};
use crate::model::read_config_json;
use crate::model::stored::Residency;
use crate::model::weights::Vb;

/// Load a DeepSeek-V4 directory: `config.json` + `model.safetensors` or shards with
/// `model.safetensors.index.json`, in any of the supported namings, its BF16 / FP8 / FP4
/// weights kept as stored ([`Residency::Stored`]).
pub fn load(dir: &Path, device: &Device) -> Result<DeepseekV4Model> {
    load_with(dir, device, Residency::Stored)
}

/// [`load`] with the weights kept as stored or dequantised to f32 on load.
pub fn load_with(dir: &Path, device: &Device, residency: Residency) -> Result<DeepseekV4Model> {
    let (path, text, _) = read_config_json(dir)?;
    let config = DeepseekV4Config::from_json(&text).map_err(|e| Error::Config {
        path: path.clone(),
        message: e.to_string(),
    })?;
    use crate::model::memory;
    let at = |e: Error| e.context(path.display().to_string());
    // The config's f32 size: refused beyond any machine, and beyond this one when the
    // weights are to be dequantised on load.
    if residency == Residency::F32 || 4.0 * config.n_params_f64() > memory::HARD_LIMIT_BYTES {
        config.check_memory().map_err(at)?;
    }
    let src = V4Checkpoint::open_dir(dir, config.fp8_block)?.with_residency(residency);
    if residency == Residency::Stored {
        // About the checkpoint's bytes (small 1-D tensors read as f32 aside).
        memory::check(
            "the model's weights (as stored)",
            &format!("the checkpoint in {}", dir.display()),
            src.file_bytes() as f64,
        )
        .map_err(at)?;
    }
    let model = DeepseekV4Model::new(&config, &Vb::new(&src, device))?;
    src.check_all_used()?;
    Ok(model)
}
