//! Atomic file writes: write to a temporary file in the destination's directory,
//! fsync it, rename it over the destination, then fsync the directory. Readers see
//! either the old file or the complete new one, never a partial write; on error the
//! temporary file is removed.
//!
//! A writer killed with `kill -9` cannot remove its temporary file. Those files are
//! hidden and named `.<target name>.tmp-<pid>-<n><ext>` ([`is_temp_name`]): every reader
//! that lists a folder uses [`committed_files`] (never a temporary file, even one that
//! ends in `.arrow`), and runs start with [`clean_stale_temps`], which removes only
//! files of this naming pattern whose writer process is gone.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// How durable an atomic write is. Both are atomic for readers and survive the writer
/// being killed (`kill -9`: the renamed file is in the kernel's page cache); they differ
/// on an operating-system crash or power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Fsync the file before the rename and the directory after it: the new file
    /// survives a crash once the write returns (tables, checkpoints).
    Synced,
    /// No fsync: after a crash the file may be missing, empty or truncated. For caches
    /// whose readers validate every file and recompute what does not read (the runner's
    /// shards, `runner::store`): two fsyncs per file cost more than the data.
    Unsynced,
}

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
    pub fn commit(self) -> io::Result<()> {
        self.commit_as(Durability::Synced)
    }

    /// Renames the temporary file onto the target, with fsyncs as `durability` says.
    pub fn commit_as(mut self, durability: Durability) -> io::Result<()> {
        if durability == Durability::Unsynced {
            fs::rename(&self.path, &self.target)?;
            self.committed = true;
            return Ok(());
        }
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

/// Whether `name` is a temporary file name of this writer:
/// `.<name>.tmp-<pid>-<n>` optionally followed by the target's extension.
pub fn is_temp_name(name: &str) -> bool {
    temp_pid(name).is_some()
}

/// The writer's process id in a temporary file name, if `name` is one.
fn temp_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?;
    let at = rest.rfind(".tmp-")?;
    if at == 0 {
        return None;
    }
    let tail = &rest[at + ".tmp-".len()..];
    let (pid, tail) = tail.split_once('-')?;
    let pid: u32 = pid.parse().ok()?;
    let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    let ext = &tail[digits..];
    // The extension, when present, is the target's own (`.<name>` ends with it).
    if !(ext.is_empty() || ext.starts_with('.') && rest[..at].ends_with(ext)) {
        return None;
    }
    Some(pid)
}

/// Whether process `pid` is alive. Linux reads `/proc`; elsewhere every process is
/// assumed alive (stale temporary files are then left alone: safe, not tidy).
pub fn process_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// Files directly in `dir` whose extension is `ext` (without the dot), skipping the
/// temporary files of interrupted writes; sorted. A missing folder has no files.
pub fn committed_files(dir: &Path, ext: &str) -> io::Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        if is_temp_name(&name) || name.starts_with('.') {
            continue;
        }
        if p.extension().is_some_and(|x| x == ext) && p.is_file() {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// Remove the temporary files that killed writers left in `dir` and its sub-folders
/// (down to `depth` levels): only names of this writer's pattern ([`is_temp_name`])
/// whose process is gone, never any other file. Returns how many were removed.
pub fn clean_stale_temps(dir: &Path, depth: usize) -> io::Result<usize> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for e in entries {
        let e = e?;
        let ty = e.file_type()?;
        let name = e.file_name().to_string_lossy().into_owned();
        if ty.is_dir() {
            if depth > 0 {
                removed += clean_stale_temps(&e.path(), depth - 1)?;
            }
            continue;
        }
        if ty.is_file()
            && let Some(pid) = temp_pid(&name)
            && !process_alive(pid)
        {
            match fs::remove_file(e.path()) {
                Ok(()) => removed += 1,
                Err(x) if x.kind() == io::ErrorKind::NotFound => {}
                Err(x) => return Err(x),
            }
        }
    }
    Ok(removed)
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
    write_atomic_as(target, write, io_err, Durability::Synced)
}

/// [`write_atomic`] with the fsyncs that `durability` asks for.
pub fn write_atomic_as<E>(
    target: &Path,
    write: impl FnOnce(&mut File) -> Result<(), E>,
    io_err: impl Fn(io::Error) -> E,
    durability: Durability,
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
    tmp.commit_as(durability).map_err(&io_err)
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
    fn temp_names_are_recognised_and_others_are_not() {
        let dir = tempfile::tempdir().unwrap();
        for target in ["heads.arrow", "fig.png", "config.json", "noext", "a.b.c"] {
            let t = TempFile::for_target(&dir.path().join(target)).unwrap();
            let name = t.path().file_name().unwrap().to_string_lossy().into_owned();
            assert!(is_temp_name(&name), "{name}");
        }
        for user in [
            "heads.arrow",
            ".heads.arrow",
            ".tmp-1-2",
            "x.tmp-1-2",
            ".x.tmp-a-2",
            ".x.tmp-1-",
            ".x.arrow.tmp-1-2.png",
            ".gitignore",
        ] {
            assert!(!is_temp_name(user), "{user}");
        }
    }

    #[test]
    fn stale_temps_of_dead_writers_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("shards");
        fs::create_dir_all(&sub).unwrap();
        // pid 0 is never a user process: its files are stale.
        let stale = [
            dir.path().join(".heads.arrow.tmp-0-3.arrow"),
            sub.join(".p0-c0000.arrow.tmp-0-0.arrow"),
        ];
        let mine = dir
            .path()
            .join(format!(".t.arrow.tmp-{}-9.arrow", std::process::id()));
        let user = [
            dir.path().join("heads.arrow"),
            dir.path().join(".notes.tmp"),
        ];
        for p in stale.iter().chain(&user).chain([&mine]) {
            fs::write(p, b"x").unwrap();
        }
        assert_eq!(clean_stale_temps(dir.path(), 2).unwrap(), 2);
        assert!(stale.iter().all(|p| !p.exists()));
        assert!(user.iter().all(|p| p.exists()) && mine.exists());
        let listed = committed_files(dir.path(), "arrow").unwrap();
        assert_eq!(listed, vec![dir.path().join("heads.arrow")]);
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
