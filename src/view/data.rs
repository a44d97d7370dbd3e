//! The viewer's data: an experiment's long tables (or a grid's merged table) and its
//! exemplars, as the one JSON object the page reads (`data.js`).
//!
//! Numbers are copied from the tables as they are (NaN and missing intervals become
//! `null`); nothing is computed here that the tables do not hold, except grouping.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::output::{HeadKind, LongRow, Table};
use crate::runner::report::ExperimentData;

use super::exemplars::ExemplarRow;

/// `null` for NaN / infinite (JSON has no NaN).
pub(crate) fn num(x: f64) -> Value {
    if x.is_finite() {
        json!((x * 1e6).round() / 1e6)
    } else {
        Value::Null
    }
}

fn opt(x: Option<f64>) -> Value {
    x.map_or(Value::Null, num)
}

fn kind_name(k: HeadKind) -> &'static str {
    match k {
        HeadKind::Query => "query",
        HeadKind::Kv => "kv",
    }
}

/// One head map: a metric of one model over layer x head (of one kind) x phase.
#[derive(Default)]
struct MapAcc {
    layers: BTreeSet<u32>,
    heads: BTreeSet<u32>,
    phases: BTreeSet<u32>,
    cells: Vec<Value>,
    pooled: Vec<Value>,
}

/// Every per-head metric of `model`, one map per (metric, head kind).
fn maps(rows: &[&LongRow]) -> Vec<Value> {
    let mut acc: BTreeMap<(String, &'static str), MapAcc> = BTreeMap::new();
    for r in rows {
        let (Some(l), Some(h), Some(k)) = (r.layer, r.head, r.head_kind) else {
            continue;
        };
        let m = acc.entry((r.metric.clone(), kind_name(k))).or_default();
        m.layers.insert(l);
        m.heads.insert(h);
        let cell = json!([l, h, r.phase, num(r.value), opt(r.ci_lo), opt(r.ci_hi), r.n]);
        match r.phase {
            Some(p) => {
                m.phases.insert(p);
                m.cells.push(cell);
            }
            None => m.pooled.push(cell),
        }
    }
    acc.into_iter()
        .filter(|(_, m)| !m.cells.is_empty())
        .map(|((metric, kind), m)| {
            json!({
                "metric": metric,
                "head_kind": kind,
                "layers": m.layers,
                "heads": m.heads,
                "phases": m.phases,
                "cells": m.cells,
                "pooled": m.pooled,
            })
        })
        .collect()
}

/// Per-phase series of whole-model (`layer` null) or per-layer (`head` null) metrics.
fn series(rows: &[&LongRow]) -> Vec<Value> {
    let mut acc: BTreeMap<(String, Option<u32>), Vec<Value>> = BTreeMap::new();
    for r in rows {
        if r.head.is_some() {
            continue;
        }
        if let Some(p) = r.phase {
            acc.entry((r.metric.clone(), r.layer))
                .or_default()
                .push(json!([p, num(r.value), opt(r.ci_lo), opt(r.ci_hi), r.n]));
        }
    }
    acc.into_iter()
        .map(
            |((metric, layer), points)| json!({"metric": metric, "layer": layer, "points": points}),
        )
        .collect()
}

/// Whole-model rows without a phase (headline numbers: mean accuracy, gap, worst phase).
fn scalars(rows: &[&LongRow]) -> Value {
    let mut out = serde_json::Map::new();
    for r in rows {
        if r.layer.is_none() && r.head.is_none() && r.phase.is_none() {
            out.insert(
                r.metric.clone(),
                json!([num(r.value), opt(r.ci_lo), opt(r.ci_hi), r.n]),
            );
        }
    }
    Value::Object(out)
}

/// The site data of one experiment (first model of the tables).
pub fn experiment_json(d: &ExperimentData, description: &str) -> Value {
    let models = d.models();
    let model = models.first().cloned().unwrap_or_default();
    let rows: Vec<&LongRow> = d.rows.iter().filter(|r| r.model == model).collect();
    let tables: Vec<String> = d
        .tables
        .iter()
        .filter_map(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    json!({
        "view": "experiment",
        "experiment": d.name,
        "kind": d.kind.kind().name(),
        "model": model,
        "models": models,
        "description": description,
        "tables": tables,
        "notes": d.notes,
        "maps": maps(&rows),
        "series": series(&rows),
        "scalars": scalars(&rows),
        "toml": d.toml,
    })
}

/// Exemplar rows grouped per rendering, in the compact form the page reads: one object
/// per (logical example, shift) with its tokens, positions and per-layer captures.
pub fn exemplars_json(rows: &[ExemplarRow]) -> Value {
    let mut by: BTreeMap<(i64, i64), Vec<&ExemplarRow>> = BTreeMap::new();
    for r in rows {
        by.entry((r.logical, r.shift)).or_default().push(r);
    }
    let renderings: Vec<Value> = by.values().map(|rs| rendering_json(rs)).collect();
    json!(renderings)
}

fn rendering_json(rs: &[&ExemplarRow]) -> Value {
    let first = rs[0];
    let mut tokens = Vec::new();
    let mut pos = serde_json::Map::new();
    let mut layers: BTreeMap<i64, serde_json::Map<String, Value>> = BTreeMap::new();
    for r in rs {
        match (r.record.as_str(), r.layer) {
            ("token", _) => tokens.push(json!([r.index, r.value as i64, r.label])),
            (rec, None) => {
                pos.insert(rec.to_string(), json!([num(r.value), r.label]));
            }
            (rec, Some(l)) => {
                let lay = layers.entry(l).or_default();
                let v = match rec {
                    "layer_kind" => json!([num(r.value), r.label, r.offset]),
                    "raw_slots" | "sink" => num(r.value),
                    "entry_span" => json!([r.index, r.offset, r.value as i64]),
                    "pattern" => json!([r.head, r.index, num(r.value)]),
                    "key_gate" => json!([r.head, r.index, r.offset, num(r.value)]),
                    _ => json!([r.index, num(r.value)]),
                };
                match rec {
                    "layer_kind" | "raw_slots" | "sink" => {
                        lay.insert(rec.to_string(), v);
                    }
                    _ => lay
                        .entry(rec.to_string())
                        .or_insert_with(|| json!([]))
                        .as_array_mut()
                        .expect("inserted as an array")
                        .push(v),
                }
            }
        }
    }
    json!({
        "logical": first.logical,
        "shift": first.shift,
        "phase": first.phase,
        "tokens": tokens,
        "marks": pos,
        "layers": layers.into_iter().map(|(l, m)| { let mut m = m; m.insert("layer".into(), json!(l)); Value::Object(m) }).collect::<Vec<_>>(),
    })
}

/// The site data of a merged grid (`grid.arrow`, `grid_summary.arrow`).
pub fn grid_json(dir: &Path, name: &str) -> Result<Value> {
    let path = dir.join("grid.arrow");
    if !path.exists() {
        return Err(Error::Input(format!(
            "{}: no merged grid table (run `phaselens grid merge <grid.toml>` first)",
            path.display()
        )));
    }
    let t = Table::read_arrow(&path)?;
    let s = |c: &str| t.utf8(c).map(<[Option<String>]>::to_vec);
    let (design, protocol, eval) = (s("design")?, s("protocol")?, s("eval")?);
    let phase = t.int64("phase")?;
    let (acc, lo, hi) = (
        t.float64("accuracy")?,
        t.float64("wilson_lo")?,
        t.float64("wilson_hi")?,
    );
    let n = t.uint64("n")?;
    let slot = t.int64("query_slot")?;
    let bindings = t.int64("n_bindings")?;
    let cells: Vec<Value> = (0..t.num_rows())
        .map(|i| {
            json!([
                design[i],
                protocol[i],
                eval[i],
                slot[i],
                bindings[i],
                phase[i],
                opt(acc[i]),
                opt(lo[i]),
                opt(hi[i]),
                n[i]
            ])
        })
        .collect();
    let mut designs: Vec<String> = Vec::new();
    for d in design.iter().flatten() {
        if !designs.contains(d) {
            designs.push(d.clone());
        }
    }
    let frontier = frontier_json(dir)?;
    let mut tables = vec!["grid.arrow"];
    if frontier.as_array().is_some_and(|a| !a.is_empty()) {
        tables.push("grid_frontier.arrow");
    }
    Ok(json!({
        "view": "grid",
        "experiment": name,
        "kind": "grid",
        "tables": tables,
        "designs": designs,
        "grid_cells": cells,
        "summary": summary_json(dir)?,
        "frontier": frontier,
        "maps": [],
        "series": [],
        "scalars": {},
    }))
}

/// `grid_summary.arrow`: per design x protocol of the final query, gap and worst phase.
fn summary_json(dir: &Path) -> Result<Value> {
    let path = dir.join("grid_summary.arrow");
    if !path.exists() {
        return Ok(json!([]));
    }
    let t = Table::read_arrow(&path)?;
    let design = t.utf8("design")?;
    let protocol = t.utf8("protocol")?;
    let eval = t.utf8("eval")?;
    let gap = t.float64("phase_gap_pp")?;
    let (glo, ghi) = (t.float64("gap_ci_lo")?, t.float64("gap_ci_hi")?);
    let worst = t.int64("worst_phase")?;
    let mean = t.float64("mean_accuracy")?;
    Ok(json!(
        (0..t.num_rows())
            .filter(|&i| eval[i].as_deref() == Some("final"))
            .map(|i| json!([
                design[i],
                protocol[i],
                opt(gap[i]),
                opt(glo[i]),
                opt(ghi[i]),
                worst[i],
                opt(mean[i])
            ]))
            .collect::<Vec<_>>()
    ))
}

/// `grid_frontier.arrow` (`grid_frontier/v1`): per pooled design x protocol, `[design,
/// protocol, seeds, seeds_total, members, mean, mean_sd, mean_lo, mean_hi, gap_pp,
/// gap_sd, gap_lo, gap_hi, worst_phase, worst_accuracy, verdict, max_gap_pp]`; empty
/// without the table (a grid merged before frontiers existed).
fn frontier_json(dir: &Path) -> Result<Value> {
    let path = dir.join("grid_frontier.arrow");
    if !path.exists() {
        return Ok(json!([]));
    }
    let t = Table::read_arrow(&path)?;
    let s = |c: &str| t.utf8(c).map(<[Option<String>]>::to_vec);
    let f = |c: &str| t.float64(c).map(<[Option<f64>]>::to_vec);
    let i = |c: &str| t.int64(c).map(<[Option<i64>]>::to_vec);
    let (design, protocol, members, verdict) =
        (s("design")?, s("protocol")?, s("members")?, s("verdict")?);
    let (seeds, total, worst) = (i("seeds")?, i("seeds_total")?, i("worst_phase")?);
    let cols = [
        "mean_accuracy",
        "mean_accuracy_sd",
        "mean_ci_lo",
        "mean_ci_hi",
        "phase_gap_pp",
        "phase_gap_sd",
        "gap_ci_lo",
        "gap_ci_hi",
        "worst_accuracy",
        "max_gap_pp",
    ];
    let num: Vec<Vec<Option<f64>>> = cols
        .iter()
        .map(|c| f(c))
        .collect::<std::result::Result<_, _>>()?;
    Ok(json!(
        (0..t.num_rows())
            .map(|r| {
                let v = |k: usize| opt(num[k][r]);
                json!([
                    design[r],
                    protocol[r],
                    seeds[r],
                    total[r],
                    members[r]
                        .as_deref()
                        .unwrap_or("")
                        .split(',')
                        .filter(|m| !m.is_empty())
                        .collect::<Vec<_>>(),
                    v(0),
                    v(1),
                    v(2),
                    v(3),
                    v(4),
                    v(5),
                    v(6),
                    v(7),
                    worst[r],
                    v(8),
                    verdict[r],
                    v(9)
                ])
            })
            .collect::<Vec<_>>()
    ))
}
