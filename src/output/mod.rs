//! Everything an experiment leaves on disk: Arrow tables (with a Parquet copy),
//! figures (PNG + SVG) and reports (Markdown + HTML). All writes are atomic
//! (temporary file in the same directory, fsync, rename), so an interrupted run
//! never leaves a truncated file behind and resume logic can trust whatever
//! exists.
//!
//! | File | Contents (its public items are re-exported here) |
//! |---|---|
//! | `table` | [`Table`]: typed named columns + schema metadata, Arrow IPC read/write |
//! | `schema` | the documented long and phase-accuracy schemas with typed rows (`docs/tables.md`) |
//! | `frame` | polars: read a table as a DataFrame, Parquet copy, merge shards |
//! | `figure` | heatmaps with colour bars, lines with CI bands, predicted-vs-observed, bar profiles, loss curves |
//! | `report` | `report.md` / `report.html` with headline numbers, tables and figures |
//! | `atomic` | the atomic write primitive; stale temporary files (listing and cleaning) |
//! | `lock` | one run at a time per output folder (a lock file naming its process) |
//! | `name` | what may name an output folder (`check_output_name`) |

pub(crate) mod atomic;
pub(crate) mod figure;
pub(crate) mod frame;
pub(crate) mod leftovers;
#[doc(hidden)] // tests/it hold a run's lock to check that a second run is refused
pub mod lock;
pub(crate) mod name;
pub(crate) mod report;
pub(crate) mod schema;
pub(crate) mod table;

pub use atomic::{
    Durability, clean_stale_temps, committed_files, is_temp_name, write_atomic, write_atomic_as,
    write_bytes_atomic,
};
pub use figure::{
    BandSeries, BarProfileSpec, ColorScale, FigureError, FigureFiles, FigureSpec, HeatmapSpec,
    LinePlotSpec, LossCurveSpec, ScatterSeries, ScatterSpec, bar_profile, check_fonts, heatmap,
    line_with_bands, loss_curve, render, scatter_predicted_vs_observed,
};
pub use frame::{parquet_path, read_dataframe, write_parquet_copy};
pub use name::check_output_name;
pub use report::{
    Headline, Report, ReportError, ReportFiles, phase_gap_headlines, ranked_heads_rows,
};
pub use schema::{
    HeadKind, LONG_COLUMNS, LongRow, PHASE_ACCURACY_COLUMNS, PhaseAccuracyRow, long_table,
    phase_accuracy_table, read_long_rows, read_phase_accuracy_rows, validate_columns,
};
pub use table::{
    Column, ColumnData, ColumnType, META_EXPERIMENT_TOML, META_SCHEMA, META_TABLE, META_VERSION,
    Table, TableError,
};
