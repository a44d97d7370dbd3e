//! `phaselens grid`: grid files, design expansion, the local executor (the same code
//! path as `phaselens train` + `phase-sweep`), the merge, figures and report.

use std::path::Path;

use crate::grid_common::{EVAL, grid_dir, phaselens, text};
use phaselens::grid::Grid;
use phaselens::output::Table;

fn err_of(body: &str) -> String {
    let (_d, p) = grid_dir(body);
    Grid::load(&p).unwrap_err().to_string()
}

#[test]
fn grid_file_errors_name_the_file_line_and_key() {
    let e = err_of("[set]\nsteps = 4\n\"model.compression.windw\" = 8\n[axes]\nseed = [0]\n");
    assert!(
        e.contains("grid.toml") && e.contains("line 5") && e.contains("model.compression.windw"),
        "{e}"
    );
    let e = err_of("[axes]\nseed = [0]\nW = [\"eight\"]\n");
    assert!(e.contains("line 5") && e.contains("key `W`"), "{e}");
    let e = err_of("bsae = 1\n[axes]\nseed = [0]\n");
    assert!(e.contains("line 3") && e.contains("bsae"), "{e}");
    let e = err_of("[axes]\nseed = []\n");
    assert!(e.contains("line 4") && e.contains("empty"), "{e}");
    let e = err_of("[[design]]\nname = \"a\"\n[[design]]\nname = \"a\"\n");
    assert!(
        e.contains("line 6") && e.contains("two designs are named `a`"),
        "{e}"
    );
    let e = err_of("[[design]]\nname = \"Big\"\n");
    assert!(
        e.contains("line 4") && e.contains("design name `Big`"),
        "{e}"
    );
    // A stride the evaluation period does not cover names the design and the fix.
    let e = err_of("[[design]]\nname = \"s3\"\nset = { W = 3, S = 3 }\n");
    assert!(e.contains("design `s3`") && e.contains("period"), "{e}");
    // Values that fail only together (W < S) are the design's error, with its line.
    let e = err_of("[[design]]\nname = \"bad\"\nset = { S = 8, period = 8 }\n");
    assert!(
        e.contains("line 4") && e.contains("design `bad`") && e.contains("window"),
        "{e}"
    );
    let e = err_of("[set]\n\"organism.name\" = \"x\"\n[axes]\nseed = [0]\n");
    assert!(
        e.contains("line 4") && e.contains("[organism] is set by the grid"),
        "{e}"
    );
    let e = err_of("[[design]]\nname = \"a\"\nsett = { S = 4 }\n");
    assert!(e.contains("line 5") && e.contains("sett"), "{e}");
    let e = err_of("");
    assert!(e.contains("[axes] or [[design]]"), "{e}");
}

#[test]
fn designs_are_the_explicit_list_crossed_with_the_axes_in_file_order() {
    let (dir, p) = grid_dir(
        "[set]\nquery_sampling = \"with_replacement\"\n\
         [axes]\nseed = [0, 1]\ngate_bias = [true, false]\n\
         [[design]]\nname = \"w4\"\n[[design]]\nname = \"kv2\"\nset = { kv_heads = 2 }\n",
    );
    let g = Grid::load(&p).unwrap();
    let names: Vec<&str> = g.designs.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "w4-seed0-bias-on",
            "w4-seed0-bias-off",
            "w4-seed1-bias-on",
            "w4-seed1-bias-off",
            "kv2-seed0-bias-on",
            "kv2-seed0-bias-off",
            "kv2-seed1-bias-on",
            "kv2-seed1-bias-off"
        ]
    );
    assert_eq!(g.columns, ["seed", "gate_bias", "kv_heads"]);
    let d = &g.designs[7];
    assert_eq!(d.index, 7);
    let f = d.organism(&g.dir).unwrap();
    let phaselens::train::ModelConfig::Kvc(m) = &f.model else {
        panic!("kvc")
    };
    assert_eq!(m.n_kv_heads, 2);
    assert!(!m.compression.as_ref().unwrap().gate_bias);
    // `seed` sets the init seed and the data seed.
    assert_eq!((f.train.seed, f.task.train.seed), (1, 1));
    assert_eq!(
        f.task.train.prompt.query_sampling,
        phaselens::tasks::QuerySampling::WithReplacement
    );
    assert_eq!(f.organism.name, "kv2-seed1-bias-off");
    assert_eq!(d.value("kv_heads"), Some(&toml::Value::Integer(2)));
    assert_eq!(
        g.designs[0].value("kv_heads"),
        Some(&toml::Value::Integer(1))
    );
    assert_eq!(g.dir, dir.path().join("grid"));
    // The same file gives the same designs and recipes.
    let again = Grid::load(&p).unwrap();
    for (a, b) in g.designs.iter().zip(&again.designs) {
        assert_eq!(a.recipe_text(&g.path), b.recipe_text(&again.path));
    }
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let r =
        phaselens::model::safetensors_io::SafetensorsReader::open(&dir.join("model.safetensors"))
            .unwrap();
    let mut v: Vec<(String, Vec<f32>)> = r
        .names()
        .map(|n| (n.to_string(), r.read_f32(n).unwrap().1))
        .collect();
    v.sort_by(|x, y| x.0.cmp(&y.0));
    v
}

fn run_grid(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["grid", "grid.toml", "--local", "--plain"];
    args.extend_from_slice(extra);
    let o = phaselens(dir, &args, &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    t
}

#[test]
fn local_grid_trains_sweeps_merges_and_resumes() {
    let (dir, _) = grid_dir(&format!(
        "paper = \"The paper: none for this grid.\"\n\
         [axes]\nseed = [0, 1]\n\
         [[design]]\nname = \"a\"\npaper = \"n/a\"\n\
         [[design]]\nname = \"b\"\nset = {{ kv_heads = 2, steps = 12, period = 4 }}\nnote = \"two KV heads\"\n{EVAL}"
    ));
    let d = dir.path();
    let out = run_grid(d, &[]);
    assert!(out.contains("[4/4] b-seed1"), "{out}");
    // Each design: recipe, model, checkpoints, eval experiments, sweeps, record.
    for name in ["a-seed0", "a-seed1", "b-seed0", "b-seed1"] {
        let g = d.join("grid").join(name);
        for f in [
            "recipe.toml",
            "model/model.safetensors",
            "model/training.json",
            "run/checkpoints",
            "eval/final.toml",
            "eval/slot-3.toml",
            "eval/bindings-4.toml",
        ] {
            assert!(g.join(f).exists(), "{name}: {f}");
        }
        let data = d.join("notebooks-data/grids/grid").join(name);
        assert!(data.join("design.json").exists(), "{name}");
        assert!(data.join("final").join(name).join("summary.json").exists());
        assert!(!data.join("final/shards").exists(), "shards are dropped");
    }
    // One long table: 4 designs x (final: 2 protocols + slot-3 + bindings-4) x 4 phases.
    let data = d.join("notebooks-data/grids/grid");
    let t = Table::read_arrow(data.join("grid.arrow")).unwrap();
    assert_eq!(t.num_rows(), 4 * 4 * 4);
    for c in [
        "protocol",
        "phase",
        "n",
        "correct",
        "accuracy",
        "wilson_lo",
        "wilson_hi",
        "design",
        "eval",
        "n_bindings",
        "query_slot",
        "seed",
        "kv_heads",
        "steps",
        "period",
    ] {
        assert!(t.column_names().contains(&c), "{c}: {:?}", t.column_names());
    }
    assert_eq!(t.metadata()["phaselens.schema"], "grid_phase_accuracy/v1");
    let kv = t.int64("kv_heads").unwrap();
    let des = t.utf8("design").unwrap();
    for (k, n) in kv.iter().zip(des) {
        let n = n.as_deref().unwrap();
        assert_eq!(*k, Some(if n.starts_with('b') { 2 } else { 1 }), "{n}");
    }
    let s = Table::read_arrow(data.join("grid_summary.arrow")).unwrap();
    assert_eq!(s.num_rows(), 4 * 4);
    assert!(s.column_names().contains(&"phase_gap_pp"));
    assert!(data.join("grid.parquet").exists() && data.join("grid_summary.parquet").exists());
    let rep = d.join("reports/grids/grid");
    for f in [
        "phase_gap.png",
        "phase_gap.svg",
        "accuracy_by_phase.png",
        "accuracy_by_slot.png",
        "accuracy_by_bindings.png",
        "seed_variance_0.png",
        "seed_variance_1.png",
        "report.md",
        "report.html",
    ] {
        assert!(rep.join(f).exists(), "{f}");
    }
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    for s in [
        "b-seed1",
        "The paper: none for this grid.",
        "two KV heads",
        "What each design learned",
        "slot = 3",
        "N = 4",
        "Seed variance",
    ] {
        assert!(md.contains(s), "{s}");
    }

    // A second run trains nothing and sweeps nothing.
    let model = d.join("grid/a-seed0/model/model.safetensors");
    let before = std::fs::metadata(&model).unwrap().modified().unwrap();
    let out = run_grid(d, &[]);
    assert_eq!(out.matches(": done").count(), 4, "{out}");
    assert!(!out.contains("checkpoint saved"), "{out}");
    assert_eq!(
        std::fs::metadata(&model).unwrap().modified().unwrap(),
        before
    );

    // A lost merged table is rebuilt from the cached parts, identical.
    let first = Table::read_arrow(data.join("grid.arrow")).unwrap();
    std::fs::remove_file(data.join("grid.arrow")).unwrap();
    let o = phaselens(d, &["grid", "merge", "grid.toml", "--plain"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("merged 4 design(s)"));
    let again = Table::read_arrow(data.join("grid.arrow")).unwrap();
    assert_eq!(first.columns(), again.columns());
}

#[test]
fn a_design_trains_as_phaselens_train_does() {
    // The grid writes a recipe and trains it through the library's `train`: the model
    // is the one `phaselens train` makes from the same recipe.
    let (dir, _) = grid_dir(&format!(
        "[[design]]\nname = \"one\"\nset = {{ query_sampling = \"with_replacement\" }}\n{EVAL}"
    ));
    let d = dir.path();
    run_grid(d, &[]);
    let recipe = d.join("grid/one/recipe.toml");
    let copy = d.join("copy.toml");
    let text_ = std::fs::read_to_string(&recipe)
        .unwrap()
        .replace("model_dir = \"model\"", "model_dir = \"copy-model\"")
        .replace("run_dir = \"run\"", "run_dir = \"copy-run\"");
    std::fs::write(&copy, text_).unwrap();
    let o = phaselens(d, &["train", "copy.toml"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    // Equal up to float summation order: two `phaselens train` runs of one recipe can
    // differ in the last bits (the backend's gradient accumulation order varies between
    // processes); another seed or recipe differs by orders of magnitude more.
    let a = weights(&d.join("copy-model"));
    let b = weights(&d.join("grid/one/model"));
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        let diff = va
            .iter()
            .zip(vb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "{na}: max |diff| {diff}");
    }
}

#[test]
fn an_interrupted_design_resumes_from_its_checkpoint() {
    let (dir, _) = grid_dir(&format!("[[design]]\nname = \"one\"\n{EVAL}"));
    let d = dir.path();
    // Train 8 of 12 steps through the recipe the grid writes, as a killed task would.
    let o = phaselens(d, &["grid", "list", "grid.toml"], &[]);
    assert!(
        o.status.success() && text(&o).contains("not started"),
        "{}",
        text(&o)
    );
    let g = Grid::load(&d.join("grid.toml")).unwrap();
    phaselens::grid::write_recipes(&g).unwrap();
    let o = phaselens(
        d,
        &["train", "grid/one/recipe.toml", "--max-steps", "8"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = phaselens(d, &["grid", "list", "grid.toml"], &[]);
    assert!(text(&o).contains("step 8/12"), "{}", text(&o));
    let out = run_grid(d, &[]);
    assert!(out.contains("one: resumed from step 8"), "{out}");
    let o = phaselens(d, &["grid", "list", "grid.toml"], &[]);
    assert!(text(&o).contains("done"), "{}", text(&o));
}

/// The report table's row of `design`.
fn row<'a>(md: &'a str, design: &str) -> &'a str {
    md.lines()
        .find(|l| l.starts_with(&format!("| {design} |")))
        .unwrap_or_else(|| panic!("no row for {design}:\n{md}"))
}

#[test]
fn a_partial_grid_merges_what_exists_and_lists_the_rest_as_not_trained() {
    let (dir, _) = grid_dir(&format!(
        "[[design]]\nname = \"one\"\n[[design]]\nname = \"two\"\nset = {{ seed = 1 }}\n\
         [[design]]\nname = \"three\"\nset = {{ seed = 2 }}\n{EVAL}"
    ));
    let d = dir.path();
    let report = d.join("reports/grids/grid/report.md");
    // Nothing trained: no tables, but a report that lists every design.
    let o = phaselens(d, &["grid", "merge", "grid.toml", "--plain"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("merged 0 design(s)"), "{}", text(&o));
    assert!(!d.join("notebooks-data/grids/grid/grid.arrow").exists());
    let md = std::fs::read_to_string(&report).unwrap();
    for n in ["one", "two", "three"] {
        assert!(
            row(&md, n).contains("| not trained (not started) |"),
            "{n}:\n{md}"
        );
    }
    // One design trained and swept, one killed at step 8 of 12, one not started.
    run_grid(d, &["--designs", "one"]);
    let o = phaselens(
        d,
        &["train", "grid/two/recipe.toml", "--max-steps", "8"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = phaselens(d, &["grid", "merge", "grid.toml", "--plain"], &[]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains(
            "merged 1 design(s); not in the tables yet: 2 \
             (two: not trained (step 8/12), three: not trained (not started))"
        ),
        "{out}"
    );
    let t = Table::read_arrow(d.join("notebooks-data/grids/grid/grid_summary.arrow")).unwrap();
    assert!(
        t.utf8("design")
            .unwrap()
            .iter()
            .all(|n| n.as_deref() == Some("one"))
    );
    let rep = d.join("reports/grids/grid");
    for f in [
        "phase_gap.png",
        "accuracy_by_phase.svg",
        "accuracy_by_slot.png",
    ] {
        assert!(rep.join(f).exists(), "{f}");
    }
    let md = std::fs::read_to_string(&report).unwrap();
    assert!(row(&md, "one").contains("| done |"), "{md}");
    assert!(
        row(&md, "two").contains("| not trained (step 8/12) |"),
        "{md}"
    );
    assert!(
        row(&md, "three").contains("| not trained (not started) |"),
        "{md}"
    );
    assert!(
        md.contains("Not in the tables, figures or comparisons yet (2 of 3)"),
        "{md}"
    );
    assert!(
        md.contains("two: not trained (step 8/12); nothing measured yet."),
        "{md}"
    );
    assert!(md.contains("one: "), "{md}");
}

#[test]
fn slurm_without_slurm_is_a_clear_error() {
    let (dir, _) = grid_dir(&format!("[[design]]\nname = \"one\"\n{EVAL}"));
    let o = phaselens(
        dir.path(),
        &[
            "grid",
            "grid.toml",
            "--slurm",
            "--dry-run",
            "--time",
            "01:00:00",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("sbatch --parsable --array=0"),
        "{}",
        text(&o)
    );
    let script = std::fs::read_to_string(dir.path().join("grid/slurm/array.sbatch")).unwrap();
    assert!(script.contains("#SBATCH --time=01:00:00"), "{script}");
    assert!(script.contains("grid task"), "{script}");
    // With no sbatch on PATH the error says what is needed.
    let o = phaselens(
        dir.path(),
        &["grid", "grid.toml", "--slurm"],
        &[("PATH", "/nonexistent")],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("`sbatch` not found"), "{}", text(&o));
}

#[test]
fn slot_sweeps_ask_distinct_bindings_before_the_target() {
    let (dir, p) = grid_dir(&format!(
        "[[design]]\nname = \"r\"\nset = {{ query_sampling = \"with_replacement\" }}\n{EVAL}"
    ));
    let g = Grid::load(&p).unwrap();
    phaselens::grid::write_recipes(&g).unwrap();
    let d = &g.designs[0];
    let f = d.organism(&g.dir).unwrap();
    let specs = phaselens::grid::task::eval_specs(&g, &f);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["final", "slot-3", "bindings-4"]);
    let exp = |name: &str| {
        let s = specs.iter().find(|s| s.name == name).unwrap();
        let text = phaselens::grid::task::experiment_text(&g, d, &f, s);
        let path = g.dir.join("r/eval").join(format!("{name}.toml"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        phaselens::runner::Experiment::load(&path).unwrap()
    };
    let slot = exp("slot-3").file.task.prompt.unwrap();
    assert_eq!(slot.n_queries, 3);
    assert_eq!(
        slot.query_sampling,
        phaselens::tasks::QuerySampling::Distinct
    );
    let fin = exp("final").file.task.prompt.unwrap();
    assert_eq!(fin.n_queries, 1);
    assert_eq!(
        fin.query_sampling,
        phaselens::tasks::QuerySampling::WithReplacement
    );
    assert_eq!(exp("bindings-4").file.task.prompt.unwrap().n_bindings, 4);
    drop(dir);
    // A slot beyond the bindings cannot ask distinct bindings.
    let (_d, p) =
        grid_dir(&format!("[[design]]\nname = \"x\"\n{EVAL}").replace("[1, 3]", "[1, 7]"));
    let e = Grid::load(&p).unwrap_err().to_string();
    assert!(e.contains("design `x`") && e.contains("slot 7"), "{e}");
}

#[test]
fn the_shipped_grid_files_load() {
    // Every design's recipe parses and validates (what `grid list` and the executors
    // check before anything runs).
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let g = Grid::load(&repo.join("experiments/grids/paper.toml")).unwrap();
    let names: Vec<&str> = g.designs.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names.len(), 25, "{names:?}");
    // Every design but the four-seed W8/S8 reference runs three seeds (0, 1, 2).
    assert!(
        names[4..]
            .chunks(3)
            .all(|c| c[1] == format!("{}-seed1", c[0]) && c[2] == format!("{}-seed2", c[0])),
        "{names:?}"
    );
    assert_eq!(
        &names[..4],
        ["w8s8-seed0", "w8s8-seed1", "w8s8-seed2", "w8s8-seed3"],
        "seeds first"
    );
    for d in &g.designs {
        let f = d.organism(&g.dir).unwrap();
        assert_eq!(f.train.steps, 2000, "{}", d.name);
    }
    let g = Grid::load(&repo.join("experiments/grids/elimination.toml")).unwrap();
    assert_eq!(g.designs.len(), 4);
}
