"""The tokenizer of the TUI's fake engine (tests/support/tui_fake_engine.py): words and single characters as tokens."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

from mlx_engine.api import RequestError

_PIECE = re.compile(r" ?[A-Za-z0-9]+| ?[^\sA-Za-z0-9]|\s+")


class FakeTokenizer:
    """Words (with their leading space) and single other characters as tokens; ids handed out on first sight.
    `non_ascii_split` > 1 splits non-ASCII characters into their UTF-8 bytes, as a byte-level BPE does
    for a script it has few merges for."""

    def __init__(self, name: str = "fake", non_ascii_split: int = 1):
        self.name = name
        self.non_ascii_split = non_ascii_split
        self._ids: dict[str, int] = {"<s>": 0, "</s>": 1}
        self._pieces: list[str] = ["<s>", "</s>"]
        self._lock = threading.Lock()

    def _id(self, piece: str) -> int:
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return self._ids[piece]

    def pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for p in _PIECE.findall(text):
            if self.non_ascii_split > 1 and not p.isascii():
                for ch in p:  # like a byte-level BPE without merges for this script: one piece per UTF-8 byte
                    out.extend([ch] if ch.isascii() else [f"<0x{b:02X}>" for b in ch.encode()])
            else:
                out.append(p)
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id(p) for p in self.pieces(text)]
        return ([0] if add_special_tokens else []) + ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._pieces[i] for i in ids if not (skip_special_tokens and i < 2))

    def id_to_piece(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._pieces):
            raise RequestError(f"token id {token_id} is out of range (vocabulary size {len(self._pieces)})")
        return self._pieces[token_id]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return [0] + self.encode(text, add_special_tokens=False)


class NoFakeTokenizer(FakeTokenizer):
    """A model without tokenizer files: text is refused as the engine refuses it."""

    def _refuse(self, *args, **kwargs) -> list[int]:
        raise RequestError(f"{self.name} has no tokenizer (tokenizer.json): send prompt_token_ids instead of text")

    encode = encode_chat = _refuse
