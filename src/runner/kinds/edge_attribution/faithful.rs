//! Faithfulness of a circuit: the clean prompts run with only the circuit's edges
//! carrying the clean (circuit) values and every other edge the corrupted run's value
//! (corrupted-run edge ablation); the logit difference it recovers.
//!
//! Edges are ablated exactly, layer by layer, with replicas (every receiver sees its
//! own mixture of sender values):
//! - **attention inputs of layer l**: one forward of the prompts once per receiver of
//!   the layer, with every earlier sender output replaced, per replica and head slice,
//!   by its circuit value where the edge into that receiver is kept and by the
//!   corrupted run's value where not; each replica's receiver activation is read.
//! - **head outputs of layer l**: one forward with the layer's q / k / v / entries
//!   replaced by those circuit activations (and every earlier sender output by its
//!   circuit value); `hook_z` read.
//! - **the MLP of layer l** and **the logits**: the same mixture for their own input; the
//!   MLP output and the logit difference read.
//!
//! With every edge kept this is the clean run; with none, the corrupted run (read at
//! the clean prompts' answer): the recovered fraction
//! `(LD_circuit - LD_corrupt) / (LD_clean - LD_corrupt)` runs from 0 to 1.

use burn::tensor::{Bool, Tensor, TensorData};

use crate::error::{Error, Result};
use crate::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::LanguageModel;

use super::super::super::patching::{Prompts, Target, readout};
use super::eap::rows_of;
use super::graph::{Graph, ReceiverNode};

fn cached(c: &ActivationCache, p: &HookPoint) -> Result<Act> {
    c.get(p)
        .cloned()
        .ok_or_else(|| Error::hook(p.to_string(), "the model did not produce this activation"))
}

/// Per replica row block (n rows each) and head: whether to take `keep` (else `base`),
/// for a rank-3 or rank-4 activation of `c * n` rows; `heads` = the point's head axis
/// length (1 for rank 3).
fn mix(base: &Act, keep: &Act, take: &[Vec<bool>], n: usize) -> Result<Act> {
    let c = take.len();
    let rank = base.shape().len();
    let (b4, k4) = (
        super::eap::as4(base)?.repeat_dim(0, c),
        super::eap::as4(keep)?.repeat_dim(0, c),
    );
    let [rows, t, h, d] = b4.dims();
    let mut mask = Vec::with_capacity(rows * h);
    for tk in take {
        for _ in 0..n {
            mask.extend_from_slice(&tk[..h]);
        }
    }
    let m = Tensor::<4, Bool>::from_data(TensorData::new(mask, [rows, 1, h, 1]), &b4.device())
        .expand([rows, t, h, d]);
    let out = b4.mask_where(m, k4);
    Ok(if rank == 3 {
        Act::new(out.reshape([rows, t, d]))
    } else {
        Act::new(out)
    })
}

/// The clean-orientation LD of every clean prompt (`0..n` of the pairs) when only the
/// edges with `keep[e]` carry circuit values.
pub fn circuit_ld(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    graph: &Graph,
    keep: &[bool],
    max_rows: usize,
) -> Result<Vec<f32>> {
    if keep.len() != graph.edges.len() {
        return Err(Error::Other(format!(
            "{} keep flags for {} edges",
            keep.len(),
            graph.edges.len()
        )));
    }
    let n = prompts.n() / 2;
    let device = model.device();
    let nl = graph.n_layers;
    let clean_rows: Vec<usize> = (0..n).collect();
    let corrupt_rows: Vec<usize> = (n..2 * n).collect();
    let mut pts: Vec<HookPoint> = graph.senders.iter().map(|s| s.point()).collect();
    pts.extend(graph.receivers.iter().filter_map(|r| r.point()));
    pts.sort();
    pts.dedup();
    let mut spec = HookSpec::new();
    for p in &pts {
        spec = spec.capture_point(*p);
    }
    let corr = model
        .forward(prompts.tokens_of(&corrupt_rows, &device), &spec)?
        .cache;
    let clean = model
        .forward(prompts.tokens_of(&clean_rows, &device), &spec)?
        .cache;
    let sub = rows_of(prompts, &clean_rows);
    // Circuit values of the senders so far.
    let mut circ = ActivationCache::new();
    let ep = HookPoint::global(Site::Embed);
    circ.insert(ep, cached(&clean, &ep)?);
    // For sender point p and receiver ri: per head (or one flag), whether kept.
    let kept = |p: &HookPoint, heads: usize, ri: usize| -> Vec<bool> {
        let mut v = vec![false; heads];
        for e in graph
            .edges
            .iter()
            .zip(keep)
            .filter(|(e, k)| **k && e.receiver == ri)
        {
            let s = graph.senders[e.0.sender];
            if s.point() == *p {
                v[s.head().unwrap_or(0)] = true;
            }
        }
        v
    };
    // A replicated forward for receivers `ris` (all reading after the senders in
    // `circ`): the mixed sender values, the captures `caps`.
    let replicas = |circ: &ActivationCache,
                    ris: &[usize],
                    caps: &[HookPoint],
                    live_mlp: Option<usize>|
     -> Result<crate::model::ForwardOutput> {
        let c = ris.len();
        let rows: Vec<usize> = (0..c).flat_map(|_| 0..n).collect();
        let rep = rows_of(&sub, &rows);
        let mut spec = HookSpec::new();
        let mut points: Vec<HookPoint> = circ.iter().map(|(p, _)| *p).collect();
        points.sort();
        for p in points {
            if live_mlp.is_some_and(|l| p == HookPoint::block(l, Site::MlpOut)) {
                continue;
            }
            let keep_v = cached(circ, &p)?;
            let heads = super::eap::as4(&keep_v)?.dims()[2];
            let take: Vec<Vec<bool>> = ris.iter().map(|&ri| kept(&p, heads, ri)).collect();
            let m = mix(&cached(&corr, &p)?, &keep_v, &take, n)?;
            spec = spec.intervene_point(p, Action::Replace(m), Scope::all());
        }
        for p in caps {
            spec = spec.capture_point(*p);
        }
        let all: Vec<usize> = (0..rep.n()).collect();
        model.forward(rep.tokens_of(&all, &device), &spec)
    };
    for l in 0..nl {
        // Attention inputs of layer l, in chunks of replicas.
        let ris: Vec<usize> = graph
            .receivers
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r, ReceiverNode::Attn { layer, .. } if *layer == l))
            .map(|(i, _)| i)
            .collect();
        let mut recv_vals: Vec<(HookPoint, Act)> = Vec::new();
        let per = (max_rows / n.max(1)).max(1);
        for chunk in ris.chunks(per) {
            let caps: Vec<HookPoint> = {
                let mut v: Vec<HookPoint> = chunk
                    .iter()
                    .filter_map(|&ri| graph.receivers[ri].point())
                    .collect();
                v.sort();
                v.dedup();
                v
            };
            let out = replicas(&circ, chunk, &caps, None)?;
            for (j, &ri) in chunk.iter().enumerate() {
                let r = graph.receivers[ri];
                let p = r.point().expect("attention receivers have a point");
                let a = super::eap::as4(&cached(&out.cache, &p)?)?;
                let [_, t, h, d] = a.dims();
                let a = a.slice([j * n..(j + 1) * n, 0..t, 0..h, 0..d]);
                let hd = r.head().unwrap_or(0);
                // Start from the clean values; overwrite this receiver's head slice.
                let idx = match recv_vals.iter().position(|(q, _)| *q == p) {
                    Some(i) => i,
                    None => {
                        recv_vals.push((p, cached(&clean, &p)?));
                        recv_vals.len() - 1
                    }
                };
                let cur = recv_vals[idx].1.get::<4>()?;
                let mut take = vec![false; h];
                take[hd] = true;
                let m = Tensor::<4, Bool>::from_data(
                    TensorData::new(take, [1, 1, h, 1]),
                    &cur.device(),
                )
                .expand([n, t, h, d]);
                recv_vals[idx].1 = Act::new(cur.mask_where(m, a));
            }
        }
        // Head outputs of layer l.
        let mut spec = HookSpec::new();
        for (p, a) in circ.iter() {
            spec = spec.intervene_point(*p, Action::Replace(a.clone()), Scope::all());
        }
        for (p, a) in &recv_vals {
            spec = spec.intervene_point(*p, Action::Replace(a.clone()), Scope::all());
        }
        let zp = HookPoint::block(l, Site::AttnZ);
        spec = spec.capture_point(zp);
        let out = model.forward(sub.tokens_of(&clean_rows, &device), &spec)?;
        circ.insert(zp, cached(&out.cache, &zp)?);
        // The MLP of layer l.
        let mp = HookPoint::block(l, Site::MlpOut);
        let mi = graph
            .receivers
            .iter()
            .position(|r| *r == ReceiverNode::Mlp { layer: l });
        match mi {
            Some(ri) => {
                let out = replicas(&circ, &[ri], &[mp], Some(l))?;
                circ.insert(mp, cached(&out.cache, &mp)?);
            }
            None => {
                circ.insert(mp, cached(&clean, &mp)?);
            }
        }
    }
    let li = graph
        .receivers
        .iter()
        .position(|r| *r == ReceiverNode::Logits)
        .ok_or_else(|| Error::Other("the graph has no logits receiver".into()))?;
    let out = replicas(&circ, &[li], &[], None)?;
    let targets: Vec<&Target> = sub.targets.iter().collect();
    Ok(readout(out.logits, &targets)?
        .iter()
        .map(|o| o.ld)
        .collect())
}

/// The edges ranked by |total score| (largest first).
pub fn ranked_edges(scores: &[Vec<f32>]) -> Vec<usize> {
    let tot: Vec<f64> = scores
        .iter()
        .map(|v| v.iter().map(|&x| x as f64).sum::<f64>())
        .collect();
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| tot[b].abs().total_cmp(&tot[a].abs()).then(a.cmp(&b)));
    idx
}

/// Keep flags of the top `k` edges of `ranked`.
pub fn top_k_keep(ranked: &[usize], k: usize) -> Vec<bool> {
    let mut keep = vec![false; ranked.len()];
    for &e in ranked.iter().take(k) {
        keep[e] = true;
    }
    keep
}
