//! `phaselens bench`: speed measurements reported as ratios within one run.

use std::time::Instant;

use anyhow::Result;
use burn::tensor::{Device, Int, Tensor, TensorData};
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
    /// cost of an empty HookSpec's dispatch. With `--model DIR` (any checkpoint) or
    /// several `--tokens`: tokens/s and peak RSS per sequence length.
    #[command(
        after_help = "Examples:\n  phaselens bench forward --tokens 1024 --reps 5\n  \
        phaselens bench forward --model experiments/organisms/kvc-w8s8 --tokens 1024,4096,16384,65536 --reps 1\n  \
        phaselens bench forward --model DIR --tokens 4096 --reps 1 --weights f32\n  \
        phaselens bench forward --model models:gemma3-270m/gemma-3-270m-q4_k_m.gguf --tokens 512,2048 \
        --last-logits --compression kind=select,block=8,top_k=4,window=32\n\n\
        The length sweep prints seconds per forward, tokens/s, the process's peak resident set\n\
        (reset before each length) and, for scale, the f32 weights and one layer's K/V state at\n\
        that length; --json writes the same numbers."
    )]
    Forward(ForwardBench),
    /// Cells/s of the runner's batched patching vs one forward per cell.
    Patching(super::run::PatchingBench),
    /// Cells/s of attribution patching (AtP: one forward + one backward for every head x
    /// position) vs the runner's exact patching of every head x position cell.
    Atp(AtpBench),
    /// Edges/s of edge attribution (EAP, EAP-IG: every edge at once) vs exact path
    /// patching (one cell per edge) on one phase group.
    Edges(EdgesBench),
    /// Steps/s, tokens/s and peak RSS of the optimiser steps `phaselens train` runs on a
    /// recipe (same model, sampler and optimiser; no checkpoints), split by phase.
    Train(TrainBenchArgs),
}

/// `phaselens bench train`.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens bench train experiments/organisms/kvc-w8s8.toml --steps 10
  phaselens bench train experiments/organisms/kvc-w8s8.toml --device tch-cpu --json out.json
  phaselens bench train experiments/organisms/full-attn.toml --export runs/bench-train/full-attn

Runs --warmup untimed steps, then --steps timed ones (steps 0, 1, ... of the recipe, from
its random init, exactly as `phaselens train --fresh` would, without checkpoint writes), and
prints steps/s, tokens/s, the peak resident set over the timed steps and the mean time per
step of each phase (batch sampling, forward + loss, backward, clipping + AdamW).
--export DIR writes what scripts/bench/train_ref.py (the PyTorch eager reference) replays:
DIR/model/ (the initial weights and config.json), DIR/batches.safetensors, DIR/logits0.safetensors
(the initial model's logits on the first batch) and DIR/train.json (optimiser, learning
rates, the measured losses). See docs/performance.md.")]
pub struct TrainBenchArgs {
    /// Organism recipe (TOML).
    pub recipe: std::path::PathBuf,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Timed optimiser steps.
    #[arg(long, default_value_t = 10, value_parser = super::run::at_least_one)]
    pub steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Write the measurement as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Write the initial weights, batches and optimiser settings for the reference.
    #[arg(long)]
    pub export: Option<std::path::PathBuf>,
}

/// `phaselens bench atp`.
#[derive(Args, Debug)]
#[command(after_help = "\
Example:
  phaselens bench atp experiments/w8s8-atp.toml --phase 2 --n-logical 16 --band 8

On one phase group of the experiment's model and prompts: one AtP forward + backward gives
the estimate for every query and KV head x every position x both directions; the runner's
exact batched patching then patches every head at each of the last --band positions (one
position per cell, both directions). Prints both cells/s, their ratio and the Spearman
correlation of the two over the head x position cells, and the cells/s of AtP* of the
query and key nodes (query head x position and KV head cells, both directions).")]
pub struct AtpBench {
    /// Experiment TOML whose model and prompts to use.
    #[arg(default_value = "experiments/w8s8-atp.toml")]
    pub experiment: std::path::PathBuf,
    /// Phase group.
    #[arg(long, default_value_t = 0)]
    pub phase: u32,
    /// Logical examples (prompts per cell); default: the experiment's.
    #[arg(long)]
    pub n_logical: Option<usize>,
    /// Exact cells patch each of the last `band` positions (offset 0 = the read position).
    #[arg(long, default_value_t = 8)]
    pub band: usize,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

/// `phaselens bench edges`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("random").args(["layers", "heads"]).multiple(true)))]
#[command(after_help = "\
Examples:
  phaselens bench edges exp/w8s8-edges.toml --phase 0 --n-logical 8
  phaselens bench edges exp/w8s8-edges.toml --layers 16 --heads 16 --exact-senders 8 --no-replicas

On one phase group of the experiment's model and prompts (denoising): EAP and EAP-IG score
every edge of the graph (docs/experiments.md, edge-attribution); exact path patching then
patches every query head -> later q / k / v edge. Prints edges/s of each, the speed-ups and
the Spearman correlation of the estimates with the exact effects over the path-patched edges.
--layers / --heads replace the trained model by a randomly initialised one of the same
config with that many layers (per-layer type lists cycled) / query heads per layer (each of
the config's head size), seeded by --seed: the speed of a larger graph on the same prompts
(the agreement of random weights means little). --exact-senders K path-patches only the edges
of K seeded-random head senders, whose edges/s estimates that of all edges (each sender's
patched run serves all its edges either way; docs/experiments.md gives the measured bias);
--no-replicas skips the replica reference of EAP;
--ig-hold-selection adds EAP-IG with the indexer's top-k choice held at the clean run's
(does the interpolation's crossing of the discrete selection hurt EAP-IG?).")]
pub struct EdgesBench {
    /// Experiment TOML whose model and prompts to use.
    #[arg(default_value = "exp/w8s8-edges.toml")]
    pub experiment: std::path::PathBuf,
    /// Phase group.
    #[arg(long, default_value_t = 0)]
    pub phase: u32,
    /// Logical examples (prompt pairs); default: the experiment's.
    #[arg(long)]
    pub n_logical: Option<usize>,
    /// EAP-IG interpolation steps.
    #[arg(long, default_value_t = 5, value_parser = super::run::at_least_one)]
    pub ig_steps: usize,
    /// Random weights, this many layers (the experiment's config otherwise).
    #[arg(long, value_parser = super::run::at_least_one)]
    pub layers: Option<usize>,
    /// Random weights, this many query heads per layer.
    #[arg(long, value_parser = super::run::at_least_one)]
    pub heads: Option<usize>,
    /// Seed of the random weights of --layers / --heads.
    #[arg(long, requires = "random")]
    pub seed: Option<u64>,
    /// Exact path patching of every edge from at most K head senders (seeded sample),
    /// for graphs where patching every edge takes too long.
    #[arg(long, value_name = "K", value_parser = super::run::at_least_one)]
    pub exact_senders: Option<usize>,
    /// Skip EAP with replicas (the reference pass 2: a forward + backward per receiver).
    #[arg(long)]
    pub no_replicas: bool,
    /// Also EAP-IG with every indexer's selection (hook_selected) held at the clean
    /// run's in the interpolated states (DeepSeek-V4 CSA).
    #[arg(long)]
    pub ig_hold_selection: bool,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

#[derive(Args, Debug)]
pub struct ForwardBench {
    #[arg(long, default_value_t = 4, value_parser = super::run::at_least_one)]
    pub layers: usize,
    #[arg(long, default_value_t = 256, value_parser = super::run::at_least_one)]
    pub d_model: usize,
    #[arg(long, default_value_t = 8, value_parser = super::run::at_least_one)]
    pub heads: usize,
    #[arg(long, default_value_t = 2, value_parser = super::run::at_least_one)]
    pub kv_heads: usize,
    /// Sequence length(s); several (comma-separated) sweep them.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1024], value_parser = super::run::at_least_one)]
    pub tokens: Vec<usize>,
    /// Any model directory (kvc or DeepSeek-V4) instead of the synthetic kvc model;
    /// measures the length sweep.
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// With --model: BF16 / FP8 / FP4 checkpoint weights `stored` (resident as in the
    /// checkpoint, dequantised where used) or `f32` (dequantised on load).
    #[arg(
        long,
        value_name = "stored|f32",
        default_value = "stored",
        requires = "model"
    )]
    pub weights: phaselens::model::stored::Residency,
    /// With --model: a training-free compression overlay in every layer's attention,
    /// the keys of an experiment's `[model.compression]` (e.g.
    /// kind=select,block=8,top_k=4,window=32; docs/models.md, "Compression overlays").
    #[arg(long, value_name = "kind=...,KEY=VALUE", requires = "model")]
    pub compression: Option<phaselens::model::compression::Overlay>,
    /// Compute dtype of the matrix products: `f32`, or `bf16` (bf16 operands, f32 sums,
    /// bf16 result; the rest f32). The GEMM-rate reference is measured in it too.
    #[arg(long, value_name = "f32|bf16", default_value = "f32")]
    pub dtype: phaselens::model::ComputeDtype,
    /// Write the length sweep as JSON.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// With --model: compute only each row's last-position logits (a prefill), not the
    /// `tokens x vocab` logits of every position (8.5 GB at 16K tokens and 129,280 words).
    /// A DeepSeek-V4 prefill of a long prompt then runs span by span and holds one span's
    /// activations (docs/performance.md, "Spans"); the memory check counts so.
    #[arg(long, requires = "model")]
    pub last_logits: bool,
    /// Also time each stage of the timed forwards: matrix products, dequantisation of
    /// stored weights, the attention core, the LM head, DeepSeek-V4's experts and mHC,
    /// and the rest (embedding, norms, RoPE, elementwise ops); a second table, and
    /// `stages` in --json (the length sweep; docs/performance.md).
    #[arg(long)]
    pub stages: bool,
    #[arg(long, default_value_t = 1, value_parser = super::run::at_least_one)]
    pub batch: usize,
    /// Timed repetitions per variant (after one warm-up).
    #[arg(long, default_value_t = 5, value_parser = super::run::at_least_one)]
    pub reps: usize,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        BenchWhat::Forward(b) => forward(b),
        BenchWhat::Patching(b) => super::run::bench_patching(b),
        BenchWhat::Atp(b) => {
            let r = phaselens::runner::bench::bench_atp(
                &b.experiment,
                b.phase,
                b.n_logical,
                b.band,
                &b.device,
            )
            .map_err(|e| anyhow::anyhow!("benchmarking {}: {e}", b.experiment.display()))?;
            println!("{r}");
            Ok(())
        }
        BenchWhat::Edges(b) => {
            use phaselens::runner::bench::RandomModel;
            use phaselens::runner::kinds::edge_attribution::bench::{EdgeBench, bench_edges};
            let random = (b.layers.is_some() || b.heads.is_some()).then_some(RandomModel {
                layers: b.layers,
                heads: b.heads,
                seed: b.seed.unwrap_or(0),
            });
            let what = EdgeBench {
                phase: b.phase,
                n_logical: b.n_logical,
                ig_steps: b.ig_steps,
                random,
                exact_senders: b.exact_senders,
                replicas: !b.no_replicas,
                ig_held: b.ig_hold_selection,
            };
            let r = bench_edges(&b.experiment, &what, &b.device)
                .map_err(|e| anyhow::anyhow!("benchmarking {}: {e}", b.experiment.display()))?;
            println!("{r}");
            Ok(())
        }
        BenchWhat::Train(b) => train(b),
    }
}

fn train(b: TrainBenchArgs) -> Result<()> {
    use anyhow::Context;
    use phaselens::train::bench::{BenchOptions, bench_train};
    let file = phaselens::train::OrganismFile::load(&b.recipe)?;
    let device = b.device.device()?;
    let opts = BenchOptions {
        steps: b.steps as u64,
        warmup: b.warmup as u64,
        export: b.export.clone(),
    };
    let r = bench_train(&b.recipe, &file, &device, &opts)
        .with_context(|| format!("benchmarking training of {}", b.recipe.display()))?;
    let mib = |x: Option<u64>| {
        x.map_or("n/a".into(), |x| {
            format!("{:.0}", x as f64 / (1 << 20) as f64)
        })
    };
    let ms = |s: f64| s * 1e3;
    println!(
        "{}: batch {} x {} tokens, {} steps after {} warm-up, device {}, {} CPUs",
        r.organism, r.batch_size, r.seq_len, r.steps, r.warmup, b.device, r.cpus
    );
    println!(
        "  {:.3} steps/s  {:.0} tokens/s  {:.1} ms/step  peak RSS {} MiB (before: {} MiB)",
        r.steps_per_second,
        r.tokens_per_second,
        ms(r.seconds / r.steps as f64),
        mib(r.peak_rss_bytes),
        mib(r.base_rss_bytes)
    );
    let p = &r.phases;
    println!(
        "  per step: sample {:.1} ms, forward + loss {:.1} ms, backward {:.1} ms, optimiser {:.1} ms",
        ms(p.sample),
        ms(p.forward),
        ms(p.backward),
        ms(p.optimizer)
    );
    let shown: Vec<String> = r.losses.iter().take(5).map(|l| format!("{l:.6}")).collect();
    println!("  losses of steps 0..: {}", shown.join(" "));
    if let Some(path) = &b.json {
        let text = serde_json::to_string_pretty(&r)?;
        phaselens::output::write_bytes_atomic(path, format!("{text}\n").as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    v[v.len() / 2]
}

fn forward(b: ForwardBench) -> Result<()> {
    b.dtype
        .check_device(&b.device.device()?, &b.device.to_string())
        .map_err(anyhow::Error::msg)?;
    let _compute = phaselens::model::precision::scoped(b.dtype);
    if b.model.is_some() || b.tokens.len() > 1 || b.stages {
        return length_sweep(b);
    }
    if b.reps == 0 {
        anyhow::bail!("--reps must be at least 1");
    }
    let device = b.device.device()?;
    let tokens_len = b.tokens[0];
    let model = synthetic_kvc(&b, &device)?;
    phaselens::model::memory::check_forward(
        &model.info(),
        b.batch,
        tokens_len,
        "--tokens / --batch",
    )?;
    let ids: Vec<i64> = (0..b.batch * tokens_len)
        .map(|i| (i * 31 % 251) as i64)
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b.batch, tokens_len]), &device);
    let variants = hook_variants(b.layers)?;
    println!(
        "kvc forward: {} layers, d_model {}, {} heads / {} KV heads, W=S=8, batch {} x {} tokens, {} reps (median)",
        b.layers, b.d_model, b.heads, b.kv_heads, b.batch, tokens_len, b.reps
    );
    let medians = time_variants(&model, &tokens, &variants, b.reps)?;
    let base = medians[0];
    for ((name, _), t) in variants.iter().zip(&medians) {
        println!(
            "  {name:<52} {:>9.0} tokens/s   {:>7.1} ms   x{:.3} vs no hooks",
            (b.batch * tokens_len) as f64 / t,
            t * 1e3,
            t / base
        );
    }
    empty_dispatch(&device, b.layers, base)
}

/// The hook specs `bench forward` compares, with their names: none, two captures on
/// every layer, one intervention on the last of `layers`.
fn hook_variants(layers: usize) -> Result<Vec<(&'static str, HookSpec)>> {
    Ok(vec![
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
                HookPoint::block(layers - 1, Site::AttnZ),
                Action::Zero,
                Scope::heads([0]),
            ),
        ),
    ])
}

/// The median forward time of each variant over `reps` runs, after one warm-up each.
fn time_variants(
    model: &KvcModel,
    tokens: &Tensor<2, Int>,
    variants: &[(&str, HookSpec)],
    reps: usize,
) -> Result<Vec<f64>> {
    // Warm up, then time the variants round-robin so that load changes on a shared
    // machine hit every variant alike.
    for (_, spec) in variants {
        let _ = model.forward(tokens.clone(), spec)?.logits.into_data();
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for _ in 0..reps {
        for (i, (_, spec)) in variants.iter().enumerate() {
            let t0 = Instant::now();
            let out = model.forward(tokens.clone(), spec)?;
            let _ = out.logits.into_data();
            times[i].push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(times.into_iter().map(median).collect())
}

/// Print the empty spec's per-point dispatch cost, measured directly, against a
/// forward of `layers` layers taking `base` seconds.
fn empty_dispatch(device: &Device, layers: usize, base: f64) -> Result<()> {
    // A forward makes about 12 hook calls per layer; time a million of them.
    let spec = HookSpec::new();
    let x = Tensor::<3>::zeros([1, 1, 1], device);
    let calls = 1_000_000;
    let t0 = Instant::now();
    let mut run = spec.run();
    let mut y = x;
    for i in 0..calls {
        y = run.apply(HookPoint::block(i % 4, Site::AttnZ), y)?;
    }
    let per_call = t0.elapsed().as_secs_f64() / calls as f64;
    let per_forward = per_call * (12 * layers + 2) as f64;
    println!(
        "  empty HookSpec dispatch: {:.1} ns per hook point, {:.2} us per forward = {:.5}% of a forward",
        per_call * 1e9,
        per_forward * 1e6,
        100.0 * per_forward / base
    );
    Ok(())
}

/// The size of the dense product whose rate `bench forward` reports a forward against.
const GEMM_N: usize = 1024;

/// The model of `bench forward`: `--model DIR`, or the synthetic kvc model.
fn sweep_model(
    b: &ForwardBench,
    device: &Device,
) -> Result<Box<dyn phaselens::model::LanguageModel>> {
    use anyhow::Context;
    Ok(match &b.model {
        Some(dir) => {
            let overlay = b.compression.as_ref();
            let m = phaselens::model::load_model_as(dir, device, b.weights, overlay)
                .with_context(|| format!("loading {}", dir.display()))?;
            eprintln!(
                "{}: {}",
                dir.display(),
                phaselens::model::residency_summary(m.as_ref(), b.weights)
            );
            if let Some(o) = overlay {
                eprintln!("compression overlay: {o}");
            }
            m
        }
        None => Box::new(synthetic_kvc(b, device)?),
    })
}

/// Refuse a sweep length whose forward cannot fit this machine's memory.
fn check_sweep_memory(
    b: &ForwardBench,
    model: &dyn phaselens::model::LanguageModel,
    t: usize,
) -> Result<()> {
    use phaselens::model::memory::{check, forward_bytes_with};
    let (info, widths) = (model.info(), model.memory_widths());
    // With --last-logits only each row's last position goes through the LM head, and a
    // prefill run span by span holds one span's activations and the cache of the
    // positions before it.
    let bytes = match (b.last_logits, model.prefill_span()) {
        (true, Some((span, cached))) if t > span => {
            forward_bytes_with(&info, &widths, b.batch, span, 1)
                + 4.0 * (b.batch * t) as f64 * cached
        }
        (last, _) => forward_bytes_with(&info, &widths, b.batch, t, if last { 1 } else { t }),
    };
    check(
        &format!("a forward over {} x {t} tokens", b.batch),
        "--tokens / --batch",
        bytes,
    )?;
    Ok(())
}

/// `bench forward --model DIR --tokens ...`: tokens/s and peak RSS per length.
fn length_sweep(b: ForwardBench) -> Result<()> {
    use anyhow::Context;
    use phaselens::model::bench::forward_sweep;
    let device = b.device.device()?;
    let model = sweep_model(&b, &device)?;
    let name = b
        .model
        .as_ref()
        .map_or("synthetic kvc".to_string(), |d| d.display().to_string());
    let mib = |x: u64| x as f64 / (1 << 20) as f64;
    let info = model.info();
    for &t in &b.tokens {
        check_sweep_memory(&b, model.as_ref(), t)?;
    }
    println!(
        "{name}: {} ({} layers, d_model {}), batch {}, {} rep(s) per length (median), device {}, compute dtype {}",
        info.arch,
        info.layers.len(),
        info.d_model,
        b.batch,
        b.reps,
        b.device,
        b.dtype
    );
    let gemm = phaselens::model::bench::gemm_gflops(&device, GEMM_N, 5);
    println!(
        "dense {} GEMM on this device: {gemm:.1} GFLOP/s (1024 x 1024 x 1024, median of 5): the reference of the last column",
        b.dtype
    );
    println!(
        "| tokens | s / forward | tokens/s | peak RSS MiB | RSS before MiB | weights MiB | one layer K/V MiB | logits MiB | matmul GFLOP / forward | GFLOP/s | of GEMM rate |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let points = forward_sweep(
        model.as_ref(),
        &b.tokens,
        (b.batch, b.reps),
        b.last_logits,
        b.stages,
        |p| {
            println!(
                "| {} | {:.3} | {:.0} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0}% |",
                p.tokens,
                p.seconds,
                p.tokens_per_second,
                p.peak_rss_bytes
                    .map_or("n/a".into(), |x| format!("{:.0}", mib(x))),
                p.base_rss_bytes
                    .map_or("n/a".into(), |x| format!("{:.0}", mib(x))),
                mib(p.weights_bytes),
                mib(p.kv_layer_bytes),
                mib(p.logits_bytes),
                p.matmul_flops as f64 / 1e9,
                p.matmul_gflops,
                100.0 * p.matmul_gflops / gemm,
            );
            p.gemm_gflops = Some(gemm);
        },
    )?;
    if b.stages {
        print_stages(&points);
    }
    if let Some(path) = &b.json {
        let text = serde_json::to_string_pretty(&points)?;
        phaselens::output::write_bytes_atomic(path, format!("{text}\n").as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The stage table of `bench forward --stages`: seconds per forward and share of the
/// forward's time, per category.
fn print_stages(points: &[phaselens::model::bench::LengthPoint]) {
    println!(
        "\nstages (mean seconds per timed forward, share of the forward; products and dequantisation inside the LM head count as the LM head's):"
    );
    println!(
        "| tokens | s / forward | GEMM (products) | dequantisation | attention core (non-GEMM) | LM head (all) | experts + mHC (non-GEMM) | embedding, norms, RoPE, elementwise |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in points {
        let Some(st) = &p.stages else { continue };
        let c = phaselens::model::bench::stage_categories(st);
        let cells: Vec<String> = c
            .iter()
            .map(|x| format!("{x:.3} ({:.0}%)", 100.0 * x / p.seconds))
            .collect();
        println!(
            "| {} | {:.3} | {} |",
            p.tokens,
            p.seconds,
            cells.join(" | ")
        );
    }
}

/// The synthetic kvc model of `bench forward` (W = S = 8, a 16-token tail, random init).
fn synthetic_kvc(b: &ForwardBench, device: &burn::tensor::Device) -> Result<KvcModel> {
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
    Ok(KvcModel::new(
        &cfg,
        &Vb::new(&RandomInit { seed: 0 }, device),
    )?)
}
