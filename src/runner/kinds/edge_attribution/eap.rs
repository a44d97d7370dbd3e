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
//!    raw-slot path only while every other layer's entries stay live (with replicas;
//!    the local pass subtracts the entries' share instead).
//! 2. **Receiver inputs**: `dM/d(input of v)` along the direct path from every sender
//!    u into v (every other node output held). Locally where the model offers a
//!    [`StreamModel`] ([`Pass2::Local`], `local.rs`: vector-Jacobian products through
//!    each stream point's input computation, and the stream-only transport linearised
//!    once per state), else with one replica forward of the whole model per receiver
//!    ([`Pass2::Replicas`], `replicas.rs`: the reference the tests compare the local
//!    pass with, to float rounding). The score is the sender's change `a_partner(u) -
//!    a(u)` dotted with that derivative.
//!
//! EAP evaluates both passes at the receiving prompts. EAP-IG (`steps = m`) averages
//! the gradients over the inputs `e + k/m (e_partner - e)`, k = 1..m, of the token
//! embeddings (`hook_embed` replaced by the interpolation; the senders' values are
//! those of the interpolated run).

use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
#[cfg(doc)]
use crate::model::StreamModel;
use crate::model::grad::grad_at_leaves;
use crate::model::{LanguageModel, StreamPoint};

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
    /// [`Method::EapIg`] with every indexer's selection (`hook_selected`, DeepSeek-V4
    /// CSA) held at the clean run's in the interpolated states, so that the path
    /// crosses no jump of the indexer's top-k (the MoE router's top-k still moves).
    EapIgHeld { steps: usize },
}

impl Method {
    /// `eap`, `eapig`.
    pub fn name(self) -> &'static str {
        match self {
            Method::Eap => "eap",
            Method::EapIg { .. } => "eapig",
            Method::EapIgHeld { .. } => "eapig_held",
        }
    }
}

/// How pass 2 (the direct-path derivative into every receiver) is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass2 {
    /// Local vector-Jacobian products at each stream point and the linearised transport:
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
pub(super) fn all_tokens(
    p: &Prompts,
    device: &burn::tensor::Device,
) -> Tensor<2, burn::tensor::Int> {
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
pub(super) fn repeat(a: &Act, c: usize) -> Result<Act> {
    Ok(match a.shape().len() {
        3 => Act::new(a.get::<3>()?.repeat_dim(0, c)),
        _ => Act::new(a.get::<4>()?.repeat_dim(0, c)),
    })
}

pub(super) fn cached<'c>(cache: &'c ActivationCache, p: &HookPoint) -> Result<&'c Act> {
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
pub(super) fn entry_points(g: &Graph) -> Vec<HookPoint> {
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
pub(super) fn stream_point(r: ReceiverNode) -> StreamPoint {
    match r {
        ReceiverNode::Attn { layer, .. } => StreamPoint::Attn(layer),
        ReceiverNode::Mlp { layer } => StreamPoint::Mlp(layer),
        ReceiverNode::Logits => StreamPoint::Final,
    }
}

/// The hook point holding the stream at `p` (`Final`: the last block's
/// `hook_resid_post`).
pub(super) fn stream_hook(p: StreamPoint, n_layers: usize) -> Result<HookPoint> {
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

/// The term `<G_v, act_v>` of receiver `r` whose rows are block `j` (of the receiving
/// prompts) of a batch: from the captured activation at its point (head slice, against
/// the pass-1 gradient `g`), or the logits (the metric's weights).
pub(super) fn receiver_term(
    r: ReceiverNode,
    j: usize,
    logits: Option<&Tensor<3>>,
    cache: &ActivationCache,
    inp: &StateInputs,
    g: &ActivationCache,
) -> Result<Tensor<1>> {
    let (sub, w) = (inp.sub, inp.w);
    let n = sub.n();
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
pub(super) struct State {
    pub(super) embed: Option<Act>,
    /// Replacements every forward at this state applies (rows = the receiving
    /// prompts): the held indexer selections of [`Method::EapIgHeld`].
    pub(super) held: Vec<(HookPoint, Act)>,
    /// Values of every sender point, every receiver point and the entries at this
    /// state (rows = the receiving prompts).
    pub(super) cache: ActivationCache,
}

/// Pass 2's inputs at one state: the state, the receiving prompts and their metric
/// weights, the senders' deltas (per sender point, `[n, T, H|1, d]`), the state's
/// weight in the average over states and the edges into each receiver.
#[derive(Clone, Copy)]
pub(super) struct StateInputs<'s> {
    pub(super) st: &'s State,
    pub(super) sub: &'s Prompts,
    pub(super) w: &'s [f32],
    pub(super) deltas: &'s [(HookPoint, Tensor<4>)],
    pub(super) scale: f32,
    /// Per receiver, the indices of the edges into it.
    pub(super) into: &'s [Vec<usize>],
}

/// Where pass 2 writes: per edge, per receiving prompt, the summed scores; the progress.
pub(super) struct Sink<'s> {
    pub(super) scores: &'s mut [Vec<f32>],
    pub(super) progress: &'s mut Progress,
}

/// One sender point's dot products with `m` receivers' gradients, `per[(j n + i) H +
/// head]` (receiver block j, prompt i of n, head of H).
pub(super) struct Dots<'s> {
    pub(super) pt: HookPoint,
    pub(super) per: &'s [f32],
    pub(super) n: usize,
    pub(super) h: usize,
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
        let hold = matches!(method, Method::EapIgHeld { .. });
        if hold {
            for l in 0..nl {
                spec = spec.capture_point(HookPoint::block(l, Site::IndexerSelected));
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
        // The clean prompts' indexer selections, row i for receiving prompt i.
        let mut held = Vec::new();
        if hold {
            let clean: Vec<usize> = (0..n).collect();
            for l in 0..nl {
                let pt = HookPoint::block(l, Site::IndexerSelected);
                if let Some(a) = plain.get(&pt) {
                    held.push((pt, a.select_batch(&clean)?));
                }
            }
            if held.is_empty() {
                return Err(Error::Other(
                    "EAP-IG with the selection held: the model has no indexer (hook_selected)"
                        .into(),
                ));
            }
        }
        let states: Vec<State> = match method {
            Method::Eap => vec![State {
                embed: None,
                held: Vec::new(),
                cache: plain.select_batch(&recv)?,
            }],
            Method::EapIg { steps } | Method::EapIgHeld { steps } => {
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
                    for (pt, a) in &held {
                        spec = spec.intervene_point(*pt, Action::Replace(a.clone()), Scope::all());
                    }
                    let o = self.model.forward(all_tokens(&sub, &device), &spec)?;
                    v.push(State {
                        embed: Some(emb),
                        held: held.clone(),
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
        let mut into = vec![Vec::new(); self.graph.receivers.len()];
        for (ei, e) in self.graph.edges.iter().enumerate() {
            into[e.receiver].push(ei);
        }
        let mut local_passes = 0;
        for st in &states {
            let t0 = Instant::now();
            let g = self.receiver_grads(st, &sub, &w, stream.is_none())?;
            timing.pass1 += t0.elapsed().as_secs_f64();
            passes += 2;
            let inp = StateInputs {
                st,
                sub: &sub,
                w: &w,
                deltas: &deltas,
                scale,
                into: &into,
            };
            let mut sink = Sink {
                scores: &mut scores,
                progress: &mut *progress,
            };
            match stream {
                None => {
                    let t0 = Instant::now();
                    passes += self.replica_passes(&inp, &g, &mut sink)?;
                    timing.replicas += t0.elapsed().as_secs_f64();
                }
                Some(sm) => {
                    local_passes += self.local_passes(sm, &inp, g, &mut sink, &mut timing)?;
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
        for (pt, a) in &st.held {
            base = base.intervene_point(*pt, Action::Replace(repeat(a, copies)?), Scope::all());
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

    /// Rows per local pass: `max_rows` bounds a full-model forward, and a local pass
    /// holds about one layer's activations per row (the stream transport less), so it
    /// takes `n_layers x max_rows`.
    pub(super) fn local_rows(&self) -> usize {
        self.max_rows.saturating_mul(self.graph.n_layers.max(1))
    }

    /// Add `inp.scale x dots.per[(jj n + i) H + head]` to every edge into receiver
    /// `ri` from a sender at `dots.pt`.
    pub(super) fn add_scores(
        &self,
        ri: usize,
        jj: usize,
        dots: &Dots,
        inp: &StateInputs,
        scores: &mut [Vec<f32>],
    ) {
        let graph = self.graph;
        let (n, h) = (dots.n, dots.h);
        for &ei in &inp.into[ri] {
            let s = graph.senders[graph.edges[ei].sender];
            if s.point() != dots.pt {
                continue;
            }
            let hd = s.head().unwrap_or(0);
            for (i, x) in scores[ei].iter_mut().enumerate().take(n) {
                *x += inp.scale * dots.per[(jj * n + i) * h + hd];
            }
        }
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
