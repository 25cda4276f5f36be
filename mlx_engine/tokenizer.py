"""The tokenizer: text <-> token ids, chat templates, special ids, and a streaming detokenizer.

One class for both sources: a Hugging Face model folder (tokenizer.json + configs) and GGUF metadata (rebuilt by
`loading/gguf_tokenizer.py`). Behaviour follows transformers': `encode` adds BOS only where the model does, and
`encode_chat` encodes the rendered template with `add_special_tokens=False` (templates write their own BOS).

Text inside a conversation is text: where a user's or a tool's string spells a special token (`<|im_end|>`), those
characters are tokenized as plain text, so a message cannot close its turn or open a system turn. Only the special
tokens the template itself writes are special (transformers reads them anywhere in the rendered text).
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from mlx_engine.api import ModelLoadError, RequestError
from mlx_engine.chat_template import FALLBACK_TEMPLATE, render_chat_template, render_with_literals
from mlx_engine.loading.gguf_tokenizer import bytes_to_unicode, template_processing, tokenizer_from_gguf

_REPLACEMENT = "\ufffd"
# Put before a look-alike's text when it is tokenized as plain text, so it is not the start of the input (where a
# SentencePiece pre-tokenizer would prepend a "▁"): a non-special added token, which splits the input there.
_SEPARATOR = "\U0010fffd"


class Tokenizer:
    """A `tokenizers.Tokenizer` plus its chat template and special token ids."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
        special_tokens: dict[str, str] | None = None,
        add_bos_token: bool = False,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, unk_token, pad_token -> text
        self.add_bos_token = add_bos_token
        self._kind = _decoder_kind(backend)
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        texts = sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._plain: tuple[HFTokenizer, int] | None = None  # the backend reading special tokens' strings as text
        self._plain_lock = threading.Lock()

    # ---- construction ---------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model folder (tokenizer.json required). Raises ModelLoadError."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{tj}: missing (a model folder needs tokenizer.json for its tokenizer)")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelLoadError(f"{tj}: not a valid tokenizers file ({detail})") from None

        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_text(name: str) -> str | None:
            v = config.get(name, special_map.get(name))
            if isinstance(v, dict):
                v = v.get("content")
            return v if isinstance(v, str) else None

        # added tokens the config declares that tokenizer.json lacks (transformers adds them too)
        declared = config.get("added_tokens_decoder")
        if isinstance(declared, dict):
            have = {t.content for t in backend.get_added_tokens_decoder().values()}
            missing = [d for d in declared.values() if isinstance(d, dict) and d.get("content") not in have]
            for d in missing:
                tok = AddedToken(d["content"], single_word=d.get("single_word", False), lstrip=d.get("lstrip", False),
                                 rstrip=d.get("rstrip", False), normalized=d.get("normalized", not d.get("special")),
                                 special=d.get("special", False))
                (backend.add_special_tokens if tok.special else backend.add_tokens)([tok])

        special = {n: t for n in ("bos_token", "eos_token", "unk_token", "pad_token") if (t := token_text(n))}
        for text in special.values():
            if backend.token_to_id(text) is None:
                backend.add_special_tokens([AddedToken(text, normalized=False, special=True)])
        bos_id = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None

        # transformers rebuilds the post-processor when the config states add_bos_token / add_eos_token
        add_bos = bool(config.get("add_bos_token", False))
        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = template_processing(
                special.get("bos_token") if add_bos else None, bos_id,
                special.get("eos_token") if config.get("add_eos_token") else None, eos_id,
            )
        elif bos_id is not None:
            add_bos = backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]

        eos_ids = [eos_id] if eos_id is not None else []
        for source in (generation, model_config):
            eos_ids += _id_list(source.get("eos_token_id"))

        return cls(
            backend,
            chat_template=_folder_chat_template(path, config),
            bos_token_id=bos_id,
            eos_token_ids=tuple(eos_ids),
            special_tokens=special,
            add_bos_token=add_bos,
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """From GGUF metadata (key -> plain value; numeric arrays as numpy). Raises ModelLoadError."""
        backend, info = tokenizer_from_gguf(metadata)
        tokens = metadata["tokenizer.ggml.tokens"]
        special = {
            name: t
            for name, i in (("bos_token", info.bos_token_id), ("eos_token", info.eos_token_id),
                            ("unk_token", info.unk_token_id), ("pad_token", info.pad_token_id))
            if (t := info.token(tokens, i)) is not None
        }
        # llama.cpp stops on end-of-turn / end-of-message ids too
        eos = tuple(i for i in (info.eos_token_id, info.eot_token_id, info.eom_token_id) if i is not None)
        return cls(
            backend,
            chat_template=info.chat_template,
            bos_token_id=info.bos_token_id,
            eos_token_ids=eos,
            special_tokens=special,
            add_bos_token=info.add_bos_token and info.bos_token_id is not None,
        )

    # ---- text <-> ids -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model adds them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_piece(self, token_id: int) -> str:
        """A token's text for display: byte-level pieces as readable text ("Ġthe" -> " the"), SentencePiece "▁"
        as a space; bytes that are not whole UTF-8 characters as `<0xE4>`."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise RequestError(f"token id {token_id} is out of range (vocabulary size {self.vocab_size})")
        if token_id in self._special_ids or self.backend.get_added_tokens_decoder().get(token_id) is not None:
            return piece
        if self._kind == "byte_level":
            decoder = _byte_decoder()
            if all(c in decoder for c in piece):
                return _bytes_to_display(bytes(decoder[c] for c in piece))
        elif self._kind == "sentencepiece":
            return piece.replace("▁", " ")
        return piece

    # ---- chat --------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The conversation rendered by the model's chat template (or the `role: content` fallback).
        Extra kwargs (tools, documents, enable_thinking, ...) reach the template. Raises RequestError."""
        return render_chat_template(
            self.chat_template if self.chat_template is not None else FALLBACK_TEMPLATE,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation. A model's template writes its own BOS, so nothing is added
        (transformers' `apply_chat_template(tokenize=True)`); the fallback format gets the model's BOS.

        A special token's string inside the conversation's text (contents, tool calls, `tools`, `documents`) is
        tokenized as plain text; elsewhere the ids are transformers'."""
        text, spans = render_with_literals(
            self.chat_template if self.chat_template is not None else FALLBACK_TEMPLATE,
            messages,
            self._special_pattern,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        add_special_tokens = not self.has_chat_template
        if not spans:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return self._encode_literal_spans(text, spans, add_special_tokens)

    def _encode_literal_spans(self, text: str, spans: list[tuple[int, int]], add_special_tokens: bool) -> list[int]:
        """`encode(text)`, but a special token matched where it begins inside one of `spans` (text from the
        conversation) is replaced by the plain-text tokens of what it matched."""
        enc = self.backend.encode(text, add_special_tokens=False)
        starts = [s for s, _ in spans]  # in order, not overlapping
        ids: list[int] = []
        for token_id, (start, end) in zip(enc.ids, enc.offsets):
            i = bisect.bisect_right(starts, start) - 1
            if token_id in self._special_ids and i >= 0 and start < spans[i][1]:
                ids += self._plain_ids(text[start:end])
            else:
                ids.append(token_id)
        if add_special_tokens:  # the post-processor's BOS/EOS around the whole, as `encode` adds them
            with_special = self.backend.encode(text, add_special_tokens=True).ids
            core = enc.ids
            for k in range(len(with_special) - len(core) + 1):
                if with_special[k:k + len(core)] == core:
                    return with_special[:k] + ids + with_special[k + len(core):]
        return ids

    def _plain_ids(self, text: str) -> list[int]:
        """`text` tokenized with special tokens' strings read as plain text, as it would be inside other text."""
        with self._plain_lock:
            if self._plain is None:
                plain = HFTokenizer.from_str(self.backend.to_str())
                plain.encode_special_tokens = True
                plain.add_tokens([AddedToken(_SEPARATOR, normalized=False, special=False)])
                self._plain = plain, plain.token_to_id(_SEPARATOR)
            plain, separator = self._plain
        ids = plain.encode(_SEPARATOR + text, add_special_tokens=False).ids
        assert ids[0] == separator and separator not in ids[1:], "a special token's text holds the separator"
        return ids[1:]

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)


class StreamingDetokenizer:
    """Token ids in, text out, one token at a time.

    Invariant: the concatenated outputs of `add_token` for ids[:k] plus `finalize()` equal `decode(ids[:k])`
    whenever that decode ends on a whole character, and an output never holds a U+FFFD the full decode lacks.

    It decodes a small window `ids[start:]` that begins at the last point where everything before was emitted and
    the text ended on a whole character, keeping one token of context before it, so leading-space rules
    (SentencePiece's "▁", Strip decoders) apply to the window as they apply to the whole. Text ending in U+FFFD is
    an incomplete UTF-8 sequence (byte-fallback `<0xE4>` or a byte-level piece of a character): held back until
    the character completes. Amortized O(1) per token: the window resets at every whole character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._decode = lambda ids: tokenizer.backend.decode(ids, skip_special_tokens=False)
        # Skipped tokens never enter the window: decode drops them before its decoder chain anyway, and a window
        # whose context token is skipped would lose the context's leading-space handling.
        self._skip = tokenizer._special_ids if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []  # the ids in the window's coordinates (skipped ones left out)
        self._start = 0  # window start: ids[_start:] are decoded
        self._read = 0  # ids[_start:_read] are context, already emitted
        self._emitted = ""  # text of the window already emitted

    def add_token(self, token_id: int) -> str:
        """The new text after `token_id` (may be empty while a character is incomplete)."""
        if token_id in self._skip:
            return ""
        self.token_ids.append(token_id)
        text = self._decode(self.token_ids[self._start :])
        if text.endswith(_REPLACEMENT):
            # emit what is stable before the incomplete character, if it extends what was emitted
            stable = text.rstrip(_REPLACEMENT)
            if len(stable) > len(self._emitted) and stable.startswith(self._emitted):
                out = stable[len(self._emitted) :]
                self._emitted = stable
                return out
            return ""
        out = text[len(self._emitted) :]
        # new window: the tokens since the last clean point become context for the next ones
        self._start, self._read = self._read, len(self.token_ids)
        self._emitted = self._decode(self.token_ids[self._start : self._read])
        return out

    def finalize(self) -> str:
        """Flush held-back text (an incomplete character comes out as U+FFFD, as `decode` gives it)."""
        text = self._decode(self.token_ids[self._start :])
        out = text[len(self._emitted) :] if len(text) > len(self._emitted) else ""
        self._start = self._read = len(self.token_ids)
        self._emitted = ""
        return out

    @property
    def text(self) -> str:
        """Everything decoded so far (O(n); for tests and debugging)."""
        return self._decode(self.token_ids)


# ---- helpers -----------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _folder_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """transformers 5 order: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = _read_json(path / "chat_template.json")
    template = json_file.get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def _decoder_kind(backend: HFTokenizer) -> str:
    decoder = backend.decoder
    if decoder is None:
        return "other"
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001
        return "other"
    types = [d.get("type") for d in spec.get("decoders", [])] if spec.get("type") == "Sequence" else [spec.get("type")]
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types or "Metaspace" in types or any(
        d.get("type") == "Replace" and d.get("content") == " " for d in spec.get("decoders", [])
    ):
        return "sentencepiece"
    return "other"


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        _BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
    return _BYTE_DECODER


def _bytes_to_display(data: bytes) -> str:
    out, i = [], 0
    while i < len(data):
        for n in (1, 2, 3, 4):  # the whole character starting here, if there is one
            try:
                out.append(data[i : i + n].decode("utf-8"))
                i += n
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"<0x{data[i]:02X}>")
            i += 1
    return "".join(out)
