//! `phaselens grid --slurm` on a real single-node Slurm started by
//! scripts/slurm/start.sh: a tiny grid of three designs as one array job plus a
//! dependent merge job; one task is killed mid-training, `grid status` reports it,
//! and `--slurm --resume` resubmits only that design, which resumes from its
//! checkpoint. Skipped (with a message) where Slurm is not installed or the test does
//! not run as root; CI installs Slurm (scripts/setup-slurm.sh) and runs it.
//!
//! The order in which `grid status` reads Slurm (squeue, then sacct, then scontrol for
//! what neither knows) is tested with stand-in tools on PATH, since the test cluster
//! has no accounting database: that test runs everywhere.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::grid_common::{EVAL, grid_dir, phaselens, text};
use phaselens::output::Table;

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// A cluster of this test's own (own state dir and ports), stopped on drop.
pub(crate) struct Cluster {
    state: tempfile::TempDir,
    conf: String,
}

impl Cluster {
    pub(crate) fn start() -> Option<Cluster> {
        let installed = ["slurmctld", "slurmd", "munged", "sbatch"].iter().all(|b| {
            Command::new("sh")
                .args(["-c", &format!("command -v {b} || test -x /usr/sbin/{b}")])
                .output()
                .is_ok_and(|o| o.status.success())
        });
        if !installed {
            eprintln!(
                "SKIPPED: Slurm is not installed (slurmctld, slurmd, munged, sbatch); \
                 `bash scripts/setup-slurm.sh` installs it (CI does)"
            );
            return None;
        }
        let uid = Command::new("id").arg("-u").output().unwrap();
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            eprintln!("SKIPPED: starting slurmd needs root (scripts/slurm/start.sh)");
            return None;
        }
        let state = tempfile::Builder::new()
            .prefix("pl-slurm-")
            .tempdir()
            .unwrap();
        let o = Command::new("bash")
            .arg(format!("{REPO}/scripts/slurm/start.sh"))
            .arg(state.path())
            .env("PHASELENS_SLURMCTLD_PORT", "16837")
            .env("PHASELENS_SLURMD_PORT", "16838")
            .output()
            .unwrap();
        assert!(o.status.success(), "start.sh failed:\n{}", text(&o));
        let conf = state.path().join("slurm.conf").display().to_string();
        assert!(
            text(&o).contains(&format!("export SLURM_CONF={conf}")),
            "{}",
            text(&o)
        );
        Some(Cluster { state, conf })
    }

    pub(crate) fn env(&self) -> [(&str, &str); 1] {
        [("SLURM_CONF", self.conf.as_str())]
    }

    fn run(&self, tool: &str, args: &[&str]) -> String {
        let o = Command::new(tool)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .output()
            .unwrap();
        text(&o)
    }

    /// Wait until none of `jobs` is pending or running. The deadline only guards
    /// against a hung cluster; it is not a speed assertion.
    pub(crate) fn wait(&self, jobs: &[&str]) {
        let t0 = Instant::now();
        loop {
            let q = self.run("squeue", &["-h", "-o", "%i %T", "-j", &jobs.join(",")]);
            if q.trim().is_empty() || q.contains("Invalid job id") {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(1200),
                "jobs {jobs:?} still queued after 20 minutes:\n{q}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn logs(&self) -> String {
        let log = self.state.path().join("log");
        ["slurmctld.log", "slurmd.log"]
            .iter()
            .map(|f| std::fs::read_to_string(log.join(f)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(format!("{REPO}/scripts/slurm/stop.sh"))
            .arg(self.state.path())
            .output();
    }
}

/// `submitted array job A ... and merge job M` -> (A, M).
pub(crate) fn job_ids(out: &str) -> (String, String) {
    let after = |key: &str| {
        out.split(key)
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no `{key}` in {out}"))
            .to_string()
    };
    (after("array job "), after("merge job "))
}

fn latest_checkpoint(run: &Path) -> Option<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("meta.json").exists())
        .collect();
    v.sort();
    v.pop()
}

#[test]
fn slurm_grid_runs_end_to_end_and_a_killed_task_resumes() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    // Two quick designs and a long one, which is killed after its first checkpoint.
    let (dir, _) = grid_dir(&format!(
        "[[design]]\nname = \"a\"\n\
         [[design]]\nname = \"b\"\nset = {{ seed = 1, kv_heads = 2 }}\n\
         [[design]]\nname = \"long\"\nset = {{ steps = 1500, \"train.checkpoint_every\" = 20 }}\n\
         [slurm]\ncpus_per_task = 1\n{EVAL}"
    ));
    // The grid lives in a folder whose path has a space and a quote: job scripts,
    // log paths and the working directory must all survive it.
    let spaced = dir.path().join("grid folder's copy");
    std::fs::create_dir(&spaced).unwrap();
    for f in ["base.toml", "grid.toml"] {
        std::fs::rename(dir.path().join(f), spaced.join(f)).unwrap();
    }
    let d = spaced.as_path();
    let env = cluster.env();
    let o = phaselens(
        d,
        &["grid", "grid.toml", "--slurm", "--time", "30:00"],
        &env,
    );
    assert!(o.status.success(), "{}", text(&o));
    let (array, merge) = job_ids(&text(&o));
    assert!(text(&o).contains("3 task(s)"), "{}", text(&o));

    // Kill the long design's task (array index 2) mid-training.
    let run = d.join("grid/long/run");
    let t0 = Instant::now();
    while latest_checkpoint(&run).is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(1200),
            "no checkpoint of long after 20 minutes\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let killed = format!("{array}_2");
    cluster.run("scancel", &[&killed]);
    cluster.wait(&[&array, &merge]);
    let at_kill = latest_checkpoint(&run).unwrap();
    assert!(
        !d.join("grid/long/model/model.safetensors").exists(),
        "killed before the end"
    );

    // status: the killed task, the finished ones, the merge job, the hint.
    let o = phaselens(d, &["grid", "status", "grid.toml"], &env);
    let st = text(&o);
    assert!(o.status.success(), "{st}");
    assert!(st.contains(&format!("{killed} CANCELLED")), "{st}");
    assert!(st.contains(&format!("{array}_0 COMPLETED")), "{st}");
    assert!(
        st.contains(&format!("merge job {merge}: COMPLETED")),
        "{st}"
    );
    assert!(st.contains("--slurm --resume"), "{st}");
    // This cluster keeps no accounting: sacct says so and scontrol fills in.
    assert!(st.contains("no accounting"), "{st}");
    let line = st.lines().find(|l| l.contains(" long ")).unwrap();
    assert!(line.contains("step "), "{line}");
    // The merge after the array merged the three finished designs.
    let t = Table::read_arrow(d.join("notebooks-data/grids/grid/grid_summary.arrow")).unwrap();
    let mut merged: Vec<String> = t
        .utf8("design")
        .unwrap()
        .iter()
        .flatten()
        .cloned()
        .collect();
    merged.dedup();
    assert_eq!(merged, ["a", "b"]);

    // --resume submits only the killed design; it continues from its checkpoint.
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &env);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("1 task(s): long"), "{}", text(&o));
    let (array2, merge2) = job_ids(&text(&o));
    cluster.wait(&[&array2, &merge2]);
    let log = std::fs::read_to_string(d.join(format!("grid/slurm/logs/{array2}_2.out"))).unwrap();
    let step: u64 = at_kill
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_start_matches("step-")
        .parse()
        .unwrap();
    assert!(
        log.contains(&format!("long: resumed from step {step}")),
        "{log}"
    );
    assert!(d.join("grid/long/model/model.safetensors").exists());
    let o = phaselens(d, &["grid", "status", "grid.toml"], &env);
    let st = text(&o);
    assert_eq!(st.matches(" done").count(), 3, "{st}");
    assert!(st.contains(&format!("{array2}_2 COMPLETED")), "{st}");
    let t = Table::read_arrow(d.join("notebooks-data/grids/grid/grid_summary.arrow")).unwrap();
    let mut merged: Vec<String> = t
        .utf8("design")
        .unwrap()
        .iter()
        .flatten()
        .cloned()
        .collect();
    merged.dedup();
    assert_eq!(merged, ["a", "b", "long"]);
    assert!(d.join("reports/grids/grid/report.md").exists());

    // Nothing left to resubmit.
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &env);
    assert!(text(&o).contains("nothing to submit"), "{}", text(&o));
}

/// Stand-ins for sbatch, squeue, sacct and scontrol (shell scripts first on PATH) that
/// log their arguments and print what the test put in `<dir>/<tool>.out`
/// (`scontrol-<job>.out` for `scontrol show job <job>`); sacct without its file
/// answers like a cluster without accounting. Runs anywhere, no root needed.
struct FakeSlurm {
    dir: tempfile::TempDir,
    path: String,
}

impl FakeSlurm {
    fn new() -> FakeSlurm {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let scripts = [
            (
                "sbatch",
                format!(
                    "n=$(cat {d}/next 2>/dev/null || echo 100); echo $((n + 1)) > {d}/next; echo \"$n\""
                ),
            ),
            ("squeue", format!("cat {d}/squeue.out 2>/dev/null; exit 0")),
            (
                "sacct",
                format!(
                    "[ -f {d}/sacct.out ] || {{ echo 'Slurm accounting storage is disabled' >&2; exit 1; }}; cat {d}/sacct.out"
                ),
            ),
            (
                "scontrol",
                format!("f={d}/scontrol-\"${{@: -1}}\".out; [ -f \"$f\" ] && cat \"$f\"; exit 0"),
            ),
        ];
        for (tool, body) in scripts {
            let p = dir.path().join(tool);
            std::fs::write(
                &p,
                format!("#!/bin/bash\necho \"{tool} $*\" >> {d}/calls.log\n{body}\n"),
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let path = format!("{d}:{}", std::env::var("PATH").unwrap_or_default());
        FakeSlurm { dir, path }
    }

    fn set(&self, file: &str, body: Option<&str>) {
        let p = self.dir.path().join(file);
        match body {
            Some(b) => std::fs::write(p, b).unwrap(),
            None => {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    /// The calls logged since the last `take_calls`.
    fn take_calls(&self) -> String {
        let p = self.dir.path().join("calls.log");
        let s = std::fs::read_to_string(&p).unwrap_or_default();
        let _ = std::fs::remove_file(p);
        s
    }
}

fn status_line<'a>(st: &'a str, design: &str) -> &'a str {
    st.lines()
        .find(|l| l.split_whitespace().nth(1) == Some(design))
        .unwrap_or_else(|| panic!("no line for {design}:\n{st}"))
}

#[test]
fn status_reads_squeue_then_sacct_then_scontrol_and_resume_resubmits_failed_tasks() {
    let fake = FakeSlurm::new();
    let (dir, _) = grid_dir(&format!(
        "[[design]]\nname = \"a\"\n[[design]]\nname = \"b\"\n\
         [[design]]\nname = \"c\"\n[[design]]\nname = \"d\"\n{EVAL}"
    ));
    let d = dir.path();
    let env = [("PATH", fake.path.as_str())];
    let o = phaselens(d, &["grid", "grid.toml", "--slurm"], &env);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("array job 100 (4 task(s): a, b, c, d) and merge job 101"),
        "{}",
        text(&o)
    );
    let calls = fake.take_calls();
    assert!(
        calls.contains("sbatch --parsable --array=0,1,2,3 "),
        "{calls}"
    );
    assert!(
        calls.contains("sbatch --parsable --dependency=afterany:100 "),
        "{calls}"
    );

    // With accounting: squeue has the running and pending tasks, sacct the finished
    // ones; squeue wins where both know a task, and scontrol is not asked.
    fake.set(
        "squeue.out",
        Some("100_3|PENDING|0:00\n100_2|RUNNING|1:05\n101|PENDING|0:00\n"),
    );
    fake.set(
        "sacct.out",
        Some(
            "100_0|COMPLETED|00:02:00\n100_1|CANCELLED by 0|00:00:30\n\
             100_2|PENDING|00:00:00\n101|PENDING|00:00:00\n",
        ),
    );
    let o = phaselens(d, &["grid", "status", "grid.toml"], &env);
    let st = text(&o);
    assert!(o.status.success(), "{st}");
    assert!(
        status_line(&st, "a").contains("100_0 COMPLETED 00:02:00"),
        "{st}"
    );
    assert!(
        status_line(&st, "b").contains("100_1 CANCELLED 00:00:30"),
        "{st}"
    );
    assert!(status_line(&st, "c").contains("100_2 RUNNING 1:05"), "{st}");
    assert!(status_line(&st, "d").contains("100_3 PENDING"), "{st}");
    assert!(status_line(&st, "a").contains("not started"), "{st}");
    assert!(st.contains("merge job 101: PENDING"), "{st}");
    assert!(
        st.contains("1 design(s) failed or were cancelled (b)") && st.contains("--slurm --resume"),
        "{st}"
    );
    assert!(!st.contains("no accounting"), "{st}");
    let calls = fake.take_calls();
    assert!(
        calls.contains("squeue -h -r -o %i|%T|%M -j 100,101"),
        "{calls}"
    );
    assert!(
        calls.contains("sacct -n -P -X -o JobID,State,Elapsed -j 100,101"),
        "{calls}"
    );
    assert!(!calls.contains("scontrol"), "{calls}");

    // Without accounting: the tasks squeue does not list come from scontrol, asked only
    // for their job; the merge job squeue lists is not looked up again.
    fake.set("sacct.out", None);
    fake.set(
        "scontrol-100.out",
        Some(
            "JobId=102 ArrayJobId=100 ArrayTaskId=0 JobState=COMPLETED RunTime=00:02:00\n\
             JobId=100 ArrayJobId=100 ArrayTaskId=1 JobState=FAILED RunTime=00:00:04\n",
        ),
    );
    let o = phaselens(d, &["grid", "status", "grid.toml"], &env);
    let st = text(&o);
    assert!(
        status_line(&st, "a").contains("100_0 COMPLETED 00:02:00"),
        "{st}"
    );
    assert!(
        status_line(&st, "b").contains("100_1 FAILED 00:00:04"),
        "{st}"
    );
    assert!(status_line(&st, "c").contains("100_2 RUNNING 1:05"), "{st}");
    assert!(
        st.contains("no accounting (Slurm accounting storage is disabled)"),
        "{st}"
    );
    assert!(st.contains("failed or were cancelled (b)"), "{st}");
    let calls = fake.take_calls();
    assert!(calls.contains("scontrol -o show job 100\n"), "{calls}");
    assert!(!calls.contains("show job 101"), "{calls}");

    // A job both have forgotten is `(no record)`, and the note says why.
    fake.set("scontrol-100.out", None);
    let st = text(&phaselens(d, &["grid", "status", "grid.toml"], &env));
    assert!(status_line(&st, "b").contains("100_1 (no record)"), "{st}");
    assert!(st.contains("MinJobAge"), "{st}");

    // --resume submits what is neither finished (by its files) nor queued: a (its task
    // completed, yet the design has no files: a lost output folder) and the failed b;
    // c and d are still in the queue.
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &env);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("array job 102 (2 task(s): a, b) and merge job 103"),
        "{}",
        text(&o)
    );
    let calls = fake.take_calls();
    assert!(calls.contains("sbatch --parsable --array=0,1 "), "{calls}");
    // The latest submission decides: a and b are the new job's tasks now.
    fake.set(
        "squeue.out",
        Some("102_[0-1]|PENDING|0:00\n100_2|RUNNING|1:10\n100_3|PENDING|0:00\n"),
    );
    let st = text(&phaselens(d, &["grid", "status", "grid.toml"], &env));
    assert!(status_line(&st, "a").contains("102_0 PENDING"), "{st}");
    assert!(status_line(&st, "b").contains("102_1 PENDING"), "{st}");
    assert!(!st.contains("failed or were cancelled"), "{st}");
    // Everything unfinished is queued: nothing to submit.
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &env);
    assert!(
        text(&o).contains(
            "nothing to submit: the unfinished designs are queued or running: a, b, c, d"
        ),
        "{}",
        text(&o)
    );
}
