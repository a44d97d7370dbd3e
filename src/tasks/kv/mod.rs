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
//!
//! | file | role |
//! |---|---|
//! | [`prompt`] | the prompt format ([`KvPromptConfig`]), a rendered prompt ([`KvExample`]); sampling and rendering one prompt (shared by evaluation, training and the haystack) |
//! | [`eval`] | phase-matched evaluation sets: the balanced design of target positions, both padding protocols |
//! | [`train`] | the training sampler: random bindings and pads, the curriculum, labels |

mod eval;
mod prompt;
mod train;

pub use eval::{KvEvalConfig, KvEvalSet, generate_eval_set, matched_block_size};
pub use prompt::{Binding, KvExample, KvPromptConfig, KvQuery, QueryMarker, QuerySampling};
pub(crate) use prompt::{Pads, Rendering, render, rng_for, sample_content, sample_tuples};
pub use train::{Curriculum, IGNORE_INDEX, KvTrainConfig, KvTrainSampler, TrainBatch};
