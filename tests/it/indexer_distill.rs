//! `[train] indexer_distill` (src/train/distill.rs): the lightning indexers of a
//! DeepSeek-V4 organism learn the main attention's distribution over the entries they
//! select, and nothing else learns from that loss.
//! - The loss's gradient reaches exactly the indexers' tensors, and the answer loss's
//!   gradient reaches everything but them.
//! - Trained without it, the indexer keeps its initial weights: its top-k passes no
//!   gradient. Trained with it, the indexer's weights move and its KL to the attention
//!   falls.
//! - Models without an indexer, and negative weights, are refused, naming the key.

use std::path::{Path, PathBuf};

use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::DeepseekV4Model;
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::weights::param_id;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::output::Table;
use phaselens::train::{ModelConfig, OrganismFile};

fn shipped(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("experiments/organisms/{name}.toml")),
    )
    .unwrap()
}

/// The shipped v4pro-mini recipe (every closed entry selected: the dense warm-up
/// regime) with a short `[train]` section plus `extra` lines, written into `dir`.
fn recipe(dir: &Path, extra: &str) -> PathBuf {
    let text: String = shipped("v4pro-mini")
        .lines()
        .map(|l| {
            let key = l.split('=').next().unwrap_or("").trim();
            match key {
                "batch_size" => "batch_size = 4".to_string(),
                "steps" => format!("steps = 16\n{extra}"),
                "warmup_steps" => "warmup_steps = 2".to_string(),
                "checkpoint_every" => "checkpoint_every = 16".to_string(),
                "name" => format!("{l}\nrun_dir = \"run\""),
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let r = dir.join("v4pro-mini.toml");
    std::fs::write(&r, text).unwrap();
    r
}

fn train(recipe: &Path) -> std::process::Output {
    crate::common::phaselens(&["train", recipe.to_str().unwrap()])
}

fn tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r = SafetensorsReader::open(&dir.join("model.safetensors")).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = r
        .names()
        // Float tensors (the hash-routing table is I64 and never trains).
        .filter_map(|n| r.read_f32(n).ok().map(|(_, v)| (n.to_string(), v)))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn indexer_distillation_trains_the_indexers_alone() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (ra, rb) = (
        recipe(a.path(), ""),
        recipe(b.path(), "indexer_distill = 1.0"),
    );
    for r in [&ra, &rb] {
        let o = train(r);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    // The initial weights (the recipe's seeded init), saved as the trainer saves.
    let f = OrganismFile::load(&ra).unwrap();
    let ModelConfig::DeepseekV4 { json, resolved } = &f.model else {
        panic!("v4pro-mini is a DeepSeek-V4 organism");
    };
    let init_dir = a.path().join("init");
    let m = phaselens::model::deepseek_v4::DeepseekV4Model::new(
        resolved,
        &Vb::new(&RandomInit { seed: f.train.seed }, &Device::flex()),
    )
    .unwrap();
    phaselens::model::deepseek_v4::save(&m, json, &init_dir).unwrap();
    let (init, plain, distilled) = (
        tensors(&init_dir),
        tensors(&a.path().join("v4pro-mini")),
        tensors(&b.path().join("v4pro-mini")),
    );
    let (mut indexer, mut moved, mut main_drift) = (0, 0, 0.0f32);
    for (((name, i), (_, p)), (_, d)) in init.iter().zip(&plain).zip(&distilled) {
        if name.contains(".indexer.") {
            indexer += 1;
            assert_eq!(i, p, "{name}: the indexer learned without distillation");
            if max_diff(i, d) > 1e-4 {
                moved += 1;
            }
        } else {
            main_drift = main_drift.max(max_diff(p, d));
        }
    }
    let trained = init
        .iter()
        .zip(&plain)
        .filter(|((n, i), (_, p))| !n.contains(".indexer.") && max_diff(i, p) > 1e-3)
        .count();
    eprintln!(
        "{indexer} indexer tensors, {moved} moved by distillation; {trained} other tensors trained; largest difference of the others between the runs {main_drift:.2e}"
    );
    assert!(indexer >= 5, "{indexer} indexer tensors");
    assert!(
        moved >= 3,
        "only {moved} of {indexer} indexer tensors moved"
    );
    assert!(trained > 20, "{trained} tensors trained");
    // The rest is not compared between the runs: the distilled run's forward computes
    // its CSA layer as one dense block (for the captured pattern), and Adam turns that
    // rounding into steps of up to ~lr on weights whose gradients are near zero (seen:
    // 7e-3 on layer 0's mHC). Where the loss's gradient goes is checked directly in
    // `the_distillation_gradient_reaches_the_indexers_alone`.
    // The KL is logged (only by the distilled run) and falls.
    let t = Table::read_arrow(b.path().join("v4pro-mini/training/loss.arrow")).unwrap();
    let kl: Vec<f64> = t
        .float64("indexer_kl")
        .unwrap()
        .iter()
        .map(|v| v.unwrap())
        .collect();
    // Batches differ from step to step: compare the first and last quarters.
    let q = kl.len() / 4;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&kl[..q]), mean(&kl[kl.len() - q..]));
    eprintln!("indexer KL: first {q} steps {first:.4}, last {q} {last:.4}: {kl:?}");
    assert!(first > 0.0 && last < 0.8 * first, "KL {first} -> {last}");
    let t = Table::read_arrow(a.path().join("v4pro-mini/training/loss.arrow")).unwrap();
    assert!(!t.column_names().contains(&"indexer_kl"));
}

#[test]
fn indexer_distill_is_refused_without_an_indexer_or_below_zero() {
    let d = tempfile::tempdir().unwrap();
    let kvc = shipped("kvc-w8s8").replace("[train]\n", "[train]\nindexer_distill = 0.5\n");
    let r = d.path().join("kvc.toml");
    std::fs::write(&r, kvc).unwrap();
    let e = format!("{:#}", OrganismFile::load(&r).unwrap_err());
    assert!(
        e.contains("[train] indexer_distill = 0.5") && e.contains("no lightning indexer"),
        "{e}"
    );
    let r = recipe(d.path(), "indexer_distill = -1.0");
    let e = format!("{:#}", OrganismFile::load(&r).unwrap_err());
    assert!(e.contains("indexer_distill must be >= 0"), "{e}");
}

/// Which saved tensors have a gradient in `grads` (by their parameter ids).
fn with_gradient(grads: &GradientsParams, names: &[(String, usize)]) -> Vec<String> {
    names
        .iter()
        .filter(|(n, rank)| {
            let id = param_id(n);
            match rank {
                1 => grads.get::<1>(id).is_some(),
                2 => grads.get::<2>(id).is_some(),
                3 => grads.get::<3>(id).is_some(),
                r => panic!("{n}: rank {r}"),
            }
        })
        .map(|(n, _)| n.clone())
        .collect()
}

#[test]
fn the_distillation_gradient_reaches_the_indexers_alone() {
    let d = tempfile::tempdir().unwrap();
    let f = OrganismFile::load(&recipe(d.path(), "indexer_distill = 1.0")).unwrap();
    let layers = f.distill_layers();
    assert_eq!(layers, vec![2], "v4pro-mini's CSA layer");
    let ModelConfig::DeepseekV4 { json, resolved } = &f.model else {
        panic!("v4pro-mini is a DeepSeek-V4 organism");
    };
    let ad = Device::flex().autodiff();
    let build = || DeepseekV4Model::new(resolved, &Vb::new(&RandomInit { seed: 5 }, &ad)).unwrap();
    // Names and ranks of the float tensors, as saved.
    phaselens::model::deepseek_v4::save(&build(), json, d.path()).unwrap();
    let r = SafetensorsReader::open(&d.path().join("model.safetensors")).unwrap();
    let names: Vec<(String, usize)> = r
        .names()
        .filter_map(|n| r.read_f32(n).ok().map(|(s, _)| (n.to_string(), s.len())))
        .collect();
    let indexer: Vec<String> = names
        .iter()
        .filter(|(n, _)| n.contains(".indexer."))
        .map(|(n, _)| n.clone())
        .collect();
    assert!(indexer.len() >= 5, "{indexer:?}");
    let ids: Vec<i64> = (0..2 * 41).map(|i| (i * 37 % 128) as i64).collect();
    let tokens = || Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [2, 41]), &ad);
    // The distillation loss alone.
    let m = build();
    let out = m
        .forward(tokens(), &phaselens::train::distill::spec(&layers))
        .unwrap();
    let kl = phaselens::train::distill::indexer_kl(&out.cache, &layers).unwrap();
    let kl_value = kl.clone().into_scalar::<f32>();
    assert!(kl_value > 0.0 && kl_value.is_finite(), "KL {kl_value}");
    let grads = GradientsParams::from_grads(kl.backward(), &m);
    let reached = with_gradient(&grads, &names);
    assert_eq!(reached, indexer, "the distillation gradient's tensors");
    assert_eq!(
        grads.len(),
        indexer.len(),
        "gradients beyond the saved tensors"
    );
    // The answer loss (all positions' logits here): everything but the indexers.
    let m = build();
    let logits = m.forward(tokens(), &HookSpec::new()).unwrap().logits;
    let grads = GradientsParams::from_grads(logits.powi_scalar(2).mean().backward(), &m);
    let reached = with_gradient(&grads, &names);
    assert!(
        reached.iter().all(|n| !n.contains(".indexer.")),
        "{reached:?}"
    );
    let missed: Vec<&String> = names
        .iter()
        .map(|(n, _)| n)
        .filter(|n| !n.contains(".indexer.") && !reached.contains(n))
        .collect();
    eprintln!(
        "answer loss: {} of {} tensors, none of the {} indexer tensors; without a gradient: {missed:?}",
        reached.len(),
        names.len(),
        indexer.len()
    );
    assert!(reached.len() > 100, "{}", reached.len());
    // Buffers (the routers' score-correction biases) take no gradient.
    assert!(
        missed.iter().all(|n| n.contains("e_score_correction_bias")),
        "{missed:?}"
    );
}
