//! Prompt batches for the patching routine ([`Prompts`]: tokens, where each prompt is
//! scored, partners and groups): one phase group of an evaluation set, clean only or as
//! clean/corrupted pairs.
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

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::tasks::{KvEvalSet, KvExample, TokenSpace};

/// Where a prompt is scored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Positions whose logits predict `answers` (teacher forcing).
    pub positions: Vec<usize>,
    /// The answer token at each position.
    pub answers: Vec<u32>,
    /// The competing answer of the logit difference at `positions[0]` (the
    /// corrupted prompt's answer for a clean prompt and vice versa).
    pub alt: Option<u32>,
}

/// A batch of equal-length prompts and what the patching routine (`runner::patching`)
/// needs to know about them.
#[derive(Debug, Clone)]
pub struct Prompts {
    /// Tokens per prompt (prompts are cut after their last target position).
    pub len: usize,
    /// Row-major `[n, len]`.
    pub tokens: Vec<u32>,
    /// Each prompt's read positions and answers.
    pub targets: Vec<Target>,
    /// Partner prompt of each prompt, for the patching fill `Fill::Source`.
    pub source: Vec<Option<usize>>,
    /// Group of each prompt, for the fills `Fill::Mean` and `Fill::Resample`.
    pub group: Vec<usize>,
}

impl Prompts {
    /// Number of prompts.
    pub fn n(&self) -> usize {
        self.targets.len()
    }

    /// `[rows.len(), len]` token ids of the given prompts.
    pub fn tokens_of(&self, rows: &[usize], device: &burn::tensor::Device) -> Tensor<2, Int> {
        let mut ids = Vec::with_capacity(rows.len() * self.len);
        for &r in rows {
            ids.extend(
                self.tokens[r * self.len..(r + 1) * self.len]
                    .iter()
                    .map(|&t| t as i64),
            );
        }
        Tensor::from_data(TensorData::new(ids, [rows.len(), self.len]), device)
    }

    /// For every prompt, the next prompt of its group (cyclic; itself when alone).
    pub fn resample_partner(&self) -> Vec<usize> {
        let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (p, g) in self.group.iter().enumerate() {
            members.entry(*g).or_default().push(p);
        }
        let mut out = vec![0; self.n()];
        for m in members.values() {
            for (i, &p) in m.iter().enumerate() {
                out[p] = m[(i + 1) % m.len()];
            }
        }
        out
    }

    pub(crate) fn partner(&self, p: usize) -> Result<usize> {
        self.source[p].ok_or_else(|| {
            Error::Other(format!(
                "prompt {p} has no source partner (Fill::Source needs paired prompts)"
            ))
        })
    }

    pub(crate) fn check(&self) -> Result<()> {
        let n = self.n();
        if n == 0 || self.len == 0 || self.tokens.len() != n * self.len {
            return Err(Error::Input(format!(
                "prompt batch: {} tokens for {n} prompts of length {}",
                self.tokens.len(),
                self.len
            )));
        }
        if self.source.len() != n || self.group.len() != n {
            return Err(Error::Input(
                "prompt batch: source/group length mismatch".into(),
            ));
        }
        for (i, t) in self.targets.iter().enumerate() {
            if t.positions.is_empty()
                || t.positions.len() != t.answers.len()
                || t.positions.iter().any(|&p| p >= self.len)
            {
                return Err(Error::Input(format!(
                    "prompt {i}: bad target positions {:?} for length {}",
                    t.positions, self.len
                )));
            }
        }
        Ok(())
    }
}

/// Per prompt of a batch: which logical example, which phase, clean or corrupted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptMeta {
    /// The logical example (the bootstrap's cluster).
    pub logical: u64,
    /// The phase it is rendered at.
    pub phase: u32,
    /// Whether it is the corrupted partner.
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
