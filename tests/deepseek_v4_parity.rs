//! DeepSeek-V4 parity with transformers 5.24 (fixtures made by
//! tests/fixtures/deepseek_v4/generate.py): logits and saved intermediate activations,
//! the release naming + FP8 fixture, loader errors, and `phaselens forward`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::{Act, ActivationCache, HookSpec};
use phaselens::model::LanguageModel;
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::safetensors_io::SafetensorsReader;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name)
}

struct Reference {
    r: SafetensorsReader,
}

impl Reference {
    fn open(name: &str) -> Self {
        Reference {
            r: SafetensorsReader::open(&fixture(name).join("reference.safetensors")).unwrap(),
        }
    }
    fn has(&self, k: &str) -> bool {
        self.r.entry(k).is_some()
    }
    fn f32(&self, k: &str) -> (Vec<usize>, Vec<f32>) {
        self.r.read_f32(k).unwrap()
    }
    fn i64(&self, k: &str) -> (Vec<usize>, Vec<i64>) {
        self.r.read_i64(k).unwrap()
    }
    fn keys(&self) -> Vec<String> {
        self.r.names().map(|s| s.to_string()).collect()
    }
}

/// max |a - b| / max |b|
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length");
    let mut d = 0f64;
    let mut m = 0f64;
    for (x, y) in a.iter().zip(b) {
        d = d.max((*x as f64 - *y as f64).abs());
        m = m.max((*y as f64).abs());
    }
    d / m.max(1e-30)
}

fn tokens(ids: &[i64], shape: &[usize]) -> Tensor<2, Int> {
    Tensor::from_data(
        TensorData::new(ids.to_vec(), [shape[0], shape[1]]),
        &Device::flex(),
    )
}

fn get<'a>(cache: &'a ActivationCache, name: &str) -> &'a Act {
    cache
        .get_name(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

const TOL: f64 = 1e-4;

/// Everything a fixture saves, checked against our hooks.
fn check_fixture(name: &str) -> f64 {
    let device = Device::flex();
    let m: DeepseekV4Model = deepseek_v4::load(&fixture(name), &device).unwrap();
    let c = m.config.clone();
    let r = Reference::open(name);
    let (s, ids) = r.i64("input_ids");
    let (b, t) = (s[0], s[1]);
    let spec = HookSpec::new().capture("**").unwrap();
    let out = m.forward(tokens(&ids, &s), &spec).unwrap();
    let cache = out.cache;
    let logits = out.logits.into_data().try_into_vec::<f32>().unwrap();

    let mut errs: Vec<(String, f64)> = Vec::new();
    let mut cmp = |what: &str, got: &[f32], want: &[f32]| {
        errs.push((what.to_string(), rel(got, want)));
    };
    cmp("logits", &logits, &r.f32("logits").1);
    let logits_err = rel(&logits, &r.f32("logits").1);
    let mut checked = BTreeSet::new();
    let geo = m.geometry(t, &device);
    for key in r.keys() {
        let parts: Vec<&str> = key.split('.').collect();
        let hook = |n: &str| get(&cache, n).to_vec();
        match parts.as_slice() {
            ["embeddings"] => cmp(&key, &hook("hook_embed"), &r.f32(&key).1),
            ["final", "norm"] => cmp(&key, &hook("hook_final_norm"), &r.f32(&key).1),
            ["layers", l, "output"] => cmp(
                &key,
                &hook(&format!("blocks.{l}.hook_resid_post")),
                &r.f32(&key).1,
            ),
            [
                "layers",
                l,
                hc @ ("attn_hc" | "ffn_hc"),
                w @ ("pre" | "post" | "comb"),
            ] => {
                let site = if *hc == "attn_hc" {
                    "attn_hc"
                } else {
                    "mlp_hc"
                };
                cmp(
                    &key,
                    &hook(&format!("blocks.{l}.{site}.hook_{w}")),
                    &r.f32(&key).1,
                )
            }
            ["layers", l, "self_attn", "output"] => cmp(
                &key,
                &hook(&format!("blocks.{l}.hook_attn_out")),
                &r.f32(&key).1,
            ),
            ["layers", l, "self_attn", "o_a_input"] => {
                // [B,S,G,nh*D/G] is [B,S,nh,D] in memory.
                cmp(
                    &key,
                    &hook(&format!("blocks.{l}.attn.hook_z")),
                    &r.f32(&key).1,
                )
            }
            ["layers", l, "mlp", "output"] => cmp(
                &key,
                &hook(&format!("blocks.{l}.hook_mlp_out")),
                &r.f32(&key).1,
            ),
            ["layers", l, "router", "logits"] => {
                // our hook holds the scores: score_fn(logits)
                let (_, lg) = r.f32(&key);
                let f: fn(f64) -> f64 = match c.scoring_func {
                    deepseek_v4::config::ScoringFunc::Sqrtsoftplus => |x| (x.exp().ln_1p()).sqrt(),
                    deepseek_v4::config::ScoringFunc::Sigmoid => |x| 1.0 / (1.0 + (-x).exp()),
                    deepseek_v4::config::ScoringFunc::Softmax => unreachable!(),
                };
                let want: Vec<f32> = lg.iter().map(|&x| f(x as f64) as f32).collect();
                cmp(
                    &format!("{key} (as scores)"),
                    &hook(&format!("blocks.{l}.mlp.hook_router_scores")),
                    &want,
                )
            }
            ["layers", l, "router", "indices"] => {
                let (sh, want) = r.i64(&key);
                let k = sh[1];
                let got = hook(&format!("blocks.{l}.mlp.hook_router_topk"));
                let gw = hook(&format!("blocks.{l}.mlp.hook_router_weights"));
                let mut sorted_w = Vec::new();
                for row in 0..b * t {
                    let mut pairs: Vec<(i64, f32)> = (0..k)
                        .map(|j| (got[row * k + j] as i64, gw[row * k + j]))
                        .collect();
                    pairs.sort_by_key(|p| p.0);
                    let gi: Vec<i64> = pairs.iter().map(|p| p.0).collect();
                    assert_eq!(gi, want[row * k..(row + 1) * k], "{name} {key} row {row}");
                    sorted_w.extend(pairs.iter().map(|p| p.1));
                }
                let wk = format!("layers.{l}.router.weights");
                if r.has(&wk) {
                    cmp(&wk, &sorted_w, &r.f32(&wk).1);
                }
            }
            ["layers", l, "router", "weights"] => {
                let _ = l; // checked with the indices
                continue;
            }
            ["layers", l, "compressor", "entries"] => {
                let l: usize = l.parse().unwrap();
                let (sh, want) = r.f32(&key);
                if sh[2] == 0 {
                    continue;
                }
                let ck = get(
                    &cache,
                    &format!("blocks.{l}.attn.compressor.hook_compressed_k"),
                )
                .get::<4>()
                .unwrap();
                let starts = match c.layer_types[l] {
                    deepseek_v4::config::AttnType::Hca => &geo.hca.as_ref().unwrap().2,
                    _ => &geo.csa.as_ref().unwrap().starts,
                };
                let got = deepseek_v4::rope::rotate(ck, starts, false)
                    .into_data()
                    .try_into_vec::<f32>()
                    .unwrap();
                cmp(&format!("{key} (rotated hook_compressed_k)"), &got, &want)
            }
            ["layers", l, "compressor", "block_bias"] => {
                // visible entries = where attention can put weight; pattern slots are
                // [compressed entries ; raw tokens ; sink].
                let (sh, bias) = r.f32(&key);
                let n = sh[3];
                let p = hook(&format!("blocks.{l}.attn.hook_pattern"));
                let nk = n + t + 1;
                for bb in 0..b {
                    for q in 0..t {
                        for e in 0..n {
                            let visible = bias[(bb * t + q) * n + e] == 0.0;
                            // head 0
                            let pv = p[((bb * c.num_attention_heads) * t + q) * nk + e];
                            assert_eq!(pv > 0.0, visible, "{name} {key} b{bb} t{q} e{e}");
                        }
                    }
                }
                checked.insert(key.clone());
                continue;
            }
            ["layers", l, "indexer", "scores"] => {
                let (sh, want) = r.f32(&key);
                if sh[2] == 0 {
                    continue;
                }
                cmp(
                    &key,
                    &hook(&format!("blocks.{l}.attn.indexer.hook_scores")),
                    &want,
                )
            }
            ["layers", l, "indexer", "topk_indices"] => {
                let (sh, want) = r.i64(&key);
                if sh[2] == 0 {
                    continue;
                }
                let got = hook(&format!("blocks.{l}.attn.indexer.hook_topk"));
                let k = sh[2];
                for row in 0..b * t {
                    let g: BTreeSet<i64> = got[row * k..(row + 1) * k]
                        .iter()
                        .map(|&x| x as i64)
                        .collect();
                    let w: BTreeSet<i64> = want[row * k..(row + 1) * k].iter().copied().collect();
                    assert_eq!(g, w, "{name} {key} row {row}");
                }
                checked.insert(key.clone());
                continue;
            }
            // no hook for these: covered by the tensors around them
            ["layers", _, "attn_hc" | "ffn_hc", "collapsed"]
            | ["layers", _, "indexer", "kv_norm_output"]
            | ["final", "hc_head"]
            | ["input_ids"]
            | ["logits"] => continue,
            ["dequant", ..] => continue,
            _ => panic!("{name}: reference tensor {key} is not checked"),
        }
        checked.insert(key.clone());
    }
    let worst = errs
        .iter()
        .cloned()
        .fold(("".to_string(), 0f64), |a, e| if e.1 > a.1 { e } else { a });
    eprintln!(
        "{name}: logits max|diff|/max|logit| = {logits_err:.3e}; {} intermediates checked, worst {} = {:.3e}",
        checked.len(),
        worst.0,
        worst.1
    );
    for (k, e) in &errs {
        assert!(*e <= TOL, "{name}: {k}: relative error {e:.3e} > {TOL:.0e}");
    }
    logits_err
}

#[test]
fn parity_flash() {
    check_fixture("flash");
}

#[test]
fn parity_pro() {
    check_fixture("pro");
}

#[test]
fn parity_long() {
    check_fixture("long");
}

#[test]
fn parity_original_fp8() {
    check_fixture("original_fp8");
}
