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

/// Whether a cell's edit can run as a suffix forward: it replaces a per-token
/// activation at given positions (not "all").
pub(super) fn suffix_edit(cell: &Cell) -> bool {
    matches!(
        &cell.edit,
        Edit::Replace { point, positions, .. }
            if point.site.info().per_token && *positions != Positions::All
    )
}

/// The positions a chunk (rows in cell order) must recompute, if it can run as a
/// suffix forward ([`run_chunk`]): every edit
/// replaces a per-token activation at given positions (not "all") of the start layer.
/// Row `r` then needs positions from its first edited or read position to its last
/// read one (edits after the last read position cannot reach the logits read). The
/// suffix length is the longest of those spans; shorter rows start earlier (their extra
/// positions are recomputed unchanged). `None` when an edit does not qualify or the
/// suffix would cover more than half of the prompt (no gain).
pub fn plan_suffix(prompts: &Prompts, cells: &[Cell], chunk: &[usize]) -> Option<Suffix> {
    let row_prompt: Vec<usize> = chunk
        .iter()
        .flat_map(|&c| cells[c].prompts.iter().copied())
        .collect();
    let mut first = Vec::with_capacity(row_prompt.len());
    for &c in chunk {
        let Edit::Replace { positions, .. } = &cells[c].edit else {
            return None;
        };
        if !suffix_edit(&cells[c]) {
            return None;
        }
        for &p in &cells[c].prompts {
            let targets = &prompts.targets[p].positions;
            let edited = positions.resolve(targets)?;
            let lo = edited
                .iter()
                .chain(targets)
                .copied()
                .min()
                .expect("a prompt has a target position");
            first.push(lo);
        }
    }
    let last: Vec<usize> = row_prompt
        .iter()
        .map(|&p| {
            *prompts.targets[p]
                .positions
                .iter()
                .max()
                .expect("a prompt has a target position")
        })
        .collect();
    // first <= the smallest target <= last, so every span is at least one position.
    let len = last.iter().zip(&first).map(|(&l, &f)| l + 1 - f).max()?;
    if 2 * len > prompts.len {
        return None;
    }
    Some(Suffix {
        rows: row_prompt,
        from: last.iter().map(|&l| l + 1 - len).collect(),
        len,
    })
}

/// Positions `from[r] .. from[r] + len` (axis 1) of each row of `act`.
pub(super) fn slice_positions(act: &Act, from: &[usize], len: usize) -> Result<Act> {
    let shape = act.shape().to_vec();
    if shape.len() < 2 || shape[0] != from.len() {
        return Err(Error::Other(format!(
            "cannot take per-row positions of an activation of shape {shape:?}"
        )));
    }
    let (b, t) = (shape[0], shape[1]);
    let mut idx = Vec::with_capacity(b * len);
    for (r, &f) in from.iter().enumerate() {
        if f + len > t {
            return Err(Error::Other(format!(
                "positions {f}..{} out of range 0..{t}",
                f + len
            )));
        }
        idx.extend((f..f + len).map(|p| r * t + p));
    }
    // Rows of the [b * t, ...] view are (row, position) pairs.
    let mut view = shape.clone();
    view.splice(0..2, [b * t]);
    let mut out = shape;
    out[1] = len;
    act.reshaped(view)?.select_batch(&idx)?.reshaped(out)
}
