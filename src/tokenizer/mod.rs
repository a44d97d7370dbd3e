//! Tokenizers of pretrained models: text <-> token ids, equal to transformers' fast
//! tokenizer for the same file.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`Tokenizer`]: open a model's tokenizer, encode, decode, pieces, chat text |
//! | `gguf.rs` | the tokenizer a GGUF's `tokenizer.ggml.*` metadata describes (byte-level BPE, SentencePiece BPE) |
//! | `merges.rs` | BPE merges rebuilt from a vocabulary (SentencePiece GGUFs list none) |
//! | `chat.rs` | one user turn in the model's chat format (ChatML, Gemma) |
//!
//! "Equal" is defined by transformers 5.25.0 (`AutoTokenizer.from_pretrained(dir,
//! gguf_file=name)`): `scripts/reference/tokenizer_fixtures.py` records its ids for
//! 2,000 strings of both pretrained models and `tests/it/tokenizer.rs` checks every one.
//! The pipeline runs in the `tokenizers` crate, the library transformers' fast
//! tokenizers run in; this module only builds it. docs/models.md, "Tokenizers".

mod chat;
mod gguf;
mod merges;

use std::path::{Path, PathBuf};

use crate::model::gguf::GgufFile;
use crate::model::pretrained;
use crate::{Error, Result};

pub use gguf::SUPPORTED_MODELS;

/// The special tokens a model names (ids into its vocabulary).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Special {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence (or of a turn, for chat models whose GGUF says so).
    pub eos: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
}

/// A model's tokenizer: a `tokenizers` pipeline (normalizer, pre-tokenizer, BPE, added
/// tokens, post-processor, decoder) plus the special tokens and chat template of its file.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: Special,
    chat_template: Option<String>,
    source: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// The tokenizer a GGUF file describes (`tokenizer.ggml.model` `gpt2` or `llama`; see
    /// [`SUPPORTED_MODELS`]). Errors name the file and the key: a file without
    /// `tokenizer.ggml.tokens`, an unknown tokenizer model, an id out of range.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        gguf::from_gguf(file)
    }

    /// A Hugging Face `tokenizer.json`; BOS, EOS and the chat template come from the
    /// `tokenizer_config.json` beside it, when there is one.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            message: format!("not a tokenizer.json: {e}"),
        })?;
        let config = path.with_file_name("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Config {
                path: config.clone(),
                message: e.to_string(),
            })?,
            Err(_) => serde_json::Value::Null,
        };
        let id = |key: &str| {
            let v = &config[key];
            let token = v.as_str().or_else(|| v["content"].as_str());
            token.and_then(|t| inner.token_to_id(t))
        };
        let special = Special {
            bos: id("bos_token"),
            eos: id("eos_token"),
            unk: id("unk_token"),
            pad: id("pad_token"),
        };
        Ok(Tokenizer {
            special,
            chat_template: config["chat_template"].as_str().map(str::to_string),
            inner,
            source: path.to_path_buf(),
        })
    }

    /// The tokenizer of `model`: a `.gguf` file, a `tokenizer.json`, or a folder holding a
    /// `tokenizer.json` or exactly one `.gguf`; `models:NAME` and `~/` name them as in
    /// [`pretrained::expand_model_path`].
    pub fn open(model: &Path) -> Result<Tokenizer> {
        let model = &pretrained::expand_model_path(model);
        if model.is_dir() {
            let json = model.join("tokenizer.json");
            if json.is_file() {
                return Tokenizer::from_file(&json);
            }
            let ggufs = pretrained::gguf_files(model)?;
            return match &ggufs[..] {
                [one] => Tokenizer::open(one),
                [] => Err(Error::Config {
                    path: model.to_path_buf(),
                    message: "no tokenizer.json and no .gguf file in this folder".into(),
                }),
                many => Err(Error::Config {
                    path: model.to_path_buf(),
                    message: format!(
                        "{} .gguf files and no tokenizer.json: name the file ({})",
                        many.len(),
                        names(many)
                    ),
                }),
            };
        }
        if pretrained::is_gguf(model) {
            let file = GgufFile::open(model)?;
            return Tokenizer::from_gguf(&file);
        }
        if !model.exists() {
            return Err(Error::io(
                model,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
        Tokenizer::from_file(model)
    }

    /// The ids of `text`. `add_special` adds what the model adds by default (transformers'
    /// `add_special_tokens=True`: BOS for Gemma, nothing for SmolLM2); special-token text
    /// in `text` (`<|im_start|>`, `<bos>`) becomes that token either way.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| Error::Other(format!("{}: encoding: {e}", self.source.display())))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`; `skip_special` leaves the special tokens out. An id outside the
    /// vocabulary is an error naming it.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let size = self.vocab_size();
        if let Some((at, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= size) {
            return Err(Error::Input(format!(
                "token id {id} (at position {at}) is outside the vocabulary of {size} tokens"
            )));
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Other(format!("{}: decoding: {e}", self.source.display())))
    }

    /// The token strings of `ids` as the vocabulary spells them (`Ġworld`, `▁world`,
    /// `<0x0A>`); an id outside the vocabulary gives `<out of vocabulary: ID>`.
    pub fn pieces(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&id| {
                self.inner
                    .id_to_token(id)
                    .unwrap_or_else(|| format!("<out of vocabulary: {id}>"))
            })
            .collect()
    }

    /// The number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token` (its exact spelling in the vocabulary), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.special.bos
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.special.eos
    }

    /// All special tokens the file names.
    pub fn special(&self) -> Special {
        self.special
    }

    /// The chat template (Jinja) the file carries, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// One user turn and the generation prompt in the model's chat format, as transformers'
    /// `apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
    /// tokenize=False)` renders it; encode it with `add_special = false` (the text holds
    /// what the template writes). Two template forms are known: ChatML (SmolLM2, with the
    /// default system turn its template writes) and Gemma's turns. A model without a
    /// template, or with another form, is an error.
    pub fn apply_chat(&self, user: &str) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Err(Error::Other(format!(
                "{}: the model has no chat template (no `tokenizer.chat_template`): it is a \
                 base model; give the prompt as plain text",
                self.source.display()
            )));
        };
        let bos = self.special.bos.and_then(|id| self.inner.id_to_token(id));
        chat::render(template, user, bos.as_deref()).ok_or_else(|| {
            Error::Other(format!(
                "{}: the chat template is neither ChatML (`<|im_start|>`) nor Gemma's \
                 (`<start_of_turn>`), the two forms phaselens renders",
                self.source.display()
            ))
        })
    }

    /// The whole pipeline as a Hugging Face `tokenizer.json` (one line).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| Error::Other(format!("{}: serialising: {e}", self.source.display())))
    }

    /// The file the tokenizer was read from.
    pub fn source(&self) -> &Path {
        &self.source
    }
}

fn names(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .filter_map(|p| p.file_name()?.to_str())
        .collect::<Vec<_>>()
        .join(", ")
}
