//! The contract every `LanguageModel` keeps, checked by ONE routine over every model
//! family and config: every DeepSeek-V4 fixture (flash, pro, long, original_fp8 and the
//! long tie fixtures), the shipped organisms (experiments/organisms/*), tiny random
//! DeepSeek-V4 configs with many exact indexer ties, and tiny random kvc configs
//! (compressed W = S, overlapping W > S, with and without a local tail, sink, key shift,
//! full attention), at 256-300 tokens.
//!
//! (a) Prefix invariance: the logits of positions < L are the same whether the input is
//!     cut at L or continued (the model is causal), for several L that are not multiples
//!     of the rates or windows.
//! (b) A suffix forward over a base run's state gives the logits of `forward_from` and of
//!     the plain forward at its positions, for several rows, starts, lengths and start
//!     layers.
//! (c) Batch-row independence: a row's logits do not change when other rows are added
//!     to the batch, nor with its index in the batch.
//!
//! "The same" means max |diff| <= 1e-5 * max |logit| of the compared positions.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use phaselens::hooks::{Act, HookPoint, HookSpec, Site};
use phaselens::model::deepseek_v4::{self, DeepseekV4Config, DeepseekV4Model};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::weights::{RandomInit, Vb};
use phaselens::model::{KvcConfig, KvcModel, LanguageModel, Suffix};

/// Largest allowed max |diff| / max |logit|.
const TOL: f64 = 1e-5;

// ---------------------------------------------------------------------------------------
// Helpers (kept here: the shared test helpers may move).

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/deepseek_v4")
        .join(name)
}

/// `rows` x `len` token ids from a seeded LCG, in `0..vocab`.
fn random_rows(seed: u64, rows: usize, len: usize, vocab: usize) -> Vec<Vec<i64>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..rows)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((x >> 33) % vocab as u64) as i64
                })
                .collect()
        })
        .collect()
}

/// `[rows.len(), len]` token tensor of the first `len` tokens of each row.
fn tokens(rows: &[&[i64]], len: usize) -> Tensor<2, Int> {
    let flat: Vec<i64> = rows.iter().flat_map(|r| r[..len].iter().copied()).collect();
    Tensor::from_data(TensorData::new(flat, [rows.len(), len]), &Device::flex())
}

/// Logits `[b, t, v]` as (host values, [b, t, v]).
fn logits(m: &dyn LanguageModel, rows: &[&[i64]], len: usize) -> (Vec<f32>, [usize; 3]) {
    let l = m
        .forward(tokens(rows, len), &HookSpec::new())
        .unwrap()
        .logits;
    host(l)
}

fn host(l: Tensor<3>) -> (Vec<f32>, [usize; 3]) {
    let dims = l.dims();
    (
        l.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap(),
        dims,
    )
}

/// max |a - b| / max |b| (0 when b is all 0 and a == b).
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared lengths");
    let (mut d, mut m) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d = d.max((*x as f64 - *y as f64).abs());
        m = m.max((*y as f64).abs());
    }
    if d == 0.0 { 0.0 } else { d / m.max(1e-30) }
}

/// Positions `from..from + len` of row `row` of `[b, t, v]` values.
fn positions(v: &[f32], dims: [usize; 3], row: usize, from: usize, len: usize) -> &[f32] {
    let [_, t, n] = dims;
    &v[(row * t + from) * n..(row * t + from + len) * n]
}

/// `[rows.len(), len, ...]`: positions `from[r]..from[r] + len` of batch row `rows[r]`
/// of an activation `[b, t, ...]` of any rank.
fn slice_positions(a: &Act, rows: &[usize], from: &[usize], len: usize) -> Act {
    let shape = a.shape().to_vec();
    let per: usize = shape[2..].iter().product();
    let v = a.to_vec();
    let mut out = Vec::with_capacity(rows.len() * len * per);
    for (&r, &f) in rows.iter().zip(from) {
        let start = (r * shape[1] + f) * per;
        out.extend_from_slice(&v[start..start + len * per]);
    }
    let mut s = shape;
    s[0] = rows.len();
    s[1] = len;
    Act::from_vec(out, s, &Device::flex()).unwrap()
}

// ---------------------------------------------------------------------------------------
// The contract.

/// The worst relative difference seen for each property.
#[derive(Debug, Default)]
struct Worst {
    prefix: f64,
    suffix: f64,
    batch: f64,
}

/// Run (a), (b) and (c) on `m` with the prompts `rows` (at least 2, equally long) and
/// `extra`, a row of other tokens for the batch test. Panics naming the case, the
/// property and where it fails; returns the worst differences.
fn check_contract(name: &str, m: &dyn LanguageModel, rows: &[Vec<i64>], extra: &[i64]) -> Worst {
    let (b, t) = (rows.len(), rows[0].len());
    assert!(b >= 2 && rows.iter().all(|r| r.len() == t) && extra.len() == t);
    let all: Vec<&[i64]> = rows.iter().map(|r| r.as_slice()).collect();
    let (full, dims) = logits(m, &all, t);
    let mut worst = Worst::default();

    // (a) prefix invariance, at cuts that are (64) and are not multiples of the rates
    // and windows
    for cut in [1, 5, 33, 64, 67, 131, t / 2 + 3, t - 1] {
        if cut == 0 || cut >= t {
            continue;
        }
        let (got, gd) = logits(m, &all, cut);
        for r in 0..b {
            let e = rel(
                positions(&got, gd, r, 0, cut),
                positions(&full, dims, r, 0, cut),
            );
            if e > TOL {
                let first = (0..cut)
                    .find(|&p| {
                        rel(
                            positions(&got, gd, r, p, 1),
                            positions(&full, dims, r, p, 1),
                        ) > TOL
                    })
                    .unwrap();
                panic!(
                    "{name}: prefix invariance: cut at {cut} of {t}, row {r}: logits differ by {e:.3e} \
                     (first at position {first})"
                );
            }
            worst.prefix = worst.prefix.max(e);
        }
    }

    // (b) suffix forward == forward_from == plain forward at the suffix positions
    let n_layers = m.info().n_layers();
    let mut spec = HookSpec::new();
    for l in 0..n_layers {
        spec = spec.capture_point(HookPoint::block(l, Site::ResidPre));
    }
    let (base, state) = m.forward_with_state(tokens(&all, t), &spec).unwrap();
    let state = state.unwrap_or_else(|| panic!("{name}: no prefix state"));
    let (base_logits, _) = host(base.logits);
    let e = rel(&base_logits, &full);
    assert!(
        e <= TOL,
        "{name}: forward_with_state differs from forward by {e:.3e}"
    );
    let suffixes = [
        Suffix {
            rows: vec![b - 1, 0, 0],
            from: vec![t - 3, 0, t / 2 + 1],
            len: 3,
        },
        Suffix {
            rows: vec![0, 1],
            from: vec![1, t - 17],
            len: 17,
        },
        Suffix {
            rows: vec![1],
            from: vec![t - 1],
            len: 1,
        },
    ];
    let mut starts = vec![0, n_layers / 2, n_layers - 1];
    starts.dedup();
    for &start in &starts {
        let resid = base
            .cache
            .get(&HookPoint::block(start, Site::ResidPre))
            .unwrap();
        let from_out = m
            .forward_from(tokens(&all, t), start, resid, &HookSpec::new())
            .unwrap();
        let (from_logits, _) = host(from_out.logits);
        for sfx in &suffixes {
            let got = m
                .forward_suffix(
                    start,
                    &state,
                    sfx,
                    &slice_positions(resid, &sfx.rows, &sfx.from, sfx.len),
                    &HookSpec::new(),
                )
                .unwrap_or_else(|e| panic!("{name}: suffix forward from layer {start}: {e}"));
            let (got, gdims) = host(got.logits);
            assert_eq!(gdims[..2], [sfx.rows.len(), sfx.len], "{name}");
            for (i, (&r, &f)) in sfx.rows.iter().zip(&sfx.from).enumerate() {
                let g = positions(&got, gdims, i, 0, sfx.len);
                let e_plain = rel(g, positions(&full, dims, r, f, sfx.len));
                let e_from = rel(g, positions(&from_logits, dims, r, f, sfx.len));
                let e = e_plain.max(e_from);
                assert!(
                    e <= TOL,
                    "{name}: suffix forward from layer {start}, row {r}, positions {f}..{}: \
                     {e_plain:.3e} from the plain forward, {e_from:.3e} from forward_from",
                    f + sfx.len
                );
                worst.suffix = worst.suffix.max(e);
            }
        }
    }

    // (d) logits at chosen positions only (training's read-out, `bench forward
    // --last-logits`) are those rows of the plain forward's logits
    let picks: Vec<i64> = vec![(t - 1) as i64, 0, (b * t - 1) as i64, (t + t / 2) as i64];
    let k = picks.len();
    let got = m
        .forward_logit_rows(
            tokens(&all, t),
            Tensor::<1, Int>::from_data(TensorData::new(picks.clone(), [k]), &m.device()),
        )
        .unwrap_or_else(|e| panic!("{name}: forward_logit_rows: {e}"));
    let v = dims[2];
    assert_eq!(got.dims(), [k, v], "{name}");
    let got = got.into_data().try_to_vec::<f32>().unwrap();
    for (i, &flat) in picks.iter().enumerate() {
        let (r, p) = (flat as usize / t, flat as usize % t);
        let e = rel(&got[i * v..(i + 1) * v], positions(&full, dims, r, p, 1));
        assert!(
            e <= TOL,
            "{name}: forward_logit_rows at row {r}, position {p} differs by {e:.3e}"
        );
    }

    // (c) batch-row independence: each row alone, and the rows reversed after another row
    for (r, row) in all.iter().enumerate() {
        let (got, _) = logits(m, &[row], t);
        let e = rel(&got, positions(&full, dims, r, 0, t));
        assert!(
            e <= TOL,
            "{name}: row {r} alone differs from row {r} of the batch by {e:.3e}"
        );
        worst.batch = worst.batch.max(e);
    }
    let mut mixed: Vec<&[i64]> = vec![extra];
    mixed.extend(all.iter().rev());
    let (got, gd) = logits(m, &mixed, t);
    for r in 0..b {
        let at = b - r; // row r sits at index b - r of `mixed`
        let e = rel(
            positions(&got, gd, at, 0, t),
            positions(&full, dims, r, 0, t),
        );
        assert!(
            e <= TOL,
            "{name}: row {r} at batch index {at} (after another row) differs by {e:.3e}"
        );
        worst.batch = worst.batch.max(e);
    }
    eprintln!(
        "{name}: batch {b} x {t} tokens; worst max|diff|/max|logit|: prefix {:.2e}, suffix {:.2e}, batch {:.2e}",
        worst.prefix, worst.suffix, worst.batch
    );
    worst
}

// ---------------------------------------------------------------------------------------
// DeepSeek-V4: the fixtures.

/// The fixture's own prompts when they are long, else 2 random prompts of 260 tokens.
fn fixture_prompts(name: &str, vocab: usize) -> Vec<Vec<i64>> {
    let r = SafetensorsReader::open(&fixture(name).join("reference.safetensors")).unwrap();
    let (shape, ids) = r.read_i64("input_ids").unwrap();
    if shape[1] >= 256 && shape[0] >= 2 {
        ids.chunks(shape[1]).map(|c| c.to_vec()).collect()
    } else {
        random_rows(name.len() as u64 * 31 + 7, 2, 260, vocab)
    }
}

fn v4_fixture(name: &str) {
    let m = deepseek_v4::load(&fixture(name), &Device::flex()).unwrap();
    let v = m.config.vocab_size;
    let rows = fixture_prompts(name, v);
    let extra = random_rows(99, 1, rows[0].len(), v).remove(0);
    check_contract(name, &m, &rows, &extra);
}

#[test]
fn v4_fixture_flash() {
    v4_fixture("flash");
}

#[test]
fn v4_fixture_pro() {
    v4_fixture("pro");
}

#[test]
fn v4_fixture_long() {
    v4_fixture("long");
}

#[test]
fn v4_fixture_original_fp8() {
    v4_fixture("original_fp8");
}

#[test]
fn v4_fixture_ties_default() {
    v4_fixture("ties_default");
}

#[test]
fn v4_fixture_ties_yarn() {
    v4_fixture("ties_yarn");
}

#[test]
fn v4_fixture_ties_rate2() {
    v4_fixture("ties_rate2");
}

// ---------------------------------------------------------------------------------------
// The shipped organisms (trained checkpoints, any family).

fn organism(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("experiments/organisms")
        .join(name);
    let m = phaselens::model::load_model(&dir, &Device::flex()).unwrap();
    let v = m.info().vocab_size;
    let rows = random_rows(name.len() as u64 + 1000, 2, 300, v);
    let extra = random_rows(98, 1, 300, v).remove(0);
    check_contract(name, m.as_ref(), &rows, &extra);
}

#[test]
fn organism_kvc_w4s4() {
    organism("kvc-w4s4");
}

#[test]
fn organism_kvc_w8s4() {
    organism("kvc-w8s4");
}

#[test]
fn organism_kvc_w8s8() {
    organism("kvc-w8s8");
}

#[test]
fn organism_full_attn() {
    organism("full-attn");
}

#[test]
fn organism_v4pro_mini() {
    organism("v4pro-mini");
}

// ---------------------------------------------------------------------------------------
// DeepSeek-V4: tiny random configs with many indexer ties (one or two indexer heads:
// every entry whose dot products are all negative scores exactly 0).

/// Fraction of indexer choices (queries with more closed entries than k) made among
/// exactly tied scores, over every CSA layer.
fn tied_fraction(m: &DeepseekV4Model, rows: &[Vec<i64>]) -> f64 {
    let all: Vec<&[i64]> = rows.iter().map(|r| r.as_slice()).collect();
    let t = rows[0].len();
    let spec = HookSpec::new()
        .capture("blocks.*.attn.indexer.hook_scores")
        .unwrap();
    let out = m.forward(tokens(&all, t), &spec).unwrap();
    let (mut deciding, mut tied) = (0usize, 0usize);
    for l in 0..m.config.num_hidden_layers {
        let Ok(a) = out
            .cache
            .get_name(&format!("blocks.{l}.attn.indexer.hook_scores"))
        else {
            continue;
        };
        let n = a.shape()[2];
        let k = m.config.index_topk.min(n);
        let s = a.to_vec();
        for row in 0..rows.len() * t {
            let closed = (row % t + 1) / m.config.csa_rate;
            if closed <= k {
                continue;
            }
            deciding += 1;
            let mut v = s[row * n..row * n + closed].to_vec();
            v.sort_by(|x, y| y.partial_cmp(x).unwrap());
            let above = v.iter().filter(|&&x| x > v[k - 1]).count();
            let equal = v.iter().filter(|&&x| x == v[k - 1]).count();
            tied += usize::from(equal > k - above);
        }
    }
    tied as f64 / deciding.max(1) as f64
}

fn v4_random(name: &str, json: &str, seed: u64, batch: usize, len: usize) {
    let c = DeepseekV4Config::from_json(json).unwrap();
    let m = DeepseekV4Model::new(&c, &Vb::new(&RandomInit { seed }, &Device::flex())).unwrap();
    let rows = random_rows(seed, batch, len, c.vocab_size);
    let extra = random_rows(seed + 1, 1, len, c.vocab_size).remove(0);
    let f = tied_fraction(&m, &rows);
    eprintln!(
        "{name}: {:.0}% of indexer choices among tied scores",
        f * 100.0
    );
    assert!(
        f >= 0.1,
        "{name}: only {f:.2} of indexer choices tie: not the case meant"
    );
    check_contract(name, &m, &rows, &extra);
}

#[test]
fn v4_random_csa4_hca8_yarn() {
    v4_random(
        "v4 random (C,H,S,C; m 4, m' 8, W 6, 1 index head, top 3, YaRN)",
        r#"{"model_type": "deepseek_v4", "vocab_size": 61, "hidden_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 16,
            "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "num_hash_layers": 1,
            "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                            "sliding_attention", "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "sliding_window": 6, "index_n_heads": 1, "index_head_dim": 8, "index_topk": 3,
            "hc_mult": 2,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 64}}"#,
        11,
        2,
        257,
    );
}

#[test]
fn v4_random_csa2_hca16_default_rope() {
    v4_random(
        "v4 random (H,C,C; m 2, m' 16, W 3, 2 index heads, top 5, default RoPE)",
        r#"{"model_type": "deepseek_v4", "vocab_size": 50, "hidden_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 8,
            "qk_rope_head_dim": 4, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
            "n_routed_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 8,
            "num_hash_layers": 1, "scoring_func": "sigmoid",
            "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                            "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
            "sliding_window": 3, "index_n_heads": 2, "index_head_dim": 4, "index_topk": 5,
            "hc_mult": 3}"#,
        12,
        3,
        259,
    );
}

#[test]
fn v4_random_csa8_hca32_softmax_tied_embeddings() {
    v4_random(
        "v4 random (C,S,H,C; m 8, m' 32, W 11, 1 index head, top 6, softmax router)",
        r#"{"model_type": "deepseek_v4", "vocab_size": 40, "hidden_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 16,
            "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 1, "o_lora_rank": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "num_hash_layers": 2, "scoring_func": "softmax", "tie_word_embeddings": true,
            "layer_types": ["compressed_sparse_attention", "sliding_attention",
                            "heavily_compressed_attention", "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 32},
            "sliding_window": 11, "index_n_heads": 1, "index_head_dim": 8, "index_topk": 6,
            "hc_mult": 2}"#,
        13,
        2,
        263,
    );
}

// ---------------------------------------------------------------------------------------
// kvc: tiny random configs.

fn kvc(name: &str, c: KvcConfig, seed: u64) {
    c.validate().unwrap();
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed }, &Device::flex())).unwrap();
    let rows = random_rows(seed, 2, 261, c.vocab_size);
    let extra = random_rows(seed + 1, 1, 261, c.vocab_size).remove(0);
    check_contract(name, &m, &rows, &extra);
}

#[test]
fn kvc_compressed_window_equals_stride() {
    kvc("kvc W=S=4", KvcConfig::tiny(), 21);
}

#[test]
fn kvc_compressed_overlapping_windows() {
    kvc(
        "kvc W=6 S=4",
        KvcConfig::tiny().with_compression(6, 4, 0),
        22,
    );
}

#[test]
fn kvc_compressed_with_local_tail() {
    kvc(
        "kvc W=S=4 tail 5",
        KvcConfig::tiny().with_compression(4, 4, 5),
        23,
    );
}

#[test]
fn kvc_overlapping_tail_key_shift_no_sink() {
    let mut c = KvcConfig::tiny().with_compression(8, 3, 2);
    c.key_shift = true;
    c.sink = false;
    kvc("kvc W=8 S=3 tail 2, key shift, no sink", c, 24);
}

#[test]
fn kvc_full_attention() {
    kvc("kvc full attention", KvcConfig::tiny().full_attention(), 25);
}

#[test]
fn kvc_full_attention_key_shift_no_sink() {
    let mut c = KvcConfig::tiny().full_attention();
    c.key_shift = true;
    c.sink = false;
    kvc("kvc full attention, key shift, no sink", c, 26);
}

/// The Gemma 3 options on a tiny kvc decoder: sliding (window 7) and global layers with
/// their own RoPE bases, post-norms, GeGLU, scaled embeddings, an attention scale and
/// a logit soft-cap; no sink.
#[test]
fn pretrained_gemma3_options_sliding_and_global_layers() {
    use phaselens::model::kvc::{ArchOptions, LayerType, MlpAct};
    let mut c = KvcConfig::tiny().full_attention();
    c.sink = false;
    c.n_layers = 3;
    c.arch = ArchOptions {
        name: Some("gemma3".into()),
        mlp_act: MlpAct::GeluTanh,
        post_norms: true,
        embed_scale: Some(5.657),
        attn_scale: Some(0.3),
        layer_types: vec![
            LayerType::SlidingAttention,
            LayerType::FullAttention,
            LayerType::SlidingAttention,
        ],
        sliding_window: Some(7),
        rope_local_theta: Some(100.0),
        final_softcap: Some(3.0),
        ..ArchOptions::default()
    };
    kvc("gemma3 options (sliding 7 / global)", c, 27);
}

/// The Llama-family options: query/key/value biases (Qwen2), Llama 3 RoPE scaling, no
/// Q/K norm, no sink, tied embeddings.
#[test]
fn pretrained_llama_options_qkv_bias_llama3_rope() {
    use phaselens::model::kvc::{ArchOptions, Llama3Rope};
    let mut c = KvcConfig::tiny().full_attention();
    c.sink = false;
    c.qk_norm = false;
    c.tie_embeddings = true;
    c.arch = ArchOptions {
        name: Some("qwen2".into()),
        qkv_bias: true,
        rope_llama3: Some(Llama3Rope {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 64.0,
        }),
        ..ArchOptions::default()
    };
    kvc("llama options (qkv bias, llama3 rope)", c, 28);
}

/// The `select` overlay (blocks of 4, top 2, window 5, offset 1, 2 sinks) on a tiny
/// full-attention decoder: block selection reads the keys of every position, so a
/// suffix forward over a base run's state (decoding) must give the full forward's
/// logits.
#[test]
fn overlay_select_blocks_of_4() {
    let c = KvcConfig::tiny().full_attention();
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 29 }, &Device::flex())).unwrap();
    let o = "kind=select,block=4,top_k=2,window=5,offset=1,sinks=2"
        .parse()
        .unwrap();
    let m = m.with_overlay(&o).unwrap();
    let rows = random_rows(29, 2, 261, c.vocab_size);
    let extra = random_rows(30, 1, 261, c.vocab_size).remove(0);
    check_contract(
        "select overlay (block 4, top 2, window 5)",
        &m,
        &rows,
        &extra,
    );
}

/// The `pool` overlay (windows of 6 every 4 tokens, 3 raw) on a tiny full-attention
/// decoder.
#[test]
fn overlay_pool_w6_s4_local3() {
    let c = KvcConfig::tiny().full_attention();
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 31 }, &Device::flex())).unwrap();
    let m = m
        .with_overlay(&"kind=pool,window=6,stride=4,local=3".parse().unwrap())
        .unwrap();
    let rows = random_rows(31, 2, 261, c.vocab_size);
    let extra = random_rows(32, 1, 261, c.vocab_size).remove(0);
    check_contract("pool overlay (W 6, S 4, local 3)", &m, &rows, &extra);
}

/// Gate weights drawn N(0, 0.5^2) whatever the builder's init asks (the learned
/// compressor's builder asks for zeros), so the test compressor's gates are far from
/// uniform.
struct NonzeroGates(RandomInit);

impl phaselens::model::weights::WeightSource for NonzeroGates {
    fn float(
        &self,
        name: &str,
        shape: &[usize],
        _init: phaselens::model::weights::Init,
    ) -> phaselens::error::Result<Vec<f32>> {
        self.0
            .float(name, shape, phaselens::model::weights::Init::Normal(0.5))
    }
    fn int(
        &self,
        name: &str,
        shape: &[usize],
        init: &dyn Fn(usize) -> i64,
    ) -> phaselens::error::Result<Vec<i64>> {
        self.0.int(name, shape, init)
    }
}

/// A `learned` compressor (overlapping windows of 8 every 4 tokens, 3 raw) with
/// random, far-from-uniform gates and per-offset biases on a tiny full-attention
/// decoder: decoding over a base run's state must give the full forward.
#[test]
fn overlay_learned_w8_s4_local3() {
    use phaselens::model::kvc::GateMode;
    let c = KvcConfig::tiny().full_attention();
    let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 33 }, &Device::flex())).unwrap();
    let gates = NonzeroGates(RandomInit { seed: 34 });
    let m = m
        .with_trainable_compressor((8, 4, 3), GateMode::Scalar, Some(&gates))
        .unwrap();
    let rows = random_rows(33, 2, 261, c.vocab_size);
    let extra = random_rows(34, 1, 261, c.vocab_size).remove(0);
    check_contract("learned overlay (W 8, S 4, local 3)", &m, &rows, &extra);
}
