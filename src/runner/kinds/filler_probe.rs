//! `filler-probe`: the paper's code-completion flip probe. Only the length `L` of a
//! filler span changes; the answer read after it is scored as
//! `P(correct) - P(distractor)` (first tokens, full-vocabulary softmax at the last
//! prompt position), per `L` and grouped by `L mod P`, with cluster-bootstrap
//! intervals (clusters: the probe's instances, or for the text probe, which has one
//! instance, the lengths of a group).
//!
//! Prompts come from [`crate::tasks::binding_filler_probe`] (`probe = "binding"`: a
//! binding `k -> v`, a distractor `k' -> v'` and the other bindings of the model's
//! prompt format, the filler, the query `k`; any token space) or
//! [`crate::tasks::text_filler_probe`] (`probe = "text"`: a text template tokenized by
//! the `[task] vocab` Hugging Face tokenizer; the default is a code-completion analogue
//! of the paper's `===` docstring line, right answer `" 8"`, wrong `" 32"`).
//!
//! Resume: one shard per length (and chunk of instances) in the run's store.

use serde::{Deserialize, Serialize};

use crate::analysis::{Clusters, Est, accuracy_clusters, per_phase};
use crate::error::{Error, Result};
use crate::hooks::HookSpec;
use crate::output::{BandSeries, Headline, LinePlotSpec, LongRow, line_with_bands};
use crate::tasks::{
    BindingProbeConfig, FillerPosition, FillerProbeItem, FillerStyle, LengthRange, QueryMarker,
    TextProbeConfig, binding_filler_probe, text_filler_probe,
};

use super::super::experiment::Experiment;
use super::super::patching::Outcome;
use super::super::report::{Figures, ci_text};
use super::super::rows::{RowCtx, baseline_rows};
use super::{Ctx, Kind, KindOutput};

/// Metric: `P(correct) - P(distractor)` per `L mod P` group (and pooled).
pub const PROB_DIFF: &str = "prob_diff";
/// Metric prefix: `prob_diff_L{L}` per filler length (phase = `L mod P`).
pub const PROB_DIFF_AT: &str = "prob_diff_L";
/// Metric: fraction of prompts where the distractor is more probable.
pub const DISTRACTOR_PREFERRED: &str = "distractor_preferred";
/// Metrics: `prob_diff` and top-1 accuracy grouped by the phase of the correct key
/// (binding probe).
pub const PROB_DIFF_KEY_PHASE: &str = "prob_diff_key_phase";
pub const ACCURACY_KEY_PHASE: &str = "accuracy_key_phase";
/// Metrics: the two probabilities.
pub const PROB_CORRECT: &str = "prob_correct";
pub const PROB_DISTRACTOR: &str = "prob_distractor";

/// Which prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeKind {
    /// The synthetic binding probe on the task's token space (default).
    #[default]
    Binding,
    /// The text probe (a Hugging Face tokenizer in `[task] vocab`).
    Text,
}

/// What fills the binding probe's span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FillerToken {
    /// The token space's filler atoms (`filler_style`). Default.
    #[default]
    Filler,
    /// The pad token (what the organisms saw in training as prefix / inner padding).
    Pad,
}

/// `[filler]` (filler-probe). Instances of the binding probe: `[task] n_logical`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FillerProbe {
    pub probe: ProbeKind,
    /// Filler lengths L (binding probe). Default 24..=39 (the paper's).
    pub lengths: LengthRange,
    /// Bindings besides the correct and the distractor one. Default: the model's prompt
    /// format's `n_bindings - 2`.
    pub n_other_bindings: Option<usize>,
    /// Default `before_context` (every binding moves with L).
    pub filler_position: FillerPosition,
    /// Default `repeat`.
    pub filler_style: FillerStyle,
    /// Default `filler`.
    pub filler_token: FillerToken,
    /// Seed of the binding probe's contexts. Default 0.
    pub seed: u64,
    /// The text probe (`probe = "text"`): template, filler unit, lengths, answers.
    pub text: TextProbeConfig,
}

impl Default for FillerProbe {
    fn default() -> Self {
        FillerProbe {
            probe: ProbeKind::Binding,
            lengths: LengthRange::default(),
            n_other_bindings: None,
            filler_position: FillerPosition::BeforeContext,
            filler_style: FillerStyle::Repeat,
            filler_token: FillerToken::Filler,
            seed: 0,
            text: TextProbeConfig::default(),
        }
    }
}

impl Kind for FillerProbe {
    fn name(&self) -> &'static str {
        "filler-probe"
    }

    fn section(&self) -> &'static str {
        "filler"
    }

    fn default_n_logical(&self) -> usize {
        128
    }

    /// Its instances are rendered at every filler length by the probe itself, not
    /// through the task's matched phase groups, so any `n_logical` is exact.
    fn matched_groups(&self) -> bool {
        false
    }

    fn check(&self, exp: &Experiment) -> Result<()> {
        let l = match self.probe {
            ProbeKind::Binding => self.lengths,
            ProbeKind::Text => self.text.lengths,
        };
        if l.min > l.max {
            let key = match self.probe {
                ProbeKind::Binding => "lengths",
                ProbeKind::Text => "text",
            };
            return Err(exp.err(
                "filler",
                key,
                format!("min = {} is larger than max = {}", l.min, l.max),
            ));
        }
        Ok(())
    }

    fn run(&self, ctx: &mut Ctx) -> Result<KindOutput> {
        run(self, ctx)
    }

    fn figures(&self, f: &mut Figures) -> Result<()> {
        draw(f)
    }
}

/// The probe's prompts, by length (each length's prompts share one token count).
fn items(cfg: &FillerProbe, ctx: &Ctx) -> Result<Vec<FillerProbeItem>> {
    let space = &ctx.task.space;
    let err = |key: &str, e: &dyn std::fmt::Display| ctx.exp.err("filler", key, e);
    match cfg.probe {
        ProbeKind::Binding => {
            let fmt = &ctx.task.prompt;
            let b = BindingProbeConfig {
                lengths: cfg.lengths,
                n_instances: ctx.task.n_logical,
                n_other_bindings: cfg
                    .n_other_bindings
                    .unwrap_or(fmt.n_bindings.saturating_sub(2)),
                filler_position: cfg.filler_position,
                filler_style: cfg.filler_style,
                key_len: fmt.key_len,
                value_len: fmt.value_len,
                assign: fmt.assign,
                binding_sep: fmt.binding_sep,
                query_marker: fmt.query_marker != QueryMarker::None,
                bos: fmt.bos,
                seed: cfg.seed,
                max_len: None,
            };
            let mut v = binding_filler_probe(space, &b).map_err(|e| err("lengths", &e))?;
            if cfg.filler_token == FillerToken::Pad {
                for it in &mut v {
                    let (a, z) = it.filler_span;
                    it.tokens[a..z].fill(space.pad());
                }
            }
            Ok(v)
        }
        ProbeKind::Text => {
            let tok = space.tokenizer().ok_or_else(|| {
                err(
                    "probe",
                    &"\"text\" needs a Hugging Face tokenizer: [task] vocab = { kind = \"hugging_face\", tokenizer = \"<model>/tokenizer.json\", pad = \"<pad>\" }",
                )
            })?;
            text_filler_probe(tok, &cfg.text).map_err(|e| err("text", &e))
        }
    }
}

/// One forward over `rows` of one length's prompts: per prompt (top-1 = correct,
/// P(c) - P(d)), (P(d) > P(c), P(c)), (_, P(d)).
fn chunk_outcomes(
    ctx: &Ctx,
    items: &[&FillerProbeItem],
    rows: &[usize],
) -> Result<Vec<Vec<Outcome>>> {
    let len = items[rows[0]].tokens.len();
    let mut ids = Vec::with_capacity(rows.len() * len);
    for &r in rows {
        ids.extend(items[r].tokens.iter().map(|&t| i64::from(t)));
    }
    let tokens = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(ids, [rows.len(), len]),
        &ctx.device,
    );
    let logits = ctx.model.forward(tokens, &HookSpec::new())?.logits;
    let [b, _, v] = logits.dims();
    let last = logits.slice([0..b, len - 1..len, 0..v]).reshape([b, v]);
    let top = last.clone().argmax(1).try_into_vec_as::<i64>()?;
    let probs = burn::tensor::activation::softmax(last, 1)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| Error::Other(format!("filler probe: reading probabilities: {e:?}")))?;
    let mut out: Vec<Vec<Outcome>> = (0..3).map(|_| Vec::with_capacity(b)).collect();
    for (i, &r) in rows.iter().enumerate() {
        let it = items[r];
        let (c, d) = (it.correct[0] as usize, it.distractor[0] as usize);
        if c >= v || d >= v {
            return Err(Error::Input(format!(
                "filler probe: answer tokens {c} / {d} are outside the model's vocabulary 0..{v}"
            )));
        }
        let (pc, pd) = (probs[i * v + c], probs[i * v + d]);
        out[0].push(Outcome {
            correct: top[i] == c as i64,
            ld: pc - pd,
        });
        out[1].push(Outcome {
            correct: pd > pc,
            ld: pc,
        });
        out[2].push(Outcome {
            correct: false,
            ld: pd,
        });
    }
    Ok(out)
}

/// One prompt's outcomes: (filler length, instance, outcomes per quantity).
type ProbeObs = (usize, usize, [Outcome; 3]);

/// Evaluate every length's prompts (one shard per length and chunk): the outcomes
/// per prompt, and the correct key's position of each.
fn evaluate(
    ctx: &mut Ctx,
    all: &[FillerProbeItem],
    lengths: &[usize],
) -> Result<(Vec<ProbeObs>, Vec<Option<usize>>)> {
    let mut shards =
        ctx.prompt_shards(&format!("{} filler-probe", ctx.mref.name), all.len() as u64);
    let mut obs: Vec<ProbeObs> = Vec::new();
    let mut key_pos: Vec<Option<usize>> = Vec::new();
    for &l in lengths {
        let group: Vec<&FillerProbeItem> = all.iter().filter(|i| i.filler_len == l).collect();
        if group
            .iter()
            .any(|i| i.tokens.len() != group[0].tokens.len())
        {
            return Err(Error::Other(format!(
                "filler probe: the prompts of L = {l} differ in length"
            )));
        }
        let res = shards.run(&format!("L{l}"), group.len(), 3, ctx.max_rows, |rows| {
            chunk_outcomes(ctx, &group, rows)
        })?;
        for (i, it) in group.iter().enumerate() {
            obs.push((l, it.instance, [res[0][i], res[1][i], res[2][i]]));
            key_pos.push(it.correct_key_pos);
        }
    }
    ctx.finish_shards(shards);
    Ok((obs, key_pos))
}

/// The outcomes of a run and how they become rows.
struct Summary<'a> {
    rc: &'a RowCtx,
    obs: &'a [ProbeObs],
    /// The text probe: clusters are lengths (its one instance), and per-length rows
    /// carry no interval.
    text: bool,
    p: usize,
    reps: usize,
    seed: u64,
}

impl Summary<'_> {
    /// The cluster of a prompt: its instance (binding probe) or its length (text probe).
    fn cluster(&self, l: usize, inst: usize) -> u64 {
        if self.text { l as u64 } else { inst as u64 }
    }

    /// The phase of a length: `L mod P`.
    fn phase(&self, l: usize) -> u32 {
        (l % self.p) as u32
    }

    /// Accuracy and the four quantities grouped by `L mod P` (and pooled).
    fn residue_rows(&self, phases: &[u32]) -> Vec<LongRow> {
        let (p, reps, seed) = (self.p, self.reps, self.seed);
        let acc = accuracy_clusters(
            p,
            self.obs
                .iter()
                .map(|(l, i, o)| (self.cluster(*l, *i), self.phase(*l), o[0].correct)),
        );
        let mut rows: Vec<LongRow> = baseline_rows(self.rc, "", &acc, phases, reps, seed);
        type Quantity = fn(&[Outcome; 3]) -> f64;
        let quantities: [(&str, Quantity); 4] = [
            (PROB_DIFF, |o| f64::from(o[0].ld)),
            (PROB_CORRECT, |o| f64::from(o[1].ld)),
            (PROB_DISTRACTOR, |o| f64::from(o[2].ld)),
            (DISTRACTOR_PREFERRED, |o| f64::from(u8::from(o[1].correct))),
        ];
        for (metric, q) in quantities {
            let mut c = Clusters::<1>::new(p);
            for (l, i, o) in self.obs {
                c.add(self.cluster(*l, *i), self.phase(*l), [q(o)]);
            }
            let (per, pooled) = per_phase(&c, mean, reps, seed);
            rows.extend(self.rc.phase_rows(metric, None, phases, &per, pooled));
        }
        rows
    }

    /// `prob_diff` and accuracy grouped by the phase of the correct binding's key
    /// (binding probe): where the flip shows when the bindings sit at different places
    /// in different instances. None unless every prompt has a key position.
    fn key_phase_rows(&self, key_pos: &[Option<usize>]) -> Vec<LongRow> {
        let (p, reps, seed) = (self.p, self.reps, self.seed);
        if !key_pos.iter().all(Option::is_some) {
            return Vec::new();
        }
        let mut c = Clusters::<2>::new(p);
        for ((l, i, o), k) in self.obs.iter().zip(key_pos) {
            let kp = (k.unwrap_or(0) % p) as u32;
            c.add(
                self.cluster(*l, *i),
                kp,
                [f64::from(o[0].ld), f64::from(u8::from(o[0].correct))],
            );
        }
        let all: Vec<u32> = (0..p as u32).collect();
        let (per, pooled) = per_phase(&c, |s, n| s[0] / n as f64, reps, seed);
        let mut rows = self
            .rc
            .phase_rows(PROB_DIFF_KEY_PHASE, None, &all, &per, pooled);
        let (per, pooled) = per_phase(&c, |s, n| s[1] / n as f64, reps, seed);
        rows.extend(
            self.rc
                .phase_rows(ACCURACY_KEY_PHASE, None, &all, &per, pooled),
        );
        rows
    }

    /// One `prob_diff_L{L}` row per length (phase = `L mod P`), clustered by instance.
    fn length_rows(&self, lengths: &[usize]) -> Vec<LongRow> {
        let mut rows = Vec::new();
        for &l in lengths {
            let mut c = Clusters::<1>::new(1);
            for (_, i, o) in self.obs.iter().filter(|(x, _, _)| *x == l) {
                c.add(*i as u64, 0, [f64::from(o[0].ld)]);
            }
            let reps = if self.text { 0 } else { self.reps };
            let (_, e) = per_phase(&c, mean, reps, self.seed);
            let e = Est {
                ci: if self.text { None } else { e.ci },
                ..e
            };
            rows.push(
                self.rc
                    .row(format!("{PROB_DIFF_AT}{l}"), e)
                    .at_phase(self.phase(l)),
            );
        }
        rows
    }
}

/// The mean of a summed quantity.
fn mean(s: &[f64; 1], n: u64) -> f64 {
    s[0] / n as f64
}

fn run(cfg: &FillerProbe, ctx: &mut Ctx) -> Result<KindOutput> {
    let all = items(cfg, ctx)?;
    let max_len = all.iter().map(|i| i.tokens.len()).max().unwrap_or(0);
    ctx.preflight_plain(max_len)?;
    let mut lengths: Vec<usize> = all.iter().map(|i| i.filler_len).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let p = ctx.p();
    let (obs, key_pos) = evaluate(ctx, &all, &lengths)?;
    let rc = ctx.rows.clone();
    let sum = Summary {
        rc: &rc,
        obs: &obs,
        text: cfg.probe == ProbeKind::Text,
        p,
        reps: ctx.reps(),
        seed: ctx.seed(),
    };
    let phases: Vec<u32> = (0..p as u32)
        .filter(|r| lengths.iter().any(|&l| sum.phase(l) == *r))
        .collect();
    let mut rows = sum.residue_rows(&phases);
    rows.extend(sum.key_phase_rows(&key_pos));
    rows.extend(sum.length_rows(&lengths));
    Ok(KindOutput {
        tables: vec![("filler".into(), rows)],
    })
}

/// The `prob_diff_L{L}` rows of `model`, sorted by L: (L, value, lo, hi).
fn per_length(f: &Figures, model: &str) -> Vec<(usize, f64, f64, f64)> {
    let mut v: Vec<(usize, f64, f64, f64)> = f
        .data
        .rows
        .iter()
        .filter(|r| r.model == model)
        .filter_map(|r| {
            let l: usize = r.metric.strip_prefix(PROB_DIFF_AT)?.parse().ok()?;
            Some((
                l,
                r.value,
                r.ci_lo.unwrap_or(r.value),
                r.ci_hi.unwrap_or(r.value),
            ))
        })
        .collect();
    v.sort_by_key(|x| x.0);
    v
}

/// This kind's figures and report section, from its tables alone.
fn draw(f: &mut Figures) -> Result<()> {
    let m = f.model.clone();
    let pts = per_length(f, &m);
    f.report.section("Filler-length probe");
    f.report.paragraph(
        "Only the filler length L changes between prompts. P(correct) - P(distractor) of the first \
         answer token at the last prompt position (full-vocabulary softmax), per L and grouped by \
         L mod P (the phase column of the table holds L mod P; the accuracy rows above are top-1 = \
         correct per group), with 95% cluster-bootstrap intervals over the probe's instances (the \
         text probe: over the lengths of a group).",
    );
    headlines(f, &m, &pts);
    if !pts.is_empty() {
        length_figure(f, &m, &pts)?;
    }
    grouped_figure(
        f,
        [
            (PROB_DIFF, "P(correct) - P(distractor)"),
            (DISTRACTOR_PREFERRED, "distractor preferred"),
        ],
        "prob_diff_by_residue",
        format!("{m}: filler probe by L mod P"),
        "L mod P",
        "Grouped by L mod P",
    )?;
    grouped_figure(
        f,
        [
            (PROB_DIFF_KEY_PHASE, "P(correct) - P(distractor)"),
            (ACCURACY_KEY_PHASE, "top-1 = correct"),
        ],
        "prob_diff_by_key_phase",
        format!("{m}: filler probe by the phase of the correct key"),
        "phase of the correct binding's key (t_K mod P)",
        "Grouped by the phase of the correct binding's key",
    )
}

/// The headlines: the pooled difference, its swing over L, how often the distractor
/// is on top.
fn headlines(f: &mut Figures, m: &str, pts: &[(usize, f64, f64, f64)]) {
    let d = f.data;
    if let Some(r) = d.scalar(m, PROB_DIFF) {
        f.report.headline(
            Headline::new(
                "P(correct) - P(distractor), all L",
                format!("{:.3}", r.value),
            )
            .with_detail(ci_text(r, |v| format!("{v:.3}"))),
        );
    }
    if let (Some(lo), Some(hi)) = (
        pts.iter().min_by(|a, b| a.1.total_cmp(&b.1)),
        pts.iter().max_by(|a, b| a.1.total_cmp(&b.1)),
    ) {
        f.report.headline(Headline::new(
            "Swing over L",
            format!("{:.3} (L = {}) to {:.3} (L = {})", lo.1, lo.0, hi.1, hi.0),
        ));
    }
    if let Some(r) = d.scalar(m, DISTRACTOR_PREFERRED) {
        f.report.headline(Headline::new(
            "Distractor on top of the two",
            format!("{:.1}% of prompts", 100.0 * r.value),
        ));
    }
}

/// `prob_diff_by_length`: the difference per filler length with its intervals.
fn length_figure(f: &mut Figures, m: &str, pts: &[(usize, f64, f64, f64)]) -> Result<()> {
    let spec = LinePlotSpec {
        series: vec![BandSeries {
            name: "P(correct) - P(distractor)".into(),
            x: pts.iter().map(|p| p.0 as f64).collect(),
            y: pts.iter().map(|p| p.1).collect(),
            lo: pts.iter().map(|p| p.2).collect(),
            hi: pts.iter().map(|p| p.3).collect(),
        }],
        title: format!("{m}: filler-length probe"),
        x_label: "filler length L".into(),
        y_label: "P(correct) - P(distractor) (95% CI)".into(),
        y_range: Some((-1.0, 1.0)),
        size: None,
    };
    let fig = line_with_bands(f.dir.join("prob_diff_by_length"), &spec)?;
    f.push("P(correct) - P(distractor) by filler length", fig);
    Ok(())
}

/// A line figure `<file>` of the per-phase rows of `metrics` (metric, legend), under
/// `caption`; nothing when none of them has rows.
fn grouped_figure(
    f: &mut Figures,
    metrics: [(&str, &str); 2],
    file: &str,
    title: String,
    x_label: &str,
    caption: &str,
) -> Result<()> {
    let (d, m) = (f.data, f.model.clone());
    let series: Vec<BandSeries> = metrics
        .iter()
        .filter_map(|(metric, name)| super::super::report::band_series(d, &m, metric, name))
        .collect();
    if series.is_empty() {
        return Ok(());
    }
    let spec = LinePlotSpec {
        series,
        title,
        x_label: x_label.into(),
        y_label: "value (95% CI)".into(),
        y_range: Some((-1.0, 1.0)),
        size: None,
    };
    let fig = line_with_bands(f.dir.join(file), &spec)?;
    f.push(caption, fig);
    Ok(())
}
