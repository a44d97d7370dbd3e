//! Polars views of the Arrow tables: load a `.arrow` as a DataFrame and write a
//! Parquet copy next to it.

use std::fs::File;
use std::path::{Path, PathBuf};

use polars::prelude::{
    DataFrame, IpcReader, KeyValueMetadata, ParquetCompression, ParquetWriter, SerReader,
};

use super::atomic::write_atomic;
use super::table::{Result, Table, TableError};

/// Reads an Arrow IPC file into a polars DataFrame (strings become polars
/// `String`, integer and float types are kept).
///
/// # Errors
/// I/O or polars errors naming `path`.
pub fn read_dataframe(path: impl AsRef<Path>) -> Result<DataFrame> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|source| TableError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    IpcReader::new(file)
        .finish()
        .map_err(|source| TableError::Polars {
            path: path.to_path_buf(),
            source,
        })
}

/// The Parquet path that belongs to an Arrow path: same directory and stem,
/// extension `.parquet`.
pub fn parquet_path(arrow_path: impl AsRef<Path>) -> PathBuf {
    arrow_path.as_ref().with_extension("parquet")
}

/// Writes `<stem>.parquet` next to the Arrow file `arrow_path` (uncompressed, so
/// any Parquet reader can open it), atomically. The table's schema metadata
/// (version, experiment TOML, ...) is copied into the Parquet key/value metadata.
/// Returns the Parquet path.
///
/// # Errors
/// I/O, Arrow or polars errors naming the file.
pub fn write_parquet_copy(arrow_path: impl AsRef<Path>) -> Result<PathBuf> {
    let arrow_path = arrow_path.as_ref();
    let mut df = read_dataframe(arrow_path)?;
    let table = Table::read_arrow(arrow_path)?;
    let mut kv: Vec<(String, String)> = table
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    kv.push((super::table::META_TABLE.to_owned(), table.name().to_owned()));
    let out = parquet_path(arrow_path);
    let polars_err = |source| TableError::Polars {
        path: out.clone(),
        source,
    };
    write_atomic(
        &out,
        |file| {
            ParquetWriter::new(file)
                .with_compression(ParquetCompression::Uncompressed)
                .with_key_value_metadata(Some(KeyValueMetadata::from_static(kv)))
                .finish(&mut df)
                .map(drop)
                .map_err(polars_err)
        },
        |source| TableError::Io {
            path: out.clone(),
            source,
        },
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use polars::prelude::*;

    fn shard(name: &str, values: Vec<f64>) -> Table {
        let n = values.len();
        Table::new("long")
            .with_provenance("k = 1")
            .with_column("model", vec![name.to_owned(); n])
            .unwrap()
            .with_column("phase", (0..n as i64).map(Some).collect::<Vec<_>>())
            .unwrap()
            .with_column("value", values)
            .unwrap()
    }

    #[test]
    fn polars_reads_arrow_and_writes_parquet() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.arrow");
        shard("m", vec![0.25, 0.5, 0.75])
            .write_arrow(&path)
            .unwrap();
        let df = read_dataframe(&path).unwrap();
        assert_eq!(df.height(), 3);
        assert_eq!(df.width(), 3);
        let ca = df.column("value").unwrap().f64().unwrap();
        let values: Vec<Option<f64>> = (0..3).map(|i| ca.get(i)).collect();
        assert_eq!(values, vec![Some(0.25), Some(0.5), Some(0.75)]);
        assert_eq!(df.column("model").unwrap().dtype(), &DataType::String);
        assert_eq!(df.column("phase").unwrap().dtype(), &DataType::Int64);

        let pq = write_parquet_copy(&path).unwrap();
        assert_eq!(pq, dir.path().join("t.parquet"));
        let back = ParquetReader::new(File::open(&pq).unwrap())
            .finish()
            .unwrap();
        assert!(back.equals_missing(&df));
        let leftovers = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains(".tmp-")
            })
            .count();
        assert_eq!(leftovers, 0);
    }
}
