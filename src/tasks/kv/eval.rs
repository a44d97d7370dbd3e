//! Phase-matched evaluation sets: every logical example rendered at every phase, with
//! a balanced design of the target's base positions (`docs/prompt_format.md`).

use rand::Rng;
use rand::seq::{SliceRandom, index};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::prompt::{
    KvExample, KvPromptConfig, Pads, QuerySampling, Rendering, render, rng_for, sample_content,
};
use crate::tasks::{Period, Protocol, TaskError, TaskResult, TokenSpace};

/// A phase-matched evaluation set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEvalConfig {
    /// Prompt format (keep it equal to the training one).
    pub prompt: KvPromptConfig,
    /// Period `P`; phase groups are `t_K mod P`. Default 8.
    pub period: Period,
    /// Padding protocol. Default `prefix_padding`.
    pub protocol: Protocol,
    /// Number of logical examples = examples per phase group. Must be a positive
    /// multiple of [`matched_block_size`]`(P) = 2 P^2` (exact matching needs it).
    /// Default 256 (valid for P = 1, 2, 4, 8).
    pub n_logical: usize,
    /// Seed. The same seed gives the same logical examples under both protocols.
    /// Default 0.
    pub seed: u64,
}

impl Default for KvEvalConfig {
    fn default() -> Self {
        KvEvalConfig {
            prompt: KvPromptConfig::default(),
            period: Period::new(8).expect("nonzero"),
            protocol: Protocol::PrefixPadding,
            n_logical: 256,
            seed: 0,
        }
    }
}

/// Smallest number of logical examples for which the balanced design matches the
/// groups' mean and variance of `t_K` exactly: `2 P^2`.
pub fn matched_block_size(period: Period) -> usize {
    2 * period.len() * period.len()
}

impl KvEvalConfig {
    /// The smallest valid `n_logical` that is at least `at_least`.
    pub fn round_n_logical(period: Period, at_least: usize) -> usize {
        let b = matched_block_size(period);
        at_least.max(1).div_ceil(b) * b
    }
}

/// A phase-matched evaluation set: every logical example rendered once per phase
/// residue `r` in `0..P`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvalSet {
    /// The config it was generated from.
    pub config: KvEvalConfig,
    /// Length of every prompt of the set.
    pub prompt_len: usize,
    /// `A`: alignment pads per prompt (split between after-BOS and before-query).
    pub align_pads: usize,
    /// Examples, logical-major: `examples[i * P + r]` is logical example `i` at residue `r`.
    pub examples: Vec<KvExample>,
}

impl KvEvalSet {
    /// The period.
    pub fn period(&self) -> Period {
        self.config.period
    }
    /// The protocol.
    pub fn protocol(&self) -> Protocol {
        self.config.protocol
    }
    /// Number of logical examples (= examples per group).
    pub fn n_logical(&self) -> usize {
        self.config.n_logical
    }
    /// Logical example `logical` rendered at residue `r`.
    pub fn example(&self, logical: usize, r: u32) -> &KvExample {
        &self.examples[logical * self.period().len() + r as usize]
    }
    /// The phase group `r`: one example per logical example.
    pub fn group(&self, r: u32) -> impl Iterator<Item = &KvExample> + '_ {
        let p = self.period().len();
        self.examples.iter().skip(r as usize).step_by(p)
    }
}

/// Geometry of the balanced design.
struct Design {
    /// Binding width.
    w: usize,
    /// Alignment pads per prompt.
    align: usize,
    /// Feasible quotient range `m_min..=m_max` of `B = P m + c`.
    m_min: usize,
    m_max: usize,
}

fn design_geometry(cfg: &KvPromptConfig, space: &TokenSpace, p: usize) -> Design {
    let w = cfg.binding_width(space);
    let lo = cfg.bos_len();
    let m_min = lo.div_ceil(p);
    let mut align = w - 1;
    loop {
        // Unshifted target key positions B = lo + a + j w cover lo..=hi.
        let hi = lo + (cfg.n_bindings - 1) * w + align;
        if hi + 1 >= p {
            let m_max = (hi + 1 - p) / p;
            if m_max > m_min {
                return Design {
                    w,
                    align,
                    m_min,
                    m_max,
                };
            }
        }
        align += 1;
    }
}

/// Base positions `B` (unshifted target key positions) of the balanced design.
///
/// Residue classes `c = B mod P` are uniform (`n/P` each). Within class `c` the
/// quotients `m = B div P` come in antithetic pairs `(x, m_min + m_max - x)` and
/// `e_c = (n/P) (P-1-2c) / (2P)` of the pairs are moved one step inwards, so the
/// class mean of `m` is `(m_min+m_max)/2 + (P-1-2c)/(2P)`. Rendering each example at
/// `t = B + ((r - c) mod P)` then gives every group `r` the same mean and variance.
fn balanced_bases(rng: &mut ChaCha8Rng, n: usize, p: usize, d: &Design) -> Vec<usize> {
    let n_c = n / p;
    let pairs = n_c / 2;
    let mid = (d.m_min + d.m_max) / 2;
    let mut bases = Vec::with_capacity(n);
    for c in 0..p {
        let e = (n_c as i64) * (p as i64 - 1 - 2 * c as i64) / (2 * p as i64);
        debug_assert_eq!(
            (n_c as i64) * (p as i64 - 1 - 2 * c as i64) % (2 * p as i64),
            0
        );
        let mut ms: Vec<(usize, usize)> = (0..pairs)
            .map(|_| {
                let x = rng.random_range(d.m_min..=mid);
                (x, d.m_min + d.m_max - x)
            })
            .collect();
        for i in index::sample(rng, pairs, e.unsigned_abs() as usize) {
            if e > 0 {
                ms[i].0 += 1;
            } else {
                ms[i].1 -= 1;
            }
        }
        for (x, y) in ms {
            bases.push(p * x + c);
            bases.push(p * y + c);
        }
    }
    bases.shuffle(rng);
    bases
}

/// Check an evaluation set's config: the prompt, enough bindings for the queries
/// before the target, and `n_logical` a multiple of the matched block.
fn check_eval_config(space: &TokenSpace, cfg: &KvEvalConfig) -> TaskResult<()> {
    cfg.prompt.validate(space)?;
    if cfg.prompt.query_sampling == QuerySampling::WithReplacement
        && cfg.prompt.n_queries > 1
        && cfg.prompt.n_bindings < 2
    {
        return Err(TaskError::config(
            "prompt.n_bindings",
            "with query_sampling = \"with_replacement\" the queries before the target ask \
             the other bindings: at least 2 bindings are needed when n_queries > 1",
        ));
    }
    let period = cfg.period;
    let p = period.len();
    let block = matched_block_size(period);
    if cfg.n_logical == 0 || !cfg.n_logical.is_multiple_of(block) {
        return Err(TaskError::config(
            "n_logical",
            format!(
                "must be a positive multiple of 2 P^2 = {block} for P = {p} (exact matching of the groups' mean and variance needs it); the nearest valid value at or above is {}",
                KvEvalConfig::round_n_logical(period, cfg.n_logical)
            ),
        ));
    }
    Ok(())
}

/// Generate a phase-matched evaluation set.
///
/// Each of `n_logical` logical examples (bindings, values, query order, target
/// binding `j`, alignment `a`) is rendered `P` times, once per residue `r`, by shifting
/// its target key from its base position `B` to `t_K = B + s` with
/// `s = (r - B) mod P` in `0..P`:
///
/// - prefix padding: `s` pads before the prompt, `P-1-s` after the last answer;
/// - in-sequence padding: `s` pads right before the target binding, `P-1-s` right
///   after it.
///
/// Every prompt of the set has the same length; the groups hold the same logical
/// examples; the query position is identical across groups (in-sequence) or its
/// per-group multiset is identical (prefix); the mean and variance of `t_K` are
/// exactly equal across groups (balanced design of `B`, see `docs/prompt_format.md`).
pub fn generate_eval_set(space: &TokenSpace, cfg: &KvEvalConfig) -> TaskResult<KvEvalSet> {
    check_eval_config(space, cfg)?;
    let period = cfg.period;
    let p = period.len();
    let prompt = &cfg.prompt;
    let design = design_geometry(prompt, space, p);
    let prompt_len = prompt.unpadded_len(space) + design.align + (p - 1);
    prompt.check_len(prompt_len)?;

    let n = cfg.n_logical;
    let nb = prompt.n_bindings;
    let bases = balanced_bases(&mut rng_for(cfg.seed, 0), n, p, &design);
    let mut examples = Vec::with_capacity(n * p);
    for (i, &b) in bases.iter().enumerate() {
        let mut rng = rng_for(cfg.seed, i as u64 + 1);
        let off = b - prompt.bos_len();
        let j = (off / design.w).min(nb - 1);
        let a = off - j * design.w;
        debug_assert!(a <= design.align);
        let content = sample_content(&mut rng, space, prompt, Some(j));
        let c = b % p;
        for r in 0..p {
            let s = (r + p - c) % p;
            let mut gaps = vec![0; nb + 1];
            gaps[0] += a;
            gaps[nb] += design.align - a;
            let pads = match cfg.protocol {
                Protocol::PrefixPadding => Pads {
                    lead: s,
                    gaps,
                    tail: p - 1 - s,
                },
                Protocol::InSequencePadding => {
                    gaps[j] += s;
                    gaps[j + 1] += p - 1 - s;
                    Pads {
                        lead: 0,
                        gaps,
                        tail: 0,
                    }
                }
            };
            let ex = render(
                space,
                prompt,
                &content,
                &pads,
                period,
                Rendering {
                    logical_id: i as u64,
                    protocol: Some(cfg.protocol),
                    shift: s,
                },
            );
            debug_assert_eq!(ex.target_key_pos, b + s);
            debug_assert_eq!(ex.phase.residue() as usize, r);
            debug_assert_eq!(ex.tokens.len(), prompt_len);
            examples.push(ex);
        }
    }
    Ok(KvEvalSet {
        config: cfg.clone(),
        prompt_len,
        align_pads: design.align,
        examples,
    })
}
