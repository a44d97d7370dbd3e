//! The compute dtype of the models' matrix products (`--dtype f32|bf16`, `[model] dtype`).
//!
//! - [`ComputeDtype::F32`] (the default): every product in f32. This is what gives parity
//!   with transformers' f32 forward (docs/models.md).
//! - [`ComputeDtype::Bf16`]: every matrix product of the model code (the counted `Mm::mm`,
//!   the stored weights' blocked products included) takes its two operands rounded to
//!   bf16. The products are summed in f32 and the result is rounded to bf16, as a bf16
//!   GEMM does (cuBLAS, LibTorch's CPU kernels, flex). The result comes back as f32.
//!   Everything else stays in f32: norms, softmax, RoPE, gates, the residual stream, the
//!   hyper-connections' Sinkhorn iterations. These are the semantics of
//!   `torch.autocast(dtype=torch.bfloat16)`. What it buys: tensor-core GEMMs on a GPU,
//!   and transient dequantised weights at 2 bytes per value instead of 4 (stored
//!   weights' blocks). On CPU backends it is no faster: flex converts bf16
//!   operands to f32 for its GEMM.
//!
//! The setting is per thread (the model code runs its products on the calling thread):
//! [`scoped`] sets it until its guard drops, and [`compute`] reads it.
//!
//! A leaf: the model files read it.

use std::cell::Cell;
use std::fmt;

use burn::tensor::{DType, Device};
use serde::{Deserialize, Serialize};

/// The dtype matrix products are computed in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    /// f32 operands and result (parity with transformers' f32 forward).
    #[default]
    F32,
    /// bf16 operands, f32 sums, bf16 result: autocast semantics.
    Bf16,
}

impl ComputeDtype {
    /// The burn dtype of the products' operands.
    pub fn dtype(self) -> DType {
        match self {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::BF16,
        }
    }

    /// An error unless `device`'s backend computes in this dtype. WGSL has no bf16, so
    /// wgpu refuses it. The message names the device and what to use instead.
    pub fn check_device(self, device: &Device, device_name: &str) -> Result<(), String> {
        if self == ComputeDtype::F32 || device.supports_dtype(self.dtype()) {
            return Ok(());
        }
        Err(format!(
            "--dtype {self}: device {device_name} has no {self} arithmetic; use --dtype f32 there, \
             or a device that has it (cpu, tch-cpu, tch-cuda:N)"
        ))
    }
}

impl std::str::FromStr for ComputeDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(ComputeDtype::F32),
            "bf16" => Ok(ComputeDtype::Bf16),
            _ => Err(format!(
                "`{s}`: the compute dtype is `f32` (the default) or `bf16` (matrix products in bf16, the rest in f32)"
            )),
        }
    }
}

impl fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
        })
    }
}

thread_local! {
    static COMPUTE: Cell<ComputeDtype> = const { Cell::new(ComputeDtype::F32) };
}

/// The compute dtype in effect on this thread.
pub fn compute() -> ComputeDtype {
    COMPUTE.with(|c| c.get())
}

/// Restores the compute dtype it replaced when dropped.
#[must_use = "the dtype holds only while the guard lives"]
pub struct Scope {
    old: ComputeDtype,
}

impl Drop for Scope {
    fn drop(&mut self) {
        COMPUTE.with(|c| c.set(self.old));
    }
}

/// Compute in `dtype` on this thread until the returned guard drops.
pub fn scoped(dtype: ComputeDtype) -> Scope {
    Scope {
        old: COMPUTE.with(|c| c.replace(dtype)),
    }
}

/// Run `f` computing in `dtype` on this thread.
pub fn with_compute<T>(dtype: ComputeDtype, f: impl FnOnce() -> T) -> T {
    let _scope = scoped(dtype);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(compute(), ComputeDtype::F32);
        {
            let _a = scoped(ComputeDtype::Bf16);
            assert_eq!(compute(), ComputeDtype::Bf16);
            with_compute(ComputeDtype::F32, || {
                assert_eq!(compute(), ComputeDtype::F32)
            });
            assert_eq!(compute(), ComputeDtype::Bf16);
        }
        assert_eq!(compute(), ComputeDtype::F32);
    }

    #[test]
    fn names_parse_and_print() {
        for d in [ComputeDtype::F32, ComputeDtype::Bf16] {
            assert_eq!(d.to_string().parse::<ComputeDtype>(), Ok(d));
        }
        let e = "f16".parse::<ComputeDtype>().unwrap_err();
        assert!(e.contains("`f16`") && e.contains("bf16"), "{e}");
    }
}
