//! `phaselens tokenize`: a model's token ids and pieces for a text, or the text of ids.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;

use phaselens::tokenizer::Tokenizer;

/// Encode a text with a model's tokenizer (or decode ids with --decode).
#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  phaselens tokenize --model ~/.cache/phaselens/models/gemma3-270m 'Key 4821: value 7710'
  phaselens tokenize --model ~/.cache/phaselens/models/smollm2-135m-instruct --chat 'Hi!'
  phaselens tokenize --model model.gguf --json 'Hello world'
  phaselens tokenize --model model.gguf --decode 2,9259,1902

One line per token: its position, its id and its piece as the vocabulary spells it
(quoted, with escapes: \"Ġworld\", \"▁world\", \"\\n\"). The ids are the ones transformers'
tokenizer gives for the same file (docs/models.md, \"Tokenizers\"). The model's special
tokens (BOS for Gemma) are added unless --no-special; text such as <|im_start|> becomes
its special token either way. --json prints {\"ids\", \"pieces\", \"text\"}.")]
pub struct TokenizeArgs {
    /// A `.gguf` file, a `tokenizer.json`, or a folder holding one of them.
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,
    /// The text to encode.
    #[arg(required_unless_present = "decode", conflicts_with = "decode")]
    pub text: Option<String>,
    /// Leave out the special tokens the model adds (BOS); with --decode, leave the special
    /// tokens out of the text.
    #[arg(long)]
    pub no_special: bool,
    /// Wrap the text in the model's chat template (one user turn + the generation prompt)
    /// before encoding it.
    #[arg(long, conflicts_with = "decode")]
    pub chat: bool,
    /// Decode these comma-separated ids instead of encoding a text.
    #[arg(long, value_name = "ID,ID,...", value_delimiter = ',')]
    pub decode: Option<Vec<String>>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::open(&args.model)
        .with_context(|| format!("the tokenizer of {}", args.model.display()))?;
    let (ids, text) = match (&args.decode, &args.text) {
        (Some(ids), _) => {
            let ids = parse_ids(ids)?;
            let text = tok.decode(&ids, args.no_special)?;
            (ids, text)
        }
        (None, Some(text)) => {
            let text = if args.chat {
                tok.apply_chat(text)?
            } else {
                text.clone()
            };
            // A chat text holds the special tokens its template writes.
            let ids = tok.encode(&text, !args.no_special && !args.chat)?;
            (ids, text)
        }
        (None, None) => bail!("give a TEXT to encode, or --decode IDS"),
    };
    let pieces = tok.pieces(&ids);
    if args.json {
        let j = serde_json::json!({ "ids": ids, "pieces": pieces, "text": text });
        println!("{}", serde_json::to_string(&j)?);
        return Ok(());
    }
    if args.decode.is_some() {
        println!("{text}");
        return Ok(());
    }
    for (i, (id, piece)) in ids.iter().zip(&pieces).enumerate() {
        println!("{i:>5} {id:>7}  {piece:?}");
    }
    Ok(())
}

/// `--decode` values as ids, each error naming the bad value.
fn parse_ids(values: &[String]) -> Result<Vec<u32>> {
    values
        .iter()
        .filter(|v| !v.trim().is_empty())
        .map(|v| {
            v.trim()
                .parse::<u32>()
                .with_context(|| format!("--decode: `{v}` is not a token id"))
        })
        .collect()
}
