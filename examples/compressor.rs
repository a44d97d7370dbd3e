//! A trained compressor on a pretrained model, through the library face: read the
//! shipped compressor of SmolLM2-135M-Instruct (`experiments/compressors/smollm2-w16s8`,
//! trained by `phaselens train experiments/compressors/smollm2-w16s8.toml`), put it on
//! the model's attention as the `learned` overlay, and compare it with training-free
//! mean pooling of the same windows (`pool`) by how far each moves the model's
//! next-token distribution from the uncompressed model's on a passage: the mean KL
//! divergence over the positions that read pooled entries.
//!
//! `cargo run --example compressor` (the model comes from `bash scripts/fetch-models.sh`;
//! without it the example says so and exits).

use std::path::{Path, PathBuf};

use phaselens::model::compression::Overlay;
use phaselens::model::compression::learned::{folder, read_meta};
use phaselens::model::load_model_as;
use phaselens::model::pretrained::detect;
use phaselens::model::stored::Residency;
use phaselens::prelude::*;
use phaselens::tokenizer::Tokenizer;

/// A passage the compressor never saw (its training text is the model's own samples).
const PASSAGE: &str = "The lighthouse keeper climbed the spiral stairs every evening at \
dusk. He carried a small brass lantern, a notebook with a green cover and a flask of \
tea that his sister had filled in the morning. At the top he wiped the great lens, \
checked the clockwork that turned it and wrote the weather in the notebook: wind from \
the north-west, a light swell, fog expected after midnight. Ships passing the cape \
relied on the beam to find the channel between the rocks, and in forty years not one \
of them had been lost on his watch. When the fog came he started the horn as well, \
two long blasts every minute, and sat by the window listening for engines.";

fn main() -> phaselens::Result<()> {
    let model_path = Path::new("models:smollm2-135m-instruct");
    if detect(model_path).is_none() {
        println!("SmolLM2 is not in the model cache: bash scripts/fetch-models.sh fetches it");
        return Ok(());
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let checkpoint = root.join("experiments/compressors/smollm2-w16s8");
    let meta = read_meta(&folder(&checkpoint.to_string_lossy()))?;
    println!(
        "compressor {}: windows of {} every {} tokens, {} raw, {} of {} steps, final KL {:.3}",
        meta.name,
        meta.window,
        meta.stride,
        meta.local,
        meta.steps,
        meta.recipe_steps,
        meta.final_kl
    );

    let device = DeviceSpec::Cpu.device()?;
    let tok = Tokenizer::open(model_path)?;
    let ids = tok.encode(PASSAGE, false)?;
    let full = log_probs(model_path, None, &ids, &device)?;
    let pool = Overlay::Pool {
        window: meta.window,
        stride: meta.stride,
        local: meta.local,
    };
    let learned = Overlay::Learned {
        checkpoint: checkpoint.to_string_lossy().into_owned(),
        window: meta.window,
        stride: meta.stride,
        local: meta.local,
    };
    // The first position whose query reads a pooled entry: a window has closed before
    // the raw window of `local` tokens begins.
    let first = meta.local + meta.window;
    let mut kls = Vec::new();
    for overlay in [&pool, &learned] {
        let lp = log_probs(model_path, Some(overlay), &ids, &device)?;
        let kl = mean_kl(&full, &lp, tok_vocab(&full, ids.len()), first);
        println!(
            "{overlay}: KL to the uncompressed model {kl:.3} nats per position ({} positions)",
            ids.len() - first
        );
        kls.push(kl);
    }
    assert!(
        kls[1] < kls[0],
        "the trained compressor should stay closer to the model than mean pooling: {kls:?}"
    );
    Ok(())
}

/// Log-softmax of the model's logits over the passage, `[pos * vocab]`.
fn log_probs(
    path: &Path,
    overlay: Option<&Overlay>,
    ids: &[u32],
    device: &burn::tensor::Device,
) -> phaselens::Result<Vec<f32>> {
    let model = load_model_as(path, device, Residency::Stored, overlay)?;
    let t = ids.len();
    let tokens: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, t]), device);
    let out = model.forward(tokens, &HookSpec::new())?;
    let lp = burn::tensor::activation::log_softmax(out.logits, 2);
    lp.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| Error::Other(format!("reading logits back: {e:?}")))
}

/// The vocabulary size of `[pos * vocab]` log-probabilities over `t` positions.
fn tok_vocab(lp: &[f32], t: usize) -> usize {
    lp.len() / t
}

/// Mean over positions `from..` of KL(p || q), p and q given as log-probabilities.
fn mean_kl(p: &[f32], q: &[f32], vocab: usize, from: usize) -> f64 {
    let t = p.len() / vocab;
    let kl: f64 = (from..t)
        .map(|i| {
            let (pi, qi) = (
                &p[i * vocab..(i + 1) * vocab],
                &q[i * vocab..(i + 1) * vocab],
            );
            pi.iter()
                .zip(qi)
                .map(|(&a, &b)| (a as f64).exp() * (a as f64 - b as f64))
                .sum::<f64>()
        })
        .sum();
    kl / (t - from) as f64
}
