//! The pooling compressor shared by the KV compressors (compressor.rs) and the
//! lightning indexer (indexer.rs): per-token projections, gate logits with a
//! position bias, the softmax over a window's slots, RMSNorm. With `overlap` (CSA) each
//! token projects `2 * dim` channels laid out in "two halves" (see the compressor's docs).

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

use super::rope;
use crate::error::{Error, Result};
use crate::model::kv_state::TokenFlow;
use crate::model::layers::{Linear, RmsNorm, RopeTables, int_tensor};
use crate::model::weights::{Init, Vb};

/// Positions of windows pooled at once by [`Pooler::entries_through`] over every
/// position (a plain or recording forward; a long prompt's windows in chunks).
pub const POOL_CHUNK_POSITIONS: usize = 2048;

/// The projections and norm of one pooling compressor.
#[derive(Module, Debug)]
pub struct Pooler {
    /// `[slots_per_token * dim, d_model]` (2 * dim when overlapping).
    pub kv_proj: Linear,
    pub gate_proj: Linear,
    /// `[rate, slots_per_token * dim]`, added to the gate logits by in-window offset.
    pub position_bias: Param<Tensor<2>>,
    /// Weighted RMSNorm over `dim`.
    pub kv_norm: RmsNorm,
    #[module(skip)]
    pub rate: usize,
    #[module(skip)]
    pub overlap: bool,
    #[module(skip)]
    pub dim: usize,
}

impl Pooler {
    /// Build under `vb` (names `kv_proj.weight`, `gate_proj.weight`, `position_bias`,
    /// `kv_norm.weight`).
    pub fn new(
        vb: &Vb,
        d_model: usize,
        dim: usize,
        rate: usize,
        overlap: bool,
        eps: f64,
    ) -> Result<Self> {
        let w = if overlap { 2 } else { 1 };
        let std = 1.0 / (d_model as f64).sqrt();
        Ok(Pooler {
            kv_proj: Linear::new(&vb.pp("kv_proj"), d_model, w * dim, std)?,
            gate_proj: Linear::new(&vb.pp("gate_proj"), d_model, w * dim, std)?,
            position_bias: vb.param("position_bias", [rate, w * dim], Init::Zeros)?,
            kv_norm: RmsNorm::new(&vb.pp("kv_norm"), dim, eps)?,
            rate,
            overlap,
            dim,
        })
    }

    /// Number of closed windows for a sequence of `t` tokens.
    pub fn n_entries(&self, t: usize) -> usize {
        t / self.rate
    }

    /// Gate logits and slot values of every closed window, both `[b, n, slots, dim]`
    /// (slots = rate, or 2 * rate when overlapping; the logits include the position bias,
    /// the softmax over slots is the caller's). `None` when no window has closed.
    pub fn window_logits(&self, x: &Tensor<3>) -> Option<(Tensor<4>, Tensor<4>)> {
        let [_, t, _] = x.dims();
        let n = t / self.rate;
        if n == 0 {
            return None;
        }
        let x = x.clone().slice_dim(1, 0..n * self.rate);
        self.window_logits_from(self.project(&x))
    }

    /// Per-token projections `(kv_proj(x), gate_proj(x))`, both `[b, t, slots_per_token *
    /// dim]` (the gate without its position bias): what [`Pooler::window_logits_from`]
    /// arranges into windows.
    pub fn project(&self, x: &Tensor<3>) -> (Tensor<3>, Tensor<3>) {
        (
            self.kv_proj.forward(x.clone()),
            self.gate_proj.forward(x.clone()),
        )
    }

    /// Gate weights (the softmax over slots) and slot values of every closed window, from
    /// per-token projections ([`Pooler::project`]).
    pub fn windows_from(
        &self,
        projections: (Tensor<3>, Tensor<3>),
    ) -> Option<(Tensor<4>, Tensor<4>)> {
        self.window_logits_from(projections)
            .map(|(logits, values)| (softmax(logits, 2), values))
    }

    /// [`Pooler::window_logits`] from per-token projections ([`Pooler::project`]) of the
    /// whole sequence (positions past the last closed window are ignored).
    pub fn window_logits_from(
        &self,
        (kv, gate): (Tensor<3>, Tensor<3>),
    ) -> Option<(Tensor<4>, Tensor<4>)> {
        let [b, t, _] = kv.dims();
        let (m, d) = (self.rate, self.dim);
        let n = t / m;
        if n == 0 {
            return None;
        }
        let wd = if self.overlap { 2 * d } else { d };
        let kv = kv.slice_dim(1, 0..n * m).reshape([b, n, m, wd]);
        let gate = gate.slice_dim(1, 0..n * m).reshape([b, n, m, wd])
            + self.position_bias.val().reshape([1, 1, m, wd]);
        let device = kv.device();
        if !self.overlap {
            return Some((gate, kv));
        }
        let a_kv = kv.clone().slice_dim(3, 0..d);
        let b_kv = kv.slice_dim(3, d..2 * d);
        let a_g = gate.clone().slice_dim(3, 0..d);
        let b_g = gate.slice_dim(3, d..2 * d);
        // A half of window w-1 goes to entry w; entry 0 gets zero values, -inf gates.
        let zero_kv = Tensor::<4>::zeros([b, 1, m, d], &device);
        let ninf_g = Tensor::<4>::full([b, 1, m, d], f32::NEG_INFINITY, &device);
        let (prev_kv, prev_g) = if n > 1 {
            (
                Tensor::cat(vec![zero_kv, a_kv.slice_dim(1, 0..n - 1)], 1),
                Tensor::cat(vec![ninf_g, a_g.slice_dim(1, 0..n - 1)], 1),
            )
        } else {
            (zero_kv, ninf_g)
        };
        let values = Tensor::cat(vec![prev_kv, b_kv], 2);
        let logits = Tensor::cat(vec![prev_g, b_g], 2);
        Some((logits, values))
    }

    /// The entries of every closed window, `[b, n, 1, dim]`: pooled ([`Pooler::pool`]
    /// of the softmax over slots) and rotated at the window starts `starts`, from this
    /// forward's per-token projections ([`Pooler::project`] at the positions `flow`
    /// computes) passed through `flow` as `names[0]` (kv) and `names[1]` (gate). A
    /// recording forward keeps the entries in the state as `names[2]`; a suffix forward
    /// takes the windows that close before its first recomputed position from there (the
    /// same values: a window reads only its own tokens, and those are the base run's)
    /// and pools only the later ones per row, without merging the state over every
    /// position of every row. `None` when no window has closed.
    pub fn entries_through(
        &self,
        layer: usize,
        names: [&'static str; 3],
        (kv, gate): (Tensor<3>, Tensor<3>),
        starts: &RopeTables,
        flow: &mut TokenFlow,
    ) -> Result<Option<Tensor<4>>> {
        let m = self.rate;
        let n = flow.queries().total() / m;
        let w0 = flow.first_recomputed().map_or(0, |f| (f / m).min(n));
        if n == 0 || w0 == 0 {
            let kv = flow.full(layer, names[0], kv)?;
            let gate = flow.full(layer, names[1], gate)?;
            let e = self.pooled_in_chunks(kv, gate, starts, POOL_CHUNK_POSITIONS);
            if let Some(e) = &e {
                flow.keep(layer, names[2], e);
            }
            return Ok(e);
        }
        let device = kv.device();
        let head = match flow.kept::<4>(layer, names[2], &device) {
            // The entries the base run pooled, of every prompt.
            Some(kept) => {
                let (e, rows) = kept?;
                e.slice_dim(1, 0..w0).select(0, int_tensor(&rows, &device))
            }
            // Not kept (the base run's compressor was hooked): pooled from its
            // projections, once per prompt.
            None => {
                let missing = || Error::Other("a suffix forward without its prefix state".into());
                let (base_kv, rows) = flow
                    .base_state(layer, names[0], &kv)
                    .ok_or_else(missing)??;
                let (base_gate, _) = flow
                    .base_state(layer, names[1], &gate)
                    .ok_or_else(missing)??;
                let cut = |x: Tensor<3>| x.slice_dim(1, 0..w0 * m);
                let (w, v) = self
                    .window_logits_from((cut(base_kv), cut(base_gate)))
                    .expect("w0 >= 1 closed windows");
                self.pooled(w, v, &starts.rows(0..w0))
                    .select(0, int_tensor(&rows, &device))
            }
        };
        let mut entries = head;
        if w0 < n {
            let p0 = self.first_read(w0);
            let kv = flow.full_from(layer, names[0], kv, p0)?;
            let gate = flow.full_from(layer, names[1], gate, p0)?;
            let tail = self
                .pooled_from((kv, gate), w0, &starts.rows(w0..n))
                .expect("windows close after w0");
            entries = Tensor::cat(vec![entries, tail], 1);
        }
        Ok(Some(entries))
    }

    /// Entries `[b, k, 1, dim]` from window logits and values (`[b, k, slots, dim]`),
    /// rotated with `tables` (one row per entry).
    fn pooled(&self, w: Tensor<4>, v: Tensor<4>, tables: &RopeTables) -> Tensor<4> {
        let e = self.pool(softmax(w, 2), v);
        let [b, k, d] = e.dims();
        rope::rotate(e.reshape([b, k, 1, d]), tables, false)
    }

    /// The first position the windows from `w0` on read: window `w0`'s start or, with
    /// overlap, window `w0 - 1`'s (window `w0` reads the first half of its tokens).
    pub(super) fn first_read(&self, w0: usize) -> usize {
        if self.overlap && w0 > 0 {
            (w0 - 1) * self.rate
        } else {
            w0 * self.rate
        }
    }

    /// The entries of windows `w0..` from the projections of the positions from
    /// [`Pooler::first_read`]`(w0)` on, rotated with `tables` (one row per entry): with
    /// overlap, window `w0 - 1`'s own entry is dropped (its first half is missing here).
    /// `None` when no window closes.
    pub(super) fn pooled_from(
        &self,
        projections: (Tensor<3>, Tensor<3>),
        w0: usize,
        tables: &RopeTables,
    ) -> Option<Tensor<4>> {
        let (w, v) = self.window_logits_from(projections)?;
        let (skip, k) = (w0 - self.first_read(w0) / self.rate, w.dims()[1]);
        Some(self.pooled(w.slice_dim(1, skip..k), v.slice_dim(1, skip..k), tables))
    }

    /// The entries of every closed window from every position's projections (`kv`,
    /// `gate`: `[b, t, *]`), `chunk` positions of windows at a time: the
    /// windows' logits, values, softmax and products (several copies of the projections)
    /// exist for one chunk at a time. Each window reads its own tokens (and, overlapping,
    /// the previous window's first half), so every entry is the one pooled at once.
    fn pooled_in_chunks(
        &self,
        kv: Tensor<3>,
        gate: Tensor<3>,
        starts: &RopeTables,
        chunk: usize,
    ) -> Option<Tensor<4>> {
        let m = self.rate;
        let n = kv.dims()[1] / m;
        let chunk = (chunk / m).max(1);
        if n <= chunk {
            let (w, v) = self.window_logits_from((kv, gate))?;
            return Some(self.pooled(w, v, starts));
        }
        let parts: Vec<Tensor<4>> = (0..n)
            .step_by(chunk)
            .map(|c0| {
                let c1 = (c0 + chunk).min(n);
                let cut = |x: &Tensor<3>| x.clone().slice_dim(1, self.first_read(c0)..c1 * m);
                self.pooled_from((cut(&kv), cut(&gate)), c0, &starts.rows(c0..c1))
                    .expect("a chunk holds at least one window")
            })
            .collect();
        Some(Tensor::cat(parts, 1))
    }

    /// `kv_norm(sum_slots weights * values)`: `[b, n, dim]`.
    pub fn pool(&self, weights: Tensor<4>, values: Tensor<4>) -> Tensor<3> {
        let [b, n, _, d] = values.dims();
        self.kv_norm
            .forward((weights * values).sum_dim(2).reshape([b, n, d]))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;
    use crate::model::weights::RandomInit;

    /// Pooling in chunks of windows gives every entry bit for bit as pooling every
    /// window at once: overlapping (CSA) and plain (HCA) windows, chunks of one window,
    /// of several, uneven, and positions past the last closed window.
    #[test]
    fn pooling_in_chunks_gives_the_entries_of_pooling_at_once() {
        let dev = Device::flex();
        let (b, t, d_model, dim) = (2, 61, 12, 8);
        for (rate, overlap) in [(4, true), (8, false)] {
            let vb = Vb::new(&RandomInit { seed: 11 }, &dev);
            let p = Pooler::new(&vb, d_model, dim, rate, overlap, 1e-6).unwrap();
            let x: Vec<f32> = (0..b * t * d_model)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let x = Tensor::<3>::from_data(TensorData::new(x, [b, t, d_model]), &dev);
            let (kv, gate) = p.project(&x);
            let n = t / rate;
            let starts: Vec<usize> = (0..n).map(|w| w * rate).collect();
            let starts = RopeTables::new(&starts, &[1.0, 0.1], 1.0, &dev);
            let bits = |e: Tensor<4>| -> Vec<u32> {
                let v = e.into_data().try_to_vec::<f32>().unwrap();
                v.into_iter().map(f32::to_bits).collect()
            };
            let once = bits(
                p.pooled_in_chunks(kv.clone(), gate.clone(), &starts, t)
                    .unwrap(),
            );
            assert_eq!(once.len(), b * n * dim);
            for chunk in [1, rate, 2 * rate, 3 * rate + 1, 5 * rate] {
                let chunked = p.pooled_in_chunks(kv.clone(), gate.clone(), &starts, chunk);
                assert_eq!(bits(chunked.unwrap()), once, "rate {rate}, chunk {chunk}");
            }
        }
    }
}
