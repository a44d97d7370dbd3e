//! The exemplar table (`exemplars.arrow`, schema `exemplars/v1`, docs/tables.md): a few
//! prompts of an experiment, each rendered at every phase (the same logical example
//! shifted by +0..+P-1 pads), with what the viewer's prompt view and phase-shift slider
//! draw: tokens, the read position, the answer's probability, every layer's attention
//! row at the read position (`hook_pattern`), its compressed entries' token spans, the
//! compressor's key gates (`hook_key_gate`) and, on DeepSeek-V4 CSA layers and under
//! a `select` or `evict` overlay, the indexer's (the overlay's) scores and choice
//! (`hook_scores`, `hook_selected`: per block at the read position, or per chunk).
//!
//! Captured once, through the model's hook points, by `phaselens view` when the
//! experiment's tables exist and the exemplar table does not; written next to the tables.
//! The model is loaded as the experiment runs it (`[model] compression` included), and
//! the prompts are the experiment's: key-value prompts, or the passkey / needle text of
//! `[task] kind = "passkey" | "needle"` (tokens shown as the tokenizer spells them).

use std::path::{Path, PathBuf};

use crate::device::DeviceSpec;
use crate::error::{Error, Result, ResultExt};
use crate::hooks::{HookPoint, HookSpec, Site};
use crate::model::compression::Overlay;
use crate::model::{LanguageModel, LayerKind, ModelInfo, load_model_as, residency_summary};
use crate::output::{ColumnData, META_SCHEMA, Table};
use crate::runner::Experiment;
use crate::runner::kinds::KindConfig;
use crate::runner::kinds::retrieval_heads::layer_layout;
use crate::runner::setup::{TaskSetup, resolve_models};
use crate::tasks::prompts::clean_prompts;
use crate::tasks::{KvExample, Protocol, TextNeedleExample, TokenSpace};

mod overlay;

/// `phaselens.schema` of the exemplar table.
pub const EXEMPLAR_SCHEMA: &str = "exemplars/v1";
/// File name of the exemplar table in an experiment's data folder.
pub const EXEMPLAR_FILE: &str = "exemplars.arrow";
/// Table metadata: the smallest attention weight stored.
pub const META_MIN_WEIGHT: &str = "phaselens.exemplars.min_weight";
/// Table metadata: the period P (renderings per logical example).
pub const META_PERIOD: &str = "phaselens.exemplars.period";
/// Table metadata: the model the exemplars were captured on.
pub const META_MODEL: &str = "phaselens.exemplars.model";

/// How many exemplars, and how sparse the stored attention.
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// Logical examples (each rendered at every phase).
    pub logical: usize,
    /// Attention weights below this are not stored (the viewer draws them as 0).
    pub min_weight: f64,
    pub device: DeviceSpec,
    /// How a checkpoint's BF16 / FP8 / FP4 weights are held (`--weights`); `None`: the
    /// experiment's `[model] weights`, else stored.
    pub weights: Option<crate::model::stored::Residency>,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            logical: 2,
            min_weight: 0.002,
            device: DeviceSpec::Cpu,
            weights: None,
        }
    }
}

/// One value of the exemplar table.
#[derive(Debug, Clone, PartialEq)]
pub struct ExemplarRow {
    pub logical: i64,
    /// Pads added before the prompt relative to the first rendering (`KvExample::shift`).
    pub shift: i64,
    /// Phase of the target key in this rendering.
    pub phase: i64,
    /// What `value` is (docs/tables.md, `exemplars/v1`).
    pub record: String,
    pub layer: Option<i64>,
    pub head: Option<i64>,
    pub index: Option<i64>,
    pub offset: Option<i64>,
    pub value: f64,
    pub label: Option<String>,
}

/// The rendering a row belongs to, and a builder for its rows.
struct Rendering {
    logical: i64,
    shift: i64,
    phase: i64,
    rows: Vec<ExemplarRow>,
}

impl Rendering {
    fn push(&mut self, record: &str, at: [Option<i64>; 4], value: f64, label: Option<String>) {
        self.rows.push(ExemplarRow {
            logical: self.logical,
            shift: self.shift,
            phase: self.phase,
            record: record.to_string(),
            layer: at[0],
            head: at[1],
            index: at[2],
            offset: at[3],
            value,
            label,
        });
    }
}

fn at(layer: usize) -> [Option<i64>; 4] {
    [Some(layer as i64), None, None, None]
}

/// The loaded model and prompts of an experiment.
struct Setup {
    model: Box<dyn LanguageModel>,
    info: ModelInfo,
    task: TaskSetup,
    name: String,
    device: burn::tensor::Device,
    /// `[model] compression`: the overlay the model runs under.
    overlay: Option<Overlay>,
}

/// One rendering to capture: a key-value or a text prompt, as the experiment runs it.
struct Exemplar {
    logical: u64,
    shift: usize,
    phase: u32,
    /// The prompt, cut after its last read position (as the runner cuts it).
    tokens: Vec<u32>,
    /// The target key (key-value) or the needle sentence's first token (text).
    key_pos: usize,
    /// The value's first token.
    value_pos: usize,
    /// The token whose phase is the rendering's phase: the key (key-value), the value
    /// (text).
    phase_pos: usize,
    /// The read position (the first answer prediction) and the answer there.
    query_pos: usize,
    answer: u32,
}

impl Exemplar {
    /// A key-value example; `key_len` and `assign` atoms put its value after its key.
    fn of_kv(e: &KvExample, key_len: usize, assign: usize) -> Result<Self> {
        let (prompts, _) = clean_prompts(&[e], |_| 0);
        let b = &e.bindings[e.scored_query().binding];
        Ok(Exemplar {
            logical: e.logical_id,
            shift: e.shift,
            phase: e.phase.residue(),
            tokens: prompts.tokens,
            key_pos: e.target_key_pos,
            value_pos: b.key_pos + key_len + assign,
            phase_pos: e.target_key_pos,
            query_pos: first_target(e.logical_id, &e.target_positions)?,
            answer: first_answer(e.logical_id, &e.answers)?,
        })
    }

    /// A passkey / needle example, cut as phase-sweep cuts it.
    fn of_text(e: &TextNeedleExample) -> Result<Self> {
        let q = first_target(e.logical_id, &e.target_positions)?;
        let end = e.target_positions.last().map_or(q + 1, |p| p + 1);
        Ok(Exemplar {
            logical: e.logical_id,
            shift: e.shift,
            phase: e.phase.residue(),
            tokens: e.tokens[..end.min(e.tokens.len())].to_vec(),
            key_pos: e.needle_span.0,
            value_pos: e.value_span.0,
            phase_pos: e.value_span.0,
            query_pos: q,
            answer: first_answer(e.logical_id, &e.answers)?,
        })
    }
}

fn first_target(logical: u64, positions: &[usize]) -> Result<usize> {
    positions
        .first()
        .copied()
        .ok_or_else(|| Error::Input(format!("logical example {logical}: no answer position")))
}

fn first_answer(logical: u64, answers: &[u32]) -> Result<u32> {
    answers
        .first()
        .copied()
        .ok_or_else(|| Error::Input(format!("logical example {logical}: no answer token")))
}

fn setup(exp: &Experiment, opts: &CaptureOptions) -> Result<Setup> {
    let (models, _) = resolve_models(exp)?;
    let mref = models
        .first()
        .ok_or_else(|| Error::Other(format!("{}: no model", exp.path.display())))?;
    let device = opts.device.device()?;
    let residency = opts.weights.or(exp.file.model.weights).unwrap_or_default();
    let overlay = exp.file.model.compression.clone();
    let model = load_model_as(&mref.dir, &device, residency, overlay.as_ref())
        .context_with(|| format!("loading model {}", mref.dir.display()))?;
    if let Some(o) = &overlay {
        eprintln!("overlay: {o}");
    }
    eprintln!(
        "model {}: {}",
        mref.dir.display(),
        residency_summary(model.as_ref(), residency)
    );
    let info = model.info();
    let task = TaskSetup::resolve(exp, mref, &info)?;
    Ok(Setup {
        model,
        info,
        task,
        name: mref.name.clone(),
        device,
        overlay,
    })
}

/// Capture the exemplars of `exp` on its (first) model and write them to
/// `<data_dir>/exemplars.arrow`.
pub fn capture(exp: &Experiment, data_dir: &Path, opts: &CaptureOptions) -> Result<PathBuf> {
    let s = setup(exp, opts)?;
    let p = s.task.period.len();
    let mut rows = Vec::new();
    for e in exemplars_of(exp, &s, opts.logical.max(1))? {
        rows.extend(capture_one(&s, &e, opts.min_weight)?);
    }
    let path = data_dir.join(EXEMPLAR_FILE);
    exemplar_table(&rows)?
        .with_provenance(&exp.text)
        .with_metadata(META_SCHEMA, EXEMPLAR_SCHEMA)
        .with_metadata(META_MIN_WEIGHT, opts.min_weight.to_string())
        .with_metadata(META_PERIOD, p.to_string())
        .with_metadata(META_MODEL, s.name.clone())
        .write_arrow(&path)?;
    Ok(path)
}

/// The protocol the experiment evaluates: phase-sweep's first `[sweep] protocols`, else
/// `[task] protocol`.
fn protocol(exp: &Experiment, task: &TaskSetup) -> Protocol {
    match &exp.file.kind {
        KindConfig::PhaseSweep(c) => c.protocols.first().copied().unwrap_or(task.protocol),
        _ => task.protocol,
    }
}

/// The first `logical` logical examples of the experiment's evaluation set, each at
/// every phase it evaluates.
fn exemplars_of(exp: &Experiment, s: &Setup, logical: usize) -> Result<Vec<Exemplar>> {
    let proto = protocol(exp, &s.task);
    let p = s.task.period.len().max(1);
    let mut out = Vec::new();
    if let Some(set) = s.task.text_set(exp, proto)? {
        let n = (set.examples.len() / p).min(logical);
        for i in 0..n {
            for &r in &s.task.phases {
                out.push(Exemplar::of_text(set.example(i, r))?);
            }
        }
        return Ok(out);
    }
    let set = s.task.eval_set(proto)?;
    let assign = if s.task.prompt.assign {
        s.task.space.assign().len()
    } else {
        0
    };
    let n = (set.examples.len() / p).min(logical);
    for i in 0..n {
        for &r in &s.task.phases {
            let e = &set.examples[i * p + r as usize];
            out.push(Exemplar::of_kv(e, s.task.prompt.key_len, assign)?);
        }
    }
    Ok(out)
}

/// The hook points captured for every layer.
fn spec_for(info: &ModelInfo) -> HookSpec {
    let mut spec = HookSpec::new();
    for l in 0..info.n_layers() {
        for site in [
            Site::AttnPattern,
            Site::KeyGate,
            Site::IndexerScores,
            Site::IndexerSelected,
        ] {
            spec = spec.capture_point(HookPoint::block(l, site));
        }
    }
    spec
}

/// One forward of one rendering; its rows.
fn capture_one(s: &Setup, e: &Exemplar, min_weight: f64) -> Result<Vec<ExemplarRow>> {
    let t = e.tokens.len();
    let ids: Vec<i64> = e.tokens.iter().map(|&x| i64::from(x)).collect();
    let tokens = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(ids, [1, t]),
        &s.device,
    );
    let out = s.model.forward(tokens, &spec_for(&s.info))?;
    let q = e.query_pos;
    let mut r = Rendering {
        logical: e.logical as i64,
        shift: e.shift as i64,
        phase: i64::from(e.phase),
        rows: Vec::new(),
    };
    prompt_rows(s, e, &mut r);
    answer_rows(s, e, out.logits, q, &mut r)?;
    for l in 0..s.info.n_layers() {
        match &s.overlay {
            Some(o @ (Overlay::Select { .. } | Overlay::Evict { .. })) => {
                overlay::layer_rows(o, &out.cache, l, (t, q), min_weight, &mut r)?
            }
            _ => layer_rows(s, &out.cache, l, (t, q), min_weight, &mut r)?,
        }
    }
    Ok(r.rows)
}

/// Tokens (value = id, label = its text) and the positions the viewer marks.
fn prompt_rows(s: &Setup, e: &Exemplar, r: &mut Rendering) {
    for (pos, &id) in e.tokens.iter().enumerate() {
        r.push(
            "token",
            [None, None, Some(pos as i64), None],
            f64::from(id),
            Some(token_text(&s.task.space, id)),
        );
    }
    let none = [None; 4];
    r.push("key_pos", none, e.key_pos as f64, None);
    r.push("value_pos", none, e.value_pos as f64, None);
    r.push("phase_pos", none, e.phase_pos as f64, None);
    r.push("query_pos", none, e.query_pos as f64, None);
    r.push("period", none, s.task.period.len() as f64, None);
    if let Some(o) = &s.overlay {
        overlay::marks(o, e.tokens.len(), e.query_pos, r);
    }
}

/// A token as the tokenizer spells it, its word-start marker (`▁`, `Ġ`) as the space it
/// stands for (a decoded lone token loses it); the synthetic vocabulary's names.
fn token_text(space: &TokenSpace, id: u32) -> String {
    let text = space.render(&[id]);
    let Some(piece) = space.tokenizer().and_then(|t| t.id_to_token(id)) else {
        return text;
    };
    let spaced = piece.starts_with('\u{2581}') || piece.starts_with('\u{0120}');
    if spaced && !text.starts_with(' ') {
        format!(" {text}")
    } else {
        text
    }
}

/// The answer's probability at the read position, and the model's top token.
fn answer_rows(
    s: &Setup,
    e: &Exemplar,
    logits: burn::tensor::Tensor<3>,
    q: usize,
    r: &mut Rendering,
) -> Result<()> {
    let [_, t, v] = logits.dims();
    if q >= t {
        return Err(Error::Input(format!(
            "read position {q} is outside the {t} positions of the logits"
        )));
    }
    let row = logits
        .slice([0..1, q..q + 1, 0..v])
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| Error::Other(format!("reading the logits: {e:?}")))?;
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    let prob = |id: usize| f64::from((row[id] - max).exp()) / z;
    let answer = e.answer as usize;
    if answer >= v {
        return Err(Error::Input(format!(
            "answer token {answer} is outside the model's vocabulary 0..{v}"
        )));
    }
    let top = (0..v).fold(0, |b, i| if row[i] > row[b] { i } else { b });
    let none = [None; 4];
    let text = |id: usize| Some(s.task.space.render(&[id as u32]));
    r.push("answer_prob", none, prob(answer), text(answer));
    r.push("top_prob", none, prob(top), text(top));
    Ok(())
}

/// A captured activation's shape and values, if the model produced it.
fn captured(
    cache: &crate::hooks::ActivationCache,
    l: usize,
    site: Site,
) -> Option<(Vec<usize>, Vec<f32>)> {
    let a = cache.get(&HookPoint::block(l, site))?;
    Some((a.shape().to_vec(), a.to_vec()))
}

/// One layer: its kind, entry spans, attention row, gates and indexer choice at `q`.
fn layer_rows(
    s: &Setup,
    cache: &crate::hooks::ActivationCache,
    l: usize,
    (t, q): (usize, usize),
    min_weight: f64,
    r: &mut Rendering,
) -> Result<()> {
    let (label, stride) = match s.info.layers[l].kind {
        LayerKind::Full => ("full".to_string(), 0),
        LayerKind::Sliding { window } => (format!("sliding W={window}"), 0),
        LayerKind::Compressed { window, stride, .. } => {
            (format!("compressed W={window} S={stride}"), stride)
        }
        LayerKind::Selected { block, top_k, .. } => {
            (format!("selected block={block} top={top_k}"), block)
        }
    };
    r.push("layer_kind", at(l), stride as f64, Some(label));
    let point = HookPoint::block(l, Site::AttnPattern);
    let (shape, vals) = captured(cache, l, Site::AttnPattern)
        .ok_or_else(|| Error::hook(point.to_string(), "not produced by the model"))?;
    let [_, h, tq, k] = <[usize; 4]>::try_from(shape.clone())
        .map_err(|_| Error::hook(point.to_string(), format!("expected rank 4, got {shape:?}")))?;
    let layout = layer_layout(&s.info, l, t, k)?;
    r.push("raw_slots", at(l), layout.raw as f64, None);
    r.push("sink", at(l), f64::from(u8::from(layout.sink)), None);
    for w in 0..layout.entries {
        // The window's first token, unclipped (negative for a first window reaching
        // before the prompt): gate offset `o` pools token `first + o`.
        let (_, b) = layout.entry_span(w);
        let first = b as i64 + 1 - layout.window as i64;
        r.push(
            "entry_span",
            [Some(l as i64), None, Some(w as i64), Some(first)],
            b as f64,
            None,
        );
    }
    for head in 0..h {
        let row = &vals[(head * tq + q) * k..(head * tq + q + 1) * k];
        for (slot, &p) in row.iter().enumerate() {
            if f64::from(p) >= min_weight {
                let at = [Some(l as i64), Some(head as i64), Some(slot as i64), None];
                r.push("pattern", at, round(f64::from(p)), None);
            }
        }
    }
    gate_rows(cache, l, r);
    indexer_rows(cache, l, q, r);
    Ok(())
}

/// Four significant decimals: what the viewer shows, and a smaller table.
fn round(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// `hook_key_gate` `[1, entry, offset, kv_head (, d_head)]`: per entry, offset and KV
/// head (vector gates: the mean over channels).
fn gate_rows(cache: &crate::hooks::ActivationCache, l: usize, r: &mut Rendering) {
    let Some((shape, vals)) = captured(cache, l, Site::KeyGate) else {
        return;
    };
    if shape.len() < 4 {
        return;
    }
    let (e, o, g) = (shape[1], shape[2], shape[3]);
    let d: usize = shape[4..].iter().product();
    for w in 0..e {
        for off in 0..o {
            for kv in 0..g {
                let at = ((w * o + off) * g + kv) * d;
                let m = vals[at..at + d].iter().map(|&x| f64::from(x)).sum::<f64>() / d as f64;
                let pos = [
                    Some(l as i64),
                    Some(kv as i64),
                    Some(w as i64),
                    Some(off as i64),
                ];
                r.push("key_gate", pos, round(m), None);
            }
        }
    }
}

/// `hook_scores` / `hook_selected` `[1, query_pos, entry]` at the read position.
fn indexer_rows(cache: &crate::hooks::ActivationCache, l: usize, q: usize, r: &mut Rendering) {
    for (site, record) in [
        (Site::IndexerScores, "indexer_score"),
        (Site::IndexerSelected, "indexer_selected"),
    ] {
        let Some((shape, vals)) = captured(cache, l, site) else {
            continue;
        };
        if shape.len() != 3 || q >= shape[1] {
            continue;
        }
        let e = shape[2];
        for w in 0..e {
            let v = f64::from(vals[q * e + w]);
            let at = [Some(l as i64), None, Some(w as i64), None];
            r.push(
                record,
                at,
                if v.is_finite() { round(v) } else { -1e30 },
                None,
            );
        }
    }
}

/// The rows as an Arrow table (no metadata).
pub fn exemplar_table(rows: &[ExemplarRow]) -> Result<Table> {
    let i64s =
        |f: &dyn Fn(&ExemplarRow) -> Option<i64>| ColumnData::Int64(rows.iter().map(f).collect());
    Ok(Table::new("exemplars")
        .with_column("logical", i64s(&|r| Some(r.logical)))?
        .with_column("shift", i64s(&|r| Some(r.shift)))?
        .with_column("phase", i64s(&|r| Some(r.phase)))?
        .with_column(
            "record",
            ColumnData::Utf8(rows.iter().map(|r| Some(r.record.clone())).collect()),
        )?
        .with_column("layer", i64s(&|r| r.layer))?
        .with_column("head", i64s(&|r| r.head))?
        .with_column("index", i64s(&|r| r.index))?
        .with_column("offset", i64s(&|r| r.offset))?
        .with_column(
            "value",
            ColumnData::Float64(rows.iter().map(|r| Some(r.value)).collect()),
        )?
        .with_column(
            "label",
            ColumnData::Utf8(rows.iter().map(|r| r.label.clone()).collect()),
        )?)
}

/// Read an exemplar table; an error names the file and what is wrong with it.
pub fn read_exemplars(path: &Path) -> Result<Vec<ExemplarRow>> {
    let t = Table::read_arrow(path)?;
    let schema = t.metadata().get(META_SCHEMA).cloned().unwrap_or_default();
    if schema != EXEMPLAR_SCHEMA {
        return Err(Error::Input(format!(
            "{}: schema `{schema}`, this phaselens reads `{EXEMPLAR_SCHEMA}` (delete the file and run `phaselens view` again to recapture)",
            path.display()
        )));
    }
    let ints = |c: &str| t.int64(c).map(<[Option<i64>]>::to_vec);
    let (logical, shift, phase) = (ints("logical")?, ints("shift")?, ints("phase")?);
    let (layer, head, index, offset) = (
        ints("layer")?,
        ints("head")?,
        ints("index")?,
        ints("offset")?,
    );
    let record = t.utf8("record")?;
    let value = t.float64("value")?;
    let label = t.utf8("label")?;
    let missing =
        |c: &str, i: usize| Error::Input(format!("{}: row {i}: `{c}` is null", path.display()));
    (0..t.num_rows())
        .map(|i| {
            Ok(ExemplarRow {
                logical: logical[i].ok_or_else(|| missing("logical", i))?,
                shift: shift[i].ok_or_else(|| missing("shift", i))?,
                phase: phase[i].ok_or_else(|| missing("phase", i))?,
                record: record[i].clone().ok_or_else(|| missing("record", i))?,
                layer: layer[i],
                head: head[i],
                index: index[i],
                offset: offset[i],
                value: value[i].ok_or_else(|| missing("value", i))?,
                label: label[i].clone(),
            })
        })
        .collect()
}
