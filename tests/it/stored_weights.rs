//! Weights resident in the dtype they are stored in (issue 22 §1): the FP8 + FP4 + BF16
//! fixtures loaded with `--weights stored` (BF16 / FP8 / FP4 bytes kept, dequantised
//! where used) and with `--weights f32` (dequantised on load) give the same logits and
//! captures bit for bit; the stored model holds about its checkpoint's bytes, counted
//! from the model, the f32 one 4 bytes per value; a malformed scale is the same error,
//! naming the tensor, under both. (Placed over two devices with host experts:
//! tests/it/placement.rs.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::stored::{Residency, take_largest_dequant, with_dequant_budget};

use crate::common::{phaselens, vals};
use crate::deepseek_v4_parity::{read_raw, write_raw};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name)
}

fn load(name: &str, residency: Residency) -> DeepseekV4Model {
    deepseek_v4::load_with(&fixture(name), &Device::flex(), residency).unwrap()
}

/// The reference input ids of a fixture.
fn input(name: &str) -> Tensor<2, Int> {
    let r = SafetensorsReader::open(&fixture(name).join("reference.safetensors")).unwrap();
    let (s, ids) = r.read_i64("input_ids").unwrap();
    Tensor::from_data(TensorData::new(ids, [s[0], s[1]]), &Device::flex())
}

/// Logits and every capture of both residencies agree exactly.
fn same_bits(name: &str) {
    let (f, s) = (load(name, Residency::F32), load(name, Residency::Stored));
    let spec = HookSpec::new().capture("**").unwrap();
    let a = f.forward(input(name), &spec).unwrap();
    let b = s.forward(input(name), &spec).unwrap();
    let (la, lb) = (vals(a.logits), vals(b.logits));
    let differ = la.iter().zip(&lb).filter(|(x, y)| x != y).count();
    eprintln!(
        "{name}: {} logits, {differ} differ between stored and f32 residency",
        la.len()
    );
    assert_eq!(la, lb, "{name}: logits");
    assert_eq!(a.cache.len(), b.cache.len());
    assert!(a.cache.len() > 20, "{name}: {} captures", a.cache.len());
    for (p, act) in a.cache.iter() {
        assert_eq!(
            act.to_vec(),
            b.cache.get(p).unwrap().to_vec(),
            "{name}: {p}"
        );
    }
}

#[test]
fn fp4_experts_fixture_is_the_same_stored_or_f32() {
    same_bits("fp4_experts");
}

#[test]
fn sharded_release_fp8_fixture_is_the_same_stored_or_f32() {
    same_bits("original_fp8");
}

#[test]
fn realwidth_fixture_is_the_same_stored_or_f32() {
    same_bits("realwidth_ci");
}

/// Stored matrices are multiplied in blocks of rows, never dequantised whole when larger
/// than the budget: with a budget of 3077 values (3 rows of `realwidth_ci`'s widest
/// matrix, `o_a` with 1024 columns; the heads are 128 x 128 and 256 x 64, `wq_b` 2048 x
/// 64, so every large matrix is split, most into blocks of uneven length) the logits and
/// every capture equal the f32 residency's bit for bit, and a forward without hooks
/// dequantises less than twice the budget at once (a last block shorter than the blocks
/// joins the one before it).
#[test]
fn blocked_products_of_stored_matrices_give_the_same_bits() {
    let budget = 3 * 1024 + 5;
    for name in ["realwidth_ci", "fp4_experts"] {
        with_dequant_budget(budget, || {
            same_bits(name);
            let s = load(name, Residency::Stored);
            take_largest_dequant();
            s.forward(input(name), &HookSpec::new()).unwrap();
            let blocked = take_largest_dequant();
            eprintln!("{name}: at most {blocked} values dequantised at once (budget {budget})");
            assert!(blocked > 0 && blocked < 2 * budget, "{name}: {blocked}");
        });
        // the default budget holds each of these small matrices whole
        let s = load(name, Residency::Stored);
        take_largest_dequant();
        s.forward(input(name), &HookSpec::new()).unwrap();
        let whole = take_largest_dequant();
        assert!(whole > 2 * budget, "{name}: largest matrix {whole}");
    }
}

/// Bytes of the tensors of `name`'s checkpoint by dtype (as in the files), and the f32
/// bytes of their values once dequantised (packed FP4: two values a byte; scales none;
/// integers 8).
fn checkpoint_bytes(name: &str) -> (BTreeMap<String, usize>, usize) {
    let dir = fixture(name);
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let f = p.file_name().unwrap().to_string_lossy();
            f.starts_with("model") && f.ends_with(".safetensors")
        })
        .collect();
    let (mut by, mut f32) = (BTreeMap::new(), 0);
    for f in files {
        for t in read_raw(&f) {
            let n: usize = t.shape.iter().product();
            *by.entry(t.dtype.clone()).or_insert(0) += t.bytes.len();
            f32 += match t.dtype.as_str() {
                "F8_E8M0" => 0,
                "I8" => 8 * n,
                "I32" | "I64" => 8 * n,
                _ => 4 * n,
            };
        }
    }
    (by, f32)
}

#[test]
fn a_stored_model_holds_its_checkpoint_bytes_and_f32_four_per_value() {
    for name in ["fp4_experts", "realwidth_ci"] {
        let (file, f32_want) = checkpoint_bytes(name);
        let stored = load(name, Residency::Stored).resident_bytes();
        let f32 = load(name, Residency::F32).resident_bytes();
        eprintln!("{name}: checkpoint {file:?}");
        eprintln!("{name}: resident stored {stored:?}");
        eprintln!("{name}: resident f32 {f32:?}");
        // Every FP8 / FP4 / BF16 byte and every scale stays as it is in the file.
        for (label, dtype) in [
            ("fp4", "I8"),
            ("fp8", "F8_E4M3"),
            ("bf16", "BF16"),
            ("scales", "F8_E8M0"),
        ] {
            assert_eq!(stored.get(label), file.get(dtype), "{name}: {label}");
        }
        assert_eq!(stored.get("f32"), file.get("F32"), "{name}: f32 tensors");
        let total = |m: &BTreeMap<String, usize>| m.values().sum::<usize>() as f64;
        let file_total = total(&file);
        // Only the hash-routing table differs (I32 in the file, i64 resident).
        let rel = total(&stored) / file_total - 1.0;
        assert!((0.0..0.02).contains(&rel), "{name}: stored {rel:+.4}");
        assert_eq!(total(&f32) as usize, f32_want, "{name}: f32 bytes");
        let fp4 = *file.get("I8").unwrap() as f64;
        eprintln!(
            "{name}: f32 residency {:.2}x the stored bytes (FP4 experts {:.1}x, FP8 {:.1}x, BF16 {:.1}x)",
            total(&f32) / total(&stored),
            8.0 * fp4 / fp4,
            4.0,
            2.0
        );
        assert!(total(&f32) > 3.0 * total(&stored), "{name}");
    }
}

/// A copy of `name` with its first file edited; the load errors under both residencies.
fn load_errors(name: &str, edit: impl Fn(&mut Vec<crate::deepseek_v4_parity::Raw>)) -> [String; 2] {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let p = dir.path().join("model.safetensors");
    let mut t = read_raw(&p);
    edit(&mut t);
    write_raw(&p, &t);
    [Residency::Stored, Residency::F32].map(|r| {
        match deepseek_v4::load_with(dir.path(), &Device::flex(), r) {
            Ok(_) => panic!("edited {name} loaded with {r} weights"),
            Err(e) => e.to_string(),
        }
    })
}

#[test]
fn a_malformed_scale_is_named_with_stored_weights_as_with_f32() {
    let find = |t: &mut Vec<crate::deepseek_v4_parity::Raw>, n: &str| -> usize {
        t.iter().position(|x| x.name == n).unwrap()
    };
    // FP8 scale grid of the wrong shape: [2, 1] -> [1, 2]
    let [s, f] = load_errors("fp4_experts", |t| {
        let i = find(t, "layers.0.attn.wq_a.scale");
        let sh = t[i].shape.clone();
        t[i].shape = sh.into_iter().rev().collect();
    });
    assert_eq!(s, f);
    assert!(
        s.contains("layers.0.attn.wq_a.scale") && s.contains("layers.0.attn.wq_a.weight"),
        "{s}"
    );
    // A NaN ue8m0 scale of an FP4 expert (0xFF): named as a non-finite weight.
    let [s, f] = load_errors("fp4_experts", |t| {
        let i = find(t, "layers.1.ffn.experts.2.w3.scale");
        t[i].bytes[0] = 0xff;
    });
    assert_eq!(s, f);
    assert!(
        s.contains("layers.1.ffn.experts.2.w3.weight") && s.contains("non-finite"),
        "{s}"
    );
    // FP4 scale of a wrong dtype
    let [s, f] = load_errors("fp4_experts", |t| {
        let i = find(t, "layers.2.ffn.experts.1.w1.scale");
        t[i].dtype = "I8".into();
    });
    assert_eq!(s, f);
    assert!(
        s.contains("layers.2.ffn.experts.1.w1.scale") && s.contains("dtype I8"),
        "{s}"
    );
}

/// `bench forward --model DIR --weights stored|f32`: the model is held so (the sweep's
/// resident weight bytes: the FP4 + FP8 + BF16 fixture is 3x larger as f32); a bad value,
/// or --weights without --model, is clap's error.
#[test]
fn bench_forward_takes_weights() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("realwidth_ci");
    let model = model.to_str().unwrap();
    let mut bytes = Vec::new();
    let mut flops = Vec::new();
    for w in ["stored", "f32"] {
        let json = dir.path().join(format!("{w}.json"));
        let out = phaselens(&[
            "bench",
            "forward",
            "--model",
            model,
            "--tokens",
            "16",
            "--reps",
            "1",
            "--weights",
            w,
            "--json",
            json.to_str().unwrap(),
        ]);
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{e}");
        assert!(e.contains(&format!("weights {w}:")), "{e}");
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        bytes.push(j[0]["weights_bytes"].as_u64().unwrap());
        flops.push(j[0]["matmul_flops"].as_u64().unwrap());
        assert!(j[0]["gemm_gflops"].as_f64().unwrap() > 0.0, "{j}");
        assert!(
            out.stdout.windows(12).any(|w| w == b"of GEMM rate"),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    eprintln!("bench forward weights bytes, stored vs f32: {bytes:?}; matmul FLOPs {flops:?}");
    assert!(bytes[1] > 2 * bytes[0], "{bytes:?}");
    // The same products either way (stored weights multiply in row blocks), and at
    // least the LM head's 2 x tokens x hidden x vocab.
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(std::path::Path::new(model).join("config.json")).unwrap(),
    )
    .unwrap();
    let head = 2 * 16 * cfg["hidden_size"].as_u64().unwrap() * cfg["vocab_size"].as_u64().unwrap();
    assert_eq!(flops[0], flops[1]);
    assert!(flops[0] > head, "{flops:?} vs the head's {head}");
    let out = phaselens(&["bench", "forward", "--model", model, "--weights", "bf16"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(e.contains("bf16") && e.contains("`stored`"), "{e}");
    let out = phaselens(&["bench", "forward", "--weights", "f32"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(e.contains("--model"), "{e}");
}

/// `audit --weights` and the audit TOML's `[model] weights` (the flag wins): the model is
/// loaded so (FP4 bytes resident or not) before the audit's checks; bad values are named.
/// A budget too small for the CI width stops each audit right after loading.
#[test]
fn audit_takes_weights_from_the_flag_or_its_config() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = fixture("realwidth_ci");
    let model = model.to_str().unwrap();
    let cfg = d.join("audit.toml");
    std::fs::write(&cfg, "[model]\nweights = \"f32\"\n").unwrap();
    let audit = |out: &str, extra: &[&str]| {
        let out = d.join(out);
        let mut args = vec![
            "audit",
            model,
            "--plain",
            "--budget",
            "prompts=10",
            "--ci-width",
            "20pp",
            "--out",
        ];
        args.push(out.to_str().unwrap());
        args.extend_from_slice(extra);
        let o = phaselens(&args);
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let cfg = cfg.to_str().unwrap();
    for (out, extra, want) in [
        ("a", &["--weights", "f32"][..], "f32"),
        ("b", &["--config", cfg][..], "f32"),
        ("c", &["--config", cfg, "--weights", "stored"][..], "stored"),
    ] {
        let (code, e) = audit(out, extra);
        assert_eq!(code, Some(1), "{extra:?}: {e}");
        assert!(e.contains("budget is too small"), "{extra:?}: {e}");
        let line = e
            .lines()
            .find(|l| l.contains(": weights "))
            .unwrap_or_else(|| panic!("{extra:?}: no residency line in {e}"));
        assert!(
            line.contains(&format!("weights {want}:")),
            "{extra:?}: {line}"
        );
        assert_eq!(line.contains("fp4 "), want == "stored", "{extra:?}: {line}");
    }
    let (code, e) = audit("e", &["--weights", "half"]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("half") && e.contains("`f32`"), "{e}");
    std::fs::write(d.join("bad.toml"), "[model]\nweights = \"half\"\n").unwrap();
    let bad = d.join("bad.toml");
    let (code, e) = audit("f", &["--config", bad.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{e}");
    assert!(e.contains("bad.toml") && e.contains("half"), "{e}");
}
