//! `--device` text -> burn [`Device`].
//!
//! Backends are cargo features; the device is chosen at run time. Asking for a device
//! whose feature was not compiled in is an error that says how to build it. A leaf: the
//! backend equivalence matrix that exercises every device lives in src/backends/.

use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;

use crate::error::{Error, Result};

/// A device specification as given on the command line.
///
/// | text          | backend                         | cargo feature |
/// |---------------|---------------------------------|---------------|
/// | `cpu`         | flex (pure-Rust CPU)            | `flex` (default) |
/// | `wgpu[:N]`    | wgpu (Vulkan/Metal), adapter N  | `wgpu`        |
/// | `tch-cpu`     | LibTorch on CPU                 | `tch`         |
/// | `tch-cuda:N`  | LibTorch on CUDA GPU N          | `tch`         |
/// | `cuda:N`      | burn's CUDA backend, GPU N      | `cuda`        |
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// `cpu`: flex, the pure-Rust CPU backend.
    #[default]
    Cpu,
    /// `wgpu[:N]`: wgpu, the default adapter or adapter N.
    Wgpu(Option<usize>),
    /// `tch-cpu`: LibTorch on the CPU.
    TchCpu,
    /// `tch-cuda:N`: LibTorch on CUDA GPU N.
    TchCuda(usize),
    /// `cuda:N`: burn's CUDA backend on GPU N.
    Cuda(usize),
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Wgpu(None) => write!(f, "wgpu"),
            DeviceSpec::Wgpu(Some(n)) => write!(f, "wgpu:{n}"),
            DeviceSpec::TchCpu => write!(f, "tch-cpu"),
            DeviceSpec::TchCuda(n) => write!(f, "tch-cuda:{n}"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

const ALLOWED: &str = "cpu, wgpu, wgpu:N, tch-cpu, tch-cuda:N, cuda:N";

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |msg: String| Error::Device {
            device: s.to_string(),
            message: msg,
        };
        let index = |text: &str| -> Result<usize> {
            text.parse::<usize>().map_err(|_| {
                bad(format!(
                    "`{text}` is not a device index (expected a number)"
                ))
            })
        };
        let (kind, idx) = match s.split_once(':') {
            Some((k, i)) => (k, Some(i)),
            None => (s, None),
        };
        match (kind, idx) {
            ("cpu" | "flex", None) => Ok(DeviceSpec::Cpu),
            ("wgpu", None) => Ok(DeviceSpec::Wgpu(None)),
            ("wgpu", Some(i)) => Ok(DeviceSpec::Wgpu(Some(index(i)?))),
            ("tch-cpu", None) => Ok(DeviceSpec::TchCpu),
            ("tch-cuda", Some(i)) => Ok(DeviceSpec::TchCuda(index(i)?)),
            ("tch-cuda", None) => Ok(DeviceSpec::TchCuda(0)),
            ("cuda", Some(i)) => Ok(DeviceSpec::Cuda(index(i)?)),
            ("cuda", None) => Ok(DeviceSpec::Cuda(0)),
            _ => Err(bad(format!("unknown device; allowed: {ALLOWED}"))),
        }
    }
}

fn not_built(spec: &DeviceSpec, feature: &str) -> Error {
    Error::Device {
        device: spec.to_string(),
        message: format!(
            "this phaselens binary was built without the `{feature}` feature; \
             rebuild with `PHASELENS_FEATURES=all-backends just build` (flex, tch and wgpu) \
             or `cargo build --features {feature}` (see README, \"Devices and backends\")"
        ),
    }
}

impl DeviceSpec {
    /// The burn device for this spec, after checking once per process that it works on
    /// this machine (see [`probe`]): an error naming the missing cargo feature, or a
    /// device that is built but absent (no driver, no adapter, no GPU of that index) and
    /// what it needs, instead of a backend panic in the middle of a run.
    pub fn device(&self) -> Result<Device> {
        let device = self.build()?;
        if *self != DeviceSpec::Cpu {
            self.check_works(&device)?;
        }
        Ok(device)
    }

    /// Run the probe computation on `device` once per process and spec.
    fn check_works(&self, device: &Device) -> Result<()> {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        static SEEN: OnceLock<Mutex<HashMap<String, std::result::Result<(), String>>>> =
            OnceLock::new();
        let seen = SEEN.get_or_init(Default::default);
        let key = self.to_string();
        let known = seen.lock().ok().and_then(|m| m.get(&key).cloned());
        let got = match known {
            Some(r) => r,
            None => {
                let r = compute_check(device);
                if let Ok(mut m) = seen.lock() {
                    m.insert(key, r.clone());
                }
                r
            }
        };
        got.map_err(|why| Error::Device {
            device: self.to_string(),
            message: format!(
                "built in, but not usable on this machine: {why}; {} \
                 (`phaselens backends` lists the devices that work here)",
                self.needs()
            ),
        })
    }

    /// What this device needs from the machine, for messages.
    fn needs(&self) -> &'static str {
        match self {
            DeviceSpec::Cpu | DeviceSpec::TchCpu => "it needs a loadable CPU backend",
            DeviceSpec::Wgpu(_) => {
                "wgpu needs a GPU adapter (a Vulkan, Metal or DX12 driver) of that index"
            }
            DeviceSpec::TchCuda(_) => {
                "tch-cuda needs an NVIDIA driver, a GPU of that index and a CUDA build of LibTorch"
            }
            DeviceSpec::Cuda(_) => "cuda needs an NVIDIA driver (libcuda) and a GPU of that index",
        }
    }

    /// The burn device for this spec without the probe.
    fn build(&self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => cpu_device(self),
            DeviceSpec::Wgpu(n) => wgpu_device(self, *n),
            DeviceSpec::TchCpu => tch_device(self, None),
            DeviceSpec::TchCuda(n) => tch_device(self, Some(*n)),
            DeviceSpec::Cuda(n) => cuda_device(self, *n),
        }
    }
}

impl DeviceSpec {
    /// The cargo feature that compiles this device's backend in.
    pub fn feature(&self) -> &'static str {
        match self {
            DeviceSpec::Cpu => "flex",
            DeviceSpec::Wgpu(_) => "wgpu",
            DeviceSpec::TchCpu | DeviceSpec::TchCuda(_) => "tch",
            DeviceSpec::Cuda(_) => "cuda",
        }
    }

    /// Whether this binary has the device's backend compiled in.
    pub fn is_built(&self) -> bool {
        // A table, not a match: with some features off the match's arms are all
        // constants, and clippy asks for `matches!` in one build but not in another.
        const BUILT: [(&str, bool); 4] = [
            ("flex", cfg!(feature = "flex")),
            ("wgpu", cfg!(feature = "wgpu")),
            ("tch", cfg!(feature = "tch")),
            ("cuda", cfg!(feature = "cuda")),
        ];
        BUILT.contains(&(self.feature(), true))
    }
}

/// Why a device cannot be used here (what [`probe`] found).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// This binary was built without the device's backend feature.
    NotBuilt {
        /// The cargo feature to build with.
        feature: String,
    },
    /// Built, but the device does not work on this machine (no GPU, no Vulkan driver).
    Unavailable {
        /// What the backend said.
        message: String,
    },
}

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unusable::NotBuilt { feature } => {
                write!(f, "built without the `{feature}` feature")
            }
            Unusable::Unavailable { message } => write!(f, "unavailable: {message}"),
        }
    }
}

/// The device, after checking that it works on this machine: a small computation runs on
/// it and its result reads back correctly. Backends panic when their hardware or driver is
/// missing (no CUDA GPU, no Vulkan adapter): the panic is caught and becomes
/// [`Unusable::Unavailable`] with its message (the panic hook is silenced meanwhile).
pub fn probe(spec: &DeviceSpec) -> std::result::Result<Device, Unusable> {
    if !spec.is_built() {
        return Err(Unusable::NotBuilt {
            feature: spec.feature().to_string(),
        });
    }
    let device = spec.build().map_err(|e| Unusable::Unavailable {
        message: e.to_string(),
    })?;
    match compute_check(&device) {
        Ok(()) => Ok(device),
        Err(message) => Err(Unusable::Unavailable { message }),
    }
}

/// A small computation on `device` that must read back 17.25; the backend's panic
/// (first line) or the wrong value otherwise.
fn compute_check(device: &Device) -> std::result::Result<(), String> {
    let tried = quietly(|| {
        let t = burn::tensor::Tensor::<1>::from_floats([1.0, 2.0, 3.5], device);
        t.clone().mul(t).sum().into_scalar::<f32>()
    });
    match tried {
        Ok(v) if (v - 17.25).abs() < 1e-4 => Ok(()),
        Ok(v) => Err(format!("a test computation read back {v} instead of 17.25")),
        Err(msg) => Err(tidy_panic(&msg)),
    }
}

/// The reason in a backend's panic message, without Rust's `unwrap` wrapper, the error
/// type's Debug dress (`Torch("...")`) or a C++ stack trace: `Found no NVIDIA driver
/// on your system. ...`.
fn tidy_panic(msg: &str) -> String {
    let mut m = msg.lines().next().unwrap_or_default();
    if let Some(rest) = m.strip_prefix("called `Result::unwrap()` on an `Err` value: ") {
        m = rest;
    }
    // `Torch("reason\nException raised ...")`: the quoted reason.
    if let Some(i) = m.find("(\"")
        && m[..i]
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        m = m[i + 2..].trim_end_matches("\")").trim_end_matches('"');
    }
    let m = m.split("\\n").next().unwrap_or(m).trim();
    let mut out: String = m.chars().take(300).collect();
    if m.chars().count() > 300 {
        out.push_str("...");
    }
    out
}

/// Run `f`, turning a panic (backends panic on missing hardware, drivers or unsupported
/// ops) into its message; the panic hook is silenced meanwhile.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    got.map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the backend panicked".to_string())
    })
}

#[cfg(feature = "flex")]
fn cpu_device(_: &DeviceSpec) -> Result<Device> {
    Ok(Device::flex())
}
#[cfg(not(feature = "flex"))]
fn cpu_device(spec: &DeviceSpec) -> Result<Device> {
    Err(not_built(spec, "flex"))
}

#[cfg(feature = "wgpu")]
fn wgpu_device(_: &DeviceSpec, n: Option<usize>) -> Result<Device> {
    use burn::tensor::DeviceKind;
    Ok(Device::wgpu(match n {
        None => DeviceKind::DefaultDevice,
        Some(i) => DeviceKind::DiscreteGpu(i),
    }))
}
#[cfg(not(feature = "wgpu"))]
fn wgpu_device(spec: &DeviceSpec, _: Option<usize>) -> Result<Device> {
    Err(not_built(spec, "wgpu"))
}

#[cfg(feature = "tch")]
// burn 0.22 marks every LibTorch device constructor deprecated (there is no other way to
// make one); the design card asks for the backend. `expect`, so that the attribute goes
// when burn lifts the mark.
#[expect(
    deprecated,
    reason = "burn 0.22 deprecates its LibTorch backend, which we use"
)]
fn tch_device(_: &DeviceSpec, n: Option<usize>) -> Result<Device> {
    Ok(match n {
        None => Device::libtorch(),
        Some(i) => Device::libtorch_cuda(i),
    })
}
#[cfg(not(feature = "tch"))]
fn tch_device(spec: &DeviceSpec, _: Option<usize>) -> Result<Device> {
    Err(not_built(spec, "tch"))
}

#[cfg(feature = "cuda")]
fn cuda_device(_: &DeviceSpec, n: usize) -> Result<Device> {
    Ok(Device::cuda(n))
}
#[cfg(not(feature = "cuda"))]
fn cuda_device(spec: &DeviceSpec, _: usize) -> Result<Device> {
    Err(not_built(spec, "cuda"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!(
            "wgpu".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Wgpu(None)
        );
        assert_eq!(
            "wgpu:1".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Wgpu(Some(1))
        );
        assert_eq!("tch-cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::TchCpu);
        assert_eq!(
            "tch-cuda:2".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::TchCuda(2)
        );
        assert_eq!("cuda:0".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        for s in ["cpu", "wgpu", "wgpu:1", "tch-cpu", "tch-cuda:2", "cuda:0"] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn backend_panics_are_reduced_to_their_reason() {
        let torch = "called `Result::unwrap()` on an `Err` value: Torch(\"Found no NVIDIA driver on your system.\\nException raised from x\\nframe #0\")";
        assert_eq!(tidy_panic(torch), "Found no NVIDIA driver on your system.");
        assert_eq!(tidy_panic("No adapter found\nmore"), "No adapter found");
    }

    #[test]
    fn rejects_unknown_and_bad_index() {
        let e = "tpu".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("allowed"), "{e}");
        let e = "cuda:x".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("not a device index"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn missing_feature_is_a_clear_error() {
        let e = DeviceSpec::Cuda(0).device().unwrap_err().to_string();
        assert!(e.contains("--features cuda"), "{e}");
    }
}
