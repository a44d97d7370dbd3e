//! Memory plan of a DeepSeek-V4 model over devices (`phaselens plan`).
//!
//! For a config (a shipped published one, a config.json, or a model directory whose
//! safetensors headers give the stored dtypes) and a sequence length, the plan counts
//! per layer:
//!
//! - **weights**, as stored (FP4 routed experts half a byte per value plus one ue8m0
//!   byte per 32 values, FP8 one byte plus one byte per 128 x 128 block, BF16 two, F32
//!   four) and as resident under the request's [`Residency`]: `stored` keeps FP4 / FP8 /
//!   BF16 matrices as stored (their bytes, scales included), `f32` dequantises every
//!   float tensor on load; integer tables are i64;
//! - **KV** at that length: the raw K = V head (`T x head_dim`) and the compressed
//!   entries (`T / rate x head_dim`, CSA's indexer keys `T / m x index_head_dim`);
//! - a **forward's working set**: the activations of one layer alive at once, per token
//!   (mHC streams, query and output heads, compressor and indexer projections, routed and
//!   shared expert intermediates), plus the logits on the device holding the head, plus
//!   one attention block's gathered keys and
//!   values ([`attention_block_bytes`]) and score scratch (times the blocks that run at
//!   once on the CPU: [`attention_blocks_held_at`]), plus (stored residency) the
//!   most dequantised at once (one matrix, at most [`DEQUANT_BUDGET`] values: larger
//!   ones are multiplied in row blocks);
//! - a **patching chunk**: the same per row, times the rows of a chunk;
//! - the **load transient**: the loader builds one tensor (f32: a layer's stacked
//!   experts; stored: one file tensor, dequantised once to check it) in host memory next
//!   to its copy in the model.
//!
//! Placement: embedding, layers in order and head are split over the devices by memory
//! (contiguous layer ranges); when the routed experts do not all fit, every device keeps
//! its layers' non-expert weights and KV, fills what is left with its layers' experts
//! (spread over its layers) and the remaining experts go to host memory. A device
//! whose non-expert part does not fit is an error naming the device and the bytes over.

use serde::Serialize;

use super::deepseek_v4::config::{AttnType, MlpType};
use super::deepseek_v4::{DeepseekV4Config, V4Checkpoint};
use super::placement::{Placement, default_host};
use super::safetensors_io::StDtype;
use super::stored::{DEQUANT_BUDGET, Residency};
use crate::device::DeviceSpec;
use crate::error::{Error, Result};

/// How a tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    F32,
    Bf16,
    /// e4m3 + ue8m0 scales per 128 x 128 block.
    Fp8,
    /// e2m1, two per byte, + ue8m0 scales per row and 32 columns.
    Fp4,
    /// An integer table (`tid2eid`), 4 bytes stored, i64 resident.
    Int,
}

/// Values and bytes of a group of tensors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Bytes {
    /// Number of values (elements of the dequantised tensors).
    pub values: f64,
    /// Bytes as stored in the checkpoint (scales included).
    pub stored: f64,
    /// Bytes resident once loaded (stored residency: FP4 / FP8 / BF16 matrices as
    /// stored; f32: f32 floats, no scales; i64 integers).
    pub resident: f64,
}

impl Bytes {
    /// One `rows x cols` tensor stored as `how`, loaded with `residency`.
    pub fn tensor(rows: usize, cols: usize, how: Stored, residency: Residency) -> Self {
        let (r, c) = (rows as f64, cols as f64);
        let values = r * c;
        let stored = match how {
            Stored::F32 | Stored::Int => 4.0 * values,
            Stored::Bf16 => 2.0 * values,
            Stored::Fp8 => values + (r / 128.0).ceil() * (c / 128.0).ceil(),
            Stored::Fp4 => values / 2.0 + r * (c / 32.0).ceil(),
        };
        let kept = residency == Residency::Stored
            && cols > 1
            && matches!(how, Stored::Bf16 | Stored::Fp8 | Stored::Fp4);
        let resident = match how {
            _ if kept => stored,
            Stored::Int => 8.0 * values,
            _ => 4.0 * values,
        };
        Bytes {
            values,
            stored,
            resident,
        }
    }

    pub fn add(&mut self, o: Bytes) {
        self.values += o.values;
        self.stored += o.stored;
        self.resident += o.resident;
    }

    pub fn times(self, k: f64) -> Bytes {
        Bytes {
            values: self.values * k,
            stored: self.stored * k,
            resident: self.resident * k,
        }
    }
}

/// The weights of one decoder layer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerWeights {
    /// Everything but the routed experts (attention, compressor, indexer, norms, mHC,
    /// router, shared expert, `tid2eid`).
    pub dense: Bytes,
    /// ONE routed expert (w1, w2, w3).
    pub expert: Bytes,
    pub n_experts: usize,
    /// The largest single resident tensor the loader builds for this layer.
    pub largest_resident: f64,
}

/// The weights of a model, layer by layer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelWeights {
    /// Embedding (device of the first layer).
    pub embed: Bytes,
    /// Head, final norm, `hc_head` (device of the last layer).
    pub head: Bytes,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    pub fn total(&self) -> Bytes {
        let mut t = self.embed;
        t.add(self.head);
        for l in &self.layers {
            t.add(l.dense);
            t.add(l.expert.times(l.n_experts as f64));
        }
        t
    }
}

/// Weights of `c` stored the way DeepSeek's releases store them: attention projections,
/// the indexer's `wq_b` and the shared expert FP8; routed experts `experts` (FP4 when the
/// config says `expert_dtype = "fp4"`, else FP8); embedding, head, router, compressor
/// and indexer-compressor projections, `weights_proj` BF16; the rest F32.
pub fn weights_from_config(
    c: &DeepseekV4Config,
    experts: Stored,
    residency: Residency,
) -> ModelWeights {
    let (h, n, v) = (c.hidden_size, c.hc_mult, c.vocab_size);
    let t = |r, cc, how| Bytes::tensor(r, cc, how, residency);
    let embed = t(v, h, Stored::Bf16);
    let mut head = t(h, 1, Stored::F32);
    head.add(t(n, n * h, Stored::F32));
    head.add(t(n + 1, 1, Stored::F32));
    if !c.tie_word_embeddings {
        head.add(t(v, h, Stored::Bf16));
    }
    let layers = (0..c.num_hidden_layers)
        .map(|l| layer_from_config(c, l, experts, residency))
        .collect();
    ModelWeights {
        embed,
        head,
        layers,
    }
}

fn attention_from_config(c: &DeepseekV4Config, t: AttnType, residency: Residency) -> Bytes {
    let (h, d, nh, q) = (
        c.hidden_size,
        c.head_dim,
        c.num_attention_heads,
        c.q_lora_rank,
    );
    let (og, olr) = (c.o_groups, c.o_lora_rank);
    let (di, hi) = (c.index_head_dim, c.index_n_heads);
    let mut b = Bytes::default();
    let mut add = |r, cc, how| b.add(Bytes::tensor(r, cc, how, residency));
    add(q, h, Stored::Fp8);
    add(q, 1, Stored::F32);
    add(nh * d, q, Stored::Fp8);
    add(d, h, Stored::Fp8);
    add(d, 1, Stored::F32);
    add(og * olr, nh * d / og.max(1), Stored::Fp8);
    add(h, og * olr, Stored::Fp8);
    add(nh, 1, Stored::F32);
    match t {
        AttnType::Sliding => {}
        AttnType::Hca => {
            add(2 * d, h, Stored::Bf16);
            add(c.hca_rate, d, Stored::F32);
            add(d, 1, Stored::F32);
        }
        AttnType::Csa => {
            add(4 * d, h, Stored::Bf16);
            add(c.csa_rate, 2 * d, Stored::F32);
            add(d, 1, Stored::F32);
            add(4 * di, h, Stored::Bf16);
            add(c.csa_rate, 2 * di, Stored::F32);
            add(di, 1, Stored::F32);
            add(hi * di, q, Stored::Fp8);
            add(hi, h, Stored::Bf16);
        }
    }
    b
}

fn layer_from_config(
    c: &DeepseekV4Config,
    l: usize,
    experts: Stored,
    residency: Residency,
) -> LayerWeights {
    let (h, n, e, i) = (
        c.hidden_size,
        c.hc_mult,
        c.n_routed_experts,
        c.moe_intermediate_size,
    );
    let mut dense = attention_from_config(c, c.layer_types[l], residency);
    let mut add = |r, cc, how| dense.add(Bytes::tensor(r, cc, how, residency));
    add(2 * h, 1, Stored::F32);
    for _ in 0..2 {
        add((2 + n) * n, n * h, Stored::F32);
        add((2 + n) * n + 3, 1, Stored::F32);
    }
    add(e, h, Stored::Bf16);
    add(2 * i, h, Stored::Fp8);
    add(h, i, Stored::Fp8);
    if c.mlp_bias {
        add(2 * i + h, 1, Stored::F32);
    }
    match c.mlp_layer_types[l] {
        MlpType::Moe => add(e, 1, Stored::F32),
        MlpType::HashMoe => add(c.vocab_size, c.num_experts_per_tok, Stored::Int),
    }
    let mut expert = Bytes::tensor(2 * i, h, experts, residency);
    expert.add(Bytes::tensor(h, i, experts, residency));
    // f32: the stacked experts the loader assembles; stored: one matrix dequantised
    let experts_built = match residency {
        Residency::F32 => e,
        Residency::Stored => 1,
    };
    let largest = [
        4.0 * (experts_built * 2 * i * h) as f64,
        4.0 * (c.num_attention_heads * c.head_dim * c.q_lora_rank) as f64,
    ];
    LayerWeights {
        dense,
        expert,
        n_experts: e,
        largest_resident: largest.into_iter().fold(0.0, f64::max),
    }
}

/// Weights of the checkpoint `dir` as its safetensors headers store them (nothing is
/// read but the headers), resident as `residency` loads them. Routed experts stored
/// stacked (`mlp.experts.gate_up_proj`) are split evenly over `n_routed_experts`;
/// `mtp.*` is skipped.
pub fn weights_from_checkpoint(
    dir: &std::path::Path,
    c: &DeepseekV4Config,
    residency: Residency,
) -> Result<ModelWeights> {
    use super::deepseek_v4::checkpoint::{FileKey, canonical_name};
    let ck = V4Checkpoint::open_dir(dir, c.fp8_block)?;
    let r = ck.reader();
    let mut w = ModelWeights {
        layers: vec![LayerWeights::default(); c.num_hidden_layers],
        ..Default::default()
    };
    let names: Vec<String> = r.names().map(str::to_string).collect();
    for key in &names {
        let e = r.entry(key).expect("listed tensor");
        let scale_of = key
            .strip_suffix(".scale")
            .or_else(|| key.strip_suffix(".weight_scale_inv"))
            .map(|b| format!("{b}.weight"))
            .filter(|w| r.entry(w).is_some());
        let target = scale_of.clone().unwrap_or_else(|| key.clone());
        let b = file_tensor_bytes(e, scale_of.is_some(), has_scale(r, key), residency);
        match canonical_name(&target) {
            FileKey::Ignored => {}
            FileKey::Expert { layer, .. } => add_expert(&mut w, c, layer, b)?,
            FileKey::Module(m) => add_module(&mut w, c, &m, b)?,
        }
    }
    // f32: the stacked gate_up tensor (w1 and w3 of every expert); stored: one expert's
    let built = match residency {
        Residency::F32 => c.n_routed_experts as f64,
        Residency::Stored => 1.0,
    };
    for lw in w.layers.iter_mut() {
        lw.n_experts = c.n_routed_experts;
        lw.expert = lw.expert.times(1.0 / c.n_routed_experts.max(1) as f64);
        let gate_up = 4.0 * lw.expert.values * built * 2.0 / 3.0;
        lw.largest_resident = lw.largest_resident.max(gate_up);
    }
    Ok(w)
}

/// Bytes of one file tensor `e` (a block-scale tensor when `is_scale`; `scaled` when
/// it has one): FP8 / FP4 weights, their scales and BF16 / F16 matrices are resident as
/// stored under [`Residency::Stored`] (as the loader keeps them); otherwise floats are
/// f32 (scales dropped), integers i64.
fn file_tensor_bytes(
    e: &super::safetensors_io::TensorEntry,
    is_scale: bool,
    scaled: bool,
    residency: Residency,
) -> Bytes {
    let values = e.shape.iter().product::<usize>() as f64;
    let stored = e.len as f64;
    let packed = matches!(e.dtype, StDtype::I8 | StDtype::U8) && scaled;
    let kept = residency == Residency::Stored
        && (is_scale
            || scaled
            || (matches!(e.dtype, StDtype::BF16 | StDtype::F16) && e.shape.len() == 2));
    let values = if is_scale {
        0.0
    } else if packed {
        2.0 * values
    } else {
        values
    };
    let resident = if kept {
        stored
    } else if is_scale {
        0.0
    } else if e.dtype.is_float() || packed {
        4.0 * values
    } else {
        8.0 * values
    };
    Bytes {
        values,
        stored,
        resident,
    }
}

fn has_scale(r: &super::safetensors_io::SafetensorsReader, key: &str) -> bool {
    key.strip_suffix(".weight").is_some_and(|b| {
        r.entry(&format!("{b}.scale")).is_some()
            || r.entry(&format!("{b}.weight_scale_inv")).is_some()
    })
}

fn layer_of(m: &str) -> Option<usize> {
    m.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn add_expert(w: &mut ModelWeights, c: &DeepseekV4Config, layer: usize, b: Bytes) -> Result<()> {
    let lw = w.layers.get_mut(layer).ok_or_else(|| {
        Error::field(
            "num_hidden_layers",
            format!(
                "the checkpoint has routed experts of layer {layer}, the config {} layers",
                c.num_hidden_layers
            ),
        )
    })?;
    lw.expert.add(b);
    Ok(())
}

fn add_module(w: &mut ModelWeights, c: &DeepseekV4Config, m: &str, b: Bytes) -> Result<()> {
    let Some(layer) = layer_of(m) else {
        if m.contains("embed_tokens") {
            w.embed.add(b);
        } else {
            w.head.add(b);
        }
        return Ok(());
    };
    if m.contains(".mlp.experts.") {
        return add_expert(w, c, layer, b);
    }
    let lw = w.layers.get_mut(layer).ok_or_else(|| {
        Error::field(
            "num_hidden_layers",
            format!(
                "the checkpoint has `{m}`, the config {} layers",
                c.num_hidden_layers
            ),
        )
    })?;
    lw.dense.add(b);
    lw.largest_resident = lw.largest_resident.max(4.0 * b.values);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Activations

/// Bytes of keys and values one attention block of layer `l` gathers, for `rows` rows
/// of `t` tokens at shared positions (a forward). The blocked attention sizes a block
/// by its score elements ([`crate::model::attention::rows_within_budget`]); each query
/// of the block gathers its own `min(window, t)` raw keys and, in a CSA layer, its
/// `index_topk` selected entries, each `head_dim` wide: the selected keys and values
/// together, then the selected values with the raw keys, then with the raw values (the
/// raw keys are freed once scored). With head_dim 512 this, not the scores, is most of
/// a block: 256 KiB per query for a window of 128, and a sliding layer's block holds up
/// to 2000 queries at 4 heads.
pub fn attention_block_bytes(c: &DeepseekV4Config, l: usize, t: usize, rows: usize) -> f64 {
    attention_block_at(c, l, t, t, rows).gathered
}

/// One attention block of a layer, as the blocked attention sizes it.
struct BlockAt {
    /// Query rows.
    queries: usize,
    /// Bytes of the keys and values it gathers.
    gathered: f64,
    /// Bytes of its score scratch (scores, exponentials, probabilities: f32): at most
    /// the budget's, less for a short prompt's block.
    scratch: f64,
}

/// Query rows per attention block of layer `l` and that block's gathered keys' bytes
/// ([`attention_block_bytes`]) when each row computes `queries` of its `t` positions (a
/// suffix forward: fewer than `t`).
fn attention_block_at(
    c: &DeepseekV4Config,
    l: usize,
    t: usize,
    queries: usize,
    rows: usize,
) -> BlockAt {
    let (nh, d) = (c.num_attention_heads, c.head_dim);
    let w = c.sliding_window.min(t);
    let (n, selecting, kk) = match c.layer_types[l] {
        AttnType::Sliding => (0, 0, 0),
        AttnType::Hca => (t / c.hca_rate.max(1), 0, 0),
        AttnType::Csa => {
            let n = t / c.csa_rate.max(1);
            (n, c.index_n_heads * n, c.index_topk.min(n))
        }
    };
    let entries = if selecting > 0 { kk } else { n };
    let scores = |bq: usize| rows * bq * (nh * (entries + w + 1) + selecting);
    let bq = crate::model::attention::rows_within_budget(queries.min(t), scores);
    let per_query = (2 * kk).max(kk + w) * d;
    let budget = crate::model::attention::block_budget();
    BlockAt {
        queries: bq,
        gathered: 4.0 * (rows * bq * per_query) as f64,
        scratch: crate::model::attention::scratch_bytes(scores(bq).min(budget)),
    }
}

/// Bytes the attention blocks of layer `l` hold at once when each of `rows` rows
/// computes `queries` of its `t` positions (see [`attention_block_bytes`]): one block's gathered keys and score scratch, times the
/// blocks that run at once on the CPU ([`crate::model::attention::concurrent_width`]:
/// small blocks on every thread of the pool).
pub fn attention_blocks_held_at(
    c: &DeepseekV4Config,
    l: usize,
    t: usize,
    queries: usize,
    rows: usize,
) -> f64 {
    let block = attention_block_at(c, l, t, queries, rows);
    let one = block.gathered + block.scratch;
    let blocks = queries.min(t).max(1).div_ceil(block.queries.max(1));
    crate::model::attention::concurrent_width(blocks, one) as f64 * one
}

/// KV of layer `l` for one row of `t` tokens in f32: (raw K = V head, compressed
/// entries incl. CSA's indexer keys).
pub fn layer_kv(c: &DeepseekV4Config, l: usize, t: usize) -> (f64, f64) {
    let (t, d, di) = (t as f64, c.head_dim as f64, c.index_head_dim as f64);
    let compressed = match c.layer_types[l] {
        AttnType::Sliding => 0.0,
        AttnType::Hca => (t / c.hca_rate as f64).floor() * d,
        AttnType::Csa => (t / c.csa_rate as f64).floor() * (d + di),
    };
    (4.0 * t * d, 4.0 * compressed)
}

/// Bytes per token of the activations of layer `l` alive at once in a forward (f32):
/// the mHC streams (in and out: on flex the mix replaces a layer's streams in place;
/// other backends also hold the mixed streams for a moment, not counted) and the layer
/// input / output, plus the larger of the
/// attention phase (low-rank and full query, the attention output heads, the K = V head,
/// the grouped output projection, compressor and indexer projections) and the MoE phase
/// (router scores, the intermediates of the k routed experts and the shared expert).
pub fn layer_activation_per_token(c: &DeepseekV4Config, l: usize) -> f64 {
    let f = |x: usize| x as f64;
    let (h, n, d, nh) = (
        f(c.hidden_size),
        f(c.hc_mult),
        f(c.head_dim),
        f(c.num_attention_heads),
    );
    let (di, hi, i, k) = (
        f(c.index_head_dim),
        f(c.index_n_heads),
        f(c.moe_intermediate_size),
        f(c.num_experts_per_tok),
    );
    let compressor = match c.layer_types[l] {
        AttnType::Sliding => 0.0,
        AttnType::Hca => 2.0 * d,
        AttnType::Csa => 4.0 * d + 4.0 * di + hi * di + hi,
    };
    let attention =
        f(c.q_lora_rank) + 2.0 * nh * d + d + f(c.o_groups * c.o_lora_rank) + compressor;
    let moe = f(c.n_routed_experts) + 3.0 * k * i + 3.0 * i;
    4.0 * (2.0 * n * h + 2.0 * h + attention.max(moe))
}

// ---------------------------------------------------------------------------------------
// Placement

/// What to plan for.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRequest {
    pub devices: usize,
    /// Bytes of memory per device.
    pub device_memory: f64,
    /// Bytes of host memory for offloaded experts (unchecked when absent).
    pub host_memory: Option<f64>,
    /// Tokens per row (the sequence length).
    pub tokens: usize,
    /// Rows of one patching chunk (`[experiment] max_rows`; 1 = one forward).
    pub chunk_rows: usize,
    /// Positions each chunk row recomputes when the experiment's cells run as suffix
    /// forwards (edits at the answer or final positions: `Experiment::suffix_positions`
    /// in the runner); `None`: every position (edits everywhere, or no experiment).
    pub chunk_positions: Option<usize>,
    /// How the weights are held (the weights' `resident` bytes must be counted so too:
    /// [`weights_from_config`], [`weights_from_checkpoint`]).
    pub residency: Residency,
}

/// One device of a plan (bytes resident in this build unless said otherwise).
#[derive(Debug, Clone, Serialize)]
pub struct DevicePlan {
    pub device: usize,
    /// Layers `first..end` (empty when the device holds none).
    pub first_layer: usize,
    pub end_layer: usize,
    pub holds_embedding: bool,
    pub holds_head: bool,
    /// Routed experts on this device / of its layers.
    pub experts_here: usize,
    pub experts_of_layers: usize,
    /// Experts on the device per layer (the placement).
    pub experts_per_layer: Vec<usize>,
    pub weights_stored: f64,
    pub weights_resident: f64,
    /// KV of one row at the plan's length: raw and compressed.
    pub kv_raw: f64,
    pub kv_compressed: f64,
    /// One forward over one row (largest layer + logits where the head is + scratch +,
    /// stored residency, the largest matrix dequantised at once).
    pub forward_working_set: f64,
    /// One patching chunk of `chunk_rows` rows (activations and their KV).
    pub chunk_working_set: f64,
    pub load_transient: f64,
    /// weights + max(load transient, KV + chunk working set).
    pub total: f64,
    pub capacity: f64,
}

/// A placement that fits.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub request: PlanRequest,
    pub weights: Bytes,
    pub devices: Vec<DevicePlan>,
    pub host_experts: usize,
    pub host_bytes_resident: f64,
    pub host_bytes_stored: f64,
    /// Bytes of one row of a chunk (to size `max_rows`).
    pub chunk_bytes_per_row: f64,
}

struct Ctx<'a> {
    c: &'a DeepseekV4Config,
    w: &'a ModelWeights,
    r: &'a PlanRequest,
}

impl Ctx<'_> {
    /// `rows` rows' activations on a device holding `layers` (and the head: logits),
    /// each row computing `queries` of its positions: per token, plus one attention
    /// block's gathered keys and its score scratch.
    fn working_set(
        &self,
        layers: std::ops::Range<usize>,
        head: bool,
        rows: usize,
        queries: usize,
    ) -> f64 {
        let t = queries as f64 * rows as f64;
        let per_token = layers
            .clone()
            .map(|l| layer_activation_per_token(self.c, l))
            .fold(0.0, f64::max);
        let blocks = layers
            .map(|l| attention_blocks_held_at(self.c, l, self.r.tokens, queries, rows))
            .fold(0.0, f64::max);
        t * (per_token + self.logits_per_token(head)) + blocks
    }

    /// The K/V a chunk row holds on a device with `layers`: every layer's at full
    /// length, or for a suffix chunk one layer's at a time (DeepSeek-V4's suffix forward
    /// gathers a layer's pooled entries from the base run's state for its rows, and its
    /// raw keys from the first query's window on, then frees them): the largest
    /// [`Ctx::suffix_kv`].
    fn chunk_kv_per_row(&self, layers: std::ops::Range<usize>) -> f64 {
        match self.r.chunk_positions {
            None => {
                let (raw, compressed) = self.kv(layers);
                raw + compressed
            }
            Some(_) => layers.map(|l| self.suffix_kv(l)).fold(0.0, f64::max),
        }
    }

    /// Layer `l`'s K/V that one suffix-chunk row gathers: the raw window its queries
    /// read and every compressed entry.
    fn suffix_kv(&self, l: usize) -> f64 {
        let t = self.r.tokens.max(1);
        let (raw, compressed) = layer_kv(self.c, l, t);
        let seen = (self.c.sliding_window + self.chunk_queries()).min(t);
        raw * seen as f64 / t as f64 + compressed
    }

    /// Positions each chunk row computes: [`PlanRequest::chunk_positions`] or every one.
    fn chunk_queries(&self) -> usize {
        self.r
            .chunk_positions
            .map_or(self.r.tokens, |p| p.clamp(1, self.r.tokens.max(1)))
    }

    /// Logit bytes per token on the device holding the head (`head`): one `vocab` row
    /// of f32 (a stored head's row blocks write into it).
    fn logits_per_token(&self, head: bool) -> f64 {
        if head {
            4.0 * self.c.vocab_size as f64
        } else {
            0.0
        }
    }

    fn kv(&self, layers: std::ops::Range<usize>) -> (f64, f64) {
        layers.fold((0.0, 0.0), |(a, b), l| {
            let (x, y) = layer_kv(self.c, l, self.r.tokens);
            (a + x, b + y)
        })
    }

    /// The device holding `layers` with `experts[l - first]` experts of each.
    fn device(&self, d: usize, layers: std::ops::Range<usize>, experts: &[usize]) -> DevicePlan {
        let n = self.w.layers.len();
        let (emb, head) = (d == 0, !layers.is_empty() && layers.end == n);
        let mut wt = Bytes::default();
        let mut lt: f64 = 0.0;
        for (j, l) in layers.clone().enumerate() {
            let lw = &self.w.layers[l];
            wt.add(lw.dense);
            wt.add(lw.expert.times(experts[j] as f64));
            lt = lt.max(lw.largest_resident);
        }
        if emb {
            wt.add(self.w.embed);
        }
        if head {
            wt.add(self.w.head);
        }
        let (kv_raw, kv_compressed) = self.kv(layers.clone());
        let rows = self.r.chunk_rows.max(1);
        let dq = self.dequant(lt, head);
        let forward = self.working_set(layers.clone(), head, 1, self.r.tokens) + dq;
        let chunk = self.working_set(layers.clone(), head, rows, self.chunk_queries()) + dq;
        let kv_rows = self.chunk_kv_per_row(layers.clone()) * rows as f64;
        // A suffix chunk may hold less than the one-row forward (the base run's block).
        let run = (kv_rows + chunk).max(kv_raw + kv_compressed + forward);
        DevicePlan {
            device: d,
            first_layer: layers.start,
            end_layer: layers.end,
            holds_embedding: emb,
            holds_head: head,
            experts_here: experts.iter().sum(),
            experts_of_layers: layers.clone().map(|l| self.w.layers[l].n_experts).sum(),
            experts_per_layer: experts.to_vec(),
            weights_stored: wt.stored,
            weights_resident: wt.resident,
            kv_raw,
            kv_compressed,
            forward_working_set: forward,
            chunk_working_set: chunk,
            load_transient: 2.0 * lt,
            total: wt.resident + (2.0 * lt).max(run),
            capacity: self.r.device_memory,
        }
    }
}

/// Running totals of a device while layers are added (so a split is linear in the
/// number of layers).
#[derive(Default, Clone, Copy)]
struct Running {
    weights: f64,
    /// K/V of one row at full length; the largest layer's of a suffix-chunk row.
    kv: f64,
    suffix_kv: f64,
    per_token: f64,
    /// The most a layer's attention blocks hold at once ([`attention_blocks_held_at`]:
    /// gathered keys and score scratch) in a chunk, and in a one-row forward.
    block: f64,
    block_one: f64,
    /// The largest tensor built at once (load: twice it).
    largest: f64,
}

impl Ctx<'_> {
    /// The most a forward dequantises at once on a device whose layers' largest matrix
    /// is `lt` (and the head's, where it is): 0 for f32 residency; stored matrices are
    /// multiplied in row blocks of at most [`DEQUANT_BUDGET`] values.
    fn dequant(&self, lt: f64, head: bool) -> f64 {
        let cap = 4.0 * DEQUANT_BUDGET as f64;
        match self.r.residency {
            Residency::F32 => 0.0,
            Residency::Stored if head => lt.max(4.0 * self.w.head.values).min(cap),
            Residency::Stored => lt.min(cap),
        }
    }

    fn with_layer(&self, mut r: Running, l: usize, experts: usize) -> Running {
        let lw = &self.w.layers[l];
        r.weights += lw.dense.resident + lw.expert.resident * experts as f64;
        let (a, b) = layer_kv(self.c, l, self.r.tokens);
        r.kv += a + b;
        r.suffix_kv = r.suffix_kv.max(self.suffix_kv(l));
        r.per_token = r.per_token.max(layer_activation_per_token(self.c, l));
        let rows = self.r.chunk_rows.max(1);
        let (t, q) = (self.r.tokens, self.chunk_queries());
        r.block = r.block.max(attention_blocks_held_at(self.c, l, t, q, rows));
        r.block_one = r
            .block_one
            .max(attention_blocks_held_at(self.c, l, t, t, 1));
        r.largest = r.largest.max(lw.largest_resident);
        r
    }

    /// The total of [`Ctx::device`] from running totals.
    fn total(&self, r: Running, first: bool, head: bool) -> f64 {
        let rows = self.r.chunk_rows.max(1) as f64;
        let t = self.chunk_queries() as f64 * rows;
        let logits = self.logits_per_token(head);
        let mut w = r.weights;
        if first {
            w += self.w.embed.resident;
        }
        if head {
            w += self.w.head.resident;
        }
        let dq = self.dequant(r.largest, head);
        let ws = t * (r.per_token + logits) + r.block + dq;
        let one = self.r.tokens as f64 * (r.per_token + logits) + r.block_one + dq;
        let per_row = match self.r.chunk_positions {
            None => r.kv,
            Some(_) => r.suffix_kv,
        };
        let kv_rows = per_row * rows;
        w + (2.0 * r.largest).max(kv_rows + ws).max(r.kv + one)
    }
}

/// Split layers over the devices in order, each device taking layers while its total
/// (with `experts(l)` experts of layer `l`) fits. With `force`, a device takes at least
/// one layer and the last device takes every layer left (for naming the overflow).
/// `None` when layers are left over.
fn greedy(
    x: &Ctx,
    experts: &dyn Fn(usize) -> usize,
    force: bool,
) -> Option<Vec<std::ops::Range<usize>>> {
    let n = x.w.layers.len();
    let mut out = Vec::new();
    let mut start = 0;
    for d in 0..x.r.devices {
        let last = d + 1 == x.r.devices;
        let mut end = start;
        let mut run = Running::default();
        while end < n {
            let next = x.with_layer(run, end, experts(end));
            let take = (force && (last || end == start))
                || x.total(next, d == 0, end + 1 == n) <= x.r.device_memory;
            if !take {
                break;
            }
            run = next;
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    (start == n).then_some(out)
}

/// Contiguous layer ranges of (nearly) equal length, one per device.
fn even_split(n: usize, devices: usize) -> Vec<std::ops::Range<usize>> {
    (0..devices)
        .map(|d| d * n / devices..(d + 1) * n / devices)
        .collect()
}

/// Fill what `layers` leave free on device `d` with their experts, spread evenly.
fn fill_experts(x: &Ctx, d: usize, layers: std::ops::Range<usize>) -> Vec<usize> {
    let len = layers.len();
    let mut ex = vec![0usize; len];
    if len == 0 {
        return ex;
    }
    let mut left = x.r.device_memory - x.device(d, layers.clone(), &ex).total;
    // whole rounds of one expert per layer first (the loop below then adds the last few)
    let round: f64 = layers.clone().map(|l| x.w.layers[l].expert.resident).sum();
    if round > 0.0 {
        let most = layers
            .clone()
            .map(|l| x.w.layers[l].n_experts)
            .max()
            .unwrap_or(0);
        let rounds = ((left / round).floor() as usize).min(most);
        for (j, l) in layers.clone().enumerate() {
            ex[j] = rounds.min(x.w.layers[l].n_experts);
            left -= x.w.layers[l].expert.resident * ex[j] as f64;
        }
    }
    let mut progress = true;
    while progress {
        progress = false;
        for (j, l) in layers.clone().enumerate() {
            let lw = &x.w.layers[l];
            if ex[j] < lw.n_experts && lw.expert.resident <= left {
                ex[j] += 1;
                left -= lw.expert.resident;
                progress = true;
            }
        }
    }
    ex
}

/// The error for a device whose non-expert part does not fit.
fn over_error(p: &DevicePlan) -> Error {
    let gib = super::memory::human;
    Error::Memory(format!(
        "the placement does not fit: device {} ({} of memory) would need {} for layers {}..{} with no routed experts (weights {}, KV {} + {} per row at full length, a patching chunk's working set {}, load transient {}): {} ({:.0} bytes) over; add devices or memory, or lower --tokens",
        p.device,
        gib(p.capacity),
        gib(p.total),
        p.first_layer,
        p.end_layer,
        gib(p.weights_resident),
        gib(p.kv_raw),
        gib(p.kv_compressed),
        gib(p.chunk_working_set),
        gib(p.load_transient),
        gib(p.total - p.capacity),
        p.total - p.capacity
    ))
}

/// Place `w` (weights of config `c`) as `r` asks; an error when it cannot fit.
pub fn plan(c: &DeepseekV4Config, w: &ModelWeights, r: &PlanRequest) -> Result<Plan> {
    if r.devices == 0 {
        return Err(Error::field("--devices", "at least one device is needed"));
    }
    let x = Ctx { c, w, r };
    let all = |l: usize| w.layers[l].n_experts;
    let devices: Vec<DevicePlan> = match greedy(&x, &all, false) {
        Some(ranges) => ranges
            .into_iter()
            .enumerate()
            .map(|(d, rg)| {
                let ex: Vec<usize> = rg.clone().map(all).collect();
                x.device(d, rg, &ex)
            })
            .collect(),
        None => offload_experts(&x)?,
    };
    let mut host = Bytes::default();
    let mut host_experts = 0;
    for p in &devices {
        for (j, l) in (p.first_layer..p.end_layer).enumerate() {
            let k = w.layers[l].n_experts - p.experts_per_layer[j];
            host_experts += k;
            host.add(w.layers[l].expert.times(k as f64));
        }
    }
    if let Some(cap) = r.host_memory
        && host.resident > cap
    {
        return Err(Error::Memory(format!(
            "the placement does not fit: host memory ({}) would hold {host_experts} routed experts of {}: {} ({:.0} bytes) over; add devices or host memory",
            super::memory::human(cap),
            super::memory::human(host.resident),
            super::memory::human(host.resident - cap),
            host.resident - cap
        )));
    }
    let per_token = (0..w.layers.len())
        .map(|l| layer_activation_per_token(c, l))
        .fold(0.0, f64::max);
    let per_row = x.chunk_queries() as f64 * (per_token + x.logits_per_token(true))
        + x.chunk_kv_per_row(0..w.layers.len());
    Ok(Plan {
        request: r.clone(),
        weights: w.total(),
        devices,
        host_experts,
        host_bytes_resident: host.resident,
        host_bytes_stored: host.stored,
        chunk_bytes_per_row: per_row,
    })
}

/// Routed experts do not all fit: non-expert parts split (evenly, else by memory), then
/// every device filled with its layers' experts; the rest to the host.
fn offload_experts(x: &Ctx) -> Result<Vec<DevicePlan>> {
    let n = x.w.layers.len();
    let none = |_: usize| 0usize;
    let fits = |rs: &[std::ops::Range<usize>]| {
        rs.iter()
            .enumerate()
            .all(|(d, rg)| x.device(d, rg.clone(), &vec![0; rg.len()]).total <= x.r.device_memory)
    };
    let even = even_split(n, x.r.devices);
    let ranges = if fits(&even) {
        even
    } else if let Some(g) = greedy(x, &none, false) {
        g
    } else {
        // Name the device that overflows when the layers fill the devices in order and
        // the last one takes what is left.
        let g = greedy(x, &none, true).unwrap_or_default();
        let worst = g
            .iter()
            .enumerate()
            .map(|(d, rg)| x.device(d, rg.clone(), &vec![0; rg.len()]))
            .find(|p| p.total > p.capacity);
        return Err(match worst {
            Some(p) => over_error(&p),
            None => Error::Memory("the placement does not fit on the devices".into()),
        });
    };
    Ok(ranges
        .into_iter()
        .enumerate()
        .map(|(d, rg)| {
            let ex = fill_experts(x, d, rg.clone());
            x.device(d, rg, &ex)
        })
        .collect())
}

impl Plan {
    /// This plan as a [`Placement`] over `devices` (plan device `d` is `devices[d]`);
    /// when experts go to the host, every layer keeps the plan's count on its device
    /// and the rest on the host.
    pub fn placement(&self, devices: Vec<DeviceSpec>) -> Result<Placement> {
        if self.devices.len() != devices.len() {
            return Err(Error::field(
                "--devices",
                format!(
                    "the plan is for {} devices, {} named",
                    self.devices.len(),
                    devices.len()
                ),
            ));
        }
        let n = self.devices.iter().map(|p| p.end_layer).max().unwrap_or(0);
        let mut layers = vec![0usize; n];
        let mut experts = vec![None; n];
        for p in &self.devices {
            for (j, l) in (p.first_layer..p.end_layer).enumerate() {
                layers[l] = p.device;
                if self.host_experts > 0 {
                    experts[l] = Some(p.experts_per_layer[j]);
                }
            }
        }
        Ok(Placement {
            host: default_host(&devices),
            devices,
            layers,
            experts_on_device: experts,
        })
    }
}

pub use super::memory::parse_bytes;

// ---------------------------------------------------------------------------------------
// Configs

/// The published configs shipped with phaselens (release-style config.json values).
pub const PUBLISHED: &[(&str, &str)] = &[
    (
        "v4-flash",
        include_str!("deepseek_v4/published/v4-flash.json"),
    ),
    ("v4-pro", include_str!("deepseek_v4/published/v4-pro.json")),
];

/// Keys `plan` needs in a config (a missing one would silently take V4-Flash's default).
pub const REQUIRED_KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "index_n_heads",
    "index_head_dim",
    "hc_mult",
];

/// Parse a config for planning: every [`REQUIRED_KEYS`] present, and a layer schedule
/// (`layer_types` or `compress_ratios`). `origin` names it in errors. Returns the config
/// and how its routed experts are stored (`expert_dtype`, top level or in
/// `quantization_config`: `fp4` -> FP4, else FP8 when quantised, BF16 otherwise).
pub fn config_for_plan(origin: &str, text: &str) -> Result<(DeepseekV4Config, Stored)> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Config {
        path: origin.into(),
        message: format!("cannot parse: {e}"),
    })?;
    let missing = |k: &str| v.get(k).is_none_or(|x| x.is_null());
    let mut absent: Vec<&str> = REQUIRED_KEYS
        .iter()
        .copied()
        .filter(|k| missing(k))
        .collect();
    if missing("layer_types") && missing("compress_ratios") {
        absent.push("layer_types (or compress_ratios)");
    }
    if !absent.is_empty() {
        return Err(Error::Config {
            path: origin.into(),
            message: format!(
                "missing key(s) {}: a plan needs every size of the model (a missing one is not defaulted)",
                absent.join(", ")
            ),
        });
    }
    let c = DeepseekV4Config::from_json(text).map_err(|e| Error::Config {
        path: origin.into(),
        message: e.to_string(),
    })?;
    let q = v.get("quantization_config");
    let dtype = v
        .get("expert_dtype")
        .or_else(|| q.and_then(|q| q.get("expert_dtype")))
        .and_then(|x| x.as_str());
    let experts = match dtype {
        Some("fp4") => Stored::Fp4,
        Some("fp8") => Stored::Fp8,
        Some("bf16") | Some("bfloat16") => Stored::Bf16,
        Some(other) => {
            return Err(Error::Config {
                path: origin.into(),
                message: format!("expert_dtype = \"{other}\": expected fp4, fp8 or bf16"),
            });
        }
        None if q.is_some() => Stored::Fp8,
        None => Stored::Bf16,
    };
    Ok((c, experts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published(name: &str) -> (DeepseekV4Config, Stored) {
        let text = PUBLISHED.iter().find(|(n, _)| *n == name).unwrap().1;
        config_for_plan(name, text).unwrap()
    }

    #[test]
    fn config_counts_match_the_model_and_the_published_sizes() {
        for (name, billions) in [("v4-flash", 284.0), ("v4-pro", 1600.0)] {
            let (c, ex) = published(name);
            assert_eq!(ex, Stored::Fp4);
            let w = weights_from_config(&c, ex, Residency::F32);
            let ints: f64 = (0..c.num_hidden_layers)
                .filter(|&l| c.mlp_layer_types[l] == MlpType::HashMoe)
                .map(|_| (c.vocab_size * c.num_experts_per_tok) as f64)
                .sum();
            let t = w.total();
            assert!((t.values - ints - c.n_params_f64()).abs() < 1.0, "{name}");
            let b = t.values / 1e9;
            assert!(
                (b / billions - 1.0).abs() < 0.05,
                "{name}: {b} B parameters"
            );
            // FP4 experts: ~0.53 bytes per expert value, the rest mostly 1 (FP8)
            assert!(
                t.stored < 0.65 * t.values && t.stored > 0.5 * t.values,
                "{name}"
            );
        }
    }

    #[test]
    fn a_plan_of_v4_flash_on_eight_gpus_becomes_a_placement_with_host_experts() {
        use crate::device::DeviceSpec;
        let (c, ex) = published("v4-flash");
        let w = weights_from_config(&c, ex, Residency::F32);
        let r = PlanRequest {
            devices: 8,
            device_memory: 141.0 * 1024f64.powi(3),
            host_memory: None,
            tokens: 131072,
            chunk_rows: 1,
            chunk_positions: None,
            residency: Residency::F32,
        };
        let pl = plan(&c, &w, &r).unwrap();
        assert!(pl.host_experts > 0);
        let devs: Vec<DeviceSpec> = (0..8).map(DeviceSpec::TchCuda).collect();
        let p = pl.placement(devs).unwrap();
        assert_eq!(p.layers.len(), c.num_hidden_layers);
        assert!(
            p.layers.windows(2).all(|w| w[0] <= w[1]),
            "contiguous ranges"
        );
        assert_eq!(p.layers[0], 0);
        assert_eq!(*p.layers.last().unwrap(), 7);
        let on_host: usize = p
            .experts_on_device
            .iter()
            .map(|k| c.n_routed_experts - k.expect("every layer's count is set"))
            .sum();
        assert_eq!(on_host, pl.host_experts);
        assert_eq!(
            p.host,
            DeviceSpec::TchCpu,
            "all-LibTorch devices keep experts in LibTorch"
        );
        let e = pl.placement(vec![DeviceSpec::Cpu]).unwrap_err().to_string();
        assert!(e.contains("8 devices, 1 named"), "{e}");
    }

    #[test]
    fn stored_residency_places_v4_flash_at_its_stored_bytes() {
        let (c, ex) = published("v4-flash");
        let req = |residency| PlanRequest {
            devices: 8,
            device_memory: 141.0 * 1024f64.powi(3),
            host_memory: None,
            tokens: 131072,
            chunk_rows: 1,
            chunk_positions: None,
            residency,
        };
        let stored = plan(
            &c,
            &weights_from_config(&c, ex, Residency::Stored),
            &req(Residency::Stored),
        )
        .unwrap();
        let f32 = plan(
            &c,
            &weights_from_config(&c, ex, Residency::F32),
            &req(Residency::F32),
        )
        .unwrap();
        let w = stored.weights;
        // resident = stored but for the hash tables (i64 for I32)
        assert!((w.resident / w.stored - 1.0).abs() < 0.01, "{w:?}");
        assert!(f32.weights.resident > 6.0 * w.resident, "{:?}", f32.weights);
        assert!(
            stored.host_experts < f32.host_experts,
            "stored {} vs f32 {} routed experts on the host",
            stored.host_experts,
            f32.host_experts
        );
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("141GiB").unwrap(), 141.0 * 1024f64.powi(3));
        assert_eq!(parse_bytes("80GB").unwrap(), 80e9);
        assert_eq!(parse_bytes("1.5 TiB").unwrap(), 1.5 * 1024f64.powi(4));
        assert!(parse_bytes("12 parsecs").unwrap_err().contains("parsecs"));
        assert!(parse_bytes("-1GB").is_err());
    }
}
