//! One optimiser step, shared by `phaselens train` and `phaselens bench train`: sample
//! the batch of the step, forward, answer-position cross-entropy, backward, AdamW with
//! per-parameter gradient clipping, each phase timed.

use std::time::Instant;

use burn::module::Module;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::Serialize;

use super::{TrainConfig, answer_positions, lr_at, rows_loss};
use crate::error::Result;
use crate::model::LanguageModel;
use crate::tasks::KvTrainSampler;

/// AdamW beta1 (burn's default, as PyTorch's).
pub const BETA1: f32 = 0.9;
/// AdamW epsilon.
pub const EPSILON: f32 = 1e-8;

/// The optimiser of a `[train]` table: AdamW (beta1 0.9, `beta2`, eps 1e-8, decoupled
/// `weight_decay` on every parameter) with burn's `GradientClipping::Norm(grad_clip)`,
/// which clips each parameter's gradient by its own L2 norm (not the global norm).
pub fn optimizer(tc: &TrainConfig) -> ModuleOptimizer {
    AdamWConfig::new()
        .with_beta_1(BETA1)
        .with_beta_2(tc.beta2)
        .with_epsilon(EPSILON)
        .with_weight_decay(tc.weight_decay)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(tc.grad_clip)))
        .init()
}

/// Keep freed memory in the process for reuse (Linux, glibc): a training step allocates
/// and frees hundreds of tensors of a few MiB each; with glibc's defaults every one of
/// them is a fresh `mmap` whose pages fault in on first touch, then go back to the kernel.
/// Raising the mmap threshold to 32 MiB (glibc's maximum) and the trim threshold to
/// 256 MiB serves them from the heap instead: ~10% faster steps at the same peak RSS
/// (docs/performance.md). Elsewhere a no-op. Called once by `train` and `bench train`.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // glibc's mallopt(3) parameters M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
            const M_TRIM_THRESHOLD: i32 = -1;
            const M_MMAP_THRESHOLD: i32 = -3;
            unsafe extern "C" {
                fn mallopt(param: i32, value: i32) -> i32;
            }
            // SAFETY: mallopt only changes allocator tuning parameters; glibc
            // serialises it against concurrent allocations (it takes the arena lock).
            unsafe {
                mallopt(M_MMAP_THRESHOLD, 32 << 20);
                mallopt(M_TRIM_THRESHOLD, 256 << 20);
            }
        });
    }
}

/// Wall time of the phases of one step (seconds). The backends used here run
/// operations eagerly, so each phase's time is its own work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PhaseTimes {
    /// Drawing the batch and building the token tensor.
    pub sample: f64,
    /// Forward, loss and accuracy (read back to the host).
    pub forward: f64,
    /// Backward and collecting the parameter gradients.
    pub backward: f64,
    /// Gradient clipping and the AdamW update.
    pub optimizer: f64,
}

impl PhaseTimes {
    /// Seconds of all four phases.
    pub fn total(&self) -> f64 {
        self.sample + self.forward + self.backward + self.optimizer
    }

    /// Element-wise sum.
    pub fn add(&mut self, o: &PhaseTimes) {
        self.sample += o.sample;
        self.forward += o.forward;
        self.backward += o.backward;
        self.optimizer += o.optimizer;
    }
}

/// What one step produced.
#[derive(Debug, Clone, Copy)]
pub struct StepOutcome {
    /// Cross-entropy on the batch's answer positions.
    pub loss: f64,
    /// The indexer distillation loss (`[train] indexer_distill`), when trained.
    pub indexer_kl: Option<f64>,
    /// Top-1 accuracy on the batch's answer positions.
    pub accuracy: f64,
    /// The step's learning rate.
    pub lr: f64,
    /// Where the step's time went.
    pub times: PhaseTimes,
}

/// The parts of a training run every step reads.
pub struct Stepper<'a> {
    /// The batch sampler.
    pub sampler: &'a KvTrainSampler,
    /// `[train]`.
    pub tc: &'a TrainConfig,
    /// The autodiff device.
    pub device: Device,
    /// The CSA layers whose indexers `[train] indexer_distill` trains (empty: none;
    /// [`super::distill`]).
    pub distill: Vec<usize>,
}

impl Stepper<'_> {
    /// The token ids of the batch of `step` as a `[batch, seq]` tensor, and its labels.
    pub fn batch(&self, step: u64) -> (Tensor<2, Int>, Vec<i64>) {
        let batch = self.sampler.batch(step, self.tc.batch_size);
        let ids: Vec<i64> = batch.input_ids().into_iter().map(|x| x as i64).collect();
        let shape = [self.tc.batch_size, self.sampler.seq_len()];
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, shape), &self.device);
        (tokens, batch.labels())
    }

    /// Optimiser step `step` (0-based) of `model`: the updated model and what the step
    /// measured. A non-finite loss is an error (naming the first non-finite layer),
    /// raised before the update.
    pub fn step<M: Module + LanguageModel>(
        &self,
        model: M,
        optim: &mut ModuleOptimizer,
        step: u64,
    ) -> Result<(M, StepOutcome)> {
        let t0 = Instant::now();
        let (tokens, labels) = self.batch(step);
        let t1 = Instant::now();
        let (idx, targets) = answer_positions(&labels);
        let n = idx.len();
        let rows = Tensor::<1, Int>::from_data(TensorData::new(idx, [n]), &self.device);
        let (logits, kl) = if self.distill.is_empty() {
            // The LM head at the answer positions only (the loss reads nothing else).
            (model.forward_logit_rows(tokens.clone(), rows)?, None)
        } else {
            // A plain forward capturing what the indexer distillation reads.
            let out = model.forward(tokens.clone(), &super::distill::spec(&self.distill))?;
            let [b, t, v] = out.logits.dims();
            let logits = out.logits.reshape([b * t, v]).select(0, rows);
            (
                logits,
                Some(super::distill::indexer_kl(&out.cache, &self.distill)?),
            )
        };
        let (ce, acc) = rows_loss(logits, targets);
        // The logged loss is the answer-token cross-entropy, with or without distillation.
        let loss_v = ce.clone().into_scalar::<f32>() as f64;
        let indexer_kl = kl.as_ref().map(|k| k.clone().into_scalar::<f32>() as f64);
        let loss = match kl {
            Some(k) => ce + k * self.tc.indexer_distill,
            None => ce,
        };
        let accuracy = acc.into_scalar::<f32>() as f64;
        let t2 = Instant::now();
        if !loss_v.is_finite() || indexer_kl.is_some_and(|k| !k.is_finite()) {
            // Before the step: the weights that produced it are still there to diagnose.
            return Err(crate::model::diagnose::non_finite_error(
                &model,
                tokens,
                &format!(
                    "training loss became {loss_v} (indexer distillation {indexer_kl:?}) at step {step} (lower [train] lr, now {})",
                    self.tc.lr
                ),
            ));
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let t3 = Instant::now();
        let lr = lr_at(self.tc, step);
        let model = optim.step(lr, model, grads);
        let t4 = Instant::now();
        let secs = |a: Instant, b: Instant| (b - a).as_secs_f64();
        let times = PhaseTimes {
            sample: secs(t0, t1),
            forward: secs(t1, t2),
            backward: secs(t2, t3),
            optimizer: secs(t3, t4),
        };
        Ok((
            model,
            StepOutcome {
                loss: loss_v,
                indexer_kl,
                accuracy,
                lr,
                times,
            },
        ))
    }
}
