//! Building modules from a weight source: a checkpoint or a seeded random init.
//!
//! Every parameter is requested by its full name and expected shape through a [`Vb`]
//! ("var builder"), so loading and initialising share one code path and a bad checkpoint
//! fails with the file, the tensor and expected-vs-found shape. Parameter ids are a hash
//! of the name, so saving ([`save_by_builder_names`]) writes each parameter under the
//! name its builder asked for, and the file loads back through the same builder.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::safetensors_io::{OwnedTensor, SafetensorsReader, TensorValues, write_safetensors};
use super::stored::{StoredMatrix, StoredWeight};
use crate::error::{Error, Result};

/// How a freshly initialised parameter is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// N(0, std^2).
    Normal(f64),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// A constant.
    Const(f32),
}

/// Where parameter values come from.
pub trait WeightSource: Send + Sync {
    /// Values (row-major, f32) for parameter `name` of shape `shape`.
    fn float(&self, name: &str, shape: &[usize], init: Init) -> Result<Vec<f32>>;
    /// Values of an integer buffer (e.g. a routing table).
    fn int(&self, name: &str, shape: &[usize], init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>>;
    /// Parameter `name` (a matrix `[rows, cols]`, or a stack `[n, rows, cols]` of routed
    /// experts) kept as the source stores it, one [`StoredMatrix`] per matrix; `None`
    /// (the default) when the source gives f32 values through [`WeightSource::float`].
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<StoredMatrix>>> {
        let _ = (name, shape);
        Ok(None)
    }
    /// The shape the source stores parameter `name` in, when it stores one (a file);
    /// `None` for generated values or an unknown name.
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let _ = name;
        None
    }
}

/// A tensor [`Tiled`] tiled: (name, stored shape, built shape).
pub type TiledTensor = (String, Vec<usize>, Vec<usize>);

/// A source whose matching parameters are tiled along their first axis: a parameter
/// named by a pattern (the full name, or a suffix after a `.`) and requested with `k`
/// times the rows `inner` stores (the other axes equal) gets the stored rows repeated
/// `k` times, row `i` = stored row `i mod r`. Everything else passes through, so a
/// shape that is not a multiple still fails with `inner`'s error. [`Tiled::tiled`]
/// lists what was tiled.
pub struct Tiled<'a> {
    inner: &'a dyn WeightSource,
    patterns: Vec<String>,
    tiled: Mutex<Vec<TiledTensor>>,
    matched: Mutex<BTreeSet<String>>,
}

impl<'a> Tiled<'a> {
    /// Tile the parameters of `inner` that `patterns` name.
    pub fn new(inner: &'a dyn WeightSource, patterns: &[String]) -> Self {
        Tiled {
            inner,
            patterns: patterns.to_vec(),
            tiled: Mutex::new(Vec::new()),
            matched: Mutex::new(BTreeSet::new()),
        }
    }

    fn pattern_of(&self, name: &str) -> Option<&str> {
        self.patterns
            .iter()
            .find(|p| name == p.as_str() || name.ends_with(&format!(".{p}")))
            .map(String::as_str)
    }

    /// The tensors tiled so far: (name, stored shape, built shape).
    pub fn tiled(&self) -> Vec<TiledTensor> {
        self.tiled.lock().expect("tile log").clone()
    }

    /// The patterns that matched no requested parameter (a misspelt name).
    pub fn unmatched(&self) -> Vec<String> {
        let m = self.matched.lock().expect("tile log");
        self.patterns
            .iter()
            .filter(|p| !m.contains(*p))
            .cloned()
            .collect()
    }
}

impl WeightSource for Tiled<'_> {
    fn float(&self, name: &str, shape: &[usize], init: Init) -> Result<Vec<f32>> {
        if let Some(p) = self.pattern_of(name) {
            self.matched.lock().expect("tile log").insert(p.to_string());
            if let Some(found) = self.inner.shape(name) {
                let tileable = found.len() == shape.len()
                    && !found.is_empty()
                    && found[1..] == shape[1..]
                    && found[0] > 0
                    && shape[0] > found[0]
                    && shape[0].is_multiple_of(found[0]);
                if tileable {
                    let v = self.inner.float(name, &found, init)?;
                    let k = shape[0] / found[0];
                    let mut out = Vec::with_capacity(v.len() * k);
                    for _ in 0..k {
                        out.extend_from_slice(&v);
                    }
                    self.tiled.lock().expect("tile log").push((
                        name.to_string(),
                        found,
                        shape.to_vec(),
                    ));
                    return Ok(out);
                }
            }
        }
        self.inner.float(name, shape, init)
    }

    fn int(&self, name: &str, shape: &[usize], init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        self.inner.int(name, shape, init)
    }

    fn stored(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<StoredMatrix>>> {
        if self.pattern_of(name).is_some() {
            return Ok(None);
        }
        self.inner.stored(name, shape)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(name)
    }
}

/// A var builder: a source, a name prefix and a device.
#[derive(Clone)]
pub struct Vb<'a> {
    src: &'a dyn WeightSource,
    prefix: String,
    device: Device,
}

impl<'a> Vb<'a> {
    /// A builder at the root.
    pub fn new(src: &'a dyn WeightSource, device: &Device) -> Self {
        Vb {
            src,
            prefix: String::new(),
            device: device.clone(),
        }
    }

    /// A builder for a sub-module.
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        Vb {
            src: self.src,
            prefix: self.full(&name.to_string()),
            device: self.device.clone(),
        }
    }

    /// The full name of `name` under this prefix.
    pub fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A float tensor of shape `shape`.
    pub fn tensor<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        init: Init,
    ) -> Result<Tensor<D>> {
        let full = self.full(name);
        let v = self.src.float(&full, &shape, init)?;
        Ok(Tensor::from_data(TensorData::new(v, shape), &self.device))
    }

    /// A trainable parameter of shape `shape`.
    pub fn param<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        init: Init,
    ) -> Result<Param<Tensor<D>>> {
        // Parameter ids derive from the full name, so optimizer state saved in a training
        // checkpoint matches the parameters of a model rebuilt from that checkpoint.
        let (_, value, mapper) = Param::from_tensor(self.tensor(name, shape, init)?).consume();
        Ok(Param::from_mapped_value(
            param_id(&self.full(name)),
            value,
            mapper,
        ))
    }

    /// Parameter `name` of shape `shape` held as the source stores it (dequantised where
    /// used, on this builder's device), when the source keeps it so.
    pub fn stored(&self, name: &str, shape: &[usize]) -> Result<Option<StoredWeight>> {
        let full = self.full(name);
        let Some(m) = self.src.stored(&full, shape)? else {
            return Ok(None);
        };
        StoredWeight::new(m, &self.device)
            .filter(|w| shape.ends_with(&w.dims()) && shape.iter().product::<usize>() == w.values())
            .map(Some)
            .ok_or_else(|| {
                Error::Other(format!(
                    "parameter `{full}`: the stored matrices do not make the shape {shape:?}"
                ))
            })
    }

    /// An integer buffer of shape `shape` (as host values).
    pub fn ints(
        &self,
        name: &str,
        shape: &[usize],
        init: &dyn Fn(usize) -> i64,
    ) -> Result<Vec<i64>> {
        self.src.int(&self.full(name), shape, init)
    }

    /// An integer tensor of shape `shape`.
    pub fn int_tensor<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
        init: &dyn Fn(usize) -> i64,
    ) -> Result<Tensor<D, Int>> {
        let v = self.ints(name, &shape, init)?;
        Ok(Tensor::from_data(TensorData::new(v, shape), &self.device))
    }
}

/// The id of the parameter named `name`: a hash of the name, so that a rebuilt model's
/// parameters have the same ids (optimizer state, saving by name).
pub fn param_id(name: &str) -> ParamId {
    ParamId::from(name_seed(0x5eed, name))
}

/// A source that records the names and shapes a model asks for and returns zeros.
/// Building a model with it lists the model's parameter names exactly as its loader
/// expects them.
#[derive(Default)]
pub struct NameRecorder {
    names: Mutex<Vec<(String, Vec<usize>)>>,
}

impl NameRecorder {
    /// The recorded float parameter names, in build order.
    pub fn names(&self) -> Vec<(String, Vec<usize>)> {
        self.names.lock().expect("lock").clone()
    }
}

impl WeightSource for NameRecorder {
    fn float(&self, name: &str, shape: &[usize], _init: Init) -> Result<Vec<f32>> {
        self.names
            .lock()
            .expect("lock")
            .push((name.to_string(), shape.to_vec()));
        Ok(vec![0.0; shape.iter().product()])
    }

    fn int(&self, _name: &str, shape: &[usize], init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        Ok((0..shape.iter().product()).map(init).collect())
    }
}

/// Seeded random initialisation. Each tensor's values depend only on the seed and the
/// tensor's name, so adding a parameter does not change the others.
pub struct RandomInit {
    pub seed: u64,
}

fn name_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, mixed with the seed.
    let mut h: u64 = 0xcbf29ce484222325 ^ seed.wrapping_mul(0x9E3779B97F4A7C15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// `n` samples of N(0, 1) from a seeded generator (Box-Muller).
pub fn normal_samples(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f64 = rng.random::<f64>().max(1e-300);
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out.push((r * t.cos()) as f32);
        out.push((r * t.sin()) as f32);
    }
    out.truncate(n);
    out
}

impl WeightSource for RandomInit {
    fn float(&self, name: &str, shape: &[usize], init: Init) -> Result<Vec<f32>> {
        let n: usize = shape.iter().product();
        Ok(match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Const(c) => vec![c; n],
            Init::Normal(std) => {
                let mut rng = ChaCha8Rng::seed_from_u64(name_seed(self.seed, name));
                normal_samples(&mut rng, n)
                    .into_iter()
                    .map(|x| x * std as f32)
                    .collect()
            }
        })
    }

    fn int(&self, _name: &str, shape: &[usize], init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        Ok((0..shape.iter().product()).map(init).collect())
    }
}

/// Which tensors of a checkpoint's files a loader read, so that the others (unknown
/// to the model: a misspelt name, another architecture's tensor) are reported instead
/// of silently dropped. The one tracker of every loader (kvc, DeepSeek-V4).
#[derive(Debug, Default)]
pub struct UsedTensors {
    used: Mutex<BTreeSet<String>>,
}

impl UsedTensors {
    /// Mark the file tensor `key` as read.
    pub fn mark(&self, key: &str) {
        self.used.lock().expect("lock").insert(key.to_string());
    }

    /// An error listing the tensors of `reader` that were neither read nor `ignored`
    /// (`model` names the model in the message: "the model", "the DeepSeek-V4 model").
    pub fn check(
        &self,
        reader: &SafetensorsReader,
        ignored: &dyn Fn(&str) -> bool,
        model: &str,
    ) -> Result<()> {
        let used = self.used.lock().expect("lock");
        let unknown: Vec<&str> = reader
            .names()
            .filter(|n| !used.contains(*n) && !ignored(n))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let shown: Vec<&str> = unknown.iter().take(8).copied().collect();
        Err(Error::tensor(
            reader.path_of(unknown[0]),
            unknown[0],
            format!(
                "unknown tensor(s) not used by {model} ({} in all): {}{}",
                unknown.len(),
                shown.join(", "),
                if unknown.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            ),
        ))
    }
}

/// A checkpoint on disk: one safetensors file or several shards. Remembers which
/// tensors were used so that unknown (unused) tensors can be reported.
pub struct CheckpointSource {
    reader: SafetensorsReader,
    used: UsedTensors,
    /// Optional map from the names the model asks for to the names in the files.
    rename: Option<Rename>,
}

/// Maps the names a model asks for to the names in the files.
type Rename = Box<dyn Fn(&str) -> String + Send + Sync>;

impl CheckpointSource {
    /// Open `model.safetensors`, or the shards listed in `model.safetensors.index.json`,
    /// in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let reader = if single.exists() {
            SafetensorsReader::open(&inside_model_dir(dir, "model.safetensors", &single)?)?
        } else if index.exists() {
            SafetensorsReader::open_many(&shard_paths(&index)?)?
        } else {
            return Err(Error::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in the model directory",
                ),
            });
        };
        Ok(Self::from_reader(reader))
    }

    /// Wrap an open reader.
    pub fn from_reader(reader: SafetensorsReader) -> Self {
        CheckpointSource {
            reader,
            used: UsedTensors::default(),
            rename: None,
        }
    }

    /// Map requested names to file names (e.g. for another naming scheme).
    pub fn with_rename(mut self, f: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.rename = Some(Box::new(f));
        self
    }

    /// The underlying reader.
    pub fn reader(&self) -> &SafetensorsReader {
        &self.reader
    }

    fn file_name(&self, name: &str) -> String {
        match &self.rename {
            Some(f) => f(name),
            None => name.to_string(),
        }
    }

    /// Mark a file tensor as used (for sources that read tensors directly).
    pub fn mark_used(&self, file_name: &str) {
        self.used.mark(file_name);
    }

    /// An error listing tensors in the files that the model never asked for.
    pub fn check_all_used(&self) -> Result<()> {
        self.used.check(&self.reader, &|_| false, "the model")
    }

    fn check_shape(&self, fname: &str, want: &[usize], found: &[usize]) -> Result<()> {
        if want != found {
            return Err(Error::tensor(
                self.reader.path_of(fname),
                fname,
                format!("expected shape {want:?}, found {found:?}"),
            ));
        }
        Ok(())
    }
}

impl WeightSource for CheckpointSource {
    fn float(&self, name: &str, shape: &[usize], _init: Init) -> Result<Vec<f32>> {
        let fname = self.file_name(name);
        let (found, v) = self.reader.read_f32(&fname)?;
        self.check_shape(&fname, shape, &found)?;
        crate::model::safetensors_io::check_finite(&self.reader.path_of(&fname), &fname, &v)?;
        self.mark_used(&fname);
        Ok(v)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.reader
            .entry(&self.file_name(name))
            .map(|e| e.shape.clone())
    }

    fn int(&self, name: &str, shape: &[usize], _init: &dyn Fn(usize) -> i64) -> Result<Vec<i64>> {
        let fname = self.file_name(name);
        let (found, v) = self.reader.read_i64(&fname)?;
        self.check_shape(&fname, shape, &found)?;
        self.mark_used(&fname);
        Ok(v)
    }
}

/// The shard files named by a `model.safetensors.index.json`.
pub fn shard_paths(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: index.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })?;
    let map = json["weight_map"]
        .as_object()
        .ok_or_else(|| Error::Config {
            path: index.to_path_buf(),
            message: "no `weight_map` object".into(),
        })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: BTreeSet<String> = BTreeSet::new();
    for (tensor, v) in map {
        let f = v.as_str().ok_or_else(|| Error::Config {
            path: index.to_path_buf(),
            message: format!("weight_map entry `{tensor}`: the shard name is not a string"),
        })?;
        files.insert(f.to_string());
    }
    let mut out = Vec::new();
    for f in files {
        let entry = format!("weight_map shard `{f}`");
        if !is_plain_relative(Path::new(&f)) {
            return Err(Error::Config {
                path: index.to_path_buf(),
                message: format!(
                    "{entry} leaves the model directory (absolute, `..` or empty); \
                     shards must be files inside {}",
                    dir.display()
                ),
            });
        }
        out.push(inside_model_dir(dir, &entry, &dir.join(&f))?);
    }
    Ok(out)
}

/// Set to `1` to follow a checkpoint file's symbolic link out of the model directory.
pub const ALLOW_OUTSIDE_LINKS: &str = "PHASELENS_ALLOW_OUTSIDE_LINKS";

/// A relative path of normal components only (no root, no `..`, no `.`-only path).
fn is_plain_relative(p: &Path) -> bool {
    use std::path::Component;
    p.components().next().is_some()
        && p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && p.components().any(|c| matches!(c, Component::Normal(_)))
}

/// `path` (named `entry` in messages) if it resolves inside `dir`. A symbolic link out
/// of the directory is refused unless it is a Hugging Face cache snapshot pointing into
/// its own repository's `blobs/`, or [`ALLOW_OUTSIDE_LINKS`] is set. A path that does
/// not exist is returned as is (opening it reports the missing file).
pub fn inside_model_dir(dir: &Path, entry: &str, path: &Path) -> Result<PathBuf> {
    let (Ok(root), Ok(real)) = (dir.canonicalize(), path.canonicalize()) else {
        return Ok(path.to_path_buf());
    };
    if real.starts_with(&root) || std::env::var(ALLOW_OUTSIDE_LINKS).is_ok_and(|v| v == "1") {
        return Ok(path.to_path_buf());
    }
    // models--org--name/snapshots/<rev>/file -> models--org--name/blobs/<hash>
    let hub_blobs = root
        .parent()
        .filter(|s| s.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .map(|repo| repo.join("blobs"));
    if hub_blobs.is_some_and(|b| real.starts_with(b)) {
        return Ok(path.to_path_buf());
    }
    Err(Error::Config {
        path: path.to_path_buf(),
        message: format!(
            "{entry} resolves to {}, outside the model directory {}; refusing to read it \
             (set {ALLOW_OUTSIDE_LINKS}=1 to follow links out of the model directory)",
            real.display(),
            root.display()
        ),
    })
}

/// Collects every float parameter by its id.
struct CollectById {
    out: std::collections::HashMap<u64, OwnedTensor>,
}

impl ModuleVisitor for CollectById {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let data = tensor.to_data().convert::<f32>();
        self.out.insert(
            param.id.val(),
            OwnedTensor {
                shape: tensor.dims().to_vec(),
                data: TensorValues::F32(data.try_into_vec::<f32>().expect("f32")),
            },
        );
    }
}

/// Save `module` with the parameter names its builder asks a [`Vb`] for: `build` is
/// run once on a [`NameRecorder`] to list them, and each is matched to the module's
/// parameter by id. The file therefore loads back through the same builder.
pub fn save_by_builder_names<M: Module>(
    module: &M,
    build: &dyn Fn(&Vb) -> Result<M>,
    device: &Device,
    path: &Path,
    extra: BTreeMap<String, OwnedTensor>,
) -> Result<()> {
    let rec = NameRecorder::default();
    let _ = build(&Vb::new(&rec, device))?;
    let mut c = CollectById {
        out: std::collections::HashMap::new(),
    };
    module.visit(&mut c);
    let mut t = BTreeMap::new();
    for (name, shape) in rec.names() {
        let v = c.out.remove(&param_id(&name).val()).ok_or_else(|| {
            Error::tensor(
                path,
                &name,
                "the model has no parameter with this name's id (built outside a Vb?)",
            )
        })?;
        if v.shape != shape {
            return Err(Error::tensor(
                path,
                &name,
                format!("expected shape {shape:?}, the model holds {:?}", v.shape),
            ));
        }
        t.insert(name, v);
    }
    t.extend(extra);
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert(
        "producer".to_string(),
        format!("phaselens {}", env!("CARGO_PKG_VERSION")),
    );
    write_safetensors(path, &t, Some(meta))
}
