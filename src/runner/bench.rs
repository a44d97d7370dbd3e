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

use super::experiment::Experiment;
use super::kinds::KindConfig;
use super::kinds::patch_heads::PatchHeads;
use super::patching::{
    Cell, ChunkPath, Edit, Fill, Outcome, Positions, Prompts, base_run, captures_for, plan_chunks,
    plan_suffix, run_cell_naive, run_chunk_with,
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
        let mut out = vec![Vec::new(); cells.len()];
        for ch in &chunks {
            for (&c, o) in ch
                .iter()
                .zip(run_chunk_with(model, prompts, &base, cells, ch, path)?)
            {
                out[c] = o;
            }
        }
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
    let mut suffix_chunks = 0;
    let mut suffix_len = 0usize;
    if has_state {
        for ch in &chunks {
            if let Some(s) = plan_suffix(prompts, cells, ch) {
                suffix_chunks += 1;
                suffix_len += s.len;
            }
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
    let positions = match cells.first().map(|c| &c.edit) {
        Some(Edit::Replace { positions, .. }) => match positions {
            Positions::All => "all".to_string(),
            Positions::Answer => "answer".to_string(),
            Positions::Final(k) => format!("final {k}"),
        },
        _ => "-".to_string(),
    };
    Ok(BenchResult {
        model: name.to_string(),
        cells: cells.len(),
        prompts_per_cell: cells.first().map_or(0, |c| c.prompts.len()),
        prompt_len: prompts.len,
        positions,
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
        work_ratio: naive_work / batched_work,
    })
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
    let (models, _) = setup::resolve_models(&exp)?;
    let mref = &models[0];
    let max_rows = exp.max_rows(device);
    let device = device.device()?;
    let model = load_model(&mref.dir, &device)?;
    let info = model.info();
    let mut task = TaskSetup::resolve(&exp, mref, &info)?;
    if let Some(n) = n_logical {
        if n == 0 || n > super::experiment::MAX_N_LOGICAL {
            return Err(Error::Input(format!(
                "--n-logical {n}: must be in 1..={}",
                super::experiment::MAX_N_LOGICAL
            )));
        }
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
    bench_cells(&mref.name, model.as_ref(), &prompts, &cells, max_rows)
}
