//! Forward cost against sequence length for any model: tokens/s and the process's peak
//! resident memory, next to what the model needs at least (its weights and one layer's
//! per-token K/V state). `phaselens bench forward --model DIR --tokens 1024,4096,...`.

use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData};
use serde::Serialize;

use super::{LanguageModel, LayerKind};
use crate::error::{Error, Result};
use crate::hooks::HookSpec;

/// One measured length.
#[derive(Debug, Clone, Serialize)]
pub struct LengthPoint {
    pub tokens: usize,
    pub batch: usize,
    /// Median wall time of one forward (logits read back to the host).
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Peak resident set during the timed forwards (bytes), when the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    /// Resident set before the forwards (weights, code, allocator pools).
    pub base_rss_bytes: Option<u64>,
    /// Resident weights: as held (a checkpoint's BF16 / FP8 / FP4 matrices at their
    /// stored bytes under `--weights stored`), else 4 bytes per parameter.
    pub weights_bytes: u64,
    /// One layer's per-token keys and values at this length (f32): raw K and V of every
    /// KV head plus the compressed entries (kvc: `T/S` per KV head; DeepSeek-V4: one
    /// shared K = V head, its CSA/HCA entries).
    pub kv_layer_bytes: u64,
    /// Logits returned by the forward, `batch x tokens x vocab` f32 (`batch x vocab`
    /// with `last_logits`: only each row's last position goes through the LM head).
    pub logits_bytes: u64,
    /// Whether only the last position's logits were computed.
    pub last_logits: bool,
    /// The compute dtype of the matrix products ([`super::precision`]).
    pub dtype: super::precision::ComputeDtype,
    /// Matrix-product FLOPs one forward executed ([`super::flops`]: every product of
    /// the model code, masked attention blocks included; elementwise work not counted).
    pub matmul_flops: u64,
    /// `matmul_flops / seconds` in GFLOP/s.
    pub matmul_gflops: f64,
    /// The device's dense GEMM rate ([`gemm_gflops`]) when the caller measured it.
    pub gemm_gflops: Option<f64>,
    /// Seconds per forward by stage ([`super::profile`]; mean over the timed forwards),
    /// when asked for.
    pub stages: Option<Vec<super::profile::StageTime>>,
}

/// The stages' seconds in the categories: `(products outside the LM head,
/// dequantisation outside it, the attention core's other work, the LM head (all its
/// work), the experts' and mHC's other work, the rest: embedding, norms, RoPE,
/// elementwise ops)`.
pub fn stage_categories(stages: &[super::profile::StageTime]) -> [f64; 6] {
    use super::profile::{Kind, Region};
    let mut c = [0.0; 6];
    for s in stages {
        let i = match (s.region, s.kind) {
            (Region::Head, _) => 3,
            (_, Kind::Products) => 0,
            (_, Kind::Dequant) => 1,
            (Region::Attention, Kind::Other) => 2,
            (Region::Experts | Region::Mhc, Kind::Other) => 4,
            (Region::Forward, Kind::Other) => 5,
        };
        c[i] += s.seconds;
    }
    c
}

/// The device's dense matrix-product rate in GFLOP/s, in the compute dtype
/// ([`super::precision`]): the median of `reps` products
/// of two `n x n` matrices (after one warm-up), the reference a forward's
/// [`LengthPoint::matmul_gflops`] is a fraction of.
pub fn gemm_gflops(device: &burn::tensor::Device, n: usize, reps: usize) -> f64 {
    use super::flops::Mm;
    let a = Tensor::<2>::ones([n, n], device) * 0.5;
    let b = Tensor::<2>::ones([n, n], device) * 0.25;
    let run = || {
        let t0 = Instant::now();
        let _ = a.clone().mm(b.clone()).into_data();
        t0.elapsed().as_secs_f64()
    };
    run();
    let mut times: Vec<f64> = (0..reps.max(1)).map(|_| run()).collect();
    times.sort_by(f64::total_cmp);
    2.0 * (n as f64).powi(3) / times[times.len() / 2] / 1e9
}

/// `(VmRSS, VmHWM)` of this process in bytes (Linux), if available.
pub fn rss() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Reset the peak resident set to the current one (Linux `clear_refs` 5); false where
/// the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// One layer's K/V state in bytes at `t` tokens (the largest layer).
pub fn kv_layer_bytes(model: &dyn LanguageModel, t: usize) -> u64 {
    let info = model.info();
    let dh = info.d_head as u64;
    let t = t as u64;
    info.layers
        .iter()
        .map(|l| {
            let kvh = l.n_kv_heads as u64;
            // DeepSeek-V4: one shared head is both K and V.
            let kv = if info.arch == super::deepseek_v4::MODEL_TYPE {
                1
            } else {
                2
            };
            let entries = match l.kind {
                LayerKind::Compressed { stride, .. } => t / stride as u64,
                _ => 0,
            };
            (t + entries) * kvh * dh * kv * 4
        })
        .max()
        .unwrap_or(0)
}

/// The median seconds of `reps` calls of `run`, the FLOPs of the last, and with
/// `stages = Some(vocab)` their mean time per stage ([`super::profile`]).
fn timed(
    reps: usize,
    stages: Option<usize>,
    mut run: impl FnMut() -> Result<f64>,
) -> Result<(f64, u64, Option<Vec<super::profile::StageTime>>)> {
    let mut times = Vec::with_capacity(reps);
    let mut flops = 0;
    if let Some(vocab) = stages {
        super::profile::start(vocab);
    }
    for _ in 0..reps {
        super::flops::start();
        let t = run();
        flops = super::flops::stop();
        if t.is_err() && stages.is_some() {
            super::profile::stop();
        }
        times.push(t?);
    }
    let stages = stages.map(|_| {
        let mut s = super::profile::stop();
        s.iter_mut().for_each(|s| s.seconds /= reps as f64);
        s
    });
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], flops, stages))
}

/// Time `reps` forwards (after one warm-up when `reps > 1`) of `batch` rows of `t`
/// deterministic pseudo-random tokens, for every `t` of `lengths`; with `last_logits`
/// the LM head runs at each row's last position only ([`LanguageModel::forward_logit_rows`]);
/// with `stages` the timed forwards are profiled by stage ([`super::profile`]).
pub fn forward_sweep(
    model: &dyn LanguageModel,
    lengths: &[usize],
    (batch, reps): (usize, usize),
    last_logits: bool,
    stages: bool,
    mut progress: impl FnMut(&mut LengthPoint),
) -> Result<Vec<LengthPoint>> {
    if reps == 0 || batch == 0 || lengths.is_empty() || lengths.contains(&0) {
        return Err(Error::Input(format!(
            "bench forward: reps ({reps}), batch ({batch}) and every length ({lengths:?}) must \
             be at least 1"
        )));
    }
    let info = model.info();
    let device = model.device();
    let weights_bytes = match model.resident_bytes() {
        Some(by) => by.values().sum::<usize>() as u64,
        None => model.n_params().unwrap_or(0) as u64 * 4,
    };
    let mut out = Vec::with_capacity(lengths.len());
    for &t in lengths {
        let ids: Vec<i64> = (0..batch * t)
            .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % info.vocab_size as u64) as i64)
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [batch, t]), &device);
        // Each row's last position (a prefill that reads the next-token logits).
        let last: Vec<i64> = (0..batch).map(|r| (r * t + t - 1) as i64).collect();
        let last = Tensor::<1, Int>::from_data(TensorData::new(last, [batch]), &device);
        let run = |tokens: Tensor<2, Int>| -> Result<f64> {
            let _stage = super::profile::region(super::profile::Region::Forward);
            let t0 = Instant::now();
            if last_logits {
                let _ = model.forward_logit_rows(tokens, last.clone())?.into_data();
            } else {
                let logits = model.forward(tokens, &HookSpec::new())?.logits;
                let _ = logits.into_data();
            }
            Ok(t0.elapsed().as_secs_f64())
        };
        if reps > 1 {
            run(tokens.clone())?;
        }
        let base = rss().map(|r| r.0);
        let reset = reset_peak_rss();
        let (seconds, flops, stages) = timed(reps, stages.then_some(info.vocab_size), || {
            run(tokens.clone())
        })?;
        let mut point = LengthPoint {
            tokens: t,
            batch,
            seconds,
            tokens_per_second: (batch * t) as f64 / seconds,
            peak_rss_bytes: if reset { rss().map(|r| r.1) } else { None },
            base_rss_bytes: base,
            weights_bytes,
            kv_layer_bytes: kv_layer_bytes(model, t) * batch as u64,
            logits_bytes: (batch * if last_logits { 1 } else { t } * info.vocab_size * 4) as u64,
            last_logits,
            dtype: super::precision::compute(),
            matmul_flops: flops,
            matmul_gflops: flops as f64 / seconds / 1e9,
            gemm_gflops: None,
            stages,
        };
        progress(&mut point);
        out.push(point);
    }
    Ok(out)
}
