//! Clean / corrupted prompt pairs of the text tasks (`[task] kind = "passkey" |
//! "needle"`) for activation patching: per phase group, the clean prompts `0..n` and
//! their corrupted partners `n..2n` (the same prompt with another value in the needle
//! and in the teacher-forced answer, `crate::tasks::corrupt_text_example`), cut after
//! the group's last read position, as phase-sweep's text scoring cuts them. Each
//! prompt reads the value at every value position (exact match of the whole value);
//! its logit difference is its own first value token against its partner's at the
//! first one.

use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::tasks::prompts::{PromptMeta, Prompts, Target};
use crate::tasks::{
    TaskError, TextNeedleExample, TextNeedleSet, corrupt_text_example, text_cut_len,
};

/// The clean / corrupted pairs of `examples` (rendered from `set`'s config with `tok`):
/// prompt `i` and `n + i` are each other's source; groups 0 = clean, 1 = corrupted.
/// Errors come back as task errors naming their `[task.text]` field.
pub fn text_paired_prompts(
    tok: &Tokenizer,
    set: &TextNeedleSet,
    examples: &[&TextNeedleExample],
) -> std::result::Result<(Prompts, Vec<PromptMeta>), TaskError> {
    let n = examples.len();
    let len = text_cut_len(examples.iter().copied());
    let mut tokens = Vec::with_capacity(2 * n * len);
    let mut targets = Vec::with_capacity(2 * n);
    let mut meta = Vec::with_capacity(2 * n);
    let mut corrupted = Vec::with_capacity(n);
    for e in examples {
        let c = corrupt_text_example(tok, &set.config, e)?;
        tokens.extend_from_slice(&e.tokens[..len]);
        targets.push(Target {
            positions: e.target_positions.clone(),
            answers: e.answers.clone(),
            alt: Some(c.answers[0]),
        });
        meta.push(meta_of(e, false));
        corrupted.push(c);
    }
    for (e, c) in examples.iter().zip(&corrupted) {
        tokens.extend_from_slice(&c.apply(e)[..len]);
        targets.push(Target {
            positions: e.target_positions.clone(),
            answers: c.answers.clone(),
            alt: Some(e.answers[0]),
        });
        meta.push(meta_of(e, true));
    }
    let prompts = Prompts {
        len,
        tokens,
        targets,
        source: (0..2 * n).map(|i| Some((i + n) % (2 * n))).collect(),
        group: (0..2 * n).map(|i| usize::from(i >= n)).collect(),
    };
    Ok((prompts, meta))
}

fn meta_of(e: &TextNeedleExample, corrupted: bool) -> PromptMeta {
    PromptMeta {
        logical: e.logical_id,
        phase: e.phase.residue(),
        corrupted,
    }
}

/// The pairs of phase group `r` of `set`, its first `n` logical examples: a
/// non-tokenizer error, or a task error as `map_err` words it (naming the key).
pub fn text_group_pairs(
    tok: &Tokenizer,
    set: &TextNeedleSet,
    r: u32,
    n: usize,
    map_err: impl Fn(TaskError) -> Error,
) -> Result<(Prompts, Vec<PromptMeta>)> {
    let ex: Vec<&TextNeedleExample> = set.group(r).take(n).collect();
    if ex.is_empty() {
        return Err(Error::Input(format!(
            "phase group {r} holds no text prompt"
        )));
    }
    text_paired_prompts(tok, set, &ex).map_err(map_err)
}
