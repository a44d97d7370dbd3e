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
//! **Pass 2 without replicas** ([`Pass2::Local`], used whenever the model offers a
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
//!   (kvc), else one backward of `sum_v <r_v, X_p(v)>` through
//!   [`StreamModel::stream_from_outputs`] with every receiver's rows stacked (cheap: no
//!   attention, no MLP);
//! - the score: that gradient dotted with u's change in stream space (a head's
//!   `hook_result` slice, the MLP output, the embeddings), summed over positions.
//!
//! The raw k / v gradients then need no copies of the prompts in pass 1: `G_k(raw) =
//! dM/d hook_k - d<G_ck, ck> / d hook_k - d<G_cv, cv> / d hook_k` (the entries' own
//! dependence on `hook_k` / `hook_v`, zero where they have their own projection), a local
//! product at the same stream point. Cost per state: pass 1 over the receiving prompts
//! plus local passes of about one layer's inputs per receiver, against a full forward per
//! receiver with replicas. [`Pass2::Replicas`] stays as the reference (tests compare the
//! two to float rounding) and the fallback for a model without a [`StreamModel`].
//!
//! EAP evaluates both passes at the receiving prompts. EAP-IG (`steps = m`) averages
//! the gradients over the inputs `e + k/m (e_partner - e)`, k = 1..m, of the token
//! embeddings (`hook_embed` replaced by the interpolation; the senders' values are
//! those of the interpolated run).

use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::grad::grad_at_leaves;
use crate::model::{LanguageModel, StreamModel, StreamPoint};

use super::super::super::heads::Direction;
use super::super::super::patching::{Outcome, Prompts, Target, readout};
use super::super::super::progress::Progress;
use super::super::attribution_patching::{weighted_ld, weights};
use super::graph::{Graph, Input, ReceiverNode};
use std::time::Instant;

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

/// How pass 2 (the direct-path derivative into every receiver) is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass2 {
    /// Local vector-Jacobian products at each stream point and one transport backward:
    /// O(1) full-model passes (needs the model's [`StreamModel`]).
    Local,
    /// One replica forward + backward of the whole model per receiver (the reference).
    Replicas,
}

impl Pass2 {
    /// `local`, `replicas`.
    pub fn name(self) -> &'static str {
        match self {
            Pass2::Local => "local",
            Pass2::Replicas => "replicas",
        }
    }
}

/// Seconds spent in each part of [`EdgeRun::scores`].
#[derive(Debug, Clone, Default)]
pub struct Timing {
    /// The plain forward of every prompt (outcomes, sender values).
    pub plain: f64,
    /// EAP-IG: the forwards of the interpolated states.
    pub states: f64,
    /// Pass 1 (`G_v` at every receiver).
    pub pass1: f64,
    /// Local pass 2: the raw k / v corrections and the local products `r_v`.
    pub local: f64,
    /// Local pass 2: the stream transport (mHC) and the scores.
    pub transport: f64,
    /// Replica pass 2.
    pub replicas: f64,
}

impl std::fmt::Display for Timing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "plain forward {:.2} s, interpolated states {:.2} s, pass 1 {:.2} s, local products {:.2} s, transport + scores {:.2} s, replicas {:.2} s",
            self.plain, self.states, self.pass1, self.local, self.transport, self.replicas
        )
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
    /// Full-model forwards run (each backward counted as one more).
    pub passes: usize,
    /// Local forwards (one layer's inputs, or the stream-only computation) run, each
    /// backward counted as one more ([`Pass2::Local`]; 0 with replicas).
    pub local_passes: usize,
    /// How pass 2 was computed.
    pub pass2: Pass2,
    /// Where the time went.
    pub timing: Timing,
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

/// Where receiver `r` reads the stream.
fn stream_point(r: ReceiverNode) -> StreamPoint {
    match r {
        ReceiverNode::Attn { layer, .. } => StreamPoint::Attn(layer),
        ReceiverNode::Mlp { layer } => StreamPoint::Mlp(layer),
        ReceiverNode::Logits => StreamPoint::Final,
    }
}

/// The hook point holding the stream at `p` (`Final`: the last block's
/// `hook_resid_post`).
fn stream_hook(p: StreamPoint, n_layers: usize) -> Result<HookPoint> {
    Ok(match p {
        StreamPoint::Attn(l) => HookPoint::block(l, Site::ResidPre),
        StreamPoint::Mlp(l) => HookPoint::block(l, Site::ResidMid),
        StreamPoint::Final => {
            if n_layers == 0 {
                return Err(Error::Other(
                    "edge attribution of a model without blocks".into(),
                ));
            }
            HookPoint::block(n_layers - 1, Site::ResidPost)
        }
    })
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

/// The term `<G_v, act_v>` of receiver `r` whose rows are block `j` (of `n`) of a
/// batch: from the captured activation at its point (head slice), or the logits.
#[allow(clippy::too_many_arguments)]
fn receiver_term(
    r: ReceiverNode,
    j: usize,
    n: usize,
    logits: Option<&Tensor<3>>,
    cache: &ActivationCache,
    g: &ActivationCache,
    sub: &Prompts,
    w: &[f32],
) -> Result<Tensor<1>> {
    match r.point() {
        None => {
            let logits =
                logits.ok_or_else(|| Error::Other("the logits receiver read no logits".into()))?;
            let [_, t, v] = logits.dims();
            let lg = logits.clone().slice([j * n..(j + 1) * n, 0..t, 0..v]);
            weighted_ld(lg, sub, w.to_vec())
        }
        Some(pt) => {
            let a = as4(cached(cache, &pt)?)?;
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
            Ok((a * gr).sum())
        }
    }
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
    /// The scores of every edge of the graph with `method`: pass 2 local where the
    /// model offers a [`StreamModel`], else with replicas; `progress` advances by one
    /// per pass-2 chunk.
    pub fn scores(&self, method: Method, progress: &mut Progress) -> Result<EdgeScores> {
        let pass2 = if self.model.stream_model().is_some() {
            Pass2::Local
        } else {
            Pass2::Replicas
        };
        self.scores_with(method, pass2, progress)
    }

    /// [`EdgeRun::scores`] with pass 2 computed as asked (`Local` needs the model's
    /// [`StreamModel`]).
    pub fn scores_with(
        &self,
        method: Method,
        pass2: Pass2,
        progress: &mut Progress,
    ) -> Result<EdgeScores> {
        let stream = match pass2 {
            Pass2::Local => Some(self.model.stream_model().ok_or_else(|| {
                Error::Other(format!(
                    "{} models offer no stream API for local edge attribution (use replicas)",
                    self.model.info().arch
                ))
            })?),
            Pass2::Replicas => None,
        };
        let nl = self.graph.n_layers;
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
        if let Some(sm) = stream {
            // The streams every receiver reads, and (for the transport) the block
            // outputs the stream is made of.
            for l in 0..nl {
                caps.push(stream_hook(StreamPoint::Attn(l), nl)?);
                caps.push(stream_hook(StreamPoint::Mlp(l), nl)?);
                if !sm.additive_stream() {
                    caps.push(HookPoint::block(l, Site::AttnOut));
                }
            }
            caps.push(stream_hook(StreamPoint::Final, nl)?);
        }
        caps.sort();
        caps.dedup();
        let all: Vec<usize> = (0..n2).collect();
        let mut timing = Timing::default();
        let t0 = Instant::now();
        let mut spec = HookSpec::new();
        for c in &caps {
            spec = spec.capture_point(*c);
        }
        if stream.is_some() {
            // The heads' outputs in stream space (hook_result): their deltas.
            for l in 0..nl {
                spec = spec.capture_point(HookPoint::block(l, Site::AttnResult));
            }
        }
        let out = self.model.forward(p.tokens_of(&all, &device), &spec)?;
        let targets: Vec<&Target> = p.targets.iter().collect();
        let base = readout(out.logits, &targets)?;
        let plain = out.cache;
        // Sender deltas (partner - receiving), per sender point, as [n, T, H|1, d]
        // (replicas: at the sender's point; local: in stream space, a head's through
        // its hook_result slice).
        let mut deltas = Vec::new();
        for sp in sender_points(self.graph) {
            let at = match (stream, sp.site, sp.layer) {
                (Some(_), Site::AttnZ, Some(l)) => HookPoint::block(l, Site::AttnResult),
                _ => sp,
            };
            let a = cached(&plain, &at)?;
            let d = as4(&a.select_batch(&partners)?)? - as4(&a.select_batch(&recv)?)?;
            deltas.push((sp, d));
        }
        timing.plain = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
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
        timing.states = t0.elapsed().as_secs_f64();
        let scale = 1.0 / states.len() as f32;
        let mut local_passes = 0;
        for st in &states {
            let t0 = Instant::now();
            let g = self.receiver_grads(st, &sub, &w, stream.is_none())?;
            timing.pass1 += t0.elapsed().as_secs_f64();
            passes += 2;
            match stream {
                None => {
                    let t0 = Instant::now();
                    passes += self.replica_passes(
                        st,
                        &sub,
                        &w,
                        &g,
                        &deltas,
                        scale,
                        &mut scores,
                        progress,
                    )?;
                    timing.replicas += t0.elapsed().as_secs_f64();
                }
                Some(sm) => {
                    local_passes += self.local_passes(
                        sm,
                        st,
                        &sub,
                        &w,
                        g,
                        &deltas,
                        scale,
                        &mut scores,
                        progress,
                        &mut timing,
                    )?;
                }
            }
        }
        Ok(EdgeScores {
            base,
            n,
            scores,
            passes,
            local_passes,
            pass2,
            timing,
        })
    }

    /// Pass 1 at a state: `G_v = dM/d act_v` at every receiver point. With `copies`,
    /// the raw k / v gradient of a compressing layer is taken with that layer's entries
    /// held (extra batch rows); without, `hook_k` / `hook_v` hold the total gradient (the
    /// local pass removes the entries' share).
    fn receiver_grads(
        &self,
        st: &State,
        sub: &Prompts,
        w: &[f32],
        copies: bool,
    ) -> Result<ActivationCache> {
        let device = self.model.device();
        let n = sub.n();
        // Copy 0 of the prompts runs unchanged (every gradient but the raw k / v ones);
        // copy 1 + c holds the entries of the c-th compressing layer at their values,
        // which cuts only the path from that layer's hook_k / hook_v into its own
        // entries (every other entry stays live): its raw k / v gradient.
        let mut entry_layers: Vec<usize> = if copies {
            entry_points(self.graph)
                .iter()
                .filter_map(|p| p.layer)
                .collect()
        } else {
            Vec::new()
        };
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
                let term = receiver_term(r, j, n, Some(&out.logits), &out.cache, g, sub, w)?;
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

    /// Rows per local pass: `max_rows` bounds a full-model forward, and a local pass
    /// holds about one layer's activations per row (the stream transport less), so it
    /// takes `n_layers x max_rows`.
    fn local_rows(&self) -> usize {
        self.max_rows.saturating_mul(self.graph.n_layers.max(1))
    }

    /// Pass 2 at a state without replicas (see the module doc): the raw k / v
    /// gradients corrected, `r_v` by local products per stream point, then the scores
    /// (additive stream: `r_v` dotted with every earlier sender's change; otherwise
    /// through the stream-only transport). Adds `scale x` each edge's per-prompt score
    /// to `scores`; returns the local passes run (a backward counted as one).
    #[allow(clippy::too_many_arguments)]
    fn local_passes(
        &self,
        sm: &dyn StreamModel,
        st: &State,
        sub: &Prompts,
        w: &[f32],
        mut g: ActivationCache,
        deltas: &[(HookPoint, Tensor<4>)],
        scale: f32,
        scores: &mut [Vec<f32>],
        progress: &mut Progress,
        timing: &mut Timing,
    ) -> Result<usize> {
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
                        n,
                        out.logits.as_ref(),
                        &out.cache,
                        &g,
                        sub,
                        w,
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
                progress.inc(1);
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
            self.score_additive(&r, deltas, scale, scores)?;
        } else {
            passes += self.score_transported(sm, st, &r, deltas, scale, scores, progress)?;
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
        deltas: &[(HookPoint, Tensor<4>)],
        scale: f32,
        scores: &mut [Vec<f32>],
    ) -> Result<()> {
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
            for (jj, &ri) in js.iter().enumerate() {
                self.add_scores(ri, *pt, &per, jj, n, h, scale, scores);
            }
        }
        Ok(())
    }

    /// Add `scale x per[(jj n + i) H + head]` to every edge into receiver `ri` from a
    /// sender at `pt`.
    #[allow(clippy::too_many_arguments)]
    fn add_scores(
        &self,
        ri: usize,
        pt: HookPoint,
        per: &[f32],
        jj: usize,
        n: usize,
        h: usize,
        scale: f32,
        scores: &mut [Vec<f32>],
    ) {
        let graph = self.graph;
        for (ei, e) in graph.edges_into(ri) {
            let s = graph.senders[e.sender];
            if s.point() != pt {
                continue;
            }
            let hd = s.head().unwrap_or(0);
            for i in 0..n {
                scores[ei][i] += scale * per[(jj * n + i) * h + hd];
            }
        }
    }

    /// Non-additive stream (mHC): the senders' gradients for every receiver from one
    /// backward of `sum_v <r_v, X_p(v)>` through the stream-only computation (receivers
    /// x prompts rows, `max_rows` at a time), every block output held at the state's
    /// value.
    #[allow(clippy::too_many_arguments)]
    fn score_transported(
        &self,
        sm: &dyn StreamModel,
        st: &State,
        r: &[Tensor<3>],
        deltas: &[(HookPoint, Tensor<4>)],
        scale: f32,
        scores: &mut [Vec<f32>],
        progress: &mut Progress,
    ) -> Result<usize> {
        let graph = self.graph;
        let nl = graph.n_layers;
        let n = self.prompts.n() / 2;
        let ad = self.model.device().autodiff();
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
        let (attn, mlp) = (outs(Site::AttnOut)?, outs(Site::MlpOut)?);
        let receivers: Vec<usize> = (0..graph.receivers.len()).collect();
        let mut passes = 0;
        for chunk in receivers.chunks(per_chunk) {
            let c = chunk.len();
            let leaf = |t: &Tensor<3>| Tensor::<3>::zeros(t.dims(), &ad).require_grad();
            let rep = |t: &Tensor<3>| t.clone().repeat_dim(0, c);
            let (e0, a0, m0) = (
                rep(&embed),
                attn.iter().map(rep).collect::<Vec<_>>(),
                mlp.iter().map(rep).collect::<Vec<_>>(),
            );
            let el = leaf(&e0);
            let al: Vec<Tensor<3>> = a0.iter().map(leaf).collect();
            let ml: Vec<Tensor<3>> = m0.iter().map(leaf).collect();
            let sum = |a: &[Tensor<3>], b: &[Tensor<3>]| -> Vec<Tensor<3>> {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| x.clone() + y.clone())
                    .collect()
            };
            let streams =
                sm.stream_from_outputs(e0 + el.clone(), &sum(&a0, &al), &sum(&m0, &ml))?;
            let mut total: Option<Tensor<1>> = None;
            for (j, &ri) in chunk.iter().enumerate() {
                let k = stream_point(graph.receivers[ri]).index(nl);
                let x = flat3(streams.get(k).ok_or_else(|| {
                    Error::Other(format!("the stream-only computation gave no stream {k}"))
                })?)?;
                let [_, t, width] = x.dims();
                let term = (x.slice([j * n..(j + 1) * n, 0..t, 0..width]) * r[ri].clone()).sum();
                total = Some(match total {
                    Some(a) => a + term,
                    None => term,
                });
            }
            let total = total.ok_or_else(|| Error::Other("an empty receiver chunk".into()))?;
            let grads = total.backward();
            let grad = |t: &Tensor<3>| -> Tensor<3> {
                t.grad(&grads)
                    .unwrap_or_else(|| Tensor::zeros(t.dims(), &self.model.device()))
            };
            for (pt, delta) in deltas {
                let gs = match (pt.site, pt.layer) {
                    (Site::Embed, _) => grad(&el),
                    (Site::AttnZ, Some(l)) => grad(&al[l]),
                    (Site::MlpOut, Some(l)) => grad(&ml[l]),
                    _ => {
                        return Err(Error::hook(
                            pt.to_string(),
                            "not a sender point of the stream transport",
                        ));
                    }
                };
                let per = dot_blocks(gs, delta, c)?;
                let h = delta.dims()[2];
                for (jj, &ri) in chunk.iter().enumerate() {
                    self.add_scores(ri, *pt, &per, jj, n, h, scale, scores);
                }
            }
            passes += 2;
            progress.inc(1);
        }
        Ok(passes)
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
