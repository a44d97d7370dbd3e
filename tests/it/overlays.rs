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

/// Every layer's `[b, h, t, slots]` plain attention pattern of `m` on `t` (raw tokens
/// first, then the sink).
fn patterns(m: &KvcModel, t: Tensor<2, Int>, layers: usize) -> Vec<(Vec<usize>, Vec<f32>)> {
    let spec = HookSpec::new()
        .capture("blocks.*.attn.hook_pattern")
        .unwrap();
    let out = m.forward(t, &spec).unwrap();
    (0..layers)
        .map(|l| {
            let a = out
                .cache
                .get_name(&format!("blocks.{l}.attn.hook_pattern"))
                .unwrap();
            (a.shape().to_vec(), a.to_vec())
        })
        .collect()
}

/// The chunk of token `j` on a grid of `chunk`-token chunks whose boundaries sit at
/// `offset + i * chunk` (tokens before `offset` form chunk 0).
fn chunk_of(j: usize, chunk: usize, offset: usize) -> usize {
    if j < offset {
        0
    } else {
        (j - offset) / chunk + usize::from(offset > 0)
    }
}

/// `evict`'s chunk scores from the plain attention pattern `(shape, values)` of one
/// layer: per row, the observation queries `t0..end`'s attention, renormalised over the
/// raw tokens (the scores' softmax has no sink), summed over heads, queries and each
/// chunk's tokens before `t0`.
fn scores_from_pattern(
    (shape, p): &(Vec<usize>, Vec<f32>),
    (t0, end): (usize, usize),
    (chunk, offset, n): (usize, usize, usize),
) -> Vec<f32> {
    let [b, h, t, k] = <[usize; 4]>::try_from(shape.clone()).unwrap();
    let mut out = vec![0.0f32; b * n];
    for r in 0..b {
        for head in 0..h {
            for q in t0..end {
                let row = &p[((r * h + head) * t + q) * k..][..k];
                let raw: f32 = row[..=q].iter().sum();
                for j in 0..t0 {
                    out[r * n + chunk_of(j, chunk, offset)] += row[j] / raw;
                }
            }
        }
    }
    out
}

#[test]
fn evict_hooks_are_the_window_attention_per_chunk_and_its_top_keep() {
    // 60 tokens, decode 2, observe 10: the window is 48..58; offset 1: chunks {0},
    // 1..5, ..., 45..49 -> 13 chunks before the window.
    let (len, t0, end, n) = (60, 48, 58, 13);
    let spec = HookSpec::new()
        .capture("blocks.*.attn.indexer.hook_scores")
        .unwrap()
        .capture("blocks.*.attn.indexer.hook_selected")
        .unwrap();
    let plain = patterns(&model(5), ids(len, 37, 8), 3);
    let run = |keep: &str| {
        let o = format!("kind=evict,chunk=4,keep={keep},observe=10,offset=1,decode=2");
        let m = model(5).with_overlay(&overlay(&o)).unwrap();
        m.forward(ids(len, 37, 8), &spec).unwrap().cache
    };
    // keep = 1 is the plain forward, so every layer's scores are its plain pattern's.
    let all = run("1");
    for (l, pat) in plain.iter().enumerate() {
        let got = all
            .get_name(&format!("blocks.{l}.attn.indexer.hook_scores"))
            .unwrap();
        assert_eq!(got.shape(), &[2, n], "layer {l}");
        let want = scores_from_pattern(pat, (t0, end), (4, 1, n));
        let err = max_rel(&got.to_vec(), &want);
        assert!(err < 1e-4, "layer {l}: relative difference {err:e}");
        let kept = all
            .get_name(&format!("blocks.{l}.attn.indexer.hook_selected"))
            .unwrap();
        assert!(kept.to_vec().iter().all(|&x| x == 1.0), "layer {l}");
    }
    // keep = 0.25: ceil(0.25 * 13) = 4 chunks, the best 4 of layer 0's plain scores.
    let some = run("0.25");
    let want = scores_from_pattern(&plain[0], (t0, end), (4, 1, n));
    let kept = some
        .get_name("blocks.0.attn.indexer.hook_selected")
        .unwrap()
        .to_vec();
    for r in 0..2 {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| want[r * n + b].total_cmp(&want[r * n + a]));
        let mut best = order[..4].to_vec();
        best.sort_unstable();
        let got: Vec<usize> = (0..n).filter(|&c| kept[r * n + c] == 1.0).collect();
        assert_eq!(got, best, "row {r}: scores {:?}", &want[r * n..(r + 1) * n]);
    }
}

#[test]
fn patching_evicts_kept_mask_changes_which_chunks_the_window_reads() {
    use phaselens::hooks::{Act, Action, HookPoint, Scope, Site};
    use std::sync::Arc;
    let (len, v, t0, n) = (60, 37, 50, 13); // observe 10; chunks of 4 before 50
    let m = model(5)
        .with_overlay(&overlay("kind=evict,chunk=4,keep=0.25,observe=10"))
        .unwrap();
    let t = ids(len, v, 8);
    let point = |l: usize| HookPoint::block(l, Site::IndexerSelected);
    let run = |spec: &HookSpec| m.forward(t.clone(), spec).unwrap();
    let base = vals(run(&HookSpec::new()).logits);
    // Patching the mask with itself changes nothing.
    let mut own = HookSpec::new();
    for l in 0..3 {
        own = own.capture_point(point(l));
    }
    let own = Arc::new(run(&own).cache);
    let mut same = HookSpec::new();
    for l in 0..3 {
        same = same.intervene_point(point(l), Action::Patch(own.clone()), Scope::all());
    }
    assert!(max_rel(&vals(run(&same).logits), &base) < 1e-6);
    // Keeping every chunk in every layer is the plain forward.
    let ones = || Action::Add(Act::new(Tensor::<2>::ones([1, 1], &dev())));
    let mut every = HookSpec::new();
    for l in 0..3 {
        every = every.intervene_point(point(l), ones(), Scope::all());
    }
    let plain = logits(&model(5), t.clone());
    assert!(max_rel(&base, &plain) > 1e-3);
    assert!(max_rel(&vals(run(&every).logits), &plain) < 1e-5);
    // Layer 0 keeps chunk 2 alone (tokens 8..12): from the window on, its attention
    // reads those tokens and the window, nothing else; before it, everything.
    let mut only = vec![0.0f32; n];
    only[2] = 1.0;
    let only = Tensor::<1>::from_data(TensorData::new(only, [n]), &dev()).reshape([1, n]);
    let spec = HookSpec::new()
        .intervene_point(point(0), Action::Replace(Act::new(only)), Scope::all())
        .capture("blocks.0.attn.hook_pattern")
        .unwrap();
    let out = run(&spec);
    let pat = out.cache.get_name("blocks.0.attn.hook_pattern").unwrap();
    let [b, h, tq, k] = <[usize; 4]>::try_from(pat.shape().to_vec()).unwrap();
    let p = pat.to_vec();
    for r in 0..b {
        for head in 0..h {
            for q in [10, t0 - 1, t0, len - 1] {
                let row = &p[((r * h + head) * tq + q) * k..][..k];
                for (j, &w) in row[..=q].iter().enumerate() {
                    let read = q < t0 || j >= t0 || (8..12).contains(&j);
                    assert_eq!(w > 0.0, read, "row {r} head {head} query {q} key {j}");
                }
            }
        }
    }
    let got = vals(out.logits);
    for r in 0..2 {
        let at = |x: &[f32], a: usize, z: usize| x[(r * len + a) * v..(r * len + z) * v].to_vec();
        assert!(max_rel(&at(&got, 0, t0), &at(&base, 0, t0)) < 1e-5);
        assert!(max_rel(&at(&got, len - 1, len), &at(&base, len - 1, len)) > 1e-4);
    }
}

#[test]
fn hooks_lists_the_points_of_a_model_under_an_overlay() {
    let dir = tempfile::tempdir().unwrap();
    phaselens::model::save_kvc(&model(2), dir.path()).unwrap();
    let model_dir = dir.path().to_str().unwrap();
    let list = |o: &str| {
        let out = crate::common::phaselens(&["hooks", "--model", model_dir, "--compression", o]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{o}: {text}");
        text
    };
    // evict: a prompt of observe + 2 chunks, so 2 chunks before the window.
    let text = list("kind=evict,chunk=4,keep=0.5,observe=8");
    for name in ["attn.indexer.hook_scores", "attn.indexer.hook_selected"] {
        let line = text.lines().find(|l| l.contains(name));
        assert!(
            line.is_some_and(|l| l.starts_with("blocks.{0..2}.") && l.ends_with("[1, 2]")),
            "{name} missing or not [1, 2] in every layer:\n{text}"
        );
    }
    // pool: a prompt of a window and a stride, so 2 entries with their gates per offset.
    let text = list("kind=pool,window=4,stride=2");
    let gate = text
        .lines()
        .find(|l| l.contains("attn.compressor.hook_key_gate "));
    assert!(gate.is_some_and(|l| l.contains("[1, 2, 4, ")), "{text}");
    assert!(!text.contains("attn.indexer."), "{text}");
}
