//! edge-attribution: EAP of every edge against brute force (each edge's linearised
//! effect by central finite differences through the hooks' own actions, edge by edge)
//! on a tiny compressed MQA model; the local pass 2 (stream API) against the replica
//! reference on kvc models and a tiny DeepSeek-V4 (CSA + HCA + sliding, mHC, hash and
//! learned MoE), EAP and EAP-IG; EAP-IG with one step against EAP at the partner; the
//! kind end to end (tables, agreement with path patching, logit lens, report, redraw,
//! resume).

use std::sync::Arc;

use crate::common::runner::*;
use crate::common::{dev, vals};
use burn::tensor::Tensor;
use phaselens::hooks::{Act, Action, ActivationCache, HookPoint, HookSpec, Scope, Site};
use phaselens::model::LanguageModel;
use phaselens::output::{LONG_COLUMNS, LongRow, Table, read_long_rows, validate_columns};
use phaselens::runner::kinds::edge_attribution::faithful::circuit_ld;
use phaselens::runner::kinds::edge_attribution::{
    EdgeRun, Graph, Input, Method, Pass2, ReceiverNode, SenderNode, edge_metric,
};
use phaselens::runner::kinds::patch_heads::Direction;
use phaselens::runner::patching::{Prompts, Target, readout};
use phaselens::runner::progress::Progress;
use phaselens::runner::report::draw_all;
use phaselens::runner::{ProgressMode, run_experiment};

/// Two clean prompts and their corrupted partners (one token changed early, so the
/// change reaches the compressed entries of the first window).
fn every_point(nl: usize) -> Vec<HookPoint> {
    let mut v = vec![HookPoint::global(Site::Embed)];
    for l in 0..nl {
        for s in [
            Site::AttnQ,
            Site::AttnK,
            Site::AttnV,
            Site::CompressedK,
            Site::CompressedV,
            Site::AttnZ,
            Site::MlpOut,
        ] {
            v.push(HookPoint::block(l, s));
        }
    }
    v
}

fn forward_cache(model: &dyn LanguageModel, p: &Prompts, rows: &[usize]) -> ActivationCache {
    let mut spec = HookSpec::new();
    for pt in every_point(model.info().n_layers()) {
        spec = spec.capture_point(pt);
    }
    model
        .forward(p.tokens_of(rows, &dev()), &spec)
        .unwrap()
        .cache
}

fn act(c: &ActivationCache, p: &HookPoint) -> Act {
    c.get(p).unwrap().clone()
}

/// `base + eps * delta` (rank 3 or 4).
fn shifted(base: &Act, delta: &Act, eps: f32) -> Act {
    match base.shape().len() {
        3 => Act::new(base.get::<3>().unwrap() + delta.get::<3>().unwrap().mul_scalar(eps)),
        _ => Act::new(base.get::<4>().unwrap() + delta.get::<4>().unwrap().mul_scalar(eps)),
    }
}

fn minus(a: &Act, b: &Act) -> Act {
    match a.shape().len() {
        3 => Act::new(a.get::<3>().unwrap() - b.get::<3>().unwrap()),
        _ => Act::new(a.get::<4>().unwrap() - b.get::<4>().unwrap()),
    }
}

/// The clean-orientation LD of the receiving (corrupted) rows.
fn metric(model: &dyn LanguageModel, p: &Prompts, rows: &[usize], spec: &HookSpec) -> Vec<f32> {
    let logits: Tensor<3> = model
        .forward(p.tokens_of(rows, &dev()), spec)
        .unwrap()
        .logits;
    let targets: Vec<&Target> = rows.iter().map(|&r| &p.targets[r]).collect();
    readout(logits, &targets)
        .unwrap()
        .iter()
        .map(|o| -o.ld)
        .collect()
}

/// The linearised effect of one edge, by brute force: (1) every sender output held at
/// the receiving run's value except sender u, moved by +-eps x its clean-minus-corrupted
/// change (an MLP receiver's own output left live), the receiver's activation read;
/// (2) the receiving run with only the receiver's slice replaced by that value (raw
/// k / v: the compressed entries held, so only the raw path counts), the metric read;
/// central difference over eps.
fn brute(
    model: &dyn LanguageModel,
    p: &Prompts,
    base: &Arc<ActivationCache>,
    delta: &ActivationCache,
    s: SenderNode,
    r: ReceiverNode,
    eps: f32,
) -> Vec<f32> {
    let nl = model.info().n_layers();
    let rows = vec![2usize, 3];
    let at = |eps: f32| -> Vec<f32> {
        let mut spec = HookSpec::new();
        for l in 0..nl {
            let z = HookPoint::block(l, Site::AttnZ);
            spec = spec.intervene_point(z, Action::Replace(act(base, &z)), Scope::all());
            let m = HookPoint::block(l, Site::MlpOut);
            if r != (ReceiverNode::Mlp { layer: l }) {
                spec = spec.intervene_point(m, Action::Replace(act(base, &m)), Scope::all());
            }
        }
        let sp = s.point();
        let moved = shifted(&act(base, &sp), &act(delta, &sp), eps);
        let scope = match s.head() {
            Some(h) => Scope::heads([h]),
            None => Scope::all(),
        };
        spec = spec.intervene_point(sp, Action::Replace(moved), scope);
        let Some(rp) = r.point() else {
            return metric(model, p, &rows, &spec);
        };
        spec = spec.capture_point(rp);
        let cache = model
            .forward(p.tokens_of(&rows, &dev()), &spec)
            .unwrap()
            .cache;
        let new = act(&cache, &rp);
        let scope = match r.head() {
            Some(h) => Scope::heads([h]),
            None => Scope::all(),
        };
        let mut spec2 = HookSpec::new();
        if let ReceiverNode::Attn {
            layer,
            input: Input::K | Input::V,
            ..
        } = r
        {
            for site in [Site::CompressedK, Site::CompressedV] {
                let c = HookPoint::block(layer, site);
                spec2 = spec2.intervene_point(c, Action::Replace(act(base, &c)), Scope::all());
            }
        }
        spec2 = spec2.intervene_point(rp, Action::Replace(new), scope);
        metric(model, p, &rows, &spec2)
    };
    let (a, b) = (at(eps), at(-eps));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y) / (2.0 * eps))
        .collect()
}

#[test]
fn eap_matches_brute_force_on_every_edge() {
    // 2 layers, 4 query heads reading ONE KV head (MQA), compressed entries (window 4,
    // stride 4) and a raw tail.
    let cfg = tiny(2, 4, 1, 4, 4);
    let model = random_model(&cfg, 5);
    let prompts = pair_prompts(14, 1);
    let graph = Graph::of(&model.info());
    // The graph: embed + 8 heads + 2 MLPs; per layer 4 q + k, v, ck, cv + MLP, logits.
    assert_eq!(graph.senders.len(), 11);
    assert_eq!(graph.receivers.len(), 19);
    let mut progress = Progress::new(ProgressMode::Hidden, "t", "passes", 0);
    let run = EdgeRun {
        model: &model,
        prompts: &prompts,
        graph: &graph,
        direction: Direction::Denoise,
        // Replicas split over several forwards (3 receivers x 2 prompts each).
        max_rows: 6,
    };
    let eap = run.scores(Method::Eap, &mut progress).unwrap();
    assert_eq!(eap.scores.len(), graph.edges.len());
    let base = Arc::new(forward_cache(&model, &prompts, &[2, 3]));
    let clean = forward_cache(&model, &prompts, &[0, 1]);
    let mut delta = ActivationCache::new();
    for pt in every_point(2) {
        delta.insert(pt, minus(&act(&clean, &pt), &act(&base, &pt)));
    }
    let mut brute_all = Vec::new();
    for e in &graph.edges {
        let b = brute(
            &model,
            &prompts,
            &base,
            &delta,
            graph.senders[e.sender],
            graph.receivers[e.receiver],
            1e-2,
        );
        brute_all.push(b);
    }
    let scale = brute_all.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        scale > 1e-3,
        "every edge's effect is ~0: the test would be vacuous"
    );
    let mut worst = (0f32, String::new());
    for (ei, e) in graph.edges.iter().enumerate() {
        for (a, b) in eap.scores[ei].iter().zip(&brute_all[ei]) {
            let err = (a - b).abs() / (1e-3 * scale + 0.02 * b.abs());
            if std::env::var("EDGES_DEBUG").is_ok() && err > 1.0 {
                eprintln!("{}: EAP {a} vs brute force {b}", graph.edge_label(*e));
            }
            if err > worst.0 {
                worst = (
                    err,
                    format!("{}: EAP {a} vs brute force {b}", graph.edge_label(*e)),
                );
            }
        }
    }
    if std::env::var("EDGES_DEBUG").is_ok() {
        eprintln!(
            "worst {:.3} of the tolerance: {} (scale {scale})",
            worst.0, worst.1
        );
    }
    assert!(worst.0 <= 1.0, "worst edge: {} (scale {scale})", worst.1);
    // Every kind of edge carries an effect somewhere (not vacuous per kind), and the
    // query heads that read the one KV head differ (the q edges are per head).
    for input in [Input::Q, Input::K, Input::V, Input::Ck, Input::Cv] {
        let m = graph
            .edges
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                matches!(graph.receivers[e.receiver], ReceiverNode::Attn { input: i, .. } if i == input)
            })
            .flat_map(|(ei, _)| brute_all[ei].iter().map(|x| x.abs()))
            .fold(0f32, f32::max);
        assert!(m > 1e-4 * scale.max(1.0), "{input:?} edges all ~0");
    }
}

/// The local pass 2 against the replicas, per edge and receiving prompt, for EAP and
/// EAP-IG (2 steps) in both directions; the default method is the local one, and every
/// kind of receiver input carries an effect (not vacuous).
fn local_matches_replicas(model: &dyn LanguageModel, prompts: &Prompts, name: &str) {
    let graph = Graph::of(&model.info());
    let mut progress = Progress::new(ProgressMode::Hidden, "t", "passes", 0);
    for (direction, method) in [
        (Direction::Denoise, Method::Eap),
        (Direction::Denoise, Method::EapIg { steps: 2 }),
        (Direction::Noise, Method::Eap),
    ] {
        let run = EdgeRun {
            model,
            prompts,
            graph: &graph,
            direction,
            // Several chunks per stream point (3 receivers x 2 prompts each).
            max_rows: 6,
        };
        let local = run.scores(method, &mut progress).unwrap();
        assert_eq!(local.pass2, Pass2::Local, "{name}: the default is local");
        let rep = run
            .scores_with(method, Pass2::Replicas, &mut progress)
            .unwrap();
        assert_eq!(rep.pass2, Pass2::Replicas);
        assert!(local.local_passes > 0 && rep.local_passes == 0);
        assert!(
            local.passes < rep.passes,
            "{name}: local ran {} full-model passes, replicas {}",
            local.passes,
            rep.passes
        );
        let scale = rep
            .scores
            .iter()
            .flatten()
            .fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 1e-3, "{name}: every score ~0: vacuous");
        let mut worst = (0f32, String::new());
        for (ei, e) in graph.edges.iter().enumerate() {
            for (a, b) in local.scores[ei].iter().zip(&rep.scores[ei]) {
                let err = (a - b).abs() / scale;
                if err > worst.0 {
                    worst = (
                        err,
                        format!("{}: local {a} vs replicas {b}", graph.edge_label(*e)),
                    );
                }
            }
        }
        eprintln!(
            "{name} {direction:?} {method:?}: worst |local - replicas| = {:.2e} of the largest score ({scale}): {}",
            worst.0, worst.1
        );
        assert!(
            worst.0 <= 2e-5,
            "{name} {direction:?} {method:?}: {} ({:.2e} of {scale})",
            worst.1,
            worst.0
        );
        for input in [Input::Q, Input::K, Input::V, Input::Ck, Input::Cv] {
            let m = graph
                .edges
                .iter()
                .enumerate()
                .filter(|(_, e)| {
                    matches!(graph.receivers[e.receiver], ReceiverNode::Attn { input: i, .. } if i == input)
                })
                .flat_map(|(ei, _)| rep.scores[ei].iter().map(|x| x.abs()))
                .fold(0f32, f32::max);
            assert!(m > 1e-6 * scale, "{name}: {input:?} edges all ~0");
        }
    }
}

#[test]
fn local_pass_matches_replicas_on_kvc() {
    // Compressed MQA with a raw tail; then GQA with overlapping windows, vector gates,
    // the key shift and tied k / v (every input computation kvc has).
    let model = random_model(&tiny(2, 4, 1, 4, 4), 5);
    local_matches_replicas(&model, &pair_prompts(14, 1), "kvc MQA");
    let mut cfg = tiny(2, 4, 2, 4, 2);
    cfg.key_shift = true;
    cfg.tied_kv = true;
    if let Some(c) = cfg.compression.as_mut() {
        c.gate = phaselens::model::kvc::GateMode::Vector;
    }
    let model = random_model(&cfg, 9);
    local_matches_replicas(&model, &pair_prompts(14, 1), "kvc GQA shift");
}

/// A tiny DeepSeek-V4: CSA (overlapping windows, indexer top-2 of 4 entries), HCA,
/// sliding; two mHC streams; a hash-routed and two learned MoE layers.
pub(crate) fn tiny_v4(seed: u64) -> phaselens::model::deepseek_v4::DeepseekV4Model {
    use phaselens::model::deepseek_v4::{DeepseekV4Config, DeepseekV4Model};
    use phaselens::model::weights::{RandomInit, Vb};
    let json = r#"{"model_type": "deepseek_v4", "vocab_size": 128, "hidden_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16,
        "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "num_hash_layers": 1,
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                        "sliding_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 6, "index_n_heads": 1, "index_head_dim": 8, "index_topk": 2,
        "hc_mult": 2}"#;
    let c = DeepseekV4Config::from_json(json).unwrap();
    DeepseekV4Model::new(&c, &Vb::new(&RandomInit { seed }, &dev())).unwrap()
}

#[test]
fn local_pass_matches_replicas_on_deepseek_v4() {
    local_matches_replicas(&tiny_v4(13), &pair_prompts(16, 1), "deepseek-v4");
}

/// A deterministic pseudo-random tensor (values in [-1, 1)).
fn noise<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<D> {
    let n: usize = shape.iter().product();
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_data(burn::tensor::TensorData::new(v, shape), &dev())
}

/// The linearised stream transport (`linearize_stream` + `StreamLinear`) against
/// autodiff through `stream_from_outputs`: an adjoint at every stream point for each of
/// `c` = 2 row blocks (different adjoints, same linearisation point), the gradient at
/// the embeddings and every block output; the steps' argument errors.
fn stream_linear_matches_autodiff(model: &dyn LanguageModel, name: &str) {
    let sm = model.stream_model().unwrap();
    let info = model.info();
    let (nl, d) = (info.n_layers(), info.d_model);
    let (b, t, c) = (2, 5, 2);
    // Block outputs of the size of a real forward's (the weights' Jacobians matter).
    let embed = noise([b, t, d], 1);
    let attn: Vec<Tensor<3>> = (0..nl).map(|l| noise([b, t, d], 10 + l as u64)).collect();
    let mlp: Vec<Tensor<3>> = (0..nl).map(|l| noise([b, t, d], 20 + l as u64)).collect();
    let width = {
        let s = sm.stream_from_outputs(embed.clone(), &attn, &mlp).unwrap();
        assert_eq!(s.len(), 2 * nl + 1);
        s[0].shape()[2..].iter().product::<usize>()
    };
    let adj: Vec<Tensor<3>> = (0..=2 * nl)
        .map(|k| noise([c * b, t, width], 100 + k as u64))
        .collect();
    // Reference: c copies of the inputs plus leaves, one backward of sum_k <adj_k, X_k>.
    let ad = dev().autodiff();
    let leaf = |x: &Tensor<3>| {
        let r = x.clone().repeat_dim(0, c);
        let l = Tensor::<3>::zeros(r.dims(), &ad).require_grad();
        (r + l.clone(), l)
    };
    let (e, el) = leaf(&embed);
    let (a, al): (Vec<_>, Vec<_>) = attn.iter().map(leaf).unzip();
    let (m, ml): (Vec<_>, Vec<_>) = mlp.iter().map(leaf).unzip();
    let streams = sm.stream_from_outputs(e, &a, &m).unwrap();
    let mut total: Option<Tensor<1>> = None;
    for (k, x) in streams.iter().enumerate() {
        let x = x
            .reshaped(vec![c * b, t, width])
            .unwrap()
            .get::<3>()
            .unwrap();
        let term = (x * adj[k].clone()).sum();
        total = Some(match total {
            Some(s) => s + term,
            None => term,
        });
    }
    let grads = total.unwrap().backward();
    let g = |l: &Tensor<3>| l.grad(&grads).unwrap();
    // The linear map, adjoints joining at their points.
    let lin = sm.linearize_stream(embed, &attn, &mlp).unwrap();
    let mut run = adj[2 * nl].clone();
    let (mut ga, mut gm) = (vec![None; nl], vec![None; nl]);
    for k in (1..=2 * nl).rev() {
        let (prev, out) = lin.step_back(k, run).unwrap();
        if k % 2 == 1 {
            ga[(k - 1) / 2] = Some(out);
        } else {
            gm[k / 2 - 1] = Some(out);
        }
        run = prev + adj[k - 1].clone();
    }
    let ge = lin.embed_back(run).unwrap();
    let mut pairs = vec![(g(&el), ge, "embed".to_string())];
    for l in 0..nl {
        pairs.push((g(&al[l]), ga[l].take().unwrap(), format!("attn_out[{l}]")));
        pairs.push((g(&ml[l]), gm[l].take().unwrap(), format!("mlp_out[{l}]")));
    }
    for (want, got, what) in pairs {
        let (w, x) = (vals(want), vals(got));
        assert_eq!(w.len(), x.len(), "{name} {what}");
        let scale = w.iter().fold(0f32, |s, v| s.max(v.abs()));
        assert!(scale > 1e-2, "{name} {what}: a vacuous gradient");
        let err = w
            .iter()
            .zip(&x)
            .fold(0f32, |s, (a, b)| s.max((a - b).abs()));
        assert!(
            err <= 1e-5 * scale,
            "{name} {what}: |linear - autodiff| = {err} of {scale}"
        );
    }
    for k in [0, 2 * nl + 1] {
        let err = lin
            .step_back(k, adj[0].clone())
            .err()
            .unwrap_or_else(|| panic!("{name}: step {k} accepted"));
        assert!(err.to_string().contains("steps are 1..="), "{err}");
    }
}

#[test]
fn stream_transport_linear_map_matches_autodiff() {
    stream_linear_matches_autodiff(&tiny_v4(13), "deepseek-v4");
    stream_linear_matches_autodiff(&random_model(&tiny(2, 4, 1, 4, 4), 5), "kvc");
}

#[test]
fn eap_ig_one_step_is_the_gradient_at_the_partner_and_more_steps_differ() {
    let cfg = tiny(2, 4, 1, 4, 4);
    let model = random_model(&cfg, 7);
    let prompts = pair_prompts(14, 1);
    let graph = Graph::of(&model.info());
    let mut progress = Progress::new(ProgressMode::Hidden, "t", "passes", 0);
    let run = |direction| EdgeRun {
        model: &model,
        prompts: &prompts,
        graph: &graph,
        direction,
        max_rows: 64,
    };
    let denoise = run(Direction::Denoise);
    // One step: alpha = 1, the corrupted tokens with the clean embeddings, i.e. the
    // clean run (kvc reads tokens only through the embeddings). The clean-orientation
    // LD is the same metric in both directions, and the deltas are opposite: noising
    // EAP (gradient at the clean run) = -(denoising EAP-IG with one step).
    let ig1 = denoise
        .scores(Method::EapIg { steps: 1 }, &mut progress)
        .unwrap();
    let noise = run(Direction::Noise)
        .scores(Method::Eap, &mut progress)
        .unwrap();
    let scale = noise
        .scores
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 1e-4);
    for (ei, e) in graph.edges.iter().enumerate() {
        for (a, b) in ig1.scores[ei].iter().zip(&noise.scores[ei]) {
            assert!(
                (a + b).abs() <= 1e-3 * scale + 1e-3 * b.abs(),
                "{}: EAP-IG(1) denoise {a} vs EAP noise {b}",
                graph.edge_label(*e)
            );
        }
    }
    let eap = denoise.scores(Method::Eap, &mut progress).unwrap();
    let ig = denoise
        .scores(Method::EapIg { steps: 4 }, &mut progress)
        .unwrap();
    let diff = eap
        .scores
        .iter()
        .flatten()
        .zip(ig.scores.iter().flatten())
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff > 1e-5, "EAP-IG equals EAP");
    assert!(ig.scores.iter().flatten().all(|x| x.is_finite()));
}

#[test]
fn circuit_of_every_edge_is_the_clean_run_and_of_none_the_corrupted_run() {
    let cfg = tiny(2, 4, 1, 4, 4);
    let model = random_model(&cfg, 11);
    let prompts = pair_prompts(14, 1);
    let graph = Graph::of(&model.info());
    let e = graph.edges.len();
    let ld = |keep: &[bool]| circuit_ld(&model, &prompts, &graph, keep, 8).unwrap();
    let all: Vec<usize> = (0..4).collect();
    let targets: Vec<&Target> = prompts.targets.iter().collect();
    let logits = model
        .forward(prompts.tokens_of(&all, &dev()), &HookSpec::new())
        .unwrap()
        .logits;
    let base = readout(logits, &targets).unwrap();
    let full = ld(&vec![true; e]);
    let none = ld(&vec![false; e]);
    for i in 0..2 {
        // Clean orientation: the clean prompt's LD; the corrupted prompt's, negated.
        assert!(
            (full[i] - base[i].ld).abs() < 1e-3,
            "{} vs clean {}",
            full[i],
            base[i].ld
        );
        assert!(
            (none[i] + base[2 + i].ld).abs() < 1e-3,
            "{} vs corrupted {}",
            none[i],
            -base[2 + i].ld
        );
    }
    assert!(
        (base[0].ld + base[2].ld).abs() > 1e-3,
        "clean and corrupted agree: vacuous"
    );
    // Half the edges: somewhere between (not either end), and every edge into the
    // logits alone (the direct paths) differs from the full circuit.
    let half: Vec<bool> = (0..e).map(|i| i % 2 == 0).collect();
    let h = ld(&half);
    assert!(h.iter().zip(&full).any(|(a, b)| (a - b).abs() > 1e-4));
    assert!(h.iter().zip(&none).any(|(a, b)| (a - b).abs() > 1e-4));
}

fn rows(path: &std::path::Path) -> Vec<LongRow> {
    let t = Table::read_arrow(path).unwrap();
    validate_columns(&t, LONG_COLUMNS).unwrap();
    assert!(path.with_extension("parquet").exists());
    read_long_rows(&t).unwrap()
}

#[test]
fn edge_attribution_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 1, 4, 4), 31);
    let text = "[experiment]\nkind = \"edge-attribution\"\nbootstrap_reps = 20\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n\n[edges]\nig_steps = 2\nvalidate_edges = 10\ntop_k = 3\n";
    let exp = experiment(d, "ea.toml", text);
    let s = run_experiment(&exp, &opts(d)).unwrap();
    assert!(s.stats.cells_computed > 0);
    let table = d.join("notebooks-data/ea/edges.arrow");
    let rows = rows(&table);
    let m = edge_metric("eap", Direction::Denoise, "L0H1->L1KV0.k");
    assert_eq!(
        rows.iter().filter(|r| r.metric == m).count(),
        4 + 1,
        "4 phases + pooled"
    );
    let m = edge_metric("eapig", Direction::Denoise, "embed->logits");
    assert!(rows.iter().any(|r| r.metric == m));
    // Faithfulness: the full graph recovers 1 in every phase.
    let edges = rows
        .iter()
        .find(|r| r.metric == "edges_scored")
        .unwrap()
        .value as usize;
    let full: Vec<&LongRow> = rows
        .iter()
        .filter(|r| r.metric == format!("faithfulness_top{edges}"))
        .collect();
    assert_eq!(full.len(), 5);
    assert!(
        full.iter()
            .all(|r| !r.value.is_finite() || (r.value - 1.0).abs() < 1e-3),
        "{full:?}"
    );
    assert_eq!(
        rows.iter()
            .filter(|r| r.metric == "circuit_size_80")
            .count(),
        5
    );
    for stat in ["spearman", "recall_top3", "mae"] {
        let m = format!("{stat}_eap_nld_denoise");
        assert_eq!(rows.iter().filter(|r| r.metric == m).count(), 5, "{m}");
    }
    let exact = rows
        .iter()
        .filter(|r| r.metric.starts_with("exact_nld_denoise:") && r.phase.is_none())
        .count();
    assert_eq!(exact, 10);
    // Logit lens: layers 0..=2 (2 = the last block's output) x (4 phases + pooled).
    let lens: Vec<&LongRow> = rows.iter().filter(|r| r.metric == "lens_prob").collect();
    assert_eq!(lens.len(), 3 * 5);
    assert!(lens.iter().all(|r| (0.0..=1.0).contains(&r.value)));
    let rep = d.join("reports/ea");
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(md.contains("Agreement with exact path patching"), "{md}");
    assert!(md.contains("Logit lens by phase"), "{md}");
    assert!(rep.join("edges_eap.png").exists());
    assert!(rep.join("faithfulness.png").exists());
    assert!(rep.join("circuit_phase0.png").exists());
    assert!(rep.join("circuit_overlap.png").exists());
    assert!(rep.join("logit_lens.png").exists());
    std::fs::remove_dir_all(&rep).unwrap();
    draw_all(&d.join("notebooks-data"), &d.join("reports"), Some("ea")).unwrap();
    assert!(rep.join("report.md").exists());
    let again = run_experiment(&exp, &opts(d)).unwrap();
    assert_eq!(again.stats.cells_computed, 0);
    assert!(again.stats.cells_resumed > 0);
    // An empty method list: an error naming the key.
    let bad = experiment(
        d,
        "bad.toml",
        "[experiment]\nkind = \"edge-attribution\"\n[model]\norganism = \"tiny\"\n[edges]\nmethods = []\n",
    );
    let err = run_experiment(&bad, &opts(d)).unwrap_err().to_string();
    assert!(err.contains("methods"), "{err}");
}

/// `bench edges --layers / --heads`: the config resized (kvc: the head size kept;
/// DeepSeek-V4: the per-layer type lists cycled), random weights of that size, and the
/// benchmark on them with exact path patching of a sample of senders.
#[test]
fn bench_edges_on_a_resized_random_model() {
    use phaselens::runner::bench::{RandomModel, random_model, scaled_config};
    use phaselens::runner::kinds::edge_attribution::bench::{EdgeBench, bench_edges};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    two_value_organism(d, "tiny", &tiny(2, 4, 1, 4, 4), 31);
    let r = RandomModel {
        layers: Some(3),
        heads: Some(6),
        seed: 2,
    };
    let json = scaled_config(&d.join("tiny"), &r).unwrap();
    assert_eq!(json["n_layers"], 3);
    assert_eq!(json["n_heads"], 6);
    let before = tiny(2, 4, 1, 4, 4);
    let d_head = before.d_head.unwrap_or(before.d_model / 4);
    assert_eq!(json["d_head"].as_u64(), Some(d_head as u64));
    let m = random_model(&d.join("tiny"), &r, &dev()).unwrap();
    let info = m.info();
    assert_eq!((info.n_layers(), info.n_heads, info.d_head), (3, 6, d_head));
    // DeepSeek-V4: 5 layers from a 3-layer config, types cycled.
    let v4 = d.join("v4");
    std::fs::create_dir_all(&v4).unwrap();
    let cfg = r#"{"model_type": "deepseek_v4", "vocab_size": 128, "hidden_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 16,
        "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention",
                        "sliding_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 6, "index_n_heads": 1, "index_head_dim": 8, "index_topk": 2,
        "hc_mult": 2}"#;
    std::fs::write(v4.join("config.json"), cfg).unwrap();
    let r5 = RandomModel {
        layers: Some(5),
        heads: Some(4),
        seed: 0,
    };
    let json = scaled_config(&v4, &r5).unwrap();
    let types: Vec<&str> = json["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(types.len(), 5);
    assert_eq!(types[3], "compressed_sparse_attention");
    assert_eq!(json["mlp_layer_types"][4], "moe");
    let m = random_model(&v4, &r5, &dev()).unwrap();
    assert_eq!((m.info().n_layers(), m.info().n_heads), (5, 4));
    // 3 heads do not split into o_groups = 2: the config's own error.
    let odd = RandomModel {
        heads: Some(3),
        ..r5
    };
    let err = random_model(&v4, &odd, &dev()).err().unwrap().to_string();
    assert!(
        err.contains("o_groups") && err.contains("--layers / --heads"),
        "{err}"
    );
    // The benchmark on the resized kvc model: the graph of 3 layers x 6 heads, path
    // patching of the edges of 2 senders only.
    let exp = experiment(
        d,
        "ea.toml",
        "[experiment]\nkind = \"edge-attribution\"\n\n[model]\norganism = \"tiny\"\n\n[task]\nn_logical = 8\n",
    );
    let what = EdgeBench {
        phase: 0,
        n_logical: Some(2),
        ig_steps: 1,
        random: Some(r),
        exact_senders: Some(2),
        replicas: false,
        ig_held: false,
    };
    let res = bench_edges(&exp, &what, &"cpu".parse().unwrap()).unwrap();
    assert_eq!(res.edges, Graph::of(&info).edges.len());
    assert!(res.replicas.is_none());
    assert!(
        res.exact_edges > 0 && res.exact_edges < res.exact_of,
        "{res}"
    );
    assert!(res.model.contains("3 layers x 6 heads"), "{}", res.model);
}

/// EAP-IG with the indexer's selection held at the clean run's: the local pass and the
/// replicas agree (both hold it), the hold changes the scores (the interpolation moves
/// the indexer's choice on this model), and a model without an indexer is refused.
#[test]
fn eap_ig_with_the_indexer_selection_held() {
    let model = tiny_v4(13);
    let prompts = pair_prompts(16, 1);
    let graph = Graph::of(&model.info());
    let mut progress = Progress::new(ProgressMode::Hidden, "t", "passes", 0);
    let run = EdgeRun {
        model: &model,
        prompts: &prompts,
        graph: &graph,
        direction: Direction::Denoise,
        max_rows: 6,
    };
    let m = Method::EapIgHeld { steps: 2 };
    let local = run.scores(m, &mut progress).unwrap();
    let rep = run.scores_with(m, Pass2::Replicas, &mut progress).unwrap();
    let flat = |v: &[Vec<f32>]| v.iter().flatten().copied().collect::<Vec<f32>>();
    let (a, b) = (flat(&local.scores), flat(&rep.scores));
    let scale = b.iter().fold(0f32, |s, x| s.max(x.abs()));
    assert!(scale > 1e-3);
    let err = a
        .iter()
        .zip(&b)
        .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
    assert!(
        err <= 2e-5 * scale,
        "held: local vs replicas {err} of {scale}"
    );
    let free = flat(
        &run.scores(Method::EapIg { steps: 2 }, &mut progress)
            .unwrap()
            .scores,
    );
    let diff = a
        .iter()
        .zip(&free)
        .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
    assert!(diff > 1e-4 * scale, "holding the selection changed nothing");
    let kvc = random_model(&tiny(2, 4, 1, 4, 4), 5);
    let graph = Graph::of(&kvc.info());
    let err = EdgeRun {
        model: &kvc,
        prompts: &pair_prompts(14, 1),
        graph: &graph,
        direction: Direction::Denoise,
        max_rows: 6,
    }
    .scores(m, &mut progress)
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("no indexer"), "{err}");
}
