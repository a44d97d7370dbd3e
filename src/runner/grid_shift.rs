//! The grid-shift test of a phase effect from two phase sweeps' per-example tables
//! (`examples.arrow`): do run B's weak phases sit where run A's are, moved by B's grid
//! offset? Paired cluster-bootstrap intervals over logical examples
//! ([`crate::analysis::grid_shift`]); `phaselens grid-shift A B [--offset D]` is its
//! command, and docs/experiments.md describes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::analysis::grid_shift::{GridShift, PairedExample, grid_shift, roll};
use crate::analysis::{DEFAULT_LEVEL, PhaseCluster};
use crate::error::{Error, Result, ResultExt};
use crate::model::compression::Overlay;
use crate::output::{
    ColumnData, META_SCHEMA, META_VERSION, Table, check_output_name, write_bytes_atomic,
    write_parquet_copy,
};
use crate::runner::Experiment;
use crate::runner::kinds::phase_sweep::examples::{
    EXAMPLES_FILE, ExampleRow, Examples, read_examples,
};
use crate::tasks::Protocol;

/// An error whose message is `format!(...)` (the checks below name files and keys).
macro_rules! fail {
    ($($t:tt)*) => {
        return Err(Error::Other(format!($($t)*)))
    };
}

/// What to test: the two runs and the bootstrap.
#[derive(Debug, Clone)]
pub struct GridShiftRequest {
    /// Run A (the reference grid): an experiment name under `data_dir`, or its TOML.
    pub a: String,
    /// Run B (the grid offset by D): an experiment name, or its TOML.
    pub b: String,
    /// B's grid offset against A's in tokens; `None`: the runs' `[model] compression`
    /// offsets, B's minus A's, modulo the period.
    pub offset: Option<usize>,
    /// Bootstrap replicates.
    pub reps: usize,
    /// Bootstrap seed.
    pub seed: u64,
    /// The model, when a run swept several.
    pub model: Option<String>,
    /// The protocol, when the runs share both.
    pub protocol: Option<Protocol>,
    /// Root of the tables (`notebooks-data`).
    pub data_dir: PathBuf,
    /// Root of the reports (`reports`).
    pub reports_dir: PathBuf,
}

/// What [`run_grid_shift`] wrote.
#[derive(Debug, Clone)]
pub struct GridShiftOutput {
    /// `<data>/grid-shift/<A>--<B>.arrow` (`grid_shift/v1`, + a Parquet copy).
    pub table: PathBuf,
    /// `<reports>/grid-shift/<A>--<B>.md`.
    pub report: PathBuf,
    /// The headline table (Markdown): one line per measure.
    pub summary: String,
    /// The tests per measure (`accuracy`, and `logit_diff` when every row has one).
    pub results: Vec<(&'static str, GridShift)>,
}

/// One run's per-example table and the experiment that wrote it.
struct Run {
    name: String,
    file: PathBuf,
    ex: Examples,
    exp: Experiment,
}

/// The experiment name of `arg`: a TOML's name (`[experiment] name` or its stem), else
/// `arg` itself.
fn experiment_name(arg: &str) -> Result<String> {
    let p = Path::new(arg);
    if arg.ends_with(".toml") || p.is_file() {
        return Ok(Experiment::load(p)?.name());
    }
    check_output_name(arg).map_err(Error::Other)?;
    Ok(arg.to_string())
}

/// `<data>/<name>/<model>/examples.arrow`: the model given, or the only one present.
fn examples_path(data: &Path, name: &str, model: Option<&str>) -> Result<PathBuf> {
    let dir = data.join(name);
    let rerun = format!(
        "rerun `phaselens run exp/{name}.toml`: it resumes from the shards under {} \
         (no forwards when they are there) and writes the per-example table",
        dir.join("shards").display()
    );
    if !dir.is_dir() {
        fail!(
            "{}: no such experiment output (run `phaselens run exp/{name}.toml` first)",
            dir.display()
        );
    }
    if let Some(m) = model {
        let f = dir.join(m).join(EXAMPLES_FILE);
        if !f.is_file() {
            fail!("{}: no per-example table; {rerun}", f.display());
        }
        return Ok(f);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| Error::io(&dir, e))?
        .flatten()
        .map(|e| e.path().join(EXAMPLES_FILE))
        .filter(|f| f.is_file())
        .collect();
    found.sort();
    match found.len() {
        0 => fail!(
            "{}: no per-example table (<model>/{EXAMPLES_FILE}); {rerun}",
            dir.display()
        ),
        1 => Ok(found.remove(0)),
        _ => fail!(
            "{}: several models have per-example tables ({}); pick one with --model",
            dir.display(),
            found
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Read run `arg`'s per-example table and the experiment TOML recorded in it.
fn load_run(arg: &str, data: &Path, model: Option<&str>) -> Result<Run> {
    let name = experiment_name(arg)?;
    let file = examples_path(data, &name, model)?;
    let ex = read_examples(&file)?;
    let Some(text) = ex.experiment_toml.clone() else {
        fail!(
            "{}: no `phaselens.experiment_toml` in its metadata",
            file.display()
        );
    };
    let exp = Experiment::parse(&file, text)
        .context_with(|| format!("{}: the experiment TOML in its metadata", file.display()))?;
    Ok(Run {
        name,
        file,
        ex,
        exp,
    })
}

/// Both runs must sweep the same model, period and `[task]` settings.
fn check_same(a: &Run, b: &Run) -> Result<()> {
    let (fa, fb) = (a.file.display(), b.file.display());
    if a.ex.period != b.ex.period {
        fail!(
            "different periods: {fa} has P = {}, {fb} has P = {} ([task] period)",
            a.ex.period,
            b.ex.period
        );
    }
    let models = |r: &Run| {
        r.ex.rows
            .iter()
            .map(|x| x.model.clone())
            .collect::<BTreeSet<_>>()
    };
    if models(a) != models(b) {
        fail!(
            "different models: {fa} has {:?}, {fb} has {:?}",
            models(a),
            models(b)
        );
    }
    let task = |r: &Run| serde_json::to_value(&r.exp.file.task).unwrap_or_default();
    let (ta, tb) = (task(a), task(b));
    let (Some(ta), Some(tb)) = (ta.as_object(), tb.as_object()) else {
        return Ok(());
    };
    let keys: BTreeSet<&String> = ta.keys().chain(tb.keys()).collect();
    for k in keys {
        let (va, vb) = (ta.get(k), tb.get(k));
        if va != vb {
            let show =
                |v: Option<&serde_json::Value>| v.map_or("(absent)".into(), |v| v.to_string());
            fail!(
                "different [task] {k}: {} in {fa}, {} in {fb} (the grid-shift test needs the \
                 same prompts: the same task, period, seed and examples)",
                show(va),
                show(vb)
            );
        }
    }
    Ok(())
}

/// The protocol label to test: `want`, or the only one both runs share.
fn pick_protocol(a: &Run, b: &Run, want: Option<Protocol>) -> Result<String> {
    let labels = |r: &Run| {
        r.ex.rows
            .iter()
            .map(|x| x.protocol.clone())
            .collect::<BTreeSet<_>>()
    };
    let common: Vec<String> = labels(a).intersection(&labels(b)).cloned().collect();
    match want {
        Some(p) if common.iter().any(|c| c == p.label()) => Ok(p.label().to_string()),
        Some(p) => fail!(
            "--protocol {}: not in both runs (they share {common:?}; {} and {})",
            p.label(),
            a.file.display(),
            b.file.display()
        ),
        None if common.len() == 1 => Ok(common[0].clone()),
        None if common.is_empty() => fail!(
            "{} and {} share no protocol",
            a.file.display(),
            b.file.display()
        ),
        None => fail!("the runs share the protocols {common:?}: pick one with --protocol"),
    }
}

/// The grid offset of a run's overlay (`None` without one).
fn overlay_offset(exp: &Experiment) -> Option<usize> {
    exp.file.model.compression.as_ref().map(Overlay::offset)
}

/// D: `--offset`, else B's overlay offset minus A's modulo P; and where it came from.
fn resolve_offset(a: &Run, b: &Run, given: Option<usize>) -> Result<(usize, String)> {
    let p = a.ex.period;
    let from_toml = match (overlay_offset(&a.exp), overlay_offset(&b.exp)) {
        (Some(oa), Some(ob)) => Some((ob + p - oa % p) % p),
        _ => None,
    };
    match (given, from_toml) {
        (Some(d), _) if d >= p => fail!("--offset {d}: not below the period {p}"),
        (Some(d), Some(t)) if d != t => {
            eprintln!(
                "note: --offset {d}, while the runs' [model] compression offsets differ by {t}"
            );
            Ok((d, "--offset".into()))
        }
        (Some(d), _) => Ok((d, "--offset".into())),
        (None, Some(t)) => Ok((t, "[model] compression offsets (B - A mod P)".into())),
        (None, None) => fail!(
            "no compression overlay in {} or {}: give the grid offset with --offset",
            a.file.display(),
            b.file.display()
        ),
    }
}

/// Per logical example: its rows of `protocol`.
fn by_logical<'r>(rows: &'r [ExampleRow], protocol: &str) -> BTreeMap<u64, Vec<&'r ExampleRow>> {
    let mut m: BTreeMap<u64, Vec<&ExampleRow>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.protocol == protocol) {
        m.entry(r.logical).or_default().push(r);
    }
    m
}

/// Rows per phase of `protocol` (the example count of each phase group).
fn per_phase_counts(rows: &[ExampleRow], protocol: &str, p: usize) -> Vec<usize> {
    let mut n = vec![0; p];
    for r in rows.iter().filter(|r| r.protocol == protocol) {
        n[r.phase as usize] += 1;
    }
    n
}

/// The same logical examples, as many at every phase, in both runs.
fn check_examples(a: &Run, b: &Run, protocol: &str) -> Result<()> {
    let p = a.ex.period;
    let (na, nb) = (
        per_phase_counts(&a.ex.rows, protocol, p),
        per_phase_counts(&b.ex.rows, protocol, p),
    );
    if na != nb {
        fail!(
            "different example counts per phase ({protocol}): {na:?} in {}, {nb:?} in {} \
             ([task] n_logical)",
            a.file.display(),
            b.file.display()
        );
    }
    let (la, lb) = (
        by_logical(&a.ex.rows, protocol),
        by_logical(&b.ex.rows, protocol),
    );
    if let Some(x) = la.keys().find(|k| !lb.contains_key(k)) {
        fail!(
            "logical example {x} is in {} but not in {}",
            a.file.display(),
            b.file.display()
        );
    }
    if let Some(x) = lb.keys().find(|k| !la.contains_key(k)) {
        fail!(
            "logical example {x} is in {} but not in {}",
            b.file.display(),
            a.file.display()
        );
    }
    Ok(())
}

/// One cluster per logical example: the value `of` each row at its phase, both runs.
fn paired(
    a: &Run,
    b: &Run,
    protocol: &str,
    of: impl Fn(&ExampleRow) -> f64,
) -> Result<Vec<PairedExample>> {
    let p = a.ex.period;
    let (la, lb) = (
        by_logical(&a.ex.rows, protocol),
        by_logical(&b.ex.rows, protocol),
    );
    let cluster = |rows: &[&ExampleRow]| {
        PhaseCluster::from_observations(p, rows.iter().map(|r| (r.phase as usize, of(r))))
    };
    la.iter()
        .map(|(l, ra)| {
            Ok(PairedExample {
                a: cluster(ra)?,
                b: cluster(&lb[l])?,
            })
        })
        .collect()
}

/// The measures to test: accuracy, and the logit difference when every row has one.
fn measures(
    a: &Run,
    b: &Run,
    protocol: &str,
    d: usize,
    args: &GridShiftRequest,
) -> Result<Vec<(&'static str, GridShift)>> {
    let test = |ex: Vec<PairedExample>| grid_shift(&ex, d, args.reps, args.seed, DEFAULT_LEVEL);
    let acc = paired(a, b, protocol, |r| f64::from(u8::from(r.correct)))?;
    let mut out = vec![("accuracy", test(acc)?)];
    let rows =
        a.ex.rows
            .iter()
            .chain(&b.ex.rows)
            .filter(|r| r.protocol == protocol);
    if rows.clone().all(|r| r.ld.is_some_and(f64::is_finite)) {
        let ld = paired(a, b, protocol, |r| r.ld.unwrap_or(f64::NAN))?;
        out.push(("logit_diff", test(ld)?));
    }
    Ok(out)
}

/// Run the grid-shift test of `req`: check that the runs share model, period, `[task]`
/// and logical examples, bootstrap every measure, write the table and the report.
///
/// # Errors
/// Errors naming the files and the key for runs that cannot be compared, a missing
/// per-example table (with the `phaselens run` that writes it), or I/O.
pub fn run_grid_shift(req: &GridShiftRequest) -> Result<GridShiftOutput> {
    let m = req.model.as_deref();
    let a = load_run(&req.a, &req.data_dir, m)?;
    let b = load_run(&req.b, &req.data_dir, m)?;
    check_same(&a, &b)?;
    let protocol = pick_protocol(&a, &b, req.protocol)?;
    check_examples(&a, &b, &protocol)?;
    let (d, source) = resolve_offset(&a, &b, req.offset)?;
    if d == 0 {
        eprintln!("note: D = 0: r(D) - r(0) is 0 by construction");
    }
    let results = measures(&a, &b, &protocol, d, req)?;
    let stem = format!("{}--{}", a.name, b.name);
    let table = req
        .data_dir
        .join("grid-shift")
        .join(format!("{stem}.arrow"));
    let ctx = Meta {
        a: &a,
        b: &b,
        protocol: &protocol,
        source: &source,
        args: req,
        table: &table,
    };
    output_table(&ctx, &results).write_arrow(&table)?;
    write_parquet_copy(&table)?;
    let report_path = req
        .reports_dir
        .join("grid-shift")
        .join(format!("{stem}.md"));
    write_bytes_atomic(&report_path, report(&ctx, &results).as_bytes())
        .map_err(|e| Error::io(&report_path, e))?;
    let summary = summary_table(&ctx, &results);
    Ok(GridShiftOutput {
        table,
        report: report_path,
        summary,
        results,
    })
}

/// What the outputs record besides the numbers.
struct Meta<'a> {
    a: &'a Run,
    b: &'a Run,
    protocol: &'a str,
    source: &'a str,
    args: &'a GridShiftRequest,
    /// The `grid_shift/v1` table's path.
    table: &'a Path,
}

/// One `grid_shift/v1` row.
struct Row {
    measure: &'static str,
    statistic: &'static str,
    k: Option<usize>,
    phase: Option<usize>,
    value: f64,
    ci: Option<(f64, f64)>,
    n: u64,
}

/// The rows of one measure's test.
fn rows_of(measure: &'static str, g: &GridShift) -> Vec<Row> {
    let n_ex = g.n_examples as u64;
    let row = |statistic, k, phase, value, ci, n| Row {
        measure,
        statistic,
        k,
        phase,
        value,
        ci,
        n,
    };
    let mut out = Vec::new();
    for (statistic, prof) in [("profile_a", &g.profile_a), ("profile_b", &g.profile_b)] {
        for (r, c) in prof.iter().enumerate() {
            out.push(row(
                statistic,
                None,
                Some(r),
                c.estimate,
                Some((c.lo, c.hi)),
                n_ex,
            ));
        }
    }
    for (k, c) in g.r.iter().enumerate() {
        out.push(row(
            "r",
            Some(k),
            None,
            c.estimate,
            Some((c.lo, c.hi)),
            c.valid_reps as u64,
        ));
    }
    let c = &g.r_diff;
    out.push(row(
        "r_offset_minus_r0",
        Some(g.offset),
        None,
        c.estimate,
        Some((c.lo, c.hi)),
        c.valid_reps as u64,
    ));
    let best_r = g.best_k.map_or(f64::NAN, |k| g.r[k].estimate);
    out.push(row("best_k", g.best_k, None, best_r, None, n_ex));
    for (k, &f) in g.best_k_fraction.iter().enumerate() {
        out.push(row("p_best_k", Some(k), None, f, None, g.r[0].reps as u64));
    }
    out
}

/// The `grid_shift/v1` table of every measure.
fn output_table(m: &Meta, results: &[(&'static str, GridShift)]) -> Table {
    let rows: Vec<Row> = results
        .iter()
        .flat_map(|(name, g)| rows_of(name, g))
        .collect();
    let idx = |v: Option<usize>| v.map(|x| x as i64);
    let cols = [
        (
            "measure",
            ColumnData::Utf8(rows.iter().map(|r| Some(r.measure.to_string())).collect()),
        ),
        (
            "statistic",
            ColumnData::Utf8(rows.iter().map(|r| Some(r.statistic.to_string())).collect()),
        ),
        (
            "k",
            ColumnData::Int64(rows.iter().map(|r| idx(r.k)).collect()),
        ),
        (
            "phase",
            ColumnData::Int64(rows.iter().map(|r| idx(r.phase)).collect()),
        ),
        (
            "value",
            ColumnData::Float64(rows.iter().map(|r| Some(r.value)).collect()),
        ),
        (
            "ci_lo",
            ColumnData::Float64(rows.iter().map(|r| r.ci.map(|c| c.0)).collect()),
        ),
        (
            "ci_hi",
            ColumnData::Float64(rows.iter().map(|r| r.ci.map(|c| c.1)).collect()),
        ),
        (
            "n",
            ColumnData::UInt64(rows.iter().map(|r| Some(r.n)).collect()),
        ),
    ];
    let g = &results[0].1;
    let mut t = Table::new("grid_shift")
        .with_metadata(META_SCHEMA, "grid_shift/v1")
        .with_metadata(META_VERSION, env!("CARGO_PKG_VERSION"));
    for (k, v) in [
        ("a", m.a.name.clone()),
        ("b", m.b.name.clone()),
        ("a_toml", m.a.exp.text.clone()),
        ("b_toml", m.b.exp.text.clone()),
        ("model", model_of(m.a)),
        ("protocol", m.protocol.to_string()),
        ("period", g.period.to_string()),
        ("offset", g.offset.to_string()),
        ("offset_source", m.source.to_string()),
        ("n_examples", g.n_examples.to_string()),
        ("reps", m.args.reps.to_string()),
        ("seed", m.args.seed.to_string()),
        ("level", DEFAULT_LEVEL.to_string()),
    ] {
        t.set_metadata(format!("phaselens.grid_shift.{k}"), v);
    }
    for (name, data) in cols {
        t.add_column(name, data)
            .expect("distinct columns of equal length");
    }
    t
}

fn model_of(r: &Run) -> String {
    r.ex.rows
        .first()
        .map(|x| x.model.clone())
        .unwrap_or_default()
}

/// `0.87 [0.52, 0.98]` (NaN bounds as `n/a`).
fn with_ci(c: &crate::analysis::BootstrapCi) -> String {
    let f = |x: f64| {
        if x.is_finite() {
            format!("{x:.2}")
        } else {
            "n/a".into()
        }
    };
    format!("{} [{}, {}]", f(c.estimate), f(c.lo), f(c.hi))
}

fn profile_line(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The headline table: one line per measure.
fn summary_table(m: &Meta, results: &[(&'static str, GridShift)]) -> String {
    let d = results[0].1.offset;
    let mut s = format!(
        "grid shift {} -> {} ({}, {}, D = {d}, {} examples x {} phases, {} replicates, seed {})\n\n",
        m.a.name,
        m.b.name,
        model_of(m.a),
        m.protocol,
        results[0].1.n_examples,
        results[0].1.period,
        m.args.reps,
        m.args.seed
    );
    s.push_str("| measure | r(D) (95% CI) | r(0) (95% CI) | r(D) - r(0) (95% CI) | best k | P(best k = D) |\n|---|---|---|---|---|---|\n");
    for (name, g) in results {
        let best = g.best_k.map_or("n/a".into(), |k| k.to_string());
        s.push_str(&format!(
            "| {name} | {} | {} | {} | {best} | {:.3} |\n",
            with_ci(g.r_offset()),
            with_ci(&g.r[0]),
            with_ci(&g.r_diff),
            g.p_best_is_offset()
        ));
    }
    s
}

/// The Markdown report: the headline table, then per measure the profiles and r(k).
fn report(m: &Meta, results: &[(&'static str, GridShift)]) -> String {
    let mut s = format!("# Grid shift: `{}` -> `{}`\n\n", m.a.name, m.b.name);
    s.push_str(&format!(
        "Written by `phaselens grid-shift {} {}` from `{}` and `{}`. D = {} ({}). \
         r(k) = Pearson correlation of B's per-phase profile with A's rolled by k \
         (`roll(a, k)[r] = a[(r - k) mod P]`); 95% percentile intervals of a paired \
         bootstrap over logical examples (the same examples drawn in both runs). \
         Table: `{}` (docs/tables.md, `grid_shift/v1`).\n\n",
        m.a.name,
        m.b.name,
        m.a.file.display(),
        m.b.file.display(),
        results[0].1.offset,
        m.source,
        m.table.display()
    ));
    s.push_str(&summary_table(m, results));
    for (name, g) in results {
        let est =
            |v: &[crate::analysis::BootstrapCi]| v.iter().map(|c| c.estimate).collect::<Vec<_>>();
        let a = est(&g.profile_a);
        s.push_str(&format!(
            "\n## {name}\n\n| phase | {} |\n|---|{}\n",
            (0..g.period)
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(" | "),
            "---|".repeat(g.period)
        ));
        for (label, v) in [
            ("A", a.clone()),
            (
                &format!("A rolled by D = {}", g.offset) as &str,
                roll(&a, g.offset),
            ),
            ("B", est(&g.profile_b)),
        ] {
            s.push_str(&format!(
                "| {label} | {} |\n",
                profile_line(&v).replace(' ', " | ")
            ));
        }
        s.push_str("\n| k | r(k) (95% CI) | P(best k = k) |\n|---|---|---|\n");
        for (k, c) in g.r.iter().enumerate() {
            s.push_str(&format!(
                "| {k} | {} | {:.3} |\n",
                with_ci(c),
                g.best_k_fraction[k]
            ));
        }
    }
    s
}
