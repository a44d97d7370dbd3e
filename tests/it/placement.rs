//! A model placed over several devices (issue 22, section 2): the DeepSeek-V4 test
//! model and a kvc organism, their layers over flex (`cpu`) and LibTorch (`tch-cpu`),
//! some routed experts in host memory, give the single-device logits, captures,
//! interventions, suffix forwards and patching table; a placement that does not fit
//! or names an absent device is a clear error.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::device::DeviceSpec;
use phaselens::hooks::{Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::placement::{Placement, PlacementConfig};
use phaselens::model::stored::Residency;
use phaselens::model::{LanguageModel, Suffix, load_model, load_model_placed, load_model_split};
use phaselens::runner::patching::{
    Cell, Edit, Fill, Positions, Prompts, Target, base_run, captures_for, plan_chunks, run_chunk,
};

use crate::common::runner::{organism, tiny};
use crate::common::*;

/// Relative tolerance of a placed model against the same model on one device.
const TOL: f32 = 1e-5;

fn v4_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4/flash")
}

/// The flash fixture (6 layers, 4 routed experts) interleaved over the two devices,
/// with some layers' experts partly or wholly in host memory (flex).
const V4_MAP: &str = r#"
devices = ["cpu", "tch-cpu"]
layers = [0, 1, 0, 1, 1, 0]
experts_on_device = [4, 1, 4, 0, 2, 3]
host = "cpu"
"#;

fn v4_placement() -> Placement {
    let c: PlacementConfig = toml::from_str(V4_MAP).unwrap();
    Placement::from_config(&c, 6, "V4_MAP").unwrap()
}

/// A kvc organism (4 blocks) saved under `dir`.
fn kvc_dir(dir: &Path) -> PathBuf {
    organism(dir, "tiny", &tiny(4, 4, 2, 4, 4), 11);
    dir.join("tiny")
}

fn tokens(vocab: usize, rows: usize, len: usize, device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..rows * len)
        .map(|i| ((i * 7919 + 13) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [rows, len]), device)
}

/// Plain, capturing, patched-from-cache and suffix forwards of `placed` match `single`.
fn same_forwards(single: &dyn LanguageModel, placed: &dyn LanguageModel, what: &str) {
    let home = Device::flex();
    assert!(
        placed.device() == home,
        "{what}: the home device is the first one"
    );
    let vocab = single.info().vocab_size;
    let (rows, len) = (3, 40);
    let t = tokens(vocab, rows, len, &home);
    let want = single.forward(t.clone(), &HookSpec::new()).unwrap().logits;
    let got = placed.forward(t.clone(), &HookSpec::new()).unwrap().logits;
    assert!(got.device() == home, "{what}: logits come back home");
    let (want, got) = (vals(want), vals(got));
    let err = max_rel(&got, &want);
    eprintln!("{what}: plain logits, max relative error {err:.2e}");
    assert!(err <= TOL, "{what}: plain logits {err:.2e}");

    // Every hook point captured: the captures come back home and match.
    let spec = HookSpec::new().capture("**").unwrap();
    let a = single.forward(t.clone(), &spec).unwrap();
    let b = placed.forward(t.clone(), &spec).unwrap();
    assert_eq!(a.cache.len(), b.cache.len(), "{what}");
    assert!(a.cache.len() > 20, "{what}: {} points", a.cache.len());
    for (p, act) in b.cache.iter() {
        let w = a.cache.get(p).unwrap().to_vec();
        assert!(max_rel(&act.to_vec(), &w) <= TOL, "{what}: capture {p}");
    }
    for (p, act) in b.cache.iter() {
        let dims = act.shape().to_vec();
        let flat = act.reshaped(vec![dims.iter().product()]).unwrap();
        assert!(
            flat.get::<1>().unwrap().device() == home,
            "{what}: {p} is not home"
        );
    }

    // Patching every point from the home cache into the placed forward gives its logits.
    let cache = Arc::new(b.cache);
    let mut spec = HookSpec::new();
    for (point, _) in cache.iter() {
        spec = spec.intervene_point(*point, Action::Patch(cache.clone()), Scope::all());
    }
    let patched = vals(placed.forward(t.clone(), &spec).unwrap().logits);
    assert!(
        max_rel(&patched, &got) <= TOL,
        "{what}: patched from its own cache"
    );
    // A real edit (zeroing a late layer's attention output) changes the placed logits as
    // it changes the single-device ones.
    let n = single.info().n_layers();
    let zero = HookSpec::new().intervene_point(
        HookPoint::block(n - 1, Site::AttnOut),
        Action::Zero,
        Scope::all(),
    );
    let zw = vals(single.forward(t.clone(), &zero).unwrap().logits);
    let zg = vals(placed.forward(t.clone(), &zero).unwrap().logits);
    assert!(max_rel(&zw, &want) > 1e-3, "{what}: the edit matters");
    assert!(max_rel(&zg, &zw) <= TOL, "{what}: zeroed attention output");

    // Suffix forward over the base state: the last two positions from layer 1.
    let spec = HookSpec::new().capture_point(HookPoint::block(1, Site::ResidPre));
    let (base_s, state_s) = single.forward_with_state(t.clone(), &spec).unwrap();
    let (base_p, state_p) = placed.forward_with_state(t.clone(), &spec).unwrap();
    let sfx = Suffix {
        rows: vec![0, 2],
        from: vec![len - 2, len - 3],
        len: 2,
    };
    let resid = |c: &phaselens::hooks::ActivationCache| {
        let a = c
            .get(&HookPoint::block(1, Site::ResidPre))
            .unwrap()
            .select_batch(&sfx.rows)
            .unwrap();
        // keep the positions of the suffix: [rows, len, ...]
        let full = a.shape().to_vec();
        let per: usize = full[2..].iter().product();
        let v = a.to_vec();
        let mut out = Vec::new();
        for (r, &f) in sfx.from.iter().enumerate() {
            let start = (r * full[1] + f) * per;
            out.extend_from_slice(&v[start..start + sfx.len * per]);
        }
        let mut shape = full.clone();
        shape[1] = sfx.len;
        phaselens::hooks::Act::from_vec(out, shape, &home).unwrap()
    };
    let ws = single
        .forward_suffix(
            1,
            &state_s.unwrap(),
            &sfx,
            &resid(&base_s.cache),
            &HookSpec::new(),
        )
        .unwrap()
        .logits;
    let gs = placed
        .forward_suffix(
            1,
            &state_p.unwrap(),
            &sfx,
            &resid(&base_p.cache),
            &HookSpec::new(),
        )
        .unwrap()
        .logits;
    assert!(gs.device() == home, "{what}: suffix logits come back home");
    let err = max_rel(&vals(gs), &vals(ws));
    assert!(err <= TOL, "{what}: suffix forward {err:.2e}");
}

/// Six prompts (three clean, three corrupted, partners of each other) of `len` tokens.
fn prompts(vocab: usize, len: usize) -> Prompts {
    let n = 6;
    let tokens: Vec<u32> = (0..n * len)
        .map(|i| ((i * 104729 + 7 * (i / len)) % vocab) as u32)
        .collect();
    let targets = (0..n)
        .map(|p| Target {
            positions: vec![len - 2, len - 1],
            answers: vec![
                (p * 5 + 1) as u32 % vocab as u32,
                (p * 3 + 2) as u32 % vocab as u32,
            ],
            alt: Some(((p + 3) * 5 + 1) as u32 % vocab as u32),
        })
        .collect();
    Prompts {
        len,
        tokens,
        targets,
        source: (0..n).map(|p| Some((p + 3) % n)).collect(),
        group: vec![0, 0, 0, 1, 1, 1],
    }
}

/// The patching table (logit difference and correctness of every patched prompt of
/// every cell) of `placed` matches `single`'s.
fn same_patching(single: &dyn LanguageModel, placed: &dyn LanguageModel, what: &str) {
    let info = single.info();
    let p = prompts(info.vocab_size, 24);
    let corrupted = vec![3, 4, 5];
    let clean = vec![0, 1, 2];
    let mut cells = Vec::new();
    for l in 0..info.n_layers() {
        for (site, heads, positions, fill, rows) in [
            (
                Site::AttnZ,
                Some(vec![l % info.n_heads]),
                Positions::All,
                Fill::Source,
                &corrupted,
            ),
            (
                Site::AttnZ,
                Some(vec![0, 1]),
                Positions::Answer,
                Fill::Source,
                &clean,
            ),
            (
                Site::ResidPre,
                None,
                Positions::All,
                Fill::Source,
                &corrupted,
            ),
            (Site::MlpOut, None, Positions::Final(3), Fill::Mean, &clean),
            (
                Site::AttnOut,
                None,
                Positions::Answer,
                Fill::Zero,
                &corrupted,
            ),
        ] {
            cells.push(Cell {
                edit: Edit::Replace {
                    point: HookPoint::block(l, site),
                    heads,
                    positions,
                    fill,
                },
                prompts: rows.clone(),
            });
        }
    }
    let caps = captures_for(&cells).unwrap();
    let bs = base_run(single, &p, &caps).unwrap();
    let bp = base_run(placed, &p, &caps).unwrap();
    let (mut worst, mut scale, mut moved) = (0f32, 0f32, 0);
    for ch in plan_chunks(&cells, 9).unwrap() {
        let a = run_chunk(single, &p, &bs, &cells, &ch).unwrap();
        let b = run_chunk(placed, &p, &bp, &cells, &ch).unwrap();
        for ((&c, x), y) in ch.iter().zip(&a).zip(&b) {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                assert_eq!(u.correct, v.correct, "{what}: cell {c} row {i}");
                worst = worst.max((u.ld - v.ld).abs());
                scale = scale.max(u.ld.abs());
                if (u.ld - bs.outcomes[cells[c].prompts[i]].ld).abs() > 1e-3 {
                    moved += 1;
                }
            }
        }
    }
    let rel = worst / scale.max(1e-30);
    eprintln!(
        "{what}: patching table, max relative error {rel:.2e} over {} cells",
        cells.len()
    );
    assert!(rel <= TOL, "{what}: patching table {rel:.2e}");
    assert!(
        moved > cells.len(),
        "{what}: the edits changed too little ({moved})"
    );
}

#[cfg(feature = "tch")]
#[test]
fn a_v4_model_over_flex_and_libtorch_with_host_experts_matches_one_device() {
    let dir = v4_fixture();
    let single = load_model(&dir, &Device::flex()).unwrap();
    let placement = v4_placement();
    assert_eq!(
        placement.to_string(),
        "cpu: layers [0, 2, 5]; tch-cpu: layers [1, 3, 4] (routed experts, the rest on cpu: \
         layer 0 keeps 4, layer 1 keeps 1, layer 2 keeps 4, layer 3 keeps 0, layer 4 keeps 2, layer 5 keeps 3)"
    );
    let placed = load_model_placed(&dir, &placement, Residency::Stored).unwrap();
    same_forwards(single.as_ref(), placed.as_ref(), "deepseek-v4 flash");
    same_patching(single.as_ref(), placed.as_ref(), "deepseek-v4 flash");
}

/// The FP8 + FP4 + BF16 fixture (3 layers, 4 routed experts) over the two devices,
/// layer 1 keeping one routed expert and layer 2 none (the rest on flex).
const FP4_MAP: &str = r#"
devices = ["cpu", "tch-cpu"]
layers = [0, 1, 1]
experts_on_device = [4, 1, 0]
host = "cpu"
"#;

#[cfg(feature = "tch")]
#[test]
fn an_fp8_fp4_model_placed_with_host_experts_is_the_same_stored_or_f32() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4/fp4_experts");
    let c: PlacementConfig = toml::from_str(FP4_MAP).unwrap();
    let placement = Placement::from_config(&c, 3, "FP4_MAP").unwrap();
    let f32 = load_model_placed(&dir, &placement, Residency::F32).unwrap();
    let stored = load_model_placed(&dir, &placement, Residency::Stored).unwrap();
    let bytes = |m: &dyn LanguageModel| m.resident_bytes().unwrap().values().sum::<usize>();
    let (bf, bs) = (bytes(f32.as_ref()), bytes(stored.as_ref()));
    eprintln!("fp4_experts placed: resident {bf} bytes f32, {bs} stored");
    assert!(bs * 3 < bf, "{bs} stored vs {bf} f32");
    // Exactly equal plain logits, then every forward and the patching table.
    let t = tokens(256, 3, 40, &Device::flex());
    let a = vals(f32.forward(t.clone(), &HookSpec::new()).unwrap().logits);
    let b = vals(stored.forward(t, &HookSpec::new()).unwrap().logits);
    assert_eq!(a, b, "placed logits, stored vs f32");
    same_forwards(
        f32.as_ref(),
        stored.as_ref(),
        "fp4_experts placed, stored vs f32",
    );
    same_patching(
        f32.as_ref(),
        stored.as_ref(),
        "fp4_experts placed, stored vs f32",
    );
}

#[cfg(feature = "tch")]
#[test]
fn a_kvc_organism_split_over_flex_and_libtorch_matches_one_device() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = kvc_dir(tmp.path());
    let single = load_model(&dir, &Device::flex()).unwrap();
    let (placed, placement) = load_model_split(
        &dir,
        vec![DeviceSpec::Cpu, DeviceSpec::TchCpu],
        None,
        Residency::Stored,
    )
    .unwrap();
    // Both devices hold layers, in order.
    assert!(
        placement.layers.contains(&0) && placement.layers.contains(&1),
        "{placement}"
    );
    assert!(
        placement.layers.windows(2).all(|w| w[0] <= w[1]),
        "{placement}"
    );
    same_forwards(single.as_ref(), placed.as_ref(), "kvc organism");
    same_patching(single.as_ref(), placed.as_ref(), "kvc organism");
}

#[test]
fn a_split_that_does_not_fit_names_the_device_and_the_bytes_over() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = kvc_dir(tmp.path());
    let m = phaselens::model::load_kvc(&dir, &Device::flex()).unwrap();
    let (layers, home) = m.placement_bytes();
    let per = layers[0];
    // Room for the embedding and one block on the first device, one on the second.
    let cap = [home + per, per];
    let e = match load_model_split(
        &dir,
        vec![DeviceSpec::Cpu, DeviceSpec::Cpu],
        Some(&cap),
        Residency::Stored,
    ) {
        Ok(_) => panic!("4 blocks do not fit in 2"),
        Err(e) => e.to_string(),
    };
    let over = format!("({:.0} bytes) over", per);
    assert!(e.contains("device cpu") && e.contains(&over), "{e}");
    assert!(e.contains("layer 2"), "{e}");
}

#[test]
fn a_placement_naming_an_absent_device_says_which() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = kvc_dir(tmp.path());
    let p = Placement {
        devices: vec![DeviceSpec::Cpu, DeviceSpec::TchCuda(7)],
        layers: vec![0, 0, 1, 1],
        experts_on_device: vec![None; 4],
        host: DeviceSpec::Cpu,
    };
    let e = match load_model_placed(&dir, &p, Residency::Stored) {
        Ok(_) => panic!("there is no eighth CUDA GPU here"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("tch-cuda:7") && e.contains("placement"), "{e}");
    // A placement for another number of layers.
    let p = Placement::single(DeviceSpec::Cpu, 3);
    let e = match load_model_placed(&dir, &p, Residency::Stored) {
        Ok(_) => panic!("3 layers placed for a 4-block model"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("3 layers") && e.contains("has 4"), "{e}");
}

/// The long rows of `<root>/notebooks-data/e/heads.arrow`.
fn head_rows(root: &Path) -> Vec<phaselens::output::LongRow> {
    let t =
        phaselens::output::Table::read_arrow(root.join("notebooks-data/e/heads.arrow")).unwrap();
    phaselens::output::read_long_rows(&t).unwrap()
}

#[cfg(feature = "tch")]
#[test]
fn patch_heads_placed_by_flag_or_by_the_experiment_gives_the_one_device_table() {
    use crate::common::runner::{experiment, opts};
    use phaselens::model::placement::DevicesRequest;
    use phaselens::runner::{RunOptions, run_experiment};
    let body = "[experiment]\nkind = \"patch-heads\"\nbootstrap_reps = 30\n\n[model]\norganism = \"tiny\"\n{placement}\n[task]\nn_logical = 6\n";
    let map = "\n[model.placement]\ndevices = [\"tch-cpu\", \"cpu\"]\nlayers = [1, 0, 1, 0]\n";
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, placement: &str, devices: Option<DevicesRequest>| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        organism(&d, "tiny", &tiny(4, 4, 2, 4, 4), 3);
        let exp = experiment(&d, "e.toml", &body.replace("{placement}", placement));
        let o = RunOptions {
            devices,
            figures: false,
            ..opts(&d)
        };
        run_experiment(&exp, &o).unwrap();
        head_rows(&d)
    };
    let one = run("one", "", None);
    let flag = run(
        "flag",
        "",
        Some(DevicesRequest::new("cpu,tch-cpu", None).unwrap()),
    );
    let toml = run("toml", map, None);
    // The per-prompt logit differences agree within 1e-5 (same_patching); the table's
    // normalised metrics divide by (clean - corrupted) and amplify that, so rows are
    // compared at 1e-3 relative, accuracies exactly.
    for (what, got) in [("--devices", &flag), ("[model.placement]", &toml)] {
        assert_eq!(got.len(), one.len(), "{what}");
        let mut worst = 0f64;
        for (a, b) in one.iter().zip(got) {
            assert_eq!(
                (&a.metric, a.layer, a.head, a.phase),
                (&b.metric, b.layer, b.head, b.phase)
            );
            assert_eq!(a.value.is_nan(), b.value.is_nan(), "{what}: {a:?} vs {b:?}");
            if a.metric == "accuracy" {
                assert_eq!(a.value, b.value, "{what}: {a:?} vs {b:?}");
            }
            if a.value.is_finite() {
                let rel = (a.value - b.value).abs() / a.value.abs().max(1.0);
                worst = worst.max(rel);
                assert!(rel <= 1e-3, "{what}: {a:?} vs {b:?}");
            }
        }
        eprintln!("{what}: patch-heads table, worst row relative difference {worst:.2e}");
    }
}
