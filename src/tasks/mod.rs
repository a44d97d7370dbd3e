//! Phase-controlled prompt generators (no model code).
//!
//! Everything here turns a seed and a config into token-id prompts plus the metadata
//! the experiment runner and the trainer need:
//!
//! - [`TokenSpace`]: the vocabulary a task draws from, either the organisms'
//!   synthetic vocabulary ([`SyntheticVocabConfig`]) or a Hugging Face
//!   `tokenizer.json` ([`HfVocabConfig`]).
//! - KV retrieval (the paper's needle-in-a-haystack): [`generate_eval_set`] builds
//!   phase-matched evaluation sets under both [`Protocol`]s, [`KvTrainSampler`]
//!   draws training batches with random prefix padding.
//! - Long-context retrieval: [`HaystackConfig`] spreads the bindings through a long
//!   haystack with the needle at a chosen depth, at every phase.
//! - Prompt batches for the patching routine ([`prompts`]): a phase group of an
//!   evaluation set as clean prompts or clean/corrupted pairs.
//! - Passkey and natural-text needle ([`generate_text_needle_set`]): a value inside
//!   varied natural filler, placed at every phase in tokens (real tokenizers).
//! - Filler-length probe (the paper's code-completion flip):
//!   [`binding_filler_probe`] (any token space) and [`text_filler_probe`]
//!   (a text template with a `{filler}` placeholder, HF tokenizers).
//!
//! The exact layouts are documented in `docs/prompt_format.md`.
//! All randomness is ChaCha8 seeded from the config, so a config reproduces its
//! prompts bit for bit (with the crate versions pinned in `Cargo.lock`).

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

mod filler;
mod haystack;
mod kv;
mod needle;
pub mod prompts;
mod vocab;

#[cfg(test)]
mod tests;

pub use filler::{
    BindingProbeConfig, FillerPosition, FillerProbeItem, FillerStyle, LengthRange, TextProbeConfig,
    binding_filler_probe, text_filler_probe,
};
pub use haystack::{HaystackConfig, HaystackExample, HaystackFiller, MAX_HAYSTACK_LEN};
pub use kv::{
    Binding, Curriculum, IGNORE_INDEX, KvEvalConfig, KvEvalSet, KvExample, KvPromptConfig, KvQuery,
    KvTrainConfig, KvTrainSampler, QueryMarker, QuerySampling, TrainBatch, generate_eval_set,
    matched_block_size,
};
pub use needle::{
    FILLER_SENTENCES, Fact, MAX_TEXT_LEN, NEEDLE_INTRO, PASSKEY_INTRO, PASSKEY_QUESTION,
    PASSKEY_SENTENCE, TextCorruption, TextNeedleConfig, TextNeedleExample, TextNeedleSet, TextTask,
    TextTokens, VALUE_SLOT, builtin_facts, corrupt_text_example, generate_text_needle_set,
    text_cut_len,
};
pub use vocab::{HfVocabConfig, SyntheticVocabConfig, TokenRange, TokenSpace, TokenSpaceConfig};

/// Errors of the task generators. Configuration errors name the offending field.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A config value is impossible or inconsistent; `field` is its name in the config.
    #[error("invalid task config: `{field}`: {reason}")]
    Config {
        /// The field.
        field: String,
        /// Why it is impossible.
        reason: String,
    },
    /// A `tokenizer.json` could not be loaded.
    #[error("cannot load tokenizer {path}: {message}")]
    TokenizerLoad {
        /// The file.
        path: String,
        /// What the tokenizer library said.
        message: String,
    },
    /// The tokenizer failed on a piece of text.
    #[error("tokenizer failed on {what} {text:?}: {message}")]
    Tokenize {
        /// What the text is (a key, a value, filler, ...).
        what: String,
        /// The text.
        text: String,
        /// What the tokenizer said.
        message: String,
    },
    /// The operation needs a Hugging Face tokenizer but the token space is synthetic.
    #[error("{0} needs a Hugging Face tokenizer, but the token space is synthetic")]
    NeedsTokenizer(&'static str),
}

impl TaskError {
    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        TaskError::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Result alias for this module.
pub type TaskResult<T> = std::result::Result<T, TaskError>;

/// The period `P` that defines phase groups `r = t mod P` (the stride, twice the
/// stride, 24, ...). Always at least 1; deserialises from a plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Period(NonZeroU32);

impl Period {
    /// A period; `0` is an error naming the field `period`.
    pub fn new(period: u32) -> TaskResult<Self> {
        if period > Self::MAX {
            // Matched designs need 2 P^2 logical examples, each rendered at P phases.
            return Err(TaskError::config(
                "period",
                format!(
                    "{period} is more than {} (matched designs need 2 P^2 examples per group)",
                    Self::MAX
                ),
            ));
        }
        NonZeroU32::new(period)
            .map(Period)
            .ok_or_else(|| TaskError::config("period", "must be at least 1 (got 0)"))
    }

    /// The largest period accepted.
    pub const MAX: u32 = 1 << 16;

    /// The period as an integer.
    pub fn get(self) -> u32 {
        self.0.get()
    }

    /// The period as a `usize` (for position arithmetic).
    pub fn len(self) -> usize {
        self.0.get() as usize
    }

    /// Never true; present for clippy's `len_without_is_empty`.
    pub fn is_empty(self) -> bool {
        false
    }

    /// Phase of absolute position `pos`: `pos mod P`.
    pub fn phase_of(self, pos: usize) -> Phase {
        Phase::of(pos, self)
    }
}

impl TryFrom<u32> for Period {
    type Error = TaskError;
    fn try_from(value: u32) -> TaskResult<Self> {
        Period::new(value)
    }
}

impl From<Period> for u32 {
    fn from(p: Period) -> u32 {
        p.get()
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// Phase of a position: its residue `t mod P` together with the period `P`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Phase {
    residue: u32,
    period: u32,
}

impl Phase {
    /// The phase of absolute position `pos` under `period`.
    pub fn of(pos: usize, period: Period) -> Self {
        Phase {
            residue: (pos % period.len()) as u32,
            period: period.get(),
        }
    }

    /// `t mod P`, in `0..P`.
    pub fn residue(self) -> u32 {
        self.residue
    }

    /// `P`.
    pub fn period(self) -> u32 {
        self.period
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} mod {}", self.residue, self.period)
    }
}

/// How an evaluation set moves the target key between phase groups
/// (shared/brief/PAPER.md, "Controlled models").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// `s` pad tokens before the prompt shift every position by `s`; `P-1-s` pad
    /// tokens after the last answer keep the length constant.
    #[default]
    PrefixPadding,
    /// `s` pad tokens right before the target binding and `P-1-s` right after it:
    /// only the target binding moves; everything else keeps its position.
    InSequencePadding,
}

impl Protocol {
    /// Both protocols, in a fixed order.
    pub const ALL: [Protocol; 2] = [Protocol::PrefixPadding, Protocol::InSequencePadding];

    /// The snake_case name used in configs and tables.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::PrefixPadding => "prefix_padding",
            Protocol::InSequencePadding => "in_sequence_padding",
        }
    }

    /// Short name in the `protocol` column of the phase-accuracy and long tables
    /// (`prefix`, `in-sequence`).
    pub fn label(self) -> &'static str {
        match self {
            Protocol::PrefixPadding => "prefix",
            Protocol::InSequencePadding => "in-sequence",
        }
    }

    /// Metric-name suffix of the protocol (`_prefix`, `_in_sequence`).
    pub fn metric_suffix(self) -> &'static str {
        match self {
            Protocol::PrefixPadding => "_prefix",
            Protocol::InSequencePadding => "_in_sequence",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Protocol {
    type Err = TaskError;
    fn from_str(s: &str) -> TaskResult<Self> {
        match s {
            "prefix_padding" | "prefix" => Ok(Protocol::PrefixPadding),
            "in_sequence_padding" | "in_sequence" | "in-sequence" => {
                Ok(Protocol::InSequencePadding)
            }
            other => Err(TaskError::config(
                "protocol",
                format!(
                    "unknown protocol {other:?} (expected prefix_padding or in_sequence_padding)"
                ),
            )),
        }
    }
}
