//! The paper's controlled family of chunk-compressed transformers ("kvc"), with full
//! attention as the baseline in the same code path.
//!
//! Decoder-only, pre-norm (RMSNorm), SwiGLU MLP, `n_heads` query heads grouped over
//! `n_kv_heads`. A query at position t attends, in ONE joint softmax, over
//! (a) the compressed entries of every window that has closed by t,
//! (b) an optional uncompressed local tail of the last `local_tail` raw tokens, and
//! (c) an optional learned attention sink.
//!
//! Compression: window `W`, stride `S` (W >= S; W > S overlaps). Entry i pools tokens
//! `i*S .. i*S+W` and becomes visible to query t once its window has closed,
//! `i*S + W - 1 <= t`. Pooling is softmax-gated per KV head with separate key and value
//! gates (`scalar`: one weight per token and KV head; `vector`: per channel; `uniform`:
//! the mean), plus an optional learned per-offset gate bias. Compressed keys are rotated
//! at their window's first position `i*S`.
//!
//! | file | what |
//! |---|---|
//! | `config.rs` | config.json: geometry, operator, options, validation |
//! | `compressor.rs` | gated pooling of windows into entries |
//! | `attention.rs` | one attention layer (projections, key shift, RoPE, the shared core) |
//! | `model.rs` | the decoder and its `LanguageModel` implementation |

mod attention;
mod compressor;
mod config;
mod model;

pub use attention::Attention;
pub use compressor::{Compressor, CompressorStack};
pub use config::{
    ArchOptions, AttentionKind, CompressionConfig, GateMode, KvcConfig, LayerType, Llama3Rope,
    MODEL_TYPE, MlpAct, RopeMode,
};
pub use model::{Block, KvcModel};
