"""A tiny thinking model written by the tests: the qwen3 golden folder's shape, a byte-level tokenizer with
`<|im_start|>`, `<|im_end|>` (EOS) and, where the tags are tokens, `<think>` and `</think>` as added tokens, and a chat
template whose generation prompt opens `<think>` (closed at once with enable_thinking=False, as Qwen3's).

Its weights make it a bigram machine whose greedy reply is known: every layer's output projections are zero, so the
last hidden state is the current token's embedding, and the head scores token y by the embedding of the token chosen
to precede it. From the opened prompt it writes REASONING, `</think>`, then ANSWER and `<|im_end|>`; from the prompt
closed by enable_thinking=False (its last token "\\n"), ANSWER at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.support.tiny_models import GOLDEN, byte_level_vocab

VOCAB = 124  # byte-level pieces of bytes 0..123; ids 124.. are added tokens
IM_START, IM_END, THINK_OPEN, THINK_CLOSE = 124, 125, 126, 127
REASONING, ANSWER = "Why not?", "Sure!"  # the tag-token model's reply; every character once, so bigrams are a chain
TEXT_REASONING, TEXT_ANSWER = "ABC", "XYZ"  # the text-tag model's (its closer's letters are taken by the chain)

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ OPENER }}{% endif %}{% endif %}"
)


def _ids(text: str) -> list[int]:
    return list(text.encode())


def think_model_folder(dst: Path, tags_as_tokens: bool = True) -> Path:
    """The folder. `tags_as_tokens`: `<think>`/`</think>` are ids 126/127 and the prompt ends with the opener token;
    else they are spelled by byte tokens (ids 126/127 are two unused special tokens) and the prompt ends "<think>\\n"."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    dst.mkdir(parents=True, exist_ok=True)
    src = GOLDEN / "qwen3"
    config = json.loads((src / "config.json").read_text())
    config.update(tie_word_embeddings=False, eos_token_id=IM_END)
    (dst / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")

    vocab = {p: i for i, p in enumerate(byte_level_vocab(VOCAB))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    if tags_as_tokens:  # added but not special, as in Qwen3's tokenizer
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")])
    else:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<|r1|>", "<|r2|>")])
    tok.save(str(dst / "tokenizer.json"))
    opener = "'<think>'" if tags_as_tokens else "'<think>\\n'"
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": TEMPLATE.replace("OPENER", opener)}))

    if tags_as_tokens:
        chain = [THINK_OPEN, *_ids(REASONING), THINK_CLOSE, *_ids(ANSWER), IM_END]
        starts = [_ids("\n")[0]]  # enable_thinking=False: the prompt ends "</think>\n\n"
    else:
        chain = [_ids("\n")[0], *_ids(TEXT_REASONING), *_ids("</think>"), *_ids(TEXT_ANSWER), IM_END]
        starts = []
    pairs = list(zip(chain, chain[1:])) + [(s, _ids(ANSWER)[0]) for s in starts]
    _write_bigram_weights(src, dst, config, pairs)
    return dst


def _write_bigram_weights(src: Path, dst: Path, config: dict, pairs: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(51)
    w = load_file(str(src / "model.safetensors"))
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    head = np.zeros((vocab, hidden), dtype=np.float32)
    for x, y in pairs:  # logit of y after x: 8 * |rmsnorm(e_x)| = 64; any other token's ~N(0, 8)
        head[y] += 8 * embed[x] / np.linalg.norm(embed[x])
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = np.zeros_like(w[name])  # each layer adds nothing to the residual stream
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    w["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    save_file(w, str(dst / "model.safetensors"))
