//! `phaselens plan` (issue 22): the one-device estimate against the measured peak resident
//! set of loading + one forward (`plan --measure`, its own process) on a ~130 MB test
//! checkpoint; errors for a config missing a key and for placements that do not fit
//! (which device or the host, how many bytes over); a fitting plan of the published
//! V4-Flash config over a node with its experts partly in host memory.

use std::path::Path;
use std::process::Command;

use burn::tensor::Device;
use phaselens::model::deepseek_v4::{self, DeepseekV4Config, DeepseekV4Model};
use phaselens::model::weights::{RandomInit, Vb};

fn phaselens(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap()
}

/// A random DeepSeek-V4 model of ~33M parameters (every attention type, hash and
/// learned routing), saved in f32.
fn test_checkpoint(dir: &Path) {
    let json = serde_json::json!({
        "model_type": "deepseek_v4",
        "vocab_size": 8192, "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 64,
        "partial_rotary_factor": 0.25, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64,
        "n_routed_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
        "n_shared_experts": 1, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16,
        "sliding_window": 32, "hc_mult": 4,
        "layer_types": ["sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention", "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "max_position_embeddings": 4096
    });
    let c = DeepseekV4Config::from_json(&json.to_string()).unwrap();
    let m = DeepseekV4Model::new(&c, &Vb::new(&RandomInit { seed: 22 }, &Device::flex())).unwrap();
    deepseek_v4::save(&m, &json, dir).unwrap();
}

#[test]
fn estimate_is_within_20_percent_of_the_measured_peak() {
    let d = tempfile::tempdir().unwrap();
    test_checkpoint(d.path());
    let dir = d.path().to_str().unwrap();
    for tokens in ["256", "2048"] {
        let out = phaselens(&["--model", dir, "--tokens", tokens, "--measure", "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let m = &j["measured"];
        let (est, peak) = (
            m["estimate"].as_f64().unwrap(),
            m["peak_rss_increase"].as_f64().unwrap(),
        );
        let resident = j["weights"]["resident"].as_f64().unwrap();
        eprintln!(
            "plan vs measured, {tokens} tokens: weights resident {:.1} MiB, estimate {:.1} MiB, measured peak RSS increase {:.1} MiB, ratio {:.3} (load {:.2} s, forward {:.2} s)",
            resident / 1048576.0,
            est / 1048576.0,
            peak / 1048576.0,
            peak / est,
            m["load_s"].as_f64().unwrap(),
            m["forward_s"].as_f64().unwrap()
        );
        assert!(
            resident > 120e6,
            "the test checkpoint is too small to measure: {resident}"
        );
        assert!(
            (peak / est - 1.0).abs() <= 0.2,
            "{tokens} tokens: measured {peak} vs estimated {est}"
        );
    }
}

/// The real-width-like `realwidth_ci` fixture (head_dim 512, indexer 64 x 128, window
/// 128; 3.3 MiB of weights, so its peak is all activations): the estimate is within 20%
/// of the measured peak, stored and f32, at lengths where a sliding layer's attention
/// block gathers 128 raw keys of 2 KiB per query for every query at once (32 to 320 MiB).
#[test]
fn realwidth_ci_estimate_is_within_20_percent_of_the_measured_peak() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4/realwidth_ci");
    let dir = dir.to_str().unwrap();
    for (tokens, weights) in [
        ("128", "stored"),
        ("640", "stored"),
        ("640", "f32"),
        ("1280", "stored"),
    ] {
        let out = phaselens(&[
            "--model",
            dir,
            "--tokens",
            tokens,
            "--measure",
            "--json",
            "--weights",
            weights,
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("no /proc/self/status") {
            eprintln!("no /proc peak RSS on this system");
            return;
        }
        assert!(out.status.success(), "{err}");
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let m = &j["measured"];
        let (est, peak) = (
            m["estimate"].as_f64().unwrap(),
            m["peak_rss_increase"].as_f64().unwrap(),
        );
        eprintln!(
            "realwidth_ci, {tokens} tokens, {weights} weights: estimate {:.1} MiB, measured peak RSS increase {:.1} MiB, ratio {:.3}",
            est / 1048576.0,
            peak / 1048576.0,
            peak / est
        );
        assert!(
            (peak / est - 1.0).abs() <= 0.2,
            "{tokens} tokens, {weights}: measured {peak} vs estimated {est}"
        );
    }
}

#[test]
fn config_missing_a_key_is_named() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("cfg.json");
    let text = include_str!("../../src/model/deepseek_v4/published/v4-flash.json");
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    v.as_object_mut().unwrap().remove("moe_intermediate_size");
    std::fs::write(&p, v.to_string()).unwrap();
    let out = phaselens(&["--config", p.to_str().unwrap(), "--tokens", "1024"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("moe_intermediate_size") && e.contains("cfg.json") && e.contains("missing"),
        "{e}"
    );
    let out = phaselens(&["--config", "v4-nano"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("v4-nano") && e.contains("v4-flash"),
        "{e}"
    );
}

#[test]
fn a_placement_that_does_not_fit_names_the_device_and_the_bytes_over() {
    // V4-Flash's non-expert weights alone (f32) exceed one 10 GiB device
    let out = phaselens(&[
        "--config",
        "v4-flash",
        "--weights",
        "f32",
        "--devices",
        "1",
        "--device-memory",
        "10GiB",
        "--tokens",
        "4096",
    ]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("device 0") && e.contains("over") && e.contains("layers 0..43"),
        "{e}"
    );
    // experts that go to a host too small for them
    let out = phaselens(&[
        "--config",
        "v4-flash",
        "--weights",
        "f32",
        "--devices",
        "2",
        "--device-memory",
        "141GiB",
        "--host-memory",
        "100GiB",
        "--tokens",
        "4096",
    ]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("host memory") && e.contains("over") && e.contains("routed experts"),
        "{e}"
    );
    // the activations of a 262144-token forward overflow a device (which one depends on
    // how the layers were spread; the error names it)
    let out = phaselens(&[
        "--config",
        "v4-flash",
        "--weights",
        "f32",
        "--devices",
        "8",
        "--device-memory",
        "141GiB",
        "--tokens",
        "262144",
    ]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("does not fit: device ") && e.contains("over"),
        "{e}"
    );
}

#[test]
fn v4_flash_over_a_node_puts_experts_on_the_host_when_needed() {
    let out = phaselens(&[
        "--config",
        "v4-flash",
        "--weights",
        "f32",
        "--devices",
        "8",
        "--device-memory",
        "141GiB",
        "--host-memory",
        "2TiB",
        "--tokens",
        "8192",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devs = j["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 8);
    let layers: u64 = devs
        .iter()
        .map(|d| d["end_layer"].as_u64().unwrap() - d["first_layer"].as_u64().unwrap())
        .sum();
    assert_eq!(layers, 43);
    for d in devs {
        assert!(
            d["total"].as_f64().unwrap() <= d["capacity"].as_f64().unwrap(),
            "{d}"
        );
    }
    let on_devices: u64 = devs
        .iter()
        .map(|d| d["experts_here"].as_u64().unwrap())
        .sum();
    let host = j["host_experts"].as_u64().unwrap();
    assert_eq!(on_devices + host, 43 * 256);
    // f32-resident experts (~1.1 TB) cannot all sit on 8 x 141 GiB
    assert!(
        host > 0 && on_devices > 0,
        "{on_devices} on devices, {host} on the host"
    );
    // stored: FP4 experts + FP8 rest, about 0.55 bytes per value
    let w = &j["weights"];
    let per_value = w["stored"].as_f64().unwrap() / w["values"].as_f64().unwrap();
    assert!((0.5..0.65).contains(&per_value), "{per_value}");
}
