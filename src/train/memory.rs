//! Training's memory estimate: the weights, the AdamW state, the gradients and one
//! batch's activations, refused upfront (through [`crate::model::memory::check`]) when
//! they cannot fit.

use super::{ModelConfig, OrganismFile};
use crate::error::Result;
use crate::model::memory;

/// Refuse to train `file`'s model when the weights, the AdamW state, the gradients and
/// one batch's activations (kept for the backward pass) cannot fit.
pub fn check_training(file: &OrganismFile, seq_len: usize) -> Result<()> {
    let (params, info_keys, d, layers, vocab) = match &file.model {
        ModelConfig::Kvc(c) => (
            c.n_params_f64(),
            "[model] sizes",
            c.d_model as f64,
            c.n_layers as f64,
            c.vocab_size as f64,
        ),
        ModelConfig::DeepseekV4 { resolved, .. } => (
            resolved.n_params_f64(),
            "[model] sizes",
            resolved.hidden_size as f64 * resolved.hc_mult as f64,
            resolved.num_hidden_layers as f64,
            resolved.vocab_size as f64,
        ),
    };
    // weights + gradients + two AdamW moments + a copy during the update.
    let state = 5.0 * 4.0 * params;
    let tokens = file.train.batch_size as f64 * seq_len as f64;
    // Autodiff keeps every layer's intermediate tensors: ~24 residual-sized per layer.
    let acts = tokens * 4.0 * (3.0 * vocab + 24.0 * d * layers.max(1.0));
    memory::check(
        &format!(
            "training `{}` ({} parameters, {} tokens per step)",
            file.organism.name, params as u64, tokens as u64
        ),
        &format!(
            "{info_keys} or [train] batch_size = {}",
            file.train.batch_size
        ),
        state + acts,
    )
}
