#!/usr/bin/env python3
"""Reference tokenizations of the two pretrained GGUF models for phaselens' tokenizer
(src/tokenizer/).

Pinned: transformers==5.25.0 (its GGUF tokenizer conversion,
`transformers/integrations/gguf/gguf_tokenizer_mapping.py`, is the definition of "equal"),
tokenizers (the version transformers installs), gguf==0.19.0. torch is not needed. Run from
the repository root, after `bash scripts/fetch-models.sh`:

    pip install transformers==5.25.0 gguf==0.19.0
    python3 scripts/reference/tokenizer_fixtures.py

writes tests/fixtures/pretrained/tokenizer-smollm2.json, tokenizer-gemma3.json and
tokenizer-llama-spm.json (a Llama-architecture SentencePiece GGUF made from part of Gemma's
vocabulary with its scores, `synthetic_llama`; its `synthetic` key says how) as compact
JSON, each under 3 MB:
- `versions`: the package versions that made it;
- `pipeline`: transformers' fast tokenizer as `tokenizer.json` without its vocabulary and
  merges (their counts instead, and `vocab_sha256` / `merges_sha256`: SHA-256 of the tokens
  in id order and of the merges' tokens in rank order, each string as its UTF-8 length
  (u32 little-endian) and bytes), so a test can compare the pipeline's parts one by one;
- `bos`, `eos`, `vocab_size` (with added tokens), `chat_template`, and `chat`: the rendered
  text of `apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
  tokenize=False)` for a few contents (empty when the file has no template);
- `cases`: for each string of `strings()` (the same >= 2,000 strings for both models, made
  from a seeded generator): `text`, `ids` (encode without special tokens), `ids_special`
  (encode with them, transformers' default), `decoded` (decode of `ids`), `decoded_special`
  (decode of `ids_special`, special tokens kept) and `decoded_skip` (of `ids_special`,
  special tokens skipped); the first 300 cases also carry `pieces`
  (`convert_ids_to_tokens(ids)`).

Deterministic: the same model files and package versions give byte-identical JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

assert version("transformers") == "5.25.0", f"transformers {version('transformers')}: pinned 5.25.0"

from transformers import AutoTokenizer  # noqa: E402

SEED = 20240611
MODELS = {
    "smollm2": "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma3-270m/gemma-3-270m-q4_k_m.gguf",
}
CHAT_CONTENTS = [
    "Hello!",
    "What is the capital of France?",
    "Key 4821: value 7710\nKey 17: value 3\nWhat is the value of key 17?",
    "",
    "  spaces  and\ttabs\n",
    "Emoji 👩‍💻 and 日本語",
]
PIECES_CASES = 300


def models_dir() -> Path:
    """The cache of tests/it/common/pretrained.rs."""
    if os.environ.get("PHASELENS_MODELS"):
        return Path(os.environ["PHASELENS_MODELS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "phaselens" / "models"


# ---------------------------------------------------------------------------------------
# The strings: every family the brief names, each from its own seeded generator.

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which "
    "this be or has had not but have one their they you all we can more when there who "
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment "
    "air teacher force education quickly brown fox jumps over lazy dog Hello World "
    "tokenizer transformer attention compression phase sensitivity interpretability"
).split()
CONTRACTIONS = ["don't", "I'll", "it's", "we're", "they've", "she'd", "I'm", "can't",
                "Won't", "IT'S", "You'Re", "o'clock", "rock'n'roll"]
PUNCT = [".", ",", "!", "?", ";", ":", "...", " -", " --", "'", '"', "(", ")", "[", "]"]

UNICODE = [
    "café", "naïve", "Ångström", "façade", "jalapeño", "Zürich", "Œuvre", "ßtraße", "İstanbul",
    "ǅemal", "ﬁnance", "Ⅻ", "①②③", "½ ¾", "µs", "Ωmega", "ΑΒΓ αβγ", "Привет мир",
    "中文分词测试", "日本語のテキスト", "한국어 텍스트", "ひらがな カタカナ", "漢字とかな",
    "👍", "🎉🎉", "😀😃😄", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏽‍💻", "🧑‍🚀", "❤️", "🇫🇷🇯🇵", "👋🏿",
    "1️⃣", "™©®", "العربية", "مرحبا بالعالم", "עברית", "שלום עולם", "فارسی",
    "e\u0301", "a\u0308o\u0308", "Z\u0351\u0307a\u0352l\u0357g\u030fo", "n\u0303",
    "\u1e9b\u0323", "ሰላም", "ᏣᎳᎩ", "தமிழ்", "हिन्दी", "नमस्ते", "ภาษาไทย", "ქართული",
    "Հայերեն", "ગુજરાતી", "ᚠᛇᚻ", "𐌰𐌱𐌲", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝕏", "𓀀𓁐", "ꦗꦮ", "ᠮᠣᠩᠭᠣᠯ",
    "\u200b", "a\u200bb", "\ufeffbom", "\u00a0nbsp\u00a0", "\u3000全角", "\u2028\u2029",
    "\u00ad", "x\u202ey", "\u2060", "\t\u000b\u000c", "\x1c\x1d\x1e\x1f", "\x7f", "\x01\x02",
    "‘quotes’ “double”", "— – …", "«guillemets»", "€ £ ¥ ₹ ₿", "→ ⇒ ∀ ∃ ∑ √ ∞", "�",
]
SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>",
    "<start_of_turn>", "<end_of_turn>", "<s>", "</s>", "<repo_name>", "<file_sep>",
    "<|im_start", "im_start|>", "<bos", "bos>", "<|", "|>", "<unused0>", "<unused99>",
    "[multimodal]", "<start_of_image>", "<0x41>", "<jupyter_code>", "<empty_output>",
]
CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(f\"{i} is even\")\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\nprint(x.shape)  # (3, 4)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<T: Clone> Stack<T> {\n    pub fn push(&mut self, x: T) {\n        self.items.push(x);\n    }\n}\n",
    "#[derive(Debug, Clone)]\npub struct Config {\n    pub n_layers: usize,\n}\n",
    "match x {\n    Some(v) => v * 2,\n    None => 0,\n}",
    '{"name": "phaselens", "version": "0.1.0", "tags": ["kv", "phase"], "n": 12}',
    '{\n  "a": [1, 2.5, -3e10, null, true],\n  "b": {"c": "d\\n\\"e\\""}\n}',
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "<div class=\"x\"><p>Hello &amp; welcome</p></div>",
    "$ cargo nextest run --test it tokenizer::\n",
    "x += 1; y -= 2; z *= 3; w /= 4; a <<= 1; b >>= 2; c != d && e || !f",
    "    \n        \n",
    "if (a < b) { return a; } else { return b; }",
    "#!/usr/bin/env bash\nset -euo pipefail\necho \"$HOME\"/${USER:-none}\n",
]


def numbers(rng: random.Random) -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
    if kind == 1:
        return f"{rng.randint(0, 10**6)}.{rng.randint(0, 10**rng.randint(1, 6))}"
    if kind == 2:
        return f"-{rng.randint(1, 10**rng.randint(1, 9))}"
    if kind == 3:
        y, m, d = rng.randint(1900, 2099), rng.randint(1, 12), rng.randint(1, 28)
        return rng.choice([f"{y}-{m:02}-{d:02}", f"{d}/{m}/{y}", f"{m:02}.{d:02}.{y}"])
    if kind == 4:
        a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(1000, 9999)
        return rng.choice([f"+1 ({a}) {b}-{c}", f"{a}-{b}-{c}", f"+44 {a} {b}{c}", f"0{a}{b}{c}"])
    if kind == 5:
        return f"{rng.randint(1, 10**6):,}"
    if kind == 6:
        return f"{rng.random() * 10**rng.randint(-5, 8):.{rng.randint(0, 6)}e}"
    if kind == 7:
        return f"The total is {rng.randint(0, 10**9)} and {rng.randint(0, 99)}% of {rng.random():.4f}."
    return " ".join(str(rng.randint(0, 10**rng.randint(1, 12))) for _ in range(rng.randint(2, 6)))


def whitespace(rng: random.Random) -> str:
    pool = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "    ", "\u00a0", " \n ", "\t\t"]
    parts = []
    for _ in range(rng.randint(1, 6)):
        parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 4))))
        if rng.random() < 0.6:
            parts.append(rng.choice(WORDS))
    return "".join(parts)


def unicode_text(rng: random.Random) -> str:
    n = rng.randint(1, 4)
    sep = rng.choice([" ", "", ", ", "\n"])
    return sep.join(rng.choice(UNICODE + WORDS[:20]) for _ in range(n))


def code(rng: random.Random) -> str:
    snippet = rng.choice(CODE)
    if rng.random() < 0.3:
        snippet = snippet.replace("    ", "\t")
    if rng.random() < 0.3:
        snippet = "    " * rng.randint(1, 3) + snippet
    return snippet


def sentence(rng: random.Random) -> str:
    words = []
    for i in range(rng.randint(3, 18)):
        w = rng.choice(CONTRACTIONS) if rng.random() < 0.08 else rng.choice(WORDS)
        if i == 0 or rng.random() < 0.05:
            w = w.capitalize()
        if rng.random() < 0.03:
            w = w.upper()
        words.append(w)
        if rng.random() < 0.1:
            words[-1] += rng.choice(PUNCT)
    return " ".join(words) + rng.choice([".", "!", "?", "", "\n", " "])


def key_value(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(1, 5)):
        k, v = rng.randint(0, 9999), rng.randint(0, 9999)
        lines.append(rng.choice([f"Key {k}: value {v}", f"key{k}={v}", f"{k} -> {v}",
                                 f"The value of key {k} is {v}."]))
    return "\n".join(lines)


def special(rng: random.Random) -> str:
    parts = [rng.choice(SPECIAL)]
    for _ in range(rng.randint(0, 3)):
        parts.append(rng.choice(["", " ", "\n", rng.choice(WORDS), " " + rng.choice(WORDS)]))
        parts.append(rng.choice(SPECIAL))
    return "".join(parts)


def long_word(rng: random.Random) -> str:
    kind = rng.randrange(5)
    n = rng.randint(20, 400)
    if kind == 0:
        return rng.choice("abcxyz") * n
    if kind == 1:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
    if kind == 2:
        return "antidisestablishmentarianism" * rng.randint(1, 12)
    if kind == 3:
        return "".join(rng.choice("0123456789") for _ in range(n))
    return rng.choice(["🙂", "中", "é", "ـ", "-", "=", "_", "."]) * rng.randint(2, 80)


def mixture(rng: random.Random) -> str:
    makers = [numbers, whitespace, unicode_text, sentence, key_value, special]
    return rng.choice(["", " ", "\n"]).join(rng.choice(makers)(rng) for _ in range(rng.randint(2, 4)))


def chat_texts() -> list[str]:
    """The SmolLM2 chat template's rendered text, written out (not read from a model)."""
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    out = []
    for c in CHAT_CONTENTS:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{c}<|im_end|>\n"
                   "<|im_start|>assistant\n")
        out.append(f"<start_of_turn>user\n{c}<end_of_turn>\n<start_of_turn>model\n")
    return out


def strings() -> list[str]:
    """The fixture's strings, in order: fixed edge cases, then each family from its own
    seeded generator."""
    fixed = ["", " ", "  ", "\n", "\t", "a", "A", "0", "12", "123", "1234", "12345", ".",
             "Hello world", " Hello world", "Hello world ", "hello  world", "\n\nhello\n\n",
             "   leading", "trailing   ", "I'm here.", "don't stop", "9 10 11 100 1000",
             "3.14159", "-42", "2024-06-11", "<|im_start|>user\nhi<|im_end|>", "<bos>hello",
             "<bos><bos>", "▁", "▁▁hello", "\u2581 x", "<0x0A>"]
    fixed += UNICODE + SPECIAL + CODE + chat_texts()
    families = [(numbers, 300), (whitespace, 200), (unicode_text, 250), (code, 60),
                (sentence, 400), (key_value, 150), (special, 120), (long_word, 80),
                (mixture, 320)]
    out = list(fixed)
    for i, (make, count) in enumerate(families):
        rng = random.Random(SEED + i)
        out += [make(rng) for _ in range(count)]
    return out


# ---------------------------------------------------------------------------------------


def digest(strings) -> str:
    """SHA-256 of the strings, each as its UTF-8 length (u32, little-endian) and bytes."""
    h = hashlib.sha256()
    for s in strings:
        b = s.encode("utf-8")
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()


def pipeline(tok) -> dict:
    j = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab))), "ids 0..n-1"
    j["model"]["vocab_sha256"] = digest(t for t, _ in vocab)
    j["model"]["merges_sha256"] = digest(x for pair in j["model"]["merges"] for x in pair)
    j["model"]["vocab"] = len(j["model"]["vocab"])
    j["model"]["merges"] = len(j["model"]["merges"])
    j["added_tokens"] = sorted(
        [a["id"], a["content"], a["special"], a["normalized"], a["lstrip"], a["rstrip"], a["single_word"]]
        for a in j["added_tokens"]
    )
    return j


def fixture(model: str, path: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = tok.backend_tokenizer
    cases = []
    for i, text in enumerate(strings()):
        ids = tok.encode(text, add_special_tokens=False)
        ids_special = tok.encode(text, add_special_tokens=True)
        # transformers' encode is the backend's (no text preprocessing): checked, so the
        # Rust side may build the same pipeline and call the same library.
        assert ids == backend.encode(text, add_special_tokens=False).ids, (name, text)
        assert ids_special == backend.encode(text, add_special_tokens=True).ids, (name, text)
        case = {
            "text": text,
            "ids": ids,
            "ids_special": ids_special,
            "decoded": tok.decode(ids),
            "decoded_special": tok.decode(ids_special),
            "decoded_skip": tok.decode(ids_special, skip_special_tokens=True),
        }
        if i < PIECES_CASES:
            case["pieces"] = tok.convert_ids_to_tokens(ids)
        cases.append(case)
    chat = []
    if tok.chat_template is not None:
        for c in CHAT_CONTENTS:
            text = tok.apply_chat_template([{"role": "user", "content": c}],
                                           add_generation_prompt=True, tokenize=False)
            chat.append({"user": c, "text": text})
    return {
        "model": model,
        "versions": {p: version(p) for p in ("transformers", "tokenizers", "gguf")},
        "pipeline": pipeline(tok),
        "vocab_size": len(tok),
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "add_bos": tok.add_bos_token,
        "add_eos": tok.add_eos_token,
        "chat_template": tok.chat_template,
        "chat": chat,
        "cases": cases,
    }


def synthetic_llama(gemma: Path, out: Path) -> dict:
    """A Llama-architecture SentencePiece GGUF made from part of Gemma 3's vocabulary, so
    the `llama` path (merges ranked by `tokenizer.ggml.scores`, `Metaspace`, BOS + EOS)
    is checked against transformers too. tests/it/tokenizer.rs writes the same metadata
    from the same Gemma file; only these keys (and `general.architecture = llama`) are
    read by phaselens."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(gemma))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    keep = [i for lo, hi in SYNTHETIC_RANGES for i in range(lo, hi)]
    tokens, scores, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), field("tokenizer.ggml.token_type")
    w = GGUFWriter(str(out), "llama")
    # transformers reads a config from the file before the tokenizer: a 1-layer stub.
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([tokens[i] for i in keep])
    w.add_token_scores([scores[i] for i in keep])
    w.add_token_types([types[i] for i in keep])
    meta = SYNTHETIC_META
    w.add_bos_token_id(meta["bos"])
    w.add_eos_token_id(meta["eos"])
    w.add_unk_token_id(meta["unk"])
    w.add_add_bos_token(meta["add_bos"])
    w.add_add_eos_token(meta["add_eos"])
    w.add_tensor("token_embd.weight", np.zeros((1, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"source": MODELS["gemma3"], "ranges": SYNTHETIC_RANGES, "metadata": meta}


# Ids of Gemma 3 kept, in order: the special, control and byte tokens, common words, and
# the single characters (Gemma puts them last), renumbered 0..n-1 in this order.
SYNTHETIC_RANGES = [[0, 500], [6400, 60000], [236000, 262144]]
SYNTHETIC_META = {"bos": 2, "eos": 1, "unk": 3, "add_bos": True, "add_eos": True}


def write(target: Path, data: dict) -> None:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    target.write_text(text + "\n", encoding="utf-8")
    print(f"{target}: {len(data['cases'])} strings, {len(text.encode()) / 1e6:.2f} MB")


def main() -> None:
    out_dir = Path("tests/fixtures/pretrained")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rel in MODELS.items():
        path = models_dir() / rel
        if not path.is_file():
            sys.exit(f"{path} is missing: bash scripts/fetch-models.sh fetches it")
        write(out_dir / f"tokenizer-{name}.json", fixture(rel, path))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-spm.gguf"
        synthetic = synthetic_llama(models_dir() / MODELS["gemma3"], path)
        data = fixture("synthetic llama-spm.gguf", path)
        write(out_dir / "tokenizer-llama-spm.json", {"synthetic": synthetic, **data})


if __name__ == "__main__":
    main()
