"""Rebuild a `tokenizers.Tokenizer` from a GGUF file's metadata.

A GGUF has no tokenizer.json: it stores the vocabulary, merges, scores, token types and special ids under
llama.cpp's key names (`tokenizer.ggml.*`). We build the same pipeline transformers' GGUF converter builds
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`: GPT2Tokenizer / LlamaTokenizer backends) without
importing transformers, with three deliberate differences, each where transformers departs from llama.cpp and
from the model's original tokenizer.json:
  - `tokenizer.ggml.pre` "smollm" / "starcoder" / ... split digits one by one (llama.cpp's `\\p{N}` split; the
    original tokenizer.json has `Digits(individual_digits=True)`); transformers keeps plain GPT-2 splitting.
  - `tokenizer.ggml.add_space_prefix = false` is honoured for SentencePiece vocabularies (transformers always
    prepends "▁").
  - only the special tokens the file names are added; never a class default such as "<|endoftext|>" that the
    vocabulary may lack (transformers would append it as a new id past the model's vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from mlx_engine.api import ModelLoadError

SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp token types (`tokenizer.ggml.token_type`)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp (src/llama-vocab.cpp), applied one after the other like its `regex_exprs`
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    (
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)

# `tokenizer.ggml.pre` -> regexes applied in turn (then byte-level mapping without a regex of its own).
# The first block is transformers' table (GGUF_PRE_TOKENIZER_SPLITS); the rest follows llama.cpp.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), (_QWEN2_SPLIT,)),
    "qwen35": (_QWEN35_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O_SPLIT,)),
    "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
    "deepseek-v3": _DEEPSEEK3_SPLITS,
}
# Pre types whose original tokenizer.json is `Digits(individual_digits=True)` + GPT-2 byte-level splitting.
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """What the metadata says beyond the vocabulary itself."""

    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    eot_token_id: int | None  # end of turn (llama.cpp stops on it)
    eom_token_id: int | None  # end of message
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool
    chat_template: str | None

    def token(self, tokens: list[str], token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_from_gguf(metadata: dict[str, Any]) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """The tokenizer a GGUF's metadata describes, and its special ids. Raises ModelLoadError."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError("GGUF metadata has no tokenizer (no 'tokenizer.ggml.model' key)")
    if model not in SUPPORTED_MODELS:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError("GGUF metadata: 'tokenizer.ggml.tokens' is missing or not a list of strings")
    token_types = _int_list(metadata, "tokenizer.ggml.token_type", len(tokens))
    architecture = metadata.get("general.architecture")
    info = _info(metadata, model, len(tokens))

    if model == "gpt2":
        tok = _byte_level(tokens, metadata)
    else:
        if isinstance(architecture, str) and architecture.startswith("gemma"):
            raise ModelLoadError(
                f"GGUF tokenizer of architecture {architecture!r} (a Gemma SentencePiece vocabulary) "
                "is not supported yet"
            )
        tok = _sentencepiece(tokens, metadata, info, phi3=architecture == "phi3")

    _add_special_tokens(tok, tokens, token_types, info, byte_level=model == "gpt2")
    tok.post_processor = template_processing(
        info.token(tokens, info.bos_token_id) if info.add_bos_token else None, info.bos_token_id,
        info.token(tokens, info.eos_token_id) if info.add_eos_token else None, info.eos_token_id,
    )
    return tok, info


def template_processing(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None):
    """transformers' `update_post_processor`: `[bos] $A [eos]` for the flags that are on."""
    bos = bos if bos is not None and bos_id is not None else None
    eos = eos if eos is not None and eos_id is not None else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = ([(bos, bos_id)] if bos else []) + ([(eos, eos_id)] if eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _info(metadata: dict[str, Any], model: str, n_tokens: int) -> GGUFTokenizerInfo:
    def token_id(key: str) -> int | None:
        v = metadata.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_tokens:
            raise ModelLoadError(f"GGUF metadata: tokenizer.ggml.{key}={v!r} is not a token id in [0, {n_tokens})")
        return v

    def flag(key: str, default: bool) -> bool:
        v = metadata.get(f"tokenizer.ggml.{key}")
        return default if v is None else bool(v)

    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizerInfo(
        model=model,
        pre=metadata.get("tokenizer.ggml.pre"),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        unk_token_id=token_id("unknown_token_id"),
        pad_token_id=token_id("padding_token_id"),
        eot_token_id=token_id("eot_token_id"),
        eom_token_id=token_id("eom_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (so does transformers)
        add_bos_token=flag("add_bos_token", model == "llama"),
        add_eos_token=flag("add_eos_token", False),
        add_space_prefix=flag("add_space_prefix", True),
        chat_template=template if isinstance(template, str) and template else None,
    )


def _int_list(metadata: dict[str, Any], key: str, n: int) -> list[int] | None:
    v = metadata.get(key)
    if v is None:
        return None
    values = [int(x) for x in v]
    if len(values) != n:
        raise ModelLoadError(f"GGUF metadata: {key} has {len(values)} entries for {n} tokens")
    return values


def _byte_level(tokens: list[str], metadata: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): tokens + merges, pre-tokenizer chosen by tokenizer.ggml.pre."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (e.g. one stored with real spaces) is respelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError("GGUF metadata: a 'gpt2' tokenizer needs 'tokenizer.ggml.merges', which is missing")
    pairs = [_merge_pair(m) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False))
    pre = metadata.get("tokenizer.ggml.pre")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:  # "gpt2", "default" and any we do not know: GPT-2's own splitting, as transformers does
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pair(m: str) -> tuple[str, str]:
    parts = m.split(" ")
    if len(parts) != 2:
        raise ModelLoadError(f"GGUF metadata: tokenizer.ggml.merges entry {m!r} is not two tokens separated by a space")
    return parts[0], parts[1]


def _sentencepiece(tokens: list[str], metadata: dict[str, Any], info: GGUFTokenizerInfo, phi3: bool) -> Tokenizer:
    """SentencePiece BPE with byte fallback (`<0x41>` tokens), as transformers' LlamaTokenizer builds it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError("GGUF metadata: a 'llama' tokenizer needs 'tokenizer.ggml.scores' or merges")
        scores = [float(s) for s in scores]
        if len(scores) != len(tokens):
            raise ModelLoadError(
                f"GGUF metadata: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
            )
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk = info.token(tokens, info.unk_token_id)
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=True, byte_fallback=True, unk_token=unk))
    prefix = info.add_space_prefix
    if phi3:  # the prefix space comes from a normalizer, and "  hi" keeps both spaces as "▁▁"
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
    chain = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix or phi3:
        chain.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(chain)
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score first
    (transformers' `generate_merges` with scores)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _add_special_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int] | None, info: GGUFTokenizerInfo,
                        byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept whole in text)."""
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    types = token_types or []
    # A control token outside the byte alphabet in a byte-level vocabulary is a llama.cpp mislabel (transformers
    # skips it too: adding it would grow the vocabulary past the model's).
    special = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and (alphabet is None or set(t) <= alphabet)]
    named_ids = (info.bos_token_id, info.eos_token_id, info.unk_token_id, info.pad_token_id)
    named = [info.token(tokens, i) for i in named_ids]
    seen = set(special)
    special += [t for t in named if t is not None and t not in seen and (seen.add(t) or True)]
    if special:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, ty in zip(tokens, types)
            if ty == TOKEN_USER_DEFINED and t not in seen and (alphabet is None or set(t) <= alphabet)]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
