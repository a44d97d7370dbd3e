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
use burn::tensor::{Bool, Tensor, TensorData};

use super::compressor::Compressor;
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

impl Attention {
    /// `x: [b, t, d_model]` (after `input_layernorm`) -> `[b, t, d_model]`.
    pub fn forward(
        &self,
        layer: usize,
        x: Tensor<3>,
        geo: &Geometry,
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let [b, t, _] = x.dims();
        let (nh, dh) = (self.n_heads, self.head_dim);
        let device = x.device();
        let tables = match self.kind {
            AttnType::Sliding => &geo.main,
            _ => &geo.compress,
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

        // Compressed entries and their visibility [b, t, n].
        let mut keys = Vec::with_capacity(2);
        let mut values = Vec::with_capacity(2);
        let mut masks: Vec<Tensor<3, Bool>> = Vec::with_capacity(2);
        if let Some(comp) = &self.compressor {
            let (starts, visible) = match self.kind {
                AttnType::Hca => match &geo.hca {
                    Some((n, vis, starts)) if *n > 0 => (
                        Some(starts),
                        Some(vis.clone().reshape([1, t, *n]).expand([b, t, *n])),
                    ),
                    _ => (None, None),
                },
                AttnType::Csa => match &geo.csa {
                    Some(g) if g.n_entries > 0 => {
                        let idx = comp.indexer.as_ref().expect("CSA layers have an indexer");
                        let sel = idx.select(layer, &x, &q_res, &geo.compress, g, hooks)?;
                        (Some(&g.starts), Some(sel))
                    }
                    _ => (None, None),
                },
                AttnType::Sliding => (None, None),
            };
            if let (Some(starts), Some(visible)) = (starts, visible)
                && let Some(c) = comp.forward(layer, &x, starts, hooks)?
            {
                let n = c.keys.dims()[1];
                keys.push(c.keys.reshape([b, n, dh]));
                values.push(c.values.reshape([b, n, dh]));
                masks.push(visible);
            }
        }
        keys.push(k);
        values.push(v);
        masks.push(geo.window.clone().reshape([1, t, t]).expand([b, t, t]));
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
