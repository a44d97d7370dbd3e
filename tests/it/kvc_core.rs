//! The kvc model core: causality, compression geometry, pooling, hooks and checkpoints.

use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::{Act, Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::kvc::{
    AttentionKind, CompressionConfig, GateMode, KvcConfig, KvcModel, RopeMode,
};
use phaselens::model::weights::{RandomInit, Vb};

use crate::common::*;

fn dev() -> Device {
    Device::flex()
}

fn config(
    attention: AttentionKind,
    window: usize,
    stride: usize,
    tail: usize,
    gate: GateMode,
) -> KvcConfig {
    KvcConfig {
        model_type: "phaselens-kvc".into(),
        vocab_size: 37,
        d_model: 32,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        d_head: Some(8),
        d_ff: 48,
        norm_eps: 1e-6,
        rope: RopeMode::All,
        rope_dims: None,
        rope_theta: 10000.0,
        qk_norm: true,
        tied_kv: false,
        sink: true,
        tie_embeddings: false,
        key_shift: false,
        attention,
        compression: (attention == AttentionKind::Compressed).then_some(CompressionConfig {
            window,
            stride,
            local_tail: tail,
            gate,
            gate_bias: true,
            window_offsets: Vec::new(),
        }),
        init_std: 0.3,
        arch: Default::default(),
        overlay: None,
    }
}

fn build(c: &KvcConfig, seed: u64) -> KvcModel {
    // A large init std and random gate biases make every path matter numerically.
    let model = KvcModel::new(c, &Vb::new(&RandomInit { seed }, &dev())).unwrap();
    randomize_biases(model, seed)
}

/// Gate biases and sinks start at zero; give them random values so tests see them.
fn randomize_biases(mut m: KvcModel, seed: u64) -> KvcModel {
    use burn::module::Param;
    let mut k = 0u64;
    let mut rnd = |dims: Vec<usize>| -> Vec<f32> {
        k += 1;
        let n: usize = dims.iter().product();
        (0..n)
            .map(|i| {
                (((i as u64 * 7919 + seed * 31 + k * 104729) % 1000) as f32 / 1000.0 - 0.5) * 2.0
            })
            .collect()
    };
    for b in m.blocks.iter_mut() {
        if let Some(c) = b.attn.compressor.as_mut() {
            for p in [&mut c.key_gate_bias, &mut c.value_gate_bias]
                .into_iter()
                .flatten()
            {
                let dims = p.dims();
                let v = rnd(dims.to_vec());
                *p = Param::from_tensor(Tensor::from_data(TensorData::new(v, dims), &dev()));
            }
        }
        for s in [&mut b.attn.sink, &mut b.attn.key_shift]
            .into_iter()
            .flatten()
        {
            let dims = s.dims();
            let v = rnd(dims.to_vec());
            *s = Param::from_tensor(Tensor::from_data(TensorData::new(v, dims), &dev()));
        }
    }
    m
}

fn tokens(rows: &[Vec<i64>]) -> Tensor<2, Int> {
    let t = rows[0].len();
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_data(TensorData::new(flat, [rows.len(), t]), &dev())
}

fn seq(n: usize, seed: i64) -> Vec<i64> {
    (0..n as i64)
        .map(|i| (i * 13 + seed * 7 + 3) % 37)
        .collect()
}

fn geometries() -> Vec<KvcConfig> {
    vec![
        config(AttentionKind::Compressed, 4, 4, 0, GateMode::Scalar),
        config(AttentionKind::Compressed, 8, 4, 0, GateMode::Scalar),
        config(AttentionKind::Compressed, 6, 3, 2, GateMode::Vector),
        config(AttentionKind::Compressed, 5, 5, 3, GateMode::Uniform),
        config(AttentionKind::Full, 0, 0, 0, GateMode::Scalar),
        shifted(config(AttentionKind::Full, 0, 0, 0, GateMode::Scalar)),
        shifted(config(AttentionKind::Compressed, 6, 3, 2, GateMode::Scalar)),
        staggered(
            config(AttentionKind::Compressed, 8, 4, 0, GateMode::Scalar),
            &[0, 2],
        ),
        staggered(
            config(AttentionKind::Compressed, 6, 3, 2, GateMode::Vector),
            &[1, 0],
        ),
    ]
}

/// KV head `h`'s windows start at `offsets[h]` (`compression.window_offsets`).
fn staggered(mut c: KvcConfig, offsets: &[usize]) -> KvcConfig {
    if let Some(cc) = c.compression.as_mut() {
        cc.window_offsets = offsets.to_vec();
    }
    c
}

fn shifted(mut c: KvcConfig) -> KvcConfig {
    c.key_shift = true;
    c
}

/// With `key_shift`, position t's key is `W_k (mu * h_t + (1 - mu) * h_{t-1})`: check
/// the captured keys against that formula from the captured attention inputs, and that
/// the shift is what makes them differ from the unshifted projection.
#[test]
fn key_shift_keys_mix_each_input_with_its_predecessor() {
    let c = shifted(config(AttentionKind::Full, 0, 0, 0, GateMode::Scalar));
    let mut plain_c = c.clone();
    plain_c.qk_norm = false;
    let m = build(&plain_c, 5);
    let t = 9;
    let spec = HookSpec::new()
        .capture("blocks.1.hook_resid_pre")
        .unwrap()
        .capture("blocks.1.attn.hook_k")
        .unwrap();
    let out = m.forward(tokens(&[seq(t, 4), seq(t, 6)]), &spec).unwrap();
    let resid = out
        .cache
        .get_name("blocks.1.hook_resid_pre")
        .unwrap()
        .get::<3>()
        .unwrap();
    let h = m.blocks[1].attn_norm.forward(resid);
    let k = vals(
        out.cache
            .get_name("blocks.1.attn.hook_k")
            .unwrap()
            .get::<4>()
            .unwrap(),
    );
    let attn = &m.blocks[1].attn;
    let mu = attn.key_shift.as_ref().unwrap().val().unsqueeze::<3>();
    let prev = Tensor::cat(
        vec![
            Tensor::<3>::zeros([2, 1, c.d_model], &dev()),
            h.clone().slice_dim(1, 0..t - 1),
        ],
        1,
    );
    let mixed = h.clone() * mu.clone() + prev * (mu.neg() + 1.0);
    let want = vals(attn.w_k.forward(mixed));
    assert!(max_diff(&k, &want) < 1e-5, "{}", max_diff(&k, &want));
    let unshifted = vals(attn.w_k.forward(h));
    assert!(max_diff(&k, &unshifted) > 1e-2, "the shift changed nothing");
}

#[test]
fn causal_on_every_path() {
    let t = 21;
    for c in geometries() {
        let m = build(&c, 1);
        let base = seq(t, 0);
        let out0 = vals(
            m.forward(tokens(std::slice::from_ref(&base)), &HookSpec::new())
                .unwrap()
                .logits,
        );
        for cut in [0, 5, 11, 19] {
            let mut changed = base.clone();
            for x in changed.iter_mut().skip(cut + 1) {
                *x = (*x + 5) % 37;
            }
            let out1 = vals(
                m.forward(tokens(&[changed]), &HookSpec::new())
                    .unwrap()
                    .logits,
            );
            let v = c.vocab_size;
            assert_eq!(
                &out0[..(cut + 1) * v],
                &out1[..(cut + 1) * v],
                "{:?}: positions <= {cut} changed",
                c.compression
            );
            assert_ne!(
                &out0[(cut + 1) * v..],
                &out1[(cut + 1) * v..],
                "later positions must react"
            );
        }
    }
}

#[test]
fn entries_become_visible_exactly_when_their_window_closes() {
    // (W, S, window start of each of the 2 KV heads; query heads 0-1 read KV head 0)
    for (w, s, off) in [
        (4, 4, [0, 0]),
        (8, 4, [0, 0]),
        (6, 3, [0, 0]),
        (4, 4, [0, 3]),
        (8, 4, [2, 0]),
        (6, 3, [0, 1]),
    ] {
        let c = staggered(
            config(AttentionKind::Compressed, w, s, 0, GateMode::Scalar),
            &off,
        );
        let m = build(&c, 2);
        let t = 23;
        let spec = HookSpec::new()
            .capture("blocks.0.attn.hook_pattern")
            .unwrap();
        let out = m.forward(tokens(&[seq(t, 1)]), &spec).unwrap();
        let p = out.cache.get_name("blocks.0.attn.hook_pattern").unwrap();
        let n_entries = (t - w) / s + 1;
        // slots: entries, then the sink (no raw tail)
        assert_eq!(p.shape(), &[1, 4, t, n_entries + 1]);
        let v = p.to_vec();
        for h in 0..4 {
            for q in 0..t {
                for e in 0..n_entries {
                    let mass = v[(h * t + q) * (n_entries + 1) + e];
                    let visible = off[h / 2] + e * s + w - 1 <= q;
                    assert_eq!(
                        mass > 0.0,
                        visible,
                        "w{w} s{s} offsets {off:?} head {h} query {q} entry {e}: {mass}"
                    );
                }
                let row: f32 = (0..=n_entries)
                    .map(|e| v[(h * t + q) * (n_entries + 1) + e])
                    .sum();
                assert!((row - 1.0).abs() < 1e-5);
            }
        }
    }
}

/// Naive per-window pooling from the captured raw keys and the model's own gate weights.
#[test]
fn pooled_entries_equal_a_naive_loop() {
    for c in [
        config(AttentionKind::Compressed, 4, 4, 0, GateMode::Scalar),
        config(AttentionKind::Compressed, 8, 4, 0, GateMode::Scalar),
        config(AttentionKind::Compressed, 6, 3, 2, GateMode::Vector),
        config(AttentionKind::Compressed, 8, 4, 1, GateMode::Vector),
        config(AttentionKind::Compressed, 5, 5, 3, GateMode::Uniform),
        config(AttentionKind::Compressed, 6, 2, 0, GateMode::Uniform),
        staggered(
            config(AttentionKind::Compressed, 4, 4, 0, GateMode::Scalar),
            &[0, 3],
        ),
        staggered(
            config(AttentionKind::Compressed, 8, 4, 1, GateMode::Vector),
            &[2, 0],
        ),
        staggered(
            config(AttentionKind::Compressed, 5, 5, 0, GateMode::Uniform),
            &[0, 4],
        ),
    ] {
        let m = build(&c, 3);
        let cc = c.compression.clone().unwrap();
        let (w, s) = (cc.window, cc.stride);
        let start = |hh: usize| cc.window_offsets.get(hh).copied().unwrap_or(0);
        let (t, kvh, dh, d) = (19, 2, 8, 32);
        let spec = HookSpec::new()
            .capture("blocks.1.hook_resid_pre")
            .unwrap()
            .capture("blocks.1.attn.hook_*")
            .unwrap()
            .capture("blocks.1.attn.compressor.*")
            .unwrap();
        let out = m.forward(tokens(&[seq(t, 2), seq(t, 5)]), &spec).unwrap();
        let resid = out
            .cache
            .get_name("blocks.1.hook_resid_pre")
            .unwrap()
            .to_vec();
        let k = out.cache.get_name("blocks.1.attn.hook_k").unwrap().to_vec();
        let vv = out.cache.get_name("blocks.1.attn.hook_v").unwrap().to_vec();
        let ck = out
            .cache
            .get_name("blocks.1.attn.compressor.hook_compressed_k")
            .unwrap();
        let cv = out
            .cache
            .get_name("blocks.1.attn.compressor.hook_compressed_v")
            .unwrap();
        let n = (t - w) / s + 1;
        assert_eq!(ck.shape(), &[2, n, kvh, dh]);
        let (ck, cv) = (ck.to_vec(), cv.to_vec());
        let blk = &m.blocks[1];
        let host = |p: &burn::module::Param<Tensor<2>>| {
            p.val()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap()
        };
        let norm_w = blk
            .attn_norm
            .weight
            .val()
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        let comp = blk.attn.compressor.as_ref().unwrap();
        let g = if cc.gate == GateMode::Vector { dh } else { 1 };
        for b in 0..2 {
            // attention input: RMSNorm of the residual
            let hnorm: Vec<Vec<f32>> = (0..t)
                .map(|p| {
                    let x = &resid[(b * t + p) * d..(b * t + p + 1) * d];
                    let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
                    let r = 1.0 / (ms + 1e-6).sqrt();
                    x.iter().zip(&norm_w).map(|(v, w)| v * r * w).collect()
                })
                .collect();
            for (value, raw, pooled) in [(false, &k, &ck), (true, &vv, &cv)] {
                let (gate, bias) = if value {
                    (&comp.value_gate, &comp.value_gate_bias)
                } else {
                    (&comp.key_gate, &comp.key_gate_bias)
                };
                for e in 0..n {
                    for hh in 0..kvh {
                        // KV head hh's window e: tokens start(hh) + e s .. + w.
                        let first = start(hh) + e * s;
                        for ch in 0..dh {
                            let got = pooled[((b * n + e) * kvh + hh) * dh + ch];
                            if first + w > t {
                                // Not closed in this prompt: a zero slot.
                                assert_eq!(got, 0.0, "{cc:?} value={value} b{b} e{e} h{hh}");
                                continue;
                            }
                            let gi = if g == 1 { 0 } else { ch };
                            // gate logits over the window's offsets
                            let logits: Vec<f32> = (0..w)
                                .map(|o| match gate {
                                    None => 0.0,
                                    Some(lin) => {
                                        let wt = host(lin.weight.dense().unwrap());
                                        let row = hh * g + gi;
                                        let mut acc: f32 = (0..d)
                                            .map(|j| hnorm[first + o][j] * wt[row * d + j])
                                            .sum();
                                        if let Some(bp) = bias {
                                            acc += host(bp)[o * kvh + hh];
                                        }
                                        acc
                                    }
                                })
                                .collect();
                            let mx = logits.iter().cloned().fold(f32::MIN, f32::max);
                            let ex: Vec<f32> = logits.iter().map(|l| (l - mx).exp()).collect();
                            let z: f32 = ex.iter().sum();
                            let want: f32 = (0..w)
                                .map(|o| {
                                    ex[o] / z * raw[((b * t + first + o) * kvh + hh) * dh + ch]
                                })
                                .sum();
                            assert!(
                                (want - got).abs() < 1e-4 * (1.0 + want.abs()),
                                "{:?} value={value} b{b} e{e} h{hh} c{ch}: {want} vs {got}",
                                cc
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn capturing_hooks_leaves_logits_bit_identical() {
    for c in geometries() {
        let m = build(&c, 4);
        let x = tokens(&[seq(17, 3), seq(17, 4)]);
        let plain = vals(m.forward(x.clone(), &HookSpec::new()).unwrap().logits);
        let spec = HookSpec::new().capture("**").unwrap();
        let out = m.forward(x, &spec).unwrap();
        assert!(out.cache.len() > 20, "captured {}", out.cache.len());
        assert_eq!(plain, vals(out.logits));
    }
}

#[test]
fn patching_a_full_clean_cache_reproduces_clean_logits() {
    for c in geometries() {
        let m = build(&c, 5);
        let clean = tokens(&[seq(17, 1)]);
        let corrupt = tokens(&[seq(17, 9)]);
        let all = HookSpec::new().capture("**").unwrap();
        let clean_out = m.forward(clean, &all).unwrap();
        let corrupt_plain = vals(m.forward(corrupt.clone(), &HookSpec::new()).unwrap().logits);
        let clean_logits = vals(clean_out.logits);
        assert_ne!(clean_logits, corrupt_plain);
        let cache = Arc::new(clean_out.cache);
        let spec = HookSpec::new()
            .intervene("**", Action::Patch(cache.clone()), Scope::all())
            .unwrap();
        let patched = vals(m.forward(corrupt.clone(), &spec).unwrap().logits);
        assert_eq!(patched, clean_logits);
        // Patching only the last residual stream is enough too.
        let spec = HookSpec::new()
            .intervene(
                "blocks.1.hook_resid_post",
                Action::Patch(cache),
                Scope::all(),
            )
            .unwrap();
        assert_eq!(
            vals(m.forward(corrupt, &spec).unwrap().logits),
            clean_logits
        );
    }
}

#[test]
fn zero_ablating_a_head_equals_zeroing_its_hook_z_slice_by_hand() {
    let c = config(AttentionKind::Compressed, 8, 4, 2, GateMode::Scalar);
    let m = build(&c, 6);
    let x = tokens(&[seq(20, 2), seq(20, 7)]);
    let z_point = HookPoint::block(1, Site::AttnZ);
    let out = m
        .forward(x.clone(), &HookSpec::new().capture_point(z_point))
        .unwrap();
    let z = out.cache.get(&z_point).unwrap();
    let (shape, mut v) = (z.shape().to_vec(), z.to_vec());
    let (b, t, nh, dh) = (shape[0], shape[1], shape[2], shape[3]);
    let head = 2;
    for bi in 0..b {
        for p in 0..t {
            for j in 0..dh {
                v[((bi * t + p) * nh + head) * dh + j] = 0.0;
            }
        }
    }
    let by_hand = Act::from_vec(v, shape, &dev()).unwrap();
    let hand = HookSpec::new().intervene_point(z_point, Action::Replace(by_hand), Scope::all());
    let ablate = HookSpec::new().intervene_point(z_point, Action::Zero, Scope::heads([head]));
    let a = vals(m.forward(x.clone(), &hand).unwrap().logits);
    let bb = vals(m.forward(x.clone(), &ablate).unwrap().logits);
    assert_eq!(a, bb);
    assert_ne!(a, vals(m.forward(x, &HookSpec::new()).unwrap().logits));
}

#[test]
fn gqa_maps_each_query_head_to_its_kv_head() {
    for c in geometries() {
        let m = build(&c, 7);
        let x = tokens(&[seq(18, 5)]);
        let z = HookPoint::block(0, Site::AttnZ);
        let clean = m
            .forward(x.clone(), &HookSpec::new().capture_point(z))
            .unwrap();
        // Scale KV head 1's values: only query heads 2 and 3 (group size 2) may change.
        let spec = HookSpec::new()
            .capture_point(z)
            .intervene(
                "blocks.0.attn.hook_v",
                Action::Scale(3.0),
                Scope::heads([1]),
            )
            .unwrap();
        let hit = m.forward(x, &spec).unwrap();
        let (a, b) = (
            clean.cache.get(&z).unwrap().to_vec(),
            hit.cache.get(&z).unwrap().to_vec(),
        );
        let (t, nh, dh) = (18, 4, 8);
        for h in 0..nh {
            let same = (0..t)
                .all(|p| (0..dh).all(|j| a[(p * nh + h) * dh + j] == b[(p * nh + h) * dh + j]));
            assert_eq!(same, h / 2 == 0, "{:?} head {h}", c.compression);
        }
    }
}

#[test]
fn forward_from_a_layer_matches_the_full_forward() {
    for c in geometries() {
        let m = build(&c, 8);
        let x = tokens(&[seq(16, 1), seq(16, 2)]);
        let out = m
            .forward(
                x,
                &HookSpec::new().capture("blocks.1.hook_resid_pre").unwrap(),
            )
            .unwrap();
        let resid = out
            .cache
            .get_name("blocks.1.hook_resid_pre")
            .unwrap()
            .get::<3>()
            .unwrap();
        let from = m.forward_from(1, resid, &HookSpec::new()).unwrap();
        assert_eq!(vals(out.logits), vals(from.logits));
    }
}

#[test]
fn scoped_interventions_touch_only_their_rows_positions_and_heads() {
    let c = config(AttentionKind::Compressed, 4, 4, 1, GateMode::Scalar);
    let m = build(&c, 9);
    let x = tokens(&[seq(12, 1), seq(12, 2)]);
    let z = HookPoint::block(0, Site::AttnZ);
    let spec = HookSpec::new()
        .intervene_point(
            z,
            Action::Zero,
            Scope::heads([1]).with_batch([1]).with_positions([3, 7]),
        )
        .capture_point(z);
    let out = m.forward(x.clone(), &spec).unwrap();
    let clean = m.forward(x, &HookSpec::new().capture_point(z)).unwrap();
    let (a, b) = (
        out.cache.get(&z).unwrap().to_vec(),
        clean.cache.get(&z).unwrap().to_vec(),
    );
    let (t, nh, dh) = (12, 4, 8);
    for bi in 0..2 {
        for p in 0..t {
            for h in 0..nh {
                for j in 0..dh {
                    let i = ((bi * t + p) * nh + h) * dh + j;
                    if bi == 1 && h == 1 && (p == 3 || p == 7) {
                        assert_eq!(a[i], 0.0);
                    } else {
                        assert_eq!(a[i], b[i]);
                    }
                }
            }
        }
    }
    // out-of-range scopes are errors, not panics
    let bad = HookSpec::new().intervene_point(z, Action::Zero, Scope::heads([9]));
    let e = m
        .forward(tokens(&[seq(12, 1)]), &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("head 9 out of range"), "{e}");
}

#[test]
fn suffix_forward_equals_forward_from_at_its_positions() {
    use phaselens::model::{LanguageModel, Suffix};
    let mut configs = geometries();
    let mut partial = config(AttentionKind::Compressed, 4, 2, 1, GateMode::Scalar);
    partial.rope = RopeMode::Partial;
    partial.rope_dims = Some(4);
    partial.tied_kv = true;
    configs.push(partial);
    for c in configs {
        let m = build(&c, 11);
        let t = 20;
        let x = tokens(&[seq(t, 1), seq(t, 2), seq(t, 3)]);
        let spec = HookSpec::new()
            .capture("blocks.0.hook_resid_pre")
            .unwrap()
            .capture("blocks.1.hook_resid_pre")
            .unwrap();
        let (out, state) = LanguageModel::forward_with_state(&m, x, &spec).unwrap();
        let state = state.expect("kvc models keep a prefix state");
        assert_eq!((state.rows(), state.len()), (3, t));
        // Rows reordered and repeated; suffixes at the start, the middle and the end.
        let sfx = Suffix {
            rows: vec![2, 0, 1, 0],
            from: vec![13, 5, 0, 17],
            len: 3,
        };
        for start in 0..2 {
            let resid = out
                .cache
                .get_name(&format!("blocks.{start}.hook_resid_pre"))
                .unwrap()
                .select_batch(&sfx.rows)
                .unwrap();
            let z = HookPoint::block(start, Site::AttnZ);
            // Plain, and with head 1's output zeroed at the suffix positions.
            for edit in [false, true] {
                let mut full_spec = HookSpec::new();
                let mut sfx_spec = HookSpec::new();
                if edit {
                    for (r, &f) in sfx.from.iter().enumerate() {
                        full_spec = full_spec.intervene_point(
                            z,
                            Action::Zero,
                            Scope {
                                batch: Some(vec![r]),
                                heads: Some(vec![1]),
                                positions: Some((f..f + sfx.len).collect()),
                                rows: None,
                            },
                        );
                    }
                    sfx_spec = sfx_spec.intervene_point(
                        z,
                        Action::Zero,
                        Scope {
                            heads: Some(vec![1]),
                            ..Scope::all()
                        },
                    );
                }
                let want = m
                    .forward_from(start, resid.get::<3>().unwrap(), &full_spec)
                    .unwrap()
                    .logits;
                let want = rows_at(want, &sfx.from, sfx.len);
                let got = m
                    .forward_suffix(start, &state, &sfx, resid_suffix(&resid, &sfx), &sfx_spec)
                    .unwrap()
                    .logits;
                assert_eq!(got.dims(), [4, sfx.len, c.vocab_size]);
                let got = vals(got);
                let d = max_diff(&got, &want);
                assert!(
                    d < 1e-4,
                    "{:?} start {start} edit {edit}: {d}",
                    c.compression
                );
                if edit {
                    let plain = m
                        .forward_from(start, resid.get::<3>().unwrap(), &HookSpec::new())
                        .unwrap()
                        .logits;
                    let plain = rows_at(plain, &sfx.from, sfx.len);
                    assert!(max_diff(&got, &plain) > 1e-3, "the edit changed nothing");
                }
            }
        }
        // Bad suffixes are errors, not panics.
        let bad = Suffix {
            rows: vec![3],
            from: vec![0],
            len: 1,
        };
        let r0 = Tensor::<3>::zeros([1, 1, c.d_model], &dev());
        assert!(
            m.forward_suffix(0, &state, &bad, r0.clone(), &HookSpec::new())
                .is_err()
        );
        let bad = Suffix {
            rows: vec![0],
            from: vec![t - 1],
            len: 2,
        };
        assert!(
            m.forward_suffix(0, &state, &bad, r0, &HookSpec::new())
                .is_err()
        );
    }
}

/// The residual rows `[b, t, d]` at each row's suffix positions, `[b, len, d]`.
fn resid_suffix(resid: &Act, sfx: &phaselens::model::Suffix) -> Tensor<3> {
    let r = resid.get::<3>().unwrap();
    let parts: Vec<Tensor<3>> = sfx
        .from
        .iter()
        .enumerate()
        .map(|(i, &f)| {
            r.clone()
                .slice_dim(0, i..i + 1)
                .slice_dim(1, f..f + sfx.len)
        })
        .collect();
    Tensor::cat(parts, 0)
}
