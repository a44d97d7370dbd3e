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
//! `[ceil(rows / B0), ceil(cols / B1)]`. An F8 weight without a scale is an error.
//!
//! Residency ([`Residency`], [`V4Checkpoint::with_residency`]): FP8, FP4 and BF16 / F16
//! matrices (routed experts one matrix per expert) are handed to the model as their file
//! bytes ([`WeightSource::stored`], src/model/stored.rs) and dequantised where they are
//! used; with `f32` (the default of a directly opened checkpoint, what training needs)
//! everything is dequantised to f32 as it is read, one tensor at a time. Both go through
//! the same [`Block`] decoding, so both give the same bits.
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

use super::super::safetensors_io::{FiniteCheck, SafetensorsReader, StDtype, decode_floats};
use super::super::stored::{Block, Residency, Scales, StoredMatrix, decode_scales};
pub use super::super::stored::{E2M1, FP4_GROUP};
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
    /// Whether [`WeightSource::stored`] keeps weights as stored (default: f32, as
    /// training needs; the model loader asks for stored).
    residency: Residency,
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
            residency: Residency::F32,
        })
    }

    /// Keep BF16 / F16 / FP8 / FP4 weights as stored ([`Residency::Stored`]) or read them
    /// as f32.
    pub fn with_residency(mut self, residency: Residency) -> Self {
        self.residency = residency;
        self
    }

    /// The underlying reader.
    pub fn reader(&self) -> &SafetensorsReader {
        &self.reader
    }

    /// Bytes of the tensors the model reads (`mtp.*` aside), as stored in the files.
    pub fn file_bytes(&self) -> u64 {
        self.reader
            .names()
            .filter(|n| !self.ignored.contains(*n))
            .filter_map(|n| self.reader.entry(n))
            .map(|e| e.len)
            .sum()
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

    /// Read the float tensor `key` (model shape `want`) as f32: block-scaled FP8, packed
    /// FP4 and BF16 / F16 matrices through their [`Block`] ([`V4Checkpoint::block`]),
    /// other floats directly.
    fn read_float(&self, key: &str, want: &[usize]) -> Result<Vec<f32>> {
        let path = self.reader.path_of(key);
        let v = match self.block(key, want)? {
            Some(b) => b.to_f32(),
            None => {
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

    /// The tensor `key` kept as stored, checked as [`V4Checkpoint::read_float`] checks it
    /// (dequantised once, a block of rows at a time, then dropped); `None` when it is not
    /// a block-scaled, packed FP4 or BF16 / F16 matrix.
    fn read_stored(&self, key: &str, want: &[usize]) -> Result<Option<Block>> {
        let Some(b) = self.block(key, want)? else {
            return Ok(None);
        };
        // Most checkpoints are decided from their bytes and scales; otherwise every value
        // is dequantised and checked (naming the first bad one).
        if !b.surely_finite() {
            let mut check = FiniteCheck::default();
            let step = (CHECK_VALUES / b.cols().max(1)).max(1);
            for r0 in (0..b.rows()).step_by(step) {
                check.feed(&b.rows_f32(r0, (r0 + step).min(b.rows())));
            }
            check.finish(&self.reader.path_of(key), key)?;
        }
        self.mark(key);
        Ok(Some(b))
    }

    /// Whether `key` is kept as stored: it has block scales, or is a BF16 / F16 matrix.
    fn storable(&self, key: &str) -> bool {
        self.scales.contains_key(key)
            || matches!(
                self.reader.entry(key).map(|e| (e.dtype, e.shape.len())),
                Some((StDtype::BF16 | StDtype::F16, 2))
            )
    }

    /// The file tensor `key` as a [`Block`] of its bytes when it has block scales (FP8,
    /// or FP4 when packed in I8 / U8) or is a BF16 / F16 matrix; `None` for other dtypes.
    /// Shapes, scale grids and scale dtypes are checked here, naming the tensors.
    fn block(&self, key: &str, want: &[usize]) -> Result<Option<Block>> {
        let path = self.reader.path_of(key);
        let dtype = self.reader.entry(key).map(|e| e.dtype);
        match (self.scales.get(key), dtype) {
            (Some(sk), Some(StDtype::I8 | StDtype::U8)) => self.fp4_block(key, sk, want).map(Some),
            (Some(sk), _) => self.fp8_block(key, sk, want).map(Some),
            (None, Some(StDtype::F8E4M3)) => Err(Error::tensor(
                path,
                key,
                "F8_E4M3 weight without a `.scale` / `.weight_scale_inv` tensor (block scales are required)",
            )),
            (None, Some(StDtype::I8 | StDtype::U8)) if want.len() == 2 => Err(Error::tensor(
                path,
                key,
                "8-bit integer weight without a `.scale` tensor: a packed FP4 weight (two e2m1 values per byte) needs its ue8m0 scales, one per row and 32 columns",
            )),
            (None, Some(d @ (StDtype::BF16 | StDtype::F16))) if want.len() == 2 => {
                let (e, bytes) = self.reader.raw(key)?;
                check_shape(&path, key, want, &e.shape)?;
                made(Block::new([want[0], want[1]], d, bytes, None), &path, key).map(Some)
            }
            (None, _) => Ok(None),
        }
    }

    /// The block scales `sk` of weight `key`, a `grid` of scales of `block` values each:
    /// F8_E8M0 (ue8m0), U8 (ue8m0 exponents, as transformers reads them) or F32 / BF16 /
    /// F16. Another dtype, or another grid (`bad_grid` words it), is an error naming `sk`.
    fn scales_of(
        &self,
        key: &str,
        sk: &str,
        [grid, block]: [[usize; 2]; 2],
        bad_grid: impl Fn(&[usize]) -> String,
    ) -> Result<Scales> {
        let spath = self.reader.path_of(sk);
        let (e, bytes) = self.reader.raw(sk)?;
        if decode_scales(e.dtype, &[]).is_none() {
            return Err(Error::tensor(
                spath,
                sk,
                format!(
                    "block scales of `{key}` have dtype {}; expected F8_E8M0 (ue8m0), U8 (ue8m0 exponents) or F32 / BF16 / F16",
                    e.dtype_name
                ),
            ));
        }
        if e.shape != grid {
            return Err(Error::tensor(spath, sk, bad_grid(&e.shape)));
        }
        let s = Scales::new(e.dtype, grid, block, bytes)
            .ok_or_else(|| Error::tensor(&spath, sk, "scale bytes do not hold the scale grid"))?;
        self.mark(sk);
        Ok(s)
    }

    /// FP8 (or any float) weight with block scales: `W[r, c] = weight[r, c] * scale[r / B0, c / B1]`.
    fn fp8_block(&self, key: &str, sk: &str, want: &[usize]) -> Result<Block> {
        let path = self.reader.path_of(key);
        let (e, bytes) = self.reader.raw(key)?;
        let (found, dtype) = (e.shape.clone(), e.dtype);
        if decode_floats(dtype, &[]).is_none() {
            return Err(Error::tensor(
                path,
                key,
                format!(
                    "expected a floating-point tensor, found {} ({dtype:?})",
                    e.dtype_name
                ),
            ));
        }
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
        let scales = self.scales_of(key, sk, [grid, self.block], |sshape| {
            format!(
                "scale grid {sshape:?} does not fit weight `{key}` {found:?} with blocks {:?} (expected {grid:?})",
                self.block
            )
        })?;
        made(
            Block::new([rows, cols], dtype, bytes, Some(scales)),
            &path,
            key,
        )
    }

    /// Packed FP4 (`expert_dtype = "fp4"`, transformers' `FP8Experts` / `Fp8Dequantize`
    /// layout): I8 / U8 `[rows, cols / 2]`, two e2m1 codes per byte (even column in the
    /// low nibble), scales `[rows, cols / 32]`:
    /// `W[r, c] = e2m1(code[r, c]) * scale[r, c / 32]`.
    fn fp4_block(&self, key: &str, sk: &str, want: &[usize]) -> Result<Block> {
        let path = self.reader.path_of(key);
        let (e, bytes) = self.reader.raw(key)?;
        let (found, dtype) = (e.shape.clone(), e.dtype);
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
        let scales = self.scales_of(key, sk, [grid, [1, FP4_GROUP]], |sshape| {
            format!(
                "FP4 scale shape {sshape:?} does not fit weight `{key}` (packed {found:?}, {rows} x {cols} values): expected {grid:?}, one scale per row and {FP4_GROUP} columns"
            )
        })?;
        made(
            Block::new([rows, cols], dtype, bytes, Some(scales)),
            &path,
            key,
        )
    }

    /// The file keys of the routed experts of `module` (`model.layers.{layer}.mlp.experts.
    /// gate_up_proj` `[E, 2I, H]`: w1 then w3 of each expert; `down_proj` `[E, H, I]`:
    /// w2), per expert, with the rows each holds.
    fn expert_keys(
        &self,
        module: &str,
        layer: usize,
        shape: &[usize],
    ) -> Result<Vec<Vec<(&str, usize)>>> {
        let gate_up = module.ends_with("gate_up_proj");
        let (e, rows) = (shape[0], shape[1]);
        if !self.experts.keys().any(|(l, _)| *l == layer) {
            return Err(self.missing(module, ""));
        }
        let parts: &[(usize, usize, &str)] = if gate_up {
            &[(0, rows / 2, "w1 (gate)"), (2, rows / 2, "w3 (up)")]
        } else {
            &[(1, rows, "w2 (down)")]
        };
        (0..e)
            .map(|ex| {
                parts
                    .iter()
                    .map(|&(part, r, what)| {
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
                        Ok((key.as_str(), r))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect()
    }

    /// Stack per-expert matrices: `part` 0/2 -> gate_up `[E, 2I, H]`, 1 -> down `[E, H, I]`.
    fn stack_experts(&self, module: &str, layer: usize, shape: &[usize]) -> Result<Vec<f32>> {
        let cols = shape[2];
        let mut out = Vec::with_capacity(shape.iter().product());
        for parts in self.expert_keys(module, layer, shape)? {
            for (key, rows) in parts {
                out.extend(self.read_float(key, &[rows, cols])?);
            }
        }
        Ok(out)
    }

    /// The routed experts of `module` kept as stored, one matrix per expert (`[w1; w3]`
    /// or `w2`); `None` when one of them is not block-scaled / packed / BF16 / F16 (the
    /// stack is then read as f32).
    fn stored_experts(
        &self,
        module: &str,
        layer: usize,
        shape: &[usize],
    ) -> Result<Option<Vec<StoredMatrix>>> {
        let cols = shape[2];
        let keys = self.expert_keys(module, layer, shape)?;
        if !keys.iter().flatten().all(|(k, _)| self.storable(k)) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(keys.len());
        for parts in keys {
            let mut blocks = Vec::with_capacity(parts.len());
            for (key, rows) in parts {
                match self.read_stored(key, &[rows, cols])? {
                    Some(b) => blocks.push(b),
                    None => return Ok(None),
                }
            }
            out.push(StoredMatrix::new(blocks).ok_or_else(|| {
                Error::tensor(&self.origin, module, "expert matrices of different widths")
            })?);
        }
        Ok(Some(out))
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

/// Values dequantised at once to check a tensor kept as stored (4 MiB of f32).
const CHECK_VALUES: usize = 1 << 20;

/// A block the loader built from a tensor whose shape it checked (`None` only if the
/// file's bytes do not hold it).
fn made(b: Option<Block>, path: &Path, key: &str) -> Result<Block> {
    b.ok_or_else(|| Error::tensor(path, key, "its bytes do not hold its shape and dtype"))
}

/// The layer of a stacked routed-expert tensor name (`model.layers.{l}.mlp.experts.
/// gate_up_proj` / `down_proj`, 3-D).
fn expert_layer(name: &str, shape: &[usize]) -> Option<usize> {
    let stacked = shape.len() == 3
        && (name.ends_with(".mlp.experts.gate_up_proj")
            || name.ends_with(".mlp.experts.down_proj"));
    if !stacked {
        return None;
    }
    name.strip_prefix("model.layers.")?
        .split_once('.')?
        .0
        .parse()
        .ok()
}

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
        if let Some(layer) = expert_layer(name, shape) {
            return self.stack_experts(name, layer, shape);
        }
        Err(self.missing(name, ""))
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let key = self.names.get(name)?;
        self.reader.entry(key).map(|e| e.shape.clone())
    }

    /// With [`Residency::Stored`]: block-scaled FP8, packed FP4 and BF16 / F16 matrices
    /// and routed-expert stacks as their file bytes (others, and [`Residency::F32`]:
    /// `None`, read by [`WeightSource::float`]).
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<StoredMatrix>>> {
        if self.residency == Residency::F32 {
            return Ok(None);
        }
        if let Some(key) = self.names.get(name) {
            if shape.len() != 2 || !self.storable(key) {
                return Ok(None);
            }
            return Ok(self
                .read_stored(key, shape)?
                .and_then(|b| StoredMatrix::new(vec![b]))
                .map(|m| vec![m]));
        }
        match expert_layer(name, shape) {
            Some(layer) => self.stored_experts(name, layer, shape),
            None => Ok(None),
        }
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
