//! A pretrained model through the library face: load SmolLM2-135M-Instruct from its GGUF
//! in the model cache (`models:` path), tokenize a prompt with the model's own
//! tokenizer, decode greedily, then put Quest-style block selection on its attention and
//! read which blocks layer 20 kept for the last query.
//!
//! `cargo run --example pretrained` (the model comes from `bash scripts/fetch-models.sh`;
//! without it the example says so and exits).

use std::path::Path;

use phaselens::model::compression::Overlay;
use phaselens::model::generate::greedy;
use phaselens::model::pretrained::detect;
use phaselens::model::stored::Residency;
use phaselens::model::{load_model_as, load_model_with};
use phaselens::prelude::*;
use phaselens::tokenizer::Tokenizer;

fn main() -> phaselens::Result<()> {
    let path = Path::new("models:smollm2-135m-instruct");
    if detect(path).is_none() {
        println!("SmolLM2 is not in the model cache: bash scripts/fetch-models.sh fetches it");
        return Ok(());
    }
    let device = DeviceSpec::Cpu.device()?;
    let tok = Tokenizer::open(path)?;
    let prompt = tok.encode("The capital of France is", true)?;
    let model = load_model_with(path, &device, Residency::Stored)?;
    let new = greedy(model.as_ref(), &prompt, 4, tok.eos(), &device)?;
    let text = tok.decode(&new, true)?;
    println!("{} -> {text:?}", model.info().arch);
    assert!(text.contains("Paris"), "greedy decoding gave {text:?}");

    // Block selection (blocks of 4, the best 2 per query, the last 4 tokens raw).
    let overlay: Overlay = "kind=select,block=4,top_k=2,window=4"
        .parse()
        .map_err(phaselens::Error::Other)?;
    let model = load_model_as(path, &device, Residency::Stored, Some(&overlay))?;
    let text = "apple: red\nriver: two\nstone: gold\ncloud: six\nQuery:\nriver:";
    let ids: Vec<i64> = tok.encode(text, true)?.iter().map(|&i| i as i64).collect();
    let t = ids.len();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, t]), &device);
    let spec = HookSpec::new().capture("blocks.20.attn.indexer.hook_selected")?;
    let out = model.forward(tokens, &spec)?;
    let kept = out.cache.get_name("blocks.20.attn.indexer.hook_selected")?;
    let n = kept.shape()[2];
    let last: Vec<usize> = kept.to_vec()[(t - 1) * n..t * n]
        .iter()
        .enumerate()
        .filter(|&(_, &k)| k > 0.5)
        .map(|(b, _)| b)
        .collect();
    println!("{overlay}: the last query of {t} tokens keeps blocks {last:?} of {n} in layer 20");
    assert_eq!(last.len(), 2, "top 2 blocks kept");
    Ok(())
}
