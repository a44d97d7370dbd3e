//! `phaselens bench edges`: edges per second of EAP and EAP-IG (every edge of the
//! graph at once) against exact path patching (the path-patching routine, one cell per
//! edge) of every edge path patching defines (query head -> later q / k / v), in one
//! run on one phase group of an experiment's model and prompts; and the agreement of the
//! estimates with the exact effects over those edges. Where pass 2 runs locally (the
//! model has a stream API), EAP with replicas is timed too, and the largest difference
//! of the two methods' scores is reported (they compute the same derivative).

use std::path::Path;
use std::time::Instant;

use crate::device::DeviceSpec;
use crate::error::Result;
use crate::runner::bench::{RandomModel, load_bench_model_with, override_n_logical, phase_prompts};
use crate::runner::experiment::Experiment;
use crate::runner::heads::Direction;
use crate::runner::patching::Positions;
use crate::runner::progress::{Progress, ProgressMode};

use super::super::path_patching::path_group;
use super::eap::{EdgeRun, Method, Pass2, Timing, path_equivalent};
use super::graph::{Graph, ReceiverNode};
use super::{path_cells, path_cells_of_senders};

/// Result of `phaselens bench edges`.
#[derive(Debug, Clone)]
pub struct EdgeBenchResult {
    pub model: String,
    pub prompts: usize,
    pub prompt_len: usize,
    /// Edges of the whole graph (what EAP and EAP-IG score).
    pub edges: usize,
    pub eap_seconds: f64,
    /// How EAP and EAP-IG computed pass 2.
    pub pass2: Pass2,
    /// Where EAP's time went.
    pub eap_timing: Timing,
    /// With local pass 2: EAP with replicas (the reference), its seconds and the
    /// largest |local - replicas| over every edge and prompt relative to the largest
    /// |replicas| score.
    pub replicas: Option<(f64, f64)>,
    pub ig_steps: usize,
    pub ig_seconds: f64,
    /// Edges path patching scored (every query head -> later q / k / v edge, or every
    /// such edge of the sampled senders).
    pub exact_edges: usize,
    /// Every query head -> later q / k / v edge of the graph.
    pub exact_of: usize,
    pub exact_seconds: f64,
    /// Spearman of the EAP / EAP-IG summed LD change with the exact one over the
    /// path-patched edges.
    pub spearman_eap: f64,
    pub spearman_ig: f64,
    /// EAP-IG with the indexer's selection held: seconds and Spearman.
    pub ig_held: Option<(f64, f64)>,
}

impl EdgeBenchResult {
    fn rate(n: usize, s: f64) -> f64 {
        n as f64 / s
    }

    /// EAP edges/s over exact path-patching edges/s.
    pub fn eap_ratio(&self) -> f64 {
        Self::rate(self.edges, self.eap_seconds) / Self::rate(self.exact_edges, self.exact_seconds)
    }

    /// EAP-IG edges/s over exact path-patching edges/s.
    pub fn ig_ratio(&self) -> f64 {
        Self::rate(self.edges, self.ig_seconds) / Self::rate(self.exact_edges, self.exact_seconds)
    }
}

impl std::fmt::Display for EdgeBenchResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {}: {} clean/corrupted pairs of {} tokens, {} edges in the graph (denoising)",
            self.model, self.prompts, self.prompt_len, self.edges
        )?;
        writeln!(
            f,
            "EAP (every edge, pass 2 {}):      {:.2} s, {:.1} edges/s",
            self.pass2.name(),
            self.eap_seconds,
            Self::rate(self.edges, self.eap_seconds)
        )?;
        if self.pass2 == Pass2::Replicas {
            writeln!(
                f,
                "(the model has no stream API: pass 2 with one replica forward per receiver)"
            )?;
        }
        writeln!(f, "  EAP's time: {}", self.eap_timing)?;
        if let Some((s, diff)) = self.replicas {
            writeln!(
                f,
                "EAP with replicas (reference):       {:.2} s, {:.1} edges/s; max |local - replicas| = {:.1e} of max |score|",
                s,
                Self::rate(self.edges, s),
                diff
            )?;
        }
        writeln!(
            f,
            "EAP-IG, {} steps (every edge):        {:.2} s, {:.1} edges/s",
            self.ig_steps,
            self.ig_seconds,
            Self::rate(self.edges, self.ig_seconds)
        )?;
        let of = if self.exact_edges < self.exact_of {
            format!(" of {}, from a sample of senders", self.exact_of)
        } else {
            String::new()
        };
        writeln!(
            f,
            "exact path patching ({} edges{of}):      {:.2} s, {:.1} edges/s",
            self.exact_edges,
            self.exact_seconds,
            Self::rate(self.exact_edges, self.exact_seconds)
        )?;
        writeln!(
            f,
            "speed-up in edges/s: EAP {:.1}x, EAP-IG {:.1}x",
            self.eap_ratio(),
            self.ig_ratio()
        )?;
        write!(
            f,
            "Spearman with exact over the path-patched edges: EAP {:.3}, EAP-IG {:.3}",
            self.spearman_eap, self.spearman_ig
        )?;
        if let Some((s, sp)) = self.ig_held {
            write!(
                f,
                "\nEAP-IG, indexer selection held at the clean run's: {s:.2} s, Spearman {sp:.3}"
            )?;
        }
        Ok(())
    }
}

/// What `phaselens bench edges` measures.
#[derive(Debug, Clone)]
pub struct EdgeBench {
    /// Phase group.
    pub phase: u32,
    /// Logical examples in place of the experiment's.
    pub n_logical: Option<usize>,
    /// EAP-IG interpolation steps.
    pub ig_steps: usize,
    /// A randomly initialised, resized model in place of the experiment's.
    pub random: Option<RandomModel>,
    /// Exact path patching of every edge from at most this many head senders (a seeded
    /// sample; `None`: every sender). Its edges/s stands for all of them: each
    /// sender's patched run serves all its edges either way.
    pub exact_senders: Option<usize>,
    /// Also time EAP with replicas and compare (where pass 2 runs locally).
    pub replicas: bool,
    /// Also EAP-IG with the indexer's selection held at the clean run's
    /// ([`Method::EapIgHeld`]; a model with an indexer).
    pub ig_held: bool,
}

/// Time EAP, EAP-IG and exact path patching on one phase group of the experiment at
/// `path`.
pub fn bench_edges(path: &Path, what: &EdgeBench, device: &DeviceSpec) -> Result<EdgeBenchResult> {
    let (phase, ig_steps) = (what.phase, what.ig_steps);
    let exp = Experiment::load(path)?;
    let mut b = load_bench_model_with(&exp, device, what.random.as_ref())?;
    if let Some(n) = what.n_logical {
        override_n_logical(&mut b.task, n)?;
    }
    let (prompts, n) = phase_prompts(&b.task, phase)?;
    let model = b.model.as_ref();
    let graph = Graph::of(&b.info);
    let d = Direction::Denoise;
    let run = EdgeRun {
        model,
        prompts: &prompts,
        graph: &graph,
        direction: d,
        max_rows: b.max_rows,
    };
    let mut hidden = Progress::new(ProgressMode::Hidden, "", "", 0);
    // Warm-up, then the timed runs.
    run.scores(Method::Eap, &mut hidden)?;
    let t = Instant::now();
    let eap = run.scores(Method::Eap, &mut hidden)?;
    let eap_seconds = t.elapsed().as_secs_f64();
    let replicas = if what.replicas && eap.pass2 == Pass2::Local {
        let t = Instant::now();
        let rep = run.scores_with(Method::Eap, Pass2::Replicas, &mut hidden)?;
        let s = t.elapsed().as_secs_f64();
        let flat = |v: &[Vec<f32>]| v.iter().flatten().copied().collect::<Vec<f32>>();
        let (a, b) = (flat(&eap.scores), flat(&rep.scores));
        let top = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        Some((s, f64::from(diff / top.max(f32::MIN_POSITIVE))))
    } else {
        None
    };
    let t = Instant::now();
    let ig = run.scores(Method::EapIg { steps: ig_steps }, &mut hidden)?;
    let ig_seconds = t.elapsed().as_secs_f64();
    let held = if what.ig_held {
        let t = Instant::now();
        let h = run.scores(Method::EapIgHeld { steps: ig_steps }, &mut hidden)?;
        Some((t.elapsed().as_secs_f64(), h))
    } else {
        None
    };
    let (senders, cells, cand) = match what.exact_senders {
        Some(k) => path_cells_of_senders(&graph, d, k, 0),
        None => path_cells(&graph, d, usize::MAX, 0),
    };
    let all_exact = path_cells(&graph, d, usize::MAX, 0).1.len();
    let t = Instant::now();
    let (base, exact) = path_group(
        model,
        &prompts,
        &senders,
        &cells,
        &Positions::All,
        b.max_rows,
        &mut hidden,
    )?;
    let exact_seconds = t.elapsed().as_secs_f64();
    let pooled = model.info().arch != crate::model::deepseek_v4::MODEL_TYPE;
    // Summed clean-orientation LD changes of the corrupted prompts.
    let x: Vec<f64> = exact
        .iter()
        .map(|o| {
            o.iter()
                .enumerate()
                .map(|(i, o)| -(o.ld as f64) + base[n + i].ld as f64)
                .sum()
        })
        .collect();
    let est = |scores: &[Vec<f32>]| -> Vec<f64> {
        cand.iter()
            .map(|(si, r)| {
                let ReceiverNode::Attn { layer, head, input } = *r else {
                    return f64::NAN;
                };
                path_equivalent(&graph, scores, *si, layer, head, input, pooled)
                    .map_or(f64::NAN, |v| v.iter().map(|&s| s as f64).sum())
            })
            .collect()
    };
    let sp = |e: Vec<f64>| {
        crate::analysis::spearman(&e, &x)
            .ok()
            .flatten()
            .unwrap_or(f64::NAN)
    };
    Ok(EdgeBenchResult {
        model: b.name.clone(),
        prompts: n,
        prompt_len: prompts.len,
        edges: graph.edges.len(),
        eap_seconds,
        pass2: eap.pass2,
        eap_timing: eap.timing.clone(),
        replicas,
        ig_steps,
        ig_seconds,
        exact_edges: cells.len(),
        exact_of: all_exact,
        exact_seconds,
        spearman_eap: sp(est(&eap.scores)),
        spearman_ig: sp(est(&ig.scores)),
        ig_held: held.map(|(s, h)| (s, sp(est(&h.scores)))),
    })
}
