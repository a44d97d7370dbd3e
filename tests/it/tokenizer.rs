//! The tokenizers of the two pretrained GGUF models (src/tokenizer/) against transformers
//! 5.25.0 on the same files: every one of the ~2,000 strings of
//! tests/fixtures/pretrained/tokenizer-{smollm2,gemma3}.json (made by
//! scripts/reference/tokenizer_fixtures.py) encodes to the same ids with and without
//! special tokens, decodes to the same text, and spells the same pieces; the pipeline's
//! parts serialise as transformers' do; the chat text is transformers' rendering. The same
//! for a Llama-architecture SentencePiece GGUF made from part of Gemma's vocabulary
//! (tokenizer-llama-spm.json). Then hand-made GGUFs (tiny vocabularies, hostile metadata)
//! and `phaselens tokenize`.

use std::path::{Path, PathBuf};

use phaselens::Error;
use phaselens::model::gguf::GgufFile;
use phaselens::tokenizer::Tokenizer;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::phaselens;
use crate::common::pretrained::{GEMMA3, SMOLLM2, model_file};

// ---------------------------------------------------------------- fixtures and models

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/pretrained")
        .join(format!("tokenizer-{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The model's tokenizer and its fixture, or `None` (skip) when the model is not cached.
fn load(rel: &str, name: &str) -> Option<(Tokenizer, Value)> {
    let path = model_file(rel)?;
    let tok = Tokenizer::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Some((tok, fixture(name)))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn cases(fx: &Value) -> &[Value] {
    fx["cases"].as_array().unwrap()
}

/// Panics with the number of mismatches and the first few when there are any; prints
/// how many cases matched.
fn report(model: &str, what: &str, total: usize, mismatches: &[String]) {
    eprintln!(
        "{model} {what}: {} of {total} equal to transformers",
        total - mismatches.len()
    );
    assert!(
        mismatches.is_empty(),
        "{model} {what}: {} of {total} differ from transformers; first:\n{}",
        mismatches.len(),
        mismatches
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

fn check_encode(model: &str, tok: &Tokenizer, fx: &Value) {
    let mut bad = Vec::new();
    for c in cases(fx) {
        let text = c["text"].as_str().unwrap();
        for (key, special) in [("ids", false), ("ids_special", true)] {
            let want = ids(&c[key]);
            let got = tok.encode(text, special).unwrap();
            if got != want {
                bad.push(format!("{text:?} ({key}): want {want:?}, got {got:?}"));
            }
        }
    }
    report(model, "encodings", 2 * cases(fx).len(), &bad);
}

fn check_decode(model: &str, tok: &Tokenizer, fx: &Value) {
    let mut bad = Vec::new();
    for c in cases(fx) {
        for (ids_key, text_key, skip) in [
            ("ids", "decoded", false),
            ("ids_special", "decoded_special", false),
            ("ids_special", "decoded_skip", true),
        ] {
            let want = c[text_key].as_str().unwrap();
            let got = tok.decode(&ids(&c[ids_key]), skip).unwrap();
            if got != want {
                bad.push(format!(
                    "{:?} ({text_key}): want {want:?}, got {got:?}",
                    c["text"]
                ));
            }
        }
    }
    report(model, "decodings", 3 * cases(fx).len(), &bad);
}

fn check_pieces(model: &str, tok: &Tokenizer, fx: &Value) {
    let with: Vec<&Value> = cases(fx)
        .iter()
        .filter(|c| c.get("pieces").is_some())
        .collect();
    assert!(
        with.len() >= 300,
        "{model}: the fixture has pieces for {} cases",
        with.len()
    );
    let mut bad = Vec::new();
    for c in &with {
        let want: Vec<&str> = c["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        let got = tok.pieces(&ids(&c["ids"]));
        if got != want {
            bad.push(format!("{:?}: want {want:?}, got {got:?}", c["text"]));
        }
    }
    report(model, "pieces", with.len(), &bad);
}

/// Our pipeline serialised as a tokenizer.json, its parts one by one against
/// transformers' (the vocabulary and merges by count; the fixture has no more).
fn check_pipeline(model: &str, tok: &Tokenizer, fx: &Value) {
    let ours: Value = serde_json::from_str(&tok.to_json().unwrap()).unwrap();
    let want = &fx["pipeline"];
    for part in ["normalizer", "pre_tokenizer", "post_processor", "decoder"] {
        assert_eq!(ours[part], want[part], "{model}: {part}");
    }
    for field in [
        "type",
        "dropout",
        "unk_token",
        "continuing_subword_prefix",
        "end_of_word_suffix",
        "fuse_unk",
        "byte_fallback",
        "ignore_merges",
    ] {
        assert_eq!(
            ours["model"][field], want["model"][field],
            "{model}: model.{field}"
        );
    }
    let vocab = ours["model"]["vocab"].as_object().unwrap().len();
    assert_eq!(
        vocab as u64,
        want["model"]["vocab"].as_u64().unwrap(),
        "{model}: vocabulary size"
    );
    let merges = ours["model"]["merges"].as_array().unwrap();
    assert_eq!(
        merges.len() as u64,
        want["model"]["merges"].as_u64().unwrap(),
        "{model}: merges"
    );
    // The merges in rank order and the tokens in id order, exactly (as digests).
    let merged = merges
        .iter()
        .flat_map(|m| m.as_array().unwrap().iter().map(|t| t.as_str().unwrap()));
    assert_eq!(
        digest(merged),
        want["model"]["merges_sha256"],
        "{model}: merges, in order"
    );
    let mut by_id: Vec<(&str, u64)> = ours["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(t, id)| (t.as_str(), id.as_u64().unwrap()))
        .collect();
    by_id.sort_by_key(|(_, id)| *id);
    assert_eq!(
        digest(by_id.into_iter().map(|(t, _)| t)),
        want["model"]["vocab_sha256"],
        "{model}: vocabulary"
    );
    let mut added: Vec<Value> = ours["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            serde_json::json!([
                a["id"],
                a["content"],
                a["special"],
                a["normalized"],
                a["lstrip"],
                a["rstrip"],
                a["single_word"]
            ])
        })
        .collect();
    added.sort_by_key(|a| a[0].as_u64());
    assert_eq!(
        &Value::from(added),
        &want["added_tokens"],
        "{model}: added tokens"
    );
    assert_eq!(
        tok.vocab_size() as u64,
        fx["vocab_size"].as_u64().unwrap(),
        "{model}: vocab_size()"
    );
    assert_eq!(tok.bos().map(u64::from), fx["bos"].as_u64(), "{model}: bos");
    assert_eq!(tok.eos().map(u64::from), fx["eos"].as_u64(), "{model}: eos");
}

/// SHA-256 of the strings, each as its UTF-8 length (u32, little-endian) and bytes (the
/// fixture script's `digest`).
fn digest<'a>(strings: impl Iterator<Item = &'a str>) -> String {
    let mut h = Sha256::new();
    for s in strings {
        h.update((s.len() as u32).to_le_bytes());
        h.update(s.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------- the two models

#[test]
fn smollm2_encodes_every_fixture_string_as_transformers() {
    let Some((tok, fx)) = load(SMOLLM2, "smollm2") else {
        return;
    };
    assert!(cases(&fx).len() >= 2000);
    check_encode("smollm2", &tok, &fx);
}

#[test]
fn gemma3_encodes_every_fixture_string_as_transformers() {
    let Some((tok, fx)) = load(GEMMA3, "gemma3") else {
        return;
    };
    assert!(cases(&fx).len() >= 2000);
    check_encode("gemma3", &tok, &fx);
}

#[test]
fn both_models_decode_and_spell_pieces_as_transformers() {
    for (rel, name) in [(SMOLLM2, "smollm2"), (GEMMA3, "gemma3")] {
        let Some((tok, fx)) = load(rel, name) else {
            continue;
        };
        check_decode(name, &tok, &fx);
        check_pieces(name, &tok, &fx);
    }
}

#[test]
fn both_pipelines_serialise_as_transformers_fast_tokenizers() {
    for (rel, name) in [(SMOLLM2, "smollm2"), (GEMMA3, "gemma3")] {
        let Some((tok, fx)) = load(rel, name) else {
            continue;
        };
        check_pipeline(name, &tok, &fx);
    }
}

/// Decoding the ids of a text gives the text back wherever the vocabulary can spell it:
/// the exceptions are transformers' own (SmolLM2's vocabulary lacks the byte 0x1D, and
/// Gemma's decoder turns a literal `▁` into a space).
#[test]
fn decode_inverts_encode_wherever_transformers_does() {
    for (rel, name) in [(SMOLLM2, "smollm2"), (GEMMA3, "gemma3")] {
        let Some((tok, fx)) = load(rel, name) else {
            continue;
        };
        let mut lossy = Vec::new();
        for c in cases(&fx) {
            let text = c["text"].as_str().unwrap();
            let back = tok
                .decode(&tok.encode(text, false).unwrap(), false)
                .unwrap();
            assert_eq!(back, c["decoded"].as_str().unwrap(), "{name}: {text:?}");
            if back != text {
                lossy.push(text);
            }
            let skipped = tok.decode(&tok.encode(text, true).unwrap(), true).unwrap();
            assert_eq!(
                skipped,
                c["decoded_skip"].as_str().unwrap(),
                "{name}: {text:?}"
            );
        }
        eprintln!(
            "{name}: {} of {} round trips exact; not: {lossy:?}",
            cases(&fx).len() - lossy.len(),
            cases(&fx).len()
        );
        assert!(lossy.len() <= 12, "{name}: {lossy:?}");
        let (missing_byte, literal_bar) = (
            lossy.iter().all(|t| t.contains('\u{1d}')),
            lossy.iter().all(|t| t.contains('▁')),
        );
        assert!(missing_byte || literal_bar, "{name}: {lossy:?}");
    }
}

#[test]
fn smollm2_chat_text_is_transformers_rendering_of_its_template() {
    let Some((tok, fx)) = load(SMOLLM2, "smollm2") else {
        return;
    };
    assert_eq!(tok.chat_template(), fx["chat_template"].as_str());
    let chats = fx["chat"].as_array().unwrap();
    assert!(!chats.is_empty());
    for c in chats {
        let user = c["user"].as_str().unwrap();
        assert_eq!(
            tok.apply_chat(user).unwrap(),
            c["text"].as_str().unwrap(),
            "{user:?}"
        );
    }
    let ids = tok.encode(&tok.apply_chat("Hi").unwrap(), false).unwrap();
    assert_eq!(
        &ids[..1],
        &[tok.bos().unwrap()],
        "the chat text starts with <|im_start|>"
    );
}

#[test]
fn gemma3_base_has_no_chat_template_and_says_so() {
    let Some((tok, fx)) = load(GEMMA3, "gemma3") else {
        return;
    };
    assert!(fx["chat_template"].is_null());
    assert_eq!(tok.chat_template(), None);
    let e = tok.apply_chat("Hi").unwrap_err().to_string();
    assert!(
        e.contains("no chat template") && e.contains("gemma-3-270m"),
        "{e}"
    );
}

#[test]
fn open_takes_a_file_or_a_folder_with_exactly_one_gguf() {
    let Some(file) = model_file(SMOLLM2) else {
        return;
    };
    let folder = file.parent().unwrap();
    let from_folder = Tokenizer::open(folder).unwrap();
    assert_eq!(from_folder.source(), file);
    assert_eq!(
        from_folder.encode("Hello world", true).unwrap(),
        [19556, 905]
    );

    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("no tokenizer.json and no .gguf"), "{e}");
    for name in ["a.gguf", "b.gguf"] {
        std::fs::write(dir.path().join(name), tiny_gpt2().bytes()).unwrap();
    }
    let e = Tokenizer::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("2 .gguf files") && e.contains("a.gguf, b.gguf"),
        "{e}"
    );
    let e = Tokenizer::open(&dir.path().join("missing.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.gguf"), "{e}");
}

#[test]
fn a_tokenizer_json_written_by_to_json_reads_back_equal() {
    let Some((tok, fx)) = load(SMOLLM2, "smollm2") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_json().unwrap()).unwrap();
    let config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": fx["chat_template"],
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let back = Tokenizer::open(dir.path()).unwrap();
    for c in cases(&fx).iter().take(400) {
        let text = c["text"].as_str().unwrap();
        assert_eq!(
            back.encode(text, true).unwrap(),
            ids(&c["ids_special"]),
            "{text:?}"
        );
    }
    assert_eq!((back.bos(), back.eos()), (tok.bos(), tok.eos()));
    assert_eq!(back.apply_chat("x").unwrap(), tok.apply_chat("x").unwrap());
}

// ---------------------------------------------------------------- hand-made GGUFs

/// A GGUF (version 3) holding only metadata: keys in the order given.
struct Gguf(Vec<(String, u32, Vec<u8>)>);

fn gstr(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    fn new() -> Gguf {
        Gguf(Vec::new()).str("general.architecture", "llama")
    }
    /// Sets `key` (replacing an earlier value: GGUF keys are unique).
    fn raw(mut self, key: &str, ty: u32, value: Vec<u8>) -> Gguf {
        self.0.retain(|(k, _, _)| k != key);
        self.0.push((key.to_string(), ty, value));
        self
    }
    fn str(self, key: &str, v: &str) -> Gguf {
        let mut b = vec![];
        gstr(&mut b, v);
        self.raw(key, 8, b)
    }
    fn u32(self, key: &str, v: u32) -> Gguf {
        self.raw(key, 4, v.to_le_bytes().to_vec())
    }
    fn bool(self, key: &str, v: bool) -> Gguf {
        self.raw(key, 7, vec![u8::from(v)])
    }
    fn array(self, key: &str, ty: u32, n: usize, elems: Vec<u8>) -> Gguf {
        let mut b = ty.to_le_bytes().to_vec();
        b.extend((n as u64).to_le_bytes());
        b.extend(elems);
        self.raw(key, 9, b)
    }
    fn strs(self, key: &str, v: &[&str]) -> Gguf {
        let mut b = vec![];
        v.iter().for_each(|s| gstr(&mut b, s));
        self.array(key, 8, v.len(), b)
    }
    fn i32s(self, key: &str, v: &[i32]) -> Gguf {
        self.array(
            key,
            5,
            v.len(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }
    fn f32s(self, key: &str, v: &[f32]) -> Gguf {
        self.array(
            key,
            6,
            v.len(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }
    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((self.0.len() as u64).to_le_bytes());
        for (key, ty, value) in &self.0 {
            gstr(&mut b, key);
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        b.resize(b.len().next_multiple_of(32), 0);
        b
    }
    /// Written to `dir/name` and opened.
    fn open(&self, dir: &Path, name: &str) -> (PathBuf, phaselens::Result<Tokenizer>) {
        let path = dir.join(name);
        std::fs::write(&path, self.bytes()).unwrap();
        let file = GgufFile::open(&path).unwrap();
        (path, Tokenizer::from_gguf(&file))
    }
}

/// A byte-level vocabulary: `Ġ` is the space.
fn tiny_gpt2() -> Gguf {
    Gguf::new()
        .str("tokenizer.ggml.model", "gpt2")
        .strs(
            "tokenizer.ggml.tokens",
            &["<|end|>", "a", "b", "ab", "Ġ", "Ġa", "Ġab", "!"],
        )
        .i32s("tokenizer.ggml.token_type", &[3, 1, 1, 1, 1, 1, 1, 1])
        .strs("tokenizer.ggml.merges", &["a b", "Ġ ab"])
        .u32("tokenizer.ggml.eos_token_id", 0)
}

/// A SentencePiece vocabulary (Llama-style: `▁` prefix, byte fallback, merges from scores).
fn tiny_llama() -> Gguf {
    let mut tokens = vec!["<unk>", "<s>", "</s>", "▁", "h", "i", "▁h", "▁hi", "hi"];
    let bytes: Vec<String> = (0..=255).map(|b| format!("<0x{b:02X}>")).collect();
    tokens.extend(bytes.iter().map(String::as_str));
    let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 1];
    types.extend([6; 256]);
    let mut scores = vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
    scores.extend([0.0; 256]);
    Gguf::new()
        .str("tokenizer.ggml.model", "llama")
        .strs("tokenizer.ggml.tokens", &tokens)
        .i32s("tokenizer.ggml.token_type", &types)
        .f32s("tokenizer.ggml.scores", &scores)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .bool("tokenizer.ggml.add_eos_token", true)
}

/// The `llama` SentencePiece path (merges ranked by `tokenizer.ggml.scores`,
/// `Metaspace`, BOS and EOS added) against transformers, on a Llama-architecture GGUF
/// made from part of Gemma 3's vocabulary as the fixture script's `synthetic_llama` makes
/// it (the same tokens, scores, types and flags; only the metadata phaselens reads).
#[test]
fn a_llama_sentencepiece_gguf_encodes_and_decodes_as_transformers() {
    let Some(gemma) = model_file(GEMMA3) else {
        return;
    };
    let fx = fixture("llama-spm");
    let syn = &fx["synthetic"];
    let file = GgufFile::open(&gemma).unwrap();
    let tokens = file.strings("tokenizer.ggml.tokens").unwrap();
    let scores = file.floats("tokenizer.ggml.scores").unwrap();
    let types = file.ints("tokenizer.ggml.token_type").unwrap();
    let keep: Vec<usize> = syn["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r[0].as_u64().unwrap() as usize..r[1].as_u64().unwrap() as usize)
        .collect();
    let meta = &syn["metadata"];
    let id = |key: &str| meta[key].as_u64().unwrap() as u32;
    let flag = |key: &str| meta[key].as_bool().unwrap();
    let types: Vec<i32> = keep.iter().map(|&i| types[i] as i32).collect();
    let gguf = Gguf::new()
        .str("tokenizer.ggml.model", "llama")
        .strs(
            "tokenizer.ggml.tokens",
            &keep.iter().map(|&i| tokens[i]).collect::<Vec<_>>(),
        )
        .f32s(
            "tokenizer.ggml.scores",
            &keep.iter().map(|&i| scores[i]).collect::<Vec<_>>(),
        )
        .i32s("tokenizer.ggml.token_type", &types)
        .u32("tokenizer.ggml.bos_token_id", id("bos"))
        .u32("tokenizer.ggml.eos_token_id", id("eos"))
        .u32("tokenizer.ggml.unknown_token_id", id("unk"))
        .bool("tokenizer.ggml.add_bos_token", flag("add_bos"))
        .bool("tokenizer.ggml.add_eos_token", flag("add_eos"));
    let dir = tempfile::tempdir().unwrap();
    let (_, tok) = gguf.open(dir.path(), "llama-spm.gguf");
    let tok = tok.unwrap();
    check_pipeline("llama-spm", &tok, &fx);
    check_encode("llama-spm", &tok, &fx);
    check_decode("llama-spm", &tok, &fx);
    check_pieces("llama-spm", &tok, &fx);
}

#[test]
fn a_tiny_byte_level_vocabulary_merges_as_listed() {
    let dir = tempfile::tempdir().unwrap();
    let (_, tok) = tiny_gpt2().open(dir.path(), "tiny.gguf");
    let tok = tok.unwrap();
    assert_eq!(tok.encode("ab ab!", true).unwrap(), [3, 6, 7]);
    assert_eq!(
        tok.encode("a<|end|>b", false).unwrap(),
        [1, 0, 2],
        "control tokens match whole"
    );
    assert_eq!(tok.pieces(&[3, 6, 7]), ["ab", "Ġab", "!"]);
    assert_eq!(tok.decode(&[3, 6, 0], false).unwrap(), "ab ab<|end|>");
    assert_eq!(tok.decode(&[3, 6, 0], true).unwrap(), "ab ab");
    assert_eq!((tok.bos(), tok.eos(), tok.vocab_size()), (None, Some(0), 8));
    let e = tok.decode(&[3, 8], false).unwrap_err().to_string();
    assert!(e.contains("token id 8") && e.contains("8 tokens"), "{e}");
    assert_eq!(tok.pieces(&[99]), ["<out of vocabulary: 99>"]);
    let e = tok.apply_chat("x").unwrap_err().to_string();
    assert!(
        e.contains("tiny.gguf") && e.contains("no chat template"),
        "{e}"
    );
}

#[test]
fn a_tiny_sentencepiece_vocabulary_merges_by_score_and_falls_back_to_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (_, tok) = tiny_llama().open(dir.path(), "spm.gguf");
    let tok = tok.unwrap();
    // BOS by default for `llama`, EOS because the file asks for it.
    assert_eq!(tok.encode("hi hi", true).unwrap(), [1, 7, 7, 2]);
    let ids = tok.encode("hi é", false).unwrap();
    assert_eq!(tok.pieces(&ids), ["▁hi", "▁", "<0xC3>", "<0xA9>"]);
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "hi é",
        "the prefix space is stripped"
    );
}

#[test]
fn a_gguf_without_tokens_is_an_error_naming_the_file_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let (path, tok) = Gguf::new()
        .str("tokenizer.ggml.model", "gpt2")
        .open(dir.path(), "notokens.gguf");
    let e = tok.unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("tokenizer.ggml.tokens"),
        "{msg}"
    );
}

#[test]
fn an_unknown_tokenizer_model_is_named_with_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (_, tok) = Gguf::new()
        .str("tokenizer.ggml.model", "bert")
        .strs("tokenizer.ggml.tokens", &["a"])
        .open(dir.path(), "bert.gguf");
    let msg = tok.unwrap_err().to_string();
    assert!(
        msg.contains("bert.gguf") && msg.contains("`bert`") && msg.contains("gpt2, llama"),
        "{msg}"
    );
}

#[test]
fn hostile_tokenizer_metadata_gives_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            tiny_gpt2().u32("tokenizer.ggml.bos_token_id", 99),
            "tokenizer.ggml.bos_token_id",
        ),
        (
            tiny_gpt2().strs("tokenizer.ggml.merges", &["a b c"]),
            "tokenizer.ggml.merges",
        ),
        (
            tiny_gpt2().strs("tokenizer.ggml.merges", &["a zz"]),
            "building the tokenizer",
        ),
        (
            tiny_gpt2()
                .u32("tokenizer.ggml.add_bos_token", 1)
                .str("tokenizer.ggml.add_eos_token", "yes"),
            "tokenizer.ggml.add_eos_token",
        ),
        (
            Gguf::new().strs("tokenizer.ggml.tokens", &["a"]),
            "tokenizer.ggml.model",
        ),
        (
            Gguf::new()
                .str("tokenizer.ggml.model", "llama")
                .strs("tokenizer.ggml.tokens", &["a", "b"]),
            "tokenizer.ggml.scores",
        ),
    ];
    for (i, (gguf, want)) in cases.into_iter().enumerate() {
        let (_, tok) = gguf.open(dir.path(), &format!("hostile{i}.gguf"));
        let msg = tok.unwrap_err().to_string();
        assert!(
            msg.contains(&format!("hostile{i}.gguf")) && msg.contains(want),
            "case {i}: {msg}"
        );
    }
}

// ---------------------------------------------------------------- the command line

fn stdout(o: &std::process::Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn tokenize_prints_ids_and_pieces_or_json_and_decodes() {
    let Some(path) = model_file(GEMMA3) else {
        return;
    };
    let model = path.to_str().unwrap();
    let lines = stdout(&phaselens(&["tokenize", "--model", model, "Hello world"]));
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        ["0", "2", "\"<bos>\""]
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["2", "1902", "\"▁world\""]
    );

    let out = stdout(&phaselens(&[
        "tokenize",
        "--model",
        model,
        "--no-special",
        "--json",
        "a\nb",
    ]));
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["text"], "a\nb");
    assert_eq!(j["pieces"], serde_json::json!(["a", "\n", "b"]));
    assert_eq!(ids(&j["ids"]).len(), 3);

    let out = stdout(&phaselens(&[
        "tokenize",
        "--model",
        model,
        "--decode",
        "2,9259,1902",
    ]));
    assert_eq!(out, "<bos>Hello world\n");
    let out = stdout(&phaselens(&[
        "tokenize",
        "--model",
        model,
        "--decode",
        "2,9259,1902",
        "--no-special",
    ]));
    assert_eq!(out, "Hello world\n");
}

#[test]
fn tokenize_chat_wraps_the_text_in_the_template() {
    let Some(path) = model_file(SMOLLM2) else {
        return;
    };
    let fx = fixture("smollm2");
    let out = stdout(&phaselens(&[
        "tokenize",
        "--model",
        path.to_str().unwrap(),
        "--chat",
        "--json",
        "Hello!",
    ]));
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["text"], fx["chat"][0]["text"]);
    assert_eq!(ids(&j["ids"])[0], 1, "<|im_start|> is one token");
}

#[test]
fn tokenize_errors_are_named_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.gguf");
    std::fs::write(&tiny, tiny_gpt2().bytes()).unwrap();
    let t = tiny.to_str().unwrap();
    let missing = dir.path().join("nope.gguf");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["tokenize", "--model", t, "--decode", "1,x"],
            "`x` is not a token id",
        ),
        (
            vec!["tokenize", "--model", t, "--decode", "1,800"],
            "token id 800",
        ),
        (
            vec!["tokenize", "--model", t, "--chat", "hi"],
            "no chat template",
        ),
        (
            vec!["tokenize", "--model", missing.to_str().unwrap(), "hi"],
            "nope.gguf",
        ),
        (vec!["tokenize", "--model", t], "required"),
    ];
    for (args, want) in cases {
        let o = phaselens(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && o.status.code().is_some(),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: want {want:?} in: {err}");
    }
}
