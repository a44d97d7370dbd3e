//! Pass 2 with replicas (the reference, [`Pass2::Replicas`]): one forward of every
//! receiving prompt per receiver (the rows of receiver v form its replica), every sender
//! output replaced by its value plus a gradient leaf (the stream reaching any input is
//! the same, but no gradient flows through a node's own computation), and one backward
//! of `sum_v <G_v, act_v>` over the replicas (the logits replica reads `M` itself): the
//! leaf gradient of sender u in replica v is `dM/d(input of v)` along the direct path
//! from u. An MLP receiver's replica keeps its own output live (the functional reads
//! it). The fallback for a model without a stream API, and what the local pass is
//! tested against.

use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::hooks::{Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use crate::model::grad::grad_at_leaves;

use super::eap::{
    Dots, EdgeRun, Sink, StateInputs, all_tokens, as4, cached, receiver_term, repeat, rows_of,
};
use super::graph::ReceiverNode;

#[cfg(doc)]
use super::eap::Pass2;

impl EdgeRun<'_> {
    /// Pass 2 at a state: the replicas of every receiver, `max_rows` rows at a time;
    /// adds `scale x` each edge's per-prompt score to the sink's scores. Returns the
    /// forwards run (a backward counted as one).
    pub(super) fn replica_passes(
        &self,
        inp: &StateInputs,
        g: &ActivationCache,
        sink: &mut Sink,
    ) -> Result<usize> {
        let n = inp.sub.n();
        let per = (self.max_rows / n.max(1)).max(1);
        let receivers: Vec<usize> = (0..self.graph.receivers.len()).collect();
        let mut passes = 0;
        for chunk in receivers.chunks(per) {
            self.replica_chunk(inp, g, chunk, sink.scores)?;
            passes += 2;
            sink.progress.inc(1);
        }
        Ok(passes)
    }

    /// The replicas of the receivers `chunk`: one forward + backward.
    fn replica_chunk(
        &self,
        inp: &StateInputs,
        g: &ActivationCache,
        chunk: &[usize],
        scores: &mut [Vec<f32>],
    ) -> Result<()> {
        let StateInputs {
            st, sub, deltas, ..
        } = *inp;
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
        for (pt, a) in &st.held {
            base = base.intervene_point(*pt, Action::Replace(repeat(a, c)?), Scope::all());
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
                let term = receiver_term(r, j, Some(&out.logits), &out.cache, inp, g)?;
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
            let dots = Dots {
                pt: *pt,
                per: &per,
                n,
                h,
            };
            for (j, &ri) in chunk.iter().enumerate() {
                self.add_scores(ri, j, &dots, inp, scores);
            }
        }
        Ok(())
    }
}
