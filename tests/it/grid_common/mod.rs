//! A tiny base recipe and grid files for the grid tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A one-layer kvc recipe that trains in well under a second per 10 steps.
pub const BASE: &str = r#"
[organism]
name = "tiny"

[model]
model_type = "phaselens-kvc"
vocab_size = 128
d_model = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 32
attention = "compressed"
compression = { window = 4, stride = 4, local_tail = 2 }

[task.vocab]
kind = "synthetic"

[task.train]
period = 4
prompt = { n_bindings = 6, n_queries = 3 }

[train]
steps = 12
batch_size = 4
lr = 1e-2
warmup_steps = 2
checkpoint_every = 4
"#;

/// Small sweeps: P = 4 needs multiples of 32 logical examples.
pub const EVAL: &str = r#"
[eval]
n_logical = 32
detail_n_logical = 32
slots = [1, 3]
bindings = [4, 6]
bootstrap_reps = 50
"#;

/// Write `base.toml` and `grid.toml` (the given body, after `[grid] base = ...`).
pub fn grid_dir(body: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
    let p = dir.path().join("grid.toml");
    std::fs::write(&p, format!("[grid]\nbase = \"base.toml\"\n{body}")).unwrap();
    (dir, p)
}

/// Run `phaselens ARGS` in `dir` with `env`.
pub fn phaselens(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_phaselens"));
    c.current_dir(dir).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// stdout + stderr as text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
