//! DeepSeek-V4's suffix forward (the patching runner's fast path): recomputing only
//! some positions of each row over a base run's state gives the logits of a full
//! `forward_from` at those positions, with and without an edit there, on the parity
//! fixtures (sliding, CSA with an indexer that must choose, HCA, hash routing, mHC).

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::{Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::deepseek_v4::{self, DeepseekV4Model};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::{LanguageModel, Suffix};

use crate::common::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name)
}

#[test]
fn suffix_forward_equals_forward_from_at_its_positions() {
    for name in ["flash", "pro", "long"] {
        let device = Device::flex();
        let m: DeepseekV4Model = deepseek_v4::load(&fixture(name), &device).unwrap();
        let r = SafetensorsReader::open(&fixture(name).join("reference.safetensors")).unwrap();
        let (shape, ids) = r.read_i64("input_ids").unwrap();
        // Two copies of every fixture row, so that rows can be reordered and repeated.
        let (b0, t) = (shape[0], shape[1]);
        let mut all = ids.clone();
        all.extend_from_slice(&ids);
        let rows = 2 * b0;
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(all, [rows, t]), &device);
        let n_layers = m.config.num_hidden_layers;
        let mut spec = HookSpec::new();
        for l in 0..n_layers {
            spec = spec.capture_point(HookPoint::block(l, Site::ResidPre));
        }
        let (out, state) = LanguageModel::forward_with_state(&m, tokens.clone(), &spec).unwrap();
        let state = state.expect("DeepSeek-V4 models keep a prefix state");
        // A base run that captures the compressed keys keeps no pooled entries (its
        // compressor runs through its hook points): suffix forwards then pool the
        // windows before their rows from the recorded projections.
        let mut hooked = spec.clone();
        for l in 0..n_layers {
            hooked = hooked.capture_point(HookPoint::block(l, Site::CompressedK));
        }
        let (_, hooked_state) =
            LanguageModel::forward_with_state(&m, tokens.clone(), &hooked).unwrap();
        let hooked_state = hooked_state.unwrap();
        // The base forward with state gives the plain forward's logits.
        let plain = m.forward(tokens.clone(), &HookSpec::new()).unwrap().logits;
        assert!(max_rel(&vals(out.logits), &vals(plain)) < 1e-5, "{name}");
        let len = 2;
        // Rows starting early (before the first compressed window closes) and rows that
        // all start late (the windows before them pooled once per prompt of the state).
        let early = Suffix {
            rows: vec![rows - 1, 0, 1, 0],
            from: vec![t - len, 3, t / 2, t - len - 1],
            len,
        };
        let late = Suffix {
            rows: vec![1, rows - 1, 0, 1],
            from: vec![t - len, t / 2, t - len - 1, t / 2 + 1],
            len,
        };
        // Every row at the same positions (the attention gathers each query's window).
        let shared = Suffix {
            rows: vec![0, 1, rows - 1, 1],
            from: vec![t - len; 4],
            len,
        };
        let runs = [
            (&early, &state),
            (&late, &state),
            (&late, &hooked_state),
            (&shared, &state),
        ];
        for (sfx, state, start) in runs
            .into_iter()
            .flat_map(|(s, st)| (0..n_layers).map(move |l| (s, st, l)))
        {
            let resid = out
                .cache
                .get(&HookPoint::block(start, Site::ResidPre))
                .unwrap()
                .select_batch(&sfx.rows)
                .unwrap();
            let resid4 = resid.get::<4>().unwrap();
            let sel = Tensor::<1, Int>::from_data(
                TensorData::new(sfx.rows.iter().map(|&x| x as i64).collect::<Vec<_>>(), [4]),
                &device,
            );
            let row_tokens = tokens.clone().select(0, sel);
            let suffix_resid = Tensor::cat(
                sfx.from
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        resid4
                            .clone()
                            .slice_dim(0, i..i + 1)
                            .slice_dim(1, f..f + len)
                    })
                    .collect(),
                0,
            );
            let z = HookPoint::block(start, Site::AttnZ);
            for edit in [false, true] {
                let mut full_spec = HookSpec::new();
                let mut sfx_spec = HookSpec::new();
                if edit {
                    for (i, &f) in sfx.from.iter().enumerate() {
                        full_spec = full_spec.intervene_point(
                            z,
                            Action::Zero,
                            Scope {
                                batch: Some(vec![i]),
                                heads: Some(vec![1]),
                                positions: Some((f..f + len).collect()),
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
                    .forward_from(row_tokens.clone(), start, resid4.clone(), &full_spec)
                    .unwrap()
                    .logits;
                let want = rows_at(want, &sfx.from, len);
                let got = m
                    .forward_suffix(start, state, sfx, suffix_resid.clone(), &sfx_spec)
                    .unwrap()
                    .logits;
                assert_eq!(got.dims()[..2], [4, len]);
                let got = vals(got);
                let d = max_rel(&got, &want);
                assert!(d < 1e-5, "{name} start {start} edit {edit}: {d}");
                if edit {
                    let plain = m
                        .forward_from(row_tokens.clone(), start, resid4.clone(), &HookSpec::new())
                        .unwrap()
                        .logits;
                    let plain = rows_at(plain, &sfx.from, len);
                    assert!(
                        max_rel(&got, &plain) > 1e-4,
                        "{name}: the edit changed nothing"
                    );
                }
            }
        }
    }
}

/// `forward_suffix_streams` over layers `l..e` gives the streams a whole suffix forward
/// from `l` shows at `blocks.{e-1}.hook_resid_post`, with its captures, and refuses an
/// empty or out-of-range span.
#[test]
fn suffix_streams_are_the_suffix_forwards_streams_after_the_last_layer() {
    let device = Device::flex();
    let m: DeepseekV4Model = deepseek_v4::load(&fixture("long"), &device).unwrap();
    let r = SafetensorsReader::open(&fixture("long").join("reference.safetensors")).unwrap();
    let (shape, ids) = r.read_i64("input_ids").unwrap();
    let (b, t) = (shape[0], shape[1]);
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, t]), &device);
    let n_layers = m.config.num_hidden_layers;
    let mut spec = HookSpec::new();
    for l in 0..n_layers {
        spec = spec.capture_point(HookPoint::block(l, Site::ResidPre));
    }
    let (out, state) = m.forward_with_state(tokens, &spec).unwrap();
    let sfx = Suffix {
        rows: vec![b - 1],
        from: vec![t - 9],
        len: 9,
    };
    for start in 0..n_layers {
        let resid = out
            .cache
            .get(&HookPoint::block(start, Site::ResidPre))
            .unwrap()
            .get::<4>()
            .unwrap()
            .slice_dim(0, b - 1..b)
            .slice_dim(1, t - 9..t);
        for end in start + 1..=n_layers {
            let post = HookPoint::block(end - 1, Site::ResidPost);
            let spec = HookSpec::new().capture_point(post);
            let whole = m
                .forward_suffix(start, &state, &sfx, resid.clone(), &spec)
                .unwrap();
            let want = whole.cache.get(&post).unwrap().to_vec();
            let (x, cache) = m
                .forward_suffix_streams(start..end, &state, &sfx, resid.clone(), &spec)
                .unwrap();
            assert_eq!(x.dims(), [1, 9, m.config.hc_mult, m.config.hidden_size]);
            assert_eq!(vals(x), want, "layers {start}..{end}");
            assert_eq!(cache.get(&post).unwrap().to_vec(), want);
        }
        for bad in [start..start, start..n_layers + 1] {
            let e = m
                .forward_suffix_streams(bad.clone(), &state, &sfx, resid.clone(), &spec)
                .unwrap_err()
                .to_string();
            assert!(e.contains("non-empty range"), "{bad:?}: {e}");
        }
    }
}
