//! `retrieval-heads`: how often each head's top attention lands on the needle while
//! the answer is copied, per source phase (the retrieval score of the retrieval-head
//! literature, Wu et al. 2024, on the KV-retrieval prompts).
//!
//! One forward per chunk of clean prompts captures `hook_pattern` of the selected
//! layers. At every target position (where answer token j is predicted, teacher
//! forced) the needle is the value token being copied (`value_pos + j` of the queried
//! binding). A head *hits* when its most-attended key slot (lower index wins among
//! ties; the sink counts as a slot) is that token's raw slot or a compressed entry
//! whose window holds it ([`crate::analysis::SlotLayout`]). Per prompt: the fraction
//! of its target positions hit, and the mean attention mass on the needle's slots.
//! `retrieval_score` averages the hits over the scored prompts of a phase group (by
//! default only the prompts the model answers correctly: those where it copies),
//! `needle_attention` the mass; cluster-bootstrap intervals over logical examples.
//!
//! Resume: per chunk, the per-prompt values are a shard of the run's store
//! (`PromptShards` of runner/exec.rs: one list of outcomes per quantity, `ld` holding
//! the value).

use serde::{Deserialize, Serialize};

use crate::analysis::{Clusters, EntryAlign, SlotLayout, accuracy_clusters, per_phase, top_hit};
use crate::error::{Error, Result};
use crate::hooks::{HookPoint, HookSpec, Site};
use crate::model::{LayerKind, ModelInfo};
use crate::output::{HeadKind, Headline, LongRow};

use super::super::experiment::Selection;
use super::super::patching::{Outcome, Prompts, Target, readout};
use super::super::report::{
    ColourScale, Figures, HeadGrid, cell_map, head_axes, head_phase_map, layer_head_heatmap, push,
    ranked_table, ranking,
};
use super::super::rows::{RowCtx, baseline_rows, specialization_rows};
use super::super::setup;
use super::{Ctx, Kind, KindOutput};
use crate::tasks::prompts::{PromptMeta, clean_prompts};

/// Metric: fraction of target positions whose top slot is the needle.
pub const RETRIEVAL_SCORE: &str = "retrieval_score";
/// Metric: mean attention probability on the needle's slots.
pub const NEEDLE_ATTENTION: &str = "needle_attention";
/// Metric: the clean prompts a phase's scores are computed over.
pub const SCORED_PROMPTS: &str = "scored_prompts";

/// `[retrieval]` (retrieval-heads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetrievalHeads {
    /// Layers whose heads are scored. Default all.
    pub layers: Selection,
    /// Score only prompts the model answers correctly (it copies the answer). Default true.
    pub only_correct: bool,
}

impl Default for RetrievalHeads {
    fn default() -> Self {
        RetrievalHeads {
            layers: Selection::All,
            only_correct: true,
        }
    }
}

impl Kind for RetrievalHeads {
    fn name(&self) -> &'static str {
        "retrieval-heads"
    }

    fn section(&self) -> &'static str {
        "retrieval"
    }

    fn default_n_logical(&self) -> usize {
        64
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(f)
    }
}

/// The key layout of layer `l`'s `hook_pattern` over `t` tokens, given its slot count.
pub fn layer_layout(info: &ModelInfo, l: usize, t: usize, slots: usize) -> Result<SlotLayout> {
    let align = info.entry_align();
    let (entries, window, stride) = match info.layers[l].kind {
        LayerKind::Compressed { window, stride, .. } => {
            let n = match align {
                EntryAlign::Start if t >= window => (t - window) / stride + 1,
                EntryAlign::Start => 0,
                EntryAlign::End => t / stride,
            };
            (n, window, stride)
        }
        _ => (0, 1, 1),
    };
    SlotLayout::infer(slots, t, entries, window, stride, align).ok_or_else(|| {
        Error::Other(format!(
            "blocks.{l}.attn.hook_pattern has {slots} key slots for {t} tokens; expected {entries} entries + {t} raw tokens (+ sink)"
        ))
    })
}

/// Prompts per forward when `layers` capture a `[rows, heads, T, slots]` pattern each:
/// about 2^25 pattern values per forward, at most `max_rows`.
pub(super) fn pattern_chunk(
    info: &ModelInfo,
    layers: &[usize],
    t: usize,
    max_rows: usize,
) -> usize {
    let per_row: usize = layers
        .iter()
        .map(|&l| info.layers[l].n_heads * t * (2 * t + 2))
        .sum::<usize>()
        .max(1);
    ((1usize << 25) / per_row).clamp(1, max_rows.max(1))
}

/// The needle token of each target position of every prompt: the queried binding's
/// value tokens.
fn needles(ex: &[&crate::tasks::KvExample], key_len: usize, assign: usize) -> Vec<Vec<usize>> {
    ex.iter()
        .map(|e| {
            let b = &e.bindings[e.scored_query().binding];
            let v0 = b.key_pos + key_len + assign;
            (0..e.target_positions.len()).map(|j| v0 + j).collect()
        })
        .collect()
}

/// Query positions `[lo, hi)` covering every target position of `targets`.
pub(super) fn target_range<'t>(targets: impl Iterator<Item = &'t Target>) -> (usize, usize) {
    let mut lo = usize::MAX;
    let mut hi = 0;
    for t in targets {
        for &p in &t.positions {
            lo = lo.min(p);
            hi = hi.max(p + 1);
        }
    }
    (lo.min(hi), hi)
}

/// One forward over `rows`: outcome of the prompt (quantity 0), then per (layer, head)
/// the hit fraction and the needle mass.
fn chunk_outcomes(
    ctx: &Ctx,
    prompts: &Prompts,
    rows: &[usize],
    layers: &[usize],
    needles: &[Vec<usize>],
) -> Result<Vec<Vec<Outcome>>> {
    let mut spec = HookSpec::new();
    for &l in layers {
        spec = spec.capture_point(HookPoint::block(l, Site::AttnPattern));
    }
    let out = ctx
        .model
        .forward(prompts.tokens_of(rows, &ctx.device), &spec)?;
    let targets: Vec<&Target> = rows.iter().map(|&r| &prompts.targets[r]).collect();
    let (q0, q1) = target_range(targets.iter().copied());
    let mut res = vec![readout(out.logits, &targets)?];
    let t = prompts.len;
    for &l in layers {
        let point = HookPoint::block(l, Site::AttnPattern);
        let act = out.cache.get(&point).ok_or_else(|| {
            Error::hook(
                point.to_string(),
                "not produced by the model (was it captured?)",
            )
        })?;
        let [b, h, _, k] = <[usize; 4]>::try_from(act.shape().to_vec()).map_err(|_| {
            Error::hook(
                point.to_string(),
                format!("expected rank 4, got {:?}", act.shape()),
            )
        })?;
        let layout = layer_layout(&ctx.info, l, t, k)?;
        let q = q1 - q0;
        let vals = act
            .get::<4>()?
            .slice([0..b, 0..h, q0..q1, 0..k])
            .into_data();
        let vals = vals
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| Error::Other(format!("{point}: reading the pattern: {e:?}")))?;
        for head in 0..h {
            let mut hits = Vec::with_capacity(b);
            let mut mass = Vec::with_capacity(b);
            for (i, tg) in targets.iter().enumerate() {
                let (mut hsum, mut msum) = (0.0f64, 0.0f64);
                for (j, &p) in tg.positions.iter().enumerate() {
                    let at = ((i * h + head) * q + (p - q0)) * k;
                    let slots = layout.needle_slots(needles[rows[i]][j]);
                    let (hit, m) = top_hit(&vals[at..at + k], &slots);
                    hsum += f64::from(u8::from(hit));
                    msum += m;
                }
                let n = tg.positions.len() as f64;
                hits.push(Outcome {
                    correct: hsum > 0.0,
                    ld: (hsum / n) as f32,
                });
                mass.push(Outcome {
                    correct: msum > 0.0,
                    ld: (msum / n) as f32,
                });
            }
            res.push(hits);
            res.push(mass);
        }
    }
    Ok(res)
}

/// The swept prompts of every phase group with what the kind needs to turn them into
/// rows.
struct Scored<'a> {
    cfg: &'a RetrievalHeads,
    rc: &'a RowCtx,
    per_group: &'a [(Vec<PromptMeta>, Vec<Vec<Outcome>>)],
    phases: &'a [u32],
    p: usize,
}

impl Scored<'_> {
    /// The fraction of prompts scored per phase (all, or the correctly answered ones).
    fn prompt_rows(&self, seed: u64) -> Vec<LongRow> {
        let mut scored = Clusters::<1>::new(self.p);
        for (meta, res) in self.per_group {
            for (m, o) in meta.iter().zip(&res[0]) {
                scored.add(
                    m.logical,
                    m.phase,
                    [f64::from(u8::from(o.correct || !self.cfg.only_correct))],
                );
            }
        }
        let (per, pooled) = per_phase(&scored, |s, _| s[0], 0, seed);
        self.rc
            .phase_rows(SCORED_PROMPTS, None, self.phases, &per, pooled)
    }

    /// Retrieval score and needle attention of query head `h` of layer `l` (head index
    /// `hi` among the scored heads) per phase, plus its specialization rows.
    fn head_rows(&self, hi: usize, l: usize, h: usize, reps: usize, seed: u64) -> Vec<LongRow> {
        let (rc, phases) = (self.rc, self.phases);
        let at = Some((l as u32, Some((h as u32, HeadKind::Query))));
        let mut rows = Vec::new();
        for (qi, metric) in [(1, RETRIEVAL_SCORE), (2, NEEDLE_ATTENTION)] {
            let mut c = Clusters::<1>::new(self.p);
            for (meta, res) in self.per_group {
                for (i, m) in meta.iter().enumerate() {
                    if self.cfg.only_correct && !res[0][i].correct {
                        continue;
                    }
                    c.add(m.logical, m.phase, [f64::from(res[2 * hi + qi][i].ld)]);
                }
            }
            let (per, pooled) = per_phase(&c, |s, n| s[0] / n as f64, reps, seed);
            rows.extend(rc.phase_rows(metric, at, phases, &per, pooled));
            if metric == RETRIEVAL_SCORE {
                let effect: Vec<f64> = phases.iter().map(|&r| per[r as usize].value).collect();
                rows.extend(specialization_rows(
                    rc,
                    l as u32,
                    h as u32,
                    HeadKind::Query,
                    phases,
                    &effect,
                ));
            }
        }
        rows
    }
}

fn run(cfg: &RetrievalHeads, ctx: &mut Ctx) -> Result<KindOutput> {
    let layers = setup::layers(ctx.exp, "retrieval", &cfg.layers, &ctx.info, false)?;
    let set = ctx.eval_set()?;
    let p = ctx.p();
    let heads: Vec<(usize, usize)> = layers
        .iter()
        .flat_map(|&l| (0..ctx.info.layers[l].n_heads).map(move |h| (l, h)))
        .collect();
    let assign = if ctx.task.prompt.assign {
        ctx.task.space.assign().len()
    } else {
        0
    };
    let key_len = ctx.task.prompt.key_len;
    let phases = ctx.task.phases.clone();
    let total: u64 = phases
        .iter()
        .map(|&r| ctx.examples(&set, r).len() as u64)
        .sum();
    let mut shards = ctx.prompt_shards(&format!("{} retrieval-heads", ctx.mref.name), total);
    let mut per_group: Vec<(Vec<PromptMeta>, Vec<Vec<Outcome>>)> = Vec::new();
    for &r in &phases {
        let ex = ctx.examples(&set, r);
        let (prompts, meta) = clean_prompts(&ex, |_| 0);
        let need = needles(&ex, key_len, assign);
        let chunk = pattern_chunk(&ctx.info, &layers, prompts.len, ctx.max_rows);
        let q = 1 + 2 * heads.len();
        let res = shards.run(&format!("p{r}-retrieval"), prompts.n(), q, chunk, |rows| {
            chunk_outcomes(ctx, &prompts, rows, &layers, &need)
        })?;
        per_group.push((meta, res));
    }
    ctx.finish_shards(shards);
    let (reps, seed) = (ctx.reps(), ctx.seed());
    let rc = ctx.rows.clone();
    let acc = per_group.iter().flat_map(|(meta, res)| {
        meta.iter()
            .zip(&res[0])
            .map(|(m, o)| (m.logical, m.phase, o.correct))
    });
    let mut rows: Vec<LongRow> =
        baseline_rows(&rc, "", &accuracy_clusters(p, acc), &phases, reps, seed);
    let scored = Scored {
        cfg,
        rc: &rc,
        per_group: &per_group,
        phases: &phases,
        p,
    };
    rows.extend(scored.prompt_rows(seed));
    for (hi, &(l, h)) in heads.iter().enumerate() {
        rows.extend(scored.head_rows(hi, l, h, reps, seed));
    }
    Ok(KindOutput {
        tables: vec![("retrieval".into(), rows)],
    })
}

/// This kind's figures and report section, from its tables alone.
fn draw(f: &mut Figures) -> Result<()> {
    let (d, m, phases, dir) = (f.data, f.model.as_str(), &f.phases[..], f.dir);
    let (report, files) = (&mut f.report, &mut f.files);
    report.section("Retrieval heads");
    report.paragraph(
        "Retrieval score of a head: the fraction of answer positions (teacher forced) at which its \
         most-attended key slot is the value token being copied, or a compressed entry whose window \
         holds it; over the prompts the model answers correctly (unless only_correct = false). \
         Needle attention: the mean attention probability on those slots. Per source phase, with \
         95% cluster-bootstrap intervals over logical examples.",
    );
    let cells = cell_map(d, m, RETRIEVAL_SCORE, HeadKind::Query);
    if let Some((best, v)) = cells
        .iter()
        .filter(|((_, _, p), v)| p.is_none() && v.is_finite())
        .max_by(|a, b| a.1.total_cmp(b.1))
    {
        report.headline(
            Headline::new(
                "Top retrieval head (all phases)",
                format!("L{}.H{}", best.0, best.1),
            )
            .with_detail(format!("retrieval score {v:.3}")),
        );
    }
    if let Some(r) = d.scalar(m, SCORED_PROMPTS) {
        report.headline(Headline::new(
            "Scored prompts",
            format!("{}", r.value as u64),
        ));
    }
    for (metric, label) in [
        (RETRIEVAL_SCORE, "retrieval score"),
        (NEEDLE_ATTENTION, "attention on the needle"),
    ] {
        if let Some(fig) = head_phase_map(
            &dir.join(format!("{metric}_map")),
            d,
            m,
            metric,
            phases,
            format!("{m}: {label} per head x source phase"),
            label,
        )? {
            push(files, report, &format!("{label}: head x source phase"), fig);
        }
        let (layers, heads) = head_axes(d, m, metric, HeadKind::Query);
        if !layers.is_empty() {
            let cells = cell_map(d, m, metric, HeadKind::Query);
            let fig = layer_head_heatmap(
                &dir.join(format!("{metric}_all_phases")),
                &HeadGrid {
                    cells: &cells,
                    layers: &layers,
                    heads: &heads,
                    head_label: "H",
                },
                None,
                format!("{m}: {label}, all phases"),
                &ColourScale {
                    label,
                    range: Some((0.0, 1.0)),
                    diverging: false,
                },
            )?;
            push(
                files,
                report,
                &format!("{label} per layer x head, all phases"),
                fig,
            );
        }
    }
    let ranked = ranking(d, m, RETRIEVAL_SCORE, phases, |v| v);
    ranked_table(report, "Most phase-specialized retrieval heads", &ranked);
    Ok(())
}
