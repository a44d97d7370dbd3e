//! Fine-tuning and length curricula: `[train] init` starts a run from a trained model's
//! weights; `[task.train] inner_pad_min` keeps every training haystack near its length.

use std::path::{Path, PathBuf};
use std::process::Command;

use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::tasks::{KvTrainConfig, KvTrainSampler, TokenSpace};

/// A one-layer kvc recipe `name.toml` in `dir` (its model goes to `dir/name`).
fn recipe(dir: &Path, name: &str, d_model: usize, lr: &str, train_extra: &str) -> PathBuf {
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(
        &p,
        format!(
            r#"
[organism]
name = "{name}"
run_dir = "run-{name}"

[model]
model_type = "phaselens-kvc"
vocab_size = 128
d_model = {d_model}
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
steps = 2
batch_size = 4
lr = {lr}
warmup_steps = 1
checkpoint_every = 2
{train_extra}
"#
        ),
    )
    .unwrap();
    p
}

fn train(recipe: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .arg("train")
        .arg(recipe)
        .output()
        .unwrap()
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r = SafetensorsReader::open(&dir.join("model.safetensors")).unwrap();
    let mut w: Vec<_> = r
        .names()
        .map(|n| (n.to_string(), r.read_f32(n).unwrap().1))
        .collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

/// The largest absolute difference between two weight sets with the same names.
fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

#[test]
fn init_starts_from_the_trained_weights() {
    let d = tempfile::tempdir().unwrap();
    let base = recipe(d.path(), "base", 16, "1e-2", "");
    let o = train(&base);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let trained = weights(&d.path().join("base"));

    // A near-zero learning rate: a run that starts from `base` ends where base ended;
    // a run from the random init (same seed) does not.
    let tuned = recipe(d.path(), "tuned", 16, "1e-12", "init = \"base\"");
    let o = train(&tuned);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(max_diff(&weights(&d.path().join("tuned")), &trained) < 1e-6);

    let fresh = recipe(d.path(), "fresh", 16, "1e-12", "");
    let o = train(&fresh);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(max_diff(&weights(&d.path().join("fresh")), &trained) > 1e-3);
}

#[test]
fn init_errors_name_the_key_and_the_directory() {
    let d = tempfile::tempdir().unwrap();
    let base = recipe(d.path(), "base", 16, "1e-2", "");
    assert!(train(&base).status.success());
    // Another width: the weights do not fit.
    let wide = recipe(d.path(), "wide", 32, "1e-2", "init = \"base\"");
    let o = train(&wide);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("[train] init"), "{err}");
    assert!(err.contains("base"), "{err}");
    // No such directory.
    let gone = recipe(d.path(), "gone", 16, "1e-2", "init = \"nowhere\"");
    let o = train(&gone);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("[train] init") && err.contains("nowhere"),
        "{err}"
    );
}

#[test]
fn inner_pad_min_bounds_the_haystack_from_below() {
    let space = TokenSpace::default_synthetic();
    let cfg: KvTrainConfig = toml::from_str("inner_pad_min = 40\ninner_pad_max = 60\n").unwrap();
    let sampler = KvTrainSampler::new(&space, cfg).unwrap();
    let batch = sampler.batch(3, 64);
    let mut counts = std::collections::BTreeSet::new();
    for e in &batch.examples {
        assert_eq!(e.tokens.len(), sampler.seq_len());
        let first_query = e.queries.iter().map(|q| q.query_pos).min().unwrap();
        // Pads between BOS and the query section: the inner pads alone.
        let inside = e.tokens[e.shift + 1..first_query]
            .iter()
            .filter(|&&t| t == space.pad())
            .count();
        assert!((40..=60).contains(&inside), "{inside}");
        counts.insert(inside);
    }
    assert!(counts.len() > 5, "{counts:?}");
    // Unset, it is the plain sampler (same batches, config serialised without it).
    let plain: KvTrainConfig = toml::from_str("inner_pad_max = 7\n").unwrap();
    let zero: KvTrainConfig = toml::from_str("inner_pad_max = 7\ninner_pad_min = 0\n").unwrap();
    assert_eq!(
        KvTrainSampler::new(&space, plain.clone())
            .unwrap()
            .batch(5, 8),
        KvTrainSampler::new(&space, zero).unwrap().batch(5, 8)
    );
    assert!(
        !serde_json::to_string(&plain)
            .unwrap()
            .contains("inner_pad_min")
    );
    // Above the maximum: an error naming the field.
    let bad: KvTrainConfig = toml::from_str("inner_pad_min = 8\ninner_pad_max = 7\n").unwrap();
    let err = KvTrainSampler::new(&space, bad).unwrap_err().to_string();
    assert!(err.contains("inner_pad_min"), "{err}");
}
