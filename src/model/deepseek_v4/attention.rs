//! DeepSeek-V4 attention: low-rank queries (`q_a -> RMSNorm -> q_b`, then an unweighted
//! per-head RMSNorm), one shared K = V head (`kv_proj -> kv_norm`), partial interleaved
//! RoPE on the last `rot_dims` channels, a raw sliding window of `sliding_window` tokens,
//! compressed entries (CSA / HCA, see [`super::compressor`]) and a per-head sink in one
//! joint softmax, the inverse rotation of the output's rope slice, and the grouped
//! low-rank output projection (`o_a` per group of heads, then `o_b`).
//!
//! Key slots, as in `hook_pattern`: `[compressed entries (n) ; raw tokens (t) ; sink]`.
//! Raw token j is visible to query t iff `t - W < j <= t`; compressed entry w iff its
//! window has closed, `w < (t + 1) / rate`, and (CSA) the indexer selected it.

use burn::module::{Module, Param};
use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::compressor::{Compressor, Pooler};
use super::config::AttnType;
use super::indexer::CsaGeometry;
use super::rope;
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::layers::{Linear, RmsNorm, RopeTables, masked_softmax, rms_normalize};

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

/// Per-forward tables and masks shared by all layers.
pub struct Geometry {
    /// Main rotary at positions `0..t` (sliding layers).
    pub main: RopeTables,
    /// Compress rotary at positions `0..t` (CSA / HCA layers, indexer queries).
    pub compress: RopeTables,
    /// `[t, t]` sliding-window visibility.
    pub window: Tensor<2, Bool>,
    /// HCA: entries, `[t, n]` visibility, tables at the window starts.
    pub hca: Option<(usize, Tensor<2, Bool>, RopeTables)>,
    /// CSA geometry (indexer and compressor).
    pub csa: Option<CsaGeometry>,
}

/// Per-layer, per-token state of a base forward that later positions' attention reads
/// (rows = prompts, every position): the rotated keys and values, and the per-token
/// projections of the compressor and of the indexer's pooler ([`Pooler::project`]).
#[derive(Debug, Clone)]
pub struct LayerState {
    pub k: Tensor<3>,
    pub v: Tensor<3>,
    pub comp: Option<(Tensor<3>, Tensor<3>)>,
    pub index: Option<(Tensor<3>, Tensor<3>)>,
}

impl LayerState {
    /// Rows `idx` of every tensor.
    pub fn select_rows(&self, idx: &Tensor<1, Int>) -> LayerState {
        let sel = |t: &Tensor<3>| t.clone().select(0, idx.clone());
        let pair = |p: &Option<(Tensor<3>, Tensor<3>)>| p.as_ref().map(|(a, b)| (sel(a), sel(b)));
        LayerState {
            k: sel(&self.k),
            v: sel(&self.v),
            comp: pair(&self.comp),
            index: pair(&self.index),
        }
    }
}

/// Queries at per-row positions (`len` of them per row) over the base run's state for
/// every other position (see `DeepseekV4Model::forward_suffix`).
pub struct SuffixFrame {
    /// `[b * t]`: index into `cat([state rows * t, new rows * len])` that puts each
    /// row's recomputed positions in place of the base run's.
    pub merge: Tensor<1, Int>,
    /// Main and compress RoPE tables at the query positions, row-major `[b * len]`.
    pub main: RopeTables,
    pub compress: RopeTables,
    /// `[b, len, t]` sliding-window visibility.
    pub window: Tensor<3, Bool>,
    /// HCA `[b, len, n]` visibility.
    pub hca: Option<Tensor<3, Bool>>,
    /// CSA closed entries per query `[b, len, 1]` and `[b, len, n]`.
    pub csa: Option<(Tensor<3, Int>, Tensor<3, Bool>)>,
    /// Per layer (rows selected); `None` before the start layer.
    pub layers: Vec<Option<LayerState>>,
}

impl SuffixFrame {
    /// `base: [b, t, c]` with each row's recomputed positions taken from `new: [b, len, c]`.
    pub fn merge(&self, base: Tensor<3>, new: Tensor<3>) -> Tensor<3> {
        crate::model::merge_positions(base, new, &self.merge)
    }
}

/// How a forward treats the per-token state.
pub enum Mode<'a> {
    /// A plain forward.
    Plain,
    /// A full forward that keeps every layer's [`LayerState`].
    Record(&'a mut Vec<LayerState>),
    /// Only some positions are recomputed.
    Suffix(&'a SuffixFrame),
}

impl Attention {
    /// `x: [b, t, d_model]` (after `input_layernorm`) -> `[b, t, d_model]`. In
    /// [`Mode::Suffix`], `t` is the number of recomputed positions per row.
    pub fn forward(
        &self,
        layer: usize,
        x: Tensor<3>,
        geo: &Geometry,
        mode: &mut Mode,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let [b, t, _] = x.dims();
        let (nh, dh) = (self.n_heads, self.head_dim);
        let device = x.device();
        let (tables, compress_tables) = match mode {
            Mode::Suffix(f) => (
                match self.kind {
                    AttnType::Sliding => &f.main,
                    _ => &f.compress,
                },
                &f.compress,
            ),
            _ => (
                match self.kind {
                    AttnType::Sliding => &geo.main,
                    _ => &geo.compress,
                },
                &geo.compress,
            ),
        };
        let q_res = self.q_a_norm.forward(self.q_a_proj.forward(x.clone()));
        let q = self.q_b_proj.forward(q_res.clone()).reshape([b, t, nh, dh]);
        let q = rms_normalize(q, self.eps);
        let q = hooks.apply(HookPoint::block(layer, Site::AttnQ), q)?;
        let q = rope::rotate(q, tables, false);
        let kv = self
            .kv_norm
            .forward(self.kv_proj.forward(x.clone()))
            .reshape([b, t, 1, dh]);
        let (kp, vp) = (
            HookPoint::block(layer, Site::AttnK),
            HookPoint::block(layer, Site::AttnV),
        );
        let (k, v) = if hooks.touches(&kp) || hooks.touches(&vp) {
            let k = hooks.apply(kp, kv.clone())?;
            let v = hooks.apply(vp, kv)?;
            (
                rope::rotate(k, tables, false).reshape([b, t, dh]),
                rope::rotate(v, tables, false).reshape([b, t, dh]),
            )
        } else {
            let kv = rope::rotate(kv, tables, false).reshape([b, t, dh]);
            (kv.clone(), kv)
        };
        // Per-token projections of the compressor and the indexer's pooler.
        let project = |p: &Pooler| -> Option<(Tensor<3>, Tensor<3>)> {
            matches!(mode, Mode::Record(_) | Mode::Suffix(_)).then(|| p.project(&x))
        };
        let comp_proj = self.compressor.as_ref().and_then(|c| project(&c.pooler));
        let index_proj = self
            .compressor
            .as_ref()
            .and_then(|c| c.indexer.as_ref())
            .and_then(|i| project(&i.pooler));
        let (k, v, comp_proj, index_proj) = match mode {
            Mode::Plain => (k, v, None, None),
            Mode::Record(out) => {
                out.push(LayerState {
                    k: k.clone(),
                    v: v.clone(),
                    comp: comp_proj.clone(),
                    index: index_proj.clone(),
                });
                (k, v, comp_proj, index_proj)
            }
            Mode::Suffix(f) => {
                let base = f.layers[layer]
                    .as_ref()
                    .expect("the suffix frame holds every layer from the start");
                let pair = |base: &Option<(Tensor<3>, Tensor<3>)>,
                            new: Option<(Tensor<3>, Tensor<3>)>| {
                    match (base, new) {
                        (Some((b0, b1)), Some((n0, n1))) => {
                            Some((f.merge(b0.clone(), n0), f.merge(b1.clone(), n1)))
                        }
                        _ => None,
                    }
                };
                (
                    f.merge(base.k.clone(), k),
                    f.merge(base.v.clone(), v),
                    pair(&base.comp, comp_proj),
                    pair(&base.index, index_proj),
                )
            }
        };
        let nt = k.dims()[1]; // every position of the sequence

        // Compressed entries and their visibility [b, t, n].
        let mut keys = Vec::with_capacity(2);
        let mut values = Vec::with_capacity(2);
        let mut masks: Vec<Tensor<3, Bool>> = Vec::with_capacity(2);
        if let Some(comp) = &self.compressor {
            let (starts, visible) = match (self.kind, &*mode) {
                (AttnType::Hca, Mode::Suffix(f)) => match (&geo.hca, &f.hca) {
                    (Some((n, _, starts)), Some(vis)) if *n > 0 => {
                        (Some(starts), Some(vis.clone()))
                    }
                    _ => (None, None),
                },
                (AttnType::Hca, _) => match &geo.hca {
                    Some((n, vis, starts)) if *n > 0 => (
                        Some(starts),
                        Some(vis.clone().reshape([1, t, *n]).expand([b, t, *n])),
                    ),
                    _ => (None, None),
                },
                (AttnType::Csa, _) => match &geo.csa {
                    Some(g) if g.n_entries > 0 => {
                        let idx = comp.indexer.as_ref().expect("CSA layers have an indexer");
                        let windows = match &index_proj {
                            Some(p) => idx.pooler.windows_from(p.clone()),
                            None => idx.pooler.windows(&x),
                        }
                        .expect("entries exist");
                        let (closed, closed_mask) = match &*mode {
                            Mode::Suffix(f) => f.csa.clone().expect("CSA suffix geometry"),
                            _ => (g.closed.clone(), g.closed_mask.clone()),
                        };
                        let sel = idx.select_with(
                            layer,
                            windows,
                            &x,
                            &q_res,
                            compress_tables,
                            &g.starts,
                            &closed,
                            &closed_mask,
                            hooks,
                        )?;
                        (Some(&g.starts), Some(sel))
                    }
                    _ => (None, None),
                },
                (AttnType::Sliding, _) => (None, None),
            };
            if let (Some(starts), Some(visible)) = (starts, visible) {
                let windows = match comp_proj {
                    Some(p) => comp.pooler.windows_from(p),
                    None => comp.pooler.windows(&x),
                };
                if let Some(c) = comp.forward_windows(layer, windows, starts, hooks)? {
                    let n = c.keys.dims()[1];
                    keys.push(c.keys.reshape([b, n, dh]));
                    values.push(c.values.reshape([b, n, dh]));
                    masks.push(visible);
                }
            }
        }
        keys.push(k);
        values.push(v);
        masks.push(match &*mode {
            Mode::Suffix(f) => f.window.clone(),
            _ => geo.window.clone().reshape([1, t, nt]).expand([b, t, nt]),
        });
        let keys = Tensor::cat(keys, 1); // [b, nk, dh]
        let values = Tensor::cat(values, 1);
        let nk = keys.dims()[1];
        let mask = Tensor::cat(masks, 2)
            .reshape([b, 1, t, nk])
            .expand([b, nh, t, nk]);

        // One K = V head for all query heads: [b, nh * t, dh] x [b, dh, nk].
        let qh = q.swap_dims(1, 2).reshape([b, nh * t, dh]);
        let scores =
            qh.matmul(keys.swap_dims(1, 2)).reshape([b, nh, t, nk]) * (1.0 / (dh as f64).sqrt());
        let sink = self
            .sinks
            .val()
            .reshape([1, nh, 1, 1])
            .expand([b, nh, t, 1]);
        let all = Tensor::cat(vec![scores, sink], 3);
        let ones = Tensor::<4, Bool>::from_data(TensorData::new(vec![true], [1, 1, 1, 1]), &device)
            .expand([b, nh, t, 1]);
        let p = masked_softmax(all, Tensor::cat(vec![mask, ones], 3));
        let p = hooks.apply(HookPoint::block(layer, Site::AttnPattern), p)?;
        let z = p
            .slice_dim(3, 0..nk)
            .reshape([b, nh * t, nk])
            .matmul(values)
            .reshape([b, nh, t, dh])
            .swap_dims(1, 2); // [b, t, nh, dh]
        let z = rope::rotate(z, tables, true);
        let z = hooks.apply(HookPoint::block(layer, Site::AttnZ), z)?;

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
        let wa = self.o_a_proj.weight.val(); // [g * r, in_g]
        let r = wa.dims()[0] / g;
        let wa = wa.reshape([g, r, in_g]).swap_dims(1, 2); // [g, in_g, r]
        let y = z
            .reshape([b * t, g, in_g])
            .swap_dims(0, 1)
            .matmul(wa) // [g, bt, r]
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
        let m = bm.matmul(a).reshape([nh, d, dh]); // head h = group * hpg + j
        let zh = z.swap_dims(0, 2).reshape([nh, t * b, dh]); // [nh, t*b, dh]
        zh.matmul(m.swap_dims(1, 2)) // [nh, t*b, d]
            .reshape([nh, t, b, d])
            .swap_dims(0, 2) // [b, t, nh, d]
    }
}
