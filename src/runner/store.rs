//! Resume bookkeeping: finished chunks are persisted as small shard tables.
//!
//! Every chunk of cells (and the base run of each prompt batch) is written, as soon
//! as it is computed, to `notebooks-data/<experiment>/shards/<run hash>/<key>.arrow`
//! through the output module's atomic table writer. The run hash (of the experiment
//! settings, the model identity and the phaselens version) names the folder and is
//! stored in each shard's metadata; a rerun loads the shards of its own hash instead
//! of recomputing them.
//!
//! Shards are written atomically (temporary file, rename) but without fsyncs
//! ([`Durability::Unsynced`]): a killed run (`kill -9`, Ctrl-C) loses no finished shard,
//! since the renamed file lives in the kernel's page cache; a crash of the machine can
//! leave a recent shard missing, empty or truncated, and [`Store::load`] recomputes
//! every shard that does not read back complete, with this run's hash and the expected
//! outcomes. Two fsyncs per shard (248 shards for edge attribution at every position)
//! had made such runs 0.85-0.94x as fast (issue 45). The tables a run ends with are
//! written with fsyncs.
//!
//! Shards are never deleted by a run: a run with other settings writes to its own
//! folder and leaves the finished shards of every other settings hash alone, so
//! editing an experiment (even into one that a later check rejects) and editing it
//! back resumes where the first run stopped. `--fresh` ignores the shards of its own
//! hash and overwrites them as it recomputes. Old folders are deleted by hand
//! (`rm -r notebooks-data/<experiment>/shards/<hash>`); [`other_settings`] lists them.

use std::path::{Path, PathBuf};

use sha2::Digest;

use crate::error::{Error, Result};
use crate::output::{ColumnData, Durability, Table};

use super::patching::Outcome;

/// Schema metadata key of a shard's run hash.
pub const META_RUN_HASH: &str = "phaselens.run_hash";

/// The shard folder of one experiment run.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    hash: String,
    /// Ignore stored shards (they are overwritten as chunks are recomputed).
    fresh: bool,
    /// `--shard i/N`: this process computes only the shards it owns ([`Store::owns`]).
    part: Option<(usize, usize)>,
}

/// The shard folders of other settings under `root` that hold shards (and shards of the
/// layout before per-hash folders, directly in `root`): `(folder or file, number of
/// shards)`.
pub fn other_settings(root: &Path, hash: &str) -> Vec<(PathBuf, usize)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return out;
    };
    let mut loose = 0;
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if e.file_name().to_string_lossy() != hash {
                // A folder without a shard (a run stopped by a check before any
                // compute) holds no work.
                let n = crate::output::committed_files(&p, "arrow").map_or(0, |v| v.len());
                if n > 0 {
                    out.push((p, n));
                }
            }
        } else if !crate::output::is_temp_name(&e.file_name().to_string_lossy())
            && p.extension().is_some_and(|x| x == "arrow")
        {
            loose += 1;
        }
    }
    out.sort();
    if loose > 0 {
        out.push((root.to_path_buf(), loose));
    }
    out
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
                .filter(|e| !crate::output::is_temp_name(&e.file_name().to_string_lossy()))
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
    /// Open the shard folder of the run `hash` under `root`
    /// (`notebooks-data/<experiment>/shards`). Nothing is removed: `fresh` makes
    /// [`Store::load`] find nothing, so every chunk is recomputed and its shard
    /// overwritten (atomically) when it is saved.
    pub fn open(root: &Path, hash: &str, fresh: bool) -> Result<Self> {
        if hash.is_empty() || !hash.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(Error::Other(format!(
                "run hash `{hash}` is not a plain folder name"
            )));
        }
        let dir = root.join(hash);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(Store {
            dir,
            hash: hash.to_string(),
            fresh,
            part: None,
        })
    }

    /// Compute only the shards of part `i` of `n` (`--shard i/N`): the others are
    /// left to the other parts; a later run without a part loads them all.
    pub fn with_part(mut self, part: Option<(usize, usize)>) -> Self {
        self.part = part;
        self
    }

    /// Whether this process computes shard `key`: always without a part; with part
    /// `i/N`, when a hash of the key (FNV-1a, stable across machines and runs) is `i`
    /// modulo `N`.
    pub fn owns(&self, key: &str) -> bool {
        let Some((i, n)) = self.part else {
            return true;
        };
        let mut h: u64 = 0xcbf29ce484222325;
        for b in key.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100000001b3);
        }
        (h % n as u64) as usize == i
    }

    /// Whether this process computes only some shards (`--shard i/N`).
    pub fn partial(&self) -> bool {
        self.part.is_some()
    }

    /// The folder of this run's shards.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.arrow"))
    }

    /// The outcomes stored under `key`, if a complete shard with the expected number
    /// of outcomes per cell exists.
    pub fn load(&self, key: &str, expected: &[usize]) -> Result<Option<Vec<Vec<Outcome>>>> {
        let path = self.path(key);
        if self.fresh || !path.exists() {
            return Ok(None);
        }
        // A shard that does not read (a foreign or damaged file) is recomputed and
        // replaced, never trusted.
        let Ok(t) = Table::read_arrow(&path) else {
            return Ok(None);
        };
        if t.metadata().get(META_RUN_HASH) != Some(&self.hash) {
            return Ok(None);
        }
        let (Ok(cell), Ok(correct), Ok(ld)) =
            (t.int64("cell"), t.boolean("correct"), t.float64("ld"))
        else {
            return Ok(None);
        };
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

    /// Persist the outcomes of `key` (atomic write, no fsync: see the module doc).
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
        Ok(t.write_arrow_as(self.path(key), Durability::Unsynced)?)
    }

    /// Number of shard files of this run present.
    pub fn count(&self) -> usize {
        crate::output::committed_files(&self.dir, "arrow").map_or(0, |v| v.len())
    }
}
