//! AtP at `hook_z`: the first-order estimate of patching every head at every position
//! (see the kind's docs in mod.rs), from one gradient ([`crate::model::grad`]), and
//! its per-group store entry (resume).

use burn::tensor::Tensor;

use super::super::super::heads::Direction;
use super::super::super::patching::{Outcome, Prompts, Target, readout};
use super::super::Ctx;
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, Site};
use crate::model::LanguageModel;
use crate::model::grad::{GradPoint, grad_at_points};

use super::{AtpTerms, weighted_ld, weights};

/// One forward over the clean and corrupted prompts with a gradient leaf at
/// `hook_z` of every layer of `layers`, one backward of the summed logit differences
/// (clean orientation), and the first-order patching terms of every head and position.
/// Prompts `0..n` must be clean and `n..2n` their partners, each with an `alt` answer.
pub fn atp_terms(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    layers: &[usize],
    directions: &[Direction],
) -> Result<AtpTerms> {
    let n2 = prompts.n();
    if n2 == 0 || !n2.is_multiple_of(2) {
        return Err(Error::Other(format!(
            "attribution patching needs clean/corrupted pairs, got {n2} prompts"
        )));
    }
    let n = n2 / 2;
    let len = prompts.len;
    let info = model.info();
    let points: Vec<GradPoint> = layers
        .iter()
        .map(|&l| GradPoint {
            point: HookPoint::block(l, Site::AttnZ),
            shape: [n2, len, info.layers[l].n_heads, info.d_head],
        })
        .collect();
    let heads: Vec<usize> = points.iter().map(|p| p.shape[2]).collect();
    let zs: Vec<HookPoint> = points.iter().map(|p| p.point).collect();
    let all: Vec<usize> = (0..n2).collect();
    // The LD of every prompt at its first target position, weighted by direction.
    let run = grad_at_points(
        model,
        prompts.tokens_of(&all, &model.device()),
        &points,
        &zs,
        |logits| weighted_ld(logits, prompts, weights(n, directions)),
    )?;
    let targets: Vec<&Target> = prompts.targets.iter().collect();
    let base = readout(run.out.logits.clone().inner(), &targets)?;

    let mut terms = vec![Vec::with_capacity(layers.len()); directions.len()];
    for (p, grad) in zs.iter().zip(run.grads) {
        let z = run
            .out
            .cache
            .get(p)
            .ok_or_else(|| Error::hook(p.to_string(), "not captured"))?
            .get::<4>()?
            .inner();
        for (di, t) in z_terms(z, grad, directions)?.into_iter().enumerate() {
            terms[di].push(t);
        }
    }
    Ok(AtpTerms {
        base,
        n,
        len,
        terms,
        heads,
    })
}

/// One layer's first-order terms per direction, from its `hook_z` and the gradient
/// there (both `[2n, len, heads, d_head]`): `[n, len, heads]` row-major each.
fn z_terms(z: Tensor<4>, grad: Tensor<4>, directions: &[Direction]) -> Result<Vec<Vec<f32>>> {
    let [n2, len, h, dh] = z.dims();
    let n = n2 / 2;
    let (zc, zx) = (
        z.clone().slice([0..n, 0..len, 0..h, 0..dh]),
        z.slice([n..n2, 0..len, 0..h, 0..dh]),
    );
    let mut out = Vec::with_capacity(directions.len());
    for d in directions {
        let (delta, gr) = match d {
            Direction::Denoise => (
                zc.clone() - zx.clone(),
                grad.clone().slice([n..n2, 0..len, 0..h, 0..dh]),
            ),
            Direction::Noise => (
                zx.clone() - zc.clone(),
                grad.clone().slice([0..n, 0..len, 0..h, 0..dh]),
            ),
        };
        let term = (delta * gr).sum_dim(3).reshape([n * len * h]);
        out.push(term.try_into_vec_as::<f32>()?);
    }
    Ok(out)
}

/// The store key of a group's AtP terms.
fn terms_key(r: u32) -> String {
    format!("p{r}-atp")
}

/// AtP terms of a group, from the store or computed (and stored): one outcome vector
/// per (direction, layer, query head, position) with the per-prompt term in `ld`,
/// then the base outcomes.
pub(super) fn group_terms(
    ctx: &Ctx,
    r: u32,
    prompts: &Prompts,
    layers: &[usize],
    dirs: &[Direction],
) -> Result<AtpTerms> {
    let n = prompts.n() / 2;
    let len = prompts.len;
    let heads: Vec<usize> = layers.iter().map(|&l| ctx.info.layers[l].n_heads).collect();
    let per_dir: usize = heads.iter().map(|h| h * len).sum();
    let mut expected = vec![n; dirs.len() * per_dir];
    expected.push(2 * n);
    if let Some(mut stored) = ctx.store.load(&terms_key(r), &expected)? {
        let base = stored.pop().expect("the base vector was expected");
        let mut it = stored.into_iter();
        let mut terms = Vec::new();
        for _ in dirs {
            let mut per_layer = Vec::new();
            for &h in &heads {
                let mut t = vec![0f32; n * len * h];
                for q in 0..h {
                    for p in 0..len {
                        let v = it.next().expect("sizes checked by the store");
                        for (i, o) in v.iter().enumerate() {
                            t[(i * len + p) * h + q] = o.ld;
                        }
                    }
                }
                per_layer.push(t);
            }
            terms.push(per_layer);
        }
        return Ok(AtpTerms {
            base,
            n,
            len,
            terms,
            heads,
        });
    }
    let got = atp_terms(ctx.model, prompts, layers, dirs)?;
    let mut save = Vec::with_capacity(expected.len());
    for per_layer in &got.terms {
        for (t, &h) in per_layer.iter().zip(&heads) {
            for q in 0..h {
                for p in 0..len {
                    save.push(
                        (0..n)
                            .map(|i| Outcome {
                                correct: false,
                                ld: t[(i * len + p) * h + q],
                            })
                            .collect(),
                    );
                }
            }
        }
    }
    save.push(got.base.clone());
    ctx.store.save(&terms_key(r), &save)?;
    Ok(got)
}
