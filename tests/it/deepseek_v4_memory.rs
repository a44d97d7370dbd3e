//! Peak memory while loading a DeepSeek-V4 checkpoint: a synthetic release-style
//! checkpoint (DeepSeek naming, FP8 e4m3 + ue8m0 block scales for the attention and
//! expert matrices, BF16 for the rest, 3 shards, ~230 MB as f32) is loaded by
//! `phaselens inspect` in its own process; the peak resident set while loading must
//! stay within 1.5x the model's f32 size. With FP4 routed experts, the peak resident
//! set of loading + one forward (`plan --measure`, its own process) with the weights
//! kept as stored against dequantised to f32 (issue 22 §1). An opt-in writer
//! (`PHASELENS_REALWIDTH_DIR=DIR`, ignored test) writes the same kind of checkpoint at
//! V4-Flash's width for measuring by hand.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use burn::tensor::Device;
use phaselens::model::deepseek_v4::checkpoint::release_name;
use phaselens::model::deepseek_v4::{DeepseekV4Config, DeepseekV4Model};
use phaselens::model::weights::{Init, Vb, WeightSource};

/// Records what the model asks for (and hands out zeros).
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, Vec<usize>, bool)>>);

impl WeightSource for Recorder {
    fn float(&self, name: &str, shape: &[usize], _: Init) -> phaselens::Result<Vec<f32>> {
        self.0
            .lock()
            .unwrap()
            .push((name.into(), shape.to_vec(), false));
        Ok(vec![0.0; shape.iter().product()])
    }
    fn int(
        &self,
        name: &str,
        shape: &[usize],
        _: &dyn Fn(usize) -> i64,
    ) -> phaselens::Result<Vec<i64>> {
        self.0
            .lock()
            .unwrap()
            .push((name.into(), shape.to_vec(), true));
        Ok(vec![0; shape.iter().product()])
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Fp8,
    /// Packed e2m1, two per byte (the shape is the file's `[rows, cols / 2]`).
    Fp4,
    Scale,
    Bf16,
    F32,
    I32(i64),
}

struct Entry {
    name: String,
    shape: Vec<usize>,
    kind: Kind,
}

impl Entry {
    fn dtype(&self) -> &'static str {
        match self.kind {
            Kind::Fp8 => "F8_E4M3",
            Kind::Fp4 => "I8",
            Kind::Scale => "F8_E8M0",
            Kind::Bf16 => "BF16",
            Kind::F32 => "F32",
            Kind::I32(_) => "I32",
        }
    }
    fn nbytes(&self) -> usize {
        let n: usize = self.shape.iter().product();
        n * match self.kind {
            Kind::Fp8 | Kind::Fp4 | Kind::Scale => 1,
            Kind::Bf16 => 2,
            Kind::F32 | Kind::I32(_) => 4,
        }
    }
    fn write(&self, w: &mut impl Write, rng: &mut Rng) {
        let n: usize = self.shape.iter().product();
        let mut buf = Vec::with_capacity(self.nbytes());
        for i in 0..n {
            let r = rng.next();
            match self.kind {
                Kind::Fp8 => buf.push(((r % 0x7f) as u8) | ((r >> 8) as u8 & 0x80)),
                Kind::Fp4 => buf.push(r as u8),
                Kind::Scale => buf.push(120 + (r % 4) as u8),
                Kind::Bf16 => {
                    let x = ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32 * 0.1;
                    buf.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
                }
                Kind::F32 => buf.extend_from_slice(&1.0f32.to_le_bytes()),
                Kind::I32(e) => buf.extend_from_slice(&(((i as i64) % e) as i32).to_le_bytes()),
            }
        }
        w.write_all(&buf).unwrap();
    }
}

fn write_shard(path: &Path, entries: &[&Entry], rng: &mut Rng) {
    let mut header = serde_json::Map::new();
    let mut off = 0;
    for e in entries {
        header.insert(
            e.name.clone(),
            serde_json::json!({"dtype": e.dtype(), "shape": e.shape, "data_offsets": [off, off + e.nbytes()]}),
        );
        off += e.nbytes();
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    for e in entries {
        e.write(&mut f, rng);
    }
}

const CONFIG: &str = r#"{
  "model_type": "deepseek_v4", "vocab_size": 8192, "hidden_size": 512,
  "moe_intermediate_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8,
  "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 32, "q_lora_rank": 384,
  "o_groups": 4, "o_lora_rank": 256, "n_routed_experts": 16, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
  "swiglu_limit": 10.0, "num_hash_layers": 2, "compress_ratios": [0, 4, 128, 4, 128, 4, 0],
  "compress_rope_theta": 160000, "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1},
  "sliding_window": 128, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16,
  "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
  "hidden_act": "silu", "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
}"#;

/// Write the synthetic release checkpoint; returns its f32 size in bytes.
fn synthetic_release_checkpoint(dir: &Path) -> usize {
    synthetic_checkpoint(dir, CONFIG, false)
}

/// Write a synthetic release checkpoint of `config` (routed experts FP4 when `fp4`);
/// returns its f32 size in bytes.
fn synthetic_checkpoint(dir: &Path, config: &str, fp4: bool) -> usize {
    let cfg = DeepseekV4Config::from_json(config).unwrap();
    let rec = Recorder::default();
    drop(DeepseekV4Model::new(&cfg, &Vb::new(&rec, &Device::flex())).unwrap());
    let asked = rec.0.into_inner().unwrap();
    let f32_bytes: usize = asked
        .iter()
        .filter(|a| !a.2)
        .map(|a| 4 * a.1.iter().product::<usize>())
        .sum();
    let fp8 = |release: &str| {
        [
            "attn.wq_a.weight",
            "attn.wq_b.weight",
            "attn.wkv.weight",
            "attn.wo_a.weight",
            "attn.wo_b.weight",
            "indexer.wq_b.weight",
            ".w1.weight",
            ".w2.weight",
            ".w3.weight",
        ]
        .iter()
        .any(|s| release.ends_with(s))
    };
    let mut entries: Vec<(usize, Entry)> = Vec::new();
    let mut push = |shard: usize, name: String, shape: Vec<usize>, kind: Kind| {
        let (grid, shape) = match kind {
            Kind::Fp8 => (
                Some(vec![shape[0].div_ceil(128), shape[1].div_ceil(128)]),
                shape,
            ),
            Kind::Fp4 => (
                Some(vec![shape[0], shape[1] / 32]),
                vec![shape[0], shape[1] / 2],
            ),
            _ => (None, shape),
        };
        if let Some(grid) = grid {
            let scale = format!("{}.scale", name.strip_suffix(".weight").unwrap());
            entries.push((
                shard,
                Entry {
                    name: scale,
                    shape: grid,
                    kind: Kind::Scale,
                },
            ));
        }
        entries.push((shard, Entry { name, shape, kind }));
    };
    let expert = if fp4 { Kind::Fp4 } else { Kind::Fp8 };
    for (module, shape, is_int) in asked {
        let layer = module
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        let shard = layer.map(|l| 1 + l / 3).unwrap_or(0);
        if let Some(l) = layer
            && module.contains(".mlp.experts.")
        {
            let (e, rows, cols) = (shape[0], shape[1], shape[2]);
            for ex in 0..e {
                let p = format!("layers.{l}.ffn.experts.{ex}");
                if module.ends_with("gate_up_proj") {
                    push(
                        shard,
                        format!("{p}.w1.weight"),
                        vec![rows / 2, cols],
                        expert,
                    );
                    push(
                        shard,
                        format!("{p}.w3.weight"),
                        vec![rows / 2, cols],
                        expert,
                    );
                } else {
                    push(shard, format!("{p}.w2.weight"), vec![rows, cols], expert);
                }
            }
            continue;
        }
        let release =
            release_name(&module).unwrap_or_else(|| panic!("no release name for {module}"));
        let kind = if is_int {
            Kind::I32(cfg.n_routed_experts as i64)
        } else if shape.len() == 2 && fp8(&release) {
            Kind::Fp8
        } else if shape.len() == 2 {
            Kind::Bf16
        } else {
            Kind::F32
        };
        push(shard, release, shape, kind);
    }
    // the MTP layer, which loaders skip
    push(
        2,
        "mtp.0.attn.wq_a.weight".into(),
        vec![cfg.q_lora_rank, cfg.hidden_size],
        Kind::Fp8,
    );
    let mut by_shard: BTreeMap<usize, Vec<&Entry>> = BTreeMap::new();
    for (s, e) in &entries {
        by_shard.entry(*s).or_default().push(e);
    }
    let n = by_shard.len();
    let mut map = serde_json::Map::new();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for (i, (_, es)) in by_shard.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        write_shard(&dir.join(&file), es, &mut rng);
        for e in es {
            map.insert(e.name.clone(), serde_json::Value::from(file.clone()));
        }
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&serde_json::json!({"metadata": {}, "weight_map": map}))
            .unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    f32_bytes
}

#[test]
fn loading_peak_rss_is_within_1_5x_of_the_f32_model() {
    let dir = tempfile::tempdir().unwrap();
    let f32_bytes = synthetic_release_checkpoint(dir.path());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args(["inspect", "--json", "--model"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["model_f32_bytes"].as_u64().unwrap() as usize, f32_bytes);
    let Some(ratio) = j["peak_over_model_f32"].as_f64() else {
        eprintln!("no /proc peak RSS on this system: {j}");
        return;
    };
    eprintln!(
        "synthetic release checkpoint (FP8 + BF16, 3 shards): model {:.1} MiB in f32, load {:.2} s, peak RSS increase {:.1} MiB = {ratio:.3}x",
        f32_bytes as f64 / 1048576.0,
        j["load_s"].as_f64().unwrap(),
        j["load_peak_rss_increase_bytes"].as_u64().unwrap() as f64 / 1048576.0
    );
    assert!(
        ratio <= 1.5,
        "peak RSS while loading is {ratio:.3}x the f32 model: {j}"
    );
}

/// [`CONFIG`] with its routed experts stored as FP4.
fn fp4_config() -> String {
    let mut v: serde_json::Value = serde_json::from_str(CONFIG).unwrap();
    v["expert_dtype"] = "fp4".into();
    v.to_string()
}

/// `phaselens plan --measure` of `dir` at `tokens` with `--weights weights`: (peak RSS
/// increase of load + one forward, the plan's estimate), `None` without /proc.
fn measure(dir: &Path, tokens: &str, weights: &str) -> Option<(f64, f64)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_phaselens"))
        .args([
            "plan",
            "--tokens",
            tokens,
            "--measure",
            "--json",
            "--weights",
        ])
        .arg(weights)
        .arg("--model")
        .arg(dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("no /proc/self/status") {
        return None;
    }
    assert!(out.status.success(), "{err}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let m = &j["measured"];
    Some((
        m["peak_rss_increase"].as_f64().unwrap(),
        m["estimate"].as_f64().unwrap(),
    ))
}

#[test]
fn stored_weights_cut_the_peak_rss_of_loading_and_a_forward() {
    let dir = tempfile::tempdir().unwrap();
    let f32_bytes = synthetic_checkpoint(dir.path(), &fp4_config(), true);
    let (Some((f, fe)), Some((s, se))) = (
        measure(dir.path(), "128", "f32"),
        measure(dir.path(), "128", "stored"),
    ) else {
        eprintln!("no /proc peak RSS on this system");
        return;
    };
    let mib = |b: f64| b / 1048576.0;
    eprintln!(
        "synthetic FP8 + FP4 + BF16 checkpoint ({:.1} MiB as f32), load + one forward of 128 tokens: peak RSS increase f32 {:.1} MiB (plan {:.1}), stored {:.1} MiB (plan {:.1}): {:.2}x less",
        mib(f32_bytes as f64),
        mib(f),
        mib(fe),
        mib(s),
        mib(se),
        f / s
    );
    assert!(s < 0.5 * f, "stored {s} vs f32 {f}");
}

/// V4-Flash's widths (hidden 4096, 64 heads x 512, q_lora 1024, o 8 x 1024, indexer 64 x
/// 128, window 128, CSA 4 / HCA 128, hc 4, the real vocabulary) with 3 layers (sliding,
/// CSA, HCA; the first hash-routed) of 8 FP4 experts (top 2) of width 2048.
const REALWIDTH: &str = r#"{
  "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
  "moe_intermediate_size": 2048, "num_hidden_layers": 3, "num_attention_heads": 64,
  "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
  "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 8, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
  "swiglu_limit": 10.0, "num_hash_layers": 1, "compress_ratios": [0, 4, 128, 0],
  "compress_rope_theta": 160000, "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1},
  "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
  "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
  "hidden_act": "silu", "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "expert_dtype": "fp4",
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
}"#;

/// Writes the real-width synthetic checkpoint to `$PHASELENS_REALWIDTH_DIR` (about 2.9
/// GB as stored, 8 GB as f32), for `/usr/bin/time -v phaselens plan --model DIR
/// --measure --weights stored|f32` by hand (docs/models.md, "Residency").
#[test]
#[ignore = "writes ~3 GB; run with PHASELENS_REALWIDTH_DIR=DIR --run-ignored only"]
fn write_realwidth_synthetic_checkpoint() {
    let Ok(dir) = std::env::var("PHASELENS_REALWIDTH_DIR") else {
        eprintln!("set PHASELENS_REALWIDTH_DIR to write the checkpoint");
        return;
    };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).unwrap();
    let f32_bytes = synthetic_checkpoint(dir, REALWIDTH, true);
    eprintln!(
        "wrote {} ({:.2} GiB as f32)",
        dir.display(),
        f32_bytes as f64 / (1u64 << 30) as f64
    );
}
