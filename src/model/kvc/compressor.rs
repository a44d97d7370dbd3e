//! The kvc compressor: softmax-gated pooling of each window's per-token keys (and,
//! separately, values) into one entry per KV head, with an optional learned per-offset
//! gate bias (`scalar` gates: one weight per token and KV head; `vector`: per channel;
//! `uniform`: the mean).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use super::config::{CompressionConfig, GateMode};
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::select_positions;
use crate::model::layers::Linear;
use crate::model::weights::{Init, Vb};

/// The compressor of one attention layer.
#[derive(Module, Debug)]
pub struct Compressor {
    /// Key gate logits, `[kv_heads * g, d_model]` (g = 1 scalar, d_head vector).
    pub key_gate: Option<Linear>,
    /// Value gate logits, as `key_gate`.
    pub value_gate: Option<Linear>,
    /// Per-offset key gate bias `[window, kv_heads]`.
    pub key_gate_bias: Option<Param<Tensor<2>>>,
    /// Per-offset value gate bias `[window, kv_heads]`.
    pub value_gate_bias: Option<Param<Tensor<2>>>,
}

/// The windows of one prompt length: how many entries, and the token index of every
/// (entry, offset).
pub struct Windows {
    pub n_entries: usize,
    /// `n_entries * W` token positions, entry-major.
    idx: Vec<usize>,
}

impl Windows {
    /// Windows of `cc` over prompts of `total` tokens.
    pub fn new(cc: &CompressionConfig, total: usize) -> Self {
        let (w, s) = (cc.window, cc.stride);
        let n_entries = if total >= w { (total - w) / s + 1 } else { 0 };
        let idx: Vec<usize> = (0..n_entries)
            .flat_map(|i| (0..w).map(move |o| i * s + o))
            .collect();
        Windows { n_entries, idx }
    }
}

impl Compressor {
    /// Build the compressor of a layer with `kv_heads` heads of width `d_head`.
    pub fn new(
        vb: &Vb,
        cc: &CompressionConfig,
        d_model: usize,
        kv_heads: usize,
        d_head: usize,
        std: f64,
    ) -> Result<Self> {
        let g = if cc.gate == GateMode::Vector {
            d_head
        } else {
            1
        };
        let learned = cc.gate != GateMode::Uniform;
        let gate = |name: &str| {
            learned
                .then(|| Linear::new(&vb.pp(name), d_model, kv_heads * g, std))
                .transpose()
        };
        let bias = |name: &str| {
            (learned && cc.gate_bias)
                .then(|| vb.param(name, [cc.window, kv_heads], Init::Zeros))
                .transpose()
        };
        Ok(Compressor {
            key_gate: gate("key_gate")?,
            value_gate: gate("value_gate")?,
            key_gate_bias: bias("key_gate_bias")?,
            value_gate_bias: bias("value_gate_bias")?,
        })
    }

    /// Per-token gate logits `[b, t, kvh, g]` of the key (or value) gate from
    /// `h: [b, t, d]`; `None` for uniform pooling.
    pub(crate) fn gate_logits(&self, value: bool, h: &Tensor<3>, kvh: usize) -> Option<Tensor<4>> {
        let gate = if value {
            &self.value_gate
        } else {
            &self.key_gate
        };
        gate.as_ref().map(|g| {
            let [b, t, _] = h.dims();
            g.forward(h.clone()).reshape([b, t, kvh, g.d_out() / kvh])
        })
    }

    /// Pool per-token `x: [b, total, kvh, dh]` into `[b, n_entries, kvh, dh]` with the
    /// gate weights `[b, n_entries, W, kvh, g]` (through the `hook_key_gate` /
    /// `hook_value_gate` point) made from the per-token gate logits `logits: [b, total,
    /// kvh, g]` ([`Compressor::gate_logits`]; `None`: uniform).
    pub(crate) fn pool(
        &self,
        layer: usize,
        value: bool,
        logits: Option<Tensor<4>>,
        x: Tensor<4>,
        windows: &Windows,
        hooks: &mut HookRun,
    ) -> Result<Tensor<4>> {
        let [b, _, kvh, dh] = x.dims();
        let n = windows.n_entries;
        assert!(n > 0, "pool is called only when entries exist");
        let idx = &windows.idx;
        let w = idx.len() / n;
        let xw = select_positions(x, idx).reshape([b, n, w, kvh, dh]);
        let (bias, site, logit_site) = if value {
            (
                &self.value_gate_bias,
                Site::ValueGate,
                Site::ValueGateLogits,
            )
        } else {
            (&self.key_gate_bias, Site::KeyGate, Site::KeyGateLogits)
        };
        let weights: Tensor<5> = match logits {
            None => Tensor::full([b, n, w, kvh, 1], 1.0 / w as f32, &xw.device()),
            Some(s) => {
                let g = s.dims()[3];
                let mut s = select_positions(s, idx).reshape([b, n, w, kvh, g]);
                if let Some(bias) = bias {
                    s = s + bias.val().reshape([1, 1, w, kvh, 1]);
                }
                let s = hook_gates(hooks, HookPoint::block(layer, logit_site), s)?;
                softmax(s, 2)
            }
        };
        let weights = hook_gates(hooks, HookPoint::block(layer, site), weights)?;
        Ok((weights * xw).sum_dim(2).reshape([b, n, kvh, dh]))
    }
}

/// Gates or gate logits `[b, n, W, kvh, g]` through `point`, seen there as `[b, n, W,
/// kvh]` for scalar gates (g = 1) and whole for vector gates.
fn hook_gates(hooks: &mut HookRun, point: HookPoint, x: Tensor<5>) -> Result<Tensor<5>> {
    let [b, n, w, kvh, g] = x.dims();
    if g == 1 {
        let x4 = hooks.apply(point, x.reshape([b, n, w, kvh]))?;
        Ok(x4.reshape([b, n, w, kvh, 1]))
    } else {
        hooks.apply(point, x)
    }
}
