//! The hook points that expose (and let an experiment change) what a compressed layer
//! reads: the lightning indexer's choice (`attn.indexer.hook_selected`) and the
//! compressors' pre-softmax gate logits (`attn.compressor.hook_{key,value}_gate_logits`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::{Act, Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::deepseek_v4::config::AttnType;
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::kvc::{KvcConfig, KvcModel};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::weights::{RandomInit, Vb};

use crate::common::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name)
}

/// A fixture's model and input ids.
fn v4(name: &str) -> (DeepseekV4Model, Tensor<2, Int>) {
    let device = Device::flex();
    let m = deepseek_v4::load(&fixture(name), &device).unwrap();
    let r = SafetensorsReader::open(&fixture(name).join("reference.safetensors")).unwrap();
    let (shape, ids) = r.read_i64("input_ids").unwrap();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [shape[0], shape[1]]), &device);
    (m, tokens)
}

fn csa_layers(m: &DeepseekV4Model) -> Vec<usize> {
    (0..m.config.num_hidden_layers)
        .filter(|&l| m.config.layer_types[l] == AttnType::Csa)
        .collect()
}

fn logits(m: &DeepseekV4Model, tokens: &Tensor<2, Int>, spec: &HookSpec) -> Vec<f32> {
    vals(m.forward(tokens.clone(), spec).unwrap().logits)
}

#[test]
fn hook_selected_is_the_top_k_of_the_closed_entries() {
    // ties_default: 257+ tokens with many exactly tied indexer scores.
    let (m, tokens) = v4("ties_default");
    let layers = csa_layers(&m);
    assert!(!layers.is_empty());
    let mut spec = HookSpec::new();
    for &l in &layers {
        spec = spec
            .capture_point(HookPoint::block(l, Site::IndexerSelected))
            .capture_point(HookPoint::block(l, Site::IndexerTopk));
    }
    let out = m.forward(tokens.clone(), &spec).unwrap();
    // Capturing the choice runs the layer dense; the numbers stay those of the blocked run.
    let plain = logits(&m, &tokens, &HookSpec::new());
    assert!(max_rel(&vals(out.logits), &plain) < 1e-5);
    let k = m.config.index_topk;
    let [b, t] = tokens.dims();
    for &l in &layers {
        let sel = out
            .cache
            .get(&HookPoint::block(l, Site::IndexerSelected))
            .unwrap();
        let n = sel.shape()[2];
        assert_eq!(sel.shape(), &[b, t, n]);
        let sel = sel.to_vec();
        let topk = out
            .cache
            .get(&HookPoint::block(l, Site::IndexerTopk))
            .unwrap()
            .to_vec();
        for row in 0..b * t {
            let pos = row % t;
            let closed = ((pos + 1) / m.config.csa_rate).min(n);
            let kept: Vec<usize> = (0..n).filter(|&s| sel[row * n + s] == 1.0).collect();
            assert!(
                sel[row * n..(row + 1) * n]
                    .iter()
                    .all(|&x| x == 0.0 || x == 1.0)
            );
            assert_eq!(kept.len(), k.min(closed), "layer {l} row {row}");
            assert!(
                kept.iter().all(|&s| s < closed),
                "layer {l} row {row}: open entry kept"
            );
            let listed: Vec<usize> = topk[row * k..(row + 1) * k]
                .iter()
                .filter(|&&x| x >= 0.0)
                .map(|&x| x as usize)
                .collect();
            assert_eq!(kept, listed, "layer {l} row {row}: hook_topk disagrees");
        }
    }
}

#[test]
fn changing_hook_selected_changes_what_later_queries_read() {
    let (m, tokens) = v4("ties_default");
    let [b, t] = tokens.dims();
    let v = m.config.vocab_size;
    let l = csa_layers(&m)[0];
    let point = HookPoint::block(l, Site::IndexerSelected);
    let base = logits(&m, &tokens, &HookSpec::new());
    let captured = m
        .forward(tokens.clone(), &HookSpec::new().capture_point(point))
        .unwrap()
        .cache;
    // Patching the choice with itself is the identity.
    let same =
        HookSpec::new().intervene_point(point, Action::Patch(Arc::new(captured)), Scope::all());
    assert!(max_rel(&logits(&m, &tokens, &same), &base) < 1e-5);
    // Dropping every entry from position p on changes the logits there, never before.
    let p = t / 2;
    let drop = HookSpec::new().intervene_point(
        point,
        Action::Zero,
        Scope::all().with_positions((p..t).collect::<Vec<_>>()),
    );
    let dropped = logits(&m, &tokens, &drop);
    for r in 0..b {
        let at = |x: &[f32], a: usize, z: usize| x[(r * t + a) * v..(r * t + z) * v].to_vec();
        assert!(max_rel(&at(&dropped, 0, p), &at(&base, 0, p)) < 1e-5);
        assert!(max_rel(&at(&dropped, p, t), &at(&base, p, t)) > 1e-4);
    }
    // Keeping every entry reads only the closed ones: the model stays causal (a prefix
    // run under the same intervention gives the same logits).
    let all = HookSpec::new().intervene_point(
        point,
        Action::Add(Act::new(Tensor::<3>::ones([1, 1, 1], &Device::flex()))),
        Scope::all(),
    );
    let full = logits(&m, &tokens, &all);
    assert!(full.iter().all(|x| x.is_finite()));
    assert!(max_rel(&full, &base) > 1e-4);
    let cut = 100.min(t - 1);
    let prefix = logits(&m, &tokens.clone().slice_dim(1, 0..cut), &all);
    for r in 0..b {
        let got = &prefix[r * cut * v..(r + 1) * cut * v];
        let want = &full[r * t * v..(r * t + cut) * v];
        assert!(max_rel(got, want) < 1e-5, "row {r}: an open entry was read");
    }
}

#[test]
fn v4_gate_logits_are_the_gates_before_their_softmax() {
    let (m, tokens) = v4("pro");
    let base = logits(&m, &tokens, &HookSpec::new());
    let spec = HookSpec::new()
        .capture("blocks.*.attn.compressor.hook_*gate*")
        .unwrap();
    let out = m.forward(tokens.clone(), &spec).unwrap();
    assert!(max_rel(&vals(out.logits), &base) < 1e-6);
    let mut seen = 0;
    for l in 0..m.config.num_hidden_layers {
        for (logit_site, gate_site) in [
            (Site::KeyGateLogits, Site::KeyGate),
            (Site::ValueGateLogits, Site::ValueGate),
        ] {
            let Some(lg) = out.cache.get(&HookPoint::block(l, logit_site)) else {
                continue;
            };
            let gate = out.cache.get(&HookPoint::block(l, gate_site)).unwrap();
            assert_eq!(lg.shape(), gate.shape());
            let soft = burn::tensor::activation::softmax(lg.get::<5>().unwrap(), 2);
            assert!(max_diff(&vals(soft), &gate.to_vec()) < 1e-6, "layer {l}");
            seen += 1;
        }
    }
    assert!(seen >= 4, "no compressed layer exposed its gate logits");
    // A constant added to every offset's logit leaves the softmax, so the logits, alone;
    // a per-offset change does not.
    let first = (0..m.config.num_hidden_layers)
        .find(|&l| m.config.layer_types[l] != AttnType::Sliding)
        .unwrap();
    let point = HookPoint::block(first, Site::KeyGateLogits);
    let shift = HookSpec::new().intervene_point(
        point,
        Action::Add(Act::new(Tensor::<5>::full(
            [1, 1, 1, 1, 1],
            3.0,
            &Device::flex(),
        ))),
        Scope::all(),
    );
    assert!(max_rel(&logits(&m, &tokens, &shift), &base) < 1e-5);
    let slots = out.cache.get(&point).unwrap().shape()[2];
    let ramp: Vec<f32> = (0..slots).map(|o| o as f32).collect();
    let ramp = Tensor::<1>::from_data(TensorData::new(ramp, [slots]), &Device::flex())
        .reshape([1, 1, slots, 1, 1]);
    let tilt = HookSpec::new().intervene_point(point, Action::Add(Act::new(ramp)), Scope::all());
    assert!(max_rel(&logits(&m, &tokens, &tilt), &base) > 1e-4);
}

/// A tiny kvc model whose key-gate biases are `bias(layer)` (`[window, kv_heads]`).
fn kvc_with_bias(cfg: &KvcConfig, bias: impl Fn(usize) -> Tensor<2>) -> KvcModel {
    let mut m = KvcModel::new(cfg, &Vb::new(&RandomInit { seed: 7 }, &dev())).unwrap();
    for (l, block) in m.blocks.iter_mut().enumerate() {
        let comp = block.attn.compressor.as_mut().unwrap();
        comp.key_gate_bias = Some(Param::from_tensor(bias(l)));
    }
    m
}

#[test]
fn kvc_bias_roll_through_the_gate_logits_equals_a_rolled_bias() {
    let cfg = KvcConfig::tiny().with_compression(8, 4, 4);
    let (w, kvh) = (8, cfg.n_kv_heads);
    let bias = |l: usize| {
        let v: Vec<f32> = (0..w * kvh)
            .map(|i| ((i * 7 + l * 3) % 11) as f32 * 0.4 - 2.0)
            .collect();
        Tensor::<2>::from_data(TensorData::new(v, [w, kvh]), &dev())
    };
    let shift = 3;
    let rolled = |l: usize| {
        let b = bias(l);
        Tensor::cat(
            vec![
                b.clone().slice_dim(0, w - shift..w),
                b.slice_dim(0, 0..w - shift),
            ],
            0,
        )
    };
    let m = kvc_with_bias(&cfg, bias);
    let want = kvc_with_bias(&cfg, rolled);
    let ids: Vec<i64> = (0..2 * 61).map(|i| (i * 13 % 37) as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 61]), &dev());
    let mut spec = HookSpec::new()
        .capture("blocks.*.attn.compressor.**")
        .unwrap();
    for l in 0..cfg.n_layers {
        let delta = (rolled(l) - bias(l)).reshape([1, 1, w, kvh]);
        spec = spec.intervene_point(
            HookPoint::block(l, Site::KeyGateLogits),
            Action::Add(Act::new(delta)),
            Scope::all(),
        );
    }
    let got = m.forward(tokens.clone(), &spec).unwrap();
    let reference = want.forward(tokens.clone(), &HookSpec::new()).unwrap();
    assert!(max_rel(&vals(got.logits), &vals(reference.logits)) < 1e-5);
    let plain = m.forward(tokens.clone(), &HookSpec::new()).unwrap();
    let base = want.forward(tokens, &HookSpec::new()).unwrap();
    assert!(max_rel(&vals(plain.logits), &vals(base.logits)) > 1e-4);
    // Scalar gates: logits [b, entry, offset, kv_head], and their softmax is the gate.
    let lg = got
        .cache
        .get(&HookPoint::block(0, Site::KeyGateLogits))
        .unwrap();
    assert_eq!(lg.shape(), &[2, (61 - 8) / 4 + 1, 8, kvh]);
    let gate = got.cache.get(&HookPoint::block(0, Site::KeyGate)).unwrap();
    let soft = burn::tensor::activation::softmax(lg.get::<4>().unwrap(), 2);
    assert!(max_diff(&vals(soft), &gate.to_vec()) < 1e-6);
}
