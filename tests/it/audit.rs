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
    assert_eq!(c["schema_version"], 2);
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

// ---- compression overlays (`--compression`, `[model] compression`) ----

/// `OUT/audit.json`'s first part's first protocol: mean accuracy.
fn mean_accuracy(c: &serde_json::Value) -> f64 {
    c["parts"][0]["protocols"][0]["mean_accuracy"]
        .as_f64()
        .unwrap()
}

/// A small budget for the shipped full-attention organism (no filler probe).
const SMALL: [&str; 5] = [
    "--budget",
    "prompts=600,time=none",
    "--ci-width",
    "40pp",
    "--no-filler",
];

#[test]
fn an_overlay_changes_the_measured_accuracy_and_is_recorded_in_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = repo().join("experiments/organisms/full-attn");
    let o = audit_cli(&model, &d.join("plain"), &SMALL);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let plain = certificate(&d.join("plain"));
    assert!(plain["model"]["compression"].is_null());
    assert_eq!(plain["parts"][0]["name"], "shift-8");
    // Mean-pooled entries of 4 tokens beside 4 raw ones: retrieval is gone.
    let mut args = SMALL.to_vec();
    args.extend(["--compression", "kind=pool,window=4,stride=4,local=4"]);
    let o = audit_cli(&model, &d.join("pool"), &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let pool = certificate(&d.join("pool"));
    assert_eq!(pool["schema_version"], 2);
    let overlay = &pool["model"]["compression"];
    assert_eq!(overlay["kind"], "pool");
    assert_eq!(overlay["stride"], 4);
    assert_eq!(pool["settings"]["model"]["compression"], *overlay);
    // The phases follow the overlay's grid: one phased part at its stride.
    assert_eq!(pool["geometry"]["compressed"], true);
    let part = &pool["parts"][0];
    assert_eq!(
        (part["name"].as_str(), part["period"].as_u64()),
        (Some("period-4"), Some(4))
    );
    assert_eq!(part["protocols"].as_array().unwrap().len(), 2);
    let (a, b) = (mean_accuracy(&plain), mean_accuracy(&pool));
    assert!(a > 0.9 && b < 0.5, "plain {a}, pool {b}");
    // The runner experiments the audit ran carry the overlay (`phaselens run` reruns them).
    let plan = std::fs::read_to_string(d.join("pool/plan/period-4-phase-sweep.toml")).unwrap();
    assert!(
        plan.contains("compression") && plan.contains("pool"),
        "{plan}"
    );
    let report = std::fs::read_to_string(d.join("pool/report.md")).unwrap();
    assert!(report.contains("Compression overlay"), "{report}");
}

#[test]
fn the_config_sets_the_overlay_the_flag_overrides_it_and_the_grid_offset_sets_the_phases() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = repo().join("experiments/organisms/full-attn");
    let toml = d.join("audit.toml");
    std::fs::write(
        &toml,
        "[model]\ncompression = { kind = \"select\", block = 4, top_k = 1, window = 4, offset = 3 }\n",
    )
    .unwrap();
    let mut args = SMALL.to_vec();
    args.extend(["--config", toml.to_str().unwrap()]);
    let o = audit_cli(&model, &d.join("cfg"), &args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let c = certificate(&d.join("cfg"));
    assert_eq!(c["model"]["compression"]["kind"], "select");
    assert_eq!(c["model"]["compression"]["offset"], 3);
    let part = &c["parts"][0];
    assert_eq!(
        (part["period"].as_u64(), part["offset"].as_u64()),
        (Some(4), Some(3))
    );
    let n = part["n_logical"].as_u64().unwrap();
    for p in part["protocols"].as_array().unwrap() {
        let phases: Vec<u64> = p["per_phase"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["phase"].as_u64().unwrap())
            .collect();
        assert_eq!(phases, vec![0, 1, 2, 3]);
        assert!(
            p["per_phase"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s["n"] == n)
        );
    }
    // The flag wins over the file.
    let mut flag = args.clone();
    flag.extend(["--compression", "kind=select,block=2,top_k=1,window=8"]);
    let o = audit_cli(&model, &d.join("flag"), &flag);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let c = certificate(&d.join("flag"));
    assert_eq!(c["model"]["compression"]["block"], 2);
    assert_eq!(c["parts"][0]["period"], 2);
    assert_eq!(c["parts"][0]["offset"], 0);
    // Another overlay into a finished audit's folder is another request: refused.
    let o = audit_cli(&model, &d.join("cfg"), &flag);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("other settings"), "{}", stderr(&o));
}

#[test]
fn overlay_errors_name_the_key_before_any_compute() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let full = repo().join("experiments/organisms/full-attn");
    let run = |model: &Path, out: &str, overlay: &str| {
        let o = audit_cli(model, &d.join(out), &["--compression", overlay]);
        assert!(!d.join(out).join("shards").exists(), "{out}");
        (o.status.code(), stderr(&o))
    };
    // Bad command lines: clap's exit code 2, the key named.
    let (code, e) = run(&full, "o1", "kind=banana,block=8");
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("banana"), "{e}");
    let (code, e) = run(&full, "o2", "kind=select,block=8,top_k=0,window=8");
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("compression.top_k"), "{e}");
    // A block longer than the retrieval prompts, a raw window that covers them.
    let (code, e) = run(&full, "o3", "kind=select,block=200,top_k=1,window=4");
    assert_eq!(code, Some(1), "{e}");
    assert!(
        e.contains("compression.block") && e.contains("retrieval prompts"),
        "{e}"
    );
    let (code, e) = run(&full, "o4", "kind=select,block=4,top_k=1,window=1000");
    assert_eq!(code, Some(1), "{e}");
    assert!(
        e.contains("compression.window") && e.contains("covers"),
        "{e}"
    );
    // Models that cannot take an overlay: one that already compresses, DeepSeek-V4.
    let w8s8 = repo().join("experiments/organisms/kvc-w8s8");
    let (code, e) = run(&w8s8, "o5", "kind=select,block=8,top_k=1,window=8");
    assert_eq!(code, Some(1), "{e}");
    assert!(
        e.contains("compression") && e.contains("already compresses"),
        "{e}"
    );
    let v4 = repo().join("tests/fixtures/deepseek_v4/pro");
    let (code, e) = run(&v4, "o6", "kind=select,block=8,top_k=1,window=8");
    assert_eq!(code, Some(1), "{e}");
    assert!(
        e.contains("compression overlay") && e.contains("deepseek"),
        "{e}"
    );
    // In the TOML: the file, the key.
    let toml = d.join("audit.toml");
    std::fs::write(
        &toml,
        "[model]\ncompression = { kind = \"select\", block = 8, top_k = 0, window = 8 }\n",
    )
    .unwrap();
    let o = audit_cli(&full, &d.join("o7"), &["--config", toml.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("audit.toml") && e.contains("compression.top_k"),
        "{e}"
    );
    std::fs::write(
        &toml,
        "[model]\ncompression = { kind = \"squeeze\", block = 8 }\n",
    )
    .unwrap();
    let o = audit_cli(&full, &d.join("o8"), &["--config", toml.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("audit.toml") && e.contains("squeeze"), "{e}");
}

#[test]
fn a_hugging_face_gemma3_folder_is_audited_under_an_overlay() {
    // The tiny Gemma 3 checkpoint (random weights, vocabulary 128, context 64): the
    // pretrained loading path and the overlay on a Gemma 3 model, end to end.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = repo().join("tests/fixtures/pretrained/tiny-gemma3");
    let mut cfg = small(600);
    cfg.audit.filler = false;
    cfg.audit.ci_width = Some(60.0);
    cfg.task = Some(toml::from_str("prompt = { n_bindings = 6, n_queries = 1 }").unwrap());
    cfg.model.compression = Some("kind=select,block=4,top_k=1,window=4".parse().unwrap());
    let o = run_audit(&request(&model, &d.join("a"), cfg.clone())).unwrap();
    let c = &o.certificate;
    assert_eq!(c.model.arch, "gemma3");
    assert!(matches!(
        c.model.compression,
        Some(phaselens::model::compression::Overlay::Select { block: 4, .. })
    ));
    assert_eq!(c.parts[0].period, 4);
    assert!(c.forwards > 0);
    // A block longer than the model's context: the overlay's key, not the model.
    cfg.model.compression = Some("kind=select,block=128,top_k=1,window=4".parse().unwrap());
    let e = run_audit(&request(&model, &d.join("b"), cfg))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("compression.block") && e.contains("context of 64"),
        "{e}"
    );
}

#[test]
fn a_cached_gguf_is_a_model_argument_and_a_text_task_is_refused_by_name() {
    use crate::common::pretrained::{SMOLLM2, model_file};
    if model_file(SMOLLM2).is_none() {
        return;
    }
    let arg = PathBuf::from(format!("models:{SMOLLM2}"));
    let t = resolve_target(&arg).unwrap();
    assert_eq!(t.name, "SmolLM2-135M-Instruct.Q4_1");
    assert!(t.dir.is_file() && t.organism.is_none(), "{t:?}");
    // The audit measures the key-value prompt; a passkey [task] is refused before
    // compute, naming the key.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small(600);
    let task: toml::Table = toml::from_str(&format!(
        "kind = \"passkey\"\nvocab = {{ kind = \"hugging_face\", tokenizer = \"models:{SMOLLM2}\", pad = \"<|endoftext|>\" }}\n"
    ))
    .unwrap();
    cfg.task = Some(task);
    cfg.model.compression = Some("kind=select,block=8,top_k=4,window=32".parse().unwrap());
    let out = dir.path().join("a");
    let e = run_audit(&request(&arg, &out, cfg))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[task] kind") && e.contains("passkey"), "{e}");
    assert!(!out.join("shards").exists());
}
