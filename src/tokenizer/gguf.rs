//! A tokenizer from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys), built
//! as transformers 5.25.0 builds its fast tokenizer from the same file
//! (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`): that conversion is the
//! definition of "equal" here, and `scripts/reference/tokenizer_fixtures.py` records it.
//!
//! | `tokenizer.ggml.model` | model | pipeline |
//! |---|---|---|
//! | `gpt2` | byte-level BPE, merges from the file | `ByteLevel` pre-tokenizer (GPT-2's regex, or the split of a known `tokenizer.ggml.pre`), `ByteLevel` decoder |
//! | `llama`, Gemma architectures | BPE with byte fallback, merges rebuilt from the token order | normalizer `" "` -> `"▁"`, decoder `▁` -> `" "`, bytes, fuse |
//! | `llama`, other architectures | BPE with byte fallback, merges rebuilt from the scores | `Metaspace` (prefix `▁` on the first word), decoder as above plus strip one leading space |
//!
//! Then, as transformers: the tokens typed CONTROL (3) become special added tokens, the
//! USER_DEFINED (4) ones plain added tokens (matched whole, before the model; see
//! `add_tokens` for the order and the defaults of transformers' classes), and the
//! post-processor adds BOS / EOS as `tokenizer.ggml.add_bos_token` / `add_eos_token` say
//! (BOS by default for `llama`).

use std::path::Path;

use serde_json::json;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Model, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::merges::{self, Rank};
use super::{Special, Tokenizer};
use crate::model::gguf::{GgufFile, MetaValue};
use crate::{Error, Result};

/// The `tokenizer.ggml.model` values phaselens builds.
pub const SUPPORTED_MODELS: &[&str] = &["gpt2", "llama"];

/// Architectures whose SentencePiece vocabulary transformers builds with `GemmaTokenizer`.
const GEMMA_ARCHITECTURES: &[&str] = &["gemma", "gemma2", "gemma3"];

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The split regexes transformers puts before `ByteLevel` for a known
/// `tokenizer.ggml.pre` (its `GGUF_PRE_TOKENIZER_SPLITS`); any other value, `smollm`
/// included, keeps GPT-2's `ByteLevel` regex.
fn pre_split(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = concat!(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    const TEKKEN: &str = concat!(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    const GPT4O: &str = concat!(
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    const QWEN2: &str = concat!(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    const QWEN35: &str = concat!(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}",
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3,
        "tekken" => TEKKEN,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        "qwen35" => QWEN35,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O,
        _ => return None,
    })
}

/// What the file says about its tokenizer.
struct Meta<'a> {
    path: &'a Path,
    architecture: &'a str,
    model: &'a str,
    pre: Option<&'a str>,
    tokens: Vec<&'a str>,
    types: Vec<i64>,
    merges: Option<Vec<&'a str>>,
    scores: Option<Vec<f64>>,
    special: Special,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    chat_template: Option<String>,
}

/// An error about key `key` of the GGUF `path`.
fn key_error(path: &Path, key: &str, message: impl std::fmt::Display) -> Error {
    Error::Config {
        path: path.to_path_buf(),
        message: format!("`{key}`: {message}"),
    }
}

impl<'a> Meta<'a> {
    fn read(file: &'a GgufFile) -> Result<Meta<'a>> {
        let path = file.path();
        let model_key = "tokenizer.ggml.model";
        let model = file.str(model_key)?;
        if !SUPPORTED_MODELS.contains(&model) {
            return Err(key_error(
                path,
                model_key,
                format!(
                    "tokenizer `{model}` is not supported (supported: {})",
                    SUPPORTED_MODELS.join(", ")
                ),
            ));
        }
        let tokens_key = "tokenizer.ggml.tokens";
        if file.get(tokens_key).is_none() {
            return Err(key_error(
                path,
                tokens_key,
                "missing: the file carries no vocabulary (a tokenizer.json beside it can)",
            ));
        }
        let tokens = file.strings(tokens_key)?;
        let types = match file.get("tokenizer.ggml.token_type") {
            Some(_) => file.ints("tokenizer.ggml.token_type")?,
            None => Vec::new(),
        };
        let merges = match file.get("tokenizer.ggml.merges") {
            Some(_) => Some(file.strings("tokenizer.ggml.merges")?),
            None => None,
        };
        let scores = match file.get("tokenizer.ggml.scores") {
            Some(_) => Some(file.floats("tokenizer.ggml.scores")?),
            None => None,
        };
        let id = |key: &str| -> Result<Option<u32>> {
            let full = format!("tokenizer.ggml.{key}");
            match file.opt_uint(&full)? {
                Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
                Some(id) => Err(key_error(
                    path,
                    &full,
                    format!("token id {id} is outside the {} tokens", tokens.len()),
                )),
                None => Ok(None),
            }
        };
        let special = Special {
            bos: id("bos_token_id")?,
            eos: id("eos_token_id")?,
            unk: id("unknown_token_id")?,
            pad: id("padding_token_id")?,
        };
        let meta = Meta {
            path,
            architecture: file.str("general.architecture").unwrap_or(""),
            model,
            pre: file.get("tokenizer.ggml.pre").and_then(MetaValue::as_str),
            types,
            merges,
            scores: scores.map(|s| s.into_iter().map(f64::from).collect()),
            special,
            add_bos: flag(file, "tokenizer.ggml.add_bos_token")?,
            add_eos: flag(file, "tokenizer.ggml.add_eos_token")?,
            chat_template: file
                .get("tokenizer.chat_template")
                .and_then(MetaValue::as_str)
                .map(str::to_string),
            tokens,
        };
        Ok(meta)
    }

    /// The merges the file lists, split at their one space.
    fn listed_merges(&self) -> Result<Option<Vec<(String, String)>>> {
        let Some(merges) = &self.merges else {
            return Ok(None);
        };
        merges
            .iter()
            .enumerate()
            .map(|(i, m)| match m.split(' ').collect::<Vec<_>>()[..] {
                [a, b] => Ok((a.to_string(), b.to_string())),
                _ => Err(key_error(
                    self.path,
                    "tokenizer.ggml.merges",
                    format!("merge {i} `{m}` is not two tokens separated by one space"),
                )),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn token(&self, id: Option<u32>) -> Option<&'a str> {
        id.map(|i| self.tokens[i as usize])
    }
}

/// A boolean key (stored as `bool` or an integer), or `None` when absent.
fn flag(file: &GgufFile, key: &str) -> Result<Option<bool>> {
    match file.get(key) {
        None => Ok(None),
        Some(MetaValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n != 0)),
            None => Err(key_error(
                file.path(),
                key,
                format!("expected a bool, found {}", v.type_desc()),
            )),
        },
    }
}

/// The tokenizer `file` describes (see the module's table).
pub(super) fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    let meta = Meta::read(file)?;
    let fail = tokenizer_error(meta.path);
    // With the special tokens of the transformers class that builds each (its defaults).
    let (mut inner, class_special) = match meta.model {
        "gpt2" => (byte_level(&meta)?, &["<|endoftext|>"][..]),
        _ if GEMMA_ARCHITECTURES.contains(&meta.architecture) => (
            gemma(&meta)?,
            &["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"][..],
        ),
        _ => (sentencepiece(&meta)?, &["<s>", "</s>", "<unk>"][..]),
    };
    add_tokens(&mut inner, &meta, class_special).map_err(&fail)?;
    // transformers' default for a SentencePiece file that does not say.
    let add_bos = meta.add_bos.unwrap_or(meta.model == "llama");
    let add_eos = meta.add_eos.unwrap_or(false);
    let processor = post_processor(&meta, add_bos, add_eos).map_err(&fail)?;
    inner.with_post_processor(Some(processor));
    Ok(Tokenizer {
        inner,
        special: meta.special,
        chat_template: meta.chat_template,
        source: meta.path.to_path_buf(),
    })
}

fn tokenizer_error(path: &Path) -> impl Fn(tokenizers::Error) -> Error + '_ {
    move |e| Error::Config {
        path: path.to_path_buf(),
        message: format!("building the tokenizer: {e}"),
    }
}

/// Byte-level BPE (`gpt2`): transformers' `GPT2Tokenizer` from the file's vocabulary and
/// merges.
fn byte_level(meta: &Meta<'_>) -> Result<tokenizers::Tokenizer> {
    let fail = tokenizer_error(meta.path);
    let bytes = bytes_to_unicode();
    let alphabet: std::collections::HashSet<char> = bytes.iter().copied().collect();
    // A token outside the byte alphabet (a mislabelled special token) is spelled byte by
    // byte, as transformers' `byte_level_tokenizer` does.
    let vocab: Vocab = meta
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let spelled = if t.chars().all(|c| alphabet.contains(&c)) {
                t.to_string()
            } else {
                t.bytes().map(|b| bytes[b as usize]).collect()
            };
            (spelled, i as u32)
        })
        .collect();
    let merges = match meta.listed_merges()? {
        Some(m) => m,
        None => merges::generate(&meta.tokens, Rank::ById),
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .fuse_unk(false)
        .build()
        .map_err(&fail)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let pre: PreTokenizerWrapper = match meta.pre.and_then(pre_split) {
        Some(regex) => PreSequence::new(vec![
            Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(&fail)?
            .into(),
            ByteLevel::new(false, true, false).into(),
        ])
        .into(),
        None => ByteLevel::new(false, true, true).into(),
    };
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevel::default()));
    Ok(tok)
}

/// Gemma's SentencePiece vocabulary: transformers' `gemma_tokenizer`. Tokens of two or
/// more blanks are stored as spaces but looked up as `▁`s, so they are respelled first;
/// the merges are rebuilt with the token order as the score (Gemma's scores do not follow
/// its merge order). No pre-tokenization happens: the normalizer turns every space into
/// `▁` before the pre-tokenizer splits at spaces.
fn gemma(meta: &Meta<'_>) -> Result<tokenizers::Tokenizer> {
    let fail = tokenizer_error(meta.path);
    let respelled: Vec<String> = meta
        .tokens
        .iter()
        .map(|t| {
            if t.contains(' ') && t.chars().all(python_isspace) {
                "▁".repeat(t.chars().count())
            } else {
                t.to_string()
            }
        })
        .collect();
    let tokens: Vec<&str> = respelled.iter().map(String::as_str).collect();
    let merges = match meta.listed_merges()? {
        Some(m) => m,
        None => {
            let positions: Vec<f64> = (0..tokens.len()).map(|i| -(i as f64)).collect();
            merges::generate(&tokens, Rank::ByScore(&positions))
        }
    };
    let bpe = sentencepiece_bpe(&tokens, merges, Some("<unk>")).map_err(&fail)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_normalizer(Some(Replace::new(" ", "▁").map_err(&fail)?))
        .map_err(&fail)?;
    tok.with_pre_tokenizer(Some(
        Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false).map_err(&fail)?,
    ));
    tok.with_decoder(Some(spm_decoder(false).map_err(&fail)?));
    Ok(tok)
}

/// Another SentencePiece vocabulary (`llama`): transformers' `LlamaTokenizer`, merges
/// rebuilt from `tokenizer.ggml.scores`.
fn sentencepiece(meta: &Meta<'_>) -> Result<tokenizers::Tokenizer> {
    let fail = tokenizer_error(meta.path);
    let merges = match meta.listed_merges()? {
        Some(m) => m,
        None => {
            let key = "tokenizer.ggml.scores";
            let scores = meta.scores.as_ref().ok_or_else(|| {
                key_error(meta.path, key, "missing: the merges are rebuilt from it")
            })?;
            merges::generate(&meta.tokens, Rank::ByScore(scores))
        }
    };
    let bpe = sentencepiece_bpe(&meta.tokens, merges, None).map_err(&fail)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, false)));
    tok.with_decoder(Some(spm_decoder(true).map_err(&fail)?));
    Ok(tok)
}

fn sentencepiece_bpe(
    tokens: &[&str],
    merges: Vec<(String, String)>,
    unk: Option<&str>,
) -> tokenizers::Result<BPE> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk.to_string());
    }
    builder.build()
}

/// `▁` -> space, `<0x..>` -> bytes, fused; with `strip`, the first leading space goes
/// (the one `Metaspace` prepended).
fn spm_decoder(strip: bool) -> tokenizers::Result<DecoderSequence> {
    let mut parts: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ")?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if strip {
        parts.push(Strip::new(' ', 1, 0).into());
    }
    Ok(DecoderSequence::new(parts))
}

/// The added tokens, in transformers' order (later additions of a token change its
/// flags, but a token once special stays special for `decode(.., skip_special)`, in the
/// `tokenizers` library on both sides):
/// 1. the special tokens the transformers class names by default (`class_special`:
///    `<|endoftext|>` for GPT-2, `<s>` `</s>` `<unk>` for Llama, Gemma's five), where the
///    vocabulary has them (transformers appends a missing one as a new id past the model's
///    vocabulary; phaselens leaves it out);
/// 2. the CONTROL tokens, special (in a byte-level vocabulary only those spelled in the
///    byte alphabet: transformers' `add_gguf_special_tokens`);
/// 3. the USER_DEFINED tokens that are in the vocabulary, not special;
/// 4. the BOS / EOS / UNK / PAD tokens the file names, special, unless added above.
///
/// All match the raw text (not normalised), before the model.
fn add_tokens(
    tok: &mut tokenizers::Tokenizer,
    meta: &Meta<'_>,
    class_special: &[&str],
) -> tokenizers::Result<()> {
    let special = |t: &str| AddedToken::from(t, true).normalized(false);
    let defaults: Vec<AddedToken> = class_special
        .iter()
        .filter(|t| tok.get_model().token_to_id(t).is_some())
        .map(|t| special(t))
        .collect();
    tok.add_special_tokens(defaults)?;
    let alphabet: Option<std::collections::HashSet<char>> =
        (meta.model == "gpt2").then(|| bytes_to_unicode().into_iter().collect());
    let typed = |kind: i64| {
        meta.tokens
            .iter()
            .zip(&meta.types)
            .filter(move |(_, t)| **t == kind)
            .map(|(token, _)| *token)
    };
    let spelled = |t: &&str| {
        let alphabet = alphabet.as_ref();
        alphabet.is_none_or(|a| t.chars().all(|c| a.contains(&c)))
    };
    tok.add_special_tokens(typed(CONTROL).filter(spelled).map(special))?;
    let vocab = tok.get_vocab(true);
    let user = typed(USER_DEFINED).filter(|t| vocab.contains_key(*t));
    tok.add_tokens(user.map(|t| AddedToken::from(t, false).normalized(false)))?;
    let s = meta.special;
    let named: Vec<AddedToken> = [s.bos, s.eos, s.unk, s.pad]
        .into_iter()
        .filter_map(|id| meta.token(id))
        .filter(|t| tok.get_added_vocabulary().get_vocab().get(*t).is_none())
        .map(special)
        .collect();
    tok.add_special_tokens(named)?;
    Ok(())
}

/// BOS and EOS around a sequence as transformers' `update_post_processor` writes them
/// (a flag without its token adds nothing); the pair template is the single one followed
/// by the same around the second sequence.
fn post_processor(
    meta: &Meta<'_>,
    add_bos: bool,
    add_eos: bool,
) -> tokenizers::Result<TemplateProcessing> {
    let bos = meta.token(meta.special.bos).filter(|_| add_bos);
    let eos = meta.token(meta.special.eos).filter(|_| add_eos);
    let around = |sequence: &str, type_id: u32| {
        let special = |token: &str| json!({"SpecialToken": {"id": token, "type_id": type_id}});
        let mut pieces: Vec<serde_json::Value> = bos.map(special).into_iter().collect();
        pieces.push(json!({"Sequence": {"id": sequence, "type_id": type_id}}));
        pieces.extend(eos.map(special));
        pieces
    };
    let single = around("A", 0);
    let pair: Vec<_> = single.iter().cloned().chain(around("B", 1)).collect();
    let mut special = serde_json::Map::new();
    for (token, id) in [(bos, meta.special.bos), (eos, meta.special.eos)] {
        if let (Some(token), Some(id)) = (token, id) {
            special.insert(
                token.to_string(),
                json!({"id": token, "ids": [id], "tokens": [token]}),
            );
        }
    }
    let value = json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special,
    });
    Ok(serde_json::from_value(value)?)
}

/// GPT-2's printable spelling of the 256 byte values (`bytes_to_unicode`).
fn bytes_to_unicode() -> Vec<char> {
    let printable = |b: u32| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// Python's `str.isspace` for one character: Unicode White_Space plus the four
/// information separators U+001C..U+001F.
fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_pre_tokenizer_split_compiles() {
        for pre in ["llama-bpe", "tekken", "qwen2", "qwen35", "gpt-4o"] {
            let regex = pre_split(pre).unwrap();
            let split = Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            );
            assert!(split.is_ok(), "{pre}: {:?}", split.err());
        }
        assert_eq!(
            pre_split("smollm"),
            None,
            "transformers keeps GPT-2's regex for smollm"
        );
    }

    #[test]
    fn bytes_to_unicode_is_gpt2s_alphabet() {
        let b = bytes_to_unicode();
        assert_eq!(
            (b[b' ' as usize], b[b'\n' as usize], b[b'a' as usize]),
            ('Ġ', 'Ċ', 'a')
        );
        assert_eq!((b[0], b[0xad], b[0xff]), ('Ā', 'Ń', 'ÿ'));
        let distinct: std::collections::HashSet<_> = b.iter().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn python_isspace_includes_the_information_separators() {
        assert!(
            " \t\n\u{a0}\u{3000}\u{1c}\u{1f}"
                .chars()
                .all(python_isspace)
        );
        assert!(!"a\u{200b}▁".chars().any(python_isspace));
    }
}
