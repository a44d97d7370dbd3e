//! The Slurm executor: one `sbatch --array` job with a task per design (each task runs
//! `phaselens grid task GRID --index $SLURM_ARRAY_TASK_ID`), and a merge job that
//! depends on it (`--dependency=afterany`, so it merges whatever finished). Slurm does
//! all the distribution; phaselens only writes the job scripts, records the job ids in
//! `<grid dir>/slurm/jobs.json`, reads `squeue` (pending, running), `sacct` (finished,
//! failed) and, without accounting, `scontrol show job` for `status`, and on `--resume`
//! resubmits the designs that are neither finished nor queued.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::output::write_bytes_atomic;
use crate::train::{OrganismFile, latest_checkpoint};

use super::spec::{Design, Grid, SlurmConfig};
use super::task::{GridOptions, eval_specs, finished, write_recipes};

/// Resources of the array tasks: the command line over the grid file's `[slurm]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    pub partition: Option<String>,
    pub cpus_per_task: Option<u32>,
    pub mem: Option<String>,
    pub time: Option<String>,
    pub max_parallel: Option<usize>,
    pub sbatch_args: Vec<String>,
}

impl Resources {
    /// These settings, each falling back to the grid file's.
    pub fn over(self, file: &SlurmConfig) -> Resources {
        Resources {
            partition: self.partition.or_else(|| file.partition.clone()),
            cpus_per_task: self.cpus_per_task.or(file.cpus_per_task),
            mem: self.mem.or_else(|| file.mem.clone()),
            time: self.time.or_else(|| file.time.clone()),
            max_parallel: self.max_parallel.or(file.max_parallel),
            sbatch_args: if self.sbatch_args.is_empty() {
                file.sbatch_args.clone()
            } else {
                self.sbatch_args
            },
        }
    }

    /// Every setting must make sense to sbatch before anything is written or submitted:
    /// at least one CPU, a memory size (`4096`, `4G`, `500M`), a Slurm time limit, at
    /// least one parallel task, arguments that are options. The message names the
    /// `[slurm]` key and the command-line flag that set it.
    pub fn check(&self) -> Result<()> {
        let bad = |key: &str, flag: &str, m: String| {
            Error::Other(format!("[slurm] {key} (or --{flag}): {m}"))
        };
        if self.cpus_per_task == Some(0) {
            return Err(bad(
                "cpus_per_task",
                "cpus-per-task",
                "must be at least 1".into(),
            ));
        }
        if let Some(m) = &self.mem
            && !valid_mem(m)
        {
            return Err(bad(
                "mem",
                "mem",
                format!(
                    "`{m}` is not a memory size: give a whole number with an optional unit K, M, G or T (e.g. \"4G\")"
                ),
            ));
        }
        if let Some(t) = &self.time
            && !valid_time(t)
        {
            return Err(bad(
                "time",
                "time",
                format!(
                    "`{t}` is not a Slurm time limit: give minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
                ),
            ));
        }
        if self.max_parallel == Some(0) {
            return Err(bad(
                "max_parallel",
                "max-parallel",
                "must be at least 1 (leave it out for no limit)".into(),
            ));
        }
        if let Some(p) = &self.partition
            && (p.is_empty() || p.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(bad(
                "partition",
                "partition",
                format!("`{p}` is not a partition name"),
            ));
        }
        for a in &self.sbatch_args {
            if !a.starts_with('-') || a.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(bad(
                    "sbatch_args",
                    "sbatch-arg",
                    format!(
                        "`{}` is not one sbatch option (e.g. \"--account=lab\")",
                        a.escape_debug()
                    ),
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn directives(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(p) = &self.partition {
            v.push(format!("--partition={p}"));
        }
        v.push(format!(
            "--cpus-per-task={}",
            self.cpus_per_task.unwrap_or(1)
        ));
        if let Some(m) = &self.mem {
            v.push(format!("--mem={m}"));
        }
        if let Some(t) = &self.time {
            v.push(format!("--time={t}"));
        }
        v.extend(self.sbatch_args.iter().cloned());
        v
    }
}

/// `4096`, `4G`, `500m`: digits and at most one unit letter.
fn valid_mem(m: &str) -> bool {
    let digits = m.trim_end_matches(|c: char| "KMGTkmgt".contains(c));
    m.len() - digits.len() <= 1
        && !digits.is_empty()
        && digits.chars().all(|c| c.is_ascii_digit())
        && digits.parse::<u64>().is_ok_and(|n| n > 0)
}

/// Slurm's time formats: `M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`, `UNLIMITED`.
fn valid_time(t: &str) -> bool {
    if t.eq_ignore_ascii_case("unlimited") || t.eq_ignore_ascii_case("infinite") {
        return true;
    }
    let num = |x: &str| !x.is_empty() && x.len() <= 9 && x.chars().all(|c| c.is_ascii_digit());
    let (days, rest) = match t.split_once('-') {
        Some((d, r)) => (Some(d), r),
        None => (None, t),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    let ok = parts.iter().all(|p| num(p));
    match days {
        Some(d) => num(d) && ok && (1..=3).contains(&parts.len()),
        None => {
            ok && (1..=3).contains(&parts.len())
                && parts.iter().any(|p| p.bytes().any(|b| b != b'0'))
        }
    }
}

/// One `phaselens grid --slurm` submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submission {
    /// The array job.
    pub array_job: String,
    /// The merge job (depends on the array job); `None` while it is not (yet) accepted:
    /// the array job is recorded before the merge job is submitted.
    #[serde(default)]
    pub merge_job: Option<String>,
    /// Array indices (= design indices) submitted.
    pub indices: Vec<usize>,
    /// Their design names.
    pub designs: Vec<String>,
    /// Unix time of the submission.
    pub submitted_unix: u64,
    /// The array script and its logs.
    pub script: PathBuf,
    pub logs: PathBuf,
}

impl fmt::Display for Submission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "submitted array job {} ({} task(s): {})",
            self.array_job,
            self.indices.len(),
            self.designs.join(", "),
        )?;
        match &self.merge_job {
            Some(m) => writeln!(f, " and merge job {m} (after the array)")?,
            None => writeln!(f, " (no merge job)")?,
        }
        writeln!(f, "logs: {}", self.logs.display())
    }
}

/// What `submit` did (or would do, with `dry_run`).
#[derive(Debug, Clone)]
pub enum Submitted {
    Jobs(Submission),
    /// Nothing to run: every selected design is finished or already queued.
    Nothing {
        queued: Vec<String>,
    },
    DryRun {
        commands: Vec<String>,
    },
}

impl fmt::Display for Submitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Submitted::Jobs(s) => write!(f, "{s}"),
            Submitted::Nothing { queued } if queued.is_empty() => {
                writeln!(f, "nothing to submit: every design is finished")
            }
            Submitted::Nothing { queued } => writeln!(
                f,
                "nothing to submit: the unfinished designs are queued or running: {}",
                queued.join(", ")
            ),
            Submitted::DryRun { commands } => {
                for c in commands {
                    writeln!(f, "{c}")?;
                }
                Ok(())
            }
        }
    }
}

/// `<grid dir>/slurm/`: job scripts, `jobs.json`, `logs/`.
pub fn state_dir(grid: &Grid) -> PathBuf {
    grid.dir.join("slurm")
}

fn jobs_path(grid: &Grid) -> PathBuf {
    state_dir(grid).join("jobs.json")
}

/// Every submission of this grid, oldest first.
pub fn submissions(grid: &Grid) -> Result<Vec<Submission>> {
    let p = jobs_path(grid);
    match std::fs::read_to_string(&p) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| Error::Config {
            path: p,
            message: format!("corrupt job record: {e}"),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(p, e)),
    }
}

pub(crate) fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).map_err(|e| Error::io(p, e))
}

pub(crate) fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// A path that goes into a job script or an sbatch argument: any character bash's
/// single quotes carry (spaces, quotes), but no control character (a newline would end
/// the script's line); Slurm's `--output` also reads `%` and `\\` as patterns.
pub(crate) fn slurm_path(p: &Path, what: &str, pattern: bool) -> Result<PathBuf> {
    let abs = absolute(p)?;
    let text = abs.to_string_lossy();
    let odd = text
        .chars()
        .find(|&c| c.is_control() || (pattern && (c == '%' || c == '\\')));
    if let Some(c) = odd {
        return Err(Error::Other(format!(
            "{what} {:?} holds {:?}, which a Slurm job cannot take{}: move or rename it",
            abs.display().to_string(),
            c,
            if pattern {
                " (sbatch reads `%` and `\\` in log paths as patterns)"
            } else {
                ""
            }
        )));
    }
    Ok(abs)
}

/// `text` as one bash word (single-quoted unless plain).
pub(crate) fn shell_word(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,%@+".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// One job: its script and the sbatch options that carry paths (job name, log file,
/// working directory), given as separate arguments so no path is ever parsed from an
/// `#SBATCH` line.
struct JobScript {
    text: String,
    options: Vec<String>,
}

/// The two job scripts (array task, merge).
fn scripts(grid: &Grid, opts: &GridOptions, res: &Resources) -> Result<(JobScript, JobScript)> {
    let bin = std::env::current_exe().map_err(|e| Error::io("<this phaselens executable>", e))?;
    let bin = slurm_path(&bin, "the phaselens executable", false)?;
    let cwd = std::env::current_dir().map_err(|e| Error::io("<current directory>", e))?;
    let cwd = slurm_path(&cwd, "the current directory", false)?;
    let logs = slurm_path(&state_dir(grid).join("logs"), "the grid's log folder", true)?;
    let common = format!(
        "--plain --device {} --data-dir {} --reports-dir {}",
        opts.device,
        quote(&slurm_path(&opts.data_root, "--data-dir", false)?),
        quote(&slurm_path(&opts.reports_root, "--reports-dir", false)?)
    );
    let gridp = quote(&slurm_path(&grid.path, "the grid file", false)?);
    let job = |what: &str, name: String, out: &str, directives: &[String], cmd: String| {
        let options = vec![
            format!("--job-name={name}"),
            format!("--output={}", logs.join(out).display()),
            format!("--chdir={}", cwd.display()),
        ];
        let mut s = format!(
            "#!/bin/bash\n# Generated by `phaselens grid --slurm` for grid `{}`: {what}.\n\
             # Submitted with: sbatch {} ...\n",
            grid.name,
            options
                .iter()
                .map(|o| shell_word(o))
                .collect::<Vec<_>>()
                .join(" ")
        );
        for d in directives {
            s.push_str(&format!("#SBATCH {d}\n"));
        }
        s.push_str("set -euo pipefail\n");
        s.push_str(&cmd);
        JobScript { text: s, options }
    };
    let array = job(
        "one array task per design",
        format!("phaselens-grid-{}", grid.name),
        "%A_%a.out",
        &res.directives(),
        format!(
            "exec {} grid task {gridp} --index \"$SLURM_ARRAY_TASK_ID\" {common}\n",
            quote(&bin)
        ),
    );
    let merge = job(
        "merge every finished design",
        format!("phaselens-grid-{}-merge", grid.name),
        "merge-%j.out",
        &res.directives()
            .into_iter()
            .filter(|d| !d.starts_with("--cpus-per-task"))
            .collect::<Vec<_>>(),
        format!("exec {} grid merge {gridp} {common}\n", quote(&bin)),
    );
    Ok((array, merge))
}

pub(crate) fn run_tool(cmd: &mut Command) -> Result<String> {
    let name = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().map_err(|e| {
        Error::Other(if e.kind() == std::io::ErrorKind::NotFound {
            format!(
                "`{name}` not found: --slurm needs a Slurm cluster (scripts/slurm/start.sh starts a single-node one)"
            )
        } else {
            format!("running {name}: {e}")
        })
    })?;
    if !out.status.success() {
        return Err(Error::Other(format!(
            "{name} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`.
pub(crate) fn job_id(out: &str) -> Result<String> {
    let id = out.trim().split(';').next().unwrap_or("").to_string();
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
        return Err(Error::Other(format!("sbatch printed no job id: {out:?}")));
    }
    Ok(id)
}

/// Submit the unfinished designs (all selected ones, or with `resume` those that are
/// neither finished nor queued/running) as one array job, plus a merge job after it.
///
/// Every setting is checked before anything is written. The array job's id is recorded
/// in `jobs.json` as soon as sbatch accepts it, before the merge job is submitted: a
/// refused merge job leaves a recorded array (which `status` and `--resume` see), and a
/// later `--resume` submits the missing merge job. With `resume`, a controller that
/// does not answer is an error: nothing is resubmitted while the queue is unknown.
pub fn submit(
    grid: &Grid,
    opts: &GridOptions,
    res: &Resources,
    only: &[String],
    resume: bool,
    dry_run: bool,
) -> Result<Submitted> {
    res.check()?;
    super::task::check_sweeps(grid)?;
    for n in only {
        grid.design(n)?;
    }
    let (array, merge) = scripts(grid, opts, res)?;
    let (todo, waiting) = to_submit(grid, opts, only, resume)?;
    if todo.is_empty() {
        if resume
            && !dry_run
            && let Some(sub) = merge_missing(grid, &merge)?
        {
            return Ok(Submitted::Jobs(sub));
        }
        return Ok(Submitted::Nothing { queued: waiting });
    }
    let state = state_dir(grid);
    let indices: Vec<usize> = todo.iter().map(|d| d.index).collect();
    let mut spec = indices
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    if let Some(m) = res.max_parallel {
        spec.push_str(&format!("%{m}"));
    }
    let array_path = state.join("array.sbatch");
    let merge_path = state.join("merge.sbatch");
    // A grid folder made by this call holds only generated recipes and scripts: it
    // goes again if nothing is submitted.
    let mut new = crate::output::leftovers::NewDirs::note(&[]).remove_all_unless_kept(&grid.dir);
    let array_args = sbatch_args(&array.options, &format!("--array={spec}"), &array_path);
    let merge_args = sbatch_args(
        &merge.options,
        "--dependency=afterany:<array job>",
        &merge_path,
    );
    write_recipes(grid)?;
    std::fs::create_dir_all(state.join("logs")).map_err(|e| Error::io(&state, e))?;
    write_bytes_atomic(&array_path, array.text.as_bytes())
        .map_err(|e| Error::io(&array_path, e))?;
    write_bytes_atomic(&merge_path, merge.text.as_bytes())
        .map_err(|e| Error::io(&merge_path, e))?;
    if dry_run {
        new.keep();
        let line = |a: &[String]| {
            let words: Vec<String> = a.iter().map(|w| shell_word(w)).collect();
            format!("sbatch {}", words.join(" "))
        };
        return Ok(Submitted::DryRun {
            commands: vec![line(&array_args), line(&merge_args)],
        });
    }
    let array_job = job_id(&run_tool(Command::new("sbatch").args(&array_args))?)?;
    let mut sub = Submission {
        array_job,
        merge_job: None,
        indices,
        designs: todo.iter().map(|d| d.name.clone()).collect(),
        submitted_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        script: array_path,
        logs: absolute(&state.join("logs"))?,
    };
    new.keep();
    record_submission(grid, &sub)?;
    sub.merge_job = Some(submit_merge(grid, &sub, &merge)?);
    Ok(Submitted::Jobs(sub))
}

/// `sbatch --parsable EXTRA OPTIONS SCRIPT`.
pub(crate) fn sbatch_args(options: &[String], extra: &str, script: &Path) -> Vec<String> {
    let mut a = vec!["--parsable".to_string(), extra.to_string()];
    a.extend(options.iter().cloned());
    a.push(script.display().to_string());
    a
}

/// Submit the merge job after `sub`'s array job and record its id; a refusal says
/// that the array job is recorded and how to get the merge.
fn submit_merge(grid: &Grid, sub: &Submission, merge: &JobScript) -> Result<String> {
    let path = state_dir(grid).join("merge.sbatch");
    let args = sbatch_args(
        &merge.options,
        &format!("--dependency=afterany:{}", sub.array_job),
        &path,
    );
    let id = run_tool(Command::new("sbatch").args(&args))
        .and_then(|out| job_id(&out))
        .map_err(|e| {
            Error::Other(format!(
                "array job {} ({}) was accepted and is recorded in {}, but its merge job was not: {e}; \
                 `phaselens grid {} --slurm --resume` submits the missing merge job (or run `phaselens grid merge` when the array is done)",
                sub.array_job,
                sub.designs.join(", "),
                jobs_path(grid).display(),
                grid.path.display()
            ))
        })?;
    let mut all = submissions(grid)?;
    if let Some(s) = all.iter_mut().find(|s| s.array_job == sub.array_job) {
        s.merge_job = Some(id.clone());
    }
    write_submissions(grid, &all)?;
    Ok(id)
}

/// With nothing left to submit, the latest submission whose merge job was refused
/// gets one now (after its array job).
fn merge_missing(grid: &Grid, merge: &JobScript) -> Result<Option<Submission>> {
    let Some(mut sub) = submissions(grid)?.into_iter().next_back() else {
        return Ok(None);
    };
    if sub.merge_job.is_some() {
        return Ok(None);
    }
    sub.merge_job = Some(submit_merge(grid, &sub, merge)?);
    Ok(Some(sub))
}

/// The designs [`submit`] runs (after checking `only` and writing every recipe), and
/// those left out because they are already queued or running (with `resume`).
fn to_submit<'g>(
    grid: &'g Grid,
    opts: &GridOptions,
    only: &[String],
    resume: bool,
) -> Result<(Vec<&'g Design>, Vec<String>)> {
    let queued = if resume {
        queued_designs(grid)?
    } else {
        Default::default()
    };
    let mut waiting = Vec::new();
    let todo: Vec<&Design> = grid
        .designs
        .iter()
        .filter(|d| only.is_empty() || only.contains(&d.name))
        .filter(|d| opts.fresh || finished(grid, d, opts).is_none())
        .filter(|d| {
            let q = queued.contains(&d.index);
            if q {
                waiting.push(d.name.clone());
            }
            !q
        })
        .collect();
    Ok((todo, waiting))
}

/// Append `sub` to the grid's submission record (`jobs.json`).
fn record_submission(grid: &Grid, sub: &Submission) -> Result<()> {
    let mut all = submissions(grid)?;
    all.push(sub.clone());
    write_submissions(grid, &all)
}

/// Replace the grid's submission record (atomic).
fn write_submissions(grid: &Grid, all: &[Submission]) -> Result<()> {
    let p = jobs_path(grid);
    write_bytes_atomic(
        &p,
        serde_json::to_string_pretty(all)
            .expect("serialises")
            .as_bytes(),
    )
    .map_err(|e| Error::io(&p, e))
}

/// One job (or array task) as Slurm reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobState {
    /// `123`, `123_4`.
    pub id: String,
    /// PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    pub state: String,
    pub elapsed: String,
    /// Where it came from: `squeue`, `sacct` or `scontrol`.
    pub source: &'static str,
}

/// Pending and running jobs among `ids` (`squeue -r`, one line per array task), or
/// why the queue is unknown (squeue missing, the controller not answering).
fn squeue(ids: &[String]) -> std::result::Result<Vec<JobState>, String> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let out = Command::new("squeue")
        .args(["-h", "-r", "-o", "%i|%T|%M", "-j"])
        .arg(ids.join(","))
        .output()
        .map_err(|e| format!("running squeue: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // squeue exits non-zero with "Invalid job id" when every id has left the queue;
    // any other failure (no controller, a timeout) leaves the queue unknown.
    if !out.status.success() && !stderr.to_lowercase().contains("invalid job id") {
        return Err(format!("squeue failed ({}): {}", out.status, stderr.trim()));
    }
    Ok(parse_rows(&String::from_utf8_lossy(&out.stdout), "squeue"))
}

/// Recent jobs among `ids` as slurmctld still holds them (`scontrol -o show job`, for
/// `MinJobAge` seconds after they end), one entry per array task (`123_4`).
fn scontrol(ids: &[String]) -> Vec<JobState> {
    let mut out = Vec::new();
    for id in ids {
        let Ok(o) = Command::new("scontrol")
            .args(["-o", "show", "job", id])
            .output()
        else {
            return out;
        };
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            out.extend(parse_scontrol(line));
        }
    }
    out
}

fn parse_scontrol(line: &str) -> Option<JobState> {
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|t| t.strip_prefix(k)?.strip_prefix('='))
            .map(str::to_string)
    };
    let id = match (field("ArrayJobId"), field("ArrayTaskId")) {
        (Some(a), Some(t)) if t.chars().all(|c| c.is_ascii_digit()) => format!("{a}_{t}"),
        (Some(a), Some(t)) => format!("{a}_[{t}]"),
        _ => field("JobId")?,
    };
    Some(JobState {
        id,
        state: field("JobState")?,
        elapsed: field("RunTime").unwrap_or_default(),
        source: "scontrol",
    })
}

/// Jobs among `ids` from Slurm's accounting (`sacct`), if the cluster keeps it.
fn sacct(ids: &[String]) -> (Vec<JobState>, Option<String>) {
    if ids.is_empty() {
        return (Vec::new(), None);
    }
    match Command::new("sacct")
        .args(["-n", "-P", "-X", "-o", "JobID,State,Elapsed", "-j"])
        .arg(ids.join(","))
        .output()
    {
        Ok(o) if o.status.success() => (
            parse_rows(&String::from_utf8_lossy(&o.stdout), "sacct"),
            None,
        ),
        Ok(o) => (
            Vec::new(),
            Some(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        ),
        Err(e) => (Vec::new(), Some(format!("sacct: {e}"))),
    }
}

fn parse_rows(text: &str, source: &'static str) -> Vec<JobState> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.trim().split('|');
            let id = f.next()?.trim().to_string();
            let state = f.next()?.split_whitespace().next()?.to_string();
            let elapsed = f.next().unwrap_or("").trim().to_string();
            (!id.is_empty()).then_some(JobState {
                id,
                state,
                elapsed,
                source,
            })
        })
        .collect()
}

/// The array index of a task id `123_4` of job `123`.
fn task_index(id: &str, job: &str) -> Option<usize> {
    id.strip_prefix(job)?.strip_prefix('_')?.parse().ok()
}

/// Design indices with a pending or running task in any of this grid's submissions.
/// A pending array shows as `123_[4-6]` in squeue even with -r until it starts, so
/// bracket ranges are expanded.
fn queued_designs(grid: &Grid) -> Result<std::collections::BTreeSet<usize>> {
    let subs = submissions(grid)?;
    let ids: Vec<String> = subs.iter().map(|s| s.array_job.clone()).collect();
    let mut out = std::collections::BTreeSet::new();
    let queue = squeue(&ids).map_err(|e| {
        Error::Other(format!(
            "cannot tell which designs are queued or running ({e}); nothing was submitted, \
             so no design runs twice: retry `--resume` when Slurm answers (`phaselens grid status {}`)",
            grid.path.display()
        ))
    })?;
    for j in queue {
        for s in &subs {
            if let Some(i) = task_index(&j.id, &s.array_job) {
                out.insert(i);
            } else if let Some(rest) =
                j.id.strip_prefix(&s.array_job)
                    .and_then(|r| r.strip_prefix("_["))
            {
                out.extend(expand_ranges(rest.trim_end_matches(']')));
            }
        }
    }
    Ok(out)
}

/// `1,3-5%2` -> 1, 3, 4, 5.
fn expand_ranges(s: &str) -> Vec<usize> {
    let s = s.split('%').next().unwrap_or("");
    let mut v = Vec::new();
    for part in s.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    v.extend(a..=b);
                }
            }
            None => v.extend(part.parse::<usize>().ok()),
        }
    }
    v
}

/// How far a design got, from its files: `done`, `sweeps 2/7`, `step 750/2000`,
/// `not started`.
pub fn design_progress(grid: &Grid, d: &Design, opts: &GridOptions) -> String {
    if finished(grid, d, opts).is_some() {
        return "done".into();
    }
    let recipe = d.recipe_path(&grid.dir);
    let Ok(file) = d.organism(&grid.dir) else {
        return "invalid recipe".into();
    };
    let steps = file.train.steps;
    let trained = file.model_dir(&recipe).join("training.json").exists();
    if trained {
        let data = opts.design_data_dir(grid, d);
        let specs = eval_specs(grid, &file);
        let n = specs
            .iter()
            .filter(|s| data.join(&s.name).join("done.json").exists())
            .count();
        return format!("trained; sweeps {n}/{}", specs.len());
    }
    match latest_checkpoint(&OrganismFile::run_dir(&file, &recipe)) {
        Ok(Some((_, m))) => format!("step {}/{steps}", m.step),
        _ => "not started".into(),
    }
}

/// `phaselens grid status`: each design's Slurm state and progress.
#[derive(Debug, Clone)]
pub struct StatusReport {
    pub rows: Vec<(usize, String, String, String)>,
    pub merge: Vec<(String, String)>,
    pub notes: Vec<String>,
}

impl fmt::Display for StatusReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:>3}  {:<24} {:<22} progress", "idx", "design", "slurm")?;
        for (i, name, state, progress) in &self.rows {
            writeln!(f, "{i:>3}  {name:<24} {state:<22} {progress}")?;
        }
        for (id, state) in &self.merge {
            writeln!(f, "merge job {id}: {state}")?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}

const FAILED: [&str; 7] = [
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
];

/// Whether `id` (`123_4` or `123`) is one of `jobs`' rows: the same id, or a task of a
/// pending array line `123_[2-5]`.
fn row_of<'a>(jobs: &'a [JobState], id: &str) -> Option<&'a JobState> {
    jobs.iter().find(|j| j.id == id).or_else(|| {
        let (job, task) = id.split_once('_')?;
        let task: usize = task.parse().ok()?;
        jobs.iter().find(|j| {
            j.id.strip_prefix(job)
                .and_then(|r| r.strip_prefix("_["))
                .is_some_and(|r| expand_ranges(r.trim_end_matches(']')).contains(&task))
        })
    })
}

/// Each design's Slurm state, read in this order: `squeue` (pending and running tasks),
/// `sacct` (finished, failed and cancelled ones, where the cluster keeps accounting),
/// and, for the ids neither knows (a cluster without accounting), `scontrol show job`
/// (which holds finished jobs for slurmctld's `MinJobAge`). The latest submission of a
/// design decides its state.
pub fn status(grid: &Grid, opts: &GridOptions) -> Result<StatusReport> {
    let subs = submissions(grid)?;
    let mut latest: BTreeMap<usize, &Submission> = BTreeMap::new();
    for s in &subs {
        for &i in &s.indices {
            latest.insert(i, s);
        }
    }
    // The ids status needs: each design's latest task and every merge job.
    let task_id = |i: usize| latest.get(&i).map(|s| format!("{}_{i}", s.array_job));
    let mut wanted: Vec<String> = grid
        .designs
        .iter()
        .filter_map(|d| task_id(d.index))
        .collect();
    wanted.extend(subs.iter().filter_map(|s| s.merge_job.clone()));
    let (known, acct_error) = Known::query(&subs, &wanted);
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    let mut no_record = 0;
    for d in &grid.designs {
        let state = match task_id(d.index) {
            None => "not submitted".to_string(),
            Some(id) => match known.state_of(&id) {
                Some(st) => format!("{id} {st}"),
                None if known.queue_error.is_some() => format!("{id} (unknown)"),
                None => {
                    no_record += 1;
                    format!("{id} (no record)")
                }
            },
        };
        let progress = design_progress(grid, d, opts);
        if FAILED.iter().any(|f| state.contains(f)) && progress != "done" {
            failed.push(d.name.clone());
        }
        rows.push((d.index, d.name.clone(), state, progress));
    }
    let merge = subs
        .iter()
        .map(|s| match &s.merge_job {
            None => (
                format!("after {}", s.array_job),
                "not submitted (sbatch refused it; `--slurm --resume` submits it)".into(),
            ),
            Some(m) => (
                m.clone(),
                known.state_of(m).unwrap_or_else(|| {
                    no_record += 1;
                    "(no record)".into()
                }),
            ),
        })
        .collect();
    let acct_error = acct_error.filter(|_| !subs.is_empty());
    let mut notes = Vec::new();
    if let Some(e) = &known.queue_error {
        notes.push(format!(
            "the queue is unknown ({e}): pending and running jobs cannot be told apart from lost ones; `--slurm --resume` refuses to submit until squeue answers"
        ));
    }
    notes.extend(status_notes(grid, acct_error, no_record, &failed));
    Ok(StatusReport { rows, merge, notes })
}

/// What Slurm knows of the submitted jobs: `squeue`'s rows, `sacct`'s, and
/// `scontrol`'s for the ids neither knows.
struct Known {
    queue: Vec<JobState>,
    /// Why `squeue` gave no answer, if it failed.
    queue_error: Option<String>,
    acct: Vec<JobState>,
    recent: Vec<JobState>,
}

impl Known {
    /// Ask Slurm about every job of `subs`, for the `wanted` ids; also returns why
    /// `sacct` gave nothing, if it failed.
    fn query(subs: &[Submission], wanted: &[String]) -> (Known, Option<String>) {
        let mut jobs: Vec<String> = Vec::new();
        for s in subs {
            for j in std::iter::once(&s.array_job).chain(&s.merge_job) {
                if !jobs.contains(j) {
                    jobs.push(j.clone());
                }
            }
        }
        let (queue, queue_error) = match squeue(&jobs) {
            Ok(q) => (q, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let (acct, acct_error) = sacct(&jobs);
        let unresolved = |id: &String| row_of(&queue, id).is_none() && row_of(&acct, id).is_none();
        let mut fallback: Vec<String> = Vec::new();
        for id in wanted.iter().filter(|id| unresolved(id)) {
            let job = id.split('_').next().unwrap_or(id).to_string();
            if !fallback.contains(&job) {
                fallback.push(job);
            }
        }
        let recent = scontrol(&fallback);
        (
            Known {
                queue,
                queue_error,
                acct,
                recent,
            },
            acct_error,
        )
    }

    /// The state of job or task `id` (with its elapsed time when its own row has
    /// one), or `None` when no source has it.
    fn state_of(&self, id: &str) -> Option<String> {
        let j = row_of(&self.queue, id)
            .or_else(|| row_of(&self.acct, id))
            .or_else(|| row_of(&self.recent, id))?;
        Some(if j.elapsed.is_empty() || j.id != id {
            j.state.clone()
        } else {
            format!("{} {}", j.state, j.elapsed)
        })
    }
}

/// The notes under the status table: no accounting (`acct_error`, with how many ids
/// had no record) and the designs that failed.
fn status_notes(
    grid: &Grid,
    acct_error: Option<String>,
    no_record: usize,
    failed: &[String],
) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(e) = acct_error {
        notes.push(if no_record > 0 {
            format!(
                "no accounting ({e}): finished jobs come from scontrol, which forgets them after slurmctld's MinJobAge; the others show as (no record), their progress column still holds"
            )
        } else {
            format!("no accounting ({e}): finished jobs read from scontrol")
        });
    }
    if !failed.is_empty() {
        notes.push(format!(
            "{} design(s) failed or were cancelled ({}): resubmit them with `phaselens grid {} --slurm --resume`",
            failed.len(),
            failed.join(", "),
            grid.path.display()
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_output_parsing() {
        assert_eq!(job_id("4242\n").unwrap(), "4242");
        assert_eq!(job_id("4242;cluster\n").unwrap(), "4242");
        assert!(job_id("Submitted batch job 1").is_err());
        assert_eq!(expand_ranges("1,3-5%2"), vec![1, 3, 4, 5]);
        assert_eq!(task_index("12_7", "12"), Some(7));
        assert_eq!(task_index("123_7", "12"), None);
        let rows = parse_rows(
            "12_0|COMPLETED|00:00:09\n12_1|CANCELLED by 0|00:00:03\n",
            "sacct",
        );
        assert_eq!(rows[1].state, "CANCELLED");
        assert_eq!(rows[0].elapsed, "00:00:09");
        let j = parse_scontrol("JobId=3 ArrayJobId=1 ArrayTaskId=1 JobName=t UserId=root(0) JobState=CANCELLED Reason=None RunTime=00:00:02").unwrap();
        assert_eq!(
            (j.id.as_str(), j.state.as_str(), j.elapsed.as_str()),
            ("1_1", "CANCELLED", "00:00:02")
        );
        let j =
            parse_scontrol("JobId=7 JobName=m JobState=PENDING Reason=Dependency RunTime=00:00:00")
                .unwrap();
        assert_eq!(j.id, "7");
        assert_eq!(
            parse_scontrol("JobId=9 ArrayJobId=9 ArrayTaskId=2-4 JobState=PENDING")
                .unwrap()
                .id,
            "9_[2-4]"
        );
        // A task is found by its own line or inside a pending array line.
        let q = parse_rows("9_[2-4%2]|PENDING|0:00\n9_1|RUNNING|0:07\n", "squeue");
        assert_eq!(row_of(&q, "9_1").unwrap().state, "RUNNING");
        assert_eq!(row_of(&q, "9_3").unwrap().state, "PENDING");
        assert!(row_of(&q, "9_5").is_none() && row_of(&q, "19_3").is_none());
        assert!(row_of(&q, "9").is_none());
    }

    #[test]
    fn command_line_resources_override_the_grid_file() {
        let file = SlurmConfig {
            partition: Some("cpu".into()),
            mem: Some("4G".into()),
            sbatch_args: vec!["--qos=low".into()],
            ..SlurmConfig::default()
        };
        let r = Resources {
            mem: Some("8G".into()),
            ..Resources::default()
        }
        .over(&file);
        assert_eq!(
            r.directives(),
            vec![
                "--partition=cpu",
                "--cpus-per-task=1",
                "--mem=8G",
                "--qos=low"
            ]
        );
    }
}
