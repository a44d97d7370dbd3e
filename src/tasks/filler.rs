//! Filler-length probe (the paper's code-completion flip).
//!
//! A fixed context and question with a filler span of length `L` (e.g. a decorative
//! `===` line); for each `L` the generator returns the prompt and the position where
//! `P(correct) - P(distractor)` is read (the last prompt position; the answer is not in
//! the prompt). Two flavours:
//!
//! - [`binding_filler_probe`]: a synthetic analogue on any [`TokenSpace`]: a binding
//!   `k -> v`, a distractor binding `k' -> v'` (optionally more bindings), a filler span
//!   of `L` filler atoms, and the query `k`;
//! - [`text_filler_probe`]: a text template with a `{filler}` placeholder, rendered
//!   with `filler_unit` repeated `L` times and tokenized as a whole by a Hugging Face
//!   tokenizer (as a real prompt would be).

use std::ops::RangeInclusive;

use rand::Rng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::kv::{rng_for, sample_tuples};
use super::vocab::TokenSpace;
use super::{TaskError, TaskResult};

/// An inclusive range of filler lengths `min..=max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LengthRange {
    /// Shortest filler.
    pub min: usize,
    /// Longest filler (inclusive).
    pub max: usize,
}

impl LengthRange {
    /// `min..=max`.
    pub fn new(min: usize, max: usize) -> Self {
        LengthRange { min, max }
    }
    /// The lengths, in increasing order.
    pub fn iter(&self) -> RangeInclusive<usize> {
        self.min..=self.max
    }
    fn validate(&self) -> TaskResult<()> {
        if self.min > self.max {
            return Err(TaskError::config(
                "lengths",
                format!("min = {} is larger than max = {}", self.min, self.max),
            ));
        }
        if self.max > super::MAX_HAYSTACK_LEN {
            return Err(TaskError::config(
                "lengths",
                format!(
                    "max = {} filler tokens is more than the longest prompt any task makes ({})",
                    self.max,
                    super::MAX_HAYSTACK_LEN
                ),
            ));
        }
        Ok(())
    }

    /// How many lengths the range holds.
    fn count(&self) -> u128 {
        (self.max - self.min) as u128 + 1
    }
}

/// The most tokens (or filler bytes) one probe may generate in all: every prompt of
/// every instance at every length is held at once.
pub const MAX_PROBE_TOKENS: u128 = 1 << 28;

/// An error naming `field` when a probe's `total` tokens exceed [`MAX_PROBE_TOKENS`].
fn check_probe_total(field: &str, total: u128, what: &str) -> TaskResult<()> {
    if total > MAX_PROBE_TOKENS {
        return Err(TaskError::config(
            field,
            format!(
                "{what} make {total} tokens in all, more than the {MAX_PROBE_TOKENS} a probe may hold"
            ),
        ));
    }
    Ok(())
}

/// The paper's range: L = 24..=39.
impl Default for LengthRange {
    fn default() -> Self {
        LengthRange { min: 24, max: 39 }
    }
}

/// Where the filler span goes in the binding probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FillerPosition {
    /// Right after BOS, before the bindings: the bindings move with `L` (default; the
    /// paper's docstring line precedes the relevant code).
    #[default]
    BeforeContext,
    /// Between the bindings and the query: only the query moves with `L`.
    BeforeQuery,
}

/// How the filler span is filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FillerStyle {
    /// The first filler atom repeated `L` times (like `========`). Default.
    #[default]
    Repeat,
    /// A random sequence of filler atoms, fixed per instance; length `L` uses its first
    /// `L` atoms.
    Random,
}

/// The synthetic filler probe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BindingProbeConfig {
    /// Filler lengths. Default 24..=39.
    pub lengths: LengthRange,
    /// Independent contexts (each rendered at every length). Default 1.
    pub n_instances: usize,
    /// Bindings besides the correct and the distractor one. Default 0.
    pub n_other_bindings: usize,
    /// Filler placement. Default `before_context`.
    pub filler_position: FillerPosition,
    /// Filler content. Default `repeat`.
    pub filler_style: FillerStyle,
    /// Tokens per key. Default 1.
    pub key_len: usize,
    /// Tokens per value (the first token is scored). Default 1.
    pub value_len: usize,
    /// Assignment piece between key and value. Default false.
    pub assign: bool,
    /// Separator after each binding. Default false.
    pub binding_sep: bool,
    /// Query marker before the question. Default true.
    pub query_marker: bool,
    /// Start with BOS. Default true.
    pub bos: bool,
    /// Seed. Default 0.
    pub seed: u64,
    /// Longest allowed prompt; `None` = no limit. Default none.
    pub max_len: Option<usize>,
}

impl Default for BindingProbeConfig {
    fn default() -> Self {
        BindingProbeConfig {
            lengths: LengthRange::default(),
            n_instances: 1,
            n_other_bindings: 0,
            filler_position: FillerPosition::BeforeContext,
            filler_style: FillerStyle::Repeat,
            key_len: 1,
            value_len: 1,
            assign: false,
            binding_sep: false,
            query_marker: true,
            bos: true,
            seed: 0,
            max_len: None,
        }
    }
}

/// One filler-probe prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillerProbeItem {
    /// Which context (0 for the text probe).
    pub instance: usize,
    /// The configured filler length `L` (filler atoms, or repetitions of `filler_unit`).
    pub filler_len: usize,
    /// Token index range `[start, end)` of the filler span in `tokens`.
    pub filler_span: (usize, usize),
    /// The prompt (ends right before the answer).
    pub tokens: Vec<u32>,
    /// Position whose next-token distribution is read: `tokens.len() - 1`.
    pub read_pos: usize,
    /// The correct answer's ids; its first token is scored.
    pub correct: Vec<u32>,
    /// The distractor's ids; its first token is scored.
    pub distractor: Vec<u32>,
    /// Position of the correct binding's key (binding probe only).
    pub correct_key_pos: Option<usize>,
    /// Position of the distractor binding's key (binding probe only).
    pub distractor_key_pos: Option<usize>,
}

/// The synthetic filler probe: `n_instances x |lengths|` prompts, instance-major.
///
/// Layout (`F` = the filler span, at one of its two places):
/// `[BOS] [F] B_0 ... B_{M-1} [F] [QUERY] k [ASSIGN]`, read at the last position;
/// the bindings are the correct `k -> v`, the distractor `k' -> v'` (with
/// `v'[0] != v[0]`) and `n_other_bindings` random ones, in random order.
pub fn binding_filler_probe(
    space: &TokenSpace,
    cfg: &BindingProbeConfig,
) -> TaskResult<Vec<FillerProbeItem>> {
    check_binding_config(space, cfg)?;
    let n_bind = cfg.n_other_bindings + 2;
    let mut out = Vec::new();
    for inst in 0..cfg.n_instances {
        let context = BindingContext::sample(space, cfg, inst, n_bind);
        for l in cfg.lengths.iter() {
            out.push(context.prompt(space, cfg, l)?);
        }
    }
    Ok(out)
}

/// Check a binding probe's config against the token space; the error names the field.
fn check_binding_config(space: &TokenSpace, cfg: &BindingProbeConfig) -> TaskResult<()> {
    cfg.lengths.validate()?;
    if cfg.n_instances == 0 {
        return Err(TaskError::config("n_instances", "must be at least 1"));
    }
    if cfg.key_len == 0 {
        return Err(TaskError::config("key_len", "must be at least 1"));
    }
    if cfg.value_len == 0 {
        return Err(TaskError::config("value_len", "must be at least 1"));
    }
    let n_bind = cfg.n_other_bindings as u128 + 2;
    let per_prompt = n_bind
        .saturating_mul(cfg.key_len as u128 + cfg.value_len as u128 + 3)
        .saturating_add(cfg.lengths.max as u128 + 8);
    check_probe_total(
        "n_instances",
        (cfg.n_instances as u128)
            .saturating_mul(cfg.lengths.count())
            .saturating_mul(per_prompt),
        "n_instances ([task] n_logical of filler-probe) x lengths x (filler + bindings)",
    )?;
    let n_bind = n_bind as usize;
    if n_bind as u128 > space.key_space(cfg.key_len) {
        return Err(TaskError::config(
            "n_other_bindings",
            format!(
                "{n_bind} bindings need {n_bind} distinct keys, but only {} keys of key_len = {} exist",
                space.key_space(cfg.key_len),
                cfg.key_len
            ),
        ));
    }
    if space.value_atoms().len() < 2 {
        return Err(TaskError::config(
            "value_len",
            "the token space needs at least 2 value atoms for a correct and a distractor value",
        ));
    }
    if space.filler_atoms().is_empty() && cfg.lengths.max > 0 {
        return Err(TaskError::config(
            "filler_style",
            "the token space has no filler atoms",
        ));
    }
    if cfg.bos && space.bos().is_none() {
        return Err(TaskError::config("bos", "the token space has no BOS token"));
    }
    Ok(())
}

/// One context of the binding probe: its bindings (`keys[0] -> values[0]` correct,
/// `keys[1] -> values[1]` the distractor), their order in the prompt, and the longest
/// filler (each prompt takes its first `L` atoms).
struct BindingContext {
    instance: usize,
    keys: Vec<Vec<u32>>,
    values: Vec<Vec<u32>>,
    order: Vec<usize>,
    filler: Vec<u32>,
}

impl BindingContext {
    /// Draw context `inst` of `n_bind` bindings (from its own seeded stream).
    fn sample(space: &TokenSpace, cfg: &BindingProbeConfig, inst: usize, n_bind: usize) -> Self {
        let mut rng = rng_for(cfg.seed, inst as u64);
        let keys = sample_tuples(&mut rng, space.key_atoms(), cfg.key_len, n_bind, true);
        let mut values = sample_tuples(&mut rng, space.value_atoms(), cfg.value_len, n_bind, false);
        // values[0] is correct, values[1] the distractor: first tokens must differ.
        while values[1][0] == values[0][0] {
            values[1][0] = space.value_atoms()[rng.random_range(0..space.value_atoms().len())];
        }
        let mut order: Vec<usize> = (0..n_bind).collect();
        order.shuffle(&mut rng);
        let filler: Vec<u32> = match cfg.filler_style {
            FillerStyle::Repeat => {
                vec![space.filler_atoms().first().copied().unwrap_or(0); cfg.lengths.max]
            }
            FillerStyle::Random => (0..cfg.lengths.max)
                .map(|_| space.filler_atoms()[rng.random_range(0..space.filler_atoms().len())])
                .collect(),
        };
        BindingContext {
            instance: inst,
            keys,
            values,
            order,
            filler,
        }
    }

    /// The prompt of this context with filler length `l`; longer than `max_len` is an
    /// error.
    fn prompt(
        &self,
        space: &TokenSpace,
        cfg: &BindingProbeConfig,
        l: usize,
    ) -> TaskResult<FillerProbeItem> {
        let assign: &[u32] = if cfg.assign { space.assign() } else { &[] };
        let sep: &[u32] = if cfg.binding_sep { space.sep() } else { &[] };
        let mut t = Vec::new();
        if cfg.bos {
            t.extend(space.bos());
        }
        let mut span = (0, 0);
        let mut put_filler = |t: &mut Vec<u32>| {
            span = (t.len(), t.len() + l);
            t.extend_from_slice(&self.filler[..l]);
        };
        if cfg.filler_position == FillerPosition::BeforeContext {
            put_filler(&mut t);
        }
        let mut key_pos = vec![0; self.keys.len()];
        for &b in &self.order {
            key_pos[b] = t.len();
            t.extend_from_slice(&self.keys[b]);
            t.extend_from_slice(assign);
            t.extend_from_slice(&self.values[b]);
            t.extend_from_slice(sep);
        }
        if cfg.filler_position == FillerPosition::BeforeQuery {
            put_filler(&mut t);
        }
        if cfg.query_marker {
            t.extend_from_slice(space.query_marker());
        }
        t.extend_from_slice(&self.keys[0]);
        t.extend_from_slice(assign);
        if let Some(max) = cfg.max_len
            && t.len() > max
        {
            return Err(TaskError::config(
                "max_len",
                format!(
                    "the prompt for L = {l} needs {} tokens, more than max_len = {max}",
                    t.len()
                ),
            ));
        }
        Ok(FillerProbeItem {
            instance: self.instance,
            filler_len: l,
            filler_span: span,
            read_pos: t.len() - 1,
            tokens: t,
            correct: self.values[0].clone(),
            distractor: self.values[1].clone(),
            correct_key_pos: Some(key_pos[0]),
            distractor_key_pos: Some(key_pos[1]),
        })
    }
}

const DEFAULT_TEMPLATE: &str = "BLOCK = 32\n\ndef block_size():\n    \"\"\"Return the block size.\n\n    {filler}\n    \"\"\"\n    return 8\n\nassert block_size() ==";

/// The text filler probe (Hugging Face tokenizers).
///
/// The default is a code-completion analogue of the paper's example: a docstring
/// with a decorative line of `L` `=` characters, the right completion `" 8"` and the
/// wrong `" 32"` (both appear in the context).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TextProbeConfig {
    /// Prompt text with exactly one `{filler}` placeholder; the prompt ends right
    /// before the answer.
    pub template: String,
    /// Text repeated `L` times in place of `{filler}`. Default `"="`.
    pub filler_unit: String,
    /// Values of `L`. Default 24..=39.
    pub lengths: LengthRange,
    /// Correct continuation (tokenized alone, first token scored). Default `" 8"`.
    pub correct: String,
    /// Distractor continuation (tokenized alone, first token scored). Default `" 32"`.
    pub distractor: String,
    /// Let the tokenizer add its special tokens (BOS, ...) to the prompt. Default true.
    pub add_special_tokens: bool,
}

impl Default for TextProbeConfig {
    fn default() -> Self {
        TextProbeConfig {
            template: DEFAULT_TEMPLATE.to_string(),
            filler_unit: "=".to_string(),
            lengths: LengthRange::default(),
            correct: " 8".to_string(),
            distractor: " 32".to_string(),
            add_special_tokens: true,
        }
    }
}

/// The text filler probe: one prompt per `L`, tokenized as a whole
/// (`encode(text, add_special_tokens)`), read at the last token.
///
/// `filler_span` lists the tokens whose character offsets overlap the filler text
/// (BPE merges may make the token count of the filler differ from `L`).
pub fn text_filler_probe(
    tokenizer: &Tokenizer,
    cfg: &TextProbeConfig,
) -> TaskResult<Vec<FillerProbeItem>> {
    cfg.lengths.validate()?;
    check_probe_total(
        "filler_unit",
        cfg.lengths
            .count()
            .saturating_mul(cfg.lengths.max as u128)
            .saturating_mul(cfg.filler_unit.len().max(1) as u128),
        "lengths x filler_unit bytes",
    )?;
    const HOLE: &str = "{filler}";
    let Some((prefix, suffix)) = cfg.template.split_once(HOLE) else {
        return Err(TaskError::config(
            "template",
            "must contain the placeholder `{filler}`",
        ));
    };
    if suffix.contains(HOLE) {
        return Err(TaskError::config(
            "template",
            "must contain `{filler}` exactly once",
        ));
    }
    let (correct, distractor) = answer_ids(tokenizer, cfg)?;
    let fs = prefix.chars().count();
    let mut out = Vec::new();
    for l in cfg.lengths.iter() {
        let filler = cfg.filler_unit.repeat(l);
        let fe = fs + filler.chars().count();
        let text = format!("{prefix}{filler}{suffix}");
        let enc = encode(tokenizer, "template", &text, cfg.add_special_tokens)?;
        let ids = enc.get_ids().to_vec();
        if ids.is_empty() {
            return Err(TaskError::config("template", "encodes to no token"));
        }
        out.push(FillerProbeItem {
            instance: 0,
            filler_len: l,
            filler_span: filler_span(&enc, fs, fe),
            read_pos: ids.len() - 1,
            tokens: ids,
            correct: correct.clone(),
            distractor: distractor.clone(),
            correct_key_pos: None,
            distractor_key_pos: None,
        });
    }
    Ok(out)
}

/// Encode `text` (the probe's `what`, named in errors) with character offsets.
fn encode(
    tokenizer: &Tokenizer,
    what: &str,
    text: &str,
    special: bool,
) -> TaskResult<tokenizers::Encoding> {
    tokenizer
        .encode_char_offsets(text, special)
        .map_err(|e| TaskError::Tokenize {
            what: what.to_string(),
            text: text.to_string(),
            message: e.to_string(),
        })
}

/// The ids of the correct and the distractor continuation: neither empty, first
/// tokens different.
fn answer_ids(tokenizer: &Tokenizer, cfg: &TextProbeConfig) -> TaskResult<(Vec<u32>, Vec<u32>)> {
    let correct = encode(tokenizer, "correct", &cfg.correct, false)?
        .get_ids()
        .to_vec();
    let distractor = encode(tokenizer, "distractor", &cfg.distractor, false)?
        .get_ids()
        .to_vec();
    if correct.is_empty() {
        return Err(TaskError::config("correct", "encodes to no token"));
    }
    if distractor.is_empty() {
        return Err(TaskError::config("distractor", "encodes to no token"));
    }
    if correct[0] == distractor[0] {
        return Err(TaskError::config(
            "distractor",
            format!(
                "starts with the same token ({}) as `correct`; the probe compares first tokens",
                correct[0]
            ),
        ));
    }
    Ok((correct, distractor))
}

/// The token range `[start, end)` of the non-special tokens of `enc` whose character
/// offsets overlap the filler text `fs..fe`; without any, the empty range at the first
/// token from `fs` on.
fn filler_span(enc: &tokenizers::Encoding, fs: usize, fe: usize) -> (usize, usize) {
    let n = enc.get_ids().len();
    let offsets = enc.get_offsets();
    let special = enc.get_special_tokens_mask();
    let inside: Vec<usize> = (0..n)
        .filter(|&i| special.get(i) != Some(&1) && offsets[i].0 < fe && offsets[i].1 > fs)
        .collect();
    match (inside.first(), inside.last()) {
        (Some(&a), Some(&b)) => (a, b + 1),
        _ => {
            let k = (0..n)
                .find(|&i| special.get(i) != Some(&1) && offsets[i].0 >= fs)
                .unwrap_or(n);
            (k, k)
        }
    }
}
