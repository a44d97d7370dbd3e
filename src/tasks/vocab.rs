//! Token spaces: the synthetic organism vocabulary and Hugging Face tokenizers.
//!
//! A [`TokenSpace`] resolves everything a prompt generator needs to token ids:
//! one pad token, an optional BOS token, the separator / assignment / query-marker
//! pieces (each a possibly empty id sequence), and three pools of *atoms* (single
//! tokens): filler atoms, key atoms and value atoms. A key of `key_len` tokens is a
//! sequence of `key_len` key atoms; a value of `value_len` tokens is a sequence of
//! value atoms. Generators only ever concatenate these id sequences, so a prompt's
//! positions are exact whatever the backend.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use tokenizers::models::ModelWrapper;

use super::{TaskError, TaskResult};

/// A half-open range of token ids `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRange {
    /// First id in the range.
    pub start: u32,
    /// One past the last id.
    pub end: u32,
}

impl TokenRange {
    /// `start..end`.
    pub const fn new(start: u32, end: u32) -> Self {
        TokenRange { start, end }
    }

    /// Number of ids in the range (0 when `end <= start`).
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start) as usize
    }

    /// True when the range holds no id.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `id` lies in the range.
    pub fn contains(&self, id: u32) -> bool {
        self.start <= id && id < self.end
    }

    fn overlaps(&self, other: &TokenRange) -> bool {
        !self.is_empty() && !other.is_empty() && self.start < other.end && other.start < self.end
    }

    fn ids(&self) -> Vec<u32> {
        (self.start..self.end).collect()
    }
}

/// Layout of the organisms' synthetic vocabulary.
///
/// Defaults (vocab size 128):
///
/// | ids | role |
/// |---|---|
/// | 0 | `PAD` (padding; an ordinary token that occupies a position) |
/// | 1 | `BOS` |
/// | 2 | `SEP` (ends a binding when `binding_sep` is on) |
/// | 3 | `QUERY` (query marker) |
/// | 4 | `ASSIGN` (between key and value when `assign` is on) |
/// | 5..8 | reserved (unused) |
/// | 8..16 | filler tokens (filler probe) |
/// | 16..64 | key tokens (48) |
/// | 64..128 | value tokens (64; chance level 1/64) |
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyntheticVocabConfig {
    /// Total vocabulary size; every id below must be smaller. Default 128.
    pub vocab_size: u32,
    /// Pad token id. Default 0.
    pub pad: u32,
    /// Beginning-of-sequence id. Default 1.
    pub bos: u32,
    /// Binding separator id. Default 2.
    pub sep: u32,
    /// Query marker id. Default 3.
    pub query: u32,
    /// Key/value assignment id. Default 4.
    pub assign: u32,
    /// Filler token ids. Default 8..16. May be empty (then the filler probe errors).
    pub filler: TokenRange,
    /// Key token ids. Default 16..64.
    pub keys: TokenRange,
    /// Value token ids. Default 64..128.
    pub values: TokenRange,
}

impl Default for SyntheticVocabConfig {
    fn default() -> Self {
        SyntheticVocabConfig {
            vocab_size: 128,
            pad: 0,
            bos: 1,
            sep: 2,
            query: 3,
            assign: 4,
            filler: TokenRange::new(8, 16),
            keys: TokenRange::new(16, 64),
            values: TokenRange::new(64, 128),
        }
    }
}

impl SyntheticVocabConfig {
    /// Check the layout: ids inside the vocabulary, special ids distinct, ranges
    /// disjoint from each other and from the special ids, keys and values non-empty.
    pub fn validate(&self) -> TaskResult<()> {
        if self.vocab_size == 0 {
            return Err(TaskError::config("vocab_size", "must be at least 1"));
        }
        let specials = [
            ("pad", self.pad),
            ("bos", self.bos),
            ("sep", self.sep),
            ("query", self.query),
            ("assign", self.assign),
        ];
        for (i, &(name, id)) in specials.iter().enumerate() {
            if id >= self.vocab_size {
                return Err(TaskError::config(
                    name,
                    format!(
                        "id {id} is outside the vocabulary (vocab_size = {})",
                        self.vocab_size
                    ),
                ));
            }
            if let Some(&(other, _)) = specials[..i].iter().find(|(_, o)| *o == id) {
                return Err(TaskError::config(
                    name,
                    format!("id {id} is already used by `{other}`"),
                ));
            }
        }
        let ranges = [
            ("filler", self.filler),
            ("keys", self.keys),
            ("values", self.values),
        ];
        for (i, &(name, r)) in ranges.iter().enumerate() {
            if r.start > r.end {
                return Err(TaskError::config(
                    name,
                    format!("start {} is after end {}", r.start, r.end),
                ));
            }
            if r.end > self.vocab_size {
                return Err(TaskError::config(
                    name,
                    format!("end {} exceeds vocab_size = {}", r.end, self.vocab_size),
                ));
            }
            if name != "filler" && r.is_empty() {
                return Err(TaskError::config(name, "must hold at least one id"));
            }
            for &(other, o) in &ranges[..i] {
                if r.overlaps(&o) {
                    return Err(TaskError::config(
                        name,
                        format!(
                            "{}..{} overlaps `{other}` {}..{}",
                            r.start, r.end, o.start, o.end
                        ),
                    ));
                }
            }
            for &(sname, id) in &specials {
                if r.contains(id) {
                    return Err(TaskError::config(
                        name,
                        format!("{}..{} contains the `{sname}` id {id}", r.start, r.end),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn default_sep() -> String {
    "\n".to_string()
}
fn default_assign() -> String {
    ":".to_string()
}
fn default_query() -> String {
    "Query:\n".to_string()
}

const DEFAULT_KEY_WORDS: &[&str] = &[
    "apple", "river", "stone", "cloud", "tiger", "piano", "castle", "forest", "garden", "window",
    "rocket", "candle", "bridge", "island", "mirror", "pencil", "dragon", "planet", "engine",
    "harbor", "jacket", "ladder", "meadow", "needle", "pepper", "rabbit", "saddle", "tunnel",
    "violin", "wagon", "anchor", "basket", "button", "camera", "carpet", "cookie", "desert",
    "farmer", "finger", "hammer", "helmet", "kitten", "lemon", "magnet", "monkey", "napkin",
    "office", "pillow", "pocket", "puzzle", "ribbon", "marble", "shadow", "shield", "spider",
    "summer", "ticket", "tomato", "turtle", "wallet", "winter", "zipper", "bottle", "doctor",
];

const DEFAULT_VALUE_WORDS: &[&str] = &[
    " red", " blue", " green", " black", " white", " gold", " pink", " gray", " brown", " purple",
    " one", " two", " three", " four", " five", " six", " seven", " eight", " nine", " ten",
    " cat", " dog", " cow", " fox", " owl", " bee", " ant", " bat", " pig", " rat", " north",
    " south", " east", " west", " up", " down", " left", " right", " hot", " cold", " big",
    " small", " fast", " slow", " old", " new", " good", " bad", " high", " low", " sun", " moon",
    " star", " sky", " sea", " rain", " snow", " wind", " fire", " ice", " tree", " leaf", " rock",
    " sand",
];

fn default_key_words() -> Vec<String> {
    DEFAULT_KEY_WORDS.iter().map(|w| w.to_string()).collect()
}
fn default_value_words() -> Vec<String> {
    DEFAULT_VALUE_WORDS.iter().map(|w| w.to_string()).collect()
}
fn default_filler_words() -> Vec<String> {
    ["=", "-", "*", "#"].iter().map(|w| w.to_string()).collect()
}

/// A token space backed by a Hugging Face `tokenizer.json`.
///
/// Every piece is tokenized *on its own* (`encode(piece, add_special_tokens = false)`)
/// and prompts are the concatenation of the pieces' ids. Keys and values are built
/// from words that tokenize to exactly one token; words that do not are dropped
/// (see [`TokenSpace::dropped_words`]). With the default pieces and a prompt with
/// `assign` and `binding_sep` on, a binding reads `apple: red\n` and the query
/// section starts with `Query:\n`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HfVocabConfig {
    /// Path of the `tokenizer.json` (required; not read by [`TokenSpace::huggingface_with`]).
    pub tokenizer: PathBuf,
    /// The pad token: a token string (e.g. `"<|endoftext|>"`) or a text piece that
    /// encodes to exactly one token (required).
    pub pad: String,
    /// The BOS token string, if the model uses one. Default: none.
    #[serde(default)]
    pub bos: Option<String>,
    /// Text ending a binding (used when `binding_sep` is on). Default `"\n"`.
    #[serde(default = "default_sep")]
    pub sep: String,
    /// Text between key and value (used when `assign` is on). Default `":"`.
    #[serde(default = "default_assign")]
    pub assign: String,
    /// Query marker text. Default `"Query:\n"`.
    #[serde(default = "default_query")]
    pub query: String,
    /// Key atoms (each must encode to one token). Default: 64 common nouns
    /// (`"apple"`, `"river"`, ...).
    #[serde(default = "default_key_words")]
    pub key_words: Vec<String>,
    /// Value atoms (each must encode to one token). Default: 64 short words with a
    /// leading space (`" red"`, `" two"`, ...).
    #[serde(default = "default_value_words")]
    pub value_words: Vec<String>,
    /// Filler atoms for the binding filler probe. Default `["=", "-", "*", "#"]`.
    #[serde(default = "default_filler_words")]
    pub filler_words: Vec<String>,
}

impl HfVocabConfig {
    /// A config with the given tokenizer path and pad token, all else default.
    pub fn new(tokenizer: impl Into<PathBuf>, pad: impl Into<String>) -> Self {
        HfVocabConfig {
            tokenizer: tokenizer.into(),
            pad: pad.into(),
            bos: None,
            sep: default_sep(),
            assign: default_assign(),
            query: default_query(),
            key_words: default_key_words(),
            value_words: default_value_words(),
            filler_words: default_filler_words(),
        }
    }
}

/// Which token space a task uses (`kind = "synthetic"` or `kind = "hugging_face"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TokenSpaceConfig {
    /// The organisms' synthetic vocabulary.
    Synthetic(SyntheticVocabConfig),
    /// A Hugging Face `tokenizer.json`.
    HuggingFace(HfVocabConfig),
}

impl Default for TokenSpaceConfig {
    fn default() -> Self {
        TokenSpaceConfig::Synthetic(SyntheticVocabConfig::default())
    }
}

impl TokenSpaceConfig {
    /// Build the token space (loads the tokenizer for `hugging_face`).
    pub fn build(&self) -> TaskResult<TokenSpace> {
        match self {
            TokenSpaceConfig::Synthetic(c) => TokenSpace::synthetic(c),
            TokenSpaceConfig::HuggingFace(c) => TokenSpace::huggingface(c),
        }
    }
}

#[derive(Debug, Clone)]
enum Backend {
    Synthetic(SyntheticVocabConfig),
    HuggingFace {
        tokenizer: Box<Tokenizer>,
        dropped: Vec<String>,
    },
}

/// The resolved vocabulary of a task: special ids, pieces and atom pools.
#[derive(Debug, Clone)]
pub struct TokenSpace {
    pad: u32,
    bos: Option<u32>,
    sep: Vec<u32>,
    assign: Vec<u32>,
    query: Vec<u32>,
    filler: Vec<u32>,
    keys: Vec<u32>,
    values: Vec<u32>,
    vocab_size: usize,
    backend: Backend,
}

impl TokenSpace {
    /// The synthetic organism vocabulary.
    pub fn synthetic(cfg: &SyntheticVocabConfig) -> TaskResult<Self> {
        cfg.validate()?;
        Ok(TokenSpace {
            pad: cfg.pad,
            bos: Some(cfg.bos),
            sep: vec![cfg.sep],
            assign: vec![cfg.assign],
            query: vec![cfg.query],
            filler: cfg.filler.ids(),
            keys: cfg.keys.ids(),
            values: cfg.values.ids(),
            vocab_size: cfg.vocab_size as usize,
            backend: Backend::Synthetic(cfg.clone()),
        })
    }

    /// The default synthetic vocabulary (see [`SyntheticVocabConfig`]).
    pub fn default_synthetic() -> Self {
        Self::synthetic(&SyntheticVocabConfig::default()).expect("default layout is valid")
    }

    /// A Hugging Face token space, loading `cfg.tokenizer`.
    pub fn huggingface(cfg: &HfVocabConfig) -> TaskResult<Self> {
        let path = crate::model::pretrained::expand_model_path(&cfg.tokenizer);
        let load_err = |message: String| TaskError::TokenizerLoad {
            path: path.display().to_string(),
            message,
        };
        let tokenizer = if path.extension().is_some_and(|e| e == "json") {
            Tokenizer::from_file(&path).map_err(|e| load_err(e.to_string()))?
        } else {
            // A GGUF file (or a folder holding one): its tokenizer, built from the
            // file's metadata (crate::tokenizer), as the same `tokenizers` pipeline.
            let t =
                crate::tokenizer::Tokenizer::open(&path).map_err(|e| load_err(e.to_string()))?;
            let json = t.to_json().map_err(|e| load_err(e.to_string()))?;
            json.parse::<Tokenizer>()
                .map_err(|e| load_err(e.to_string()))?
        };
        Self::huggingface_with(tokenizer, cfg)
    }

    /// A Hugging Face token space from an already loaded tokenizer
    /// (`cfg.tokenizer` is not read).
    pub fn huggingface_with(tokenizer: Tokenizer, cfg: &HfVocabConfig) -> TaskResult<Self> {
        let tk = &tokenizer;
        let pad = hf_single(tk, "pad", &cfg.pad)?;
        let bos = cfg
            .bos
            .as_deref()
            .map(|b| hf_single(tk, "bos", b))
            .transpose()?;
        let sep = hf_encode(tk, "sep", &cfg.sep)?;
        let assign = hf_encode(tk, "assign", &cfg.assign)?;
        let query = hf_encode(tk, "query", &cfg.query)?;
        // Ids that can never be atoms: the unknown token and special added tokens.
        let mut banned: Vec<u32> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        banned.extend(unk_id(&tokenizer));
        banned.push(pad);
        let mut dropped = Vec::new();
        let mut atoms =
            |field: &str, words: &[String]| hf_atoms(tk, &banned, &mut dropped, field, words);
        let keys = atoms("key_words", &cfg.key_words)?;
        let values = atoms("value_words", &cfg.value_words)?;
        let filler = atoms("filler_words", &cfg.filler_words)?;
        check_hf_atoms(&keys, &values)?;
        let vocab_size = tokenizer.get_vocab_size(true);
        Ok(TokenSpace {
            pad,
            bos,
            sep,
            assign,
            query,
            filler,
            keys,
            values,
            vocab_size,
            backend: Backend::HuggingFace {
                tokenizer: Box::new(tokenizer),
                dropped,
            },
        })
    }

    /// The pad token.
    pub fn pad(&self) -> u32 {
        self.pad
    }
    /// The BOS token, if any.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    /// Ids ending a binding (when `binding_sep` is on).
    pub fn sep(&self) -> &[u32] {
        &self.sep
    }
    /// Ids between key and value (when `assign` is on).
    pub fn assign(&self) -> &[u32] {
        &self.assign
    }
    /// Ids of the query marker.
    pub fn query_marker(&self) -> &[u32] {
        &self.query
    }
    /// Filler atoms (single tokens).
    pub fn filler_atoms(&self) -> &[u32] {
        &self.filler
    }
    /// Key atoms (single tokens).
    pub fn key_atoms(&self) -> &[u32] {
        &self.keys
    }
    /// Value atoms (single tokens).
    pub fn value_atoms(&self) -> &[u32] {
        &self.values
    }
    /// Vocabulary size (including added tokens for HF).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    /// True for the synthetic vocabulary.
    pub fn is_synthetic(&self) -> bool {
        matches!(self.backend, Backend::Synthetic(_))
    }
    /// The tokenizer, for the HF backend.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        match &self.backend {
            Backend::HuggingFace { tokenizer, .. } => Some(tokenizer),
            Backend::Synthetic(_) => None,
        }
    }
    /// Words of the HF config that were dropped because they do not encode to exactly
    /// one token, or to the unknown token, a special token, the pad token or a token
    /// already taken by an earlier word of the same list. Empty for the synthetic
    /// vocabulary.
    pub fn dropped_words(&self) -> &[String] {
        match &self.backend {
            Backend::HuggingFace { dropped, .. } => dropped,
            Backend::Synthetic(_) => &[],
        }
    }

    /// Number of distinct keys of `key_len` atoms (saturating).
    pub fn key_space(&self, key_len: usize) -> u128 {
        tuple_space(self.keys.len(), key_len)
    }
    /// Number of distinct values of `value_len` atoms (saturating).
    pub fn value_space(&self, value_len: usize) -> u128 {
        tuple_space(self.values.len(), value_len)
    }

    /// Human-readable rendering of ids: the tokenizer's decoding for HF, names such as
    /// `<bos> k3 v17 ?` for the synthetic vocabulary.
    pub fn render(&self, ids: &[u32]) -> String {
        match &self.backend {
            Backend::HuggingFace { tokenizer, .. } => tokenizer
                .decode(ids, false)
                .unwrap_or_else(|_| format!("{ids:?}")),
            Backend::Synthetic(c) => ids
                .iter()
                .map(|&id| synthetic_name(c, id))
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// The ids of `text` (field `what`, named in errors), without special tokens.
fn hf_encode(tokenizer: &Tokenizer, what: &str, text: &str) -> TaskResult<Vec<u32>> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| TaskError::Tokenize {
            what: what.to_string(),
            text: text.to_string(),
            message: e.to_string(),
        })
}

/// The one id of `text` (a token of the vocabulary, or text that encodes to one
/// token); anything else is an error naming `field`.
fn hf_single(tokenizer: &Tokenizer, field: &str, text: &str) -> TaskResult<u32> {
    if let Some(id) = tokenizer.token_to_id(text) {
        return Ok(id);
    }
    let ids = hf_encode(tokenizer, field, text)?;
    match ids.as_slice() {
        [id] => Ok(*id),
        _ => Err(TaskError::config(
            field.to_string(),
            format!(
                "{text:?} must be one token, but encodes to {} tokens {ids:?}",
                ids.len()
            ),
        )),
    }
}

/// The atoms of `words` (field `field`): each word that encodes to one token, not
/// `banned` and not seen before; the other words go to `dropped`.
fn hf_atoms(
    tokenizer: &Tokenizer,
    banned: &[u32],
    dropped: &mut Vec<String>,
    field: &str,
    words: &[String],
) -> TaskResult<Vec<u32>> {
    let mut out: Vec<u32> = Vec::new();
    for w in words {
        let ids = hf_encode(tokenizer, field, w)?;
        match ids.as_slice() {
            [id] if !banned.contains(id) && !out.contains(id) => out.push(*id),
            _ => dropped.push(w.clone()),
        }
    }
    Ok(out)
}

/// Key and value atoms: neither empty, no token both.
fn check_hf_atoms(keys: &[u32], values: &[u32]) -> TaskResult<()> {
    if keys.is_empty() {
        return Err(TaskError::config(
            "key_words",
            "no word encodes to exactly one token with this tokenizer",
        ));
    }
    if values.is_empty() {
        return Err(TaskError::config(
            "value_words",
            "no word encodes to exactly one token with this tokenizer",
        ));
    }
    if let Some(k) = keys.iter().find(|k| values.contains(k)) {
        return Err(TaskError::config(
            "value_words",
            format!("token {k} is both a key atom and a value atom"),
        ));
    }
    Ok(())
}

/// The id of the model's unknown token, if it has one.
fn unk_id(tokenizer: &Tokenizer) -> Option<u32> {
    let name = match tokenizer.get_model() {
        ModelWrapper::BPE(m) => m.unk_token.clone(),
        ModelWrapper::WordPiece(m) => Some(m.unk_token.clone()),
        ModelWrapper::WordLevel(m) => Some(m.unk_token.clone()),
        // Unigram's unk id is private; its "<unk>" is normally a special added token.
        ModelWrapper::Unigram(_) => None,
    };
    name.and_then(|n| tokenizer.token_to_id(&n))
}

fn tuple_space(atoms: usize, len: usize) -> u128 {
    // Bounded: the loop stops once the count saturates (a key_len of 10^18 used to
    // spin here for ever).
    if atoms <= 1 || len == 0 {
        return if len == 0 { 1 } else { atoms as u128 };
    }
    let mut n: u128 = 1;
    for _ in 0..len {
        n = n.saturating_mul(atoms as u128);
        if n == u128::MAX {
            break;
        }
    }
    n
}

fn synthetic_name(c: &SyntheticVocabConfig, id: u32) -> String {
    match id {
        _ if id == c.pad => "<pad>".into(),
        _ if id == c.bos => "<bos>".into(),
        _ if id == c.sep => ";".into(),
        _ if id == c.query => "?".into(),
        _ if id == c.assign => ":".into(),
        _ if c.filler.contains(id) => format!("f{}", id - c.filler.start),
        _ if c.keys.contains(id) => format!("k{}", id - c.keys.start),
        _ if c.values.contains(id) => format!("v{}", id - c.values.start),
        _ => format!("<{id}>"),
    }
}
