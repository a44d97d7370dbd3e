//! Cache activations (also windowed to one position, and the forward in bf16), zero-ablate one head, patch one head at one position from a
//! corrupted run, and sweep every layer x head x position (TransformerLens'
//! `get_act_patch_attn_head_out_by_pos`), through the library face.
//!
//! `cargo run --example cache_and_patch --features all-backends`
//!
//! The prompt pair: a clean KV-retrieval prompt of the shipped kvc-w8s8 organism and
//! the same prompt with the scored binding's value replaced (so the answer differs).
//! The metric is the logit difference LD = logit(clean answer) - logit(corrupted
//! answer) at the read position.

use std::path::PathBuf;

use phaselens::prelude::*;
use phaselens::tasks::prompts::{group_examples, paired_prompts};
use phaselens::tasks::{KvEvalConfig, Protocol, generate_eval_set};
use phaselens::train::OrganismFile;

/// One prompt's tokens as a `[1, len]` tensor.
fn row(tokens: &[u32], device: &burn::tensor::Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    Tensor::from_data(TensorData::new(ids, [1, tokens.len()]), device)
}

/// LD at `pos` of every batch row of `[batch, pos, vocab]` logits.
fn logit_diffs(logits: Tensor<3>, pos: usize, a: u32, b: u32) -> Result<Vec<f32>> {
    let [batch, _, vocab] = logits.dims();
    let v = logits
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| Error::Other(format!("{e:?}")))?;
    let len = v.len() / (batch * vocab);
    Ok((0..batch)
        .map(|r| {
            let at = (r * len + pos) * vocab;
            v[at + a as usize] - v[at + b as usize]
        })
        .collect())
}

fn main() -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let recipe_path = root.join("experiments/organisms/kvc-w8s8.toml");
    let recipe = OrganismFile::load(&recipe_path)?;
    let device = DeviceSpec::Cpu.device()?;
    let model = load_model(&recipe.model_dir(&recipe_path), &device)?;
    let info = model.info();
    let space = recipe.task.vocab.build()?;
    let prompt = recipe.task.train.prompt.clone();
    let period = recipe.task.train.period;
    let cfg = KvEvalConfig {
        prompt: prompt.clone(),
        period,
        protocol: Protocol::PrefixPadding,
        n_logical: 2 * period.len() * period.len(),
        seed: 3,
    };
    let set = generate_eval_set(&space, &cfg)?;
    // One logical example at phase 0: clean = prompt 0, corrupted = prompt 1.
    let ex = group_examples(&set, 0, 1);
    let assign = if prompt.assign {
        space.assign().len()
    } else {
        0
    };
    let (pair, _) = paired_prompts(&ex, &space, assign, prompt.key_len, 3)?;
    let len = pair.len;
    let (clean, corrupt) = (&pair.tokens[..len], &pair.tokens[len..]);
    let target = &pair.targets[0];
    let (pos, good, bad) = (
        target.positions[0],
        target.answers[0],
        pair.targets[1].answers[0],
    );

    // 1. Cache every head's output (hook_z: [batch, pos, head, d_head]) on both runs.
    let spec = HookSpec::new().capture("blocks.*.attn.hook_z")?;
    let clean_run = model.forward(row(clean, &device), &spec)?;
    let corrupt_run = model.forward(row(corrupt, &device), &spec)?;
    let ld_clean = logit_diffs(clean_run.logits, pos, good, bad)?[0];
    let ld_corrupt = logit_diffs(corrupt_run.logits, pos, good, bad)?[0];
    println!(
        "{} hook points cached; LD clean {ld_clean:.3}, corrupted {ld_corrupt:.3}",
        clean_run.cache.len()
    );

    // 1b. The same captures at the read position only: `capture_window` copies that
    //     position out of each per-token activation as it is captured, so the whole
    //     ones are freed with the forward (what the patching runner's base run does at
    //     long context, where every position of hook_z is gigabytes).
    let narrow = HookSpec::new()
        .capture("blocks.*.attn.hook_z")?
        .capture_window(pos..pos + 1);
    let narrow_run = model.forward(row(clean, &device), &narrow)?;
    let (whole, kept) = (
        clean_run.cache.get_name("blocks.0.attn.hook_z")?,
        narrow_run.cache.get_name("blocks.0.attn.hook_z")?,
    );
    let per: usize = whole.shape()[2..].iter().product();
    let same = kept.to_vec() == whole.to_vec()[pos * per..(pos + 1) * per];
    println!(
        "hook_z of layer 0 windowed to position {pos}: shape {:?} of {:?}, equal to the whole capture there: {same}",
        kept.shape(),
        whole.shape()
    );
    if !same {
        return Err(Error::Other("the windowed capture differs".into()));
    }

    // 1c. The clean forward again with the matrix products in bf16 (bf16 operands, f32
    //     sums; the rest f32: `--dtype bf16`), for this thread while the closure runs.
    let bf16_logits =
        phaselens::model::precision::with_compute(phaselens::model::ComputeDtype::Bf16, || {
            model.forward(row(clean, &device), &HookSpec::new())
        })?
        .logits;
    let ld_bf16 = logit_diffs(bf16_logits, pos, good, bad)?[0];
    println!("LD clean with bf16 matrix products: {ld_bf16:.3} (f32: {ld_clean:.3})");
    if !ld_bf16.is_finite() {
        return Err(Error::Other("the bf16 forward is not finite".into()));
    }

    // 2. Zero-ablate head 0 of the last layer on the clean prompt.
    let last = info.layers.len() - 1;
    let z = format!("blocks.{last}.attn.hook_z");
    let ablate = HookSpec::new().intervene(&z, Action::Zero, Scope::heads([0]))?;
    let ld = logit_diffs(
        model.forward(row(clean, &device), &ablate)?.logits,
        pos,
        good,
        bad,
    )?[0];
    println!("zero-ablate L{last}.H0: LD {ld:.3}");

    // 3. Patch that head at the read position from the corrupted run into the clean run.
    let source = std::sync::Arc::new(corrupt_run.cache);
    let patch = HookSpec::new().intervene(
        &z,
        Action::Patch(source.clone()),
        Scope::heads([0]).with_positions([pos]),
    )?;
    let ld = logit_diffs(
        model.forward(row(clean, &device), &patch)?.logits,
        pos,
        good,
        bad,
    )?[0];
    println!("patch L{last}.H0 at position {pos} from the corrupted run: LD {ld:.3}");

    // 4. Denoising sweep: every layer x head x position, the clean head output patched
    //    into the corrupted run; one batched forward per (layer, head), row p patches
    //    position p. Normalised: 1 = this head at this position alone restores LD.
    let clean_cache = clean_run.cache;
    let mut table = Vec::new(); // [layer, head, pos], row-major
    let batch_ids: Vec<u32> = corrupt.iter().copied().cycle().take(len * len).collect();
    let ids: Vec<i64> = batch_ids.iter().map(|&t| t as i64).collect();
    for l in 0..info.layers.len() {
        let name = format!("blocks.{l}.attn.hook_z");
        let z_clean = clean_cache.get_name(&name)?.clone();
        let heads = z_clean.shape()[2];
        for h in 0..heads {
            let rows = (0..len)
                .map(|p| RowScope {
                    row: p,
                    heads: Some(vec![h]),
                    positions: Some(vec![p]),
                })
                .collect();
            let spec = HookSpec::new().intervene(
                &name,
                Action::Replace(z_clean.clone()),
                Scope::rows(rows),
            )?;
            let tokens =
                Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [len, len]), &device);
            let lds = logit_diffs(model.forward(tokens, &spec)?.logits, pos, good, bad)?;
            table.extend(
                lds.iter()
                    .map(|ld| (ld - ld_corrupt) / (ld_clean - ld_corrupt)),
            );
        }
    }
    let heads = table.len() / (info.layers.len() * len);
    let (best, &v) =
        table.iter().enumerate().fold(
            (0, &f32::MIN),
            |b, (i, v)| if *v > *b.1 { (i, v) } else { b },
        );
    let (l, h, p) = (best / (heads * len), best / len % heads, best % len);
    println!(
        "[layer, head, pos] = [{}, {heads}, {len}] table; strongest cell L{l}.H{h} at position {p} (key at {}): {v:.3}",
        info.layers.len(),
        ex[0].target_key_pos
    );
    Ok(())
}
