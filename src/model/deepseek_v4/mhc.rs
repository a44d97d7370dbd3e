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
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Tensor, TensorData};

use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::flops::Mm;
use crate::model::host;
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

    /// The raw mixing logits `rms_normalize(flat X) fn^T` (`[b t, (2 + N) N]`) of the
    /// streams `x: [b, t, N, d]`.
    fn mix(&self, x: &Tensor<4>) -> Tensor<2> {
        let [b, t, n, d] = x.dims();
        normalized_mm(
            x.clone().reshape([b * t, n * d]),
            self.fn_weight.val().transpose(),
            self.norm_eps,
        )
    }

    /// The pre (`[bt, N]`), post (`[bt, N]`) and comb (`[bt, N, N]`, `[from j, to k]`)
    /// weights from the raw mixing logits `mix: [bt, (2 + N) N]`.
    fn weights(&self, mix: Tensor<2>) -> (Tensor<2>, Tensor<2>, Tensor<3>) {
        let n = self.n;
        let [bt, _] = mix.dims();
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
        (pre, post, comb)
    }

    /// Compute the weights from the streams `x: [b, t, N, d]` and collapse them.
    pub fn forward(
        &self,
        layer: usize,
        which: Sublayer,
        x: &Tensor<4>,
        hooks: &mut HookRun,
    ) -> Result<HcOut> {
        let [b, t, n, _] = x.dims();
        let mix = self.mix(x);
        let (pre, post, comb) = self.weights(mix);
        let (ps, qs, cs) = match which {
            Sublayer::Attention => (Site::HcPre, Site::HcPost, Site::HcComb),
            Sublayer::Mlp => (Site::MlpHcPre, Site::MlpHcPost, Site::MlpHcComb),
        };
        let pre = hooks.apply(HookPoint::block(layer, ps), pre.reshape([b, t, n]))?;
        let post = hooks.apply(HookPoint::block(layer, qs), post.reshape([b, t, n]))?;
        let comb = hooks.apply(HookPoint::block(layer, cs), comb.reshape([b, t, n, n]))?;
        let collapsed = collapse(pre, x);
        Ok(HcOut {
            post,
            comb,
            collapsed,
        })
    }

    /// The stream update `X' = post * out + comb^T X` around the sublayer output `out:
    /// [b, t, d]`, linearised at the streams `x: [b, t, N, d]`: returns `X'` and the
    /// [`HcLinear`] that applies its transposed Jacobian (with respect to `X`, the
    /// weights included, and to `out`) to any number of adjoints.
    pub fn linearize(&self, x: &Tensor<4>, out: Tensor<3>) -> Result<(Tensor<4>, HcLinear)> {
        let [b, t, n, d] = x.dims();
        let bt = b * t;
        let mix = self.mix(x);
        let (_, post, comb) = self.weights(mix.clone());
        let jac = self.mix_jacobian(&mix)?;
        let post = post.reshape([b, t, n]);
        let comb = comb.reshape([b, t, n, n]);
        let next = mix_streams(x.clone(), out.clone(), post.clone(), comb.clone());
        let (m, nd) = (n + n * n, n * d);
        let xf = x.clone().reshape([bt, nd]);
        // The weights' share of dL/dX, per token: K (W dL/dX'), where W [m, N d] reads
        // the post / comb adjoints off dL/dX' (row k: `out` in block k; row (j, k):
        // X[j] in block k) and K [N d, m] = U J^T carries them back: J^T through the
        // sigmoid / softmax / Sinkhorn, U = s P - s^3 / D x (x^T P) through `fn`'s rows
        // P = fn^T [N d, m] and rms_normalize (x s, s = (mean(x^2) + eps)^(-1/2)).
        let s = (xf.clone().square().mean_dim(1) + self.norm_eps)
            .sqrt()
            .recip()
            .reshape([bt, 1, 1]);
        let p = self
            .fn_weight
            .val()
            .slice_dim(0, n..(2 + n) * n)
            .transpose()
            .reshape([1, nd, m]);
        let xp = xf
            .clone()
            .mm(p.clone().reshape([nd, m]))
            .reshape([bt, 1, m]);
        let u = s.clone() * p
            - (s.clone() * s.clone() * s / nd as f64) * xf.clone().reshape([bt, nd, 1]) * xp;
        let k = u.mm(jac.swap_dims(1, 2));
        let out2 = out.reshape([bt, 1, d]);
        let x3 = x.clone().reshape([bt, n, 1, d]);
        let mut rows = Vec::with_capacity(m);
        for r in 0..m {
            // Row r of W: block `blk` holds `src` (out, or X[j]), the others zero.
            let (blk, src) = if r < n {
                (r, out2.clone())
            } else {
                let (j, kk) = ((r - n) / n, (r - n) % n);
                (kk, x3.clone().slice_dim(1, j..j + 1).reshape([bt, 1, d]))
            };
            let mut parts = Vec::with_capacity(n);
            for b_ in 0..n {
                parts.push(if b_ == blk {
                    src.clone()
                } else {
                    src.zeros_like()
                });
            }
            rows.push(Tensor::cat(parts, 2));
        }
        let w = Tensor::cat(rows, 1);
        Ok((
            next,
            HcLinear {
                n,
                d,
                t,
                post: post.reshape([bt, 1, n]),
                comb: comb.reshape([bt, n, n]),
                w,
                k,
            },
        ))
    }

    /// Per token, the Jacobian of the post and comb weights (`m = N + N^2` values, comb
    /// row-major `[j, k]`) with respect to their raw mixing logits (`mix` columns `N..`):
    /// `[bt, m (weight), m (logit)]`, by one backward over `m` copies of the logits
    /// (copy q differentiates weight q; the weights are per token, so every token's row
    /// comes from the same backward).
    fn mix_jacobian(&self, mix: &Tensor<2>) -> Result<Tensor<3>> {
        let n = self.n;
        let m = n + n * n;
        let [bt, width] = mix.dims();
        let ad = mix.device().autodiff();
        let leaf = Tensor::<3>::zeros([m, bt, width], &ad).require_grad();
        let rep = mix.clone().reshape([1, bt, width]).repeat_dim(0, m) + leaf.clone();
        let (_, post, comb) = self.weights(rep.reshape([m * bt, width]));
        let w = Tensor::cat(vec![post, comb.reshape([m * bt, n * n])], 1).reshape([m, bt, m]);
        let eye: Vec<f32> = (0..m * m)
            .map(|i| if i / m == i % m { 1.0 } else { 0.0 })
            .collect();
        let eye = Tensor::<3>::from_data(TensorData::new(eye, [m, 1, m]), &ad);
        let grads = (w * eye).sum().backward();
        let g = leaf.grad(&grads).ok_or_else(|| {
            Error::Other("no gradient reached the hyper-connection's mixing logits".into())
        })?;
        Ok(g.slice_dim(2, n..width).swap_dims(0, 1))
    }
}

/// One hyper-connection's stream update linearised at its streams (see
/// [`HyperConnection::linearize`]): per token, the post / comb weights and the two
/// matrices of the weights' share of the derivative; [`HcLinear::back`] applies the
/// transposed Jacobian as per-token matrix products, for any number of adjoints at once.
pub struct HcLinear {
    n: usize,
    d: usize,
    t: usize,
    /// `[bt, 1, N]`
    post: Tensor<3>,
    /// `[bt, N, N]`, `[from j, to k]`
    comb: Tensor<3>,
    /// `[bt, m, N d]` (m = N + N^2): the post and comb adjoints `<dL/dX'[k], out>`,
    /// `<X[j], dL/dX'[k]>` as a linear map of `dL/dX'`.
    w: Tensor<3>,
    /// `[bt, N d, m]`: from the post / comb adjoints to `dL/dX` (through the weights'
    /// Jacobian in the mixing logits, `fn` and the RMS normalisation).
    k: Tensor<3>,
}

impl HcLinear {
    /// `adj = dL/dX'` for `c` blocks of the linearised batch's rows (`[c b, t, N d]`) ->
    /// (`dL/dX` `[c b, t, N d]`, `dL/d out` `[c b, t, d]`): the direct mixing
    /// `comb^T X`, the output's expansion `post * out` and the weights' dependence on
    /// `X`, as batched per-token matrix products with the `c` blocks as columns.
    pub fn back(&self, adj: Tensor<3>) -> Result<(Tensor<3>, Tensor<3>)> {
        let (n, d, t) = (self.n, self.d, self.t);
        let [bt, _, _] = self.comb.dims();
        let [rows, ta, w] = adj.dims();
        let b = bt / t;
        if ta != t || w != n * d || b == 0 || !rows.is_multiple_of(b) {
            return Err(Error::Input(format!(
                "an mHC adjoint of shape [{rows}, {ta}, {w}]: expected [c x {b}, {t}, {}]",
                n * d
            )));
        }
        let c = rows / b;
        // [c, bt, N d] -> [bt, N d, c]: per token, one column per block.
        let a = adj.reshape([c, bt, n * d]).permute([1, 2, 0]);
        let weights = self.k.clone().mm(self.w.clone().mm(a.clone()));
        let a = a.reshape([bt, n, d * c]);
        let direct = self.comb.clone().mm(a.clone()).reshape([bt, n * d, c]);
        let g_out = self
            .post
            .clone()
            .mm(a)
            .reshape([bt, d, c])
            .permute([2, 0, 1])
            .reshape([rows, t, d]);
        let prev = (direct + weights)
            .permute([2, 0, 1])
            .reshape([rows, t, n * d]);
        Ok((prev, g_out))
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
    mix_streams(x, out, hc.post.clone(), hc.comb.clone())
}

/// [`expand`] with the weights given: `post: [b, t, N]`, `comb: [b, t, N, N]`.
pub fn mix_streams(x: Tensor<4>, out: Tensor<3>, post: Tensor<3>, comb: Tensor<4>) -> Tensor<4> {
    let reachable = host::reachable(&x)
        && host::reachable(&out)
        && host::reachable(&post)
        && host::reachable(&comb);
    if reachable {
        return mix_streams_host(x, &out, &post, &comb);
    }
    let [b, t, n, d] = x.dims();
    let mixed = comb
        .reshape([b * t, n, n])
        .swap_dims(1, 2)
        .mm(x.reshape([b * t, n, d]))
        .reshape([b, t, n, d]);
    post.reshape([b, t, n, 1]) * out.reshape([b, t, 1, d]) + mixed
}

/// `rms_normalize(x) w` for `x: [rows, k]`, `w: [k, m]`, computed as `s (x w)` with
/// `s = (mean(x^2) + eps)^(-1/2)` per row: the normalised copy of `x` (`4 x d_model`
/// values per position) is never written. On flex the row scales are one pass over `x`
/// on every core; elsewhere tensor operations.
fn normalized_mm(x: Tensor<2>, w: Tensor<2>, eps: f64) -> Tensor<2> {
    let [rows, k] = x.dims();
    let scales = host::with_values(&x, |v| {
        host::new_rows(rows, 1, |r, si| {
            si[0] = host::inv_rms(&v[r * k..(r + 1) * k], eps)
        })
    });
    match scales {
        Some(s) => {
            let s = host::tensor_from(s, [rows, 1], &x);
            x.mm(w) * s
        }
        None => rms_normalize(x, eps).mm(w),
    }
}

/// `sum_n w[n] X[n]`: the weights `w: [b, t, N]` collapse the streams `x: [b, t, N, d]`
/// into `[b, t, d]`. On flex one pass per position (every core, no `[b, t, N, d]`
/// product written); elsewhere a broadcast product and a sum.
pub fn collapse(w: Tensor<3>, x: &Tensor<4>) -> Tensor<3> {
    let [b, t, n, d] = x.dims();
    let values = host::with_values(&w, |w| {
        host::with_values(x, |xs| {
            host::new_rows(b * t, d, |r, row| {
                for j in 0..n {
                    let wj = w[r * n + j];
                    let xj = &xs[(r * n + j) * d..(r * n + j + 1) * d];
                    for (o, &e) in row.iter_mut().zip(xj) {
                        *o += wj * e;
                    }
                }
            })
        })
    })
    .flatten();
    match values {
        Some(v) => host::tensor_from(v, [b, t, d], x),
        None => (w.reshape([b, t, n, 1]) * x.clone())
            .sum_dim(2)
            .reshape([b, t, d]),
    }
}

/// [`mix_streams`] on flex (every tensor [`host::reachable`]): each position's `N x d`
/// stream values are replaced in place (through one position's scratch), positions over
/// every core.
fn mix_streams_host(
    x: Tensor<4>,
    out: &Tensor<3>,
    post: &Tensor<3>,
    comb: &Tensor<4>,
) -> Tensor<4> {
    let [_, _, n, d] = x.dims();
    let mixed = host::with_values(out, |a| {
        host::with_values(post, |p| {
            host::with_values(comb, |c| {
                host::update(x, |xs| {
                    host::par_rows_with(
                        xs,
                        n * d,
                        || vec![0f32; n * d],
                        |next, r, row| {
                            let (a, p) = (&a[r * d..(r + 1) * d], &p[r * n..(r + 1) * n]);
                            mix_position(row, next, a, p, &c[r * n * n..(r + 1) * n * n]);
                        },
                    )
                })
            })
        })
    });
    mixed
        .flatten()
        .flatten()
        .expect("reachable tensors lend their values")
}

/// One position of [`mix_streams`]: `row` (`N x d`, the streams) becomes `post[k] out +
/// sum_j comb[j, k] row[j]`, through `next` (`N x d` scratch).
fn mix_position(row: &mut [f32], next: &mut [f32], out: &[f32], post: &[f32], comb: &[f32]) {
    let (n, d) = (post.len(), out.len());
    for k in 0..n {
        let nk = &mut next[k * d..(k + 1) * d];
        nk.fill(0.0);
        for j in 0..n {
            let c = comb[j * n + k];
            for (o, &e) in nk.iter_mut().zip(&row[j * d..(j + 1) * d]) {
                *o += c * e;
            }
        }
        let pk = post[k];
        for (o, &e) in nk.iter_mut().zip(out) {
            *o += pk * e;
        }
    }
    row.copy_from_slice(next);
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
        let mix = normalized_mm(
            x.clone().reshape([b * t, n * d]),
            self.hc_fn.val().transpose(),
            self.norm_eps,
        );
        let pre =
            sigmoid(mix * self.hc_scale.val().reshape([1, 1]) + self.hc_base.val().reshape([1, n]))
                + self.hc_eps;
        let pre = hooks.apply(HookPoint::global(Site::HcHeadPre), pre.reshape([b, t, n]))?;
        Ok(collapse(pre, &x))
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::model::host::ROWS_PER_TASK;
    use burn::tensor::{Device, Distribution};

    fn close(a: Tensor<2>, b: Tensor<2>, what: &str) {
        let (a, b) = (
            a.to_data().try_into_vec::<f32>().unwrap(),
            b.to_data().try_into_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len(), "{what}: sizes");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    /// The host kernels (flex) give the tensor expressions they replace (computed on the
    /// autodiff device, where the kernels decline), on shapes that leave a partial task of
    /// rows and on strided inputs.
    #[test]
    fn host_kernels_give_the_tensor_expressions() {
        let (dev, ad) = (Device::flex(), Device::flex().autodiff());
        let (b, t, n, d) = (2, 2 * ROWS_PER_TASK + 3, 4, 24);
        let rnd =
            |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0.0, 2.0), &dev);
        let x = rnd([b, t, n, d]);
        let out = rnd([b, t, 1, d]).reshape([b, t, d]);
        let post = rnd([b, t, n, 1]).reshape([b, t, n]);
        // Strided weights (a transposed view): the kernels read them in logical order.
        let comb = rnd([b, t, n, n]).swap_dims(2, 3);
        let on = |x: &Tensor<4>, d: &Device| Tensor::<4>::from_data(x.to_data(), d);
        let on3 = |x: &Tensor<3>, d: &Device| Tensor::<3>::from_data(x.to_data(), d);
        let flat = |x: Tensor<4>| {
            let [b, t, n, d] = x.dims();
            x.reshape([b * t, n * d])
        };

        let host = mix_streams(x.clone(), out.clone(), post.clone(), comb.clone());
        let want = mix_streams(on(&x, &ad), on3(&out, &ad), on3(&post, &ad), on(&comb, &ad));
        close(flat(host), flat(want).inner_flex(), "mix_streams");

        let host = collapse(post.clone(), &x);
        let want = collapse(on3(&post, &ad), &on(&x, &ad));
        close(
            host.reshape([b * t, d]),
            want.reshape([b * t, d]).inner_flex(),
            "collapse",
        );

        let w = Tensor::<2>::random([n * d, 6], Distribution::Normal(0.0, 1.0), &dev);
        let host = normalized_mm(flat(x.clone()), w.clone(), 1e-6);
        let want = normalized_mm(
            flat(on(&x, &ad)),
            Tensor::<2>::from_data(w.to_data(), &ad),
            1e-6,
        );
        close(host, want.inner_flex(), "normalized_mm");
        // The streams the mix consumed were its own: a shared input is left as it was.
        let before = x.to_data();
        let _ = mix_streams(x.clone(), out, post, comb);
        assert_eq!(x.to_data(), before);
    }

    trait Inner {
        fn inner_flex(self) -> Tensor<2>;
    }
    impl Inner for Tensor<2> {
        fn inner_flex(self) -> Tensor<2> {
            Tensor::from_data(self.to_data(), &Device::flex())
        }
    }
}
