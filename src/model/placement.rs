//! Placement of a model over devices: which device holds each layer and, in
//! DeepSeek-V4's MoE layers, how many routed experts stay on the layer's device (the
//! others live in host memory and run there).
//!
//! The first device is the *home* device: it holds the embedding, receives the token
//! ids, and every forward returns its logits and captured activations there, so hooks,
//! caches, interventions, suffix forwards and patching see one device whatever the
//! placement. The residual stream moves to a layer's device before the layer runs; the
//! final norm and head sit with the last layer (a tied head reads the embedding at
//! home). Devices may be of different backends (`cpu` = flex and `tch-cpu`): burn's
//! dispatch device moves a tensor between backends through host memory.
//!
//! A placement comes from
//! - [`Placement::split`]: contiguous layer ranges over `--devices`, balanced by the
//!   layers' resident bytes, or filled in order when the device memory is given (an
//!   error names the device and the bytes over);
//! - `Plan::placement` (model/plan.rs): `phaselens plan`'s placement of a DeepSeek-V4
//!   model (layer ranges and experts per layer on each device, the rest on the host);
//! - [`PlacementConfig`]: an explicit map (the `[placement]` table of an experiment).

use std::fmt;

use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// Where a model's parts live, by device name.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The devices; the first is the home device (embedding, inputs, outputs).
    pub devices: Vec<DeviceSpec>,
    /// Index into `devices` of each layer's device.
    pub layers: Vec<usize>,
    /// Per layer: how many routed experts (the first ones) stay on the layer's device;
    /// `None` = all. The others live on [`Placement::host`].
    pub experts_on_device: Vec<Option<usize>>,
    /// Where offloaded experts live (host memory).
    pub host: DeviceSpec,
}

/// A [`Placement`] with its devices opened.
#[derive(Debug, Clone)]
pub struct Placed {
    /// The home device (embedding, head; inputs and captures live there).
    pub home: Device,
    /// Each layer's device.
    pub layers: Vec<Device>,
    /// Routed experts kept with each layer (`None`: all).
    pub experts_on_device: Vec<Option<usize>>,
    /// Where the other routed experts live.
    pub host: Device,
    /// The names, for messages.
    pub names: Vec<String>,
}

/// The explicit map of an experiment's `[placement]` table:
///
/// ```toml
/// [placement]
/// devices = ["cpu", "tch-cpu"]
/// layers = [0, 0, 1, 1]              # device index of each layer
/// experts_on_device = [8, 8, 2, 8]   # optional: routed experts kept with each layer
/// host = "cpu"                       # optional: where the other experts live
/// ```
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PlacementConfig {
    /// The devices (`cpu`, `tch-cuda:0`, ...).
    pub devices: Vec<String>,
    /// The device index of each layer.
    pub layers: Vec<usize>,
    /// Routed experts kept with each layer (the rest go to `host`).
    #[serde(default)]
    pub experts_on_device: Option<Vec<usize>>,
    /// Where the other routed experts live (default: the host CPU).
    #[serde(default)]
    pub host: Option<String>,
}

/// `--devices cpu,tch-cpu [--device-memory 6GiB,6GiB]`: an automatic split
/// ([`Placement::split`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DevicesRequest {
    /// The devices, the first one home.
    pub devices: Vec<DeviceSpec>,
    /// Bytes per device; `None`: equal shares of the model's bytes.
    pub memory: Option<Vec<f64>>,
}

impl DevicesRequest {
    /// From `--devices cpu,tch-cpu` and, optionally, the sizes of `--device-memory`
    /// (one for every device, or one per device).
    pub fn new(devices: &str, memory: Option<Vec<f64>>) -> Result<Self> {
        let devices = parse_devices(devices)?;
        let memory = match memory {
            None => None,
            Some(sizes) if sizes.len() == 1 => Some(vec![sizes[0]; devices.len()]),
            Some(sizes) if sizes.len() == devices.len() => Some(sizes),
            Some(sizes) => {
                return Err(Error::field(
                    "--device-memory",
                    format!(
                        "{} sizes for {} devices (give one, or one per device)",
                        sizes.len(),
                        devices.len()
                    ),
                ));
            }
        };
        Ok(DevicesRequest { devices, memory })
    }
}

impl fmt::Display for Placement {
    /// `cpu: layers 0..2; tch-cpu: layers 2..4 (experts on host: layer 3 x 6)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (d, spec) in self.devices.iter().enumerate() {
            let mine: Vec<usize> = (0..self.layers.len())
                .filter(|&l| self.layers[l] == d)
                .collect();
            if !first {
                write!(f, "; ")?;
            }
            first = false;
            write!(f, "{spec}: ")?;
            match (mine.first(), mine.last()) {
                (Some(a), Some(b)) if b - a + 1 == mine.len() => {
                    write!(f, "layers {a}..{}", b + 1)?
                }
                (Some(_), _) => write!(f, "layers {mine:?}")?,
                _ => write!(f, "no layers")?,
            }
        }
        let off: Vec<String> = self
            .experts_on_device
            .iter()
            .enumerate()
            .filter_map(|(l, k)| k.map(|k| format!("layer {l} keeps {k}")))
            .collect();
        if !off.is_empty() {
            write!(
                f,
                " (routed experts, the rest on {}: {})",
                self.host,
                off.join(", ")
            )?;
        }
        Ok(())
    }
}

/// Parse `--devices cpu,tch-cpu`.
pub fn parse_devices(text: &str) -> Result<Vec<DeviceSpec>> {
    let out = text
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<DeviceSpec>())
        .collect::<Result<Vec<_>>>()?;
    if out.is_empty() {
        return Err(Error::field(
            "--devices",
            "no device named (e.g. `--devices cpu,tch-cpu`)",
        ));
    }
    Ok(out)
}

/// The host device for offloaded experts: LibTorch's CPU when every device is a
/// LibTorch one (no cross-backend copies), else flex.
pub fn default_host(devices: &[DeviceSpec]) -> DeviceSpec {
    if devices
        .iter()
        .all(|d| matches!(d, DeviceSpec::TchCpu | DeviceSpec::TchCuda(_)))
    {
        DeviceSpec::TchCpu
    } else {
        DeviceSpec::Cpu
    }
}

impl Placement {
    /// Every layer on `device`.
    pub fn single(device: DeviceSpec, n_layers: usize) -> Self {
        Placement {
            host: default_host(std::slice::from_ref(&device)),
            devices: vec![device],
            layers: vec![0; n_layers],
            experts_on_device: vec![None; n_layers],
        }
    }

    /// Contiguous layer ranges over `devices`. `layer_bytes[l]` are layer `l`'s
    /// resident bytes and `home_bytes` what the home device holds besides its layers
    /// (embedding). Without `capacity`, each device takes about an equal share of the
    /// bytes; with it (bytes per device), devices fill in order and a layer that fits
    /// nowhere is an error naming the device and the bytes over.
    pub fn split(
        devices: Vec<DeviceSpec>,
        layer_bytes: &[f64],
        home_bytes: f64,
        capacity: Option<&[f64]>,
    ) -> Result<Self> {
        let n = layer_bytes.len();
        let nd = devices.len();
        if nd == 0 {
            return Err(Error::field("--devices", "no device named"));
        }
        let mut layers = vec![0usize; n];
        match capacity {
            None => {
                let total: f64 = home_bytes + layer_bytes.iter().sum::<f64>();
                let mut acc = home_bytes;
                for (l, b) in layer_bytes.iter().enumerate() {
                    // the device whose share [d/nd, (d+1)/nd) holds the layer's middle
                    let mid = (acc + b / 2.0) / total.max(1.0);
                    layers[l] = ((mid * nd as f64) as usize).min(nd - 1);
                    acc += b;
                }
            }
            Some(cap) => {
                if cap.len() != nd {
                    return Err(Error::field(
                        "--device-memory",
                        format!("{} sizes for {nd} devices", cap.len()),
                    ));
                }
                let mut d = 0;
                let mut used = home_bytes;
                for (l, &b) in layer_bytes.iter().enumerate() {
                    while used + b > cap[d] {
                        if d + 1 == nd || (used == 0.0 && b > cap[d]) {
                            return Err(over(&devices[d], cap[d], used + b, l));
                        }
                        d += 1;
                        used = 0.0;
                    }
                    used += b;
                    layers[l] = d;
                }
            }
        }
        Ok(Placement {
            host: default_host(&devices),
            devices,
            layers,
            experts_on_device: vec![None; n],
        })
    }

    /// An explicit map, checked against a model of `n_layers` layers (`origin` names
    /// the file in messages).
    pub fn from_config(c: &PlacementConfig, n_layers: usize, origin: &str) -> Result<Self> {
        let key = |k: &str| format!("{origin}: [placement] {k}");
        let devices = c
            .devices
            .iter()
            .map(|s| {
                s.parse::<DeviceSpec>()
                    .map_err(|e| Error::field(key("devices"), e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        if devices.is_empty() {
            return Err(Error::field(key("devices"), "no device named"));
        }
        if c.layers.len() != n_layers {
            return Err(Error::field(
                key("layers"),
                format!(
                    "{} entries for a model of {n_layers} layers (one device index per layer)",
                    c.layers.len()
                ),
            ));
        }
        if let Some((l, d)) = c
            .layers
            .iter()
            .enumerate()
            .find(|(_, d)| **d >= devices.len())
        {
            return Err(Error::field(
                key("layers"),
                format!(
                    "layer {l} names device {d}, but only {} devices are listed (0..{})",
                    devices.len(),
                    devices.len()
                ),
            ));
        }
        let experts_on_device = match &c.experts_on_device {
            None => vec![None; n_layers],
            Some(v) if v.len() == n_layers => v.iter().map(|&k| Some(k)).collect(),
            Some(v) => {
                return Err(Error::field(
                    key("experts_on_device"),
                    format!("{} entries for a model of {n_layers} layers", v.len()),
                ));
            }
        };
        let host = match &c.host {
            Some(h) => h
                .parse::<DeviceSpec>()
                .map_err(|e| Error::field(key("host"), e.to_string()))?,
            None => default_host(&devices),
        };
        Ok(Placement {
            devices,
            layers: c.layers.clone(),
            experts_on_device,
            host,
        })
    }

    /// Check every layer's resident bytes against per-device capacities (bytes):
    /// an error names the first device over and by how much.
    pub fn check_fits(&self, layer_bytes: &[f64], home_bytes: f64, capacity: &[f64]) -> Result<()> {
        let mut used = vec![0.0f64; self.devices.len()];
        used[0] += home_bytes;
        for (l, &b) in layer_bytes.iter().enumerate() {
            used[self.layers[l]] += b;
        }
        for (d, (&u, &c)) in used.iter().zip(capacity).enumerate() {
            if u > c {
                let last = (0..self.layers.len())
                    .rev()
                    .find(|&l| self.layers[l] == d)
                    .unwrap_or(0);
                return Err(over(&self.devices[d], c, u, last));
            }
        }
        Ok(())
    }

    /// Open every device (an absent or unbuilt one is an error naming it).
    pub fn open(&self) -> Result<Placed> {
        let open = |spec: &DeviceSpec| {
            spec.device().map_err(|e| Error::Device {
                device: spec.to_string(),
                message: format!("placement: {e}"),
            })
        };
        let devs = self.devices.iter().map(open).collect::<Result<Vec<_>>>()?;
        Ok(Placed {
            home: devs[0].clone(),
            layers: self.layers.iter().map(|&d| devs[d].clone()).collect(),
            experts_on_device: self.experts_on_device.clone(),
            host: open(&self.host)?,
            names: self.devices.iter().map(|d| d.to_string()).collect(),
        })
    }
}

impl Placed {
    /// Check that the placement is for `n_layers` layers.
    pub fn check_layers(&self, n_layers: usize) -> Result<()> {
        if self.layers.len() != n_layers {
            return Err(Error::Input(format!(
                "the placement names {} layers, the model has {n_layers}",
                self.layers.len()
            )));
        }
        Ok(())
    }

    /// The device of the last layer (final norm and head), home for a model without
    /// layers.
    pub fn last(&self) -> Device {
        self.layers
            .last()
            .cloned()
            .unwrap_or_else(|| self.home.clone())
    }
}

fn over(device: &DeviceSpec, cap: f64, need: f64, layer: usize) -> Error {
    let h = super::memory::human;
    Error::Memory(format!(
        "the placement does not fit: device {device} ({} of memory) would need {} with layer {layer}: {} ({:.0} bytes) over; add devices or memory",
        h(cap),
        h(need),
        h(need - cap),
        need - cap
    ))
}

/// `x` on `device` (moved only when it lives elsewhere).
pub fn to<const D: usize, K: burn::tensor::kind::Basic>(
    x: Tensor<D, K>,
    device: &Device,
) -> Tensor<D, K> {
    if x.device() == *device {
        x
    } else {
        x.to_device(device)
    }
}

/// Per-forward values built once per device (RoPE tables for the layers of each
/// device of a placed model).
pub struct PerDevice<T> {
    items: Vec<(Device, T)>,
}

impl<T> PerDevice<T> {
    /// Nothing built yet.
    pub fn new() -> Self {
        PerDevice { items: Vec::new() }
    }

    /// The value for `device`, built by `make` the first time.
    pub fn get(&mut self, device: &Device, make: impl FnOnce(&Device) -> T) -> &T {
        let i = match self.items.iter().position(|(d, _)| d == device) {
            Some(i) => i,
            None => {
                self.items.push((device.clone(), make(device)));
                self.items.len() - 1
            }
        };
        &self.items[i].1
    }
}

impl<T> Default for PerDevice<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_even_split_balances_bytes_in_order() {
        let p = Placement::split(
            vec![DeviceSpec::Cpu, DeviceSpec::TchCpu],
            &[1.0, 1.0, 1.0, 1.0],
            0.0,
            None,
        )
        .unwrap();
        assert_eq!(p.layers, vec![0, 0, 1, 1]);
        // A heavy embedding at home pushes layers to the second device.
        let p = Placement::split(
            vec![DeviceSpec::Cpu, DeviceSpec::TchCpu],
            &[1.0, 1.0, 1.0, 1.0],
            4.0,
            None,
        )
        .unwrap();
        assert_eq!(p.layers, vec![1, 1, 1, 1]);
    }

    #[test]
    fn a_split_by_memory_names_the_device_and_the_bytes_over() {
        let devs = vec![DeviceSpec::Cpu, DeviceSpec::TchCpu];
        let p = Placement::split(devs.clone(), &[3.0, 3.0, 3.0], 1.0, Some(&[8.0, 5.0])).unwrap();
        assert_eq!(p.layers, vec![0, 0, 1]);
        let e = Placement::split(devs, &[3.0, 3.0, 3.0, 3.0], 1.0, Some(&[8.0, 5.0]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("device tch-cpu") && e.contains("(1 bytes) over"),
            "{e}"
        );
    }

    #[test]
    fn an_explicit_map_is_checked_against_the_model() {
        let c = PlacementConfig {
            devices: vec!["cpu".into(), "tch-cpu".into()],
            layers: vec![0, 2],
            experts_on_device: None,
            host: None,
        };
        let e = Placement::from_config(&c, 2, "exp.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[placement] layers") && e.contains("layer 1 names device 2"),
            "{e}"
        );
        let e = Placement::from_config(&c, 3, "exp.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 entries for a model of 3 layers"), "{e}");
        let ok = PlacementConfig {
            layers: vec![0, 1],
            experts_on_device: Some(vec![4, 1]),
            ..c
        };
        let p = Placement::from_config(&ok, 2, "exp.toml").unwrap();
        assert_eq!(p.experts_on_device, vec![Some(4), Some(1)]);
        assert_eq!(
            p.to_string(),
            "cpu: layers 0..1; tch-cpu: layers 1..2 (routed experts, the rest on cpu: layer 0 keeps 4, layer 1 keeps 1)"
        );
    }

    #[test]
    fn placed_bytes_over_a_capacity_name_the_device() {
        let p = Placement {
            devices: vec![DeviceSpec::Cpu, DeviceSpec::TchCpu],
            layers: vec![0, 1, 1],
            experts_on_device: vec![None; 3],
            host: DeviceSpec::Cpu,
        };
        let e = p
            .check_fits(&[2.0, 2.0, 2.0], 1.0, &[10.0, 3.0])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("device tch-cpu") && e.contains("(1 bytes) over"),
            "{e}"
        );
        p.check_fits(&[2.0, 2.0, 2.0], 1.0, &[10.0, 4.0]).unwrap();
    }
}
