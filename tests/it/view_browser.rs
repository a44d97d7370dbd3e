//! `phaselens view` in a real browser: the generated site is loaded by headless Chromium
//! (Debian's `chromium`, installed by scripts/setup.sh) with `index.html#selftest`; the
//! page's self-test dispatches real DOM events (hover and click a map cell, click an
//! accuracy point, move the phase-shift slider, click a compressed entry), collects
//! `window.onerror` / `console.error`, and writes its results into `#selftest-result`,
//! which `--dump-dom` returns. The map's cells are compared with the Arrow tables read
//! here. Bad inputs (not run, interrupted, older schema, corrupt, partial) are checked
//! without the browser.
//!
//! `PHASELENS_CHROMIUM` names another browser binary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use phaselens::output::{HeadKind, LongRow, Table, long_table, read_long_rows};
use phaselens::runner::Experiment;
use phaselens::view::exemplars::{CaptureOptions, capture};
use phaselens::view::{
    EXEMPLAR_FILE, Site, ViewOptions, read_exemplars, view_experiment, view_grid,
};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn chromium() -> String {
    let bin = std::env::var("PHASELENS_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let ok = Command::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "`{bin} --version` failed: the browser tests need headless Chromium (bash scripts/setup.sh installs Debian's `chromium`)"
    );
    bin
}

/// Options writing the site into `out`, reading the committed tables, never loading a model.
fn opts(data_root: &Path, out: &Path) -> ViewOptions {
    ViewOptions {
        data_root: data_root.to_path_buf(),
        reports_root: out.join("reports"),
        out: Some(out.join("site")),
        experiments_dir: repo().join("experiments"),
        capture: None,
    }
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// Load `index.html#selftest` in headless Chromium; the self-test's JSON result.
fn selftest(site: &Site) -> Value {
    let url = format!("file://{}#selftest", site.dir.join("index.html").display());
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--virtual-time-budget=10000",
            "--dump-dom",
            &url,
        ])
        .output()
        .expect("running chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    let start = dom
        .find("<pre id=\"selftest-result\">")
        .unwrap_or_else(|| panic!("no #selftest-result in the DOM of {url}:\n{dom}"));
    let body = &dom[start + "<pre id=\"selftest-result\">".len()..];
    let end = body.find("</pre>").expect("closing </pre>");
    let text = unescape(&body[..end]);
    assert!(
        !text.is_empty(),
        "the self-test did not run on {url} (stderr: {})",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn assert_passed(res: &Value, what: &str) {
    let failed: Vec<&Value> = res["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] != Value::Bool(true))
        .collect();
    assert!(
        res["ok"] == Value::Bool(true),
        "{what}: self-test failed: {failed:?}; errors {}",
        res["errors"]
    );
    assert_eq!(
        res["errors"].as_array().unwrap().len(),
        0,
        "{what}: console errors"
    );
}

fn check_names(res: &Value) -> Vec<String> {
    res["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect()
}

/// Per-head rows of the first model in the experiment's long tables.
fn head_rows(dir: &Path) -> Vec<LongRow> {
    let mut rows = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "arrow") && p.file_name().unwrap() != EXEMPLAR_FILE {
            rows.extend(read_long_rows(&Table::read_arrow(&p).unwrap()).unwrap());
        }
    }
    let model = rows[0].model.clone();
    rows.into_iter()
        .filter(|r| r.model == model && r.head.is_some() && r.phase.is_some())
        .collect()
}

/// Every per-head table row is one map cell in the browser, with its value.
fn assert_cells_match(res: &Value, rows: &[LongRow]) {
    let mut cells: BTreeMap<(String, String, u32, u32, u32), Option<f64>> = BTreeMap::new();
    for c in res["cells"].as_array().unwrap() {
        let key = (
            c[0].as_str().unwrap().to_string(),
            c[1].as_str().unwrap().to_string(),
            c[2].as_u64().unwrap() as u32,
            c[3].as_u64().unwrap() as u32,
            c[4].as_u64().unwrap() as u32,
        );
        let v = c[5].as_str().map(|s| s.parse::<f64>().unwrap());
        assert!(
            cells.insert(key.clone(), v).is_none(),
            "cell {key:?} drawn twice"
        );
    }
    let mut with_value = 0;
    for r in rows {
        let kind = if r.head_kind == Some(HeadKind::Kv) {
            "kv"
        } else {
            "query"
        };
        let key = (
            r.metric.clone(),
            kind.to_string(),
            r.layer.unwrap(),
            r.head.unwrap(),
            r.phase.unwrap(),
        );
        let shown = cells
            .get(&key)
            .unwrap_or_else(|| panic!("table row {key:?} has no cell in the page"));
        match shown {
            Some(v) if v.is_finite() => {
                assert!(
                    (v - r.value).abs() <= 1e-6 * (1.0 + r.value.abs()),
                    "{key:?}: page {v}, table {}",
                    r.value
                );
                with_value += 1;
            }
            _ => assert!(
                !r.value.is_finite(),
                "{key:?}: page shows no value, table {}",
                r.value
            ),
        }
    }
    let drawn_with_value = cells.values().filter(|v| v.is_some()).count();
    assert_eq!(
        drawn_with_value,
        rows.len(),
        "cells with a value vs table rows"
    );
    assert!(with_value > 0 || rows.is_empty());
}

/// The site of a committed experiment; self-test, cells vs tables; returns the result.
fn check_shipped(name: &str, tmp: &Path) -> (Site, Value) {
    let site = view_experiment(name, &opts(&repo().join("notebooks-data"), tmp)).unwrap();
    let res = selftest(&site);
    assert_passed(&res, name);
    assert_cells_match(&res, &head_rows(&repo().join("notebooks-data").join(name)));
    (site, res)
}

#[test]
fn v4pro_map_prompt_view_and_shift_slider_work_in_chromium() {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let (site, res) = check_shipped("v4pro", tmp.path());
    let names = check_names(&res);
    for want in [
        "hover shows the value, CI and n",
        "click locks the cell",
        "click opens the prompt view at the cell phase",
        "slider moves the needle to another phase",
        "slider shows that rendering's answer probability",
        "clicking an entry shows its gate weights or says there are none",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "check `{want}` did not run: {names:?}"
        );
    }
    assert!(
        site.bytes < 2 * 1024 * 1024,
        "page weight {} bytes (aim < 2 MB)",
        site.bytes
    );
    eprintln!(
        "v4pro site: {:.1} KB, first render {} ms in the page, {:.1} s with the browser start",
        site.bytes as f64 / 1024.0,
        res["render_ms"],
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn shipped_intervention_and_diagnostic_experiments_have_working_viewers() {
    for name in [
        "w8s8-ablate",
        "w8s8-knockout",
        "w8s8-retrieval",
        "v4pro-indexer",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (_, res) = check_shipped(name, tmp.path());
        let names = check_names(&res);
        assert!(
            names.iter().any(|n| n.starts_with("slider moves")),
            "{name}: no exemplars in the site: {names:?}"
        );
    }
}

#[test]
fn the_paper_grid_has_a_design_by_phase_viewer() {
    let tmp = tempfile::tempdir().unwrap();
    let site = view_grid("paper", &opts(&repo().join("notebooks-data"), tmp.path())).unwrap();
    let res = selftest(&site);
    assert_passed(&res, "grid paper");
    assert!(
        check_names(&res)
            .iter()
            .any(|n| n == "grid has design x phase cells")
    );
}

#[test]
fn the_mitigation_grid_viewer_lists_every_pooled_design_with_its_verdicts() {
    let tmp = tempfile::tempdir().unwrap();
    let data = repo().join("notebooks-data");
    let site = view_grid("mitigations", &opts(&data, tmp.path())).unwrap();
    let res = selftest(&site);
    assert_passed(&res, "grid mitigations");
    let names = check_names(&res);
    for want in [
        "the frontier has one row per pooled design",
        "clicking a pooled design draws each seed's accuracy by phase",
    ] {
        assert!(names.iter().any(|n| n == want), "{want}: {names:?}");
    }
    // The verdicts on the page are the table's, design by design and protocol by
    // protocol, in the table's order.
    let t = Table::read_arrow(data.join("grids/mitigations/grid_frontier.arrow")).unwrap();
    let (d, p, v) = (
        t.utf8("design").unwrap(),
        t.utf8("protocol").unwrap(),
        t.utf8("verdict").unwrap(),
    );
    let mut want: Vec<(String, String, String)> = (0..t.num_rows())
        .map(|i| {
            (
                d[i].clone().unwrap(),
                p[i].clone().unwrap(),
                v[i].clone().unwrap(),
            )
        })
        .collect();
    let mut got: Vec<(String, String, String)> = res["frontier"]
        .as_array()
        .expect("the self-test reports the frontier's verdicts")
        .iter()
        .map(|r| {
            let s = |k: usize| r[k].as_str().unwrap().to_string();
            (s(0), s(1), s(2))
        })
        .collect();
    assert_eq!(got.len(), want.len());
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert!(
        got.iter()
            .any(|r| r.0 == "stagger-kv4" && r.2 == "inconclusive")
    );
}

/// Copy the long tables of a committed experiment (not its exemplars) into `root/name`.
fn copy_tables(name: &str, root: &Path) -> PathBuf {
    let src = repo().join("notebooks-data").join(name);
    let dst = root.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "arrow") && p.file_name().unwrap() != EXEMPLAR_FILE {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    dst
}

#[test]
fn a_partial_run_hatches_missing_cells_and_says_so_and_missing_exemplars_are_stated() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    let dir = copy_tables("v4pro", &root);
    let path = dir.join("heads.arrow");
    let t = Table::read_arrow(&path).unwrap();
    let mut rows = read_long_rows(&t).unwrap();
    // Drop phase 7 of layer 3 (as if the run stopped before its last chunk).
    rows.retain(|r| !(r.layer == Some(3) && r.phase == Some(7)));
    let mut out = long_table("heads", &rows);
    for (k, v) in t.metadata() {
        out.set_metadata(k.clone(), v.clone());
    }
    out.write_arrow(&path).unwrap();
    let site = view_experiment("v4pro", &opts(&root, tmp.path())).unwrap();
    assert!(
        site.warnings
            .iter()
            .any(|w| w.contains("head x phase cells in the tables")),
        "{:?}",
        site.warnings
    );
    assert!(site.warnings.iter().any(|w| w.contains("no exemplars")));
    let res = selftest(&site);
    assert_passed(&res, "partial v4pro");
    assert!(
        check_names(&res)
            .iter()
            .any(|n| n == "a missing exemplar table is stated")
    );
    let kept: Vec<LongRow> = head_rows(&dir);
    assert_cells_match(&res, &kept);
    let html = std::fs::read_to_string(site.dir.join("data.js")).unwrap();
    assert!(html.contains("a partial run?"));
}

#[test]
fn bad_inputs_are_named_not_drawn_as_empty_maps() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    std::fs::create_dir_all(&root).unwrap();
    let o = opts(&root, tmp.path());
    let err = |name: &str| view_experiment(name, &o).unwrap_err().to_string();

    // Not run.
    let e = err("never-ran");
    assert!(e.contains("has not run"), "{e}");

    // Interrupted: shards, no tables yet.
    std::fs::create_dir_all(root.join("stopped/shards/abc123")).unwrap();
    let e = err("stopped");
    assert!(e.contains("interrupted run") && e.contains("shards"), "{e}");

    // Corrupt table: the error names the file.
    let dir = copy_tables("v4pro", &root);
    let bytes = std::fs::read(dir.join("heads.arrow")).unwrap();
    std::fs::write(dir.join("heads.arrow"), &bytes[..bytes.len() / 3]).unwrap();
    let e = err("v4pro");
    assert!(e.contains("heads.arrow"), "{e}");

    // Older schema: said so, with the file and its schema.
    let dir = root.join("old");
    std::fs::create_dir_all(&dir).unwrap();
    let t = long_table("heads", &[]).with_metadata("phaselens.schema", "long/v0");
    t.write_arrow(dir.join("heads.arrow")).unwrap();
    let e = err("old");
    assert!(e.contains("long/v0") && e.contains("heads.arrow"), "{e}");

    // A corrupt exemplar table names its file too.
    let dir = copy_tables("w8s8-knockout", &root);
    std::fs::write(dir.join(EXEMPLAR_FILE), b"not arrow").unwrap();
    let e = err("w8s8-knockout");
    assert!(e.contains(EXEMPLAR_FILE), "{e}");
}

/// Capture on the shipped DeepSeek-V4 organism: every rendering of a logical example at
/// every phase, attention rows that are distributions, gates per offset, and the CSA
/// layer's indexer choice.
#[test]
fn exemplars_capture_patterns_gates_and_the_indexer_through_the_hooks() {
    let tmp = tempfile::tempdir().unwrap();
    let org = repo().join("experiments/organisms/v4pro-mini");
    let text = format!(
        "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"{}\"\n[task]\nn_logical = 8\n",
        org.display()
    );
    let exp_path = tmp.path().join("cap.toml");
    std::fs::write(&exp_path, text).unwrap();
    let exp = Experiment::load(&exp_path).unwrap();
    let o = CaptureOptions {
        logical: 1,
        min_weight: 0.0,
        ..CaptureOptions::default()
    };
    let path = capture(&exp, tmp.path(), &o).unwrap();
    let rows = read_exemplars(&path).unwrap();
    let phases: std::collections::BTreeSet<i64> = rows.iter().map(|r| r.phase).collect();
    assert_eq!(phases.len(), 8, "one rendering per phase");
    let shifts: std::collections::BTreeSet<i64> = rows.iter().map(|r| r.shift).collect();
    assert_eq!(
        shifts.len(),
        8,
        "the same example shifted by 8 different pad counts"
    );
    // With min_weight 0 every slot is stored: each head's row sums to 1.
    let mut sums: BTreeMap<(i64, i64, i64), f64> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.record == "pattern") {
        *sums
            .entry((r.shift, r.layer.unwrap(), r.head.unwrap()))
            .or_default() += r.value;
    }
    assert_eq!(sums.len(), 8 * 4 * 4);
    for (k, s) in &sums {
        assert!((s - 1.0).abs() < 1e-2, "{k:?}: attention row sums to {s}");
    }
    let csa: Vec<&_> = rows
        .iter()
        .filter(|r| r.record == "indexer_selected")
        .collect();
    assert!(
        !csa.is_empty() && csa.iter().all(|r| r.layer == Some(2)),
        "indexer rows on the CSA layer only"
    );
    assert!(csa.iter().any(|r| r.value == 1.0));
    assert!(rows.iter().any(|r| r.record == "key_gate" && r.value > 0.0));
    let probs: Vec<f64> = rows
        .iter()
        .filter(|r| r.record == "answer_prob")
        .map(|r| r.value)
        .collect();
    assert_eq!(probs.len(), 8);
    assert!(probs.iter().all(|p| (0.0..=1.0).contains(p)));
    // The token strip: as many tokens as the prompt, the key inside it.
    let first = shifts.iter().next().copied().unwrap();
    let toks = rows
        .iter()
        .filter(|r| r.record == "token" && r.shift == first)
        .count();
    let key = rows
        .iter()
        .find(|r| r.record == "key_pos" && r.shift == first)
        .unwrap()
        .value as usize;
    assert!(key < toks);
}

/// `view --weights stored|f32` loads the capture's model so (the line it prints names
/// the residency and the resident bytes); a bad value is clap's error naming it.
#[test]
fn view_takes_weights_for_its_capture_forwards() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    copy_tables("v4pro", &root);
    let view = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_phaselens"))
            .arg("view")
            .arg("v4pro")
            .arg("--data-dir")
            .arg(&root)
            .arg("--reports-dir")
            .arg(tmp.path().join("reports"))
            .arg("--experiments-dir")
            .arg(repo().join("experiments"))
            .args(["--exemplars", "1"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = view(
        &["--weights", "f32", "--out"]
            .into_iter()
            .chain([tmp.path().join("site").to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{e}");
    assert!(e.contains("weights f32:") && e.contains("resident"), "{e}");
    assert!(root.join("v4pro").join(EXEMPLAR_FILE).exists(), "{e}");
    let out = view(&["--weights", "half"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("half") && e.contains("`stored`") && e.contains("`f32`"),
        "{e}"
    );
}

/// `view` on an experiment run under an overlay (here `evict` on the full-attention
/// organism): the capture loads the model under it, every layer's exemplar rows hold
/// the chunks it kept (`hook_selected`: ceil(keep x chunks before the observation
/// window)) and its attention folded onto the tokens, and the page draws the overlay's
/// layers x chunks grid from them (checked cell by cell in Chromium).
#[test]
fn view_under_an_overlay_draws_what_it_kept_per_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    copy_tables("full-attn-patch", &root);
    let exps = tmp.path().join("experiments");
    std::fs::create_dir_all(&exps).unwrap();
    let org = repo().join("experiments/organisms/full-attn");
    let text = format!(
        "[experiment]\nkind = \"patch-heads\"\n[model]\norganism = \"{}\"\ncompression = {{ kind = \"evict\", chunk = 8, keep = 0.25, observe = 8 }}\n[task]\nprotocol = \"prefix_padding\"\nn_logical = 8\n",
        org.display()
    );
    std::fs::write(exps.join("full-attn-patch.toml"), text).unwrap();
    let o = ViewOptions {
        experiments_dir: exps,
        capture: Some(CaptureOptions {
            logical: 1,
            ..CaptureOptions::default()
        }),
        ..opts(&root, tmp.path())
    };
    let site = view_experiment("full-attn-patch", &o).unwrap();
    let path = site
        .captured
        .clone()
        .unwrap_or_else(|| panic!("{:?}", site.warnings));
    let rows = read_exemplars(&path).unwrap();
    // Chunks of 8 before the observation window (the last 8 tokens of each rendering).
    let mut tokens: BTreeMap<i64, usize> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.record == "token") {
        *tokens.entry(r.shift).or_default() += 1;
    }
    let chunks = |shift: i64| (tokens[&shift] - 8).div_ceil(8);
    let mut kept: BTreeMap<(i64, i64), (usize, f64)> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.record == "indexer_selected") {
        let e = kept.entry((r.shift, r.layer.unwrap())).or_default();
        e.0 += 1;
        e.1 += r.value;
    }
    assert_eq!(kept.len(), 8 * 4, "every rendering x layer has its chunks");
    for (&(shift, layer), &(n, sum)) in &kept {
        assert_eq!(n, chunks(shift), "shift {shift} layer {layer}");
        let want = (0.25 * n as f64).ceil();
        assert_eq!(sum, want, "shift {shift} layer {layer}: chunks kept");
    }
    assert!(rows.iter().any(|r| {
        r.record == "layer_kind"
            && r.label
                .as_deref()
                .is_some_and(|l| l.starts_with("evict chunk=8"))
    }));
    let res = selftest(&site);
    assert_passed(&res, "full-attn under evict");
    assert!(check_names(&res).contains(&"every overlay cell shows hook_selected".to_string()));
    assert_eq!(res["overlay"]["layers"], 4);
    let shown = res["overlay"]["blocks"].as_u64().unwrap() as usize;
    assert!(
        kept.values().any(|&(n, _)| n == shown),
        "{shown} chunks drawn"
    );
}
