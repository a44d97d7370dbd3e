//! Training: seeded, checkpointed, and resumable after an interruption (even kill -9).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use phaselens::model::safetensors_io::SafetensorsReader;

fn recipe(dir: &Path, steps: u64, every: u64) -> std::path::PathBuf {
    let p = dir.join("tiny.toml");
    std::fs::write(
        &p,
        format!(
            r#"
[organism]
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
compression = {{ window = 4, stride = 4, local_tail = 2 }}

[task.vocab]
kind = "synthetic"

[task.train]
period = 4
prompt = {{ n_bindings = 6, n_queries = 3 }}

[train]
steps = {steps}
batch_size = 4
lr = 1e-2
warmup_steps = 2
checkpoint_every = {every}
keep_checkpoints = 100
"#
        ),
    )
    .unwrap();
    p
}

fn train(recipe: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .arg("train")
        .arg(recipe)
        .args(extra)
        .output()
        .unwrap()
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r = SafetensorsReader::open(&dir.join("model.safetensors")).unwrap();
    r.names()
        .map(|n| (n.to_string(), r.read_f32(n).unwrap().1))
        .collect()
}

#[test]
fn resumed_run_equals_uninterrupted_run() {
    let a = tempfile::tempdir().unwrap();
    let ra = recipe(a.path(), 6, 2);
    let o = train(&ra, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let straight = weights(&a.path().join("tiny"));

    let b = tempfile::tempdir().unwrap();
    let rb = recipe(b.path(), 6, 2);
    let o = train(&rb, &["--max-steps", "4"]);
    assert!(o.status.success());
    assert!(
        !b.path().join("tiny/model.safetensors").exists(),
        "no final model before the last step"
    );
    // an interval that was being written when the process died: no meta.json
    std::fs::create_dir_all(b.path().join("run/checkpoints/step-0000006")).unwrap();
    std::fs::write(
        b.path()
            .join("run/checkpoints/step-0000006/model.safetensors"),
        b"partial",
    )
    .unwrap();
    let o = train(&rb, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resumed from step 4"), "{err}");
    assert_eq!(weights(&b.path().join("tiny")), straight);
    // metadata and loss history
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(b.path().join("tiny/training.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["steps"], 6);
    // The binary's source commit (build.rs; 40 hex digits in a git checkout), in the
    // model's training.json and in the checkpoints' meta.json.
    let commit = env!("PHASELENS_GIT_COMMIT");
    assert!(
        commit == "unknown"
            || (commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{commit}"
    );
    assert_eq!(meta["phaselens_commit"], commit);
    let last = std::fs::read_dir(b.path().join("run/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("meta.json").exists())
        .max()
        .unwrap();
    let ckpt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(last.join("meta.json")).unwrap()).unwrap();
    assert_eq!(ckpt["phaselens_commit"], commit, "{}", last.display());
    // the loss curve, as a table and a figure, next to the checkpoints and the model
    for f in [
        "run/loss.arrow",
        "run/loss.png",
        "run/loss.svg",
        "tiny/training/loss.arrow",
        "tiny/training/loss.png",
    ] {
        assert!(b.path().join(f).exists(), "{f}");
    }
    let t =
        phaselens::output::Table::read_arrow(b.path().join("tiny/training/loss.arrow")).unwrap();
    assert_eq!(t.num_rows(), 6);
    assert_eq!(
        t.column_names(),
        vec!["step", "loss", "lr", "tokens_seen", "accuracy"]
    );
}

#[test]
fn kill_9_loses_at_most_one_interval() {
    let d = tempfile::tempdir().unwrap();
    let r = recipe(d.path(), 100_000, 3);
    let mut child = Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .arg("train")
        .arg(&r)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ck = d.path().join("run/checkpoints");
    let t0 = Instant::now();
    let complete = |ck: &Path| -> Vec<u64> {
        let mut v: Vec<u64> = std::fs::read_dir(ck)
            .map(|e| {
                e.flatten()
                    .filter(|e| e.path().join("meta.json").exists())
                    .filter_map(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .strip_prefix("step-")
                            .and_then(|s| s.parse().ok())
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    while complete(&ck).len() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no checkpoints appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let last = *complete(&ck).last().unwrap();
    let o = train(&r, &["--max-steps", &(last + 3).to_string()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(&format!("resumed from step {last}")), "{err}");
}

#[test]
fn a_checkpoint_from_another_recipe_is_not_resumed() {
    let d = tempfile::tempdir().unwrap();
    let r = recipe(d.path(), 4, 2);
    assert!(train(&r, &["--max-steps", "2"]).status.success());
    let text = std::fs::read_to_string(&r)
        .unwrap()
        .replace("lr = 1e-2", "lr = 2e-2");
    std::fs::write(&r, text).unwrap();
    let o = train(&r, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--fresh"), "{err}");
    assert!(train(&r, &["--fresh"]).status.success());
}

#[test]
fn recipe_errors_name_file_line_and_key() {
    let d = tempfile::tempdir().unwrap();
    let r = recipe(d.path(), 4, 2);
    let text = std::fs::read_to_string(&r)
        .unwrap()
        .replace("batch_size = 4", "batch_size = 4\nbatch_sise = 8");
    std::fs::write(&r, text).unwrap();
    let o = train(&r, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("tiny.toml") && err.contains("batch_sise") && err.contains("line"),
        "{err}"
    );
}
