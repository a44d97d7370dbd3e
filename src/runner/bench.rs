//! `phaselens bench patching`: cells per second of the batched routine against a
//! one-forward-per-cell loop (TransformerLens style: a full forward per cell with the
//! hooks' own patch action) on the same model, prompts and cells, plus the largest
//! difference between their logit differences.

use std::path::Path;
use std::time::Instant;

use crate::device::DeviceSpec;
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, Site};
use crate::model::{LanguageModel, ModelInfo, load_model};

use super::experiment::Experiment;
use super::kinds::KindConfig;
use super::kinds::attribution_patching::AtpTerms;
use super::kinds::patch_heads::PatchHeads;
use super::patching::{
    Base, Cell, ChunkPath, Edit, Fill, Outcome, Positions, Prompts, base_run, captures_for,
    plan_chunks, plan_suffix, run_cell_naive, run_chunk_with,
};
use super::setup::{self, TaskSetup};
use crate::tasks::prompts::{group_examples, paired_prompts};

/// Result of one benchmark.
#[derive(Debug, Clone)]
pub struct BenchResult {
    pub model: String,
    pub cells: usize,
    pub prompts_per_cell: usize,
    pub prompt_len: usize,
    /// The patched positions (`all`, `answer`, `final = k`).
    pub positions: String,
    /// The runner's path: batched, recomputing only the edited and read positions
    /// when the model and the edits allow it (see `run_chunk`).
    pub batched_seconds: f64,
    /// Batched, every position recomputed (`forward_from`).
    pub full_seconds: f64,
    pub naive_seconds: f64,
    pub batched_cells_per_s: f64,
    pub full_cells_per_s: f64,
    pub naive_cells_per_s: f64,
    /// batched / naive cells per second (the headline).
    pub ratio: f64,
    /// batched-over-every-position / naive cells per second.
    pub full_ratio: f64,
    /// Chunks that ran as suffix forwards, and their mean suffix length.
    pub suffix_chunks: usize,
    pub mean_suffix_len: f64,
    /// Largest |LD_batched - LD_naive| (and |LD_full - LD_naive|) over all cells and prompts.
    pub max_abs_ld_diff: f64,
    pub forwards_batched: usize,
    /// Row-layers computed by the loop / by the every-position batched path (base runs
    /// included): the speed-up that skipping the layers before the patched one allows
    /// when a batch row costs the same whatever the batch size (the CPU backend).
    pub work_ratio: f64,
}

impl std::fmt::Display for BenchResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {}: {} cells x {} prompts of {} tokens (hook_z patching at positions = {}, denoise + noise, query + KV heads)",
            self.model, self.cells, self.prompts_per_cell, self.prompt_len, self.positions
        )?;
        writeln!(
            f,
            "runner (batched; {} of {} chunks as suffix forwards, mean suffix {:.1} positions): {:.2} s, {:.1} cells/s",
            self.suffix_chunks,
            self.forwards_batched,
            self.mean_suffix_len,
            self.batched_seconds,
            self.batched_cells_per_s
        )?;
        writeln!(
            f,
            "batched, every position recomputed:        {:.2} s, {:.1} cells/s",
            self.full_seconds, self.full_cells_per_s
        )?;
        writeln!(
            f,
            "one forward per cell:                      {:.2} s, {:.1} cells/s",
            self.naive_seconds, self.naive_cells_per_s
        )?;
        writeln!(
            f,
            "speed-up over one forward per cell: runner {:.2}x, every-position batched {:.2}x",
            self.ratio, self.full_ratio
        )?;
        writeln!(
            f,
            "row-layers computed, loop / every-position batched: {:.2}x (the bound of layer skipping at equal cost per row)",
            self.work_ratio
        )?;
        write!(
            f,
            "max |LD difference| against the loop: {:.2e}",
            self.max_abs_ld_diff
        )
    }
}

/// Time the three paths on `cells` over `prompts` (runner, every-position batched, loop).
pub fn bench_cells(
    name: &str,
    model: &dyn LanguageModel,
    prompts: &Prompts,
    cells: &[Cell],
    max_rows: usize,
) -> Result<BenchResult> {
    let captures = captures_for(cells)?;
    // Warm-up (allocator, thread pool) so no path pays first-call costs.
    let has_state = base_run(model, prompts, &captures)?.state.is_some();
    let chunks = plan_chunks(cells, max_rows)?;

    let batched_path = |path: ChunkPath| -> Result<(f64, Vec<Vec<Outcome>>)> {
        let t = Instant::now();
        let base = base_run(model, prompts, &captures)?;
        let out = run_chunks(model, prompts, &base, cells, &chunks, path)?;
        Ok((t.elapsed().as_secs_f64(), out))
    };
    let (batched_seconds, batched) = batched_path(ChunkPath::Auto)?;
    let (full_seconds, full) = batched_path(ChunkPath::Full)?;

    let t = Instant::now();
    let base2 = base_run(model, prompts, &captures)?;
    let naive: Vec<_> = cells
        .iter()
        .map(|c| run_cell_naive(model, prompts, &base2, c))
        .collect::<Result<_>>()?;
    let naive_seconds = t.elapsed().as_secs_f64();

    let mut max_diff = 0.0f64;
    for other in [&batched, &full] {
        for (a, b) in other.iter().zip(&naive) {
            for (x, y) in a.iter().zip(b) {
                max_diff = max_diff.max((x.ld as f64 - y.ld as f64).abs());
            }
        }
    }
    let (suffix_chunks, suffix_len) = if has_state {
        suffix_plan(prompts, cells, &chunks)
    } else {
        (0, 0)
    };
    let n = cells.len() as f64;
    Ok(BenchResult {
        model: name.to_string(),
        cells: cells.len(),
        prompts_per_cell: cells.first().map_or(0, |c| c.prompts.len()),
        prompt_len: prompts.len,
        positions: positions_label(cells),
        batched_seconds,
        full_seconds,
        naive_seconds,
        batched_cells_per_s: n / batched_seconds,
        full_cells_per_s: n / full_seconds,
        naive_cells_per_s: n / naive_seconds,
        ratio: naive_seconds / batched_seconds,
        full_ratio: naive_seconds / full_seconds,
        suffix_chunks,
        mean_suffix_len: if suffix_chunks > 0 {
            suffix_len as f64 / suffix_chunks as f64
        } else {
            0.0
        },
        max_abs_ld_diff: max_diff,
        forwards_batched: chunks.len(),
        work_ratio: work_ratio(model, prompts, cells)?,
    })
}

/// Every cell's outcomes through the runner's batched chunks on `path`.
fn run_chunks(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    base: &Base,
    cells: &[Cell],
    chunks: &[Vec<usize>],
    path: ChunkPath,
) -> Result<Vec<Vec<Outcome>>> {
    let mut out = vec![Vec::new(); cells.len()];
    for ch in chunks {
        for (&c, o) in ch
            .iter()
            .zip(run_chunk_with(model, prompts, base, cells, ch, path)?)
        {
            out[c] = o;
        }
    }
    Ok(out)
}

/// Chunks that run as suffix forwards, and the sum of their suffix lengths.
fn suffix_plan(prompts: &Prompts, cells: &[Cell], chunks: &[Vec<usize>]) -> (usize, usize) {
    let mut suffix_chunks = 0;
    let mut suffix_len = 0usize;
    for ch in chunks {
        if let Some(s) = plan_suffix(prompts, cells, ch) {
            suffix_chunks += 1;
            suffix_len += s.len;
        }
    }
    (suffix_chunks, suffix_len)
}

/// Row-layers computed by the loop over those of the every-position batched path (base
/// runs included).
fn work_ratio(model: &dyn LanguageModel, prompts: &Prompts, cells: &[Cell]) -> Result<f64> {
    let layers = model.info().n_layers() as f64;
    let base_work = prompts.n() as f64 * layers;
    let mut naive_work = base_work;
    let mut batched_work = base_work;
    for c in cells {
        let rows = c.prompts.len() as f64;
        naive_work += rows * layers;
        batched_work += rows * (layers - c.edit.start_layer()? as f64);
    }
    Ok(naive_work / batched_work)
}

/// The patched positions of the first cell (`all`, `answer`, `final k`, `offset k`; `-`
/// when it is not a replacement).
fn positions_label(cells: &[Cell]) -> String {
    match cells.first().map(|c| &c.edit) {
        Some(Edit::Replace { positions, .. }) => match positions {
            Positions::All => "all".to_string(),
            Positions::Answer => "answer".to_string(),
            Positions::Final(k) => format!("final {k}"),
            Positions::Offset(k) => format!("offset {k}"),
        },
        _ => "-".to_string(),
    }
}

/// The experiment's first model and its task, loaded for a benchmark.
pub(crate) struct BenchModel {
    pub(crate) name: String,
    pub(crate) model: Box<dyn LanguageModel>,
    pub(crate) info: ModelInfo,
    pub(crate) task: TaskSetup,
    pub(crate) max_rows: usize,
}

/// Load the first model of `exp` on `device` and resolve its task.
pub(crate) fn load_bench_model(exp: &Experiment, device: &DeviceSpec) -> Result<BenchModel> {
    let (models, _) = setup::resolve_models(exp)?;
    let mref = &models[0];
    let max_rows = exp.max_rows(device);
    let device = device.device()?;
    let model = load_model(&mref.dir, &device)?;
    let info = model.info();
    let task = TaskSetup::resolve(exp, mref, &info)?;
    Ok(BenchModel {
        name: mref.name.clone(),
        model,
        info,
        task,
        max_rows,
    })
}

/// `bench edges --layers / --heads`: a randomly initialised model of the experiment's
/// architecture and config, resized, in place of its trained weights (for graphs larger
/// than the organisms'; the prompts stay the experiment's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomModel {
    /// Layers (the config's per-layer type lists cycled to this length); `None`: as is.
    pub layers: Option<usize>,
    /// Query heads per layer, each of the config's head size; `None`: as is.
    pub heads: Option<usize>,
    /// Seed of the random weights.
    pub seed: u64,
}

/// The config.json of the model in `dir` resized as `r` asks: kvc `n_layers`,
/// `n_heads` (`d_head` fixed at its value, so that the heads keep their size);
/// DeepSeek-V4 `num_hidden_layers`, `num_attention_heads` (`head_dim` is explicit),
/// `layer_types` / `mlp_layer_types` cycled to the new depth.
pub fn scaled_config(dir: &Path, r: &RandomModel) -> Result<serde_json::Value> {
    use serde_json::Value;
    let (path, _, mut json) = crate::model::read_config_json(dir)?;
    let bad = |m: String| Error::Config {
        path: path.clone(),
        message: m,
    };
    let kind = json["model_type"].as_str().unwrap_or_default().to_string();
    let (layers_key, heads_key, lists): (&str, &str, &[&str]) = match kind.as_str() {
        crate::model::kvc::MODEL_TYPE => ("n_layers", "n_heads", &[]),
        crate::model::deepseek_v4::MODEL_TYPE => (
            "num_hidden_layers",
            "num_attention_heads",
            &["layer_types", "mlp_layer_types"],
        ),
        other => {
            return Err(bad(format!(
                "--layers / --heads: no random resizing of model_type \"{other}\""
            )));
        }
    };
    let obj = json
        .as_object_mut()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    if let Some(h) = r.heads {
        if kind == crate::model::kvc::MODEL_TYPE && obj.get("d_head").is_none_or(Value::is_null) {
            let (d, n) = (
                obj.get("d_model").and_then(Value::as_u64),
                obj.get("n_heads").and_then(Value::as_u64),
            );
            let (Some(d), Some(n)) = (d, n) else {
                return Err(bad(
                    "--heads: no d_model / n_heads to keep the head size".into()
                ));
            };
            obj.insert("d_head".into(), Value::from(d / n.max(1)));
        }
        obj.insert(heads_key.into(), Value::from(h));
    }
    if let Some(l) = r.layers {
        obj.insert(layers_key.into(), Value::from(l));
        for key in lists {
            if let Some(Value::Array(v)) = obj.get(*key)
                && !v.is_empty()
            {
                let cycled: Vec<Value> = v.iter().cycle().take(l).cloned().collect();
                obj.insert((*key).into(), Value::Array(cycled));
            }
        }
    }
    Ok(json)
}

/// A randomly initialised model of [`scaled_config`]`(dir, r)` on `device`.
pub fn random_model(
    dir: &Path,
    r: &RandomModel,
    device: &burn::tensor::Device,
) -> Result<Box<dyn LanguageModel>> {
    use crate::model::weights::{RandomInit, Vb};
    let json = scaled_config(dir, r)?;
    let path = dir.join("config.json");
    let text = json.to_string();
    let at = |m: String| Error::Config {
        path: path.clone(),
        message: format!("resized by --layers / --heads: {m}"),
    };
    let init = RandomInit { seed: r.seed };
    let vb = Vb::new(&init, device);
    if json["model_type"].as_str() == Some(crate::model::kvc::MODEL_TYPE) {
        let c = crate::model::KvcConfig::from_json(&text).map_err(at)?;
        c.check_memory().map_err(|e| at(e.to_string()))?;
        Ok(Box::new(crate::model::KvcModel::new(&c, &vb)?))
    } else {
        use crate::model::deepseek_v4::{DeepseekV4Config, DeepseekV4Model};
        let c = DeepseekV4Config::from_json(&text).map_err(|e| at(e.to_string()))?;
        c.check_memory().map_err(|e| at(e.to_string()))?;
        Ok(Box::new(DeepseekV4Model::new(&c, &vb)?))
    }
}

/// [`load_bench_model`] with the weights replaced as `random` asks (`None`: the
/// experiment's model as trained); the name says which.
pub(crate) fn load_bench_model_with(
    exp: &Experiment,
    device: &DeviceSpec,
    random: Option<&RandomModel>,
) -> Result<BenchModel> {
    let Some(r) = random else {
        return load_bench_model(exp, device);
    };
    let (models, _) = setup::resolve_models(exp)?;
    let mref = &models[0];
    let max_rows = exp.max_rows(device);
    let device = device.device()?;
    let model = random_model(&mref.dir, r, &device)?;
    let info = model.info();
    let task = TaskSetup::resolve(exp, mref, &info)?;
    Ok(BenchModel {
        name: format!(
            "{} resized to {} layers x {} heads, random weights (seed {})",
            mref.name,
            info.n_layers(),
            info.n_heads,
            r.seed
        ),
        model,
        info,
        task,
        max_rows,
    })
}

/// The clean/corrupted prompts of phase group `phase`, and the number of pairs.
pub(crate) fn phase_prompts(task: &TaskSetup, phase: u32) -> Result<(Prompts, usize)> {
    if phase as usize >= task.period.len() {
        return Err(Error::Input(format!(
            "phase {phase} is out of range 0..{}",
            task.period.len()
        )));
    }
    let set = task.eval_set(task.protocol)?;
    let ex = group_examples(&set, phase, task.n_logical);
    let n = ex.len();
    let assign = if task.prompt.assign {
        task.space.assign().len()
    } else {
        0
    };
    let (prompts, _) = paired_prompts(&ex, &task.space, assign, task.prompt.key_len, task.seed)?;
    Ok((prompts, n))
}

/// `--n-logical N` in place of the experiment's, within the runner's bounds (it sizes
/// the prompts generated before anything runs).
pub(crate) fn override_n_logical(task: &mut TaskSetup, n: usize) -> Result<()> {
    use super::experiment::MAX_N_LOGICAL;
    if n == 0 || n > MAX_N_LOGICAL {
        return Err(Error::Input(format!(
            "--n-logical {n}: give 1 to {MAX_N_LOGICAL} logical examples per phase group"
        )));
    }
    task.n_logical = n;
    task.n_generated = crate::tasks::KvEvalConfig::round_n_logical(task.period, n);
    Ok(())
}

/// Benchmark hook_z patching of every query and KV head of every layer (both
/// directions) on phase group `phase` of the experiment's model and prompts, at
/// `positions` (default: the experiment's `[patch] positions`).
pub fn bench_experiment(
    path: &Path,
    phase: u32,
    n_logical: Option<usize>,
    positions: Option<Positions>,
    device: &DeviceSpec,
) -> Result<BenchResult> {
    let exp = Experiment::load(path)?;
    let BenchModel {
        name,
        model,
        info,
        mut task,
        max_rows,
    } = load_bench_model(&exp, device)?;
    if let Some(n) = n_logical {
        override_n_logical(&mut task, n)?;
    }
    let (prompts, n) = phase_prompts(&task, phase)?;
    // The experiment's `[patch] positions` when it is a patch-heads file.
    let own = match &exp.file.kind {
        KindConfig::PatchHeads(p) => p.positions.clone(),
        _ => PatchHeads::default().positions,
    };
    let positions = positions.unwrap_or(own);
    let mut cells = Vec::new();
    for receivers in [(n..2 * n).collect::<Vec<_>>(), (0..n).collect()] {
        for l in 0..info.n_layers() {
            let spec = &info.layers[l];
            let group = spec.n_heads / spec.n_kv_heads.max(1);
            let mut sets: Vec<Vec<usize>> = (0..spec.n_heads).map(|h| vec![h]).collect();
            sets.extend((0..spec.n_kv_heads).map(|g| (g * group..(g + 1) * group).collect()));
            for heads in sets {
                cells.push(Cell {
                    edit: Edit::Replace {
                        point: HookPoint::block(l, Site::AttnZ),
                        heads: Some(heads),
                        positions: positions.clone(),
                        fill: Fill::Source,
                    },
                    prompts: receivers.clone(),
                });
            }
        }
    }
    bench_cells(&name, model.as_ref(), &prompts, &cells, max_rows)
}

/// Result of `phaselens bench atp`.
#[derive(Debug, Clone)]
pub struct AtpBenchResult {
    pub model: String,
    /// Head cells (query + KV) x directions.
    pub head_cells: usize,
    pub prompts_per_cell: usize,
    pub prompt_len: usize,
    /// Offsets of the exact head x position cells (0..band).
    pub band: usize,
    /// One AtP forward + backward: every head x every position, both directions.
    pub atp_seconds: f64,
    pub atp_cells: usize,
    /// The runner's exact batched patching of every head x offset cell.
    pub exact_seconds: f64,
    pub exact_cells: usize,
    /// AtP cells/s over exact cells/s (the headline).
    pub ratio: f64,
    /// Spearman correlation of the AtP and exact effects (the LD change summed over the
    /// prompts of a cell) over the denoising head x offset cells.
    pub spearman_positions: f64,
    /// AtP + AtP* of the query and key nodes (`qk_fix`): every query head x position and
    /// every KV head (all key slots), both directions.
    pub star_seconds: f64,
    pub star_cells: usize,
}

impl std::fmt::Display for AtpBenchResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {}: {} head cells (query + KV heads x denoise + noise) x {} prompts of {} tokens",
            self.model, self.head_cells, self.prompts_per_cell, self.prompt_len
        )?;
        writeln!(
            f,
            "AtP (one forward + one backward, every head x position): {:.2} s, {} cells, {:.1} cells/s",
            self.atp_seconds,
            self.atp_cells,
            self.atp_cells as f64 / self.atp_seconds
        )?;
        writeln!(
            f,
            "exact batched patching, every head x offset 0..{}:       {:.2} s, {} cells, {:.1} cells/s",
            self.band,
            self.exact_seconds,
            self.exact_cells,
            self.exact_cells as f64 / self.exact_seconds
        )?;
        writeln!(f, "AtP speed-up in cells/s: {:.1}x", self.ratio)?;
        writeln!(
            f,
            "AtP* of q / k (query head x position + KV head cells):     {:.2} s, {} cells, {:.1} cells/s",
            self.star_seconds,
            self.star_cells,
            self.star_cells as f64 / self.star_seconds
        )?;
        write!(
            f,
            "Spearman(AtP, exact) over head x offset cells (denoising LD change): {:.3}",
            self.spearman_positions
        )
    }
}

/// The exact head x offset cells of `bench atp`: every head set at every offset of the
/// band, both directions.
struct OffsetCells {
    /// (layer, query heads): every query head and every KV head (its query heads).
    head_sets: Vec<(usize, Vec<usize>)>,
    band: usize,
    /// Clean/corrupted pairs.
    n: usize,
}

impl OffsetCells {
    /// Head cells of every query head and every KV head of every layer.
    fn new(info: &ModelInfo, band: usize, n: usize) -> Self {
        let mut head_sets: Vec<(usize, Vec<usize>)> = Vec::new();
        for (l, spec) in info.layers.iter().enumerate() {
            let group = spec.n_heads / spec.n_kv_heads.max(1);
            head_sets.extend((0..spec.n_heads).map(|h| (l, vec![h])));
            head_sets
                .extend((0..spec.n_kv_heads).map(|g| (l, (g * group..(g + 1) * group).collect())));
        }
        OffsetCells { head_sets, band, n }
    }

    /// Per offset and direction (denoise, noise), one hook_z cell per head set.
    fn cells(&self) -> Vec<Cell> {
        let n = self.n;
        let mut cells = Vec::new();
        for o in 0..self.band {
            for receivers in [(n..2 * n).collect::<Vec<_>>(), (0..n).collect()] {
                for (l, heads) in &self.head_sets {
                    cells.push(Cell {
                        edit: Edit::Replace {
                            point: HookPoint::block(*l, Site::AttnZ),
                            heads: Some(heads.clone()),
                            positions: Positions::Offset(o),
                            fill: Fill::Source,
                        },
                        prompts: receivers.clone(),
                    });
                }
            }
        }
        cells
    }

    /// Spearman correlation of the AtP and exact effects (the clean-orientation LD
    /// change summed over the prompts of a cell) over the denoising cells.
    fn agreement(
        &self,
        terms: &AtpTerms,
        prompts: &Prompts,
        base: &[Outcome],
        out: &[Vec<Outcome>],
    ) -> f64 {
        let n = self.n;
        let mut est = Vec::new();
        let mut exact = Vec::new();
        let per_offset = 2 * self.head_sets.len();
        for o in 0..self.band {
            for (hi, (l, heads)) in self.head_sets.iter().enumerate() {
                let ci = o * per_offset + hi;
                let mut e = 0.0;
                let mut x = 0.0;
                for (i, o_i) in out[ci].iter().enumerate().take(n) {
                    let tg = &prompts.targets[n + i].positions;
                    let pos = Positions::Offset(o).resolve(tg).unwrap_or_default();
                    e += terms.sum(0, *l, i, heads, &pos);
                    // Clean-orientation LD change of the corrupted prompt.
                    x += -(o_i.ld as f64) + base[n + i].ld as f64;
                }
                est.push(e);
                exact.push(x);
            }
        }
        crate::analysis::spearman(&est, &exact)
            .ok()
            .flatten()
            .unwrap_or(f64::NAN)
    }
}

/// Time AtP against the runner's exact patching over every head x position cell on
/// phase group `phase` of the experiment's model and prompts (`band` offsets before
/// and at the read position for the exact cells).
pub fn bench_atp(
    path: &Path,
    phase: u32,
    n_logical: Option<usize>,
    band: usize,
    device: &DeviceSpec,
) -> Result<AtpBenchResult> {
    use super::heads::Direction;
    use super::kinds::attribution_patching::atp_terms;
    if band == 0 {
        return Err(Error::Input("--band must be at least 1".into()));
    }
    let exp = Experiment::load(path)?;
    let mut b = load_bench_model(&exp, device)?;
    if let Some(n) = n_logical {
        override_n_logical(&mut b.task, n)?;
    }
    let (prompts, n) = phase_prompts(&b.task, phase)?;
    if band > prompts.len {
        return Err(Error::Input(format!(
            "--band {band}: the prompts hold {} tokens (offsets past the first token patch nothing)",
            prompts.len
        )));
    }
    let (model, info) = (b.model.as_ref(), &b.info);
    let layers: Vec<usize> = (0..info.n_layers()).collect();
    let dirs = [Direction::Denoise, Direction::Noise];
    let offsets = OffsetCells::new(info, band, n);
    // Warm-up, then AtP.
    atp_terms(model, &prompts, &layers, &dirs)?;
    let t = Instant::now();
    let terms = atp_terms(model, &prompts, &layers, &dirs)?;
    let atp_seconds = t.elapsed().as_secs_f64();
    let atp_cells = offsets.head_sets.len() * dirs.len() * prompts.len;
    let t = Instant::now();
    super::kinds::attribution_patching::atp_star::qk_terms(model, &prompts, &layers, &dirs)?;
    let star_seconds = t.elapsed().as_secs_f64();
    let star_cells: usize = info
        .layers
        .iter()
        .map(|s| (s.n_heads * prompts.len + s.n_kv_heads) * dirs.len())
        .sum();

    let cells = offsets.cells();
    let captures = captures_for(&cells)?;
    let chunks = plan_chunks(&cells, b.max_rows)?;
    let t = Instant::now();
    let base = base_run(model, &prompts, &captures)?;
    let out = run_chunks(model, &prompts, &base, &cells, &chunks, ChunkPath::Auto)?;
    let exact_seconds = t.elapsed().as_secs_f64();

    // Agreement over the denoising head x offset cells: summed LD change.
    let spearman_positions = offsets.agreement(&terms, &prompts, &base.outcomes, &out);
    let exact_cells = cells.len();
    Ok(AtpBenchResult {
        model: b.name.clone(),
        head_cells: offsets.head_sets.len() * dirs.len(),
        prompts_per_cell: n,
        prompt_len: prompts.len,
        band,
        atp_seconds,
        atp_cells,
        exact_seconds,
        exact_cells,
        ratio: (atp_cells as f64 / atp_seconds) / (exact_cells as f64 / exact_seconds),
        spearman_positions,
        star_seconds,
        star_cells,
    })
}
