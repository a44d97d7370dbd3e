//! Shared building blocks: linear maps in PyTorch layout, RMSNorm, embeddings, RoPE,
//! SwiGLU, and the masked softmax every attention uses.

use burn::module::{Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use super::host;
use super::stored::StoredWeight;
use super::weights::{Init, Vb};
use crate::error::Result;
use crate::model::flops::Mm;

/// A weight matrix: a trainable f32 parameter (training, random init, f32 checkpoints)
/// or a checkpoint's matrix kept as stored ([`StoredWeight`]: BF16 / FP8 / FP4 bytes in
/// host memory). [`Weight::val`] is the one way to read it.
#[derive(Module, Debug)]
pub enum Weight {
    Dense(Param<Tensor<2>>),
    Stored(StoredWeight),
}

impl From<Param<Tensor<2>>> for Weight {
    fn from(p: Param<Tensor<2>>) -> Self {
        Weight::Dense(p)
    }
}

impl Weight {
    /// Parameter `name` of shape `shape` from `vb`: as stored when the source keeps it so,
    /// else a parameter initialised by `init`.
    pub fn build(vb: &Vb, name: &str, shape: [usize; 2], init: Init) -> Result<Self> {
        Ok(match vb.stored(name, &shape)? {
            Some(s) => Weight::Stored(s),
            None => Weight::Dense(vb.param(name, shape, init)?),
        })
    }

    /// The values `[rows, cols]`: the parameter, or the stored matrix dequantised into a
    /// transient tensor on the weight's device.
    pub fn val(&self) -> Tensor<2> {
        match self {
            Weight::Dense(p) => p.val(),
            Weight::Stored(s) => s.matrix(0),
        }
    }

    /// `x: [n, cols] -> x W^T: [n, rows]`. A stored matrix is dequantised in blocks of
    /// rows within [`super::stored::DEQUANT_BUDGET`] ([`StoredWeight::matmul_t`]), never
    /// whole when larger.
    pub fn matmul_t(&self, x: Tensor<2>) -> Tensor<2> {
        match self {
            Weight::Dense(p) => x.mm(p.val().transpose()),
            Weight::Stored(s) => s.matmul_t(0, x),
        }
    }

    /// Rows `ids` of the matrix (`[ids.len(), cols]`; only those rows are dequantised).
    pub fn rows(&self, ids: Tensor<1, Int>) -> Tensor<2> {
        match self {
            Weight::Dense(p) => p.val().select(0, ids),
            Weight::Stored(s) => {
                let host: Vec<usize> = ids
                    .into_data()
                    .convert::<i64>()
                    .try_into_vec::<i64>()
                    .expect("ids converted to i64")
                    .into_iter()
                    .map(|i| i as usize)
                    .collect();
                s.gather_rows(0, &host)
            }
        }
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Weight::Dense(p) => p.dims(),
            Weight::Stored(s) => s.dims(),
        }
    }

    /// The device the values live on (stored: where they are dequantised to).
    pub fn device(&self) -> Device {
        match self {
            Weight::Dense(p) => p.val().device(),
            Weight::Stored(s) => s.device(),
        }
    }

    /// The stored matrix, when kept as stored.
    pub fn stored(&self) -> Option<&StoredWeight> {
        match self {
            Weight::Dense(_) => None,
            Weight::Stored(s) => Some(s),
        }
    }

    /// The trainable parameter, when dense.
    pub fn dense(&self) -> Option<&Param<Tensor<2>>> {
        match self {
            Weight::Dense(p) => Some(p),
            Weight::Stored(_) => None,
        }
    }
}

/// `y = x W^T (+ b)` with `W` stored `[out, in]` as in PyTorch/safetensors checkpoints.
#[derive(Module, Debug)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Param<Tensor<1>>>,
}

impl Linear {
    /// Build `[out, in]` (no bias) initialised N(0, std^2).
    pub fn new(vb: &Vb, d_in: usize, d_out: usize, std: f64) -> Result<Self> {
        Ok(Linear {
            weight: Weight::build(vb, "weight", [d_out, d_in], Init::Normal(std))?,
            bias: None,
        })
    }

    /// Build with a bias.
    pub fn with_bias(vb: &Vb, d_in: usize, d_out: usize, std: f64) -> Result<Self> {
        Ok(Linear {
            weight: Weight::build(vb, "weight", [d_out, d_in], Init::Normal(std))?,
            bias: Some(vb.param("bias", [d_out], Init::Zeros)?),
        })
    }

    /// Output features.
    pub fn d_out(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Apply to the last axis of `x` (any rank).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let dims = x.dims();
        let d_in = dims[D - 1];
        let n: usize = dims[..D - 1].iter().product();
        let d_out = self.weight.dims()[0];
        let mut y = self.weight.matmul_t(x.reshape([n, d_in]));
        if let Some(b) = &self.bias {
            y = y + b.val().unsqueeze::<2>();
        }
        let mut out = dims;
        out[D - 1] = d_out;
        y.reshape(out)
    }
}

/// Root-mean-square norm over the last axis, with a learned scale.
#[derive(Module, Debug)]
pub struct RmsNorm {
    pub weight: Param<Tensor<1>>,
    #[module(skip)]
    pub eps: f64,
}

impl RmsNorm {
    pub fn new(vb: &Vb, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: vb.param("weight", [dim], Init::Ones)?,
            eps,
        })
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let w = self.weight.val();
        match rms_host(&x, self.eps, Some(&w)) {
            Some(y) => y,
            None => rms_normalize(x, self.eps) * w.unsqueeze::<D>(),
        }
    }
}

/// `x / sqrt(mean(x^2) + eps)` over the last axis (no scale).
pub fn rms_normalize<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
    if let Some(y) = rms_host(&x, eps, None) {
        return y;
    }
    let ms = x.clone().square().mean_dim(D - 1);
    x * (ms + eps).sqrt().recip()
}

/// [`rms_normalize`] times `w` (when given) on flex: one pass per row over every core
/// into one new buffer, in place of the five tensors the expression writes (`x^2`, the
/// mean, its root, `x s` and `x s w`). `(x s) w` is rounded as the expression rounds it;
/// the mean of squares is summed in another order ([`host::inv_rms`]). `None` where
/// [`host::reachable`] does not hold.
fn rms_host<const D: usize>(x: &Tensor<D>, eps: f64, w: Option<&Tensor<1>>) -> Option<Tensor<D>> {
    let d = x.dims()[D - 1];
    let scaled = |w: Option<&[f32]>| {
        host::with_values(x, |xs| {
            host::new_rows(xs.len() / d.max(1), d, |r, row| {
                let src = &xs[r * d..(r + 1) * d];
                let s = host::inv_rms(src, eps);
                match w {
                    Some(w) => row
                        .iter_mut()
                        .zip(src.iter().zip(w))
                        .for_each(|(o, (&e, &g))| *o = e * s * g),
                    None => row.iter_mut().zip(src).for_each(|(o, &e)| *o = e * s),
                }
            })
        })
    };
    let values = match w {
        Some(w) if w.dims()[0] == d => host::with_values(w, |w| scaled(Some(w)))??,
        Some(_) => return None,
        None => scaled(None)?,
    };
    Some(host::tensor_from(values, x.dims(), x))
}

/// Token embedding table `[vocab, d_model]`.
#[derive(Module, Debug)]
pub struct Embedding {
    pub weight: Weight,
}

impl Embedding {
    pub fn new(vb: &Vb, vocab: usize, dim: usize, std: f64) -> Result<Self> {
        Ok(Embedding {
            weight: Weight::build(vb, "weight", [vocab, dim], Init::Normal(std))?,
        })
    }

    /// `[batch, pos]` ids -> `[batch, pos, d_model]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let d = self.weight.dims()[1];
        self.weight.rows(ids.reshape([b * t])).reshape([b, t, d])
    }
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct SwiGlu {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl SwiGlu {
    pub fn new(vb: &Vb, d_model: usize, d_ff: usize, std: f64, out_std: f64) -> Result<Self> {
        Ok(SwiGlu {
            gate: Linear::new(&vb.pp("gate"), d_model, d_ff, std)?,
            up: Linear::new(&vb.pp("up"), d_model, d_ff, std)?,
            down: Linear::new(&vb.pp("down"), d_ff, d_model, out_std)?,
        })
    }

    /// `[..., d_model]` -> `[..., d_model]`, over chunks of at most [`ROW_CHUNK`] rows
    /// (the `d_ff`-wide intermediates then scale with the chunk, not the sequence).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_with(x, Gate::Silu)
    }

    /// [`SwiGlu::forward`] with another gate activation ([`Gate::GeluTanh`]: GeGLU).
    pub fn forward_with<const D: usize>(&self, x: Tensor<D>, act: Gate) -> Tensor<D> {
        let dims = x.dims();
        let d = dims[D - 1];
        let rows: usize = dims[..D - 1].iter().product();
        let flat = row_chunks(x.reshape([rows, d]), |x| {
            self.down
                .forward(act.gated(self.gate.forward(x.clone()), self.up.forward(x)))
        });
        flat.reshape(dims)
    }
}

/// The gate activation of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// `silu(g) = g sigmoid(g)` (SwiGLU).
    Silu,
    /// [`gelu_tanh`] (GeGLU).
    GeluTanh,
}

impl Gate {
    /// The activation of `g`.
    pub fn apply<const D: usize>(self, g: Tensor<D>) -> Tensor<D> {
        match self {
            Gate::Silu => silu(g),
            Gate::GeluTanh => gelu_tanh(g),
        }
    }

    /// `act(g) u`. On flex one pass over every core into one new buffer, with the
    /// vectorised [`host::sigmoid`] (flex calls libm's `expf` per value): the same
    /// products in the same order, within a few ulp of the expression.
    pub fn gated<const D: usize>(self, g: Tensor<D>, u: Tensor<D>) -> Tensor<D> {
        let dims = g.dims();
        let d = dims[D - 1];
        let values = (dims == u.dims())
            .then(|| {
                host::with_values(&g, |gs| {
                    host::with_values(&u, |us| {
                        host::new_rows(gs.len() / d.max(1), d, |r, o| {
                            gated_row(self, &gs[r * d..][..d], &us[r * d..][..d], o)
                        })
                    })
                })
            })
            .flatten()
            .flatten();
        match values {
            Some(v) => host::tensor_from(v, dims, &g),
            None => self.apply(g) * u,
        }
    }

    /// The activation of one value, in the expression's order of operations.
    #[inline(always)]
    fn scalar(self, x: f32) -> f32 {
        match self {
            Gate::Silu => host::silu(x),
            Gate::GeluTanh => {
                let k = (2.0f64 / std::f64::consts::PI).sqrt();
                let inner = (x + x * x * x * 0.044715) * (2.0 * k) as f32;
                x * host::sigmoid(inner)
            }
        }
    }
}

host::multiversion! {
    /// `o = act(g) u` for one row.
    fn gated_row(gate: Gate, g: &[f32], u: &[f32], o: &mut [f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = gate.scalar(g) * u;
        }
    }
}

/// GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`):
/// `0.5 x (1 + tanh(u))` with `u = sqrt(2 / pi) (x + 0.044715 x^3)`, computed as the
/// equal `x sigmoid(2 u)`, and `x^3` as `x x x` (as PyTorch computes a cube): flex's
/// `tanh` and `powi_scalar(3)` are scalar libm calls (`tanhf`, `powf`), which took a
/// quarter of Gemma 3's forward at 512 tokens; `sigmoid` is one `expf` per value and the
/// products are vectorised. The two forms differ by float rounding (~1e-7 relative).
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let k = (2.0f64 / std::f64::consts::PI).sqrt();
    let cube = x.clone() * x.clone() * x.clone();
    let inner = (x.clone() + cube * 0.044715) * (2.0 * k);
    x * burn::tensor::activation::sigmoid(inner)
}

/// Rows per chunk of position-wise work on long inputs.
pub const ROW_CHUNK: usize = 8192;

/// `f` applied to `x: [rows, d]` in chunks of at most [`ROW_CHUNK`] rows, concatenated
/// (one call when it fits). For row-wise `f` only: the result equals `f(x)`.
pub fn row_chunks(x: Tensor<2>, f: impl Fn(Tensor<2>) -> Tensor<2>) -> Tensor<2> {
    let rows = x.dims()[0];
    if rows <= ROW_CHUNK {
        return f(x);
    }
    let parts: Vec<Tensor<2>> = (0..rows)
        .step_by(ROW_CHUNK)
        .map(|r0| f(x.clone().slice_dim(0, r0..(r0 + ROW_CHUNK).min(rows))))
        .collect();
    Tensor::cat(parts, 0)
}

/// Parts along dimension 1 (blocks of positions, groups of heads), in order -> one
/// tensor; a single part passes through without a copy.
pub fn cat_dim1<const D: usize>(mut parts: Vec<Tensor<D>>) -> Tensor<D> {
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        super::host::cat(&parts, 1).unwrap_or_else(|| Tensor::cat(parts, 1))
    }
}

/// How rotary dims are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(i, i + r/2)` (GPT-NeoX / Llama in transformers).
    HalfSplit,
    /// Pairs `(2i, 2i + 1)` (the original complex-number formulation).
    Interleaved,
}

/// Rotary embedding tables for a set of positions.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `[n_pos, rot_dims / 2]`
    pub cos: Tensor<2>,
    /// `[n_pos, rot_dims / 2]`
    pub sin: Tensor<2>,
}

impl RopeTables {
    /// The tables of the positions `range` of these (rows of `cos` and `sin`).
    pub fn rows(&self, range: std::ops::Range<usize>) -> Self {
        RopeTables {
            cos: self.cos.clone().slice_dim(0, range.clone()),
            sin: self.sin.clone().slice_dim(0, range),
        }
    }

    /// Tables for `positions` with per-pair inverse frequencies `inv_freq`
    /// (`theta^(-2i/r)` for plain RoPE; YaRN-adjusted by callers that need it) and an
    /// optional attention scaling factor multiplied into cos and sin.
    pub fn new(positions: &[usize], inv_freq: &[f64], mscale: f64, device: &Device) -> Self {
        let half = inv_freq.len();
        let mut c = Vec::with_capacity(positions.len() * half);
        let mut s = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in inv_freq {
                let a = p as f64 * f;
                c.push((a.cos() * mscale) as f32);
                s.push((a.sin() * mscale) as f32);
            }
        }
        let n = positions.len();
        RopeTables {
            cos: Tensor::from_data(TensorData::new(c, [n, half]), device),
            sin: Tensor::from_data(TensorData::new(s, [n, half]), device),
        }
    }
}

/// Standard RoPE inverse frequencies `theta^(-2i/r)`, `i < r/2`.
pub fn rope_inv_freq(rot_dims: usize, theta: f64) -> Vec<f64> {
    (0..rot_dims / 2)
        .map(|i| theta.powf(-(2.0 * i as f64) / rot_dims as f64))
        .collect()
}

/// Rotate the first `2 * tables.cos.dims()[1]` dims of `x: [batch, pos, heads, d]`
/// (positions given by the tables' rows); the remaining dims pass through. `inverse`
/// rotates by the negative angle. The tables hold one row per position, shared by the
/// batch (`pos` rows), or one row per (batch row, position), row-major (`batch * pos`
/// rows: rows whose tokens sit at different positions, as in suffix forwards).
pub fn apply_rope(x: Tensor<4>, t: &RopeTables, layout: RopeLayout, inverse: bool) -> Tensor<4> {
    apply_rope_range(x, t, layout, inverse, 0)
}

/// As [`apply_rope`], rotating dims `start .. start + rot` and passing the rest.
pub fn apply_rope_range(
    x: Tensor<4>,
    t: &RopeTables,
    layout: RopeLayout,
    inverse: bool,
    start: usize,
) -> Tensor<4> {
    let [b, n, h, d] = x.dims();
    let half = t.cos.dims()[1];
    let rot = 2 * half;
    if rot == 0 {
        return x;
    }
    if host::reachable(&x) && host::reachable(&t.cos) && host::reachable(&t.sin) {
        return rope_host(x, t, layout, inverse, start);
    }
    let tb = if t.cos.dims()[0] == n { 1 } else { b };
    let cos = t.cos.clone().reshape([tb, n, 1, half]);
    let sin = if inverse {
        t.sin.clone().neg()
    } else {
        t.sin.clone()
    };
    let sin = sin.reshape([tb, n, 1, half]);
    let xr = x.clone().slice_dim(3, start..start + rot);
    let (x1, x2) = match layout {
        RopeLayout::HalfSplit => (xr.clone().slice_dim(3, 0..half), xr.slice_dim(3, half..rot)),
        RopeLayout::Interleaved => {
            let pairs = xr.reshape([b, n, h, half, 2]);
            (
                pairs.clone().slice_dim(4, 0..1).reshape([b, n, h, half]),
                pairs.slice_dim(4, 1..2).reshape([b, n, h, half]),
            )
        }
    };
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x2 * cos + x1 * sin;
    let rotated = match layout {
        RopeLayout::HalfSplit => Tensor::cat(vec![r1, r2], 3),
        RopeLayout::Interleaved => Tensor::stack::<5>(vec![r1, r2], 4).reshape([b, n, h, rot]),
    };
    let mut parts = Vec::with_capacity(3);
    if start > 0 {
        parts.push(x.clone().slice_dim(3, 0..start));
    }
    parts.push(rotated);
    if start + rot < d {
        parts.push(x.slice_dim(3, start + rot..d));
    }
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Tensor::cat(parts, 3)
    }
}

/// [`apply_rope_range`] on flex: each head's rotated dims are replaced in place (the
/// other dims are not touched or copied), positions over every core. The same products
/// and sums as the tensor expression, so the same values.
fn rope_host(
    x: Tensor<4>,
    t: &RopeTables,
    layout: RopeLayout,
    inverse: bool,
    start: usize,
) -> Tensor<4> {
    let [_, n, h, d] = x.dims();
    let half = t.cos.dims()[1];
    let per_batch_row = t.cos.dims()[0] != n;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    let rotated = host::with_values(&t.cos, |cos| {
        host::with_values(&t.sin, |sin| {
            host::update(x, |xs| {
                host::par_rows(xs, h * d, |row, pos| {
                    // Row `b * n + p` of the batch; the tables' row is `p` or that.
                    let tr = if per_batch_row { row } else { row % n };
                    let c = &cos[tr * half..(tr + 1) * half];
                    let s = &sin[tr * half..(tr + 1) * half];
                    for head in pos.chunks_mut(d) {
                        rotate(&mut head[start..start + 2 * half], c, s, sign, layout);
                    }
                });
            })
        })
    });
    rotated
        .flatten()
        .expect("reachable tables lend their values")
}

/// Rotates the pairs of `v` (`2 * half` values) by the angles of `cos` / `sin` (`sign`
/// -1: the negative angles): `(x1 c - x2 s, x2 c + x1 s)`.
fn rotate(v: &mut [f32], cos: &[f32], sin: &[f32], sign: f32, layout: RopeLayout) {
    let half = cos.len();
    match layout {
        RopeLayout::HalfSplit => {
            let (a, b) = v.split_at_mut(half);
            for i in 0..half {
                let (x1, x2, c, s) = (a[i], b[i], cos[i], sign * sin[i]);
                a[i] = x1 * c - x2 * s;
                b[i] = x2 * c + x1 * s;
            }
        }
        RopeLayout::Interleaved => {
            for (i, p) in v.chunks_exact_mut(2).enumerate() {
                let (x1, x2, c, s) = (p[0], p[1], cos[i], sign * sin[i]);
                p[0] = x1 * c - x2 * s;
                p[1] = x2 * c + x1 * s;
            }
        }
    }
}

/// Softmax over the last axis restricted to `mask` (true = visible). Rows with nothing
/// visible give all zeros instead of NaN.
pub fn masked_softmax<const D: usize>(scores: Tensor<D>, mask: Tensor<D, Bool>) -> Tensor<D> {
    // Hidden slots become exp(-1e30 - max) = 0 exactly wherever a row sees anything;
    // rows that see nothing are zeroed by their (one-column) row mask.
    let seen = mask.clone().any_dim(D - 1).float();
    let masked = scores.mask_fill(mask.bool_not(), -1.0e30);
    let max = masked.clone().max_dim(D - 1).detach();
    let e = (masked - max).exp() * seen;
    let denom = e.clone().sum_dim(D - 1).clamp_min(1e-30);
    e / denom
}

/// An index tensor from host values.
pub fn int_tensor(values: &[usize], device: &Device) -> Tensor<1, Int> {
    Tensor::from_data(
        TensorData::new(
            values.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            [values.len()],
        ),
        device,
    )
}

#[cfg(all(test, feature = "flex"))]
mod tests {

    /// RoPE on flex (in place, over the pool) gives the tensor expression bit for bit
    /// (computed on the autodiff device, where the kernel declines): both layouts, the
    /// inverse, a rotated range inside the head, tables per position and per (batch row,
    /// position), and a strided input; a shared input is left as it was.
    #[cfg(feature = "flex")]
    /// Every value of `got` within `1e-6 |want| + abs` of `want`'s, NaN where it is NaN.
    fn assert_close<const D: usize>(got: Tensor<D>, want: Tensor<D>, abs: f32, what: &str) {
        assert_eq!(got.dims(), want.dims(), "{what}");
        let got = got.into_data().try_into_vec::<f32>().unwrap();
        let want = want.into_data().try_into_vec::<f32>().unwrap();
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            let close = g == e || (g - e).abs() <= 1e-6 * e.abs() + abs;
            assert!(
                close || (g.is_nan() && e.is_nan()),
                "{what} value {i}: {g} against {e}"
            );
        }
    }

    /// The gated activations on flex against the tensor expressions (on the autodiff
    /// device, where the kernel declines), over values from -1e4 to 1e4 with NaN and the
    /// infinities; a strided gate.
    #[test]
    fn gated_activations_on_flex_give_the_tensor_expressions() {
        use burn::tensor::Distribution;
        let (dev, ad) = (Device::flex(), Device::flex().autodiff());
        let mut v: Vec<f32> = (-400..400).map(|i| i as f32 * 0.05).collect();
        v.extend([
            1e4,
            -1e4,
            100.0,
            -100.0,
            88.0,
            -88.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
        ]);
        v.resize(810, 0.5);
        let g = Tensor::<2>::from_data(TensorData::new(v, [10, 81]), &dev);
        let gs = Tensor::<2>::random([81, 10], Distribution::Normal(0.0, 3.0), &dev).transpose();
        let u = Tensor::<2>::random([10, 81], Distribution::Normal(0.0, 2.0), &dev);
        for gate in [Gate::Silu, Gate::GeluTanh] {
            for g in [&g, &gs] {
                let got = gate.gated(g.clone(), u.clone());
                let want = gate.gated(
                    Tensor::<2>::from_data(g.to_data(), &ad),
                    Tensor::from_data(u.to_data(), &ad),
                );
                assert_close(got, want, 0.0, &format!("{gate:?}"));
            }
        }
    }

    #[test]
    fn rms_norm_on_flex_gives_the_tensor_expression() {
        use burn::tensor::Distribution;
        let (dev, ad) = (Device::flex(), Device::flex().autodiff());
        let x = Tensor::<3>::random([2, 37, 50], Distribution::Normal(0.0, 3.0), &dev);
        // A strided input, a row of zeros, a NaN and an infinity in rows of their own.
        let xs = Tensor::<3>::random([2, 50, 37], Distribution::Normal(0.0, 1.0), &dev)
            .swap_dims(1, 2)
            .slice_assign([0..1, 0..1, 0..50], Tensor::zeros([1, 1, 50], &dev))
            .slice_assign([0..1, 1..2, 3..4], Tensor::full([1, 1, 1], f32::NAN, &dev))
            .slice_assign(
                [1..2, 0..1, 7..8],
                Tensor::full([1, 1, 1], f32::INFINITY, &dev),
            );
        let w = Tensor::<1>::random([50], Distribution::Normal(1.0, 0.5), &dev);
        let norm = |dev: &Device| RmsNorm {
            weight: Param::from_tensor(Tensor::from_data(w.to_data(), dev)),
            eps: 1e-6,
        };
        for input in [&x, &xs] {
            let on_ad = Tensor::<3>::from_data(input.to_data(), &ad);
            let pairs = [
                (
                    norm(&dev).forward(input.clone()),
                    norm(&ad).forward(on_ad.clone()),
                ),
                (
                    rms_normalize(input.clone(), 1e-6),
                    rms_normalize(on_ad, 1e-6),
                ),
            ];
            for (got, want) in pairs {
                assert_close(got, want, 1e-6, "rms");
            }
        }
    }

    #[test]
    fn rope_on_flex_gives_the_tensor_expression_bit_for_bit() {
        use burn::tensor::Distribution;
        let (dev, ad) = (Device::flex(), Device::flex().autodiff());
        let (b, n, h, d) = (2, 37, 3, 20);
        let inv = rope_inv_freq(8, 10000.0);
        let shared: Vec<usize> = (5..5 + n).collect();
        let per_row: Vec<usize> = (0..b * n).map(|i| 3 * i + 1).collect();
        let x = Tensor::<4>::random([b, n, h, d], Distribution::Normal(0.0, 1.0), &dev);
        let xs =
            Tensor::<4>::random([b, h, n, d], Distribution::Normal(0.0, 1.0), &dev).swap_dims(1, 2);
        for positions in [&shared, &per_row] {
            let (tf, ta) = (
                RopeTables::new(positions, &inv, 0.9, &dev),
                RopeTables::new(positions, &inv, 0.9, &ad),
            );
            for layout in [RopeLayout::HalfSplit, RopeLayout::Interleaved] {
                for (inverse, start) in [(false, 0), (true, 0), (false, 12), (true, 5)] {
                    for input in [&x, &xs] {
                        let before = input.to_data();
                        let got = apply_rope_range(input.clone(), &tf, layout, inverse, start);
                        let on_ad = Tensor::<4>::from_data(input.to_data(), &ad);
                        let want = apply_rope_range(on_ad, &ta, layout, inverse, start);
                        assert_eq!(
                            got.to_data(),
                            want.to_data(),
                            "{layout:?} {inverse} {start}"
                        );
                        assert_eq!(input.to_data(), before);
                    }
                }
            }
        }
    }
    use super::*;

    /// `gelu_tanh` is PyTorch's `0.5 x (1 + tanh(u))`, computed here in f64, to float
    /// rounding over the values activations take and beyond (no NaN where `x^3`
    /// overflows).
    #[test]
    fn gelu_tanh_is_the_tanh_form() {
        let xs: Vec<f32> = vec![
            -1e20, -1e4, -100.0, -10.0, -5.0, -3.0, -1.5, -1.0, -0.5, -1e-3, -1e-8, 0.0, 1e-8,
            1e-3, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0, 1e4, 1e20,
        ];
        let dev = Device::flex();
        let t = Tensor::<1>::from_data(TensorData::new(xs.clone(), [xs.len()]), &dev);
        let got: Vec<f32> = gelu_tanh(t).into_data().try_to_vec::<f32>().unwrap();
        let k = (2.0f64 / std::f64::consts::PI).sqrt();
        for (&x, &g) in xs.iter().zip(&got) {
            let x = x as f64;
            let want = 0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh());
            let want = if want.is_nan() {
                if x > 0.0 { x } else { 0.0 }
            } else {
                want
            };
            let err = (g as f64 - want).abs();
            assert!(
                g.is_finite() && err <= 1e-6 * want.abs() + 1e-7,
                "gelu_tanh({x}) = {g}, want {want}"
            );
        }
    }
}
