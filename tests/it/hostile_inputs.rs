//! Hostile and clumsy input, table-driven: every case is an input and a substring the
//! error must contain. Each case runs under `catch_unwind`, so a panic fails the case
//! by name instead of hiding behind the first one; "no abort" follows from the memory
//! checks refusing absurd sizes before anything is allocated (an abort would kill the
//! test binary). Issue 12's classes: stale temp files, validation before destruction,
//! garbage numbers, unchecked arithmetic and sizes, and the smaller items.
//!
//! Parsers also get a bounded, seeded random-mutation fuzz (the safetensors header
//! reader, experiment TOMLs, organism recipes, both config.json families): thousands of
//! mutated inputs per run, every one must give `Ok` or a named error, never a panic.

use crate::common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use crate::common::runner::{experiment, opts, organism, tiny, write_recipe};
use phaselens::model::KvcConfig;
use phaselens::model::deepseek_v4::DeepseekV4Config;
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::runner::{Experiment, run_experiment};
use phaselens::train::OrganismFile;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Run `f` for every case; collect every case that panicked, succeeded or whose error
/// lacks the expected text, and fail once with all of them.
fn expect_errors<I>(
    what: &str,
    cases: Vec<(String, I, &str)>,
    f: impl Fn(&I) -> Result<(), String>,
) {
    let mut bad = Vec::new();
    let n = cases.len();
    for (label, input, want) in cases {
        match catch_unwind(AssertUnwindSafe(|| f(&input))) {
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                bad.push(format!("{label}: PANIC {msg}"));
            }
            Ok(Ok(())) => bad.push(format!(
                "{label}: accepted, expected an error with `{want}`"
            )),
            Ok(Err(e)) if !e.to_lowercase().contains(&want.to_lowercase()) => {
                bad.push(format!("{label}: error lacks `{want}`: {e}"))
            }
            Ok(Err(_)) => {}
        }
    }
    assert!(
        bad.is_empty(),
        "{what}: {} of {n} cases failed:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

// ---------------------------------------------------------------- experiment TOMLs

const HEAD: &str = "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"x\"\n";

fn exp_case(extra: &str) -> String {
    format!("{HEAD}{extra}")
}

#[test]
fn experiment_files_reject_impossible_settings_where_parsed() {
    let c = |l: &str, text: String, want: &'static str| (l.to_string(), text, want);
    let cases = vec![
        c("name ..", exp_case("").replace("kind =", "name = \"../x\"\nkind ="), "name"),
        c("name nested ..", exp_case("").replace("kind =", "name = \"a/../../x\"\nkind ="), "separator"),
        c("name absolute", exp_case("").replace("kind =", "name = \"/tmp/x\"\nkind ="), "name"),
        c("name empty", exp_case("").replace("kind =", "name = \"\"\nkind ="), "empty"),
        c("name hidden", exp_case("").replace("kind =", "name = \".hidden\"\nkind ="), "name"),
        c("name backslash", exp_case("").replace("kind =", "name = \"a\\\\b\"\nkind ="), "separator"),
        c("name control", exp_case("").replace("kind =", "name = \"a\\u0007b\"\nkind ="), "control"),
        c("model name ..", exp_case("").replace("organism = \"x\"", "organism = \"x\"\nname = \"../m\""), "[model] name"),
        c("positions final 0", exp_case("[patch]\npositions = { final = 0 }\n"), "final = 0"),
        c("positions unknown", exp_case("[patch]\npositions = \"some\"\n"), "line 6"),
        c("positions negative", exp_case("[patch]\npositions = { final = -1 }\n"), "line 6"),
        c("layers negative", exp_case("[patch]\nlayers = [-1]\n"), "line 6"),
        c("layers huge", exp_case("[patch]\nlayers = [18446744073709551616]\n"), "line 6"),
        c("layers string", exp_case("[patch]\nlayers = \"some\"\n"), "line 6"),
        c("n_logical 0", exp_case("[task]\nn_logical = 0\n"), "n_logical"),
        c("n_logical 10^9", exp_case("[task]\nn_logical = 1000000000\n"), "n_logical"),
        c("n_logical negative", exp_case("[task]\nn_logical = -3\n"), "line 6"),
        c("period 0", exp_case("[task]\nperiod = 0\n"), "period"),
        c("period 2^32-1", exp_case("[task]\nperiod = 4294967295\n"), "period"),
        c("period 2^32", exp_case("[task]\nperiod = 4294967296\n"), "line 6"),
        c("period 65537", exp_case("[task]\nperiod = 65537\n"), "period"),
        c("bootstrap 0", exp_case("").replace("kind =", "bootstrap_reps = 0\nkind ="), "bootstrap_reps"),
        c("bootstrap 10^11", exp_case("").replace("kind =", "bootstrap_reps = 100000000000\nkind ="), "bootstrap_reps"),
        c("max_rows 0", exp_case("").replace("kind =", "max_rows = 0\nkind ="), "max_rows"),
        c("unknown kind", "[experiment]\nkind = \"nope\"\n[model]\norganism = \"x\"\n".into(), "nope"),
        c("no model", "[experiment]\nkind = \"patch-heads\"\n".into(), "model"),
        c("empty model", "[experiment]\nkind = \"patch-heads\"\n[model]\n".into(), "organism"),
        c("both model keys", exp_case("").replace("organism = \"x\"", "organism = \"x\"\npath = \"y\""), "not both"),
        c("glob outside phase-sweep", exp_case("").replace("\"x\"", "\"organisms/*\""), "glob"),
        c("syntax error", exp_case("[task\nn_logical = 3\n"), "syntax"),
        c("syntax error column", exp_case("[task]\nn_logical = = 3\n"), "column"),
        c("duplicate section", exp_case("[task]\nseed = 1\n[task]\nseed = 2\n"), "duplicate key"),
        c("wrong section", exp_case("[ablate]\nmethods = [\"zero\"]\n"), "[ablate]"),
        c("unknown key", exp_case("[patch]\nlayerz = [0]\n"), "layerz"),
        c("empty file", String::new(), "experiment"),
        c("binary garbage", "\u{0}\u{1}\u{2}[[[".into(), "syntax"),
        c("cycling delta i64::MAX", "[experiment]\nkind = \"gate-cycling\"\n[model]\norganism = \"x\"\n[cycling]\ndeltas = [9223372036854775807]\n".into(), "deltas"),
        c("cycling delta i64::MIN", "[experiment]\nkind = \"gate-cycling\"\n[model]\norganism = \"x\"\n[cycling]\ndeltas = [-9223372036854775808]\n".into(), "deltas"),
        c("cycling delta 0", "[experiment]\nkind = \"gate-cycling\"\n[model]\norganism = \"x\"\n[cycling]\ndeltas = [0]\n".into(), "deltas"),
        c("ablate source", "[experiment]\nkind = \"ablate-heads\"\n[model]\norganism = \"x\"\n[ablate]\nmethods = [\"source\"]\n".into(), "source"),
    ];
    expect_errors("experiment TOML", cases, |text| {
        Experiment::parse(Path::new("exp/t.toml"), text.clone())
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
}

// ---------------------------------------------------------------- config.json (kvc)

fn kvc_json(edit: impl Fn(&mut serde_json::Value)) -> String {
    let mut v = serde_json::to_value(KvcConfig::tiny()).unwrap();
    edit(&mut v);
    v.to_string()
}

#[test]
fn kvc_configs_reject_impossible_values() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let set =
        |k: &'static str, x: serde_json::Value| -> Edit { Box::new(move |v| v[k] = x.clone()) };
    let cases: Vec<(String, Edit, &str)> = vec![
        (
            "rope_theta 0".into(),
            set("rope_theta", 0.into()),
            "rope_theta",
        ),
        (
            "rope_theta negative".into(),
            set("rope_theta", (-1.0).into()),
            "rope_theta",
        ),
        (
            "rope_theta huge (inf in f64)".into(),
            Box::new(|v| v["rope_theta"] = serde_json::json!(1e308)),
            "__accept__",
        ),
        ("norm_eps 0".into(), set("norm_eps", 0.0.into()), "norm_eps"),
        (
            "norm_eps negative".into(),
            set("norm_eps", (-1e-6).into()),
            "norm_eps",
        ),
        (
            "init_std negative".into(),
            set("init_std", (-0.1).into()),
            "init_std",
        ),
        (
            "n_layers 10^9".into(),
            set("n_layers", 1_000_000_000u64.into()),
            "n_layers",
        ),
        ("n_layers 0".into(), set("n_layers", 0.into()), "n_layers"),
        ("d_model 0".into(), set("d_model", 0.into()), "d_model"),
        ("vocab 0".into(), set("vocab_size", 0.into()), "vocab_size"),
        (
            "n_kv_heads not dividing".into(),
            set("n_kv_heads", 3.into()),
            "n_kv_heads",
        ),
        (
            "window < stride".into(),
            Box::new(|v| v["compression"]["window"] = 2.into()),
            "window",
        ),
        (
            "stride 0".into(),
            Box::new(|v| v["compression"]["stride"] = 0.into()),
            "stride",
        ),
        (
            "window offsets: one for 2 KV heads".into(),
            Box::new(|v| v["compression"]["window_offsets"] = serde_json::json!([0])),
            "window_offsets",
        ),
        (
            "window offset = stride".into(),
            Box::new(|v| v["compression"]["window_offsets"] = serde_json::json!([0, 4])),
            "window_offsets",
        ),
        (
            "window offsets without 0".into(),
            Box::new(|v| v["compression"]["window_offsets"] = serde_json::json!([1, 2])),
            "window_offsets",
        ),
        ("negative size".into(), set("d_ff", (-4).into()), "d_ff"),
        ("string size".into(), set("d_ff", "many".into()), "d_ff"),
        ("unknown key".into(), set("d_fff", 3.into()), "d_fff"),
        (
            "wrong model_type".into(),
            set("model_type", "gpt".into()),
            "model_type",
        ),
        (
            "partial without dims".into(),
            set("rope", "partial".into()),
            "rope_dims",
        ),
        (
            "odd rope dims".into(),
            Box::new(|v| {
                v["rope"] = "partial".into();
                v["rope_dims"] = 3.into();
            }),
            "rope_dims",
        ),
    ];
    let cases = cases
        .into_iter()
        .filter(|(_, _, w)| *w != "__accept__")
        .map(|(l, e, w)| (l, kvc_json(e), w))
        .collect();
    expect_errors("kvc config.json", cases, |text| {
        KvcConfig::from_json(text).map(|_| ())
    });
}

#[test]
fn kvc_config_sizes_beyond_memory_are_refused_naming_the_keys() {
    let mut c = KvcConfig::tiny();
    c.vocab_size = 1 << 40;
    c.d_model = 1 << 20;
    let e = c.check_memory().unwrap_err().to_string();
    assert!(
        e.contains("vocab_size = 1099511627776") && e.contains("d_model"),
        "{e}"
    );
}

// ---------------------------------------------------------------- config.json (DeepSeek-V4)

fn v4_json(edit: impl Fn(&mut serde_json::Value)) -> String {
    let text = std::fs::read_to_string("tests/fixtures/deepseek_v4/pro/config.json").unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    v.to_string()
}

#[test]
fn deepseek_v4_configs_reject_impossible_values() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let set =
        |k: &'static str, x: serde_json::Value| -> Edit { Box::new(move |v| v[k] = x.clone()) };
    let cases: Vec<(String, Edit, &str)> = vec![
        (
            "rope_theta 0".into(),
            Box::new(|v| {
                v["rope_theta"] = 0.into();
                v.as_object_mut().unwrap().remove("rope_parameters");
            }),
            "rope_theta",
        ),
        (
            "rope_theta negative".into(),
            Box::new(|v| {
                v["rope_theta"] = (-5.0).into();
                v.as_object_mut().unwrap().remove("rope_parameters");
            }),
            "rope_theta",
        ),
        (
            "compress_rope_theta 0".into(),
            Box::new(|v| {
                v["compress_rope_theta"] = 0.into();
                v.as_object_mut().unwrap().remove("rope_parameters");
            }),
            "rope_theta",
        ),
        (
            "partial_rotary_factor 2".into(),
            Box::new(|v| {
                v["partial_rotary_factor"] = 2.0.into();
                v.as_object_mut().unwrap().remove("rope_parameters");
            }),
            "partial_rotary_factor",
        ),
        (
            "partial_rotary_factor negative".into(),
            Box::new(|v| {
                v["partial_rotary_factor"] = (-0.5).into();
                v.as_object_mut().unwrap().remove("rope_parameters");
            }),
            "partial_rotary_factor",
        ),
        (
            "num_hidden_layers 10^9".into(),
            set("num_hidden_layers", 1_000_000_000u64.into()),
            "num_hidden_layers",
        ),
        (
            "num_hidden_layers 10^18".into(),
            set("num_hidden_layers", 1_000_000_000_000_000_000u64.into()),
            "num_hidden_layers",
        ),
        (
            "hidden_size 0".into(),
            set("hidden_size", 0.into()),
            "hidden_size",
        ),
        (
            "rms_norm_eps 0".into(),
            set("rms_norm_eps", 0.0.into()),
            "rms_norm_eps",
        ),
        (
            "swiglu_limit negative".into(),
            set("swiglu_limit", (-1.0).into()),
            "swiglu_limit",
        ),
        (
            "hc_eps negative".into(),
            set("hc_eps", (-1.0).into()),
            "hc_eps",
        ),
        (
            "experts per token > experts".into(),
            set("num_experts_per_tok", 9.into()),
            "num_experts_per_tok",
        ),
        (
            "o_groups not dividing".into(),
            set("o_groups", 3.into()),
            "o_groups",
        ),
        (
            "wrong model_type".into(),
            set("model_type", "llama".into()),
            "model_type",
        ),
        (
            "hidden_size string".into(),
            set("hidden_size", "big".into()),
            "hidden_size",
        ),
    ];
    let cases = cases
        .into_iter()
        .map(|(l, e, w)| (l, v4_json(e), w))
        .collect();
    expect_errors("DeepSeek-V4 config.json", cases, |text| {
        DeepseekV4Config::from_json(text)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // Sizes that parse but cannot fit any machine are refused by the memory check.
    let big = v4_json(|v| {
        v["hidden_size"] = (1u64 << 22).into();
        v["moe_intermediate_size"] = (1u64 << 22).into();
    });
    let c = DeepseekV4Config::from_json(&big).unwrap();
    let e = c.check_memory().unwrap_err().to_string();
    assert!(e.contains("hidden_size = 4194304"), "{e}");
}

// ---------------------------------------------------------------- organism recipes

const RECIPE: &str = r#"[organism]
name = "tiny"
run_dir = "run"

[model]
model_type = "phaselens-kvc"
vocab_size = 128
d_model = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 32
attention = "compressed"
compression = { window = 4, stride = 4, local_tail = 2 }

[task.vocab]
kind = "synthetic"

[task.train]
period = 4
prompt = { n_bindings = 6, n_queries = 3 }

[train]
steps = 4
batch_size = 4
lr = 1e-2
warmup_steps = 2
checkpoint_every = 2
"#;

fn load_recipe(dir: &Path, text: &str) -> Result<OrganismFile, String> {
    let p = dir.join("r.toml");
    std::fs::write(&p, text).unwrap();
    OrganismFile::load(&p).map_err(|e| e.to_string())
}

#[test]
fn recipes_reject_impossible_settings_where_parsed() {
    let d = tempfile::tempdir().unwrap();
    let r = |from: &str, to: &str| RECIPE.replace(from, to);
    let c = |l: &str, text: String, want: &'static str| (l.to_string(), text, want);
    let cases = vec![
        c("lr -1", r("lr = 1e-2", "lr = -1.0"), "lr"),
        c("lr 0", r("lr = 1e-2", "lr = 0.0"), "lr"),
        c("lr nan", r("lr = 1e-2", "lr = nan"), "lr"),
        c("lr inf", r("lr = 1e-2", "lr = inf"), "lr"),
        c(
            "min_lr_ratio 2",
            r("lr = 1e-2", "lr = 1e-2\nmin_lr_ratio = 2.0"),
            "min_lr_ratio",
        ),
        c("beta2 1", r("lr = 1e-2", "lr = 1e-2\nbeta2 = 1.0"), "beta2"),
        c(
            "grad_clip 0",
            r("lr = 1e-2", "lr = 1e-2\ngrad_clip = 0.0"),
            "grad_clip",
        ),
        c(
            "weight_decay negative",
            r("lr = 1e-2", "lr = 1e-2\nweight_decay = -0.1"),
            "weight_decay",
        ),
        c("steps 0", r("steps = 4", "steps = 0"), "steps"),
        c(
            "batch_size 0",
            r("batch_size = 4", "batch_size = 0"),
            "batch_size",
        ),
        c(
            "batch_size 10^8",
            r("batch_size = 4", "batch_size = 100000000"),
            "batch_size",
        ),
        c(
            "checkpoint_every 0",
            r("checkpoint_every = 2", "checkpoint_every = 0"),
            "checkpoint_every",
        ),
        c(
            "keep_checkpoints 0",
            r(
                "checkpoint_every = 2",
                "checkpoint_every = 2\nkeep_checkpoints = 0",
            ),
            "keep_checkpoints",
        ),
        c("syntax error", r("[train]", "[train"), "syntax"),
        c(
            "syntax error line/col",
            r("steps = 4", "steps = = 4"),
            "column",
        ),
        c(
            "rope_theta 0",
            r("d_ff = 32", "d_ff = 32\nrope_theta = 0.0"),
            "rope_theta",
        ),
        c(
            "rope_theta nan",
            r("d_ff = 32", "d_ff = 32\nrope_theta = nan"),
            "rope_theta",
        ),
        c(
            "norm_eps inf",
            r("d_ff = 32", "d_ff = 32\nnorm_eps = inf"),
            "norm_eps",
        ),
        c(
            "n_layers 10^9",
            r("n_layers = 1", "n_layers = 1000000000"),
            "n_layers",
        ),
        c(
            "name ..",
            r("name = \"tiny\"", "name = \"../evil\""),
            "name",
        ),
        c(
            "name absolute",
            r("name = \"tiny\"", "name = \"/tmp/evil\""),
            "name",
        ),
        c(
            "no model_type",
            r("model_type = \"phaselens-kvc\"\n", ""),
            "model_type",
        ),
        c("period 0", r("period = 4", "period = 0"), "period"),
        c(
            "period 2^32-1",
            r("period = 4", "period = 4294967295"),
            "period",
        ),
        c(
            "key_len 10^6",
            r("n_queries = 3", "n_queries = 3, key_len = 1000000"),
            "key_len",
        ),
        c(
            "key_len 10^18",
            r(
                "n_queries = 3",
                "n_queries = 3, key_len = 1000000000000000000",
            ),
            "key_len",
        ),
        c(
            "value_len 10^9",
            r("n_queries = 3", "n_queries = 3, value_len = 1000000000"),
            "value_len",
        ),
        c(
            "n_bindings 0",
            r("n_bindings = 6", "n_bindings = 0"),
            "n_bindings",
        ),
        c(
            "queries > bindings",
            r("n_queries = 3", "n_queries = 9"),
            "n_queries",
        ),
        c(
            "inner_pad_max huge",
            r(
                "period = 4",
                "period = 4\ninner_pad_max = 9223372036854775807",
            ),
            "inner_pad_max",
        ),
    ];
    expect_errors("organism recipe", cases, |text| {
        let f = load_recipe(d.path(), text)?;
        // What `train` checks before it builds anything (token space, sampler, memory).
        let space = f.task.vocab.build().map_err(|e| e.to_string())?;
        let sampler = phaselens::tasks::KvTrainSampler::new(&space, f.task.train.clone())
            .map_err(|e| e.to_string())?;
        phaselens::train::memory::check_training(&f, sampler.seq_len()).map_err(|e| e.to_string())
    });
}

#[test]
fn training_batch_beyond_memory_is_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let text = RECIPE
        .replace("batch_size = 4", "batch_size = 1000000")
        .replace("d_model = 16", "d_model = 4096")
        .replace("n_layers = 1", "n_layers = 64");
    let p = d.path().join("r.toml");
    std::fs::write(&p, &text).unwrap();
    let f = OrganismFile::load(&p).unwrap();
    let opts = phaselens::train::TrainOptions {
        fresh: false,
        max_steps: None,
        progress: false,
    };
    let e = phaselens::train::train(&p, &f, &common::dev(), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("batch_size") && e.contains("r.toml"), "{e}");
    assert!(
        !d.path().join("run").exists(),
        "nothing written before the check"
    );
}

// ---------------------------------------------------------------- safetensors headers

/// A safetensors file from a header JSON value and `data_len` data bytes.
fn st_file(dir: &Path, name: &str, header: &serde_json::Value, data_len: usize) -> PathBuf {
    let h = header.to_string().into_bytes();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.extend(std::iter::repeat_n(0u8, data_len));
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn safetensors_headers_that_lie_are_named_errors() {
    use serde_json::json;
    let d = tempfile::tempdir().unwrap();
    let t = |dtype: &str, shape: serde_json::Value, a: u64, b: u64| json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]});
    let c =
        |l: &str, h: serde_json::Value, n: usize, want: &'static str| (l.to_string(), (h, n), want);
    let cases = vec![
        c(
            "overlap",
            json!({"a": t("F32", json!([2]), 0, 8), "b": t("F32", json!([2]), 4, 12)}),
            12,
            "overlap",
        ),
        c(
            "same bytes twice",
            json!({"a": t("F32", json!([2]), 0, 8), "b": t("F32", json!([2]), 0, 8)}),
            8,
            "overlap",
        ),
        c(
            "gap",
            json!({"a": t("F32", json!([1]), 0, 4), "b": t("F32", json!([1]), 8, 12)}),
            12,
            "unclaimed",
        ),
        c(
            "gap at start",
            json!({"a": t("F32", json!([1]), 4, 8)}),
            8,
            "unclaimed",
        ),
        c(
            "trailing bytes",
            json!({"a": t("F32", json!([1]), 0, 4)}),
            12,
            "trailing",
        ),
        c(
            "past the end",
            json!({"a": t("F32", json!([4]), 0, 16)}),
            8,
            "truncated",
        ),
        c(
            "offsets reversed",
            json!({"a": t("F32", json!([1]), 8, 4)}),
            8,
            "data_offsets",
        ),
        c(
            "offset u64::MAX",
            json!({"a": t("F32", json!([1]), u64::MAX - 4, u64::MAX)}),
            8,
            "truncated",
        ),
        c(
            "shape product overflow",
            json!({"a": t("F32", json!([u64::MAX, u64::MAX]), 0, 4)}),
            4,
            "shape",
        ),
        c(
            "shape x dtype overflow",
            json!({"a": t("F64", json!([1u64 << 62]), 0, 8)}),
            8,
            "shape",
        ),
        c(
            "shape mismatch",
            json!({"a": t("F32", json!([3]), 0, 8)}),
            8,
            "needs",
        ),
        c(
            "negative dim",
            json!({"a": t("F32", json!([-1]), 0, 4)}),
            4,
            "shape",
        ),
        c(
            "bad dtype",
            json!({"a": t("F33", json!([1]), 0, 4)}),
            4,
            "dtype",
        ),
        c(
            "no offsets",
            json!({"a": {"dtype": "F32", "shape": [1]}}),
            4,
            "data_offsets",
        ),
        c("header not object", json!([1, 2]), 0, "object"),
        c(
            "shape not list",
            json!({"a": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}),
            16,
            "shape",
        ),
    ];
    expect_errors("safetensors header", cases, |(h, n)| {
        let p = st_file(d.path(), "x.safetensors", h, *n);
        SafetensorsReader::open(&p)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // Raw byte-level damage.
    let raw = |l: &str, bytes: Vec<u8>, want: &'static str| (l.to_string(), bytes, want);
    let mut huge_len = u64::MAX.to_le_bytes().to_vec();
    huge_len.extend_from_slice(b"{}");
    let mut not_json = 4u64.to_le_bytes().to_vec();
    not_json.extend_from_slice(b"{{{{");
    let cases = vec![
        raw("empty file", vec![], "too short"),
        raw("3 bytes", vec![1, 2, 3], "too short"),
        raw("header length u64::MAX", huge_len, "header"),
        raw("header not JSON", not_json, "JSON"),
    ];
    expect_errors("safetensors bytes", cases, |bytes| {
        let p = d.path().join("raw.safetensors");
        std::fs::write(&p, bytes).unwrap();
        SafetensorsReader::open(&p)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
}

// ---------------------------------------------------------------- bounded fuzzing

/// Mutate `base` a few times: flip, insert, delete or duplicate bytes, or splice in
/// hostile tokens (huge numbers, negatives, NaN, brackets).
fn mutate(rng: &mut ChaCha8Rng, base: &[u8]) -> Vec<u8> {
    const TOKENS: [&[u8]; 12] = [
        b"18446744073709551615",
        b"-1",
        b"0",
        b"nan",
        b"inf",
        b"1e308",
        b"[",
        b"]",
        b"{",
        b"\"",
        b"4294967295",
        b"\n[x]\n",
    ];
    let mut v = base.to_vec();
    for _ in 0..rng.random_range(1..4) {
        if v.is_empty() {
            v.push(b'{');
        }
        let i = rng.random_range(0..v.len());
        match rng.random_range(0..5) {
            0 => v[i] = rng.random(),
            1 => v.insert(i, rng.random()),
            2 => {
                let j = (i + rng.random_range(1..8)).min(v.len());
                v.drain(i..j);
            }
            3 => {
                let t = TOKENS[rng.random_range(0..TOKENS.len())];
                let j = (i + rng.random_range(0..4)).min(v.len());
                v.splice(i..j, t.iter().copied());
            }
            _ => {
                // Replace a run of digits with a hostile number.
                let t = TOKENS[rng.random_range(0..3)];
                if let Some(k) = v[i..].iter().position(u8::is_ascii_digit) {
                    let s = i + k;
                    let e = s + v[s..].iter().take_while(|b| b.is_ascii_digit()).count();
                    v.splice(s..e, t.iter().copied());
                }
            }
        }
    }
    v
}

/// Feed `n` mutations of `base` to `f`; every panic is a failure (named by its seed).
fn fuzz(what: &str, base: &[u8], n: usize, f: impl Fn(&[u8])) {
    let mut panics = Vec::new();
    for seed in 0..n as u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let input = mutate(&mut rng, base);
        if catch_unwind(AssertUnwindSafe(|| f(&input))).is_err() {
            panics.push(format!(
                "seed {seed}: {:?}",
                String::from_utf8_lossy(&input)
            ));
        }
    }
    assert!(
        panics.is_empty(),
        "{what}: {} panics:\n{}",
        panics.len(),
        panics.join("\n")
    );
}

#[test]
fn fuzz_safetensors_header_parser() {
    let d = tempfile::tempdir().unwrap();
    let good = serde_json::json!({
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]},
        "__metadata__": {"format": "pt"}
    })
    .to_string()
    .into_bytes();
    let path = d.path().join("f.safetensors");
    fuzz("safetensors header", &good, 2000, |h| {
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(h);
        bytes.extend(std::iter::repeat_n(0u8, 24));
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(r) = SafetensorsReader::open(&path) {
            let names: Vec<String> = r.names().map(String::from).collect();
            for n in names {
                let _ = r.read_f32(&n);
                let _ = r.read_i64(&n);
            }
        }
    });
    // Whole-file mutations, length prefix included.
    let mut whole = (good.len() as u64).to_le_bytes().to_vec();
    whole.extend_from_slice(&good);
    whole.extend(std::iter::repeat_n(0u8, 24));
    fuzz("safetensors file", &whole, 600, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        let _ = SafetensorsReader::open(&path);
    });
}

#[test]
fn fuzz_experiment_and_recipe_toml_parsers() {
    let d = tempfile::tempdir().unwrap();
    let exp = format!(
        "{HEAD}[task]\nn_logical = 8\nperiod = 4\nphases = [0, 1]\nprompt = {{ n_bindings = 6, n_queries = 2, key_len = 1 }}\n[patch]\nlayers = [0, 1]\npositions = {{ final = 2 }}\n"
    );
    fuzz("experiment TOML", exp.as_bytes(), 1500, |b| {
        let _ = Experiment::parse(Path::new("f.toml"), String::from_utf8_lossy(b).into_owned());
    });
    let p = d.path().join("r.toml");
    fuzz("organism recipe", RECIPE.as_bytes(), 600, |b| {
        std::fs::write(&p, b).unwrap();
        if let Ok(f) = OrganismFile::load(&p)
            && let Ok(space) = f.task.vocab.build()
            && let Ok(s) = phaselens::tasks::KvTrainSampler::new(&space, f.task.train.clone())
        {
            let _ = phaselens::train::memory::check_training(&f, s.seq_len());
        }
    });
    let kvc = serde_json::to_string_pretty(&KvcConfig::tiny()).unwrap();
    fuzz("kvc config.json", kvc.as_bytes(), 1500, |b| {
        if let Ok(c) = KvcConfig::from_json(&String::from_utf8_lossy(b)) {
            let _ = c.check_memory();
        }
    });
    let v4 = std::fs::read_to_string("tests/fixtures/deepseek_v4/pro/config.json").unwrap();
    fuzz("DeepSeek-V4 config.json", v4.as_bytes(), 1500, |b| {
        if let Ok(c) = DeepseekV4Config::from_json(&String::from_utf8_lossy(b)) {
            let _ = c.check_memory();
            let _ = c.n_params();
        }
    });
}

// ---------------------------------------------------------------- runs

const PATCH: &str = r#"
[experiment]
kind = "patch-heads"
bootstrap_reps = 20
max_rows = 16

[model]
organism = "tiny"

[task]
n_logical = 8
"#;

fn shard_files(data: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for dir in std::fs::read_dir(data.join("shards")).unwrap().flatten() {
        for f in std::fs::read_dir(dir.path()).unwrap().flatten() {
            out.push((f.path(), std::fs::read(f.path()).unwrap()));
        }
    }
    out.sort();
    out
}

#[test]
fn an_invalid_edit_deletes_no_finished_shard_and_reverting_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let mut o = opts(d);
    o.figures = false;
    let exp = experiment(d, "keep.toml", PATCH);
    let first = run_experiment(&exp, &o).unwrap();
    let before = shard_files(&d.join("notebooks-data/keep"));
    assert!(!before.is_empty());
    // Edits that a check rejects after the TOML parsed: layer out of range, a period
    // that does not fit the model, a prompt the vocabulary cannot hold.
    for (edit, want) in [
        ("[patch]\nlayers = [0, 5]\n", "out of range"),
        ("[patch]\nheads = [9]\n", "heads"),
    ] {
        let bad = experiment(d, "keep.toml", &format!("{PATCH}{edit}"));
        let e = run_experiment(&bad, &o).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        assert_eq!(
            shard_files(&d.join("notebooks-data/keep")),
            before,
            "{edit}"
        );
    }
    let bad = experiment(
        d,
        "keep.toml",
        &PATCH.replace("n_logical = 8", "n_logical = 8\nperiod = 3"),
    );
    assert!(
        run_experiment(&bad, &o)
            .unwrap_err()
            .to_string()
            .contains("period")
    );
    assert_eq!(shard_files(&d.join("notebooks-data/keep")), before);
    // A valid edit with other settings computes into its own folder, keeping the old.
    let other = experiment(d, "keep.toml", &format!("{PATCH}[patch]\nlayers = [1]\n"));
    run_experiment(&other, &o).unwrap();
    let after = shard_files(&d.join("notebooks-data/keep"));
    assert!(
        before.iter().all(|s| after.contains(s)),
        "no finished shard lost"
    );
    // Reverting resumes everything.
    let exp = experiment(d, "keep.toml", PATCH);
    let again = run_experiment(&exp, &o).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert_eq!(again.stats.cells_resumed, first.stats.cells_computed);
}

/// Shards are written without fsyncs (src/runner/store.rs): what a crash of the machine
/// can leave (an empty shard, a truncated one, a foreign file under a shard's name) must
/// be recomputed, never read, and the run must end with the tables of an intact run.
#[test]
fn shards_a_crash_damaged_are_recomputed_and_the_tables_match() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let exp = experiment(d, "crash.toml", PATCH);
    let mut o = opts(d);
    o.figures = false;
    let first = run_experiment(&exp, &o).unwrap();
    let data = d.join("notebooks-data/crash");
    let table = std::fs::read(data.join("heads.arrow")).unwrap();
    let shards = shard_files(&data);
    assert!(shards.len() >= 3, "{} shards", shards.len());
    std::fs::write(&shards[0].0, b"").unwrap();
    std::fs::write(&shards[1].0, &shards[1].1[..shards[1].1.len() / 2]).unwrap();
    std::fs::write(&shards[2].0, vec![0u8; shards[2].1.len()]).unwrap();
    let again = run_experiment(&exp, &o).unwrap();
    assert!(
        again.stats.cells_computed > 0,
        "the damaged shards were recomputed"
    );
    assert!(
        again.stats.cells_resumed > 0,
        "the intact shards were resumed"
    );
    assert_eq!(
        again.stats.cells_computed + again.stats.cells_resumed,
        first.stats.cells_computed
    );
    assert_eq!(std::fs::read(data.join("heads.arrow")).unwrap(), table);
    let repaired = shard_files(&data);
    for i in 0..3 {
        assert_eq!(repaired[i].1, shards[i].1, "shard {} rewritten", i);
    }
}

#[test]
fn stale_temp_files_are_never_read_and_are_cleaned_at_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let exp = experiment(d, "st.toml", PATCH);
    let mut o = opts(d);
    o.figures = false;
    run_experiment(&exp, &o).unwrap();
    let data = d.join("notebooks-data/st");
    let table = data.join("heads.arrow");
    // What a kill -9 during table writes leaves: a complete table of another run (with
    // rows the current one does not have) and a truncated one, both under temp names
    // that end in .arrow. Also a user's own hidden file, which must survive.
    let complete = data.join(".heads.arrow.tmp-0-7.arrow");
    std::fs::copy(&table, &complete).unwrap();
    let truncated = data.join(".accuracy.arrow.tmp-0-8.arrow");
    let bytes = std::fs::read(&table).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    let shard_dir = std::fs::read_dir(data.join("shards"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let stale_shard = shard_dir.join(".p0-c0000.arrow.tmp-0-1.arrow");
    std::fs::write(&stale_shard, b"garbage").unwrap();
    let user = data.join(".my-notes.tmp");
    std::fs::write(&user, b"mine").unwrap();

    // Readers see only committed tables: the figures redraw works and sees one table.
    let loaded = phaselens::runner::report::ExperimentData::load(&data).unwrap();
    assert!(loaded.tables.contains(&table), "{:?}", loaded.tables);
    assert!(
        loaded
            .tables
            .iter()
            .all(|t| !t.file_name().unwrap().to_string_lossy().starts_with('.')),
        "{:?}",
        loaded.tables
    );
    phaselens::runner::report::draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("st"))
        .unwrap();
    // The next run removes the stale temp files of this program, and only those.
    let s = run_experiment(&exp, &o).unwrap();
    assert_eq!(s.stats.cells_computed, 0);
    assert!(!complete.exists() && !truncated.exists() && !stale_shard.exists());
    assert!(user.exists(), "a user's file is never removed");
}

#[test]
fn outputs_never_escape_the_data_and_report_roots() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let inside = d.join("inside");
    std::fs::create_dir_all(&inside).unwrap();
    let mut o = opts(&inside);
    o.figures = false;
    for name in ["../escaped", "/tmp/phaselens-escaped", "..", "a/../../b"] {
        let text = PATCH.replace("kind =", &format!("name = \"{name}\"\nkind ="));
        let exp = experiment(d, "esc.toml", &text);
        let e = run_experiment(&exp, &o).unwrap_err().to_string();
        assert!(e.contains("name"), "{name}: {e}");
    }
    assert!(!d.join("escaped").exists() && !Path::new("/tmp/phaselens-escaped").exists());
    let e = phaselens::runner::report::draw_all(&inside, &inside, Some("../x")).unwrap_err();
    assert!(e.to_string().contains("--experiment"), "{e}");
}

#[test]
fn a_second_run_of_one_experiment_is_refused_naming_the_first_and_a_stale_lock_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let exp = experiment(d, "lk.toml", PATCH);
    let mut o = opts(d);
    o.figures = false;
    let lock_path = d.join("notebooks-data/lk/.lock");
    let held = phaselens::output::lock::RunLock::acquire(&lock_path, "experiment `lk`").unwrap();
    let e = run_experiment(&exp, &o).unwrap_err().to_string();
    assert!(
        e.contains("already running") && e.contains(&format!("process {}", std::process::id())),
        "{e}"
    );
    drop(held);
    // A lock left by a killed process (a pid that does not exist) is taken over.
    std::fs::write(&lock_path, "pid=0\nstart=1\nwhat=x\n").unwrap();
    run_experiment(&exp, &o).unwrap();
    assert!(!lock_path.exists(), "released on exit");
}

/// A copy of the organism `tiny` whose tensor `pick` (first name containing it) is
/// multiplied by `factor` at index 0 .. all (or set to `value` at index 0).
fn doctor(d: &Path, pick: &str, f: impl Fn(&mut [f32])) -> String {
    use phaselens::model::safetensors_io::{OwnedTensor, TensorValues, write_safetensors};
    let path = d.join("tiny/model.safetensors");
    let r = SafetensorsReader::open(&path).unwrap();
    let names: Vec<String> = r.names().map(String::from).collect();
    let mut out = std::collections::BTreeMap::new();
    let mut chosen = String::new();
    for n in names {
        let (shape, mut v) = r.read_f32(&n).unwrap();
        if chosen.is_empty() && n.contains(pick) {
            f(&mut v);
            chosen = n.clone();
        }
        out.insert(
            n,
            OwnedTensor {
                shape,
                data: TensorValues::F32(v),
            },
        );
    }
    drop(r);
    write_safetensors(&path, &out, None).unwrap();
    assert!(!chosen.is_empty(), "no tensor matches {pick}");
    chosen
}

#[test]
fn nan_or_inf_weights_are_named_at_load_and_overflowing_activations_name_their_layer() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let mut o = opts(d);
    o.figures = false;
    let exp = experiment(d, "nan.toml", PATCH);
    for (bad, v) in [("NaN", f32::NAN), ("inf", f32::INFINITY)] {
        let name = doctor(d, "blocks.1.attn", |w| w[3] = v);
        let e = run_experiment(&exp, &o).unwrap_err().to_string();
        assert!(e.contains(&name) && e.contains("non-finite"), "{bad}: {e}");
        doctor(d, &name, |w| w[3] = 0.01);
    }
    // Finite weights whose products overflow f32 in layer 1's MLP: the run stops with
    // an error naming that hook point instead of reporting "accuracy 0%, no effect".
    let name = doctor(d, "blocks.1.mlp.down", |w| {
        w.iter_mut().for_each(|x| *x = x.signum() * 3e38)
    });
    let e = run_experiment(&exp, &o).unwrap_err().to_string();
    assert!(
        e.contains("non-finite") && e.contains("blocks.1.hook_mlp_out"),
        "{name}: {e}"
    );
    assert!(
        !d.join("notebooks-data/nan/heads.arrow").exists(),
        "no table of garbage"
    );
}

#[test]
fn runner_sizes_beyond_memory_are_refused_before_generation() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let mut o = opts(d);
    o.figures = false;
    let cases = [
        (
            "period 65536",
            PATCH.replace(
                "n_logical = 8",
                "n_logical = 8\nperiod = 65536\nallow_period_mismatch = true",
            ),
            "period",
        ),
        (
            "key_len 10^6",
            format!("{PATCH}prompt = {{ n_bindings = 8, n_queries = 2, key_len = 1000000 }}\n"),
            "prompt",
        ),
        (
            "n_logical 10^6 at P = 4096",
            PATCH.replace(
                "n_logical = 8",
                "n_logical = 1000000\nperiod = 4096\nallow_period_mismatch = true",
            ),
            "n_logical",
        ),
    ];
    for (label, text, want) in cases {
        let exp = experiment(d, "big.toml", &text);
        let r = catch_unwind(AssertUnwindSafe(|| run_experiment(&exp, &o)));
        let e = match r {
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(_)) => panic!("{label}: accepted"),
            Err(_) => panic!("{label}: panicked"),
        };
        assert!(e.contains(want), "{label}: {e}");
    }
    // max_rows is a cap: a chunk holds at most the rows its group's cells have, and the
    // memory check sizes the chunks the executor really builds (suffix forwards of a few
    // positions here), so a cap of 10^9 runs as one chunk per layer.
    let exp = experiment(
        d,
        "cap.toml",
        &PATCH.replace("max_rows = 16", "max_rows = 1000000000"),
    );
    let s = run_experiment(&exp, &o).unwrap();
    assert!(s.stats.cells_computed > 0);
}

#[test]
fn the_prompt_format_doc_toml_hint_is_the_default_token_space() {
    let doc = std::fs::read_to_string("docs/prompt_format.md").unwrap();
    let start = doc.find("```toml\n[task.vocab]").expect("the TOML hint");
    let block = &doc[start + 8..];
    let block = &block[..block.find("```").unwrap()];
    #[derive(serde::Deserialize)]
    struct T {
        task: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        vocab: phaselens::tasks::TokenSpaceConfig,
    }
    let t: T = toml::from_str(block).unwrap();
    assert_eq!(t.task.vocab, phaselens::tasks::TokenSpaceConfig::default());
}

// ---------------------------------------------------------------- paths out of the model folder

/// A model folder whose shard index names `shard`; `secret.safetensors` lies one level
/// above the folder (what a `..` path or an outward symlink would reach).
fn indexed_model(root: &Path, shard: &str) -> PathBuf {
    use serde_json::json;
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let t = json!({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}});
    st_file(root, "secret.safetensors", &t, 4);
    st_file(&dir, "inside.safetensors", &t, 4);
    let index = json!({"weight_map": {"w": shard}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    dir
}

#[test]
fn shard_paths_and_links_leaving_the_model_folder_are_refused_naming_the_entry() {
    use phaselens::model::weights::CheckpointSource;
    let d = tempfile::tempdir().unwrap();
    let secret = d.path().join("secret.safetensors");
    let c = |l: &str, shard: String, want: &'static str| (l.to_string(), shard, want);
    let cases = vec![
        c(
            "dot-dot",
            "../secret.safetensors".into(),
            "`../secret.safetensors`",
        ),
        c(
            "deep dot-dot",
            "a/../../secret.safetensors".into(),
            "leaves the model directory",
        ),
        c(
            "many dot-dots",
            "../../../../../../etc/passwd".into(),
            "leaves the model directory",
        ),
        c(
            "absolute",
            secret.display().to_string(),
            "leaves the model directory",
        ),
        c("empty", String::new(), "leaves the model directory"),
        c("dot", ".".into(), "leaves the model directory"),
        c(
            "link out",
            "link.safetensors".into(),
            "`link.safetensors` resolves to",
        ),
        c(
            "dir link out",
            "sub/secret.safetensors".into(),
            "outside the model directory",
        ),
    ];
    expect_errors("shard paths", cases, |shard| {
        let root = tempfile::tempdir_in(d.path()).unwrap();
        let dir = indexed_model(root.path(), shard);
        let out = root.path().join("secret.safetensors");
        std::os::unix::fs::symlink(&out, dir.join("link.safetensors")).unwrap();
        std::os::unix::fs::symlink(root.path(), dir.join("sub")).unwrap();
        CheckpointSource::open_dir(&dir)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // The single-file layout: model.safetensors itself a link out of the folder.
    let root = tempfile::tempdir().unwrap();
    let dir = indexed_model(root.path(), "inside.safetensors");
    std::os::unix::fs::symlink(
        root.path().join("secret.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let e = CheckpointSource::open_dir(&dir)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("outside the model directory"),
        "{e}"
    );
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    // Paths and links that stay inside are fine, and so is a Hugging Face cache snapshot
    // whose files link into its own repository's blobs/.
    let root = tempfile::tempdir().unwrap();
    let dir = indexed_model(root.path(), "./inside.safetensors");
    CheckpointSource::open_dir(&dir).expect("a ./ path inside the folder");
    std::os::unix::fs::symlink(
        dir.join("inside.safetensors"),
        dir.join("alias.safetensors"),
    )
    .unwrap();
    let index = serde_json::json!({"weight_map": {"w": "alias.safetensors"}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    CheckpointSource::open_dir(&dir).expect("a link inside the folder");
    let repo = root.path().join("models--org--name");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots/abc")).unwrap();
    std::fs::copy(dir.join("inside.safetensors"), repo.join("blobs/1234")).unwrap();
    std::os::unix::fs::symlink(
        "../../blobs/1234",
        repo.join("snapshots/abc/model.safetensors"),
    )
    .unwrap();
    CheckpointSource::open_dir(&repo.join("snapshots/abc")).expect("a hub cache snapshot");
}

// ---------------------------------------------------------------- issue 24: new kinds, benches, grids

/// Numbers that size allocations in the new kinds and benches are refused before
/// compute, naming the setting; none aborts on allocation.
#[test]
fn sizes_of_the_new_kinds_and_benches_are_checked_before_compute() {
    let d = tempfile::tempdir().unwrap();
    organism(d.path(), "tiny", &tiny(2, 4, 2, 4, 4), 1);
    let atp = |extra: &str| {
        format!(
            "[experiment]\nkind = \"attribution-patching\"\nbootstrap_reps = 10\n[model]\norganism = \"tiny\"\n[task]\nn_logical = 8\n[atp]\n{extra}"
        )
    };
    let filler = |task: &str, extra: &str| {
        format!(
            "[experiment]\nkind = \"filler-probe\"\nbootstrap_reps = 10\n[model]\norganism = \"tiny\"\n[task]\n{task}\n[filler]\n{extra}"
        )
    };
    let c = |l: &str, text: String, want: &'static str| (l.to_string(), text, want);
    let cases = vec![
        c(
            "atp band 10^15",
            atp("position_band = 1000000000000000\n"),
            "position_band",
        ),
        c(
            "atp band longer than the prompts",
            atp("position_band = 4000\nvalidate_positions = true\n"),
            "position_band",
        ),
        c(
            "filler lengths 10^12",
            filler(
                "n_logical = 2",
                "lengths = { min = 0, max = 1000000000000 }\n",
            ),
            "lengths",
        ),
        c(
            "filler lengths x instances",
            filler("n_logical = 1000", "lengths = { min = 0, max = 4000000 }\n"),
            "n_logical",
        ),
        c(
            "filler instances 10^6",
            filler("n_logical = 1000000", ""),
            "n_logical",
        ),
    ];
    expect_errors("new kind sizes", cases, |text| {
        let p = experiment(d.path(), "k.toml", text);
        run_experiment(&p, &opts(d.path()))
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // Benches: the same checks on their command-line numbers.
    let p = experiment(d.path(), "b.toml", &atp(""));
    use phaselens::device::DeviceSpec;
    use phaselens::runner::bench::bench_atp;
    let cases = vec![
        (
            "band 10^12".to_string(),
            (None, 1_000_000_000_000usize),
            "--band",
        ),
        ("band 0".to_string(), (None, 0), "--band"),
        (
            "n_logical 10^9".to_string(),
            (Some(1_000_000_000usize), 4),
            "--n-logical",
        ),
        ("n_logical 0".to_string(), (Some(0), 4), "--n-logical"),
    ];
    expect_errors("bench atp", cases, |(n, band)| {
        bench_atp(&p, 0, *n, *band, &DeviceSpec::Cpu)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
}

/// A top-k recall whose k is not below the number of candidates is 1.0 for any
/// estimate: it is refused (NaN in the tables), not reported as perfect agreement.
#[test]
fn vacuous_top_k_recall_is_refused() {
    use phaselens::analysis::topk_recall;
    let est = [0.3, -0.1, 0.2, 0.0];
    let wrong = [0.0, 0.1, -0.2, 0.9];
    assert!(topk_recall(&est, &wrong, 1).unwrap() < 1.0);
    for k in [4, 5, usize::MAX] {
        let e = topk_recall(&est, &wrong, k).unwrap_err().to_string();
        assert!(e.contains("vacuous"), "{e}");
    }
}

/// Grid files: every design's sweeps are checked at load (not after training), and a
/// seeded fuzz of grid TOMLs gives `Ok` or a named error, never a panic.
#[test]
fn grid_files_are_checked_whole_and_fuzzing_them_never_panics() {
    use phaselens::grid::{Grid, check_sweeps};
    let d = tempfile::tempdir().unwrap();
    let base = write_recipe(d.path(), "base", &tiny(1, 2, 1, 4, 4));
    let _ = base;
    let grid = "[grid]\nbase = \"base.toml\"\n[axes]\nseed = [1, 2]\nW = [4, 8]\n\
                [[design]]\nname = \"x\"\nset = { kv_heads = 1 }\n\
                [eval]\nn_logical = 32\ndetail_n_logical = 32\nslots = [1, 2]\nbindings = [4, 8]\nbootstrap_reps = 20\n\
                [slurm]\ncpus_per_task = 2\nmem = \"4G\"\nmax_parallel = 3\n";
    let load = |text: &str| -> Result<(), String> {
        let p = d.path().join("g.toml");
        let g = Grid::parse(&p, text).map_err(|e| e.to_string())?;
        check_sweeps(&g).map_err(|e| e.to_string())
    };
    load(grid).expect("the base grid is valid");
    let c = |l: &str, text: String, want: &'static str| (l.to_string(), text, want);
    let cases = vec![
        c(
            "bootstrap 0",
            grid.replace("bootstrap_reps = 20", "bootstrap_reps = 0"),
            "bootstrap_reps",
        ),
        c(
            "bootstrap 10^11",
            grid.replace("bootstrap_reps = 20", "bootstrap_reps = 100000000000"),
            "bootstrap_reps",
        ),
        c(
            "n_logical 10^9",
            grid.replace("n_logical = 32\nd", "n_logical = 1000000000\nd"),
            "n_logical",
        ),
        c(
            "detail 10^9",
            grid.replace("detail_n_logical = 32", "detail_n_logical = 1000000000"),
            "n_logical",
        ),
        c(
            "slot beyond bindings",
            grid.replace("slots = [1, 2]", "slots = [1, 99]"),
            "slot 99",
        ),
        c(
            "an experiment as grid",
            "[experiment]\nkind = \"patch-heads\"\n".into(),
            "expected a grid file",
        ),
    ];
    expect_errors("grid files", cases, |t| load(t.as_str()));
    fuzz("grid TOML", grid.as_bytes(), 400, |bytes| {
        let _ = load(String::from_utf8_lossy(bytes).as_ref());
    });
}
