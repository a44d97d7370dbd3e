//! The gradient of a scalar metric of the logits at hook points: the one primitive the
//! attribution estimators (AtP at `hook_z`, AtP* at `hook_q` / `hook_k` /
//! `hook_pattern`) share.
//!
//! At every point a zero tensor that requires a gradient is added (`Action::Add`; the
//! model's weights stay constants), the model runs ONCE on the autodiff view of its
//! device, and ONE backward of `metric(logits)` gives `d metric / d activation` at every
//! point: the gradient of the metric with respect to the activation there, for every
//! prompt, position and head at once.

use burn::tensor::{Int, Tensor};

use super::{ForwardOutput, LanguageModel};
use crate::error::{Error, Result};
use crate::hooks::{Act, Action, HookPoint, HookSpec, Scope};

/// A point to differentiate at and the shape of its activation.
#[derive(Debug, Clone, Copy)]
pub struct GradPoint {
    pub point: HookPoint,
    /// The activation's shape at `point` for the batch (e.g. `[b, T, n_heads, d_head]`
    /// at `hook_z`).
    pub shape: [usize; 4],
}

/// What [`grad_at_points`] returns.
pub struct PointGrads {
    /// The forward's output: its logits (on the autodiff view; `.inner()` for values)
    /// and the activations it captured.
    pub out: ForwardOutput,
    /// Per point, in the order asked: the gradient of the metric there (the point's
    /// shape, on the model's device).
    pub grads: Vec<Tensor<4>>,
}

/// One forward of `tokens` with a gradient leaf at every point of `points`, capturing
/// `captures`, and one backward of `metric(logits)`. An error names a point the
/// gradient did not reach (a point the model does not run).
pub fn grad_at_points(
    model: &dyn LanguageModel,
    tokens: Tensor<2, Int>,
    points: &[GradPoint],
    captures: &[HookPoint],
    metric: impl FnOnce(Tensor<3>) -> Result<Tensor<1>>,
) -> Result<PointGrads> {
    let ad = model.device().autodiff();
    let mut spec = HookSpec::new();
    let mut leaves = Vec::with_capacity(points.len());
    for p in points {
        let leaf = Tensor::<4>::zeros(p.shape, &ad).require_grad();
        spec = spec.intervene_point(p.point, Action::Add(Act::new(leaf.clone())), Scope::all());
        leaves.push(leaf);
    }
    for &c in captures {
        spec = spec.capture_point(c);
    }
    let out = model.forward(tokens, &spec)?;
    let backward = metric(out.logits.clone())?.backward();
    let grads = points
        .iter()
        .zip(&leaves)
        .map(|(p, leaf)| {
            leaf.grad(&backward).ok_or_else(|| {
                Error::hook(
                    p.point.to_string(),
                    "no gradient reached this point (does the model run it?)",
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(PointGrads { out, grads })
}
