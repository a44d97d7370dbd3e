//! KV retrieval (the paper's needle-in-a-haystack): phase-matched evaluation sets
//! and a training sampler.
//!
//! Layout of one prompt (see `docs/prompt_format.md` for the full specification):
//!
//! ```text
//! [lead pads] [BOS] {gap_0 pads} B_0 {gap_1 pads} B_1 ... B_{N-1} {gap_N pads}
//!     [QUERY] Q_1 ... Q_T [tail pads]
//! B_i = key_i [ASSIGN] value_i [SEP]          (one binding, width w)
//! Q_q = [QUERY] key [ASSIGN] value [SEP]      (a query repeats its binding)
//! ```
//!
//! Answers are in the prompt (teacher forcing); the logits at
//! `target_positions[j]` must predict `answers[j]`.

use rand::seq::{SliceRandom, index};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::vocab::TokenSpace;
use super::{Period, Phase, Protocol, TaskError, TaskResult};

/// Label value of positions that carry no loss in [`TrainBatch::labels`].
pub const IGNORE_INDEX: i64 = -100;

/// Where the query marker goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueryMarker {
    /// No marker: queries follow the bindings directly.
    None,
    /// One marker between the binding section and the queries (default).
    #[default]
    Section,
    /// One marker before every query.
    EachQuery,
}

/// How the queries of a prompt choose their bindings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuerySampling {
    /// The queries ask distinct bindings (default; the shipped organisms' recipe). A
    /// later query's binding is one not asked yet, so a model can gain accuracy by
    /// elimination: with 16 of 24 the last query has only 9 candidates.
    #[default]
    Distinct,
    /// Every query asks a uniformly random binding, independently of the others
    /// (repeats allowed): the earlier queries say nothing about the next one, so only
    /// retrieval pays. In evaluation sets the queries before the scored one are drawn
    /// with replacement from the *other* bindings, so the target is asked once, at the
    /// end, and its answer can only come from the haystack.
    WithReplacement,
}

impl QuerySampling {
    /// True for the default (not written when serialising, so that recipes without
    /// the key keep their config hash).
    pub fn is_distinct(&self) -> bool {
        *self == QuerySampling::Distinct
    }

    /// The snake_case name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            QuerySampling::Distinct => "distinct",
            QuerySampling::WithReplacement => "with_replacement",
        }
    }
}

/// The format of a KV retrieval prompt, shared by evaluation and training.
///
/// The defaults are the ORGANISM_NOTES recipe: 24 single-token bindings `k v`, a
/// query marker, then 16 of the bindings repeated as queries (the last one is the
/// scored target in evaluation sets): `BOS k v k v ... QUERY k v k v ...`, 82 tokens
/// before padding. For the paper's single query at the end set `n_queries = 1`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvPromptConfig {
    /// Number of key -> value bindings in the haystack. Default 24.
    pub n_bindings: usize,
    /// Number of queries (bindings asked again, in random order; in evaluation sets
    /// the last one is the target). Default 16.
    pub n_queries: usize,
    /// How queries choose their bindings: `distinct` (default) or `with_replacement`
    /// (see [`QuerySampling`]).
    #[serde(skip_serializing_if = "QuerySampling::is_distinct")]
    pub query_sampling: QuerySampling,
    /// Tokens per key. Default 1.
    pub key_len: usize,
    /// Tokens per value. Default 1.
    pub value_len: usize,
    /// Put the assignment piece between key and value. Default false.
    pub assign: bool,
    /// End every binding and query with the separator piece. Default false.
    pub binding_sep: bool,
    /// Query marker placement. Default `section`.
    pub query_marker: QueryMarker,
    /// Start the prompt with BOS. Default true.
    pub bos: bool,
    /// Prefix pads go before BOS (true, default) or right after it (false; better for
    /// text models whose BOS must come first).
    pub pad_before_bos: bool,
    /// Values are distinct across the bindings of a prompt (default false: values are
    /// drawn with replacement; keys are always distinct).
    pub distinct_values: bool,
    /// Longest allowed prompt including all padding; `None` = no limit. Default none.
    pub max_len: Option<usize>,
}

impl Default for KvPromptConfig {
    fn default() -> Self {
        KvPromptConfig {
            n_bindings: 24,
            n_queries: 16,
            query_sampling: QuerySampling::Distinct,
            key_len: 1,
            value_len: 1,
            assign: false,
            binding_sep: false,
            query_marker: QueryMarker::Section,
            bos: true,
            pad_before_bos: true,
            distinct_values: false,
            max_len: None,
        }
    }
}

impl KvPromptConfig {
    /// Check the config against a token space. Field names are given as they appear
    /// under `prompt` in [`KvEvalConfig`] / [`KvTrainConfig`].
    pub fn validate(&self, space: &TokenSpace) -> TaskResult<()> {
        self.validate_counts()?;
        let keys = space.key_space(self.key_len);
        if self.n_bindings as u128 > keys {
            return Err(TaskError::config(
                "prompt.n_bindings",
                format!(
                    "{} bindings need {} distinct keys, but only {keys} keys of key_len = {} exist ({} key atoms)",
                    self.n_bindings,
                    self.n_bindings,
                    self.key_len,
                    space.key_atoms().len()
                ),
            ));
        }
        let values = space.value_space(self.value_len);
        if self.distinct_values && self.n_bindings as u128 > values {
            return Err(TaskError::config(
                "prompt.n_bindings",
                format!(
                    "{} bindings with distinct_values need {} distinct values, but only {values} exist",
                    self.n_bindings, self.n_bindings
                ),
            ));
        }
        // Each factor is at most 2^22 above, so this product cannot overflow.
        let len = self.unpadded_len(space);
        if len > super::MAX_HAYSTACK_LEN {
            return Err(TaskError::config(
                "prompt.n_bindings",
                format!(
                    "the prompt would be {len} tokens before padding, more than {} (n_bindings x (key_len + value_len + ...) + the queries)",
                    super::MAX_HAYSTACK_LEN
                ),
            ));
        }
        if self.bos && space.bos().is_none() {
            return Err(TaskError::config(
                "prompt.bos",
                "the token space has no BOS token (set bos = false or configure one)",
            ));
        }
        Ok(())
    }

    /// The counts and lengths on their own: at least 1, at most a prompt's length, and
    /// no more distinct queries than bindings.
    fn validate_counts(&self) -> TaskResult<()> {
        if self.n_bindings == 0 {
            return Err(TaskError::config("prompt.n_bindings", "must be at least 1"));
        }
        if self.key_len == 0 {
            return Err(TaskError::config("prompt.key_len", "must be at least 1"));
        }
        if self.value_len == 0 {
            return Err(TaskError::config("prompt.value_len", "must be at least 1"));
        }
        if self.n_queries == 0 {
            return Err(TaskError::config("prompt.n_queries", "must be at least 1"));
        }
        for (key, v) in [
            ("prompt.n_bindings", self.n_bindings),
            ("prompt.n_queries", self.n_queries),
            ("prompt.key_len", self.key_len),
            ("prompt.value_len", self.value_len),
        ] {
            if v > super::MAX_HAYSTACK_LEN {
                return Err(TaskError::config(
                    key,
                    format!(
                        "{v} is more than a prompt can hold ({} tokens at most)",
                        super::MAX_HAYSTACK_LEN
                    ),
                ));
            }
        }
        if self.query_sampling == QuerySampling::Distinct && self.n_queries > self.n_bindings {
            return Err(TaskError::config(
                "prompt.n_queries",
                format!(
                    "{} queries but only {} bindings (each query asks a distinct binding; \
                     query_sampling = \"with_replacement\" allows repeats)",
                    self.n_queries, self.n_bindings
                ),
            ));
        }
        Ok(())
    }

    /// Width `w` of one binding in tokens: `key_len + |ASSIGN| + value_len + |SEP|`.
    pub fn binding_width(&self, space: &TokenSpace) -> usize {
        self.key_len
            + if self.assign { space.assign().len() } else { 0 }
            + self.value_len
            + if self.binding_sep {
                space.sep().len()
            } else {
                0
            }
    }

    /// Length of the query section (marker(s) and all queries, answers included).
    pub fn query_section_len(&self, space: &TokenSpace) -> usize {
        let m = space.query_marker().len();
        let w = self.binding_width(space);
        match self.query_marker {
            QueryMarker::None => self.n_queries * w,
            QueryMarker::Section => m + self.n_queries * w,
            QueryMarker::EachQuery => self.n_queries * (m + w),
        }
    }

    /// Prompt length without any padding: `|BOS| + N w + query section`.
    pub fn unpadded_len(&self, space: &TokenSpace) -> usize {
        self.bos_len() + self.n_bindings * self.binding_width(space) + self.query_section_len(space)
    }

    fn bos_len(&self) -> usize {
        usize::from(self.bos)
    }

    fn check_len(&self, len: usize) -> TaskResult<()> {
        match self.max_len {
            Some(max) if len > max => Err(TaskError::config(
                "prompt.max_len",
                format!(
                    "the prompt needs {len} tokens (padding included), more than max_len = {max}"
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// One key -> value binding of the haystack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// Key ids (`key_len` of them).
    pub key: Vec<u32>,
    /// Value ids (`value_len` of them).
    pub value: Vec<u32>,
    /// Absolute position of the key's first token in this rendering.
    pub key_pos: usize,
}

/// One query of a prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvQuery {
    /// Index of the queried binding in [`KvExample::bindings`].
    pub binding: usize,
    /// `t_K`: absolute position of the queried binding's key (first token) in the haystack.
    pub target_key_pos: usize,
    /// `t_K mod P`.
    pub phase: Phase,
    /// Absolute position of the query's first token (its marker under
    /// `query_marker = each_query`, else its key).
    pub query_pos: usize,
    /// Positions whose next-token predictions must be the answer tokens
    /// (`answer[j]` is predicted at `target_positions[j]`).
    pub target_positions: Vec<usize>,
    /// The answer (the binding's value ids).
    pub answer: Vec<u32>,
}

/// One rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvExample {
    /// Identifier of the logical example: all renderings of the same bindings and
    /// queries (at different phases) share it. Cluster key for the bootstrap.
    pub logical_id: u64,
    /// The padding protocol (None for training prompts).
    pub protocol: Option<Protocol>,
    /// The shift `s` applied to the target (prefix pads, or pads before the target
    /// binding under in-sequence padding).
    pub shift: usize,
    /// The prompt, answers included.
    pub tokens: Vec<u32>,
    /// The haystack bindings, in prompt order.
    pub bindings: Vec<Binding>,
    /// All queries, in prompt order.
    pub queries: Vec<KvQuery>,
    /// Index in `queries` of the scored query (always the last one).
    pub scored: usize,
    /// `t_K` of the scored query.
    pub target_key_pos: usize,
    /// Phase `t_K mod P` of the scored query (P of the set / sampler).
    pub phase: Phase,
    /// Where the scored query's answer is read (see [`KvQuery::target_positions`]).
    pub target_positions: Vec<usize>,
    /// The scored query's answer ids.
    pub answers: Vec<u32>,
}

impl KvExample {
    /// The scored query.
    pub fn scored_query(&self) -> &KvQuery {
        &self.queries[self.scored]
    }

    /// `(position, token)` pairs for the loss over every query's answer tokens.
    pub fn loss_targets(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.queries.iter().flat_map(|q| {
            q.target_positions
                .iter()
                .copied()
                .zip(q.answer.iter().copied())
        })
    }

    /// Phase of the scored target under another period (e.g. a second stride).
    pub fn phase_for(&self, period: Period) -> Phase {
        Phase::of(self.target_key_pos, period)
    }

    /// Prompt length in tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True for an empty prompt (never produced by the generators).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

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

pub(crate) struct Content {
    pub(crate) keys: Vec<Vec<u32>>,
    pub(crate) values: Vec<Vec<u32>>,
    /// Binding indices in query order.
    pub(crate) query_order: Vec<usize>,
}

pub(crate) struct Pads {
    pub(crate) lead: usize,
    /// `gaps[i]` pads before binding `i`; `gaps[N]` pads after the last binding.
    pub(crate) gaps: Vec<usize>,
    pub(crate) tail: usize,
}

pub(crate) fn rng_for(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

/// `n` tuples of `len` atoms; distinct when `distinct`.
pub(crate) fn sample_tuples(
    rng: &mut ChaCha8Rng,
    atoms: &[u32],
    len: usize,
    n: usize,
    distinct: bool,
) -> Vec<Vec<u32>> {
    let a = atoms.len();
    let decode = |mut idx: usize| -> Vec<u32> {
        let mut t = vec![0; len];
        for slot in t.iter_mut().rev() {
            *slot = atoms[idx % a];
            idx /= a;
        }
        t
    };
    if !distinct {
        return (0..n)
            .map(|_| (0..len).map(|_| atoms[rng.random_range(0..a)]).collect())
            .collect();
    }
    let space = (a as u128).checked_pow(len as u32).unwrap_or(u128::MAX);
    if space <= 1 << 24 {
        let mut idx = index::sample(rng, space as usize, n).into_vec();
        idx.shuffle(rng);
        idx.into_iter().map(decode).collect()
    } else {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let t: Vec<u32> = (0..len).map(|_| atoms[rng.random_range(0..a)]).collect();
            if seen.insert(t.clone()) {
                out.push(t);
            }
        }
        out
    }
}

pub(crate) fn sample_content(
    rng: &mut ChaCha8Rng,
    space: &TokenSpace,
    cfg: &KvPromptConfig,
    target: Option<usize>,
) -> Content {
    let n = cfg.n_bindings;
    let keys = sample_tuples(rng, space.key_atoms(), cfg.key_len, n, true);
    let values = sample_tuples(
        rng,
        space.value_atoms(),
        cfg.value_len,
        n,
        cfg.distinct_values,
    );
    let query_order = match (target, cfg.query_sampling) {
        (Some(t), QuerySampling::WithReplacement) => {
            // The earlier queries ask any binding but the target (n >= 2 is checked
            // when n_queries >= 2): the target's answer must come from the haystack.
            let mut q: Vec<usize> = (1..cfg.n_queries)
                .map(|_| {
                    let i = rng.random_range(0..n - 1);
                    if i >= t { i + 1 } else { i }
                })
                .collect();
            q.push(t);
            q
        }
        (None, QuerySampling::WithReplacement) => {
            (0..cfg.n_queries).map(|_| rng.random_range(0..n)).collect()
        }
        (Some(t), QuerySampling::Distinct) => {
            let mut q: Vec<usize> = index::sample(rng, n - 1, cfg.n_queries - 1)
                .into_iter()
                .map(|i| if i >= t { i + 1 } else { i })
                .collect();
            q.shuffle(rng);
            q.push(t);
            q
        }
        (None, QuerySampling::Distinct) => {
            let mut q = index::sample(rng, n, cfg.n_queries).into_vec();
            q.shuffle(rng);
            q
        }
    };
    Content {
        keys,
        values,
        query_order,
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn render(
    space: &TokenSpace,
    cfg: &KvPromptConfig,
    content: &Content,
    pads: &Pads,
    period: Period,
    logical_id: u64,
    protocol: Option<Protocol>,
    shift: usize,
) -> KvExample {
    let pad = space.pad();
    let mut t: Vec<u32> = Vec::new();
    let push_pads = |t: &mut Vec<u32>, k: usize| t.extend(std::iter::repeat_n(pad, k));
    let bos = if cfg.bos { space.bos() } else { None };
    if cfg.pad_before_bos {
        push_pads(&mut t, pads.lead);
        t.extend(bos);
    } else {
        t.extend(bos);
        push_pads(&mut t, pads.lead);
    }
    let assign: &[u32] = if cfg.assign { space.assign() } else { &[] };
    let sep: &[u32] = if cfg.binding_sep { space.sep() } else { &[] };
    let mut bindings = Vec::with_capacity(cfg.n_bindings);
    for (i, (k, v)) in content.keys.iter().zip(&content.values).enumerate() {
        push_pads(&mut t, pads.gaps[i]);
        bindings.push(Binding {
            key: k.clone(),
            value: v.clone(),
            key_pos: t.len(),
        });
        t.extend_from_slice(k);
        t.extend_from_slice(assign);
        t.extend_from_slice(v);
        t.extend_from_slice(sep);
    }
    push_pads(&mut t, pads.gaps[cfg.n_bindings]);
    if cfg.query_marker == QueryMarker::Section {
        t.extend_from_slice(space.query_marker());
    }
    let mut queries = Vec::with_capacity(content.query_order.len());
    for &b in &content.query_order {
        let query_pos = t.len();
        if cfg.query_marker == QueryMarker::EachQuery {
            t.extend_from_slice(space.query_marker());
        }
        t.extend_from_slice(&content.keys[b]);
        t.extend_from_slice(assign);
        let vstart = t.len();
        t.extend_from_slice(&content.values[b]);
        t.extend_from_slice(sep);
        let target_key_pos = bindings[b].key_pos;
        queries.push(KvQuery {
            binding: b,
            target_key_pos,
            phase: Phase::of(target_key_pos, period),
            query_pos,
            target_positions: (vstart - 1..vstart - 1 + cfg.value_len).collect(),
            answer: content.values[b].clone(),
        });
    }
    push_pads(&mut t, pads.tail);
    let scored = queries.len() - 1;
    let s = &queries[scored];
    KvExample {
        logical_id,
        protocol,
        shift,
        target_key_pos: s.target_key_pos,
        phase: s.phase,
        target_positions: s.target_positions.clone(),
        answers: s.answer.clone(),
        tokens: t,
        bindings,
        queries,
        scored,
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
                i as u64,
                Some(cfg.protocol),
                s,
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

fn is_zero(n: &usize) -> bool {
    *n == 0
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
        if cfg.inner_pad_max > super::MAX_HAYSTACK_LEN {
            return Err(TaskError::config(
                "inner_pad_max",
                format!(
                    "{} is more than a prompt can hold ({} tokens at most)",
                    cfg.inner_pad_max,
                    super::MAX_HAYSTACK_LEN
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
                    step.wrapping_mul(batch_size as u64).wrapping_add(b as u64),
                    None,
                    lead,
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
