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

/// The shipped v4pro-mini recipe (HCA rate 8) with HCA rate `hca`, one step at a
/// near-zero learning rate from the shipped weights, plus `extra` `[train]` lines.
fn v4_recipe(dir: &Path, name: &str, hca: usize, extra: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/organisms");
    let text = std::fs::read_to_string(root.join("v4pro-mini.toml")).unwrap();
    let text: String = text
        .lines()
        .map(|l| match l.split('=').next().unwrap_or("").trim() {
            "compress_rates" => format!(
                "compress_rates = {{ compressed_sparse_attention = 4, heavily_compressed_attention = {hca} }}"
            ),
            "name" => format!("name = \"{name}\"\nrun_dir = \"run-{name}\""),
            "steps" => format!(
                "steps = 1\ninit = {:?}\n{extra}",
                root.join("v4pro-mini").to_str().unwrap()
            ),
            "batch_size" => "batch_size = 2".into(),
            "lr" => "lr = 1e-12".into(),
            "warmup_steps" => "warmup_steps = 1".into(),
            "checkpoint_every" => "checkpoint_every = 1".into(),
            "init" => String::new(),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn float_weights(dir: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let r = SafetensorsReader::open(&dir.join("model.safetensors")).unwrap();
    r.names()
        .filter_map(|n| r.read_f32(n).ok().map(|v| (n.to_string(), v)))
        .collect()
}

#[test]
fn init_tile_starts_a_higher_compression_rate_from_the_tiled_weights() {
    let d = tempfile::tempdir().unwrap();
    let shipped = float_weights(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/organisms/v4pro-mini"),
    );

    // HCA rate 16 from the rate-8 organism: without init_tile the shapes do not fit,
    // and the error names the key, the tensor and both shapes.
    let plain = v4_recipe(d.path(), "plain", 16, "");
    let o = train(&plain);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("[train] init"), "{err}");
    assert!(
        err.contains("position_bias") && err.contains("[8, "),
        "{err}"
    );

    // A pattern that names nothing is refused; init_tile without init is refused.
    let typo = v4_recipe(d.path(), "typo", 8, "init_tile = [\"positon_bias\"]");
    let o = train(&typo);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("positon_bias"), "{err}");
    let lone = d.path().join("lone.toml");
    let text = std::fs::read_to_string(&typo).unwrap();
    let text: String = text
        .lines()
        .filter(|l| !l.starts_with("init ="))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&lone, text).unwrap();
    let o = train(&lone);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("init_tile") && err.contains("needs `init`"),
        "{err}"
    );

    // With it: every HCA compressor's position_bias is the stored one twice over, row
    // i = row i mod 8, and every other tensor is the shipped one.
    let tiled = v4_recipe(d.path(), "tiled", 16, "init_tile = [\"position_bias\"]");
    let o = train(&tiled);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let got = float_weights(&d.path().join("tiled"));
    assert_eq!(got.len(), shipped.len());
    let mut n_tiled = 0;
    for (name, (shape, v)) in &got {
        let (s_shape, s_v) = &shipped[name];
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-6;
        if shape == s_shape {
            assert!(v.iter().zip(s_v).all(|(a, b)| close(*a, *b)), "{name}");
            continue;
        }
        n_tiled += 1;
        assert!(name.ends_with("compressor.position_bias"), "{name}");
        assert_eq!(shape[0], 2 * s_shape[0], "{name}");
        assert_eq!(shape[1..], s_shape[1..], "{name}");
        let row = s_shape[1];
        for i in 0..shape[0] {
            let (a, b) = (
                &v[i * row..(i + 1) * row],
                &s_v[(i % 8) * row..(i % 8 + 1) * row],
            );
            assert!(
                a.iter().zip(b).all(|(x, y)| close(*x, *y)),
                "{name} row {i}"
            );
        }
        assert!(err.contains(&format!("init: tiled `{name}`")), "{err}");
    }
    // The three HCA layers of the V4-Pro schedule.
    assert_eq!(n_tiled, 3, "{err}");
}
