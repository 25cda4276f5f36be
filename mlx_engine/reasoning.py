"""Reasoning kept apart from the answer: which reasoning family a model's chat template and tokenizer show, the
template variables a request's `reasoning_effort` becomes, and a streaming parser per family that splits the reply
on token ids as the scheduler emits it (`GenerationEvent.reasoning` / `.text`).

Families (`ModelInfo.reasoning`):
- "think": the chat template mentions `</think>` and the tokenizer spells `<think>` and `</think>` (Qwen3, QwQ,
  DeepSeek-R1, SmolLM3, Granite 3.3): text between the tags is reasoning. A generation prompt that already ends with
  an opened `<think>` (DeepSeek-R1, Qwen3's thinking-only models, or any template by its variables) starts the reply
  inside the reasoning: that is read per request from the rendered prompt's last tokens, not per model.
- "harmony" (gpt-oss's channels, `harmony.py`): the tokenizer spells the harmony markup as o200k_harmony's tokens
  and the template writes it; `openai-harmony` parses the reply: `analysis` is reasoning, `final` the answer,
  `commentary` to a function a tool call (`GenerationEvent.tool_calls`).

A tag that is one token of the vocabulary is matched by its id, so the same characters written by other tokens (a
reply quoting "<think>") stay text; a tag spelled by several tokens is matched in the text, and text that may be its
beginning is held back until it is not (as `stop.py` holds a possible stop string). MLX-free, so front ends may use
`template_kwargs` and the names here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mlx_engine.api import RequestError, ToolCall

THINK = "think"
HARMONY = "harmony"  # gpt-oss's analysis/final channels (harmony.py)
OPEN, CLOSE = "<think>", "</think>"
# reasoning_effort values that turn a "think" template's thinking off (its enable_thinking variable); harmony cannot
# turn it off, so they are its lowest effort
EFFORTS_OFF = ("none", "minimal")
HARMONY_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high"}
# names encode_chat and the renderer take themselves: a request's template variables cannot be one of them
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "special_tokens", "source", "literal")
_PROMPT_TAIL = 16  # tokens of the prompt read for an opened tag: the tag and the whitespace after it


class ReasoningParser(Protocol):
    """One request's split of its reply into reasoning and answer, fed each emitted token in order on the engine
    thread. A family (think tags, harmony channels) implements it; the scheduler knows no family.

    `num_tokens` is `Usage.reasoning_tokens`: the reply's tokens that belong to its reasoning, the tags that open
    and close it included (completion_tokens - num_tokens are the answer's)."""

    num_tokens: int
    budget: int | None  # SamplingParams.reasoning_budget

    def feed(self, token_id: int, text: str) -> tuple[str, str]:
        """A generated token and its detokenized text -> (new reasoning text, new answer text); either may be ""
        while text that may begin a tag is held."""
        ...

    def flush(self, text: str = "") -> tuple[str, str]:
        """End of the reply: `text` (the detokenizer's tail) and whatever was held, as (reasoning, answer)."""
        ...

    @property
    def answer_token(self) -> bool:
        """The token fed last belongs to the answer (a response format's grammar consumes it)."""
        ...

    @property
    def answering(self) -> bool:
        """The next token is the answer's, or may begin it: a response format's grammar holds it."""
        ...

    @property
    def budgeted(self) -> bool:
        """The budget still bounds this reply (its reasoning is not closed), so tokens must not be drawn ahead of
        what was read further than `draft_room` allows."""
        ...

    def steers(self, unread: int) -> bool:
        """With `unread` tokens sampled and not yet fed, the next draw may depend on them: the scheduler reads them
        first and draws with `mask`."""
        ...

    def mask(self, grammar: np.ndarray | None, vocab_size: int) -> np.ndarray | None:
        """(vocab_size,) bool: the tokens the next draw may take, given the grammar's mask (None: no grammar, or
        it is not active); None: any token."""
        ...

    def draft_room(self, unread: int, constrained: bool) -> int | None:
        """How many draft tokens a speculative verification may take now without passing the budget or the point
        where a grammar starts (`constrained`); None: no limit."""
        ...

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The functions the reply called in its family's own format, read after `flush` (the final event's)."""
        ...


@dataclass(frozen=True)
class ThinkTags:
    """A tokenizer's `<think>` and `</think>`: each one's id where it is one token (matched by id), else None
    (matched in the text); `close_ids`, the tokens the budget writes to close the reasoning."""

    open_id: int | None
    close_id: int | None
    close_ids: tuple[int, ...]
    open: str = OPEN
    close: str = CLOSE


class ReasoningFormat(Protocol):
    """A loaded model's reasoning family (built once at load by `reasoning_for`): a parser for each request."""

    family: str  # ModelInfo.reasoning

    def parser(self, prompt_ids: list[int], budget: int | None = None) -> ReasoningParser:
        """The parser of a request whose prompt is `prompt_ids` (it may open the reasoning itself)."""
        ...


class ThinkFormat:
    """The "think" family: `<think>` ... `</think>` (`ThinkParser`)."""

    family = THINK

    def __init__(self, tokenizer: Any, tags: ThinkTags):
        self.tags = tags
        self._decode = tokenizer.decode

    def opened(self, prompt_ids: list[int]) -> bool:
        """The prompt ends with an opened `<think>` (whitespace after it aside): the reply starts in its reasoning."""
        tail = prompt_ids[-_PROMPT_TAIL:]
        if self.tags.open_id is not None and self.tags.open_id not in tail:
            return False
        return self._decode(tail).rstrip().endswith(self.tags.open)

    def parser(self, prompt_ids: list[int], budget: int | None = None) -> ThinkParser:
        return ThinkParser(self.tags, opened=self.opened(prompt_ids), budget=budget)


def reasoning_for(tokenizer: Any) -> ReasoningFormat | None:
    """The reasoning family the tokenizer's chat template shows, or None (a model without reasoning)."""
    from mlx_engine.harmony import harmony_format, is_harmony

    if is_harmony(tokenizer):
        return harmony_format(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or CLOSE not in template:
        return None
    tags = think_tags(tokenizer)
    return None if tags is None else ThinkFormat(tokenizer, tags)


def reasoning_family(tokenizer: Any) -> str | None:
    """`ModelInfo.reasoning`: every backend sets it at load from this one function."""
    found = reasoning_for(tokenizer)
    return None if found is None else found.family


def think_tags(tokenizer: Any) -> ThinkTags | None:
    """The tokenizer's ids for `<think>` and `</think>`, or None where it cannot write them back as they are."""
    try:
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
        if any(not i or tokenizer.decode(i).strip() != tag for i, tag in zip(ids, (OPEN, CLOSE))):
            return None
    except (RequestError, AttributeError, TypeError):
        return None
    open_ids, close_ids = ids
    return ThinkTags(open_id=open_ids[0] if len(open_ids) == 1 else None,
                     close_id=close_ids[0] if len(close_ids) == 1 else None, close_ids=tuple(close_ids))


def template_kwargs(family: str | None, chat_template_kwargs: Mapping[str, Any] | None,
                    reasoning_effort: str | None) -> dict[str, Any]:
    """The variables a request adds to the chat template: its own `chat_template_kwargs`, then what its
    `reasoning_effort` means for the family: on "think", "none" and "minimal" set `enable_thinking=False` (unless the
    request set `enable_thinking` itself), other values leave the template's default; the effort itself is passed as
    `reasoning_effort` too (templates that read it, like gpt-oss's: its "Reasoning:" line, on "harmony" only low,
    medium or high, so "none" and "minimal" are "low"). A model without reasoning gets the variables as given, which
    its template ignores."""
    out = dict(chat_template_kwargs or {})
    reserved = [k for k in out if k in RESERVED_TEMPLATE_VARIABLES]
    if reserved:
        raise RequestError(f"invalid chat_template_kwargs: {reserved[0]!r} is the request's own field, not a template "
                           "variable")
    if reasoning_effort is not None:
        out.setdefault("reasoning_effort", HARMONY_EFFORTS.get(reasoning_effort, reasoning_effort) if family == HARMONY
                          else reasoning_effort)
        if family == THINK and reasoning_effort in EFFORTS_OFF:
            out.setdefault("enable_thinking", False)
    return out


# ThinkParser's states
_PENDING = 0  # nothing but whitespace yet: the reply may still open its reasoning
_REASONING = 1
_LEAD = 2  # just closed: the answer's leading whitespace is dropped
_ANSWER = 3


class ThinkParser:
    """`<think>` ... `</think>` over one reply's tokens (`ReasoningParser`).

    The reasoning is one block at the start of the reply: opened by the prompt, or by the reply's first text besides
    whitespace; after its closer (or after any other first text) everything is the answer, tags included. Whitespace
    at the reasoning's two ends and at the answer's start after it is dropped. `num_tokens` counts the tokens from
    the opener through the closer (the tag tokens included); the budget counts the tokens between them."""

    def __init__(self, tags: ThinkTags, opened: bool, budget: int | None = None):
        self.tags = tags
        self.state = _REASONING if opened else _PENDING
        self.budget = budget
        self.num_tokens = 0
        self.num_thinking = 0  # reasoning tokens between the tags: what the budget counts
        self._answer_token = True
        self._held = ""  # text not yet given out: whitespace, or what may begin a tag
        self._began = False  # reasoning text given out (its leading whitespace is dropped)
        self._forced = 0  # closer tokens written under the budget

    tool_calls: tuple[ToolCall, ...] = ()  # think templates' tool calls are the server's grammar's, not parsed here

    @property
    def answer_token(self) -> bool:
        return self._answer_token

    @property
    def answering(self) -> bool:
        return self.state != _REASONING

    @property
    def budgeted(self) -> bool:
        return self.budget is not None and self.state in (_PENDING, _REASONING)

    def _forcing(self) -> bool:
        return self.state == _REASONING and self.budget is not None and self.num_thinking >= self.budget

    def steers(self, unread: int) -> bool:
        return self.budgeted and self.num_thinking + unread >= self.budget  # type: ignore[operator]

    def mask(self, grammar: np.ndarray | None, vocab_size: int) -> np.ndarray | None:
        if self._forcing():
            ids = self.tags.close_ids
            forced = np.zeros(vocab_size, dtype=bool)
            forced[ids[min(self._forced, len(ids) - 1)]] = True
            return forced
        opener = self.tags.open_id
        if self.state == _PENDING and opener is not None and (self.budget == 0 or grammar is not None):
            out = np.ones(vocab_size, dtype=bool) if grammar is None else grammar.copy()
            out[opener] = self.budget != 0  # no room to think: never open; else thinking or the grammar's answer
            return out
        return grammar

    def draft_room(self, unread: int, constrained: bool) -> int | None:
        if self.state not in (_PENDING, _REASONING):
            return None
        if constrained:  # where the grammar starts is known only once the closer is read
            return 0
        if self.budget is None:
            return None
        return max(0, self.budget - self.num_thinking - unread - 1)  # the verification samples one more than it drafts

    def feed(self, token_id: int, text: str) -> tuple[str, str]:
        if self.state == _ANSWER:  # the common case after the reasoning: nothing to look for
            self._answer_token = True
            return "", text
        before, forcing = self.state, self._forcing()
        r: list[str] = []
        a: list[str] = []
        tags = self.tags
        if token_id == tags.open_id and before == _PENDING:
            self._text(text.removesuffix(tags.open), r, a)
            if self.state == _PENDING:
                self._held, self.state = "", _REASONING
            else:  # the text before it was the answer's: the opener is text in the answer
                a.append(tags.open)
        elif token_id == tags.close_id and before == _REASONING:
            self._text(text.removesuffix(tags.close), r, a)
            self._close()
        else:
            self._text(text, r, a)
        ids = tags.close_ids
        if forcing and self.state == _REASONING and token_id == ids[min(self._forced, len(ids) - 1)]:
            self._forced += 1
            if self._forced >= len(ids):  # written whole, yet not read as the closer (tokenization)
                self._close()
        reasoning = before == _REASONING or self.state == _REASONING
        self._answer_token = not reasoning
        self.num_tokens += reasoning
        self.num_thinking += before == self.state == _REASONING and not forcing
        return "".join(r), "".join(a)

    def flush(self, text: str = "") -> tuple[str, str]:
        r: list[str] = []
        a: list[str] = []
        self._text(text, r, a)
        held, self._held = self._held, ""
        if self.state == _REASONING:
            held = held.rstrip() if self._began else held.strip()
            r.append(held)
        elif self.state != _LEAD:  # whitespace, or the start of an opener that never came: the answer's text
            a.append(held)
        return "".join(r), "".join(a)

    def _close(self) -> None:
        self._held, self.state = "", _LEAD  # what was held was the reasoning's trailing whitespace

    def _text(self, s: str, r: list[str], a: list[str]) -> None:
        held = self._held + s
        tags = self.tags
        while True:
            if self.state == _PENDING:
                body = held.lstrip()
                if tags.open_id is None and body.startswith(tags.open):
                    held, self.state = body[len(tags.open):], _REASONING
                    continue
                if not body or (tags.open_id is None and tags.open.startswith(body)):
                    break  # whitespace, or what may still be the opener
                self.state = _ANSWER
            elif self.state == _REASONING:
                keep = 0
                if tags.close_id is None:
                    i = held.find(tags.close)
                    if i >= 0:
                        self._give_reasoning(held[:i].rstrip(), r)
                        held, self.state = held[i + len(tags.close):], _LEAD
                        continue
                    keep = _partial(held, tags.close)
                head, tail = held[:len(held) - keep], held[len(held) - keep:]
                body = head.rstrip()
                self._give_reasoning(body, r)
                held = head[len(body):] + tail  # trailing whitespace, and what may begin the closer
                break
            elif self.state == _LEAD:
                held = held.lstrip()
                if not held:
                    break
                self.state = _ANSWER
            else:
                a.append(held)
                held = ""
                break
        self._held = held

    def _give_reasoning(self, text: str, r: list[str]) -> None:
        if not self._began:
            text = text.lstrip()
        if text:
            r.append(text)
            self._began = True


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
