//! The documented table schemas (see `docs/tables.md`) with typed rows.
//!
//! * **long** (`phaselens.schema = "long/v1"`): one row per experiment x model x
//!   layer x head x phase x metric. Used by every experiment kind.
//! * **phase_accuracy** (`phaselens.schema = "phase_accuracy/v1"`): accuracy per
//!   phase group with Wilson intervals, as written by `phase-sweep`.

use super::table::{ColumnData, ColumnType, META_SCHEMA, Result, Table, TableError};
use crate::analysis::{Z95, wilson};

/// Schema id of the long format.
pub const LONG_SCHEMA_ID: &str = "long/v1";
/// Schema id of the phase-accuracy table.
pub const PHASE_ACCURACY_SCHEMA_ID: &str = "phase_accuracy/v1";

/// Columns of the long format, in order.
pub const LONG_COLUMNS: &[(&str, ColumnType)] = &[
    ("experiment", ColumnType::Utf8),
    ("model", ColumnType::Utf8),
    ("kind", ColumnType::Utf8),
    ("layer", ColumnType::Int64),
    ("head", ColumnType::Int64),
    ("head_kind", ColumnType::Utf8),
    ("phase", ColumnType::Int64),
    ("metric", ColumnType::Utf8),
    ("value", ColumnType::Float64),
    ("ci_lo", ColumnType::Float64),
    ("ci_hi", ColumnType::Float64),
    ("n", ColumnType::UInt64),
];

/// Columns of the phase-accuracy table, in order.
pub const PHASE_ACCURACY_COLUMNS: &[(&str, ColumnType)] = &[
    ("model", ColumnType::Utf8),
    ("protocol", ColumnType::Utf8),
    ("phase", ColumnType::Int64),
    ("n", ColumnType::UInt64),
    ("correct", ColumnType::UInt64),
    ("accuracy", ColumnType::Float64),
    ("wilson_lo", ColumnType::Float64),
    ("wilson_hi", ColumnType::Float64),
];

/// Which kind of head: the head axis of a hook site, a cell of an experiment
/// (`head_kinds = ["query", "kv"]`) and the `head_kind` column of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadKind {
    /// A query head (0..n_heads); stored as `"query"`.
    Query,
    /// A key/value head (0..n_kv_heads); query head h reads KV head h / (n_heads / n_kv_heads).
    /// Stored as `"kv"`.
    Kv,
}

impl HeadKind {
    /// The name in TOML files and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Query => "query",
            Self::Kv => "kv",
        }
    }

    /// Parses [`HeadKind::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "query" => Some(Self::Query),
            "kv" => Some(Self::Kv),
            _ => None,
        }
    }
}

/// One row of the long format.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRow {
    /// Experiment name (the TOML's name).
    pub experiment: String,
    /// Model name.
    pub model: String,
    /// Experiment kind (`phase-sweep`, `patch-heads`, `ablate-heads`, ...).
    pub kind: String,
    /// Layer index; `None` for whole-model rows.
    pub layer: Option<u32>,
    /// Head index within the layer; `None` for layer- or model-level rows.
    pub head: Option<u32>,
    /// Query head or KV head; `None` when `head` is `None`.
    pub head_kind: Option<HeadKind>,
    /// Phase (source residue); `None` for rows aggregated over phases.
    pub phase: Option<u32>,
    /// Metric name (e.g. `accuracy`, `nld_denoise`, `rel_change_pct`).
    pub metric: String,
    /// The value (`NaN` if undefined).
    pub value: f64,
    /// Lower CI bound, if any.
    pub ci_lo: Option<f64>,
    /// Upper CI bound, if any.
    pub ci_hi: Option<f64>,
    /// Number of observations (prompts or logical examples) behind the value.
    pub n: u64,
}

impl LongRow {
    /// A whole-model row (no layer, head or phase; no CI; `n = 0`).
    pub fn new(
        experiment: impl Into<String>,
        model: impl Into<String>,
        kind: impl Into<String>,
        metric: impl Into<String>,
        value: f64,
    ) -> Self {
        Self {
            experiment: experiment.into(),
            model: model.into(),
            kind: kind.into(),
            layer: None,
            head: None,
            head_kind: None,
            phase: None,
            metric: metric.into(),
            value,
            ci_lo: None,
            ci_hi: None,
            n: 0,
        }
    }

    /// Sets the layer (layer-level row).
    pub fn at_layer(mut self, layer: u32) -> Self {
        self.layer = Some(layer);
        self
    }

    /// Sets layer, head and head kind.
    pub fn at_head(mut self, layer: u32, head: u32, kind: HeadKind) -> Self {
        self.layer = Some(layer);
        self.head = Some(head);
        self.head_kind = Some(kind);
        self
    }

    /// Sets the phase.
    pub fn at_phase(mut self, phase: u32) -> Self {
        self.phase = Some(phase);
        self
    }

    /// Sets the confidence interval.
    pub fn with_ci(mut self, lo: f64, hi: f64) -> Self {
        self.ci_lo = Some(lo);
        self.ci_hi = Some(hi);
        self
    }

    /// Sets the number of observations.
    pub fn with_n(mut self, n: u64) -> Self {
        self.n = n;
        self
    }
}

/// One row of the phase-accuracy table.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseAccuracyRow {
    /// Model name.
    pub model: String,
    /// Prompt protocol (`prefix` or `in-sequence`).
    pub protocol: String,
    /// Phase group (residue of the target key position).
    pub phase: u32,
    /// Prompts in the group.
    pub n: u64,
    /// Correct answers (full-vocabulary top-1).
    pub correct: u64,
    /// `correct / n` (`NaN` when `n = 0`).
    pub accuracy: f64,
    /// 95% Wilson lower bound.
    pub wilson_lo: f64,
    /// 95% Wilson upper bound.
    pub wilson_hi: f64,
}

impl PhaseAccuracyRow {
    /// A row with accuracy and 95% Wilson interval computed from `correct / n`.
    ///
    /// # Panics
    /// If `correct > n`.
    pub fn new(
        model: impl Into<String>,
        protocol: impl Into<String>,
        phase: u32,
        n: u64,
        correct: u64,
    ) -> Self {
        let (wilson_lo, wilson_hi) = wilson(correct, n, Z95);
        Self {
            model: model.into(),
            protocol: protocol.into(),
            phase,
            n,
            correct,
            accuracy: if n == 0 {
                f64::NAN
            } else {
                correct as f64 / n as f64
            },
            wilson_lo,
            wilson_hi,
        }
    }
}

fn opt_u32(v: Option<u32>) -> Option<i64> {
    v.map(i64::from)
}

/// Builds a long-format table named `name` (metadata [`META_SCHEMA`] = `long/v1`).
/// Add provenance with [`Table::with_provenance`].
pub fn long_table(name: impl Into<String>, rows: &[LongRow]) -> Table {
    let col = |f: &dyn Fn(&LongRow) -> Option<String>| -> ColumnData {
        ColumnData::Utf8(rows.iter().map(f).collect())
    };
    let cols: Vec<ColumnData> = vec![
        col(&|r| Some(r.experiment.clone())),
        col(&|r| Some(r.model.clone())),
        col(&|r| Some(r.kind.clone())),
        ColumnData::Int64(rows.iter().map(|r| opt_u32(r.layer)).collect()),
        ColumnData::Int64(rows.iter().map(|r| opt_u32(r.head)).collect()),
        col(&|r| r.head_kind.map(|k| k.as_str().to_owned())),
        ColumnData::Int64(rows.iter().map(|r| opt_u32(r.phase)).collect()),
        col(&|r| Some(r.metric.clone())),
        ColumnData::Float64(rows.iter().map(|r| Some(r.value)).collect()),
        ColumnData::Float64(rows.iter().map(|r| r.ci_lo).collect()),
        ColumnData::Float64(rows.iter().map(|r| r.ci_hi).collect()),
        ColumnData::UInt64(rows.iter().map(|r| Some(r.n)).collect()),
    ];
    build(name.into(), LONG_SCHEMA_ID, LONG_COLUMNS, cols)
}

/// Builds a phase-accuracy table named `name` (metadata [`META_SCHEMA`] =
/// `phase_accuracy/v1`).
pub fn phase_accuracy_table(name: impl Into<String>, rows: &[PhaseAccuracyRow]) -> Table {
    let cols: Vec<ColumnData> = vec![
        ColumnData::Utf8(rows.iter().map(|r| Some(r.model.clone())).collect()),
        ColumnData::Utf8(rows.iter().map(|r| Some(r.protocol.clone())).collect()),
        ColumnData::Int64(rows.iter().map(|r| Some(i64::from(r.phase))).collect()),
        ColumnData::UInt64(rows.iter().map(|r| Some(r.n)).collect()),
        ColumnData::UInt64(rows.iter().map(|r| Some(r.correct)).collect()),
        ColumnData::Float64(rows.iter().map(|r| Some(r.accuracy)).collect()),
        ColumnData::Float64(rows.iter().map(|r| Some(r.wilson_lo)).collect()),
        ColumnData::Float64(rows.iter().map(|r| Some(r.wilson_hi)).collect()),
    ];
    build(
        name.into(),
        PHASE_ACCURACY_SCHEMA_ID,
        PHASE_ACCURACY_COLUMNS,
        cols,
    )
}

fn build(
    name: String,
    schema_id: &str,
    spec: &[(&str, ColumnType)],
    cols: Vec<ColumnData>,
) -> Table {
    let mut t = Table::new(name).with_metadata(META_SCHEMA, schema_id);
    for ((col_name, _), data) in spec.iter().zip(cols) {
        t.add_column(*col_name, data)
            .expect("schema columns are distinct and equally long");
    }
    t
}

/// Checks that `table` has exactly the columns `expected` (names, types, order).
///
/// # Errors
/// [`TableError::MissingColumn`] or [`TableError::WrongType`] naming the file
/// and column; [`TableError::InvalidValue`] for an extra column.
pub fn validate_columns(table: &Table, expected: &[(&str, ColumnType)]) -> Result<()> {
    for (name, ty) in expected {
        let found = table.get(name)?.data.column_type();
        if found != *ty {
            return Err(TableError::WrongType {
                table: table.name().to_owned(),
                column: (*name).to_owned(),
                file: table
                    .source()
                    .map_or_else(|| "<memory>".into(), |p| p.display().to_string()),
                expected: ty.to_string(),
                found: found.to_string(),
            });
        }
    }
    if let Some(extra) = table
        .column_names()
        .into_iter()
        .find(|n| !expected.iter().any(|(e, _)| e == n))
    {
        return Err(table.value_error(extra, 0, "column is not part of the schema".into()));
    }
    Ok(())
}

fn required<T: Clone>(table: &Table, column: &str, values: &[Option<T>], row: usize) -> Result<T> {
    values[row]
        .clone()
        .ok_or_else(|| table.null_error(column, row))
}

fn opt_index(table: &Table, column: &str, value: Option<i64>, row: usize) -> Result<Option<u32>> {
    value
        .map(|v| {
            u32::try_from(v)
                .map_err(|_| table.value_error(column, row, format!("{v} is not a valid index")))
        })
        .transpose()
}

/// Reads the rows of a long-format table (e.g. from [`Table::read_arrow`]).
///
/// # Errors
/// Schema mismatch, nulls in required columns (`experiment, model, kind, metric,
/// value, n`), negative indices or an unknown `head_kind`, naming file, column
/// and row.
pub fn read_long_rows(table: &Table) -> Result<Vec<LongRow>> {
    validate_columns(table, LONG_COLUMNS)?;
    let experiment = table.utf8("experiment")?;
    let model = table.utf8("model")?;
    let kind = table.utf8("kind")?;
    let layer = table.int64("layer")?;
    let head = table.int64("head")?;
    let head_kind = table.utf8("head_kind")?;
    let phase = table.int64("phase")?;
    let metric = table.utf8("metric")?;
    let value = table.float64("value")?;
    let ci_lo = table.float64("ci_lo")?;
    let ci_hi = table.float64("ci_hi")?;
    let n = table.uint64("n")?;
    (0..table.num_rows())
        .map(|i| {
            let head_kind = match &head_kind[i] {
                None => None,
                Some(s) => Some(HeadKind::parse(s).ok_or_else(|| {
                    table.value_error("head_kind", i, format!("`{s}` is not `query` or `kv`"))
                })?),
            };
            Ok(LongRow {
                experiment: required(table, "experiment", experiment, i)?,
                model: required(table, "model", model, i)?,
                kind: required(table, "kind", kind, i)?,
                layer: opt_index(table, "layer", layer[i], i)?,
                head: opt_index(table, "head", head[i], i)?,
                head_kind,
                phase: opt_index(table, "phase", phase[i], i)?,
                metric: required(table, "metric", metric, i)?,
                value: required(table, "value", value, i)?,
                ci_lo: ci_lo[i],
                ci_hi: ci_hi[i],
                n: required(table, "n", n, i)?,
            })
        })
        .collect()
}

/// Reads the rows of a phase-accuracy table.
///
/// # Errors
/// Schema mismatch, nulls or a negative phase, naming file, column and row.
pub fn read_phase_accuracy_rows(table: &Table) -> Result<Vec<PhaseAccuracyRow>> {
    validate_columns(table, PHASE_ACCURACY_COLUMNS)?;
    let model = table.utf8("model")?;
    let protocol = table.utf8("protocol")?;
    let phase = table.int64("phase")?;
    let n = table.uint64("n")?;
    let correct = table.uint64("correct")?;
    let accuracy = table.float64("accuracy")?;
    let lo = table.float64("wilson_lo")?;
    let hi = table.float64("wilson_hi")?;
    (0..table.num_rows())
        .map(|i| {
            Ok(PhaseAccuracyRow {
                model: required(table, "model", model, i)?,
                protocol: required(table, "protocol", protocol, i)?,
                phase: opt_index(table, "phase", Some(required(table, "phase", phase, i)?), i)?
                    .expect("Some in, Some out"),
                n: required(table, "n", n, i)?,
                correct: required(table, "correct", correct, i)?,
                accuracy: required(table, "accuracy", accuracy, i)?,
                wilson_lo: required(table, "wilson_lo", lo, i)?,
                wilson_hi: required(table, "wilson_hi", hi, i)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long_rows() -> Vec<LongRow> {
        vec![
            LongRow::new("v4pro", "v4pro-mini", "patch-heads", "nld_denoise", 0.42)
                .at_head(3, 1, HeadKind::Kv)
                .at_phase(5)
                .with_ci(0.3, 0.55)
                .with_n(256),
            LongRow::new("v4pro", "v4pro-mini", "phase-sweep", "phase_gap_pp", 13.9)
                .with_ci(12.1, 15.7)
                .with_n(2048),
            LongRow::new(
                "v4pro",
                "v4pro-mini",
                "knockout",
                "rel_change_pct",
                f64::NAN,
            )
            .at_layer(2),
        ]
    }

    #[test]
    fn long_round_trip_through_arrow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("heads.arrow");
        let rows = long_rows();
        long_table("heads", &rows)
            .with_provenance("name = 'v4pro'")
            .write_arrow(&path)
            .unwrap();
        let t = Table::read_arrow(&path).unwrap();
        assert_eq!(t.metadata()[META_SCHEMA], LONG_SCHEMA_ID);
        let names: Vec<&str> = LONG_COLUMNS.iter().map(|(n, _)| *n).collect();
        assert_eq!(t.column_names(), names);
        assert_eq!(t.int64("layer").unwrap(), &[Some(3), None, Some(2)]);
        assert_eq!(t.utf8("head_kind").unwrap()[1], None);
        let back = read_long_rows(&t).unwrap();
        assert_eq!(back[..2], rows[..2]);
        assert!(back[2].value.is_nan() && back[2].layer == Some(2));
    }

    #[test]
    fn phase_accuracy_rows() {
        let r = PhaseAccuracyRow::new("kvc-w8s8", "prefix", 3, 10, 8);
        assert_eq!(r.accuracy, 0.8);
        assert!((r.wilson_lo - 0.4902).abs() < 1e-4 && (r.wilson_hi - 0.9433).abs() < 1e-4);
        let empty = PhaseAccuracyRow::new("m", "prefix", 0, 0, 0);
        assert!(empty.accuracy.is_nan());
        assert_eq!((empty.wilson_lo, empty.wilson_hi), (0.0, 1.0));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("phase_accuracy.arrow");
        let rows = vec![
            r,
            PhaseAccuracyRow::new("kvc-w8s8", "in-sequence", 4, 256, 200),
        ];
        phase_accuracy_table("phase_accuracy", &rows)
            .write_arrow(&path)
            .unwrap();
        let t = Table::read_arrow(&path).unwrap();
        assert_eq!(t.metadata()[META_SCHEMA], PHASE_ACCURACY_SCHEMA_ID);
        assert_eq!(read_phase_accuracy_rows(&t).unwrap(), rows);
    }

    #[test]
    fn invalid_tables_are_reported() {
        let t = phase_accuracy_table("pa", &[PhaseAccuracyRow::new("m", "p", 1, 4, 2)]);
        let err = read_long_rows(&t).unwrap_err().to_string();
        assert!(err.contains("experiment"), "{err}");

        let mut rows = long_rows();
        rows.truncate(1);
        let t = long_table("heads", &rows);
        // Replace head_kind by an invalid value.
        let mut bad = Table::new("heads");
        for c in t.columns() {
            let data = if c.name == "head_kind" {
                ColumnData::Utf8(vec![Some("value".into())])
            } else {
                c.data.clone()
            };
            bad.add_column(c.name.clone(), data).unwrap();
        }
        let err = read_long_rows(&bad).unwrap_err().to_string();
        assert!(err.contains("head_kind") && err.contains("row 0"), "{err}");

        let mut extra = long_table("heads", &rows);
        extra.add_column("extra", vec![1i64]).unwrap();
        assert!(
            read_long_rows(&extra)
                .unwrap_err()
                .to_string()
                .contains("extra")
        );
    }
}
