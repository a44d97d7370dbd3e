//! The grid TOML (every key is documented in `docs/grid.md`):
//!
//! ```toml
//! [grid]
//! base = "../organisms/kvc-w8s8.toml"   # the base recipe, relative to this file
//! [set]                                 # recipe keys set in every design
//! "task.train.prompt.query_sampling" = "with_replacement"
//! steps = 2000
//! [axes]                                # a cartesian product, in file order ...
//! seed = [0, 1, 2, 3]
//! [[design]]                            # ... and/or an explicit list (crossed with the axes)
//! name = "kv2"
//! set = { kv_heads = 2 }
//! [eval]                                # the phase sweeps run on every design
//! [slurm]                               # resources of the Slurm array tasks
//! ```
//!
//! A key is an alias ([`super::keys::ALIASES`]) or a dotted path into the recipe.
//! Unknown grid keys and recipe keys that the recipe does not accept are errors naming
//! the grid file, the line and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::error::{Error, Result};
use crate::model::kvc::AttentionKind;
use crate::tasks::Protocol;
use crate::toml_file::{line_of, parse_toml};
use crate::train::{ModelConfig, OrganismFile};

use super::keys::{self, get_path, name_part, paths_of, set_path, valid_name};

/// `[grid]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct GridSection {
    /// Default: the file stem.
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: String,
    /// The paper's numbers the designs compare with (free text for the report).
    #[serde(default)]
    paper: String,
    /// The base recipe, relative to the grid file.
    base: PathBuf,
    /// Folder of the designs (recipes, models, checkpoints), relative to the grid file.
    /// Default: `<name>` next to the grid file.
    #[serde(default)]
    out: Option<PathBuf>,
    /// The frontier's phase-gap gate (`"5pp"` or 5): default [`DEFAULT_MAX_GAP_PP`].
    #[serde(default)]
    max_gap: Option<toml::Value>,
}

/// The frontier's default phase-gap gate (pp), the audit's `--max-gap 5pp`.
pub const DEFAULT_MAX_GAP_PP: f64 = 5.0;

/// `[grid] max_gap` in pp: a number (pp) or text such as `"5pp"`; must be in (0, 100].
fn max_gap_pp(src: Source, g: &GridSection) -> Result<f64> {
    let Some(v) = &g.max_gap else {
        return Ok(DEFAULT_MAX_GAP_PP);
    };
    let pp = match v {
        toml::Value::Integer(i) => Ok(*i as f64),
        toml::Value::Float(f) => Ok(*f),
        toml::Value::String(s) => crate::audit::parse_pp(s),
        other => Err(format!(
            "expected an amount in pp (5 or \"5pp\"), got {other}"
        )),
    }
    .map_err(|m| src.bad(None, format!("[grid] max_gap: {m}")))?;
    if !(pp > 0.0 && pp <= 100.0) {
        return Err(src.bad(None, format!("[grid] max_gap: {pp} pp is not in (0, 100]")));
    }
    Ok(pp)
}

type KeyMap = BTreeMap<Spanned<String>, Spanned<toml::Value>>;
/// An explicit design (or none: the base alone) and its keys in file order.
type Named<'a> = (
    Option<&'a RawDesign>,
    Vec<(&'a Spanned<String>, &'a Spanned<toml::Value>)>,
);

/// `[[design]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDesign {
    name: Spanned<String>,
    #[serde(default)]
    set: KeyMap,
    /// What the design showed (free text for the report).
    #[serde(default)]
    note: String,
    /// The paper's numbers for this design, if it has them (free text for the report).
    #[serde(default)]
    paper: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGrid {
    grid: GridSection,
    #[serde(default)]
    set: KeyMap,
    #[serde(default)]
    axes: BTreeMap<Spanned<String>, Spanned<Vec<toml::Value>>>,
    #[serde(default)]
    design: Vec<RawDesign>,
    #[serde(default)]
    eval: EvalConfig,
    #[serde(default)]
    slurm: SlurmConfig,
}

/// `[eval]`: the phase sweeps of every design (`phase-sweep` experiments).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Logical examples per phase group of the headline sweep. Default 256.
    pub n_logical: usize,
    /// Protocols of the headline sweep. Default both.
    pub protocols: Vec<Protocol>,
    /// Query slots: the final query is the k-th query of its prompt; the k - 1 before
    /// it (teacher-forced) ask distinct other bindings, whatever the design's
    /// `query_sampling`, so a model that eliminates already-asked bindings would gain.
    /// Default 1, 4, 8, 16 (those up to the design's bindings). Slot 1 is the headline
    /// sweep.
    pub slots: Option<Vec<usize>>,
    /// Binding counts of a single final query. Default 8, 16, 24, 32 (the design's own
    /// count is the headline sweep).
    pub bindings: Vec<usize>,
    /// Logical examples per phase group of the slot and binding sweeps. Default 128.
    pub detail_n_logical: usize,
    /// Protocol of the slot and binding sweeps. Default prefix_padding.
    pub detail_protocol: Protocol,
    /// Cluster-bootstrap replicates. Default 2000.
    pub bootstrap_reps: usize,
    /// Seed of the evaluation prompts; default the runner's (held out from training).
    pub seed: Option<u64>,
}

impl EvalConfig {
    /// The query slots of a design with `n_bindings` bindings.
    pub fn slots_for(&self, n_bindings: usize) -> Vec<usize> {
        match &self.slots {
            Some(s) => s.clone(),
            None => [1, 4, 8, 16]
                .into_iter()
                .filter(|&k| k <= n_bindings)
                .collect(),
        }
    }
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            n_logical: 256,
            protocols: Protocol::ALL.to_vec(),
            slots: None,
            bindings: vec![8, 16, 24, 32],
            detail_n_logical: 128,
            detail_protocol: Protocol::PrefixPadding,
            bootstrap_reps: crate::analysis::DEFAULT_REPS,
            seed: None,
        }
    }
}

/// `[slurm]`: resources of each array task (flags of `phaselens grid --slurm`
/// override them).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmConfig {
    /// `--partition`.
    pub partition: Option<String>,
    /// `--cpus-per-task`. Default 1.
    pub cpus_per_task: Option<u32>,
    /// `--mem` (e.g. "4G").
    pub mem: Option<String>,
    /// `--time` (e.g. "04:00:00").
    pub time: Option<String>,
    /// At most this many array tasks at once (`--array=...%N`).
    pub max_parallel: Option<usize>,
    /// More `sbatch` arguments, verbatim (e.g. ["--account=lab", "--qos=low"]).
    pub sbatch_args: Vec<String>,
}

/// One design of the grid.
#[derive(Debug, Clone)]
pub struct Design {
    /// Position in the grid (the Slurm array index).
    pub index: usize,
    /// Stable name (folder and `design` column).
    pub name: String,
    /// The grid keys this design sets beyond `[set]`, in file order.
    pub keys: Vec<(String, toml::Value)>,
    /// The full recipe.
    pub recipe: toml::Table,
    /// Free text from the grid file.
    pub note: String,
    /// The paper's numbers for it, from the grid file.
    pub paper: String,
}

/// A loaded grid.
#[derive(Debug, Clone)]
pub struct Grid {
    /// The grid file.
    pub path: PathBuf,
    /// The grid's name (its file stem; names its output folders).
    pub name: String,
    /// What it is for (free text).
    pub description: String,
    /// `[grid] paper`: what the paper reports, for the report.
    pub paper: String,
    /// The base recipe file.
    pub base: PathBuf,
    /// Folder of the designs' recipes, models and checkpoints.
    pub dir: PathBuf,
    /// Every design, in file order.
    pub designs: Vec<Design>,
    /// The key columns of the merged tables (every key some design sets), in file order.
    pub columns: Vec<String>,
    /// `[eval]`: the sweeps of every design.
    pub eval: EvalConfig,
    /// `[slurm]`: resources of the array tasks.
    pub slurm: SlurmConfig,
    /// `[grid] max_gap` (pp): the frontier's gate on the phase gap (docs/grid.md).
    pub max_gap_pp: f64,
}

impl Grid {
    /// Read, expand and validate a grid file: every design's recipe is parsed and
    /// checked like `phaselens train` would.
    pub fn load(path: &Path) -> Result<Grid> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, &text)
    }

    /// [`Grid::load`] from text (`path` names the file in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Grid> {
        crate::toml_file::expect_kind(path, text, crate::toml_file::FileKind::Grid)?;
        let raw: RawGrid = parse_toml(path, text)?;
        let src = Source { path, text };
        let folder = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let name = grid_name(src, &raw.grid)?;
        let max_gap_pp = max_gap_pp(src, &raw.grid)?;
        let (base, base_table) = load_base(src, &folder, &raw.grid)?;
        let dir = folder.join(raw.grid.out.clone().unwrap_or_else(|| name.clone().into()));

        let common = ordered(&raw.set);
        let axes = sorted_axes(src, &raw.axes)?;
        // Explicit designs (or the base alone), crossed with the axes.
        let named: Vec<Named> = if raw.design.is_empty() {
            vec![(None, Vec::new())]
        } else {
            raw.design
                .iter()
                .map(|d| (Some(d), ordered(&d.set)))
                .collect()
        };
        if raw.design.is_empty() && axes.is_empty() {
            return Err(src.bad(
                None,
                "a grid needs [axes] or [[design]] entries (or both)".into(),
            ));
        }
        let combos = product(&axes);
        let expander = Expander {
            src,
            base: &base,
            base_table: &base_table,
            dir: &dir,
            common: &common,
            eval: &raw.eval,
        };
        let mut designs = Vec::new();
        let mut columns: Vec<(usize, String)> = Vec::new();
        for (raw_d, set) in &named {
            for combo in &combos {
                for (k, _) in set {
                    columns.push((k.span().start, k.get_ref().clone()));
                }
                for (k, _) in combo {
                    columns.push((k.span().start, k.get_ref().clone()));
                }
                let design = expander.design(*raw_d, set, combo, &designs)?;
                designs.push(design);
            }
        }
        columns.sort();
        let mut cols: Vec<String> = Vec::new();
        for (_, c) in columns {
            if !cols.contains(&c) {
                cols.push(c);
            }
        }
        check_eval(&raw.eval).map_err(|m| src.bad(None, format!("[eval] {m}")))?;
        Ok(Grid {
            path: path.to_path_buf(),
            name,
            description: raw.grid.description,
            paper: raw.grid.paper,
            base,
            dir,
            designs,
            columns: cols,
            eval: raw.eval,
            slurm: raw.slurm,
            max_gap_pp,
        })
    }

    /// The design called `name`.
    pub fn design(&self, name: &str) -> Result<&Design> {
        self.designs.iter().find(|d| d.name == name).ok_or_else(|| {
            Error::Other(format!(
                "{}: no design `{name}` (designs: {})",
                self.path.display(),
                self.designs
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }
}

impl Design {
    /// The design's folder: `recipe.toml`, `model/`, `run/` (checkpoints), `eval/`.
    pub fn dir(&self, grid_dir: &Path) -> PathBuf {
        grid_dir.join(&self.name)
    }

    /// Where its recipe is written.
    pub fn recipe_path(&self, grid_dir: &Path) -> PathBuf {
        self.dir(grid_dir).join("recipe.toml")
    }

    /// The recipe as TOML text, with a header saying where it comes from.
    pub fn recipe_text(&self, grid_path: &Path) -> String {
        let body = toml::to_string(&self.recipe).expect("a TOML table serialises");
        format!(
            "# Generated by `phaselens grid` from {} (design `{}`): edit the grid file, not this.\n\n{body}",
            grid_path.display(),
            self.name
        )
    }

    /// The parsed recipe (as it will be at [`Design::recipe_path`]).
    pub fn organism(&self, grid_dir: &Path) -> Result<OrganismFile> {
        let text = toml::to_string(&self.recipe).expect("a TOML table serialises");
        OrganismFile::parse(&self.recipe_path(grid_dir), &text)
    }

    /// The value of grid key `key` in the design's recipe (an alias reads its first
    /// path); `None` when the recipe leaves it at its default.
    pub fn value(&self, key: &str) -> Option<&toml::Value> {
        get_path(&self.recipe, &paths_of(key)[0])
    }
}

/// The grid file and its text, for errors that name the file and the line.
#[derive(Clone, Copy)]
struct Source<'a> {
    path: &'a Path,
    text: &'a str,
}

impl Source<'_> {
    /// A config error about the grid file, at the line of `span` when there is one.
    fn bad(&self, span: Option<std::ops::Range<usize>>, m: String) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            message: match span {
                Some(s) => format!("line {}: {m}", line_of(self.text, s.start)),
                None => m,
            },
        }
    }
}

/// The grid's name: `[grid] name`, else the file stem (checked like a design name).
fn grid_name(src: Source, g: &GridSection) -> Result<String> {
    let name = match &g.name {
        Some(n) => n.clone(),
        None => src
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "grid".into()),
    };
    if !valid_name(&name) {
        return Err(src.bad(
            None,
            format!("[grid] name `{name}`: use lower-case letters, digits, '-', '_', '.'"),
        ));
    }
    Ok(name)
}

/// The base recipe's path and table; it must be a valid recipe on its own.
fn load_base(src: Source, folder: &Path, g: &GridSection) -> Result<(PathBuf, toml::Table)> {
    let base = folder.join(&g.base);
    let base_text = std::fs::read_to_string(&base)
        .map_err(|e| src.bad(None, format!("[grid] base = {}: {e}", g.base.display())))?;
    OrganismFile::parse(&base, &base_text)?;
    let base_table: toml::Table = toml::from_str(&base_text).map_err(|e| Error::Config {
        path: base.clone(),
        message: e.message().to_string(),
    })?;
    Ok((base, base_table))
}

/// One axis of the grid: its key and its values.
type Axis = (Spanned<String>, Spanned<Vec<toml::Value>>);

/// The axes in file order; an axis without values is an error.
fn sorted_axes(
    src: Source,
    axes: &BTreeMap<Spanned<String>, Spanned<Vec<toml::Value>>>,
) -> Result<Vec<Axis>> {
    let mut v: Vec<_> = axes
        .iter()
        .map(|(k, vals)| (k.clone(), vals.clone()))
        .collect();
    v.sort_by_key(|(k, _)| k.span().start);
    for (k, vals) in &v {
        if vals.get_ref().is_empty() {
            return Err(src.bad(
                Some(vals.span()),
                format!("[axes] `{}`: the list of values is empty", k.get_ref()),
            ));
        }
    }
    Ok(v)
}

/// Keys of the grid file in file order, as [`ordered`] gives them.
type Keys<'a> = [(&'a Spanned<String>, &'a Spanned<toml::Value>)];
/// One combination of axis values, as [`product`] gives it.
type Combo<'a> = [(&'a Spanned<String>, toml::Value)];

/// What every design of a grid is built from: the base recipe, the `[set]` keys, the
/// designs' folder and `[eval]` (checked against each design).
struct Expander<'a> {
    src: Source<'a>,
    base: &'a Path,
    base_table: &'a toml::Table,
    dir: &'a Path,
    common: &'a Keys<'a>,
    eval: &'a EvalConfig,
}

impl Expander<'_> {
    /// The design of explicit entry `raw_d` (or the base) crossed with `combo`, named,
    /// built and checked like `phaselens train` would; `taken` are the designs before.
    fn design(
        &self,
        raw_d: Option<&RawDesign>,
        set: &Keys,
        combo: &Combo,
        taken: &[Design],
    ) -> Result<Design> {
        let mut keys: Vec<(String, toml::Value)> = set
            .iter()
            .map(|(k, v)| (k.get_ref().clone(), v.get_ref().clone()))
            .collect();
        let mut parts: Vec<String> = raw_d
            .map(|d| vec![d.name.get_ref().clone()])
            .unwrap_or_default();
        for (k, v) in combo {
            keys.push((k.get_ref().clone(), v.clone()));
            parts.push(name_part(k.get_ref(), v));
        }
        let name = parts.join("-");
        let span = raw_d.map(|d| d.name.span());
        if !valid_name(&name) {
            return Err(self.src.bad(
                span.clone(),
                format!("design name `{name}`: use lower-case letters, digits, '-', '_', '.'"),
            ));
        }
        if taken.iter().any(|d: &Design| d.name == name) {
            return Err(self
                .src
                .bad(span.clone(), format!("two designs are named `{name}`")));
        }
        let recipe = self.recipe(&name, &keys, set, combo)?;
        let design = Design {
            index: taken.len(),
            name,
            keys,
            recipe,
            note: raw_d.map(|d| d.note.clone()).unwrap_or_default(),
            paper: raw_d.map(|d| d.paper.clone()).unwrap_or_default(),
        };
        let file = match design.organism(self.dir) {
            Ok(f) => f,
            Err(e) => return Err(self.rejected(&design, e, span, set, combo)),
        };
        check_period(&file)
            .and_then(|()| check_slots(&file, self.eval))
            .map_err(|m| self.src.bad(span, format!("design `{}`: {m}", design.name)))?;
        Ok(design)
    }

    /// Every key a design applies, in order: `[set]`, the design's own, the axes'.
    fn all_keys<'s>(
        &'s self,
        set: &'s Keys,
        combo: &'s Combo,
    ) -> impl Iterator<Item = (&'s Spanned<String>, &'s toml::Value)> + 's {
        self.common
            .iter()
            .map(|(k, v)| (*k, v.get_ref()))
            .chain(set.iter().map(|(k, v)| (*k, v.get_ref())))
            .chain(combo.iter().map(|(k, v)| (*k, v)))
    }

    /// The recipe of design `name`: the base with every key applied and the
    /// `[organism]` table the grid sets (name, folders, description from `keys`).
    fn recipe(
        &self,
        name: &str,
        keys: &[(String, toml::Value)],
        set: &Keys,
        combo: &Combo,
    ) -> Result<toml::Table> {
        let mut recipe = self.base_table.clone();
        for (k, v) in self.all_keys(set, combo) {
            apply(&mut recipe, k.get_ref(), v).map_err(|m| {
                self.src
                    .bad(Some(k.span()), format!("key `{}`: {m}", k.get_ref()))
            })?;
        }
        let org = recipe
            .entry("organism")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let Some(t) = org.as_table_mut() {
            t.insert("name".into(), name.to_string().into());
            t.insert("model_dir".into(), "model".into());
            t.insert("run_dir".into(), "run".into());
            let what: Vec<String> = keys.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            t.insert(
                "description".into(),
                format!(
                    "grid `{name}` of {}: {}",
                    self.src.path.display(),
                    what.join(", ")
                )
                .into(),
            );
        }
        Ok(recipe)
    }

    /// The error for a design whose recipe does not load (`e`): a key the recipe does
    /// not accept at all is named with its line in the grid file; anything else is the
    /// design's error.
    fn rejected(
        &self,
        design: &Design,
        e: Error,
        span: Option<std::ops::Range<usize>>,
        set: &Keys,
        combo: &Combo,
    ) -> Error {
        for (k, v) in self.all_keys(set, combo) {
            if let Err(m) = check_key(self.base, self.base_table, k.get_ref(), v) {
                return self
                    .src
                    .bad(Some(k.span()), format!("key `{}`: {m}", k.get_ref()));
            }
        }
        self.src.bad(span, format!("design `{}`: {e}", design.name))
    }
}

fn ordered(m: &KeyMap) -> Vec<(&Spanned<String>, &Spanned<toml::Value>)> {
    let mut v: Vec<_> = m.iter().collect();
    v.sort_by_key(|(k, _)| k.span().start);
    v
}

/// Every combination of the axes' values (the first axis varies slowest).
fn product(
    axes: &[(Spanned<String>, Spanned<Vec<toml::Value>>)],
) -> Vec<Vec<(&Spanned<String>, toml::Value)>> {
    let mut out: Vec<Vec<(&Spanned<String>, toml::Value)>> = vec![Vec::new()];
    for (k, vals) in axes {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                vals.get_ref().iter().map(move |v| {
                    let mut p = prefix.clone();
                    p.push((k, v.clone()));
                    p
                })
            })
            .collect();
    }
    out
}

fn apply(recipe: &mut toml::Table, key: &str, v: &toml::Value) -> std::result::Result<(), String> {
    if key.starts_with("organism.") || key == "organism" {
        return Err(format!(
            "key `{key}`: [organism] is set by the grid (name, model_dir, run_dir)"
        ));
    }
    for p in paths_of(key) {
        set_path(recipe, &p, v.clone())?;
    }
    Ok(())
}

/// Does the recipe format accept `key = v` at all (a known key of the right type)?
/// The parser's message (without its line, which is the generated recipe's) when not;
/// values that only fail together with other keys (W < S) pass.
fn check_key(
    base: &Path,
    base_table: &toml::Table,
    key: &str,
    v: &toml::Value,
) -> std::result::Result<(), String> {
    let mut t = base_table.clone();
    apply(&mut t, key, v)?;
    let text = toml::to_string(&t).map_err(|e| e.to_string())?;
    match OrganismFile::parse(base, &text) {
        Err(Error::Config { message, .. }) if message.starts_with("line ") => {
            Err(strip_line(&message))
        }
        _ => Ok(()),
    }
}

fn strip_line(m: &str) -> String {
    match m.strip_prefix("line ") {
        Some(rest) => rest
            .split_once(": ")
            .map(|(_, r)| r.to_string())
            .unwrap_or_else(|| m.to_string()),
        None => m.to_string(),
    }
}

/// The phases of the evaluation must be those of the compression: P a multiple of
/// every stride.
fn check_period(file: &OrganismFile) -> std::result::Result<(), String> {
    let p = file.task.train.period.get() as usize;
    if let ModelConfig::Kvc(c) = &file.model
        && c.attention == AttentionKind::Compressed
        && let Some(comp) = &c.compression
        && !p.is_multiple_of(comp.stride)
    {
        return Err(format!(
            "period {p} is not a multiple of the stride S = {}: set `period` (task.train.period) with S",
            comp.stride
        ));
    }
    Ok(())
}

/// Slot sweeps ask distinct bindings before the target: at most N queries.
fn check_slots(file: &OrganismFile, e: &EvalConfig) -> std::result::Result<(), String> {
    let n = file.task.train.prompt.n_bindings;
    match e.slots.iter().flatten().find(|&&k| k > n) {
        Some(k) => Err(format!(
            "[eval] slots: slot {k} needs {k} distinct bindings, the design has {n}"
        )),
        None => Ok(()),
    }
}

fn check_eval(e: &EvalConfig) -> std::result::Result<(), String> {
    if e.n_logical == 0 || e.detail_n_logical == 0 {
        return Err("n_logical and detail_n_logical must be at least 1".into());
    }
    if e.protocols.is_empty() {
        return Err("protocols: give at least one".into());
    }
    if e.slots.iter().flatten().any(|&k| k == 0) || e.bindings.contains(&0) {
        return Err("slots and bindings must be at least 1".into());
    }
    use crate::runner::experiment::{MAX_BOOTSTRAP_REPS, MAX_N_LOGICAL};
    if e.n_logical.max(e.detail_n_logical) > MAX_N_LOGICAL {
        return Err(format!(
            "n_logical and detail_n_logical: at most {MAX_N_LOGICAL} logical examples per phase group"
        ));
    }
    if e.bootstrap_reps == 0 || e.bootstrap_reps > MAX_BOOTSTRAP_REPS {
        return Err(format!(
            "bootstrap_reps: give 1 to {MAX_BOOTSTRAP_REPS} replicates (got {})",
            e.bootstrap_reps
        ));
    }
    Ok(())
}

/// Paths, key aliases and every default of a grid, for `--help` and the docs.
pub fn aliases_help() -> String {
    keys::ALIASES
        .iter()
        .map(|a| format!("  {:<15} {} ({})", a.name, a.paths.join(" + "), a.doc))
        .collect::<Vec<_>>()
        .join("\n")
}
