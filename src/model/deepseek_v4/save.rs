//! Saving a DeepSeek-V4 model (trained organisms) as `config.json` + `model.safetensors`
//! in module-path naming, which [`super::load`] reads back exactly.

use std::collections::BTreeMap;
use std::path::Path;

use super::DeepseekV4Model;
use crate::error::{Error, Result};
use crate::model::safetensors_io::{OwnedTensor, TensorValues, write_atomic};
use crate::model::weights::save_by_builder_names;

/// Write `dir/config.json` (the given config.json object) and `dir/model.safetensors`
/// (every parameter under its module path, plus the `tid2eid` tables of hash layers),
/// atomically. A model whose weights are kept as stored (loaded with
/// `Residency::Stored`) has nothing to save under their names: an error.
pub fn save(model: &DeepseekV4Model, config_json: &serde_json::Value, dir: &Path) -> Result<()> {
    let resident = model.resident_bytes();
    if let Some(kept) = resident
        .keys()
        .find(|k| !matches!(k.as_str(), "f32" | "i64"))
    {
        return Err(Error::Other(format!(
            "the model holds {kept} weights as stored (not parameters): load it with f32 weights (`--weights f32`, `load_with(.., Residency::F32)`) to save it"
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let vocab = model.config.vocab_size;
    let mut extra = BTreeMap::new();
    for (l, layer) in model.model.layers.iter().enumerate() {
        if let Some(t) = &layer.mlp.gate.tid2eid {
            extra.insert(
                format!("model.layers.{l}.mlp.gate.tid2eid"),
                OwnedTensor {
                    shape: vec![vocab, t.len() / vocab.max(1)],
                    data: TensorValues::I64(t.clone()),
                },
            );
        }
    }
    let config = model.config.clone();
    let device = burn::module::Module::devices(model)
        .into_iter()
        .next()
        .unwrap_or_default();
    save_by_builder_names(
        model,
        &|vb| DeepseekV4Model::new(&config, vb),
        &device,
        &dir.join("model.safetensors"),
        extra,
    )?;
    let text = serde_json::to_string_pretty(config_json).expect("JSON value serialises");
    write_atomic(&dir.join("config.json"), format!("{text}\n").as_bytes())
}
