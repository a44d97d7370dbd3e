//! AtP* (Kramar, Lieberum, Shah, Nanda 2024): the QK fix for the query and key nodes of
//! attention heads (`[atp] qk_fix = true`).
//!
//! AtP linearises the whole path from a node to the metric. For a query or key node that
//! path starts with the attention softmax, and where the softmax is saturated its
//! derivative is ~0 while a patch can move the attention from one key to another: AtP
//! reads ~0 where the effect is large. AtP* computes the change of the attention PATTERN
//! exactly and linearises only the step from the pattern to the metric:
//!
//! ```text
//! c*(q node of head h at query t) = sum_j (A'[h,t,j] - A[h,t,j]) dL/dA[h,t,j]
//! ```
//!
//! where `A'` is the layer's pattern with head h's query at t replaced by the partner
//! prompt's. The nodes in our models:
//! - **query nodes**: `hook_q` per query head and query position. Every row of the
//!   pattern depends on its own query only, so ONE forward with the whole `hook_q` of
//!   layer l replaced gives `A'` of every query node of the layer at once.
//! - **key nodes**: the key SLOTS of `hook_pattern` per KV head, `[compressed entries ;
//!   raw tokens]`: raw slot s holds `hook_k[s]`; compressed entry i holds the keys of its
//!   window pooled with the receiving prompt's gates (kvc pools `hook_k`; DeepSeek-V4's
//!   entries come from the compressor's own projection, which `hook_k` does not reach,
//!   so their slots never change). Replacing the key of slot j changes column j of every
//!   query row that sees it, for every query head reading the KV head; the row is
//!   recomputed exactly from the clean logits (`hook_attn_scores`) with column j moved
//!   by `delta = S_k[t,j] - S[t,j]`, where `S_k` are the logits of ONE forward with the
//!   whole `hook_k` of layer l replaced (each column depends on its own key only).
//!   Per row, with `a = A[t,j]`, the new row is `A'[t,j] = a e^delta / Z'`, the other
//!   slots scaled by `1 / Z'`, `Z' = 1 - a + a e^delta` (computed in log space).
//!
//! The head-level estimates add the nodes (as AtP adds positions): a query cell sums
//! its head's query nodes over the `positions` of the kind; a key cell sums every slot
//! of its KV head over every query row, and is checked against patching the KV head's
//! `hook_k` at every position. Alongside, plain AtP of the same nodes,
//! `(x_partner - x) . dL/dx` at `hook_q` / `hook_k`, shows what the fix changes. The
//! value path (`hook_z`) keeps plain AtP.
//!
//! Cost per phase group: one plain forward (clean logits, queries and keys), one forward
//! and backward on the autodiff device (`dL/dA`, `dL/dq`, `dL/dk`), and per layer one
//! forward of twice the prompts (patched queries | patched keys). Capturing
//! `hook_pattern` / `hook_attn_scores` runs those layers' attention as one dense block
//! (`[T, entries + T + sink]` per head): fine at organism lengths, quadratic in T.

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor, TensorData};

use crate::analysis::{Clusters, Est};
use crate::error::{Error, Result};
use crate::hooks::{Act, Action, HookPoint, HookSpec, Scope, Site};
use crate::model::attention::MASKED;
use crate::model::grad::{GradPoint, grad_at_points};
use crate::model::{ForwardOutput, LanguageModel};
use crate::output::{HeadKind, LongRow, ScatterSpec, scatter_predicted_vs_observed};

use super::super::super::exec::{Group, GroupResult};
use super::super::super::heads::{Direction, nld_clusters};
use super::super::super::patching::{Cell, Edit, Fill, Positions, Prompts, Target, readout};
use super::super::super::report::{Figures, cell_map, paired_series, push};
use super::super::super::rows::RowCtx;
use super::super::{Ctx, HeadCell};
use crate::tasks::prompts::PromptMeta;

use super::{AtpTerms, AttributionPatching, NldRows, agreement_stats, weighted_ld, weights};

/// The node family of a query/key estimate: `q` (hook_q, query heads) or `k` (key
/// slots, KV heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QkSite {
    Q,
    K,
}

impl QkSite {
    pub fn as_str(self) -> &'static str {
        match self {
            QkSite::Q => "q",
            QkSite::K => "k",
        }
    }

    /// The head kind of its cells.
    pub fn kind(self) -> HeadKind {
        match self {
            QkSite::Q => HeadKind::Query,
            QkSite::K => HeadKind::Kv,
        }
    }
}

/// AtP (first order through the softmax) or AtP* (exact pattern change).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum QkMethod {
    Atp,
    AtpStar,
}

impl QkMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            QkMethod::Atp => "atp",
            QkMethod::AtpStar => "atpstar",
        }
    }
}

/// Metric of the exact patching of a site (`q_nld_denoise`).
pub fn exact_qk_metric(site: QkSite, d: Direction) -> String {
    format!("{}_{}", site.as_str(), d.metric())
}

/// Metric of an estimate (`atpstar_q_nld_denoise`).
pub fn est_qk_metric(method: QkMethod, site: QkSite, d: Direction) -> String {
    format!("{}_{}", method.as_str(), exact_qk_metric(site, d))
}

/// Metric of an agreement statistic of an estimate (`spearman_atpstar_k_nld_noise`).
pub fn agreement_qk_metric(stat: &str, method: QkMethod, site: QkSite, d: Direction) -> String {
    format!("{stat}_{}", est_qk_metric(method, site, d))
}

/// Query/key terms of one prompt batch (clean `0..n`, corrupted partners `n..2n`), in
/// the clean orientation like [`AtpTerms`].
#[derive(Debug, Clone)]
pub struct QkTerms {
    /// Plain AtP of every query node: `[n, len, n_heads]` per direction and layer.
    pub q_atp: AtpTerms,
    /// AtP* of every query node, same layout.
    pub q_star: AtpTerms,
    /// Plain AtP of the whole `hook_k` of each KV head (summed over positions):
    /// `[n, 1, n_kv_heads]`.
    pub k_atp: AtpTerms,
    /// AtP* summed over every key slot of each KV head: `[n, 1, n_kv_heads]`.
    pub k_star: AtpTerms,
    /// Per layer: (query rows at a prompt's read position whose largest attention
    /// probability exceeds 0.99, such rows), over every prompt and query head.
    pub saturated: Vec<(usize, usize)>,
}

impl QkTerms {
    /// The terms of a site and method.
    pub fn get(&self, site: QkSite, method: QkMethod) -> &AtpTerms {
        match (site, method) {
            (QkSite::Q, QkMethod::Atp) => &self.q_atp,
            (QkSite::Q, QkMethod::AtpStar) => &self.q_star,
            (QkSite::K, QkMethod::Atp) => &self.k_atp,
            (QkSite::K, QkMethod::AtpStar) => &self.k_star,
        }
    }
}

/// Probabilities of one row of logits (`MASKED` slots invisible), in f64; all zero when
/// nothing is visible (as the model's softmax).
pub fn row_softmax(s: &[f32]) -> Vec<f64> {
    let vis = |x: f32| x > MASKED / 2.0;
    let m = s
        .iter()
        .copied()
        .filter(|&x| vis(x))
        .fold(f64::NEG_INFINITY, |a, x| a.max(x as f64));
    if m == f64::NEG_INFINITY {
        return vec![0.0; s.len()];
    }
    let e: Vec<f64> = s
        .iter()
        .map(|&x| if vis(x) { (x as f64 - m).exp() } else { 0.0 })
        .collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// AtP* of a query node: `sum_j (softmax(s_patched) - softmax(s))_j g_j`.
pub fn query_row(s: &[f32], s_patched: &[f32], g: &[f32]) -> f64 {
    let (a, b) = (row_softmax(s), row_softmax(s_patched));
    a.iter()
        .zip(&b)
        .zip(g)
        .map(|((a, b), g)| (b - a) * *g as f64)
        .sum()
}

/// AtP* of every key slot of one query row, summed: slot j's logit moves to
/// `s_patched[j]` alone, the row is renormalised exactly, and the pattern change is
/// weighted by `g = dL/dA`. Leave-one-out sums avoid the cancellation of `Z - e_j` when
/// the row is saturated on slot j.
pub fn key_row(s: &[f32], s_patched: &[f32], g: &[f32]) -> f64 {
    let vis = |x: f32| x > MASKED / 2.0;
    let m = s
        .iter()
        .copied()
        .filter(|&x| vis(x))
        .fold(f64::NEG_INFINITY, |a, x| a.max(x as f64));
    if m == f64::NEG_INFINITY {
        return 0.0;
    }
    let e: Vec<f64> = s
        .iter()
        .map(|&x| if vis(x) { (x as f64 - m).exp() } else { 0.0 })
        .collect();
    let n = e.len();
    let mut pre = vec![0.0f64; n + 1];
    for j in 0..n {
        pre[j + 1] = pre[j] + e[j];
    }
    let mut suf = vec![0.0f64; n + 1];
    for j in (0..n).rev() {
        suf[j] = suf[j + 1] + e[j];
    }
    let z = pre[n];
    let lz = z.ln() + m;
    let ag: f64 = e.iter().zip(g).map(|(e, g)| e / z * *g as f64).sum();
    let mut total = 0.0;
    for j in 0..n {
        if !vis(s[j]) {
            continue;
        }
        let delta = s_patched[j] as f64 - s[j] as f64;
        if delta == 0.0 {
            continue;
        }
        let a = e[j] / z;
        let others = pre[j] + suf[j + 1];
        let lj = s[j] as f64 + delta;
        let lo = others.ln() + m; // -inf when slot j is the only one visible
        let hi = lo.max(lj);
        let lz_new = hi + ((lo - hi).exp() + (lj - hi).exp()).ln();
        let a_new = (lj - lz_new).exp();
        let scale = (lz - lz_new).exp();
        let gj = g[j] as f64;
        total += (a_new - a) * gj + (scale - 1.0) * (ag - a * gj);
    }
    total
}

/// Host values of a tensor.
fn host<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>> {
    Ok(t.try_into_vec_as::<f32>()?)
}

/// Rows `rows` of a `[b, ...]` tensor, in that order.
fn rows_of<const D: usize>(t: Tensor<D>, rows: &[usize]) -> Tensor<D> {
    let idx: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let device = t.device();
    t.select(
        0,
        Tensor::<1, Int>::from_data(TensorData::new(idx, [rows.len()]), &device),
    )
}

fn captured<const D: usize>(out: &ForwardOutput, p: HookPoint) -> Result<Tensor<D>> {
    out.cache
        .get(&p)
        .ok_or_else(|| Error::hook(p.to_string(), "not captured (does the model run it?)"))?
        .get::<D>()
}

/// One layer's activations for the query/key terms.
struct LayerActs {
    /// `[2n, T, n_heads, d_head]`, `[2n, T, kv_heads, d_head]`.
    q: Tensor<4>,
    k: Tensor<4>,
    /// `[2n, n_heads, T, J]` clean logits (host).
    scores: Vec<f32>,
    slots: usize,
}

/// The plain forward: outcomes, and per layer the queries, keys and logits.
fn clean_acts(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    layers: &[usize],
) -> Result<(Vec<super::super::super::patching::Outcome>, Vec<LayerActs>)> {
    let device = model.device();
    let all: Vec<usize> = (0..prompts.n()).collect();
    let mut spec = HookSpec::new();
    for &l in layers {
        for s in [Site::AttnQ, Site::AttnK, Site::AttnScores] {
            spec = spec.capture_point(HookPoint::block(l, s));
        }
    }
    let out = model.forward(prompts.tokens_of(&all, &device), &spec)?;
    let targets: Vec<&Target> = prompts.targets.iter().collect();
    let base = readout(out.logits.clone(), &targets)?;
    let mut acts = Vec::with_capacity(layers.len());
    for &l in layers {
        let s: Tensor<4> = captured(&out, HookPoint::block(l, Site::AttnScores))?;
        let slots = s.dims()[3];
        acts.push(LayerActs {
            q: captured(&out, HookPoint::block(l, Site::AttnQ))?,
            k: captured(&out, HookPoint::block(l, Site::AttnK))?,
            scores: host(s)?,
            slots,
        });
    }
    Ok((base, acts))
}

/// Gradients of the weighted LD at `hook_q`, `hook_k` and `hook_pattern` of every layer.
struct Grads {
    q: Vec<Tensor<4>>,
    k: Vec<Tensor<4>>,
    /// `[2n, n_heads, T, J]` (host).
    pattern: Vec<Vec<f32>>,
}

fn gradients(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    layers: &[usize],
    acts: &[LayerActs],
    directions: &[Direction],
) -> Result<Grads> {
    let n2 = prompts.n();
    let mut points = Vec::with_capacity(3 * layers.len());
    for (&l, a) in layers.iter().zip(acts) {
        let [_, t, h, dh] = a.q.dims();
        let kv = a.k.dims()[2];
        for (site, shape) in [
            (Site::AttnQ, [n2, t, h, dh]),
            (Site::AttnK, [n2, t, kv, dh]),
            (Site::AttnPattern, [n2, h, t, a.slots]),
        ] {
            points.push(GradPoint {
                point: HookPoint::block(l, site),
                shape,
            });
        }
    }
    let all: Vec<usize> = (0..n2).collect();
    let run = grad_at_points(
        model,
        prompts.tokens_of(&all, &model.device()),
        &points,
        &[],
        |logits| weighted_ld(logits, prompts, weights(n2 / 2, directions)),
    )?;
    let mut g = Grads {
        q: Vec::new(),
        k: Vec::new(),
        pattern: Vec::new(),
    };
    let mut it = run.grads.into_iter();
    while let (Some(q), Some(k), Some(p)) = (it.next(), it.next(), it.next()) {
        g.q.push(q);
        g.k.push(k);
        g.pattern.push(host(p)?);
    }
    Ok(g)
}

/// Logits of layer `l` with every query replaced by the partner's (rows `0..2n` of the
/// result) and with every key replaced by the partner's (rows `2n..4n`).
fn patched_scores(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    l: usize,
    a: &LayerActs,
    partner: &[usize],
) -> Result<Vec<f32>> {
    let device = model.device();
    let n2 = prompts.n();
    let qp = rows_of(a.q.clone(), partner);
    let kp = rows_of(a.k.clone(), partner);
    let q = Tensor::cat(vec![qp, a.q.clone()], 0);
    let k = Tensor::cat(vec![a.k.clone(), kp], 0);
    let sp = HookPoint::block(l, Site::AttnScores);
    let spec = HookSpec::new()
        .intervene_point(
            HookPoint::block(l, Site::AttnQ),
            Action::Replace(Act::new(q)),
            Scope::all(),
        )
        .intervene_point(
            HookPoint::block(l, Site::AttnK),
            Action::Replace(Act::new(k)),
            Scope::all(),
        )
        .capture_point(sp);
    let rows: Vec<usize> = (0..n2).chain(0..n2).collect();
    let out = model.forward(prompts.tokens_of(&rows, &device), &spec)?;
    host(captured::<4>(&out, sp)?)
}

/// The partner prompt of every prompt (its `source`).
fn partners(prompts: &Prompts) -> Result<Vec<usize>> {
    (0..prompts.n())
        .map(|i| {
            prompts.source[i]
                .ok_or_else(|| Error::Other(format!("prompt {i} has no partner prompt (source)")))
        })
        .collect()
}

/// Sizes of one layer's terms: prompts (`2n`), tokens, query heads and KV heads.
struct Dims {
    n2: usize,
    len: usize,
    h: usize,
    kvh: usize,
}

/// Plain AtP, `(x_partner - x) . dL/dx`, of every query node (`[2n, len, n_heads]`) and
/// of the whole `hook_k` of every KV head (`[2n, kv_heads]`).
fn atp_qk(
    a: &LayerActs,
    grad_q: Tensor<4>,
    grad_k: Tensor<4>,
    partner: &[usize],
    s: &Dims,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let dq = (rows_of(a.q.clone(), partner) - a.q.clone()) * grad_q;
    let qa = host(dq.sum_dim(3).reshape([s.n2 * s.len * s.h]))?;
    let dk = (rows_of(a.k.clone(), partner) - a.k.clone()) * grad_k;
    let ka = host(dk.sum_dim(3).sum_dim(1).reshape([s.n2 * s.kvh]))?;
    Ok((qa, ka))
}

/// AtP*: per query row, the exact pattern change times `g = dL/dA`, for every query
/// node (`[2n, len, n_heads]`) and summed over the key slots of every KV head
/// (`[2n, kv_heads]`). `patched` holds the logits with patched queries (rows `0..2n`)
/// and with patched keys (rows `2n..4n`).
fn star_qk(a: &LayerActs, patched: &[f32], g: &[f32], dims: &Dims) -> (Vec<f32>, Vec<f64>) {
    let (n2, len, h, kvh) = (dims.n2, dims.len, dims.h, dims.kvh);
    let (j, group) = (a.slots, h / kvh);
    let mut qs = vec![0f32; n2 * len * h];
    let mut ks = vec![0f64; n2 * kvh];
    for r in 0..n2 {
        for hh in 0..h {
            for tq in 0..len {
                let at = ((r * h + hh) * len + tq) * j;
                let s = &a.scores[at..at + j];
                let gg = &g[at..at + j];
                let sq = &patched[at..at + j];
                let sk_at = ((n2 + r) * h + hh) * len * j + tq * j;
                let sk = &patched[sk_at..sk_at + j];
                qs[(r * len + tq) * h + hh] = query_row(s, sq, gg) as f32;
                ks[r * kvh + hh / group] += key_row(s, sk, gg);
            }
        }
    }
    (qs, ks)
}

/// (query rows at a prompt's read position whose largest attention probability
/// exceeds 0.99, such rows) of one layer, over every prompt and query head.
fn saturation(prompts: &Prompts, a: &LayerActs, s: &Dims) -> (usize, usize) {
    let j = a.slots;
    let mut sat = (0, 0);
    for (r, tg) in prompts.targets.iter().enumerate() {
        for hh in 0..s.h {
            let at = ((r * s.h + hh) * s.len + tg.positions[0]) * j;
            let top = row_softmax(&a.scores[at..at + j])
                .into_iter()
                .fold(0.0, f64::max);
            sat.0 += (top > 0.99) as usize;
            sat.1 += 1;
        }
    }
    sat
}

/// AtP and AtP* of the query and key nodes of `layers` (see the module docs). Prompts
/// `0..n` must be clean and `n..2n` their partners, each with an `alt` answer.
pub fn qk_terms(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    layers: &[usize],
    directions: &[Direction],
) -> Result<QkTerms> {
    let n2 = prompts.n();
    if n2 == 0 || !n2.is_multiple_of(2) {
        return Err(Error::Other(format!(
            "attribution patching needs clean/corrupted pairs, got {n2} prompts"
        )));
    }
    let n = n2 / 2;
    let len = prompts.len;
    let partner = partners(prompts)?;
    let (base, acts) = clean_acts(model, prompts, layers)?;
    let grads = gradients(model, prompts, layers, &acts, directions)?;
    let info = model.info();
    let nd = directions.len();
    let mut t = [
        vec![Vec::new(); nd],
        vec![Vec::new(); nd],
        vec![Vec::new(); nd],
        vec![Vec::new(); nd],
    ];
    let (mut q_heads, mut kv_heads) = (Vec::new(), Vec::new());
    let mut saturated = Vec::with_capacity(layers.len());
    for (li, (&l, a)) in layers.iter().zip(&acts).enumerate() {
        let (h, kvh) = (info.layers[l].n_heads, info.layers[l].n_kv_heads.max(1));
        let dims = Dims { n2, len, h, kvh };
        let patched = patched_scores(model, prompts, l, a, &partner)?;
        let (qa, ka) = atp_qk(a, grads.q[li].clone(), grads.k[li].clone(), &partner, &dims)?;
        let (qs, ks) = star_qk(a, &patched, &grads.pattern[li], &dims);
        saturated.push(saturation(prompts, a, &dims));
        for (di, d) in directions.iter().enumerate() {
            let rows = match d {
                Direction::Denoise => n..n2,
                Direction::Noise => 0..n,
            };
            let (q, k) = (
                rows.start * len * h..rows.end * len * h,
                rows.start * kvh..rows.end * kvh,
            );
            t[0][di].push(qa[q.clone()].to_vec());
            t[1][di].push(qs[q].to_vec());
            t[2][di].push(ka[k.clone()].to_vec());
            t[3][di].push(ks[k].iter().map(|&x| x as f32).collect());
        }
        q_heads.push(h);
        kv_heads.push(kvh);
    }
    let [qa, qs, ka, ks] = t;
    let terms = |terms, len, heads: &Vec<usize>| AtpTerms {
        base: base.clone(),
        n,
        len,
        terms,
        heads: heads.clone(),
    };
    Ok(QkTerms {
        q_atp: terms(qa, len, &q_heads),
        q_star: terms(qs, len, &q_heads),
        k_atp: terms(ka, 1, &kv_heads),
        k_star: terms(ks, 1, &kv_heads),
        saturated,
    })
}

/// The exact cells of the query/key sites: per direction, every query-head cell patches
/// its `hook_q` at `positions`, every KV-head cell its `hook_k` at every position.
fn exact_cells(
    heads: &[HeadCell],
    dirs: &[Direction],
    positions: &Positions,
    n: usize,
) -> Vec<Cell> {
    let mut cells = Vec::new();
    for d in dirs {
        let receivers = d.receivers(n);
        for h in heads {
            let (site, pos) = match h.kind {
                HeadKind::Query => (Site::AttnQ, positions.clone()),
                HeadKind::Kv => (Site::AttnK, Positions::All),
            };
            cells.push(Cell {
                edit: Edit::Replace {
                    point: HookPoint::block(h.layer, site),
                    heads: Some(vec![h.head]),
                    positions: pos,
                    fill: Fill::Source,
                },
                prompts: receivers.clone(),
            });
        }
    }
    cells
}

fn site_of(kind: HeadKind) -> QkSite {
    match kind {
        HeadKind::Query => QkSite::Q,
        HeadKind::Kv => QkSite::K,
    }
}

/// Per-phase and pooled values.
type PhaseVals = (Vec<f64>, f64);

/// (direction, head cell, method) -> the estimate's values.
type EstVals = BTreeMap<(usize, usize, QkMethod), PhaseVals>;

/// (direction, head cell) -> the exact values.
type ExactVals = BTreeMap<(usize, usize), PhaseVals>;

/// What [`rows`] needs from the kind's run.
pub struct QkInput<'a> {
    pub cfg: &'a AttributionPatching,
    pub layers: &'a [usize],
    pub heads: &'a [HeadCell],
    pub metas: &'a [Vec<PromptMeta>],
    pub prompts: &'a [Prompts],
    pub phases_run: &'a [u32],
}

/// The query/key estimates (AtP and AtP*), their exact check and agreement, and the
/// speed rows, appended to `rows`.
pub fn rows(ctx: &mut Ctx, inp: &QkInput, rows: &mut Vec<LongRow>) -> Result<()> {
    let dirs = inp.cfg.directions.clone();
    let t0 = std::time::Instant::now();
    let mut terms = Vec::with_capacity(inp.prompts.len());
    for prompts in inp.prompts {
        terms.push(qk_terms(ctx.model, prompts, inp.layers, &dirs)?);
    }
    let star_seconds = t0.elapsed().as_secs_f64();
    saturation_rows(&ctx.rows, inp.layers, &terms, rows);
    ctx.stats.forwards += (inp.prompts.len() * (2 + inp.layers.len())) as u64;
    let exact = if inp.cfg.validate {
        Some(exact_patching(ctx, inp)?)
    } else {
        None
    };
    let nr = NldRows::new(ctx);
    let estimates = Estimates {
        inp,
        terms,
        layer_index: inp
            .layers
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i))
            .collect(),
        p: ctx.p(),
    };
    let (est, ex) = estimates.cell_rows(&nr, exact.as_ref().map(|(res, _)| res.as_slice()), rows);
    if exact.is_some() {
        agreement_rows(&nr, inp, &est, &ex, rows);
    }
    speed_rows(
        &nr.rc,
        inp,
        star_seconds,
        exact.as_ref().map(|(_, secs)| *secs),
        rows,
    );
    Ok(())
}

/// Per layer, the share of saturated query rows at the read position
/// (`saturated_read_rows`) over every group.
fn saturation_rows(rc: &RowCtx, layers: &[usize], terms: &[QkTerms], rows: &mut Vec<LongRow>) {
    for (li, &l) in layers.iter().enumerate() {
        let (k, n) = terms.iter().fold((0, 0), |(k, n), t| {
            (k + t.saturated[li].0, n + t.saturated[li].1)
        });
        let frac = if n == 0 {
            f64::NAN
        } else {
            k as f64 / n as f64
        };
        rows.push(
            rc.row(
                "saturated_read_rows",
                Est {
                    value: frac,
                    ci: None,
                    n: n as u64,
                },
            )
            .at_layer(l as u32),
        );
    }
}

/// Exact patching of the query/key cells in every phase group, and its wall time.
fn exact_patching(ctx: &mut Ctx, inp: &QkInput) -> Result<(Vec<GroupResult>, f64)> {
    let cfg = inp.cfg;
    let groups: Vec<Group> = inp
        .prompts
        .iter()
        .zip(inp.phases_run)
        .map(|(p, r)| Group {
            key: format!("p{r}-qk"),
            prompts: p.clone(),
            cells: exact_cells(inp.heads, &cfg.directions, &cfg.positions, p.n() / 2),
        })
        .collect();
    let t1 = std::time::Instant::now();
    let res = ctx.execute(&format!("{} exact q/k patching", ctx.mref.name), &groups)?;
    Ok((res, t1.elapsed().as_secs_f64()))
}

/// Speed rows of AtP* (query head x position and KV head nodes) and, with `exact_secs`,
/// of the exact q/k patching.
fn speed_rows(
    rc: &RowCtx,
    inp: &QkInput,
    star_seconds: f64,
    exact_secs: Option<f64>,
    rows: &mut Vec<LongRow>,
) {
    let n_dirs = inp.cfg.directions.len();
    let n_groups = inp.prompts.len().max(1) as u64;
    let cells = (inp.heads.len() * n_dirs) as f64 * n_groups as f64;
    // The terms cover every query head x position node (as atp_cells_per_s counts
    // head x position cells) and every KV head.
    let len = inp.prompts.first().map_or(0, |p| p.len);
    let nodes: usize = inp
        .heads
        .iter()
        .map(|h| if h.kind == HeadKind::Query { len } else { 1 })
        .sum();
    let node_cells = (nodes * n_dirs) as f64 * n_groups as f64;
    let speed = |v: f64, n: u64| Est {
        value: v,
        ci: None,
        n,
    };
    rows.push(rc.row("atpstar_seconds", speed(star_seconds, n_groups)));
    rows.push(rc.row(
        "atpstar_cells_per_s",
        speed(node_cells / star_seconds.max(1e-9), node_cells as u64),
    ));
    if let Some(secs) = exact_secs {
        rows.push(rc.row("exact_qk_seconds", speed(secs, n_groups)));
        rows.push(rc.row(
            "exact_qk_cells_per_s",
            speed(cells / secs.max(1e-9), cells as u64),
        ));
    }
}

/// The query/key terms of every group, with what their estimate rows need.
struct Estimates<'a> {
    inp: &'a QkInput<'a>,
    terms: Vec<QkTerms>,
    /// Layer -> its index in the terms.
    layer_index: BTreeMap<usize, usize>,
    p: usize,
}

impl Estimates<'_> {
    /// Estimate rows (AtP, AtP*) and, with `exact`, exact rows per direction x head; the
    /// values of both.
    fn cell_rows(
        &self,
        nr: &NldRows,
        exact: Option<&[GroupResult]>,
        rows: &mut Vec<LongRow>,
    ) -> (EstVals, ExactVals) {
        let inp = self.inp;
        let mut est: EstVals = BTreeMap::new();
        let mut ex: ExactVals = BTreeMap::new();
        for (di, d) in inp.cfg.directions.iter().enumerate() {
            for (hi, h) in inp.heads.iter().enumerate() {
                let site = site_of(h.kind);
                let at = Some((h.layer as u32, Some((h.head as u32, h.kind))));
                for method in [QkMethod::Atp, QkMethod::AtpStar] {
                    let c = self.clusters(method, *d, di, h);
                    let metric = est_qk_metric(method, site, *d);
                    est.insert((di, hi, method), nr.push(&c, &metric, at, rows));
                }
                if let Some(res) = exact {
                    let ci = di * inp.heads.len() + hi;
                    let c = nld_clusters(inp.metas, res, ci, *d, self.p);
                    ex.insert((di, hi), nr.push(&c, &exact_qk_metric(site, *d), at, rows));
                }
            }
        }
        (est, ex)
    }

    /// `[LD estimate, LD clean, LD corrupted]` per pair of head `h` in direction `d`
    /// (index `di`), clustered by logical example.
    fn clusters(&self, method: QkMethod, d: Direction, di: usize, h: &HeadCell) -> Clusters<3> {
        let (inp, site, li) = (self.inp, site_of(h.kind), self.layer_index[&h.layer]);
        let mut c = Clusters::<3>::new(self.p);
        for ((meta, qk), prompts) in inp.metas.iter().zip(&self.terms).zip(inp.prompts) {
            let t = qk.get(site, method);
            let n = t.n;
            for (i, mi) in meta.iter().enumerate().take(n) {
                let (row, sign) = match d {
                    Direction::Denoise => (n + i, -1.0),
                    Direction::Noise => (i, 1.0),
                };
                let delta = match site {
                    QkSite::Q => {
                        let tg = &prompts.targets[row].positions;
                        let pos = inp
                            .cfg
                            .positions
                            .resolve(tg)
                            .unwrap_or_else(|| (0..prompts.len).collect());
                        t.sum(di, li, i, &h.query_heads, &pos)
                    }
                    QkSite::K => t.sum(di, li, i, &[h.head], &[0]),
                };
                let ld_base = sign * t.base[row].ld as f64;
                c.add(
                    mi.logical,
                    mi.phase,
                    [
                        ld_base + delta,
                        t.base[i].ld as f64,
                        -t.base[n + i].ld as f64,
                    ],
                );
            }
        }
        c
    }
}

/// Spearman, top-k recall and mean absolute error of each estimate against the exact
/// values over the heads of each site, per phase and pooled.
fn agreement_rows(
    nr: &NldRows,
    inp: &QkInput,
    est: &EstVals,
    ex: &ExactVals,
    rows: &mut Vec<LongRow>,
) {
    for (di, d) in inp.cfg.directions.iter().enumerate() {
        for site in [QkSite::Q, QkSite::K] {
            let hs: Vec<usize> = (0..inp.heads.len())
                .filter(|&i| inp.heads[i].kind == site.kind())
                .collect();
            if hs.is_empty() {
                continue;
            }
            for method in [QkMethod::Atp, QkMethod::AtpStar] {
                let pick = |v: &PhaseVals, ph: Option<usize>| ph.map_or(v.1, |ph| v.0[ph]);
                let at = |ph: Option<usize>| -> (Vec<f64>, Vec<f64>) {
                    hs.iter()
                        .map(|&hi| (pick(&est[&(di, hi, method)], ph), pick(&ex[&(di, hi)], ph)))
                        .filter(|(a, b)| a.is_finite() && b.is_finite())
                        .unzip()
                };
                let metric = |stat: &str| agreement_qk_metric(stat, method, site, *d);
                for ph in nr.phases.iter().map(|&ph| Some(ph)).chain([None]) {
                    let (e, x) = at(ph.map(|p| p as usize));
                    rows.extend(agreement_stats(&nr.rc, inp.cfg.top_k, metric, ph, &e, &x));
                }
            }
        }
    }
}

fn fmt3(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.3}")
    } else {
        "n/a".into()
    }
}

/// The report section of the query/key estimates: agreement tables, scatter plots, and
/// where AtP and AtP* disagree with exact patching.
pub fn draw(cfg: &AttributionPatching, f: &mut Figures) -> Result<()> {
    let (d, m, phases) = (f.data, f.model.clone(), f.phases.clone());
    let m = m.as_str();
    let present = cfg.directions.iter().any(|x| {
        [QkSite::Q, QkSite::K]
            .iter()
            .any(|s| d.has(m, &est_qk_metric(QkMethod::AtpStar, *s, *x)))
    });
    if !present {
        return Ok(());
    }
    intro(f, m);
    let recall = format!("recall_top{}", cfg.top_k);
    for dirn in &cfg.directions {
        f.report.subsection(format!(
            "{}: AtP and AtP* of q / k against exact",
            dirn.metric()
        ));
        qk_scatter(f, m, *dirn)?;
        agreement_table(f, m, &phases, *dirn, &recall)?;
        disagreement_text(f, m, &phases, *dirn, &recall);
    }
    Ok(())
}

/// The section's heading and explanation, the speed and the saturation of the read rows.
fn intro(f: &mut Figures, m: &str) {
    let d = f.data;
    f.report.section("AtP* of the query and key nodes (qk_fix)");
    f.report.paragraph(
        "AtP linearises through the attention softmax; where the softmax is saturated its slope is ~0 \
         although a patched query or key can move the attention from one slot to another. AtP* (Kramar et \
         al. 2024) computes the change of the attention pattern exactly and linearises only from the \
         pattern to the logit difference: sum_j (A'[t,j] - A[t,j]) dLD/dA[t,j]. Query nodes: hook_q per \
         query head and position (a q cell patches its head's hook_q at the kind's positions). Key nodes: \
         the key slots of hook_pattern per KV head (raw tokens from hook_k, compressed entries pooled from \
         the window's hook_k); a k cell sums every slot and is checked against patching the KV head's \
         hook_k at every position. atp_* is plain AtP of the same nodes ((x_partner - x) . dLD/dx), \
         atpstar_* the fix, q_nld_* / k_nld_* the exact patching.",
    );
    if let (Some(a), Some(x)) = (
        d.scalar(m, "atpstar_cells_per_s"),
        d.scalar(m, "exact_qk_cells_per_s"),
    ) {
        f.report.paragraph(format!(
            "Speed: AtP* + AtP {:.1} cells/s (query head x position and KV head cells), exact patching \
             {:.1} head cells/s (query heads at the kind's positions, KV heads at every position; {:.1}x).",
            a.value,
            x.value,
            a.value / x.value
        ));
    }
    let sat: Vec<String> = d
        .find(m, "saturated_read_rows")
        .filter_map(|r| Some(format!("L{} {:.0}%", r.layer?, 100.0 * r.value)))
        .collect();
    if !sat.is_empty() {
        f.report.paragraph(format!(
            "Saturation: share of the query rows at the read position (every prompt and query head) whose \
             largest attention probability exceeds 0.99: {}. Where a row is not saturated the softmax is \
             close to linear over the patch and AtP and AtP* of q agree; they part where it is.",
            sat.join(", ")
        ));
    }
}

/// Scatter of AtP and AtP* of q and k against exact patching, every head x phase cell.
fn qk_scatter(f: &mut Figures, m: &str, dirn: Direction) -> Result<()> {
    let (d, dir) = (f.data, f.dir);
    let mut series = Vec::new();
    for site in [QkSite::Q, QkSite::K] {
        let x = cell_map(d, m, &exact_qk_metric(site, dirn), site.kind());
        for method in [QkMethod::Atp, QkMethod::AtpStar] {
            let e = cell_map(d, m, &est_qk_metric(method, site, dirn), site.kind());
            let name = format!("{} {}", method.as_str(), site.as_str());
            series.extend(paired_series(name, &e, &x));
        }
    }
    if series.is_empty() {
        return Ok(());
    }
    let xm = dirn.metric();
    let fig = scatter_predicted_vs_observed(
        dir.join(format!("atpstar_qk_{xm}_vs_exact")),
        &ScatterSpec {
            series,
            title: format!("{m}: AtP / AtP* of q and k vs exact {xm}, head x phase"),
            x_label: "estimate of NLD".into(),
            y_label: "exact NLD".into(),
            r2_text: None,
            size: None,
        },
    )?;
    push(
        &mut f.files,
        &mut f.report,
        &format!("AtP and AtP* of hook_q / key slots vs exact {xm}, every head x source phase"),
        fig,
    );
    Ok(())
}

fn qk_val(f: &Figures, m: &str, metric: &str, ph: Option<u32>) -> f64 {
    f.data
        .find(m, metric)
        .find(|r| r.phase == ph)
        .map_or(f64::NAN, |r| r.value)
}

fn agreement_table(
    f: &mut Figures,
    m: &str,
    phases: &[u32],
    dirn: Direction,
    recall: &str,
) -> Result<()> {
    let mut header = vec!["phase".to_string()];
    let mut cols = Vec::new();
    for site in [QkSite::Q, QkSite::K] {
        for method in [QkMethod::Atp, QkMethod::AtpStar] {
            for stat in ["spearman", recall, "mae"] {
                let metric = agreement_qk_metric(stat, method, site, dirn);
                if f.data.has(m, &metric) {
                    header.push(format!("{stat} {} ({})", method.as_str(), site.as_str()));
                    cols.push(metric);
                }
            }
        }
    }
    if cols.is_empty() {
        return Ok(());
    }
    let mut body = Vec::new();
    for ph in phases.iter().map(|&p| Some(p)).chain([None]) {
        let mut row = vec![ph.map_or("all".to_string(), |p| p.to_string())];
        row.extend(cols.iter().map(|c| fmt3(qk_val(f, m, c, ph))));
        body.push(row);
    }
    f.report.table(
        format!(
            "Agreement of AtP / AtP* with exact patching of q and k ({}; top-k recall over |NLD|)",
            dirn.metric()
        ),
        header,
        body,
    );
    Ok(())
}

/// Where each estimate's ranking fails, and the cells where AtP and AtP* differ most from
/// the exact value.
fn disagreement_text(f: &mut Figures, m: &str, phases: &[u32], dirn: Direction, recall: &str) {
    let parts = ranking_parts(f, m, phases, dirn, recall);
    if parts.is_empty() {
        return;
    }
    let mut text = format!("{}.", parts.join("; "));
    // Pooled over the phases: does the fix help?
    for site in [QkSite::Q, QkSite::K] {
        if let Some(verdict) = pooled_verdict(f, m, phases, dirn, site) {
            text.push_str(&verdict);
        }
    }
    // The largest errors of each estimate, with the other estimate next to it.
    let worst = worst_qk_cells(f, m, dirn);
    if !worst.is_empty() {
        let list: Vec<String> = worst.iter().take(6).map(|w| w.1.clone()).collect();
        text.push_str(&format!(" Largest errors: {}.", list.join("; ")));
    }
    text.push_str(
        " AtP* removes only the softmax's curvature; what remains is the first-order step from the pattern \
         to the logit difference (later layers, norms, a patch that switches the answer at once) and, for \
         keys, the sum over slots that are in truth patched together.",
    );
    f.report.paragraph(text);
}

/// Per site and method with agreement rows: the phases where the ranking fails, or that
/// it ranks well at every phase.
fn ranking_parts(
    f: &Figures,
    m: &str,
    phases: &[u32],
    dirn: Direction,
    recall: &str,
) -> Vec<String> {
    let mut parts = Vec::new();
    for site in [QkSite::Q, QkSite::K] {
        for method in [QkMethod::Atp, QkMethod::AtpStar] {
            let sp = agreement_qk_metric("spearman", method, site, dirn);
            let rq = agreement_qk_metric(recall, method, site, dirn);
            if !f.data.has(m, &sp) {
                continue;
            }
            let bad: Vec<String> = phases
                .iter()
                .filter(|&&p| {
                    let (s, r) = (qk_val(f, m, &sp, Some(p)), qk_val(f, m, &rq, Some(p)));
                    s.is_nan() || s < 0.5 || r < 1.0
                })
                .map(|&p| {
                    format!(
                        "{p} ({}, {})",
                        fmt3(qk_val(f, m, &sp, Some(p))),
                        fmt3(qk_val(f, m, &rq, Some(p)))
                    )
                })
                .collect();
            let what = format!("{} of {}", method.as_str(), site.as_str());
            parts.push(if bad.is_empty() {
                format!("{what}: ranks well at every phase")
            } else {
                format!("{what} fails (Spearman < 0.5 or a top-k head missed; Spearman, recall) at phase {}", bad.join(", "))
            });
        }
    }
    parts
}

/// The mean of the finite values, NaN when there are none.
fn mean_finite(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The `site` nodes pooled over the phases: Spearman of AtP and AtP*, their mean
/// absolute NLD error, and whether the fix helps; None without pooled Spearman rows.
fn pooled_verdict(
    f: &Figures,
    m: &str,
    phases: &[u32],
    dirn: Direction,
    site: QkSite,
) -> Option<String> {
    let pooled =
        |method, stat: &str| qk_val(f, m, &agreement_qk_metric(stat, method, site, dirn), None);
    let mean_mae = |method| {
        mean_finite(phases.iter().map(|&p| {
            qk_val(
                f,
                m,
                &agreement_qk_metric("mae", method, site, dirn),
                Some(p),
            )
        }))
    };
    let (sa, ss) = (
        pooled(QkMethod::Atp, "spearman"),
        pooled(QkMethod::AtpStar, "spearman"),
    );
    if sa.is_nan() && ss.is_nan() {
        return None;
    }
    let (ma, ms) = (mean_mae(QkMethod::Atp), mean_mae(QkMethod::AtpStar));
    let verdict = if ms < 0.8 * ma {
        "AtP* is closer to the exact values"
    } else if ms > 1.25 * ma {
        "AtP* is further from the exact values"
    } else {
        "AtP and AtP* are about equally close"
    };
    let caveat = rank_caveat(f, m, dirn, site);
    Some(format!(
        " {} nodes: pooled Spearman AtP {}, AtP* {}; mean absolute NLD error over the phases AtP {ma:.4}, AtP* {ms:.4}: {verdict}{caveat}.",
        site.as_str(),
        fmt3(sa),
        fmt3(ss),
    ))
}

/// Why the `site` rank statistics may mislead (few heads, near-zero exact effects), as
/// ` (...)`, or empty.
fn rank_caveat(f: &Figures, m: &str, dirn: Direction, site: QkSite) -> String {
    let n = f
        .data
        .find(
            m,
            &agreement_qk_metric("spearman", QkMethod::AtpStar, site, dirn),
        )
        .find(|r| r.phase.is_none())
        .map_or(0, |r| r.n);
    let mut caveat = Vec::new();
    if n < 6 {
        caveat.push(format!(
            "over {n} heads only: these rank statistics are coarse"
        ));
    }
    // No effect is NLD 0 (denoising) or 1 (noising).
    let none = match dirn {
        Direction::Denoise => 0.0,
        Direction::Noise => 1.0,
    };
    let largest = cell_map(f.data, m, &exact_qk_metric(site, dirn), site.kind())
        .values()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |a, v| a.max((v - none).abs()));
    if largest < 0.05 {
        caveat.push(format!(
            "the exact effects are small (largest |NLD change| {largest:.4}), so the rankings order near-noise differences"
        ));
    }
    if caveat.is_empty() {
        String::new()
    } else {
        format!(" ({})", caveat.join("; "))
    }
}

/// Every q / k head x phase cell with finite exact, AtP and AtP* values, as (the larger
/// error of the two, description), largest first.
fn worst_qk_cells(f: &Figures, m: &str, dirn: Direction) -> Vec<(f64, String)> {
    let mut worst: Vec<(f64, String)> = Vec::new();
    for site in [QkSite::Q, QkSite::K] {
        let x = cell_map(f.data, m, &exact_qk_metric(site, dirn), site.kind());
        let a = cell_map(
            f.data,
            m,
            &est_qk_metric(QkMethod::Atp, site, dirn),
            site.kind(),
        );
        let s = cell_map(
            f.data,
            m,
            &est_qk_metric(QkMethod::AtpStar, site, dirn),
            site.kind(),
        );
        for (k, o) in &x {
            let (Some(ph), Some(av), Some(sv)) = (k.2, a.get(k), s.get(k)) else {
                continue;
            };
            if !(o.is_finite() && av.is_finite() && sv.is_finite()) {
                continue;
            }
            let name = match site {
                QkSite::Q => format!("L{}.H{} q", k.0, k.1),
                QkSite::K => format!("L{}.KV{} k", k.0, k.1),
            };
            let err = (av - o).abs().max((sv - o).abs());
            worst.push((
                err,
                format!("{name} at phase {ph}: exact {o:.3}, AtP {av:.3}, AtP* {sv:.3}"),
            ));
        }
    }
    worst.sort_by(|a, b| b.0.total_cmp(&a.0));
    worst
}
