//! Resume bookkeeping: finished chunks are persisted as small shard tables.
//!
//! Every chunk of cells (and the base run of each prompt batch) is written, as soon
//! as it is computed, to `notebooks-data/<experiment>/shards/<key>.arrow` through the
//! output module's atomic table writer. Each shard carries the run hash (experiment
//! settings + model identity + phaselens version) in its metadata; a rerun loads the
//! shards whose hash matches instead of recomputing them, and removes the ones that
//! belong to another configuration.

use std::path::{Path, PathBuf};

use sha2::Digest;

use crate::error::{Error, Result};
use crate::output::{ColumnData, Table};

use super::patching::Outcome;

/// Schema metadata key of a shard's run hash.
pub const META_RUN_HASH: &str = "phaselens.run_hash";

/// The shard folder of one experiment run.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    hash: String,
}

/// A short hash identifying what a run computes: the experiment settings (the
/// parsed file, so comments and formatting do not matter; the description and the
/// bootstrap settings are left out because shards hold raw outcomes), every model's
/// config and weight-file size and mtime, and the phaselens version.
pub fn run_hash(settings: &serde_json::Value, model_dirs: &[&Path]) -> String {
    let mut h = sha2::Sha256::new();
    h.update(settings.to_string().as_bytes());
    for dir in model_dirs {
        // The same model reached through `exp/` or `experiments/` is the same model.
        let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        h.update(canonical.to_string_lossy().as_bytes());
        if let Ok(text) = std::fs::read(dir.join("config.json")) {
            h.update(&text);
        }
        if let Ok(entries) = std::fs::read_dir(dir) {
            let mut files: Vec<_> = entries
                .flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort_by_key(|e| e.path());
            for e in files {
                if let Ok(m) = e.metadata() {
                    h.update(e.file_name().to_string_lossy().as_bytes());
                    h.update(m.len().to_le_bytes());
                    if let Ok(t) = m.modified()
                        && let Ok(d) = t.duration_since(std::time::UNIX_EPOCH)
                    {
                        h.update(d.as_nanos().to_le_bytes());
                    }
                }
            }
        }
    }
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Store {
    /// Open `dir` for a run with `hash`. `fresh` removes every shard; otherwise shards
    /// of another hash are removed (they belong to another configuration) and the
    /// number of removed shards is returned.
    pub fn open(dir: &Path, hash: &str, fresh: bool) -> Result<(Self, usize)> {
        let mut removed = 0;
        if dir.exists() {
            let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for e in entries.flatten() {
                let p = e.path();
                if p.extension().is_none_or(|x| x != "arrow") {
                    continue;
                }
                let stale = fresh
                    || Table::read_arrow(&p)
                        .map(|t| t.metadata().get(META_RUN_HASH).map(String::as_str) != Some(hash))
                        .unwrap_or(true);
                if stale {
                    std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
                    removed += 1;
                }
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        Ok((
            Store {
                dir: dir.to_path_buf(),
                hash: hash.to_string(),
            },
            removed,
        ))
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.arrow"))
    }

    /// The outcomes stored under `key`, if a complete shard with the expected number
    /// of outcomes per cell exists.
    pub fn load(&self, key: &str, expected: &[usize]) -> Result<Option<Vec<Vec<Outcome>>>> {
        let path = self.path(key);
        if !path.exists() {
            return Ok(None);
        }
        let t = Table::read_arrow(&path)?;
        if t.metadata().get(META_RUN_HASH) != Some(&self.hash) {
            return Ok(None);
        }
        let cell = t.int64("cell")?;
        let correct = t.boolean("correct")?;
        let ld = t.float64("ld")?;
        let mut out: Vec<Vec<Outcome>> = expected.iter().map(|&n| Vec::with_capacity(n)).collect();
        for i in 0..t.num_rows() {
            let c = cell[i].unwrap_or(-1);
            if c < 0 || c as usize >= out.len() {
                return Ok(None);
            }
            out[c as usize].push(Outcome {
                correct: correct[i].unwrap_or(false),
                ld: ld[i].map_or(f32::NAN, |v| v as f32),
            });
        }
        if out.iter().zip(expected).any(|(o, &n)| o.len() != n) {
            return Ok(None);
        }
        Ok(Some(out))
    }

    /// Persist the outcomes of `key` (atomic write).
    pub fn save(&self, key: &str, outcomes: &[Vec<Outcome>]) -> Result<()> {
        let mut cell = Vec::new();
        let mut prompt = Vec::new();
        let mut correct = Vec::new();
        let mut ld = Vec::new();
        for (c, rows) in outcomes.iter().enumerate() {
            for (p, o) in rows.iter().enumerate() {
                cell.push(c as i64);
                prompt.push(p as i64);
                correct.push(o.correct);
                ld.push(o.ld as f64);
            }
        }
        let t = Table::new(key)
            .with_metadata(META_RUN_HASH, self.hash.clone())
            .with_column("cell", ColumnData::from(cell))
            .and_then(|t| t.with_column("prompt", ColumnData::from(prompt)))
            .and_then(|t| t.with_column("correct", ColumnData::from(correct)))
            .and_then(|t| t.with_column("ld", ColumnData::from(ld)))?;
        Ok(t.write_arrow(self.path(key))?)
    }

    /// Number of shard files present.
    pub fn count(&self) -> usize {
        std::fs::read_dir(&self.dir)
            .map(|r| {
                r.flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "arrow"))
                    .count()
            })
            .unwrap_or(0)
    }
}
