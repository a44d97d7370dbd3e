//! EAP and EAP-IG scores of every edge of a [`Graph`] on one batch of clean/corrupted
//! pairs.
//!
//! The metric `M` is the clean-orientation logit difference summed over the receiving
//! prompts (denoising: the corrupted prompts; noising: the clean ones). The score of
//! edge `u -> v` for receiving prompt i is
//!
//! ```text
//! s(u -> v) = (a_partner(u) - a(u)) . dM / d(input of v) |direct from u
//! ```
//!
//! where `a(u)` is the sender's output (its `hook_z` slice, `hook_mlp_out`, `hook_embed`)
//! and the derivative is taken along the direct path from `u` through the residual
//! stream into `v` only (every other node output held at its value: the linearisation
//! of exactly what path patching measures). It is computed at hook points in two
//! gradient passes per state, without per-edge forwards:
//!
//! 1. **Receiver gradients**: one forward with a gradient leaf at every receiver's point
//!    (`hook_q`, `hook_k`, `hook_v`, compressed entries, `hook_mlp_out`) and one backward
//!    of `M`: `G_v = dM/d act_v`. The raw k / v gradients of a compressing layer come
//!    from a copy of the prompts (extra batch rows) in which that layer's entries are
//!    replaced by their own values (constants), so that `dM/d hook_k` there holds the
//!    raw-slot path only while every other layer's entries stay live.
//! 2. **Receiver inputs**: one forward of every prompt once per receiver (the rows of
//!    receiver v form its replica), with every sender output replaced by its value
//!    plus a gradient leaf (so the residual stream reaching any input is the same, but
//!    no gradient flows through a node's own computation), and one backward of
//!    `sum_v <G_v, act_v>` over the replicas (the logits replica reads `M` itself).
//!    The leaf gradient of sender u in replica v is `dM/d(input of v)` along the
//!    direct path from u; its dot product with `a_partner(u) - a(u)` is the score. An
//!    MLP receiver's replica keeps its own output live (the functional reads it).
//!
//! EAP evaluates both passes at the receiving prompts. EAP-IG (`steps = m`) averages
//! the gradients over the inputs `e + k/m (e_partner - e)`, k = 1..m, of the token
//! embeddings (`hook_embed` replaced by the interpolation; the senders' values are
//! those of the interpolated run).

use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::LanguageModel;
use crate::model::grad::grad_at_leaves;

use super::super::super::heads::Direction;
use super::super::super::patching::{Outcome, Prompts, Target, readout};
use super::super::super::progress::Progress;
use super::super::attribution_patching::{weighted_ld, weights};
use super::graph::{Graph, Input, ReceiverNode};

/// Which estimator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Gradients at the receiving prompts.
    Eap,
    /// Gradients averaged over `steps` interpolations of the input embeddings.
    EapIg { steps: usize },
}

impl Method {
    /// `eap`, `eapig`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Eap => "eap",
            Method::EapIg { .. } => "eapig",
        }
    }
}

/// The scores of one prompt batch.
#[derive(Debug, Clone)]
pub struct EdgeScores {
    /// Outcomes of the plain forward of every prompt (clean `0..n`, corrupted `n..2n`).
    pub base: Vec<Outcome>,
    /// Clean prompts per batch.
    pub n: usize,
    /// Per edge (graph order): per receiving prompt, the estimated change of the
    /// clean-orientation logit difference when the edge carries the partner's value.
    pub scores: Vec<Vec<f32>>,
    /// Forwards run (each backward counted as one more).
    pub passes: usize,
}

/// A batch of the prompts `rows` of `p` (targets and tokens only).
pub(crate) fn rows_of(p: &Prompts, rows: &[usize]) -> Prompts {
    let mut tokens = Vec::with_capacity(rows.len() * p.len);
    for &r in rows {
        tokens.extend_from_slice(&p.tokens[r * p.len..(r + 1) * p.len]);
    }
    Prompts {
        len: p.len,
        tokens,
        targets: rows.iter().map(|&r| p.targets[r].clone()).collect(),
        source: vec![None; rows.len()],
        group: vec![0; rows.len()],
    }
}

/// Every prompt's tokens.
fn all_tokens(p: &Prompts, device: &burn::tensor::Device) -> Tensor<2, burn::tensor::Int> {
    let all: Vec<usize> = (0..p.n()).collect();
    p.tokens_of(&all, device)
}

/// `[b, T, d]` as `[b, T, 1, d]`; rank-4 activations as they are.
pub(crate) fn as4(a: &Act) -> Result<Tensor<4>> {
    match a.shape().len() {
        3 => {
            let t = a.get::<3>()?;
            let [b, t_, d] = t.dims();
            Ok(t.reshape([b, t_, 1, d]))
        }
        _ => a.get::<4>(),
    }
}

/// `t` repeated `c` times along the batch axis (rank 3 or 4).
fn repeat(a: &Act, c: usize) -> Result<Act> {
    Ok(match a.shape().len() {
        3 => Act::new(a.get::<3>()?.repeat_dim(0, c)),
        _ => Act::new(a.get::<4>()?.repeat_dim(0, c)),
    })
}

fn cached<'c>(cache: &'c ActivationCache, p: &HookPoint) -> Result<&'c Act> {
    cache.get(p).ok_or_else(|| {
        Error::hook(
            p.to_string(),
            "the model did not produce this activation (is the layer of the right kind?)",
        )
    })
}

/// Every sender point of the graph (sorted, deduplicated).
fn sender_points(g: &Graph) -> Vec<HookPoint> {
    let mut v: Vec<HookPoint> = g.senders.iter().map(|s| s.point()).collect();
    v.sort();
    v.dedup();
    v
}

/// Every receiver point of the graph (sorted, deduplicated; not the logits).
fn receiver_points(g: &Graph) -> Vec<HookPoint> {
    let mut v: Vec<HookPoint> = g.receivers.iter().filter_map(|r| r.point()).collect();
    v.sort();
    v.dedup();
    v
}

/// The compressed-entry points among the receivers.
fn entry_points(g: &Graph) -> Vec<HookPoint> {
    let mut v: Vec<HookPoint> = g
        .receivers
        .iter()
        .filter(|r| matches!(r, ReceiverNode::Attn { input, .. } if input.compressed()))
        .filter_map(|r| r.point())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The state the gradients are taken at: the receiving prompts' tokens, optionally
/// with the token embeddings replaced.
struct State {
    embed: Option<Act>,
    /// Values of every sender point, every receiver point and the entries at this
    /// state (rows = the receiving prompts).
    cache: ActivationCache,
}

/// One batch's edge scores.
pub struct EdgeRun<'a> {
    pub model: &'a dyn LanguageModel,
    pub prompts: &'a Prompts,
    pub graph: &'a Graph,
    pub direction: Direction,
    pub max_rows: usize,
}

impl EdgeRun<'_> {
    /// The scores of every edge of the graph with `method`; `progress` advances by one
    /// per replica pass.
    pub fn scores(&self, method: Method, progress: &mut Progress) -> Result<EdgeScores> {
        let p = self.prompts;
        let n2 = p.n();
        if n2 == 0 || !n2.is_multiple_of(2) {
            return Err(Error::Other(format!(
                "edge attribution needs clean/corrupted pairs, got {n2} prompts"
            )));
        }
        let n = n2 / 2;
        let device = self.model.device();
        let recv = self.direction.receivers(n);
        let partners: Vec<usize> = recv.iter().map(|&i| (i + n) % n2).collect();
        // The plain forward of every prompt: outcomes, sender values, receiver shapes.
        let mut caps = sender_points(self.graph);
        caps.extend(receiver_points(self.graph));
        caps.extend(entry_points(self.graph));
        caps.sort();
        caps.dedup();
        let all: Vec<usize> = (0..n2).collect();
        let mut spec = HookSpec::new();
        for c in &caps {
            spec = spec.capture_point(*c);
        }
        let out = self.model.forward(p.tokens_of(&all, &device), &spec)?;
        let targets: Vec<&Target> = p.targets.iter().collect();
        let base = readout(out.logits, &targets)?;
        let plain = out.cache;
        // Sender deltas (partner - receiving), per sender point, as [n, T, H|1, d].
        let mut deltas = Vec::new();
        for sp in sender_points(self.graph) {
            let a = cached(&plain, &sp)?;
            let d = as4(&a.select_batch(&partners)?)? - as4(&a.select_batch(&recv)?)?;
            deltas.push((sp, d));
        }
        let sub = rows_of(p, &recv);
        let sign = weights(n, &[self.direction])[recv[0]];
        let w = vec![sign; n];
        let states: Vec<State> = match method {
            Method::Eap => vec![State {
                embed: None,
                cache: plain.select_batch(&recv)?,
            }],
            Method::EapIg { steps } => {
                if steps == 0 {
                    return Err(Error::Other("EAP-IG needs at least one step".into()));
                }
                let ep = HookPoint::global(Site::Embed);
                let e = cached(&plain, &ep)?;
                let (e0, e1) = (
                    e.select_batch(&recv)?.get::<3>()?,
                    e.select_batch(&partners)?.get::<3>()?,
                );
                let mut v = Vec::with_capacity(steps);
                for k in 1..=steps {
                    let alpha = k as f64 / steps as f64;
                    let emb = Act::new(e0.clone() + (e1.clone() - e0.clone()).mul_scalar(alpha));
                    let mut spec = HookSpec::new().intervene_point(
                        ep,
                        Action::Replace(emb.clone()),
                        Scope::all(),
                    );
                    for c in &caps {
                        spec = spec.capture_point(*c);
                    }
                    let o = self.model.forward(all_tokens(&sub, &device), &spec)?;
                    v.push(State {
                        embed: Some(emb),
                        cache: o.cache,
                    });
                }
                v
            }
        };
        let mut scores = vec![vec![0f32; n]; self.graph.edges.len()];
        // The plain forward, and one more per interpolation.
        let mut passes = 1 + if matches!(method, Method::Eap) {
            0
        } else {
            states.len()
        };
        let scale = 1.0 / states.len() as f32;
        for st in &states {
            let g = self.receiver_grads(st, &sub, &w)?;
            passes += 2;
            passes +=
                self.replica_passes(st, &sub, &w, &g, &deltas, scale, &mut scores, progress)?;
        }
        Ok(EdgeScores {
            base,
            n,
            scores,
            passes,
        })
    }

    /// Pass 1 at a state: `G_v = dM/d act_v` at every receiver point (raw k / v of a
    /// compressing layer: with that layer's entries held).
    fn receiver_grads(&self, st: &State, sub: &Prompts, w: &[f32]) -> Result<ActivationCache> {
        let device = self.model.device();
        let n = sub.n();
        // Copy 0 of the prompts runs unchanged (every gradient but the raw k / v ones);
        // copy 1 + c holds the entries of the c-th compressing layer at their values,
        // which cuts only the path from that layer's hook_k / hook_v into its own
        // entries (every other entry stays live): its raw k / v gradient.
        let mut entry_layers: Vec<usize> = entry_points(self.graph)
            .iter()
            .filter_map(|p| p.layer)
            .collect();
        entry_layers.dedup();
        let copies = 1 + entry_layers.len();
        let rows: Vec<usize> = (0..copies).flat_map(|_| 0..n).collect();
        let rep = rows_of(sub, &rows);
        let mut base = HookSpec::new();
        if let Some(e) = &st.embed {
            base = base.intervene_point(
                HookPoint::global(Site::Embed),
                Action::Replace(repeat(e, copies)?),
                Scope::all(),
            );
        }
        for (c, &l) in entry_layers.iter().enumerate() {
            let block: Vec<usize> = ((c + 1) * n..(c + 2) * n).collect();
            for site in [Site::CompressedK, Site::CompressedV] {
                let ep = HookPoint::block(l, site);
                if st.cache.get(&ep).is_none() {
                    continue;
                }
                base = base.intervene_point(
                    ep,
                    Action::Replace(repeat(cached(&st.cache, &ep)?, copies)?),
                    Scope::all().with_batch(block.clone()),
                );
            }
        }
        let pts = receiver_points(self.graph);
        let leaves = pts
            .iter()
            .map(|pt| {
                let mut shape = cached(&st.cache, pt)?.shape().to_vec();
                shape[0] = copies * n;
                Ok((*pt, shape))
            })
            .collect::<Result<Vec<_>>>()?;
        let wr: Vec<f32> = (0..copies).flat_map(|_| w.iter().copied()).collect();
        let (_, grads) = grad_at_leaves(
            self.model,
            all_tokens(&rep, &device),
            base,
            &leaves,
            &[],
            |out| weighted_ld(out.logits.clone(), &rep, wr),
        )?;
        let mut g = ActivationCache::new();
        for (pt, a) in pts.into_iter().zip(grads) {
            let copy = match (pt.site, pt.layer) {
                (Site::AttnK | Site::AttnV, Some(l)) => entry_layers
                    .iter()
                    .position(|&e| e == l)
                    .map_or(0, |c| c + 1),
                _ => 0,
            };
            let block: Vec<usize> = (copy * n..(copy + 1) * n).collect();
            g.insert(pt, a.select_batch(&block)?);
        }
        Ok(g)
    }

    /// Pass 2 at a state: the replicas of every receiver, `max_rows` rows at a time;
    /// adds `scale x` each edge's per-prompt score to `scores`. Returns the forwards
    /// run (a backward counted as one).
    #[allow(clippy::too_many_arguments)]
    fn replica_passes(
        &self,
        st: &State,
        sub: &Prompts,
        w: &[f32],
        g: &ActivationCache,
        deltas: &[(HookPoint, Tensor<4>)],
        scale: f32,
        scores: &mut [Vec<f32>],
        progress: &mut Progress,
    ) -> Result<usize> {
        let n = sub.n();
        let per = (self.max_rows / n.max(1)).max(1);
        let receivers: Vec<usize> = (0..self.graph.receivers.len()).collect();
        let mut passes = 0;
        for chunk in receivers.chunks(per) {
            self.replica_chunk(st, sub, w, g, deltas, chunk, scale, scores)?;
            passes += 2;
            progress.inc(1);
        }
        Ok(passes)
    }

    #[allow(clippy::too_many_arguments)]
    fn replica_chunk(
        &self,
        st: &State,
        sub: &Prompts,
        w: &[f32],
        g: &ActivationCache,
        deltas: &[(HookPoint, Tensor<4>)],
        chunk: &[usize],
        scale: f32,
        scores: &mut [Vec<f32>],
    ) -> Result<()> {
        let graph = self.graph;
        let nl = graph.n_layers;
        let n = sub.n();
        let c = chunk.len();
        let device = self.model.device();
        let rows_all: Vec<usize> = (0..c).flat_map(|_| 0..n).collect();
        let rep = rows_of(sub, &rows_all);
        let max_order = chunk
            .iter()
            .map(|&ri| graph.receivers[ri].order(nl))
            .max()
            .unwrap_or(0);
        // Frozen senders: every hook_z and every MLP output at the state's values (an
        // MLP receiver's own output stays live in its replica), plus leaves.
        let mut base = HookSpec::new();
        let ep = HookPoint::global(Site::Embed);
        if let Some(e) = &st.embed {
            base = base.intervene_point(ep, Action::Replace(repeat(e, c)?), Scope::all());
        }
        for l in 0..nl {
            let zp = HookPoint::block(l, Site::AttnZ);
            base = base.intervene_point(
                zp,
                Action::Replace(repeat(cached(&st.cache, &zp)?, c)?),
                Scope::all(),
            );
            let mp = HookPoint::block(l, Site::MlpOut);
            let live: Vec<usize> = chunk
                .iter()
                .enumerate()
                .filter(|(_, ri)| graph.receivers[**ri] == ReceiverNode::Mlp { layer: l })
                .flat_map(|(j, _)| j * n..(j + 1) * n)
                .collect();
            let frozen: Vec<usize> = (0..c * n).filter(|r| !live.contains(r)).collect();
            if !frozen.is_empty() {
                base = base.intervene_point(
                    mp,
                    Action::Replace(repeat(cached(&st.cache, &mp)?, c)?),
                    Scope::all().with_batch(frozen),
                );
            }
        }
        // Leaves at the senders that write before some receiver of the chunk reads.
        let mut leaf_pts: Vec<HookPoint> = Vec::new();
        for s in &graph.senders {
            if s.order() < max_order && !leaf_pts.contains(&s.point()) {
                leaf_pts.push(s.point());
            }
        }
        let leaves = leaf_pts
            .iter()
            .map(|pt| {
                let mut shape = cached(&st.cache, pt)?.shape().to_vec();
                shape[0] = c * n;
                Ok((*pt, shape))
            })
            .collect::<Result<Vec<_>>>()?;
        let caps: Vec<HookPoint> = {
            let mut v: Vec<HookPoint> = chunk
                .iter()
                .filter_map(|&ri| graph.receivers[ri].point())
                .collect();
            v.sort();
            v.dedup();
            v
        };
        let metric = |out: &crate::model::ForwardOutput| -> Result<Tensor<1>> {
            let mut total: Option<Tensor<1>> = None;
            for (j, &ri) in chunk.iter().enumerate() {
                let r = graph.receivers[ri];
                let term = match r.point() {
                    None => {
                        let [_, t, v] = out.logits.dims();
                        let lg = out.logits.clone().slice([j * n..(j + 1) * n, 0..t, 0..v]);
                        weighted_ld(lg, sub, w.to_vec())?
                    }
                    Some(pt) => {
                        let a = as4(cached(&out.cache, &pt)?)?;
                        let gr = as4(cached(g, &pt)?)?;
                        let [_, t, h, d] = a.dims();
                        let a = a.slice([j * n..(j + 1) * n, 0..t, 0..h, 0..d]);
                        let (a, gr) = match r.head() {
                            Some(hd) => (
                                a.slice([0..n, 0..t, hd..hd + 1, 0..d]),
                                gr.slice([0..n, 0..t, hd..hd + 1, 0..d]),
                            ),
                            None => (a, gr),
                        };
                        (a * gr).sum()
                    }
                };
                total = Some(match total {
                    Some(x) => x + term,
                    None => term,
                });
            }
            total.ok_or_else(|| Error::Other("an empty replica chunk".into()))
        };
        let (_, grads) = grad_at_leaves(
            self.model,
            all_tokens(&rep, &device),
            base,
            &leaves,
            &caps,
            metric,
        )?;
        // Per sender point: sum over positions and d of delta x leaf gradient, per
        // (replica, prompt, head).
        for (pt, gr) in leaf_pts.iter().zip(grads) {
            let delta = &deltas
                .iter()
                .find(|(p, _)| p == pt)
                .ok_or_else(|| Error::hook(pt.to_string(), "no sender delta"))?
                .1;
            let gr = as4(&gr)?;
            let [_, t, h, d] = gr.dims();
            let prod = gr.reshape([c, n * t * h * d]) * delta.clone().reshape([1, n * t * h * d]);
            let per = prod
                .reshape([c * n, t, h, d])
                .sum_dim(3)
                .sum_dim(1)
                .reshape([c * n * h])
                .try_into_vec_as::<f32>()?;
            for (j, &ri) in chunk.iter().enumerate() {
                for (ei, e) in graph.edges_into(ri) {
                    let s = graph.senders[e.sender];
                    if s.point() != *pt {
                        continue;
                    }
                    let hd = s.head().unwrap_or(0);
                    for i in 0..n {
                        scores[ei][i] += scale * per[(j * n + i) * h + hd];
                    }
                }
            }
        }
        Ok(())
    }
}

/// The per-edge scores summed into one receiver's KV input as path patching's `hook_k`
/// / `hook_v` replacement sees it: the raw path, plus the entries where they are pooled
/// from `hook_k` / `hook_v` (`pooled_from_raw`: kvc; DeepSeek-V4's compressor has its own
/// projection).
pub fn path_equivalent(
    graph: &Graph,
    scores: &[Vec<f32>],
    sender: usize,
    layer: usize,
    head: usize,
    input: Input,
    pooled_from_raw: bool,
) -> Option<Vec<f32>> {
    let want: Vec<Input> = match input {
        Input::K if pooled_from_raw => vec![Input::K, Input::Ck],
        Input::V if pooled_from_raw => vec![Input::V, Input::Cv],
        i => vec![i],
    };
    let mut out: Option<Vec<f32>> = None;
    for (ei, e) in graph.edges.iter().enumerate() {
        if e.sender != sender {
            continue;
        }
        if let ReceiverNode::Attn {
            layer: l,
            head: h,
            input: i,
        } = graph.receivers[e.receiver]
            && l == layer
            && h == head
            && want.contains(&i)
        {
            let acc = out.get_or_insert_with(|| vec![0.0; scores[ei].len()]);
            for (a, b) in acc.iter_mut().zip(&scores[ei]) {
                *a += b;
            }
        }
    }
    out
}
