//! Typed, named-column tables written as Arrow IPC files (`.arrow`).
//!
//! A [`Table`] holds whole columns in memory (experiment tables are small: one row
//! per layer x head x phase x metric) plus schema-level metadata (string key/value
//! pairs such as [`META_VERSION`] and [`META_EXPERIMENT_TOML`]). It is written with
//! the `arrow` crate's IPC *file* format (readable by pyarrow, polars, pandas via
//! pyarrow, DuckDB) through an atomic rename, and read back for redrawing figures
//! and resuming runs. Every column is nullable; `Float64` distinguishes null
//! (missing) from `NaN` (computed but undefined).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, StringArray, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::error::ArrowError;
use arrow::ipc::reader::FileReader;
use arrow::ipc::writer::FileWriter;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};

use super::atomic::{Durability, write_atomic_as};

/// Metadata key: the phaselens version that wrote the table.
pub const META_VERSION: &str = "phaselens.version";
/// Metadata key: the full text of the experiment TOML that produced the table.
pub const META_EXPERIMENT_TOML: &str = "phaselens.experiment_toml";
/// Metadata key: the table's name (the [`Table::name`]).
pub const META_TABLE: &str = "phaselens.table";
/// Metadata key: the documented schema the table follows (e.g. `long/v1`).
pub const META_SCHEMA: &str = "phaselens.schema";

/// The phaselens version recorded in [`META_VERSION`].
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Errors of table building, writing and reading. Each names the file and, where
/// relevant, the column.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// Filesystem error on `path`.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Arrow encoding or decoding failed.
    #[error("{path}: arrow: {source}")]
    Arrow {
        /// The file.
        path: PathBuf,
        /// The Arrow error.
        #[source]
        source: ArrowError,
    },
    /// Polars failed to read or write.
    #[error("{path}: polars: {source}")]
    Polars {
        /// The file.
        path: PathBuf,
        /// The polars error.
        #[source]
        source: polars::error::PolarsError,
    },
    /// A column is absent.
    #[error("{file}: no column `{column}` in table `{table}`")]
    MissingColumn {
        /// Table name.
        table: String,
        /// Column name.
        column: String,
        /// Source file, or `<memory>`.
        file: String,
    },
    /// A column has another type than expected.
    #[error("{file}: column `{column}` of table `{table}` is {found}, expected {expected}")]
    WrongType {
        /// Table name.
        table: String,
        /// Column name.
        column: String,
        /// Source file, or `<memory>`.
        file: String,
        /// Expected type.
        expected: String,
        /// Actual type.
        found: String,
    },
    /// A column whose length differs from the table's row count.
    #[error("column `{column}` of table `{table}` has {len} rows, the table has {rows}")]
    RowCount {
        /// Table name.
        table: String,
        /// Column name.
        column: String,
        /// Column length.
        len: usize,
        /// Table row count.
        rows: usize,
    },
    /// Two columns with one name.
    #[error("table `{table}` already has a column `{column}`")]
    DuplicateColumn {
        /// Table name.
        table: String,
        /// Column name.
        column: String,
    },
    /// A null in a column that must not have one.
    #[error("{file}: column `{column}` of table `{table}` has a null at row {row}")]
    UnexpectedNull {
        /// Table name.
        table: String,
        /// Column name.
        column: String,
        /// Source file, or `<memory>`.
        file: String,
        /// Row index.
        row: usize,
    },
    /// A value outside the allowed set (e.g. `head_kind` not `query`/`kv`).
    #[error("{file}: column `{column}` of table `{table}` row {row}: {reason}")]
    InvalidValue {
        /// Table name.
        table: String,
        /// Column name.
        column: String,
        /// Source file, or `<memory>`.
        file: String,
        /// Row index.
        row: usize,
        /// What is wrong.
        reason: String,
    },
    /// Shards to merge whose schemas differ.
    #[error("{path}: schema differs from the first shard {first}: {reason}")]
    SchemaMismatch {
        /// The differing shard.
        path: PathBuf,
        /// The first shard.
        first: PathBuf,
        /// The difference.
        reason: String,
    },
}

/// Result alias of table functions.
pub type Result<T, E = TableError> = std::result::Result<T, E>;

/// The column types a [`Table`] supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ColumnType {
    /// UTF-8 string.
    Utf8,
    /// Signed 64-bit integer.
    Int64,
    /// Unsigned 64-bit integer.
    UInt64,
    /// 64-bit float.
    Float64,
    /// Boolean.
    Boolean,
}

impl ColumnType {
    /// The Arrow data type.
    pub fn arrow_type(self) -> DataType {
        match self {
            Self::Utf8 => DataType::Utf8,
            Self::Int64 => DataType::Int64,
            Self::UInt64 => DataType::UInt64,
            Self::Float64 => DataType::Float64,
            Self::Boolean => DataType::Boolean,
        }
    }
}

impl std::fmt::Display for ColumnType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Utf8 => "Utf8",
            Self::Int64 => "Int64",
            Self::UInt64 => "UInt64",
            Self::Float64 => "Float64",
            Self::Boolean => "Boolean",
        })
    }
}

/// The values of one column (`None` = null).
#[derive(Debug, Clone, PartialEq)]
pub enum ColumnData {
    /// Strings.
    Utf8(Vec<Option<String>>),
    /// Signed integers.
    Int64(Vec<Option<i64>>),
    /// Unsigned integers.
    UInt64(Vec<Option<u64>>),
    /// Floats.
    Float64(Vec<Option<f64>>),
    /// Booleans.
    Boolean(Vec<Option<bool>>),
}

impl ColumnData {
    /// The column's type.
    pub fn column_type(&self) -> ColumnType {
        match self {
            Self::Utf8(_) => ColumnType::Utf8,
            Self::Int64(_) => ColumnType::Int64,
            Self::UInt64(_) => ColumnType::UInt64,
            Self::Float64(_) => ColumnType::Float64,
            Self::Boolean(_) => ColumnType::Boolean,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Self::Utf8(v) => v.len(),
            Self::Int64(v) => v.len(),
            Self::UInt64(v) => v.len(),
            Self::Float64(v) => v.len(),
            Self::Boolean(v) => v.len(),
        }
    }

    /// Whether the column has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn to_arrow(&self) -> ArrayRef {
        match self {
            Self::Utf8(v) => Arc::new(v.iter().map(|s| s.as_deref()).collect::<StringArray>()),
            Self::Int64(v) => Arc::new(Int64Array::from(v.clone())),
            Self::UInt64(v) => Arc::new(UInt64Array::from(v.clone())),
            Self::Float64(v) => Arc::new(Float64Array::from(v.clone())),
            Self::Boolean(v) => Arc::new(BooleanArray::from(v.clone())),
        }
    }

    /// Converts an Arrow array, widening compatible types (Int8..Int32 to Int64,
    /// UInt8..UInt32 to UInt64, Float16/32 to Float64, LargeUtf8/Utf8View to Utf8).
    fn from_arrow(array: &dyn Array) -> Option<Self> {
        use arrow::compute::cast;
        let target = match array.data_type() {
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => DataType::Utf8,
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => DataType::Int64,
            DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
                DataType::UInt64
            }
            DataType::Float16 | DataType::Float32 | DataType::Float64 => DataType::Float64,
            DataType::Boolean => DataType::Boolean,
            _ => return None,
        };
        let array = cast(array, &target).ok()?;
        let any = array.as_any();
        Some(match target {
            DataType::Utf8 => {
                let a = any.downcast_ref::<StringArray>()?;
                Self::Utf8(a.iter().map(|s| s.map(str::to_owned)).collect())
            }
            DataType::Int64 => Self::Int64(any.downcast_ref::<Int64Array>()?.iter().collect()),
            DataType::UInt64 => Self::UInt64(any.downcast_ref::<UInt64Array>()?.iter().collect()),
            DataType::Float64 => {
                Self::Float64(any.downcast_ref::<Float64Array>()?.iter().collect())
            }
            _ => Self::Boolean(any.downcast_ref::<BooleanArray>()?.iter().collect()),
        })
    }

    fn append(&mut self, other: ColumnData) -> std::result::Result<(), ColumnType> {
        match (self, other) {
            (Self::Utf8(a), Self::Utf8(b)) => a.extend(b),
            (Self::Int64(a), Self::Int64(b)) => a.extend(b),
            (Self::UInt64(a), Self::UInt64(b)) => a.extend(b),
            (Self::Float64(a), Self::Float64(b)) => a.extend(b),
            (Self::Boolean(a), Self::Boolean(b)) => a.extend(b),
            (_, b) => return Err(b.column_type()),
        }
        Ok(())
    }
}

macro_rules! column_from {
    ($variant:ident, $t:ty) => {
        impl From<Vec<$t>> for ColumnData {
            fn from(v: Vec<$t>) -> Self {
                Self::$variant(v.into_iter().map(Some).collect())
            }
        }
        impl From<Vec<Option<$t>>> for ColumnData {
            fn from(v: Vec<Option<$t>>) -> Self {
                Self::$variant(v)
            }
        }
    };
}
column_from!(Utf8, String);
column_from!(Int64, i64);
column_from!(UInt64, u64);
column_from!(Float64, f64);
column_from!(Boolean, bool);

impl From<Vec<&str>> for ColumnData {
    fn from(v: Vec<&str>) -> Self {
        Self::Utf8(v.into_iter().map(|s| Some(s.to_owned())).collect())
    }
}

/// A named column.
#[derive(Debug, Clone, PartialEq)]
pub struct Column {
    /// Column name.
    pub name: String,
    /// Values.
    pub data: ColumnData,
}

/// A named table of typed columns with schema-level metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    name: String,
    columns: Vec<Column>,
    metadata: BTreeMap<String, String>,
    source: Option<PathBuf>,
}

macro_rules! typed_getter {
    ($(#[$doc:meta])* $fn:ident, $variant:ident, $t:ty) => {
        $(#[$doc])*
        pub fn $fn(&self, name: &str) -> Result<&[Option<$t>]> {
            match &self.get(name)?.data {
                ColumnData::$variant(v) => Ok(v),
                other => Err(self.wrong_type(name, ColumnType::$variant, other.column_type())),
            }
        }
    };
}

impl Table {
    /// An empty table (no columns, no rows, no metadata).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            columns: Vec::new(),
            metadata: BTreeMap::new(),
            source: None,
        }
    }

    /// The table's name (stored as [`META_TABLE`] when written).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file this table was read from, if any.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// Adds (or replaces) a metadata entry, builder style.
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.set_metadata(key, value);
        self
    }

    /// Adds (or replaces) a metadata entry.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// Records provenance: [`META_VERSION`] and [`META_EXPERIMENT_TOML`].
    pub fn with_provenance(self, experiment_toml: &str) -> Self {
        self.with_metadata(META_VERSION, VERSION)
            .with_metadata(META_EXPERIMENT_TOML, experiment_toml)
    }

    /// The metadata (sorted by key).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Appends a column; builder style.
    ///
    /// # Errors
    /// Duplicate name or a length different from the existing columns'.
    pub fn with_column(
        mut self,
        name: impl Into<String>,
        data: impl Into<ColumnData>,
    ) -> Result<Self> {
        self.add_column(name, data)?;
        Ok(self)
    }

    /// Appends a column.
    ///
    /// # Errors
    /// Duplicate name or a length different from the existing columns'.
    pub fn add_column(
        &mut self,
        name: impl Into<String>,
        data: impl Into<ColumnData>,
    ) -> Result<()> {
        let name = name.into();
        let data = data.into();
        if self.columns.iter().any(|c| c.name == name) {
            return Err(TableError::DuplicateColumn {
                table: self.name.clone(),
                column: name,
            });
        }
        if let Some(first) = self.columns.first()
            && first.data.len() != data.len()
        {
            return Err(TableError::RowCount {
                table: self.name.clone(),
                column: name,
                len: data.len(),
                rows: first.data.len(),
            });
        }
        self.columns.push(Column { name, data });
        Ok(())
    }

    /// Number of rows (0 without columns).
    pub fn num_rows(&self) -> usize {
        self.columns.first().map_or(0, |c| c.data.len())
    }

    /// The columns in order.
    pub fn columns(&self) -> &[Column] {
        &self.columns
    }

    /// Column names in order.
    pub fn column_names(&self) -> Vec<&str> {
        self.columns.iter().map(|c| c.name.as_str()).collect()
    }

    /// `(name, type)` of every column, in order.
    pub fn column_types(&self) -> Vec<(&str, ColumnType)> {
        self.columns
            .iter()
            .map(|c| (c.name.as_str(), c.data.column_type()))
            .collect()
    }

    fn file_label(&self) -> String {
        self.source
            .as_ref()
            .map_or_else(|| "<memory>".to_owned(), |p| p.display().to_string())
    }

    /// The column `name`.
    ///
    /// # Errors
    /// [`TableError::MissingColumn`] naming the table and file.
    pub fn get(&self, name: &str) -> Result<&Column> {
        self.columns
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| TableError::MissingColumn {
                table: self.name.clone(),
                column: name.to_owned(),
                file: self.file_label(),
            })
    }

    fn wrong_type(&self, column: &str, expected: ColumnType, found: ColumnType) -> TableError {
        TableError::WrongType {
            table: self.name.clone(),
            column: column.to_owned(),
            file: self.file_label(),
            expected: expected.to_string(),
            found: found.to_string(),
        }
    }

    /// Error for a null at `row` of `column` (used by typed row readers).
    pub(crate) fn null_error(&self, column: &str, row: usize) -> TableError {
        TableError::UnexpectedNull {
            table: self.name.clone(),
            column: column.to_owned(),
            file: self.file_label(),
            row,
        }
    }

    /// Error for an invalid value at `row` of `column`.
    pub(crate) fn value_error(&self, column: &str, row: usize, reason: String) -> TableError {
        TableError::InvalidValue {
            table: self.name.clone(),
            column: column.to_owned(),
            file: self.file_label(),
            row,
            reason,
        }
    }

    typed_getter!(
        /// The `Utf8` column `name`.
        ///
        /// # Errors
        /// Missing column or another type.
        utf8, Utf8, String);
    typed_getter!(
        /// The `Int64` column `name`.
        ///
        /// # Errors
        /// Missing column or another type.
        int64, Int64, i64);
    typed_getter!(
        /// The `UInt64` column `name`.
        ///
        /// # Errors
        /// Missing column or another type.
        uint64, UInt64, u64);
    typed_getter!(
        /// The `Float64` column `name`.
        ///
        /// # Errors
        /// Missing column or another type.
        float64, Float64, f64);
    typed_getter!(
        /// The `Boolean` column `name`.
        ///
        /// # Errors
        /// Missing column or another type.
        boolean, Boolean, bool);

    /// The Arrow schema: one nullable field per column, the metadata plus
    /// [`META_TABLE`].
    pub fn schema(&self) -> Schema {
        let fields: Vec<Field> = self
            .columns
            .iter()
            .map(|c| Field::new(&c.name, c.data.column_type().arrow_type(), true))
            .collect();
        let mut metadata: HashMap<String, String> = self
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        metadata.insert(META_TABLE.to_owned(), self.name.clone());
        Schema::new_with_metadata(fields, metadata)
    }

    /// The table as one Arrow record batch.
    ///
    /// # Errors
    /// Arrow errors (not expected for a table built through this API).
    pub fn to_record_batch(&self) -> std::result::Result<RecordBatch, ArrowError> {
        let arrays: Vec<ArrayRef> = self.columns.iter().map(|c| c.data.to_arrow()).collect();
        RecordBatch::try_new_with_options(
            Arc::new(self.schema()),
            arrays,
            &RecordBatchOptions::new().with_row_count(Some(self.num_rows())),
        )
    }

    /// Writes the table to `path` as an Arrow IPC file, atomically (temporary file
    /// in the same directory, fsync, rename). Parent directories are created.
    ///
    /// # Errors
    /// I/O or Arrow errors naming `path`; on error `path` is unchanged.
    pub fn write_arrow(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_arrow_as(path, Durability::Synced)
    }

    /// [`Table::write_arrow`] with the fsyncs that `durability` asks for
    /// ([`Durability::Unsynced`]: atomic and safe against `kill -9`, not against a
    /// crash of the machine; for caches that validate what they read).
    ///
    /// # Errors
    /// I/O or Arrow errors naming `path`; on error `path` is unchanged.
    pub fn write_arrow_as(&self, path: impl AsRef<Path>, durability: Durability) -> Result<()> {
        let path = path.as_ref();
        let arrow_err = |source| TableError::Arrow {
            path: path.to_path_buf(),
            source,
        };
        let batch = self.to_record_batch().map_err(arrow_err)?;
        let io_err = |source| TableError::Io {
            path: path.to_path_buf(),
            source,
        };
        write_atomic_as(
            path,
            |file: &mut File| -> Result<()> {
                let mut writer =
                    FileWriter::try_new_buffered(&mut *file, &batch.schema()).map_err(arrow_err)?;
                writer.write(&batch).map_err(arrow_err)?;
                writer.finish().map_err(arrow_err)?;
                writer
                    .into_inner()
                    .map_err(arrow_err)?
                    .into_inner()
                    .map_err(|e| io_err(e.into_error()))?;
                Ok(())
            },
            io_err,
            durability,
        )
    }

    /// Reads an Arrow IPC file written by [`Table::write_arrow`] (or any IPC file
    /// whose columns have supported types). The name comes from [`META_TABLE`], else
    /// the file stem; [`META_TABLE`] is not kept in [`Table::metadata`].
    ///
    /// # Errors
    /// I/O, Arrow, or [`TableError::WrongType`] for an unsupported column type.
    pub fn read_arrow(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io_err = |source| TableError::Io {
            path: path.to_path_buf(),
            source,
        };
        let arrow_err = |source| TableError::Arrow {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let reader = FileReader::try_new_buffered(file, None).map_err(arrow_err)?;
        let schema = reader.schema();
        let mut metadata: BTreeMap<String, String> = schema
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let name = metadata.remove(META_TABLE).unwrap_or_else(|| {
            path.file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned())
        });
        let mut table = Table {
            name,
            columns: Vec::new(),
            metadata,
            source: Some(path.to_path_buf()),
        };
        let mut data: Vec<Option<ColumnData>> = vec![None; schema.fields().len()];
        for batch in reader {
            let batch = batch.map_err(arrow_err)?;
            for (i, field) in schema.fields().iter().enumerate() {
                let col = ColumnData::from_arrow(batch.column(i).as_ref())
                    .ok_or_else(|| table.unsupported(field))?;
                match &mut data[i] {
                    Some(existing) => existing.append(col).map_err(|_| table.unsupported(field))?,
                    slot => *slot = Some(col),
                }
            }
        }
        for (field, col) in schema.fields().iter().zip(data) {
            let col = match col {
                Some(c) => c,
                // A file without batches: empty columns of the schema's type.
                None => ColumnData::from_arrow(
                    arrow::array::new_empty_array(field.data_type()).as_ref(),
                )
                .ok_or_else(|| table.unsupported(field))?,
            };
            table.columns.push(Column {
                name: field.name().clone(),
                data: col,
            });
        }
        Ok(table)
    }

    fn unsupported(&self, field: &Field) -> TableError {
        TableError::WrongType {
            table: self.name.clone(),
            column: field.name().clone(),
            file: self.file_label(),
            expected: "one of Utf8, Int64, UInt64, Float64, Boolean".into(),
            found: field.data_type().to_string(),
        }
    }

    /// Appends the rows of `other`, which must have the same column names and types
    /// in the same order. Metadata of `self` is kept.
    ///
    /// # Errors
    /// [`TableError::SchemaMismatch`] describing the first difference.
    pub fn append(&mut self, other: Table) -> Result<()> {
        let mismatch = |reason: String| TableError::SchemaMismatch {
            path: other
                .source
                .clone()
                .unwrap_or_else(|| other.name.clone().into()),
            first: self
                .source
                .clone()
                .unwrap_or_else(|| self.name.clone().into()),
            reason,
        };
        if self.column_types() != other.column_types() {
            let reason = format!(
                "columns {:?} vs {:?}",
                other.column_types(),
                self.column_types()
            );
            return Err(mismatch(reason));
        }
        for (mine, theirs) in self.columns.iter_mut().zip(other.columns) {
            mine.data
                .append(theirs.data)
                .expect("column types were checked to match");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Table {
        Table::new("sample")
            .with_provenance("[experiment]\nname = \"t\"\n")
            .with_column("name", vec!["a", "b", "c"])
            .unwrap()
            .with_column("i", vec![Some(-1i64), None, Some(3)])
            .unwrap()
            .with_column("u", vec![1u64, 2, 3])
            .unwrap()
            .with_column("x", vec![Some(0.5), Some(f64::NAN), None])
            .unwrap()
            .with_column("ok", vec![true, false, true])
            .unwrap()
    }

    #[test]
    fn round_trip_with_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/sample.arrow");
        let t = sample();
        t.write_arrow(&path).unwrap();
        let back = Table::read_arrow(&path).unwrap();
        assert_eq!(back.name(), "sample");
        assert_eq!(back.source(), Some(path.as_path()));
        assert_eq!(back.metadata(), t.metadata());
        assert_eq!(back.metadata()[META_VERSION], VERSION);
        assert_eq!(
            back.metadata()[META_EXPERIMENT_TOML],
            "[experiment]\nname = \"t\"\n"
        );
        assert_eq!(back.column_types(), t.column_types());
        assert_eq!(back.utf8("name").unwrap()[1].as_deref(), Some("b"));
        assert_eq!(back.int64("i").unwrap(), &[Some(-1), None, Some(3)]);
        assert_eq!(back.uint64("u").unwrap(), &[Some(1), Some(2), Some(3)]);
        let x = back.float64("x").unwrap();
        assert_eq!(x[0], Some(0.5));
        assert!(x[1].unwrap().is_nan());
        assert_eq!(x[2], None);
        assert_eq!(
            back.boolean("ok").unwrap(),
            &[Some(true), Some(false), Some(true)]
        );
    }

    #[test]
    fn errors_name_file_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.arrow");
        sample().write_arrow(&path).unwrap();
        let back = Table::read_arrow(&path).unwrap();
        let err = back.float64("name").unwrap_err().to_string();
        assert!(
            err.contains("s.arrow") && err.contains("`name`") && err.contains("Utf8"),
            "{err}"
        );
        let err = back.float64("nope").unwrap_err().to_string();
        assert!(err.contains("s.arrow") && err.contains("`nope`"), "{err}");
        let err = Table::read_arrow(dir.path().join("missing.arrow"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.arrow"), "{err}");
    }

    #[test]
    fn builder_validation() {
        let t = Table::new("t").with_column("a", vec![1i64, 2]).unwrap();
        assert!(matches!(
            t.clone().with_column("b", vec![1i64]),
            Err(TableError::RowCount { .. })
        ));
        assert!(matches!(
            t.with_column("a", vec![3i64, 4]),
            Err(TableError::DuplicateColumn { .. })
        ));
    }

    #[test]
    fn empty_table_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.arrow");
        let t = Table::new("e")
            .with_column("a", ColumnData::Float64(vec![]))
            .unwrap();
        t.write_arrow(&path).unwrap();
        let back = Table::read_arrow(&path).unwrap();
        assert_eq!(back.num_rows(), 0);
        assert_eq!(back.column_types(), vec![("a", ColumnType::Float64)]);
    }

    #[test]
    fn failed_write_leaves_no_partial_file() {
        let dir = tempfile::tempdir().unwrap();
        // The target is an existing directory: rename fails after the data was written.
        let target = dir.path().join("taken.arrow");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("keep"), b"x").unwrap();
        let err = sample().write_arrow(&target).unwrap_err();
        assert!(err.to_string().contains("taken.arrow"), "{err}");
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["taken.arrow".to_owned()]);
        // And an existing good file survives a failed overwrite.
        let good = dir.path().join("good.arrow");
        sample().write_arrow(&good).unwrap();
        let before = std::fs::read(&good).unwrap();
        let bad = Table::new("bad").with_column("a", vec![1i64]).unwrap();
        let unwritable = good.join("child.arrow"); // parent is a file
        assert!(bad.write_arrow(&unwritable).is_err());
        assert_eq!(std::fs::read(&good).unwrap(), before);
    }

    #[test]
    fn append_checks_schema() {
        let mut a = sample();
        a.append(sample()).unwrap();
        assert_eq!(a.num_rows(), 6);
        let other = Table::new("o").with_column("name", vec!["z"]).unwrap();
        assert!(matches!(
            a.append(other),
            Err(TableError::SchemaMismatch { .. })
        ));
    }
}
