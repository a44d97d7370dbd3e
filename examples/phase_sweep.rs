//! Accuracy by phase of a shipped organism, through the library face.
//!
//! `cargo run --example phase_sweep --features all-backends [-- ORGANISM_RECIPE]`
//! (default `experiments/organisms/kvc-w8s8.toml`): a phase-matched evaluation set
//! (every logical example rendered at each phase of the target key), one batched
//! forward per phase group, top-1 accuracy of the single final query.

use std::path::PathBuf;

use phaselens::prelude::*;
use phaselens::tasks::{KvEvalConfig, Protocol, generate_eval_set};
use phaselens::train::OrganismFile;

fn main() -> phaselens::Result<()> {
    let recipe_path = std::env::args().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("experiments/organisms/kvc-w8s8.toml"),
        PathBuf::from,
    );
    let recipe = OrganismFile::load(&recipe_path)?;
    let device = DeviceSpec::Cpu.device()?;
    let model = load_model(&recipe.model_dir(&recipe_path), &device)?;
    let space = recipe.task.vocab.build()?;
    let period = recipe.task.train.period;
    let cfg = KvEvalConfig {
        prompt: recipe.task.train.prompt.clone(),
        period,
        protocol: Protocol::PrefixPadding,
        n_logical: 2 * (period.len() * period.len()), // the smallest matched design
        seed: 7,
    };
    let set = generate_eval_set(&space, &cfg)?;
    println!(
        "{}: {} logical examples per phase",
        recipe.organism.name, cfg.n_logical
    );
    let mut accs = Vec::new();
    for r in 0..period.len() as u32 {
        let group: Vec<_> = set.group(r).collect();
        let len = group[0].tokens.len();
        let ids: Vec<i64> = group
            .iter()
            .flat_map(|e| e.tokens.iter().map(|&t| t as i64))
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [group.len(), len]), &device);
        let logits = model.forward(tokens, &HookSpec::new())?.logits; // [batch, pos, vocab]
        let vocab = logits.dims()[2];
        let values = logits
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| Error::Other(format!("{e:?}")))?;
        let correct = group
            .iter()
            .enumerate()
            .filter(|(b, e)| {
                let at = (b * len + e.target_positions[0]) * vocab;
                argmax(&values[at..at + vocab]) == e.answers[0] as usize
            })
            .count();
        let acc = correct as f64 / group.len() as f64;
        println!("phase {r}: {correct:>3}/{} = {acc:.3}", group.len());
        accs.push(acc);
    }
    let (lo, hi) = accs
        .iter()
        .fold((1.0f64, 0.0f64), |(l, h), &a| (l.min(a), h.max(a)));
    println!("gap (best - worst): {:.1} pp", 100.0 * (hi - lo));
    Ok(())
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(0, |best, (i, &v)| if v > row[best] { i } else { best })
}
