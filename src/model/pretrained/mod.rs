//! Pretrained checkpoints: GGUF files (llama.cpp's container, quantised blocks) and
//! Hugging Face folders (`config.json` + safetensors) of the Llama family (Llama 2/3,
//! Mistral, Qwen2, Qwen3, SmolLM) and of Gemma 3, loaded as kvc decoders with their
//! architecture's options set ([`crate::model::kvc::ArchOptions`]): the same forward,
//! hook points, caching, patching and suffix forwards as every phaselens model.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | what a path holds, loading, the GGUF weight source |
//! | `llama.rs` | the Llama family: config from GGUF metadata or config.json, tensor names |
//! | `gemma3.rs` | Gemma 3: the same |
//! | `hf.rs` | Hugging Face folders: config.json keys, the safetensors source |
//!
//! Names: each family maps the kvc parameter names (`blocks.{l}.attn.w_q.weight`) to
//! the file's (`blk.{l}.attn_q.weight` in GGUF, `model.layers.{l}.self_attn.q_proj.weight`
//! in safetensors). Values are transformed on load exactly where the file's convention
//! differs from the forward's: llama.cpp stores Llama's query and key rows permuted for
//! its interleaved RoPE (un-permuted here, as transformers does), and Gemma's
//! safetensors store RMSNorm scales as `w` for `(1 + w)` (GGUF stores `1 + w`).

mod gemma3;
mod hf;
mod llama;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::tensor::Device;

use super::gguf::{GgmlType, GgufFile};
use super::kvc::{KvcConfig, KvcModel};
use super::stored::{Block, Residency, StoredMatrix};
use super::weights::{Init, Vb, WeightSource};
use crate::error::{Error, Result};

pub use hf::HF_MODEL_TYPES;

/// The GGUF architectures phaselens loads.
pub const GGUF_ARCHS: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

/// The cache of pretrained models (`scripts/fetch-models.sh` fills it):
/// `$PHASELENS_MODELS`, else `$XDG_CACHE_HOME/phaselens/models`, else
/// `~/.cache/phaselens/models`.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PHASELENS_MODELS") {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache"));
    cache.join("phaselens").join("models")
}

fn home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
}

/// A model path as written in an experiment or on the command line: `models:NAME` is
/// `NAME` inside [`models_dir`] (`models:smollm2-135m-instruct`), `~/...` is under the
/// home folder; anything else is returned as it is.
pub fn expand_model_path(path: &Path) -> PathBuf {
    let text = path.to_string_lossy();
    if let Some(rest) = text.strip_prefix("models:") {
        return models_dir().join(rest);
    }
    if let Some(rest) = text.strip_prefix("~/") {
        return home().join(rest);
    }
    path.to_path_buf()
}

/// What a model path holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pretrained {
    /// A GGUF file.
    Gguf(PathBuf),
    /// A Hugging Face folder of a supported `model_type`.
    Hf(PathBuf),
}

/// Whether `path` is a pretrained checkpoint: a `.gguf` file, a folder holding exactly
/// one `.gguf` and no `config.json`, or a folder whose `config.json` names a Hugging
/// Face `model_type` of [`HF_MODEL_TYPES`]. `None` for anything else (kvc and
/// DeepSeek-V4 folders, missing paths): the caller's errors apply.
pub fn detect(path: &Path) -> Option<Pretrained> {
    let path = &expand_model_path(path);
    if path.is_file() {
        let gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        return gguf.then(|| Pretrained::Gguf(path.to_path_buf()));
    }
    if !path.is_dir() {
        return None;
    }
    let config = path.join("config.json");
    if config.is_file() {
        let text = std::fs::read_to_string(&config).ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        let t = json["model_type"].as_str()?;
        return HF_MODEL_TYPES
            .contains(&t)
            .then(|| Pretrained::Hf(path.to_path_buf()));
    }
    let ggufs = gguf_files(path).ok()?;
    (ggufs.len() == 1).then(|| Pretrained::Gguf(ggufs[0].clone()))
}

/// Whether `path` names a GGUF file by its extension (`.gguf`, any case).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The `.gguf` files directly in `dir`, sorted; an error naming the folder when it
/// cannot be listed.
pub fn gguf_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.is_file() && is_gguf(&path) {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Load a pretrained checkpoint (see [`detect`]).
pub fn load(p: &Pretrained, device: &Device, residency: Residency) -> Result<KvcModel> {
    match p {
        Pretrained::Gguf(path) => load_gguf(path, device, residency),
        Pretrained::Hf(dir) => hf::load(dir, device),
    }
}

/// The kvc config of a GGUF file (its architecture's metadata).
pub fn gguf_config(file: &GgufFile) -> Result<KvcConfig> {
    let arch = file.architecture()?;
    match arch {
        "gemma3" => gemma3::config_from_gguf(file),
        a if GGUF_ARCHS.contains(&a) => llama::config_from_gguf(file, a),
        other => Err(Error::Config {
            path: file.path().to_path_buf(),
            message: format!(
                "general.architecture = \"{other}\" is not supported (supported: {})",
                GGUF_ARCHS.join(", ")
            ),
        }),
    }
}

/// Load a GGUF file as a kvc decoder. Every tensor of the file must be used.
pub fn load_gguf(path: &Path, device: &Device, residency: Residency) -> Result<KvcModel> {
    let file = GgufFile::open(path)?;
    let config = gguf_config(&file)?;
    config
        .validate()
        .map_err(|e| e.context(path.display().to_string()))?;
    let arch = file.architecture()?.to_string();
    let src = GgufSource {
        permute_qk: arch == "llama",
        n_heads: config.n_heads,
        n_kv_heads: config.n_kv_heads,
        file,
        name: if arch == "gemma3" {
            gemma3::gguf_name
        } else {
            llama::gguf_name
        },
        used: Mutex::new(BTreeSet::new()),
        residency,
    };
    let model = KvcModel::new(&config, &Vb::new(&src, device))?;
    src.check_all_used()?;
    Ok(model)
}

/// A GGUF file as a weight source: each kvc parameter read from its tensor,
/// dequantised to f32 (and un-permuted where llama.cpp permuted it).
struct GgufSource {
    file: GgufFile,
    /// kvc name -> GGUF name.
    name: fn(&str) -> Option<String>,
    /// Llama's `attn_q` / `attn_k` rows are in llama.cpp's RoPE order.
    permute_qk: bool,
    n_heads: usize,
    n_kv_heads: usize,
    used: Mutex<BTreeSet<String>>,
    /// `Stored`: quantised matrices stay as their GGUF blocks ([`Block::ggml`]).
    residency: Residency,
}

impl GgufSource {
    /// The heads of a matrix llama.cpp stored permuted (Llama's `attn_q` / `attn_k`).
    fn permuted_heads(&self, fname: &str) -> Option<usize> {
        if !self.permute_qk {
            return None;
        }
        if fname.ends_with("attn_q.weight") {
            Some(self.n_heads)
        } else if fname.ends_with("attn_k.weight") {
            Some(self.n_kv_heads)
        } else {
            None
        }
    }

    fn file_name(&self, name: &str) -> Result<String> {
        (self.name)(name).ok_or_else(|| Error::Tensor {
            path: self.file.path().to_path_buf(),
            tensor: name.to_string(),
            message: "the model asks for a parameter this GGUF architecture has no tensor for"
                .into(),
        })
    }

    /// Every tensor of the file was read, else an error naming the first unread ones.
    fn check_all_used(&self) -> Result<()> {
        let used = self.used.lock().expect("used-tensor lock");
        let unused: Vec<&str> = self
            .file
            .tensors()
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| !used.contains(*n))
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        Err(Error::Config {
            path: self.file.path().to_path_buf(),
            message: format!(
                "{} tensor(s) the model does not use (an architecture option phaselens does not know?): {}",
                unused.len(),
                unused
                    .iter()
                    .take(8)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }
}

impl WeightSource for GgufSource {
    fn float(&self, name: &str, shape: &[usize], _init: Init) -> Result<Vec<f32>> {
        let fname = self.file_name(name)?;
        let info = self.file.tensor(&fname)?;
        let found = info.shape();
        if found != shape {
            return Err(Error::Tensor {
                path: self.file.path().to_path_buf(),
                tensor: fname,
                message: format!(
                    "the metadata makes parameter `{name}` {shape:?}, the tensor is {found:?}"
                ),
            });
        }
        let mut v = self.file.dequantize(&fname)?;
        if let Some(heads) = self.permuted_heads(&fname) {
            v = unpermute_rows(&v, shape[0], heads);
        }
        let path = self.file.path().to_path_buf();
        crate::model::safetensors_io::check_finite(&path, &fname, &v)?;
        self.used.lock().expect("used-tensor lock").insert(fname);
        Ok(v)
    }

    fn int(&self, name: &str, _shape: &[usize], _init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        Err(Error::Tensor {
            path: self.file.path().to_path_buf(),
            tensor: name.to_string(),
            message: "GGUF checkpoints hold no integer parameters".into(),
        })
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let fname = (self.name)(name)?;
        self.file.tensor(&fname).ok().map(|t| t.shape())
    }

    fn stored(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<StoredMatrix>>> {
        let fname = self.file_name(name)?;
        let info = self.file.tensor(&fname)?;
        if self.residency != Residency::Stored
            || info.ggml_type == GgmlType::F32
            || shape.len() != 2
        {
            return Ok(None);
        }
        let found = info.shape();
        if found != shape {
            return Err(Error::Tensor {
                path: self.file.path().to_path_buf(),
                tensor: fname,
                message: format!(
                    "the metadata makes parameter `{name}` {shape:?}, the tensor is {found:?}"
                ),
            });
        }
        let mut bytes = self.file.raw(info).to_vec();
        if let Some(heads) = self.permuted_heads(&fname) {
            bytes = unpermute_rows(&bytes, shape[0], heads);
        }
        let block = Block::ggml([shape[0], shape[1]], info.ggml_type, bytes).ok_or_else(|| {
            Error::Tensor {
                path: self.file.path().to_path_buf(),
                tensor: fname.clone(),
                message: format!(
                    "{} rows of {} values are not whole {} blocks",
                    shape[0],
                    shape[1],
                    info.ggml_type.name()
                ),
            }
        })?;
        self.used.lock().expect("used-tensor lock").insert(fname);
        Ok(StoredMatrix::new(vec![block]).map(|m| vec![m]))
    }
}

/// Undo llama.cpp's permutation of a query or key matrix of `rows` equally long rows
/// (`[heads * d_head, cols]` f32 values, or whole rows of quantised blocks as bytes):
/// within each head, file row `2 i + j` holds transformers' row `j * d_head / 2 + i`
/// (`convert_hf_to_gguf.py`'s `permute`, the layout of its interleaved RoPE).
pub fn unpermute_rows<T: Copy + Default>(v: &[T], rows: usize, heads: usize) -> Vec<T> {
    let w = v.len() / rows.max(1);
    let dh = rows / heads.max(1);
    let half = dh / 2;
    let mut out = vec![T::default(); v.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..half {
                let (dst, src) = (h * dh + j * half + i, h * dh + 2 * i + j);
                out[dst * w..(dst + 1) * w].copy_from_slice(&v[src * w..(src + 1) * w]);
            }
        }
    }
    out
}

/// The per-layer parameter names of the kvc decoder and their GGUF names (llama.cpp's
/// `blk.{l}.*`), shared by both families; `None` for a name outside the table.
fn gguf_block_name(rest: &str, l: &str, table: &[(&str, &str)]) -> Option<String> {
    let (param, suffix) = rest.rsplit_once('.')?;
    table
        .iter()
        .find(|(k, _)| *k == param)
        .map(|(_, g)| format!("blk.{l}.{g}.{suffix}"))
}

/// The global names (embedding, final norm, head), then blocks through `table`.
fn gguf_name_with(name: &str, table: &[(&str, &str)]) -> Option<String> {
    match name {
        "embed.weight" => Some("token_embd.weight".into()),
        "final_norm.weight" => Some("output_norm.weight".into()),
        "lm_head.weight" => Some("output.weight".into()),
        _ => {
            let rest = name.strip_prefix("blocks.")?;
            let (l, rest) = rest.split_once('.')?;
            gguf_block_name(rest, l, table)
        }
    }
}
