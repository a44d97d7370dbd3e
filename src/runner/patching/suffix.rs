//! Suffix plans: which chunks can run as a suffix forward (only the positions from the
//! first edited or read one to the last read one are recomputed), and the per-row
//! position slices they need.

use super::*;

/// How [`run_chunk_with`] runs the blocks from the start layer on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkPath {
    /// The suffix forward when the chunk allows it (see [`run_chunk`]), else full.
    Auto,
    /// Always `forward_from` over every position.
    Full,
}

/// Where a cell's change to the forward starts, if it can run as a suffix forward:
/// the positions of a replacement of a per-token activation at given positions (not
/// "all"); for a [`Edit::FromStage`] of a per-token activation, the positions of its
/// stage's edit (by causality its capture equals the base run's before the first
/// of them, [`Stage::suffix_positions`]).
pub(super) fn suffix_edit(cell: &Cell) -> Option<&Positions> {
    match &cell.edit {
        Edit::Replace {
            point, positions, ..
        } if point.site.info().per_token && *positions != Positions::All => Some(positions),
        Edit::FromStage { stage, point, .. } if point.site.info().per_token => {
            stage.suffix_positions()
        }
        _ => None,
    }
}

/// The positions a chunk (rows in cell order) must recompute, if it can run as a
/// suffix forward ([`run_chunk`]): every cell's change starts at given positions
/// ([`suffix_edit`]: a replacement of a per-token activation at given positions, not
/// "all", or a stage fill whose stage edits such positions).
/// Row `r` then needs positions from its first edited or read position to its last
/// read one (edits after the last read position cannot reach the logits read). The
/// suffix length is the longest of those spans; shorter rows start earlier (their extra
/// positions are recomputed unchanged). `None` when an edit does not qualify or the
/// suffix would cover more than half of the prompt (no gain).
pub fn plan_suffix(prompts: &Prompts, cells: &[Cell], chunk: &[usize]) -> Option<Suffix> {
    let mut rows = Vec::new();
    for &c in chunk {
        let positions = suffix_edit(&cells[c])?;
        rows.extend(cells[c].prompts.iter().map(|&p| (p, positions)));
    }
    span_suffix(prompts, &rows)
}

/// The suffix of rows `(prompt, edited positions)` (see [`plan_suffix`]).
pub(super) fn span_suffix(prompts: &Prompts, rows: &[(usize, &Positions)]) -> Option<Suffix> {
    let mut first = Vec::with_capacity(rows.len());
    let mut last = Vec::with_capacity(rows.len());
    for &(p, positions) in rows {
        let targets = &prompts.targets[p].positions;
        let edited = positions.resolve(targets)?;
        let lo = edited
            .iter()
            .chain(targets)
            .copied()
            .min()
            .expect("a prompt has a target position");
        first.push(lo);
        last.push(
            *targets
                .iter()
                .max()
                .expect("a prompt has a target position"),
        );
    }
    // first <= the smallest target <= last, so every span is at least one position.
    let len = last.iter().zip(&first).map(|(&l, &f)| l + 1 - f).max()?;
    if 2 * len > prompts.len {
        return None;
    }
    Some(Suffix {
        rows: rows.iter().map(|&(p, _)| p).collect(),
        from: last.iter().map(|&l| l + 1 - len).collect(),
        len,
    })
}

/// The token positions a base run for `cells` must capture per-token activations at,
/// when every chunk of them runs as a suffix forward: `None` when some cell cannot
/// ([`suffix_edit`]), reads a stage's captures (path patching keeps every position), or
/// the suffixes would not save anything.
///
/// The suffix of all the cells' rows together has the longest span `L`; a chunk's own
/// suffix is at most `L` long and ends at each row's last read position, so it starts
/// no earlier than that row's start in the joint suffix and ends no later: the joint
/// suffix's positions, from its earliest start to its latest end, hold every chunk's.
pub fn capture_window(prompts: &Prompts, cells: &[Cell]) -> Option<std::ops::Range<usize>> {
    let mut rows = Vec::new();
    for c in cells {
        if matches!(c.edit, Edit::FromStage { .. }) {
            return None;
        }
        let positions = suffix_edit(c)?;
        rows.extend(c.prompts.iter().map(|&p| (p, positions)));
    }
    let joint = span_suffix(prompts, &rows)?;
    let start = *joint.from.iter().min()?;
    let end = joint.from.iter().max()? + joint.len;
    (end - start < prompts.len).then_some(start..end)
}

/// Whether a base run for `cells` keeps the prefix state: some cell can run as a suffix
/// forward ([`suffix_edit`]).
pub(super) fn keeps_state(cells: &[Cell]) -> bool {
    cells.iter().any(|c| suffix_edit(c).is_some())
}

/// Positions `from[r] .. from[r] + len` (axis 1) of each row of `act`.
pub(super) fn slice_positions(act: &Act, from: &[usize], len: usize) -> Result<Act> {
    let b = act.shape().first().copied().unwrap_or(0);
    if act.shape().len() < 2 || b != from.len() {
        return Err(Error::Other(format!(
            "cannot take per-row positions of an activation of shape {:?}",
            act.shape()
        )));
    }
    let rows: Vec<usize> = (0..b).collect();
    take_positions(act, &rows, from, len)
}

/// Positions `from[r] .. from[r] + len` of prompt `rows[r]` of `act: [prompts, t, ...]`
/// for every row: `[rows, len, ...]`, what `slice_positions(select_batch(rows))` gives,
/// without building any row at full length.
pub(super) fn take_positions(act: &Act, rows: &[usize], from: &[usize], len: usize) -> Result<Act> {
    let shape = act.shape().to_vec();
    if shape.len() < 2 || rows.len() != from.len() {
        return Err(Error::Other(format!(
            "cannot take per-row positions of an activation of shape {shape:?}"
        )));
    }
    let (n, t) = (shape[0], shape[1]);
    let mut idx = Vec::with_capacity(rows.len() * len);
    for (&p, &f) in rows.iter().zip(from) {
        if p >= n || f + len > t {
            return Err(Error::Other(format!(
                "prompt {p} positions {f}..{} out of range ({n} prompts of {t})",
                f + len
            )));
        }
        idx.extend((f..f + len).map(|q| p * t + q));
    }
    let mut view = shape.clone();
    view.splice(0..2, [n * t]);
    let mut out = shape;
    out[0] = rows.len();
    out[1] = len;
    act.reshaped(view)?.select_batch(&idx)?.reshaped(out)
}

/// The inverse of [`slice_positions`]: `full: [rows, t, ...]` with positions
/// `from[r] .. from[r] + len` of each row taken from `part: [rows, len, ...]`.
pub(super) fn unslice_positions(full: &Act, part: &Act, from: &[usize], len: usize) -> Result<Act> {
    let shape = full.shape().to_vec();
    if shape.len() < 2 || shape[0] != from.len() || part.shape().get(1) != Some(&len) {
        return Err(Error::Other(format!(
            "cannot put positions of an activation of shape {:?} into one of shape {shape:?}",
            part.shape()
        )));
    }
    let (b, t) = (shape[0], shape[1]);
    let mut idx = Vec::with_capacity(b * t);
    for (r, &f) in from.iter().enumerate() {
        idx.extend((0..t).map(|p| {
            if (f..f + len).contains(&p) {
                b * t + r * len + p - f
            } else {
                r * t + p
            }
        }));
    }
    // Rows of the [b * t, ...] views are (row, position) pairs: the full rows, then
    // the recomputed ones.
    let mut view = shape.clone();
    view.splice(0..2, [b * t]);
    let mut part_view = view.clone();
    part_view[0] = b * len;
    let both = Act::cat_batch(&[full.reshaped(view)?, part.reshaped(part_view)?])?;
    both.select_batch(&idx)?.reshaped(shape)
}
