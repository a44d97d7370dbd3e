//! Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` parallel
//! streams `X: [b, t, N, d]`. Around each sublayer, weights computed from the
//! RMS-normalised flattened streams collapse the streams into the sublayer input
//! (`pre`), expand the output back (`post`) and mix the streams (`comb`, projected onto
//! doubly-stochastic matrices by Sinkhorn-Knopp):
//!
//! `input = sum_n pre[n] X[n]`, `X'[k] = post[k] * output + sum_j comb[j, k] X[j]`.
//!
//! The final [`HyperHead`] collapses the streams once more (sigmoid weights, no
//! Sinkhorn) before the last norm.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::activation::{sigmoid, softmax};

use crate::error::Result;
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::layers::rms_normalize;
use crate::model::weights::{Init, Vb};

/// Which sublayer a hyper-connection serves (selects the hook sites).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sublayer {
    Attention,
    Mlp,
}

/// One hyper-connection (`attn_hc` or `ffn_hc`).
#[derive(Module, Debug)]
pub struct HyperConnection {
    /// `fn`: `[(2 + N) * N, N * d]`, rows = pre (N), post (N), comb (N * N, row-major [j, k]).
    pub fn_weight: Param<Tensor<2>>,
    /// `base`: `[(2 + N) * N]`.
    pub base: Param<Tensor<1>>,
    /// `scale`: `[3]` = (pre, post, comb).
    pub scale: Param<Tensor<1>>,
    #[module(skip)]
    pub n: usize,
    #[module(skip)]
    pub iters: usize,
    #[module(skip)]
    pub hc_eps: f64,
    #[module(skip)]
    pub norm_eps: f64,
}

/// The `post` and `comb` weights of one hyper-connection, and the collapsed input.
pub struct HcOut {
    /// `[b, t, N]`
    pub post: Tensor<3>,
    /// `[b, t, N, N]`, `[from j, to k]`
    pub comb: Tensor<4>,
    /// `[b, t, d]`
    pub collapsed: Tensor<3>,
}

impl HyperConnection {
    pub fn new(
        vb: &Vb,
        d_model: usize,
        n: usize,
        iters: usize,
        hc_eps: f64,
        norm_eps: f64,
    ) -> Result<Self> {
        let m = (2 + n) * n;
        Ok(HyperConnection {
            fn_weight: vb.param(
                "fn",
                [m, n * d_model],
                Init::Normal(1.0 / ((n * d_model) as f64).sqrt()),
            )?,
            base: vb.param("base", [m], Init::Zeros)?,
            scale: vb.param("scale", [3], Init::Ones)?,
            n,
            iters,
            hc_eps,
            norm_eps,
        })
    }

    /// Compute the weights from the streams `x: [b, t, N, d]` and collapse them.
    pub fn forward(
        &self,
        layer: usize,
        which: Sublayer,
        x: &Tensor<4>,
        hooks: &mut HookRun,
    ) -> Result<HcOut> {
        let [b, t, n, d] = x.dims();
        let bt = b * t;
        let flat = rms_normalize(x.clone().reshape([bt, n * d]), self.norm_eps);
        let mix = flat.matmul(self.fn_weight.val().transpose()); // [bt, (2+N)N]
        let base = self.base.val();
        let scale = self.scale.val();
        let s = |i: usize| scale.clone().slice_dim(0, i..i + 1).reshape([1, 1]);
        let pre = sigmoid(
            mix.clone().slice_dim(1, 0..n) * s(0) + base.clone().slice_dim(0, 0..n).reshape([1, n]),
        ) + self.hc_eps;
        let post = sigmoid(
            mix.clone().slice_dim(1, n..2 * n) * s(1)
                + base.clone().slice_dim(0, n..2 * n).reshape([1, n]),
        ) * 2.0;
        let logits = mix.slice_dim(1, 2 * n..(2 + n) * n).reshape([bt, n, n])
            * s(2).reshape([1, 1, 1])
            + base.slice_dim(0, 2 * n..(2 + n) * n).reshape([1, n, n]);
        let comb = sinkhorn(softmax(logits, 2) + self.hc_eps, self.iters, self.hc_eps);

        let (ps, qs, cs) = match which {
            Sublayer::Attention => (Site::HcPre, Site::HcPost, Site::HcComb),
            Sublayer::Mlp => (Site::MlpHcPre, Site::MlpHcPost, Site::MlpHcComb),
        };
        let pre = hooks.apply(HookPoint::block(layer, ps), pre.reshape([b, t, n]))?;
        let post = hooks.apply(HookPoint::block(layer, qs), post.reshape([b, t, n]))?;
        let comb = hooks.apply(HookPoint::block(layer, cs), comb.reshape([b, t, n, n]))?;
        let collapsed = (pre.reshape([b, t, n, 1]) * x.clone())
            .sum_dim(2)
            .reshape([b, t, d]);
        Ok(HcOut {
            post,
            comb,
            collapsed,
        })
    }
}

/// Sinkhorn-Knopp as in the reference: one column normalisation, then `iters - 1`
/// (row, column) rounds; `m: [bt, N, N]` indexed `[j, k]`.
fn sinkhorn(m: Tensor<3>, iters: usize, eps: f64) -> Tensor<3> {
    let col = |m: Tensor<3>| m.clone() / (m.sum_dim(1) + eps);
    let row = |m: Tensor<3>| m.clone() / (m.sum_dim(2) + eps);
    let mut m = col(m);
    for _ in 1..iters {
        m = col(row(m));
    }
    m
}

/// `X'[k] = post[k] * out + sum_j comb[j, k] X[j]`.
pub fn expand(x: Tensor<4>, out: Tensor<3>, hc: &HcOut) -> Tensor<4> {
    let [b, t, n, d] = x.dims();
    let mixed = hc
        .comb
        .clone()
        .reshape([b * t, n, n])
        .swap_dims(1, 2)
        .matmul(x.reshape([b * t, n, d]))
        .reshape([b, t, n, d]);
    hc.post.clone().reshape([b, t, n, 1]) * out.reshape([b, t, 1, d]) + mixed
}

/// The final collapse of the streams (`hc_head`).
#[derive(Module, Debug)]
pub struct HyperHead {
    /// `[N, N * d]`
    pub hc_fn: Param<Tensor<2>>,
    /// `[N]`
    pub hc_base: Param<Tensor<1>>,
    /// `[1]`
    pub hc_scale: Param<Tensor<1>>,
    #[module(skip)]
    pub hc_eps: f64,
    #[module(skip)]
    pub norm_eps: f64,
}

impl HyperHead {
    pub fn new(vb: &Vb, d_model: usize, n: usize, hc_eps: f64, norm_eps: f64) -> Result<Self> {
        Ok(HyperHead {
            hc_fn: vb.param(
                "hc_fn",
                [n, n * d_model],
                Init::Normal(1.0 / ((n * d_model) as f64).sqrt()),
            )?,
            hc_base: vb.param("hc_base", [n], Init::Zeros)?,
            hc_scale: vb.param("hc_scale", [1], Init::Ones)?,
            hc_eps,
            norm_eps,
        })
    }

    /// `[b, t, N, d]` -> `[b, t, d]`.
    pub fn forward(&self, x: Tensor<4>, hooks: &mut HookRun) -> Result<Tensor<3>> {
        let [b, t, n, d] = x.dims();
        let flat = rms_normalize(x.clone().reshape([b * t, n * d]), self.norm_eps);
        let mix = flat.matmul(self.hc_fn.val().transpose());
        let pre =
            sigmoid(mix * self.hc_scale.val().reshape([1, 1]) + self.hc_base.val().reshape([1, n]))
                + self.hc_eps;
        let pre = hooks.apply(HookPoint::global(Site::HcHeadPre), pre.reshape([b, t, n]))?;
        Ok((pre.reshape([b, t, n, 1]) * x)
            .sum_dim(2)
            .reshape([b, t, d]))
    }
}
