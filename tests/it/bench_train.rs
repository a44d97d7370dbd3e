//! `phaselens bench train`: the steps it times are the steps `phaselens train` runs (same
//! losses), and `--export` writes what the PyTorch reference replays.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::train::bench::{BenchOptions, bench_train};
use phaselens::train::{OrganismFile, TrainOptions, train};

fn recipe(dir: &Path, attention: &str) -> PathBuf {
    let p = dir.join("tiny.toml");
    let model = if attention == "full" {
        "attention = \"full\"\nkey_shift = true\nsink = true".to_string()
    } else {
        "attention = \"compressed\"\nsink = true\n\
         compression = { window = 4, stride = 4, local_tail = 2 }"
            .to_string()
    };
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
n_layers = 2
n_heads = 2
n_kv_heads = 1
d_ff = 32
{model}

[task.vocab]
kind = "synthetic"

[task.train]
period = 4
prompt = {{ n_bindings = 6, n_queries = 3 }}

[train]
steps = 20
batch_size = 3
lr = 1e-2
warmup_steps = 2
checkpoint_every = 10
"#
        ),
    )
    .unwrap();
    p
}

fn dev() -> Device {
    Device::default()
}

#[test]
fn bench_losses_are_the_losses_of_train() {
    for attention in ["compressed", "full"] {
        let dir = tempfile::tempdir().unwrap();
        let path = recipe(dir.path(), attention);
        let file = OrganismFile::load(&path).unwrap();
        let opts = TrainOptions {
            fresh: true,
            max_steps: Some(5),
            progress: false,
        };
        let trained = train(&path, &file, &dev(), &opts).unwrap();
        let bench = bench_train(
            &path,
            &file,
            &dev(),
            &BenchOptions {
                steps: 3,
                warmup: 2,
                export: None,
            },
        )
        .unwrap();
        let want: Vec<f64> = trained.history.iter().map(|r| r.loss).collect();
        assert_eq!(bench.losses.len(), 5);
        for (s, (a, b)) in bench.losses.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6,
                "{attention}: step {s}: bench {a} vs train {b}"
            );
        }
        assert!(
            bench.losses.iter().all(|l| l.is_finite() && *l > 0.0),
            "{:?}",
            bench.losses
        );
        assert!(bench.steps_per_second > 0.0 && bench.tokens_per_second > 0.0);
        assert_eq!(bench.tokens_per_step, 3 * bench.seq_len);
        let p = bench.phases;
        assert!(
            p.forward > 0.0 && p.backward > 0.0 && p.optimizer > 0.0,
            "{p:?}"
        );
        assert!(
            p.total() <= bench.seconds / 3.0 * 1.001,
            "{p:?} vs {}",
            bench.seconds
        );
    }
}

#[test]
fn export_holds_the_weights_batches_and_first_logits() {
    let dir = tempfile::tempdir().unwrap();
    let path = recipe(dir.path(), "compressed");
    let file = OrganismFile::load(&path).unwrap();
    let out = dir.path().join("export");
    let bench = bench_train(
        &path,
        &file,
        &dev(),
        &BenchOptions {
            steps: 2,
            warmup: 1,
            export: Some(out.clone()),
        },
    )
    .unwrap();
    let (b, t) = (3, bench.seq_len);
    let batches = SafetensorsReader::open(&out.join("batches.safetensors")).unwrap();
    let (shape, ids) = batches.read_i64("input_ids").unwrap();
    assert_eq!(shape, vec![3, b, t]);
    let (_, labels) = batches.read_i64("labels").unwrap();
    let (_, mask) = batches.read_i64("loss_mask").unwrap();
    let answers = labels.iter().filter(|&&l| l != -100).count();
    assert_eq!(answers, mask.iter().filter(|&&m| m == 1).count());
    assert_eq!(answers, 3 * b * 3, "3 steps x 3 prompts x 3 queries");
    // The exported logits are the exported model's forward on the first batch.
    let model = phaselens::model::load_model(&out.join("model"), &dev()).unwrap();
    let tokens =
        Tensor::<2, Int>::from_data(TensorData::new(ids[..b * t].to_vec(), [b, t]), &dev());
    let logits: Vec<f32> = model
        .forward(tokens, &HookSpec::new())
        .unwrap()
        .logits
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let (lshape, want) = SafetensorsReader::open(&out.join("logits0.safetensors"))
        .unwrap()
        .read_f32("logits")
        .unwrap();
    assert_eq!(lshape, vec![b, t, 128]);
    let err = logits
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err <= 1e-6, "{err}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("train.json")).unwrap()).unwrap();
    assert_eq!(json["lr"].as_array().unwrap().len(), 3);
    assert_eq!(json["optimizer"]["epsilon"].as_f64().unwrap() as f32, 1e-8);
    assert_eq!(json["bench"]["losses"].as_array().unwrap().len(), 3);
    assert_eq!(json["warmup"], 1);
}

#[test]
fn cli_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = recipe(dir.path(), "compressed");
    let json = dir.path().join("bench.json");
    let o = Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(["bench", "train"])
        .arg(&path)
        .args(["--steps", "1", "--warmup", "0", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("steps/s"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v["steps_per_second"].as_f64().unwrap() > 0.0);
    assert_eq!(v["steps"], 1);
    // No checkpoint or model directory is written.
    assert!(!dir.path().join("run").exists());
    assert!(!dir.path().join("tiny").exists());
    let o = Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(["bench", "train"])
        .arg(&path)
        .args(["--steps", "0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least 1"));
}
