//! phaselens: mechanistic interpretability of phase sensitivity in chunk-compressed
//! KV-cache language models.
//!
//! Data flows one way: config -> model + task -> runner (hooks, interventions) ->
//! tables -> figures/report.
//!
//! The library face: [`prelude`] (one import for loading a model, running it with hooks
//! and reading the cache), [`model`], [`hooks`], [`device`], [`tasks`] (phase-controlled
//! prompts), [`tokenizer`] (text <-> token ids of pretrained models, equal to
//! transformers'), [`analysis`] (intervals, bootstraps, effects), [`output`] (tables and their
//! schemas), [`audit`] (certify a checkpoint's phase sensitivity), [`grid`] (the
//! mitigation frontier over designs and seeds), [`train`] (organism recipes and
//! training) and [`error`]. Runnable examples: `examples/` (docs/library.md).
#![warn(missing_docs)]

// The library face (`cargo doc` shows these; every public item has a doc comment,
// checked by `missing_docs` above; docs/library.md lists them).
pub mod analysis;
pub mod audit;
pub mod device;
pub mod error;
pub mod grid;
pub mod hooks;
pub mod model;
pub mod output;
pub mod tasks;
pub mod tokenizer;
pub mod train;

// Behind the command line: public for the `phaselens` binary (src/cli) and the
// integration tests (tests/it), not part of the face.
#[doc(hidden)] // the backend equivalence matrix behind `phaselens backends`
pub mod backends;
#[doc(hidden)] // `phaselens run`: experiment TOMLs, kinds, the batched patching routine
pub mod runner;
#[doc(hidden)] // TOML loading with file:line:key errors, for the CLI's config files
pub mod toml_file;
#[doc(hidden)] // `phaselens view`: the static explorer
pub mod view;

pub use error::{Error, Result};

/// burn, at the exact version phaselens is built with: tensors in and out of
/// [`LanguageModel::forward`](crate::model::LanguageModel::forward) are
/// `phaselens::burn::tensor::Tensor`s, so a dependent crate needs no burn of its own.
pub use burn;

/// What most programs need, in one import: `use phaselens::prelude::*;`
///
/// ```no_run
/// use phaselens::prelude::*;
/// # fn main() -> phaselens::Result<()> {
/// let device = DeviceSpec::Cpu.device()?;
/// let model = load_model(std::path::Path::new("experiments/organisms/kvc-w8s8"), &device)?;
/// let tokens = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4], [1, 4]), &device);
/// let spec = HookSpec::new()
///     .capture("blocks.*.attn.hook_z")?                                    // globs
///     .intervene("blocks.1.attn.hook_z", Action::Zero, Scope::heads([3]))?;  // ablate head 3
/// let out = model.forward(tokens, &spec)?;          // logits + ActivationCache
/// let z = out.cache.get_name("blocks.0.attn.hook_z")?;
/// assert_eq!(z.shape().len(), 4);                   // [batch, pos, head, d_head]
/// # Ok(())
/// # }
/// ```
pub mod prelude {
    pub use crate::device::DeviceSpec;
    pub use crate::error::{Error, Result};
    pub use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, RowScope, Scope};
    pub use crate::model::{ForwardOutput, LanguageModel, LayerKind, ModelInfo, load_model};
    pub use burn::tensor::{Int, Tensor, TensorData};
}
