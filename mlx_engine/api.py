"""The engine's public, MLX-free types.

Front ends (TUI, server, benchmarks) build a `GenerationRequest`, pass it to `Engine.generate`, and
iterate `GenerationEvent`s. Nothing here imports MLX, so front ends and their tests can run against a
scripted fake engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "cancelled", "error"]
SPECULATIVE_MODES = ("draft", "prompt-lookup", "self", "auto")
MAX_DRAFT_TOKENS = 16
# speculative="draft" on an engine loaded without a draft model (every front end shows it as is)
NO_DRAFT_MODEL = ("speculative='draft' needs a draft model: load one beside the model (Engine.load(model, "
                  "draft_model=PATH); roofline chat, generate and serve: --draft-model PATH), or use 'prompt-lookup' "
                  "or 'self'")
MAX_LOGPROBS = 20  # top alternatives per token, at most (OpenAI's limit)
RESPONSE_FORMATS = ("json_object", "json_schema", "regex", "lark")
DEFAULT_MAX_SEQS = 16  # sequences the scheduler runs at once unless Engine.load(max_seqs=...) says otherwise
# OpenAI's reasoning_effort values; each reasoning family maps them onto its own switch (harmony's "Reasoning:" line,
# a template's enable_thinking). "none" (and "minimal" where a family has no lower level) turns thinking off.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


class RooflineError(Exception):
    """A user-facing error: its message is complete and is shown as is, without a traceback."""


class ModelLoadError(RooflineError):
    """A model path, file or configuration that cannot be loaded."""


class RequestError(RooflineError):
    """A request that cannot be served as given (bad sampling values, prompt too long, ...)."""


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: the reply is held, token by token, to a grammar (`mlx_engine.structured`).

    - `ResponseFormat("json_object")`: one JSON object (OpenAI's JSON mode).
    - `ResponseFormat("json_schema", schema={...})`: JSON valid against a JSON Schema (a dict).
    - `ResponseFormat("regex", pattern=r"...")`: text that the regular expression matches whole.
    - `ResponseFormat("lark", grammar="start: ...")`: text in a Lark grammar (llguidance's dialect).

    The reply ends ("stop") as soon as the grammar is complete; a schema the engine cannot compile is a
    RequestError from `Engine.generate`."""

    type: str
    schema: dict[str, Any] | None = None
    pattern: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.type not in RESPONSE_FORMATS:
            raise RequestError(f"invalid response format type {self.type!r}: expected one of "
                               f"{', '.join(map(repr, RESPONSE_FORMATS))}")
        needs = {"json_schema": "schema", "regex": "pattern", "lark": "grammar"}.get(self.type)
        given = [name for name in ("schema", "pattern", "grammar") if getattr(self, name) is not None]
        if given != ([needs] if needs else []):
            want = f"'{needs}' and nothing else" if needs else "no schema, pattern or grammar"
            raise RequestError(f"response format {self.type!r} takes {want} (got {', '.join(given) or 'none'})")
        if needs == "schema" and not isinstance(self.schema, dict):
            raise RequestError(f"response format 'json_schema' needs a JSON Schema object (a dict), got "
                               f"{type(self.schema).__name__}")
        if needs in ("pattern", "grammar") and not isinstance(getattr(self, needs), str):
            raise RequestError(f"response format {self.type!r} needs '{needs}' as a string")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature=0` is greedy decoding."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off (CTRL-style, divides positive logits)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 512  # 0 with prompt_logprobs: score the prompt and generate nothing
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return per token; None: none
    # each prompt token's log-probability (all but the first) with this many top alternatives, on the first
    # event; None: none. The prompt is then computed whole (no prefix-cache hits), in the batch's chunks.
    prompt_logprobs: int | None = None
    # speculative decoding: "draft" (the engine's draft model), "prompt-lookup", "self" (the target's early
    # layers), "auto" (speculate only where the backend's cost curve and the acceptance say it pays: by prompt
    # lookup, and with a draft model loaded by it too, each step the one predicted to gain most), None: off
    speculative: str | None = None
    num_draft_tokens: int = 4  # most draft tokens per verification (adapted per step within 1..this)
    # structured output: the reply held to JSON, a JSON Schema, a regex or a Lark grammar; None: free text. On a
    # reasoning model it holds the answer, not the reasoning before it
    response_format: ResponseFormat | None = None
    # a reasoning model's thinking, at most this many tokens: the engine then closes the reasoning (writes the
    # family's closer) and the answer starts; None: no limit. A model without reasoning refuses it (RequestError)
    reasoning_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    def validate(self) -> None:
        def bad(name: str, expected: str) -> RequestError:
            return RequestError(f"invalid sampling parameter {name}={getattr(self, name)!r}: expected {expected}")

        def finite(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not finite("temperature") or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not finite("top_p") or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 means off)")
        if not finite("min_p") or not 0 <= self.min_p < 1:
            raise bad("min_p", "a number in [0, 1)")
        if not finite("repetition_penalty") or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 means off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not finite(name) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad("max_tokens", "an integer >= 1")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad("max_tokens", "an integer >= 1 (0 only with prompt_logprobs: the prompt scored, nothing generated)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise bad("speculative", f"one of {', '.join(map(repr, SPECULATIVE_MODES))} or None")
        if (not isinstance(self.num_draft_tokens, int) or isinstance(self.num_draft_tokens, bool)
                or not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS):
            raise bad("num_draft_tokens", f"an integer in [1, {MAX_DRAFT_TOKENS}]")
        if self.response_format is not None and not isinstance(self.response_format, ResponseFormat):
            raise bad("response_format", "a ResponseFormat or None")
        b = self.reasoning_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise bad("reasoning_budget", "an integer >= 0 (0: no thinking) or None")
        for k, v in self.logit_bias.items():
            if not isinstance(k, int) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RequestError(f"invalid sampling parameter logit_bias: expected {{token_id: number}}, got {k!r}: {v!r}")


@dataclass
class GenerationRequest:
    """One generation: chat `messages` (rendered with the model's chat template) or raw `prompt_token_ids`."""

    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None  # raw text, tokenized as is (with BOS when the model adds one)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    add_generation_prompt: bool = True
    # extra variables for the chat template (vLLM's and mlx-lm's field: {"enable_thinking": False}, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning_effort (REASONING_EFFORTS), mapped by the model's reasoning family; None: the template's own
    reasoning_effort: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.messages, self.prompt_token_ids, self.prompt)]
        if sum(given) != 1:
            raise RequestError("a request needs exactly one of messages, prompt_token_ids or prompt")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
            for i, m in enumerate(self.messages):
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise RequestError(f"messages[{i}] must have 'role' and 'content', got {m!r}")
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise RequestError("prompt_token_ids must be a non-empty list of non-negative integers")
        if self.chat_template_kwargs is not None and not (
                isinstance(self.chat_template_kwargs, dict) and all(isinstance(k, str) for k in self.chat_template_kwargs)):
            raise RequestError("chat_template_kwargs must be an object of template variables ({\"enable_thinking\": "
                               "false}, ...)")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise RequestError(f"invalid reasoning_effort {self.reasoning_effort!r}: expected one of "
                               f"{', '.join(map(repr, REASONING_EFFORTS))}")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning (GenerationEvent.reasoning)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ToolCall:
    """A function call the model wrote in its own format (harmony's `commentary to=functions.NAME`): `arguments` is
    the JSON text as written."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Stats:
    ttft_s: float  # submit to first token
    prefill_tps: float  # prompt tokens actually computed / prefill seconds
    decode_tps: float  # generated tokens after the first / decode seconds
    peak_memory_bytes: int
    # speculative decoding; None where no draft token was verified (plain decoding, or "auto" stepped aside)
    acceptance_rate: float | None = None  # accepted draft tokens / drafted tokens verified
    mean_accepted_tokens: float | None = None  # accepted draft tokens per verification
    target_forwards: int = 0  # target forward passes that sampled tokens (last prefill chunk, decode, verify)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationEvent:
    """A step of a generation: new `text` (may be empty while a UTF-8 character or a possible stop
    string is held back) and the new `token_ids`. The last event has `finish_reason`, `usage`, `stats`.

    On a reasoning model the reply is split on token ids as it streams: `reasoning` holds new text of the model's
    thinking, `text` only the answer (the tags or channel markup around them in neither)."""

    text: str = ""
    reasoning: str = ""
    token_ids: tuple[int, ...] = ()
    from_draft: tuple[bool, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    # SamplingParams.prompt_logprobs: every prompt token but the first, on the request's first event
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stats: Stats | None = None
    error: str | None = None
    # the final event of a reply that a stop string ended (finish_reason "stop"): which of SamplingParams.stop it was
    # (the text holds none of it); None where the reply ended otherwise (EOS, a grammar's end)
    stop_string: str | None = None
    # the final event of a reply that called functions in its model's own format (harmony); () otherwise
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    """What a front end shows about the loaded model."""

    name: str
    path: str
    model_type: str
    source_format: Literal["safetensors", "mlx-quantized", "gguf", "hf-cache"]
    num_parameters: int
    quantization: str  # e.g. "Q4_1", "4-bit g64", "bf16"
    context_length: int
    weight_bytes: int
    vocab_size: int
    native: bool  # False: mlx-lm's model class (later features may be unavailable)
    dtype: str  # activation dtype in use
    eos_token_ids: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # how the engine runs this model here (informational)
    warnings: tuple[str, ...] = ()  # what a user should know before relying on it: front ends show these
    backend: str = "mlx"  # the model runner: "mlx" or "torch"
    device: str = "cpu"  # where it runs: "metal", "cpu" or "cuda"
    draft_model: str | None = None  # the name of the draft model loaded beside it (Engine.load's draft_model)
    kv_files: bool = False  # whether save_kv / restore_kv work here (the cache declares it: KVCapabilities.kv_files)
    # False: no tokenizer files were found beside the weights, so the model takes and gives token ids only (no
    # text, no chat template): front ends say so at load, in their users' words
    has_tokenizer: bool = True
    # the reasoning family the chat template and tokenizer show ("think": <think>...</think>, "harmony": gpt-oss's
    # channels), or None: a model without reasoning, whose events never carry `reasoning`
    reasoning: str | None = None
    # an embedding model (a sentence-transformers folder, a GGUF with a pooling type): it answers `embed`, not
    # `generate`; front ends refuse embeddings of a chat model and chat with an embedding model by this flag
    embeddings: bool = False

    @property
    def runs_on(self) -> str:
        """Where it runs, as front ends show it: "MLX on Metal", "torch on CPU", "torch on CUDA", "MLX on CPU"."""
        backend = {"mlx": "MLX"}.get(self.backend, self.backend)
        return f"{backend} on {ModelInfo._DEVICES.get(self.device, self.device)}"

    _DEVICES: ClassVar[dict[str, str]] = {"cpu": "CPU", "cuda": "CUDA", "metal": "Metal"}


# --- loading ----------------------------------------------------------------------------------------------

LOAD_OPTIONS = {
    "backend": "the model runner: 'auto' (default: the faster one here for the model: Metal on a Mac; the torch "
    "backend on CUDA, or on an x86-64 Linux CPU for a quantized model it runs, where torch is installed; else MLX's "
    "CPU backend, with a warning saying how to get the faster one), 'mlx' (Metal or MLX's CPU backend) or 'torch' "
    "(CUDA or CPU; the optional extra `torch`)",
    "device": "'auto' (default), 'cpu' or 'cuda' (cuda: the torch backend; with backend='auto' it picks torch)",
    "dtype": "activation dtype: 'float32', 'float16' or 'bfloat16' (default: float32 on MLX's CPU backend, "
    "the checkpoint's on Metal)",
    "prefill_chunk_size": "tokens per prefill step (default 512; for backend='torch' 4096 on CUDA, 256 on the CPU)",
    "max_context": "cap the context length below the model's own",
    "block_size": "tokens per KV block: 16 (default) or 32",
    "kv_bits": "quantize the KV cache: 8 or 4 bits (default: None, the activation dtype)",
    "kv_key_bits": "the keys' bits when they differ from kv_bits: 8 or 4 (default: kv_bits; needs kv_bits)",
    "kv_group_size": "group size of quantized KV: 64 (default) or 32",
    "kv_key_per_channel": "quantize the keys per channel over each block's tokens (KIVI) rather than per token "
    "(default: for 4-bit keys, where it takes SmolLM2's perplexity cost from 6-11% to under 3%, under 2% with "
    "block_size=32; True needs kv_bits and a block size dividing the head dim)",
    "kv_budget_bytes": "bytes for the KV block pool (default: one full context plus 25%, within half the "
    "free memory)",
    "prefix_caching": "reuse KV blocks across requests that share a prefix (default True)",
    "paged_kv": "force the paged KV cache on or off (default: on where the model supports it)",
    "draft_model": "a draft model for speculative='draft' (same tokenizer as the model; GGUF file, HF or MLX "
    "folder, HF repo id)",
    "draft_bits": "hold the draft model at fewer bits than it is stored in, so that it drafts cheaply (the model "
    "itself may then be its own draft): 4 or 8 on MLX (affine groups of 64); 8 on backend='torch' on the CPU, "
    "through the CPU's int8 matmul (about 0.3 of a float32 decode step for SmolLM2)",
    "draft_optional": "a draft model that fails to load or does not share the model's tokenizer is one of the "
    "model's warnings (ModelInfo.warnings) rather than an error, and the model loads without it (default False; "
    "the chat app, where a model picked in the app need not suit the draft named on its command line)",
    "self_draft_layers": "layers of the model that speculative='self' drafts with (default: half)",
    "threads": "backend='torch' on the CPU: torch's CPU threads (default: all the cores torch sees)",
    "compile": "backend='torch' on the CPU: run prefills (and decode steps, where they are not one native call) as "
    "torch.compile graphs, compiled at load: for SmolLM2 prefill level at 128 tokens and 1.05-1.15x at 512, the load "
    "3-4x slower and 60-85 MB more memory (default: on with packed quantized weights where the layers are not one "
    "native call; ROOFLINE_TORCH_COMPILE=0 turns the default off)",
    "cpu_kernel": "backend='torch' on the CPU: quantized weights read by Roofline's own CPU kernel, built at the first "
    "load with the system's C++ compiler (default True where it builds; False: torch's int4 and int8 kernels, "
    "slower at decode; ROOFLINE_TORCH_CPU_NATIVE=0 turns the default off)",
    "native_step": "backend='torch' on the CPU: a forward's layers (decode steps, verifications, prefills) in one call "
    "of Roofline's CPU kernel, where the model's layers allow it (default True; False: the layers as Python around "
    "the kernel's matmuls, slower at decode; ROOFLINE_TORCH_NATIVE_STEP=0 turns the default off)",
    "cuda_graphs": "backend='torch' on CUDA: replay each batched decode step as a CUDA graph (default True; "
    "False launches its kernels one by one)",
    "distributed": "'pipeline' or 'tensor': the model across the ranks mlx.launch started, this process being rank 0 "
    "(another rank serves rank 0 and ends with it; docs/distributed.md)",
    "chat_template": "a Jinja chat template to use instead of the model's own: its text, or a path (a .jinja file, "
    "or a tokenizer_config.json)",
    "max_seqs": f"sequences the scheduler runs at once, the rest waiting their turn (default {DEFAULT_MAX_SEQS}; the "
    "contiguous KV cache holds one)",
}
# the engine's own options; every other one is the runner's (`LoadOptions.runner`)
ENGINE_OPTIONS = ("chat_template", "max_seqs")


@dataclass(frozen=True)
class LoadOptions:
    """`Engine.load`'s keyword options, checked once, before anything loads: the names against `LOAD_OPTIONS`, the
    engine's own options (`max_seqs`, `chat_template`) here; the runner's (`runner`, passed to the backend as
    given) by the backend, which knows the model they apply to."""

    max_seqs: int = DEFAULT_MAX_SEQS
    chat_template: str | None = None  # the template's text or a path, read by `chat_template.read_chat_template`
    runner: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> LoadOptions:
        unknown = sorted(set(options) - set(LOAD_OPTIONS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in LOAD_OPTIONS.items())
            raise RooflineError(f"unknown Engine.load option(s) {', '.join(unknown)}. Known options: {known}")
        own = {k: options[k] for k in ENGINE_OPTIONS if k in options}
        return cls(**own, runner=MappingProxyType({k: v for k, v in options.items() if k not in ENGINE_OPTIONS}))

    def __post_init__(self) -> None:
        n = self.max_seqs
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RooflineError(f"invalid Engine.load option max_seqs={n!r}: expected an integer >= 1 "
                                f"({LOAD_OPTIONS['max_seqs']})")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise RooflineError(f"invalid Engine.load option chat_template={self.chat_template!r}: expected a "
                                "template's text or a path, as a string")
        if not isinstance(self.runner, MappingProxyType):  # frozen all the way down
            object.__setattr__(self, "runner", MappingProxyType(dict(self.runner)))


# --- what a front end may ask of an engine -----------------------------------------------------------------


@runtime_checkable
class GenerationStreamLike(Protocol):
    """`Engine.generate`'s result: GenerationEvents, the last with `finish_reason`; `close` (or leaving a for loop
    over it) cancels the request."""

    def __iter__(self) -> Iterator[GenerationEvent]: ...

    def __next__(self) -> GenerationEvent: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineLike(Protocol):
    """What a front end (TUI, server, bench) uses of an engine: the real `mlx_engine.Engine`, and the scripted fakes
    the front ends' tests run against (tests/test_engine_like.py holds every one of them to this list)."""

    info: ModelInfo
    tokenizer: Any  # mlx_engine.tokenizer.Tokenizer: encode, decode, encode_chat, id_to_piece, eos_token_ids

    def generate(self, request: GenerationRequest) -> GenerationStreamLike: ...

    def kv_stats(self) -> dict[str, Any]: ...

    def save_kv(self, path: str, request: GenerationRequest | list[int]) -> int: ...

    def restore_kv(self, path: str) -> int: ...

    def decode_bytes_per_token(self, context_tokens: int) -> int: ...

    def close(self) -> None: ...


# --- embeddings ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Embeddings:
    """`EmbedderLike.embed`'s result: one vector per input, in the order given."""

    vectors: Any  # numpy float32 (N, dimensions)
    num_tokens: tuple[int, ...]  # each input's tokens (instruction prefix and special tokens included)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_tokens)


@runtime_checkable
class EmbedderLike(EngineLike, Protocol):
    """An engine whose `info.embeddings` is True (`mlx_engine.embedding.EmbeddingEngine`): what a front end uses to
    embed. Its `generate` refuses (RequestError)."""

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
              prompt_name: str | None = None) -> Embeddings: ...
