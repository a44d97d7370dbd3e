//! Hostile input through the `phaselens` binary (exit codes, messages, no panics),
//! and kill -9 at varying points of `phaselens run` and `phaselens train`: after every
//! kill the run resumes, no finished shard or checkpoint is ever lost or changed, and
//! the final tables / weights equal those of an uninterrupted run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::common::runner::{experiment, organism, tiny};
use phaselens::output::{Table, read_long_rows};

fn phaselens(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every case: arguments, expected exit code, a substring of stderr. A panic (exit
/// code 101, "panicked at") or an abort (a signal) fails the case.
#[test]
fn bad_command_lines_give_named_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    std::fs::write(d.join("ids.json"), "[[1, 16, 64, 17, 65, 3, 16]]").unwrap();
    std::fs::write(d.join("ragged.json"), "[[1, 2], [3]]").unwrap();
    std::fs::write(d.join("oov.json"), "[[1, 500]]").unwrap();
    std::fs::write(d.join("neg.json"), "[[1, -5]]").unwrap();
    std::fs::write(d.join("empty.json"), "[]").unwrap();
    std::fs::write(d.join("garbage.json"), "{{{").unwrap();
    std::fs::write(
        d.join("p.toml"),
        "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"tiny\"\n[task]\nn_logical = 8\n",
    )
    .unwrap();
    let fwd = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["forward", "--model", "tiny", "--out", "o.safetensors"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            fwd(&[
                "--input",
                "ids.json",
                "--capture",
                "hook_embed",
                "--capture",
                "blocks.*.attn.hook_zz",
            ]),
            1,
            "`blocks.*.attn.hook_zz` matched no hook point",
        ),
        (
            fwd(&[
                "--input",
                "ids.json",
                "--capture",
                "blocks.9.hook_resid_pre",
            ]),
            1,
            "blocks.9.hook_resid_pre",
        ),
        (fwd(&["--input", "ragged.json"]), 1, "ragged"),
        (fwd(&["--input", "oov.json"]), 1, "out of the vocabulary"),
        (fwd(&["--input", "neg.json"]), 1, "out of the vocabulary"),
        (fwd(&["--input", "empty.json"]), 1, "empty"),
        (fwd(&["--input", "garbage.json"]), 1, "JSON array"),
        (fwd(&["--input", "missing.json"]), 1, "missing.json"),
        (
            vec![
                "forward".into(),
                "--model".into(),
                "nowhere".into(),
                "--input".into(),
                "ids.json".into(),
                "--out".into(),
                "o.safetensors".into(),
            ],
            1,
            "nowhere",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--reps".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--tokens".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--tokens".into(),
                "16,0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--batch".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--layers".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--reps".into(),
                "-1".into(),
            ],
            2,
            "-1",
        ),
        (
            vec![
                "bench".into(),
                "forward".into(),
                "--tokens".into(),
                "100000000000".into(),
                "--reps".into(),
                "1".into(),
            ],
            1,
            "--tokens",
        ),
        (
            vec![
                "bench".into(),
                "patching".into(),
                "p.toml".into(),
                "--n-logical".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "patching".into(),
                "p.toml".into(),
                "--positions".into(),
                "final:0".into(),
            ],
            2,
            "final",
        ),
        (
            vec![
                "bench".into(),
                "patching".into(),
                "p.toml".into(),
                "--positions".into(),
                "final:x".into(),
            ],
            2,
            "final:K",
        ),
        (
            vec![
                "bench".into(),
                "patching".into(),
                "p.toml".into(),
                "--phase".into(),
                "99".into(),
            ],
            1,
            "phase 99",
        ),
        (
            vec![
                "bench".into(),
                "edges".into(),
                "p.toml".into(),
                "--layers".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            vec![
                "bench".into(),
                "edges".into(),
                "p.toml".into(),
                "--exact-senders".into(),
                "0".into(),
            ],
            2,
            "at least 1",
        ),
        (
            // A seed of random weights without --layers / --heads.
            vec![
                "bench".into(),
                "edges".into(),
                "p.toml".into(),
                "--seed".into(),
                "3".into(),
            ],
            2,
            "--layers",
        ),
        (
            // 3 query heads over the organism's 2 KV heads.
            vec![
                "bench".into(),
                "edges".into(),
                "p.toml".into(),
                "--heads".into(),
                "3".into(),
            ],
            1,
            "must divide n_heads",
        ),
        (vec!["run".into(), "nope.toml".into()], 1, "nope.toml"),
        (vec!["train".into(), "nope.toml".into()], 1, "nope.toml"),
        (
            vec![
                "figures".into(),
                "--experiment".into(),
                "../etc".into(),
                "--data-dir".into(),
                ".".into(),
            ],
            1,
            "--experiment",
        ),
        (
            vec![
                "figures".into(),
                "--experiment".into(),
                "none".into(),
                "--data-dir".into(),
                ".".into(),
            ],
            1,
            "none",
        ),
        (
            vec!["inspect".into(), "--model".into(), "nowhere".into()],
            1,
            "nowhere",
        ),
    ];
    let mut bad = Vec::new();
    for (args, code, want) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = phaselens(&args, d);
        let e = stderr(&o);
        if o.status.code() != Some(*code) || e.contains("panicked at") || !e.contains(want) {
            bad.push(format!(
                "{args:?}: exit {:?}, want {code} and `{want}`: {e}",
                o.status.code()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} cases failed:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
}

#[test]
fn os_error_text_is_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let o = phaselens(&["run", "missing.toml"], dir.path());
    let e = stderr(&o);
    assert_eq!(e.matches("No such file or directory").count(), 1, "{e}");
    let o = phaselens(&["train", "missing.toml"], dir.path());
    let e = stderr(&o);
    assert_eq!(e.matches("No such file or directory").count(), 1, "{e}");
}

#[test]
fn train_help_names_the_folders_it_writes() {
    let dir = tempfile::tempdir().unwrap();
    let o = phaselens(&["train", "--help"], dir.path());
    let h = String::from_utf8_lossy(&o.stdout);
    assert!(
        h.contains("runs/<name>/checkpoints")
            && h.contains("runs/<name>/loss.arrow")
            && h.contains("<model dir>/training/loss")
            && !h.contains("notebooks-data/train"),
        "{h}"
    );
}

#[test]
fn a_forward_of_100k_tokens_runs_in_linear_memory() {
    // Blocked attention: no [T, T] mask or score matrix. (Before, 100K tokens built an
    // 11 GB mask and aborted.) Attention compute still grows as T x entries, so the
    // model is one layer, one head, one entry per 128 tokens: the test checks that the
    // length works, not speed (`bench forward --tokens` measures that).
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(1, 1, 1, 128, 128), 1);
    let t = 100_000;
    let ids: Vec<String> = (0..t).map(|i| ((i * 31) % 128).to_string()).collect();
    std::fs::write(d.join("long.json"), format!("[[{}]]", ids.join(","))).unwrap();
    let o = phaselens(
        &[
            "forward",
            "--model",
            "tiny",
            "--input",
            "long.json",
            "--out",
            "long.safetensors",
        ],
        d,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r = phaselens::model::safetensors_io::SafetensorsReader::open(&d.join("long.safetensors"))
        .unwrap();
    let (shape, v) = r.read_f32("logits").unwrap();
    assert_eq!(shape, vec![1, t, 128]);
    assert!(v.iter().all(|x| x.is_finite()));
}

// ---------------------------------------------------------------- kill -9

const RUN: &str = r#"
[experiment]
kind = "patch-heads"
bootstrap_reps = 20
max_rows = 8

[model]
organism = "tiny"

[task]
n_logical = 8
"#;

/// Every shard file under `shards/` with its bytes.
fn shards(data: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(dirs) = std::fs::read_dir(data.join("shards")) else {
        return out;
    };
    for dir in dirs.flatten() {
        for f in std::fs::read_dir(dir.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') {
                out.push((f.path(), std::fs::read(f.path()).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Spawn `args`, kill it with SIGKILL after `ms` milliseconds (if still running);
/// returns whether it finished by itself (successfully).
fn run_or_kill(args: &[&str], cwd: &Path, ms: u64) -> bool {
    let mut child = Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(args)
        .current_dir(cwd)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let step = Duration::from_millis(5);
    let mut waited = 0;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.success();
        }
        if waited >= ms {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            return false;
        }
        std::thread::sleep(step);
        waited += 5;
    }
}

fn rows(path: &Path) -> String {
    format!(
        "{:?}",
        read_long_rows(&Table::read_arrow(path).unwrap()).unwrap()
    )
}

#[test]
fn kill_9_at_any_point_of_run_never_changes_a_table_or_loses_a_shard() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    experiment(d, "k.toml", RUN);
    let args = ["run", "k.toml", "--no-figures", "--plain"];
    // The reference: one uninterrupted run in its own folder.
    let reference = tempfile::tempdir().unwrap();
    let r = reference.path();
    organism(r, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    experiment(r, "k.toml", RUN);
    assert!(run_or_kill(&args, r, u64::MAX));
    let want = rows(&r.join("notebooks-data/k/heads.arrow"));

    let data = d.join("notebooks-data/k");
    let mut done = false;
    let mut kills = 0;
    // Kill points spread over start-up, model load, base runs, chunks and table writes.
    for ms in [
        40, 90, 150, 220, 300, 400, 520, 650, 800, 1000, 1300, 1700, 2200, 3000,
    ] {
        let before = shards(&data);
        let finished = run_or_kill(&args, d, ms);
        let after = shards(&data);
        for s in &before {
            assert!(
                after.contains(s),
                "kill at {ms} ms lost or changed {}",
                s.0.display()
            );
        }
        if finished {
            done = true;
            break;
        }
        kills += 1;
        // A killed run holds no lock that blocks the next one, and its table (if any)
        // is either absent or a complete one (atomic writes).
        if let Ok(t) = Table::read_arrow(data.join("heads.arrow")) {
            read_long_rows(&t).unwrap();
        }
    }
    if !done {
        assert!(run_or_kill(&args, d, u64::MAX), "the final resume failed");
    }
    assert!(kills >= 1, "the run finished before the first kill point");
    assert_eq!(rows(&data.join("heads.arrow")), want);
    // No temp file or lock survives the finished run.
    let leftovers: Vec<String> = std::fs::read_dir(&data)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

const RECIPE: &str = r#"[organism]
name = "tiny"
run_dir = "run"

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
steps = 16
batch_size = 4
lr = 1e-2
warmup_steps = 2
checkpoint_every = 2
keep_checkpoints = 100
"#;

/// Every tensor of a safetensors file, by name.
fn tensors(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let r = phaselens::model::safetensors_io::SafetensorsReader::open(path).unwrap();
    let names: Vec<String> = r.names().map(String::from).collect();
    names
        .into_iter()
        .map(|n| {
            let (shape, v) = r.read_f32(&n).unwrap();
            (n, shape, v)
        })
        .collect()
}

fn complete_checkpoints(run: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(dirs) = std::fs::read_dir(run.join("checkpoints")) else {
        return out;
    };
    for e in dirs.flatten() {
        let meta = e.path().join("meta.json");
        if meta.exists() {
            let mut bytes = std::fs::read(e.path().join("model.safetensors")).unwrap();
            bytes.extend(std::fs::read(&meta).unwrap());
            out.push((e.path(), bytes));
        }
    }
    out.sort();
    out
}

#[test]
fn kill_9_at_any_point_of_train_never_changes_the_result_or_loses_a_checkpoint() {
    let reference = tempfile::tempdir().unwrap();
    std::fs::write(reference.path().join("tiny.toml"), RECIPE).unwrap();
    assert!(run_or_kill(
        &["train", "tiny.toml"],
        reference.path(),
        u64::MAX
    ));
    let want = tensors(&reference.path().join("tiny/model.safetensors"));

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("tiny.toml"), RECIPE).unwrap();
    let mut done = false;
    let mut kills = 0;
    for ms in [
        30, 80, 140, 200, 280, 360, 450, 560, 700, 900, 1200, 1600, 2200,
    ] {
        let before = complete_checkpoints(&d.join("run"));
        let finished = run_or_kill(&["train", "tiny.toml"], d, ms);
        let after = complete_checkpoints(&d.join("run"));
        for c in &before {
            assert!(
                after.contains(c),
                "kill at {ms} ms lost or changed {}",
                c.0.display()
            );
        }
        if finished {
            done = true;
            break;
        }
        kills += 1;
    }
    if !done {
        assert!(run_or_kill(&["train", "tiny.toml"], d, u64::MAX));
    }
    assert!(kills >= 1, "training finished before the first kill point");
    // Values, not bytes: the safetensors header's key order differs between processes.
    assert_eq!(
        tensors(&d.join("tiny/model.safetensors")),
        want,
        "the resumed model differs from the uninterrupted one ({kills} kills)"
    );
    assert!(!d.join("run/.lock").exists());
}

// ---------------------------------------------------------------- issue 24: new surfaces

/// Every command that chooses a device, on devices that are built but (here) absent,
/// or not built: a clear error naming the device and what it needs, exit 1, never a
/// panic. Where a device does work (a CI runner with a GPU), the command may succeed.
#[test]
fn absent_devices_are_named_errors_on_every_command_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipe = organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let recipe = recipe.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::write(d.join("ids.json"), "[[1, 16, 64, 17, 65, 3, 16]]").unwrap();
    experiment(
        d,
        "p.toml",
        "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"tiny\"\n[task]\nn_logical = 8\n",
    );
    std::fs::write(
        d.join("g.toml"),
        format!("[grid]\nbase = \"{recipe}\"\n[axes]\nseed = [1]\n[eval]\nn_logical = 32\ndetail_n_logical = 32\nbootstrap_reps = 10\n"),
    )
    .unwrap();
    let commands: Vec<Vec<&str>> = vec![
        vec![
            "forward",
            "--model",
            "tiny",
            "--input",
            "ids.json",
            "--out",
            "o.safetensors",
        ],
        vec!["run", "p.toml"],
        vec!["train", recipe.as_str(), "--max-steps", "1"],
        vec![
            "bench",
            "train",
            recipe.as_str(),
            "--steps",
            "1",
            "--warmup",
            "0",
        ],
        vec!["inspect", "--model", "tiny"],
        vec!["grid", "g.toml", "--data-dir", "gd", "--reports-dir", "gr"],
    ];
    let mut bad = Vec::new();
    let mut named = 0;
    for device in ["tch-cuda:0", "tch-cuda:7", "wgpu:7", "cuda:0"] {
        for c in &commands {
            let mut args = c.clone();
            args.extend(["--device", device]);
            let o = phaselens(&args, d);
            let e = stderr(&o);
            let ok = o.status.success();
            let clear = o.status.code() == Some(1)
                && e.contains(&format!("device `{device}`"))
                && (e.contains("not usable on this machine") || e.contains("built without"))
                && !e.contains("panicked");
            if clear {
                named += 1;
            }
            if !(ok || clear) {
                bad.push(format!("{args:?}: exit {:?}: {e}", o.status.code()));
            }
        }
    }
    assert!(bad.is_empty(), "{} failed:\n{}", bad.len(), bad.join("\n"));
    // cuda is not in the default test build, and no machine has 8 GPUs for tch-cuda:7.
    assert!(
        named >= commands.len(),
        "too few devices were refused ({named})"
    );
    // A refused device leaves no folder or generated recipe behind.
    for left in [
        "notebooks-data",
        "reports",
        "gd",
        "g",
        "grid",
        "runs",
        "o.safetensors",
    ] {
        assert!(!d.join(left).exists(), "{left} left behind");
    }
}

/// Files given to the wrong command say what they are and what was expected.
#[test]
fn a_file_of_another_kind_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipe = organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let recipe = recipe.file_name().unwrap().to_string_lossy().into_owned();
    experiment(
        d,
        "p.toml",
        "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"tiny\"\n",
    );
    std::fs::write(
        d.join("g.toml"),
        "[grid]\nbase = \"p.toml\"\n[axes]\nseed = [1, 2]\n",
    )
    .unwrap();
    std::fs::create_dir(d.join("arr")).unwrap();
    std::fs::write(d.join("arr/config.json"), "[1, 2]").unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["run", recipe.as_str()],
            "this is an organism recipe (it has [organism]), expected an experiment file",
        ),
        (
            vec!["train", "p.toml"],
            "this is an experiment file (it has [experiment]), expected an organism recipe",
        ),
        (
            vec!["bench", "train", "p.toml"],
            "this is an experiment file",
        ),
        (vec!["train", "g.toml"], "this is a grid file"),
        (vec!["run", "g.toml"], "this is a grid file"),
        (
            vec!["grid", "list", "p.toml"],
            "this is an experiment file (it has [experiment]), expected a grid file",
        ),
        (
            vec!["grid", "list", "g.toml"],
            "this is an experiment file (it has [experiment]), expected an organism recipe",
        ),
        (
            vec!["inspect", "--model", "arr"],
            "must be a JSON object of settings",
        ),
    ];
    let mut bad = Vec::new();
    for (args, want) in &cases {
        let o = phaselens(args, d);
        let e = stderr(&o);
        if o.status.code() != Some(1) || !e.contains(want) || e.contains("panicked") {
            bad.push(format!("{args:?}: exit {:?}: {e}", o.status.code()));
        }
    }
    assert!(bad.is_empty(), "{} failed:\n{}", bad.len(), bad.join("\n"));
}

/// `train --max-steps 0` is refused by the parser and leaves no run folder; Rust
/// debug text (`TchCuda(0)`) never reaches the user.
#[test]
fn max_steps_zero_is_refused_and_no_debug_text_reaches_users() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipe = organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let recipe = recipe.file_name().unwrap().to_string_lossy().into_owned();
    let o = phaselens(&["train", recipe.as_str(), "--max-steps", "0"], d);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("--max-steps") && !e.contains("NaN"), "{e}");
    assert!(!d.join("runs").exists());
    // bench train names its device as given on the command line.
    let o = phaselens(
        &[
            "bench",
            "train",
            recipe.as_str(),
            "--steps",
            "1",
            "--warmup",
            "0",
        ],
        d,
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.contains("device cpu,") && !out.contains("Cpu"), "{out}");
}

/// Ctrl-C / SIGTERM during a training release its `.lock` (exit 128 + signal).
#[test]
fn sigterm_and_sigint_release_the_run_lock() {
    for (sig, code) in [("TERM", 143), ("INT", 130)] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let recipe = organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
        let mut text = std::fs::read_to_string(&recipe).unwrap();
        text.push_str("\n[train]\nsteps = 1000000\nbatch_size = 2\ncheckpoint_every = 100000\n");
        std::fs::write(&recipe, text).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_phaselens"))
            .args(["train", recipe.to_str().unwrap()])
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lock = d.join("runs/tiny/.lock");
        let t0 = std::time::Instant::now();
        while std::fs::read_to_string(&lock).map_or(true, |t| t.is_empty()) {
            assert!(t0.elapsed() < Duration::from_secs(60), "no lock after 60 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        let k = Command::new("kill")
            .args([&format!("-{sig}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(k.success());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(code), "SIG{sig}");
        assert!(!lock.exists(), "SIG{sig} left {}", lock.display());
    }
}
