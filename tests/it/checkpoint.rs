//! Model directories: exact round trips and clear errors for bad checkpoints; the
//! `phaselens forward` command.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::kvc::{KvcConfig, KvcModel, RopeMode};
use phaselens::model::safetensors_io::{
    OwnedTensor, SafetensorsReader, TensorValues, write_safetensors,
};
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{load_kvc, load_model, save_kvc};

fn config() -> KvcConfig {
    KvcConfig {
        vocab_size: 29,
        d_model: 16,
        n_heads: 2,
        n_kv_heads: 1,
        d_head: None,
        d_ff: 24,
        rope: RopeMode::Partial,
        rope_dims: Some(4),
        key_shift: true,
        init_std: 0.1,
        ..KvcConfig::tiny()
    }
    .with_compression(4, 4, 2)
}

fn saved(dir: &Path) -> KvcModel {
    let m = KvcModel::new(
        &config(),
        &Vb::new(&RandomInit { seed: 11 }, &Device::flex()),
    )
    .unwrap();
    save_kvc(&m, dir).unwrap();
    m
}

fn logits(m: &KvcModel) -> Vec<f32> {
    let x = Tensor::<2, Int>::from_data(
        TensorData::new((0..20i64).map(|i| i % 29).collect::<Vec<_>>(), [1, 20]),
        &Device::flex(),
    );
    m.forward(x, &HookSpec::new())
        .unwrap()
        .logits
        .into_data()
        .try_into_vec::<f32>()
        .unwrap()
}

/// Rewrite the saved weights through `edit`.
fn rewrite(dir: &Path, edit: impl FnOnce(&mut BTreeMap<String, OwnedTensor>)) {
    let p = dir.join("model.safetensors");
    let r = SafetensorsReader::open(&p).unwrap();
    let mut t = BTreeMap::new();
    for n in r.names() {
        let (shape, v) = r.read_f32(n).unwrap();
        t.insert(
            n.to_string(),
            OwnedTensor {
                shape,
                data: TensorValues::F32(v),
            },
        );
    }
    drop(r);
    edit(&mut t);
    write_safetensors(&p, &t, None).unwrap();
}

fn load_err(dir: &Path) -> String {
    load_kvc(dir, &Device::flex())
        .expect_err("load must fail")
        .to_string()
}

#[test]
fn save_load_round_trips_exactly() {
    let d = tempfile::tempdir().unwrap();
    let m = saved(d.path());
    let back = load_kvc(d.path(), &Device::flex()).unwrap();
    assert_eq!(back.config, m.config);
    assert_eq!(logits(&m), logits(&back));
    let names: Vec<String> = SafetensorsReader::open(&d.path().join("model.safetensors"))
        .unwrap()
        .names()
        .map(String::from)
        .collect();
    assert!(
        names.contains(&"blocks.1.attn.compressor.key_gate_bias".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"embed.weight".to_string()));
    assert!(names.contains(&"blocks.1.attn.key_shift".to_string()));
    // and through the generic loader
    let any = load_model(d.path(), &Device::flex()).unwrap();
    assert_eq!(any.info().strides(), vec![4]);
}

#[test]
fn missing_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    saved(d.path());
    rewrite(d.path(), |t| {
        t.remove("blocks.1.attn.w_k.weight");
    });
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors")
            && e.contains("blocks.1.attn.w_k.weight")
            && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn misshaped_tensor_names_expected_and_found() {
    let d = tempfile::tempdir().unwrap();
    saved(d.path());
    rewrite(d.path(), |t| {
        t.insert(
            "blocks.0.attn.w_q.weight".into(),
            OwnedTensor {
                shape: vec![16, 15],
                data: TensorValues::F32(vec![0.0; 240]),
            },
        );
    });
    let e = load_err(d.path());
    assert!(
        e.contains("blocks.0.attn.w_q.weight")
            && e.contains("expected shape [16, 16], found [16, 15]"),
        "{e}"
    );
}

#[test]
fn wrongly_typed_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    saved(d.path());
    rewrite(d.path(), |t| {
        t.insert(
            "final_norm.weight".into(),
            OwnedTensor {
                shape: vec![16],
                data: TensorValues::I64(vec![1; 16]),
            },
        );
    });
    let e = load_err(d.path());
    assert!(e.contains("final_norm.weight") && e.contains("I64"), "{e}");
}

#[test]
fn truncated_file_is_an_error_not_a_panic() {
    let d = tempfile::tempdir().unwrap();
    saved(d.path());
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
    std::fs::write(&p, &bytes[..5]).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("too short"), "{e}");
}

#[test]
fn unknown_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    saved(d.path());
    rewrite(d.path(), |t| {
        t.insert(
            "blocks.0.attn.extra".into(),
            OwnedTensor {
                shape: vec![2],
                data: TensorValues::F32(vec![0.0; 2]),
            },
        );
    });
    let e = load_err(d.path());
    assert!(
        e.contains("blocks.0.attn.extra") && e.contains("unknown"),
        "{e}"
    );
}

#[test]
fn config_errors_name_the_field() {
    let d = tempfile::tempdir().unwrap();
    saved(d.path());
    let p = d.path().join("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replace("\"n_kv_heads\": 1", "\"n_kv_heads\": 3")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("n_kv_heads"), "{e}");
    std::fs::write(
        &p,
        text.replace("\"gate\": \"scalar\"", "\"gate\": \"fancy\""),
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("fancy")
            && e.contains("scalar")
            && e.contains("vector")
            && e.contains("uniform"),
        "{e}"
    );
    std::fs::write(&p, text.replace("\"d_ff\"", "\"d_fff\"")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("d_fff") && e.contains("line"), "{e}");
}

fn phaselens(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn forward_command_with_and_without_captures() {
    let d = tempfile::tempdir().unwrap();
    let m = saved(&d.path().join("model"));
    let ids = d.path().join("ids.json");
    std::fs::write(&ids, "[[1,2,3,4,5,6,7,8,9], [9,8,7,6,5,4,3,2,1]]").unwrap();
    let out = d.path().join("out.safetensors");
    let model = d.path().join("model");
    let (model_s, ids_s, out_s) = (
        model.to_str().unwrap(),
        ids.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let o = phaselens(&[
        "forward", "--model", model_s, "--input", ids_s, "--out", out_s,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = SafetensorsReader::open(&out).unwrap();
    let (shape, v) = r.read_f32("logits").unwrap();
    assert_eq!(shape, vec![2, 9, 29]);
    assert_eq!(r.names().count(), 1);
    // same numbers as the library
    let x = Tensor::<2, Int>::from_data(
        TensorData::new(
            vec![1i64, 2, 3, 4, 5, 6, 7, 8, 9, 9, 8, 7, 6, 5, 4, 3, 2, 1],
            [2, 9],
        ),
        &Device::flex(),
    );
    let lib = m
        .forward(x, &HookSpec::new())
        .unwrap()
        .logits
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    assert_eq!(v, lib);

    let o = phaselens(&[
        "forward",
        "--model",
        model_s,
        "--input",
        ids_s,
        "--out",
        out_s,
        "--capture",
        "blocks.*.attn.hook_z",
        "--capture",
        "hook_embed",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = SafetensorsReader::open(&out).unwrap();
    let names: Vec<&str> = r.names().collect();
    assert_eq!(
        names,
        vec![
            "blocks.0.attn.hook_z",
            "blocks.1.attn.hook_z",
            "hook_embed",
            "logits"
        ]
    );
    assert_eq!(
        r.read_f32("blocks.1.attn.hook_z").unwrap().0,
        vec![2, 9, 2, 8]
    );
}

#[test]
fn forward_command_rejects_bad_input_clearly() {
    let d = tempfile::tempdir().unwrap();
    saved(&d.path().join("model"));
    let model = d.path().join("model");
    let out = d.path().join("o.safetensors");
    let cases = [
        ("[[1,2,3],[1,2]]", "ragged"),
        ("[[1,2,300]]", "token id 300 is out of the vocabulary 0..29"),
        ("[]", "empty"),
        ("{\"a\": 1}", "expected a JSON array"),
    ];
    for (i, (json, want)) in cases.iter().enumerate() {
        let ids = d.path().join(format!("ids{i}.json"));
        std::fs::write(&ids, json).unwrap();
        let o = phaselens(&[
            "forward",
            "--model",
            model.to_str().unwrap(),
            "--input",
            ids.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{json}: {err}");
    }
    let ids = d.path().join("good.json");
    std::fs::write(&ids, "[[1,2,3]]").unwrap();
    let o = phaselens(&[
        "forward",
        "--model",
        model.to_str().unwrap(),
        "--input",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--capture",
        "blocks.0.attn.hook_nope",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown hook point"));
    let o = phaselens(&[
        "forward",
        "--model",
        "/nonexistent",
        "--input",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/config.json"));
}
