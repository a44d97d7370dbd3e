//! Text retrieval with a real tokenizer, phase-controlled in tokens: the **passkey**
//! task ("The pass key is 71432. Remember it." inside varied filler, asked for at the
//! end) and the **natural-text needle** (a fact sentence, "The secret ingredient of
//! the soup is saffron.", asked about at the end).
//!
//! Layout of one prompt of `length` tokens (`P` = period, `s` = the phase shift):
//!
//! ```text
//! prefix padding:       BOS? [s pads] INTRO F[..b]     NEEDLE F[b..]     QUERY VALUE [P-1-s pads]
//! in-sequence padding:  BOS?          INTRO F[..b+s]   NEEDLE F[b+s..]   QUERY VALUE
//! ```
//!
//! `F` is a stream of filler sentences drawn from [`FILLER_SENTENCES`] (ChaCha8
//! seeded with the config's seed and the logical example), each tokenized on its own
//! with a leading space; the stream has exactly `length - fixed` tokens, where `fixed`
//! counts BOS, the intro, the needle, the query with its value and (prefix padding)
//! the `P - 1` pads. `b` is a sentence boundary of the stream at the drawn depth. The
//! phase of a prompt is the position of the needle's first value token mod `P`; `s`
//! is `(r - B) mod P` for the unshifted position `B`, so every logical example is
//! rendered once at every phase `r` and every prompt has exactly `length` tokens.
//! Under in-sequence padding the needle moves `s` whole filler tokens into the
//! stream (everything else keeps its position). The query is scored by teacher
//! forcing: the logits before each value token must predict it.
//! The full specification: `docs/prompt_format.md`, section "Passkey and needle".

mod corrupt;
mod facts;
mod generate;
mod pool;

use std::ops::Range;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::{Period, Phase, Protocol, TaskError, TaskResult};

pub use corrupt::{TextCorruption, corrupt_text_example};
pub use facts::{
    Fact, NEEDLE_INTRO, PASSKEY_INTRO, PASSKEY_QUESTION, PASSKEY_SENTENCE, VALUE_SLOT,
    builtin_facts,
};
pub use generate::generate_text_needle_set;
pub use pool::FILLER_SENTENCES;

/// Which text task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextTask {
    /// "The pass key is 71432. Remember it." -> the digits.
    #[default]
    Passkey,
    /// A fact sentence -> a word from the fact's value list.
    Needle,
}

impl TextTask {
    /// The name in configs (`passkey`, `needle`).
    pub fn name(self) -> &'static str {
        match self {
            TextTask::Passkey => "passkey",
            TextTask::Needle => "needle",
        }
    }
}

/// Longest text prompt the generator builds (tokens).
pub const MAX_TEXT_LEN: usize = 1 << 20;

/// A phase-controlled passkey or needle evaluation set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TextNeedleConfig {
    /// Passkey or needle. Default passkey.
    pub task: TextTask,
    /// Prompt length in tokens, pads included. Default 512.
    pub length: usize,
    /// Needle depth range, fractions of the filler stream in `0..=1`: the needle
    /// starts at a sentence boundary in this range. Default `[0.1, 0.9]`.
    pub depth: [f64; 2],
    /// Digits of the pass key (the first is never 0). Default 5.
    pub digits: usize,
    /// The needle's facts (one drawn per logical example). Default [`builtin_facts`].
    pub facts: Vec<Fact>,
    /// Period P; the phase is the needle's first value token's position mod P. Default 8.
    pub period: Period,
    /// Padding protocol. Default `prefix_padding`.
    pub protocol: Protocol,
    /// Logical examples; each is rendered at every phase. A multiple of P matches the
    /// groups' mean value position exactly. Default 64.
    pub n_logical: usize,
    /// Seed. Default 0.
    pub seed: u64,
}

impl Default for TextNeedleConfig {
    fn default() -> Self {
        TextNeedleConfig {
            task: TextTask::Passkey,
            length: 512,
            depth: [0.1, 0.9],
            digits: 5,
            facts: builtin_facts(),
            period: Period::new(8).expect("nonzero"),
            protocol: Protocol::PrefixPadding,
            n_logical: 64,
            seed: 0,
        }
    }
}

/// The special tokens a text prompt uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextTokens {
    /// The pad token (prefix padding).
    pub pad: u32,
    /// BOS, first token of every prompt, if the model uses one.
    pub bos: Option<u32>,
}

/// One rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextNeedleExample {
    /// The logical example (shared by its renderings at every phase).
    pub logical_id: u64,
    /// The protocol it was rendered under.
    pub protocol: Protocol,
    /// The shift `s` (pads before the prompt, or filler tokens moved before the needle).
    pub shift: usize,
    /// The prompt, the answer included (teacher forcing).
    pub tokens: Vec<u32>,
    /// The value as text (`"71432"`, `"saffron"`).
    pub value: String,
    /// The needle sentence as text.
    pub needle_text: String,
    /// Token range of the needle sentence.
    pub needle_span: (usize, usize),
    /// Token range of the needle's value tokens; its start sets the phase.
    pub value_span: (usize, usize),
    /// Token range of the filler stream (the needle inside it).
    pub filler_span: (usize, usize),
    /// The phase of `value_span.0`.
    pub phase: Phase,
    /// Positions whose logits must predict `answers` (the query's value, teacher forced).
    pub target_positions: Vec<usize>,
    /// The value's tokens in the query.
    pub answers: Vec<u32>,
    /// First tokens of the wrong values (every other value of the pass key's first
    /// digit or the fact's list, deduplicated, never `answers[0]`): the logit
    /// difference is `answers[0]` against the best of them.
    pub wrong_first: Vec<u32>,
}

/// How far a batch of `examples` is read: one past the last target position of any
/// (1 for none). Scoring and patching cut the prompts there: the tokens after it
/// affect no logit that is read.
pub fn text_cut_len<'a>(examples: impl IntoIterator<Item = &'a TextNeedleExample>) -> usize {
    examples
        .into_iter()
        .map(|e| e.target_positions.last().map_or(1, |p| p + 1))
        .max()
        .unwrap_or(1)
}

/// A phase-controlled text set: every logical example rendered once per phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextNeedleSet {
    /// The config it was generated from.
    pub config: TextNeedleConfig,
    /// Length of every prompt.
    pub prompt_len: usize,
    /// Logical-major: `examples[i * P + r]` is logical example `i` at phase `r`.
    pub examples: Vec<TextNeedleExample>,
}

impl TextNeedleSet {
    /// The phase group `r`: one example per logical example.
    pub fn group(&self, r: u32) -> impl Iterator<Item = &TextNeedleExample> + '_ {
        let p = self.config.period.len();
        self.examples.iter().skip(r as usize).step_by(p)
    }

    /// Logical example `logical` at phase `r`.
    pub fn example(&self, logical: usize, r: u32) -> &TextNeedleExample {
        &self.examples[logical * self.config.period.len() + r as usize]
    }
}

/// A piece of text as tokens, with the token range of its value (empty without one).
#[derive(Debug, Clone)]
struct Encoded {
    ids: Vec<u32>,
    value: Range<usize>,
}

fn encode(tok: &Tokenizer, what: &str, text: &str) -> TaskResult<tokenizers::Encoding> {
    tok.encode_char_offsets(text, false)
        .map_err(|e| TaskError::Tokenize {
            what: what.to_string(),
            text: text.to_string(),
            message: e.to_string(),
        })
}

/// Tokenize `before + value + after`; the value's tokens are those whose character
/// offsets overlap it.
fn encode_with_value(
    tok: &Tokenizer,
    what: &str,
    before: &str,
    value: &str,
    after: &str,
) -> TaskResult<Encoded> {
    let text = format!("{before}{value}{after}");
    let enc = encode(tok, what, &text)?;
    let (vs, ve) = (
        before.chars().count(),
        before.chars().count() + value.chars().count(),
    );
    let offsets = enc.get_offsets();
    let inside: Vec<usize> = (0..offsets.len())
        .filter(|&i| offsets[i].0 < ve && offsets[i].1 > vs)
        .collect();
    let (Some(&a), Some(&b)) = (inside.first(), inside.last()) else {
        return Err(TaskError::config(
            what,
            format!("the value {value:?} encodes to no token in {text:?}"),
        ));
    };
    Ok(Encoded {
        ids: enc.get_ids().to_vec(),
        value: a..b + 1,
    })
}

/// Split a template at its one `{value}` slot.
fn split_slot<'a>(field: &str, template: &'a str) -> TaskResult<(&'a str, &'a str)> {
    let Some((before, after)) = template.split_once(VALUE_SLOT) else {
        return Err(TaskError::config(
            field,
            format!("{template:?} must contain {VALUE_SLOT} once"),
        ));
    };
    if after.contains(VALUE_SLOT) {
        return Err(TaskError::config(
            field,
            format!("{template:?} contains {VALUE_SLOT} more than once"),
        ));
    }
    Ok((before, after))
}
