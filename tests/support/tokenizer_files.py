"""tokenizer.json files for the tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

from tests.support.tiny_models import byte_level_vocab


def write_tokenizer(folder: Path, reverse: bool = False) -> Path:
    """A byte-level BPE tokenizer.json over the folder's 128 ids (no merges); `reverse` numbers them backwards."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = byte_level_vocab(128)
    vocab = {p: (127 - i if reverse else i) for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder
