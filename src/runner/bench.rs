//! `phaselens bench patching`: cells per second of the batched routine against a
//! one-forward-per-cell loop (TransformerLens style: a full forward per cell with the
//! hooks' own patch action) on the same model, prompts and cells, plus the largest
//! difference between their logit differences.

use std::path::Path;
use std::time::Instant;

use crate::device::DeviceSpec;
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, Site};
use crate::model::{LanguageModel, load_model};

use super::config::{Experiment, PatchConfig};
use super::patching::{
    Cell, Edit, Fill, Prompts, base_run, captures_for, plan_chunks, run_cell_naive, run_chunk,
};
use super::prompts::{group_examples, paired_prompts};
use super::setup::{self, TaskSetup};

/// Result of one benchmark.
#[derive(Debug, Clone)]
pub struct BenchResult {
    pub model: String,
    pub cells: usize,
    pub prompts_per_cell: usize,
    pub prompt_len: usize,
    pub batched_seconds: f64,
    pub naive_seconds: f64,
    pub batched_cells_per_s: f64,
    pub naive_cells_per_s: f64,
    /// batched / naive cells per second.
    pub ratio: f64,
    /// Largest |LD_batched - LD_naive| over all cells and prompts.
    pub max_abs_ld_diff: f64,
    pub forwards_batched: usize,
    /// Row-layers computed by the loop / by the batched path (base runs included): the
    /// speed-up that skipping the layers before the patched one allows when a batch row
    /// costs the same whatever the batch size (the CPU backend).
    pub work_ratio: f64,
}

impl std::fmt::Display for BenchResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {}: {} cells x {} prompts of {} tokens (hook_z patching, denoise + noise, query + KV heads)",
            self.model, self.cells, self.prompts_per_cell, self.prompt_len
        )?;
        writeln!(
            f,
            "batched (base run + {} forward_from calls): {:.2} s, {:.1} cells/s",
            self.forwards_batched, self.batched_seconds, self.batched_cells_per_s
        )?;
        writeln!(
            f,
            "one forward per cell:                    {:.2} s, {:.1} cells/s",
            self.naive_seconds, self.naive_cells_per_s
        )?;
        writeln!(f, "speed-up: {:.2}x", self.ratio)?;
        writeln!(
            f,
            "row-layers computed, loop / batched: {:.2}x (the bound of layer skipping at equal cost per row)",
            self.work_ratio
        )?;
        write!(
            f,
            "max |LD difference| batched vs loop: {:.2e}",
            self.max_abs_ld_diff
        )
    }
}

/// Time both paths on `cells` over `prompts`.
pub fn bench_cells(
    name: &str,
    model: &dyn LanguageModel,
    prompts: &Prompts,
    cells: &[Cell],
    max_rows: usize,
) -> Result<BenchResult> {
    let captures = captures_for(cells)?;
    // Warm-up (allocator, thread pool) so neither path pays first-call costs.
    let _ = base_run(model, prompts, &captures)?;

    let t = Instant::now();
    let base = base_run(model, prompts, &captures)?;
    let chunks = plan_chunks(cells, max_rows)?;
    let mut batched = vec![Vec::new(); cells.len()];
    for ch in &chunks {
        for (&c, out) in ch.iter().zip(run_chunk(model, prompts, &base, cells, ch)?) {
            batched[c] = out;
        }
    }
    let batched_seconds = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let base2 = base_run(model, prompts, &captures)?;
    let naive: Vec<_> = cells
        .iter()
        .map(|c| run_cell_naive(model, prompts, &base2, c))
        .collect::<Result<_>>()?;
    let naive_seconds = t.elapsed().as_secs_f64();

    let mut max_diff = 0.0f64;
    for (a, b) in batched.iter().zip(&naive) {
        for (x, y) in a.iter().zip(b) {
            max_diff = max_diff.max((x.ld as f64 - y.ld as f64).abs());
        }
    }
    let n = cells.len() as f64;
    let layers = model.info().n_layers() as f64;
    let base_work = prompts.n() as f64 * layers;
    let mut naive_work = base_work;
    let mut batched_work = base_work;
    for c in cells {
        let rows = c.prompts.len() as f64;
        naive_work += rows * layers;
        batched_work += rows * (layers - c.edit.start_layer()? as f64);
    }
    Ok(BenchResult {
        model: name.to_string(),
        cells: cells.len(),
        prompts_per_cell: cells.first().map_or(0, |c| c.prompts.len()),
        prompt_len: prompts.len,
        batched_seconds,
        naive_seconds,
        batched_cells_per_s: n / batched_seconds,
        naive_cells_per_s: n / naive_seconds,
        ratio: naive_seconds / batched_seconds,
        max_abs_ld_diff: max_diff,
        forwards_batched: chunks.len(),
        work_ratio: naive_work / batched_work,
    })
}

/// Benchmark hook_z patching of every query and KV head of every layer (both
/// directions) on phase group `phase` of the experiment's model and prompts.
pub fn bench_experiment(
    path: &Path,
    phase: u32,
    n_logical: Option<usize>,
    device: &DeviceSpec,
) -> Result<BenchResult> {
    let exp = Experiment::load(path)?;
    let (models, _) = setup::resolve_models(&exp)?;
    let mref = &models[0];
    let max_rows = exp.max_rows(device);
    let device = device.device()?;
    let model = load_model(&mref.dir, &device)?;
    let info = model.info();
    let mut task = TaskSetup::resolve(&exp, mref, &info)?;
    if let Some(n) = n_logical {
        task.n_logical = n;
        task.n_generated = crate::tasks::KvEvalConfig::round_n_logical(task.period, n);
    }
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
    let cfg = PatchConfig::default();
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
                        positions: cfg.positions.clone(),
                        fill: Fill::Source,
                    },
                    prompts: receivers.clone(),
                });
            }
        }
    }
    bench_cells(&mref.name, model.as_ref(), &prompts, &cells, max_rows)
}
