//! One kvc attention layer: projections, Q/K norm, the optional key shift, the
//! compressor, RoPE, and the shared attention core ([`crate::model::attention`]) over
//! `[compressed entries ; raw tail (or every token, full attention) ; sink]`.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

use super::compressor::{Compressor, Windows};
use super::config::{AttentionKind, KvcConfig};
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::{Entries, Keys, Raw, attend};
use crate::model::compression::{BlockSelector, ChunkSelector, Eviction, Overlay};
use crate::model::flops::Mm;
use crate::model::kv_state::{Queries, TokenFlow};
use crate::model::layers::{Linear, RmsNorm, RopeLayout, RopeTables, apply_rope, rope_inv_freq};
use crate::model::weights::{Init, Vb};

/// One attention layer.
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection `W_Q` (`[n_heads * d_head, d_model]`).
    pub w_q: Linear,
    /// Key projection `W_K` (`[n_kv_heads * d_head, d_model]`).
    pub w_k: Linear,
    /// Absent with `tied_kv`.
    pub w_v: Option<Linear>,
    /// Output projection `W_O` (`[d_model, n_heads * d_head]`).
    pub w_o: Linear,
    /// Per-head query RMSNorm (`qk_norm`).
    pub q_norm: Option<RmsNorm>,
    /// Per-head key RMSNorm (`qk_norm`).
    pub k_norm: Option<RmsNorm>,
    /// Per-head sink logits `[n_heads]`.
    pub sink: Option<Param<Tensor<1>>>,
    /// Key-shift mix `mu` `[d_model]` (`key_shift = true`).
    pub key_shift: Option<Param<Tensor<1>>>,
    /// The compressor (compressed attention only).
    pub compressor: Option<Compressor>,
}

/// Which of the attention's inputs [`Attention::inputs`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// The queries.
    pub q: bool,
    /// The per-token keys and values.
    pub kv: bool,
    /// The compressed entries (and the keys and values they pool).
    pub entries: bool,
}

impl Need {
    /// Everything (the forward).
    pub const ALL: Need = Need {
        q: true,
        kv: true,
        entries: true,
    };

    /// What the hooks of `hooks` read or change at layer `layer` (a local read).
    pub fn touched(hooks: &HookRun, layer: usize) -> Need {
        let at = |s: Site| hooks.touches(&HookPoint::block(layer, s));
        Need {
            q: at(Site::AttnQ),
            kv: at(Site::AttnK) || at(Site::AttnV),
            entries: at(Site::CompressedK) || at(Site::CompressedV),
        }
    }
}

/// What every layer of one forward shares: RoPE tables at the key positions, the
/// computed (query) positions and the entry starts, and the compression windows.
pub struct Tables {
    keys: Option<RopeTables>,
    queries: Option<RopeTables>,
    /// Sliding layers' tables when their RoPE base differs (Gemma 3): (keys, queries).
    local: Option<(Option<RopeTables>, Option<RopeTables>)>,
    entries: Option<RopeTables>,
    windows: Option<Windows>,
}

/// The inverse frequencies of a `c` model at RoPE base `theta` (Llama 3 scaled when
/// the config says so).
fn inv_freq(c: &KvcConfig, theta: f64) -> Vec<f64> {
    let inv = rope_inv_freq(c.rot_dims(), theta);
    match &c.arch.rope_llama3 {
        Some(s) => s.apply(&inv),
        None => inv,
    }
}

impl Tables {
    /// For a forward computing `queries` of a `c` model.
    pub fn new(c: &KvcConfig, queries: &Queries, device: &Device) -> Self {
        let rot = c.rot_dims();
        let total = queries.total();
        let key_pos: Vec<usize> = (0..total).collect();
        let at =
            |inv: &[f64], pos: &[usize]| (rot > 0).then(|| RopeTables::new(pos, inv, 1.0, device));
        let pair = |inv: &[f64]| {
            let keys = at(inv, &key_pos);
            let q = match queries {
                Queries::All { .. } => keys.clone(),
                _ => at(inv, &queries.positions()),
            };
            (keys, q)
        };
        let global = inv_freq(c, c.rope_theta);
        let (keys, queries_t) = pair(&global);
        let local = c.arch.rope_local_theta.map(|t| pair(&inv_freq(c, t)));
        let windows = match (&c.compression, c.attention) {
            (Some(cc), AttentionKind::Compressed) => Some(Windows::new(cc, total, c.n_kv_heads)),
            _ => None,
        };
        let entries = match (&c.compression, &windows) {
            // Each entry rotated at its window's start: per (entry, KV head) when the
            // heads' windows are staggered.
            (Some(cc), Some(w)) if w.n_entries > 0 => {
                let kvh = if cc.staggered() { c.n_kv_heads } else { 1 };
                let pos: Vec<usize> = (0..w.n_entries)
                    .flat_map(|i| (0..kvh).map(move |h| i * cc.stride + cc.offset(h)))
                    .collect();
                at(&global, &pos)
            }
            _ => None,
        };
        Tables {
            keys,
            queries: queries_t,
            local,
            entries,
            windows,
        }
    }

    /// The (keys, queries) tables of layer `l`.
    fn rope_of(&self, c: &KvcConfig, l: usize) -> (&Option<RopeTables>, &Option<RopeTables>) {
        match &self.local {
            Some((k, q)) if c.arch.sliding(l) => (k, q),
            _ => (&self.keys, &self.queries),
        }
    }
}

/// Layer `layer` of one forward of a `config` model, with the [`Tables`] every layer
/// of the forward shares: where an attention layer runs.
#[derive(Clone, Copy)]
pub struct LayerAt<'a> {
    /// The layer's index.
    pub layer: usize,
    /// The model's configuration.
    pub config: &'a KvcConfig,
    /// The forward's tables (on the layer's device).
    pub tables: &'a Tables,
}

/// The attention's inputs ([`Attention::inputs`]); each is `None` when not asked for.
pub struct Inputs {
    /// `[b, lq, n_heads, d_head]`, through `hook_q`, not rotated.
    pub q: Option<Tensor<4>>,
    /// `[b, total, kv_heads, d_head]` of every position, through `hook_k`, not rotated.
    pub k: Option<Tensor<4>>,
    /// `[b, total, kv_heads, d_head]` of every position, through `hook_v`.
    pub v: Option<Tensor<4>>,
    /// The compressed entries (through `hook_compressed_k` / `_v`), rotated.
    pub entries: Option<Entries>,
}

fn rope(x: Tensor<4>, t: &Option<RopeTables>) -> Tensor<4> {
    match t {
        Some(t) => apply_rope(x, t, RopeLayout::HalfSplit, false),
        None => x,
    }
}

impl Attention {
    /// Build layer attention under `va` (`blocks.{l}.attn`).
    pub fn new(va: &Vb, c: &KvcConfig, std: f64, out_std: f64) -> Result<Self> {
        let (d, h, kvh, dh) = (c.d_model, c.n_heads, c.n_kv_heads, c.d_head());
        let compressor = match (&c.compression, c.attention) {
            (Some(cc), AttentionKind::Compressed) => {
                Some(Compressor::new(&va.pp("compressor"), cc, d, kvh, dh, std)?)
            }
            _ => None,
        };
        let norm = |name: &str| {
            c.qk_norm
                .then(|| RmsNorm::new(&va.pp(name), dh, c.norm_eps))
                .transpose()
        };
        let proj = |name: &str, out: usize| {
            let vb = va.pp(name);
            if c.arch.qkv_bias {
                Linear::with_bias(&vb, d, out, std)
            } else {
                Linear::new(&vb, d, out, std)
            }
        };
        Ok(Attention {
            w_q: proj("w_q", h * dh)?,
            w_k: proj("w_k", kvh * dh)?,
            w_v: (!c.tied_kv).then(|| proj("w_v", kvh * dh)).transpose()?,
            w_o: Linear::new(&va.pp("w_o"), h * dh, d, out_std)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            sink: c
                .sink
                .then(|| va.param("sink", [h], Init::Zeros))
                .transpose()?,
            key_shift: c
                .key_shift
                .then(|| va.param("key_shift", [d], Init::Const(0.5)))
                .transpose()?,
            compressor,
        })
    }

    /// `h: [b, lq, d]` at the positions `flow` computes -> `[b, lq, d]`.
    pub(crate) fn forward(
        &self,
        at: LayerAt,
        h: Tensor<3>,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let LayerAt {
            layer,
            config: c,
            tables,
        } = at;
        let Inputs { q, k, v, entries } = self.inputs(at, h, Need::ALL, flow, hooks)?;
        let (Some(q), Some(k), Some(v)) = (q, k, v) else {
            return Err(Error::Other(format!(
                "layer {layer}: the attention inputs were not all computed"
            )));
        };
        let dh = c.d_head();
        let (key_rope, query_rope) = tables.rope_of(c, layer);
        let q = rope(q, query_rope);
        let pattern = HookPoint::block(layer, Site::AttnPattern);
        let scale = c.arch.attn_scale.unwrap_or(1.0 / (dh as f64).sqrt());
        let sink = self.sink.as_ref().map(|s| s.val());
        if let Some(o) = &c.overlay {
            let z = self.attend_overlay(
                o,
                (layer, scale, pattern),
                (q, k, v, sink),
                key_rope,
                flow,
                hooks,
            )?;
            let z = hooks.apply(HookPoint::block(layer, Site::AttnZ), z)?;
            return self.output(layer, z, hooks);
        }
        let raw = match (c.attention, &c.compression) {
            // A window that covers every position is no window: the causal path, not
            // one gathered band of keys per query.
            (AttentionKind::Full, _) => {
                Some(c.arch.window(layer).filter(|&w| w < flow.queries().total()))
            }
            (_, Some(cc)) if cc.local_tail > 0 => Some(Some(cc.local_tail)),
            _ => None,
        }
        .map(|window| Raw {
            k: rope(k, key_rope),
            v,
            window,
            start: 0,
        });
        let keys = Keys {
            entries,
            selector: None,
            raw,
            sink,
        };
        let z = attend(q, flow.queries(), keys, scale, pattern, false, hooks)?;
        let z = hooks.apply(HookPoint::block(layer, Site::AttnZ), z)?;
        self.output(layer, z, hooks)
    }

    /// The attention of a `select` overlay: every raw token is an entry the block
    /// selector may keep (stride 1, visible at once), the last `window` tokens are read
    /// raw; `q` rotated, `k` not yet.
    #[allow(clippy::too_many_arguments)]
    fn attend_overlay(
        &self,
        overlay: &Overlay,
        (layer, scale, pattern): (usize, f64, HookPoint),
        (q, k, v, sink): (Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<1>>),
        key_rope: &Option<RopeTables>,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        if let Overlay::Evict {
            chunk,
            keep,
            observe,
            offset,
            sinks,
            decode,
        } = *overlay
        {
            let e = Eviction {
                chunk,
                offset,
                keep,
                observe,
                sinks,
                decode,
            };
            return self.attend_evict(
                e,
                (layer, scale, pattern),
                (q, k, v, sink),
                key_rope,
                flow,
                hooks,
            );
        }
        let Overlay::Select {
            block,
            top_k,
            window,
            offset,
            sinks,
            score,
        } = *overlay
        else {
            return Err(Error::Other(format!(
                "layer {layer}: overlay {overlay} is applied as compressed attention, not in the attention core"
            )));
        };
        let k = rope(k, key_rope);
        let geometry = (block, offset, top_k, window, sinks);
        let mut sel =
            BlockSelector::new(layer, q.clone(), k.clone(), flow.queries(), geometry, score);
        let keys = Keys {
            entries: Some(Entries {
                k: k.clone(),
                v: v.clone(),
                stride: 1,
                close: 0,
                offsets: Vec::new(),
            }),
            selector: Some(&mut sel),
            raw: Some(Raw {
                k,
                v,
                window: Some(window),
                start: 0,
            }),
            sink,
        };
        let at = |s: Site| hooks.touches(&HookPoint::block(layer, s));
        let dense = at(Site::IndexerScores) || at(Site::IndexerSelected);
        attend(q, flow.queries(), keys, scale, pattern, dense, hooks)
    }

    /// The attention of an `evict` overlay of geometry `e`: the chunks the observation window kept,
    /// the window, the decode tokens and the sinks ([`ChunkSelector`]); `q` rotated,
    /// `k` not yet.
    #[allow(clippy::too_many_arguments)]
    fn attend_evict(
        &self,
        e: Eviction,
        (layer, scale, pattern): (usize, f64, HookPoint),
        (q, k, v, sink): (Tensor<4>, Tensor<4>, Tensor<4>, Option<Tensor<1>>),
        key_rope: &Option<RopeTables>,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        // The chunk scores read the window's queries: every position's rotated
        // queries (a suffix forward merges its own into the base run's).
        let q_all = flow.full(layer, "overlay_q", q.clone())?;
        let k = rope(k, key_rope);
        let mut sel =
            ChunkSelector::new(layer, (q_all, k.clone()), flow.queries(), e, scale, hooks)?;
        let keys = Keys {
            entries: Some(Entries {
                k,
                v,
                stride: 1,
                close: 0,
                offsets: Vec::new(),
            }),
            selector: Some(&mut sel),
            raw: None,
            sink,
        };
        attend(q, flow.queries(), keys, scale, pattern, false, hooks)
    }

    /// The attention's inputs from `h: [b, lq, d]`: the queries (through `hook_q`, not
    /// rotated), the keys and values of every position (through `hook_k` / `hook_v`,
    /// not rotated) and the compressed entries (through `hook_compressed_k` / `_v`).
    /// Everything between the layer's normalised input and what the attention core
    /// reads: edge attribution's local pass runs this alone, only the parts it `need`s
    /// (the forward: all; `None` for the others).
    pub(crate) fn inputs(
        &self,
        at: LayerAt,
        h: Tensor<3>,
        need: Need,
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Inputs> {
        let LayerAt {
            layer, config: c, ..
        } = at;
        let [b, lq, _] = h.dims();
        let (nh, kvh, dh) = (c.n_heads, c.n_kv_heads, c.d_head());
        let q = if need.q {
            let mut q = self.w_q.forward(h.clone()).reshape([b, lq, nh, dh]);
            if let Some(n) = &self.q_norm {
                q = n.forward(q);
            }
            Some(hooks.apply(HookPoint::block(layer, Site::AttnQ), q)?)
        } else {
            None
        };
        if !(need.kv || need.entries) {
            return Ok(Inputs {
                q,
                k: None,
                v: None,
                entries: None,
            });
        }
        let key_input = match &self.key_shift {
            Some(mix) => {
                let prev = flow.previous(layer, "attn_in", h.clone())?;
                let mu = mix.val().unsqueeze::<3>();
                h.clone() * mu.clone() + prev * (mu.neg() + 1.0)
            }
            None => h.clone(),
        };
        let mut k = self.w_k.forward(key_input).reshape([b, lq, kvh, dh]);
        let v = match &self.w_v {
            Some(w_v) => w_v.forward(h.clone()).reshape([b, lq, kvh, dh]),
            None => k.clone(),
        };
        if let Some(n) = &self.k_norm {
            k = n.forward(k);
        }
        let k = hooks.apply(HookPoint::block(layer, Site::AttnK), k)?;
        let v = hooks.apply(HookPoint::block(layer, Site::AttnV), v)?;
        let k = flow.full(layer, "k", k)?;
        let v = flow.full(layer, "v", v)?;
        let entries = if need.entries {
            self.entries(at, &h, (&k, &v), flow, hooks)?
        } else {
            None
        };
        Ok(Inputs {
            q,
            k: Some(k),
            v: Some(v),
            entries,
        })
    }

    /// The compressed entries (pooled from the keys and values `(k, v)` of every
    /// position, gated from `h`), or `None` when the layer does not compress or no
    /// window has closed.
    fn entries(
        &self,
        at: LayerAt,
        h: &Tensor<3>,
        (k, v): (&Tensor<4>, &Tensor<4>),
        flow: &mut TokenFlow,
        hooks: &mut HookRun,
    ) -> Result<Option<Entries>> {
        let LayerAt {
            layer,
            config: c,
            tables,
        } = at;
        let (Some(comp), Some(windows), Some(cc)) =
            (&self.compressor, &tables.windows, &c.compression)
        else {
            return Ok(None);
        };
        if windows.n_entries == 0 {
            return Ok(None);
        }
        let kvh = c.n_kv_heads;
        let mut gates = [None, None];
        for (value, name) in [(false, "key_gate"), (true, "value_gate")] {
            if let Some(g) = comp.gate_logits(value, h, kvh) {
                gates[value as usize] = Some(flow.full(layer, name, g)?);
            }
        }
        let [key_gate, value_gate] = gates;
        let ck = comp.pool(layer, false, key_gate, k.clone(), windows, hooks)?;
        let ck = hooks.apply(HookPoint::block(layer, Site::CompressedK), ck)?;
        let cv = comp.pool(layer, true, value_gate, v.clone(), windows, hooks)?;
        let cv = hooks.apply(HookPoint::block(layer, Site::CompressedV), cv)?;
        let k = if cc.staggered() {
            // One table row per (entry, KV head).
            let [b, n, kvh, dh] = ck.dims();
            rope(ck.reshape([b, n * kvh, 1, dh]), &tables.entries).reshape([b, n, kvh, dh])
        } else {
            rope(ck, &tables.entries)
        };
        Ok(Some(Entries {
            k,
            v: cv,
            stride: cc.stride,
            close: cc.window - 1,
            offsets: if cc.staggered() {
                cc.window_offsets.clone()
            } else {
                Vec::new()
            },
        }))
    }

    /// `z: [b, lq, nh, dh]` -> the attention output `[b, lq, d]`, through `hook_result`
    /// (per-head contributions) when it is captured or intervened on.
    fn output(&self, layer: usize, z: Tensor<4>, hooks: &mut HookRun) -> Result<Tensor<3>> {
        let [b, lq, nh, dh] = z.dims();
        let result_point = HookPoint::block(layer, Site::AttnResult);
        if hooks.touches(&result_point) {
            // Per-head contributions [b, lq, nh, d_model]: W_O split by head.
            let d = self.w_o.d_out();
            let wo = self.w_o.weight.val().reshape([d, nh, dh]).swap_dims(0, 1); // [nh, d, dh]
            let zh = z.clone().swap_dims(0, 2).reshape([nh, lq * b, dh]);
            let r = zh.mm(wo.swap_dims(1, 2)); // [nh, lq*b, d]
            let r = r.reshape([nh, lq, b, d]).swap_dims(0, 2); // [b, lq, nh, d]
            let intervened = hooks
                .spec()
                .interventions()
                .iter()
                .any(|i| i.target.matches_point(&result_point));
            let r = hooks.apply(result_point, r)?;
            if intervened {
                let mut out = r.sum_dim(2).reshape([b, lq, d]);
                if let Some(bias) = &self.w_o.bias {
                    out = out + bias.val().unsqueeze::<3>();
                }
                return Ok(out);
            }
        }
        Ok(self.w_o.forward(z.reshape([b, lq, nh * dh])))
    }
}
