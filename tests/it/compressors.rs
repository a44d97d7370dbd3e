//! Learned compressors (`phaselens train` on a `[compressor]` recipe, the `learned`
//! overlay): zero gates are `pool`; a training writes a folder the overlay loads, and
//! resuming from a checkpoint gives the gates of an uninterrupted run; a compressor
//! for another model, another geometry or no folder at all is refused naming the key.
//! (The forward contract with random gates is model_contract.rs's
//! `overlay_learned_w8_s4_local3`.)

use std::path::Path;

use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::compression::Overlay;
use phaselens::model::kvc::GateMode;
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::stored::Residency;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{KvcConfig, KvcModel, load_model_overlaid};
use phaselens::train::TrainOptions;
use phaselens::train::compressor::{CompressorFile, train};

use crate::common::pretrained::{SMOLLM2, model_file};
use crate::common::{dev, max_rel, vals};

fn tokens(len: usize, vocab: usize) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..2 * len)
        .map(|i| ((i * 7919 + 13) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(v, [2, len]), &dev())
}

#[test]
fn zero_gates_pool_like_the_pool_overlay() {
    let c = KvcConfig::tiny().full_attention();
    let build = || KvcModel::new(&c, &Vb::new(&RandomInit { seed: 5 }, &dev())).unwrap();
    let pool: Overlay = "kind=pool,window=6,stride=4,local=3".parse().unwrap();
    let a = build().with_overlay(&pool).unwrap();
    let b = build()
        .with_trainable_compressor((6, 4, 3), GateMode::Scalar, None)
        .unwrap();
    let t = tokens(40, c.vocab_size);
    let la = vals(a.forward(t.clone(), &HookSpec::new()).unwrap().logits);
    let lb = vals(b.forward(t.clone(), &HookSpec::new()).unwrap().logits);
    assert!(max_rel(&la, &lb) < 1e-6, "{}", max_rel(&la, &lb));
    // And the compressor changes the forward: the plain model differs.
    let plain = vals(build().forward(t, &HookSpec::new()).unwrap().logits);
    assert!(max_rel(&la, &plain) > 1e-3);
}

fn recipe(dir: &Path, name: &str, model: &Path) -> std::path::PathBuf {
    let text = format!(
        r#"[compressor]
name = "{name}"
model = "{}"
window = 8
stride = 8
local = 16
run_dir = "run-{name}"
[data]
sequences = 2
prompt_tokens = 24
new_tokens = 12
batch = 2
seed = 3
[train]
steps = 3
batch_size = 1
lr = 0.01
warmup_steps = 1
checkpoint_every = 1
"#,
        model.display()
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn run(path: &Path, max_steps: Option<u64>) -> phaselens::train::TrainSummary {
    let file = CompressorFile::load(path).unwrap();
    let opts = TrainOptions {
        fresh: false,
        max_steps,
        progress: false,
    };
    train(path, &file, &dev(), &opts).unwrap()
}

fn gates(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r = SafetensorsReader::open(&dir.join("compressor.safetensors")).unwrap();
    let mut names: Vec<String> = r.names().map(String::from).collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let (_, v) = r.read_f32(&n).unwrap();
            (n, v)
        })
        .collect()
}

fn overlay(dir: &Path, window: usize) -> Overlay {
    format!(
        "kind=learned,checkpoint={},window={window},stride=8,local=16",
        dir.display()
    )
    .parse()
    .unwrap()
}

/// Train 3 steps in one go and 2 + 1 with a resume: the same gates. The folder loads as
/// a `learned` overlay on SmolLM2; a folder of another model or geometry does not.
#[test]
fn a_trained_compressor_resumes_loads_and_is_checked() {
    let Some(model) = model_file(SMOLLM2) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let straight = recipe(tmp.path(), "straight", &model);
    let resumed = recipe(tmp.path(), "resumed", &model);
    let s = run(&straight, None);
    assert_eq!(s.final_step, 3);
    assert!(
        s.history
            .iter()
            .all(|r| r.loss.is_finite() && r.loss >= 0.0)
    );
    let first = run(&resumed, Some(2));
    assert_eq!(first.final_step, 2);
    // An unfinished training exports the compressor at its step.
    let json = std::fs::read_to_string(tmp.path().join("resumed/compressor.json")).unwrap();
    assert!(
        json.contains("\"steps\": 2,") && json.contains("\"recipe_steps\": 3"),
        "{json}"
    );
    let second = run(&resumed, None);
    assert_eq!(second.resumed_from, Some(2));
    let (a, b) = (gates(&s.model_dir), gates(&second.model_dir));
    assert_eq!(a.len(), 4 * 30, "4 tensors per layer");
    let mut moved = 0.0f32;
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(max_rel(va, vb) < 1e-5, "{na}: resumed differs");
        moved = moved.max(va.iter().fold(0.0, |m, x| m.max(x.abs())));
    }
    assert!(moved > 0.0, "training left every gate at zero");

    // The folder is a `learned` overlay of SmolLM2.
    let m = load_model_overlaid(&model, &dev(), Residency::F32, &overlay(&s.model_dir, 8)).unwrap();
    let t = Tensor::<2, Int>::from_data(
        TensorData::new((1..41).collect::<Vec<i64>>(), [1, 40]),
        &dev(),
    );
    let logits = vals(m.forward(t, &HookSpec::new()).unwrap().logits);
    assert!(logits.iter().all(|x| x.is_finite()));

    // Another geometry, another model, no folder: errors naming the key.
    let err = |o: &Overlay| {
        load_model_overlaid(&model, &dev(), Residency::F32, o)
            .err()
            .expect("must be refused")
            .to_string()
    };
    let e = err(&overlay(&s.model_dir, 16));
    assert!(
        e.contains("compression.window") && e.contains("trained with window = 8"),
        "{e}"
    );
    let other = tmp.path().join("other-model");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::copy(
        s.model_dir.join("compressor.safetensors"),
        other.join("compressor.safetensors"),
    )
    .unwrap();
    let json = std::fs::read_to_string(s.model_dir.join("compressor.json")).unwrap();
    std::fs::write(
        other.join("compressor.json"),
        json.replace("\"n_layers\": 30", "\"n_layers\": 18"),
    )
    .unwrap();
    let e = err(&overlay(&other, 8));
    assert!(
        e.contains("compression.checkpoint") && e.contains("n_layers: 18 vs 30"),
        "{e}"
    );
    let e = err(&overlay(&tmp.path().join("nowhere"), 8));
    assert!(
        e.contains("compression.checkpoint") && e.contains("compressor.json"),
        "{e}"
    );
}

#[test]
fn compressor_recipe_errors_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("local = 16", "local = 200", "compressor.local"),
        (
            "checkpoint_every = 1",
            "checkpoint_every = 0",
            "train.checkpoint_every",
        ),
        ("batch = 2", "batch = 0", "data.batch"),
        (
            "seed = 3",
            "seed = 3\ntemperature = 0.0",
            "data.temperature",
        ),
        ("batch_size = 1", "batch_size = 1\ninit = \"x\"", "train"),
        ("stride = 8", "stride = 8\nstrides = 2", "strides"),
        ("name = \"bad\"", "name = \"../bad\"", "compressor.name"),
    ];
    for (i, (from, to, key)) in cases.iter().enumerate() {
        let p = recipe(tmp.path(), "bad", Path::new("/no/model.gguf"));
        let text = std::fs::read_to_string(&p).unwrap().replacen(from, to, 1);
        let p = tmp.path().join(format!("case-{i}.toml"));
        std::fs::write(&p, text).unwrap();
        let e = CompressorFile::load(&p).expect_err(key).to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
}

#[test]
fn sampling_refuses_non_finite_logits_and_follows_the_temperature() {
    use phaselens::train::compressor::data::draw;
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    assert_eq!(draw(&[0.0, f32::NAN, 1.0], 1.0, &mut rng), None);
    assert_eq!(draw(&[0.0, f32::INFINITY], 1.0, &mut rng), None);
    assert_eq!(draw(&[], 1.0, &mut rng), None);
    // A cold temperature takes the argmax; a hot one spreads over both tokens.
    let cold: Vec<u32> = (0..50)
        .map(|_| draw(&[0.0, 2.0], 0.01, &mut rng).unwrap())
        .collect();
    assert!(cold.iter().all(|&t| t == 1));
    let hot: Vec<u32> = (0..200)
        .map(|_| draw(&[0.0, 0.1], 10.0, &mut rng).unwrap())
        .collect();
    let ones = hot.iter().filter(|&&t| t == 1).count();
    assert!((60..140).contains(&ones), "{ones} of 200");
}
