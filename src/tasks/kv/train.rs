//! The training sampler: random bindings, random prefix (and inner) padding, the
//! binding-count curriculum and the loss labels.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::prompt::{
    KvExample, KvPromptConfig, Pads, QuerySampling, Rendering, render, rng_for, sample_content,
};
use crate::tasks::{MAX_HAYSTACK_LEN, Period, TaskError, TaskResult, TokenSpace};

/// Label value of positions that carry no loss in [`TrainBatch::labels`].
pub const IGNORE_INDEX: i64 = -100;

/// Training prompts: random bindings, random prefix padding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvTrainConfig {
    /// Prompt format.
    pub prompt: KvPromptConfig,
    /// Period `P`: prefix pads are uniform in `0..P` (`0..=P-1`) and query phases are
    /// reported mod `P`. Default 8.
    pub period: Period,
    /// Up to this many extra pads (uniform count in `0..=inner_pad_max`) are placed,
    /// one by one, at uniformly random binding boundaries (before the first binding,
    /// between two, or before the query section), so that the alignment and
    /// in-sequence pads of evaluation prompts are in distribution. Default 0.
    pub inner_pad_max: usize,
    /// The fewest extra pads: the count is uniform in `inner_pad_min..=inner_pad_max`
    /// (long-context training: every prompt's haystack near its full length). Default
    /// 0 (not serialised then, so recipes without it keep their config hash).
    #[serde(skip_serializing_if = "is_zero")]
    pub inner_pad_min: usize,
    /// Seed. Default 0.
    pub seed: u64,
    /// Start with fewer bindings and grow to `prompt.n_bindings` (default: none).
    pub curriculum: Option<Curriculum>,
}

/// A binding-count curriculum (associative recall forms faster with few distractors):
/// the batch of step `s` has `start_bindings + (n_bindings - start_bindings) * s /
/// steps` bindings (integer division; `n_bindings` from step `steps` on) and
/// `min(n_queries, bindings)` queries (`n_queries` with `query_sampling =
/// "with_replacement"`). Prompts keep the full length: the unused
/// positions become pads after the last query (they carry no loss).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Curriculum {
    /// Bindings at step 0 (at least 1, at most `prompt.n_bindings`).
    pub start_bindings: usize,
    /// Steps over which the count grows to `prompt.n_bindings`.
    pub steps: u64,
}

impl Default for KvTrainConfig {
    fn default() -> Self {
        KvTrainConfig {
            prompt: KvPromptConfig::default(),
            period: Period::new(8).expect("nonzero"),
            inner_pad_max: 0,
            inner_pad_min: 0,
            seed: 0,
            curriculum: None,
        }
    }
}

/// A batch of training prompts, all `seq_len` long.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainBatch {
    /// The step the batch was drawn for.
    pub step: u64,
    /// Length of every prompt.
    pub seq_len: usize,
    /// The prompts.
    pub examples: Vec<KvExample>,
}

impl TrainBatch {
    /// Number of prompts.
    pub fn batch_size(&self) -> usize {
        self.examples.len()
    }

    /// Token ids, row-major `[batch_size, seq_len]`.
    pub fn input_ids(&self) -> Vec<u32> {
        self.examples
            .iter()
            .flat_map(|e| e.tokens.iter().copied())
            .collect()
    }

    /// Next-token labels, row-major `[batch_size, seq_len]`: at every answer position
    /// the answer token, [`IGNORE_INDEX`] elsewhere.
    pub fn labels(&self) -> Vec<i64> {
        let mut out = vec![IGNORE_INDEX; self.examples.len() * self.seq_len];
        for (b, e) in self.examples.iter().enumerate() {
            for (pos, tok) in e.loss_targets() {
                out[b * self.seq_len + pos] = tok as i64;
            }
        }
        out
    }

    /// True at the positions carrying loss, row-major `[batch_size, seq_len]`.
    pub fn loss_mask(&self) -> Vec<bool> {
        self.labels()
            .into_iter()
            .map(|l| l != IGNORE_INDEX)
            .collect()
    }
}

/// Draws training batches; batch `step` depends only on `(seed, step, batch_size)`,
/// so a resumed run sees exactly the batches it would have seen.
#[derive(Debug, Clone)]
pub struct KvTrainSampler {
    space: TokenSpace,
    cfg: KvTrainConfig,
    seq_len: usize,
}

impl KvTrainSampler {
    /// Validate the config and fix the sequence length
    /// `unpadded_len + (P - 1) + inner_pad_max`.
    pub fn new(space: &TokenSpace, cfg: KvTrainConfig) -> TaskResult<Self> {
        cfg.prompt.validate(space)?;
        if let Some(c) = &cfg.curriculum {
            if c.start_bindings == 0 || c.start_bindings > cfg.prompt.n_bindings {
                return Err(TaskError::config(
                    "curriculum.start_bindings",
                    format!(
                        "must be in 1..={} (prompt.n_bindings), got {}",
                        cfg.prompt.n_bindings, c.start_bindings
                    ),
                ));
            }
            if c.steps == 0 {
                return Err(TaskError::config("curriculum.steps", "must be at least 1"));
            }
        }
        if cfg.inner_pad_max > MAX_HAYSTACK_LEN {
            return Err(TaskError::config(
                "inner_pad_max",
                format!(
                    "{} is more than a prompt can hold ({} tokens at most)",
                    cfg.inner_pad_max, MAX_HAYSTACK_LEN
                ),
            ));
        }
        if cfg.inner_pad_min > cfg.inner_pad_max {
            return Err(TaskError::config(
                "inner_pad_min",
                format!(
                    "{} is more than inner_pad_max = {}",
                    cfg.inner_pad_min, cfg.inner_pad_max
                ),
            ));
        }
        let seq_len = cfg.prompt.unpadded_len(space) + cfg.period.len() - 1 + cfg.inner_pad_max;
        cfg.prompt.check_len(seq_len)?;
        Ok(KvTrainSampler {
            space: space.clone(),
            cfg,
            seq_len,
        })
    }

    /// Length of every training prompt.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The config.
    pub fn config(&self) -> &KvTrainConfig {
        &self.cfg
    }

    /// The prompt format of the batch of `step` (fewer bindings early in a curriculum).
    pub fn prompt_at(&self, step: u64) -> KvPromptConfig {
        let mut prompt = self.cfg.prompt.clone();
        if let Some(c) = &self.cfg.curriculum {
            let n = prompt.n_bindings;
            let s = step.min(c.steps);
            let grown = ((n - c.start_bindings) as u64 * s / c.steps) as usize;
            prompt.n_bindings = c.start_bindings + grown;
            if prompt.query_sampling == QuerySampling::Distinct {
                prompt.n_queries = prompt.n_queries.min(prompt.n_bindings);
            }
        }
        prompt
    }

    /// The batch of `step` (ChaCha8 stream `step` of the seed).
    pub fn batch(&self, step: u64, batch_size: usize) -> TrainBatch {
        let mut rng = rng_for(self.cfg.seed, step);
        let p = self.cfg.period.len();
        let prompt = self.prompt_at(step);
        let nb = prompt.n_bindings;
        // Positions the curriculum's shorter prompts leave free (pads at the end).
        let spare = self.cfg.prompt.unpadded_len(&self.space) - prompt.unpadded_len(&self.space);
        let examples = (0..batch_size)
            .map(|b| {
                let lead = rng.random_range(0..p);
                let inner = rng.random_range(self.cfg.inner_pad_min..=self.cfg.inner_pad_max);
                let mut gaps = vec![0; nb + 1];
                for _ in 0..inner {
                    gaps[rng.random_range(0..=nb)] += 1;
                }
                let pads = Pads {
                    lead,
                    gaps,
                    tail: (p - 1 - lead) + (self.cfg.inner_pad_max - inner) + spare,
                };
                let content = sample_content(&mut rng, &self.space, &prompt, None);
                let ex = render(
                    &self.space,
                    &prompt,
                    &content,
                    &pads,
                    self.cfg.period,
                    Rendering {
                        logical_id: step.wrapping_mul(batch_size as u64).wrapping_add(b as u64),
                        protocol: None,
                        shift: lead,
                    },
                );
                debug_assert_eq!(ex.tokens.len(), self.seq_len);
                ex
            })
            .collect();
        TrainBatch {
            step,
            seq_len: self.seq_len,
            examples,
        }
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}
