//! One hook mechanism for every model: TransformerLens-style hook points, a
//! [`HookSpec`] of captures and interventions, and the [`ActivationCache`] a forward
//! pass returns.
//!
//! ```
//! use phaselens::hooks::{HookSpec, Action, Scope};
//! // capture every head's output, zero-ablate head 3 of block 1
//! let spec = HookSpec::new()
//!     .capture("blocks.*.attn.hook_z").unwrap()
//!     .intervene("blocks.1.attn.hook_z", Action::Zero, Scope::heads([3])).unwrap();
//! assert!(!spec.is_empty());
//! ```

pub(crate) mod cache;
pub(crate) mod point;
pub(crate) mod spec;

pub use cache::{Act, ActivationCache};
pub use point::{HeadKind, HookPoint, PointPattern, PosCounts, Site, SiteInfo, markdown_table};
pub use spec::{Action, HookRun, HookSpec, Intervention, RowScope, Scope};
