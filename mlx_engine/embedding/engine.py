"""`EmbeddingEngine`: an embedding model behind the engine thread. Inputs are checked and tokenized on the caller's
thread; the packed forward runs on the engine thread between other engines' steps."""

from __future__ import annotations

from typing import Any

from mlx_engine.api import Embeddings, GenerationRequest, ModelInfo, RequestError, RooflineError
from mlx_engine.embedding.layout import EmbeddingLayout
from mlx_engine.engine_thread import EngineThread, engine_thread

# Engine.load's options an embedding model takes; the rest (KV, drafts, templates, torch's) have nothing to act on
OPTIONS = ("backend", "device", "dtype", "max_context", "max_seqs")


class EmbeddingEngine:
    """A loaded embedding model (`mlx_engine.api.EmbedderLike`). `Engine.load` returns one for a sentence-transformers
    folder or a GGUF file with a pooling type."""

    info: ModelInfo

    def __init__(self, thread: EngineThread, model: Any, tokenizer: Any, info: ModelInfo, layout: EmbeddingLayout,
                 dimension: int):
        self._thread = thread
        self._model = model
        self.tokenizer = tokenizer
        self.info = info
        self.layout = layout
        self.dimension = dimension  # the pooled vector's length (the decoder's hidden size)

    @classmethod
    def load(cls, model: str | None, layout: EmbeddingLayout, **options: Any) -> EmbeddingEngine:
        from mlx_engine.embedding.model import load_decoder

        unused = sorted(k for k, v in options.items() if k not in OPTIONS and v is not None)
        if unused:
            raise RooflineError(f"{model}: an embedding model takes no {', '.join(unused)} (it keeps no KV cache and "
                                f"generates nothing); its options: {', '.join(OPTIONS)}")
        backend, device = options.get("backend") or "auto", options.get("device") or "auto"
        if backend not in ("auto", "mlx") or device not in ("auto", "cpu"):
            raise RooflineError(f"{model}: embeddings run on the MLX backend (backend='auto' or 'mlx', device='auto' or "
                                f"'cpu'), not backend={backend!r} device={device!r}")
        thread = engine_thread()
        decoder = thread.call(lambda: load_decoder(model, options.get("dtype"), options.get("max_context")))
        ckpt = decoder.checkpoint
        context = decoder.context_length
        if layout.max_seq_length:
            context = min(context, int(layout.max_seq_length))
        import mlx.core as mx

        hidden = int(ckpt.config["hidden_size"])
        norm = ", L2-normalized" if layout.normalize else ""
        info = ModelInfo(name=ckpt.name, path=str(ckpt.path), model_type=str(ckpt.config.get("model_type")),
                         source_format=ckpt.source_format, num_parameters=decoder.num_parameters,
                         quantization=ckpt.quant_label, context_length=context, weight_bytes=decoder.weight_bytes,
                         vocab_size=int(ckpt.config["vocab_size"]), native=True, dtype=decoder.dtype,
                         eos_token_ids=tuple(ckpt.tokenizer.eos_token_ids),
                         notes=(f"embeddings: {layout.pooling} pooling{norm}, {hidden} dimensions, packed forwards "
                                f"(pooling from {layout.source})",) + ((decoder.note,) if decoder.note else ()),
                         backend="mlx", device="metal" if mx.metal.is_available() else "cpu", embeddings=True)
        return cls(thread, decoder.model, ckpt.tokenizer, info, layout, hidden)

    # ---- embeddings ---------------------------------------------------------------------------------------

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
              prompt_name: str | None = None) -> Embeddings:
        """One vector per input (a string, strings, one input's token ids, or lists of token ids), float32: pooled
        as the checkpoint says, normalized where it normalizes, truncated to `dimensions` (Matryoshka) and then
        renormalized. `prompt_name` picks an instruction prefix from the checkpoint's `prompts` for text inputs
        (default: its `default_prompt_name`). Bad input raises RequestError naming the input."""
        from mlx_engine.embedding.packed import embed_packed, finish

        ids, skip = self.token_ids(inputs, prompt_name)
        if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                       or not 1 <= dimensions <= self.dimension):
            raise RequestError(f"dimensions={dimensions!r}: expected an integer from 1 to {self.dimension} (the "
                               "model's embedding size)")
        model, pooling = self._model, self.layout.pooling
        if model is None:
            raise RooflineError("this engine is closed")
        vectors = self._thread.call(lambda: embed_packed(model, ids, pooling, skip))
        return Embeddings(finish(vectors, self.layout.normalize, dimensions), tuple(len(i) for i in ids))

    def token_ids(self, inputs: Any, prompt_name: str | None = None) -> tuple[list[list[int]], list[int]]:
        """The token ids each input runs (instruction prefix and special tokens included), checked against the
        vocabulary and the context, and each one's leading prompt tokens that mean pooling leaves out."""
        items = _items(inputs)
        texts = isinstance(items[0], str)
        prompt = self._prompt(prompt_name, texts)
        skip = 0
        if prompt and not self.layout.include_prompt:  # sentence-transformers: the prompt's tokens less its last
            skip = len(self.tokenizer.encode(prompt)) - 1
        out = []
        for i, item in enumerate(items):
            if texts:
                if not item:
                    raise RequestError(f"input[{i}] is an empty string: expected text to embed")
                ids = self.tokenizer.encode(prompt + item)
            else:
                ids = item
                bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
                if bad:
                    raise RequestError(f"input[{i}]: token id {bad[0]} is outside the vocabulary "
                                       f"(0..{self.info.vocab_size - 1})")
            if len(ids) > self.info.context_length:
                raise RequestError(f"input[{i}] is {len(ids)} tokens but the model's context is "
                                   f"{self.info.context_length} tokens")
            out.append(list(ids))
        return out, [skip] * len(out)

    def _prompt(self, name: str | None, texts: bool) -> str:
        prompts = self.layout.prompts
        if name is None:
            name = self.layout.default_prompt_name
            if name is None or not texts:
                return ""
        elif not texts:
            raise RequestError(f"prompt_name={name!r} applies to text inputs: token ids are embedded as given")
        if name not in prompts:
            known = ", ".join(repr(k) for k in prompts) or "none"
            raise RequestError(f"prompt_name={name!r} is not one of this model's prompts ({known}; from "
                               "config_sentence_transformers.json)")
        return prompts[name]

    # ---- the rest of EngineLike: an embedding model generates nothing and keeps no KV -------------------------

    def generate(self, request: GenerationRequest) -> Any:
        raise RequestError(f"{self.info.name} is an embedding model: it answers embeddings (POST /v1/embeddings, "
                           "roofline embed), not chat or completions; load a chat model for those")

    def kv_stats(self) -> dict[str, Any]:
        return {"kind": "none", "hit_rate": 0.0}

    def save_kv(self, path: str, request: GenerationRequest | list[int]) -> int:
        raise RooflineError(f"{self.info.name} is an embedding model: it keeps no KV cache to save")

    def restore_kv(self, path: str) -> int:
        raise RooflineError(f"{self.info.name} is an embedding model: it keeps no KV cache to restore")

    def decode_bytes_per_token(self, context_tokens: int) -> int:
        return self.info.weight_bytes  # a forward reads the weights once, whatever it packs

    def close(self) -> None:
        self._model = None

    def __enter__(self) -> EmbeddingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _items(inputs: Any) -> list[Any]:
    """inputs as a list of strings or a list of token-id lists (one input's ids, or one string, wrapped)."""
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise RequestError("input is empty: expected a string, a list of strings, or token ids (a list of integers "
                           "or of lists of integers)")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
        return [list(inputs)]
    if all(isinstance(t, str) for t in inputs):
        return list(inputs)
    for i, item in enumerate(inputs):
        if not isinstance(item, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in item):
            raise RequestError(f"input[{i}] is a {type(item).__name__}: expected every input a string, or every one "
                               "a list of token ids (integers)")
        if not item:
            raise RequestError(f"input[{i}] is an empty list of token ids")
    return [list(item) for item in inputs]
