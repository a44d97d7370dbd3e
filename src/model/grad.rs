//! The gradient of a scalar metric of the logits at hook points: the one primitive the
//! attribution estimators (AtP at `hook_z`, AtP* at `hook_q` / `hook_k` /
//! `hook_pattern`) share.
//!
//! At every point a zero tensor that requires a gradient is added (`Action::Add`; the
//! model's weights stay constants), the model runs ONCE on the autodiff view of its
//! device, and ONE backward of `metric(logits)` gives `d metric / d activation` at every
//! point: the gradient of the metric with respect to the activation there, for every
//! prompt, position and head at once. [`grad_at_leaves`] is the general form (leaves of
//! rank 3 or 4 on top of other interventions, a metric of the whole forward output) that
//! edge attribution uses.

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
    let leaves: Vec<(HookPoint, Vec<usize>)> =
        points.iter().map(|p| (p.point, p.shape.to_vec())).collect();
    let (out, grads) = grad_at_leaves(
        model,
        tokens,
        HookSpec::new(),
        &leaves,
        captures,
        |out: &ForwardOutput| metric(out.logits.clone()),
    )?;
    let grads = grads
        .into_iter()
        .map(|g| g.get::<4>())
        .collect::<Result<Vec<_>>>()?;
    Ok(PointGrads { out, grads })
}

/// The general form of [`grad_at_points`]: leaves of rank 3 or 4 (`[b, T, d_model]`
/// points such as `hook_embed` / `hook_mlp_out`, or `[b, T, heads, d_head]`), on top of
/// the interventions of `base` (which apply BEFORE the leaf at the same point: e.g.
/// `Replace` a point by a constant so that the gradient there flows no further back),
/// and a metric of the whole forward output (logits and captured activations, e.g. a
/// linear functional of a captured activation). Returns the forward's output and the
/// gradient at every leaf, in the order asked.
pub fn grad_at_leaves(
    model: &dyn LanguageModel,
    tokens: Tensor<2, Int>,
    base: HookSpec,
    leaves: &[(HookPoint, Vec<usize>)],
    captures: &[HookPoint],
    metric: impl FnOnce(&ForwardOutput) -> Result<Tensor<1>>,
) -> Result<(ForwardOutput, Vec<Act>)> {
    enum Leaf {
        R3(Tensor<3>),
        R4(Tensor<4>),
    }
    let ad = model.device().autodiff();
    let mut spec = base;
    let mut made = Vec::with_capacity(leaves.len());
    for (point, shape) in leaves {
        let (leaf, act) = match shape.as_slice() {
            &[a, b, c] => {
                let t = Tensor::<3>::zeros([a, b, c], &ad).require_grad();
                (Leaf::R3(t.clone()), Act::new(t))
            }
            &[a, b, c, d] => {
                let t = Tensor::<4>::zeros([a, b, c, d], &ad).require_grad();
                (Leaf::R4(t.clone()), Act::new(t))
            }
            other => {
                return Err(Error::hook(
                    point.to_string(),
                    format!("a gradient leaf must have rank 3 or 4, got shape {other:?}"),
                ));
            }
        };
        spec = spec.intervene_point(*point, Action::Add(act), Scope::all());
        made.push(leaf);
    }
    for &c in captures {
        spec = spec.capture_point(c);
    }
    let out = model.forward(tokens, &spec)?;
    let backward = metric(&out)?.backward();
    let grads = leaves
        .iter()
        .zip(&made)
        .map(|((p, _), leaf)| {
            let g = match leaf {
                Leaf::R3(t) => t.grad(&backward).map(Act::new),
                Leaf::R4(t) => t.grad(&backward).map(Act::new),
            };
            g.ok_or_else(|| {
                Error::hook(
                    p.to_string(),
                    "no gradient reached this point (does the model run it?)",
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((out, grads))
}
