//! DeepSeek-V4 attention: low-rank queries (`q_a -> RMSNorm -> q_b`, then an unweighted
//! per-head RMSNorm), one shared K = V head (`kv_proj -> kv_norm`), partial interleaved
//! RoPE on the last `rot_dims` channels, a raw sliding window of `sliding_window` tokens,
//! compressed entries (CSA / HCA, see [`super::compressor`]) and a per-head sink in one
//! joint softmax, the inverse rotation of the output's rope slice, and the grouped
//! low-rank output projection (`o_a` per group of heads, then `o_b`).
//!
//! Key slots, as in `hook_pattern`: `[compressed entries (n) ; raw tokens (t) ; sink]`.
//! Raw token j is visible to query t iff `t - W < j <= t`; compressed entry w iff its
//! window has closed, `w < (t + 1) / rate`, and (CSA) the indexer selected it. The
//! attention itself is the shared blocked core ([`crate::model::attention`]); per-token
//! state (keys, compressor and indexer projections) goes through
//! `crate::model::kv_state::TokenFlow`, so plain, recording and suffix forwards are
//! one code path.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::compressor::Compressor;
use super::config::{AttnType, DeepseekV4Config};
use super::indexer::{IndexQueries, IndexSelector, Indexer};
use super::rope;
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::{Entries, EntrySelector, Keys, Raw, attend, reads_every_key};
use crate::model::flops::Mm;
use crate::model::kv_state::{Queries, TokenFlow};
use crate::model::layers::{Linear, RmsNorm, RopeTables, cat_dim1, rms_normalize};

/// One attention layer (`self_attn`).
#[derive(Module, Debug)]
pub struct Attention {
    pub q_a_proj: Linear,
    pub q_a_norm: RmsNorm,
    pub q_b_proj: Linear,
    pub kv_proj: Linear,
    pub kv_norm: RmsNorm,
    /// `[o_groups * o_lora_rank, n_heads * head_dim / o_groups]`
    pub o_a_proj: Linear,
    /// `[d_model, o_groups * o_lora_rank]`
    pub o_b_proj: Linear,
    /// `[n_heads]`
    pub sinks: Param<Tensor<1>>,
    pub compressor: Option<Compressor>,
    #[module(skip)]
    pub kind: AttnType,
    #[module(skip)]
    pub n_heads: usize,
    #[module(skip)]
    pub head_dim: usize,
    #[module(skip)]
    pub o_groups: usize,
    #[module(skip)]
    pub eps: f64,
}

/// What one block of positions contributes to the keys of a plain forward in blocks
/// ([`Attention::key_inputs`]).
pub struct KeyInputs {
    /// The K = V head `[b, bq, 1, head_dim]`, rotated.
    pub(super) k: Tensor<4>,
    /// The compressor's pooler inputs (`kv`, `gate`), per token.
    pub(super) comp: Option<(Tensor<3>, Tensor<3>)>,
    /// The CSA indexer's pooler inputs.
    pub(super) index: Option<(Tensor<3>, Tensor<3>)>,
}

/// What one block's queries are computed from in a plain forward in blocks
/// ([`Attention::query_inputs`]).
pub struct QueryInputs {
    /// `[b, bq, q_lora_rank]`
    q_res: Tensor<3>,
    /// The CSA indexer's head weights `[b, bq, index_n_heads]`.
    heads: Option<Tensor<3>>,
}

/// What the query blocks of one span of a plain forward in spans read
/// ([`Attention::span_keys`]).
pub struct BlockKeys {
    /// The K = V head `[b, total - start, 1, head_dim]`, rotated, at the positions
    /// `start..total`.
    pub(super) k: Tensor<4>,
    /// The position of `k`'s first row (the span's first less `window - 1`, or 0).
    pub(super) start: usize,
    /// The compressed entries of the windows closed by `total`.
    pub(super) entries: Option<Entries>,
    /// The CSA indexer's pooled keys `[b, n, 1, index_head_dim]`.
    pub(super) index: Option<Tensor<4>>,
    /// Positions up to the span's end.
    pub(super) total: usize,
}

/// What every layer of one forward shares: RoPE tables (main and compress rotary) at the
/// computed positions (per-token keys are rotated at their own position before they join
/// the state), the sliding window, and per compression rate the number of entries and
/// the tables at their window starts.
pub struct Tables {
    pub main: RopeTables,
    pub compress: RopeTables,
    pub window: usize,
    /// HCA: `(entries, tables at w * rate)`.
    pub hca: Option<(usize, RopeTables)>,
    /// CSA: `(entries, tables at w * rate)`.
    pub csa: Option<(usize, RopeTables)>,
}

impl Tables {
    /// For a forward computing `queries` of a `c` model.
    pub fn new(c: &DeepseekV4Config, queries: &Queries, device: &Device) -> Self {
        let total = queries.total();
        let pos = queries.positions();
        let starts = |kind: AttnType, rate: usize| {
            c.layer_types.contains(&kind).then(|| {
                let n = total / rate;
                let p: Vec<usize> = (0..n).map(|i| i * rate).collect();
                (n, rope::tables(&c.rope_compress, &p, device))
            })
        };
        Tables {
            main: rope::tables(&c.rope_main, &pos, device),
            compress: rope::tables(&c.rope_compress, &pos, device),
            window: c.sliding_window,
            hca: starts(AttnType::Hca, c.hca_rate),
            csa: starts(AttnType::Csa, c.csa_rate),
        }
    }
}

impl Attention {
    /// `x: [b, t, d_model]` (after `input_layernorm`) at the positions `flow` computes
    /// -> `[b, t, d_model]`.
    pub fn forward(
        &self,
        layer: usize,
        x: Tensor<3>,
        tables: &Tables,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let q_tables = self.q_tables(tables);
        let (q, q_res) = self.queries(layer, &x, q_tables, hooks)?;
        // The indexer's hook points see every query and entry at once: one dense block.
        let scores_hooked = hooks.touches(&HookPoint::block(layer, Site::IndexerScores))
            || hooks.touches(&HookPoint::block(layer, Site::IndexerSelected));
        let pattern = HookPoint::block(layer, Site::AttnPattern);
        // A suffix forward's blocked attention reads raw keys from its first query's
        // window on only; a dense block (a hooked pattern) reads every position.
        let raw_from = match flow.first_recomputed() {
            Some(f) if !reads_every_key(pattern, scores_hooked, hooks) => {
                f.saturating_sub(tables.window.saturating_sub(1))
            }
            _ => 0,
        };
        let (k, v) = self.keys(layer, &x, q_tables, flow, hooks, raw_from)?;
        let entries = self.entries(layer, &x, tables, flow, hooks)?;
        let mut selector = match (&entries, &self.compressor) {
            (
                Some(_),
                Some(Compressor {
                    indexer: Some(idx), ..
                }),
            ) => {
                let keys = self.index_keys(idx, layer, &x, tables, flow)?;
                let at = IndexQueries {
                    heads: &idx.head_weights(&x.clone().detach()),
                    q_res: &q_res,
                    tables: &tables.compress,
                    queries: flow.queries(),
                };
                Some(Self::selector(idx, layer, keys, at)?)
            }
            _ => None,
        };
        let keys = Keys {
            entries,
            selector: selector.as_mut().map(|s| s as &mut dyn EntrySelector),
            raw: Some(Raw {
                k,
                v,
                window: Some(tables.window),
                start: raw_from,
            }),
            sink: Some(self.sinks.val()),
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let z = attend(
            q,
            flow.queries(),
            keys,
            scale,
            pattern,
            scores_hooked,
            hooks,
        )?;
        if let Some(s) = selector {
            s.finish(hooks);
        }
        let z = rope::rotate(z, q_tables, true);
        let z = hooks.apply(HookPoint::block(layer, Site::AttnZ), z)?;
        self.output(layer, z, hooks)
    }

    /// Only the attention's inputs from `x` (after `input_layernorm`) that the hooks
    /// touch: the queries through `hook_q`, the K = V head through `hook_k` / `hook_v`,
    /// the compressed entries through `hook_compressed_k` / `_v`; neither the indexer
    /// nor the attention runs. Edge attribution's local pass.
    pub fn read_inputs(
        &self,
        layer: usize,
        x: Tensor<3>,
        tables: &Tables,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<()> {
        let q_tables = self.q_tables(tables);
        let at = |s: Site| hooks.touches(&HookPoint::block(layer, s));
        let (q, kv, entries) = (
            at(Site::AttnQ),
            at(Site::AttnK) || at(Site::AttnV),
            at(Site::CompressedK) || at(Site::CompressedV),
        );
        if q {
            self.queries(layer, &x, q_tables, hooks)?;
        }
        if kv {
            self.keys(layer, &x, q_tables, flow, hooks, 0)?;
        }
        if entries {
            self.entries(layer, &x, tables, flow, hooks)?;
        }
        Ok(())
    }

    /// The queries `[b, t, n_heads, head_dim]` (low-rank, per-head normalised, hooked
    /// at `attn_q`, then rotated) and the normalised low-rank residual `q_res` the CSA
    /// indexer reads.
    fn queries(
        &self,
        layer: usize,
        x: &Tensor<3>,
        q_tables: &RopeTables,
        hooks: &mut HookRun,
    ) -> Result<(Tensor<4>, Tensor<3>)> {
        let q_res = self.q_a_norm.forward(self.q_a_proj.forward(x.clone()));
        Ok((self.queries_from(layer, &q_res, q_tables, hooks)?, q_res))
    }

    /// The queries `[b, t, n_heads, head_dim]` from the query residual `q_res: [b, t,
    /// q_lora_rank]` ([`Attention::queries`]).
    fn queries_from(
        &self,
        layer: usize,
        q_res: &Tensor<3>,
        q_tables: &RopeTables,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        let [b, t, _] = q_res.dims();
        let q = self
            .q_b_proj
            .forward(q_res.clone())
            .reshape([b, t, self.n_heads, self.head_dim]);
        let q = rms_normalize(q, self.eps);
        let q = hooks.apply(HookPoint::block(layer, Site::AttnQ), q)?;
        Ok(rope::rotate(q, q_tables, false))
    }

    /// The shared K = V head of the positions `from..` (0: every position) of what
    /// `flow` holds: hooked at `attn_k` / `attn_v`, rotated at their own positions before
    /// they join the state.
    fn keys(
        &self,
        layer: usize,
        x: &Tensor<3>,
        q_tables: &RopeTables,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
        from: usize,
    ) -> Result<(Tensor<4>, Tensor<4>)> {
        let kv = self.kv_head(x);
        let (kp, vp) = (
            HookPoint::block(layer, Site::AttnK),
            HookPoint::block(layer, Site::AttnV),
        );
        let (k, v) = if hooks.touches(&kp) || hooks.touches(&vp) {
            let k = hooks.apply(kp, kv.clone())?;
            let v = hooks.apply(vp, kv)?;
            (
                rope::rotate(k, q_tables, false),
                rope::rotate(v, q_tables, false),
            )
        } else {
            let kv = rope::rotate(kv, q_tables, false);
            (kv.clone(), kv)
        };
        Ok((
            flow.full_from(layer, "k", k, from)?,
            flow.full_from(layer, "v", v, from)?,
        ))
    }

    /// The compressed entries of a CSA / HCA layer (pooled from the per-token
    /// projections of every position), or `None` (sliding layer, no closed window).
    fn entries(
        &self,
        layer: usize,
        x: &Tensor<3>,
        tables: &Tables,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Option<Entries>> {
        let Some((comp, starts)) = self.compressed(tables) else {
            return Ok(None);
        };
        let (kv, gate) = comp.pooler.project(x);
        if !Compressor::hooked(layer, hooks) {
            // K = V, pooled once (and, in a suffix forward, only where it changes).
            let e = comp
                .pooler
                .entries_through(layer, COMP_NAMES, (kv, gate), starts, flow)?;
            return Ok(e.map(|e| entries(comp, e.clone(), e)));
        }
        let kv = flow.full(layer, COMP_NAMES[0], kv)?;
        let gate = flow.full(layer, COMP_NAMES[1], gate)?;
        let windows = comp.pooler.window_logits_from((kv, gate));
        let Some(c) = comp.forward_windows(layer, windows, starts, hooks)? else {
            return Ok(None);
        };
        Ok(Some(entries(comp, c.keys, c.values)))
    }

    /// The compressor of a CSA / HCA layer and the RoPE tables at its window starts,
    /// when a window has closed (`None`: a sliding layer, or no closed window).
    pub(super) fn compressed<'s, 't>(
        &'s self,
        tables: &'t Tables,
    ) -> Option<(&'s Compressor, &'t RopeTables)> {
        let rate = match self.kind {
            AttnType::Hca => &tables.hca,
            AttnType::Csa => &tables.csa,
            AttnType::Sliding => &None,
        };
        match (&self.compressor, rate) {
            (Some(c), Some((n, starts))) if *n > 0 => Some((c, starts)),
            _ => None,
        }
    }

    /// The shared K = V head `[b, t, 1, head_dim]` of `x` (after `input_layernorm`),
    /// before its rotation.
    fn kv_head(&self, x: &Tensor<3>) -> Tensor<4> {
        let [b, t, _] = x.dims();
        self.kv_norm
            .forward(self.kv_proj.forward(x.clone()))
            .reshape([b, t, 1, self.head_dim])
    }

    /// The lightning indexer's pooled index keys over every position of what `flow`
    /// holds (`[b, n, 1, index_head_dim]`).
    fn index_keys(
        &self,
        idx: &Indexer,
        layer: usize,
        x: &Tensor<3>,
        tables: &Tables,
        flow: &mut TokenFlow,
    ) -> Result<Tensor<4>> {
        // The indexer reads its inputs detached. Its top-k passes no gradient to the
        // rest of the model anyway, so this changes no value and no gradient of the
        // main loss; it keeps the distillation loss (`[train] indexer_distill`) from
        // training anything but the indexer, as DeepSeek trains it.
        let (kv, gate) = idx.pooler.project(&x.clone().detach());
        let starts = &tables.csa.as_ref().expect("CSA tables").1;
        Ok(idx
            .pooler
            .entries_through(layer, INDEX_NAMES, (kv, gate), starts, flow)?
            .expect("the caller checked that entries exist"))
    }

    /// The lightning indexer's selector over the index `keys` for the queries `at`
    /// (read detached, as [`Attention::index_keys`] reads its input).
    fn selector(
        idx: &Indexer,
        layer: usize,
        keys: Tensor<4>,
        at: IndexQueries,
    ) -> Result<IndexSelector> {
        // `heads` come from the detached input already (callers pass
        // `head_weights(x.detach())`): detaching them again would cut the gradient of
        // the indexer's own `weights_proj`.
        let q_res = &at.q_res.clone().detach();
        idx.selector(layer, keys, IndexQueries { q_res, ..at })
    }

    /// The RoPE tables the queries and keys of this layer rotate with.
    fn q_tables<'t>(&self, tables: &'t Tables) -> &'t RopeTables {
        match self.kind {
            AttnType::Sliding => &tables.main,
            _ => &tables.compress,
        }
    }

    /// What block `f..f + bq` of a plain forward without hooks contributes to the keys
    /// every query reads (`x: [b, bq, d_model]`, after `input_layernorm`): its K = V head,
    /// rotated at its positions, and its compressor's and indexer's pooler inputs.
    pub fn key_inputs(&self, f: usize, x: &Tensor<3>, tables: &Tables) -> KeyInputs {
        let bq = x.dims()[1];
        let comp = self.compressor.as_ref();
        KeyInputs {
            k: rope::rotate(
                self.kv_head(x),
                &self.q_tables(tables).rows(f..f + bq),
                false,
            ),
            comp: comp.map(|c| c.pooler.project(x)),
            // The indexer reads its input detached, as in `index_keys`.
            index: comp
                .and_then(|c| c.indexer.as_ref())
                .map(|i| i.pooler.project(&x.clone().detach())),
        }
    }

    /// What the queries of block `x: [b, bq, d_model]` (after `input_layernorm`) are
    /// computed from: the low-rank query residual and, in a CSA layer, the indexer's head
    /// weights (`q_lora_rank + index_n_heads` values per token, against `d_model`).
    pub fn query_inputs(&self, x: &Tensor<3>) -> QueryInputs {
        let indexer = self.compressor.as_ref().and_then(|c| c.indexer.as_ref());
        QueryInputs {
            q_res: self.q_a_norm.forward(self.q_a_proj.forward(x.clone())),
            heads: indexer.map(|i| i.head_weights(&x.clone().detach())),
        }
    }

    /// The output `[b, bq, d_model]` of the block of queries at positions `f..f + bq`
    /// (their [`Attention::query_inputs`]) over the `keys` of [`Attention::span_keys`]:
    /// in sub-blocks of `sub` queries, each one's queries, attention, inverse rotation and
    /// output projection. The queries and per-head outputs (`n_heads * head_dim` values
    /// per token, 8x `d_model` at DeepSeek-V4's width) exist for one sub-block at a time.
    #[allow(clippy::too_many_arguments)]
    pub fn block_output(
        &self,
        layer: usize,
        f: usize,
        at: &QueryInputs,
        keys: &BlockKeys,
        tables: &Tables,
        hooks: &mut HookRun,
        sub: usize,
    ) -> Result<Tensor<3>> {
        let [b, t, _] = at.q_res.dims();
        let sub = sub.max(1);
        let indexer = self.compressor.as_ref().and_then(|c| c.indexer.as_ref());
        let pattern = HookPoint::block(layer, Site::AttnPattern);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mut parts = Vec::with_capacity(t.div_ceil(sub));
        for i in (0..t).step_by(sub) {
            let rows = i..(i + sub).min(t);
            let part = QueryInputs {
                q_res: at.q_res.clone().slice_dim(1, rows.clone()),
                heads: at.heads.clone().map(|h| h.slice_dim(1, rows.clone())),
            };
            let (f, bq) = (f + i, rows.len());
            let qt = self.q_tables(tables).rows(f..f + bq);
            let q = self.queries_from(layer, &part.q_res, &qt, hooks)?;
            let queries = Queries::Rows {
                from: vec![f; b],
                len: bq,
                total: keys.total,
            };
            let mut selector = match (indexer, &keys.index, &part.heads) {
                (Some(idx), Some(index), Some(heads)) => {
                    let at = IndexQueries {
                        heads,
                        q_res: &part.q_res,
                        tables: &tables.compress.rows(f..f + bq),
                        queries: &queries,
                    };
                    Some(Self::selector(idx, layer, index.clone(), at)?)
                }
                _ => None,
            };
            let attend_to = Keys {
                entries: keys.entries.clone(),
                selector: selector.as_mut().map(|s| s as &mut dyn EntrySelector),
                raw: Some(Raw {
                    k: keys.k.clone(),
                    v: keys.k.clone(),
                    window: Some(tables.window),
                    start: keys.start,
                }),
                sink: Some(self.sinks.val()),
            };
            let z = attend(q, &queries, attend_to, scale, pattern, false, hooks)?;
            if let Some(s) = selector {
                s.finish(hooks);
            }
            parts.push(self.project(rope::rotate(z, &qt, true)));
        }
        Ok(cat_dim1(parts))
    }

    /// `z: [b, t, nh, dh]` -> the output `[b, t, d_model]`, through `hook_result`
    /// (per-head contributions) when it is captured or intervened on.
    fn output(&self, layer: usize, z: Tensor<4>, hooks: &mut HookRun) -> Result<Tensor<3>> {
        let [b, t, _, _] = z.dims();
        let result_point = HookPoint::block(layer, Site::AttnResult);
        if hooks.touches(&result_point) {
            let r = self.per_head(z.clone());
            let intervened = hooks
                .spec()
                .interventions()
                .iter()
                .any(|i| i.target.matches_point(&result_point));
            let r = hooks.apply(result_point, r)?;
            if intervened {
                let d = r.dims()[3];
                return Ok(r.sum_dim(2).reshape([b, t, d]));
            }
        }
        Ok(self.project(z))
    }

    /// The grouped low-rank output projection of `z: [b, t, nh, dh]`.
    fn project(&self, z: Tensor<4>) -> Tensor<3> {
        let [b, t, nh, dh] = z.dims();
        let g = self.o_groups;
        let in_g = nh * dh / g;
        if let Some(s) = self.o_a_proj.weight.stored() {
            // As stored: group by group, each group's rows of `o_a` dequantised in
            // blocks (never the whole matrix at once).
            let r = s.dims()[0] / g;
            let zg = z.reshape([b * t, g, in_g]);
            let y: Vec<Tensor<2>> = (0..g)
                .map(|gi| {
                    let x = zg.clone().slice_dim(1, gi..gi + 1).reshape([b * t, in_g]);
                    s.matmul_t_rows(0, gi * r..(gi + 1) * r, x)
                })
                .collect();
            return self.o_b_proj.forward(cat_dim1(y).reshape([b, t, g * r]));
        }
        let wa = self.o_a_proj.weight.val(); // [g * r, in_g]
        let r = wa.dims()[0] / g;
        let wa = wa.reshape([g, r, in_g]).swap_dims(1, 2); // [g, in_g, r]
        let y = z
            .reshape([b * t, g, in_g])
            .swap_dims(0, 1)
            .mm(wa) // [g, bt, r]
            .swap_dims(0, 1)
            .reshape([b, t, g * r]);
        self.o_b_proj.forward(y)
    }

    /// Per-head contributions `[b, t, nh, d_model]` (the output projection is linear and
    /// bias-free, so they sum to the attention output).
    fn per_head(&self, z: Tensor<4>) -> Tensor<4> {
        let [b, t, nh, dh] = z.dims();
        let g = self.o_groups;
        let hpg = nh / g;
        let wa = self.o_a_proj.weight.val();
        let r = wa.dims()[0] / g;
        let wb = self.o_b_proj.weight.val(); // [d, g * r]
        let d = wb.dims()[0];
        let a = wa.reshape([g, r, hpg, dh]).swap_dims(1, 2); // [g, hpg, r, dh]
        let bm = wb
            .reshape([d, g, r])
            .swap_dims(0, 1) // [g, d, r]
            .reshape([g, 1, d, r])
            .expand([g, hpg, d, r]);
        let m = bm.mm(a).reshape([nh, d, dh]); // head h = group * hpg + j
        let zh = z.swap_dims(0, 2).reshape([nh, t * b, dh]); // [nh, t*b, dh]
        zh.mm(m.swap_dims(1, 2)) // [nh, t*b, d]
            .reshape([nh, t, b, d])
            .swap_dims(0, 2) // [b, t, nh, d]
    }
}

/// The state names of the compressor's pooler inputs and entries
/// ([`super::pooler::Pooler::entries_through`]).
const COMP_NAMES: [&str; 3] = ["comp_kv", "comp_gate", "comp_entries"];

/// The state names of the CSA indexer's pooler inputs and keys.
const INDEX_NAMES: [&str; 3] = ["index_kv", "index_gate", "index_keys"];

/// Compressed entries of `comp`'s windows (keys `k`, values `v`: `[b, n, 1, d]`).
pub(super) fn entries(comp: &Compressor, k: Tensor<4>, v: Tensor<4>) -> Entries {
    let rate = comp.pooler.rate;
    Entries {
        k,
        v,
        stride: rate,
        close: rate - 1,
        offsets: Vec::new(),
    }
}
