//! Memory of a group's forwards, checked before each is computed: the base run (its
//! forward, the captures the cells read, the prefix state) and each chunk (a suffix
//! forward of a few positions over the base run's state, or a full `forward_from`).
//!
//! A chunk that runs as a suffix forward costs its rows times the suffix length, not
//! the prompt length, plus one layer's per-token state merged over every position
//! (`TokenFlow::full`: the state's rows and the chunk's, one layer at a time). Before
//! the base run that state is estimated from the model's keys and values; after it, the
//! recorded state's own size is used.

use crate::error::Result;
use crate::hooks::{HookPoint, Site};
use crate::model::memory::Widths;
use crate::model::{LanguageModel, ModelInfo, PrefixState, memory};

use super::suffix::plan_suffix;
use super::{Base, Cell, Prompts, captures_for};

/// A model's sizes for the estimates: its widths and what its forward holds per token
/// ([`LanguageModel::memory_widths`]).
#[derive(Debug, Clone)]
pub struct Sizes {
    pub info: ModelInfo,
    pub widths: Widths,
}

impl Sizes {
    /// The sizes of `model`.
    pub fn of(model: &dyn LanguageModel) -> Self {
        Sizes {
            info: model.info(),
            widths: model.memory_widths(),
        }
    }

    /// Bytes of a forward over `rows x len` tokens (every position's logits).
    pub fn forward_bytes(&self, rows: usize, len: usize) -> f64 {
        memory::forward_bytes_with(&self.info, &self.widths, rows, len, len)
    }

    /// Bytes of a forward over `rows x len` tokens whose LM head runs at `logit_len`
    /// positions per row ([`crate::model::LanguageModel::forward_rows`]).
    pub fn forward_bytes_logits(&self, rows: usize, len: usize, logit_len: usize) -> f64 {
        memory::forward_bytes_with(&self.info, &self.widths, rows, len, logit_len)
    }
}

/// Tokens per block of rows of a base run: a base run over many prompts runs as
/// blocks of `BASE_BLOCK_TOKENS / len` rows (at least 1), several at once
/// ([`crate::runner::concurrent`]). The split depends on the prompts' number and length
/// alone, never on the threads or the memory, so the base run's values do not either
/// (a row's logits depend at float level on the rows that share its forward).
pub const BASE_BLOCK_TOKENS: usize = 4096;

/// The blocks of rows of a base run over `n` prompts of `len` tokens.
pub fn base_blocks(n: usize, len: usize) -> Vec<std::ops::Range<usize>> {
    let per = (BASE_BLOCK_TOKENS / len.max(1)).max(1);
    (0..n).step_by(per).map(|a| a..(a + per).min(n)).collect()
}

/// Positions per prompt the base run's LM head reads (its targets').
fn read_positions(prompts: &Prompts) -> usize {
    prompts
        .targets
        .iter()
        .map(|t| t.positions.len())
        .max()
        .unwrap_or(0)
}

/// Bytes of one base-run forward over `rows` of `prompts` (the LM head at the
/// targets' positions only).
pub fn base_block_bytes(sizes: &Sizes, prompts: &Prompts, rows: usize) -> f64 {
    sizes.forward_bytes_logits(rows, prompts.len, read_positions(prompts))
}

/// How many of a base run's `blocks` ([`base_blocks`]) run at once (see
/// [`crate::runner::concurrent::width`]).
pub fn base_width(sizes: &Sizes, prompts: &Prompts, blocks: &[std::ops::Range<usize>]) -> usize {
    let rows = blocks.first().map_or(0, |b| b.len());
    crate::runner::concurrent::width(blocks.len(), Some(base_block_bytes(sizes, prompts, rows)))
}

/// Values per token of a capture of `point` (f32), from the model's widths. Sites
/// that are not per-token vectors (attention scores and patterns: one row of at most
/// `len` keys per head) are bounded by their largest shape.
pub fn capture_width(info: &ModelInfo, point: &HookPoint, len: usize) -> f64 {
    let (d, h, kv, dh) = (
        info.d_model as f64,
        info.n_heads as f64,
        info.n_kv_heads as f64,
        info.d_head as f64,
    );
    let streams = info.streams.max(1) as f64;
    match point.site {
        Site::ResidPre | Site::ResidMid | Site::ResidPost => streams * d,
        Site::AttnQ | Site::AttnZ => h * dh,
        Site::AttnK | Site::AttnV => kv * dh,
        Site::AttnResult => h * d,
        Site::AttnScores | Site::AttnPattern => h * (len as f64 + 1.0),
        _ => d,
    }
}

/// Bytes of the captures `points` over `rows x len` tokens.
pub fn captures_bytes(info: &ModelInfo, points: &[HookPoint], rows: usize, len: usize) -> f64 {
    let tokens = rows as f64 * len as f64;
    points
        .iter()
        .map(|p| 4.0 * tokens * capture_width(info, p, len))
        .sum()
}

/// Bytes of a base run's captures `points` over `rows x len` tokens when its per-token
/// captures keep `window` positions only ([`super::capture_window`]; `None`: all).
pub fn base_captures_bytes(
    info: &ModelInfo,
    points: &[HookPoint],
    rows: usize,
    len: usize,
    window: Option<usize>,
) -> f64 {
    points
        .iter()
        .map(|p| {
            let kept = match window {
                Some(w) if p.site.info().per_token => w,
                _ => len,
            };
            4.0 * rows as f64 * kept as f64 * capture_width(info, p, len)
        })
        .sum()
}

/// Per-token bytes of the largest layer of a recorded state.
fn layer_state_per_token(state: &PrefixState) -> f64 {
    let tokens = (state.rows() * state.len()).max(1) as f64;
    state.max_layer_bytes() / tokens
}

/// What a chunk costs and why: bytes, rows, and the positions each row computes.
#[derive(Debug, Clone, Copy)]
pub struct ChunkSize {
    pub bytes: f64,
    pub rows: usize,
    /// Positions each row computes (the suffix length, or the prompt length).
    pub positions: usize,
    pub suffix: bool,
}

/// The size of chunk `chunk` of `cells` (indices) on `prompts`: a suffix forward when
/// the base run kept a state (`state`: the recorded one, or `Some(None)` before the base
/// run when it will keep one) and the chunk's edits allow it.
pub fn chunk_size(
    sizes: &Sizes,
    prompts: &Prompts,
    cells: &[Cell],
    chunk: &[usize],
    state: Option<Option<&PrefixState>>,
) -> ChunkSize {
    let rows: usize = chunk.iter().map(|&c| cells[c].prompts.len()).sum();
    let suffix = state.and_then(|s| plan_suffix(prompts, cells, chunk).map(|sfx| (s, sfx)));
    let (positions, merged) = match &suffix {
        Some((s, sfx)) => {
            let per_token = s.map_or(4.0 * sizes.widths.state_max(), layer_state_per_token);
            let state_rows = s.map_or(prompts.n(), PrefixState::rows);
            let merged = per_token * ((state_rows + rows) * prompts.len) as f64;
            (sfx.len, merged)
        }
        None => (prompts.len, 0.0),
    };
    // The replaced points' fill tensors, over the chunk's rows and computed positions.
    let fills: f64 = chunk
        .iter()
        .filter_map(|&c| match &cells[c].edit {
            super::Edit::Replace { point, .. } | super::Edit::FromStage { point, .. } => {
                Some(*point)
            }
            _ => None,
        })
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|p| captures_bytes(&sizes.info, &[p], rows, positions))
        .sum();
    ChunkSize {
        bytes: sizes.forward_bytes(rows, positions) + merged + fills,
        rows,
        positions,
        suffix: suffix.is_some(),
    }
}

/// The largest chunk of `chunks` (by bytes).
pub fn largest_chunk(
    sizes: &Sizes,
    prompts: &Prompts,
    cells: &[Cell],
    chunks: &[Vec<usize>],
    state: Option<Option<&PrefixState>>,
) -> Option<ChunkSize> {
    chunks
        .iter()
        .map(|c| chunk_size(sizes, prompts, cells, c, state))
        .max_by(|a, b| a.bytes.total_cmp(&b.bytes))
}

/// What a group's forwards are estimated to hold at their largest (bytes, beyond the
/// weights and the process): the base run (its forward next to the captures the cells
/// read), and the largest chunk next to what the base run leaves alive (its captures and
/// prefix state, counted only before the base run: after it they are allocated already).
#[derive(Debug, Clone, Copy)]
pub struct GroupEstimate {
    /// The base run's forward and captures (0 after the base run).
    pub base: f64,
    /// The base run's captures and prefix state, alive next to every chunk (0 after it).
    pub held: f64,
    /// The largest chunk, if any.
    pub chunk: Option<ChunkSize>,
}

impl GroupEstimate {
    /// The group's estimated peak: the larger of the base run and the largest chunk
    /// next to what the base run left alive.
    pub fn peak(&self) -> f64 {
        self.base
            .max(self.held + self.chunk.map_or(0.0, |c| c.bytes))
    }
}

/// The estimate [`check_group`] compares with the machine (`base`: `None` before the
/// base run, the recorded one after it).
pub fn estimate_group(
    sizes: &Sizes,
    prompts: &Prompts,
    cells: &[Cell],
    chunks: &[Vec<usize>],
    base: Option<&Base>,
) -> Result<GroupEstimate> {
    let keeps_state = super::suffix::keeps_state(cells);
    let state = match base {
        None => keeps_state.then_some(None),
        Some(b) => b.state.as_deref().map(Some),
    };
    let (n, len) = (prompts.n(), prompts.len);
    let (base_bytes, held) = if base.is_none() {
        // The per-token captures keep only the suffixes' positions when every cell
        // runs as one (a model without a suffix forward reruns the base run whole,
        // which this does not count: every model here has one).
        let window = super::capture_window(prompts, cells).map(|w| w.len());
        let captures = base_captures_bytes(&sizes.info, &captures_for(cells)?, n, len, window);
        // The forward counts every layer's state (kept to the end when recorded).
        let state = if keeps_state {
            4.0 * sizes.widths.state_total() * (n * len) as f64
        } else {
            0.0
        };
        // The base run's LM head runs at the targets' positions alone, in blocks of
        // rows, `width` at once (base_run_windowed); the finished blocks' captures and
        // state are held until they are stacked, one point or layer at a time.
        let blocks = base_blocks(n, len);
        let held = captures + state;
        let base = if blocks.len() == 1 {
            base_block_bytes(sizes, prompts, n) + captures
        } else {
            let one = base_block_bytes(sizes, prompts, blocks[0].len());
            let width = base_width(sizes, prompts, &blocks) as f64;
            let widest = (4.0 * sizes.widths.state_max() * (n * len) as f64).max(captures);
            (width * one + held).max(held + widest)
        };
        (base, held)
    } else {
        (0.0, 0.0)
    };
    Ok(GroupEstimate {
        base: base_bytes,
        held,
        chunk: largest_chunk(sizes, prompts, cells, chunks, state),
    })
}

/// Refuse a group whose base run, or whose largest chunk next to the base run's
/// captures and state, cannot fit (before the base run: `base = None`, the state
/// estimated; after it: the base run's own captures and state, already allocated, so
/// only the chunk is compared with what is left). `keys` names what to lower: the
/// base run's size (`keys.0`: the prompts) and the chunks' (`keys.1`: rows per forward).
/// Returns the estimate it checked.
pub fn check_group(
    sizes: &Sizes,
    prompts: &Prompts,
    cells: &[Cell],
    chunks: &[Vec<usize>],
    base: Option<&Base>,
    keys: (&str, &str),
) -> Result<GroupEstimate> {
    let est = estimate_group(sizes, prompts, cells, chunks, base)?;
    let (n, len) = (prompts.n(), prompts.len);
    if base.is_none() {
        memory::check(
            &format!("the base run ({n} x {len} tokens with its captures)"),
            keys.0,
            est.base,
        )?;
    }
    let Some(c) = est.chunk else {
        return Ok(est);
    };
    let how = if c.suffix {
        format!("a suffix forward of {} positions per row", c.positions)
    } else {
        format!("a full forward of {} tokens per row", c.positions)
    };
    memory::check(
        &format!(
            "a patching chunk of {} rows ({how}, next to the base run's captures)",
            c.rows
        ),
        keys.1,
        c.bytes + est.held,
    )?;
    Ok(est)
}
