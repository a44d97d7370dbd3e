//! The DeepSeek-V4 MoE block: a router (learned top-k with a score-correction bias, or
//! hash routing through the fixed `tid2eid` table), routed SwiGLU experts with a clamp,
//! and one always-on shared expert.
//!
//! Scores `s = score_fn(x W_gate^T)` (sqrtsoftplus, sigmoid or softmax). Top-k layers pick
//! the k largest `s + bias` (the bias affects the choice only); hash layers take
//! `tid2eid[token]`. Weights are the chosen (unbiased) scores, normalised to sum 1 and
//! multiplied by `routed_scaling_factor`. Expert: `down(silu(min(gate, L)) *
//! clamp(up, -L, L))` with `L = swiglu_limit`; the shared expert uses the same clamp.

use burn::module::{Module, Param, ParamId};
use burn::tensor::activation::{sigmoid, silu, softmax, softplus};
use burn::tensor::{Device, IndexingUpdateOp, Int, Tensor, TensorData};

use super::config::{DeepseekV4Config, MlpType, ScoringFunc};
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookRun, Site};
use crate::model::flops::Mm;
use crate::model::host;
use crate::model::layers::{Linear, Weight, int_tensor, row_chunks};
use crate::model::placement::to;
use crate::model::stored::StoredWeight;
use crate::model::topk::topk_indices;
use crate::model::weights::{Init, Vb};

/// The router (`mlp.gate`).
#[derive(Module, Debug)]
pub struct Router {
    /// `[n_experts, d_model]`
    pub weight: Weight,
    /// `e_score_correction_bias` `[n_experts]` (top-k layers).
    pub e_score_correction_bias: Option<Param<Tensor<1>>>,
    /// `tid2eid` `[vocab, top_k]`, row-major (hash layers).
    #[module(skip)]
    pub tid2eid: Option<Vec<i64>>,
}

/// Routed experts, stacked as in transformers.
#[derive(Module, Debug)]
pub struct Experts {
    /// `[n_experts, 2 * d_ff, d_model]`: rows `0..d_ff` = gate (w1), `d_ff..` = up (w3).
    pub gate_up_proj: ExpertBank,
    /// `[n_experts, d_model, d_ff]` (w2).
    pub down_proj: ExpertBank,
}

/// One matrix per routed expert: a trainable stack `[n, rows, cols]`, or the
/// checkpoint's matrices kept as stored (dequantised one expert at a time, on use).
#[derive(Module, Debug)]
pub enum ExpertBank {
    Dense(Param<Tensor<3>>),
    Stored(StoredWeight),
}

impl ExpertBank {
    /// Parameter `name` `[n, rows, cols]` from `vb`: as stored when the source keeps it
    /// so, else initialised by `init`.
    fn build(vb: &Vb, name: &str, shape: [usize; 3], init: Init) -> Result<Self> {
        Ok(match vb.stored(name, &shape)? {
            Some(s) => ExpertBank::Stored(s),
            None => ExpertBank::Dense(vb.param(name, shape, init)?),
        })
    }

    /// Number of experts.
    pub fn len(&self) -> usize {
        match self {
            ExpertBank::Dense(p) => p.dims()[0],
            ExpertBank::Stored(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the experts run.
    pub fn device(&self) -> Device {
        match self {
            ExpertBank::Dense(p) => p.val().device(),
            ExpertBank::Stored(s) => s.device(),
        }
    }

    /// Expert `j`'s matrix `[rows, cols]` on [`ExpertBank::device`] (a stored one
    /// dequantised into a transient tensor).
    pub fn expert(&self, j: usize) -> Tensor<2> {
        match self {
            ExpertBank::Dense(p) => {
                let [_, r, c] = p.dims();
                p.val().slice_dim(0, j..j + 1).reshape([r, c])
            }
            ExpertBank::Stored(s) => s.matrix(j),
        }
    }

    /// The stored matrices, when kept as stored.
    pub fn stored(&self) -> Option<&StoredWeight> {
        match self {
            ExpertBank::Dense(_) => None,
            ExpertBank::Stored(s) => Some(s),
        }
    }

    /// Experts `0..keep` (the parameter keeps its id) and `keep..` (on `host`), for
    /// `0 < keep < len`.
    fn split(self, keep: usize, host: &Device) -> Result<(Self, Self)> {
        match self {
            ExpertBank::Dense(p) => {
                let (id, v) = (p.id, p.val());
                let e = v.dims()[0];
                let off = to(v.clone().slice_dim(0, keep..e), host);
                Ok((
                    ExpertBank::Dense(Param::initialized(id, v.slice_dim(0, 0..keep))),
                    ExpertBank::Dense(Param::initialized(ParamId::new(), off)),
                ))
            }
            ExpertBank::Stored(s) => match s.split(keep) {
                (Some(a), Some(b)) => {
                    Ok((ExpertBank::Stored(a), ExpertBank::Stored(b.to_device(host))))
                }
                _ => Err(Error::Other(format!(
                    "cannot keep {keep} of {} routed experts on the device",
                    s.len()
                ))),
            },
        }
    }
}

/// The shared expert.
#[derive(Module, Debug)]
pub struct SharedExpert {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// One MoE block.
#[derive(Module, Debug)]
pub struct Moe {
    pub gate: Router,
    /// Routed experts `0..n` (all of them unless a placement offloads some).
    pub experts: Experts,
    /// Experts `n..` that a placement keeps in host memory ([`Moe::offload_experts`]);
    /// they run where they live, on the rows routed to them.
    pub host_experts: Option<Experts>,
    pub shared_experts: SharedExpert,
    #[module(skip)]
    pub kind: MlpType,
    #[module(skip)]
    pub scoring: ScoringFunc,
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub scaling: f64,
    #[module(skip)]
    pub limit: f64,
}

/// `silu(min(gate, L)) * clamp(up, -L, L)` given the two pre-activations (`[rows, d_ff]`
/// each): the input of `down`.
pub fn clamped_swiglu(gate: Tensor<2>, up: Tensor<2>, limit: f64) -> Tensor<2> {
    let [rows, d_ff] = gate.dims();
    let host = host::with_values(&gate, |g| {
        host::with_values(&up, |u| {
            swiglu_rows(rows, d_ff, limit, |r| {
                (&g[r * d_ff..][..d_ff], &u[r * d_ff..][..d_ff])
            })
        })
    });
    match host.flatten() {
        Some(v) => host::tensor_from(v, [rows, d_ff], &gate),
        None => silu(gate.clamp_max(limit)) * up.clamp(-limit, limit),
    }
}

/// [`clamped_swiglu`] of the two halves of one product `gu: [rows, 2 d_ff]` (gate, then
/// up): on flex read in place, without a copy of either half.
pub fn clamped_swiglu_halves(gu: Tensor<2>, d_ff: usize, limit: f64) -> Tensor<2> {
    let [rows, w] = gu.dims();
    let host = host::with_values(&gu, |v| {
        swiglu_rows(rows, d_ff, limit, |r| {
            (&v[r * w..][..d_ff], &v[r * w + d_ff..][..d_ff])
        })
    });
    match host {
        Some(v) => host::tensor_from(v, [rows, d_ff], &gu),
        None => clamped_swiglu(
            gu.clone().slice_dim(1, 0..d_ff),
            gu.slice_dim(1, d_ff..2 * d_ff),
            limit,
        ),
    }
}

/// `rows x d_ff` values of [`clamped_swiglu`], row `r`'s gate and up from `row(r)`,
/// rows over every core, with the vectorised [`host::silu`].
fn swiglu_rows<'a>(
    rows: usize,
    d_ff: usize,
    limit: f64,
    row: impl Fn(usize) -> (&'a [f32], &'a [f32]) + Sync,
) -> Vec<f32> {
    let l = limit as f32;
    host::new_rows(rows, d_ff, |r, o| {
        let (g, u) = row(r);
        swiglu_row(l, g, u, o)
    })
}

host::multiversion! {
    /// One row of [`swiglu_rows`].
    fn swiglu_row(l: f32, g: &[f32], u: &[f32], o: &mut [f32]) {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            // As `clamp_max`: a NaN stays NaN (`f32::min` would drop it).
            let g = if g > l { l } else { g };
            *o = host::silu(g) * u.clamp(-l, l);
        }
    }
}

impl Moe {
    /// The MoE block (routing `kind`) of a layer of a `c` model under `vb`
    /// (`model.layers.{l}.mlp`).
    pub fn new(vb: &Vb, c: &DeepseekV4Config, kind: MlpType) -> Result<Self> {
        let (h, i, vocab) = (c.hidden_size, c.moe_intermediate_size, c.vocab_size);
        let (e, k) = (c.n_routed_experts, c.num_experts_per_tok);
        let (scoring, scaling) = (c.scoring_func, c.routed_scaling_factor);
        let (limit, bias) = (c.swiglu_limit, c.mlp_bias);
        let vg = vb.pp("gate");
        let std = 1.0 / (h as f64).sqrt();
        let tid2eid = match kind {
            MlpType::HashMoe => {
                let name = vg.full("tid2eid");
                let t = vg.ints("tid2eid", &[vocab, k], &|x| ((x % k) % e) as i64)?;
                if let Some(bad) = t.iter().find(|&&x| x < 0 || x as usize >= e) {
                    return Err(Error::Other(format!(
                        "tensor `{name}`: expert id {bad} out of range 0..{e}"
                    )));
                }
                Some(t)
            }
            MlpType::Moe => None,
        };
        let ve = vb.pp("experts");
        let vs = vb.pp("shared_experts");
        let lin = |name: &str, d_in: usize, d_out: usize| {
            let v = vs.pp(name);
            let s = 1.0 / (d_in as f64).sqrt();
            if bias {
                Linear::with_bias(&v, d_in, d_out, s)
            } else {
                Linear::new(&v, d_in, d_out, s)
            }
        };
        Ok(Moe {
            gate: Router {
                weight: Weight::build(&vg, "weight", [e, h], Init::Normal(std))?,
                e_score_correction_bias: (kind == MlpType::Moe)
                    .then(|| vg.param("e_score_correction_bias", [e], Init::Zeros))
                    .transpose()?,
                tid2eid,
            },
            experts: Experts {
                gate_up_proj: ExpertBank::build(
                    &ve,
                    "gate_up_proj",
                    [e, 2 * i, h],
                    Init::Normal(std),
                )?,
                down_proj: ExpertBank::build(
                    &ve,
                    "down_proj",
                    [e, h, i],
                    Init::Normal(1.0 / (i as f64).sqrt()),
                )?,
            },
            host_experts: None,
            shared_experts: SharedExpert {
                gate_proj: lin("gate_proj", h, i)?,
                up_proj: lin("up_proj", h, i)?,
                down_proj: lin("down_proj", i, h)?,
            },
            kind,
            scoring,
            top_k: k,
            scaling,
            limit,
        })
    }

    /// Keep routed experts `0..keep` with the rest of the layer and move the others to
    /// `host` (a placement's host offload; `keep` >= the number of experts moves none).
    pub fn offload_experts(mut self, keep: usize, host: &Device) -> Result<Self> {
        if self.host_experts.is_some() {
            return Err(Error::Other(
                "the routed experts of this layer are already offloaded".into(),
            ));
        }
        let e = self.experts.gate_up_proj.len();
        if keep >= e {
            return Ok(self);
        }
        if keep == 0 {
            self.experts = self.experts.to_device(host);
            return Ok(self);
        }
        let (gu, gu_host) = self.experts.gate_up_proj.split(keep, host)?;
        let (down, down_host) = self.experts.down_proj.split(keep, host)?;
        self.experts = Experts {
            gate_up_proj: gu,
            down_proj: down,
        };
        self.host_experts = Some(Experts {
            gate_up_proj: gu_host,
            down_proj: down_host,
        });
        Ok(self)
    }

    /// `y: [b, t, d]` (after `post_attention_layernorm`), `tokens` the row-major token ids
    /// (hash routing) -> `[b, t, d]`.
    pub fn forward(
        &self,
        layer: usize,
        y: Tensor<3>,
        tokens: &[i64],
        hooks: &mut HookRun,
    ) -> Result<Tensor<3>> {
        let [b, t, h] = y.dims();
        let flat = y.reshape([b * t, h]);
        let (idx, weights) = self.route(layer, flat.clone(), [b, t], tokens, hooks)?;
        let routed = self.routed(flat.clone(), idx, weights)?;
        let s = &self.shared_experts;
        let shared = row_chunks(flat, |x| {
            s.down_proj.forward(clamped_swiglu(
                s.gate_proj.forward(x.clone()),
                s.up_proj.forward(x),
                self.limit,
            ))
        });
        Ok((routed + shared).reshape([b, t, h]))
    }

    /// The router: the experts each of the `b * t` tokens of `flat: [b * t, d]` goes to
    /// (`[b * t, top_k]`; hash table or score top-k) and their weights (`[b * t *
    /// top_k]`), through the router hook points.
    fn route(
        &self,
        layer: usize,
        flat: Tensor<2>,
        [b, t]: [usize; 2],
        tokens: &[i64],
        hooks: &mut HookRun,
    ) -> Result<(Tensor<2, Int>, Tensor<1>)> {
        let nt = b * t;
        let k = self.top_k;
        let device = flat.device();
        let e = self.gate.weight.dims()[0];
        let logits = self.gate.weight.matmul_t(flat);
        let scores = match self.scoring {
            ScoringFunc::Sqrtsoftplus => softplus(logits, 1.0).sqrt(),
            ScoringFunc::Sigmoid => sigmoid(logits),
            ScoringFunc::Softmax => softmax(logits, 1),
        };
        let scores = hooks
            .apply(
                HookPoint::block(layer, Site::RouterScores),
                scores.reshape([b, t, e]),
            )?
            .reshape([nt, e]);
        let idx: Tensor<2, Int> = match (&self.gate.tid2eid, &self.gate.e_score_correction_bias) {
            (Some(table), _) => {
                let mut v = Vec::with_capacity(nt * k);
                for &tok in tokens {
                    let r = tok as usize * k;
                    v.extend_from_slice(&table[r..r + k]);
                }
                Tensor::from_data(TensorData::new(v, [nt, k]), &device)
            }
            (None, Some(bias)) => {
                let biased = scores.clone() + bias.val().reshape([1, e]);
                topk_indices(biased, k)
            }
            (None, None) => topk_indices(scores.clone(), k),
        };
        let chosen = scores.gather(1, idx.clone());
        let weights = chosen.clone() / (chosen.sum_dim(1) + 1e-20) * self.scaling;
        let weights = hooks
            .apply(
                HookPoint::block(layer, Site::RouterWeights),
                weights.reshape([b, t, k]),
            )?
            .reshape([nt * k]);
        hooks.record(HookPoint::block(layer, Site::RouterTopk), || {
            idx.clone().float().reshape([b, t, k])
        });
        Ok((idx, weights))
    }

    /// The routed experts' output `[b * t, d]`: each expert runs on the tokens (and
    /// top-k slots) it serves, weighted, summed per token.
    fn routed(
        &self,
        flat: Tensor<2>,
        idx: Tensor<2, Int>,
        weights: Tensor<1>,
    ) -> Result<Tensor<2>> {
        let [nt, h] = flat.dims();
        let k = self.top_k;
        let device = flat.device();
        let e = self.gate.weight.dims()[0];
        let host: Vec<i64> = idx
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| Error::Other(format!("router indices: {e:?}")))?;
        let mut per_expert: Vec<(Vec<usize>, Vec<usize>)> = vec![(Vec::new(), Vec::new()); e];
        for (slot, &ex) in host.iter().enumerate() {
            let ex = ex as usize;
            per_expert[ex].0.push(slot / k);
            per_expert[ex].1.push(slot);
        }
        let mut routed = Tensor::<2>::zeros([nt, h], &device);
        // Expert `first + j` is row `j` of its bank; a bank in host memory runs there on
        // the rows routed to it.
        let mut first = 0;
        for bank in std::iter::once(&self.experts).chain(self.host_experts.as_ref()) {
            let n = bank.down_proj.len();
            let here = bank.down_proj.device();
            for j in 0..n {
                let (toks, slots) = &per_expert[first + j];
                if toks.is_empty() {
                    continue;
                }
                // Only the experts rows are routed to are read (a stored one is
                // dequantised here, for this call, in blocks of rows when large).
                let ti = int_tensor(toks, &device);
                let rows = to(flat.clone().select(0, ti.clone()), &here);
                let swiglu =
                    |gu: Tensor<2>, d_ff: usize| clamped_swiglu_halves(gu, d_ff, self.limit);
                let out = match (bank.gate_up_proj.stored(), bank.down_proj.stored()) {
                    (Some(gu), Some(down)) => {
                        let d_ff = down.dims()[1];
                        row_chunks(rows, |rows| {
                            down.matmul_t(j, swiglu(gu.matmul_t(j, rows), d_ff))
                        })
                    }
                    _ => {
                        let w_gu = bank.gate_up_proj.expert(j).transpose();
                        let w_down = bank.down_proj.expert(j).transpose();
                        let d_ff = w_down.dims()[0];
                        row_chunks(rows, |rows| {
                            swiglu(rows.mm(w_gu.clone()), d_ff).mm(w_down.clone())
                        })
                    }
                };
                let wsel = weights
                    .clone()
                    .select(0, int_tensor(slots, &device))
                    .reshape([toks.len(), 1]);
                routed =
                    routed.select_assign(0, ti, to(out, &device) * wsel, IndexingUpdateOp::Add);
            }
            first += n;
        }
        if first != e {
            return Err(Error::Other(format!(
                "the expert banks hold {first} routed experts, the router {e}"
            )));
        }
        Ok(routed)
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::model::host::ROWS_PER_TASK;
    use burn::tensor::Distribution;

    /// The flex kernel of the clamped SwiGLU gives the tensor expression (computed on the
    /// autodiff device, where the kernel declines), from two tensors and from the halves
    /// of one; a NaN gate stays NaN, as `clamp_max` keeps it.
    #[test]
    fn clamped_swiglu_kernel_gives_the_tensor_expression() {
        let (dev, ad) = (Device::flex(), Device::flex().autodiff());
        let (rows, d_ff, limit) = (2 * ROWS_PER_TASK + 5, 12, 1.5);
        let mut gu = Tensor::<2>::random([rows, 2 * d_ff], Distribution::Normal(0.0, 3.0), &dev)
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        gu[3] = f32::NAN;
        let gu = Tensor::<2>::from_data(TensorData::new(gu, [rows, 2 * d_ff]), &dev);
        let on_ad = |x: &Tensor<2>| Tensor::<2>::from_data(x.to_data(), &ad);
        let values = |x: Tensor<2>| x.into_data().try_into_vec::<f32>().unwrap();
        let want = values(clamped_swiglu_halves(on_ad(&gu), d_ff, limit));
        let halves = values(clamped_swiglu_halves(gu.clone(), d_ff, limit));
        let (gate, up) = (
            gu.clone().slice_dim(1, 0..d_ff),
            gu.slice_dim(1, d_ff..2 * d_ff),
        );
        let two = values(clamped_swiglu(gate, up, limit));
        assert!(want[3].is_nan() && halves[3].is_nan() && two[3].is_nan());
        for (i, w) in want.iter().enumerate().filter(|(i, _)| *i != 3) {
            for (got, what) in [(halves[i], "halves"), (two[i], "two tensors")] {
                assert!(
                    (got - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "{what}[{i}]: {got} vs {w}"
                );
            }
        }
    }
}
