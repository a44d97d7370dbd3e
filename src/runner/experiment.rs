//! The experiment TOML (`docs/experiments.md` documents every key).
//!
//! ```toml
//! [experiment]
//! kind = "patch-heads"            # one of the kinds registered in runner/kinds/mod.rs
//! [model]
//! organism = "organisms/kvc-w8s8" # or path = "/models/DeepSeek-V4-Pro"
//! [task]                          # defaults: the organism's token space, prompt format and period
//! n_logical = 64
//! [patch]                         # the section of the kind
//! positions = "all"
//! ```
//!
//! `[experiment] kind` selects the kind, and the kind's own section (`[patch]` for
//! patch-heads, ...) holds its settings: the file is tagged by `kind`, the settings
//! type belongs to the kind's file under `runner/kinds/` ([`KindConfig`]). Unknown keys
//! and wrong types are errors naming the file, line and key
//! ([`crate::toml_file::parse_toml`]); semantic errors found later (a layer out of range,
//! a period that does not fit the model) name the key too, via [`Experiment::err`].

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::error::{Error, Result};
pub use crate::output::check_output_name;
use crate::tasks::{KvPromptConfig, Protocol, TokenSpaceConfig};

use super::kinds::{Kind, KindConfig};

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
    /// What to run: the name of a registered kind (`patch-heads`, ...).
    #[serde(deserialize_with = "kind_name")]
    pub kind: String,
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
    /// `[model.placement]`: the layers (and routed experts) over several devices
    /// (`model::placement::PlacementConfig`); `--devices` overrides it.
    #[serde(default)]
    pub placement: Option<crate::model::placement::PlacementConfig>,
    /// `weights = "stored" | "f32"`: BF16 / FP8 / FP4 checkpoint weights resident as
    /// stored (dequantised where used; the default) or dequantised to f32 on load;
    /// `--weights` overrides it.
    #[serde(default)]
    pub weights: Option<crate::model::stored::Residency>,
    /// `dtype = "f32" | "bf16"`: the compute dtype of the matrix products
    /// (`crate::model::precision`; default f32); `--dtype` overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<crate::model::ComputeDtype>,
    /// `[model.compression]`: a training-free chunked-compression overlay on the model
    /// (`kind = "select" | "pool"`, `crate::model::compression::Overlay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<crate::model::compression::Overlay>,
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
    /// `kind = "kv" | "passkey" | "needle"`: key-value prompts (`vocab` / `prompt`, the
    /// default), or a text task with a real tokenizer (phase-sweep and patch-heads;
    /// `[task.text]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<TaskKind>,
    /// `[task.text]`: the passkey / needle settings (`kind = "passkey" | "needle"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextSection>,
}

/// `[task] kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// Key-value retrieval (`crate::tasks::generate_eval_set`).
    #[default]
    Kv,
    /// "The pass key is 71432. Remember it." inside varied filler.
    Passkey,
    /// A fact sentence inside varied filler.
    Needle,
}

/// The experiment kinds that run the text tasks (`[task] kind = "passkey" | "needle"`).
pub const TEXT_TASK_KINDS: [&str; 2] = ["phase-sweep", "patch-heads"];

impl TaskKind {
    /// The text task, for passkey and needle.
    pub fn text(self) -> Option<crate::tasks::TextTask> {
        match self {
            TaskKind::Kv => None,
            TaskKind::Passkey => Some(crate::tasks::TextTask::Passkey),
            TaskKind::Needle => Some(crate::tasks::TextTask::Needle),
        }
    }
}

/// `[task.text]` (every key optional; defaults in `crate::tasks::TextNeedleConfig`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextSection {
    /// Prompt length in tokens. Default 512.
    #[serde(default)]
    pub length: Option<usize>,
    /// Needle depth range `[lo, hi]`, fractions of the filler. Default `[0.1, 0.9]`.
    #[serde(default)]
    pub depth: Option<[f64; 2]>,
    /// Digits of the pass key. Default 5.
    #[serde(default)]
    pub digits: Option<usize>,
    /// The needle's facts (`{ sentence, question, values }`). Default: the built-in six.
    #[serde(default)]
    pub facts: Option<Vec<crate::tasks::Fact>>,
}

/// A whole experiment file: the shared sections and the kind's settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExperimentFile {
    pub experiment: ExperimentSection,
    pub model: ModelSection,
    pub task: TaskSection,
    /// The settings of `[experiment] kind`: its section (`[patch]`, ...) or its defaults.
    #[serde(flatten)]
    pub kind: KindConfig,
}

/// `[experiment] kind`: a registered kind's name.
fn kind_name<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    let s = String::deserialize(d)?;
    if KindConfig::named(&s).is_none() {
        return Err(de::Error::unknown_variant(&s, KindConfig::names()));
    }
    Ok(s)
}

/// The file as written: the shared sections and whichever kind sections appear, in
/// order. Each kind section is read by its kind's settings type (so an unknown key
/// inside it is reported at its own line); which one belongs to the kind is checked in
/// [`Experiment::parse`].
struct RawFile {
    experiment: ExperimentSection,
    model: ModelSection,
    task: TaskSection,
    sections: Vec<(String, KindConfig)>,
}

/// A top-level table name: a shared section or a registered kind's section.
struct SectionName;

impl<'de> de::DeserializeSeed<'de> for SectionName {
    type Value = String;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<String, D::Error> {
        let s = String::deserialize(d)?;
        let shared = ["experiment", "model", "task"];
        if shared.contains(&s.as_str()) || KindConfig::sections().contains(&s.as_str()) {
            Ok(s)
        } else {
            Err(de::Error::unknown_field(&s, KindConfig::all_sections()))
        }
    }
}

impl<'de> Deserialize<'de> for RawFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawFile;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "an experiment file ([experiment], [model], [task], the kind's section)",
                )
            }
            fn visit_map<A: de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawFile, A::Error> {
                let (mut experiment, mut model, mut task) = (None, None, None);
                let mut sections = Vec::new();
                while let Some(key) = map.next_key_seed(SectionName)? {
                    let dup = match key.as_str() {
                        "experiment" => experiment.replace(map.next_value()?).is_some(),
                        "model" => model.replace(map.next_value()?).is_some(),
                        "task" => task.replace(map.next_value()?).is_some(),
                        section => {
                            let c = KindConfig::read_section(section, &mut map)?;
                            sections.push((key.clone(), c));
                            false
                        }
                    };
                    if dup {
                        return Err(de::Error::custom(format!("duplicate section [{key}]")));
                    }
                }
                Ok(RawFile {
                    experiment: experiment.ok_or_else(|| de::Error::missing_field("experiment"))?,
                    model: model.ok_or_else(|| de::Error::missing_field("model"))?,
                    task: task.unwrap_or_default(),
                    sections,
                })
            }
        }
        d.deserialize_map(V)
    }
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

    /// Positions a chunk row recomputes when the cells run as suffix forwards (edits at
    /// given positions: the answer's, the last `k`, one `k` before the answer), from the
    /// first edited position to the last target position, for the memory plan
    /// (`phaselens plan --experiment`). `None`: every position (edits everywhere, or a
    /// kind without positions).
    pub fn suffix_positions(&self) -> Option<usize> {
        use crate::runner::kinds::KindConfig as K;
        use crate::runner::patching::Positions;
        let positions = match &self.file.kind {
            K::PatchHeads(c) => &c.positions,
            K::AblateHeads(c) => &c.positions,
            K::Knockout(c) => &c.positions,
            K::PathPatching(c) => &c.positions,
            _ => return None,
        };
        // The scored answer's teacher-forced tokens are consecutive target positions.
        let answer = self
            .file
            .task
            .prompt
            .as_ref()
            .map_or(1, |p| p.value_len.max(1));
        match positions {
            Positions::All => None,
            Positions::Answer => Some(answer),
            Positions::Final(k) => Some((*k).max(answer)),
            Positions::Offset(k) => Some(k + answer),
        }
    }

    /// Read, parse and check the structure of an experiment TOML.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, text)
    }

    /// Parse `text` as the contents of `path`.
    pub fn parse(path: &Path, text: String) -> Result<Self> {
        crate::toml_file::expect_kind(path, &text, crate::toml_file::FileKind::Experiment)?;
        let raw: RawFile = crate::toml_file::parse_toml(path, &text)?;
        let name = raw.experiment.kind.clone();
        let mut own = None;
        let mut wrong = None;
        for (section, c) in raw.sections {
            if c.kind().name() == name {
                own = Some(c);
            } else if wrong.is_none() {
                wrong = Some(section);
            }
        }
        let kind = match own.or_else(|| KindConfig::named(&name)) {
            Some(k) => k,
            None => unreachable!("[experiment] kind is checked while parsing"),
        };
        let exp = Experiment {
            file: ExperimentFile {
                experiment: raw.experiment,
                model: raw.model,
                task: raw.task,
                kind,
            },
            text,
            path: path.to_path_buf(),
        };
        if let Some(section) = wrong {
            let k = exp.kind();
            return Err(exp.err(
                &section,
                "",
                format!(
                    "this section is not used by kind \"{}\" (its section is [{}])",
                    k.name(),
                    k.section()
                ),
            ));
        }
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

    /// The kind (its settings and behaviour).
    pub fn kind(&self) -> &dyn Kind {
        self.file.kind.kind()
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

    /// Experiment-wide numbers must be sane; then the kind checks its own settings.
    fn check_sections(&self) -> Result<()> {
        let f = &self.file;
        if let Err(m) = check_output_name(&self.name()) {
            return Err(self.err("experiment", "name", m));
        }
        if let Some(n) = &f.model.name
            && let Err(m) = check_output_name(n)
        {
            return Err(self.err("model", "name", m));
        }
        if f.experiment.bootstrap_reps > MAX_BOOTSTRAP_REPS {
            return Err(self.err(
                "experiment",
                "bootstrap_reps",
                format!(
                    "{} is more than {MAX_BOOTSTRAP_REPS} replicates (intervals stop changing long before)",
                    f.experiment.bootstrap_reps
                ),
            ));
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
            && !self.kind().accepts_model_glob()
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
        if let Some(n) = f.task.n_logical
            && n > MAX_N_LOGICAL
        {
            return Err(self.err(
                "task",
                "n_logical",
                format!("{n} is more than {MAX_N_LOGICAL} logical examples per phase group"),
            ));
        }
        if let Some(p) = f.task.period
            && let Err(e) = crate::tasks::Period::new(p)
        {
            return Err(self.err("task", "period", e));
        }
        if f.task.period == Some(0) {
            return Err(self.err("task", "period", "must be at least 1"));
        }
        self.check_task_kind()?;
        self.kind().check(self)
    }

    /// `[task] kind` against the experiment kind and the other `[task]` keys.
    fn check_task_kind(&self) -> Result<()> {
        let t = &self.file.task;
        let text = t.kind.and_then(TaskKind::text);
        match text {
            Some(task) => {
                if !TEXT_TASK_KINDS.contains(&self.kind().name()) {
                    return Err(self.err(
                        "task",
                        "kind",
                        format!(
                            "kind = \"{}\" runs in experiment kinds {} only (not \"{}\")",
                            task.name(),
                            TEXT_TASK_KINDS.map(|k| format!("\"{k}\"")).join(" and "),
                            self.kind().name()
                        ),
                    ));
                }
                if t.prompt.is_some() {
                    return Err(self.err(
                        "task",
                        "prompt",
                        format!(
                            "the key-value prompt format does not apply to kind = \"{}\"; use [task.text]",
                            task.name()
                        ),
                    ));
                }
                if task == crate::tasks::TextTask::Passkey
                    && t.text.as_ref().is_some_and(|x| x.facts.is_some())
                {
                    return Err(self.err(
                        "task",
                        "text",
                        "`facts` belongs to kind = \"needle\" (the passkey's value is its digits)",
                    ));
                }
            }
            None if t.text.is_some() => {
                return Err(self.err(
                    "task",
                    "text",
                    "[task.text] needs kind = \"passkey\" or \"needle\" in [task]",
                ));
            }
            None => {}
        }
        Ok(())
    }
}

/// The most logical examples per phase group an experiment may ask for.
pub const MAX_N_LOGICAL: usize = 1_000_000;

/// The most bootstrap replicates an experiment may ask for (each replicate resamples
/// every cluster of every cell: 10^11 would run for days and hold gigabytes).
pub const MAX_BOOTSTRAP_REPS: usize = 1_000_000;

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
        assert_eq!(e.kind().name(), "patch-heads");
        assert_eq!(e.file.experiment.bootstrap_reps, 2000);
        assert_eq!(
            e.file.kind,
            KindConfig::PatchHeads(crate::runner::kinds::patch_heads::PatchHeads::default())
        );
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
        // The plan sizes a chunk row by the positions it recomputes.
        assert_eq!(e.suffix_positions(), Some(4));
        let kind = |body: &str| {
            parse(&format!(
                "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"x\"\n{body}"
            ))
            .unwrap()
            .suffix_positions()
        };
        assert_eq!(kind("[patch]\npositions = \"answer\"\n"), Some(1));
        assert_eq!(
            kind("[task]\nprompt = { value_len = 3 }\n[patch]\npositions = \"answer\"\n"),
            Some(3)
        );
        assert_eq!(kind("[patch]\npositions = \"all\"\n"), None);
        let KindConfig::PatchHeads(p) = e.file.kind else {
            panic!("{:?}", e.file.kind)
        };
        assert_eq!(p.layers, Selection::Only(vec![1, 3]));
        assert_eq!(p.heads, Selection::All);
        assert_eq!(p.positions, crate::runner::patching::Positions::Final(4));
        assert!(Selection::Only(vec![5]).resolve(4, "layers").is_err());
        let err = parse(
            "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"x\"\n[patch]\nlayers = \"some\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 6"), "{err}");
    }

    #[test]
    fn unknown_kind_and_unknown_section_name_their_line() {
        let err = parse("[experiment]\nkind = \"patch-headz\"\n[model]\norganism = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 2") && err.contains("patch-headz") && err.contains("knockout"),
            "{err}"
        );
        let err = parse(
            "[experiment]\nkind = \"knockout\"\n[model]\norganism = \"x\"\n[knockoutt]\nband = 2\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 5") && err.contains("knockoutt"), "{err}");
    }

    #[test]
    fn kind_checks_its_own_settings() {
        let err = parse(
            "[experiment]\nkind = \"gate-cycling\"\n[model]\norganism = \"x\"\n[cycling]\ndeltas = [0, 1]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 6") && err.contains("deltas"), "{err}");
        let err = parse(
            "[experiment]\nkind = \"ablate-heads\"\n[model]\norganism = \"x\"\n[ablate]\nmethods = [\"zero\", \"source\"]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 6") && err.contains("source"), "{err}");
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
