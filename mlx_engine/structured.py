"""Structured output: a reply held to a JSON Schema, JSON, a regex or a Lark grammar (llguidance, the library
behind llama.cpp's and vLLM's guided decoding).

`Engine.generate` compiles the request's `ResponseFormat` into a `Constraint` on the caller's thread, so a bad
schema is a RequestError there and never reaches the engine thread. The scheduler then, for each token of a
constrained request: reads the token it sampled last (a host sync: the next mask depends on it), feeds it to
the matcher, and masks the row's logits to the tokens the grammar allows before the sampler's penalties,
temperature and filters (`Sampler.allowed`). Log-probabilities are those of the masked distribution, the one
sampled from. The request ends with "stop" as soon as the grammar admits no further token but end-of-sequence.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from mlx_engine.api import RequestError, ResponseFormat, RooflineError

# Between JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs of indent (llama.cpp's
# json-schema-to-grammar rule). Unbounded whitespace lets a small model pad a reply with blank lines forever.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})?"

_lock = threading.Lock()


def _lltokenizer(tokenizer: Any, vocab_size: int) -> LLTokenizer:
    """llguidance's view of the model's tokenizer (~0.2 s for SmolLM2's 49K tokens): built once per tokenizer."""
    with _lock:
        built = getattr(tokenizer, "_llguidance", None)
        if built is None:
            backend = getattr(tokenizer, "backend", None)
            if backend is None:
                raise RequestError(f"{getattr(tokenizer, 'path', 'this model')} has no tokenizer, which a "
                                   "response format needs (its grammar is over text)")
            n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
            built = LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=list(tokenizer.eos_token_ids) or None)
            tokenizer._llguidance = built
        return built


def grammar(fmt: ResponseFormat) -> str:
    """The format as an llguidance grammar (not yet checked: `constrain` does)."""
    if fmt.type in ("json_object", "json_schema"):
        schema = fmt.schema if fmt.type == "json_schema" else {"type": "object"}
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_pattern": JSON_WHITESPACE})
        except (ValueError, TypeError) as e:
            raise RequestError(f"response format json_schema: the schema is not a JSON object ({e})") from None
    if fmt.type == "regex":
        return LLMatcher.grammar_from_regex(fmt.pattern or "")
    return LLMatcher.grammar_from_lark(fmt.grammar or "")


def constrain(tokenizer: Any, vocab_size: int, fmt: ResponseFormat) -> Constraint:
    """A fresh matcher for one request. RequestError when the schema, regex or grammar is invalid or uses what
    llguidance does not support (its message says what and where)."""
    matcher = LLMatcher(_lltokenizer(tokenizer, vocab_size), grammar(fmt), log_level=0)
    if matcher.is_error():
        what = {"json_object": "JSON", "json_schema": "the JSON Schema", "regex": "the regex",
                "lark": "the Lark grammar"}[fmt.type]
        raise RequestError(f"response format {fmt.type}: {what} cannot be used: {_one_line(matcher.get_error())}")
    return Constraint(matcher, vocab_size)


def _one_line(message: str) -> str:
    """llguidance's first line, and its "error: ..." line where it draws the place in the source beneath."""
    lines = [line.strip() for line in message.strip().splitlines()]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} ({detail})" if lines and detail else (lines[0] if lines else "unknown error")


class Constraint:
    """One request's grammar state. Used on the engine thread only, after `constrain`."""

    def __init__(self, matcher: LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_error() or not mask.any():
            raise RooflineError(f"the response format allows no next token: {self.matcher.get_error() or 'dead end'}")
        return mask

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RooflineError(f"token {token} breaks the response format: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but end-of-sequence."""
        return self.matcher.is_stopped()
