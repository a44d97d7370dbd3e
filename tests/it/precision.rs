//! The bf16 compute dtype (`--dtype bf16`, `[model] dtype`; src/model/precision.rs;
//! issue 22 §1). Its matrix products take bf16 operands, sum in f32 and round the
//! result to bf16; the rest stays f32, as under `torch.autocast(dtype=torch.bfloat16)`.
//! Checked here:
//! - the products' exact semantics on flex and LibTorch;
//! - stored (BF16 / FP8 / FP4) weights, dequantised straight to bf16, multiply as dense
//!   f32 weights do under bf16;
//! - DeepSeek-V4 logits against transformers under CPU autocast
//!   (tests/fixtures/deepseek_v4/autocast_bf16.py);
//! - the runner: a bf16 run never resumes f32 shards, and `[model] dtype` equals `--dtype`;
//! - the CLI's refusals.

use std::path::Path;

use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use phaselens::device::DeviceSpec;
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::flops::Mm;
use phaselens::model::precision::{ComputeDtype, with_compute};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::stored::Residency;
use phaselens::output::{Table, read_long_rows};
use phaselens::runner::{RunOptions, run_experiment};

use crate::common::runner::*;
use crate::common::{phaselens, v4_fixture, vals};

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

fn matrix(v: Vec<f32>, shape: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

/// On `spec`: a bf16 product equals the f32 product of the bf16-rounded operands,
/// rounded to bf16 (within one bf16 step where the backend sums in another order), and
/// differs from the f32 product.
fn bf16_product_semantics(spec: DeviceSpec, exact: bool) {
    let device = spec.device().unwrap();
    let (m, k, n) = (37, 300, 29);
    let a = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 1.0), &Device::flex());
    let b = Tensor::<2>::random([k, n], Distribution::Normal(0.0, 1.0), &Device::flex());
    let (av, bv) = (vals(a), vals(b));
    let f32_product = |x: &[f32], y: &[f32]| {
        vals(matrix(x.to_vec(), [m, k], &device).matmul(matrix(y.to_vec(), [k, n], &device)))
    };
    let want = round_bf16(&f32_product(&round_bf16(&av), &round_bf16(&bv)));
    let plain = f32_product(&av, &bv);
    let got = with_compute(ComputeDtype::Bf16, || {
        let out = matrix(av.clone(), [m, k], &device).mm(matrix(bv.clone(), [k, n], &device));
        assert_eq!(
            out.dtype(),
            burn::tensor::DType::F32,
            "{spec}: the result comes back as f32"
        );
        vals(out)
    });
    // f32 again once the scope is left.
    let after = vals(matrix(av.clone(), [m, k], &device).mm(matrix(bv.clone(), [k, n], &device)));
    assert_eq!(after, plain, "{spec}: f32 after the bf16 scope");
    let mut off_by_a_step = 0;
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        if g != w {
            // One bf16 step (8 bits of mantissa) at this magnitude.
            let step = w.abs().max(g.abs()) / 128.0;
            assert!(
                !exact && (g - w).abs() <= step,
                "{spec}: element {i}: bf16 product {g}, expected {w} (f32 product {})",
                plain[i]
            );
            off_by_a_step += 1;
        }
    }
    let moved = got.iter().zip(&plain).filter(|(g, p)| g != p).count();
    eprintln!(
        "{spec}: {} products, {off_by_a_step} one bf16 step off the rounded f32 product, {moved} differ from f32",
        got.len()
    );
    assert!(
        moved > got.len() / 2,
        "{spec}: bf16 products equal the f32 ones ({moved} of {} differ)",
        got.len()
    );
}

#[test]
fn bf16_products_round_operands_and_result_on_flex() {
    bf16_product_semantics(DeviceSpec::Cpu, true);
}

#[cfg(feature = "tch")]
#[test]
fn bf16_products_round_operands_and_result_on_libtorch() {
    bf16_product_semantics(DeviceSpec::TchCpu, false);
}

fn load(name: &str, residency: Residency) -> DeepseekV4Model {
    deepseek_v4::load_with(&v4_fixture(name), &Device::flex(), residency).unwrap()
}

fn f32s(r: &SafetensorsReader, key: &str) -> Vec<f32> {
    r.read_f32(key).unwrap().1
}

/// Per position, the largest |difference| of two `[1, t, vocab]` logit tensors.
fn per_position(a: &[f32], b: &[f32], vocab: usize) -> Vec<f32> {
    a.chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max)
        })
        .collect()
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The discrete choices (router experts, indexer entries) of a forward.
fn choices(m: &DeepseekV4Model, ids: Tensor<2, Int>) -> Vec<(String, Vec<f32>)> {
    let spec = HookSpec::new()
        .capture("blocks.*.mlp.hook_router_topk")
        .unwrap()
        .capture("blocks.*.attn.indexer.hook_topk")
        .unwrap();
    let out = m.forward(ids, &spec).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = out
        .cache
        .iter()
        .map(|(p, a)| (p.to_string(), a.to_vec()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// DeepSeek-V4 in bf16 against transformers under CPU autocast bf16: phaselens' bf16
/// logits are as far from the f32 logits as autocast's are (median over positions of the
/// largest |difference|, within a factor of 2), both stored and f32-resident weights give
/// the same bf16 logits, and the f32 mode stays at parity. A discrete choice (router,
/// indexer) whose f32 margin is below bf16's error can flip: the flips are counted and
/// the positions they reach are left out of the median (they move one position's logits
/// by up to ~1).
fn bf16_matches_autocast(name: &str) {
    let r = SafetensorsReader::open(&v4_fixture(name).join("autocast-bf16.safetensors")).unwrap();
    let (s, ids) = r.read_i64("input_ids").unwrap();
    let tokens =
        || Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [s[0], s[1]]), &Device::flex());
    let (autocast, reference) = (f32s(&r, "logits"), f32s(&r, "logits_f32"));
    let vocab = reference.len() / (s[0] * s[1]);
    let stored = load(name, Residency::Stored);
    let f32_logits = vals(stored.forward(tokens(), &HookSpec::new()).unwrap().logits);
    let ours = with_compute(ComputeDtype::Bf16, || {
        vals(stored.forward(tokens(), &HookSpec::new()).unwrap().logits)
    });
    let dense = with_compute(ComputeDtype::Bf16, || {
        let m = load(name, Residency::F32);
        vals(m.forward(tokens(), &HookSpec::new()).unwrap().logits)
    });
    assert_eq!(
        ours, dense,
        "{name}: bf16 logits of stored vs f32-resident weights"
    );
    let f32_err = per_position(&f32_logits, &reference, vocab);
    assert!(
        f32_err.iter().all(|&e| e < 1e-4),
        "{name}: f32 mode left parity: {f32_err:?}"
    );
    // Positions where a choice flips under bf16 (a flip moves its own position's logits;
    // later positions read it only through attention, at bf16's noise).
    let (c32, c16) = (
        choices(&stored, tokens()),
        with_compute(ComputeDtype::Bf16, || choices(&stored, tokens())),
    );
    // Rows are (batch row, position) pairs; a capture's last axis holds one row's choices.
    let rows = s[0] * s[1];
    let mut flipped = vec![false; rows];
    let mut flips = 0;
    for ((p, a), (_, b)) in c32.iter().zip(&c16) {
        let per = a.len() / rows;
        for (row, (x, y)) in a.chunks(per).zip(b.chunks(per)).enumerate() {
            if x != y {
                flips += 1;
                flipped[row] = true;
                eprintln!(
                    "{name}: {p} row {} position {}: f32 chose {x:?}, bf16 {y:?}",
                    row / s[1],
                    row % s[1]
                );
            }
        }
    }
    let ours_err = per_position(&ours, &reference, vocab);
    let autocast_err = per_position(&autocast, &reference, vocab);
    let keep = |e: &[f32]| -> Vec<f32> {
        e.iter()
            .zip(&flipped)
            .zip(&autocast_err)
            // autocast's own flips: a position it moves by ~10x its median
            .filter(|((_, f), a)| !**f && **a < 5.0 * median(autocast_err.clone()))
            .map(|((e, _), _)| *e)
            .collect()
    };
    let (ours_kept, autocast_kept) = (keep(&ours_err), keep(&autocast_err));
    assert!(
        ours_kept.len() * 2 >= rows,
        "{name}: only {} of {rows} positions free of flips",
        ours_kept.len()
    );
    let (mo, ma) = (median(ours_kept.clone()), median(autocast_kept));
    eprintln!(
        "{name}: {flips} choices flip under bf16; over {} of {rows} positions, median largest |dlogit| vs f32: phaselens bf16 {mo:.3e}, transformers autocast {ma:.3e}",
        ours_kept.len()
    );
    assert!(
        mo > ma / 2.0 && mo < ma * 2.0,
        "{name}: phaselens bf16 error {mo:.3e} vs autocast's {ma:.3e}: not bf16's size"
    );
    let largest = ours_kept.iter().copied().fold(0.0, f32::max);
    let autocast_largest = autocast_err.iter().copied().fold(0.0, f32::max);
    assert!(
        largest < 3.0 * autocast_largest,
        "{name}: a position without flips is {largest:.3e} off (autocast at most {autocast_largest:.3e})"
    );
}

#[test]
fn deepseek_v4_flash_bf16_matches_transformers_autocast() {
    bf16_matches_autocast("flash");
}

#[test]
fn deepseek_v4_pro_bf16_matches_transformers_autocast() {
    bf16_matches_autocast("pro");
}

/// FP8 / FP4 / BF16 stored weights dequantise straight to bf16 in blocked products: the
/// logits equal those of the same weights dequantised to f32 on load, under bf16.
#[test]
fn stored_weights_multiply_in_bf16_as_dense_ones() {
    for name in ["fp4_experts", "original_fp8"] {
        let r = SafetensorsReader::open(&v4_fixture(name).join("reference.safetensors")).unwrap();
        let (s, ids) = r.read_i64("input_ids").unwrap();
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(ids, [s[0], s[1]]), &Device::flex());
        let run = |res| {
            with_compute(ComputeDtype::Bf16, || {
                vals(
                    load(name, res)
                        .forward(tokens.clone(), &HookSpec::new())
                        .unwrap()
                        .logits,
                )
            })
        };
        let (a, b) = (run(Residency::Stored), run(Residency::F32));
        assert_eq!(a, b, "{name}: stored vs f32-resident weights under bf16");
        let f32_logits = vals(
            load(name, Residency::Stored)
                .forward(tokens.clone(), &HookSpec::new())
                .unwrap()
                .logits,
        );
        assert_ne!(a, f32_logits, "{name}: bf16 changed nothing");
    }
}

/// run_shards' patch-heads experiment on the organism "tiny", with `line` added to its
/// `[model]`.
fn patch_with(line: &str) -> String {
    crate::run_shards::PATCH.replace(
        "organism = \"tiny\"",
        &format!("organism = \"tiny\"\n{line}"),
    )
}

fn values(dir: &Path, name: &str) -> Vec<f64> {
    let t = Table::read_arrow(dir.join("notebooks-data").join(name).join("heads.arrow")).unwrap();
    read_long_rows(&t)
        .unwrap()
        .iter()
        .map(|r| r.value)
        .collect()
}

/// A bf16 run computes its own shards (never resuming f32 ones), its tables differ from
/// f32's, and `[model] dtype = "bf16"` is the same run as `--dtype bf16`.
#[test]
fn bf16_runs_keep_their_own_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    organism(d, "tiny", &tiny(2, 2, 1, 4, 4), 7);
    let exp = experiment(d, "e.toml", &patch_with(""));
    let f = run_experiment(&exp, &opts(d)).unwrap();
    assert!(f.stats.cells_computed > 0);
    let f32_values = values(d, &f.name);
    let bf16 = RunOptions {
        dtype: Some(ComputeDtype::Bf16),
        ..opts(d)
    };
    let b = run_experiment(&exp, &bf16).unwrap();
    assert_eq!(
        b.stats.cells_computed, f.stats.cells_computed,
        "the bf16 run resumed f32 shards"
    );
    let bf16_values = values(d, &b.name);
    assert_eq!(bf16_values.len(), f32_values.len());
    assert_ne!(bf16_values, f32_values, "bf16 changed no value");
    // The file's key is the same setting: it resumes the --dtype run's shards.
    let keyed = experiment(d, "e.toml", &patch_with("dtype = \"bf16\""));
    let k = run_experiment(&keyed, &opts(d)).unwrap();
    assert_eq!(
        k.stats.cells_computed, 0,
        "[model] dtype = \"bf16\" did not resume --dtype bf16"
    );
    assert_eq!(values(d, &k.name), bf16_values);
    // And f32 still resumes its own.
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    let bad = experiment(d, "bad.toml", &patch_with("dtype = \"f16\""));
    let e = format!("{:#}", run_experiment(&bad, &opts(d)).unwrap_err());
    // The TOML line of the key, the value and the allowed ones.
    assert!(
        e.contains("bad.toml: line 8") && e.contains("`f16`") && e.contains("`bf16`"),
        "{e}"
    );
}

/// `--dtype` on the command line: an unknown dtype and a device without bf16 (wgpu) are
/// refused with the reason; `forward --dtype bf16` writes bf16 logits.
#[test]
fn cli_dtype_refusals_and_forward() {
    let tmp = tempfile::tempdir().unwrap();
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, "[[3, 9, 27, 81, 243, 5, 15, 45]]").unwrap();
    let dir = v4_fixture("flash");
    let out = tmp.path().join("o.safetensors");
    let args = |dtype: &'static str, device: &'static str| {
        vec![
            "forward".to_string(),
            "--model".into(),
            dir.display().to_string(),
            "--input".into(),
            ids.display().to_string(),
            "--out".into(),
            out.display().to_string(),
            "--dtype".into(),
            dtype.into(),
            "--device".into(),
            device.into(),
        ]
    };
    let run = |a: Vec<String>| phaselens(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(args("f16", "cpu"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("`f16`") && err.contains("bf16"),
        "{err}"
    );
    #[cfg(feature = "wgpu")]
    {
        let o = run(args("bf16", "wgpu"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains("wgpu has no bf16"),
            "wgpu with bf16: {err}"
        );
    }
    let logits = |dtype| {
        let o = run(args(dtype, "cpu"));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        SafetensorsReader::open(&out)
            .unwrap()
            .read_f32("logits")
            .unwrap()
            .1
    };
    let (a, b) = (logits("f32"), logits("bf16"));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(
        d > 1e-3 && d < 2.0,
        "forward --dtype bf16 vs f32: largest difference {d}"
    );
}
