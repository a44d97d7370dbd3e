//! Prompt batches for the routine: one phase group of an evaluation set, clean only
//! or as clean/corrupted pairs.
//!
//! A corrupted prompt is its clean prompt with the value of the scored (target)
//! binding replaced, in the haystack and in the query's teacher-forced answer, by
//! another value whose first token differs; nothing else changes, so the answer
//! token differs and the logit difference `logit(clean answer) - logit(corrupted
//! answer)` at the read position measures which binding the model retrieved. The
//! replacement value is drawn per logical example (ChaCha8 seeded with the task seed
//! and the logical id), so every phase rendering of an example gets the same one.
//!
//! Prompts are cut after their last target position: a causal model's outputs up to
//! there do not depend on later tokens, and the layers run on fewer positions.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::tasks::{KvEvalSet, KvExample, TokenSpace};

use super::patching::{Prompts, Target};

/// Per prompt of a batch: which logical example, which phase, clean or corrupted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptMeta {
    pub logical: u64,
    pub phase: u32,
    pub corrupted: bool,
}

/// The examples of phase group `r` restricted to the first `n` logical examples.
pub fn group_examples(set: &KvEvalSet, r: u32, n: usize) -> Vec<&KvExample> {
    set.group(r).take(n).collect()
}

fn cut_len(examples: &[&KvExample]) -> usize {
    examples
        .iter()
        .map(|e| e.target_positions.last().copied().unwrap_or(0) + 1)
        .max()
        .unwrap_or(1)
}

/// Clean prompts (one group id per prompt: `group_of(i)`).
pub fn clean_prompts(
    examples: &[&KvExample],
    group_of: impl Fn(usize) -> usize,
) -> (Prompts, Vec<PromptMeta>) {
    let len = cut_len(examples);
    let mut tokens = Vec::with_capacity(examples.len() * len);
    let mut targets = Vec::new();
    let mut meta = Vec::new();
    for e in examples {
        tokens.extend_from_slice(&e.tokens[..len]);
        targets.push(Target {
            positions: e.target_positions.clone(),
            answers: e.answers.clone(),
            alt: None,
        });
        meta.push(PromptMeta {
            logical: e.logical_id,
            phase: e.phase.residue(),
            corrupted: false,
        });
    }
    let n = examples.len();
    (
        Prompts {
            len,
            tokens,
            targets,
            source: vec![None; n],
            group: (0..n).map(group_of).collect(),
        },
        meta,
    )
}

/// The corrupted value of a logical example: `value_len` value atoms whose first
/// differs from `clean[0]`.
pub fn corrupt_value(
    space: &TokenSpace,
    clean: &[u32],
    seed: u64,
    logical: u64,
) -> Result<Vec<u32>> {
    let atoms = space.value_atoms();
    if atoms.len() < 2 {
        return Err(Error::Other(
            "the token space needs at least two value atoms to corrupt a binding".into(),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_c0de);
    rng.set_stream(logical + 1);
    let mut v: Vec<u32> = (0..clean.len())
        .map(|_| atoms[rng.random_range(0..atoms.len())])
        .collect();
    while v[0] == clean[0] {
        v[0] = atoms[rng.random_range(0..atoms.len())];
    }
    Ok(v)
}

/// Clean prompts `0..n` followed by their corrupted versions `n..2n`; prompt `i`
/// and `n + i` are each other's source. Groups: 0 = clean, 1 = corrupted.
pub fn paired_prompts(
    examples: &[&KvExample],
    space: &TokenSpace,
    assign_len: usize,
    key_len: usize,
    seed: u64,
) -> Result<(Prompts, Vec<PromptMeta>)> {
    let (clean, clean_meta) = clean_prompts(examples, |_| 0);
    let n = examples.len();
    let len = clean.len;
    let mut tokens = clean.tokens.clone();
    let mut targets = clean.targets.clone();
    let mut meta = clean_meta.clone();
    for (i, e) in examples.iter().enumerate() {
        let q = e.scored_query();
        let b = &e.bindings[q.binding];
        let v = &b.value;
        let v2 = corrupt_value(space, v, seed, e.logical_id)?;
        let mut t: Vec<u32> = e.tokens[..len].to_vec();
        let vpos = b.key_pos + key_len + assign_len;
        for (k, (&old, &new)) in v.iter().zip(&v2).enumerate() {
            let p = vpos + k;
            if t.get(p) != Some(&old) {
                return Err(Error::Other(format!(
                    "logical example {}: expected value token {old} at position {p} (binding {} of the prompt format)",
                    e.logical_id, q.binding
                )));
            }
            t[p] = new;
        }
        // The query's teacher-forced answer tokens that fall inside the cut prompt.
        for (k, &tp) in e.target_positions.iter().enumerate() {
            let p = tp + 1;
            if p < len && k + 1 < v.len() {
                t[p] = v2[k];
            }
        }
        tokens.extend_from_slice(&t);
        targets[i].alt = Some(v2[0]);
        targets.push(Target {
            positions: e.target_positions.clone(),
            answers: v2.clone(),
            alt: Some(v[0]),
        });
        meta.push(PromptMeta {
            corrupted: true,
            ..clean_meta[i].clone()
        });
    }
    let source = (0..2 * n).map(|i| Some((i + n) % (2 * n))).collect();
    let group = (0..2 * n).map(|i| usize::from(i >= n)).collect();
    Ok((
        Prompts {
            len,
            tokens,
            targets,
            source,
            group,
        },
        meta,
    ))
}
