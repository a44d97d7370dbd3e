//! attribution-patching: the AtP terms against finite differences of the model, and
//! the kind end to end (tables, agreement with exact patching, report, resume).

use crate::common::runner::*;
use crate::common::{dev, vals};
use burn::tensor::{Tensor, TensorData};
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
    let prompts = pair_prompts(12, 3);
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

// ---------------------------------------------------------------------------------
// AtP* (qk_fix): query and key nodes.

use phaselens::runner::kinds::atp_star::{QkMethod, QkSite, qk_terms};

/// `[b, ...]` rows of `t` in the order `rows`.
fn rows_of<const D: usize>(t: Tensor<D>, rows: &[usize]) -> Tensor<D> {
    let idx: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    t.select(
        0,
        Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(idx, [rows.len()]), &dev()),
    )
}

/// `dLD/dA` of layer `l`'s pattern, every prompt in the clean orientation (clean
/// prompts +LD, corrupted -LD), by its own backward; and the clean pattern.
fn pattern_and_gradient(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    l: usize,
) -> (Vec<f32>, Vec<f32>, [usize; 4]) {
    let p = HookPoint::block(l, Site::AttnPattern);
    let n2 = prompts.n();
    let all: Vec<usize> = (0..n2).collect();
    let toks = prompts.tokens_of(&all, &dev());
    let a: Tensor<4> = model
        .forward(toks.clone(), &HookSpec::new().capture_point(p))
        .unwrap()
        .cache
        .get(&p)
        .unwrap()
        .get::<4>()
        .unwrap();
    let dims = a.dims();
    let leaf = Tensor::<4>::zeros(dims, &dev().autodiff()).require_grad();
    let spec =
        HookSpec::new().intervene_point(p, Action::Add(Act::new(leaf.clone())), Scope::all());
    let logits = model.forward(toks, &spec).unwrap().logits;
    let mut loss: Option<Tensor<1>> = None;
    let [_, t, v] = logits.dims();
    for (r, tg) in prompts.targets.iter().enumerate() {
        let at = |tok: u32| {
            logits
                .clone()
                .slice([
                    r..r + 1,
                    tg.positions[0]..tg.positions[0] + 1,
                    tok as usize..tok as usize + 1,
                ])
                .reshape([1])
        };
        assert!(tg.positions[0] < t && (tg.answers[0] as usize) < v);
        let sign = if r < n2 / 2 { 1.0 } else { -1.0 };
        let ld = (at(tg.answers[0]) - at(tg.alt.unwrap())) * sign;
        loss = Some(match loss {
            Some(x) => x + ld,
            None => ld,
        });
    }
    let grads = loss.unwrap().backward();
    (vals(a), vals(leaf.grad(&grads).unwrap()), dims)
}

/// Row `r`'s `sum (A' - A) . G` over its whole pattern `[head, query, slot]`.
fn pattern_change_times_gradient(
    a: &[f32],
    a2: &[f32],
    g: &[f32],
    dims: [usize; 4],
    r: usize,
) -> f64 {
    let per = dims[1] * dims[2] * dims[3];
    (r * per..(r + 1) * per)
        .map(|i| (a2[i] as f64 - a[i] as f64) * g[i] as f64)
        .sum()
}

fn capture4(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    spec: HookSpec,
    p: HookPoint,
) -> Tensor<4> {
    let all: Vec<usize> = (0..prompts.n()).collect();
    model
        .forward(prompts.tokens_of(&all, &dev()), &spec.capture_point(p))
        .unwrap()
        .cache
        .get(&p)
        .unwrap()
        .get::<4>()
        .unwrap()
}

/// (direction index, pair index) of row `r` of four prompts (denoise = 0 reads the
/// corrupted rows 2, 3; noise = 1 the clean rows 0, 1).
fn dir_pair(r: usize) -> (usize, usize) {
    if r >= 2 { (0, r - 2) } else { (1, r) }
}

#[test]
fn atp_star_terms_are_the_exact_pattern_change_times_the_gradient() {
    // Compressed entries (window 4, stride 4), a raw tail of 2 and a sink: every kind
    // of key slot.
    let cfg = tiny(2, 4, 2, 4, 4);
    let model = random_model(&cfg, 5);
    let prompts = pair_prompts(12, 3);
    let partner: Vec<usize> = prompts.source.iter().map(|s| s.unwrap()).collect();
    let qk = qk_terms(
        &model,
        &prompts,
        &[0, 1],
        &[Direction::Denoise, Direction::Noise],
    )
    .unwrap();
    let mut nonzero = 0;
    for l in 0..2 {
        let (a, g, dims) = pattern_and_gradient(&model, &prompts, l);
        let pat = HookPoint::block(l, Site::AttnPattern);
        let (qp, kp, ckp) = (
            HookPoint::block(l, Site::AttnQ),
            HookPoint::block(l, Site::AttnK),
            HookPoint::block(l, Site::CompressedK),
        );
        // Query nodes: patch one head's query at one position, every prompt from its partner.
        let q = capture4(&model, &prompts, HookSpec::new(), qp);
        for (h, t) in [(0, 11), (1, 11), (2, 7), (3, 4), (1, 9)] {
            let spec = HookSpec::new().intervene_point(
                qp,
                Action::Replace(Act::new(rows_of(q.clone(), &partner))),
                Scope::heads(vec![h]).with_positions(vec![t]),
            );
            let a2 = vals(capture4(&model, &prompts, spec, pat));
            for r in 0..4 {
                let want = pattern_change_times_gradient(&a, &a2, &g, dims, r);
                let (di, i) = dir_pair(r);
                let got = qk.q_star.sum(di, l, i, &[h], &[t]);
                assert!(
                    (got - want).abs() < 1e-4 + 1e-3 * want.abs(),
                    "L{l}.H{h} query at {t}, prompt {r}: AtP* {got} vs brute force {want}"
                );
                nonzero += (want.abs() > 1e-5) as usize;
            }
        }
        // Key nodes: every slot of a KV head on its own. Entry slots get the entry that
        // pools the partner's keys with the prompt's own gates; raw slots the partner's
        // key at that position with the entries held clean.
        let k = capture4(&model, &prompts, HookSpec::new(), kp);
        let kx = rows_of(k.clone(), &partner);
        let ck = capture4(&model, &prompts, HookSpec::new(), ckp);
        let ckx = capture4(
            &model,
            &prompts,
            HookSpec::new().intervene_point(
                kp,
                Action::Replace(Act::new(kx.clone())),
                Scope::all(),
            ),
            ckp,
        );
        let n_entries = ck.dims()[1];
        for kvh in 0..2 {
            let mut want = [0.0f64; 4];
            for e in 0..n_entries {
                let spec = HookSpec::new().intervene_point(
                    ckp,
                    Action::Replace(Act::new(ckx.clone())),
                    Scope::heads(vec![kvh]).with_positions(vec![e]),
                );
                let a2 = vals(capture4(&model, &prompts, spec, pat));
                for (r, w) in want.iter_mut().enumerate() {
                    *w += pattern_change_times_gradient(&a, &a2, &g, dims, r);
                }
            }
            for s in 0..12 {
                let spec = HookSpec::new()
                    .intervene_point(
                        kp,
                        Action::Replace(Act::new(kx.clone())),
                        Scope::heads(vec![kvh]).with_positions(vec![s]),
                    )
                    .intervene_point(ckp, Action::Replace(Act::new(ck.clone())), Scope::all());
                let a2 = vals(capture4(&model, &prompts, spec, pat));
                for (r, w) in want.iter_mut().enumerate() {
                    *w += pattern_change_times_gradient(&a, &a2, &g, dims, r);
                }
            }
            for (r, w) in want.iter().enumerate() {
                let (di, i) = dir_pair(r);
                let got = qk.k_star.sum(di, l, i, &[kvh], &[0]);
                assert!(
                    (got - w).abs() < 2e-4 + 2e-3 * w.abs(),
                    "L{l}.KV{kvh}, prompt {r}: AtP* over key slots {got} vs brute force {w}"
                );
                nonzero += (w.abs() > 1e-5) as usize;
            }
        }
    }
    assert!(nonzero >= 12, "too few non-zero terms to check ({nonzero})");
    assert_eq!(qk.get(QkSite::K, QkMethod::AtpStar).len, 1);
}

/// `n` clean prompts of `len` random tokens and their partners, which differ only in
/// the last (read) token: the query there differs, the keys before it do not.
fn last_token_pairs(n: usize, len: usize) -> Prompts {
    let mut tokens = Vec::new();
    for i in 0..n {
        tokens.extend((0..len).map(|p| ((p * 37 + i * 11 + 5) % 60) as u32 + 1));
    }
    for i in 0..n {
        let mut t = tokens[i * len..(i + 1) * len].to_vec();
        t[len - 1] = 70 + i as u32;
        tokens.extend(t);
    }
    let tg = |a: u32, b: u32| Target {
        positions: vec![len - 1],
        answers: vec![a],
        alt: Some(b),
    };
    let mut targets = vec![tg(64, 65); n];
    targets.extend(vec![tg(65, 64); n]);
    Prompts {
        len,
        tokens,
        targets,
        source: (0..2 * n).map(|r| Some((r + n) % (2 * n))).collect(),
        group: (0..2 * n).map(|r| r % n).collect(),
    }
}

#[test]
fn atp_star_recovers_what_saturated_attention_hides_from_atp() {
    use burn::module::Param;
    // One layer whose query norm is scaled up: every softmax row is one-hot.
    let cfg = tiny(1, 4, 2, 4, 4);
    let mut model = random_model(&cfg, 11);
    let qn = model.blocks[0].attn.q_norm.as_mut().unwrap();
    let w = qn.weight.val() * 100.0;
    qn.weight = Param::initialized(qn.weight.id, w);
    // A small output projection keeps the step from the pattern to the logits in its
    // linear range (final norm, MLP): what remains of AtP*'s error is that step alone.
    let wo = &mut model.blocks[0].attn.w_o;
    let w = wo.weight.val() * 0.01;
    wo.weight = Param::initialized(wo.weight.dense().unwrap().id, w).into();
    let n = 6;
    let len = 12;
    let prompts = last_token_pairs(n, len);
    let t = len - 1;
    let pat = HookPoint::block(0, Site::AttnPattern);
    let a = vals(capture4(&model, &prompts, HookSpec::new(), pat));
    let slots = a.len() / (2 * n * 4 * len);
    let top = |r: usize, h: usize| {
        let at = ((r * 4 + h) * len + t) * slots;
        a[at..at + slots].iter().fold(0f32, |m, x| m.max(*x))
    };
    let saturated: usize = (0..2 * n)
        .map(|r| (0..4).filter(|&h| top(r, h) > 0.999).count())
        .sum();
    assert!(
        saturated >= 6 * n,
        "too few saturated read rows ({saturated} of {})",
        8 * n
    );
    let qk = qk_terms(&model, &prompts, &[0], &[Direction::Denoise]).unwrap();
    // Exact: patch one head's query at the read position of the corrupted prompts.
    let qp = HookPoint::block(0, Site::AttnQ);
    let q = capture4(&model, &prompts, HookSpec::new(), qp);
    let partner: Vec<usize> = prompts.source.iter().map(|s| s.unwrap()).collect();
    let all: Vec<usize> = (0..2 * n).collect();
    let toks = prompts.tokens_of(&all, &dev());
    let targets: Vec<&Target> = prompts.targets.iter().collect();
    let base = readout(
        model
            .forward(toks.clone(), &HookSpec::new())
            .unwrap()
            .logits,
        &targets,
    )
    .unwrap();
    let mut big = Vec::new();
    for h in 0..4 {
        let spec = HookSpec::new().intervene_point(
            qp,
            Action::Replace(Act::new(rows_of(q.clone(), &partner))),
            Scope::heads(vec![h]).with_positions(vec![t]),
        );
        let out = readout(model.forward(toks.clone(), &spec).unwrap().logits, &targets).unwrap();
        for i in 0..n {
            // The clean-orientation LD of the corrupted prompt is -ld.
            let exact = -(out[n + i].ld as f64 - base[n + i].ld as f64);
            let atp = qk.q_atp.sum(0, 0, i, &[h], &[t]);
            let star = qk.q_star.sum(0, 0, i, &[h], &[t]);
            // A large effect with both read rows (the prompt's and its partner's) one-hot.
            if exact.abs() > 0.02 && top(n + i, h) > 0.999 && top(i, h) > 0.999 {
                big.push((h, i, exact, atp, star));
            }
        }
    }
    eprintln!("(head, pair, exact, AtP, AtP*): {big:?}");
    assert!(
        big.len() >= 2,
        "the construction should give large exact effects: {big:?}"
    );
    for &(h, i, exact, atp, star) in &big {
        assert!(
            atp.abs() < 0.05 * exact.abs(),
            "H{h} prompt {i}: AtP {atp} should be ~0 against exact {exact} (saturated softmax)"
        );
        assert!(
            (star - exact).abs() < 0.5 * exact.abs(),
            "H{h} prompt {i}: AtP* {star} should recover exact {exact} (AtP {atp})"
        );
    }
}

#[test]
fn attribution_patching_with_qk_fix_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 21);
    let text = "[experiment]\nkind = \"attribution-patching\"\nbootstrap_reps = 40\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n\n[atp]\nposition_band = 0\ntop_k = 2\nqk_fix = true\n";
    let exp = experiment(d, "qk.toml", text);
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // Exact cells: hook_z (4 query + 2 KV heads) and hook_q / hook_k (the same heads),
    // x 2 layers x 2 directions x 4 phases.
    assert_eq!(s.stats.cells_computed, 2 * 12 * 2 * 4);
    let rows = rows(&d.join("notebooks-data/qk/atp.arrow"));
    for (site, kind, heads) in [("q", HeadKind::Query, 8), ("k", HeadKind::Kv, 4)] {
        for dir in ["denoise", "noise"] {
            for m in [
                format!("{site}_nld_{dir}"),
                format!("atp_{site}_nld_{dir}"),
                format!("atpstar_{site}_nld_{dir}"),
            ] {
                let rs = metric_rows(&rows, &m);
                assert_eq!(rs.len(), heads * 5, "{m}");
                assert!(rs.iter().all(|r| r.head_kind == Some(kind)), "{m}");
                assert!(rs.iter().any(|r| r.value.is_finite()), "{m}");
            }
            for method in ["atp", "atpstar"] {
                for stat in ["spearman", "recall_top2", "mae"] {
                    let m = format!("{stat}_{method}_{site}_nld_{dir}");
                    assert_eq!(metric_rows(&rows, &m).len(), 5, "{m}");
                }
            }
        }
    }
    assert!(metric_rows(&rows, "atpstar_cells_per_s")[0].value > 0.0);
    assert!(metric_rows(&rows, "exact_qk_cells_per_s")[0].value > 0.0);
    let md = std::fs::read_to_string(d.join("reports/qk/report.md")).unwrap();
    assert!(md.contains("AtP* of the query and key nodes"), "{md}");
    assert!(
        md.contains("Agreement of AtP / AtP* with exact patching of q and k"),
        "{md}"
    );
    assert!(
        d.join("reports/qk/atpstar_qk_nld_denoise_vs_exact.png")
            .exists()
    );
    // Resume: the exact q/k cells come from the store, the estimates are the same.
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    let rows2 = self::rows(&d.join("notebooks-data/qk/atp.arrow"));
    let pick = |rs: &[LongRow]| -> Vec<f64> {
        rs.iter()
            .filter(|r| r.metric.starts_with("atpstar_") && r.metric.contains("_nld_"))
            .map(|r| r.value)
            .collect()
    };
    assert_eq!(pick(&rows), pick(&rows2));
}
