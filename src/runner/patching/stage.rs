//! Two-stage edits ([`Edit::FromStage`], path patching): the forwards of the earlier
//! stage (one replacement plus freezes, in one forward), run once per stage and prompt
//! for every cell that replaces from it, and the values the later stage takes.

use std::collections::BTreeSet;

use super::suffix::{span_suffix, take_positions, unslice_positions};
use super::*;

/// The earlier stage of a two-stage edit: one forward of a prompt (from the first
/// layer of its points) with every point of `freeze` held at the prompt's own base
/// value at every position, and `point` within `heads` x `positions` replaced by
/// `fill` on top (so `point` may be frozen too: its other heads keep their base
/// values). Path patching's sender forward: the sender head's `hook_z` from the
/// partner prompt, every `hook_z` and `hook_mlp_out` from its layer on frozen.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stage {
    pub point: HookPoint,
    pub heads: Option<Vec<usize>>,
    pub positions: Positions,
    pub fill: Fill,
    pub freeze: Vec<HookPoint>,
}

impl Stage {
    /// The block the stage's forward starts at: the first layer of its points.
    pub fn start_layer(&self) -> Result<usize> {
        Edit::first_layer(
            std::iter::once(&self.point).chain(&self.freeze),
            block_layer,
        )
    }

    /// What a base run must capture for the stage's forwards.
    pub(super) fn reads(&self) -> Result<Vec<HookPoint>> {
        let mut v = vec![
            HookPoint::block(self.start_layer()?, Site::ResidPre),
            self.point,
        ];
        v.extend(&self.freeze);
        Ok(v)
    }

    /// The replacement as a one-point edit (the naive oracle's own actions).
    pub(super) fn edit(&self) -> Edit {
        Edit::Replace {
            point: self.point,
            heads: self.heads.clone(),
            positions: self.positions.clone(),
            fill: self.fill,
        }
    }

    /// Where the stage's forward starts to differ from the base run, if it can run as
    /// a suffix forward: its replacement of a per-token activation at given positions
    /// (not "all"), every freeze per-token. By causality, every activation of the
    /// stage's forward equals the base run's before the first of these positions.
    pub fn suffix_positions(&self) -> Option<&Positions> {
        let per_token = |p: &HookPoint| p.site.info().per_token;
        (per_token(&self.point)
            && self.positions != Positions::All
            && self.freeze.iter().all(per_token))
        .then_some(&self.positions)
    }
}

/// The captures of a stage over its prompts (sorted), at every position.
#[derive(Debug, Clone)]
struct StageRun {
    prompts: Vec<usize>,
    acts: BTreeMap<HookPoint, Act>,
}

/// The captures of every stage of a batch's cells ([`run_stages`]).
#[derive(Debug, Clone, Default)]
pub struct StageCaptures {
    runs: BTreeMap<Stage, StageRun>,
    /// The stage forwards that ran.
    pub forwards: u64,
}

impl StageCaptures {
    /// The value of a replacement at `point` over the rows of a chunk: each row of
    /// `edits` (all stage fills) takes its prompt's capture under its stage, every
    /// other row its own base value (`base_act`: every prompt).
    pub(super) fn value(
        &self,
        point: &HookPoint,
        base_act: &Act,
        row_prompt: &[usize],
        edits: &[&RowEdit],
    ) -> Result<Act> {
        let missing = |what: &str| Error::hook(point.to_string(), what.to_string());
        let mut sources = vec![base_act.clone()];
        let mut offsets: BTreeMap<&Stage, usize> = BTreeMap::new();
        let mut total = base_act.shape()[0];
        let mut idx = row_prompt.to_vec();
        for e in edits {
            let RowFill::Stage(stage) = e.fill else {
                return Err(missing("a stage value for a row without a stage fill"));
            };
            let run = self
                .runs
                .get(stage)
                .ok_or_else(|| missing("the stage of this edit did not run (run_stages)"))?;
            let off = match offsets.get(stage) {
                Some(&o) => o,
                None => {
                    let act = run
                        .acts
                        .get(point)
                        .ok_or_else(|| missing("not captured by the stage's forward"))?;
                    sources.push(act.clone());
                    offsets.insert(stage, total);
                    total += act.shape()[0];
                    total - act.shape()[0]
                }
            };
            let i = run
                .prompts
                .binary_search(&e.prompt)
                .map_err(|_| missing("the stage did not run on this prompt"))?;
            idx[e.row] = off + i;
        }
        Act::cat_batch(&sources)?.select_batch(&idx)
    }
}

/// One stage of a stage chunk: the stage, its prompts (sorted), the points captured.
type StageNeed<'c> = (&'c Stage, Vec<usize>, BTreeSet<HookPoint>);

/// The forwards of the stages of `cells`' [`Edit::FromStage`] edits over `base`
/// (which holds what [`captures_for`] lists): each distinct stage once per prompt of
/// the cells that replace from it, capturing the points they replace. Stages of one
/// start layer share forwards of at most `max_rows` rows (a stage with more prompts
/// gets a forward of its own); with [`ChunkPath::Auto`] and a base state, a forward
/// whose stages all edit given positions runs as a suffix forward (its captures keep
/// the base values outside the recomputed positions).
pub fn run_stages(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    base: &Base,
    cells: &[Cell],
    max_rows: usize,
    path: ChunkPath,
) -> Result<StageCaptures> {
    let mut need: BTreeMap<&Stage, (BTreeSet<usize>, BTreeSet<HookPoint>)> = BTreeMap::new();
    for c in cells {
        if let Edit::FromStage { stage, point, .. } = &c.edit {
            let e = need.entry(&**stage).or_default();
            e.0.extend(&c.prompts);
            e.1.insert(*point);
        }
    }
    let mut by_layer: BTreeMap<usize, Vec<StageNeed>> = BTreeMap::new();
    for (stage, (ps, pts)) in need {
        by_layer.entry(stage.start_layer()?).or_default().push((
            stage,
            ps.into_iter().collect(),
            pts,
        ));
    }
    let mut out = StageCaptures::default();
    let run = StageForward {
        model,
        prompts,
        base,
        path,
    };
    for (start, stages) in by_layer {
        let mut chunk: Vec<StageNeed> = Vec::new();
        let mut rows = 0;
        for s in stages {
            if !chunk.is_empty() && rows + s.1.len() > max_rows {
                run.chunk(start, &std::mem::take(&mut chunk), &mut out)?;
                rows = 0;
            }
            rows += s.1.len();
            chunk.push(s);
        }
        if !chunk.is_empty() {
            run.chunk(start, &chunk, &mut out)?;
        }
    }
    Ok(out)
}

/// What the stage forwards of a batch share.
struct StageForward<'a> {
    model: &'a dyn LanguageModel,
    prompts: &'a Prompts,
    base: &'a Base,
    path: ChunkPath,
}

impl StageForward<'_> {
    /// One forward from `start` over the prompts of the stages of `chunk` (rows in
    /// stage order); their captures go to `out`.
    fn chunk(&self, start: usize, chunk: &[StageNeed], out: &mut StageCaptures) -> Result<()> {
        let (prompts, base) = (self.prompts, self.base);
        let mut row_prompt = Vec::new();
        let mut per_point: BTreeMap<HookPoint, Vec<RowEdit>> = BTreeMap::new();
        let mut spans = Vec::with_capacity(chunk.len());
        let mut points = BTreeSet::new();
        for (stage, ps, pts) in chunk {
            let from = row_prompt.len();
            for &prompt in ps {
                let row = row_prompt.len();
                row_prompt.push(prompt);
                for f in &stage.freeze {
                    per_point.entry(*f).or_default().push(RowEdit {
                        row,
                        prompt,
                        fill: RowFill::Own,
                        heads: None,
                        positions: None,
                    });
                }
                per_point.entry(stage.point).or_default().push(RowEdit {
                    row,
                    prompt,
                    fill: RowFill::Fill(stage.fill),
                    heads: stage.heads.as_deref(),
                    positions: stage.positions.resolve(&prompts.targets[prompt].positions),
                });
            }
            spans.push(from..row_prompt.len());
            points.extend(pts.iter().copied());
        }
        let suffix = match (self.path, &base.state) {
            (ChunkPath::Auto, Some(_)) => {
                let mut rows = Vec::with_capacity(row_prompt.len());
                for (stage, ps, _) in chunk {
                    if let Some(pos) = stage.suffix_positions() {
                        rows.extend(ps.iter().map(|&p| (p, pos)));
                    }
                }
                // Every stage must qualify.
                (rows.len() == row_prompt.len())
                    .then(|| span_suffix(prompts, &rows))
                    .flatten()
            }
            _ => None,
        };
        let mut spec = install_replacements(
            HookSpec::new(),
            &per_point,
            base,
            prompts,
            &row_prompt,
            suffix.as_ref(),
        )?;
        for p in &points {
            spec = spec.capture_point(*p);
        }
        let resid_all = act_at(&base.cache, &HookPoint::block(start, Site::ResidPre))?;
        let (cache, sfx) = match (&suffix, &base.state) {
            (Some(sfx), Some(state)) => {
                let resid = take_positions(resid_all, &row_prompt, &sfx.from, sfx.len)?;
                let o = self
                    .model
                    .forward_suffix(start, state, sfx, &resid, &spec)?;
                (o.cache, Some(sfx))
            }
            _ => {
                let tokens = prompts.tokens_of(&row_prompt, &self.model.device());
                let resid = resid_all.select_batch(&row_prompt)?;
                let o = self.model.forward_from(tokens, start, &resid, &spec)?;
                (o.cache, None)
            }
        };
        let mut acts = BTreeMap::new();
        for p in &points {
            let got = cache.get(p).ok_or_else(|| {
                Error::hook(
                    p.to_string(),
                    "the stage forward did not produce this activation",
                )
            })?;
            let full = match sfx {
                // Every position: the base run's outside the recomputed ones.
                Some(sfx) => {
                    let own = act_at(&base.cache, p)?.select_batch(&row_prompt)?;
                    unslice_positions(&own, got, &sfx.from, sfx.len)?
                }
                None => got.clone(),
            };
            acts.insert(*p, full);
        }
        for ((stage, ps, pts), span) in chunk.iter().zip(spans) {
            let sel: Vec<usize> = span.collect();
            let mut mine = BTreeMap::new();
            for p in pts {
                mine.insert(*p, acts[p].select_batch(&sel)?);
            }
            out.runs.insert(
                (*stage).clone(),
                StageRun {
                    prompts: ps.clone(),
                    acts: mine,
                },
            );
        }
        out.forwards += 1;
        Ok(())
    }
}
