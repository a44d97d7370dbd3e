//! `edge-attribution`: EAP and EAP-IG scores of every edge of the model's graph
//! ([`graph`]: embeddings, query-head outputs and MLP outputs -> query-head q inputs,
//! KV-head k / v inputs (MQA: one node per KV head), compressed entries, MLP inputs,
//! the logit difference), per source phase, checked against exact path patching, with
//! a logit lens by phase.
//!
//! Per phase group r (clean prompts and their corrupted partners, as in path patching):
//! 1. **Scores** ([`eap`]): for every method, one plain forward, then per state (EAP: the
//!    receiving prompts; EAP-IG: `ig_steps` interpolations of the input embeddings)
//!    one gradient pass for the receivers' gradients and the direct-path derivative
//!    into every receiver's input (local products per stream point and a stream
//!    transport where the model offers its stream API, else one replicated pass); every
//!    edge's per-prompt estimate of the change of the
//!    clean-orientation logit difference. The estimated NLD of an edge is the
//!    patch-heads NLD with `LD_patched` replaced by `LD_receiving + score`.
//! 2. **Exact check** (`validate`): the path-patching routine on (a seeded sample of)
//!    the edges path patching defines (query head -> later q / k / v), and per phase the
//!    Spearman correlation, top-k recall and mean absolute error of each estimator
//!    against it. Path patching replaces `hook_k` / `hook_v`, which on kvc models also
//!    feed the compressed entries, so its k / v edge is compared with the sum of the
//!    raw and entry edges there.
//! 3. **Logit lens** (`lens`): each layer's residual stream entering the block (and the
//!    last block's output) through the model's final norm and unembedding (a
//!    `forward_from` the end), at the clean prompts' read position: the answer's
//!    probability and rank per layer and phase.

use std::collections::BTreeMap;

use burn::tensor::{Tensor, TensorData};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::analysis::{Clusters, Est, accuracy_clusters, per_phase};
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookSpec, Site};
use crate::model::LanguageModel;
use crate::output::{
    BandSeries, HeatmapSpec, LinePlotSpec, LongRow, ScatterSeries, ScatterSpec, heatmap,
    line_with_bands, scatter_predicted_vs_observed,
};

use super::super::heads::Direction;
use super::super::patching::{Outcome, Positions, Prompts};
use super::super::progress::Progress;
use super::super::report::{Figures, sym_range};
use super::super::rows::baseline_rows;
use super::attribution_patching::{NldRows, agreement_stats};
use super::path_patching::{PathCell, PathInput, Receiver, Sender, path_group};
use super::{Ctx, Kind, KindOutput};
use crate::tasks::prompts::{PromptMeta, paired_prompts};

/// A faithfulness value per phase and pooled.
type Curve = (Vec<f64>, f64);
/// A value with its interval `(value, lo, hi)`.
type Band = (f64, f64, f64);

pub mod bench;
pub mod eap;
pub mod faithful;
pub mod figure;
pub mod graph;
mod local;
mod replicas;

pub use eap::{EdgeRun, EdgeScores, Method, Pass2, Timing};
pub use graph::{Edge, Graph, Input, ReceiverNode, SenderNode};

/// An estimator as the settings name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MethodName {
    Eap,
    Eapig,
}

/// `[edges]` (edge-attribution).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EdgeAttribution {
    /// Default both.
    pub methods: Vec<MethodName>,
    /// Interpolation steps of EAP-IG. Default 5.
    pub ig_steps: usize,
    /// Default denoise.
    pub direction: Direction,
    /// Run exact path patching on a sample of edges and write the agreement. Default
    /// true.
    pub validate: bool,
    /// At most this many edges (query head -> later q / k / v) are path-patched, a
    /// seeded sample when there are more. Default 64.
    pub validate_edges: usize,
    /// k of the top-k recall. Default 5.
    pub top_k: usize,
    /// Logit lens by phase. Default true.
    pub lens: bool,
    /// Circuit sizes (top-n edges of each phase group, ranked by the last method) whose
    /// faithfulness is measured; sizes above the number of edges are dropped, the full
    /// graph is always added. Default [1, 2, 5, 10, 20, 50, 100, 200]; [] = none.
    pub circuit_sizes: Vec<usize>,
}

impl Default for EdgeAttribution {
    fn default() -> Self {
        EdgeAttribution {
            methods: vec![MethodName::Eap, MethodName::Eapig],
            ig_steps: 5,
            direction: Direction::Denoise,
            validate: true,
            validate_edges: 64,
            top_k: 5,
            lens: true,
            circuit_sizes: vec![1, 2, 5, 10, 20, 50, 100, 200],
        }
    }
}

impl EdgeAttribution {
    fn method(&self, m: MethodName) -> Method {
        match m {
            MethodName::Eap => Method::Eap,
            MethodName::Eapig => Method::EapIg {
                steps: self.ig_steps,
            },
        }
    }
}

/// Metric of an edge's estimated NLD: `eap_nld_denoise:L0H1->L2KV0.k`.
pub fn edge_metric(method: &str, d: Direction, edge: &str) -> String {
    format!("{method}_{}:{edge}", d.metric())
}

/// Metric of an exact path-patching NLD (`exact_nld_denoise:L0H1->L2KV0.k`) and of an
/// estimate of the same path (`eap_path_nld_denoise:...`: on kvc the k / v edge plus
/// its entry edge).
pub fn exact_metric(d: Direction, edge: &str) -> String {
    format!("exact_{}:{edge}", d.metric())
}

/// See [`exact_metric`].
pub fn path_est_metric(method: &str, d: Direction, edge: &str) -> String {
    format!("{method}_path_{}:{edge}", d.metric())
}

/// Agreement statistic of a method with exact path patching (`spearman_eap_nld_denoise`).
pub fn agreement_metric(stat: &str, method: &str, d: Direction) -> String {
    format!("{stat}_{method}_{}", d.metric())
}

impl Kind for EdgeAttribution {
    fn name(&self) -> &'static str {
        "edge-attribution"
    }

    fn section(&self) -> &'static str {
        "edges"
    }

    fn default_n_logical(&self) -> usize {
        16
    }

    fn check(&self, exp: &super::super::experiment::Experiment) -> Result<()> {
        super::empty_list(exp, "edges", "methods", self.methods.is_empty())?;
        if self.ig_steps == 0 && self.methods.contains(&MethodName::Eapig) {
            return Err(exp.err("edges", "ig_steps", "EAP-IG needs at least 1 step"));
        }
        if self.top_k == 0 {
            return Err(exp.err("edges", "top_k", "must be at least 1"));
        }
        if self.circuit_sizes.contains(&0) {
            return Err(exp.err("edges", "circuit_sizes", "sizes must be at least 1"));
        }
        if self.validate && self.validate_edges < 2 {
            return Err(exp.err(
                "edges",
                "validate_edges",
                "a rank correlation needs at least 2 edges",
            ));
        }
        Ok(())
    }

    fn accuracy_series(&self) -> Vec<(&'static str, String)> {
        vec![
            ("clean", "accuracy".to_string()),
            (
                "corrupted (answer = the replaced value)",
                "accuracy_corrupted".to_string(),
            ),
        ]
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(self, f)
    }
}

/// The edges path patching can check: query head -> q of a later query head, k / v of
/// a later KV head, as path cells (direction `d`) with their senders; a seeded sample
/// of at most `max` of them.
pub fn path_cells(
    graph: &Graph,
    d: Direction,
    max: usize,
    seed: u64,
) -> (Vec<Sender>, Vec<PathCell>, Vec<(usize, ReceiverNode)>) {
    let mut cand = path_candidates(graph);
    if seeded_sample(&mut cand, max, seed ^ 0xed6e) {
        cand.sort();
    }
    cells_of(graph, d, cand)
}

/// [`path_cells`] of every edge from a seeded sample of at most `max` head senders
/// (each sender's patched run is shared by all its edges, as when every edge is
/// patched: `bench edges --exact-senders`).
pub fn path_cells_of_senders(
    graph: &Graph,
    d: Direction,
    max: usize,
    seed: u64,
) -> (Vec<Sender>, Vec<PathCell>, Vec<(usize, ReceiverNode)>) {
    let mut cand = path_candidates(graph);
    let mut ids: Vec<usize> = cand.iter().map(|c| c.0).collect();
    ids.sort();
    ids.dedup();
    if seeded_sample(&mut ids, max, seed ^ 0x5e4d) {
        cand.retain(|c| ids.contains(&c.0));
    }
    cells_of(graph, d, cand)
}

/// Keep a seeded random `max` of `items` when there are more (shuffled order); true
/// when it sampled.
fn seeded_sample<T>(items: &mut Vec<T>, max: usize, seed: u64) -> bool {
    if items.len() <= max {
        return false;
    }
    items.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    items.truncate(max);
    true
}

/// Every head -> later q / k / v edge, as (sender index, receiver), in graph order.
fn path_candidates(graph: &Graph) -> Vec<(usize, ReceiverNode)> {
    let mut cand: Vec<(usize, ReceiverNode)> = Vec::new();
    for e in &graph.edges {
        let (s, r) = (graph.senders[e.sender], graph.receivers[e.receiver]);
        if let (SenderNode::Head { .. }, ReceiverNode::Attn { input, .. }) = (s, r)
            && matches!(input, Input::Q | Input::K | Input::V)
        {
            cand.push((e.sender, r));
        }
    }
    cand
}

/// The path cells and senders of the candidate edges `cand`.
fn cells_of(
    graph: &Graph,
    d: Direction,
    cand: Vec<(usize, ReceiverNode)>,
) -> (Vec<Sender>, Vec<PathCell>, Vec<(usize, ReceiverNode)>) {
    let mut sender_ids: Vec<usize> = cand.iter().map(|c| c.0).collect();
    sender_ids.sort();
    sender_ids.dedup();
    let senders: Vec<Sender> = sender_ids
        .iter()
        .map(|&si| match graph.senders[si] {
            SenderNode::Head { layer, head } => Sender { layer, head },
            _ => unreachable!("only head senders are candidates"),
        })
        .collect();
    let cells = cand
        .iter()
        .map(|(si, r)| {
            let ReceiverNode::Attn { layer, head, input } = *r else {
                unreachable!("only attention receivers are candidates")
            };
            PathCell {
                sender: sender_ids.binary_search(si).expect("listed"),
                receiver: Receiver {
                    layer,
                    head,
                    input: match input {
                        Input::Q => PathInput::Q,
                        Input::K => PathInput::K,
                        _ => PathInput::V,
                    },
                },
                direction: d,
            }
        })
        .collect();
    (senders, cells, cand)
}

/// Whether the model's compressed entries are pooled from `hook_k` / `hook_v` (kvc), so
/// that path patching's k / v replacement reaches them.
fn entries_pooled_from_raw(model: &dyn LanguageModel) -> bool {
    model.info().arch != crate::model::deepseek_v4::MODEL_TYPE
}

/// One group's prompts and metadata.
fn group_prompts(
    ctx: &Ctx,
    set: &crate::tasks::KvEvalSet,
    r: u32,
) -> Result<(Prompts, Vec<PromptMeta>)> {
    let ex = ctx.examples(set, r);
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    paired_prompts(
        &ex,
        &ctx.task.space,
        assign,
        ctx.task.prompt.key_len,
        ctx.task.seed,
    )
}

/// Per-prompt scores from the store, or computed and stored: per edge a vector of `n`
/// scores (in `ld`), then the `2n` base outcomes.
fn stored_scores(
    ctx: &mut Ctx,
    key: &str,
    n_vectors: usize,
    n: usize,
    progress: &mut Progress,
    units: u64,
    compute: impl FnOnce(&mut Progress) -> Result<(Vec<Outcome>, Vec<Vec<Outcome>>)>,
) -> Result<(Vec<Outcome>, Vec<Vec<Outcome>>)> {
    let mut expected = vec![n; n_vectors];
    expected.push(2 * n);
    if let Some(mut v) = ctx.store.load(key, &expected)? {
        progress.skip(units);
        ctx.stats.cells_resumed += n_vectors as u64;
        let base = v.pop().expect("the base vector was expected");
        return Ok((base, v));
    }
    let (base, cells) = compute(progress)?;
    let mut save = cells.clone();
    save.push(base.clone());
    ctx.store.save(key, &save)?;
    ctx.stats.cells_computed += n_vectors as u64;
    Ok((base, cells))
}

fn as_outcomes(v: &[f32]) -> Vec<Outcome> {
    v.iter().map(|&ld| Outcome { correct: false, ld }).collect()
}

/// Clusters of `(LD_patched, LD_clean, LD_corrupted)` (clean orientation) of per-prompt
/// changes `delta` of the receiving prompts' LD.
fn delta_clusters(
    meta: &[PromptMeta],
    base: &[Outcome],
    delta: &[f32],
    d: Direction,
    c: &mut Clusters<3>,
) {
    let n = meta.len() / 2;
    for i in 0..n {
        let clean = base[i].ld as f64;
        let corrupt = -base[n + i].ld as f64;
        let start = match d {
            Direction::Denoise => corrupt,
            Direction::Noise => clean,
        };
        c.add(
            meta[i].logical,
            meta[i].phase,
            [start + delta[i] as f64, clean, corrupt],
        );
    }
}

/// What every group gives: metadata, base outcomes, per method per edge scores, exact
/// path outcomes per validated cell.
struct GroupData {
    meta: Vec<PromptMeta>,
    base: Vec<Outcome>,
    scores: Vec<Vec<Vec<f32>>>,
    exact: Vec<Vec<Outcome>>,
    lens: Vec<LensObs>,
    /// Per circuit size: the clean prompts' LD with only the circuit's edges clean.
    faith: Vec<Vec<f32>>,
}

/// Per clean prompt and lens layer: the answer's probability and rank.
#[derive(Debug, Clone, Copy)]
struct LensObs {
    logical: u64,
    phase: u32,
    layer: usize,
    prob: f64,
    rank: f64,
}

fn run(cfg: &EdgeAttribution, ctx: &mut Ctx) -> Result<KindOutput> {
    let graph = Graph::of(&ctx.info);
    let set = ctx.eval_set()?;
    let phases = ctx.task.phases.clone();
    let d = cfg.direction;
    let (senders, cells, cand) = if cfg.validate {
        path_cells(&graph, d, cfg.validate_edges, ctx.seed())
    } else {
        (Vec::new(), Vec::new(), Vec::new())
    };
    let methods: Vec<Method> = cfg.methods.iter().map(|&m| cfg.method(m)).collect();
    let sizes = circuit_sizes(cfg, &graph);
    let per_group: u64 =
        methods.len() as u64 + u64::from(!cells.is_empty()) + u64::from(!sizes.is_empty());
    let mut progress = Progress::new(
        ctx.opts.progress,
        &format!("{} edge-attribution", ctx.mref.name),
        "passes",
        per_group * phases.len() as u64,
    );
    let t0 = std::time::Instant::now();
    let mut groups = Vec::new();
    for &r in &phases {
        let (prompts, meta) = group_prompts(ctx, &set, r)?;
        let n = prompts.n() / 2;
        let mut base = Vec::new();
        let mut scores: Vec<Vec<Vec<f32>>> = Vec::new();
        for m in &methods {
            let key = format!("p{r}-edges-{}-{}", m.name(), d.metric());
            let (model, max_rows) = (ctx.model, ctx.max_rows);
            let g = &graph;
            let pr = &prompts;
            let (b, s) = stored_scores(ctx, &key, g.edges.len(), n, &mut progress, 1, |prog| {
                let mut hidden = Progress::new(super::super::ProgressMode::Hidden, "", "", 0);
                let run = EdgeRun {
                    model,
                    prompts: pr,
                    graph: g,
                    direction: d,
                    max_rows,
                };
                let out = run.scores(*m, &mut hidden)?;
                prog.inc(1);
                Ok((
                    out.base,
                    out.scores.iter().map(|v| as_outcomes(v)).collect(),
                ))
            })?;
            base = b;
            scores.push(s.iter().map(|v| v.iter().map(|o| o.ld).collect()).collect());
        }
        let exact = if cells.is_empty() {
            Vec::new()
        } else {
            let key = format!("p{r}-edges-exact-{}", d.metric());
            let (model, max_rows) = (ctx.model, ctx.max_rows);
            let (s_, c_) = (&senders, &cells);
            let pr = &prompts;
            let (b, e) = stored_scores(ctx, &key, cells.len(), n, &mut progress, 1, |prog| {
                let mut hidden =
                    Progress::new(super::super::ProgressMode::Hidden, "", "", c_.len() as u64);
                let out = path_group(model, pr, s_, c_, &Positions::All, max_rows, &mut hidden)?;
                prog.inc(1);
                Ok(out)
            })?;
            if base.is_empty() {
                base = b;
            }
            e
        };
        let lens = if cfg.lens {
            logit_lens(ctx.model, &prompts, &meta, ctx.max_rows)?
        } else {
            Vec::new()
        };
        let faith = if sizes.is_empty() {
            Vec::new()
        } else {
            let key = format!(
                "p{r}-edges-faith-{}-{}",
                methods[methods.len() - 1].name(),
                d.metric()
            );
            let ranked = faithful::ranked_edges(&scores[scores.len() - 1]);
            let (model, max_rows) = (ctx.model, ctx.max_rows);
            let g = &graph;
            let pr = &prompts;
            let b0 = base.clone();
            let (_, v) = stored_scores(ctx, &key, sizes.len(), n, &mut progress, 1, |prog| {
                let mut out = Vec::new();
                for &k in &sizes {
                    let keep = faithful::top_k_keep(&ranked, k);
                    out.push(as_outcomes(&faithful::circuit_ld(
                        model, pr, g, &keep, max_rows,
                    )?));
                }
                prog.inc(1);
                Ok((b0, out))
            })?;
            v.iter().map(|o| o.iter().map(|x| x.ld).collect()).collect()
        };
        groups.push(GroupData {
            meta,
            base,
            scores,
            exact,
            lens,
            faith,
        });
    }
    progress.finish();
    ctx.stats.seconds += t0.elapsed().as_secs_f64();
    let pooled_raw = entries_pooled_from_raw(ctx.model);
    let mut rows = rows(cfg, ctx, &graph, &groups, &cells, &cand, pooled_raw);
    rows.extend(faith_rows(ctx, &groups, &sizes));
    Ok(KindOutput {
        tables: vec![("edges".into(), rows)],
    })
}

/// The circuit sizes measured: the settings' sizes below the number of edges, then
/// every edge.
pub fn circuit_sizes(cfg: &EdgeAttribution, graph: &Graph) -> Vec<usize> {
    if cfg.circuit_sizes.is_empty() {
        return Vec::new();
    }
    let e = graph.edges.len();
    let mut v: Vec<usize> = cfg
        .circuit_sizes
        .iter()
        .copied()
        .filter(|&k| k < e)
        .collect();
    v.sort_unstable();
    v.dedup();
    v.push(e);
    v
}

/// Metric of the faithfulness of the top-k circuit (`faithfulness_top10`).
pub fn faith_metric(k: usize) -> String {
    format!("faithfulness_top{k}")
}

/// The faithfulness rows (per size, per phase and pooled: the fraction of the
/// clean-minus-corrupted LD the circuit recovers) and `circuit_size_80` per phase (the
/// smallest measured size recovering at least 0.8; NaN when none does).
fn faith_rows(ctx: &Ctx, groups: &[GroupData], sizes: &[usize]) -> Vec<LongRow> {
    let mut out = Vec::new();
    if sizes.is_empty() || groups.iter().all(|g| g.faith.is_empty()) {
        return out;
    }
    let p = ctx.p();
    let nr = NldRows::new(ctx);
    let mut vals = Vec::new();
    for (si, &k) in sizes.iter().enumerate() {
        let mut c = Clusters::<3>::new(p);
        for g in groups {
            let n = g.meta.len() / 2;
            for i in 0..n {
                c.add(
                    g.meta[i].logical,
                    g.meta[i].phase,
                    [
                        g.faith[si][i] as f64,
                        g.base[i].ld as f64,
                        -g.base[n + i].ld as f64,
                    ],
                );
            }
        }
        vals.push(nr.push(&c, &faith_metric(k), None, &mut out));
    }
    let first = |per: &dyn Fn(&Curve) -> f64| {
        sizes
            .iter()
            .zip(&vals)
            .find(|(_, v)| per(v) >= 0.8)
            .map_or(f64::NAN, |(k, _)| *k as f64)
    };
    for &ph in &ctx.task.phases {
        let v = first(&|x: &Curve| x.0[ph as usize]);
        out.push(
            ctx.rows
                .row(
                    "circuit_size_80",
                    Est {
                        value: v,
                        ci: None,
                        n: 0,
                    },
                )
                .at_phase(ph),
        );
    }
    out.push(ctx.rows.row(
        "circuit_size_80",
        Est {
            value: first(&|x: &(Vec<f64>, f64)| x.1),
            ci: None,
            n: 0,
        },
    ));
    out
}

/// The logit lens of a group's clean prompts: the residual entering every block (and
/// the last block's output) run through the model's end (`forward_from` the last
/// layer + 1: final norm and unembedding), read at the first target position.
fn logit_lens(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    meta: &[PromptMeta],
    max_rows: usize,
) -> Result<Vec<LensObs>> {
    let nl = model.info().n_layers();
    let n = prompts.n() / 2;
    let device = model.device();
    let clean: Vec<usize> = (0..n).collect();
    let mut spec = HookSpec::new();
    for l in 0..nl {
        spec = spec.capture_point(HookPoint::block(l, Site::ResidPre));
    }
    spec = spec.capture_point(HookPoint::block(nl - 1, Site::ResidPost));
    let out = model.forward(prompts.tokens_of(&clean, &device), &spec)?;
    let mut obs = Vec::new();
    for l in 0..=nl {
        let p = if l < nl {
            HookPoint::block(l, Site::ResidPre)
        } else {
            HookPoint::block(nl - 1, Site::ResidPost)
        };
        let resid = out
            .cache
            .get(&p)
            .ok_or_else(|| Error::hook(p.to_string(), "not captured"))?;
        for chunk in clean.chunks(max_rows.max(1)) {
            let r = resid.select_batch(chunk)?;
            let o =
                model.forward_from(prompts.tokens_of(chunk, &device), nl, &r, &HookSpec::new())?;
            let [b, t, v] = o.logits.dims();
            let mut flat = Vec::with_capacity(b);
            for (k, &i) in chunk.iter().enumerate() {
                flat.push((k * t + prompts.targets[i].positions[0]) as i64);
            }
            let idx =
                Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(flat, [b]), &device);
            let rows = o.logits.reshape([b * t, v]).select(0, idx);
            let probs = burn::tensor::activation::softmax(rows, 1).try_into_vec_as::<f32>()?;
            for (k, &i) in chunk.iter().enumerate() {
                let row = &probs[k * v..(k + 1) * v];
                let a = prompts.targets[i].answers[0] as usize;
                let pa = row[a];
                let rank = row.iter().filter(|&&x| x > pa).count() as f64;
                obs.push(LensObs {
                    logical: meta[i].logical,
                    phase: meta[i].phase,
                    layer: l,
                    prob: pa as f64,
                    rank,
                });
            }
        }
    }
    Ok(obs)
}

/// The metric names of the logit lens: `lens_prob`, `lens_rank` (0 = top), at the
/// layer column (`n_layers` = the last block's output).
pub const LENS_PROB: &str = "lens_prob";
/// See [`LENS_PROB`].
pub const LENS_RANK: &str = "lens_rank";

fn rows(
    cfg: &EdgeAttribution,
    ctx: &Ctx,
    graph: &Graph,
    groups: &[GroupData],
    cells: &[PathCell],
    cand: &[(usize, ReceiverNode)],
    pooled_raw: bool,
) -> Vec<LongRow> {
    let (p, phases) = (ctx.p(), &ctx.task.phases);
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = &ctx.rows;
    let d = cfg.direction;
    // Baselines.
    let mut acc = Vec::new();
    let mut acc_corrupt = Vec::new();
    for g in groups {
        let n = g.meta.len() / 2;
        for (i, m) in g.meta.iter().take(n).enumerate() {
            acc.push((m.logical, m.phase, g.base[i].correct));
            acc_corrupt.push((m.logical, m.phase, g.base[n + i].correct));
        }
    }
    let mut out = baseline_rows(rc, "", &accuracy_clusters(p, acc), phases, reps, seed);
    out.extend(baseline_rows(
        rc,
        "_corrupted",
        &accuracy_clusters(p, acc_corrupt),
        phases,
        reps,
        seed,
    ));
    let nr = NldRows::new(ctx);
    let clusters_of = |f: &dyn Fn(&GroupData) -> Vec<f32>| {
        let mut c = Clusters::<3>::new(p);
        for g in groups {
            delta_clusters(&g.meta, &g.base, &f(g), d, &mut c);
        }
        c
    };
    // Every edge's estimate per method.
    for (mi, m) in cfg.methods.iter().enumerate() {
        let name = cfg.method(*m).name();
        for (ei, e) in graph.edges.iter().enumerate() {
            let c = clusters_of(&|g: &GroupData| g.scores[mi][ei].clone());
            nr.push(
                &c,
                &edge_metric(name, d, &graph.edge_label(*e)),
                None,
                &mut out,
            );
        }
    }
    out.push(rc.row(
        "edges_scored",
        Est {
            value: graph.edges.len() as f64,
            ci: None,
            n: phases.len() as u64,
        },
    ));
    // Exact path patching and the agreement.
    if !cells.is_empty() {
        let label = |ci: usize| {
            let (si, r) = cand[ci];
            format!("{}->{}", graph.senders[si].label(), r.label())
        };
        let mut exact_vals: Vec<(Vec<f64>, f64)> = Vec::new();
        for ci in 0..cells.len() {
            let mut c = Clusters::<3>::new(p);
            for g in groups {
                let n = g.meta.len() / 2;
                let start: Vec<f32> = match d {
                    Direction::Denoise => (0..n).map(|i| -g.base[n + i].ld).collect(),
                    Direction::Noise => (0..n).map(|i| g.base[i].ld).collect(),
                };
                let sign = if d == Direction::Denoise { -1.0 } else { 1.0 };
                let delta: Vec<f32> = g.exact[ci]
                    .iter()
                    .zip(&start)
                    .map(|(o, s)| sign * o.ld - s)
                    .collect();
                delta_clusters(&g.meta, &g.base, &delta, d, &mut c);
            }
            exact_vals.push(nr.push(&c, &exact_metric(d, &label(ci)), None, &mut out));
        }
        for (mi, m) in cfg.methods.iter().enumerate() {
            let name = cfg.method(*m).name();
            let mut est_vals: Vec<(Vec<f64>, f64)> = Vec::new();
            for (ci, (si, r)) in cand.iter().enumerate() {
                let ReceiverNode::Attn { layer, head, input } = *r else {
                    continue;
                };
                let c = clusters_of(&|g: &GroupData| {
                    eap::path_equivalent(graph, &g.scores[mi], *si, layer, head, input, pooled_raw)
                        .unwrap_or_default()
                });
                est_vals.push(nr.push(&c, &path_est_metric(name, d, &label(ci)), None, &mut out));
            }
            let metric = |stat: &str| agreement_metric(stat, name, d);
            for &ph in phases {
                let est: Vec<f64> = est_vals.iter().map(|v| v.0[ph as usize]).collect();
                let ex: Vec<f64> = exact_vals.iter().map(|v| v.0[ph as usize]).collect();
                out.extend(agreement_stats(rc, cfg.top_k, metric, Some(ph), &est, &ex));
            }
            let est: Vec<f64> = est_vals.iter().map(|v| v.1).collect();
            let ex: Vec<f64> = exact_vals.iter().map(|v| v.1).collect();
            out.extend(agreement_stats(rc, cfg.top_k, metric, None, &est, &ex));
        }
    }
    // Logit lens.
    if groups.iter().any(|g| !g.lens.is_empty()) {
        let nl = graph.n_layers;
        for l in 0..=nl {
            for (metric, f) in [
                (LENS_PROB, (|o: &LensObs| o.prob) as fn(&LensObs) -> f64),
                (LENS_RANK, (|o: &LensObs| o.rank) as fn(&LensObs) -> f64),
            ] {
                let mut c = Clusters::<1>::new(p);
                for g in groups {
                    for o in g.lens.iter().filter(|o| o.layer == l) {
                        c.add(o.logical, o.phase, [f(o)]);
                    }
                }
                let (per, pooled) = per_phase(&c, |s, n| s[0] / n as f64, reps, seed);
                out.extend(rc.phase_rows(metric, Some((l as u32, None)), phases, &per, pooled));
            }
        }
    }
    out
}

/// edge label -> phase (None: pooled) -> value, of the rows whose metric starts with
/// `prefix` (the label is what follows it).
type EdgeValues = BTreeMap<String, BTreeMap<Option<u32>, f64>>;

fn edge_values(f: &Figures, prefix: &str) -> EdgeValues {
    let m = f.model.as_str();
    let mut out: EdgeValues = BTreeMap::new();
    for r in f
        .data
        .rows
        .iter()
        .filter(|r| r.model == m && r.metric.starts_with(prefix))
    {
        out.entry(r.metric[prefix.len()..].to_string())
            .or_default()
            .insert(r.phase, r.value);
    }
    out
}

fn draw(cfg: &EdgeAttribution, f: &mut Figures) -> Result<()> {
    let d = cfg.direction;
    f.report
        .section("Edge attribution (EAP, EAP-IG) per source phase");
    f.report.paragraph(
        "Nodes: token embeddings, each query head's output, each MLP output (senders); each query head's q, \
         each KV head's raw k and v (one node per KV head, read by all its query heads), each KV head's \
         compressed entries (ck, cv) on compressing layers, each MLP's input and the logit difference \
         (receivers). An edge's value is the estimated NLD of the receiving prompts when only that edge \
         carries the partner prompt's value (metric <method>_<direction>:<sender>-><receiver>): the \
         first-order change of the logit difference along the direct path from the sender into the \
         receiver, at the receiving prompts (EAP) or averaged over interpolated input embeddings (EAP-IG).",
    );
    let methods: Vec<&str> = cfg.methods.iter().map(|m| cfg.method(*m).name()).collect();
    for name in &methods {
        let vals = edge_values(f, &format!("{name}_{}:", d.metric()));
        top_edges(f, name, &vals)?;
    }
    agreement(f, cfg, &methods)?;
    if let Some(last) = methods.last() {
        circuits(f, cfg, last)?;
    }
    lens(f)?;
    Ok(())
}

/// The faithfulness curves per phase, the circuit of every phase (the top edges of its
/// size at 80%, else the top 20) and the overlap of the phase circuits (Jaccard).
fn circuits(f: &mut Figures, cfg: &EdgeAttribution, method: &str) -> Result<()> {
    let (m, phases, dir, data) = (f.model.clone(), f.phases.clone(), f.dir, f.data);
    // size -> phase -> (value, lo, hi)
    let mut curves: BTreeMap<usize, BTreeMap<Option<u32>, Band>> = BTreeMap::new();
    for r in f.data.rows.iter().filter(|r| r.model == m) {
        if let Some(k) = r
            .metric
            .strip_prefix("faithfulness_top")
            .and_then(|k| k.parse().ok())
        {
            curves.entry(k).or_default().insert(
                r.phase,
                (
                    r.value,
                    r.ci_lo.unwrap_or(f64::NAN),
                    r.ci_hi.unwrap_or(f64::NAN),
                ),
            );
        }
    }
    if curves.is_empty() {
        return Ok(());
    }
    f.report.section("Circuits per phase: faithfulness");
    f.report.paragraph(format!(
        "Per phase group the edges are ranked by |{method}| (summed over the group's prompts); the circuit of \
         size n keeps the top n and ablates every other edge with the corrupted run's value, exactly (each \
         receiver's input recomputed from its own mixture of circuit and corrupted sender values, layer by \
         layer). Faithfulness = (LD_circuit - LD_corrupted) / (LD_clean - LD_corrupted) on the clean prompts \
         (0 = the corrupted run, 1 = the clean run; the full graph recovers 1 by construction). Circuit size \
         at 80%: the smallest measured n reaching 0.8."
    ));
    let mut cols: Vec<Option<u32>> = phases.iter().map(|&p| Some(p)).collect();
    cols.push(None);
    let series: Vec<BandSeries> = cols
        .iter()
        .map(|c| {
            let pts: Vec<(f64, (f64, f64, f64))> = curves
                .iter()
                .filter_map(|(k, v)| v.get(c).map(|x| ((*k as f64).log10(), *x)))
                .collect();
            BandSeries {
                name: c.map_or("all phases".into(), |p| format!("phase {p}")),
                x: pts.iter().map(|p| p.0).collect(),
                y: pts.iter().map(|p| p.1.0).collect(),
                lo: pts.iter().map(|p| p.1.1).collect(),
                hi: pts.iter().map(|p| p.1.2).collect(),
            }
        })
        .collect();
    let spec = LinePlotSpec {
        series,
        title: format!("{m}: faithfulness of the top-n circuit per phase"),
        x_label: "log10 edges kept (n)".into(),
        y_label: "fraction of the logit difference recovered".into(),
        y_range: None,
        size: None,
    };
    let fig = line_with_bands(dir.join("faithfulness"), &spec)?;
    f.push(
        "Faithfulness vs circuit size, per phase (95% cluster-bootstrap bands)",
        fig,
    );
    let size80 = |ph: Option<u32>| {
        data.find(&m, "circuit_size_80")
            .find(|r| r.phase == ph)
            .map_or(f64::NAN, |r| r.value)
    };
    f.report.table(
        "Circuit size at 80% faithfulness (edges; n/a: no measured size reached 0.8)".to_string(),
        vec!["phase".into(), "edges".into()],
        cols.iter()
            .map(|&c| {
                let v = size80(c);
                vec![
                    c.map_or("all".into(), |p| p.to_string()),
                    if v.is_finite() {
                        format!("{v:.0}")
                    } else {
                        "n/a".into()
                    },
                ]
            })
            .collect(),
    );
    // The circuit of every phase.
    let vals = edge_values(f, &format!("{method}_{}:", cfg.direction.metric()));
    let nl = data
        .rows
        .iter()
        .filter(|r| r.metric == LENS_PROB)
        .filter_map(|r| r.layer)
        .max()
        .map(|l| l as usize)
        .or_else(|| {
            vals.keys()
                .flat_map(|e| e.split("->"))
                .filter_map(|n| figure::component(n, 0).map(|c| c.column))
                .max()
                .map(|c| c / 2)
        })
        .unwrap_or(0);
    let mut nodes: Vec<figure::Component> = vals
        .keys()
        .flat_map(|e| e.split("->"))
        .filter_map(|n| figure::component(n, nl))
        .collect();
    nodes.sort();
    nodes.dedup();
    let mut sets: Vec<(u32, std::collections::BTreeSet<String>)> = Vec::new();
    for &ph in &phases {
        let k = size80(Some(ph));
        let k = if k.is_finite() { k as usize } else { 20 };
        let mut ranked: Vec<(f64, &String)> = vals
            .iter()
            .filter_map(|(e, v)| v.get(&Some(ph)).map(|x| (*x, e)))
            .filter(|(x, _)| x.is_finite())
            .collect();
        ranked.sort_by(|a, b| b.0.abs().total_cmp(&a.0.abs()).then(a.1.cmp(b.1)));
        ranked.truncate(k);
        sets.push((ph, ranked.iter().map(|(_, e)| e.to_string()).collect()));
        let mut agg: BTreeMap<(usize, usize), f64> = BTreeMap::new();
        for (v, e) in &ranked {
            let mut it = e.split("->");
            let (Some(a), Some(b)) = (it.next(), it.next()) else {
                continue;
            };
            let (Some(ca), Some(cb)) = (figure::component(a, nl), figure::component(b, nl)) else {
                continue;
            };
            let ia = nodes.iter().position(|n| *n == ca);
            let ib = nodes.iter().position(|n| *n == cb);
            if let (Some(ia), Some(ib)) = (ia, ib) {
                *agg.entry((ia, ib)).or_default() += v;
            }
        }
        let spec = figure::CircuitSpec {
            title: format!(
                "{m}: circuit of phase {ph} ({} edges, {method}; red +, blue -)",
                ranked.len()
            ),
            nodes: nodes.clone(),
            edges: agg.into_iter().map(|((a, b), v)| (a, b, v)).collect(),
        };
        let fig = crate::output::render(dir.join(format!("circuit_phase{ph}")), &spec)?;
        f.push(
            &format!("Circuit of phase {ph}: its top edges, width = |estimated NLD| summed per component pair"),
            fig,
        );
    }
    if sets.len() > 1 {
        let matrix: Vec<Vec<f64>> = sets
            .iter()
            .map(|(_, a)| {
                sets.iter()
                    .map(|(_, b)| {
                        let u = a.union(b).count();
                        if u == 0 {
                            f64::NAN
                        } else {
                            a.intersection(b).count() as f64 / u as f64
                        }
                    })
                    .collect()
            })
            .collect();
        let labels: Vec<String> = sets.iter().map(|(p, _)| p.to_string()).collect();
        let spec = HeatmapSpec {
            matrix,
            row_labels: labels.clone(),
            col_labels: labels,
            title: format!("{m}: overlap of the phase circuits (Jaccard of their edge sets)"),
            x_label: "phase".into(),
            y_label: "phase".into(),
            colorbar_label: "Jaccard index".into(),
            diverging: false,
            range: Some((0.0, 1.0)),
            annotate: true,
            size: None,
        };
        let fig = heatmap(dir.join("circuit_overlap"), &spec)?;
        f.push("Overlap of the phase circuits", fig);
    }
    Ok(())
}

/// A heatmap of the 24 edges with the largest pooled |value| x phase, and a table.
fn top_edges(f: &mut Figures, name: &str, vals: &EdgeValues) -> Result<()> {
    let (m, phases, dir) = (f.model.clone(), f.phases.clone(), f.dir);
    let mut ranked: Vec<(f64, &String)> = vals
        .iter()
        .map(|(k, v)| (v.get(&None).copied().unwrap_or(f64::NAN), k))
        .filter(|(x, _)| x.is_finite())
        .collect();
    ranked.sort_by(|a, b| b.0.abs().total_cmp(&a.0.abs()).then(a.1.cmp(b.1)));
    let top: Vec<&String> = ranked.iter().take(24).map(|x| x.1).collect();
    if top.is_empty() {
        f.report
            .paragraph(format!("{name}: no edge has a finite estimate."));
        return Ok(());
    }
    let mut cols: Vec<Option<u32>> = phases.iter().map(|&p| Some(p)).collect();
    cols.push(None);
    let matrix: Vec<Vec<f64>> = top
        .iter()
        .map(|e| {
            cols.iter()
                .map(|c| vals[*e].get(c).copied().unwrap_or(f64::NAN))
                .collect()
        })
        .collect();
    let spec = HeatmapSpec {
        range: sym_range(matrix.iter().flatten().copied()),
        matrix,
        row_labels: top.iter().map(|s| s.to_string()).collect(),
        col_labels: cols
            .iter()
            .map(|c| c.map_or("all".to_string(), |p| p.to_string()))
            .collect(),
        title: format!("{m}: strongest edges ({name}) per source phase"),
        x_label: "source phase".into(),
        y_label: "edge".into(),
        colorbar_label: "estimated NLD".into(),
        diverging: true,
        annotate: true,
        size: None,
    };
    let fig = heatmap(dir.join(format!("edges_{name}")), &spec)?;
    f.push(
        &format!("{name}: the 24 edges with the largest pooled |estimated NLD|, per source phase"),
        fig,
    );
    f.report.table(
        format!("Strongest edges ({name}; estimated NLD pooled and per phase {phases:?})"),
        vec!["edge".into(), "all".into(), "per phase".into()],
        top.iter()
            .take(12)
            .map(|e| {
                let v = &vals[*e];
                vec![
                    e.to_string(),
                    format!("{:.3}", v.get(&None).copied().unwrap_or(f64::NAN)),
                    phases
                        .iter()
                        .map(|p| v.get(&Some(*p)).map_or("n/a".into(), |x| format!("{x:.2}")))
                        .collect::<Vec<_>>()
                        .join(" "),
                ]
            })
            .collect(),
    );
    Ok(())
}

/// Estimated vs exact path-patching NLD (pooled) per method, and the agreement per phase.
fn agreement(f: &mut Figures, cfg: &EdgeAttribution, methods: &[&str]) -> Result<()> {
    let d = cfg.direction;
    let exact = edge_values(f, &format!("exact_{}:", d.metric()));
    if exact.is_empty() {
        return Ok(());
    }
    f.report.section("Agreement with exact path patching");
    f.report.paragraph(format!(
        "{} edges (query head -> later q / k / v) were path-patched exactly (the path-patching routine: \
         the sender patched at every position with every other head output and MLP output frozen, then only \
         the receiver's input replaced). On kvc models path patching's k / v replacement also reaches the \
         compressed entries pooled from them, so its k / v edge is compared with the raw edge plus the entry \
         edge. Per phase: Spearman rank correlation, recall of the exact top-{} among the estimated top-{}, \
         mean absolute error.",
        exact.len(),
        cfg.top_k,
        cfg.top_k
    ));
    let (m, dir, data) = (f.model.clone(), f.dir, f.data);
    let mut series = Vec::new();
    for name in methods {
        let est = edge_values(f, &format!("{name}_path_{}:", d.metric()));
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for (e, v) in &exact {
            if let (Some(a), Some(b)) = (est.get(e).and_then(|v| v.get(&None)), v.get(&None)) {
                x.push(*a);
                y.push(*b);
            }
        }
        series.push(ScatterSeries {
            name: name.to_string(),
            predicted: x,
            observed: y,
        });
    }
    let spec = ScatterSpec {
        series,
        title: format!("{m}: estimated vs exact path-patching NLD (pooled over phases)"),
        x_label: "estimated NLD".into(),
        y_label: "exact path-patching NLD".into(),
        r2_text: None,
        size: None,
    };
    let fig = scatter_predicted_vs_observed(dir.join("edges_vs_exact"), &spec)?;
    f.push("Estimated vs exact NLD of the path-patched edges", fig);
    let phases = f.phases.clone();
    let mut rows = Vec::new();
    for name in methods {
        for stat in [
            "spearman".to_string(),
            format!("recall_top{}", cfg.top_k),
            "mae".into(),
        ] {
            let metric = agreement_metric(&stat, name, d);
            let get = |ph: Option<u32>| {
                data.find(&m, &metric)
                    .find(|r| r.phase == ph && r.layer.is_none())
                    .map_or("n/a".to_string(), |r| format!("{:.2}", r.value))
            };
            let mut row = vec![name.to_string(), stat.clone(), get(None)];
            row.push(
                phases
                    .iter()
                    .map(|p| get(Some(*p)))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
            rows.push(row);
        }
    }
    f.report.table(
        format!("Agreement with exact path patching (all phases, then per phase {phases:?})"),
        vec![
            "method".into(),
            "statistic".into(),
            "all".into(),
            "per phase".into(),
        ],
        rows,
    );
    Ok(())
}

/// The logit lens: answer probability per layer x phase.
fn lens(f: &mut Figures) -> Result<()> {
    let (m, phases, dir, data) = (f.model.clone(), f.phases.clone(), f.dir, f.data);
    let rows: Vec<&LongRow> = data.find(&m, LENS_PROB).collect();
    if rows.is_empty() {
        return Ok(());
    }
    let layers: std::collections::BTreeSet<u32> = rows.iter().filter_map(|r| r.layer).collect();
    let mut cols: Vec<Option<u32>> = phases.iter().map(|&p| Some(p)).collect();
    cols.push(None);
    let get = |metric: &str, l: u32, c: Option<u32>| {
        data.find(&m, metric)
            .find(|r| r.layer == Some(l) && r.phase == c)
            .map_or(f64::NAN, |r| r.value)
    };
    let matrix: Vec<Vec<f64>> = layers
        .iter()
        .map(|&l| cols.iter().map(|&c| get(LENS_PROB, l, c)).collect())
        .collect();
    let nl = layers.iter().max().copied().unwrap_or(0);
    let labels: Vec<String> = layers
        .iter()
        .map(|&l| {
            if l == nl {
                "out".to_string()
            } else {
                format!("L{l} in")
            }
        })
        .collect();
    let spec = HeatmapSpec {
        matrix,
        row_labels: labels.clone(),
        col_labels: cols
            .iter()
            .map(|c| c.map_or("all".to_string(), |p| p.to_string()))
            .collect(),
        title: format!("{m}: logit lens, answer probability per layer and phase"),
        x_label: "source phase".into(),
        y_label: "residual stream".into(),
        colorbar_label: "mean answer probability".into(),
        diverging: false,
        range: Some((0.0, 1.0)),
        annotate: true,
        size: None,
    };
    let fig = heatmap(dir.join("logit_lens"), &spec)?;
    f.report.section("Logit lens by phase");
    f.report.paragraph(
        "Each block's input residual stream (and the last block's output, `out`) at the clean prompts' read \
         position, through the model's final norm and unembedding: the answer's mean probability (figure) \
         and mean rank (table, 0 = top-1) per layer and source phase: the layer at which retrieval happens, \
         per phase.",
    );
    f.push(
        "Logit lens: mean answer probability per layer x source phase",
        fig,
    );
    f.report.table(
        format!(
            "Logit lens: mean answer rank (0 = top) per layer, all phases then per phase {phases:?}"
        ),
        vec!["residual".into(), "all".into(), "per phase".into()],
        layers
            .iter()
            .zip(&labels)
            .map(|(&l, lab)| {
                vec![
                    lab.clone(),
                    format!("{:.1}", get(LENS_RANK, l, None)),
                    phases
                        .iter()
                        .map(|&p| format!("{:.1}", get(LENS_RANK, l, Some(p))))
                        .collect::<Vec<_>>()
                        .join(" "),
                ]
            })
            .collect(),
    );
    Ok(())
}
