//! The KV prompt format shared by evaluation and training: its config, a rendered
//! prompt, and the sampling and rendering of one prompt's bindings and queries.

use rand::seq::{SliceRandom, index};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::tasks::{MAX_HAYSTACK_LEN, Period, Phase, Protocol, TaskError, TaskResult, TokenSpace};

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
    /// under `prompt` in [`KvEvalConfig`](super::KvEvalConfig) / [`KvTrainConfig`](super::KvTrainConfig).
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
        if len > MAX_HAYSTACK_LEN {
            return Err(TaskError::config(
                "prompt.n_bindings",
                format!(
                    "the prompt would be {len} tokens before padding, more than {} (n_bindings x (key_len + value_len + ...) + the queries)",
                    MAX_HAYSTACK_LEN
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
            if v > MAX_HAYSTACK_LEN {
                return Err(TaskError::config(
                    key,
                    format!(
                        "{v} is more than a prompt can hold ({} tokens at most)",
                        MAX_HAYSTACK_LEN
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

    pub(super) fn bos_len(&self) -> usize {
        usize::from(self.bos)
    }

    pub(super) fn check_len(&self, len: usize) -> TaskResult<()> {
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

/// Which rendering of which logical example a prompt is (copied into its [`KvExample`]).
pub(crate) struct Rendering {
    pub(crate) logical_id: u64,
    /// None for training prompts.
    pub(crate) protocol: Option<Protocol>,
    /// The shift `s` of the target (see [`KvExample::shift`]).
    pub(crate) shift: usize,
}

pub(crate) fn render(
    space: &TokenSpace,
    cfg: &KvPromptConfig,
    content: &Content,
    pads: &Pads,
    period: Period,
    id: Rendering,
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
        logical_id: id.logical_id,
        protocol: id.protocol,
        shift: id.shift,
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
