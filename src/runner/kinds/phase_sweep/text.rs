//! phase-sweep on the text tasks (`[task] kind = "passkey" | "needle"`): one forward
//! per prompt, read at the value's positions (teacher forcing). A prompt is correct
//! when the top-1 token over the full vocabulary is the value's token at every
//! position; its logit difference is the value's first token against the best wrong
//! value's first token at the first position. Chunks of `max_rows` prompts are
//! persisted as shards (resume).

use burn::tensor::{Int, Tensor, TensorData};

use crate::error::{Error, Result};
use crate::tasks::{Protocol, TextNeedleExample, text_cut_len};

use super::super::super::patching::Outcome;
use super::super::Ctx;
use super::PhaseSweep;

/// What one protocol's prompts gave: `(logical, phase, correct)` and
/// `(logical, phase, logit difference)` per prompt.
pub(super) struct TextObs {
    pub proto: Protocol,
    pub correct: Vec<(u64, u32, bool)>,
    pub ld: Vec<(u64, u32, f64)>,
}

/// The `[rows.len(), len]` ids of `rows`, cut after the last target position of any.
fn batch(ctx: &Ctx, ex: &[&TextNeedleExample], rows: &[usize]) -> (Tensor<2, Int>, usize) {
    let len = text_cut_len(rows.iter().map(|&r| ex[r]));
    let mut ids = Vec::with_capacity(rows.len() * len);
    for &r in rows {
        ids.extend(ex[r].tokens[..len].iter().map(|&t| i64::from(t)));
    }
    let t = Tensor::from_data(TensorData::new(ids, [rows.len(), len]), &ctx.device);
    (t, len)
}

/// One forward over `rows`: per prompt, exact match of the whole value and the logit
/// difference against the best wrong value.
fn chunk_outcomes(
    ctx: &Ctx,
    ex: &[&TextNeedleExample],
    rows: &[usize],
) -> Result<Vec<Vec<Outcome>>> {
    let (tokens, len) = batch(ctx, ex, rows);
    let mut flat = Vec::new();
    for (i, &r) in rows.iter().enumerate() {
        flat.extend(ex[r].target_positions.iter().map(|&p| (i * len + p) as i64));
    }
    let n_flat = flat.len();
    let idx = Tensor::<1, Int>::from_data(TensorData::new(flat, [n_flat]), &ctx.device);
    let logits = ctx.model.forward_logit_rows(tokens, idx)?;
    if !crate::model::diagnose::all_finite(&logits)? {
        return Err(Error::NonFinite(
            "the logits at the value positions hold NaN or infinite values".into(),
        ));
    }
    let v = logits.dims()[1];
    let top = logits.clone().argmax(1).try_into_vec_as::<i64>()?;
    let vals = logits.try_into_vec_as::<f32>()?;
    let mut out = Vec::with_capacity(rows.len());
    let mut j = 0;
    for &r in rows {
        let e = ex[r];
        let row = &vals[j * v..(j + 1) * v];
        let at = |t: u32| -> Result<f32> {
            row.get(t as usize).copied().ok_or_else(|| {
                Error::Input(format!(
                    "token {t} of the value is outside the model's vocabulary 0..{v}"
                ))
            })
        };
        let mut best_wrong = f32::NEG_INFINITY;
        for &w in &e.wrong_first {
            best_wrong = best_wrong.max(at(w)?);
        }
        let ld = at(e.answers[0])? - best_wrong;
        let n = e.answers.len();
        let correct = (0..n).all(|k| top[j + k] == i64::from(e.answers[k]));
        j += n;
        out.push(Outcome { correct, ld });
    }
    Ok(vec![out])
}

/// Evaluate every protocol's text set at every phase of the experiment.
pub(super) fn observe(cfg: &PhaseSweep, ctx: &mut Ctx) -> Result<Vec<TextObs>> {
    let n = ctx.task.n_logical;
    let total = (cfg.protocols.len() * ctx.task.phases.len() * n) as u64;
    let mut shards = ctx.prompt_shards(&format!("{} phase-sweep", ctx.mref.name), total);
    let mut out = Vec::new();
    for &proto in &cfg.protocols {
        let set = ctx
            .task
            .text_set(ctx.exp, proto)?
            .expect("observe runs on text tasks");
        ctx.preflight_plain(set.prompt_len)?;
        let mut obs = TextObs {
            proto,
            correct: Vec::new(),
            ld: Vec::new(),
        };
        for &r in &ctx.task.phases {
            let ex: Vec<&TextNeedleExample> = set.group(r).take(n).collect();
            let key = format!("{}-{}-p{r}", ctx.mref.name, proto.label());
            let res = shards.run(&key, ex.len(), 1, ctx.max_rows, |rows| {
                chunk_outcomes(ctx, &ex, rows)
            })?;
            for (e, o) in ex.iter().zip(&res[0]) {
                obs.correct.push((e.logical_id, r, o.correct));
                obs.ld.push((e.logical_id, r, f64::from(o.ld)));
            }
        }
        out.push(obs);
    }
    ctx.finish_shards(shards);
    Ok(out)
}
