//! Training-free compression overlays (`select`, `pool`) on kvc-family models: with a
//! budget that keeps everything they are the plain forward; their hook points; their
//! config errors. The forward contract under overlays (prefix invariance, suffix
//! forwards = decoding over a base run's state, batch independence) is in
//! model_contract.rs.

use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::HookSpec;
use phaselens::model::compression::Overlay;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{KvcConfig, KvcModel, LanguageModel};

use crate::common::{dev, max_rel, vals};

fn model(seed: u64) -> KvcModel {
    let mut c = KvcConfig::tiny().full_attention();
    c.n_layers = 3;
    KvcModel::new(&c, &Vb::new(&RandomInit { seed }, &dev())).unwrap()
}

fn ids(len: usize, vocab: usize, seed: u64) -> Tensor<2, Int> {
    let mut x = seed | 1;
    let v: Vec<i64> = (0..2 * len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % vocab as u64) as i64
        })
        .collect();
    Tensor::from_data(TensorData::new(v, [2, len]), &dev())
}

fn logits(m: &dyn LanguageModel, t: Tensor<2, Int>) -> Vec<f32> {
    vals(m.forward(t, &HookSpec::new()).unwrap().logits)
}

fn overlay(s: &str) -> Overlay {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn select_keeping_every_block_is_the_plain_forward() {
    let plain = model(3);
    let want = logits(&plain, ids(70, 37, 5));
    // Window 1 (only the query itself raw), every block kept: every earlier token is
    // read as a selected entry, in the same softmax.
    for spec in [
        "kind=select,block=4,top_k=100,window=1",
        "kind=select,block=8,top_k=9,window=3,offset=5",
        "kind=select,block=4,top_k=100,window=1,score=mean",
        "kind=select,block=16,top_k=1,window=80",
    ] {
        let m = model(3).with_overlay(&overlay(spec)).unwrap();
        let got = logits(&m, ids(70, 37, 5));
        let err = max_rel(&got, &want);
        assert!(err < 1e-5, "{spec}: relative difference {err:e}");
    }
}

#[test]
fn select_with_a_small_budget_changes_the_output() {
    let want = logits(&model(3), ids(70, 37, 5));
    let m = model(3)
        .with_overlay(&overlay("kind=select,block=4,top_k=1,window=4"))
        .unwrap();
    let got = logits(&m, ids(70, 37, 5));
    assert!(
        max_rel(&got, &want) > 1e-3,
        "a budget of 1 block of 4 must change the logits"
    );
}

#[test]
fn evict_keeping_every_chunk_is_the_plain_forward() {
    let want = logits(&model(5), ids(60, 37, 8));
    for spec in [
        "kind=evict,chunk=4,keep=1,observe=8",
        "kind=evict,chunk=8,keep=0.25,observe=60",
        "kind=evict,chunk=5,keep=1.0,observe=1,offset=2,sinks=3",
    ] {
        let m = model(5).with_overlay(&overlay(spec)).unwrap();
        let err = max_rel(&logits(&m, ids(60, 37, 8)), &want);
        assert!(err < 1e-5, "{spec}: relative difference {err:e}");
    }
}

#[test]
fn evict_changes_only_the_observation_window() {
    // Queries before the window ran before the cache was compressed: their logits are
    // the plain forward's; the window's change when most chunks are gone.
    let want = logits(&model(5), ids(60, 37, 8));
    let m = model(5)
        .with_overlay(&overlay("kind=evict,chunk=4,keep=0.2,observe=10"))
        .unwrap();
    let got = logits(&m, ids(60, 37, 8));
    let v = 37;
    for row in 0..2 {
        let at = |x: &[f32], p: usize| x[(row * 60 + p) * v..(row * 60 + p + 1) * v].to_vec();
        for p in 0..50 {
            assert!(
                max_rel(&at(&got, p), &at(&want, p)) < 1e-5,
                "row {row} position {p} changed"
            );
        }
        let late = max_rel(&at(&got, 59), &at(&want, 59));
        assert!(
            late > 1e-3,
            "row {row}: the last position did not change ({late:e})"
        );
    }
}

/// With `decode = 3` the cache is compressed when the prefill ends, 3 tokens before the
/// sequence does: nothing before those 3 tokens may depend on them. Without it the
/// observation window reads them, and earlier window positions change with them (the
/// leak `decode` closes: teacher-forced answer tokens choosing the chunks).
#[test]
fn evict_decode_keeps_the_answer_tokens_out_of_the_eviction() {
    let (len, v) = (60, 37);
    let a = ids(len, v, 8);
    let mut tail = vals(a.clone().float());
    for row in 0..2 {
        for p in len - 3..len {
            let i = row * len + p;
            tail[i] = ((tail[i] as usize + 11) % v) as f32;
        }
    }
    let tail: Vec<i64> = tail.into_iter().map(|x| x as i64).collect();
    let b = Tensor::<2, Int>::from_data(TensorData::new(tail, [2, len]), &dev());
    let max_change = |spec: &str| {
        let m = model(5).with_overlay(&overlay(spec)).unwrap();
        let (la, lb) = (logits(&m, a.clone()), logits(&m, b.clone()));
        (0..2)
            .flat_map(|row| (0..len - 3).map(move |p| (row * len + p) * v))
            .map(|i| max_rel(&la[i..i + v], &lb[i..i + v]))
            .fold(0.0f32, f32::max)
    };
    let sealed = max_change("kind=evict,chunk=4,keep=0.2,observe=10,decode=3");
    assert!(
        sealed < 1e-6,
        "prefill logits changed with the decode tokens: {sealed:e}"
    );
    let leaky = max_change("kind=evict,chunk=4,keep=0.2,observe=10");
    assert!(
        leaky > 1e-4,
        "without decode the window should read them: {leaky:e}"
    );
}

#[test]
fn pool_of_single_token_windows_is_the_plain_forward() {
    // W = S = 1, no raw tail: entry i is token i's key (rotated at i) and value.
    let want = logits(&model(4), ids(50, 37, 6));
    let m = model(4)
        .with_overlay(&overlay("kind=pool,window=1,stride=1"))
        .unwrap();
    let err = max_rel(&logits(&m, ids(50, 37, 6)), &want);
    assert!(err < 1e-5, "relative difference {err:e}");
}

#[test]
fn select_exposes_block_scores_and_the_kept_blocks() {
    let m = model(3)
        .with_overlay(&overlay("kind=select,block=4,top_k=2,window=8"))
        .unwrap();
    let spec = HookSpec::new()
        .capture("blocks.1.attn.indexer.hook_scores")
        .unwrap()
        .capture("blocks.1.attn.indexer.hook_selected")
        .unwrap();
    let out = m.forward(ids(40, 37, 7), &spec).unwrap();
    let sel = out
        .cache
        .get_name("blocks.1.attn.indexer.hook_selected")
        .unwrap();
    assert_eq!(sel.shape(), &[2, 40, 10]); // 40 tokens in blocks of 4
    let v = sel.to_vec();
    for p in 0..40 {
        let kept: f32 = v[p * 10..(p + 1) * 10].iter().sum();
        // Blocks with a token before the window: those starting at <= p - 8.
        let candidates = if p >= 8 { (p - 8) / 4 + 1 } else { 0 };
        assert_eq!(kept as usize, candidates.min(2), "position {p}");
    }
    let scores = out
        .cache
        .get_name("blocks.1.attn.indexer.hook_scores")
        .unwrap();
    assert_eq!(scores.shape(), &[2, 40, 10]);
}

#[test]
fn overlay_errors_name_the_key() {
    for (spec, key) in [
        ("kind=select,block=0,top_k=4,window=32", "compression.block"),
        ("kind=select,block=8,top_k=0,window=32", "compression.top_k"),
        ("kind=select,block=8,top_k=2,window=0", "compression.window"),
        (
            "kind=select,block=8,top_k=2,window=4,offset=8",
            "compression.offset",
        ),
        ("kind=pool,window=4,stride=8", "compression.window"),
        ("kind=select,block=8,top_k=2,window=4,topk=3", "topk"),
        ("kind=squeeze,block=8", "squeeze"),
        ("block=8,top_k=2", "kind"),
        ("kind=select,block=eight,top_k=2,window=4", "block"),
        ("kind=evict,chunk=8,keep=0,observe=16", "compression.keep"),
        ("kind=evict,chunk=8,keep=1.5,observe=16", "compression.keep"),
        (
            "kind=evict,chunk=0,keep=0.5,observe=16",
            "compression.chunk",
        ),
        (
            "kind=evict,chunk=8,keep=0.5,observe=0",
            "compression.observe",
        ),
    ] {
        let e = spec.parse::<Overlay>().unwrap_err();
        assert!(e.contains(key), "{spec}: `{e}` does not name `{key}`");
    }
    // A context shorter than the block.
    let mut c = KvcConfig::tiny().full_attention();
    c.arch.max_positions = Some(16);
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 1 }, &dev())).unwrap();
    let e = m
        .with_overlay(&overlay("kind=select,block=32,top_k=2,window=4"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("compression.block"), "{e}");
    // A model that already compresses.
    let m = KvcModel::new(
        &KvcConfig::tiny(),
        &Vb::new(&RandomInit { seed: 1 }, &dev()),
    )
    .unwrap();
    let e = m
        .with_overlay(&overlay("kind=pool,window=8,stride=8"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("compression") && e.contains("already"), "{e}");
}

/// Decoding over a compressed cache: a suffix forward of the last positions over a
/// base run's state (its keys, values and the window's queries) gives the full
/// forward's logits there, for `evict` (whose chunk choice reads the observation
/// window's queries) and `select`.
#[test]
fn suffix_forwards_over_the_state_equal_the_full_forward() {
    use phaselens::hooks::Act;
    use phaselens::model::Suffix;
    for spec in [
        "kind=evict,chunk=4,keep=0.3,observe=12",
        "kind=evict,chunk=4,keep=0.3,observe=12,decode=5,offset=1,sinks=2",
        "kind=select,block=4,top_k=2,window=6,sinks=1",
    ] {
        let m = model(6).with_overlay(&overlay(spec)).unwrap();
        let t = ids(64, 37, 9);
        let capture = HookSpec::new().capture("blocks.0.hook_resid_pre").unwrap();
        let (out, state) = LanguageModel::forward_with_state(&m, t, &capture).unwrap();
        let state = state.expect("kvc models keep a prefix state");
        let full = vals(out.logits);
        let resid = out.cache.get_name("blocks.0.hook_resid_pre").unwrap();
        for (from, len) in [(56usize, 8usize), (60, 4), (40, 24)] {
            let v = resid.to_vec();
            let d = resid.shape()[2];
            let mut part = Vec::new();
            for r in 0..2 {
                part.extend_from_slice(&v[(r * 64 + from) * d..(r * 64 + from + len) * d]);
            }
            let resid_s = Act::from_vec(part, vec![2, len, d], &dev()).unwrap();
            let suffix = Suffix {
                rows: vec![0, 1],
                from: vec![from, from],
                len,
            };
            let got =
                LanguageModel::forward_suffix(&m, 0, &state, &suffix, &resid_s, &HookSpec::new());
            let got = vals(got.unwrap().logits);
            let mut want = Vec::new();
            for r in 0..2 {
                want.extend_from_slice(&full[(r * 64 + from) * 37..(r * 64 + from + len) * 37]);
            }
            let err = max_rel(&got, &want);
            assert!(
                err < 1e-5,
                "{spec}, positions {from}..{}: relative difference {err:e}",
                from + len
            );
        }
    }
}
