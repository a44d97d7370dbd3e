//! Shared by the runner tests: tiny random kvc organisms saved to a temp dir, tiny
//! experiment TOMLs, options that keep outputs inside the temp dir.

use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::{Tensor, TensorData};
use phaselens::model::kvc::{KvcConfig, KvcModel};
use phaselens::model::save_kvc;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::runner::patching::{Prompts, Target};
use phaselens::runner::{ProgressMode, RunOptions};

use super::dev;

/// A tiny chunk-compressed config (vocab 128 = the synthetic token space, raw tail 2).
pub fn tiny(layers: usize, heads: usize, kv: usize, window: usize, stride: usize) -> KvcConfig {
    KvcConfig {
        vocab_size: 128,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: kv,
        ..KvcConfig::tiny()
    }
    .with_compression(window, stride, 2)
}

/// A random model whose gate biases are random too (so every gate offset matters).
pub fn random_model(cfg: &KvcConfig, seed: u64) -> KvcModel {
    let mut m = KvcModel::new(cfg, &Vb::new(&RandomInit { seed }, &dev())).unwrap();
    let mut k = 0u64;
    for b in m.blocks.iter_mut() {
        if let Some(c) = b.attn.compressor.as_mut() {
            for p in [&mut c.key_gate_bias, &mut c.value_gate_bias]
                .into_iter()
                .flatten()
            {
                k += 1;
                let dims = p.dims();
                let n: usize = dims.iter().product();
                let v: Vec<f32> = (0..n)
                    .map(|i| {
                        (((i as u64 * 7919 + seed * 31 + k * 104729) % 1000) as f32 / 1000.0 - 0.5)
                            * 4.0
                    })
                    .collect();
                // Keep the parameter id: saving maps ids to the builder's names.
                *p = Param::initialized(p.id, Tensor::from_data(TensorData::new(v, dims), &dev()));
            }
        }
    }
    m
}

/// Save `cfg` as organism `name` under `dir` (model dir + recipe TOML with a small
/// prompt format, period = stride). Returns the recipe path.
pub fn organism(dir: &Path, name: &str, cfg: &KvcConfig, seed: u64) -> PathBuf {
    save_kvc(&random_model(cfg, seed), &dir.join(name)).unwrap();
    write_recipe(dir, name, cfg)
}

/// Only the recipe (an untrained organism).
pub fn write_recipe(dir: &Path, name: &str, cfg: &KvcConfig) -> PathBuf {
    let c = cfg.compression.as_ref().unwrap();
    let text = format!(
        r#"[organism]
name = "{name}"

[model]
model_type = "phaselens-kvc"
vocab_size = {vocab}
d_model = {d}
n_layers = {l}
n_heads = {h}
n_kv_heads = {kv}
d_head = {dh}
d_ff = {ff}
sink = true
init_std = 0.3
attention = "compressed"
compression = {{ window = {w}, stride = {s}, local_tail = {tail}, gate = "scalar", gate_bias = true }}

[task.vocab]
kind = "synthetic"

[task.train]
period = {s}
prompt = {{ n_bindings = 8, n_queries = 2 }}
"#,
        vocab = cfg.vocab_size,
        d = cfg.d_model,
        l = cfg.n_layers,
        h = cfg.n_heads,
        kv = cfg.n_kv_heads,
        dh = cfg.d_head(),
        ff = cfg.d_ff,
        w = c.window,
        s = c.stride,
        tail = c.local_tail,
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// Write an experiment TOML into `dir`.
pub fn experiment(dir: &Path, file: &str, text: &str) -> PathBuf {
    let p = dir.join(file);
    std::fs::write(&p, text).unwrap();
    p
}

/// Outputs inside `dir`, no progress output.
pub fn opts(dir: &Path) -> RunOptions {
    RunOptions {
        data_root: dir.join("notebooks-data"),
        reports_root: dir.join("reports"),
        progress: ProgressMode::Hidden,
        ..RunOptions::default()
    }
}

/// The files directly in `dir` with extension `ext`.
pub fn files_with(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == ext))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Like [`organism`], with a token space of two value atoms (ids 64, 65) and an LM
/// head that only scores those two: a random model then answers correctly about
/// half the time, depending on its heads, so accuracy-based effects are defined.
pub fn two_value_organism(dir: &Path, name: &str, cfg: &KvcConfig, seed: u64) -> PathBuf {
    let mut m = random_model(cfg, seed);
    if let Some(h) = m.lm_head.as_mut() {
        let dims = h.weight.dims();
        let w: Vec<f32> = h
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        let w: Vec<f32> = w
            .chunks(dims[1])
            .enumerate()
            .flat_map(|(tok, row)| {
                let keep = tok == 64 || tok == 65;
                row.iter().map(move |x| if keep { *x } else { 0.0 })
            })
            .collect();
        h.weight = Param::initialized(
            h.weight
                .dense()
                .expect("a random model's weights are dense")
                .id,
            Tensor::from_data(TensorData::new(w, dims), &dev()),
        )
        .into();
    }
    save_kvc(&m, &dir.join(name)).unwrap();
    let p = write_recipe(dir, name, cfg);
    let text = std::fs::read_to_string(&p).unwrap().replace(
        "kind = \"synthetic\"",
        "kind = \"synthetic\"\nvalues = { start = 64, end = 66 }",
    );
    std::fs::write(&p, text).unwrap();
    p
}

/// Two clean prompts of `len` tokens and their corrupted partners: prompt i's partner
/// (index 2 + i) changes one token, at `first_changed + i`. Targets read the last
/// position with answers 64 / 65 swapped between the pairs (group 0 and group 1).
pub fn pair_prompts(len: usize, first_changed: usize) -> Prompts {
    let mut tokens = Vec::new();
    for i in 0..2u32 {
        tokens.extend((0..len as u32).map(|p| (p * 7 + i * 13) % 60 + 1));
    }
    let clean = tokens.clone();
    for i in 0..2 {
        let mut t = clean[i * len..(i + 1) * len].to_vec();
        t[first_changed + i] = 100 + i as u32;
        tokens.extend(t);
    }
    let tg = |a: u32, b: u32| Target {
        positions: vec![len - 1],
        answers: vec![a],
        alt: Some(b),
    };
    Prompts {
        len,
        tokens,
        targets: vec![tg(64, 65), tg(64, 65), tg(65, 64), tg(65, 64)],
        source: vec![Some(2), Some(3), Some(0), Some(1)],
        group: vec![0, 0, 1, 1],
    }
}
