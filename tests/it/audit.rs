//! `phaselens audit`: end to end on the shipped organisms and a DeepSeek-V4 test
//! checkpoint, resume after an interruption, the errors before compute, and the
//! documented exit codes through the binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::runner::{organism, tiny};
use phaselens::audit::{AuditConfig, AuditRequest, resolve_target, run_audit};
use phaselens::device::DeviceSpec;
use phaselens::runner::ProgressMode;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn audit_cli(model: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .arg("audit")
        .arg(model)
        .arg("--out")
        .arg(out)
        .arg("--plain")
        .args(extra)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn certificate(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("audit.json")).unwrap()).unwrap()
}

fn request(model: &Path, out: &Path, cfg: AuditConfig) -> AuditRequest {
    AuditRequest {
        model: model.to_path_buf(),
        out: out.to_path_buf(),
        config: cfg,
        device: DeviceSpec::Cpu,
        progress: ProgressMode::Hidden,
        fresh: false,
    }
}

/// A small budget: enough for a 40 pp CI, no time limit (deterministic sizing).
fn small(prompts: usize) -> AuditConfig {
    let mut c = AuditConfig::default();
    c.budget.prompts = prompts;
    c.budget.time = None;
    c.audit.ci_width = Some(40.0);
    c.audit.bootstrap_reps = 200;
    c.audit.permutations = 200;
    c.audit.filler_instances = 8;
    c
}

#[test]
fn shipped_kvc_w8s8_fails_a_5pp_gate_with_exit_code_3_and_a_full_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("w8s8");
    let model = repo().join("experiments/organisms/kvc-w8s8");
    let o = audit_cli(
        &model,
        &out,
        &["--max-gap", "5pp", "--budget", "prompts=2700,time=none"],
    );
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("gate failed: max_gap"),
        "{}",
        stderr(&o)
    );
    // The default audit of a shipped organism is sized so that no part warns (the
    // filler probe's instances are not matched phase groups).
    assert!(!stderr(&o).contains("warning:"), "{}", stderr(&o));
    let c = certificate(&out);
    assert_eq!(c["schema"], "phaselens.audit");
    assert_eq!(c["schema_version"], 1);
    assert_eq!(c["verdict"], "fail");
    assert_eq!(c["exit_code"], 3);
    assert_eq!(c["geometry"]["strides"], serde_json::json!([8]));
    let part = &c["parts"][0];
    assert_eq!(part["period"], 8);
    assert_eq!(part["n_logical"], 128);
    let prefix = &part["protocols"][0];
    assert_eq!(prefix["protocol"], "prefix_padding");
    assert_eq!(prefix["per_phase"].as_array().unwrap().len(), 8);
    assert!(
        prefix["per_phase"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["n"] == 128)
    );
    // The organism's known weak phase: a binding that straddles a window boundary.
    assert_eq!(prefix["worst_phase"], 7);
    assert!(prefix["gap_pp"].as_f64().unwrap() > 5.0);
    assert!(prefix["gap_ci95"][0].as_f64().unwrap() > 5.0);
    assert!(prefix["flatness"]["p_value"].as_f64().unwrap() < 0.05);
    assert!(part["shift_invariance"]["flip_rate"].as_f64().unwrap() > 0.0);
    assert_eq!(part["filler"]["by_residue"].as_array().unwrap().len(), 8);
    for f in [
        "report.md",
        "report.html",
        "figures/accuracy_period-8.png",
        "figures/filler_period-8.png",
        "plan.json",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }
}

#[test]
fn shipped_full_attention_has_no_phase_runs_the_shift_test_only_and_passes_a_5pp_gate() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("full");
    let model = repo().join("experiments/organisms/full-attn");
    let o = audit_cli(
        &model,
        &out,
        &["--max-gap", "5pp", "--budget", "prompts=2700,time=none"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let c = certificate(&out);
    assert_eq!(c["verdict"], "pass");
    assert_eq!(c["geometry"]["compressed"], false);
    let parts = c["parts"].as_array().unwrap();
    assert_eq!(parts.len(), 1);
    assert_eq!(parts[0]["name"], "shift-8");
    assert_eq!(parts[0]["phased"], false);
    assert!(parts[0]["filler"].is_null());
    assert_eq!(parts[0]["protocols"].as_array().unwrap().len(), 1);
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("No chunked compression"), "{report}");
}

#[test]
fn deepseek_v4_test_checkpoint_is_audited_per_stride_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("v4");
    let model = repo().join("tests/fixtures/deepseek_v4/pro");
    let mut cfg = small(2400);
    cfg.gates.max_gap = Some(100.0);
    let o = run_audit(&request(&model, &out, cfg)).unwrap();
    let c = certificate(&out);
    // CSA rate 4 and HCA rate 16 (whose lcm is 16): one part each.
    assert_eq!(c["geometry"]["strides"], serde_json::json!([4, 16]));
    let periods: Vec<u64> = c["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["period"].as_u64().unwrap())
        .collect();
    assert_eq!(periods, vec![4, 16]);
    for part in c["parts"].as_array().unwrap() {
        let n = part["n_logical"].as_u64().unwrap();
        assert!(n >= 2, "{part}");
        for p in part["protocols"].as_array().unwrap() {
            for ph in p["per_phase"].as_array().unwrap() {
                assert_eq!(ph["n"].as_u64().unwrap(), n);
            }
        }
    }
    assert_eq!(o.exit_code, 0);
    assert!(o.certificate.forwards > 0);
}

#[test]
fn an_interrupted_audit_resumes_from_its_shards_and_gives_the_same_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipe = organism(d, "tiny-w4", &tiny(2, 2, 1, 4, 4), 3);
    let out = d.join("audit");
    let first = run_audit(&request(&recipe, &out, small(900))).unwrap();
    assert!(first.certificate.forwards > 0);
    let parts = |c: &phaselens::audit::Certificate| serde_json::to_value(&c.parts).unwrap();
    // Everything finished: a rerun computes nothing.
    let again = run_audit(&request(&recipe, &out, small(900))).unwrap();
    assert_eq!(again.certificate.forwards, 0);
    assert_eq!(parts(&again.certificate), parts(&first.certificate));
    // An interruption lost some shards: only those are recomputed.
    let mut shards: Vec<PathBuf> = walk(&out.join("shards"));
    shards.sort();
    assert!(shards.len() > 2, "{shards:?}");
    for s in shards.iter().step_by(2) {
        std::fs::remove_file(s).unwrap();
    }
    std::fs::remove_file(out.join("audit.json")).unwrap();
    let resumed = run_audit(&request(&recipe, &out, small(900))).unwrap();
    assert!(resumed.certificate.forwards > 0);
    assert!(resumed.certificate.forwards < first.certificate.forwards);
    assert_eq!(parts(&resumed.certificate), parts(&first.certificate));
    // Another request into the same folder is refused.
    let e = run_audit(&request(&recipe, &out, small(1000)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("other settings"), "{e}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            v.extend(walk(&p));
        } else {
            v.push(p);
        }
    }
    v
}

#[test]
fn errors_come_before_compute_with_exit_code_1_and_say_what_to_change() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A vocabulary too small for the synthetic token space (ids up to 128).
    let out = d.join("vocab");
    let o = audit_cli(
        &repo().join("tests/fixtures/deepseek_v4/ties_default"),
        &out,
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("vocabulary of 64"), "{}", stderr(&o));
    assert!(!out.join("shards").exists() && !out.join("audit.json").exists());
    // A model folder that does not load (config without weights).
    let broken = d.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(
        repo().join("experiments/organisms/kvc-w8s8/config.json"),
        broken.join("config.json"),
    )
    .unwrap();
    let o = audit_cli(&broken, &d.join("o1"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("does not load"), "{}", stderr(&o));
    // Not a model folder at all.
    let o = audit_cli(d, &d.join("o2"), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("no config.json"), "{}", stderr(&o));
    // A budget too small for the requested CI width.
    let w8s8 = repo().join("experiments/organisms/kvc-w8s8");
    let o = audit_cli(
        &w8s8,
        &d.join("o3"),
        &["--budget", "prompts=800", "--ci-width", "20pp"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("budget is too small") && e.contains("193 logical"),
        "{e}"
    );
    assert!(!d.join("o3/shards").exists());
    // Bad command lines are clap's exit code 2.
    let o = audit_cli(&w8s8, &d.join("o4"), &["--max-gap", "banana"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = audit_cli(&w8s8, &d.join("o5"), &["--budget", "tokens=5"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn without_gates_the_audit_measures_and_exits_0_and_a_toml_sets_the_gates() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipe = organism(d, "tiny-w4", &tiny(2, 2, 1, 4, 4), 5);
    let common = ["--budget", "prompts=1500,time=none", "--ci-width", "40pp"];
    let mut args = common.to_vec();
    args.extend(["--lengths", "64"]);
    let o = audit_cli(&recipe, &d.join("a"), &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let c = certificate(&d.join("a"));
    assert_eq!(c["verdict"], "no_gates");
    // The long-context test: one length under both protocols, every phase.
    let long = c["parts"][0]["long_context"].as_array().unwrap();
    assert_eq!(long.len(), 2, "{long:?}");
    assert_eq!(long[0]["length"], 64);
    assert_eq!(long[0]["per_phase"].as_array().unwrap().len(), 4);
    // A gate nothing can pass (worst phase at 101% is refused; 100% with a random
    // model fails): from the TOML, exit code 3.
    let toml = d.join("audit.toml");
    std::fs::write(
        &toml,
        "[gates]\nmin_worst_phase = \"100%\"\n[audit]\nfiller = false\n",
    )
    .unwrap();
    let mut args = common.to_vec();
    args.extend(["--config", toml.to_str().unwrap()]);
    let o = audit_cli(&recipe, &d.join("b"), &args);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let c = certificate(&d.join("b"));
    assert_eq!(c["gates"][0]["gate"], "min_worst_phase");
    assert!(c["parts"][0]["filler"].is_null());
    // A bad key in the TOML names file, line and key.
    std::fs::write(&toml, "[gates]\nmax_gapp = 5\n").unwrap();
    let o = audit_cli(&recipe, &d.join("c"), &["--config", toml.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("max_gapp") && stderr(&o).contains("audit.toml"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_grid_design_folder_is_audited_through_its_recipe() {
    // The README's `phaselens audit experiments/grids/mitigations/<design>-seed0`.
    let design = repo().join("experiments/grids/mitigations/w9s8-kv2-seed0");
    let t = resolve_target(&design).unwrap();
    assert_eq!(t.name, "w9s8-kv2-seed0");
    assert_eq!(t.dir, design.join("model"));
    assert_eq!(
        t.organism.as_deref(),
        Some(design.join("recipe.toml").as_path())
    );
    // A design folder whose model is not trained yet says how to train it.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(design.join("recipe.toml"), dir.path().join("recipe.toml")).unwrap();
    let e = resolve_target(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("not trained yet") && e.contains("phaselens train"),
        "{e}"
    );
    // An empty folder names what a model argument can be.
    let empty = tempfile::tempdir().unwrap();
    let e = resolve_target(empty.path()).unwrap_err().to_string();
    assert!(
        e.contains("no config.json") && e.contains("recipe.toml"),
        "{e}"
    );
}
