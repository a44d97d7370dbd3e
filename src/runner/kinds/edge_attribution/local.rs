//! Pass 2 without replicas ([`Pass2::Local`], used whenever the model offers a
//! [`StreamModel`]). "Direct path from u into v" means: every block's own computation
//! (attention core and output projection of every head, every MLP / MoE) held at its
//! value, the rest live: the stream-only computation from the senders' outputs to the
//! stream `X_p` at the point p where v reads (kvc: the running sum; DeepSeek-V4: the
//! hyper-connections, whose pre / post / comb weights stay functions of the stream), then
//! v's own input computation `act_v = f_v(X_p)` (norm, mHC pre-mix, projections, gates
//! and pooling of the entries, the MLP for an MLP receiver, head for the logits). This is
//! exactly what the replicas differentiate, so the derivative factorises:
//!
//! - `r_v = d<G_v, f_v(X_p)>/dX_p`: a vector-Jacobian product through f_v alone
//!   ([`StreamModel::read_stream`]), one local forward + backward per stream point with
//!   the point's receivers as batch rows;
//! - the gradient at u's contribution to the stream: r_v itself on an additive stream
//!   (kvc), else the transposed Jacobian of the stream-only computation applied to r_v
//!   ([`StreamModel::linearize_stream`]: linearised once per state, its weights and their
//!   per-token Jacobians computed once; then a per-token linear map per step, for every
//!   receiver's rows from its own stream point down, no weight recomputed);
//! - the score: that gradient dotted with u's change in stream space (a head's
//!   `hook_result` slice, the MLP output, the embeddings), summed over positions.
//!
//! The raw k / v gradients then need no copies of the prompts in pass 1: `G_k(raw) =
//! dM/d hook_k - d<G_ck, ck> / d hook_k - d<G_cv, cv> / d hook_k` (the entries' own
//! dependence on `hook_k` / `hook_v`, zero where they have their own projection), a local
//! product at the same stream point. Cost per state: pass 1 over the receiving prompts
//! plus local passes of about one layer's inputs per receiver, against a full forward per
//! receiver with replicas.

use std::time::Instant;

use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::{StreamModel, StreamPoint};

use super::super::super::patching::Prompts;
use super::eap::{
    Dots, EdgeRun, Sink, State, StateInputs, Timing, all_tokens, as4, cached, entry_points,
    receiver_term, rows_of, stream_hook, stream_point,
};
use super::graph::{Input, ReceiverNode};

#[cfg(doc)]
use super::eap::Pass2;

/// Receivers whose local products compute the same parts of a layer's input
/// computation (and so share a local pass): queries, per-token k / v, entries, the MLP,
/// the logits.
fn input_class(r: ReceiverNode) -> u8 {
    match r {
        ReceiverNode::Attn {
            input: Input::Q, ..
        } => 0,
        ReceiverNode::Attn {
            input: Input::K | Input::V,
            ..
        } => 1,
        ReceiverNode::Attn { .. } => 2,
        ReceiverNode::Mlp { .. } => 3,
        ReceiverNode::Logits => 4,
    }
}

/// `a: [b, T, ...]` as `[b, T, rest]`.
fn flat3(a: &Act) -> Result<Tensor<3>> {
    let s = a.shape();
    if s.len() < 3 {
        return Err(Error::Other(format!(
            "a stream of shape {s:?}: expected [batch, pos, ...]"
        )));
    }
    let rest: usize = s[2..].iter().product();
    a.reshaped(vec![s[0], s[1], rest])?.get::<3>()
}

/// Per (row block j, prompt i, head h), `sum_{t, d} g[j n + i, t, d] delta[i, t, h, d]`
/// for `g: [m n, T, d]` and `delta: [n, T, H, d]`, flattened `[m, n, H]`.
fn dot_blocks(g: Tensor<3>, delta: &Tensor<4>, m: usize) -> Result<Vec<f32>> {
    let [n, t, h, d] = delta.dims();
    let gm = g.reshape([m, n, t * d]).swap_dims(0, 1); // [n, m, T d]
    let dm = delta.clone().swap_dims(2, 3).reshape([n, t * d, h]); // [n, T d, H]
    let prod = gm.matmul(dm).swap_dims(0, 1); // [m, n, H]
    Ok(prod.reshape([m * n * h]).try_into_vec_as::<f32>()?)
}

impl EdgeRun<'_> {
    /// Pass 2 at a state without replicas (see the module doc): the raw k / v
    /// gradients corrected, `r_v` by local products per stream point, then the scores
    /// (additive stream: `r_v` dotted with every earlier sender's change; otherwise
    /// through the stream-only transport). Adds `scale x` each edge's per-prompt score
    /// to the sink's scores; returns the local passes run (a backward counted as one).
    pub(super) fn local_passes(
        &self,
        sm: &dyn StreamModel,
        inp: &StateInputs,
        mut g: ActivationCache,
        sink: &mut Sink,
        timing: &mut Timing,
    ) -> Result<usize> {
        let (st, sub) = (inp.st, inp.sub);
        let t0 = Instant::now();
        let graph = self.graph;
        let nl = graph.n_layers;
        let n = sub.n();
        let device = self.model.device();
        let ad = device.clone().autodiff();
        let per = (self.local_rows() / n.max(1)).max(1);
        let mut passes = 0;
        // The raw k / v gradients of every layer with entry receivers.
        let mut entry_layers: Vec<usize> =
            entry_points(graph).iter().filter_map(|p| p.layer).collect();
        entry_layers.dedup();
        for &l in &entry_layers {
            self.raw_kv_grads(sm, st, sub, l, &mut g)?;
            passes += 2;
        }
        // r_v per receiver, [n, T, P] (P: the stream's width per position).
        let mut r: Vec<Option<Tensor<3>>> = vec![None; graph.receivers.len()];
        let mut points: Vec<StreamPoint> =
            graph.receivers.iter().map(|&rv| stream_point(rv)).collect();
        points.sort();
        points.dedup();
        for sp in points {
            let x = cached(&st.cache, &stream_hook(sp, nl)?)?;
            let shape = x.shape().to_vec();
            let x3 = flat3(x)?;
            let [_, t, width] = x3.dims();
            let mut at: Vec<usize> = (0..graph.receivers.len())
                .filter(|&ri| stream_point(graph.receivers[ri]) == sp)
                .collect();
            at.sort_by_key(|&ri| input_class(graph.receivers[ri]));
            let chunks = at
                .chunk_by(|&a, &b| {
                    input_class(graph.receivers[a]) == input_class(graph.receivers[b])
                })
                .flat_map(|group| group.chunks(per));
            for chunk in chunks {
                let c = chunk.len();
                let rows: Vec<usize> = (0..c).flat_map(|_| 0..n).collect();
                let rep = rows_of(sub, &rows);
                let leaf = Tensor::<3>::zeros([c * n, t, width], &ad).require_grad();
                let mut sshape = shape.clone();
                sshape[0] = c * n;
                let xs = Act::new(x3.clone().repeat_dim(0, c) + leaf.clone()).reshaped(sshape)?;
                let mut spec = HookSpec::new();
                for &ri in chunk {
                    if let Some(pt) = graph.receivers[ri].point() {
                        spec = spec.capture_point(pt);
                    }
                }
                let out = sm.read_stream(all_tokens(&rep, &device), sp, &xs, &spec)?;
                let mut total: Option<Tensor<1>> = None;
                for (j, &ri) in chunk.iter().enumerate() {
                    let term = receiver_term(
                        graph.receivers[ri],
                        j,
                        out.logits.as_ref(),
                        &out.cache,
                        inp,
                        &g,
                    )?;
                    total = Some(match total {
                        Some(a) => a + term,
                        None => term,
                    });
                }
                let total = total.ok_or_else(|| Error::Other("an empty receiver chunk".into()))?;
                let grads = total.backward();
                let gr = leaf.grad(&grads).ok_or_else(|| {
                    Error::Other(format!(
                        "no gradient reached the stream at {sp:?} (does the model read it?)"
                    ))
                })?;
                for (j, &ri) in chunk.iter().enumerate() {
                    r[ri] = Some(gr.clone().slice([j * n..(j + 1) * n, 0..t, 0..width]));
                }
                passes += 2;
                sink.progress.inc(1);
            }
        }
        let r: Vec<Tensor<3>> = r
            .into_iter()
            .enumerate()
            .map(|(ri, x)| {
                x.ok_or_else(|| {
                    Error::Other(format!("no local pass for {}", graph.receivers[ri].label()))
                })
            })
            .collect::<Result<_>>()?;
        timing.local += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        if sm.additive_stream() {
            self.score_additive(&r, inp, sink.scores)?;
        } else {
            passes += self.score_transported(sm, inp, &r, sink)?;
        }
        timing.transport += t0.elapsed().as_secs_f64();
        Ok(passes)
    }

    /// `G_k(raw) = G_k - d(<G_ck, ck> + <G_cv, cv>)/d hook_k` (and for v) at layer `l`:
    /// one local product through the layer's inputs with leaves at `hook_k` / `hook_v`.
    fn raw_kv_grads(
        &self,
        sm: &dyn StreamModel,
        st: &State,
        sub: &Prompts,
        l: usize,
        g: &mut ActivationCache,
    ) -> Result<()> {
        let device = self.model.device();
        let ad = device.clone().autodiff();
        let sp = StreamPoint::Attn(l);
        let x = cached(&st.cache, &stream_hook(sp, self.graph.n_layers)?)?;
        let (kp, vp) = (
            HookPoint::block(l, Site::AttnK),
            HookPoint::block(l, Site::AttnV),
        );
        let (ckp, cvp) = (
            HookPoint::block(l, Site::CompressedK),
            HookPoint::block(l, Site::CompressedV),
        );
        let mut spec = HookSpec::new().capture_point(ckp).capture_point(cvp);
        let mut leaves = Vec::new();
        for pt in [kp, vp] {
            let Some(gk) = g.get(&pt) else {
                continue;
            };
            let dims: [usize; 4] = as4(gk)?.dims();
            let leaf = Tensor::<4>::zeros(dims, &ad).require_grad();
            let act = if gk.rank() == 3 {
                Act::new(leaf.clone().reshape([dims[0], dims[1], dims[3]]))
            } else {
                Act::new(leaf.clone())
            };
            spec = spec.intervene_point(pt, Action::Add(act), Scope::all());
            leaves.push((pt, leaf));
        }
        if leaves.is_empty() {
            return Ok(());
        }
        let out = sm.read_stream(all_tokens(sub, &device), sp, x, &spec)?;
        let mut total: Option<Tensor<1>> = None;
        for pt in [ckp, cvp] {
            let (Some(a), Some(ga)) = (out.cache.get(&pt), g.get(&pt)) else {
                continue;
            };
            let term = (as4(a)? * as4(ga)?).sum();
            total = Some(match total {
                Some(x) => x + term,
                None => term,
            });
        }
        // Entries that do not read hook_k / hook_v (their own projection): nothing to
        // remove, and nothing to differentiate.
        let Some(total) = total.filter(|t| t.is_tracked()) else {
            return Ok(());
        };
        let grads = total.backward();
        for (pt, leaf) in leaves {
            // No gradient: the entries do not read this point (their own projection).
            let Some(share) = leaf.grad(&grads) else {
                continue;
            };
            let gk = cached(g, &pt)?;
            let shape = gk.shape().to_vec();
            let raw = Act::new(as4(gk)? - share).reshaped(shape)?;
            g.insert(pt, raw);
        }
        Ok(())
    }

    /// Additive stream: the gradient at every earlier sender's contribution is `r_v`.
    fn score_additive(
        &self,
        r: &[Tensor<3>],
        inp: &StateInputs,
        scores: &mut [Vec<f32>],
    ) -> Result<()> {
        let deltas = inp.deltas;
        let graph = self.graph;
        let nl = graph.n_layers;
        let n = self.prompts.n() / 2;
        for (pt, delta) in deltas {
            let Some(order) = graph
                .senders
                .iter()
                .find(|s| s.point() == *pt)
                .map(|s| s.order())
            else {
                continue;
            };
            let js: Vec<usize> = (0..graph.receivers.len())
                .filter(|&ri| graph.receivers[ri].order(nl) > order)
                .collect();
            if js.is_empty() {
                continue;
            }
            let width = r[js[0]].dims()[2];
            let d = delta.dims()[3];
            if width != d {
                return Err(Error::hook(
                    pt.to_string(),
                    format!(
                        "an additive stream of width {width} against sender outputs of width {d}"
                    ),
                ));
            }
            let gcat = Tensor::cat(js.iter().map(|&j| r[j].clone()).collect(), 0);
            let per = dot_blocks(gcat, delta, js.len())?;
            let h = delta.dims()[2];
            let dots = Dots {
                pt: *pt,
                per: &per,
                n,
                h,
            };
            for (jj, &ri) in js.iter().enumerate() {
                self.add_scores(ri, jj, &dots, inp, scores);
            }
        }
        Ok(())
    }

    /// Non-additive stream (mHC): the senders' gradients for every receiver through the
    /// stream-only computation linearised once at the state
    /// ([`StreamModel::linearize_stream`]: its weights and their Jacobians computed
    /// once, every block output held at the state's value), applied to the receivers'
    /// `r_v` as a per-token linear map. Receivers go deepest first, `local_rows` rows
    /// at a time; each joins the running adjoint at its own stream point, so a receiver
    /// costs one linear step per stream point below it and no weight is recomputed.
    fn score_transported(
        &self,
        sm: &dyn StreamModel,
        inp: &StateInputs,
        r: &[Tensor<3>],
        sink: &mut Sink,
    ) -> Result<usize> {
        let StateInputs { st, deltas, .. } = *inp;
        let graph = self.graph;
        let nl = graph.n_layers;
        let n = self.prompts.n() / 2;
        let per_chunk = (self.local_rows() / n.max(1)).max(1);
        let embed = match &st.embed {
            Some(e) => e.get::<3>()?,
            None => cached(&st.cache, &HookPoint::global(Site::Embed))?.get::<3>()?,
        };
        let outs = |site: Site| -> Result<Vec<Tensor<3>>> {
            (0..nl)
                .map(|l| cached(&st.cache, &HookPoint::block(l, site))?.get::<3>())
                .collect()
        };
        let lin = sm.linearize_stream(embed, &outs(Site::AttnOut)?, &outs(Site::MlpOut)?)?;
        // The forward of the stream-only computation and the weights' Jacobians.
        let mut passes = 2;
        let at = |ri: usize| stream_point(graph.receivers[ri]).index(nl);
        let mut order: Vec<usize> = (0..graph.receivers.len()).collect();
        order.sort_by_key(|&ri| std::cmp::Reverse(at(ri)));
        // The sender point whose output step k writes (k = 0: the embeddings).
        let written = |k: usize| match k {
            0 => HookPoint::global(Site::Embed),
            k if k % 2 == 1 => HookPoint::block((k - 1) / 2, Site::AttnZ),
            k => HookPoint::block(k / 2 - 1, Site::MlpOut),
        };
        for chunk in order.chunks(per_chunk) {
            let mut joined: Vec<usize> = Vec::with_capacity(chunk.len());
            let mut adj: Option<Tensor<3>> = None;
            let top = at(chunk[0]);
            for k in (0..=top).rev() {
                let new: Vec<Tensor<3>> = chunk
                    .iter()
                    .filter(|&&ri| at(ri) == k)
                    .map(|&ri| {
                        joined.push(ri);
                        r[ri].clone()
                    })
                    .collect();
                if !new.is_empty() {
                    let mut parts: Vec<Tensor<3>> = adj.take().into_iter().collect();
                    parts.extend(new);
                    adj = Some(Tensor::cat(parts, 0));
                }
                let Some(a) = adj.take() else {
                    continue;
                };
                let g = if k == 0 {
                    lin.embed_back(a)?
                } else {
                    let (prev, g) = lin.step_back(k, a)?;
                    adj = Some(prev);
                    g
                };
                let pt = written(k);
                if let Some((_, delta)) = deltas.iter().find(|(p, _)| *p == pt) {
                    let per = dot_blocks(g, delta, joined.len())?;
                    let dots = Dots {
                        pt,
                        per: &per,
                        n,
                        h: delta.dims()[2],
                    };
                    for (jj, &ri) in joined.iter().enumerate() {
                        self.add_scores(ri, jj, &dots, inp, sink.scores);
                    }
                }
            }
            passes += 1;
            sink.progress.inc(1);
        }
        Ok(passes)
    }
}
