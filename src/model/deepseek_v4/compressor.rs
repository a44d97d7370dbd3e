//! KV compressors: HCA (non-overlapping windows of m' tokens) and CSA (overlapping
//! windows of 2m tokens every m tokens, the "two halves" layout). Stateless prefill:
//! only closed windows exist, trailing tokens beyond `floor(S / rate) * rate` are unused.
//!
//! Per token `kv = W_kv x` and `gate = W_gate x + position_bias[offset]`; a per-channel
//! softmax over the window's slots weights the sum, then RMSNorm (`kv_norm`) and RoPE at
//! the window's first position `w * rate` on the last `rot_dims` channels.
//!
//! CSA: each token projects `2 * dim` channels. Channels `[0, dim)` (the A half) feed the
//! NEXT window's entry, channels `[dim, 2 dim)` (the B half) its own window's entry. Entry
//! `w` pools slots `0..m` = A half of tokens `(w-1) m + j` and slots `m..2m` = B half of
//! tokens `w m + j`; entry 0 has no A slots (weight 0). The lightning indexer uses the
//! same layout at `index_head_dim` ([`Pooler`], in pooler.rs, is shared).

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use super::indexer::Indexer;
pub use super::pooler::Pooler;
use super::rope;
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::layers::RopeTables;

/// The compressor of a CSA or HCA layer (and, for CSA, its lightning indexer).
#[derive(Module, Debug)]
pub struct Compressor {
    pub pooler: Pooler,
    /// CSA only.
    pub indexer: Option<Indexer>,
}

/// Compressed keys and values of one layer, `[b, n, 1, head_dim]`, rotated at their
/// window starts. They are the same tensor unless a hook changed one of them.
pub struct Compressed {
    pub keys: Tensor<4>,
    pub values: Tensor<4>,
}

impl Compressor {
    /// Run on the attention input `x: [b, t, d_model]`; `None` when no window has closed.
    /// `starts` are the RoPE tables at the window starts `w * rate`.
    pub fn forward(
        &self,
        layer: usize,
        x: &Tensor<3>,
        starts: &RopeTables,
        hooks: &mut HookRun,
    ) -> Result<Option<Compressed>> {
        self.forward_windows(layer, self.pooler.window_logits(x), starts, hooks)
    }

    /// Whether `hooks` capture or change any of this layer's compressor points (the
    /// gates' logits and weights, the compressed K and V), which
    /// [`Compressor::forward_windows`] then exposes.
    pub fn hooked(layer: usize, hooks: &HookRun) -> bool {
        [
            Site::KeyGateLogits,
            Site::ValueGateLogits,
            Site::KeyGate,
            Site::ValueGate,
            Site::CompressedK,
            Site::CompressedV,
        ]
        .into_iter()
        .any(|s| hooks.touches(&HookPoint::block(layer, s)))
    }

    /// [`Compressor::forward`] from the pooler's window logits and values
    /// ([`Pooler::window_logits`] or [`Pooler::window_logits_from`]).
    pub fn forward_windows(
        &self,
        layer: usize,
        windows: Option<(Tensor<4>, Tensor<4>)>,
        starts: &RopeTables,
        hooks: &mut HookRun,
    ) -> Result<Option<Compressed>> {
        let Some((logits, values)) = windows else {
            return Ok(None);
        };
        let [b, n, s, d] = logits.dims();
        let kl = HookPoint::block(layer, Site::KeyGateLogits);
        let vl = HookPoint::block(layer, Site::ValueGateLogits);
        let kg = HookPoint::block(layer, Site::KeyGate);
        let vg = HookPoint::block(layer, Site::ValueGate);
        let ckp = HookPoint::block(layer, Site::CompressedK);
        let cvp = HookPoint::block(layer, Site::CompressedV);
        let gates_hooked = [&kl, &vl, &kg, &vg].iter().any(|p| hooks.touches(p));
        if !gates_hooked && !hooks.touches(&ckp) && !hooks.touches(&cvp) {
            // K = V: pool and rotate once.
            let e = self.pooler.pool(softmax(logits, 2), values);
            let e = rope::rotate(e.reshape([b, n, 1, d]), starts, false);
            return Ok(Some(Compressed {
                keys: e.clone(),
                values: e,
            }));
        }
        let (pk, pv) = if gates_hooked {
            // K and V share the gates; seen (and changeable) separately here.
            let l5 = logits.reshape([b, n, s, 1, d]);
            let lk = hooks.apply(kl, l5.clone())?;
            let lv = hooks.apply(vl, l5)?;
            let wk = hooks.apply(kg, softmax(lk, 2))?;
            let wv = hooks.apply(vg, softmax(lv, 2))?;
            (
                self.pooler.pool(wk.reshape([b, n, s, d]), values.clone()),
                Some(self.pooler.pool(wv.reshape([b, n, s, d]), values)),
            )
        } else {
            (self.pooler.pool(softmax(logits, 2), values), None)
        };
        let pk = pk.reshape([b, n, 1, d]);
        let ck = hooks.apply(ckp, pk.clone())?;
        let cv = hooks.apply(cvp, pv.map(|v| v.reshape([b, n, 1, d])).unwrap_or(pk))?;
        Ok(Some(Compressed {
            keys: rope::rotate(ck, starts, false),
            values: rope::rotate(cv, starts, false),
        }))
    }
}
