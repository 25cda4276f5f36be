"""Structured output: a reply held to a JSON Schema, JSON, a regex or a Lark grammar (llguidance, the library
behind llama.cpp's and vLLM's guided decoding).

`Engine.generate` compiles the request's `ResponseFormat` into a `Constraint` on the caller's thread, so a bad
schema, or one that admits no text at all (`{"$ref": "#"}`: no first token fits), is a RequestError there and never
reaches the engine thread. The scheduler then, for each token of a
constrained request: reads the token it sampled last (a host sync: the next mask depends on it), feeds it to
the matcher, and masks the row's logits to the tokens the grammar allows before the sampler's penalties,
temperature and filters (`Sampler.allowed`). Log-probabilities are those of the masked distribution, the one
sampled from. The request ends with "stop" as soon as the grammar admits no further token but end-of-sequence.

Speculative decoding keeps working. A draft model (or the self draft) draws each proposal from its own
distribution masked by the grammar after the drafts before it (the last row of `allowed_along`), so it proposes
only what fits; prompt lookup's copy is cut at the first token the grammar refuses. The verification masks each
of its k + 1 rows the same way (`allowed_along`). Rejection sampling with those masked p and q is lossless as ever, so the
output is exactly the masked distribution's, and a quote that fits the grammar is accepted as usual.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from mlx_engine.api import RequestError, ResponseFormat, RooflineError

# Between JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs of indent (llama.cpp's
# json-schema-to-grammar rule). Unbounded whitespace lets a small model pad a reply with blank lines forever.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})?"
# oneOf is read as anyOf (llama.cpp's and xgrammar's reading): llguidance otherwise refuses every oneOf whose
# branches it cannot prove disjoint, and a reply matching two branches is the rare price.
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "coerce_one_of": True}
# What a dead start reads as: llguidance names only its stop reason ("NoExtensionBias") and dumps parser state.
DEAD_START = ("it admits no text: no first token fits (a rule or $ref that leads only back to itself, as "
              '{"$ref": "#"})')

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
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise RequestError(f"response format json_schema: the schema is not a JSON object ({e})") from None
    if fmt.type == "regex":
        return LLMatcher.grammar_from_regex(fmt.pattern or "")
    return LLMatcher.grammar_from_lark(fmt.grammar or "")


_WHAT = {"json_object": "JSON", "json_schema": "the JSON Schema", "regex": "the regex", "lark": "the Lark grammar"}


def _matcher_error(matcher: LLMatcher) -> str | None:
    """Why the matcher cannot start (one line), or None: a grammar that compiles may still allow no first token."""
    if matcher.is_error():
        return _one_line(matcher.get_error())
    matcher.compute_bitmask()
    return DEAD_START if matcher.is_error() else None


def constrain(tokenizer: Any, vocab_size: int, fmt: ResponseFormat) -> Constraint:
    """A fresh matcher for one request. RequestError when the schema, regex or grammar is invalid, uses what
    llguidance does not support (its message says what and where) or admits no text."""
    matcher = LLMatcher(_lltokenizer(tokenizer, vocab_size), grammar(fmt), log_level=0)
    error = _matcher_error(matcher)
    if error is not None:
        raise RequestError(f"response format {fmt.type}: {_WHAT[fmt.type]} cannot be used: {error}")
    return Constraint(matcher, vocab_size, tuple(tokenizer.eos_token_ids))


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes (and an end): over it a grammar allows a first token exactly when
    it admits some text, whatever the model's tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_bytes_tokenizer: LLTokenizer | None = None


def format_error(fmt: ResponseFormat) -> str | None:
    """Why llguidance cannot hold a reply to the format (its reason, one line), or None when it can. Needs no model:
    a front end checks a format, or a tool's schema, before anything loads or runs."""
    try:
        source = grammar(fmt)
    except RequestError as e:
        return str(e).split(": ", 1)[-1]
    error = LLMatcher.validate_grammar(source, None)
    if error:
        return _one_line(error)
    return _matcher_error(LLMatcher(bytes_tokenizer(), source, log_level=0))


def bytes_tokenizer() -> LLTokenizer:
    """llguidance's view of `_Bytes` (built once): a grammar's text checked with no model loaded."""
    global _bytes_tokenizer
    with _lock:
        if _bytes_tokenizer is None:
            _bytes_tokenizer = LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])
        return _bytes_tokenizer


def check_format(fmt: ResponseFormat) -> None:
    """RequestError, worded as `constrain`'s, for a schema, regex or grammar llguidance cannot compile or that admits
    no text; needs no tokenizer, so a front end can check a format before the model loads."""
    error = format_error(fmt)
    if error is not None:
        raise RequestError(f"response format {fmt.type}: {_WHAT[fmt.type]} cannot be used: {error}")


# llguidance's runtime errors carry the parser's state and the whole grammar (hundreds of lines): never shown
MAX_REASON = 200


def _one_line(message: str) -> str:
    """llguidance's first line, and its "error: ..." line where it draws the place in the source beneath; at most
    MAX_REASON characters."""
    lines = [line.strip() for line in message.strip().splitlines()]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    out = f"{lines[0]} ({detail})" if lines and detail else (lines[0] if lines else "unknown error")
    return out if len(out) <= MAX_REASON else out[:MAX_REASON - 3] + "..."


class Constraint:
    """One request's grammar state. Used on the engine thread only, after `constrain`."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_ids: tuple[int, ...] = ()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_error() or not mask.any():
            reason = _one_line(self.matcher.get_error()) if self.matcher.is_error() else "dead end"
            raise RooflineError(f"the response format allows no next token: {reason}")
        return mask

    def consumable(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts before the first it refuses or an end-of-sequence
        (which ends the reply, or under ignore_eos is not fed to the grammar)."""
        valid = self.matcher.validate_tokens(tokens)
        return next((i for i, t in enumerate(tokens[:valid]) if t in self.eos_ids), valid)

    def _rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            raise RooflineError(f"the response format could not roll back {n} tokens: "
                                f"{_one_line(self.matcher.get_error())}")

    def allowed_along(self, tokens: list[int]) -> np.ndarray:
        """(len(tokens) + 1, vocab_size) bool: row i is what the grammar allows after tokens[:i] (a speculative
        verification's rows; the last row, a draft model's next proposal's mask). Past the first token the grammar
        refuses, rows repeat the last: that token's probability is 0 there, so it is rejected and no later row is
        used. The matcher ends where it began."""
        valid = self.consumable(tokens)
        rows, done = [self.allowed()], 0
        try:
            for token in tokens[:valid]:
                self.consume(token)
                done += 1
                rows.append(self.allowed())
        finally:
            self._rollback(done)
        rows += [rows[-1]] * (len(tokens) - valid)
        return np.stack(rows)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RooflineError(f"token {token} breaks the response format: {_one_line(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more but end-of-sequence."""
        return self.matcher.is_stopped()
