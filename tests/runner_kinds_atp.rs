//! attribution-patching: the AtP terms against finite differences of the model, and
//! the kind end to end (tables, agreement with exact patching, report, resume).

mod common;

use burn::tensor::{Tensor, TensorData};
use common::runner::*;
use common::{dev, vals};
use phaselens::hooks::{Act, Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::LanguageModel;
use phaselens::output::{HeadKind, LONG_COLUMNS, LongRow, Table, read_long_rows, validate_columns};
use phaselens::runner::kinds::attribution_patching::atp_terms;
use phaselens::runner::kinds::patch_heads::Direction;
use phaselens::runner::patching::{Prompts, Target, readout};
use phaselens::runner::report::draw_all;
use phaselens::runner::run_experiment;

fn rows(path: &std::path::Path) -> Vec<LongRow> {
    let t = Table::read_arrow(path).unwrap();
    validate_columns(&t, LONG_COLUMNS).unwrap();
    assert!(path.with_extension("parquet").exists());
    read_long_rows(&t).unwrap()
}

/// Two clean prompts and their corrupted partners (one token changed), answers 64/65.
fn pair_prompts(len: usize) -> Prompts {
    let mut tokens = Vec::new();
    for i in 0..2u32 {
        tokens.extend((0..len as u32).map(|p| (p * 7 + i * 13) % 60 + 1));
    }
    let clean = tokens.clone();
    for i in 0..2 {
        let mut t = clean[i * len..(i + 1) * len].to_vec();
        t[3 + i] = 100 + i as u32;
        tokens.extend(t);
    }
    let tg = |a: u32, b: u32| Target {
        positions: vec![len - 1],
        answers: vec![a],
        alt: Some(b),
    };
    Prompts {
        len,
        tokens,
        targets: vec![tg(64, 65), tg(64, 65), tg(65, 64), tg(65, 64)],
        source: vec![Some(2), Some(3), Some(0), Some(1)],
        group: vec![0, 0, 1, 1],
    }
}

/// d LD / d epsilon at epsilon = 0 of adding epsilon x (z_partner - z) at one head and
/// position of every receiving prompt, by central differences (clean orientation).
fn finite_difference(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    layer: usize,
    head: usize,
    pos: usize,
    dir: Direction,
) -> Vec<f64> {
    let p = HookPoint::block(layer, Site::AttnZ);
    let all: Vec<usize> = (0..4).collect();
    let toks = prompts.tokens_of(&all, &dev());
    let out = model
        .forward(toks.clone(), &HookSpec::new().capture_point(p))
        .unwrap();
    let z: Tensor<4> = out.cache.get(&p).unwrap().get::<4>().unwrap();
    let [b, t, h, d] = z.dims();
    let zv = vals(z);
    let mut delta = vec![0f32; b * t * h * d];
    for row in 0..4 {
        let partner = prompts.source[row].unwrap();
        for k in 0..d {
            let at = |r: usize| ((r * t + pos) * h + head) * d + k;
            delta[at(row)] = zv[at(partner)] - zv[at(row)];
        }
    }
    let eps = 1e-2f32;
    let ld = |s: f32| -> Vec<f64> {
        let a: Vec<f32> = delta.iter().map(|x| x * s).collect();
        let add = Tensor::<4>::from_data(TensorData::new(a, [b, t, h, d]), &dev());
        let spec = HookSpec::new().intervene_point(p, Action::Add(Act::new(add)), Scope::all());
        let logits = model.forward(toks.clone(), &spec).unwrap().logits;
        let targets: Vec<&Target> = prompts.targets.iter().collect();
        readout(logits, &targets)
            .unwrap()
            .iter()
            .map(|o| o.ld as f64)
            .collect()
    };
    let (up, down) = (ld(eps), ld(-eps));
    let rows: Vec<usize> = match dir {
        Direction::Denoise => vec![2, 3],
        Direction::Noise => vec![0, 1],
    };
    rows.iter()
        .map(|&r| {
            let sign = if r >= 2 { -1.0 } else { 1.0 };
            sign * (up[r] - down[r]) / (2.0 * eps as f64)
        })
        .collect()
}

#[test]
fn atp_terms_are_the_gradient_times_the_activation_difference() {
    let cfg = tiny(2, 4, 2, 4, 4);
    let model = random_model(&cfg, 5);
    let prompts = pair_prompts(12);
    let dirs = [Direction::Denoise, Direction::Noise];
    let terms = atp_terms(&model, &prompts, &[0, 1], &dirs).unwrap();
    assert_eq!(terms.n, 2);
    assert_eq!(terms.heads, vec![4, 4]);
    let mut checked = 0;
    for (di, d) in dirs.iter().enumerate() {
        for (layer, head, pos) in [(0, 1, 11), (1, 2, 11), (0, 3, 5), (1, 0, 4)] {
            let fd = finite_difference(&model, &prompts, layer, head, pos, *d);
            for (i, want) in fd.iter().enumerate() {
                let got = terms.sum(di, layer, i, &[head], &[pos]);
                let tol = 2e-3 + 2e-2 * want.abs();
                assert!(
                    (got - want).abs() < tol,
                    "{d:?} L{layer}.H{head} pos {pos} prompt {i}: AtP {got} vs finite difference {want}"
                );
                if want.abs() > 1e-4 {
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 4, "too few non-zero terms to check ({checked})");
    // Positions before the corrupted token cannot differ: their terms are zero.
    for di in 0..2 {
        for i in 0..2 {
            assert_eq!(terms.sum(di, 0, i, &[0, 1, 2, 3], &[0, 1, 2]), 0.0);
        }
    }
}

fn metric_rows<'a>(rows: &'a [LongRow], metric: &str) -> Vec<&'a LongRow> {
    rows.iter().filter(|r| r.metric == metric).collect()
}

#[test]
fn attribution_patching_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 21);
    let text = "[experiment]\nkind = \"attribution-patching\"\nbootstrap_reps = 40\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n\n[atp]\nposition_band = 3\nvalidate_positions = true\ntop_k = 2\n";
    let exp = experiment(d, "atp.toml", text);
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // Exact cells: (4 query + 2 KV heads) x 2 layers x 2 directions x (head level + 3 offsets) x 4 phases.
    assert_eq!(s.stats.cells_computed, 12 * 2 * 4 * 4);
    let table = d.join("notebooks-data/atp/atp.arrow");
    let rows = rows(&table);
    for m in [
        "atp_nld_denoise",
        "atp_nld_noise",
        "nld_denoise",
        "nld_noise",
    ] {
        // 12 head cells x (4 phases + pooled).
        assert_eq!(metric_rows(&rows, m).len(), 12 * 5, "{m}");
        assert_eq!(
            metric_rows(&rows, &format!("{m}_offset2")).len(),
            12 * 5,
            "{m}"
        );
    }
    // The exact values are what patch-heads computes on the same prompts.
    let ph = experiment(
        d,
        "ph.toml",
        "[experiment]\nkind = \"patch-heads\"\nbootstrap_reps = 40\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n\n[patch]\npositions = \"answer\"\n",
    );
    run_experiment(&ph, &opts(d)).unwrap();
    let ph_rows = self::rows(&d.join("notebooks-data/ph/heads.arrow"));
    let key = |r: &LongRow| (r.layer, r.head, r.head_kind.map(|k| k.as_str()), r.phase);
    for m in ["nld_denoise", "nld_noise"] {
        let want: std::collections::BTreeMap<_, f64> = metric_rows(&ph_rows, m)
            .iter()
            .map(|r| (key(r), r.value))
            .collect();
        for r in metric_rows(&rows, m) {
            let w = want[&key(r)];
            assert!(
                (r.value - w).abs() < 1e-5 || (r.value.is_nan() && w.is_nan()),
                "{m} {:?}: {} vs patch-heads {w}",
                key(r),
                r.value
            );
        }
    }
    // Agreement rows per phase and pooled, for both head kinds; values in range.
    for kind in ["query", "kv"] {
        for stat in ["spearman", "recall_top2", "mae"] {
            let m = format!("{stat}_nld_denoise_{kind}");
            let rs = metric_rows(&rows, &m);
            assert_eq!(rs.len(), 5, "{m}");
            for r in rs {
                if stat == "spearman" && r.value.is_finite() {
                    assert!((-1.0..=1.0).contains(&r.value), "{m} = {}", r.value);
                }
                if stat == "recall_top2" {
                    assert!((0.0..=1.0).contains(&r.value), "{m} = {}", r.value);
                }
            }
        }
        assert_eq!(
            metric_rows(&rows, &format!("spearman_nld_noise_{kind}_positions")).len(),
            5
        );
    }
    // The KV-head estimate is the sum of its query heads' terms: with one position
    // patched, the AtP NLD of KV head g equals the sum of its query heads' AtP NLDs
    // minus (group - 1) x the base level (0 for denoising NLD).
    let est = |l: u32, h: u32, k: HeadKind, m: &str| {
        rows.iter()
            .find(|r| {
                r.metric == m
                    && r.layer == Some(l)
                    && r.head == Some(h)
                    && r.head_kind == Some(k)
                    && r.phase.is_none()
            })
            .unwrap()
            .value
    };
    let kv = est(1, 0, HeadKind::Kv, "atp_nld_denoise");
    let q = est(1, 0, HeadKind::Query, "atp_nld_denoise")
        + est(1, 1, HeadKind::Query, "atp_nld_denoise");
    assert!(
        (kv - q).abs() < 1e-4,
        "KV head {kv} vs sum of its query heads {q}"
    );
    assert!(metric_rows(&rows, "atp_cells_per_s")[0].value > 0.0);
    // Report and figures, and a redraw from the tables alone.
    let rep = d.join("reports/atp");
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(md.contains("Agreement of AtP with exact patching"), "{md}");
    assert!(rep.join("atp_nld_denoise_vs_exact.png").exists());
    assert!(rep.join("atp_nld_denoise_positions.png").exists());
    std::fs::remove_dir_all(&rep).unwrap();
    draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("atp")).unwrap();
    assert!(rep.join("report.md").exists());
    // Resume: nothing is recomputed, the table is the same.
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    let rows2 = self::rows(&table);
    let pick = |rs: &[LongRow]| -> Vec<f64> {
        rs.iter()
            .filter(|r| r.metric.starts_with("atp_nld"))
            .map(|r| r.value)
            .collect()
    };
    assert_eq!(pick(&rows), pick(&rows2));
}

#[test]
fn attribution_patching_checks_its_settings() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_recipe(d, "tiny", &tiny(2, 4, 2, 4, 4));
    for (extra, key) in [
        ("top_k = 0", "top_k"),
        ("directions = []", "directions"),
        (
            "position_band = 0\nvalidate_positions = true",
            "validate_positions",
        ),
    ] {
        let exp = experiment(
            d,
            "bad.toml",
            &format!(
                "[experiment]\nkind = \"attribution-patching\"\n[model]\norganism = \"tiny\"\n[atp]\n{extra}\n"
            ),
        );
        let err = run_experiment(&exp, &opts(d)).unwrap_err().to_string();
        assert!(err.contains(key), "{extra}: {err}");
    }
}
