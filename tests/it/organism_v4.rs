//! DeepSeek-V4 organisms: the v4pro-mini recipe builds, trains a step, saves and loads
//! back exactly.

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::load_model;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::train::{ModelConfig, OrganismFile};

fn recipe() -> OrganismFile {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/organisms/v4pro-mini.toml");
    OrganismFile::load(&p).unwrap()
}

#[test]
fn v4pro_mini_saves_and_loads_back_exactly() {
    let f = recipe();
    let ModelConfig::DeepseekV4 { json, resolved } = &f.model else {
        panic!("v4pro-mini is a DeepSeek-V4 organism");
    };
    let device = Device::flex();
    let m = DeepseekV4Model::new(resolved, &Vb::new(&RandomInit { seed: 3 }, &device)).unwrap();
    let d = tempfile::tempdir().unwrap();
    deepseek_v4::save(&m, json, d.path()).unwrap();
    let back = load_model(d.path(), &device).unwrap();
    let ids: Vec<i64> = (0..2 * 41).map(|i| (i * 7 % 128) as i64).collect();
    let x = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 41]), &device);
    let a = m
        .forward(x.clone(), &HookSpec::new())
        .unwrap()
        .logits
        .into_data();
    let b = back
        .forward(x, &HookSpec::new())
        .unwrap()
        .logits
        .into_data();
    assert_eq!(
        a.try_into_vec::<f32>().unwrap(),
        b.try_into_vec::<f32>().unwrap()
    );
    // the schedule is the Pro one: 2 HCA layers, then CSA/HCA alternating
    let info = back.info();
    assert_eq!(info.strides(), vec![4, 8]);
}

#[test]
fn v4pro_mini_trains_and_resumes() {
    let d = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/organisms/v4pro-mini.toml"),
    )
    .unwrap();
    // The shipped recipe with a tiny [train] section.
    let text: String = src
        .lines()
        .map(|l| {
            let key = l.split('=').next().unwrap_or("").trim();
            match key {
                "batch_size" => "batch_size = 2".to_string(),
                "steps" => "steps = 2".to_string(),
                "checkpoint_every" => "checkpoint_every = 1".to_string(),
                "name" => format!("{l}\nrun_dir = \"run\""),
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(text.contains("steps = 2\n") && text.contains("batch_size = 2\n"));
    let r = d.path().join("v4pro-mini.toml");
    std::fs::write(&r, text).unwrap();
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_phaselens"))
            .arg("train")
            .arg(&r)
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&["--max-steps", "1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("resumed from step 1"),
        "{err}"
    );
    let m = load_model(&d.path().join("v4pro-mini"), &Device::flex()).unwrap();
    assert_eq!(m.info().n_layers(), 4);
}
