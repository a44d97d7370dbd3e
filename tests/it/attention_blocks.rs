//! The shared attention core computes over blocks of queries (memory linear in the keys
//! a query sees); a hooked `hook_pattern` runs the same layer as one dense block over the
//! full key layout. Both must compute the same function, for every model family and
//! geometry, in plain and suffix forwards, whatever the block size; and the blocked
//! path's largest score tensor must not grow with the sequence length.

use std::path::Path;

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::{HookPoint, HookSpec, Site};
use phaselens::model::attention::{BLOCK_BUDGET, take_largest_block, with_block_budget};
use phaselens::model::kvc::{GateMode, KvcConfig, KvcModel};
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{LanguageModel, Suffix, deepseek_v4};

use crate::common::*;

fn dev() -> Device {
    Device::flex()
}

fn kvc_configs() -> Vec<(&'static str, KvcConfig)> {
    let t = KvcConfig::tiny;
    let mut no_sink = t().with_compression(8, 8, 0);
    no_sink.sink = false;
    let mut vector = t().with_compression(6, 3, 2);
    if let Some(c) = vector.compression.as_mut() {
        c.gate = GateMode::Vector;
    }
    let mut shifted_full = t().full_attention();
    shifted_full.key_shift = true;
    let mut shifted = t().with_compression(6, 3, 2);
    shifted.key_shift = true;
    vec![
        ("w4s4", t()),
        ("w8s4", t().with_compression(8, 4, 0)),
        ("w8s8-no-sink", no_sink),
        ("w6s3-tail2-vector", vector),
        ("w5s5-tail7", t().with_compression(5, 5, 7)),
        ("full", t().full_attention()),
        ("full-key-shift", shifted_full),
        ("w6s3-tail2-key-shift", shifted),
    ]
}

fn kvc(c: &KvcConfig, seed: u64) -> KvcModel {
    KvcModel::new(c, &Vb::new(&RandomInit { seed }, &dev())).unwrap()
}

fn random_tokens(rows: usize, t: usize, vocab: usize, seed: u64) -> Tensor<2, Int> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let ids: Vec<i64> = (0..rows * t)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as i64
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows, t]), &dev())
}

/// Capturing every layer's `hook_pattern` makes every layer dense.
fn dense_spec(n_layers: usize) -> HookSpec {
    let mut spec = HookSpec::new();
    for l in 0..n_layers {
        spec = spec.capture_point(HookPoint::block(l, Site::AttnPattern));
    }
    spec
}

fn check_plain(name: &str, m: &dyn LanguageModel, tokens: Tensor<2, Int>) {
    let n = m.info().n_layers();
    let dense = vals(m.forward(tokens.clone(), &dense_spec(n)).unwrap().logits);
    for budget in [1, 300, 5_000, 100_000] {
        let blocked = with_block_budget(budget, || {
            vals(m.forward(tokens.clone(), &HookSpec::new()).unwrap().logits)
        });
        let err = max_rel(&blocked, &dense);
        assert!(
            err <= 1e-5,
            "{name}: budget {budget}: blocked vs dense {err:e}"
        );
    }
}

/// Suffix forwards with rows at different positions (the per-row gathered band).
fn check_suffix(name: &str, m: &dyn LanguageModel, tokens: Tensor<2, Int>) {
    let n = m.info().n_layers();
    let [rows, t] = tokens.dims();
    let mut spec = HookSpec::new();
    for l in 0..n {
        spec = spec.capture_point(HookPoint::block(l, Site::ResidPre));
    }
    let (out, state) = m.forward_with_state(tokens, &spec).unwrap();
    let state = state.expect("suffix state");
    let len = 5;
    let sfx = Suffix {
        rows: (0..rows).rev().chain(0..rows).collect(),
        from: (0..2 * rows).map(|i| (7 + 31 * i) % (t - len)).collect(),
        len,
    };
    for start in [0, n - 1] {
        let base = out
            .cache
            .get(&HookPoint::block(start, Site::ResidPre))
            .unwrap()
            .select_batch(&sfx.rows)
            .unwrap();
        // Each row's positions from[r]..from[r]+len of the residual entering `start`.
        let mut shape = base.shape().to_vec();
        let per: usize = shape[2..].iter().product();
        let all = base.to_vec();
        let mut picked = Vec::new();
        for (r, &f) in sfx.from.iter().enumerate() {
            picked.extend_from_slice(&all[(r * t + f) * per..(r * t + f + len) * per]);
        }
        shape[1] = len;
        let resid = phaselens::hooks::Act::from_vec(picked, shape, &dev()).unwrap();
        let dense = vals(
            m.forward_suffix(start, &state, &sfx, &resid, &dense_spec(n))
                .unwrap()
                .logits,
        );
        for budget in [1, 400] {
            let blocked = with_block_budget(budget, || {
                vals(
                    m.forward_suffix(start, &state, &sfx, &resid, &HookSpec::new())
                        .unwrap()
                        .logits,
                )
            });
            let err = max_rel(&blocked, &dense);
            assert!(
                err <= 1e-5,
                "{name}: suffix from block {start}, budget {budget}: blocked vs dense {err:e}"
            );
        }
    }
}

#[test]
fn kvc_blocked_attention_equals_the_dense_layout() {
    for (i, (name, c)) in kvc_configs().into_iter().enumerate() {
        let m = kvc(&c, 11 + i as u64);
        let tokens = random_tokens(3, 61, c.vocab_size, 5 + i as u64);
        check_plain(name, &m, tokens.clone());
        check_suffix(name, &m, tokens);
    }
}

#[test]
fn deepseek_v4_blocked_attention_equals_the_dense_layout() {
    for name in ["flash", "pro", "long"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/deepseek_v4")
            .join(name);
        let m = deepseek_v4::load(&dir, &dev()).unwrap();
        let tokens = random_tokens(2, 83, m.config.vocab_size, 17);
        check_plain(name, &m, tokens.clone());
        check_suffix(name, &m, tokens);
    }
}

#[test]
fn the_largest_attention_block_does_not_grow_with_the_sequence() {
    let budget = 1 << 14;
    for (name, c) in [
        ("full", KvcConfig::tiny().full_attention()),
        ("w4s4-tail8", KvcConfig::tiny().with_compression(4, 4, 8)),
    ] {
        let m = kvc(&c, 3);
        let mut largest = Vec::new();
        for t in [256, 1024, 2048] {
            let tokens = random_tokens(1, t, c.vocab_size, t as u64);
            take_largest_block();
            with_block_budget(budget, || m.forward(tokens, &HookSpec::new()).unwrap());
            largest.push(take_largest_block());
        }
        // One query row over every key (full attention) is the floor: n_heads * (T + 1).
        for (t, l) in [256usize, 1024, 2048].iter().zip(&largest) {
            let floor = c.n_heads * (t + 2);
            assert!(
                *l <= budget.max(floor),
                "{name}: T = {t}: a block of {l} score elements (budget {budget})"
            );
            assert!(*l > 0, "{name}: the blocked path ran");
        }
    }
    // With the default budget, a 4096-token forward never builds its [T, T] scores.
    let m = kvc(&KvcConfig::tiny().full_attention(), 4);
    take_largest_block();
    m.forward(random_tokens(1, 4096, 37, 9), &HookSpec::new())
        .unwrap();
    let l = take_largest_block();
    assert!(l <= BLOCK_BUDGET, "{l} > {BLOCK_BUDGET}");
    assert!(l < 4 * 4096 * 4096, "{l}");
}
