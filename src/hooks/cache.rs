//! Captured activations, indexed by hook point.

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor, TensorData};

use super::point::HookPoint;
use crate::error::{Error, Result};

/// One activation of any rank. Stored flat with its shape so that a cache can hold the
/// mixed ranks of a forward pass (`[batch, pos, d_model]`, `[batch, head, q, k]`, ...).
#[derive(Debug, Clone)]
pub struct Act {
    shape: Vec<usize>,
    flat: Tensor<1>,
}

impl Act {
    /// Wrap a tensor of any rank.
    pub fn new<const D: usize>(t: Tensor<D>) -> Self {
        let shape = t.dims().to_vec();
        let n = shape.iter().product::<usize>();
        Act {
            shape,
            flat: t.reshape([n]),
        }
    }

    /// From host data (f32) and a shape.
    pub fn from_vec(
        values: Vec<f32>,
        shape: Vec<usize>,
        device: &burn::tensor::Device,
    ) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != values.len() {
            return Err(Error::Other(format!(
                "activation shape {shape:?} holds {n} values, got {}",
                values.len()
            )));
        }
        Ok(Act {
            flat: Tensor::from_data(TensorData::new(values, [n]), device),
            shape,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The tensor at its own rank `D`; an error if the rank differs.
    pub fn get<const D: usize>(&self) -> Result<Tensor<D>> {
        let dims: [usize; D] = self.shape.clone().try_into().map_err(|_| {
            Error::Other(format!(
                "activation of shape {:?} (rank {}) read as rank {D}",
                self.shape,
                self.shape.len()
            ))
        })?;
        Ok(self.flat.clone().reshape(dims))
    }

    /// The same values under another shape of the same size (row-major).
    pub fn reshaped(&self, shape: Vec<usize>) -> Result<Act> {
        if shape.iter().product::<usize>() != self.shape.iter().product::<usize>() {
            return Err(Error::Other(format!(
                "activation of shape {:?} cannot be viewed as {shape:?}",
                self.shape
            )));
        }
        Ok(Act {
            shape,
            flat: self.flat.clone(),
        })
    }

    /// The values on the host, row-major.
    pub fn to_vec(&self) -> Vec<f32> {
        self.flat
            .to_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 data")
    }

    /// The same activation on `device` (moved only when it lives elsewhere).
    pub fn to_device(self, device: &burn::tensor::Device) -> Act {
        if self.flat.device() == *device {
            return self;
        }
        Act {
            flat: self.flat.to_device(device),
            shape: self.shape,
        }
    }

    /// `acts` stacked along the batch (first) axis; their other axes must agree.
    pub fn cat_batch(acts: &[Act]) -> Result<Act> {
        let first = acts
            .first()
            .ok_or_else(|| Error::Other("no activations to concatenate".into()))?;
        let rest = first
            .shape
            .get(1..)
            .ok_or_else(|| Error::Other("scalar activation has no batch axis".into()))?;
        let mut shape = first.shape.clone();
        if let Some(a) = acts.iter().find(|a| a.shape.get(1..) != Some(rest)) {
            return Err(Error::Other(format!(
                "activations of shapes {:?} and {:?} cannot be stacked along the batch",
                first.shape, a.shape
            )));
        }
        shape[0] = acts.iter().map(|a| a.shape[0]).sum();
        // Row-major: the flat values of a batch are its rows one after the other.
        Ok(Act {
            flat: Tensor::cat(acts.iter().map(|a| a.flat.clone()).collect(), 0),
            shape,
        })
    }

    /// Rows `rows` of the batch (first) axis, in that order.
    pub fn select_batch(&self, rows: &[usize]) -> Result<Act> {
        let b = *self
            .shape
            .first()
            .ok_or_else(|| Error::Other("scalar activation has no batch axis".into()))?;
        if let Some(r) = rows.iter().find(|&&r| r >= b) {
            return Err(Error::Other(format!("batch row {r} out of range 0..{b}")));
        }
        let per_row: usize = self.shape[1..].iter().product();
        let device = self.flat.device();
        let m: Tensor<2> = self.flat.clone().reshape([b, per_row]);
        let idx = Tensor::<1, Int>::from_data(
            TensorData::new(
                rows.iter().map(|&r| r as i64).collect::<Vec<_>>(),
                [rows.len()],
            ),
            &device,
        );
        let picked = m.select(0, idx);
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        Ok(Act {
            flat: picked.reshape([rows.len() * per_row]),
            shape,
        })
    }
}

/// Maps of the activations of consecutive blocks of rows of one batch, stacked key by
/// key along the batch axis (the first map's keys, in order); each key's pieces are
/// taken out of the maps and dropped once stacked, so at most one key is held twice.
/// `missing(key)` words the error for a key that a later map lacks.
pub(crate) fn stack_maps<K: Ord + Clone>(
    mut parts: Vec<&mut BTreeMap<K, Act>>,
    missing: impl Fn(&K) -> String,
) -> Result<BTreeMap<K, Act>> {
    let keys: Vec<K> = parts
        .first()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for k in keys {
        let pieces = parts
            .iter_mut()
            .map(|m| m.remove(&k).ok_or_else(|| Error::Other(missing(&k))))
            .collect::<Result<Vec<Act>>>()?;
        out.insert(k, Act::cat_batch(&pieces)?);
    }
    Ok(out)
}

/// Activations captured by one forward pass, keyed by hook point.
#[derive(Debug, Clone, Default)]
pub struct ActivationCache {
    map: BTreeMap<HookPoint, Act>,
}

impl ActivationCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Store an activation.
    pub fn insert(&mut self, point: HookPoint, act: Act) {
        self.map.insert(point, act);
    }

    /// The activation at `point`.
    pub fn get(&self, point: &HookPoint) -> Option<&Act> {
        self.map.get(point)
    }

    /// The activation named `name` (e.g. `blocks.0.attn.hook_z`).
    pub fn get_name(&self, name: &str) -> Result<&Act> {
        let p: HookPoint = name.parse()?;
        self.get(&p)
            .ok_or_else(|| Error::hook(name, "not in the cache (was it captured?)"))
    }

    /// Number of captured points.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing was captured.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// All (point, activation) pairs in forward order.
    pub fn iter(&self) -> impl Iterator<Item = (&HookPoint, &Act)> {
        self.map.iter()
    }

    /// Every activation on `device`: a model placed over several devices returns its
    /// captures on its home device.
    pub fn to_device(self, device: &burn::tensor::Device) -> ActivationCache {
        ActivationCache {
            map: self
                .map
                .into_iter()
                .map(|(p, a)| (p, a.to_device(device)))
                .collect(),
        }
    }

    /// The caches of consecutive blocks of rows of one batch (the same points, in
    /// order), every activation stacked along the batch axis. Each point's pieces are
    /// dropped once stacked, so at most one point is held twice.
    pub fn cat_batch(mut parts: Vec<ActivationCache>) -> Result<ActivationCache> {
        let points: Vec<HookPoint> = parts
            .first()
            .map(|c| c.map.keys().copied().collect())
            .unwrap_or_default();
        if let Some(c) = parts.iter().find(|c| c.map.len() != points.len()) {
            return Err(Error::Other(format!(
                "caches of {} and {} points cannot be stacked along the batch",
                points.len(),
                c.map.len()
            )));
        }
        let map = stack_maps(parts.iter_mut().map(|c| &mut c.map).collect(), |p| {
            format!("{p} is missing from a block's captures")
        })?;
        Ok(ActivationCache { map })
    }

    /// Keep only the given batch rows of every activation.
    pub fn select_batch(&self, rows: &[usize]) -> Result<ActivationCache> {
        let mut out = ActivationCache::new();
        for (p, a) in &self.map {
            out.insert(*p, a.select_batch(rows)?);
        }
        Ok(out)
    }
}
