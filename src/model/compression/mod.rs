//! Chunked-compression overlays for models that were not trained with a compressed
//! cache (issue 44): ONE component every kvc-family attention calls (kvc organisms,
//! Llama-family and Gemma 3 checkpoints), configured by `[model.compression]` in an
//! experiment or `--compression kind=select,block=8,top_k=4,window=32` on a command.
//!
//! Every overlay has a block grid: blocks of `block` tokens whose boundaries sit at
//! positions `offset + i * block`; a token's **phase** is `(position - offset) mod
//! block`.
//! - `select` (Quest-style block selection): each query scores every block that holds a
//!   token before its raw window by the channel-wise min / max bound of the block's
//!   keys (`score = sum_d max(q_d min_d, q_d max_d)`, Quest) or by its mean key, takes
//!   the maximum over the layer's query heads, and attends (one softmax) to the raw
//!   tokens of its `top_k` best blocks outside the window, the last `window` tokens, and
//!   the first `sinks` tokens. The choice is shared by the heads of a layer.
//! - `evict` (ChunkKV-style eviction at prefill): the last `observe` tokens are the
//!   observation window; their attention over the earlier tokens (summed over heads and
//!   window queries, then within chunks of `chunk` tokens) scores the chunks, and the
//!   best `keep` fraction stays for every query from the window on (the window itself
//!   and `sinks` leading tokens always stay); queries before the window see everything
//!   (they ran before the cache was compressed). Per layer. With `decode = n`, the
//!   sequence's last `n` tokens are decoding after the prefill (teacher-forced answer
//!   tokens): the window is the `observe` tokens before them, and they always stay.
//! - `pool` (pooled entries, CSA / HCA-like, training-free): every `stride` tokens a
//!   window of `window` tokens becomes one entry, keys and values averaged (keys before
//!   RoPE, the entry rotated at its window's first position); an entry is visible from
//!   the query at its window's last position on; the last `local` raw tokens are read
//!   beside the entries (kvc's compressed attention with uniform gates).
//! - `learned` (a trained compressor, DeepSeek-V4-style): `pool`'s windows with
//!   softmax gates per token and KV head (logits from the layer's input plus a
//!   per-offset bias), separately for keys and values, trained by self-distillation on
//!   the frozen model (`phaselens train` on a `[compressor]` recipe). With zero weights
//!   it is `pool` exactly.
//!
//! Hook points, captured and patched like any activation (docs/hooks.md):
//! - `select`: `attn.indexer.hook_scores` (`[batch, query_pos, block]`, the block
//!   scores) and `attn.indexer.hook_selected` (1.0 for the blocks each query keeps).
//! - `evict`: the same two names, one row per sequence (the eviction is decided once,
//!   when the prefill ends): `attn.indexer.hook_scores` `[batch, chunk]`, each chunk's
//!   attention mass from the observation window, and `attn.indexer.hook_selected`
//!   `[batch, chunk]`, 1.0 for the kept chunks; a patched mask changes which chunks
//!   every query from the window on reads (`evict.rs`).
//! - `pool` and `learned`: compressed attention's points, `attn.compressor.hook_key_gate`
//!   / `hook_value_gate` (`[batch, entry, offset, kv_head]`: the pooling weights per
//!   window offset, uniform for `pool`), `learned`'s gate logits before the softmax
//!   (`hook_key_gate_logits` / `hook_value_gate_logits`, the per-offset bias included)
//!   and the pooled entries (`hook_compressed_k` / `hook_compressed_v`).
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the `[model.compression]` table, its text form, validation |
//! | `select.rs` | the block selector of `select`, the block grid |
//! | `evict.rs` | the chunk selector of `evict` |
//! | `learned.rs` | the trained compressor of `learned`: its folder, identity checks |

mod evict;
pub mod learned;
mod select;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use evict::{ChunkSelector, Eviction};
pub use select::{BlockScore, BlockSelector, Grid};

/// `[model.compression]`: one overlay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Overlay {
    /// Quest-style block selection.
    Select {
        /// Tokens per block (the phase period).
        block: usize,
        /// Blocks each query keeps.
        top_k: usize,
        /// Raw tokens a query always sees (itself included).
        window: usize,
        /// Where the block grid starts (`0..block`).
        #[serde(default)]
        offset: usize,
        /// Leading tokens every query sees (attention sinks).
        #[serde(default)]
        sinks: usize,
        /// How a block is scored: `min_max` (Quest's bound) or `mean`.
        #[serde(default)]
        score: BlockScore,
    },
    /// ChunkKV-style chunk eviction at prefill.
    Evict {
        /// Tokens per chunk (the phase period).
        chunk: usize,
        /// The fraction of the chunks before the observation window that stays.
        keep: f64,
        /// The observation window: the sequence's last tokens, whose attention scores
        /// the chunks and which stay.
        observe: usize,
        /// Where the chunk grid starts (`0..chunk`).
        #[serde(default)]
        offset: usize,
        /// Leading tokens never evicted.
        #[serde(default)]
        sinks: usize,
        /// Tokens at the end of every sequence that come after the prefill: the
        /// teacher-forced answer tokens an experiment feeds after its query. The cache
        /// is compressed when the prefill ends, so the observation window is the
        /// `observe` tokens before them, and they, like the window, always stay.
        /// Without it (0) the window would include the answer's own tokens, whose
        /// attention helps keep the chunk that holds the answer: a leak.
        #[serde(default)]
        decode: usize,
    },
    /// Mean-pooled entries (kvc compressed attention with uniform gates).
    Pool {
        /// Tokens pooled into one entry (`W >= stride`).
        window: usize,
        /// Tokens between entries (the phase period).
        stride: usize,
        /// Raw tokens read beside the entries.
        #[serde(default)]
        local: usize,
    },
    /// A trained compressor (DeepSeek-V4-style): per window, softmax-gated pooling of the
    /// keys and of the values, with per-token gate logits from the layer's input and a
    /// per-offset gate bias, distilled on the frozen model by `phaselens train` on a
    /// `[compressor]` recipe (`src/train/compressor/`).
    Learned {
        /// The trained compressor's folder (`compressor.json` +
        /// `compressor.safetensors`), relative to the working directory.
        checkpoint: String,
        /// Tokens pooled into one entry (`W >= stride`); must equal the checkpoint's.
        window: usize,
        /// Tokens between entries (the phase period); must equal the checkpoint's.
        stride: usize,
        /// Raw tokens read beside the entries; must equal the checkpoint's.
        #[serde(default)]
        local: usize,
    },
}

impl Overlay {
    /// The phase period: `block` (select) or `stride` (pool).
    pub fn period(&self) -> usize {
        match self {
            Overlay::Select { block, .. } => *block,
            Overlay::Evict { chunk, .. } => *chunk,
            Overlay::Pool { stride, .. } | Overlay::Learned { stride, .. } => *stride,
        }
    }

    /// Where the block grid starts: `offset` (select, evict); the entries of `pool` and
    /// `learned` start at position 0.
    pub fn offset(&self) -> usize {
        match self {
            Overlay::Select { offset, .. } | Overlay::Evict { offset, .. } => *offset,
            Overlay::Pool { .. } | Overlay::Learned { .. } => 0,
        }
    }

    /// Check every key against the others and against a context of `context`
    /// positions (when known); the error names the key.
    pub fn validate(&self, context: Option<usize>) -> Result<()> {
        // (key, value) pairs that must be at least 1; (key, span, grid) where the span
        // must fit the context and an offset must lie inside the grid.
        let (counts, span, offset): Checks = match *self {
            Overlay::Select {
                block,
                top_k,
                window,
                offset,
                ..
            } => (
                vec![("block", block), ("top_k", top_k), ("window", window)],
                ("block", block),
                Some(offset),
            ),
            Overlay::Evict {
                chunk,
                keep,
                observe,
                offset,
                ..
            } => {
                if !(keep > 0.0 && keep <= 1.0) {
                    return Err(field(
                        "keep",
                        format!("must be a fraction in (0, 1], got {keep}"),
                    ));
                }
                (
                    vec![("chunk", chunk), ("observe", observe)],
                    ("chunk", chunk),
                    Some(offset),
                )
            }
            Overlay::Pool { window, stride, .. } | Overlay::Learned { window, stride, .. } => {
                if let Overlay::Learned { checkpoint, .. } = self
                    && checkpoint.trim().is_empty()
                {
                    return Err(field(
                        "checkpoint",
                        "must name a trained compressor's folder".into(),
                    ));
                }
                if stride > 0 && window > 0 && window < stride {
                    return Err(field(
                        "window",
                        format!("must be >= stride ({stride}), got {window}"),
                    ));
                }
                (
                    vec![("window", window), ("stride", stride)],
                    ("window", window),
                    None,
                )
            }
        };
        if let Some((k, _)) = counts.iter().find(|(_, v)| *v == 0) {
            return Err(field(k, "must be at least 1".into()));
        }
        let (name, len) = span;
        if let Some(o) = offset
            && o >= len
        {
            return Err(field(
                "offset",
                format!("must be in 0..{len} (the {name}), got {o}"),
            ));
        }
        if let Some(c) = context
            && len > c
        {
            return Err(field(
                name,
                format!("{len} is longer than the model's context of {c} positions"),
            ));
        }
        Ok(())
    }
}

/// What [`Overlay::validate`] checks of one overlay: the keys that must be at least 1,
/// the key whose length must fit the context, and the grid offset.
type Checks = (
    Vec<(&'static str, usize)>,
    (&'static str, usize),
    Option<usize>,
);

/// An error of key `compression.{key}`.
fn field(key: &str, message: String) -> Error {
    Error::field(format!("compression.{key}"), message)
}

/// The keys whose values are whole numbers.
const INTEGER_KEYS: &[&str] = &[
    "block", "top_k", "window", "offset", "sinks", "stride", "local", "decode",
];

/// `kind=select,block=8,top_k=4,window=32` (the keys of the TOML table).
impl FromStr for Overlay {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut table = toml::Table::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                format!("`{part}`: expected key=value (e.g. kind=select,block=8,top_k=4,window=32)")
            })?;
            let (k, v) = (k.trim(), v.trim());
            let value = match (v.parse::<i64>(), v.parse::<f64>()) {
                (Ok(n), _) => toml::Value::Integer(n),
                _ if INTEGER_KEYS.contains(&k) => {
                    return Err(format!("key `{k}`: expected a whole number, got `{v}`"));
                }
                (_, Ok(x)) => toml::Value::Float(x),
                _ => toml::Value::String(v.to_string()),
            };
            if table.insert(k.to_string(), value).is_some() {
                return Err(format!("key `{k}` given twice"));
            }
        }
        if !table.contains_key("kind") {
            return Err("no `kind` (select, evict, pool or learned)".into());
        }
        let o: Overlay = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| format!("--compression: {}", e.message()))?;
        o.validate(None).map_err(|e| e.to_string())?;
        Ok(o)
    }
}

impl fmt::Display for Overlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Overlay::Select {
                block,
                top_k,
                window,
                offset,
                sinks,
                score,
            } => write!(
                f,
                "select (block {block}, top {top_k}, window {window}, offset {offset}, sinks {sinks}, {score})"
            ),
            Overlay::Evict {
                chunk,
                keep,
                observe,
                offset,
                sinks,
                decode,
            } => write!(
                f,
                "evict (chunk {chunk}, keep {keep}, observe {observe}, offset {offset}, sinks {sinks}, decode {decode})"
            ),
            Overlay::Pool {
                window,
                stride,
                local,
            } => write!(f, "pool (window {window}, stride {stride}, local {local})"),
            Overlay::Learned {
                checkpoint,
                window,
                stride,
                local,
            } => write!(
                f,
                "learned (window {window}, stride {stride}, local {local}, checkpoint {checkpoint})"
            ),
        }
    }
}
