"""A tiny gpt-oss that calls a tool: `tests/support/harmony_models.py`'s checkpoint (the real o200k_harmony tokenizer)
with gpt-oss's own chat template (tests/data/gpt_oss_chat_template.jinja) and weights rewritten so that its greedy reply
to any conversation is CALL.

The bigram trick of `tests/support/think_models.py`: every attention output projection and every expert's down
projection are zero, biases included, so each layer adds nothing to the residual stream and the last hidden state is the
current token's embedding; the head scores token y by the embedding of the token chosen to precede it. The generation
prompt ends `<|start|>assistant` (spelled byte by byte by this merge-less tokenizer, so its last token is "t"), and
CALL's o200k tokens (the ids openai-harmony encodes it with, as gpt-oss writes it) repeat none, "t" included: each
token has one successor, and the chain runs from "t" to `<|call|>`, an end-of-sequence token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.support.harmony_models import VOCAB_SIZE, harmony_tokenizer_files
from tests.support.tiny_models import GOLDEN

TEMPLATE_FILE = Path(__file__).parent.parent / "data" / "gpt_oss_chat_template.jinja"
ARGUMENTS = '{"city":"Paris"}'
CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>"


def call_chain(tokenizer_folder: Path) -> list[int]:
    """The prompt's last token, then CALL's tokens as openai-harmony encodes them (needs ROOFLINE_CACHE_DIR: the
    vocabulary file is written there)."""
    from mlx_engine.harmony import harmony_format
    from mlx_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tokenizer_folder)
    fmt = harmony_format(tok)
    assert fmt is not None
    (last,) = tok.encode("t", add_special_tokens=False)
    chain = [last, *fmt.encoding.encode(CALL, allowed_special="all")]
    assert len(set(chain)) == len(chain), "a token repeats: the bigram chain would branch"
    return chain


def harmony_tool_model_folder(dst: Path) -> Path:
    """The folder: tokenizer files with gpt-oss's template, config, and the bigram weights."""
    harmony_tokenizer_files(dst)
    config_path = dst / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = TEMPLATE_FILE.read_text()
    config_path.write_text(json.dumps(tok_config))
    chain = call_chain(dst)

    src = GOLDEN / "gpt_oss"
    config = json.loads((src / "config.json").read_text())
    # the merge-less tokenizer spells the system message and the tools byte by byte: room for them (the attention adds
    # nothing, so positions past the golden checkpoint's do not matter)
    config.update(vocab_size=VOCAB_SIZE, eos_token_id=[200002, 199999, 200012], max_position_embeddings=4096)
    (dst / "config.json").write_text(json.dumps(config))
    w = load_file(str(src / "model.safetensors"))
    hidden = config["hidden_size"]
    rng = np.random.default_rng(51)
    embed = rng.standard_normal((VOCAB_SIZE, hidden)).astype(np.float32)
    head = np.zeros((VOCAB_SIZE, hidden), dtype=np.float32)
    for x, y in zip(chain, chain[1:]):  # logit of y after x: 8 * |rmsnorm(e_x)| = 64; any other token's ~N(0, 8)
        head[y] += 8 * embed[x] / np.linalg.norm(embed[x])
    for name in w:
        if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj", "experts.down_proj_bias")):
            w[name] = np.zeros_like(w[name])
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed.astype(np.float16), head.astype(np.float16)
    w["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    save_file(w, str(dst / "model.safetensors"))
    return dst
