"""The torch model runner: `backends.base.ModelRunner` over a torch model and torch KV.

The scheduler, sampler and speculative code stay shared: token ids arrive as (possibly lazy) mx arrays and
go to torch through numpy; logits come back as float32 mx arrays. What it shares with the MLX runner is in
`backends.common`; prompt handling is the engine's.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
import torch

from mlx_engine.api import ModelInfo, RooflineError
from mlx_engine.backends.torch.kv import (
    ContiguousLayer,
    DecodeStep,
    DecodeView,
    PackedView,
    PrefillView,
    TorchPagedCache,
)
from mlx_engine.backends.torch.cpu_features import DEQUANT_MIN_ROWS, cpu_support
from mlx_engine.backends.torch.host import TORCH_THREADS, peak_rss, reset_peak_rss
from mlx_engine.backends.torch.weights import build_model
from mlx_engine.backends.torch.model import GRAPH_ROWS
from mlx_engine.backends.torch import switches
from mlx_engine.backends.torch.paths import Paths
from mlx_engine.backends.torch.paths.native_step import KV_DTYPE as NATIVE_KV_DTYPE
from mlx_engine.backends.torch.paths.native_step import NOTE as NATIVE_NOTE
from mlx_engine.backends.torch.sampling import sample_rows
from mlx_engine.backends.base import RunnerCapabilities
from mlx_engine.backends.choice import TORCH_MODEL_TYPES
from mlx_engine.models.config_families import family_reason
from mlx_engine.backends.common import (CacheRunner, NoTokenizer, attach_draft, cap_context, check_self_draft_layers,
                                        entry, model_fingerprint)
from mlx_engine.backends.torch.load import (DEFAULT_CPU_THREADS, check_draft_bits, check_switch, check_threads,
                                            cpu_pack_notes, cpu_pack_plan, pick_dtype, resolve_device, use_kernels)
from mlx_engine.reasoning import reasoning_family

T = TypeVar("T")


def default_compile(packed_cpu: bool, native: bool) -> bool:
    """compile=None: on for packed CPU weights whose decode steps run as compiled graphs; off where a forward's
    layers are one native call (`native_step`), since the graphs would then serve prefills only, level with the
    native prefill at 128 tokens and 1.05-1.15x at 512, at the cost of a 3-4x slower load and 60-85 MB more peak
    memory (docs/benchmarks/torch-cpu.md, "Issue 27: the decode step in one call"); off with
    ROOFLINE_TORCH_COMPILE=0 (`switches.COMPILE`)."""
    return packed_cpu and not native and switches.COMPILE.on()


# A single sequence's prefill of at most this many positions (a speculative verification of k + 1 <= 17
# tokens, a short prompt's last chunk) replays a CUDA graph as that many decode rows
MAX_GRAPH_PREFILL = 17
# Prefill tokens per forward on CUDA: at 512 a small model's forward is bound by its eager launches, whatever its
# rows, so the chunk is large (docs/benchmarks/code-figures.md, "Measurements moved out of the code").
CUDA_PREFILL_CHUNK = 4096
# On the CPU: as fast as 512 (the GEMM's rows past ~200 buy nothing) with half the chunk's activations, which set
# the prefill's peak RSS (docs/benchmarks/torch-cpu.md, "Issue 27: the prefill's working set")
CPU_PREFILL_CHUNK = 256


def _ids(inputs: Any, device: torch.device) -> torch.Tensor:
    """Token ids (an mx array, possibly lazy, or a list) -> int64 tensor on `device`."""
    return torch.from_numpy(np.array(inputs, dtype=np.int64)).to(device)


def _torch_work(method: Callable[..., T]) -> Callable[..., T]:
    """A runner method's torch work: no autograd; on the CPU with the runner's `threads` (restored after)."""

    @functools.wraps(method)
    def run(self: TorchRunner, *args: Any, **kwargs: Any) -> T:
        TORCH_THREADS.add(threading.current_thread().name)
        with torch.inference_mode():
            before = torch.get_num_threads()
            if self.device.type != "cpu" or before == self.threads:
                return method(self, *args, **kwargs)
            torch.set_num_threads(self.threads)
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.set_num_threads(before)

    return run


def _mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.float().cpu().numpy())


def _tokens(t: torch.Tensor) -> mx.array:
    return mx.array(t.to(torch.int32).cpu().numpy())


class TorchRunner(CacheRunner):
    """The torch backend's `backends.base.ModelRunner`."""

    draft: TorchRunner | None = None  # the draft model (Engine.load(..., draft_model=...))
    self_draft_layers: int = 0

    def __init__(self, model: Any, tokenizer: Any, info: ModelInfo, prefill_chunk_size: int, device: torch.device):
        super().__init__(model, tokenizer, info, prefill_chunk_size)  # cache: a TorchPagedCache, set by load()
        self.device = device
        self.graphs: Any = None  # graphs.DecodeGraphs: the decode step as CUDA graphs (CUDA, cuda_graphs on)
        self.graphs_error: str | None = None  # why graphs went off, when a capture failed
        self.threads = DEFAULT_CPU_THREADS  # torch's CPU threads in this runner's work (load's `threads`)
        self.paths = Paths(model)  # how its forwards run: the native step and compiled graphs the load made

    @classmethod
    def load(
        cls,
        model: str | None,
        device: str = "auto",
        dtype: str | None = None,
        prefill_chunk_size: int | None = None,
        max_context: int | None = None,
        paged_kv: bool | None = None,
        draft_model: str | None = None,
        self_draft_layers: int | None = None,
        cuda_graphs: bool | None = None,
        draft_bits: int | None = None,
        draft_optional: bool = False,
        threads: int | None = None,
        compile: bool | None = None,
        native_step: bool | None = None,
        cpu_kernel: bool | None = None,
        *,
        with_cache: bool = True,
        packed_cpu: bool = True,
        **kv_options: Any,
    ) -> TorchRunner:
        """`kv_options`: KVConfig's fields (block_size, kv_bits, kv_group_size, kv_budget_bytes,
        prefix_caching, kv_key_bits, kv_key_per_channel); the quantized-KV ones are refused (the torch KV is
        unquantized). `cuda_graphs`: replay batched decode steps as CUDA graphs (default: on CUDA). `draft_bits`:
        8 holds the draft as int8 for the CPU's int8 matmul, its float projections dropped (`draft_int8.quantize_int8`).
        `threads`: torch's CPU threads (default: all cores torch sees). `packed_cpu=False` (an int8 draft, made from
        float32 weights): quantized weights dequantized to float32 even where the CPU kernels could hold them.
        `compile`: decode-sized forwards and prefills through torch.compile graphs (`paths.compiled.CompiledHalves`),
        compiled at load (default: `default_compile`). `cpu_kernel`: quantized weights for Roofline's own CPU kernel
        where it builds (default on; else torch's int4 and int8 kernels); `native_step`: a forward's layers in one
        call of it where the model's layers allow (default on; `paths.native_step`)."""
        import importlib

        from mlx_engine.kv.config import KVConfig
        from mlx_engine.loading import load_checkpoint

        dev = resolve_device(device)
        for name in ("kv_bits", "kv_key_bits", "kv_key_per_channel"):
            if kv_options.get(name) not in (None, False):
                raise RooflineError(f"{name} is not supported on the torch backend (its KV cache is unquantized): "
                                    f"leave {name} unset, or use backend='mlx'")
        if paged_kv is False:
            raise RooflineError("paged_kv=False is not supported on the torch backend: it always uses the paged KV cache")
        if cuda_graphs not in (None, True, False):
            raise RooflineError(f"cuda_graphs={cuda_graphs!r}: expected True, False or None (on CUDA: True)")
        if cuda_graphs and dev.type != "cuda":
            raise RooflineError(f"cuda_graphs=True needs device='cuda' (this runner is on {dev.type}); leave it unset")
        check_draft_bits(draft_bits, draft_model, dev, dtype)
        num_threads = check_threads(threads, dev)
        want_kernel = check_switch("cpu_kernel", cpu_kernel, switches.CPU_NATIVE)
        want_step = check_switch("native_step", native_step, switches.NATIVE_STEP)
        if prefill_chunk_size is None:
            prefill_chunk_size = CUDA_PREFILL_CHUNK if dev.type == "cuda" else CPU_PREFILL_CHUNK
        if not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
            raise RooflineError(f"prefill_chunk_size={prefill_chunk_size!r}: expected an integer >= 1")
        kv_config = KVConfig(**kv_options)
        # k-quants: packed here (weights.kquant_weight); lazy: each tensor read from the file as build_model takes it
        ckpt = load_checkpoint(model, kquant_blocks=True, lazy=True)
        model_type = ckpt.config.get("model_type")
        if model_type not in TORCH_MODEL_TYPES:
            reason = family_reason(ckpt.config)
            raise RooflineError(f"{ckpt.path}: model type {model_type!r} is not supported on the torch backend "
                                f"({reason + '; ' if reason else ''}it runs {', '.join(TORCH_MODEL_TYPES)}); "
                                "use backend='mlx'")
        args = importlib.import_module(f"mlx_engine.models.{model_type}").args_from_config(ckpt.config)
        if args.sliding_window is not None:
            raise RooflineError(f"{ckpt.path}: sliding-window attention (window {args.sliding_window}) is not "
                                "supported on the torch backend; use backend='mlx'")
        act_dtype = pick_dtype(dtype, ckpt.checkpoint_dtype, dev)
        freq_factors = ckpt.config.pop("_rope_freq_factors", None)  # GGUF llama3: per-frequency divisors
        kernels = use_kernels(dev)
        cpu, pack_warnings = cpu_pack_plan(dev, want_kernel) if packed_cpu and not kernels else (None, ())
        weights, ckpt.weights = ckpt.weights, {}  # emptied as they convert: each source array freed once converted
        tmodel = build_model(args, weights, ckpt.quantization, act_dtype, dev, str(ckpt.path), freq_factors,
                             packed=kernels, cpu=cpu)
        del weights
        paths = Paths(tmodel)
        why_not = paths.use_native_step() if cpu is not None and cpu.native and want_step else None
        native = why_not == ""
        if why_not:  # the kernel holds the weights, but the step around it runs as Python layers: say so
            pack_warnings += (f"decode steps run as Python layers around the kernel, not in one call of it "
                              f"({why_not}): slower decode (docs/benchmarks.md, issue 27)",)
        tokenizer = ckpt.tokenizer or NoTokenizer(ckpt.path, ckpt.config)
        context = args.max_position_embeddings
        context = cap_context(context, max_context)
        dtype_name = str(act_dtype).removeprefix("torch.")
        info = ModelInfo(
            name=ckpt.name, path=str(ckpt.path), model_type=model_type, source_format=ckpt.source_format,
            num_parameters=tmodel.num_parameters, quantization=ckpt.quant_label, context_length=context,
            weight_bytes=tmodel.weight_bytes, vocab_size=int(ckpt.config.get("vocab_size") or tokenizer.vocab_size),
            native=True, dtype=dtype_name, eos_token_ids=tuple(tokenizer.eos_token_ids), backend="torch",
            device=dev.type, has_tokenizer=ckpt.tokenizer is not None, reasoning=reasoning_family(tokenizer),
            notes=cpu_pack_notes(tmodel) + ((f"{num_threads} CPU threads",) if dev.type == "cpu" else ())
            + ((NATIVE_NOTE,) if native else ()),
            warnings=pack_warnings if ckpt.quantization else (),
        )
        runner = cls(tmodel, tokenizer, info, prefill_chunk_size, dev)
        runner.threads, runner.paths = num_threads, paths
        paths.on_path = runner._record_forward
        if compile not in (None, True, False):
            raise RooflineError(f"compile={compile!r}: expected True, False or None (default: on the CPU with packed "
                                "weights where the decode step is not native)")
        if compile is None:
            compile = default_compile(cpu is not None, native)
        if compile:
            from mlx_engine.backends.torch.weights import trim_heap

            note, info = runner.compile_decode(), runner.info
            trim_heap()  # what tracing and lowering freed (~30 MB of SmolLM2's compile, docs/benchmarks/torch-cpu.md)
            runner.info = (dataclasses.replace(info, warnings=(*info.warnings, note)) if runner.paths.compiled is None
                           else dataclasses.replace(info, notes=(*info.notes, note)))
            runner.warm_prefill()
        # the native step's pools hold float16, as llama.cpp's default KV: half the bytes its attention reads
        kv_dtype = NATIVE_KV_DTYPE if native else act_dtype
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        runner._shape = {"embed_bytes": tmodel.embed_bytes, "tied": args.tie_word_embeddings,
                         "layers": args.num_hidden_layers, "kv_heads": args.num_key_value_heads,
                         "head_dim": args.head_dim, "kv_itemsize": itemsize}
        runner.fingerprint = model_fingerprint(ckpt, f"torch.{dtype_name}")
        if with_cache:
            runner.cache = TorchPagedCache.create_torch(
                num_layers=args.num_hidden_layers, num_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                dtype=kv_dtype, device=dev, context_length=context, weight_bytes=tmodel.weight_bytes,
                config=kv_config, model_id=runner.fingerprint, use_kernel=kernels)
            if kernels and dev.type == "cuda" and cuda_graphs is not False:
                from mlx_engine.backends.torch.graphs import DecodeGraphs

                runner.graphs = DecodeGraphs(tmodel, runner.cache.storage)
        kv_files = runner.cache is not None and runner.cache.capabilities.kv_files
        runner.capabilities = RunnerCapabilities(rollback=True, kv_files=kv_files, self_draft=True, hidden_states=True,
                                                 max_batch=None, host_blas=False, why_not={} if kv_files else {
                                                     "kv_files": "KV files are not supported on the torch backend"})
        runner.self_draft_layers = check_self_draft_layers(self_draft_layers, len(runner.model.layers))
        if draft_model is not None:
            def load_draft() -> TorchRunner:
                draft = cls.load(draft_model, device=dev.type, dtype=dtype, prefill_chunk_size=prefill_chunk_size,
                                 threads=threads, native_step=native_step, cpu_kernel=cpu_kernel, with_cache=False,
                                 packed_cpu=draft_bits is None)
                if draft_bits is not None:
                    from mlx_engine.backends.torch.draft_int8 import quantize_int8

                    quantize_int8(draft.model)
                    draft.info = dataclasses.replace(draft.info, quantization=f"{draft.info.quantization}, int8 draft",
                                                     weight_bytes=draft.model.weight_bytes)
                return draft

            attach_draft(runner, load_draft, draft_optional)
        return runner

    def _record_forward(self, path: str) -> None:
        self.record_path(f"{path}, {torch.get_num_threads()} threads" if self.device.type == "cpu" else path)

    @_torch_work
    def compile_decode(self) -> str:
        """Compiles the decode-sized forwards (one row, and several: two graphs a part) and a prefill's (more
        rows) by running them once on scratch caches. Returns the note to show, or the warning when compiling
        failed (then all runs eager)."""
        import gc
        import time

        from mlx_engine.backends.torch.inductor import compile_errors
        from mlx_engine.backends.torch.weights import trim_heap

        start = time.perf_counter()
        self.paths.compile(GRAPH_ROWS)
        try:
            layers = self.scratch_layers()  # a prefill's rows, then 3 (the graphs of 2..max rows), then 1
            for rows in (max(GRAPH_ROWS + 1, DEQUANT_MIN_ROWS), 3, 1):
                h = self.paths(torch.zeros(1, rows, dtype=torch.long, device=self.device), layers)
                if rows <= GRAPH_ROWS:  # a prefill's logits are its last row's (the one-row graph)
                    self.paths.logits(h[0])
                gc.collect()  # each batch's tracing and lowering, freed before the next one's (the load's peak)
                trim_heap()
        except compile_errors() as e:
            self.paths.compiled = None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"torch.compile failed here, so decode and prefill run eagerly (slower): {first[:200]}"
        self.paths.compiled.warmed()
        what = "prefills and the output head" if self.paths.native is not None else "decode steps and prefills"
        return f"{what} compiled by torch.compile in {time.perf_counter() - start:.0f} s"

    @_torch_work
    def warm_prefill(self) -> None:
        """One forward of a prefill's rows on scratch caches, so that the dequantizing GEMM path compiles its
        slices (`cpu_gemm`) at load rather than in the first prompt; none where the prefill's layers are
        compiled graphs (`compile_decode` compiled them with those slices inside)."""
        if self.device.type != "cpu" or not cpu_support().bf16_gemm or self.paths.compiled is not None:
            return
        self.paths(torch.zeros(1, DEQUANT_MIN_ROWS, dtype=torch.long, device=self.device), self.scratch_layers())

    # --- forwards (engine thread) ---

    def scratch_layers(self) -> list[ContiguousLayer]:
        return [ContiguousLayer() for _ in self.model.layers]

    @_torch_work
    def forward(self, inputs: Any, layers: list[Any]) -> torch.Tensor:
        """inputs (B, L) -> final hidden states (B, L, hidden), a torch tensor (K/V written to `layers`)."""
        return self.paths(_ids(inputs, self.device), layers)

    @entry("prefill")
    def prefill(self, inputs: Any, layers: list[Any]) -> None:
        self.forward(inputs, layers)

    def _graph_step(self, layers: list[Any]) -> DecodeStep | None:
        """The step a CUDA graph can replay, as rows of a decode step: `layers` are a decode step's views
        (`decode_layers`), packed views holding only decode rows (`packed_layers`), or one sequence's prefill
        of at most MAX_GRAPH_PREFILL positions (a speculative verification), one row per position."""
        if self.graphs is None or not layers:
            return None
        view = layers[0]
        if isinstance(view, PackedView) and not view.prefills and view.decode is not None:
            view = view.decode
        if isinstance(view, DecodeView) and self.graphs.supports(len(view.step.tables)):
            return view.step
        if isinstance(view, PrefillView) and view.num_new <= MAX_GRAPH_PREFILL:
            return view.as_decode_step()
        return None

    def _graph_logits(self, inputs: Any, step: DecodeStep) -> torch.Tensor | None:
        """The step's logits (B, V) from its CUDA graph; None when capturing fails (a torch or driver that
        cannot capture some kernel): then graphs stay off for this runner, with a warning, and the step runs
        eagerly (its K/V writes are idempotent)."""
        try:
            logits = self.graphs.logits(np.array(inputs, dtype=np.int64).reshape(-1), step)
            self.record_path("cuda-graph")
            return logits
        except RuntimeError as e:
            import warnings

            self.graphs, self.graphs_error = None, f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graphs are off for this model: capturing the decode step failed ({e}); decoding "
                          "continues with eager launches", RuntimeWarning, stacklevel=2)
            return None

    def graph_step(self, width: int, context: int) -> Callable[[], bool] | None:
        """One graphed step of `width` rows after `context` cached tokens, logits to the host, as a call to time
        (`speculative.timing.time_graph_forward`); it returns False once a capture failed (graphs are off).
        Every row reads and writes the pool's scratch block only. None while graphs are off."""
        if self.graphs is None:
            return None
        storage = self.cache.storage
        bs, scratch = storage.block_size, storage.scratch_block
        nblocks = -(-(context + width) // bs)
        step = DecodeStep(storage, [context + i for i in range(width)],
                          [scratch * bs + (context + i) % bs for i in range(width)], [[scratch] * nblocks] * width)
        ids = np.zeros(width, dtype=np.int64)
        return lambda: self._graph_logits_to_host(ids, step)

    @_torch_work
    def _graph_logits_to_host(self, ids: np.ndarray, step: DecodeStep) -> bool:
        logits = self._graph_logits(ids, step)
        if logits is None:
            return False
        mx.eval(_mx(logits))
        return True

    def _last_logits(self, inputs: Any, layers: list[Any]) -> torch.Tensor:
        step = self._graph_step(layers)
        logits = None if step is None else self._graph_logits(inputs, step)
        if logits is not None:  # a prefill's rows are one sequence's positions: its last
            return logits[-1:] if isinstance(layers[0], PrefillView) else logits
        h = self.forward(inputs, layers)
        return self.paths.logits(h[:, -1, :])

    def _rows_logits(self, inputs: Any, layers: list[Any], rows: list[int]) -> torch.Tensor | None:
        step = self._graph_step(layers)  # a step of decode rows only: rows (1, B) -> a graph's batch of B
        logits = None if step is None else self._graph_logits(inputs, step)
        if logits is not None:
            return logits[rows] if rows else None
        h = self.forward(inputs, layers)  # eager: the K/V writes are done
        return self.paths.logits(h[0, rows]) if rows else None

    def timing_variant(self) -> str:
        return "-cuda-graphs" if self.graphs is not None else ""  # graphed steps: another forward

    @entry("decode_logits")
    @_torch_work
    def decode_logits(self, inputs: Any, layers: list[Any]) -> mx.array:
        return _mx(self._last_logits(inputs, layers))

    prefill_logits = entry("prefill_logits")(decode_logits)

    @entry("packed_logits")
    @_torch_work
    def packed_logits(self, inputs: Any, layers: list[Any], rows: list[int]) -> mx.array | None:
        logits = self._rows_logits(inputs, layers, rows)
        return None if logits is None else _mx(logits)

    @entry("decode_sample")
    @_torch_work
    def decode_sample(self, inputs: Any, layers: list[Any], samplers: list[Any]) -> mx.array:
        """Tokens drawn on the device (`backends.torch.sampling`): B token ids to the host instead of B x V
        logits, and no per-row draw in MLX on the CPU."""
        return _tokens(sample_rows(self._last_logits(inputs, layers), samplers))

    @entry("packed_sample")
    @_torch_work
    def packed_sample(self, inputs: Any, layers: list[Any], rows: list[int],
                      samplers: list[Any]) -> mx.array | None:
        logits = self._rows_logits(inputs, layers, rows)
        return None if logits is None else _tokens(sample_rows(logits, samplers))

    @entry("verify_logits")
    @_torch_work
    def verify_logits(self, inputs: Any, layers: list[Any]) -> mx.array:
        step = self._graph_step(layers)
        logits = None if step is None or not isinstance(layers[0], PrefillView) else self._graph_logits(inputs, step)
        if logits is not None:
            return _mx(logits)
        h = self.forward(inputs, layers)
        return _mx(self.paths.logits(h[0]))

    @entry("draft_logits")
    @_torch_work
    def draft_logits(self, inputs: Any, layers: list[Any], num_layers: int) -> mx.array:
        h = self.paths(_ids(inputs, self.device), layers, num_layers=num_layers)
        return _mx(self.paths.logits(h[:, -1, :]))

    @entry("forward_logits")
    @_torch_work
    def forward_logits(self, ids: list[int]) -> np.ndarray:
        h = self.paths(_ids([ids], self.device))
        return self.paths.logits(h[0]).float().cpu().numpy()

    @entry("hidden_states")
    @_torch_work
    def hidden_states(self, ids: list[int]) -> list[np.ndarray]:
        """[embedding output, output of each decoder layer], each (T, hidden) float32, from a fresh forward."""
        return [h[0].float().cpu().numpy() for h in self.paths.layer_outputs(_ids([ids], self.device))]

    @entry("score")
    @_torch_work
    def score(self, ids: list[int]) -> np.ndarray:
        """log p(ids[t+1] | ids[..t]) for every t, in prefill chunks -> float32 (T - 1,). The KV is unquantized
        here, so buffers of its own give what the block pool would."""
        layers, out = self.scratch_layers(), []
        for start in range(0, len(ids) - 1, self.prefill_chunk_size):
            end = min(start + self.prefill_chunk_size, len(ids) - 1)
            h = self.paths(_ids([ids[start:end]], self.device), layers)
            logp = torch.log_softmax(self.paths.logits(h[0]).float(), dim=-1)  # (L, V)
            target = _ids(ids[start + 1:end + 1], self.device)
            out.append(logp.gather(-1, target[:, None])[:, 0].cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _free_device_memory(self) -> None:
        self.paths = None  # it holds the model, and the native step the weights' tensors
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()

    def peak_memory_bytes(self) -> int:
        """CUDA: the peak torch allocated on the device since the last reset. CPU: the process's peak
        resident memory since the last reset (`peak_rss`: it counts everything in the process)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return peak_rss()
