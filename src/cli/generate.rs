//! `phaselens generate`: greedy decoding from a text prompt (pretrained models).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;

use phaselens::device::DeviceSpec;
use phaselens::model::load_model_as;
use phaselens::tokenizer::Tokenizer;

/// Greedy decoding from a text prompt.
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens generate --model ~/.cache/phaselens/models/smollm2-135m-instruct \\
      --prompt 'What is the capital of France?' --chat
  phaselens generate --model ~/.cache/phaselens/models/gemma3-270m/gemma-3-270m-q4_k_m.gguf \\
      --prompt 'The pass key is 71432. Remember it. The pass key is' --max-new-tokens 8

The model's own tokenizer encodes the prompt (with its BOS when the model adds one;
--chat wraps it in the model's chat template for one user turn). Decoding is greedy (the
argmax at each step) and stops at the end-of-sequence token or after --max-new-tokens.
Prints the continuation; --json prints the prompt's ids, the new ids and the text.")]
pub struct GenerateArgs {
    /// A `.gguf` file, or a folder holding one (or config.json + safetensors +
    /// tokenizer.json).
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// New tokens at most.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Wrap the prompt in the model's chat template (one user turn + the assistant's
    /// generation prompt).
    #[arg(long)]
    pub chat: bool,
    /// Print JSON (prompt ids, new ids, text).
    #[arg(long)]
    pub json: bool,
    /// Device: cpu, wgpu[:N], tch-cpu, tch-cuda:N, cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
    /// Quantised weights `stored` (dequantised where used) or `f32` (on load).
    #[arg(long, value_name = "stored|f32", default_value = "stored")]
    pub weights: phaselens::model::stored::Residency,
    /// A training-free compression overlay inside attention, e.g.
    /// `kind=select,block=8,top_k=4,window=32` or `kind=pool,window=8,stride=8,local=32`
    /// (the keys of `[model.compression]`, docs/experiments.md).
    #[arg(long, value_name = "kind=...,key=value")]
    pub compression: Option<phaselens::model::compression::Overlay>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let device = args.device.device()?;
    let tok = Tokenizer::open(&args.model)
        .with_context(|| format!("the tokenizer of {}", args.model.display()))?;
    let model = load_model_as(
        &args.model,
        &device,
        args.weights,
        args.compression.as_ref(),
    )
    .with_context(|| format!("loading model {}", args.model.display()))?;
    let text = if args.chat {
        tok.apply_chat(&args.prompt)?
    } else {
        args.prompt.clone()
    };
    // A chat template writes its own BOS; a plain prompt gets the model's.
    let prompt: Vec<u32> = tok.encode(&text, !args.chat)?;
    if prompt.is_empty() {
        bail!("--prompt: the prompt encodes to no tokens");
    }
    let new = phaselens::model::generate::greedy(
        model.as_ref(),
        &prompt,
        args.max_new_tokens,
        tok.eos(),
        &device,
    )?;
    let out = tok.decode(&new, true)?;
    if args.json {
        let j = serde_json::json!({ "prompt_ids": prompt, "new_ids": new, "text": out });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!("{out}");
    }
    Ok(())
}
