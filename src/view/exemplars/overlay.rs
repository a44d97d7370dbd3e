//! The exemplar rows of a layer under a `select` or `evict` overlay (docs/view.md): its
//! grid, its attention at the read position folded onto the tokens (the overlay reads
//! raw tokens, some as selected entries and some as its raw window: `hook_pattern`'s key
//! slots are `[every token as an entry..., raw tokens (select)..., sink]`), and the
//! blocks / chunks it scored and kept (`attn.indexer.hook_scores` / `hook_selected`).

use super::{Rendering, at, captured, round};
use crate::error::{Error, Result};
use crate::hooks::{ActivationCache, HookPoint, Site};
use crate::model::compression::Overlay;

/// The `layer_kind` label of an overlay.
fn label(o: &Overlay) -> String {
    match *o {
        Overlay::Select {
            block,
            top_k,
            window,
            sinks,
            ..
        } => format!("select block={block} top={top_k} window={window} sinks={sinks}"),
        Overlay::Evict {
            chunk,
            keep,
            observe,
            sinks,
            decode,
            ..
        } => format!(
            "evict chunk={chunk} keep={keep} observe={observe} sinks={sinks} decode={decode}"
        ),
        _ => o.to_string(),
    }
}

/// The marks of a rendering of `t` tokens read at `q`: `overlay_window`, the first
/// token the overlay always reads at `q` (`select`: its raw window's first; `evict`: the
/// observation window's first), and `overlay_sinks`, the leading tokens it always reads.
pub(super) fn marks(o: &Overlay, t: usize, q: usize, r: &mut Rendering) {
    let (first, sinks) = match *o {
        Overlay::Select { window, sinks, .. } => ((q + 1).saturating_sub(window), sinks),
        Overlay::Evict {
            observe,
            decode,
            sinks,
            ..
        } => (t.saturating_sub(decode).saturating_sub(observe), sinks),
        _ => return,
    };
    let none = [None; 4];
    r.push("overlay_window", none, first as f64, None);
    r.push("overlay_sinks", none, sinks as f64, None);
}

/// One layer of `t` tokens read at `q`: its kind (`layer_kind`: value = the block or
/// chunk, offset = the grid's offset), its attention per token, and its selection.
pub(super) fn layer_rows(
    o: &Overlay,
    cache: &ActivationCache,
    l: usize,
    (t, q): (usize, usize),
    min_weight: f64,
    r: &mut Rendering,
) -> Result<()> {
    let kind_at = [Some(l as i64), None, None, Some(o.offset() as i64)];
    r.push("layer_kind", kind_at, o.period() as f64, Some(label(o)));
    let point = HookPoint::block(l, Site::AttnPattern);
    let (shape, vals) = captured(cache, l, Site::AttnPattern)
        .ok_or_else(|| Error::hook(point.to_string(), "not produced by the model"))?;
    let [_, h, tq, k] = <[usize; 4]>::try_from(shape.clone())
        .map_err(|_| Error::hook(point.to_string(), format!("expected rank 4, got {shape:?}")))?;
    let raw = matches!(o, Overlay::Select { .. });
    let sink = k.checked_sub(t * (1 + usize::from(raw)));
    let sink = match sink {
        Some(s @ (0 | 1)) if q < tq => s == 1,
        _ => {
            return Err(Error::hook(
                point.to_string(),
                format!("{k} key slots for {t} tokens under {o} (read position {q} of {tq})"),
            ));
        }
    };
    r.push("raw_slots", at(l), t as f64, None);
    r.push("sink", at(l), f64::from(u8::from(sink)), None);
    for head in 0..h {
        let row = &vals[(head * tq + q) * k..(head * tq + q + 1) * k];
        let folded = (0..t).map(|j| row[j] + if raw { row[t + j] } else { 0.0 });
        let sink_w = sink.then(|| row[k - 1]);
        for (slot, w) in folded.chain(sink_w).enumerate() {
            if f64::from(w) >= min_weight {
                let at = [Some(l as i64), Some(head as i64), Some(slot as i64), None];
                r.push("pattern", at, round(f64::from(w)), None);
            }
        }
    }
    selection_rows(cache, l, q, r);
    Ok(())
}

/// `hook_scores` / `hook_selected` per block at the read position (`select`: `[1,
/// query_pos, block]`) or per chunk (`evict`: `[1, chunk]`, one decision per sequence),
/// as `indexer_score` / `indexer_selected` rows (`index` = the block or chunk).
fn selection_rows(cache: &ActivationCache, l: usize, q: usize, r: &mut Rendering) {
    for (site, record) in [
        (Site::IndexerScores, "indexer_score"),
        (Site::IndexerSelected, "indexer_selected"),
    ] {
        let Some((shape, vals)) = captured(cache, l, site) else {
            continue;
        };
        let row = match *shape.as_slice() {
            [_, tq, n] if q < tq => &vals[q * n..(q + 1) * n],
            [_, n] => &vals[..n],
            _ => continue,
        };
        for (i, &v) in row.iter().enumerate() {
            let v = f64::from(v);
            let at = [Some(l as i64), None, Some(i as i64), None];
            r.push(
                record,
                at,
                if v.is_finite() { round(v) } else { -1e30 },
                None,
            );
        }
    }
}
