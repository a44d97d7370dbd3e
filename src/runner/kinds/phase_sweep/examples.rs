//! The per-example table of a phase sweep (`examples/v1`): one row per protocol x
//! phase x logical example, with its outcome and logit difference.
//!
//! Written next to `phase_accuracy.arrow` when a sweep finishes (from the prompts it
//! computed or the shards it resumed), so that statistics over logical examples
//! (`phaselens grid-shift`) can be recomputed from committed tables alone.

use std::path::Path;

use crate::error::{Error, Result};
use crate::output::{
    ColumnData, ColumnType, META_EXPERIMENT_TOML, META_SCHEMA, Table, validate_columns,
};

/// Schema id of the per-example table.
pub const EXAMPLES_SCHEMA: &str = "examples/v1";

/// File name of the per-example table in `notebooks-data/<experiment>/<model>/`.
pub const EXAMPLES_FILE: &str = "examples.arrow";

/// Schema metadata key: the number of phases P of the sweep.
pub const META_PERIOD: &str = "phaselens.examples.period";

/// The columns of `examples/v1`, in order.
pub const EXAMPLES_COLUMNS: &[(&str, ColumnType)] = &[
    ("model", ColumnType::Utf8),
    ("protocol", ColumnType::Utf8),
    ("phase", ColumnType::Int64),
    ("logical", ColumnType::Int64),
    ("correct", ColumnType::Boolean),
    ("ld", ColumnType::Float64),
];

/// One prompt of a sweep: a logical example rendered at one phase under one protocol.
#[derive(Debug, Clone, PartialEq)]
pub struct ExampleRow {
    /// Model name.
    pub model: String,
    /// `prefix` or `in-sequence` (the `phase_accuracy` table's labels).
    pub protocol: String,
    /// Phase group `0..P`.
    pub phase: u32,
    /// Logical example id (the same id at every phase).
    pub logical: u64,
    /// Top-1 over the full vocabulary equals the answer at every target position.
    pub correct: bool,
    /// Logit difference of the answer's first token against the best wrong value's
    /// (text tasks); `None` where the sweep does not compute one (key-value tasks).
    pub ld: Option<f64>,
}

/// The `examples/v1` table of `rows` (sorted by protocol, phase, logical example),
/// with the period in [`META_PERIOD`].
pub fn examples_table(rows: &[ExampleRow], period: usize) -> Table {
    let mut rows = rows.to_vec();
    rows.sort_by(|a, b| (&a.protocol, a.phase, a.logical).cmp(&(&b.protocol, b.phase, b.logical)));
    let cols = vec![
        ColumnData::Utf8(rows.iter().map(|r| Some(r.model.clone())).collect()),
        ColumnData::Utf8(rows.iter().map(|r| Some(r.protocol.clone())).collect()),
        ColumnData::Int64(rows.iter().map(|r| Some(i64::from(r.phase))).collect()),
        ColumnData::Int64(rows.iter().map(|r| i64::try_from(r.logical).ok()).collect()),
        ColumnData::Boolean(rows.iter().map(|r| Some(r.correct)).collect()),
        ColumnData::Float64(
            rows.iter()
                .map(|r| r.ld.filter(|v| v.is_finite()))
                .collect(),
        ),
    ];
    let mut t = Table::new("examples")
        .with_metadata(META_SCHEMA, EXAMPLES_SCHEMA)
        .with_metadata(META_PERIOD, period.to_string());
    for ((name, _), data) in EXAMPLES_COLUMNS.iter().zip(cols) {
        t.add_column(*name, data)
            .expect("schema columns are distinct and equally long");
    }
    t
}

/// An `examples/v1` table read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Examples {
    /// Its rows, in file order.
    pub rows: Vec<ExampleRow>,
    /// The number of phases P ([`META_PERIOD`]).
    pub period: usize,
    /// The experiment TOML that wrote it (`phaselens.experiment_toml`), if recorded.
    pub experiment_toml: Option<String>,
}

/// Read the `examples/v1` table at `path`.
///
/// # Errors
/// I/O or Arrow errors naming the file; a missing or wrong column, a null where a
/// value is required, or a missing or unreadable [`META_PERIOD`], each naming the file.
pub fn read_examples(path: &Path) -> Result<Examples> {
    let t = Table::read_arrow(path)?;
    validate_columns(&t, EXAMPLES_COLUMNS)?;
    let period = t
        .metadata()
        .get(META_PERIOD)
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&p| p > 0)
        .ok_or_else(|| {
            Error::Other(format!(
                "{}: schema metadata `{META_PERIOD}` is missing or not a positive integer",
                path.display()
            ))
        })?;
    let (model, protocol) = (t.utf8("model")?, t.utf8("protocol")?);
    let (phase, logical) = (t.int64("phase")?, t.int64("logical")?);
    let (correct, ld) = (t.boolean("correct")?, t.float64("ld")?);
    let mut rows = Vec::with_capacity(t.num_rows());
    for i in 0..t.num_rows() {
        let index = |col: &str, v: Option<i64>| -> Result<u64> {
            let v = v.ok_or_else(|| t.null_error(col, i))?;
            u64::try_from(v).map_err(|_| t.value_error(col, i, format!("{v} is negative")).into())
        };
        let ph = index("phase", phase[i])?;
        if ph >= period as u64 {
            let why = format!("phase {ph} is outside 0..{period}");
            return Err(t.value_error("phase", i, why).into());
        }
        rows.push(ExampleRow {
            model: model[i].clone().ok_or_else(|| t.null_error("model", i))?,
            protocol: protocol[i]
                .clone()
                .ok_or_else(|| t.null_error("protocol", i))?,
            phase: ph as u32,
            logical: index("logical", logical[i])?,
            correct: correct[i].ok_or_else(|| t.null_error("correct", i))?,
            ld: ld[i],
        });
    }
    Ok(Examples {
        rows,
        period,
        experiment_toml: t.metadata().get(META_EXPERIMENT_TOML).cloned(),
    })
}

/// Write `notebooks-data/<experiment>/<model>/examples.arrow` (+ Parquet copy) with
/// the experiment TOML as provenance.
pub(super) fn write_examples(
    dir: &Path,
    rows: &[ExampleRow],
    period: usize,
    experiment_toml: &str,
) -> Result<()> {
    let path = dir.join(EXAMPLES_FILE);
    examples_table(rows, period)
        .with_provenance(experiment_toml)
        .write_arrow(&path)?;
    crate::output::write_parquet_copy(&path)?;
    Ok(())
}
