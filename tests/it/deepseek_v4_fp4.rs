//! DeepSeek-V4 with FP4 routed experts (`expert_dtype = "fp4"`, issue 22): the
//! `fp4_experts` fixture (tests/fixtures/deepseek_v4/generate.py, make_fp4_experts) is a
//! release-named checkpoint whose routed experts are packed e2m1 + ue8m0 scales per 32
//! columns (transformers' layout; its dequantisation checked bit-exactly there), the rest
//! FP8 128 x 128 / BF16. Parity of the logits and captured activations with transformers'
//! forward of the dequantised weights, exact dequantisation, and loader errors for FP4 /
//! FP8 tensors whose scales have the wrong shape or dtype.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::weights::{Init, WeightSource};

const FIXTURE: &str = "fp4_experts";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4/fp4_experts")
}

fn reference() -> SafetensorsReader {
    SafetensorsReader::open(&fixture().join("reference.safetensors")).unwrap()
}

/// (max |a - b|, max |b|)
fn err(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len(), "length");
    a.iter().zip(b).fold((0f64, 0f64), |(d, m), (x, y)| {
        (
            d.max((*x as f64 - *y as f64).abs()),
            m.max((*y as f64).abs()),
        )
    })
}

#[test]
fn fp4_expert_checkpoint_matches_transformers() {
    let device = Device::flex();
    let m: DeepseekV4Model = deepseek_v4::load(&fixture(), &device).unwrap();
    let r = reference();
    let (s, ids) = r.read_i64("input_ids").unwrap();
    let tokens: Tensor<2, Int> =
        Tensor::from_data(TensorData::new(ids.clone(), [s[0], s[1]]), &device);
    let spec = HookSpec::new().capture("hook_final_norm").unwrap();
    let out = m.forward(tokens, &spec).unwrap();
    let logits = out.logits.into_data().try_into_vec::<f32>().unwrap();
    let (d, mx) = err(&logits, &r.read_f32("logits").unwrap().1);
    eprintln!(
        "{FIXTURE}: logits max|diff| {d:.3e}, max|ref| {mx:.3e}, relative {:.3e}",
        d / mx
    );
    assert!(d <= 1e-4 * mx, "logits max|diff| {d} > 1e-4 * {mx}");
    let norm = out.cache.get_name("hook_final_norm").unwrap().to_vec();
    let (d, mx) = err(&norm, &r.read_f32("final.norm").unwrap().1);
    eprintln!("{FIXTURE}: final norm max|diff| {d:.3e}");
    assert!(d <= 1e-4 * mx, "final norm max|diff| {d} > 1e-4 * {mx}");
}

#[test]
fn fp4_experts_dequantise_exactly() {
    let src = deepseek_v4::V4Checkpoint::open_dir(&fixture(), [128, 128]).unwrap();
    let r = reference();
    // layer 1, routed experts [E=4, 2I=128, H=64]: expert 2's w1 is rows 0..64 of its block
    let gate_up = src
        .float(
            "model.layers.1.mlp.experts.gate_up_proj",
            &[4, 128, 64],
            Init::Zeros,
        )
        .unwrap();
    let (_, want) = r
        .read_f32("dequant.layers.1.ffn.experts.2.w1.weight")
        .unwrap();
    let at = 2 * 128 * 64;
    assert_eq!(&gate_up[at..at + 64 * 64], &want[..]);
    // layer 2 down [E, H=64, I=64]: expert 3
    let down = src
        .float(
            "model.layers.2.mlp.experts.down_proj",
            &[4, 64, 64],
            Init::Zeros,
        )
        .unwrap();
    let (_, want) = r
        .read_f32("dequant.layers.2.ffn.experts.3.w2.weight")
        .unwrap();
    assert_eq!(&down[3 * 64 * 64..], &want[..]);
    // FP8 next to FP4 in the same file
    let q = src
        .float(
            "model.layers.1.self_attn.q_a_proj.weight",
            &[256, 64],
            Init::Zeros,
        )
        .unwrap();
    assert_eq!(
        q,
        r.read_f32("dequant.layers.1.attn.wq_a.weight").unwrap().1
    );
}

// ---------------------------------------------------------------------------------------
// Loader errors, on edited copies of the fixture (safetensors rewritten tensor by tensor).

// The raw safetensors editor is shared with the parity tests' loader-error cases.
use crate::deepseek_v4_parity::{Raw, read_raw, write_raw};

/// A copy of the fixture with model.safetensors edited; returns the load error.
fn load_error(edit: impl FnOnce(&mut Vec<Raw>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let p = dir.path().join("model.safetensors");
    let mut t = read_raw(&p);
    edit(&mut t);
    write_raw(&p, &t);
    match phaselens::model::load_model(dir.path(), &Device::flex()) {
        Ok(_) => panic!("edited {FIXTURE} loaded without error"),
        Err(e) => e.to_string(),
    }
}

fn find<'a>(t: &'a mut [Raw], name: &str) -> &'a mut Raw {
    t.iter_mut().find(|x| x.name == name).unwrap()
}

#[test]
fn fp4_scale_with_wrong_shape_is_named() {
    // [64, 2] -> [32, 4]: same bytes, wrong grid
    let e = load_error(|t| find(t, "layers.1.ffn.experts.2.w1.scale").shape = vec![32, 4]);
    assert!(
        e.contains("layers.1.ffn.experts.2.w1.scale")
            && e.contains("layers.1.ffn.experts.2.w1.weight")
            && e.contains("[32, 4]")
            && e.contains("expected [64, 2]"),
        "{e}"
    );
}

#[test]
fn fp4_scale_with_wrong_dtype_is_named() {
    // an F8_E4M3 scale (NVFP4-style) is not what DeepSeek / transformers store
    let e = load_error(|t| find(t, "layers.2.ffn.experts.0.w2.scale").dtype = "F8_E4M3".into());
    assert!(
        e.contains("layers.2.ffn.experts.0.w2.scale")
            && e.contains("layers.2.ffn.experts.0.w2.weight")
            && e.contains("F8_E4M3")
            && e.contains("F8_E8M0"),
        "{e}"
    );
}

#[test]
fn fp8_scale_with_wrong_dtype_is_named() {
    let e = load_error(|t| find(t, "layers.0.attn.wkv.scale").dtype = "I8".into());
    assert!(
        e.contains("layers.0.attn.wkv.scale")
            && e.contains("layers.0.attn.wkv.weight")
            && e.contains("dtype I8"),
        "{e}"
    );
}

#[test]
fn fp4_weight_with_wrong_packing_or_no_scale_is_named() {
    // unpacked width: [64, 64] int8 instead of [64, 32]
    let e = load_error(|t| {
        let w = find(t, "layers.1.ffn.experts.1.w3.weight");
        w.shape = vec![64, 64];
        w.bytes = [w.bytes.clone(), w.bytes.clone()].concat();
    });
    assert!(
        e.contains("layers.1.ffn.experts.1.w3.weight")
            && e.contains("packed FP4")
            && e.contains("[64, 32]")
            && e.contains("found [64, 64]"),
        "{e}"
    );
    // the scale of a packed weight is missing
    let e = load_error(|t| t.retain(|x| x.name != "layers.0.ffn.experts.3.w1.scale"));
    assert!(
        e.contains("layers.0.ffn.experts.3.w1.weight") && e.contains("FP4"),
        "{e}"
    );
}

#[test]
fn u8_exponent_scales_read_like_ue8m0() {
    // transformers reads U8 scales as ue8m0 exponent bytes: same values, same logits
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let p = dir.path().join("model.safetensors");
    let mut t = read_raw(&p);
    for x in t.iter_mut().filter(|x| x.dtype == "F8_E8M0") {
        x.dtype = "U8".into();
    }
    write_raw(&p, &t);
    let a = deepseek_v4::V4Checkpoint::open_dir(&fixture(), [128, 128]).unwrap();
    let b = deepseek_v4::V4Checkpoint::open_dir(dir.path(), [128, 128]).unwrap();
    for name in [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.experts.down_proj",
    ] {
        let shape = if name.ends_with("gate_up_proj") {
            [4, 128, 64]
        } else {
            [4, 64, 64]
        };
        assert_eq!(
            a.float(name, &shape, Init::Zeros).unwrap(),
            b.float(name, &shape, Init::Zeros).unwrap(),
            "{name}"
        );
    }
}
