//! Runs batches of cells through the routine with resume and progress: the glue every
//! kind shares; [`PromptShards`] for kinds that run their own forwards.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::model::LanguageModel;

use super::concurrent;
use super::patching::{
    self, Base, Cell, Outcome, Prompts, base_run_for, budget, plan_chunks, run_chunk,
};
use super::progress::{Progress, ProgressMode};
use super::store::Store;

/// One prompt batch and the cells to evaluate on it.
#[derive(Debug, Clone)]
pub struct Group {
    /// Unique, stable key (shard file names): e.g. `p3` for phase group 3.
    pub key: String,
    pub prompts: Prompts,
    pub cells: Vec<Cell>,
}

impl Group {
    /// Progress units of the group: its cells, or 1 for a base-only group.
    pub fn units(&self) -> u64 {
        self.cells.len().max(1) as u64
    }
}

/// Outcomes of a group: the base run's, and per cell one per prompt of the cell.
#[derive(Debug, Clone)]
pub struct GroupResult {
    pub base: Vec<Outcome>,
    pub cells: Vec<Vec<Outcome>>,
}

/// Counters for the summary line and the benchmark.
#[derive(Debug, Clone, Default)]
pub struct ExecStats {
    pub cells_computed: u64,
    pub cells_resumed: u64,
    pub forwards: u64,
    pub seconds: f64,
    /// Seconds of the groups' base runs (the plain forwards the cells start from).
    pub base_seconds: f64,
    /// Seconds of the cells' chunks, from the first one started to the last one saved.
    pub cell_seconds: f64,
    /// The largest memory estimate the patching budget checked before a group's base
    /// run (bytes beyond the weights; [`budget::GroupEstimate::peak`]), 0 when none.
    pub memory_estimate_bytes: f64,
}

impl ExecStats {
    /// Add `other`'s counters to these.
    pub fn add(&mut self, other: &ExecStats) {
        self.cells_computed += other.cells_computed;
        self.cells_resumed += other.cells_resumed;
        self.forwards += other.forwards;
        self.seconds += other.seconds;
        self.base_seconds += other.base_seconds;
        self.cell_seconds += other.cell_seconds;
        self.memory_estimate_bytes = self.memory_estimate_bytes.max(other.memory_estimate_bytes);
    }
}

/// Evaluates groups, loading finished chunks from the store.
pub struct Executor<'a> {
    pub model: &'a dyn LanguageModel,
    pub store: &'a Store,
    pub max_rows: usize,
    /// The settings that size a group's base run and its chunks, named in a memory
    /// error (e.g. "[task] n_logical in exp/x.toml", "[experiment] max_rows in ...").
    pub memory_keys: (String, String),
    pub progress: &'a mut Progress,
    pub stats: ExecStats,
}

impl<'a> Executor<'a> {
    /// Evaluate one group (resuming what the store already holds). Non-finite logits
    /// are an error naming the group and the first layer / hook point that went
    /// non-finite in a plain forward of its prompts.
    pub fn run(&mut self, g: &Group) -> Result<GroupResult> {
        match self.run_inner(g) {
            // Base runs name the layer themselves; a chunk's forward (with its
            // interventions) is diagnosed here against plain forwards of the group.
            Err(Error::NonFinite(what)) if !what.contains(crate::model::diagnose::LOCATED) => {
                Err(self.name_non_finite(g, &what))
            }
            r => r,
        }
    }

    /// The diagnostic of a non-finite group: plain forwards of its prompts, `max_rows`
    /// at a time, until one names where the values broke.
    fn name_non_finite(&self, g: &Group, what: &str) -> Error {
        let device = self.model.device();
        let all: Vec<usize> = (0..g.prompts.n()).collect();
        let what = format!("group `{}`: {what}", g.key);
        for rows in all.chunks(self.max_rows.max(1)) {
            let tokens = g.prompts.tokens_of(rows, &device);
            if let Ok(Some(at)) = crate::model::diagnose::first_non_finite(self.model, tokens) {
                return Error::NonFinite(format!(
                    "{what}; prompts {}..={}: {at}",
                    rows[0],
                    rows[rows.len() - 1]
                ));
            }
        }
        Error::NonFinite(format!(
            "{what}; a plain forward of every prompt of the group is finite at every layer, so a cell's intervention made the values non-finite"
        ))
    }

    /// The chunks of `g` the store already holds (`None` for the others).
    fn load_chunks(
        &mut self,
        g: &Group,
        chunks: &[Vec<usize>],
    ) -> Result<Vec<Option<Vec<Vec<Outcome>>>>> {
        let mut results = Vec::with_capacity(chunks.len());
        for (i, chunk) in chunks.iter().enumerate() {
            let expected: Vec<usize> = chunk.iter().map(|&c| g.cells[c].prompts.len()).collect();
            let got = self.store.load(&chunk_key(&g.key, i), &expected)?;
            if got.is_some() {
                self.progress.skip(chunk.len() as u64);
                self.stats.cells_resumed += chunk.len() as u64;
            }
            results.push(got);
        }
        Ok(results)
    }

    /// Compute the chunks `missing` of `g` over its base run `b`, as many at once as the
    /// threads and the memory allow (`chunk_bytes`: the largest chunk's estimate), each
    /// saved as it finishes.
    fn run_chunks(
        &mut self,
        g: &Group,
        b: &Base,
        chunks: &[Vec<usize>],
        missing: &[usize],
        chunk_bytes: Option<f64>,
        results: &mut [Option<Vec<Vec<Outcome>>>],
    ) -> Result<()> {
        let width = concurrent::width(missing.len(), chunk_bytes);
        let (model, store) = (self.model, self.store);
        let t_cells = Instant::now();
        concurrent::run(
            missing,
            width,
            |i| run_chunk(model, &g.prompts, b, &g.cells, &chunks[i]),
            |i, out| {
                self.stats.forwards += 1;
                store.save(&chunk_key(&g.key, i), &out)?;
                self.progress.inc(chunks[i].len() as u64);
                self.stats.cells_computed += chunks[i].len() as u64;
                results[i] = Some(out);
                Ok(())
            },
        )?;
        self.stats.cell_seconds += t_cells.elapsed().as_secs_f64();
        Ok(())
    }

    fn run_inner(&mut self, g: &Group) -> Result<GroupResult> {
        let t0 = Instant::now();
        let n = g.prompts.n();
        let chunks = plan_chunks(&g.cells, self.max_rows)?;
        let base_key = format!("{}-base", g.key);
        let mut base: Option<Vec<Outcome>> =
            self.store.load(&base_key, &[n])?.map(|mut v| v.remove(0));
        let mut results = self.load_chunks(g, &chunks)?;
        // `--shard i/N`: chunks of other parts stay missing (placeholders below).
        let missing: Vec<usize> = (0..chunks.len())
            .filter(|&i| results[i].is_none() && self.store.owns(&chunk_key(&g.key, i)))
            .collect();
        if (base.is_none() && self.store.owns(&base_key)) || !missing.is_empty() {
            let (cells_needed, chunks_needed) = needed_cells(&g.cells, &chunks, &missing);
            let sizes = budget::Sizes::of(self.model);
            let check = |base: Option<&Base>| {
                budget::check_group(
                    &sizes,
                    &g.prompts,
                    &cells_needed,
                    &chunks_needed,
                    base,
                    (&self.memory_keys.0, &self.memory_keys.1),
                )
            };
            if !cells_needed.is_empty() {
                let est = check(None)?.peak();
                self.stats.memory_estimate_bytes = self.stats.memory_estimate_bytes.max(est);
            }
            let t_base = Instant::now();
            let b: Base = if cells_needed.is_empty() {
                Base {
                    cache: Default::default(),
                    outcomes: patching::evaluate(self.model, &g.prompts, self.max_rows)?,
                    state: None,
                    stages: Default::default(),
                    window: None,
                }
            } else {
                base_run_for(self.model, &g.prompts, &cells_needed, self.max_rows)?
            };
            self.stats.base_seconds += t_base.elapsed().as_secs_f64();
            self.stats.forwards += 1 + b.stages.forwards;
            if base.is_none() {
                self.store
                    .save(&base_key, std::slice::from_ref(&b.outcomes))?;
                if g.cells.is_empty() {
                    self.progress.inc(1);
                }
            }
            base = Some(b.outcomes.clone());
            let chunk_bytes = if cells_needed.is_empty() {
                None
            } else {
                check(Some(&b))?.chunk.map(|c| c.bytes)
            };
            self.run_chunks(g, &b, &chunks, &missing, chunk_bytes, &mut results)?;
        } else if g.cells.is_empty() {
            self.progress.skip(1);
        }
        // Another part's chunks and base: placeholders, never saved (a shard run writes
        // no tables; the merge run loads every part's shards).
        for (i, r) in results.iter_mut().enumerate() {
            if r.is_none() {
                self.progress.skip(chunks[i].len() as u64);
                *r = Some(
                    chunks[i]
                        .iter()
                        .map(|&c| vec![NOT_HERE; g.cells[c].prompts.len()])
                        .collect(),
                );
            }
        }
        let cells = cells_in_order(g.cells.len(), &chunks, results);
        self.stats.seconds += t0.elapsed().as_secs_f64();
        Ok(GroupResult {
            base: base.unwrap_or_else(|| vec![NOT_HERE; n]),
            cells,
        })
    }
}

/// The cells of the `missing` chunks (in chunk order) and those chunks as indices into
/// that list.
fn needed_cells(
    cells: &[Cell],
    chunks: &[Vec<usize>],
    missing: &[usize],
) -> (Vec<Cell>, Vec<Vec<usize>>) {
    let needed: Vec<Cell> = missing
        .iter()
        .flat_map(|&i| chunks[i].iter().map(|&c| cells[c].clone()))
        .collect();
    let mut next = 0;
    let as_indices = missing
        .iter()
        .map(|&i| {
            let c: Vec<usize> = (next..next + chunks[i].len()).collect();
            next += chunks[i].len();
            c
        })
        .collect();
    (needed, as_indices)
}

/// Each of `count` cells' outcomes, from the results of the chunks that hold them.
fn cells_in_order(
    count: usize,
    chunks: &[Vec<usize>],
    results: Vec<Option<Vec<Vec<Outcome>>>>,
) -> Vec<Vec<Outcome>> {
    let mut cells: Vec<Vec<Outcome>> = vec![Vec::new(); count];
    for (chunk, res) in chunks.iter().zip(results) {
        for (&c, out) in chunk
            .iter()
            .zip(res.expect("every chunk computed or loaded"))
        {
            cells[c] = out;
        }
    }
    cells
}

/// Every cell of `cells` on `prompts` without a store (no resume): the base run (with
/// the cells' stages) and one forward per chunk of at most `max_rows` rows, as the
/// executor runs them. Returns the base outcomes and, per cell, one per prompt.
pub fn run_cells(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    cells: &[Cell],
    max_rows: usize,
    progress: &mut Progress,
) -> Result<GroupResult> {
    let chunks = plan_chunks(cells, max_rows)?;
    let sizes = budget::Sizes::of(model);
    let base_keys = format!("the prompts ({} x {} tokens)", prompts.n(), prompts.len);
    let chunk_keys = format!("max_rows ({max_rows})");
    let keys = (base_keys.as_str(), chunk_keys.as_str());
    budget::check_group(&sizes, prompts, cells, &chunks, None, keys)?;
    let base = base_run_for(model, prompts, cells, max_rows)?;
    let est = budget::check_group(&sizes, prompts, cells, &chunks, Some(&base), keys)?;
    let mut out: Vec<Vec<Outcome>> = vec![Vec::new(); cells.len()];
    let all: Vec<usize> = (0..chunks.len()).collect();
    let width = concurrent::width(chunks.len(), est.chunk.map(|c| c.bytes));
    concurrent::run(
        &all,
        width,
        |i| run_chunk(model, prompts, &base, cells, &chunks[i]),
        |i, res| {
            for (&c, o) in chunks[i].iter().zip(res) {
                out[c] = o;
            }
            progress.inc(chunks[i].len() as u64);
            Ok(())
        },
    )?;
    Ok(GroupResult {
        base: base.outcomes.clone(),
        cells: out,
    })
}

/// The shard key of chunk `i` of group `group`.
fn chunk_key(group: &str, i: usize) -> String {
    format!("{group}-c{i:04}")
}

/// The outcome standing for one computed by another part of a `--shard i/N` run.
const NOT_HERE: Outcome = Outcome {
    correct: false,
    ld: f32::NAN,
};

/// Per-prompt quantities of a kind that runs its own forwards, persisted chunk by chunk
/// as shards of the run's store (resume), with a progress bar and the run's counters.
pub struct PromptShards<'s> {
    store: &'s Store,
    stats: ExecStats,
    progress: Progress,
}

impl<'s> PromptShards<'s> {
    /// Shards of `store`; progress over `total` prompts labelled `label`.
    pub fn new(store: &'s Store, mode: ProgressMode, label: &str, total: u64) -> Self {
        PromptShards {
            store,
            stats: ExecStats::default(),
            progress: Progress::new(mode, label, "prompts", total),
        }
    }

    /// Per prompt of `n`, `quantities` values, computed by `compute(rows)` (one `Vec`
    /// per quantity, one outcome per row) over chunks of `chunk` prompts, each chunk
    /// persisted as shard `{key}-c{i}` and loaded instead of recomputed on resume.
    pub fn run(
        &mut self,
        key: &str,
        n: usize,
        quantities: usize,
        chunk: usize,
        mut compute: impl FnMut(&[usize]) -> Result<Vec<Vec<Outcome>>>,
    ) -> Result<Vec<Vec<Outcome>>> {
        let mut out: Vec<Vec<Outcome>> = (0..quantities).map(|_| Vec::with_capacity(n)).collect();
        let idx: Vec<usize> = (0..n).collect();
        for (i, rows) in idx.chunks(chunk.max(1)).enumerate() {
            let shard = format!("{key}-c{i:04}");
            let got = match self.store.load(&shard, &vec![rows.len(); quantities])? {
                Some(v) => {
                    self.progress.skip(rows.len() as u64);
                    self.stats.cells_resumed += rows.len() as u64;
                    v
                }
                // `--shard i/N`: another part computes it.
                None if !self.store.owns(&shard) => {
                    self.progress.skip(rows.len() as u64);
                    vec![vec![NOT_HERE; rows.len()]; quantities]
                }
                None => {
                    let t0 = std::time::Instant::now();
                    let v = compute(rows)?;
                    if v.len() != quantities || v.iter().any(|q| q.len() != rows.len()) {
                        return Err(Error::Other(format!(
                            "{shard}: computed {} quantities for {} rows, expected {quantities} x {}",
                            v.len(),
                            v.first().map_or(0, Vec::len),
                            rows.len()
                        )));
                    }
                    self.store.save(&shard, &v)?;
                    self.progress.inc(rows.len() as u64);
                    self.stats.cells_computed += rows.len() as u64;
                    self.stats.forwards += 1;
                    self.stats.seconds += t0.elapsed().as_secs_f64();
                    v
                }
            };
            for (o, g) in out.iter_mut().zip(got) {
                o.extend(g);
            }
        }
        Ok(out)
    }

    /// Finish the progress bar; the counters of what ran.
    pub fn finish(mut self) -> ExecStats {
        self.progress.finish();
        self.stats
    }
}
