//! What a DeepSeek-V4 attention layer keeps between the spans of a plain forward in
//! spans (`deepseek_v4::token_blocks`): the part of its K/V cache that later queries
//! read, and nothing per position beyond it.
//!
//! A query at position `q` reads the raw K = V head of the `window` positions up to `q`,
//! and the compressed entries (with, in a CSA layer, the indexer's pooled keys) of the
//! windows closed by `q`. So after a span the layer keeps the last `window - 1` rotated
//! K = V heads, every closed window's entries, and the pooler inputs of the positions
//! whose windows are still open (with overlap, also the last closed window's, whose first
//! half the next entry reads). Each window is pooled once, from the same projections as
//! in a whole forward, so the entries are the ones pooled at once (pooling is per window;
//! `pooler::tests` checks chunked pooling bit for bit).

use burn::tensor::Tensor;

use super::attention::{Attention, BlockKeys, KeyInputs, Tables, entries as entries_of};
use super::config::{AttnType, DeepseekV4Config};
use super::pooler::Pooler;
use crate::model::layers::{RopeTables, cat_dim1};

/// One attention layer's cache between spans.
#[derive(Default)]
pub struct SpanCache {
    /// The rotated K = V head of the last `window - 1` positions before the next span
    /// (`[b, <= window - 1, 1, head_dim]`), or `None` before the first span.
    tail: Option<Tensor<4>>,
    /// The compressor's closed windows.
    comp: Pooled,
    /// The CSA indexer's closed windows.
    index: Pooled,
    /// Positions seen so far.
    end: usize,
}

impl SpanCache {
    /// f32 values held: `(entries and index keys, raw tail + pending pooler inputs)`.
    /// The first grows with the positions seen (as [`cached_per_token`] counts), the
    /// second is bounded by the window and two windows of pooler inputs.
    pub fn held_values(&self) -> (usize, usize) {
        let n = |x: &Tensor<4>| x.dims().iter().product::<usize>();
        let n3 = |x: &Tensor<3>| x.dims().iter().product::<usize>();
        let entries = [&self.comp, &self.index]
            .iter()
            .filter_map(|p| p.entries.as_ref())
            .map(n)
            .sum();
        let pending: usize = [&self.comp, &self.index]
            .iter()
            .filter_map(|p| p.pending.as_ref())
            .map(|(k, g)| n3(k) + n3(g))
            .sum();
        (entries, self.tail.as_ref().map_or(0, n) + pending)
    }
}

/// One pooler's entries of the windows closed so far, and the inputs of the rest.
#[derive(Default)]
struct Pooled {
    /// `[b, done, 1, dim]`, rotated at the window starts.
    entries: Option<Tensor<4>>,
    /// Windows pooled so far.
    done: usize,
    /// The pooler inputs (`kv`, `gate`) from `Pooler::first_read(done)` to the end of
    /// the last span.
    pending: Option<(Tensor<3>, Tensor<3>)>,
}

impl Pooled {
    /// Add the pooler inputs of the positions up to `end` (`new`, continuing the pending
    /// ones) and pool every window they close (`starts`: the tables at every window's
    /// start).
    fn extend(
        &mut self,
        pooler: &Pooler,
        (kv, gate): (Tensor<3>, Tensor<3>),
        end: usize,
        starts: &RopeTables,
    ) {
        let (kv, gate) = match self.pending.take() {
            Some((pk, pg)) => (cat_dim1(vec![pk, kv]), cat_dim1(vec![pg, gate])),
            None => (kv, gate),
        };
        let from = pooler.first_read(self.done);
        let n = end / pooler.rate;
        if n > self.done {
            let e = pooler
                .pooled_from(
                    (kv.clone(), gate.clone()),
                    self.done,
                    &starts.rows(self.done..n),
                )
                .expect("windows close in this span");
            self.entries = Some(match self.entries.take() {
                Some(old) => cat_dim1(vec![old, e]),
                None => e,
            });
        }
        let keep = pooler.first_read(n) - from;
        let t = kv.dims()[1];
        self.pending = (keep < t).then(|| {
            (
                owned(kv.slice_dim(1, keep..t)),
                owned(gate.slice_dim(1, keep..t)),
            )
        });
        self.done = n;
    }
}

/// f32 values per position the layers of a `c` model keep between spans: each closed
/// window's entry (`head_dim`) and, in CSA, its index key (`index_head_dim`), per `rate`
/// positions. (The raw tail and the open windows' inputs are a constant beside it.)
pub fn cached_per_token(c: &DeepseekV4Config) -> f64 {
    c.layer_types
        .iter()
        .map(|t| match t {
            AttnType::Csa => (c.head_dim + c.index_head_dim) as f64 / c.csa_rate as f64,
            AttnType::Hca => c.head_dim as f64 / c.hca_rate as f64,
            AttnType::Sliding => 0.0,
        })
        .sum()
}

/// A copy of `x` in its own buffer: a slice is a view that would keep the whole buffer
/// it was cut from alive (for small pieces kept across spans).
pub(super) fn owned<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let device = x.device();
    Tensor::from_data(x.into_data(), &device)
}

impl Attention {
    /// The keys the queries of the span at positions `s0..` read (its blocks'
    /// [`Attention::key_inputs`], in order), given what `cache` holds of the positions
    /// before it: the raw K = V head from `s0 - (window - 1)` on, the compressed entries
    /// and the CSA indexer's pooled keys of every window closed by the span's end. Then
    /// `cache` keeps what later spans read.
    pub fn span_keys(
        &self,
        inputs: Vec<KeyInputs>,
        s0: usize,
        cache: &mut SpanCache,
        tables: &Tables,
    ) -> BlockKeys {
        assert_eq!(s0, cache.end, "spans run in order");
        let tail = cache.tail.take();
        let start = s0 - tail.as_ref().map_or(0, |t| t.dims()[1]);
        let mut k = Vec::with_capacity(inputs.len() + 1);
        k.extend(tail);
        let (mut comp, mut index) = (Vec::new(), Vec::new());
        for i in inputs {
            k.push(i.k);
            comp.extend(i.comp);
            index.extend(i.index);
        }
        let k = cat_dim1(k);
        let held = k.dims()[1];
        let end = start + held;
        let keep = tables.window.saturating_sub(1).min(held);
        cache.tail = (keep > 0).then(|| owned(k.clone().slice_dim(1, held - keep..held)));
        cache.end = end;
        let joined = |parts: Vec<(Tensor<3>, Tensor<3>)>| {
            let (kv, gate): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
            (cat_dim1(kv), cat_dim1(gate))
        };
        let (mut entries, mut index_keys) = (None, None);
        if let Some((c, starts)) = self.compressed(tables)
            && !comp.is_empty()
        {
            cache.comp.extend(&c.pooler, joined(comp), end, starts);
            entries = cache
                .comp
                .entries
                .clone()
                .map(|e| entries_of(c, e.clone(), e));
            if let Some(idx) = &c.indexer
                && !index.is_empty()
            {
                cache.index.extend(&idx.pooler, joined(index), end, starts);
                // As in a whole forward: index keys only beside compressed entries.
                index_keys = entries.as_ref().and(cache.index.entries.clone());
            }
        }
        BlockKeys {
            k,
            start,
            entries,
            index: index_keys,
            total: end,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;
    use crate::model::weights::{RandomInit, Vb};

    /// Pooling span by span gives every entry bit for bit as pooling every window at
    /// once (overlapping CSA windows and plain HCA ones; spans that end inside a window,
    /// on a window's end, shorter than a window), and what is pending between spans never
    /// exceeds two windows' positions.
    #[test]
    fn pooling_span_by_span_gives_the_entries_of_pooling_at_once() {
        let dev = Device::flex();
        let (b, t, d_model, dim) = (2, 61, 12, 8);
        for (rate, overlap) in [(4, true), (8, false)] {
            let vb = Vb::new(&RandomInit { seed: 5 }, &dev);
            let p = Pooler::new(&vb, d_model, dim, rate, overlap, 1e-6).unwrap();
            let x: Vec<f32> = (0..b * t * d_model)
                .map(|i| ((i * 29 % 97) as f32 / 48.0) - 1.0)
                .collect();
            let x = Tensor::<3>::from_data(TensorData::new(x, [b, t, d_model]), &dev);
            let (kv, gate) = p.project(&x);
            let n = t / rate;
            let starts: Vec<usize> = (0..n).map(|w| w * rate).collect();
            let starts = RopeTables::new(&starts, &[1.0, 0.3], 1.0, &dev);
            let bits = |e: Tensor<4>| -> Vec<u32> {
                let v = e.into_data().try_to_vec::<f32>().unwrap();
                v.into_iter().map(f32::to_bits).collect()
            };
            let once = bits(
                p.pooled_from((kv.clone(), gate.clone()), 0, &starts)
                    .unwrap(),
            );
            for spans in [
                vec![t],
                vec![3, 5, 53],
                vec![rate, 2 * rate, t - 3 * rate],
                vec![1; t],
            ] {
                let mut pooled = Pooled::default();
                let mut f = 0;
                for len in spans.iter().copied() {
                    let cut = |x: &Tensor<3>| x.clone().slice_dim(1, f..f + len);
                    pooled.extend(&p, (cut(&kv), cut(&gate)), f + len, &starts);
                    f += len;
                    assert_eq!(pooled.done, f / rate);
                    let pending = pooled.pending.as_ref().map_or(0, |(k, _)| k.dims()[1]);
                    assert!(pending < 2 * rate, "{pending} positions pending");
                }
                let got = bits(pooled.entries.clone().unwrap());
                assert_eq!(got, once, "rate {rate}, spans {spans:?}");
            }
        }
    }

    /// What a layer's cache holds after many spans: the entries (and index keys) grow as
    /// [`cached_per_token`] counts, the rest (raw tail, open windows' pooler inputs) stays
    /// within the window and two windows, whatever the prompt's length.
    #[test]
    fn a_layers_cache_holds_its_entries_and_a_bounded_rest() {
        use crate::model::deepseek_v4::DeepseekV4Model;
        use crate::model::kv_state::Queries;
        let dev = Device::flex();
        let json = r#"{"model_type": "deepseek_v4", "vocab_size": 64, "hidden_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 8,
            "qk_rope_head_dim": 4, "q_lora_rank": 8, "o_groups": 2, "o_lora_rank": 4,
            "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 4,
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                            "sliding_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "sliding_window": 6, "index_n_heads": 1, "index_head_dim": 4, "index_topk": 2,
            "hc_mult": 2}"#;
        let c = DeepseekV4Config::from_json(json).unwrap();
        let m = DeepseekV4Model::new(&c, &Vb::new(&RandomInit { seed: 3 }, &dev)).unwrap();
        let (b, t, span) = (2, 203, 13);
        let tables = Tables::new(&c, &Queries::All { rows: b, len: t }, &dev);
        let x: Vec<f32> = (0..b * t * 16)
            .map(|i| ((i * 13 % 31) as f32 / 15.0) - 1.0)
            .collect();
        let x = Tensor::<3>::from_data(TensorData::new(x, [b, t, 16]), &dev);
        let mut per_token = 0.0;
        for layer in &m.model.layers {
            let attn = &layer.self_attn;
            let mut cache = SpanCache::default();
            let mut rest_max = 0;
            for s0 in (0..t).step_by(span) {
                let s1 = (s0 + span).min(t);
                let inputs = attn.key_inputs(s0, &x.clone().slice_dim(1, s0..s1), &tables);
                let keys = attn.span_keys(vec![inputs], s0, &mut cache, &tables);
                assert_eq!(keys.total, s1);
                assert_eq!(keys.start, s0.saturating_sub(c.sliding_window - 1));
                rest_max = rest_max.max(cache.held_values().1);
            }
            // Entries of every closed window: `t / rate` per row, `dim` values each (the
            // compressor's, and in CSA the indexer's).
            let (entries, _) = cache.held_values();
            let (closed, dims, rate) = attn.compressor.as_ref().map_or((0, 0, 1), |cp| {
                let dims = cp.pooler.dim + cp.indexer.as_ref().map_or(0, |i| i.pooler.dim);
                (t / cp.pooler.rate, dims, cp.pooler.rate)
            });
            assert_eq!(entries, b * closed * dims);
            per_token += dims as f64 / rate as f64;
            // The rest: the raw tail (window - 1 positions of head_dim) and at most two
            // windows of pooler inputs (kv + gate, twice the width when overlapping).
            let bound = b
                * ((c.sliding_window - 1) * c.head_dim
                    + attn.compressor.as_ref().map_or(0, |cp| {
                        let w = |p: &Pooler| 2 * p.rate * 2 * p.dim * if p.overlap { 2 } else { 1 };
                        w(&cp.pooler) + cp.indexer.as_ref().map_or(0, |i| w(&i.pooler))
                    }));
            assert!(
                rest_max <= bound,
                "{rest_max} values held beside the entries > {bound}"
            );
        }
        assert!(
            (per_token - cached_per_token(&c)).abs() < 1e-9,
            "{per_token}"
        );
    }
}
