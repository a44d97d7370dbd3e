//! The kvc compressor: softmax-gated pooling of each window's per-token keys (and,
//! separately, values) into one entry per KV head, with an optional learned per-offset
//! gate bias (`scalar` gates: one weight per token and KV head; `vector`: per channel;
//! `uniform`: the mean).

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::{Tensor, TensorData};

use super::config::{CompressionConfig, GateMode};
use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::attention::select_positions;
use crate::model::layers::Linear;
use crate::model::layers::int_tensor;
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

/// The compressors of every layer of a model, as one module: the parameter names of a
/// trained compressor's `compressor.safetensors` (`blocks.{l}.key_gate.weight`, ...).
#[derive(Module, Debug)]
pub struct CompressorStack {
    /// One per layer.
    pub layers: Vec<Compressor>,
}

impl CompressorStack {
    /// `n_layers` compressors of `cc` for layers of width `d_model` with `kv_heads`
    /// heads of width `d_head`, read from `vb` (gate weights drawn with std 0: zeros).
    pub fn new(
        vb: &Vb,
        cc: &CompressionConfig,
        n_layers: usize,
        (d_model, kv_heads, d_head): (usize, usize, usize),
    ) -> Result<Self> {
        let layers = (0..n_layers)
            .map(|l| Compressor::new(&vb.pp("blocks").pp(l), cc, d_model, kv_heads, d_head, 0.0))
            .collect::<Result<Vec<_>>>()?;
        Ok(CompressorStack { layers })
    }
}

/// The windows of one prompt length: how many entries, and the token index of every
/// (entry, offset), per KV head when the heads' windows are staggered.
pub struct Windows {
    pub n_entries: usize,
    /// `n_entries * W` token positions, entry-major (every head's windows start at 0).
    idx: Vec<usize>,
    /// Staggered window boundaries ([`CompressionConfig::window_offsets`]).
    staggered: Option<Staggered>,
}

/// The windows of KV heads whose boundaries differ.
struct Staggered {
    kvh: usize,
    /// Per (entry, offset, KV head), entry-major: the row `position * kvh + head` of
    /// one prompt's `[total * kvh]` (position, head) rows (positions clamped into the
    /// prompt for windows that have not closed).
    rows: Vec<usize>,
    /// Per (entry, KV head): 1 where the head's window lies inside the prompt, else 0.
    closed: Vec<f32>,
}

impl Windows {
    /// Windows of `cc` over prompts of `total` tokens for `kvh` KV heads.
    pub fn new(cc: &CompressionConfig, total: usize, kvh: usize) -> Self {
        let (w, s) = (cc.window, cc.stride);
        let n_entries = if total >= w { (total - w) / s + 1 } else { 0 };
        let idx: Vec<usize> = (0..n_entries)
            .flat_map(|i| (0..w).map(move |o| i * s + o))
            .collect();
        let staggered = cc.staggered().then(|| {
            let mut rows = Vec::with_capacity(n_entries * w * kvh);
            for i in 0..n_entries {
                for o in 0..w {
                    rows.extend(
                        (0..kvh).map(|h| (cc.offset(h) + i * s + o).min(total - 1) * kvh + h),
                    );
                }
            }
            let closed = (0..n_entries)
                .flat_map(|i| {
                    (0..kvh).map(move |h| (cc.offset(h) + i * s + w <= total) as u8 as f32)
                })
                .collect();
            Staggered { kvh, rows, closed }
        });
        Windows {
            n_entries,
            idx,
            staggered,
        }
    }

    /// Per-token `x: [b, total, kvh, c]` -> every window's tokens `[b, n, W, kvh, c]`
    /// (each KV head's own windows when staggered).
    fn gather(&self, x: Tensor<4>) -> Tensor<5> {
        let [b, total, kvh, c] = x.dims();
        let n = self.n_entries;
        let w = self.idx.len() / n;
        let Some(st) = &self.staggered else {
            return select_positions(x, &self.idx).reshape([b, n, w, kvh, c]);
        };
        let rows: Vec<usize> = (0..b)
            .flat_map(|r| st.rows.iter().map(move |&j| r * total * kvh + j))
            .collect();
        let device = x.device();
        x.reshape([b * total * kvh, c])
            .select(0, int_tensor(&rows, &device))
            .reshape([b, n, w, kvh, c])
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
        let w = windows.idx.len() / n;
        let device = x.device();
        let xw = windows.gather(x);
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
            None => Tensor::full([b, n, w, kvh, 1], 1.0 / w as f32, &device),
            Some(s) => {
                let mut s = windows.gather(s);
                if let Some(bias) = bias {
                    s = s + bias.val().reshape([1, 1, w, kvh, 1]);
                }
                let s = hook_gates(hooks, HookPoint::block(layer, logit_site), s)?;
                softmax(s, 2)
            }
        };
        let weights = hook_gates(hooks, HookPoint::block(layer, site), weights)?;
        let pooled = (weights * xw).sum_dim(2).reshape([b, n, kvh, dh]);
        Ok(match &windows.staggered {
            // A head's slot whose window has not closed holds a zero entry.
            Some(st) => {
                let closed = TensorData::new(st.closed.clone(), [1, n, st.kvh, 1]);
                pooled * Tensor::from_data(closed, &device)
            }
            None => pooled,
        })
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
