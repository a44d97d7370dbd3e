//! Naming where a forward pass first went non-finite.
//!
//! The runner and the trainer check the logits they read (and the loss) for NaN and
//! infinities. On that failure path only, [`first_non_finite`] reruns the forward with
//! the residual stream and the sublayer outputs captured and walks them in forward
//! order: the first hook point holding a NaN or an infinity is where the numbers broke
//! (`blocks.3.hook_attn_out`: the attention of layer 3). Nothing is captured on the
//! normal path.

use burn::tensor::{Int, Tensor};

use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookSpec, Site};

use super::LanguageModel;

/// Part of every message that names where the values went non-finite (callers do
/// not diagnose such an error a second time).
pub const LOCATED: &str = "first non-finite";

/// The residual stream and sublayer outputs, in the order a block computes them.
const BLOCK_ORDER: [Site; 5] = [
    Site::ResidPre,
    Site::AttnOut,
    Site::ResidMid,
    Site::MlpOut,
    Site::ResidPost,
];

/// Forward position of a captured point: the embedding, then each block's points in
/// [`BLOCK_ORDER`], then the final norm.
fn order(p: &HookPoint) -> (usize, usize) {
    match (p.layer, p.site) {
        (None, Site::Embed) => (0, 0),
        (Some(l), s) => (
            l + 1,
            BLOCK_ORDER
                .iter()
                .position(|&b| b == s)
                .unwrap_or(BLOCK_ORDER.len()),
        ),
        (None, _) => (usize::MAX, 0),
    }
}

/// Counts of NaN and infinite values.
pub fn count_non_finite(values: &[f32]) -> (usize, usize) {
    values.iter().fold((0, 0), |(n, i), x| {
        (n + x.is_nan() as usize, i + x.is_infinite() as usize)
    })
}

/// What the hook point is, in words.
fn describe(p: &HookPoint) -> String {
    match (p.layer, p.site) {
        (None, Site::Embed) => "the token embedding".into(),
        (Some(l), Site::ResidPre) => format!("the residual stream entering layer {l}"),
        (Some(l), Site::AttnOut) => format!("the attention sublayer of layer {l}"),
        (Some(l), Site::ResidMid) => format!("the residual stream after layer {l}'s attention"),
        (Some(l), Site::MlpOut) => format!("the MLP / MoE sublayer of layer {l}"),
        (Some(l), Site::ResidPost) => format!("the residual stream leaving layer {l}"),
        (None, Site::FinalNorm) => "the final norm".into(),
        _ => p.to_string(),
    }
}

/// Rerun `tokens` (`[batch, pos]`) with the residual stream and sublayer outputs
/// captured and name the first point (in forward order) holding NaN or infinite
/// values; `Ok(None)` when all of them and the logits are finite.
pub fn first_non_finite(
    model: &dyn LanguageModel,
    tokens: Tensor<2, Int>,
) -> Result<Option<String>> {
    let mut spec = HookSpec::new()
        .capture("hook_embed")?
        .capture("hook_final_norm")?;
    for s in BLOCK_ORDER {
        spec = spec.capture(&format!("blocks.*.{}", s.info().suffix))?;
    }
    let out = model.forward(tokens, &spec)?;
    let mut points: Vec<_> = out.cache.iter().collect();
    points.sort_by_key(|(p, _)| order(p));
    let mut last_finite: Option<&HookPoint> = None;
    for (p, act) in points {
        let v = act.to_vec();
        let (nan, inf) = count_non_finite(&v);
        if nan + inf > 0 {
            let after = last_finite
                .map(|q| format!("; {q} before it is finite"))
                .unwrap_or_default();
            return Ok(Some(format!(
                "`{p}` ({}) is the first non-finite activation: {nan} NaN and {inf} infinite of {} values{after}",
                describe(p),
                v.len()
            )));
        }
        last_finite = Some(p);
    }
    let logits: Vec<f32> = out.logits.try_into_vec_as::<f32>()?;
    let (nan, inf) = count_non_finite(&logits);
    if nan + inf > 0 {
        return Ok(Some(format!(
            "the logits (the LM head) are the first non-finite values: {nan} NaN and {inf} infinite of {}; every captured activation before them is finite",
            logits.len()
        )));
    }
    Ok(None)
}

/// The error for non-finite `what` (e.g. "logits of prompts 0..64"), naming the first
/// non-finite hook point of a diagnostic forward over `tokens` when there is one.
pub fn non_finite_error(model: &dyn LanguageModel, tokens: Tensor<2, Int>, what: &str) -> Error {
    match first_non_finite(model, tokens) {
        Ok(Some(at)) => Error::NonFinite(format!("{what}: {at}")),
        Ok(None) => Error::NonFinite(format!(
            "{what}; a plain forward of the same tokens is finite at every layer (no layer is the {LOCATED} one), so an intervention (or the loss) made them non-finite"
        )),
        Err(e) => Error::NonFinite(format!(
            "{what} (the diagnostic forward that would name the layer failed: {e})"
        )),
    }
}

/// Whether every value of `t` is finite (one read-back of a boolean).
pub fn all_finite<const D: usize>(t: &Tensor<D>) -> Result<bool> {
    Ok(t.clone()
        .is_finite()
        .all()
        .try_into_vec_as::<bool>()?
        .first()
        .copied()
        .unwrap_or(true))
}
