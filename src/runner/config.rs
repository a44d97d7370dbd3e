//! The experiment TOML (`docs/experiments.md` documents every key).
//!
//! ```toml
//! [experiment]
//! kind = "patch-heads"            # phase-sweep | patch-heads | ablate-heads | knockout | gate-profiles | gate-cycling
//! [model]
//! organism = "organisms/kvc-w8s8" # or path = "/models/DeepSeek-V4-Pro"
//! [task]                          # defaults: the organism's token space, prompt format and period
//! n_logical = 64
//! [patch]                         # the section of the kind
//! positions = "all"
//! ```
//!
//! Unknown keys and wrong types are errors naming the file, line and key
//! ([`crate::config::load_toml`]); semantic errors found later (a layer out of range,
//! a period that does not fit the model) name the key too, via [`ExperimentFile::err`].

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::tasks::{KvPromptConfig, Protocol, TokenSpaceConfig};

use super::patching::Positions;

/// What an experiment does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Accuracy by phase group (both protocols), per model.
    PhaseSweep,
    /// Activation patching of hook_z per layer x head x source phase.
    PatchHeads,
    /// Zero / mean / resample ablation of one head at a time.
    AblateHeads,
    /// KV-head knockout (the paper's Figure 3) and whole-layer attention-output replacement.
    Knockout,
    /// Compressor gate statistics per layer x KV head (optionally over checkpoints).
    GateProfiles,
    /// Shift the learned gates by delta offsets; predicted vs observed accuracy profiles.
    GateCycling,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 6] = [
        Kind::PhaseSweep,
        Kind::PatchHeads,
        Kind::AblateHeads,
        Kind::Knockout,
        Kind::GateProfiles,
        Kind::GateCycling,
    ];

    /// The name used in TOML files and in the tables' `kind` column.
    pub fn name(self) -> &'static str {
        match self {
            Kind::PhaseSweep => "phase-sweep",
            Kind::PatchHeads => "patch-heads",
            Kind::AblateHeads => "ablate-heads",
            Kind::Knockout => "knockout",
            Kind::GateProfiles => "gate-profiles",
            Kind::GateCycling => "gate-cycling",
        }
    }

    /// Parse a `kind` column value.
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    /// The TOML section holding this kind's settings.
    pub fn section(self) -> &'static str {
        match self {
            Kind::PhaseSweep => "sweep",
            Kind::PatchHeads => "patch",
            Kind::AblateHeads => "ablate",
            Kind::Knockout => "knockout",
            Kind::GateProfiles => "gates",
            Kind::GateCycling => "cycling",
        }
    }

    /// Default logical examples per phase group (sized for 2 CPU cores, see
    /// docs/experiments.md).
    pub fn default_n_logical(self) -> usize {
        match self {
            Kind::PhaseSweep => 256,
            Kind::PatchHeads | Kind::AblateHeads | Kind::Knockout => 64,
            Kind::GateProfiles => 32,
            Kind::GateCycling => 128,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A selection of indices: `"all"` or an explicit list such as `[0, 2, 3]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Selection {
    /// Every index.
    #[default]
    All,
    /// These indices, in this order.
    Only(Vec<usize>),
}

impl Selection {
    /// The indices in `0..n`; an error message naming the first out-of-range index.
    pub fn resolve(&self, n: usize, what: &str) -> std::result::Result<Vec<usize>, String> {
        match self {
            Selection::All => Ok((0..n).collect()),
            Selection::Only(v) => {
                if v.is_empty() {
                    return Err(format!("the list of {what} is empty"));
                }
                if let Some(bad) = v.iter().find(|&&i| i >= n) {
                    return Err(format!(
                        "index {bad} is out of range 0..{n} (the model has {n} {what})"
                    ));
                }
                let mut seen = v.clone();
                seen.sort_unstable();
                seen.dedup();
                if seen.len() != v.len() {
                    return Err(format!("the list of {what} has duplicates: {v:?}"));
                }
                Ok(v.clone())
            }
        }
    }
}

impl Serialize for Selection {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Selection::All => s.serialize_str("all"),
            Selection::Only(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Selection {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Selection;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("\"all\" or a list of indices such as [0, 2]")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Selection, E> {
                if v == "all" {
                    Ok(Selection::All)
                } else {
                    Err(E::custom(format!(
                        "expected \"all\" or a list of indices such as [0, 2], got \"{v}\""
                    )))
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Selection, A::Error> {
                let mut out = Vec::new();
                while let Some(x) = seq.next_element::<usize>()? {
                    out.push(x);
                }
                Ok(Selection::Only(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// Query heads, KV heads, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadKindSel {
    /// One cell per query head.
    Query,
    /// One cell per KV head: every query head that reads it (see docs/experiments.md).
    Kv,
}

/// Direction of activation patching.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Clean activation into the corrupted run (does the component suffice?).
    Denoise,
    /// Corrupted activation into the clean run (is the component necessary?).
    Noise,
}

impl Direction {
    /// The metric name of the direction's normalised logit difference.
    pub fn metric(self) -> &'static str {
        match self {
            Direction::Denoise => "nld_denoise",
            Direction::Noise => "nld_noise",
        }
    }
}

/// How a head is ablated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Set to zero.
    Zero,
    /// The mean over the prompts of the same phase group (per position).
    Mean,
    /// The activation of another prompt of the same phase group.
    Resample,
}

impl Method {
    /// Name used in metric suffixes.
    pub fn name(self) -> &'static str {
        match self {
            Method::Zero => "zero",
            Method::Mean => "mean",
            Method::Resample => "resample",
        }
    }
}

/// Which compressor gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateKind {
    /// `hook_key_gate`.
    Key,
    /// `hook_value_gate`.
    Value,
}

impl GateKind {
    /// `key` or `value`.
    pub fn name(self) -> &'static str {
        match self {
            GateKind::Key => "key",
            GateKind::Value => "value",
        }
    }
}

fn default_reps() -> usize {
    crate::analysis::DEFAULT_REPS
}
fn default_eval_seed() -> u64 {
    // Not a training seed: evaluation prompts are held out from the training streams.
    20_260_901
}

/// `[experiment]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentSection {
    /// Output folder name under `notebooks-data/` and `reports/`; default: the file stem.
    #[serde(default)]
    pub name: Option<String>,
    /// What to run.
    pub kind: Kind,
    /// Free text for the report.
    #[serde(default)]
    pub description: String,
    /// Cluster-bootstrap replicates for every interval. Default 2000.
    #[serde(default = "default_reps")]
    pub bootstrap_reps: usize,
    /// Bootstrap seed. Default 0.
    #[serde(default)]
    pub seed: u64,
    /// Most batch rows in one forward (cells x prompts). Default: 64 on the CPU (the flex
    /// backend's time per row grows with the batch, see docs/experiments.md), 2048 on
    /// GPUs (where one big batch is what makes the batched routine fast).
    #[serde(default)]
    pub max_rows: Option<usize>,
}

/// `[model]`
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// An organism recipe, relative to this file, with or without `.toml`
    /// (`organisms/kvc-w8s8`); phase-sweep accepts a glob (`organisms/*`).
    #[serde(default)]
    pub organism: Option<String>,
    /// A model directory (config.json + safetensors), relative to this file or absolute.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Display name; default: the organism name or the directory name.
    #[serde(default)]
    pub name: Option<String>,
    /// Device (`cpu`, `wgpu`, `cuda:0`, ...); `--device` overrides it. Default cpu.
    #[serde(default)]
    pub device: Option<String>,
}

/// `[task]`: the prompts. Every key defaults to the organism's recipe.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSection {
    /// Token space; default: the organism's `[task.vocab]` (required for other models).
    #[serde(default)]
    pub vocab: Option<TokenSpaceConfig>,
    /// Prompt format; default: the organism's `[task.train.prompt]`.
    #[serde(default)]
    pub prompt: Option<KvPromptConfig>,
    /// Phase period P; default: the organism's training period, else the model's
    /// smallest compression stride.
    #[serde(default)]
    pub period: Option<u32>,
    /// Padding protocol (every kind but phase-sweep). Default prefix_padding.
    #[serde(default)]
    pub protocol: Option<Protocol>,
    /// Logical examples per phase group; default per kind (docs/experiments.md).
    #[serde(default)]
    pub n_logical: Option<usize>,
    /// Seed of the evaluation prompts.
    #[serde(default = "default_eval_seed")]
    pub seed: u64,
    /// Phase groups (source phases) to evaluate. Default all.
    #[serde(default)]
    pub phases: Selection,
    /// Run even when P is not a multiple of any compression stride.
    #[serde(default)]
    pub allow_period_mismatch: bool,
}

/// `[sweep]` (phase-sweep).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SweepConfig {
    /// Protocols to evaluate. Default both.
    pub protocols: Vec<Protocol>,
    /// Skip organisms whose model directory does not exist yet (with a note).
    pub skip_untrained: bool,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            protocols: Protocol::ALL.to_vec(),
            skip_untrained: true,
        }
    }
}

fn both_kinds() -> Vec<HeadKindSel> {
    vec![HeadKindSel::Query, HeadKindSel::Kv]
}

/// `[patch]` (patch-heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PatchConfig {
    /// Layers to sweep. Default all.
    pub layers: Selection,
    /// Query heads (for `query` cells). Default all.
    pub heads: Selection,
    /// KV heads (for `kv` cells). Default all.
    pub kv_heads: Selection,
    /// Which cells. Default both.
    pub head_kinds: Vec<HeadKindSel>,
    /// Default both.
    pub directions: Vec<Direction>,
    /// Query positions patched. Default all.
    pub positions: Positions,
}

impl Default for PatchConfig {
    fn default() -> Self {
        PatchConfig {
            layers: Selection::All,
            heads: Selection::All,
            kv_heads: Selection::All,
            head_kinds: both_kinds(),
            directions: vec![Direction::Denoise, Direction::Noise],
            positions: Positions::All,
        }
    }
}

/// `[ablate]` (ablate-heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AblateConfig {
    pub layers: Selection,
    pub heads: Selection,
    pub kv_heads: Selection,
    pub head_kinds: Vec<HeadKindSel>,
    /// Default zero, mean, resample.
    pub methods: Vec<Method>,
    pub positions: Positions,
}

impl Default for AblateConfig {
    fn default() -> Self {
        AblateConfig {
            layers: Selection::All,
            heads: Selection::All,
            kv_heads: Selection::All,
            head_kinds: both_kinds(),
            methods: vec![Method::Zero, Method::Mean, Method::Resample],
            positions: Positions::All,
        }
    }
}

/// `[knockout]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KnockoutConfig {
    pub layers: Selection,
    pub kv_heads: Selection,
    /// How a KV head is removed. Default zero.
    pub method: Method,
    /// Positions of the KV-head knockout. Default all.
    pub positions: Positions,
    /// Also replace each whole layer's attention output over the final band.
    pub layer_output: bool,
    /// Final query positions of the layer-output replacement. Default 8.
    pub band: usize,
    /// What replaces the layer output: mean (per phase group, default) or zero.
    pub layer_output_fill: Method,
}

impl Default for KnockoutConfig {
    fn default() -> Self {
        KnockoutConfig {
            layers: Selection::All,
            kv_heads: Selection::All,
            method: Method::Zero,
            positions: Positions::All,
            layer_output: true,
            band: 8,
            layer_output_fill: Method::Mean,
        }
    }
}

/// `[gates]` (gate-profiles).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatesConfig {
    /// Compressed layers. Default all compressed layers.
    pub layers: Selection,
    /// A training run's checkpoint folder (`step-*` subfolders), relative to this
    /// file: the statistics are also computed at every checkpoint.
    pub checkpoints: Option<PathBuf>,
}

/// `[cycling]` (gate-cycling).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CyclingConfig {
    /// Compressed layers whose gates are rolled (all together). Default all.
    pub layers: Selection,
    /// Shifts in offsets. Default -3, -2, -1, 1, 2, 3.
    pub deltas: Vec<i64>,
    /// Which gates are rolled. Default both.
    pub gates: Vec<GateKind>,
}

impl Default for CyclingConfig {
    fn default() -> Self {
        CyclingConfig {
            layers: Selection::All,
            deltas: vec![-3, -2, -1, 1, 2, 3],
            gates: vec![GateKind::Key, GateKind::Value],
        }
    }
}

/// A whole experiment file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentFile {
    pub experiment: ExperimentSection,
    pub model: ModelSection,
    #[serde(default)]
    pub task: TaskSection,
    #[serde(default)]
    pub sweep: Option<SweepConfig>,
    #[serde(default)]
    pub patch: Option<PatchConfig>,
    #[serde(default)]
    pub ablate: Option<AblateConfig>,
    #[serde(default)]
    pub knockout: Option<KnockoutConfig>,
    #[serde(default)]
    pub gates: Option<GatesConfig>,
    #[serde(default)]
    pub cycling: Option<CyclingConfig>,
}

/// A loaded experiment: the parsed file, its text and where it lives.
#[derive(Debug, Clone)]
pub struct Experiment {
    pub file: ExperimentFile,
    /// The TOML text (stored in every table's metadata).
    pub text: String,
    pub path: PathBuf,
}

/// Default rows per batched forward on `device`.
pub fn default_max_rows(device: &crate::device::DeviceSpec) -> usize {
    use crate::device::DeviceSpec;
    match device {
        DeviceSpec::Cpu | DeviceSpec::TchCpu => 64,
        _ => 2048,
    }
}

impl Experiment {
    /// Rows per batched forward on `device` (`[experiment] max_rows` or the default).
    pub fn max_rows(&self, device: &crate::device::DeviceSpec) -> usize {
        self.file
            .experiment
            .max_rows
            .unwrap_or_else(|| default_max_rows(device))
    }

    /// Read, parse and check the structure of an experiment TOML.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, text)
    }

    /// Parse `text` as the contents of `path`.
    pub fn parse(path: &Path, text: String) -> Result<Self> {
        let file: ExperimentFile = crate::config::parse_toml(path, &text)?;
        let exp = Experiment {
            file,
            text,
            path: path.to_path_buf(),
        };
        exp.check_sections()?;
        Ok(exp)
    }

    /// The experiment's name (output folder).
    pub fn name(&self) -> String {
        self.file.experiment.name.clone().unwrap_or_else(|| {
            self.path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "experiment".into())
        })
    }

    /// The kind.
    pub fn kind(&self) -> Kind {
        self.file.experiment.kind
    }

    /// The folder relative paths in the file are resolved against.
    pub fn base_dir(&self) -> PathBuf {
        self.path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."))
    }

    /// An error naming the file, the line of `section.key` (when found) and the key.
    pub fn err(&self, section: &str, key: &str, message: impl fmt::Display) -> Error {
        let line = key_line(&self.text, section, key);
        let at = if key.is_empty() {
            format!("[{section}]")
        } else {
            format!("[{section}] {key}")
        };
        Error::Config {
            path: self.path.clone(),
            message: match line {
                Some(l) => format!("line {l}: {at}: {message}"),
                None => format!("{at}: {message}"),
            },
        }
    }

    /// Only the kind's own section may appear; experiment-wide numbers must be sane.
    fn check_sections(&self) -> Result<()> {
        let f = &self.file;
        let kind = f.experiment.kind;
        let present = [
            ("sweep", f.sweep.is_some()),
            ("patch", f.patch.is_some()),
            ("ablate", f.ablate.is_some()),
            ("knockout", f.knockout.is_some()),
            ("gates", f.gates.is_some()),
            ("cycling", f.cycling.is_some()),
        ];
        for (section, here) in present {
            if here && section != kind.section() {
                return Err(self.err(
                    section,
                    "",
                    format!(
                        "this section is not used by kind \"{kind}\" (its section is [{}])",
                        kind.section()
                    ),
                ));
            }
        }
        if f.experiment.bootstrap_reps == 0 {
            return Err(self.err("experiment", "bootstrap_reps", "must be at least 1"));
        }
        if f.experiment.max_rows == Some(0) {
            return Err(self.err("experiment", "max_rows", "must be at least 1"));
        }
        match (&f.model.organism, &f.model.path) {
            (None, None) => {
                return Err(self.err(
                    "model",
                    "",
                    "give `organism = \"organisms/<name>\"` or `path = \"<model dir>\"`",
                ));
            }
            (Some(_), Some(_)) => {
                return Err(self.err(
                    "model",
                    "path",
                    "give either `organism` or `path`, not both",
                ));
            }
            _ => {}
        }
        if let Some(o) = &f.model.organism
            && o.contains('*')
            && kind != Kind::PhaseSweep
        {
            return Err(self.err(
                "model",
                "organism",
                "a glob selects several models; only kind \"phase-sweep\" runs several",
            ));
        }
        if f.task.n_logical == Some(0) {
            return Err(self.err("task", "n_logical", "must be at least 1"));
        }
        if f.task.period == Some(0) {
            return Err(self.err("task", "period", "must be at least 1"));
        }
        if kind == Kind::PhaseSweep && f.task.protocol.is_some() {
            return Err(self.err(
                "task",
                "protocol",
                "phase-sweep evaluates [sweep] protocols (default both); remove this key",
            ));
        }
        if let Some(c) = &f.cycling {
            if c.deltas.is_empty() {
                return Err(self.err("cycling", "deltas", "give at least one shift"));
            }
            if c.deltas.contains(&0) {
                return Err(self.err(
                    "cycling",
                    "deltas",
                    "0 is the baseline; list non-zero shifts",
                ));
            }
            if c.gates.is_empty() {
                return Err(self.err("cycling", "gates", "give \"key\", \"value\" or both"));
            }
        }
        if let Some(s) = &f.sweep
            && s.protocols.is_empty()
        {
            return Err(self.err("sweep", "protocols", "give at least one protocol"));
        }
        let empty_list = |section: &str, key: &str, empty: bool| {
            if empty {
                Err(self.err(section, key, "the list is empty"))
            } else {
                Ok(())
            }
        };
        if let Some(p) = &f.patch {
            empty_list("patch", "head_kinds", p.head_kinds.is_empty())?;
            empty_list("patch", "directions", p.directions.is_empty())?;
        }
        if let Some(a) = &f.ablate {
            empty_list("ablate", "head_kinds", a.head_kinds.is_empty())?;
            empty_list("ablate", "methods", a.methods.is_empty())?;
        }
        if let Some(k) = &f.knockout
            && k.layer_output
            && k.band == 0
        {
            return Err(self.err("knockout", "band", "must be at least 1"));
        }
        Ok(())
    }
}

/// 1-based line of `key = ...` inside `[section]` (or of the section header when
/// `key` is empty).
pub fn key_line(text: &str, section: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix('[') {
            current = rest
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim()
                .to_string();
            if key.is_empty() && current == section {
                return Some(i + 1);
            }
            continue;
        }
        if !key.is_empty()
            && current == section
            && let Some(rest) = t.strip_prefix(key)
            && rest.trim_start().starts_with('=')
        {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Experiment> {
        Experiment::parse(Path::new("exp/t.toml"), text.to_string())
    }

    #[test]
    fn minimal_file_and_defaults() {
        let e = parse(
            "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"organisms/kvc-w8s8\"\n",
        )
        .unwrap();
        assert_eq!(e.name(), "t");
        assert_eq!(e.kind(), Kind::PatchHeads);
        assert_eq!(e.file.experiment.bootstrap_reps, 2000);
        assert!(e.file.patch.is_none());
    }

    #[test]
    fn unknown_key_names_line_and_key() {
        let err = parse(
            "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"x\"\n[patch]\nlayerz = [0]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("exp/t.toml") && err.contains("line 6") && err.contains("layerz"),
            "{err}"
        );
    }

    #[test]
    fn wrong_section_for_kind() {
        let err = parse(
            "[experiment]\nkind = \"knockout\"\n[model]\norganism = \"x\"\n\n[patch]\nlayers = [0]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 6") && err.contains("[patch]"), "{err}");
    }

    #[test]
    fn selections_and_positions() {
        let e = parse(
            "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"x\"\n[patch]\nlayers = [1, 3]\nheads = \"all\"\npositions = { final = 4 }\n",
        )
        .unwrap();
        let p = e.file.patch.unwrap();
        assert_eq!(p.layers, Selection::Only(vec![1, 3]));
        assert_eq!(p.heads, Selection::All);
        assert_eq!(p.positions, Positions::Final(4));
        assert!(Selection::Only(vec![5]).resolve(4, "layers").is_err());
        let err = parse(
            "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"x\"\n[patch]\nlayers = \"some\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 6"), "{err}");
    }

    #[test]
    fn key_line_finds_keys_in_sections() {
        let t = "[a]\nx = 1\n[b]\nx = 2\n  y= 3\n";
        assert_eq!(key_line(t, "b", "x"), Some(4));
        assert_eq!(key_line(t, "b", "y"), Some(5));
        assert_eq!(key_line(t, "b", ""), Some(3));
        assert_eq!(key_line(t, "c", "x"), None);
    }
}
