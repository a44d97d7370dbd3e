//! path-patching: the batched two-step routine against full forwards with the hooks'
//! own actions, and the kind end to end (tables, report, redraw, resume).

use std::sync::Arc;

use crate::common::dev;
use crate::common::runner::*;
use phaselens::hooks::{Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::LanguageModel;
use phaselens::output::{LONG_COLUMNS, LongRow, Table, read_long_rows, validate_columns};
use phaselens::runner::kinds::patch_heads::Direction;
use phaselens::runner::kinds::path_patching::{
    PathCell, PathInput, Receiver, Sender, path_group, path_metric,
};
use phaselens::runner::patching::{Positions, Prompts, Target, readout};
use phaselens::runner::progress::Progress;
use phaselens::runner::report::draw_all;
use phaselens::runner::{ProgressMode, run_experiment};

/// Path patching of one cell with full forwards and the hooks' own actions:
/// sender forward (sender from the partner, every other z / MLP output frozen),
/// receiver forward (only the receiver's input slice replaced).
fn reference(
    model: &dyn LanguageModel,
    prompts: &Prompts,
    s: Sender,
    r: Receiver,
    d: Direction,
) -> Vec<f32> {
    let nl = model.info().n_layers();
    let all: Vec<usize> = (0..4).collect();
    let mut cap = HookSpec::new();
    for l in 0..nl {
        for site in [
            Site::AttnZ,
            Site::MlpOut,
            Site::AttnQ,
            Site::AttnK,
            Site::AttnV,
        ] {
            cap = cap.capture_point(HookPoint::block(l, site));
        }
    }
    let base = Arc::new(
        model
            .forward(prompts.tokens_of(&all, &dev()), &cap)
            .unwrap()
            .cache,
    );
    let rows: Vec<usize> = match d {
        Direction::Denoise => vec![2, 3],
        Direction::Noise => vec![0, 1],
    };
    let partners: Vec<usize> = rows.iter().map(|&p| (p + 2) % 4).collect();
    let own = |spec: HookSpec, p: HookPoint| {
        spec.intervene_point(
            p,
            Action::Resample {
                source: base.clone(),
                perm: rows.clone(),
            },
            Scope::all(),
        )
    };
    let mut spec = HookSpec::new();
    for l in s.layer..nl {
        spec = own(spec, HookPoint::block(l, Site::AttnZ));
        spec = own(spec, HookPoint::block(l, Site::MlpOut));
    }
    spec = spec.intervene_point(
        HookPoint::block(s.layer, Site::AttnZ),
        Action::Resample {
            source: base.clone(),
            perm: partners,
        },
        Scope::heads([s.head]),
    );
    let input = match r.input {
        PathInput::Q => Site::AttnQ,
        PathInput::K => Site::AttnK,
        PathInput::V => Site::AttnV,
    };
    let ip = HookPoint::block(r.layer, input);
    spec = spec.capture_point(ip);
    let toks = prompts.tokens_of(&rows, &dev());
    let sent = Arc::new(model.forward(toks.clone(), &spec).unwrap().cache);
    let spec = HookSpec::new().intervene_point(ip, Action::Patch(sent), Scope::heads([r.head]));
    let logits = model.forward(toks, &spec).unwrap().logits;
    let targets: Vec<&Target> = rows.iter().map(|&p| &prompts.targets[p]).collect();
    readout(logits, &targets)
        .unwrap()
        .iter()
        .map(|o| o.ld)
        .collect()
}

#[test]
fn batched_path_patching_matches_full_forwards() {
    let cfg = tiny(3, 4, 2, 4, 4);
    let model = random_model(&cfg, 9);
    let prompts = pair_prompts(12, 3);
    let senders = vec![Sender { layer: 0, head: 1 }, Sender { layer: 1, head: 3 }];
    let mut cells = Vec::new();
    for d in [Direction::Denoise, Direction::Noise] {
        for (si, s) in senders.iter().enumerate() {
            for lr in s.layer + 1..3 {
                for (input, head) in [(PathInput::Q, 2), (PathInput::K, 1), (PathInput::V, 0)] {
                    cells.push(PathCell {
                        sender: si,
                        receiver: Receiver {
                            layer: lr,
                            head,
                            input,
                        },
                        direction: d,
                    });
                }
            }
        }
    }
    let mut progress = Progress::new(ProgressMode::Hidden, "test", "cells", cells.len() as u64);
    // max_rows 4: chunks of two cells, so rows of different cells share a forward.
    let (_, out) = path_group(
        &model,
        &prompts,
        &senders,
        &cells,
        &Positions::All,
        4,
        &mut progress,
    )
    .unwrap();
    let mut moved = 0;
    for (c, o) in cells.iter().zip(&out) {
        let want = reference(&model, &prompts, senders[c.sender], c.receiver, c.direction);
        for (a, b) in o.iter().zip(&want) {
            assert!(
                (a.ld - b).abs() < 1e-4 * (1.0 + b.abs()),
                "{c:?}: batched {} vs full forwards {b}",
                a.ld
            );
        }
        // A path that moves the logit difference at all (the test is not vacuous).
        let base_ld: Vec<f32> = reference(
            &model,
            &prompts,
            Sender { layer: 2, head: 0 },
            Receiver {
                layer: 2,
                head: 0,
                input: PathInput::Q,
            },
            c.direction,
        );
        if o.iter().zip(&base_ld).any(|(a, b)| (a.ld - b).abs() > 1e-3) {
            moved += 1;
        }
    }
    assert!(moved > 0, "no path changed any logit difference");
}

fn rows(path: &std::path::Path) -> Vec<LongRow> {
    let t = Table::read_arrow(path).unwrap();
    validate_columns(&t, LONG_COLUMNS).unwrap();
    assert!(path.with_extension("parquet").exists());
    read_long_rows(&t).unwrap()
}

#[test]
fn path_patching_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 2, 4, 4), 31);
    let text = "[experiment]\nkind = \"path-patching\"\nbootstrap_reps = 40\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n\n[path]\nsender_layers = [0]\nreceiver_layers = [1]\n";
    let exp = experiment(d, "pp.toml", text);
    let s = run_experiment(&exp, &opts(d)).unwrap();
    // 4 senders x (4 q + 2 k + 2 v receivers) x 4 phases.
    assert_eq!(s.stats.cells_computed, 4 * 8 * 4);
    let table = d.join("notebooks-data/pp/paths.arrow");
    let rows = rows(&table);
    for (input, h) in [(PathInput::Q, 3), (PathInput::K, 1), (PathInput::V, 0)] {
        let m = path_metric(Direction::Denoise, input, 1, h);
        let rs: Vec<&LongRow> = rows.iter().filter(|r| r.metric == m).collect();
        assert_eq!(rs.len(), 4 * 5, "{m}: 4 senders x (4 phases + pooled)");
        assert!(rs.iter().all(|r| r.layer == Some(0)));
    }
    let rep = d.join("reports/pp");
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(md.contains("Strongest paths"), "{md}");
    std::fs::remove_dir_all(&rep).unwrap();
    draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("pp")).unwrap();
    assert!(rep.join("report.md").exists());
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert_eq!(again.stats.cells_resumed, 4 * 8 * 4);
    // No receiver after the senders: an error naming the key.
    let bad = experiment(
        d,
        "bad.toml",
        "[experiment]\nkind = \"path-patching\"\n[model]\norganism = \"tiny\"\n[path]\nsender_layers = [1]\nreceiver_layers = [0, 1]\n",
    );
    let err = run_experiment(&bad, &opts(d)).unwrap_err().to_string();
    assert!(err.contains("receiver_layers"), "{err}");
}
