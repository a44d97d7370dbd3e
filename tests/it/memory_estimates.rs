//! Memory estimates follow what one forward really holds: the runner's check sizes the
//! rows the executor puts in one forward (a long-context run at 65,536 tokens runs one
//! prompt per forward and is not refused as if it held the whole group), and the
//! per-forward estimate is held against the peak resident memory a forward reaches; the
//! patching budget's estimate of a group (base run, captures, prefix state, chunks) is
//! held against the peak of the CI-sized variant of `exp/realwidth-patch.toml`.

use crate::common::runner::{experiment, opts, random_model, tiny, two_value_organism};
use burn::tensor::{Int, Tensor, TensorData};
use phaselens::device::DeviceSpec;
use phaselens::hooks::HookSpec;
use phaselens::model::memory::{forward_bytes, human};
use phaselens::runner::run_experiment;

/// `VmHWM` (peak resident set) or `VmRSS` of this process, in bytes.
fn status_bytes(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// Reset the peak resident set to the current one (Linux: `5` > clear_refs).
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[test]
fn the_forward_estimate_bounds_the_measured_peak_and_is_not_far_above_it() {
    if !reset_peak() {
        eprintln!("SKIPPED: /proc/self/clear_refs cannot reset the peak here");
        return;
    }
    let cfg = tiny(1, 2, 1, 64, 64);
    let device = DeviceSpec::Cpu.device().unwrap();
    let model = random_model(&cfg, 1);
    let info = model.info();
    let mut ratios = Vec::new();
    for (rows, len) in [(1usize, 65_536usize), (4, 16_384), (16, 4_096)] {
        let ids: Vec<i64> = (0..rows * len)
            .map(|i| ((i * 31) % 100) as i64 + 3)
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows, len]), &device);
        reset_peak();
        let before = status_bytes("VmRSS:");
        let out = model.forward(tokens, &HookSpec::new()).unwrap();
        let peak = status_bytes("VmHWM:").saturating_sub(before) as f64;
        drop(out);
        let est = forward_bytes(&info, rows, len);
        eprintln!(
            "{rows} x {len}: estimate {}, measured peak {}",
            human(est),
            human(peak)
        );
        ratios.push((rows, len, est, peak));
    }
    // Every estimate bounds its peak. Only the first forward runs on fresh memory:
    // later ones reuse pages the allocator kept, so only it bounds the estimate from
    // above.
    for (i, (rows, len, est, peak)) in ratios.into_iter().enumerate() {
        assert!(
            est >= peak,
            "{rows} x {len}: the estimate {} is below the measured peak {}",
            human(est),
            human(peak)
        );
        assert!(
            i > 0 || est <= 16.0 * peak.max(1.0),
            "{rows} x {len}: the estimate {} is more than 16x the measured peak {}",
            human(est),
            human(peak)
        );
    }
}

#[test]
fn a_long_context_run_with_one_prompt_per_forward_is_sized_per_forward() {
    // 65,536 tokens, one prompt per forward (tokens_per_forward below the length). The
    // check used to size 64 rows at once (about 64x what a forward holds) and refuse.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = tiny(1, 2, 1, 64, 64);
    two_value_organism(d, "tiny", &cfg, 3);
    let exp = experiment(
        d,
        "lc.toml",
        "[experiment]\nkind = \"long-context\"\nbootstrap_reps = 10\nmax_rows = 64\n\
         [model]\norganism = \"tiny\"\n[task]\nn_logical = 1\nphases = [0]\n\
         [long_context]\nlengths = [65536]\ndepths = [0.5]\nprotocols = [\"prefix_padding\"]\n\
         tokens_per_forward = 16384\n",
    );
    let info = random_model(&cfg, 3).info();
    let one = forward_bytes(&info, 1, 65_536);
    let group = forward_bytes(&info, 64, 65_536);
    eprintln!("one forward {}, 64 rows {}", human(one), human(group));
    let s = run_experiment(&exp, &opts(d));
    assert!(s.is_ok(), "{}", s.err().unwrap());
    assert!(d.join("notebooks-data/lc/tiny/long_context.arrow").exists());
}

#[test]
fn the_patching_estimate_is_within_20_percent_of_the_realwidth_ci_patch_peak() {
    // exp/realwidth-patch.toml's CI-sized variant: the same job (patch-heads of every
    // query and KV head at the answer position, both directions, suffix chunks of up to
    // 64 rows) on the `realwidth_ci` fixture (V4-Flash's head, indexer and mHC widths at
    // a small hidden size) at ~2K tokens. Its peak is the base run's, at the CSA
    // layer's indexer queries, which the generic widths (a dozen residual vectors per
    // token) missed by 4x.
    if !reset_peak() {
        eprintln!("SKIPPED: /proc/self/clear_refs cannot reset the peak here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exp = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("experiments/realwidth-patch-ci.toml");
    let o = phaselens::runner::RunOptions {
        figures: false,
        ..opts(dir.path())
    };
    let before = status_bytes("VmRSS:");
    reset_peak();
    let s = run_experiment(&exp, &o).unwrap();
    let peak = status_bytes("VmHWM:").saturating_sub(before) as f64;
    let est = s.stats.memory_estimate_bytes;
    eprintln!(
        "realwidth-patch-ci: {} cells, estimate {}, measured peak {} (ratio {:.3})",
        s.stats.cells_computed,
        human(est),
        human(peak),
        est / peak
    );
    assert_eq!(s.stats.cells_computed, 30);
    assert!(
        (0.8..=1.2).contains(&(est / peak)),
        "the estimate {} is not within 20% of the measured peak {}",
        human(est),
        human(peak)
    );
    // `phaselens plan --experiment` sizes the same job from the config alone (its
    // chunks as suffix forwards of the answer positions, the one-row forward that the
    // base run's blocks are): within 20% of the same peak too. Before it counted every
    // chunk row at every position (9.5 GiB, 15x).
    let model = crate::common::v4_fixture("realwidth_ci");
    let out = crate::common::phaselens(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        "2009",
        "--json",
        "--experiment",
        exp.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan = j["devices"][0]["total"].as_f64().unwrap();
    eprintln!(
        "plan --experiment: {} (ratio {:.3})",
        human(plan),
        plan / peak
    );
    assert_eq!(j["request"]["chunk_positions"], 1, "{}", j["request"]);
    assert!(
        (0.8..=1.2).contains(&(plan / peak)),
        "the plan's {} is not within 20% of the measured peak {}",
        human(plan),
        human(peak)
    );
}
