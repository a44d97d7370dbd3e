//! A plain DeepSeek-V4 forward over a long prompt in blocks of positions.
//!
//! At DeepSeek-V4's width a token's activations are large beside its K/V: the `hc_mult`
//! residual streams (4 x 4,096 f32, 64 KiB), and in the attention the queries and the
//! per-head outputs (64 heads x 512 f32, 128 KiB each, with their normalised and rotated
//! copies). Held for every position at once they made a 16K-token forward peak at 4.0x
//! its stored weights + K/V (docs/performance.md).
//!
//! When no hook touches a forward and it keeps no state (`bench forward`, a prefill's
//! last-position logits, any forward without captures or interventions) and the prompt
//! is longer than one stream block ([`token_block`]), it runs **span by span**: a span of
//! positions (one expert group, [`expert_group`]: 4,096 positions at DeepSeek-V4's width)
//! goes through every layer before the next span starts, as a chunked prefill does. Each
//! attention layer keeps between spans only what later queries read
//! ([`super::span_cache::SpanCache`]: the last `window - 1` K = V heads, the closed
//! windows' entries and index keys, the pooler inputs of the open windows), so what a
//! forward holds beside its weights no longer grows with the prompt's length. Within a
//! span, each layer runs so:
//! - the streams are held in stream blocks of positions ([`token_block`]); a layer
//!   replaces them block by block, so the old and new streams are never both whole;
//! - per stream block, the attention's hyper-connection and `input_layernorm`; then what
//!   the keys and queries need per position (the K = V head, the compressor's and the
//!   indexer's pooler inputs, the low-rank query residual, the indexer's head weights);
//!   the keys' inputs join the layer's cache and the windows they close are pooled
//!   ([`super::attention::Attention::span_keys`]);
//! - per stream block again, the queries, attention and output projection in query
//!   sub-blocks ([`query_block`], [`super::attention::Attention::block_output`]), the
//!   stream update and the MoE's hyper-connection and norm; then the MoE over the span's
//!   positions at once (each routed expert's stored weights dequantised once per span it
//!   serves) and each block's second stream update.
//!
//! [`DeepseekV4Model::forward_logit_rows`] keeps only its rows of each span's last
//! streams; the other plain forwards keep every span's (they return every position).
//! Forwards with hooks, recording and suffix forwards run whole. Every value is computed
//! by the same operations as in the whole forward, over fewer rows at a time; matrix
//! products over a subset of rows may round differently in the last bits (tests compare
//! the logits within 1e-5 relative, and bit for bit across thread counts). Block sizes
//! depend on the model's shape (or [`TOKEN_BLOCK_ENV`], [`QUERY_BLOCK_ENV`],
//! [`EXPERT_BLOCK_ENV`]) alone, never on the threads.

use std::cell::Cell;
use std::ops::Range;

use burn::tensor::{Int, Tensor};

use super::attention::Tables;
use super::config::DeepseekV4Config;
use super::mhc::{self, Sublayer};
use super::model::{DecoderLayer, DeepseekV4Model};
use super::span_cache::{SpanCache, cached_per_token, owned};
use crate::error::{Error, Result};
use crate::hooks::HookRun;
use crate::model::kv_state::{Queries, TokenFlow};
use crate::model::layers::cat_dim1;
use crate::model::placement::{PerDevice, to};
use crate::model::profile;

/// Bytes of one block's residual streams (`hc_mult * d_model` f32 per position): the
/// streams are held in blocks of this size, and the hyper-connections and stream updates
/// run over one block at a time (each holds a few copies of its block).
pub const STREAM_BLOCK_BYTES: usize = 64 << 20;

/// Bytes of one span's MoE input (`d_model` f32 per position): a span (an expert group of
/// consecutive stream blocks) runs through every layer before the next, and its MoE
/// (router, routed and shared experts) runs over its positions at once. Each routed
/// expert's stored weights are dequantised once per span it serves, so longer spans cost
/// fewer dequantisations and more memory.
pub const EXPERT_BLOCK_BYTES: usize = 64 << 20;

/// Bytes of one attention block's queries (`n_heads * head_dim` f32 per position): a
/// stream block's queries are computed, attended and projected in sub-blocks of this
/// size, which hold their queries, their normalised and rotated copies and their
/// per-head outputs, about four times this.
pub const QUERY_BLOCK_BYTES: usize = 128 << 20;

/// The fewest positions per block (the products stay wide enough for the GEMM kernels).
pub const MIN_TOKEN_BLOCK: usize = 256;

/// The environment variable that sets the positions per stream block ([`token_block`];
/// a prompt no longer than one block runs whole).
pub const TOKEN_BLOCK_ENV: &str = "PHASELENS_TOKEN_BLOCK";

/// The environment variable that sets the query positions per attention sub-block
/// ([`query_block`]).
pub const QUERY_BLOCK_ENV: &str = "PHASELENS_QUERY_BLOCK";

/// The environment variable that sets the positions per span, the expert group
/// ([`expert_group`]).
pub const EXPERT_BLOCK_ENV: &str = "PHASELENS_EXPERT_BLOCK";

/// Block sizes in positions: stream block, query sub-block, span (expert group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub stream: usize,
    pub query: usize,
    pub experts: usize,
}

thread_local! {
    /// Set by [`with_token_blocks`].
    static TOKEN_BLOCK: Cell<Option<BlockSizes>> = const { Cell::new(None) };
    static BLOCKED_LAYERS: Cell<usize> = const { Cell::new(0) };
}

/// `bytes / per_token` positions, at least [`MIN_TOKEN_BLOCK`].
fn positions(bytes: usize, per_token: usize) -> usize {
    (bytes / (4 * per_token).max(1)).max(MIN_TOKEN_BLOCK)
}

/// Positions per stream block of a plain forward of a `c` model: [`STREAM_BLOCK_BYTES`]
/// of streams (1,024 at DeepSeek-V4's width), at least [`MIN_TOKEN_BLOCK`], unless
/// [`with_token_blocks`] set another on this thread or [`TOKEN_BLOCK_ENV`] another for
/// the process.
pub fn token_block(c: &DeepseekV4Config) -> usize {
    let set = TOKEN_BLOCK.with(|b| b.get()).map(|b| b.stream);
    set.or_else(|| positions_from_env(TOKEN_BLOCK_ENV))
        .unwrap_or_else(|| positions(STREAM_BLOCK_BYTES, c.hc_mult * c.hidden_size))
}

/// Query positions per attention sub-block of a stream block of `block` positions:
/// [`QUERY_BLOCK_BYTES`] of queries (1,024 at DeepSeek-V4's width), at least
/// [`MIN_TOKEN_BLOCK`], unless [`with_token_blocks`] set another on this thread or
/// [`QUERY_BLOCK_ENV`] another for the process; at most `block`.
pub fn query_block(c: &DeepseekV4Config, block: usize) -> usize {
    let set = TOKEN_BLOCK.with(|b| b.get()).map(|b| b.query);
    set.or_else(|| positions_from_env(QUERY_BLOCK_ENV))
        .unwrap_or_else(|| positions(QUERY_BLOCK_BYTES, c.num_attention_heads * c.head_dim))
        .min(block.max(1))
}

/// Stream blocks of `block` positions per span (expert group): [`EXPERT_BLOCK_BYTES`] of
/// MoE input (4,096 positions at DeepSeek-V4's width: 4 stream blocks), unless
/// [`with_token_blocks`] set another on this thread or [`EXPERT_BLOCK_ENV`] another for
/// the process; at least 1.
pub fn expert_group(c: &DeepseekV4Config, block: usize) -> usize {
    let set = TOKEN_BLOCK.with(|b| b.get()).map(|b| b.experts);
    let n = set
        .or_else(|| positions_from_env(EXPERT_BLOCK_ENV))
        .unwrap_or_else(|| positions(EXPERT_BLOCK_BYTES, c.hidden_size));
    (n / block.max(1)).max(1)
}

/// Run `f` with these block sizes on this thread (tests force many blocks on short
/// prompts).
pub fn with_token_blocks<T>(sizes: BlockSizes, f: impl FnOnce() -> T) -> T {
    let sizes = BlockSizes {
        stream: sizes.stream.max(1),
        query: sizes.query.max(1),
        experts: sizes.experts.max(1),
    };
    let old = TOKEN_BLOCK.with(|b| b.replace(Some(sizes)));
    let out = f();
    TOKEN_BLOCK.with(|b| b.set(old));
    out
}

/// Layers this thread ran in blocks of positions since the last call; resets it.
pub fn take_blocked_layers() -> usize {
    BLOCKED_LAYERS.with(|n| n.replace(0))
}

/// A positive number of positions from the environment variable `name`, if set.
fn positions_from_env(name: &str) -> Option<usize> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

impl DeepseekV4Model {
    /// Positions per block when this forward runs in blocks ([`token_block`]): a plain
    /// flow, no hook, more positions than one block; otherwise `None`.
    pub(super) fn blocks_of(&self, flow: &TokenFlow, hooks: &HookRun) -> Option<usize> {
        let block = token_block(&self.config);
        (flow.is_plain() && hooks.spec().is_empty() && flow.queries().len() > block)
            .then_some(block)
    }

    /// Positions per span of a long prompt's plain forward, and the f32 values per
    /// position it keeps for the whole forward: its layers' caches
    /// ([`super::span_cache::cached_per_token`]) and the RoPE tables (cos and sin, main and
    /// compress rotary, at every position): what
    /// [`crate::model::LanguageModel::prefill_span`] reports.
    pub(super) fn span_and_cache(&self) -> (usize, f64) {
        let c = &self.config;
        let block = token_block(c);
        let tables = (c.rope_main.rot_dims + c.rope_compress.rot_dims) as f64;
        (expert_group(c, block) * block, cached_per_token(c) + tables)
    }

    /// Layers `layers` of a plain forward over `b` prompts of `t` positions, span by
    /// span (see the module docs): `input(range)` gives the streams `[b, len, hc, d]`
    /// entering the first of them at those positions; `out(f, blocks)` takes the streams
    /// leaving the last at the positions of a span from `f`, in stream blocks.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_spans(
        &self,
        [b, t]: [usize; 2],
        layers: Range<usize>,
        block: usize,
        ids: &[i64],
        hooks: &mut HookRun,
        mut input: impl FnMut(Range<usize>) -> Result<Tensor<4>>,
        mut out: impl FnMut(usize, Vec<Tensor<4>>) -> Result<()>,
    ) -> Result<()> {
        let span = expert_group(&self.config, block) * block;
        let queries = Queries::All { rows: b, len: t };
        let mut per_device = PerDevice::new();
        let mut caches: Vec<SpanCache> = layers.clone().map(|_| SpanCache::default()).collect();
        for s0 in (0..t).step_by(span) {
            let s1 = (s0 + span).min(t);
            let x = input(s0..s1)?;
            let mut x: Vec<Tensor<4>> = (0..s1 - s0)
                .step_by(block)
                .map(|f| x.clone().slice_dim(1, f..(f + block).min(s1 - s0)))
                .collect();
            let run = self.model.layers.iter().enumerate().skip(layers.start);
            for ((l, layer), cache) in run.take(layers.len()).zip(&mut caches) {
                if s0 == 0 {
                    BLOCKED_LAYERS.with(|n| n.set(n.get() + 1));
                }
                let here = layer.input_layernorm.weight.val().device();
                let tables = per_device.get(&here, |d| Tables::new(&self.config, &queries, d));
                let span = Span {
                    f: s0,
                    t,
                    ids,
                    cache,
                };
                x = self.layer_span((l, layer), x, span, tables, hooks)?;
            }
            out(s0, x)?;
        }
        Ok(())
    }

    /// The logits `[rows, vocab]` at the flat positions `rows` (indices into `[b * t]`)
    /// of a plain forward in spans of `tokens` `[b, t]`: each span's last streams are
    /// dropped once the wanted rows among them are copied out, so no tensor over every
    /// position is held.
    pub(super) fn logit_rows_in_spans(
        &self,
        tokens: Tensor<2, Int>,
        ids: &[i64],
        rows: Tensor<1, Int>,
        block: usize,
        hooks: &mut HookRun,
    ) -> Result<Tensor<2>> {
        let [b, t] = tokens.dims();
        let wanted = flat_rows(rows, b * t)?;
        if wanted.is_empty() {
            return Err(Error::Input("no logit rows asked for".into()));
        }
        let mut picked: Vec<Option<Tensor<4>>> = vec![None; wanted.len()];
        let n = self.model.layers.len();
        let embed = &self.model.embed_tokens;
        let input = |r: Range<usize>| {
            Ok(self.expand_streams(embed.forward(tokens.clone().slice([0..b, r]))))
        };
        self.run_spans([b, t], 0..n, block, ids, hooks, input, |f, blocks| {
            let mut f = f;
            for x in blocks {
                let len = x.dims()[1];
                for (i, &w) in wanted.iter().enumerate() {
                    let (row, pos) = (w / t, w % t);
                    if (f..f + len).contains(&pos) {
                        let one = x.clone().slice_dim(0, row..row + 1);
                        picked[i] = Some(owned(one.slice_dim(1, pos - f..pos - f + 1)));
                    }
                }
                f += len;
            }
            Ok(())
        })?;
        let picked: Vec<Tensor<4>> = picked
            .into_iter()
            .map(|p| p.expect("every row lies in a span"))
            .collect();
        let logits = self.head_logits(Tensor::cat(picked, 1), hooks)?;
        let v = logits.dims()[2];
        Ok(logits.reshape([wanted.len(), v]))
    }

    /// Layer `l` over one span's streams `x` in stream blocks (see the module docs) ->
    /// the streams leaving it, in the same blocks.
    fn layer_span(
        &self,
        (l, layer): (usize, &DecoderLayer),
        x: Vec<Tensor<4>>,
        span: Span,
        tables: &Tables,
        hooks: &mut HookRun,
    ) -> Result<Vec<Tensor<4>>> {
        let here = layer.input_layernorm.weight.val().device();
        let x: Vec<Tensor<4>> = x.into_iter().map(|x| to(x, &here)).collect();
        let attn = &layer.self_attn;
        let mut weights = Vec::with_capacity(x.len());
        let (mut keys, mut queries) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len()));
        let mut f = span.f;
        for xb in &x {
            let mhc = profile::region(profile::Region::Mhc);
            let hc = layer.attn_hc.forward(l, Sublayer::Attention, xb, hooks)?;
            drop(mhc);
            // The normalised input lives for this block only: the keys' and the queries'
            // inputs are a few percent of it.
            let normed = layer.input_layernorm.forward(hc.collapsed);
            keys.push(attn.key_inputs(f, &normed, tables));
            queries.push(attn.query_inputs(&normed));
            weights.push((hc.post, hc.comb));
            f += xb.dims()[1];
        }
        let keys = attn.span_keys(keys, span.f, span.cache, tables);
        let sub = query_block(&self.config, x[0].dims()[1]);
        let (b, t) = (x[0].dims()[0], span.t);
        let mut f = span.f;
        let (mut streams, mut hcs, mut ys) = (Vec::new(), Vec::new(), Vec::new());
        for ((xb, (post, comb)), at) in x.into_iter().zip(weights).zip(queries) {
            let a = attn.block_output(l, f, &at, &keys, tables, hooks, sub)?;
            drop(at);
            f += xb.dims()[1];
            let mhc = profile::region(profile::Region::Mhc);
            let xb = mhc::mix_streams(xb, a, post, comb);
            let hc = layer.ffn_hc.forward(l, Sublayer::Mlp, &xb, hooks)?;
            drop(mhc);
            let _experts = profile::region(profile::Region::Experts);
            ys.push(layer.post_attention_layernorm.forward(hc.collapsed));
            streams.push(xb);
            hcs.push((hc.post, hc.comb));
        }
        drop(keys);
        // The MoE over the span's positions at once: each routed expert's stored weights
        // are dequantised once per span it serves.
        let span_ids: Vec<i64> = (0..b)
            .flat_map(|r| span.ids[r * t + span.f..r * t + f].iter().copied())
            .collect();
        let experts = profile::region(profile::Region::Experts);
        let m = layer.mlp.forward(l, cat_dim1(ys), &span_ids, hooks)?;
        drop(experts);
        let _mhc = profile::region(profile::Region::Mhc);
        let mut at = 0;
        let mut out = Vec::with_capacity(streams.len());
        for (xb, (post, comb)) in streams.into_iter().zip(hcs) {
            let n = xb.dims()[1];
            let mb = m.clone().slice_dim(1, at..at + n);
            at += n;
            out.push(mhc::mix_streams(xb, mb, post, comb));
        }
        Ok(out)
    }
}

/// Where one span lies: its first position `f` in prompts of `t` positions, the token
/// ids of every prompt (hash routing), and the layer's cache of the positions before it.
struct Span<'a> {
    f: usize,
    t: usize,
    ids: &'a [i64],
    cache: &'a mut SpanCache,
}

/// The flat row indices in `rows`, each checked to lie in `0..n`.
fn flat_rows(rows: Tensor<1, Int>, n: usize) -> Result<Vec<usize>> {
    let wanted: Vec<i64> = rows
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|e| Error::Other(format!("logit rows: {e:?}")))?;
    wanted
        .into_iter()
        .map(|r| {
            usize::try_from(r)
                .ok()
                .filter(|&r| r < n)
                .ok_or_else(|| Error::Input(format!("logit row {r} out of range 0..{n}")))
        })
        .collect()
}
