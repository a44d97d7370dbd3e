//! `phaselens run EXP --shard i/N`: parts of one run computed apart (as array tasks
//! would), then a run without a part loads every part's shards and writes tables equal
//! to those of the same run done in one process.

use std::path::Path;

use phaselens::output::{Table, read_long_rows};
use phaselens::runner::{RunOptions, run_experiment};

use crate::common::runner::*;

pub(crate) const PATCH: &str = r#"
[experiment]
kind = "patch-heads"
bootstrap_reps = 30

[model]
organism = "tiny"

[task]
n_logical = 6
"#;

/// The rows of every table of `dir` (`notebooks-data/<name>/*.arrow`), as text (NaN
/// equals NaN), by table name.
fn tables(dir: &Path) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = files_with(dir, "arrow")
        .into_iter()
        .map(|p| {
            let t = Table::read_arrow(&p).unwrap();
            let rows = read_long_rows(&t)
                .unwrap()
                .iter()
                .map(|r| format!("{r:?}"))
                .collect();
            (p.file_name().unwrap().to_string_lossy().into_owned(), rows)
        })
        .collect();
    out.sort();
    out
}

/// Run `exp` whole in `one`, and in `n` parts + a merge in `parts`; the tables must
/// be equal and the merge must compute nothing.
fn parts_merge_to_the_whole(exp_text: &str, setup: &dyn Fn(&Path), n: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let (one, parts) = (tmp.path().join("one"), tmp.path().join("parts"));
    for d in [&one, &parts] {
        std::fs::create_dir_all(d).unwrap();
        setup(d);
    }
    let whole = run_experiment(&experiment(&one, "e.toml", exp_text), &opts(&one)).unwrap();
    assert!(whole.stats.cells_computed > 0);
    let exp = experiment(&parts, "e.toml", exp_text);
    let mut computed = 0;
    for i in 0..n {
        let o = RunOptions {
            shard: Some((i, n)),
            ..opts(&parts)
        };
        let s = run_experiment(&exp, &o).unwrap();
        assert!(s.tables.is_empty(), "part {i} wrote tables");
        assert!(s.figures.is_empty(), "part {i} drew figures");
        computed += s.stats.cells_computed;
        // A part's rerun resumes its own shards.
        let again = run_experiment(&exp, &o).unwrap();
        assert_eq!(again.stats.cells_computed, 0, "part {i} rerun");
    }
    assert_eq!(
        computed, whole.stats.cells_computed,
        "the parts compute each unit once"
    );
    let merged = run_experiment(&exp, &opts(&parts)).unwrap();
    assert_eq!(merged.stats.cells_computed, 0, "the merge loads every part");
    let data = |root: &Path| root.join("notebooks-data").join(&whole.name);
    let (a, b) = (tables(&data(&one)), tables(&data(&parts)));
    assert!(!a.is_empty());
    assert_eq!(a, b, "merged tables differ from the one-process run");
}

#[test]
fn patch_heads_in_three_parts_merges_to_the_local_tables() {
    let setup = |d: &Path| {
        organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 5);
    };
    parts_merge_to_the_whole(PATCH, &setup, 3);
}

#[test]
fn indexer_diagnostics_in_two_parts_merges_to_the_local_tables() {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4/flash");
    let text = format!(
        "[experiment]\nkind = \"indexer-diagnostics\"\nbootstrap_reps = 30\n\n[model]\npath = \"{}\"\n\n[task]\nvocab = {{ kind = \"synthetic\" }}\nprompt = {{ n_bindings = 8, n_queries = 2 }}\nperiod = 8\nn_logical = 4\n",
        fixture.display()
    );
    parts_merge_to_the_whole(&text, &|_| {}, 2);
}

#[test]
fn a_part_runs_beside_another_part_of_the_same_experiment() {
    // Parts take their own locks: part 1 runs while part 0's lock is held.
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 5);
    let exp = experiment(d, "e.toml", PATCH);
    let name = "e";
    let held = phaselens::output::lock::RunLock::acquire(
        &d.join("notebooks-data")
            .join(name)
            .join(".lock-shard-0-of-2"),
        "test",
    )
    .unwrap();
    let o = RunOptions {
        shard: Some((1, 2)),
        ..opts(d)
    };
    run_experiment(&exp, &o).unwrap();
    // The same part twice at once is refused.
    let o0 = RunOptions {
        shard: Some((0, 2)),
        ..opts(d)
    };
    assert!(run_experiment(&exp, &o0).is_err());
    drop(held);
}

#[test]
fn slurm_runs_the_parts_as_an_array_and_merges_to_the_local_tables() {
    use crate::grid_common::{phaselens, text};
    let Some(cluster) = crate::grid_slurm::Cluster::start() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (one, parts) = (tmp.path().join("one"), tmp.path().join("parts"));
    for d in [&one, &parts] {
        std::fs::create_dir_all(d).unwrap();
        organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 5);
        experiment(d, "e.toml", PATCH);
    }
    let o = phaselens(&one, &["run", "e.toml", "--no-figures", "--plain"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let env = cluster.env();
    let o = phaselens(
        &parts,
        &[
            "run",
            "e.toml",
            "--slurm",
            "--shards",
            "3",
            "--time",
            "30:00",
            "--no-figures",
        ],
        &env,
    );
    assert!(o.status.success(), "{}", text(&o));
    let (array, merge) = crate::grid_slurm::job_ids(&text(&o));
    cluster.wait(&[&array, &merge]);
    let logs = parts.join("notebooks-data/e/slurm/logs");
    let log = |f: &str| std::fs::read_to_string(logs.join(f)).unwrap_or_default();
    for i in 0..3 {
        let l = log(&format!("{array}_{i}.out"));
        assert!(l.contains(&format!("part {i}/3 done")), "task {i}: {l}");
    }
    let m = log(&format!("merge-{merge}.out"));
    assert!(
        m.contains("0 cells computed"),
        "the merge computed cells: {m}"
    );
    let data = |root: &Path| root.join("notebooks-data/e");
    assert_eq!(tables(&data(&one)), tables(&data(&parts)));
}
