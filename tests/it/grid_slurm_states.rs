//! The Slurm submission state machine against stand-in `sbatch` / `squeue` / `sacct` /
//! `scontrol` (shell scripts first on PATH) that accept, refuse and lose contact:
//! every job id sbatch accepted is recorded before the next submission, nothing is
//! resubmitted while the queue is unknown, paths with spaces and quotes reach the job
//! intact, and settings that make no sense are refused before anything is written.
//! A seeded random walk over accept / refuse / lose-contact / jobs-ending checks the
//! invariants after every step. Runs anywhere, no Slurm or root needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::grid_common::{EVAL, grid_dir, phaselens, text};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The stand-ins' state lives in one folder:
/// - `plan`: one line per coming sbatch call, `ok` or `refuse` (empty: `ok`);
/// - `queue`: squeue's rows (`ID_I|PENDING|0:00`), extended by every accepted job;
/// - `down`: when present, squeue cannot reach the controller;
/// - `accepted`: every id sbatch printed (the ground truth of what Slurm holds);
/// - `calls`: every call with its arguments.
struct Stand {
    dir: tempfile::TempDir,
    path: String,
}

impl Stand {
    fn new() -> Stand {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let sbatch = format!(
            r#"plan=$(head -n1 {d}/plan 2>/dev/null); sed -i '1d' {d}/plan 2>/dev/null
if [ -f {d}/down ]; then
  echo "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)" >&2
  exit 1
fi
if [ "$plan" = refuse ]; then
  echo "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified" >&2
  exit 1
fi
n=$(cat {d}/next 2>/dev/null || echo 100); echo $((n + 1)) > {d}/next
echo "$n" >> {d}/accepted
array=""
for a in "$@"; do case "$a" in --array=*) array="${{a#--array=}}";; esac; done
if [ -n "$array" ]; then
  for i in $(echo "${{array%%\%*}}" | tr ',' ' '); do echo "${{n}}_$i|PENDING|0:00" >> {d}/queue; done
else
  echo "$n|PENDING|0:00" >> {d}/queue
fi
echo "$n""#
        );
        let squeue = format!(
            r#"if [ -f {d}/down ]; then
  echo "squeue: error: slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2
  exit 1
fi
ids="${{@: -1}}"; out=""
for id in $(echo "$ids" | tr ',' ' '); do
  out="$out$(grep -E "^${{id}}(_|\|)" {d}/queue 2>/dev/null)
"
done
out=$(echo "$out" | sed '/^$/d')
if [ -z "$out" ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi
echo "$out""#
        );
        let scripts = [
            ("sbatch", sbatch),
            ("squeue", squeue),
            (
                "sacct",
                "echo 'Slurm accounting storage is disabled' >&2; exit 1".to_string(),
            ),
            ("scontrol", "exit 0".to_string()),
        ];
        for (tool, body) in scripts {
            let p = dir.path().join(tool);
            std::fs::write(
                &p,
                format!("#!/bin/bash\necho \"{tool} $*\" >> {d}/calls\n{body}\n"),
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let path = format!("{d}:{}", std::env::var("PATH").unwrap_or_default());
        Stand { dir, path }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.file(name)).unwrap_or_default()
    }

    fn plan(&self, steps: &[&str]) {
        std::fs::write(self.file("plan"), steps.join("\n") + "\n").unwrap();
    }

    fn down(&self, down: bool) {
        if down {
            std::fs::write(self.file("down"), "").unwrap();
        } else {
            let _ = std::fs::remove_file(self.file("down"));
        }
    }

    /// The calls since the last look.
    fn take_calls(&self) -> String {
        let s = self.read("calls");
        let _ = std::fs::remove_file(self.file("calls"));
        s
    }

    fn env(&self) -> [(&str, &str); 1] {
        [("PATH", self.path.as_str())]
    }
}

/// Every job id the grid's `jobs.json` records (array and merge).
fn recorded(grid_dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(grid_dir.join("slurm/jobs.json")).unwrap_or_default();
    if text.is_empty() {
        return Vec::new();
    }
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut ids = Vec::new();
    for s in v.as_array().unwrap() {
        ids.push(s["array_job"].as_str().unwrap().to_string());
        if let Some(m) = s["merge_job"].as_str() {
            ids.push(m.to_string());
        }
    }
    ids
}

const DESIGNS: &str =
    "[[design]]\nname = \"a\"\n[[design]]\nname = \"b\"\n[[design]]\nname = \"c\"\n";

#[test]
fn a_refused_merge_job_leaves_the_accepted_array_recorded_and_resume_submits_only_the_merge() {
    let s = Stand::new();
    let (dir, _) = grid_dir(&format!("{DESIGNS}{EVAL}"));
    let d = dir.path();
    s.plan(&["ok", "refuse"]);
    let o = phaselens(d, &["grid", "grid.toml", "--slurm"], &s.env());
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("array job 100 (a, b, c) was accepted and is recorded")
            && out.contains("--slurm --resume")
            && !out.contains("panicked"),
        "{out}"
    );
    assert_eq!(recorded(&d.join("grid")), ["100"]);
    // status sees the running array and says the merge job is missing.
    let st = text(&phaselens(d, &["grid", "status", "grid.toml"], &s.env()));
    assert!(
        st.contains("100_0 PENDING") && st.contains("100_2 PENDING"),
        "{st}"
    );
    assert!(st.contains("merge job after 100: not submitted"), "{st}");
    // --resume submits the merge job only (the designs are queued).
    s.take_calls();
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &s.env());
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let calls = s.take_calls();
    assert_eq!(calls.matches("sbatch ").count(), 1, "{calls}");
    assert!(
        calls.contains("sbatch --parsable --dependency=afterany:100 "),
        "{calls}"
    );
    assert!(out.contains("merge job 101"), "{out}");
    assert_eq!(recorded(&d.join("grid")), ["100", "101"]);
    // And then there is nothing left to do.
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &s.env());
    assert!(text(&o).contains("nothing to submit"), "{}", text(&o));
    assert!(!s.take_calls().contains("sbatch "));
}

#[test]
fn resume_while_the_controller_is_unreachable_submits_nothing_and_says_so() {
    let s = Stand::new();
    let (dir, _) = grid_dir(&format!("{DESIGNS}{EVAL}"));
    let d = dir.path();
    let o = phaselens(d, &["grid", "grid.toml", "--slurm"], &s.env());
    assert!(o.status.success(), "{}", text(&o));
    s.down(true);
    s.take_calls();
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &s.env());
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("cannot tell which designs are queued or running")
            && out.contains("Unable to contact slurm controller")
            && out.contains("nothing was submitted"),
        "{out}"
    );
    assert!(!s.take_calls().contains("sbatch "));
    let st = text(&phaselens(d, &["grid", "status", "grid.toml"], &s.env()));
    assert!(
        st.contains("100_0 (unknown)") && st.contains("the queue is unknown"),
        "{st}"
    );
    assert!(!st.contains("not submitted"), "{st}");
    // Contact back: the queued designs are still not resubmitted.
    s.down(false);
    let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &s.env());
    assert!(text(&o).contains("nothing to submit"), "{}", text(&o));
}

#[test]
fn a_refused_first_submission_leaves_no_grid_folder_behind() {
    let s = Stand::new();
    let (dir, _) = grid_dir(&format!("{DESIGNS}{EVAL}"));
    let d = dir.path();
    s.plan(&["refuse"]);
    let o = phaselens(d, &["grid", "grid.toml", "--slurm"], &s.env());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("Batch job submission failed"),
        "{}",
        text(&o)
    );
    assert!(
        !d.join("grid").exists(),
        "generated recipes and scripts were left behind"
    );
}

#[test]
fn grid_folders_with_spaces_and_quotes_reach_the_job_intact() {
    let s = Stand::new();
    let (dir, _) = grid_dir(&format!("{DESIGNS}{EVAL}"));
    let odd = dir.path().join("my grids/it's \"here\"");
    std::fs::create_dir_all(&odd).unwrap();
    for f in ["base.toml", "grid.toml"] {
        std::fs::rename(dir.path().join(f), odd.join(f)).unwrap();
    }
    // --dry-run and the real submission agree, and both succeed.
    let o = phaselens(
        &odd,
        &["grid", "grid.toml", "--slurm", "--dry-run"],
        &s.env(),
    );
    assert!(o.status.success(), "{}", text(&o));
    let dry = text(&o);
    assert!(
        dry.contains("'--output="),
        "the log path is quoted for the shell: {dry}"
    );
    let o = phaselens(&odd, &["grid", "grid.toml", "--slurm"], &s.env());
    assert!(o.status.success(), "{}", text(&o));
    let calls = s.take_calls();
    let logs = odd.join("grid/slurm/logs");
    assert!(
        calls.contains(&format!("--output={}/%A_%a.out", logs.display())),
        "{calls}"
    );
    let script = odd.join("grid/slurm/array.sbatch");
    let body = std::fs::read_to_string(&script).unwrap();
    assert!(!body.contains("#SBATCH --output"), "{body}");
    let check = std::process::Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check));
    // Run the job script as Slurm would, for a task index past the designs: the task
    // loads the grid (so its path arrived as one intact argument) and names the index.
    let run = std::process::Command::new("bash")
        .arg(&script)
        .env("SLURM_ARRAY_TASK_ID", "7")
        .current_dir(&odd)
        .output()
        .unwrap();
    let out = text(&run);
    assert!(
        !run.status.success() && out.contains("design index 7 out of range (0..3)"),
        "{out}"
    );
}

#[test]
fn slurm_resources_and_sweep_settings_that_make_no_sense_are_refused_before_anything_is_written() {
    let s = Stand::new();
    type Case = (&'static str, &'static [&'static str], &'static str);
    let c = |body: &'static str, extra: &'static [&'static str], want: &'static str| -> Case {
        (body, extra, want)
    };
    let cases: Vec<Case> = vec![
        c("[slurm]\ncpus_per_task = 0\n", &[], "cpus_per_task"),
        c(
            "[slurm]\nmem = \"lots\"\n",
            &[],
            "`lots` is not a memory size",
        ),
        c("[slurm]\nmem = \"0G\"\n", &[], "memory size"),
        c("[slurm]\nmax_parallel = 0\n", &[], "max_parallel"),
        c("[slurm]\ntime = \"soon\"\n", &[], "time limit"),
        c("[slurm]\ntime = \"1:2:3:4\"\n", &[], "time limit"),
        c("[slurm]\npartition = \"a b\"\n", &[], "partition"),
        c(
            "[slurm]\nsbatch_args = [\"account=lab\"]\n",
            &[],
            "sbatch option",
        ),
        c(
            "[slurm]\nsbatch_args = [\"--comment=a b\"]\n",
            &[],
            "sbatch option",
        ),
        c("", &["--mem", "4 G"], "memory size"),
        c("", &["--max-parallel", "0"], "max_parallel"),
        c("", &["--time", "never"], "time limit"),
    ];
    let mut bad = Vec::new();
    for (body, extra, want) in &cases {
        for dry in [false, true] {
            let (dir, _) = grid_dir(&format!("{DESIGNS}{EVAL}{body}"));
            let d = dir.path();
            let mut args = vec!["grid", "grid.toml", "--slurm"];
            args.extend_from_slice(extra);
            if dry {
                args.push("--dry-run");
            }
            let o = phaselens(d, &args, &s.env());
            let out = text(&o);
            if o.status.code() != Some(1)
                || !out.contains(want)
                || out.contains("panicked")
                || d.join("grid").exists()
            {
                bad.push(format!(
                    "{body:?} {extra:?} dry={dry}: exit {:?}: {out}",
                    o.status.code()
                ));
            }
        }
    }
    assert!(
        !s.take_calls().contains("sbatch "),
        "nothing may be submitted"
    );
    // Sweep settings fail `grid list` (and every other grid command), not each task.
    let evals = [
        ("bootstrap_reps = 0", "bootstrap_reps"),
        ("bootstrap_reps = 100000000", "bootstrap_reps"),
        ("n_logical = 1000000000", "n_logical"),
        ("detail_n_logical = 1000000000", "n_logical"),
    ];
    for (line, want) in evals {
        let e = EVAL
            .lines()
            .filter(|l| !l.starts_with(line.split(' ').next().unwrap()))
            .collect::<Vec<_>>()
            .join("\n");
        let (dir, _) = grid_dir(&format!("{DESIGNS}{e}\n{line}\n"));
        for cmd in [
            &["grid", "list", "grid.toml"][..],
            &["grid", "grid.toml", "--slurm", "--dry-run"][..],
        ] {
            let o = phaselens(dir.path(), cmd, &s.env());
            let out = text(&o);
            if o.status.code() != Some(1) || !out.contains(want) || dir.path().join("grid").exists()
            {
                bad.push(format!(
                    "[eval] {line} / {cmd:?}: exit {:?}: {out}",
                    o.status.code()
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} cases failed:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// One step of the random walk: the stand-ins' behaviour for the next `--resume`.
#[derive(Debug)]
struct Step {
    plan: Vec<&'static str>,
    down: bool,
    /// Queue rows that end (leave the queue) before the step.
    ending: usize,
}

#[test]
fn seeded_random_walk_over_accept_refuse_and_lost_contact_keeps_every_job_recorded() {
    let s = Stand::new();
    let (dir, _) = grid_dir(&format!("{DESIGNS}{EVAL}"));
    let d = dir.path();
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let mut log = Vec::new();
    for round in 0..24 {
        let pick = |rng: &mut ChaCha8Rng| if rng.random_bool(0.7) { "ok" } else { "refuse" };
        let step = Step {
            plan: vec![pick(&mut rng), pick(&mut rng)],
            down: rng.random_bool(0.25),
            ending: rng.random_range(0..3),
        };
        // Some jobs end (they leave squeue; no files: the designs stay unfinished).
        let queue = s.read("queue");
        let mut rows: Vec<&str> = queue.lines().collect();
        for _ in 0..step.ending.min(rows.len()) {
            let i = rng.random_range(0..rows.len());
            rows.remove(i);
        }
        std::fs::write(
            s.file("queue"),
            rows.join("\n") + if rows.is_empty() { "" } else { "\n" },
        )
        .unwrap();
        s.plan(&step.plan);
        s.down(step.down);
        s.take_calls();
        let before = recorded(&d.join("grid"));
        let o = phaselens(d, &["grid", "grid.toml", "--slurm", "--resume"], &s.env());
        let out = text(&o);
        let calls = s.take_calls();
        log.push(format!(
            "round {round}: {step:?} -> exit {:?}",
            o.status.code()
        ));
        let ctx = || format!("{}\n{out}\n{calls}", log.join("\n"));
        assert!(!out.contains("panicked"), "{}", ctx());
        // Never a submission while the queue of recorded jobs is unknown.
        if step.down && !before.is_empty() {
            assert!(!calls.contains("sbatch "), "{}", ctx());
        }
        // Every id Slurm accepted is recorded.
        let accepted: Vec<String> = s.read("accepted").lines().map(str::to_string).collect();
        let rec = recorded(&d.join("grid"));
        for id in &accepted {
            assert!(
                rec.contains(id),
                "accepted job {id} is not in jobs.json\n{}",
                ctx()
            );
        }
        // No design is queued twice.
        let mut per_design: BTreeMap<String, usize> = BTreeMap::new();
        for row in s.read("queue").lines() {
            if let Some((_, task)) = row.split('|').next().unwrap().split_once('_') {
                *per_design.entry(task.to_string()).or_default() += 1;
            }
        }
        assert!(
            per_design.values().all(|&n| n <= 1),
            "{per_design:?}\n{}",
            ctx()
        );
    }
    // The walk visited every kind of step.
    let all = log.join("\n");
    assert!(
        all.contains("refuse") && all.contains("down: true"),
        "{all}"
    );
}
