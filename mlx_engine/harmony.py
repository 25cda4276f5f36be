"""gpt-oss's harmony format as a reasoning family ("harmony"): the reply is messages on channels, split by
`openai-harmony`'s `StreamableParser` as the scheduler emits tokens. `analysis` is reasoning, `final` the answer,
`commentary` addressed `to=functions.NAME` a tool call (`api.ToolCall`, on the final event), `commentary` to no one
(a preamble meant for the user) answer text.

openai-harmony tokenizes with o200k_harmony, whose vocabulary it would download (`o200k_base.tiktoken`) and which it
checks by SHA-256 wherever it reads it from. Nothing is fetched here: the file is written from the checkpoint's own
tokenizer (gpt-oss's tokenizer is o200k_base's ranks plus the harmony special tokens) into the cache dir, and
`TIKTOKEN_ENCODINGS_BASE` points openai-harmony at it. A tokenizer whose vocabulary is not o200k's (the hash
differs) is no harmony model here.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.api import ToolCall

HARMONY = "harmony"
VOCAB_FILE = "o200k_base.tiktoken"
# what openai-harmony checks the file against (its tiktoken_ext/public_encodings.rs)
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_BASE_TOKENS = 199998  # o200k_base's ranks; the special tokens start here
# o200k_harmony's ids for the markup, fixed by openai-harmony
START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN = 200006, 200007, 200008, 200005, 200002, 200012, 200003
MARKERS = {"<|start|>": START, "<|end|>": END, "<|message|>": MESSAGE, "<|channel|>": CHANNEL,
           "<|return|>": RETURN, "<|call|>": CALL}
ENDS = (END, RETURN, CALL)
FUNCTIONS = "functions."
_env_lock = threading.Lock()
# a tokenizer's HarmonyFormat, or why it has none (its vocabulary is not o200k's)
_formats: weakref.WeakKeyDictionary[Any, HarmonyFormat | str] = weakref.WeakKeyDictionary()


def is_harmony(tokenizer: Any) -> bool:
    """The tokenizer spells the harmony markup as single tokens at o200k_harmony's ids and its chat template writes
    them (gpt-oss, whatever the checkpoint is called)."""
    template = getattr(tokenizer, "chat_template", None)
    backend = getattr(tokenizer, "backend", None)
    if not isinstance(template, str) or "<|channel|>" not in template or backend is None:
        return False
    return all(backend.token_to_id(text) == i for text, i in MARKERS.items())


def vocab_text(tokenizer: Any) -> bytes:
    """The tokenizer's first NUM_BASE_TOKENS tokens in the .tiktoken format (`base64(bytes) rank` a line, by
    rank): o200k_base.tiktoken itself where the tokenizer is o200k's. Byte-level pieces only (GPT-2's byte map)."""
    from mlx_engine.tokenizer import _byte_decoder

    decoder = _byte_decoder()
    pieces = {i: p for p, i in tokenizer.backend.get_vocab(with_added_tokens=False).items() if i < NUM_BASE_TOKENS}
    if len(pieces) != NUM_BASE_TOKENS:
        raise ValueError(f"its vocabulary has {len(pieces)} base tokens, o200k has {NUM_BASE_TOKENS}")
    lines = []
    for i in range(NUM_BASE_TOKENS):
        raw = bytes(decoder[c] for c in pieces[i])  # KeyError: not a byte-level piece
        lines.append(f"{base64.b64encode(raw).decode()} {i}\n")
    return "".join(lines).encode()


def write_vocab(tokenizer: Any, folder: Path) -> Path:
    """`folder`/o200k_base.tiktoken written from the tokenizer (kept where already there and whole). ValueError where
    the tokenizer's vocabulary is not o200k's: checked even where the file is there, since another model wrote it."""
    try:
        text = vocab_text(tokenizer)
    except KeyError:
        raise ValueError("its vocabulary is not byte-level BPE, so it is not o200k's") from None
    if hashlib.sha256(text).hexdigest() != VOCAB_SHA256:
        raise ValueError("its vocabulary differs from o200k_base's")
    path = folder / VOCAB_FILE
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(text)
    tmp.replace(path)  # atomic: another process may be reading it
    return path


def load_encoding(folder: Path) -> Any:
    """openai-harmony's gpt-oss encoding from `folder`/o200k_base.tiktoken, never from the network."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    with _env_lock:  # the variable is read during the load only; put back what was there
        before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            if before is None:
                del os.environ["TIKTOKEN_ENCODINGS_BASE"]
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def harmony_format(tokenizer: Any) -> HarmonyFormat | None:
    """The tokenizer's HarmonyFormat (built once per tokenizer), or None: not harmony, or its vocabulary is not
    o200k's (openai-harmony could not read its replies)."""
    if not is_harmony(tokenizer):
        return None
    found = _read(tokenizer)
    return found if isinstance(found, HarmonyFormat) else None


def harmony_warning(tokenizer: Any) -> str | None:
    """Why a tokenizer that looks like gpt-oss's (its chat template writes the harmony markup, which it has as tokens
    of its own) is not read as harmony (`ModelInfo.warnings`), or None. Such a model's replies are shown as they are,
    markup and tool calls included, with no reasoning split from them."""
    template = getattr(tokenizer, "chat_template", None)
    backend = getattr(tokenizer, "backend", None)
    if not isinstance(template, str) or "<|channel|>" not in template or backend is None:
        return None
    ids = {text: backend.token_to_id(text) for text in MARKERS}
    if any(i is None for i in ids.values()):
        return None  # the markup is text to this tokenizer: not a harmony model
    head = ("the chat template writes gpt-oss's harmony format, but openai-harmony cannot read this tokenizer's "
            "replies (")
    tail = "): replies come back as they are, markup included, with no reasoning or tool calls read from them"
    if not is_harmony(tokenizer):
        moved = ", ".join(f"{t} is {i}, not {MARKERS[t]}" for t, i in ids.items() if i != MARKERS[t])
        return f"{head}its markup tokens are not at o200k_harmony's ids: {moved}{tail}"
    found = _read(tokenizer)
    return None if isinstance(found, HarmonyFormat) else f"{head}{found}{tail}"


def _read(tokenizer: Any) -> HarmonyFormat | str:
    """The tokenizer's HarmonyFormat, or why it cannot have one; once per tokenizer."""
    try:
        return _formats[tokenizer]
    except (KeyError, TypeError):
        pass
    from mlx_engine.paths import cache_dir

    try:
        fmt: HarmonyFormat | str = HarmonyFormat(load_encoding(write_vocab(tokenizer, cache_dir() / "harmony").parent))
    except ValueError as e:
        fmt = str(e)
    try:
        _formats[tokenizer] = fmt
    except TypeError:  # not weakly referable: built again next time
        pass
    return fmt


class HarmonyFormat:
    """The "harmony" family (`reasoning.ReasoningFormat`): a `HarmonyParser` per request."""

    family = HARMONY

    def __init__(self, encoding: Any):
        self.encoding = encoding
        self.assistant = tuple(encoding.encode("assistant"))
        self.final = tuple(encoding.encode("final"))

    def parser(self, prompt_ids: list[int], budget: int | None = None) -> HarmonyParser:
        return HarmonyParser(self, budget=budget)


# where the parser is in the reply
_HEADER, _CONTENT, _BETWEEN, _BROKEN = 0, 1, 2, 3


class HarmonyParser:
    """One reply's harmony messages (`reasoning.ReasoningParser`), read by openai-harmony's StreamableParser.

    The generation prompt ends with `<|start|>assistant`, so the reply starts in a message's header. `num_tokens`
    counts the tokens of `analysis` messages, headers and ends included; the budget counts their content tokens, and
    once reached forces `<|end|><|start|>assistant<|channel|>final<|message|>` (from a header:
    `<|channel|>final<|message|>`). A reply openai-harmony cannot parse gives the rest of its text as the answer."""

    def __init__(self, fmt: HarmonyFormat, budget: int | None = None):
        from openai_harmony import Role, StreamableParser

        self.fmt = fmt
        self.budget = budget
        self.num_tokens = 0
        self.num_thinking = 0  # analysis content tokens: what the budget counts
        self._parser = StreamableParser(fmt.encoding, role=Role.ASSISTANT)
        self._state = _HEADER
        self._header = 0  # tokens of the header being read
        self._channel: str | None = None
        self._recipient: str | None = None
        self._answer_token = False
        self._answered = False  # a final message has begun: the budget no longer applies
        self._forced: list[int] = []  # the closer's tokens still to write
        self._calls: tuple[ToolCall, ...] | None = None

    @property
    def answer_token(self) -> bool:
        return self._answer_token

    @property
    def answering(self) -> bool:
        return self._state == _BROKEN or (self._state == _CONTENT and self._answer_message())

    def _answer_message(self) -> bool:
        return self._channel in ("final", None) and self._recipient is None

    @property
    def budgeted(self) -> bool:
        return self.budget is not None and not self._answered and self._state != _BROKEN

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The reply's `commentary` messages to `functions.NAME` (complete after `flush`)."""
        return self._calls if self._calls is not None else self._read_calls(self._parser.messages)

    def _closer(self) -> list[int]:
        tail = [CHANNEL, *self.fmt.final, MESSAGE]
        if self._state == _HEADER and self._header == 0:
            return tail
        if self._state == _BETWEEN:
            return [START, *self.fmt.assistant, *tail]
        return [END, START, *self.fmt.assistant, *tail]

    def _forcing(self) -> bool:
        if self._forced:
            return True
        if not self.budgeted or self.num_thinking < self.budget:  # type: ignore[operator]
            return False
        if self._state == _HEADER and self._header > 0:
            return False  # a header the model began is let finish (its channel is not known yet)
        self._forced = self._closer()
        return True

    def steers(self, unread: int) -> bool:
        return self.budgeted and self.num_thinking + unread >= self.budget  # type: ignore[operator]

    def mask(self, grammar: np.ndarray | None, vocab_size: int) -> np.ndarray | None:
        if self._forcing():
            forced = np.zeros(vocab_size, dtype=bool)
            forced[self._forced[0]] = True
            return forced
        return grammar if self.answering else None

    def draft_room(self, unread: int, constrained: bool) -> int | None:
        if self._answered or self._state == _BROKEN:
            return None
        if constrained:  # where the grammar starts is known only once the final header is read
            return 0
        if self.budget is None:
            return None
        return max(0, self.budget - self.num_thinking - unread - 1)

    def feed(self, token_id: int, text: str) -> tuple[str, str]:
        if self._forced and token_id == self._forced[0]:
            self._forced.pop(0)
        if self._state == _BROKEN:
            self._answer_token = True
            return "", text
        try:
            self._parser.process(token_id)
        except Exception:  # noqa: BLE001 - HarmonyError: not harmony after all; the rest is shown as it is
            self._state, self._answer_token, self._forced = _BROKEN, True, []
            return "", text
        was_analysis = self._channel == "analysis"
        delta = ""
        if self._state == _CONTENT:
            if token_id in ENDS:
                self._state = _BETWEEN
                self.num_tokens += was_analysis
                self._answer_token = False
                return "", ""
            delta = self._parser.last_content_delta or ""
            self.num_tokens += was_analysis
            self.num_thinking += was_analysis
        elif token_id == START:
            self._state, self._header = _HEADER, 1
        elif token_id == MESSAGE:
            self._state, self._header = _CONTENT, self._header + 1
            self._channel, self._recipient = self._parser.current_channel, self._parser.current_recipient
            self._answered |= self._channel == "final"
            if self._channel == "analysis":
                self.num_tokens += self._header
        else:
            self._header += 1
        self._answer_token = self._state == _CONTENT and token_id != MESSAGE and self._answer_message()
        if not delta:
            return "", ""
        if self._channel == "analysis":
            return delta, ""
        if self._recipient is None:  # final, or a preamble to the user
            return "", delta
        return "", ""  # a tool call's arguments

    def flush(self, text: str = "") -> tuple[str, str]:
        if self._state == _BROKEN:
            return "", text
        try:
            self._parser.process_eos()  # <|call|> and <|return|> end the reply without being fed: close its message
        except Exception:  # noqa: BLE001 - a reply cut inside a header: no message to close
            pass
        self._calls = self._read_calls(self._parser.messages)
        return "", ""

    @staticmethod
    def _read_calls(messages: list[Any]) -> tuple[ToolCall, ...]:
        calls = []
        for m in messages:
            r = m.recipient or ""
            if m.channel == "commentary" and r.startswith(FUNCTIONS):
                calls.append(ToolCall(name=r[len(FUNCTIONS):], arguments="".join(c.text for c in m.content)))
        return tuple(calls)
