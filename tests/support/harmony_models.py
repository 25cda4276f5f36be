"""A tiny gpt-oss written by the tests that carries the real o200k_harmony tokenizer: the gpt_oss golden folder's
shape with o200k's 201088-token vocabulary, a tokenizer.json built from o200k_base's ranks (tests/data/o200k: the
file openai-harmony itself would download, checked by the same SHA-256) plus the harmony special tokens, and a small
harmony chat template. The tokenizer has no merges: prompts encode byte by byte, which any o200k id decodes the same.
Weights are random: replies are steered by the engine's budget mask, or the parser is driven with scripted ids.
"""

from __future__ import annotations

import base64
import hashlib
import json
import lzma
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.support.tiny_models import GOLDEN

VOCAB_XZ = Path(__file__).parent.parent / "data" / "o200k" / "o200k_base.tiktoken.xz"
VOCAB_SIZE = 201088
SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}

TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT.\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{% for m in messages %}{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def o200k_text() -> bytes:
    """o200k_base.tiktoken, checked against the hash openai-harmony checks."""
    text = lzma.decompress(VOCAB_XZ.read_bytes())
    assert hashlib.sha256(text).hexdigest() == "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
    return text


def harmony_tokenizer_files(dst: Path) -> Path:
    """tokenizer.json, tokenizer_config.json (the harmony template) and generation_config.json (gpt-oss's EOS ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from mlx_engine.tokenizer import _byte_decoder

    encoder = {b: c for c, b in _byte_decoder().items()}
    vocab = {}
    for line in o200k_text().splitlines():
        token, rank = line.split()
        vocab["".join(encoder[b] for b in base64.b64decode(token))] = int(rank)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = {i: SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(len(vocab), VOCAB_SIZE)}
    tok.add_special_tokens([AddedToken(names[i], normalized=False, special=True) for i in sorted(names)])
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "chat_template": TEMPLATE}))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    return dst


def harmony_model_folder(dst: Path) -> Path:
    """The gpt_oss golden checkpoint widened to o200k's vocabulary (float16 embeddings and head, random)."""
    harmony_tokenizer_files(dst)
    src = GOLDEN / "gpt_oss"
    config = json.loads((src / "config.json").read_text())
    config.update(vocab_size=VOCAB_SIZE, eos_token_id=[200002, 199999, 200012])
    (dst / "config.json").write_text(json.dumps(config))
    w = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(51)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w[name] = (0.2 * rng.standard_normal((VOCAB_SIZE, config["hidden_size"]))).astype(np.float16)
    save_file(w, str(dst / "model.safetensors"))
    return dst
