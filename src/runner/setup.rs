//! From an experiment file to a model directory, a token space and a prompt format,
//! and the checks of the experiment against the model that run before any compute.

use std::path::{Path, PathBuf};

use crate::error::{Result, ResultExt};
use crate::model::{LayerKind, ModelInfo};
use crate::tasks::{
    KvEvalConfig, KvEvalSet, KvPromptConfig, Period, Protocol, TaskError, TextNeedleConfig,
    TextNeedleSet, TextTask, TextTokens, TokenSpace, TokenSpaceConfig, generate_eval_set,
    generate_text_needle_set,
};
use crate::train::OrganismFile;

use super::experiment::{Experiment, Selection};

/// A model the experiment runs on.
#[derive(Debug, Clone)]
pub struct ModelRef {
    /// Name used in tables (`model` column) and output folders.
    pub name: String,
    /// The model directory.
    pub dir: PathBuf,
    /// The organism recipe it was trained from, if any (path, parsed file).
    pub organism: Option<(PathBuf, OrganismFile)>,
}

fn organism_path(base: &Path, spec: &str) -> PathBuf {
    let p = base.join(spec);
    if p.extension().is_some_and(|e| e == "toml") {
        p
    } else {
        p.with_extension("toml")
    }
}

/// The model directory `[model] path` names (relative to the experiment file), named
/// by `[model] name` or the directory.
fn model_at_path(exp: &Experiment, base: &Path, path: &Path) -> Result<ModelRef> {
    let path = crate::model::pretrained::expand_model_path(path);
    let dir = if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    };
    if !dir.join("config.json").exists() && crate::model::pretrained::detect(&dir).is_none() {
        return Err(exp.err(
            "model",
            "path",
            format!(
                "{} is not a model directory (no config.json) nor a GGUF file",
                dir.display()
            ),
        ));
    }
    let name = exp.file.model.name.clone().unwrap_or_else(|| {
        dir.file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    Ok(ModelRef {
        name,
        dir,
        organism: None,
    })
}

/// The organism recipes `[model] organism` names: the one file, or every file a glob
/// matches (sorted; none is an error).
fn organism_recipes(exp: &Experiment, base: &Path, spec: &str) -> Result<Vec<PathBuf>> {
    if !spec.contains('*') {
        return Ok(vec![organism_path(base, spec)]);
    }
    let pattern = organism_path(base, spec);
    let mut v: Vec<PathBuf> = glob::glob(&pattern.to_string_lossy())
        .map_err(|e| exp.err("model", "organism", format!("bad glob: {e}")))?
        .filter_map(|p| p.ok())
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(exp.err(
            "model",
            "organism",
            format!("no organism recipe matches {}", pattern.display()),
        ));
    }
    Ok(v)
}

/// The models of an experiment: one, or (phase-sweep with a glob) every organism the
/// glob matches. Untrained organisms are an error, or skipped with a note when
/// `skip_untrained` (phase-sweep).
pub fn resolve_models(exp: &Experiment) -> Result<(Vec<ModelRef>, Vec<String>)> {
    let base = exp.base_dir();
    let m = &exp.file.model;
    let mut notes = Vec::new();
    if let Some(path) = &m.path {
        return Ok((vec![model_at_path(exp, &base, path)?], notes));
    }
    let spec = m.organism.as_deref().expect("checked: organism or path");
    let recipes = organism_recipes(exp, &base, spec)?;
    let skip = exp.kind().skips_untrained() && spec.contains('*');
    let mut out = Vec::new();
    for recipe in recipes {
        if !recipe.exists() {
            return Err(exp.err(
                "model",
                "organism",
                format!("no organism recipe {}", recipe.display()),
            ));
        }
        let file = OrganismFile::load(&recipe)?;
        let dir = file.model_dir(&recipe);
        if !dir.join("config.json").exists() {
            let msg = format!(
                "organism `{}` is not trained yet ({} does not exist): run `just train {}`",
                file.organism.name,
                dir.display(),
                recipe.display()
            );
            if skip {
                notes.push(format!("skipping: {msg}"));
                continue;
            }
            return Err(exp.err("model", "organism", msg));
        }
        let name = if spec.contains('*') {
            file.organism.name.clone()
        } else {
            m.name.clone().unwrap_or_else(|| file.organism.name.clone())
        };
        out.push(ModelRef {
            name,
            dir,
            organism: Some((recipe, file)),
        });
    }
    if out.is_empty() {
        return Err(exp.err(
            "model",
            "organism",
            format!(
                "no trained organism matches `{spec}` ({})",
                notes.join("; ")
            ),
        ));
    }
    Ok((out, notes))
}

/// The resolved prompts of an experiment on one model.
#[derive(Debug, Clone)]
pub struct TaskSetup {
    pub space: TokenSpace,
    pub space_config: TokenSpaceConfig,
    pub prompt: KvPromptConfig,
    pub period: Period,
    /// Protocol of every kind but phase-sweep.
    pub protocol: Protocol,
    /// Logical examples used per phase group.
    pub n_logical: usize,
    /// Logical examples generated (the smallest exactly matched design >= n_logical).
    pub n_generated: usize,
    pub seed: u64,
    /// The phase groups evaluated.
    pub phases: Vec<u32>,
    /// Where each default came from (for the report).
    pub provenance: Vec<String>,
    /// `[task] kind = "passkey" | "needle"`: the text task (its protocol and seed are
    /// set per evaluation set); `None` for key-value prompts.
    pub text: Option<TextNeedleConfig>,
}

impl TaskSetup {
    /// Resolve `[task]` against the organism recipe (if any) and the model.
    pub fn resolve(exp: &Experiment, m: &ModelRef, info: &ModelInfo) -> Result<Self> {
        let t = &exp.file.task;
        let org = m.organism.as_ref().map(|(_, f)| f);
        let mut provenance = Vec::new();
        let space_config = resolve_vocab(exp, org, &mut provenance)?;
        let space = space_config
            .build()
            .map_err(|e| exp.err("task", "vocab", e))?;
        if let Some(task) = t.kind.and_then(|k| k.text()) {
            return Self::resolve_text(exp, info, task, space, space_config, provenance);
        }
        let prompt = resolve_prompt(exp, org, &mut provenance);
        prompt
            .validate(&space)
            .map_err(|e| exp.err("task", "prompt", e))?;
        let period = resolve_period(exp, org, info, &mut provenance)?;
        let kind = exp.kind();
        let n_logical = t.n_logical.unwrap_or(kind.default_n_logical());
        let n_generated = KvEvalConfig::round_n_logical(period, n_logical);
        check_eval_set_size(exp, &space, &prompt, period, n_generated)?;
        let phases: Vec<u32> = t
            .phases
            .resolve(period.len(), "phases")
            .map_err(|e| exp.err("task", "phases", e))?
            .into_iter()
            .map(|p| p as u32)
            .collect();
        Ok(TaskSetup {
            space,
            space_config,
            prompt,
            period,
            protocol: t.protocol.unwrap_or_default(),
            n_logical,
            n_generated,
            seed: t.seed,
            phases,
            provenance,
            text: None,
        })
    }

    /// Resolve a passkey / needle `[task]`: the tokenizer of `vocab`, `[task.text]`
    /// over the defaults, `n_logical` rounded up to a multiple of P (the groups' mean
    /// value position matches exactly then); the config checked by generating one
    /// logical example.
    fn resolve_text(
        exp: &Experiment,
        info: &ModelInfo,
        task: TextTask,
        space: TokenSpace,
        space_config: TokenSpaceConfig,
        mut provenance: Vec<String>,
    ) -> Result<Self> {
        let t = &exp.file.task;
        let period = resolve_period(exp, None, info, &mut provenance)?;
        let n_logical = t.n_logical.unwrap_or(exp.kind().default_n_logical());
        let n_generated = n_logical.div_ceil(period.len()) * period.len();
        let mut cfg = TextNeedleConfig {
            task,
            period,
            n_logical: n_generated,
            seed: t.seed,
            ..TextNeedleConfig::default()
        };
        if let Some(x) = &t.text {
            cfg.length = x.length.unwrap_or(cfg.length);
            cfg.depth = x.depth.unwrap_or(cfg.depth);
            cfg.digits = x.digits.unwrap_or(cfg.digits);
            cfg.facts = x.facts.clone().unwrap_or(cfg.facts);
        }
        let probe = TextNeedleConfig {
            n_logical: 1,
            ..cfg.clone()
        };
        text_set(exp, &space, &probe)?;
        let phases = t
            .phases
            .resolve(period.len(), "phases")
            .map_err(|e| exp.err("task", "phases", e))?
            .into_iter()
            .map(|p| p as u32)
            .collect();
        Ok(TaskSetup {
            space,
            space_config,
            prompt: KvPromptConfig::default(),
            period,
            protocol: t.protocol.unwrap_or_default(),
            n_logical,
            n_generated,
            seed: t.seed,
            phases,
            provenance,
            text: Some(cfg),
        })
    }

    /// The passkey / needle set under `protocol` (`None` for key-value tasks).
    pub fn text_set(&self, exp: &Experiment, protocol: Protocol) -> Result<Option<TextNeedleSet>> {
        let Some(cfg) = &self.text else {
            return Ok(None);
        };
        let cfg = TextNeedleConfig {
            protocol,
            ..cfg.clone()
        };
        text_set(exp, &self.space, &cfg).map(Some)
    }

    /// The evaluation set under `protocol` (every phase, `n_generated` logical examples).
    pub fn eval_set(&self, protocol: Protocol) -> Result<KvEvalSet> {
        let cfg = KvEvalConfig {
            prompt: self.prompt.clone(),
            period: self.period,
            protocol,
            n_logical: self.n_generated,
            seed: self.seed,
        };
        generate_eval_set(&self.space, &cfg).context_with(|| "[task]")
    }
}

/// Generate a text set; errors name `[task] vocab` (no tokenizer) or the
/// `[task.text]` key (`[task] seed` / `n_logical` / `period` for theirs).
fn text_set(exp: &Experiment, space: &TokenSpace, cfg: &TextNeedleConfig) -> Result<TextNeedleSet> {
    let tok = space.tokenizer().ok_or_else(|| {
        exp.err(
            "task",
            "vocab",
            format!(
                "kind = \"{}\" needs a real tokenizer: vocab = {{ kind = \"hugging_face\", tokenizer = \"models:<model>.gguf\", pad = \"<pad>\" }}",
                cfg.task.name()
            ),
        )
    })?;
    let specials = TextTokens {
        pad: space.pad(),
        bos: space.bos(),
    };
    generate_text_needle_set(tok, specials, cfg).map_err(|e| text_error(exp, e))
}

/// A text task's error as a config error of the experiment: `[task] seed` /
/// `n_logical` / `period` for theirs, else the `[task.text]` key of its field.
pub(crate) fn text_error(exp: &Experiment, e: TaskError) -> crate::error::Error {
    match &e {
        TaskError::Config { field, .. }
            if ["n_logical", "period", "seed"].contains(&field.as_str()) =>
        {
            exp.err("task", field, &e)
        }
        TaskError::Config { field, .. } => {
            let key = field.split(['.', '[']).next().unwrap_or(field);
            exp.err("task.text", key, &e)
        }
        _ => exp.err("task", "text", &e),
    }
}

/// `[task] vocab`, else the organism's token space (noted in `provenance`); a model
/// that is not an organism needs one.
fn resolve_vocab(
    exp: &Experiment,
    org: Option<&OrganismFile>,
    provenance: &mut Vec<String>,
) -> Result<TokenSpaceConfig> {
    match (&exp.file.task.vocab, org) {
        (Some(v), _) => Ok(v.clone()),
        (None, Some(o)) => {
            provenance.push(format!("token space from organism `{}`", o.organism.name));
            Ok(o.task.vocab.clone())
        }
        (None, None) => Err(exp.err(
            "task",
            "vocab",
            "required for a model that is not an organism, e.g. vocab = { kind = \"hugging_face\", tokenizer = \"<model>/tokenizer.json\", pad = \"<pad>\" }",
        )),
    }
}

/// `[task] prompt`, else the organism's training prompt format (noted in
/// `provenance`), else the default format.
fn resolve_prompt(
    exp: &Experiment,
    org: Option<&OrganismFile>,
    provenance: &mut Vec<String>,
) -> KvPromptConfig {
    match (&exp.file.task.prompt, org) {
        (Some(p), _) => p.clone(),
        (None, Some(o)) => {
            provenance.push(format!(
                "prompt format from organism `{}` ([task.train.prompt])",
                o.organism.name
            ));
            o.task.train.prompt.clone()
        }
        (None, None) => KvPromptConfig::default(),
    }
}

/// `[task] period`, else the organism's training period, else the model's smallest
/// stride, else 8 (each default noted in `provenance`).
fn resolve_period(
    exp: &Experiment,
    org: Option<&OrganismFile>,
    info: &ModelInfo,
    provenance: &mut Vec<String>,
) -> Result<Period> {
    let period = match (exp.file.task.period, org) {
        (Some(p), _) => p,
        (None, Some(o)) => {
            provenance.push(format!(
                "period {} from organism `{}`",
                o.task.train.period, o.organism.name
            ));
            o.task.train.period.get()
        }
        (None, None) => match info.strides().first() {
            Some(&s) => {
                provenance.push(format!("period {s} = the model's smallest stride"));
                s as u32
            }
            None => {
                provenance.push("period 8 (the model does not compress)".into());
                8
            }
        },
    };
    Period::new(period).map_err(|e| exp.err("task", "period", e))
}

/// Refuse an evaluation set that cannot fit in memory before generating it: every
/// logical example is rendered once per phase (`n_generated x P` prompts of about
/// `unpadded + P` tokens, as token ids and their metadata).
fn check_eval_set_size(
    exp: &Experiment,
    space: &TokenSpace,
    prompt: &KvPromptConfig,
    period: Period,
    n_generated: usize,
) -> Result<()> {
    let p = period.len() as f64;
    let prompts = n_generated as f64 * p;
    let len = prompt.unpadded_len(space) as f64 + p;
    let bytes = prompts * (len * 16.0 + 256.0);
    crate::model::memory::check(
        &format!(
            "the evaluation set ({n_generated} logical examples x {} phases)",
            period.len()
        ),
        &format!(
            "[task] n_logical / period = {} (matched designs round n_logical up to a multiple of 2 P^2 = {}) in {}",
            period.len(),
            crate::tasks::matched_block_size(period),
            exp.path.display()
        ),
        bytes,
    )
}

/// Check the period against the model's compression strides: an error when it fixes
/// no stride's phase (unless `allow_period_mismatch`), else at most one warning.
fn check_period(
    exp: &Experiment,
    m: &ModelRef,
    info: &ModelInfo,
    p: usize,
) -> Result<Option<String>> {
    let strides = info.strides();
    if strides.is_empty() {
        return Ok(Some(format!(
            "{} has no compressed layers: its phase groups are a control (no phase is special)",
            m.name
        )));
    }
    let fixed: Vec<usize> = strides
        .iter()
        .copied()
        .filter(|s| p.is_multiple_of(*s))
        .collect();
    let loose: Vec<usize> = strides
        .iter()
        .copied()
        .filter(|s| !p.is_multiple_of(*s))
        .collect();
    if fixed.is_empty() && !exp.file.task.allow_period_mismatch {
        return Err(exp.err(
            "task",
            "period",
            format!(
                "P = {p} is not a multiple of any compression stride of {} (strides {strides:?}): \
                 a phase group would mix compression phases. Use a multiple of {} \
                 (or set allow_period_mismatch = true to run anyway)",
                m.name, strides[0]
            ),
        ));
    }
    Ok(if fixed.is_empty() {
        Some(format!(
            "P = {p} is not a multiple of any compression stride {strides:?}: phase groups mix compression phases (allow_period_mismatch = true)"
        ))
    } else if !loose.is_empty() {
        Some(format!(
            "P = {p} fixes the compression phase of layers with stride {fixed:?} but not of layers with stride {loose:?}"
        ))
    } else {
        None
    })
}

/// Check that the prompts fit the model: the token space in its vocabulary, the prompt
/// length in its positions, the largest forward in memory.
fn check_fits(
    exp: &Experiment,
    m: &ModelRef,
    info: &ModelInfo,
    task: &TaskSetup,
    size: ForwardSize,
) -> Result<()> {
    let ForwardSize { prompt_len, rows } = size;
    if task.space.vocab_size() > info.vocab_size {
        return Err(exp.err(
            "task",
            "vocab",
            format!(
                "the token space uses ids up to {} but {} has a vocabulary of {}",
                task.space.vocab_size(),
                m.name,
                info.vocab_size
            ),
        ));
    }
    if let Ok((_, _, json)) = crate::model::read_config_json(&m.dir)
        && let Some(max) = json.get("max_position_embeddings").and_then(|v| v.as_u64())
        && prompt_len as u64 > max
    {
        return Err(exp.err(
            "task",
            "prompt",
            format!(
                "prompts are {prompt_len} tokens but {} takes at most {max} (max_position_embeddings)",
                m.name
            ),
        ));
    }
    crate::model::memory::check_forward(
        info,
        rows,
        prompt_len,
        &format!(
            "[task] n_logical = {} / prompt length {prompt_len} / [experiment] max_rows (rows per forward) in {}",
            task.n_logical,
            exp.path.display()
        ),
    )
}

/// The largest forward a kind runs: prompts of `prompt_len` tokens, `rows` of them
/// in one forward (what the executor batches, not the whole group unless it runs the
/// group as one forward).
#[derive(Debug, Clone, Copy)]
pub struct ForwardSize {
    pub prompt_len: usize,
    pub rows: usize,
}

/// Check the experiment against the model before any compute. Returns warnings;
/// errors name the key to change.
pub fn check(
    exp: &Experiment,
    m: &ModelRef,
    info: &ModelInfo,
    task: &TaskSetup,
    size: ForwardSize,
) -> Result<Vec<String>> {
    let prompt_len = size.prompt_len;
    let mut warn = Vec::new();
    warn.extend(check_period(exp, m, info, task.period.len())?);
    if task.text.is_some() {
        if !task.n_logical.is_multiple_of(task.period.len()) {
            warn.push(format!(
                "n_logical = {}: the phase groups' mean value position is matched exactly only for multiples of P = {}",
                task.n_logical,
                task.period.len()
            ));
        }
    } else if exp.kind().matched_groups()
        && !task
            .n_logical
            .is_multiple_of(crate::tasks::matched_block_size(task.period))
    {
        warn.push(format!(
            "n_logical = {}: groups are matched exactly (mean and variance of the target position) only for multiples of 2P^2 = {}; using the first {} of {} generated logical examples",
            task.n_logical,
            crate::tasks::matched_block_size(task.period),
            task.n_logical,
            task.n_generated
        ));
    }
    check_fits(exp, m, info, task, size)?;
    for (l, spec) in info.layers.iter().enumerate() {
        if let LayerKind::Compressed { window, .. } = spec.kind
            && prompt_len < window
        {
            warn.push(format!(
                "prompts ({prompt_len} tokens) are shorter than layer {l}'s compression window ({window}): it has no entries"
            ));
            break;
        }
    }
    Ok(warn)
}

/// Resolve a layer selection; `compressed_only` restricts `"all"` to compressed layers
/// and rejects explicit uncompressed ones.
pub fn layers(
    exp: &Experiment,
    section: &str,
    sel: &Selection,
    info: &ModelInfo,
    compressed_only: bool,
) -> Result<Vec<usize>> {
    let n = info.n_layers();
    let all = sel
        .resolve(n, "layers")
        .map_err(|e| exp.err(section, "layers", e))?;
    if !compressed_only {
        return Ok(all);
    }
    let is_c = |l: usize| matches!(info.layers[l].kind, LayerKind::Compressed { .. });
    match sel {
        Selection::All => {
            let v: Vec<usize> = all.into_iter().filter(|&l| is_c(l)).collect();
            if v.is_empty() {
                return Err(exp.err(
                    section,
                    "layers",
                    "the model has no compressed layers (nothing has gates)",
                ));
            }
            Ok(v)
        }
        Selection::Only(_) => {
            if let Some(l) = all.iter().find(|&&l| !is_c(l)) {
                return Err(exp.err(
                    section,
                    "layers",
                    format!(
                        "layer {l} is not compressed ({}); it has no compressor gates",
                        info.layers[*l].kind
                    ),
                ));
            }
            Ok(all)
        }
    }
}

/// Resolve a head selection against the smallest head count of `layers`.
pub fn heads(
    exp: &Experiment,
    section: &str,
    key: &str,
    sel: &Selection,
    info: &ModelInfo,
    layers: &[usize],
    kv: bool,
) -> Result<Vec<usize>> {
    let n = layers
        .iter()
        .map(|&l| {
            if kv {
                info.layers[l].n_kv_heads
            } else {
                info.layers[l].n_heads
            }
        })
        .min()
        .unwrap_or(0);
    sel.resolve(n, if kv { "KV heads" } else { "heads" })
        .map_err(|e| exp.err(section, key, e))
}
