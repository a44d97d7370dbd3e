//! One run at a time per output folder: a lock file (`<folder>/.lock`) that names the
//! process holding it. A second `phaselens run` of the same experiment (or `train` of
//! the same organism) fails at once with a message naming the other process instead of
//! computing everything twice; the lock is released when the run ends (also on errors
//! and panics, by `Drop`), and a lock left by a killed process (`kill -9`, a crash, a
//! reboot) is taken over by the next run.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::atomic::process_alive;

/// A held lock; dropping it removes the lock file.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    token: String,
}

/// Why a lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another live process holds it.
    #[error(
        "{what} is already running in process {pid} (lock file {path}); wait for it to finish or stop it (kill {pid})"
    )]
    Held {
        what: String,
        pid: u32,
        path: PathBuf,
    },
    #[error("lock file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The start time of process `pid` in clock ticks since boot (`/proc/<pid>/stat` field
/// 22), so a lock whose process id was reused by another program is still stale.
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields resume after
    // the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// `(pid, start time)` recorded in a lock file.
fn parse(text: &str) -> Option<(u32, Option<u64>)> {
    let mut pid = None;
    let mut start = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("pid=") {
            pid = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("start=") {
            start = v.trim().parse().ok();
        }
    }
    Some((pid?, start))
}

fn held_by_live_process(text: &str) -> Option<u32> {
    let (pid, start) = parse(text)?;
    if !process_alive(pid) {
        return None;
    }
    match (start, start_time(pid)) {
        (Some(a), Some(b)) if a != b => None, // the id now belongs to another process
        _ => Some(pid),
    }
}

impl RunLock {
    /// Take the lock `path` for `what` (e.g. "experiment `v4pro`").
    pub fn acquire(path: &Path, what: &str) -> Result<RunLock, LockError> {
        let io_err = |source| LockError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(io_err)?;
        }
        let pid = std::process::id();
        let token = format!(
            "pid={pid}\nstart={}\nwhat={what}\n",
            start_time(pid).map_or_else(String::new, |s| s.to_string())
        );
        // A few rounds: a stale lock is moved away, then the lock is created afresh;
        // `create_new` decides between two processes that race for it.
        for _ in 0..8 {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    // Registered before the token is written: a lock file with content
                    // is always one a signal removes.
                    on_signal::hold(path);
                    if let Err(e) = f.write_all(token.as_bytes()).and_then(|()| f.sync_all()) {
                        on_signal::release(path);
                        return Err(io_err(e));
                    }
                    return Ok(RunLock {
                        path: path.to_path_buf(),
                        token,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err(e)),
            }
            let text = match fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(e)),
            };
            if let Some(other) = held_by_live_process(&text) {
                return Err(LockError::Held {
                    what: what.to_string(),
                    pid: other,
                    path: path.to_path_buf(),
                });
            }
            if text.is_empty() {
                // Maybe a process that has created the file but not yet written it:
                // give it a moment before calling the lock stale.
                std::thread::sleep(std::time::Duration::from_millis(50));
                if fs::read_to_string(path).is_ok_and(|t| !t.is_empty()) {
                    continue;
                }
            }
            // Stale: move it aside (only one process wins the rename), then check
            // that what was moved is the stale lock read above.
            let aside = path.with_extension(format!("stale-{pid}"));
            match fs::rename(path, &aside) {
                Ok(()) => {
                    let moved = fs::read_to_string(&aside).unwrap_or_default();
                    if moved == text {
                        let _ = fs::remove_file(&aside);
                    } else {
                        // Another process took the lock in between: give it back.
                        let _ = fs::rename(&aside, path);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(e)),
            }
        }
        let text = fs::read_to_string(path).unwrap_or_default();
        Err(match parse(&text) {
            Some((pid, _)) => LockError::Held {
                what: what.to_string(),
                pid,
                path: path.to_path_buf(),
            },
            None => io_err(io::Error::other("could not take over the lock file")),
        })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        on_signal::release(&self.path);
        // Remove only our own lock (never one another process took over).
        if fs::read_to_string(&self.path).is_ok_and(|t| t == self.token) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Ctrl-C (SIGINT) and SIGTERM end the process without running `Drop`: a handler,
/// installed with the first lock, removes the locks this process holds and exits with
/// 128 + the signal number, as the default action's status reads to a shell. The
/// handler only calls `unlink` and `_exit` (async-signal-safe) on paths prepared
/// beforehand (slots of leaked C strings). Elsewhere than Unix the next run takes a
/// dead process's lock over, as after `kill -9`.
mod on_signal {
    #[cfg(unix)]
    mod imp {
        use std::ffi::{CString, c_char, c_int};
        use std::os::unix::ffi::OsStrExt;
        use std::path::Path;
        use std::sync::Once;
        use std::sync::atomic::{AtomicPtr, Ordering};

        const SLOTS: usize = 32;
        static HELD: [AtomicPtr<c_char>; SLOTS] =
            [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];
        static INSTALL: Once = Once::new();
        const SIGINT: c_int = 2;
        const SIGTERM: c_int = 15;

        unsafe extern "C" {
            fn signal(signum: c_int, handler: extern "C" fn(c_int)) -> usize;
            fn unlink(path: *const c_char) -> c_int;
            fn _exit(status: c_int) -> !;
        }

        extern "C" fn handler(sig: c_int) {
            for slot in &HELD {
                let p = slot.load(Ordering::SeqCst);
                if !p.is_null() {
                    // SAFETY: `p` is a leaked, NUL-terminated C string (never freed).
                    unsafe { unlink(p) };
                }
            }
            // SAFETY: _exit is async-signal-safe and ends the process.
            unsafe { _exit(128 + sig) }
        }

        pub fn hold(path: &Path) {
            INSTALL.call_once(|| {
                // SAFETY: installing a handler that only calls async-signal-safe
                // functions.
                unsafe {
                    signal(SIGINT, handler);
                    signal(SIGTERM, handler);
                }
            });
            let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
                return;
            };
            let raw = c.into_raw();
            for slot in &HELD {
                if slot
                    .compare_exchange(
                        std::ptr::null_mut(),
                        raw,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    )
                    .is_ok()
                {
                    return;
                }
            }
            // More than SLOTS locks at once: this one is left to the stale-lock rule.
            // SAFETY: `raw` came from `into_raw` above and was stored nowhere.
            drop(unsafe { CString::from_raw(raw) });
        }

        pub fn release(path: &Path) {
            let bytes = path.as_os_str().as_bytes();
            for slot in &HELD {
                let p = slot.load(Ordering::SeqCst);
                if p.is_null() {
                    continue;
                }
                // SAFETY: non-null slots hold leaked, NUL-terminated C strings.
                let held = unsafe { std::ffi::CStr::from_ptr(p) };
                if held.to_bytes() == bytes
                    && slot
                        .compare_exchange(
                            p,
                            std::ptr::null_mut(),
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        )
                        .is_ok()
                {
                    // Leaked on purpose: a handler running now may still read it.
                    return;
                }
            }
        }
    }

    #[cfg(unix)]
    pub use imp::{hold, release};

    #[cfg(not(unix))]
    pub fn hold(_: &std::path::Path) {}
    #[cfg(not(unix))]
    pub fn release(_: &std::path::Path) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_naming_the_first_and_release_frees_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("exp/.lock");
        let a = RunLock::acquire(&p, "experiment `x`").unwrap();
        let e = RunLock::acquire(&p, "experiment `x`")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("already running")
                && e.contains(&std::process::id().to_string())
                && e.contains(".lock"),
            "{e}"
        );
        drop(a);
        assert!(!p.exists());
        let _b = RunLock::acquire(&p, "experiment `x`").unwrap();
    }

    #[test]
    fn stale_lock_of_a_dead_process_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(".lock");
        // pid 0 is never a user process.
        fs::write(&p, "pid=0\nstart=1\nwhat=x\n").unwrap();
        let l = RunLock::acquire(&p, "x").unwrap();
        assert!(
            fs::read_to_string(l.path())
                .unwrap()
                .contains(&format!("pid={}", std::process::id()))
        );
        // A lock whose pid is alive but whose start time differs (pid reuse) is stale.
        drop(l);
        fs::write(&p, format!("pid={}\nstart=1\nwhat=x\n", std::process::id())).unwrap();
        if start_time(std::process::id()).is_some_and(|s| s != 1) {
            RunLock::acquire(&p, "x").unwrap();
        }
        // Garbage in the lock file is stale too.
        fs::write(&p, "not a lock").unwrap();
        RunLock::acquire(&p, "x").unwrap();
    }
}
