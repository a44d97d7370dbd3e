//! `phaselens plan`: the memory a DeepSeek-V4 model needs per device at a sequence
//! length, and the layer / expert placement it would use (src/model/plan.rs).
//! `--measure` loads the model here and runs one forward (after a short warm-up forward)
//! to compare the estimate with the process's peak resident set.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::hooks::HookSpec;
use phaselens::model::deepseek_v4::token_blocks::{BlockSizes, with_token_blocks};
use phaselens::model::load_model_with;
use phaselens::model::memory::human;
use phaselens::model::plan::{
    self, DevicePlan, ModelWeights, PUBLISHED, Plan, PlanRequest, config_for_plan,
};
use phaselens::model::stored::Residency;

/// Plan a DeepSeek-V4 model's memory over devices: weights, KV, working sets, placement.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens plan --config v4-flash --devices 8 --device-memory 141GiB --tokens 131072
  phaselens plan --config v4-pro --devices 8 --device-memory 141GiB --host-memory 2TiB --tokens 65536
  phaselens plan --model DIR --devices 2 --device-memory 80GB --tokens 8192 --experiment exp/v4pro.toml
  phaselens plan --model tests/fixtures/deepseek_v4/fp4_experts --tokens 48 --measure --json

Weights are counted as stored (FP4 experts half a byte per value, FP8 one byte + block
scales, BF16 two) and as resident once loaded: with --weights stored (the default) FP4 /
FP8 / BF16 matrices stay as stored and are dequantised where used (the largest such
matrix counts in the working set), with --weights f32 every float is dequantised on load;
the placement uses the resident bytes. Routed experts that do not fit on the devices go to
host memory (checked against --host-memory when given). Published configs: v4-flash,
v4-pro (release-style config.json values, shipped with phaselens). See docs/models.md.")]
pub struct PlanArgs {
    /// Model directory (config.json + safetensors: stored dtypes from the headers).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "config",
        required_unless_present = "config"
    )]
    pub model: Option<PathBuf>,
    /// A published config (v4-flash, v4-pro) or a config.json file.
    #[arg(long, value_name = "NAME|FILE")]
    pub config: Option<String>,
    /// Number of devices.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Memory per device (141GiB, 80GB, ...).
    #[arg(long, default_value = "141GiB", value_parser = plan::parse_bytes)]
    pub device_memory: f64,
    /// Host memory for routed experts that do not fit on the devices.
    #[arg(long, value_parser = plan::parse_bytes)]
    pub host_memory: Option<f64>,
    /// Tokens per row (sequence length).
    #[arg(long, default_value_t = 131072)]
    pub tokens: usize,
    /// Size the patching chunk by this experiment's `max_rows` (on a GPU-class device).
    #[arg(long, value_name = "EXP.toml")]
    pub experiment: Option<PathBuf>,
    /// Load --model here, run one forward of --tokens tokens and compare the one-device
    /// estimate with the peak resident set (Linux).
    #[arg(long, requires = "model")]
    pub measure: bool,
    /// Device for --measure.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// How the weights are held: `stored` (BF16 / FP8 / FP4 resident as in the
    /// checkpoint) or `f32` (dequantised on load); sizes the plan and --measure's load.
    #[arg(long, value_name = "stored|f32", default_value = "stored")]
    pub weights: Residency,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The config, its expert storage and the weights to plan with.
fn weights(
    args: &PlanArgs,
) -> Result<(
    phaselens::model::deepseek_v4::DeepseekV4Config,
    ModelWeights,
)> {
    if let Some(dir) = &args.model {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let (c, _) = config_for_plan(&path.display().to_string(), &text)?;
        let w = plan::weights_from_checkpoint(dir, &c, args.weights)?;
        return Ok((c, w));
    }
    let name = args.config.as_deref().expect("clap: --model or --config");
    let (origin, text) = match PUBLISHED.iter().find(|(n, _)| *n == name) {
        Some((n, t)) => (format!("published config {n}"), t.to_string()),
        None => {
            let p = PathBuf::from(name);
            if !p.exists() {
                let known: Vec<&str> = PUBLISHED.iter().map(|(n, _)| *n).collect();
                bail!(
                    "--config {name}: neither a published config ({}) nor a file",
                    known.join(", ")
                );
            }
            let t = std::fs::read_to_string(&p).with_context(|| format!("reading {name}"))?;
            (name.to_string(), t)
        }
    };
    let (c, experts) = config_for_plan(&origin, &text)?;
    Ok((
        c.clone(),
        plan::weights_from_config(&c, experts, args.weights),
    ))
}

pub fn run(args: PlanArgs) -> Result<()> {
    let (c, w) = weights(&args)?;
    let (chunk_rows, chunk_positions) = match &args.experiment {
        Some(p) => {
            let exp = phaselens::runner::experiment::Experiment::load(p)?;
            (
                exp.max_rows(&DeviceSpec::TchCuda(0)),
                exp.suffix_positions(),
            )
        }
        None => (1, None),
    };
    let req = PlanRequest {
        devices: args.devices,
        device_memory: args.device_memory,
        host_memory: args.host_memory,
        tokens: args.tokens,
        chunk_rows,
        chunk_positions,
        residency: args.weights,
    };
    let p = plan::plan(&c, &w, &req)?;
    let measured = if args.measure {
        Some(measure(&args, &c, &w)?)
    } else {
        None
    };
    if args.json {
        let mut j = serde_json::to_value(&p)?;
        if let Some(m) = &measured {
            j["measured"] = serde_json::to_value(m)?;
        }
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        print_plan(&p);
        if let Some(m) = &measured {
            println!(
                "measured here ({}): one device, load + one forward of 1 x {} tokens: peak RSS increase {} vs estimate {} (ratio {:.3}; not counted: {} left by a {WARM_UP_TOKENS}-token warm-up forward, the code and worker threads)",
                args.device,
                args.tokens,
                human(m.peak_rss_increase),
                human(m.estimate),
                m.peak_rss_increase / m.estimate,
                human(m.warm_up_rss_increase)
            );
        }
    }
    Ok(())
}

/// Estimate vs measurement on one device.
#[derive(serde::Serialize)]
struct Measured {
    estimate: f64,
    /// The larger of loading's peak and (resident after loading + the measured
    /// forward's peak over the resident set before it), over the resident set before
    /// loading.
    peak_rss_increase: f64,
    /// What the warm-up forward left resident (code, worker threads): not counted.
    warm_up_rss_increase: f64,
    load_s: f64,
    forward_s: f64,
}

fn rss() -> Option<(f64, f64)> {
    let (a, b) = phaselens::model::bench::rss()?;
    Some((a as f64, b as f64))
}

fn measure(
    args: &PlanArgs,
    c: &phaselens::model::deepseek_v4::DeepseekV4Config,
    w: &ModelWeights,
) -> Result<Measured> {
    let one = PlanRequest {
        devices: 1,
        device_memory: f64::INFINITY,
        host_memory: None,
        tokens: args.tokens,
        chunk_rows: 1,
        chunk_positions: None,
        residency: args.weights,
    };
    let estimate = plan::plan(c, w, &one)?.devices[0].total;
    let dir = args
        .model
        .as_ref()
        .expect("clap: --measure requires --model");
    let device = args.device.device()?;
    let reset = phaselens::model::bench::reset_peak_rss();
    let Some((rss0, _)) = rss() else {
        bail!("--measure: no /proc/self/status on this system (Linux only)");
    };
    if !reset {
        eprintln!(
            "note: cannot reset the peak RSS (/proc/self/clear_refs): the peak may predate loading"
        );
    }
    let t0 = std::time::Instant::now();
    let model = load_model_with(dir, &device, args.weights)
        .with_context(|| format!("loading {}", dir.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let (rss_loaded, load_hwm) = rss().context("reading the resident set after loading")?;
    let forward = |t: usize| -> Result<f64> {
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(lcg_ids(t, c.vocab_size), [1, t]), &device);
        let t1 = std::time::Instant::now();
        // The plan sizes forwards with hooks (the runner's base runs), which run whole:
        // so does the measured one, however long (a hook-free forward of a long prompt
        // would otherwise run in blocks of positions and hold less).
        let whole = || model.forward(tokens, &HookSpec::new());
        let all = BlockSizes {
            stream: usize::MAX,
            query: usize::MAX,
            experts: usize::MAX,
        };
        let _ = with_token_blocks(all, whole)?.logits.into_data();
        Ok(t1.elapsed().as_secs_f64())
    };
    // A short forward first: the code a forward runs and the worker threads (stacks,
    // GEMM packing slabs) are touched once per process, not per token; they are not the
    // model's memory, and on a small model they would be a large part of its peak.
    let warm = reset && args.tokens > WARM_UP_TOKENS;
    let (rss_warm, process) = if warm {
        forward(WARM_UP_TOKENS)?;
        phaselens::model::bench::reset_peak_rss();
        let (r, _) = rss().context("reading the resident set after the warm-up")?;
        (r, r - rss_loaded)
    } else {
        (rss_loaded, 0.0)
    };
    let forward_s = forward(args.tokens)?;
    let (_, hwm) = rss().context("reading the peak RSS")?;
    Ok(Measured {
        estimate,
        peak_rss_increase: (load_hwm - rss0).max(rss_loaded - rss0 + hwm - rss_warm),
        warm_up_rss_increase: process,
        load_s,
        forward_s,
    })
}

/// Tokens of the warm-up forward before the measured one (when it is longer).
const WARM_UP_TOKENS: usize = 16;

/// `t` deterministic token ids below `vocab` (a fixed LCG).
fn lcg_ids(t: usize, vocab: usize) -> Vec<i64> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..t)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as i64
        })
        .collect()
}

fn print_plan(p: &Plan) {
    let r = &p.request;
    println!(
        "weights: {:.3} B values, {} stored, {} resident ({} weights); {} tokens per row, patching chunk {} row(s)",
        p.weights.values / 1e9,
        human(p.weights.stored),
        human(p.weights.resident),
        r.residency,
        r.tokens,
        r.chunk_rows
    );
    println!(
        "{:>6} {:>9} {:>11} {:>11} {:>11} {:>10} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "device",
        "layers",
        "experts",
        "w stored",
        "w resident",
        "KV raw",
        "KV compr",
        "forward ws",
        "chunk ws",
        "load trans",
        "total",
        "free"
    );
    for d in &p.devices {
        print_device(d);
    }
    let host = if p.host_experts == 0 {
        "none".to_string()
    } else {
        format!(
            "{} routed experts, {} resident ({} stored){}",
            p.host_experts,
            human(p.host_bytes_resident),
            human(p.host_bytes_stored),
            match r.host_memory {
                Some(m) => format!(" of {} host memory", human(m)),
                None => " (host memory not given: not checked)".into(),
            }
        )
    };
    println!("host: {host}");
    println!(
        "fits: yes; one more row of a patching chunk at {} tokens costs {}",
        r.tokens,
        human(p.chunk_bytes_per_row)
    );
}

fn print_device(d: &DevicePlan) {
    let mut layers = format!("{}..{}", d.first_layer, d.end_layer);
    if d.holds_embedding {
        layers.insert(0, 'E');
    }
    if d.holds_head {
        layers.push('H');
    }
    println!(
        "{:>6} {:>9} {:>11} {:>11} {:>11} {:>10} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11}",
        d.device,
        layers,
        format!("{}/{}", d.experts_here, d.experts_of_layers),
        human(d.weights_stored),
        human(d.weights_resident),
        human(d.kv_raw),
        human(d.kv_compressed),
        human(d.forward_working_set),
        human(d.chunk_working_set),
        human(d.load_transient),
        human(d.total),
        human(d.capacity - d.total)
    );
}
