//! Patch one attention head from a corrupted run into a clean run of a shipped organism,
//! through phaselens's library face (`HookSpec` / `Action::Patch` / `Scope`).
//!
//! `cargo run -- PHASELENS_CHECKOUT [DEVICE]` (DEVICE: cpu, tch-cpu, wgpu, ...).

use std::path::PathBuf;
use std::sync::Arc;

use phaselens::prelude::*;
use phaselens::tasks::prompts::{group_examples, paired_prompts};
use phaselens::tasks::{KvEvalConfig, Protocol, generate_eval_set};
use phaselens::train::OrganismFile;

/// `[batch, pos, vocab]` logits of batch row 0 at `pos`, as host floats.
fn logits_at(logits: Tensor<3>, pos: usize) -> Vec<f32> {
    let vocab = logits.dims()[2];
    let v = logits
        .into_data()
        .try_into_vec::<f32>()
        .expect("f32 logits");
    v[pos * vocab..(pos + 1) * vocab].to_vec()
}

fn main() -> phaselens::Result<()> {
    let mut args = std::env::args().skip(1);
    let root = PathBuf::from(
        args.next()
            .expect("usage: phaselens-dependent CHECKOUT [DEVICE]"),
    );
    let device_spec: DeviceSpec = args.next().as_deref().unwrap_or("cpu").parse()?;
    let device = device_spec.device()?;
    let recipe_path = root.join("experiments/organisms/kvc-w8s8.toml");
    let recipe = OrganismFile::load(&recipe_path)?;
    let model = load_model(&recipe.model_dir(&recipe_path), &device)?;
    let (space, prompt) = (recipe.task.vocab.build()?, recipe.task.train.prompt.clone());
    let period = recipe.task.train.period;
    let cfg = KvEvalConfig {
        prompt: prompt.clone(),
        period,
        protocol: Protocol::PrefixPadding,
        n_logical: 2 * period.len() * period.len(),
        seed: 5,
    };
    let set = generate_eval_set(&space, &cfg)?;
    let assign = if prompt.assign {
        space.assign().len()
    } else {
        0
    };
    let (pair, _) = paired_prompts(
        &group_examples(&set, 0, 1),
        &space,
        assign,
        prompt.key_len,
        5,
    )?;
    let (pos, good, bad) = (
        pair.targets[0].positions[0],
        pair.targets[0].answers[0],
        pair.targets[1].answers[0],
    );
    let [clean, corrupt] = [0, 1].map(|r| pair.tokens_of(&[r], &device));

    let captures = HookSpec::new()
        .capture("blocks.0.hook_resid_pre")?
        .capture("blocks.*.attn.hook_z")?;
    let corrupt_run = model.forward(corrupt, &captures)?;
    let corrupt_logits = logits_at(corrupt_run.logits, pos);
    let source = Arc::new(corrupt_run.cache);
    let ld = |l: &[f32]| l[good as usize] - l[bad as usize];
    let clean_logits = logits_at(model.forward(clean.clone(), &HookSpec::new())?.logits, pos);

    // The whole residual stream into layer 0 from the corrupted run: the corrupted logits.
    let all = HookSpec::new().intervene(
        "blocks.0.hook_resid_pre",
        Action::Patch(source.clone()),
        Scope::all(),
    )?;
    let patched = logits_at(model.forward(clean.clone(), &all)?.logits, pos);
    let err = patched
        .iter()
        .zip(&corrupt_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        err < 1e-4,
        "patching hook_resid_pre of layer 0 should reproduce the corrupted run (max error {err})"
    );

    // One head of the last layer at the read position.
    let last = model.info().layers.len() - 1;
    let z = format!("blocks.{last}.attn.hook_z");
    let one = HookSpec::new().intervene(
        &z,
        Action::Patch(source),
        Scope::heads([0]).with_positions([pos]),
    )?;
    let head = logits_at(model.forward(clean, &one)?.logits, pos);
    println!(
        "{device_spec}: LD clean {:.3}, corrupted {:.3}; whole stream patched {:.3} (max error {err:.1e}); L{last}.H0 at position {pos} patched {:.3}",
        ld(&clean_logits),
        ld(&corrupt_logits),
        ld(&patched),
        ld(&head)
    );
    Ok(())
}
