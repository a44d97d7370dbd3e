//! Pretrained models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M; GGUF) against
//! transformers' f32 forward of the same files: logits at 16, 512 and 2,048 tokens,
//! hook activations, a head ablation and a head-output patch. The reference is
//! `scripts/reference/pretrained_reference.py` (fixtures in tests/fixtures/pretrained/);
//! the models come from the cache `scripts/fetch-models.sh` fills.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData};
use phaselens::hooks::{Action, HookSpec, Scope};
use phaselens::model::safetensors_io::SafetensorsReader;
use phaselens::model::stored::Residency;
use phaselens::model::{LanguageModel, load_model_with};

use crate::common::pretrained::{GEMMA3, SMOLLM2, model_file};
use crate::common::{dev, max_diff, max_rel, vals};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pretrained")
        .join(name)
}

fn ints(r: &SafetensorsReader, name: &str) -> Vec<i64> {
    r.read_i64(name).unwrap_or_else(|e| panic!("{name}: {e}")).1
}

fn floats(r: &SafetensorsReader, name: &str) -> Vec<f32> {
    r.read_f32(name).unwrap_or_else(|e| panic!("{name}: {e}")).1
}

fn tokens(ids: &[i64]) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &dev())
}

/// `[1, t, vocab]` logits at the fixture's columns, row-major `[t, cols]`.
fn at_cols(logits: Tensor<3>, cols: &[i64]) -> Vec<f32> {
    let [_, t, v] = logits.dims();
    let all = vals(logits);
    let mut out = Vec::with_capacity(t * cols.len());
    for p in 0..t {
        out.extend(cols.iter().map(|&c| all[p * v + c as usize]));
    }
    out
}

/// Full-vocabulary argmax per position of `[1, t, vocab]` logits.
fn argmax(logits: &Tensor<3>) -> Vec<i64> {
    let [_, t, _] = logits.dims();
    logits
        .clone()
        .argmax(2)
        .reshape([t])
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap()
}

/// The largest |ours - reference| over every compared value, relative to the largest
/// |logit| of the reference at the compared positions.
fn rel_err(ours: &[f32], want: &[f32], maxabs: f32) -> f32 {
    max_diff(ours, want) / maxabs
}

fn load(rel: &str, residency: Residency) -> Option<Box<dyn LanguageModel>> {
    let path = model_file(rel)?;
    Some(load_model_with(&path, &dev(), residency).expect("the model loads"))
}

/// Logits at `len` tokens within 1e-4 of transformers' (relative to the largest
/// logit), the same argmax everywhere except at near-ties.
fn logits_match(model: &dyn LanguageModel, fixture_file: &str, len: usize) {
    let r = SafetensorsReader::open(&fixture(fixture_file)).unwrap();
    let ids = ints(&r, &format!("ids_{len}"));
    let cols = ints(&r, "cols");
    let want = floats(&r, &format!("logits_{len}"));
    let want_argmax = ints(&r, &format!("argmax_{len}"));
    let gap = floats(&r, &format!("gap_{len}"));
    let maxabs = floats(&r, &format!("maxabs_{len}"));
    // Positions kept (every position, or `rows_{len}` when the fixture subsamples).
    let rows: Vec<usize> = match r.read_i64(&format!("rows_{len}")) {
        Ok((_, v)) => v.into_iter().map(|x| x as usize).collect(),
        Err(_) => (0..ids.len()).collect(),
    };
    let logits = model
        .forward(tokens(&ids), &HookSpec::new())
        .unwrap()
        .logits;
    let top = argmax(&logits);
    let ours_all = at_cols(logits, &cols);
    let nc = cols.len();
    let ours: Vec<f32> = rows
        .iter()
        .flat_map(|&p| ours_all[p * nc..(p + 1) * nc].to_vec())
        .collect();
    let scale = maxabs.iter().copied().fold(0.0f32, f32::max);
    let err = rel_err(&ours, &want, scale);
    eprintln!("{fixture_file} at {len} tokens: max |d logit| / max |logit| = {err:.2e}");
    assert!(
        err <= 1e-4,
        "{fixture_file} at {len} tokens: relative error {err:.2e} > 1e-4"
    );
    let mut ties = 0;
    for (k, &p) in rows.iter().enumerate() {
        if top[p] != want_argmax[k] {
            // A near-tie: the reference's top two within what the error allows.
            assert!(
                gap[k] <= 4.0 * err * scale + 1e-5,
                "{fixture_file} at {len} tokens, position {p}: argmax {} vs transformers' {} (gap {})",
                top[p],
                want_argmax[k],
                gap[k]
            );
            ties += 1;
        }
    }
    eprintln!(
        "  argmax equal at {} of {} positions ({ties} near-ties)",
        rows.len() - ties,
        rows.len()
    );
}

#[test]
fn smollm2_logits_match_transformers_at_16_512_and_2048_tokens() {
    let Some(m) = load(SMOLLM2, Residency::F32) else {
        return;
    };
    for len in [16, 512, 2048] {
        logits_match(m.as_ref(), "logits-smollm2.safetensors", len);
    }
}

#[test]
fn gemma3_logits_match_transformers_at_16_512_and_2048_tokens() {
    let Some(m) = load(GEMMA3, Residency::F32) else {
        return;
    };
    for len in [16, 512, 2048] {
        logits_match(m.as_ref(), "logits-gemma3.safetensors", len);
    }
}

/// Hook activations at 16 tokens equal transformers' at the same points.
fn hooks_match(model: &dyn LanguageModel, name: &str) {
    let r = SafetensorsReader::open(&fixture(&format!("hooks-{name}.safetensors"))).unwrap();
    let lr = SafetensorsReader::open(&fixture(&format!("logits-{name}.safetensors"))).unwrap();
    let ids = ints(&lr, "ids_16");
    // The fixture's names are TransformerLens'; the final norm's output is our
    // `hook_final_norm` (TL's `ln_final.hook_normalized` is before the norm's weight,
    // the fixture's after it, as ours).
    let ours = |n: &str| match n {
        "ln_final.hook_normalized" => "hook_final_norm".to_string(),
        other => other.to_string(),
    };
    let names: Vec<String> = r
        .names()
        .filter(|n| n.starts_with("blocks.") || n.starts_with("ln_final"))
        .map(|s| s.to_string())
        .collect();
    assert!(names.len() >= 6, "{name}: the fixture holds {names:?}");
    let mut spec = HookSpec::new();
    for n in &names {
        spec = spec.capture(&ours(n)).unwrap();
    }
    let out = model.forward(tokens(&ids), &spec).unwrap();
    for n in &names {
        let want = floats(&r, n);
        let got: Vec<f32> = out.cache.get_name(&ours(n)).unwrap().to_vec();
        assert_eq!(got.len(), want.len(), "{name} {n}: sizes differ");
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = rel_err(&got, &want, scale);
        eprintln!("{name} {n}: relative error {err:.2e}");
        assert!(err <= 1e-4, "{name} {n}: relative error {err:.2e} > 1e-4");
    }
}

#[test]
fn smollm2_hook_points_match_transformers() {
    if let Some(m) = load(SMOLLM2, Residency::F32) {
        hooks_match(m.as_ref(), "smollm2");
    }
}

#[test]
fn gemma3_hook_points_match_transformers() {
    if let Some(m) = load(GEMMA3, Residency::F32) {
        hooks_match(m.as_ref(), "gemma3");
    }
}

/// A head ablation and a head-output patch through hooks equal the same done with
/// PyTorch forward hooks on transformers' model.
fn interventions_match(model: &dyn LanguageModel, name: &str) {
    let r =
        SafetensorsReader::open(&fixture(&format!("interventions-{name}.safetensors"))).unwrap();
    let lr = SafetensorsReader::open(&fixture(&format!("logits-{name}.safetensors"))).unwrap();
    let ids = ints(&lr, "ids_16");
    let cols = ints(&lr, "cols");
    let one = |k: &str| ints(&r, k)[0] as usize;
    let scale = floats(&lr, "maxabs_16").into_iter().fold(0.0f32, f32::max);
    // (a) zero one head's z everywhere.
    let (l, h) = (one("ablate_layer"), one("ablate_head"));
    let spec = HookSpec::new()
        .intervene(
            &format!("blocks.{l}.attn.hook_z"),
            Action::Zero,
            Scope::heads([h]),
        )
        .unwrap();
    let got = at_cols(model.forward(tokens(&ids), &spec).unwrap().logits, &cols);
    let err = rel_err(&got, &floats(&r, "ablate_logits"), scale);
    eprintln!("{name} ablation of L{l}H{h}: relative error {err:.2e}");
    assert!(err <= 1e-4, "{name} ablation: {err:.2e}");
    // (b) patch one head's z at one position from the other prompt.
    let (l, h, p) = (one("patch_layer"), one("patch_head"), one("patch_pos"));
    let point = format!("blocks.{l}.attn.hook_z");
    let source = model
        .forward(
            tokens(&ints(&r, "ids_b")),
            &HookSpec::new().capture(&point).unwrap(),
        )
        .unwrap()
        .cache;
    let spec = HookSpec::new()
        .intervene(
            &point,
            Action::Patch(Arc::new(source)),
            Scope::heads([h]).with_positions([p]),
        )
        .unwrap();
    let got = at_cols(model.forward(tokens(&ids), &spec).unwrap().logits, &cols);
    let err = rel_err(&got, &floats(&r, "patch_logits"), scale);
    eprintln!("{name} patch of L{l}H{h} at {p}: relative error {err:.2e}");
    assert!(err <= 1e-4, "{name} patch: {err:.2e}");
}

#[test]
fn smollm2_ablation_and_patch_match_transformers_hooks() {
    if let Some(m) = load(SMOLLM2, Residency::F32) {
        interventions_match(m.as_ref(), "smollm2");
    }
}

#[test]
fn gemma3_ablation_and_patch_match_transformers_hooks() {
    if let Some(m) = load(GEMMA3, Residency::F32) {
        interventions_match(m.as_ref(), "gemma3");
    }
}

/// Greedy decoding: the same new tokens as transformers' `generate(do_sample=False)`
/// for every fixture prompt (64 tokens; transformers ignored EOS, so ours runs the full
/// 64 too), except from a step whose top-2 gap is below what the logits' agreement
/// (1e-4 relative) can decide.
fn generation_matches(model: &dyn LanguageModel, name: &str) {
    let text = std::fs::read_to_string(fixture(&format!("generate-{name}.json"))).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = j["cases"].as_array().unwrap();
    assert!(cases.len() >= 5, "{name}: {} cases", cases.len());
    for (i, c) in cases.iter().enumerate() {
        let ids: Vec<u32> = serde_json::from_value(c["input_ids"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(c["new_ids"].clone()).unwrap();
        let gaps: Vec<f64> = serde_json::from_value(c["step_gap"].clone()).unwrap_or_default();
        let got =
            phaselens::model::generate::greedy(model, &ids, want.len(), None, &dev()).unwrap();
        let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
        if let Some(s) = first_diff {
            let gap = gaps.get(s).copied().unwrap_or(f64::INFINITY);
            assert!(
                gap < 1e-2,
                "{name} case {i} ({}): step {s} gives {} vs transformers' {} (top-2 gap {gap})",
                c["prompt"],
                got[s],
                want[s]
            );
            eprintln!("{name} case {i}: equal up to step {s}, a near-tie (gap {gap})");
        } else {
            eprintln!("{name} case {i}: {} new tokens equal", want.len());
        }
    }
}

#[test]
fn smollm2_greedy_generation_matches_transformers() {
    if let Some(m) = load(SMOLLM2, Residency::F32) {
        generation_matches(m.as_ref(), "smollm2");
    }
}

#[test]
fn gemma3_greedy_generation_matches_transformers() {
    if let Some(m) = load(GEMMA3, Residency::F32) {
        generation_matches(m.as_ref(), "gemma3");
    }
}

/// Quantised blocks resident as stored (dequantised per use) give the f32 load's
/// logits up to the order of float sums (the same dequantised values).
#[test]
fn stored_blocks_match_the_f32_load() {
    for rel in [SMOLLM2, GEMMA3] {
        let (Some(a), Some(b)) = (load(rel, Residency::F32), load(rel, Residency::Stored)) else {
            return;
        };
        let by = b.resident_bytes().unwrap_or_default();
        assert!(
            by.keys().any(|k| k.starts_with('Q') || k.starts_with('q')),
            "{rel}: no quantised blocks resident: {by:?}"
        );
        let ids: Vec<i64> = (0..48).map(|i| 100 + 37 * i).collect();
        let la = vals(a.forward(tokens(&ids), &HookSpec::new()).unwrap().logits);
        let lb = vals(b.forward(tokens(&ids), &HookSpec::new()).unwrap().logits);
        let err = max_rel(&lb, &la);
        eprintln!("{rel}: stored vs f32 relative difference {err:.2e}, resident {by:?}");
        assert!(err <= 1e-5, "{rel}: stored vs f32 {err:e}");
    }
}

/// Tiny Hugging Face checkpoints written by transformers (LlamaForCausalLM in BF16 with
/// GQA, Qwen3 with Q/K norms and tied embeddings, Qwen2 with q/k/v biases, Gemma 3 with
/// sliding (window 4) and global layers): logits equal transformers'.
#[test]
fn tiny_hugging_face_checkpoints_match_transformers() {
    for name in ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-gemma3"] {
        let dir = fixture(name);
        let m =
            load_model_with(&dir, &dev(), Residency::F32).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = SafetensorsReader::open(&dir.join("reference.safetensors")).unwrap();
        let (shape, ids) = r.read_i64("ids").unwrap();
        let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [shape[0], shape[1]]), &dev());
        let got = vals(m.forward(t, &HookSpec::new()).unwrap().logits);
        let want = floats(&r, "logits");
        let err = max_rel(&got, &want);
        eprintln!("{name}: relative error {err:.2e}");
        assert!(err <= 1e-4, "{name}: relative error {err:.2e}");
    }
}

/// What a user gets wrong, named: an unknown architecture, a prompt longer than the
/// context, an overlay the model cannot take.
#[test]
fn pretrained_errors_name_what_to_fix() {
    let Some(path) = model_file(SMOLLM2) else {
        return;
    };
    let m = load_model_with(&path, &dev(), Residency::Stored).unwrap();
    let ids: Vec<i64> = vec![1; 8193];
    let e = m
        .forward(tokens(&ids), &HookSpec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("8193") && e.contains("8192"), "{e}");
    // A config.json of an architecture phaselens does not load.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "falcon"}"#,
    )
    .unwrap();
    let e = match load_model_with(dir.path(), &dev(), Residency::F32) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a falcon config loaded"),
    };
    assert!(
        e.contains("falcon") && e.contains("llama") && e.contains("gemma3"),
        "{e}"
    );
}

/// The MLP's hook points on the kvc decoder every pretrained model runs as: `mlp.hook_pre`
/// is the gate pre-activation (`[b, T, d_ff]`), `mlp.hook_post` the down projection's
/// input, so zeroing `hook_post` zeroes the MLP's output (no bias) exactly as zeroing
/// `hook_mlp_out` does, and capturing them changes nothing.
#[test]
fn mlp_hook_points_are_the_gate_and_the_down_input() {
    use phaselens::model::kvc::MlpAct;
    use phaselens::model::weights::{RandomInit, Vb};
    use phaselens::model::{KvcConfig, KvcModel};
    for act in [MlpAct::Silu, MlpAct::GeluTanh] {
        let mut c = KvcConfig::tiny().full_attention();
        c.arch.mlp_act = act;
        let m = KvcModel::new(&c, &Vb::new(&RandomInit { seed: 3 }, &dev())).unwrap();
        let ids: Vec<i64> = (0..20).map(|i| (i * 5 + 1) % 37).collect();
        let plain = vals(m.forward(tokens(&ids), &HookSpec::new()).unwrap().logits);
        let cap = HookSpec::new().capture("blocks.*.mlp.*").unwrap();
        let out = m.forward(tokens(&ids), &cap).unwrap();
        assert_eq!(
            vals(out.logits),
            plain,
            "{act:?}: capturing changed the logits"
        );
        let pre = out.cache.get_name("blocks.1.mlp.hook_pre").unwrap();
        assert_eq!(pre.shape(), &[1, 20, c.d_ff]);
        let zero = |point: &str| {
            let spec = HookSpec::new()
                .intervene(point, Action::Zero, Scope::all())
                .unwrap();
            vals(m.forward(tokens(&ids), &spec).unwrap().logits)
        };
        let a = zero("blocks.1.mlp.hook_post");
        let b = zero("blocks.1.hook_mlp_out");
        let d = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |x, (p, q)| x.max((p - q).abs()));
        assert!(
            d < 1e-5,
            "{act:?}: zeroing hook_post vs hook_mlp_out differ by {d}"
        );
        assert!(a != plain, "{act:?}: zeroing the MLP changed nothing");
    }
}

/// `models:NAME` names a model in the cache wherever a model path is taken: the model
/// and its tokenizer (what `generate --model models:...` needs).
#[test]
fn models_prefix_names_a_cached_model_and_its_tokenizer() {
    if model_file(SMOLLM2).is_none() {
        return;
    }
    let p = Path::new("models:smollm2-135m-instruct");
    let tok = phaselens::tokenizer::Tokenizer::open(p).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let m = load_model_with(p, &dev(), Residency::Stored).unwrap();
    assert_eq!(m.info().arch, "llama");
}
