"""The runner contract: what the engine, the scheduler, speculative decoding and the distributed runner ask of a
model runner. The scheduler hands `ModelRunner.execute` a plain-data plan (`mlx_engine.step`); the phase forwards
below (`PhaseForwards`) serve the plan's executor (`backends.phases`), the proposers and the timers; whole-sequence
work is `SequenceWork` (`backends.mlx.runner.Runner`, `backends.torch.runner.TorchRunner`,
`distributed.runner.DistributedRunner` are all three, each reached through its typed accessor). A runner declares
what it can do (`RunnerCapabilities`); callers read the declaration, never probe the object.

Forwards are named by the phase they serve. Inputs are (B, L) token ids (an mx array, possibly lazy); `layers` are
the per-layer views of the engine's KV cache (`kv.protocol.KVCache`) or of `scratch_layers`. Logits come back as
float32 mx arrays and tokens as int32 mx arrays, whatever device computed them, lazily where the backend is lazy.

- `prefill`: a prompt chunk that samples nothing (its K/V writes; evaluate `cache.state(layers)`).
- `prefill_logits`: a prompt's last chunk, logits of its last position (the first token).
- `decode_logits` / `decode_sample`: one new token per sequence, logits or tokens of each row.
- `packed_logits` / `packed_sample`: one forward over (1, T) rows (`KVCapabilities.packed`: decode rows and
  prefill chunks packed; or one sequence's chunk whose every row scores its prompt), logits or tokens of `rows`.
- `verify_logits`: a speculative verification, logits of every position.
- `draft_logits`: the self draft, the first `num_layers` layers + head, logits of the last position.

Prompt handling (token ids, their checks against the vocabulary and context, the speculation a request asks for)
runs on the caller's thread in the engine, from the attributes below; everything else runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mlx_engine.api import ModelInfo

if TYPE_CHECKING:
    from mlx_engine.kv.protocol import KVCache
    from mlx_engine.step import StepPlan, StepResult


@dataclass(frozen=True)
class RunnerCapabilities:
    rollback: bool  # its KV rolls back past rejected drafts at every length: speculative decoding
    kv_files: bool  # `save_kv` / `restore_kv` (`ModelInfo.kv_files`)
    self_draft: bool  # speculative='self': `draft_logits` over the model's first layers
    hidden_states: bool  # `hidden_states`: each decoder layer's output
    max_batch: int | None  # sequences one step may hold (None: as many as the scheduler's max_seqs)
    # for a capability declared False: why, as the user is told it ("rollback": a clause after the model's name;
    # "self_draft", "hidden_states": a predicate after "speculative='self'" / "hidden states")
    why_not: Mapping[str, str] = field(default_factory=dict)
    # > 1: the runner is an `InFlightDecode` (a pipeline of that many ranks): the scheduler may step the decoding
    # sequences in that many groups in turn, each group's step in flight while the others' run
    decode_groups: int = 1
    # its steps may call numpy's BLAS (MLX's CPU backend's host GEMMs, `backends.mlx.host_blas`): the engine caps
    # that BLAS at one thread around each step (threadpoolctl, about 33 us a step and 2 MB of RSS on first use)
    host_blas: bool = True

    def reason(self, name: str) -> str:
        return self.why_not.get(name, f"this runner does not support {name}")


@runtime_checkable
class InFlightDecode(Protocol):
    """A runner whose `RunnerCapabilities.decode_groups` is above 1 (a pipeline): a plain decode forward only
    starts (`launch`: decode rows alone, views from `decode_layers`, or `packed_layers` without prefill chunks), and
    its sampled tokens come back from a later call, once `decode_groups - 1` others are in flight, with the `tag`
    it was launched with. Any other forward finishes the ones in flight first; their tokens wait for the next
    `launch` or `settle`."""

    def launch(self, inputs: Any, layers: list[Any], samplers: list[Any], tag: Any) -> list[tuple[Any, Any]]:
        """Starts a decode forward; returns (tag, tokens) of each forward finished since the last call, oldest
        first, the tokens (B,) int32 and evaluated."""
        ...

    def settle(self) -> list[tuple[Any, Any]]:
        """Finishes every forward in flight; (tag, tokens) of each not yet returned, oldest first."""
        ...


@runtime_checkable
class PhaseForwards(Protocol):
    """A runner's forwards by phase (see the module's docstring), and what times them: what the plan executor
    (`backends.phases`), the speculative proposers and the timers call (`ModelRunner.forwards`)."""

    info: ModelInfo
    cache: KVCache | None
    vocab_size: int
    prefill_chunk_size: int
    fingerprint: bytes  # the weights' and activation dtype's identity (`backends.common.model_fingerprint`)
    self_draft_layers: int  # layers speculative='self' drafts with

    def prefill(self, inputs: Any, layers: list[Any]) -> None: ...

    def prefill_logits(self, inputs: Any, layers: list[Any]) -> Any: ...

    def decode_logits(self, inputs: Any, layers: list[Any]) -> Any: ...

    def decode_sample(self, inputs: Any, layers: list[Any], samplers: list[Any]) -> Any: ...

    def packed_logits(self, inputs: Any, layers: list[Any], rows: list[int]) -> Any | None: ...

    def packed_sample(self, inputs: Any, layers: list[Any], rows: list[int], samplers: list[Any]) -> Any | None: ...

    def verify_logits(self, inputs: Any, layers: list[Any]) -> Any: ...

    def draft_logits(self, inputs: Any, layers: list[Any], num_layers: int) -> Any: ...

    def scratch_layers(self) -> list[Any]:
        """Fresh contiguous KV outside the cache, one per layer (a draft model's per sequence, timing forwards)."""
        ...

    # --- timing (speculative.timing, speculative.cost) ---

    def graph_step(self, width: int, context: int) -> Callable[[], bool] | None:
        """One replayed step of `width` rows after `context` tokens, as a call to time that returns False once
        replaying failed; None where this runner replays no steps (no CUDA graphs)."""
        ...

    def timing_variant(self) -> str:
        """What else a forward's speed depends on here, for keying measured timings ('' where nothing does)."""
        ...

    def forward_paths(self) -> dict[str, int]:
        """Forwards run since load, counted by how they ran: "<entry>: <path>, <thread>" (the forward entry the
        plan executor called, the backend's execution path with its CPU threads where it sets them, and the thread
        that ran it); what `Engine.diagnostics().execution()` reports."""
        ...


@runtime_checkable
class SequenceWork(Protocol):
    """Work on a whole sequence outside the scheduler's steps (engine thread; `ModelRunner.sequences`)."""

    def forward_logits(self, ids: list[int]) -> Any: ...

    def hidden_states(self, ids: list[int]) -> list[Any]: ...

    def score(self, ids: list[int]) -> Any: ...

    def decode_bytes_per_token(self, context: int) -> int: ...

    def moe_routing(self) -> dict[str, Any] | None: ...  # a mixture-of-experts model's routed decode steps

    def kv_stats(self) -> dict[str, Any]: ...

    def save_kv(self, path: str, token_ids: list[int]) -> int: ...

    def restore_kv(self, path: str) -> list[int]: ...


@runtime_checkable
class ModelRunner(Protocol):
    """What the engine and the scheduler ask of a runner: its model's facts, `execute` for each step, and typed
    access to its forwards and its whole-sequence work."""

    info: ModelInfo
    tokenizer: Any  # tokenizer.Tokenizer, or backends.common.NoTokenizer
    cache: KVCache | None  # None once released, or in a draft model that keeps KV of its own
    capabilities: RunnerCapabilities
    vocab_size: int
    context_length: int
    prefill_chunk_size: int
    eos_ids: frozenset[int]
    draft: ModelRunner | None  # the draft model (load option draft_model)

    def execute(self, plan: StepPlan) -> StepResult:
        """The scheduler's step (`step.StepPlan`), through its forwards (`backends.phases`)."""
        ...

    def forwards(self) -> PhaseForwards: ...

    def sequences(self) -> SequenceWork: ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory_bytes(self) -> int: ...

    def release(self) -> None: ...
