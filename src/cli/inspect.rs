//! `phaselens inspect`: load a model directory and report what it is, how long loading
//! took and how much memory it needed; optionally time forward passes.
//!
//! Peak memory is the process's peak resident set (`VmHWM` in /proc/self/status, Linux)
//! during loading, minus the resident set before it; the peak is reset first by writing
//! `5` to /proc/self/clear_refs where the kernel allows it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::hooks::HookSpec;
use phaselens::model::{LanguageModel, LayerKind, ModelInfo, load_model_with};

use super::forward::read_ids;

/// Load a model; report its layers, parameter count, load time and peak memory.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens inspect --model tests/fixtures/deepseek_v4/pro
  phaselens inspect --model DIR --json --time-forward ids.json --reps 10

The memory figure is the peak resident set while loading, above the resident set before
loading, and its ratio to the model's size in the compute dtype (f32).")]
pub struct InspectArgs {
    /// Model directory (config.json + model.safetensors, or shards + index).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Also time the forward pass on these token ids (JSON array of equal-length rows).
    #[arg(long, value_name = "IDS.json")]
    pub time_forward: Option<PathBuf>,
    /// Timed forward repetitions (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// BF16 / FP8 / FP4 checkpoint weights: `stored` (resident as in the checkpoint,
    /// dequantised where used) or `f32` (dequantised on load, 4 bytes per weight).
    #[arg(long, value_name = "stored|f32", default_value = "stored")]
    pub weights: phaselens::model::stored::Residency,
}

/// `(VmRSS, VmHWM)` in bytes, when /proc/self/status has them.
fn rss() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// What `inspect` measured of a model.
struct Measured {
    /// Kind of each layer (`full`, `sliding(W)`, `compressed(wW/sS+T)`).
    kinds: Vec<String>,
    n_params: Option<usize>,
    /// The model's size in f32.
    bytes: Option<u64>,
    /// Its resident weight bytes by storage (`--weights`).
    resident: Option<std::collections::BTreeMap<String, usize>>,
    load_s: f64,
    /// `(VmRSS, VmHWM)` before loading.
    before: Option<(u64, u64)>,
    /// The peak RSS increase while loading, and whether it is exact (not an upper bound).
    peak: Option<(u64, bool)>,
    /// `--time-forward`: the ids' shape, the median time and every run's time.
    forward: Option<([usize; 2], f64, Vec<f64>)>,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let device = args.device.device()?;
    // Reset the peak so that it measures loading only.
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let before = rss();
    let t0 = Instant::now();
    let model = load_model_with(&args.model, &device, args.weights)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let after = rss();
    let info = model.info();
    let n_params = model.n_params();
    let peak = match (before, after) {
        (Some((rss0, hwm0)), Some((_, hwm1))) => {
            // Without a reset the peak may predate loading: then only an upper bound.
            Some((hwm1.saturating_sub(rss0), reset || hwm1 > hwm0))
        }
        _ => None,
    };
    let forward = match &args.time_forward {
        Some(ids_path) => Some(time_forward(
            model.as_ref(),
            ids_path,
            info.vocab_size,
            args.reps,
            &device,
        )?),
        None => None,
    };
    let m = Measured {
        kinds: info.layers.iter().map(|l| layer_kind(&l.kind)).collect(),
        n_params,
        bytes: n_params.map(|n| n as u64 * 4),
        resident: model.resident_bytes(),
        load_s,
        before,
        peak,
        forward,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&args, &info, &m))?
        );
        return Ok(());
    }
    print_text(&args, &info, &m);
    Ok(())
}

/// One warm-up, then `reps` (at least 1) timed forwards on the ids of `ids_path`:
/// their shape, the median time and every time, sorted.
fn time_forward(
    model: &dyn LanguageModel,
    ids_path: &Path,
    vocab_size: usize,
    reps: usize,
    device: &Device,
) -> Result<([usize; 2], f64, Vec<f64>)> {
    let (ids, shape) = read_ids(ids_path, vocab_size)?;
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, shape), device);
    let spec = HookSpec::new();
    let _ = model.forward(tokens.clone(), &spec)?.logits.into_data();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| -> Result<f64> {
            let t = Instant::now();
            let _ = model.forward(tokens.clone(), &spec)?.logits.into_data();
            Ok(t.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    times.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    Ok((shape, times[times.len() / 2], times))
}

/// A layer's kind as `inspect` prints it.
fn layer_kind(kind: &LayerKind) -> String {
    match kind {
        LayerKind::Full => "full".to_string(),
        LayerKind::Sliding { window } => format!("sliding({window})"),
        LayerKind::Compressed {
            window,
            stride,
            local_tail,
        } => format!("compressed(w{window}/s{stride}+{local_tail})"),
        LayerKind::Selected {
            block,
            top_k,
            window,
        } => format!("selected(b{block}/top{top_k}+{window})"),
    }
}

/// The `--json` report.
fn to_json(args: &InspectArgs, info: &ModelInfo, m: &Measured) -> serde_json::Value {
    let (peak, bytes) = (m.peak, m.bytes);
    let mut j = serde_json::json!({
        "model": args.model.display().to_string(),
        "arch": info.arch,
        "layers": m.kinds,
        "n_params": m.n_params,
        "model_f32_bytes": bytes,
        "weights": args.weights.to_string(),
        "resident_bytes": m.resident,
        "load_s": m.load_s,
        "rss_before_bytes": m.before.map(|b| b.0),
        "load_peak_rss_increase_bytes": peak.map(|p| p.0),
        "peak_is_exact": peak.map(|p| p.1),
        "peak_over_model_f32": match (peak, bytes) {
            (Some(p), Some(b)) if b > 0 => Some(p.0 as f64 / b as f64),
            _ => None,
        },
    });
    if let Some((shape, med, times)) = &m.forward {
        j["forward"] = serde_json::json!({
            "batch": shape[0], "seq_len": shape[1], "median_s": med, "runs_s": times,
        });
    }
    j
}

/// The text report.
fn print_text(args: &InspectArgs, info: &ModelInfo, m: &Measured) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "{} ({}), {} layers: {}",
        args.model.display(),
        info.arch,
        info.layers.len(),
        m.kinds.join(", ")
    );
    match (m.n_params, m.bytes) {
        (Some(n), Some(b)) => println!("parameters: {n} ({:.1} MiB in f32)", mib(b)),
        _ => println!("parameters: unknown"),
    }
    if let Some(r) = &m.resident {
        let parts: Vec<String> = r
            .iter()
            .map(|(k, b)| format!("{k} {:.1} MiB", mib(*b as u64)))
            .collect();
        println!(
            "resident weights ({}): {:.1} MiB ({})",
            args.weights,
            mib(r.values().sum::<usize>() as u64),
            parts.join(", ")
        );
    }
    print!("load: {:.3} s", m.load_s);
    match (m.peak, m.bytes, m.before) {
        (Some((p, exact)), Some(b), Some((rss0, _))) => println!(
            "; peak RSS while loading: +{:.1} MiB over {:.1} MiB before = {:.2}x the f32 model{}",
            mib(p),
            mib(rss0),
            p as f64 / b as f64,
            if exact { "" } else { " (upper bound)" }
        ),
        _ => println!("; peak RSS: not available on this system"),
    }
    if let Some((shape, med, _)) = &m.forward {
        println!(
            "forward: batch {} x {} tokens, median {:.3} ms over {} runs",
            shape[0],
            shape[1],
            med * 1e3,
            args.reps.max(1)
        );
    }
}
