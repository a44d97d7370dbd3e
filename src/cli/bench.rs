//! `phaselens bench`: speed measurements reported as ratios within one run.

use std::time::Instant;

use anyhow::Result;
use burn::tensor::{Int, Tensor, TensorData};
use clap::{Args, Subcommand};

use phaselens::device::DeviceSpec;
use phaselens::hooks::{Action, HookPoint, HookSpec, Scope, Site};
use phaselens::model::kvc::{KvcConfig, KvcModel};
use phaselens::model::weights::{RandomInit, Vb};

/// Benchmarks. Numbers are wall-clock on this machine; compare ratios, not absolutes.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Subcommand, Debug)]
pub enum BenchWhat {
    /// Forward tokens/s of a kvc model: no hooks, captures, one intervention; plus the
    /// cost of an empty HookSpec's dispatch.
    #[command(after_help = "Example:\n  phaselens bench forward --tokens 1024 --reps 5")]
    Forward(ForwardBench),
    /// Cells/s of the runner's batched patching vs one forward per cell.
    Patching(super::run::PatchingBench),
}

#[derive(Args, Debug)]
pub struct ForwardBench {
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 1024)]
    pub tokens: usize,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Timed repetitions per variant (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        BenchWhat::Forward(b) => forward(b),
        BenchWhat::Patching(b) => super::run::bench_patching(b),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    v[v.len() / 2]
}

fn forward(b: ForwardBench) -> Result<()> {
    let device = b.device.device()?;
    let cfg = KvcConfig {
        vocab_size: 256,
        d_model: b.d_model,
        n_layers: b.layers,
        n_heads: b.heads,
        n_kv_heads: b.kv_heads,
        d_head: None,
        d_ff: 4 * b.d_model,
        init_std: 0.02,
        ..KvcConfig::tiny()
    }
    .with_compression(8, 8, 16);
    let model = KvcModel::new(&cfg, &Vb::new(&RandomInit { seed: 0 }, &device))?;
    let ids: Vec<i64> = (0..b.batch * b.tokens)
        .map(|i| (i * 31 % 251) as i64)
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b.batch, b.tokens]), &device);
    let variants: Vec<(&str, HookSpec)> = vec![
        ("no hooks (empty HookSpec)", HookSpec::new()),
        (
            "capture hook_z + hook_pattern, all layers",
            HookSpec::new()
                .capture("blocks.*.attn.hook_z")?
                .capture("blocks.*.attn.hook_pattern")?,
        ),
        (
            "one intervention (zero-ablate head 0, last layer)",
            HookSpec::new().intervene_point(
                HookPoint::block(b.layers - 1, Site::AttnZ),
                Action::Zero,
                Scope::heads([0]),
            ),
        ),
    ];
    println!(
        "kvc forward: {} layers, d_model {}, {} heads / {} KV heads, W=S=8, batch {} x {} tokens, {} reps (median)",
        b.layers, b.d_model, b.heads, b.kv_heads, b.batch, b.tokens, b.reps
    );
    // Warm up, then time the variants round-robin so that load changes on a shared
    // machine hit every variant alike.
    for (_, spec) in &variants {
        let _ = model.forward(tokens.clone(), spec)?.logits.into_data();
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for _ in 0..b.reps {
        for (i, (_, spec)) in variants.iter().enumerate() {
            let t0 = Instant::now();
            let out = model.forward(tokens.clone(), spec)?;
            let _ = out.logits.into_data();
            times[i].push(t0.elapsed().as_secs_f64());
        }
    }
    let medians: Vec<f64> = times.into_iter().map(median).collect();
    let base = medians[0];
    for ((name, _), t) in variants.iter().zip(&medians) {
        println!(
            "  {name:<52} {:>9.0} tokens/s   {:>7.1} ms   x{:.3} vs no hooks",
            (b.batch * b.tokens) as f64 / t,
            t * 1e3,
            t / base
        );
    }
    // The empty spec's per-point dispatch, measured directly: a forward makes about 12
    // hook calls per layer; time a million of them.
    let spec = HookSpec::new();
    let x = Tensor::<3>::zeros([1, 1, 1], &device);
    let calls = 1_000_000;
    let t0 = Instant::now();
    let mut run = spec.run();
    let mut y = x;
    for i in 0..calls {
        y = run.apply(HookPoint::block(i % 4, Site::AttnZ), y)?;
    }
    let per_call = t0.elapsed().as_secs_f64() / calls as f64;
    let per_forward = per_call * (12 * b.layers + 2) as f64;
    println!(
        "  empty HookSpec dispatch: {:.1} ns per hook point, {:.2} us per forward = {:.5}% of a forward",
        per_call * 1e9,
        per_forward * 1e6,
        100.0 * per_forward / base
    );
    Ok(())
}
