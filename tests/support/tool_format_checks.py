"""What the tests of each family's tool-call format share: a tiny random model folder with a byte-level tokenizer,
the family's markup tokens and its chat template; whether a grammar accepts a text (llguidance over the byte
tokenizer); and a reply read whole and streamed under random chunkings to the same content and calls."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
from llguidance import LLMatcher
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.toolcalls.tool_formats import ToolFormat
from app.toolcalls.tools import Tools
from mlx_engine.structured import grammar
from tests.support.schema_models import BYTES
from tests.support.tiny_models import byte_level_vocab, folder_with_weights

DATA = Path(__file__).parent.parent / "data"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
EARLIER = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "days": 2}'}}]}


def tiny_folder(root: Path, template: str, special: list[str], eos: str, bos: str | None = None,
                added: tuple[str, ...] = ()) -> tuple[Path, int]:
    """The golden random qwen2 (the architecture is no matter to a format) with a vocabulary of the 256 bytes,
    `special` and `added` tokens (ids from 256 in that order), a longer context, and `template`; and the
    vocabulary's size."""
    vocab = 256 + len(special) + len(added) + 2
    folder = root / "tiny"
    embed = np.random.default_rng(0).standard_normal((vocab, 64)).astype(np.float32)
    folder_with_weights(DATA / "golden" / "qwen2", folder, {"model.embed_tokens.weight": embed})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab, "max_position_embeddings": 4096}))
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_level_vocab(256))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": eos, "chat_template": template, **({"bos_token": bos} if bos else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, vocab


def accepts(fmt: Any, text: str) -> bool:
    m = LLMatcher(BYTES, grammar(fmt), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_alike(fmt: ToolFormat, text: str, content: str | None, calls: list, tools: Tools | None = None,
               id_check=lambda i: i.startswith("call_")) -> None:
    """`fmt` reads `text` whole as `content` and `calls` ([(name, arguments)]), and streamed in random pieces as the
    same text (all of it, where it makes no call) and calls: each a first piece with its id and name, then
    argument fragments that add up to its arguments."""
    got_content, got_calls = fmt.parse(text, tools)
    assert got_content == content
    assert [(c["function"]["name"], arguments(c["function"]["arguments"])) for c in got_calls or []] == calls
    assert all(id_check(c["id"]) and c["type"] == "function" for c in got_calls or [])
    rng = random.Random(0)
    for _ in range(8):
        reader, deltas, at = fmt.stream(tools), [], 0
        while at < len(text):
            n = rng.randint(1, 7)
            deltas += reader.feed(text[at:at + n])
            at += n
        deltas += reader.finish()
        streamed = "".join(d.content for d in deltas if d.content is not None)
        assert streamed == (content or "" if calls else text)
        pieces: dict[int, list[dict]] = {}
        for d in deltas:
            if d.call is not None:
                pieces.setdefault(d.call["index"], []).append(d.call)
        assert reader.called == bool(calls) and len(pieces) == len(calls)
        for (name, args), parts in zip(calls, pieces.values()):
            head, rest = parts[0], parts[1:]
            assert id_check(head["id"]) and head["type"] == "function" and head["function"]["name"] == name
            assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
            joined = "".join(p["function"]["arguments"] for p in parts)
            assert arguments(joined) == args
            if got_calls:  # streamed, the arguments' text is what the whole reply gives
                assert joined == got_calls[list(pieces).index(head["index"])]["function"]["arguments"]
