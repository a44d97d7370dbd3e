//! Reading DeepSeek-V4 checkpoints in any of the three spellings, BF16 / F32 / FP8.
//!
//! The model asks for transformers' module paths (the canonical names,
//! `model.layers.3.self_attn.kv_proj.weight`). A file key is mapped onto them by
//! [`canonical_name`]:
//!
//! 1. module paths as they are (`torch.save(model.state_dict())`, older files);
//! 2. what transformers 5.24 `save_pretrained` writes: release names with a `model.`
//!    prefix (`model.layers.3.attn.wkv.weight`, `model.layers.3.attn.norm.weight` for the
//!    kv norm, per-expert `ffn.experts.E.w1/w2/w3`), `head.weight`;
//! 3. DeepSeek's release naming (`layers.3.attn.wkv.weight`, `embed.weight`,
//!    `hc_head_fn`, ...) with FP8 weights and `mtp.*` tensors (ignored).
//!
//! The whole mapping is [`RELEASE_NAMES`] (per layer) plus [`TOP_NAMES`]. Per-expert
//! `w1` (gate) / `w3` (up) / `w2` (down) tensors are stacked into transformers'
//! `experts.gate_up_proj` `[E, 2I, H]` (`[w1; w3]` per expert) and `experts.down_proj`
//! `[E, H, I]`.
//!
//! FP8: a 2-D `NAME.weight` with a sibling `NAME.scale` (release, ue8m0) or
//! `NAME.weight_scale_inv` (transformers / V3 style, f32) is block-quantised; its value
//! is `W[r, c] = weight[r, c] * scale[r / B0, c / B1]` with the block `[B0, B1]` from
//! `quantization_config.weight_block_size` (default 128 x 128) and a scale grid of
//! `[ceil(rows / B0), ceil(cols / B1)]`. Everything is dequantised to f32 as it is read,
//! one tensor at a time. An F8 weight without a scale is an error.
//!
//! FP4 (`expert_dtype = "fp4"`, the routed experts of V4 releases): an I8 / U8 weight
//! `[rows, cols / 2]` with a sibling scale `[rows, cols / 32]` holds two e2m1 codes per
//! byte (even column in the low nibble); `W[r, c] = e2m1(code) * scale[r, c / 32]`.
//! The layout and the value table are transformers' (`FP8Experts` with
//! `expert_dtype="fp4"`, `Fp8Dequantize`). Scales may be F8_E8M0, U8 exponents, or
//! F32 / BF16 / F16; any other scale dtype, or a scale of the wrong shape, is an error
//! naming the scale tensor and its weight.
//!
//! Errors name the file and the tensor: unknown tensors (never asked for), missing ones,
//! wrong shapes, wrong scale grids, unsupported dtypes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::super::safetensors_io::{SafetensorsReader, StDtype};
use super::super::weights::{Init, UsedTensors, WeightSource, inside_model_dir, shard_paths};
use crate::error::{Error, Result};

/// Per-layer names: (DeepSeek release suffix after `layers.N.`, transformers module
/// suffix after `model.layers.N.`). `save_pretrained` (5.24) writes the release suffix
/// with a `model.` prefix.
pub const RELEASE_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    (
        "attn.compressor.wkv.weight",
        "self_attn.compressor.kv_proj.weight",
    ),
    (
        "attn.compressor.wgate.weight",
        "self_attn.compressor.gate_proj.weight",
    ),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    (
        "attn.compressor.norm.weight",
        "self_attn.compressor.kv_norm.weight",
    ),
    (
        "attn.indexer.compressor.wkv.weight",
        "self_attn.compressor.indexer.kv_proj.weight",
    ),
    (
        "attn.indexer.compressor.wgate.weight",
        "self_attn.compressor.indexer.gate_proj.weight",
    ),
    (
        "attn.indexer.compressor.ape",
        "self_attn.compressor.indexer.position_bias",
    ),
    (
        "attn.indexer.compressor.norm.weight",
        "self_attn.compressor.indexer.kv_norm.weight",
    ),
    (
        "attn.indexer.wq_b.weight",
        "self_attn.compressor.indexer.q_b_proj.weight",
    ),
    (
        "attn.indexer.weights_proj.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
    ),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    (
        "ffn.shared_experts.w1.weight",
        "mlp.shared_experts.gate_proj.weight",
    ),
    (
        "ffn.shared_experts.w2.weight",
        "mlp.shared_experts.down_proj.weight",
    ),
    (
        "ffn.shared_experts.w3.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
    (
        "ffn.shared_experts.w1.bias",
        "mlp.shared_experts.gate_proj.bias",
    ),
    (
        "ffn.shared_experts.w2.bias",
        "mlp.shared_experts.down_proj.bias",
    ),
    (
        "ffn.shared_experts.w3.bias",
        "mlp.shared_experts.up_proj.bias",
    ),
];

/// Top-level names: (file spelling without a `model.` prefix, module path).
pub const TOP_NAMES: &[(&str, &str)] = &[
    ("embed.weight", "model.embed_tokens.weight"),
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
    ("hc_head.hc_fn", "model.hc_head.hc_fn"),
    ("hc_head.hc_base", "model.hc_head.hc_base"),
    ("hc_head.hc_scale", "model.hc_head.hc_scale"),
];

/// What a file key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileKey {
    /// A tensor with this module path.
    Module(String),
    /// One routed expert's matrix: `part` 0 = gate (w1), 1 = down (w2), 2 = up (w3).
    Expert {
        layer: usize,
        expert: usize,
        part: usize,
    },
    /// Not part of the forward (`mtp.*`, the multi-token-prediction layer).
    Ignored,
}

/// Map a file key to what it holds (see the module docs).
pub fn canonical_name(key: &str) -> FileKey {
    if key.starts_with("mtp.") || key.contains(".mtp.") {
        return FileKey::Ignored;
    }
    let k = key.strip_prefix("model.").unwrap_or(key);
    if let Some((_, m)) = TOP_NAMES.iter().find(|(f, _)| *f == k) {
        return FileKey::Module(m.to_string());
    }
    if let Some(rest) = k.strip_prefix("layers.")
        && let Some((n, rest)) = rest.split_once('.')
        && let Ok(layer) = n.parse::<usize>()
    {
        if let Some(e) = expert_part(layer, rest) {
            return e;
        }
        let m = RELEASE_NAMES
            .iter()
            .find(|(r, _)| *r == rest)
            .map(|(_, m)| *m)
            .unwrap_or(rest);
        return FileKey::Module(format!("model.layers.{layer}.{m}"));
    }
    FileKey::Module(key.to_string())
}

fn expert_part(layer: usize, rest: &str) -> Option<FileKey> {
    let r = rest
        .strip_prefix("ffn.experts.")
        .or_else(|| rest.strip_prefix("mlp.experts."))?;
    let (e, leaf) = r.split_once('.')?;
    let expert = e.parse::<usize>().ok()?;
    let part = match leaf {
        "w1.weight" | "gate_proj.weight" => 0,
        "w2.weight" | "down_proj.weight" => 1,
        "w3.weight" | "up_proj.weight" => 2,
        _ => return None,
    };
    Some(FileKey::Expert {
        layer,
        expert,
        part,
    })
}

/// The release spelling of a module path, for error messages.
pub fn release_name(module: &str) -> Option<String> {
    if let Some((f, _)) = TOP_NAMES.iter().find(|(_, m)| *m == module) {
        return Some(f.to_string());
    }
    let rest = module.strip_prefix("model.layers.")?;
    let (n, rest) = rest.split_once('.')?;
    if let Some(r) = rest.strip_prefix("mlp.experts.") {
        return Some(match r {
            "gate_up_proj" => format!("layers.{n}.ffn.experts.E.w1.weight + w3"),
            _ => format!("layers.{n}.ffn.experts.E.w2.weight"),
        });
    }
    RELEASE_NAMES
        .iter()
        .find(|(_, m)| *m == rest)
        .map(|(r, _)| format!("layers.{n}.{r}"))
}

/// A DeepSeek-V4 checkpoint directory opened for reading.
pub struct V4Checkpoint {
    reader: SafetensorsReader,
    /// module path -> file key
    names: BTreeMap<String, String>,
    /// (layer, expert) -> file keys of w1, w2, w3
    experts: BTreeMap<(usize, usize), [Option<String>; 3]>,
    /// weight file key -> scale file key
    scales: BTreeMap<String, String>,
    ignored: BTreeSet<String>,
    used: UsedTensors,
    block: [usize; 2],
    /// For messages about tensors absent from every file.
    origin: PathBuf,
}

impl V4Checkpoint {
    /// Open `model.safetensors` or the shards of `model.safetensors.index.json` in `dir`.
    /// `block` is the FP8 block size.
    pub fn open_dir(dir: &Path, block: [usize; 2]) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let (reader, origin) = if single.exists() {
            let file = inside_model_dir(dir, "model.safetensors", &single)?;
            (SafetensorsReader::open(&file)?, single)
        } else if index.exists() {
            (SafetensorsReader::open_many(&shard_paths(&index)?)?, index)
        } else {
            return Err(Error::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in the model directory",
                ),
            });
        };
        Self::from_reader(reader, origin, block)
    }

    /// Index an open reader.
    pub fn from_reader(
        reader: SafetensorsReader,
        origin: PathBuf,
        block: [usize; 2],
    ) -> Result<Self> {
        let mut names: BTreeMap<String, String> = BTreeMap::new();
        let mut experts: BTreeMap<(usize, usize), [Option<String>; 3]> = BTreeMap::new();
        let mut scales = BTreeMap::new();
        let mut ignored = BTreeSet::new();
        let all: Vec<String> = reader.names().map(|s| s.to_string()).collect();
        let present: BTreeSet<&str> = all.iter().map(|s| s.as_str()).collect();
        for key in &all {
            // Block scales belong to their weight.
            let base = key
                .strip_suffix(".weight_scale_inv")
                .or_else(|| key.strip_suffix(".scale"));
            if let Some(base) = base {
                let w = format!("{base}.weight");
                if present.contains(w.as_str()) {
                    scales.insert(w, key.clone());
                    continue;
                }
            }
            let dup = |other: &str| {
                Error::tensor(
                    reader.path_of(key),
                    key.as_str(),
                    format!("names the same parameter as `{other}` (two spellings of one tensor)"),
                )
            };
            match canonical_name(key) {
                FileKey::Ignored => {
                    ignored.insert(key.clone());
                }
                FileKey::Module(m) => {
                    if let Some(prev) = names.insert(m, key.clone()) {
                        return Err(dup(&prev));
                    }
                }
                FileKey::Expert {
                    layer,
                    expert,
                    part,
                } => {
                    let slot = &mut experts.entry((layer, expert)).or_default()[part];
                    if let Some(prev) = slot.replace(key.clone()) {
                        return Err(dup(&prev));
                    }
                }
            }
        }
        // Scales of ignored weights are ignored too.
        for (w, s) in &scales {
            if ignored.contains(w) {
                ignored.insert(s.clone());
            }
        }
        Ok(V4Checkpoint {
            reader,
            names,
            experts,
            scales,
            ignored,
            used: UsedTensors::default(),
            block,
            origin,
        })
    }

    /// The underlying reader.
    pub fn reader(&self) -> &SafetensorsReader {
        &self.reader
    }

    fn mark(&self, key: &str) {
        self.used.mark(key);
    }

    fn missing(&self, module: &str, what: &str) -> Error {
        let hint = release_name(module)
            .map(|r| format!(" (release name `{r}`)"))
            .unwrap_or_default();
        Error::tensor(
            &self.origin,
            module,
            format!("{what}missing from the checkpoint{hint}"),
        )
    }

    /// Read the float tensor `key`, check its shape, dequantise block-scaled FP8 and
    /// packed FP4 (see [`V4Checkpoint::read_fp4`]).
    fn read_float(&self, key: &str, want: &[usize]) -> Result<Vec<f32>> {
        let path = self.reader.path_of(key);
        let dtype = self.reader.entry(key).map(|e| e.dtype);
        let v = match (self.scales.get(key), dtype) {
            (Some(sk), Some(StDtype::I8 | StDtype::U8)) => self.read_fp4(key, sk, want)?,
            (Some(sk), _) => self.read_fp8(key, sk, want)?,
            (None, Some(StDtype::F8E4M3)) => {
                return Err(Error::tensor(
                    path,
                    key,
                    "F8_E4M3 weight without a `.scale` / `.weight_scale_inv` tensor (block scales are required)",
                ));
            }
            (None, Some(StDtype::I8 | StDtype::U8)) if want.len() == 2 => {
                return Err(Error::tensor(
                    path,
                    key,
                    "8-bit integer weight without a `.scale` tensor: a packed FP4 weight (two e2m1 values per byte) needs its ue8m0 scales, one per row and 32 columns",
                ));
            }
            (None, _) => {
                let (found, v) = self.reader.read_f32(key)?;
                check_shape(&path, key, want, &found)?;
                v
            }
        };
        // After dequantisation: a NaN scale or an FP8 NaN byte is as bad as a NaN weight.
        crate::model::safetensors_io::check_finite(&path, key, &v)?;
        self.mark(key);
        Ok(v)
    }

    /// Block scales of weight `key` as f32 multipliers: F8_E8M0 (ue8m0), U8 (ue8m0
    /// exponent bytes, as transformers reads them), or F32 / BF16 / F16 values. Any other
    /// dtype is an error naming the scale tensor.
    fn read_scale(&self, key: &str, sk: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let dtype = self.reader.entry(sk).map(|e| e.dtype);
        match dtype {
            Some(StDtype::F8E8M0 | StDtype::F32 | StDtype::BF16 | StDtype::F16) => {
                self.reader.read_f32(sk)
            }
            Some(StDtype::U8) => {
                let (shape, b) = self.reader.read_i64(sk)?;
                let v = b
                    .iter()
                    .map(|&e| crate::model::safetensors_io::f8_e8m0_to_f32(e as u8))
                    .collect();
                Ok((shape, v))
            }
            _ => {
                let name = self
                    .reader
                    .entry(sk)
                    .map(|e| e.dtype_name.clone())
                    .unwrap_or_default();
                Err(Error::tensor(
                    self.reader.path_of(sk),
                    sk,
                    format!(
                        "block scales of `{key}` have dtype {name}; expected F8_E8M0 (ue8m0), U8 (ue8m0 exponents) or F32 / BF16 / F16"
                    ),
                ))
            }
        }
    }

    /// FP8 (or any float) weight with block scales: `W[r, c] = weight[r, c] * scale[r / B0, c / B1]`.
    fn read_fp8(&self, key: &str, sk: &str, want: &[usize]) -> Result<Vec<f32>> {
        let path = self.reader.path_of(key);
        let (found, mut v) = self.reader.read_f32(key)?;
        check_shape(&path, key, want, &found)?;
        let [rows, cols] = match found[..] {
            [r, c] => [r, c],
            _ => {
                return Err(Error::tensor(
                    path,
                    key,
                    format!(
                        "block-scaled weights must be 2-D, found shape {found:?} with scale `{sk}`"
                    ),
                ));
            }
        };
        let [b0, b1] = self.block;
        let grid = [rows.div_ceil(b0), cols.div_ceil(b1)];
        let (sshape, s) = self.read_scale(key, sk)?;
        if sshape != grid {
            return Err(Error::tensor(
                self.reader.path_of(sk),
                sk,
                format!(
                    "scale grid {sshape:?} does not fit weight `{key}` {found:?} with blocks {:?} (expected {grid:?})",
                    self.block
                ),
            ));
        }
        for r in 0..rows {
            let srow = &s[(r / b0) * grid[1]..(r / b0 + 1) * grid[1]];
            for (c, x) in v[r * cols..(r + 1) * cols].iter_mut().enumerate() {
                *x *= srow[c / b1];
            }
        }
        self.mark(sk);
        Ok(v)
    }

    /// Packed FP4 (`expert_dtype = "fp4"`, transformers' `FP8Experts` / `Fp8Dequantize`
    /// layout): I8 / U8 `[rows, cols / 2]`, two e2m1 codes per byte (even column in the
    /// low nibble), scales `[rows, cols / 32]`:
    /// `W[r, c] = e2m1(code[r, c]) * scale[r, c / 32]`.
    fn read_fp4(&self, key: &str, sk: &str, want: &[usize]) -> Result<Vec<f32>> {
        let path = self.reader.path_of(key);
        let (found, bytes) = self.reader.read_i64(key)?;
        let [rows, cols] = match want[..] {
            [r, c] => [r, c],
            _ => {
                return Err(Error::tensor(
                    path,
                    key,
                    format!(
                        "packed FP4 weight where the model needs a {}-D tensor {want:?}",
                        want.len()
                    ),
                ));
            }
        };
        if !cols.is_multiple_of(FP4_GROUP) || found != [rows, cols / 2] {
            return Err(Error::tensor(
                path,
                key,
                format!(
                    "packed FP4 weight (two e2m1 values per byte): the model needs [{rows}, {cols}], so the file must hold [{rows}, {}] with {cols} a multiple of {FP4_GROUP}; found {found:?}",
                    cols / 2
                ),
            ));
        }
        let grid = [rows, cols / FP4_GROUP];
        let (sshape, s) = self.read_scale(key, sk)?;
        if sshape != grid {
            return Err(Error::tensor(
                self.reader.path_of(sk),
                sk,
                format!(
                    "FP4 scale shape {sshape:?} does not fit weight `{key}` (packed {found:?}, {rows} x {cols} values): expected {grid:?}, one scale per row and {FP4_GROUP} columns"
                ),
            ));
        }
        let mut v = Vec::with_capacity(rows * cols);
        for (i, &b) in bytes.iter().enumerate() {
            let (r, c) = (i / (cols / 2), 2 * (i % (cols / 2)));
            let srow = &s[r * grid[1]..(r + 1) * grid[1]];
            let b = b as u8;
            v.push(E2M1[(b & 0x0f) as usize] * srow[c / FP4_GROUP]);
            v.push(E2M1[(b >> 4) as usize] * srow[(c + 1) / FP4_GROUP]);
        }
        self.mark(sk);
        Ok(v)
    }

    /// Stack per-expert matrices: `part` 0/2 -> gate_up `[E, 2I, H]`, 1 -> down `[E, H, I]`.
    fn stack_experts(&self, module: &str, layer: usize, shape: &[usize]) -> Result<Vec<f32>> {
        let gate_up = module.ends_with("gate_up_proj");
        let (e, rows, cols) = (shape[0], shape[1], shape[2]);
        if !self.experts.keys().any(|(l, _)| *l == layer) {
            return Err(self.missing(module, ""));
        }
        let mut out = Vec::with_capacity(e * rows * cols);
        for ex in 0..e {
            let parts: &[(usize, usize, &str)] = if gate_up {
                &[(0, rows / 2, "w1 (gate)"), (2, rows / 2, "w3 (up)")]
            } else {
                &[(1, rows, "w2 (down)")]
            };
            for &(part, r, what) in parts {
                let key = self
                    .experts
                    .get(&(layer, ex))
                    .and_then(|p| p[part].as_ref())
                    .ok_or_else(|| {
                        Error::tensor(
                            &self.origin,
                            format!(
                                "layers.{layer}.ffn.experts.{ex}.w{}.weight",
                                [1, 2, 3][part]
                            ),
                            format!(
                                "expert {ex} {what} of layer {layer} is missing from the checkpoint"
                            ),
                        )
                    })?;
                out.extend(self.read_float(key, &[r, cols])?);
            }
        }
        Ok(out)
    }

    /// An error listing the tensors the model never asked for (`mtp.*` excepted).
    pub fn check_all_used(&self) -> Result<()> {
        self.used.check(
            &self.reader,
            &|n| self.ignored.contains(n),
            "the DeepSeek-V4 model",
        )
    }
}

/// Columns per FP4 scale (transformers' `sf_gran_k = 32`).
pub const FP4_GROUP: usize = 32;

/// The e2m1 value of each 4-bit code (bit 3 is the sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

fn check_shape(path: &Path, key: &str, want: &[usize], found: &[usize]) -> Result<()> {
    if found != want {
        return Err(Error::tensor(
            path,
            key,
            format!("expected shape {want:?}, found {found:?}"),
        ));
    }
    Ok(())
}

impl WeightSource for V4Checkpoint {
    fn float(&self, name: &str, shape: &[usize], _init: Init) -> Result<Vec<f32>> {
        if let Some(key) = self.names.get(name) {
            return self.read_float(key, shape);
        }
        if shape.len() == 3
            && (name.ends_with(".mlp.experts.gate_up_proj")
                || name.ends_with(".mlp.experts.down_proj"))
            && let Some(layer) = name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(n, _)| n.parse::<usize>().ok())
        {
            return self.stack_experts(name, layer, shape);
        }
        Err(self.missing(name, ""))
    }

    fn int(&self, name: &str, shape: &[usize], _init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        let key = self.names.get(name).ok_or_else(|| self.missing(name, ""))?;
        let (found, v) = self.reader.read_i64(key)?;
        if found != shape {
            return Err(Error::tensor(
                self.reader.path_of(key),
                key.as_str(),
                format!("expected shape {shape:?}, found {found:?}"),
            ));
        }
        self.mark(key);
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_spellings_map_to_module_paths() {
        let m = |s: &str| FileKey::Module(s.to_string());
        assert_eq!(
            canonical_name("layers.3.attn.wkv.weight"),
            m("model.layers.3.self_attn.kv_proj.weight")
        );
        assert_eq!(
            canonical_name("model.layers.3.attn.wkv.weight"),
            m("model.layers.3.self_attn.kv_proj.weight")
        );
        assert_eq!(
            canonical_name("model.layers.3.self_attn.kv_proj.weight"),
            m("model.layers.3.self_attn.kv_proj.weight")
        );
        assert_eq!(
            canonical_name("model.layers.0.attn.norm.weight"),
            m("model.layers.0.self_attn.kv_norm.weight")
        );
        assert_eq!(canonical_name("model.norm.weight"), m("model.norm.weight"));
        assert_eq!(canonical_name("norm.weight"), m("model.norm.weight"));
        assert_eq!(canonical_name("head.weight"), m("lm_head.weight"));
        assert_eq!(canonical_name("hc_head_fn"), m("model.hc_head.hc_fn"));
        assert_eq!(
            canonical_name("model.hc_head.hc_base"),
            m("model.hc_head.hc_base")
        );
        assert_eq!(
            canonical_name("layers.1.attn.indexer.compressor.ape"),
            m("model.layers.1.self_attn.compressor.indexer.position_bias")
        );
        assert_eq!(
            canonical_name("layers.2.ffn.experts.5.w3.weight"),
            FileKey::Expert {
                layer: 2,
                expert: 5,
                part: 2
            }
        );
        assert_eq!(canonical_name("mtp.0.attn_norm.weight"), FileKey::Ignored);
        assert_eq!(
            release_name("model.layers.4.self_attn.compressor.position_bias").as_deref(),
            Some("layers.4.attn.compressor.ape")
        );
    }
}
