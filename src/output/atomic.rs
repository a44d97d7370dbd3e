//! Atomic file writes: write to a temporary file in the destination's directory,
//! fsync it, rename it over the destination, then fsync the directory. Readers see
//! either the old file or the complete new one, never a partial write; on error the
//! temporary file is removed.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary file next to `target` that is deleted on drop unless
/// [`TempFile::commit`] renamed it into place.
#[derive(Debug)]
pub struct TempFile {
    path: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl TempFile {
    /// Reserves a fresh temporary path in `target`'s directory. The temporary name
    /// is hidden (`.name.tmp-<pid>-<n>`) and keeps `target`'s extension, so
    /// writers that pick a format from the extension (the PNG encoder) still work.
    /// The directory is created if missing.
    pub fn for_target(target: &Path) -> io::Result<Self> {
        let dir = parent_dir(target);
        fs::create_dir_all(&dir)?;
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?
            .to_string_lossy()
            .into_owned();
        let ext = target
            .extension()
            .map(|e| format!(".{}", e.to_string_lossy()))
            .unwrap_or_default();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(".{name}.tmp-{}-{n}{ext}", std::process::id()));
        Ok(Self {
            path,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    /// The temporary path to write to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fsyncs the temporary file, renames it onto the target and fsyncs the
    /// directory (best effort on platforms where directories cannot be opened).
    pub fn commit(mut self) -> io::Result<()> {
        File::open(&self.path)?.sync_all()?;
        fs::rename(&self.path, &self.target)?;
        self.committed = true;
        if let Ok(dir) = File::open(parent_dir(&self.target)) {
            let _ = dir.sync_all();
        }
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Atomically replaces `target` with what `write` produces. `write` receives the
/// open temporary file; if it fails (or any step does) `target` is untouched and
/// no temporary file is left behind. `io_err` converts the I/O errors of the
/// surrounding steps (creating, syncing, renaming) into the caller's error type.
pub fn write_atomic<E>(
    target: &Path,
    write: impl FnOnce(&mut File) -> Result<(), E>,
    io_err: impl Fn(io::Error) -> E,
) -> Result<(), E> {
    let tmp = TempFile::for_target(target).map_err(&io_err)?;
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp.path())
        .map_err(&io_err)?;
    write(&mut file)?;
    file.flush().map_err(&io_err)?;
    drop(file);
    tmp.commit().map_err(&io_err)
}

/// Atomically writes `bytes` to `target`.
pub fn write_bytes_atomic(target: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic(target, |f| f.write_all(bytes), |e| e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect()
    }

    #[test]
    fn replaces_content() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("sub/a.txt");
        write_bytes_atomic(&target, b"one").unwrap();
        write_bytes_atomic(&target, b"two").unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"two");
        assert!(leftovers(&dir.path().join("sub")).is_empty());
    }

    #[test]
    fn failure_keeps_old_file_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a.txt");
        write_bytes_atomic(&target, b"old").unwrap();
        let res: io::Result<()> = write_atomic(
            &target,
            |f| {
                f.write_all(b"partial")?;
                Err(io::Error::other("boom"))
            },
            |e| e,
        );
        assert!(res.is_err());
        assert_eq!(fs::read(&target).unwrap(), b"old");
        assert!(leftovers(dir.path()).is_empty());
    }

    #[test]
    fn temp_name_keeps_extension() {
        let dir = tempfile::tempdir().unwrap();
        let t = TempFile::for_target(&dir.path().join("fig.png")).unwrap();
        let name = t.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(".fig.png.tmp-") && name.ends_with(".png"),
            "{name}"
        );
    }
}
